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

/* One move of step 2, a sender splitting its quotas q[ep] over its own experts' routes
 * left[pr]: the largest open quota (*dst, lowest rank on ties) takes the local expert
 * with the most routes left (*i, lowest on ties), min(quota, left) of them, taken off
 * both; each move empties a quota or an expert, so ep + pr moves always suffice. Returns
 * the routes moved, 0 once every quota is met. */
static inline int64_t vexp_split_move(int64_t *q, int64_t *left, int32_t ep, int32_t pr, int32_t *dst, int32_t *i)
{
    *dst = vexp_argmax_low(q, ep);
    if (q[*dst] <= 0) return 0;
    *i = vexp_argmax_low(left, pr);
    int64_t moved = q[*dst] < left[*i] ? q[*dst] : left[*i];
    if (moved <= 0) return 0; /* unreachable: a sender never sends more than it owns */
    left[*i] -= moved;
    q[*dst] -= moved;
    return moved;
}

#endif
