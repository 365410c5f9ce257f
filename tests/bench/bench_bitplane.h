/* bench_stats's scan without a store per id: bit-sliced counting of dense uint8 top-8
 * routing with AVX-512 (VBMI, VPOPCNTDQ, GFNI), to measure whether it beats the per-id
 * counters of rp_stats_compute on this CPU. Not in the library: on the Zen 4 it was
 * measured on it is slower (bench_stats prints both).
 *
 * For 8 tokens x 8 layers (512 ids, 8 zmm loads): GF2P8AFFINEQB with the ids as the
 * matrix transposes each layer's 8 ids into 8 bit planes (byte i = bit i of the 8
 * choices), and a 3-stage VPERMT2B transpose gathers plane i of the 64 (token, layer)
 * pairs into one register P_i whose qword q holds layer q's 64 bits. Expert e's ids are
 * then the AND over the planes of P_i or ~P_i by e's bits (VPTERNLOG, three planes an
 * operation), and VPOPCNTQ of that counts them per layer, added into 16 accumulators a
 * block of 16 experts: about 3 vector operations per expert per 512 ids, against one
 * load and one store per id for counters. */
#ifndef RP_BENCH_BITPLANE_H
#define RP_BENCH_BITPLANE_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BITPLANE_AVAILABLE 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BITPLANE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vpopcntdq,gfni")))
enum { BITPLANE_SUPER = 16 }; /* blocks of 8 tokens whose planes are made before counting */

/* True when this CPU has what the kernel uses. */
static int bitplane_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vpopcntdq") &&
           __builtin_cpu_supports("gfni");
}

/* The byte permutations of the 8x8 transpose's stage s (swap distance b = 4 >> s) for a
 * pair of registers (r, r + b): new_r[i] = i & b ? old_{r+b}[i - b] : old_r[i] and
 * new_{r+b}[i] = i & b ? old_{r+b}[i] : old_r[i + b], within each qword. */
static uint8_t bitplane_perm_lo[3][64], bitplane_perm_hi[3][64];

static void bitplane_init(void)
{
    for (int s = 0; s < 3; s++) {
        int b = 4 >> s;
        for (int q = 0; q < 8; q++)
            for (int i = 0; i < 8; i++) {
                bitplane_perm_lo[s][8 * q + i] = (uint8_t)(i & b ? 64 + 8 * q + i - b : 8 * q + i);
                bitplane_perm_hi[s][8 * q + i] = (uint8_t)(i & b ? 64 + 8 * q + i : 8 * q + i + b);
            }
    }
}

/* Planes of 8 tokens (records `rec` bytes apart) x the 8 layers at p, `lanes` the bytes
 * that are ids (the last group of layers may be short). */
BITPLANE_TARGET __attribute__((always_inline)) static inline void
bitplane_planes(const uint8_t *p, int64_t rec, __mmask64 lanes, __m512i *out)
{
    const __m512i unit = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    __m512i a[8];
    for (int r = 0; r < 8; r++)
        a[r] = _mm512_gf2p8affine_epi64_epi8(unit, _mm512_maskz_loadu_epi8(lanes, p + r * rec), 0);
#define BITPLANE_SWAP(s, r, b)                                                                   \
    do {                                                                                         \
        __m512i x_ = a[r], y_ = a[(r) + (b)];                                                    \
        a[r] = _mm512_permutex2var_epi8(x_, lo##s, y_);                                          \
        a[(r) + (b)] = _mm512_permutex2var_epi8(x_, hi##s, y_);                                  \
    } while (0)
    const __m512i lo0 = _mm512_loadu_si512(bitplane_perm_lo[0]), hi0 = _mm512_loadu_si512(bitplane_perm_hi[0]);
    const __m512i lo1 = _mm512_loadu_si512(bitplane_perm_lo[1]), hi1 = _mm512_loadu_si512(bitplane_perm_hi[1]);
    const __m512i lo2 = _mm512_loadu_si512(bitplane_perm_lo[2]), hi2 = _mm512_loadu_si512(bitplane_perm_hi[2]);
    BITPLANE_SWAP(0, 0, 4); BITPLANE_SWAP(0, 1, 4); BITPLANE_SWAP(0, 2, 4); BITPLANE_SWAP(0, 3, 4);
    BITPLANE_SWAP(1, 0, 2); BITPLANE_SWAP(1, 1, 2); BITPLANE_SWAP(1, 4, 2); BITPLANE_SWAP(1, 5, 2);
    BITPLANE_SWAP(2, 0, 1); BITPLANE_SWAP(2, 2, 1); BITPLANE_SWAP(2, 4, 1); BITPLANE_SWAP(2, 6, 1);
#undef BITPLANE_SWAP
    for (int i = 0; i < 8; i++) out[i] = a[i];
}

/* Experts 16h .. 16h+15 over nblocks blocks of planes: cnt[c * 8 + q] += ids of expert
 * 16h + c at layer q of the group. `bits`: planes the ids use (4 to 8). */
BITPLANE_TARGET static void bitplane_chunk(const __m512i *planes, int nblocks, int h, int bits, uint64_t *cnt)
{
    __m512i acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_si512();
    for (int blk = 0; blk < nblocks; blk++) {
        const __m512i *p = planes + 8 * blk;
        __m512i hm = _mm512_set1_epi64(-1);
        for (int i = 4; i < bits; i++)
            hm = (h >> (i - 4)) & 1 ? _mm512_and_si512(hm, p[i]) : _mm512_andnot_si512(p[i], hm);
        /* x[a]: hm and bits 3, 2 of the expert equal to a's; then bits 1, 0 */
        __m512i x0 = _mm512_ternarylogic_epi64(hm, p[3], p[2], 1 << 4);
        __m512i x1 = _mm512_ternarylogic_epi64(hm, p[3], p[2], 1 << 5);
        __m512i x2 = _mm512_ternarylogic_epi64(hm, p[3], p[2], 1 << 6);
        __m512i x3 = _mm512_ternarylogic_epi64(hm, p[3], p[2], 1 << 7);
#define BITPLANE_COUNT(c, x, m) \
    acc[c] = _mm512_add_epi64(acc[c], _mm512_popcnt_epi64(_mm512_ternarylogic_epi64(x, p[1], p[0], 1 << (4 + (m)))))
        BITPLANE_COUNT(0, x0, 0); BITPLANE_COUNT(1, x0, 1); BITPLANE_COUNT(2, x0, 2); BITPLANE_COUNT(3, x0, 3);
        BITPLANE_COUNT(4, x1, 0); BITPLANE_COUNT(5, x1, 1); BITPLANE_COUNT(6, x1, 2); BITPLANE_COUNT(7, x1, 3);
        BITPLANE_COUNT(8, x2, 0); BITPLANE_COUNT(9, x2, 1); BITPLANE_COUNT(10, x2, 2); BITPLANE_COUNT(11, x2, 3);
        BITPLANE_COUNT(12, x3, 0); BITPLANE_COUNT(13, x3, 1); BITPLANE_COUNT(14, x3, 2); BITPLANE_COUNT(15, x3, 3);
#undef BITPLANE_COUNT
    }
    for (int c = 0; c < 16; c++)
        _mm512_storeu_si512(cnt + 8 * c, _mm512_add_epi64(_mm512_loadu_si512(cnt + 8 * c), acc[c]));
}

/* Adds the counts of `tokens` tokens of dense uint8 top-8 ids [tokens][layers][8], every id
 * below `experts` <= 256, to counts[layer * experts + e]. Scratch: cnt of
 * ceil(layers / 8) * 256 * 8 uint64 and planes of ceil(layers / 8) * BITPLANE_SUPER * 8
 * zmm, both 64-byte aligned. */
BITPLANE_TARGET static void bitplane_count(const uint8_t *ids, int64_t tokens, int32_t layers, int32_t experts,
                                           uint32_t *counts, uint64_t *cnt, __m512i *planes)
{
    const int64_t rec = (int64_t)layers * 8;
    int bits = 4;
    while ((1 << bits) < experts) bits++;
    const int chunks = (experts + 15) / 16, groups = (layers + 7) / 8;
    memset(cnt, 0, (size_t)groups * 256 * 8 * sizeof *cnt);
    const int64_t full = tokens / 8 * 8;
    for (int64_t t0 = 0; t0 < full; t0 += 8 * BITPLANE_SUPER) {
        int nb = (int)((full - t0) / 8 < BITPLANE_SUPER ? (full - t0) / 8 : BITPLANE_SUPER);
        for (int b = 0; b < nb; b++)
            for (int g = 0; g < groups; g++) {
                int lanes = layers - 8 * g < 8 ? layers - 8 * g : 8;
                __mmask64 m = lanes == 8 ? ~0ULL : (1ULL << (8 * lanes)) - 1;
                bitplane_planes(ids + (t0 + 8 * b) * rec + 64 * g, rec, m, planes + ((size_t)g * BITPLANE_SUPER + b) * 8);
            }
        for (int g = 0; g < groups; g++)
            for (int h = 0; h < chunks; h++)
                bitplane_chunk(planes + (size_t)g * BITPLANE_SUPER * 8, nb, h, bits, cnt + ((size_t)g * 256 + 16 * h) * 8);
    }
    for (int g = 0; g < groups; g++) {
        int lanes = layers - 8 * g < 8 ? layers - 8 * g : 8;
        for (int e = 0; e < experts; e++)
            for (int q = 0; q < lanes; q++)
                counts[(size_t)(8 * g + q) * experts + e] += (uint32_t)cnt[((size_t)g * 256 + e) * 8 + q];
    }
    const uint8_t *p = ids + full * rec; /* the last tokens, fewer than 8 */
    for (int64_t i = 0; i < (tokens - full) * rec; i++) counts[(size_t)(i / 8 % layers) * experts + p[i]]++;
}
#else
#define BITPLANE_AVAILABLE 0
#endif

#endif
