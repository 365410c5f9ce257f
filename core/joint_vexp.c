/* The joint planner's candidate that runs with per-forward balancing (Megatron-Core's
 * virtual-expert balancer, rp_joint_params.virtual_experts): the joint packing on the
 * evenly owned contiguous placement the balancer requires (docs/routepack-policy.md,
 * "Beside the per-forward balancer"). */
#include "joint_internal.h"

rp_status joint_vexp_candidate(const joint *jt, const rp_plan *previous_placed, rp_plan **out, rp_error *err)
{
    rp_plan *plan = NULL;
    rp_status st;
    RP_CHECK_GOTO(rp_plan_new(jt->ctx, jt->cfg, jt->M, &plan, err), st, out);
    RP_CHECK_GOTO(rp_plan_set_packing(plan, jt->N, jt->seq_gpu, jt->seq_mb, err), st, out);
    /* contiguous: the layout trainers start from, so once there it never moves again */
    RP_CHECK_GOTO(rp_plan_set_contiguous(plan, err), st, out);
    RP_CHECK_GOTO(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, err), st, out);
    if (previous_placed) RP_CHECK_GOTO(rp_plan_stabilize_slots(plan, previous_placed, err), st, out);
    /* built to be valid; a violation here is a planner bug, reported as such */
    RP_CHECK_GOTO(rp_plan_validate(plan, jt->cfg, jt->batch, err), st, out);
    /* under pipeline parallelism its own microbatch order, as the joint plan gets */
    if (rp_config_topology(jt->cfg)->pipeline_parallel_size > 1) {
        RP_CHECK_GOTO(rp_cost_evaluate(jt->cost, plan, NULL, err), st, out);
        RP_CHECK_GOTO(rp_cost_order_microbatches(jt->cost, plan, NULL, err), st, out);
    }
    *out = plan;
    plan = NULL;
out:
    rp_plan_free(plan);
    return st;
}
