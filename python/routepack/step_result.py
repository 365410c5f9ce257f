"""routepack.StepResult: what one step returns, copied out of the C library (the packing,
the placement, the levers, the report and the step's migration), with what is computed
from the step's own plan copy: physical routing (rp_remap), dispatch ranks, memory per
GPU and each MoE layer's placement (``placement(layer)``)."""

from __future__ import annotations

import ctypes
import os
import weakref

import numpy as np

from . import _args, _lib, _remap_device, _routing, errors
from ._context import Owned
from .placement import ExpertPlacement
from .trace import _new_batch

_SPLIT = {"even": 0, "locality": 1}


def _i32p(arr):
    return arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


def _i64p(arr):
    return arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))


def _raise_step_error(st, err, fallback_message=None):
    """Raise a failed step's or remap's error: RoutingError when the C library blames the
    routing (it names a sequence, or its message starts with "routing"), else the
    status's class."""
    routing_problem = err.sequence >= 0 or _lib.text(err.text).startswith("routing")
    cls = errors.RoutingError if routing_problem else None
    if not err.text and fallback_message:
        _lib.raise_error(st, err, message=fallback_message, cls=cls)
    _lib.raise_error(st, err, cls=cls)


class StepResult:
    """What one step returns, copied out of the C library: every array here belongs to
    the caller and stays valid after later steps.

    Packing: ``microbatches[rank][mb]`` is an int32 array of sequence indices (in the
    order to run them); ``seq_rank[s]``, ``seq_microbatch[s]`` say where sequence s runs;
    ``microbatch_order`` [G, M] int32, the microbatch each rank runs at each position (the
    identity unless the plan orders them, as under pipeline parallelism).
    Placement (DeepSeek EPLB's arrays, docs/formats.md): ``phy2log`` [L, S],
    ``log2phy`` [L, E, R] (-1 padded), ``logcnt`` [L, E], ``slot_begin`` [ep_size + 1].
    Levers: ``extra_replicas`` [n, 4] rows of (microbatch, layer, expert, ep_rank) and
    ``shares`` {(microbatch, layer, expert): float64 array}, replicas in ascending slot
    order then extra replicas in order; without an entry the tokens of that expert split
    by ``split_rule``. Physical routing (rp_remap): ``num_physical`` [M] (P of each
    microbatch), and with step(..., physical=True) ``physical_routing`` [tokens, L, k]
    and ``slot_tokens`` (a list of M int64 arrays [L, Q, P]); see remap().
    The result keeps its own copy of the C plan (rp_plan_copy), so remap() works after
    later steps and after the scheduler is closed.
    Report: ``report`` (the dict of rp_sched_report_json) and typed fields from the C
    report: ``step_time_s``, ``lower_bound_s``, ``fallback``, ``fallback_reason``,
    ``swapped``, ``swap_error``, ``policy_name``, ``policy_version``, ``plan_hash``;
    demotion (Scheduler's ``demote_after``): ``failed_steps`` (steps in a row that fell
    back, this one included), ``demoted``, ``demoted_to``, ``demote_error``.
    Migration: ``migration``, the step's expert migration plan (rp_sched_migration) as a
    routepack.migration.Migration copy, or None when the placement did not change; it is
    executed with the result itself (routepack.torch.MigrationExecutor.execute(res), or
    routepack.executor.execute(res, registry, transport)), after the step and before the
    next is planned. ``placement(layer)``: one MoE layer's placement (ExpertPlacement)."""

    def metrics(self, prefix="routepack/"):
        """The step's flat metrics for a logger, {prefix + key: float}: step_time_ms,
        lower_bound_ms, step_over_lower_bound, attention/dispatch/expert/combine_ms,
        attention_imbalance, expert_imbalance, expert_balancedness (vLLM's mean/max),
        migration_bytes, migration_ms, experts_moved, plan_ms, policy_ms, fallback,
        swapped, ranks_disagreed (0 or 1); after Scheduler.attach_shift also
        router_shift_fraction, router_shift_max_layer_fraction,
        router_shift_max_seq_fraction, router_shift_max_expert_lost_fraction. The same keys as `routepack simulate --json`
        per step (both come from the C report); docs/python.md defines each.

            wandb.log(res.metrics(), step=step)       # or writer.add_scalars(...)
        """
        return {prefix + k: float(v) for k, v in self.report["metrics"].items()}

    def __init__(self):
        self.migration = None
        self._scheduler = None   # weakref to the Scheduler whose C plan executes `migration`
        self.physical_routing = None
        self.exchange_bytes = None   # routepack.torch.DistributedScheduler: this rank's statistics exchange
        self.slot_tokens = None
        self._rank_table = None

    def remap(self, routing, layout=None, *, slot_tokens=False, num_threads=None):
        """Physical ids [tokens, layers, k] (int32) for this step's routing, in any form
        step() takes, computed by the C library's rp_remap (docs/kernels.md has the split
        rule) one microbatch at a time: for a token of microbatch m, a slot in [0, S)
        (S = total_slots), or S + i for the i-th extra replica of (m, layer) in the
        plan's order (numbered per microbatch and layer, so the id's EP rank needs m:
        dispatch_ranks()); -1 for a sequence the plan does not pack. With
        ``slot_tokens=True`` returns (ids, slot_tokens): slot_tokens[m][layer, q, p]
        counts the token-choices physical id p of EP group q receives in microbatch m
        (int64, P = num_physical[m] columns).
        ``num_threads``: rp_remap's threads (default: the scheduler's num_threads, 0 for
        all CPUs). Errors of the C library raise with its message (RoutingError for an
        expert id out of range)."""
        lay, arrays = _routing.normalize(routing, layout)
        view = _routing.view(lay, arrays, num_layers=self.num_layers, top_k=self._top_k,
                             num_experts=self.num_experts, lens=self._lens)
        batch = _new_batch(self._lib, self._ctx.handle, self._lens)
        try:
            phys, counts = self._remap_view(view, batch, num_threads)
        finally:
            self._lib.rp_batch_free(batch)
        return (phys, counts) if slot_tokens else phys

    def remap_rank(self, rank, microbatch, routing, layout=None, *, slot_tokens=False):
        """Physical ids [tokens, layers, k] (int32) of one rank's own tokens of one
        microbatch (C rp_remap_rank): the tokens of ``microbatches[rank][microbatch]``'s
        sequences in that order (their THD concatenation), given only their routing, in
        any form step() takes. The same ids remap() gives those tokens. With
        ``slot_tokens=True`` returns (ids, counts): counts[layer, p] token-choices this
        rank sends to physical id p of its EP group (int64, P = num_physical[mb]).
        Torch in, torch out: given a torch tensor (CPU or CUDA), ids and counts are tensors
        on its device; else numpy arrays. A packed CUDA tensor is remapped on the device
        (rp_gpu_remap_rank: the same ids, no host copy of the routing or the ids; one
        blocking C call) where the library has its CUDA kernels and sees a device, else
        through a host copy."""
        if _remap_device.usable(routing, layout):   # read and written on the device
            return _remap_device.remap_rank(self, rank, microbatch, routing, slot_tokens)
        like = _routing.torch_tensor_of(routing)
        if like is not None:
            out = self.remap_rank(rank, microbatch, _routing.host_arrays(routing), layout, slot_tokens=slot_tokens)
            if slot_tokens:
                return _routing.as_tensor_like(out[0], like), _routing.as_tensor_like(out[1], like)
            return _routing.as_tensor_like(out, like)
        rank = _args.integer(rank, "rank", _args.INT32, 0, self.num_gpus - 1)
        mb = _args.integer(microbatch, "microbatch", _args.INT32, 0, self.num_microbatches - 1)
        seqs = self.microbatches[rank][mb]
        lens = _routing.Lengths(np.ascontiguousarray(self._lens.prompt[seqs], dtype=np.int32),
                                np.ascontiguousarray(self._lens.response[seqs], dtype=np.int32), None)
        lay, arrays = _routing.normalize(routing, layout)
        view = _routing.view(lay, arrays, num_layers=self.num_layers, top_k=self._top_k,
                             num_experts=self.num_experts, lens=lens)
        T, L, K = lens.num_tokens, self.num_layers, self._top_k
        P = int(self.num_physical[mb])
        phys = np.full((T, L, K), -1, dtype=np.int32)
        counts = np.zeros((L, max(P, 0)), dtype=np.int64)
        batch = _new_batch(self._lib, self._ctx.handle, self._lens)
        try:
            err = _lib.new_error()
            st = self._lib.rp_remap_rank(self._plan.handle, self._config.handle, mb, rank, batch,
                                         view.pointer(), _SPLIT[self.split_rule], _i32p(phys),
                                         _i64p(counts), ctypes.byref(err))
            if st != errors.OK:
                _raise_step_error(st, err)
        finally:
            self._lib.rp_batch_free(batch)
        del view
        return (phys, counts) if slot_tokens else phys

    def _remap_view(self, view, batch, num_threads=None):
        """rp_remap over every microbatch of the plan copy into one packed array."""
        lib = self._lib
        threads = (self._num_threads if num_threads is None
                   else _args.integer(num_threads, "num_threads", _args.INT32))
        if threads <= 0:
            threads = os.cpu_count() or 1
        T, L, K = int(self.cu_seqlens[-1]), self.num_layers, self._top_k
        Q = self.num_gpus // self.ep_size if self.ep_size > 0 else 0
        phys = np.full((T, L, K), -1, dtype=np.int32)
        counts = []
        for mb in range(self.num_microbatches):
            P = int(self.num_physical[mb])
            rows = np.zeros((L, Q, max(P, 0)), dtype=np.int64)
            err = _lib.new_error()
            st = lib.rp_remap(self._plan.handle, self._config.handle, mb, batch, view.pointer(),
                              _SPLIT[self.split_rule], threads, _i32p(phys),
                              _i64p(rows) if P >= 0 else None, ctypes.byref(err))
            if st != errors.OK:
                _raise_step_error(st, err)
            counts.append(rows)
        return phys, counts

    def _ranks(self):
        """[M, L, max P] int32: the EP rank of every physical id of every (microbatch,
        layer), -1 where none. Slots follow slot_begin (ids 0 .. S-1 are the slots,
        EP-rank-major); extra replica ids come from rp_remap_physical_ep_rank."""
        if self._rank_table is None:
            M, L, S = self.num_microbatches, self.num_layers, self.total_slots
            width = max([S] + [int(p) for p in self.num_physical])
            table = np.full((M, L, width), -1, dtype=np.int32)
            slot_rank = np.repeat(np.arange(self.ep_size, dtype=np.int32),
                                  np.diff(self.slot_begin))
            for mb in range(M):
                P = int(self.num_physical[mb])
                if P < 0:
                    continue
                table[mb, :, :S] = slot_rank
                for layer in range(L):
                    for p in range(S, P):
                        table[mb, layer, p] = self._lib.rp_remap_physical_ep_rank(
                            self._plan.handle, mb, layer, p)
            self._rank_table = table
        return self._rank_table

    def dispatch_ranks(self, physical, microbatch=None):
        """EP rank (in the token's own EP group) of each physical id from remap(), as
        rp_remap_physical_ep_rank gives it; -1 stays -1. Extra replica ids are numbered
        per (microbatch, layer), so the microbatch is needed: ``physical`` is either the
        whole step's [tokens, layers, k] array (``microbatch=None``: each token's from
        seq_microbatch) or ids of microbatch ``microbatch`` only, of shape [..., layers,
        k] (e.g. the rows of that microbatch's tokens)."""
        physical = np.asarray(physical)
        L, M = self.num_layers, self.num_microbatches
        if physical.size and physical.dtype.kind not in "iu":
            raise errors.InvalidArgumentError("physical ids must be integers, got %s"
                                              % physical.dtype)
        physical = physical.astype(np.int64, copy=False)
        if physical.ndim < 2 or physical.shape[-2] != L:
            raise errors.InvalidArgumentError(
                "dispatch_ranks takes physical ids shaped [..., layers, k] with %d layers, got "
                "shape %s" % (L, physical.shape))
        if microbatch is None:
            T = int(self.cu_seqlens[-1])
            if physical.ndim != 3 or physical.shape[0] != T:
                raise errors.InvalidArgumentError(
                    "physical ids of shape %s are not the whole step's [%d, %d, k]; give "
                    "microbatch= for the ids of one microbatch" % (physical.shape, T, L))
            seq_of = np.repeat(np.arange(self.num_seqs), np.diff(self.cu_seqlens))
            mb = self.seq_microbatch[seq_of].reshape(-1, 1, 1)
        else:
            mb = _args.integer(microbatch, "microbatch", _args.INT32)
            if not 0 <= mb < M:
                raise errors.InvalidArgumentError("microbatch %d is out of range (the plan has %d)"
                                                  % (mb, M))
        table = self._ranks()
        width = table.shape[2]
        # one gather from the flattened table, whose last entry (-1) takes every id that
        # names no replica
        flat = np.append(table.reshape(-1), np.int32(-1))
        row = (np.asarray(mb, dtype=np.int64) * L + np.arange(L).reshape(L, 1)) * width
        idx = row + physical
        bad = (physical < 0) | (physical >= width)
        if microbatch is None:
            bad |= np.asarray(mb) < 0
        idx[bad] = len(flat) - 1
        return flat[idx]

    def memory(self, gpu):
        """What GPU ``gpu`` holds to train this plan (C rp_memory_gpu, docs/cost-model.md
        "Memory per GPU"): a dict of routepack/memory.h's fields, bytes as floats
        (``extra_replica_bytes``: the plan's extra replicas it holds in the step, weights
        and gradients)."""
        out = _lib.rp_gpu_memory()
        err = _lib.new_error()
        st = self._lib.rp_memory_gpu(self._config.handle, self._plan.handle, int(gpu), ctypes.byref(out),
                                     ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        return {name: getattr(out, name) for name, _ in out._fields_}

    def placement(self, layer):
        """MoE layer ``layer``'s placement in this step, a routepack.placement.ExpertPlacement
        (what routepack.torch.MoELayer.fetch_replicas takes): the slots' experts
        (phy2log[layer]), slot_begin, and per microbatch the (expert, EP rank) rows of its
        extra replicas in plan order (physical id S + i is row i). The same for every EP
        group. Raises InvalidArgumentError for a layer out of range or a plan without
        placement."""
        layer = _args.integer(layer, "layer", _args.INT32, 0, self.num_layers - 1)
        if self.phy2log is None:
            raise errors.InvalidArgumentError("step %d's plan has no placement" % self.step)
        ex = self.extra_replicas[self.extra_replicas[:, 1] == layer]
        extras = [ex[ex[:, 0] == m][:, 2:4].astype(np.int64) for m in range(self.num_microbatches)]
        return ExpertPlacement(self.phy2log[layer].astype(np.int64), self.slot_begin.astype(np.int64), extras)

    def microbatch_tokens(self, rank):
        """Token counts of each microbatch of `rank`."""
        lens = np.diff(self.cu_seqlens)
        return [int(lens[mb].sum()) for mb in self.microbatches[rank]]

    def __repr__(self):
        return ("StepResult(step=%d, plan_hash=%016x, policy=%s %s, step_time_s=%.6g%s%s)"
                % (self.step, self.plan_hash, self.policy_name, self.policy_version,
                   self.step_time_s, ", fallback" if self.fallback else "",
                   ", swapped" if self.swapped else ""))


def from_step(sched, plan, rep, lens):
    """The StepResult of a step that just ran on ``sched`` (a routepack.Scheduler), copied out
    of the C library while its borrowed plan ``plan`` and report ``rep`` are valid."""
    lib = sched._lib
    r = StepResult()
    G = lib.rp_plan_num_gpus(plan)
    M = lib.rp_plan_num_microbatches(plan)
    L = lib.rp_plan_num_layers(plan)
    E = lib.rp_plan_num_experts(plan)
    S = lens.num_seqs
    r.num_gpus, r.num_microbatches, r.num_layers, r.num_experts = G, M, L, E
    r.ep_size = lib.rp_plan_ep_size(plan)
    r.num_seqs = S
    r.cu_seqlens = lens.cu_seqlens
    r._lens = lens
    r._top_k = sched.config.top_k
    r.split_rule = sched.split_rule
    r._num_threads = sched._num_threads
    r._lib, r._ctx, r._config = lib, sched._ctx, sched.config
    r.config = sched.config   # the layout and trainer constraints the adapters check
    r._scheduler = weakref.ref(sched)
    # The step's plan is borrowed until the next step: keep a copy for remap().
    copy = ctypes.c_void_p()
    err = _lib.new_error()
    st = lib.rp_plan_copy(plan, ctypes.byref(copy), ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err)
    r._plan = Owned(copy, lib.rp_plan_free, [sched._ctx, sched.config._owned])
    r.num_physical = np.array([lib.rp_remap_num_physical(copy, m) for m in range(M)],
                              dtype=np.int32)

    # packing
    r.microbatches = []
    r.seq_rank = np.full(S, -1, dtype=np.int32)
    r.seq_microbatch = np.full(S, -1, dtype=np.int32)
    count = ctypes.c_int32()
    for g in range(G):
        row = []
        for m in range(M):
            p = lib.rp_plan_microbatch(plan, g, m, ctypes.byref(count))
            n = count.value
            ids = np.ctypeslib.as_array(p, (n,)).copy() if n and p else np.zeros(0, np.int32)
            row.append(ids)
            if n:
                fresh = ids[(ids >= 0) & (ids < S)]
                fresh = fresh[r.seq_rank[fresh] < 0]
                r.seq_rank[fresh] = g
                r.seq_microbatch[fresh] = m
        r.microbatches.append(row)
    r.microbatch_order = np.array([[lib.rp_plan_microbatch_at(plan, g, k) for k in range(M)] for g in range(G)],
                                  dtype=np.int32).reshape(G, M)

    # placement
    r.total_slots = lib.rp_plan_total_slots(plan)
    r.slot_begin = np.ctypeslib.as_array(lib.rp_plan_slot_begin(plan),
                                         (r.ep_size + 1,)).copy()
    if lib.rp_plan_has_placement(plan):
        R = max([lib.rp_plan_logcnt(plan, l, None) for l in range(L)] + [1])
        r.phy2log = np.empty((L, r.total_slots), dtype=np.int32)
        r.log2phy = np.empty((L, E, R), dtype=np.int32)
        r.logcnt = np.empty((L, E), dtype=np.int32)
        err = _lib.new_error()
        st = lib.rp_plan_eplb_arrays(plan, R, _i32p(r.phy2log), _i32p(r.log2phy),
                                     _i32p(r.logcnt), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
    else:
        r.phy2log = r.log2phy = r.logcnt = None

    # levers
    n = lib.rp_plan_num_extra_replicas(plan)
    r.extra_replicas = np.zeros((n, 4), dtype=np.int32)
    a, b, c, d = (ctypes.c_int32() for _ in range(4))
    for i in range(n):
        lib.rp_plan_extra_replica(plan, i, ctypes.byref(a), ctypes.byref(b), ctypes.byref(c),
                                  ctypes.byref(d))
        r.extra_replicas[i] = (a.value, b.value, c.value, d.value)
    r.shares = {}
    for i in range(lib.rp_plan_num_share_sets(plan)):
        p = lib.rp_plan_share_set(plan, i, ctypes.byref(a), ctypes.byref(b), ctypes.byref(c),
                                  ctypes.byref(d))
        r.shares[(a.value, b.value, c.value)] = (np.ctypeslib.as_array(p, (d.value,)).copy()
                                                 if d.value else np.zeros(0))
    r.plan_hash = int(lib.rp_plan_hash(plan))

    # report
    r.step = int(rep.step)
    cost = rep.cost
    r.step_time_s = cost.step_s
    r.lower_bound_s = cost.lower_bound_s
    r.ratio = cost.ratio
    r.fallback = bool(rep.fallback)
    r.fallback_reason = _lib.text(rep.fallback_reason)
    r.swapped = bool(rep.swapped)
    r.swap_error = _lib.text(rep.swap_error)
    r.failed_steps = int(rep.failed_steps)
    r.demoted = bool(rep.demoted)
    r.demoted_to = _lib.text(rep.demoted_to)
    r.demote_error = _lib.text(rep.demote_error)
    r.policy_name = _lib.text(rep.policy_name)
    r.policy_version = _lib.text(rep.policy_version)
    r.policy_hash = int(rep.policy_hash)
    r.plan_wall_s = rep.plan_wall_s
    r.experts_moved = rep.experts_moved
    r.migration_bytes = rep.migration_bytes
    r.plan_from_rank = int(rep.plan_from_rank)
    r.ranks_disagreed = bool(rep.ranks_disagreed)
    r.ranks_fell_back = int(rep.ranks_fell_back)
    r.report = sched._report_json()
    return r
