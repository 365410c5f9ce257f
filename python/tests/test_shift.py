"""Router shift from Python (routepack.router_shift, Scheduler.attach_shift): hand counts,
a numpy reference on random routings in several forms, the step report and metrics,
errors."""

import numpy as np
import pytest

import routepack
from conftest import random_step


def numpy_shift(lens, old, new, E):
    """Reference: (layer_changed [L], seq_changed [S], lost [L, E], arrived [L, E])."""
    T, L, K = old.shape
    in_new = (old[:, :, :, None] == new[:, :, None, :]).any(-1)   # [T, L, K]
    in_old = (new[:, :, :, None] == old[:, :, None, :]).any(-1)
    changed = ~in_new
    seq_of = np.repeat(np.arange(len(lens)), lens)
    lost = np.zeros((L, E), np.int64)
    arrived = np.zeros((L, E), np.int64)
    for l in range(L):
        np.add.at(lost[l], old[:, l][changed[:, l]], 1)
        np.add.at(arrived[l], new[:, l][~in_old[:, l]], 1)
    seq_changed = np.bincount(seq_of, weights=changed.sum((1, 2)), minlength=len(lens)).astype(np.int64)
    return changed.sum((0, 2)), seq_changed, lost, arrived


def test_hand_counts():
    lens = [2, 1]
    old = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]], np.int32)
    sh = routepack.router_shift(lens, old, old, num_experts=4)
    assert sh.choices == 12 and sh.changed == 0 and sh.fraction == 0.0
    assert sh.expert_old[0].tolist() == [2, 2, 1, 1]
    # reordering within a top-k is no shift
    assert routepack.router_shift(lens, old, old[:, :, ::-1], num_experts=4).changed == 0
    new = old.copy()
    new[0, 0] = [0, 3]          # expert 1 leaves token 0 at layer 0
    sh = routepack.router_shift(lens, old, new, num_experts=4)
    assert sh.changed == 1 and sh.layer_changed.tolist() == [1, 0]
    assert sh.seq_changed.tolist() == [1, 0] and sh.seq_choices.tolist() == [8, 4]
    assert sh.expert_lost[0, 1] == 1 and sh.expert_arrived[0, 3] == 1
    assert sh.expert_lost_fraction[0, 1] == 0.5
    assert sh.summary["max_seq"] == 0 and sh.summary["max_layer"] == 0
    # the complement of every top-k: everything changed
    comp = np.array([[[e for e in range(4) if e not in row] for row in tok] for tok in old], np.int32)
    assert routepack.router_shift(lens, old, comp, num_experts=4).fraction == 1.0


@pytest.mark.parametrize("form", ["packed", "per_seq", "per_layer", "int64"])
def test_random_against_numpy(form):
    rng = np.random.default_rng(7)
    lens, old = random_step(rng, 12, 3, 4, 16, max_len=40)
    _, fresh = random_step(rng, 12, 3, 4, 16, lens=lens)
    keep = rng.random(old.shape[:2])[..., None] < 0.7
    new = np.where(keep, old, fresh).astype(np.int32)   # may repeat ids: counted per entry
    want = numpy_shift(lens, old, new, 16)
    cu = np.concatenate([[0], np.cumsum(lens)])
    if form == "packed":
        sh = routepack.router_shift(lens, old, new, 16)
    elif form == "per_seq":
        sh = routepack.router_shift(None, [old[a:b] for a, b in zip(cu[:-1], cu[1:])],
                                    [new[a:b] for a, b in zip(cu[:-1], cu[1:])], 16)
    elif form == "per_layer":
        sh = routepack.router_shift(lens, old, [new[:, l] for l in range(3)], 16, new_layout="per_layer")
    else:
        sh = routepack.router_shift(lens, old.astype(np.int64), new.astype(np.int64), 16)
    assert sh.layer_changed.tolist() == want[0].tolist()
    assert sh.seq_changed.tolist() == want[1].tolist()
    assert np.array_equal(sh.expert_lost, want[2]) and np.array_equal(sh.expert_arrived, want[3])
    assert sh.changed == int(want[0].sum()) > 0


def test_errors():
    lens = [2, 1]
    old = np.zeros((3, 2, 2), np.int32)
    old[..., 1] = 1
    bad = old.copy()
    bad[2, 1, 1] = 9
    with pytest.raises(routepack.RoutingError, match="new routing: sequence 1 token 0 layer 1 choice 1 "
                                                     "has expert id 9, but the model has 4 experts"):
        routepack.router_shift(lens, old, bad, 4)
    with pytest.raises(routepack.RoutingError, match="shape"):
        routepack.router_shift(lens, old, old[:, :1], 4)


def test_attach_to_step(tiny_config):
    rng = np.random.default_rng(3)
    lens, old = random_step(rng, 6, 2, 2, 8, max_len=30)
    with routepack.Scheduler(tiny_config) as sched:
        with pytest.raises(routepack.InvalidArgumentError, match="no step"):
            sched.attach_shift(old, old)
        res = sched.step(lens, old)
        assert not any("router_shift" in k for k in res.metrics())
        new = old.copy()
        new[0, 0] = [e for e in range(8) if e not in old[0, 0]][:2]   # token 0 moved entirely at layer 0
        sh = sched.attach_shift(old, new)
        assert sh.changed == 2
        m = res.metrics()
        assert m["routepack/router_shift_fraction"] == pytest.approx(2 / old.size)
        assert m["routepack/router_shift_max_expert_lost_fraction"] > 0
        assert res.report["router_shift"]["changed"] == 2
        res2 = sched.step(lens, old)
        assert "router_shift" not in res2.report
