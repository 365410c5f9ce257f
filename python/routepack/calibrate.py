"""routepack.calibrate: measure, on one GPU, the figures the cost model takes from the
hardware (docs/calibration.md), per model shape of the given configs, and write them as
calibration.json, which a config loads with ``"calibration": "path"``.

    python -m routepack.calibrate --config examples/config-small.json ... --out calibration.json

Per shape (key ``d<hidden>_f<ffn>_h<heads>_kv<kv heads>_dh<head dim>``):
- gemm_efficiency: eff(n) of the grouped SwiGLU expert GEMM in one launch
  (torch._grouped_mm where it runs, else one GEMM per expert; gemm_kernel says which), n
  token-choices per expert, uniform counts over 8, 16 and 32 local experts (the median
  over the three): the per-expert cost form's curve;
- the grouped GEMM's figures (docs/cost-model.md, "Experts"), fitted from the same
  samples and a few more: gemm_tile_rows, the rows each expert's rows are padded up to
  (probes at n and n + 1 rows: the candidate tile whose padding explains their time
  ratios best); grouped_gemm_efficiency by a GPU's total padded rows (every uniform
  sample, the median at each total); wgrad_efficiency, the weight-gradient GEMMs alone by
  one expert's padded rows; backward.experts_dgrad, the rest of the expert backward as a
  multiple of the forward; skewed counts are timed against the grouped term's
  prediction and the per-expert sum's, forward and forward+backward (detail file and log);
- attention_efficiency: causal varlen attention forward of a packed microbatch of
  sequences of one length, 512 .. 32k (attention_kernel says which fused kernel; an
  unfused kernel's figure is never written: no fused kernel is an error);
- dense_efficiency: the QKV and output projections at 16k tokens;
- backward: fwd+bwd / fwd - 1 of attention, projections and experts;
- hbm_bytes_per_s: a device-to-device copy;
- layer_fixed_us: a whole layer's forward (routepack.torch.cell.LayerCell) at 16 tokens,
  less what the model predicts for its compute from the figures above.
Efficiencies are fractions of the config's hardware.peak_flops (default: the H200 SXM
datasheet's 989e12 dense BF16), recorded as peak_flops. Timings: CUDA events, warmup
calls, medians. Exit status 0 when every value was measured and the file written; 1
otherwise, naming each value that could not be (the file is then not written).

``--links N`` also measures the links between N ranks of this machine (routepack.links:
gloo between pinned CPU processes with ``--device cpu`` or ``--fake``, NCCL between N GPUs
otherwise) and writes them as the file's "links", which set a config's
topology.nvlink_bytes_per_s and nvlink_latency_us where it leaves them out.

``--fake`` measures a synthetic device with known figures instead (FakeDevice), on any
machine and without torch: the tests check that the program recovers them."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

DEFAULT_PEAK_FLOPS = 989e12      # H200 SXM dense BF16 (docs/cost-model.md)
DEFAULT_HBM_BYTES_PER_S = 4.8e12
FORMAT, VERSION = "routepack-calibration", 1

PROFILES = {
    # tokens per expert, local expert counts, attention lengths, tokens per packed
    # attention microbatch, tokens of the dense projections, bytes of the HBM copy
    "device": dict(gemm_tokens=[1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
                   gemm_experts=[8, 16, 32], max_gemm_rows=1 << 17,
                   attention_lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                   attention_tokens=32768, dense_tokens=16384, copy_bytes=1 << 31,
                   skew_tokens=1024, fixed_tokens=16, warmup=2, reps=7,
                   tile_probes=[16, 32, 64, 128, 256], wgrad_tokens=[1, 4, 16, 64, 256, 1024, 4096]),
    # the CPU as a device (routepack.cpu: one pinned thread, fp32, least thread CPU time
    # of reps): the sizes a CPU runs in seconds, not hours
    "cpu": dict(gemm_tokens=[1, 4, 16, 64, 128, 256, 512, 1024, 2048], gemm_experts=[4, 8, 16],
                max_gemm_rows=1 << 14, attention_lengths=[64, 128, 256, 512, 1024, 2048],
                attention_tokens=4096, dense_tokens=2048, copy_bytes=1 << 26,
                skew_tokens=256, fixed_tokens=16, warmup=1, reps=5,
                tile_probes=[8, 16, 32, 64], wgrad_tokens=[1, 4, 16, 64, 256, 1024]),
    # for CPU tests: tiny, same code paths
    "tiny": dict(gemm_tokens=[1, 4, 16], gemm_experts=[2, 4], max_gemm_rows=1 << 8,
                 attention_lengths=[8, 16, 32], attention_tokens=32, dense_tokens=16,
                 copy_bytes=1 << 16, skew_tokens=8, fixed_tokens=4, warmup=1, reps=3,
                 tile_probes=[4, 8], wgrad_tokens=[1, 4, 16]),
}
BACKWARD_MIN_TOKENS = 256      # expert backward ratio: median over n >= this (all if none)
BACKWARD_MIN_LENGTH = 2048     # attention backward ratio: median over L >= this (all if none)
TILE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class MeasurementError(Exception):
    """A value that could not be measured; the message names it."""


def shape_key(model):
    return "d%d_f%d_h%d_kv%d_dh%d" % (model["hidden_size"], model["expert_ffn_size"], model["num_heads"],
                                      model["num_kv_heads"], model["head_dim"])


SHAPE_FIELDS = ("hidden_size", "expert_ffn_size", "num_heads", "num_kv_heads", "head_dim")


def shapes_from_configs(paths):
    """{shape key: {shape fields, peak_flops, bytes_per_param, configs}} of the configs'
    models, in order of first appearance."""
    shapes = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        model = cfg.get("model", {})
        missing = [k for k in SHAPE_FIELDS if k not in model]
        if "num_kv_heads" in missing and "num_heads" in model:   # the config default
            model = dict(model, num_kv_heads=model["num_heads"])
            missing.remove("num_kv_heads")
        if missing:
            raise ValueError("%s: model has no %s" % (path, ", ".join(missing)))
        hw = cfg.get("hardware", {})
        peak = float(hw.get("peak_flops", DEFAULT_PEAK_FLOPS))
        key = shape_key(model)
        if key in shapes:
            if shapes[key]["peak_flops"] != peak:
                raise ValueError("%s: shape %s with peak_flops %g, but %s has %g" % (
                    path, key, peak, shapes[key]["configs"][0], shapes[key]["peak_flops"]))
            shapes[key]["configs"].append(str(path))
            continue
        entry = {k: int(model[k]) for k in SHAPE_FIELDS}
        bpp = int(model.get("bytes_per_param", 2))
        entry.update(peak_flops=peak, bytes_per_param=bpp, bytes_per_grad=int(model.get("bytes_per_grad", 0)) or bpp,
                     configs=[str(path)])
        shapes[key] = entry
    return shapes


# ---- the model's formulas (docs/cost-model.md), which turn times into efficiencies ----

def interp(curve, x):
    """The cost model's curve lookup: linear between points, flat beyond both ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def expert_flops(s, n):
    return 6.0 * n * s["hidden_size"] * s["expert_ffn_size"]


def attention_flops(s, length):
    return 2.0 * length * length * s["num_heads"] * s["head_dim"]


def projection_flops(s, tokens):
    hd, kvd = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    return 2.0 * tokens * s["hidden_size"] * (2 * hd + 2 * kvd)


def expert_seconds(s, n, gemm_curve, hbm):
    """t(n) of the cost model: compute, or the weights read once, whichever is longer."""
    if n <= 0:
        return 0.0
    floor = 3.0 * s["hidden_size"] * s["expert_ffn_size"] * s["bytes_per_param"] / hbm
    return max(expert_flops(s, n) / (s["peak_flops"] * interp(gemm_curve, n)), floor)


def tiny_layer_seconds(s, tokens, fig):
    """What the model predicts for LayerCell's forward at ``tokens`` tokens in one
    sequence routed top-1 to one expert, without the fixed cost."""
    peak = s["peak_flops"]
    return (attention_flops(s, tokens) / (peak * interp(fig["attention_efficiency"], tokens))
            + projection_flops(s, tokens) / (peak * fig["dense_efficiency"])
            + expert_seconds(s, tokens, fig["gemm_efficiency"], fig["hbm_bytes_per_s"]))


def pad(n, tile):
    """n rows padded up to the tile (0 stays 0)."""
    return -(-n // tile) * tile if n > 0 else 0


def grouped_seconds(s, counts, g, backward=False):
    """The grouped term of the cost model (docs/cost-model.md, "Experts") for one GPU's
    expert rows ``counts`` from the figures ``g`` (gemm_tile_rows, grouped_gemm_efficiency,
    wgrad_efficiency, experts_dgrad, hbm_bytes_per_s): the forward, or forward + backward."""
    T = g["gemm_tile_rows"]
    rows = [pad(n, T) for n in counts if n > 0]
    if not rows:
        return 0.0
    P, peak = sum(rows), s["peak_flops"]
    floor = 3.0 * s["hidden_size"] * s["expert_ffn_size"] * s["bytes_per_param"] / g["hbm_bytes_per_s"]
    fwd = max(expert_flops(s, P) / (peak * interp(g["grouped_gemm_efficiency"], P)), len(rows) * floor)
    if not backward:
        return fwd
    return fwd * (1.0 + g["experts_dgrad"]) + sum(wgrad_seconds(s, r, g) for r in rows)


def wgrad_seconds(s, rows, g):
    """One expert's weight-gradient GEMMs at ``rows`` padded rows, at least the write of dW."""
    floor = 3.0 * s["hidden_size"] * s["expert_ffn_size"] * s.get("bytes_per_grad", s["bytes_per_param"]) / \
        g["hbm_bytes_per_s"]
    return max(expert_flops(s, rows) / (s["peak_flops"] * interp(g["wgrad_efficiency"], rows)), floor)


# ---- the grouped GEMM's fits (pure: the tests feed them synthetic timings) ----

def fit_tile(samples, candidates=TILE_CANDIDATES):
    """The tile each expert's rows are padded up to, from forward samples ``(experts, n,
    seconds)`` (uniform counts, with probes at n and n + 1 rows): for each candidate tile
    T (at most the largest n), the time as a + b x padded rows + c x experts, least
    squares in relative error (a grouped GEMM's time is a launch plus its tiles, and a
    per-group cost); samples of equal padded rows must then take equal time, and rows
    past a tile boundary must cost a tile. The smallest candidate within a quarter of the
    best fit's error wins (a kernel without padding gives 1). Only samples of the probes'
    expert counts and of at most twice the largest probe pair's n count: beyond, the
    padding is negligible and the curve bends."""
    import numpy as np
    pairs = [n for E, n, _ in samples for F, m, _ in samples if m == n + 1 and E == F]
    if not pairs:
        raise MeasurementError("gemm_tile_rows: no probe pair at n and n + 1 rows")
    probe_e = {E for E, n, _ in samples for F, m, _ in samples if m == n + 1 and E == F}
    near = [(E, n, t) for E, n, t in samples if n <= 2 * max(pairs) + 1 and E in probe_e]
    t = np.array([x for _, _, x in near])
    errs = []
    for T in candidates:
        if T > max(pairs):
            break
        A = np.array([[1.0, E * pad(n, T), E] for E, n, _ in near]) / t[:, None]
        coef = np.linalg.lstsq(A, np.ones(len(near)), rcond=None)[0]
        errs.append((float(np.sum((A @ coef - 1.0) ** 2)), T))
    best = min(e for e, _ in errs)
    # within a quarter of the best fit's error counts as a tie (noise)
    return next(T for e, T in errs if e <= 1.25 * best + 1e-12)


def fit_grouped_efficiency(s, samples, tile):
    """grouped_gemm_efficiency from forward samples ``(experts, n, seconds)``: the GPU's total
    padded rows P = experts x pad(n), eff = 6 P d f / (peak t) (at most 1), the median at
    each P, by P."""
    per = {}
    for E, n, t in samples:
        P = E * pad(n, tile)
        per.setdefault(P, []).append(min(expert_flops(s, P) / (t * s["peak_flops"]), 1.0))
    return [[P, statistics.median(per[P])] for P in sorted(per)]


def fit_wgrad_efficiency(s, samples, tile):
    """wgrad_efficiency from weight-gradient samples ``(experts, n, seconds)``: per expert of
    pad(n) rows, eff = 6 experts pad(n) d f / (peak t) (at most 1), the median at each
    padded n, by padded n."""
    per = {}
    for E, n, t in samples:
        r = pad(n, tile)
        per.setdefault(r, []).append(min(expert_flops(s, E * r) / (t * s["peak_flops"]), 1.0))
    return [[r, statistics.median(per[r])] for r in sorted(per)]


def fit_dgrad(s, samples, g, key_min=BACKWARD_MIN_TOKENS):
    """backward.experts_dgrad from uniform samples ``(experts, n, forward s, forward+backward
    s)``: (fb - f - the weight gradient the fitted curve gives) / f, the median over n >=
    key_min (all when none is), at least 0."""
    rows = []
    for E, n, tf, tb in samples:
        w = E * wgrad_seconds(s, pad(n, g["gemm_tile_rows"]), g)
        rows.append((n, (tb - tf - w) / tf))
    chosen = [r for n, r in rows if n >= key_min] or [r for _, r in rows]
    return max(statistics.median(chosen), 0.0)


def better_form(grouped_err, per_expert_err):
    """Which expert form prices a device's samples better, from each form's mean relative
    error: "grouped", "loop", or "tie" when they are within a tenth of each other (what
    timing noise on a shared machine does)."""
    if abs(grouped_err - per_expert_err) <= 0.1 * min(grouped_err, per_expert_err):
        return "tie"
    return "grouped" if grouped_err < per_expert_err else "loop"


def skewed_counts(total, experts):
    """Zipf-like counts (weight 1/(j+1)), summing to total: a hot expert and a long tail."""
    w = [1.0 / (j + 1) for j in range(experts)]
    counts = [int(total * x / sum(w)) for x in w]
    counts[0] += total - sum(counts)
    return counts


# ---- devices ----

class FakeDevice:
    """A synthetic device whose figures are known: each time is what the cost model
    predicts from ``truth`` (curves sampled at the profile's points, so interpolation is
    exact), plus the fixed cost for a whole layer. No torch needed."""

    name, torch_version, cuda_version = "fake device", "none", "none"
    gemm_kernel, attention_kernel = "fake_grouped_gemm", "fake_flash_varlen"
    kernel_notes = ["fake device: every time is computed from known figures"]

    def __init__(self, profile, grouped=None):
        """``grouped``: the device runs its experts as the cost model's grouped term with
        these figures (gemm_tile_rows, grouped_gemm_efficiency, wgrad_efficiency,
        experts_dgrad); None: one GEMM per expert at gemm_efficiency, the weight gradient
        at 0.6 n / (n + 128) of peak."""
        p = PROFILES[profile]
        self.grouped = grouped
        self.truth = dict(
            gemm_efficiency=[[n, round(0.8 * n / (n + 256.0), 6)] for n in p["gemm_tokens"]],
            attention_efficiency=[[L, round(0.7 * L / (L + 2048.0), 6)] for L in p["attention_lengths"]],
            dense_efficiency=0.75, backward={"attention": 2.5, "projections": 2.0, "experts": 2.25},
            hbm_bytes_per_s=4.0e12, layer_fixed_us=40.0)

    def prepare(self, shape):
        pass

    def experts(self, s, counts, backward):
        if self.grouped:
            return grouped_seconds(s, counts, dict(self.grouped, hbm_bytes_per_s=self.truth["hbm_bytes_per_s"]),
                                   backward)
        t = sum(expert_flops(s, n) / (s["peak_flops"] * interp(self.truth["gemm_efficiency"], n))
                for n in counts)
        return t * (1 + self.truth["backward"]["experts"]) if backward else t

    def wgrad(self, s, counts):
        if self.grouped:
            g = dict(self.grouped, hbm_bytes_per_s=self.truth["hbm_bytes_per_s"])
            return sum(wgrad_seconds(s, pad(n, g["gemm_tile_rows"]), g) for n in counts if n > 0)
        return sum(expert_flops(s, n) / (s["peak_flops"] * 0.6 * n / (n + 128.0)) for n in counts if n > 0)

    def attention(self, s, length, tokens, backward):
        t = (tokens // length) * attention_flops(s, length) / (
            s["peak_flops"] * interp(self.truth["attention_efficiency"], length))
        return t * (1 + self.truth["backward"]["attention"]) if backward else t

    def projections(self, s, tokens, backward):
        t = projection_flops(s, tokens) / (s["peak_flops"] * self.truth["dense_efficiency"])
        return t * (1 + self.truth["backward"]["projections"]) if backward else t

    def copy(self, nbytes):
        return 2 * nbytes / self.truth["hbm_bytes_per_s"]

    def tiny_layer(self, s, tokens):
        return self.truth["layer_fixed_us"] * 1e-6 + tiny_layer_seconds(s, tokens, self.truth)


def cpu_name():
    """The CPU's model name (/proc/cpuinfo), one thread: "cpu: AMD EPYC, 1 thread, fp32"."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "cpu: %s, 1 thread, fp32" % model


class TorchDevice:
    """One CUDA device, or the CPU (routepack.cpu: one thread pinned to a core, fp32, the
    least thread CPU time of the profile's reps), measured through torch."""

    def __init__(self, device, profile):
        import torch
        from routepack import cpu
        from routepack.torch import kernels
        self.torch, self.kernels = torch, kernels
        self.device = torch.device(device)
        self.p = PROFILES[profile]
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else cpu.dtype()
        self.core = None if cuda else cpu.pin(0)
        self.name = torch.cuda.get_device_name(self.device) if cuda else cpu_name()
        self.torch_version = torch.__version__
        self.cuda_version = str(torch.version.cuda) if cuda else "none"
        self.gemm_kernel, why = kernels.choose_expert_kernel(self.device, self.dtype)
        self.kernel_notes = ["experts: %s (%s)" % (self.gemm_kernel, why)]
        self.attention_kernel, notes = kernels.choose_attention_kernel(self.device, self.dtype)
        self.kernel_notes += ["attention: passed over %s" % n for n in notes]
        self._cache = {}

    def _time(self, fn):
        if self.device.type == "cpu":
            from routepack import cpu
            return cpu.min_thread_seconds(fn, self.p["warmup"], self.p["reps"])
        from routepack.torch.cell import median_seconds
        return median_seconds(fn, self.device, self.p["warmup"], self.p["reps"])

    def _randn(self, *shape, scale=1.0, grad=False):
        t = (self.torch.randn(*shape, device=self.device, dtype=self.torch.float32) * scale).to(self.dtype)
        return t.requires_grad_() if grad else t

    def prepare(self, shape):
        self._cache = {}
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def _fwd_bwd(self, fn, leaves, backward):
        torch = self.torch
        if not backward:
            def run():
                with torch.no_grad():
                    fn()
            return self._time(run)
        out = fn()
        grad = torch.randn_like(out)

        def run_bwd():
            o = fn()
            o.backward(grad)
            for t in leaves:
                t.grad = None
        return self._time(run_bwd)

    def experts(self, s, counts, backward):
        d, f = s["hidden_size"], s["expert_ffn_size"]
        E, N = len(counts), sum(counts)
        key = ("w", E)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] != "w"}
            self._cache[key] = (self._randn(E, d, 2 * f, scale=d ** -0.5, grad=True),
                                self._randn(E, f, d, scale=f ** -0.5, grad=True))
        w_in, w_out = self._cache[key]
        x = self._randn(N, d, grad=True)
        return self._fwd_bwd(lambda: self.kernels.expert_mlp(x, counts, w_in, w_out, self.gemm_kernel),
                             [x, w_in, w_out], backward)

    def wgrad(self, s, counts):
        """The weight-gradient GEMMs of the experts' two projections alone (what their
        backward runs for dW): x^T dh [d, 2f] and a^T dy [f, d] per expert; one grouped GEMM
        each where the expert kernel is grouped (each expert's rows padded as the forward
        pads them on CUDA), else one GEMM per expert."""
        torch, d, f = self.torch, s["hidden_size"], s["expert_ffn_size"]
        align = self.kernels.GROUP_ALIGN_ROWS if self.device.type == "cuda" else 1
        rows = [pad(n, align) for n in counts]
        N = sum(rows)
        x, gh = self._randn(N, d), self._randn(N, 2 * f)
        a, gy = self._randn(N, f), self._randn(N, d)
        if self.gemm_kernel == self.kernels.GROUPED:
            offs = torch.as_tensor([sum(rows[:i + 1]) for i in range(len(rows))], dtype=torch.int32,
                                   device=self.device)

            def run():
                torch._grouped_mm(x.t(), gh, offs=offs)
                torch._grouped_mm(a.t(), gy, offs=offs)
        else:
            bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]

            def run():
                for lo, hi in zip(bounds, bounds[1:]):
                    if hi > lo:
                        x[lo:hi].t() @ gh[lo:hi]
                        a[lo:hi].t() @ gy[lo:hi]
        with torch.no_grad():
            return self._time(run)

    def attention(self, s, length, tokens, backward):
        if self.attention_kernel is None:
            raise MeasurementError("no fused varlen attention kernel runs here")
        h, hkv, dh = s["num_heads"], s["num_kv_heads"], s["head_dim"]
        n = tokens // length
        T = n * length
        q, k, v = (self._randn(T, heads, dh, grad=True) for heads in (h, hkv, hkv))
        cu = self.torch.arange(n + 1, device=self.device, dtype=self.torch.int32) * length
        return self._fwd_bwd(lambda: self.kernels.varlen_attention(q, k, v, cu, length, self.attention_kernel),
                             [q, k, v], backward)

    def projections(self, s, tokens, backward):
        d, hd, kvd = s["hidden_size"], s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
        x = self._randn(tokens, d, grad=True)
        a = self._randn(tokens, hd, grad=True)
        w_qkv = self._randn(hd + 2 * kvd, d, scale=d ** -0.5, grad=True)
        w_o = self._randn(d, hd, scale=hd ** -0.5, grad=True)
        F = self.torch.nn.functional
        # two separate GEMMs, as in a layer; summed so one backward runs both
        return self._fwd_bwd(lambda: F.linear(x, w_qkv).sum(-1, keepdim=True) + F.linear(a, w_o),
                             [x, a, w_qkv, w_o], backward)

    def copy(self, nbytes):
        src = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        return self._time(lambda: dst.copy_(src))

    def tiny_layer(self, s, tokens):
        from routepack.torch.cell import LayerCell
        if self.attention_kernel is None:
            raise MeasurementError("no fused varlen attention kernel runs here")
        cell = LayerCell(s, 1, attention_kernel=self.attention_kernel, expert_kernel=self.gemm_kernel,
                         dtype=self.dtype, device=self.device)
        inputs = cell.inputs([tokens], [tokens])
        with self.torch.no_grad():
            return self._time(lambda: cell.step(inputs, backward=False))


# ---- the calibration ----

def _eff(flops, seconds, peak, what):
    if not seconds > 0:
        raise MeasurementError("%s: the time measured is %r s" % (what, seconds))
    eff = flops / (seconds * peak)
    if eff > 1.0:
        raise MeasurementError("%s: efficiency %.3f exceeds 1: hardware.peak_flops %g is below what this "
                               "device reached" % (what, eff, peak))
    return eff


def _median_ratio(rows, key_min, what):
    """The median backward / forward ratio over the samples at or above key_min (all when
    none is); a negative one (backward faster than nothing) is a measurement error."""
    chosen = [r for x, r in rows if x >= key_min] or [r for _, r in rows]
    ratio = statistics.median(chosen)
    if not ratio >= 0:
        raise MeasurementError("%s backward: (forward+backward) / forward - 1 = %.3g < 0: the timings are "
                               "noise" % (what, ratio))
    return ratio


class Calibration:
    """Runs every measurement of every shape on ``device`` (FakeDevice or TorchDevice)
    within ``budget_s`` seconds; collects the figures, the detail and the failures."""

    def __init__(self, device, profile, budget_s=170.0, log=None):
        self.dev, self.p = device, PROFILES[profile]
        self.deadline = time.monotonic() + budget_s
        self.failures = []
        self.log = log or (lambda msg: None)

    def _measure(self, what, fn):
        if time.monotonic() > self.deadline:
            raise MeasurementError("%s: the time budget ran out before it" % what)
        try:
            return fn()
        except MeasurementError:
            raise
        except Exception as e:  # noqa: BLE001 - named, reported, exit status 1
            raise MeasurementError("%s: %s: %s" % (what, type(e).__name__, str(e).splitlines()[0][:300])) from e

    def shape(self, key, s):
        """(entry for calibration.json or None, detail) of one shape."""
        dev, p = self.dev, self.p
        dev.prepare(s)
        peak = s["peak_flops"]
        out = {k: s[k] for k in SHAPE_FIELDS}
        detail = {"configs": s["configs"]}
        failed = []

        def attempt(name, fn):
            try:
                return fn()
            except MeasurementError as e:
                failed.append("%s %s: %s" % (key, name, e))
                self.failures.append(failed[-1])
                self.log("  FAILED " + failed[-1])
                return None

        # grouped expert GEMM, uniform counts: eff(n) per local expert count
        def gemm():
            per_n, ratios, samples = {}, [], []
            for E in p["gemm_experts"]:
                for n in p["gemm_tokens"]:
                    if n * E > p["max_gemm_rows"]:
                        continue
                    what = "grouped expert GEMM (%d experts x %d tokens)" % (E, n)
                    counts = [n] * E
                    tf = self._measure(what, lambda: dev.experts(s, counts, False))
                    tb = self._measure(what + " backward", lambda: dev.experts(s, counts, True))
                    eff = _eff(E * expert_flops(s, n), tf, peak, what)
                    per_n.setdefault(n, []).append(eff)
                    ratios.append((n, tb / tf - 1))
                    samples.append({"experts": E, "tokens": n, "forward_s": tf, "forward_backward_s": tb,
                                    "efficiency": eff})
            curve = [[n, statistics.median(per_n[n])] for n in sorted(per_n)]
            detail["gemm_uniform"] = samples
            return curve, _median_ratio(ratios, BACKWARD_MIN_TOKENS, "grouped expert GEMM")

        # the grouped GEMM: the tile from probes at n and n + 1 rows, the grouped curve from
        # every uniform sample, the weight gradient alone at small n, the data gradient
        def grouped():
            uniform = [(u["experts"], u["tokens"], u["forward_s"]) for u in detail["gemm_uniform"]]
            E = p["gemm_experts"][len(p["gemm_experts"]) // 2]
            probes, known = [], {(e, n): t for e, n, t in uniform}
            for n0 in p["tile_probes"]:
                for n in (n0, n0 + 1):
                    if (E, n) not in known:
                        what = "grouped expert GEMM, tile probe (%d experts x %d tokens)" % (E, n)
                        known[(E, n)] = self._measure(what, lambda: dev.experts(s, [n] * E, False))
                    probes.append((E, n, known[(E, n)]))
            tile = fit_tile(uniform + [pr for pr in probes if (pr[0], pr[1]) not in
                                       {(e, n) for e, n, _ in uniform}])
            g = {"gemm_tile_rows": tile, "hbm_bytes_per_s": out["hbm_bytes_per_s"],
                 "grouped_gemm_efficiency": fit_grouped_efficiency(s, uniform + probes, tile)}
            wg = []
            for n in p["wgrad_tokens"]:
                what = "weight-gradient GEMMs (%d experts x %d tokens)" % (E, n)
                wg.append((E, n, self._measure(what, lambda: dev.wgrad(s, [n] * E))))
            g["wgrad_efficiency"] = fit_wgrad_efficiency(s, wg, tile)
            g["experts_dgrad"] = fit_dgrad(s, [(u["experts"], u["tokens"], u["forward_s"], u["forward_backward_s"])
                                               for u in detail["gemm_uniform"]], g)
            detail["gemm_grouped"] = {"tile_probes": [{"experts": e, "tokens": n, "forward_s": t}
                                                      for e, n, t in probes],
                                      "wgrad": [{"experts": e, "tokens": n, "seconds": t} for e, n, t in wg]}
            return g

        got = attempt("gemm_efficiency", gemm)
        if got:
            out["gemm_efficiency"], bwd_experts = got
            out["gemm_kernel"] = dev.gemm_kernel
        # attention by length
        def attention():
            if dev.attention_kernel is None or dev.attention_kernel == "math_reference":
                # an unfused kernel's figure would tell the model attention costs several
                # times what the trainer's FlashAttention costs: never written
                raise MeasurementError("no fused varlen attention kernel ran: %s" % "; ".join(dev.kernel_notes))
            curve, ratios, samples = [], [], []
            for L in p["attention_lengths"]:
                tokens = max(p["attention_tokens"], L)
                what = "varlen attention (length %d, %d tokens)" % (L, tokens)
                tf = self._measure(what, lambda: dev.attention(s, L, tokens, False))
                tb = self._measure(what + " backward", lambda: dev.attention(s, L, tokens, True))
                eff = _eff((tokens // L) * attention_flops(s, L), tf, peak, what)
                curve.append([L, eff])
                ratios.append((L, tb / tf - 1))
                samples.append({"length": L, "tokens": tokens, "forward_s": tf, "forward_backward_s": tb,
                                "efficiency": eff})
            detail["attention"] = samples
            return curve, _median_ratio(ratios, BACKWARD_MIN_LENGTH, "attention")

        got = attempt("attention_efficiency", attention)
        if got:
            out["attention_efficiency"], bwd_attention = got
            out["attention_kernel"] = dev.attention_kernel

        def dense():
            T = p["dense_tokens"]
            what = "QKV and output projections (%d tokens)" % T
            tf = self._measure(what, lambda: dev.projections(s, T, False))
            tb = self._measure(what + " backward", lambda: dev.projections(s, T, True))
            return _eff(projection_flops(s, T), tf, peak, what), _median_ratio([(T, tb / tf - 1)], T, what)

        got = attempt("dense_efficiency", dense)
        if got:
            out["dense_efficiency"], bwd_proj = got
        if all(k in out for k in ("gemm_efficiency", "attention_efficiency", "dense_efficiency")):
            out["backward"] = {"attention": bwd_attention, "projections": bwd_proj, "experts": bwd_experts}
        else:
            failed.append("%s backward: needs the attention, projection and expert measurements" % key)

        def hbm():
            t = self._measure("HBM copy", lambda: dev.copy(p["copy_bytes"]))
            if not t > 0:
                raise MeasurementError("HBM copy: the time measured is %r s" % t)
            return 2.0 * p["copy_bytes"] / t

        got = attempt("hbm_bytes_per_s", hbm)
        if got:
            out["hbm_bytes_per_s"] = got
        if "gemm_efficiency" in out and "hbm_bytes_per_s" in out:
            g = attempt("grouped GEMM (gemm_tile_rows, grouped_gemm_efficiency, wgrad_efficiency)", grouped)
            if g:
                for k in ("gemm_tile_rows", "grouped_gemm_efficiency", "wgrad_efficiency"):
                    out[k] = g[k]
                if "backward" in out:
                    out["backward"]["experts_dgrad"] = g["experts_dgrad"]

        def skew():
            """Skewed counts against both expert terms: the grouped GEMM's (what the
            model prices under a grouped executor) and the per-expert sum's (the loop
            form, and the model before the grouped term), forward and forward+backward."""
            E, n = p["gemm_experts"][len(p["gemm_experts"]) // 2], p["skew_tokens"]
            counts = skewed_counts(n * E, E)
            what = "grouped expert GEMM, skewed counts %s" % counts
            tf = self._measure(what, lambda: dev.experts(s, counts, False))
            tb = self._measure(what + " backward", lambda: dev.experts(s, counts, True))
            per_expert = sum(expert_seconds(s, c, out["gemm_efficiency"], out["hbm_bytes_per_s"]) for c in counts if c)
            sk = {"counts": counts, "forward_s": tf, "forward_backward_s": tb,
                  "per_expert_s": per_expert, "per_expert_forward_backward_s":
                  per_expert * (1.0 + out["backward"]["experts"]),
                  "per_expert_measured_over_predicted": tf / per_expert,
                  "per_expert_fb_measured_over_predicted": tb / (per_expert * (1.0 + out["backward"]["experts"]))}
            if "gemm_tile_rows" in out:
                g = dict(out, experts_dgrad=out["backward"]["experts_dgrad"])
                sk.update(grouped_s=grouped_seconds(s, counts, g), grouped_forward_backward_s=grouped_seconds(
                    s, counts, g, True))
                sk.update(grouped_measured_over_predicted=tf / sk["grouped_s"],
                          grouped_fb_measured_over_predicted=tb / sk["grouped_forward_backward_s"])
                # the uniform counts of the same total, measured and priced alike
                uni = [n] * E
                tu = self._measure(what + ", uniform", lambda: dev.experts(s, uni, True))
                sk.update(uniform_forward_backward_s=tu, uniform_grouped_forward_backward_s=grouped_seconds(
                    s, uni, g, True))
                # which form prices this device's samples better (forward+backward, every
                # uniform sample and the skewed one): a kernel that loops over its groups
                # (the CPU's torch._grouped_mm does) fits the per-expert sum, a grouped one
                # the grouped term; execution.expert_gemm says which the config prices
                fb = [(u["experts"], u["tokens"], u["forward_backward_s"]) for u in detail["gemm_uniform"]]
                bx = 1.0 + out["backward"]["experts"]
                err_g = [abs(t / grouped_seconds(s, [n] * E, g, True) - 1) for E, n, t in fb]
                err_p = [abs(t / (E * bx * expert_seconds(s, n, out["gemm_efficiency"], out["hbm_bytes_per_s"])) - 1)
                         for E, n, t in fb]
                err_g.append(abs(sk["grouped_fb_measured_over_predicted"] - 1))
                err_p.append(abs(sk["per_expert_fb_measured_over_predicted"] - 1))
                sk.update(grouped_mape=statistics.mean(err_g), per_expert_mape=statistics.mean(err_p))
                sk["better_form"] = better_form(sk["grouped_mape"], sk["per_expert_mape"])
            detail["gemm_skewed"] = sk

        def fixed():
            T = p["fixed_tokens"]
            t = self._measure("a whole layer's forward at %d tokens" % T, lambda: dev.tiny_layer(s, T))
            predicted = tiny_layer_seconds(s, T, out)
            detail["layer_fixed"] = {"tokens": T, "measured_s": t, "predicted_compute_s": predicted}
            return max(t - predicted, 0.0) * 1e6

        if all(k in out for k in ("gemm_efficiency", "attention_efficiency", "dense_efficiency",
                                  "hbm_bytes_per_s")):
            attempt("gemm_skewed (the skew check)", skew)
            got = attempt("layer_fixed_us", fixed)
            if got is not None:
                out["layer_fixed_us"] = got
        else:
            failed.append("%s layer_fixed_us: needs every other measurement first" % key)
            self.failures.append(failed[-1])
        return (None if failed else out), detail

    def run(self, shapes):
        entries, details = {}, {}
        for key, s in shapes.items():
            self.log("shape %s (peak %g FLOP/s; from %s)" % (key, s["peak_flops"], ", ".join(s["configs"])))
            t0 = time.monotonic()
            entry, detail = self.shape(key, s)
            detail["seconds"] = time.monotonic() - t0
            details[key] = detail
            if entry is not None:
                entry["peak_flops"] = s["peak_flops"]
                entries[key] = entry
                self.log(summary(key, entry))
        return entries, details


def summary(key, e):
    g = e["gemm_efficiency"]
    a = e["attention_efficiency"]
    grouped = ""
    if "gemm_tile_rows" in e:
        grouped = "; grouped GEMM: tile %d rows, eff by total rows %s, wgrad eff %s, data gradient %.2f x forward" % (
            e["gemm_tile_rows"], ", ".join("%d:%.3f" % (n, x) for n, x in e["grouped_gemm_efficiency"][::4]),
            ", ".join("%d:%.3f" % (n, x) for n, x in e["wgrad_efficiency"]), e["backward"]["experts_dgrad"])
    return ("  %s: gemm eff %s (%s); attention eff %s (%s); dense eff %.3f; backward attention %.2f, "
            "projections %.2f, experts %.2f; HBM %.3g B/s; layer fixed %.1f us" % (
                key, ", ".join("%d:%.3f" % (n, x) for n, x in g), e["gemm_kernel"],
                ", ".join("%d:%.3f" % (n, x) for n, x in a), e["attention_kernel"], e["dense_efficiency"],
                e["backward"]["attention"], e["backward"]["projections"], e["backward"]["experts"],
                e["hbm_bytes_per_s"], e["layer_fixed_us"])) + grouped


def _figures(value):
    """Measured figures to 6 significant digits (more than any timing here resolves), so
    a file reads cleanly and the fake device's figures come back exactly."""
    if isinstance(value, float):
        return float("%.6g" % value)
    if isinstance(value, dict):
        return {k: _figures(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_figures(v) for v in value]
    return value


def dumps(doc):
    """calibration.json text: one key a line, each curve on one line."""
    lines = ["{"]
    head = [k for k in doc if k != "shapes"]
    for k in head:
        lines.append(" %s: %s," % (json.dumps(k), json.dumps(doc[k])))
    lines.append(' "shapes": {')
    keys = list(doc["shapes"])
    for i, key in enumerate(keys):
        entry = doc["shapes"][key]
        lines.append("  %s: {" % json.dumps(key))
        fields = ["   %s: %s" % (json.dumps(k), json.dumps(v)) for k, v in entry.items()]
        lines.append(",\n".join(fields))
        lines.append("  }" + ("," if i + 1 < len(keys) else ""))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def document(dev, entries, created=None, comment=None, links=None):
    doc = {"format": FORMAT, "version": VERSION, "device": dev.name, "torch": dev.torch_version,
           "cuda": dev.cuda_version,
           "created": created or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if comment:
        doc["comment"] = comment
    if links:   # routepack.links: the topology's link figures where a config leaves them out
        doc["links"] = _figures(links)
    doc["shapes"] = _figures(entries)
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m routepack.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, help="a config whose model shape to measure")
    ap.add_argument("--out", default="calibration.json")
    ap.add_argument("--detail", help="every sample and the skewed-count check as JSON")
    ap.add_argument("--device", default="cuda",
                    help="torch device (default cuda; cpu: one pinned thread, fp32, least thread CPU time)")
    ap.add_argument("--profile", default="device", choices=sorted(PROFILES))
    ap.add_argument("--budget-s", type=float, default=170.0, help="time for all measurements")
    ap.add_argument("--fake", action="store_true", help="a synthetic device with known figures (tests)")
    ap.add_argument("--created", help="the created field (default: now)")
    ap.add_argument("--comment", help="a comment field: how the file was made (the CPU profile's says)")
    ap.add_argument("--links", type=int, default=0, metavar="N",
                    help="also measure the links between N ranks of this machine (gloo between pinned CPU processes "
                         "with --device cpu, NCCL between N GPUs otherwise): the topology's nvlink_bytes_per_s and "
                         "nvlink_latency_us where a config leaves them out")
    args = ap.parse_args(argv)
    if args.links == 1 or args.links < 0:
        print("calibrate: --links needs at least 2 ranks, got %d" % args.links, file=sys.stderr)
        return 1

    def log(msg):
        print(msg, flush=True)

    try:
        shapes = shapes_from_configs(args.config)
    except (OSError, ValueError) as e:
        print("calibrate: %s" % e, file=sys.stderr)
        return 1
    start = time.monotonic()
    if args.fake:
        dev = FakeDevice(args.profile)
    else:
        try:
            import torch
        except ImportError as e:
            print("calibrate: needs PyTorch (%s); --fake runs without it" % e, file=sys.stderr)
            return 1
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print("calibrate: torch %s sees no CUDA device" % torch.__version__, file=sys.stderr)
            return 1
        dev = TorchDevice(args.device, args.profile)
    log("calibrate: %s, torch %s, CUDA %s; experts: %s; attention: %s" % (
        dev.name, dev.torch_version, dev.cuda_version, dev.gemm_kernel, dev.attention_kernel))
    for note in dev.kernel_notes:
        log("  " + note)
    cal = Calibration(dev, args.profile, args.budget_s - (time.monotonic() - start), log)
    entries, details = cal.run(shapes)
    if args.detail:
        with open(args.detail, "w", encoding="utf-8") as fh:
            json.dump({"device": dev.name, "kernels": dev.kernel_notes, "shapes": details,
                       "failures": cal.failures}, fh, indent=1)
    for key, d in details.items():
        sk = d.get("gemm_skewed")
        if sk:
            log("  %s: skewed counts %s: measured / predicted, forward | forward+backward: per-expert sum "
                "%.3f | %.3f" % (key, sk["counts"], sk["per_expert_measured_over_predicted"],
                                 sk["per_expert_fb_measured_over_predicted"]))
            if "grouped_s" in sk:
                log("  %s: ... grouped GEMM term %.3f | %.3f; skewed / uniform of the same rows, forward+backward: "
                    "measured %.3f, grouped term %.3f" % (
                        key, sk["grouped_measured_over_predicted"], sk["grouped_fb_measured_over_predicted"],
                        sk["forward_backward_s"] / sk["uniform_forward_backward_s"],
                        sk["grouped_forward_backward_s"] / sk["uniform_grouped_forward_backward_s"]))
                log("  %s: forward+backward over every uniform sample and the skewed one, mean |measured / predicted "
                    "- 1|: grouped GEMM term %.3f, per-expert sum %.3f: %s" % (
                        key, sk["grouped_mape"], sk["per_expert_mape"],
                        "the two forms price this device alike (within a tenth of each other): the timings cannot "
                        "tell how its kernel runs" if sk["better_form"] == "tie" else
                        "this device's kernel prices best as execution.expert_gemm \"%s\"" % sk["better_form"]))
    if cal.failures:
        for f in cal.failures:
            print("calibrate: not measured: %s" % f, file=sys.stderr)
        print("calibrate: %s not written (%d values could not be measured)" % (args.out, len(cal.failures)),
              file=sys.stderr)
        return 1
    links = None
    if args.links:
        from routepack import links as links_mod
        backend = "gloo" if args.fake or not args.device.startswith("cuda") else "nccl"
        try:
            links = links_mod.measure_spawned(args.links, backend)
        except (ValueError, RuntimeError, OSError) as e:
            print("calibrate: the links could not be measured: %s; %s not written" % (e, args.out), file=sys.stderr)
            return 1
        log("calibrate: links over %d %s ranks: %.3g B/s, latency %.0f us" % (
            links["ranks"], backend, links["bytes_per_s"], links["latency_us"]))
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(dumps(document(dev, entries, "1970-01-01T00:00:00Z" if args.fake and not args.created
                                else args.created, args.comment, links)))
    os.replace(tmp, args.out)
    log("calibrate: wrote %s (%d shapes) in %.1f s" % (args.out, len(entries), time.monotonic() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
