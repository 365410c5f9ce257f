"""The policies a config can find (list_policies) and one policy described as a scheduler
would load it (describe_policy), without making a scheduler."""

from __future__ import annotations

import ctypes
import json

from . import _args, _lib, errors
from ._context import Context
from .config import Config


def list_policies(config):
    """The policies found on the search path (the config's policy.search_path,
    RP_POLICY_PATH, the shipped ones), each a dict of name, version, api, description,
    path, hash and shadowed (an earlier directory has one of the same name)."""
    lib = _lib.require_scheduler()
    ctx = Context()
    cfg = Config(config, ctx)
    infos = ctypes.POINTER(_lib.rp_policy_info)()
    count = ctypes.c_int32()
    err = _lib.new_error()
    st = lib.rp_policy_list(ctx.handle, cfg.handle, ctypes.byref(infos),
                            ctypes.byref(count), ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err)
    try:
        out = []
        for i in range(count.value):
            p = infos[i]
            out.append({"name": _lib.text(p.name), "version": _lib.text(p.version),
                        "api": p.api, "description": _lib.text(p.description),
                        "path": _lib.text(p.path), "hash": "%016x" % p.hash,
                        "shadowed": bool(p.shadowed)})
        return out
    finally:
        lib.rp_text_free(ctx.handle, ctypes.cast(infos, ctypes.c_void_p))
        cfg.free()


def describe_policy(name_or_path, config):
    """Load a policy (a name on the search path, or a path), check it as a scheduler
    would, and describe it: name, version, api, description, path, hash, has_init and
    its params with types, defaults and ranges."""
    lib = _lib.require_scheduler()
    if not _lib.has("rp_policy_describe"):
        raise errors.NotSupportedError("this libroutepack has no rp_policy_describe")
    ctx = Context()
    cfg = Config(config, ctx)
    try:
        ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
        err = _lib.new_error()
        st = lib.rp_policy_describe(ctx.handle, cfg.handle,
                                    _args.c_path(name_or_path, "policy"), ctypes.byref(ptr),
                                    ctypes.byref(length), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        return json.loads(_lib.take_text(ctx.handle, ptr, length))
    finally:
        cfg.free()
