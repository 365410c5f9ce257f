/* The scheduler's own private header (core/sched*.c only): the scheduler's fields, one
 * step's inputs and what running a policy set gives, and the calls between its files,
 * bottom to top: sched_set.c (policy sets, shared helpers) < sched_run.c (running the
 * policies, one step's inputs, judging a plan) < sched_agree.c (multi-rank agreement) <
 * sched_swap.c (hot swap, staging, demotion) < sched.c (creation and the step);
 * sched_metrics.c (the step report as JSON) reads the fields. */
#ifndef RP_SCHED_IMPL_H
#define RP_SCHED_IMPL_H

#include "sched_internal.h"
#include "sched_migrate.h"

#include "routepack/sched.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>


/* The safe default (docs/policies.md): verl's two-level Karmarkar-Karp keyed by each
 * sequence's attention time, token cap enforced; placement contiguous. */
#define SAFE_DEFAULT "attn_kk+contiguous"
#define MAX_HISTORY 1024
/* Multi-rank: a rank's record in each allgather: bytes 0-3 flags, 4-7 the rank's
 * status (little-endian), 8-15 a hash. */
#define RECORD 16
/* The agreed plan is broadcast in pieces of this size into a buffer held by the
 * scheduler, so a rank that cannot allocate the whole text still takes part. */
#define PLAN_CHUNK ((size_t)256 * 1024)


/* policy_set: sched_internal.h (the checkpoint, core/sched_state.c, reads it too) */

struct rp_sched {
    rp_context *ctx;
    const rp_config *cfg;
    rp_sched_options opts;
    char *spec;              /* the policy as given */
    char *base_dir;          /* for a config-relative policy path; NULL: the working dir */
    char *params_json;       /* NULL: defaults */
    rp_comm comm;
    bool has_comm;
    unsigned char *gather_buf; /* [comm.size][RECORD]: the step's allgathers */
    unsigned char *chunk_buf;  /* [PLAN_CHUNK]: the agreed plan's broadcast */
    rp_sandbox_limits limits;

    policy_set running;
    policy_set staged;
    policy_set previous;     /* what the last hot swap replaced: a demotion's target */
    int32_t failed_steps;    /* steps in a row that fell back on every rank */
    int64_t staged_at;       /* -1: the next step */

    rp_plan *current;        /* the plan in use */
    rp_plan *initial;        /* the placement in use before the first step */
    bool has_step;
    int64_t last_step;
    rp_batch *prev_batch;    /* the last step's inputs, for dry runs */
    rp_stats *prev_stats;
    /* the statistics of the step before prev_stats, kept (only on the path from
     * statistics) so the next step's copy reuses their storage: stats_copy_reusing */
    rp_stats *spare_stats;
    bool keep_spare;

    int32_t hist_cap, hist_count, hist_head; /* ring; head = next slot to write */
    int64_t *hist_steps;
    int64_t *hist_loads;     /* [cap][L * E] */
    const int64_t **hist_ptrs;
    int64_t *hist_view_steps;

    rp_step_report report;
    bool has_report;
    char errmsg[RP_ERROR_TEXT];
    sched_migration migration; /* the last step's migration plan (core/sched_migrate.c) */
};

/* ---- core/sched_set.c: policy sets and shared helpers ---- */

double sched_now_s(void);
double sched_thread_cpu_s(void);
/* math.random's seed for a step: a function of the options' seed, the step and the
 * policy's position in a pair, never of time. */
uint64_t sched_step_seed(const rp_sched *s, int64_t step, int32_t which);
/* snprintf that may cut long messages (reasons nest other messages). */
void sched_textf(char *dst, size_t n, const char *fmt, ...) RP_PRINTF(3, 4);
/* Keep the message of a failed call in the handle (sqlite3_errmsg's contract). */
rp_status sched_fail_keep(rp_sched *s, rp_status st, const rp_error *err);
/* Run a loaded policy's init for position `which` of its set. */
rp_status sched_init_policy(rp_sched *s, rp_policy *pol, int32_t which, rp_error *err);
/* Load "NAME", "PATH" or "PACKING+PLACEMENT" into `ps` with its init run. `same_as`
 * (may be NULL): policies whose params carry over to a component of the same name. */
rp_status sched_load_set(rp_sched *s, const char *spec, const char *base_dir, const char *params_json,
                         const policy_set *same_as, policy_set *ps, rp_error *err);
/* A fresh copy of `from`: every policy loaded again from its own source text with its
 * params, in a new sandbox, and its init run. */
rp_status sched_set_reload(rp_sched *s, const policy_set *from, policy_set *out, rp_error *err);

/* ---- core/sched_run.c: one step's inputs, running the policies, judging a plan ---- */

/* ---- one step's inputs ------------------------------------------------------------------ */

typedef struct step_inputs {
    rp_sched *s;
    int64_t step;
    const rp_batch *batch;
    const rp_stats *stats;
    rp_cost *cost;
    const rp_plan *placement;  /* in use: the initial placement on the first step */
    rp_lua_history history;
    rp_plan *dflt;             /* the safe default for this batch, made on first use */
    rp_plan *base;             /* dflt's packing + the placement in use */
    rp_status base_status;
    rp_error base_err;
    bool base_tried;
} step_inputs;

/* ---- running the policies ------------------------------------------------------------- */

typedef struct run_result {
    rp_plan *plan;       /* merged, stable, valid; NULL on failure */
    rp_lua_decision decision; /* the last rp.decision of the set's policies */
    int32_t fallback_checks, fallback_changes; /* rp.joint's checks, over the set */
    int64_t work;
    double wall_s;       /* in the policy calls */
    double cpu_s;        /* the same, this thread's CPU time */
    rp_call_failure why;
    rp_status status;
    char reason[RP_ERROR_TEXT];
} run_result;

void sched_inputs_release(step_inputs *in);
/* What runs when the policy gives nothing: the safe default packing of this batch and
 * the placement in use (the initial placement on the first step). */
const rp_plan *sched_inputs_base(step_inputs *in, rp_error *err);
/* History views, most recent first; `skip` drops the newest entries (a dry run sees
 * the history as it was before the step it replays). */
void sched_fill_history(rp_sched *s, step_inputs *in, int32_t skip);
void sched_push_history(rp_sched *s, int64_t step, const rp_stats *stats);
/* Run the set's policies on `in` and return the merged, slot-stabilised, validated plan,
 * or the reason it failed. */
void sched_run_set(rp_sched *s, policy_set *ps, step_inputs *in, run_result *r);
/* The cost and the migration plan of `plan` (replacing what *migration held). */
rp_status sched_judge(rp_sched *s, step_inputs *in, const rp_plan *plan, rp_step_report *rep,
                      sched_migration_next *migration, rp_error *err);

/* ---- core/sched_agree.c: multi-rank agreement (docs/distributed.md) ---- */

bool sched_multi_rank(const rp_sched *s);
void sched_put_u64(unsigned char *p, uint64_t v);
uint64_t sched_get_u64(const unsigned char *p);
/* A rank's status into bytes 4-7 of its record. */
void sched_put_status(unsigned char *rec, rp_status st);
/* Allgather one record per rank; *all points into the scheduler's buffer. */
rp_status sched_gather(rp_sched *s, const unsigned char *mine, const unsigned char **all, rp_error *err);
/* After a gather: this rank's own error (its message is in err), else the status of the
 * lowest rank that failed, else RP_OK. */
rp_status sched_ranks_failure(rp_sched *s, const unsigned char *all, rp_status mine, int64_t step,
                              const char *phase, rp_error *err);
/* Every rank runs the same plan (the lowest rank whose own policy succeeded broadcasts
 * its plan when hashes or fallback flags differ). */
rp_status sched_agree(rp_sched *s, step_inputs *in, rp_status local, rp_plan **plan, rp_step_report *rep,
                      sched_migration_next *migration, rp_error *err);

/* ---- core/sched_swap.c: hot swap and demotion ---- */

typedef enum swap_decision { SWAP_NONE = 0, SWAP_DO, SWAP_REFUSE, SWAP_WAIT } swap_decision;

/* Whether a staged policy takes over at this step (after a dry run; with several ranks,
 * agreed). */
rp_status sched_decide_swap(rp_sched *s, step_inputs *in, rp_status local, swap_decision *decision, char *reason,
                            size_t reason_len, rp_error *err);
/* Count the step's outcome and demote the running set after demote_after steps in a row
 * that fell back on every rank. */
void sched_demote_if_failing(rp_sched *s, rp_step_report *rep);

#endif
