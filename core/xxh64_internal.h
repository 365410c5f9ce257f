/* XXH64's primitives (Yann Collet's xxHash, 64-bit variant, as its specification defines
 * them), shared by the streaming hash (hash.c) and the many-blocks-at-once first level of
 * the expert checksum (checksum_blocks.c), which must give the same bits. */
#ifndef RP_XXH64_INTERNAL_H
#define RP_XXH64_INTERNAL_H

#include <stdint.h>
#include <string.h>

#define XXH64_P1 0x9E3779B185EBCA87ULL
#define XXH64_P2 0xC2B2AE3D27D4EB4FULL
#define XXH64_P3 0x165667B19E3779F9ULL
#define XXH64_P4 0x85EBCA77C2B2AE63ULL
#define XXH64_P5 0x27D4EB2F165667C5ULL

static inline uint64_t xxh64_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh64_read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only, as the trace format */
    return v;
}

static inline uint64_t xxh64_round(uint64_t acc, uint64_t input)
{
    acc += input * XXH64_P2;
    acc = xxh64_rotl(acc, 31);
    return acc * XXH64_P1;
}

/* The four lanes of 32-byte stripes merged into one value (before the length). */
static inline uint64_t xxh64_lanes(const uint64_t v[4])
{
    uint64_t h = xxh64_rotl(v[0], 1) + xxh64_rotl(v[1], 7) + xxh64_rotl(v[2], 12) + xxh64_rotl(v[3], 18);
    for (int i = 0; i < 4; i++) {
        h ^= xxh64_round(0, v[i]);
        h = h * XXH64_P1 + XXH64_P4;
    }
    return h;
}

/* The final mix. */
static inline uint64_t xxh64_avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= XXH64_P2;
    h ^= h >> 29;
    h *= XXH64_P3;
    h ^= h >> 32;
    return h;
}

#endif
