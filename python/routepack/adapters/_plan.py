"""What both adapters read from a StepResult: its microbatch lists, checked (every id in
range, no sequence twice), their run order, its sequence lengths and its layout."""

from __future__ import annotations

import numpy as np

from .. import errors


def microbatches(res):
    """The plan's lists as ``[rank][mb]`` int64 arrays, checked: every id is a sequence of
    the step and no sequence runs twice. Raises PlanError naming the sequence."""
    S = int(res.num_seqs)
    where = np.full(S, -1, dtype=np.int64)   # rank * M + mb of each sequence seen
    M = int(res.num_microbatches)
    lists = []
    for rank, row in enumerate(res.microbatches):
        if len(row) != M:
            raise errors.PlanError("rank %d has %d microbatches; the plan has %d"
                                   % (rank, len(row), M))
        out = []
        for mb, ids in enumerate(row):
            ids = np.asarray(ids, dtype=np.int64)
            bad = ids[(ids < 0) | (ids >= S)]
            if bad.size:
                raise errors.PlanError("rank %d microbatch %d holds sequence %d; the step has "
                                       "%d sequences" % (rank, mb, bad[0], S), sequence=int(bad[0]))
            for s in ids:
                if where[s] >= 0:
                    raise errors.PlanError(
                        "sequence %d is in rank %d microbatch %d and in rank %d microbatch %d"
                        % (s, where[s] // M, where[s] % M, rank, mb), sequence=int(s))
                where[s] = rank * M + mb
            out.append(ids)
        lists.append(out)
    return lists


def run_order(res):
    """int64 [G, M]: the microbatch each rank runs at each position (StepResult.microbatch_order,
    part of the plan under pipeline parallelism; index order for a result without one).
    Raises PlanError for a row that is not a permutation."""
    G, M = len(res.microbatches), int(res.num_microbatches)
    order = getattr(res, "microbatch_order", None)
    if order is None:
        return np.tile(np.arange(M, dtype=np.int64), (G, 1))
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (G, M):
        raise errors.PlanError("microbatch_order has shape %s; the plan has %d ranks of %d "
                               "microbatches" % (order.shape, G, M))
    for g in range(G):
        if sorted(order[g].tolist()) != list(range(M)):
            raise errors.PlanError("rank %d's microbatch order %s is not a permutation of its %d "
                                   "microbatches" % (g, order[g].tolist(), M))
    return order


def seq_lens(res):
    """Tokens of each sequence, int64 [S] (prompt + response)."""
    return np.diff(np.asarray(res.cu_seqlens, dtype=np.int64))


def config_value(res, name, default):
    """A layout or trainer value of the config the step ran with (StepResult.config), or
    ``default`` for a result without one."""
    cfg = getattr(res, "config", None)
    return getattr(cfg, name, default) if cfg is not None else default
