"""scripts/results/planner.py (docs/results.md's "The planner against the per-forward
balancer" section, issue 35) on small fake simulate runs: the "done when" clauses (the own
plan on its trainer's run, the balancer and routepack packing for it on the balancer's
trainer's run), the steps where the balancer's plan still wins and each step's levers come
from the runs' figures."""

import json

from conftest import REPO, load_script

planner = load_script("results_planner", "results/planner.py")

TERMS = ("attention_ms", "dispatch_ms", "expert_ms", "combine_ms", "grad_reduce_ms", "extra_copy_ms")


def _policy(name, baseline, steps):
    """steps: (attention_ms, expert_ms, migration_ms) per step; the step is their sum."""
    out = []
    for i, (a, x, m) in enumerate(steps):
        s = {"step": i, "step_ms": a + x, "migration_ms": m, "ratio": 1.0, "shared_ratio": 1.0,
             "migration_bytes": 0, "fallback": False,
             "levers": {"replicas": 16 + i, "share_sets": 40, "extra_replicas": 12, "extras_fetched": 5,
                        "bytes_fetched": 2.5e9, "bytes_fetched_ahead": 2.5e9}}
        s.update({t: 0.0 for t in TERMS})
        s.update(attention_ms=a, expert_ms=x)
        out.append(s)
    return {"policy": name, "status": "ok", "summary": {"baseline": baseline}, "steps": out}


def _run(policies, best):
    return {"format": "routepack-simulate", "version": 1, "config": "c.json",
            "input": {"kind": "trace", "path": "/tmp/x.rpt", "steps": 2},
            "shape": {"num_gpus": 8, "num_nodes": 1, "gpus_per_node": 8, "ep_size": 8, "num_layers": 2,
                      "num_experts": 16, "top_k": 2},
            "policies": policies, "verdict": {"text": "verdict: fake", "steps": 2, "best_baseline": best,
                                              "fastest": "routepack"}}


def test_done_when_and_balancer_wins(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    vx = _policy("token_kk+virtual_experts", True, [(50.0, 50.0, 0.0), (50.0, 50.0, 0.0)])
    eplb = _policy("token_kk+eplb", True, [(50.0, 60.0, 5.0), (50.0, 60.0, 5.0)])
    # the own plan: 2 ms behind on step 0 (its expert side 3 ms worse, attention 1 ms better),
    # 4 ms ahead on step 1: 2 ms ahead of 200 over both, 1.0%; with the candidate 1.5% ahead
    own = _policy("routepack:virtual_experts=false", False, [(49.0, 53.0, 0.0), (48.0, 48.0, 0.0)])
    full = _policy("routepack", False, [(49.0, 49.0, 0.0), (49.0, 50.0, 0.0)])
    # the config's trainer (routepack_torch) and the balancer's (megatron_balancer)
    (work / "planner-a.json").write_text(json.dumps(_run([eplb, own], "token_kk+eplb")))
    (work / "planner-a-bal.json").write_text(json.dumps(_run([vx, full], "token_kk+virtual_experts")))
    # a cross-node run, no balancer: routepack 2% ahead of the best baseline, short of 5%
    (work / "planner-b.json").write_text(json.dumps(_run([
        _policy("token_kk+eplb", True, [(50.0, 50.0, 4.0), (50.0, 50.0, 0.0)]),
        _policy("routepack", False, [(50.0, 50.0, 0.0), (50.0, 50.0, 0.0)])], "token_kk+eplb")))
    (work / "planner.tsv").write_text(
        "a\texamples/c.json\tg.json\t5\t2\tplanner-a.json\tplanner-a-bal.json\n"
        "b\texamples/c.json\tg.json\t6\t2\tplanner-b.json\t-\n")
    md = planner.render(str(work), str(REPO))
    assert md.startswith(planner.HEADING)
    assert "step 0 by 2.000 ms (expert, 3.000 ms)" in md
    assert "step 1 by" not in md
    assert "| a | +1.0% | +1.5% | met |" in md
    assert "| routepack on megatron_balancer |" in md
    assert planner.summary(str(work), str(REPO)) == (
        "a: own plan +1.0% vs token_kk+virtual_experts (on the balancer's trainer +1.5%); b: +2.0% vs token_kk+eplb")
    assert "| 0 | 16 | 40 | 12 | 5 | 2.50 GB |" in md and "| 1 | 17 | 40 | 12 | 5 | 2.50 GB |" in md
    assert "| b (cross-node; the balancer cannot run) | - | +2.0% vs token_kk+eplb | not met |" in md
