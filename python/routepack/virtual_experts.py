"""The per-forward offload plan of Megatron-Core's virtual-expert balancer (MoonEP) for one
EP group: core/virtual_experts.c (rp_vexp_plan) through ctypes. docs/baselines.md,
"Virtual experts (MoonEP)", gives the algorithm; routepack.torch.VirtualExpertBalancer
uses it as a stand-in for the trainer's balancer."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import _lib, errors
from ._context import Context


@dataclass
class OffloadPlan:
    """One forward's plan for an EP group of W ranks and E experts (n = E / W per rank).

    ``rank_load``: int64 [W], token-choices each rank computes (the group's mean; a
    remainder to the lowest ranks); ``allocation``: int64 [E, W], choices of expert e
    computed on rank r; ``slot_expert``: int32 [W, n], the expert whose weights fill
    virtual slot s of rank r (-1: unused), larger allocations first; ``traffic``: int64
    [W, W], choices rank src sends to rank dst (each expert's choices, ordered by source
    rank, fill its destinations in rank order); ``pushes_out`` / ``pushes_in``: int32 [W],
    virtual experts each rank pushes as owner / receives."""

    rank_load: np.ndarray
    allocation: np.ndarray
    slot_expert: np.ndarray
    traffic: np.ndarray
    pushes_out: np.ndarray
    pushes_in: np.ndarray

    @property
    def num_virtual(self):
        return int((self.slot_expert >= 0).sum())


def plan_forward(counts, owner=None):
    """The offload plan of one forward. ``counts``: int [W, E], the token-choices EP rank
    src routes to expert e; ``owner``: int [E], the EP rank holding each expert (None:
    contiguous, e // (E / W)); every rank must own E / W experts. Raises
    InvalidArgumentError (W outside 2..64, E not a multiple of W, negative counts, uneven
    ownership) or RangeError (a rank's total beyond 2^31 - 1), with the C message."""
    counts = np.ascontiguousarray(counts, dtype=np.int32)
    if counts.ndim != 2:
        raise errors.InvalidArgumentError("counts must be [ep_size, num_experts], got shape %s"
                                          % (counts.shape,))
    W, E = counts.shape
    lib = _lib.load()
    ctx = Context(log_level=None)
    err = _lib.rp_error()
    handle = ctypes.c_void_p()
    st = lib.rp_vexp_new(ctx.handle, W, E, ctypes.byref(handle), ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err)
    try:
        own = None
        if owner is not None:
            own = np.ascontiguousarray(owner, dtype=np.int32)
            if own.shape != (E,):
                raise errors.InvalidArgumentError("owner must be [num_experts] = [%d], got shape %s"
                                                  % (E, own.shape))
        st = lib.rp_vexp_plan(handle, counts.ctypes.data_as(_lib.PI32),
                              own.ctypes.data_as(_lib.PI32) if own is not None else None,
                              ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        n = E // W

        def copy(ptr, shape):
            return np.ctypeslib.as_array(ptr, shape=shape).copy()

        return OffloadPlan(copy(lib.rp_vexp_rank_load(handle), (W,)),
                           copy(lib.rp_vexp_allocation(handle), (E, W)),
                           copy(lib.rp_vexp_slot_expert(handle), (W, n)),
                           copy(lib.rp_vexp_traffic(handle), (W, W)),
                           copy(lib.rp_vexp_pushes_out(handle), (W,)),
                           copy(lib.rp_vexp_pushes_in(handle), (W,)))
    finally:
        lib.rp_vexp_free(handle)
        ctx.close()
