"""A RoutePack plan's physical placement run by Megatron-Core's own MoE layer: replicas of an
expert in spare slots and the plan's per-microbatch replica shares, through the
all-to-all (or all-gather) token dispatcher, with replicas' gradients summed among their
holders before DDP reduces them.

Read against megatron-core 0.16.1 (transformer/moe/moe_layer.py: MoELayer.route returns the
router's probs and routing_map [tokens, experts], MoELayer.preprocess hands them to the
dispatcher's dispatch_preprocess; BaseMoELayer holds num_moe_experts / EP contiguous local
experts). The model is built with ``num_moe_experts`` = the plan's physical slots (EP x
slots_per_gpu), so Megatron's dispatcher and experts run slots; the router alone is built for
the logical experts, and preprocess turns each token's logical choices into the slots the
plan gives them (routepack's remap: StepResult.remap_rank). Imports megatron.core."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from .megatron_migration import expert_pieces


def moe_layer_class():
    """RoutePackMoELayer, a subclass of megatron.core's MoELayer (imported here). Put it in
    the layer spec in MoELayer's place with ``params={"num_logical_experts": E}``
    (with_routepack_layers does it), with the TransformerConfig's ``num_moe_experts`` set
    to the physical slots."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class RoutePackMoELayer(MoELayer):
        """Megatron's MoELayer over the plan's physical slots: ``config.num_moe_experts`` is
        the slots (each EP rank holds slots_per_gpu of them, Megatron's local experts), the
        router routes over ``num_logical_experts``. Before each forward on planned tokens,
        set_physical(ids): the slot of every (token, k), [tokens, k] int64 in Megatron's
        token order, k in ascending logical id (routepack's remap of the replayed routing);
        without it (a rollout), each expert's first slot in ``slot_expert`` order.
        ``slot_expert``: int64 [slots], the logical expert each slot holds (-1: none), and
        ``first_slot``: int64 [experts], each expert's first slot, which set_placement keeps."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                     num_logical_experts=None):
            if pg_collection is None:
                # TransformerLayer passes pg_collection to MoELayer itself only (an exact class
                # match); MoELayer takes the same default then
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
                pg_collection = get_default_pg_collection()
            super().__init__(config, submodules, layer_number, pg_collection)
            if num_logical_experts is None:
                raise errors.InvalidArgumentError("RoutePackMoELayer needs num_logical_experts")
            self.num_logical_experts = int(num_logical_experts)
            logical = dataclasses.replace(config, num_moe_experts=self.num_logical_experts)
            unused = self.router
            self.router = submodules.router(config=logical, pg_collection=pg_collection)
            replay = getattr(unused, "router_replay", None)
            if replay is not None:   # the slots' router is never used: nor its replay
                type(replay).global_router_replay_instances.remove(replay)
            self.slot_expert = None
            self._physical = None
            self.first_slot = None

        def set_placement(self, phy2log):
            """The logical expert of every slot (int [slots], -1 none) of this layer."""
            phy2log = np.asarray(phy2log, dtype=np.int64)
            if phy2log.shape != (self.config.num_moe_experts,):
                raise errors.InvalidArgumentError("a placement of %d slots for a layer of %d"
                                                  % (len(phy2log), self.config.num_moe_experts))
            first = np.full(self.num_logical_experts, -1, np.int64)
            for p in range(len(phy2log) - 1, -1, -1):
                if phy2log[p] >= 0:
                    first[phy2log[p]] = p
            if (first < 0).any():
                raise errors.PlanError("logical expert %d has no slot" % int(np.flatnonzero(first < 0)[0]))
            self.slot_expert = phy2log
            self.first_slot = torch.as_tensor(first)

        def set_physical(self, physical):
            """Slots of the next forward's tokens ([tokens, k] int64) or None."""
            self._physical = physical

        def preprocess(self, hidden_states, probs, routing_map):
            T, k = routing_map.shape[0], self.router.topk
            logical = routing_map.nonzero()[:, 1].view(T, k)         # ascending per token
            if self._physical is not None:
                slots = self._physical.to(logical.device).long()
                if tuple(slots.shape) != (T, k):
                    raise errors.InvalidArgumentError("set_physical gave %s slots for %d tokens x %d"
                                                      % (tuple(slots.shape), T, k))
            else:
                slots = self.first_slot.to(logical.device)[logical]
            P = self.config.num_moe_experts
            slot_map = torch.zeros((T, P), dtype=torch.bool, device=routing_map.device)
            slot_map.scatter_(1, slots, True)
            slot_probs = torch.zeros((T, P), dtype=probs.dtype, device=probs.device).scatter(
                1, slots, probs.gather(1, logical))
            return super().preprocess(hidden_states, slot_probs, slot_map)

    return RoutePackMoELayer


def with_routepack_layers(spec, num_logical_experts):
    """A GPT layer spec (get_gpt_layer_local_spec / ..._with_transformer_engine_spec) whose
    MoE layer is RoutePackMoELayer routing over ``num_logical_experts``."""
    mlp = spec.submodules.mlp
    spec.submodules.mlp = dataclasses.replace(mlp, module=moe_layer_class(),
                                              params=dict(mlp.params or {},
                                                          num_logical_experts=num_logical_experts))
    return spec


def reduce_replica_grads(layers, phy2log, group=None):
    """Sum each replicated expert's gradient (``main_grad`` of its pieces, expert_pieces) over
    every slot holding it, on every rank of the EP group ``group``, so that replicas take
    the same update; call after the step's backward passes and before DDP's gradient sync
    (finalize_model_grads / finish_grad_sync): Megatron's overlapped grad reduce
    (overlap_grad_reduce) would have started reducing before this and is refused.
    ``layers``: the model's MoE layers in order; ``phy2log``: the step's placement [L][slots]
    (StepResult.phy2log). One all_reduce per layer holding a replicated expert, of the
    replicated experts' gradients (every rank, the same layers)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for l, layer in enumerate(layers):
        row = np.asarray(phy2log[l], dtype=np.int64)
        n = len(row) // ep
        counts = np.bincount(row[row >= 0], minlength=layer.num_logical_experts)
        replicated = np.flatnonzero(counts > 1)
        if not len(replicated):
            continue
        index = {int(e): i for i, e in enumerate(replicated)}
        pieces = [expert_pieces(layer.experts, i) for i in range(n)]
        for _, p, _ in pieces[0]:
            if getattr(p, "main_grad", None) is None:
                raise errors.NotSupportedError("expert parameters without main_grad: wrap the model "
                                               "in Megatron's DistributedDataParallel first")
        sizes = [select(p.main_grad).numel() for _, p, select in pieces[0]]
        width = sum(sizes)
        total = torch.zeros((len(replicated), width), dtype=pieces[0][0][1].main_grad.dtype,
                            device=pieces[0][0][1].main_grad.device)
        mine = [(i, index[int(row[rank * n + i])]) for i in range(n) if int(row[rank * n + i]) in index]
        for i, r in mine:
            total[r] += torch.cat([select(p.main_grad).reshape(-1) for _, p, select in pieces[i]])
        dist.all_reduce(total, group=group)
        for i, r in mine:
            at = 0
            for (_, p, select), size in zip(pieces[i], sizes):
                select(p.main_grad).copy_(total[r, at:at + size].view(select(p.main_grad).shape))
                at += size
