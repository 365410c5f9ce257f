"""What the binding hands to C is checked, since ctypes checks nothing: integers that do not
fit their C type raise RangeError (they were wrapped: step=2**63 planned step -2**63,
at_step=2**70 swapped at the next step), text with a NUL byte is refused (a C string ends
there: the rest of a policy was silently dropped), and misaligned uint16/int32 arrays are
copied before C reads them through a typed pointer."""

import numpy as np
import pytest

import routepack
from routepack import _routing, errors
from conftest import random_step


def misaligned(arr):
    """A copy of `arr` whose data starts one byte past an aligned address."""
    buf = np.zeros(arr.nbytes + 1, dtype=np.uint8)
    out = buf[1:].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    assert not out.flags.aligned or not arr.size  # an empty array counts as aligned
    return out


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("layout", ["packed", "per_seq", "per_layer"])
def test_misaligned_routing_is_copied_aligned(tiny_config, dtype, layout):
    rng = np.random.default_rng(3)
    lens, ids = random_step(rng, 6, 2, 2, 8, dtype=dtype, lens=[3, 0, 5, 1, 2, 4])
    cu = np.concatenate([[0], np.cumsum(lens)])
    if layout == "packed":
        routing = misaligned(ids)
    elif layout == "per_seq":
        routing = [misaligned(ids[cu[s]:cu[s + 1]]) for s in range(len(lens))]
    else:
        routing = [misaligned(np.ascontiguousarray(ids[:, l, :])) for l in range(ids.shape[1])]
    lengths, view = _routing.prepare(routing, lens, None, None, num_layers=2, top_k=2,
                                     num_experts=8, layout=layout)
    assert view.copied
    assert all(a.flags.aligned for a in view.arrays)
    assert view.c.width == np.dtype(dtype).itemsize
    with routepack.Scheduler(tiny_config, "token_kk+eplb") as a, \
            routepack.Scheduler(tiny_config, "token_kk+eplb") as b:
        assert a.step(lens, routing, layout=layout).plan_hash == \
            b.step(lens, ids).plan_hash


def test_misaligned_lengths_are_copied_aligned():
    lens = misaligned(np.array([3, 0, 2, 5], dtype=np.int32))
    out = _routing.lengths(lens, None, misaligned(np.array([1, 1, 2, 2], dtype=np.int32)))
    for arr in (out.prompt, out.response, out.group_ids):
        assert arr.flags.aligned and arr.flags.c_contiguous
    assert list(out.response) == [3, 0, 2, 5] and list(out.group_ids) == [1, 1, 2, 2]


@pytest.fixture
def sched_and_step(tiny_config):
    rng = np.random.default_rng(1)
    lens, ids = random_step(rng, 4, 2, 2, 8, lens=[3, 1, 2, 4])
    s = routepack.Scheduler(tiny_config, "token_kk+eplb")
    yield s, lens, ids
    s.close()


@pytest.mark.parametrize("value", [2**63, -2**63 - 1, 2**70])
def test_step_index_out_of_int64(sched_and_step, value):
    s, lens, ids = sched_and_step
    with pytest.raises(errors.RangeError, match=r"step is %d; it must be in \[-2\^63, 2\^63 - 1\]"
                       % value):
        s.step(lens, ids, step=value)
    assert s.step(lens, ids, step=2**63 - 1).step == 2**63 - 1
    # the default next step would be 2**63: refused, not wrapped
    with pytest.raises(errors.RangeError, match="one past the previous"):
        s.step(lens, ids)


def test_step_index_types(sched_and_step):
    s, lens, ids = sched_and_step
    assert s.step(lens, ids, step=np.int64(5)).step == 5
    assert s.step(lens, ids, step=6.0).step == 6
    with pytest.raises(errors.RangeError, match="must be an integer, got 6.5"):
        s.step(lens, ids, step=6.5)
    with pytest.raises(TypeError, match="step must be an integer, got str"):
        s.step(lens, ids, step="7")
    with pytest.raises(TypeError, match="got a bool"):
        s.step(lens, ids, step=True)


def test_stage_policy_at_step_out_of_range(sched_and_step):
    s, lens, ids = sched_and_step
    s.step(lens, ids)
    with pytest.raises(errors.RangeError, match=r"at_step is %d; it must be in \[-1, 2\^63 - 1\]"
                       % 2**70):
        s.stage_policy("attn_kk+eplb", at_step=2**70)
    with pytest.raises(errors.RangeError, match="at_step is -2"):
        s.stage_policy("attn_kk+eplb", at_step=-2)
    # nothing was staged: the next step does not swap (2**70 had wrapped to 0 before)
    assert not s.step(lens, ids).swapped
    s.stage_policy("attn_kk+eplb", at_step=2**63 - 1)
    assert not s.step(lens, ids).swapped


def test_nul_in_policy_source_is_refused(sched_and_step):
    s, lens, ids = sched_and_step
    src = ("return {name = 'nul', version = '1.0.0', api = 1, description = 'x',\n"
           "plan = function(ctx) return rp.baseline('attn_kk+eplb') end}\n")
    with pytest.raises(errors.InvalidArgumentError, match="source holds a NUL byte at offset 10"):
        s.stage_policy(source=src[:10] + "\0" + src[10:])
    with pytest.raises(errors.InvalidArgumentError, match="NUL byte"):
        s.stage_policy(source=(src + "\0").encode())
    with pytest.raises(errors.InvalidArgumentError, match="path holds a NUL byte"):
        s.stage_policy(path="attn_kk\0+eplb")
    s.stage_policy(source=src)
    assert s.step(lens, ids).swapped


@pytest.mark.parametrize("option, value, ctype", [
    ("num_threads", 2**31, "int32"), ("history", -2**31 - 1, "int32"),
    ("max_instructions", 2**63, "int64"), ("max_memory_bytes", -1, "size_t"),
    ("max_memory_bytes", 2**64, "size_t"), ("max_depth", 2**32 + 10, "int32"),
    ("seed", -1, "uint64"), ("seed", 2**64, "uint64")])
def test_scheduler_options_out_of_range(tiny_config, option, value, ctype):
    with pytest.raises(errors.RangeError, match=r"%s is %d; .*the C %s" % (option, value, ctype)):
        routepack.Scheduler(tiny_config, **{option: value})


def test_scheduler_text_arguments_without_nul(tiny_config):
    with pytest.raises(errors.InvalidArgumentError, match="policy holds a NUL byte"):
        routepack.Scheduler(tiny_config, "token_kk\0+eplb")
    with pytest.raises(errors.InvalidArgumentError, match="params holds a NUL byte"):
        routepack.Scheduler(tiny_config, "token_kk+eplb", params='{"eplb": {}}\0')
    with pytest.raises(errors.InvalidArgumentError, match="config holds a NUL byte"):
        routepack.Scheduler("examples/config-small.json\0.txt")
    s = routepack.Scheduler(tiny_config, seed=2**64 - 1, max_memory_bytes=2**40)
    s.close()


def test_remap_and_dispatch_arguments(sched_and_step):
    s, lens, ids = sched_and_step
    res = s.step(lens, ids)
    with pytest.raises(errors.RangeError, match="num_threads is 4294967297"):
        res.remap(ids, num_threads=2**32 + 1)
    with pytest.raises(errors.RangeError, match="microbatch is 4294967296"):
        res.dispatch_ranks(np.zeros((1, 2, 2), np.int32), microbatch=2**32)
    assert res.remap(ids, num_threads=1).shape == ids.shape


def test_load_state_next_step_is_checked(sched_and_step):
    if not routepack.can_checkpoint():
        pytest.skip("no checkpoint support")
    s, lens, ids = sched_and_step
    s.step(lens, ids)
    good = s.state_dict()
    with pytest.raises(errors.RangeError, match=r"state\['next_step'\] is %d" % 2**63):
        s.load_state_dict(dict(good, next_step=2**63))
    with pytest.raises(TypeError, match="next_step'\\] must be an integer"):
        s.load_state_dict(dict(good, next_step="1"))
    with pytest.raises(errors.InvalidArgumentError, match="must be the state text"):
        s.load_state_dict(dict(good, state=b"{}"))
    assert s.state_dict() == good


def test_trace_arguments(tmp_path, sched_and_step):
    _, lens, ids = sched_and_step
    with pytest.raises(errors.RangeError, match="num_experts is %d" % (2**32 + 8)):
        routepack.TraceWriter(tmp_path / "t.rpt", 2**32 + 8)
    with pytest.raises(errors.InvalidArgumentError, match="path holds a NUL byte"):
        routepack.TraceWriter(str(tmp_path / "t.rpt") + "\0x", 8)
    with routepack.TraceWriter(tmp_path / "t.rpt", 8) as w:
        with pytest.raises(errors.RangeError, match="step is %d" % 2**63):
            w.append(2**63, lens, ids)
        w.append(2**63 - 1, lens, ids)
    r = routepack.TraceReader(tmp_path / "t.rpt")
    assert r[0].step == 2**63 - 1 and r.info(np.int32(0))["step"] == 2**63 - 1
    with pytest.raises(errors.RangeError, match="step index is %d" % 2**64):
        r[2**64]
    with pytest.raises(errors.InvalidArgumentError, match="path holds a NUL byte"):
        routepack.TraceReader(str(tmp_path / "t.rpt") + "\0")
