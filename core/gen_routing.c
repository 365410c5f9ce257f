/* The generator's hot loop: the top-k expert ids of every token of one step, one
 * prompt group at a time (on several threads; the result does not depend on how
 * many), written straight into the packed [tokens, layers, k] array. */
#include "gen_internal.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

/* Consecutive rejected draws before switching to an exact draw over what is left. */
#define MAX_REJECTIONS 16
/* Draws from a coupling row before falling back to the sequence's own preference. */
#define COUPLING_TRIES 1
/* Preference weights below this fraction of a layer's largest are raised to it, so
 * every expert stays drawable (inclusion changes by under 1e-10). */
#define WEIGHT_FLOOR 1e-12

/* Experts by decreasing preference (ties by id, so the order is deterministic). */
typedef struct ranked {
    double weight;
    uint32_t expert;
} ranked;

/* Alias-table entries a worker may spend on suffix tables (see pl_draw). */
#define SUFFIX_BUDGET ((size_t)1 << 22)


typedef struct worker {
    const gen_step_job *job;
    int32_t *next_group;    /* shared work counter */
    int32_t num_suffix;     /* suffix tables per layer, 1..k */
    uint64_t *table;        /* [L x num_suffix x E] alias tables, see pl_draw */
    uint16_t *order;        /* [L x E] experts by decreasing preference */
    double *weight;         /* [L x E] the preferences, each layer sums to 1 */
    void *alias_work;
    ranked *rank;           /* [E] scratch for sorting */
    double *suffix_weight;  /* [E] scratch */
    uint32_t *stamp;        /* [E] expert already taken by the current (token, layer) */
    uint32_t mark;
} worker;

static inline uint64_t threshold_of(double p)
{
    if (p <= 0) return 0;
    if (p >= 1) return UINT64_MAX;
    return (uint64_t)(p * 18446744073709551616.0);
}

/* One Plackett-Luce draw among the experts not yet taken. Rejecting taken experts
 * from a draw over a superset is exact (it conditions on the rest), so the draw uses
 * the alias table of the suffix order[p..E) of the experts sorted by preference, where
 * the p most preferred are all taken already: a specialized sequence, whose first
 * picks are mostly its favourites, then rarely draws a taken expert. After
 * MAX_REJECTIONS misses it scans what is left, exactly. */
static inline int32_t pl_draw(const uint32_t *stamp, uint32_t mark, const uint64_t *table,
                              const double *weight, uint32_t ne, uint32_t p, gen_rng *rng)
{
    const uint64_t *tp = table + (size_t)p * ne;
    for (int tries = 0; tries < MAX_REJECTIONS; tries++) {
        uint32_t e = gen_alias_draw(tp, ne - p, gen_next(rng));
        if (stamp[e] != mark) return (int32_t)e;
    }
    double rest = 0;
    for (uint32_t e = 0; e < ne; e++)
        if (stamp[e] != mark) rest += weight[e];
    double u = gen_uniform(rng) * rest;
    int32_t last = -1;
    for (uint32_t e = 0; e < ne; e++) {
        if (stamp[e] == mark) continue;
        last = (int32_t)e;
        u -= weight[e];
        if (u < 0) break;
    }
    return last;
}

/* A fresh mark for the next (token, layer): stamps equal to it are taken. */
static inline uint32_t next_mark(uint32_t *stamp, uint32_t mark, uint32_t ne)
{
    if (++mark == 0) {
        memset(stamp, 0, ne * sizeof(uint32_t));
        mark = 1;
    }
    return mark;
}

static inline int32_t id_get(const char *at, rp_id_width width, int32_t j)
{
    switch (width) {
    case RP_ID_U8: return ((const uint8_t *)at)[j];
    case RP_ID_U16: return ((const uint16_t *)(const void *)at)[j];
    default: return ((const int32_t *)(const void *)at)[j];
    }
}

static inline void ids_put(char *at, rp_id_width width, const int32_t *ids, int32_t k)
{
    switch (width) {
    case RP_ID_U8:
        for (int32_t j = 0; j < k; j++) ((uint8_t *)at)[j] = (uint8_t)ids[j];
        break;
    case RP_ID_U16:
        for (int32_t j = 0; j < k; j++) ((uint16_t *)(void *)at)[j] = (uint16_t)ids[j];
        break;
    default:
        memcpy(at, ids, (size_t)k * sizeof(int32_t));
        break;
    }
}

/* Whether a comes before b: larger weight first, then smaller id (a total order, so
 * the result does not depend on the sort). */
static inline bool ranks_before(const ranked *a, const ranked *b)
{
    return a->weight > b->weight || (a->weight == b->weight && a->expert < b->expert);
}

/* Heapsort: in place, O(n log n), and no allocation (qsort may call malloc behind the
 * context's allocator). */
static void sort_ranked(ranked *a, uint32_t n)
{
    for (uint32_t end = n, start = n / 2; end > 1;) {
        uint32_t root;
        if (start > 0) {
            root = --start;
        } else {
            ranked t = a[0];
            a[0] = a[--end];
            a[end] = t;
            root = 0;
        }
        /* sift down: the heap's top is the element that sorts last */
        for (;;) {
            uint32_t child = 2 * root + 1;
            if (child >= end) break;
            if (child + 1 < end && ranks_before(&a[child], &a[child + 1])) child++;
            if (!ranks_before(&a[root], &a[child])) break;
            ranked t = a[root];
            a[root] = a[child];
            a[child] = t;
            root = child;
        }
    }
}

/* Draw the preferences of one group: per layer, Dirichlet(alpha) by normalized gamma
 * draws, and the alias tables of its suffixes by preference. */
static void draw_preferences(worker *w, const double *alpha, gen_rng *rng)
{
    const gen_model *m = w->job->model;
    uint32_t ne = (uint32_t)m->num_experts;
    ranked *rank = w->rank;
    double *suffix_w = w->suffix_weight;
    for (int32_t l = 0; l < m->num_layers; l++) {
        double *wt = w->weight + (size_t)l * ne;
        const double *a = alpha + (size_t)l * ne;
        double top = -INFINITY, total = 0;
        for (uint32_t e = 0; e < ne; e++) {
            wt[e] = gen_log_gamma(rng, a[e]);
            if (wt[e] > top) top = wt[e];
        }
        for (uint32_t e = 0; e < ne; e++) {
            double v = exp(wt[e] - top);
            wt[e] = v > WEIGHT_FLOOR ? v : WEIGHT_FLOOR;
            total += wt[e];
        }
        for (uint32_t e = 0; e < ne; e++) {
            wt[e] /= total;
            rank[e].weight = wt[e];
            rank[e].expert = e;
        }
        sort_ranked(rank, ne);
        uint16_t *order = w->order + (size_t)l * ne;
        for (uint32_t e = 0; e < ne; e++) {
            order[e] = (uint16_t)rank[e].expert;
            suffix_w[e] = rank[e].weight;
        }
        size_t base = (size_t)l * (size_t)w->num_suffix * ne;
        for (int32_t p = 0; p < w->num_suffix; p++)
            gen_alias_build(suffix_w + p, ne - (uint32_t)p, order + p, w->table + base + (size_t)p * ne,
                            w->alias_work);
    }
}

/* Routing of `num_tokens` consecutive tokens of one sequence into `out` (its token 0,
 * layer 0). `have_prev`: the token before the first is already in place right before
 * `out` (locality reaches across the end of a shared prompt). Layer by layer, so one
 * layer's tables stay in the L1 cache over the whole sequence: the token before (for
 * locality) and the layer before (for the coupling) are both written already. */
static void gen_tokens(worker *w, const gen_domain *dom, gen_rng *stream, int64_t num_tokens, char *out,
                       bool have_prev)
{
    /* locals the compiler can keep in registers across the stores below */
    gen_rng state = *stream, *rng = &state;
    uint32_t *stamp = w->stamp, mark = w->mark;
    const gen_step_job *job = w->job;
    const gen_model *m = job->model;
    const gen_settings *s = job->settings;
    int32_t nl = m->num_layers, k = m->top_k;
    uint32_t ne = (uint32_t)m->num_experts;
    rp_id_width width = s->width;
    size_t k_bytes = (size_t)k * (size_t)width;
    size_t row_bytes = (size_t)nl * k_bytes;
    uint64_t loc_thr = threshold_of(s->locality);
    uint64_t corr_thr = threshold_of(s->layer_correlation);
    uint32_t last_suffix = (uint32_t)w->num_suffix - 1;
    int32_t ids[GEN_MAX_TOP_K];
    for (int32_t l = 0; l < nl; l++) {
        const uint64_t *table = w->table + (size_t)l * (size_t)w->num_suffix * ne;
        const uint16_t *order = w->order + (size_t)l * ne;
        const double *weight = w->weight + (size_t)l * ne;
        int32_t c = l > 0 && corr_thr ? dom->coupling[l] : -1;
        const gen_coupling *cp = c >= 0 ? &dom->couplings[c] : NULL;
        const int32_t *inv_prev = c >= 0 ? m->inv + (size_t)(l - 1) * ne : NULL;
        const int32_t *perm = c >= 0 ? m->perm + (size_t)l * ne : NULL;
        char *dst = out + (size_t)l * k_bytes;
        for (int64_t t = 0; t < num_tokens; t++, dst += row_bytes) {
            if (loc_thr && (t > 0 || have_prev) && gen_next(rng) < loc_thr) {
                memcpy(dst, dst - row_bytes, k_bytes);
                continue;
            }
            mark = next_mark(stamp, mark, ne);
            uint32_t p = 0;
            if (!cp) {
                /* no coupling: the first pick cannot collide */
                int32_t e = (int32_t)gen_alias_draw(table, ne, gen_next(rng));
                stamp[e] = mark;
                ids[0] = e;
                if (order[0] == (uint32_t)e)
                    while (p < last_suffix && stamp[order[p]] == mark) p++;
                for (int32_t j = 1; j < k; j++) {
                    e = pl_draw(stamp, mark, table, weight, ne, p, rng);
                    stamp[e] = mark;
                    ids[j] = e;
                    if (order[p] == (uint32_t)e)
                        while (p < last_suffix && stamp[order[p]] == mark) p++;
                }
                ids_put(dst, width, ids, k);
                continue;
            }
            for (int32_t j = 0; j < k; j++) {
                int32_t e = -1;
                if (gen_next(rng) < corr_thr) {
                    /* the j-th choice follows the j-th choice of the layer before */
                    size_t from = (size_t)inv_prev[id_get(dst - k_bytes, width, j)] * ne;
                    for (int tries = 0; tries < COUPLING_TRIES; tries++) {
                        e = perm[gen_alias_draw(cp->table + from, ne, gen_next(rng))];
                        if (stamp[e] != mark) break;
                        e = -1;
                    }
                }
                if (e < 0) e = pl_draw(stamp, mark, table, weight, ne, p, rng);
                stamp[e] = mark;
                ids[j] = e;
                /* order[0..p) are all taken (a lower bound of the taken prefix is
                 * enough for exactness): p grows when the pick is the next favourite,
                 * and past favourites taken earlier out of order */
                if (order[p] == (uint32_t)e)
                    while (p < last_suffix && stamp[order[p]] == mark) p++;
            }
            ids_put(dst, width, ids, k);
        }
    }
    w->mark = mark;
    *stream = state;
}

static void gen_group(worker *w, int32_t g)
{
    const gen_step_job *job = w->job;
    const gen_settings *s = job->settings;
    const gen_model *m = job->model;
    int32_t d = job->group_domain[g];
    const gen_domain *dom = &m->domains[d];
    size_t le = (size_t)m->num_layers * (size_t)m->num_experts;
    size_t row = (size_t)m->num_layers * (size_t)m->top_k;
    size_t row_bytes = row * (size_t)s->width;
    gen_rng rng;

    gen_rng_stream(&rng, job->seed, GEN_TAG_PREF, (uint64_t)job->step, (uint64_t)g);
    draw_preferences(w, job->alpha + (size_t)d * le, &rng);

    int32_t first = g * s->group_size;
    char *ids = job->ids;
    if (s->share_prompt_routing) {
        /* the group's prompt is one text: routed once, the same for every response */
        int32_t plen = job->prompt_len[first];
        char *lead = ids + (size_t)job->cu_seqlens[first] * row_bytes;
        gen_rng_stream(&rng, job->seed, GEN_TAG_PROMPT, (uint64_t)job->step, (uint64_t)g);
        gen_tokens(w, dom, &rng, plen, lead, false);
        for (int32_t i = 0; i < s->group_size; i++) {
            int32_t seq = first + i;
            char *at = ids + (size_t)job->cu_seqlens[seq] * row_bytes;
            int64_t len = job->cu_seqlens[seq + 1] - job->cu_seqlens[seq];
            if (i > 0) memcpy(at, lead, (size_t)plen * row_bytes);
            gen_rng_stream(&rng, job->seed, GEN_TAG_TOKENS, (uint64_t)job->step, (uint64_t)seq);
            gen_tokens(w, dom, &rng, len - plen, at + (size_t)plen * row_bytes, true);
        }
    } else {
        for (int32_t i = 0; i < s->group_size; i++) {
            int32_t seq = first + i;
            char *at = ids + (size_t)job->cu_seqlens[seq] * row_bytes;
            int64_t len = job->cu_seqlens[seq + 1] - job->cu_seqlens[seq];
            gen_rng_stream(&rng, job->seed, GEN_TAG_TOKENS, (uint64_t)job->step, (uint64_t)seq);
            gen_tokens(w, dom, &rng, len, at, false);
        }
    }
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    int32_t groups = w->job->settings->num_prompts;
    for (;;) {
        int32_t g = __atomic_fetch_add(w->next_group, 1, __ATOMIC_RELAXED);
        if (g >= groups) break;
        gen_group(w, g);
    }
    return NULL;
}

static void worker_free(rp_context *ctx, worker *w)
{
    rp_free(ctx, w->table);
    rp_free(ctx, w->order);
    rp_free(ctx, w->rank);
    rp_free(ctx, w->suffix_weight);
    rp_free(ctx, w->weight);
    rp_free(ctx, w->alias_work);
    rp_free(ctx, w->stamp);
}

static bool worker_init(rp_context *ctx, const gen_step_job *job, int32_t *next_group, worker *w)
{
    const gen_model *m = job->model;
    size_t le = (size_t)m->num_layers * (size_t)m->num_experts;
    memset(w, 0, sizeof *w);
    w->job = job;
    w->next_group = next_group;
    /* one suffix table per pick (k) if the budget allows, at least the full table */
    size_t suffix = SUFFIX_BUDGET / (le ? le : 1);
    if (suffix > (size_t)m->top_k) suffix = (size_t)m->top_k;
    if (suffix < 1) suffix = 1;
    w->num_suffix = (int32_t)suffix;
    w->table = rp_alloc(ctx, le * suffix * sizeof(uint64_t));
    w->order = rp_alloc(ctx, le * sizeof(uint16_t));
    w->rank = rp_alloc(ctx, (size_t)m->num_experts * sizeof(ranked));
    w->suffix_weight = rp_alloc(ctx, (size_t)m->num_experts * sizeof(double));
    w->weight = rp_alloc(ctx, le * sizeof(double));
    w->alias_work = rp_alloc(ctx, GEN_ALIAS_WORK_BYTES(m->num_experts));
    w->stamp = rp_calloc(ctx, (size_t)m->num_experts, sizeof(uint32_t));
    return w->table && w->order && w->rank && w->suffix_weight && w->weight && w->alias_work && w->stamp;
}

rp_status gen_routing_run(rp_context *ctx, const gen_step_job *job, int32_t threads, rp_error *err)
{
    int32_t groups = job->settings->num_prompts;
    if (threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (int32_t)(n < 64 ? n : 64) : 1;
    }
    if (threads > groups) threads = groups;
    if (threads < 1) threads = 1;
    worker *workers = rp_calloc(ctx, (size_t)threads, sizeof(worker));
    pthread_t *tids = rp_calloc(ctx, (size_t)threads, sizeof(pthread_t));
    bool *started = rp_calloc(ctx, (size_t)threads, sizeof(bool));
    int32_t next_group = 0;
    rp_status st = RP_OK;
    if (!workers || !tids || !started) {
        st = rp_fail_nomem(err, "generator threads");
        goto out;
    }
    for (int32_t i = 0; i < threads; i++)
        if (!worker_init(ctx, job, &next_group, &workers[i])) {
            st = rp_fail_nomem(err, "generator scratch tables");
            goto out;
        }
    /* Workers beyond the first run on their own threads; if a thread cannot be
     * started the others (and this one) take its share: the ids are the same. */
    for (int32_t i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, worker_main, &workers[i]) == 0;
    worker_main(&workers[0]);
    for (int32_t i = 1; i < threads; i++)
        if (started[i]) pthread_join(tids[i], NULL);
out:
    if (workers)
        for (int32_t i = 0; i < threads; i++) worker_free(ctx, &workers[i]);
    rp_free(ctx, workers);
    rp_free(ctx, tids);
    rp_free(ctx, started);
    return st;
}
