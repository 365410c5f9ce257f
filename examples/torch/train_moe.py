#!/usr/bin/env python3
"""A small MoE transformer trained with RoutePack inside torch.distributed.

    torchrun --nproc-per-node 4 examples/torch/train_moe.py            # CPU: gloo
    torchrun --nproc-per-node 1 examples/torch/train_moe.py            # one GPU: NCCL

Every step: each rank rolls out its own sequences and records their routing (R3); the
ranks exchange only their routing statistics and every rank plans the same packing and
placement from them (DistributedScheduler); the expert weights and Adam state
migrate (C executor over torch.distributed); each rank fetches the sequences the plan
gives it (THD packing) and remaps their routing to physical replicas; the MoE layers run
the plan (replica shares, extra replicas) microbatch by microbatch; replicas' gradients
are summed, dense gradients all-reduced, and the optimizer steps. Halfway, the policy is
hot-swapped. Placement changes where the work runs, never what is computed: the losses
and parameters equal those of ``--policy token_kk+contiguous`` (fixed placement, no
replicas) to fp32 round-off (python/tests/test_torch_example.py checks it).

Then the benefit on this machine (CPU runs; --no-benefit skips it): a batch skewed as RL
batches are (one long response in eight among short ones; a few hot experts per layer) is
planned twice, by the policy and by ``token_kk+contiguous``, with the cost model
calibrated on this CPU first (the example's own attention, expert MLP and projections
timed, fp32, one thread: the config's ``hardware`` figures), and the model (its dense
weights, experts BENEFIT_FFN wide) runs each plan's forward and backward. The closing line
sets the MEASURED time of the two plans (each rank's own compute time, least of
--benefit-reps runs, the slowest rank per microbatch summed: what the step waits for when
every rank has a core of its own) beside the PREDICTED ratio. Communication is neither
measured nor predicted there (gloo on one host is no interconnect), nor is the migration.

Options: --policy (the scheduler's), --steps, --swap-to (the policy staged halfway;
'none' keeps one), --seqs-per-rank, --seed, --dump PATH (rank 0 saves the per-step losses
and every logical parameter, experts gathered by id, with torch.save), --no-benefit,
--benefit-reps (timed runs of each plan, default 5)."""

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from routepack.torch import (DistributedScheduler, ExpertPlacement, MigrationExecutor, MoELayer,
                             init_optimizer_state, pack_microbatches, slot_tensors)
from rollout import rollout_batch   # examples/torch/rollout.py, shared with examples/megatron
from teardown import end_run        # examples/torch/teardown.py, likewise

VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 16, 32, 2, 8, 2
# the closing comparison's experts are wider, so that their work, not Python's per-op cost,
# is what a rank spends its time on (a real MoE layer's experts are far wider still)
BENEFIT_FFN = 512


def config_for(world, ffn=FFN):
    """One node of `world` GPUs, one EP group over all of them, a spare slot each."""
    return {
        "topology": {"num_nodes": 1, "gpus_per_node": world, "ep_size": world,
                     "slots_per_gpu": -(-EXPERTS // world) + 1},
        "model": {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K, "hidden_size": HIDDEN,
                  "expert_ffn_size": ffn, "num_heads": HEADS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM},
        "limits": {"max_tokens_per_microbatch": 256, "num_microbatches": 2},
    }


class Attention(nn.Module):
    """Causal self-attention over packed sequences (THD: cu_seqlens); FlashAttention's
    varlen kernel does the loop below in one call on GPUs."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x, cu_seqlens):
        q, k, v = self.qkv(x).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        outs = []
        cu = cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            if b > a:
                o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                   v[a:b].transpose(0, 1), is_causal=True)
                outs.append(o.transpose(0, 1))
        o = torch.cat(outs) if outs else x.new_zeros((0, HEADS, HEAD_DIM))
        return self.out(o.reshape(-1, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self, num_slots, dispatch_dedup, ffn):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.moe = MoELayer(HIDDEN, ffn, EXPERTS, TOP_K, num_slots, dispatch_dedup=dispatch_dedup)


class TinyMoE(nn.Module):
    def __init__(self, num_slots, dispatch_dedup="gpu", ffn=FFN):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(num_slots, dispatch_dedup, ffn) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, cu_seqlens, routing=None, physical=None, microbatch=0):
        """tokens [T]; routing, physical [T, layers, k] or None. Returns logits [T, vocab]."""
        x = self.embed(tokens)
        for l, b in enumerate(self.blocks):
            x = x + b.attn(b.norm1(x), cu_seqlens)
            x = x + b.moe(b.norm2(x), None if routing is None else routing[:, l],
                          None if physical is None else physical[:, l], microbatch)
        return self.head(self.norm(x))


def sum_loss(logits, tokens, cu_seqlens):
    """Next-token cross entropy summed over every position with a successor in its sequence."""
    if tokens.numel() == 0:
        return logits.sum() * 0.0
    ends = cu_seqlens[1:].long() - 1
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[ends[ends >= 0]] = False   # a sequence's last token has no successor
    idx = torch.nonzero(keep).squeeze(1)
    return F.cross_entropy(logits[idx], tokens[idx + 1], reduction="sum")


def cpu_hardware(ffn, peak=1e12, reps=5):
    """The cost model's hardware figures for this CPU, measured with the example's own
    operations (fp32, this thread): efficiencies are fractions of a nominal ``peak``. The
    model counts an expert as 6 n d f FLOPs (SwiGLU); this MLP does 4 n d f, which its
    measured efficiency absorbs, so that FLOPs / (peak x efficiency) is the time measured."""
    def timed(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        return max(statistics.median(times), 1e-7)

    def fwd_bwd(fn, leaves):
        def run():
            fn().sum().backward()
            for t in leaves:
                t.grad = None
        with torch.no_grad():
            tf = timed(fn)
        return tf, timed(run)

    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()   # noqa: E731
    gemm, attn, bwd_e, bwd_a = [], [], [], []
    w_in, w_out = rnd(HIDDEN, ffn), rnd(ffn, HIDDEN)
    for n in (4, 16, 64, 256, 1024):
        x = rnd(n, HIDDEN)
        tf, tb = fwd_bwd(lambda: F.silu(x @ w_in) @ w_out, [x, w_in, w_out])
        gemm.append([n, min(1.0, 6.0 * n * HIDDEN * ffn / (tf * peak))])
        if n >= 256:   # backward / forward where the work, not the per-op cost, is timed
            bwd_e.append(tb / tf - 1)
    for L in (16, 64, 256, 1024):
        q, k, v = rnd(HEADS, L, HEAD_DIM), rnd(HEADS, L, HEAD_DIM), rnd(HEADS, L, HEAD_DIM)
        tf, tb = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
        attn.append([L, min(1.0, 2.0 * L * L * HEADS * HEAD_DIM / (tf * peak))])
        if L >= 256:
            bwd_a.append(tb / tf - 1)
    T, hd = 1024, HEADS * HEAD_DIM
    x, a, w_qkv, w_o = rnd(T, HIDDEN), rnd(T, hd), rnd(3 * hd, HIDDEN), rnd(HIDDEN, hd)
    tf, tb = fwd_bwd(lambda: F.linear(x, w_qkv).sum(-1, keepdim=True) + F.linear(a, w_o), [x, a, w_qkv, w_o])
    src = torch.empty(1 << 24, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return {"peak_flops": peak, "gemm_efficiency": gemm, "attention_efficiency": attn,
            "dense_efficiency": min(1.0, 2.0 * T * HIDDEN * 4 * hd / (tf * peak)),
            "hbm_bytes_per_s": 2.0 * src.numel() / timed(lambda: dst.copy_(src)),
            "backward": {"attention": statistics.median(bwd_a), "experts": statistics.median(bwd_e),
                         "projections": tb / tf - 1}}


def benefit_batch(world, seed):
    """An RL-like batch: 8 sequences a rank, most of 32-160 tokens and one in eight of
    700-1000 (long reasoning responses), owned round robin; and per layer a routing skewed
    to a few hot experts (Zipf 1.6 over a random order). Returns lens, owner, routing."""
    rng = np.random.default_rng([seed, 12345])
    S = 8 * world
    lens = np.where(rng.random(S) < 0.125, rng.integers(700, 1000, S), rng.integers(32, 160, S)).astype(np.int32)
    T = int(lens.sum())
    routing = np.empty((T, LAYERS, TOP_K), np.int32)
    for l in range(LAYERS):
        p = 1.0 / np.arange(1, EXPERTS + 1) ** 1.6
        p = p[rng.permutation(EXPERTS)] / p.sum()
        gumbel = np.log(p)[None, :] + rng.gumbel(size=(T, EXPERTS))
        routing[:, l] = np.argsort(-gumbel, axis=1)[:, :TOP_K]
    return lens, np.arange(S) % world, routing


def measure_benefit(args, model, rank, world, device):
    """The closing comparison: the policy's plan and token_kk+contiguous's for one skewed
    batch, predicted by the cost model calibrated on this CPU and measured on the model
    (its dense weights; experts BENEFIT_FFN wide; forward + backward, no optimizer step).
    Returns the closing line (rank 0)."""
    # calibrate on rank 0 (the others wait), every rank takes its figures
    hw = [cpu_hardware(BENEFIT_FFN) if rank == 0 else None]
    dist.broadcast_object_list(hw, src=0)
    config = config_for(world, BENEFIT_FFN)
    config["hardware"] = hw[0]
    config["topology"].update({"nvlink_bytes_per_s": 1e15, "nvlink_latency_us": 0})   # communication not compared
    config["limits"] = {"max_tokens_per_microbatch": 8192, "num_microbatches": 2}
    lens, owner, routing = benefit_batch(world, args.seed)
    mine = np.nonzero(owner == rank)[0]
    cu = np.concatenate([[0], np.cumsum(lens)])
    rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in mine])
    my_routing = torch.as_tensor(routing[rows], device=device)
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    my_tokens = torch.randint(0, VOCAB, (len(rows),), generator=g).to(device)
    # logical experts (the same on every rank), loaded at each plan's placement below
    g = torch.Generator().manual_seed(args.seed + 2)
    logical = [(torch.randn(EXPERTS, HIDDEN, BENEFIT_FFN, generator=g) * HIDDEN ** -0.5,
                torch.randn(EXPERTS, BENEFIT_FFN, HIDDEN, generator=g) * BENEFIT_FFN ** -0.5) for _ in range(LAYERS)]
    slots = config["topology"]["slots_per_gpu"]
    slot_begin = np.arange(world + 1) * slots

    plans = {}
    for policy in (args.policy, "token_kk+contiguous"):
        sched = DistributedScheduler(config, policy=policy, log_level=None)
        res = sched.step(lens[mine], my_routing, mine)
        sched.close()
        run = TinyMoE(slots, model.blocks[0].moe.dispatch_dedup, BENEFIT_FFN).to(device)
        run.load_state_dict({k: v for k, v in model.state_dict().items() if ".moe.w_" not in k}, strict=False)
        for l, b in enumerate(run.blocks):
            b.moe.load_experts(*(w.to(device) for w in logical[l]), ExpertPlacement(res.phy2log[l], slot_begin, []))
            b.moe.fetch_replicas(res.placement(l))
        packed = pack_microbatches(res.microbatches, owner, lens, mine, {"tokens": my_tokens, "routing": my_routing})
        physical = [res.remap_rank(rank, m, pm["routing"]) for m, pm in enumerate(packed)]
        plans[policy] = (res, run, packed, physical)


    def one_pass(res, run, packed, physical):
        """This rank's compute time of each microbatch's forward + backward (its thread's
        CPU time: waiting for the other ranks is not in it)."""
        times = []
        for m, pm in enumerate(packed):
            t0 = time.thread_time()
            logits = run(pm["tokens"], pm.cu_seqlens, routing=pm["routing"], physical=physical[m], microbatch=m)
            sum_loss(logits, pm["tokens"], pm.cu_seqlens).backward()
            times.append(time.thread_time() - t0)
        for b in run.blocks:
            b.moe.reduce_replica_grads()
        run.zero_grad(set_to_none=True)
        return times

    # each rank's time of each microbatch: the least over the repetitions (other work on
    # the machine only ever adds to it); then each microbatch waits for its slowest rank
    best = {}
    for rep in range(args.benefit_reps + 1):          # the first pass of each warms up
        for policy, plan in plans.items():            # alternated, so drift hits both
            t = torch.tensor(one_pass(*plan), dtype=torch.float64)
            if rep:
                best[policy] = t if policy not in best else torch.minimum(best[policy], t)
    measured = {}
    for policy in plans:                              # the same order on every rank
        every = [torch.zeros_like(best[policy]) for _ in range(world)]
        dist.all_gather(every, best[policy])
        measured[policy] = float(torch.stack(every).max(0).values.sum())

    if rank != 0:
        return None
    ours, base = plans[args.policy][0], plans["token_kk+contiguous"][0]
    t_ours, t_base = measured[args.policy], measured["token_kk+contiguous"]
    return ("benefit on this CPU (%d ranks, %d sequences, %d tokens): forward+backward MEASURED here %s %.1f ms "
            "vs token_kk+contiguous %.1f ms = %.3fx (each rank's compute time, least of %d runs, the slowest "
            "rank per microbatch); PREDICTED by the cost model calibrated on this CPU %.1f vs %.1f ms = %.3fx; "
            "the plans %s" % (world, len(lens), int(lens.sum()), args.policy, t_ours * 1e3, t_base * 1e3,
                              t_ours / t_base, args.benefit_reps, ours.step_time_s * 1e3, base.step_time_s * 1e3,
                              ours.step_time_s / base.step_time_s,
                              "differ" if ours.plan_hash != base.plan_hash else "are the same"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="routepack")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--swap-to", default="auto",
                    help="policy staged at steps/2 ('auto': token_kk+eplb, or none for token_kk+contiguous)")
    ap.add_argument("--seqs-per-rank", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--plan-ahead", action="store_true",
                    help="plan step t + 1 on a host thread while step t trains")
    ap.add_argument("--no-benefit", dest="benefit", action="store_false",
                    help="skip the closing comparison with token_kk+contiguous")
    ap.add_argument("--benefit-reps", type=int, default=5)
    args = ap.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    config = config_for(world)
    # Every rank plans the same step from all ranks' routing statistics (only those are
    # exchanged), agreeing on the plan through torch.distributed.
    sched = DistributedScheduler(config, policy=args.policy, log_level=None, plan_ahead=args.plan_ahead)
    swap_to = args.swap_to
    if swap_to == "auto":
        swap_to = "none" if args.policy == "token_kk+contiguous" else "token_kk+eplb"

    # The model: the same dense weights on every rank; logical experts from one seed,
    # loaded into the slots of the placement the scheduler starts from.
    torch.manual_seed(args.seed)
    slots = config["topology"]["slots_per_gpu"]
    # the layer dispatches as the cost model prices it: the config's execution.dispatch_dedup
    model = TinyMoE(slots, config.get("execution", {}).get("dispatch_dedup", "gpu")).to(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    start = sched.initial_placement()
    slot_begin = np.arange(world + 1) * slots
    for l, b in enumerate(model.blocks):
        w_in = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * HIDDEN ** -0.5
        w_out = torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * FFN ** -0.5
        b.moe.load_experts(w_in.to(device), w_out.to(device), ExpertPlacement(start[l], slot_begin, []))
    experts = {id(p) for b in model.blocks for p in (b.moe.w_in, b.moe.w_out)}
    dense = [p for p in model.parameters() if id(p) not in experts]
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    init_optimizer_state(opt)   # Adam's state exists before the first migration moves it

    executor = MigrationExecutor(sched, timeout_s=60.0)
    for l, b in enumerate(model.blocks):
        executor.register(l, slot_tensors([b.moe.w_in, b.moe.w_out], opt))
    executor.sync()
    placement = [ExpertPlacement(start[l], slot_begin, [np.zeros((0, 2), np.int64)]) for l in range(LAYERS)]

    def rollout(step):
        """Each rank runs its own sequences of `step` once and records their routing (R3)."""
        lens, tokens, owner = rollout_batch(step, world, args.seqs_per_rank, args.seed, VOCAB, 40)
        mine = np.nonzero(owner == rank)[0]
        my_tokens = torch.cat([tokens[s] for s in mine]).to(device)
        my_cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lens[mine])]), device=device)
        with torch.no_grad():
            for l, b in enumerate(model.blocks):
                b.moe.fetch_replicas(ExpertPlacement(placement[l].phy2log, slot_begin, [np.zeros((0, 2), np.int64)]))
            model(my_tokens, my_cu)
            my_routing = torch.stack([b.moe.last_routing for b in model.blocks], dim=1).to(torch.int32)
        return lens, owner, mine, my_tokens, my_routing

    losses, planning = [], []
    ahead = None
    if args.plan_ahead:
        # Step 0's plan has nothing to hide behind; from then on step t + 1 is planned on a
        # host thread while step t trains (its rollout made with the weights before step
        # t's update, as an asynchronous RL trainer's is).
        if swap_to != "none" and args.steps // 2 == 0:
            sched.stage_policy(swap_to)
        ro = rollout(0)
        ahead = sched.step_ahead(ro[0][ro[2]], ro[4], ro[2], step=0)
    for step in range(args.steps):
        t0 = time.perf_counter()
        if not args.plan_ahead:
            if swap_to != "none" and step == args.steps // 2:
                sched.stage_policy(swap_to)
            ro = rollout(step)
            tp = time.perf_counter()
            res = sched.step(ro[0][ro[2]], ro[4], ro[2], step=step)
            plan_s = waited_s = time.perf_counter() - tp
        else:
            res = ahead.result()          # waits for a late plan; never skips it
            plan_s, waited_s = ahead.planning_s, ahead.waited_s
        planning.append((plan_s, waited_s))
        lens, owner, mine, my_tokens, my_routing = ro

        # Migrate, then (plan-ahead) start the next step's plan, then pack and train.
        executor.execute(res)
        placement = [res.placement(l) for l in range(LAYERS)]
        if args.plan_ahead and step + 1 < args.steps:
            if swap_to != "none" and step + 1 == args.steps // 2:
                sched.stage_policy(swap_to)
            ro = rollout(step + 1)       # this step's was unpacked above
            ahead = sched.step_ahead(ro[0][ro[2]], ro[4], ro[2], step=step + 1)
        for l, b in enumerate(model.blocks):
            b.moe.fetch_replicas(placement[l])
        packed = pack_microbatches(res.microbatches, owner, lens, mine,
                                   {"tokens": my_tokens, "routing": my_routing})
        num_targets = float(np.sum(lens - 1))

        # Train: every microbatch in lockstep on every rank, even an empty one.
        loss_sum = torch.zeros((), device=device)
        for m, pm in enumerate(packed):
            phys = res.remap_rank(rank, m, pm["routing"])   # a tensor on the routing's device
            logits = model(pm["tokens"], pm.cu_seqlens, routing=pm["routing"], physical=phys, microbatch=m)
            loss = sum_loss(logits, pm["tokens"], pm.cu_seqlens)
            (loss / num_targets).backward()
            loss_sum += loss.detach()
        for b in model.blocks:
            b.moe.reduce_replica_grads()
        for p in dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=False)
        dist.all_reduce(loss_sum)
        step_loss = loss_sum.item() / num_targets
        losses.append(step_loss)

        wall = torch.tensor([time.perf_counter() - t0], device=device)
        walls = [torch.zeros_like(wall) for _ in range(world)]
        dist.all_gather(walls, wall)
        if rank == 0:
            swapped = "  swapped to %s" % res.policy_name if res.swapped else ""
            print("step %d  policy %s  predicted %.3f ms  wall %s ms  experts moved %d  stats sent %d B  "
                  "planning %.1f ms  waited %.1f ms  loss %.6f%s"
                  % (step, res.policy_name, res.step_time_s * 1e3,
                     "/".join("%.0f" % (w.item() * 1e3) for w in walls), res.experts_moved,
                     res.exchange_bytes["sent"], plan_s * 1e3, waited_s * 1e3, step_loss, swapped),
                  flush=True)

    # Logical parameters: dense ones as they are, experts gathered by id.
    logical = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if id(p) not in experts}
    for l, b in enumerate(model.blocks):
        w_in, w_out = b.moe.gather_experts(placement[l])
        logical["blocks.%d.moe.experts.w_in" % l] = w_in.cpu()
        logical["blocks.%d.moe.experts.w_out" % l] = w_out.cpu()
    if rank == 0 and len(planning) > 1:
        # The trainer waits for all of a synchronous plan; planned ahead, for the part the
        # step before's training did not hide. Step 0 has no step before it.
        plan_ms = sum(p for p, _ in planning[1:]) * 1e3
        wait_ms = sum(w for _, w in planning[1:]) * 1e3
        print("planning steps 1-%d: %.1f ms, the trainer waited %.1f ms (%.1f%%)%s; step 0: %.1f ms"
              % (len(planning) - 1, plan_ms, wait_ms, 100 * wait_ms / max(plan_ms, 1e-9),
                 " (planned ahead)" if args.plan_ahead else " (synchronous)", planning[0][0] * 1e3), flush=True)
    if rank == 0:
        if args.dump:
            torch.save({"losses": losses, "params": logical}, args.dump)
        print("final loss %.9g" % losses[-1], flush=True)
    if args.benefit and backend == "gloo":   # on GPUs: scripts/device-check.sh and docs/calibration.md
        line = measure_benefit(args, model, rank, world, device)
        if rank == 0:
            print(line, flush=True)
    end_run(sched, backend)


if __name__ == "__main__":
    main()
