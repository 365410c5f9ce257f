"""The example outputs the docs show must be what the tool prints. Every fenced block of
docs/*.md and README.md whose first line is `$ routepack ...` is run (in order, from a
folder holding the source tree's examples/ and policies/, so `plan eval` reads the plan
that `plan baseline` wrote before it); blocks whose output is deterministic are compared
line for line (for the commands in TIMED, wall times masked: `1.3 ms`, `1.03 GB/s`;
predicted times are never masked), and a block that ends
with a line `...` shows the first lines of the output only. Blocks whose output depends
on the machine or on hand-made inputs are listed in VOLATILE and only checked to run.
Refresh a block by running its command and pasting."""

import os
import re
import shlex
import subprocess

import pytest

from conftest import REPO, cli_path

# Commands whose output holds wall times, the machine's GPUs, or input made by hand.
VOLATILE = {
    "simulate": "plan ms column (wall time); the table is abridged",
    "policy list": "paths of the install",
    "policy check": "wall time of the sample steps",
    "plan validate": "bad.json is hand-made",
    "version": "CUDA and GPUs of the machine",
}


def doc_blocks():
    files = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"```[a-z]*\n(\$ routepack [^\n]*)\n(.*?)```", text, re.S):
            yield path.name, m.group(1)[2:], m.group(2)


BLOCKS = list(doc_blocks())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = cli_path()
    if path is None:
        pytest.skip("the routepack tool is not built")
    d = tmp_path_factory.mktemp("docs")
    os.symlink(REPO / "examples", d / "examples")
    os.symlink(REPO / "policies", d / "policies")
    return path, d


# Commands that print wall times beside deterministic output.
TIMED = {"stats"}
TIMING = re.compile(r"\d+(\.\d+)? (ms|s|GB/s|MB/s)\b")


def masked(lines):
    return [TIMING.sub("<time>", line) for line in lines]


def volatile(command):
    words = shlex.split(command)[1:]
    return next((why for cmd, why in VOLATILE.items() if words[:len(cmd.split())] == cmd.split()),
                None)


def test_the_docs_have_examples():
    assert len(BLOCKS) >= 8
    assert any(c.startswith("routepack plan eval") for _, c, _ in BLOCKS)


@pytest.mark.parametrize("doc,command,shown", BLOCKS,
                         ids=["%s:%s" % (d, c[:40]) for d, c, _ in BLOCKS])
def test_doc_example_output(workdir, doc, command, shown):
    cli, d = workdir
    if "bad.json" in command:
        pytest.skip("hand-made input")
    argv = shlex.split(command)
    r = subprocess.run([cli, *argv[1:]], capture_output=True, text=True, cwd=d,
                       env=dict(os.environ, RP_EXAMPLES_DIR=str(REPO / "examples")))
    assert r.returncode == 0, r.stderr
    why = volatile(command)
    if why:
        return
    printed = (r.stdout + r.stderr).rstrip("\n").splitlines()
    want = shown.rstrip("\n").splitlines()
    if argv[1] in TIMED:
        printed, want = masked(printed), masked(want)
    if want and want[-1] == "...":
        want, printed = want[:-1], printed[:len(want) - 1]
    assert printed == want, \
        "%s: the output of `%s` has changed; paste the new output into the doc" % (doc, command)
