/* The library's one pseudo-random generator, the same stream on every machine:
 * splitmix64 (seeding, and a stream of its own where a few draws suffice) and
 * xoshiro256** (long streams: the trace generator, the sandbox's math.random). Header
 * only; the base of everything that draws. Internal. */
#ifndef RP_PRNG_H
#define RP_PRNG_H

#include <stdint.h>

/* splitmix64's finalizer: a bijective mix of 64 bits. */
static inline uint64_t rp_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The next draw of the splitmix64 stream whose state is *x. */
static inline uint64_t rp_splitmix64(uint64_t *x)
{
    return rp_mix64(*x += 0x9E3779B97F4A7C15ULL);
}

/* xoshiro256**'s state from a seed, through splitmix64. */
static inline void rp_xoshiro_seed(uint64_t s[4], uint64_t seed)
{
    for (int i = 0; i < 4; i++) s[i] = rp_splitmix64(&seed);
}

static inline uint64_t rp_rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* The next draw of xoshiro256** (state s, never all zero). */
static inline uint64_t rp_xoshiro_next(uint64_t s[4])
{
    uint64_t result = rp_rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rp_rotl64(s[3], 45);
    return result;
}

#endif
