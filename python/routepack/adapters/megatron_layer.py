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
from ..torch.holders import sum_among_holders
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
    every slot holding it, exchanged among the EP ranks that hold it only
    (routepack.torch.holders: each holder sends its summed FP32 copy to every other holder
    in one batched call for all layers; what the ``megatron_routepack`` executor profile
    prices), so that replicas take the same update. Call after the step's backward passes
    and before DDP's gradient sync (finalize_model_grads / finish_grad_sync): Megatron's
    overlapped grad reduce (overlap_grad_reduce) would have started reducing before this
    and is refused. ``layers``: the model's MoE layers in order; ``phy2log``: the step's
    placement [L][slots] (StepResult.phy2log). Collective over ``group`` (every rank of
    the EP group calls it). Returns the bytes this rank sent."""
    ep = dist.get_world_size(group)
    grads, device = [], None
    for layer in layers:
        n = len(phy2log[0]) // ep
        slots = []
        for i in range(n):
            pieces = expert_pieces(layer.experts, i)
            for _, p, _ in pieces:
                if getattr(p, "main_grad", None) is None:
                    raise errors.NotSupportedError("expert parameters without main_grad: wrap the model "
                                                   "in Megatron's DistributedDataParallel first")
                device = p.main_grad.device
            slots.append([select(p.main_grad) for _, p, select in pieces])
        grads.append(slots)
    return sum_among_holders(phy2log, grads, group, device)


class _ReadyGate:
    """Stands in DDP's param_to_bucket_group for one MoE layer's expert parameters: on the
    last micro-batch it holds their register_grad_ready until every one of them is ready,
    sums the layer's replica gradients among their holders, then passes them on."""

    def __init__(self, owner, layer, real):
        self.owner, self.layer, self.real = owner, layer, real

    def __getattr__(self, name):          # everything else is the bucket group's
        return getattr(self.real, name)

    def register_grad_ready(self, param, force_all_reduce=False):
        self.owner._ready(self.layer, self.real, param, force_all_reduce)


class OverlappedReplicaGrads:
    """Replica gradients under Megatron DDP's ``overlap_grad_reduce`` (which starts a
    bucket's reduce-scatter during the backward pass as soon as its parameters' gradients
    are ready): every RoutePackMoELayer's expert parameters report ready through a gate
    that, on the step's last micro-batch, waits for all of the layer's expert parameters,
    sums their replicated experts' ``main_grad`` among the holders (as
    reduce_replica_grads), and only then lets DDP start their bucket. MegatronMigration
    installs it when DDP overlaps and sets each step's placement from ``execute``; then
    do not call reduce_replica_grads. Micro-batches before the last must run under
    ``ddp.no_sync()``, as Megatron's training loop does."""

    def __init__(self, ddps, layers, group=None):
        self.layers, self.group = layers, group
        self.rows, self.done = None, set()
        ep = dist.get_world_size(group)
        self._params, self._held = [], {}
        # per layer, each local slot's main_grad views (expert_pieces' order), found once:
        # DDP's main_grad buffers stay in place, and migration rewrites them in place
        self._slots = []
        for l, layer in enumerate(layers):
            n = layer.config.num_moe_experts // ep
            pieces = [expert_pieces(layer.experts, i) for i in range(n)]
            params = {id(p): p for slot in pieces for _, p, _ in slot}
            if any(getattr(p, "main_grad", None) is None for p in params.values()):
                raise errors.NotSupportedError("expert parameters without main_grad: wrap the model "
                                               "in Megatron's DistributedDataParallel first")
            self._slots.append([[select(p.main_grad) for _, p, select in slot] for slot in pieces])
            self._params.append(set(params))
            for p in params.values():
                for ddp in ddps:
                    table = ddp.param_to_bucket_group
                    if p in table and not isinstance(table[p], _ReadyGate):
                        table[p] = _ReadyGate(self, l, table[p])

    def start_step(self, phy2log):
        """The step's placement (StepResult.phy2log [L][slots]): call before its backward."""
        self.rows = [np.asarray(r, dtype=np.int64) for r in phy2log]
        self.done, self._held = set(), {}

    def _ready(self, l, real, param, force):
        if not real.is_last_microbatch or l in self.done:
            real.register_grad_ready(param, force)
            return
        if self.rows is None:
            raise errors.InvalidArgumentError(
                "overlapped replica gradients: no placement for this step (MegatronMigration.execute "
                "sets it; call it every step before the backward)")
        held = self._held.setdefault(l, [])
        held.append((real, param, force))
        if {id(p) for _, p, _ in held} != self._params[l]:
            return
        sum_among_holders([self.rows[l]], [self._slots[l]], self.group, param.main_grad.device)
        self.done.add(l)
        del self._held[l]
        for r, p, f in held:
            r.register_grad_ready(p, f)
