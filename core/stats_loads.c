/* Routing statistics: loads of a packing (per microbatch) and of a placement (per GPU),
 * and skew, from the statistics core/stats.c builds. */
#include "internal.h"
#include "stats_internal.h"
#include "routepack/stats.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* ---- loads of a packing and of a placement ----------------------------------- */

/* Add sequence s's counts to a row of 64-bit loads: the plain pass, one sequence at a time
 * (what the narrow pass below falls back to when it cannot allocate its partial loads). */
static void add_sequence(const rp_stats *stats, int32_t s, size_t cells, int64_t *row)
{
    const unsigned char *h = stats->hist + stats->offset[s];
    switch (stats->width[s]) {
    case 1:
        for (size_t c = 0; c < cells; c++) row[c] += h[c];
        break;
    case 2:
        for (size_t c = 0; c < cells; c++) row[c] += stats_u16_at(h, c);
        break;
    case 4:
        for (size_t c = 0; c < cells; c++) row[c] += stats_u32_at(h, c);
        break;
    default: break;
    }
}

/* The narrow pass sums 1- and 2-byte counts into 32-bit partial loads, one row per
 * microbatch, and adds them to the 64-bit loads at the end: a 32-bit add takes 4 counts a
 * 128-bit register against 2 for a 64-bit one, and the partial rows take half the cache.
 * Sequences go in their stored order, so the counts stream from memory (the pass is bound
 * by that read: 50 MB at the reference scale; an order by microbatch was slower). The adds
 * run over LOADS_CHUNK cells, a constant trip count, so GCC vectorises them at -O2 (whose
 * cost model refuses loops that need a scalar epilogue). A partial load cannot wrap: it
 * holds at most STATS_NARROW_MAX counts of at most 65535 each, and 65537 x 65535 =
 * 2^32 - 1, so a row is flushed before it takes more sequences than that. 4-byte counts go
 * to the 64-bit loads directly. Integer sums do not depend on their order, so the loads
 * equal the plain pass's bit for bit. */
#define LOADS_CHUNK 16

static void add_u8(uint32_t *restrict acc, const unsigned char *restrict h, size_t cells)
{
    const size_t chunks = cells / LOADS_CHUNK;
    for (size_t k = 0; k < chunks; k++)
        for (size_t j = 0; j < LOADS_CHUNK; j++) acc[k * LOADS_CHUNK + j] += h[k * LOADS_CHUNK + j];
    for (size_t c = chunks * LOADS_CHUNK; c < cells; c++) acc[c] += h[c];
}

static void add_u16(uint32_t *restrict acc, const unsigned char *restrict h, size_t cells)
{
    const size_t chunks = cells / LOADS_CHUNK;
    for (size_t k = 0; k < chunks; k++)
        for (size_t j = 0; j < LOADS_CHUNK; j++)
            acc[k * LOADS_CHUNK + j] += stats_u16_at(h, k * LOADS_CHUNK + j);
    for (size_t c = chunks * LOADS_CHUNK; c < cells; c++) acc[c] += stats_u16_at(h, c);
}

void stats_add_narrow(uint32_t *acc, const unsigned char *counts, int width, size_t cells)
{
    if (width == 1) add_u8(acc, counts, cells);
    else add_u16(acc, counts, cells);
}

/* Copy and add in one pass: chunks of LOADS_CHUNK, as above. */
#define DEFINE_COPY_ADD(NAME, BYTES, AT)                                                                     \
    static void copy_add_##NAME(uint32_t *restrict acc, unsigned char *restrict to,                          \
                                const unsigned char *restrict from, size_t cells)                            \
    {                                                                                                        \
        const size_t chunks = cells / LOADS_CHUNK;                                                           \
        for (size_t k = 0; k < chunks; k++) {                                                                \
            memcpy(to + k * LOADS_CHUNK * BYTES, from + k * LOADS_CHUNK * BYTES, LOADS_CHUNK * BYTES);       \
            for (size_t j = 0; j < LOADS_CHUNK; j++) acc[k * LOADS_CHUNK + j] += AT(from, k * LOADS_CHUNK + j); \
        }                                                                                                    \
        const size_t c0 = chunks * LOADS_CHUNK;                                                              \
        memcpy(to + c0 * BYTES, from + c0 * BYTES, (cells - c0) * BYTES);                                    \
        for (size_t c = c0; c < cells; c++) acc[c] += AT(from, c);                                           \
    }
static inline uint32_t u8_at(const unsigned char *h, size_t i) { return h[i]; }
DEFINE_COPY_ADD(u8, 1, u8_at)
DEFINE_COPY_ADD(u16, 2, stats_u16_at)

#if defined(__SSE2__)
#include <emmintrin.h>
static void copy_add_u16_nt(uint32_t *restrict acc, unsigned char *restrict to, const unsigned char *restrict from,
                            size_t cells)
{
    const size_t chunks = cells / 16;
    const __m128i zero = _mm_setzero_si128();
    for (size_t k = 0; k < chunks; k++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(from + 32 * k));
        __m128i b = _mm_loadu_si128((const __m128i *)(from + 32 * k + 16));
        _mm_stream_si128((__m128i *)(to + 32 * k), a);
        _mm_stream_si128((__m128i *)(to + 32 * k + 16), b);
        __m128i *q = (__m128i *)(acc + 16 * k);
        _mm_storeu_si128(q, _mm_add_epi32(_mm_loadu_si128(q), _mm_unpacklo_epi16(a, zero)));
        _mm_storeu_si128(q + 1, _mm_add_epi32(_mm_loadu_si128(q + 1), _mm_unpackhi_epi16(a, zero)));
        _mm_storeu_si128(q + 2, _mm_add_epi32(_mm_loadu_si128(q + 2), _mm_unpacklo_epi16(b, zero)));
        _mm_storeu_si128(q + 3, _mm_add_epi32(_mm_loadu_si128(q + 3), _mm_unpackhi_epi16(b, zero)));
    }
    const size_t c0 = chunks * 16;
    memcpy(to + c0 * 2, from + c0 * 2, (cells - c0) * 2);
    for (size_t c = c0; c < cells; c++) acc[c] += stats_u16_at(from, c);
    _mm_sfence(); /* the streamed stores ordered before any later store (another thread may read them) */
}
#endif

void stats_copy_add_narrow(uint32_t *acc, unsigned char *to, const unsigned char *from, int width, size_t cells)
{
#if defined(__SSE2__)
    if (width == 2 && (uintptr_t)to % 16 == 0) {
        copy_add_u16_nt(acc, to, from, cells);
        return;
    }
#endif
    if (width == 1) copy_add_u8(acc, to, from, cells);
    else copy_add_u16(acc, to, from, cells);
}

void stats_flush_loads(int64_t *restrict loads, uint32_t *restrict acc, size_t cells)
{
    for (size_t c = 0; c < cells; c++) loads[c] += acc[c];
    memset(acc, 0, cells * sizeof *acc);
}

void stats_add_layers(const rp_stats *stats, int32_t seq, int32_t *rows, size_t stride)
{
    const size_t E = (size_t)stats->num_experts;
    const unsigned char *h = stats->hist + stats->offset[seq];
    /* the width chosen once for the whole block: per-layer calls through a decoded
     * buffer cost the evaluator's histogram pass about twice this */
    switch (stats->width[seq]) {
    case 1:
        for (int32_t l = 0; l < stats->num_layers; l++, h += E) {
            int32_t *restrict row = rows + (size_t)l * stride;
            for (size_t e = 0; e < E; e++) row[e] += h[e];
        }
        break;
    case 2:
        for (int32_t l = 0; l < stats->num_layers; l++, h += 2 * E) {
            int32_t *restrict row = rows + (size_t)l * stride;
            for (size_t e = 0; e < E; e++) row[e] += (int32_t)stats_u16_at(h, e);
        }
        break;
    case 4:
        for (int32_t l = 0; l < stats->num_layers; l++, h += 4 * E) {
            int32_t *restrict row = rows + (size_t)l * stride;
            for (size_t e = 0; e < E; e++) row[e] += (int32_t)stats_u32_at(h, e);
        }
        break;
    default: break; /* width 0: no counts */
    }
}

/* narrow[mb]: the 1- and 2-byte sequences in acc's row mb since its last flush */
static void loads_narrow(const rp_stats *stats, const int32_t *seq_microbatch, int32_t num_microbatches,
                         size_t cells, uint32_t *acc, int32_t *narrow, int64_t *loads)
{
    memset(acc, 0, (size_t)num_microbatches * cells * sizeof *acc);
    memset(narrow, 0, (size_t)num_microbatches * sizeof *narrow);
    for (int32_t s = 0; s < stats->num_seqs; s++) {
        const int32_t mb = seq_microbatch[s];
        if (mb < 0 || stats->width[s] == 0) continue;
        const unsigned char *h = stats->hist + stats->offset[s];
        uint32_t *row = acc + (size_t)mb * cells;
        switch (stats->width[s]) {
        case 4:
            for (size_t c = 0; c < cells; c++) loads[(size_t)mb * cells + c] += stats_u32_at(h, c);
            continue;
        case 1: add_u8(row, h, cells); break;
        default: add_u16(row, h, cells); break;
        }
        if (++narrow[mb] == STATS_NARROW_MAX) {
            stats_flush_loads(loads + (size_t)mb * cells, row, cells);
            narrow[mb] = 0;
        }
    }
    for (int32_t mb = 0; mb < num_microbatches; mb++)
        stats_flush_loads(loads + (size_t)mb * cells, acc + (size_t)mb * cells, cells);
}

rp_status rp_stats_microbatch_loads(const rp_stats *stats, const int32_t *seq_microbatch,
                                    int32_t num_microbatches, int64_t *loads, rp_error *err)
{
    const int32_t n = stats->num_seqs;
    if (num_microbatches < 0)
        return rp_fail(err, RP_EINVAL, "microbatch loads: %d microbatches, must be >= 0",
                       num_microbatches);
    if ((n > 0 && !seq_microbatch) || (num_microbatches > 0 && !loads))
        return rp_fail(err, RP_EINVAL, "microbatch loads: missing sequence map or output array");
    for (int32_t s = 0; s < n; s++) {
        int32_t mb = seq_microbatch[s];
        if (mb < -1 || mb >= num_microbatches) {
            rp_fail(err, RP_EINVAL,
                    "microbatch loads: sequence %d is in microbatch %d, but there are %d "
                    "microbatches (-1 means not packed)", s, mb, num_microbatches);
            if (err) err->sequence = s;
            return RP_EINVAL;
        }
    }
    const size_t cells = (size_t)stats->num_layers * stats->num_experts;
    if (num_microbatches > 0) memset(loads, 0, (size_t)num_microbatches * cells * sizeof *loads);
    /* 32-bit partial loads (no memory for them: the plain pass gives the same loads) */
    uint32_t *acc = NULL;
    int32_t *narrow = NULL;
    if (num_microbatches > 0 && (size_t)num_microbatches * cells <= SIZE_MAX / 8) {
        acc = rp_alloc(stats->ctx, (size_t)num_microbatches * cells * sizeof *acc);
        narrow = rp_alloc(stats->ctx, (size_t)num_microbatches * sizeof *narrow);
    }
    if (!acc || !narrow) {
        for (int32_t s = 0; s < n; s++)
            if (seq_microbatch[s] >= 0) add_sequence(stats, s, cells, loads + (size_t)seq_microbatch[s] * cells);
    } else {
        loads_narrow(stats, seq_microbatch, num_microbatches, cells, acc, narrow, loads);
    }
    rp_free(stats->ctx, acc);
    rp_free(stats->ctx, narrow);
    return RP_OK;
}

/* Experts are handled in windows of this many ids, so replica counts fit on the stack
 * (this function has no context to allocate from) whatever the expert count. */
#define EXPERT_WINDOW 1024

rp_status rp_loads_per_gpu(const int64_t *expert_load, int32_t num_experts,
                           const int32_t *phy2log, const int32_t *gpu_slot_begin,
                           int32_t num_gpus, int64_t *gpu_load, rp_error *err)
{
    if (num_experts < 1 || num_gpus < 1)
        return rp_fail(err, RP_EINVAL, "per-GPU loads: %d experts and %d GPUs, both must be >= 1",
                       num_experts, num_gpus);
    if (!expert_load || !phy2log || !gpu_slot_begin || !gpu_load)
        return rp_fail(err, RP_EINVAL, "per-GPU loads: missing input or output array");
    if (gpu_slot_begin[0] != 0)
        return rp_fail(err, RP_EINVAL, "per-GPU loads: gpu_slot_begin[0] is %d, must be 0",
                       gpu_slot_begin[0]);
    for (int32_t g = 0; g < num_gpus; g++)
        if (gpu_slot_begin[g + 1] < gpu_slot_begin[g])
            return rp_fail(err, RP_EINVAL,
                           "per-GPU loads: GPU %d has slots [%d, %d), which run backwards", g,
                           gpu_slot_begin[g], gpu_slot_begin[g + 1]);
    const int32_t slots = gpu_slot_begin[num_gpus];
    for (int32_t p = 0; p < slots; p++)
        if (phy2log[p] < 0 || phy2log[p] >= num_experts) {
            rp_fail(err, RP_ERANGE, "per-GPU loads: slot %d holds expert id %d, but there are %d experts",
                    p, phy2log[p], num_experts);
            if (err) err->expert = phy2log[p];
            return RP_ERANGE;
        }
    for (int32_t e = 0; e < num_experts; e++)
        if (expert_load[e] < 0) {
            rp_fail(err, RP_EINVAL, "per-GPU loads: expert %d has a negative load %lld", e,
                    (long long)expert_load[e]);
            if (err) err->expert = e;
            return RP_EINVAL;
        }

    int32_t replicas[EXPERT_WINDOW], seen[EXPERT_WINDOW];
    /* validate every window before writing anything */
    for (int32_t e0 = 0; e0 < num_experts; e0 += EXPERT_WINDOW) {
        int32_t w = num_experts - e0 < EXPERT_WINDOW ? num_experts - e0 : EXPERT_WINDOW;
        memset(replicas, 0, (size_t)w * sizeof *replicas);
        for (int32_t p = 0; p < slots; p++)
            if (phy2log[p] >= e0 && phy2log[p] < e0 + w) replicas[phy2log[p] - e0]++;
        for (int32_t i = 0; i < w; i++)
            if (replicas[i] == 0) {
                rp_fail(err, RP_EINVAL, "per-GPU loads: expert %d has no replica in the %d slots",
                        e0 + i, slots);
                if (err) err->expert = e0 + i;
                return RP_EINVAL;
            }
    }
    memset(gpu_load, 0, (size_t)num_gpus * sizeof *gpu_load);
    for (int32_t e0 = 0; e0 < num_experts; e0 += EXPERT_WINDOW) {
        int32_t w = num_experts - e0 < EXPERT_WINDOW ? num_experts - e0 : EXPERT_WINDOW;
        memset(replicas, 0, (size_t)w * sizeof *replicas);
        memset(seen, 0, (size_t)w * sizeof *seen);
        for (int32_t p = 0; p < slots; p++)
            if (phy2log[p] >= e0 && phy2log[p] < e0 + w) replicas[phy2log[p] - e0]++;
        for (int32_t g = 0; g < num_gpus; g++)
            for (int32_t p = gpu_slot_begin[g]; p < gpu_slot_begin[g + 1]; p++) {
                int32_t e = phy2log[p];
                if (e < e0 || e >= e0 + w) continue;
                int64_t load = expert_load[e], r = replicas[e - e0];
                /* replica i (in slot order) gets load / r, plus one of the remainder
                 * if i < load % r */
                gpu_load[g] += load / r + (seen[e - e0]++ < load % r ? 1 : 0);
            }
    }
    return RP_OK;
}

/* ---- skew -------------------------------------------------------------------- */

rp_skew rp_skew_of(const int64_t *values, int32_t n)
{
    rp_skew k = {0, 0, 0, 0, 0, -1};
    if (n <= 0 || !values) return k;
    long double sum = 0;
    int64_t min = values[0];
    k.max = values[0];
    k.argmax = 0;
    for (int32_t i = 0; i < n; i++) {
        sum += values[i];
        if (values[i] > k.max) k.max = values[i], k.argmax = i;
        if (values[i] < min) min = values[i];
    }
    long double mean = sum / n, var = 0;
    for (int32_t i = 0; i < n; i++) {
        long double d = values[i] - mean;
        var += d * d;
    }
    k.mean = (double)mean;
    if (mean == 0) {
        /* an all-zero vector is perfectly even */
        k.max_over_mean = k.min_over_mean = k.max == 0 && min == 0 ? 1.0 : 0.0;
        return k;
    }
    k.cv = (double)(sqrtl(var / n) / mean);
    k.max_over_mean = (double)(k.max / mean);
    k.min_over_mean = (double)(min / mean);
    return k;
}
