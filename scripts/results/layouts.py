#!/usr/bin/env python3
"""The section "Parallel layouts (TP/ETP, PP/VPP)" of docs/results.md (issue 19): the runs
scripts/results.sh lists in WORK/layouts.tsv (one line a run: layout name, config, gen
settings, seed, steps, the `routepack simulate --json` file in WORK, all tab-separated;
config and gen relative to ROOT), every seed of a layout pooled into one table, as markdown
on stdout.
Usage: scripts/results/layouts.py WORK ROOT

The layout (TP, ETP, EP, PP, VPP, schedule) is read from the config each run names: the
simulate JSON's shape is the planner's view, DP ranks, not the trainer's GPUs. The list of
layouts lives in scripts/results.sh (LAYOUTS): a layout is one line there."""
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import DEFAULTS, Run, fmt_pct, label  # noqa: E402  (scripts/results.py)

HEADING = "## Parallel layouts (TP/ETP, PP/VPP)"
MANIFEST = "layouts.tsv"


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


class Pooled:
    """The runs of one layout (one a seed), pooled: every step of every seed counts once."""

    def __init__(self, runs):
        self.runs = runs  # [(seed, Run)]
        self.steps = sum(r.steps for _, r in runs)
        specs = [s for s in runs[0][1].policies if all(s in r.policies for _, r in runs)]
        self.policies = {}
        for spec in specs:
            ps = [r.policies[spec] for _, r in runs]
            steps = [s for p in ps for s in p["steps"]]
            self.policies[spec] = {
                "total_ms": sum(p["total_ms"] for p in ps),
                "step_ms": sum(s["step_ms"] for s in steps) / len(steps),
                "mig_ms": sum(s["migration_ms"] for s in steps) / len(steps),
                "shared": sum(s["shared_ratio"] for s in steps) / len(steps),
                "fallbacks": sum(p["fallbacks"] for p in ps),
                "baseline": ps[0]["baseline"],
            }
        # the baseline fastest over every seed's steps (a seed's verdict may name another)
        bases = [s for s, p in self.policies.items() if p["baseline"]]
        self.best_base = min(bases, key=lambda s: self.policies[s]["total_ms"]) if bases else None

    def margin(self, spec):
        """How much faster than the pooled best baseline on step + migration (+0.031: 3.1%)."""
        if spec not in self.policies or not self.best_base:
            return None
        return self.policies[self.best_base]["total_ms"] / self.policies[spec]["total_ms"] - 1


def table(pooled):
    seeds = ", ".join("seed %s" % seed for seed, _ in pooled.runs)
    rows = ["| policy | step ms | step/sLB | migration ms | step + migration ms | vs best baseline | per seed (%s) "
            "| fell back |" % seeds,
            "|---|---|---|---|---|---|---|---|"]
    for spec in DEFAULTS + [s for s in pooled.policies if s not in DEFAULTS]:
        p = pooled.policies.get(spec)
        if not p:
            continue
        name = label(spec) + (" (best baseline)" if spec == pooled.best_base else "")
        per_seed = " / ".join(fmt_pct(r.margin(spec)) for _, r in pooled.runs)
        rows.append("| %s | %.3f | %.3f | %.3f | %.3f | %s | %s | %s |" % (
            name, p["step_ms"], p["shared"], p["mig_ms"], p["total_ms"] / pooled.steps, fmt_pct(pooled.margin(spec)),
            per_seed, "-" if p["baseline"] else "%d of %d steps" % (p["fallbacks"], pooled.steps)))
    return "\n".join(rows)


def read_manifest(work):
    """{layout name: {"config", "gen", "runs": [(seed, steps, json path)]}} in the list's order."""
    layouts = {}
    with open(os.path.join(work, MANIFEST)) as f:
        for line in f:
            if not line.strip():
                continue
            name, config, gen, seed, steps, path = line.rstrip("\n").split("\t")
            entry = layouts.setdefault(name, {"config": config, "gen": gen, "runs": []})
            entry["runs"].append((seed, int(steps), os.path.join(work, path)))
    return layouts


def commit_of(root):
    """The commit the section is rendered at (a splice leaves the rest of the file at its own)."""
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def render(work, root, commit=None):
    """The section's markdown, or None where WORK lists no layout run."""
    if not os.path.exists(os.path.join(work, MANIFEST)):
        return None
    layouts = read_manifest(work)
    if not layouts:
        return None
    out = [HEADING, "",
           "Rendered at commit %s (%s) by `scripts/results.sh --layouts`, which can run it alone."
           % (commit or commit_of(root), datetime.date.today().isoformat()), "",
           "The Megatron layouts of the examples (issue 19): the DP rank is a TP group, expert GEMMs",
           "split over ETP, and under PP each stage holds its own layers and placement while",
           "microbatches flow through the stages in the schedule's order (docs/config.md,",
           "docs/cost-model.md); a migration moves each layer's experts between the GPUs of its",
           "stage, the stages at once (docs/migration.md, \"Pipeline stages\"). Each run: `routepack",
           "trace gen GEN --seed S --steps N`, then `routepack simulate --config C --trace T --json`",
           "with the default policies, from the repository root; a layout's seeds are pooled (every",
           "step of every seed counts once). Under PP the cost model prices each plan's microbatch",
           "order: `verl_kk+eplb` runs them in verl 0.6.1's order (light microbatches at both ends of",
           "the pipeline), the other baselines in the order their packing writes (docs/baselines.md),",
           "`routepack` in the order it chooses for a short critical path",
           "(docs/routepack-policy.md). *step/sLB*: as in \"Step + migration against the best",
           "baseline\" above. *vs best baseline*: step + migration over every seed's steps against the",
           "baseline fastest over them; *per seed*: against each seed's own best baseline. *fell",
           "back*: the steps on which `routepack` returned a baseline's plan instead of its own.", ""]
    for name, entry in layouts.items():
        runs = [(seed, Run(path)) for seed, _, path in entry["runs"]]
        pooled = Pooled(runs)
        config = entry["config"]
        with open(config if os.path.isabs(config) else os.path.join(root, config)) as c:
            conf = json.load(c)
        topo, trainer = conf["topology"], conf.get("trainer", {})
        # mini-batches and epochs (trainer.mini_batches, trainer.epochs) are named where set
        batches = [("%d mini-batches" % trainer["mini_batches"]) if trainer.get("mini_batches", 1) > 1 else "",
                   ("%d epochs" % trainer["epochs"]) if trainer.get("epochs", 1) > 1 else ""]
        batches = ", ".join(b for b in batches if b)
        sh = runs[0][1].d["shape"]
        steps = sorted({n for _, n, _ in entry["runs"]})
        out += ["### %s" % os.path.basename(config), "", layout(topo) + (" (%s a rollout batch)" % batches if batches else "") + ".", "",
                "%s, seeds %s, %s steps each. The planner's view: %d DP ranks in EP groups of %d DP ranks, "
                "%d layers x %d experts, top-%d." % (
                    os.path.basename(entry["gen"]), ", ".join(seed for seed, _, _ in entry["runs"]),
                    "/".join(str(n) for n in steps), sh["num_gpus"], sh["ep_size"], sh["num_layers"],
                    sh["num_experts"], sh["top_k"]), "",
                table(pooled), ""]
        out += ["`seed %s: %s`" % (seed, r.d["verdict"]["text"]) for seed, r in runs]
        out.append("")
        why = fallback_reasons(runs)
        if why:
            out += ["Why `routepack` fell back: " + "; ".join("%s (%d step%s)" % (text, n, "" if n == 1 else "s")
                                                             for text, n in why) + ".", ""]
    return "\n".join(out).rstrip("\n")


def fallback_reasons(runs, spec="routepack"):
    """[(reason, steps)] of SPEC's fallbacks over every run, most frequent first."""
    counts = {}
    for _, r in runs:
        for s in r.policies.get(spec, {}).get("steps", []):
            if s.get("fallback"):
                text = (s.get("fallback_reason") or "no reason given").rstrip(".")
                counts[text] = counts.get(text, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def summary(work, root):
    """One line for README's Results: routepack against the pooled best baseline per layout."""
    if not os.path.exists(os.path.join(work, MANIFEST)):
        return None
    parts = []
    for name, entry in read_manifest(work).items():
        pooled = Pooled([(seed, Run(path)) for seed, _, path in entry["runs"]])
        fell = pooled.policies.get("routepack", {}).get("fallbacks", 0)
        parts.append("%s %s (vs %s%s)" % (os.path.basename(entry["config"]), fmt_pct(pooled.margin("routepack")),
                                          pooled.best_base, "; routepack fell back at %d of %d steps"
                                          % (fell, pooled.steps) if fell else ""))
    return "; ".join(parts)


def main():
    text = render(sys.argv[1], sys.argv[2])
    if text:
        print(text)


if __name__ == "__main__":
    main()
