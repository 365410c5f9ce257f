"""examples/python/train_loop.py runs as documented: per-step predicted times, the refused
broken policy, the swap, and (when the library can checkpoint) an identical resume."""

import os
import subprocess
import sys

import routepack
from conftest import REPO

EXAMPLE = REPO / "examples" / "python" / "train_loop.py"


def test_train_loop_runs():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "9", "--swap-at", "4",
                        "--checkpoint-at", "5"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    rows = [l for l in lines if l[:4].strip().isdigit()]
    assert [int(l.split()[0]) for l in rows] == list(range(9))
    assert "swap refused" in rows[2] and "broken on purpose" in rows[2]
    assert "swapped in" in rows[4]
    if routepack.can_checkpoint():
        assert any("plans identical" in l for l in lines)
    else:
        assert any("cannot save scheduler state" in l for l in lines)
