"""examples/torch/bench_migrate.py --phases: the messenger's calls are timed on the
instance (the executor's transport calls them through it) and one call's wall time is
split into exchanges, posting, each batch's transfer (from its start's end to its
wait's end) and the rest. No process group is needed."""

import os
import sys

import pytest

pytest.importorskip("torch", reason="bench_migrate.py needs PyTorch (pip install torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
import bench_migrate  # noqa: E402


class _Messenger:
    def __init__(self):
        self.calls = []

    def start(self, messages):
        self.calls.append(("start", messages))

    def wait(self, timeout_s):
        self.calls.append(("wait", timeout_s))

    def allgather(self, data, timeout_s):
        self.calls.append(("allgather", data))
        return data * 2


def test_the_messenger_calls_are_timed_and_still_made():
    m = _Messenger()
    log = bench_migrate.time_phases(m)
    m.allgather(b"ab", 1.0)
    m.start(["x"])
    m.wait(2.0)
    assert m.allgather(b"c", 1.0) == b"cc"
    assert m.calls == [("allgather", b"ab"), ("start", ["x"]), ("wait", 2.0), ("allgather", b"c")]
    assert [name for name, _, _ in log] == ["allgather", "start", "wait", "allgather"]
    assert all(began <= ended for _, began, ended in log)


def test_a_call_is_split_into_exchanges_posting_transfer_and_the_rest():
    # two rounds: agree, (start, wait, decide) twice; times in seconds
    log = [("allgather", 0.0, 1.0),
           ("start", 3.0, 4.0), ("wait", 4.5, 10.0), ("allgather", 10.5, 12.0),
           ("start", 13.0, 13.5), ("wait", 13.5, 20.0), ("allgather", 20.0, 21.0)]
    exchanges, posting, transfer, rest = bench_migrate.phases(log, 22.0)
    assert exchanges == pytest.approx(1.0 + 1.5 + 1.0)
    assert posting == pytest.approx(1.0 + 0.5)
    assert transfer == pytest.approx((10.0 - 4.0) + (20.0 - 13.5))
    assert rest == pytest.approx(22.0 - 3.5 - 1.5 - 12.5)


def test_the_link_script_refuses_a_rate_that_is_not_a_number():
    import subprocess
    script = os.path.join(ROOT, "scripts", "bench-migrate-link.sh")
    out = subprocess.run(["sh", script, "ten"], capture_output=True, text=True)
    assert out.returncode == 2 and "GBIT must be a number, got 'ten'" in out.stderr, out
    out = subprocess.run(["sh", script], capture_output=True, text=True)
    assert out.returncode != 0 and "usage: scripts/bench-migrate-link.sh GBIT" in out.stderr, out
