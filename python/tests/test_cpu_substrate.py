"""The CPU substrate (issue 30, docs/calibration.md "The CPU substrate"): routepack.cpu
times the thread's CPU time (a call that sleeps costs nothing), the least of N; pin() leaves
one thread on one core, and keeps freed memory in the heap as a GPU's caching allocator does; the calibration's CPU device runs fp32 with that timer; fidelity
measure splits the cells over pinned workers without losing or repeating one; and the
shipped CPU profile (config, calibration, trace) loads and prices."""

import json
import os
import subprocess
import time

import pytest

from conftest import REPO, cli_path

from routepack import calibrate, cpu, fidelity

CPU_DIR = REPO / "examples" / "cpu"


def test_min_thread_seconds_counts_cpu_not_wall():
    calls = []

    def sleepy():
        calls.append(1)
        time.sleep(0.03)      # 30 ms of wall, next to no CPU
    t = cpu.min_thread_seconds(sleepy, warmup=2, reps=3)
    assert len(calls) == 5
    assert 0 <= t < 0.01


def test_min_thread_seconds_is_the_least(monkeypatch):
    """A fake thread clock: the calls cost 5, 2, 9, 3 and 7 units; the first is warmup."""
    costs = iter([5.0, 2.0, 9.0, 3.0, 7.0])
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "thread_time", lambda: clock[0])

    def call():
        clock[0] += next(costs)
    assert cpu.min_thread_seconds(call, warmup=1, reps=4) == 2.0


def test_pin_one_thread_one_core():
    pytest.importorskip("torch", reason="pin sets torch's threads")
    code = ("import os, json, torch; from routepack import cpu; c = cpu.pin(%d); "
            "print(json.dumps([c, sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))")
    cores = sorted(os.sched_getaffinity(0))
    for index in (0, 1, len(cores)):
        out = subprocess.run([os.sys.executable, "-c", code % index], capture_output=True, text=True, check=True)
        core, aff, threads = json.loads(out.stdout)
        assert core == cores[index % len(cores)] and aff == [core] and threads == 1


# In a fresh process (glibc's thresholds are per process): malloc 16 MiB, free it, and
# report glibc's mallinfo2 before, holding and after: the bytes mmap'd (hblkhd) and the
# heap's size (arena). With the caller's ARG true, keep_freed_memory() runs first.
_MALLINFO = r"""
import ctypes, ctypes.util, json, sys
from routepack import cpu
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit(0)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
why = cpu.keep_freed_memory() if ARG else None
snap = lambda: (lambda i: {"hblkhd": i.hblkhd, "arena": i.arena})(libc.mallinfo2())
before = snap()
p = libc.malloc(16 << 20)
holding = snap()
libc.free(p)
print(json.dumps({"why": why, "before": before, "holding": holding, "after": snap()}))
"""


def _mallinfo(keep):
    out = subprocess.run([os.sys.executable, "-c", _MALLINFO.replace("ARG", str(keep))], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_keep_freed_memory_keeps_a_large_block_in_the_heap():
    """glibc's default mmaps a 16 MiB block and unmaps it when freed (the next step faults
    its pages in again); after keep_freed_memory() the block comes from the heap and stays
    there once freed."""
    plain, kept = _mallinfo(False), _mallinfo(True)
    if plain is None:
        pytest.skip("the C library has no mallinfo2 (not glibc 2.33+)")
    assert plain["holding"]["hblkhd"] - plain["before"]["hblkhd"] >= 16 << 20   # the default: mmap'd
    assert kept["why"] is None
    assert kept["holding"]["hblkhd"] == kept["before"]["hblkhd"]                 # kept: from the heap,
    assert kept["holding"]["arena"] >= 16 << 20                                   # which holds it
    assert kept["after"]["arena"] == kept["holding"]["arena"]                     # and keeps it once freed
    # glibc's default trims the heap's free top once it passes 128 KiB: a block freed at
    # the top goes back, which is what kept["after"] must not show


def test_calibration_cpu_device_is_fp32_least_thread_time():
    torch = pytest.importorskip("torch", reason="the CPU device is measured through torch")
    code = ("import json, torch, time; from routepack import calibrate; "
            "d = calibrate.TorchDevice('cpu', 'tiny'); "
            "t = d._time(lambda: time.sleep(0.02)); "
            "print(json.dumps([str(d.dtype), d.name, t]))")
    out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dtype, name, t = json.loads(out.stdout)
    assert dtype == str(torch.float32)
    assert name.startswith("cpu: ") and "1 thread, fp32" in name
    assert t < 0.01          # thread CPU time: the 20 ms of sleep are not counted
    assert "cpu" in calibrate.PROFILES


def _tiny_doc():
    return {"format": fidelity.FORMAT_CELLS,
            "shape": dict(hidden_size=16, expert_ffn_size=8, num_heads=2, num_kv_heads=1, head_dim=8),
            "cells": [{"lengths": [3], "expert_counts": [2, 1]}, {"lengths": [4], "expert_counts": [5, 2]},
                      {"lengths": [2], "expert_counts": [1, 1]}, {"lengths": [5, 2], "expert_counts": [3, 0]},
                      {"lengths": [6], "expert_counts": [4, 4]}],
            "plans": [{"cells": [[0, 1]]}, {"cells": [[2, 3], [4, 0]]}]}


def test_plans_complete_by_hand():
    doc = _tiny_doc()
    assert fidelity.plans_complete(doc, {"0": 1, "1": 1}) == 1
    assert fidelity.plans_complete(doc, {"0": 1, "1": 1, "2": 1, "3": 1, "4": 1}) == 2
    assert fidelity.plans_complete(doc, {"2": 1, "3": 1, "4": 1, "0": 1}) == 0


def test_measure_workers_split_and_merge(tmp_path):
    pytest.importorskip("torch", reason="the cells are timed through torch")
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps(_tiny_doc()))
    out = tmp_path / "measured.json"
    m = fidelity.measure_workers(str(cells), str(out), 2, device="cpu", budget_s=200, reps=1, log=lambda s: None)
    assert sorted(m["seconds"], key=int) == ["0", "1", "2", "3", "4"]
    assert m["plans_complete"] == 2 and m["workers"] == 2 and m["cells_measured"] == 5
    assert all(t > 0 for t in m["seconds"].values())
    assert "thread CPU" in m["timing"]
    assert json.loads(out.read_text()) == m


def test_one_shard_times_only_its_cells():
    pytest.importorskip("torch", reason="the cells are timed through torch")
    code = ("import json; from routepack import fidelity; doc = json.load(open(%r)); "
            "m = fidelity.measure(doc, 'cpu', 200, warmup=0, reps=1, log=lambda s: None, shard=(1, 2)); "
            "print(json.dumps(sorted(m['seconds'], key=int)))")
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(_tiny_doc(), fh)
    try:
        out = subprocess.run([os.sys.executable, "-c", code % fh.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(fh.name)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["1", "3"]


def test_shipped_cpu_profile_loads_and_prices(tmp_path):
    """examples/cpu: the calibration's shape is the config's, measured on a CPU, and the
    config (with it) prices the CPU trace's plans; cells at 1, 2, 4, 8 microbatches."""
    if cli_path() is None:
        pytest.skip("the routepack tool is not built")
    cfg = json.loads((CPU_DIR / "config-cpu.json").read_text())
    cal = json.loads((CPU_DIR / cfg["calibration"]).read_text())
    assert cal["format"] == "routepack-calibration" and cal["device"].startswith("cpu: ")
    assert list(cal["shapes"]) == [calibrate.shape_key(cfg["model"])]
    entry = cal["shapes"][calibrate.shape_key(cfg["model"])]
    assert entry["peak_flops"] == cfg["hardware"]["peak_flops"]
    assert all(0 < x <= 1 for _, x in entry["gemm_efficiency"])
    doc = fidelity.make_cells(CPU_DIR / "config-cpu.json", CPU_DIR / "cpu.rpt", 0, 0, log=lambda s: None,
                              microbatches=(1, 8))
    assert sorted({p["microbatches"] for p in doc["plans"]}) == [1, 8]
    assert doc["num_gpus"] == 2 and doc["ep_size"] == 2
    # the calibrated figures reach the predictions: the 8-microbatch cells are smaller
    one = [x for p in doc["plans"] if p["microbatches"] == 1 for row in p["predicted"] for x in row]
    eight = [x for p in doc["plans"] if p["microbatches"] == 8 for row in p["predicted"] for x in row]
    assert max(one) / min(eight) > 10


def test_results_section_renders_the_figures():
    """scripts/results/cpu_fidelity.py's section: the three columns of tau and MAPE, the
    floor's verdict, the plans' ratios to token_kk+contiguous at the same count, the five
    plans' printout."""
    from conftest import load_script
    mod = load_script("cpu_fidelity", "results/cpu_fidelity.py")
    plans = [{"name": "token_kk+contiguous, 2 microbatches", "predicted_s": 0.2, "measured_s": 0.25},
             {"name": "joint, 2 microbatches", "predicted_s": 0.18, "measured_s": 0.2}]
    score = {"cell_tau": 0.91, "cell_mape_percent": 12.0, "plan_tau": 1.0, "plans": 2, "cells": 8,
             "noise_floor": {"retest_tau": 0.85, "retest_mape_percent": 6.0, "cells": 8, "span": 12.0},
             "per_plan": plans}
    second = dict(score, cell_tau=0.9, cell_mape_percent=15.0, plan_tau=1.0)
    o = {"score": score, "score_second": second, "reps": 3, "plans": 2, "cells": 8, "microbatches": [2],
         "uptime": ["u1", "u2"], "wall_s": [10.0, 12.0], "five": ["five plans: x", "  contiguous y"],
         "five_uptime": "u3"}
    text = mod.render(o, {})
    assert text.startswith("## Measured on CPU (issue 30)\n")
    assert "| cell Kendall tau | 0.910 | 0.900 | 0.850 |" in text
    assert "| cell MAPE | 12.0% | 15.0% | 6.0% |" in text
    assert "below 0.9" in text and "better than the two measurements rank each other" in text
    assert "| joint, 2 microbatches | 180.0 | 200.0 | 0.900 | 0.800 |" in text
    assert "five plans: x\n  contiguous y\n```" in text
    o["score"]["noise_floor"]["retest_tau"] = 0.95
    text = mod.render(o, {})
    assert "The noise floor reaches 0.9; the model meets the target" in text
