/* Remap: for every token-choice of a microbatch, the physical slot (EP rank, slot) it is
 * dispatched to under a placement with replicas, splitting each expert's tokens over
 * its replicas deterministically, as the cost model assumes. The split rule is in
 * docs/kernels.md; rp_gpu_remap (routepack/gpu.h) gives the same integers on a GPU,
 * and rp_remap forwards device memory to it. */
#ifndef ROUTEPACK_REMAP_H
#define ROUTEPACK_REMAP_H

#include "routepack/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Physical ids of microbatch `mb`, the same in every EP group: 0 .. S-1 are the
 * placement's slots (EP-rank-major, as in the plan); S + i is the i-th extra replica
 * of (mb, layer) in the plan's order (rp_plan_extra_replica, which sorts by expert).
 * Returns P = S + the most extra replicas one layer has in `mb`: the row length of
 * rp_remap's slot_tokens; -1 for a plan without placement or `mb` out of range. */
RP_API int32_t rp_remap_num_physical(const rp_plan *plan, int32_t mb);
/* The EP rank holding physical id `phys` at (mb, layer), -1 when no replica has that
 * id (an extra id past the layer's extras, or anything out of range). */
RP_API int32_t rp_remap_physical_ep_rank(const rp_plan *plan, int32_t mb, int32_t layer,
                                         int32_t phys);

/* Remap microbatch `mb` of the plan's packing. Sequence s of the microbatch runs on
 * GPU g (from the packing: DP rank = GPU, EP group q = g / ep_size), and each of its
 * token-choices (t, layer, j) with logical expert e goes to one replica of e in its
 * own EP group:
 *   - single candidate: the only one;
 *   - explicit shares of (mb, layer, e) (rp_plan_set_shares): source g's occurrences
 *     of e split by largest remainder over the shares, in occurrence order;
 *   - RP_SPLIT_EVEN: round robin over all replicas, starting at g's EP rank;
 *   - RP_SPLIT_LOCALITY: round robin over the replicas on g itself, else those on g's
 *     node, else all.
 * Occurrences count per source GPU and (layer, expert) in the order sequences are
 * listed for (g, mb), then tokens, then choices (docs/kernels.md has the exact rule).
 * Writes phys_ids[(t * L + layer) * k + j] for every token t of the microbatch's
 * sequences (t is the global token index, cu_seqlens[s] + position: a packed
 * [tokens, layers, k] int32 array for the whole batch); entries of tokens outside the
 * microbatch are not touched. slot_tokens (may be NULL) receives, for every layer and
 * EP group q, the token-choices each physical id receives:
 * slot_tokens[(layer * Q + q) * P + p], P = rp_remap_num_physical. `routing` is any
 * host view (routepack/batch.h); num_threads > 1 splits the work over threads by
 * source GPU (same result). Errors (nothing written): a plan without packing or
 * placement, or shaped unlike cfg, batch or routing (RP_EINVAL); a sequence listed
 * twice in the microbatch, an expert without a replica, shares that do not match the
 * replica count or sum to 0 (RP_EPLAN); an id out of range (RP_ERANGE, naming the
 * lowest sequence, then layer, token and choice, as rp_routing_check); more than
 * 2^31-1 token-choices on one GPU (RP_ERANGE). Each id is read once where it is
 * used and checked there, so routing changed by another thread during the call cannot
 * make it index out of bounds: an id that turns out of range after the checking pass is
 * RP_ERANGE too ("... (the routing changed during the call)"), and only then may the
 * microbatch's entries of phys_ids be partly written (slot_tokens is not).
 *
 * Device memory: when the routing ids are device (or managed) memory (asked of CUDA,
 * routepack/gpu.h), the call is rp_gpu_remap's: phys_ids must then be device memory
 * too, the view packed (any strides; per-sequence or per-layer device arrays are
 * RP_ENOTSUP), `num_threads` is ignored, slot_tokens is still written on the host, the
 * same integers result, and the device is synchronised before the call returns (more
 * split (layer, expert) pairs than the kernel holds is RP_ENOTSUP, see rp_gpu_remap).
 * Ids and phys_ids on different sides (when the batch has tokens), a view whose
 * arrays are partly on each, or slot_tokens in device memory are RP_EINVAL. Host
 * memory (pinned or pageable) always takes the CPU path, as does everything without
 * CUDA or a GPU. */
RP_API rp_status rp_remap(const rp_plan *plan, const rp_config *cfg, int32_t mb,
                          const rp_batch *batch, const rp_routing *routing, rp_split_rule rule,
                          int32_t num_threads, int32_t *phys_ids, int64_t *slot_tokens,
                          rp_error *err);

/* Remap one GPU's own tokens of microbatch `mb`: what rank `gpu` of a distributed job
 * does (docs/distributed.md) without the other ranks' routing. The tokens are those of
 * the sequences the plan lists for (gpu, mb) (rp_plan_microbatch), in list order: local
 * sequence i is the i-th listed, and local token t counts through them in that order
 * (their THD concatenation). `batch` is the whole step's batch the plan was made for
 * (lengths only are read); `local_routing` views the listed sequences' ids only, indexed
 * as a batch of just them (any host layout, as rp_remap takes). Writes
 * phys_ids[(t * L + layer) * k + j] for every local token: exactly the ids rp_remap
 * writes for those tokens, because a token's replica depends only on its own GPU's
 * occurrences. slot_tokens (may be NULL) receives [layer * P + p]: the token-choices this
 * GPU sends to physical id p of its own EP group (P = rp_remap_num_physical); summed over
 * the GPUs of EP group q it is rp_remap's slot_tokens row q. Errors (nothing written):
 * gpu out of range (RP_EINVAL), and those of rp_remap for the table and the ids (the
 * sequence in an id error is the global one). Device memory: when the local ids are
 * device memory the call is rp_gpu_remap_rank's (routepack/gpu.h), with rp_remap's rules
 * for it (phys_ids device memory too, a packed view, slot_tokens on the host, the same
 * integers, the device synchronised before it returns). */
RP_API rp_status rp_remap_rank(const rp_plan *plan, const rp_config *cfg, int32_t mb, int32_t gpu,
                               const rp_batch *batch, const rp_routing *local_routing,
                               rp_split_rule rule, int32_t *phys_ids, int64_t *slot_tokens,
                               rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
