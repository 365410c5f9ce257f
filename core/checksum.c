/* The two-level expert checksum (routepack/checksum.h): XXH64 of the XXH64s of 4 KiB
 * blocks, the CPU reference of the GPU checksum kernel in kernels/migrate.cu. */
#include "routepack/checksum.h"

#include <string.h>

static void put_le64(unsigned char out[8], uint64_t v)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
}

uint64_t rp_checksum_expert(const void *const *parts, const size_t *bytes, int32_t count)
{
    rp_hash_state outer, block;
    size_t in_block = 0; /* bytes of the current block hashed so far */
    unsigned char le[8];
    rp_hash_init(&outer, 0);
    rp_hash_init(&block, 0);
    for (int32_t i = 0; i < count; i++) {
        const unsigned char *p = (const unsigned char *)parts[i];
        size_t left = bytes[i];
        while (left > 0) {
            size_t take = RP_CHECKSUM_BLOCK - in_block;
            if (take > left) take = left;
            rp_hash_update(&block, p, take);
            p += take;
            left -= take;
            in_block += take;
            if (in_block == RP_CHECKSUM_BLOCK) {
                put_le64(le, rp_hash_final(&block));
                rp_hash_update(&outer, le, sizeof le);
                rp_hash_init(&block, 0);
                in_block = 0;
            }
        }
    }
    if (in_block > 0) {
        put_le64(le, rp_hash_final(&block));
        rp_hash_update(&outer, le, sizeof le);
    }
    return rp_hash_final(&outer);
}

uint64_t rp_checksum_bytes(const void *data, size_t bytes)
{
    return rp_checksum_expert(&data, &bytes, 1);
}
