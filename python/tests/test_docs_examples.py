"""The example outputs the docs show must be what the tool prints. Every fenced block of
docs/*.md and README.md whose first line is `$ routepack ...` is run (in order, from a
folder holding the source tree's examples/ and policies/, so `plan eval` reads the plan
that `plan baseline` wrote before it); blocks whose output is deterministic are compared
line for line (for the commands in TIMED, wall times masked: `1.3 ms`, `1.03 GB/s`;
predicted times are never masked), and a block that ends
with a line `...` shows the first lines of the output only. Blocks whose output depends
on the machine or on hand-made inputs are listed in VOLATILE and only checked to run.
Refresh them all with scripts/regen-docs.sh.

Python blocks (```python) whose first line is `# doc-test: <what>` are run too, each in a
fresh namespace (skipped, with the reason, when they import torch and torch is missing);
they assert what they show. A block whose <what> ends with `(torchrun --nproc-per-node N)`
is a whole distributed script: it is written to a file and run as the docs say, by
torchrun (torch.distributed.run --standalone) with N CPU ranks."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, cli_path

sys.path.insert(0, str(REPO / "scripts"))
import docblocks  # noqa: E402  (the parser scripts/regen-docs.sh shares)

from docblocks import TIMED, masked, volatile  # noqa: E402

BLOCKS = list(docblocks.examples(REPO))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = cli_path()
    if path is None:
        pytest.skip("the routepack tool is not built")
    d = tmp_path_factory.mktemp("docs")
    os.symlink(REPO / "examples", d / "examples")
    os.symlink(REPO / "policies", d / "policies")
    return path, d


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
        "%s: the output of `%s` has changed; run scripts/regen-docs.sh" % (doc, command)


def test_every_command_in_the_docs_is_an_example_or_listed():
    """A command shown in the docs either runs here (a `$ routepack` example) or is listed
    in docblocks.NOT_RUN with where it runs instead (CI, a GPU, a long benchmark)."""
    unlisted = [(doc, line) for doc, line in docblocks.other_commands(REPO)
                if docblocks.not_run_reason(line) is None]
    assert unlisted == [], "make these `$ routepack` examples or list them in scripts/docblocks.py"


def test_regen_docs_rewrites_a_stale_output(workdir, tmp_path):
    """scripts/regen-docs.sh puts back an output that drifted, and --check finds it first."""
    cli, _ = workdir
    (tmp_path / "docs").mkdir()
    for path in docblocks.doc_files(REPO):
        (tmp_path / path.relative_to(REPO)).write_text(path.read_text())
    doc = tmp_path / "docs" / "cli.md"
    good = doc.read_text()
    doc_examples = [b for b in BLOCKS if b[0] == "cli.md" and not volatile(b[1]) and "plan eval" in b[1]]
    assert doc_examples, "docs/cli.md shows plan eval"
    shown = doc_examples[0][2]
    doc.write_text(good.replace(shown, shown.replace("0", "9", 1), 1))
    regen = [sys.executable, str(REPO / "scripts" / "regen_docs.py"), "--docs-root", str(tmp_path)]
    r = subprocess.run(regen + ["--check", cli], capture_output=True, text=True)
    assert r.returncode == 1 and "differs: cli.md" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(regen + [cli], capture_output=True, text=True)
    assert r.returncode == 0 and "rewrote: cli.md" in r.stdout, r.stdout + r.stderr
    assert doc.read_text() == good
    assert "NOT LISTED" not in r.stdout


def python_blocks():
    for path in docblocks.doc_files(REPO):
        for m in re.finditer(r"```python\n(# doc-test: ([^\n]*)\n.*?)```", path.read_text(), re.S):
            yield path.name, m.group(2), m.group(1)


PY_BLOCKS = list(python_blocks())


def test_the_docs_have_python_examples():
    assert any(doc == "torch.md" for doc, _, _ in PY_BLOCKS)


@pytest.mark.parametrize("doc,what,code", PY_BLOCKS, ids=["%s:%s" % (d, w[:40]) for d, w, _ in PY_BLOCKS])
def test_doc_python_example(doc, what, code, tmp_path):
    if re.search(r"^\s*(import torch|from routepack\.torch)", code, re.M):
        pytest.importorskip("torch")
    ranks = re.search(r"\(torchrun --nproc-per-node (\d+)\)$", what)
    if ranks:
        script = tmp_path / "example.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            ranks.group(1), str(script)], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, "%s (%s) under torchrun:\n%s" % (doc, what, (r.stdout + r.stderr)[-4000:])
        return
    exec(compile(code, "%s (%s)" % (doc, what), "exec"), {"__name__": "doc_example"})
