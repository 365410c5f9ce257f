#!/usr/bin/env python3
"""The section "Both sync settings, with and without overlap" of docs/results.md (issue 14):
the runs structure-SYNC-OVERLAP.json that scripts/results.sh leaves in its work folder
(one trace on a config of several EP groups, under each execution structure), as
markdown on stdout. Usage: scripts/results/structure.py WORK"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import Run, fmt_pct  # noqa: E402  (scripts/results.py)

SETTINGS = [("group", "none"), ("group", "layer"), ("global", "none"), ("global", "layer")]
COLUMNS = ["token_kk+eplb", "token_kk+eplb_periodic", "token_kk+virtual_experts", "routepack"]


def main():
    work = sys.argv[1]
    runs = {}
    for sync, overlap in SETTINGS:
        path = os.path.join(work, "structure-%s-%s.json" % (sync, overlap))
        if os.path.exists(path):
            runs[(sync, overlap)] = Run(path)
    if not runs:
        return
    first = next(iter(runs.values()))
    out = ["## Both sync settings, with and without overlap", "",
           "The configured structure (`execution.sync`, `execution.overlap`, docs/cost-model.md) decides",
           "what the cost model charges and what the joint planner's surrogates minimise",
           "(docs/routepack-policy.md, \"The configured structure\"). The same trace on a config of",
           "several EP groups, `examples/config-small.json` on 4 nodes (4 EP groups of 8, one a node),",
           "under each structure: %s." % first.describe(), "",
           "Step + migration per step (ms), and routepack against the best baseline of the run (every",
           "default policy; `docs/cli.md`) and against `token_kk+eplb` and `token_kk+virtual_experts`:", "",
           "| sync | overlap | " + " | ".join(COLUMNS) + " | best baseline | routepack vs best | vs token_kk+eplb |"
           " vs token_kk+virtual_experts | routepack fell back |",
           "|---|---|" + "---|" * (len(COLUMNS) + 5)]
    for (sync, overlap), r in runs.items():
        cells = []
        for spec in COLUMNS:
            p = r.policies.get(spec)
            cells.append("%.3f" % (p["total_ms"] / r.steps) if p else "-")
        rp = r.policies.get("routepack")

        def against(spec):
            if not rp or spec not in r.policies:
                return "-"
            return fmt_pct(r.policies[spec]["total_ms"] / rp["total_ms"] - 1)
        out.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            sync, overlap, " | ".join(cells), r.best_base or "-", fmt_pct(r.margin("routepack")),
            against("token_kk+eplb"), against("token_kk+virtual_experts"),
            "%d of %d steps" % (rp["fallbacks"], r.steps) if rp else "-"))
    out += ["", "Before the surrogates took the group form (issue 14; measured by its helper with",
            "`tests/bench/bench_policies --scale reference --prompts 64 --execution '\"sync\": \"group\"'`, the",
            "joint planner alone against `token_kk+eplb`, 11 single-step batches of the reference shape",
            "with 64 prompts x 8, 8 EP groups; not produced by this script): mean speedup 1.165x before,",
            "1.364x after (10 of 11 batches faster, by up to 22%; one, a single microbatch, 0.6% slower);",
            "with `\"overlap\": \"layer\"` as well, 1.165x before and 1.384x after. The construction",
            "took 13-14 ms before and 15 ms after (mean, one core of the shared build machine)."]
    print("\n".join(out))


if __name__ == "__main__":
    main()
