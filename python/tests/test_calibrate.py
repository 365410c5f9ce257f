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
    assert e["backward"] == {"attention": 2.5, "projections": 2.0, "experts": 2.25, "experts_dgrad": 1.05}
    # the fake device loops over its experts: no tile; its weight gradient at 0.6 n / (n + 128)
    assert e["gemm_tile_rows"] == 1
    assert dict((n, x) for n, x in e["wgrad_efficiency"])[256] == 0.4
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


# ---- the grouped GEMM's fits (docs/cost-model.md, "Experts") ----

def _grouped_truth():
    """A grouped device: tile 16, the grouped forward at 0.8 P / (P + 1024) of peak by total
    padded rows (at every tile, so interpolation is exact at the samples), the weight gradient from
    0.02 (16 rows) to 0.6 (4096 rows), data gradient 0.9 x the forward."""
    Ps = range(16, 16 * 8193, 16)
    return {"gemm_tile_rows": 16,
            "grouped_gemm_efficiency": [[P, 0.8 * P / (P + 1024.0)] for P in Ps],
            "wgrad_efficiency": [[16, 0.02], [4096, 0.6]],
            "experts_dgrad": 0.9}


def test_fit_tile_on_synthetic_probes():
    s = {"hidden_size": 4, "expert_ffn_size": 2, "peak_flops": 64.0}
    # a padded grouped GEMM at 0.8 P / (P + 512) of peak: the efficiency rises with the
    # rows about as fast as the padding adds them, so time ratios alone cannot tell
    def t(E, n, tile):
        P = E * calibrate.pad(n, tile)
        return calibrate.expert_flops(s, P) / (64.0 * 0.8 * P / (P + 512.0))
    for tile in (1, 8, 16, 64):
        samples = [(E, n, t(E, n, tile)) for E in (4, 8, 16) for n in (1, 4, 16, 64, 128, 256)]
        samples += [(8, n, t(8, n, tile)) for n0 in (8, 16, 32, 64) for n in (n0, n0 + 1)]
        assert calibrate.fit_tile(samples) == tile, tile
        # 1% noise does not move a tile the padding shows (a tile of 2 or 4 rows instead of
        # 1 is within such noise here, and costs as little)
        if tile >= 8:
            noisy = [(E, n, x * (1.01 if (E + n) % 2 else 0.99)) for E, n, x in samples]
            assert calibrate.fit_tile(noisy) == tile, tile
    with pytest.raises(calibrate.MeasurementError, match="no probe pair"):
        calibrate.fit_tile([(16, 8, 1.0), (16, 10, 1.0)])


def test_fits_by_hand():
    s = {"hidden_size": 4, "expert_ffn_size": 2, "peak_flops": 64.0, "bytes_per_param": 2, "bytes_per_grad": 4}
    # 6 d f / peak = 0.75 s a row: 2 experts x 3 rows padded to 4 (tile 4) in 12 s -> 8 x 0.75 / 12
    assert calibrate.fit_grouped_efficiency(s, [(2, 3, 12.0), (2, 4, 6.0), (4, 2, 12.0)], 4) == \
        [[8, 0.75], [16, 1.0]]   # at P 8 the median of 0.5 and 1.0, at P 16: 1.0
    assert calibrate.fit_wgrad_efficiency(s, [(2, 4, 16.8)], 4) == [[4, pytest.approx(6 / 16.8)]]
    # the C test's skewed and uniform rows (tests/test_cost_gemm.c): forward+backward 47.4 s
    # and 34.8 s with tile 4, a flat 0.5, wgrad 0.25 .. 0.5 over 1 .. 8 rows, dgrad 0.5
    g = {"gemm_tile_rows": 4, "grouped_gemm_efficiency": [[1, 0.5]], "wgrad_efficiency": [[1, 0.25], [8, 0.5]],
         "experts_dgrad": 0.5, "hbm_bytes_per_s": 48.0}
    assert calibrate.grouped_seconds(s, [6, 2], g, True) == pytest.approx(47.4)
    assert calibrate.grouped_seconds(s, [4, 4], g, True) == pytest.approx(34.8)
    assert calibrate.grouped_seconds(s, [6, 2], g) == pytest.approx(18.0)
    # dgrad: (fb - f - the weight gradient) / f = (34.8 - 12 - 16.8) / 12
    assert calibrate.fit_dgrad(s, [(2, 4, 12.0, 34.8)], g, key_min=1) == pytest.approx(0.5)
    assert calibrate.fit_dgrad(s, [(2, 4, 12.0, 20.0)], g, key_min=1) == 0.0   # never negative


def test_better_form():
    assert calibrate.better_form(0.05, 0.20) == "grouped"
    assert calibrate.better_form(0.20, 0.05) == "loop"
    assert calibrate.better_form(0.175, 0.177) == "tie"      # the CPU's second run: noise
    assert calibrate.better_form(0.0, 0.0) == "tie"


class _GroupedFake(calibrate.FakeDevice):
    """The grouped device, with HBM fast enough that the weights' read (the floor of a
    GPU's forward) does not hide the padding of small counts."""
    def __init__(self, profile):
        super().__init__(profile, grouped=_grouped_truth())
        self.truth["hbm_bytes_per_s"] = 4e14


def test_fake_grouped_device_is_recovered():
    shapes = calibrate.shapes_from_configs([SMALL])
    cal = calibrate.Calibration(_GroupedFake("device"), "device")
    entries, details = cal.run(shapes)
    assert not cal.failures, cal.failures
    e, truth = entries["d2048_f1024_h16_kv16_dh128"], _grouped_truth()
    assert e["gemm_tile_rows"] == 16
    for P, eff in e["grouped_gemm_efficiency"]:
        assert eff == pytest.approx(calibrate.interp(truth["grouped_gemm_efficiency"], P), rel=1e-9), P
    # the weight gradient at 16 rows and more: the curve (the write of dW is below it there)
    for n, eff in e["wgrad_efficiency"]:
        assert n % 16 == 0
        assert eff == pytest.approx(calibrate.interp(truth["wgrad_efficiency"], n), rel=1e-9), n
    assert e["backward"]["experts_dgrad"] == pytest.approx(0.9, rel=1e-9)
    # the skew check tests the grouped term: right on this device (to the curve's
    # interpolation between the sampled totals); the per-expert sum is reported beside it
    sk = details["d2048_f1024_h16_kv16_dh128"]["gemm_skewed"]
    assert sk["grouped_measured_over_predicted"] == pytest.approx(1.0, rel=1e-3)
    assert sk["grouped_fb_measured_over_predicted"] == pytest.approx(1.0, rel=1e-3)
    assert sk["per_expert_fb_measured_over_predicted"] > 0
    # and skewed against uniform counts of the same rows, as the grouped term prices them
    assert sk["grouped_forward_backward_s"] / sk["uniform_grouped_forward_backward_s"] == pytest.approx(
        sk["forward_backward_s"] / sk["uniform_forward_backward_s"], rel=1e-3)
