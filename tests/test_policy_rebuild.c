/* After a limit trip the policy's Lua state is discarded and rebuilt from its source and
 * the ctx.state of its last successful call: nothing the interrupted call did reaches a
 * later plan, so the same steps under different wall-time limits give the same plans. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>

#define STEPS 5

static gen_steps fx;

/* Counts in an upvalue and writes ctx.state while its step 1 loops until the wall-time
 * limit stops it; later steps fail loudly if any of that survived, and otherwise choose
 * their plan from what they kept (ctx.state.n, the steps that succeeded). */
static const char *COUNTING =
    "local count = 0\n"
    "return {name = 'counting', version = '1.0.0', api = 1, description = 'counts until stopped',\n"
    "init = function(ctx) ctx.state.n = 0 end,\n"
    "plan = function(ctx)\n"
    "  local s = ctx.state\n"
    "  s.n = s.n + 1\n"
    "  if ctx.step == 1 then while true do count = count + 1 s.junk = count end end\n"
    "  if count ~= 0 or s.junk ~= nil then\n"
    "    error('the interrupted call leaked: count ' .. count .. ', junk ' .. tostring(s.junk))\n"
    "  end\n"
    "  if (s.n + count) % 2 == 0 then return rp.baseline('attn_kk+eplb') end\n"
    "  return rp.baseline('token_kk+eplb')\n"
    "end}\n";

static const char *policy_path(void)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/counting.lua", fx.tmp);
    spit(path, COUNTING, strlen(COUNTING));
    return path;
}

/* Run STEPS steps under `wall_s` (no instruction limit in reach: only the clock stops
 * step 1); the plan hashes and fallback flags into the arrays. */
static bool run(double wall_s, uint64_t *hash, bool *fell_back, char *reason, size_t reason_len)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy_path();
    o.num_threads = 1;
    o.max_wall_s = wall_s;
    o.max_instructions = INT64_C(1) << 50;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(fx.ctx, fx.cfg, &o, &s, &err) != RP_OK) {
        diag("rp_sched_new: %s", err.text);
        return false;
    }
    bool good = true;
    for (int t = 0; t < STEPS && good; t++) {
        const rp_plan *p = NULL;
        const rp_step_report *rep = NULL;
        good = rp_sched_step(s, t, fx.batches[t], &fx.routings[t], &p, &rep, &err) == RP_OK;
        if (!good) {
            diag("step %d: %s", t, err.text);
            break;
        }
        hash[t] = rep->plan_hash;
        fell_back[t] = rep->fallback;
        if (rep->fallback && t != 1) snprintf(reason, reason_len, "step %d: %.400s", t, rep->fallback_reason);
        if (t == 1) diag("wall limit %.2f s, step 1: %s", wall_s, rep->fallback_reason);
    }
    rp_sched_free(s);
    return good;
}

int main(void)
{
    rp_error err;
    if (!gen_steps_load(&fx, "policy-rebuild", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    uint64_t h1[STEPS], h2[STEPS];
    bool f1[STEPS], f2[STEPS];
    char r1[RP_ERROR_TEXT] = "", r2[RP_ERROR_TEXT] = "";
    bool ran = run(0.15, h1, f1, r1, sizeof r1) && run(0.6, h2, f2, r2, sizeof r2);
    ok(ran, "the steps run under wall-time limits of 0.15 s and 0.6 s");
    ok(ran && f1[1] && f2[1], "step 1 stops at the wall-time limit under both");
    bool clean = ran;
    for (int t = 0; clean && t < STEPS; t++) clean = t == 1 || (!f1[t] && !f2[t]);
    ok(clean, "no other step falls back: nothing the interrupted call did survived %s%s", r1, r2);
    bool same = ran;
    for (int t = 0; same && t < STEPS; t++) same = h1[t] == h2[t] && f1[t] == f2[t];
    ok(same, "the same steps under both limits give the same plans");
    gen_steps_free(&fx);
    return tap_done();
}
