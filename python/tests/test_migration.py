"""StepResult.migration: the step's expert migration plan (rp_sched_migration) copied
into numpy. Checked against the step report and against the placements it moves between,
which would catch a ctypes struct that does not match migrate.h."""

import ctypes

import numpy as np
import pytest

import routepack
from routepack import _lib
from routepack.migration import LINK_NAMES, TRANSFER_DTYPE, WRITE_DTYPE
from conftest import SMALL_CONFIG

MOVING = "token_kk+eplb"        # re-places every step
STILL = "token_kk+contiguous"   # the placement the scheduler starts from: never moves


def run(small_trace, policy, steps=3):
    with routepack.Scheduler(SMALL_CONFIG, policy=policy) as s:
        return [s.step(small_trace[i].lengths, small_trace[i].routing,
                       group_ids=small_trace[i].group_ids)
                for i in range(min(steps, len(small_trace)))]


@pytest.fixture(scope="module")
def moving(small_trace):
    return run(small_trace, MOVING)


def test_dtypes_match_the_c_structs():
    for dtype, struct in ((TRANSFER_DTYPE, _lib.rp_migration_transfer),
                          (WRITE_DTYPE, _lib.rp_migration_write)):
        assert dtype.itemsize == ctypes.sizeof(struct)
        assert list(dtype.names) == [f for f, _ in struct._fields_]
        for name, _ in struct._fields_:
            assert dtype.fields[name][1] == getattr(struct, name).offset
    # migrate.h: seven 32-bit fields, then int64 bytes at offset 32
    assert ctypes.sizeof(_lib.rp_migration_transfer) == 40
    assert _lib.rp_migration_transfer.bytes.offset == 32
    assert _lib.rp_migration_write.transfer.offset == 16
    # eight int64 (bytes[3] .. writes), two int32, two int64, then the double
    assert _lib.rp_migration_summary.predicted_s.offset == 8 * 8 + 2 * 4 + 2 * 8
    assert ctypes.sizeof(_lib.rp_migration_summary) == 96


def test_a_moving_policy_has_a_migration_that_agrees_with_the_report(moving):
    res = moving[0]
    mig = res.migration
    assert mig is not None
    s = mig.summary
    assert s["moved_bytes"] > 0
    assert s["moved_bytes"] == res.migration_bytes
    assert s["moved_bytes"] == res.report["migration_bytes"]
    assert s["predicted_s"] == pytest.approx(res.report["migration_s"])
    assert s["moved_bytes"] == s["min_bytes"]
    assert set(s["bytes"]) == set(LINK_NAMES)
    assert s["moved_bytes"] == s["bytes"]["nvlink"] + s["bytes"]["net"]
    assert s["num_rounds"] == mig.num_rounds >= 1
    assert s["predicted_s"] > 0
    assert isinstance(mig.hash, int) and mig.hash != 0


def test_transfers_and_writes_are_consistent(moving):
    mig = moving[0].migration
    s, tr, wr = mig.summary, mig.transfers, mig.writes
    L = moving[0].num_layers
    assert tr.dtype == TRANSFER_DTYPE and wr.dtype == WRITE_DTYPE
    local = tr["link"] == LINK_NAMES.index("local")
    # the transfer list holds the copies between GPUs and those inside one GPU
    assert len(tr) == s["transfers"] + s["local_copies"]
    assert int((~local).sum()) == s["transfers"]
    assert int(local.sum()) == s["local_copies"]
    assert np.all((tr["src_gpu"] == tr["dst_gpu"]) == local)
    assert len(wr) == s["writes"] > 0
    assert np.all((tr["link"] >= 0) & (tr["link"] < len(LINK_NAMES)))
    for i, name in enumerate(LINK_NAMES):
        assert int(tr["bytes"][tr["link"] == i].sum()) == s["bytes"][name]
    np.testing.assert_array_equal(tr["bytes"], mig.expert_bytes[tr["layer"]])
    # every write names a valid transfer of its own layer and destination GPU
    assert np.all((wr["transfer"] >= 0) & (wr["transfer"] < len(tr)))
    np.testing.assert_array_equal(tr["layer"][wr["transfer"]], wr["layer"])
    np.testing.assert_array_equal(tr["dst_gpu"][wr["transfer"]], wr["gpu"])
    # every layer with writes has a round, and its transfers are of that round
    assert mig.layer_round.dtype == np.int32 and mig.layer_round.shape == (L,)
    written = np.unique(wr["layer"])
    assert np.all(mig.layer_round[written] >= 0)
    assert len(written) == s["layers_moved"]
    np.testing.assert_array_equal(tr["round"], mig.layer_round[tr["layer"]])
    # execution order: by round, then layer
    order = tr["round"].astype(np.int64) * L + tr["layer"]
    assert np.all(np.diff(order) >= 0)


def test_moves_go_from_the_previous_placement_to_the_new_one(moving):
    prev, res = moving[0], moving[1]
    mig = res.migration
    assert mig is not None
    tr, wr = mig.transfers, mig.writes
    ep = res.ep_size
    begin = res.slot_begin

    def slot_of(gpu, local_slot):
        return begin[gpu % ep] + local_slot

    # each write fills a slot with the expert the new placement puts there
    for w in wr:
        t = tr[w["transfer"]]
        assert res.phy2log[w["layer"], slot_of(w["gpu"], w["slot"])] == t["expert"]
    # each copy reads its expert where the previous step's placement held it
    for t in tr:
        assert prev.phy2log[t["layer"], slot_of(t["src_gpu"], t["src_slot"])] == t["expert"]
    # every slot whose expert changed is written, and no other
    changed = set(zip(*np.nonzero(prev.phy2log != res.phy2log)))
    assert {(int(w["layer"]), int(slot_of(w["gpu"], w["slot"]))) for w in wr} == \
        {(int(l), int(p)) for l, p in changed}


def test_a_policy_that_never_moves_has_no_migration(small_trace):
    results = run(small_trace, STILL)
    assert len(results) >= 2
    for res in results:   # step 0 included: the scheduler starts from contiguous
        assert res.migration is None
        assert res.migration_bytes == 0


def test_migrations_are_copies_that_outlive_later_steps(small_trace):
    with routepack.Scheduler(SMALL_CONFIG, policy=MOVING) as s:
        rec = small_trace[0]
        r0 = s.step(rec.lengths, rec.routing, group_ids=rec.group_ids)
        m0 = r0.migration
        saved = (m0.hash, dict(m0.summary), m0.layer_round.copy(), m0.transfers.copy(),
                 m0.writes.copy())
        for i in range(1, len(small_trace)):
            rec = small_trace[i]
            s.step(rec.lengths, rec.routing, group_ids=rec.group_ids)
    assert r0.migration is m0
    assert (m0.hash, m0.summary) == saved[:2]
    np.testing.assert_array_equal(m0.layer_round, saved[2])
    np.testing.assert_array_equal(m0.transfers, saved[3])
    np.testing.assert_array_equal(m0.writes, saved[4])
    assert "moved_bytes=%d" % m0.summary["moved_bytes"] in repr(m0)


def test_same_steps_give_the_same_migration(moving, small_trace):
    again = run(small_trace, MOVING, steps=1)[0].migration
    assert again.hash == moving[0].migration.hash
    np.testing.assert_array_equal(again.transfers, moving[0].migration.transfers)


def test_the_config_staging_budget_is_the_default(small_trace, tmp_path):
    """execution.staging_budget_bytes (what the memory check counts) is the budget until
    the trainer sets one; set_migration_options() without a budget keeps it."""
    import json
    cfg = json.loads(SMALL_CONFIG.read_text())
    cfg["execution"] = {"optimizer_sharding": "dp", "staging_budget_bytes": 1}
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(cfg))
    t = small_trace[0]
    with routepack.Scheduler(str(path), policy=MOVING) as s:
        assert s.config.staging_budget_bytes == 1
        assert s.config.optimizer_sharding == "dp"
        with pytest.raises(routepack.Error, match="staging budget of 1 bytes"):
            s.step(t.lengths, t.routing, group_ids=t.group_ids)
        s.set_migration_options()
        with pytest.raises(routepack.Error, match="staging budget of 1 bytes"):
            s.step(t.lengths, t.routing, group_ids=t.group_ids)
        s.set_migration_options(staging_budget_bytes=0)
        assert s.step(t.lengths, t.routing, group_ids=t.group_ids).migration_bytes > 0


def test_a_step_result_executes_its_own_migration_only(small_trace):
    """routepack.executor.execute(res) runs the migration of step res, the C plan the
    scheduler holds for it until the next step: once a later step has been planned it
    refuses, naming both steps, instead of running the later step's plan (what "the last
    step's migration" ran). Checked before the registry or the transport is touched."""
    from routepack import executor
    with routepack.Scheduler(SMALL_CONFIG, policy=MOVING) as s:
        r0, r1 = [s.step(small_trace[i].lengths, small_trace[i].routing, group_ids=small_trace[i].group_ids)
                  for i in range(2)]
        assert r0.migration is not None and r1.migration is not None
        with pytest.raises(routepack.InvalidArgumentError,
                           match="step 0's migration cannot run now: this scheduler planned step 1 since"):
            executor.execute(r0, None, None)
    with routepack.Scheduler(SMALL_CONFIG, policy=STILL) as s:
        res = s.step(small_trace[0].lengths, small_trace[0].routing, group_ids=small_trace[0].group_ids)
        assert executor.execute(res, None, None) is None   # nothing moves
        with pytest.warns(FutureWarning, match=r"executor\.execute\(res, registry, transport"):
            assert s.execute_migration(None, None) is None

