/* Per-forward expert balancing with virtual experts (Megatron-Core's
 * --moe-virtual-expert-load-balance, from Moonshot's MoonEP): the offload plan of one
 * EP group for one (microbatch, layer) forward, and the limits under which a trainer
 * can run it. The cost model prices plans with it when the config's
 * execution.per_forward_balancing is "virtual_experts"; docs/baselines.md ("Virtual
 * experts (MoonEP)") gives the algorithm and where it may differ from Megatron's kernel. */
#ifndef ROUTEPACK_VIRTUAL_EXPERTS_H
#define ROUTEPACK_VIRTUAL_EXPERTS_H

#include "routepack/base.h"
#include "routepack/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Megatron's planner and transport kernels take 1..64 EP ranks
 * (MAX_VIRTUAL_EXPERT_EP_RANKS); one rank has nothing to balance. */
#define RP_VEXP_MIN_EP 2
#define RP_VEXP_MAX_EP 64

/* Whether a trainer can run the balancer on this config: trainer.per_forward_balancer
 * true (it says whether the trainer runs it at all), EP size in 2..64, every EP
 * group inside one node (the weights travel through NVLink symmetric memory), experts
 * evenly owned (num_experts a multiple of ep_size, every GPU with at least
 * num_experts / ep_size slots). RP_EINVAL with a message naming the limit and the value
 * otherwise ("virtual experts: an EP group of 16 GPUs spans nodes of 8 GPUs; ..."). */
RP_API rp_status rp_vexp_check_config(const rp_config *cfg, rp_error *err);

/* One EP group's planner: scratch and results for one forward at a time. Opaque. */
typedef struct rp_vexp rp_vexp;

/* A planner for EP groups of `ep_size` ranks and `num_experts` experts (each rank owns
 * num_experts / ep_size). RP_EINVAL: ep_size outside 2..64, num_experts not a positive
 * multiple of ep_size; RP_ENOMEM. Free with rp_vexp_free (NULL is a no-op). */
RP_API rp_status rp_vexp_new(rp_context *ctx, int32_t ep_size, int32_t num_experts, rp_vexp **out,
                             rp_error *err);
RP_API void rp_vexp_free(rp_vexp *v);

/* Plan one forward. `counts[src * E + e]` (>= 0) are the token-choices that EP rank
 * `src` routes to expert `e`; `owner[e]` is the EP rank holding expert e's weights
 * (NULL: contiguous, e / (E / ep)); each rank must own exactly E / ep experts, its
 * local order ascending expert id. Every rank ends with the group's mean load (the
 * total over E / ep ranks; a remainder of r choices goes to ranks 0..r-1) of
 * token-choices to compute, whatever it routed itself: overloaded owners offload
 * whole quotas to underloaded ranks, each receiving rank from one sender only, into at
 * most E / ep virtual slots. RP_EINVAL (nothing changes): NULL counts, a negative count,
 * uneven or out-of-range ownership; RP_ERANGE: a rank's total beyond 2^31 - 1. */
RP_API rp_status rp_vexp_plan(rp_vexp *v, const int32_t *counts, const int32_t *owner, rp_error *err);

/* Results of the last successful rp_vexp_plan, borrowed until the next plan or free
 * (all zero before the first one). */
RP_API int32_t rp_vexp_ep_size(const rp_vexp *v);
RP_API int32_t rp_vexp_experts_per_rank(const rp_vexp *v);
/* [ep] token-choices each rank computes (native slots and virtual slots). */
RP_API const int64_t *rp_vexp_rank_load(const rp_vexp *v);
/* [E * ep] token-choices of expert e computed on rank r: allocation[e * ep + r]. */
RP_API const int64_t *rp_vexp_allocation(const rp_vexp *v);
/* [ep * (E / ep)] the expert whose weights fill virtual slot s of rank r
 * (slot_expert[r * (E / ep) + s]), -1 when unused; larger allocations first. */
RP_API const int32_t *rp_vexp_slot_expert(const rp_vexp *v);
/* [ep * ep] token-choices rank src sends to rank dst (dst != src; the diagonal holds
 * those computed where they were routed). Each expert's choices, ordered by source
 * rank, fill its destinations in rank order, as Megatron's route map does. */
RP_API const int64_t *rp_vexp_traffic(const rp_vexp *v);
/* Virtual experts instantiated in the group (used slots). */
RP_API int32_t rp_vexp_num_virtual(const rp_vexp *v);
/* [ep] virtual experts whose weights rank r pushes (as owner) and receives. */
RP_API const int32_t *rp_vexp_pushes_out(const rp_vexp *v);
RP_API const int32_t *rp_vexp_pushes_in(const rp_vexp *v);

/* Bytes of one virtual expert's weights (3 d f bytes_per_param: gate, up and down
 * projections), pushed owner -> slot over NVLink before its forward and again before its
 * backward; its weight gradient (same element count, at bytes_per_param) returns to the
 * owner after the backward. */
RP_API double rp_vexp_expert_bytes(const rp_model *model);

#ifdef __cplusplus
}
#endif

#endif
