/* XXH64 (Yann Collet's xxHash, 64-bit variant, as its specification defines it):
 * fast, stable across machines, and the checksum of trace payloads, plan hashes and
 * migration transfers. */
#include "routepack/base.h"
#include "xxh64_internal.h"

#include <string.h>

static inline uint32_t read32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

void rp_hash_init(rp_hash_state *st, uint64_t seed)
{
    memset(st, 0, sizeof *st);
    st->seed = seed;
    st->v[0] = seed + XXH64_P1 + XXH64_P2;
    st->v[1] = seed + XXH64_P2;
    st->v[2] = seed;
    st->v[3] = seed - XXH64_P1;
}

static void stripes(uint64_t v[4], const unsigned char *p, size_t n)
{
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (const unsigned char *end = p + n; p < end; p += 32) {
        a = xxh64_round(a, xxh64_read64(p));
        b = xxh64_round(b, xxh64_read64(p + 8));
        c = xxh64_round(c, xxh64_read64(p + 16));
        d = xxh64_round(d, xxh64_read64(p + 24));
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
        h = xxh64_lanes(st->v);
    } else {
        h = st->seed + XXH64_P5;
    }
    h += st->total_len;
    const unsigned char *p = st->buf, *end = st->buf + st->buf_len;
    for (; p + 8 <= end; p += 8) {
        h ^= xxh64_round(0, xxh64_read64(p));
        h = xxh64_rotl(h, 27) * XXH64_P1 + XXH64_P4;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * XXH64_P1;
        h = xxh64_rotl(h, 23) * XXH64_P2 + XXH64_P3;
        p += 4;
    }
    for (; p < end; p++) {
        h ^= (uint64_t)*p * XXH64_P5;
        h = xxh64_rotl(h, 11) * XXH64_P1;
    }
    return xxh64_avalanche(h);
}

uint64_t rp_hash64(const void *data, size_t len, uint64_t seed)
{
    rp_hash_state st;
    rp_hash_init(&st, seed);
    rp_hash_update(&st, data, len);
    return rp_hash_final(&st);
}
