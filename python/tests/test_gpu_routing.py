"""Routing in GPU memory from Python: Scheduler.step() and compute_stats() hand one packed
[tokens, layers, k] array with __cuda_array_interface__ (a torch CUDA tensor) to the C
library by its pointer, never a copy, where rp_stats_compute runs the histogram kernel
(kernels/histogram.cu); a library that cannot read GPU memory (built without CUDA, or no
device) refuses it with ENOTSUP instead of reading a device pointer as host memory.

The pointer's way through the binding is checked on any machine with an object that shows
only __cuda_array_interface__ over host memory and the library's "can read GPU memory"
answer forced to yes (the C library then asks CUDA where the pointer lives, finds host
memory, and scans it on the CPU): the statistics must equal those of the numpy array, bit
for bit. The device itself is checked with torch CUDA tensors, skipped without a GPU."""

import numpy as np
import pytest

import routepack
from routepack import _routing, errors
from conftest import SMALL_CONFIG, random_step

L, K, E = 16, 8, 64   # config-small's model


class HostAsCuda:
    """An array seen only through __cuda_array_interface__ (no buffer, no DLPack), over
    the memory of a numpy array it keeps alive."""

    def __init__(self, arr, typestr=None, strides="array"):
        self.arr = arr
        self._cai = {"shape": arr.shape, "typestr": typestr or arr.dtype.str,
                     "data": (arr.ctypes.data, False), "version": 3,
                     "strides": arr.strides if strides == "array" else strides}

    @property
    def __cuda_array_interface__(self):
        return self._cai


@pytest.fixture
def sched():
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as s:
        yield s


@pytest.fixture
def reads_device(monkeypatch):
    """The library's answer to "can you read GPU memory" forced to yes."""
    monkeypatch.setattr(_routing, "library_reads_device", lambda: True)


def test_refused_by_a_library_without_the_gpu_path(sched):
    why = _routing.library_reads_device()
    if why is True:
        pytest.skip("this library reads GPU memory (CUDA build with a device)")
    lens, ids = random_step(np.random.default_rng(1), 5, L, K, E, dtype=np.uint8)
    for call in (sched.compute_stats, sched.step):
        with pytest.raises(routepack.RoutingError, match=r"GPU memory, but this libroutepack") as e:
            call(lens, HostAsCuda(ids))
        assert e.value.status == errors.ENOTSUP
    assert "CUDA" in why


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.int32])
def test_pointer_passed_through(sched, reads_device, dtype):
    rng = np.random.default_rng(2)
    lens, ids = random_step(rng, 23, L, K, E, max_len=300, dtype=dtype)
    want = sched.compute_stats(lens, ids).to_bytes()
    assert sched.compute_stats(lens, HostAsCuda(ids)).to_bytes() == want
    # strided: every other token of a twice-longer buffer, choices reversed in memory
    wide = np.zeros((2 * ids.shape[0], L, K), dtype=dtype)
    wide[::2] = ids
    assert sched.compute_stats(lens, HostAsCuda(wide[::2])).to_bytes() == want
    tk = np.ascontiguousarray(ids.transpose(0, 2, 1))        # [tokens, k, layers] in memory
    assert sched.compute_stats(lens, HostAsCuda(tk.transpose(0, 2, 1))).to_bytes() == want
    # C-contiguous without strides (the interface's None)
    assert sched.compute_stats(lens, HostAsCuda(ids, strides=None)).to_bytes() == want
    # the view borrows the pointer itself: nothing copied or converted
    _, view = _routing.prepare(HostAsCuda(ids), lens, None, None, num_layers=L, top_k=K,
                               num_experts=E, device_ok=True)
    assert view.device and not view.copied and view.c.base == ids.ctypes.data


def test_step_equals_the_host_step(reads_device):
    rng = np.random.default_rng(3)
    steps = [random_step(rng, 40, L, K, E, max_len=200, dtype=np.uint8) for _ in range(2)]
    hashes = []
    for wrap in (lambda a: a, HostAsCuda):
        with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as s:
            hashes.append([s.step(lens, wrap(ids)).plan_hash for lens, ids in steps])
    assert hashes[0] == hashes[1]


def test_what_the_device_path_refuses(sched, reads_device):
    lens, ids = random_step(np.random.default_rng(4), 6, L, K, E, dtype=np.uint8)
    with pytest.raises(routepack.RoutingError, match=r"int64 ids.*ids\.to\(torch\.int32\)") as e:
        sched.compute_stats(lens, HostAsCuda(ids.astype(np.int64)))
    assert e.value.status == errors.ENOTSUP
    neg = ids[::-1]
    with pytest.raises(routepack.RoutingError, match=r"strides.*\.contiguous\(\)"):
        sched.compute_stats(lens[::-1].copy(), HostAsCuda(neg))
    with pytest.raises(routepack.RoutingError, match=r"shape .*expected \[tokens, layers, k\]"):
        sched.compute_stats(lens, HostAsCuda(ids[:-1]))
    with pytest.raises(routepack.RoutingError, match="layout 'per_layer' takes host memory") as e:
        sched.compute_stats(lens, HostAsCuda(ids), layout="per_layer")
    assert e.value.status == errors.ENOTSUP
    # per-sequence lists in GPU memory: the kernel reads one packed array only
    cu = np.concatenate([[0], np.cumsum(lens)])
    per_seq = [HostAsCuda(ids[cu[s]:cu[s + 1]]) for s in range(len(lens))]
    with pytest.raises(routepack.RoutingError, match="GPU memory") as e:
        sched.compute_stats(lens, per_seq)
    assert e.value.status == errors.ENOTSUP
    with pytest.raises(routepack.RoutingError, match=r"physical=True.*remap\(routing\.cpu\(\)\)"):
        sched.step(lens, HostAsCuda(ids), physical=True)
    # remap reads host arrays only
    res = sched.step(lens, ids)
    with pytest.raises(routepack.RoutingError, match=r"GPU memory.*tensor\.cpu\(\)"):
        res.remap(HostAsCuda(ids))


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU (torch.cuda.is_available() is False)")
    why = _routing.library_reads_device()
    if why is not True:
        pytest.skip("the library cannot read GPU memory: %s" % why)
    return torch


@pytest.mark.parametrize("dtype", ["uint8", "int32"])
def test_torch_cuda_tensor_on_the_gpu(sched, dtype):
    torch = _torch_cuda()
    rng = np.random.default_rng(5)
    lens, ids = random_step(rng, 64, L, K, E, max_len=500, dtype=getattr(np, dtype))
    want = sched.compute_stats(lens, ids).to_bytes()
    dev = torch.from_numpy(ids).cuda()
    assert sched.compute_stats(lens, dev).to_bytes() == want
    # a strided device view: [tokens, k, layers] in memory, seen as [tokens, layers, k]
    tk = torch.from_numpy(np.ascontiguousarray(ids.transpose(0, 2, 1))).cuda()
    assert sched.compute_stats(lens, tk.permute(0, 2, 1)).to_bytes() == want
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as host, \
            routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as gpu:
        assert host.step(lens, ids).plan_hash == gpu.step(lens, dev).plan_hash
