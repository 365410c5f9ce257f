/* Fuzzes what the scheduler reads from a policy's source text: compiling it in the
 * sandbox, its metadata and params (rp_sched_stage_policy), and, when it stages, the dry
 * run, swap and first step with what it returns (rp_sched_step: plan conversion and
 * validation). A fresh scheduler per input, small sandbox limits. Whatever the policy
 * does, the step must succeed (falling back if the policy failed), and no call may take
 * 10 times the wall-time limit: a policy that escapes the clock is a finding (the
 * per-input timeout, tests/fuzz/fuzz_policy.timeout, catches one that never returns). */
#include "fuzz_util.h"

#include <time.h>

#define WALL_S 0.3

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Staging runs the policy's chunk (twice when it has params) and its init: together they
 * must end within 10 times the wall-time limit each. */
#define FUZZ_WITHIN(calls, t0, what)                                                                          \
    FUZZ_REQUIRE(now_s() - (t0) < 10 * WALL_S * (calls), "%s took %.2f s, over 10 x the wall-time limit of %g s " \
                 "for each of its %d policy calls: the policy escaped the clock", what, now_s() - (t0), WALL_S, calls)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    /* The source is text: the stage call takes a NUL-terminated string. */
    char *source = malloc(size + 1);
    FUZZ_REQUIRE(source, "out of memory");
    memcpy(source, data, size);
    source[size] = '\0';

    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    o.max_instructions = 2000000;
    o.max_wall_s = WALL_S;
    o.max_memory_bytes = 64u << 20;
    rp_sched *sched = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &sched, &err) == RP_OK,
                 "rp_sched_new: %s", err.text);
    const rp_plan *plan = NULL;
    const rp_step_report *report = NULL;
    FUZZ_REQUIRE(rp_sched_step(sched, 0, batch, &routing, &plan, &report, &err) == RP_OK, "step 0: %s",
                 err.text);
    double t0 = now_s();
    rp_status staged = rp_sched_stage_policy(sched, "fuzz.lua", source, -1, &err);
    FUZZ_WITHIN(3, t0, "staging (the chunk and init)");
    if (staged == RP_OK) {
        for (int64_t step = 1; step <= 2; step++) {
            t0 = now_s();
            FUZZ_REQUIRE(rp_sched_step(sched, step, batch, &routing, &plan, &report, &err) == RP_OK,
                         "step %lld with a staged policy: %s", (long long)step, err.text);
            /* the step's own policy call, and the whole step (with a swap: the dry run's
             * chunk, init and call, the fresh copy's chunk and init; a rebuild's chunk) */
            FUZZ_REQUIRE(report->policy_wall_s < 10 * WALL_S,
                         "step %lld: the policy's call took %.2f s, over 10 x the wall-time limit of %g s: the "
                         "policy escaped the clock", (long long)step, report->policy_wall_s, WALL_S);
            FUZZ_WITHIN(7, t0, step == 1 ? "the step with the swap" : "a step");
        }
    }
    rp_sched_free(sched);
    free(source);
    return 0;
}
