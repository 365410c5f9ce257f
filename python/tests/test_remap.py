"""Physical routing (StepResult.remap, step(..., physical=True)) is the C library's
rp_remap: equal to a direct ctypes call of rp_remap made here on the plan read back from
its JSON, every id names a replica of the chosen expert, the counts per physical id are
slot_tokens, and C errors arrive with the C message."""

import ctypes
import json
from ctypes import POINTER, Structure, c_char, c_int, c_int32, c_int64, c_size_t, c_void_p

import numpy as np
import pytest

import routepack
from conftest import SMALL_CONFIG

SPLIT = {"even": 0, "locality": 1}


# ---- an independent caller of the C API (its own struct mirrors and prototypes) ----

class _Error(Structure):
    _fields_ = [("status", c_int), ("line", c_int32), ("column", c_int32),
                ("offset", c_int64), ("sequence", c_int64), ("expert", c_int64),
                ("text", c_char * 512)]


class _Routing(Structure):
    _fields_ = [("layout", c_int), ("width", c_int), ("num_layers", c_int32),
                ("top_k", c_int32), ("token_stride", c_int64), ("layer_stride", c_int64),
                ("k_stride", c_int64), ("base", c_void_p), ("bases", POINTER(c_void_p)),
                ("num_bases", c_int32)]


def _c_api():
    lib = ctypes.CDLL(routepack.library_path())   # a fresh handle: prototypes of our own
    P, E = c_void_p, POINTER(_Error)
    for name, res, args in [
        ("rp_context_new", c_int, [P, P, POINTER(P)]),
        ("rp_context_free", None, [P]),
        ("rp_config_parse", c_int, [P, ctypes.c_char_p, c_size_t, ctypes.c_char_p, POINTER(P), E]),
        ("rp_config_free", None, [P]),
        ("rp_plan_parse", c_int, [P, P, ctypes.c_char_p, c_size_t, ctypes.c_char_p, POINTER(P), E]),
        ("rp_plan_free", None, [P]),
        ("rp_plan_total_slots", c_int32, [P]),
        ("rp_plan_num_microbatches", c_int32, [P]),
        ("rp_batch_new", c_int, [P, c_int32, POINTER(c_int32), POINTER(c_int32),
                                 POINTER(c_int32), POINTER(P), E]),
        ("rp_batch_free", None, [P]),
        ("rp_routing_packed", None, [POINTER(_Routing), c_int, c_int32, c_int32, P]),
        ("rp_remap_num_physical", c_int32, [P, c_int32]),
        ("rp_remap_physical_ep_rank", c_int32, [P, c_int32, c_int32, c_int32]),
        ("rp_remap", c_int, [P, P, c_int32, P, POINTER(_Routing), c_int, c_int32,
                             POINTER(c_int32), POINTER(c_int64), E]),
    ]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def c_remap(config_text, plan_json, step, split, ids=None):
    """rp_remap over every microbatch, called directly: (phys [T, L, k], slot_tokens per
    microbatch [L, Q, P], ranks {(mb, layer, phys): ep_rank} for every id, C status and
    message of the first failure or (0, ''))."""
    lib = _c_api()
    ids = np.ascontiguousarray(step.routing if ids is None else ids)
    assert ids.dtype == np.uint8
    T, L, K = ids.shape
    cfg_json = json.loads(config_text)
    topo = cfg_json["topology"]
    G = topo["num_nodes"] * topo["gpus_per_node"]
    Q = G // topo["ep_size"]
    ctx, cfg, plan, batch = c_void_p(), c_void_p(), c_void_p(), c_void_p()
    err = _Error()
    assert lib.rp_context_new(None, None, ctypes.byref(ctx)) == 0
    try:
        text = config_text.encode()
        assert lib.rp_config_parse(ctx, text, len(text), b"cfg", ctypes.byref(cfg),
                                   ctypes.byref(err)) == 0, err.text
        ptext = plan_json.encode()
        assert lib.rp_plan_parse(ctx, cfg, ptext, len(ptext), b"plan", ctypes.byref(plan),
                                 ctypes.byref(err)) == 0, err.text
        prompt, response = (np.ascontiguousarray(a, dtype=np.int32) for a in step.lengths)
        i32 = POINTER(c_int32)
        assert lib.rp_batch_new(ctx, len(prompt), prompt.ctypes.data_as(i32),
                                response.ctypes.data_as(i32), None, ctypes.byref(batch),
                                ctypes.byref(err)) == 0, err.text
        view = _Routing()
        lib.rp_routing_packed(ctypes.byref(view), 1, L, K, ids.ctypes.data)
        phys = np.full((T, L, K), -1, dtype=np.int32)
        slots, ranks = [], {}
        S = lib.rp_plan_total_slots(plan)
        for mb in range(lib.rp_plan_num_microbatches(plan)):
            P = lib.rp_remap_num_physical(plan, mb)
            rows = np.zeros((L, Q, P), dtype=np.int64)
            st = lib.rp_remap(plan, cfg, mb, batch, ctypes.byref(view), SPLIT[split], 1,
                              phys.ctypes.data_as(i32), rows.ctypes.data_as(POINTER(c_int64)),
                              ctypes.byref(err))
            if st != 0:
                return None, None, None, (st, err.text.decode())
            slots.append(rows)
            for layer in range(L):
                for p in range(P + 1):            # P itself: no replica, -1
                    ranks[(mb, layer, p)] = lib.rp_remap_physical_ep_rank(plan, mb, layer, p)
        assert S > 0
        return phys, slots, ranks, (0, "")
    finally:
        lib.rp_batch_free(batch)
        lib.rp_plan_free(plan)
        lib.rp_config_free(cfg)
        lib.rp_context_free(ctx)


# ---- configs: the example's (one microbatch, one EP group) and one with several
# microbatches and two EP groups of 4 GPUs ----

def config_text(several):
    cfg = json.loads(SMALL_CONFIG.read_text())
    # priced as the "ideal" executor: the joint plan keeps extra replicas and shares on this
    # trace (under the default routepack_torch a baseline without them wins), which the
    # remap must resolve
    cfg["execution"] = {"executor": "ideal"}
    if several:
        cfg["topology"].update(ep_size=4, slots_per_gpu=20)
        cfg["limits"] = {"max_tokens_per_microbatch": 16384, "num_microbatches": 3}
    return json.dumps(cfg)


@pytest.fixture(scope="module")
def steps(small_trace):
    return [small_trace[i] for i in range(min(len(small_trace), 3))]


def run(config, steps, split):
    """Step the scheduler through `steps` with physical=True; (results, plan JSON of each)."""
    out, plans = [], []
    with routepack.Scheduler(config, split=split) as s:
        for st in steps:
            res = s.step(st.lengths, st.routing, group_ids=st.group_ids, physical=True)
            out.append(res)
            plans.append(s.plan_json())
    return out, plans


def token_microbatch(res):
    seq_of = np.repeat(np.arange(res.num_seqs), np.diff(res.cu_seqlens))
    return res.seq_microbatch[seq_of], res.seq_rank[seq_of]


@pytest.mark.parametrize("split", ["even", "locality"])
@pytest.mark.parametrize("microbatches", [False, True], ids=["one_mb", "several_mb"])
def test_equals_c_remap(steps, split, microbatches):
    text = config_text(microbatches)
    results, plans = run(text, steps, split)
    levers = 0
    several = 0
    for res, plan, st in zip(results, plans, steps):
        want, want_slots, want_ranks, fail = c_remap(text, plan, st, split)
        assert fail == (0, "")
        np.testing.assert_array_equal(res.physical_routing, want)
        assert len(res.slot_tokens) == len(want_slots) == res.num_microbatches
        for got, exp in zip(res.slot_tokens, want_slots):
            np.testing.assert_array_equal(got, exp)
        # every routing form, after later steps and after close(): the result's own plan
        np.testing.assert_array_equal(res.remap(st.per_sequence()), want)
        np.testing.assert_array_equal(res.remap(st.per_layer()), want)
        np.testing.assert_array_equal(res.remap(st.routing.astype(np.int64), num_threads=3),
                                      want)
        # dispatch ranks are rp_remap_physical_ep_rank's
        mb_tok, _ = token_microbatch(res)
        layer = np.broadcast_to(np.arange(res.num_layers)[None, :, None], want.shape)
        mb = np.broadcast_to(mb_tok[:, None, None], want.shape)
        exp_rank = np.vectorize(lambda m, l, p: want_ranks[(m, l, p)])(mb, layer, want)
        np.testing.assert_array_equal(res.dispatch_ranks(res.physical_routing), exp_rank)
        levers += len(res.extra_replicas) > 0
        several += res.num_microbatches > 1
    # the bundled trace makes the default policy add extra replicas and shares
    assert levers > 0
    assert several > 0 if microbatches else several == 0
    assert (results[0].num_gpus // results[0].ep_size > 1) == microbatches


def test_a_layers_placement_names_every_physical_id(steps):
    """StepResult.placement(layer), the ExpertPlacement routepack.torch executes: every
    physical id of a (microbatch, layer) (the slots, then that microbatch's extra replicas
    of the layer in plan order) maps to the expert the plan put there and to the EP rank
    rp_remap_physical_ep_rank gives (dispatch_ranks)."""
    results, _ = run(config_text(True), steps, "even")
    extras = 0
    for res in results:
        S, L = res.total_slots, res.num_layers
        for l in range(L):
            pl = res.placement(l)
            np.testing.assert_array_equal(pl.phy2log, res.phy2log[l])
            np.testing.assert_array_equal(pl.slot_begin, res.slot_begin)
            assert len(pl.extras) == res.num_microbatches
            for m in range(res.num_microbatches):
                rows = res.extra_replicas[(res.extra_replicas[:, 0] == m) & (res.extra_replicas[:, 1] == l)]
                logical, rank, _ = pl.physical(m)
                np.testing.assert_array_equal(logical, np.concatenate([res.phy2log[l], rows[:, 2]]))
                phys = np.full((1, L, S + len(rows)), -1)
                phys[0, l] = np.arange(S + len(rows))
                np.testing.assert_array_equal(rank, res.dispatch_ranks(phys, microbatch=m)[0, l])
                extras += len(rows)
    assert extras > 0   # the bundled trace makes the default policy add extra replicas
    with pytest.raises(ValueError, match="layer"):
        results[0].placement(results[0].num_layers)


@pytest.mark.parametrize("split", ["even", "locality"])
def test_ids_name_replicas_of_the_chosen_expert(steps, split):
    results, _ = run(config_text(True), steps, split)
    for res, st in zip(results, steps):
        phys, ids = res.physical_routing, st.routing.astype(np.int64)
        assert (phys >= 0).all()                      # the scheduler packs every sequence
        S = res.total_slots
        mb_tok, _ = token_microbatch(res)
        L = res.num_layers
        layer = np.broadcast_to(np.arange(L)[None, :, None], phys.shape)
        mb = np.broadcast_to(mb_tok[:, None, None], phys.shape)
        ranks = res.dispatch_ranks(phys)
        # a slot: phy2log holds the chosen expert; its EP rank is slot_begin's
        slot = phys < S
        np.testing.assert_array_equal(res.phy2log[layer[slot], phys[slot]], ids[slot])
        np.testing.assert_array_equal(
            ranks[slot], np.searchsorted(res.slot_begin, phys[slot], side="right") - 1)
        # S + i: the i-th extra replica of (mb, layer) in plan order, of the chosen expert,
        # on the EP rank the plan put it
        extra = ~slot
        for m, l, p, e, j in zip(mb[extra], layer[extra], phys[extra], ids[extra], ranks[extra]):
            rows = res.extra_replicas[(res.extra_replicas[:, 0] == m) &
                                      (res.extra_replicas[:, 1] == l)]
            assert p - S < len(rows) and p < res.num_physical[m]
            assert rows[p - S, 2] == e and rows[p - S, 3] == j
        # every expert's replicas receive exactly its token-choices
        for m in range(res.num_microbatches):
            for l in range(L):
                sel = (mb[:, l, :] == m)
                owner = np.concatenate([res.phy2log[l],
                                        res.extra_replicas[(res.extra_replicas[:, 0] == m) &
                                                           (res.extra_replicas[:, 1] == l), 2]])
                got = np.zeros(res.num_experts, np.int64)
                np.add.at(got, owner[phys[:, l, :][sel]], 1)
                np.testing.assert_array_equal(
                    got, np.bincount(ids[:, l, :][sel], minlength=res.num_experts))


def test_counts_per_physical_id_are_slot_tokens(steps):
    results, _ = run(config_text(True), steps, "locality")
    for res, st in zip(results, steps):
        phys = res.physical_routing
        mb_tok, g_tok = token_microbatch(res)
        Q = res.num_gpus // res.ep_size
        L = res.num_layers
        assert Q == 2
        for m in range(res.num_microbatches):
            P = int(res.num_physical[m])
            counts = np.zeros((L, Q, P), np.int64)
            tok = np.flatnonzero(mb_tok == m)
            q = np.broadcast_to((g_tok[tok] // res.ep_size)[:, None, None], phys[tok].shape)
            layer = np.broadcast_to(np.arange(L)[None, :, None], phys[tok].shape)
            np.add.at(counts, (layer, q, phys[tok]), 1)
            np.testing.assert_array_equal(counts, res.slot_tokens[m])
            assert res.slot_tokens[m].sum() == len(tok) * L * phys.shape[2]
        # remap(slot_tokens=True) gives the same pair
        again, slots = res.remap(st.routing, slot_tokens=True)
        np.testing.assert_array_equal(again, phys)
        for a, b in zip(slots, res.slot_tokens):
            np.testing.assert_array_equal(a, b)


def test_dispatch_ranks_of_one_microbatch(steps):
    results, _ = run(config_text(True), steps[1:2], "even")
    res = results[0]
    whole = res.dispatch_ranks(res.physical_routing)
    mb_tok, _ = token_microbatch(res)
    for m in range(res.num_microbatches):
        tok = np.flatnonzero(mb_tok == m)
        np.testing.assert_array_equal(res.dispatch_ranks(res.physical_routing[tok], microbatch=m),
                                      whole[tok])
    assert (res.dispatch_ranks(np.full((2, res.num_layers, 1), -1), microbatch=0) == -1).all()
    beyond = np.full((1, res.num_layers, 1), int(res.num_physical.max()))
    assert (res.dispatch_ranks(beyond, microbatch=0) == -1).all()
    with pytest.raises(routepack.InvalidArgumentError, match="microbatch="):
        res.dispatch_ranks(res.physical_routing[:3])
    with pytest.raises(routepack.InvalidArgumentError, match="out of range"):
        res.dispatch_ranks(res.physical_routing[:3], microbatch=res.num_microbatches)


def test_c_error_raises_with_the_c_message(steps):
    text = config_text(True)
    st = steps[1]
    with routepack.Scheduler(text) as s:
        res = s.step(st.lengths, st.routing, group_ids=st.group_ids)
        plan = s.plan_json()
    bad = st.routing.copy()                       # uint8: handed to C as it is, unchecked
    t = int(st.cu_seqlens[5]) + 2
    bad[t, 3, 1] = 200
    _, _, _, (status, message) = c_remap(text, plan, st, "even", ids=bad)
    assert status == routepack.errors.ERANGE
    assert message == ("routing: sequence 5 token 2 layer 3 choice 1 has expert id 200, but "
                       "the model has 64 experts")
    with pytest.raises(routepack.Error) as exc:
        res.remap(bad)
    assert isinstance(exc.value, routepack.RoutingError)
    assert exc.value.message == message and exc.value.status == status
    assert exc.value.sequence == 5 and exc.value.expert == 200
    # the result is still usable afterwards
    np.testing.assert_array_equal(res.remap(st.routing), c_remap(text, plan, st, "even")[0])


def test_remap_without_physical_and_after_close(steps):
    text = config_text(False)
    st = steps[0]
    with routepack.Scheduler(text) as s:
        res = s.step(st.lengths, st.routing, group_ids=st.group_ids)
        plan = s.plan_json()
        assert res.physical_routing is None and res.slot_tokens is None
        for later in steps[1:]:
            s.step(later.lengths, later.routing, group_ids=later.group_ids)
    # the result's plan copy outlives the scheduler's plan and the scheduler
    phys = res.remap(st.routing)
    np.testing.assert_array_equal(phys, c_remap(text, plan, st, "even")[0])
    assert phys.dtype == np.int32 and phys.shape == st.routing.shape
