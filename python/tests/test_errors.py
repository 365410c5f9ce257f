"""Errors: every rp_status maps to a routepack.Error subclass; a bad config raises
ConfigError with the C message; bad routing raises RoutingError naming the sequence and
token; and a failed call leaves the scheduler usable."""

import json

import numpy as np
import pytest

import routepack
from routepack import errors
from conftest import SMALL_CONFIG, random_step


def test_every_status_has_a_class():
    seen = set()
    for code in range(1, 13):
        cls = errors.class_for_status(code)
        assert issubclass(cls, routepack.Error)
        assert cls.default_status == code
        seen.add(cls)
        e = cls("text", code)
        assert e.status == code and e.status_name == errors.STATUS_NAMES[code] and str(e) == "text"
    assert len(seen) == 12
    assert issubclass(routepack.LimitError, routepack.PolicyError)
    assert issubclass(routepack.ConfigError, ValueError)
    assert issubclass(routepack.RoutingError, ValueError)
    assert issubclass(routepack.FileError, OSError)
    assert errors.class_for_status(99) is routepack.Error


def test_unknown_key_in_config(tmp_path, tiny_config):
    tiny_config["topology"]["slots_per_gpuu"] = 5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(tiny_config, indent=2))
    with pytest.raises(routepack.ConfigError) as e:
        routepack.Scheduler(path)
    msg = str(e.value)
    assert msg.startswith(str(path) + ":")          # file:line:column first, from C
    assert "slots_per_gpuu" in msg and "slots_per_gpu" in msg
    assert e.value.line is not None and e.value.line > 1
    assert e.value.status in (errors.EINVAL, errors.ERANGE)


def test_config_syntax_and_missing_file(tmp_path):
    bad = tmp_path / "syntax.json"
    bad.write_text('{"topology": {"num_nodes": 1,,}}')
    with pytest.raises(routepack.ConfigError) as e:
        routepack.Scheduler(bad)
    assert e.value.status == errors.EFORMAT and "syntax.json:1:" in str(e.value)
    with pytest.raises(routepack.ConfigError) as e:
        routepack.Scheduler(tmp_path / "nope.json")
    assert e.value.status == errors.EIO and "nope.json" in str(e.value)


def test_config_from_dict_and_text(tiny_config):
    tiny_config["model"]["top_k"] = 99                # more than the 8 experts
    with pytest.raises(routepack.ConfigError) as e:
        routepack.Scheduler(tiny_config)
    assert "top_k" in str(e.value) and str(e.value).startswith("<dict>:")
    with pytest.raises(routepack.ConfigError) as e:
        routepack.Scheduler('{"topology": 5}')
    assert str(e.value).startswith("<inline>:")


def test_bad_options(tiny_config):
    with pytest.raises(TypeError, match="max_wal_s"):
        routepack.Scheduler(tiny_config, max_wal_s=1.0)
    with pytest.raises(routepack.InvalidArgumentError, match="split"):
        routepack.Scheduler(tiny_config, split="nearest")
    with pytest.raises(routepack.InvalidArgumentError, match="log_level"):
        routepack.Scheduler(tiny_config, log_level="loud")


def test_unknown_policy(tiny_config):
    with pytest.raises(routepack.Error) as e:
        routepack.Scheduler(tiny_config, policy="no_such_policy_here")
    assert "no_such_policy_here" in str(e.value)
    assert isinstance(e.value, (routepack.PolicyError, routepack.FileError,
                                routepack.InvalidArgumentError))


@pytest.fixture
def sched_and_step():
    rng = np.random.default_rng(3)
    lens = rng.integers(5, 60, size=12)
    lens, ids = random_step(rng, 12, 16, 8, 64, dtype=np.uint8, lens=lens)
    s = routepack.Scheduler(SMALL_CONFIG)
    yield s, lens, ids
    s.close()


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64])
def test_bad_expert_id_names_sequence_and_token(sched_and_step, dtype):
    s, lens, ids = sched_and_step
    bad = ids.astype(dtype)
    cu = np.concatenate([[0], np.cumsum(lens)])
    bad[cu[7] + 3, 5, 2] = 64 if dtype != np.int64 else 1 << 40
    want = 64 if dtype != np.int64 else 1 << 40
    with pytest.raises(routepack.RoutingError) as e:
        s.step(lens, bad)
    msg = str(e.value)
    assert "sequence 7 token 3 layer 5 choice 2 has expert id %d" % want in msg
    assert "64 experts" in msg
    assert e.value.sequence == 7 and e.value.expert == want
    assert e.value.status == errors.ERANGE
    # the scheduler is still usable and plans as if the bad call never happened
    fresh = routepack.Scheduler(SMALL_CONFIG)
    assert s.step(lens, ids, step=0).plan_hash == fresh.step(lens, ids, step=0).plan_hash


def test_shape_and_dtype_errors(sched_and_step):
    s, lens, ids = sched_and_step
    with pytest.raises(routepack.RoutingError, match=r"shape \(\d+, 16, 8\), expected"):
        s.step(lens, ids[:-1])
    with pytest.raises(routepack.RoutingError, match="layers"):
        s.step(lens, ids[:, :15])
    with pytest.raises(routepack.RoutingError, match="float"):
        s.step(lens, ids.astype(np.float32))
    cu = np.concatenate([[0], np.cumsum(lens)])
    per_seq = [ids[cu[i]:cu[i + 1]] for i in range(len(lens))]
    with pytest.raises(routepack.RoutingError, match="11 per-sequence routing arrays for 12"):
        s.step(lens, per_seq[:-1])
    per_seq[4] = per_seq[4][1:]
    with pytest.raises(routepack.RoutingError, match=r"routing\[4\] \(sequence 4\)") as e:
        s.step(lens, per_seq)
    assert e.value.sequence == 4
    with pytest.raises(routepack.RoutingError, match="cu_seqlens does not match"):
        s.step(lens, ids, cu_seqlens=cu + 1)
    neg = lens.copy()
    neg[2] = -1
    with pytest.raises(routepack.RoutingError, match="sequence 2 has response length -1"):
        s.step(neg, ids)
    with pytest.raises(routepack.RoutingError, match="give seq_lens"):
        s.step(None, ids)
    with pytest.raises(routepack.RoutingError, match="group_ids has 3 entries for 12"):
        s.step(lens, ids, group_ids=[1, 2, 3])
    with pytest.raises(routepack.RoutingError, match="layout"):
        s.step(lens, ids, layout="columnar")


class FakeCudaTensor:
    """What a torch CUDA tensor shows through DLPack."""

    def __dlpack_device__(self):
        return (2, 1)

    def __dlpack__(self, **kw):
        raise AssertionError("must not be exported")


class FakeCudaArray:
    @property
    def __cuda_array_interface__(self):
        return {"shape": (1, 16, 8), "typestr": "<i4", "data": (0, True), "version": 3}


def test_device_memory_is_refused_clearly(sched_and_step):
    s, lens, ids = sched_and_step
    with pytest.raises(routepack.RoutingError, match=r"device cuda:1.*\.cpu\(\)") as e:
        s.step(lens, FakeCudaTensor())
    assert e.value.status == errors.ENOTSUP
    with pytest.raises(routepack.RoutingError, match="GPU memory"):
        s.step(lens, FakeCudaArray())
    with pytest.raises(routepack.RoutingError, match="numpy array"):
        s.step(lens, "not an array")


def test_closed_scheduler(tiny_config):
    s = routepack.Scheduler(SMALL_CONFIG)
    s.close()
    s.close()                      # twice is fine
    with pytest.raises(routepack.InvalidArgumentError, match="closed"):
        s.step([1], np.zeros((1, 16, 8), np.uint8))
