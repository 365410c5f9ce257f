"""CPU stand-ins for the CUDA calls megatron-core 0.16.1 makes unconditionally, so that its
MoE layer (SequentialMLP, the all-to-all token dispatcher), DDP and distributed optimizer
run on CPU over gloo in RoutePack's tests and examples/megatron/train_moe.py. Applied only
when CUDA is absent (apply() does nothing otherwise); never a change to Megatron's code.

What each stand-in is for (found running the example; docs/adapters.md, "Megatron-Core,
the whole plan"):
- torch.cuda.Stream / Event / stream() / current_stream() / default_stream() /
  synchronize(): MoEAlltoAllTokenDispatcher makes a D2H stream at construction, DDP and
  the dispatcher order work on streams. On CPU every operation is already in order:
  stand-ins that do nothing.
- torch.cuda.current_device() -> "cpu", and a TorchFunctionMode turning device="cuda" (or
  a CUDA index) of tensor factories and Tensor.to into CPU; Tensor.cuda() returns the
  tensor: the router, grad buffers and the optimizer allocate on the current device or
  "cuda" by name.
- Tensor.type() names a CPU tensor's CUDA type ("torch.cuda.FloatTensor"): the
  distributed optimizer accepts only those names for the parameters it shards.
- torch.cuda.get_rng_state / set_rng_state / manual_seed and Megatron's
  tensor_parallel.random._get/_set_cuda_rng_state: the RNG tracker forks the CUDA RNG
  (dropout is off here; the CPU generator stands in).
- moe_utils.te_general_gemm = None: Transformer Engine is absent (Megatron's own fallback
  is the torch matmul, which the name being None selects).
- token_dispatcher.maybe_move_tensor_to_cpu: moves only CUDA tensors, so on CPU the
  all-to-all split sizes stay tensors, which all_to_all_single does not take; the
  stand-in gives numpy arrays, as the CUDA path does."""

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def wait(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cpu(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not torch.is_tensor(args[1]) \
                and not isinstance(args[1], torch.dtype):
            args = (args[0], _cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


_applied = []


def apply():
    """Install the stand-ins in this process (once; nothing when CUDA is available)."""
    if _applied or torch.cuda.is_available():
        return
    stream = _Stream()
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *a, **k: self
    mode = _CudaToCpu()
    mode.__enter__()
    _applied.append(mode)

    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    moe_utils.te_general_gemm = None

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
