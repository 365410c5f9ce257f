"""StepResult.remap_rank for a CUDA tensor: one rank's own tokens remapped on the device
(C rp_remap_rank, which hands device memory to the rp_gpu_remap_rank kernels). The
routing is read in place and the ids are written into a tensor on the same device: no
copy of either crosses to the host. One C call per microbatch, for all its layers, that
waits for the device once (the per-expert counts come back on the host: the id check,
the tables and slot_tokens need them) and returns with the remap kernels queued on the
legacy default stream (torch's default stream): the ids are there for whatever torch
queues next."""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from . import _args, _lib, _routing, errors


def usable(routing, layout):
    """True when `routing` is one packed CUDA tensor the loaded library can remap in place."""
    torch = sys.modules.get("torch")
    return (torch is not None and torch.is_tensor(routing) and routing.is_cuda and routing.dim() == 3
            and layout in (None, "packed") and _routing.library_reads_device() is True)


def remap_rank(res, rank, microbatch, routing, slot_tokens):
    """res.remap_rank(rank, microbatch, routing) with `routing` a CUDA tensor (usable())."""
    from .step_result import _SPLIT, _i64p, _raise_step_error
    from .trace import _new_batch

    torch = sys.modules["torch"]
    rank = _args.integer(rank, "rank", _args.INT32, 0, res.num_gpus - 1)
    mb = _args.integer(microbatch, "microbatch", _args.INT32, 0, res.num_microbatches - 1)
    seqs = res.microbatches[rank][mb]
    lens = _routing.Lengths(np.ascontiguousarray(res._lens.prompt[seqs], dtype=np.int32),
                            np.ascontiguousarray(res._lens.response[seqs], dtype=np.int32), None)
    T, L, K = lens.num_tokens, res.num_layers, res._top_k
    P = int(res.num_physical[mb])
    if routing.dtype not in (torch.uint8, torch.int32):
        routing = routing.to(torch.int32)   # on the device (torch's top-k gives int64)
    # the kernels run on the legacy default stream, which waits for torch's default
    # stream; work queued on another stream must be done first
    stream = torch.cuda.current_stream(routing.device)
    if stream != torch.cuda.default_stream(routing.device):
        stream.synchronize()
    layout, arrays = _routing.normalize(routing, "packed", device_ok=True)
    view = _routing.view(layout, arrays, num_layers=L, top_k=K, num_experts=res.num_experts, lens=lens)
    phys = torch.full((T, L, K), -1, dtype=torch.int32, device=routing.device)
    counts = np.zeros((L, max(P, 0)), dtype=np.int64)
    batch = _new_batch(res._lib, res._ctx.handle, res._lens)
    try:
        err = _lib.new_error()
        st = res._lib.rp_remap_rank(res._plan.handle, res._config.handle, mb, rank, batch, view.pointer(),
                                    _SPLIT[res.split_rule],
                                    ctypes.cast(phys.data_ptr(), ctypes.POINTER(ctypes.c_int32)) if T else None,
                                    _i64p(counts), ctypes.byref(err))
        if st != errors.OK:
            _raise_step_error(st, err)
    finally:
        res._lib.rp_batch_free(batch)
    del view
    if slot_tokens:
        return phys, torch.from_numpy(counts).to(routing.device, non_blocking=True)
    return phys
