"""A step's expert migration plan (rp_sched_migration, core/include/routepack/migrate.h)
copied into numpy, so that a trainer can execute the moves with its own communicator
(torch.distributed). The contract is docs/migration.md, "With the scheduler"."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import _lib, errors

LINK_NAMES = _lib.LINK_NAMES


def _dtype_of(struct):
    """The numpy dtype laid out exactly as the ctypes Structure (offsets, padding, size),
    so that an array of the C structs is read without converting field by field."""
    names, formats, offsets = [], [], []
    for name, ctype in struct._fields_:
        names.append(name)
        formats.append(np.dtype(ctype))
        offsets.append(getattr(struct, name).offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": ctypes.sizeof(struct)})


# One record per rp_migration_transfer / rp_migration_write, fields as in migrate.h.
TRANSFER_DTYPE = _dtype_of(_lib.rp_migration_transfer)
WRITE_DTYPE = _dtype_of(_lib.rp_migration_write)


@dataclass(frozen=True, repr=False)
class Migration:
    """The migration of one step: from the placement in effect before the step to the
    step's (docs/migration.md). Everything is a copy; it stays valid after later steps.

    ``hash``: XXH64 of the plan (rp_migration_plan_hash; every rank gets the same).
    ``summary``: rp_migration_summary as a dict; ``summary["bytes"]`` is a dict of bytes
    copied by link name ("local", "nvlink", "net").
    ``layer_round``: int32 [num_layers], the round that moves each layer, -1 where the
    layer moves nothing. ``expert_bytes``: int64 [num_layers], bytes of one expert.
    ``transfers``: structured array (TRANSFER_DTYPE) of rp_migration_transfer in execution
    order (round, layer, EP group, destination EP rank, slot): round, layer, expert,
    src_gpu, src_slot (local slot on the source GPU), dst_gpu, link (index into
    LINK_NAMES), bytes. ``writes``: structured array (WRITE_DTYPE) of rp_migration_write:
    local slot ``slot`` of GPU ``gpu`` at ``layer`` receives the bytes of
    ``transfers[transfer]``."""

    hash: int
    summary: dict
    layer_round: np.ndarray
    expert_bytes: np.ndarray
    transfers: np.ndarray
    writes: np.ndarray

    @property
    def num_rounds(self):
        return self.summary["num_rounds"]

    def __repr__(self):
        s = self.summary
        return ("Migration(hash=%016x, moved_bytes=%d, transfers=%d, writes=%d, rounds=%d)"
                % (self.hash, s["moved_bytes"], s["transfers"], s["writes"], s["num_rounds"]))


def _records(lib, mp, count, getter, struct, dtype):
    n = int(count(mp))
    if n <= 0:
        return np.zeros(0, dtype=dtype)
    buf = (struct * n)()
    err = _lib.new_error()
    for i in range(n):
        st = getter(mp, i, ctypes.byref(buf[i]), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
    return np.frombuffer(buf, dtype=dtype, count=n).copy()


def copy_plan(lib, mp):
    """A Migration holding a copy of the borrowed rp_migration_plan `mp` (not NULL)."""
    raw = _lib.rp_migration_summary()
    lib.rp_migration_plan_summary(mp, ctypes.byref(raw))
    summary = {"bytes": {name: int(raw.bytes[i]) for i, name in enumerate(LINK_NAMES)}}
    for name, _ in _lib.rp_migration_summary._fields_[1:]:
        summary[name] = getattr(raw, name)
    L = lib.rp_migration_plan_num_layers(mp)
    layer_round = np.array([lib.rp_migration_plan_layer_round(mp, l) for l in range(L)],
                           dtype=np.int32)
    expert_bytes = np.array([lib.rp_migration_plan_expert_bytes(mp, l) for l in range(L)],
                            dtype=np.int64)
    transfers = _records(lib, mp, lib.rp_migration_plan_num_transfers,
                         lib.rp_migration_plan_transfer, _lib.rp_migration_transfer,
                         TRANSFER_DTYPE)
    writes = _records(lib, mp, lib.rp_migration_plan_num_writes, lib.rp_migration_plan_write,
                      _lib.rp_migration_write, WRITE_DTYPE)
    return Migration(hash=int(lib.rp_migration_plan_hash(mp)), summary=summary,
                     layer_round=layer_round, expert_bytes=expert_bytes,
                     transfers=transfers, writes=writes)
