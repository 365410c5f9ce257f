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

/* ---- exchanging statistics between ranks (docs/distributed.md) ----
 * A rank computes the statistics of the sequences it holds (rp_stats_compute on a batch
 * of just those sequences), serialises them, and the ranks exchange the bytes; every
 * rank then merges the parts into the whole step's statistics, which are bit-identical
 * to rp_stats_compute over the whole batch in global sequence order.
 *
 * The serialised form, version 1, little-endian whatever the host:
 *   offset  bytes  field
 *   0       8      magic "RPSTATS\0"
 *   8       4      u32 version (1)
 *   12      4      u32 header bytes (64)
 *   16      4      i32 num_seqs (n)
 *   20      4      i32 num_layers (L)
 *   24      4      i32 num_experts (E)
 *   28      4      i32 top_k
 *   32      8      i64 num_tokens
 *   40      8      u64 histogram bytes (H)
 *   48      8      u64 XXH64 (seed 0) of the n + H bytes after the header
 *   56      8      reserved, 0
 *   64      n      u8 width of each sequence's counts: 0 (all zero), 1, 2 or 4
 *   64 + n  H      per sequence with width w > 0, in order: L x E counts ([layer][expert])
 *                  of w bytes each; H = sum of L * E * w
 * Total 64 + n + H bytes (rp_stats_serialized_bytes). Expert loads are not sent: the
 * reader sums them from the counts. */
#define RP_STATS_WIRE_VERSION 1
#define RP_STATS_WIRE_HEADER_BYTES 64

/* Bytes rp_stats_serialize writes for these statistics. */
RP_API size_t rp_stats_serialized_bytes(const rp_stats *stats);

/* Write the serialised form into buf[0 .. buf_bytes). Errors (nothing written): a
 * buffer smaller than rp_stats_serialized_bytes (RP_ERANGE, naming both sizes), NULL
 * arguments (RP_EINVAL). */
RP_API rp_status rp_stats_serialize(const rp_stats *stats, void *buf, size_t buf_bytes,
                                    rp_error *err);

/* Read statistics back from `bytes` bytes (never trusted): a copy owned by the caller
 * (rp_stats_free), allocated through ctx, equal in every count, width, load and size
 * to the statistics that were serialised. Every field is checked before anything is
 * allocated from it: errors are RP_EFORMAT for a short or long buffer (the size the
 * header implies against the length given), a wrong magic, a header size other than
 * 64, a width other than 0/1/2/4, a width wider than the sequence's largest count needs
 * (the form is canonical), or a sequence whose layers do not each sum to the same
 * multiple of top_k (each token routes top_k choices at every layer), or counts that do
 * not sum to num_tokens * top_k, or a shape the bytes cannot describe (L x E above the
 * histogram bytes, or above 2^24 when no sequence has counts: the work of reading
 * follows from the bytes, never from the header's word alone); RP_ENOTSUP for a later
 * version; RP_EINVAL for counts out of range (n < 0, L, E or top_k < 1, L or E above
 * 65536, top_k above E, num_tokens < 0); RP_ERANGE for sizes that
 * overflow; RP_ECHECKSUM when the payload does not match its XXH64. err->offset is the
 * byte offset of the bad field where there is one, err->sequence the bad sequence. */
RP_API rp_status rp_stats_deserialize(rp_context *ctx, const void *bytes, size_t len,
                                      rp_stats **out, rp_error *err);

/* Merge per-rank parts into the whole step's statistics: part i holds the sequences
 * global_ids[i][0 .. rp_stats_num_seqs(parts[i])) (in its own order), and the result
 * (owned by the caller, allocated through ctx) has num_seqs sequences in global id
 * order, bit-identical to rp_stats_compute over the whole batch. A part may have no
 * sequences (its ids may then be NULL). Errors (no result): num_parts < 1 or
 * num_seqs < 0 (RP_EINVAL); parts that disagree on layers, experts or top_k (RP_EINVAL,
 * naming the part and both values); a global id out of [0, num_seqs), an id given
 * twice, or an id in no part (RP_EINVAL, "global sequence id 17 is in parts 0 and 2",
 * "... is in no part"; err->sequence = the id); sizes that overflow (RP_ERANGE); no
 * memory. */
RP_API rp_status rp_stats_merge(rp_context *ctx, int32_t num_parts, const rp_stats *const *parts,
                                const int32_t *const *global_ids, int32_t num_seqs,
                                rp_stats **out, rp_error *err);

/* rp_stats_merge of serialised parts, without making each part's statistics first:
 * part i is bytes[i][0 .. lens[i]), checked exactly as rp_stats_deserialize checks one
 * (the message starts "part i: "). Same result and errors as deserialising each and
 * calling rp_stats_merge. */
RP_API rp_status rp_stats_merge_serialized(rp_context *ctx, int32_t num_parts,
                                           const void *const *bytes, const size_t *lens,
                                           const int32_t *const *global_ids, int32_t num_seqs,
                                           rp_stats **out, rp_error *err);

/* rp_stats_merge_serialized for a trainer that merges every step: *stats is NULL or the
 * statistics an earlier merge (this call or rp_stats_merge_serialized, same context)
 * returned, which the caller no longer needs; their histogram storage, when large enough,
 * takes the new merge (at the reference scale the merge otherwise faults in 50 MB of
 * fresh pages each step, most of its time). On success the earlier statistics are freed
 * and *stats is the merge (the same result as rp_stats_merge_serialized); on error *stats
 * is unchanged and still valid. Errors: rp_stats_merge_serialized's; stats NULL
 * (RP_EINVAL). */
RP_API rp_status rp_stats_merge_serialized_reusing(rp_context *ctx, int32_t num_parts,
                                                   const void *const *bytes, const size_t *lens,
                                                   const int32_t *const *global_ids, int32_t num_seqs,
                                                   rp_stats **stats, rp_error *err);

/* Check that statistics describe `batch`: the same number of sequences, the same
 * total tokens, and each sequence's histogram at every layer summing to its length x
 * top_k. Errors (RP_EINVAL, naming the first sequence that differs and both values;
 * err->sequence): a count or length mismatch. */
RP_API rp_status rp_stats_check_batch(const rp_stats *stats, const rp_batch *batch, rp_error *err);

/* top_k and num_tokens the statistics were computed with. */
RP_API int32_t rp_stats_top_k(const rp_stats *stats);
RP_API int64_t rp_stats_num_tokens(const rp_stats *stats);

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
