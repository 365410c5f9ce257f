#!/usr/bin/env python3
"""A tiny GPT-MoE built from Megatron-Core's own modules (GPTModel, MoELayer with
SequentialMLP experts and the all-to-all token dispatcher, DDP, the distributed
optimizer) trained with RoutePack's plans, replicas included.

    torchrun --nproc-per-node 2 examples/megatron/train_moe.py [--policy P] [--steps N]

Every step: each rank rolls out its own sequences (a forward pass, routing recorded from
Megatron's router); the ranks exchange routing statistics and plan the same step
(DistributedScheduler); MegatronMigration runs the plan's placement on the Megatron model
(experts' weights, main_grad, the distributed optimizer's fp32 state shards; with the stock
layer router rows and expert_bias too); each rank trains the micro-batches the plan gives
it, routed as their rollout was (Megatron's router replay) to the slots the plan gives them
(RoutePackMoELayer: a spare slot per rank, where token_kk+eplb puts replicas); replicas'
gradients are summed among their holders, DDP reduces the gradients and the distributed
optimizer steps. Placement changes where the work runs,
never what is computed: the losses equal those of --policy token_kk+contiguous (no
placement change) to fp32 round-off (python/tests/test_megatron_moe.py checks the losses,
every logical parameter and optimizer state). On CPU (gloo) the CUDA calls megatron-core
0.16.1 makes unconditionally get stand-ins (megatron_cpu.py, said there).

Options: --policy (default token_kk+eplb: replicas of the hottest experts in the spare
slots, or with --layer stock a permutation of the experts), --layer routepack|stock
(RoutePackMoELayer over the plan's slots, default; or Megatron's MoELayer, each expert
once), --spec local|te (SequentialMLP experts, default; or Transformer Engine's
TEGroupedMLP, CUDA only), --overlap-grad-reduce (Megatron DDP reduce-scatters gradients during the backward;
the replicas' gradients are summed as each layer's backward ends), --steps, --seqs-per-rank,
--seed, --lr, --dump PATH (rank 0 saves
the per-step losses and MegatronMigration.logical_state_dict() with torch.save), --load
PATH (a --dump file's logical state loaded into the model and optimizer first)."""

import argparse
import contextlib
import os
import sys
import zlib

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the rollout both train_moe.py examples share
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torch"))
from rollout import rollout_batch  # noqa: E402
from teardown import end_run  # noqa: E402

VOCAB, HIDDEN, HEADS, FFN, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 32, 2, 8, 2


def config_for(world, layer="routepack"):
    """One node of `world` GPUs = Megatron's EP group; num_experts / EP slots each, and a
    spare slot for a replica with RoutePack's layer (stock Megatron holds every expert once).
    The executor profile says what runs the plan, so the planner prices it and makes only
    the levers it runs: megatron_routepack (replicas and shares, no extra replicas) or
    megatron_alltoall (every expert once)."""
    return {
        "topology": {"num_nodes": 1, "gpus_per_node": world, "ep_size": world,
                     "slots_per_gpu": EXPERTS // world + (layer == "routepack")},
        "execution": {"executor": "megatron_routepack" if layer == "routepack" else "megatron_alltoall"},
        "model": {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K, "hidden_size": HIDDEN,
                  "expert_ffn_size": FFN, "num_heads": HEADS, "num_kv_heads": HEADS,
                  "head_dim": HIDDEN // HEADS},
        "limits": {"max_tokens_per_microbatch": 256, "num_microbatches": 2},
    }


def build(world, seed, start, layer="routepack", spec_kind="local"):
    """GPTModel with MoE layers, every weight a function of its logical name (an expert's
    of its logical id), loaded where placement `start` (phy2log [L, slots]) puts the
    experts. layer "routepack": RoutePackMoELayer over the plan's slots (replicas), with
    Megatron's router replay; "stock": Megatron's MoELayer, one slot per expert. spec_kind
    "local": Megatron's local spec (SequentialMLP experts); "te": the Transformer Engine
    spec with grouped GEMMs (TEGroupedMLP: CUDA and transformer_engine)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from routepack.adapters.megatron_layer import with_routepack_layers
    from routepack.adapters.megatron_migration import expert_pieces, moe_layers

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(seed)
    slots = len(start[0])
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        num_moe_experts=slots, moe_router_topk=TOP_K, moe_enable_routing_replay=layer == "routepack", moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=spec_kind == "te",
        expert_model_parallel_size=world,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, add_bias_linear=False,
        use_cpu_initialization=not torch.cuda.is_available(), params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False)
    if spec_kind == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=slots, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=slots)
    if layer == "routepack":
        spec = with_routepack_layers(spec, EXPERTS)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64)
    if torch.cuda.is_available():
        model.cuda()

    def value(name, shape):
        g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g) * shape[-1] ** -0.5

    experts = set()
    n = slots // world
    rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for l, moe in enumerate(moe_layers(model)):
            for i in range(n):
                e = int(start[l][rank * n + i])
                for name, p, select in expert_pieces(moe.experts, i):
                    select(p.data).copy_(value("moe.%d.expert.%d.%s" % (l, e, name), select(p.data).shape)
                                         if e >= 0 else torch.zeros_like(select(p.data)))
                    experts.add(id(p))
            # stock: the router's rows in Megatron's order; RoutePackMoELayer's is logical
            order = np.asarray(start[l]) if layer == "stock" else np.arange(EXPERTS)
            moe.router.weight.copy_(value("moe.%d.router" % l, (EXPERTS, HIDDEN))[torch.as_tensor(order)])
        for name, p in model.named_parameters():
            if id(p) not in experts and "router" not in name:
                p.copy_(value(name, p.shape) if p.dim() > 1 else torch.ones_like(p) if "weight" in name
                        else torch.zeros_like(p))
    return cfg, model


def batch_of(ids, tokens, device):
    """Sequences `ids` right-padded into [b, s] (causal attention: padding after a
    sequence never reaches it); a batch of one pad token when `ids` is empty (the rank
    still runs the layer's all-to-alls). Returns input, labels, loss mask."""
    if len(ids) == 0:
        z = torch.zeros((1, 1), dtype=torch.long, device=device)
        return z, z, torch.zeros((1, 1), device=device)
    width = max(len(tokens[s]) for s in ids)
    inp = torch.zeros((len(ids), width), dtype=torch.long)
    labels = torch.zeros_like(inp)
    mask = torch.zeros((len(ids), width))
    for b, s in enumerate(ids):
        t = tokens[s]
        inp[b, :len(t)] = t
        labels[b, :len(t) - 1] = t[1:]
        mask[b, :len(t) - 1] = 1.0
    return inp.to(device), labels.to(device), mask.to(device)


def replay_plan(layers, res, rank, m, routing, mask, lens, actions):
    """Micro-batch m's tokens ([b, s] right-padded, `mask` 1 on tokens with a target) routed
    as their rollout was (Megatron's router replay) and dispatched to the slots the plan gives
    them (routepack's remap): per MoE layer, set in Megatron's token order (s x b)."""
    b, s = mask.shape
    real = torch.zeros((b, s), dtype=torch.bool)
    for row, sid in enumerate(res.microbatches[rank][m]):
        real[row, :int(lens[sid])] = True
    physical = torch.as_tensor(res.remap_rank(rank, m, routing.numpy()), dtype=torch.long)
    for l, moe in enumerate(layers):
        # padding (and an empty micro-batch's one pad token): experts 0 .. k-1, first slots
        target = torch.arange(TOP_K).repeat(b, s, 1)
        slots = moe.first_slot[target]
        target[real] = routing[:, l].long()
        slots[real] = physical[:, l]
        moe.router.router_replay.set_target_indices(target.transpose(0, 1).reshape(s * b, TOP_K).to(mask.device))
        moe.router.router_replay.set_router_replay_action(actions.REPLAY_FORWARD)
        moe.set_physical(slots.transpose(0, 1).reshape(s * b, TOP_K).to(mask.device))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="token_kk+eplb")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seqs-per-rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--overlap-grad-reduce", action="store_true",
                    help="Megatron DDP's overlap_grad_reduce: gradients reduce-scattered during the "
                         "backward; replicas' gradients summed at each layer's readiness")
    ap.add_argument("--layer", choices=("routepack", "stock"), default="routepack",
                    help="routepack: RoutePackMoELayer over the plan's slots (replicas in a spare "
                         "slot per rank); stock: Megatron's MoELayer, the experts renumbered")
    ap.add_argument("--spec", choices=("local", "te"), default="local",
                    help="local: SequentialMLP experts (runs on CPU); te: Transformer Engine's "
                         "TEGroupedMLP (needs CUDA and transformer_engine; scripts/device-check.sh)")
    ap.add_argument("--load", default=None,
                    help="a --dump file: its logical state loaded before the first step")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda:
        import megatron_cpu
        megatron_cpu.apply()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from routepack.adapters.megatron_layer import reduce_replica_grads
    from routepack.adapters.megatron_migration import MegatronMigration, moe_layers
    from routepack.torch import DistributedScheduler, pack_microbatches

    config = config_for(world, args.layer)
    sched = DistributedScheduler(config, policy=args.policy, log_level=None)
    start = sched.initial_placement()
    if args.spec == "te" and not cuda:
        sys.exit("--spec te needs CUDA (Transformer Engine's grouped GEMMs)")
    mcfg, model = build(world, args.seed, start, args.layer, args.spec)
    ddp = DistributedDataParallel(mcfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, use_distributed_optimizer=True, bf16=False, clip_grad=0.0,
        weight_decay=0.0), [ddp])
    # Registers every expert's weights, main_grad and the optimizer's state of them.
    migration = MegatronMigration(sched, ddp, opt, group=ps.get_expert_model_parallel_group())
    if args.load:
        # a checkpoint in logical order loads at whatever placement this run starts from
        migration.load_logical_state_dict(torch.load(args.load)["state"])

    # The routing a rank's rollout took: Megatron's router, read at its output.
    routed = {}
    layers = moe_layers(ddp)

    def record(l):
        def hook(module, inputs, output):
            routed[l] = output[1].detach()     # routing_map [tokens, E]
        return hook
    for l, layer in enumerate(layers):
        layer.router.register_forward_hook(record(l))

    losses = []
    for step in range(args.steps):
        lens, tokens, owner = rollout_batch(step, world, args.seqs_per_rank, args.seed, VOCAB, 24)
        mine = np.nonzero(owner == rank)[0]
        inp, _, mask = batch_of(mine, tokens, device)
        with torch.no_grad():
            ddp(inp, torch.arange(inp.shape[1], device=device)[None].expand_as(inp), None)
        b, s = inp.shape
        keep = mask.bool().clone()
        keep[torch.arange(b), torch.as_tensor(lens[mine] - 1, device=device)] = True
        routing = []
        for l in range(len(layers)):
            ids = routed[l].view(s, b, EXPERTS).transpose(0, 1)[keep]   # [tokens, E] of real tokens
            meg = ids.nonzero()[:, 1].view(-1, TOP_K)
            # stock: the router's rows are in Megatron's order; RoutePackMoELayer's are logical
            routing.append(torch.as_tensor(migration.expert_order[l], device=device)[meg]
                           if args.layer == "stock" else meg)
        my_routing = torch.stack(routing, dim=1).to(torch.int32).cpu()

        res = sched.step(lens[mine], my_routing, mine, step=step)
        migration.execute(res)
        if args.layer == "routepack":
            # each micro-batch's tokens with their rollout routing, fetched from who rolled them out
            packed = pack_microbatches(res.microbatches, owner, lens, mine, {"routing": my_routing})

        ddp.zero_grad_buffer()
        opt.zero_grad()
        num_targets = float(np.sum(lens - 1))
        loss_sum = torch.zeros((), device=device)
        for m in range(len(res.microbatches[rank])):
            inp, labels, mask = batch_of(res.microbatches[rank][m], tokens, device)
            pos = torch.arange(inp.shape[1], device=device)[None].expand_as(inp)
            if args.layer == "routepack":
                replay_plan(layers, res, rank, m, packed[m]["routing"], mask, lens, RouterReplayAction)
            # DDP reduces gradients after the last micro-batch only (Megatron's no_sync_func);
            # with --overlap-grad-reduce during its backward, bucket by bucket
            last = m == len(res.microbatches[rank]) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                per_token = ddp(inp, pos, None, labels=labels)
                loss = (per_token * mask).sum()
                # DDP averages over the DP ranks: scaled so the update is the whole batch's mean
                (loss * world / num_targets).backward()
            loss_sum += loss.detach()
        if args.layer == "routepack":
            for moe in layers:       # the next rollout routes by itself
                moe.router.router_replay.set_router_replay_action(None)
                moe.set_physical(None)
            # replicas of an expert take the sum of their gradients, before DDP's reduction
            # (overlapped: the migration's hook did, as each layer's backward ended)
            if migration.overlapped_grads is None:
                reduce_replica_grads(layers, res.phy2log, ps.get_expert_model_parallel_group())
        finalize_model_grads([ddp])
        opt.step()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / num_targets)
        if rank == 0:
            print("step %d  policy %s  experts moved %d  replicated %d  loss %.6f"
                  % (step, res.policy_name, res.experts_moved,
                     int((np.asarray(res.logcnt) > 1).sum()) if res.logcnt is not None else 0,
                     losses[-1]), flush=True)

    state = migration.logical_state_dict()
    if rank == 0:
        if args.dump:
            torch.save({"losses": losses, "state": state}, args.dump)
        print("final loss %.9g" % losses[-1] if losses else "no step run", flush=True)
    end_run(sched, dist.get_backend())


if __name__ == "__main__":
    main()
