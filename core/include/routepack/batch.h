/* A batch: the rollout sequences of one RL training step, and a borrowed view of their
 * routing replay in whatever layout the trainer holds it. */
#ifndef ROUTEPACK_BATCH_H
#define ROUTEPACK_BATCH_H

#include "routepack/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sequences with prompt and response lengths and group ids (GRPO: the responses to one
 * prompt share a group id). A sequence's routed tokens are its prompt followed by its
 * response; sequence s owns tokens [cu_seqlens[s], cu_seqlens[s+1]). Empty sequences
 * are allowed. */
typedef struct rp_batch rp_batch;

/* Copy the lengths into a new batch. `group_id` NULL gives each sequence its own group.
 * Errors: negative lengths, a token count that overflows int64. */
RP_API rp_status rp_batch_new(rp_context *ctx, int32_t num_seqs, const int32_t *prompt_len,
                       const int32_t *response_len, const int32_t *group_id,
                       rp_batch **out, rp_error *err);
RP_API void rp_batch_free(rp_batch *batch);

RP_API int32_t rp_batch_num_seqs(const rp_batch *batch);
RP_API int64_t rp_batch_num_tokens(const rp_batch *batch);
RP_API int32_t rp_batch_seq_len(const rp_batch *batch, int32_t seq);
RP_API int32_t rp_batch_max_seq_len(const rp_batch *batch);
/* Borrowed arrays, valid until rp_batch_free. cu_seqlens has num_seqs + 1 entries. */
RP_API const int64_t *rp_batch_cu_seqlens(const rp_batch *batch);
RP_API const int32_t *rp_batch_prompt_lens(const rp_batch *batch);
RP_API const int32_t *rp_batch_response_lens(const rp_batch *batch);
RP_API const int32_t *rp_batch_group_ids(const rp_batch *batch);

/* How the routing ids are laid out. In every layout the id of (token t, layer l,
 * choice j) sits at element t*token_stride + l*layer_stride + j*k_stride of its array
 * (strides count ids, not bytes), where t and the array are:
 *   RP_ROUTING_PACKED     one array `base` for all tokens; t is the global token index
 *                         (cu_seqlens[s] + position): one [tokens, layers, k] tensor.
 *   RP_ROUTING_PER_SEQ    `bases[s]` per sequence; t restarts at 0 in each: the
 *                         (seq_len, layers, k) arrays vLLM and SGLang return for R3.
 *   RP_ROUTING_PER_LAYER  `bases[l]` per layer, layer_stride unused; t global:
 *                         Megatron's router-replay buffers, one [tokens, k] per layer. */
typedef enum rp_routing_layout {
    RP_ROUTING_PACKED = 0,
    RP_ROUTING_PER_SEQ = 1,
    RP_ROUTING_PER_LAYER = 2
} rp_routing_layout;

/* A borrowed view of routing replay: RoutePack never copies or frees the ids. */
typedef struct rp_routing {
    rp_routing_layout layout;
    rp_id_width width;
    int32_t num_layers;
    int32_t top_k;
    int64_t token_stride, layer_stride, k_stride;
    const void *base;             /* RP_ROUTING_PACKED */
    const void *const *bases;     /* RP_ROUTING_PER_SEQ / RP_ROUTING_PER_LAYER */
    int32_t num_bases;            /* entries in bases */
} rp_routing;

/* Views of dense, C-ordered arrays (the common case). */
RP_API void rp_routing_packed(rp_routing *r, rp_id_width width, int32_t num_layers, int32_t top_k,
                       const void *ids);
RP_API void rp_routing_per_seq(rp_routing *r, rp_id_width width, int32_t num_layers, int32_t top_k,
                        const void *const *seq_ids, int32_t num_seqs);
RP_API void rp_routing_per_layer(rp_routing *r, rp_id_width width, int32_t num_layers,
                          int32_t top_k, const void *const *layer_ids);

/* Check a view against a batch and a model: shape, strides, and every id in
 * [0, num_experts). The first bad id is reported with its sequence, token, layer and
 * choice ("sequence 17 token 5 layer 3 choice 0 has expert id 71, but the model has 64
 * experts"). */
RP_API rp_status rp_routing_check(const rp_routing *r, const rp_batch *batch, int32_t num_experts,
                           rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
