/* A policy that fails several steps in a row is demoted: to the policy the last hot swap
 * replaced, else to the safe default's packing (attn_kk); the step report says so, and
 * rp_sched_options.demote_after sets how many failures it takes (negative: never). */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>

#define STEPS 8

static gen_steps fx;

/* Plans with token_kk+eplb's baseline until step `from`, then fails every step. */
static const char *failing_policy(int from)
{
    static char path[512];
    char src[1024];
    snprintf(src, sizeof src,
             "return {name = 'late_failure', version = '1.0.0', api = 1, description = 'fails from a step on',\n"
             "plan = function(ctx)\n"
             "  if ctx.step >= %d then error('broken from step %d') end\n"
             "  return rp.baseline('token_kk+eplb')\n"
             "end}\n",
             from, from);
    snprintf(path, sizeof path, "%s/late_failure.lua", fx.tmp);
    spit(path, src, strlen(src));
    return path;
}

static rp_sched *make(const char *policy, int32_t demote_after)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.demote_after = demote_after;
    return gen_steps_sched(&fx, policy, NULL, &o);
}

static const rp_step_report *step(rp_sched *s, int t)
{
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    rp_error err;
    if (!s || rp_sched_step(s, t, fx.batches[t % STEPS], &fx.routings[t % STEPS], &p, &rep, &err) != RP_OK) {
        if (s) diag("step %d: %s", t, err.text);
        return NULL;
    }
    return rep;
}

static void test_default(void)
{
    rp_sched *s = make(failing_policy(2), 0);
    const rp_step_report *rep = NULL;
    int demoted_at = -1;
    char to[64] = "";
    for (int t = 0; t < STEPS && demoted_at < 0; t++) {
        rep = step(s, t);
        if (!rep) break;
        if (t >= 2) ok(rep->fallback && rep->failed_steps == t - 1, "step %d falls back, failure %d in a row", t,
                       rep->failed_steps);
        if (rep->demoted) {
            demoted_at = t;
            snprintf(to, sizeof to, "%s", rep->demoted_to);
        }
    }
    ok(demoted_at == 4 && strcmp(to, "attn_kk") == 0,
       "after 3 failures in a row (steps 2-4) the policy is demoted to the safe default's packing (step %d, '%s')",
       demoted_at, to);
    char *json = NULL;
    rp_error err;
    ok(rp_sched_report_json(s, &json, NULL, &err) == RP_OK && strstr(json, "\"demoted_to\": \"attn_kk\"") &&
           strstr(json, "\"failed_steps\": 3"),
       "the report JSON says so");
    rp_text_free(fx.ctx, json);
    rep = step(s, 5);
    ok(rep && !rep->fallback && strcmp(rep->policy_name, "attn_kk") == 0 && rep->failed_steps == 0,
       "the next step runs attn_kk without falling back (%s)", rep ? rep->policy_name : "-");
    rp_sched_free(s);
}

static void test_back_to_previous(void)
{
    rp_sched *s = make("token_kk+eplb", 2);
    const rp_step_report *rep = NULL;
    rp_error err;
    step(s, 0);
    ok(rp_sched_stage_policy(s, failing_policy(2), NULL, -1, &err) == RP_OK, "a policy that fails from step 2 is staged");
    rep = step(s, 1);
    ok(rep && rep->swapped && strcmp(rep->policy_name, "late_failure") == 0, "it takes over at step 1");
    rep = step(s, 2);
    ok(rep && rep->fallback && !rep->demoted, "step 2 falls back");
    rep = step(s, 3);
    ok(rep && rep->fallback && rep->demoted && strcmp(rep->demoted_to, "token_kk+eplb") == 0,
       "after 2 failures (demote_after 2) the policy it replaced runs again ('%s')", rep ? rep->demoted_to : "-");
    rep = step(s, 4);
    ok(rep && !rep->fallback && strcmp(rep->policy_name, "token_kk+eplb") == 0, "and plans step 4 (%s)",
       rep ? rep->policy_name : "-");
    rp_sched_free(s);
}

static void test_never(void)
{
    rp_sched *s = make(failing_policy(0), -1);
    bool demoted = false, all_failed = true;
    for (int t = 0; t < 6; t++) {
        const rp_step_report *rep = step(s, t);
        all_failed &= rep && rep->fallback;
        demoted |= rep && rep->demoted;
    }
    ok(all_failed && !demoted, "demote_after -1: a policy failing 6 steps in a row is kept");
    rp_sched_free(s);
}

/* The streak toward demote_after is in the checkpoint: a run saved after its first two
 * failures (steps 2 and 3) and resumed in a new scheduler demotes at step 4, as the
 * uninterrupted run does (a resumed scheduler counted from 0 and demoted at step 6). */
static void test_checkpoint(void)
{
    rp_sched *s = make(failing_policy(2), 0);
    for (int t = 0; t < 4; t++) step(s, t);
    char *state = NULL;
    size_t len = 0;
    rp_error err;
    ok(s && rp_sched_save_state(s, &state, &len, &err) == RP_OK && strstr(state, "\"failed_steps\":2"),
       "the checkpoint after two failures in a row holds failed_steps 2");
    rp_sched *r = make(failing_policy(2), 0);
    ok(r && state && rp_sched_load_state(r, state, len, &err) == RP_OK, "it loads into a new scheduler %s",
       state ? "" : err.text);
    int demoted_at = -1;
    for (int t = 4; t < STEPS && demoted_at < 0; t++) {
        const rp_step_report *rep = step(r, t);
        if (rep && rep->demoted) demoted_at = t;
    }
    ok(demoted_at == 4, "the resumed run demotes at step 4, as the uninterrupted one (step %d)", demoted_at);
    char *again = NULL;
    ok(r && rp_sched_save_state(r, &again, NULL, &err) == RP_OK && !strstr(again, "failed_steps"),
       "after the demotion the streak is over: the checkpoint leaves failed_steps out");
    rp_text_free(fx.ctx, state);
    rp_text_free(fx.ctx, again);
    rp_sched_free(s);
    rp_sched_free(r);
}

int main(void)
{
    rp_error err;
    if (!gen_steps_load(&fx, "sched-demote", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    test_default();
    test_back_to_previous();
    test_never();
    test_checkpoint();
    gen_steps_free(&fx);
    return tap_done();
}
