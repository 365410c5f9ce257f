"""An rp_context owned by Python, with the library's log hook sent to the `routepack`
logger. Every C object is created in one and keeps it alive until it is freed."""

from __future__ import annotations

import ctypes
import logging

from . import _lib, errors

logger = logging.getLogger("routepack")

_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}
_NAMES = {"debug": 0, "info": 1, "warning": 2, "warn": 2, "error": 3}


def _log(ud, level, message):
    # Called from C (possibly from a library thread; ctypes takes the GIL). Never raise.
    try:
        logger.log(_LEVELS.get(level, logging.ERROR), "%s", _lib.text(message))
    except Exception:
        pass


_LOG_CALLBACK = _lib.LOG_FN(_log)   # one for the process: it must outlive every context


class Owned:
    """One C object owned from Python, freed exactly once, and never before the objects
    created from it. Garbage collection may finalise a whole cycle in any order (a
    context before the trace made in it), so each object counts its live dependents and
    a dropped object is freed only when the last of them is gone."""

    def __init__(self, handle, free_fn, parents=()):
        self.handle = handle
        self._free_fn = free_fn
        self._parents = tuple(parents)
        self._children = 0
        self._dropped = False
        for p in self._parents:
            p._children += 1

    def close(self):
        """Drop this object: freed now, or when its last dependent is freed."""
        self._dropped = True
        self._try_free()

    def _try_free(self):
        if not (self._dropped and self._children == 0 and self.handle):
            return
        h, self.handle = self.handle, None
        try:
            self._free_fn(h)
        finally:
            for p in self._parents:
                p._children -= 1
                p._try_free()

    def release(self):
        """The C side took the object (freed it, or reused its storage for a new one):
        forget the handle without freeing it, and let the parents go."""
        if not self.handle:
            return
        self.handle = None
        self._dropped = True
        for p in self._parents:
            p._children -= 1
            p._try_free()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Context(Owned):
    """Owns one rp_context. `log_level` ('debug', 'info', 'warning', 'error' or None to
    drop everything) filters what reaches the `routepack` logger."""

    def __init__(self, log_level="warning"):
        lib = _lib.load()
        if log_level is not None and log_level not in _NAMES:
            raise errors.InvalidArgumentError(
                "log_level must be one of debug, info, warning, error or None, got %r"
                % (log_level,))
        handle = ctypes.c_void_p()
        st = lib.rp_context_new(None, None, ctypes.byref(handle))
        if st != errors.OK:
            _lib.raise_error(st, message="cannot create a RoutePack context")
        super().__init__(handle, lib.rp_context_free)
        if log_level is not None:
            lib.rp_context_set_log(handle, _LOG_CALLBACK, None, _NAMES[log_level])
