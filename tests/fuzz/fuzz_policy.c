/* Fuzzes what the scheduler reads from a policy's source text: compiling it in the
 * sandbox, its metadata and params (rp_sched_stage_policy), and, when it stages, the dry
 * run, swap and first step with what it returns (rp_sched_step: plan conversion and
 * validation). A fresh scheduler per input, small sandbox limits. Whatever the policy
 * does, the step must succeed (falling back if the policy failed). */
#include "fuzz_util.h"

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
    o.max_wall_s = 2.0;
    o.max_memory_bytes = 64u << 20;
    rp_sched *sched = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &sched, &err) == RP_OK,
                 "rp_sched_new: %s", err.text);
    const rp_plan *plan = NULL;
    const rp_step_report *report = NULL;
    FUZZ_REQUIRE(rp_sched_step(sched, 0, batch, &routing, &plan, &report, &err) == RP_OK, "step 0: %s",
                 err.text);
    if (rp_sched_stage_policy(sched, "fuzz.lua", source, -1, &err) == RP_OK) {
        for (int64_t step = 1; step <= 2; step++)
            FUZZ_REQUIRE(rp_sched_step(sched, step, batch, &routing, &plan, &report, &err) == RP_OK,
                         "step %lld with a staged policy: %s", (long long)step, err.text);
    }
    rp_sched_free(sched);
    free(source);
    return 0;
}
