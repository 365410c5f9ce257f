/* The scheduler's private interface (core/sched*.c): the policy sets it runs, its fields
 * for the checkpoint, the initial placement and the step's metrics. The policy loader's
 * contract is core/policy.h. */
#ifndef RP_SCHED_INTERNAL_H
#define RP_SCHED_INTERNAL_H

#include "policy.h"
#include "routepack/sched.h"

/* ---- the scheduler's fields, for its checkpoint (core/sched_state.c) ---- */

struct rp_stats;
struct sched_migration;

/* The policies a scheduler runs (or has staged): one joint policy, or packing then
 * placement. */
typedef struct policy_set {
    rp_policy *pol[2];
    int32_t count;
    char name[64];
    char version[32];
    uint64_t hash;
} policy_set;

void sched_set_free(policy_set *ps);
/* Fill name, version and hash from the loaded policies. */
void sched_set_describe(policy_set *ps);

/* Pointers into a scheduler: what decides its future plans. Valid while it lives. */
typedef struct sched_fields {
    rp_context *ctx;
    const rp_config *cfg;
    rp_sched_options *opts;          /* seed, split, history */
    const rp_sandbox_limits *limits;
    policy_set *running, *staged;
    int64_t *staged_at;
    rp_plan **current;               /* the plan in use */
    bool *has_step;
    int64_t *last_step;
    int32_t *failed_steps;           /* the demotion's count of failed steps in a row */
    rp_batch **prev_batch;           /* the last step's inputs (dry runs replay them) */
    struct rp_stats **prev_stats;
    int32_t hist_cap;
    int32_t *hist_count, *hist_head; /* ring of expert loads; head = next slot to write */
    int64_t *hist_steps;             /* [hist_cap] */
    int64_t *hist_loads;             /* [hist_cap][num_layers * num_experts] */
    bool *has_report;
    struct sched_migration *migration;
    char *errmsg;                    /* RP_ERROR_TEXT bytes */
} sched_fields;

void sched_fields_of(rp_sched *sched, sched_fields *f);

/* The placement in use before the first step (core/sched_initial.c): `source` is
 * "contiguous" or a plan file whose placement is taken; NULL or "": the config's
 * policy.initial_placement. *out is a one-microbatch plan with a placement only (owned
 * by the caller). Errors: an unreadable file, one without a placement or with an invalid
 * one for the config (named), no memory. */
rp_status sched_initial_placement(rp_context *ctx, const rp_config *cfg, const char *source, rp_plan **out,
                                  rp_error *err);

/* The step's flat metrics as a new JSON object (core/sched_metrics.c); NULL when out of
 * memory. The report JSON's "metrics" and simulate --json's per-step "metrics". */
struct json_t *rp_step_metrics_json(const rp_step_report *r);

#endif
