"""`--help` on every command and subcommand, `routepack help CMD [SUB]`, and the example
each help page shows: it must run as printed (from a folder that holds the source tree's
examples/ and policies/), so the pages cannot drift from the tool."""

import os
import shlex
import subprocess

import numpy as np
import pytest

from conftest import REPO

# In the order their examples run: plan eval and validate read what plan baseline wrote,
# trace import reads the arrays the fixture writes.
COMMANDS = [
    ("trace", "gen"), ("trace", "info"), ("trace", "validate"), ("trace", "import"),
    ("stats", None), ("simulate", None), ("policy", "list"), ("policy", "check"),
    ("plan", "baseline"), ("plan", "eval"), ("plan", "validate"), ("memory", None),
]


def run(cli, args, cwd=None):
    return subprocess.run([cli, *args], capture_output=True, text=True, cwd=cwd)


def words(group, sub):
    return [group] + ([sub] if sub else [])


@pytest.mark.parametrize("group,sub", COMMANDS)
def test_help_page(cli, group, sub):
    name = " ".join(words(group, sub))
    pages = []
    for args in (words(group, sub) + ["--help"], words(group, sub) + ["-h"],
                 ["help"] + words(group, sub)):
        r = run(cli, args)
        assert r.returncode == 0, (args, r.stderr)
        assert r.stderr == ""
        pages.append(r.stdout)
    assert pages[0] == pages[1] == pages[2]
    page = pages[0]
    assert page.startswith("usage: routepack %s " % name)
    assert "\noptions:\n" in page and "\nexample:\n  routepack %s" % name in page
    # every option the usage line names is explained on the page
    usage = page.splitlines()[0]
    for opt in {w.strip("[]()|.,") for w in usage.split() if w.strip("[]()").startswith("--")}:
        assert "  " + opt in page, "%s: option %s has no line on the help page" % (name, opt)


def test_every_command_is_covered(cli):
    # every command the global page lists has its help page and example tested here
    page = run(cli, ["help"]).stdout
    listed = [line[2:] for line in page.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
              if line.startswith("  ") and not line.startswith("   ")]
    assert len(listed) >= len(COMMANDS)
    for line in listed:
        if line == "version":
            continue  # the one command without options (test_help_errors)
        covered = [w for w in (" ".join(words(g, s)) for g, s in COMMANDS)
                   if line == w or line.startswith(w + " ")]
        assert covered, "routepack help lists '%s', which COMMANDS does not test" % line


def test_help_wins_over_other_arguments(cli):
    # --help anywhere after the command words: the page, exit 0, nothing run
    r = run(cli, ["stats", "missing.rpt", "--step", "3", "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: routepack stats ")
    r = run(cli, ["plan", "baseline", "token_kk+eplb", "--config", "nope.json", "-h"])
    assert r.returncode == 0 and r.stdout.startswith("usage: routepack plan baseline ")


def test_group_help_lists_subcommands(cli):
    for args in (["trace", "--help"], ["help", "trace"]):
        r = run(cli, args)
        assert r.returncode == 0
        for sub in ("gen", "info", "validate", "import"):
            assert "  trace %s " % sub in r.stdout


def test_help_errors(cli):
    r = run(cli, ["help", "nonsense"])
    assert r.returncode == 2 and "unknown command 'nonsense'" in r.stderr
    r = run(cli, ["help", "plan", "nope"])
    assert r.returncode == 2 and "no subcommand 'nope'" in r.stderr
    r = run(cli, ["help", "version"])
    assert r.returncode == 0 and r.stdout.startswith("usage: routepack version")


def test_every_example_runs(cli, tmp_path):
    os.symlink(REPO / "examples", tmp_path / "examples")
    os.symlink(REPO / "policies", tmp_path / "policies")
    # the arrays `trace import`'s example reads: 3 sequences, 2... of the small model
    lens = np.array([5, 7, 4], dtype=np.int32)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "lens.npy", lens)
    np.save(tmp_path / "routing.npy",
            rng.integers(0, 64, size=(int(lens.sum()), 16, 8)).astype(np.uint8))
    for group, sub in COMMANDS:
        page = run(cli, words(group, sub) + ["--help"]).stdout
        example = page.split("\nexample:\n  ", 1)[1].strip()
        argv = shlex.split(example)
        assert argv[0] == "routepack"
        r = run(cli, argv[1:], cwd=tmp_path)
        assert r.returncode == 0, "example of %s failed: %s\n%s" % (
            " ".join(words(group, sub)), example, r.stderr)
