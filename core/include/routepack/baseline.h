/* Plans built from the primitives: the baselines users run today (docs/baselines.md) and
 * a local search that improves any plan against the cost model. */
#ifndef ROUTEPACK_BASELINE_H
#define ROUTEPACK_BASELINE_H

#include "routepack/cost.h"
#include "routepack/plan.h"
#include "routepack/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- baselines ----
 *
 * A baseline is named PACKING+PLACEMENT:
 *   packing    token_kk  verl <= 0.6.0: Karmarkar-Karp over DP ranks on token counts,
 *                        equal sequence counts per rank, then per rank Karmarkar-Karp
 *                        over microbatches on token counts (dynamic batch size)
 *              verl_kk   verl >= 0.6.1: the same on the workload 24576 L + L^2, with
 *                        verl's ordering of sequences and microbatches
 *              attn_kk   verl_kk's structure keyed by the cost model's attention time
 *              slime_ff  slime --balance-data: first-fit microbatches of each mini-batch
 *                        under the cap, aligned to a multiple of the ranks x
 *                        trainer.microbatch_multiple by splitting, dealt to the ranks by
 *                        Karmarkar-Karp on slime's FLOPs with equal microbatch counts
 *              slime_kk  slime --balance-by-flops: the microbatches by Karmarkar-Karp on
 *                        the FLOPs, dealt alike (both refuse
 *                        trainer.equal_sequences_per_rank: ranks run different counts)
 *   placement  contiguous  expert e on EP rank floor(e * ep_size / E), no replicas
 *              eplb        EPLB from this step's expert loads: replicas apportioned by
 *                          load per replica, packed onto GPUs (hierarchical when the EP
 *                          group's nodes divide the expert groups, else global)
 *              virtual_experts  contiguous, with per-forward balancing by Megatron's
 *                          virtual experts (rp_plan_set_balancing); RP_EINVAL where the
 *                          config rules the balancer out (rp_vexp_check_config)
 */

/* The names rp_baseline_plan accepts, NULL-terminated, static storage. */
RP_API const char *const *rp_baseline_names(void);

/* Build baseline `name` (e.g. "token_kk+eplb") for one step.
 * - `stats`: this step's routing statistics; required by eplb and attn_kk (may be NULL
 *   otherwise).
 * - `previous`: the plan of the last step or NULL; eplb renumbers slots so that experts
 *   already resident on an EP rank keep their slot (rp_plan_stabilize_slots).
 * - `num_microbatches`: > 0 fixes the count; 0 takes the config's
 *   limits.num_microbatches, and when that is 0 too, verl's rule: the largest over DP
 *   ranks of ceil(rank tokens / cap), at most the rank's sequence count. The cap is the
 *   token cap, lowered by the activation memory cap when the config sets one.
 * The plan is new (caller frees with rp_plan_free) and valid for cfg and batch.
 * Errors: an unknown name (RP_EINVAL listing the names), an empty batch, a sequence
 * longer than the cap (RP_ERANGE naming it), a fixed microbatch count the caps cannot
 * meet (RP_ERANGE naming the rank), missing statistics, statistics of another shape.
 * The config's trainer constraints hold: with equal_sequences_per_rank a batch that does
 * not divide over the DP ranks is RP_EINVAL (naming both counts and the key); the count
 * is rounded up to trainer.microbatch_multiple, and a fixed count that is not a multiple
 * is RP_EINVAL. */
RP_API rp_status rp_baseline_plan(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                                  const rp_stats *stats, const rp_plan *previous, const char *name,
                                  int32_t num_microbatches, rp_plan **out, rp_error *err);

/* The packing half of a baseline, alone: `name` is token_kk, verl_kk, attn_kk, slime_ff
 * or slime_kk, built as rp_baseline_plan builds it (stats needed by attn_kk only), except
 * that `equal_size` false replaces verl's equal sequence counts per DP rank by plain
 * Karmarkar-Karp over the ranks (true gives exactly rp_baseline_plan's packing; the
 * config's trainer.equal_sequences_per_rank forces true; slime's packings ignore it). The
 * new plan holds the packing and no placement (caller frees). The shipped packing policies
 * are this call (rp.kk_packing). Errors as rp_baseline_plan's. */
RP_API rp_status rp_baseline_packing(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                                     const rp_stats *stats, const char *name, int32_t num_microbatches,
                                     bool equal_size, rp_plan **out, rp_error *err);

/* ---- local search ---- */

typedef struct rp_search_params {
    /* Budget: the number of candidates drawn, >= 0; each makes at most one
     * rp_cost_try_* call (a pointless draw, such as a second replica of an expert on
     * one EP rank, makes none but still counts, so the search always ends). The search
     * never looks at a clock, so every rank reaches the same plan. */
    int64_t max_evaluations;
    /* Candidates drawn per iteration; the best of them is applied if it lowers the
     * step time (best-of-sample; 1 gives first-improvement descent). >= 1. */
    int32_t sample;
    uint64_t seed;
    /* Neighbourhoods. Sequence moves (to another rank or microbatch) and swaps keep
     * every cap (the cost model refuses what breaks one), and under the config's
     * trainer.equal_sequences_per_rank a move stays inside its rank (another microbatch),
     * so every rank keeps its count; slot changes replace the
     * expert in one slot of one layer, keeping every expert at least one replica and
     * no EP rank two replicas of one expert. */
    bool moves, swaps, slots;
    /* A second budget, in the evaluator's operations (rp_cost_operations, counted from
     * the search's first evaluation on): the search stops after the candidate that
     * passes it. 0: none. Deterministic like the first (the count does not depend on
     * the machine); the policy sandbox sets it to the work the call has left. */
    int64_t max_operations;
} rp_search_params;

/* Defaults: 20000 evaluations, samples of 8, seed 0, all three neighbourhoods, no
 * operations budget. */
RP_API rp_search_params rp_search_defaults(void);

typedef struct rp_search_result {
    double initial_s;        /* step time before */
    double final_s;          /* after: never above initial_s */
    int64_t evaluations;     /* candidates drawn (<= max_evaluations) */
    int64_t iterations;
    int64_t moves, swaps, slots; /* changes applied */
    int64_t operations;      /* the evaluator's operations the search performed, its first evaluation included */
    bool stopped;            /* max_operations ended it before max_evaluations */
} rp_search_result;

/* Improve `plan` in place against `cost` (built for the same config and batch).
 * Evaluates the plan (binding `cost` to it), then repeats until the budget is spent:
 * draw `sample` candidates with a seeded generator (splitmix64), half of them aimed
 * at the current straggler (a sequence of its rank and microbatch when attention
 * decides, a slot of its layer and EP rank when experts do), evaluate each with
 * rp_cost_try_*, and apply the best if it lowers the step time by more than a
 * relative 1e-12 (ties: the first drawn). Deterministic: the same plan, statistics,
 * parameters and seed give the same plan, on every machine. At most max_evaluations
 * try calls, plus one summary per iteration and one apply per improving iteration. The plan must be valid (rp_plan_validate);
 * on error the plan is unchanged unless the error comes from an apply, which leaves
 * the plan valid with the changes made so far. `result` may be NULL. */
RP_API rp_status rp_search_local(rp_cost *cost, rp_plan *plan, const rp_search_params *params,
                                 rp_search_result *result, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
