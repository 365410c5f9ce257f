/* The two-level expert checksum (routepack/checksum.h): XXH64 of the XXH64s of 4 KiB
 * blocks, the CPU reference of the GPU checksum kernel in kernels/migrate.cu, and its
 * streaming form (checksum_internal.h) that the transports use for bytes read in pieces. */
#include "checksum_internal.h"

#include <string.h>

static void put_le64(unsigned char out[8], uint64_t v)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
}

void rp_checksum_init(rp_checksum_state *st)
{
    rp_hash_init(&st->outer, 0);
    rp_hash_init(&st->block, 0);
    st->in_block = 0;
}

void rp_checksum_update(rp_checksum_state *st, const void *data, size_t bytes)
{
    const unsigned char *p = (const unsigned char *)data;
    unsigned char le[8];
    while (bytes > 0) {
        if (st->in_block == 0 && bytes >= RP_CHECKSUM_BLOCK) {
            /* whole blocks: their hashes many at a time, then into the outer hash */
            enum { BATCH = 64 };
            uint64_t sums[BATCH];
            unsigned char les[BATCH * 8];
            size_t n = bytes / RP_CHECKSUM_BLOCK;
            if (n > BATCH) n = BATCH;
            rp_checksum_blocks(p, n, sums);
            for (size_t i = 0; i < n; i++) put_le64(les + 8 * i, sums[i]);
            rp_hash_update(&st->outer, les, 8 * n);
            p += n * RP_CHECKSUM_BLOCK;
            bytes -= n * RP_CHECKSUM_BLOCK;
            continue;
        }
        size_t take = RP_CHECKSUM_BLOCK - st->in_block;
        if (take > bytes) take = bytes;
        rp_hash_update(&st->block, p, take);
        p += take;
        bytes -= take;
        st->in_block += take;
        if (st->in_block == RP_CHECKSUM_BLOCK) {
            put_le64(le, rp_hash_final(&st->block));
            rp_hash_update(&st->outer, le, sizeof le);
            rp_hash_init(&st->block, 0);
            st->in_block = 0;
        }
    }
}

uint64_t rp_checksum_final(const rp_checksum_state *st)
{
    if (st->in_block == 0) return rp_hash_final(&st->outer);
    /* The last, shorter block: hash a copy of the outer state, so the state stays as it was. */
    rp_hash_state outer = st->outer;
    unsigned char le[8];
    put_le64(le, rp_hash_final(&st->block));
    rp_hash_update(&outer, le, sizeof le);
    return rp_hash_final(&outer);
}

uint64_t rp_checksum_expert(const void *const *parts, const size_t *bytes, int32_t count)
{
    rp_checksum_state st;
    rp_checksum_init(&st);
    for (int32_t i = 0; i < count; i++) rp_checksum_update(&st, parts[i], bytes[i]);
    return rp_checksum_final(&st);
}

uint64_t rp_checksum_bytes(const void *data, size_t bytes)
{
    return rp_checksum_expert(&data, &bytes, 1);
}
