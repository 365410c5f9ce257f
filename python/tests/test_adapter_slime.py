"""routepack.adapters.slime: a plan in build_dp_schedule's shapes, with the invariants
slime's scheduler states (THUDM/slime 624b824a, slime/utils/dp_schedule.py): every rank the
same micro-batch count per step, every kept sample exactly once, each rank's micro-batch
indices tiling its partition; and refusals where slime could not run the plan."""

import copy
import json

import numpy as np
import pytest

import routepack
from routepack.adapters import slime
from conftest import REPO, SMALL_CONFIG


def config(**trainer):
    cfg = json.loads(SMALL_CONFIG.read_text())
    cfg["policy"]["search_path"] = [str(REPO / "policies")]
    cfg["trainer"] = trainer
    return cfg


@pytest.fixture(scope="module")
def batch():
    with routepack.TraceReader(REPO / "examples" / "small.rpt") as tr:
        st = tr[0]
        return (np.array(st.seq_lens), np.array(st.routing), np.array(st.group_ids))


def step(cfg, batch, policy=None):
    lens, routing, groups = batch
    with routepack.Scheduler(cfg, policy=policy) as s:
        return s.step(lens, routing, group_ids=groups)


def check_invariants(sched, res):
    G, S = len(res.microbatches), int(res.num_seqs)
    assert len(sched.partitions) == len(sched.micro_batch_indices) == G
    every = sorted(i for part in sched.partitions for i in part)
    assert every == list(range(S)), "every sample exactly once"
    for r in range(G):
        flat = [i for mb in sched.micro_batch_indices[r] for i in mb]
        assert flat == list(range(len(sched.partitions[r]))), "rank %d's indices tile its partition" % r
        assert len(sched.micro_batch_indices[r]) == sum(sched.num_microbatches)


@pytest.mark.parametrize("policy", ["slime_ff+eplb", "slime_kk+contiguous", "routepack"])
def test_one_step_is_the_plan(policy, batch):
    res = step(config(nonempty_microbatches=True), batch, policy)
    sched = slime.dp_schedule(res)
    check_invariants(sched, res)
    assert sched.num_microbatches == [res.num_microbatches]
    assert sched.global_batch_sizes == [res.num_seqs]
    for r, row in enumerate(res.microbatches):
        got = [[sched.partitions[r][i] for i in mb] for mb in sched.micro_batch_indices[r]]
        assert got == [list(ids) for ids in row], "rank %d runs the plan's micro-batches, in order" % r
    assert sched.as_tuple() == (sched.partitions, sched.micro_batch_indices, sched.num_microbatches,
                                sched.global_batch_sizes)


def test_mini_batches_are_optimizer_steps(batch):
    cfg = config(mini_batches=2, nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 4
    res = step(cfg, batch, "slime_ff+eplb")
    sched = slime.dp_schedule(res)
    check_invariants(sched, res)
    assert sched.num_microbatches == [2, 2]
    # step k is the plan's mini-batch k: micro-batches 2k, 2k + 1 of every rank
    for r, row in enumerate(res.microbatches):
        mbs = sched.micro_batch_indices[r]
        for k in range(2):
            got = sorted(sched.partitions[r][i] for mb in mbs[2 * k:2 * k + 2] for i in mb)
            assert got == sorted(int(s) for m in (2 * k, 2 * k + 1) for s in row[m])
    assert sum(sched.global_batch_sizes) == res.num_seqs
    # one rollout a sample without rollout_ids; with them, distinct rollouts per step
    ids = np.arange(res.num_seqs) // 1
    assert slime.dp_schedule(res, rollout_ids=ids).global_batch_sizes == sched.global_batch_sizes


def test_rollout_split_over_steps_is_refused(batch):
    cfg = config(mini_batches=2, nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 4
    res = step(cfg, batch, "slime_ff+eplb")
    first = [int(s) for row in res.microbatches for s in row[0]][0]
    second = [int(s) for row in res.microbatches for s in row[2]][0]
    rollout = np.arange(res.num_seqs)
    rollout[second] = rollout[first]          # one rollout, two optimizer steps
    with pytest.raises(routepack.PlanError, match="rollout %d has samples in optimizer step" % first):
        slime.dp_schedule(res, rollout_ids=rollout)
    with pytest.raises(routepack.InvalidArgumentError, match="rollout_ids has shape"):
        slime.dp_schedule(res, rollout_ids=rollout[:3])


def test_refusals(batch):
    res = step(config(nonempty_microbatches=True), batch, "slime_ff+eplb")
    with pytest.raises(routepack.InvalidArgumentError, match="8 DP ranks.*dp_size is 4"):
        slime.dp_schedule(res, dp_size=4)
    empty = copy.copy(res)
    empty.microbatches = [list(row) for row in res.microbatches]
    moved = list(empty.microbatches[0][0])
    empty.microbatches[0] = [[]] + [list(x) for x in empty.microbatches[0][1:]]
    empty.microbatches[1] = [list(empty.microbatches[1][0]) + moved] + [list(x) for x in empty.microbatches[1][1:]]
    with pytest.raises(routepack.PlanError, match="rank 0 micro-batch 0 holds no sample.*nonempty_microbatches"):
        slime.dp_schedule(empty)
    lost = copy.copy(res)
    lost.microbatches = [list(row) for row in res.microbatches]
    gone = int(lost.microbatches[0][0][0])
    lost.microbatches[0] = [list(lost.microbatches[0][0][1:])] + [list(x) for x in lost.microbatches[0][1:]]
    with pytest.raises(routepack.PlanError, match="sample %d is in no micro-batch" % gone):
        slime.dp_schedule(lost)
