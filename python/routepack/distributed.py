"""The distributed step from Python (docs/distributed.md, docs/python.md "Distributed
step"): routing statistics as bytes (rp_stats_serialize / rp_stats_merge_serialized), and
an rp_comm built from two Python callables, so that any collective library
(torch.distributed, mpi4py, ...) carries the scheduler's agreement. Numpy only; torch is
routepack.torch's business."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import _args, _lib, errors
from ._context import Owned

ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p)
BCAST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_int32)


class rp_comm(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("size", ctypes.c_int32), ("ud", ctypes.c_void_p),
                ("allgather", ALLGATHER_FN), ("bcast", BCAST_FN)]


def as_bytes_view(data, what="bytes"):
    """A read-only uint8 numpy view of bytes, bytearray, memoryview or a uint8 numpy
    array (a CPU torch tensor: pass tensor.numpy()), without a copy where possible."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise errors.InvalidArgumentError("%s must be a one-dimensional uint8 array, got %s %s"
                                              % (what, data.dtype, data.shape))
        return np.ascontiguousarray(data)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise errors.InvalidArgumentError("%s must be bytes, bytearray, memoryview or a uint8 numpy "
                                      "array, got %s" % (what, type(data).__name__))


class Stats:
    """Routing statistics of some sequences (an rp_stats owned from Python): a rank's part
    from Scheduler.compute_stats, or the whole step's from Scheduler.merge_stats /
    Stats.from_bytes. ``to_bytes()`` is the versioned little-endian form the ranks
    exchange (routepack/stats.h); ``num_seqs``, ``num_layers``, ``num_experts``,
    ``top_k``, ``num_tokens``; ``expert_load()`` [L, E] int64 and ``seq_hist(s)`` [L, E]
    uint32 are copies."""

    def __init__(self, handle, ctx):
        self._lib = _lib.load()
        self._owned = Owned(handle, self._lib.rp_stats_free, [ctx])
        lib, h = self._lib, handle
        self.num_seqs = int(lib.rp_stats_num_seqs(h))
        self.num_layers = int(lib.rp_stats_num_layers(h))
        self.num_experts = int(lib.rp_stats_num_experts(h))
        self.top_k = int(lib.rp_stats_top_k(h))
        self.num_tokens = int(lib.rp_stats_num_tokens(h))

    @property
    def handle(self):
        if self._owned.handle is None:
            raise errors.InvalidArgumentError("the statistics were freed")
        return self._owned.handle

    def close(self):
        self._owned.close()

    def serialized_bytes(self):
        """Size of to_bytes() in bytes: 64 + num_seqs + the histogram bytes."""
        return int(self._lib.rp_stats_serialized_bytes(self.handle))

    def to_bytes(self):
        """The serialised statistics (bytes)."""
        n = self.serialized_bytes()
        buf = ctypes.create_string_buffer(n)
        err = _lib.new_error()
        st = self._lib.rp_stats_serialize(self.handle, buf, n, ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        return buf.raw

    def expert_load(self):
        """[num_layers, num_experts] int64: token-choices per expert over these sequences."""
        out = np.empty((self.num_layers, self.num_experts), dtype=np.int64)
        for l in range(self.num_layers):
            p = self._lib.rp_stats_expert_load(self.handle, l)
            out[l] = np.ctypeslib.as_array(p, (self.num_experts,))
        return out

    def seq_hist(self, seq):
        """[num_layers, num_experts] uint32: sequence `seq`'s histogram."""
        seq = _args.integer(seq, "seq", _args.INT32, 0, self.num_seqs - 1)
        out = np.empty((self.num_layers, self.num_experts), dtype=np.uint32)
        for l in range(self.num_layers):
            self._lib.rp_stats_seq_hist(self.handle, seq, l,
                                        out[l].ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)))
        return out

    def __repr__(self):
        return ("Stats(%d sequences, %d tokens, %d layers x %d experts, top-%d)"
                % (self.num_seqs, self.num_tokens, self.num_layers, self.num_experts, self.top_k))


def merge(ctx, parts, global_ids, num_seqs=None, reuse=None):
    """rp_stats_merge_serialized: the whole step's Stats from every rank's serialised part
    (parts[i]: bytes-like) and its global sequence ids (global_ids[i]: int array, one per
    sequence of the part, in the part's order). ``num_seqs`` defaults to the total of the
    ids. ``reuse``: Stats an earlier merge in this context returned and the caller no
    longer needs (rp_stats_merge_serialized_reusing): the merge takes their storage (at the
    reference scale a fresh merge faults in 50 MB of pages, most of its time), and on
    success they are gone (their handle says "the statistics were freed"); on error they
    stay valid. Raises InvalidArgumentError naming a missing, duplicate or out-of-range id,
    or for ``reuse`` of another context; FormatError / ChecksumError / NotSupportedError
    for bad bytes (message "part i: ...")."""
    parts = list(parts)
    global_ids = list(global_ids)
    if not parts:
        raise errors.InvalidArgumentError("merge needs at least one part")
    if len(global_ids) != len(parts):
        raise errors.InvalidArgumentError("%d parts but %d id arrays" % (len(parts), len(global_ids)))
    views = [as_bytes_view(p, "part %d" % i) for i, p in enumerate(parts)]
    ids = []
    for i, g in enumerate(global_ids):
        a = np.asarray(g)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise errors.InvalidArgumentError("global_ids[%d] must be a one-dimensional integer array"
                                              % i)
        if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
            raise errors.RangeError("global_ids[%d] holds ids outside the int32 range" % i,
                                    errors.ERANGE)
        ids.append(_args.aligned(np.ascontiguousarray(a, dtype=np.int32)))
    total = sum(len(a) for a in ids) if num_seqs is None else num_seqs
    total = _args.integer(total, "num_seqs", _args.INT32)
    n = len(parts)
    ptrs = (ctypes.c_void_p * n)(*[v.ctypes.data for v in views])
    lens = (ctypes.c_size_t * n)(*[v.size for v in views])
    idp = (ctypes.POINTER(ctypes.c_int32) * n)(
        *[a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) for a in ids])
    err = _lib.new_error()
    lib = _lib.load()
    if reuse is None:
        out = ctypes.c_void_p()
        st = lib.rp_stats_merge_serialized(ctx.handle, n, ptrs, lens, idp, total, ctypes.byref(out),
                                           ctypes.byref(err))
    else:
        if not isinstance(reuse, Stats) or reuse._owned._parents[:1] != (ctx,):
            raise errors.InvalidArgumentError("reuse must be Stats merged in the same context")
        h = reuse.handle
        out = ctypes.c_void_p(h.value if isinstance(h, ctypes.c_void_p) else h)
        st = lib.rp_stats_merge_serialized_reusing(ctx.handle, n, ptrs, lens, idp, total, ctypes.byref(out),
                                                   ctypes.byref(err))
        if st == errors.OK:
            reuse._owned.release()
    if st != errors.OK:
        _lib.raise_error(st, err)
    return Stats(out, ctx)


def from_bytes(ctx, data):
    """rp_stats_deserialize: Stats from one serialised part, checked."""
    view = as_bytes_view(data)
    out = ctypes.c_void_p()
    err = _lib.new_error()
    st = _lib.load().rp_stats_deserialize(ctx.handle, view.ctypes.data, view.size, ctypes.byref(out),
                                          ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err)
    return Stats(out, ctx)


class Comm:
    """An rp_comm over two Python callables, for Scheduler(..., comm=Comm(...)):

    ``allgather(data: bytes) -> sequence of size bytes objects`` (rank-major, each as long
    as `data`); ``bcast(data: bytes, root: int) -> bytes`` (every rank passes a buffer of
    the same length, the root's holding the payload; every rank returns the root's
    bytes). ``rank``, ``size``: this rank and the number of ranks.

    The scheduler calls them from the thread that runs its step, in the same order on
    every rank (docs/distributed.md: two allgathers of 16 bytes a step, more when ranks
    disagree). An exception inside a callable, or a result of the wrong size, becomes
    RP_ETRANSPORT for the step (never a crash); the exception is kept in ``last_error``
    and the step raises TransportError from it. The ctypes callbacks live as long as this
    object, and the Scheduler keeps it for its own lifetime."""

    def __init__(self, allgather, bcast, rank, size):
        if not callable(allgather) or not callable(bcast):
            raise errors.InvalidArgumentError("allgather and bcast must be callables")
        self.rank = _args.integer(rank, "rank", _args.INT32)
        self.size = _args.integer(size, "size", _args.INT32)
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise errors.InvalidArgumentError("rank %d of %d ranks: need size >= 1 and 0 <= rank < size"
                                              % (self.rank, self.size))
        self._allgather, self._bcast = allgather, bcast
        self.last_error = None
        self._lock = threading.Lock()
        self._cb_allgather = ALLGATHER_FN(self._on_allgather)
        self._cb_bcast = BCAST_FN(self._on_bcast)
        self.c = rp_comm(self.rank, self.size, None, self._cb_allgather, self._cb_bcast)

    def pointer(self):
        """The rp_comm's address (valid while this object lives)."""
        return ctypes.addressof(self.c)

    def _failed(self, exc):
        self.last_error = exc
        return errors.ETRANSPORT

    def _on_allgather(self, ud, src, nbytes, dst):
        try:
            data = ctypes.string_at(src, nbytes) if nbytes else b""
            got = list(self._allgather(data))
            if len(got) != self.size:
                raise errors.TransportError("allgather returned %d parts for %d ranks"
                                            % (len(got), self.size), errors.ETRANSPORT)
            for q, part in enumerate(got):
                part = bytes(part)
                if len(part) != nbytes:
                    raise errors.TransportError("allgather: rank %d's part has %d bytes, expected %d"
                                                % (q, len(part), nbytes), errors.ETRANSPORT)
                if nbytes:
                    ctypes.memmove(dst + q * nbytes, part, nbytes)
            return errors.OK
        except BaseException as e:   # never let an exception cross into C
            return self._failed(e)

    def _on_bcast(self, ud, buf, nbytes, root):
        try:
            data = ctypes.string_at(buf, nbytes) if nbytes else b""
            got = bytes(self._bcast(data, int(root)))
            if len(got) != nbytes:
                raise errors.TransportError("bcast from rank %d returned %d bytes, expected %d"
                                            % (root, len(got), nbytes), errors.ETRANSPORT)
            if nbytes and self.rank != root:
                ctypes.memmove(buf, got, nbytes)
            return errors.OK
        except BaseException as e:
            return self._failed(e)
