"""Adapters: a RoutePack step's plan in the forms other trainers take (docs/adapters.md).

    from routepack.adapters import verl, megatron, slime
    vp = verl.batch_plan(res)                        # DataProto order + micro-batch index lists
    sched = slime.dp_schedule(res)                   # build_dp_schedule's four results
    params = megatron.packed_seq_params(res, rank)   # PackedSeqParams fields per microbatch (torch)
    placement = megatron.expert_placement(res)       # the expert permutation stock MoELayer can run

Each reads a StepResult (Scheduler.step, DistributedScheduler.step); none imports verl,
Megatron-Core or slime. `import routepack.adapters` needs numpy only: torch is imported by
megatron.packed_seq_params when it is called."""

from . import megatron, slime, verl

__all__ = ["megatron", "slime", "verl"]
