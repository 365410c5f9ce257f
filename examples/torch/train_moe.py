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

Options: --policy (the scheduler's), --steps, --swap-to (the policy staged halfway;
'none' keeps one), --seqs-per-rank, --seed, --dump PATH (rank 0 saves the per-step losses
and every logical parameter, experts gathered by id, with torch.save)."""

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from routepack.torch import (DistributedScheduler, ExpertPlacement, MigrationExecutor, MoELayer,
                             init_optimizer_state, pack_microbatches, slot_tensors)

VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 16, 32, 2, 8, 2


def config_for(world):
    """One node of `world` GPUs, one EP group over all of them, a spare slot each."""
    return {
        "topology": {"num_nodes": 1, "gpus_per_node": world, "ep_size": world,
                     "slots_per_gpu": -(-EXPERTS // world) + 1},
        "model": {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K, "hidden_size": HIDDEN,
                  "expert_ffn_size": FFN, "num_heads": HEADS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM},
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
    def __init__(self, num_slots, dispatch_dedup):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.moe = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, num_slots, dispatch_dedup=dispatch_dedup)


class TinyMoE(nn.Module):
    def __init__(self, num_slots, dispatch_dedup="gpu"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(num_slots, dispatch_dedup) for _ in range(LAYERS))
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


def rollout_batch(step, world, seqs_per_rank, seed):
    """The step's sequences (lengths for all; tokens of each from its own seed), the
    same in every run. Sequence s was rolled out by rank s % world."""
    S = seqs_per_rank * world
    rng = np.random.default_rng([seed, step])
    lens = rng.integers(4, 40, S).astype(np.int32)
    tokens = [torch.randint(0, VOCAB, (int(lens[s]),), generator=torch.Generator().manual_seed(
        seed * 1000003 + step * 1009 + s)) for s in range(S)]
    return lens, tokens, np.arange(S) % world


def sum_loss(logits, tokens, cu_seqlens):
    """Next-token cross entropy summed over every position with a successor in its sequence."""
    if tokens.numel() == 0:
        return logits.sum() * 0.0
    ends = cu_seqlens[1:].long() - 1
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[ends[ends >= 0]] = False   # a sequence's last token has no successor
    idx = torch.nonzero(keep).squeeze(1)
    return F.cross_entropy(logits[idx], tokens[idx + 1], reduction="sum")


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
        lens, tokens, owner = rollout_batch(step, world, args.seqs_per_rank, args.seed)
        mine = np.nonzero(owner == rank)[0]
        my_tokens = torch.cat([tokens[s] for s in mine]).to(device)
        my_cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lens[mine])]), device=device)
        with torch.no_grad():
            for l, b in enumerate(model.blocks):
                b.moe.set_placement(ExpertPlacement(placement[l].phy2log, slot_begin, [np.zeros((0, 2), np.int64)]))
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
        executor.execute()
        placement = [ExpertPlacement.from_step(res, l) for l in range(LAYERS)]
        if args.plan_ahead and step + 1 < args.steps:
            if swap_to != "none" and step + 1 == args.steps // 2:
                sched.stage_policy(swap_to)
            ro = rollout(step + 1)       # this step's was unpacked above
            ahead = sched.step_ahead(ro[0][ro[2]], ro[4], ro[2], step=step + 1)
        for l, b in enumerate(model.blocks):
            b.moe.set_placement(placement[l])
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
                     sched.last_exchange_bytes["sent"], plan_s * 1e3, waited_s * 1e3, step_loss, swapped),
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
    # Every rank reaches teardown together: a rank that destroys its gloo group while a peer
    # is still writing the dump can abort in gloo's destructor ("terminate called without an
    # active exception", seen under load in CI).
    dist.barrier()
    sched.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
