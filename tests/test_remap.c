/* Remap (core/remap.c): hand cases with replicas and extra replicas under each split
 * rule and explicit shares, random plans against a plain re-implementation of the rule in
 * docs/kernels.md, the per-slot counts against the cost model, determinism across
 * threads and views, and bad input (ids out of range, broken plans, failed allocations). */
#include "internal.h"
#include "routepack/routepack.h"
#include "routing_access.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>

static rp_context *ctx;

static rp_config *config_of(int32_t nodes, int32_t gpn, int32_t ep, int32_t slots, int32_t layers, int32_t experts,
                            int32_t k, const char *hardware)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " %s \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": %d, \"hidden_size\": 64,"
             " \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1000000}}",
             nodes, gpn, ep, slots, hardware ? hardware : "", layers, experts, k);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

static rp_batch *batch_of(int32_t n, const int32_t *lens)
{
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_batch *b = NULL;
    rp_batch_new(ctx, n, lens, zero, NULL, &b, NULL);
    free(zero);
    return b;
}

/* ---- the rule, re-implemented plainly (docs/kernels.md) ------------------------------ */

/* Replicas of (mb, layer, e): slots ascending, then extras in plan order; their physical
 * ids and EP ranks. Returns the count. */
static int32_t replicas_of(const rp_plan *plan, int32_t mb, int32_t l, int32_t e, int32_t *phys, int32_t *rank)
{
    const int32_t S = rp_plan_total_slots(plan), ep = rp_plan_ep_size(plan);
    const int32_t *p2l = rp_plan_phy2log(plan, l), *begin = rp_plan_slot_begin(plan);
    int32_t n = 0, x = 0;
    for (int32_t j = 0; j < ep; j++)
        for (int32_t p = begin[j]; p < begin[j + 1]; p++)
            if (p2l[p] == e) phys[n] = p, rank[n++] = j;
    for (int32_t i = 0; i < rp_plan_num_extra_replicas(plan); i++) {
        int32_t m, xl, xe, xr;
        rp_plan_extra_replica(plan, i, &m, &xl, &xe, &xr);
        if (m != mb || xl != l) continue;
        if (xe == e) phys[n] = S + x, rank[n++] = xr;
        x++;
    }
    return n;
}

/* Fixed-point shares and the largest-remainder split, as documented. */
static void oracle_weights(const double *sh, int32_t r, uint64_t *w)
{
    double sum = 0;
    for (int32_t i = 0; i < r; i++) sum += sh[i];
    uint64_t tot = 0;
    double frac[64];
    for (int32_t i = 0; i < r; i++) {
        double q = sh[i] / sum * 4294967296.0;
        w[i] = (uint64_t)floor(q);
        frac[i] = q - floor(q);
        tot += w[i];
    }
    int64_t left = (int64_t)(4294967296ULL - tot);
    for (int64_t k = 0; k < left; k++) { /* next largest fraction (ties: lower index) */
        int32_t best = -1;
        for (int32_t i = 0; i < r; i++)
            if (frac[i] >= 0 && (best < 0 || frac[i] > frac[best])) best = i;
        w[best]++;
        frac[best] = -1;
    }
}

static int64_t oracle_share_n(int64_t c, const uint64_t *w, int32_t r, int32_t i)
{
    int64_t floors = 0;
    for (int32_t j = 0; j < r; j++) floors += (int64_t)((c * w[j]) >> 32);
    int64_t left = c - floors, rank = 0;
    uint64_t ri = (c * w[i]) & 0xffffffffu;
    for (int32_t j = 0; j < r; j++) {
        uint64_t rj = (c * w[j]) & 0xffffffffu;
        if (rj > ri || (rj == ri && j < i)) rank++;
    }
    return (int64_t)((c * w[i]) >> 32) + (rank < left);
}

/* phys[(t * L + l) * k + j] and counts[(l * Q + q) * P + p] of microbatch mb, the slow way. */
static void oracle(const rp_plan *plan, const rp_config *cfg, int32_t mb, const rp_batch *b, const uint8_t *ids,
                   int32_t L, int32_t k, rp_split_rule rule, int32_t *phys, int64_t *counts)
{
    const int32_t G = rp_plan_num_gpus(plan), ep = rp_plan_ep_size(plan), E = rp_plan_num_experts(plan);
    const int32_t gpn = rp_config_topology(cfg)->gpus_per_node, P = rp_remap_num_physical(plan, mb);
    const int64_t *cu = rp_batch_cu_seqlens(b);
    memset(counts, 0, sizeof(int64_t) * (size_t)L * (G / ep) * P);
    int64_t *occ = calloc((size_t)L * E, sizeof *occ), *tot = calloc((size_t)L * E, sizeof *tot);
    for (int32_t g = 0; g < G; g++) {
        int32_t n = 0;
        const int32_t *list = rp_plan_microbatch(plan, g, mb, &n);
        memset(occ, 0, sizeof *occ * (size_t)L * E);
        memset(tot, 0, sizeof *tot * (size_t)L * E);
        for (int32_t i = 0; i < n; i++)
            for (int64_t t = cu[list[i]]; t < cu[list[i] + 1]; t++)
                for (int32_t l = 0; l < L; l++)
                    for (int32_t j = 0; j < k; j++) tot[l * E + ids[(t * L + l) * k + j]]++;
        for (int32_t i = 0; i < n; i++)
            for (int64_t t = cu[list[i]]; t < cu[list[i] + 1]; t++)
                for (int32_t l = 0; l < L; l++)
                    for (int32_t j = 0; j < k; j++) {
                        int32_t e = ids[(t * L + l) * k + j], rp[64], rr[64], cand[64], nc = 0;
                        int32_t r = replicas_of(plan, mb, l, e, rp, rr), pick;
                        int64_t o = occ[l * E + e]++;
                        int32_t set = -1, m_, l_, e_, cnt = 0;
                        for (int32_t x = 0; x < rp_plan_num_share_sets(plan); x++) {
                            rp_plan_share_set(plan, x, &m_, &l_, &e_, &cnt);
                            if (m_ == mb && l_ == l && e_ == e) set = x;
                        }
                        if (set >= 0) {
                            const double *sh = rp_plan_share_set(plan, set, &m_, &l_, &e_, &cnt);
                            uint64_t w[64];
                            oracle_weights(sh, r, w);
                            int64_t cum = 0;
                            pick = r - 1;
                            for (int32_t x = 0; x < r; x++) {
                                cum += oracle_share_n(tot[l * E + e], w, r, x);
                                if (o < cum) {
                                    pick = x;
                                    break;
                                }
                            }
                            pick = rp[pick];
                        } else {
                            if (rule == RP_SPLIT_LOCALITY) {
                                for (int32_t x = 0; x < r; x++)
                                    if (rr[x] == g % ep) cand[nc++] = rp[x];
                                if (!nc)
                                    for (int32_t x = 0; x < r; x++)
                                        if ((g - g % ep + rr[x]) / gpn == g / gpn) cand[nc++] = rp[x];
                            }
                            if (!nc)
                                for (int32_t x = 0; x < r; x++) cand[nc++] = rp[x];
                            pick = cand[(o + g % ep) % nc];
                        }
                        phys[(t * L + l) * k + j] = pick;
                        counts[((int64_t)l * (G / ep) + g / ep) * P + pick]++;
                    }
    }
    free(occ);
    free(tot);
}

/* ---- a random case ------------------------------------------------------------------ */

typedef struct rcase {
    rp_config *cfg;
    rp_plan *plan;
    rp_batch *batch;
    uint8_t *ids;
    int32_t n, L, k, E, M;
    int64_t tokens;
} rcase;

static void rcase_free(rcase *c)
{
    rp_plan_free(c->plan);
    rp_batch_free(c->batch);
    rp_config_free(c->cfg);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

/* A valid plan with random replicas, extras and shares; hot experts skew the ids. */
static bool rcase_make(rcase *c, uint64_t *rng, int32_t nodes, int32_t gpn, int32_t ep, int32_t slots, int32_t E,
                       int32_t L, int32_t k, int32_t n, int32_t M)
{
    memset(c, 0, sizeof *c);
    c->cfg = config_of(nodes, gpn, ep, slots, L, E, k, NULL);
    if (!c->cfg || rp_plan_new(ctx, c->cfg, M, &c->plan, NULL) != RP_OK) return false;
    c->n = n, c->L = L, c->k = k, c->E = E, c->M = M;
    int32_t *lens = malloc(sizeof *lens * (size_t)n), *rank = malloc(sizeof *rank * (size_t)n),
            *mb = malloc(sizeof *mb * (size_t)n);
    const int32_t G = nodes * gpn;
    for (int32_t s = 0; s < n; s++) {
        lens[s] = (int32_t)(xorshift64(rng) % 7 == 0 ? 0 : 1 + xorshift64(rng) % 40);
        rank[s] = (int32_t)(xorshift64(rng) % G);
        mb[s] = (int32_t)(xorshift64(rng) % M);
    }
    c->batch = batch_of(n, lens);
    rp_plan_set_packing(c->plan, n, rank, mb, NULL);
    c->tokens = rp_batch_num_tokens(c->batch);
    c->ids = malloc((size_t)(c->tokens * L * k + 1));
    for (int64_t t = 0; t < c->tokens; t++)
        for (int32_t l = 0; l < L; l++)
            for (int32_t j = 0; j < k; j++) {
                uint64_t x = xorshift64(rng) % 100;
                c->ids[(t * L + l) * k + j] = (uint8_t)(x < 40 ? x % 3 : xorshift64(rng) % E);
            }
    const int32_t S = ep * slots;
    int32_t *p2l = malloc(sizeof *p2l * (size_t)S);
    for (int32_t l = 0; l < L; l++) {
        for (int32_t p = 0; p < S; p++) p2l[p] = p < E ? p : -1; /* every expert once */
        for (int32_t p = 0; p < S; p++) { /* shuffle */
            int32_t q = (int32_t)(xorshift64(rng) % S), tmp = p2l[p];
            p2l[p] = p2l[q], p2l[q] = tmp;
        }
        for (int32_t p = 0; p < S; p++) /* spare slots: hot experts, not twice on a rank */
            if (p2l[p] < 0) {
                int32_t e = (int32_t)(xorshift64(rng) % 4 < 3 ? xorshift64(rng) % 3 : xorshift64(rng) % E);
                bool dup = false;
                for (int32_t q = p / slots * slots; q < (p / slots + 1) * slots; q++) dup |= p2l[q] == e;
                if (!dup) p2l[p] = e;
            }
        rp_plan_set_phy2log(c->plan, l, p2l, NULL);
    }
    free(p2l);
    for (int32_t x = 0; x < 6; x++) { /* extras on ranks that do not hold the expert */
        int32_t m = (int32_t)(xorshift64(rng) % M), l = (int32_t)(xorshift64(rng) % L);
        int32_t e = (int32_t)(xorshift64(rng) % 3), j = (int32_t)(xorshift64(rng) % ep);
        int32_t rp[64], rr[64], r = replicas_of(c->plan, m, l, e, rp, rr);
        bool held = false;
        for (int32_t i = 0; i < r; i++) held |= rr[i] == j;
        if (!held) rp_plan_add_extra_replica(c->plan, m, l, e, j, NULL);
    }
    for (int32_t x = 0; x < 4; x++) { /* shares that do not divide evenly */
        int32_t m = (int32_t)(xorshift64(rng) % M), l = (int32_t)(xorshift64(rng) % L);
        int32_t e = (int32_t)(xorshift64(rng) % 3), rp[64], rr[64], r = replicas_of(c->plan, m, l, e, rp, rr);
        double sh[64], sum = 0;
        for (int32_t i = 0; i < r; i++) sum += sh[i] = (double)(1 + xorshift64(rng) % 7);
        for (int32_t i = 0; i < r; i++) sh[i] /= sum;
        rp_plan_set_shares(c->plan, m, l, e, sh, r, NULL);
    }
    free(lens);
    free(rank);
    free(mb);
    return true;
}

static void test_random(void)
{
    uint64_t rng = 0x9E3779B97F4A7C15ULL;
    /* nodes, gpus per node, EP size, slots: groups inside a node, spanning nodes, and
     * groups that nodes cut unevenly (gpn 3, ep 2) */
    const int32_t shapes[][4] = {{1, 4, 4, 3}, {2, 2, 4, 2}, {2, 4, 2, 3}, {2, 3, 2, 4}, {4, 2, 8, 2}, {1, 2, 1, 5}};
    int all_ids = 1, all_counts = 1, all_totals = 1, cases = 0;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
        for (int rule = 0; rule < 2; rule++) {
            rcase c;
            const int32_t E = shapes[sh][2] * shapes[sh][3] - 2 > 3 ? shapes[sh][2] * shapes[sh][3] - 2 : 3;
            if (!rcase_make(&c, &rng, shapes[sh][0], shapes[sh][1], shapes[sh][2], shapes[sh][3], E, 3, 2, 40, 2)) {
                ok(0, "random case made");
                rcase_free(&c);
                continue;
            }
            rp_routing r;
            rp_routing_packed(&r, RP_ID_U8, c.L, c.k, c.ids);
            const size_t nid = (size_t)(c.tokens * c.L * c.k) + 1;
            int32_t *got = malloc(nid * sizeof *got), *want = malloc(nid * sizeof *want);
            for (int32_t mb = 0; mb < c.M; mb++) {
                const int32_t P = rp_remap_num_physical(c.plan, mb), Q = rp_plan_num_gpus(c.plan) / rp_plan_ep_size(c.plan);
                const size_t rows = (size_t)c.L * Q * P;
                int64_t *gc = malloc(rows * sizeof *gc), *wc = malloc(rows * sizeof *wc);
                for (size_t i = 0; i < nid; i++) got[i] = want[i] = -7;
                rp_error err;
                rp_status st = rp_remap(c.plan, c.cfg, mb, c.batch, &r, (rp_split_rule)rule, 1 + (int32_t)(sh % 3), got, gc, &err);
                if (st != RP_OK) diag("remap: %s", err.text);
                oracle(c.plan, c.cfg, mb, c.batch, c.ids, c.L, c.k, (rp_split_rule)rule, want, wc);
                all_ids &= st == RP_OK && memcmp(got, want, nid * sizeof *got) == 0;
                all_counts &= st == RP_OK && memcmp(gc, wc, rows * sizeof *gc) == 0;
                /* per (layer, group, expert): the replicas' counts add up to the routing's */
                for (int32_t l = 0; l < c.L; l++)
                    for (int32_t q = 0; q < Q; q++)
                        for (int32_t e = 0; e < c.E; e++) {
                            int64_t routed = 0, split = 0;
                            const int64_t *cu = rp_batch_cu_seqlens(c.batch);
                            for (int32_t s = 0; s < c.n; s++)
                                if (rp_plan_seq_microbatch(c.plan, s) == mb &&
                                    rp_plan_seq_rank(c.plan, s) / rp_plan_ep_size(c.plan) == q)
                                    for (int64_t t = cu[s]; t < cu[s + 1]; t++)
                                        for (int32_t j = 0; j < c.k; j++) routed += c.ids[(t * c.L + l) * c.k + j] == e;
                            for (int32_t p = 0; p < P; p++) {
                                int32_t rk = rp_remap_physical_ep_rank(c.plan, mb, l, p);
                                int32_t rp[64], rr[64], nr = replicas_of(c.plan, mb, l, e, rp, rr);
                                for (int32_t i = 0; i < nr; i++)
                                    if (rp[i] == p && rr[i] == rk) split += gc[((size_t)l * Q + q) * P + p];
                            }
                            all_totals &= routed == split;
                        }
                free(gc);
                free(wc);
                cases++;
            }
            free(got);
            free(want);
            rcase_free(&c);
        }
    ok(all_ids, "random plans (%d microbatches, every topology and rule): ids equal the documented rule", cases);
    ok(all_counts, "random plans: per-slot counts equal the documented rule's");
    ok(all_totals, "random plans: every expert's replicas receive exactly its routed token-choices");
}

/* ---- hand cases ---------------------------------------------------------------------- */

/* 2 nodes x 2 GPUs, one EP group of 4, 2 slots each (S = 8), one layer, 4 experts, top-2.
 * Layer 0: EP0 [0 1]  EP1 [2 0]  EP2 [3 0]  EP3 [1 2]
 *   expert 0: slots 0 (EP0), 3 (EP1), 5 (EP2); expert 1: 1 (EP0), 6 (EP3);
 *   expert 2: 2 (EP1), 7 (EP3); expert 3: 4 (EP2), plus an extra on EP3 (id 8) in mb 0. */
typedef struct hand {
    rp_config *cfg;
    rp_plan *plan;
    rp_batch *batch;
    uint8_t ids[64];
} hand;

static void hand_make(hand *h)
{
    memset(h, 0, sizeof *h);
    h->cfg = config_of(2, 2, 4, 2, 1, 4, 2, NULL);
    rp_plan_new(ctx, h->cfg, 2, &h->plan, NULL);
    static const int32_t p2l[8] = {0, 1, 2, 0, 3, 0, 1, 2};
    rp_plan_set_phy2log(h->plan, 0, p2l, NULL);
    /* GPU 0 runs s0, GPU 1 runs s1, GPU 3 runs s3 then s2; s4 is in microbatch 1 */
    static const int32_t lens[5] = {4, 2, 2, 3, 1};
    h->batch = batch_of(5, lens);
    static const int32_t l00[] = {0}, l01[] = {4}, l10[] = {1}, l30[] = {3, 2};
    const int32_t *lists[8] = {l00, l01, l10, NULL, NULL, NULL, l30, NULL};
    const int32_t counts[8] = {1, 1, 1, 0, 0, 0, 2, 0};
    rp_plan_set_microbatches(h->plan, 5, lists, counts, NULL);
    rp_plan_add_extra_replica(h->plan, 0, 0, 3, 3, NULL);
    /* tokens (global): s0 0-3, s1 4-5, s2 6-7, s3 8-10, s4 11 */
    static const uint8_t ids[24] = {
        0, 3, 0, 3, 1, 3, 2, 3, /* s0 on GPU 0 */
        0, 1, 2, 3,             /* s1 on GPU 1 */
        0, 1, 0, 2,             /* s2 on GPU 3 (listed second) */
        3, 0, 3, 1, 3, 2,       /* s3 on GPU 3 (listed first) */
        0, 3,                   /* s4, microbatch 1 */
    };
    memcpy(h->ids, ids, sizeof ids);
}

static void hand_free(hand *h)
{
    rp_plan_free(h->plan);
    rp_batch_free(h->batch);
    rp_config_free(h->cfg);
}

static void test_hand(void)
{
    hand h;
    hand_make(&h);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 1, 2, h.ids);
    rp_error err;
    is_int(rp_remap_num_physical(h.plan, 0), 9, "mb 0 has 8 slots and one extra replica: 9 physical ids");
    is_int(rp_remap_num_physical(h.plan, 1), 8, "mb 1 has no extra replica: 8 physical ids");
    is_int(rp_remap_physical_ep_rank(h.plan, 0, 0, 8), 3, "physical id 8 of mb 0 is the extra on EP rank 3");
    is_int(rp_remap_physical_ep_rank(h.plan, 0, 0, 5), 2, "slot 5 is on EP rank 2");
    is_int(rp_remap_physical_ep_rank(h.plan, 1, 0, 8), -1, "no physical id 8 in mb 1");
    is_int(rp_remap_physical_ep_rank(h.plan, 0, 1, 0), -1, "layer out of range: -1");

    int32_t phys[24];
    int64_t cnt[9];
    for (int i = 0; i < 24; i++) phys[i] = -7;
    ok(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_LOCALITY, 1, phys, cnt, &err) == RP_OK, "locality: remaps");
    /* GPU 0 (node 0): expert 0 own slot 0; expert 3 has no replica on node 0 (EP2 and the
     * extra on EP3 are on node 1): round robin from EP rank 0 over [4, 8];
     * expert 1 own slot 1; expert 2 on node 0: slot 2 (EP1). */
    static const int32_t want_s0[8] = {0, 4, 0, 8, 1, 4, 2, 8};
    ok(memcmp(phys, want_s0, sizeof want_s0) == 0, "locality: GPU 0 uses its own slots, else alternates 4, 8 for expert 3");
    /* GPU 1: expert 0 own slot 3; expert 1: node 0 holds it on EP0 (slot 1); expert 2 own
     * slot 2; expert 3: round robin from EP rank 1: 8 first. */
    static const int32_t want_s1[4] = {3, 1, 2, 8};
    ok(memcmp(phys + 8, want_s1, sizeof want_s1) == 0, "locality: GPU 1 rotates its start by its EP rank");
    /* GPU 3 (node 1) runs s3 then s2: expert 3 own (the extra, 8); expert 0 on node 1: slot
     * 5 (EP2); expert 1 own slot 6; expert 2 own slot 7. */
    static const int32_t want_s3[6] = {8, 5, 8, 6, 8, 7}, want_s2[4] = {5, 6, 5, 7};
    ok(memcmp(phys + 16, want_s3, sizeof want_s3) == 0 && memcmp(phys + 12, want_s2, sizeof want_s2) == 0,
       "locality: GPU 3 keeps expert 3 on its extra replica");
    ok(phys[22] == -7 && phys[23] == -7, "tokens of other microbatches are not touched");
    static const int64_t want_cnt[9] = {2, 2, 2, 1, 2, 3, 2, 2, 6};
    ok(memcmp(cnt, want_cnt, sizeof want_cnt) == 0, "locality: per-slot counts");

    ok(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err) == RP_OK, "even: remaps");
    /* Even: round robin over all replicas from the source's EP rank. GPU 0 (rank 0):
     * expert 0 -> [0,3,5][0], [1]; expert 3 -> [4,8]: 4, 8, 4, 8; expert 1 -> [1,6][0];
     * expert 2 -> [2,7][0]. */
    static const int32_t even_s0[8] = {0, 4, 3, 8, 1, 4, 2, 8};
    ok(memcmp(phys, even_s0, sizeof even_s0) == 0, "even: GPU 0 walks every expert's replicas in order");
    /* GPU 3 (rank 3): s3 first: expert 3 occurrences 0,1,2 -> (o+3)%2: 8, 4, 8; expert 0
     * occ 0 -> [0,3,5][(0+3)%3=0] = 0, then s2: expert 0 occ 1,2 -> 3, 5; expert 1 occ 0 ->
     * [1,6][1] = 6, occ 1 -> 1; expert 2 occ 0 -> [2,7][1] = 7, occ 1 -> 2. */
    static const int32_t even_s3[6] = {8, 0, 4, 6, 8, 7}, even_s2[4] = {3, 1, 5, 2};
    ok(memcmp(phys + 16, even_s3, sizeof even_s3) == 0 && memcmp(phys + 12, even_s2, sizeof even_s2) == 0,
       "even: occurrences run over GPU 3's sequences in list order (s3 before s2)");

    /* Explicit shares for expert 0 at mb 0: [0.5, 0.25, 0.25] over slots 0, 3, 5. GPU 0
     * has 2 occurrences: quotas 1, 0.5, 0.5 -> floors 1, 0, 0, and the unit left over goes
     * to the larger remainder, a tie broken to the lower index: 1, 1, 0. GPU 3 has 3:
     * 1.5, 0.75, 0.75 -> floors 1, 0, 0, two units left to the remainders 0.75: 1, 1, 1.
     * GPU 1 has 1: 0.5, 0.25, 0.25 -> 1, 0, 0. */
    const double shares[3] = {0.5, 0.25, 0.25};
    rp_plan_set_shares(h.plan, 0, 0, 0, shares, 3, NULL);
    ok(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_LOCALITY, 1, phys, cnt, &err) == RP_OK, "shares: remaps");
    ok(phys[0] == 0 && phys[2] == 3, "shares: GPU 0's two expert-0 choices go to slots 0 then 3, whatever the rule");
    ok(phys[17] == 0 && phys[12] == 3 && phys[14] == 5, "shares: GPU 3's three go to 0, 3, 5 in occurrence order");
    ok(cnt[0] == 3 && cnt[3] == 2 && cnt[5] == 1, "shares: per-slot counts follow the apportionment");

    /* Shares of a single-replica expert: everything to it. */
    const double one[1] = {1.0};
    rp_plan_set_shares(h.plan, 1, 0, 2, (const double[2]){0.0, 1.0}, 2, NULL);
    rp_plan_set_shares(h.plan, 1, 0, 3, one, 1, NULL);
    ok(rp_remap(h.plan, h.cfg, 1, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err) == RP_OK && phys[22] == 0 + 0 &&
           phys[23] == 4,
       "mb 1: s4 on GPU 0 (EP rank 0): expert 0 to slot 0, expert 3 to its only replica");
    hand_free(&h);
}

/* A share of 0 sends nothing, and an uneven split stays within one of the exact quota. */
static void test_share_quotas(void)
{
    rp_config *cfg = config_of(1, 2, 2, 2, 1, 3, 1, NULL);
    rp_plan *plan = NULL;
    rp_plan_new(ctx, cfg, 1, &plan, NULL);
    static const int32_t p2l[4] = {0, 1, 0, 2};
    rp_plan_set_phy2log(plan, 0, p2l, NULL);
    enum { N = 1000 };
    int32_t lens[1] = {N};
    rp_batch *b = batch_of(1, lens);
    rp_plan_set_packing(plan, 1, (const int32_t[]){0}, (const int32_t[]){0}, NULL);
    uint8_t ids[N];
    memset(ids, 0, sizeof ids);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 1, 1, ids);
    int32_t phys[N];
    int64_t cnt[4];
    rp_plan_set_shares(plan, 0, 0, 0, (const double[2]){1.0, 0.0}, 2, NULL);
    ok(rp_remap(plan, cfg, 0, b, &r, RP_SPLIT_EVEN, 1, phys, cnt, NULL) == RP_OK && cnt[0] == N && cnt[2] == 0,
       "a share of 0 receives nothing");
    rp_plan_set_shares(plan, 0, 0, 0, (const double[2]){1.0 / 3, 2.0 / 3}, 2, NULL);
    ok(rp_remap(plan, cfg, 0, b, &r, RP_SPLIT_EVEN, 1, phys, cnt, NULL) == RP_OK && cnt[0] == 333 && cnt[2] == 667,
       "1/3 and 2/3 of 1000: 333 and 667 (largest remainder)");
    ok(phys[0] == 0 && phys[332] == 0 && phys[333] == 2 && phys[999] == 2,
       "shares hand out contiguous runs in occurrence order");
    rp_plan_clear_levers(plan);
    ok(rp_remap(plan, cfg, 0, b, &r, RP_SPLIT_EVEN, 1, phys, cnt, NULL) == RP_OK && cnt[0] == 500 && cnt[2] == 500 &&
           phys[0] == 0 && phys[1] == 2,
       "even: 1000 from EP rank 0 alternate between the two replicas");
    rp_batch_free(b);
    rp_plan_free(plan);
    rp_config_free(cfg);
}

/* ---- agreement with the cost model --------------------------------------------------- */

/* The cost model splits fractionally; with every source's count a multiple of its
 * candidate count the split is integral, and its per-slot token counts must be remap's.
 * Compared through X(g, m, l) = sum over g's slots of t(n_slot) with a curved eff(n), so
 * that any other split of the same total changes it: the per-expert (loop) form, whose
 * GPU time is that sum (the grouped form's is not a sum over slots: test_cost_gemm). */
static void test_cost_agreement(void)
{
    const char *hw = "\"hardware\": {\"peak_flops\": 1e6, \"hbm_bytes_per_s\": 1e30,"
                     " \"gemm_efficiency\": [[1, 0.05], [40, 0.6], [400, 1]]},"
                     " \"execution\": {\"expert_gemm\": \"loop\"},";
    uint64_t rng = 12345;
    int all = 1, compared = 0;
    for (int rule = 0; rule < 2; rule++)
        for (int shape = 0; shape < 2; shape++) {
            const int32_t nodes = 2, gpn = shape ? 4 : 2, ep = shape ? 4 : 4, slots = 3, E = 8, L = 2, k = 2, n = 30;
            rp_config *cfg = config_of(nodes, gpn, ep, slots, L, E, k, hw);
            rp_plan *plan = NULL;
            rp_plan_new(ctx, cfg, 2, &plan, NULL);
            const int32_t G = nodes * gpn, S = ep * slots, Q = G / ep;
            /* each token record repeated 6 times: every count divides by 1, 2, 3 and 6 */
            int32_t lens[30], rank[30], mbs[30];
            for (int32_t s = 0; s < n; s++) {
                lens[s] = 6 * (int32_t)(1 + xorshift64(&rng) % 5);
                rank[s] = (int32_t)(xorshift64(&rng) % G);
                mbs[s] = (int32_t)(xorshift64(&rng) % 2);
            }
            rp_batch *b = batch_of(n, lens);
            rp_plan_set_packing(plan, n, rank, mbs, NULL);
            const int64_t T = rp_batch_num_tokens(b);
            uint8_t *ids = malloc((size_t)(T * L * k));
            for (int64_t t = 0; t < T; t += 6)
                for (int32_t l = 0; l < L; l++) {
                    int32_t a = (int32_t)(xorshift64(&rng) % E), c = (int32_t)((a + 1 + xorshift64(&rng) % (E - 1)) % E);
                    for (int32_t rep = 0; rep < 6; rep++) {
                        ids[((t + rep) * L + l) * k] = (uint8_t)a;
                        ids[((t + rep) * L + l) * k + 1] = (uint8_t)c;
                    }
                }
            /* experts 0..7 once, then hot experts 0, 1, 2 on spare slots (2 or 3 replicas) */
            for (int32_t l = 0; l < L; l++) {
                int32_t p2l[12] = {0, 1, 5, 2, 3, 6, 4, 0, 7, 1, 2, 0};
                if (l == 1) p2l[11] = -1;
                rp_plan_set_phy2log(plan, l, p2l, NULL);
            }
            (void)S;
            rp_routing r;
            rp_routing_packed(&r, RP_ID_U8, L, k, ids);
            rp_stats *stats = NULL;
            rp_cost *cost = NULL;
            rp_error err;
            bool made = rp_stats_compute(ctx, b, &r, E, 1, &stats, &err) == RP_OK &&
                        rp_cost_new(ctx, cfg, b, stats, (rp_split_rule)rule, &cost, &err) == RP_OK &&
                        rp_cost_evaluate(cost, plan, NULL, &err) == RP_OK;
            if (!made) diag("cost: %s", err.text);
            all &= made;
            const double *X = made ? rp_cost_expert_breakdown(cost) : NULL;
            int32_t *phys = malloc(sizeof *phys * (size_t)(T * L * k));
            for (int32_t mb = 0; made && mb < 2; mb++) {
                const int32_t P = rp_remap_num_physical(plan, mb);
                int64_t *cnt = calloc((size_t)L * Q * P, sizeof *cnt);
                all &= rp_remap(plan, cfg, mb, b, &r, (rp_split_rule)rule, 2, phys, cnt, &err) == RP_OK;
                for (int32_t l = 0; l < L; l++)
                    for (int32_t g = 0; g < G; g++) {
                        double x = 0;
                        for (int32_t p = 0; p < P; p++)
                            if (rp_remap_physical_ep_rank(plan, mb, l, p) == g % ep)
                                x += rp_cost_expert_s(cost, (double)cnt[((size_t)l * Q + g / ep) * P + p]);
                        const double want = X[((size_t)mb * L + l) * G + g];
                        all &= fabs(x - want) <= 1e-9 * fabs(want) + 1e-15;
                        compared++;
                    }
                free(cnt);
            }
            free(phys);
            rp_cost_free(cost);
            rp_stats_free(stats);
            free(ids);
            rp_batch_free(b);
            rp_plan_free(plan);
            rp_config_free(cfg);
        }
    ok(all && compared == 96,
       "integral splits: every GPU's expert time from remap's per-slot counts equals the cost model's (%d GPU-layers)",
       compared);
}

/* ---- determinism, views, threads ------------------------------------------------------ */

static void test_determinism(void)
{
    uint64_t rng = 77;
    rcase c;
    rcase_make(&c, &rng, 2, 4, 8, 3, 20, 4, 3, 200, 3);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, c.L, c.k, c.ids);
    const size_t nid = (size_t)(c.tokens * c.L * c.k);
    int32_t *a = calloc(nid, sizeof *a), *b = calloc(nid, sizeof *b), *d = calloc(nid, sizeof *d);
    const int32_t P = rp_remap_num_physical(c.plan, 1);
    const size_t rows = (size_t)c.L * 1 * P;
    int64_t *ca = calloc(rows, sizeof *ca), *cb = calloc(rows, sizeof *cb), *cd = calloc(rows, sizeof *cd);
    ok(rp_remap(c.plan, c.cfg, 1, c.batch, &r, RP_SPLIT_LOCALITY, 1, a, ca, NULL) == RP_OK &&
           rp_remap(c.plan, c.cfg, 1, c.batch, &r, RP_SPLIT_LOCALITY, 1, b, cb, NULL) == RP_OK &&
           memcmp(a, b, nid * sizeof *a) == 0 && memcmp(ca, cb, rows * sizeof *ca) == 0,
       "the same inputs give the same ids and counts");
    ok(rp_remap(c.plan, c.cfg, 1, c.batch, &r, RP_SPLIT_LOCALITY, 5, b, cb, NULL) == RP_OK &&
           memcmp(a, b, nid * sizeof *a) == 0 && memcmp(ca, cb, rows * sizeof *ca) == 0,
       "5 threads give what 1 thread gives");
    /* the same ids as per-sequence arrays and as per-layer [tokens, k] arrays */
    const int32_t n = c.n;
    const void **seq = malloc(sizeof *seq * (size_t)n);
    const int64_t *cu = rp_batch_cu_seqlens(c.batch);
    for (int32_t s = 0; s < n; s++) seq[s] = c.ids + cu[s] * c.L * c.k;
    rp_routing rs;
    rp_routing_per_seq(&rs, RP_ID_U8, c.L, c.k, seq, n);
    ok(rp_remap(c.plan, c.cfg, 1, c.batch, &rs, RP_SPLIT_LOCALITY, 2, d, cd, NULL) == RP_OK &&
           memcmp(a, d, nid * sizeof *a) == 0 && memcmp(ca, cd, rows * sizeof *ca) == 0,
       "a per-sequence view gives what the packed view gives");
    int32_t *wide = malloc(nid * sizeof *wide);
    for (size_t i = 0; i < nid; i++) wide[i] = c.ids[i];
    rp_routing rw;
    rp_routing_packed(&rw, RP_ID_I32, c.L, c.k, wide);
    memset(d, 0, nid * sizeof *d);
    ok(rp_remap(c.plan, c.cfg, 1, c.batch, &rw, RP_SPLIT_LOCALITY, 3, d, cd, NULL) == RP_OK &&
           memcmp(a, d, nid * sizeof *a) == 0,
       "int32 ids give what uint8 ids give");
    /* all microbatches cover every token exactly once */
    int32_t *all = malloc(nid * sizeof *all);
    for (size_t i = 0; i < nid; i++) all[i] = -1;
    for (int32_t mb = 0; mb < c.M; mb++) rp_remap(c.plan, c.cfg, mb, c.batch, &r, RP_SPLIT_EVEN, 2, all, NULL, NULL);
    int covered = 1;
    for (size_t i = 0; i < nid; i++) covered &= all[i] >= 0;
    ok(covered, "remapping every microbatch fills every token (slot_tokens may be NULL)");
    free(all);
    free(wide);
    free(seq);
    free(a), free(b), free(d), free(ca), free(cb), free(cd);
    rcase_free(&c);
}

/* ---- bad input ------------------------------------------------------------------------ */

static void test_errors(void)
{
    hand h;
    hand_make(&h);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 1, 2, h.ids);
    rp_error err;
    int32_t phys[24];
    int64_t cnt[9];
    for (int i = 0; i < 24; i++) phys[i] = -7;
    for (int i = 0; i < 9; i++) cnt[i] = -7;
    int untouched;

    h.ids[13] = 9; /* s2 token 0 choice 1 */
    h.ids[19] = 4; /* s3 token 1 choice 1: a higher sequence, listed earlier */
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 2, phys, cnt, &err), RP_ERANGE, "an id out of range: RP_ERANGE");
    like(err.text, "sequence 2 token 0 layer 0 choice 1 has expert id 9, but the model has 4 experts",
         "the error names the lowest sequence's first bad id");
    is_int(err.sequence, 2, "err.sequence is set");
    untouched = 1;
    for (int i = 0; i < 24; i++) untouched &= phys[i] == -7;
    for (int i = 0; i < 9; i++) untouched &= cnt[i] == -7;
    ok(untouched, "nothing is written on error");
    h.ids[13] = 1, h.ids[19] = 1;

    int32_t wide[24];
    for (int i = 0; i < 24; i++) wide[i] = h.ids[i];
    wide[3] = -1;
    rp_routing rw;
    rp_routing_packed(&rw, RP_ID_I32, 1, 2, wide);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &rw, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_ERANGE, "a negative id: RP_ERANGE");
    like(err.text, "sequence 0 token 1 layer 0 choice 1 has expert id -1", "and names it");
    wide[3] = 3;
    wide[23] = 70000; /* out of range, but in microbatch 1 */
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &rw, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_OK,
           "a bad id in another microbatch is not read");

    is_int(rp_remap(h.plan, h.cfg, 2, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "microbatch out of range");
    like(err.text, "microbatch 2 is out of range", "and says so");
    is_int(rp_remap(h.plan, h.cfg, -1, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "negative microbatch");
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, (rp_split_rule)7, 1, phys, cnt, &err), RP_EINVAL, "unknown split rule");
    rp_routing r2;
    rp_routing_packed(&r2, RP_ID_U8, 2, 2, h.ids);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r2, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "routing of 2 layers for a 1-layer plan");
    like(err.text, "the routing has 2 layers, but the plan has 1", "names both layer counts");
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, NULL, cnt, &err), RP_EINVAL, "no output array");
    is_int(rp_remap(NULL, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "no plan");

    rp_config *other = config_of(1, 4, 4, 2, 1, 4, 2, NULL);
    is_int(rp_remap(h.plan, other, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_OK,
           "a config of the same shape is accepted");
    rp_config_free(other);
    other = config_of(1, 4, 2, 4, 1, 4, 2, NULL);
    is_int(rp_remap(h.plan, other, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "a config of another shape");
    like(err.text, "was made for another config", "says so");
    rp_config_free(other);
    int32_t six[6] = {1, 1, 1, 1, 1, 1};
    rp_batch *b6 = batch_of(6, six);
    is_int(rp_remap(h.plan, h.cfg, 0, b6, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "a batch of another size");
    like(err.text, "the packing has 5 sequences, but the batch has 6", "names both counts");
    rp_batch_free(b6);

    /* shares that do not match the replicas */
    rp_plan_set_shares(h.plan, 0, 0, 1, (const double[3]){0.2, 0.3, 0.5}, 3, NULL);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EPLAN, "3 shares for 2 replicas: RP_EPLAN");
    like(err.text, "mb 0 layer 0 expert 1 has 3 shares for 2 replicas", "names the expert and the counts");
    rp_plan_set_shares(h.plan, 0, 0, 1, (const double[2]){0.0, 0.0}, 2, NULL);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EPLAN, "shares summing to 0");
    rp_plan_set_shares(h.plan, 0, 0, 1, (const double[2]){NAN, 1.0}, 2, NULL);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EPLAN, "a NaN share");
    rp_plan_clear_levers(h.plan);

    /* an expert without a replica */
    static const int32_t p2l[8] = {0, 1, 3, 0, 3, 0, 1, 0};
    rp_plan_set_phy2log(h.plan, 0, p2l, NULL);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EPLAN, "an expert without replica");
    like(err.text, "layer 0 expert 2 has no replica", "names it");
    static const int32_t good[8] = {0, 1, 2, 0, 3, 0, 1, 2};
    rp_plan_set_phy2log(h.plan, 0, good, NULL);

    /* a sequence listed twice in the microbatch */
    static const int32_t l0[] = {0, 1}, l1[] = {1}, l3[] = {3, 2};
    const int32_t *lists[8] = {l0, NULL, l1, NULL, NULL, NULL, l3, NULL};
    const int32_t counts[8] = {2, 0, 1, 0, 0, 0, 2, 0};
    rp_plan_set_microbatches(h.plan, 5, lists, counts, NULL);
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EPLAN, "a sequence listed twice");
    like(err.text, "sequence 1 is listed twice in microbatch 0 (GPUs 0 and 1)", "names the sequence and the GPUs");

    rp_plan *bare = NULL;
    rp_plan_new(ctx, h.cfg, 1, &bare, NULL);
    is_int(rp_remap(bare, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_EINVAL, "a plan without packing or placement");
    is_int(rp_remap_num_physical(bare, 0), -1, "no placement: no physical ids");
    rp_plan_free(bare);
    hand_free(&h);
}

/* The routing changes between the pass that checks the ids and the pass that uses them
 * (routing_scan_hook, the point where another thread could write it): the id is
 * checked where it is used, so the call reports it instead of indexing the replica
 * table with it (before, it read and wrote out of bounds). */
static int32_t *changing_ids;
static int32_t changing_value;
static void change_routing(void) { changing_ids[3] = changing_value; }

static void test_changed_during_call(void)
{
    hand h;
    hand_make(&h);
    int32_t wide[24], phys[24];
    int64_t cnt[9];
    for (int i = 0; i < 24; i++) wide[i] = h.ids[i];
    rp_routing r;
    rp_routing_packed(&r, RP_ID_I32, 1, 2, wide);
    const int32_t bad[3] = {4, 1 << 28, -1};
    for (int i = 0; i < 3; i++) {
        wide[3] = 3;
        changing_ids = wide;
        changing_value = bad[i];
        routing_scan_hook = change_routing;
        rp_error err;
        for (int x = 0; x < 9; x++) cnt[x] = -7;
        rp_status st = rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err);
        routing_scan_hook = NULL;
        is_int(st, RP_ERANGE, "an id changed to %d after the checking pass: RP_ERANGE", bad[i]);
        like(err.text, "changed during the call", "the message says the routing changed: %s", err.text);
        int untouched = 1;
        for (int x = 0; x < 9; x++) untouched &= cnt[x] == -7;
        ok(untouched, "slot_tokens is not written");
    }
    wide[3] = 3;
    rp_error err;
    is_int(rp_remap(h.plan, h.cfg, 0, h.batch, &r, RP_SPLIT_EVEN, 1, phys, cnt, &err), RP_OK, "unchanged, the call succeeds");
    hand_free(&h);
}

/* Fail every allocation of rp_remap in turn: each fails cleanly and leaks nothing. */
static void test_alloc_failures(void)
{
    counting c = {0, 0, 0, 0, 0};
    rp_context *cctx = NULL;
    rp_context_new(counting_alloc, &c, &cctx);
    rp_context *saved = ctx;
    ctx = cctx;
    uint64_t rng = 5;
    rcase rc;
    rcase_make(&rc, &rng, 2, 2, 4, 3, 10, 2, 2, 30, 2);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, rc.L, rc.k, rc.ids);
    int32_t *phys = calloc((size_t)(rc.tokens * rc.L * rc.k) + 1, sizeof *phys);
    int64_t *cnt = calloc((size_t)rc.L * rp_remap_num_physical(rc.plan, 0), sizeof *cnt);
    const long live = c.live;
    int clean = 1, n = 0;
    for (long at = 1; at < 200; at++) {
        c.fail_at = c.calls + at;
        rp_error err;
        rp_status st = rp_remap(rc.plan, rc.cfg, 0, rc.batch, &r, RP_SPLIT_LOCALITY, 2, phys, cnt, &err);
        clean &= c.live == live;
        if (st == RP_OK) break;
        clean &= st == RP_ENOMEM;
        n++;
    }
    c.fail_at = 0;
    ok(clean && n > 3, "each of %d failed allocations gives RP_ENOMEM and leaks nothing", n);
    free(phys);
    free(cnt);
    rcase_free(&rc);
    ctx = saved;
    rp_context_free(cctx);
}

/* ---- one rank's own tokens (rp_remap_rank) ------------------------------------------- */

static void test_rank(void)
{
    uint64_t rng = 0xA0761D6478BD642FULL;
    const int32_t shapes[][4] = {{1, 4, 4, 3}, {2, 2, 4, 2}, {2, 3, 2, 4}, {4, 2, 8, 2}};
    int ids_same = 1, counts_sum = 1, calls = 0;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
        for (int rule = 0; rule < 2; rule++) {
            rcase c;
            const int32_t E = shapes[sh][2] * shapes[sh][3] - 2 > 3 ? shapes[sh][2] * shapes[sh][3] - 2 : 3;
            if (!rcase_make(&c, &rng, shapes[sh][0], shapes[sh][1], shapes[sh][2], shapes[sh][3], E, 3, 2, 40, 2)) {
                ok(0, "random case made");
                rcase_free(&c);
                continue;
            }
            rp_routing r;
            rp_routing_packed(&r, RP_ID_U8, c.L, c.k, c.ids);
            const size_t nid = (size_t)(c.tokens * c.L * c.k) + 1, rec = (size_t)c.L * c.k;
            const int64_t *cu = rp_batch_cu_seqlens(c.batch);
            const int32_t G = rp_plan_num_gpus(c.plan), ep = rp_plan_ep_size(c.plan), Q = G / ep;
            int32_t *whole = malloc(nid * sizeof *whole);
            for (int32_t mb = 0; mb < c.M; mb++) {
                const int32_t P = rp_remap_num_physical(c.plan, mb);
                int64_t *wc = malloc((size_t)c.L * Q * P * sizeof *wc), *sum = calloc((size_t)c.L * Q * P, sizeof *sum);
                rp_error err;
                rp_remap(c.plan, c.cfg, mb, c.batch, &r, (rp_split_rule)rule, 1, whole, wc, &err);
                for (int32_t g = 0; g < G; g++) {
                    int32_t cnt = 0;
                    const int32_t *seqs = rp_plan_microbatch(c.plan, g, mb, &cnt);
                    /* this rank's tokens only: the listed sequences' ids, concatenated */
                    int64_t tok = 0;
                    for (int32_t i = 0; i < cnt; i++) tok += cu[seqs[i] + 1] - cu[seqs[i]];
                    uint8_t *mine = malloc((size_t)tok * rec + 1), *p = mine;
                    for (int32_t i = 0; i < cnt; i++) {
                        size_t n = (size_t)(cu[seqs[i] + 1] - cu[seqs[i]]) * rec;
                        memcpy(p, c.ids + (size_t)cu[seqs[i]] * rec, n);
                        p += n;
                    }
                    rp_routing lr;
                    rp_routing_packed(&lr, RP_ID_U8, c.L, c.k, mine);
                    int32_t *got = malloc(((size_t)tok * rec + 1) * sizeof *got);
                    int64_t *gc = malloc((size_t)c.L * P * sizeof *gc);
                    rp_status st = rp_remap_rank(c.plan, c.cfg, mb, g, c.batch, &lr, (rp_split_rule)rule, got, gc, &err);
                    if (st != RP_OK) diag("remap_rank: %s", err.text);
                    ids_same &= st == RP_OK;
                    int64_t at = 0;
                    for (int32_t i = 0; i < cnt && st == RP_OK; i++) {
                        size_t n = (size_t)(cu[seqs[i] + 1] - cu[seqs[i]]) * rec;
                        ids_same &= memcmp(got + at, whole + (size_t)cu[seqs[i]] * rec, n * sizeof *got) == 0;
                        at += (int64_t)n;
                    }
                    for (int32_t l = 0; l < c.L; l++)
                        for (int32_t x = 0; x < P; x++) sum[((size_t)l * Q + g / ep) * P + x] += gc[(size_t)l * P + x];
                    free(got);
                    free(gc);
                    free(mine);
                    calls++;
                }
                counts_sum &= memcmp(sum, wc, (size_t)c.L * Q * P * sizeof *sum) == 0;
                free(wc);
                free(sum);
            }
            free(whole);
            rcase_free(&c);
        }
    ok(ids_same, "rp_remap_rank on each GPU's own tokens (%d calls, every topology and rule): the ids rp_remap gives "
       "those tokens", calls);
    ok(counts_sum, "and each GPU's slot counts add up, over its EP group, to rp_remap's");

    /* errors */
    rcase c;
    rcase_make(&c, &rng, 1, 4, 4, 3, 10, 3, 2, 12, 2);
    int32_t cnt = 0, g = 0;
    while (g < 4 && (rp_plan_microbatch(c.plan, g, 0, &cnt), cnt == 0)) g++;
    const int32_t *seqs = rp_plan_microbatch(c.plan, g, 0, &cnt);
    const int64_t *cu = rp_batch_cu_seqlens(c.batch);
    int64_t tok = 0;
    int32_t last = -1;
    for (int32_t i = 0; i < cnt; i++) {
        tok += cu[seqs[i] + 1] - cu[seqs[i]];
        if (cu[seqs[i] + 1] > cu[seqs[i]]) last = seqs[i];
    }
    uint8_t *mine = calloc((size_t)tok * 6 + 1, 1);
    int32_t *out = malloc(((size_t)tok * 6 + 1) * sizeof *out);
    rp_routing lr;
    rp_routing_packed(&lr, RP_ID_U8, 3, 2, mine);
    rp_error err;
    ok(rp_remap_rank(c.plan, c.cfg, 0, 4, c.batch, &lr, RP_SPLIT_EVEN, out, NULL, &err) == RP_EINVAL,
       "a GPU out of range is refused");
    like(err.text, "GPU 4 is out of range", "and named");
    if (tok > 0) {
        mine[tok * 6 - 1] = 200;
        ok(rp_remap_rank(c.plan, c.cfg, 0, g, c.batch, &lr, RP_SPLIT_EVEN, out, NULL, &err) == RP_ERANGE &&
               err.sequence == last,
           "a bad id is RP_ERANGE naming the global sequence (%d)", last);
    } else {
        skip(1, "no tokens on the GPU");
    }
    rp_routing_packed(&lr, RP_ID_U8, 2, 2, mine);
    ok(rp_remap_rank(c.plan, c.cfg, 0, g, c.batch, &lr, RP_SPLIT_EVEN, out, NULL, &err) == RP_EINVAL,
       "a routing with another layer count is refused");
    free(mine);
    free(out);
    rcase_free(&c);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_hand();
    test_share_quotas();
    test_random();
    test_rank();
    test_cost_agreement();
    test_determinism();
    test_errors();
    test_changed_during_call();
    test_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
