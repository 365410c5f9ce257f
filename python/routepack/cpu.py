"""The CPU as a measured device (issue 30): what ``routepack.calibrate --device cpu`` and
``routepack.fidelity measure --device cpu`` time with.

- one thread a rank, pinned to one core (``pin``): torch's intra-op pool at one thread,
  the process on core ``index % cores``;
- fp32 (``DTYPE``): CPUs without native BF16 GEMMs emulate it, at a cost the GPU's BF16
  never pays;
- the least of N calls' thread CPU time (``min_thread_seconds``): what the rank computed,
  not what it waited for while other processes held its core (the machine is shared);
  other jobs only ever make a call slower, so the least is the closest to the work;
- freed memory kept for reuse (``keep_freed_memory``, which ``pin`` calls): glibc hands
  a large freed block back to the kernel (mmap'd, or trimmed off the heap's top), so every
  step faults in and zeroes its activations' pages again, at a cost that grows with the
  microbatch. A GPU trainer's caching allocator never pays it. Measured on 2 pinned gloo
  ranks (bench_moe.py's skewed batch), the one-microbatch plan's busiest rank took
  141 ms of thread CPU against EPLB's two-microbatch plan's 130 ms with glibc's
  defaults, and 127 ms against 133 ms with freed memory kept;
- the load average beside every figure (``load``).

Torch runs a CPU tensor's backward on the calling thread, so its thread time counts the
backward too."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

DTYPE_NAME = "float32"


def dtype():
    import torch
    return torch.float32


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX):
# blocks above it are still mmap'd.
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory():
    """Make glibc keep freed blocks for reuse, as a GPU's caching allocator does: no block
    up to 32 MiB is mmap'd, and the heap's free top is never trimmed. Returns None, or why
    it could not (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "no mallopt in the C library (%s): freed memory goes back as it will" % name
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return "mallopt refused the thresholds"
    return None


def pin(index=0):
    """One thread, on core ``index`` modulo the cores this process may use, with freed
    memory kept for reuse (keep_freed_memory). Returns the core."""
    import torch
    keep_freed_memory()
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
