"""Checks on what the binding hands to C through ctypes, which does none of them itself:
integers must fit their C type (ctypes wraps them silently: step=2**63 became -2**63 and
at_step=2**70 became 0), text must hold no NUL byte (a C string ends at the first, so the
rest was silently dropped), and numpy arrays C reads through a typed pointer must be
aligned for their type (reading a misaligned int32 is undefined behaviour in C)."""

from __future__ import annotations

import math
import operator
import os

import numpy as np

from . import errors

INT32 = ("int32", -2**31, 2**31 - 1)
INT64 = ("int64", -2**63, 2**63 - 1)
UINT64 = ("uint64", 0, 2**64 - 1)
SIZE_T = ("size_t", 0, 2**64 - 1)


def _bound(x):
    """2^31 - 1 as text for messages ("2^31 - 1", "-2^63", "0")."""
    for e in (31, 63, 64):
        if x == 2**e - 1:
            return "2^%d - 1" % e
        if x == -2**e:
            return "-2^%d" % e
    return str(x)


def integer(value, name, ctype, lo=None, hi=None):
    """`value` as a Python int that fits `ctype` (INT32, INT64, UINT64, SIZE_T) and
    [lo, hi] when given. Integers of any kind (numpy's too) and integral floats are
    taken; anything else is TypeError, a fraction or a value out of range RangeError (a
    ValueError) naming the argument, the value and the range."""
    cname, cmin, cmax = ctype
    lo = cmin if lo is None else max(lo, cmin)
    hi = cmax if hi is None else min(hi, cmax)
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("%s must be an integer, got a bool (%r)" % (name, value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != math.floor(value):
            raise errors.RangeError("%s must be an integer, got %r" % (name, value), errors.ERANGE)
        value = int(value)
    else:
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError("%s must be an integer, got %s" % (name, type(value).__name__)) from None
    if not lo <= value <= hi:
        raise errors.RangeError("%s is %d; it must be in [%s, %s] (the C %s it is passed as)"
                                % (name, value, _bound(lo), _bound(hi), cname), errors.ERANGE)
    return value


def number(value, name):
    """`value` as a float (C double); a non-number is TypeError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("%s must be a number, got a bool (%r)" % (name, value))
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError("%s must be a number, got %s" % (name, type(value).__name__)) from None


def c_text(value, name):
    """`value` (str, UTF-8 encoded, or bytes) as bytes for a C string: a NUL byte would end
    it there and drop the rest, so one is refused (InvalidArgumentError)."""
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    at = data.find(b"\0")
    if at >= 0:
        raise errors.InvalidArgumentError(
            "%s holds a NUL byte at offset %d; C reads a string only up to its first NUL, so "
            "the rest would be silently dropped" % (name, at))
    return data


def c_path(path, name="path"):
    """A file system path (str, bytes or os.PathLike) as bytes for C, without NUL."""
    try:
        data = os.fsencode(path)
    except TypeError:
        raise TypeError("%s must be a path (str, bytes or os.PathLike), got %s"
                        % (name, type(path).__name__)) from None
    return c_text(data, name)


def aligned(arr):
    """`arr`, or an aligned copy of it when its data or strides are not aligned for its
    type (numpy allows such views, e.g. np.frombuffer at an odd offset; C may not read
    them through an int32 or uint16 pointer)."""
    return arr if arr.flags.aligned else np.array(arr, copy=True, order="C")
