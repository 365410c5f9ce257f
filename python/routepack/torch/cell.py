"""One (microbatch, GPU) cell of a step at one layer, run on one device: the cell's
sequences through attention (RMSNorm, QKV projection, causal varlen attention, output
projection, residual) and the rows its experts receive through routepack.torch.MoELayer
(RMSNorm, router, dispatch, the grouped expert GEMMs, combine, residual), forward and
backward. The calibration times it at a few tokens for the fixed per-layer cost; the
fidelity check times it per cell of a plan. Communication is not part of it: the MoE
layer runs on a process group of one rank, so its all-to-alls are local copies.

    group = single_rank_group(device)
    cell = LayerCell(shape, num_local=16, attention_kernel=..., expert_kernel=..., device=device)
    inputs = cell.inputs(lengths=[4096, 1024], expert_counts=[300, 0, 812, ...])
    seconds = median_seconds(lambda: cell.step(inputs), device)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import kernels
from .moe import ExpertPlacement, MoELayer


def single_rank_group(device):
    """Initialise torch.distributed as a world of one rank (NCCL on CUDA, gloo on CPU,
    a file rendezvous: no network) unless it is initialised already; returns None (the
    world group)."""
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="rp-cell-")
        os.close(fd)
        os.unlink(path)
        dev = torch.device(device)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":   # NCCL binds its communicator to the current device
            torch.cuda.set_device(dev.index if dev.index is not None else torch.cuda.current_device())
        dist.init_process_group(backend, init_method="file://" + path, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("LayerCell runs on one rank; torch.distributed has %d" % dist.get_world_size())
    return None


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, warmup=2, reps=7):
    """Median wall time of fn() in seconds: CUDA events around each call on a GPU, the
    host clock after a synchronise on a CPU; ``warmup`` untimed calls first."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _RMSNorm(nn.Module):
    """nn.RMSNorm for a torch that predates it (2.4)."""

    def __init__(self, d, eps=1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, dtype=dtype, device=device))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


RMSNorm = getattr(nn, "RMSNorm", _RMSNorm)


class LayerCell(nn.Module):
    """One layer of one GPU for one microbatch. ``shape``: dict with hidden_size,
    expert_ffn_size, num_heads, num_kv_heads, head_dim (a config's model section);
    ``num_local``: the experts (slots and extra replicas) the GPU holds at the layer.
    SwiGLU experts (as the cost model's 6 n d f FLOPs assume)."""

    def __init__(self, shape, num_local, *, attention_kernel, expert_kernel, dtype=torch.bfloat16,
                 device="cpu", seed=0):
        super().__init__()
        d, f = int(shape["hidden_size"]), int(shape["expert_ffn_size"])
        h, hkv, dh = int(shape["num_heads"]), int(shape["num_kv_heads"]), int(shape["head_dim"])
        self.d, self.h, self.hkv, self.dh = d, h, hkv, dh
        self.num_local = max(int(num_local), 1)
        self.attention_kernel = attention_kernel
        self.device, self.dtype = torch.device(device), dtype
        kw = dict(dtype=dtype, device=device)
        self.norm1 = RMSNorm(d, **kw)
        self.qkv = nn.Linear(d, (h + 2 * hkv) * dh, bias=False, **kw)
        self.proj = nn.Linear(h * dh, d, bias=False, **kw)
        self.norm2 = RMSNorm(d, **kw)
        group = single_rank_group(device)
        self.moe = MoELayer(d, f, self.num_local, 1, self.num_local, ep_group=group, gated=True,
                            expert_kernel=expert_kernel, **kw)
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for w in (self.qkv.weight, self.proj.weight, self.moe.router.weight):
                w.copy_(torch.randn(w.shape, generator=g) * w.shape[-1] ** -0.5)
            self.moe.w_in.copy_(torch.randn(self.moe.w_in.shape, generator=g) * d ** -0.5)
            self.moe.w_out.copy_(torch.randn(self.moe.w_out.shape, generator=g) * f ** -0.5)
        self.moe.fetch_replicas(ExpertPlacement(np.arange(self.num_local), np.array([0, self.num_local]),
                                                [np.zeros((0, 2), np.int64)]))
        self._gen = g

    def inputs(self, lengths, expert_counts):
        """The cell's tensors: its sequences' hidden states [sum lengths, d] with their
        cu_seqlens, and the rows its experts receive (expert_counts[j] rows for local
        expert j, routed there with top-1 replay) with their output gradients."""
        lengths = [int(n) for n in lengths if int(n) > 0]
        counts = [int(c) for c in expert_counts] + [0] * (self.num_local - len(expert_counts))
        if len(counts) > self.num_local:
            raise ValueError("%d expert counts for a cell with %d local experts" % (len(counts), self.num_local))
        T, N = sum(lengths), sum(counts)
        g, kw = self._gen, dict(dtype=self.dtype, device=self.device)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]) if lengths else [0],
                          dtype=torch.int32, device=self.device)
        routing = torch.repeat_interleave(torch.arange(self.num_local), torch.tensor(counts, dtype=torch.int64))
        return dict(x=torch.randn(T, self.d, generator=g).to(**kw).requires_grad_(),
                    gy=torch.randn(T, self.d, generator=g).to(**kw),
                    cu=cu, max_len=max(lengths, default=0),
                    rows=torch.randn(N, self.d, generator=g).to(**kw).requires_grad_(),
                    gz=torch.randn(N, self.d, generator=g).to(**kw),
                    routing=routing.view(-1, 1).to(self.device))

    def attention_block(self, x, cu, max_len):
        T = x.shape[0]
        if T == 0:
            return x
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], dim=-1)
        a = kernels.varlen_attention(q.view(T, self.h, self.dh), k.view(T, self.hkv, self.dh),
                                     v.view(T, self.hkv, self.dh), cu, max_len, self.attention_kernel)
        return x + self.proj(a.reshape(T, self.h * self.dh))

    def moe_block(self, rows, routing):
        return rows + self.moe(self.norm2(rows), routing)

    def forward(self, x, cu, max_len, rows, routing):
        return self.attention_block(x, cu, max_len), self.moe_block(rows, routing)

    def step(self, inputs, backward=True):
        """Forward (and backward, with the inputs' output gradients) of the cell."""
        y, z = self(inputs["x"], inputs["cu"], inputs["max_len"], inputs["rows"], inputs["routing"])
        if backward:
            outs = [(o, g) for o, g in ((y, inputs["gy"]), (z, inputs["gz"])) if o.shape[0] and o.requires_grad]
            if outs:
                torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
            for p in self.parameters():
                p.grad = None
            for t in (inputs["x"], inputs["rows"]):
                t.grad = None
        return y, z
