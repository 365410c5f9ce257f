/* Predicted cost of changing placements: the migration plan's copies and predicted time
 * (migrate_build.h), the time the executor is charged (docs/cost-model.md, "Migration"). */
#include "cost_internal.h"
#include "migrate_build.h"

#include <string.h>

static rp_status check_placement(const rp_cost *c, const rp_plan *p, const char *which, rp_error *err)
{
    if (!p) return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan is missing", which);
    if (!rp_plan_has_placement(p))
        return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan has no placement", which);
    if (rp_plan_num_gpus(p) != c->G || rp_plan_ep_size(p) != c->ep || rp_plan_num_layers(p) != c->L ||
        rp_plan_num_experts(p) != c->E)
        return rp_fail(err, RP_EINVAL,
                       "cost: migration: the '%s' plan is shaped for %d GPUs, EP %d, %d layers, %d experts; the "
                       "config has %d, %d, %d, %d", which, rp_plan_num_gpus(p), rp_plan_ep_size(p),
                       rp_plan_num_layers(p), rp_plan_num_experts(p), c->G, c->ep, c->L, c->E);
    const int32_t *sb = rp_plan_slot_begin(p);
    if (!sb || sb[0] != 0 || sb[c->ep] != rp_plan_total_slots(p))
        return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's slot offsets are inconsistent", which);
    for (int32_t j = 0; j < c->ep; j++)
        if (sb[j + 1] < sb[j])
            return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's EP rank %d has a negative slot count",
                           which, j);
    return RP_OK;
}

/* Which experts each EP rank holds at one layer: held[rank * E + e] = 1. */
static rp_status mark_held(const rp_cost *c, const rp_plan *p, const char *which, int32_t layer,
                           unsigned char *held, rp_error *err)
{
    const int32_t *sb = rp_plan_slot_begin(p), *row = rp_plan_phy2log(p, layer);
    memset(held, 0, (size_t)c->ep * c->E);
    for (int32_t r = 0; r < c->ep; r++)
        for (int32_t k = sb[r]; k < sb[r + 1]; k++) {
            int32_t e = row[k];
            if (e < -1 || e >= c->E) {
                rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's layer %d slot %d holds expert %d, but "
                        "the model has %d", which, layer, k, e, c->E);
                if (err) err->expert = e;
                return RP_EINVAL;
            }
            if (e >= 0) held[(size_t)r * c->E + e] = 1;
        }
    return RP_OK;
}

rp_status rp_cost_migration(const rp_cost *c, const rp_plan *from, const rp_plan *to, double *seconds,
                            double *bytes, rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st;
    if ((st = check_placement(c, from, "from", err)) != RP_OK || (st = check_placement(c, to, "to", err)) != RP_OK)
        return st;
    const int32_t ep = c->ep, E = c->E, L = c->L;
    const int32_t *sb = rp_plan_slot_begin(to), *sb_from = rp_plan_slot_begin(from);
    for (int32_t j = 0; j <= ep; j++)
        if (sb[j] != sb_from[j])
            return rp_fail(err, RP_EINVAL, "cost: migration: the 'from' and 'to' plans give EP rank %d different slot "
                           "counts", j > 0 ? j - 1 : 0);
    unsigned char *had = rp_alloc(c->ctx, (size_t)ep * E), *want = rp_alloc(c->ctx, (size_t)ep * E);
    const int32_t **rows = rp_alloc(c->ctx, 2 * (size_t)L * sizeof *rows);
    migrate_build built;
    memset(&built, 0, sizeof built);
    if (!had || !want || !rows) {
        st = rp_fail_nomem(err, "a migration estimate");
        goto out;
    }
    /* every expert `to` places must be somewhere in `from` to be copied */
    for (int32_t l = 0; l < L; l++) {
        RP_CHECK_GOTO(mark_held(c, from, "from", l, had, err), st, out);
        RP_CHECK_GOTO(mark_held(c, to, "to", l, want, err), st, out);
        for (int32_t e = 0; e < E; e++) {
            bool wanted = false, anywhere = false;
            for (int32_t r = 0; r < ep; r++) {
                wanted |= want[(size_t)r * E + e] && !had[(size_t)r * E + e];
                anywhere |= had[(size_t)r * E + e];
            }
            if (wanted && !anywhere) {
                rp_fail(err, RP_EINVAL, "cost: migration: layer %d expert %d is on no EP rank of the 'from' "
                        "placement, so it cannot be copied", l, e);
                if (err) err->expert = e;
                st = RP_EINVAL;
                goto out;
            }
        }
        rows[l] = rp_plan_phy2log(from, l);
        rows[L + l] = rp_plan_phy2log(to, l);
    }
    /* the migration plan's own copies, sources, rounds and predicted time, with the
     * staging budget the scheduler plans with until the trainer sets its own */
    rp_migration_options o = {NULL, rp_config_execution(c->cfg)->staging_budget_bytes};
    RP_CHECK_GOTO(migrate_build_new(c->ctx, c->cfg, sb, rows, rows + L, &o, &built, err), st, out);
    if (seconds) *seconds = built.summary.predicted_s;
    if (bytes) *bytes = (double)built.summary.moved_bytes;
    st = RP_OK;
out:
    migrate_build_free(c->ctx, &built);
    rp_free(c->ctx, had);
    rp_free(c->ctx, want);
    rp_free(c->ctx, (void *)rows);
    return st;
}
