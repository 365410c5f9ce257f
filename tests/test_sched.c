/* The scheduler end to end: a step with each shipped policy, omitted parts kept, the
 * safe default, fallback on every kind of hostile policy with the last good placement
 * surviving, determinism (also across threads), hot swap success and failure, read-only
 * views, and a plan userdata a policy cannot take apart. */
#include "cost_internal.h"
#include "limits_internal.h"
#include "routepack/routepack.h"
#include "sched_internal.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define STEPS 4
static gen_steps fx; /* the fixture (tests/test_util.h); the names below are its parts */
static rp_context *ctx;
static rp_config *cfg;
static rp_batch **batches;
static rp_routing *routings;
static const char *tmp;

static const rp_step_report *step(rp_sched *s, int t, const rp_plan **plan)
{
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    rp_error err;
    if (!s || rp_sched_step(s, t, batches[t % STEPS], &routings[t % STEPS], &p, &rep, &err) != RP_OK) {
        if (s) diag("step %d: %s", t, err.text);
        return NULL;
    }
    if (plan) *plan = p;
    return rep;
}

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    if (!rp_plan_has_placement(a) || !rp_plan_has_placement(b)) return false;
    for (int32_t l = 0; l < rp_plan_num_layers(a); l++)
        if (memcmp(rp_plan_phy2log(a, l), rp_plan_phy2log(b, l), (size_t)rp_plan_total_slots(a) * 4) != 0) return false;
    return true;
}

static bool same_packing(const rp_plan *a, const rp_plan *b)
{
    if (!rp_plan_has_packing(a) || !rp_plan_has_packing(b)) return false;
    if (rp_plan_num_microbatches(a) != rp_plan_num_microbatches(b)) return false;
    for (int32_t g = 0; g < rp_plan_num_gpus(a); g++)
        for (int32_t m = 0; m < rp_plan_num_microbatches(a); m++) {
            int32_t ca, cb;
            const int32_t *la = rp_plan_microbatch(a, g, m, &ca), *lb = rp_plan_microbatch(b, g, m, &cb);
            if (ca != cb || (ca && memcmp(la, lb, (size_t)ca * 4) != 0)) return false;
        }
    return true;
}

static rp_plan *baseline(int t, const char *name)
{
    rp_stats *stats = NULL;
    rp_plan *p = NULL, *contiguous = NULL;
    rp_error err;
    /* a fresh scheduler's placement in use is the contiguous one */
    if (rp_plan_new(ctx, cfg, 1, &contiguous, &err) == RP_OK && rp_plan_set_contiguous(contiguous, &err) == RP_OK &&
        rp_stats_compute(ctx, batches[t], &routings[t], 64, 1, &stats, &err) == RP_OK)
        rp_baseline_plan(ctx, cfg, batches[t], stats, contiguous, name, 0, &p, &err);
    rp_stats_free(stats);
    rp_plan_free(contiguous);
    return p;
}

/* ---- one step with each shipped policy ---------------------------------------------- */

static void test_shipped(void)
{
    static const char *names[] = {"token_kk", "attn_kk", "eplb", "routepack", "token_kk+eplb", "attn_kk+eplb"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        rp_sched *s = gen_steps_sched(&fx, names[i], NULL, NULL);
        const rp_plan *plan = NULL;
        const rp_step_report *rep = step(s, 0, &plan);
        ok(rep && !rep->fallback && rp_plan_validate(plan, cfg, batches[0], NULL) == RP_OK,
           "%s: a step gives a valid plan without fallback", names[i]);
        if (rep && rep->fallback) diag("%s", rep->fallback_reason);
        ok(rep && strcmp(rep->policy_name, names[i]) == 0 && rep->cost.step_s > 0 &&
               rep->cost.ratio >= 1 - 1e-9 && rep->plan_hash == rp_plan_hash(plan) && rep->policy_work > 0 &&
               rep->step == 0 && rep->policy_wall_s >= 0 && rep->policy_wall_s <= rep->plan_wall_s &&
               rep->policy_cpu_s > 0 && rep->policy_cpu_s <= rep->policy_wall_s + 0.01,
           "%s: the report names the policy and carries the plan's figures", names[i]);
        rep = step(s, 1, &plan);
        ok(rep && !rep->fallback && rep->migration_s >= 0 && rep->experts_moved >= 0, "%s: a second step", names[i]);
        rp_sched_free(s);
    }
}

/* ---- what a policy omits ------------------------------------------------------------ */

static void test_omitted(void)
{
    /* nothing returned on the first step: the safe default */
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "return nil"), NULL, NULL);
    const rp_plan *plan = NULL;
    const rp_step_report *rep = step(s, 0, &plan);
    rp_plan *dflt = baseline(0, "attn_kk+contiguous");
    ok(rep && !rep->fallback && dflt && same_packing(plan, dflt) && same_placement(plan, dflt),
       "a policy returning nil gets the safe default (attn_kk packing, contiguous placement)");
    rp_plan_free(dflt);
    rp_sched_free(s);

    /* placement only: the packing is the safe default's */
    s = gen_steps_sched(&fx, "eplb", NULL, NULL);
    rep = step(s, 0, &plan);
    dflt = baseline(0, "attn_kk+eplb");
    ok(rep && dflt && same_packing(plan, dflt), "a placement-only policy keeps the safe default packing");
    ok(rep && dflt && same_placement(plan, dflt), "and its placement is EPLB's, as rp_baseline makes it");
    rp_plan_free(dflt);
    rp_sched_free(s);

    /* packing only after an EPLB placement: the placement survives untouched */
    s = gen_steps_sched(&fx, "eplb", NULL, NULL);
    rep = step(s, 0, &plan);
    rp_plan *first = NULL;
    if (plan) rp_plan_copy(plan, &first, NULL);
    rp_error err;
    ok(rp_sched_stage_policy(s, "token_kk", NULL, 1, &err) == RP_OK, "stage token_kk for step 1");
    rep = step(s, 1, &plan);
    dflt = baseline(1, "token_kk+contiguous");
    ok(rep && rep->swapped && first && same_placement(plan, first) && rep->experts_moved == 0 &&
           rep->migration_bytes == 0,
       "a packing-only policy keeps the placement in use (nothing migrates)");
    ok(rep && dflt && same_packing(plan, dflt), "and packs as token_kk does");
    rp_plan_free(dflt);
    rp_plan_free(first);
    rp_sched_free(s);

    /* ctx.plan is what runs when nothing is returned */
    s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local p = ctx.plan\n"
                         "assert(p:has_packing() and p:has_placement())\n"
                         "return {packing = p:packing()}"), NULL,
             NULL);
    rep = step(s, 0, &plan);
    dflt = baseline(0, "attn_kk+contiguous");
    ok(rep && !rep->fallback && dflt && same_packing(plan, dflt), "ctx.plan holds the safe default packing");
    rp_plan_free(dflt);
    rp_sched_free(s);

    /* a pair: the placement policy sees the packing policy's packing in ctx.plan */
    s = gen_steps_sched(&fx, "token_kk+eplb", NULL, NULL);
    rep = step(s, 0, &plan);
    rp_plan *tk = baseline(0, "token_kk+eplb");
    ok(rep && tk && same_packing(plan, tk) && same_placement(plan, tk),
       "token_kk+eplb gives what rp_baseline(\"token_kk+eplb\") gives");
    rp_plan_free(tk);
    rp_sched_free(s);

    /* levers without a packing go with ctx.plan's microbatches */
    s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local M = ctx.plan:num_microbatches()\n"
                         "local e = ctx.plan:experts(0, 0)[1]\n"
                         "return {shares = {{microbatch = M - 1, layer = 0, expert = e, shares = {1}}}}"), NULL,
             NULL);
    rep = step(s, 0, &plan);
    ok(rep && !rep->fallback && rp_plan_num_share_sets(plan) == 1, "levers given without a packing are kept");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);
    rp_sched_free(s);
}

/* ---- hostile policies --------------------------------------------------------------- */

/* Good at step 0 (an EPLB placement), hostile from step 1 on. */
static void hostile(const char *what, const char *body, const char *expect)
{
    char src[8192];
    snprintf(src, sizeof src, "if ctx.step == 0 then return rp.baseline('attn_kk+eplb') end\n%s", body);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_instructions = 5000000;
    o.max_memory_bytes = (size_t)32 << 20;
    o.max_depth = 200;
    o.max_wall_s = 30;
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, src), NULL, &o);
    const rp_plan *plan = NULL;
    rp_plan *good = NULL;
    const rp_step_report *rep = step(s, 0, &plan);
    if (rep && !rep->fallback) rp_plan_copy(plan, &good, NULL);
    else diag("step 0 fell back: %s", rep ? rep->fallback_reason : "(no report)");
    rep = step(s, 1, &plan);
    bool pass = rep && rep->fallback && strstr(rep->fallback_reason, expect);
    if (!tap_ok_at(pass, __FILE__, __LINE__, "hostile policy (%s) falls back with a clear reason", what))
        printf("#          got: '%s'\n#  to contain: '%s'\n", rep ? rep->fallback_reason : "(step failed)", expect);
    ok(rep && good && same_placement(plan, good) && rp_plan_validate(plan, cfg, batches[1], NULL) == RP_OK &&
           rep->experts_moved == 0,
       "hostile policy (%s): the last good placement survives in a valid plan", what);
    /* and the scheduler goes on */
    rep = step(s, 2, &plan);
    ok(rep && rep->fallback && rp_plan_validate(plan, cfg, batches[2], NULL) == RP_OK,
       "hostile policy (%s): the next step still gets a valid plan", what);
    rp_plan_free(good);
    rp_sched_free(s);
}

static void test_hostile(void)
{
    hostile("error", "error('boom: no plan today')", "policy 'probe' failed: policy");
    hostile("error message", "error('boom: no plan today')", "boom: no plan today");
    hostile("while true", "while true do end", "policy 'probe' stopped: policy exceeded the instruction limit (5000000)");
    hostile("numeric for", "for i = 1, 1e12 do end", "exceeded the instruction limit");
    hostile("loop in pcall", "pcall(function() while true do end end) return nil", "exceeded the instruction limit");
    hostile("allocation bomb", "local t = {} for i = 1, 1e9 do t[i] = {i, i, i, i} end", "exceeded the memory limit of 32 MiB");
    hostile("string bomb", "local s = 'x' while true do s = s .. s end", "exceeded the object size limit of 8 MiB");
    hostile("plan copies", "local keep = {} local p = ctx.plan for i = 1, 1e6 do keep[i] = p:copy() end",
            "exceeded the memory limit");
    hostile("string past LuaJIT's largest", "return #string.rep('xx', 2^30)",
            "policy 'probe' stopped: policy exceeded the memory limit of 32 MiB");
    hostile("deep recursion", "local function f(n) return 1 + f(n + 1) end return f(1)",
            "exceeded the call depth limit of 200");
    hostile("huge return value",
            "local big = {} for i = 1, 200000 do big[i] = 0 end\n"
            "local p = ctx.plan:packing() p[1][1] = big return {packing = p}",
            "plan.packing lists more than 64 sequence ids, but the batch has 64 sequences");
    hostile("a number", "return 42", "returned an invalid plan: plan must be a table in the plan shape or a plan userdata, got number");
    hostile("wrong type", "return {packing = 'all of them'}", "plan.packing must be a table");
    hostile("wrong element type", "local p = ctx.plan:packing() p[1][1][1] = 'seven' return {packing = p}",
            "plan.packing[1][1][1] must be a sequence id, got string");
    hostile("fractional id", "local p = ctx.plan:packing() p[1][1][1] = 1.5 return {packing = p}",
            "plan.packing[1][1][1]: sequence id 1.5 is not an integer");
    hostile("ids out of range", "local p = ctx.plan:packing() p[3][1][1] = 9000 return {packing = p}",
            "plan.packing[3][1][1]: sequence id 9000 out of range (64 sequences)");
    hostile("expert out of range", "local pl = ctx.plan:placement() pl[2][1][1] = 64 return {placement = pl}",
            "plan.placement[2][1][1]: expert id 64 out of range (64 experts; -1 marks an empty slot)");
    hostile("too few ranks", "local p = ctx.plan:packing() p[8] = nil return {packing = p}",
            "plan.packing has 7 ranks, but the config has 8 GPUs");
    /* each path below is written only when its error is raised (lua_plan.c) */
    hostile("a rank not a table", "local p = ctx.plan:packing() p[2] = 7 return {packing = p}",
            "plan.packing[2] must be a table (the microbatches of one rank), got number");
    hostile("a rank's microbatches", "local p = ctx.plan:packing() p[3][#p[3] + 1] = {} return {packing = p}",
            "plan.packing[3] has 2 microbatches, but rank 0 has 1 (every rank runs the same number)");
    hostile("a microbatch not a table", "local p = ctx.plan:packing() p[4][1] = true return {packing = p}",
            "plan.packing[4][1] must be a table (a list of sequence ids), got boolean");
    hostile("a layer not a table", "local pl = ctx.plan:placement() pl[3] = 'x' return {placement = pl}",
            "plan.placement[3] must be a table (one list per EP rank), got string");
    hostile("a layer's EP ranks", "local pl = ctx.plan:placement() pl[2][#pl[2]] = nil return {placement = pl}",
            "plan.placement[2] has 7 EP ranks, but ep_size is 8");
    hostile("an EP rank not a table", "local pl = ctx.plan:placement() pl[1][2] = 5 return {placement = pl}",
            "plan.placement[1][2] must be a table (the experts in the rank's slots), got number");
    hostile("an EP rank's slots", "local pl = ctx.plan:placement() for i = 1, 40 do pl[2][3][i] = -1 end "
            "return {placement = pl}", "plan.placement[2][3] has 40 experts, but EP rank 2 has");
    hostile("an expert id", "local pl = ctx.plan:placement() pl[1][4][2] = 'e' return {placement = pl}",
            "plan.placement[1][4][2] must be an expert id (or -1 for an empty slot), got string");
    hostile("unknown key", "return {packin = {}}", "plan: unknown key 'packin' (did you mean 'packing'?)");
    /* a swap of neighbours is one edit, as for config keys: two swaps still suggest */
    hostile("unknown key, two letters swapped twice", "return {apckign = {}}",
            "plan: unknown key 'apckign' (did you mean 'packing'?)");
    hostile("sequence missing", "local p = ctx.plan:packing() table.remove(p[1][1]) return {packing = p}",
            "returned an invalid plan: plan: sequence");
    hostile("expert without replica",
            "local pl = ctx.plan:placement() for l = 1, #pl do for j = 1, #pl[l] do for k = 1, #pl[l][j] do\n"
            "  if pl[l][j][k] == 5 then pl[l][j][k] = -1 end end end end return {placement = pl}",
            "expert 5 has no replica");
    hostile("wrong shape key", "return {num_gpus = 4}", "plan.num_gpus is 4, but the config has 8 GPUs");
}

static void test_stale_view(void)
{
    /* a view kept in a global is dead in the next call */
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "if ctx.step == 0 then kept = ctx.batch.seq_len return nil end\n"
                                   "local x = kept[0]\nreturn nil"), NULL,
                       NULL);
    const rp_step_report *rep = step(s, 0, NULL);
    ok(rep && !rep->fallback, "a view can be kept in a global");
    rep = step(s, 1, NULL);
    ok(rep && rep->fallback && strstr(rep->fallback_reason, "ctx.batch.seq_len belongs to an earlier call"),
       "reading it in a later call is an error naming it");
    rp_sched_free(s);
    /* ctx.state is kept after every call as a checkpoint holds it: a view there fails
     * the step that put it there */
    s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "ctx.state.v = ctx.batch.seq_len return nil"), NULL, NULL);
    rep = step(s, 0, NULL);
    ok(rep && rep->fallback && strstr(rep->fallback_reason, "ctx.state cannot be kept after the call: ctx.state.v is "
                                                             "userdata"),
       "a view kept in ctx.state fails its step, naming it: %s", rep ? rep->fallback_reason : "");
    rp_sched_free(s);
}

/* ---- determinism --------------------------------------------------------------------- */

static void hashes(const char *policy, uint64_t *out, int n)
{
    rp_sched *s = gen_steps_sched(&fx, policy, NULL, NULL);
    for (int t = 0; t < n; t++) {
        const rp_step_report *rep = step(s, t, NULL);
        out[t] = rep ? rep->plan_hash : 0;
    }
    rp_sched_free(s);
}

typedef struct thread_job {
    const char *policy;
    uint64_t hash[STEPS];
} thread_job;

static void *thread_main(void *arg)
{
    thread_job *j = arg;
    hashes(j->policy, j->hash, STEPS);
    return NULL;
}

static void test_determinism(void)
{
    const char *random_policy = gen_steps_body_policy(&fx, "local p = ctx.plan:packing()\n"
                                            "local a, b = math.random(8), math.random(8)\n"
                                            "local s = table.remove(p[a][1]) if s then table.insert(p[b][1], s) end\n"
                                            "return {packing = p}");
    uint64_t a[STEPS], b[STEPS];
    hashes("routepack", a, 2);
    hashes("routepack", b, 2);
    a[2] = a[3] = b[2] = b[3] = 0;
    ok(memcmp(a, b, sizeof a) == 0 && a[0] != 0, "routepack: two schedulers give the same plans");
    hashes(random_policy, a, STEPS);
    hashes(random_policy, b, STEPS);
    ok(memcmp(a, b, sizeof a) == 0 && a[0] != 0, "a policy using math.random: the same plans in two schedulers");

    thread_job jobs[2] = {{"token_kk+eplb", {0}}, {random_policy, {0}}};
    uint64_t seq[2][STEPS];
    hashes(jobs[0].policy, seq[0], STEPS);
    hashes(jobs[1].policy, seq[1], STEPS);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thread_main, &jobs[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    ok(memcmp(jobs[0].hash, seq[0], sizeof seq[0]) == 0 && memcmp(jobs[1].hash, seq[1], sizeof seq[1]) == 0,
       "two schedulers on two threads at once give the same plans as run one after the other");

    /* the seed differs between steps but not between runs */
    const char *seed_policy = gen_steps_body_policy(&fx, "error(string.format('seed=%.0f r=%.17g', ctx.seed, math.random()))");
    rp_sched *s1 = gen_steps_sched(&fx, seed_policy, NULL, NULL), *s2 = gen_steps_sched(&fx, seed_policy, NULL, NULL);
    const rp_step_report *r1 = step(s1, 0, NULL);
    char first[RP_ERROR_TEXT];
    snprintf(first, sizeof first, "%s", r1 ? r1->fallback_reason : "");
    const rp_step_report *r2 = step(s2, 0, NULL);
    ok(r2 && strcmp(first, r2->fallback_reason) == 0 && strstr(first, "seed="), "ctx.seed and math.random repeat for a step");
    r1 = step(s1, 1, NULL);
    ok(r1 && strcmp(first, r1->fallback_reason) != 0, "and differ from one step to the next");
    rp_sched_free(s1);
    rp_sched_free(s2);
}

/* ---- hot swap --------------------------------------------------------------------------- */

static void test_swap(void)
{
    rp_error err;
    rp_sched *s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
    ok(rp_sched_stage_policy(s, "attn_kk", NULL, 2, &err) == RP_OK, "stage attn_kk for step 2");
    const rp_step_report *rep = step(s, 0, NULL);
    uint64_t before = rep ? rep->policy_hash : 0;
    ok(rep && !rep->swapped && strcmp(rep->policy_name, "token_kk") == 0, "step 0 still runs token_kk");
    rep = step(s, 1, NULL);
    ok(rep && !rep->swapped && strcmp(rep->policy_name, "token_kk") == 0, "step 1 still runs token_kk");
    rep = step(s, 2, NULL);
    ok(rep && rep->swapped && !rep->fallback && strcmp(rep->policy_name, "attn_kk") == 0 &&
           rep->policy_hash != before && !rep->swap_error[0],
       "the swap takes effect at step 2, the report names the new policy and its hash");
    rep = step(s, 3, NULL);
    ok(rep && !rep->swapped && strcmp(rep->policy_name, "attn_kk") == 0, "and stays");

    /* staging failures are reported at once */
    rp_status st = rp_sched_stage_policy(s, "broken.lua", "return {name = 'x',, }", -1, &err);
    ok(st == RP_EPOLICY && strstr(err.text, "broken.lua:1:") && strstr(rp_sched_errmsg(s), "broken.lua:1:"),
       "a syntax error is refused at stage time, also in rp_sched_errmsg");
    st = rp_sched_stage_policy(s, NULL, "return {name = 'x', version = '1', api = 1, description = 'd', plan = print}", -1,
                               &err);
    ok(st == RP_EPOLICY && strstr(err.text, "'version' must be a string like"), "a metadata error is refused at stage time");
    st = rp_sched_stage_policy(s, "no_such_policy", NULL, -1, &err);
    ok(st == RP_EIO, "an unknown policy name is refused at stage time");
    ok(rp_sched_stage_policy(s, "x", NULL, -5, &err) == RP_EINVAL, "a step below -1 is refused");
    rep = step(s, 4, NULL);
    ok(rep && !rep->swapped && !rep->swap_error[0] && strcmp(rep->policy_name, "attn_kk") == 0,
       "refused stagings leave the running policy alone");

    /* a runtime failure in the dry run keeps the running policy */
    const char *bad = "return {name = 'flaky', version = '1.0.0', api = 1, description = 'fails on a batch',\n"
                      "plan = function(ctx) error('cannot plan this batch') end}";
    ok(rp_sched_stage_policy(s, "flaky.lua", bad, -1, &err) == RP_OK, "a policy that fails at run time stages");
    rep = step(s, 5, NULL);
    ok(rep && !rep->swapped && !rep->fallback && strcmp(rep->policy_name, "attn_kk") == 0 &&
           strstr(rep->swap_error, "the dry run of policy 'flaky' failed") &&
           strstr(rep->swap_error, "cannot plan this batch"),
       "its dry run fails: the running policy stays and swap_error says why");
    rep = step(s, 6, NULL);
    ok(rep && !rep->swapped && !rep->swap_error[0], "the refused policy is dropped");

    /* an invalid plan in the dry run also refuses */
    const char *invalid = "return {name = 'holes', version = '1.0.0', api = 1, description = 'loses a sequence',\n"
                          "plan = function(ctx) local p = ctx.plan:packing() table.remove(p[1][1]) return {packing = p} end}";
    ok(rp_sched_stage_policy(s, NULL, invalid, -1, &err) == RP_OK, "a policy returning invalid plans stages");
    rep = step(s, 7, NULL);
    ok(rep && !rep->swapped && strstr(rep->swap_error, "returned an invalid plan"), "its dry run's plan fails validation");

    /* a staged policy whose dry run runs out of memory inside LuaJIT (no allocation
     * asked: this failed the step, and every later one) is dropped like any other */
    const char *oom = "return {name = 'oom', version = '1.0.0', api = 1, description = 'asks for 2 GiB',\n"
                      "plan = function(ctx) return #string.rep('xx', 2^30) end}";
    ok(rp_sched_stage_policy(s, "oom.lua", oom, -1, &err) == RP_OK, "a policy that asks LuaJIT for 2 GiB stages");
    rep = step(s, 7, NULL);
    ok(rep && !rep->swapped && !rep->fallback && strcmp(rep->policy_name, "attn_kk") == 0 &&
           strstr(rep->swap_error, "the dry run of policy 'oom' failed") && strstr(rep->swap_error, "memory limit"),
       "its dry run fails: the step runs the healthy policy and swap_error says why");
    if (rep) diag("%s", rep->swap_error);
    rep = step(s, 7, NULL);
    ok(rep && !rep->swapped && !rep->fallback && !rep->swap_error[0], "it is dropped: the next step is clean");

    /* the dry run's effects on ctx.state are dropped, init runs again */
    const char *counting = "return {name = 'counting', version = '1.0.0', api = 1, description = 'counts calls',\n"
                           "init = function(ctx) ctx.state.calls = 0 end,\n"
                           "plan = function(ctx) ctx.state.calls = ctx.state.calls + 1\n"
                           "  if ctx.state.calls ~= 1 and ctx.step == 8 then error('state carried over: ' .. ctx.state.calls) end end}";
    ok(rp_sched_stage_policy(s, NULL, counting, 8, &err) == RP_OK, "stage a policy with state");
    rep = step(s, 8, NULL);
    ok(rep && rep->swapped && !rep->fallback, "after its dry run it starts from a fresh state");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);
    rp_sched_free(s);

    /* staged before any step: dry-run on the step's own inputs */
    s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
    ok(rp_sched_stage_policy(s, "eplb", NULL, -1, &err) == RP_OK, "stage before the first step");
    rep = step(s, 0, NULL);
    ok(rep && rep->swapped && strcmp(rep->policy_name, "eplb") == 0, "it swaps in at the first step");
    rp_sched_free(s);

    /* an edited policy of the same name keeps its params */
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.params_json = "{\"k\": 5}";
    const char *v1 = gen_steps_policy_file(&fx, "return {name = 'tuned', version = '1.0.0', api = 1, description = 'd',\n"
                                 "params = {k = {type = 'integer', default = 1, doc = 'k'}},\n"
                                 "plan = function(ctx) if ctx.params.k ~= 5 then error('k=' .. ctx.params.k) end end}");
    s = gen_steps_sched(&fx, v1, NULL, &o);
    ok(s != NULL, "a policy with config params");
    rep = step(s, 0, NULL);
    ok(rep && !rep->fallback, "runs with them");
    ok(rp_sched_stage_policy(s, "tuned.lua",
                             "return {name = 'tuned', version = '1.1.0', api = 1, description = 'd',\n"
                             "params = {k = {type = 'integer', default = 2, doc = 'k'}},\n"
                             "plan = function(ctx) if ctx.params.k ~= 5 then error('k=' .. ctx.params.k) end end}",
                             -1, &err) == RP_OK,
       "stage its edited version");
    rep = step(s, 1, NULL);
    ok(rep && rep->swapped && !rep->fallback && strcmp(rep->policy_version, "1.1.0") == 0,
       "the edited version runs with the same params");
    rp_sched_free(s);
}

/* ---- what a policy can and cannot touch --------------------------------------------------- */

/* Run body as a policy at step 1 (after a step 0 that returned nil); "" when it ran
 * without error, else the reason. */
static char probe_out[RP_ERROR_TEXT];
static const char *probe(const char *body)
{
    char src[8192];
    snprintf(src, sizeof src, "if ctx.step == 0 then return nil end\n%s\nreturn nil", body);
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, src), NULL, NULL);
    step(s, 0, NULL);
    const rp_step_report *rep = step(s, 1, NULL);
    snprintf(probe_out, sizeof probe_out, "%s", !rep ? "(step failed)" : rep->fallback ? rep->fallback_reason : "");
    rp_sched_free(s);
    return probe_out;
}

static void test_views(void)
{
    is_str(probe("assert(ctx.batch.num_seqs == 64 and #ctx.batch.seq_len == 64)\n"
                 "assert(ctx.batch.seq_len[0] == ctx.batch.prompt_len[0] + ctx.batch.response_len[0])\n"
                 "assert(ctx.batch.seq_len[64] == nil and ctx.batch.seq_len[-1] == nil and ctx.batch.seq_len[0.5] == nil)\n"
                 "assert(ctx.topology.num_gpus == 8 and ctx.topology.ep_size == 8 and #ctx.topology.slots == 8)\n"
                 "assert(ctx.topology.slot_begin[8] == 80 and ctx.topology.node[7] == 0 and ctx.topology.speed[0] == 1)\n"
                 "assert(ctx.topology.pipeline_parallel_size == 1 and ctx.topology.virtual_pipeline_size == 1)\n"
                 "assert(#ctx.topology.stage_of_layer == 16 and ctx.topology.stage_of_layer[16] == 0)\n"
                 "assert(ctx.model.num_layers == 16 and ctx.model.num_experts == 64 and ctx.model.top_k == 8)\n"
                 "assert(ctx.model.bytes_per_grad == 4 and ctx.model.dense_params == 16 * (2048 * 128 * 64 + 2048 * 64))\n"
                 "assert(ctx.limits.max_tokens_per_microbatch == 16384 and ctx.limits.num_microbatches == 0)\n"
                 "assert(ctx.trainer.per_forward_balancer == true and ctx.trainer.equal_sequences_per_rank == false)\n"
                 "assert(ctx.trainer.nonempty_microbatches == false and ctx.trainer.microbatch_multiple == 1)\n"
                 "assert(ctx.trainer.mini_batches == 1 and ctx.trainer.epochs == 1)\n"
                 "assert(ctx.trainer.no_such_key == nil)\n"
                 "local load = ctx.stats.expert_load(3)\n"
                 "assert(#load == 64 and load:sum() == ctx.batch.num_tokens * 8)\n"
                 "local h = ctx.stats.seq_hist(5, 3)\n"
                 "local c = 0 for e = 0, 63 do c = c + h[e] end\n"
                 "assert(c == ctx.batch.seq_len[5] * 8 and ctx.stats.seq_count(5, 3, 7) == h[7])\n"
                 "assert(#ctx.history == 1 and ctx.history[1].step == 0 and ctx.history[2] == nil)\n"
                 "assert(ctx.history[1].expert_load(0):sum() > 0)\n"
                 "assert(ctx.placement.total_slots == 80 and #ctx.placement.phy2log(0) == 80)\n"
                 "assert(ctx.placement.logcnt(0)[0] == 1 and #ctx.placement.experts(0, 0) == 8)\n"
                 "assert(ctx.cost.attention(1000) > ctx.cost.attention(100) and ctx.cost.expert(64) > 0)\n"
                 "assert(ctx.cost.expert_move(false) > ctx.cost.expert_move(true))\n"
                 "local n = 0 for i, v in pairs(ctx.batch.seq_len) do assert(v == ctx.batch.seq_len[i]) n = n + 1 end\n"
                 "assert(n == 64)\n"
                 "assert(load:argmax() >= 0 and load:max() >= load:min() and #load:totable() == 64)\n"
                 "assert(ctx.step == 1 and type(ctx.seed) == 'number')"),
           "", "ctx views give the batch, topology, model, limits, trainer, statistics, history, placement and cost");
    like(probe("ctx.trainer.per_forward_balancer = false"), "ctx.trainer is read-only", "the trainer view cannot be written");
    like(probe("ctx.batch.seq_len[0] = 5"), "ctx.batch.seq_len is read-only", "a view cannot be written");
    like(probe("ctx.batch.num_seqs = 1"), "ctx.batch is read-only", "a view object cannot be written");
    like(probe("ctx.topology.slots[0] = 99"), "ctx.topology.slots is read-only", "config views cannot be written");
    like(probe("rawset(ctx.batch, 'x', 1)"), "bad argument #1 to 'rawset' (table expected, got userdata)",
         "rawset does not reach a view");
    is_str(probe("assert(getmetatable(ctx.batch) == 'routepack view' and getmetatable(ctx.batch.seq_len) == 'routepack view')\n"
                 "assert(not pcall(setmetatable, ctx.batch, {}))\n"
                 "assert(tostring(ctx.batch.seq_len) == 'view ctx.batch.seq_len [64]')"),
           "", "a view's metatable is hidden and cannot be replaced; tostring shows no address");
    like(probe("ctx.stats.expert_load(16)"), "ctx.stats.expert_load: layer must be within 0..15, got 16",
         "a layer out of range is an error naming it");
    like(probe("ctx.stats.seq_hist(64, 0)"), "sequence must be within 0..63", "a sequence out of range is an error");
    /* the iterator of pairs(view) called with any key: no index arithmetic overflows
     * (2^31 - 1 + 1 aborted the sanitized build) and no key wraps into the range */
    is_str(probe("local f, v = pairs(ctx.batch.seq_len)\n"
                 "for _, k in ipairs({2^31 - 1, 2^31, 2^32, 2^32 + 1, 2^53, 2^63, 1e300, -2^31, -2^31 - 1, -2, -1e300,\n"
                 "                    1 / 0, -1 / 0, 0 / 0, 63, 64, 0.5, -0.5}) do\n"
                 "  local i, x = f(v, k)\n"
                 "  assert(i == nil and x == nil, 'key ' .. tostring(k) .. ' gave ' .. tostring(i))\n"
                 "end\n"
                 "local i, x = f(v, -1) assert(i == 0 and x == ctx.batch.seq_len[0])\n"
                 "i = f(v, 62) assert(i == 63)\n"
                 "assert(not pcall(f, v, 'x'))"),
           "", "the view iterator answers nil for every key past the end, huge, negative or not an integer");
    is_str(probe("ctx.params.x = 1 ctx.topology = nil ctx.state.n = (ctx.state.n or 0) + 1"), "",
           "the ctx table itself is the policy's to scribble on");
}

static void test_plan_userdata(void)
{
    is_str(probe("local p = ctx.plan\n"
                 "assert(getmetatable(p) == 'routepack plan')\n"
                 "assert(p.__gc == nil and p.__index == nil and p[1] == nil)\n"
                 "assert(not pcall(function() p.copy = 1 end))\n"
                 "assert(not pcall(rawget, p, 'copy') and not pcall(setmetatable, p, {}))\n"
                 "assert(not pcall(p.copy, ctx.batch) and not pcall(p.copy, {}))\n"
                 "assert(tostring(p):match('^plan %(8 GPUs x %d+ microbatches; packing of 64 sequences; placement%)$'))\n"
                 "local q = p:copy() q:move(0, 7, 0)\n"
                 "assert(q:seq_rank(0) == 7 and p:hash() ~= q:hash() and #p:hash() == 16)\n"
                 "assert(rp.validate(q))\n"
                 "local e = rp.evaluate(q)\n"
                 "assert(e.step_s > 0 and e.ratio >= 1 and type(e.straggler_side) == 'string')\n"
                 "local pl = q:placement()\n"
                 "assert(#pl == 16 and #pl[1] == 8 and #pl[1][1] == 10)\n"
                 "q:set_gpu_experts(0, 0, {0, 1, 2, 3, 4, 5, 6, 7})\n"
                 "local ok, msg = rp.validate(q)\n"
                 "q:set({placement = p:placement()})\n"
                 "assert(rp.validate(q) and q:seq_rank(0) == 7)\n"
                 "local r = rp.plan({packing = q:packing()})\n"
                 "assert(r:has_packing() and not r:has_placement())\n"
                 "assert(not pcall(rp.evaluate, r))"),
           "", "plan userdata: methods work, internals are out of reach, no address in tostring");
    like(probe("local q = ctx.plan q:move(64, 0, 0)"), "plan:move: sequence must be within 0..63, got 64",
         "plan methods check their arguments");
    like(probe("rp.plan({packing = {}, num_seqs = 10})"), "plan.num_seqs is 10, but the batch has 64 sequences",
         "rp.plan checks the shape against the batch");
}

static void test_rp_api(void)
{
    is_str(probe("local parts = rp.kk({5, 4, 3, 2, 1, 1}, 2)\n"
                 "assert(#parts == 2)\n"
                 "local sum = {0, 0} for p = 1, 2 do for _, i in ipairs(parts[p]) do sum[p] = sum[p] + ({5, 4, 3, 2, 1, 1})[i + 1] end end\n"
                 "assert(sum[1] == 8 and sum[2] == 8)\n"
                 "local eq = rp.kk({1, 2, 3, 4}, 2, {equal_size = true}) assert(#eq[1] == 2 and #eq[2] == 2)\n"
                 "local l = rp.lpt({3, 3, 2, 2, 2}, 2) assert(#l[1] + #l[2] == 5)\n"
                 "local c = rp.lpt({5, 5, 5}, 3, {sizes = {1, 1, 1}, cap = 1}) assert(#c[1] == 1 and #c[3] == 1)\n"
                 "local t, obj = rp.partition2({4, 1, 1, 4}, {1, 4, 4, 1}, 2) assert(obj >= 1 and #t == 2)\n"
                 "local o = rp.argsort({3, 1, 2}) assert(o[1] == 1 and o[2] == 2 and o[3] == 0)\n"
                 "local d = rp.argsort({3, 1, 2}, true) assert(d[1] == 0 and d[3] == 1)\n"
                 "local k = rp.topk(ctx.batch.seq_len, 3) assert(#k == 3 and ctx.batch.seq_len[k[1]] == ctx.batch.max_seq_len)\n"
                 "local r = rp.replicas({10, 1, 1}, 5) assert(r[1] == 3 and r[2] == 1 and r[3] == 1)\n"
                 "local ranks, used = rp.place(ctx.stats.expert_load(0), nil, {mode = 'global'})\n"
                 "assert(#ranks == 8 and #used == 64)\n"
                 "local b = rp.baseline('token_kk+eplb') assert(rp.validate(b))\n"
                 "local better, res = rp.local_search(b, {evaluations = 200})\n"
                 "assert(res.final_s <= res.initial_s and rp.validate(better))\n"
                 "local s, bytes, moved = rp.migration(b) assert(s >= 0 and bytes >= 0 and moved >= 0)\n"
                 "assert(rp.api == 1 and type(rp.version) == 'string')"),
           "", "the rp primitives work from Lua");
    like(probe("rp.kk({1, 2}, 0)"), "rp.kk: k must be within 1..65536, got 0", "rp.kk checks k");
    like(probe("rp.kk({1, 'x'}, 2)"), "rp.kk: weights[2] must be a number, got string", "rp.kk checks each weight");
    like(probe("rp.kk({1, 2}, 2, {equalsize = true})"), "rp.kk: unknown option 'equalsize' (options: equal_size",
         "an unknown option is named");
    like(probe("rp.lpt({1, -2}, 2)"), "rp.lpt: lpt: item 1 has weight -2", "a primitive's own error reaches the policy");
    like(probe("rp.lpt({5}, 1, {sizes = {9}, cap = 4})"), "rp.lpt:", "an item over every cap is an error");
    like(probe("rp.partition2({1}, {1, 2}, 2)"), "w1 has 1 entries but w2 has 2", "rp.partition2 checks lengths");
    like(probe("local w = {} for i = 1, 20000 do w[i] = 1 end rp.partition2(w, w, 8, {rounds = 1000})"),
         "rp.partition2: 1000 rounds on 20000 items and 8 parts could take", "rp.partition2 bounds its worst case");
    like(probe("rp.place({1, 2}, {1, 9})"), "rp.place: counts[2] must be an integer within 1..8, got 9",
         "rp.place checks replica counts");
    like(probe("rp.baseline('nope+eplb')"), "rp.baseline: baseline: unknown baseline 'nope+eplb'",
         "rp.baseline names an unknown baseline");
    like(probe("rp.evaluate(5)"), "rp.evaluate: expected a plan", "rp.evaluate wants a plan");
    is_str(probe("local p, rep = rp.joint({fallbacks = {}})\n"
                 "assert(rp.validate(p) and rep.chosen == 'joint' and rep.num_microbatches >= 1)\n"
                 "local q, r = rp.joint({expected_loads = (function() local t = {} for i = 1, 1024 do t[i] = 1 end return t end)()})\n"
                 "assert(rp.validate(q) and r.step_s > 0)\n"
                 "assert(r.step_s <= r.joint_step_s and r.step_s <= r.best_fallback_step_s)\n"
                 "assert(rp.evaluate(q).step_s == r.step_s)"),
           "", "rp.joint plans from Lua, never worse than its candidate or the fallbacks");
    is_str(probe("assert(ctx.placement.per_forward_balancing == 'none')\n"
                 "local p, r = rp.joint({fallbacks = {}, virtual_experts = true, recurring_migration_s = 1000})\n"
                 "assert(r.per_forward_balancing == true and r.chosen == 'joint', 'not the balancer')\n"
                 "assert(r.virtual_experts_step_s == r.step_s and rp.evaluate(p).step_s == r.step_s)\n"
                 "local q, s = rp.joint({fallbacks = {}, relabel = false})\n"
                 "assert(s.per_forward_balancing == false and s.virtual_experts_step_s ~= s.virtual_experts_step_s)"),
           "", "rp.joint: the balancer's candidate from Lua, reported as such");
    like(probe("rp.joint({virtual_experts = 1})"), "rp.joint: opts.virtual_experts must be a boolean, got number",
         "rp.joint checks virtual_experts");
    like(probe("rp.joint({recurring_migration_s = -2})"), "rp.joint: joint: recurring_migration_s = -2, must be",
         "rp.joint checks recurring_migration_s");
    like(probe("rp.joint({horizon = 0})"), "rp.joint: joint: horizon_steps = 0, must be > 0", "rp.joint checks its params");
    like(probe("rp.joint({expected_loads = {1, 2}})"),
         "rp.joint: opts.expected_loads has 2 entries, must have num_layers x num_experts = 1024",
         "rp.joint checks the expected loads' shape");
    like(probe("rp.joint({fallbacks = {'nope'}})"), "unknown fallback baseline 'nope'", "rp.joint names a bad fallback");
    like(probe("rp.joint({horizon_steps = 3})"), "rp.joint: unknown option 'horizon_steps'", "rp.joint names an unknown option");
    like(probe("rp.log('hello', 1, true, {})"), "rp.log: argument 4 is a table", "rp.log takes plain values only");
    like(probe("local t = {} for i = 1, 300000 do t[i] = i end rp.kk(t, 65536)"),
         "policy exceeded the instruction limit (200000000)",
         "a primitive whose work exceeds the budget is stopped before it runs");
}

/* ---- out of memory inside a policy call ------------------------------------------------- */

/* The context's allocator refuses every block of 4 MiB or more: a policy asking for a
 * 5 MiB string (well under its 256 MiB and 8 MiB caps) finds the process out of memory. */
static void *small_blocks_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    (void)ud;
    (void)old_size;
    if (new_size == 0) {
        free(ptr);
        return NULL;
    }
    if (new_size >= (size_t)4 << 20) return NULL;
    return realloc(ptr, new_size);
}

static void test_policy_out_of_memory(void)
{
    rp_context *small = NULL;
    rp_context_new(small_blocks_alloc, NULL, &small);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = gen_steps_body_policy(&fx, "if ctx.step == 0 then return nil end\nlocal s = string.rep('x', 5 * 2^20) return nil");
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    rp_status st = rp_sched_new(small, cfg, &o, &s, &err);
    ok(st == RP_OK, "a scheduler on an allocator that refuses big blocks");
    const rp_plan *plan = NULL;
    const rp_step_report *rep = NULL;
    st = s ? rp_sched_step(s, 0, batches[0], &routings[0], &plan, &rep, &err) : RP_EINVAL;
    ok(st == RP_OK && rep && !rep->fallback, "step 0 plans");
    st = s ? rp_sched_step(s, 1, batches[1], &routings[1], &plan, &rep, &err) : RP_EINVAL;
    ok(st == RP_OK && rep && rep->fallback && strstr(rep->fallback_reason, "out of memory") &&
           rp_plan_validate(plan, cfg, batches[1], NULL) == RP_OK,
       "out of memory inside the policy's call is the policy's failure: the step falls back");
    if (st != RP_OK) diag("%s", err.text);
    else if (rep) diag("%s", rep->fallback_reason);
    rp_sched_free(s);
    rp_context_free(small);
}

/* ---- rp.log: bounded and escaped ------------------------------------------------------ */

typedef struct log_capture {
    int records, warnings, with_newline;
    long bytes;
    char first[1100], last_warning[1100];
} log_capture;

static void capture_log(void *ud, rp_log_level level, const char *message)
{
    log_capture *c = ud;
    if (strchr(message, '\n') || strchr(message, '\r')) c->with_newline++;
    if (level == RP_LOG_WARN) {
        c->warnings++;
        snprintf(c->last_warning, sizeof c->last_warning, "%s", message);
        return;
    }
    if (!strstr(message, "policy 'probe'")) return;
    if (c->records++ == 0) snprintf(c->first, sizeof c->first, "%s", message);
    c->bytes += (long)strlen(message);
}

static void test_log_limits(void)
{
    log_capture c;
    memset(&c, 0, sizeof c);
    rp_context_set_log(ctx, capture_log, &c, RP_LOG_INFO);
    is_str(probe("for i = 1, 10000 do rp.log('line', i, '\\nINFO forged by the policy\\r\\0\\\\n' .. string.rep('x', 200)) end"),
           "", "a policy logging 10000 records in a step runs to its end");
    rp_context_set_log(ctx, NULL, NULL, RP_LOG_INFO);
    ok(c.records <= 100 && c.records > 0 && c.bytes <= (64 << 10) + 100 * 32,
       "at most 100 records and 64 KiB of them reach the log in one step (got %d records, %ld bytes)", c.records,
       c.bytes);
    ok(c.warnings == 1 && strstr(c.last_warning, "log records dropped in this call") &&
           strstr(c.last_warning, "policy 'probe': 99"),
       "one warning says how many were dropped");
    if (c.warnings) diag("%s", c.last_warning);
    ok(c.with_newline == 0, "no record carries a newline or carriage return");
    like(c.first, "policy 'probe': line 1 \\nINFO forged by the policy\\r\\x00\\\\n",
         "control characters and backslashes are escaped");

    memset(&c, 0, sizeof c);
    rp_context_set_log(ctx, capture_log, &c, RP_LOG_INFO);
    is_str(probe("rp.log(string.rep('y', 100000))"), "", "one long record");
    rp_context_set_log(ctx, NULL, NULL, RP_LOG_INFO);
    ok(c.records == 1 && strstr(c.first, "yyy [cut]") && c.warnings == 0, "a long record is cut and says so");

    /* the log sink gets valid UTF-8: well-formed characters pass, every other byte is
     * escaped (a stray byte, a truncated sequence, a surrogate, past U+10FFFF, overlong) */
    memset(&c, 0, sizeof c);
    rp_context_set_log(ctx, capture_log, &c, RP_LOG_INFO);
    is_str(probe("rp.log('caf\\xc3\\xa9 \\xe2\\x82\\xac \\xff \\xe2\\x82 \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80 "
                 "\\xc0\\xaf end\\xf0')"),
           "", "a record with invalid UTF-8");
    rp_context_set_log(ctx, NULL, NULL, RP_LOG_INFO);
    is_str(c.first,
           "policy 'probe': caf\xc3\xa9 \xe2\x82\xac \\xff \\xe2\\x82 \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80 "
           "\\xc0\\xaf end\\xf0",
           "bytes that are not UTF-8 are escaped, characters pass");
}

/* The default instruction budget grows with the batch (16 full evaluations of the cost
 * model), so that a policy leaning on C primitives is not stopped on a large batch; an
 * explicit limit is kept as given. */
static void test_instruction_budget(void)
{
    enum { N = 20000, LEN = 8 };
    int32_t *lens = malloc(N * sizeof *lens), *zero = calloc(N + 1, sizeof *zero);
    for (int i = 0; i < N; i++) lens[i] = LEN;
    rp_batch *b = NULL;
    rp_error err;
    rp_batch_new(ctx, N, lens, zero, NULL, &b, &err);
    const rp_model *md = rp_config_model(cfg);
    size_t n_ids = (size_t)N * LEN * md->num_layers * md->top_k;
    uint8_t *big = malloc(n_ids);
    for (size_t i = 0; i < n_ids; i++) big[i] = (uint8_t)((i * 2654435761u >> 7) % (uint32_t)md->num_experts);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, md->num_layers, md->top_k, big);
    /* 16 x (L (N 2 E + M (S + G E + Q (2 ep (E + ep) + 3 ep^2 + 5 E + 9 ep))) + N) on
     * config-small.json: L = 16, E = 64, G = ep = 8, Q = 1, S = 8 x 10 = 80 slots,
     * M = 160000 / (8 x 16384) rounded up = 2, N = 20000:
     * 16 x (16 x (2560000 + 2 x (80 + 512 + 1152 + 192 + 320 + 72)) + 20000)
     * = 16 x (16 x 2564656 + 20000) = 16 x 41054496 = 656871936 */
    const int64_t want = 656871936;
    char text[64];
    snprintf(text, sizeof text, "instruction limit (%lld)", (long long)want);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_wall_s = 120; /* the loop below runs ~2 s, longer under sanitizers */
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "while true do end"), NULL, &o);
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    ok(s && rp_sched_step(s, 0, b, &r, &p, &rep, &err) == RP_OK && rep->fallback, "a runaway policy falls back");
    if (rep) like(rep->fallback_reason, text, "on a large batch the budget is 16 evaluations' work (%lld)", (long long)want);
    rp_sched_free(s);
    o.max_instructions = 1000000;
    s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "while true do end"), NULL, &o);
    rep = NULL;
    ok(s && rp_sched_step(s, 0, b, &r, &p, &rep, &err) == RP_OK, "steps with an explicit limit");
    if (rep) like(rep->fallback_reason, "instruction limit (1000000)", "an explicit limit is kept as given");
    rp_sched_free(s);
    /* the budget's estimate is what rp.evaluate charges a plan of that shape: one formula */
    int64_t M = rp_limits_expected_microbatches(cfg, b), units = -1;
    int32_t *rank = malloc(N * sizeof *rank), *mb = malloc(N * sizeof *mb);
    for (int i = 0; i < N; i++) rank[i] = i % 8, mb[i] = i % (int32_t)M;
    rp_stats *stats = NULL;
    rp_plan *plan = NULL;
    rp_cost *cost = NULL;
    bool made = rp_stats_compute(ctx, b, &r, md->num_experts, 1, &stats, &err) == RP_OK &&
                rp_plan_new(ctx, cfg, (int32_t)M, &plan, &err) == RP_OK &&
                rp_plan_set_packing(plan, N, rank, mb, &err) == RP_OK && rp_plan_set_contiguous(plan, &err) == RP_OK &&
                rp_cost_new(ctx, cfg, b, stats, RP_SPLIT_EVEN, &cost, &err) == RP_OK &&
                rp_cost_evaluation_needs(cost, plan, &units, NULL, &err) == RP_OK;
    if (!made) diag("%s", err.text);
    ok(made && M == 2 && units == want / 16 && cost_evaluation_units(cfg, b) == units,
       "rp.evaluate's units on a plan of the expected %lld microbatches (%lld) are the budget's evaluation (%lld)",
       (long long)M, (long long)units, (long long)(want / 16));
    rp_cost_free(cost);
    rp_plan_free(plan);
    rp_stats_free(stats);
    free(rank);
    free(mb);
    free(big);
    free(lens);
    free(zero);
    rp_batch_free(b);
}

static void test_history(void)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.history = 2;
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local want = math.min(ctx.step, 2)\n"
                                   "if #ctx.history ~= want then error('history ' .. #ctx.history) end\n"
                                   "for i = 1, want do if ctx.history[i].step ~= ctx.step - i then error('order') end end"), NULL,
                       &o);
    bool fine = true;
    for (int t = 0; t < 4; t++) {
        const rp_step_report *rep = step(s, t, NULL);
        if (!rep || rep->fallback) {
            fine = false;
            if (rep) diag("step %d: %s", t, rep->fallback_reason);
        }
    }
    ok(fine, "ctx.history holds the last `history` steps, most recent first");
    rp_sched_free(s);
}

static void test_errors(void)
{
    rp_error err;
    rp_sched *s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
    size_t nids = (size_t)rp_batch_num_tokens(batches[0]) * 16 * 8;
    uint8_t *bad_ids = malloc(nids);
    memcpy(bad_ids, fx.ids[0], nids);
    bad_ids[nids / 2] = 200; /* one expert id out of range */
    rp_routing bad;
    rp_routing_packed(&bad, RP_ID_U8, 16, 8, bad_ids);
    const rp_plan *plan;
    const rp_step_report *rep;
    rp_status st = rp_sched_step(s, 0, batches[0], &bad, &plan, &rep, &err);
    ok(st != RP_OK && strlen(rp_sched_errmsg(s)) > 0 && strcmp(rp_sched_errmsg(s), err.text) == 0,
       "a bad routing view is an error of the step, kept in rp_sched_errmsg");
    ok(rp_sched_plan(s) == NULL, "and changes nothing (no plan yet)");
    like(err.text, "has expert id 200, but the model has 64 experts", "the error names the bad id");
    free(bad_ids);
    rep = step(s, 0, &plan);
    ok(rep && plan == rp_sched_plan(s) && rp_sched_errmsg(s)[0] == '\0', "the scheduler is usable afterwards");
    char *json = NULL;
    size_t len = 0;
    ok(rp_sched_report_json(s, &json, &len, &err) == RP_OK && json && strlen(json) == len,
       "the report as JSON");
    like(json, "\"policy\": {", "it has the policy");
    like(json, "\"fallback\": false", "and the fallback flag");
    rp_text_free(ctx, json);
    rp_sched_free(s);

    rp_sched_options o;
    rp_sched_options_default(&o);
    o.history = -1;
    s = NULL;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_EINVAL, "a negative history is refused");
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.params_json = "{\"token_kk\": {\"equal_size\": false}, \"eplb\": {\"mode\": \"global\"}}";
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK, "a pair takes params per component");
    rp_sched_free(s);
    s = NULL;
    o.params_json = "{\"equal_size\": false}";
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_EINVAL && strstr(err.text, "unknown params key 'equal_size'"),
       "a pair's params must be keyed by component");
    o.params_json = NULL;
    o.policy = "token_kk+token_kk";
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_EINVAL, "a pair of the same policy is refused");
    o.policy = "token_kk+";
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK, "a pair with an empty part is refused");
    rp_sched_free(NULL);
}

/* ---- allocation failures -------------------------------------------------------------- */

/* Create a scheduler, run 3 steps with a swap staged for step 2, free everything, with
 * the fail_at-th allocation failing. Returns the steps that succeeded. */
static int chaos_run(long fail_at, counting *c)
{
    static const char *text =
        "{\"execution\": {\"executor\": \"ideal\"},"
        " \"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
        "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
        " \"limits\": {\"max_tokens_per_microbatch\": 1000}}";
    memset(c, 0, sizeof *c);
    c->fail_at = fail_at;
    rp_context *cx = NULL;
    if (rp_context_new(counting_alloc, c, &cx) != RP_OK) return 0;
    rp_config *cf = NULL;
    rp_sched *s = NULL;
    rp_batch *b = NULL;
    rp_error err;
    int32_t p[6] = {10, 20, 30, 5, 7, 9}, r[6] = {3, 4, 5, 6, 7, 8};
    uint8_t route[114 * 2 * 2];
    for (int i = 0; i < 114 * 4; i++) route[i] = (uint8_t)((i * 7) % 8);
    rp_routing rt;
    rp_routing_packed(&rt, RP_ID_U8, 2, 2, route);
    int steps = 0;
    if (rp_config_parse(cx, text, strlen(text), "<chaos>", &cf, &err) == RP_OK &&
        rp_batch_new(cx, 6, p, r, NULL, &b, &err) == RP_OK) {
        rp_sched_options o;
        rp_sched_options_default(&o);
        o.policy = "token_kk+eplb";
        o.num_threads = 1;
        if (rp_sched_new(cx, cf, &o, &s, &err) == RP_OK) {
            for (int t = 0; t < 3; t++) {
                const rp_plan *plan;
                const rp_step_report *rep;
                if (t == 1) rp_sched_stage_policy(s, "routepack", NULL, 2, &err);
                if (rp_sched_step(s, t, b, &rt, &plan, &rep, &err) == RP_OK &&
                    rp_plan_validate(plan, cf, b, NULL) == RP_OK)
                    steps++;
            }
        }
    }
    rp_sched_free(s);
    rp_batch_free(b);
    rp_config_free(cf);
    rp_context_free(cx);
    return steps;
}

static void test_allocation_failures(void)
{
    counting c;
    int steps = chaos_run(0, &c);
    long total = c.calls;
    ok(steps == 3 && c.blocks == 0 && total > 1000, "a clean run: 3 steps, %ld allocations, none left", total);
    /* every 13th allocation, to stay fast under ASan (sweeps of every N were run by hand
     * during development and pass): creation, loading, statistics, the policy's C
     * calls, staging, the dry run and swap, evaluation, freeing */
    long leaks = 0, runs = 0, recovered = 0;
    for (long n = 1; n <= total; n += 13) {
        int done = chaos_run(n, &c);
        runs++;
        if (c.blocks != 0) {
            leaks++;
            diag("failing allocation %ld leaves %ld blocks", n, c.blocks);
        }
        if (done > 0 && done < 3) recovered++;
    }
    ok(leaks == 0, "failing one of %ld allocations (%ld runs) never crashes or leaks", total, runs);
    ok(recovered > 0, "after a failed step the scheduler plans the next one (%ld runs)", recovered);
}

/* ---- what a returned plan may cost the engine ------------------------------------------- */

/* One sequence per microbatch (64 microbatches, empty ones allowed) is a valid plan
 * whose evaluation takes M x L x G x E work and memory. The engine decides from the
 * plan's shape, before paying, whether the policy could have evaluated it under its own
 * limits; if not the plan is refused and the step falls back. */
static const char *SPREAD_BODY =
    "local pk = {}\n"
    "for g = 1, 8 do pk[g] = {} for m = 1, 64 do pk[g][m] = {} end end\n"
    "for i = 0, ctx.batch.num_seqs - 1 do pk[1][i + 1] = {i} end\n"
    "return {packing = pk}";

static const rp_step_report *spread_step(int64_t max_instructions, size_t max_memory_bytes, const char *body)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_instructions = max_instructions;
    o.max_memory_bytes = max_memory_bytes;
    o.max_wall_s = 60;
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, body), NULL, &o);
    const rp_step_report *rep = step(s, 0, NULL);
    static rp_step_report copy;
    if (rep) copy = *rep;
    rp_sched_free(s);
    return rep ? &copy : NULL;
}

static void test_engine_work(void)
{
    /* 16 layers x (64 seqs x 2 x 64 experts + 64 mb x 8 GPUs x 64 experts + 64 mb x 80
     * slots + 64 mb x 1 EP group x (2 x 8 EP ranks x (64 experts + 8) + 3 x 8^2 + 5 x 64
     * + 9 x 8)) + 64 */
    const rp_step_report *rep = spread_step(300000, (size_t)32 << 20, SPREAD_BODY);
    ok(rep && rep->fallback, "a plan whose evaluation is over the instruction limit falls back");
    if (rep)
        like(rep->fallback_reason,
             "returned a plan the engine will not evaluate: evaluating it (64 microbatches x 16 layers x 8 GPUs x 64 "
             "experts) would take 2515008 work units, over the instruction limit of 300000",
             "the reason names the shape, the work and the limit");
    rep = spread_step(300000, (size_t)32 << 20, "return ctx.plan");
    ok(rep && !rep->fallback, "under the same limits an ordinary plan is evaluated");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);

    rep = spread_step(5000000, (size_t)2 << 20, SPREAD_BODY);
    ok(rep && rep->fallback, "a plan whose evaluation is over the memory limit falls back");
    if (rep) like(rep->fallback_reason, "MiB, over the policy's memory limit of 2 MiB", "the reason names the memory");
    rep = spread_step(5000000, (size_t)2 << 20, "return ctx.plan");
    ok(rep && !rep->fallback, "under the same memory limit an ordinary plan is evaluated");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);

    /* rp.evaluate pays for the evaluator's memory from the policy's cap, before it runs */
    char body[2048];
    snprintf(body, sizeof body, "%s", SPREAD_BODY);
    char *ret = strstr(body, "return {packing = pk}");
    snprintf(ret, sizeof body - (size_t)(ret - body), "rp.evaluate(rp.plan({packing = pk, placement = ctx.plan:placement()})) return nil");
    rep = spread_step(5000000, (size_t)2 << 20, body);
    ok(rep && rep->fallback, "rp.evaluate of a plan over the memory limit fails the call");
    if (rep)
        like(rep->fallback_reason,
             "rp.evaluate: evaluating this plan (64 microbatches x 16 layers x 8 GPUs x 64 experts) needs 2.8 MiB",
             "naming the plan's shape and the memory it needs");

    rep = spread_step(50000000, (size_t)2 << 20, "rp.joint({num_microbatches = 64, fallbacks = {}}) return nil");
    ok(rep && rep->fallback && strstr(rep->fallback_reason, "rp.joint: evaluating the planner's plans (64 microbatches x 16 "
                                                           "layers x 8 GPUs x 64 experts) needs"),
       "so does rp.joint, for the plans it will evaluate, before it runs");
    if (rep && !strstr(rep->fallback_reason, "rp.joint: evaluating")) diag("%s", rep->fallback_reason);
    rep = spread_step(50000000, (size_t)2 << 20, "return rp.joint({fallbacks = {}})");
    ok(rep && !rep->fallback, "an ordinary rp.joint fits the same limit");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);

    /* a returned plan expands (share sets: one Lua table of 88 shares referenced 32768
     * times) in the policy's capped memory, not the engine's */
    counting cnt = {0};
    rp_context *counted = NULL;
    rp_context_new(counting_alloc, &cnt, &counted);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_instructions = 50000000;
    o.max_memory_bytes = (size_t)16 << 20;
    o.max_wall_s = 60;
    o.num_threads = 1;
    snprintf(body, sizeof body, "%s", SPREAD_BODY);
    ret = strstr(body, "return {packing = pk}");
    snprintf(ret, sizeof body - (size_t)(ret - body),
             "local sh = {} for i = 1, 88 do sh[i] = 1 / 88 end\n"
             "local list, n = {}, 0\n"
             "for m = 0, 31 do for l = 0, 15 do for e = 0, 63 do\n"
             "  n = n + 1 list[n] = {microbatch = m, layer = l, expert = e, shares = sh} end end end\n"
             "return {packing = pk, shares = list}");
    o.policy = gen_steps_body_policy(&fx, body);
    rp_sched *s = NULL;
    rp_error err;
    ok(rp_sched_new(counted, cfg, &o, &s, &err) == RP_OK, "a scheduler on a counting allocator");
    long before = cnt.live;
    cnt.peak = cnt.live;
    const rp_plan *p = NULL;
    rep = NULL;
    ok(s && rp_sched_step(s, 0, batches[0], &routings[0], &p, &rep, &err) == RP_OK && rep->fallback,
       "a plan whose share sets expand past the memory limit falls back");
    if (rep) like(rep->fallback_reason, "policy exceeded the memory limit of 16 MiB (plans and scratch of C calls)",
                  "the expansion is charged to the policy's memory limit");
    ok(cnt.peak - before < (34L << 20), "the step's peak memory stays within the two caps and a little (%.1f MiB)",
       (double)(cnt.peak - before) / (1 << 20));
    rp_sched_free(s);
    rp_context_free(counted);

    /* share sets are inserted in sorted position: given in reverse order, each moves all
     * before it (1024 x 1023 / 2 moves), and the conversion charges that */
    const char *order = "local list = {}\n"
                        "for l = 0, 15 do for e = 0, 63 do\n"
                        "  list[#list + 1] = {microbatch = 0, layer = l, expert = e, shares = {1}} end end\n"
                        "local out = {}\n"
                        "for i = 1, #list do out[i] = list[%s] end\n"
                        "return {shares = out}";
    char text[1024];
    snprintf(text, sizeof text, order, "i");
    const rp_step_report *sorted = spread_step(50000000, (size_t)32 << 20, text);
    int64_t sorted_work = sorted ? sorted->policy_work : 0;
    snprintf(text, sizeof text, order, "#list + 1 - i");
    const rp_step_report *reversed = spread_step(50000000, (size_t)32 << 20, text);
    int64_t reversed_work = reversed ? reversed->policy_work : 0;
    ok(sorted && reversed && reversed_work - sorted_work >= 1024 * 1023 / 16,
       "share sets out of order are charged for the moves they cost (%lld more units than in order)",
       (long long)(reversed_work - sorted_work));
}

/* ---- host primitives are charged what they count ---------------------------------------- */

/* The work a step's policy was charged and the number its error message carried. */
static int64_t charged_and_counted(const char *body, int64_t *counted)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_instructions = INT64_C(4000000000);
    o.max_wall_s = 120;
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, body), NULL, &o);
    const rp_step_report *rep = step(s, 0, NULL);
    int64_t work = -1;
    *counted = -1;
    if (rep && rep->fallback) {
        const char *at = strstr(rep->fallback_reason, "counted=");
        if (at) *counted = strtoll(at + 8, NULL, 10);
        work = rep->policy_work;
    } else {
        diag("expected the probe to report by an error; %s", rep ? "it did not" : "the step failed");
    }
    rp_sched_free(s);
    return work;
}

/* rp.local_search and rp.joint's refinement are charged the operations the evaluator
 * counts while they run (units = counted operations, plus at most the evaluation paid
 * up front), on a few shapes; the old per-candidate estimates were 10-40x below. */
static void test_primitive_charges(void)
{
    int64_t dummy;
    int64_t base = charged_and_counted("local b = rp.baseline('attn_kk+eplb') error('counted=0')", &dummy);
    int64_t eval = cost_evaluation_units(cfg, batches[0]);
    static const struct {
        int evaluations, sample;
        bool slots;
    } shapes[] = {{200, 8, true}, {2000, 8, true}, {2000, 1, true}, {4000, 4, false}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "local b = rp.baseline('attn_kk+eplb')\n"
                 "local _, res = rp.local_search(b, {evaluations = %d, sample = %d, slots = %s})\n"
                 "error('counted=' .. string.format('%%d', res.operations))",
                 shapes[i].evaluations, shapes[i].sample, shapes[i].slots ? "true" : "false");
        int64_t counted = 0, work = charged_and_counted(body, &counted);
        int64_t charged = work - base;
        ok(base > 0 && counted > 0 && charged >= counted && charged <= counted + eval + 2000,
           "rp.local_search (%d candidates, samples of %d%s): charged %lld units for %lld counted operations",
           shapes[i].evaluations, shapes[i].sample, shapes[i].slots ? "" : ", no slots", (long long)charged,
           (long long)counted);
    }
    int64_t joint_base = charged_and_counted("local p, rep = rp.joint({fallbacks = {}}) error('counted=0')", &dummy);
    for (int k = 1; k <= 2; k++) {
        char body[512];
        snprintf(body, sizeof body,
                 "local p, rep = rp.joint({fallbacks = {}, refine_evaluations = %d})\n"
                 "error('counted=' .. string.format('%%d', rep.refine_operations))",
                 1000 * k);
        int64_t counted = 0, work = charged_and_counted(body, &counted);
        int64_t charged = work - joint_base;
        ok(joint_base > 0 && counted > 0 && charged >= counted - eval && charged <= counted + eval + 2000,
           "rp.joint's refinement (%d candidates): charged %lld more units for %lld counted operations", 1000 * k,
           (long long)charged, (long long)counted);
    }

    /* a search longer than the budget stops where the budget runs out, and the call fails */
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.max_instructions = 3000000;
    o.max_wall_s = 120;
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local b = rp.baseline('attn_kk+eplb')\n"
                                   "return rp.local_search(b, {evaluations = 100000000})"), NULL,
                       &o);
    const rp_step_report *rep = step(s, 0, NULL);
    ok(rep && rep->fallback && strstr(rep->fallback_reason, "exceeded the instruction limit (3000000)") &&
           rep->policy_work < 3000000 + eval + 100000,
       "a search over the budget stops just past it (%lld units) and the step falls back",
       rep ? (long long)rep->policy_work : -1LL);
    rp_sched_free(s);
}

/* The dry run happens in a copy of the staged policy that is thrown away: neither its
 * upvalues nor its globals reach the policy that then takes over, which is loaded afresh. */
static void test_swap_fresh_state(void)
{
    static const struct {
        const char *what, *source;
    } sticky[] = {
        {"an upvalue",
         "local calls = 0\n"
         "return {name = 'sticky', version = '1.0.0', api = 1, description = 'counts calls in an upvalue',\n"
         "plan = function(ctx) calls = calls + 1\n"
         "  if calls > 1 then error('the dry run left calls = ' .. calls) end end}"},
        {"a global",
         "return {name = 'sticky', version = '1.0.0', api = 1, description = 'counts calls in a global',\n"
         "plan = function(ctx) calls = (calls or 0) + 1\n"
         "  if calls > 1 then error('the dry run left calls = ' .. calls) end end}"},
        {"init's upvalue",
         "local inits = 0\n"
         "return {name = 'sticky', version = '1.0.0', api = 1, description = 'counts inits',\n"
         "init = function(ctx) inits = inits + 1 end,\n"
         "plan = function(ctx) if inits ~= 1 then error('init ran ' .. inits .. ' times in this state') end end}"},
    };
    for (size_t i = 0; i < sizeof sticky / sizeof sticky[0]; i++) {
        rp_error err;
        rp_sched *s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
        step(s, 0, NULL);
        ok(rp_sched_stage_policy(s, "sticky.lua", sticky[i].source, -1, &err) == RP_OK, "stage a policy with %s",
           sticky[i].what);
        const rp_step_report *rep = step(s, 1, NULL);
        ok(rep && rep->swapped && !rep->fallback && strcmp(rep->policy_name, "sticky") == 0,
           "it swaps in and its first real call sees no trace of the dry run (%s)", sticky[i].what);
        if (rep && rep->fallback) diag("%s", rep->fallback_reason);
        rep = step(s, 2, NULL);
        if (i < 2)
            ok(rep && rep->fallback && strstr(rep->fallback_reason, "the dry run left calls = 2"),
               "while its own state carries over between its calls as before (%s)", sticky[i].what);
        else
            ok(rep && !rep->fallback, "init ran once in the state that runs (%s)", sticky[i].what);
        rp_sched_free(s);
    }
}

/* ---- the placement in use from the first step ------------------------------------------ */

static bool placements_equal(const rp_plan *a, const rp_plan *b)
{
    if (!a || !b || !rp_plan_has_placement(a) || !rp_plan_has_placement(b)) return false;
    for (int32_t l = 0; l < rp_plan_num_layers(a); l++)
        if (memcmp(rp_plan_phy2log(a, l), rp_plan_phy2log(b, l), (size_t)rp_plan_total_slots(a) * 4) != 0)
            return false;
    return true;
}

/* ctx.placement.per_forward_balancing: how the placement in use runs */
static void test_placement_balancing(void)
{
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "if ctx.step == 0 then\n"
                                   "  assert(ctx.placement.per_forward_balancing == 'none')\n"
                                   "  return rp.baseline('token_kk+virtual_experts')\n"
                                   "end\n"
                                   "assert(ctx.placement.per_forward_balancing == 'virtual_experts', 'step 1 sees none')\n"
                                   "return rp.baseline('token_kk+eplb')"), NULL,
                       NULL);
    const rp_step_report *r0 = step(s, 0, NULL);
    ok(r0 && !r0->fallback, "step 0 runs the balancer's plan");
    const rp_step_report *r1 = step(s, 1, NULL);
    ok(r1 && !r1->fallback, "step 1: ctx.placement.per_forward_balancing says the placement in use runs with it");
    if (r1 && r1->fallback) diag("%s", r1->fallback_reason);
    rp_sched_free(s);
}

static void test_initial_placement(void)
{
    rp_error err;
    /* default: contiguous, seen by the policy at step 0 */
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "assert(ctx.placement ~= nil, 'no placement in use at step 0')\n"
                                   "for l = 0, 15 do for j = 0, 7 do local ex = ctx.placement.experts(l, j)\n"
                                   "  assert(#ex == 8 and ex[1] == 8 * j and ex[8] == 8 * j + 7) end end\n"
                                   "local s, b, n = rp.migration(ctx.plan)\n"
                                   "assert(s == 0 and b == 0 and n == 0)"), NULL,
                       NULL);
    const rp_plan *plan = NULL;
    const rp_step_report *rep = step(s, 0, &plan);
    ok(rep && !rep->fallback, "step 0: ctx.placement is the contiguous placement in use (nothing to migrate to keep it)");
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);
    rp_sched_free(s);

    /* a plan file: an EPLB placement saved from a step */
    s = gen_steps_sched(&fx, "token_kk+eplb", NULL, NULL);
    rep = step(s, 2, &plan);
    char path[600];
    snprintf(path, sizeof path, "%s/initial-plan.json", tmp);
    ok(rep && rp_plan_save(plan, path, &err) == RP_OK, "save an EPLB plan as the initial placement");
    rp_plan *eplb = NULL;
    if (plan) rp_plan_copy(plan, &eplb, NULL);
    rp_sched_free(s);

    rp_sched_options o;
    rp_sched_options_default(&o);
    o.initial_placement = path;
    s = gen_steps_sched(&fx, "token_kk", NULL, &o);
    rep = step(s, 0, &plan);
    ok(rep && placements_equal(plan, eplb) && rep->experts_moved == 0 && rep->migration_bytes == 0,
       "a packing-only policy keeps the plan file's placement from step 0, and nothing migrates");
    rp_sched_free(s);
    /* the same scheduler without the option moves nothing either, from contiguous */
    s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
    rep = step(s, 0, &plan);
    ok(rep && !placements_equal(plan, eplb) && rep->migration_bytes == 0,
       "without it the placement in use is contiguous");
    rp_sched_free(s);
    /* EPLB from the plan file's placement: its slots are renumbered against it, and the
     * migration counted is from it */
    s = gen_steps_sched(&fx, "token_kk+eplb", NULL, &o);
    rep = step(s, 2, &plan);
    ok(rep && placements_equal(plan, eplb) && rep->experts_moved == 0 && rep->migration_bytes == 0,
       "EPLB on the batch its initial placement came from moves nothing");
    rp_sched_free(s);

    /* the config key, relative to the config's directory */
    char cfg_path[600];
    snprintf(cfg_path, sizeof cfg_path, "%s/config-initial.json", tmp);
    /* config-small.json with the key added */
    json_t *root = json_load_file(RP_SOURCE_DIR "/examples/config-small.json", 0, NULL);
    json_t *pol = root ? json_object_get(root, "policy") : NULL;
    if (root && !pol) json_object_set_new(root, "policy", pol = json_object());
    if (pol) json_object_set_new(pol, "initial_placement", json_string("initial-plan.json"));
    if (!root || json_dump_file(root, cfg_path, 0) != 0) diag("cannot write %s", cfg_path);
    json_decref(root);
    rp_config *c2 = NULL;
    rp_sched *s2 = NULL;
    rp_sched_options o2;
    rp_sched_options_default(&o2);
    o2.policy = "token_kk";
    o2.num_threads = 1;
    ok(rp_config_load(ctx, cfg_path, &c2, &err) == RP_OK &&
           !strcmp(rp_config_policy(c2)->initial_placement, path),
       "policy.initial_placement is read relative to the config's directory");
    const rp_plan *p2 = NULL;
    const rp_step_report *r2 = NULL;
    ok(c2 && rp_sched_new(ctx, c2, &o2, &s2, &err) == RP_OK &&
           rp_sched_step(s2, 0, batches[0], &routings[0], &p2, &r2, &err) == RP_OK && placements_equal(p2, eplb) &&
           r2->migration_bytes == 0,
       "a scheduler made from that config starts from the file's placement");
    rp_sched_free(s2);
    rp_config_free(c2);
    ok(rp_config_policy(cfg)->initial_placement && !strcmp(rp_config_policy(cfg)->initial_placement, "contiguous"),
       "policy.initial_placement defaults to \"contiguous\"");
    root = json_load_file(RP_SOURCE_DIR "/examples/config-small.json", 0, NULL);
    pol = root ? json_object_get(root, "policy") : NULL;
    if (root && !pol) json_object_set_new(root, "policy", pol = json_object());
    if (pol) json_object_set_new(pol, "initial_placement", json_string(""));
    char *doc = root ? json_dumps(root, 0) : NULL;
    json_decref(root);
    c2 = NULL;
    ok(doc && rp_config_parse(ctx, doc, strlen(doc), "<inline>", &c2, &err) != RP_OK &&
           strstr(err.text, "policy.initial_placement"),
       "an empty policy.initial_placement is refused, naming the key");
    rp_config_free(c2);
    free(doc);

    /* errors: a missing file, a file without a placement */
    o.initial_placement = "/nonexistent/plan.json";
    o.policy = "token_kk";
    s = NULL;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK && strstr(err.text, "/nonexistent/plan.json") && !s,
       "an unreadable initial placement fails rp_sched_new, naming the file");
    snprintf(path, sizeof path, "%s/packing-only.json", tmp);
    rp_plan *packing_only = NULL;
    rp_plan_new(ctx, cfg, 1, &packing_only, &err);
    int32_t n = rp_batch_num_seqs(batches[0]);
    int32_t *zeros = calloc((size_t)n, sizeof *zeros);
    rp_plan_set_packing(packing_only, n, zeros, zeros, &err);
    free(zeros);
    rp_plan_save(packing_only, path, &err);
    rp_plan_free(packing_only);
    o.initial_placement = path;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK && strstr(err.text, "has no \"placement\""),
       "a plan file without a placement is refused: %s", err.text);
    rp_plan_free(eplb);

    /* the joint policy at step 0 charges the migration from the placement in use: it
     * keeps most of the contiguous layout where EPLB rewrites it (before, it re-placed
     * every layer at step 0 with no migration test) */
    rp_sched *joint = gen_steps_sched(&fx, "routepack", NULL, NULL), *ep = gen_steps_sched(&fx, "token_kk+eplb", NULL, NULL);
    const rp_step_report *rj = step(joint, 0, NULL);
    double joint_bytes = rj ? rj->migration_bytes : -1;
    const rp_step_report *re = step(ep, 0, NULL);
    ok(rj && re && joint_bytes < 0.5 * re->migration_bytes,
       "routepack's step 0 moves %.1f GB, less than half of EPLB's re-placement (%.1f GB)", joint_bytes / 1e9,
       re ? re->migration_bytes / 1e9 : -1.0);
    rp_sched_free(joint);
    rp_sched_free(ep);
}

/* rp.joint's fallback check in the step report: the calls that ran it, and those where a
 * baseline won. The probe calls rp.joint three times: the defaults (whether a baseline
 * wins there is learnt from a probe that fails when one does: at step 0 on this config
 * token_kk+contiguous can, as it migrates nothing), no fallbacks (no check), and 16
 * microbatches forced where the cap allows fewer (a baseline wins: asserted). A policy
 * without rp.joint counts nothing. */
static void test_fallback_check_counts(void)
{
    rp_sched *s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local p, r = rp.joint({})\n"
                                   "assert(r.chosen == 'joint', 'a baseline won: ' .. r.chosen)\n"
                                   "return p"), NULL,
                       NULL);
    const rp_step_report *rep = step(s, 0, NULL);
    const int first_changes = rep && rep->fallback ? 1 : 0;
    rp_sched_free(s);
    s = gen_steps_sched(&fx, gen_steps_body_policy(&fx, "local p1, r1 = rp.joint({})\n"
                         "local p2, r2 = rp.joint({fallbacks = {}})\n"
                         "local p3, r3 = rp.joint({num_microbatches = 16})\n"
                         "assert(r3.chosen ~= 'joint', 'forced microbatches: the joint plan won')\n"
                         "return p1"), NULL,
             NULL);
    rep = step(s, 0, NULL);
    ok(rep && !rep->fallback && rep->fallback_checks == 2 && rep->fallback_check_changes == 1 + first_changes,
       "the report counts rp.joint's fallback checks (2) and those a baseline won (%d)", 1 + first_changes);
    if (rep && rep->fallback) diag("%s", rep->fallback_reason);
    char *json = NULL, want[64];
    size_t len = 0;
    snprintf(want, sizeof want, "\"fallback_check_changes\": %d", 1 + first_changes);
    ok(s && rp_sched_report_json(s, &json, &len, NULL) == RP_OK && json && strstr(json, "\"fallback_checks\": 2") &&
           strstr(json, want),
       "and so do the step's metrics");
    rp_text_free(ctx, json);
    rp_sched_free(s);
    s = gen_steps_sched(&fx, "token_kk", NULL, NULL);
    rep = step(s, 0, NULL);
    ok(rep && rep->fallback_checks == 0 && rep->fallback_check_changes == 0, "a policy without rp.joint: none");
    rp_sched_free(s);
}

int main(void)
{
    rp_error err;
    /* the bundled small config as the scheduler's checks were written: the "ideal"
     * executor, which runs every lever (the balancer's plans included) */
    if (!gen_steps_load_cfg(&fx, "sched", "gen-small.json", EXECUTOR_IDEAL, STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    ctx = fx.ctx, cfg = fx.cfg, batches = fx.batches, routings = fx.routings, tmp = fx.tmp;
    test_shipped();
    test_placement_balancing();
    test_initial_placement();
    test_omitted();
    test_hostile();
    test_stale_view();
    test_determinism();
    test_swap();
    test_swap_fresh_state();
    test_views();
    test_plan_userdata();
    test_rp_api();
    test_log_limits();
    test_policy_out_of_memory();
    test_history();
    test_instruction_budget();
    test_engine_work();
    test_primitive_charges();
    test_errors();
    test_allocation_failures();
    test_fallback_check_counts();
    gen_steps_free(&fx);
    return tap_done();
}
