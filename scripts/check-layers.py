#!/usr/bin/env python3
"""The floors of core/ (docs/layers.md): every call between two files of the library and
the CLI, read from the built object files' symbols (nm: what each defines, what it
needs), checked against the layer table. Fails (exit 1) when

  - a file calls a file on a higher floor (an upward call), or
  - two or more files call each other round a loop (within a floor as well),

unless the edge is a known exception listed in docs/layers.md, and also when a listed
exception no longer occurs (the list only shrinks). A file that no floor names fails too,
so a new file must be placed. Static functions never show (they cannot be called from
another file), nor do calls through function pointers (the callbacks a lower floor
declares: rp_progress_fn, transport callbacks, the CLI's command table is data).

Usage: scripts/check-layers.py [BUILD_DIR] [--edges] [--table LAYERS.md]   (default build;
--edges prints every call edge with the symbols behind it; --table reads another table
than docs/layers.md)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "layers.md")
OBJECT_DIRS = [("core/CMakeFiles/routepack_obj.dir", ""),
               ("core/CMakeFiles/routepack_cli.dir/cli", "cli/")]


def read_table(path):
    """floor of each source file (relative to core/), and the known exceptions
    (from, to) -> reason, from docs/layers.md."""
    floors, exceptions, section = {}, {}, None
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):
            section = line[3:].strip().lower()
            continue
        if section == "floors" and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3 or not cells[0].isdigit():
                continue
            for name in re.findall(r"`([^`]+\.c)`", cells[2]):
                if name in floors:
                    sys.exit("check-layers: %s is on two floors in %s" % (name, path))
                floors[name] = int(cells[0])
        elif section == "known exceptions":
            m = re.match(r"- `([^`]+\.c)` -> `([^`]+\.c)`: (.+)", line.strip())
            if m:
                exceptions[(m.group(1), m.group(2))] = m.group(3)
    return floors, exceptions


def symbols(build):
    """{file: defined global symbols}, {file: undefined symbols}, over the object files."""
    defined, needed = {}, {}
    for sub, prefix in OBJECT_DIRS:
        d = os.path.join(build, sub)
        if not os.path.isdir(d):
            sys.exit("check-layers: %s not found: build first (cmake --build %s)" % (d, build))
        for name in sorted(os.listdir(d)):
            if not name.endswith(".c.o"):
                continue
            src = prefix + name[:-2]
            out = subprocess.run(["nm", os.path.join(d, name)], capture_output=True, text=True,
                                 check=True).stdout
            for row in out.splitlines():
                parts = row.split()
                if len(parts) == 2 and parts[0] == "U":
                    needed.setdefault(src, set()).add(parts[1])
                elif len(parts) == 3 and parts[1] in "TDBRCVW":
                    defined.setdefault(src, set()).add(parts[2])
            defined.setdefault(src, set())
    return defined, needed


def call_edges(defined, needed):
    """{(from, to): symbols} for every call from one file into another's symbols."""
    owner = {}
    for f, syms in defined.items():
        for s in syms:
            owner.setdefault(s, f)
    edges = {}
    for f, syms in needed.items():
        for s in syms:
            g = owner.get(s)
            if g is not None and g != f:
                edges.setdefault((f, g), set()).add(s)
    return edges


def loops(files, edges):
    """The strongly connected components of more than one file (Tarjan)."""
    graph = {f: sorted(g for (a, g) in edges if a == f) for f in files}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for f in sorted(files):
        if f not in index:
            visit(f)
    return out


def main(argv):
    table, args, i = TABLE, [], 0
    while i < len(argv):
        if argv[i] == "--table" and i + 1 < len(argv):
            table = argv[i + 1]
            i += 1
        elif not argv[i].startswith("--"):
            args.append(argv[i])
        i += 1
    build = args[0] if args else os.path.join(ROOT, "build")
    floors, exceptions = read_table(table)
    defined, needed = symbols(build)
    files = set(defined)
    edges = call_edges(defined, needed)
    if "--edges" in argv:
        for (a, b), syms in sorted(edges.items()):
            print("%s -> %s: %s" % (a, b, " ".join(sorted(syms))))
    problems = []
    for f in sorted(files - set(floors)):
        problems.append("%s is on no floor: add it to docs/layers.md" % f)
    for e in sorted(set(exceptions) - set(edges)):
        problems.append("known exception %s -> %s no longer occurs: take it out of docs/layers.md" % e)
    # the known exceptions are left out of both checks: each is one edge to remove
    kept = {e: syms for e, syms in edges.items() if e not in exceptions}
    for (a, b), syms in sorted(kept.items()):
        if a in floors and b in floors and floors[b] > floors[a]:
            problems.append("%s (floor %d) calls %s (floor %d) upward: %s"
                            % (a, floors[a], b, floors[b], " ".join(sorted(syms))))
    for comp in loops(files, kept):
        inside = ["%s -> %s (%s)" % (a, b, " ".join(sorted(kept[(a, b)])))
                  for (a, b) in sorted(kept) if a in comp and b in comp]
        problems.append("a loop of calls among %s: %s" % (", ".join(comp), "; ".join(inside)))
    for p in problems:
        print("check-layers: " + p)
    print("check-layers: %d files on %d floors, %d call edges, %d known exceptions: %s"
          % (len(files), len(set(floors.values())), len(edges), len(exceptions),
             "FAIL" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
