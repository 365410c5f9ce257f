"""examples/torch/bench_moe.py five's batch is what its docstring says it was chosen for,
from the predictions alone: under the CPU profile its five plans are five different plans,
predicted at least 4.5% apart both ways (the whole step, and the same plans re-priced with
communication free, which the ranks' thread CPU time is set against), with routepack giving
an extra replica; and re-pricing a plan with `routepack plan eval` under the config it was
planned with gives the step the scheduler reported. No process group is needed: the
bench's planning half runs here, its timing half is the bench's."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="bench_moe.py needs PyTorch (pip install torch)")

from conftest import cli_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
import bench_moe  # noqa: E402


def _hardware():
    """cpu_hardware's figures with --calibration at 2 ranks: the file's links where it has
    them (the bench measures them otherwise)."""
    hw = dict(bench_moe.calibrated(os.path.join(ROOT, "examples", "cpu", "calibration-cpu.json"), 256, 512, 2),
              dense_efficiency=1.0)
    return hw, {"nvlink_bytes_per_s": hw.pop("nvlink_bytes_per_s", 8e8),
                "nvlink_latency_us": hw.pop("nvlink_latency_us", 200.0)}


def _args():
    # the defaults main() gives `five`
    return SimpleNamespace(hidden=256, ffn=512, experts=8, top_k=2, tokens=2048, seqs=8, microbatches=4,
                           skew=8.0, hot_experts=3, spare_slots=1, dedup="gpu", expert_gemm="loop")


@pytest.fixture
def five(monkeypatch):
    monkeypatch.setenv("ROUTEPACK_CLI", cli_path())
    args = _args()
    hw, links = _hardware()
    lens, routing = bench_moe.five_batch(args, 2)
    return bench_moe.five_plans(args, 2, hw, links, lens, routing)


def test_five_distinct_plans_predicted_apart(five):
    labels = [p[0] for p in five]
    assert labels == [label for label, *_ in bench_moe.FIVE]
    # five different plans: the balancer runs contiguous's packing under its own expert side
    keys = {(res.plan_hash, balancer) for _, res, _, _, balancer, _ in five}
    assert len(keys) == 5
    by = {p[0]: p for p in five}
    assert len(by["routepack"][1].extra_replicas) >= 1
    assert len(by["routepack-no-extras"][1].extra_replicas) == 0
    for col in (2, 3):   # whole step, communication free
        times = sorted(p[col] for p in five)
        gaps = [b / a - 1 for a, b in zip(times, times[1:])]
        assert min(gaps) >= 0.045, (col, [round(t * 1e3, 1) for t in times])
    # communication free is never dearer than the whole step
    assert all(p[3] <= p[2] for p in five)


def test_five_reprice_matches_the_scheduler(five, monkeypatch, tmp_path):
    """plan eval of a plan under its own config reprices it as the scheduler did, so the
    communication-free figure differs from the whole step by the communication alone."""
    import routepack
    from routepack import fidelity

    args = _args()
    hw, links = _hardware()
    lens, routing = bench_moe.five_batch(args, 2)
    cfg = {"topology": dict({"num_nodes": 1, "gpus_per_node": 2, "ep_size": 2, "slots_per_gpu": 5}, **links),
           "model": {"num_layers": 1, "num_experts": 8, "top_k": 2, "hidden_size": 256, "expert_ffn_size": 512,
                     "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "dense_params": 0,
                     "bytes_per_param": 4, "bytes_per_grad": 4},
           "hardware": hw, "limits": {"max_tokens_per_microbatch": 1 << 20, "num_microbatches": 4},
           "execution": {"executor": "routepack_torch", "dispatch_dedup": "gpu", "expert_gemm": "loop"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    trace = tmp_path / "batch.rpt"
    w = routepack.TraceWriter(trace, 8)
    w.append(0, lens, routing)
    w.close()
    with routepack.Scheduler(cfg, policy="routepack", log_level=None) as s:
        res = s.step(lens, routing)
        text = s.plan_json()
    step = fidelity.plan_eval(path, trace, 0, text)["summary"]["step_s"]
    assert step == pytest.approx(res.step_time_s, rel=1e-9)
    assert step == pytest.approx(dict((p[0], p[2]) for p in five)["routepack"], rel=1e-9)


def test_comm_clock_counts_the_calling_threads_time_in_communication(monkeypatch):
    """five's compute is thread CPU time less what the rank's thread spent inside
    torch.distributed's calls: CommClock counts exactly the time inside the wrapped calls,
    whichever module looks them up at call time, and puts the real functions back."""
    import time

    import torch.distributed as dist

    def busy(seconds):
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass

    calls = []
    for name in bench_moe.CommClock.CALLS:
        monkeypatch.setattr(dist, name, lambda *a, name=name, **k: (calls.append(name), busy(0.02)))
    real = {name: getattr(dist, name) for name in bench_moe.CommClock.CALLS}
    with bench_moe.CommClock() as clock:
        busy(0.03)                       # compute: not counted
        dist.all_to_all_single(None, None)
        dist.batch_isend_irecv([])
    assert calls == ["all_to_all_single", "batch_isend_irecv"]
    assert 0.04 <= clock.seconds < 0.07, clock.seconds
    assert all(getattr(dist, name) is fn for name, fn in real.items())
