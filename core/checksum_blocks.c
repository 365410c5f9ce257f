/* XXH64 (seed 0) of whole RP_CHECKSUM_BLOCK-byte blocks, many at a time: the first
 * level of the expert checksum (checksum.c), which every migrated byte goes through
 * twice (at the source, and as the commit writes the slot). One XXH64 runs four
 * dependent multiply chains, about 4 bytes a cycle on one core; on a CPU with AVX-512
 * (F and DQ) eight blocks run side by side, two per vector register, so the pass is
 * bound by memory rather than by the multiplier. The results are the scalar XXH64's,
 * bit for bit (test_checksum compares them on every length and alignment). */
#include "checksum_internal.h"
#include "xxh64_internal.h"

#include <string.h>

/* XXH64's end for a whole block: its four lanes merged, the length, the avalanche
 * (no tail bytes: a block is a whole number of 32-byte stripes). */
static uint64_t block_final(const uint64_t v[4])
{
    return xxh64_avalanche(xxh64_lanes(v) + RP_CHECKSUM_BLOCK);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RP_HAVE_BLOCKS8 1

/* Eight blocks at p: block 2j in the low half of register j, block 2j + 1 in its high
 * half, each half the four lanes of that block's XXH64. */
__attribute__((target("avx512f,avx512dq"))) static void blocks8(const unsigned char *p, uint64_t out[8])
{
    const __m512i p1 = _mm512_set1_epi64((long long)XXH64_P1), p2 = _mm512_set1_epi64((long long)XXH64_P2);
    const long long v0 = (long long)(XXH64_P1 + XXH64_P2), v1 = (long long)XXH64_P2, v3 = (long long)(0 - XXH64_P1);
    const __m512i init = _mm512_set_epi64(v3, 0, v1, v0, v3, 0, v1, v0);
    __m512i acc[4] = {init, init, init, init};
    for (size_t off = 0; off < RP_CHECKSUM_BLOCK; off += 32)
        for (int j = 0; j < 4; j++) {
            const unsigned char *a = p + (size_t)(2 * j) * RP_CHECKSUM_BLOCK + off;
            __m512i in = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                                            _mm256_loadu_si256((const __m256i *)(a + RP_CHECKSUM_BLOCK)), 1);
            __m512i x = _mm512_add_epi64(acc[j], _mm512_mullo_epi64(in, p2));
            acc[j] = _mm512_mullo_epi64(_mm512_rol_epi64(x, 31), p1);
        }
    for (int j = 0; j < 4; j++) {
        uint64_t v[8];
        _mm512_storeu_si512(v, acc[j]);
        out[2 * j] = block_final(v);
        out[2 * j + 1] = block_final(v + 4);
    }
}

static bool have_blocks8(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}
#endif

static uint64_t block1(const unsigned char *p)
{
    uint64_t a = XXH64_P1 + XXH64_P2, b = XXH64_P2, c = 0, d = 0 - XXH64_P1, w[4];
    for (size_t off = 0; off < RP_CHECKSUM_BLOCK; off += 32) {
        memcpy(w, p + off, 32); /* little-endian hosts only, as hash.c */
        a = xxh64_round(a, w[0]);
        b = xxh64_round(b, w[1]);
        c = xxh64_round(c, w[2]);
        d = xxh64_round(d, w[3]);
    }
    const uint64_t v[4] = {a, b, c, d};
    return block_final(v);
}

void rp_checksum_blocks(const void *data, size_t n, uint64_t *out)
{
    const unsigned char *p = data;
    size_t i = 0;
#ifdef RP_HAVE_BLOCKS8
    if (n >= 8 && have_blocks8())
        for (; i + 8 <= n; i += 8) blocks8(p + i * RP_CHECKSUM_BLOCK, out + i);
#endif
    for (; i < n; i++) out[i] = block1(p + i * RP_CHECKSUM_BLOCK);
}
