/* Private plan helpers shared by the core. Not installed. */
#ifndef RP_PLAN_INTERNAL_H
#define RP_PLAN_INTERNAL_H

#include "routepack/plan.h"

/* rp_plan_copy into `ctx` rather than the plan's own context: for a copy that must
 * outlive the context the plan was made in (the cost evaluator's memory of the plans it
 * evaluated, which a policy's sandbox context makes and frees before the evaluator). */
rp_status plan_copy_in(rp_context *ctx, const rp_plan *src, rp_plan **out, rp_error *err);

/* Experts that arrive on an EP rank that did not hold them, over all layers (0 when
 * either plan has no placement; -1 when memory runs out). */
int32_t plan_experts_moved(rp_context *ctx, const rp_plan *from, const rp_plan *to);
/* The same for two plans with placements, with a caller's scratch of E bytes. */
int32_t plan_experts_moved_into(const rp_plan *from, const rp_plan *to, uint8_t *held, int32_t E);

/* rp_plan_equal without comparing the placement rows (phy2log): the same shape, packing,
 * microbatch order, balancing and levers, and both with or without a placement. */
bool plan_equal_but_rows(const rp_plan *a, const rp_plan *b);

#endif
