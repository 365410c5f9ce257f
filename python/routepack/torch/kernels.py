"""The compute kernels of one MoE transformer layer, chosen once per device and named, so
the calibration (routepack.calibrate), the fidelity check (routepack.fidelity) and
MoELayer run the same ones and a measurement can say which kernel it measured.

Experts: ``expert_mlp(rows, counts, w_in, w_out)`` runs every local expert on its rows in
one grouped GEMM per projection (``torch._grouped_mm``, what Megatron's GroupedMLP and
torchtitan use) or, where that is missing or fails its check, one GEMM per expert
(``per_expert_loop``). A SwiGLU expert has ``w_in`` twice as wide as ``w_out`` is tall
(gate and up fused); otherwise the activation is plain SiLU.

Attention: ``varlen_attention(q, k, v, cu_seqlens, max_len, kernel)``, causal, packed
(THD: tokens of all sequences concatenated) with fewer KV heads allowed (GQA). Fused
kernels only: ``flash_attn_varlen`` (the flash-attn package), ``torch_varlen``
(torch.nn.attention.varlen), ``sdpa_flash`` (SDPA restricted to its flash backend,
sequences of one length batched together). ``math_reference`` is the unfused reference,
for checking the others; the calibration refuses to report it."""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

GROUPED = "torch._grouped_mm"
LOOP = "per_expert_loop"
FUSED_ATTENTION = ("flash_attn_varlen", "torch_varlen", "sdpa_flash")
UNFUSED_ATTENTION = "math_reference"
# torch._grouped_mm reads each group's rows with 16-byte aligned TMA loads, also in the
# transposed operand of the weight gradient: groups start at multiples of 8 bf16 rows
# (torchtitan pads to 8 for bf16 too). We pad to 16 to cover fp32 accumulators.
GROUP_ALIGN_ROWS = 16


def _activation(h, gated):
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.silu(h)


def _is_gated(w_in, w_out):
    if w_in.shape[-1] == w_out.shape[-2]:
        return False
    if w_in.shape[-1] == 2 * w_out.shape[-2]:
        return True
    raise ValueError("w_in [.., %d, %d] and w_out [.., %d, %d] fit neither a plain (equal widths) nor "
                     "a SwiGLU (w_in twice as wide) expert" % (*w_in.shape[-2:], *w_out.shape[-2:]))


def _loop(rows, counts, w_in, w_out, gated):
    """One GEMM per expert with rows. The weights are split with unbind (one backward node
    that stacks the experts' gradients: linear in the experts, where indexing w_in[j]
    gives each expert a full-size zero gradient)."""
    outs = []
    w_ins, w_outs = w_in.unbind(0), w_out.unbind(0)
    for j, chunk in enumerate(torch.split(rows, list(counts))):
        if chunk.shape[0] or (j == len(counts) - 1 and not outs):
            # without rows, the last expert still runs on none: the output stays in the
            # graph of ``rows``, so a backward runs the same collectives on every rank
            outs.append(_activation(chunk @ w_ins[j], gated) @ w_outs[j])
    return torch.cat(outs) if outs else rows.new_zeros((0, w_out.shape[-1]))


def _grouped(rows, counts, w_in, w_out, gated):
    """Two grouped GEMMs. ``counts`` are host integers (the caller's): the group offsets
    are computed on the host and copied down, nothing is read back. On CUDA each group is
    padded to GROUP_ALIGN_ROWS (zero rows, dropped afterwards: they cost what they cost in
    Megatron and torchtitan too); the CPU kernel needs no alignment."""
    counts = np.asarray(list(counts), dtype=np.int64)
    if rows.device.type != "cuda":
        offs = torch.as_tensor(np.cumsum(counts), dtype=torch.int32)
        h = torch._grouped_mm(rows, w_in, offs=offs)
        return torch._grouped_mm(_activation(h, gated), w_out, offs=offs)
    padded = (counts + GROUP_ALIGN_ROWS - 1) // GROUP_ALIGN_ROWS * GROUP_ALIGN_ROWS
    starts = np.cumsum(padded) - padded
    src_start = np.cumsum(counts) - counts
    shift = torch.as_tensor(starts - src_start).to(rows.device, non_blocking=True)
    group_of = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                       torch.as_tensor(counts).to(rows.device, non_blocking=True),
                                       output_size=rows.shape[0])
    dest = torch.arange(rows.shape[0], device=rows.device) + shift[group_of]
    x = rows.new_zeros((int(padded.sum()), rows.shape[1])).index_copy(0, dest, rows)
    offs = torch.as_tensor(np.cumsum(padded), dtype=torch.int32).to(rows.device, non_blocking=True)
    h = torch._grouped_mm(x, w_in, offs=offs)
    y = torch._grouped_mm(_activation(h, gated), w_out, offs=offs)
    return y.index_select(0, dest)


def expert_mlp(rows, counts, w_in, w_out, kernel=GROUPED):
    """``rows`` [N, d] grouped by local expert, ``counts`` (host ints, sum N) rows of each of the
    E experts, ``w_in`` [E, d, f or 2f], ``w_out`` [E, f, d] -> [N, d]. ``kernel``:
    GROUPED or LOOP (same result up to rounding). Differentiable."""
    gated = _is_gated(w_in, w_out)
    if kernel == GROUPED and rows.shape[0] > 0:   # no rows: the loop keeps the graph
        return _grouped(rows, counts, w_in, w_out, gated)
    if kernel in (GROUPED, LOOP):
        return _loop(rows, counts, w_in, w_out, gated)
    raise ValueError("unknown expert kernel %r (known: %s, %s)" % (kernel, GROUPED, LOOP))


def _close(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item() + 1e-6
    if not err <= 0.05 * scale:
        raise RuntimeError("%s differs from the reference by %.3g (scale %.3g)" % (what, err, scale))


_CHOSEN = {}   # (device, dtype, hidden, ffn, gated) -> (kernel, why): checked once per process


def choose_expert_kernel(device, dtype, hidden=64, ffn=32, gated=True):
    """(kernel, why): GROUPED when torch has _grouped_mm and it gives the per-expert loop's
    output and gradients on this device and dtype for experts of this shape (``hidden``,
    ``ffn``, SwiGLU when ``gated``: the kernel may refuse row strides that are not a
    multiple of 16 bytes) with skewed counts and an empty group, else LOOP with the
    reason. Checked once per device, dtype and shape in a process."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype, int(hidden), int(ffn), bool(gated))
    if key not in _CHOSEN:
        _CHOSEN[key] = _check_grouped(device, dtype, int(hidden), int(ffn), bool(gated))
    return _CHOSEN[key]


def _check_grouped(device, dtype, d, f, gated):
    if not hasattr(torch, "_grouped_mm"):
        return LOOP, "torch %s has no torch._grouped_mm" % torch.__version__
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        counts = [5, 0, 37, 16]
        x = (torch.randn(sum(counts), d, generator=g) * 0.5).to(device, dtype)
        w_in = (torch.randn(len(counts), d, 2 * f if gated else f, generator=g) * 0.1).to(device, dtype)
        w_out = (torch.randn(len(counts), f, d, generator=g) * 0.1).to(device, dtype)
        outs = []
        for kern in (GROUPED, LOOP):
            leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
            y = expert_mlp(leaves[0], counts, leaves[1], leaves[2], kern)
            y.float().square().sum().backward()
            outs.append([y] + [t.grad for t in leaves])
        for name, a, b in zip(("output", "input grad", "w_in grad", "w_out grad"), *outs):
            _close(a, b, "torch._grouped_mm " + name)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here
        return LOOP, "torch._grouped_mm failed its check on %s: %s" % (device, str(e).splitlines()[0][:200])
    return GROUPED, "torch._grouped_mm matches the per-expert loop"


# ---- attention ----

def _expand_kv(k, heads):
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _math_reference(q, k, v, cu, max_len):
    outs = []
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        scores = (qs.float() @ ks.float().transpose(1, 2)) / (q.shape[-1] ** 0.5)
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append((p @ vs.float()).to(q.dtype).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def _sdpa_flash(q, k, v, cu, max_len):
    """Sequences of equal length batched [B, h, L, d] through SDPA's flash backend only
    (an error, never the math backend, where flash cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lens = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    out = torch.empty_like(q)
    by_len = {}
    for s, n in zip(starts, lens):
        by_len.setdefault(n, []).append(s)
    # KV heads repeated for GQA: SDPA's flash backend refuses enable_gqa in some torch
    # versions, and the flash kernel then does the same FLOPs
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        for n, ss in by_len.items():
            if n == 0:
                continue
            idx = (torch.as_tensor(ss, device=q.device).unsqueeze(1)
                   + torch.arange(n, device=q.device)).reshape(-1)
            qb, kb, vb = (t.index_select(0, idx).view(len(ss), n, t.shape[1], t.shape[2]).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            out = out.index_copy(0, idx, o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]))
    return out


def _torch_varlen(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    cu = cu.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _flash_attn_varlen(q, k, v, cu, max_len):
    from flash_attn import flash_attn_varlen_func
    cu = cu.to(torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)


_ATTENTION = {"flash_attn_varlen": _flash_attn_varlen, "torch_varlen": _torch_varlen,
              "sdpa_flash": _sdpa_flash, UNFUSED_ATTENTION: _math_reference}


def varlen_attention(q, k, v, cu_seqlens, max_len, kernel):
    """Causal attention of packed sequences: ``q`` [T, h, dh], ``k``/``v`` [T, h_kv, dh]
    (h a multiple of h_kv), ``cu_seqlens`` [n + 1] int (on q's device), ``max_len`` the
    longest sequence -> [T, h, dh]. Differentiable."""
    try:
        fn = _ATTENTION[kernel]
    except KeyError:
        raise ValueError("unknown attention kernel %r (known: %s)" % (kernel, ", ".join(_ATTENTION))) from None
    return fn(q, k, v, cu_seqlens, int(max_len))


def choose_attention_kernel(device, dtype, allow_unfused=False):
    """(kernel, notes): the first fused kernel, in the order of FUSED_ATTENTION, that runs
    on this device and dtype and matches the math reference forward and backward (two
    sequences of different lengths, GQA); notes say why each earlier one was passed
    over. None when none does (math_reference instead when ``allow_unfused``: tests)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    h, hkv, dh, lens = 4, 2, 64, [48, 80]
    cu = torch.tensor([0, 48, 128], dtype=torch.int32, device=device)
    base = [(torch.randn(128, n, dh, generator=g) * 0.5).to(device, dtype) for n in (h, hkv, hkv)]
    ref_leaves = [t.clone().float().requires_grad_() for t in base]
    ref = _math_reference(*ref_leaves, cu, max(lens))
    ref.square().sum().backward()
    notes = []
    for kern in FUSED_ATTENTION:
        try:
            leaves = [t.clone().requires_grad_() for t in base]
            out = varlen_attention(*leaves, cu, max(lens), kern)
            out.float().square().sum().backward()
            _close(out, ref, kern + " output")
            for name, a, b in zip(("dq", "dk", "dv"), leaves, ref_leaves):
                _close(a.grad, b.grad, kern + " " + name)
            return kern, notes
        except Exception as e:  # noqa: BLE001 - try the next kernel
            notes.append("%s: %s" % (kern, str(e).splitlines()[0][:200] if str(e) else type(e).__name__))
    if allow_unfused:
        return UNFUSED_ATTENTION, notes
    return None, notes
