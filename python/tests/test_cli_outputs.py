"""Output paths of the command-line tool: checked before any work (a missing folder is a
usage error at once, not after the run), and `simulate --plans DIR` writes the plan each
policy ran at each step, which reads back as the same plan (same hash, valid for its
step)."""

import json
import subprocess

import pytest

from conftest import SMALL_CONFIG, SMALL_TRACE


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
    # the trace the plans are checked against (simulate's own default is gen-example.json)
    r = run(cli, "simulate", "--json", "--steps", 2, "--policies", ",".join(policies),
            "--config", SMALL_CONFIG, "--trace", SMALL_TRACE, "--plans", plans)
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


def run_on_terminal(cli, *args, env_extra=None):
    """Run with stderr on a pseudo-terminal; returns (returncode, stdout, what the terminal got)."""
    import os
    import pty
    master, slave = pty.openpty()
    env = dict(os.environ, **(env_extra or {}))
    p = subprocess.Popen([cli, *map(str, args)], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    out = p.stdout.read()
    p.wait()
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_only(cli, tmp_path):
    gen = SMALL_CONFIG.parent / "gen-small.json"
    # from the first update, every update (no 0.2 s between redraws: no clock in the test)
    show = {"RP_PROGRESS_AFTER_S": "0", "RP_PROGRESS_EVERY_S": "0"}
    rc, out, term = run_on_terminal(cli, "trace", "gen", gen, "--steps", 3, "--out",
                                    tmp_path / "a.rpt", env_extra=show)
    assert rc == 0
    assert "about" in term and "to write (3 steps like step 0" in term   # the estimate first
    assert "\r\x1b[Ktrace gen: step 1/3" in term and "ETA" in term
    assert term.rstrip("\r\n").endswith("\x1b[K") or "\r\x1b[K" in term.split("ETA")[-1]
    assert "\x1b" not in out                                               # stdout stays clean
    # --quiet: neither the line nor the estimate
    rc, out, term = run_on_terminal(cli, "trace", "gen", gen, "--steps", 3, "--quiet", "--out",
                                    tmp_path / "b.rpt", env_extra=show)
    assert rc == 0 and "step 1/3" not in term and "to write" not in term
    # not a terminal: no progress line (the estimate is a message, it stays)
    r = subprocess.run([cli, "trace", "gen", str(gen), "--steps", "3", "--out",
                        str(tmp_path / "c.rpt")], capture_output=True, text=True,
                       env=dict(__import__("os").environ, **show))
    assert r.returncode == 0 and "\x1b" not in r.stderr and "to write" in r.stderr
    # simulate draws its line too, and erases it before the table
    rc, out, term = run_on_terminal(cli, "simulate", "--steps", 2, "--policies",
                                    "token_kk+eplb", env_extra=show)
    assert rc == 0 and "\r\x1b[Ksimulate: step 0/2  token_kk+eplb" in term
    assert term.endswith("\r\x1b[K")
