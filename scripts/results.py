#!/usr/bin/env python3
"""Render docs/results.md and README.md's Results section from the measurements that
scripts/results.sh leaves in its work folder (simulate --json files, bench markdown).
Usage: scripts/results.py WORK ROOT [--long N] [--reference] [--bench SCALE]
       scripts/results.py WORK ROOT --splice NAME
--splice puts WORK/section-NAME.md alone into the existing docs/results.md where a full
render would put it (replacing that section if it is there), leaving the rest as it is;
--splice overhead does the same with the section rendered from WORK/bench-overhead.out
("Planning overhead per rank") and README's sentence on it.

Everything printed is computed from those files; the prose that does not depend on
numbers lives in scripts/results/notes.md. To add a section: append a function to
SECTIONS that takes the Run set and returns markdown (or None to leave it out)."""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

DEFAULTS = ["token_kk+contiguous", "token_kk+eplb", "token_kk+eplb_periodic", "verl_kk+eplb", "attn_kk+eplb",
            "slime_ff+eplb", "slime_kk+eplb", "token_kk+virtual_experts", "routepack"]


def label(spec):
    """A policy spec as the tables show it: a sweep file by its variant name."""
    base = os.path.basename(spec)
    if base.endswith(".lua"):
        return base[:-4]
    return spec


class Run:
    def __init__(self, path):
        self.name = os.path.basename(path)[:-5]
        with open(path) as f:
            self.d = json.load(f)
        self.steps = self.d["verdict"]["steps"]
        self.policies = {}
        for p in self.d["policies"]:
            if p["status"] == "failed":
                continue
            steps = p["steps"][: self.steps]
            # end to end (issue 30): the MoE layers, the rest of the step, the migration
            total = sum(s.get("end_to_end_ms", s["step_ms"] + s["migration_ms"]) for s in steps)
            self.policies[p["policy"]] = {
                "raw": p,
                "steps": steps,
                "total_ms": total,
                "step_ms": sum(s["step_ms"] for s in steps) / len(steps),
                "mig_ms": sum(s["migration_ms"] for s in steps) / len(steps),
                "ratio": sum(s["ratio"] for s in steps) / len(steps),
                "shared": sum(s["shared_ratio"] for s in steps) / len(steps),
                "bytes": sum(s["migration_bytes"] for s in steps) / len(steps),
                "fallbacks": sum(1 for s in steps if s["fallback"]),
                "baseline": p["summary"]["baseline"],
            }
        self.best_base = self.d["verdict"]["best_baseline"]

    def margin(self, spec):
        """How much faster than the best baseline end to end, step + migration (+0.031: 3.1%)."""
        if spec not in self.policies or not self.best_base:
            return None
        return self.policies[self.best_base]["total_ms"] / self.policies[spec]["total_ms"] - 1

    def describe(self):
        inp = self.d["input"]
        sh = self.d["shape"]
        return "%s, %s %s, %d steps; %d GPUs, EP %d, %d layers x %d experts" % (
            os.path.basename(self.d["config"]), inp["kind"], os.path.basename(inp["path"]), inp["steps"],
            sh["num_gpus"], sh["ep_size"], sh["num_layers"], sh["num_experts"])


def fmt_pct(x):
    return "-" if x is None else "%+.1f%%" % (100 * x)


def table(run, order=None):
    rows = ["| policy | step ms | step/LB | step/sLB | migration ms | migrated/step | end to end ms | vs best baseline |",
            "|---|---|---|---|---|---|---|---|"]
    specs = order or list(run.policies)
    for spec in specs:
        if spec not in run.policies:
            continue
        p = run.policies[spec]
        name = label(spec) + (" (best baseline)" if spec == run.best_base else "")
        rows.append("| %s | %.3f | %.3f | %.3f | %.3f | %.2f GB | %.3f | %s |" % (
            name, p["step_ms"], p["ratio"], p["shared"], p["mig_ms"], p["bytes"] / 1e9,
            p["total_ms"] / run.steps, fmt_pct(run.margin(spec))))
    return "\n".join(rows)


def section_comparison(runs, args):
    out = ["## Step + migration against the best baseline", "",
           "Each run: `routepack simulate --json` with the default policies. *step/LB* is each plan's",
           "step over its own lower bound (its imbalance); *step/sLB* over the step's shared bound (the",
           "least own bound of all plans of that step, so it ranks plans as step time does,",
           "`docs/cli.md`). *step ms* is the MoE layers' step; *end to end ms* adds the log-prob",
           "forward passes, what the step does outside the MoE layers (LM head and loss, optimizer,",
           "data-parallel gradients) and the migration (`docs/cost-model.md`, \"The whole step\").",
           "*vs best baseline*: the best baseline's end-to-end time over the run / the policy's,",
           "minus 1. Every run prices the config's executor: the default `routepack_torch` (this",
           "project's layer as it runs on `main`: one copy of a token per destination GPU, replica",
           "gradients exchanged among each expert's holders, the step's extra replicas fetched once",
           "and ahead, no per-forward balancer) except `example-balancer`: the",
           "bundled example on Megatron-Core with its virtual-expert balancer (`megatron_balancer`,",
           "8 slots a GPU: Megatron holds every expert once). Seeds 21 and 22 were not used to",
           "choose any default (tuning used seed 11 and the bundled example).", ""]
    for name in eval_runs(runs, args):
        r = runs[name]
        out += ["### %s" % name, "", r.describe(), "", table(r, DEFAULTS), "", "`%s`" % r.d["verdict"]["text"], ""]
    return "\n".join(out)


def eval_runs(runs, args):
    names = ["example", "example-balancer", "small-8", "small-%d" % args.long]
    if args.reference:
        names.append("reference-8")
    return [n for n in names if n in runs]


def section_done_when(runs, args):
    out = ["## Done when (issue 15)", "",
           "The shipped `routepack` policy fastest on step + migration of all default policies by at",
           "least 1%, on the bundled example and on generated traces of 8 and 24 steps at the small",
           "scale with unseen seeds:", "",
           "| run | fastest | routepack vs best baseline | best baseline | routepack fell back | met? |",
           "|---|---|---|---|---|---|"]
    for name in eval_runs(runs, args):
        r = runs[name]
        m = r.margin("routepack")
        fastest = r.d["verdict"]["fastest"]
        met = fastest == "routepack" and m is not None and m >= 0.01
        fb = r.policies.get("routepack", {}).get("fallbacks", 0)
        out.append("| %s | %s | %s | %s | %d of %d steps | %s |" % (
            name, label(fastest or "-"), fmt_pct(m), r.best_base or "-", fb, r.steps, "yes" if met else "**no**"))
    return "\n".join(out)


def section_sweep(runs, args):
    names = [n for n in ("sweep-example", "sweep-small-2", "sweep-small-8", "sweep-small-%d" % args.long)
             if n in runs]
    if not names:
        return None
    specs = []
    for n in names:
        for s in runs[n].policies:
            if s not in specs and not runs[n].policies[s]["baseline"]:
                specs.append(s)
    out = ["## Horizon and persistence", "",
           "How the routepack policy's migration defaults were chosen: the same policy with `horizon`",
           "and `persistence` set otherwise (`h1`, `h3`, `h10`: that horizon with persistence measured",
           "from history and prior 0; `h10-prior1`: prior 1; `h10-rho1`: persistence fixed at 1, the",
           "old rule; `novx`: horizon 3 without the per-forward balancer's candidate, for a trainer",
           "that cannot run it), on the tuning traces (seed 11) and the bundled example. Each cell:",
           "step + migration against the run's best baseline (of `token_kk+contiguous`,",
           "`token_kk+eplb_periodic` and `token_kk+virtual_experts`). `routepack` is the shipped",
           "default.", "",
           "| variant | " + " | ".join(names) + " | mean |", "|---|" + "---|" * (len(names) + 1)]
    best, best_mean = None, None
    for s in specs:
        cells, vals = [], []
        for n in names:
            m = runs[n].margin(s)
            cells.append(fmt_pct(m))
            if m is not None:
                vals.append(m)
        mean = sum(vals) / len(vals) if vals else None
        if mean is not None and (best_mean is None or mean > best_mean):
            best, best_mean = s, mean
        out.append("| %s | %s | %s |" % (label(s), " | ".join(cells), fmt_pct(mean)))
    out += ["", "Best mean: `%s` (%s)." % (label(best), fmt_pct(best_mean)) if best else ""]
    return "\n".join(out)


def section_calibration(runs, args):
    name = "small-%d" % args.long
    if name not in runs or "routepack" not in runs[name].policies:
        return None
    steps = runs[name].policies["routepack"]["steps"]
    out = ["## Calibration of the migration decision", "",
           "Per step of `%s`, from the routepack policy's step report (`rp.decision`, metrics):" % name,
           "the persistence it used, this step's placement change predicted on its own batch, and an",
           "earlier change's saving realised on this batch (the placement after it against the one",
           "before, this step's packing, the cost model).", "",
           "| step | persistence | observations | migration ms | predicted saving ms | realised saving ms |",
           "|---|---|---|---|---|---|"]
    pred = real = 0.0
    for s in steps:
        m = s["metrics"]
        out.append("| %d | %.3f | %d | %.3f | %.3f | %s |" % (
            s["step"], m["persistence"], m["persistence_observations"], s["migration_ms"],
            m["predicted_saving_ms"], "%.3f" % m["realised_saving_ms"] if m["realised_scored"] else "-"))
        pred += m["predicted_saving_ms"]
        if m["realised_scored"]:
            real += m["realised_saving_ms"]
    out += ["", "Sum of predicted savings (of the changes made) %.3f ms; of realised savings on the following"
            " steps %.3f ms." % (pred, real)]
    return "\n".join(out)


def section_bench(runs, args):
    if not args.bench:
        return None
    path = os.path.join(args.work, "bench.md")
    if not os.path.exists(path):
        return None
    return "\n".join(["## Single-step planner quality (bench_policies --scale %s)" % args.bench, "",
                      "Two-step batches of `tests/bench/bench_policies` (its own baselines; step time only,",
                      "speedup against `token_kk+eplb`): how well each plan balances one batch.",
                      open(path).read()])


def section_vexp(runs, args):
    """RoutePack with, without or beside Megatron's per-forward virtual-expert balancer."""
    if "vexp-small-8" not in runs or "small-8" not in runs:
        return None
    beside, plain = runs["vexp-small-8"], runs["small-8"]
    out = ["## With, without or beside virtual experts (MoonEP)", "",
           "Megatron-Core's per-forward virtual-expert balancer (`docs/baselines.md`, \"Virtual experts",
           "(MoonEP)\") as a baseline where the trainer runs it: the default executor",
           "(`routepack_torch`) does not, so `token_kk+virtual_experts` is in the defaults only of",
           "`example-balancer` above (`execution.executor` `megatron_balancer`, where the shipped",
           "`routepack` also scores its packing run with the balancer each step;",
           "`docs/routepack-policy.md`, \"Beside the per-forward balancer\"). Below, the same 8-step",
           "trace (seed 21) under a config whose trainer always runs the balancer (`megatron_balancer`,",
           "8 slots a GPU, `execution.per_forward_balancing`): `routepack` then always packs for it",
           "(attention and tokens) and leaves each forward's expert residue to the balancer. The",
           "balancer is priced with its pushes, the SMs they take, its equal-token padding and its",
           "FP32 gradient push (`docs/cost-model.md`).", "",
           "| policy | trainer | step ms | end to end ms | vs token_kk+virtual_experts |", "|---|---|---|---|---|"]
    ref = beside.policies.get("token_kk+virtual_experts")
    rows = [("token_kk+virtual_experts", beside, "balancer on"),
            ("routepack", plain, "default config (routepack_torch: its own placement, no balancer)"),
            ("routepack", beside, "balancer on (beside it)")]
    for spec, run, what in rows:
        p = run.policies.get(spec)
        if not p:
            continue
        vs = "-" if not ref or run is beside and spec == "token_kk+virtual_experts" else \
            fmt_pct(ref["total_ms"] / p["total_ms"] - 1)
        out.append("| %s | %s | %.3f | %.3f | %s |" % (spec, what, p["step_ms"], p["total_ms"] / len(p["steps"]), vs))
    out += ["", "Measured by the issue's helper at the reference shape (one step, overlap none; not produced",
            "by this script, which stays at the small scale): token_kk+eplb 16163 / 16197 ms (step / with",
            "migration), token_kk+virtual_experts 15639 / 15639, routepack 15762 / 15791, routepack beside",
            "virtual experts 15375 / 15375: the balancer removes the expert-side straggler; RoutePack",
            "beside it adds 0.5-1.7% from attention-aware packing."]
    return "\n".join(out)


def section_overhead(runs, args):
    """Planning overhead per rank at the reference scale (issue 16): bench_overhead --json."""
    path = os.path.join(args.work, "bench-overhead.out")
    if not os.path.exists(path):
        return None
    o = json.load(open(path))
    pct = lambda ms: 100.0 * ms / o["predicted_step_ms"]
    load_path = os.path.join(args.work, "bench-overhead.load")
    load = open(load_path).read().strip() if os.path.exists(load_path) else None
    rows = [
        ("statistics of the rank's %d sequences (one thread)" % o["rank_seqs"], o["stats_ms"]),
        ("exchange: %s bytes a part, %.1f MB gathered, modelled as a ring over the config's network"
         % (format(o["part_bytes"], ","), o["exchange_bytes"] / 1e6), o["exchange_ms"]),
        ("merge of the %d parts into the statistics the scheduler gave back (`rp_stats_merge_serialized_reusing`; "
         "%.1f ms into fresh memory)" % (o["ranks"], o.get("merge_fresh_ms", float("nan"))), o["merge_ms"]),
        ("policy calls (`%s`, a step between fallback checks: after the balancer's plan won the last check, "
         "that plan alone)" % o["policy"], o["policy_ms"]),
        ("the engine around them (`rp_sched_step_stats_take`: validation, the plan's summary, migration plan)",
         o["validate_ms"]),
    ]
    out = ["## Planning overhead per rank (issue 16)", "",
           "`./build/bench/bench_overhead --reps %d --json` (tests/bench/bench_overhead.c): one rank of the"
           % o.get("reps", 3),
           "reference config's %d holds %d sequences (%s tokens) and computes their statistics; the other"
           % (o["ranks"], o["rank_seqs"], format(o["rank_tokens"], ",")),
           "ranks' parts are the same bytes under shuffled global ids; every step the parts are merged into",
           "the statistics the scheduler gave back and the config's policy plans with",
           "`rp_sched_step_stats_take`: the third step (a placement in use), and on to the step where it next",
           "checks the fallbacks (the same batch each step; checking every step, and the policy without the",
           "balancer's candidate, alternated with it in each repetition). CPU time of the",
           "thread, the least of the repetitions, on the shared 2-core development machine (its load moves",
           "these figures by tens of percent from run to run).", "",
           "Rendered at commit %s (%s)%s." % (git_commit(args.root) or "?", datetime.date.today().isoformat(),
                                              "; load average (1, 5, 15 min) before / after: " + load if load else ""),
           "",
           "| part | ms | % of the predicted step |", "| --- | --- | --- |"]
    for name, ms in rows:
        out.append("| %s | %.1f | %.2f%% |" % (name, ms, pct(ms)))
    out.append("| **total** | **%.1f** | **%.2f%%** (goal 1%%) of %.1f s |"
               % (o["total_ms"], pct(o["total_ms"]), o["predicted_step_ms"] / 1e3))
    out.append("| total on the step that checks the fallbacks (step %d; policy %.1f ms) | %.1f | %.2f%% |"
               % (o["check_step"], o["check_policy_ms"], o["check_total_ms"], pct(o["check_total_ms"])))
    out.append("| **total, the mean step of that interval** (steps 1 to %d; policy %.1f ms) | **%.1f** | **%.2f%%** |"
               % (o["check_step"], o["interval_policy_ms"], o["interval_total_ms"], pct(o["interval_total_ms"])))
    out.append("| total checking every step (`fallback_interval` 1, as before issue 16's interval; policy %.1f ms) "
               "| %.1f | %.2f%% |" % (o["every_step_policy_ms"], o["every_step_total_ms"], pct(o["every_step_total_ms"])))
    if "no_balancer_total_ms" in o:
        out.append("| total without the balancer's candidate (`virtual_experts` false: the joint placement every "
                   "step; policy %.1f ms), a step between checks | %.1f | %.2f%% |"
                   % (o["no_balancer_policy_ms"], o["no_balancer_total_ms"], pct(o["no_balancer_total_ms"])))
        out.append("| ... the mean step of its interval | %.1f | %.2f%% |"
                   % (o["no_balancer_interval_total_ms"], pct(o["no_balancer_interval_total_ms"])))
    rest = o["check_policy_ms"] - o["checked_construction_ms"]
    out.append("| of the policy: the joint construction (`rp_joint_plan`, no fallbacks; goal 20 ms) | %.1f | %.2f%% |"
               % (o["construction_ms"], pct(o["construction_ms"])))
    out.append("| of the policy: the fallback check (4 baselines evaluated exactly) | %.1f | %.2f%% |"
               % (o["fallback_check_ms"], pct(o["fallback_check_ms"])))
    out.append("| of the checking step's policy: the rest (the per-forward balancer candidate, persistence scoring, "
               "the Lua around the calls) "
               "| %.1f | %.2f%% |" % (rest, pct(rest)))
    out += ["", "The fallback check chose `%s` (%s the plan). Peak RSS of the rank %.0f MiB; it holds its own"
            % (o["fallback_chosen"], "changed" if o["fallback_changed"] else "kept"
               , o["peak_rss_mib"]),
            "routing (%.1f MiB), never the step's (%.0f MiB)." % (o["rank_routing_bytes"] / 2**20,
                                                                   o["step_routing_bytes"] / 2**20)]
    return "\n".join(out)


def section_notes(runs, args):
    path = os.path.join(args.root, "scripts", "results", "notes.md")
    return open(path).read().rstrip("\n") if os.path.exists(path) else None


def section_extra(runs, args):
    """Sections other steps of scripts/results.sh leave as WORK/section-*.md, in name order."""
    parts = [open(os.path.join(args.work, f)).read().rstrip("\n")
             for f in sorted(os.listdir(args.work)) if f.startswith("section-") and f.endswith(".md")]
    return "\n\n".join(parts) if parts else None


def section_previous(runs, args):
    path = os.path.join(args.root, "scripts", "results", "previous.md")
    return open(path).read().rstrip("\n") if os.path.exists(path) else None


SECTIONS = [section_comparison, section_done_when, section_vexp, section_sweep, section_calibration, section_notes,
            section_bench, section_overhead, section_extra, section_previous]


def splice(doc, section, later_headings, previous_heading):
    """DOC with SECTION (an extra section, WORK/section-*.md) where section_extra puts it in a
    full render: in place of the section of the same heading, else before the first of
    LATER_HEADINGS (the first lines of the extra sections that sort after it) that DOC holds,
    else before PREVIOUS_HEADING (the appendix, section_previous), else at the end."""
    section = section.rstrip("\n")
    heading = section.split("\n", 1)[0]
    lines = doc.split("\n")
    if heading in lines:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
        if end is None:
            return "\n".join(lines[:start]) + ("\n" if start else "") + section + "\n"
        return "\n".join(lines[:start] + section.split("\n") + [""] + lines[end:])
    for h in list(later_headings) + [previous_heading]:
        if h and h in lines:
            at = lines.index(h)
            return "\n".join(lines[:at] + section.split("\n") + [""] + lines[at:])
    return doc.rstrip("\n") + "\n\n" + section + "\n"


RESULTS_BEGIN, RESULTS_END = "<!-- results: begin (scripts/results.sh) -->", "<!-- results: end -->"
LAYOUTS_BEGIN, LAYOUTS_END = "<!-- layouts: begin (scripts/results.sh --layouts) -->", "<!-- layouts: end -->"


def readme_layouts(args):
    """README's line on the parallel layouts (docs/results.md's "Parallel layouts"), in its own
    block after the results block, so that a --layouts run alone keeps it current."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    try:
        import layouts
    finally:
        sys.path.pop(0)
    line = layouts.summary(args.work, args.root)
    readme = os.path.join(args.root, "README.md")
    if not line or not os.path.exists(readme):
        return
    src = open(readme).read()
    block = (LAYOUTS_BEGIN + "\nParallel layouts (`docs/results.md`, \"Parallel layouts\"; seeds pooled): routepack "
             "against the best baseline on step + migration: " + line + ".\n" + LAYOUTS_END)
    if LAYOUTS_BEGIN in src:
        src = re.sub(re.escape(LAYOUTS_BEGIN) + ".*?" + re.escape(LAYOUTS_END), lambda m: block, src, flags=re.S)
    elif RESULTS_END in src:
        src = src.replace(RESULTS_END, RESULTS_END + "\n\n" + block, 1)
    else:
        return
    with open(readme, "w") as f:
        f.write(src)


PLANNER_BEGIN, PLANNER_END = "<!-- planner: begin (scripts/results.sh --planner) -->", "<!-- planner: end -->"


def readme_planner(args):
    """README's line on the planner against the per-forward balancer (docs/results.md's
    section of issue 35), in its own block after the layouts' (or the results') block."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    try:
        import planner
    finally:
        sys.path.pop(0)
    line = planner.summary(args.work, args.root)
    readme = os.path.join(args.root, "README.md")
    if not line or not os.path.exists(readme):
        return
    src = open(readme).read()
    block = (PLANNER_BEGIN + "\nThe planner against Megatron's per-forward balancer (`docs/results.md`, \"The planner "
             "against the per-forward balancer\"; predicted end to end, step + migration, unseen seeds): " + line +
             ".\n" + PLANNER_END)
    if PLANNER_BEGIN in src:
        src = re.sub(re.escape(PLANNER_BEGIN) + ".*?" + re.escape(PLANNER_END), lambda m: block, src, flags=re.S)
    else:
        for anchor in (LAYOUTS_END, RESULTS_END):
            if anchor in src:
                src = src.replace(anchor, anchor + "\n\n" + block, 1)
                break
        else:
            return
    with open(readme, "w") as f:
        f.write(src)


def git_commit(root):
    """ROOT's commit, short, or "" outside a git work tree."""
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


OVERHEAD_SENTENCE = re.compile(r"Planning overhead per rank at the reference scale \(.*?\(-?[0-9.]+%\)\. ")


def readme_overhead_splice(args):
    """README's sentence on the planning overhead (readme_overhead) replaced in its Results
    block, or added before the block's closing words where it has none."""
    readme = os.path.join(args.root, "README.md")
    sentence = readme_overhead(args)
    if not sentence or not os.path.exists(readme):
        return
    src = open(readme).read()
    if RESULTS_BEGIN not in src or RESULTS_END not in src:
        return
    head, rest = src.split(RESULTS_BEGIN, 1)
    block, tail = rest.split(RESULTS_END, 1)
    if OVERHEAD_SENTENCE.search(block):
        block = OVERHEAD_SENTENCE.sub(lambda m: sentence, block, count=1)
    elif "`docs/results.md` has every figure" in block:
        block = block.replace("`docs/results.md` has every figure", sentence + "`docs/results.md` has every figure", 1)
    else:
        block = block.rstrip("\n") + " " + sentence.rstrip() + "\n"
    with open(readme, "w") as f:
        f.write(head + RESULTS_BEGIN + block + RESULTS_END + tail)


def splice_section(args):
    """--splice NAME: WORK/section-NAME.md into ROOT/docs/results.md (see splice); NAME
    overhead: the section rendered from WORK/bench-overhead.out, which a full render puts
    before every WORK/section-*.md."""
    if args.splice == "overhead":
        name = ""  # every extra section sorts after it
        section = section_overhead(None, args)
        if section is None:
            sys.exit("results: no %s to splice" % os.path.join(args.work, "bench-overhead.out"))
    else:
        name = "section-%s.md" % args.splice
        with open(os.path.join(args.work, name)) as f:
            section = f.read()
    later = [open(os.path.join(args.work, f)).read().split("\n", 1)[0]
             for f in sorted(os.listdir(args.work)) if f.startswith("section-") and f.endswith(".md") and f > name]
    prev = section_previous(None, args)
    path = os.path.join(args.root, "docs", "results.md")
    with open(path) as f:
        doc = f.read()
    # a header of the older wording claims one commit for every section: say that a
    # section naming its own commit was rendered at that one
    doc = re.sub(r"Generated by `scripts/results.sh` \(commit ([^,]+), ([0-9?-]+)\); edit that script, "
                 r"`scripts/results.py`\n",
                 lambda m: "Generated by `scripts/results.sh` (commit %s, %s; a section that names its own commit was"
                           "\nrendered alone at that one since); edit that script, `scripts/results.py`\n"
                           % (m.group(1), m.group(2)), doc, count=1)
    with open(path, "w") as f:
        f.write(splice(doc, section, later, prev.split("\n", 1)[0] if prev else None))
    if args.splice == "tp-pp-layouts":
        readme_layouts(args)
    if args.splice == "vs-balancer":
        readme_planner(args)
    if args.splice == "overhead":
        readme_overhead_splice(args)
    print("results: spliced %s into docs/results.md" % (name or "the overhead section"), file=sys.stderr)


def readme_summary(runs, args):
    parts = []
    for name in eval_runs(runs, args):
        r = runs[name]
        m = r.margin("routepack")
        parts.append("%s: routepack %s against the best baseline (%s)" % (name, fmt_pct(m), r.best_base))
    return ("Predicted by the cost model, end to end (the MoE layers, the log-prob passes, the rest of the step "
            "and the migration), on the bundled example and generated traces (small scale, seeds not "
            "used for tuning), priced for this project's own layer (`execution.executor` `routepack_torch`, "
            "the default: one copy of a token per destination GPU, replica gradients exchanged among each "
            "expert's holders, the step's extra replicas fetched once and ahead, no per-forward balancer) except `example-balancer` (the example on Megatron-Core with its balancer), "
            "against the best baseline of "
            "`token_kk+contiguous`, `token_kk+eplb`, `token_kk+eplb_periodic` (EPLB as vLLM and SGLang run it), "
            "`verl_kk+eplb`, `attn_kk+eplb`, `slime_ff+eplb` and `slime_kk+eplb` (slime's packings: its recipes' "
            "first fit and its FLOPs balancing) and `token_kk+virtual_experts` "
            "(Megatron's per-forward balancer, MoonEP, where the trainer runs it): " + "; ".join(parts) + ". "
            + readme_overhead(args) +
            "`docs/results.md` has every figure, "
            "the verdicts, the sweep the defaults came from and what limits them; `scripts/results.sh` "
            "produces it.")


def readme_overhead(args):
    """README's sentence on the planning overhead per rank (bench_overhead's JSON), or nothing."""
    path = os.path.join(args.work, "bench-overhead.out")
    if not os.path.exists(path):
        return ""
    o = json.load(open(path))
    pct = lambda ms: 100.0 * ms / o["predicted_step_ms"]
    return ("Planning overhead per rank at the reference scale (64 GPUs, 4096 sequences; one CPU thread, "
            "`bench_overhead`): %.0f ms a step between fallback checks (%.2f%% of the predicted %.1f s step), "
            "%.0f ms the mean step of an interval (%.2f%%). "
            % (o["total_ms"], pct(o["total_ms"]), o["predicted_step_ms"] / 1e3, o["interval_total_ms"],
               pct(o["interval_total_ms"])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("root")
    ap.add_argument("--long", type=int, default=24)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--bench")
    ap.add_argument("--splice", metavar="NAME")
    args = ap.parse_args()
    if args.splice:
        splice_section(args)
        return
    runs = {}
    for f in sorted(os.listdir(args.work)):
        if f.endswith(".json") and not f.startswith("gen-"):
            try:
                r = Run(os.path.join(args.work, f))
            except (KeyError, ValueError):
                continue
            runs[r.name] = r
    commit = git_commit(args.root)
    head = ["# Results: the joint policy against what trainers run", "",
            "Generated by `scripts/results.sh` (commit %s, %s; a section that names its own commit was"
            % (commit or "?", datetime.date.today().isoformat()),
            "rendered alone at that one since); edit that script, `scripts/results.py`",
            "or `scripts/results/notes.md`, not this file. Everything here is the cost model's",
            "prediction (`docs/cost-model.md`) on batches generated from real data (`docs/gen.md`); no",
            "GPU ran these steps.", "",
            "## How to reproduce", "", "```", "scripts/results.sh            # about 40 minutes at load 10 on 2 cores (2026-12-06)",
            "scripts/results.sh --quick    # 8-step traces instead of 24",
            "scripts/results.sh --layouts  # only \"Parallel layouts\", spliced into this file",
            "scripts/results.sh --overhead # only \"Planning overhead per rank\" (and README's sentence on it)", "```", ""]
    body = [s(runs, args) for s in SECTIONS]
    text = "\n".join(head) + "\n" + "\n\n".join(b for b in body if b) + "\n"
    with open(os.path.join(args.root, "docs", "results.md"), "w") as f:
        f.write(text)
    readme = os.path.join(args.root, "README.md")
    src = open(readme).read()
    block = RESULTS_BEGIN + "\n" + readme_summary(runs, args) + "\n" + RESULTS_END
    if RESULTS_BEGIN in src:
        src = re.sub(re.escape(RESULTS_BEGIN) + ".*?" + re.escape(RESULTS_END), lambda m: block, src, flags=re.S)
    else:
        src = re.sub(r"(## Results\n\n)(.*?)(\n## )", lambda m: m.group(1) + block + "\n" + m.group(3), src,
                     count=1, flags=re.S)
    with open(readme, "w") as f:
        f.write(src)
    readme_layouts(args)
    print("results: wrote docs/results.md and README.md's Results section", file=sys.stderr)


if __name__ == "__main__":
    main()
