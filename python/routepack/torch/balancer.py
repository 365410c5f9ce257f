"""VirtualExpertBalancer: a stand-in, on torch.distributed, for the per-forward expert
balancing a Megatron-Core trainer runs inside every EP group (--moe-virtual-expert-load-
balance, from Moonshot's MoonEP), with the same contract, so that RoutePack's packing and
placement can be shown and tested feeding it (docs/torch.md, "Per-forward balancing").

The contract, per forward and EP group, as Megatron's balancer has it: every rank passes
its router's [T, k] expert ids; the ranks exchange only their expert histograms; every
rank computes the same offload plan (routepack.virtual_experts.plan_forward, the C planner
of core/virtual_experts.c): overloaded owners offload token-choices to virtual-expert slots
on underloaded ranks, whose weights are pushed before the expert compute, and whose
gradients are reduced back to the owner after the backward. Here the virtual experts are
MoELayer's per-microbatch extra replicas: ``set_placement`` is the push,
``reduce_replica_grads`` the gradient reduction."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..virtual_experts import plan_forward
from .moe import ExpertPlacement


class VirtualExpertBalancer:
    """Per-forward balancing for one EP group over an evenly owned placement (the plan's:
    RoutePack's plans with per_forward_balancing hold every expert once, num_experts /
    ep_size per EP rank). ``placement``: ExpertPlacement (its extras are ignored);
    ``ep_group``: the EP group (None: the world)."""

    def __init__(self, num_experts, placement, ep_group=None):
        self.num_experts = int(num_experts)
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if placement.ep_size != self.ep_size:
            raise ValueError("the placement has %d EP ranks, the group %d" % (placement.ep_size, self.ep_size))
        per_rank = self.num_experts // self.ep_size
        slot_rank = np.searchsorted(placement.slot_begin, np.arange(placement.num_slots), side="right") - 1
        self.owner = np.full(self.num_experts, -1, np.int64)
        self.home = np.full(self.num_experts, -1, np.int64)   # the expert's slot (physical id)
        for s, e in enumerate(placement.phy2log):
            if e < 0:
                continue
            if self.owner[e] >= 0:
                raise ValueError("expert %d has two replicas (slots %d and %d); per-forward balancing needs "
                                 "every expert once" % (e, self.home[e], s))
            self.owner[e], self.home[e] = slot_rank[s], s
        held = np.bincount(self.owner[self.owner >= 0], minlength=self.ep_size)
        if (self.owner < 0).any() or self.num_experts % self.ep_size or (held != per_rank).any():
            raise ValueError("per-forward balancing needs every expert once and %d per EP rank; the placement "
                             "holds %s per rank" % (per_rank, held.tolist()))
        self.placement = placement

    def plan(self, routing):
        """One forward. ``routing``: int [T, k], this rank's expert ids. Collective over the
        EP group (one all_gather of [E] int64 histograms). Returns (placement, physical,
        plan): the ExpertPlacement to pass to MoELayer.set_placement (the virtual experts
        as microbatch 0's extra replicas), int64 [T, k] physical ids for
        MoELayer.forward(..., microbatch=0), and the OffloadPlan."""
        routing = torch.as_tensor(routing).to(torch.int64)
        flat = routing.reshape(-1).cpu()
        mine = torch.bincount(flat, minlength=self.num_experts)
        every = [torch.empty_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(every, mine, group=self.ep_group)
        counts = torch.stack(every).numpy()                                   # [W, E]
        p = plan_forward(counts, self.owner)
        W, E = self.ep_size, self.num_experts
        # virtual experts as extra replicas, in rank then slot order: row i is physical S + i
        rows = [(int(e), r) for r in range(W) for e in p.slot_expert[r] if e >= 0]
        extras = np.array(rows, np.int64).reshape(-1, 2)
        extra_id = {(e, r): self.placement.num_slots + i for i, (e, r) in enumerate(rows)}
        # Each expert's choices, ordered by source rank and, within a rank, by position,
        # fill its destinations in rank order (Megatron's destination boundaries).
        ids = flat.numpy()
        before = np.cumsum(counts, axis=0) - counts                           # [W, E] choices of earlier ranks
        order = np.argsort(ids, kind="stable")
        start = np.concatenate([[0], np.cumsum(np.bincount(ids, minlength=E))[:-1]])
        position = np.empty(len(ids), np.int64)
        position[order] = np.arange(len(ids)) - start[ids[order]]
        position += before[self.ep_rank, ids]
        bounds = np.cumsum(p.allocation, axis=1)                              # [E, W]
        dest = (position[:, None] >= bounds[ids]).sum(axis=1)
        physical = np.where(dest == self.owner[ids], self.home[ids],
                            [extra_id.get((int(e), int(d)), -1) for e, d in zip(ids, dest)])
        placement = ExpertPlacement(self.placement.phy2log, self.placement.slot_begin, [extras])
        return placement, torch.as_tensor(physical.reshape(routing.shape), dtype=torch.int64), p
