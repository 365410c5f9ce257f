/* Routing statistics: one multi-threaded scan of the routing replay into per-layer
 * expert loads and compact per-sequence histograms, and their accessors. Microbatch and
 * per-GPU loads and skew: core/stats_loads.c. */
#include "internal.h"
#include "gpu_dispatch.h"
#include "routing_access.h"
#include "stats_internal.h"
#include "routepack/gpu.h"
#include "../kernels/gpu_support.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* struct rp_stats: stats_internal.h (core/stats_exchange.c reads and builds it too). */

/* ---- the scan ---------------------------------------------------------------- */

#define MAX_AUTO_THREADS 64
#define MAX_THREADS 256
/* Fewer ids than this per thread and an automatic thread count adds no thread. */
#define MIN_IDS_PER_THREAD (1 << 20)
/* Dense ids are copied in blocks of at most this many into a worker's private
 * snapshot (L1-resident), which is range-checked and then counted: the caller's buffer
 * is read once, so a bad id never indexes the count buffer, even when another thread
 * writes the routing during the scan. Views with more ids per token take the strided
 * path, which checks each id where it uses it. */
#define CHECK_BLOCK_IDS 4096
/* Cache line size: per-worker buffers are padded to it. */
#define LINE 64
/* Entries past the last row of a worker's counts, where an unchecked uint8 id (< 256)
 * of the last layer can land before the check sees it (count_dense_u8_by8). */
#define STATS_COUNTS_SPARE 256

/* What every worker reads. Nothing here is written during the scan but first_bad. */
typedef struct scan {
    const rp_routing *routing;
    const int64_t *cu_seqlens;
    int32_t num_layers, top_k;
    uint32_t num_experts;
    bool dense;          /* each sequence's ids are one contiguous [len, layers, k] run */
    bool layer_outer;    /* strided views: walk layers outside tokens (per-layer arrays) */
    bool check;          /* ids of this width can be >= num_experts (or negative) */
    const uint64_t *stage_offset; /* [num_seqs + 1]: where each sequence's counts go */
    unsigned char *hist;
    uint8_t *width;
    atomic_int first_bad;         /* lowest sequence seen with a bad id; INT_MAX if none */
} scan;

typedef struct worker {
    const scan *sc;
    void *snapshot;      /* CHECK_BLOCK_IDS ids: the block being counted (dense views) */
    int32_t seq_begin, seq_end;
    uint32_t *counts;    /* [layers][experts] of the current sequence */
    int64_t *load;       /* [layers][experts] partial global loads of this worker */
    int32_t bad_seq;     /* first sequence of this range with a bad id, or -1 */
} worker;

/* True when any of n ids is outside [0, limit). Vectorised for the hot path. */
static bool bad_u8(const uint8_t *ids, int64_t n, uint32_t limit)
{
    int64_t i = 0;
    uint8_t top = (uint8_t)(limit - 1);
#if defined(__SSE2__)
    __m128i acc = _mm_setzero_si128(), lim = _mm_set1_epi8((char)top);
    for (; i + 64 <= n; i += 64) {
        const __m128i *p = (const __m128i *)(ids + i);
        __m128i a = _mm_subs_epu8(_mm_loadu_si128(p), lim);
        __m128i b = _mm_subs_epu8(_mm_loadu_si128(p + 1), lim);
        __m128i c = _mm_subs_epu8(_mm_loadu_si128(p + 2), lim);
        __m128i d = _mm_subs_epu8(_mm_loadu_si128(p + 3), lim);
        acc = _mm_or_si128(acc, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d)));
    }
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128())) != 0xFFFF) return true;
#endif
    uint8_t m = 0;
    for (; i < n; i++) m = ids[i] > m ? ids[i] : m;
    return m > top;
}

static bool bad_u16(const uint16_t *ids, int64_t n, uint32_t limit)
{
    int64_t i = 0;
    uint16_t top = (uint16_t)(limit - 1);
#if defined(__SSE2__)
    __m128i acc = _mm_setzero_si128(), lim = _mm_set1_epi16((short)top);
    for (; i + 32 <= n; i += 32) {
        const __m128i *p = (const __m128i *)(ids + i);
        __m128i a = _mm_subs_epu16(_mm_loadu_si128(p), lim);
        __m128i b = _mm_subs_epu16(_mm_loadu_si128(p + 1), lim);
        __m128i c = _mm_subs_epu16(_mm_loadu_si128(p + 2), lim);
        __m128i d = _mm_subs_epu16(_mm_loadu_si128(p + 3), lim);
        acc = _mm_or_si128(acc, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d)));
    }
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128())) != 0xFFFF) return true;
#endif
    uint16_t m = 0;
    for (; i < n; i++) m = ids[i] > m ? ids[i] : m;
    return m > top;
}

static bool bad_i32(const int32_t *ids, int64_t n, uint32_t limit)
{
    int64_t i = 0;
#if defined(__SSE2__)
    /* unsigned compare through the sign flip: negative ids become huge */
    const __m128i flip = _mm_set1_epi32(INT32_MIN);
    const __m128i top = _mm_set1_epi32((int32_t)((limit - 1) ^ 0x80000000u));
    __m128i acc = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) {
        const __m128i *p = (const __m128i *)(ids + i);
        __m128i a = _mm_cmpgt_epi32(_mm_xor_si128(_mm_loadu_si128(p), flip), top);
        __m128i b = _mm_cmpgt_epi32(_mm_xor_si128(_mm_loadu_si128(p + 1), flip), top);
        __m128i c = _mm_cmpgt_epi32(_mm_xor_si128(_mm_loadu_si128(p + 2), flip), top);
        __m128i d = _mm_cmpgt_epi32(_mm_xor_si128(_mm_loadu_si128(p + 3), flip), top);
        acc = _mm_or_si128(acc, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d)));
    }
    if (_mm_movemask_epi8(acc)) return true;
#endif
    uint32_t m = 0;
    for (; i < n; i++) m |= (uint32_t)ids[i] >= limit;
    return m != 0;
}

/* Test seam (routing_access.h): called between checking a block and counting it. */
void (*routing_scan_hook)(void) = NULL;

/* Seam (stats_internal.h): the portable scan only. */
bool stats_portable_scan = false;

/* Count one layer's 8 choices. The ids are read as 64-bit words, not one by one: the
 * loop is bound by memory operations (each count is a load and a store), and this
 * saves a load per id. */
static inline void count8_u8(const uint8_t *p, uint32_t *c)
{
    uint64_t w;
    memcpy(&w, p, 8);
    c[w & 0xFF]++; c[(w >> 8) & 0xFF]++; c[(w >> 16) & 0xFF]++; c[(w >> 24) & 0xFF]++;
    c[(w >> 32) & 0xFF]++; c[(w >> 40) & 0xFF]++; c[(w >> 48) & 0xFF]++; c[w >> 56]++;
}

static inline void count8_u16(const uint16_t *p, uint32_t *c)
{
    uint64_t w[2];
    memcpy(w, p, 16);
    for (int i = 0; i < 2; i++) {
        c[w[i] & 0xFFFF]++; c[(w[i] >> 16) & 0xFFFF]++;
        c[(w[i] >> 32) & 0xFFFF]++; c[w[i] >> 48]++;
    }
}

static inline void count8_i32(const int32_t *p, uint32_t *c)
{
    /* ids are checked before counting, so they are in [0, experts) */
    for (int i = 0; i < 8; i++) c[(uint32_t)p[i]]++;
}

/* Count the contiguous ids of `tokens` tokens: token t, layer l, choice j at
 * ids[(t * layers + l) * k + j], layers * k <= CHECK_BLOCK_IDS. Blocks of tokens are
 * copied into `snap` (read once), checked there and counted from there, so what is
 * counted is what was checked. The common top-8 has its own inner loop (count8_*). */
#define DEFINE_COUNT_DENSE(T, NAME)                                                           \
    static bool count_dense_##NAME(const T *ids, int64_t tokens, int32_t layers, int32_t k,  \
                                   uint32_t experts, bool check, uint32_t *counts, T *snap)   \
    {                                                                                         \
        const int64_t rec = (int64_t)layers * k;                                              \
        const int64_t block = CHECK_BLOCK_IDS / rec;                                          \
        for (int64_t t0 = 0; t0 < tokens; t0 += block) {                                      \
            int64_t n = tokens - t0 < block ? tokens - t0 : block;                            \
            memcpy(snap, ids + t0 * rec, (size_t)(n * rec) * sizeof(T));                      \
            const T *p = snap;                                                                \
            if (check && bad_##NAME(p, n * rec, experts)) return false;                       \
            if (routing_scan_hook) routing_scan_hook();                                       \
            if (k == 8) {                                                                     \
                for (int64_t t = 0; t < n; t++) {                                             \
                    uint32_t *c = counts;                                                     \
                    for (int32_t l = 0; l < layers; l++, p += 8, c += experts) count8_##NAME(p, c); \
                }                                                                             \
            } else {                                                                          \
                for (int64_t t = 0; t < n; t++) {                                             \
                    uint32_t *c = counts;                                                     \
                    for (int32_t l = 0; l < layers; l++, p += k, c += experts)                \
                        for (int32_t j = 0; j < k; j++) c[p[j]]++;                            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        return true;                                                                          \
    }

/* Count any strided view: per layer its own start (rp_routing_at), then tokens and
 * choices by stride. k_stride 1 (choices contiguous, e.g. Megatron's per-layer
 * [tokens, k] buffers) has its own loop. Each id is checked as it is loaded. */
#define DEFINE_COUNT_STRIDED(T, NAME)                                                          \
    static bool count_strided_##NAME(const scan *sc, int32_t seq, int64_t tokens,             \
                                     uint32_t *counts)                                        \
    {                                                                                         \
        const rp_routing *r = sc->routing;                                                    \
        const int64_t ts = r->token_stride, ks = r->k_stride;                                 \
        const int32_t k = sc->top_k, layers = sc->num_layers;                                 \
        const uint32_t experts = sc->num_experts;                                             \
        const bool check = sc->check;                                                         \
        if (routing_scan_hook) routing_scan_hook();                                           \
        if (sc->layer_outer) {                                                                \
            for (int32_t l = 0; l < layers; l++) {                                            \
                const T *p = rp_routing_at(r, sc->cu_seqlens, seq, l);                        \
                uint32_t *c = counts + (size_t)l * experts;                                   \
                for (int64_t t = 0; t < tokens; t++, p += ts)                                 \
                    for (int32_t j = 0; j < k; j++) {                                         \
                        uint32_t id = (uint32_t)p[ks == 1 ? j : j * ks];                      \
                        if (check && id >= experts) return false;                             \
                        c[id]++;                                                              \
                    }                                                                         \
            }                                                                                 \
            return true;                                                                      \
        }                                                                                     \
        const T *p0 = rp_routing_at(r, sc->cu_seqlens, seq, 0);                               \
        const int64_t ls = r->layer_stride;                                                   \
        for (int64_t t = 0; t < tokens; t++, p0 += ts) {                                      \
            const T *p = p0;                                                                  \
            uint32_t *c = counts;                                                             \
            for (int32_t l = 0; l < layers; l++, p += ls, c += experts)                       \
                for (int32_t j = 0; j < k; j++) {                                             \
                    uint32_t id = (uint32_t)p[ks == 1 ? j : j * ks];                          \
                    if (check && id >= experts) return false;                                 \
                    c[id]++;                                                                  \
                }                                                                             \
        }                                                                                     \
        return true;                                                                          \
    }

#if defined(__SSE2__)
/* Dense uint8 ids, top-k a multiple of 8: the scan's hot case (up to 256 experts take
 * uint8 ids, and top-8 is the common k). Each 8 choices of a layer are one 64-bit word,
 * loaded once from the caller's buffer: the word is counted and its bytes are folded into
 * a running maximum (in a register, from the same load), which is checked once the
 * sequence is counted. So the value counted is the value checked, as with the snapshot,
 * without copying the ids first (the copy and the separate check cost about a quarter of
 * the portable scan). An id >= experts is counted before the check sees it: `counts` has
 * STATS_COUNTS_SPARE entries past its last row, so such an id still lands inside it (the
 * sequence is then reported, and its counts are never used). */
/* Count one layer's 8 ids, one 64-bit word. */
static inline void count_word(const uint8_t *p, uint32_t *c)
{
    uint64_t w;
    memcpy(&w, p, 8);
    c[w & 0xFF]++; c[(w >> 8) & 0xFF]++; c[(w >> 16) & 0xFF]++; c[(w >> 24) & 0xFF]++;
    c[(w >> 32) & 0xFF]++; c[(w >> 40) & 0xFF]++; c[(w >> 48) & 0xFF]++; c[w >> 56]++;
}

static bool count_dense_u8_by8(const uint8_t *ids, int64_t tokens, int32_t layers, int32_t k,
                               uint32_t experts, bool check, uint32_t *counts)
{
    const int64_t rec = (int64_t)layers * k;
    const int64_t block = CHECK_BLOCK_IDS / rec > 0 ? CHECK_BLOCK_IDS / rec : 1;
    const int32_t words = k / 8;
    __m128i top = _mm_setzero_si128();
    for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        int64_t n = tokens - t0 < block ? tokens - t0 : block;
        /* the test seam, where another thread could change ids not read yet */
        if (routing_scan_hook) routing_scan_hook();
        if (words == 1) {
            /* top-8, the common case: two layers a step, their 16 ids folded into the
             * maximum with one load (about a tenth faster than a word at a time) */
            for (int64_t t = 0; t < n; t++) {
                uint32_t *c = counts;
                int32_t l = 0;
                for (; l + 1 < layers; l += 2, c += 2 * (size_t)experts, ids += 16) {
                    top = _mm_max_epu8(top, _mm_loadu_si128((const __m128i *)ids));
                    count_word(ids, c);
                    count_word(ids + 8, c + experts);
                }
                if (l < layers) {
                    top = _mm_max_epu8(top, _mm_loadl_epi64((const __m128i *)ids));
                    count_word(ids, c);
                    ids += 8;
                }
            }
            continue;
        }
        for (int64_t t = 0; t < n; t++) {
            uint32_t *c = counts;
            for (int32_t l = 0; l < layers; l++, c += experts)
                for (int32_t i = 0; i < words; i++, ids += 8) {
                    top = _mm_max_epu8(top, _mm_loadl_epi64((const __m128i *)ids));
                    count_word(ids, c);
                }
        }
    }
    if (!check) return true;
    uint8_t bytes[16];
    _mm_storeu_si128((__m128i *)bytes, top);
    uint8_t max = 0;
    for (int i = 0; i < 16; i++) max = bytes[i] > max ? bytes[i] : max;
    return max < experts;
}
#endif

DEFINE_COUNT_DENSE(uint8_t, u8)
DEFINE_COUNT_DENSE(uint16_t, u16)
DEFINE_COUNT_DENSE(int32_t, i32)
DEFINE_COUNT_STRIDED(uint8_t, u8)
DEFINE_COUNT_STRIDED(uint16_t, u16)
DEFINE_COUNT_STRIDED(int32_t, i32)

static bool count_seq(const scan *sc, int32_t seq, int64_t tokens, uint32_t *counts, void *snap)
{
    const rp_routing *r = sc->routing;
    if (sc->dense) {
        const void *ids = rp_routing_at(r, sc->cu_seqlens, seq, 0);
#if defined(__SSE2__)
        if (r->width == RP_ID_U8 && sc->top_k % 8 == 0 && !stats_portable_scan)
            return count_dense_u8_by8(ids, tokens, sc->num_layers, sc->top_k, sc->num_experts, sc->check,
                                      counts);
#endif
        switch (r->width) {
        case RP_ID_U8:
            return count_dense_u8(ids, tokens, sc->num_layers, sc->top_k, sc->num_experts,
                                  sc->check, counts, snap);
        case RP_ID_U16:
            return count_dense_u16(ids, tokens, sc->num_layers, sc->top_k, sc->num_experts,
                                   sc->check, counts, snap);
        default:
            return count_dense_i32(ids, tokens, sc->num_layers, sc->top_k, sc->num_experts,
                                   sc->check, counts, snap);
        }
    }
    switch (r->width) {
    case RP_ID_U8: return count_strided_u8(sc, seq, tokens, counts);
    case RP_ID_U16: return count_strided_u16(sc, seq, tokens, counts);
    default: return count_strided_i32(sc, seq, tokens, counts);
    }
}

static int width_for(uint32_t max_count)
{
    return max_count == 0 ? 0 : max_count <= UINT8_MAX ? 1 : max_count <= UINT16_MAX ? 2 : 4;
}

/* Bytes per count reserved for a sequence before its counts are known: enough for
 * len * k, the most any count can reach. */
static int stage_width(int64_t len, int32_t top_k)
{
    return len == 0 ? 0 : width_for((uint32_t)(len * top_k));
}

/* Counts of 2 and 4 bytes sit wherever the sequences before them end (a sequence takes
 * layers x experts x its width bytes, which may be odd), so they are read and written
 * byte-wise, never through a uint16_t or uint32_t pointer (a misaligned access is
 * undefined behaviour). */
static inline uint32_t load_u16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t load_u32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Narrow n counts into `width` bytes each. */
static void store_counts(const uint32_t *counts, size_t n, int width, unsigned char *out)
{
    switch (width) {
    case 1:
        for (size_t i = 0; i < n; i++) out[i] = (uint8_t)counts[i];
        break;
    case 2: {
        for (size_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)counts[i];
            memcpy(out + i * sizeof v, &v, sizeof v);
        }
        break;
    }
    case 4: memcpy(out, counts, n * sizeof *counts); break;
    default: break;
    }
}

static void *work(void *arg)
{
    worker *w = arg;
    const scan *sc = w->sc;
    const size_t cells = (size_t)sc->num_layers * sc->num_experts;
    for (int32_t s = w->seq_begin; s < w->seq_end; s++) {
        /* a lower sequence already failed: nothing this worker finds can be reported */
        if (atomic_load_explicit((atomic_int *)&sc->first_bad, memory_order_relaxed) < s) break;
        int64_t len = sc->cu_seqlens[s + 1] - sc->cu_seqlens[s];
        if (len == 0) {
            sc->width[s] = 0;
            continue;
        }
        memset(w->counts, 0, cells * sizeof *w->counts);
        if (!count_seq(sc, s, len, w->counts, w->snapshot)) {
            w->bad_seq = s;
            int cur = atomic_load_explicit((atomic_int *)&sc->first_bad, memory_order_relaxed);
            while (s < cur && !atomic_compare_exchange_weak((atomic_int *)&sc->first_bad, &cur, s)) {
            }
            break;
        }
        uint32_t max = 0;
        for (size_t i = 0; i < cells; i++) {
            max = w->counts[i] > max ? w->counts[i] : max;
            w->load[i] += w->counts[i];
        }
        int width = width_for(max);
        /* stored at its final width inside the staged slot; compaction moves it down */
        store_counts(w->counts, cells, width, sc->hist + sc->stage_offset[s]);
        sc->width[s] = (uint8_t)width;
    }
    return NULL;
}

/* The first bad id of a sequence in rp_routing_check's order (layer, token, choice),
 * so the report does not depend on the layout or the thread count. */
static rp_status report_bad(const rp_routing *r, const int64_t *cu, int32_t seq,
                            int32_t num_experts, rp_error *err)
{
    int64_t len = cu[seq + 1] - cu[seq];
    for (int32_t l = 0; l < r->num_layers; l++) {
        const void *at = rp_routing_at(r, cu, seq, l);
        for (int64_t t = 0; t < len; t++)
            for (int32_t j = 0; j < r->top_k; j++) {
                int32_t id = rp_id_load(at, r->width, t * r->token_stride + j * r->k_stride);
                if (id < 0 || id >= num_experts) {
                    rp_fail(err, RP_ERANGE,
                            "routing: sequence %d token %lld layer %d choice %d has expert id %d, "
                            "but the model has %d experts",
                            seq, (long long)t, l, j, id, num_experts);
                    if (err) err->sequence = seq, err->expert = id;
                    return RP_ERANGE;
                }
            }
    }
    return rp_fail(err, RP_ERANGE, "routing: sequence %d has an expert id out of range", seq);
}

static int32_t pick_threads(int32_t requested, int32_t num_seqs, int64_t num_ids)
{
    int64_t n = requested;
    if (n <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus < 1 ? 1 : cpus > MAX_AUTO_THREADS ? MAX_AUTO_THREADS : cpus;
        int64_t by_work = num_ids / MIN_IDS_PER_THREAD;
        if (n > by_work) n = by_work;
    }
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n > num_seqs) n = num_seqs;
    return n < 1 ? 1 : (int32_t)n;
}

/* First sequence of worker i's share: sequences are split so that each worker gets an
 * equal share of ids to count plus a fixed cost per sequence (clearing and storing its
 * histograms), not an equal number of sequences. */
static int32_t split_point(const int64_t *cu, int32_t num_seqs, int64_t ids_per_token,
                           int64_t cells, int64_t i, int64_t parts)
{
    __int128 total = (__int128)cu[num_seqs] * ids_per_token + (__int128)num_seqs * cells;
    __int128 goal = total * i / parts;
    int32_t lo = 0, hi = num_seqs; /* first s with weight(s) >= goal */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        __int128 wmid = (__int128)cu[mid] * ids_per_token + (__int128)mid * cells;
        if (wmid < goal) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void rp_stats_free(rp_stats *stats)
{
    if (!stats) return;
    rp_context *ctx = stats->ctx;
    rp_free(ctx, stats->expert_load);
    rp_free(ctx, stats->width);
    rp_free(ctx, stats->offset);
    rp_free(ctx, stats->hist);
    rp_free(ctx, stats);
}

/* ---- dense counts (the GPU path) --------------------------------------------- */

rp_status stats_from_rows(rp_context *ctx, int32_t num_seqs, int32_t num_layers, int32_t num_experts,
                          int32_t top_k, int64_t num_tokens, stats_row_fn row, void *ud,
                          const int64_t *expert_load, rp_stats **out, rp_error *err)
{
    const int32_t n = num_seqs;
    if (n < 0 || num_layers < 1 || num_experts < 1)
        return rp_fail(err, RP_EINVAL, "stats: %d sequences, %d layers, %d experts", n, num_layers,
                       num_experts);
    const size_t cells = (size_t)num_layers * (size_t)num_experts;
    if (cells > SIZE_MAX / sizeof(int64_t) || (n > 0 && cells > SIZE_MAX / 4 / (size_t)n))
        return rp_fail(err, RP_ERANGE, "stats: the histograms of %d sequences overflow memory", n);
    rp_status st = RP_OK;
    uint32_t *counts = NULL;
    rp_stats *stats = rp_calloc(ctx, 1, sizeof *stats);
    if (!stats) return rp_fail_nomem(err, "routing statistics");
    stats->ctx = ctx;
    stats->num_seqs = n;
    stats->num_layers = num_layers;
    stats->num_experts = num_experts;
    stats->top_k = top_k;
    stats->num_tokens = num_tokens;
    stats->expert_load = rp_alloc(ctx, cells * sizeof(int64_t));
    stats->width = rp_alloc(ctx, (size_t)n + 1);
    stats->offset = rp_alloc(ctx, ((size_t)n + 1) * sizeof(uint64_t));
    counts = rp_alloc(ctx, cells * sizeof *counts);
    if (!stats->expert_load || !stats->width || !stats->offset || !counts) {
        st = rp_fail_nomem(err, "routing statistics");
        goto out;
    }
    /* the scan's storage: each sequence at the width of its largest count, back to back */
    uint64_t pos = 0;
    for (int32_t s = 0; s < n; s++) {
        row(ud, s, counts);
        uint32_t max = 0;
        for (size_t i = 0; i < cells; i++) max = counts[i] > max ? counts[i] : max;
        stats->width[s] = (uint8_t)width_for(max);
        stats->offset[s] = pos;
        pos += cells * stats->width[s];
    }
    stats->offset[n] = pos;
    stats->hist = rp_alloc(ctx, (size_t)pos);
    if (!stats->hist) {
        st = rp_fail_nomem(err, "routing statistics");
        goto out;
    }
    for (int32_t s = 0; s < n; s++) {
        if (!stats->width[s]) continue;
        row(ud, s, counts);
        store_counts(counts, cells, stats->width[s], stats->hist + stats->offset[s]);
    }
    memcpy(stats->expert_load, expert_load, cells * sizeof(int64_t));
    stats->bytes = sizeof *stats + cells * sizeof(int64_t) + ((size_t)n + 1) +
                   ((size_t)n + 1) * sizeof(uint64_t) + (size_t)pos;
    *out = stats;
    stats = NULL;
out:
    rp_free(ctx, counts);
    rp_stats_free(stats);
    return st;
}

typedef struct dense_rows {
    const uint32_t *seq_hist;
    size_t cells;
} dense_rows;

static void dense_row(void *ud, int32_t seq, uint32_t *counts)
{
    const dense_rows *d = ud;
    memcpy(counts, d->seq_hist + (size_t)seq * d->cells, d->cells * sizeof *counts);
}

rp_status stats_from_counts(rp_context *ctx, int32_t num_seqs, int32_t num_layers,
                            int32_t num_experts, int32_t top_k, int64_t num_tokens,
                            const uint32_t *seq_hist, const int64_t *expert_load,
                            rp_stats **out, rp_error *err)
{
    dense_rows d = {seq_hist, (size_t)(num_layers > 0 ? num_layers : 0) * (size_t)(num_experts > 0 ? num_experts : 0)};
    return stats_from_rows(ctx, num_seqs, num_layers, num_experts, top_k, num_tokens, dense_row, &d, expert_load,
                           out, err);
}

bool stats_same(const rp_stats *a, const rp_stats *b)
{
    if (a->num_seqs != b->num_seqs || a->num_layers != b->num_layers ||
        a->num_experts != b->num_experts || a->top_k != b->top_k ||
        a->num_tokens != b->num_tokens || a->bytes != b->bytes)
        return false;
    const size_t n = (size_t)a->num_seqs, cells = (size_t)a->num_layers * a->num_experts;
    return memcmp(a->expert_load, b->expert_load, cells * sizeof(int64_t)) == 0 &&
           memcmp(a->width, b->width, n) == 0 &&
           memcmp(a->offset, b->offset, (n + 1) * sizeof(uint64_t)) == 0 &&
           memcmp(a->hist, b->hist, (size_t)a->offset[n]) == 0;
}

/* Routing ids in device memory: the histogram kernel's dense counts (n x layers x
 * experts uint32 on the host for the length of the call), stored as the scan stores
 * them. The batch's cu_seqlens go up to the device for the call. */
static rp_status compute_on_device(rp_context *ctx, const rp_batch *batch, const rp_routing *routing,
                                   int32_t num_experts, rp_stats **out, rp_error *err)
{
    const int32_t n = rp_batch_num_seqs(batch), layers = routing->num_layers;
    const size_t cells = (size_t)layers * (size_t)num_experts;
    if ((n > 0 && cells > SIZE_MAX / sizeof(uint32_t) / (size_t)n))
        return rp_fail(err, RP_ERANGE, "stats: the dense histograms of %d sequences overflow memory", n);
    rp_status st;
    void *cu_dev = NULL;
    uint32_t *seq_hist = rp_alloc(ctx, (size_t)n * cells * sizeof *seq_hist);
    int64_t *load = rp_alloc(ctx, cells * sizeof *load);
    if (!seq_hist || !load) {
        st = rp_fail_nomem(err, "routing statistics (dense GPU histograms)");
        goto out;
    }
    RP_CHECK_GOTO(rp_gpu_dev_upload(rp_batch_cu_seqlens(batch), ((size_t)n + 1) * sizeof(int64_t),
                                    &cu_dev, err), st, out);
    st = rp_gpu_routing_histograms(routing, cu_dev, n, num_experts, seq_hist, load, err);
    if (st == RP_ERANGE) gpu_error_as_cpu(err); /* no statistics: nothing was "counted in none" */
    if (st != RP_OK) goto out;
    st = stats_from_counts(ctx, n, layers, num_experts, routing->top_k, rp_batch_num_tokens(batch),
                           seq_hist, load, out, err);
out:
    rp_gpu_dev_free(cu_dev);
    rp_free(ctx, seq_hist);
    rp_free(ctx, load);
    return st;
}

/* ---- the call ---------------------------------------------------------------- */

rp_status rp_stats_compute(rp_context *ctx, const rp_batch *batch, const rp_routing *routing,
                           int32_t num_experts, int32_t num_threads, rp_stats **out,
                           rp_error *err)
{
    rp_status st = rp_routing_check_shape(routing, batch, num_experts, err);
    if (st != RP_OK) return st;

    const int32_t n = rp_batch_num_seqs(batch);
    const int32_t layers = routing->num_layers, k = routing->top_k;
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    const int64_t tokens = rp_batch_num_tokens(batch);
    const size_t cells = (size_t)layers * (size_t)num_experts;

    /* Sizes: the largest element index the view can reach, and the staged histograms. */
    int64_t last, tmp;
    if (tokens > 0 &&
        (rp_mul_overflow(tokens - 1, routing->token_stride, &last) ||
         rp_mul_overflow((int64_t)layers - 1, routing->layer_stride, &tmp) ||
         rp_add_overflow(last, tmp, &last) ||
         rp_mul_overflow((int64_t)k - 1, routing->k_stride, &tmp) ||
         rp_add_overflow(last, tmp, &last) || rp_mul_overflow(last, 4, &tmp)))
        return rp_fail(err, RP_ERANGE, "routing: strides overflow a 64-bit index");
    int64_t num_ids;
    if (rp_mul_overflow(tokens, (int64_t)layers * k, &num_ids))
        return rp_fail(err, RP_ERANGE, "routing: %lld tokens x %d layers x top-%d overflows",
                       (long long)tokens, layers, k);
    int64_t stage_bytes = 0;
    for (int32_t s = 0; s < n; s++) {
        int64_t len = cu[s + 1] - cu[s], b;
        if (len * k > (int64_t)UINT32_MAX) {
            rp_fail(err, RP_ERANGE,
                    "stats: sequence %d has %lld tokens x top-%d choices, more than a 32-bit count holds",
                    s, (long long)len, k);
            if (err) err->sequence = s;
            return RP_ERANGE;
        }
        if (rp_mul_overflow((int64_t)cells, stage_width(len, k), &b) ||
            rp_add_overflow(stage_bytes, b, &stage_bytes) || (uint64_t)stage_bytes > SIZE_MAX / 2)
            return rp_fail(err, RP_ERANGE, "stats: the histograms of %d sequences overflow memory", n);
    }

    if (cells > SIZE_MAX / (16 * (size_t)MAX_THREADS))
        return rp_fail(err, RP_ERANGE, "stats: %d layers x %d experts overflow memory", layers,
                       num_experts);
    bool on_device;
    if ((st = gpu_routing_on_device(routing, batch, "stats", &on_device, err)) != RP_OK) return st;
    if (on_device) return compute_on_device(ctx, batch, routing, num_experts, out, err);

    const int32_t nthreads = pick_threads(num_threads, n, num_ids);
    rp_stats *stats = rp_calloc(ctx, 1, sizeof *stats);
    unsigned char *scratch = NULL;
    if (!stats) return rp_fail_nomem(err, "routing statistics");
    stats->ctx = ctx;
    stats->num_seqs = n;
    stats->num_layers = layers;
    stats->num_experts = num_experts;
    stats->top_k = k;
    stats->num_tokens = tokens;
    stats->expert_load = rp_calloc(ctx, cells, sizeof(int64_t));
    stats->width = rp_alloc(ctx, (size_t)n + 1);
    stats->offset = rp_alloc(ctx, ((size_t)n + 1) * sizeof(uint64_t));
    stats->hist = rp_alloc(ctx, (size_t)stage_bytes);
    /* Per worker: partial loads and counts, each padded to whole cache lines so that
     * workers never write to a line another one writes; then the worker records and
     * thread ids. The block is aligned to a line by hand (the hook only promises 16). */
    size_t loads_stride = (cells * sizeof(int64_t) + 2 * LINE - 1) / LINE * LINE;
    size_t counts_stride = ((cells + STATS_COUNTS_SPARE) * sizeof(uint32_t) + 2 * LINE - 1) / LINE * LINE;
    size_t workers_bytes = ((size_t)nthreads * sizeof(worker) + LINE - 1) / LINE * LINE;
    size_t snapshot_stride = (size_t)CHECK_BLOCK_IDS * sizeof(int32_t);
    size_t per_worker_bytes = loads_stride + counts_stride + snapshot_stride;
    scratch = rp_alloc(ctx, LINE + (size_t)nthreads * per_worker_bytes + workers_bytes +
                                (size_t)nthreads * sizeof(pthread_t));
    if (!stats->expert_load || !stats->width || !stats->offset || !stats->hist || !scratch) {
        st = rp_fail_nomem(err, "routing statistics");
        goto out;
    }

    stats->offset[0] = 0;
    for (int32_t s = 0; s < n; s++)
        stats->offset[s + 1] = stats->offset[s] + cells * (size_t)stage_width(cu[s + 1] - cu[s], k);

    scan sc = {
        .routing = routing,
        .cu_seqlens = cu,
        .num_layers = layers,
        .top_k = k,
        .num_experts = (uint32_t)num_experts,
        .dense = (int64_t)layers * k <= CHECK_BLOCK_IDS && routing->k_stride == 1 && routing->layer_stride == k &&
                 routing->token_stride == (int64_t)layers * k &&
                 (routing->layout == RP_ROUTING_PACKED || routing->layout == RP_ROUTING_PER_SEQ),
        .layer_outer = routing->layout == RP_ROUTING_PER_LAYER ||
                       routing->layer_stride > routing->token_stride,
        .check = rp_id_width_capacity(routing->width) > num_experts || routing->width == RP_ID_I32,
        .stage_offset = stats->offset,
        .hist = stats->hist,
        .width = stats->width,
    };
    atomic_init(&sc.first_bad, INT_MAX);

    unsigned char *aligned = scratch + (LINE - (uintptr_t)scratch % LINE) % LINE;
    worker *workers = (worker *)(aligned + (size_t)nthreads * per_worker_bytes);
    pthread_t *threads = (pthread_t *)((unsigned char *)workers + workers_bytes);
    bool threads_ok[MAX_THREADS];
    for (int32_t i = 0; i < nthreads; i++) {
        memset(aligned + (size_t)i * per_worker_bytes, 0, loads_stride);
        workers[i] = (worker){
            .sc = &sc,
            .seq_begin = split_point(cu, n, (int64_t)layers * k, (int64_t)cells, i, nthreads),
            .seq_end = split_point(cu, n, (int64_t)layers * k, (int64_t)cells, i + 1, nthreads),
            .load = (int64_t *)(aligned + (size_t)i * per_worker_bytes),
            .counts = (uint32_t *)(aligned + (size_t)i * per_worker_bytes + loads_stride),
            .snapshot = aligned + (size_t)i * per_worker_bytes + loads_stride + counts_stride,
            .bad_seq = -1,
        };
    }
    /* Worker 0 runs in the calling thread; a thread that cannot be started has its
     * share run here too, so the result never depends on how many threads ran. */
    for (int32_t i = 1; i < nthreads; i++)
        threads_ok[i] = pthread_create(&threads[i], NULL, work, &workers[i]) == 0;
    work(&workers[0]);
    for (int32_t i = 1; i < nthreads; i++) {
        if (threads_ok[i]) pthread_join(threads[i], NULL);
        else work(&workers[i]);
    }

    for (int32_t i = 0; i < nthreads; i++)
        if (workers[i].bad_seq >= 0) {
            st = report_bad(routing, cu, workers[i].bad_seq, num_experts, err);
            goto out;
        }

    for (int32_t i = 0; i < nthreads; i++) {
        const int64_t *l = workers[i].load;
        for (size_t c = 0; c < cells; c++) stats->expert_load[c] += l[c];
    }

    /* Compact in place: each sequence moves down to its final offset. A sequence's
     * final block is never larger than its staged one, so moving them in order never
     * overwrites a block not yet moved. */
    uint64_t pos = 0;
    for (int32_t s = 0; s < n; s++) {
        uint64_t from = stats->offset[s];
        size_t size = cells * stats->width[s];
        if (size && pos != from) memmove(stats->hist + pos, stats->hist + from, size);
        stats->offset[s] = pos;
        pos += size;
    }
    stats->offset[n] = pos;
    size_t hist_bytes = (size_t)stage_bytes;
    if (pos < hist_bytes) {
        /* a failed shrink only costs memory: keep the larger block */
        unsigned char *shrunk = rp_realloc(ctx, stats->hist, pos);
        if (shrunk) stats->hist = shrunk, hist_bytes = pos;
    }
    stats->bytes = sizeof *stats + cells * sizeof(int64_t) + ((size_t)n + 1) +
                   ((size_t)n + 1) * sizeof(uint64_t) + hist_bytes;
    *out = stats;
    stats = NULL;
out:
    rp_free(ctx, scratch);
    rp_stats_free(stats);
    return st;
}

/* ---- access ------------------------------------------------------------------ */

int32_t rp_stats_num_seqs(const rp_stats *stats) { return stats->num_seqs; }
int32_t rp_stats_num_layers(const rp_stats *stats) { return stats->num_layers; }
int32_t rp_stats_num_experts(const rp_stats *stats) { return stats->num_experts; }
size_t rp_stats_bytes(const rp_stats *stats) { return stats->bytes; }

const int64_t *rp_stats_expert_load(const rp_stats *stats, int32_t layer)
{
    if (layer < 0 || layer >= stats->num_layers) return NULL;
    return stats->expert_load + (size_t)layer * stats->num_experts;
}

/* Start of (seq, layer) and its width; width 0 for all-zero or out-of-range requests. */
static const unsigned char *seq_row(const rp_stats *stats, int32_t seq, int32_t layer, int *width)
{
    *width = 0;
    if (seq < 0 || seq >= stats->num_seqs || layer < 0 || layer >= stats->num_layers) return NULL;
    *width = stats->width[seq];
    return stats->hist + stats->offset[seq] + (size_t)layer * stats->num_experts * *width;
}

void rp_stats_seq_hist(const rp_stats *stats, int32_t seq, int32_t layer, uint32_t *counts)
{
    int width;
    const unsigned char *row = seq_row(stats, seq, layer, &width);
    const int32_t e = stats->num_experts;
    switch (width) {
    case 1:
        for (int32_t i = 0; i < e; i++) counts[i] = row[i];
        break;
    case 2:
        for (int32_t i = 0; i < e; i++) counts[i] = load_u16(row + 2 * (size_t)i);
        break;
    case 4: memcpy(counts, row, (size_t)e * sizeof *counts); break;
    default: memset(counts, 0, (size_t)e * sizeof *counts); break;
    }
}

uint32_t rp_stats_seq_count(const rp_stats *stats, int32_t seq, int32_t layer, int32_t expert)
{
    int width;
    const unsigned char *row = seq_row(stats, seq, layer, &width);
    if (expert < 0 || expert >= stats->num_experts) return 0;
    switch (width) {
    case 1: return row[expert];
    case 2: return load_u16(row + 2 * (size_t)expert);
    case 4: return load_u32(row + 4 * (size_t)expert);
    default: return 0;
    }
}
