"""The scripts a newcomer runs first: scripts/test.sh's closing summary of what was skipped
(scripts/tap-log.sh keeps each TAP program's output for it without changing what prove
prints or its exit status; scripts/test_summary.py groups the skips and names the command
that would run them), and scripts/install-deps.sh waiting for another apt's lock."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
import test_summary  # noqa: E402


def tap_program(path, text, status=0):
    path.write_text("#!/bin/sh\ncat <<'TAP'\n%sTAP\nexit %d\n" % (textwrap.dedent(text), status))
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which("prove") is None, reason="prove (perl) is not installed")
def test_tap_log_passes_prove_the_output_and_the_status(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    tap_program(tests / "a.t", """\
        ok 1 - works
        ok 2 # SKIP no GPU
        ok 3 # skip no GPU
        1..3
        """)
    tap_program(tests / "b.t", "ok 1 - fine\nnot ok 2 - broken\n1..2\n", status=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ, RP_TAP_LOG_DIR=str(logs))

    def prove(*args):
        return subprocess.run(["prove", *args, "tests/"], cwd=tmp_path, env=env, capture_output=True, text=True)

    plain, logged = prove(), prove("--exec", str(SCRIPTS / "tap-log.sh"))
    strip = lambda out: [l for l in out.splitlines() if "wallclock" not in l]  # noqa: E731
    assert strip(logged.stdout) == strip(plain.stdout), "prove prints the same through tap-log.sh"
    assert plain.returncode != 0 and logged.returncode == plain.returncode, "a failing program still fails prove"
    assert "Result: FAIL" in logged.stdout
    assert (logs / "a.t.tap").read_text().splitlines()[1] == "ok 2 # SKIP no GPU"
    assert test_summary.tap_skips(logs) == {"no GPU": 2}


def test_summary_groups_the_skips_and_names_the_command(tmp_path):
    # a real pytest JUnit file: skips for torch, a GPU, Chromium and something else
    (tmp_path / "test_fake.py").write_text(textwrap.dedent("""\
        import pytest
        def test_torch():
            pytest.skip("routepack.torch needs PyTorch (pip install torch)")
        def test_gpu():
            pytest.skip("no GPU (torch.cuda.is_available() is False)")
        def test_browser():
            pytest.skip("no Chromium on this machine")
        def test_hand():
            pytest.skip("hand-made input")
        def test_runs():
            pass
        """))
    xml = tmp_path / "logs" / "pytest.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml),
                        str(tmp_path / "test_fake.py")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "logs" / "test_x.t.tap").write_text(
        "ok 1 # SKIP no GPU\nok 2 # SKIP no GPU\nok 3 # SKIP mpirun not found\nok 4 - fine\n1..4\n")
    (tmp_path / "logs" / "test_y.t.tap").write_text("1..0 # SKIP fixture\n")
    r = subprocess.run([sys.executable, str(SCRIPTS / "test_summary.py"), str(tmp_path / "logs"), "build"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "test.sh: skipped 4 TAP checks and 4 pytest tests:"
    assert lines[1].startswith("  no GPU: 2 TAP checks, 1 pytest test; to run them: scripts/device-check.sh")
    assert lines[2].startswith("  no torch: 1 pytest test; to run them: ROUTEPACK_TEST_TORCH=1 scripts/test.sh "
                               "build (installs PyTorch from PyPI into build/python-venv once: about 3 GB")
    assert lines[3] == "  no Chromium: 1 pytest test; to run them: apt-get install chromium, then scripts/test.sh build"
    assert lines[4].startswith("  no MPI: 1 TAP check; to run them: scripts/install-deps.sh")
    assert lines[5] == "  other: 1 TAP check, 1 pytest test (fixture: 1; hand-made input: 1)"
    assert len(lines) == 6
    assert test_summary.summary({}, {}) == ["test.sh: nothing skipped"]


def test_test_sh_prints_the_summary_after_prove_and_pytest():
    """The order CI relies on: prove's closing lines, then pytest's, then the summary;
    the exit status is prove's when it fails, else pytest's."""
    text = (SCRIPTS / "test.sh").read_text()
    prove = text.index('prove --failures -j"$(nproc)" --exec "$root/scripts/tap-log.sh" tests/')
    pytest_run = text.index('"$root/scripts/test-python.sh" "$build" --junitxml="$logs/pytest.xml"')
    summary = text.index('python3 "$root/scripts/test_summary.py"')
    assert prove < pytest_run < summary < text.index("exit $rc")
    assert "if [ $rc -eq 0 ]; then" in text[prove:pytest_run]


def test_install_deps_waits_for_the_apt_lock(tmp_path):
    """Every apt-get call of install-deps.sh waits for a lock another apt holds
    (DPkg::Lock::Timeout) instead of failing at once."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    (fake / "apt-get").write_text('#!/bin/sh\necho "$@" >> %s\n' % calls)
    (fake / "id").write_text("#!/bin/sh\necho 0\n")  # as root: no sudo
    for f in fake.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH="%s:%s" % (fake, os.environ["PATH"]))
    r = subprocess.run(["bash", str(SCRIPTS / "install-deps.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    assert [l.split()[2] for l in lines] == ["update", "install"]
    assert all(l.startswith("-o DPkg::Lock::Timeout=600 ") for l in lines), lines
    calls.unlink()
    env["RP_APT_LOCK_TIMEOUT"] = "30"
    subprocess.run(["bash", str(SCRIPTS / "install-deps.sh")], env=env, check=True, capture_output=True)
    assert all(l.startswith("-o DPkg::Lock::Timeout=30 ") for l in calls.read_text().splitlines())


@pytest.mark.parametrize("doc", ["README.md", "docs/torch.md"])
def test_the_docs_give_both_torch_routes_with_their_size(doc):
    text = " ".join((REPO / doc).read_text().split())
    assert "pip install './python[torch]'" in text and "about 3 GB" in text and "5 minutes" in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "ROUTEPACK_TEST_TORCH=1 scripts/test.sh" in text
