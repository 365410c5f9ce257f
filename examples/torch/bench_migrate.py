#!/usr/bin/env python3
"""Migration throughput: routepack.torch.MigrationExecutor (the C executor over
torch.distributed, with checksums, staging and the all-or-nothing commit) against a plain
batch_isend_irecv of the same bytes between the same ranks, in the same run.

    torchrun --nproc-per-node 4 examples/torch/bench_migrate.py [--expert-mib 4] [--steps 4]

Prints, per step, the bytes this rank group moved, each path's time (the slowest rank's,
between barriers) and throughput, the two run in alternating order, then the medians over
the steps; the figures are measured, never asserted. Each rank is pinned to core
rank % cores. On a loaded machine the wall time
mostly measures the scheduler: each path's CPU time is printed too (the busiest rank's
process CPU time, every thread of it: gloo's threads do the socket copies), and the
ratio of those. ``--phases``: each rank's medians of where the executor's wall time went
(its messenger's calls timed: the exchanges between ranks, posting the batch, the
transfer with the commit of each expert as it arrives, and the rest: source checksums,
headers, Python). scripts/bench-migrate-link.sh runs it over a loopback capped at a
link's rate."""

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from routepack.torch import DistributedScheduler, MigrationExecutor, slot_tensors

LAYERS, EXPERTS, TOP_K = 2, 16, 2


def time_phases(messenger):
    """Time `messenger`'s start, wait and allgather calls (wrapped on the instance); returns
    the log the wrappers append (name, began, ended) to."""
    log = []
    for name in ("start", "wait", "allgather"):
        def timed(*args, _fn=getattr(messenger, name), _name=name):
            began = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                log.append((_name, began, time.perf_counter()))
        setattr(messenger, name, timed)
    return log


def phases(log, total):
    """(exchanges, posting, transfer and commit, the rest) of one executor call, seconds:
    each batch's transfer runs from the end of its start to the end of its wait."""
    exchanges = sum(e - b for n, b, e in log if n == "allgather")
    posting = sum(e - b for n, b, e in log if n == "start")
    started = [e for n, b, e in log if n == "start"]
    waited = [e for n, b, e in log if n == "wait"]
    transfer = sum(w - s for s, w in zip(started, waited))
    return exchanges, posting, transfer, total - exchanges - posting - transfer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--expert-mib", type=float, default=4.0, help="MiB of one expert's weights")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--phases", action="store_true", help="also where the executor's wall time went, per rank")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})   # one core a rank (its threads too)
    slots = EXPERTS // world + 1
    config = {"topology": {"num_nodes": 1, "gpus_per_node": world, "ep_size": world, "slots_per_gpu": slots},
              "model": {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K, "hidden_size": 256,
                        "expert_ffn_size": 128, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64},
              "limits": {"max_tokens_per_microbatch": 8192}}
    sched = DistributedScheduler(config, policy="token_kk+eplb", log_level=None)
    numel = int(args.expert_mib * 2**20 / 4)
    weights = [torch.randn(slots, numel) for _ in range(LAYERS)]
    ex = MigrationExecutor(sched, timeout_s=120)
    for l in range(LAYERS):
        ex.register(l, slot_tensors([weights[l]]))
    ex.sync()
    log = time_phases(ex.messenger) if args.phases else None
    spent = []   # per step: phases of this rank's executor call
    figures = []
    for step in range(args.steps):
        rng = np.random.default_rng(step)
        lens = rng.integers(16, 64, 8).astype(np.int32)
        skew = 1.0 / np.arange(1, EXPERTS + 1) ** 1.5
        perm = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
        ids = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=skew[perm[l]] / skew.sum())
                                  for _ in range(int(lens.sum()))]) for l in range(LAYERS)], axis=1)
        # every rank passes the sequences id % world == rank
        mine = np.nonzero(np.arange(len(lens)) % world == rank)[0]
        cu = np.concatenate([[0], np.cumsum(lens)])
        rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in mine])
        res = sched.step(lens[mine], torch.as_tensor(ids[rows], dtype=torch.int32), mine, step=step)
        if res.migration is None:
            continue
        # the same transfers as a plain batch_isend_irecv of the same bytes: each send from
        # its transfer's source slot (the memory the executor reads), receives into
        # buffers allocated (and touched) beforehand
        ops = []
        for tr in res.migration.transfers:
            if tr["src_gpu"] == tr["dst_gpu"]:
                continue
            n = int(tr["bytes"])
            if tr["src_gpu"] == rank:
                src = weights[int(tr["layer"])][int(tr["src_slot"])].view(torch.uint8)
                ops.append(dist.P2POp(dist.isend, src[:n], int(tr["dst_gpu"])))
            elif tr["dst_gpu"] == rank:
                ops.append(dist.P2POp(dist.irecv, torch.zeros(n, dtype=torch.uint8), int(tr["src_gpu"])))

        def executor():
            return ex.execute(res)

        def plain():
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        # interleaved: the executor first on even steps, the plain exchange first on odd
        t, cpu = {}, {}
        for name, fn in ((("executor", executor), ("plain", plain)) if step % 2 == 0
                         else (("plain", plain), ("executor", executor))):
            dist.barrier()
            if log is not None:
                log.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            c1 = time.process_time()
            if log is not None and name == "executor":
                spent.append(phases(log, time.perf_counter() - t0))
            dist.barrier()
            t[name] = time.perf_counter() - t0
            cpu[name] = c1 - c0
            if name == "executor":
                r = out
        moved = torch.tensor([r.bytes_received if r else 0, t["executor"], t["plain"],
                              cpu["executor"], cpu["plain"]], dtype=torch.float64)
        dist.all_reduce(moved[:1])
        dist.all_reduce(moved[1:], op=dist.ReduceOp.MAX)
        mib, te, tp, ce, cp = moved[0].item() / 2**20, *moved[1:].tolist()
        figures.append((mib / te, mib / max(tp, 1e-9), te / max(tp, 1e-9), mib / max(ce, 1e-9),
                        mib / max(cp, 1e-9), ce / max(cp, 1e-9)))
        if rank == 0:
            print("step %d: %.1f MiB moved between ranks; executor %.3f s (%.0f MiB/s), "
                  "batch_isend_irecv %.3f s (%.0f MiB/s), ratio %.2f; CPU time: executor %.3f s "
                  "(%.0f MiB/s), batch_isend_irecv %.3f s (%.0f MiB/s), ratio %.2f"
                  % (step, mib, te, figures[-1][0], tp, figures[-1][1], figures[-1][2],
                     ce, figures[-1][3], cp, figures[-1][4], figures[-1][5]), flush=True)
    if rank == 0 and figures:
        cols = list(zip(*figures))

        def med(i):
            return statistics.median(cols[i]), min(cols[i]), max(cols[i])
        print("median over %d steps: executor %.0f MiB/s (%.0f-%.0f), batch_isend_irecv %.0f MiB/s (%.0f-%.0f), "
              "ratio %.2f (%.2f-%.2f); by CPU time: executor %.0f MiB/s (%.0f-%.0f), batch_isend_irecv "
              "%.0f MiB/s (%.0f-%.0f), ratio %.2f (%.2f-%.2f)"
              % ((len(figures),) + med(0) + med(1) + med(2) + med(3) + med(4) + med(5)))
    if spent:
        cols = [statistics.median(c) * 1e3 for c in zip(*spent)]
        every = [None] * world
        dist.all_gather_object(every, cols)
        if rank == 0:
            for r, c in enumerate(every):
                print("rank %d executor, median ms a step: exchanges %.2f, posting %.2f, transfer and commit "
                      "%.2f, the rest (source checksums, headers, Python) %.2f" % (r, *c))
    sched.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
