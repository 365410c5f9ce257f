"""The links between ranks of one machine, measured as the cost model prices them
(``topology.nvlink_bytes_per_s`` and ``nvlink_latency_us``, one node's links): gloo
between pinned CPU processes (the CPU substrate of issue 30, whose ranks stand for the GPUs
of one node), NCCL between the GPUs of one node.

- ``measure(group)``: inside a process group, every rank calls it; the least wall time,
  over repetitions, of the slowest rank's ``all_to_all_single`` of a few bytes (the
  latency) and of ``mib`` MiB to every peer (the bandwidth: the bytes a rank sends over
  the time beyond the latency). Other jobs on the machine only ever make a transfer
  slower, so the least is the closest to the link.
- ``measure_spawned(ranks)``: starts ``ranks`` processes for it (``routepack.calibrate
  --links N``), each pinned to a core of its own under gloo.

The latency is reported as half the least exchange of a few bytes: the model charges it
once a message, and the exchange is a round (each rank's message out, its peers' in)."""

from __future__ import annotations

import json
import os
import tempfile
import time


def measure(group=None, reps=7, mib=4):
    """{"bytes_per_s", "latency_us", "ranks"} of the group's links (collective)."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError("links need at least 2 ranks, the group has %d" % world)
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    small = torch.zeros(world, device=device)
    big = torch.zeros(world * (mib << 18), device=device)   # mib MiB to each rank

    def slowest(fn):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def exchange(t):
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)

    exchange(small)
    exchange(big)
    lat = min(slowest(lambda: exchange(small)) for _ in range(max(reps, 1) + 2))
    bw_time = min(slowest(lambda: exchange(big)) for _ in range(max(reps, 1)))
    sent = big.numel() * big.element_size() * (world - 1) / world
    return {"ranks": world, "bytes_per_s": sent / max(bw_time - lat, 1e-9), "latency_us": lat * 1e6 / 2}


def _worker(rank, ranks, backend, store_path, out_path, reps, mib):
    import torch.distributed as dist
    from routepack import cpu
    if backend == "gloo":
        cpu.pin(rank)
    else:
        import torch
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, ranks)
    dist.init_process_group(backend, store=store, rank=rank, world_size=ranks)
    try:
        got = measure(reps=reps, mib=mib)
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(got, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_spawned(ranks=2, backend="gloo", reps=7, mib=4):
    """measure() in ``ranks`` processes started for it (gloo: each pinned to a core of
    its own, one thread; nccl: one GPU each). Returns its figures with the backend."""
    import torch
    import torch.multiprocessing as mp
    if ranks < 2:
        raise ValueError("links need at least 2 ranks, got %d" % ranks)
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        raise ValueError("nccl links over %d ranks need %d GPUs; torch sees %d" % (
            ranks, ranks, torch.cuda.device_count()))
    with tempfile.TemporaryDirectory(prefix="rp-links-") as tmp:
        out = os.path.join(tmp, "links.json")
        mp.start_processes(_worker, args=(ranks, backend, os.path.join(tmp, "store"), out, reps, mib),
                           nprocs=ranks, join=True, start_method="spawn")
        with open(out) as fh:
            got = json.load(fh)
    return {"backend": backend, "ranks": got["ranks"], "bytes_per_s": got["bytes_per_s"],
            "latency_us": got["latency_us"]}
