/* Plans: a packing (which sequences each DP rank runs in each microbatch) and a
 * placement (which experts each EP rank holds at each MoE layer), plus the optional
 * per-microbatch levers (replica token shares, extra in-node replicas). The plan JSON
 * schema (docs/formats.md) is the one contract between the policy engine, the joint
 * policy, migration and the Python binding. */
#ifndef ROUTEPACK_PLAN_H
#define ROUTEPACK_PLAN_H

#include "routepack/batch.h"
#include "routepack/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How an expert's tokens split over its replicas when the plan sets no shares. */
typedef enum rp_split_rule {
    RP_SPLIT_EVEN = 0,     /* each replica takes an equal share of every source's tokens */
    RP_SPLIT_LOCALITY = 1  /* tokens go to a replica on the same GPU, else the same node,
                              else evenly over all replicas */
} rp_split_rule;

/* The newest plan format version this build reads and writes; it reads every older one
 * (version 1: no microbatch order). The writer writes 1 for a plan without a microbatch
 * order, so such plans stay readable by older builds. */
#define RP_PLAN_VERSION 2

typedef struct rp_plan rp_plan;

/* An empty plan shaped for `cfg`: num_gpus DP ranks, `num_microbatches` microbatches
 * per rank (>= 1), EP groups of ep_size GPUs with the config's slots per EP rank, the
 * model's layers and experts. Nothing is packed and every slot is empty (-1). */
RP_API rp_status rp_plan_new(rp_context *ctx, const rp_config *cfg, int32_t num_microbatches,
                             rp_plan **out, rp_error *err);
RP_API void rp_plan_free(rp_plan *plan);
/* A deep copy (for keeping the last good plan). */
RP_API rp_status rp_plan_copy(const rp_plan *plan, rp_plan **out, rp_error *err);

RP_API int32_t rp_plan_num_gpus(const rp_plan *plan);
RP_API int32_t rp_plan_num_microbatches(const rp_plan *plan);
RP_API int32_t rp_plan_ep_size(const rp_plan *plan);
RP_API int32_t rp_plan_num_layers(const rp_plan *plan);
RP_API int32_t rp_plan_num_experts(const rp_plan *plan);
/* The context the plan was created in (allocates what rp_plan_to_json returns). */
RP_API rp_context *rp_plan_context(const rp_plan *plan);

/* ---- packing ---- */

/* Replace the packing: sequence s runs on DP rank seq_rank[s] in microbatch seq_mb[s];
 * inside a microbatch sequences keep ascending id order. Errors: ids out of range
 * (the plan is unchanged). */
RP_API rp_status rp_plan_set_packing(rp_plan *plan, int32_t num_seqs, const int32_t *seq_rank,
                                     const int32_t *seq_mb, rp_error *err);
/* Replace the packing from explicit ordered lists: lists[rank * M + mb] holds
 * counts[rank * M + mb] sequence ids. A sequence missing or repeated is recorded as
 * such and reported by rp_plan_check (the lists are kept verbatim). */
RP_API rp_status rp_plan_set_microbatches(rp_plan *plan, int32_t num_seqs,
                                          const int32_t *const *lists, const int32_t *counts,
                                          rp_error *err);
/* Move sequence `seq` (its first occurrence; or pack it if it is not packed) to the end
 * of microbatch `mb` of DP rank `rank`: one step of a local search. Errors: no
 * packing, ids out of range (the plan is unchanged). */
RP_API rp_status rp_plan_move_sequence(rp_plan *plan, int32_t seq, int32_t rank, int32_t mb,
                                       rp_error *err);
RP_API bool rp_plan_has_packing(const rp_plan *plan);
RP_API int32_t rp_plan_num_seqs(const rp_plan *plan);
/* The ordered sequence ids of (rank, mb); borrowed until the packing changes. */
RP_API const int32_t *rp_plan_microbatch(const rp_plan *plan, int32_t rank, int32_t mb,
                                         int32_t *count);
/* Where a sequence runs (the first occurrence if repeated); -1 if not packed. */
RP_API int32_t rp_plan_seq_rank(const rp_plan *plan, int32_t seq);
RP_API int32_t rp_plan_seq_microbatch(const rp_plan *plan, int32_t seq);

/* ---- placement ----
 * Physical slots are numbered EP-rank-major: EP rank j holds slots
 * [slot_begin[j], slot_begin[j+1]); the same placement is used by every EP group.
 * phy2log[slot] is the logical expert in a slot, -1 for an empty slot. */

RP_API bool rp_plan_has_placement(const rp_plan *plan);
RP_API int32_t rp_plan_total_slots(const rp_plan *plan);
RP_API const int32_t *rp_plan_slot_begin(const rp_plan *plan);  /* [ep_size + 1] */
/* Borrowed [total_slots] array of a layer; valid until the placement changes. */
RP_API const int32_t *rp_plan_phy2log(const rp_plan *plan, int32_t layer);
/* Set a whole layer's slots. Ids must be in [-1, num_experts). */
RP_API rp_status rp_plan_set_phy2log(rp_plan *plan, int32_t layer, const int32_t *phy2log,
                                     rp_error *err);
/* Set the experts EP rank `ep_rank` holds at `layer` (at most its slot count; the
 * rest of its slots become empty), in the order given. */
RP_API rp_status rp_plan_set_gpu_experts(rp_plan *plan, int32_t layer, int32_t ep_rank,
                                         const int32_t *experts, int32_t count, rp_error *err);
/* Renumber slots inside each EP rank so that every expert that `previous` already had
 * on that rank keeps its slot index (so it need not move); others fill the free slots
 * in ascending expert order, empty slots last. For the given per-rank expert sets no
 * other slot order moves fewer experts; a rank whose experts did not change ends up
 * exactly as in `previous`. `previous` without a placement: ascending order. Errors:
 * no placement, `previous` of another shape (the plan is unchanged). */
RP_API rp_status rp_plan_stabilize_slots(rp_plan *plan, const rp_plan *previous, rp_error *err);
/* Lay experts out contiguously, one replica each, as trainers start (Megatron's
 * layout), the same at every layer: expert e on EP rank floor(e * ep_size / E), in
 * ascending order; where a rank has fewer slots than its block, the overflow goes to
 * the next rank with a free slot (wrapping around to rank 0). Spare slots stay empty.
 * Errors: fewer slots than experts. */
RP_API rp_status rp_plan_set_contiguous(rp_plan *plan, rp_error *err);

/* Replica count of each expert of a layer into logcnt[num_experts] (NULL: only the
 * largest); returns the largest count, -1 for a layer out of range. */
RP_API int32_t rp_plan_logcnt(const rp_plan *plan, int32_t layer, int32_t *logcnt);
/* The arrays EP dispatchers consume, as DeepSeek's EPLB defines them, for all layers:
 * phy2log[L][S], logcnt[L][E] and log2phy[L][E][max_replicas] (replica slots in
 * ascending slot order, padded with -1). A physical expert index is a slot:
 * slot_begin[j] + local slot (docs/formats.md). Errors (nothing written): no
 * placement, max_replicas below the largest count (RP_EINVAL), an expert without a
 * replica (RP_EPLAN). */
RP_API rp_status rp_plan_eplb_arrays(const rp_plan *plan, int32_t max_replicas, int32_t *phy2log,
                                     int32_t *log2phy, int32_t *logcnt, rp_error *err);

/* ---- per-microbatch levers (optional) ----
 * Extra replicas: for microbatch mb at a layer, EP rank ep_rank also holds a temporary
 * copy of `expert`, copied over NVLink from a replica in the same node.
 * Shares: the fraction of an expert's tokens in (mb, layer) that each of its replicas
 * takes: replicas in ascending slot order, then its extra replicas in insertion order.
 * Without explicit shares the cost model's split rule applies. */

RP_API rp_status rp_plan_add_extra_replica(rp_plan *plan, int32_t mb, int32_t layer,
                                           int32_t expert, int32_t ep_rank, rp_error *err);
RP_API rp_status rp_plan_set_shares(rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                                    const double *shares, int32_t count, rp_error *err);
/* Drop all extra replicas and explicit shares. */
RP_API void rp_plan_clear_levers(rp_plan *plan);
/* The replicas of `expert` in (mb, layer): their EP ranks and shares (-1 each when no
 * explicit shares are set). Writes at most `cap` entries (either array may be NULL);
 * returns the count, which may exceed `cap`. */
RP_API int32_t rp_plan_replicas(const rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                                int32_t *ep_ranks, double *shares, int32_t cap);
/* Number of extra replicas in the plan, and the i-th one. They are kept sorted by
 * (mb, layer, expert), in insertion order within one (mb, layer, expert). */
RP_API int32_t rp_plan_num_extra_replicas(const rp_plan *plan);
RP_API void rp_plan_extra_replica(const rp_plan *plan, int32_t i, int32_t *mb, int32_t *layer,
                                  int32_t *expert, int32_t *ep_rank);
/* Per-forward balancing the trainer runs with this plan, inside every EP group
 * (docs/baselines.md, "Virtual experts (MoonEP)"). RP_BALANCING_VIRTUAL_EXPERTS:
 * Megatron-Core's virtual-expert balancer re-balances each (microbatch, layer) forward's
 * expert load from its exact histogram; the cost model prices the plan that way, and
 * validation requires what the balancer requires (routepack/virtual_experts.h): the
 * config's limits, every expert once per layer with num_experts / ep_size on each EP
 * rank, no extra replicas or shares. Part of the plan's JSON ("per_forward_balancing")
 * and hash. A new plan has RP_BALANCING_NONE. (rp_balancing: routepack/config.h.) */
/* RP_EINVAL for a value outside the enum (nothing changes). */
RP_API rp_status rp_plan_set_balancing(rp_plan *plan, rp_balancing balancing, rp_error *err);
RP_API rp_balancing rp_plan_balancing(const rp_plan *plan);

/* Microbatch order (plan version 2; docs/formats.md): the order in which a rank runs its
 * microbatches, which under pipeline parallelism changes the step (the pipeline's critical
 * path). Position k of every rank of an EP group runs together (the all-to-all is
 * collective), so rp_plan_check requires one order per EP group (per job under
 * execution.sync "global"). Without an order every rank runs 0, 1, ..., M - 1.
 * rp_plan_set_microbatch_order sets rank's order from order[M], a permutation of
 * 0 .. M - 1 (NULL: the identity); errors (nothing changes): rank out of range, a value
 * out of range or twice (the message names the rank, the value and its positions), no
 * memory. rp_plan_microbatch_order returns rank's order [M] (borrowed until the plan
 * changes) or NULL when the plan has none (the identity); rp_plan_microbatch_at gives
 * the microbatch at one position (-1 out of range). */
RP_API rp_status rp_plan_set_microbatch_order(rp_plan *plan, int32_t rank, const int32_t *order, rp_error *err);
RP_API const int32_t *rp_plan_microbatch_order(const rp_plan *plan, int32_t rank);
RP_API int32_t rp_plan_microbatch_at(const rp_plan *plan, int32_t rank, int32_t position);
RP_API bool rp_plan_has_microbatch_order(const rp_plan *plan);
/* "none" or "virtual_experts"; NULL for a value outside the enum. */
RP_API const char *rp_balancing_name(rp_balancing balancing);

/* Number of explicit share sets, and the i-th one (sorted by (mb, layer, expert)): its
 * key, and its shares as set (borrowed until the levers change; *count entries). */
RP_API int32_t rp_plan_num_share_sets(const rp_plan *plan);
RP_API const double *rp_plan_share_set(const rp_plan *plan, int32_t i, int32_t *mb,
                                       int32_t *layer, int32_t *expert, int32_t *count);

/* ---- validation ---- */

/* Check the plan against the config and a batch, calling `report` once per violation
 * with a precise message ("plan: layer 12 expert 97 has no replica", "plan: sequence
 * 811 is packed twice (rank 3 mb 1, rank 9 mb 0)", "plan: rank 2 mb 0 holds 40000
 * tokens, over the cap of 32768"; all listed in docs/formats.md). After 100 messages
 * the rest are only counted and one more call says "plan: ... and N more problems".
 * Returns the number of violations (0: valid). Checks only the parts the plan has (packing,
 * placement, levers). `report` may be NULL. `batch` NULL skips the token and memory
 * caps and the sequence count. If memory runs out, that is reported and counted as a
 * violation (a plan that could not be checked is not known to be valid). */
RP_API int32_t rp_plan_check(const rp_plan *plan, const rp_config *cfg, const rp_batch *batch,
                             void (*report)(void *ud, const char *message), void *ud);
/* rp_plan_check as a status: RP_EPLAN with the first violation and the count in `err`
 * ("plan: 3 problems; first: ..."; just the message when there is one; err->sequence
 * and err->expert name the first violation's ids where it has them); RP_ENOMEM if
 * memory ran out while checking. Changes nothing. */
RP_API rp_status rp_plan_validate(const rp_plan *plan, const rp_config *cfg,
                                  const rp_batch *batch, rp_error *err);

/* ---- JSON and hashing ---- */

/* Serialise to the plan JSON schema (docs/formats.md gives the exact layout).
 * *text is NUL-terminated, allocated through the plan's context; free it with
 * rp_text_free. Reading it back gives a plan with the same hash. Errors: a NaN or
 * infinite share (JSON cannot hold it). */
RP_API rp_status rp_plan_to_json(const rp_plan *plan, char **text, size_t *len, rp_error *err);
/* Parse the plan JSON schema against a config (shape must match). Errors give
 * name:line:column and the JSON path. Packing and placement are each optional; the
 * lists are kept verbatim (missing or repeated sequences are for rp_plan_check). */
RP_API rp_status rp_plan_parse(rp_context *ctx, const rp_config *cfg, const char *text,
                               size_t len, const char *name, rp_plan **out, rp_error *err);
RP_API rp_status rp_plan_load(rp_context *ctx, const rp_config *cfg, const char *path,
                              rp_plan **out, rp_error *err);
RP_API rp_status rp_plan_save(const rp_plan *plan, const char *path, rp_error *err);
/* XXH64 of the plan's canonical content (shape, packing lists in order, phy2log,
 * levers): equal plans hash equal on every rank and machine. */
RP_API uint64_t rp_plan_hash(const rp_plan *plan);
/* Whether two plans have the same content: what rp_plan_hash hashes (shape, packing
 * lists in order, phy2log, balancing, microbatch order, extra replicas, shares bit for
 * bit), compared exactly. Two NULLs are equal; NULL and a plan are not. */
RP_API bool rp_plan_equal(const rp_plan *a, const rp_plan *b);

/* What a plan asks of its levers in one step (docs/routepack-policy.md, "Lever
 * statistics"): the replicas in its placement, the explicit share sets, its extra
 * replicas, and what the executor (execution.executor) fetches for them. */
typedef struct rp_lever_stats {
    int32_t replicas;           /* slots holding a second or later copy of an expert, over layers */
    int32_t share_sets;         /* (microbatch, layer, expert) keys with explicit shares */
    int32_t extra_replicas;     /* (microbatch, layer, expert, EP rank) extra replicas */
    int32_t extras_fetched;     /* weight copies the executor makes for them: the distinct
                                   (layer, expert, EP rank) when it fetches a step's extras
                                   once (extras_once), else every extra replica */
    double bytes_fetched;       /* extras_fetched x one expert's weights (3 d f bytes_per_param),
                                   one EP group's */
    double bytes_fetched_ahead; /* of which fetched ahead of the step (execution.extras_ahead) */
} rp_lever_stats;
RP_API rp_status rp_plan_lever_stats(const rp_plan *plan, const rp_config *cfg, rp_lever_stats *out,
                                     rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
