/* The streaming form of rp_checksum_expert (private): the same checksum of bytes that
 * arrive in pieces, such as device memory read through a bounded host buffer. */
#ifndef RP_CHECKSUM_INTERNAL_H
#define RP_CHECKSUM_INTERNAL_H

#include "routepack/checksum.h"

typedef struct rp_checksum_state {
    rp_hash_state outer;  /* over the finished blocks' hashes */
    rp_hash_state block;  /* over the current block's bytes */
    size_t in_block;      /* bytes of the current block so far */
} rp_checksum_state;

void rp_checksum_init(rp_checksum_state *st);
/* Feed the next `bytes` bytes of the expert (host memory); pieces may split blocks
 * anywhere. */
void rp_checksum_update(rp_checksum_state *st, const void *data, size_t bytes);
/* XXH64 (seed 0) of each of `n` whole RP_CHECKSUM_BLOCK-byte blocks at `data` (host
 * memory, any alignment) into out[n]: the first level, many blocks at a time
 * (checksum_blocks.c; vectorized across blocks where the CPU can). */
void rp_checksum_blocks(const void *data, size_t n, uint64_t *out);
/* rp_checksum_expert of every byte fed since init. */
uint64_t rp_checksum_final(const rp_checksum_state *st);

#endif
