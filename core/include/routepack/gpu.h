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
/* 1 when a kernel of the current device can read `ptr`: device or managed memory, pinned
 * host memory, or any host memory on a device with pageable memory access (HMM, ATS);
 * 0 otherwise, for NULL, and without CUDA or a device. The rp_gpu_* calls check their
 * device arrays with this (a host pointer is RP_EINVAL, not a fault that would end the
 * CUDA context). rp_stats_compute and rp_remap pick the path themselves: device or
 * managed memory goes to these kernels, host memory (even readable here) to the CPU. */
RP_API int rp_gpu_pointer_readable(const void *ptr);

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

/* Router shift counts (routepack/shift.h) from two routing views in device memory (both
 * packed, any strides, the same layers and top-k; `cu_seqlens_dev` on the device). Writes,
 * on the host, layer_changed[num_layers], seq_changed[num_seqs] and the [num_layers *
 * num_experts] expert_old, expert_lost and expert_arrived, equal to rp_shift_compute's
 * CPU counts. An id out of range is RP_ERANGE with the CPU's message (the first in the
 * old routing, else the first in the new one) and the outputs are not written.
 * Synchronises the default stream before returning. */
RP_API rp_status rp_gpu_router_shift(const rp_routing *old_dev, const rp_routing *new_dev,
                                     const int64_t *cu_seqlens_dev, int32_t num_seqs, int32_t num_experts,
                                     int64_t *layer_changed, int64_t *seq_changed, int64_t *expert_old,
                                     int64_t *expert_lost, int64_t *expert_arrived, rp_error *err);

#ifdef __cplusplus
}
#endif

/* ---- remap and the migration kernels (kernels/remap.cu, kernels/migrate.cu) ----
 * Their CPU references are rp_remap (routepack/remap.h) and rp_checksum_expert
 * (routepack/checksum.h); docs/kernels.md has the rules. Without CUDA: RP_ENOTSUP. */
#include "routepack/remap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* rp_remap on the device: the same integers. `routing_dev` is a packed view
 * (RP_ROUTING_PACKED, any strides) whose base is device memory; the plan, config and
 * batch are the host objects. Writes phys_ids_dev (device, a packed [tokens, layers, k]
 * int32 array for the whole batch; entries of tokens outside the microbatch are not
 * touched) and, if not NULL, slot_tokens on the host as rp_remap does. Errors as
 * rp_remap's (nothing written), plus RP_ENOTSUP for another layout, no device, or more
 * split (layer, expert) pairs than one warp's shared memory holds (about 57000 on an
 * H100/H200). Synchronises the device before returning. */
RP_API rp_status rp_gpu_remap(const rp_plan *plan, const rp_config *cfg, int32_t mb,
                              const rp_batch *batch, const rp_routing *routing_dev,
                              rp_split_rule rule, int32_t *phys_ids_dev, int64_t *slot_tokens,
                              rp_error *err);

/* rp_remap_rank on the device: one GPU's own tokens of microbatch `mb`, the same
 * integers (its CPU reference is rp_remap_rank, routepack/remap.h, whose rules and
 * local token order it takes). `local_routing_dev` is a packed view (RP_ROUTING_PACKED,
 * any strides) of the listed sequences' ids only, whose base is device memory; writes
 * phys_ids_dev (device, [local tokens, layers, k] int32) and, if not NULL, slot_tokens
 * on the host ([layer * P + p], as rp_remap_rank). Errors as rp_remap_rank's (nothing
 * written; an id error names the global sequence), plus rp_gpu_remap's RP_ENOTSUP cases.
 * The kernels run on the legacy default stream, and the call waits for the device once:
 * the id check and the per-expert counts are one kernel whose result is copied back (the
 * copy waits for the work queued before it on that stream). The tables then go up with
 * stream-ordered allocations and copies, and the remap kernels are left running: work
 * queued afterwards on the legacy default stream (or on a stream that synchronises with
 * it, such as torch's default stream) sees phys_ids_dev; read it from another stream
 * only after synchronising with it. Needs a device with memory pools (cudaMallocAsync).
 * A failure inside the remap kernels themselves surfaces at the caller's next
 * synchronisation, not here. */
RP_API rp_status rp_gpu_remap_rank(const rp_plan *plan, const rp_config *cfg, int32_t mb, int32_t gpu,
                                   const rp_batch *batch, const rp_routing *local_routing_dev,
                                   rp_split_rule rule, int32_t *phys_ids_dev, int64_t *slot_tokens,
                                   rp_error *err);

/* Expert migration buffers. Expert i is the concatenation of its parts
 * part_begin[i] .. part_begin[i+1]-1 (part_ptr[p]: device memory of part_bytes[p]
 * bytes; the three arrays live on the host). A contiguous buffer holds the experts back
 * to back without padding: expert i starts at the sum of the earlier experts' bytes.
 * `stream` is a cudaStream_t (NULL: the legacy default stream); `ctx` allocates the
 * small host descriptor arrays. Copies are fastest when part and buffer offsets share
 * their alignment modulo 16. */

/* Copy every expert's parts into `buffer_dev` (device, buffer_bytes long), in order.
 * Enqueued on `stream` (the host arrays may be reused on return). Errors: a total
 * beyond buffer_bytes, a NULL pointer with bytes, part_begin not ascending
 * (RP_EINVAL). */
RP_API rp_status rp_gpu_gather(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes,
                               const int32_t *part_begin, int32_t num_experts, void *buffer_dev,
                               size_t buffer_bytes, void *stream, rp_error *err);
/* The reverse: copy `buffer_dev` back into every expert's parts. Same rules. */
RP_API rp_status rp_gpu_scatter(rp_context *ctx, const void *buffer_dev, size_t buffer_bytes,
                                void *const *part_ptr, const size_t *part_bytes,
                                const int32_t *part_begin, int32_t num_experts, void *stream,
                                rp_error *err);
/* checksums[i] (host) = rp_checksum_expert of expert i's device bytes. Runs on
 * `stream` after the work queued there and synchronises it before returning. */
RP_API rp_status rp_gpu_checksum(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes,
                                 const int32_t *part_begin, int32_t num_experts,
                                 uint64_t *checksums, void *stream, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
