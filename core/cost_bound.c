/* The lower bound of the cost model: for each microbatch and layer, the same work with
 * every term perfectly balanced over the GPUs (docs/cost-model.md, "Lower bound"). */
#include "cost_internal.h"

#include <string.h>

rp_status cost_bound_prepare(rp_cost *c, int32_t slots_max, rp_error *err)
{
    (void)slots_max;
    if (c->seq_nonlocal) return RP_OK;
    c->seq_nonlocal = rp_alloc(c->ctx, (size_t)c->N * (size_t)c->L * sizeof *c->seq_nonlocal);
    if (!c->seq_nonlocal) return rp_fail_nomem(err, "the lower bound's per-sequence volumes");
    c->nonlocal_slots = -1;
    return RP_OK;
}

/* Sum of the k largest of values[0..n): how many of a sequence's token-choices can at
 * best stay on its GPU when that GPU holds k distinct experts. Counts are small
 * integers, so usually a count of each value, walked from the top; otherwise a
 * min-heap of the k largest so far. `heap` holds max(n, COST_TOP_BUCKETS + 1) entries. */
uint64_t cost_top_sum(const uint32_t *values, int32_t n, int32_t k, uint32_t *heap)
{
    uint64_t sum = 0;
    if (k <= 0) return 0;
    if (k >= n) {
        for (int32_t i = 0; i < n; i++) sum += values[i];
        return sum;
    }
    uint32_t top = 0;
    for (int32_t i = 0; i < n; i++) top = values[i] > top ? values[i] : top;
    if (top <= COST_TOP_BUCKETS && top <= 8u * (uint32_t)n) {
        uint32_t *count = heap;
        memset(count, 0, ((size_t)top + 1) * sizeof *count);
        for (int32_t i = 0; i < n; i++) count[values[i]]++;
        uint32_t left = (uint32_t)k;
        for (uint32_t v = top; v > 0 && left; v--) {
            uint32_t take = count[v] < left ? count[v] : left;
            sum += (uint64_t)take * v;
            left -= take;
        }
        return sum;
    }
    int32_t size = 0;
    for (int32_t i = 0; i < n; i++) {
        uint32_t v = values[i];
        if (!v) continue;
        int32_t at;
        if (size < k) {
            at = size++;
            while (at > 0 && heap[(at - 1) / 2] > v) {
                heap[at] = heap[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            heap[at] = v;
        } else if (v > heap[0]) {
            at = 0;
            for (;;) {
                int32_t child = 2 * at + 1;
                if (child >= size) break;
                if (child + 1 < size && heap[child + 1] < heap[child]) child++;
                if (heap[child] >= v) break;
                heap[at] = heap[child];
                at = child;
            }
            heap[at] = v;
        }
    }
    for (int32_t i = 0; i < size; i++) sum += heap[i];
    return sum;
}

/* Non-local volume of (m, l) when a GPU may hold `slots` experts: sum over the
 * microbatch's sequences of their token-choices beyond the `slots` largest. */
static int64_t nonlocal_volume(const rp_cost *c, const cost_state *st, int32_t m, int32_t l,
                               int32_t slots)
{
    if (slots == st->slots_max && c->nonlocal_slots == slots)
        return st->mb_nonlocal[(size_t)m * c->L + l];
    /* Extra replicas give some GPU more slots at this (m, l): recompute. The scratch
     * buffer is the evaluator's own (an evaluator is used by one thread at a time). */
    uint32_t *h = c->sc.hist;
    int64_t volume = 0;
    for (int32_t s = 0; s < c->N; s++) {
        if (st->seq_mb[s] != m) continue;
        rp_stats_seq_hist(c->stats, s, l, h);
        uint64_t total = 0;
        for (int32_t e = 0; e < c->E; e++) total += h[e];
        volume += (int64_t)(total - cost_top_sum(h, c->E, slots, c->sc.sel));
    }
    return volume;
}

/* Forward lower bound of layer time T(m, l), seconds. Each term is a bound of its
 * counterpart for every plan that keeps the microbatch's sequences (any GPU, any
 * placement, any levers), so their sum bounds T(m, l):
 *   attention  max(sum_s a(L_s) / sum_g speed_g, a(max_s L_s) / max_g speed_g)
 *   experts    sum_e [N_e > 0] max(N_e 6df / (peak eff_max), 3df bpp / hbm) / sum_g speed_g
 *   dispatch   (ep > 1 ? nvlink latency : 0) + (V / G) d bpp / max(nvlink bw, net bw)
 *   combine    the same as dispatch
 * with N_e the microbatch's token-choices of expert e and V the token-choices that
 * leave their GPU however experts are placed (see nonlocal_volume). */
double cost_bound_layer(const rp_cost *c, const cost_state *st, int32_t m, int32_t l,
                        int32_t max_len_m)
{
    const int32_t M = st->M, G = c->G, E = c->E, ep = c->ep;
    int64_t sq = 0, len = 0;
    for (int32_t g = 0; g < G; g++) {
        sq += st->cell_sq[(size_t)g * M + m];
        len += st->cell_tokens[(size_t)g * M + m];
    }
    double work = ((double)sq * c->attn_sq_s + (double)len * c->attn_lin_s) / c->speed_sum;
    double single = rp_cost_attention_s(c, max_len_m) / c->speed_max;
    double attention = work > single ? work : single;

    const int64_t *load = st->mb_load + ((size_t)m * c->L + l) * E;
    const double per_token = c->expert_token_s / c->eff_max;
    double expert = 0.0;
    for (int32_t e = 0; e < E; e++) {
        if (load[e] <= 0) continue;
        double t = (double)load[e] * per_token;
        expert += t > c->expert_mem_s ? t : c->expert_mem_s;
    }
    expert /= c->speed_sum;

    double dispatch = 0.0;
    if (ep > 1) {
        int32_t slots = 0;
        const int32_t *extra = st->extra_count + ((size_t)m * c->L + l) * ep;
        for (int32_t r = 0; r < ep; r++) {
            int32_t n = st->slot_begin[r + 1] - st->slot_begin[r] + extra[r];
            if (n > slots) slots = n;
        }
        double bw = c->nv_bw > c->net_bw ? c->nv_bw : c->net_bw;
        double volume = (double)nonlocal_volume(c, st, m, l, slots);
        dispatch = c->nv_lat + volume / G * c->token_bytes / bw;
    }
    return attention + dispatch + expert + dispatch;
}

/* The bound of every layer of microbatch m, into the state (after a full evaluation, and
 * after a move between microbatches: nothing else changes it). */
void cost_bound_microbatch(const rp_cost *c, cost_state *st, int32_t m)
{
    int32_t max_len = 0;
    for (int32_t g = 0; g < c->G; g++)
        if (st->cell_max[(size_t)g * st->M + m] > max_len) max_len = st->cell_max[(size_t)g * st->M + m];
    for (int32_t l = 0; l < c->L; l++) st->lb_layer[(size_t)m * c->L + l] = cost_bound_layer(c, st, m, l, max_len);
}
