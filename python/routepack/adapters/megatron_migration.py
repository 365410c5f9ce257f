"""MegatronMigration: a RoutePack plan's expert placement executed on a Megatron-Core model
in Megatron's own layout: expert weights, main_grad, the optimizer's fp32 main parameters
and moments (distributed-optimizer shards included), router rows and per-expert buffers.

Read against megatron-core 0.16.1 (transformer/moe/experts.py: SequentialMLP
``local_experts[i]``, TEGroupedMLP ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``,
GroupedMLP ``weight1`` / ``weight2`` (expert i: ``weight1.view(n, hidden, -1)[i]`` in its
forward); transformer/moe/router.py: ``weight [E, hidden]``, ``expert_bias`` and
``local_tokens_per_expert``; optimizer/distrib_optimizer.py: ``model_param_gbuf_map``,
``_get_model_param_range_map``, ``model_float16_groups`` / ``shard_fp32_from_float16_groups``
and ``model_fp32_groups`` / ``shard_fp32_groups``). No Megatron code is imported here: the
model and optimizer are the caller's objects, read through those attributes.

Imports torch and routepack.torch (the expert bytes move through MigrationExecutor, the C
executor over torch.distributed: all-or-nothing rounds of whole layers, slot identities)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..torch.migration import MigrationExecutor, init_optimizer_state
from . import megatron as _megatron


def moe_layers(model):
    """The MoE layers of a Megatron-Core model (a module, a DDP wrapper, or a list of model
    chunks), in forward order: every module with ``router``, ``experts`` and
    ``token_dispatcher`` (megatron.core.transformer.moe.moe_layer.MoELayer)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        for m in chunk.modules():
            if all(hasattr(m, a) for a in ("router", "experts", "token_dispatcher")):
                out.append(m)
    return out


def expert_form(experts):
    """The name of a Megatron expert module's form: "SequentialMLP" (``local_experts``),
    "TEGroupedMLP" (``linear_fc1.weight0`` ...), "GroupedMLP" (``weight1``/``weight2``);
    NotSupportedError for anything else."""
    if hasattr(experts, "local_experts"):
        return "SequentialMLP"
    if hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        return "TEGroupedMLP"
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
        return "GroupedMLP"
    raise errors.NotSupportedError(
        "expert module %s is none of the forms MegatronMigration knows (SequentialMLP, "
        "TEGroupedMLP, GroupedMLP)" % type(experts).__name__)


def expert_pieces(experts, local):
    """The parameters of local expert ``local`` of a Megatron expert module, in a fixed
    order: a list of (name, parameter, select) where ``select(t)`` is the expert's part of
    any tensor shaped like the parameter (the parameter itself, its main_grad, its
    optimizer state). SequentialMLP: every parameter of ``local_experts[local]`` by name;
    TEGroupedMLP: ``linear_fc1`` / ``linear_fc2``'s ``weight{local}`` and ``bias{local}``;
    GroupedMLP: the expert's n-th of ``weight1`` and of ``weight2``'s storage, which is what
    its forward multiplies by (``weight1.view(n, hidden, -1)[local]``), flattened."""
    form = expert_form(experts)
    if form == "SequentialMLP":
        return [(n, p, _whole) for n, p in sorted(experts.local_experts[local].named_parameters())]
    if form == "TEGroupedMLP":
        out = []
        for lin in ("linear_fc1", "linear_fc2"):
            mod = getattr(experts, lin)
            for kind in ("weight", "bias"):
                p = getattr(mod, "%s%d" % (kind, local), None)
                if isinstance(p, torch.nn.Parameter) and p.numel():
                    out.append(("%s.%s%d" % (lin, kind, local), p, _whole))
        return out
    # GroupedMLP.forward takes expert i's matrices as weight1.view(n, hidden, -1)[i] and
    # weight2.view(n, -1, hidden)[i]: the i-th n-th of each parameter's storage (contiguous),
    # whatever the [hidden, n x ffn] shape suggests.
    n = experts.num_local_experts

    def chunk(t):
        return t.reshape(n, -1)[local]
    return [("weight1", experts.weight1, chunk), ("weight2", experts.weight2, chunk)]


def _whole(t):
    return t


class _OptimizerIndex:
    """Where a model parameter's optimizer state lives: per Megatron optimizer (the members
    of a ChainedOptimizer), the torch optimizer's state of this rank's shard of it, the
    shard's element range in the flattened parameter, and the data-parallel group over
    which the shards are spread (None: the state is whole on this rank)."""

    def __init__(self, optimizer):
        self.optimizers = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        self._where = {}   # id(model param) -> (megatron optimizer, shard or None, main separate)
        for opt in self.optimizers:
            pairs = []
            if hasattr(opt, "model_float16_groups"):    # DistributedOptimizer, Float16Optimizer
                pairs += [(m, s, True) for mg, sg in zip(opt.model_float16_groups,
                                                          getattr(opt, "shard_fp32_from_float16_groups",
                                                                  getattr(opt, "fp32_from_float16_groups", [])))
                          for m, s in zip(mg, sg)]
            if hasattr(opt, "model_fp32_groups"):
                pairs += [(m, s, False) for mg, sg in zip(opt.model_fp32_groups,
                                                           getattr(opt, "shard_fp32_groups", opt.model_fp32_groups))
                          for m, s in zip(mg, sg)]
            if not hasattr(opt, "model_float16_groups") and not hasattr(opt, "model_fp32_groups"):
                inner = opt.optimizer     # FP32Optimizer: the torch optimizer holds the params
                pairs += [(p, p, False) for g in inner.param_groups for p in g["params"]]
            for m, s, separate in pairs:
                self._where[id(m)] = (opt, s, separate)
            # Every parameter of the DDP buffers the optimizer shards, including those whose
            # elements all live on other data-parallel ranks (model_param_gbuf_map and the
            # groups list only this rank's).
            for buf in getattr(opt, "buffers", []):
                for m in buf.param_index_map:
                    self._where.setdefault(id(m), (opt, None, False))

    def covers(self, param):
        return id(param) in self._where

    def sharded(self, param):
        opt = self._where[id(param)][0]
        return hasattr(opt, "_get_model_param_range_map")

    def group(self, param):
        opt = self._where[id(param)][0]
        return getattr(opt, "data_parallel_group", None) if self.sharded(param) else None

    def range(self, param):
        """(start, end) of this rank's shard in the flattened parameter (may be empty)."""
        opt, shard, _ = self._where[id(param)]
        if not self.sharded(param):
            return 0, param.numel()
        if shard is None:
            return 0, 0
        r = opt._get_model_param_range_map(param)["param"]
        return r.start, r.end

    def state_keys(self, param):
        """Names of the parameter's optimizer tensors that have its shape ("main" first when
        the fp32 main parameter is a separate tensor, then the torch optimizer's state
        tensors by name: exp_avg, exp_avg_sq), the same on every rank of its group."""
        opt, _, separate = self._where[id(param)]
        keys = ["main"] if separate else []
        names = set()
        for state in opt.optimizer.state.values():
            names.update(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
        return keys + sorted(names)

    def tensors(self, param):
        """{key: this rank's flat shard tensor} (empty when this rank holds no shard)."""
        opt, shard, separate = self._where[id(param)]
        if shard is None:
            return {}
        out = {"main": shard} if separate else {}
        for k, v in opt.optimizer.state.get(shard, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[k] = v.view(-1)
        return out

    def ensure_state(self):
        """Create the torch optimizers' state as their first step would (zeros), so there is
        state to move before the first step (routepack.torch.init_optimizer_state)."""
        for opt in self.optimizers:
            init_optimizer_state(opt.optimizer)


def _gather_full(index, params, device):
    """{(id(param), key): the whole fp32 tensor [param.shape]} of every optimizer tensor of
    ``params``, assembled from the data-parallel shards (one all_reduce per group over
    every parameter's zero-padded shards; every rank of a group calls it with the same
    parameters in the same order)."""
    by_group = {}
    for p in params:
        by_group.setdefault(index.group(p), []).append(p)
    out = {}
    for group, ps in by_group.items():
        entries = [(p, k) for p in ps for k in index.state_keys(p)]
        flat = torch.zeros(sum(p.numel() for p, _ in entries), dtype=torch.float32, device=device)
        at = 0
        for p, k in entries:
            start, end = index.range(p)
            mine = index.tensors(p)
            if k in mine and end > start:
                flat[at + start:at + end].copy_(mine[k])
            out[(id(p), k)] = flat[at:at + p.numel()].view(p.shape)
            at += p.numel()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
    return out


def _scatter_full(index, params, full):
    """Write each rank's shard back from ``full`` (_gather_full's form)."""
    for p in params:
        start, end = index.range(p)
        mine = index.tensors(p)
        for k in index.state_keys(p):
            if k in mine and end > start:
                mine[k].copy_(full[(id(p), k)].reshape(-1)[start:end])


class MegatronMigration:
    """Executes each step's expert placement on a Megatron-Core model.

    ``scheduler``: the routepack.Scheduler / routepack.torch.DistributedScheduler planning
    for Megatron's EP group (plan GPU g = EP rank g). With Megatron's stock MoELayer,
    ``slots_per_gpu`` = num_experts / EP (it holds each expert once;
    routepack.adapters.megatron.expert_placement renumbers them, and the router's rows
    follow); with RoutePackMoELayer (routepack.adapters.megatron_layer) Megatron's local
    experts are the plan's slots (``num_moe_experts`` = EP x slots_per_gpu), replicas and
    empty slots included, and the router stays in logical order.
    ``model``: the Megatron model (module, DDP wrapper or list of chunks) whose MoE layers,
    in forward order, are the plan's layers. ``optimizer``: its Megatron optimizer
    (DistributedOptimizer, a ChainedOptimizer of them, or FP32Optimizer; Float16Optimizer's
    fp32 copies are not found and it is refused as not holding the parameters).
    Registering a model registers its optimizer state: ``optimizer`` None, or one that does
    not hold an expert or router parameter, is an InvalidArgumentError naming what is
    missing (a weights-only migration would leave the old expert's moments behind).
    ``group``: Megatron's expert-model-parallel group (None: the world). Collective over
    ``group`` (it makes MigrationExecutor's private groups).

    Each step, on every rank, after the step's plan and before training on it:
    ``execute(res)`` moves every piece of every expert that changes EP rank (weights,
    ``main_grad``, fp32 main parameters and optimizer moments: distributed-optimizer shards
    are assembled over the expert data-parallel group, moved whole, and cut again), then
    permutes each router's rows (weight, main_grad and their optimizer state),
    ``expert_bias`` and per-expert token counters into the new Megatron order. The C
    executor's guarantees hold: rounds of whole layers, all-or-nothing on every rank."""

    def __init__(self, scheduler, model, optimizer, group=None, *, placement=None, timeout_s=60.0,
                 staging_budget_bytes=None):
        self.scheduler = scheduler
        cfg = self.scheduler.config
        self.layers = moe_layers(model)
        self._roots = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(self.layers) != cfg.num_layers:
            raise errors.InvalidArgumentError("the model has %d MoE layers; the config has %d"
                                              % (len(self.layers), cfg.num_layers))
        if optimizer is None:
            raise errors.InvalidArgumentError(
                "no optimizer: MegatronMigration moves each expert's optimizer state (fp32 main "
                "parameters, Adam moments) with its weights; pass the model's Megatron optimizer")
        self.index = _OptimizerIndex(optimizer)
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        E = cfg.num_experts
        # RoutePackMoELayer (megatron_layer): Megatron's experts are the plan's slots, replicas
        # and empty slots included, and the router stays logical; stock MoELayer: one slot per
        # expert, the experts renumbered (expert_placement) and the router rows with them.
        self.physical = hasattr(self.layers[0], "num_logical_experts")
        P = self.layers[0].config.num_moe_experts if self.physical else E
        self.num_local = P // self.ep_size
        missing = []
        for l, layer in enumerate(self.layers):
            n = len(getattr(layer, "local_expert_indices", [])) or layer.experts.num_local_experts
            if n != self.num_local or self.num_local * self.ep_size != P or \
                    (self.physical and n != cfg.slots[self.ep_rank]):
                raise errors.NotSupportedError(
                    "MoE layer %d holds %d local experts; %s with %d %s over EP %d holds %d%s"
                    % (l, n, "RoutePackMoELayer" if self.physical else "stock Megatron-Core", P,
                       "slots" if self.physical else "experts", self.ep_size, self.num_local,
                       " (the config's slots_per_gpu is %d)" % cfg.slots[self.ep_rank]
                       if self.physical else ""))
            for i in range(self.num_local):
                for name, p, _ in expert_pieces(layer.experts, i):
                    if not self.index.covers(p):
                        missing.append("MoE layer %d local expert %d %s" % (l, i, name))
            if not self.index.covers(layer.router.weight):
                missing.append("MoE layer %d router.weight" % l)
        if missing:
            raise errors.InvalidArgumentError(
                "the optimizer does not hold %s%s: its state would not follow the experts; pass the "
                "optimizer that trains the whole model" % (", ".join(missing[:4]),
                                                           " and %d more" % (len(missing) - 4)
                                                           if len(missing) > 4 else ""))
        self.index.ensure_state()
        self.device = self.layers[0].router.weight.device
        start = np.asarray(self.scheduler.initial_placement() if placement is None else placement,
                           dtype=np.int64)
        if start.shape != (cfg.num_layers, P) or (
                not self.physical and (np.sort(start, axis=1) != np.arange(E)).any()):
            raise errors.NotSupportedError(
                "the starting placement (shape %s) is not %s" % (
                    start.shape, "one of the %d slots per layer" % P if self.physical else
                    "a permutation of the %d experts per layer: stock Megatron-Core holds each "
                    "expert once" % E))
        # DDP that reduces during the backward: replicas' gradients summed at each layer's
        # readiness (megatron_layer.OverlappedReplicaGrads), placed from execute()
        overlapping = [m for m in self._roots
                       if getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False)]
        self.overlapped_grads = None
        if self.physical and overlapping:
            from .megatron_layer import OverlappedReplicaGrads
            self.overlapped_grads = OverlappedReplicaGrads(overlapping, self.layers, group)
        self.expert_order = start.copy()
        if self.physical:
            for l, layer in enumerate(self.layers):
                layer.set_placement(start[l])
        self.executor = MigrationExecutor(self.scheduler, group, placement=start, timeout_s=timeout_s,
                                          staging_budget_bytes=staging_budget_bytes, device=self.device)
        self._register(None)
        self.executor.sync()

    # ---- the tensors of each slot ----

    def _expert_params(self, l):
        seen, out = set(), []
        for i in range(self.num_local):
            for _, p, _ in expert_pieces(self.layers[l].experts, i):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @staticmethod
    def _piece(view):
        # every form's expert is a contiguous part of its parameter (expert_pieces), and of
        # any tensor of the parameter's shape
        assert view.is_contiguous()
        return view

    def _register(self, full):
        """Register every layer's slots: per local expert its weights, main_grad, then the
        optimizer tensors (from ``full``, or zeros of their size when only sizing)."""
        for l, layer in enumerate(self.layers):
            slots = []
            for i in range(self.num_local):
                ts = []
                for _, p, select in expert_pieces(layer.experts, i):
                    ts.append(self._piece(select(p.data)))
                    if getattr(p, "main_grad", None) is not None:
                        ts.append(self._piece(select(p.main_grad)))
                    for k in self.index.state_keys(p):
                        if full is None:
                            ts.append(torch.zeros(select(p.data).shape, dtype=torch.float32,
                                                  device=self.device))
                        else:
                            ts.append(self._piece(select(full[(id(p), k)])))
                slots.append(ts)
            self.executor.register_slots(l, slots)

    # ---- a step ----

    def execute(self, res):
        """Run step ``res``'s placement (StepResult; every rank, after the step, before the
        step's first forward). Returns routepack.executor.MigrationResult, or None when the
        placement did not change. The new Megatron order is ``self.expert_order`` (int64
        [L, slots]: Megatron's expert index p holds logical expert expert_order[l, p], -1
        none). A plan the layer cannot hold is refused before anything moves: for the stock
        MoELayer replicas, spare slots, extra replicas and shares (expert_placement's
        NotSupportedError); for RoutePackMoELayer per-microbatch extra replicas (Megatron's
        expert forms hold a fixed number of local experts). On MigrationFailed the layers of
        committed rounds are in the new order (their routers permuted), the others in the old.
        Under DDP's overlap_grad_reduce it also gives OverlappedReplicaGrads the slots held
        now, whose replicas' gradients the step's backward then sums."""
        if self.overlapped_grads is not None:
            self.overlapped_grads.start_step(self.expert_order)   # made right below if it moves
        if self.physical:
            if len(res.extra_replicas):
                raise errors.NotSupportedError(
                    "the plan has %d per-microbatch extra replicas; Megatron's expert forms "
                    "(SequentialMLP, TEGroupedMLP, GroupedMLP) hold a fixed number of local experts, "
                    "so Megatron cannot run them: plan with execution.executor \"megatron_routepack\" "
                    "in the scheduler's config (replicas and shares, never extra replicas)"
                    % len(res.extra_replicas))
            new = np.asarray(res.phy2log, dtype=np.int64)
        else:
            new = _megatron.expert_placement(res).expert_order
        if res.migration is None and (new == self.expert_order).all():
            return None
        params = [p for l in range(len(self.layers)) for p in self._expert_params(l)]
        full = _gather_full(self.index, params, self.device)
        self._register(full)
        result, failure = None, None
        try:
            result = self.executor.execute(res)
        except errors.Error as e:  # the same on every rank (MigrationFailed)
            failure = e
        finally:
            _scatter_full(self.index, params, full)
        held = self._held_layers(new)
        perm_layers = [l for l in range(len(self.layers)) if held[l]]
        self._permute_routers(new, perm_layers)
        if failure is not None:
            raise failure
        return result

    def _held_layers(self, new):
        """Per layer, whether every EP rank's slots hold ``new``'s experts (the C executor's
        slot identities, agreed over the group)."""
        mine = np.array([all(e == int(new[l, self.ep_rank * self.num_local + s])
                             for s, e in enumerate(self.executor.slot_experts(l)))
                         for l in range(len(self.layers))], dtype=np.int64)
        t = torch.as_tensor(mine, device=self.executor.messenger.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.cpu().numpy().astype(bool)

    def _permute_routers(self, new, layers):
        if self.physical:        # the router is logical: only the slots' record changes
            for l in layers:
                self.expert_order[l] = new[l]
                self.layers[l].set_placement(new[l])
            if self.overlapped_grads is not None:   # the slots held now, a failure's included
                self.overlapped_grads.start_step(self.expert_order)
            return
        perm = {l: torch.as_tensor(np.argsort(self.expert_order[l])[new[l]], device=self.device)
                for l in layers}
        weights = [self.layers[l].router.weight for l in layers]
        full = _gather_full(self.index, weights, self.device)
        for l in layers:
            router, idx = self.layers[l].router, perm[l]
            with torch.no_grad():
                w = router.weight
                w.data.copy_(w.data[idx])
                if getattr(w, "main_grad", None) is not None:
                    w.main_grad.copy_(w.main_grad[idx])
                for k in self.index.state_keys(w):
                    t = full[(id(w), k)]
                    t.copy_(t[idx])
                for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert"):
                    buf = getattr(router, name, None)
                    if torch.is_tensor(buf) and buf.dim() == 1 and buf.numel() == len(idx):
                        buf.copy_(buf[idx.to(buf.device)])
            self.expert_order[l] = new[l]
        _scatter_full(self.index, weights, full)

    # ---- logical order (checkpoints, comparisons) ----

    def logical_state_dict(self, include_optimizer=True):
        """The model (and optimizer) state in logical expert order, whole, on every rank:
        {name: tensor} where an expert's parameter is named
        ``moe.{layer}.expert.{logical id}.{piece}`` (piece as in expert_pieces), a router's
        rows are in logical order (``moe.{layer}.router.{weight, expert_bias, ...}``), and
        every other parameter keeps its model name; with ``include_optimizer`` each
        parameter's optimizer tensors follow as ``{name}/{key}`` (exp_avg, exp_avg_sq, main),
        whole (assembled from their shards). What it returns does not depend on the
        placement: a checkpoint of it loads (load_logical_state_dict) into a run that never
        migrated. Collective over the world (experts are gathered over ``group``, shards over
        their data-parallel groups)."""
        return self._logical(include_optimizer)

    def load_logical_state_dict(self, state):
        """Load logical_state_dict's form into the model and optimizer at the current
        placement (every rank; each takes the experts its slots hold)."""
        self._logical(True, load=state)

    def _router_order(self, l):
        """The logical expert of each router row (stock: Megatron's order; a
        RoutePackMoELayer's router is logical)."""
        if self.physical:
            return np.arange(self.scheduler.config.num_experts)
        return self.expert_order[l]

    def _named_params(self):
        experts = {id(p) for l in range(len(self.layers)) for p in self._expert_params(l)}
        routers = {id(layer.router.weight): l for l, layer in enumerate(self.layers)}
        named = []
        seen = set()
        for l, layer in enumerate(self.layers):
            for i in range(self.num_local):
                for name, p, select in expert_pieces(layer.experts, i):
                    named.append(("expert", l, i, name, p, select))
        for m in self._roots:
            for n, p in m.named_parameters():
                if id(p) in experts or id(p) in seen:
                    continue
                seen.add(id(p))
                named.append(("router", routers[id(p)], None, n, p, _whole) if id(p) in routers
                             else ("dense", None, None, n, p, _whole))
        return named

    def _logical(self, include_optimizer, load=None):
        named = self._named_params()
        params, seen = [], set()
        for entry in named:
            if id(entry[4]) not in seen:
                seen.add(id(entry[4]))
                params.append(entry[4])
        full = _gather_full(self.index, params, self.device) if include_optimizer else {}
        out = {}
        for kind, l, i, name, p, select in named:
            tensors = {"": p.data}
            if include_optimizer:
                tensors.update({"/" + k: full[(id(p), k)] for k in self.index.state_keys(p)})
            for suffix, t in tensors.items():
                if kind == "expert":
                    mine = select(t)
                    key_of = lambda e: "moe.%d.expert.%d.%s%s" % (l, e, name, suffix)  # noqa: E731
                    if load is None:
                        parts = [torch.empty_like(mine.contiguous()) for _ in range(self.ep_size)]
                        dist.all_gather(parts, mine.contiguous(), group=self.group)
                        for r, part in enumerate(parts):
                            e = int(self.expert_order[l, r * self.num_local + i])
                            # an expert's first slot (replicas are kept alike); none: nothing
                            if e >= 0 and key_of(e) not in out:
                                out[key_of(e)] = part.cpu()
                    else:
                        e = int(self.expert_order[l, self.ep_rank * self.num_local + i])
                        if e >= 0:
                            with torch.no_grad():
                                mine.copy_(load[key_of(e)].to(mine.device))
                elif kind == "router":
                    key = "moe.%d.router.weight%s" % (l, suffix)
                    order = torch.as_tensor(self._router_order(l), device=t.device)
                    with torch.no_grad():
                        if load is None:
                            logical = torch.empty_like(t)
                            logical[order] = t
                            out[key] = logical.cpu()
                        else:
                            t.copy_(load[key].to(t.device)[order])
                else:
                    key = name + suffix
                    if load is None:
                        out[key] = t.detach().cpu().clone()
                    else:
                        with torch.no_grad():
                            t.copy_(load[key].to(t.device))
        for l, layer in enumerate(self.layers):
            order = torch.as_tensor(self._router_order(l))
            for name in ("expert_bias", "local_tokens_per_expert"):
                buf = getattr(layer.router, name, None)
                if torch.is_tensor(buf) and buf.dim() == 1:
                    key = "moe.%d.router.%s" % (l, name)
                    if load is None:
                        logical = torch.empty_like(buf)
                        logical[order.to(buf.device)] = buf
                        out[key] = logical.cpu()
                    elif key in load:
                        buf.copy_(load[key].to(buf.device)[order.to(buf.device)])
        if load is not None and include_optimizer:
            _scatter_full(self.index, params, full)
        return out
