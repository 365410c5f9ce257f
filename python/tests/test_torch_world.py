"""torch_world, the helper every routepack.torch test runs its gloo ranks through: a rank
whose function returned first does not tear gloo down (nor exit) while a peer is still
running its function, and a rank that raises is reported with its traceback."""

import os
import time

import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")
import torch.distributed as dist  # noqa: E402

import torch_world  # noqa: E402


def _process_state(pid):
    """The state letter of /proc/PID/status (R, S, Z, ...), or None once it is reaped."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split()[1]
    except FileNotFoundError:
        return None
    return None


def _slow_last_rank(rank, world):
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank != world - 1:
        return rank
    # the other ranks returned at once; they must still be there, gloo up, 0.5 s later
    time.sleep(0.5)
    return [_process_state(p) for p in pids[:-1]]


def test_no_rank_leaves_before_its_peers_finish():
    out = torch_world.run(_slow_last_rank, 3, timeout=60)
    assert out[:2] == [0, 1]
    # without the barrier before teardown the early ranks have exited (zombies: Z)
    assert all(s is not None and s != "Z" for s in out[2]), out[2]


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def test_a_failing_rank_is_reported():
    with pytest.raises(AssertionError, match="rank one fails on purpose"):
        torch_world.run(_raise_on_one, 2, timeout=60)
