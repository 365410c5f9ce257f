"""How both train_moe.py examples end a run (examples/torch and, through sys.path,
examples/megatron): every rank meets at a barrier, closes its scheduler, and leaves.

Under gloo a rank then exits at once, without destroying its process groups: with all
ranks past the barrier nothing is left to exchange, and gloo's teardown in PyTorch 2.x
can abort a finished run ("terminate called without an active exception", SIGABRT, seen
twice in CI after the last step's output, on rank 0 and on rank 1, with the barrier in
place). Under NCCL the groups are destroyed as PyTorch asks, so no peer is left blocked."""

import os
import sys

import torch.distributed as dist


def end_run(sched, backend):
    """Close ``sched`` (a DistributedScheduler) and leave the job; does not return under gloo."""
    dist.barrier()
    sched.close()
    if backend == "gloo":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
