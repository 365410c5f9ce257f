"""MoELayer: a mixture-of-experts layer that executes a RoutePack plan: each token-choice
goes to the physical replica the plan assigns it (log2phy with the per-microbatch replica
shares and extra replicas, resolved into physical ids by rp_remap), tokens move with one
all_to_all_single each way, every local expert runs on its rows, and the replicas of an
expert get the sum of all their gradients so they stay identical. Placement changes where
the work runs, never what is computed: the output and the gradients equal those of the
same experts held once each (tests/torch check this against a dense reference).

The structure follows Megatron-Core's alltoall token dispatcher, so each piece maps onto
one there: ``_dispatch_layout`` is its preprocess (counts per rank and local expert),
``all_to_all`` its _AllToAll, ``_expert_compute`` its GroupedMLP, ``reduce_replica_grads``
the extra reduction a replicated expert needs next to the usual expert-data-parallel one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import kernels


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x, output_splits, input_splits, group=None):
    """Rows of ``x`` [n, ...]: input_splits[r] rows go to rank r; returns the rows received,
    output_splits[r] from rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, list(map(int, output_splits)), list(map(int, input_splits)), group)


@dataclass
class ExpertPlacement:
    """One MoE layer's placement in one EP group, as a plan gives it (the same on every
    rank of the group).

    ``phy2log``: int [S], the logical expert of each slot (slots EP-rank-major; -1: an
    empty slot, which receives no tokens and is never reduced);
    ``slot_begin``: int [ep_size + 1], EP rank r holds slots slot_begin[r] .. [r+1]-1;
    ``extras``: per microbatch, int [n, 2] rows (expert, ep_rank) of that microbatch's
    extra replicas in plan order (physical id S + i is row i), so rp_remap's physical ids
    index this placement directly."""

    phy2log: np.ndarray
    slot_begin: np.ndarray
    extras: list

    @classmethod
    def from_step(cls, res, layer):
        """The placement of MoE layer ``layer`` in a StepResult (extra replicas of every
        microbatch)."""
        ex = np.asarray(res.extra_replicas).reshape(-1, 4)
        extras = []
        for m in range(res.num_microbatches):
            rows = ex[(ex[:, 0] == m) & (ex[:, 1] == layer)]
            extras.append(rows[:, 2:4].astype(np.int64))
        return cls(np.asarray(res.phy2log[layer], dtype=np.int64),
                   np.asarray(res.slot_begin, dtype=np.int64), extras)

    @property
    def num_slots(self):
        return int(self.phy2log.shape[0])

    @property
    def ep_size(self):
        return int(self.slot_begin.shape[0] - 1)

    def local_slots(self, ep_rank):
        return int(self.slot_begin[ep_rank + 1] - self.slot_begin[ep_rank])

    def physical(self, microbatch):
        """(logical expert, EP rank, local index) of every physical id of a microbatch,
        int64 arrays [P]. A rank's local experts are its slots, then its extra replicas
        in plan order."""
        S = self.num_slots
        extras = self.extras[microbatch] if self.extras else np.zeros((0, 2), np.int64)
        slot_rank = np.searchsorted(self.slot_begin, np.arange(S), side="right") - 1
        logical = np.concatenate([self.phy2log, extras[:, 0]])
        rank = np.concatenate([slot_rank, extras[:, 1]])
        local = np.concatenate([np.arange(S) - self.slot_begin[slot_rank], np.zeros(len(extras), np.int64)])
        for r in range(self.ep_size):   # extras after the slots, in plan order
            mine = np.nonzero(extras[:, 1] == r)[0]
            local[S + mine] = self.local_slots(r) + np.arange(len(mine))
        return logical.astype(np.int64), rank.astype(np.int64), local.astype(np.int64)

    def first_replica(self):
        """int64 [E']: the lowest slot holding each logical expert (-1 where none)."""
        E = int(self.phy2log.max()) + 1 if self.num_slots else 0
        first = np.full(max(E, 0), -1, np.int64)
        for s in range(self.num_slots - 1, -1, -1):
            if self.phy2log[s] >= 0:
                first[self.phy2log[s]] = s
        return first

    def step_extras(self):
        """Sorted unique (expert, ep_rank) pairs over every microbatch: the weights that
        have to be fetched for the step."""
        rows = [e for e in self.extras if len(e)]
        if not rows:
            return np.zeros((0, 2), np.int64)
        return np.unique(np.concatenate(rows), axis=0)


class MoELayer(nn.Module):
    """A top-k MoE layer with experts in slots spread over an EP group.

    Parameters (this rank's): ``router.weight`` [E, hidden] (dense: the trainer reduces its
    gradient over data parallel ranks, as for attention), ``w_in`` [num_slots, hidden, ffn]
    and ``w_out`` [num_slots, ffn, hidden]: slot s holds the expert the placement puts in
    this rank's slot s (expert(x) = silu(x @ w_in) @ w_out). ``gated=True``: SwiGLU experts,
    ``w_in`` [num_slots, hidden, 2 ffn] (gate, then up) and expert(x) = (silu(x @ w_gate) *
    (x @ w_up)) @ w_out. ``expert_kernel``: kernels.LOOP (default: one GEMM per expert) or
    kernels.GROUPED (torch._grouped_mm, one launch per projection; check it on the device
    with kernels.choose_expert_kernel). ``ep_group``: the EP group's process group (None:
    the world); its rank r is EP rank r of the plan.

    Per step: set_placement(placement) (collective: fetches the weights of this step's
    extra replicas), then per microbatch forward(x, routing, physical, microbatch) on
    every rank of the group in lockstep (even with no tokens), backward, and after the
    last microbatch reduce_replica_grads() (collective) before the optimizer step."""

    def __init__(self, hidden_size, ffn_size, num_experts, top_k, num_slots, *, ep_group=None,
                 dtype=torch.float32, device=None, gated=False, expert_kernel=kernels.LOOP):
        super().__init__()
        self.hidden_size, self.ffn_size = int(hidden_size), int(ffn_size)
        self.num_experts, self.top_k, self.num_slots = int(num_experts), int(top_k), int(num_slots)
        self.ep_group = ep_group
        self.ep_rank = dist.get_rank(ep_group)
        self.ep_size = dist.get_world_size(ep_group)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.gated, self.expert_kernel = bool(gated), expert_kernel
        in_width = 2 * ffn_size if gated else ffn_size
        self.w_in = nn.Parameter(torch.empty(num_slots, hidden_size, in_width, dtype=dtype, device=device))
        self.w_out = nn.Parameter(torch.empty(num_slots, ffn_size, hidden_size, dtype=dtype, device=device))
        self.placement = None
        self.last_routing = None
        self._extra = {}       # expert -> (w_in, w_out) leaves fetched for this step

    # ---- weights ----

    def load_experts(self, w_in, w_out, placement):
        """Fill this rank's slots from logical expert weights w_in [E, hidden, ffn],
        w_out [E, ffn, hidden] (the same on every rank) under ``placement``."""
        b = int(placement.slot_begin[self.ep_rank])
        ids = placement.phy2log[b:b + self.num_slots]
        with torch.no_grad():
            for s, e in enumerate(ids):   # an empty slot (-1) is zeroed
                self.w_in[s].copy_(w_in[e] if e >= 0 else torch.zeros_like(self.w_in[s]))
                self.w_out[s].copy_(w_out[e] if e >= 0 else torch.zeros_like(self.w_out[s]))

    def gather_experts(self, placement):
        """Logical expert weights (w_in [E, hidden, ffn], w_out [E, ffn, hidden]), each
        from its lowest slot, on every rank (collective: all_gather over the EP group)."""
        w_in = [torch.empty_like(self.w_in) for _ in range(self.ep_size)]
        w_out = [torch.empty_like(self.w_out) for _ in range(self.ep_size)]
        dist.all_gather(w_in, self.w_in.detach().contiguous(), group=self.ep_group)
        dist.all_gather(w_out, self.w_out.detach().contiguous(), group=self.ep_group)
        every_in, every_out = torch.cat(w_in), torch.cat(w_out)   # [S, ...] slot order
        first = torch.as_tensor(placement.first_replica(), device=every_in.device)
        return every_in[first], every_out[first]

    # ---- per step ----

    def _global(self, r):
        return r if self.ep_group is None else dist.get_global_rank(self.ep_group, r)

    def set_placement(self, placement):
        """Use ``placement`` (ExpertPlacement, this step's) from now on, and fetch the
        weights of every extra replica this rank holds in some microbatch of the step from
        the lowest slot holding that expert (one batch_isend_irecv, collective over the
        EP group: every rank calls it). The slots must hold the placement's experts
        already (migration executed)."""
        if placement.ep_size != self.ep_size or placement.local_slots(self.ep_rank) != self.num_slots:
            raise ValueError("the placement has %d EP ranks and %d slots on rank %d; this layer has %d "
                             "ranks and %d slots" % (placement.ep_size, placement.local_slots(self.ep_rank),
                                                     self.ep_rank, self.ep_size, self.num_slots))
        self.placement = placement
        self._extra = {}
        pairs = placement.step_extras()
        if len(pairs) == 0:
            return
        first = placement.first_replica()
        slot_rank = np.searchsorted(placement.slot_begin, np.arange(placement.num_slots), side="right") - 1
        ops, fetched = [], []
        for e, r in pairs:   # every rank walks the same list in the same order
            src_slot = int(first[e])
            src = int(slot_rank[src_slot])
            local = src_slot - int(placement.slot_begin[src])
            if r == self.ep_rank:
                w_in = torch.empty_like(self.w_in[0])
                w_out = torch.empty_like(self.w_out[0])
                if src == self.ep_rank:
                    w_in.copy_(self.w_in.detach()[local])
                    w_out.copy_(self.w_out.detach()[local])
                else:
                    ops += [dist.P2POp(dist.irecv, w_in, self._global(src), self.ep_group),
                            dist.P2POp(dist.irecv, w_out, self._global(src), self.ep_group)]
                fetched.append((int(e), w_in, w_out))
            elif src == self.ep_rank:
                ops += [dist.P2POp(dist.isend, self.w_in.detach()[local].contiguous(), self._global(r),
                                   self.ep_group),
                        dist.P2POp(dist.isend, self.w_out.detach()[local].contiguous(), self._global(r),
                                   self.ep_group)]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for e, w_in, w_out in fetched:
            self._extra[e] = (w_in.requires_grad_(), w_out.requires_grad_())

    def reduce_replica_grads(self):
        """Give every replica of an expert (slots and this step's extra replicas) the sum of
        all their gradients, so replicas stay identical after the optimizer step: one
        all_reduce over the EP group of [R, params] for the R experts that have more than
        one replica (none: no collective; the list is the placement's, the same on every
        rank). Call after the step's last backward. Reducing over expert-data-parallel
        groups (several EP groups) stays the trainer's, as without RoutePack."""
        p = self.placement
        counts = np.bincount(p.phy2log[p.phy2log >= 0], minlength=self.num_experts)
        extras = p.step_extras()
        shared = sorted(set(np.nonzero(counts > 1)[0].tolist()) | set(extras[:, 0].tolist()))
        if not shared:
            return
        index = {e: i for i, e in enumerate(shared)}
        n_in = self.w_in[0].numel()
        buf = torch.zeros(len(shared), n_in + self.w_out[0].numel(), dtype=self.w_in.dtype,
                          device=self.w_in.device)
        for w in (self.w_in, self.w_out):
            if w.grad is None:
                w.grad = torch.zeros_like(w)
        b = int(p.slot_begin[self.ep_rank])
        mine = p.phy2log[b:b + self.num_slots]
        for s, e in enumerate(mine):
            if int(e) in index:
                i = index[int(e)]
                buf[i, :n_in] += self.w_in.grad[s].reshape(-1)
                buf[i, n_in:] += self.w_out.grad[s].reshape(-1)
        for e, (w_in, w_out) in self._extra.items():
            if w_in.grad is not None:
                buf[index[e], :n_in] += w_in.grad.reshape(-1)
                buf[index[e], n_in:] += w_out.grad.reshape(-1)
        dist.all_reduce(buf, group=self.ep_group)
        for s, e in enumerate(mine):
            if int(e) in index:
                i = index[int(e)]
                self.w_in.grad[s].copy_(buf[i, :n_in].view_as(self.w_in[s]))
                self.w_out.grad[s].copy_(buf[i, n_in:].view_as(self.w_out[s]))

    # ---- forward ----

    def gates(self, x, routing=None):
        """(routing [T, k] int64, gates [T, k] fp32): the router's softmax at the replayed
        experts (``routing`` given: R3) or at its top-k, renormalised over the k."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        if routing is None:
            g, routing = probs.topk(self.top_k, dim=-1)
        else:
            routing = routing.to(device=x.device, dtype=torch.int64)
            g = probs.gather(1, routing)
        return routing, g / g.sum(dim=-1, keepdim=True)

    def _dispatch_layout(self, physical, microbatch):
        """Where each token-choice goes: (order [N] sorting choices by destination rank then
        local expert, input_splits [W], output_splits [W], rows received per local expert
        and source [W, n_local], local expert weights)."""
        logical, rank, local = self.placement.physical(microbatch)
        dev = physical.device
        max_local = int(max(self.placement.local_slots(r) + int(np.sum(rank[self.placement.num_slots:] == r))
                            for r in range(self.ep_size)))
        flat = physical.reshape(-1).to(torch.int64)
        dest = torch.as_tensor(rank, device=dev)[flat]
        key = dest * max_local + torch.as_tensor(local, device=dev)[flat]
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.ep_size * max_local).view(self.ep_size, max_local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        return order, counts.sum(1).tolist(), recv_counts.sum(1).tolist(), recv_counts, logical, rank, local

    def _local_weights(self, microbatch, logical, rank, local):
        """This rank's local experts in local order: its slots, then its extra replicas."""
        weights = [(self.w_in[s], self.w_out[s]) for s in range(self.num_slots)]
        S = self.placement.num_slots
        for p in range(S, len(logical)):
            if rank[p] == self.ep_rank:
                weights.append(self._extra[int(logical[p])])
        return weights

    def _expert_compute(self, rows, per_expert, weights):
        """Each local expert on its rows (rows grouped by local expert, per_expert[j] rows
        for expert j): kernels.expert_mlp with this layer's expert_kernel (the grouped GEMM
        of Megatron's GroupedMLP, or one GEMM per expert)."""
        if not weights:
            return rows.new_zeros((0, self.hidden_size))
        if len(weights) == self.num_slots:   # no extra replicas: the slots as they are
            w_in, w_out = self.w_in, self.w_out
        else:
            w_in = torch.stack([w for w, _ in weights])
            w_out = torch.stack([w for _, w in weights])
        return kernels.expert_mlp(rows, per_expert, w_in, w_out, self.expert_kernel)

    def forward(self, x, routing=None, physical=None, microbatch=0):
        """``x`` [T, hidden]; ``routing`` [T, k] int: the replayed experts (None: the
        router's top-k); ``physical`` [T, k] int: each choice's physical id under this
        microbatch's placement (rp_remap's ids for this layer; None: the lowest slot of
        each expert). Returns [T, hidden]. Collective over the EP group: every rank calls
        it for every microbatch, with or without tokens."""
        T, k = x.shape[0], self.top_k
        routing, gates = self.gates(x, routing)
        self.last_routing = routing.detach()   # what a rollout records for replay (R3)
        if physical is None:
            first = torch.as_tensor(self.placement.first_replica(), device=x.device)
            physical = first[routing]
        physical = physical.to(device=x.device, dtype=torch.int64)
        order, input_splits, output_splits, recv_counts, logical, rank, local = \
            self._dispatch_layout(physical, microbatch)
        token = torch.arange(T, device=x.device).repeat_interleave(k)
        sent = x[token[order]]                                   # [T*k, hidden], by destination
        received = all_to_all(sent, output_splits, input_splits, self.ep_group)
        # received is source-rank-major, each source's rows by local expert: regroup by
        # local expert for the compute, then back.
        n_local = recv_counts.shape[1]
        expert_of_row = torch.arange(n_local, device=x.device).repeat(self.ep_size).repeat_interleave(
            recv_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        per_expert = recv_counts.sum(0).tolist()
        weights = self._local_weights(microbatch, logical, rank, local)
        per_expert = per_expert[:len(weights)]
        computed = self._expert_compute(received[by_expert], per_expert, weights)
        back = torch.empty_like(computed).index_copy(0, by_expert, computed) if computed.shape[0] else computed
        returned = all_to_all(back, input_splits, output_splits, self.ep_group)
        out = torch.empty_like(returned).index_copy(0, order, returned) if returned.shape[0] else returned
        out = out.view(T, k, self.hidden_size)
        return (out * gates.to(out.dtype).unsqueeze(-1)).sum(dim=1)
