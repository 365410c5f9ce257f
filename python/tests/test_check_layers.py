"""scripts/check-layers.py: on the library as built it passes (every call runs down a floor
or is a listed exception); on tiny object files compiled here it finds an upward call, a
loop of calls within a floor, a file no floor names and a listed exception that no
longer occurs, each by name, and passes once they are mended."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "check-layers.py"


def _check(build, table=None):
    cmd = [sys.executable, str(SCRIPT), str(build)] + (["--table", str(table)] if table else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def test_the_library_as_built_keeps_its_floors():
    build = os.environ.get("ROUTEPACK_BUILD_DIR") or str(REPO / "build")
    if not os.path.isdir(os.path.join(build, "core", "CMakeFiles", "routepack_obj.dir")):
        pytest.skip("no CMake build of the library at %s" % build)
    rc, out = _check(build)
    assert rc == 0, out
    assert out.strip().endswith("ok")


def _build(tmp_path, sources):
    """Compile {name: C text} into the object layout check-layers reads."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    obj = tmp_path / "build" / "core" / "CMakeFiles" / "routepack_obj.dir"
    cli = tmp_path / "build" / "core" / "CMakeFiles" / "routepack_cli.dir" / "cli"
    obj.mkdir(parents=True)
    cli.mkdir(parents=True)
    for name, text in sources.items():
        src = tmp_path / name.replace("/", "_")
        src.write_text(text)
        out = (cli / (name[4:] + ".o")) if name.startswith("cli/") else (obj / (name + ".o"))
        subprocess.run([cc, "-c", str(src), "-o", str(out)], check=True)
    return tmp_path / "build"


def _table(tmp_path, floors, exceptions=()):
    rows = "\n".join("| %d | f | %s |" % (f, " ".join("`%s`" % n for n in names)) for f, names in floors)
    exc = "\n".join("- `%s` -> `%s`: why" % e for e in exceptions)
    path = tmp_path / "layers.md"
    path.write_text("# t\n\n## Floors\n\n| floor | what | files |\n| --- | --- | --- |\n%s\n\n"
                    "## Known exceptions\n\n%s\n" % (rows, exc))
    return path


SOURCES = {
    "base.c": "int base_f(void) { return 1; }\n",
    "low.c": "int high_f(void);\nint low_f(void) { return high_f(); }\n",          # calls upward
    "high.c": "int base_f(void);\nint high_f(void) { return base_f(); }\n",
    "a.c": "int b_f(void);\nint a_f(void) { return b_f(); }\nint a_g(void) { return 2; }\n",
    "b.c": "int a_g(void);\nint b_f(void) { return a_g(); }\n",                       # a <-> b
    "cli/main.c": "int high_f(void);\nint main(void) { return high_f(); }\n",
}


def test_upward_calls_loops_unplaced_files_and_stale_exceptions_are_named(tmp_path):
    build = _build(tmp_path, SOURCES)
    table = _table(tmp_path, [(0, ["base.c"]), (1, ["low.c", "a.c", "b.c"]), (2, ["high.c"])],
                   exceptions=[("base.c", "high.c")])
    rc, out = _check(build, table)
    assert rc == 1
    assert "low.c (floor 1) calls high.c (floor 2) upward: high_f" in out
    assert "a loop of calls among a.c, b.c: a.c -> b.c (b_f); b.c -> a.c (a_g)" in out
    assert "cli/main.c is on no floor" in out
    assert "known exception base.c -> high.c no longer occurs" in out
    assert out.strip().endswith("FAIL")

    # mended: low.c's call listed as an exception, the loop broken, main.c placed
    sources = dict(SOURCES, **{"b.c": "int b_f(void) { return 3; }\n"})
    build = _build(tmp_path / "again", sources)
    table = _table(tmp_path, [(0, ["base.c"]), (1, ["low.c", "a.c", "b.c"]), (2, ["high.c"]),
                              (3, ["cli/main.c"])], exceptions=[("low.c", "high.c")])
    rc, out = _check(build, table)
    assert rc == 0, out
