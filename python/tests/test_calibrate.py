"""routepack.calibrate: a fake device run recovers the figures it was built with, written
in calibration.json's format; values that cannot be measured fail the run and write
nothing; the C test's calibration file is exactly what the fake run writes. With torch,
the real measurements run on the CPU at tiny sizes."""

import json
import math

import pytest

from conftest import REPO

from routepack import calibrate

SMALL = str(REPO / "examples" / "config-small.json")
REFERENCE = str(REPO / "examples" / "config-reference.json")
FAKE_FILE = REPO / "tests" / "data" / "calibration" / "fake.json"


def _run(tmp_path, *args):
    out = tmp_path / "calibration.json"
    rc = calibrate.main(["--out", str(out)] + list(args))
    return rc, out


def test_fake_run_recovers_the_device_figures(tmp_path):
    rc, out = _run(tmp_path, "--fake", "--config", SMALL, "--config", REFERENCE)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "routepack-calibration" and doc["version"] == 1
    assert sorted(doc["shapes"]) == ["d2048_f1024_h16_kv16_dh128", "d2048_f768_h32_kv4_dh128"]
    e = doc["shapes"]["d2048_f768_h32_kv4_dh128"]
    assert (e["hidden_size"], e["expert_ffn_size"], e["num_heads"], e["num_kv_heads"], e["head_dim"]) == \
        (2048, 768, 32, 4, 128)
    gemm = dict((n, x) for n, x in e["gemm_efficiency"])
    # the fake device's expert GEMM runs at 0.8 n / (n + 256) of peak
    assert gemm[256] == 0.4 and gemm[1024] == 0.64 and gemm[64] == 0.16
    assert [n for n, _ in e["gemm_efficiency"]] == calibrate.PROFILES["device"]["gemm_tokens"]
    att = dict((n, x) for n, x in e["attention_efficiency"])
    # and its attention at 0.7 L / (L + 2048)
    assert att[2048] == 0.35 and att[512] == 0.14 and att[8192] == 0.56
    assert e["dense_efficiency"] == 0.75
    assert e["backward"] == {"attention": 2.5, "projections": 2.0, "experts": 2.25}
    assert e["hbm_bytes_per_s"] == 4e12
    assert e["layer_fixed_us"] == 40.0
    assert e["peak_flops"] == 989e12
    assert e["gemm_kernel"] == "fake_grouped_gemm" and e["attention_kernel"] == "fake_flash_varlen"


def test_c_test_file_is_the_fake_run(tmp_path):
    """tests/data/calibration/fake.json (read by tests/test_calibration.c) is what the
    fake run writes today: regenerate it with the command in its directory's README."""
    rc, out = _run(tmp_path, "--fake", "--config", SMALL, "--config", REFERENCE)
    assert rc == 0
    assert out.read_text() == FAKE_FILE.read_text()


class _NoAttention(calibrate.FakeDevice):
    def attention(self, s, length, tokens, backward):
        raise RuntimeError("no fused kernel on this device")


class _NoisyBackward(calibrate.FakeDevice):
    def projections(self, s, tokens, backward):
        t = super().projections(s, tokens, False)
        return t * 0.9 if backward else t


class _SlowPeak(calibrate.FakeDevice):
    def experts(self, s, counts, backward):
        return super().experts(s, counts, backward) / 10.0   # faster than the datasheet allows


@pytest.mark.parametrize("device, words", [
    (_NoAttention, ["attention_efficiency", "varlen attention (length 512", "no fused kernel",
                    "layer_fixed_us"]),
    (_NoisyBackward, ["dense_efficiency", "backward", "< 0"]),
    (_SlowPeak, ["gemm_efficiency", "exceeds 1", "peak_flops"]),
])
def test_a_value_not_measured_fails_and_writes_nothing(tmp_path, device, words):
    shapes = calibrate.shapes_from_configs([SMALL])
    cal = calibrate.Calibration(device("device"), "device")
    entries, _ = cal.run(shapes)
    assert entries == {}
    text = " | ".join(cal.failures)
    for w in words:
        assert w in text, (w, text)


def test_main_exits_1_naming_the_value(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "FakeDevice", _NoAttention)
    rc, out = _run(tmp_path, "--fake", "--config", SMALL)
    assert rc == 1 and not out.exists()
    err = capsys.readouterr().err
    assert "not measured: d2048_f1024_h16_kv16_dh128 attention_efficiency" in err
    assert "not written" in err


def test_budget_exhausted_names_what_was_left(tmp_path):
    shapes = calibrate.shapes_from_configs([SMALL])
    cal = calibrate.Calibration(calibrate.FakeDevice("device"), "device", budget_s=-1)
    entries, _ = cal.run(shapes)
    assert entries == {} and "time budget ran out" in cal.failures[0]


def test_shapes_from_configs(tmp_path):
    shapes = calibrate.shapes_from_configs([SMALL, REFERENCE, SMALL])
    assert list(shapes) == ["d2048_f1024_h16_kv16_dh128", "d2048_f768_h32_kv4_dh128"]
    assert shapes["d2048_f768_h32_kv4_dh128"]["peak_flops"] == 989e12
    other = json.loads(open(SMALL).read())
    other["hardware"] = {"peak_flops": 1e15}
    p = tmp_path / "c.json"
    p.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="peak_flops"):
        calibrate.shapes_from_configs([SMALL, str(p)])


def test_model_formulas_by_hand():
    s = {"hidden_size": 4, "expert_ffn_size": 3, "num_heads": 2, "num_kv_heads": 1, "head_dim": 5,
         "peak_flops": 100.0, "bytes_per_param": 2}
    assert calibrate.expert_flops(s, 10) == 6 * 10 * 4 * 3
    assert calibrate.attention_flops(s, 7) == 2 * 49 * 2 * 5
    assert calibrate.projection_flops(s, 3) == 2 * 3 * 4 * (2 * 10 + 2 * 5)
    curve = [[10, 0.2], [20, 0.4]]
    assert calibrate.interp(curve, 5) == 0.2 and calibrate.interp(curve, 15) == pytest.approx(0.3)
    assert calibrate.interp(curve, 99) == 0.4
    # t(n) = max(720 / (100 * 0.2), 3 * 4 * 3 * 2 / hbm)
    assert calibrate.expert_seconds(s, 10, curve, 1e9) == pytest.approx(36.0)
    assert calibrate.expert_seconds(s, 10, curve, 1.0) == 72.0
    assert calibrate.skewed_counts(100, 4) == [48, 24, 16, 12]   # 100 / (1 + 1/2 + 1/3 + 1/4) = 48
    assert sum(calibrate.skewed_counts(1000, 16)) == 1000


def _measure_on_cpu(rank, world):
    """In a process of its own (torch_world): the layer's cell makes a one-rank group."""
    import torch
    dev = calibrate.TorchDevice("cpu", "tiny")
    s = dict(calibrate.shapes_from_configs([SMALL])["d2048_f1024_h16_kv16_dh128"])
    s.update(hidden_size=64, expert_ffn_size=32, num_heads=4, num_kv_heads=2, head_dim=16)
    times = [dev.experts(s, [3, 0, 5], False), dev.experts(s, [3, 0, 5], True),
             dev.attention(s, 8, 32, False), dev.attention(s, 8, 32, True),
             dev.projections(s, 16, True), dev.copy(1 << 12), dev.tiny_layer(s, 4)]
    return dev.attention_kernel, dev.gemm_kernel, times, torch.__version__


def test_torch_device_measures_on_cpu():
    pytest.importorskip("torch", reason="the real measurements need PyTorch")
    import torch_world
    att, gemm, times, _ = torch_world.run(_measure_on_cpu, 1)[0]
    assert att in ("sdpa_flash", "torch_varlen", "flash_attn_varlen")
    assert gemm in ("torch._grouped_mm", "per_expert_loop")
    assert all(t > 0 and math.isfinite(t) for t in times)
