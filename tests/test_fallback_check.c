/* When the routepack policy checks its plan against the baselines (docs/routepack-policy.md,
 * section 7, "When the policy checks"): rp.joint's gate (opts.fallback_above_ratio:
 * the baselines are built and evaluated only when the joint plan's step / lower bound is
 * above it), and the policy's rule over steps: the first step, every fallback_interval
 * steps, every step while a baseline won the last check, and a step whose joint plan's
 * ratio rose by more than fallback_ratio_rise since the last check. fallback_interval = 1
 * checks every step and returns the plans of the policy without the gate. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 8
static gen_steps fx; /* the fixture (tests/test_util.h); the names below are its parts */
static rp_context *ctx;
static rp_config *cfg;
static rp_batch **batches;
static rp_routing *routings;
static const char *tmp;

/* Step t; NULL (with a diagnostic) when the step fails or the policy fell back. */
static const rp_step_report *step(rp_sched *s, int t, const rp_plan **plan)
{
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    rp_error err;
    if (!s || rp_sched_step(s, t, batches[t], &routings[t], &p, &rep, &err) != RP_OK) {
        if (s) diag("step %d: %s", t, err.text);
        return NULL;
    }
    if (rep->fallback) {
        diag("step %d fell back: %s", t, rep->fallback_reason);
        return NULL;
    }
    if (plan) *plan = p;
    return rep;
}

/* rp.joint's gate, from a probe policy: above the joint plan's ratio nothing is checked,
 * just below it the check runs and returns what the ungated call returns. */
static void test_gate(void)
{
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local p0, r0 = rp.joint({})\n"
                                   "local p1, r1 = rp.joint({fallback_above_ratio = 1000})\n"
                                   "assert(r0.fallbacks_checked, 'ungated: not checked')\n"
                                   "assert(not r1.fallbacks_checked, 'above the ratio: checked')\n"
                                   "assert(r1.chosen == 'joint', 'unchecked, yet ' .. r1.chosen)\n"
                                   "assert(r1.best_fallback_step_s ~= r1.best_fallback_step_s, 'a fallback scored')\n"
                                   "assert(r1.joint_ratio == r0.joint_ratio and r0.joint_ratio >= 1,\n"
                                   "       'joint ratio ' .. r1.joint_ratio .. ' vs ' .. r0.joint_ratio)\n"
                                   "local p2, r2 = rp.joint({fallback_above_ratio = r0.joint_ratio * (1 - 1e-9)})\n"
                                   "assert(r2.fallbacks_checked, 'just below the ratio: not checked')\n"
                                   "assert(r2.chosen == r0.chosen and r2.step_s == r0.step_s and\n"
                                   "       r2.best_fallback_step_s == r0.best_fallback_step_s and p2:hash() == p0:hash(),\n"
                                   "       'gated check differs from the ungated one')\n"
                                   "local p3, r3 = rp.joint({fallback_above_ratio = r0.joint_ratio})\n"
                                   "assert(not r3.fallbacks_checked, 'at the ratio: checked')\n"
                                   "return p2"),
                       NULL, NULL);
    const rp_step_report *rep = step(s, 0, NULL);
    ok(rep != NULL, "rp.joint with fallback_above_ratio: unchecked above and at the joint plan's ratio (no "
                    "baseline scored), checked just below it with the ungated call's choice and plan");
    ok(rep && rep->fallback_checks == 2, "the step report counts the two calls that checked (%d)",
       rep ? rep->fallback_checks : -1);
    rp_sched_free(s);

    const char *bad[] = {"-1", "0/0", "1/0"};
    for (int i = 0; i < 3; i++) {
        char body[128];
        snprintf(body, sizeof body, "return rp.joint({fallback_above_ratio = %s})", bad[i]);
        s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, body), NULL, NULL);
        const rp_plan *p = NULL;
        const rp_step_report *r = NULL;
        rp_error err;
        const bool stepped = s && rp_sched_step(s, 0, batches[0], &routings[0], &p, &r, &err) == RP_OK;
        ok(stepped && r->fallback && strstr(r->fallback_reason, "fallback_above_ratio") &&
               strstr(r->fallback_reason, "finite number >= 0"),
           "fallback_above_ratio = %s is refused, naming it: %s", bad[i], stepped ? r->fallback_reason : err.text);
        rp_sched_free(s);
    }
}

/* rp.joint's balancer_first, from a probe policy (the joint placement's re-fits charged
 * dearly, so the balancer's candidate wins): under a closed gate the candidate comes
 * back without the joint placement, the plan the full call returns; with the gate open
 * (just below its ratio) it is the full comparison, as the ungated call; without the
 * gate it is ignored. */
static void test_balancer_first(void)
{
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, 
        "local base = {virtual_experts = true, recurring_migration_s = 1000}\n"
        "local function with(extra) local o = {} for k, v in pairs(base) do o[k] = v end\n"
        "  for k, v in pairs(extra) do o[k] = v end return o end\n"
        "local p0, r0 = rp.joint(with({fallback_above_ratio = 1000}))\n"
        "assert(r0.per_forward_balancing and r0.joint_built, 'the candidate did not win, or no joint placement')\n"
        "local p1, r1 = rp.joint(with({fallback_above_ratio = 1000, balancer_first = true}))\n"
        "assert(not r1.joint_built and r1.per_forward_balancing and not r1.fallbacks_checked, 'gate closed: built')\n"
        "assert(r1.joint_step_s ~= r1.joint_step_s and r1.joint_ratio ~= r1.joint_ratio, 'a joint score')\n"
        "assert(p1:hash() == p0:hash() and r1.step_s == r0.step_s and r1.chosen == 'joint', 'another plan')\n"
        "assert(r1.virtual_experts_step_s == r1.step_s, 'the candidate step')\n"
        "local p2, r2 = rp.joint(with({fallback_above_ratio = r1.ratio * (1 - 1e-9), balancer_first = true}))\n"
        "local p3, r3 = rp.joint(base)\n"
        "assert(r2.joint_built and r2.fallbacks_checked, 'gate open: not the full comparison')\n"
        "assert(p2:hash() == p3:hash() and r2.chosen == r3.chosen and r2.step_s == r3.step_s and\n"
        "       r2.joint_step_s == r3.joint_step_s, 'the open gate differs from the ungated call')\n"
        "local p4, r4 = rp.joint(with({balancer_first = true}))\n"
        "assert(r4.joint_built and r4.fallbacks_checked and p4:hash() == p3:hash(), 'no gate: not ignored')\n"
        "return p1"),
        NULL, NULL);
    const rp_step_report *rep = step(s, 0, NULL);
    ok(rep != NULL, "rp.joint balancer_first: under a closed gate the balancer's plan without the joint placement, "
                    "the full comparison when the gate opens, ignored without the gate");
    rp_sched_free(s);
}

/* policies/routepack.lua with the first occurrence of `line` replaced by `with`, as a
 * policy file in the scratch folder; NULL when the source has no such line. */
static const char *shipped_edited(const char *line, const char *with)
{
    char path[512];
    snprintf(path, sizeof path, "%s/policies/routepack.lua", RP_SOURCE_DIR);
    size_t len = 0;
    char *src = slurp(path, &len);
    char *at = src ? strstr(src, line) : NULL;
    if (!at) {
        free(src);
        return NULL;
    }
    char *out = malloc(len + strlen(with) + 1);
    memcpy(out, src, (size_t)(at - src));
    strcpy(out + (at - src), with);
    strcat(out, at + strlen(line));
    free(src);
    const char *file = gen_steps_policy_file(&fx, out);
    free(out);
    return file;
}

/* The shipped policy with a counter injected after its rp.joint call: how many of its
 * `STEPS` calls on the steps of `g` built the joint placement (the last step reports it
 * as its failure). */
static int joint_builds(const gen_steps *g, const char *params)
{
    char probe[768];
    snprintf(probe, sizeof probe,
             "  note_refit(ctx, report)\n"
             "  ctx.state.built = (ctx.state.built or 0) + (report.joint_built and 1 or 0)\n"
             "  ctx.state.calls = (ctx.state.calls or 0) + 1\n"
             "  if ctx.state.calls == %d then error('built ' .. ctx.state.built .. ' of') end\n",
             STEPS);
    const char *file = shipped_edited("  note_refit(ctx, report)\n", probe);
    if (!file) return -1;
    rp_sched *s = gen_steps_sched(&fx, file, params, NULL);
    int built = -1;
    for (int t = 0; t < STEPS && s; t++) {
        const rp_plan *p = NULL;
        const rp_step_report *r = NULL;
        rp_error err;
        if (rp_sched_step(s, t, g->batches[t], &g->routings[t], &p, &r, &err) != RP_OK) break;
        const char *b = r->fallback ? strstr(r->fallback_reason, "built ") : NULL;
        if (t == STEPS - 1 && b) built = atoi(b + 6);
        else if (r->fallback) break;
    }
    rp_sched_free(s);
    return built;
}

/* The shipped policy on the bundled example's steps (gen-example.json, where the
 * balancer's plan wins every check): after it won a check, the steps until the next one
 * build no joint placement (balancer_between_checks); without it, every step does. */
static void test_between_checks(void)
{
    gen_steps ex;
    rp_error err;
    if (!gen_steps_load_cfg(&ex, "between-checks", "gen-example.json", EXECUTOR_IDEAL, STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        ok(0, "setup");
        return;
    }
    int gated = joint_builds(&ex, "{\"fallback_interval\": 4}");
    int every = joint_builds(&ex, "{\"balancer_between_checks\": false, \"fallback_interval\": 4}");
    gen_steps_free(&ex);
    is_int(every, STEPS, "balancer_between_checks false: every step builds the joint placement");
    ok(gated >= 2 && gated < STEPS, "balancer_between_checks (default): only the checks build it (%d of %d steps)",
       gated, STEPS);
}

/* The policy's rule replayed from the step reports. Without the balancer's candidate the
 * returned plan is the joint plan whenever no baseline won, so the report's ratio is the
 * joint plan's step / lower bound that the gate compares. Returns the checks made. */
static int replay(const char *params, int interval, double rise, int *by_interval, int *by_rise, int *skipped)
{
    rp_sched *s = gen_steps_sched(&fx, "routepack", params, NULL);
    int mismatches = 0, ran = 0, checks = 0;
    bool have = false, lost = false;
    int age = 0;
    double last = 0;
    *by_interval = *by_rise = *skipped = 0;
    for (int t = 0; t < STEPS && s; t++) {
        const rp_step_report *r = step(s, t, NULL);
        if (!r) break;
        ran++;
        const double ratio = r->cost.ratio;
        const bool interval_due = have && !lost && age + 1 >= interval;
        const bool risen = have && !lost && !interval_due && ratio > last * (1 + rise);
        const bool want = !have || lost || interval_due || risen;
        if ((r->fallback_checks == 1) != want || r->fallback_checks > 1) {
            diag("step %d: %d checks, the rule says %d (ratio %.9f, last check's %.9f, age %d, lost %d)", t,
                 r->fallback_checks, want, ratio, last, age, lost);
            mismatches++;
        }
        if (r->fallback_checks == 1) {
            checks++;
            *by_interval += interval_due;
            *by_rise += risen;
            have = true;
            lost = r->fallback_check_changes == 1;
            age = 0;
            last = ratio;
        } else {
            (*skipped)++;
            age++;
        }
    }
    is_int(ran, STEPS, "routepack %s ran %d steps without falling back", params, STEPS);
    is_int(mismatches, 0, "each step checks exactly when the rule says (%d checks)", checks);
    rp_sched_free(s);
    return checks;
}

static void test_rule(void)
{
    int by_interval, by_rise, skipped;
    /* the first step, then every third: steps 0, 3, 6 unless a baseline wins */
    replay("{\"virtual_experts\": false, \"fallback_interval\": 3, \"fallback_ratio_rise\": 1000}", 3, 1000,
           &by_interval, &by_rise, &skipped);
    ok(by_interval >= 2 && skipped >= 4 && by_rise == 0,
       "interval 3, no rise trigger: checks at the interval (%d), quiet steps skipped (%d)", by_interval, skipped);
    /* any rise of the ratio checks */
    replay("{\"virtual_experts\": false, \"fallback_interval\": 1000, \"fallback_ratio_rise\": 0}", 1000, 0,
           &by_interval, &by_rise, &skipped);
    ok(by_rise >= 1 && skipped >= 1 && by_interval == 0,
       "no interval, rise 0: a step whose joint plan fits worse than at the last check is checked (%d), the "
       "others skipped (%d)",
       by_rise, skipped);
}

/* 16 microbatches where the cap allows fewer: a baseline wins every check, so the check
 * stays on at every step whatever the interval. */
static void test_sticky(void)
{
    rp_sched *s = gen_steps_sched(&fx, "routepack", "{\"num_microbatches\": 16, \"fallback_interval\": 1000}", NULL);
    int checked = 0, won = 0, ran = 0;
    for (int t = 0; t < STEPS && s; t++) {
        const rp_step_report *r = step(s, t, NULL);
        if (!r) break;
        ran++;
        checked += r->fallback_checks;
        won += r->fallback_check_changes;
    }
    ok(ran == STEPS && checked == STEPS && won == STEPS,
       "while a baseline wins, every step checks (%d of %d) and returns the baseline (%d)", checked, ran, won);
    rp_sched_free(s);
}

/* fallback_interval = 1: every step checks, and the plans are those of the shipped
 * policy with the gate taken out (rp.joint's check on every step, as before the gate). */
static void test_every_step(void)
{
    const char *file = shipped_edited("    fallback_above_ratio = gate,\n", "");
    ok(file != NULL, "policies/routepack.lua passes the gate to rp.joint in one line");
    if (!file) return;
    rp_sched *every = gen_steps_sched(&fx, "routepack", "{\"fallback_interval\": 1}", NULL), *ungated = gen_steps_sched(&fx, file, NULL, NULL);
    int same = 0, checks = 0, ran = 0;
    for (int t = 0; t < STEPS && every && ungated; t++) {
        const rp_plan *a = NULL, *b = NULL;
        const rp_step_report *ra = step(every, t, &a), *rb = step(ungated, t, &b);
        if (!ra || !rb) break;
        ran++;
        same += rp_plan_hash(a) == rp_plan_hash(b);
        checks += ra->fallback_checks == 1 && rb->fallback_checks == 1;
    }
    is_int(ran, STEPS, "both ran %d steps", STEPS);
    ok(checks == STEPS && same == STEPS,
       "fallback_interval 1 checks every step (%d) with the ungated policy's plans (%d of %d the same)", checks,
       same, ran);
    rp_sched_free(every);
    rp_sched_free(ungated);
}

int main(void)
{
    rp_error err;
    /* the bundled small config priced as the figures here were derived: the "ideal"
     * executor (every lever, the balancer included). Under routepack_torch's one
     * all-reduce of replica gradients over the EP group a baseline without replicas
     * wins every check on this batch (test_sticky's case), and the gate never closes. */
    if (!gen_steps_load_cfg(&fx, "fallback-check", "gen-small.json", EXECUTOR_IDEAL, STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    ctx = fx.ctx, cfg = fx.cfg, batches = fx.batches, routings = fx.routings, tmp = fx.tmp;
    test_gate();
    test_balancer_first();
    test_between_checks();
    test_rule();
    test_sticky();
    test_every_step();
    gen_steps_free(&fx);
    return tap_done();
}
