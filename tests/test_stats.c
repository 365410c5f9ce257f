/* Routing statistics (core/stats.c): histograms by hand and against a naive count in
 * every layout, width and thread count; compact widths; microbatch and per-GPU loads;
 * skew; bad input; allocation failures; the constructor from dense counts that the GPU
 * path of rp_stats_compute uses, against the scan. */
#include "internal.h"
#include "stats_internal.h"
#include "routepack/routepack.h"
#include "routing_access.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <stdlib.h>
#include <unistd.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)((xorshift64(&rng_state) >> 11) % n); }

/* A batch with routing ids held as int32 [tokens][layers][k], and views of it in every
 * layout and width (the arrays the views borrow live here too). */
typedef struct fixture {
    rp_batch *batch;
    int32_t n, layers, k, experts;
    int64_t tokens;
    int32_t *ids;          /* [tokens][layers][k] */
    void **owned;          /* arrays of the current view */
    int nowned, cap;
} fixture;

static int32_t id_of(const fixture *f, int64_t t, int32_t l, int32_t j)
{
    return f->ids[(t * f->layers + l) * f->k + j];
}

static void fixture_init(fixture *f, rp_context *ctx, int32_t n, const int32_t *lens, int32_t layers,
                         int32_t k, int32_t experts)
{
    memset(f, 0, sizeof *f);
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_batch_new(ctx, n, lens, zero, NULL, &f->batch, NULL);
    free(zero);
    f->n = n, f->layers = layers, f->k = k, f->experts = experts;
    f->tokens = rp_batch_num_tokens(f->batch);
    f->ids = calloc((size_t)f->tokens * layers * k + 1, sizeof *f->ids);
}

static void fixture_random(fixture *f, int skewed)
{
    for (int64_t i = 0; i < f->tokens * f->layers * f->k; i++)
        f->ids[i] = skewed && rnd(4) ? (int32_t)rnd(3) : (int32_t)rnd((uint32_t)f->experts);
}

static void drop_view(fixture *f)
{
    for (int i = 0; i < f->nowned; i++) free(f->owned[i]);
    f->nowned = 0;
}

static void fixture_free(fixture *f)
{
    drop_view(f);
    free(f->owned);
    free(f->ids);
    rp_batch_free(f->batch);
}

static void store(void *a, rp_id_width w, int64_t i, int32_t v)
{
    if (w == RP_ID_U8) ((uint8_t *)a)[i] = (uint8_t)v;
    else if (w == RP_ID_U16) ((uint16_t *)a)[i] = (uint16_t)v;
    else ((int32_t *)a)[i] = v;
}

static void *own(fixture *f, size_t bytes)
{
    if (f->nowned == f->cap) {
        f->cap = f->cap ? 2 * f->cap : 64;
        f->owned = realloc(f->owned, (size_t)f->cap * sizeof *f->owned);
    }
    void *p = calloc(bytes ? bytes : 1, 1);
    f->owned[f->nowned++] = p;
    return p;
}

/* Views: 0 packed, 1 per sequence, 2 per layer, 3 packed [tokens][k][layers]
 * (choices strided), 4 packed with 3 ids of padding per token. */
#define NUM_VIEWS 5
static const char *view_names[NUM_VIEWS] = {"packed", "per-sequence", "per-layer",
                                            "token-k-layer order", "padded tokens"};

static void make_view(fixture *f, int which, rp_id_width w, rp_routing *r)
{
    const int32_t L = f->layers, k = f->k;
    const int64_t T = f->tokens;
    const int64_t *cu = rp_batch_cu_seqlens(f->batch);
    drop_view(f); /* views are used one at a time */
    switch (which) {
    case 0: {
        void *a = own(f, (size_t)(T * L * k) * w);
        for (int64_t i = 0; i < T * L * k; i++) store(a, w, i, f->ids[i]);
        rp_routing_packed(r, w, L, k, a);
        break;
    }
    case 1: {
        const void **seqs = own(f, ((size_t)f->n + 1) * sizeof *seqs);
        for (int32_t s = 0; s < f->n; s++) {
            int64_t len = cu[s + 1] - cu[s];
            if (len == 0) continue; /* an empty sequence may have no array */
            void *a = own(f, (size_t)(len * L * k) * w);
            for (int64_t i = 0; i < len * L * k; i++) store(a, w, i, f->ids[cu[s] * L * k + i]);
            seqs[s] = a;
        }
        rp_routing_per_seq(r, w, L, k, seqs, f->n);
        break;
    }
    case 2: {
        const void **layers = own(f, (size_t)L * sizeof *layers);
        for (int32_t l = 0; l < L; l++) {
            void *a = own(f, (size_t)(T * k) * w);
            for (int64_t t = 0; t < T; t++)
                for (int32_t j = 0; j < k; j++) store(a, w, t * k + j, id_of(f, t, l, j));
            layers[l] = a;
        }
        rp_routing_per_layer(r, w, L, k, layers);
        break;
    }
    case 3: {
        void *a = own(f, (size_t)(T * L * k) * w);
        for (int64_t t = 0; t < T; t++)
            for (int32_t l = 0; l < L; l++)
                for (int32_t j = 0; j < k; j++) store(a, w, (t * k + j) * L + l, id_of(f, t, l, j));
        rp_routing_packed(r, w, L, k, a);
        r->layer_stride = 1, r->k_stride = L, r->token_stride = (int64_t)L * k;
        break;
    }
    default: {
        int64_t ts = (int64_t)L * k + 3;
        void *a = own(f, (size_t)(T * ts) * w);
        for (int64_t t = 0; t < T; t++) {
            for (int32_t l = 0; l < L; l++)
                for (int32_t j = 0; j < k; j++) store(a, w, t * ts + l * k + j, id_of(f, t, l, j));
            for (int p = 0; p < 3; p++) store(a, w, t * ts + L * k + p, 255); /* never read */
        }
        rp_routing_packed(r, w, L, k, a);
        r->token_stride = ts;
        break;
    }
    }
}

/* 1 when stats match a naive count of the fixture's ids exactly. */
static int matches_naive(const fixture *f, const rp_stats *st)
{
    const int64_t *cu = rp_batch_cu_seqlens(f->batch);
    uint32_t *want = calloc((size_t)f->experts, sizeof *want), *got = calloc((size_t)f->experts, sizeof *got);
    int64_t *load = calloc((size_t)f->layers * f->experts, sizeof *load);
    int good = rp_stats_num_seqs(st) == f->n && rp_stats_num_layers(st) == f->layers &&
               rp_stats_num_experts(st) == f->experts;
    for (int32_t s = 0; s < f->n && good; s++)
        for (int32_t l = 0; l < f->layers && good; l++) {
            memset(want, 0, (size_t)f->experts * sizeof *want);
            for (int64_t t = cu[s]; t < cu[s + 1]; t++)
                for (int32_t j = 0; j < f->k; j++) want[id_of(f, t, l, j)]++;
            rp_stats_seq_hist(st, s, l, got);
            for (int32_t e = 0; e < f->experts; e++) {
                load[(size_t)l * f->experts + e] += want[e];
                if (got[e] != want[e] || rp_stats_seq_count(st, s, l, e) != want[e]) good = 0;
            }
        }
    for (int32_t l = 0; l < f->layers && good; l++)
        if (memcmp(rp_stats_expert_load(st, l), load + (size_t)l * f->experts,
                   (size_t)f->experts * sizeof *load) != 0)
            good = 0;
    free(want), free(got), free(load);
    return good;
}

/* 1 when two statistics hold exactly the same numbers. */
static int same_stats(const rp_stats *a, const rp_stats *b)
{
    if (rp_stats_num_seqs(a) != rp_stats_num_seqs(b) || rp_stats_num_layers(a) != rp_stats_num_layers(b) ||
        rp_stats_num_experts(a) != rp_stats_num_experts(b) || rp_stats_bytes(a) != rp_stats_bytes(b))
        return 0;
    int32_t E = rp_stats_num_experts(a);
    uint32_t *ha = malloc((size_t)E * 4), *hb = malloc((size_t)E * 4);
    int good = 1;
    for (int32_t l = 0; l < rp_stats_num_layers(a); l++) {
        if (memcmp(rp_stats_expert_load(a, l), rp_stats_expert_load(b, l), (size_t)E * 8)) good = 0;
        for (int32_t s = 0; s < rp_stats_num_seqs(a); s++) {
            rp_stats_seq_hist(a, s, l, ha);
            rp_stats_seq_hist(b, s, l, hb);
            if (memcmp(ha, hb, (size_t)E * 4)) good = 0;
        }
    }
    free(ha), free(hb);
    return good;
}

static void test_by_hand(rp_context *ctx)
{
    /* 3 sequences of 2, 0 and 3 tokens; 2 layers, top-2, 4 experts */
    int32_t lens[3] = {2, 0, 3}, zero[3] = {0, 0, 0};
    rp_batch *b;
    rp_batch_new(ctx, 3, lens, zero, NULL, &b, NULL);
    const uint8_t ids[5 * 2 * 2] = {
        /* seq 0 */ 0, 1, /**/ 2, 3,    /* token 0: layer 0 {0,1}, layer 1 {2,3} */
                    0, 2, /**/ 2, 1,    /* token 1 */
        /* seq 2 */ 3, 3, /**/ 0, 1,    /* (a repeated id is counted twice) */
                    1, 3, /**/ 0, 2,
                    3, 0, /**/ 0, 3,
    };
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    rp_stats *st = NULL;
    rp_error err;
    is_int(rp_stats_compute(ctx, b, &r, 4, 1, &st, &err), RP_OK, "statistics of a tiny batch");
    uint32_t h[4];
    rp_stats_seq_hist(st, 0, 0, h);
    ok(h[0] == 2 && h[1] == 1 && h[2] == 1 && h[3] == 0, "sequence 0 layer 0: {2,1,1,0}");
    rp_stats_seq_hist(st, 0, 1, h);
    ok(h[0] == 0 && h[1] == 1 && h[2] == 2 && h[3] == 1, "sequence 0 layer 1: {0,1,2,1}");
    rp_stats_seq_hist(st, 1, 0, h);
    ok(h[0] == 0 && h[1] == 0 && h[2] == 0 && h[3] == 0, "empty sequence: all zero");
    rp_stats_seq_hist(st, 2, 0, h);
    ok(h[0] == 1 && h[1] == 1 && h[2] == 0 && h[3] == 4, "sequence 2 layer 0: {1,1,0,4}");
    rp_stats_seq_hist(st, 2, 1, h);
    ok(h[0] == 3 && h[1] == 1 && h[2] == 1 && h[3] == 1, "sequence 2 layer 1: {3,1,1,1}");
    const int64_t *l0 = rp_stats_expert_load(st, 0), *l1 = rp_stats_expert_load(st, 1);
    ok(l0[0] == 3 && l0[1] == 2 && l0[2] == 1 && l0[3] == 4, "layer 0 loads {3,2,1,4}");
    ok(l1[0] == 3 && l1[1] == 2 && l1[2] == 3 && l1[3] == 2, "layer 1 loads {3,2,3,2}");
    is_int(rp_stats_seq_count(st, 2, 0, 3), 4, "single count");
    is_int(rp_stats_seq_count(st, 7, 0, 3), 0, "count of a sequence out of range is 0");
    is_int(rp_stats_seq_count(st, 0, 0, 4), 0, "count of an expert out of range is 0");
    ok(rp_stats_expert_load(st, 2) == NULL && rp_stats_expert_load(st, -1) == NULL,
       "loads of a layer out of range: NULL");
    ok(rp_stats_bytes(st) > 0 && rp_stats_bytes(st) < 1024, "a tiny batch takes little memory (%zu bytes)",
       rp_stats_bytes(st));
    rp_stats_free(st);
    rp_stats_free(NULL);
    rp_batch_free(b);
}

static void test_layouts_and_widths(rp_context *ctx)
{
    int32_t lens[40];
    for (int i = 0; i < 40; i++) lens[i] = i % 9 == 4 ? 0 : (int32_t)rnd(60) + (i == 7 ? 300 : 0);
    fixture f;
    fixture_init(&f, ctx, 40, lens, 3, 2, 7);
    fixture_random(&f, 1);
    rp_stats *ref = NULL;
    int all_naive = 1, all_same = 1;
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    for (int v = 0; v < NUM_VIEWS; v++)
        for (int wi = 0; wi < 3; wi++) {
            rp_routing r;
            rp_error err;
            make_view(&f, v, widths[wi], &r);
            rp_stats *st = NULL;
            rp_status s = rp_stats_compute(ctx, f.batch, &r, f.experts, 2, &st, &err);
            if (s != RP_OK) {
                all_naive = all_same = 0;
                diag("%s width %d: %s", view_names[v], widths[wi], err.text);
                continue;
            }
            if (!matches_naive(&f, st)) {
                all_naive = 0;
                diag("%s width %d differs from the naive count", view_names[v], widths[wi]);
            }
            if (!ref) ref = st;
            else {
                if (!same_stats(ref, st)) all_same = 0;
                rp_stats_free(st);
            }
        }
    ok(all_naive, "every layout and width matches a naive count");
    ok(all_same, "every layout and width gives identical statistics");

    /* global loads of each layer sum to tokens * k */
    int sums = 1;
    for (int32_t l = 0; l < f.layers; l++) {
        int64_t sum = 0;
        for (int32_t e = 0; e < f.experts; e++) sum += rp_stats_expert_load(ref, l)[e];
        if (sum != f.tokens * f.k) sums = 0;
    }
    ok(sums, "each layer's global loads sum to tokens x k (%lld)", (long long)(f.tokens * f.k));
    rp_stats_free(ref);
    fixture_free(&f);
}

static void test_threads(rp_context *ctx)
{
    int32_t lens[203];
    for (int i = 0; i < 203; i++) lens[i] = i % 17 == 3 ? 0 : (int32_t)rnd(400);
    lens[100] = 5000; /* one long sequence: the split is by tokens */
    fixture f;
    fixture_init(&f, ctx, 203, lens, 4, 3, 16);
    fixture_random(&f, 1);
    const int32_t counts[6] = {1, 2, 3, 7, 0, 1000};
    int same = 1, naive = 1;
    for (int v = 0; v < NUM_VIEWS; v += 2) { /* packed, per-layer, padded */
        rp_routing r;
        make_view(&f, v, v == 2 ? RP_ID_I32 : RP_ID_U16, &r);
        rp_stats *first = NULL;
        for (int i = 0; i < 6; i++) {
            rp_stats *st = NULL;
            if (rp_stats_compute(ctx, f.batch, &r, f.experts, counts[i], &st, NULL) != RP_OK) {
                same = 0;
                continue;
            }
            if (!first) {
                first = st;
                naive &= matches_naive(&f, st);
            } else {
                same &= same_stats(first, st);
                rp_stats_free(st);
            }
        }
        rp_stats_free(first);
    }
    ok(naive, "203 sequences match the naive count");
    ok(same, "1, 2, 3, 7, automatic and 1000 threads give bit-identical statistics");
    fixture_free(&f);
}

/* A batch whose counts need every stored width, 2 layers, top-3 of 16 experts:
 * seq 0: 10 tokens (width 1); seq 1: 300 tokens all on expert 1 (width 2); seq 2: empty;
 * seq 3: 70000 tokens all on expert 2 at layer 0 (width 4); seq 4: 30000 tokens spread
 * (staged at 4 bytes, stored at 2); seq 5: 100 tokens x top-3 (staged 2, stored 1). */
static void fixture_widths(fixture *f, rp_context *ctx)
{
    int32_t lens[6] = {10, 300, 0, 70000, 30000, 100};
    fixture_init(f, ctx, 6, lens, 2, 3, 16);
    const int64_t *cu = rp_batch_cu_seqlens(f->batch);
    for (int64_t t = 0; t < f->tokens; t++)
        for (int32_t l = 0; l < 2; l++)
            for (int32_t j = 0; j < 3; j++) {
                int32_t id = (int32_t)((t * 7 + l * 3 + j * 5) % 16);
                if (t >= cu[1] && t < cu[2] && j == 0) id = 1;
                if (t >= cu[3] && t < cu[4] && l == 0) id = 2;
                f->ids[(t * 2 + l) * 3 + j] = id;
            }
}

static void test_compact_widths(rp_context *ctx)
{
    fixture f;
    fixture_widths(&f, ctx);
    rp_routing r;
    make_view(&f, 0, RP_ID_U8, &r);
    rp_stats *st = NULL;
    is_int(rp_stats_compute(ctx, f.batch, &r, 16, 3, &st, NULL), RP_OK, "statistics with every width");
    ok(matches_naive(&f, st), "every compact width decodes exactly");
    ok(rp_stats_seq_count(st, 1, 0, 1) > 255, "count above 255 kept (%u)", rp_stats_seq_count(st, 1, 0, 1));
    is_int(rp_stats_seq_count(st, 3, 0, 2), 210000, "count above 65535 kept exactly (70000 x 3)");
    size_t cells = 2 * 16;
    /* the histograms take 1 + 2 + 0 + 4 + 2 + 1 bytes per cell */
    size_t fixed = rp_stats_bytes(st) - cells * 10;
    rp_stats_free(st);

    /* the same batch with the heavy sequences shortened: all widths 1 except the empty one */
    int32_t small[6] = {10, 20, 0, 20, 20, 10};
    fixture g;
    fixture_init(&g, ctx, 6, small, 2, 3, 16);
    fixture_random(&g, 0);
    make_view(&g, 0, RP_ID_U8, &r);
    is_int(rp_stats_compute(ctx, g.batch, &r, 16, 1, &st, NULL), RP_OK, "small counts");
    is_int(rp_stats_bytes(st), fixed + cells * 5, "widths are 1, 2 or 4 bytes per count as needed, 0 for an empty sequence");
    rp_stats_free(st);
    fixture_free(&g);
    fixture_free(&f);
}

/* An odd number of cells (1 layer x 3 experts) puts the 2- and 4-byte counts that follow
 * a 1-byte sequence at odd offsets: they must read and add up as any other (found by
 * tests/fuzz/fuzz_routing: the stores and loads were misaligned, undefined behaviour
 * that UBSan reports). seq 0: 5 tokens (width 1, 3 bytes); seq 1: 300 tokens on expert 0
 * (width 2 at offset 3); seq 2: 70000 tokens on expert 1 (width 4 at offset 9). */
static void test_odd_cells(rp_context *ctx)
{
    int32_t lens[3] = {5, 300, 70000};
    fixture f;
    fixture_init(&f, ctx, 3, lens, 1, 1, 3);
    const int64_t *cu = rp_batch_cu_seqlens(f.batch);
    for (int64_t t = 0; t < f.tokens; t++) f.ids[t] = t < cu[1] ? (int32_t)(t % 3) : t < cu[2] ? 0 : 1;
    rp_routing r;
    make_view(&f, 0, RP_ID_U8, &r);
    rp_stats *st = NULL;
    is_int(rp_stats_compute(ctx, f.batch, &r, 3, 1, &st, NULL), RP_OK, "statistics with 3 cells a sequence");
    ok(matches_naive(&f, st), "counts at odd offsets decode exactly");
    is_int(rp_stats_seq_count(st, 1, 0, 0), 300, "a 2-byte count after 3 bytes of 1-byte counts");
    is_int(rp_stats_seq_count(st, 2, 0, 1), 70000, "a 4-byte count after 3 + 6 bytes");
    int32_t mb[3] = {0, 0, 1};
    int64_t loads[2 * 3];
    is_int(rp_stats_microbatch_loads(st, mb, 2, loads, NULL), RP_OK, "microbatch loads over odd offsets");
    ok(loads[0] == 2 + 300 && loads[1] == 2 && loads[2] == 1 && loads[3] == 0 && loads[4] == 70000 && loads[5] == 0,
       "microbatch loads add the odd-offset counts (%lld %lld %lld | %lld %lld %lld)", (long long)loads[0],
       (long long)loads[1], (long long)loads[2], (long long)loads[3], (long long)loads[4], (long long)loads[5]);
    rp_stats_free(st);
    fixture_free(&f);
}

/* ---- statistics from dense counts (the GPU path's constructor) ---------------- */

/* Naive dense counts of the fixture, in rp_gpu_routing_histograms' layout:
 * hist[(s * layers + l) * experts + e] and load[l * experts + e]. */
static void dense_counts(const fixture *f, uint32_t **hist, int64_t **load)
{
    const int64_t *cu = rp_batch_cu_seqlens(f->batch);
    const size_t cells = (size_t)f->layers * f->experts;
    *hist = calloc((size_t)f->n * cells + 1, sizeof **hist);
    *load = calloc(cells, sizeof **load);
    for (int32_t s = 0; s < f->n; s++)
        for (int64_t t = cu[s]; t < cu[s + 1]; t++)
            for (int32_t l = 0; l < f->layers; l++)
                for (int32_t j = 0; j < f->k; j++) {
                    const size_t c = (size_t)l * f->experts + (size_t)id_of(f, t, l, j);
                    (*hist)[(size_t)s * cells + c]++;
                    (*load)[c]++;
                }
}

/* Build statistics from the fixture's dense counts and from a scan of its packed u8/u16
 * view; 1 when both are the same in every field (stats_same) and through the API. */
static int from_counts_matches_scan(rp_context *ctx, const char *name, fixture *f, rp_id_width w)
{
    uint32_t *hist;
    int64_t *load;
    dense_counts(f, &hist, &load);
    rp_routing r;
    make_view(f, 0, w, &r);
    rp_stats *scan = NULL, *dense = NULL;
    rp_error err;
    int good = rp_stats_compute(ctx, f->batch, &r, f->experts, 2, &scan, &err) == RP_OK;
    if (!good) diag("%s: scan: %s", name, err.text);
    if (good && stats_from_counts(ctx, f->n, f->layers, f->experts, f->k, f->tokens, hist, load,
                                  &dense, &err) != RP_OK) {
        diag("%s: from counts: %s", name, err.text);
        good = 0;
    }
    if (good && !stats_same(scan, dense)) diag("%s: fields differ", name), good = 0;
    if (good && !same_stats(scan, dense)) diag("%s: accessors differ", name), good = 0;
    if (good && !matches_naive(f, dense)) diag("%s: differs from the naive count", name), good = 0;
    rp_stats_free(scan);
    rp_stats_free(dense);
    free(hist), free(load);
    return good;
}

static void test_from_counts(rp_context *ctx)
{
    /* every stored width: 1, 2, 4, and 0 for an empty sequence */
    fixture f;
    fixture_widths(&f, ctx);
    ok(from_counts_matches_scan(ctx, "every width", &f, RP_ID_U8),
       "from dense counts: every width, offset, count, load and size equal the scan's");

    /* a difference in one count is seen: the comparison can fail */
    uint32_t *hist;
    int64_t *load;
    dense_counts(&f, &hist, &load);
    rp_routing r;
    make_view(&f, 0, RP_ID_U8, &r);
    rp_stats *scan = NULL, *dense = NULL;
    rp_stats_compute(ctx, f.batch, &r, 16, 1, &scan, NULL);
    hist[(size_t)5 * 32 + 7] += 1; /* sequence 5, layer 0, expert 7 */
    load[7] += 1;
    is_int(stats_from_counts(ctx, 6, 2, 16, 3, f.tokens, hist, load, &dense, NULL), RP_OK,
           "from dense counts: a changed count");
    ok(!stats_same(scan, dense), "from dense counts: one changed count makes the statistics differ");
    rp_stats_free(dense);
    /* a count past 255 in an otherwise width-1 sequence widens it to 2 bytes */
    hist[(size_t)5 * 32 + 7] = 300;
    is_int(stats_from_counts(ctx, 6, 2, 16, 3, f.tokens, hist, load, &dense, NULL), RP_OK,
           "from dense counts: a count of 300");
    is_int(rp_stats_seq_count(dense, 5, 0, 7), 300, "from dense counts: widened sequence keeps 300");
    is_int(rp_stats_bytes(dense), rp_stats_bytes(scan) + 32, "from dense counts: its width is 2 bytes");
    rp_stats_free(dense);
    rp_stats_free(scan);
    free(hist), free(load);
    fixture_free(&f);

    /* random routing, many short and empty sequences, u16 ids */
    int32_t many[57];
    for (int i = 0; i < 57; i++) many[i] = i % 5 == 2 ? 0 : (int32_t)rnd(90);
    fixture g;
    fixture_init(&g, ctx, 57, many, 4, 2, 300);
    fixture_random(&g, 1);
    ok(from_counts_matches_scan(ctx, "random", &g, RP_ID_U16),
       "from dense counts: random routing of 57 sequences equals the scan");
    fixture_free(&g);

    /* no sequences; and only empty sequences */
    fixture h;
    fixture_init(&h, ctx, 0, NULL, 3, 2, 5);
    ok(from_counts_matches_scan(ctx, "empty batch", &h, RP_ID_U8), "from dense counts: an empty batch");
    fixture_free(&h);
    int32_t zeros[3] = {0, 0, 0};
    fixture_init(&h, ctx, 3, zeros, 3, 2, 5);
    ok(from_counts_matches_scan(ctx, "empty sequences", &h, RP_ID_U8),
       "from dense counts: only empty sequences");
    fixture_free(&h);

    rp_error err;
    is_int(stats_from_counts(ctx, -1, 2, 4, 1, 0, NULL, NULL, &dense, &err), RP_EINVAL,
           "from dense counts: a negative sequence count is rejected");

    /* every allocation fails cleanly and leaks nothing */
    int32_t few[4] = {3, 0, 5, 2};
    fixture_init(&h, ctx, 4, few, 2, 2, 4);
    fixture_random(&h, 0);
    dense_counts(&h, &hist, &load);
    int cleanly = 1, tried = 0;
    for (long n = 1; n < 20; n++) {
        counting c = {0};
        rp_context *fctx;
        rp_context_new(counting_alloc, &c, &fctx);
        c.fail_at = n + 1; /* the context took call 1 */
        dense = NULL;
        rp_status s = stats_from_counts(fctx, 4, 2, 4, 2, h.tokens, hist, load, &dense, NULL);
        if (s == RP_OK) rp_stats_free(dense);
        else if (s != RP_ENOMEM || dense != NULL) cleanly = 0;
        int all_tried = c.fail_at > c.calls;
        rp_context_free(fctx);
        if (c.live != 0) cleanly = 0;
        if (all_tried) break;
        tried++;
    }
    ok(tried >= 4 && cleanly, "from dense counts: each of %d allocations fails cleanly, leaking nothing",
       tried);
    free(hist), free(load);
    fixture_free(&h);
}

static void test_microbatches(rp_context *ctx)
{
    int32_t lens[30];
    for (int i = 0; i < 30; i++) lens[i] = (int32_t)rnd(50);
    fixture f;
    fixture_init(&f, ctx, 30, lens, 2, 2, 8);
    fixture_random(&f, 1);
    rp_routing r;
    make_view(&f, 0, RP_ID_U8, &r);
    rp_stats *st = NULL;
    rp_stats_compute(ctx, f.batch, &r, 8, 2, &st, NULL);
    int32_t map[30];
    for (int i = 0; i < 30; i++) map[i] = i % 7 == 0 ? -1 : (int32_t)rnd(5);
    int64_t loads[5 * 2 * 8], want[5 * 2 * 8] = {0};
    uint32_t h[8];
    for (int32_t s = 0; s < 30; s++) {
        if (map[s] < 0) continue;
        for (int32_t l = 0; l < 2; l++) {
            rp_stats_seq_hist(st, s, l, h);
            for (int e = 0; e < 8; e++) want[(map[s] * 2 + l) * 8 + e] += h[e];
        }
    }
    rp_error err;
    is_int(rp_stats_microbatch_loads(st, map, 5, loads, &err), RP_OK, "microbatch loads");
    ok(!memcmp(loads, want, sizeof want), "microbatch loads are the sums of their sequences' histograms");

    int64_t before[5 * 2 * 8];
    memcpy(before, loads, sizeof loads);
    map[12] = 5;
    is_int(rp_stats_microbatch_loads(st, map, 5, loads, &err), RP_EINVAL, "microbatch id past the end");
    like(err.text, "sequence 12 is in microbatch 5, but there are 5 microbatches", "names sequence and id");
    is_int(err.sequence, 12, "error carries the sequence");
    ok(!memcmp(loads, before, sizeof loads), "loads untouched on error");
    map[12] = -2;
    is_int(rp_stats_microbatch_loads(st, map, 5, loads, &err), RP_EINVAL, "microbatch id -2 rejected");
    for (int i = 0; i < 30; i++) map[i] = -1;
    is_int(rp_stats_microbatch_loads(st, map, 0, NULL, &err), RP_OK, "nothing packed, no microbatches");
    is_int(rp_stats_microbatch_loads(st, map, -1, loads, &err), RP_EINVAL, "negative microbatch count");
    rp_stats_free(st);
    fixture_free(&f);
}

/* Loads over several accumulator blocks (L * E > 4096 cells), with counts of every width:
 * two sequences whose layer-0 counts need 4 bytes share a microbatch (the accumulator
 * is flushed between them), sequences of 2-byte and 1-byte counts and empty ones. */
static void test_microbatch_blocks(rp_context *ctx)
{
    enum { N = 12, L = 2, E = 2100, M = 3 };
    int32_t lens[N] = {70000, 70001, 300, 0, 5, 1000, 257, 1, 0, 4000, 33, 70};
    fixture f;
    fixture_init(&f, ctx, N, lens, L, 1, E);
    fixture_random(&f, 1);
    for (int64_t t = 0; t < 140001; t++) f.ids[t * L] = E - 1; /* sequences 0 and 1, layer 0 */
    rp_routing r;
    make_view(&f, 0, RP_ID_U16, &r);
    rp_stats *st = NULL;
    is_int(rp_stats_compute(ctx, f.batch, &r, E, 1, &st, NULL), RP_OK, "statistics of mixed widths");
    int32_t map[N] = {1, 1, 0, 2, 1, 0, -1, 2, 0, 1, 2, 0};
    int64_t *loads = calloc((size_t)M * L * E, sizeof *loads), *want = calloc((size_t)M * L * E, sizeof *want);
    uint32_t *h = calloc(E, sizeof *h);
    for (int32_t s = 0; s < N; s++) {
        if (map[s] < 0) continue;
        for (int32_t l = 0; l < L; l++) {
            rp_stats_seq_hist(st, s, l, h);
            for (int e = 0; e < E; e++) want[((size_t)map[s] * L + l) * E + e] += h[e];
        }
    }
    rp_error err;
    is_int(rp_stats_microbatch_loads(st, map, M, loads, &err), RP_OK, "loads over several blocks");
    ok(!memcmp(loads, want, (size_t)M * L * E * sizeof *loads), "equal the sums of the histograms, every width");
    is_int((int)loads[(size_t)1 * L * E + E - 1], 140001, "two 4-byte counts add up in one microbatch");
    free(h);
    free(want);
    free(loads);
    rp_stats_free(st);
    fixture_free(&f);
}

/* The 32-bit partial loads of 1- and 2-byte counts (core/stats.c) must not wrap: 65597
 * narrow sequences, almost all of counts 65535, sum to 4,298,838,725 > 2^32 in one
 * microbatch (a partial load flushed only at the end would give 3,871,429). 20 experts:
 * one vectorised chunk of 16 and a scalar tail. Then the same loads with every allocation after the
 * context's failing: the plain pass gives them, nothing leaks. */
static void test_microbatch_wrap(rp_context *ctx)
{
    enum { N = 65600, L = 1, E = 20, M = 2 };
    uint32_t *counts = malloc(sizeof *counts * (size_t)N * L * E);
    int64_t load[L * E];
    int32_t *map = malloc(sizeof *map * N);
    int64_t tokens = 0;
    for (int32_t s = 0; s < N; s++) {
        /* two sequences of 1-byte counts and one of 4-byte counts among them */
        uint32_t v = s == 5 || s == 70 ? 200 : s == 9 ? 70000 : 65535;
        for (int e = 0; e < E; e++) counts[(size_t)s * E + e] = v;
        tokens += v;
        map[s] = s == 3 ? 0 : s == 4 ? -1 : 1;
    }
    int64_t want1 = 0;
    for (int32_t s = 0; s < N; s++)
        if (map[s] == 1) want1 += counts[(size_t)s * E];
    for (int e = 0; e < E; e++) load[e] = 0;
    for (int32_t s = 0; s < N; s++)
        for (int e = 0; e < E; e++) load[e] += counts[(size_t)s * E + e];
    rp_stats *st = NULL;
    rp_error err;
    is_int(stats_from_counts(ctx, N, L, E, E, tokens, counts, load, &st, &err), RP_OK, "statistics of 65600 full sequences");
    int64_t loads[M * E];
    is_int(rp_stats_microbatch_loads(st, map, M, loads, &err), RP_OK, "microbatch loads past 2^32");
    int good = 1;
    for (int e = 0; e < E; e++) good &= loads[e] == 65535 && loads[E + e] == want1;
    ok(good, "no 32-bit sum wraps: %lld in every cell of microbatch 1 (want %lld)", (long long)loads[E + E - 1],
       (long long)want1);

    counting c = {0};
    rp_context *failing;
    rp_context_new(counting_alloc, &c, &failing);
    rp_stats *copy = NULL;
    is_int(stats_from_counts(failing, N, L, E, E, tokens, counts, load, &copy, &err), RP_OK, "the same statistics");
    c.fail_at = c.calls + 1; /* every allocation from here fails */
    int64_t again[M * E];
    is_int(rp_stats_microbatch_loads(copy, map, M, again, &err), RP_OK, "loads without memory for partial sums");
    ok(!memcmp(again, loads, sizeof loads), "the plain pass gives the same loads");
    rp_stats_free(copy);
    rp_context_free(failing);
    is_int((int)c.live, 0, "nothing leaks");
    rp_stats_free(st);
    free(map);
    free(counts);
}

static void test_loads_per_gpu(void)
{
    /* 3 experts, 6 slots on 3 GPUs: expert 0 x3, expert 1 x2, expert 2 x1 */
    const int64_t load[3] = {10, 7, 4};
    const int32_t phy2log[6] = {0, 1, 0, 2, 0, 1};
    const int32_t begin[4] = {0, 2, 4, 6};
    int64_t gpu[3] = {-1, -1, -1};
    rp_error err;
    is_int(rp_loads_per_gpu(load, 3, phy2log, begin, 3, gpu, &err), RP_OK, "per-GPU loads");
    /* expert 0: 10 = 4 + 3 + 3 (slots 0, 2, 4); expert 1: 7 = 4 + 3 (slots 1, 5); expert 2: 4 */
    ok(gpu[0] == 8 && gpu[1] == 7 && gpu[2] == 6, "remainder to the first replicas in slot order: {8, 7, 6}, got {%lld, %lld, %lld}",
       (long long)gpu[0], (long long)gpu[1], (long long)gpu[2]);

    const int32_t begin_empty[4] = {0, 3, 3, 6}; /* GPU 1 holds no slot */
    is_int(rp_loads_per_gpu(load, 3, phy2log, begin_empty, 3, gpu, &err), RP_OK, "a GPU with no slots");
    ok(gpu[0] == 4 + 4 + 3 && gpu[1] == 0 && gpu[2] == 4 + 3 + 3, "its load is 0");

    int64_t before[3];
    memcpy(before, gpu, sizeof gpu);
    const int32_t missing[6] = {0, 1, 0, 1, 0, 1};
    is_int(rp_loads_per_gpu(load, 3, missing, begin, 3, gpu, &err), RP_EINVAL, "expert with no replica");
    like(err.text, "expert 2 has no replica", "names the expert");
    is_int(err.expert, 2, "error carries the expert");
    const int32_t bad_id[6] = {0, 1, 0, 2, 3, 1};
    is_int(rp_loads_per_gpu(load, 3, bad_id, begin, 3, gpu, &err), RP_ERANGE, "slot with an expert id out of range");
    like(err.text, "slot 4 holds expert id 3, but there are 3 experts", "names slot and id");
    const int32_t neg_id[6] = {0, 1, -1, 2, 0, 1};
    is_int(rp_loads_per_gpu(load, 3, neg_id, begin, 3, gpu, &err), RP_ERANGE, "negative expert id");
    const int32_t backwards[4] = {0, 4, 2, 6};
    is_int(rp_loads_per_gpu(load, 3, phy2log, backwards, 3, gpu, &err), RP_EINVAL, "slot ranges running backwards");
    const int32_t offset[4] = {1, 2, 4, 6};
    is_int(rp_loads_per_gpu(load, 3, phy2log, offset, 3, gpu, &err), RP_EINVAL, "slots not starting at 0");
    const int64_t negative[3] = {10, -7, 4};
    is_int(rp_loads_per_gpu(negative, 3, phy2log, begin, 3, gpu, &err), RP_EINVAL, "negative load");
    is_int(rp_loads_per_gpu(load, 3, phy2log, begin, 0, gpu, &err), RP_EINVAL, "no GPUs");
    ok(!memcmp(gpu, before, sizeof gpu), "GPU loads untouched by every error");

    /* more experts than one window of the implementation: 3000 experts on 1000 GPUs,
     * expert e on GPU e % 1000, and expert 2999 replicated on every GPU's second slot */
    enum { E = 3000, G = 1000 };
    int64_t *big = malloc(E * sizeof *big), *out = malloc(G * sizeof *out);
    int32_t *p2l = malloc((E + G) * sizeof *p2l), *beg = malloc((G + 1) * sizeof *beg);
    int64_t total = 0;
    for (int e = 0; e < E; e++) big[e] = e, total += e;
    big[E - 1] = 1000 * 5 + 17; /* 5 each, 17 GPUs get 6 */
    total += big[E - 1] - (E - 1);
    int32_t p = 0;
    for (int g = 0; g < G; g++) {
        beg[g] = p;
        for (int e = g; e < E - 1; e += G) p2l[p++] = e;
        p2l[p++] = E - 1;
    }
    beg[G] = p;
    is_int(rp_loads_per_gpu(big, E, p2l, beg, G, out, &err), RP_OK, "3000 experts on 1000 GPUs");
    int64_t sum = 0;
    for (int g = 0; g < G; g++) sum += out[g];
    is_int(sum, total, "loads are conserved exactly");
    is_int(out[16] - (16 + 1016 + 2016), 6, "GPU 16 gets a remainder token");
    is_int(out[17] - (17 + 1017 + 2017), 5, "GPU 17 does not");
    free(big), free(out), free(p2l), free(beg);
}

static void test_skew(void)
{
    const int64_t even[4] = {3, 3, 3, 3};
    rp_skew k = rp_skew_of(even, 4);
    ok(k.cv == 0 && k.max_over_mean == 1 && k.min_over_mean == 1 && k.mean == 3, "even loads: cv 0, ratios 1");
    const int64_t one_hot[4] = {0, 0, 4, 0};
    k = rp_skew_of(one_hot, 4);
    is_double(k.cv, sqrt(3.0), 1e-12, "one hot expert: cv sqrt(3)");
    is_double(k.max_over_mean, 4, 1e-12, "max/mean 4");
    is_double(k.min_over_mean, 0, 1e-12, "min/mean 0");
    ok(k.max == 4 && k.argmax == 2, "max and argmax");
    const int64_t textbook[8] = {2, 4, 4, 4, 5, 5, 7, 9};
    k = rp_skew_of(textbook, 8);
    is_double(k.mean, 5, 1e-12, "mean 5");
    is_double(k.cv, 0.4, 1e-12, "population cv 2/5");
    is_double(k.max_over_mean, 1.8, 1e-12, "max/mean 9/5");
    is_int(k.argmax, 7, "argmax");
    const int64_t ties[3] = {5, 1, 5};
    is_int(rp_skew_of(ties, 3).argmax, 0, "argmax is the first of equal maxima");
    const int64_t zeros[3] = {0, 0, 0};
    k = rp_skew_of(zeros, 3);
    ok(k.cv == 0 && k.mean == 0 && k.max_over_mean == 1 && k.min_over_mean == 1, "all-zero vector: cv 0, even");
    k = rp_skew_of(zeros, 0);
    ok(k.argmax == -1 && k.mean == 0 && k.cv == 0, "empty vector");
    const int64_t huge[2] = {INT64_MAX / 2, INT64_MAX / 2};
    is_double(rp_skew_of(huge, 2).cv, 0, 1e-12, "huge equal loads do not overflow");
}

static void test_bad_ids(rp_context *ctx)
{
    int32_t lens[60];
    for (int i = 0; i < 60; i++) lens[i] = 20 + (int32_t)rnd(30);
    fixture f;
    fixture_init(&f, ctx, 60, lens, 3, 2, 10);
    fixture_random(&f, 0);
    const int64_t *cu = rp_batch_cu_seqlens(f.batch);
    /* bad ids in sequences 17 (layer 2, later token, and layer 1, token 4), 40 and 55 */
    f.ids[((cu[17] + 9) * 3 + 2) * 2 + 0] = 12;
    f.ids[((cu[17] + 4) * 3 + 1) * 2 + 1] = 10;
    f.ids[((cu[40] + 0) * 3 + 0) * 2 + 0] = 11;
    f.ids[((cu[55] + 3) * 3 + 1) * 2 + 1] = 200;
    const int32_t threads[4] = {1, 2, 3, 7};
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    int all = 1;
    char want[RP_ERROR_TEXT];
    for (int v = 0; v < NUM_VIEWS; v++)
        for (int wi = 0; wi < 3; wi++) {
            rp_routing r;
            make_view(&f, v, widths[wi], &r);
            rp_error check;
            rp_routing_check(&r, f.batch, 10, &check);
            snprintf(want, sizeof want, "%s", check.text);
            for (int i = 0; i < 4; i++) {
                rp_stats *st = NULL;
                rp_error err;
                rp_status s = rp_stats_compute(ctx, f.batch, &r, 10, threads[i], &st, &err);
                if (s != RP_ERANGE || st != NULL || err.sequence != 17 || err.expert != 10 ||
                    strcmp(err.text, want) != 0) {
                    all = 0;
                    diag("%s width %d threads %d: %s", view_names[v], widths[wi], threads[i], err.text);
                }
            }
        }
    ok(all, "the first bad id is reported at the lowest sequence for every layout, width and thread count");
    like(want, "sequence 17 token 4 layer 1 choice 1 has expert id 10, but the model has 10 experts",
         "as rp_routing_check reports it");

    /* negative int32 ids */
    f.ids[((cu[17] + 4) * 3 + 1) * 2 + 1] = 3;
    f.ids[((cu[17] + 9) * 3 + 2) * 2 + 0] = 3;
    f.ids[((cu[40] + 0) * 3 + 0) * 2 + 0] = -5;
    rp_routing r;
    make_view(&f, 0, RP_ID_I32, &r);
    rp_stats *st = NULL;
    rp_error err;
    is_int(rp_stats_compute(ctx, f.batch, &r, 10, 3, &st, &err), RP_ERANGE, "negative id rejected");
    like(err.text, "sequence 40 token 0 layer 0 choice 0 has expert id -5", "negative id position");
    /* 256 experts with uint8 ids: every id is valid */
    make_view(&f, 0, RP_ID_U8, &r);
    is_int(rp_stats_compute(ctx, f.batch, &r, 256, 2, &st, &err), RP_OK, "uint8 ids with 256 experts need no check");
    is_int(rp_stats_seq_count(st, 55, 1, 200), 1, "id 200 counted");
    rp_stats_free(st);
    fixture_free(&f);
}

/* The routing changes during the scan, between checking ids and counting them
 * (routing_scan_hook, where another thread could write them): the scan either counts
 * the ids as they were (dense views: a private snapshot of the block was checked and is
 * counted) or reports the changed one (strided views check each id where they count
 * it), never counts it. Before, a block was checked and then read again to count, and
 * the changed id indexed outside the histograms (an out-of-bounds write, and RP_OK
 * with one count missing). */
static void *changing_id;
static rp_id_width changing_width;
static int32_t changing_value;
static void change_routing(void)
{
    if (changing_id) store(changing_id, changing_width, 0, changing_value);
    changing_id = NULL; /* once */
}

static void test_changed_during_scan(rp_context *ctx)
{
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    const int32_t bad[3] = {255, 65535, 1000};
    const int32_t ks[2] = {2, 8};
    int all = 1, cases = 0;
    for (int ki = 0; ki < 2; ki++) {
        int32_t lens[1] = {5};
        fixture f;
        fixture_init(&f, ctx, 1, lens, 3, ks[ki], 10);
        fixture_random(&f, 0);
        for (int v = 0; v < NUM_VIEWS; v++)
            for (int wi = 0; wi < 3; wi++) {
                rp_routing r;
                make_view(&f, v, widths[wi], &r);
                /* the last id of the sequence: last token, layer and choice */
                const int64_t *cu = rp_batch_cu_seqlens(f.batch);
                const char *at = rp_routing_at(&r, cu, 0, f.layers - 1);
                changing_id = (void *)(at + ((lens[0] - 1) * r.token_stride + (f.k - 1) * r.k_stride) * widths[wi]);
                changing_width = widths[wi];
                changing_value = bad[wi];
                routing_scan_hook = change_routing;
                rp_stats *st = NULL;
                rp_error err;
                rp_status s = rp_stats_compute(ctx, f.batch, &r, 10, 1, &st, &err);
                routing_scan_hook = NULL;
                cases++;
                /* fixture ids still hold the values before the change */
                bool reported = s == RP_ERANGE && !st && strstr(err.text, "sequence 0");
                bool as_before = s == RP_OK && st && matches_naive(&f, st);
                if (!reported && !as_before) {
                    all = 0;
                    diag("top-%d %s width %d: status %d: %s", f.k, view_names[v], widths[wi], s, s ? err.text : "");
                }
                rp_stats_free(st);
            }
        fixture_free(&f);
    }
    ok(all, "an id changed to out of range during the scan is counted as it was or reported, never counted (%d "
       "layouts x widths)", cases);
}

/* The kernel for dense uint8 ids with top-k a multiple of 8 against the portable scan
 * (stats_portable_scan) and a naive count, over random batches, layouts, widths, top-k
 * and expert counts (1, 255, 256, 257, 65535 and more among them), with duplicate ids
 * within a token and, in a quarter of the cases, one id out of range: both scans must
 * give bit-identical statistics, or the same error word for word. */
static void test_kernel_matches_portable(rp_context *ctx)
{
    static const int32_t experts[] = {1, 2, 7, 8, 16, 100, 128, 255, 256, 257, 1000, 65535, 65536, 70000};
    static const int32_t ks[] = {1, 2, 3, 8, 16};
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    int trials = 0, kernel_cases = 0, kernel_bad = 0, agree = 1, naive = 1;
    for (int trial = 0; trial < 500; trial++) {
        int32_t E = experts[rnd(sizeof experts / sizeof *experts)];
        int32_t k = ks[rnd(sizeof ks / sizeof *ks)];
        if (k > E) k = E;
        rp_id_width w = widths[rnd(3)];
        int view = (int)rnd(NUM_VIEWS);
        /* half the cases in the kernel's view, width and top-k (where E allows) */
        if (rnd(2)) w = RP_ID_U8, k = E >= 16 && rnd(3) == 0 ? 16 : E >= 8 ? 8 : k, view = (int)rnd(2);
        int64_t cap = w == RP_ID_U8 ? 256 : w == RP_ID_U16 ? 65536 : INT32_MAX;
        int32_t top = (int32_t)(E < cap ? E : cap); /* ids drawn in [0, top) */
        int32_t L = E > 1000 ? 1 + (int32_t)rnd(2) : 1 + (int32_t)rnd(6);
        int32_t n = (int32_t)rnd(13), lens[13];
        for (int32_t s = 0; s < n; s++)
            lens[s] = rnd(5) == 0 ? 0 : rnd(8) == 0 ? 200 + (int32_t)rnd(300) : (int32_t)rnd(40);
        fixture f;
        fixture_init(&f, ctx, n, lens, L, k, E);
        for (int64_t i = 0; i < f.tokens * L * k; i++) /* a hot id repeats within tokens */
            f.ids[i] = rnd(3) == 0 ? (int32_t)(i / 5 % 3 % top) : (int32_t)rnd((uint32_t)top);
        /* an id out of range (where the width can hold one) at a random place */
        bool bad = f.tokens > 0 && E < cap && rnd(4) == 0;
        if (bad) {
            int64_t at = (int64_t)rnd((uint32_t)(f.tokens * L * k));
            f.ids[at] = E + (int32_t)rnd((uint32_t)(cap - E < 1000 ? cap - E : 1000));
        }
        rp_routing r;
        make_view(&f, view, w, &r);
        int32_t threads = 1 + (int32_t)rnd(3);
        rp_stats *fast = NULL, *portable = NULL;
        rp_error ef, ep;
        memset(&ef, 0, sizeof ef), memset(&ep, 0, sizeof ep);
        rp_status sf = rp_stats_compute(ctx, f.batch, &r, E, threads, &fast, &ef);
        stats_portable_scan = true;
        rp_status sp = rp_stats_compute(ctx, f.batch, &r, E, threads, &portable, &ep);
        stats_portable_scan = false;
        bool kernel = w == RP_ID_U8 && k % 8 == 0 && (view == 0 || view == 1);
        trials++;
        kernel_cases += kernel;
        kernel_bad += kernel && bad;
        if (sf != sp || (sf == RP_OK ? !stats_same(fast, portable) : strcmp(ef.text, ep.text) != 0)) {
            agree = 0;
            diag("trial %d: %d experts, top-%d, %d layers, %s width %d: status %d / %d: %s / %s", trial, E, k, L,
                 view_names[view], w, sf, sp, ef.text, ep.text);
        }
        if (sf == RP_OK && !bad && !matches_naive(&f, fast)) {
            naive = 0;
            diag("trial %d: %d experts, top-%d, %s width %d differs from the naive count", trial, E, k,
                 view_names[view], w);
        }
        if (bad && sf != RP_ERANGE) {
            agree = 0;
            diag("trial %d: an id out of range was not reported (status %d)", trial, sf);
        }
        rp_stats_free(fast);
        rp_stats_free(portable);
        fixture_free(&f);
    }
    ok(agree && naive, "%d random cases: the uint8 top-8k kernel and the portable scan agree bit for bit (or "
       "on the error), and match a naive count", trials);
    ok(kernel_cases >= 150 && kernel_bad >= 20, "%d of them took the kernel, %d with an id out of range",
       kernel_cases, kernel_bad);
}

static void test_edges(rp_context *ctx)
{
    rp_batch *b;
    rp_routing r;
    rp_stats *st = NULL;
    rp_error err;
    rp_batch_new(ctx, 0, NULL, NULL, NULL, &b, NULL);
    rp_routing_packed(&r, RP_ID_U8, 4, 2, NULL);
    is_int(rp_stats_compute(ctx, b, &r, 8, 0, &st, &err), RP_OK, "empty batch");
    is_int(rp_stats_num_seqs(st), 0, "no sequences");
    ok(rp_stats_expert_load(st, 3)[7] == 0, "loads all zero");
    int32_t map[1];
    is_int(rp_stats_microbatch_loads(st, map, 0, NULL, &err), RP_OK, "microbatch loads of an empty batch");
    rp_stats_free(st);
    rp_batch_free(b);

    int32_t zero[5] = {0, 0, 0, 0, 0};
    rp_batch_new(ctx, 5, zero, zero, NULL, &b, NULL);
    const void *none[5] = {NULL, NULL, NULL, NULL, NULL};
    rp_routing_per_seq(&r, RP_ID_U16, 2, 2, none, 5);
    is_int(rp_stats_compute(ctx, b, &r, 4, 3, &st, &err), RP_OK, "only empty sequences");
    uint32_t h[4] = {9, 9, 9, 9};
    rp_stats_seq_hist(st, 4, 1, h);
    ok(h[0] == 0 && h[3] == 0, "their histograms are zero");
    rp_stats_free(st);
    rp_batch_free(b);

    int32_t one[1] = {1}, big[1] = {INT32_MAX};
    st = NULL;
    uint8_t ids[4] = {1, 0, 3, 3};
    rp_batch_new(ctx, 1, one, zero, NULL, &b, NULL);
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    is_int(rp_stats_compute(ctx, b, &r, 1, 1, &st, &err), RP_EINVAL, "top-k above the expert count rejected");
    r.width = (rp_id_width)3;
    is_int(rp_stats_compute(ctx, b, &r, 4, 1, &st, &err), RP_EINVAL, "bad id width rejected");
    ok(st == NULL, "nothing returned on error");
    rp_batch_free(b);
    /* a sequence whose counts could pass 2^32: rejected before any id is read */
    rp_batch_new(ctx, 1, big, zero, NULL, &b, NULL);
    rp_routing_packed(&r, RP_ID_U8, 1, 3, ids);
    is_int(rp_stats_compute(ctx, b, &r, 4, 1, &st, &err), RP_ERANGE, "counts beyond 32 bits rejected");
    like(err.text, "sequence 0 has 2147483647 tokens x top-3 choices", "names the sequence");
    r.token_stride = INT64_MAX / 2;
    is_int(rp_stats_compute(ctx, b, &r, 4, 1, &st, &err), RP_ERANGE, "overflowing strides rejected");
    rp_batch_free(b);
}

static void test_alloc_failures(void)
{
    int32_t lens[12] = {5, 0, 90, 3, 200, 1, 0, 17, 44, 300, 2, 9};
    int cleanly = 1, exact = 1, tried = 0;
    rp_context *plain;
    rp_context_new(NULL, NULL, &plain);
    fixture f;
    fixture_init(&f, plain, 12, lens, 3, 2, 6);
    fixture_random(&f, 0);
    rp_routing r;
    make_view(&f, 0, RP_ID_U16, &r);
    for (long n = 1; n < 40; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        c.fail_at = n + 1; /* the context took call 1 */
        rp_stats *st = NULL;
        rp_status s = rp_stats_compute(ctx, f.batch, &r, 6, 3, &st, NULL);
        if (s == RP_OK) {
            if (!matches_naive(&f, st)) exact = 0;
            rp_stats_free(st);
        } else if (s != RP_ENOMEM || st != NULL) {
            cleanly = 0;
        }
        int all_tried = c.fail_at > c.calls; /* no allocation failed: every one was tried */
        rp_context_free(ctx);
        if (c.live != 0) cleanly = 0;
        if (all_tried) break;
        tried++;
    }
    ok(tried >= 5, "failed each of the %d allocations in turn", tried);
    ok(cleanly, "statistics fail cleanly at every allocation and leak nothing");
    ok(exact, "a failed shrink still gives exact statistics");
    fixture_free(&f);
    rp_context_free(plain);
}

/* ---- routepack stats ------------------------------------------------------- */

static char cli_out[1 << 17];

/* Run `routepack ARGS` (stderr joined) into cli_out; its exit status. */
#define run_cli(...) run_routepack(cli_out, sizeof cli_out, __VA_ARGS__)

static void test_cli(rp_context *ctx)
{
    char bin[1024];
    snprintf(bin, sizeof bin, "%s/routepack", RP_BINARY_DIR);
    if (access(bin, X_OK) != 0) {
        skip(12, "the routepack tool is not built");
        return;
    }
    char dir[64], path[128];
    if (!temp_dir_make(dir, sizeof dir, "stats")) {
        skip(12, "no temporary directory");
        return;
    }
    snprintf(path, sizeof path, "%s/two.rpt", dir);
    /* two steps of 30 sequences, 3 layers, top-2, 8 experts; step 1 differs */
    int32_t lens[30];
    for (int i = 0; i < 30; i++) lens[i] = i == 4 ? 0 : 1 + (int32_t)rnd(40);
    fixture f[2];
    rp_trace_writer *w = NULL;
    rp_error err;
    rp_trace_writer_open(ctx, path, 8, &w, &err);
    for (int step = 0; step < 2; step++) {
        rp_routing r;
        fixture_init(&f[step], ctx, 30, lens, 3, 2, 8);
        fixture_random(&f[step], step);
        make_view(&f[step], 0, RP_ID_U8, &r);
        if (w && rp_trace_writer_append(w, 10 + step, f[step].batch, &r, &err) != RP_OK) diag("%s", err.text);
    }
    is_int(w ? rp_trace_writer_close(w, &err) : RP_EIO, RP_OK, "a two-step trace for the stats command");

    is_int(run_cli("stats '%s' --step 1 --threads 2", path), 0, "stats of step 1");
    like(cli_out, "step 1 (of 2, counted from 0; recorded as step 11): 30 sequences", "names the step and shape");
    like(cli_out, "seq top share", "prints the per-sequence specialization");
    like(cli_out, "all layers: mean cv", "prints a summary");

    is_int(run_cli("stats '%s' --step 1 --json", path), 0, "stats as JSON");
    json_error_t jerr;
    json_t *root = json_loads(cli_out, 0, &jerr);
    rp_stats *st = NULL;
    rp_routing r;
    make_view(&f[1], 0, RP_ID_U8, &r);
    rp_stats_compute(ctx, f[1].batch, &r, 8, 1, &st, NULL);
    int same = root && st && json_array_size(json_object_get(root, "layers")) == 3;
    for (int32_t l = 0; same && l < 3; l++) {
        json_t *layer = json_array_get(json_object_get(root, "layers"), (size_t)l);
        json_t *loads = json_object_get(layer, "expert_load");
        rp_skew k = rp_skew_of(rp_stats_expert_load(st, l), 8);
        same = json_array_size(loads) == 8 &&
               fabs(json_real_value(json_object_get(layer, "cv")) - k.cv) < 1e-5 &&
               json_integer_value(json_object_get(layer, "hottest_expert")) == k.argmax;
        for (int e = 0; same && e < 8; e++)
            same = json_integer_value(json_array_get(loads, (size_t)e)) == rp_stats_expert_load(st, l)[e];
    }
    ok(same, "JSON holds every layer's full expert loads and skew, as the library computes them");
    ok(root && json_integer_value(json_object_get(root, "stats_bytes")) == (json_int_t)rp_stats_bytes(st),
       "JSON gives the statistics' memory");
    json_decref(root);
    rp_stats_free(st);

    is_int(run_cli("stats '%s' --step 2", path), 2, "a step that does not exist is a usage error");
    like(cli_out, "has 2 steps (0 to 1), --step 2 does not exist", "says which steps exist");
    is_int(run_cli("stats '%s/missing.rpt'", dir), 1, "a missing trace fails");
    is_int(run_cli("stats '%s' --threads many", path), 2, "a bad thread count is a usage error");
    fixture_free(&f[0]);
    fixture_free(&f[1]);
    unlink(path);
    temp_dir_remove(dir);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_by_hand(ctx);
    test_layouts_and_widths(ctx);
    test_threads(ctx);
    test_compact_widths(ctx);
    test_odd_cells(ctx);
    test_from_counts(ctx);
    test_microbatches(ctx);
    test_microbatch_blocks(ctx);
    test_microbatch_wrap(ctx);
    test_loads_per_gpu();
    test_skew();
    test_bad_ids(ctx);
    test_changed_during_scan(ctx);
    test_kernel_matches_portable(ctx);
    test_edges(ctx);
    test_alloc_failures();
    test_cli(ctx);
    rp_context_free(ctx);
    return tap_done();
}
