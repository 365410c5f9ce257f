#!/usr/bin/env python3
"""MoELayer measured on CPU ranks (gloo, one thread each): figures, never assertions.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/torch/bench_moe.py plain [--reps 9]
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/torch/bench_moe.py plans [--reps 9]

``plain``: MoELayer with no levers (every expert once, contiguous) against a plain
expert-parallel layer written as Megatron's alltoall dispatcher is (destination = expert //
experts per rank, one row per token-choice, the same expert kernel), forward + backward of
the same tokens, the variants interleaved (their order rotates every repetition).

``plans``: the same skewed batch (rank 0's experts 3x hotter) under three plans the
scheduler makes with a config whose hardware is this CPU (GEMM FLOP/s and gloo bandwidth
measured first), written by a small policy so that all three share one packing:
contiguous, replicas and shares only (ranks 1.. hold rank 0's first experts in their spare
slots, half the tokens each) and with extra replicas (rank 0's first experts get an extra
replica on every other rank: half their tokens stay, the other half split evenly). Each
plan's step runs as a trainer runs it: fetch_replicas (extra replicas fetched), every
microbatch's forward and
backward with the plan's physical ids, reduce_replica_grads. Printed: each plan's
predicted step time (the scheduler's cost model under the layer's dispatch_dedup; also with
communication free) and measured time, their ratios to the contiguous plan, each rank's
thread CPU time, issue 29's clause per measure (clause_check), and the replica-gradient
bytes per rank against the formula.

``five``: issue 30's five plans of one skewed batch (8 experts, experts 0-2 8x hotter,
lengths varied, 4 microbatches: chosen from the predictions alone so that the five are
different plans predicted at least 4.5% apart), each from its policy: contiguous
(token_kk+contiguous), EPLB (token_kk+eplb), the balancer stand-in (token_kk+contiguous's
plan with VirtualExpertBalancer's virtual experts every forward, planned before the timed
step with their placement tables, as Megatron's balancer does on the device),
routepack without extra replicas
(max_extra_per_rank 0) and routepack; PREDICTED under execution.executor routepack_torch
(the balancer's under megatron_balancer: routepack_torch cannot run it) with this CPU's
figures (--calibration examples/cpu/calibration-cpu.json: its expert curve, backward ratio
and peak; gloo measured here), twice: the whole step, and the same plan re-priced with
communication free (`routepack plan eval`; the CLI from ROUTEPACK_CLI or PATH), which is
what a rank's compute measures: its thread CPU time outside torch.distributed's calls
(CommClock: gloo writes sends and packs all_to_alls on the calling thread, which is the
transfer's cost, not compute); MEASURED as ``plans`` does, plus that compute; the
predicted and measured orders (the least of each plan's repetitions) of compute and of
wall time, with their Kendall tau and the test-retest tau of odd against even
repetitions. Every plan's placement tables are made before its timed step
(MoELayer.prepare).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/torch/bench_moe.py five \
        --calibration examples/cpu/calibration-cpu.json [--reps 15] [--comm]

With ``--comm`` every all_to_all_single and batch_isend_irecv one step of each plan made is
recorded (torch.distributed's functions wrapped for one call) and replayed alone, barriers
around, the least wall time of the slowest rank over --reps summed by kind: MEASURED
dispatch + combine and point-to-point time (extra-replica fetches, replica gradients)
beside the model's dispatch_s + combine_s and grad_reduce_s + extra_copy_s, PREDICTED.

Every layer's experts are SwiGLU (w_in [d, 2 f], gate then up), the experts the cost model
prices (6 d f FLOP a token) and routepack.calibrate times.

Times per repetition are the slowest rank's: wall (perf_counter) and the rank's thread CPU
time (time.thread_time: what a rank computes, not what it waits for; with more ranks than
cores the wall clock measures the scheduler of the machine). Medians, min-max over the
repetitions. Each rank is pinned to core rank % cores."""

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import routepack
import routepack.links
from routepack import cpu, fidelity
from routepack.torch import ExpertPlacement, MoELayer, all_to_all, kernels


class PlainEP(nn.Module):
    """Expert parallelism without levers: expert e on rank e // n_local, one row per
    token-choice there and back (Megatron's MoEAlltoAllTokenDispatcher), the experts in
    the same kernel as MoELayer's."""

    def __init__(self, d, f, E, k, kernel, group=None):
        super().__init__()
        self.W = dist.get_world_size(group)
        self.n_local, self.k, self.kernel, self.group = E // self.W, k, kernel, group
        self.router = nn.Linear(d, E, bias=False)
        self.w_in = nn.Parameter(torch.empty(self.n_local, d, 2 * f))   # SwiGLU: gate, then up
        self.w_out = nn.Parameter(torch.empty(self.n_local, f, d))

    def forward(self, x, routing):
        T, k = x.shape[0], self.k
        probs = torch.softmax(self.router(x).float(), -1)
        gates = probs.gather(1, routing)
        gates = gates / gates.sum(-1, keepdim=True)
        key = routing.reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(self.W * self.n_local, dtype=torch.int64).index_add_(0, key, torch.ones_like(key))
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        host = torch.stack([counts, recv]).numpy()
        sent_c, recv_c = host[0].reshape(self.W, -1), host[1].reshape(self.W, -1)
        rows = all_to_all(x[order // k], recv_c.sum(1), sent_c.sum(1), self.group)
        expert_of_row = torch.arange(self.n_local).repeat(self.W).repeat_interleave(
            torch.as_tensor(recv_c.reshape(-1)), output_size=rows.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = kernels.expert_mlp(rows[by_expert], recv_c.sum(0).tolist(), self.w_in, self.w_out, self.kernel)
        back = torch.empty_like(y).index_copy(0, by_expert, y)
        returned = all_to_all(back, sent_c.sum(1), recv_c.sum(1), self.group)
        out = torch.empty_like(returned).index_copy(0, order, returned).view(T, k, -1)
        return (out * gates.to(out.dtype).unsqueeze(-1)).sum(1)


def slowest(values):
    """The largest of each value over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class CommClock:
    """While installed, the thread CPU time the calling thread spends inside
    torch.distributed's collective and point-to-point calls: its share of the transfers
    (gloo writes a send's bytes, and packs an all_to_all's, on the calling thread), which a
    rank's thread CPU time holds beside the compute that the model prices with
    communication free. The layer calls these through the module (dist.NAME at call
    time), so wrapping the module's functions sees every call."""
    CALLS = ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_reduce")

    def __enter__(self):
        self.seconds = 0.0
        self.real = {name: getattr(dist, name) for name in self.CALLS}
        for name, fn in self.real.items():
            setattr(dist, name, self._clocked(fn))
        return self

    def _clocked(self, fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0
        return call

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)


def timed(fn):
    """The slowest rank's wall time, thread CPU time (the rank's own thread: its compute
    and its share of the transfers) and process CPU time (every thread of the rank: gloo's,
    which copy the bytes a transfer moves, included); then this rank's own thread CPU time;
    then the slowest rank's compute: its thread CPU time outside communication calls
    (CommClock); then this rank's own compute."""
    dist.barrier()
    with CommClock() as comm:
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        fn()
        c1, p1 = time.thread_time(), time.process_time()
    dist.barrier()
    wall, thread, proc, compute = slowest([time.perf_counter() - w0, c1 - c0, p1 - p0, c1 - c0 - comm.seconds])
    return [wall, thread, proc, c1 - c0, compute, c1 - c0 - comm.seconds]


def summary(xs):
    return "%.2f (%.2f-%.2f)" % (statistics.median(xs), min(xs), max(xs))


def skewed_routing(rng, T, E, k, hot, factor):
    p = np.ones(E)
    p[hot] = factor
    p /= p.sum()
    g = np.log(p)[None, :] + rng.gumbel(size=(T, E))
    return np.argsort(-g, axis=1)[:, :k]


def part_plain(args, rank, world):
    d, f, E, k, T = args.hidden, args.ffn, args.experts, args.top_k, args.tokens
    kern, why = kernels.choose_expert_kernel("cpu", torch.float32, d, f, True)
    g = torch.Generator().manual_seed(0)
    w_in, w_out = torch.randn(E, d, 2 * f, generator=g) * d ** -0.5, torch.randn(E, f, d, generator=g) * f ** -0.5
    router = torch.randn(E, d, generator=g) * d ** -0.5
    n_local = E // world
    placement = ExpertPlacement(np.arange(E), np.arange(world + 1) * n_local, [np.zeros((0, 2), np.int64)])
    plain = PlainEP(d, f, E, k, kern)
    layers = {"plain": plain}
    for mode in ("choice", "gpu"):
        layer = MoELayer(d, f, E, k, n_local, gated=True, dispatch_dedup=mode, expert_kernel=kern)
        layer.load_experts(w_in, w_out, placement)
        layer.fetch_replicas(placement)
        layers["moe_" + mode] = layer
    with torch.no_grad():
        plain.w_in.copy_(w_in[rank * n_local:(rank + 1) * n_local])
        plain.w_out.copy_(w_out[rank * n_local:(rank + 1) * n_local])
        for layer in layers.values():
            layer.router.weight.copy_(router)
    rng = np.random.default_rng(rank)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(rank + 1))
    routing = torch.as_tensor(skewed_routing(rng, T, E, k, np.arange(E), 1.0))
    cot = torch.randn(T, d)

    def run(layer):
        def go():
            xi = x.clone().requires_grad_()
            y = layer(xi, routing)
            y.backward(cot)
            if isinstance(layer, MoELayer):
                layer.reduce_replica_grads()
        return go
    names = list(layers)
    times = {n: [] for n in names}
    for rep in range(args.warmup + args.reps):
        for j in range(len(names)):
            n = names[(rep + j) % len(names)]
            t = timed(run(layers[n]))
            if rep >= args.warmup:
                times[n].append(t)
    if rank == 0:
        print("plain: %d ranks, %d tokens a rank, d %d, f %d, %d experts, top-%d; expert kernel %s (%s); "
              "%d reps after %d warm-up, interleaved" % (world, T, d, f, E, k, kern, why, args.reps, args.warmup))
        for n in names:
            print("  %-10s wall %s ms   thread CPU %s ms" % (
                n, summary([t[0] * 1e3 for t in times[n]]), summary([t[1] * 1e3 for t in times[n]])))
        for n in names[1:]:
            print("  %s / plain: wall %s   thread CPU %s" % (
                n, summary([a[0] / b[0] for a, b in zip(times[n], times["plain"])]),
                summary([a[1] / b[1] for a, b in zip(times[n], times["plain"])])))


def calibrated(path, d, f, world):
    """The cost model's hardware figures a calibration file gives for experts of d x f:
    peak, expert efficiency curve, memory bandwidth, the experts' backward ratio and,
    where the file has them, the grouped GEMM's figures (docs/cost-model.md, "Experts")
    and, where it measured them between ``world`` ranks, the links (its "links":
    nvlink_bytes_per_s, nvlink_latency_us)."""
    with open(path) as fh:
        cal = json.load(fh)
    entry = next(iter(cal["shapes"].values()))
    if (entry["hidden_size"], entry["expert_ffn_size"]) != (d, f):
        raise SystemExit("--calibration is for d %d, f %d; the bench runs d %d, f %d" % (
            entry["hidden_size"], entry["expert_ffn_size"], d, f))
    hw = {"peak_flops": entry["peak_flops"], "gemm_efficiency": entry["gemm_efficiency"],
          "hbm_bytes_per_s": entry["hbm_bytes_per_s"], "backward": {"experts": entry["backward"]["experts"]}}
    for key in ("gemm_tile_rows", "grouped_gemm_efficiency", "wgrad_efficiency"):
        if key in entry:
            hw[key] = entry[key]
    if "experts_dgrad" in entry["backward"]:
        hw["backward"]["experts_dgrad"] = entry["backward"]["experts_dgrad"]
    if cal.get("links", {}).get("ranks") == world:   # routepack.calibrate --links: gloo here
        hw.update(nvlink_bytes_per_s=cal["links"]["bytes_per_s"], nvlink_latency_us=cal["links"]["latency_us"])
    return hw


def cpu_hardware(args, world):
    """Hardware constants of this CPU for the cost model: one thread's GEMM FLOP/s at
    the experts' shape, gloo's bandwidth and latency between the ranks (routepack.links,
    measured now); with --calibration, that file's peak, expert efficiency curve, memory
    bandwidth and experts' backward ratio instead of the measured peak and a flat curve,
    and its links where it measured them over as many ranks (steadier than one
    measurement now, which is printed beside them)."""
    d, f = args.hidden, args.ffn
    a, b = torch.randn(512, d), torch.randn(d, f)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.thread_time()
    while time.thread_time() - t0 < 0.2:
        a @ b
        n += 1
    flops = 2.0 * 512 * d * f * n / (time.thread_time() - t0)
    flops = -slowest([-flops])[0]   # the slowest rank's
    got = routepack.links.measure()   # gloo between the ranks, now (collective)
    hw = {"peak_flops": flops, "gemm_efficiency": [[1, 1.0], [1 << 20, 1.0]], "dense_efficiency": 1.0,
          "hbm_bytes_per_s": 20e9, "nvlink_bytes_per_s": got["bytes_per_s"], "nvlink_latency_us": got["latency_us"]}
    if args.calibration:
        hw.update(calibrated(args.calibration, d, f, world))
        if dist.get_rank() == 0 and hw["nvlink_bytes_per_s"] != got["bytes_per_s"]:
            print("links: the calibration's %.0f MB/s, latency %.0f us (measured now: %.0f MB/s, %.0f us)" % (
                hw["nvlink_bytes_per_s"] / 1e6, hw["nvlink_latency_us"], got["bytes_per_s"] / 1e6,
                got["latency_us"]))
    return hw


# The three plans, written by hand so that they share one packing (sequence s on rank
# s % W, microbatch (s // W) % M) and differ only in the expert side; the scheduler
# validates each and prices it with the config's cost model.
PLANS_POLICY = """
return {
  name = "bench_levers", version = "1.0.0", api = 1,
  description = "one packing; contiguous, replicas with shares, or extra replicas with shares",
  params = {mode = {type = "string", default = "contiguous", values = {"contiguous", "replicas", "extras"},
                    doc = "the expert side"},
            extra_experts = {type = "integer", default = 1, min = 1, max = 1024,
                             doc = "extras: rank 0's experts 0 .. this - 1 get an extra replica on every other rank"}},
  plan = function(ctx)
    local W = ctx.topology.ep_size
    local E, L = ctx.model.num_experts, ctx.model.num_layers
    local n = math.floor(E / W)
    local M = %d
    local packing = {}
    for g = 1, W do packing[g] = {} for m = 1, M do packing[g][m] = {} end end
    for s = 0, ctx.batch.num_seqs - 1 do
      local g, m = s %% W, math.floor(s / W) %% M
      table.insert(packing[g + 1][m + 1], s)
    end
    local placement, extras, shares = {}, {}, {}
    for l = 0, L - 1 do
      local layer = {}
      for j = 0, W - 1 do
        local slots = {}
        for i = 0, n - 1 do slots[#slots + 1] = j * n + i end
        -- replicas: EP rank j >= 1 holds rank 0's expert j - 1 in its spare slot
        slots[#slots + 1] = (ctx.params.mode == "replicas" and j >= 1) and (j - 1) or -1
        layer[j + 1] = slots
      end
      placement[l + 1] = layer
      for m = 0, M - 1 do
        if ctx.params.mode == "replicas" then
          for j = 1, W - 1 do
            shares[#shares + 1] = {microbatch = m, layer = l, expert = j - 1, shares = {0.5, 0.5}}
          end
        elseif ctx.params.mode == "extras" then
          -- rank 0's first experts each get an extra replica on every other rank: half
          -- their tokens stay on rank 0, the other half split evenly over the extras
          -- (with 2 ranks: one extra, half and half)
          for e = 0, math.min(ctx.params.extra_experts, n) - 1 do
            local sh = {0.5}
            for j = 1, W - 1 do
              extras[#extras + 1] = {microbatch = m, layer = l, expert = e, ep_rank = j}
              sh[#sh + 1] = 0.5 / (W - 1)
            end
            shares[#shares + 1] = {microbatch = m, layer = l, expert = e, shares = sh}
          end
        end
      end
    end
    return {packing = packing, placement = placement, extra_replicas = extras, shares = shares,
            num_microbatches = M}
  end,
}
"""


def part_plans(args, rank, world):
    d, f, E, k, T = args.hidden, args.ffn, args.experts, args.top_k, args.tokens
    kern, why = kernels.choose_expert_kernel("cpu", torch.float32, d, f, True)
    hw = cpu_hardware(args, world)
    M, seqs = args.microbatches, args.seqs
    links = {"nvlink_bytes_per_s": hw.pop("nvlink_bytes_per_s"), "nvlink_latency_us": hw.pop("nvlink_latency_us")}
    cfg = {"topology": dict({"num_nodes": 1, "gpus_per_node": world, "ep_size": world,
                             "slots_per_gpu": E // world + 1}, **links),
           "model": {"num_layers": 1, "num_experts": E, "top_k": k, "hidden_size": d, "expert_ffn_size": f,
                     "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "dense_params": 0,
                     "bytes_per_param": 4, "bytes_per_grad": 4},
           "hardware": hw,
           "limits": {"max_tokens_per_microbatch": 1 << 20, "num_microbatches": M},
           "execution": {"dispatch_dedup": args.dedup, "expert_gemm": args.expert_gemm}}
    # one batch: every rank's tokens, rank 0's experts args.skew times hotter
    lens = np.full(seqs * world, T // seqs, np.int32)
    rng = np.random.default_rng(7)
    routing = skewed_routing(rng, int(lens.sum()), E, k, np.arange(E // world), args.skew).astype(np.int32)
    routing = routing.reshape(-1, 1, k)
    results = []
    policy = os.path.join(tempfile.mkdtemp(prefix="bench-moe-"), "bench_levers.lua")
    with open(policy, "w") as fh:
        fh.write(PLANS_POLICY % M)
    # the same config with communication free: what the model predicts for the compute
    # alone (thread CPU time measures no communication: gloo's threads move the bytes)
    free = dict(cfg, topology=dict(cfg["topology"], nvlink_bytes_per_s=1e15, nvlink_latency_us=1e-3))
    compute_only = []
    for mode in ("contiguous", "replicas", "extras"):
        # extras: enough of rank 0's experts to level rank 0 with the others at half shares
        extra = args.extra_experts or max(1, (E // world) // 2 if world == 2 else E // world)
        for c, out in ((cfg, results), (free, compute_only)):
            sched = routepack.Scheduler(c, policy=policy, params={"mode": mode, "extra_experts": extra},
                                        log_level=None)
            res = sched.step(lens, routing)
            if res.fallback or res.policy_name != "bench_levers":
                raise SystemExit("the %s plan fell back: %s" % (mode, res.fallback_reason))
            out.append((mode, res))
    g = torch.Generator().manual_seed(0)
    w_in, w_out = torch.randn(E, d, 2 * f, generator=g) * d ** -0.5, torch.randn(E, f, d, generator=g) * f ** -0.5
    router = torch.randn(E, d, generator=g) * d ** -0.5
    cu = np.concatenate([[0], np.cumsum(lens)])
    runs = []
    for name, res in results:
        placement = res.placement(0)
        layer = MoELayer(d, f, E, k, placement.local_slots(rank), gated=True, dispatch_dedup=args.dedup,
                         expert_kernel=kern)
        layer.load_experts(w_in, w_out, placement)
        with torch.no_grad():
            layer.router.weight.copy_(router)
        mbs = []
        for m in range(res.num_microbatches):
            ids = res.microbatches[rank][m]
            rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in ids]) if len(ids) else np.zeros(0, np.int64)
            r = routing[rows]
            phys = torch.as_tensor(res.remap_rank(rank, m, r), dtype=torch.int64)[:, 0]
            x = torch.randn(len(rows), d, generator=torch.Generator().manual_seed(1000 * rank + m))
            mbs.append((x, torch.as_tensor(r[:, 0], dtype=torch.int64), phys, torch.randn(len(rows), d)))
        runs.append((name, res, placement, layer, mbs))

    def step(placement, layer, mbs):
        def go():
            layer.fetch_replicas(placement)
            for m, (x, r, phys, cot) in enumerate(mbs):
                xi = x.clone().requires_grad_()
                layer(xi, r, phys, microbatch=m).backward(cot)
            layer.reduce_replica_grads()
        return go
    times = {name: [] for name, *_ in runs}
    for rep in range(args.warmup + args.reps):
        for j in range(len(runs)):
            name, res, placement, layer, mbs = runs[(rep + j) % len(runs)]
            t = timed(step(placement, layer, mbs))
            if rep >= args.warmup:
                times[name].append(t)
    # replica-gradient bytes: measured (the layer's count) against the formula
    grad_bytes = []
    for name, res, placement, layer, mbs in runs:
        holders = placement.replica_holders(E)
        P = (layer.w_in[0].numel() + layer.w_out[0].numel()) * 4
        # each holder sends to every other holder keeping the expert in a slot
        in_slots = {e: set(placement.slot_rank()[placement.phy2log == e].tolist()) for e in holders}
        formula = sum(len(in_slots[e] - {rank}) * P for e, h in holders.items() if rank in h)
        allreduce = 2 * (world - 1) / world * len(holders) * P
        got = torch.tensor([layer.replica_grad_bytes["sent"], formula, allreduce], dtype=torch.float64)
        every = [torch.zeros_like(got) for _ in range(world)]
        dist.all_gather(every, got)
        grad_bytes.append((name, [e.tolist() for e in every]))
    mine = torch.tensor([statistics.median(t[3] for t in times[name]) * 1e3 for name, *_ in runs],
                        dtype=torch.float64)
    own_cpu = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(own_cpu, mine)
    own_cpu = [e.tolist() for e in own_cpu]
    if rank == 0:
        print("plans: %d ranks, %d tokens in %d sequences, %d microbatch(es), d %d, f %d, %d experts, top-%d, "
              "rank 0's experts %.0fx hotter, %d spare slot(s) a rank; dispatch_dedup %s; kernel %s; %d reps after "
              "%d warm-up, interleaved" % (world, int(lens.sum()), len(lens), M, d, f, E, k, args.skew,
                                           args.spare_slots, args.dedup, kern, args.reps, args.warmup))
        print("  CPU hardware for the model: %.1f GFLOP/s a thread%s, gloo %.0f MB/s, latency %.0f us"
              % (hw["peak_flops"] / 1e9, " with " + args.calibration + "'s expert curve" if args.calibration
                 else " (flat efficiency)", links["nvlink_bytes_per_s"] / 1e6, links["nvlink_latency_us"]))
        base_pred = results[0][1].step_time_s
        base_free = compute_only[0][1].step_time_s
        base = times[results[0][0]]
        for (name, res), (_, free_res) in zip(results, compute_only):
            extras = len(res.extra_replicas)
            reps_n = int(np.sum(np.bincount(res.phy2log[0][res.phy2log[0] >= 0], minlength=E) > 1))
            print("  %-16s predicted %.2f ms (x%.3f), communication free %.2f ms (x%.3f)  wall %s ms (x%s)  "
                  "thread CPU %s ms (x%s)  process CPU %s ms (x%s)  [%d replicated experts, %d share sets, "
                  "%d extra replicas]"
                  % (name, res.step_time_s * 1e3, res.step_time_s / base_pred,
                     free_res.step_time_s * 1e3, free_res.step_time_s / base_free,
                     summary([t[0] * 1e3 for t in times[name]]),
                     summary([a[0] / b[0] for a, b in zip(times[name], base)]),
                     summary([t[1] * 1e3 for t in times[name]]),
                     summary([a[1] / b[1] for a, b in zip(times[name], base)]),
                     summary([t[2] * 1e3 for t in times[name]]),
                     summary([a[2] / b[2] for a, b in zip(times[name], base)]),
                     reps_n, len(res.shares), extras))
        for i, (name, *_) in enumerate(runs):
            print("  %-16s thread CPU per rank (median ms): %s" % (name, " ".join("%.1f" % e[i] for e in own_cpu)))
        clause_check([(name, res.step_time_s, free_res.step_time_s, times[name])
                      for (name, res), (_, free_res) in zip(results, compute_only)])
        for name, every in grad_bytes:
            print("  replica gradients, %-16s bytes sent per rank %s; formula %s; an all-reduce over the EP group "
                  "would move %s" % (name, [int(e[0]) for e in every], [int(e[1]) for e in every],
                                     [int(e[2]) for e in every]))


def clause_check(plans):
    """Issue 29's 3-plan clause, for each measure against the prediction that measures
    the same thing: wall and process CPU time (every thread, gloo's included) against the
    whole prediction, the rank's thread CPU time (its compute: gloo's threads move the
    bytes) against the prediction with communication free. The model's fastest plan
    against its runner-up: the predicted margin, 1 - fastest / runner-up; the measured one,
    the median over repetitions of the same ratio of the two plans' times in that
    repetition (paired: both ran back to back); the clause holds when the model's fastest
    plan has the least median time and the measured margin is at least half the
    predicted one. `plans`: (name, predicted s, predicted s with communication free,
    [(wall, thread CPU, process CPU) per repetition])."""
    for label, col, pred in (("wall", 0, 1), ("thread CPU", 1, 2), ("process CPU", 2, 1)):
        order = sorted(plans, key=lambda p: p[pred])
        fast, second = order[0], order[1]
        predicted = 1 - fast[pred] / second[pred]
        paired = statistics.median(1 - a[col] / b[col] for a, b in zip(fast[3], second[3]))
        medians = {p[0]: statistics.median(t[col] for t in p[3]) for p in plans}
        measured_fastest = min(medians, key=medians.get)
        holds = measured_fastest == fast[0] and paired >= predicted / 2
        print("  clause, %-11s against the %s prediction: the model's fastest %s by %.1f%% over %s; measured "
              "fastest %s, %s by %.1f%% (paired median) over %s: %s"
              % (label, "communication-free" if pred == 2 else "whole", fast[0], predicted * 100, second[0],
                 measured_fastest, fast[0], paired * 100, second[0], "holds" if holds else "does not hold"))


# The five plans of issue 30: (label, policy, params, balancer). Each plans the same batch
# with its own packing and placement; "balancer" runs token_kk+contiguous's plan with
# VirtualExpertBalancer re-planning the experts every forward (the stand-in for Megatron's).
FIVE = [("contiguous", "token_kk+contiguous", None, False),
        ("eplb", "token_kk+eplb", None, False),
        ("balancer", "token_kk+contiguous", None, True),
        ("routepack-no-extras", "routepack", {"max_extra_per_rank": 0}, False),
        ("routepack", "routepack", None, False)]


def rank_least(plans, times, col):
    """Per plan, each rank's least ``col`` over all, the even and the odd repetitions,
    then the slowest rank's of each ([plans, 3]; collective: every rank calls it)."""
    mine = torch.tensor([[min(t[col] for t in times[p[0]][reps]) for reps in
                          (slice(None), slice(0, None, 2), slice(1, None, 2))] for p in plans], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.tolist()


def five_orders(plans, free, pred, times, compute):
    """The predicted and measured orders, each measure against the prediction of what it
    measures: compute (thread CPU outside communication calls) against communication free,
    wall against the whole step. Min-of-N (other work on the machine only ever adds time):
    compute is each rank's least over the repetitions, then the slowest rank's of those
    (``compute``: rank_least), the estimate of what the model predicts, the slowest rank's
    noise-free compute; the least over repetitions of the slowest rank per repetition
    would take, for a plan whose ranks are even, the larger of two noisy figures every
    repetition, biased up against a plan with one busy rank. Wall is the least over the
    repetitions of the slowest rank's (barrier to barrier: the step's). Plans that are the
    same plan (routepack with no extra replica to give is routepack without extras) are one
    entry, so a tie the model predicts is not scored as an order. Test-retest: the order of
    the odd repetitions' figures against the even ones', the tau a second run of the bench
    could reach against the first."""
    groups = {}
    for i, p in enumerate(plans):
        groups.setdefault((p[1].plan_hash, p[3]), []).append(i)   # the balancer runs contiguous's plan
    distinct = list(groups.values())
    names = ["=".join(plans[i][0] for i in g) for g in distinct]
    order = lambda xs: " < ".join(names[i] for i in np.argsort(xs, kind="stable"))
    reps = {"all": slice(None), "even": slice(0, None, 2), "odd": slice(1, None, 2)}
    for what, basis, p, least, how in (
            ("compute", "communication free", free,
             lambda r: [min(compute[i][list(reps).index(r)] for i in g) for g in distinct],
             "the slowest rank's least"),
            ("wall", "whole step", pred,
             lambda r: [min(t[0] for i in g for t in times[plans[i][0]][reps[r]]) for g in distinct],
             "the least of the slowest rank's")):
        p, m = [p[g[0]] for g in distinct], least("all")
        print("  %-10s predicted (%s) order: %s" % (what, basis, order(p)))
        print("  %-10s measured order (%s): %s   [%s ms]" % (what, how, order(m), " ".join("%.1f" % (x * 1e3) for x in m)))
        print("  %-10s Kendall tau predicted vs measured: %.2f over %d distinct plans%s; test-retest (odd against "
              "even repetitions) %.2f" % (
                  what, kendall(p, m), len(distinct), "" if len(distinct) == len(plans) else " (" + ", ".join(
                      n for n in names if "=" in n) + ": one plan)", kendall(least("even"), least("odd"))))


def kendall(a, b):
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return s / (n * (n - 1) / 2)


def five_batch(args, world):
    """issue 30's skewed batch: lengths varied, experts 0 .. args.hot_experts - 1 (all on
    rank 0) args.skew times hotter."""
    T, seqs, E, k = args.tokens, args.seqs, args.experts, args.top_k
    rng = np.random.default_rng(7)
    lens = rng.integers(T // seqs // 4, 2 * T // seqs, seqs * world).astype(np.int32)
    routing = skewed_routing(rng, int(lens.sum()), E, k, np.arange(args.hot_experts), args.skew).astype(np.int32)
    return lens, routing.reshape(-1, 1, k)


def five_plans(args, world, hw, links, lens, routing):
    """Each of FIVE's plans of the batch with its prediction, two ways: the whole step under
    this CPU's links (what wall time measures) and the same plan re-priced with
    communication free (`routepack plan eval` under a copy of the config whose links cost
    nothing: what a rank's compute measures, its thread CPU time outside communication).
    Returns [(label, StepResult, predicted s, predicted s communication free, balancer,
    cost report)]."""
    d, f, E, k, M = args.hidden, args.ffn, args.experts, args.top_k, args.microbatches

    def config(executor, spare, links):
        return {"topology": dict({"num_nodes": 1, "gpus_per_node": world, "ep_size": world,
                                  "slots_per_gpu": E // world + spare}, **links),
                "model": {"num_layers": 1, "num_experts": E, "top_k": k, "hidden_size": d, "expert_ffn_size": f,
                          "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "dense_params": 0,
                          "bytes_per_param": 4, "bytes_per_grad": 4},
                "hardware": hw, "limits": {"max_tokens_per_microbatch": 1 << 20, "num_microbatches": M},
                # the layer dispatches the activations' fp32 (the default prices BF16)
                "execution": {"executor": executor, "dispatch_dedup": args.dedup, "expert_gemm": args.expert_gemm}}
    free_links = {"nvlink_bytes_per_s": 1e15, "nvlink_latency_us": 1e-3}
    tmp = tempfile.mkdtemp(prefix="bench-moe-five-")
    trace = os.path.join(tmp, "batch.rpt")
    writer = routepack.TraceWriter(trace, E)
    writer.append(0, lens, routing)
    writer.close()
    out = []
    for label, policy, params, balancer in FIVE:
        executor, spare = ("megatron_balancer", 0) if balancer else ("routepack_torch", args.spare_slots)
        cfg = config("routepack_torch", args.spare_slots, links)
        with routepack.Scheduler(cfg, policy=policy, params=params, log_level=None) as sched:
            res = sched.step(lens, routing)
            text = sched.plan_json()
        if res.fallback:
            raise SystemExit("%s fell back: %s" % (label, res.fallback_reason))
        predicted, report = res.step_time_s, res.report["cost"]
        if balancer:   # the balancer's own plan, priced under its own profile
            with routepack.Scheduler(config(executor, spare, links), policy="token_kk+virtual_experts",
                                     log_level=None) as bs:
                bres = bs.step(lens, routing)
                text = bs.plan_json()
            predicted, report = bres.step_time_s, bres.report["cost"]
        free_cfg = os.path.join(tmp, "free-%s.json" % executor)
        with open(free_cfg, "w") as fh:
            json.dump(config(executor, spare, free_links), fh)
        free = fidelity.plan_eval(free_cfg, trace, 0, text)["summary"]["step_s"]
        out.append((label, res, predicted, free, balancer, report))
    return out


def part_five(args, rank, world):
    """contiguous, EPLB, the balancer stand-in, routepack without and with extra replicas
    on one skewed batch: each plan's step (fetch_replicas, every microbatch's forward and
    backward, reduce_replica_grads) timed interleaved; MEASURED medians against the times
    PREDICTED under execution.executor routepack_torch with this CPU's figures (the
    balancer's under megatron_balancer's profile: routepack_torch cannot run it), the
    whole step for wall time, communication free for compute (thread CPU time outside
    communication calls)."""
    from routepack.torch import VirtualExpertBalancer
    d, f, E, k = args.hidden, args.ffn, args.experts, args.top_k
    kern, why = kernels.choose_expert_kernel("cpu", torch.float32, d, f, True)
    hw = cpu_hardware(args, world)
    links = {"nvlink_bytes_per_s": hw.pop("nvlink_bytes_per_s"), "nvlink_latency_us": hw.pop("nvlink_latency_us")}
    lens, routing = five_batch(args, world)
    five = five_plans(args, world, hw, links, lens, routing)
    plans = [(label, res, predicted, balancer) for label, res, predicted, _, balancer, _ in five]
    reports = [report for *_, report in five]
    free = [fr for _, _, _, fr, _, _ in five]
    M = args.microbatches
    g = torch.Generator().manual_seed(0)
    w_in, w_out = torch.randn(E, d, 2 * f, generator=g) * d ** -0.5, torch.randn(E, f, d, generator=g) * f ** -0.5
    router = torch.randn(E, d, generator=g) * d ** -0.5
    cu = np.concatenate([[0], np.cumsum(lens)])
    runs = []
    for label, res, predicted, balancer in plans:
        placement = res.placement(0)
        layer = MoELayer(d, f, E, k, placement.local_slots(rank), gated=True, dispatch_dedup=args.dedup,
                         expert_kernel=kern)
        layer.load_experts(w_in, w_out, placement)
        with torch.no_grad():
            layer.router.weight.copy_(router)
        bal = VirtualExpertBalancer(E, placement) if balancer else None
        mbs = []
        for m in range(res.num_microbatches):
            ids = res.microbatches[rank][m]
            rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in ids]) if len(ids) else np.zeros(0, np.int64)
            r = routing[rows][:, 0]
            phys = torch.as_tensor(res.remap_rank(rank, m, routing[rows]), dtype=torch.int64)[:, 0]
            x = torch.randn(len(rows), d, generator=torch.Generator().manual_seed(1000 * rank + m))
            r = torch.as_tensor(r, dtype=torch.int64)
            # the balancer's own plan of each forward, made before the timed step: Megatron's
            # balancer plans on the device in microseconds, and what it costs (the pushes,
            # their gradients) stays timed; the stand-in's Python planning (about 1 ms a
            # forward here) is not what the megatron_balancer profile prices
            planned = bal.plan(r)[:2] if bal is not None else None
            if planned is not None:   # its tables too, as Megatron's are made on the device
                layer.prepare(planned[0])
            mbs.append((x, r, phys, torch.randn(len(rows), d), planned))
        layer.prepare(placement)   # every plan's tables made before the step (a plan precedes its step)
        runs.append((label, placement, layer, mbs, bal))

    def step(placement, layer, mbs, bal):
        def go():
            if bal is None:
                layer.fetch_replicas(placement)
            for m, (x, r, phys, cot, planned) in enumerate(mbs):
                if bal is not None:   # the balancer's own plan, every forward
                    pl, phys = planned
                    layer.fetch_replicas(pl)
                    m = 0
                xi = x.clone().requires_grad_()
                layer(xi, r, phys, microbatch=m).backward(cot)
                if bal is not None:
                    layer.reduce_replica_grads()
            if bal is None:
                layer.reduce_replica_grads()
        return go
    times = {label: [] for label, *_ in runs}
    for rep in range(args.warmup + args.reps):
        for j in range(len(runs)):
            label, placement, layer, mbs, bal = runs[(rep + j) % len(runs)]
            t = timed(step(placement, layer, mbs, bal))
            if rep >= args.warmup:
                times[label].append(t)
    compute = rank_least(plans, times, 5)
    if rank == 0:
        print("five plans: %d ranks (gloo, one pinned thread each), %d tokens in %d sequences, %d microbatch(es), "
              "d %d, f %d, %d experts, top-%d, experts 0-%d %.0fx hotter, %d spare slot(s) a rank; kernel %s; "
              "%d reps after %d warm-up, interleaved; %s" % (
                  world, int(lens.sum()), len(lens), M, d, f, E, k, args.hot_experts - 1, args.skew, args.spare_slots,
                  kern, args.reps,
                  args.warmup, "load %.2f" % os.getloadavg()[0]))
        print("  the model's CPU figures: peak %.3g FLOP/s%s, experts priced %s, gloo %.0f MB/s, latency %.0f us" % (
            hw["peak_flops"], " with " + args.calibration + "'s expert curve" if args.calibration else "",
            "per expert (loop)" if args.expert_gemm == "loop" else "as one grouped GEMM",
            links["nvlink_bytes_per_s"] / 1e6, links["nvlink_latency_us"]))
        pred = [p for _, _, p, _ in plans]
        cpu_t = [statistics.median([t[1] for t in times[label]]) for label, *_ in plans]
        comp_t = [statistics.median([t[4] for t in times[label]]) for label, *_ in plans]
        wall_t = [statistics.median([t[0] for t in times[label]]) for label, *_ in plans]
        proc_t = [statistics.median([t[2] for t in times[label]]) for label, *_ in plans]
        for (label, res, p, bal), fr, cm, c, w, pc in zip(plans, free, comp_t, cpu_t, wall_t, proc_t):
            print("  %-20s PREDICTED %8.2f ms (x%.3f), communication free %8.2f ms (x%.3f)   MEASURED compute %s ms "
                  "(x%.3f), thread CPU %s ms (x%.3f), process CPU %s ms (x%.3f), wall %s ms (x%.3f)  "
                  "[%d extra replicas, plan %016x]" % (
                      label, p * 1e3, p / pred[0], fr * 1e3, fr / free[0],
                      summary([x[4] * 1e3 for x in times[label]]), cm / comp_t[0],
                      summary([x[1] * 1e3 for x in times[label]]), c / cpu_t[0],
                      summary([x[2] * 1e3 for x in times[label]]), pc / proc_t[0],
                      summary([x[0] * 1e3 for x in times[label]]), w / wall_t[0], len(res.extra_replicas),
                      res.plan_hash))
        # routepack's own plan against the balancer's stand-in, repetition by repetition
        # (interleaved: each repetition ran both in one round), as issue 35 asks
        mine, theirs = times["routepack"], times["balancer"]
        pi, bi = [label for label, *_ in plans].index("routepack"), [label for label, *_ in plans].index("balancer")
        print("  routepack / balancer: PREDICTED x%.3f (communication free x%.3f); MEASURED per repetition, median "
              "(min-max) and reps routepack ran faster: %s" % (pred[pi] / pred[bi], free[pi] / free[bi], ", ".join(
                  "%s x%s %d/%d" % (name, summary([a[i] / b[i] for a, b in zip(mine, theirs)]),
                                    sum(a[i] < b[i] for a, b in zip(mine, theirs)), len(mine))
                  for name, i in (("compute", 4), ("thread CPU", 1), ("process CPU", 2), ("wall", 0)))))
        five_orders(plans, free, pred, times, compute)
    if args.comm:
        comm = [replay_comm(step(placement, layer, mbs, bal), args.reps) for _, placement, layer, mbs, bal in runs]
        if rank == 0:
            print("  communication, each collective the step ran replayed alone (barriers around, least wall of %d), "
                  "MEASURED, against the model's terms with gloo's figures above, PREDICTED:" % args.reps)
            for (label, *_), rep, (a2a, p2p, n_a2a, n_p2p) in zip(plans, reports, comm):
                print("  %-20s dispatch + combine: PREDICTED %7.2f ms  MEASURED %7.2f ms (%d all_to_all_single)   "
                      "extra-replica fetches + replica gradients: PREDICTED %7.2f ms  MEASURED %7.2f ms "
                      "(%d batch_isend_irecv)" % (
                          label, (rep["dispatch_s"] + rep["combine_s"]) * 1e3, a2a * 1e3, n_a2a,
                          (rep["grad_reduce_s"] + rep["extra_copy_s"]) * 1e3, p2p * 1e3, n_p2p))
            print("  (the model charges the balancer's weight pushes and gradient returns as dispatch time; the "
                  "layer sends them point to point)")


def replay_comm(run, reps):
    """The step's collectives, each replayed alone: every all_to_all_single and
    batch_isend_irecv one call of ``run`` makes (the layer's dispatch, combine, their
    backward, the counts, the replica-gradient exchange) is recorded, then each is re-run
    with barriers around it; the least wall time over ``reps`` (the slowest rank's) is
    summed by kind. Returns (all_to_all seconds, isend/irecv seconds, counts)."""
    a2a_real, p2p_real = dist.all_to_all_single, dist.batch_isend_irecv
    a2a_calls, p2p_calls = [], []

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        a2a_calls.append((output.shape, output.dtype, input.detach().clone(), output_split_sizes,
                          input_split_sizes, group))
        return a2a_real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def p2p(ops):
        p2p_calls.append([(op.op, op.tensor.detach().clone(), op.peer, op.group) for op in ops])
        return p2p_real(ops)
    dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
    try:
        run()
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a_real, p2p_real
    # every rank made the same collectives in the same order; replay them one at a time
    n = torch.tensor([len(a2a_calls), len(p2p_calls)])
    every = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(every, n)
    if any(not torch.equal(e, n) for e in every):
        raise SystemExit("the ranks made different collectives: %s" % [e.tolist() for e in every])

    def least(fn):
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            best = min(best, slowest([t])[0])
        return best
    t_a2a = sum(least(lambda c=c: a2a_real(torch.empty(c[0], dtype=c[1]), c[2], c[3], c[4], group=c[5]))
                for c in a2a_calls)

    def p2p_once(ops):
        works = p2p_real([dist.P2POp(op, t.clone(), peer, group) for op, t, peer, group in ops])
        for w in works:
            w.wait()
    t_p2p = sum(least(lambda ops=ops: p2p_once(ops)) for ops in p2p_calls)
    return t_a2a, t_p2p, len(a2a_calls), len(p2p_calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["plain", "plans", "five"])
    ap.add_argument("--comm", action="store_true", help="five: also replay each plan's collectives alone and "
                                                       "set them against the model's communication terms")
    ap.add_argument("--calibration", help="plans, five: take the expert curve, backward ratio, memory bandwidth "
                                          "and peak from this calibration.json (examples/cpu/calibration-cpu.json)")
    ap.add_argument("--expert-gemm", choices=["grouped", "loop"], default="loop",
                    help="plans, five: price the experts as one grouped GEMM or per expert (default loop: the CPU's "
                         "torch._grouped_mm runs one matmul per group, as examples/cpu/config-cpu.json says)")
    ap.add_argument("--reps", type=int, help="timed repetitions (default 9; five: 15, at least 2: its test-retest "
                                             "sets odd against even repetitions)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, help="experts (default 16; five: 8)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8, help="plans: sequences a rank")
    ap.add_argument("--microbatches", type=int, help="microbatches (default 2; five: 4)")
    ap.add_argument("--spare-slots", type=int, default=1)
    ap.add_argument("--skew", type=float, help="how much hotter the hot experts are (default 3; five: 8)")
    ap.add_argument("--hot-experts", type=int, help="five: the hot experts, 0 .. N - 1 (default 3)")
    ap.add_argument("--extra-experts", type=int, default=0, help="plans: extra replicas a microbatch (0: by world)")
    ap.add_argument("--dedup", default="gpu", choices=["gpu", "choice"])
    args = ap.parse_args()
    # five's batch: chosen, from the predictions alone before anything ran, so that the
    # five plans are predicted at least 4.5% apart both ways (whole step, communication
    # free) and routepack gives an extra replica; with plans' batch (16 experts, rank 0's
    # 3x hotter) EPLB, the balancer and routepack are predicted within 0.3% of each other
    # with communication free, an order no run on this machine can resolve
    five = args.part == "five"
    for key, plain, fives in (("experts", 16, 8), ("microbatches", 2, 4), ("skew", 3.0, 8.0), ("hot_experts", None, 3),
                              ("reps", 9, 15)):
        if getattr(args, key) is None:
            setattr(args, key, fives if five else plain)
    if args.reps < (2 if five else 1):
        ap.error("--reps %d: %s needs at least %d" % (args.reps, args.part, 2 if five else 1))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # one thread a rank on a core of its own, freed memory kept as a GPU's caching allocator
    # keeps it (routepack.cpu.pin: without it a bigger microbatch pays page faults per step)
    cpu.pin(rank)
    {"plain": part_plain, "plans": part_plans, "five": part_five}[args.part](args, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
