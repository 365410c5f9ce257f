/* The migration planner's rule as a function of placement rows (docs/migration.md): the
 * copies, their sources, rounds and predicted time from one placement to another. The
 * migration plan (migrate_plan.c) wraps its result into rp_migration_plan; the cost
 * model's estimate (cost_migrate.c) and the joint planner's per-layer migration
 * (joint_place.c) read its predicted time, so every part plans with the time the
 * executor is charged. It sits with migrate_links.c, below the cost model. */
#ifndef RP_MIGRATE_BUILD_H
#define RP_MIGRATE_BUILD_H

#include "routepack/config.h"
#include "routepack/migrate.h"

typedef struct migrate_build {
    int32_t num_gpus;                /* DP ranks of the whole pipeline */
    int32_t num_rounds;
    int32_t *layer_round;            /* [num_layers], -1: nothing moves */
    int32_t *layer_stage;            /* [num_layers] the pipeline stage holding each layer */
    int64_t *expert_bytes;           /* [num_layers] */
    rp_migration_transfer *transfers;
    int64_t num_transfers;
    rp_migration_write *writes;
    int64_t num_writes;
    rp_migration_gpu *gpus;          /* [num_gpus] */
    rp_migration_summary summary;
} migrate_build;

/* Plan the move of rp_migration_plan_new (routepack/migrate.h) on the machine of `cfg`.
 * `slot_begin` [ep_size + 1] is both placements' (the caller checked they agree);
 * `current[l]` and `target[l]` are one EP group's phy2log of layer l (slot_begin[ep_size]
 * slots each, expert ids checked by the caller), or both NULL where layer l does not move
 * (then neither is read). `opts` NULL: the model's expert bytes, no staging budget.
 * Fills *out, which the caller frees with migrate_build_free (also after an error).
 * RP_EINVAL: a negative budget or a non-positive expert size; RP_ERANGE: a layer's
 * staging above the budget, or byte counts that overflow; RP_EPLAN: a target expert in
 * no slot of the current placement; RP_ENOMEM. */
rp_status migrate_build_new(rp_context *ctx, const rp_config *cfg, const int32_t *slot_begin,
                            const int32_t *const *current, const int32_t *const *target,
                            const rp_migration_options *opts, migrate_build *out, rp_error *err);

/* Frees what migrate_build_new allocated into `b` and zeroes it; NULL is a no-op. */
void migrate_build_free(rp_context *ctx, migrate_build *b);

#endif
