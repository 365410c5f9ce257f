"""Bytes between the ranks of a torch.distributed group, the one place routepack.torch
turns bytes into tensors and back: the all-gathers of equal-sized and of any-sized parts
(DistributedScheduler's statistics, TorchMessenger's exchanges), a broadcast, and
TorchComm, the scheduler's rp_comm built on them. Collective over the group: every rank
calls the same functions in the same order."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import Comm


def device_of(group):
    """Where a group's collectives take their tensors: the current CUDA device under NCCL,
    else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_tensor(data, device):
    """``data`` (bytes-like) as a uint8 tensor on ``device`` (a copy)."""
    if not len(data):
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def as_bytes(t):
    """A uint8 tensor's bytes (read on the host)."""
    return bytes(t.cpu().numpy())


def start_all_gather(data, group, device):
    """Start the all_gather of every rank's ``data`` (the same length on every rank):
    returns (work, parts), parts the received tensors, rank-major, complete once
    work.wait() returns (TorchMessenger waits with its deadline)."""
    mine = as_tensor(data, device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(parts, mine, group=group, async_op=True), parts


def all_gather(data, group=None, device=None):
    """Every rank's ``data`` (the same length on every rank), rank-major: a list of bytes."""
    work, parts = start_all_gather(data, group, device or device_of(group))
    work.wait()
    return [as_bytes(p) for p in parts]


def all_gather_bytes(data, group=None, device=None):
    """Every rank's bytes (any size each), rank-major, on every rank: sizes first, then
    one all_gather of the parts padded to the largest."""
    device = device or device_of(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(sizes + [1]), dtype=torch.uint8, device=device)
    padded[:len(data)] = as_tensor(data, device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [as_bytes(p[:n]) for p, n in zip(parts, sizes)]


def broadcast(data, root, group=None, device=None):
    """Group rank ``root``'s bytes on every rank (every rank passes as many bytes)."""
    t = as_tensor(data, device or device_of(group))
    src = root if group is None else dist.get_global_rank(group, root)
    dist.broadcast(t, src=src, group=group)
    return as_bytes(t)


class TorchComm(Comm):
    """routepack.Comm (the scheduler's rp_comm) over a torch.distributed group: the
    scheduler's agreement (plan hashes, fallback flags, the agreed plan) travels with
    all_gather and broadcast. Every rank's scheduler calls it in the same order."""

    def __init__(self, group=None, device=None):
        self.group = group
        self.device = device or device_of(group)
        super().__init__(lambda data: all_gather(data, self.group, self.device),
                         lambda data, root: broadcast(data, root, self.group, self.device),
                         dist.get_rank(group), dist.get_world_size(group))
