"""DistributedScheduler: the RoutePack step inside a torch.distributed job. Each rank passes
only its own sequences' routing replay; statistics are computed where the routing lives
(the CUDA kernels for CUDA tensors, the C scan for host memory), only their compact bytes
are exchanged, and every rank plans the same step from them (rp_sched_step_stats), with
plan hashes and any fallback agreed through torch.distributed (the scheduler's rp_comm)."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

import routepack
from .. import errors
from .comm import TorchComm, all_gather_bytes, device_of

# ids the binding reads in GPU memory in place (others are converted to int32 on the device)
_DEVICE_IDS = (torch.uint8, torch.int16, torch.int32)


def _stats_routing(routing):
    """The routing as Scheduler.compute_stats takes it: a CUDA tensor in place (the
    binding hands its pointer to the histogram kernel), converted to int32 on its device
    first when its ids are wider; a CPU tensor as its numpy view; anything else as it is."""
    if not torch.is_tensor(routing):
        return routing
    if routing.is_cuda:
        return routing if routing.dtype in _DEVICE_IDS else routing.to(torch.int32)
    return routing.numpy()


def _ndim(x):
    """Dimensions of an array or tensor; None for anything else (a list is read as [n])."""
    nd = getattr(x, "ndim", None)
    return nd if isinstance(nd, int) else None


def _lengths_first(seq_lens, routing, call):
    """(seq_lens, routing) in the order Scheduler.step takes them. The former order,
    (routing, seq_lens), is told apart by the arrays' dimensions (routing has 3, lengths
    1) and still runs with a FutureWarning; lengths of any other shape are refused before
    any collective."""
    if _ndim(seq_lens) == 3 and _ndim(routing) == 1:
        warnings.warn("DistributedScheduler.%s(routing, seq_lens, ...) is the old argument order; pass "
                      "%s(seq_lens, routing, global_ids, ...) as Scheduler.step takes them" % (call, call),
                      FutureWarning, stacklevel=3)
        return routing, seq_lens
    if _ndim(seq_lens) not in (None, 1):
        raise errors.InvalidArgumentError(
            "seq_lens has %d dimensions; DistributedScheduler.%s(seq_lens [n], routing [tokens, layers, "
            "k], global_ids [n], ...) takes this rank's lengths first" % (_ndim(seq_lens), call))
    return seq_lens, routing


class DistributedScheduler:
    """A routepack.Scheduler whose every step is planned from all ranks' sequences while
    each rank holds only its own routing.

    ``config``, ``policy`` and ``options`` are Scheduler's; ``group``: the ranks that plan
    together (None: the world; rank r of the group is plan GPU r). Creating it is not
    collective; every step is (every rank calls step() for every step, in order).

    step(seq_lens, routing, global_ids, group_ids=None, step=None) -> StepResult: the plan
    of the whole step, the same on every rank (plan_hash); lengths first and routing
    second, as routepack.Scheduler.step(seq_lens, routing, ...). ``seq_lens``: this
    rank's sequences' lengths (int [n]), ``routing``: their ids [tokens, layers, k] (a
    CPU or CUDA tensor of uint8/int16/int32, or a numpy array; CUDA tensors are counted
    by the CUDA kernels where the library has them), ``global_ids``: their ids in the
    step (int [n], 0 .. S-1 over all ranks, each id on exactly one rank), ``group_ids``:
    their GRPO group ids. The former order, step(routing, seq_lens, ...), is told apart
    by the arrays' dimensions (routing has 3, lengths 1) and still runs, with a
    FutureWarning; it will be refused in a later release. step_ahead takes the same
    arguments. Physical routing: StepResult.remap_rank on the tokens a rank runs (a
    tensor on the routing's device when given a tensor).

    Bytes a rank sends per step: its statistics (64 + n + the histogram bytes,
    routepack/stats.h), 8 bytes of size, 12 bytes per sequence (id, length, group), and
    the scheduler's agreement (two all_gathers of 16 bytes, more when ranks disagree);
    with all_gather it receives every rank's parts, padded to the largest
    (docs/torch.md)."""

    def __init__(self, config, policy=None, group=None, *, plan_ahead=False, **options):
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device_of(group)
        # Planning ahead runs the step's collectives on a host thread while the trainer's
        # run on theirs: a group of its own keeps the two streams of collectives apart
        # (each group sees its own in one order on every rank).
        self.plan_ahead = bool(plan_ahead)
        if self.plan_ahead:
            ranks = list(range(self.size)) if group is None else dist.get_process_group_ranks(group)
            group = dist.new_group(ranks=ranks, use_local_synchronization=True)
        self.group = group
        self.comm = TorchComm(group, self.device)
        self.scheduler = routepack.Scheduler(config, policy, comm=self.comm, **options)
        self.config = self.scheduler.config
        if self.config.num_gpus != self.size:
            raise errors.InvalidArgumentError("the config has %d GPUs; the group has %d ranks"
                                              % (self.config.num_gpus, self.size))
        self.last_exchange_bytes = None   # the last step taken's (step() or result()); also res.exchange_bytes
        # statistics no longer needed (the scheduler gives back the step before's): the next
        # merge takes their storage (merge_stats's reuse) instead of faulting in fresh
        # pages, 50 MB a step at the reference scale
        self._spare_stats = None
        self._ahead = None   # the PlannedStep in flight (plan_ahead)

    # ---- the plain scheduler's calls, once no plan is in flight ----

    def _idle(self, call):
        """The plain routepack.Scheduler, for ``call``; refused while a plan is in flight."""
        ahead = self._ahead
        if ahead is not None and not ahead.done():
            raise errors.InvalidArgumentError(
                "a plan is in flight (step_ahead of step %s): take it with .result() before "
                "calling the scheduler's %s" % (ahead.step, call))
        return self.scheduler

    @property
    def last(self):
        """The StepResult of the last step planned (None before the first)."""
        return self.scheduler.last

    @property
    def next_step(self):
        return self.scheduler.next_step

    def initial_placement(self):
        """Scheduler.initial_placement()."""
        return self._idle("initial_placement").initial_placement()

    def set_migration_options(self, expert_bytes=None, staging_budget_bytes=None):
        """Scheduler.set_migration_options()."""
        return self._idle("set_migration_options").set_migration_options(expert_bytes, staging_budget_bytes)

    def stage_policy(self, path=None, source=None, at_step=None):
        """Scheduler.stage_policy() (every rank stages the same policy)."""
        return self._idle("stage_policy").stage_policy(path, source, at_step)

    def plan_json(self):
        """Scheduler.plan_json()."""
        return self._idle("plan_json").plan_json()

    def report_json(self):
        """Scheduler.report_json()."""
        return self._idle("report_json").report_json()

    def state_dict(self):
        """Scheduler.state_dict() (the same on every rank)."""
        return self._idle("state_dict").state_dict()

    def load_state_dict(self, state):
        """Scheduler.load_state_dict() (every rank loads the same state)."""
        return self._idle("load_state_dict").load_state_dict(state)

    def close(self):
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None
        if self._spare_stats is not None:
            self._spare_stats.close()
            self._spare_stats = None
        self.scheduler.close()

    def _stats(self, routing, lens):
        """This rank's Stats: the C library's rp_stats_compute on the routing where it lives
        (Scheduler.compute_stats: the histogram kernel for a CUDA tensor, the C scan for
        host memory)."""
        return self.scheduler.compute_stats(lens, _stats_routing(routing))

    def step(self, seq_lens, routing, global_ids, group_ids=None, step=None):
        seq_lens, routing = _lengths_first(seq_lens, routing, "step")
        if self._ahead is not None:
            raise errors.InvalidArgumentError(
                "a plan is in flight (step_ahead of step %s): take it with .result() first"
                % self._ahead.step)
        res = self._step(seq_lens, routing, global_ids, group_ids, step)
        self.last_exchange_bytes = res.exchange_bytes
        return res

    def _step(self, seq_lens, routing, global_ids, group_ids=None, step=None):
        lens = np.asarray(seq_lens.cpu() if torch.is_tensor(seq_lens) else seq_lens, dtype=np.int64)
        ids = np.asarray(global_ids.cpu() if torch.is_tensor(global_ids) else global_ids, dtype=np.int64)
        groups = np.zeros(len(lens), np.int64) if group_ids is None else \
            np.asarray(group_ids.cpu() if torch.is_tensor(group_ids) else group_ids, dtype=np.int64)
        if not (len(lens) == len(ids) == len(groups)):
            raise errors.InvalidArgumentError("%d lengths, %d global ids and %d group ids: one of each per "
                                              "sequence" % (len(lens), len(ids), len(groups)))
        part = self._stats(routing, lens).to_bytes()
        # Every collective below runs on every rank, whatever its part holds.
        meta = np.stack([ids, lens, groups], axis=1).astype(np.int32)
        metas = all_gather_bytes(meta.tobytes(), self.group, self.device)
        parts = all_gather_bytes(part, self.group, self.device)
        exchange = {"sent": len(part) + meta.nbytes + 16,
                    "received": sum(len(p) for p in parts) + sum(len(m) for m in metas) + 16 * self.size}
        per_rank = [np.frombuffer(m, dtype=np.int32).reshape(-1, 3) for m in metas]
        S = sum(len(m) for m in per_rank)
        all_lens = np.zeros(S, np.int32)
        all_groups = np.zeros(S, np.int32)
        for m in per_rank:
            if len(m) and (m[:, 0].min() < 0 or m[:, 0].max() >= S):
                raise errors.InvalidArgumentError("a global sequence id is outside 0 .. %d" % (S - 1))
            all_lens[m[:, 0]] = m[:, 1]
            all_groups[m[:, 0]] = m[:, 2]
        # on error the spare stays valid (and kept); on success it is gone into the merge
        merged = self.scheduler.merge_stats(parts, [m[:, 0] for m in per_rank], S, reuse=self._spare_stats)
        self._spare_stats = None
        try:
            # the scheduler keeps the merge itself (no 48 MB copy at the reference scale)
            # and gives back the step before's, which the next merge fills
            res = self.scheduler.step_from_stats(all_lens, merged, step=step, take=True,
                                                 group_ids=all_groups if group_ids is not None else None)
            res.exchange_bytes = exchange    # travels with its step (planned ahead: on the thread)
            return res
        finally:
            spare = self.scheduler.take_spare_stats()
            self._spare_stats = spare if merged._owned.handle is None else merged

    def step_ahead(self, seq_lens, routing, global_ids, group_ids=None, step=None):
        """step()'s plan made on a host thread, so that it overlaps what the trainer does
        next (the step before's training): call it as soon as the step's rollout has ended,
        on every rank, and take the plan with ``.result()`` when the trainer needs it. The
        thread runs all of step(): this rank's statistics, their exchange (the scheduler's
        own process group: made at construction with ``plan_ahead=True``, required here),
        the merge and the C step, which releases the GIL while it plans. Returns a
        PlannedStep.

        The plan is step()'s, bit for bit, whatever the timing: the same inputs, the same
        collectives in the same order on every rank. One plan is in flight at a time, and
        nothing else may be called on the scheduler (stage_policy, the migration of the
        step before, ...) until its ``result()`` is taken; call step_ahead for step t + 1
        after step t's migration. A plan that is late is waited for by ``result()``, never
        skipped; an error of the step is raised there. ``routing`` is read on the thread:
        keep it unchanged until ``result()`` returns (a CUDA tensor: written on the
        current stream before the call)."""
        seq_lens, routing = _lengths_first(seq_lens, routing, "step_ahead")
        if not self.plan_ahead:
            raise errors.InvalidArgumentError(
                "step_ahead needs DistributedScheduler(..., plan_ahead=True), which gives the "
                "planning thread its own process group")
        if self._ahead is not None:
            raise errors.InvalidArgumentError(
                "a plan is in flight (step_ahead of step %s): take it with .result() first"
                % self._ahead.step)
        self._ahead = PlannedStep(self, (seq_lens, routing, global_ids, group_ids, step), step)
        return self._ahead


class PlannedStep:
    """A step planned on a host thread (DistributedScheduler.step_ahead). ``result()``
    waits for it and returns its StepResult (or raises the step's error); ``planning_s``:
    the thread's wall time for the whole step (statistics, exchange, merge, plan);
    ``waited_s``: how long ``result()`` blocked the caller (0 when the plan was ready),
    the part of the planning the trainer did not hide."""

    def __init__(self, sched, args, step):
        self.step = step
        self.planning_s = None
        self.waited_s = None
        self._sched = sched
        self._value = None
        self._error = None
        self._thread = threading.Thread(target=self._run, args=args, name="routepack-plan-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self, *args):
        t0 = time.perf_counter()
        try:
            self._value = self._sched._step(*args)
        except BaseException as e:  # noqa: BLE001 (raised by result() on the trainer's thread)
            self._error = e
        self.planning_s = time.perf_counter() - t0

    def done(self):
        """Whether the plan is ready (result() will not wait)."""
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()

    def result(self):
        if self.waited_s is None:
            t0 = time.perf_counter()
            self._thread.join()
            self.waited_s = time.perf_counter() - t0
            if self._sched._ahead is self:
                self._sched._ahead = None
        if self._error is not None:
            raise self._error
        # the trainer's thread, not the planner's, updates what "the last step" sent
        self._sched.last_exchange_bytes = self._value.exchange_bytes
        return self._value
