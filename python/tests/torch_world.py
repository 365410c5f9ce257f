"""The one way the routepack.torch tests run a function on N gloo ranks: forked processes,
a file rendezvous, one CPU thread each; a rank's exception comes back with its traceback,
and a rank that hangs fails the test after `timeout` seconds instead of hanging it. A rank
whose function returned waits at a barrier for every other before it tears gloo down, so
a rank that finished first never closes connections its peers still wait on (gloo
signals a closed pair as an error to the rank at its other end)."""

import contextlib
import os
import queue
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world, init_file, fn, args, results, timeout):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        try:
            out = fn(rank, world, *args)
            # Every rank finished before any tears down (a rank that raised skips it: its
            # teardown then fails the peers' barrier, and the test reports both).
            # monitored_barrier names a rank that never arrives.
            if world > 1:
                dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
            results.put((rank, True, out))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, False, traceback.format_exc()))


def run(fn, world, *args, timeout=120):
    """fn(rank, world, *args) on `world` gloo ranks; returns the results by rank. `fn`
    must be a module-level function (it is pickled by name)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="rp-torch-")
    os.close(fd)
    os.unlink(init_file)   # the file store creates it
    procs = [ctx.Process(target=_rank_main, args=(r, world, init_file, fn, args, results, timeout))
             for r in range(world)]
    for p in procs:
        p.start()
    out, failures = {}, []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                failures.append("ranks %s did not finish within %d s"
                                % (sorted(set(range(world)) - set(out)), timeout))
                break
            if ok:
                out[rank] = value
            else:
                failures.append("rank %d:\n%s" % (rank, value))
                out[rank] = None
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if failures:
        raise AssertionError("\n".join(failures))
    return [out[r] for r in range(world)]


@contextlib.contextmanager
def counting_sends():
    """Inside the block, every dist.P2POp made with dist.isend has its bytes appended to
    the list this yields (the bytes a rank sends point to point)."""
    seen = []
    real = dist.P2POp

    def counting(op, tensor, *args, **kw):
        if op is dist.isend:
            seen.append(tensor.numel() * tensor.element_size())
        return real(op, tensor, *args, **kw)

    dist.P2POp = counting
    try:
        yield seen
    finally:
        dist.P2POp = real
