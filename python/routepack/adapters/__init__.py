"""Adapters: a RoutePack step's plan in the forms other trainers take (docs/adapters.md).

    from routepack.adapters import verl, megatron
    vp = verl.batch_plan(res)                        # DataProto order + micro-batch index lists
    params = megatron.packed_seq_params(res, rank)   # PackedSeqParams fields per microbatch (torch)
    placement = megatron.expert_placement(res)       # the expert permutation stock MoELayer can run

Both read a StepResult (Scheduler.step, DistributedScheduler.step); neither imports verl or
Megatron-Core. `import routepack.adapters` needs numpy only: torch is imported by
megatron.packed_seq_params when it is called."""

from . import megatron, verl

__all__ = ["megatron", "verl"]
