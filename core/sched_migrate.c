/* The scheduler's migration plan: each step plans the move from the placement in use to
 * the step's, and a failed execution puts the scheduler back on the placement the
 * weights hold (docs/migration.md, "With the scheduler"). */
#include "sched_migrate.h"

#include "internal.h"
#include "plan_internal.h"

#include <assert.h>
#include <string.h>

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    const int32_t S = rp_plan_total_slots(b);
    for (int32_t l = 0; l < rp_plan_num_layers(b); l++)
        if (memcmp(rp_plan_phy2log(a, l), rp_plan_phy2log(b, l), (size_t)S * sizeof(int32_t)) != 0) return false;
    return true;
}

rp_status sched_migration_prepare(const sched_migration *m, rp_context *ctx, const rp_config *cfg,
                                  const rp_plan *placement, const rp_plan *plan, sched_migration_next *next,
                                  rp_step_report *rep, rp_error *err)
{
    memset(next, 0, sizeof *next);
    rep->experts_moved = 0;
    rep->migration_bytes = 0;
    rep->migration_s = 0;
    rp_plan *contiguous = NULL;
    rp_migration_plan *mp = NULL;
    int32_t *rows = NULL;
    rp_status st = RP_OK;
    const rp_plan *from = placement;
    if (!from) {
        /* before the first step the weights are where trainers start them */
        RP_CHECK_GOTO(rp_plan_new(ctx, cfg, 1, &contiguous, err), st, out);
        RP_CHECK_GOTO(rp_plan_set_contiguous(contiguous, err), st, out);
        from = contiguous;
    }
    if (same_placement(from, plan)) goto out;
    /* until the trainer sets options, the budget the memory check counted */
    rp_migration_options o = {m->expert_bytes, m->options_set ? m->staging_budget_bytes
                                                              : rp_config_execution(cfg)->staging_budget_bytes};
    RP_CHECK_GOTO(rp_migration_plan_new(ctx, cfg, from, plan, &o, &mp, err), st, out);
    rp_migration_summary sum;
    rp_migration_plan_summary(mp, &sum);
    if (sum.writes == 0) goto out; /* only slots that become empty: nothing to move */
    const int32_t L = rp_plan_num_layers(from), S = rp_plan_total_slots(from);
    rows = rp_alloc(ctx, (size_t)L * (size_t)S * sizeof(int32_t) + 1);
    if (!rows) {
        st = rp_fail_nomem(err, "the placement before a migration");
        goto out;
    }
    for (int32_t l = 0; l < L; l++)
        memcpy(rows + (size_t)l * S, rp_plan_phy2log(from, l), (size_t)S * sizeof(int32_t));
    int32_t moved = plan_experts_moved(ctx, from, plan);
    if (moved < 0) {
        st = rp_fail_nomem(err, "counting moved experts");
        goto out;
    }
    /* the report gives the figures of the migration the trainer executes */
    rep->experts_moved = moved;
    rep->migration_bytes = (double)sum.moved_bytes;
    rep->migration_s = sum.predicted_s;
    next->plan = mp;
    next->from_phy2log = rows;
    mp = NULL;
    rows = NULL;
out:
    rp_migration_plan_free(mp);
    rp_free(ctx, rows);
    rp_plan_free(contiguous);
    return st;
}

void sched_migration_discard(rp_context *ctx, sched_migration_next *next)
{
    rp_migration_plan_free(next->plan);
    rp_free(ctx, next->from_phy2log);
    memset(next, 0, sizeof *next);
}

void sched_migration_commit(sched_migration *m, rp_context *ctx, sched_migration_next *next)
{
    rp_migration_plan_free(m->plan);
    rp_free(ctx, m->from_phy2log);
    m->plan = next->plan;
    m->from_phy2log = next->from_phy2log;
    m->open = m->plan != NULL;
    memset(next, 0, sizeof *next);
}

void sched_migration_free(sched_migration *m, rp_context *ctx)
{
    rp_migration_plan_free(m->plan);
    rp_free(ctx, m->from_phy2log);
    rp_free(ctx, m->expert_bytes);
    memset(m, 0, sizeof *m);
}

rp_status sched_migration_set_options(sched_migration *m, rp_context *ctx, const rp_config *cfg,
                                      const rp_migration_options *opts, rp_error *err)
{
    const int32_t L = rp_config_model(cfg)->num_layers;
    int64_t *bytes = NULL;
    if (opts && opts->staging_budget_bytes < 0)
        return rp_fail(err, RP_EINVAL, "sched: the staging budget is %lld bytes; give 0 (no limit) or more",
                       (long long)opts->staging_budget_bytes);
    if (opts && opts->expert_bytes) {
        for (int32_t l = 0; l < L; l++)
            if (opts->expert_bytes[l] <= 0)
                return rp_fail(err, RP_EINVAL, "sched: expert_bytes[%d] is %lld; every layer's expert must have bytes "
                               "(rp_registry_expert_bytes)", l, (long long)opts->expert_bytes[l]);
        bytes = rp_alloc(ctx, (size_t)L * sizeof(int64_t));
        if (!bytes) return rp_fail_nomem(err, "the migration options");
        memcpy(bytes, opts->expert_bytes, (size_t)L * sizeof(int64_t));
    }
    rp_free(ctx, m->expert_bytes);
    m->expert_bytes = bytes;
    m->staging_budget_bytes = opts ? opts->staging_budget_bytes : 0;
    m->options_set = opts != NULL;
    return RP_OK;
}

rp_status sched_migration_rollback(sched_migration *m, rp_plan *current, const rp_migration_result *result,
                                   rp_error *err)
{
    if (!m->plan || !m->open)
        return rp_fail(err, RP_EINVAL, "sched: there is no migration to roll back: the last step did not change the "
                       "placement, a step ran since, or its failure was already reported");
    if (!result) return rp_fail(err, RP_EINVAL, "sched: the migration result is required (rp_migration_execute's)");
    const int32_t rounds = rp_migration_plan_num_rounds(m->plan);
    if (result->rounds_committed < 0 || result->rounds_committed > rounds)
        return rp_fail(err, RP_EINVAL, "sched: the result says %d rounds committed, but the step's migration has %d",
                       (int)result->rounds_committed, (int)rounds);
    /* Layers of committed rounds are in the target placement, the others as before
     * (docs/migration.md, "Rounds"); layers that write nothing keep the target rows, which
     * differ from the old ones only in slots the target leaves empty. */
    const int32_t L = rp_plan_num_layers(current), S = rp_plan_total_slots(current);
    bool reverted = false;
    for (int32_t l = 0; l < L; l++) {
        if (rp_migration_plan_layer_round(m->plan, l) < result->rounds_committed) continue;
        /* the rows were a valid placement of this plan's shape: this cannot fail */
        rp_status st = rp_plan_set_phy2log(current, l, m->from_phy2log + (size_t)l * S, NULL);
        assert(st == RP_OK);
        (void)st;
        reverted = true;
    }
    /* levers (extra replicas, shares) were chosen for the target placement */
    if (reverted) rp_plan_clear_levers(current);
    m->open = false;
    return RP_OK;
}
