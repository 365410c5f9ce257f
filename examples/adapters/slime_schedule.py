#!/usr/bin/env python3
"""A RoutePack plan handed to slime's trainer (docs/adapters.md): the four results of
slime's build_dp_schedule (partitions, micro_batch_indices, num_microbatches,
global_batch_sizes), which RolloutManager._split_train_data_by_dp packages per DP rank.

slime itself is not needed: a dict of numpy arrays stands in for the rollout data, and the
loop below does what _split_train_data_by_dp does with the schedule.

    python examples/adapters/slime_schedule.py                     # routepack, 2 micro-batches a rank
    python examples/adapters/slime_schedule.py --policy slime_ff+eplb   # slime's own packing
    python examples/adapters/slime_schedule.py --mini-batches 2 --microbatches 4   # 2 optimizer steps
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
from routepack.adapters import slime

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--policy", default="routepack")
ap.add_argument("--microbatches", type=int, default=2, help="limits.num_microbatches")
ap.add_argument("--step", type=int, default=2, help="which step of examples/small.rpt")
ap.add_argument("--mini-batches", type=int, default=1,
                help="trainer.mini_batches: optimizer steps per rollout batch (slime's "
                     "num_steps_per_rollout); --microbatches must be a multiple")
args = ap.parse_args()

# slime's trainer: every micro-batch holds a sample; ranks may run different sample counts
# (slime deals micro-batches, not samples), so no equal_sequences_per_rank.
config = json.loads((REPO / "examples" / "config-small.json").read_text())
config["policy"]["search_path"] = [str(REPO / "policies")]
config["trainer"] = {"nonempty_microbatches": True, "mini_batches": args.mini_batches}
config["limits"]["num_microbatches"] = args.microbatches

with routepack.TraceReader(REPO / "examples" / "small.rpt") as trace:
    rollout = trace[args.step]
    # The rollout data as slime's RolloutManager holds it (one row per sample). A slime
    # rollout is one sample unless a multi-turn agent emits several (samples[i].rollout_id);
    # a prompt's responses are separate rollouts, their advantages computed before training.
    data = {"total_lengths": np.array(rollout.seq_lens), "rollout_ids": np.arange(len(rollout.seq_lens))}
    with routepack.Scheduler(config, policy=args.policy) as sched:
        res = sched.step(rollout.seq_lens, rollout.routing, group_ids=rollout.group_ids)

try:
    schedule = slime.dp_schedule(res, rollout_ids=data["rollout_ids"])
except routepack.PlanError as e:         # what slime cannot run, e.g. an empty micro-batch
    sys.exit("slime cannot run this plan: %s" % e)

# Instead of build_dp_schedule(...) in _split_train_data_by_dp:
partitions, micro_batch_indices, num_microbatches, global_batch_sizes = schedule.as_tuple()
print("%d samples, %d DP ranks, %s micro-batches a rank per optimizer step, %s rollouts per step"
      % (res.num_seqs, len(partitions), num_microbatches, global_batch_sizes))
for r, partition in enumerate(partitions):
    rank_data = {k: v[partition] for k, v in data.items()}   # rollout_data[key] = [data[key][j] for j in partition]
    mbs = micro_batch_indices[r]
    assert [i for mb in mbs for i in mb] == list(range(len(partition)))
    tokens = [int(rank_data["total_lengths"][mb].sum()) for mb in mbs]
    assert tokens == res.microbatch_tokens(r)
    print("rank %d: %d samples, micro-batches %s, tokens %s" % (r, len(partition), mbs, tokens))
print("ok: every sample once, every rank %s micro-batches, token sums match the plan" % num_microbatches)
