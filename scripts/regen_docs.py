"""Rewrite the outputs that RoutePack's docs show under their `$ routepack ...` examples
with what the tool prints now (scripts/regen-docs.sh runs this; docblocks.py says which
examples there are). Volatile examples (wall times, the install's paths, hand-made inputs)
are run but left as written; an example that shows only its first lines (ending with a
line `...`) keeps showing as many. Prints what changed and the commands no test runs."""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import docblocks

REPO = Path(__file__).resolve().parent.parent


def run(cli, workdir, command):
    argv = shlex.split(command)
    r = subprocess.run([cli, *argv[1:]], capture_output=True, text=True, cwd=workdir,
                       env=dict(os.environ, RP_EXAMPLES_DIR=str(REPO / "examples")))
    if r.returncode != 0:
        sys.exit("regen-docs: `%s` failed (exit %d):\n%s" % (command, r.returncode, r.stderr))
    return (r.stdout + r.stderr).rstrip("\n").splitlines()


def new_output(printed, shown):
    want = shown.rstrip("\n").splitlines()
    if want and want[-1] == "...":
        return printed[:len(want) - 1] + ["..."]
    return printed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cli", help="the routepack tool to run (e.g. build/routepack)")
    ap.add_argument("--docs-root", default=str(REPO),
                    help="the tree whose docs/ and README.md are read and rewritten "
                         "(default: this source tree; examples/ and policies/ always come from it)")
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 when a doc's output differs (times masked)")
    args = ap.parse_args()
    cli = os.path.abspath(args.cli)
    changed = []
    with tempfile.TemporaryDirectory() as d:
        os.symlink(REPO / "examples", os.path.join(d, "examples"))
        os.symlink(REPO / "policies", os.path.join(d, "policies"))
        for path in docblocks.doc_files(args.docs_root):
            text = path.read_text()
            out, pos = [], 0
            for m in docblocks.EXAMPLE.finditer(text):
                command, shown = m.group(1)[2:], m.group(2)
                if "bad.json" in command:  # hand-made input, not in the tree
                    continue
                printed = run(cli, d, command)
                if docblocks.volatile(command):
                    continue
                lines = new_output(printed, shown)
                old = shown.rstrip("\n").splitlines()
                timed = shlex.split(command)[1] in docblocks.TIMED
                same = (docblocks.masked(lines) == docblocks.masked(old)) if timed else lines == old
                if same:
                    continue
                changed.append("%s: %s" % (path.name, command))
                out.append(text[pos:m.start(2)])
                out.append("\n".join(lines) + "\n")
                pos = m.end(2)
            if pos and not args.check:
                path.write_text("".join(out) + text[pos:])
    for c in changed:
        print(("differs: " if args.check else "rewrote: ") + c)
    print("\nnot run by the docs test (run elsewhere or long):")
    for doc, line in docblocks.other_commands(args.docs_root):
        print("  %s: %s -- %s" % (doc, line, docblocks.not_run_reason(line) or "NOT LISTED"))
    if args.check and changed:
        sys.exit(1)


if __name__ == "__main__":
    main()
