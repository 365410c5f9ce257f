/* The two-level expert checksum (core/checksum.c): reference vectors computed with an
 * independent XXH64 (python-xxhash), block and part boundaries, empty experts. */
#include "routepack/routepack.h"
#include "routepack/checksum.h"
#include "tap.h"

#include <stdlib.h>

/* The bytes every reference vector hashes: a fixed pattern, reproducible anywhere. */
static unsigned char *pattern(size_t n)
{
    unsigned char *p = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 131u + (i >> 8) * 7u + 1u) & 0xffu);
    return p;
}

/* XXH64 over the concatenated little-endian XXH64s of 4 KiB blocks, by python-xxhash:
 *   hs = b''.join(struct.pack('<Q', xxh64(d[o:o+4096]).intdigest()) for o in range(0, len(d), 4096))
 *   xxh64(hs).intdigest() */
static const struct {
    size_t n;
    uint64_t want;
} vectors[] = {
    {0, 0xEF46DB3751D8E999ULL},     {1, 0xE44E2FB1030D2A28ULL},    {31, 0x1D5FE3968DB4FFFCULL},
    {32, 0xD59EAAE548673E14ULL},    {4095, 0x0F25A28B6168B7E0ULL}, {4096, 0x8C1E37646BC9CBB6ULL},
    {4097, 0x1CC3512E5ED24FB3ULL},  {8192, 0xA841C5437BED4DF1ULL}, {12293, 0xBC1FB6B2BA41D79FULL},
    {100000, 0xFAE0FDD7BB012FDCULL},
};

static void le64(unsigned char *out, uint64_t v)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
}

static void test_vectors(void)
{
    for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++) {
        unsigned char *p = pattern(vectors[i].n);
        is_int(rp_checksum_bytes(p, vectors[i].n), (long long)vectors[i].want,
               "reference vector: %zu bytes", vectors[i].n);
        free(p);
    }
}

static void test_definition(void)
{
    /* Up to one block: XXH64 of the 8 little-endian bytes of the block's XXH64. */
    unsigned char *p = pattern(3 * RP_CHECKSUM_BLOCK + 77);
    unsigned char le[24];
    le64(le, rp_hash64(p, 1000, 0));
    is_int(rp_checksum_bytes(p, 1000), (long long)rp_hash64(le, 8, 0), "one short block: xxh64 of its xxh64");
    le64(le, rp_hash64(p, RP_CHECKSUM_BLOCK, 0));
    le64(le + 8, rp_hash64(p + RP_CHECKSUM_BLOCK, RP_CHECKSUM_BLOCK, 0));
    le64(le + 16, rp_hash64(p + 2 * RP_CHECKSUM_BLOCK, 77, 0));
    is_int(rp_checksum_bytes(p, 2 * RP_CHECKSUM_BLOCK + 77), (long long)rp_hash64(le, 24, 0),
           "three blocks, the last short: xxh64 of the three block hashes");
    ok(rp_checksum_bytes(p, 2 * RP_CHECKSUM_BLOCK + 77) != rp_hash64(p, 2 * RP_CHECKSUM_BLOCK + 77, 0),
       "the two-level checksum differs from plain xxh64 of the bytes");
    /* A trailing zero byte is a different expert. */
    unsigned char *z = calloc(RP_CHECKSUM_BLOCK + 1, 1);
    ok(rp_checksum_bytes(z, RP_CHECKSUM_BLOCK) != rp_checksum_bytes(z, RP_CHECKSUM_BLOCK + 1),
       "a zero byte past a block boundary changes the checksum");
    ok(rp_checksum_bytes(z, 8) != rp_checksum_bytes(z, 9), "length is part of the checksum");
    z[RP_CHECKSUM_BLOCK - 1] = 1;
    ok(rp_checksum_bytes(z, RP_CHECKSUM_BLOCK) != rp_checksum_bytes(z + 1, RP_CHECKSUM_BLOCK),
       "one flipped byte changes the checksum");
    free(z);
    free(p);
}

static void test_parts(void)
{
    const size_t n = 5 * RP_CHECKSUM_BLOCK + 333;
    unsigned char *p = pattern(n);
    const uint64_t whole = rp_checksum_bytes(p, n);
    /* Cuts at, just before and just after block boundaries, and inside blocks. */
    const size_t cuts[][3] = {
        {RP_CHECKSUM_BLOCK, 2 * RP_CHECKSUM_BLOCK, 3 * RP_CHECKSUM_BLOCK},
        {RP_CHECKSUM_BLOCK - 1, RP_CHECKSUM_BLOCK + 1, 4 * RP_CHECKSUM_BLOCK - 7},
        {1, 2, 3},
        {17, 17, 17}, /* an empty part in the middle */
        {0, 0, n},    /* empty parts first and last */
    };
    int all = 1;
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        const void *parts[4] = {p, p + cuts[c][0], p + cuts[c][1], p + cuts[c][2]};
        size_t bytes[4] = {cuts[c][0], cuts[c][1] - cuts[c][0], cuts[c][2] - cuts[c][1], n - cuts[c][2]};
        all &= rp_checksum_expert(parts, bytes, 4) == whole;
    }
    ok(all, "an expert cut into parts anywhere has the checksum of its concatenation");
    /* Many tiny parts: one byte each over a block boundary. */
    enum { TINY = RP_CHECKSUM_BLOCK + 40 };
    const void **tp = malloc(sizeof *tp * TINY);
    size_t *tb = malloc(sizeof *tb * TINY);
    for (size_t i = 0; i < TINY; i++) tp[i] = p + i, tb[i] = 1;
    is_int(rp_checksum_expert(tp, tb, TINY), (long long)rp_checksum_bytes(p, TINY),
           "one-byte parts across a block boundary");
    free(tp);
    free(tb);
    const void *none[1] = {NULL};
    size_t zero[1] = {0};
    is_int(rp_checksum_expert(none, zero, 1), (long long)0xEF46DB3751D8E999ULL, "one empty part (NULL pointer)");
    is_int(rp_checksum_expert(NULL, NULL, 0), (long long)0xEF46DB3751D8E999ULL, "no parts");
    is_int(rp_checksum_bytes(NULL, 0), (long long)rp_hash64("", 0, 0), "empty expert: xxh64 of nothing");
    free(p);
}

/* The definition computed block by block with plain XXH64 (rp_hash64). */
static uint64_t reference(const unsigned char *p, size_t n)
{
    rp_hash_state outer;
    rp_hash_init(&outer, 0);
    for (size_t o = 0; o < n; o += RP_CHECKSUM_BLOCK) {
        unsigned char le[8];
        le64(le, rp_hash64(p + o, n - o < RP_CHECKSUM_BLOCK ? n - o : RP_CHECKSUM_BLOCK, 0));
        rp_hash_update(&outer, le, 8);
    }
    return rp_hash_final(&outer);
}

/* Whole blocks are hashed many at a time (eight side by side where the CPU has AVX-512):
 * the same bits as block by block, at any alignment, for runs of whole blocks that are
 * and are not multiples of eight, after a part that ends inside a block, and with
 * every byte of a block able to change the result. */
static void test_batches(void)
{
    const size_t most = 40 * RP_CHECKSUM_BLOCK + 100;
    unsigned char *buf = malloc(most + 64);
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (size_t i = 0; i < most + 64; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (unsigned char)x;
    }
    const size_t lens[] = {8 * RP_CHECKSUM_BLOCK, 9 * RP_CHECKSUM_BLOCK - 1, 16 * RP_CHECKSUM_BLOCK + 5,
                           23 * RP_CHECKSUM_BLOCK, 40 * RP_CHECKSUM_BLOCK + 100, 7 * RP_CHECKSUM_BLOCK + 31};
    int same = 1, split = 1;
    for (size_t a = 0; a < 8; a++)
        for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
            const unsigned char *p = buf + a * 7;
            uint64_t want = reference(p, lens[i]);
            same &= rp_checksum_bytes(p, lens[i]) == want;
            /* a first part ending inside a block, then the rest in one part */
            const void *parts[2] = {p, p + 1000 + a};
            size_t bytes[2] = {1000 + a, lens[i] - 1000 - a};
            split &= rp_checksum_expert(parts, bytes, 2) == want;
        }
    ok(same, "runs of whole blocks at 8 alignments: the checksum of the blocks hashed one by one");
    ok(split, "the same after a part that ends inside a block");
    /* one flipped bit in any of the eight blocks of a batch, at any lane position */
    const uint64_t base = rp_checksum_bytes(buf, 8 * RP_CHECKSUM_BLOCK);
    int all_differ = 1, all_match = 1;
    for (size_t b = 0; b < 8; b++)
        for (size_t at = 0; at < 64; at += 9) {
            unsigned char *q = buf + b * RP_CHECKSUM_BLOCK + b * 500 + at;
            *q ^= 0x10;
            uint64_t got = rp_checksum_bytes(buf, 8 * RP_CHECKSUM_BLOCK);
            all_differ &= got != base;
            all_match &= got == reference(buf, 8 * RP_CHECKSUM_BLOCK);
            *q ^= 0x10;
        }
    ok(all_differ && all_match, "a flipped bit anywhere in a batch of eight blocks changes it as the definition does");
    free(buf);
}

int main(void)
{
    test_vectors();
    test_definition();
    test_parts();
    test_batches();
    return tap_done();
}
