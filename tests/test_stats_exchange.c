/* Statistics between ranks (core/stats_exchange.c): the serialised form round-trips
 * bit for bit; random batches split over 2-4 simulated ranks with shuffled global ids
 * merge into exactly rp_stats_compute over the whole batch (from statistics and from
 * bytes; counts of 2 bytes in rows on 16-byte boundaries or not); every truncation and every flipped byte is refused; crafted bad payloads
 * with a valid checksum are refused with the right error; missing, duplicate and
 * out-of-range ids are named; allocation failures fail cleanly; rp_stats_check_batch. */
#include "internal.h"
#include "stats_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>

static uint64_t rng_state = 0xD1B54A32D192ED03ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)((xorshift64(&rng_state) >> 11) % n); }

/* A batch and its routing ids [tokens][layers][k] int32. */
typedef struct world {
    int32_t n, layers, k, experts;
    int32_t *lens;
    int64_t *cu;
    int32_t *ids;
    rp_batch *batch;
} world;

/* n random sequences; lengths 0 .. 40, with one long sequence routed to expert 0 at
 * every choice when `wide` (a count above 65535: width 4), and one of 300 tokens (width
 * 2 when skewed). */
static void world_make(world *w, rp_context *ctx, int32_t n, int32_t layers, int32_t k, int32_t experts, int wide)
{
    memset(w, 0, sizeof *w);
    w->n = n, w->layers = layers, w->k = k, w->experts = experts;
    w->lens = calloc((size_t)n + 1, sizeof *w->lens);
    w->cu = calloc((size_t)n + 1, sizeof *w->cu);
    for (int32_t s = 0; s < n; s++) w->lens[s] = rnd(5) == 0 ? 0 : (int32_t)rnd(40) + 1;
    if (n > 1) w->lens[1] = 300;
    if (wide && n > 2) w->lens[2] = 70000;
    for (int32_t s = 0; s < n; s++) w->cu[s + 1] = w->cu[s] + w->lens[s];
    w->ids = calloc((size_t)w->cu[n] * layers * k + 1, sizeof *w->ids);
    for (int32_t s = 0; s < n; s++)
        for (int64_t i = w->cu[s] * layers * k; i < w->cu[s + 1] * layers * k; i++)
            w->ids[i] = (s == 1 || s == 2) && rnd(8) ? 0 : (int32_t)rnd((uint32_t)experts);
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_batch_new(ctx, n, zero, w->lens, NULL, &w->batch, NULL);
    free(zero);
}

static void world_free(world *w)
{
    rp_batch_free(w->batch);
    free(w->lens);
    free(w->cu);
    free(w->ids);
}

static rp_stats *stats_of(rp_context *ctx, const world *w)
{
    rp_routing r;
    rp_routing_packed(&r, RP_ID_I32, w->layers, w->k, w->ids);
    rp_stats *st = NULL;
    rp_error err;
    if (rp_stats_compute(ctx, w->batch, &r, w->experts, 1, &st, &err) != RP_OK) diag("compute: %s", err.text);
    return st;
}

/* The statistics of the sequences ids[0 .. m) of w, in that order (a rank's part). */
static rp_stats *part_stats(rp_context *ctx, const world *w, const int32_t *ids, int32_t m)
{
    int32_t *lens = calloc((size_t)m + 1, sizeof *lens), *zero = calloc((size_t)m + 1, sizeof *zero);
    int64_t tokens = 0;
    for (int32_t i = 0; i < m; i++) lens[i] = w->lens[ids[i]], tokens += lens[i];
    const int64_t rec = (int64_t)w->layers * w->k;
    int32_t *local = calloc((size_t)(tokens * rec) + 1, sizeof *local), *p = local;
    for (int32_t i = 0; i < m; i++) {
        size_t n = (size_t)(w->lens[ids[i]] * rec);
        memcpy(p, w->ids + w->cu[ids[i]] * rec, n * sizeof *p);
        p += n;
    }
    rp_batch *b = NULL;
    rp_stats *st = NULL;
    rp_error err;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_I32, w->layers, w->k, local);
    if (rp_batch_new(ctx, m, zero, lens, NULL, &b, &err) != RP_OK ||
        rp_stats_compute(ctx, b, &r, w->experts, 2, &st, &err) != RP_OK)
        diag("part: %s", err.text);
    rp_batch_free(b);
    free(lens);
    free(zero);
    free(local);
    return st;
}

static unsigned char *serialise(const rp_stats *st, size_t *len)
{
    *len = rp_stats_serialized_bytes(st);
    unsigned char *b = malloc(*len);
    rp_error err;
    if (rp_stats_serialize(st, b, *len, &err) != RP_OK) diag("serialise: %s", err.text);
    return b;
}

static void test_round_trip(rp_context *ctx)
{
    int all_same = 1;
    for (int trial = 0; trial < 6; trial++) {
        world w;
        world_make(&w, ctx, 1 + (int32_t)rnd(30), 1 + (int32_t)rnd(4), 1 + (int32_t)rnd(4), 2 + (int32_t)rnd(40),
                   trial == 0);
        rp_stats *st = stats_of(ctx, &w), *back = NULL;
        size_t len;
        unsigned char *b = serialise(st, &len);
        rp_error err;
        if (rp_stats_deserialize(ctx, b, len, &back, &err) != RP_OK) diag("trial %d: %s", trial, err.text);
        all_same &= back && stats_same(st, back);
        rp_stats_free(back);
        rp_stats_free(st);
        free(b);
        world_free(&w);
    }
    ok(all_same, "serialise then deserialise gives the same statistics (every count, width, load, size)");

    /* the layout is the documented one: header fields little-endian, widths, counts */
    world w;
    world_make(&w, ctx, 4, 2, 2, 8, 1);
    rp_stats *st = stats_of(ctx, &w);
    size_t len;
    unsigned char *b = serialise(st, &len);
    uint64_t H = 0;
    for (int i = 0; i < 8; i++) H |= (uint64_t)b[40 + i] << (8 * i);
    ok(memcmp(b, "RPSTATS", 8) == 0 && b[8] == 1 && b[12] == 64 && b[16] == 4 && b[20] == 2 && b[24] == 8 &&
           b[28] == 2 && len == 64 + 4 + H,
       "header: magic, version 1, 64 bytes, sequences, layers, experts, top-k, 64 + n + H bytes in all");
    ok(b[64 + 2] == 4 && b[64 + 1] == 2, "the 70000-token sequence is stored 4 bytes a count, the 300-token one 2");
    uint32_t c0 = rp_stats_seq_count(st, 2, 1, 0);
    const unsigned char *h = b + 64 + 4;
    size_t at = 0;
    for (int s = 0; s < 2; s++) at += (size_t)16 * b[64 + s];
    uint32_t wire = (uint32_t)h[at + 32] | (uint32_t)h[at + 33] << 8 | (uint32_t)h[at + 34] << 16 |
                    (uint32_t)h[at + 35] << 24;
    ok(wire == c0 && c0 > 65535, "sequence 2 layer 1 expert 0 is %u, little-endian at its place", c0);
    free(b);
    rp_stats_free(st);
    world_free(&w);
}

static void shuffle(int32_t *a, int32_t n)
{
    for (int32_t i = n - 1; i > 0; i--) {
        int32_t j = (int32_t)rnd((uint32_t)i + 1), t = a[i];
        a[i] = a[j], a[j] = t;
    }
}

static void test_merge_random(rp_context *ctx)
{
    int from_stats = 1, from_bytes = 1, trials = 0;
    for (int trial = 0; trial < 24; trial++) {
        const int32_t P = 2 + trial % 3;
        world w;
        world_make(&w, ctx, 1 + (int32_t)rnd(40), 1 + (int32_t)rnd(3), 1 + (int32_t)rnd(4), 2 + (int32_t)rnd(30),
                   trial % 8 == 0);
        rp_stats *whole = stats_of(ctx, &w);
        /* shuffled ids dealt to ranks in random amounts (some ranks may get none) */
        int32_t *perm = malloc(sizeof *perm * (size_t)w.n);
        for (int32_t s = 0; s < w.n; s++) perm[s] = s;
        shuffle(perm, w.n);
        int32_t cut[5] = {0};
        cut[P] = w.n;
        for (int32_t r = 1; r < P; r++) cut[r] = (int32_t)rnd((uint32_t)w.n + 1);
        for (int32_t r = 1; r < P; r++)
            for (int32_t q = r + 1; q < P; q++)
                if (cut[q] < cut[r]) { int32_t t = cut[q]; cut[q] = cut[r]; cut[r] = t; }
        rp_stats *parts[4] = {0};
        const int32_t *ids[4];
        const void *bytes[4];
        size_t lens[4];
        for (int32_t r = 0; r < P; r++) {
            ids[r] = perm + cut[r];
            parts[r] = part_stats(ctx, &w, perm + cut[r], cut[r + 1] - cut[r]);
            bytes[r] = serialise(parts[r], &lens[r]);
        }
        rp_stats *m1 = NULL, *m2 = NULL;
        rp_error err;
        if (rp_stats_merge(ctx, P, (const rp_stats *const *)parts, ids, w.n, &m1, &err) != RP_OK)
            diag("merge: %s", err.text);
        if (rp_stats_merge_serialized(ctx, P, bytes, lens, ids, w.n, &m2, &err) != RP_OK)
            diag("merge bytes: %s", err.text);
        from_stats &= m1 && stats_same(m1, whole);
        from_bytes &= m2 && stats_same(m2, whole);
        trials++;
        rp_stats_free(m1);
        rp_stats_free(m2);
        for (int32_t r = 0; r < P; r++) {
            rp_stats_free(parts[r]);
            free((void *)bytes[r]);
        }
        free(perm);
        rp_stats_free(whole);
        world_free(&w);
    }
    ok(from_stats, "%d random batches over 2-4 ranks with shuffled ids: the merge equals the whole batch's "
       "statistics bit for bit", trials);
    ok(from_bytes, "and so does the merge of the serialised parts");
}

/* More sequences than the merge sums in 32 bits before a flush (STATS_NARROW_MAX =
 * 65537 of 1 or 2 bytes a count): the merged loads still equal the whole batch's. */
static void test_merge_many(rp_context *ctx)
{
    world w;
    world_make(&w, ctx, 70000, 1, 1, 2, 0);
    rp_stats *whole = stats_of(ctx, &w);
    int32_t *ids = malloc(sizeof *ids * (size_t)w.n);
    for (int32_t s = 0; s < w.n; s++) ids[s] = s;
    const int32_t half = w.n / 2;
    rp_stats *a = part_stats(ctx, &w, ids, half), *b = part_stats(ctx, &w, ids + half, w.n - half);
    size_t la = 0, lb = 0;
    unsigned char *ba = serialise(a, &la), *bb = serialise(b, &lb);
    const void *bytes[2] = {ba, bb};
    const size_t lens[2] = {la, lb};
    const int32_t *part_ids[2] = {ids, ids + half};
    rp_stats *m = NULL;
    rp_error err;
    rp_status st = rp_stats_merge_serialized(ctx, 2, bytes, lens, part_ids, w.n, &m, &err);
    ok(st == RP_OK && stats_same(m, whole), "70,000 sequences in 2 parts: the merge equals the whole batch's "
                                            "statistics, loads included (%s)", st == RP_OK ? "merged" : err.text);
    rp_stats_free(m);
    rp_stats_free(a);
    rp_stats_free(b);
    rp_stats_free(whole);
    free(ba);
    free(bb);
    free(ids);
    world_free(&w);
}

/* Sequences of 2 bytes a count with rows of at least 16 counts, whose blocks in the merged
 * histograms start on 16-byte boundaries (layers x experts even: the merge streams them,
 * 16 counts at a time) or not (odd), with a short tail: the merge of 3 parts equals the
 * whole batch's statistics, loads included. */
static void test_merge_wide_rows(rp_context *ctx)
{
    const int32_t shapes[3][2] = {{3, 16}, {2, 13}, {5, 17}}; /* layers, experts */
    int same = 1;
    for (int t = 0; t < 3; t++) {
        world w;
        world_make(&w, ctx, 30, shapes[t][0], 2, shapes[t][1], 0);
        /* every sequence long and skewed to expert 0: counts above 255 */
        w.cu[0] = 0;
        for (int32_t q = 0; q < w.n; q++) {
            w.lens[q] = 260 + (int32_t)rnd(200) * (q % 3 != 0);
            w.cu[q + 1] = w.cu[q] + w.lens[q];
        }
        const int64_t rec = (int64_t)w.layers * w.k;
        free(w.ids);
        w.ids = calloc((size_t)(w.cu[w.n] * rec) + 1, sizeof *w.ids);
        for (int64_t i = 0; i < w.cu[w.n] * rec; i++) w.ids[i] = rnd(4) ? 0 : (int32_t)rnd((uint32_t)w.experts);
        int32_t *zero = calloc((size_t)w.n, sizeof *zero);
        rp_batch_free(w.batch);
        rp_batch_new(ctx, w.n, zero, w.lens, NULL, &w.batch, NULL);
        free(zero);
        rp_stats *whole = stats_of(ctx, &w);
        int32_t *perm = malloc(sizeof *perm * (size_t)w.n);
        for (int32_t q = 0; q < w.n; q++) perm[q] = q;
        shuffle(perm, w.n);
        const int32_t cut[4] = {0, 7, 19, w.n};
        rp_stats *parts[3];
        const void *bytes[3];
        size_t lens[3];
        const int32_t *ids[3];
        for (int r = 0; r < 3; r++) {
            ids[r] = perm + cut[r];
            parts[r] = part_stats(ctx, &w, ids[r], cut[r + 1] - cut[r]);
            bytes[r] = serialise(parts[r], &lens[r]);
        }
        rp_stats *m = NULL;
        rp_error err;
        if (rp_stats_merge_serialized(ctx, 3, bytes, lens, ids, w.n, &m, &err) != RP_OK) diag("merge: %s", err.text);
        int wide = 1;
        for (int32_t q = 0; m && q < w.n; q++) wide &= m->width[q] == 2;
        same &= m && wide && stats_same(m, whole);
        rp_stats_free(m);
        for (int r = 0; r < 3; r++) {
            rp_stats_free(parts[r]);
            free((void *)bytes[r]);
        }
        free(perm);
        rp_stats_free(whole);
        world_free(&w);
    }
    ok(same, "sequences of 2 bytes a count in rows of 13 to 17 counts, on 16-byte boundaries or not: the merge "
       "equals the whole batch's statistics");
}

/* Re-sign a payload after editing it (the checksum covers everything after the header). */
static void resign(unsigned char *b, size_t len)
{
    uint64_t h = rp_hash64(b + 64, len - 64, 0);
    for (int i = 0; i < 8; i++) b[48 + i] = (unsigned char)(h >> (8 * i));
}

static rp_status load(rp_context *ctx, const unsigned char *b, size_t len, rp_error *err)
{
    rp_stats *st = NULL;
    rp_status s = rp_stats_deserialize(ctx, b, len, &st, err);
    rp_stats_free(st);
    if (s == RP_OK && st == NULL) return RP_EINVAL;
    return s;
}

static void test_bad_bytes(rp_context *ctx)
{
    world w;
    world_make(&w, ctx, 6, 2, 2, 5, 0);
    rp_stats *st = stats_of(ctx, &w);
    size_t len;
    unsigned char *b = serialise(st, &len);
    unsigned char *c = malloc(len + 8);
    rp_error err;

    int truncations = 1;
    for (size_t n = 0; n < len; n++) {
        memcpy(c, b, n);
        truncations &= load(ctx, c, n, &err) != RP_OK;
    }
    ok(truncations, "every truncation (0 .. %zu bytes) is refused", len - 1);
    memcpy(c, b, len);
    c[len] = 0;
    ok(load(ctx, c, len + 1, &err) == RP_EFORMAT, "a trailing byte is refused");
    like(err.text, "bytes were given", "and the message compares the sizes");

    int flips = 1;
    size_t missed = 0;
    for (size_t i = 0; i < len; i++)
        for (int bit = 0; bit < 8; bit++) {
            memcpy(c, b, len);
            c[i] ^= (unsigned char)(1u << bit);
            if (load(ctx, c, len, &err) == RP_OK) flips = 0, missed = i;
        }
    ok(flips, "every flipped bit of the %zu bytes is refused (missed byte %zu)", len, missed);

    memcpy(c, b, len);
    c[48] ^= 1;
    ok(load(ctx, c, len, &err) == RP_ECHECKSUM, "a wrong checksum is RP_ECHECKSUM");
    memcpy(c, b, len);
    c[64] = 3; /* the first sequence's width: invalid, and the checksum no longer matches */
    ok(load(ctx, c, len, &err) == RP_ECHECKSUM && strstr(err.text, "XXH64"),
       "a bad width under a stale checksum is the checksum's error (judged first)");
    memcpy(c, b, len);
    c[0] = 'X';
    ok(load(ctx, c, len, &err) == RP_EFORMAT, "a wrong magic is RP_EFORMAT");
    memcpy(c, b, len);
    c[8] = 2;
    ok(load(ctx, c, len, &err) == RP_ENOTSUP, "version 2 is RP_ENOTSUP");
    like(err.text, "format version 2", "and names the version");
    memcpy(c, b, len);
    c[16] = 0xff, c[17] = 0xff, c[18] = 0xff, c[19] = 0x7f;
    ok(load(ctx, c, len, &err) == RP_EFORMAT, "2^31-1 sequences in a short buffer is refused before anything is "
       "allocated");
    memcpy(c, b, len);
    c[40] = c[41] = c[42] = c[43] = c[44] = c[45] = c[46] = 0xff, c[47] = 0x7f;
    ok(load(ctx, c, len, &err) != RP_OK, "a huge histogram size is refused");
    memcpy(c, b, len);
    c[56] = 1;
    ok(load(ctx, c, len, &err) == RP_EFORMAT, "a nonzero reserved field is refused");

    /* crafted payloads with a valid checksum */
    int32_t s1 = -1;
    for (int32_t s = 0; s < w.n; s++)
        if (b[64 + s] == 1) s1 = s;
    memcpy(c, b, len);
    c[64 + s1] = 3;
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EFORMAT && err.sequence == s1, "width 3 is refused, naming sequence %d", s1);
    like(err.text, "count width 3", "and says so");

    /* sequence s1's counts moved from one layer-0 expert to another at layer 1 only:
     * find its block and break the equal layer sums */
    size_t at = 64 + (size_t)w.n;
    for (int32_t s = 0; s < s1; s++) at += (size_t)w.layers * w.experts * b[64 + s];
    memcpy(c, b, len);
    c[at + (size_t)w.experts] += 1; /* layer 1, expert 0: one more choice */
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EFORMAT && err.sequence == s1, "a layer that routes another number of choices "
       "is refused");
    like(err.text, "at layer 1 but", "and names the layer");

    /* widen sequence s1 to 2 bytes a count (same values): not canonical */
    size_t cells = (size_t)w.layers * w.experts, wide_len = len + cells;
    unsigned char *d = malloc(wide_len);
    memcpy(d, b, at);
    for (size_t i = 0; i < cells; i++) d[at + 2 * i] = b[at + i], d[at + 2 * i + 1] = 0;
    memcpy(d + at + 2 * cells, b + at + cells, len - at - cells);
    d[64 + s1] = 2;
    uint64_t H = 0;
    for (int i = 0; i < 8; i++) H |= (uint64_t)b[40 + i] << (8 * i);
    H += cells;
    for (int i = 0; i < 8; i++) d[40 + i] = (unsigned char)(H >> (8 * i));
    resign(d, wide_len);
    ok(load(ctx, d, wide_len, &err) == RP_EFORMAT && err.sequence == s1, "a count stored wider than it needs is "
       "refused (the form is canonical)");
    like(err.text, "needs 1", "and says which width it needs");
    /* the check reads the counts' bits, not their maximum: the message still names the largest */
    uint32_t largest = 0;
    for (size_t i = 0; i < cells; i++) largest = b[at + i] > largest ? b[at + i] : largest;
    char want[64];
    snprintf(want, sizeof want, "largest count %u needs 1", largest);
    like(err.text, want, "and names the largest count (%u)", largest);
    free(d);

    /* num_tokens that does not match the counts */
    memcpy(c, b, len);
    c[32] += 1;
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EFORMAT, "a token count the counts do not add up to is refused");
    /* top_k 0 */
    memcpy(c, b, len);
    c[28] = 0;
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EINVAL, "top-k 0 is RP_EINVAL");

    ok(load(ctx, NULL, 0, &err) == RP_EFORMAT, "no bytes at all is refused");

    /* The header's shape must be vouched for by the bytes: reading costs layers x
     * experts per sequence with counts, and loads of layers x experts. Without the
     * bound, 168 bytes declaring 83,886,082 layers ran for minutes (fuzz_stats_wire). */
    memcpy(c, b, len);
    c[20] = 0x02, c[21] = 0x00, c[22] = 0x00, c[23] = 0x05; /* 83,886,082 layers */
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EINVAL, "83,886,082 layers: over the model limit, refused at once");
    like(err.text, "outside the model limits", "and says so");
    {
        /* a header of empty sequences (no histogram bytes) declaring 65536 x 65536 cells */
        unsigned char h[64 + 3];
        memcpy(h, b, 64);
        h[16] = 3, h[17] = h[18] = h[19] = 0;                   /* 3 sequences */
        h[20] = 0, h[21] = 0, h[22] = 1, h[23] = 0;             /* 65536 layers */
        h[24] = 0, h[25] = 0, h[26] = 1, h[27] = 0;             /* 65536 experts */
        memset(h + 32, 0, 16);                                  /* 0 tokens, 0 histogram bytes */
        h[64] = h[65] = h[66] = 0;                              /* widths 0 */
        resign(h, sizeof h);
        ok(load(ctx, h, sizeof h, &err) == RP_EFORMAT, "2^32 cells and no histogram bytes: refused");
        like(err.text, "cannot be described by 0 histogram bytes", "naming the shape and the bytes");
        h[22] = 0, h[21] = 4;                                    /* 1024 layers x 65536: 2^26 cells */
        h[26] = 0, h[25] = 0, h[24] = 16;                        /* 16 experts: 2^14 cells */
        resign(h, sizeof h);
        rp_stats *empty = NULL;
        ok(rp_stats_deserialize(ctx, h, sizeof h, &empty, &err) == RP_OK && rp_stats_num_seqs(empty) == 3 &&
           rp_stats_num_layers(empty) == 1024, "a batch of empty sequences of a real shape still reads back");
        rp_stats_free(empty);
    }
    /* counts of a sequence must cover the cells: more cells than histogram bytes */
    memcpy(c, b, len);
    {
        uint32_t experts = (uint32_t)w.experts * 1000;
        for (int i = 0; i < 4; i++) c[24 + i] = (unsigned char)(experts >> (8 * i));
    }
    resign(c, len);
    ok(load(ctx, c, len, &err) == RP_EFORMAT, "more cells than histogram bytes: refused before reading");
    free(b);
    free(c);
    rp_stats_free(st);
    world_free(&w);
}

static void test_merge_errors(rp_context *ctx)
{
    world w;
    world_make(&w, ctx, 6, 2, 2, 5, 0);
    int32_t a[3] = {0, 2, 4}, bb[3] = {1, 3, 5}, dup[3] = {1, 2, 5}, out[3] = {1, 3, 6};
    rp_stats *pa = part_stats(ctx, &w, a, 3), *pb = part_stats(ctx, &w, bb, 3);
    const rp_stats *parts[2] = {pa, pb};
    rp_stats *m = NULL;
    rp_error err;
    const int32_t *ids_dup[2] = {a, dup};
    ok(rp_stats_merge(ctx, 2, parts, ids_dup, 6, &m, &err) == RP_EINVAL && err.sequence == 2 && !m,
       "an id in two parts is refused");
    like(err.text, "global sequence id 2 is in parts 0 and 1", "and names the id and both parts");
    const int32_t *ids_out[2] = {a, out};
    ok(rp_stats_merge(ctx, 2, parts, ids_out, 6, &m, &err) == RP_EINVAL && err.sequence == 6, "an id out of range is "
       "refused");
    like(err.text, "global sequence id 6, outside [0, 6)", "and says so");
    const int32_t *ids_ok[2] = {a, bb};
    ok(rp_stats_merge(ctx, 2, parts, ids_ok, 7, &m, &err) == RP_EINVAL && err.sequence == 6, "a missing id is "
       "refused");
    like(err.text, "global sequence id 6 is in no part", "and named");
    ok(rp_stats_merge(ctx, 2, parts, NULL, 6, &m, &err) == RP_EINVAL, "no ids is refused");
    world w2;
    world_make(&w2, ctx, 3, 3, 2, 5, 0);
    int32_t three[3] = {0, 1, 2};
    rp_stats *pc = part_stats(ctx, &w2, three, 3);
    const rp_stats *mixed[2] = {pa, pc};
    const int32_t *ids_mixed[2] = {a, bb};
    ok(rp_stats_merge(ctx, 2, mixed, ids_mixed, 6, &m, &err) == RP_EINVAL, "parts with other layer counts are "
       "refused");
    like(err.text, "part 1 has 3 layers", "and the message names the part");
    size_t lb;
    unsigned char *bytes_b = serialise(pb, &lb);
    size_t la;
    unsigned char *bytes_a = serialise(pa, &la);
    bytes_b[70] ^= 1;
    const void *bl[2] = {bytes_a, bytes_b};
    size_t ll[2] = {la, lb};
    ok(rp_stats_merge_serialized(ctx, 2, bl, ll, ids_ok, 6, &m, &err) == RP_ECHECKSUM, "a corrupt part is refused");
    like(err.text, "part 1: statistics", "and the message names the part");
    free(bytes_a);
    free(bytes_b);
    rp_stats_free(pa);
    rp_stats_free(pb);
    rp_stats_free(pc);
    world_free(&w);
    world_free(&w2);
}

static void test_check_batch(rp_context *ctx)
{
    world w;
    world_make(&w, ctx, 5, 2, 2, 5, 0);
    rp_stats *st = stats_of(ctx, &w);
    rp_error err;
    ok(rp_stats_check_batch(st, w.batch, &err) == RP_OK, "statistics describe their own batch");
    ok(rp_stats_top_k(st) == 2 && rp_stats_num_tokens(st) == rp_batch_num_tokens(w.batch), "top_k and num_tokens");
    /* the same lengths in another order */
    int32_t *lens = malloc(sizeof *lens * 5), zero[5] = {0};
    for (int s = 0; s < 5; s++) lens[s] = w.lens[4 - s];
    lens[0] = w.lens[1], lens[1] = w.lens[0];
    for (int s = 2; s < 5; s++) lens[s] = w.lens[s];
    rp_batch *other = NULL;
    rp_batch_new(ctx, 5, zero, lens, NULL, &other, NULL);
    ok(rp_stats_check_batch(st, other, &err) == RP_EINVAL && err.sequence == 0,
       "a batch with sequences 0 and 1 swapped (lengths %d, %d) is refused at sequence 0", w.lens[0], w.lens[1]);
    like(err.text, "another order", "and the message suggests why");
    rp_batch_free(other);
    rp_batch_new(ctx, 4, zero, lens, NULL, &other, NULL);
    ok(rp_stats_check_batch(st, other, &err) == RP_EINVAL, "a batch with fewer sequences is refused");
    rp_batch_free(other);
    free(lens);
    rp_stats_free(st);
    world_free(&w);
}

/* stats_copy (the scheduler keeps the last step's statistics): the same statistics in
 * fresh storage, widths 0, 1, 2 and 4 included; failing each allocation gives RP_ENOMEM
 * and leaks nothing. */
static void test_copy(rp_context *ctx)
{
    int all_same = 1, fresh = 1;
    for (int trial = 0; trial < 6; trial++) {
        world w;
        world_make(&w, ctx, 1 + (int32_t)rnd(30), 1 + (int32_t)rnd(4), 1 + (int32_t)rnd(4), 2 + (int32_t)rnd(40),
                   trial < 2);
        rp_stats *st = stats_of(ctx, &w), *copy = NULL;
        rp_error err;
        if (stats_copy(ctx, st, &copy, &err) != RP_OK) diag("trial %d: %s", trial, err.text);
        all_same &= copy && stats_same(st, copy);
        fresh &= copy && copy->hist != st->hist && copy->width != st->width && copy->offset != st->offset &&
                 copy->expert_load != st->expert_load;
        rp_stats_free(st);
        /* the copy outlives the original */
        all_same &= copy && rp_stats_seq_count(copy, 0, 0, 0) <= (uint32_t)(w.lens[0] * w.k);
        rp_stats_free(copy);
        world_free(&w);
    }
    ok(all_same, "stats_copy gives the same statistics (every count, width, offset, load, size)");
    ok(fresh, "in storage of its own");

    int clean = 1, leaks = 0, done = 0;
    for (long n = 1; n < 20 && !done; n++) {
        counting c = {0};
        rp_context *cc = NULL;
        if (rp_context_new(counting_alloc, &c, &cc) != RP_OK) continue;
        world w;
        world_make(&w, cc, 6, 2, 2, 5, 0);
        rp_stats *st = stats_of(cc, &w), *copy = NULL;
        long live = c.live;
        c.fail_at = c.calls + n;
        rp_error err;
        rp_status r = stats_copy(cc, st, &copy, &err);
        c.fail_at = 0;
        if (r != RP_OK && (r != RP_ENOMEM || copy)) clean = 0;
        if (r == RP_OK) done = 1, clean &= stats_same(st, copy);
        rp_stats_free(copy);
        if (c.live != live) leaks++;
        rp_stats_free(st);
        world_free(&w);
        rp_context_free(cc);
    }
    ok(clean && done, "failing each allocation of stats_copy gives RP_ENOMEM (then success)");
    is_int(leaks, 0, "and leaks nothing");
}

/* stats_copy_reusing: into a spare of the same shape (its storage taken, histograms of
 * another size refitted), or a fresh copy when the shape differs (the spare freed); the
 * same statistics either way; a failed refit leaves the spare as it was. */
static void test_copy_reusing(rp_context *ctx)
{
    int same = 1, reused = 1;
    for (int trial = 0; trial < 6; trial++) {
        world a, b;
        int32_t n = 2 + (int32_t)rnd(20), layers = 1 + (int32_t)rnd(4), k = 1 + (int32_t)rnd(3), e = 4 + (int32_t)rnd(20);
        world_make(&a, ctx, n, layers, k, e, trial % 2);
        world_make(&b, ctx, n, layers, k, e, (trial + 1) % 2); /* other lengths: other widths */
        rp_stats *sa = stats_of(ctx, &a), *sb = stats_of(ctx, &b), *spare = NULL, *copy = NULL;
        stats_copy(ctx, sa, &spare, NULL);
        rp_stats *was = spare;
        rp_error err;
        if (stats_copy_reusing(ctx, sb, &spare, &copy, &err) != RP_OK) diag("%s", err.text);
        same &= copy && stats_same(sb, copy);
        reused &= copy == was && spare == NULL;
        rp_stats_free(copy);
        rp_stats_free(sa);
        rp_stats_free(sb);
        world_free(&a);
        world_free(&b);
    }
    ok(same, "stats_copy_reusing gives the same statistics (every count, width, offset, load, size)");
    ok(reused, "in the spare's storage, which it takes");

    world a, b;
    world_make(&a, ctx, 5, 2, 2, 6, 0);
    world_make(&b, ctx, 7, 2, 2, 6, 0);
    rp_stats *sa = stats_of(ctx, &a), *sb = stats_of(ctx, &b), *spare = NULL, *copy = NULL;
    stats_copy(ctx, sa, &spare, NULL);
    ok(stats_copy_reusing(ctx, sb, &spare, &copy, NULL) == RP_OK && copy && stats_same(sb, copy) && !spare,
       "another shape: a fresh copy, the spare freed");
    rp_stats_free(copy);
    rp_stats_free(sa);
    rp_stats_free(sb);
    world_free(&a);
    world_free(&b);

    /* a failing refit: the spare stays, nothing leaks */
    counting c = {0};
    rp_context *cc = NULL;
    int clean = 0;
    if (rp_context_new(counting_alloc, &c, &cc) == RP_OK) {
        world x, y;
        world_make(&x, cc, 6, 2, 2, 5, 0);
        world_make(&y, cc, 6, 2, 2, 5, 1); /* a width-4 sequence: larger histograms */
        rp_stats *sx = stats_of(cc, &x), *sy = stats_of(cc, &y), *sp = NULL, *out = NULL;
        stats_copy(cc, sx, &sp, NULL);
        rp_stats *was = sp;
        long live = c.live;
        c.fail_at = c.calls + 1;
        rp_status r = stats_copy_reusing(cc, sy, &sp, &out, NULL);
        c.fail_at = 0;
        clean = r == RP_ENOMEM && !out && sp == was && stats_same(sx, sp) && c.live == live;
        rp_stats_free(sp);
        rp_stats_free(sx);
        rp_stats_free(sy);
        world_free(&x);
        world_free(&y);
        rp_context_free(cc);
    }
    ok(clean, "a failed refit gives RP_ENOMEM and leaves the spare as it was");
}

/* rp_stats_merge_serialized_reusing: a step after step merge into the last merge's
 * storage equals a fresh merge bit for bit, takes that storage when it is large enough,
 * and on any error (bad bytes, a failed allocation) leaves *stats as it was. */
static void test_merge_reusing(rp_context *ctx)
{
    int same = 1, reused = 0, steps = 0;
    rp_stats *kept = NULL;
    rp_error err;
    for (int step = 0; step < 6; step++) {
        world w;
        /* the batch shrinks after the first steps: a later merge fits in the first's storage */
        world_make(&w, ctx, step < 2 ? 40 : 20 + (int32_t)rnd(15), 3, 2, 9, step == 0);
        rp_stats *whole = stats_of(ctx, &w);
        int32_t *perm = malloc(sizeof *perm * (size_t)w.n);
        for (int32_t q = 0; q < w.n; q++) perm[q] = q;
        shuffle(perm, w.n);
        const int32_t half = w.n / 2;
        rp_stats *a = part_stats(ctx, &w, perm, half), *b = part_stats(ctx, &w, perm + half, w.n - half);
        size_t la, lb;
        unsigned char *ba = serialise(a, &la), *bb = serialise(b, &lb);
        const void *bytes[2] = {ba, bb};
        size_t lens[2] = {la, lb};
        const int32_t *ids[2] = {perm, perm + half};
        const unsigned char *storage = kept ? kept->hist : NULL;
        const size_t cap = kept ? kept->hist_cap : 0;
        if (rp_stats_merge_serialized_reusing(ctx, 2, bytes, lens, ids, w.n, &kept, &err) != RP_OK) {
            diag("merge: %s", err.text);
            same = 0;
        } else {
            steps++;
            same &= stats_same(kept, whole);
            reused += storage && kept->hist == storage && cap >= kept->offset[w.n];
        }
        /* a corrupt part: an error, and the last merge untouched */
        rp_stats *before = kept;
        ba[la - 1] ^= 0x5A;
        if (rp_stats_merge_serialized_reusing(ctx, 2, bytes, lens, ids, w.n, &kept, &err) != RP_ECHECKSUM ||
            kept != before || !stats_same(kept, whole))
            same = 0;
        free(ba);
        free(bb);
        rp_stats_free(a);
        rp_stats_free(b);
        rp_stats_free(whole);
        free(perm);
        world_free(&w);
    }
    rp_stats_free(kept);
    is_int(steps, 6, "six steps merged into the last step's statistics");
    ok(same, "each equals the whole batch's statistics bit for bit, and a corrupt part leaves the last merge whole");
    ok(reused >= 4, "the merges that fit took the last one's histogram storage (%d of 5)", reused);
    ok(rp_stats_merge_serialized_reusing(ctx, 1, NULL, NULL, NULL, 0, NULL, &err) == RP_EINVAL,
       "no place for the result: RP_EINVAL (%s)", err.text);
}

static void test_alloc_failures(void)
{
    int clean = 1, leaks = 0;
    long n_ok = 0;
    for (long n = 1; n < 200; n++) {
        counting c = {0};
        rp_context *ctx = NULL;
        if (rp_context_new(counting_alloc, &c, &ctx) != RP_OK) continue;
        c.fail_at = 0;
        world w;
        rng_state = 42;
        world_make(&w, ctx, 5, 2, 2, 5, 0);
        int32_t a[2] = {3, 0}, b[3] = {4, 1, 2};
        rp_stats *pa = part_stats(ctx, &w, a, 2), *pb = part_stats(ctx, &w, b, 3), *m = NULL, *d = NULL;
        size_t la, lb;
        unsigned char *ba = serialise(pa, &la), *bb = serialise(pb, &lb);
        const void *bytes[2] = {ba, bb};
        size_t lens[2] = {la, lb};
        const int32_t *ids[2] = {a, b};
        const rp_stats *parts[2] = {pa, pb};
        long live = c.live;
        c.fail_at = c.calls + n;
        rp_error err;
        rp_status s1 = rp_stats_merge_serialized(ctx, 2, bytes, lens, ids, 5, &m, &err);
        rp_stats_free(m);
        m = NULL;
        rp_status s2 = rp_stats_merge(ctx, 2, parts, ids, 5, &m, &err);
        rp_stats_free(m);
        rp_status s3 = rp_stats_deserialize(ctx, ba, la, &d, &err);
        rp_stats_free(d);
        /* reusing an earlier merge: on failure it stays whole */
        c.fail_at = 0;
        rp_stats *r = NULL, *fresh = NULL;
        rp_status s0 = rp_stats_merge_serialized(ctx, 2, bytes, lens, ids, 5, &r, &err);
        rp_stats_merge_serialized(ctx, 2, bytes, lens, ids, 5, &fresh, &err);
        rp_stats *held = r;
        c.fail_at = c.calls + n;
        rp_status s4 = s0 == RP_OK ? rp_stats_merge_serialized_reusing(ctx, 2, bytes, lens, ids, 5, &r, &err) : RP_OK;
        c.fail_at = 0;
        if (s0 != RP_OK || (s4 != RP_OK && (r != held || !stats_same(r, fresh)))) clean = 0;
        if (s4 == RP_OK && (!r || !stats_same(r, fresh))) clean = 0;
        if (s4 != RP_OK && s4 != RP_ENOMEM) clean = 0;
        rp_stats_free(r);
        rp_stats_free(fresh);
        c.fail_at = 0;
        if ((s1 != RP_OK && s1 != RP_ENOMEM) || (s2 != RP_OK && s2 != RP_ENOMEM) || (s3 != RP_OK && s3 != RP_ENOMEM))
            clean = 0;
        if (c.live != live) leaks++;
        if (s1 == RP_OK && s2 == RP_OK && s3 == RP_OK) n_ok++;
        free(ba);
        free(bb);
        rp_stats_free(pa);
        rp_stats_free(pb);
        world_free(&w);
        rp_context_free(ctx);
        if (n_ok > 3) break;
    }
    ok(clean, "failing each allocation of merge (reusing or not) and deserialise gives RP_ENOMEM or success, "
              "and a reusing merge that fails leaves the earlier statistics whole");
    is_int(leaks, 0, "and leaks nothing");
}

int main(void)
{
    rp_context *ctx = NULL;
    rp_context_new(NULL, NULL, &ctx);
    test_round_trip(ctx);
    test_merge_random(ctx);
    test_merge_many(ctx);
    test_merge_wide_rows(ctx);
    test_bad_bytes(ctx);
    test_merge_errors(ctx);
    test_check_batch(ctx);
    test_copy(ctx);
    test_copy_reusing(ctx);
    test_merge_reusing(ctx);
    test_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
