/* The remap and migration entry points of routepack/gpu.h in a build without CUDA:
 * every call RP_ENOTSUP. With CUDA they live in kernels/remap.cu and kernels/migrate.cu. */
#include "internal.h"
#include "routepack/gpu.h"

#ifndef RP_HAVE_CUDA

#define NO_CUDA "this build has no CUDA kernels (configure with nvcc available to build them)"

rp_status rp_gpu_remap(const rp_plan *plan, const rp_config *cfg, int32_t mb, const rp_batch *batch,
                       const rp_routing *routing_dev, rp_split_rule rule, int32_t *phys_ids_dev,
                       int64_t *slot_tokens, rp_error *err)
{
    (void)plan, (void)cfg, (void)mb, (void)batch, (void)routing_dev, (void)rule, (void)phys_ids_dev;
    (void)slot_tokens;
    return rp_fail(err, RP_ENOTSUP, "gpu remap: %s", NO_CUDA);
}

rp_status rp_gpu_remap_rank(const rp_plan *plan, const rp_config *cfg, int32_t mb, int32_t gpu, const rp_batch *batch,
                            const rp_routing *local_routing_dev, rp_split_rule rule, int32_t *phys_ids_dev,
                            int64_t *slot_tokens, rp_error *err)
{
    (void)plan, (void)cfg, (void)mb, (void)gpu, (void)batch, (void)local_routing_dev, (void)rule;
    (void)phys_ids_dev, (void)slot_tokens;
    return rp_fail(err, RP_ENOTSUP, "gpu remap: %s", NO_CUDA);
}

rp_status rp_gpu_gather(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes, const int32_t *part_begin,
                        int32_t num_experts, void *buffer_dev, size_t buffer_bytes, void *stream, rp_error *err)
{
    (void)ctx, (void)part_ptr, (void)part_bytes, (void)part_begin, (void)num_experts, (void)buffer_dev;
    (void)buffer_bytes, (void)stream;
    return rp_fail(err, RP_ENOTSUP, "gpu gather: %s", NO_CUDA);
}

rp_status rp_gpu_scatter(rp_context *ctx, const void *buffer_dev, size_t buffer_bytes, void *const *part_ptr,
                         const size_t *part_bytes, const int32_t *part_begin, int32_t num_experts, void *stream,
                         rp_error *err)
{
    (void)ctx, (void)buffer_dev, (void)buffer_bytes, (void)part_ptr, (void)part_bytes, (void)part_begin;
    (void)num_experts, (void)stream;
    return rp_fail(err, RP_ENOTSUP, "gpu scatter: %s", NO_CUDA);
}

rp_status rp_gpu_checksum(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes, const int32_t *part_begin,
                          int32_t num_experts, uint64_t *checksums, void *stream, rp_error *err)
{
    (void)ctx, (void)part_ptr, (void)part_bytes, (void)part_begin, (void)num_experts, (void)checksums;
    (void)stream;
    return rp_fail(err, RP_ENOTSUP, "gpu checksum: %s", NO_CUDA);
}

#else
/* Keep the translation unit non-empty under -Wpedantic. */
typedef int rp_gpu_migrate_unused;
#endif
