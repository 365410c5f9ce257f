#!/usr/bin/env python3
"""The section "Parallel layouts (TP/ETP, PP/VPP)" of docs/results.md (issue 19): the runs
layout-NAME.json that scripts/results.sh leaves in its work folder (`routepack simulate
--json` with the default policies on examples/config-NAME.json and
examples/gen-qwen3-30b-tp4.json), one table per layout, as markdown on stdout.
Usage: scripts/results/layouts.py WORK ROOT

The layout (TP, ETP, EP, PP, VPP, schedule) is read from the config each run names
(relative to ROOT when the path is relative): the simulate JSON's shape is the planner's
view, DP ranks, not the trainer's GPUs."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import DEFAULTS, Run, fmt_pct, label  # noqa: E402  (scripts/results.py)

HEADING = "## Parallel layouts (TP/ETP, PP/VPP)"


def layout(topo):
    """The layout a config's topology names, with docs/config.md's defaults filled in."""
    tp = topo.get("tensor_parallel_size", 1)
    etp = topo.get("expert_tensor_parallel_size", tp)
    pp = topo.get("pipeline_parallel_size", 1)
    vpp = topo.get("virtual_pipeline_size", 1)
    ep = topo.get("ep_size")
    if pp == 1:
        schedule = "none (PP 1)"
    else:
        schedule = topo.get("pipeline_schedule", "interleaved" if vpp > 1 else "1f1b")
    gpus = topo["num_nodes"] * topo["gpus_per_node"]
    return ("TP %s, ETP %d, EP %s, PP %d, VPP %d, schedule %s; %d GPUs (%d nodes x %d)"
            % ("%d x CP %d" % (tp, topo["context_parallel_size"]) if topo.get("context_parallel_size", 1) > 1 else tp,
               etp, ep if ep is not None else "default", pp, vpp, schedule, gpus, topo["num_nodes"],
               topo["gpus_per_node"]))


def table(run):
    rows = ["| policy | step ms | step/sLB | migration ms | step + migration ms | vs best baseline | fell back |",
            "|---|---|---|---|---|---|---|"]
    for spec in DEFAULTS + [s for s in run.policies if s not in DEFAULTS]:
        p = run.policies.get(spec)
        if not p:
            continue
        name = label(spec) + (" (best baseline)" if spec == run.best_base else "")
        rows.append("| %s | %.3f | %.3f | %.3f | %.3f | %s | %s |" % (
            name, p["step_ms"], p["shared"], p["mig_ms"], p["total_ms"] / run.steps, fmt_pct(run.margin(spec)),
            "-" if p["baseline"] else "%d of %d steps" % (p["fallbacks"], run.steps)))
    return "\n".join(rows)


def render(work, root):
    """The section's markdown, or None where WORK holds no layout run."""
    names = sorted(f for f in os.listdir(work) if f.startswith("layout-") and f.endswith(".json"))
    if not names:
        return None
    out = [HEADING, "",
           "The Megatron layouts of the Qwen3-30B-A3B examples (issue 19): the DP rank is a TP group,",
           "expert GEMMs split over ETP, and under PP each stage holds its own layers and placement",
           "while microbatches flow through the stages in the schedule's order (docs/config.md,",
           "docs/cost-model.md). Each run: `routepack simulate --config C --gen",
           "examples/gen-qwen3-30b-tp4.json --json` with the default policies, from the repository",
           "root. Under PP the cost model prices each plan's microbatch order: `verl_kk+eplb` runs them",
           "in verl 0.6.1's order (light microbatches at both ends of the pipeline), the other baselines",
           "in the order their packing writes (docs/baselines.md), `routepack` in the order it chooses",
           "for a short critical path (docs/routepack-policy.md). *step/sLB*, *vs best baseline*: as in",
           "\"Step + migration against the best baseline\" above. *fell back*: the steps on which",
           "`routepack` returned a baseline's plan instead of its own.", ""]
    runs = []
    for f in names:
        r = Run(os.path.join(work, f))
        path = r.d["config"]
        full = path if os.path.isabs(path) else os.path.join(root, path)
        with open(full) as c:
            topo = json.load(c)["topology"]
        runs.append((topo.get("pipeline_parallel_size", 1), topo.get("virtual_pipeline_size", 1), f, r, topo))
    for _, _, _, r, topo in sorted(runs, key=lambda t: t[:3]):
        sh, inp = r.d["shape"], r.d["input"]
        out += ["### %s" % os.path.basename(r.d["config"]), "", layout(topo) + ".", "",
                "%s, %d steps. The planner's view: %d DP ranks in EP groups of %d DP ranks, %d layers x %d "
                "experts, top-%d." % (os.path.basename(inp["path"]), inp["steps"], sh["num_gpus"], sh["ep_size"],
                                      sh["num_layers"], sh["num_experts"], sh["top_k"]), "",
                table(r), "", "`%s`" % r.d["verdict"]["text"], ""]
    return "\n".join(out).rstrip("\n")


def main():
    text = render(sys.argv[1], sys.argv[2])
    if text:
        print(text)


if __name__ == "__main__":
    main()
