#!/usr/bin/env python3
"""A RoutePack plan handed to verl's actor (docs/adapters.md): the rollout batch reordered
so that DataProto.chunk(dp_size) gives each DP rank the plan's sequences, and each rank's
micro-batches as the index lists verl's rearrange_micro_batches returns.

verl itself is not needed: a dict of numpy arrays stands in for the DataProto, and
np.split for DataProto.chunk (equal consecutive parts, as verl/protocol.py splits).

    python examples/adapters/verl_batch.py        # examples/config-small.json + small.rpt
    python examples/adapters/verl_batch.py --policy verl_kk+eplb --microbatches 4
    python examples/adapters/verl_batch.py --mini-batches 2 --microbatches 4   # 2 optimizer steps
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
try:
    import routepack
except ImportError:                      # run from a checkout without installing
    sys.path.insert(0, str(REPO / "python"))
    import routepack
from routepack.adapters import verl

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--policy", default="routepack")
ap.add_argument("--microbatches", type=int, default=2, help="limits.num_microbatches")
ap.add_argument("--step", type=int, default=2, help="which step of examples/small.rpt")
ap.add_argument("--mini-batches", type=int, default=1,
                help="trainer.mini_batches: optimizer steps per rollout batch (verl's chunk over "
                     "ppo_mini_batch_size); --microbatches must be a multiple")
args = ap.parse_args()

# verl's constraints, as the trainer section states them: every DP rank the same count,
# every micro-batch a sequence.
config = json.loads((REPO / "examples" / "config-small.json").read_text())
config["policy"]["search_path"] = [str(REPO / "policies")]
config["trainer"] = {"equal_sequences_per_rank": True, "nonempty_microbatches": True}
config["trainer"]["mini_batches"] = args.mini_batches
config["limits"]["num_microbatches"] = args.microbatches

with routepack.TraceReader(REPO / "examples" / "small.rpt") as trace:
    rollout = trace[args.step]
    # The rollout batch as the single controller holds it (one row per sequence).
    batch = {"seq_len": np.array(rollout.seq_lens), "uid": np.array(rollout.group_ids)}
    with routepack.Scheduler(config, policy=args.policy) as sched:
        res = sched.step(rollout.seq_lens, rollout.routing, group_ids=rollout.group_ids)

try:
    plan = verl.batch_plan(res, order="batch")
except routepack.PlanError as e:         # what verl cannot run, e.g. an empty micro-batch
    sys.exit("verl cannot run this plan: %s" % e)

# Driver, instead of verl's _balance_batch: batch.reorder(torch.as_tensor(plan.order)).
batch = {k: v[plan.order] for k, v in batch.items()}
# Dispatch: DataProto.chunk(dp_size) splits into equal consecutive chunks.
chunks = {k: np.split(v, plan.dp_size) for k, v in batch.items()}

print("%d sequences, %d DP ranks x %d micro-batches, %d sequences per rank"
      % (res.num_seqs, plan.dp_size, plan.num_micro_batches, plan.sequences_per_rank))
for rank in range(plan.dp_size):
    local_lens = chunks["seq_len"][rank]
    # Actor, instead of rearrange_micro_batches: the plan's index lists.
    micro = plan.micro_batch_indices[rank]
    tokens = [int(local_lens[idx].sum()) for idx in micro]
    assert tokens == plan.micro_batch_tokens[rank].tolist() == res.microbatch_tokens(rank)
    # Outputs come back in micro-batch order; get_reverse_idx's list puts them back.
    outputs = np.concatenate([local_lens[idx] for idx in micro])
    assert (outputs[plan.reverse_indices(rank)] == local_lens).all()
    print("rank %d: micro-batches %s, tokens %s" % (rank, micro, tokens))

# Actor with mini-batches: data.split(ppo_mini_batch_size) hands it consecutive parts of its
# chunk, and it rearranges each into micro-batches; the plan's lists per mini-batch.
for rank in range(plan.dp_size):
    local_lens = chunks["seq_len"][rank]
    size = plan.mini_batch_size
    for k in range(plan.num_mini_batches):
        mini = local_lens[k * size:(k + 1) * size]
        micro = plan.mini_batch_indices[rank][k]
        outputs = np.concatenate([mini[idx] for idx in micro])
        assert (outputs[plan.reverse_indices(rank, k)] == mini).all()
        if plan.num_mini_batches > 1:
            print("rank %d mini-batch %d: micro-batches %s, tokens %s"
                  % (rank, k, micro, [int(mini[idx].sum()) for idx in micro]))

print("ok: every rank's chunk holds its plan sequences; token sums match the plan")
