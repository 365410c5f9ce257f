/* Rebuilding a policy after a limit trip: its Lua state is discarded and a fresh one
 * loaded from the policy's source, with ctx.state as the last successful call left it
 * (kept by policy_keep_state, core/policy_state.c), so nothing an interrupted call did
 * (globals, upvalues, half-updated tables) reaches a later plan: the wall-time limit
 * trips at a machine-dependent point. The rebuild waits for the policy's next call and
 * runs in that call's window of wall time, so no step pays for a call and a rebuild
 * both (docs/sandbox.md, "After a limit trips"). */
#include "policy_state.h"

#include <lauxlib.h>
#include <string.h>

static rp_status rebuild(rp_policy **pol, rp_error *err)
{
    rp_policy *old = *pol, *fresh = NULL;
    double start = rp_sandbox_now(old->sb);
    rp_sandbox_limits lim = *rp_sandbox_limits_of(old->sb);
    rp_status st = rp_policy_load(old->ctx, old->cfg, old->source, old->source_len,
                                  old->info.path[0] ? old->info.path : NULL, &lim, old->params_json, true, &fresh, err);
    if (st == RP_OK) {
        /* loading, restoring and the call that follows share one window from `start` */
        rp_sandbox_open_window(fresh->sb, start);
        if (rp_sandbox_past_deadline(fresh->sb))
            st = rp_fail(err, RP_ELIMIT, "policy exceeded the wall-time limit of %g s reloading its source after a "
                         "limit trip", lim.max_wall_s);
    }
    if (st == RP_OK) st = state_copy_restore(fresh, &old->kept, fresh->sb, err);
    if (st != RP_OK) {
        rp_policy_free(fresh);
        return st;
    }
    policy_state_replace(fresh, &old->kept);
    *pol = fresh;
    rp_policy_free(old);
    return RP_OK;
}

rp_status policy_ready(rp_policy **pol, rp_error *err)
{
    if (!(*pol)->tainted) return RP_OK;
    rp_error e;
    rp_error_clear(&e);
    rp_status st = rebuild(pol, &e);
    if (st != RP_OK)
        return rp_fail(err, st, "policy '%s' could not be rebuilt after its last call tripped a limit: %s",
                       (*pol)->info.name, e.text);
    return RP_OK;
}
