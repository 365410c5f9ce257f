"""The CPU as a measured device (issue 30): what ``routepack.calibrate --device cpu`` and
``routepack.fidelity measure --device cpu`` time with.

- one thread a rank, pinned to one core (``pin``): torch's intra-op pool at one thread,
  the process on core ``index % cores``;
- fp32 (``DTYPE``): CPUs without native BF16 GEMMs emulate it, at a cost the GPU's BF16
  never pays;
- the least of N calls' thread CPU time (``min_thread_seconds``): what the rank computed,
  not what it waited for while other processes held its core (the machine is shared);
  other jobs only ever make a call slower, so the least is the closest to the work;
- the load average beside every figure (``load``).

Torch runs a CPU tensor's backward on the calling thread, so its thread time counts the
backward too."""

from __future__ import annotations

import os
import time

DTYPE_NAME = "float32"


def dtype():
    import torch
    return torch.float32


def pin(index=0):
    """One thread, on core ``index`` modulo the cores this process may use. Returns the
    core."""
    import torch
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def min_thread_seconds(fn, warmup=1, reps=5):
    """The least thread CPU time of ``reps`` calls of fn() after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(max(int(reps), 1)):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def load():
    """The 1-minute load average and the cores, as a string for a log line."""
    try:
        one = os.getloadavg()[0]
    except OSError:
        return "load unknown"
    return "load %.2f on %d cores" % (one, os.cpu_count() or 0)
