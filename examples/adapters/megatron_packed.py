#!/usr/bin/env python3
"""A RoutePack plan handed to Megatron-Core (docs/adapters.md): each DP rank's micro-batches
as THD PackedSeqParams (each sequence padded to the TP size for sequence parallelism), and
each MoE layer's placement as the expert permutation stock MoELayer runs: router rows in
Megatron's order, replayed top-k ids renumbered, the experts each EP rank holds.

Megatron-Core is used when it is installed (megatron.core.packed_seq_params); otherwise
the fields come back as dicts. Needs torch.

    python examples/adapters/megatron_packed.py            # TP 2, ETP 1, EP 8 on one node
    python examples/adapters/megatron_packed.py --policy routepack   # replicas: dropped
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    import routepack
except ImportError:                      # run from a checkout without installing
    sys.path.insert(0, str(REPO / "python"))
    import routepack
from routepack.adapters import megatron

try:
    from megatron.core.packed_seq_params import PackedSeqParams
except ImportError:
    PackedSeqParams = None

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--policy", default="token_kk+eplb",
                help="a policy whose placement stock Megatron can hold (default), or one with "
                     "replicas, which are dropped with a report")
args = ap.parse_args()

# config-small's node in the Megatron layout: TP 2 (sequence parallel), ETP 1, EP 8, so 4
# DP ranks of 2 GPUs, each holding 2 EP ranks of 8 experts (no spare slots).
config = json.loads((REPO / "examples" / "config-small.json").read_text())
config["policy"]["search_path"] = [str(REPO / "policies")]
config["topology"].update(tensor_parallel_size=2, expert_tensor_parallel_size=1, ep_size=8,
                          slots_per_gpu=8)
config["trainer"] = {"equal_sequences_per_rank": True}
if args.policy == "routepack":
    config["topology"]["slots_per_gpu"] = 10          # spare slots: the plan replicates

with routepack.TraceReader(REPO / "examples" / "small.rpt") as trace:
    rollout = trace[0]
    with routepack.Scheduler(config, policy=args.policy) as sched:
        res = sched.step(rollout.seq_lens, rollout.routing, group_ids=rollout.group_ids)
    routing = np.array(rollout.routing)                  # [tokens, layers, k], logical ids

print("%s: %d DP ranks (TP %d), %d micro-batches; Megatron EP %d"
      % (res.policy_name, res.num_gpus, res.config.tensor_parallel_size, res.num_microbatches,
         res.config.expert_parallel_size))

# Packing: one PackedSeqParams per micro-batch of each DP rank (every rank of its TP group
# passes the same), in the order routepack.torch.pack_microbatches concatenates tokens.
for rank in range(res.num_gpus):
    params = megatron.packed_seq_params(res, rank, cls=PackedSeqParams)
    for m, p in enumerate(params):
        p = p if isinstance(p, dict) else vars(p)
        assert int(p["cu_seqlens_q"][-1]) == res.microbatch_tokens(rank)[m]
        assert int(p["cu_seqlens_q_padded"][-1]) % 2 == 0
    first = params[0] if isinstance(params[0], dict) else vars(params[0])
    print("rank %d mb 0: cu_seqlens_q %s, padded %s, max_seqlen %d"
          % (rank, first["cu_seqlens_q"].tolist(), first["cu_seqlens_q_padded"].tolist(),
             first["max_seqlen_q"]))

# Placement: refuse what stock Megatron cannot hold, or drop it when asked.
try:
    placement = megatron.expert_placement(res)
except routepack.NotSupportedError as e:
    print("refused: %s" % str(e)[:160])
    placement = megatron.expert_placement(res, drop=True)
    d = placement.dropped
    print("dropped: %d replicas, %d extra replicas, %d share sets, %d empty slots; "
          "%d experts moved" % (d.replicas, d.extra_replicas, d.share_sets, d.empty_slots,
                                int(d.moved.sum())))

layer, hidden = 0, 16
router = torch.randn(res.num_experts, hidden)              # logical order, as trained so far
x = torch.randn(len(routing), hidden)
megatron_router = router[torch.as_tensor(placement.expert_order[layer])]
topk = torch.as_tensor(routing[:, layer, :], dtype=torch.int64)
ids = placement.to_megatron(topk, layer)
# RouterReplay gathers the router's scores at the replayed ids: the same scores either way.
assert torch.equal((x @ megatron_router.T).gather(1, ids), (x @ router.T).gather(1, topk))
for ep_rank in range(placement.expert_parallel_size):
    held = placement.local_experts(layer, ep_rank).tolist()
    local = placement.local_expert_indices(ep_rank)
    print("layer %d EP rank %d: Megatron experts %d-%d hold %s"
          % (layer, ep_rank, local[0], local[-1], held))
contiguous = np.tile(np.arange(res.num_experts), (res.num_layers, 1))
start = megatron.ExpertPlacement(contiguous, contiguous, placement.expert_parallel_size,
                                 placement.dropped)
print("from the contiguous start: %d experts change EP rank" % len(placement.moves_from(start)))
print("ok: PackedSeqParams match the plan's micro-batches; the renumbered router routes alike")
