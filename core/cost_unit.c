/* The cost model's unit costs: one sequence's attention and dense work, one slot's
 * expert time from the efficiency curve, a cell's dense phase, a layer's time from its
 * phase maxima (docs/cost-model.md). The bottom of the cost model: it calls nothing
 * above it. */
#include "cost_internal.h"

#include <math.h>

/* ---- unit costs ------------------------------------------------------------------ */

double rp_cost_attention_s(const rp_cost *c, int64_t seq_len)
{
    if (!c || seq_len <= 0) return 0.0;
    double len = (double)(seq_len + cost_pad(c, seq_len));
    return len * len * c->attn_flop_s / cost_curve_at(c->attn_eff, c->num_attn_eff, len) + len * c->attn_lin_s;
}

double rp_cost_dense_s(const rp_cost *c, int64_t seq_len)
{
    if (!c || seq_len <= 0) return 0.0;
    double len = (double)(seq_len + cost_pad(c, seq_len));
    double core = len * len * c->attn_flop_s / cost_curve_at(c->attn_eff, c->num_attn_eff, len);
    double proj = len * c->attn_lin_s, lin = len * c->token_linear_s;
    return (1.0 + c->bwd.attention) * core + (1.0 + c->bwd.projections) * proj + (1.0 + c->bwd.token_linear) * lin;
}

double cost_seq_attention(const rp_cost *c, int32_t seq)
{
    const int64_t n = c->cu_seqlens[seq + 1] - c->cu_seqlens[seq];
    return cost_cell_attention(c, c->seq_quad[seq], n + cost_pad(c, n), -1);
}

double cost_curve_at(const rp_eff_point *p, int32_t k, double x)
{
    if (x <= p[0].tokens) return p[0].efficiency;
    if (x >= p[k - 1].tokens) return p[k - 1].efficiency;
    int32_t lo = 0, hi = k - 1; /* p[lo].tokens < x < p[hi].tokens */
    while (hi - lo > 1) {
        int32_t mid = (lo + hi) / 2;
        if (p[mid].tokens <= x) lo = mid;
        else hi = mid;
    }
    double frac = (x - p[lo].tokens) / (p[hi].tokens - p[lo].tokens);
    return p[lo].efficiency + (p[hi].efficiency - p[lo].efficiency) * frac;
}

/* Grouped-GEMM efficiency at n tokens. */
static double eff_at(const rp_cost *c, double n) { return cost_curve_at(c->eff, c->num_eff, n); }

double cost_slot_time(const rp_cost *c, double n)
{
    if (!(n > 0)) return 0.0;
    double t = n * c->expert_token_s / eff_at(c, n);
    return t > c->expert_mem_s ? t : c->expert_mem_s;
}

double rp_cost_expert_move_s(const rp_cost *c, bool same_node)
{
    if (!c) return 0.0;
    /* received over one link, then written into its slot (the staged copy read, the slot
     * written: 2 x its bytes of HBM), as the migration plan charges one copy */
    const double b = c->expert_move_bytes;
    return same_node ? migrate_links_s(&c->move_links, b, 0.0, 2.0 * b)
                     : migrate_links_s(&c->move_links, 0.0, b, 2.0 * b);
}

/* The CP ring of a cell beyond its attention compute, forward and backward: the packed
 * microbatch runs one ring (THD), cp steps of 1/cp of the attention each, step i + 1's
 * K/V chunk (tokens / cp of them) arriving while step i computes, so each of the cp - 1
 * transfers costs what it takes beyond one step's compute; one latency (the first
 * exchange's start) is never hidden. The backward passes K/V and their gradients: twice
 * the bytes per step. `core` is the cell's attention core at its GPU's speed. */
static void ring_excess(const rp_cost *c, double core, int64_t tokens, double *fwd, double *bwd)
{
    const double steps = c->cp - 1, chunk = (double)tokens / c->cp;
    const double cf = core / c->cp, cb = c->bwd.attention * core / c->cp;
    const double pf = chunk * c->ring_token_s + c->ring_lat, pb = 2.0 * chunk * c->ring_token_s + c->ring_lat;
    *fwd = steps * (pf > cf ? pf - cf : 0.0) + c->ring_lat;
    *bwd = steps * (pb > cb ? pb - cb : 0.0) + c->ring_lat;
}

double cost_cell_attention(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu)
{
    double a = (double)sum_quad * c->attn_quad_s + (double)sum_len * c->attn_lin_s;
    a = gpu < 0 ? a : a / c->speed[gpu];
    if (c->cp > 1 && sum_len > 0) {
        double rf, rb;
        ring_excess(c, (double)sum_quad * c->attn_quad_s / (gpu < 0 ? 1.0 : c->speed[gpu]), sum_len, &rf, &rb);
        a += rf;
    }
    return a;
}

/* The dense phase of a cell: attention, its projections, the token-linear work and the
 * fixed cost of the layer, each with its own backward multiplier, plus the CP ring's
 * unhidden transfers. One function for the full and the incremental evaluation (same
 * bits). */
void cost_cell_dense_at(const rp_cost *c, int64_t sum_quad, int64_t sum_len, double speed, double *fwd,
                        double *bwd)
{
    const double core = (double)sum_quad * c->attn_quad_s, proj = (double)sum_len * c->attn_lin_s;
    const double lin = (double)sum_len * c->token_linear_s, fixed = c->fixed_s;
    *fwd = (core + proj + lin + fixed) / speed;
    *bwd = (c->bwd.attention * core + c->bwd.projections * proj + c->bwd.token_linear * lin +
            c->bwd.fixed * fixed) / speed;
    if (c->cp > 1 && sum_len > 0) {
        double rf, rb;
        ring_excess(c, core / speed, sum_len, &rf, &rb);
        *fwd += rf;
        *bwd += rb;
    }
}

void cost_cell_dense(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu, double *fwd, double *bwd)
{
    cost_cell_dense_at(c, sum_quad, sum_len, gpu < 0 ? 1.0 : c->speed[gpu], fwd, bwd);
}

/* T(m, l) of one sync domain, forward and backward: the dense phase (its forward and
 * backward maxima), the experts and, twice, the dispatch (combine moves the same volume
 * back), each phase at its own backward multiplier. Without overlap the phases follow
 * one another; with per-layer overlap the layer takes the longer of its compute and its
 * communication. One expression for every caller. */
double cost_layer_time(const rp_cost *c, double dfmax, double dbmax, double dmax, double xmax)
{
    const double compute = dfmax + dbmax + (1.0 + c->bwd.experts) * xmax;
    const double comm = 2.0 * (1.0 + c->bwd.communication) * dmax;
    if (c->overlap == RP_OVERLAP_LAYER) return compute > comm ? compute : comm;
    return compute + comm;
}

/* The forward and the backward of one (m, l) apart, for a pipeline that runs them at
 * different times: each pass's compute and communication at its own multipliers, under
 * the configured overlap. */
static void layer_passes(const rp_cost *c, double dfmax, double dbmax, double dmax, double xmax, double *fwd,
                         double *bwd)
{
    const double cf = dfmax + xmax, mf = 2.0 * dmax;
    const double cb = dbmax + c->bwd.experts * xmax, mb = 2.0 * c->bwd.communication * dmax;
    if (c->overlap == RP_OVERLAP_LAYER) {
        *fwd = cf > mf ? cf : mf;
        *bwd = cb > mb ? cb : mb;
    } else {
        *fwd = cf + mf;
        *bwd = cb + mb;
    }
}

void cost_layer_times(const rp_cost *c, const double *dfmax, const double *dbmax, const double *dmax,
                      const double *xmax, double *out)
{
    cost_count(c, c->Q);
    const int32_t NQ = c->NQ;
    if (c->sync == RP_SYNC_GROUP) {
        for (int32_t q = 0; q < c->Q; q++) {
            out[q] = cost_layer_time(c, dfmax[q], dbmax[q], dmax[q], xmax[q]);
            if (c->PP > 1) layer_passes(c, dfmax[q], dbmax[q], dmax[q], xmax[q], &out[NQ + q], &out[2 * NQ + q]);
        }
        return;
    }
    double f = dfmax[0], b = dbmax[0], d = dmax[0], x = xmax[0];
    for (int32_t q = 1; q < c->Q; q++) {
        if (dfmax[q] > f) f = dfmax[q];
        if (dbmax[q] > b) b = dbmax[q];
        if (dmax[q] > d) d = dmax[q];
        if (xmax[q] > x) x = xmax[q];
    }
    out[0] = cost_layer_time(c, f, b, d, x);
    if (c->PP > 1) layer_passes(c, f, b, d, x, &out[1], &out[2]);
}
