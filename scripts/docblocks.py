"""The command examples of RoutePack's docs, for scripts/regen-docs.sh (which rewrites
their outputs) and python/tests/test_docs_examples.py (which checks them).

An *example* is a fenced block of docs/*.md or README.md whose first line is
`$ routepack ...`: the command, then what it prints. Other fenced blocks that hold commands
(build steps, the device check, long benchmarks) cannot run in a test; every one of them
must match an entry of NOT_RUN, which says why and where it is exercised instead, so a new
command in the docs is either an example or listed here."""

import re
import shlex
from pathlib import Path

EXAMPLE = re.compile(r"```[a-z]*\n(\$ routepack [^\n]*)\n(.*?)```", re.S)
FENCE = re.compile(r"```([a-z]*)\n(.*?)```", re.S)

# Examples whose output holds wall times, the machine's GPUs, or input made by hand: they
# are run, and their shown output is kept as written.
VOLATILE = {
    "simulate": "plan ms column (wall time); the table is abridged",
    "policy list": "paths of the install",
    "policy check": "wall time of the sample steps",
    "plan validate": "bad.json is hand-made",
    "version": "CUDA and GPUs of the machine",
}

# Examples that print wall times beside deterministic output: compared with times masked.
TIMED = {"stats"}
TIMING = re.compile(r"\d+(\.\d+)? (ms|s|GB/s|MB/s)\b")

# Commands in the docs that no docs test runs, by the start of the line, with the reason.
NOT_RUN = {
    "scripts/install-deps.sh": "installs system packages; .ci/run runs it",
    "scripts/test.sh": "the test suite itself; .ci/run runs it",
    "scripts/results.sh": "long: the measurements behind docs/results.md (10-20 minutes of CPU)",
    "cmake ": "the build; .ci/run configures and builds",
    "CC=clang cmake": "the fuzz build; .ci/run builds and runs the fuzzers",
    "build-fuzz/": "long: libFuzzer runs; scripts/fuzz.sh in .ci/run",
    "ASAN_OPTIONS=": "long: the soak benchmark under ASan",
    "build-asan/": "long: the soak benchmark under ASan",
    "scripts/device-check.sh": "needs an NVIDIA GPU (the device check)",
    "./build/bench/": "long: benchmarks (minutes at the reference scale)",
    "build/bench/": "long: benchmarks",
    "python3 -m venv": "environment setup; scripts/test-python.sh makes the test venv",
    ". .venv/": "environment setup",
    "pip install": "environment setup; scripts/test-python.sh installs the binding",
    "python examples/python/train_loop.py": "python/tests/test_example.py runs it",
    "python examples/adapters/": "python/tests/test_adapters.py runs both adapter examples",
    "python -c \"import routepack": "python/tests/test_install.py imports the installed binding",
    "torchrun": "needs several processes; python/tests/test_torch_example.py and test_megatron_moe.py run the examples",
    "routepack trace import --routing routing.npy": "inputs made by the reader; python/tests/test_import_npz.py and tests/test_cli_trace.c run imports",
}

# A line that looks like a command a reader would type.
COMMAND = re.compile(r"^(\./build/|build[-\w]*/|scripts/|cmake |CC=|ASAN_OPTIONS=|python3? |pip |\. \.venv|torchrun|routepack )")


def doc_files(repo):
    return sorted((Path(repo) / "docs").glob("*.md")) + [Path(repo) / "README.md"]


def examples(repo):
    """(doc file name, command without `$ `, shown output) for every example."""
    for path in doc_files(repo):
        for m in EXAMPLE.finditer(path.read_text()):
            yield path.name, m.group(1)[2:], m.group(2)


def is_synopsis(line):
    """A usage line (`routepack plan eval --config C ... [--json]`, `routepack version  # what
    it does`), not a command: it has optional parts, alternatives, placeholders in capitals
    or a comment."""
    return line.startswith("routepack ") and re.search(r"\[|\||\.\.\.|\b[A-Z][A-Z0-9_]*\b|\s#", line) is not None


def other_commands(repo):
    """(doc file name, line) for every command line in a fenced block that is not an example."""
    for path in doc_files(repo):
        for m in FENCE.finditer(path.read_text()):
            body = m.group(2)
            if body.startswith("$ routepack"):
                continue
            lines = [line.strip() for line in body.splitlines()]
            # In a listing of usage lines, a bare `routepack version` is one more entry.
            listing = any(is_synopsis(line) for line in lines)
            for line in lines:
                if COMMAND.match(line) and not is_synopsis(line) \
                        and not (listing and line.startswith("routepack ")):
                    yield path.name, line


def not_run_reason(line):
    return next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)


def volatile(command):
    words = shlex.split(command)[1:]
    return next((why for cmd, why in VOLATILE.items() if words[:len(cmd.split())] == cmd.split()),
                None)


def masked(lines):
    return [TIMING.sub("<time>", line) for line in lines]
