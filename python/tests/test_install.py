"""Where the package finds libroutepack, and that an installed copy is self-contained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import routepack
from routepack import _lib


def run_python(code, **env):
    full = dict(os.environ)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd="/")


def test_env_var_is_the_only_candidate(monkeypatch):
    monkeypatch.setenv("ROUTEPACK_LIBRARY", "/nowhere/libroutepack.so")
    assert _lib.candidates() == [("$ROUTEPACK_LIBRARY", "/nowhere/libroutepack.so")]


def test_search_order(monkeypatch):
    monkeypatch.delenv("ROUTEPACK_LIBRARY", raising=False)
    wheres = [w for w, _ in _lib.candidates()]
    order = ["next to the package", "the system library path"]
    if "the repository's build/core" in wheres:
        order.insert(1, "the repository's build/core")
    firsts = [wheres.index(w) for w in order]
    assert firsts == sorted(firsts)


def test_bad_env_var_names_the_path():
    r = run_python("import routepack\n"
                   "try:\n"
                   "    routepack.library_path()\n"
                   "except routepack.LibraryError as e:\n"
                   "    print('LibraryError:', e)\n",
                   ROUTEPACK_LIBRARY="/nowhere/libroutepack.so")
    assert r.returncode == 0, r.stderr
    assert "LibraryError:" in r.stdout and "/nowhere/libroutepack.so" in r.stdout
    assert "ROUTEPACK_LIBRARY" in r.stdout


def test_env_var_overrides(tmp_path):
    lib = routepack.library_path()
    r = run_python("import routepack; print(routepack.library_path())", ROUTEPACK_LIBRARY=lib)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == lib


@pytest.mark.skipif(not os.environ.get("ROUTEPACK_TEST_INSTALLED"),
                    reason="run by scripts/test-python.sh against the pip-installed package")
def test_installed_copy_bundles_the_library():
    pkg = Path(routepack.__file__).resolve().parent
    source = Path(os.environ["ROUTEPACK_SOURCE_DIR"]).resolve() / "python"
    assert source not in pkg.parents, "tests imported the source tree, not the installed package"
    assert Path(routepack.library_path()).resolve() == pkg / "libroutepack.so"


def test_import_routepack_never_imports_torch():
    """routepack.torch is optional: the numpy binding loads without it, and without torch
    importing routepack.torch says how to install it."""
    p = run_python("import sys, routepack, routepack.executor\n"
                   "s = routepack.Scheduler\n"
                   "print('torch' in sys.modules)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
    # torch hidden: the ImportError names the extra
    p = run_python("import sys\nsys.modules['torch'] = None\n"
                   "try:\n    import routepack.torch\nexcept ImportError as e:\n    print(e)\n")
    assert p.returncode == 0, p.stderr
    assert "routepack[torch]" in p.stdout


def test_torch_imports_after_the_library():
    """A library built with NCCL depends on libnccl.so.2, which the loader binds to the
    first one loaded: the toolkit's made `import torch` after `import routepack` fail
    (undefined symbol ncclCommResume). The binding loads PyTorch's NCCL first."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    p = run_python("import sys, routepack\nfrom routepack import _lib\n_lib.load()\n"
                   "assert 'torch' not in sys.modules\nimport torch\nprint(torch.__version__)")
    assert p.returncode == 0, p.stderr
