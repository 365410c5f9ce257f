"""Output paths of the command-line tool: checked before any work (a missing folder is a
usage error at once, not after the run), and `simulate --plans DIR` writes the plan each
policy ran at each step, which reads back as the same plan (same hash, valid for its
step)."""

import json
import subprocess

import pytest

from conftest import SMALL_CONFIG, SMALL_TRACE, cli_path


@pytest.fixture(scope="module")
def cli():
    path = cli_path()
    if path is None:
        pytest.skip("the routepack tool is not built")
    return path


def run(cli, *args, cwd=None):
    return subprocess.run([cli, *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("args,option", [
    (["simulate", "--report", "{missing}/r.html"], "--report"),
    (["simulate", "--plans", "{missing}/deeper/plans"], "--plans"),
    (["trace", "gen", "examples/gen-small.json", "--out", "{missing}/t.rpt"], "--out"),
    (["plan", "baseline", "token_kk+eplb", "--config", str(SMALL_CONFIG), "--trace",
      str(SMALL_TRACE), "--out", "{missing}/p.json"], "--out"),
    (["trace", "import", "--routing", "r.npy", "--lens", "l.npy", "--experts", "64", "--out",
      "{missing}/t.rpt"], "--out"),
])
def test_missing_output_folder_is_refused_first(cli, tmp_path, args, option):
    missing = tmp_path / "nope"
    r = run(cli, *[a.format(missing=missing) for a in args], cwd=SMALL_CONFIG.parent.parent)
    assert r.returncode == 2, r.stderr
    assert option in r.stderr and "does not exist" in r.stderr and "create it first" in r.stderr
    assert r.stdout == ""            # nothing ran
    assert not missing.exists()


def test_output_that_is_a_folder(cli, tmp_path):
    r = run(cli, "simulate", "--report", tmp_path)
    assert r.returncode == 2 and "is a folder" in r.stderr


def test_plans_dir(cli, tmp_path):
    plans = tmp_path / "plans"
    policies = ["token_kk+eplb", "routepack"]
    r = run(cli, "simulate", "--json", "--steps", 2, "--policies", ",".join(policies),
            "--plans", plans)
    assert r.returncode == 0, r.stderr
    run_json = json.loads(r.stdout)
    for pol in run_json["policies"]:
        folder = plans / pol["policy"]
        assert sorted(p.name for p in folder.iterdir()) == ["step-0.json", "step-1.json"]
        for k, step in enumerate(pol["steps"]):
            path = folder / ("step-%d.json" % step["step"])
            v = run(cli, "plan", "validate", "--config", SMALL_CONFIG, "--trace", SMALL_TRACE,
                    "--step", k, path)
            assert v.returncode == 0, v.stdout + v.stderr
            e = run(cli, "plan", "eval", "--json", "--config", SMALL_CONFIG, "--trace",
                    SMALL_TRACE, "--step", k, "--plan", path)
            assert e.returncode == 0, e.stderr
            ev = json.loads(e.stdout)
            assert ev["plan_hash"] == step["plan_hash"]
            assert ev["breakdown"]["summary"]["step_s"] * 1e3 == pytest.approx(step["step_ms"], rel=1e-6)


def test_plans_dir_names_a_path_policy(cli, tmp_path):
    plans = tmp_path / "plans"
    policy = SMALL_CONFIG.parent.parent / "policies" / "eplb.lua"
    r = run(cli, "simulate", "--steps", 1, "--policies", "token_kk+contiguous,%s" % policy,
            "--plans", plans)
    # eplb alone has no packing: it may not run, but the folder of what ran is there
    assert (plans / "token_kk+contiguous" / "step-0.json").is_file(), r.stderr
