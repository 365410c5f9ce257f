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
MoELayer's per-microbatch extra replicas: ``fetch_replicas`` is the push,
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
        """One forward. ``routing``: int [T, k], this rank's expert ids, on the CPU or a
        CUDA device. Collective over the EP group (one all_gather of [E] int64
        histograms, on the routing's device: NCCL takes CUDA tensors). The histograms
        are counted on the device and read on the host once (the offload plan is the C
        planner's); the token-choices are mapped on the device. Returns (placement,
        physical, plan): the ExpertPlacement to pass to MoELayer.fetch_replicas (the
        virtual experts as microbatch 0's extra replicas), int64 [T, k] physical ids on
        the routing's device for MoELayer.forward(..., microbatch=0), and the
        OffloadPlan."""
        routing = torch.as_tensor(routing)
        device = routing.device
        flat = routing.reshape(-1).to(torch.int64)
        W, E = self.ep_size, self.num_experts
        mine = torch.zeros(E, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
        every = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(every, mine, group=self.ep_group)
        counts = torch.stack(every).cpu().numpy()                             # [W, E]: the one host read
        p = plan_forward(counts, self.owner)
        # virtual experts as extra replicas, in rank then slot order: row i is physical S + i
        rows = [(int(e), r) for r in range(W) for e in p.slot_expert[r] if e >= 0]
        extras = np.array(rows, np.int64).reshape(-1, 2)
        # physical id of an expert's choices sent to rank d: its slot on its owner, the
        # virtual expert on another rank (-1: the plan sends none there)
        table = np.full((E, W), -1, np.int64)
        table[np.arange(E), self.owner] = self.home
        for i, (e, r) in enumerate(rows):
            table[e, r] = self.placement.num_slots + i
        # Each expert's choices, ordered by source rank and, within a rank, by position,
        # fill its destinations in rank order (Megatron's destination boundaries).
        before = torch.as_tensor((np.cumsum(counts, axis=0) - counts)[self.ep_rank]).to(device)   # [E]
        order = torch.argsort(flat, stable=True)
        start = torch.cumsum(mine, 0) - mine
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=device) - start[flat[order]]
        position += before[flat]
        bounds = torch.as_tensor(np.cumsum(p.allocation, axis=1)).to(device)          # [E, W]
        dest = (position.unsqueeze(1) >= bounds[flat]).sum(dim=1)
        physical = torch.as_tensor(table).to(device)[flat, dest]
        placement = ExpertPlacement(self.placement.phy2log, self.placement.slot_begin, [extras])
        return placement, physical.view(routing.shape), p
