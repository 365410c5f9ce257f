/* A hostile policy ends its whole step within its wall-time limit plus the bound
 * docs/sandbox.md states ("After a limit trips"): rp_sched_step as a whole, with the
 * rebuild that follows a limit trip, the call, keeping ctx.state and the engine's own
 * work of the step. Each hostile kind of test_sandbox_bounds runs as a policy whose chunk
 * takes most of the limit to load, so a rebuild done in the step that tripped (as before
 * this test: the call, then the reload) took about 1.6 times the limit. The wall-time
 * limit reads this thread's CPU time (an injected clock), and each step is timed the
 * same way, so the machine's load changes neither. */
#include "sandbox.h"
#include "sched_internal.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#define STEPS 2
/* The limit, the chunk's share of it, and what the test allows past it: the stated
 * bound is 100 ms on the development machine (0-13 ms measured per call); the step's own
 * engine work (statistics, the fallback's plan and its evaluation, freeing the
 * interrupted state) and the sanitizer builds take the rest. */
#define WALL_S 0.5
#define CHUNK_SHARE 0.6
#define ALLOWED_S 0.15

static gen_steps fx;

static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_clock(void *ud)
{
    (void)ud;
    return thread_cpu_s();
}

/* Iterations of the chunk's loop that take CHUNK_SHARE of the limit to load here. */
static long calibrate(void)
{
    const char *fmt = "local x = 0 for i = 1, %ld do x = x + i end\n"
                      "return {name = 'burn', version = '1.0.0', api = 1, description = 'd', plan = function() end}";
    long n = 2000000;
    for (int round = 0; round < 2; round++) {
        char src[512];
        snprintf(src, sizeof src, fmt, n);
        rp_sandbox_limits lim = rp_sandbox_limits_default();
        lim.max_wall_s = 60;
        lim.max_instructions = INT64_C(1) << 50;
        rp_policy *pol = NULL;
        rp_error err;
        double t0 = thread_cpu_s();
        if (rp_policy_load(fx.ctx, fx.cfg, src, strlen(src), "burn.lua", &lim, NULL, false, &pol, &err) != RP_OK) {
            diag("calibrating: %s", err.text);
            return n;
        }
        double took = thread_cpu_s() - t0;
        rp_policy_free(pol);
        n = (long)((double)n * CHUNK_SHARE * WALL_S / (took > 1e-3 ? took : 1e-3));
    }
    return n;
}

static const char *policy_path(long burn, const char *body)
{
    static char path[512];
    char src[4096];
    snprintf(src, sizeof src,
             "local x = 0 for i = 1, %ld do x = x + i end\n"
             "return {name = 'hostile', version = '1.0.0', api = 1, description = 'a hostile policy',\n"
             "plan = function(ctx) %s end}\n",
             burn, body);
    snprintf(path, sizeof path, "%s/hostile.lua", fx.tmp);
    spit(path, src, strlen(src));
    return path;
}

static void run_hostile(long burn, const char *name, const char *body)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy_path(burn, body);
    o.num_threads = 1;
    o.max_wall_s = 60; /* loading under the real clock; the limit is set below */
    o.max_instructions = INT64_C(1) << 50;
    o.demote_after = -1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(fx.ctx, fx.cfg, &o, &s, &err) != RP_OK) {
        ok(0, "%s: rp_sched_new: %s", name, err.text);
        return;
    }
    sched_fields f;
    sched_fields_of(s, &f);
    rp_sandbox_set_clock(f.running->pol[0]->sb, cpu_clock, NULL);
    rp_sandbox_set_max_wall_s(f.running->pol[0]->sb, WALL_S);
    double worst = 0;
    bool tripped = true;
    char reason[256] = "";
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *p = NULL;
        const rp_step_report *rep = NULL;
        double t0 = thread_cpu_s();
        rp_status st = rp_sched_step(s, t, fx.batches[t], &fx.routings[t], &p, &rep, &err);
        double took = thread_cpu_s() - t0;
        if (st != RP_OK) {
            diag("step %d: %s", t, err.text);
            tripped = false;
            break;
        }
        diag("%s: step %d %.3f s (CPU) against a limit of %.1f s: %.160s", name, t, took, WALL_S,
             rep->fallback_reason);
        if (took > worst) worst = took;
        tripped &= rep->fallback && strstr(rep->fallback_reason, "wall-time limit") != NULL;
        if (!tripped && !reason[0]) snprintf(reason, sizeof reason, "%.200s", rep->fallback_reason);
    }
    ok(tripped, "%s: every step stops at the wall-time limit %s", name, reason);
    ok(worst < WALL_S + ALLOWED_S, "%s: every step ends within the limit plus the bound (the longest %.3f s)", name,
       worst);
    rp_sched_free(s);
}

#define BIG "local big = {} for i = 1, 2^17 do big[i + 0.5] = i end "

int main(void)
{
    rp_error err;
    if (!gen_steps_load(&fx, "step-bound", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    long burn = calibrate();
    diag("the chunk loops %ld times (about %.2f s of CPU here)", burn, CHUNK_SHARE * WALL_S);
    run_hostile(burn, "a plain loop", "while true do end");
    run_hostile(burn, "table.maxn in a loop", BIG "while true do table.maxn(big) end");
    run_hostile(burn, "__lt = table.maxn under table.sort",
                BIG "setmetatable(big, {__lt = table.maxn}) local t = {} for i = 1, 2000 do t[i] = big end "
                    "while true do pcall(table.sort, t) end");
    run_hostile(burn, "__index = table.maxn under string.gsub with a table",
                BIG "setmetatable(big, {__index = table.maxn}) local s = string.rep('x', 2^20) "
                    "while true do string.gsub(s, '%a', big) end");
    run_hostile(burn, "__concat = table.maxn over many operands",
                BIG "setmetatable(big, {__concat = table.maxn}) local b = big "
                    "while true do local _ = b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b "
                    "..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b..b end");
    run_hostile(burn, "__index = unpack under string.gsub",
                "local t = {} for i = 1, 4000 do t[i] = i end setmetatable(t, {__index = unpack}) "
                "local s = string.rep('1', 2^20) while true do string.gsub(s, '%d', t) end");
    run_hostile(burn, "table.remove at the front of a long array",
                "local a = {} for i = 1, 2^19 do a[i] = i end while true do table.remove(a, 1) table.insert(a, 1, 0) end");
    run_hostile(burn, "__lt = pairs under table.sort",
                BIG "setmetatable(big, {__lt = pairs}) local t = {} for i = 1, 2000 do t[i] = big end "
                    "while true do pcall(table.sort, t) end");
    run_hostile(burn, "__index = next under string.gsub with a table",
                BIG "setmetatable(big, {__index = next}) local s = string.rep('x', 2^20) "
                    "while true do pcall(string.gsub, s, '%a', big) end");
    run_hostile(burn, "next over a table of long keys",
                "local t = {} for i = 1, 64 do t[string.rep('k', 2^16) .. i] = i end "
                "while true do local k = next(t) while k do k = next(t, k) end end");
    run_hostile(burn, "a Lua comparator that sorts again",
                "local t = {} for i = 1, 200 do t[i] = 201 - i end "
                "while true do table.sort(t, function(a, b) local u = {3, 2, 1} table.sort(u) return a < b end) end");
    gen_steps_free(&fx);
    return tap_done();
}
