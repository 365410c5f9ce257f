/* The cost model: one judge for dense attention work and sparse expert work of the
 * same step, its lower bound, a breakdown that names the straggler, and incremental
 * evaluation for local search. Every formula, unit and default constant is in
 * docs/cost-model.md. */
#ifndef ROUTEPACK_COST_H
#define ROUTEPACK_COST_H

#include "routepack/plan.h"
#include "routepack/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* rp_split_rule: routepack/plan.h (remap splits tokens by it too). */

/* Which side of a layer decides its straggler. */
typedef enum rp_side {
    RP_SIDE_ATTENTION = 0,
    RP_SIDE_DISPATCH = 1,
    RP_SIDE_EXPERT = 2,
    RP_SIDE_COMBINE = 3
} rp_side;

/* Figures of one evaluated plan. Times in seconds for the whole step (forward and
 * backward, all microbatches and layers). Under pipeline parallelism step_s is the
 * pipeline's (its critical path plus the once-per-step terms), while the four terms
 * attention_s .. combine_s stay sums over every (mb, layer) of every stage: work, not
 * time along the pipeline; the pipeline figures at the end say how the step splits. */
typedef struct rp_cost_summary {
    double step_s;           /* predicted step time */
    double lower_bound_s;    /* see docs/cost-model.md: every term perfectly balanced */
    double ratio;            /* step_s / lower_bound_s */
    double attention_s;      /* sum over (mb, layer) of the slowest GPU's attention */
    double dispatch_s;
    double expert_s;         /* sum over (mb, layer) of the slowest GPU's expert work */
    double combine_s;
    double grad_reduce_s;    /* extra gradient reduction that replicas add */
    double extra_copy_s;     /* NVLink copies of per-microbatch extra replicas */
    double attention_imbalance; /* mean over mb of max/mean attention across GPUs */
    double expert_imbalance;    /* mean over (mb, layer, EP group) of max/mean expert time */
    int32_t straggler_gpu;   /* the GPU, microbatch and layer whose term is the largest */
    int32_t straggler_mb;
    int32_t straggler_layer;
    rp_side straggler_side;
} rp_cost_summary;

/* What a training step does outside the MoE layers, for the config and batch the
 * evaluator was made for, the same for every plan (docs/cost-model.md, "The whole
 * step"). Seconds per rollout batch; a part the config does not describe is 0
 * (model.vocab_size, model.dense_layers, trainer.logprob_forwards 0). */
typedef struct rp_step_outside {
    double lm_head_s;        /* LM head and loss, forward and backward, every epoch */
    double dense_layers_s;   /* model.dense_layers: dense phase and dense MLP, every epoch */
    double optimizer_s;      /* the optimizer step over what a GPU holds, every optimizer step */
    double dp_grad_s;        /* gradients all-reduced over the data-parallel replicas, not overlapped */
    double logprob_s;        /* trainer.logprob_forwards forward passes of the LM head and dense layers */
    double total_s;          /* their sum */
} rp_step_outside;

/* Added after the first version (rp_cost_summary is embedded in rp_step_report, so it
 * stays as it was). How the step of the last evaluated plan splits along the pipeline
 * (docs/cost-model.md, "Pipeline figures"): per mini-batch (trainer.mini_batches; each
 * its own pipeline) in the sync domain that sets it, summed over the mini-batches, times
 * trainer.epochs. Without PP: 1 stage, critical_path_s = stage_busy_s, bubble_s 0 (with
 * one mini-batch and epoch: step_s - grad_reduce_s - extra_copy_s). */
typedef struct rp_pipeline_summary {
    int32_t stages;          /* pipeline_parallel_size */
    int32_t busiest_stage;   /* the stage whose passes take longest (the lowest on ties) */
    double step_s;           /* as rp_cost_summary.step_s */
    double critical_path_s;  /* the schedule's critical path: step_s less the gradient
                                reduction and extra-replica copies */
    double stage_busy_s;     /* the busiest stage's passes, forward and backward, every
                                microbatch over its layers */
    double bubble_s;         /* critical_path_s - stage_busy_s: that stage idle (warm-up,
                                cool-down, p2p, waiting for other stages) */
} rp_pipeline_summary;

/* An evaluator bound to one step: config, batch and its routing statistics (all
 * borrowed; they must outlive it). Not thread-safe: one thread at a time per
 * evaluator (try_* use its scratch space). Errors of rp_cost_new: NaN, infinite or
 * non-positive constants it uses (named in the message), an empty batch, statistics
 * of another batch or model shape, a batch too large for its int32 counts. */
typedef struct rp_cost rp_cost;

RP_API rp_status rp_cost_new(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                             const rp_stats *stats, rp_split_rule rule, rp_cost **out,
                             rp_error *err);
RP_API void rp_cost_free(rp_cost *cost);
/* The config the evaluator was built for (borrowed from rp_cost_new's caller). */
RP_API const rp_config *rp_cost_config(const rp_cost *cost);

/* Forward time of one layer's attention for a sequence of `seq_len` tokens on a GPU of
 * relative speed 1 (causal attention plus QKV/O projections). */
RP_API double rp_cost_attention_s(const rp_cost *cost, int64_t seq_len);
/* Forward and backward time of one layer's dense work for a sequence of `seq_len` tokens
 * on a GPU of speed 1: attention, projections and the token-linear work, each at its own
 * backward multiplier (the fixed cost per layer is not a sequence's). */
RP_API double rp_cost_dense_s(const rp_cost *cost, int64_t seq_len);
/* What a step does outside the MoE layers (rp_step_outside) for the evaluator's config
 * and batch. RP_EINVAL without an evaluator. */
RP_API rp_status rp_cost_outside(const rp_cost *cost, rp_step_outside *out, rp_error *err);
/* Forward time of one expert slot processing `tokens` tokens at speed 1: under a grouped
 * GEMM (execution.expert_gemm "grouped"), the forward-equivalent time of that expert alone
 * on its GPU, (forward + backward) / (1 + backward.experts) (docs/cost-model.md,
 * "Experts"). */
RP_API double rp_cost_expert_s(const rp_cost *cost, double tokens);
/* Time to move one expert (weights and optimizer state) over NVLink (same node) or
 * the network, into one EP rank: over its ETP GPUs' links, and its commit (the staged
 * copy read and the slot written in HBM), as the migration plan prices a lone copy
 * (docs/cost-model.md, "Migration"). */
RP_API double rp_cost_expert_move_s(const rp_cost *cost, bool same_node);

/* Evaluate a plan fully (packing and placement are both required; the plan should be
 * valid: run rp_plan_validate first; evaluate itself rejects, with RP_EINVAL, a plan of
 * the wrong shape, without packing or placement, with a sequence missing or packed
 * twice, an expert without a replica, or shares that do not sum to 1; it does not
 * check caps). Keeps the breakdown for the accessors below and binds the evaluator
 * to the plan for incremental moves: the plan must then change only through
 * rp_cost_apply_* until the next evaluation. On error the previous binding stays.
 * A plan equal (rp_plan_equal) to the one the evaluator is bound to, as evaluated and
 * not since changed by rp_cost_apply_* or rp_cost_order_microbatches, is not evaluated
 * again: the bound summary is returned and the evaluator bound to this plan. (The
 * evaluator also remembers the summaries of its last few evaluations, for the
 * scheduler's judgement of the plan its policy returned.)
 * `out` may be NULL. */
RP_API rp_status rp_cost_evaluate(rp_cost *cost, const rp_plan *plan, rp_cost_summary *out,
                                  rp_error *err);

/* Breakdown of the bound state (seconds, forward, one layer):
 * attention[gpu * M + mb], expert[(mb * L + layer) * G + gpu],
 * dispatch[(mb * L + layer) * G + gpu], combine likewise (in this model combine moves
 * the dispatch volume back, so it equals dispatch). Borrowed until the next evaluate,
 * apply_* or free; NULL before the first successful evaluation. */
RP_API const double *rp_cost_attention_breakdown(const rp_cost *cost);
RP_API const double *rp_cost_expert_breakdown(const rp_cost *cost);
RP_API const double *rp_cost_dispatch_breakdown(const rp_cost *cost);
RP_API const double *rp_cost_combine_breakdown(const rp_cost *cost);
/* The breakdown and summary as JSON (rp_text_free). */
RP_API rp_status rp_cost_breakdown_json(const rp_cost *cost, char **text, size_t *len,
                                        rp_error *err);

/* Incremental evaluation against the bound plan: the step time the plan would have
 * after the change, without changing anything. Exact: equal to a full evaluation of
 * the changed plan (they run the same arithmetic on the same integer counts).
 * Returns INFINITY when the change is invalid: no bound plan, ids out of range, or a
 * microbatch that grows beyond the config's token cap or activation memory cap.
 * Moving a sequence to where it is, or swapping two of the same microbatch, returns
 * the current step time. */
RP_API double rp_cost_try_move(rp_cost *cost, int32_t seq, int32_t rank, int32_t mb);
RP_API double rp_cost_try_swap(rp_cost *cost, int32_t seq_a, int32_t seq_b);
/* Replace the expert in one physical slot of a layer; `expert` -1 empties the slot.
 * Invalid (INFINITY) also when the old expert would lose its last replica, or when
 * the old or new expert has explicit shares at that layer in some microbatch (shares
 * are tied to a replica set). */
RP_API double rp_cost_try_slot(rp_cost *cost, int32_t layer, int32_t slot, int32_t expert);
/* Apply a change to the bound state and to `plan` (the plan the evaluator is bound to;
 * RP_EINVAL for another). Errors as for try_*, with a message; on error nothing
 * changes. A moved sequence goes to the end of its new microbatch's list (as
 * rp_plan_move_sequence does); a swap moves each to the end of the other's list. */
RP_API rp_status rp_cost_apply_move(rp_cost *cost, rp_plan *plan, int32_t seq, int32_t rank,
                                    int32_t mb, rp_error *err);
RP_API rp_status rp_cost_apply_swap(rp_cost *cost, rp_plan *plan, int32_t seq_a, int32_t seq_b,
                                    rp_error *err);
RP_API rp_status rp_cost_apply_slot(rp_cost *cost, rp_plan *plan, int32_t layer, int32_t slot,
                                    int32_t expert, rp_error *err);
/* Step time of the bound state (NAN before the first successful evaluation). */
RP_API double rp_cost_current_s(const rp_cost *cost);
/* Summary of the bound state, as rp_cost_evaluate gives it, also after apply_*.
 * Errors: no plan evaluated yet. */
RP_API rp_status rp_cost_current_summary(const rp_cost *cost, rp_cost_summary *out, rp_error *err);
/* The pipeline figures of the last evaluated or applied plan. Errors: no evaluator or
 * output, nothing evaluated yet (RP_EINVAL). */
RP_API rp_status rp_cost_pipeline_summary(const rp_cost *cost, rp_pipeline_summary *out, rp_error *err);
/* Forward time T(mb, layer) of the bound state (NAN when out of range or unbound). */
RP_API double rp_cost_layer_s(const rp_cost *cost, int32_t mb, int32_t layer);
/* The side that decides layer (mb, layer) (the largest of its attention, dispatch and
 * expert terms, each the maximum over the GPUs of the critical domain: under
 * execution.sync "group" the EP group whose sum sets the step, as the summary's
 * straggler, else every GPU; combine equals dispatch) and the GPU that sets it (*gpu -1
 * when out of range or unbound). */
RP_API rp_side rp_cost_layer_straggler(const rp_cost *cost, int32_t mb, int32_t layer,
                                       int32_t *gpu);
/* Bytes the evaluator holds (its state for the bound plan included). */
RP_API size_t rp_cost_bytes(const rp_cost *cost);
/* Elementary operations (loop iterations over experts, GPUs, slots, cells) the evaluator
 * has performed since rp_cost_new: full evaluations, trials, applies and summaries, each
 * counted where its loops run. The difference across a call is its measured work, which
 * callers that account for work (the policy sandbox) charge. */
RP_API int64_t rp_cost_operations(const rp_cost *cost);
/* What rp_cost_evaluate(cost, plan) would take, from the plan's shape alone (nothing is
 * allocated; the work is O(extra replicas)): *bytes, the memory the evaluation
 * allocates (the evaluator holds it afterwards, and the previous plan's meanwhile),
 * exactly; *units, its work in elementary steps (sequence histograms over the layers,
 * the microbatch x layer x GPU x expert counts, the slots of every microbatch and
 * layer, each microbatch, layer and EP group's dispatch pairs), the units rp.evaluate
 * charges. Either pointer may be NULL. Errors: the shape
 * checks of rp_cost_evaluate (RP_EINVAL), RP_ERANGE when no evaluation could hold it.
 * Lets a caller refuse a plan before paying for it (docs/policies.md, Limits). */
RP_API rp_status rp_cost_evaluation_needs(const rp_cost *cost, const rp_plan *plan, int64_t *units,
                                          size_t *bytes, rp_error *err);

/* Under pipeline parallelism, choose the microbatch order of every sync domain (EP group;
 * the job under sync "global") that shortens the pipeline's critical path for the bound
 * plan's packing and placement, and set it on `plan` (the bound plan; RP_EINVAL for
 * another or before an evaluation). Exhaustive over every order when a rank runs at most
 * 6 microbatches; else the better of index order and verl's (rearrange_micro_batches:
 * the lightest at both ends, the heaviest in the middle), improved by pairwise swaps up
 * to 32 microbatches. The plan keeps its order unless the chosen one's step is shorter;
 * the bound state's step becomes the plan's (*step_s, may be NULL). With one stage (or over
 * 4096 microbatches) nothing changes. Errors: no memory (the plan's order unchanged). */
RP_API rp_status rp_cost_order_microbatches(rp_cost *cost, rp_plan *plan, double *step_s, rp_error *err);

/* Predicted time of moving from placement `from` to placement `to` (minimum moves:
 * experts already resident on a plan's rank stay; the rest come from the nearest rank
 * holding them in `from`, NVLink inside a node, else the network, in every EP group;
 * the busiest receiving EP rank, over its ETP GPUs' links, sets the time:
 * docs/cost-model.md, "Migration"), with the bytes moved (weights and optimizer state,
 * all groups). Only placements are read. Migration overlaps nothing in this first
 * model, and rp_cost_evaluate's step time does not include it. */
RP_API rp_status rp_cost_migration(const rp_cost *cost, const rp_plan *from, const rp_plan *to,
                                   double *seconds, double *bytes, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
