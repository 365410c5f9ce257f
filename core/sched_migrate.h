/* The scheduler's side of expert migration (private to core/sched.c and
 * core/sched_migrate.c): the migration plan of the last step and the placement it moves
 * from, so that a failed execution puts the scheduler back on the placement the weights
 * hold. Contract: docs/migration.md, "With the scheduler". */
#ifndef RP_SCHED_MIGRATE_H
#define RP_SCHED_MIGRATE_H

#include "routepack/migrate.h"
#include "routepack/sched.h"

typedef struct sched_migration {
    int64_t *expert_bytes;         /* [num_layers]; NULL: the model's bytes per expert */
    int64_t staging_budget_bytes;  /* 0: one round */
    bool options_set;              /* false: the config's execution.staging_budget_bytes */
    rp_migration_plan *plan;       /* the last step's; NULL when its placement did not change */
    int32_t *from_phy2log;         /* [num_layers][total_slots]: the placement before that step */
    bool open;                     /* the plan may still be executed or reported failed: no
                                      step ran since and no failure was reported */
} sched_migration;

/* A step's migration before the step commits (owned until committed or discarded). */
typedef struct sched_migration_next {
    rp_migration_plan *plan;
    int32_t *from_phy2log;
} sched_migration_next;

/* Plan the move from `placement` (the one in use; NULL before the first step: the
 * contiguous placement trainers start from) to `plan`'s, and fill the report's
 * experts_moved, migration_bytes and migration_s from it (0 when nothing moves).
 * next->plan stays NULL when no slot is written. Errors: those of
 * rp_migration_plan_new (a staging budget below one layer's need is RP_ERANGE). */
rp_status sched_migration_prepare(const sched_migration *m, rp_context *ctx, const rp_config *cfg,
                                  const rp_plan *placement, const rp_plan *plan, sched_migration_next *next,
                                  rp_step_report *rep, rp_error *err);
/* The step commits: `next` becomes the last step's migration (ownership moves). */
void sched_migration_commit(sched_migration *m, rp_context *ctx, sched_migration_next *next);
void sched_migration_discard(rp_context *ctx, sched_migration_next *next);
void sched_migration_free(sched_migration *m, rp_context *ctx);

/* rp_sched_set_migration_options: check and copy (nothing changes on error). */
rp_status sched_migration_set_options(sched_migration *m, rp_context *ctx, const rp_config *cfg,
                                      const rp_migration_options *opts, rp_error *err);
/* rp_sched_migration_failed: every layer of a round at or after result->rounds_committed
 * goes back to its placement before the step in `current` (the plan in use), and the
 * plan's levers are dropped when any layer went back; the migration closes. Errors
 * (nothing changes): no open migration, a result that does not fit the plan. */
rp_status sched_migration_rollback(sched_migration *m, rp_plan *current, const rp_migration_result *result,
                                   rp_error *err);

#endif
