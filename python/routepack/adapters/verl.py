"""A RoutePack plan in the form verl's actor takes: the order of the rollout batch
(``DataProto.reorder``) after which ``DataProto.chunk(dp_size)`` hands each DP rank exactly
the plan's sequences, and each rank's micro-batches as the index lists
``verl.utils.seqlen_balancing.rearrange_micro_batches`` returns.

Read against verl 0.8.0.dev, commit b178a3cd56f58b2d502255daba591e92833930a7
(verl/protocol.py: DataProto.chunk, reorder, select_idxs; verl/utils/seqlen_balancing.py:
rearrange_micro_batches, get_reverse_idx, restore_dynamic_batch;
verl/trainer/ppo/ray_trainer.py: _balance_batch; verl/workers/actor/megatron_actor.py:
make_minibatch_iterator, forward_backward_batch; verl/workers/actor/dp_actor.py:
update_policy's ``data.split(ppo_mini_batch_size)``).
No verl code is used or needed here; docs/adapters.md shows where the lists go."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import errors
from . import _plan

ORDERS = ("plan", "batch")


@dataclass(frozen=True)
class BatchPlan:
    """One step's plan for verl.

    ``order``: int64 [S]; ``batch.reorder(torch.as_tensor(order))`` puts sequence
    ``order[i]`` (its index in the batch the step planned) at position i, as verl's
    ``_balance_batch`` does with its own partitions; ``chunk(dp_size)`` then gives DP rank r
    positions ``r * n .. (r + 1) * n - 1`` (n = ``sequences_per_rank``).
    ``chunks``: ``[dp_size]`` int64 arrays, the batch indices of each rank's chunk in chunk
    order (``order`` is their concatenation).
    ``micro_batch_indices``: ``[dp_size][M]`` lists of int, rank r's micro-batches as
    indices into its chunk, in run order: ``rearrange_micro_batches``'s second result.
    ``micro_batch_tokens``: int64 [dp_size, M], the tokens of each micro-batch, in run order.
    ``microbatch_order``: int64 [dp_size, M], the plan's microbatch at each run position
    (StepResult.microbatch_order; the identity unless the plan orders them, as under
    pipeline parallelism): entry k of rank r is ``res.microbatches[r][microbatch_order[r, k]]``.
    ``mini_batch_indices``: ``[dp_size][K][M / K]`` lists of int (K = ``trainer.mini_batches``):
    rank r's micro-batches of mini-batch k as indices into that mini-batch (rows
    ``k * mini_batch_size .. (k + 1) * mini_batch_size - 1`` of the chunk, which
    ``data.split(ppo_mini_batch_size)`` hands the actor), in run order: what
    ``rearrange_micro_batches`` returns for that mini-batch. With K = 1 it is
    ``[micro_batch_indices[r]]``."""

    order: np.ndarray
    chunks: list
    micro_batch_indices: list
    micro_batch_tokens: np.ndarray
    microbatch_order: np.ndarray
    mini_batch_indices: list = None

    @property
    def num_mini_batches(self):
        return len(self.mini_batch_indices[0]) if self.mini_batch_indices else 1

    @property
    def mini_batch_size(self):
        """Sequences of one mini-batch of one rank: verl's ``ppo_mini_batch_size`` after its
        normalisation (times rollout.n, over the DP size)."""
        return self.sequences_per_rank // self.num_mini_batches

    @property
    def dp_size(self):
        return len(self.chunks)

    @property
    def num_micro_batches(self):
        return len(self.micro_batch_indices[0]) if self.micro_batch_indices else 0

    @property
    def sequences_per_rank(self):
        return len(self.chunks[0]) if self.chunks else 0

    def reverse_indices(self, rank, mini_batch=None):
        """What verl computes with ``get_reverse_idx`` over rank ``rank``'s flattened
        micro-batch indices: outputs concatenated in micro-batch order, indexed by this
        list, come back in chunk order (``restore_dynamic_batch``). list of int [n]. With
        ``mini_batch`` k: the same within mini-batch k (``mini_batch_indices[rank][k]``), as
        verl restores each mini-batch's outputs."""
        lists = (self.micro_batch_indices[rank] if mini_batch is None
                 else self.mini_batch_indices[rank][mini_batch])
        flat = [i for mb in lists for i in mb]
        reverse = [0] * len(flat)
        for pos, i in enumerate(flat):
            reverse[i] = pos
        return reverse


def batch_plan(res, *, dp_size=None, num_batches_divided_by=None, order="plan"):
    """The plan of StepResult ``res`` for verl's actor; ``res``'s sequence ids are the
    indices of the batch (``DataProto``) the step was planned from, and a plan's rank is a
    DP rank (a TP group under TP: docs/config.md).

    ``dp_size``: verl's DP size, checked against the plan's ranks (default: the plan's).
    ``num_batches_divided_by``: the micro-batch count must be a multiple of it, as verl's
    Megatron actor asks of ``rearrange_micro_batches`` under virtual pipeline stages
    (``microbatch_group_size_per_vp_stage``; default: the config's
    ``trainer.microbatch_multiple``).
    ``order``: ``"plan"`` (each chunk holds its rank's sequences micro-batch after
    micro-batch, so the index lists are consecutive ranges) or ``"batch"`` (each chunk in
    ascending batch index, as the batch came; the index lists then pick from it). Under
    ``trainer.mini_batches`` K > 1 either way each chunk is laid out mini-batch after
    mini-batch (``"batch"``: ascending batch index inside each), since verl's actor splits
    its chunk into consecutive mini-batches.

    Raises PlanError when verl cannot run the plan as it is: a sequence in no micro-batch
    or in two, ranks with different sequence counts (``DataProto.chunk`` splits equally:
    plan with ``trainer.equal_sequences_per_rank``), an empty micro-batch (verl's
    partitioning asserts each holds a sequence), a micro-batch count that is not a
    multiple of ``num_batches_divided_by``, or, under ``trainer.mini_batches`` K, a count
    that does not divide into K mini-batches of one size, a (rank, mini-batch) with another
    sequence count than the rest (verl splits by count) or a run order that leaves a
    mini-batch; InvalidArgumentError for a bad argument."""
    if order not in ORDERS:
        raise errors.InvalidArgumentError("order must be one of %s, got %r" % (ORDERS, order))
    lists = _plan.microbatches(res)
    G, M, S = len(lists), int(res.num_microbatches), int(res.num_seqs)
    if dp_size is not None and int(dp_size) != G:
        raise errors.InvalidArgumentError(
            "the plan has %d DP ranks (a plan's rank is a TP group of %d GPUs%s), but dp_size is %d"
            % (G, _plan.config_value(res, "tensor_parallel_size", 1),
               " x CP %d" % _plan.config_value(res, "context_parallel_size", 1)
               if _plan.config_value(res, "context_parallel_size", 1) > 1 else "", dp_size))
    ranked = [np.concatenate(row) if row else np.zeros(0, np.int64) for row in lists]
    placed = sum(len(r) for r in ranked)
    if placed != S:
        seen = np.zeros(S, dtype=bool)
        for r in ranked:
            seen[r] = True
        missing = int(np.flatnonzero(~seen)[0])
        raise errors.PlanError("sequence %d is in no microbatch of the plan (%d of %d sequences "
                               "are); verl trains every sequence of the batch"
                               % (missing, placed, S), sequence=missing)
    counts = [len(r) for r in ranked]
    if len(set(counts)) > 1:
        hi = int(np.argmax(counts))
        lo = int(np.argmin(counts))
        hint = ("" if _plan.config_value(res, "equal_sequences_per_rank", False)
                else "; plan with trainer.equal_sequences_per_rank: true (docs/config.md)")
        raise errors.PlanError(
            "verl's DataProto.chunk(%d) gives every DP rank %s of the %d sequences, but the "
            "plan gives rank %d %d and rank %d %d%s"
            % (G, "%d" % (S // G) if S % G == 0 else "an equal share", S, lo, counts[lo], hi,
               counts[hi], hint))
    for rank, row in enumerate(lists):
        for mb, ids in enumerate(row):
            if len(ids) == 0:
                hint = ("set limits.num_microbatches to at most %d, the sequences per rank"
                        % counts[0] if M > counts[0] else
                        "the policy left it empty with %d sequences for %d micro-batches; "
                        "plan with trainer.nonempty_microbatches: true (docs/config.md) or "
                        "lower limits.num_microbatches" % (counts[0], M))
                raise errors.PlanError(
                    "rank %d microbatch %d holds no sequence; verl's micro-batches each need "
                    "one (get_seqlen_balanced_partitions asserts it): %s" % (rank, mb, hint))
    divided_by = (_plan.config_value(res, "microbatch_multiple", 1)
                  if num_batches_divided_by is None else int(num_batches_divided_by))
    if divided_by < 1:
        raise errors.InvalidArgumentError("num_batches_divided_by must be >= 1, got %d" % divided_by)
    K = int(_plan.config_value(res, "mini_batches", 1))
    if M % K or (M // K) % divided_by:
        raise errors.PlanError(
            "the plan has %d micro-batches; in trainer.mini_batches %d mini-batches each needs "
            "a multiple of num_batches_divided_by = %d (verl rearranges each mini-batch's "
            "micro-batches on its own)" % (M, K, divided_by)
            if K > 1 else
            "the plan has %d micro-batches, not a multiple of num_batches_divided_by = %d "
            "(verl's Megatron actor under virtual pipeline stages); plan with "
            "trainer.microbatch_multiple: %d" % (M, divided_by, divided_by))
    Mk = M // K

    lens = _plan.seq_lens(res)
    run = _plan.run_order(res)
    if K > 1:
        size = counts[0] // K if counts[0] % K == 0 else None
        for rank, row in enumerate(lists):
            for k in range(K):
                here = sum(len(row[m]) for m in range(k * Mk, (k + 1) * Mk))
                if here != size:
                    raise errors.PlanError(
                        "rank %d mini-batch %d (micro-batches %d to %d) holds %d sequences; verl "
                        "splits each rank's %d into trainer.mini_batches %d mini-batches of one "
                        "size (DataProto.split(ppo_mini_batch_size)): plan with "
                        "trainer.equal_sequences_per_rank: true and a multiple of %d sequences"
                        % (rank, k, k * Mk, (k + 1) * Mk - 1, here, counts[0], K, G * K))
            for pos, m in enumerate(run[rank]):
                if m // Mk != pos // Mk:
                    raise errors.PlanError(
                        "rank %d runs microbatch %d at position %d, in mini-batch %d; a mini-batch "
                        "runs only its own micro-batches" % (rank, m, pos, pos // Mk))
    chunks, indices, mini = [], [], []
    tokens = np.zeros((G, M), dtype=np.int64)
    for rank, row in enumerate(lists):
        row = [row[m] for m in run[rank]]          # in the order the rank runs them
        ranked[rank] = np.concatenate(row) if row else np.zeros(0, np.int64)
        bounds = np.concatenate([[0], np.cumsum([len(ids) for ids in row])])
        if order == "plan":
            chunk = ranked[rank]
            pos = np.arange(len(chunk))
        else:
            # ascending batch index inside each mini-batch (all of the chunk with one)
            cut = bounds[::Mk]
            chunk = np.concatenate([np.sort(ranked[rank][cut[k]:cut[k + 1]]) for k in range(K)])
            pos = np.empty(len(chunk), dtype=np.int64)
            for k in range(K):
                part = chunk[cut[k]:cut[k + 1]]
                pos[cut[k]:cut[k + 1]] = cut[k] + np.searchsorted(part, ranked[rank][cut[k]:cut[k + 1]])
        lists_r = [pos[bounds[m]:bounds[m + 1]].tolist() for m in range(M)]
        indices.append(lists_r)
        mini.append([[[i - int(bounds[k * Mk]) for i in mb] for mb in lists_r[k * Mk:(k + 1) * Mk]]
                     for k in range(K)])
        tokens[rank] = [int(lens[ids].sum()) for ids in row]
        chunks.append(chunk)
    return BatchPlan(order=np.concatenate(chunks) if chunks else np.zeros(0, np.int64),
                     chunks=chunks, micro_batch_indices=indices, micro_batch_tokens=tokens,
                     microbatch_order=run, mini_batch_indices=mini)
