/* The steps of the virtual-expert balancer's plan (virtual_experts.c) that the joint
 * planner's push count (joint_vexp_own.c) runs too: one copy, so the count is the plan's. */
#ifndef RP_VIRTUAL_EXPERTS_INTERNAL_H
#define RP_VIRTUAL_EXPERTS_INTERNAL_H

#include <stdint.h>

/* Index of the largest value among the first n, the lowest index on ties. */
int32_t vexp_argmax_low(const int64_t *x, int32_t n);

/* Step 1, the quotas between ranks: bal[r] is rank r's native load less its target (the
 * balances sum to zero). The most overloaded rank (lowest on ties) covers the most
 * underloaded one's whole deficit, quota[hi * ep + lo], until no rank is overloaded; at
 * most ep rounds. quota [ep * ep] is zeroed first; bal ends all zero or below. */
void vexp_quotas(int64_t *bal, int64_t *quota, int32_t ep);

#endif
