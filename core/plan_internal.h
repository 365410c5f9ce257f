/* Private plan helpers shared by the core. Not installed. */
#ifndef RP_PLAN_INTERNAL_H
#define RP_PLAN_INTERNAL_H

#include "routepack/plan.h"

/* rp_plan_copy into `ctx` rather than the plan's own context: for a copy that must
 * outlive the context the plan was made in (the cost evaluator's memory of the plans it
 * evaluated, which a policy's sandbox context makes and frees before the evaluator). */
rp_status plan_copy_in(rp_context *ctx, const rp_plan *src, rp_plan **out, rp_error *err);

#endif
