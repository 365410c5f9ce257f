"""routepack.torch: RoutePack's plan executed inside a PyTorch trainer (torch.distributed;
NCCL on GPUs, gloo on CPUs).

    from routepack.torch import DistributedScheduler, MoELayer, MigrationExecutor, pack_microbatches
    sched = DistributedScheduler(config)      # every rank; plans from all ranks' statistics
    res = sched.step(my_lens, my_routing, my_global_ids, my_group_ids)
    executor.execute(res)                     # expert weights and optimizer state move, all-or-nothing
    packed = pack_microbatches(res.microbatches, owner, lens, my_ids, {"tokens": t})
    physical = res.remap_rank(rank, m, packed[m]["routing"])   # a tensor on the routing's device
    layer.fetch_replicas(res.placement(l))    # collective; then forward/backward per microbatch
    layer.reduce_replica_grads()              # replicas of an expert keep identical weights
    w = router_shift_weights(old_topk_ids, router_logits)   # RSPO trust weights per token

Process groups are arguments (default: the world group). docs/torch.md shows the wiring
in a Megatron- or verl-style trainer. Importing this module imports torch; ``import
routepack`` alone never does."""

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "routepack.torch needs PyTorch (pip install 'routepack[torch]' or pip install torch); "
        "the numpy binding (import routepack) works without it: %s" % e) from e

from .balancer import VirtualExpertBalancer
from .messenger import TorchMessenger
from .migration import MigrationExecutor, init_optimizer_state, slot_tensors
from .moe import ExpertPlacement, MoELayer, all_to_all
from .packing import PackedMicrobatch, pack_microbatches
from .router_shift import router_shift_weights
from .comm import TorchComm, all_gather_bytes
from .scheduler import DistributedScheduler, PlannedStep

__all__ = [
    "TorchMessenger", "MigrationExecutor", "init_optimizer_state", "slot_tensors",
    "ExpertPlacement", "MoELayer", "all_to_all", "PackedMicrobatch", "pack_microbatches",
    "DistributedScheduler", "PlannedStep", "TorchComm", "all_gather_bytes", "router_shift_weights",
    "VirtualExpertBalancer",
]
