/* XXH64 (Yann Collet's xxHash, 64-bit variant, as its specification defines it):
 * fast, stable across machines, and the checksum of trace payloads, plan hashes and
 * migration transfers. */
#include "routepack/base.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only, as the trace format */
    return v;
}

static inline uint32_t read32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t round64(uint64_t acc, uint64_t input)
{
    acc += input * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

static inline uint64_t merge64(uint64_t acc, uint64_t val)
{
    acc ^= round64(0, val);
    return acc * P1 + P4;
}

void rp_hash_init(rp_hash_state *st, uint64_t seed)
{
    memset(st, 0, sizeof *st);
    st->seed = seed;
    st->v[0] = seed + P1 + P2;
    st->v[1] = seed + P2;
    st->v[2] = seed;
    st->v[3] = seed - P1;
}

static void stripes(uint64_t v[4], const unsigned char *p, size_t n)
{
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (const unsigned char *end = p + n; p < end; p += 32) {
        a = round64(a, read64(p));
        b = round64(b, read64(p + 8));
        c = round64(c, read64(p + 16));
        d = round64(d, read64(p + 24));
    }
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

void rp_hash_update(rp_hash_state *st, const void *data, size_t len)
{
    const unsigned char *p = data;
    st->total_len += len;
    if (st->buf_len) {
        size_t take = 32 - st->buf_len;
        if (take > len) take = len;
        memcpy(st->buf + st->buf_len, p, take);
        st->buf_len += (uint32_t)take;
        p += take;
        len -= take;
        if (st->buf_len < 32) return;
        stripes(st->v, st->buf, 32);
        st->buf_len = 0;
    }
    size_t whole = len & ~(size_t)31;
    stripes(st->v, p, whole);
    memcpy(st->buf, p + whole, len - whole);
    st->buf_len = (uint32_t)(len - whole);
}

uint64_t rp_hash_final(const rp_hash_state *st)
{
    uint64_t h;
    if (st->total_len >= 32) {
        h = rotl(st->v[0], 1) + rotl(st->v[1], 7) + rotl(st->v[2], 12) + rotl(st->v[3], 18);
        for (int i = 0; i < 4; i++) h = merge64(h, st->v[i]);
    } else {
        h = st->seed + P5;
    }
    h += st->total_len;
    const unsigned char *p = st->buf, *end = st->buf + st->buf_len;
    for (; p + 8 <= end; p += 8) {
        h ^= round64(0, read64(p));
        h = rotl(h, 27) * P1 + P4;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl(h, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) {
        h ^= (uint64_t)*p * P5;
        h = rotl(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t rp_hash64(const void *data, size_t len, uint64_t seed)
{
    rp_hash_state st;
    rp_hash_init(&st, seed);
    rp_hash_update(&st, data, len);
    return rp_hash_final(&st);
}
