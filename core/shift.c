/* Router shift (routepack/shift.h): one pass over the replayed and the new top-k ids of
 * every token and layer, counting the old choices whose expert left the new top-k, per
 * layer, (layer, expert) and sequence. The CPU reference of kernels/shift.cu. */
#include "internal.h"
#include "gpu_dispatch.h"
#include "routing_access.h"
#include "routepack/gpu.h"
#include "routepack/shift.h"
#include "../kernels/gpu_support.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

struct rp_shift {
    rp_context *ctx;
    int32_t num_seqs, num_layers, num_experts, top_k;
    int64_t choices, changed;
    int64_t *layer_changed;  /* [layers] */
    int64_t *seq_changed;    /* [seqs] */
    int64_t *seq_choices;    /* [seqs] */
    int64_t *expert_old;     /* [layers][experts] */
    int64_t *expert_lost;    /* [layers][experts] */
    int64_t *expert_arrived; /* [layers][experts] */
};

#define MAX_AUTO_THREADS 64
/* Fewer token-layers than this per thread and an automatic thread count adds no thread. */
#define MIN_ROWS_PER_THREAD (1 << 18)

/* What every worker reads; nothing here is written during the pass. */
typedef struct pass {
    const rp_routing *old_r, *new_r;
    const int64_t *cu;
    int32_t layers, k;
    uint32_t experts;
    int64_t *seq_changed;    /* each worker writes its own sequences' entries */
} pass;

typedef struct worker {
    const pass *p;
    int32_t seq_begin, seq_end;
    int64_t *layer_changed, *expert_old, *expert_lost, *expert_arrived; /* partial counts */
    uint32_t *in_new, *in_old;  /* [experts]: stamp of the (token, layer) holding the expert */
    int32_t *old_ids, *new_ids; /* [k]: the ids of the current (token, layer), read once */
    const unsigned char **old_at, **new_at; /* [layers]: the current sequence's rows */
    uint32_t stamp;
    int32_t bad_seq;         /* first sequence of this range with an id out of range, or -1 */
} worker;

/* Read k ids of one (token, layer) into ids[], once each; false if one is out of range.
 * The width switch is per row, not per id. */
static inline bool load_row(rp_id_width width, const void *at, int64_t k_stride, int32_t k, uint32_t experts,
                            int32_t *ids)
{
    uint32_t bad = 0;
    switch (width) {
    case RP_ID_U8:
        for (int32_t j = 0; j < k; j++) ids[j] = ((const uint8_t *)at)[j * k_stride];
        break;
    case RP_ID_U16:
        for (int32_t j = 0; j < k; j++) ids[j] = ((const uint16_t *)at)[j * k_stride];
        break;
    default:
        for (int32_t j = 0; j < k; j++) ids[j] = ((const int32_t *)at)[j * k_stride];
        break;
    }
    for (int32_t j = 0; j < k; j++) bad |= (uint32_t)ids[j] >= experts;
    return bad == 0;
}

/* One sequence, tokens outside layers (a packed [tokens, layers, k] view is then read in
 * order); false at the first id out of range (the whole result is then discarded). */
static bool shift_seq(worker *w, int32_t s)
{
    const pass *p = w->p;
    const int32_t k = p->k, layers = p->layers;
    const int64_t len = p->cu[s + 1] - p->cu[s];
    const rp_routing *o = p->old_r, *n = p->new_r;
    const int64_t o_ts = o->token_stride * (int64_t)o->width, n_ts = n->token_stride * (int64_t)n->width;
    for (int32_t l = 0; l < layers; l++) {
        w->old_at[l] = rp_routing_at(o, p->cu, s, l);
        w->new_at[l] = rp_routing_at(n, p->cu, s, l);
    }
    int64_t seq_changed = 0;
    for (int64_t t = 0; t < len; t++) {
        for (int32_t l = 0; l < layers; l++) {
            if (!load_row(o->width, w->old_at[l] + t * o_ts, o->k_stride, k, p->experts, w->old_ids) ||
                !load_row(n->width, w->new_at[l] + t * n_ts, n->k_stride, k, p->experts, w->new_ids))
                return false;
            /* set membership by stamps: O(k) per (token, layer) whatever k is */
            if (++w->stamp == 0) {
                memset(w->in_new, 0, p->experts * sizeof *w->in_new);
                memset(w->in_old, 0, p->experts * sizeof *w->in_old);
                w->stamp = 1;
            }
            const uint32_t stamp = w->stamp;
            const size_t row = (size_t)l * p->experts;
            int64_t changed = 0;
            for (int32_t j = 0; j < k; j++) w->in_new[w->new_ids[j]] = stamp;
            for (int32_t j = 0; j < k; j++) w->in_old[w->old_ids[j]] = stamp;
            /* branch-free: which choices changed is data, not a predictable branch */
            int64_t *old_row = w->expert_old + row, *lost_row = w->expert_lost + row;
            int64_t *arrived_row = w->expert_arrived + row;
            for (int32_t j = 0; j < k; j++) {
                int32_t e = w->old_ids[j];
                int64_t lost = w->in_new[e] != stamp;
                old_row[e]++;
                lost_row[e] += lost;
                changed += lost;
            }
            for (int32_t j = 0; j < k; j++) {
                int32_t e = w->new_ids[j];
                arrived_row[e] += w->in_old[e] != stamp;
            }
            w->layer_changed[l] += changed;
            seq_changed += changed;
        }
    }
    p->seq_changed[s] = seq_changed;
    return true;
}

static void *work(void *arg)
{
    worker *w = arg;
    for (int32_t s = w->seq_begin; s < w->seq_end; s++)
        if (!shift_seq(w, s)) {
            w->bad_seq = s;
            break;
        }
    return NULL;
}

void rp_shift_free(rp_shift *shift)
{
    if (!shift) return;
    rp_context *ctx = shift->ctx;
    rp_free(ctx, shift->layer_changed);
    rp_free(ctx, shift->seq_changed);
    rp_free(ctx, shift->seq_choices);
    rp_free(ctx, shift->expert_old);
    rp_free(ctx, shift->expert_lost);
    rp_free(ctx, shift->expert_arrived);
    rp_free(ctx, shift);
}

/* "routing: ..." from the shared routing checks becomes "old routing: ...". */
static rp_status relabel(rp_error *err, rp_status st, const char *which)
{
    if (!err) return st;
    const size_t skip = strncmp(err->text, "routing: ", 9) == 0 ? 9 : 0;
    const size_t rest = strlen(err->text + skip), which_len = strlen(which);
    const size_t prefix = which_len + sizeof " routing: " - 1;
    const size_t keep = rest < sizeof err->text - 1 - prefix ? rest : sizeof err->text - 1 - prefix;
    memmove(err->text + prefix, err->text + skip, keep);
    memcpy(err->text, which, which_len);
    memcpy(err->text + which_len, " routing: ", prefix - which_len);
    err->text[prefix + keep] = '\0';
    return st;
}

/* Shape and index-range checks of one view. */
static rp_status check_view(const rp_routing *r, const rp_batch *batch, int32_t num_experts,
                            const char *which, rp_error *err)
{
    rp_status st = rp_routing_check_shape(r, batch, num_experts, err);
    if (st != RP_OK) return relabel(err, st, which);
    const int64_t tokens = rp_batch_num_tokens(batch);
    int64_t last, tmp;
    if (tokens > 0 &&
        (rp_mul_overflow(tokens - 1, r->token_stride, &last) ||
         rp_mul_overflow((int64_t)r->num_layers - 1, r->layer_stride, &tmp) || rp_add_overflow(last, tmp, &last) ||
         rp_mul_overflow((int64_t)r->top_k - 1, r->k_stride, &tmp) || rp_add_overflow(last, tmp, &last) ||
         rp_mul_overflow(last, 4, &tmp)))
        return rp_fail(err, RP_ERANGE, "%s routing: strides overflow a 64-bit index", which);
    return RP_OK;
}

/* The first bad id: the old routing's, else the new routing's, as rp_routing_check names it. */
static rp_status report_bad(const rp_routing *old_r, const rp_routing *new_r, const rp_batch *batch,
                            int32_t num_experts, rp_error *err)
{
    rp_status st = rp_routing_check(old_r, batch, num_experts, err);
    if (st != RP_OK) return relabel(err, st, "old");
    st = rp_routing_check(new_r, batch, num_experts, err);
    if (st != RP_OK) return relabel(err, st, "new");
    /* the ids changed between the pass and the report (another thread writes them) */
    return rp_fail(err, RP_ERANGE, "routing: an expert id was out of range during the shift pass");
}

static int32_t pick_threads(int32_t requested, int32_t num_seqs, int64_t rows)
{
    int64_t n = requested;
    if (n <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus < 1 ? 1 : cpus > MAX_AUTO_THREADS ? MAX_AUTO_THREADS : cpus;
        if (n > rows / MIN_ROWS_PER_THREAD) n = rows / MIN_ROWS_PER_THREAD;
    }
    if (n > MAX_AUTO_THREADS) n = MAX_AUTO_THREADS;
    if (n > num_seqs) n = num_seqs;
    return n < 1 ? 1 : (int32_t)n;
}

/* First sequence of worker i's share: an equal share of tokens. */
static int32_t split_point(const int64_t *cu, int32_t n, int64_t i, int64_t parts)
{
    const int64_t goal = (int64_t)((__int128)cu[n] * i / parts);
    int32_t lo = 0, hi = n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (cu[mid] < goal) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static rp_shift *shift_new(rp_context *ctx, int32_t n, int32_t layers, int32_t experts, int32_t k)
{
    const size_t cells = (size_t)layers * (size_t)experts;
    rp_shift *sh = rp_calloc(ctx, 1, sizeof *sh);
    if (!sh) return NULL;
    sh->ctx = ctx;
    sh->num_seqs = n, sh->num_layers = layers, sh->num_experts = experts, sh->top_k = k;
    sh->layer_changed = rp_calloc(ctx, (size_t)layers, sizeof(int64_t));
    sh->seq_changed = rp_calloc(ctx, (size_t)n + 1, sizeof(int64_t));
    sh->seq_choices = rp_calloc(ctx, (size_t)n + 1, sizeof(int64_t));
    sh->expert_old = rp_calloc(ctx, cells, sizeof(int64_t));
    sh->expert_lost = rp_calloc(ctx, cells, sizeof(int64_t));
    sh->expert_arrived = rp_calloc(ctx, cells, sizeof(int64_t));
    if (!sh->layer_changed || !sh->seq_changed || !sh->seq_choices || !sh->expert_old || !sh->expert_lost ||
        !sh->expert_arrived) {
        rp_shift_free(sh);
        return NULL;
    }
    return sh;
}

/* Totals every path derives the same way from the per-layer and per-sequence counts. */
static void finish(rp_shift *sh, const rp_batch *batch)
{
    const int64_t per_token = (int64_t)sh->num_layers * sh->top_k;
    sh->changed = 0;
    for (int32_t l = 0; l < sh->num_layers; l++) sh->changed += sh->layer_changed[l];
    sh->choices = rp_batch_num_tokens(batch) * per_token;
    for (int32_t s = 0; s < sh->num_seqs; s++) sh->seq_choices[s] = rp_batch_seq_len(batch, s) * per_token;
}

static rp_status compute_on_device(rp_context *ctx, const rp_batch *batch, const rp_routing *old_r,
                                   const rp_routing *new_r, int32_t num_experts, rp_shift **out,
                                   rp_error *err)
{
    const int32_t n = rp_batch_num_seqs(batch);
    rp_status st;
    void *cu_dev = NULL;
    rp_shift *sh = shift_new(ctx, n, old_r->num_layers, num_experts, old_r->top_k);
    if (!sh) return rp_fail_nomem(err, "router shift");
    RP_CHECK_GOTO(rp_gpu_dev_upload(rp_batch_cu_seqlens(batch), ((size_t)n + 1) * sizeof(int64_t), &cu_dev, err),
                  st, out);
    st = rp_gpu_router_shift(old_r, new_r, cu_dev, n, num_experts, sh->layer_changed, sh->seq_changed,
                             sh->expert_old, sh->expert_lost, sh->expert_arrived, err);
    if (st != RP_OK) goto out;
    finish(sh, batch);
    *out = sh;
    sh = NULL;
out:
    rp_gpu_dev_free(cu_dev);
    rp_shift_free(sh);
    return st;
}

rp_status rp_shift_compute(rp_context *ctx, const rp_batch *batch, const rp_routing *old_routing,
                           const rp_routing *new_routing, int32_t num_experts, int32_t num_threads,
                           rp_shift **out, rp_error *err)
{
    if (!batch || !old_routing || !new_routing || !out)
        return rp_fail(err, RP_EINVAL, "shift: batch, both routings and the output are required");
    rp_status st;
    if ((st = check_view(old_routing, batch, num_experts, "old", err)) != RP_OK) return st;
    if ((st = check_view(new_routing, batch, num_experts, "new", err)) != RP_OK) return st;
    if (old_routing->num_layers != new_routing->num_layers || old_routing->top_k != new_routing->top_k)
        return rp_fail(err, RP_EINVAL,
                       "shift: the old routing has %d layers x top-%d but the new routing has %d layers x "
                       "top-%d; both must describe the same model",
                       old_routing->num_layers, old_routing->top_k, new_routing->num_layers, new_routing->top_k);
    const int32_t n = rp_batch_num_seqs(batch), layers = old_routing->num_layers, k = old_routing->top_k;
    const size_t cells = (size_t)layers * (size_t)num_experts;
    int64_t choices;
    if (cells > SIZE_MAX / (8 * sizeof(int64_t) * MAX_AUTO_THREADS) ||
        rp_mul_overflow(rp_batch_num_tokens(batch), (int64_t)layers * k, &choices))
        return rp_fail(err, RP_ERANGE, "shift: %lld tokens x %d layers x top-%d (x %d experts) overflow",
                       (long long)rp_batch_num_tokens(batch), layers, k, num_experts);

    bool old_dev, new_dev;
    if ((st = gpu_routing_on_device(old_routing, batch, "old routing", &old_dev, err)) != RP_OK) return st;
    if ((st = gpu_routing_on_device(new_routing, batch, "new routing", &new_dev, err)) != RP_OK) return st;
    if (old_dev != new_dev)
        return rp_fail(err, RP_EINVAL,
                       "shift: the old routing is %s memory but the new routing is %s memory; copy one so "
                       "both are on the host or both on the device",
                       old_dev ? "device" : "host", new_dev ? "device" : "host");
    if (old_dev) return compute_on_device(ctx, batch, old_routing, new_routing, num_experts, out, err);

    const int64_t *cu = rp_batch_cu_seqlens(batch);
    const int32_t nthreads = pick_threads(num_threads, n, rp_batch_num_tokens(batch) * layers);
    rp_shift *sh = shift_new(ctx, n, layers, num_experts, k);
    worker *workers = NULL;
    int64_t *partial = NULL;
    uint32_t *marks = NULL;
    int32_t *ids = NULL;
    pthread_t *threads = NULL;
    bool *started = NULL;
    const unsigned char **rows = NULL;
    if (!sh) return rp_fail_nomem(err, "router shift");
    workers = rp_calloc(ctx, (size_t)nthreads, sizeof *workers);
    partial = rp_calloc(ctx, (size_t)nthreads * (3 * cells + (size_t)layers), sizeof *partial);
    marks = rp_calloc(ctx, (size_t)nthreads * 2 * (size_t)num_experts, sizeof *marks);
    ids = rp_alloc(ctx, (size_t)nthreads * 2 * (size_t)k * sizeof *ids);
    threads = rp_alloc(ctx, (size_t)nthreads * sizeof *threads);
    started = rp_calloc(ctx, (size_t)nthreads, sizeof *started);
    rows = rp_alloc(ctx, (size_t)nthreads * 2 * (size_t)layers * sizeof *rows);
    if (!workers || !partial || !marks || !ids || !threads || !started || !rows) {
        st = rp_fail_nomem(err, "router shift");
        goto out;
    }
    pass p = {old_routing, new_routing, cu, layers, k, (uint32_t)num_experts, sh->seq_changed};
    for (int32_t i = 0; i < nthreads; i++) {
        int64_t *part = partial + (size_t)i * (3 * cells + (size_t)layers);
        workers[i] = (worker){
            .p = &p,
            .seq_begin = split_point(cu, n, i, nthreads),
            .seq_end = i + 1 == nthreads ? n : split_point(cu, n, i + 1, nthreads),
            .expert_old = part,
            .expert_lost = part + cells,
            .expert_arrived = part + 2 * cells,
            .layer_changed = part + 3 * cells,
            .in_new = marks + (size_t)i * 2 * num_experts,
            .in_old = marks + (size_t)i * 2 * num_experts + num_experts,
            .old_ids = ids + (size_t)i * 2 * k,
            .new_ids = ids + (size_t)i * 2 * k + k,
            .old_at = rows + (size_t)i * 2 * layers,
            .new_at = rows + (size_t)i * 2 * layers + layers,
            .bad_seq = -1,
        };
    }
    /* Worker 0 runs here; a thread that cannot start has its share run here too. */
    for (int32_t i = 1; i < nthreads; i++) started[i] = pthread_create(&threads[i], NULL, work, &workers[i]) == 0;
    work(&workers[0]);
    for (int32_t i = 1; i < nthreads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else work(&workers[i]);
    }
    for (int32_t i = 0; i < nthreads; i++)
        if (workers[i].bad_seq >= 0) {
            st = report_bad(old_routing, new_routing, batch, num_experts, err);
            goto out;
        }
    for (int32_t i = 0; i < nthreads; i++) {
        const worker *w = &workers[i];
        for (size_t c = 0; c < cells; c++) {
            sh->expert_old[c] += w->expert_old[c];
            sh->expert_lost[c] += w->expert_lost[c];
            sh->expert_arrived[c] += w->expert_arrived[c];
        }
        for (int32_t l = 0; l < layers; l++) sh->layer_changed[l] += w->layer_changed[l];
    }
    finish(sh, batch);
    *out = sh;
    sh = NULL;
    st = RP_OK;
out:
    rp_free(ctx, workers);
    rp_free(ctx, partial);
    rp_free(ctx, marks);
    rp_free(ctx, ids);
    rp_free(ctx, threads);
    rp_free(ctx, started);
    rp_free(ctx, rows);
    rp_shift_free(sh);
    return st;
}

/* ---- access ------------------------------------------------------------------ */

int32_t rp_shift_num_seqs(const rp_shift *sh) { return sh->num_seqs; }
int32_t rp_shift_num_layers(const rp_shift *sh) { return sh->num_layers; }
int32_t rp_shift_num_experts(const rp_shift *sh) { return sh->num_experts; }
int32_t rp_shift_top_k(const rp_shift *sh) { return sh->top_k; }
int64_t rp_shift_choices(const rp_shift *sh) { return sh->choices; }
int64_t rp_shift_changed(const rp_shift *sh) { return sh->changed; }
const int64_t *rp_shift_layer_changed(const rp_shift *sh) { return sh->layer_changed; }
const int64_t *rp_shift_seq_changed(const rp_shift *sh) { return sh->seq_changed; }
const int64_t *rp_shift_seq_choices(const rp_shift *sh) { return sh->seq_choices; }
const int64_t *rp_shift_expert_old(const rp_shift *sh) { return sh->expert_old; }
const int64_t *rp_shift_expert_lost(const rp_shift *sh) { return sh->expert_lost; }
const int64_t *rp_shift_expert_arrived(const rp_shift *sh) { return sh->expert_arrived; }

rp_shift_summary rp_shift_summarize(const rp_shift *sh)
{
    rp_shift_summary m = {0};
    m.max_layer = m.max_seq = m.max_expert_layer = m.max_expert = -1;
    if (!sh) return m;
    m.choices = sh->choices;
    m.changed = sh->changed;
    m.fraction = sh->choices > 0 ? (double)sh->changed / (double)sh->choices : 0.0;
    /* each layer compares tokens x k choices */
    const int64_t per_layer = sh->num_layers > 0 ? sh->choices / sh->num_layers : 0;
    if (per_layer > 0)
        for (int32_t l = 0; l < sh->num_layers; l++) {
            double f = (double)sh->layer_changed[l] / (double)per_layer;
            if (m.max_layer < 0 || f > m.max_layer_fraction) m.max_layer_fraction = f, m.max_layer = l;
        }
    for (int32_t s = 0; s < sh->num_seqs; s++) {
        if (sh->seq_choices[s] == 0) continue;
        double f = (double)sh->seq_changed[s] / (double)sh->seq_choices[s];
        if (m.max_seq < 0 || f > m.max_seq_fraction) m.max_seq_fraction = f, m.max_seq = s;
    }
    for (int32_t l = 0; l < sh->num_layers; l++)
        for (int32_t e = 0; e < sh->num_experts; e++) {
            size_t c = (size_t)l * sh->num_experts + e;
            if (sh->expert_old[c] == 0) continue;
            double f = (double)sh->expert_lost[c] / (double)sh->expert_old[c];
            if (m.max_expert < 0 || f > m.max_expert_lost_fraction)
                m.max_expert_lost_fraction = f, m.max_expert_layer = l, m.max_expert = e;
        }
    return m;
}
