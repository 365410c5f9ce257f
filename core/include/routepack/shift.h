/* Router shift: how far the training forward's own top-k choices moved away from the
 * replayed routing (the rollout's, or the old policy's) for the same tokens. The
 * stability signal of MoE RL (Zhang et al., arXiv 2510.23027, "router shift"); the
 * per-token RSPO weights built on it are routepack.torch.router_shift_weights
 * (docs/torch.md). Definitions: docs/router-shift.md. */
#ifndef ROUTEPACK_SHIFT_H
#define ROUTEPACK_SHIFT_H

#include "routepack/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Definitions. For token t at layer l, O is the set of experts in the old top-k
 * (old[t][l][0..k)) and N the set in the new one; the order within a top-k is ignored.
 * A token-choice is one old entry (t, l, j), k of them per token and layer; it is
 * "changed" when its expert old[t][l][j] is not in N. An "arrival" is a new entry
 * (t, l, j) whose expert new[t][l][j] is not in O. With k distinct ids in each top-k (as
 * routers choose) changed and arrivals are equal per token and layer; a repeated id
 * counts once per entry, on either side.
 *
 * Every figure is an exact integer count, so per-rank results add up (sum the counts
 * of the ranks' sequences) and the CPU and GPU paths give equal results. */
typedef struct rp_shift rp_shift;

/* Compare two routing views of the same batch: `old_routing` (the replayed routing)
 * and `new_routing` (the training forward's top-k ids), in any of the layouts and id
 * widths rp_stats_compute reads, not necessarily the same two. `num_threads` <= 0 picks
 * the number of online CPUs (capped at 64; fewer for small inputs).
 * Errors (no result): each view checked against the batch as rp_routing_check checks
 * one (shape, strides), the message starting "old routing: " or "new routing: "
 * (RP_EINVAL); views that disagree on layers or top-k (RP_EINVAL, naming both values);
 * an id outside [0, num_experts) (RP_ERANGE, the first in the old routing, else the first
 * in the new one, in rp_routing_check's order: "new routing: sequence 3 token 5 layer 1
 * choice 0 has expert id 71, but the model has 64 experts"; err->sequence and
 * err->expert); sizes that overflow (RP_ERANGE); no memory.
 *
 * Device memory: when both views' id arrays are device (or managed) memory, the counts
 * come from the CUDA kernel (rp_gpu_router_shift) and equal the CPU's; both views must
 * then be packed (any strides). One view on the host and one on the device is RP_EINVAL;
 * per-sequence or per-layer device arrays are RP_ENOTSUP. The batch stays on the host
 * (its cu_seqlens are copied to the device for the call). */
RP_API rp_status rp_shift_compute(rp_context *ctx, const rp_batch *batch, const rp_routing *old_routing,
                                  const rp_routing *new_routing, int32_t num_experts, int32_t num_threads,
                                  rp_shift **out, rp_error *err);
/* Free of NULL is a no-op. */
RP_API void rp_shift_free(rp_shift *shift);

RP_API int32_t rp_shift_num_seqs(const rp_shift *shift);
RP_API int32_t rp_shift_num_layers(const rp_shift *shift);
RP_API int32_t rp_shift_num_experts(const rp_shift *shift);
RP_API int32_t rp_shift_top_k(const rp_shift *shift);

/* Token-choices compared (tokens x layers x k) and those changed. */
RP_API int64_t rp_shift_choices(const rp_shift *shift);
RP_API int64_t rp_shift_changed(const rp_shift *shift);

/* Borrowed arrays, valid until rp_shift_free:
 *   layer_changed   [num_layers]: changed choices of each layer (of tokens x k);
 *   seq_changed     [num_seqs]: changed choices of each sequence (of len x layers x k);
 *   seq_choices     [num_seqs]: len x layers x k;
 *   expert_old      [num_layers * num_experts]: old choices of (layer, expert), the
 *                   old routing's expert loads (rp_stats_expert_load's counts);
 *   expert_lost     [num_layers * num_experts]: of those, the changed ones (the expert
 *                   is no longer in the token's new top-k);
 *   expert_arrived  [num_layers * num_experts]: new choices of (layer, expert) that
 *                   were not in the token's old top-k. */
RP_API const int64_t *rp_shift_layer_changed(const rp_shift *shift);
RP_API const int64_t *rp_shift_seq_changed(const rp_shift *shift);
RP_API const int64_t *rp_shift_seq_choices(const rp_shift *shift);
RP_API const int64_t *rp_shift_expert_old(const rp_shift *shift);
RP_API const int64_t *rp_shift_expert_lost(const rp_shift *shift);
RP_API const int64_t *rp_shift_expert_arrived(const rp_shift *shift);

/* The figures a step report and the flat metrics carry. Fractions are changed over
 * compared choices (0 when there are none); the maxima name the first layer, sequence
 * or (layer, expert) reaching them (-1 when there is none: no choices, no sequence with
 * tokens, no expert with old choices). */
typedef struct rp_shift_summary {
    int64_t choices;                 /* rp_shift_choices */
    int64_t changed;                 /* rp_shift_changed */
    double fraction;                 /* changed / choices */
    double max_layer_fraction;       /* max over layers of layer_changed / (tokens x k) */
    int32_t max_layer;
    double max_seq_fraction;         /* max over sequences of seq_changed / seq_choices */
    int32_t max_seq;
    double max_expert_lost_fraction; /* max over (layer, expert) of lost / old */
    int32_t max_expert_layer, max_expert;
} rp_shift_summary;

RP_API rp_shift_summary rp_shift_summarize(const rp_shift *shift);

#ifdef __cplusplus
}
#endif
#endif
