"""examples/torch/train_moe.py under torchrun (2 gloo ranks, 10 steps): with the joint
policy (migrations, replicas, shares, a hot swap to token_kk+eplb halfway) every step's
loss and every logical parameter (experts gathered by id) equal those of the run with a
fixed contiguous placement and no replicas (--policy token_kk+contiguous) to fp32
round-off: placement changes where the work runs, never what is computed. And its closing
comparison on CPU: the policy's plan and token_kk+contiguous's for a skewed batch, measured
and predicted (with the cost model calibrated on this CPU), in one line that says which is
which (the figures are wall-clock: printed, never asserted)."""

import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

from conftest import REPO  # noqa: E402

EXAMPLE = REPO / "examples" / "torch" / "train_moe.py"


def _run(policy, dump, world=2, steps=10, extra=()):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(EXAMPLE), "--policy", policy, "--steps", str(steps), "--seqs-per-rank", "4", "--dump", str(dump),
           "--no-benefit"]
    cmd += list(extra)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(cmd), p.stdout[-3000:], p.stderr[-5000:])
    lines = p.stdout.strip().splitlines()
    assert lines[-1].startswith("final loss "), p.stdout
    return p.stdout, torch.load(dump)


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/torch/train_moe.py is not in this tree")
def test_example_equals_the_contiguous_run(tmp_path):
    out, run = _run("routepack", tmp_path / "routepack.pt")
    ref_out, ref = _run("token_kk+contiguous", tmp_path / "contiguous.pt")
    assert "swapped to token_kk+eplb" in out          # the policy was hot-swapped
    moved = [int(l.split("experts moved ")[1].split()[0]) for l in out.splitlines() if "experts moved" in l]
    assert len(moved) == 10 and sum(moved) > 0          # experts did move
    assert all(" experts moved 0 " in l for l in ref_out.splitlines() if "experts moved" in l)
    assert len(run["losses"]) == len(ref["losses"]) == 10
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert run["params"].keys() == ref["params"].keys()
    for name, p in run["params"].items():
        q = ref["params"][name]
        # fp32 round-off: the sums run in another order on other ranks
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        assert (p - q).abs().max() <= 1e-5 * q.abs().max(), name


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/torch/train_moe.py is not in this tree")
def test_planned_ahead_equals_the_contiguous_run_planned_ahead(tmp_path):
    """--plan-ahead: step t + 1 planned on a host thread while step t trains (its rollout one
    update behind, as an asynchronous trainer's); still only where the work runs changes."""
    out, run = _run("routepack", tmp_path / "ahead.pt", steps=6, extra=["--plan-ahead"])
    _, ref = _run("token_kk+contiguous", tmp_path / "ahead-contiguous.pt", steps=6, extra=["--plan-ahead"])
    assert "(planned ahead)" in out and "waited" in out
    moved = [int(l.split("experts moved ")[1].split()[0]) for l in out.splitlines() if "experts moved" in l]
    assert len(moved) == 6 and sum(moved) > 0
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, p in run["params"].items():
        q = ref["params"][name]
        assert (p - q).abs().max() <= 1e-5 * q.abs().max(), name


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/torch/train_moe.py is not in this tree")
def test_example_ends_comparing_measured_and_predicted_with_contiguous():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--steps", "1", "--seqs-per-rank", "2", "--benefit-reps", "1"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(cmd), p.stdout[-3000:], p.stderr[-5000:])
    last = p.stdout.strip().splitlines()[-1]
    m = re.match(r"benefit on this CPU \(2 ranks, 16 sequences, (\d+) tokens\): forward\+backward MEASURED here "
                 r"routepack ([\d.]+) ms vs token_kk\+contiguous ([\d.]+) ms = ([\d.]+)x \(each rank's compute time, "
                 r"least of 1 runs, the slowest rank per microbatch\); PREDICTED by the cost model calibrated on this "
                 r"CPU ([\d.]+) vs ([\d.]+) ms = ([\d.]+)x; the plans differ$", last)
    assert m, last
    ours, base, ratio, p_ours, p_base, p_ratio = (float(x) for x in m.groups()[1:])
    assert ours > 0 and base > 0 and abs(ratio - ours / base) < 2e-3 * max(1.0, ratio)
    assert p_ours > 0 and p_base > 0 and abs(p_ratio - p_ours / p_base) < 2e-3 * max(1.0, p_ratio)
    assert p_ratio < 1, "the cost model predicts the policy's plan faster on this skewed batch: %s" % last
