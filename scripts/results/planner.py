#!/usr/bin/env python3
"""The section "The planner against the per-forward balancer" of docs/results.md (issue 35):
the runs scripts/results.sh --planner lists in WORK/planner.tsv (one line a run: name,
config, gen settings, seed, steps, the `routepack simulate --json` file in WORK under the
config's trainer (routepack_torch), and the same trace's on Megatron-Core with its
balancer (megatron_balancer; "-" where the balancer cannot run), all tab-separated; config
and gen relative to ROOT), as markdown on stdout: routepack's own plan on its trainer
(`routepack:virtual_experts=false`) and routepack on the balancer's trainer (its packing
and placement with the balancer as its candidate) against token_kk+virtual_experts, the
EPLB family and the trainers' packings, each step's levers (replicas, shares, extras
fetched, bytes fetched ahead), the issue's "done when" figures, and the steps where the
balancer's plan still beats the planner's own with the term it wins on.
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
ON_BALANCER = "routepack on megatron_balancer"
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


def levers_table(run):
    """Each step's levers in the planner's own plan (simulate --json's per-step "levers")."""
    if OWN not in run.policies:
        return ""
    rows = ["| step | replicas | share sets | extra replicas | extras fetched | bytes fetched ahead |",
            "|---|---|---|---|---|---|"]
    for s in run.policies[OWN]["steps"]:
        m = s.get("levers")
        if not m:
            return ""
        rows.append("| %d | %d | %d | %d | %d | %.2f GB |" % (
            s["step"], m["replicas"], m["share_sets"], m["extra_replicas"], m["extras_fetched"],
            m["bytes_fetched_ahead"] / 1e9))
    return "Levers of `%s` (one EP group's):\n\n" % OWN + "\n".join(rows)


def mean_term(run, spec, term):
    steps = run.policies[spec]["steps"]
    return sum(st[term] for st in steps) / len(steps)


def why_lines(run):
    """Where the balancer's trainer still wins, or where packing for it gains under 1%: why,
    from the terms."""
    out = []
    groups = run.d["shape"]["num_gpus"] // run.d["shape"]["ep_size"]
    lead = faster(run, ON_BALANCER, OWN)
    if lead is not None and lead > 0:
        ahead = {t: mean_term(run, OWN, t) - mean_term(run, ON_BALANCER, t) for t in TERMS}
        term = max(ahead, key=ahead.get)
        out += ["`%s` is %.1f%% faster than `%s` on routepack_torch here, most on %s (%.1f vs %.1f ms a step): "
                "the balancer brings every EP group to its own mean every forward, while the plan's shares and "
                "extra replicas are one set per (microbatch, layer, expert)%s." % (
                    ON_BALANCER, 100 * lead, OWN, term[:-3].replace("_", " "), mean_term(run, ON_BALANCER, term),
                    mean_term(run, OWN, term),
                    " for all %d groups" % groups if groups > 1 else ""), ""]
    full = faster(run, ON_BALANCER, BALANCER)
    if full is not None and full < 0.01:
        out += ["On the balancer's trainer `%s` gains %.1f%% over %s: Megatron holds every expert once and the "
                "balancer does the rest, so the planner's levers there are its packing (attention %.1f vs %.1f ms "
                "a step) and its placement; its own levers win on its own trainer (%s)." % (
                    ON_BALANCER, 100 * full, BALANCER, mean_term(run, ON_BALANCER, "attention_ms"),
                    mean_term(run, BALANCER, "attention_ms"), fmt_pct(faster(run, OWN, BALANCER))), ""]
    return out


def load_runs(work):
    """(name, config, gen, seed, steps, Run) per manifest line, the balancer trainer's run
    merged into the config's (its routepack as ON_BALANCER)."""
    out = []
    for line in open(os.path.join(work, MANIFEST)):
        if not line.strip():
            continue
        row = line.rstrip("\n").split("\t")
        run = Run(os.path.join(work, row[5]))
        if len(row) > 6 and row[6] != "-":
            for spec, p in Run(os.path.join(work, row[6])).policies.items():
                run.policies[ON_BALANCER if spec == "routepack" else spec] = p
        out.append(tuple(row[:5]) + (run,))
    return out


def summary(work, root):
    """README's line: per run, the own plan against the balancer (and routepack on the
    balancer's trainer), or, cross-node, routepack against the best baseline."""
    parts = []
    for name, config, gen, seed, steps, run in load_runs(work):
        if BALANCER in run.policies:
            parts.append("%s: own plan %s vs %s (on the balancer's trainer %s)" % (
                name, fmt_pct(faster(run, OWN, BALANCER)), BALANCER, fmt_pct(faster(run, ON_BALANCER, BALANCER))))
        else:
            parts.append("%s: %s vs %s" % (name, fmt_pct(run.margin("routepack")), run.best_base))
    return "; ".join(parts)


def render(work, root):
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    out = [HEADING, "",
           "Rendered alone by `scripts/results.sh --planner` (commit %s, %s) on unseen seeds, priced end to end "
           "under the executor profiles (issue 30; predicted, not measured). Each config runs on its own trainer, "
           "`routepack_torch` (this project's layer: replicas, shares, extra replicas fetched once a step and "
           "ahead, no per-forward balancer), where `%s` is the shipped policy's own plan (`routepack` is the "
           "same there: that trainer cannot run the balancer, so there is no candidate); and, where the "
           "balancer can run (one node per EP group), the same trace on Megatron-Core with its balancer "
           "(`megatron_balancer`: every expert once per EP group), where %s runs and `%s` is the shipped "
           "policy packing for the balancer with the balancer as its candidate (on an expert ownership planned "
           "for the balancer's pushes where that pays, docs/routepack-policy.md). The migration the planner "
           "plans with is the one the executor is charged (docs/cost-model.md, \"Migration\")." % (
               commit, datetime.date.today().isoformat(), OWN, BALANCER, ON_BALANCER), ""]
    done = []
    for name, config, gen, seed, steps, run in load_runs(work):
        sh = run.d["shape"]
        out += ["### %s" % name, "",
                "`%s`, `%s` seed %s, %s steps; the planner's view: %d DP ranks, EP %d, %d layers x %d experts." % (
                    config, gen, seed, steps, sh["num_gpus"], sh["ep_size"], sh["num_layers"], sh["num_experts"]),
                "", table(run), "", levers_table(run), ""]
        if BALANCER in run.policies:
            own, full = faster(run, OWN, BALANCER), faster(run, ON_BALANCER, BALANCER)
            done.append("| %s | %s | %s | %s |" % (name, fmt_pct(own), fmt_pct(full),
                                                   "met" if own is not None and own >= 0 and full >= 0.01
                                                   else "not met"))
            out += why_lines(run)
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
            "| run | own plan (routepack_torch) vs %s | %s vs %s (cross-node: routepack vs the best "
            "baseline) | clause |" % (BALANCER, ON_BALANCER, BALANCER),
            "|---|---|---|---|"] + done + [
            "", "Clauses: without the candidate at least as fast as %s, with it at least 1%% faster; on a "
                "cross-node EP config at least 5%% faster than the best baseline that can run there." % BALANCER]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1], sys.argv[2]))
