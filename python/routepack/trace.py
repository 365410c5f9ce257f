"""Routing traces (.rpt) from Python, through the C reader and writer: read a recorded run
step by step (routing as numpy views into the memory-mapped file), or record a trainer's
steps for `routepack simulate` and friends."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from . import _args, _lib, _routing, errors
from ._context import Context, Owned

_WIDTH_DTYPE = {1: np.uint8, 2: np.uint16, 4: np.int32}


class TraceStep:
    """One step of a trace: lengths and group ids (copies the caller owns) and the routing
    ids, a read-only [tokens, layers, k] numpy view into the mapped file that keeps the
    trace open while it lives."""

    def __init__(self, step, prompt_lens, response_lens, group_ids, routing, num_experts):
        self.step = step
        self.prompt_lens = prompt_lens
        self.response_lens = response_lens
        self.group_ids = group_ids
        self.routing = routing
        self.num_experts = num_experts

    @property
    def seq_lens(self):
        """Whole lengths, prompt + response."""
        return self.prompt_lens + self.response_lens

    @property
    def lengths(self):
        """(prompt_lens, response_lens), as Scheduler.step takes them."""
        return (self.prompt_lens, self.response_lens)

    @property
    def cu_seqlens(self):
        cu = np.zeros(len(self.prompt_lens) + 1, dtype=np.int64)
        np.cumsum(self.seq_lens, out=cu[1:])
        return cu

    @property
    def num_seqs(self):
        return len(self.prompt_lens)

    @property
    def num_tokens(self):
        return int(self.routing.shape[0])

    def per_sequence(self):
        """The routing split per sequence, as vLLM/SGLang return it (views, no copy)."""
        cu = self.cu_seqlens
        return [self.routing[cu[s]:cu[s + 1]] for s in range(self.num_seqs)]

    def per_layer(self):
        """The routing split per layer, as Megatron's router replay keeps it (views)."""
        return [self.routing[:, l, :] for l in range(self.routing.shape[1])]


class _Mapped:
    """Exposes memory of an open trace to numpy; holding it keeps the trace mapped."""

    def __init__(self, handle, address, shape, strides, dtype):
        self._handle = handle
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": np.dtype(dtype).str,
                                    "data": (address, True), "strides": strides}


class TraceReader:
    """Open a .rpt trace (every header and, unless verify=False, every payload checksum is
    checked at open). Iterate for TraceStep objects, or index: reader[i]. Step routing
    arrays are read-only views into the mapped file; they keep it mapped while they live,
    also after close()."""

    def __init__(self, path, verify=True):
        self._lib = _lib.load()
        ctx = Context()
        self.path = os.fspath(path)
        cpath = _args.c_path(path)
        trace = ctypes.c_void_p()
        err = _lib.new_error()
        st = self._lib.rp_trace_open(ctx.handle, cpath, 0 if verify else 1,
                                     ctypes.byref(trace), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        # The reader and every routing view of its steps hold this, so the file stays
        # mapped until the last of them is gone.
        self._h = Owned(trace, self._lib.rp_trace_close, [ctx])

    @property
    def _trace(self):
        if self._h is None:
            raise errors.InvalidArgumentError("the trace reader is closed")
        return self._h.handle

    def close(self):
        """Release the reader (the mapping goes when no step view is left)."""
        self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return int(self._lib.rp_trace_num_steps(self._trace))

    def info(self, i):
        """The header of step i as a dict."""
        i = _args.integer(i, "step index", _args.INT64)
        n = len(self)
        if not -n <= i < n:
            raise IndexError("step %d of a %d-step trace" % (i, n))
        p = self._lib.rp_trace_step(self._trace, i % n).contents
        return {"step": p.step, "num_seqs": p.num_seqs, "num_tokens": p.num_tokens,
                "num_layers": p.num_layers, "num_experts": p.num_experts, "top_k": p.top_k,
                "id_width": p.width, "checksum": "%016x" % p.checksum}

    def __getitem__(self, i):
        i = _args.integer(i, "step index", _args.INT64)
        n = len(self)
        if not -n <= i < n:
            raise IndexError("step %d of a %d-step trace" % (i, n))
        i %= n
        info = self._lib.rp_trace_step(self._trace, i).contents
        batch = ctypes.c_void_p()
        r = _lib.rp_routing()
        err = _lib.new_error()
        st = self._lib.rp_trace_read_step(self._trace, i, ctypes.byref(batch), ctypes.byref(r),
                                          ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        try:
            S = self._lib.rp_batch_num_seqs(batch)
            T = self._lib.rp_batch_num_tokens(batch)
            prompt = np.ctypeslib.as_array(self._lib.rp_batch_prompt_lens(batch), (S,)).copy() \
                if S else np.zeros(0, np.int32)
            response = np.ctypeslib.as_array(self._lib.rp_batch_response_lens(batch), (S,)).copy() \
                if S else np.zeros(0, np.int32)
            groups = np.ctypeslib.as_array(self._lib.rp_batch_group_ids(batch), (S,)).copy() \
                if S else np.zeros(0, np.int32)
        finally:
            self._lib.rp_batch_free(batch)
        L, K, W = r.num_layers, r.top_k, r.width
        if T and r.base:
            mapped = _Mapped(self._h, r.base, (T, L, K),
                             (r.token_stride * W, r.layer_stride * W, r.k_stride * W),
                             _WIDTH_DTYPE[W])
            ids = np.asarray(mapped)
        else:
            ids = np.zeros((T, L, K), dtype=_WIDTH_DTYPE[W])
        ids.flags.writeable = False
        return TraceStep(int(info.step), prompt, response, groups, ids, int(info.num_experts))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class TraceWriter:
    """Write (or, with append=True, extend) a .rpt trace for a model with `num_experts`
    experts. append() takes the same lengths and routing forms as Scheduler.step."""

    def __init__(self, path, num_experts, append=False):
        self._lib = _lib.load()
        self._ctx = Context()
        self.path = os.fspath(path)
        cpath = _args.c_path(path)
        self.num_experts = _args.integer(num_experts, "num_experts", _args.INT32)
        w = ctypes.c_void_p()
        err = _lib.new_error()
        fn = self._lib.rp_trace_writer_open_append if append else self._lib.rp_trace_writer_open
        st = fn(self._ctx.handle, cpath, self.num_experts, ctypes.byref(w),
                ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        self._close_err = _lib.new_error()
        self._close_status = []
        lib = self._lib

        def close_writer(handle, err=self._close_err, out=self._close_status):
            out.append(lib.rp_trace_writer_close(handle, ctypes.byref(err)))

        self._owned = Owned(w, close_writer, [self._ctx])

    @property
    def _w(self):
        return self._owned.handle

    def append(self, step, seq_lens, routing, *, group_ids=None, cu_seqlens=None,
               layout=None):
        """Append one step; the routing's shape gives the layers and top-k (all steps of a
        trace share them and the id width, which is the routing's: uint8, uint16 or
        int32; other integer dtypes are stored in the narrowest width for num_experts)."""
        if not self._w:
            raise errors.InvalidArgumentError("the trace writer is closed")
        step = _args.integer(step, "step", _args.INT64)
        layout, arrays = _routing.normalize(routing, layout)
        shape = _routing.shape_of(layout, arrays)
        if shape is None:
            raise errors.RoutingError("cannot tell the layers and top-k of an empty routing list")
        lens = _routing.lengths(seq_lens, cu_seqlens, group_ids, routing_list=arrays,
                                layout=layout)
        view = _routing.view(layout, arrays, num_layers=shape[0], top_k=shape[1],
                             num_experts=self.num_experts, lens=lens)
        batch = _new_batch(self._lib, self._ctx.handle, lens)
        try:
            err = _lib.new_error()
            st = self._lib.rp_trace_writer_append(self._w, step, batch, view.pointer(),
                                                  ctypes.byref(err))
            if st != errors.OK:
                _lib.raise_error(st, err, cls=errors.RoutingError if err.sequence >= 0 else None)
        finally:
            self._lib.rp_batch_free(batch)

    def close(self):
        """Flush and close; raises if the final write failed (the file then holds the
        steps appended before)."""
        if not self._owned.handle:
            return
        self._owned.close()
        if self._close_status and self._close_status[0] != errors.OK:
            _lib.raise_error(self._close_status[0], self._close_err)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ptr(arr):
    return arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) if arr is not None else None


def _new_batch(lib, ctx, lens):
    """A new rp_batch (the caller frees it) from a Lengths."""
    batch = ctypes.c_void_p()
    err = _lib.new_error()
    num_seqs = _args.integer(lens.num_seqs, "the number of sequences", _args.INT32)
    st = lib.rp_batch_new(ctx, num_seqs, _ptr(lens.prompt), _ptr(lens.response),
                          _ptr(lens.group_ids), ctypes.byref(batch), ctypes.byref(err))
    if st != errors.OK:
        _lib.raise_error(st, err, cls=errors.RoutingError)
    return batch
