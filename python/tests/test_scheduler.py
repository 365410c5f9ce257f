"""The step from Python: every routing form plans exactly as the packed form, borrowed
dtypes are not copied, results are copies that survive later steps, and what the plan
arrays say agrees with the plan JSON and the report."""

import json
import threading

import numpy as np
import pytest

import routepack
from routepack import _routing
from conftest import SMALL_CONFIG, random_step


class DLPackOnly:
    """A producer with only the DLPack protocol, as a torch CPU tensor presents itself."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayInterfaceOnly:
    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


@pytest.fixture(scope="module")
def step1(small_trace):
    return small_trace[1]


def plan_with(routing, rec, **kw):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        seq_lens = kw.pop("seq_lens", rec.lengths)
        return s.step(seq_lens, routing, step=0, group_ids=rec.group_ids, **kw)


def forms(rec):
    ids = rec.routing
    cu = rec.cu_seqlens
    return {
        "uint8 packed": dict(routing=ids),
        "int32 packed": dict(routing=ids.astype(np.int32)),
        "uint16 packed": dict(routing=ids.astype(np.uint16)),
        "int64 packed (copied once)": dict(routing=ids.astype(np.int64)),
        "cu_seqlens": dict(routing=ids, seq_lens=None, cu_seqlens=cu),
        "whole lengths + cu_seqlens": dict(routing=ids, seq_lens=rec.seq_lens, cu_seqlens=cu),
        "per sequence (vLLM/SGLang)": dict(routing=rec.per_sequence()),
        "per sequence, lengths from shapes": dict(routing=rec.per_sequence(), seq_lens=None),
        "per sequence int64": dict(routing=[a.astype(np.int64) for a in rec.per_sequence()]),
        "per layer (Megatron)": dict(routing=rec.per_layer()),
        "per layer contiguous copies": dict(routing=[np.ascontiguousarray(a) for a in rec.per_layer()]),
        "stacked [layers, tokens, k]": dict(routing=np.ascontiguousarray(ids.transpose(1, 0, 2)),
                                            layout="per_layer"),
        "strided view": dict(routing=np.ascontiguousarray(ids.transpose(2, 1, 0)).transpose(2, 1, 0)),
        "DLPack producer": dict(routing=DLPackOnly(ids.astype(np.int32))),
        "__array_interface__": dict(routing=ArrayInterfaceOnly(ids)),
        "list of DLPack per sequence": dict(routing=[DLPackOnly(a) for a in rec.per_sequence()]),
    }


def test_every_form_plans_as_the_packed_form(step1):
    want = plan_with(step1.routing, step1)
    assert want.num_seqs == step1.num_seqs
    for name, kw in forms(step1).items():
        kw = dict(kw)
        routing = kw.pop("routing")
        got = plan_with(routing, step1, **kw)
        assert got.plan_hash == want.plan_hash, name
        assert got.step_time_s == want.step_time_s, name
        for a, b in zip(got.microbatches, want.microbatches):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=name)


def test_whole_lengths_equal_prompt_response_split(step1):
    # the split into prompt and response does not change the tokens; plans may use it,
    # so only the token layout is compared
    a = plan_with(step1.routing, step1, seq_lens=step1.seq_lens)
    assert a.num_seqs == step1.num_seqs
    np.testing.assert_array_equal(a.cu_seqlens, step1.cu_seqlens)


def _data_ptr(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_borrowed_dtypes_are_not_copied(step1, dtype):
    ids = step1.routing.astype(dtype)
    lens, view = _routing.prepare(ids, step1.lengths, None, None, num_layers=16, top_k=8,
                                  num_experts=64)
    assert not view.copied
    assert view.c.base == _data_ptr(ids)
    # strided: a transposed copy viewed back has non-C strides, still passed through
    strided = np.ascontiguousarray(ids.transpose(1, 0, 2)).transpose(1, 0, 2)
    lens, view = _routing.prepare(strided, step1.lengths, None, None, num_layers=16, top_k=8,
                                  num_experts=64)
    assert not view.copied
    assert view.c.base == _data_ptr(strided)
    assert (view.c.token_stride, view.c.layer_stride, view.c.k_stride) == (8, step1.num_tokens * 8, 1)


def test_dlpack_is_zero_copy(step1):
    ids = step1.routing.astype(np.int32)
    lens, view = _routing.prepare(DLPackOnly(ids), step1.lengths, None, None, num_layers=16,
                                  top_k=8, num_experts=64)
    assert not view.copied and view.c.base == _data_ptr(ids)
    per_seq = [DLPackOnly(a) for a in step1.per_sequence()]
    lens, view = _routing.prepare(per_seq, None, None, None, num_layers=16, top_k=8,
                                  num_experts=64)
    assert not view.copied
    for s, a in enumerate(step1.per_sequence()):
        if a.shape[0]:
            assert view._bases[s] == _data_ptr(a)


def test_int64_is_converted_once_to_the_narrowest_width(step1):
    ids = step1.routing.astype(np.int64)
    lens, view = _routing.prepare(ids, step1.lengths, None, None, num_layers=16, top_k=8,
                                  num_experts=64)
    assert view.copied and view.width == 1
    assert view.arrays[0].dtype == np.uint8


def test_results_are_copies_that_outlive_later_steps(step1, small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        r0 = s.step(step1.lengths, step1.routing)
        saved = [[mb.copy() for mb in rank] for rank in r0.microbatches]
        phy2log, log2phy = r0.phy2log.copy(), r0.log2phy.copy()
        for i in range(len(small_trace)):
            rec = small_trace[i]
            s.step(rec.lengths, rec.routing)
        for a, b in zip(saved, r0.microbatches):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(phy2log, r0.phy2log)
        np.testing.assert_array_equal(log2phy, r0.log2phy)
    # and after the scheduler is gone
    assert r0.microbatches[0][0].dtype == np.int32
    assert int(r0.log2phy.sum()) == int(log2phy.sum())


def test_result_arrays_are_consistent(step1):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        res = s.step(step1.lengths, step1.routing, group_ids=step1.group_ids, physical=True)
        plan = json.loads(s.plan_json())
        report = s.report_json()
    cfg = json.loads(SMALL_CONFIG.read_text())
    G = cfg["topology"]["num_nodes"] * cfg["topology"]["gpus_per_node"]
    L, E = cfg["model"]["num_layers"], cfg["model"]["num_experts"]
    assert len(res.microbatches) == G == res.num_gpus
    assert all(len(r) == res.num_microbatches for r in res.microbatches)
    # the packing: every sequence exactly once, as the plan JSON says
    seen = np.concatenate([mb for rank in res.microbatches for mb in rank])
    assert sorted(seen.tolist()) == list(range(step1.num_seqs))
    assert plan["packing"] == [[mb.tolist() for mb in rank] for rank in res.microbatches]
    for g, rank in enumerate(res.microbatches):
        for m, mb in enumerate(rank):
            assert (res.seq_rank[mb] == g).all() and (res.seq_microbatch[mb] == m).all()
    # the placement: EPLB arrays agree with the JSON and with each other
    S = int(res.slot_begin[-1])
    assert res.phy2log.shape == (L, S)
    assert res.logcnt.shape == (L, E) and res.log2phy.shape[:2] == (L, E)
    assert res.log2phy.shape[2] == res.logcnt.max()
    flat = [[e for rank in layer for e in rank] for layer in plan["placement"]]
    np.testing.assert_array_equal(res.phy2log, np.array(flat))
    for l in range(L):
        for e in range(E):
            reps = res.log2phy[l, e, :res.logcnt[l, e]]
            assert (res.phy2log[l, reps] == e).all()
            assert (res.log2phy[l, e, res.logcnt[l, e]:] == -1).all()
    # physical routing names slots holding the chosen expert
    phys = res.physical_routing
    assert phys.shape == step1.routing.shape and (phys >= 0).all()
    layer = np.broadcast_to(np.arange(L)[None, :, None], phys.shape)
    slot = phys < S
    np.testing.assert_array_equal(res.phy2log[layer[slot], phys[slot]], step1.routing[slot])
    np.testing.assert_array_equal(res.remap(step1.per_sequence()), phys)
    # the report: typed fields and the JSON say the same
    assert res.report == report
    assert res.step_time_s > 0 and res.lower_bound_s > 0
    assert res.step_time_s >= res.lower_bound_s * (1 - 1e-12)
    # the typed fields come from the C struct rp_step_report read through ctypes: equal
    # to the JSON, so a layout that drifted from the header would show here
    assert report["plan_hash"] == "%016x" % res.plan_hash
    assert report["step"] == res.step
    assert report["cost"]["step_s"] == res.step_time_s
    assert report["cost"]["lower_bound_s"] == res.lower_bound_s
    assert report["policy"]["name"] == res.policy_name
    assert report["policy"]["version"] == res.policy_version
    assert report["policy"]["hash"] == "%016x" % res.policy_hash
    assert report["fallback"] == res.fallback and report["swapped"] == res.swapped
    assert report["plan_wall_s"] == res.plan_wall_s
    assert report["experts_moved"] == res.experts_moved
    assert report["migration_bytes"] == res.migration_bytes


def test_policy_params_and_seed(step1):
    rec = step1
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb") as a, \
            routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb",
                                params={"token_kk": {"equal_size": False}}) as b, \
            routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb",
                                params='{"token_kk": {"equal_size": true}}', seed=7) as c:
        ha = a.step(rec.lengths, rec.routing).plan_hash
        hb = b.step(rec.lengths, rec.routing).plan_hash
        hc = c.step(rec.lengths, rec.routing).plan_hash
    assert ha == hc and ha != hb
    with pytest.raises(routepack.Error, match="equal_sizes"):
        routepack.Scheduler(SMALL_CONFIG, policy="token_kk", params={"equal_sizes": False})


def test_describe_policy():
    d = routepack.describe_policy("token_kk", SMALL_CONFIG)
    assert d["name"] == "token_kk" and d["api"] == 1
    assert {p["name"] for p in d["params"]} >= {"equal_size"}
    with pytest.raises(routepack.Error, match="no_such_policy"):
        routepack.describe_policy("no_such_policy", SMALL_CONFIG)


def test_step_index_counts_on():
    cfg = SMALL_CONFIG
    rng = np.random.default_rng(0)
    lens, ids = random_step(rng, 16, 16, 8, 64, max_len=100, dtype=np.uint8)
    with routepack.Scheduler(cfg) as s:
        assert s.next_step == 0
        assert s.step(lens, ids).step == 0
        assert s.step(lens, ids).step == 1
        assert s.step(lens, ids, step=10).step == 10
        assert s.next_step == 11
        assert s.step(lens, ids).step == 11


def test_two_schedulers_on_two_threads_plan_as_one(small_trace):
    recs = [small_trace[i] for i in range(len(small_trace))]

    def run(out):
        with routepack.Scheduler(SMALL_CONFIG) as s:
            out.extend(s.step(r.lengths, r.routing, group_ids=r.group_ids).plan_hash for r in recs)

    alone = []
    run(alone)
    a, b = [], []
    ta, tb = threading.Thread(target=run, args=(a,)), threading.Thread(target=run, args=(b,))
    ta.start(), tb.start()
    ta.join(), tb.join()
    assert a == alone and b == alone


def test_list_policies():
    pols = routepack.list_policies(SMALL_CONFIG)
    assert pols, "no policy found on the search path"
    for p in pols:
        assert p["name"] and p["api"] == 1 and len(p["hash"]) == 16


def test_plan_json_before_the_first_step():
    with routepack.Scheduler(SMALL_CONFIG) as s:
        assert s.plan_json() is None


def test_initial_placement_from_a_plan_file(step1, tmp_path):
    """The placement in use before the first step comes from a plan file: a packing-only
    policy keeps it at step 0 and nothing migrates; without it the start is contiguous."""
    rec = step1
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb") as s:
        s.step(rec.lengths, rec.routing, step=0)
        plan = json.loads(s.plan_json())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk", initial_placement=path) as s:
        r = s.step(rec.lengths, rec.routing, step=0)
        kept = json.loads(s.plan_json())["placement"]
    assert kept == plan["placement"] and r.migration_bytes == 0 and r.experts_moved == 0
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk") as s:
        s.step(rec.lengths, rec.routing, step=0)
        assert json.loads(s.plan_json())["placement"] != plan["placement"]
    with pytest.raises(routepack.Error, match="nope.json"):
        routepack.Scheduler(SMALL_CONFIG, policy="token_kk", initial_placement=tmp_path / "nope.json")
