"""Turning what a trainer holds (numpy arrays, torch CPU tensors, DLPack or
__array_interface__ objects; packed, per-sequence or per-layer) into a borrowed C routing
view, and sequence lengths into the arrays rp_batch_new copies."""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from . import _args, _lib, errors

LAYOUTS = ("packed", "per_seq", "per_layer")
_LAYOUT_CODE = {"packed": 0, "per_seq": 1, "per_layer": 2}

# dtypes the C library reads in place: the id widths of rp_id_width.
_BORROWED = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2, np.dtype(np.int32): 4}
# ids read in GPU memory in place: those, and int16 (a torch.int16 tensor; the kernel reads
# 16-bit ids as unsigned, so a negative id is out of range there)
_DEVICE_BORROWED = {**_BORROWED, np.dtype(np.int16): 2}

# DLPack device types (dlpack.h DLDeviceType) for messages.
_DL_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
               9: "vpi", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}


def _routing_error(msg, status=errors.EINVAL, **where):
    return errors.RoutingError(msg, status, **where)


class DeviceArray:
    """A routing array in GPU memory, as its __cuda_array_interface__ describes it (a torch
    CUDA tensor has one): the C library reads it in place, where rp_stats_compute runs
    the histogram kernel (kernels/histogram.cu). Keeps the owner alive; never copies."""

    def __init__(self, obj, what):
        cai = obj.__cuda_array_interface__
        self.owner = obj
        try:
            self.shape = tuple(int(n) for n in cai["shape"])
            self.dtype = np.dtype(cai["typestr"])
            data = cai.get("data")
            self.ptr = int(data[0]) if data and data[0] is not None else 0
            strides = cai.get("strides")
        except (KeyError, TypeError, ValueError) as e:
            raise _routing_error("%s: unreadable __cuda_array_interface__ (%s)" % (what, e)) from e
        if cai.get("mask") is not None:
            raise _routing_error("%s in GPU memory has a mask; routing ids take none" % what,
                                 errors.ENOTSUP)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        item = self.dtype.itemsize
        if strides is None:  # C-contiguous
            st, acc = [], 1
            for n in reversed(self.shape):
                st.append(acc)
                acc *= n
            self.elem_strides = tuple(reversed(st))
        else:
            strides = tuple(int(b) for b in strides)
            if any(b < 0 or b % item for b, n in zip(strides, self.shape) if n > 1):
                raise _routing_error(
                    "%s in GPU memory has strides %s (bytes), negative or not a multiple of its "
                    "%d-byte ids; the binding cannot copy device memory: pass .contiguous()"
                    % (what, strides, item), errors.ENOTSUP)
            self.elem_strides = tuple(b // item if n > 1 else 0 for b, n in zip(strides, self.shape))
        if self.size and (self.ptr == 0 or self.ptr % item):
            raise _routing_error("%s in GPU memory is at address %#x, which cannot hold %d-byte ids"
                                 % (what, self.ptr, item))


def torch_tensor_of(routing):
    """The torch tensor `routing` is (or, for a list, its first item), or None. Read from
    sys.modules, so the binding never imports torch itself: a tensor exists only when the
    caller has."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    item = routing[0] if isinstance(routing, (list, tuple)) and len(routing) else routing
    return item if torch.is_tensor(item) else None


def host_arrays(routing):
    """`routing` with its torch tensors as numpy arrays in host memory (a CPU tensor's
    own memory; a device tensor copied); anything else as it is."""
    torch = sys.modules.get("torch")
    if torch is None:
        return routing
    if isinstance(routing, (list, tuple)):
        return [r.detach().cpu().numpy() if torch.is_tensor(r) else r for r in routing]
    return routing.detach().cpu().numpy() if torch.is_tensor(routing) else routing


def as_tensor_like(array, like):
    """`array` (numpy) as a torch tensor on `like`'s device: torch in, torch out."""
    return sys.modules["torch"].from_numpy(array).to(like.device)


def is_device(obj):
    """True for an object the C library reads in GPU memory (__cuda_array_interface__)."""
    return hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, np.ndarray)


def as_host_array(obj, what="routing"):
    """A numpy array over `obj`'s memory without a copy: numpy arrays as they are, DLPack
    producers through np.from_dlpack (torch CPU tensors), __array_interface__ objects
    through np.asarray. Device memory is refused here (a packed routing array in GPU
    memory is taken by normalize(device_ok=True) instead)."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        raise _routing_error(
            "%s is in GPU memory (__cuda_array_interface__); only the statistics (step(), "
            "compute_stats()) read one packed [tokens, layers, k] routing array in GPU memory: "
            "pass tensor.cpu() here" % what, errors.ENOTSUP)
    if hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__dlpack_device__"):
            dev_type, dev_id = obj.__dlpack_device__()
            if int(dev_type) != 1:
                raise _routing_error(
                    "%s is on device %s:%d, seen through DLPack only; the binding reads GPU memory "
                    "through __cuda_array_interface__ (a torch CUDA tensor has one): pass such an "
                    "object, or tensor.cpu()" % (what, _DL_DEVICES.get(int(dev_type), str(dev_type)),
                                                 int(dev_id)), errors.ENOTSUP)
        try:
            return np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError) as e:
            raise _routing_error("%s: DLPack export failed: %s" % (what, e)) from e
    if hasattr(obj, "__array_interface__"):
        return np.asarray(obj)
    raise _routing_error("%s must be a numpy array, a CPU tensor (DLPack) or an object with "
                         "__array_interface__, got %s" % (what, type(obj).__name__),
                         errors.EINVAL)


def _check_integer(arr, what):
    if arr.dtype.kind not in "iu":
        raise _routing_error("%s holds %s values; expert ids must be integers" % (what, arr.dtype))


def _width_for(num_experts):
    return 1 if num_experts <= 256 else 2 if num_experts <= 65536 else 4


_WIDTH_DTYPE = {1: np.uint8, 2: np.uint16, 4: np.int32}


class Lengths:
    """Per-sequence lengths of one step as rp_batch_new takes them."""

    def __init__(self, prompt, response, group_ids):
        self.prompt = prompt          # int32 [S], C-contiguous
        self.response = response      # int32 [S]
        self.group_ids = group_ids    # int32 [S] or None
        total = prompt.astype(np.int64) + response
        self.cu_seqlens = np.zeros(len(prompt) + 1, dtype=np.int64)
        np.cumsum(total, out=self.cu_seqlens[1:])

    @property
    def num_seqs(self):
        return len(self.prompt)

    @property
    def num_tokens(self):
        return int(self.cu_seqlens[-1])


def _int32_vector(values, what):
    arr = np.asarray(as_host_array(values, what) if not isinstance(values, (list, tuple))
                     else values)
    if arr.ndim != 1:
        raise _routing_error("%s must be one-dimensional, got shape %s" % (what, arr.shape))
    if arr.size and arr.dtype.kind not in "iu":
        raise _routing_error("%s holds %s values; lengths must be integers" % (what, arr.dtype))
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -2**31 or hi >= 2**31:
            bad = int(np.flatnonzero((arr < -2**31) | (arr >= 2**31))[0])
            raise _routing_error("%s[%d] is %d, outside the int32 range" % (what, bad, int(arr[bad])),
                                 errors.ERANGE, sequence=bad)
    # C reads these through an int32 pointer: contiguous and aligned (a copy when not)
    return _args.aligned(np.ascontiguousarray(arr, dtype=np.int32))


def lengths(seq_lens, cu_seqlens, group_ids, routing_list=None, layout=None):
    """Lengths from `seq_lens` (S lengths, an [S, 2] array of (prompt, response), or a
    (prompt_lens, response_lens) pair), else from `cu_seqlens`, else from the shapes of
    per-sequence routing arrays. Whole lengths are recorded as response lengths with
    prompt length 0 (as `routepack trace import --lens` does)."""
    if seq_lens is None and cu_seqlens is None:
        if layout == "per_seq" and routing_list is not None:
            seq_lens = [a.shape[0] for a in routing_list]
        else:
            raise _routing_error("give seq_lens (or (prompt_lens, response_lens)) or "
                                 "cu_seqlens: the routing's layout does not tell the lengths")
    if seq_lens is not None:
        if isinstance(seq_lens, tuple) and len(seq_lens) == 2:
            prompt = _int32_vector(seq_lens[0], "prompt_lens")
            response = _int32_vector(seq_lens[1], "response_lens")
            if len(prompt) != len(response):
                raise _routing_error("prompt_lens has %d entries but response_lens has %d"
                                     % (len(prompt), len(response)))
        else:
            arr = seq_lens if isinstance(seq_lens, list) else as_host_array(seq_lens, "seq_lens")
            arr = np.asarray(arr)
            if arr.ndim == 2 and arr.shape[1] == 2:
                prompt = _int32_vector(arr[:, 0], "seq_lens[:, 0] (prompt lengths)")
                response = _int32_vector(arr[:, 1], "seq_lens[:, 1] (response lengths)")
            else:
                response = _int32_vector(arr, "seq_lens")
                prompt = np.zeros(len(response), dtype=np.int32)
    else:
        cu = np.asarray(as_host_array(cu_seqlens, "cu_seqlens") if not isinstance(cu_seqlens, list)
                        else cu_seqlens)
        if cu.ndim != 1 or cu.size < 1:
            raise _routing_error("cu_seqlens must be one-dimensional with num_seqs + 1 entries")
        if cu.dtype.kind not in "iu":
            raise _routing_error("cu_seqlens holds %s values; it must be integers" % cu.dtype)
        if int(cu[0]) != 0:
            raise _routing_error("cu_seqlens[0] is %d, must be 0" % int(cu[0]))
        response = _int32_vector(np.diff(cu.astype(np.int64)), "lengths from cu_seqlens")
        prompt = np.zeros(len(response), dtype=np.int32)
    for name, arr in (("prompt length", prompt), ("response length", response)):
        if arr.size and int(arr.min()) < 0:
            s = int(np.flatnonzero(arr < 0)[0])
            raise _routing_error("sequence %d has %s %d; lengths must be >= 0"
                                 % (s, name, int(arr[s])), sequence=s)
    groups = None
    if group_ids is not None:
        groups = _int32_vector(group_ids, "group_ids")
        if len(groups) != len(prompt):
            raise _routing_error("group_ids has %d entries for %d sequences"
                                 % (len(groups), len(prompt)))
    out = Lengths(prompt, response, groups)
    if seq_lens is not None and cu_seqlens is not None:
        cu = np.asarray(as_host_array(cu_seqlens, "cu_seqlens") if not isinstance(cu_seqlens, list)
                        else cu_seqlens).astype(np.int64)
        if cu.shape != out.cu_seqlens.shape or not np.array_equal(cu, out.cu_seqlens):
            raise _routing_error("cu_seqlens does not match the sequence lengths "
                                 "(cu_seqlens[s+1] - cu_seqlens[s] must be the length of s)")
    return out


class RoutingView:
    """A C rp_routing over the caller's arrays, with the arrays it points into kept alive.
    Valid only while this object lives: the C library borrows, never copies. `device`:
    the ids are one packed array in GPU memory (a DeviceArray)."""

    def __init__(self, layout, width, num_layers, top_k, strides, arrays, copied):
        self.layout = layout
        self.width = width
        self.arrays = arrays       # keeps the memory alive
        self.copied = copied       # True when a conversion or copy was needed
        self.device = bool(arrays) and isinstance(arrays[0], DeviceArray)
        r = _lib.rp_routing()
        r.layout = _LAYOUT_CODE[layout]
        r.width = width
        r.num_layers = num_layers
        r.top_k = top_k
        r.token_stride, r.layer_stride, r.k_stride = strides
        if layout == "packed":
            if self.device:
                r.base = arrays[0].ptr or None
            else:
                r.base = arrays[0].__array_interface__["data"][0] if arrays else None
            self._bases = None
        else:
            self._bases = (ctypes.c_void_p * max(len(arrays), 1))(
                *[a.__array_interface__["data"][0] for a in arrays])
            r.bases = ctypes.cast(self._bases, ctypes.POINTER(ctypes.c_void_p))
            r.num_bases = len(arrays)
        self.c = r

    def pointer(self):
        return ctypes.byref(self.c)

    def packed_ids(self, cu_seqlens):
        """The ids as one [tokens, layers, k] array (a view for the packed layout, a
        concatenation otherwise)."""
        if self.layout == "packed":
            return self.arrays[0]
        if self.layout == "per_seq":
            L, K = self.c.num_layers, self.c.top_k
            parts = [a for a in self.arrays if a.shape[0]]
            if not parts:
                return np.zeros((0, L, K), dtype=_WIDTH_DTYPE[self.width])
            return np.concatenate(parts, axis=0)
        return np.stack(self.arrays, axis=1)


def _elem_strides(arr):
    """Element strides of `arr`, or None when they are not usable as they are (negative,
    or not a multiple of the item size). Dimensions of size <= 1 get stride 0: their
    stride is never multiplied by anything but 0."""
    out = []
    for n, st in zip(arr.shape, arr.strides):
        if n <= 1:
            out.append(0)
            continue
        if st < 0 or st % arr.itemsize:
            return None
        out.append(st // arr.itemsize)
    return tuple(out)


def _common_strides(arrays):
    """One stride per dimension shared by all arrays (dims of size <= 1 match anything),
    or None."""
    ndim = arrays[0].ndim
    common = [None] * ndim
    for a in arrays:
        st = _elem_strides(a)
        if st is None:
            return None
        for d in range(ndim):
            if a.shape[d] <= 1:
                continue
            if common[d] is None:
                common[d] = st[d]
            elif common[d] != st[d]:
                return None
    return tuple(0 if c is None else c for c in common)


def _first_bad(ids_list, layout, num_experts, cu_seqlens):
    """Location of the first id outside [0, num_experts) in the C library's scan order
    (sequence, layer, token, choice), as (sequence, token, layer, choice, value)."""
    best = None
    for idx, a in enumerate(ids_list):
        bad = np.argwhere((a < 0) | (a >= num_experts))
        if not len(bad):
            continue
        for pos in bad:
            if layout == "per_seq":
                s, t, l, j = idx, int(pos[0]), int(pos[1]), int(pos[2])
            else:
                if layout == "packed":
                    g, l, j = int(pos[0]), int(pos[1]), int(pos[2])
                else:
                    g, l, j = int(pos[0]), idx, int(pos[1])
                s = int(np.searchsorted(cu_seqlens, g, side="right")) - 1
                t = g - int(cu_seqlens[s])
            key = (s, l, t, j)
            if best is None or key < best[0]:
                best = (key, int(a[tuple(pos)]))
    if best is None:
        return None
    (s, l, t, j), v = best
    return s, t, l, j, v


def _convert(arrays, layout, num_experts, cu_seqlens):
    """Convert ids of another integer dtype (int64 from torch, int16, uint32, ...) to the
    narrowest width that holds num_experts, once, checking every id first so that a bad
    one is reported with its position rather than wrapped by the cast."""
    for a in arrays:
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= num_experts:
                s, t, l, j, v = _first_bad(arrays, layout, num_experts, cu_seqlens)
                raise _routing_error(
                    "routing: sequence %d token %d layer %d choice %d has expert id %d, but "
                    "the model has %d experts" % (s, t, l, j, v, num_experts),
                    errors.ERANGE, sequence=s, expert=v)
    width = _width_for(num_experts)
    dt = _WIDTH_DTYPE[width]
    return [np.ascontiguousarray(a, dtype=dt) for a in arrays], width


def normalize(routing, layout=None, device_ok=False):
    """(layout, arrays): the routing as a list of host numpy arrays and its layout
    ('packed': one [tokens, layers, k]; 'per_seq': one (seq_len, layers, k) per sequence;
    'per_layer': one [tokens, k] per layer). A list's layout follows from its arrays'
    dimensions; a single array is packed unless layout='per_layer' ([layers, tokens, k]).
    With device_ok, one packed array in GPU memory (__cuda_array_interface__) is taken as
    it is: ('packed', [DeviceArray]); the C library's GPU path reads only that form."""
    if layout is not None and layout not in LAYOUTS:
        raise _routing_error("layout must be one of %s, got %r" % (", ".join(LAYOUTS), layout))
    if device_ok and is_device(routing):
        if layout not in (None, "packed"):
            raise _routing_error(
                "routing in GPU memory is read as one packed [tokens, layers, k] array; layout "
                "%r takes host memory: pass the packed array, or .cpu()" % layout, errors.ENOTSUP)
        return "packed", [DeviceArray(routing, "routing")]
    if isinstance(routing, (list, tuple)):
        arrays = []
        for i, item in enumerate(routing):
            what = "routing[%d]" % i
            if isinstance(item, (list, tuple)):
                arr = np.asarray(item)
            else:
                arr = as_host_array(item, what)
            arrays.append(arr)
        if layout is None:
            dims = {a.ndim for a in arrays}
            if dims == {3}:
                layout = "per_seq"
            elif dims == {2}:
                layout = "per_layer"
            elif not arrays:
                layout = "per_seq"
            else:
                raise _routing_error(
                    "a list of routing arrays must be per sequence, each (seq_len, layers, k), "
                    "or per layer, each [tokens, k]; got arrays of %s dimensions"
                    % sorted(dims))
        if layout == "packed":
            raise _routing_error("layout 'packed' takes one [tokens, layers, k] array, not a list")
    else:
        arr = as_host_array(routing)
        if layout is None:
            layout = "packed"
        if layout == "packed":
            arrays = [arr]
        elif layout == "per_layer":
            if arr.ndim != 3:
                raise _routing_error("layout 'per_layer' with one array takes [layers, tokens, k], "
                                     "got shape %s" % (arr.shape,))
            arrays = [arr[l] for l in range(arr.shape[0])]
        else:
            raise _routing_error("layout 'per_seq' takes a list of (seq_len, layers, k) "
                                 "arrays, one per sequence")
    for i, a in enumerate(arrays):
        if a.size:
            _check_integer(a, "routing" if layout == "packed" else "routing[%d]" % i)
    return layout, arrays


def shape_of(layout, arrays):
    """(layers, k) as the arrays show them, or None when they cannot tell."""
    for a in arrays:
        if layout == "per_layer" and a.ndim == 2:
            return len(arrays), a.shape[1]
        if layout != "per_layer" and a.ndim == 3:
            return a.shape[1], a.shape[2]
    return None


def prepare(routing, seq_lens, cu_seqlens, group_ids, *, num_layers, top_k, num_experts,
            layout=None, device_ok=False):
    """(Lengths, RoutingView) for one step (device_ok: normalize's)."""
    layout, arrays = normalize(routing, layout, device_ok)
    lens = lengths(seq_lens, cu_seqlens, group_ids, routing_list=arrays, layout=layout)
    return lens, view(layout, arrays, num_layers=num_layers, top_k=top_k,
                      num_experts=num_experts, lens=lens)


def view(layout, arrays, *, num_layers, top_k, num_experts, lens):
    """A RoutingView of normalized arrays for a step with lengths `lens` (a Lengths):
    shapes checked against the batch, ids of other dtypes converted, strides passed."""
    L, K, S, T = num_layers, top_k, lens.num_seqs, lens.num_tokens
    if arrays and isinstance(arrays[0], DeviceArray):
        return _device_view(arrays[0], L, K, T, num_experts)
    # Shapes first: the C library reads raw pointers, so every array must hold what the
    # batch says it does before a pointer is handed over.
    if layout == "packed":
        a = arrays[0]
        if a.ndim != 3 or a.shape != (T, L, K):
            raise _routing_error("routing has shape %s, expected [tokens, layers, k] = [%d, %d, %d]"
                                 % (tuple(a.shape), T, L, K))
    elif layout == "per_seq":
        if len(arrays) != S:
            raise _routing_error("%d per-sequence routing arrays for %d sequences"
                                 % (len(arrays), S), sequence=min(len(arrays), S))
        lens_s = lens.cu_seqlens[1:] - lens.cu_seqlens[:-1]
        for s, a in enumerate(arrays):
            if a.ndim != 3 or a.shape != (int(lens_s[s]), L, K):
                raise _routing_error("routing[%d] (sequence %d) has shape %s, expected "
                                     "(seq_len, layers, k) = (%d, %d, %d)"
                                     % (s, s, tuple(a.shape), int(lens_s[s]), L, K), sequence=s)
    else:
        if len(arrays) != L:
            raise _routing_error("%d per-layer routing arrays for %d layers" % (len(arrays), L))
        for l, a in enumerate(arrays):
            if a.ndim != 2 or a.shape != (T, K):
                raise _routing_error("routing[%d] (layer %d) has shape %s, expected [tokens, k] "
                                     "= [%d, %d]" % (l, l, tuple(a.shape), T, K))

    copied = False
    # Empty arrays hold no ids: their dtype (often numpy's float64 default) is not asked.
    dtypes = {a.dtype for a in arrays if a.size}
    if len(dtypes) <= 1 and (not dtypes or next(iter(dtypes)) in _BORROWED):
        dt = next(iter(dtypes)) if dtypes else np.dtype(_WIDTH_DTYPE[_width_for(num_experts)])
        width = _BORROWED[dt]
        arrays = [a if a.size or a.dtype == dt else np.empty(a.shape, dtype=dt) for a in arrays]
    else:
        arrays = [a if a.size else np.empty(a.shape, dtype=np.int64) for a in arrays]
        arrays, width = _convert(arrays, layout, num_experts, lens.cu_seqlens)
        copied = True

    # C reads the ids through a uint16 or int32 pointer: a misaligned array (numpy allows
    # one, e.g. np.frombuffer at an odd offset) is copied, never handed over
    if any(not a.flags.aligned for a in arrays):
        arrays = [_args.aligned(a) for a in arrays]
        copied = True
    strides = _common_strides(arrays) if arrays else (0,) * (3 if layout != "per_layer" else 2)
    if strides is None:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        strides = _common_strides(arrays)
        copied = True
    if layout == "per_layer":
        token_stride, k_stride = strides
        full = (token_stride, 0, k_stride)
    else:
        full = strides
    return RoutingView(layout, width, L, K, full, arrays, copied)


def _device_view(dev, L, K, T, num_experts):
    """A RoutingView of one packed routing array in GPU memory, read in place: the C
    library asks CUDA where the pointer lives and runs the histogram kernel there. Nothing
    is copied or converted (the binding holds no CUDA code): the ids must already be
    uint8, uint16, int16 or int32, with non-negative strides."""
    if dev.ndim != 3 or dev.shape != (T, L, K):
        raise _routing_error("routing has shape %s, expected [tokens, layers, k] = [%d, %d, %d]"
                             % (dev.shape, T, L, K))
    if dev.size and dev.dtype not in _DEVICE_BORROWED:
        raise _routing_error(
            "routing in GPU memory holds %s ids; the histogram kernel reads uint8, 16-bit or int32 "
            "in place and the binding cannot convert device memory: pass ids.to(torch.int32) (or "
            "torch.uint8 up to 256 experts)" % dev.dtype, errors.ENOTSUP)
    reads = library_reads_device()
    if dev.size and reads is not True:
        raise _routing_error("routing is in GPU memory, but %s: pass tensor.cpu()" % reads, errors.ENOTSUP)
    width = _DEVICE_BORROWED.get(dev.dtype, _width_for(num_experts))
    return RoutingView("packed", width, L, K, dev.elem_strides, [dev], False)


def library_reads_device():
    """True when the loaded library can take routing in GPU memory (built with the CUDA
    kernels, and a device is there); otherwise why not. A library without them would
    read a device pointer as host memory."""
    lib = _lib.load()
    if not lib.rp_gpu_built():
        return "this libroutepack was built without CUDA (RP_WITH_CUDA=OFF or no nvcc)"
    if lib.rp_gpu_count() < 1:
        return "this libroutepack sees no CUDA device"
    return True
