"""routepack.Scheduler: the C scheduler (rp_sched_*) from Python. A step takes the batch's
lengths and its routing replay as the trainer holds it and returns the plan as numpy
arrays the caller owns, with the step report (a routepack.StepResult, step_result.py).
The config is config.py's; executing a step's migration is routepack.executor's."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import warnings

import numpy as np

from . import _args, _lib, _routing, distributed, errors, migration, shift, step_result
from ._context import Context, Owned
from .config import Config
from .step_result import _SPLIT, StepResult, _i64p, _raise_step_error  # noqa: F401 (StepResult: routepack.scheduler.StepResult)
from .trace import _new_batch

STATE_FORMAT = "routepack-scheduler-state"

# each option and the C type of its rp_sched_options field (None: a double)
_OPTION_FIELDS = {
    "num_threads": _args.INT32, "history": _args.INT32, "max_instructions": _args.INT64,
    "max_wall_s": None, "max_memory_bytes": _args.SIZE_T, "max_depth": _args.INT32,
}


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
                res = step_result.from_step(self, plan, report.contents, lens)
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

    # ---- the step's migration (executed by routepack.executor) ----

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
        xlib = _lib.require_executor()
        opts = _lib.rp_migration_options()
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

    @contextlib.contextmanager
    def _open_migration(self, res):
        """Under the scheduler's lock: (its handle, step ``res``'s C migration plan or None
        when nothing moves or its failure was reported) for routepack.executor.execute.
        Refused once a later step has been planned: the C plan is borrowed until then, and
        the scheduler plans each step from the one before as executed (docs/migration.md,
        "With the scheduler")."""
        with self._lock:
            handle = self._handle()
            if self.last is not res:
                raise errors.InvalidArgumentError(
                    "step %d's migration cannot run now: %s; execute a step's migration after its "
                    "step and before the next is planned" % (
                        res.step, "this scheduler planned step %d since" % self.last.step
                        if self.last is not None else "this scheduler did not plan it"))
            yield handle, self._lib.rp_sched_migration(handle)

    def execute_migration(self, registry, transport, *args, **kw):
        """The former call form of routepack.executor.execute(res, registry, transport, ...)
        for the last step's result; FutureWarning."""
        warnings.warn("Scheduler.execute_migration(registry, transport, ...) runs the last step's "
                      "migration; call routepack.executor.execute(res, registry, transport, ...) with "
                      "the step's result", FutureWarning, stacklevel=2)
        from . import executor
        return executor.execute(self.last, registry, transport, *args, **kw) if self.last else None

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
