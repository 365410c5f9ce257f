"""Replica gradients summed among the ranks that hold an expert, for a layer whose experts
live in slots (Megatron-Core's MoELayer under RoutePack's placement,
routepack.adapters.megatron_layer): each rank sums its own slots' copies of every
replicated expert it holds and sends that sum to every other holder of the expert, in one
batched point-to-point call for all layers; ranks without a copy of any replicated expert
only take part in the call (NCCL needs every rank of the group in it). Every holder adds
the copies in EP-rank order, so all replicas get the same bits. What the cost model's
``replica_grad_reduce`` "holders" prices (docs/cost-model.md, "Executor profiles")."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._p2p import ring_padding


def _layer_plan(row, rank, size):
    """For one layer's slots ``row`` (the EP group's, [size * n] logical ids, -1 none):
    the replicated experts this rank holds (in id order), which of its slots hold each
    (slot, row in that list), per peer rank the rows it shares, and whether any
    replicated expert spans ranks (the same answer on every rank)."""
    n = len(row) // size
    counts = np.bincount(row[row >= 0], minlength=1)
    holders = {}
    for p, e in enumerate(row):
        if e >= 0 and counts[e] > 1:
            holders.setdefault(int(e), set()).add(p // n)
    spans = any(len(r) > 1 for r in holders.values())
    shared = [e for e in sorted(holders) if rank in holders[e]]
    index = {e: i for i, e in enumerate(shared)}
    mine = [(i, index[int(row[rank * n + i])]) for i in range(n) if int(row[rank * n + i]) in index]
    peers = {}
    for e in shared:
        for q in sorted(holders[e]):
            if q != rank:
                peers.setdefault(q, []).append(index[e])
    return shared, mine, peers, spans


def sum_among_holders(rows, slot_grads, group=None, device=None):
    """Give every slot holding a replicated expert the sum of that expert's gradients over
    all its slots in the EP group ``group`` (default: the world). ``rows``: per layer, the
    EP group's slots' logical experts (int [size * slots], rank r's slots at r * slots);
    ``slot_grads``: per layer, this rank's slots, each a list of gradient tensors (the
    slot's pieces, in the same order and shapes on every slot; written in place).
    Collective over ``group``: every rank calls it with the same ``rows``; ``device``: where
    a rank that holds no replicated expert makes its zero-byte padding (the group's
    device: CUDA under NCCL). Returns the bytes this rank sent (it receives as many)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def to_global(r):
        return dist.get_global_rank(group, r) if group is not None else r

    ops, pending, sent, spans_any, like = [], [], 0, False, None
    for row, slots in zip(rows, slot_grads):
        row = np.asarray(row, dtype=np.int64)
        shared, mine, peers, spans = _layer_plan(row, rank, size)
        spans_any = spans_any or spans
        if not mine:
            continue
        first = slots[mine[0][0]]
        like = first[0]
        own = first[0].new_zeros((len(shared), sum(g.numel() for g in first)))
        with torch.no_grad():
            for i, r in mine:
                own[r] += torch.cat([g.reshape(-1) for g in slots[i]])
        recv = {}
        for q, idx in sorted(peers.items()):
            out = own[torch.as_tensor(idx, device=own.device)]
            recv[q] = torch.empty_like(out)
            ops += [dist.P2POp(dist.isend, out, to_global(q), group),
                    dist.P2POp(dist.irecv, recv[q], to_global(q), group)]
            sent += out.numel() * out.element_size()
        pending.append((own, recv, peers, mine, slots))
    if spans_any and size > 1:   # the same on every rank: then every rank takes part
        pad = like if like is not None else torch.empty(0, device=device)
        ops += ring_padding(rank, size, pad, to_global, group)
    for w in (dist.batch_isend_irecv(ops) if ops else []):
        w.wait()
    with torch.no_grad():
        for own, recv, peers, mine, slots in pending:
            total = torch.zeros_like(own)
            for q in range(size):   # rank order: every holder adds the same terms in the same order
                if q == rank:
                    total += own
                elif q in recv:
                    total.index_add_(0, torch.as_tensor(peers[q], device=own.device), recv[q])
            for i, r in mine:
                at = 0
                for g in slots[i]:
                    g.copy_(total[r, at:at + g.numel()].view(g.shape))
                    at += g.numel()
    return sent
