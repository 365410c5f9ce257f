"""The closing summary of scripts/test.sh: every skipped TAP check (`ok N # SKIP reason`,
from the copies scripts/tap-log.sh keeps) and every skipped pytest test (pytest's JUnit
XML), grouped by why (no GPU, no torch, no Chromium, no MPI, ...), each group with the
command that would run it. Printed after prove's and pytest's own closing lines, which
it leaves as they are.

Usage: python3 scripts/test_summary.py LOG_DIR BUILD_DIR"""

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TAP_SKIP = re.compile(r"^ok \d+\b[^#]*#\s*skip\b:?\s*(.*)$", re.I)
TAP_PLAN_SKIP = re.compile(r"^1\.\.0\s*#\s*skip\b:?\s*(.*)$", re.I)

# (group, how to tell it from the reason, what runs it); the first that matches wins.
# {build} is the build folder as the user named it.
GROUPS = [
    ("no GPU", re.compile(r"\bGPU|CUDA|NCCL", re.I),
     "scripts/device-check.sh on a machine with an NVIDIA GPU and the CUDA toolkit"),
    ("no torch", re.compile(r"torch|megatron", re.I),
     "ROUTEPACK_TEST_TORCH=1 scripts/test.sh {build} (installs PyTorch from PyPI into "
     "{build}/python-venv once: about 3 GB, 5 minutes; docs/torch.md)"),
    ("no Chromium", re.compile(r"chromium", re.I),
     "apt-get install chromium, then scripts/test.sh {build}"),
    ("no MPI", re.compile(r"\bMPI\b|mpirun", re.I),
     "scripts/install-deps.sh (Open MPI), then cmake -S . -B {build} and scripts/test.sh {build}"),
    ("sanitizer build", re.compile(r"sanitiz|ASan", re.I),
     "scripts/test.sh on a build without -DRP_SANITIZE"),
]


def tap_skips(log_dir):
    """Reason -> count of skipped checks over every kept TAP log."""
    counts = Counter()
    for path in sorted(Path(log_dir).glob("*.tap")):
        for line in path.read_text(errors="replace").splitlines():
            m = TAP_SKIP.match(line) or TAP_PLAN_SKIP.match(line)
            if m:
                counts[m.group(1).strip() or "no reason given"] += 1
    return counts


def pytest_skips(xml_path):
    """Reason -> count of skipped tests in pytest's JUnit XML (absent: none ran)."""
    counts = Counter()
    if not Path(xml_path).exists():
        return counts
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        for skipped in case.findall("skipped"):
            why = skipped.get("message") or "no reason given"
            counts[re.sub(r"^Skipped:\s*", "", why).strip()] += 1
    return counts


def group_of(reason):
    return next((g for g in GROUPS if g[1].search(reason)), None)


def plural(n, word):
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


def summary(tap, py, build="build"):
    """The summary's lines."""
    total_tap, total_py = sum(tap.values()), sum(py.values())
    if not total_tap and not total_py:
        return ["test.sh: nothing skipped"]
    lines = ["test.sh: skipped %s and %s:" % (plural(total_tap, "TAP check"), plural(total_py, "pytest test"))]
    rows = {}
    for source, counts in (("TAP check", tap), ("pytest test", py)):
        for reason, n in counts.items():
            g = group_of(reason)
            key = g[0] if g else "other"
            row = rows.setdefault(key, {"TAP check": Counter(), "pytest test": Counter(), "group": g})
            row[source][reason] += n
    order = [g[0] for g in GROUPS] + ["other"]
    for key in sorted(rows, key=order.index):
        row = rows[key]
        parts = [plural(sum(row[s].values()), s) for s in ("TAP check", "pytest test") if row[s]]
        if row["group"]:
            lines.append("  %s: %s; to run them: %s" % (key, ", ".join(parts), row["group"][2].format(build=build)))
        else:
            reasons = Counter()
            for s in ("TAP check", "pytest test"):
                reasons.update(row[s])
            lines.append("  other: %s (%s)" % (", ".join(parts), "; ".join(
                "%s: %d" % (r, n) for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))))
    return lines


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    log_dir, build = Path(argv[1]), argv[2]
    print("\n".join(summary(tap_skips(log_dir), pytest_skips(log_dir / "pytest.xml"), build)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
