#!/usr/bin/env python3
"""A trainer-shaped loop around RoutePack: every step a (fake) rollout returns routing replay
per sequence, as vLLM/SGLang do for R3; RoutePack plans the step; the loop hands each rank
its microbatches and the EP dispatcher its log2phy, hot-swaps a policy mid-run, and prints
the predicted step time and any fallback. Only the model is fake.

    python examples/python/train_loop.py                       # examples/small.rpt, 12 steps
    python examples/python/train_loop.py --random --steps 20   # random routing instead
"""

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
try:
    import routepack
except ImportError:                      # run from a checkout without installing
    sys.path.insert(0, str(REPO / "python"))
    import routepack

# A policy written on the spot and staged mid-run: one that fails at plan time, to show
# that a bad swap leaves the running policy in place and says why.
BROKEN_POLICY = """
return {
  name = "broken_demo", version = "0.0.1", api = 1,
  description = "fails at plan time (hot-swap demo)",
  params = {},
  plan = function(ctx) error("this policy is broken on purpose") end,
}
"""


class FakeRollout:
    """Stands in for the inference engine: per step, the sequences' prompt and response
    lengths, group ids and routed experts, one (seq_len, layers, k) array per sequence."""

    def __init__(self, args, model):
        self.seed = args.seed
        self.model = model
        self.trace = None if args.random else routepack.TraceReader(args.trace)
        if self.trace is not None:
            info = self.trace.info(0)
            shape = (info["num_layers"], info["num_experts"], info["top_k"])
            want = (model.num_layers, model.num_experts, model.top_k)
            if shape != want:
                sys.exit("train_loop: %s has layers/experts/top-k %s, the config %s"
                         % (args.trace, shape, want))

    def generate(self, step):
        # Seeded per step, so a resumed run sees the same rollouts as the original.
        self.rng = np.random.default_rng((self.seed, step))
        if self.trace is not None:
            rec = self.trace[step % len(self.trace)]
            per_seq = rec.per_sequence()
            order = np.arange(rec.num_seqs)
            if step >= len(self.trace):          # later passes: shuffle the sequences
                order = self.rng.permutation(rec.num_seqs)
            return (rec.prompt_lens[order], rec.response_lens[order], rec.group_ids[order],
                    [per_seq[s] for s in order])
        m = self.model
        n = 32
        prompt = self.rng.integers(16, 256, size=n).astype(np.int32)
        response = self.rng.integers(1, 1024, size=n).astype(np.int32)
        groups = np.arange(n, dtype=np.int32) // 4
        hot = 1.0 / np.arange(1, m.num_experts + 1) ** 1.1
        out = []
        for p, r in zip(prompt, response):
            t = int(p + r)
            g = np.log(hot)[None, None, :] + self.rng.gumbel(size=(t, m.num_layers, m.num_experts))
            out.append(np.argsort(-g, axis=2)[:, :, :m.top_k].astype(np.uint8
                                                                    if m.num_experts <= 256
                                                                    else np.int32))
        return prompt, response, groups, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "config-small.json"))
    ap.add_argument("--trace", default=str(REPO / "examples" / "small.rpt"))
    ap.add_argument("--random", action="store_true", help="random routing, not the trace")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--policy", default=None, help="policy to start with (default: the config's)")
    ap.add_argument("--swap-to", default="token_kk+eplb",
                    help="policy name or file staged at --swap-at")
    ap.add_argument("--swap-at", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0, help="the DP rank this process plays")
    ap.add_argument("--checkpoint-at", type=int, default=8,
                    help="save the scheduler state after this step, then resume from it")
    args = ap.parse_args()

    sched = routepack.Scheduler(args.config, policy=args.policy)
    model = sched.config
    rollout = FakeRollout(args, model)
    rank = args.rank
    ep_rank = rank % model.ep_size
    print("RoutePack %s (%s); %d GPUs, EP %d, %d layers x %d experts, top-%d; this is rank %d"
          % (routepack.__version__, routepack.library_path(), model.num_gpus, model.ep_size,
             model.num_layers, model.num_experts, model.top_k, rank))
    print("%4s  %-28s %9s %9s %6s %4s %8s %7s  %s" % ("step", "policy", "pred_ms", "bound_ms",
                                                     "ratio", "mbs", "my_tok", "moved", "events"))
    checkpoint = None
    hashes = {}
    for step in range(args.steps):
        if step == args.swap_at - 2:
            sched.stage_policy(source=BROKEN_POLICY)          # refused at the next step
        if step == args.swap_at - 1:
            sched.stage_policy(path=args.swap_to, at_step=args.swap_at)   # name or file

        # 1. rollout: what the inference engine hands back for this step
        prompt, response, groups, routing = rollout.generate(step)

        # 2. RoutePack plans the step (the routing is borrowed for this call only)
        res = sched.step((prompt, response), routing, step=step, group_ids=groups,
                         physical=True)

        # 3. data loader: this rank's microbatches, sequence indices in order
        my_mbs = res.microbatches[rank]
        my_tokens = sum(int((prompt[mb] + response[mb]).sum()) for mb in my_mbs)

        # 4. MoE dispatcher: where each token-choice of this rank's first microbatch goes
        #    (physical ids from the C library's rp_remap; extra replica ids are numbered
        #    per microbatch and layer, so the EP rank lookup takes the microbatch)
        cu = res.cu_seqlens
        first = my_mbs[0] if len(my_mbs) else np.zeros(0, np.int32)
        tok = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in first]) if len(first) else \
            np.zeros(0, np.int64)
        dest = res.dispatch_ranks(res.physical_routing[tok], microbatch=0)
        local = float((dest == ep_rank).mean()) if dest.size else 0.0

        events = []
        if res.fallback:
            events.append("FALLBACK: " + res.fallback_reason)
        if res.swapped:
            events.append("swapped in %s %s" % (res.policy_name, res.policy_version))
        if res.swap_error:
            events.append("swap refused: " + res.swap_error)
        events.append("%.0f%% of mb0 stays on EP rank %d" % (100 * local, ep_rank))
        print("%4d  %-28s %9.3f %9.3f %6.3f %4d %8d %7d  %s"
              % (res.step, (res.policy_name + " " + res.policy_version)[:28],
                 res.step_time_s * 1e3, res.lower_bound_s * 1e3, res.ratio,
                 res.num_microbatches, my_tokens, res.experts_moved, "; ".join(events)))

        hashes[step] = res.plan_hash
        if step == args.checkpoint_at and routepack.can_checkpoint():
            checkpoint = sched.state_dict()      # saved beside the trainer's checkpoint

    if checkpoint is not None:
        # A restarted trainer: a new scheduler, the state from the checkpoint, the same
        # rollouts from there on: every plan must be the one the first run made.
        resumed = routepack.Scheduler(args.config, policy=args.policy)
        resumed.load_state_dict(checkpoint)
        same = True
        for step in range(resumed.next_step, args.steps):
            prompt, response, groups, routing = rollout.generate(step)
            res = resumed.step((prompt, response), routing, step=step, group_ids=groups)
            same &= res.plan_hash == hashes[step]
        print("resumed after step %d: steps %d-%d replanned, plans %s"
              % (args.checkpoint_at, args.checkpoint_at + 1, args.steps - 1,
                 "identical" if same else "DIFFERENT"))
        resumed.close()
        if not same:
            sys.exit(1)
    elif not routepack.can_checkpoint():
        print("(this libroutepack cannot save scheduler state: no checkpoint demo)")
    print("plan of the last step: %d bytes of plan JSON, hash %016x"
          % (len(sched.plan_json()), sched.last.plan_hash))
    sched.close()


if __name__ == "__main__":
    main()
