"""routepack.Scheduler: the C scheduler (rp_sched_*) from Python. A step takes the batch's
lengths and its routing replay as the trainer holds it and returns the plan as numpy
arrays the caller owns, with the step report."""

from __future__ import annotations

import ctypes
import json
import os
import threading

import numpy as np

from . import _args, _lib, _routing, distributed, errors, migration, shift
from ._context import Context, Owned
from .trace import _new_batch

_SPLIT = {"even": 0, "locality": 1}
_SIDES = {0: "attention", 1: "dispatch", 2: "expert", 3: "combine"}
STATE_FORMAT = "routepack-scheduler-state"

# each option and the C type of its rp_sched_options field (None: a double)
_OPTION_FIELDS = {
    "num_threads": _args.INT32, "history": _args.INT32, "max_instructions": _args.INT64,
    "max_wall_s": None, "max_memory_bytes": _args.SIZE_T, "max_depth": _args.INT32,
}


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


def _demote_after(value):
    """rp_sched_options.demote_after for the Scheduler option: a positive number of steps,
    or None (or -1) for never. 0 and other negatives are refused: C reads 0 as "the
    default" and any negative as "never", which a caller writing 0 does not mean."""
    if value is None:
        return -1
    n = _args.integer(value, "demote_after", _args.INT32)
    if n == -1 or n >= 1:
        return n
    raise errors.RangeError("demote_after is %d; it must be a positive number of steps in a row that "
                            "fell back (default 3), or None (or -1) to never demote" % n, errors.ERANGE)


def _config_bytes(config):
    """('path', bytes) or ('text', bytes, name) for a config given as a path, a JSON text
    or a dict."""
    if isinstance(config, dict):
        return ("text", json.dumps(config).encode("utf-8"), b"<dict>")
    if isinstance(config, bytes):
        config = config.decode("utf-8")
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return ("text", config.encode("utf-8"), b"<inline>")
    if isinstance(config, (str, os.PathLike)):
        return ("path", _args.c_path(config, "config"))
    raise TypeError("config must be a path, a JSON text or a dict, got %s" % type(config).__name__)


class Config:
    """A loaded and validated config (rp_config). Errors raise ConfigError with the C
    message (file:line:column and the JSON path)."""

    def __init__(self, config, ctx):
        self._lib = _lib.load()
        self._ctx = ctx
        handle = ctypes.c_void_p()
        err = _lib.new_error()
        kind = _config_bytes(config)
        if kind[0] == "path":
            st = self._lib.rp_config_load(ctx.handle, kind[1], ctypes.byref(handle),
                                          ctypes.byref(err))
        else:
            st = self._lib.rp_config_parse(ctx.handle, kind[1], len(kind[1]), kind[2],
                                           ctypes.byref(handle), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err, cls=errors.ConfigError)
        self._owned = Owned(handle, self._lib.rp_config_free, [ctx])
        topo = self._lib.rp_config_topology(handle).contents
        model = self._lib.rp_config_model(handle).contents
        self.num_gpus = topo.num_gpus
        self.gpus_per_node = topo.gpus_per_node
        self.num_nodes = topo.num_nodes
        self.ep_size = topo.ep_size
        self.slots = np.ctypeslib.as_array(topo.slots, (topo.ep_size,)).copy()
        # the Megatron layout (docs/config.md, "topology"): a plan's rank is a TP x CP group
        self.tensor_parallel_size = topo.tensor_parallel_size
        self.context_parallel_size = topo.context_parallel_size
        self.expert_tensor_parallel_size = topo.expert_tensor_parallel_size
        self.expert_parallel_size = topo.expert_parallel_size
        self.num_layers = model.num_layers
        self.num_experts = model.num_experts
        self.top_k = model.top_k
        limits = self._lib.rp_config_limits(handle).contents
        self.max_tokens_per_microbatch = limits.max_tokens_per_microbatch
        trainer = self._lib.rp_config_trainer(handle).contents
        # what the trainer demands of a packing (docs/config.md, "trainer")
        self.equal_sequences_per_rank = bool(trainer.equal_sequences_per_rank)
        self.microbatch_multiple = trainer.microbatch_multiple
        self.nonempty_microbatches = bool(trainer.nonempty_microbatches)
        # the trainer runs Megatron's per-forward balancer on plans that ask for it
        self.per_forward_balancer = bool(trainer.per_forward_balancer)
        # how a rollout batch is trained: mini-batches of M / mini_batches consecutive
        # microbatches, one optimizer step each, epochs times (verl's ppo_mini_batch_size,
        # ppo_epochs)
        self.mini_batches = trainer.mini_batches
        self.epochs = trainer.epochs
        execution = self._lib.rp_config_execution(handle).contents
        # what the memory check counts (docs/cost-model.md, "Memory per GPU")
        self.optimizer_sharding = ("none", "dp")[execution.optimizer_sharding]
        self.staging_budget_bytes = execution.staging_budget_bytes

    @property
    def handle(self):
        return self._owned.handle

    def free(self):
        """Drop the config (freed once no scheduler made from it is left)."""
        self._owned.close()


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
    routepack.migration.Migration copy, or None when the placement did not change."""

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
        Torch in, torch out: given a torch tensor (CPU or CUDA; a CUDA one is read through
        a host copy), ids and counts are tensors on its device; else numpy arrays."""
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

    def microbatch_tokens(self, rank):
        """Token counts of each microbatch of `rank`."""
        lens = np.diff(self.cu_seqlens)
        return [int(lens[mb].sum()) for mb in self.microbatches[rank]]

    def __repr__(self):
        return ("StepResult(step=%d, plan_hash=%016x, policy=%s %s, step_time_s=%.6g%s%s)"
                % (self.step, self.plan_hash, self.policy_name, self.policy_version,
                   self.step_time_s, ", fallback" if self.fallback else "",
                   ", swapped" if self.swapped else ""))


class Scheduler:
    """A RoutePack scheduler.

    ``config``: a path, a JSON text or a dict (docs/config.md). ``policy``: a policy
    name, a path, or "PACKING+PLACEMENT" (None: the config's). Options (rp_sched_options):
    ``split`` ('even' or 'locality'), ``params`` (the policy's params, a dict or JSON
    text; default: the config's policy.params), ``seed``, ``initial_placement``
    ("contiguous" or a plan file whose placement is in use before the first step;
    default: the config's policy.initial_placement), ``num_threads``, ``history``,
    ``max_instructions``, ``max_wall_s``, ``max_memory_bytes``, ``max_depth``,
    ``demote_after`` (a policy whose steps fall back this many times in a row is demoted
    to the policy it replaced, else attn_kk; default 3; None or -1: never;
    docs/policies.md, Demotion), ``comm`` (a routepack.Comm: the ranks of a multi-rank job agree on every plan and
    every fallback, docs/distributed.md); and
    ``log_level`` ('debug' ..
    'error', None to silence) for the messages the library sends to the `routepack`
    logger.

    A scheduler is used by one thread at a time (calls are serialised by a lock; the GIL
    is released while C runs, so planning step t+1 on a thread overlaps the trainer's
    step t). Free it with close() or a with-block; it is also freed when collected."""

    def __init__(self, config, policy=None, **options):
        self._lib = _lib.require_scheduler()
        self._lock = threading.Lock()
        self._owned = None
        self._spare_stats = None  # what step_from_stats(take=True) gave back
        log_level = options.pop("log_level", "warning")
        split = options.pop("split", "even")
        if split not in _SPLIT:
            raise errors.InvalidArgumentError("split must be 'even' or 'locality', got %r"
                                              % (split,))
        comm = options.pop("comm", None)
        if comm is not None and not isinstance(comm, distributed.Comm):
            raise errors.InvalidArgumentError("comm must be a routepack.Comm, got %s"
                                              % type(comm).__name__)
        unknown = sorted(set(options) - set(_OPTION_FIELDS)
                         - {"params", "seed", "initial_placement", "demote_after"})
        if unknown:
            raise TypeError("unknown Scheduler option%s: %s (known: split, log_level, params, "
                            "seed, initial_placement, demote_after, comm, %s)"
                            % ("s" if len(unknown) > 1 else "", ", ".join(unknown),
                               ", ".join(sorted(_OPTION_FIELDS))))
        self._ctx = Context(log_level)
        self.config = Config(config, self._ctx)
        self.split_rule = split
        opts = _lib.rp_sched_options()
        self._lib.rp_sched_options_default(ctypes.byref(opts))
        self._policy_bytes = None
        if policy is not None:
            self._policy_bytes = _args.c_path(policy, "policy")
            opts.policy = self._policy_bytes
        opts.split = _SPLIT[split]
        params = options.pop("params", None)
        if params is not None:
            self._params_bytes = _args.c_text(params if isinstance(params, (str, bytes))
                                              else json.dumps(params), "params")
            opts.params_json = self._params_bytes
        if "seed" in options:
            opts.seed = _args.integer(options.pop("seed"), "seed", _args.UINT64)
        initial = options.pop("initial_placement", None)
        if initial is not None:
            self._initial_bytes = _args.c_path(initial, "initial_placement")
            opts.initial_placement = self._initial_bytes
        if "demote_after" in options:
            opts.demote_after = _demote_after(options.pop("demote_after"))
        for key, ctype in _OPTION_FIELDS.items():
            if key in options:
                setattr(opts, key, _args.number(options[key], key) if ctype is None
                        else _args.integer(options[key], key, ctype))
        self._num_threads = int(opts.num_threads)
        # the callbacks must outlive the C scheduler, which copies the rp_comm
        self.comm = comm
        if comm is not None:
            opts.comm = comm.pointer()
        sched = ctypes.c_void_p()
        err = _lib.new_error()
        st = self._lib.rp_sched_new(self._ctx.handle, self.config.handle, ctypes.byref(opts),
                                    ctypes.byref(sched), ctypes.byref(err))
        if st != errors.OK:
            self.config.free()
            _lib.raise_error(st, err)
        self._owned = Owned(sched, self._lib.rp_sched_free, [self.config._owned, self._ctx])
        self._next_step = 0
        self.last = None

    # ---- lifetime ----

    @property
    def _sched(self):
        return self._owned.handle if self._owned is not None else None

    def close(self):
        """Free the scheduler (results already returned stay valid)."""
        with self._lock:
            if self._owned is not None:
                self._owned.close()
            if getattr(self, "config", None) is not None:
                self.config.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _handle(self):
        if not self._sched:
            raise errors.InvalidArgumentError("the scheduler is closed")
        return self._sched

    def _errmsg(self):
        return _lib.text(self._lib.rp_sched_errmsg(self._sched)) if self._sched else ""

    def _fail(self, st, err, cls=None):
        if not err.text:
            msg = _lib.text(self._lib.rp_sched_errmsg(self._sched)) if self._sched else ""
            _lib.raise_error(st, err, message=msg or None, cls=cls)
        _lib.raise_error(st, err, cls=cls)

    # ---- the step ----

    @property
    def next_step(self):
        """The step index step() uses when none is given."""
        return self._next_step

    def step(self, seq_lens, routing, step=None, group_ids=None, cu_seqlens=None, *,
             layout=None, physical=False):
        """Plan one step.

        ``seq_lens``: per-sequence lengths (whole lengths, an [S, 2] array of (prompt,
        response), or a (prompt_lens, response_lens) pair); may be None when
        ``cu_seqlens`` is given or the routing is per sequence. ``routing``: one [tokens,
        layers, k] array (with seq_lens or cu_seqlens), a list of per-sequence
        (seq_len, layers, k) arrays (vLLM/SGLang R3), or a list of per-layer [tokens, k]
        arrays (Megatron router replay); numpy arrays, CPU tensors (DLPack) or
        __array_interface__ objects. uint8/uint16/int32 ids are read in place, other
        integer dtypes converted once. One packed array in GPU memory (a torch CUDA
        tensor, __cuda_array_interface__; uint8/uint16/int32) is read in place too: the
        statistics come from the C library's histogram kernel (docs/python.md). The C
        library borrows the routing only during this call. ``step``: the step index (default: one past the previous).
        ``physical=True`` also fills result.physical_routing and result.slot_tokens
        (StepResult.remap, rp_remap over every microbatch of the new plan).
        """
        cfg = self.config
        if step is not None:
            step = _args.integer(step, "step", _args.INT64)
        lens, view = _routing.prepare(routing, seq_lens, cu_seqlens, group_ids,
                                      num_layers=cfg.num_layers, top_k=cfg.top_k,
                                      num_experts=cfg.num_experts, layout=layout, device_ok=True)
        if physical and view.device:
            raise errors.RoutingError(
                "physical=True remaps the routing into host arrays, and this routing is in GPU "
                "memory: call step() without it and StepResult.remap(routing.cpu())", errors.ENOTSUP)
        res = self._run(step, lens, lambda handle, idx, batch, plan, report, err:
                        self._lib.rp_sched_step(handle, idx, batch, view.pointer(), plan, report, err),
                        view if physical else None)
        del view   # the C library's borrow of the routing ends with the call
        return res

    def _run(self, step, lens, call, remap_view=None):
        """One step through `call` (rp_sched_step or rp_sched_step_stats), its result
        copied out while the C library's borrowed plan and report are valid."""
        with self._lock:
            handle = self._handle()
            idx = (_args.integer(self._next_step, "step (one past the previous)", _args.INT64)
                   if step is None else step)
            batch = _new_batch(self._lib, self._ctx.handle, lens)
            try:
                plan = ctypes.c_void_p()
                report = ctypes.POINTER(_lib.rp_step_report)()
                err = _lib.new_error()
                if self.comm is not None:
                    self.comm.last_error = None
                st = call(handle, idx, batch, ctypes.byref(plan), ctypes.byref(report),
                          ctypes.byref(err))
                if st != errors.OK:
                    cause = self.comm.last_error if self.comm is not None else None
                    if cause is not None and st == errors.ETRANSPORT:
                        raise errors.TransportError(
                            "%s (in the comm callback: %s: %s)" % (_lib.text(err.text) or self._errmsg(),
                                                                  type(cause).__name__, cause),
                            st) from cause
                    _raise_step_error(st, err, self._errmsg())
                res = self._result(plan, report.contents, lens)
                # Borrowed until the next step: copied now, while it is valid.
                mp = self._lib.rp_sched_migration(handle)
                res.migration = migration.copy_plan(self._lib, mp) if mp else None
                self._next_step = idx + 1
                if remap_view is not None:
                    res.physical_routing, res.slot_tokens = res._remap_view(remap_view, batch)
            finally:
                self._lib.rp_batch_free(batch)
        self.last = res
        return res

    # ---- the distributed step (docs/distributed.md) ----

    def compute_stats(self, seq_lens, routing, cu_seqlens=None, *, layout=None):
        """This rank's routing statistics (rp_stats_compute) from the routing of its own
        sequences, in any form step() takes (seq_lens / cu_seqlens of those sequences, in
        the order of the routing, GPU memory included, as step() takes it): a
        routepack.Stats, whose to_bytes() the ranks exchange. Uses the scheduler's config
        (layers, experts, top_k) and threads."""
        cfg = self.config
        lens, view = _routing.prepare(routing, seq_lens, cu_seqlens, None,
                                      num_layers=cfg.num_layers, top_k=cfg.top_k,
                                      num_experts=cfg.num_experts, layout=layout, device_ok=True)
        batch = _new_batch(self._lib, self._ctx.handle, lens)
        try:
            out = ctypes.c_void_p()
            err = _lib.new_error()
            st = self._lib.rp_stats_compute(self._ctx.handle, batch, view.pointer(), cfg.num_experts,
                                            self._num_threads, ctypes.byref(out), ctypes.byref(err))
            if st != errors.OK:
                _raise_step_error(st, err)
        finally:
            self._lib.rp_batch_free(batch)
        del view
        return distributed.Stats(out, self._ctx)

    def merge_stats(self, parts, global_ids, num_seqs=None, reuse=None):
        """The whole step's statistics (rp_stats_merge_serialized) from every rank's
        serialised part (bytes-like, Stats.to_bytes()) and its global sequence ids (one
        int array per part, in the part's order); ``num_seqs`` defaults to the total. Bit
        for bit rp_stats_compute over the whole batch. ``reuse``: the Stats of an earlier
        merge_stats that are no longer needed (e.g. last step's, after step_from_stats):
        their storage takes this merge and they are gone. Raises InvalidArgumentError
        naming a missing, duplicate or out-of-range id; FormatError, ChecksumError or
        NotSupportedError for bad bytes (the message names the part)."""
        return distributed.merge(self._ctx, parts, global_ids, num_seqs, reuse)

    def stats_from_bytes(self, data):
        """Stats from one serialised part (rp_stats_deserialize, every field checked)."""
        return distributed.from_bytes(self._ctx, data)

    def step_from_stats(self, seq_lens, stats, step=None, group_ids=None, cu_seqlens=None, *, take=False):
        """Plan one step from the whole step's statistics (rp_sched_step_stats), with no
        routing: ``seq_lens`` / ``cu_seqlens`` / ``group_ids`` of every sequence of the
        step in global id order (as step() takes them), ``stats`` the merged statistics
        (a Stats from merge_stats, or the bytes of a whole step's serialised statistics).
        Everything else is step()'s: the same policy, fallback, swap, agreement with the
        other ranks (``comm``), report and StepResult (without physical routing: each
        rank remaps its own tokens with StepResult.remap_rank). Raises
        InvalidArgumentError when the statistics do not describe the batch.

        ``take=True`` (Stats of this scheduler's context only): the scheduler keeps
        ``stats`` themselves instead of a copy (rp_sched_step_stats_take, 48 MB a step
        less to copy at the reference scale); once taken the Stats object is gone (its
        handle says "the statistics were freed"), also when the step then fails. The
        statistics it gives back (the step before's, no longer needed; None at first)
        come from take_spare_stats(), for the next merge_stats(reuse=...)."""
        if step is not None:
            step = _args.integer(step, "step", _args.INT64)
        if not isinstance(stats, distributed.Stats):
            if take:
                raise errors.InvalidArgumentError("take=True needs Stats (from merge_stats), not bytes")
            stats = self.stats_from_bytes(stats)
        lens = _routing.lengths(seq_lens, cu_seqlens, group_ids)
        handle = stats.handle
        if not take:
            return self._run(step, lens, lambda sched, idx, batch, plan, report, err:
                             self._lib.rp_sched_step_stats(sched, idx, batch, handle, plan, report, err))
        if stats._owned._parents[:1] != (self._ctx,):
            raise errors.InvalidArgumentError("take=True needs Stats made in this scheduler's context "
                                              "(its merge_stats or compute_stats)")
        given = handle.value if isinstance(handle, ctypes.c_void_p) else handle
        io = ctypes.c_void_p(given)

        def call(sched, idx, batch, plan, report, err):
            st = self._lib.rp_sched_step_stats_take(sched, idx, batch, ctypes.byref(io), plan, report, err)
            if io.value != given:
                stats._owned.release()  # taken: the scheduler owns (or freed) them now
                if io.value:
                    self._spare_stats = distributed.Stats(ctypes.c_void_p(io.value), self._ctx)
            return st
        return self._run(step, lens, call)

    def take_spare_stats(self):
        """The statistics step_from_stats(take=True) last gave back (the step before's,
        which the scheduler no longer needs), once; None when there are none. Pass them
        to the next merge_stats(reuse=...): the merge then writes into memory already
        faulted in."""
        spare, self._spare_stats = self._spare_stats, None
        return spare

    # ---- router shift (routepack.shift) ----

    def attach_shift(self, old_routing, new_routing, *, layout=None, new_layout=None):
        """Router shift of the last step, attached to its report: ``old_routing`` the
        step's replayed routing, ``new_routing`` the training forward's own top-k ids for the
        same tokens (each in any form step() takes; the last step's lengths). Computes
        rp_shift_compute, hands it to rp_sched_attach_shift, and refreshes ``last.report``
        so ``last.metrics()`` has the router_shift_* keys. Returns the RouterShift. Call it
        after the step's forward (the new ids exist only then), before the next step.
        Raises InvalidArgumentError before any step, RoutingError for routings that do
        not match the step (shapes, an id out of range)."""
        if self.last is None:
            raise errors.InvalidArgumentError("attach_shift: no step has run yet")
        cfg = self.config
        res = self.last
        lens = res._lens
        old_view = _routing.view(*_routing.normalize(old_routing, layout), num_layers=cfg.num_layers,
                                 top_k=cfg.top_k, num_experts=cfg.num_experts, lens=lens)
        new_view = _routing.view(*_routing.normalize(new_routing, new_layout), num_layers=cfg.num_layers,
                                 top_k=cfg.top_k, num_experts=cfg.num_experts, lens=lens)
        with self._lock:
            handle, out = shift.compute(self._lib, self._ctx.handle, lens, old_view, new_view,
                                        cfg.num_experts, self._num_threads)
            try:
                err = _lib.new_error()
                st = self._lib.rp_sched_attach_shift(self._handle(), handle, ctypes.byref(err))
                if st != errors.OK:
                    self._fail(st, err)
            finally:
                self._lib.rp_shift_free(handle)
            res.report = self._report_json()
        return out

    def _result(self, plan, rep, lens):
        lib = self._lib
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
        r._top_k = self.config.top_k
        r.split_rule = self.split_rule
        r._num_threads = self._num_threads
        r._lib, r._ctx, r._config = lib, self._ctx, self.config
        r.config = self.config   # the layout and trainer constraints the adapters check
        # The step's plan is borrowed until the next step: keep a copy for remap().
        copy = ctypes.c_void_p()
        err = _lib.new_error()
        st = lib.rp_plan_copy(plan, ctypes.byref(copy), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        r._plan = Owned(copy, lib.rp_plan_free, [self._ctx, self.config._owned])
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
        r.report = self._report_json()
        return r

    def _report_json(self):
        ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
        err = _lib.new_error()
        st = self._lib.rp_sched_report_json(self._sched, ctypes.byref(ptr), ctypes.byref(length),
                                            ctypes.byref(err))
        if st != errors.OK:
            self._fail(st, err)
        return json.loads(_lib.take_text(self._ctx.handle, ptr, length))

    # ---- policies ----

    def stage_policy(self, path=None, source=None, at_step=None):
        """Stage a policy for hot swap: a name or a file (`path`) or its text (`source`).
        It takes effect at the first step >= at_step (None: the next step) after a dry
        run on the previous step's inputs; if that fails, the running policy stays and
        the step's report says why (result.swap_error). Syntax and metadata errors raise
        PolicyError here at once."""
        if path is None and source is None:
            raise errors.InvalidArgumentError("stage_policy needs a path (or policy name) or a source")
        cpath = _args.c_path(path, "path") if path is not None else None
        csource = _args.c_text(source, "source") if source is not None else None
        at = -1 if at_step is None else _args.integer(at_step, "at_step", _args.INT64, lo=-1)
        with self._lock:
            handle = self._handle()
            err = _lib.new_error()
            st = self._lib.rp_sched_stage_policy(
                handle, cpath, csource, at, ctypes.byref(err))
            if st != errors.OK:
                self._fail(st, err)

    def plan_json(self):
        """The plan in use as plan JSON text (docs/formats.md), or None before the first
        step."""
        with self._lock:
            plan = self._lib.rp_sched_plan(self._handle())
            if not plan:
                return None
            ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
            err = _lib.new_error()
            st = self._lib.rp_plan_to_json(plan, ctypes.byref(ptr), ctypes.byref(length),
                                           ctypes.byref(err))
            if st != errors.OK:
                _lib.raise_error(st, err)
            return _lib.take_text(self._lib.rp_plan_context(plan), ptr, length)

    def report_json(self):
        """The last step's report (rp_sched_report_json) as a dict."""
        with self._lock:
            self._handle()
            return self._report_json()

    # ---- executing the step's migration (routepack.executor) ----

    def initial_placement(self):
        """The placement the scheduler starts from, which the first step's migration moves
        from (rp_plan_set_contiguous: expert e on EP rank floor(e * ep_size / E), spare
        slots empty): phy2log int32 [layers, total slots], -1 for an empty slot. Load the
        expert weights into the slots this way before the first step."""
        lib = self._lib
        cfg = self.config
        plan = ctypes.c_void_p()
        err = _lib.new_error()
        st = lib.rp_plan_new(self._ctx.handle, cfg.handle, 1, ctypes.byref(plan), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        try:
            st = lib.rp_plan_set_contiguous(plan, ctypes.byref(err))
            if st != errors.OK:
                _lib.raise_error(st, err)
            S = lib.rp_plan_total_slots(plan)
            return np.stack([np.ctypeslib.as_array(lib.rp_plan_phy2log(plan, l), (S,)).copy()
                             for l in range(cfg.num_layers)])
        finally:
            lib.rp_plan_free(plan)

    def set_migration_options(self, expert_bytes=None, staging_budget_bytes=None):
        """Expert bytes per MoE layer (what the registry holds: Registry.expert_bytes) and
        the staging budget in bytes (0: no limit, one round) of the migration plans of
        later steps (rp_sched_set_migration_options). ``expert_bytes`` None: the model's;
        ``staging_budget_bytes`` None: the config's execution.staging_budget_bytes, the
        budget the memory check counts."""
        if staging_budget_bytes is None:
            staging_budget_bytes = self.config.staging_budget_bytes
        from . import executor
        xlib = executor.lib()
        opts = executor.rp_migration_options()
        arr = None
        if expert_bytes is not None:
            arr = np.ascontiguousarray(expert_bytes, dtype=np.int64)
            if arr.shape != (self.config.num_layers,):
                raise errors.InvalidArgumentError(
                    "expert_bytes has shape %s; the model has %d MoE layers"
                    % (arr.shape, self.config.num_layers))
            opts.expert_bytes = _i64p(arr)
        opts.staging_budget_bytes = int(staging_budget_bytes)
        with self._lock:
            err = _lib.new_error()
            st = xlib.rp_sched_set_migration_options(self._handle(), ctypes.byref(opts),
                                                     ctypes.byref(err))
            if st != errors.OK:
                self._fail(st, err)

    def execute_migration(self, registry, transport, timeout_s=60.0, ep_group=-1, exchange_timeout_s=0.0,
                          staging=None):
        """Run the last step's migration plan (rp_sched_migration) with the C executor on
        this rank's ``registry`` (routepack.executor.Registry) over ``transport``
        (routepack.executor.CallbackTransport): call on every rank of the transport after
        the step, before the step's placement is used. Returns a MigrationResult (None
        when the step moved nothing). Each round is all-or-nothing on every rank; on a
        failure the scheduler is told (rp_sched_migration_failed: the layers of rounds
        that did not commit go back to their old placement in the plan in use, so the
        next step plans from what the weights are) and MigrationFailed is raised, the
        same on every rank. ``ep_group``: for a transport over one EP group, that group.
        ``timeout_s`` bounds the transfers, ``exchange_timeout_s`` the exchanges between
        ranks (0: ``timeout_s``; docs/migration.md, "Deadlines"). ``staging``: None (the
        executor allocates its staging for the call) or a callable that takes the bytes
        this migration's largest round stages on a GPU and returns the address of that
        much memory of the transport's kind, the caller's, kept for the call (a trainer
        keeps one buffer across steps instead of allocating, and faulting in, staging
        every call)."""
        from . import executor
        xlib = executor.lib()
        with self._lock:
            handle = self._handle()
            mp = self._lib.rp_sched_migration(handle)
            if not mp:
                return None
            opts = executor.rp_migration_exec_options()
            xlib.rp_migration_exec_defaults(ctypes.byref(opts))
            opts.timeout_s = float(timeout_s)
            opts.ep_group = int(ep_group)
            opts.exchange_timeout_s = float(exchange_timeout_s)
            if staging is not None:
                summary = _lib.rp_migration_summary()
                self._lib.rp_migration_plan_summary(mp, ctypes.byref(summary))
                if summary.max_staging_bytes > 0:
                    opts.staging = staging(int(summary.max_staging_bytes))
                    opts.staging_bytes = int(summary.max_staging_bytes)
            raw = executor.rp_migration_result()
            err = _lib.new_error()
            st = xlib.rp_migration_execute(mp, registry.handle, transport.handle,
                                           ctypes.byref(opts), ctypes.byref(raw),
                                           ctypes.byref(err))
            if st == errors.OK:
                return executor.MigrationResult(raw)
            text = _lib.text(err.text)
            result = executor.MigrationResult(raw, st, text)
            ferr = _lib.new_error()
            fst = xlib.rp_sched_migration_failed(handle, ctypes.byref(raw), ctypes.byref(ferr))
            if fst != errors.OK:
                text += "; the scheduler could not take the failure back: " + _lib.text(ferr.text)
        raise executor.MigrationFailed(text, st, result)

    # ---- checkpoint and resume ----

    def state_dict(self):
        """The scheduler's state (placement in use, policy state, history, next step) as a
        JSON-serialisable dict, to save beside the trainer's checkpoint. Needs
        rp_sched_save_state in libroutepack (NotSupportedError otherwise)."""
        if not _lib.has("rp_sched_save_state"):
            raise errors.NotSupportedError(
                "this libroutepack (%s) cannot save scheduler state: it has no "
                "rp_sched_save_state" % _lib.path())
        with self._lock:
            handle = self._handle()
            ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
            err = _lib.new_error()
            st = self._lib.rp_sched_save_state(handle, ctypes.byref(ptr), ctypes.byref(length),
                                               ctypes.byref(err))
            if st != errors.OK:
                self._fail(st, err)
            state = _lib.take_text(self._ctx.handle, ptr, length)
            return {"format": STATE_FORMAT, "version": 1, "next_step": self._next_step,
                    "state": state}

    def load_state_dict(self, state):
        """Restore what state_dict() returned (into a scheduler made with the same config
        and policy); the following steps plan exactly as the saved scheduler's would."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise errors.InvalidArgumentError("not a RoutePack scheduler state (format %r)"
                                              % (state.get("format") if isinstance(state, dict)
                                                 else type(state).__name__))
        if state.get("version") != 1:
            raise errors.NotSupportedError("scheduler state version %r (this binding reads 1)"
                                           % (state.get("version"),))
        if not _lib.has("rp_sched_load_state"):
            raise errors.NotSupportedError(
                "this libroutepack (%s) cannot restore scheduler state: it has no "
                "rp_sched_load_state" % _lib.path())
        if not isinstance(state.get("state"), str):
            raise errors.InvalidArgumentError("state['state'] must be the state text (a str), got %s"
                                              % type(state.get("state")).__name__)
        next_step = _args.integer(state.get("next_step"), "state['next_step']", _args.INT64)
        text = state["state"].encode("utf-8")
        with self._lock:
            handle = self._handle()
            err = _lib.new_error()
            st = self._lib.rp_sched_load_state(handle, text, len(text), ctypes.byref(err))
            if st != errors.OK:
                self._fail(st, err)
            self._next_step = next_step

    def save_state(self, path):
        """Write state_dict() to `path` as JSON (atomically: a temporary file renamed)."""
        data = json.dumps(self.state_dict())
        tmp = "%s.tmp%d" % (os.fspath(path), os.getpid())
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(tmp, path)

    def load_state(self, path):
        """Restore the state save_state() wrote."""
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))


def can_checkpoint():
    """Whether the loaded libroutepack can save and restore scheduler state."""
    return _lib.has("rp_sched_save_state") and _lib.has("rp_sched_load_state")


def list_policies(config):
    """The policies found on the search path (the config's policy.search_path,
    RP_POLICY_PATH, the shipped ones), each a dict of name, version, api, description,
    path, hash and shadowed (an earlier directory has one of the same name)."""
    lib = _lib.require_scheduler()
    ctx = Context()
    cfg = Config(config, ctx)
    infos = ctypes.POINTER(_lib.rp_policy_info)()
    count = ctypes.c_int32()
    err = _lib.new_error()
    st = lib.rp_policy_list(ctx.handle, cfg.handle, ctypes.byref(infos),
                            ctypes.byref(count), ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err)
    try:
        out = []
        for i in range(count.value):
            p = infos[i]
            out.append({"name": _lib.text(p.name), "version": _lib.text(p.version),
                        "api": p.api, "description": _lib.text(p.description),
                        "path": _lib.text(p.path), "hash": "%016x" % p.hash,
                        "shadowed": bool(p.shadowed)})
        return out
    finally:
        lib.rp_text_free(ctx.handle, ctypes.cast(infos, ctypes.c_void_p))
        cfg.free()


def describe_policy(name_or_path, config):
    """Load a policy (a name on the search path, or a path), check it as a scheduler
    would, and describe it: name, version, api, description, path, hash, has_init and
    its params with types, defaults and ranges."""
    lib = _lib.require_scheduler()
    if not _lib.has("rp_policy_describe"):
        raise errors.NotSupportedError("this libroutepack has no rp_policy_describe")
    ctx = Context()
    cfg = Config(config, ctx)
    try:
        ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
        err = _lib.new_error()
        st = lib.rp_policy_describe(ctx.handle, cfg.handle,
                                    _args.c_path(name_or_path, "policy"), ctypes.byref(ptr),
                                    ctypes.byref(length), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        return json.loads(_lib.take_text(ctx.handle, ptr, length))
    finally:
        cfg.free()
