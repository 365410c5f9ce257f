/* Rebuilding a policy after a limit trip: its Lua state is discarded and a fresh one
 * loaded from the policy's source, with ctx.state as the last successful call left it
 * (kept by policy_keep_state, core/policy_state.c), so nothing an interrupted call did
 * (globals, upvalues, half-updated tables) reaches a later plan: the wall-time limit
 * trips at a machine-dependent point. */
#include "policy_state.h"


rp_status policy_rebuild(rp_policy **pol, rp_error *err)
{
    rp_policy *old = *pol, *fresh = NULL;
    rp_sandbox_limits lim = *rp_sandbox_limits_of(old->sb);
    rp_status st = rp_policy_load(old->ctx, old->cfg, old->source, old->source_len,
                                  old->info.path[0] ? old->info.path : NULL, &lim, old->params_json, true, &fresh, err);
    if (st == RP_OK && old->saved_state) st = policy_state_restore(fresh, old->saved_state, err);
    if (st != RP_OK) {
        rp_policy_free(fresh);
        return st;
    }
    rp_sandbox_copy_clock(fresh->sb, old->sb);
    /* The load kept the fresh state's own ctx.state (and the restore replaced it): the
     * copy to keep is the old one, whichever of the two holds a reference now. */
    json_t *kept = json_incref(old->saved_state);
    json_decref(fresh->saved_state);
    fresh->saved_state = kept;
    *pol = fresh;
    rp_policy_free(old);
    return RP_OK;
}
