"""The binding plans exactly as the C command-line tool: a trace written from Python (by
the trace writer, and by np.save + `routepack trace import`) is simulated by
`routepack simulate --json`, and every step's plan hash and predicted time must equal
what Scheduler.step returned for the same step."""

import json
import subprocess

import numpy as np
import pytest

import routepack
from conftest import SMALL_CONFIG, random_step


def run_cli(cli, *args):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, "routepack %s failed: %s" % (" ".join(map(str, args)), r.stderr)
    return r.stdout


def make_steps(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(1, 80, size=24).astype(np.int32)
        response = rng.integers(0, 400, size=24).astype(np.int32)
        groups = (np.arange(24) // 4).astype(np.int32)
        _, ids = random_step(rng, 24, 16, 8, 64, dtype=np.uint8, lens=prompt + response)
        out.append((i, prompt, response, groups, ids))
    return out


POLICIES = ["token_kk+eplb", "attn_kk+eplb", None]    # None: the config's policy


def python_run(steps, policy):
    with routepack.Scheduler(SMALL_CONFIG, policy=policy) as s:
        return [s.step((p, r), ids, step=i, group_ids=g) for i, p, r, g, ids in steps]


def test_simulate_matches_the_binding(cli, tmp_path):
    steps = make_steps(5)
    trace = tmp_path / "py.rpt"
    with routepack.TraceWriter(trace, 64) as w:
        for i, p, r, g, ids in steps:
            cu = np.concatenate([[0], np.cumsum(p + r)])
            # per-sequence arrays, as a rollout engine returns them
            w.append(i, (p, r), [ids[cu[s]:cu[s + 1]] for s in range(len(p))], group_ids=g)
    run_cli(cli, "trace", "validate", trace)
    config_policy = json.loads(SMALL_CONFIG.read_text())["policy"]["name"]
    specs = [p or config_policy for p in POLICIES]
    out = json.loads(run_cli(cli, "simulate", "--config", SMALL_CONFIG, "--trace", trace,
                             "--policies", ",".join(specs), "--json"))
    for policy, spec in zip(POLICIES, specs):
        mine = python_run(steps, policy)
        theirs = _find(out, spec)
        assert len(theirs["steps"]) == len(mine)
        for a, b in zip(mine, theirs["steps"]):
            assert b["step"] == a.step
            assert b["plan_hash"] == "%016x" % a.plan_hash, (spec, a.step)
            # the tool prints times rounded (to the microsecond); the hash is exact
            assert b["step_ms"] == pytest.approx(a.step_time_s * 1e3, rel=1e-6, abs=1e-6)
            assert b["lower_bound_ms"] == pytest.approx(a.lower_bound_s * 1e3, rel=1e-6, abs=1e-6)
            assert b["fallback"] == a.fallback
            assert b["policy"]["name"] == a.policy_name


def _find(out, spec):
    for pol in out["policies"]:
        if spec in (pol.get("name"), pol.get("spec"), pol.get("policy")):
            return pol
    raise AssertionError("policy %s not in the simulate output: %s"
                         % (spec, [sorted(p) for p in out["policies"]]))


def test_npy_import_gives_the_writers_trace(cli, tmp_path):
    (i, p, r, g, ids), = make_steps(1, seed=4)
    np.save(tmp_path / "routing.npy", ids.astype(np.int64))       # torch's default dtype
    np.save(tmp_path / "lens.npy", np.stack([p, r], axis=1))
    np.save(tmp_path / "groups.npy", g)
    run_cli(cli, "trace", "import", "--routing", tmp_path / "routing.npy", "--lens",
            tmp_path / "lens.npy", "--group-ids", tmp_path / "groups.npy", "--experts", 64,
            "--out", tmp_path / "imported.rpt")
    with routepack.TraceWriter(tmp_path / "written.rpt", 64) as w:
        w.append(0, (p, r), ids.astype(np.int64), group_ids=g)
    a = routepack.TraceReader(tmp_path / "imported.rpt")
    b = routepack.TraceReader(tmp_path / "written.rpt")
    assert a.info(0) == b.info(0)                                  # same bytes, same checksum
    # and the binding plans the imported step as it plans the arrays themselves
    with routepack.Scheduler(SMALL_CONFIG) as s1, routepack.Scheduler(SMALL_CONFIG) as s2:
        rec = a[0]
        h1 = s1.step(rec.lengths, rec.routing, group_ids=rec.group_ids).plan_hash
        h2 = s2.step((p, r), ids, group_ids=g).plan_hash
    assert h1 == h2


def test_plan_eval_prices_the_plan_as_the_step_report(cli, tmp_path):
    steps = make_steps(1, seed=9)
    (i, p, r, g, ids), = steps
    trace = tmp_path / "one.rpt"
    with routepack.TraceWriter(trace, 64) as w:
        w.append(0, (p, r), ids, group_ids=g)
    with routepack.Scheduler(SMALL_CONFIG) as s:
        res = s.step((p, r), ids, step=0, group_ids=g)
        (tmp_path / "plan.json").write_text(s.plan_json())
    ev = json.loads(run_cli(cli, "plan", "eval", "--config", SMALL_CONFIG, "--trace", trace,
                            "--plan", tmp_path / "plan.json", "--json"))
    text = json.dumps(ev)
    step_ms = _first_key(ev, ("step_ms", "step_s"))
    assert step_ms is not None, text[:400]
    key, value = step_ms
    want = res.step_time_s * (1e3 if key == "step_ms" else 1.0)
    assert value == pytest.approx(want, rel=1e-12)


def _first_key(obj, keys):
    if isinstance(obj, dict):
        for k in keys:
            if k in obj and isinstance(obj[k], (int, float)):
                return k, obj[k]
        for v in obj.values():
            got = _first_key(v, keys)
            if got:
                return got
    elif isinstance(obj, list):
        for v in obj:
            got = _first_key(v, keys)
            if got:
                return got
    return None


def test_metrics_match_simulate(cli, tmp_path):
    # StepResult.metrics() and simulate --json's per-step "metrics": the same keys, and
    # the same values for everything the plan decides (timings aside)
    steps = make_steps(2, seed=5)
    path = tmp_path / "m.rpt"
    with routepack.TraceWriter(path, 64) as w:
        for i, p, r, g, ids in steps:
            w.append(i, (p, r), ids, group_ids=g)
    sim = json.loads(run_cli(cli, "simulate", "--json", "--config", SMALL_CONFIG, "--trace", path,
                             "--policies", "token_kk+eplb"))
    results = python_run(steps, "token_kk+eplb")
    for res, step in zip(results, sim["policies"][0]["steps"]):
        m = res.metrics()
        assert set(m) == {"routepack/" + k for k in step["metrics"]}
        assert all(isinstance(v, float) for v in m.values())
        for k, v in step["metrics"].items():
            if k in ("plan_ms", "policy_ms"):
                continue
            assert m["routepack/" + k] == pytest.approx(v, rel=1e-6), k
        assert m["routepack/step_time_ms"] == pytest.approx(res.step_time_s * 1e3)
        assert m["routepack/expert_balancedness"] == pytest.approx(
            1 / m["routepack/expert_imbalance"])
        assert res.metrics(prefix="")["fallback"] in (0.0, 1.0)


def test_the_shipped_policy_fits_its_budget_at_ep_64(cli):
    """The DeepSeek-V3-like example (EP 64, 256 experts, PP 4): the default instruction
    budget (16 evaluations' work, plus the joint packing's screen under PP) once priced an
    evaluation without its dispatch pairs, a third of its work there, and the routepack
    policy's persistence scoring ran past it from step 1 on and fell back."""
    config = SMALL_CONFIG.parent / "config-deepseek-v3-pp.json"
    gen = SMALL_CONFIG.parent / "gen-deepseek-v3.json"
    out = json.loads(run_cli(cli, "simulate", "--config", config, "--gen", gen, "--steps", 2,
                             "--policies", "routepack", "--json", "--quiet"))
    steps = out["policies"][0]["steps"]
    assert len(steps) == 2
    for s in steps:
        assert not s["fallback"], s["fallback_reason"]
