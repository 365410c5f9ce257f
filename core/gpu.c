/* The GPU entry points in a build without CUDA: no devices, every call RP_ENOTSUP.
 * With CUDA the same functions live in kernels/ (histogram.cu, gpu_support.cu). */
#include "internal.h"
#include "routepack/gpu.h"
#include "../kernels/gpu_support.h"

#ifndef RP_HAVE_CUDA

#define NO_CUDA "this build has no CUDA kernels (configure with nvcc available to build them)"

int rp_gpu_count(void) { return 0; }
int rp_gpu_built(void) { return 0; }
int rp_gpu_pointer_readable(const void *ptr) { (void)ptr; return 0; }

rp_status rp_gpu_routing_histograms(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                    int32_t num_seqs, int32_t num_experts, uint32_t *seq_hist,
                                    int64_t *expert_load, rp_error *err)
{
    (void)routing_dev, (void)cu_seqlens_dev, (void)num_seqs, (void)num_experts;
    (void)seq_hist, (void)expert_load;
    return rp_fail(err, RP_ENOTSUP, "gpu: %s", NO_CUDA);
}

rp_status rp_gpu_microbatch_loads(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                  int32_t num_seqs, int32_t num_experts,
                                  const int32_t *seq_microbatch_dev, int32_t num_microbatches,
                                  int64_t *loads, rp_error *err)
{
    (void)routing_dev, (void)cu_seqlens_dev, (void)num_seqs, (void)num_experts;
    (void)seq_microbatch_dev, (void)num_microbatches, (void)loads;
    return rp_fail(err, RP_ENOTSUP, "gpu: %s", NO_CUDA);
}

rp_status rp_gpu_router_shift(const rp_routing *old_dev, const rp_routing *new_dev,
                              const int64_t *cu_seqlens_dev, int32_t num_seqs, int32_t num_experts,
                              int64_t *layer_changed, int64_t *seq_changed, int64_t *expert_old,
                              int64_t *expert_lost, int64_t *expert_arrived, rp_error *err)
{
    (void)old_dev, (void)new_dev, (void)cu_seqlens_dev, (void)num_seqs, (void)num_experts;
    (void)layer_changed, (void)seq_changed, (void)expert_old, (void)expert_lost, (void)expert_arrived;
    return rp_fail(err, RP_ENOTSUP, "gpu: %s", NO_CUDA);
}

rp_status rp_gpu_dev_upload(const void *host, size_t bytes, void **dev, rp_error *err)
{
    (void)host, (void)bytes, (void)dev;
    return rp_fail(err, RP_ENOTSUP, "gpu: %s", NO_CUDA);
}

void rp_gpu_dev_free(void *dev) { (void)dev; }

int rp_gpu_pointer_on_device(const void *ptr) { (void)ptr; return 0; }

#endif
