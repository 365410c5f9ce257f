"""Batched point-to-point calls that every rank of a group takes part in (NCCL requires
all ranks of a group in the group's first batch_isend_irecv; gloo does not, so tests on
CPU cannot see a rank that skips one)."""

from __future__ import annotations

import torch.distributed as dist


def ring_padding(rank, size, like, to_global, group):
    """Zero-element point-to-point operations (send to rank + 1, receive from rank - 1 of
    the group, ``to_global`` mapping a group rank to the global rank P2POp takes) that a
    rank adds to its batch so that it takes part in it, whatever it moves itself: every
    rank of the group adds them to the same call. None for a group of one."""
    if size < 2:
        return []
    return [dist.P2POp(dist.isend, like.new_empty(0), to_global((rank + 1) % size), group),
            dist.P2POp(dist.irecv, like.new_empty(0), to_global((rank - 1) % size), group)]


def join_group(rank, size, like, to_global, group):
    """One batch_isend_irecv of the ring padding alone, waited on: the group's first
    batched call with every rank in it (call on every rank right after making the group)."""
    ops = ring_padding(rank, size, like, to_global, group)
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
