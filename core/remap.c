/* Remap (routepack/remap.h): the physical replica of every token-choice of a microbatch,
 * and the replica table the CUDA kernel (kernels/remap.cu) shares with this CPU reference. */
#include "internal.h"
#include "gpu_dispatch.h"
#include "remap_internal.h"
#include "routing_access.h"
#include "routepack/gpu.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#define MAX_THREADS 256

/* ---- physical ids ---------------------------------------------------------------- */

int32_t rp_remap_num_physical(const rp_plan *plan, int32_t mb)
{
    if (!plan || !rp_plan_has_placement(plan) || mb < 0 || mb >= rp_plan_num_microbatches(plan))
        return -1;
    int32_t most = 0, nx = rp_plan_num_extra_replicas(plan);
    int32_t run = 0, prev_l = -1;
    for (int32_t i = 0; i < nx; i++) { /* sorted by (mb, layer, expert) */
        int32_t m, l, e, r;
        rp_plan_extra_replica(plan, i, &m, &l, &e, &r);
        if (m != mb) continue;
        run = l == prev_l ? run + 1 : 1;
        prev_l = l;
        if (run > most) most = run;
    }
    return rp_plan_total_slots(plan) + most;
}

int32_t rp_remap_physical_ep_rank(const rp_plan *plan, int32_t mb, int32_t layer, int32_t phys)
{
    if (!plan || !rp_plan_has_placement(plan) || mb < 0 || mb >= rp_plan_num_microbatches(plan) ||
        layer < 0 || layer >= rp_plan_num_layers(plan) || phys < 0)
        return -1;
    const int32_t S = rp_plan_total_slots(plan), ep = rp_plan_ep_size(plan);
    const int32_t *begin = rp_plan_slot_begin(plan);
    if (phys < S) {
        int32_t j = 0;
        while (j + 1 < ep && begin[j + 1] <= phys) j++;
        return j;
    }
    int32_t want = phys - S, n = 0, nx = rp_plan_num_extra_replicas(plan);
    for (int32_t i = 0; i < nx; i++) {
        int32_t m, l, e, r;
        rp_plan_extra_replica(plan, i, &m, &l, &e, &r);
        if (m == mb && l == layer && n++ == want) return r;
    }
    return -1;
}

/* ---- the table -------------------------------------------------------------------- */

void remap_table_free(rp_context *ctx, remap_table *t)
{
    rp_free(ctx, t->cand);
    rp_free(ctx, t->cand_phys);
    rp_free(ctx, t->weight);
    rp_free(ctx, t->key_layer);
    rp_free(ctx, t->key_expert);
    rp_free(ctx, t->key_bofs);
    rp_free(ctx, t->key_first);
    rp_free(ctx, t->key_count);
    rp_free(ctx, t->phys_rank);
    rp_free(ctx, t->seq_gpu);
    rp_free(ctx, t->order);
    rp_free(ctx, t->gpu_begin);
    memset(t, 0, sizeof *t);
}

/* Append n entries to a growable int32 (or uint64) array. */
static bool grow(rp_context *ctx, void **arr, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return true;
    int64_t nc = *cap ? *cap : 256;
    while (nc < need) nc *= 2;
    void *p = rp_realloc(ctx, *arr, (size_t)nc * elem);
    if (!p) return false;
    *arr = p;
    *cap = nc;
    return true;
}

/* Shares to fixed point: floor(share / sum * 2^32), then the units left over to the
 * largest fractional parts (ties to the lower index), so the weights sum to 2^32. */
static void shares_to_weights(const double *shares, int32_t r, double sum, uint64_t *w)
{
    uint64_t total = 0;
    for (int32_t i = 0; i < r; i++) {
        double q = shares[i] / sum * 4294967296.0;
        if (q > 4294967296.0) q = 4294967296.0;
        w[i] = (uint64_t)floor(q);
        total += w[i];
    }
    while (total > REMAP_ONE) { /* rounding pushed past 2^32: take from the largest */
        int32_t big = 0;
        for (int32_t i = 1; i < r; i++)
            if (w[i] > w[big]) big = i;
        w[big]--;
        total--;
    }
    int64_t left = (int64_t)(REMAP_ONE - total);
    for (int64_t round = 0; left > 0; round++) {
        for (int32_t i = 0; i < r && left > 0; i++) {
            double fi = shares[i] / sum * 4294967296.0 - floor(shares[i] / sum * 4294967296.0);
            int32_t rank = 0;
            for (int32_t j = 0; j < r; j++) {
                double fj = shares[j] / sum * 4294967296.0 - floor(shares[j] / sum * 4294967296.0);
                rank += fj > fi || (fj == fi && j < i);
            }
            if (rank == (int32_t)(round % r)) {
                w[i]++;
                left--;
            }
        }
    }
}

rp_status remap_table_build(rp_context *ctx, const rp_plan *plan, const rp_config *cfg, int32_t mb,
                            const rp_batch *batch, int32_t num_layers, int32_t top_k,
                            rp_split_rule rule, remap_table *t, rp_error *err)
{
    rp_status st = RP_OK;
    memset(t, 0, sizeof *t);
    int32_t *rep_off = NULL, *rep_phys = NULL, *rep_rank = NULL, *ex_rank = NULL, *share_of = NULL;
    int32_t *list = NULL, *ex_expert = NULL;
    int64_t cap_phys = 0, cap_w = 0;
    if (!plan || !cfg || !batch) return rp_fail(err, RP_EINVAL, "remap: missing plan, config or batch");
    if (rule != RP_SPLIT_EVEN && rule != RP_SPLIT_LOCALITY)
        return rp_fail(err, RP_EINVAL, "remap: split rule %d is neither RP_SPLIT_EVEN nor RP_SPLIT_LOCALITY", (int)rule);
    if (!rp_plan_has_packing(plan) || !rp_plan_has_placement(plan))
        return rp_fail(err, RP_EINVAL, "remap: the plan needs both a packing and a placement");
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    t->G = rp_plan_num_gpus(plan);
    t->ep = rp_plan_ep_size(plan);
    t->L = rp_plan_num_layers(plan);
    t->E = rp_plan_num_experts(plan);
    t->S = rp_plan_total_slots(plan);
    t->k = top_k;
    t->mb = mb;
    t->gpus_per_node = topo->gpus_per_node;
    if (topo->num_gpus != t->G || topo->ep_size != t->ep || model->num_layers != t->L ||
        model->num_experts != t->E)
        return rp_fail(err, RP_EINVAL,
                       "remap: the plan (%d GPUs, EP size %d, %d layers, %d experts) was made for another "
                       "config (%d GPUs, EP size %d, %d layers, %d experts)",
                       t->G, t->ep, t->L, t->E, topo->num_gpus, topo->ep_size, model->num_layers,
                       model->num_experts);
    if (num_layers != t->L)
        return rp_fail(err, RP_EINVAL, "remap: the routing has %d layers, but the plan has %d", num_layers, t->L);
    if (top_k < 1) return rp_fail(err, RP_EINVAL, "remap: top-k %d, must be >= 1", top_k);
    if (mb < 0 || mb >= rp_plan_num_microbatches(plan))
        return rp_fail(err, RP_EINVAL, "remap: microbatch %d is out of range (the plan has %d)", mb,
                       rp_plan_num_microbatches(plan));
    t->num_seqs = rp_batch_num_seqs(batch);
    if (rp_plan_num_seqs(plan) != t->num_seqs)
        return rp_fail(err, RP_EINVAL, "remap: the packing has %d sequences, but the batch has %d",
                       rp_plan_num_seqs(plan), t->num_seqs);
    t->Q = t->G / t->ep;
    const int32_t G = t->G, ep = t->ep, L = t->L, E = t->E, S = t->S, gpn = t->gpus_per_node;
    /* Nodes split every EP group the same way when one divides the other: then the
     * table needs only the source's EP rank. */
    t->nsrc = (gpn % ep == 0 || ep % gpn == 0) ? ep : G;
    const int32_t nsrc = t->nsrc;

    /* The microbatch's sequences, GPU by GPU. */
    t->seq_gpu = rp_alloc(ctx, sizeof(int32_t) * (size_t)(t->num_seqs > 0 ? t->num_seqs : 1));
    t->gpu_begin = rp_alloc(ctx, sizeof(int32_t) * (size_t)(G + 1));
    if (!t->seq_gpu || !t->gpu_begin) goto nomem;
    for (int32_t s = 0; s < t->num_seqs; s++) t->seq_gpu[s] = -1;
    int64_t listed = 0;
    for (int32_t g = 0; g < G; g++) {
        int32_t cnt = 0;
        rp_plan_microbatch(plan, g, mb, &cnt);
        listed += cnt;
    }
    t->order = rp_alloc(ctx, sizeof(int32_t) * (size_t)(listed > 0 ? listed : 1));
    if (!t->order) goto nomem;
    t->num_order = 0;
    for (int32_t g = 0; g < G; g++) {
        int32_t cnt = 0;
        const int32_t *seqs = rp_plan_microbatch(plan, g, mb, &cnt);
        int64_t choices = 0;
        t->gpu_begin[g] = t->num_order;
        for (int32_t i = 0; i < cnt; i++) {
            int32_t s = seqs[i];
            if (t->seq_gpu[s] >= 0) {
                st = rp_fail(err, RP_EPLAN, "remap: sequence %d is listed twice in microbatch %d (GPUs %d and %d)",
                             s, mb, t->seq_gpu[s], g);
                if (err) err->sequence = s;
                goto fail;
            }
            t->seq_gpu[s] = g;
            t->order[t->num_order++] = s;
            choices += (int64_t)rp_batch_seq_len(batch, s) * top_k;
        }
        if (choices > INT32_MAX) {
            st = rp_fail(err, RP_ERANGE, "remap: GPU %d has %lld token-choices in microbatch %d, more than %d",
                         g, (long long)choices, mb, INT32_MAX);
            goto fail;
        }
    }
    t->gpu_begin[G] = t->num_order;

    /* Physical ids: slots, then each layer's extras. */
    t->P = rp_remap_num_physical(plan, mb);
    const int32_t P = t->P, X = P - S;
    t->phys_rank = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)P);
    ex_rank = rp_alloc(ctx, sizeof(int32_t) * (size_t)(X > 0 ? X : 1));
    ex_expert = rp_alloc(ctx, sizeof(int32_t) * (size_t)(X > 0 ? X : 1));
    rep_off = rp_alloc(ctx, sizeof(int32_t) * (size_t)(E + 1));
    rep_phys = rp_alloc(ctx, sizeof(int32_t) * (size_t)P);
    rep_rank = rp_alloc(ctx, sizeof(int32_t) * (size_t)P);
    share_of = rp_alloc(ctx, sizeof(int32_t) * (size_t)E);
    list = rp_alloc(ctx, sizeof(int32_t) * (size_t)P);
    t->cand = rp_alloc(ctx, sizeof(remap_cand) * (size_t)L * (size_t)E * (size_t)nsrc);
    t->key_layer = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)E);
    t->key_expert = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)E);
    t->key_bofs = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)E);
    t->key_first = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)E);
    t->key_count = rp_alloc(ctx, sizeof(int32_t) * (size_t)L * (size_t)E);
    if (!t->phys_rank || !ex_rank || !ex_expert || !rep_off || !rep_phys || !rep_rank || !share_of || !list ||
        !t->cand || !t->key_layer || !t->key_expert || !t->key_bofs || !t->key_first || !t->key_count)
        goto nomem;
    const int32_t *begin = rp_plan_slot_begin(plan);
    const int32_t num_sets = rp_plan_num_share_sets(plan), nx = rp_plan_num_extra_replicas(plan);
    int32_t set_i = 0, ex_i = 0;
    for (int32_t l = 0; l < L; l++) {
        const int32_t *phy2log = rp_plan_phy2log(plan, l);
        int32_t *prank = t->phys_rank + (size_t)l * P;
        for (int32_t j = 0; j < ep; j++)
            for (int32_t p = begin[j]; p < begin[j + 1]; p++) prank[p] = j;
        /* this layer's extras, in plan order (sorted by expert) */
        int32_t nxl = 0;
        for (; ex_i < nx; ex_i++) {
            int32_t m, xl, xe, xr;
            rp_plan_extra_replica(plan, ex_i, &m, &xl, &xe, &xr);
            if (m > mb || (m == mb && xl > l)) break;
            if (m == mb && xl == l) {
                ex_rank[nxl] = xr;
                ex_expert[nxl] = xe;
                nxl++;
            }
        }
        for (int32_t i = 0; i < X; i++) prank[S + i] = i < nxl ? ex_rank[i] : -1;
        /* replicas of every expert: slots ascending, then extras in order */
        for (int32_t e = 0; e <= E; e++) rep_off[e] = 0;
        for (int32_t p = 0; p < S; p++)
            if (phy2log[p] >= 0) rep_off[phy2log[p] + 1]++;
        for (int32_t i = 0; i < nxl; i++) rep_off[ex_expert[i] + 1]++;
        for (int32_t e = 0; e < E; e++) rep_off[e + 1] += rep_off[e];
        {
            int32_t *cur = share_of; /* a cursor per expert, reset to -1 below */
            for (int32_t e = 0; e < E; e++) cur[e] = rep_off[e];
            for (int32_t p = 0; p < S; p++)
                if (phy2log[p] >= 0) {
                    rep_phys[cur[phy2log[p]]] = p;
                    rep_rank[cur[phy2log[p]]++] = prank[p];
                }
            for (int32_t i = 0; i < nxl; i++) {
                rep_phys[cur[ex_expert[i]]] = S + i;
                rep_rank[cur[ex_expert[i]]++] = ex_rank[i];
            }
            for (int32_t e = 0; e < E; e++) cur[e] = -1;
        }
        /* this layer's share sets (sorted by (mb, layer, expert)) */
        for (; set_i < num_sets; set_i++) {
            int32_t m, sl, se, cnt;
            rp_plan_share_set(plan, set_i, &m, &sl, &se, &cnt);
            if (m > mb || (m == mb && sl > l)) break;
            if (m == mb && sl == l) share_of[se] = set_i;
        }
        for (int32_t e = 0; e < E; e++) {
            const int32_t r = rep_off[e + 1] - rep_off[e];
            const int32_t *rp = rep_phys + rep_off[e], *rr = rep_rank + rep_off[e];
            remap_cand *cd = t->cand + ((size_t)l * E + e) * (size_t)nsrc;
            if (r == 0) {
                st = rp_fail(err, RP_EPLAN, "remap: layer %d expert %d has no replica", l, e);
                if (err) err->expert = e;
                goto fail;
            }
            int32_t key = -1;
            if (share_of[e] >= 0) {
                int32_t m, sl, se, cnt;
                const double *sh = rp_plan_share_set(plan, share_of[e], &m, &sl, &se, &cnt);
                double sum = 0.0;
                bool bad = cnt != r;
                for (int32_t i = 0; !bad && i < cnt; i++) {
                    bad = !isfinite(sh[i]) || sh[i] < 0.0;
                    sum += sh[i];
                }
                if (bad || !(sum > 0.0) || !isfinite(sum)) {
                    st = rp_fail(err, RP_EPLAN,
                                 "remap: mb %d layer %d expert %d has %d shares for %d replicas, which must "
                                 "be finite, >= 0 and sum to more than 0", mb, l, e, cnt, r);
                    if (err) err->expert = e;
                    goto fail;
                }
                if (r > 1) {
                    if (!grow(ctx, (void **)&t->cand_phys, &cap_phys, t->num_cand + r, sizeof(int32_t)) ||
                        !grow(ctx, (void **)&t->weight, &cap_w, t->num_cand + r, sizeof(uint64_t)))
                        goto nomem;
                    const int32_t first = (int32_t)t->num_cand;
                    memcpy(t->cand_phys + first, rp, sizeof(int32_t) * (size_t)r);
                    shares_to_weights(sh, r, sum, t->weight + first);
                    t->num_cand += r;
                    key = t->num_keys++;
                    t->key_bofs[key] = t->share_slots;
                    t->key_first[key] = first;
                    t->key_count[key] = r;
                    t->share_slots += r;
                    for (int32_t src = 0; src < nsrc; src++)
                        cd[src] = (remap_cand){first, r, key, REMAP_SHARES};
                } else {
                    for (int32_t src = 0; src < nsrc; src++)
                        cd[src] = (remap_cand){rp[0], 1, -1, REMAP_ROUND_ROBIN};
                }
            } else {
                int32_t full_first = -1; /* the list of all replicas, once appended */
                for (int32_t src = 0; src < nsrc; src++) {
                    const int32_t *cl = rp;
                    int32_t n = r;
                    if (rule == RP_SPLIT_LOCALITY && r > 1) {
                        /* the source GPU: src itself, or GPU src of group 0 when the
                         * table is per EP rank (every group is split alike then) */
                        const int32_t js = src % ep, g0 = src - js, node = src / gpn;
                        n = 0;
                        for (int32_t i = 0; i < r; i++)
                            if (rr[i] == js) list[n++] = rp[i];
                        if (n == 0)
                            for (int32_t i = 0; i < r; i++)
                                if ((g0 + rr[i]) / gpn == node) list[n++] = rp[i];
                        if (n > 0) cl = list;
                        else n = r;
                    }
                    if (n == 1) {
                        cd[src] = (remap_cand){cl[0], 1, -1, REMAP_ROUND_ROBIN};
                        continue;
                    }
                    if (key < 0) {
                        key = t->num_keys++;
                        t->key_bofs[key] = -1;
                        t->key_first[key] = -1;
                        t->key_count[key] = 0;
                    }
                    if (cl == rp && full_first >= 0) {
                        cd[src] = (remap_cand){full_first, r, key, REMAP_ROUND_ROBIN};
                        continue;
                    }
                    if (!grow(ctx, (void **)&t->cand_phys, &cap_phys, t->num_cand + n, sizeof(int32_t)) ||
                        !grow(ctx, (void **)&t->weight, &cap_w, t->num_cand + n, sizeof(uint64_t)))
                        goto nomem;
                    const int32_t first = (int32_t)t->num_cand;
                    memcpy(t->cand_phys + first, cl, sizeof(int32_t) * (size_t)n);
                    memset(t->weight + first, 0, sizeof(uint64_t) * (size_t)n); /* unused */
                    t->num_cand += n;
                    if (cl == rp) full_first = first;
                    cd[src] = (remap_cand){first, n, key, REMAP_ROUND_ROBIN};
                }
            }
            if (key >= 0) {
                t->key_layer[key] = l;
                t->key_expert[key] = e;
            }
        }
    }
    goto done;
nomem:
    st = rp_fail_nomem(err, "the remap table");
fail:
    remap_table_free(ctx, t);
done:
    rp_free(ctx, rep_off);
    rp_free(ctx, rep_phys);
    rp_free(ctx, rep_rank);
    rp_free(ctx, ex_rank);
    rp_free(ctx, ex_expert);
    rp_free(ctx, share_of);
    rp_free(ctx, list);
    return st;
}

/* ---- counts ---------------------------------------------------------------------- */

void remap_add_counts(const remap_table *t, int32_t g, int32_t l, int32_t e, int64_t total,
                      int64_t *slot_tokens)
{
    if (total == 0) return;
    const remap_cand c = t->cand[((size_t)l * t->E + e) * (size_t)t->nsrc + remap_src(g, t->ep, t->nsrc)];
    int64_t *row = slot_tokens + ((size_t)l * t->Q + (size_t)(g / t->ep)) * (size_t)t->P;
    if (c.count == 1) {
        row[c.first] += total;
        return;
    }
    for (int32_t i = 0; i < c.count; i++)
        row[t->cand_phys[c.first + i]] +=
            c.mode == REMAP_SHARES ? remap_share_n(total, t->weight + c.first, c.count, i)
                                   : remap_rr_count(total, c.count, g % t->ep, i);
}

/* ---- the CPU remap ----------------------------------------------------------------- */

typedef struct remap_job {
    const remap_table *t;
    const rp_routing *routing;
    const int64_t *cu;
    int32_t *phys_ids;
    int32_t worker, workers;
    int64_t *counts;       /* [G][num_keys]: occurrences per source (pass 1) */
    int64_t *bounds;       /* [G][share_slots]: share boundaries per source */
    int64_t *occ;          /* [num_keys] running occurrence counters of this worker */
    int64_t *slot_tokens;  /* [L][Q][P] of this worker */
    /* the lowest bad id this worker saw: sequence, layer, token, choice */
    int64_t bad_seq, bad_layer, bad_token, bad_choice;
    int32_t bad_id;
    int pass;
} remap_job;

static bool before(int64_t s, int64_t l, int64_t t, int64_t j, const remap_job *jb)
{
    if (s != jb->bad_seq) return s < jb->bad_seq;
    if (l != jb->bad_layer) return l < jb->bad_layer;
    if (t != jb->bad_token) return t < jb->bad_token;
    return j < jb->bad_choice;
}

/* Pass 1: check every id and count each source's occurrences of split keys. */
static void count_gpu(remap_job *jb, int32_t g)
{
    const remap_table *t = jb->t;
    const rp_routing *r = jb->routing;
    const int32_t L = t->L, k = t->k, E = t->E, src = remap_src(g, t->ep, t->nsrc);
    int64_t *cnt = jb->counts + (size_t)g * (size_t)t->num_keys;
    for (int32_t i = t->gpu_begin[g]; i < t->gpu_begin[g + 1]; i++) {
        const int32_t s = t->order[i];
        const int64_t len = jb->cu[s + 1] - jb->cu[s];
        for (int32_t l = 0; l < L; l++) {
            const void *at = rp_routing_at(r, jb->cu, s, l);
            const remap_cand *cl = t->cand + (size_t)l * E * (size_t)t->nsrc + src;
            for (int64_t tok = 0; tok < len; tok++)
                for (int32_t j = 0; j < k; j++) {
                    const int32_t e = rp_id_load(at, r->width, tok * r->token_stride + j * r->k_stride);
                    if (e < 0 || e >= E) {
                        if (before(s, l, tok, j, jb)) {
                            jb->bad_seq = s, jb->bad_layer = l, jb->bad_token = tok, jb->bad_choice = j;
                            jb->bad_id = e;
                        }
                        continue;
                    }
                    const remap_cand *c = cl + (size_t)e * t->nsrc;
                    if (c->count > 1) cnt[c->key]++;
                }
        }
    }
}

/* Pass 2: the physical id of every token-choice, in occurrence order. */
static void assign_gpu(remap_job *jb, int32_t g)
{
    const remap_table *t = jb->t;
    const rp_routing *r = jb->routing;
    const int32_t L = t->L, k = t->k, E = t->E, src = remap_src(g, t->ep, t->nsrc), js = g % t->ep;
    const int64_t R = (int64_t)L * k;
    const int64_t *bnd = jb->bounds + (size_t)g * (size_t)t->share_slots;
    int64_t *occ = jb->occ;
    int64_t *row0 = jb->slot_tokens + (size_t)(g / t->ep) * (size_t)t->P;
    const size_t layer_step = (size_t)t->Q * (size_t)t->P;
    for (int32_t x = 0; x < t->num_keys; x++) occ[x] = 0;
    for (int32_t i = t->gpu_begin[g]; i < t->gpu_begin[g + 1]; i++) {
        const int32_t s = t->order[i];
        const int64_t len = jb->cu[s + 1] - jb->cu[s];
        const void *at[L > 0 ? L : 1];
        for (int32_t l = 0; l < L; l++) at[l] = rp_routing_at(r, jb->cu, s, l);
        int32_t *out = jb->phys_ids + jb->cu[s] * R;
        for (int64_t tok = 0; tok < len; tok++)
            for (int32_t l = 0; l < L; l++) {
                const remap_cand *cl = t->cand + (size_t)l * E * (size_t)t->nsrc + src;
                int64_t *row = row0 + (size_t)l * layer_step;
                for (int32_t j = 0; j < k; j++) {
                    /* pass 1 checked the ids, but the buffer is the caller's: the id is
                     * read once here and checked where it is used */
                    const int32_t e = rp_id_load(at[l], r->width, tok * r->token_stride + j * r->k_stride);
                    if (e < 0 || e >= E) {
                        if (before(s, l, tok, j, jb)) {
                            jb->bad_seq = s, jb->bad_layer = l, jb->bad_token = tok, jb->bad_choice = j;
                            jb->bad_id = e;
                        }
                        out[tok * R + (int64_t)l * k + j] = -1;
                        continue;
                    }
                    const remap_cand c = cl[(size_t)e * t->nsrc];
                    int32_t phys;
                    if (c.count == 1) {
                        phys = c.first;
                    } else {
                        const int64_t o = occ[c.key]++;
                        int32_t idx = 0;
                        if (c.mode == REMAP_SHARES) {
                            const int64_t *cum = bnd + t->key_bofs[c.key];
                            while (idx + 1 < c.count && o >= cum[idx]) idx++;
                        } else {
                            idx = (int32_t)((o + js) % c.count);
                        }
                        phys = t->cand_phys[c.first + idx];
                    }
                    out[tok * R + (int64_t)l * k + j] = phys;
                    row[phys]++;
                }
            }
    }
}

static void *run_job(void *arg)
{
    remap_job *jb = arg;
    for (int32_t g = jb->worker; g < jb->t->G; g += jb->workers) {
        if (jb->pass == 1) count_gpu(jb, g);
        else assign_gpu(jb, g);
    }
    return NULL;
}

/* Run `pass` on every worker, in threads where they start (inline where not). */
static void run_pass(remap_job *jobs, int32_t n, int pass)
{
    pthread_t tids[MAX_THREADS];
    bool started[MAX_THREADS];
    for (int32_t i = 0; i < n; i++) {
        jobs[i].pass = pass;
        started[i] = i > 0 && pthread_create(&tids[i], NULL, run_job, &jobs[i]) == 0;
    }
    run_job(&jobs[0]);
    for (int32_t i = 1; i < n; i++) {
        if (started[i]) pthread_join(tids[i], NULL);
        else run_job(&jobs[i]);
    }
}


/* RP_ERANGE naming the first bad id any worker met (lowest sequence, then layer, token,
 * choice), with `why` appended; RP_OK when none did. `seq_ids` maps the jobs' sequence
 * indexes to the batch's (NULL: the same). */
static rp_status report_bad_id(const remap_job *jobs, int32_t workers, int32_t num_experts,
                               const int32_t *seq_ids, const char *why, rp_error *err)
{
    const remap_job *worst = NULL;
    for (int32_t w = 0; w < workers; w++)
        if (jobs[w].bad_seq != INT64_MAX &&
            (!worst || before(jobs[w].bad_seq, jobs[w].bad_layer, jobs[w].bad_token, jobs[w].bad_choice, worst)))
            worst = &jobs[w];
    if (!worst) return RP_OK;
    const int64_t seq = seq_ids ? seq_ids[worst->bad_seq] : worst->bad_seq;
    rp_fail(err, RP_ERANGE,
            "routing: sequence %lld token %lld layer %lld choice %lld has expert id %d, but the model has %d "
            "experts%s", (long long)seq, (long long)worst->bad_token, (long long)worst->bad_layer,
            (long long)worst->bad_choice, worst->bad_id, num_experts, why);
    if (err) err->sequence = seq, err->expert = worst->bad_id;
    return RP_ERANGE;
}

rp_status rp_remap(const rp_plan *plan, const rp_config *cfg, int32_t mb, const rp_batch *batch,
                   const rp_routing *routing, rp_split_rule rule, int32_t num_threads, int32_t *phys_ids,
                   int64_t *slot_tokens, rp_error *err)
{
    if (!plan || !routing) return rp_fail(err, RP_EINVAL, "remap: missing plan or routing");
    rp_context *ctx = rp_plan_context(plan);
    remap_table t;
    rp_status st = remap_table_build(ctx, plan, cfg, mb, batch, routing->num_layers, routing->top_k, rule, &t, err);
    if (st != RP_OK) return st;
    remap_job *jobs = NULL;
    int64_t *counts = NULL, *bounds = NULL, *scratch = NULL;
    int32_t workers = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
    if (workers > t.G) workers = t.G;
    const size_t rows = (size_t)t.L * (size_t)t.Q * (size_t)t.P;
    const size_t per_worker = (size_t)t.num_keys + rows;
    RP_CHECK_GOTO(rp_routing_check_shape(routing, batch, t.E, err), st, out);
    if (t.num_order > 0 && !phys_ids) {
        st = rp_fail(err, RP_EINVAL, "remap: no output array");
        goto out;
    }
    {
        /* Device memory goes to the kernel (rp_gpu_remap), which rebuilds the table. */
        bool ids_dev;
        RP_CHECK_GOTO(gpu_routing_on_device(routing, batch, "remap", &ids_dev, err), st, out);
        if (slot_tokens && gpu_on_device(slot_tokens)) {
            st = rp_fail(err, RP_EINVAL, "remap: slot_tokens is device memory; it is written on the "
                         "host on both paths");
            goto out;
        }
        const bool out_dev = phys_ids && gpu_on_device(phys_ids);
        if (phys_ids && ids_dev != out_dev && rp_batch_num_tokens(batch) > 0) {
            st = rp_fail(err, RP_EINVAL,
                         "remap: the routing ids are %s memory but phys_ids is %s memory; both must "
                         "be on the host or both on the device", ids_dev ? "device" : "host",
                         out_dev ? "device" : "host");
            goto out;
        }
        if (ids_dev) {
            remap_table_free(ctx, &t);
            st = rp_gpu_remap(plan, cfg, mb, batch, routing, rule, phys_ids, slot_tokens, err);
            if (st == RP_ERANGE) gpu_error_as_cpu(err); /* nothing written: the CPU's message */
            return st;
        }
    }
    jobs = rp_calloc(ctx, (size_t)workers, sizeof *jobs);
    counts = rp_calloc(ctx, (size_t)t.G * (size_t)t.num_keys + 1, sizeof *counts);
    bounds = rp_calloc(ctx, (size_t)t.G * (size_t)t.share_slots + 1, sizeof *bounds);
    scratch = rp_calloc(ctx, (size_t)workers * per_worker + 1, sizeof *scratch);
    if (!jobs || !counts || !bounds || !scratch) {
        st = rp_fail_nomem(err, "remap counters");
        goto out;
    }
    for (int32_t w = 0; w < workers; w++) {
        jobs[w] = (remap_job){&t, routing, rp_batch_cu_seqlens(batch), phys_ids, w, workers, counts, bounds,
                              scratch + (size_t)w * per_worker, scratch + (size_t)w * per_worker + t.num_keys,
                              INT64_MAX, 0, 0, 0, 0, 0};
    }
    run_pass(jobs, workers, 1);
    if ((st = report_bad_id(jobs, workers, t.E, NULL, "", err)) != RP_OK) goto out;
    /* share boundaries of every source */
    for (int32_t g = 0; g < t.G; g++)
        for (int32_t x = 0; x < t.num_keys; x++)
            if (t.key_bofs[x] >= 0)
                remap_apportion(counts[(size_t)g * t.num_keys + x], t.weight + t.key_first[x], t.key_count[x],
                                bounds + (size_t)g * t.share_slots + t.key_bofs[x]);
    if (routing_scan_hook) routing_scan_hook();
    run_pass(jobs, workers, 2);
    /* an id that changed after pass 1 (another thread wrote the routing) */
    if ((st = report_bad_id(jobs, workers, t.E, NULL, " (the routing changed during the call)", err)) != RP_OK)
        goto out;
    if (slot_tokens) {
        memset(slot_tokens, 0, rows * sizeof *slot_tokens);
        for (int32_t w = 0; w < workers; w++)
            for (size_t i = 0; i < rows; i++) slot_tokens[i] += jobs[w].slot_tokens[i];
    }
out:
    rp_free(ctx, jobs);
    rp_free(ctx, counts);
    rp_free(ctx, bounds);
    rp_free(ctx, scratch);
    remap_table_free(ctx, &t);
    return st;
}

/* ---- one GPU's own tokens ------------------------------------------------------------ */

rp_status rp_remap_rank(const rp_plan *plan, const rp_config *cfg, int32_t mb, int32_t gpu, const rp_batch *batch,
                        const rp_routing *routing, rp_split_rule rule, int32_t *phys_ids, int64_t *slot_tokens,
                        rp_error *err)
{
    if (!plan || !routing) return rp_fail(err, RP_EINVAL, "remap: missing plan or routing");
    rp_context *ctx = rp_plan_context(plan);
    remap_table t;
    rp_status st = remap_table_build(ctx, plan, cfg, mb, batch, routing->num_layers, routing->top_k, rule, &t, err);
    if (st != RP_OK) return st;
    rp_batch *local = NULL;
    int32_t *plen = NULL, *rlen = NULL, *iota = NULL, *begin = NULL;
    int64_t *counts = NULL, *bounds = NULL, *scratch = NULL;
    const size_t rows = (size_t)t.L * (size_t)t.Q * (size_t)t.P;
    if (gpu < 0 || gpu >= t.G) {
        st = rp_fail(err, RP_EINVAL, "remap: GPU %d is out of range (the plan has %d)", gpu, t.G);
        goto out;
    }
    /* The listed sequences as a batch of their own, in list order. */
    const int32_t m = t.gpu_begin[gpu + 1] - t.gpu_begin[gpu];
    const int32_t *listed = t.order + t.gpu_begin[gpu];
    plen = rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    rlen = rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    iota = rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    begin = rp_alloc(ctx, sizeof(int32_t) * ((size_t)t.G + 1));
    counts = rp_calloc(ctx, (size_t)t.G * (size_t)t.num_keys + 1, sizeof *counts);
    bounds = rp_calloc(ctx, (size_t)t.G * (size_t)t.share_slots + 1, sizeof *bounds);
    scratch = rp_calloc(ctx, (size_t)t.num_keys + rows + 1, sizeof *scratch);
    if (!plen || !rlen || !iota || !begin || !counts || !bounds || !scratch) {
        st = rp_fail_nomem(err, "remap counters");
        goto out;
    }
    for (int32_t i = 0; i < m; i++) {
        plen[i] = rp_batch_prompt_lens(batch)[listed[i]];
        rlen[i] = rp_batch_response_lens(batch)[listed[i]];
        iota[i] = i;
    }
    RP_CHECK_GOTO(rp_batch_new(ctx, m, plen, rlen, NULL, &local, err), st, out);
    RP_CHECK_GOTO(rp_routing_check_shape(routing, local, t.E, err), st, out);
    if (rp_batch_num_tokens(local) > 0 && !phys_ids) {
        st = rp_fail(err, RP_EINVAL, "remap: no output array");
        goto out;
    }
    {
        /* Device memory goes to the kernel (rp_gpu_remap_rank), which rebuilds the table. */
        bool ids_dev;
        RP_CHECK_GOTO(gpu_routing_on_device(routing, local, "remap", &ids_dev, err), st, out);
        if (slot_tokens && gpu_on_device(slot_tokens)) {
            st = rp_fail(err, RP_EINVAL, "remap: slot_tokens is device memory; it is written on the host on both "
                         "paths");
            goto out;
        }
        const bool out_dev = phys_ids && gpu_on_device(phys_ids);
        if (phys_ids && ids_dev != out_dev && rp_batch_num_tokens(local) > 0) {
            st = rp_fail(err, RP_EINVAL, "remap: the routing ids are %s memory but phys_ids is %s memory; both must "
                         "be on the host or both on the device", ids_dev ? "device" : "host",
                         out_dev ? "device" : "host");
            goto out;
        }
        if (ids_dev) {
            st = rp_gpu_remap_rank(plan, cfg, mb, gpu, batch, routing, rule, phys_ids, slot_tokens, err);
            if (st == RP_ERANGE) gpu_error_as_cpu(err); /* nothing written: the CPU's message */
            goto out;
        }
    }
    /* The table, seen from this GPU alone: its sequences are the local ones 0 .. m-1, the
     * other GPUs list none (their occurrences never affect this GPU's replicas). */
    remap_table lt = t;
    lt.order = iota;
    lt.num_order = m;
    lt.num_seqs = m;
    for (int32_t g = 0; g <= t.G; g++) begin[g] = g <= gpu ? 0 : m;
    lt.gpu_begin = begin;
    remap_job job = {&lt, routing, rp_batch_cu_seqlens(local), phys_ids, 0, 1, counts, bounds, scratch,
                     scratch + t.num_keys, INT64_MAX, 0, 0, 0, 0, 0};
    job.pass = 1;
    count_gpu(&job, gpu);
    if ((st = report_bad_id(&job, 1, t.E, listed, "", err)) != RP_OK) goto out;
    for (int32_t x = 0; x < t.num_keys; x++)
        if (t.key_bofs[x] >= 0)
            remap_apportion(counts[(size_t)gpu * t.num_keys + x], t.weight + t.key_first[x], t.key_count[x],
                            bounds + (size_t)gpu * t.share_slots + t.key_bofs[x]);
    job.pass = 2;
    assign_gpu(&job, gpu);
    /* an id that changed after pass 1 */
    if ((st = report_bad_id(&job, 1, t.E, listed, " (the routing changed during the call)", err)) != RP_OK)
        goto out;
    if (slot_tokens) {
        const size_t q = (size_t)(gpu / t.ep);
        for (int32_t l = 0; l < t.L; l++)
            memcpy(slot_tokens + (size_t)l * t.P, job.slot_tokens + ((size_t)l * t.Q + q) * t.P,
                   (size_t)t.P * sizeof *slot_tokens);
    }
out:
    rp_batch_free(local);
    rp_free(ctx, plen);
    rp_free(ctx, rlen);
    rp_free(ctx, iota);
    rp_free(ctx, begin);
    rp_free(ctx, counts);
    rp_free(ctx, bounds);
    rp_free(ctx, scratch);
    remap_table_free(ctx, &t);
    return st;
}
