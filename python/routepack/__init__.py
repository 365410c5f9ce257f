"""RoutePack from Python: a thin, faithful layer over libroutepack's C API (ctypes).

    import routepack
    sched = routepack.Scheduler("config.json")
    res = sched.step(seq_lens, routing)      # routing: [tokens, layers, k], per sequence or per layer
    res.microbatches[rank]                   # this rank's microbatches: arrays of sequence indices
    res.log2phy, res.logcnt, res.phy2log     # the placement, as EP dispatchers take it
    res.remap(routing)                       # physical ids per token-choice (C rp_remap)
    res.migration                            # the expert moves this step needs (or None)

docs/python.md has the whole story: install, routing forms, lifetimes, trainer wiring."""

from .errors import (ChecksumError, ConfigError, DeadlineError, Error, FileError, FormatError,
                     InvalidArgumentError, LibraryError, LimitError, NotSupportedError,
                     OutOfMemoryError, PlanError, PolicyError, RangeError, RoutingError,
                     TransportError)
from .config import Config
from .placement import ExpertPlacement
from .policies import describe_policy, list_policies
from .scheduler import Scheduler, can_checkpoint
from .step_result import StepResult
from .migration import Migration
from .distributed import Comm, Stats
from .trace import TraceReader, TraceStep, TraceWriter
from .shift import RouterShift, router_shift

__version__ = "0.1.0"


def library_path():
    """Path of the libroutepack this process loaded (loading it if needed)."""
    from . import _lib
    return _lib.path()


__all__ = [
    "Scheduler", "StepResult", "ExpertPlacement", "Config", "list_policies", "describe_policy", "can_checkpoint", "TraceReader", "TraceStep",
    "TraceWriter", "library_path", "Migration", "Comm", "Stats", "RouterShift", "router_shift",
    "Error", "ConfigError", "RoutingError", "PolicyError", "LimitError", "PlanError",
    "InvalidArgumentError", "OutOfMemoryError", "FileError", "FormatError", "RangeError",
    "NotSupportedError", "TransportError", "ChecksumError", "DeadlineError", "LibraryError",
]
