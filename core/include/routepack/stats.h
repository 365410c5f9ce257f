/* Routing statistics: what the planners consume. Global per-layer expert loads, compact
 * per-sequence per-layer expert histograms, per-microbatch loads for a packing, per-GPU
 * loads for a placement, skew figures. These are the exact integer references that the
 * CUDA kernels are checked against. */
#ifndef ROUTEPACK_STATS_H
#define ROUTEPACK_STATS_H

#include "routepack/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rp_stats rp_stats;

/* Scan the routing once. `num_threads` <= 0 picks the number of online CPUs (capped at
 * 64). Checks the view against the batch and every id against num_experts; the first
 * id out of range is RP_ERANGE, named as rp_routing_check names it (lowest sequence,
 * then layer, token, choice), and no statistics are made. The CPU scan reads each id
 * once and counts the value it checked, so routing written by another thread during
 * the call can change the counts (or make the call RP_ERANGE), never make it index
 * outside its histograms.
 *
 * Device memory: when the view's id arrays are device (or managed) memory (asked of
 * CUDA, routepack/gpu.h), the counts come from the histogram kernel
 * (rp_gpu_routing_histograms) and are stored exactly as the scan stores them, so the
 * result and every call on it are bit-identical to the CPU path's; `num_threads` is
 * ignored. The view must then be packed (any strides; per-sequence or per-layer device
 * arrays are RP_ENOTSUP); a view whose arrays are partly host, partly device memory is
 * RP_EINVAL naming the first that differs. The batch stays on the host: its cu_seqlens
 * are copied to the device for the call, and the dense counts (num_seqs x layers x
 * experts uint32) are held on the host until the compact statistics are built. The
 * call synchronises the device (legacy default stream) before returning; CUDA failures
 * are RP_EIO (RP_ENOMEM for device memory). Host memory (pinned or pageable, even where
 * a kernel could read it) always takes the CPU path, as does everything in a build
 * without CUDA or on a machine without a GPU. On a machine with a GPU the check
 * initialises the CUDA runtime on first use. */
RP_API rp_status rp_stats_compute(rp_context *ctx, const rp_batch *batch, const rp_routing *routing,
                           int32_t num_experts, int32_t num_threads, rp_stats **out,
                           rp_error *err);
RP_API void rp_stats_free(rp_stats *stats);

RP_API int32_t rp_stats_num_seqs(const rp_stats *stats);
RP_API int32_t rp_stats_num_layers(const rp_stats *stats);
RP_API int32_t rp_stats_num_experts(const rp_stats *stats);
/* Bytes the statistics hold (the per-sequence histograms dominate). */
RP_API size_t rp_stats_bytes(const rp_stats *stats);

/* Token-choices routed to each expert of a layer over the whole batch:
 * [num_experts], borrowed until rp_stats_free. Sums to num_tokens * top_k. */
RP_API const int64_t *rp_stats_expert_load(const rp_stats *stats, int32_t layer);

/* One sequence's histogram at one layer, decoded into counts[num_experts]. */
RP_API void rp_stats_seq_hist(const rp_stats *stats, int32_t seq, int32_t layer, uint32_t *counts);
RP_API uint32_t rp_stats_seq_count(const rp_stats *stats, int32_t seq, int32_t layer, int32_t expert);

/* Per-microbatch per-layer expert loads of a packing: loads[(mb * num_layers + layer) *
 * num_experts + expert]. seq_microbatch[s] is the microbatch of sequence s, in
 * [0, num_microbatches), or -1 if not packed. */
RP_API rp_status rp_stats_microbatch_loads(const rp_stats *stats, const int32_t *seq_microbatch,
                                    int32_t num_microbatches, int64_t *loads, rp_error *err);

/* Per-GPU load of one layer under a placement, in EPLB's arrays: GPU g holds physical
 * slots [gpu_slot_begin[g], gpu_slot_begin[g+1]) and slot p holds logical expert
 * phy2log[p]. An expert's load is split evenly over its replicas, the remainder one
 * token each to its first replicas in slot order, so results stay exact integers.
 * Errors: an expert id out of range, an expert with no replica. */
RP_API rp_status rp_loads_per_gpu(const int64_t *expert_load, int32_t num_experts,
                           const int32_t *phy2log, const int32_t *gpu_slot_begin,
                           int32_t num_gpus, int64_t *gpu_load, rp_error *err);

/* Skew of a load vector. cv is the population coefficient of variation (0 for an
 * all-zero vector, whose max/mean and min/mean are 1: perfectly even). argmax is the
 * first index of the largest value; -1 (and every figure 0) for an empty vector. */
typedef struct rp_skew {
    double mean;
    double cv;
    double max_over_mean;
    double min_over_mean;
    int64_t max;
    int32_t argmax;
} rp_skew;
RP_API rp_skew rp_skew_of(const int64_t *values, int32_t n);

#ifdef __cplusplus
}
#endif
#endif
