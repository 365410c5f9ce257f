"""pack_microbatches: a plan's microbatch lists turned into this rank's packed micro-batches
in THD form (tokens of the microbatch's sequences concatenated, plus cu_seqlens, as
Megatron's packed sequences and FlashAttention's varlen kernels take them), each sequence
fetched from the rank that rolled it out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class PackedMicrobatch:
    """One micro-batch of this rank: ``seq_ids`` (int64 [n], global sequence ids in the
    plan's order), ``cu_seqlens`` (int32 [n + 1] on the fields' device, offsets of each
    sequence in the concatenation), ``fields`` (name -> tensor [tokens, ...]: the
    sequences' rows concatenated in that order) and ``microbatch``, its index in the
    plan's lists (the packing helper returns micro-batches in the plan's run order)."""

    seq_ids: np.ndarray
    cu_seqlens: torch.Tensor
    fields: dict = field(default_factory=dict)
    microbatch: int = -1

    @property
    def num_tokens(self):
        return int(self.cu_seqlens[-1]) if len(self.cu_seqlens) else 0

    @property
    def max_seqlen(self):
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max()) if len(self.seq_ids) else 0

    def __getitem__(self, name):
        return self.fields[name]


def _valid(ids, num_seqs):
    ids = np.asarray(ids, dtype=np.int64)
    return ids[(ids >= 0) & (ids < num_seqs)]


def pack_microbatches(microbatches, seq_owner, seq_lens, local_seq_ids, local_fields, group=None, order=None):
    """This rank's packed micro-batches for a plan.

    ``microbatches``: the plan's lists for every rank, ``[rank][mb]`` arrays of global
    sequence ids (StepResult.microbatches; rank = rank in ``group``). ``seq_owner``: int
    [S], the rank holding each sequence's data (who rolled it out). ``seq_lens``: int [S]
    tokens per sequence. ``local_seq_ids``: the sequences this rank holds, in the order
    ``local_fields`` concatenates them. ``local_fields``: name -> tensor [local tokens,
    ...] (token ids, routing replay [tokens, layers, k], loss masks, ...), every field on
    one device. All arguments but the local ones are the same on every rank.

    Collective over ``group`` (None: the world): one all_to_all_single per field, in the
    order of sorted field names; each rank sends exactly the rows of its sequences that
    other ranks run. Returns a list of PackedMicrobatch, one per microbatch, in the order
    to run them: ``order[rank]`` (StepResult.microbatch_order, int [ranks, M]: the
    microbatch each rank runs at each position, which under pipeline parallelism is part
    of the plan), else index order."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if len(microbatches) != world:
        raise ValueError("the plan has %d ranks; the group has %d" % (len(microbatches), world))
    seq_owner = np.asarray(seq_owner, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    S = len(seq_lens)
    M = len(microbatches[rank])
    # every rank checks every rank's order (the same on all), so all raise or none does
    # before the collectives below
    if order is not None:
        if len(order) != world:
            raise ValueError("order has %d ranks; the group has %d" % (len(order), world))
        for g, row in enumerate(order):
            if sorted(int(m) for m in row) != list(range(M)):
                raise ValueError("order[%d] is %r, not a permutation of the %d microbatches" % (g, list(row), M))
    run = list(range(M)) if order is None else [int(m) for m in order[rank]]
    local_seq_ids = np.asarray(local_seq_ids, dtype=np.int64)
    local_off = np.zeros(S + 1, dtype=np.int64)
    local_start = np.full(S, -1, dtype=np.int64)
    pos = 0
    for s in local_seq_ids:
        if seq_owner[s] != rank:
            raise ValueError("rank %d passed sequence %d, which seq_owner puts on rank %d" % (rank, s, seq_owner[s]))
        local_start[s] = pos
        pos += seq_lens[s]
    names = sorted(local_fields)
    for n in names:
        if local_fields[n].shape[0] != pos:
            raise ValueError("field %r has %d rows; the local sequences have %d tokens"
                             % (n, local_fields[n].shape[0], pos))
    device = local_fields[names[0]].device if names else torch.device("cpu")

    # What this rank sends: rows of its sequences, by destination rank, then microbatch.
    send_rows, input_splits = [], []
    for dst in range(world):
        n = 0
        for mb in microbatches[dst]:
            for s in _valid(mb, S):
                if seq_owner[s] == rank:
                    send_rows.append(np.arange(local_start[s], local_start[s] + seq_lens[s]))
                    n += seq_lens[s]
        input_splits.append(int(n))
    send_index = torch.as_tensor(np.concatenate(send_rows) if send_rows else np.zeros(0, np.int64),
                                 device=device)

    # What it receives: from each source, its sequences of this rank's microbatches.
    output_splits = [0] * world
    mine = [_valid(mb, S) for mb in microbatches[rank]]
    recv_start = np.zeros(S, dtype=np.int64)
    for src in range(world):
        for ids in mine:
            for s in ids:
                if seq_owner[s] == src:
                    output_splits[src] += int(seq_lens[s])
    base = np.concatenate([[0], np.cumsum(output_splits)])
    cursor = base[:-1].copy()
    for ids in mine:
        for s in ids:
            src = seq_owner[s]
            recv_start[s] = cursor[src]
            cursor[src] += seq_lens[s]

    received = {}
    for n in names:   # the same order on every rank
        t = local_fields[n]
        flat = t.reshape(t.shape[0], -1)
        out = flat.new_empty((int(base[-1]), flat.shape[1]))
        dist.all_to_all_single(out, flat[send_index].contiguous(), output_splits, input_splits, group=group)
        received[n] = out.reshape((out.shape[0],) + tuple(t.shape[1:]))

    packed = []
    for m in range(M):
        ids = mine[m]
        rows = [np.arange(recv_start[s], recv_start[s] + seq_lens[s]) for s in ids]
        index = torch.as_tensor(np.concatenate(rows) if rows else np.zeros(0, np.int64), device=device)
        cu = np.concatenate([[0], np.cumsum(seq_lens[ids])]).astype(np.int32)
        packed.append(PackedMicrobatch(ids, torch.as_tensor(cu, device=device),
                                       {n: received[n][index] for n in names}, m))
    return [packed[m] for m in run]
