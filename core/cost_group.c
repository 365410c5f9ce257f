/* One (microbatch, layer, EP group) of the cost model: the dense maxima, where each
 * expert's tokens go, the dispatch and combine traffic with its de-duplication, and the
 * expert and dispatch time of every GPU of the group (docs/cost-model.md). A full and an
 * incremental evaluation call these same functions on the same integers. */
#include "cost_internal.h"
#include "routepack/executor.h"
#include "routepack/virtual_experts.h"

#include <math.h>
#include <string.h>

void cost_group_dense(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int32_t gA, int32_t mA,
                      double fA, double bA, int32_t gB, int32_t mB, double fB, double bB, double *fmax,
                      double *bmax, int32_t *farg)
{
    const int32_t g0 = q * c->ep, M = st->M;
    *fmax = *bmax = -1.0;
    *farg = g0;
    cost_count(c, c->ep);
    for (int32_t g = g0; g < g0 + c->ep; g++) {
        double f, b;
        if (g == gA && m == mA) f = fA, b = bA;
        else if (g == gB && m == mB) f = fB, b = bB;
        else f = st->dense_f[(size_t)g * M + m], b = st->dense_b[(size_t)g * M + m];
        if (f > *fmax) {
            *fmax = f;
            *farg = g;
        }
        if (b > *bmax) *bmax = b;
    }
}

/* ---- one (microbatch, layer, EP group) ------------------------------------------ */


/* Group a destination map's experts by destination: ord lists the experts of
 * destination d at ord[seg[d] .. seg[d + 1]) (d = ep: split experts). */
static void map_segments(int32_t E, int32_t ep, const int32_t *dst, int32_t *seg, int32_t *ord)
{
    for (int32_t r = 0; r <= ep + 1; r++) seg[r] = 0;
    for (int32_t e = 0; e < E; e++) seg[dst[e] + 1]++;
    for (int32_t r = 0; r <= ep; r++) seg[r + 1] += seg[r];
    for (int32_t e = 0; e < E; e++) ord[seg[dst[e]]++] = e;
    for (int32_t r = ep; r > 0; r--) seg[r] = seg[r - 1];
    seg[0] = 0;
}

/* Where each expert's token-choices go at (m, l): the EP rank of its only replica, or
 * ep when it has several (then they are split, source by source). The base placement's
 * map is cached per layer; (m, l) with levers, and placements under trial, get theirs
 * built in the scratch space. */
cost_map cost_dst_map(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, const int32_t *rep_off,
                      const int32_t *rep_rank, bool base, cost_scratch *sc)
{
    const int32_t ml = m * c->L + l;
    const cost_override *ov = st->ov + st->ov_begin[ml], *ov_end = st->ov + st->ov_begin[ml + 1];
    if (base && ov == ov_end)
        return (cost_map){st->lay_dst + (size_t)l * c->E, st->lay_seg + (size_t)l * (c->ep + 2),
                          st->lay_ord + (size_t)l * c->E};
    for (int32_t e = 0; e < c->E; e++) {
        const cost_override *o = (ov < ov_end && ov->expert == e) ? ov++ : NULL;
        int32_t R = rep_off[e + 1] - rep_off[e] + (o ? o->num_extra : 0);
        sc->dst[e] = R == 1 ? rep_rank[rep_off[e]] : c->ep;
    }
    map_segments(c->E, c->ep, sc->dst, sc->seg, sc->ord);
    cost_count(c, 3 * (int64_t)c->E + 2 * (int64_t)c->ep + 4);
    return (cost_map){sc->dst, sc->seg, sc->ord};
}

/* The integer aggregates of group q at (m, l), from the per-GPU counts: each expert's
 * token-choices over the group, and the token-choices of single-replica experts each
 * GPU sends to each other GPU of the group (pair[src * ep + dst]; the diagonal stays 0).
 * Integers, so a move can update them by its own histogram and land on exactly these
 * values. */
void cost_group_rebuild(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                        cost_map map, int32_t *total, int32_t *pair)
{
    const int32_t ep = c->ep, E = c->E, g0 = q * ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    memset(total, 0, (size_t)E * sizeof *total);
    memset(pair, 0, (size_t)ep * ep * sizeof *pair);
    cost_count(c, E + 2 * (int64_t)ep * (E + ep) + 4 * (int64_t)ep);
    for (int32_t src = 0; src < ep; src++) {
        const int32_t *row = cnt + (size_t)src * E;
        for (int32_t e = 0; e < E; e++) total[e] += row[e];
        for (int32_t d = 0; d < ep; d++) {
            if (d == src) continue;
            int32_t sum = 0;
            for (int32_t i = map.seg[d]; i < map.seg[d + 1]; i++) sum += row[map.ord[i]];
            pair[(size_t)src * ep + d] = sum;
        }
    }
}

void cost_group_tokens(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int64_t *tok)
{
    for (int32_t r = 0; r < c->ep; r++) tok[r] = st->cell_tokens[(size_t)(q * c->ep + r) * st->M + m];
}

/* The change of a group's totals and pairs when EP rank `src` of the group gains
 * sign x hist. Integers: undone exactly by the opposite sign. */
void cost_delta_aggregates(const rp_cost *c, int32_t src, const int32_t *restrict h, int32_t sign, cost_map map,
                           int32_t *restrict total, int32_t *restrict pair)
{
    const int32_t ep = c->ep, E = c->E;
    cost_count(c, 2 * (int64_t)E + 2 * (int64_t)ep);
    if (sign > 0)
        for (int32_t e = 0; e < E; e++) total[e] += h[e];
    else
        for (int32_t e = 0; e < E; e++) total[e] -= h[e];
    for (int32_t d = 0; d < ep; d++) {
        if (d == src) continue;
        int32_t sum = 0;
        for (int32_t i = map.seg[d]; i < map.seg[d + 1]; i++) sum += h[map.ord[i]];
        pair[(size_t)src * ep + d] += sign * sum;
    }
}

/* The same change in the state: the GPU's counts and its group's aggregates. */
void cost_group_delta(const rp_cost *c, cost_state *st, int32_t m, int32_t l, int32_t gpu,
                      const uint32_t *hist, int32_t sign, cost_map map)
{
    const int32_t ep = c->ep, E = c->E, q = gpu / ep;
    const size_t gq = ((size_t)m * c->L + l) * c->Q + q;
    int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + gpu) * (size_t)E;
    const int32_t *h = (const int32_t *)hist; /* a sequence's counts fit int32 (see rp_cost_new) */
    cost_count(c, E);
    if (sign > 0)
        for (int32_t e = 0; e < E; e++) cnt[e] += h[e];
    else
        for (int32_t e = 0; e < E; e++) cnt[e] -= h[e];
    cost_delta_aggregates(c, gpu % ep, h, sign, map, st->gtotal + gq * E, st->gpair + gq * ep * ep);
}

/* Copies of a source's tokens that reach one destination (a GPU or a node) when `choices`
 * of its token-choices go there, sent once per token (execution.dispatch_dedup gpu or
 * node). The statistics hold per-sequence expert histograms, not which choices share a
 * token, so this is an expectation: a token can send at most m = min(top_k, experts the
 * destination holds) of its choices there; with each of those m chances taken
 * independently at p = choices / (tokens m), tokens (1 - (1 - p)^m) tokens send at least
 * one. Exact when m = 1 and when every token sends m choices there; always between
 * choices / m and min(choices, tokens). */
static double dedup_copies(double choices, double tokens, int32_t m)
{
    if (!(choices > 0) || m <= 1 || !(tokens > 0)) return choices;
    double p = choices / (tokens * m);
    if (p >= 1.0) return tokens;
    /* tokens (1 - q^m), q = 1 - p, as tokens p (1 + q + ... + q^(m-1)) = choices / m
     * times that sum (Horner): no cancellation however small p is, and m - 1
     * multiply-adds (m <= top_k) where expm1(m log1p(-p)) took a fifth of an evaluation */
    const double q = 1.0 - p;
    double sum = 1.0;
    for (int32_t k = 1; k < m; k++) sum = 1.0 + q * sum;
    return choices / m * sum;
}

/* min(top_k, slots of EP ranks [r0, r1)): the most choices a token can send there. */
static int32_t dedup_limit(const rp_cost *c, const cost_state *st, int32_t r0, int32_t r1)
{
    int64_t slots = st->slot_begin[r1] - st->slot_begin[r0];
    return slots < c->top_k ? (int32_t)slots : c->top_k;
}

/* Token copies each GPU of the group (first GPU g0) sends and receives inside its node
 * (sc->si, sc->ri) and across nodes (sc->se, sc->re) at one (m, l), from the
 * token-choices between each pair of GPUs (the single-replica experts' integer pairs plus
 * the split experts' shares) and each source's tokens, under the configured
 * de-duplication (docs/cost-model.md, "Dispatch and combine"). */
static void group_traffic(const rp_cost *c, const cost_state *st, int32_t g0, const int32_t *pair,
                          const double *sp, const int64_t *tokens, cost_scratch *sc)
{
    const int32_t ep = c->ep, gpn = c->gpn;
    double *si = sc->si, *ri = sc->ri, *se = sc->se, *re = sc->re;
    for (int32_t r = 0; r < ep; r++) si[r] = ri[r] = se[r] = re[r] = 0.0;
    for (int32_t src = 0; src < ep; src++) {
        const int32_t node = c->gpu_node[g0 + src];
        const double n = (double)tokens[src];
        if (c->dedup != RP_DEDUP_NODE) {
            for (int32_t d = 0; d < ep; d++) {
                if (d == src) continue;
                double ch = (double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d];
                if (!(ch > 0)) continue;
                double v = c->dedup == RP_DEDUP_GPU ? dedup_copies(ch, n, dedup_limit(c, st, d, d + 1)) : ch;
                if (c->gpu_node[g0 + d] == node) {
                    si[src] += v;
                    ri[d] += v;
                } else {
                    se[src] += v;
                    re[d] += v;
                }
            }
            continue;
        }
        /* per node: the group's GPUs of one node are a contiguous run [d0, d1) */
        for (int32_t d0 = 0; d0 < ep;) {
            const int32_t dn = c->gpu_node[g0 + d0];
            int32_t d1 = d0;
            double to_node = 0.0;
            while (d1 < ep && c->gpu_node[g0 + d1] == dn) {
                if (d1 != src) to_node += (double)pair[(size_t)src * ep + d1] + sp[(size_t)src * ep + d1];
                d1++;
            }
            if (dn == node) { /* own node: NVLink, one copy per destination GPU */
                for (int32_t d = d0; d < d1; d++) {
                    if (d == src) continue;
                    double v = dedup_copies((double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d], n,
                                            dedup_limit(c, st, d, d + 1));
                    si[src] += v;
                    ri[d] += v;
                }
            } else if (to_node > 0) {
                /* one copy per token over the network to the GPU of that node with the
                 * source's local index (else the node's first GPU in the group), which
                 * forwards one copy per destination GPU over NVLink */
                int32_t land = (int32_t)((int64_t)dn * gpn + (g0 + src) % gpn) - g0;
                if (land < d0 || land >= d1) land = d0;
                double v = dedup_copies(to_node, n, dedup_limit(c, st, d0, d1));
                se[src] += v;
                re[land] += v;
                for (int32_t d = d0; d < d1; d++) {
                    if (d == land) continue;
                    double f = dedup_copies((double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d], n,
                                            dedup_limit(c, st, d, d + 1));
                    si[land] += f;
                    ri[d] += f;
                }
            }
            d0 = d1;
        }
    }
}

void cost_group_traffic(const rp_cost *c, const cost_state *st, int32_t g0, const int32_t *pair, const double *sp,
                        const int64_t *tokens, cost_scratch *sc)
{
    group_traffic(c, st, g0, pair, sp, tokens, sc);
}

/* Expert and dispatch time of every GPU of group q at (m, l), from the group's integer
 * aggregates (and the per-GPU counts for experts split over several replicas), in a
 * fixed order: a full evaluation and every incremental one call this same function on
 * the same integers, so their results agree bit for bit. */
void cost_group_eval(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                     const int32_t *rep_off, const int32_t *rep_rank, cost_map map,
                     const int32_t *total, const int32_t *pair, const int64_t *tokens, double *x_out,
                     double *d_out, group_result *res, cost_scratch *sc)
{
    if (st->vexp) {
        cost_group_eval_vexp(c, st, m, l, q, pair, tokens, x_out, d_out, res, sc);
        return;
    }
    const int32_t *dst = map.dst;
    const int32_t ep = c->ep, E = c->E, g0 = q * ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    double *xa = sc->xacc, *sp = sc->sp;
    const cost_override *ov = st->ov + st->ov_begin[m * c->L + l];
    const cost_override *ov_end = st->ov + st->ov_begin[m * c->L + l + 1];
    double *xtok = xa + ep; /* tokens each rank's experts take, for the ETP all-gather */
    double *xrow = xa + 2 * ep, *xgrp = xa + 3 * ep; /* the grouped GEMM's rows and groups */
    /* the extras' own grouped GEMM (extras_apart): its weight gradients, rows and groups */
    double *ya = xa + 4 * ep, *yrow = xa + 5 * ep, *ygrp = xa + 6 * ep;
    for (int32_t r = 0; r < ep; r++) xa[r] = xtok[r] = xrow[r] = xgrp[r] = ya[r] = yrow[r] = ygrp[r] = 0.0;
    memset(sp, 0, (size_t)ep * ep * sizeof *sp);

    for (int32_t e = 0; e < E; e++) {
        if (dst[e] < ep) {
            cost_expert_add_int(c, total[e], &xa[dst[e]], &xrow[dst[e]], &xgrp[dst[e]]);
            xtok[dst[e]] += (double)total[e];
            continue;
        }
        while (ov < ov_end && ov->expert < e) ov++;
        const cost_override *o = (ov < ov_end && ov->expert == e) ? ov : NULL;
        const int32_t nb = rep_off[e + 1] - rep_off[e], R = nb + (o ? o->num_extra : 0);
        const int32_t *base = rep_rank + rep_off[e];
        cost_count(c, (int64_t)R * (5 + (int64_t)ep * (c->rule == RP_SPLIT_EVEN ? 1 : 3)));
        int32_t *rk = sc->rk;
        double *w = sc->w, *load = sc->load;
        for (int32_t i = 0; i < nb; i++) rk[i] = base[i];
        for (int32_t i = nb; i < R; i++) rk[i] = st->extra_rank[o->extra_off + i - nb];
        for (int32_t i = 0; i < R; i++) load[i] = 0.0;
        const bool fixed = (o && o->num_shares) || c->rule == RP_SPLIT_EVEN;
        if (fixed)
            for (int32_t i = 0; i < R; i++)
                w[i] = o && o->num_shares ? st->share_val[o->share_off + i] : 1.0 / R;
        for (int32_t src = 0; src < ep; src++) {
            int32_t v = cnt[(size_t)src * E + e];
            if (!v) continue;
            const int32_t node = c->gpu_node[g0 + src];
            int32_t tier = 2, k = R;
            if (!fixed) {
                /* locality: own GPU, else own node, else everyone, evenly inside the tier */
                int32_t own = 0, near = 0;
                for (int32_t i = 0; i < R; i++) {
                    own += rk[i] == src;
                    near += c->gpu_node[g0 + rk[i]] == node;
                }
                tier = own ? 0 : near ? 1 : 2;
                k = own ? own : near ? near : R;
            }
            for (int32_t i = 0; i < R; i++) {
                double part;
                if (fixed) part = (double)v * w[i];
                else if (tier == 2 || (tier == 1 && c->gpu_node[g0 + rk[i]] == node) || rk[i] == src)
                    part = (double)v / k;
                else continue;
                if (!fixed) load[i] += part;
                if (rk[i] == src || part == 0.0) continue;
                sp[(size_t)src * ep + rk[i]] += part;
            }
        }
        if (fixed)
            for (int32_t i = 0; i < R; i++) load[i] = (double)total[e] * w[i];
        for (int32_t i = 0; i < R; i++) {
            const int32_t r = rk[i];
            if (i >= nb && c->extras_apart)
                cost_expert_add(c, load[i], &ya[r], &yrow[r], &ygrp[r]);
            else
                cost_expert_add(c, load[i], &xa[r], &xrow[r], &xgrp[r]);
            xtok[r] += load[i];
        }
    }
    /* routepack.torch runs a GPU's extras from their buffers as a second grouped GEMM
     * (kernels.expert_mlp on the extras' rows): at the efficiency of its own few rows,
     * every extra's weights read, not the slots' GEMM grown by their rows */
    for (int32_t r = 0; r < ep; r++)
        xa[r] = cost_gemm_finish(c, xa[r], xrow[r], xgrp[r]) + cost_gemm_finish(c, ya[r], yrow[r], ygrp[r]);

    if (c->extras_stacked) {
        /* routepack.torch stacks a GPU's slots and extras into one weight tensor every
         * forward it has extras, and launches its GEMMs for each extra too */
        const int32_t *nx = st->extra_count + (size_t)(m * c->L + l) * ep;
        for (int32_t r = 0; r < ep; r++)
            if (nx[r] > 0)
                xa[r] += (double)(st->slot_begin[r + 1] - st->slot_begin[r] + nx[r]) * c->stack_s +
                         nx[r] * c->extra_launch_s;
    }
    cost_count(c, E + 2 * (int64_t)ep + 3 * (int64_t)ep * ep);
    group_traffic(c, st, g0, pair, sp, tokens, sc);
    const double *si = sc->si, *ri = sc->ri, *se = sc->se, *re = sc->re;
    res->xmax = res->dmax = -1.0;
    res->xarg = res->darg = g0;
    const double base_lat = ep > 1 ? c->nv_lat : 0.0;
    for (int32_t r = 0; r < ep; r++) {
        double x = xa[r] / c->speed[g0 + r];
        double send_in = si[r], send_out = se[r], recv_in = ri[r], recv_out = re[r];
        double intra = send_in > recv_in ? send_in : recv_in;
        double inter = send_out > recv_out ? send_out : recv_out;
        double d = intra * c->token_bytes / c->nv_bw + inter * c->token_bytes / c->net_bw + base_lat +
                   (inter > 0 ? c->net_lat : 0.0) + xtok[r] * c->etp_gather_s;
        x_out[r] = x;
        d_out[r] = d;
        group_result_note(res, g0 + r, x, d);
    }
}

/* Replicas of every expert of one layer: EP rank of each, in ascending slot order. */
void cost_index_layer(int32_t E, int32_t S, const int32_t *slot_rank_of, const int32_t *phy2log,
                      int32_t *rep_off, int32_t *rep_rank)
{
    memset(rep_off, 0, (size_t)(E + 1) * sizeof *rep_off);
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] >= 0) rep_off[phy2log[s] + 1]++;
    for (int32_t e = 0; e < E; e++) rep_off[e + 1] += rep_off[e];
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] >= 0) rep_rank[rep_off[phy2log[s]]++] = slot_rank_of[s];
    for (int32_t e = E; e > 0; e--) rep_off[e] = rep_off[e - 1];
    rep_off[0] = 0;
}

/* Destination map of a layer's base placement (no levers), into the state's cache. */
void cost_layer_dst(const rp_cost *c, cost_state *st, int32_t l, const int32_t *rep_off,
                    const int32_t *rep_rank)
{
    int32_t *dst = st->lay_dst + (size_t)l * c->E;
    cost_count(c, 3 * (int64_t)c->E + 2 * (int64_t)c->ep + 4);
    /* under per-forward balancing every expert counts as split: a trial move then keeps
     * every per-GPU count current, which the balancer's plan reads (cost_vexp.c) */
    for (int32_t e = 0; e < c->E; e++)
        dst[e] = rep_off[e + 1] - rep_off[e] == 1 && !st->vexp ? rep_rank[rep_off[e]] : c->ep;
    map_segments(c->E, c->ep, dst, st->lay_seg + (size_t)l * (c->ep + 2), st->lay_ord + (size_t)l * c->E);
}

void cost_group_eval_vexp(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                          const int32_t *pair, const int64_t *tokens, double *x_out, double *d_out,
                          group_result *res, cost_scratch *sc)
{
    const int32_t ep = c->ep, E = c->E, g0 = q * ep, per_rank = E / ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    const int32_t *owner = st->vexp_owner + (size_t)l * E;
    rp_vexp *v = c->vexp;
    /* Cannot fail: the ownership was checked when the plan was bound, counts are
     * non-negative and a group's total is at most the batch's token-choices (< 2^31). */
    rp_status planned = rp_vexp_plan(v, cnt, owner, NULL);
    (void)planned;
    cost_count(c, 4 * (int64_t)E * ep + 4 * (int64_t)ep * ep);
    const int64_t *alloc = rp_vexp_allocation(v), *traffic = rp_vexp_traffic(v);
    const int32_t *slot = rp_vexp_slot_expert(v), *pin = rp_vexp_pushes_in(v), *pout = rp_vexp_pushes_out(v);
    double *xa = sc->xacc, *sp = sc->sp, *xrow = xa + 2 * ep, *xgrp = xa + 3 * ep;
    for (int32_t r = 0; r < ep; r++) xa[r] = xrow[r] = xgrp[r] = 0.0;
    for (int32_t e = 0; e < E; e++) {
        const int32_t o = owner[e];
        cost_expert_add_int(c, alloc[(size_t)e * ep + o], &xa[o], &xrow[o], &xgrp[o]);
    }
    for (int32_t r = 0; r < ep; r++) {
        for (int32_t s = 0; s < per_rank; s++) {
            int32_t e = slot[(size_t)r * per_rank + s];
            if (e >= 0) cost_expert_add_int(c, alloc[(size_t)e * ep + r], &xa[r], &xrow[r], &xgrp[r]);
        }
        xa[r] = cost_gemm_finish(c, xa[r], xrow[r], xgrp[r]);
    }
    /* The route map's choices between GPUs (every expert counts as split under
     * balancing, so `pair` holds none), de-duplicated as the dispatcher would. All inside
     * the group's node: the balancer's limit. */
    for (size_t i = 0; i < (size_t)ep * ep; i++) sp[i] = (double)traffic[i];
    for (int32_t r = 0; r < ep; r++) sp[(size_t)r * ep + r] = 0.0;
    cost_group_traffic(c, st, g0, pair, sp, tokens, sc);

    /* Megatron pads every rank of the group to the same token count (the balancer's
     * static shapes): each rank's experts run the largest cell's tokens, the group's
     * balanced load scaled by max / mean tokens */
    int64_t most = 0, sum = 0;
    for (int32_t r = 0; r < ep; r++) {
        sum += tokens[r];
        if (tokens[r] > most) most = tokens[r];
    }
    const double pad = sum > 0 && c->vexp_charges ? (double)most * ep / (double)sum : 1.0;
    res->xmax = res->dmax = -1.0;
    res->xarg = res->darg = g0;
    for (int32_t r = 0; r < ep; r++) {
        double send = sc->si[r], recv = sc->ri[r];
        int32_t copies = pin[r] > pout[r] ? pin[r] : pout[r];
        /* two weight pushes (forward, backward) and the gradients back in FP32 main-grad
         * dtype (bytes_per_grad) */
        double push = copies ? copies * c->expert_bytes / c->nv_bw + c->nv_lat : 0.0;
        double push_grad = copies ? copies * (c->vexp_charges ? c->vexp_grad_bytes : c->expert_bytes) / c->nv_bw +
                                        c->nv_lat
                                  : 0.0;
        double x = xa[r] * pad / c->speed[g0 + r];
        /* the push's copy kernels hold RP_BALANCER_PUSH_SM_FRACTION of the SMs while it
         * runs beside the expert GEMMs: the GEMMs overlapping it run that much slower */
        if (c->vexp_charges)
            x += RP_BALANCER_PUSH_SM_FRACTION / (1.0 - RP_BALANCER_PUSH_SM_FRACTION) * (push < x ? push : x);
        double d = (send > recv ? send : recv) * c->token_bytes / c->nv_bw + c->nv_lat +
                   c->vexp_comm_scale * (2.0 * push + push_grad);
        x_out[r] = x;
        d_out[r] = d;
        group_result_note(res, g0 + r, x, d);
    }
}
