/* The lower bound of the cost model: every microbatch and layer with the plan's own work
 * spread perfectly over the GPUs (docs/cost-model.md, "Lower bound"). Computed from the
 * evaluator's per-GPU state on demand, so incremental moves need not maintain it. */
#include "cost_internal.h"

/* Forward lower bound of T(m, l), seconds. Each term is at most its counterpart's
 * maximum over GPUs, so the sum is at most T(m, l):
 *   attention  max(sum_g A(g,m) speed_g / sum_g speed_g, a(longest sequence) / max speed)
 *   experts    sum_g X(g,m,l) speed_g / sum_g speed_g  (the same expert work, spread)
 *   dispatch   sum_g D(g,m,l) / G                     (the same traffic, spread)
 *   combine    the same as dispatch */
double cost_bound_layer(const rp_cost *c, const cost_state *st, int32_t m, int32_t l)
{
    const int32_t M = st->M, G = c->G;
    const size_t ml = (size_t)m * c->L + l;
    double attn = 0.0, expert = 0.0, dispatch = 0.0;
    double single = 0.0;
    for (int32_t g = 0; g < G; g++) {
        attn += st->attn[(size_t)g * M + m] * c->speed[g];
        expert += st->expert[ml * G + g] * c->speed[g];
        dispatch += st->dispatch[ml * G + g];
        int32_t top = st->cell_top[(size_t)g * M + m];
        if (top >= 0) {
            double a = cost_seq_attention(c, top);
            if (a > single) single = a;
        }
    }
    attn /= c->speed_sum;
    single /= c->speed_max;
    if (single > attn) attn = single;
    dispatch /= G;
    return attn + dispatch + expert / c->speed_sum + dispatch;
}

/* The step's lower bound: the layers' bounds with the backward multiplier, the replica
 * gradient reduction at its mean over GPUs, and every extra-replica copy at the number of
 * copies per EP rank that spreads them evenly. */
double cost_bound_step(const rp_cost *c, const cost_state *st)
{
    const int32_t G = c->G, L = c->L, ep = c->ep;
    double layers = 0.0;
    for (int32_t m = 0; m < st->M; m++)
        for (int32_t l = 0; l < L; l++) layers += cost_bound_layer(c, st, m, l);
    double grad = 0.0;
    for (size_t i = 0; i < (size_t)L * G; i++) grad += st->grad_gpu[i];
    double extra = 0.0;
    for (size_t i = 0; i < (size_t)st->M * L; i++) {
        int32_t copies = 0;
        for (int32_t j = 0; j < ep; j++) copies += st->extra_count[i * ep + j];
        if (copies > 0) extra += 2.0 * ((double)copies / ep * c->expert_bytes / c->nv_bw + c->nv_lat);
    }
    return c->fwd_bwd * layers + grad / G + extra;
}
