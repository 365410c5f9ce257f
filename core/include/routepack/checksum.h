/* The checksum of an expert's bytes for migration: a two-level XXH64 that a GPU can
 * compute in parallel and the CPU computes identically (docs/kernels.md). */
#ifndef ROUTEPACK_CHECKSUM_H
#define ROUTEPACK_CHECKSUM_H

#include "routepack/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of one first-level block. Part of the definition: changing it changes every
 * checksum. */
#define RP_CHECKSUM_BLOCK 4096

/* The checksum of one expert whose bytes are the concatenation of `count` parts
 * (weights, optimizer moments, ...: parts[i] holds bytes[i] bytes, in host memory).
 * Cut the concatenation into blocks of RP_CHECKSUM_BLOCK bytes (the last one shorter;
 * a block may span parts), hash each block with XXH64 (seed 0), and return XXH64
 * (seed 0) of the block hashes written one after another as 8-byte little-endian
 * values. Where the parts begin and end does not matter, only the concatenated bytes:
 * an expert scattered over tensors and the same expert gathered into one buffer have
 * the same checksum. No bytes: XXH64 of nothing, 0xEF46DB3751D8E999. A part with 0
 * bytes may have a NULL pointer. rp_gpu_checksum (routepack/gpu.h) gives the same
 * value for device memory. */
RP_API uint64_t rp_checksum_expert(const void *const *parts, const size_t *bytes, int32_t count);

/* The same for one contiguous range. */
RP_API uint64_t rp_checksum_bytes(const void *data, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
