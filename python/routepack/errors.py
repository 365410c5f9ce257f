"""The exceptions of the binding: one class per rp_status, plus two classes for where an
error came from (the config, the routing input), each carrying the C library's message."""

from __future__ import annotations

# rp_status values (core/include/routepack/base.h); codes are appended, never renumbered.
OK = 0
EINVAL = 1
ENOMEM = 2
EIO = 3
EFORMAT = 4
ERANGE = 5
ENOTSUP = 6
EPOLICY = 7
ELIMIT = 8
ETRANSPORT = 9
ECHECKSUM = 10
ETIMEOUT = 11
EPLAN = 12

STATUS_NAMES = {
    OK: "RP_OK", EINVAL: "RP_EINVAL", ENOMEM: "RP_ENOMEM", EIO: "RP_EIO",
    EFORMAT: "RP_EFORMAT", ERANGE: "RP_ERANGE", ENOTSUP: "RP_ENOTSUP",
    EPOLICY: "RP_EPOLICY", ELIMIT: "RP_ELIMIT", ETRANSPORT: "RP_ETRANSPORT",
    ECHECKSUM: "RP_ECHECKSUM", ETIMEOUT: "RP_ETIMEOUT", EPLAN: "RP_EPLAN",
}


class Error(Exception):
    """Base of every error the binding raises.

    ``message`` is the C library's text (the ``rp_error.text`` of the failed call, or
    ``rp_sched_errmsg``); ``status`` the ``rp_status`` code; ``sequence``, ``expert``,
    ``line``, ``column`` and ``offset`` repeat the location the C library gave, ``None``
    where it does not apply."""

    default_status = EINVAL

    def __init__(self, message, status=None, *, sequence=None, expert=None, line=None,
                 column=None, offset=None):
        super().__init__(message)
        self.message = message
        self.status = self.default_status if status is None else int(status)
        self.sequence = sequence
        self.expert = expert
        self.line = line
        self.column = column
        self.offset = offset

    @property
    def status_name(self):
        return STATUS_NAMES.get(self.status, "status %d" % self.status)

    def __str__(self):
        return self.message


class InvalidArgumentError(Error, ValueError):
    """RP_EINVAL: an argument or an input value is invalid."""
    default_status = EINVAL


class OutOfMemoryError(Error, MemoryError):
    """RP_ENOMEM: an allocation failed."""
    default_status = ENOMEM


class FileError(Error, OSError):
    """RP_EIO: a file could not be opened, read or written."""
    default_status = EIO

    def __init__(self, message, status=None, **where):
        Error.__init__(self, message, status, **where)

    def __str__(self):
        return self.message


class FormatError(Error, ValueError):
    """RP_EFORMAT: a file or text is malformed (bad magic, syntax, truncation)."""
    default_status = EFORMAT


class RangeError(Error, ValueError):
    """RP_ERANGE: a value is out of range, or sizes overflow."""
    default_status = ERANGE


class NotSupportedError(Error):
    """RP_ENOTSUP: not supported by this build or this version."""
    default_status = ENOTSUP


class PolicyError(Error):
    """RP_EPOLICY: a policy failed to load or run (error, invalid metadata)."""
    default_status = EPOLICY


class LimitError(PolicyError):
    """RP_ELIMIT: a policy hit a sandbox limit (instructions, wall time, memory, depth)."""
    default_status = ELIMIT


class TransportError(Error):
    """RP_ETRANSPORT: a transport failed."""
    default_status = ETRANSPORT


class ChecksumError(Error):
    """RP_ECHECKSUM: data does not match its checksum."""
    default_status = ECHECKSUM


class DeadlineError(Error, TimeoutError):
    """RP_ETIMEOUT: a deadline passed."""
    default_status = ETIMEOUT

    def __init__(self, message, status=None, **where):
        Error.__init__(self, message, status, **where)

    def __str__(self):
        return self.message


class PlanError(Error):
    """RP_EPLAN: a plan is invalid."""
    default_status = EPLAN


class ConfigError(Error, ValueError):
    """The config could not be read or is invalid (any status: RP_EIO for a missing file,
    RP_EFORMAT for JSON syntax, RP_EINVAL/RP_ERANGE for a bad key or value). ``status``
    tells which; the message gives file:line:column and the JSON path."""


class RoutingError(Error, ValueError):
    """The routing replay or the sequence lengths of a step are unusable: wrong shape,
    dtype or device, or an expert id out of range (``sequence`` and ``expert`` name it)."""


class LibraryError(Error, OSError):
    """libroutepack could not be found or loaded, or lacks a function the binding needs."""
    default_status = ENOTSUP

    def __init__(self, message, status=None, **where):
        Error.__init__(self, message, status, **where)

    def __str__(self):
        return self.message


_BY_STATUS = {
    EINVAL: InvalidArgumentError, ENOMEM: OutOfMemoryError, EIO: FileError,
    EFORMAT: FormatError, ERANGE: RangeError, ENOTSUP: NotSupportedError,
    EPOLICY: PolicyError, ELIMIT: LimitError, ETRANSPORT: TransportError,
    ECHECKSUM: ChecksumError, ETIMEOUT: DeadlineError, EPLAN: PlanError,
}


def class_for_status(status):
    """The exception class for an rp_status code (Error for an unknown code)."""
    return _BY_STATUS.get(int(status), Error)
