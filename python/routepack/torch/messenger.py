"""TorchMessenger: the messages and exchanges of the C migration executor moved by
torch.distributed (routepack.executor.CallbackTransport calls it).

Receives land in buffers this object owns (kept and reused between batches) and are
copied into the executor's memory only when they completed, so a receive abandoned after
a failure (gloo and NCCL cannot cancel one) never writes the executor's staging: finish()
keeps such buffers alive forever and reports the transport still safe. Expert bytes are
sent from the registered slot tensors as they are; headers, which live in the executor's
memory, are copied first. No tags: NCCL ignores them, so a message left over from a
failed call must never meet a later call's on the same group, and MigrationExecutor
replaces the message group on every rank after a failed call instead."""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import errors
from ..executor import TransportFailure
from . import comm
from ._p2p import join_group
from .checksum import checksum_experts as _torch_checksums


class _CudaMemory:
    """A device address as an object torch.as_tensor takes (__cuda_array_interface__)."""

    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1",
                                         "data": (int(address), False), "version": 3}


def bytes_at(address, nbytes, device):
    """A uint8 tensor viewing `nbytes` at `address` (host memory, or device memory of
    `device` when it is CUDA); the memory is borrowed."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        return torch.as_tensor(_CudaMemory(address, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _wait_work(work, deadline, index, timeout_text):
    """work.wait() until `deadline` (time.monotonic): a timeout raises TransportFailure
    with ETIMEOUT, another backend error with ETRANSPORT and the backend's words."""
    left = deadline - time.monotonic()
    if left <= 0 and not work.is_completed():
        raise TransportFailure(timeout_text, errors.ETIMEOUT, index)
    try:
        work.wait(timeout=timedelta(seconds=max(left, 1e-3)))
    except RuntimeError as e:
        if time.monotonic() >= deadline or "imed out" in str(e) or "imeout" in str(e):
            raise TransportFailure(timeout_text, errors.ETIMEOUT, index) from e
        raise TransportFailure("%s: %s" % (type(e).__name__, e), errors.ETRANSPORT, index) from e


class TorchMessenger:
    """The executor's messages over ``group`` (a torch.distributed process group; None:
    the world): point-to-point batches with batch_isend_irecv, exchanges with all_gather
    over ``control_group`` (default: ``group``; the same ranks), both waited on until the
    executor's deadline. A separate control group matters on gloo: a receive that times
    out there closes every connection of its group (gloo signals the error to all its
    pairs), and the ranks still have to exchange the round's outcome afterwards. ``device``: where messages
    live (cpu for gloo, the current CUDA device for NCCL; default from the backend).
    ``torch_checksum``: offer the executor expert checksums computed with torch ops on
    ``device`` (routepack.torch.checksum; no host copy, one read of the results per
    batch). None (default): for CUDA only, where the C checksum kernel cannot run; True:
    also for host memory (the C checksum is faster there: tests use it to run the device
    path on CPU); False: never."""

    def __init__(self, group=None, device=None, control_group=None, torch_checksum=None):
        self.group = group
        self.control_group = group if control_group is None else control_group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else comm.device_of(group)
        # the stream every copy of this messenger is queued on (the current one when
        # made); the executor's checksum kernel runs on it after them
        self.stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        self.call = 0          # executor calls so far, the same on every rank
        self._batch = []       # (message, work, buffer)
        self._orphans = []     # (work, buffer) of abandoned operations, kept alive
        self._memory = {}      # address -> tensor, for alloc/free of device memory
        self._pool = {}        # nbytes -> receive buffers of finished batches, reused
        # A uint8 tensor of the caller's (MigrationExecutor's staging) that receives may
        # write directly, also after being abandoned: its owner never reuses it after a
        # failed call (drop_direct), and an orphaned receive keeps it alive.
        self.direct = None
        use = self.device.type == "cuda" if torch_checksum is None else bool(torch_checksum)
        self.checksum_experts = self._checksum_experts if use else None
        self.checksum_calls = 0   # batches checksummed through torch ops

    def _checksum_experts(self, experts, timeout_s):
        """rp_checksum_expert of each expert ([(address, nbytes), ...] parts in this
        messenger's memory), with torch ops on its device, queued on the current stream
        after the copies queued there; the results are read once (the only
        synchronisation)."""
        self.checksum_calls += 1
        return _torch_checksums([[bytes_at(a, n, self.device) for a, n in parts] for parts in experts])

    def begin_call(self):
        """Count an executor call (MigrationExecutor does this before each one)."""
        self.call += 1

    def join(self):
        """The message group's first batched point-to-point call, with every rank in it
        (NCCL requires it; the executor's own batches involve only the ranks that move
        something). Collective over the group: MigrationExecutor calls it on every rank
        whenever it makes the group."""
        join_group(self.rank, self.size, torch.empty(0, device=self.device), self._peer, self.group)

    def _peer(self, rank):
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ---- point to point ----

    def _direct_view(self, address, nbytes):
        d = self.direct
        if d is None or d.device != self.device:
            return None
        off = address - d.data_ptr()
        if 0 <= off and off + nbytes <= d.numel():
            return d[off:off + nbytes]
        return None

    def _receive_buffer(self, nbytes):
        free = self._pool.get(nbytes)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def start(self, messages):
        ops, batch = [], []
        for m in messages:
            if m.send and m.payload:
                # Expert bytes are read where they are: the registered slot tensors,
                # which the trainer keeps alive and the executor does not write while
                # this batch is in flight (a failed round writes nothing).
                buf = bytes_at(m.address, m.nbytes, self.device)
                op = dist.P2POp(dist.isend, buf, self._peer(m.peer), self.group)
            elif m.send:
                # A header lives in the executor's memory, which an abandoned send may
                # still read after the executor returns: a copy.
                buf = bytes_at(m.address, m.nbytes, self.device).clone()
                op = dist.P2POp(dist.isend, buf, self._peer(m.peer), self.group)
            else:
                direct = self._direct_view(m.address, m.nbytes) if m.payload else None
                buf = direct if direct is not None else self._receive_buffer(m.nbytes)
                op = dist.P2POp(dist.irecv, buf, self._peer(m.peer), self.group)
            ops.append(op)
            batch.append([m, None, buf, direct is not None if not m.send else False, False])
        self._batch = batch
        if ops:
            # Sends are posted before receives (the batch keeps the executor's order for
            # its waits). On gloo, a send posted after the peer's receive is written on
            # the posting thread, under the connection's lock, while gloo's loop thread
            # spins on that lock with the peer's data pending: on a shared core it takes
            # the writer's time. A send posted first usually waits for the peer's
            # receive, and gloo's loop thread writes it. Coalesced backends (NCCL) take
            # the batch as one.
            order = [i for i, m in enumerate(messages) if m.send] + [i for i, m in enumerate(messages) if not m.send]
            works = dist.batch_isend_irecv([ops[i] for i in order])
            if len(works) == len(batch):
                for i, w in zip(order, works):
                    batch[i][1] = w
            else:   # a coalesced backend (NCCL): one handle completes the whole batch
                for entry in batch:
                    entry[1] = works[-1] if works else None

    def _wait_entry(self, i, deadline):
        entry = self._batch[i]
        m, work, buf, direct, done = entry
        if work is None or done:
            return
        # Work.wait with a timeout: gloo's send/recv handles only complete inside wait
        # (is_completed stays False until then), so they cannot be polled.
        _wait_work(work, deadline, i, ("rank %d did not take the message before the deadline" if m.send
                                       else "nothing arrived from rank %d before the deadline") % m.peer)
        if not m.send and not direct:
            # queued on the current stream: whatever reads staging next (a copy,
            # a checksum) is ordered after it, so no synchronisation per message
            bytes_at(m.address, m.nbytes, self.device).copy_(buf, non_blocking=True)
        entry[4] = True

    def wait(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        for i in range(len(self._batch)):
            self._wait_entry(i, deadline)

    def wait_one(self, index, timeout_s):
        """Until message ``index`` of the batch completed: on gloo its own handle (the
        executor commits each expert of host memory as it arrives); on a backend that
        gives one handle for the batch (NCCL) that handle, which completes them all."""
        self._wait_entry(index, time.monotonic() + timeout_s)

    def finish(self):
        for m, work, buf, direct, _done in self._batch:
            if work is not None and not work.is_completed():
                self._orphans.append((work, buf))
            elif not m.send and not direct:
                self._pool.setdefault(buf.numel(), []).append(buf)
        self._batch = []
        return True   # the executor's buffers are never written from here

    # ---- exchanges ----

    def allgather(self, data, timeout_s):
        work, out = comm.start_all_gather(data, self.control_group, self.device)
        try:
            _wait_work(work, time.monotonic() + timeout_s, -1,
                       "rank %d timed out in an exchange between ranks" % self.rank)
        except TransportFailure:
            self._orphans.append((work, out))
            raise
        return b"".join(comm.as_bytes(o) for o in out)

    # ---- device memory (CUDA registries) ----

    def alloc(self, nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._memory[t.data_ptr()] = t
        return t.data_ptr()

    def free(self, address):
        self._memory.pop(address, None)

    def copy(self, dst, src, nbytes, kind):
        host = torch.device("cpu")
        src_dev = host if kind == "from_host" else self.device
        dst_dev = host if kind == "to_host" else self.device
        bytes_at(dst, nbytes, dst_dev).copy_(bytes_at(src, nbytes, src_dev))
        if self.device.type == "cuda" and kind == "to_host":
            # the executor reads host memory next; device-side copies stay queued
            torch.cuda.current_stream(self.device).synchronize()
