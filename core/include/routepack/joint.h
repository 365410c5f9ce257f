/* The joint RoutePack planner: packing that balances attention, tokens and expert load
 * within every microbatch, placement with replicas that pays for its migration, and
 * per-microbatch replica shares and extra replicas, refined and checked against the
 * cost model (docs/routepack-policy.md). */
#ifndef ROUTEPACK_JOINT_H
#define ROUTEPACK_JOINT_H

#include "routepack/cost.h"
#include "routepack/plan.h"
#include "routepack/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rp_joint_params {
    /* Microbatches per rank: > 0 fixes the count; 0 takes limits.num_microbatches, and
     * when that is 0 too, the fewest that the packing fits under the caps (starting
     * from ceil(tokens / (GPUs x cap)), one more at a time). */
    int32_t num_microbatches;
    /* The two halves, for ablations. pack = false packs as the token_kk baseline does;
     * place = false places as the eplb baseline does, without shares or extra replicas. */
    bool pack, place;
    /* Packing: weight of putting a second response of one prompt (same group id, hence
     * the same routing preferences) into the same (microbatch, EP group), as a fraction
     * of that sequence's expert work. 0 turns it off. >= 0. */
    double prompt_spread;
    /* Packing: candidate sequence trades evaluated (against the surrogate) to mix routing
     * profiles across EP groups inside each microbatch: a sequence of the group that
     * overflows the placement trades places with one of about the same length in
     * another group. Work, not time. 0: none. >= 0. */
    int64_t balance_evaluations;
    /* Placement: rounds of replica moves and swaps per layer against the per-microbatch,
     * per-group loads (0: the EPLB-style greedy alone). >= 0. */
    int32_t place_rounds;
    /* Per-microbatch levers: explicit replica shares; and up to this many extra
     * replicas per EP rank per (microbatch, layer), added only where the surrogate
     * saving exceeds their copy time (0: none). >= 0. */
    bool shares;
    int32_t max_extra_per_rank;
    /* Migration: the number of steps a placement is expected to serve. A layer is
     * re-placed only when its predicted saving (this step's, plus the persistent part,
     * from expected_loads, over the other horizon - 1 steps) exceeds the time
     * to migrate it (rp_cost_migration's model, one layer); otherwise the previous
     * placement stays, moving only replicas that pay back within the step. > 0;
     * INFINITY: always re-place. Ignored without a previous plan. */
    double horizon_steps;
    /* Exact refinement: rp_search_local on the joint plan with this many candidate
     * evaluations (rp_cost_try_* calls; work, never time). 0: none. >= 0. */
    int64_t refine_evaluations;
    /* The refinement's operations budget (rp_search_params.max_operations): it stops
     * once the evaluator has counted this many operations. 0: none. >= 0. */
    int64_t refine_max_operations;
    uint64_t seed;
    /* Baselines (rp_baseline_names) built, evaluated and returned instead of the joint
     * plan when one of them scores better; NULL-terminated. NULL: the default list
     * (token_kk+contiguous, token_kk+eplb, verl_kk+eplb, attn_kk+eplb); a list holding
     * only NULL: none (the joint plan is still evaluated when refinement asks for it). */
    const char *const *fallbacks;
    /* The per-expert loads expected over the coming steps, [num_layers * num_experts]
     * (any scale: each layer is scaled to this step's token-choices), for the persistent
     * part of a re-placement's saving. The mean of recent past steps' loads is a good
     * estimate: a placement fitted to this step's noise gains nothing on it, one that
     * follows a lasting shift in popularity does. NULL: this step's own loads (which
     * assumes they persist). Finite, >= 0. Borrowed for the call. */
    const double *expected_loads;
    /* Added after the first version (append only). */
    /* The fraction of a re-placement's persistent saving expected to hold on the coming
     * steps, in [0, 1]: the rule counts (horizon_steps - 1) x persistence x the
     * persistent saving. 1 (the default) takes the prediction at its word; the shipped
     * policy measures it from the realised savings of its earlier moves
     * (docs/routepack-policy.md, "Persistence from history"). */
    double persistence;
    /* Also score the joint packing run with per-forward balancing (Megatron-Core's
     * virtual-expert balancer: the evenly owned contiguous placement, no levers, the
     * balancer fixing each forward's expert side) where the config's limits allow it
     * (rp_vexp_check_config), and return it when it scores better than the joint
     * placement (step + migration / horizon_steps). This assumes the trainer can run the
     * balancer, as the token_kk+virtual_experts baseline does; the plan says so
     * (per_forward_balancing virtual_experts). false (the default): never. Ignored when
     * the config's execution.per_forward_balancing already asks for the balancer (every
     * plan then runs with it) or place is false. */
    bool virtual_experts;
    /* Migration: relabel a re-placed layer's EP ranks among interchangeable ones (same
     * node, slot count and speeds) so that it keeps the most experts where the previous
     * placement has them: the same score, less to migrate. true by default. */
    bool relabel;
    /* Migration the joint placement costs every step it stays (seconds): its re-fits to
     * each batch pay back within their step and recur, unlike a one-off move. Against a
     * placement that stops moving (the per-forward balancer's, the fallbacks), the joint
     * candidate is then charged (migration + (horizon_steps - 1) x this) / horizon_steps
     * instead of migration / horizon_steps, so it is not entered for a gain its re-fits
     * eat. The shipped policy measures it (the mean migration of its joint plans that
     * followed a joint plan). 0 (the default): none. Finite, >= 0. */
    double recurring_migration_s;
    /* Gate on the fallback check: the fallbacks are built and evaluated only when the
     * joint candidate's step / lower bound (rp_joint_report.joint_ratio) is above this;
     * the joint candidate (and the virtual-expert one) is then evaluated first, to read
     * that ratio. A caller that checks on some steps only passes the ratio it last saw
     * times a tolerance, so a step where the joint plan fits its batch worse is still
     * checked. 0 (the default): always check. Finite, >= 0. */
    double fallback_above_ratio;
    /* Gate on the joint placement, beside the virtual-expert candidate, under the
     * fallback gate (fallbacks and fallback_above_ratio > 0): the candidate is built and
     * scored first and returned as it is when its step / lower bound is at most
     * fallback_above_ratio; above it, the joint placement is built and everything is
     * compared, the fallbacks included. For a caller whose last check returned the
     * balancer's plan, on the steps between checks: it skips the construction of a
     * placement that lost (most of the planner's time), which the next check judges
     * again. false (the default): always both. Ignored without the fallback gate, where
     * the virtual-expert candidate does not apply (virtual_experts), and with
     * refine_evaluations or balance_evaluations. */
    bool balancer_first;
} rp_joint_params;

/* Defaults: the full joint planner, prompt_spread 0.5, no balance evaluations,
 * place_rounds 4,
 * shares on, one extra replica per EP rank, a horizon of 10 steps, no exact
 * refinement, seed 0, the default fallbacks. */
RP_API rp_joint_params rp_joint_defaults(void);

/* What the planner did and how the returned plan scores. Times in seconds for the
 * whole step (forward and backward), as rp_cost_summary gives them. */
typedef struct rp_joint_report {
    char chosen[32];           /* "joint", or the name of the baseline returned instead */
    bool evaluated;            /* false: nothing was evaluated exactly (no fallbacks, no
                                  refinement); the figures below are then NAN */
    double step_s, lower_bound_s, ratio;   /* the returned plan */
    double joint_step_s;       /* the joint candidate, after refinement */
    double joint_ratio;
    double best_fallback_step_s; /* the best fallback; NAN without fallbacks */
    char best_fallback[32];
    /* Comparisons use step_s + migration_s / horizon_steps (with a previous plan). */
    double migration_s, migration_bytes;   /* previous -> returned plan; 0 without previous */
    int32_t num_microbatches;
    int32_t layers_replaced;   /* layers whose placement the planner changed (of the
                                  previous plan's; all of them without previous) */
    int32_t share_sets, extra_replicas;
    double surrogate_saving_s; /* predicted per-step saving of the re-placed layers */
    int64_t refine_evaluations;
    int64_t refine_operations;  /* the evaluator's operations in the refinement (rp_search_result) */
    bool refine_stopped;        /* refine_max_operations ended it early */
    /* Added after the first version (append only). */
    /* The returned plan runs with per-forward balancing (virtual experts): under the
     * config's execution.per_forward_balancing, or as the candidate of
     * rp_joint_params.virtual_experts when it scored better (chosen is then "joint"). */
    bool per_forward_balancing;
    double virtual_experts_step_s; /* that candidate's step time; NAN when not scored */
    bool fallbacks_checked;    /* the fallbacks were built and evaluated: a non-empty list,
                                  and the joint candidate above fallback_above_ratio */
    bool joint_built;          /* the joint placement was built (false: balancer_first
                                  returned the virtual-expert candidate; joint_step_s and
                                  joint_ratio are then NAN) */
} rp_joint_report;

/* The exact evaluations rp_joint_plan makes to choose its packing before it places the
 * experts: under pipeline parallelism (topology.pipeline_parallel_size > 1) one for each
 * packing it tries (docs/routepack-policy.md, "Packing under pipeline parallelism"); 0
 * otherwise, and for a NULL config. For work budgets (the sandbox's rp.joint). */
RP_API int32_t rp_joint_packing_evaluations(const rp_config *cfg);

/* Plan one step jointly (docs/routepack-policy.md gives the algorithm).
 * - `stats`: this step's routing statistics (required).
 * - `previous`: the last step's plan or NULL: its placement is kept where moving
 *   away from it does not pay within the horizon, and experts keep their slots.
 * - `cost`: an evaluator for this config, batch and statistics, or NULL (one is made
 *   with the even split rule and freed); passing one shares its lower-bound cache and
 *   its split rule. Afterwards it is bound to whichever plan it evaluated last:
 *   evaluate the returned plan before using it incrementally. With fallbacks, the joint
 *   candidate is evaluated last (first under fallback_above_ratio, and last when that
 *   skips the check), so when it is returned that evaluation reuses the per-microbatch
 *   counts (a cheaper evaluation, same result).
 * - `params`: NULL for the defaults.
 * The plan is new (caller frees with rp_plan_free) and valid for cfg and batch
 * (rp_plan_validate). Deterministic: the same inputs give the same plan, bit for bit,
 * on every machine (no clock, no address-dependent order). With fallbacks checked
 * (rp_joint_report.fallbacks_checked), the returned plan scores no worse under the cost
 * model than any of them.
 * `report` may be NULL. Errors: missing or mismatched inputs (RP_EINVAL), a sequence
 * longer than the cap or a fixed microbatch count the caps cannot meet (RP_ERANGE),
 * bad parameters (RP_EINVAL naming the field), allocation failure; on error nothing
 * is returned and `previous` is untouched. */
RP_API rp_status rp_joint_plan(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                               const rp_stats *stats, const rp_plan *previous, rp_cost *cost,
                               const rp_joint_params *params, rp_plan **out,
                               rp_joint_report *report, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
