/* The lower bound of the cost model: every microbatch and layer with the plan's own work
 * spread perfectly over the GPUs of its sync domain (docs/cost-model.md, "Lower bound").
 * Computed from the evaluator's per-GPU state on demand, so incremental moves need not
 * maintain it. */
#include "cost_internal.h"

/* The (m, l) bound over GPUs [g0, g0 + n), forward and backward seconds. Each phase is at
 * most its maximum over those GPUs, and the layer time is monotone in every phase, so the
 * result is at most the domain's T(m, l):
 *   dense phase  max(sum_g F(g,m) speed_g / sum_g speed_g, the sequence with the most dense
 *                work alone on the fastest GPU), forward and backward each
 *   experts      sum_g X(g,m,l) speed_g / sum_g speed_g  (the same expert work, spread)
 *   dispatch     sum_g D(g,m,l) / n                      (the same traffic, spread) */
static double bound_over(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t g0, int32_t n)
{
    const int32_t M = st->M, G = c->G;
    const size_t ml = (size_t)m * c->L + l;
    double f = 0.0, b = 0.0, x = 0.0, d = 0.0, speed_sum = 0.0, speed_max = 0.0, single_f = 0.0, single_b = 0.0;
    for (int32_t g = g0; g < g0 + n; g++) {
        const size_t cell = (size_t)g * M + m;
        const double s = c->speed[g];
        speed_sum += s;
        if (s > speed_max) speed_max = s;
        f += st->dense_f[cell] * s;
        b += st->dense_b[cell] * s;
        x += st->expert[ml * G + g] * s;
        d += st->dispatch[ml * G + g];
    }
    /* The top sequences alone on the fastest GPU: the dense phase only falls with speed
     * (under CP too: its ring hides less behind faster compute, but never costs more
     * than the compute it saves), so a cell holding one takes at least this. */
    for (int32_t g = g0; g < g0 + n; g++) {
        int32_t top = st->cell_top[(size_t)g * M + m];
        if (top >= 0) {
            const int64_t len = c->cu_seqlens[top + 1] - c->cu_seqlens[top];
            double sf, sb;
            cost_cell_dense_at(c, c->seq_quad[top], len + cost_pad(c, len), speed_max, &sf, &sb);
            if (sf > single_f) single_f = sf;
            if (sb > single_b) single_b = sb;
        }
    }
    f /= speed_sum;
    b /= speed_sum;
    if (single_f > f) f = single_f;
    if (single_b > b) b = single_b;
    return cost_layer_time(c, f, b, d / n, x / speed_sum);
}

/* Bound of (m, l): under global sync the whole job's work spread over all GPUs; under
 * group sync each group's own work spread over its GPUs, averaged over the groups (the
 * step is the slowest group's sum, at least the groups' mean). */
double cost_bound_layer(const rp_cost *c, const cost_state *st, int32_t m, int32_t l)
{
    if (c->sync == RP_SYNC_GLOBAL) return bound_over(c, st, m, l, 0, c->G);
    double sum = 0.0;
    for (int32_t q = 0; q < c->Q; q++) sum += bound_over(c, st, m, l, q * c->ep, c->ep);
    return sum / c->Q;
}

/* The step's lower bound: the layers' bounds, the replica gradient reduction at its mean
 * over GPUs, and every extra-replica copy at the number of copies per EP rank that
 * spreads them evenly. Under PP a stage runs every microbatch over its layers, forward
 * and backward (each pass at least the layer's combined time's share: the combined time
 * overlaps at most as much), so the pipeline takes at least the busiest stage's bound;
 * likewise its gradient reduction. Mini-batches and epochs repeat what they repeat in the
 * step. */
double cost_bound_step(const rp_cost *c, const cost_state *st)
{
    const int32_t G = c->G, L = c->L, ep = c->ep;
    double layers = 0.0, grad = 0.0;
    for (int32_t r = 0; r < c->PP; r++) {
        double sum = 0.0, gsum = 0.0;
        for (int32_t m = 0; m < st->M; m++)
            for (int32_t l = 0; l < L; l++)
                if (c->layer_stage[l] == r) sum += cost_bound_layer(c, st, m, l);
        for (int32_t l = 0; l < L; l++)
            if (c->layer_stage[l] == r)
                for (int32_t g = 0; g < G; g++) gsum += st->grad_gpu[(size_t)l * G + g];
        if (r == 0 || sum > layers) layers = sum;
        if (r == 0 || gsum > grad) grad = gsum;
    }
    /* the step counts the stage with the most copy time; each stage's bound is below its
     * own time term by term, so the busiest stage's bound is below the step's */
    double extra = 0.0;
    for (int32_t r = 0; r < c->PP; r++) {
        double stage_s = 0.0;
        if (c->extras_once) {
            stage_s = cost_extras_once(c, st, r, true, c->extras_ahead);
            if (stage_s > extra) extra = stage_s;
            continue;
        }
        for (size_t i = 0; i < (size_t)st->M * L; i++) {
            if (c->layer_stage[i % (size_t)L] != r) continue;
            int32_t copies = 0;
            for (int32_t j = 0; j < ep; j++) copies += st->extra_count[i * ep + j];
            if (copies > 0) stage_s += 2.0 * ((double)copies / ep * c->expert_bytes / c->nv_bw + c->nv_lat);
        }
        if (stage_s > extra) extra = stage_s;
    }
    /* per epoch: every mini-batch's pipeline (their sum is at least the stage's sum over
     * all microbatches) and its gradient reduction */
    const double epoch = layers + (c->K == 1 ? grad / G : c->K * (grad / G)) + extra;
    return c->epochs == 1 ? epoch : c->epochs * epoch;
}
