/* The GPU path of the routing statistics (CUDA kernels in kernels/). Each function has
 * a CPU reference in core/ that gives bit-identical integers. In a build without CUDA
 * every function returns RP_ENOTSUP and rp_gpu_count() is 0. */
#ifndef ROUTEPACK_GPU_H
#define ROUTEPACK_GPU_H

#include "routepack/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 without CUDA, a driver or a device. */
RP_API int rp_gpu_count(void);
/* 1 when this library was built with the CUDA kernels. */
RP_API int rp_gpu_built(void);

/* Dense histograms from routing ids in device memory (packed [tokens, layers, k] with
 * the view's strides; `cu_seqlens_dev` on the device). Writes, on the host,
 * seq_hist[(seq * num_layers + layer) * num_experts + e] and
 * expert_load[layer * num_experts + e]. Ids out of range are counted in none and
 * reported as RP_ERANGE (with the first one's position, as the CPU reports it); the
 * outputs are still written. cu_seqlens running backwards is RP_EINVAL. Synchronises
 * the default stream before returning. */
RP_API rp_status rp_gpu_routing_histograms(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                    int32_t num_seqs, int32_t num_experts,
                                    uint32_t *seq_hist, int64_t *expert_load, rp_error *err);

/* Per-microbatch per-layer expert loads of a packing, straight from routing ids in
 * device memory (same view rules as above): loads[(mb * num_layers + layer) *
 * num_experts + e] on the host, equal to rp_stats_microbatch_loads on the same
 * routing. seq_microbatch_dev[s] (on the device) is the microbatch of sequence s in
 * [0, num_microbatches), or -1 if not packed (its ids are not read). A map entry out of
 * range is RP_EINVAL and writes nothing; ids out of range are counted in none and
 * reported as RP_ERANGE. Synchronises the default stream before returning. */
RP_API rp_status rp_gpu_microbatch_loads(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                  int32_t num_seqs, int32_t num_experts,
                                  const int32_t *seq_microbatch_dev, int32_t num_microbatches,
                                  int64_t *loads, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
