/* The experts of one GPU as the executor runs them (docs/cost-model.md, "Experts"): one
 * grouped GEMM over its local experts, each expert's rows padded up to the GEMM's tile,
 * its forward time following the GPU's total padded rows; the backward's weight gradient
 * per expert at its own efficiency (small n: far below the forward's), with the write of
 * dW as its floor; the data gradient like the forward. Or, where the executor loops over
 * its experts (execution.expert_gemm "loop"), the per-expert sum of t(n). At the bottom of
 * the cost model beside cost_unit.c: it calls nothing above it. */
#include "cost_internal.h"

#include <math.h>

double cost_gemm_pad(const rp_cost *c, double n) { return ceil(n / c->tile) * c->tile; }

double cost_wgrad_time(const rp_cost *c, double n)
{
    if (!(n > 0)) return 0.0;
    return cost_wgrad_padded(c, cost_gemm_pad(c, n));
}

void cost_expert_add(const rp_cost *c, double n, double *x, double *rows, double *groups)
{
    if (!c->grouped) {
        *x += cost_slot_time(c, n);
        return;
    }
    if (!(n > 0)) return;
    const double p = cost_gemm_pad(c, n); /* padded once for both */
    *x += cost_wgrad_padded(c, p);
    *rows += p;
    *groups += 1.0;
}

double cost_gemm_finish(const rp_cost *c, double x, double rows, double groups)
{
    if (!c->grouped || !(groups > 0)) return x;
    /* the grouped forward: its total padded rows at the efficiency of that many rows
     * (without a grouped curve: the per-expert curve at the mean padded rows), at least
     * every expert's weights read once */
    const double eff = c->geff ? cost_curve_at(c->geff, c->num_geff, rows)
                               : cost_curve_at(c->eff, c->num_eff, rows / groups);
    double fwd = rows * c->expert_token_s / eff;
    const double floor = groups * c->expert_mem_s;
    if (fwd < floor) fwd = floor;
    /* forward, data gradient (and the rest of the backward) at dgrad x the forward, and
     * the weight gradients, as forward-equivalent seconds: the layer pays
     * (1 + backward.experts) x this, which is exactly their sum */
    return (fwd * (1.0 + c->dgrad) + x) * c->xscale;
}

double rp_cost_expert_s(const rp_cost *c, double tokens)
{
    if (!c) return 0.0;
    double x = 0.0, rows = 0.0, groups = 0.0;
    cost_expert_add(c, tokens, &x, &rows, &groups);
    return cost_gemm_finish(c, x, rows, groups);
}
