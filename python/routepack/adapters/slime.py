"""A RoutePack plan in the form slime's trainer takes: the four results of
``slime.utils.dp_schedule.build_dp_schedule``, which slime's
``RolloutManager._split_train_data_by_dp`` (slime/ray/rollout.py) hands each DP rank as
``partition``, ``micro_batch_indices``, ``num_microbatches`` and ``global_batch_sizes``.

Read against THUDM/slime commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
(slime/utils/dp_schedule.py: build_dp_schedule and the invariants its docstring states;
slime/ray/rollout.py: _split_train_data_by_dp; slime/backends/megatron_utils/model.py:
train's use of num_microbatches and global_batch_sizes). No slime code is used or needed
here; docs/adapters.md shows where the lists go."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import errors
from . import _plan


@dataclass(frozen=True)
class DPSchedule:
    """One rollout batch's schedule for slime, in build_dp_schedule's shapes.

    ``partitions``: ``[dp_size]`` lists of int, the sample indices (the plan's sequence ids,
    indices of the rollout batch) DP rank r trains, optimizer step after optimizer step,
    micro-batch after micro-batch in run order.
    ``micro_batch_indices``: ``[dp_size]`` lists of lists of int, rank r's micro-batches as
    indices into ``partitions[r]``, every step's in turn; flattened they are
    ``range(len(partitions[r]))``.
    ``num_microbatches``: list of int, one per optimizer step: the micro-batches every rank
    runs in it (the same on every rank, as slime's pipeline needs).
    ``global_batch_sizes``: list of int, one per optimizer step: the rollouts it holds.
    ``as_tuple()`` gives the four in build_dp_schedule's order."""

    partitions: list
    micro_batch_indices: list
    num_microbatches: list
    global_batch_sizes: list

    def as_tuple(self):
        return self.partitions, self.micro_batch_indices, self.num_microbatches, self.global_batch_sizes


def dp_schedule(res, *, dp_size=None, rollout_ids=None):
    """The plan of StepResult ``res`` as slime's build_dp_schedule would return it; ``res``'s
    sequence ids are the indices of the rollout batch slime splits (``data["tokens"]``), and
    a plan's rank is a DP rank (a TP x CP group: docs/config.md). Optimizer step k is the
    plan's mini-batch k (``trainer.mini_batches``; its micro-batches k M / K .. (k + 1) M / K
    - 1), in the order each rank runs them.

    ``dp_size``: slime's DP size, checked against the plan's ranks (default: the plan's).
    ``rollout_ids``: the rollout of each sample (slime's ``data["rollout_ids"]``); with it,
    ``global_batch_sizes`` counts each step's distinct rollouts and every rollout must lie
    in one step (slime reduces the loss per rollout); without it, one rollout a sample.

    Raises PlanError where slime cannot run the plan: a sample in no micro-batch or in two,
    an empty micro-batch (slime never makes one: its scheduler asserts), a run order that
    leaves a mini-batch, or a rollout split over optimizer steps; InvalidArgumentError for
    a bad argument."""
    lists = _plan.microbatches(res)
    G, M, S = len(lists), int(res.num_microbatches), int(res.num_seqs)
    if dp_size is not None and int(dp_size) != G:
        raise errors.InvalidArgumentError(
            "the plan has %d DP ranks (a plan's rank is a TP x CP group of %d GPUs), but dp_size is %d"
            % (G, _plan.config_value(res, "tensor_parallel_size", 1)
               * _plan.config_value(res, "context_parallel_size", 1), dp_size))
    placed = sum(len(ids) for row in lists for ids in row)
    if placed != S:
        seen = np.zeros(S, dtype=bool)
        for row in lists:
            for ids in row:
                seen[ids] = True
        missing = int(np.flatnonzero(~seen)[0])
        raise errors.PlanError("sample %d is in no micro-batch of the plan (%d of %d are); slime trains "
                               "every sample it keeps" % (missing, placed, S), sequence=missing)
    for rank, row in enumerate(lists):
        for mb, ids in enumerate(row):
            if len(ids) == 0:
                raise errors.PlanError(
                    "rank %d micro-batch %d holds no sample; slime's micro-batches each hold one "
                    "(build_dp_schedule never makes an empty one): plan with "
                    "trainer.nonempty_microbatches: true (docs/config.md)" % (rank, mb))
    K = int(_plan.config_value(res, "mini_batches", 1))
    if M % K:
        raise errors.PlanError("the plan has %d micro-batches, which do not divide into "
                               "trainer.mini_batches %d optimizer steps" % (M, K))
    Mk = M // K
    run = _plan.run_order(res)
    for rank in range(G):
        for pos, m in enumerate(run[rank]):
            if m // Mk != pos // Mk:
                raise errors.PlanError(
                    "rank %d runs micro-batch %d at position %d, in optimizer step %d; a step "
                    "runs only its own micro-batches" % (rank, m, pos, pos // Mk))
    if rollout_ids is not None:
        rollout_ids = np.asarray(rollout_ids)
        if rollout_ids.shape != (S,):
            raise errors.InvalidArgumentError("rollout_ids has shape %s; the plan has %d samples"
                                              % (rollout_ids.shape, S))
    step_of = np.empty(S, dtype=np.int64)
    partitions, indices = [], []
    for rank, row in enumerate(lists):
        part, idx = [], []
        for m in run[rank]:
            ids = row[m].tolist()
            idx.append(list(range(len(part), len(part) + len(ids))))
            part.extend(ids)
            step_of[row[m]] = m // Mk
        partitions.append(part)
        indices.append(idx)
    if rollout_ids is None:
        sizes = np.bincount(step_of, minlength=K).tolist()
    else:
        sizes = []
        for k in range(K):
            here = set(rollout_ids[step_of == k].tolist())
            elsewhere = here & set(rollout_ids[step_of != k].tolist())
            if elsewhere:
                rid = min(elsewhere)
                raise errors.PlanError(
                    "rollout %s has samples in optimizer step %d and in another; slime keeps a "
                    "rollout's samples in one step (its loss is reduced per rollout)" % (rid, k))
            sizes.append(len(here))
    return DPSchedule(partitions=partitions, micro_batch_indices=indices, num_microbatches=[Mk] * K,
                      global_batch_sizes=[int(x) for x in sizes])
