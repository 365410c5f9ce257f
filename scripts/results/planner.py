#!/usr/bin/env python3
"""The section "The planner against the per-forward balancer" of docs/results.md (issue 35):
the runs scripts/results.sh --planner lists in WORK/planner.tsv (one line a run: name,
config, gen settings, seed, steps, the `routepack simulate --json` file in WORK, all
tab-separated; config and gen relative to ROOT), as markdown on stdout: routepack with and
without the balancer's candidate (`routepack:virtual_experts=false`) against
token_kk+virtual_experts, the EPLB family and the trainers' packings, the issue's "done
when" figures, and the steps where the balancer's plan still beats the planner's own with
the term it wins on.
Usage: scripts/results/planner.py WORK ROOT"""
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import Run, fmt_pct, table  # noqa: E402  (scripts/results.py)

HEADING = "## The planner against the per-forward balancer (issue 35)"
MANIFEST = "planner.tsv"
OWN = "routepack:virtual_experts=false"
BALANCER = "token_kk+virtual_experts"
TERMS = ("attention_ms", "dispatch_ms", "expert_ms", "combine_ms", "grad_reduce_ms", "extra_copy_ms")


def faster(run, spec, other):
    """How much faster SPEC is than OTHER on step + migration (+0.01: 1%), or None."""
    if spec not in run.policies or other not in run.policies:
        return None
    return run.policies[other]["total_ms"] / run.policies[spec]["total_ms"] - 1


def balancer_wins(run):
    """The steps where the balancer's plan beats the planner's own on step + migration,
    each with the term (of TERMS and migration) the balancer's plan is most ahead on."""
    if OWN not in run.policies or BALANCER not in run.policies:
        return []
    out = []
    for mine, theirs in zip(run.policies[OWN]["steps"], run.policies[BALANCER]["steps"]):
        gap = (mine["step_ms"] + mine["migration_ms"]) - (theirs["step_ms"] + theirs["migration_ms"])
        if gap <= 0:
            continue
        ahead = {t: mine[t] - theirs[t] for t in TERMS}
        ahead["migration_ms"] = mine["migration_ms"] - theirs["migration_ms"]
        term = max(ahead, key=ahead.get)
        out.append((mine["step"], gap, term[:-3].replace("_", " "), ahead[term]))
    return out


def render(work, root):
    rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(work, MANIFEST)) if line.strip()]
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    out = [HEADING, "",
           "Rendered alone by `scripts/results.sh --planner` (commit %s, %s) on unseen seeds. `%s` is the "
           "shipped policy without the balancer's candidate (its own placement, replicas, shares and extra "
           "replicas); `routepack` may also return the balancer's plan with its packing. The migration the "
           "planner plans with is the one the executor is charged (docs/cost-model.md, \"Migration\"). "
           "Under this model's defaults, not yet the executor profiles of issue 30." % (
               commit, datetime.date.today().isoformat(), OWN), ""]
    done = []
    for name, config, gen, seed, steps, path in rows:
        run = Run(os.path.join(work, path))
        sh = run.d["shape"]
        out += ["### %s" % name, "",
                "`%s`, `%s` seed %s, %s steps; the planner's view: %d DP ranks, EP %d, %d layers x %d experts." % (
                    config, gen, seed, steps, sh["num_gpus"], sh["ep_size"], sh["num_layers"], sh["num_experts"]),
                "", table(run), ""]
        if BALANCER in run.policies:
            own, full = faster(run, OWN, BALANCER), faster(run, "routepack", BALANCER)
            done.append("| %s | %s | %s | %s |" % (name, fmt_pct(own), fmt_pct(full),
                                                   "met" if own is not None and own >= 0 and full >= 0.01
                                                   else "not met"))
            choice = faster(run, OWN, "routepack")
            if choice is not None and choice > 0:
                out += ["`routepack` is %.1f%% slower than `%s` here: the choice between the two candidates "
                        "(its own plan or the balancer's), not the levers, loses it." % (100 * choice, OWN), ""]
            wins = balancer_wins(run)
            if wins:
                out += ["Steps where %s beats `%s` on step + migration (the term it is most ahead on): %s." % (
                    BALANCER, OWN, "; ".join("step %d by %.3f ms (%s, %.3f ms)" % w for w in wins)), ""]
            else:
                out += ["`%s` is at least as fast as %s on every step." % (OWN, BALANCER), ""]
        else:
            best = run.best_base
            margin = run.margin("routepack")
            done.append("| %s (cross-node; the balancer cannot run) | - | %s vs %s | %s |" % (
                name, fmt_pct(margin), best, "met" if margin is not None and margin >= 0.05 else "not met"))
    out += ["### Done when", "",
            "| run | own plan vs %s | routepack vs %s (cross-node: vs the best baseline) | clause |" % (
                BALANCER, BALANCER),
            "|---|---|---|---|"] + done + [
            "", "Clauses: without the candidate at least as fast as %s, with it at least 1%% faster; on a "
                "cross-node EP config at least 5%% faster than the best baseline that can run there." % BALANCER]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1], sys.argv[2]))
