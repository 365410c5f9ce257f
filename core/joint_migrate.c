/* The joint planner's migration of one layer: the migration plan's predicted time for
 * moving that layer alone (migrate_build.h), so a layer is re-placed by the time the
 * executor is charged for it (docs/routepack-policy.md, "Migration-aware placement"). */
#include "joint_internal.h"
#include "migrate_build.h"

#include <string.h>

rp_status joint_layer_migration_s(const joint *jt, int32_t layer, const joint_layer *from, const joint_layer *to,
                                  double *seconds, rp_error *err)
{
    const int32_t L = rp_config_model(jt->cfg)->num_layers;
    /* every other layer stays: NULL rows are not read */
    const int32_t **rows = rp_calloc(jt->ctx, 2 * (size_t)L, sizeof *rows);
    if (!rows) return rp_fail_nomem(err, "joint: a layer's migration");
    rows[layer] = from->phy2log;
    rows[L + layer] = to->phy2log;
    migrate_build built;
    /* one layer is one round: no staging budget */
    rp_status st = migrate_build_new(jt->ctx, jt->cfg, jt->slot_begin, rows, rows + L, NULL, &built, err);
    if (st == RP_OK) *seconds = built.summary.predicted_s;
    migrate_build_free(jt->ctx, &built);
    rp_free(jt->ctx, (void *)rows);
    return st;
}
