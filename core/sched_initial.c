/* The placement in use before a scheduler's first step (docs/policies.md, "The placement
 * in use"): a trainer always starts from some placement, its checkpoint's or the
 * contiguous one, and the policy, the fallback check and the migration charged at step 0
 * must all see the same one. */
#include "sched_internal.h"

#include <stdio.h>
#include <string.h>

rp_status sched_initial_placement(rp_context *ctx, const rp_config *cfg, const char *source, rp_plan **out,
                                  rp_error *err)
{
    *out = NULL;
    if (!source || !*source) source = rp_config_policy(cfg)->initial_placement;
    if (!source || !*source) source = "contiguous";
    rp_plan *placed = NULL, *file = NULL;
    rp_status st = rp_plan_new(ctx, cfg, 1, &placed, err);
    if (st != RP_OK) return st;
    if (!strcmp(source, "contiguous")) {
        st = rp_plan_set_contiguous(placed, err);
        goto out;
    }
    st = rp_plan_load(ctx, cfg, source, &file, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        snprintf(msg, sizeof msg, "%s", err->text);
        st = rp_fail(err, st, "sched: the initial placement %s cannot be read: %s", source, msg);
        goto out;
    }
    if (!rp_plan_has_placement(file)) {
        st = rp_fail(err, RP_EINVAL,
                     "sched: the initial placement %s has no \"placement\"; give a plan file with one, or "
                     "\"contiguous\"",
                     source);
        goto out;
    }
    /* only the placement is taken: a packing names another batch's sequences, and levers
     * belong to that packing */
    for (int32_t l = 0; l < rp_plan_num_layers(file) && st == RP_OK; l++)
        st = rp_plan_set_phy2log(placed, l, rp_plan_phy2log(file, l), err);
    if (st == RP_OK) st = rp_plan_validate(placed, cfg, NULL, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        snprintf(msg, sizeof msg, "%s", err->text);
        st = rp_fail(err, st, "sched: the initial placement %s is not a valid placement for this config: %s", source,
                     msg);
    }
out:
    rp_plan_free(file);
    if (st != RP_OK) rp_plan_free(placed);
    else *out = placed;
    return st;
}
