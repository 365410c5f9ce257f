/* The scheduler: every step it computes the routing statistics, runs the policy (one
 * joint Lua policy, or a packing policy plus a placement policy, "token_kk+eplb") in
 * the sandbox, validates the plan it returns, keeps the last good plan, and applies a
 * staged policy at a step boundary. Policy authoring: docs/policies.md.
 *
 * Thread-safety: a scheduler is used from one thread at a time (the trainer may plan
 * step t+1 on its own thread while step t runs); separate schedulers share nothing and
 * run on separate threads at once. The library has no global state. */
#ifndef ROUTEPACK_SCHED_H
#define ROUTEPACK_SCHED_H

#include "routepack/cost.h"
#include "routepack/plan.h"
#include "routepack/shift.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The policy API version this build serves (policies declare `api = 1`). */
#define RP_POLICY_API 1

/* Collective operations between the ranks of a multi-rank job, supplied by the caller
 * (rp_comm_mpi() wraps an MPI communicator; the Python binding builds one from two
 * callables). Each returns RP_OK or an error status; a failed collective makes the step
 * fail with RP_ETRANSPORT on that rank (the others see it fail or time out in their own
 * transport: an rp_comm must not return on one rank and hang on another). What the
 * scheduler exchanges each step: docs/distributed.md. */
typedef struct rp_comm {
    int32_t rank, size;
    void *ud;
    /* Every rank contributes `bytes` at `in`; `out` receives size * bytes, rank-major. */
    rp_status (*allgather)(void *ud, const void *in, size_t bytes, void *out);
    /* `bytes` at `buf` on rank `root` are copied to `buf` on every rank. */
    rp_status (*bcast)(void *ud, void *buf, size_t bytes, int32_t root);
} rp_comm;

typedef struct rp_sched_options {
    const char *policy;        /* name, path or "PACKING+PLACEMENT"; NULL: the config's */
    rp_split_rule split;       /* the cost model's replica split rule */
    int32_t num_threads;       /* statistics threads; 0: all CPUs */
    int32_t history;           /* past steps whose expert loads the policy sees (default 8) */
    int64_t max_instructions;  /* sandbox limits; 0: the defaults (docs/policies.md; the
                                  instruction budget then grows with the batch) */
    double max_wall_s;
    size_t max_memory_bytes;
    int32_t max_depth;
    const rp_comm *comm;       /* NULL: a single rank */
    /* Added after the first version (append only). */
    /* The policy's params as a JSON object. NULL: the config's policy.params when the
     * scheduler runs the config's policy (`policy` NULL or equal to the config's
     * policy.name), else every param at its default. For PACKING+PLACEMENT the object
     * has one optional member per component, named by the component's policy name:
     * {"eplb": {"mode": "global"}}. */
    const char *params_json;
    uint64_t seed;             /* mixed with the step into math.random's seed and ctx.seed */
    /* The placement in use before the first step: "contiguous" or a plan file (JSON,
     * its placement taken, its packing ignored); NULL: the config's
     * policy.initial_placement (default "contiguous"). The policy (ctx.placement), the
     * fallback and the migration of the first step all start from it; a checkpoint's
     * plan in use (rp_sched_load_state) replaces it. */
    const char *initial_placement;
    /* A policy whose steps fall back this many times in a row (on every rank) is
     * demoted after the last of them: the policy the last hot swap replaced runs again,
     * else RP_SCHED_DEMOTE_TO, the safe default's packing keeping the placement (its
     * steps then pay no more failures up to the wall-time limit). 0: the default
     * (RP_SCHED_DEMOTE_AFTER); negative: never. Not kept in checkpoints: a restored
     * scheduler counts from 0. */
    int32_t demote_after;
} rp_sched_options;

#define RP_SCHED_DEMOTE_AFTER 3
#define RP_SCHED_DEMOTE_TO "attn_kk"

/* Fill `opts` with the defaults. */
RP_API void rp_sched_options_default(rp_sched_options *opts);

typedef struct rp_sched rp_sched;

/* Create a scheduler (config borrowed: it must outlive the scheduler). Loads and checks
 * the policy (metadata, params against the config's policy.params) in a fresh sandbox
 * and runs its init. */
RP_API rp_status rp_sched_new(rp_context *ctx, const rp_config *cfg, const rp_sched_options *opts,
                              rp_sched **out, rp_error *err);
RP_API void rp_sched_free(rp_sched *sched);
/* The message of the last failed call on this scheduler ("" if none); valid until the
 * next call on it. */
RP_API const char *rp_sched_errmsg(const rp_sched *sched);

/* What happened in one step. Borrowed from the scheduler until its next step. */
typedef struct rp_step_report {
    int64_t step;
    rp_cost_summary cost;          /* of the plan in use */
    double plan_wall_s;            /* statistics + policy + validation, informational */
    int64_t policy_work;           /* work units (instructions) the policy used */
    bool fallback;                 /* the policy failed: the last good plan is in use */
    char fallback_reason[RP_ERROR_TEXT];
    bool swapped;                  /* a staged policy took effect at this step */
    char swap_error[RP_ERROR_TEXT];/* a staged policy was refused ("" if none) */
    char policy_name[64];
    char policy_version[32];
    uint64_t policy_hash;          /* XXH64 of the running policy's source text */
    uint64_t plan_hash;
    int32_t plan_from_rank;        /* multi-rank: whose plan every rank uses (the lowest rank
                                      whose policy did not fall back; 0 if all did, and 0 for
                                      a single rank) */
    bool ranks_disagreed;          /* multi-rank: plan hashes or fallback flags differed this
                                      step, so rank plan_from_rank's plan was broadcast */
    int32_t experts_moved;         /* placement change against the previous step */
    double migration_bytes;
    double migration_s;
    /* Added after the first version (append only). */
    double policy_wall_s;          /* the policy calls alone (plan(ctx) and converting what
                                      it returned), informational */
    int32_t ranks_fell_back;       /* ranks whose own policy failed this step (the same on
                                      every rank; 0 or 1 for a single rank). With several
                                      ranks, `fallback` is this rank's own policy failing;
                                      the plan in use is rank plan_from_rank's */
    double policy_cpu_s;           /* the same calls in CPU time of the calling thread (the
                                      policy runs there): what they cost when other work
                                      shares the cores, informational */
    /* The policy's account of its migration decision (rp.decision; the shipped
     * routepack policy gives it, docs/routepack-policy.md "Persistence from history").
     * has_decision false: the policy gave none (the fields below are 0). */
    bool has_decision;
    double persistence;            /* the fraction of a move's saving expected to hold on
                                      later steps that the decision used, [0, 1] */
    int32_t persistence_observations; /* scored steps behind it; 0: the prior */
    double predicted_saving_s;     /* this step's placement change: what it saves on this
                                      step's batch (0: no change) */
    bool realised_scored;          /* an earlier change was scored on this batch */
    double realised_saving_s;      /* its saving on this batch (the placement after it
                                      against the one before, this step's packing) */
    /* rp.joint's fallback check (docs/routepack-policy.md): the policy's calls that ran
     * it this step, and of them those where a baseline scored better than the joint
     * plan and was returned instead (0 and 0 for a policy that does not call rp.joint,
     * or when the step fell back) */
    int32_t fallback_checks;
    int32_t fallback_check_changes;
    bool has_shift;                /* router shift attached (rp_sched_attach_shift) */
    rp_shift_summary shift;        /* its summary; zero until attached */
    /* Demotion (rp_sched_options.demote_after): the steps in a row, this one included,
     * that fell back; `demoted`: after this step the running policy was replaced by
     * `demoted_to` (failed_steps then counts from 0 again); `demote_error`: demoting was
     * due but the replacement could not be loaded ("" if none) */
    int32_t failed_steps;
    bool demoted;
    char demoted_to[64];
    char demote_error[RP_ERROR_TEXT];
    /* The whole step (docs/cost-model.md, "The whole step"): one forward pass of the
     * plan's microbatches through the MoE layers (what each of trainer.logprob_forwards
     * costs), and what the step does outside the MoE layers. The end-to-end step is
     * cost.step_s + logprob_forwards x forward_s + outside.total_s (+ migration). */
    double forward_s;
    rp_step_outside outside;
} rp_step_report;

/* Plan step `step` for `batch` and its routing replay (host memory, or device memory:
 * the statistics then come from the histogram kernel, as rp_stats_compute says). On success *plan
 * and *report point at the plan to run and its report, valid until the next step or
 * rp_sched_free. Whatever the policy omits stays as it was: the packing of the safe
 * default (below) and the placement in use. A failing policy (error, limit, invalid
 * plan) is not an error of this call: the step falls back (report->fallback, with the
 * reason) to the safe default: the packing of rp_baseline_plan's "attn_kk" for this
 * batch (a packing cannot be carried over: it names the previous batch's sequences) and
 * the last good placement (contiguous on the first step). Errors (bad batch or routing,
 * a batch no packing can hold, out of memory, a failed collective) leave the scheduler
 * as it was, except for what the policy wrote into its own ctx.state; a batch no
 * packing can hold or the cost model cannot take (more than 2^31-1 token-choices per
 * layer: RP_ERANGE) is refused before its routing is read. With opts->comm
 * every rank must call this for the same steps, and every decision is collective
 * (docs/distributed.md): each step runs two allgathers of 16 bytes per rank; when the
 * ranks' plans or fallback flags differ, the lowest rank whose own policy succeeded
 * (rank 0 if none did) broadcasts its plan (two or more broadcasts: the length, then the
 * JSON text in pieces of 256 KiB) and a third allgather confirms every rank took it. A
 * policy that fails or hits a limit on some ranks only is not an error: every rank runs
 * the agreed plan (report->plan_from_rank, ranks_disagreed, ranks_fell_back). An error on
 * any rank (bad input, no memory, a plan that cannot be sent or parsed) is an error on
 * every rank: that rank returns its own, the others the same status with "rank R failed",
 * and no rank changes anything. A failed collective is RP_ETRANSPORT on the rank that saw
 * it; the others depend on their transport noticing (a timeout), so stop the job. */
RP_API rp_status rp_sched_step(rp_sched *sched, int64_t step, const rp_batch *batch,
                               const rp_routing *routing, const rp_plan **plan,
                               const rp_step_report **report, rp_error *err);

/* rp_sched_step from precomputed statistics, with no routing on the host: the
 * distributed step (docs/distributed.md). `batch` carries the whole step's lengths and
 * group ids (in global sequence order); `stats` are the whole step's statistics in the
 * same order, as rp_stats_merge or rp_stats_merge_serialized make them from the ranks'
 * parts (borrowed: the scheduler keeps its own copy). Everything else is rp_sched_step's:
 * the same policy, validation, fallback, hot swap, history, multi-rank agreement and
 * report, and the same plan as rp_sched_step gives for the routing the statistics were
 * computed from. Errors (nothing changes): those of rp_sched_step, and statistics that do
 * not describe the batch or the model (rp_stats_check_batch: sequences, tokens, each
 * sequence's length; layers, experts, top_k against the config) (RP_EINVAL). */
RP_API rp_status rp_sched_step_stats(rp_sched *sched, int64_t step, const rp_batch *batch,
                                     const rp_stats *stats, const rp_plan **plan,
                                     const rp_step_report **report, rp_error *err);
/* rp_sched_step_stats without its copy of the statistics (48 MB, ~5 ms a step at the
 * reference scale): the scheduler takes *stats as the step's own, and returns in *stats
 * statistics it no longer needs (an earlier step's; NULL at first), whose storage the
 * caller's next merge takes (rp_stats_merge_serialized_reusing), so a trainer's ranks
 * merge and plan step after step without copying the statistics or faulting in fresh
 * pages. The same checks, plan and report as rp_sched_step_stats. When a check of the
 * arguments or of the statistics against the batch and model fails, *stats stays the
 * caller's; once they pass, *stats is taken whatever the step's result (a failed step
 * frees it). */
RP_API rp_status rp_sched_step_stats_take(rp_sched *sched, int64_t step, const rp_batch *batch,
                                          rp_stats **stats, const rp_plan **plan,
                                          const rp_step_report **report, rp_error *err);

/* Stage a new policy for hot swap: `source` is its text (`name_or_path` then names it in
 * messages and may be NULL), else `name_or_path` is a policy name on the search path, a
 * file, or "PACKING+PLACEMENT". It is compiled at once in a fresh sandbox, its metadata
 * and params checked and its init run: those errors are returned here (and kept for
 * rp_sched_errmsg). At the first step >= at_step (-1: the next step) it is dry-run on
 * the previous step's inputs (this step's if there was none), its plan validated, and
 * only then swapped in, for that step, with a fresh ctx.state and init run again; on
 * failure the running policy stays, the staged one is dropped and report->swap_error
 * says why. A policy staged under the running one's name keeps its params. Staging again
 * replaces what was staged. Multi-rank: the swap happens at the first step where it is
 * due on every rank and every rank's dry run passed with the same code; else no rank
 * swaps. */
RP_API rp_status rp_sched_stage_policy(rp_sched *sched, const char *name_or_path,
                                       const char *source, int64_t at_step, rp_error *err);

/* The plan in use (the last good one), or NULL before the first step. */
RP_API const rp_plan *rp_sched_plan(const rp_sched *sched);

/* ---- expert migration (routepack/migrate.h; contract: docs/migration.md, "With the
 * scheduler") ----
 * Each step plans the move of expert weights from the placement in effect before it
 * (the contiguous one, rp_plan_set_contiguous, before the first step) to its plan's; the
 * report's experts_moved, migration_bytes and migration_s are that migration plan's. The
 * trainer runs rp_migration_execute with it once on every rank, before the step uses the
 * new placement. The next rp_sched_step takes it as executed, unless
 * rp_sched_migration_failed said otherwise. */
struct rp_migration_plan;
struct rp_migration_options;
struct rp_migration_result;

/* The migration plan of the last step, or NULL when its placement did not change (no
 * slot to write), before the first step, after a later rp_sched_step call (even one that
 * failed) or after rp_sched_migration_failed. Borrowed until the next step or
 * rp_sched_free. */
RP_API const struct rp_migration_plan *rp_sched_migration(const rp_sched *sched);

/* Report that executing the last step's migration failed, with the rp_migration_result
 * it filled (the same on every rank; call on every rank). The layers of rounds that did
 * not commit (rp_migration_plan_layer_round(mp, l) >= result->rounds_committed) go back
 * to their placement before the step in the plan in use (rp_sched_plan: the pointer the
 * step returned, changed in place; its extra replicas and shares are dropped), so the
 * plan matches the weights and the next step plans from it. The step report is not
 * revised. Errors (nothing changes): no open migration (none, a step ran since, already
 * reported), no result or rounds_committed out of range (RP_EINVAL). */
RP_API rp_status rp_sched_migration_failed(rp_sched *sched, const struct rp_migration_result *result,
                                           rp_error *err);

/* Expert bytes per layer and staging budget of the migration plans of later steps;
 * opts->expert_bytes must be what the registry holds (rp_registry_expert_bytes) or the
 * executor refuses the plan; NULL opts or expert_bytes: the model's (docs/migration.md).
 * NULL opts, and before any call: the config's execution.staging_budget_bytes (what the
 * memory check counts). The array is copied. Errors (nothing changes): bytes <= 0, a negative budget
 * (RP_EINVAL). A budget below one layer's need makes the step fail (RP_ERANGE). */
RP_API rp_status rp_sched_set_migration_options(rp_sched *sched,
                                                const struct rp_migration_options *opts, rp_error *err);

/* Attach router-shift diagnostics to the last step's report: the training forward's
 * own top-k ids only exist once the step's plan has run, so the trainer computes
 * rp_shift_compute(step batch, replayed routing, forward's ids) afterwards and hands it
 * here. The report (rp_step_report.has_shift, .shift), rp_sched_report_json
 * ("router_shift") and the flat metrics (router_shift_*) then carry its summary, until
 * the next step (which starts without). Attaching again replaces it. The shift is only
 * read (not kept). Errors (nothing changes): no step yet, a shift of another batch or
 * model (sequences, choices, layers, experts or top-k differ from the last step's batch
 * and the config: RP_EINVAL naming both values). Multi-rank: compute the shift of the
 * whole step (every rank's sequences), or attach each rank's own; the scheduler does not
 * exchange it. */
RP_API rp_status rp_sched_attach_shift(rp_sched *sched, const rp_shift *shift, rp_error *err);

/* The report of the last step as JSON (rp_text_free). */
RP_API rp_status rp_sched_report_json(const rp_sched *sched, char **text, size_t *len,
                                      rp_error *err);

/* ---- checkpoint and resume (format: docs/formats.md, "Scheduler state") ----
 * Save what decides the scheduler's future plans: the plan in use, the running policy
 * (its source text, hash, params and ctx.state), a staged policy and its step, the
 * expert-load history, the last step's inputs (a dry run replays them), the seed and
 * the last step. A scheduler that loads it plans every later step exactly as this one
 * would (same plans, same reports). Not saved: the last step's migration plan and the
 * migration options (the trainer sets those again), sandbox limits, thread count.
 * *json is compact JSON text with a trailing newline, allocated through the
 * scheduler's context (rp_text_free); the same state always gives the same bytes.
 * Errors (nothing changes): a ctx.state value that JSON cannot hold (a function,
 * userdata, a thread, a table reached twice or a cycle, a table with a metatable, a key
 * that is not a number, string or boolean), named by its path ("policy 'p':
 * ctx.state.cache[2] is a function") (RP_EINVAL); no memory. */
RP_API rp_status rp_sched_save_state(const rp_sched *sched, char **json, size_t *len,
                                     rp_error *err);
/* Replace the scheduler's state with one rp_sched_save_state wrote, from a scheduler
 * whose config has the same shape (layers, experts, top_k, GPUs, EP size, slots) and
 * the same history length and split rule; the seed is the state's. Everything is
 * parsed, checked and rebuilt (policies loaded from their saved source, hashes
 * checked) before anything changes: on error the scheduler is as it was. Afterwards
 * the last step's migration plan is closed and rp_sched_report_json has no report
 * until the next step. Errors: not JSON, truncated, another format (RP_EFORMAT); a
 * later version (RP_ENOTSUP); a shape, history or split mismatch, a field out of range
 * (RP_EINVAL, naming the field and both values); a policy that no longer loads or
 * whose text does not match its hash (RP_EPOLICY or the loader's error). */
RP_API rp_status rp_sched_load_state(rp_sched *sched, const char *json, size_t len,
                                     rp_error *err);

/* ---- finding policies ---- */

typedef struct rp_policy_info {
    char name[64];
    char version[32];
    int32_t api;
    char description[256];
    char path[1024];
    uint64_t hash;
    /* Added after the first version (append only). */
    bool shadowed;             /* an earlier directory has a policy of the same name */
} rp_policy_info;

/* Every policy found on the search path (the config's policy.search_path, then
 * RP_POLICY_PATH (colon-separated), then the shipped policies directory), each loaded
 * in a sandbox to read its metadata. In each directory files are taken in name order;
 * a name found again in a later directory is listed with `shadowed` set (loading by
 * name takes the first). A policy for another API version is listed (its `api` says
 * which); files that fail to load are reported through the context's log (RP_LOG_WARN)
 * and skipped. *infos is allocated through ctx (rp_text_free((char *)*infos)); NULL
 * when none is found. */
RP_API rp_status rp_policy_list(rp_context *ctx, const rp_config *cfg, rp_policy_info **infos,
                                int32_t *count, rp_error *err);

/* Load a policy (a name on the search path, or a path) in a sandbox, check its metadata
 * and params (at their defaults) exactly as rp_sched_new does, and describe it as JSON
 * (rp_text_free): {"name", "version", "api", "description", "path", "hash" (16 hex
 * digits), "has_init", "params": [{"name", "type", "default", "value", "min", "max",
 * "values", "doc"}]} ("min", "max", "values" only where declared). Errors: those of
 * loading (RP_EIO not found, RP_EPOLICY bad metadata naming the field, RP_ENOTSUP
 * another API version). */
RP_API rp_status rp_policy_describe(rp_context *ctx, const rp_config *cfg, const char *name_or_path,
                                    char **json, size_t *len, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
