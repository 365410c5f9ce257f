/* Fuzzes the reading of a policy's params (rp_sched_options.params_json, checked against
 * what the policy declares; for a pair, one member per component) for the joint policy
 * and a pair. */
#include "fuzz_util.h"

static void make(const char *policy, const char *params)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy;
    o.num_threads = 1;
    o.params_json = params;
    rp_sched *sched = NULL;
    rp_error err;
    if (rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &sched, &err) == RP_OK) rp_sched_free(sched);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *params = malloc(size + 1);
    FUZZ_REQUIRE(params, "out of memory");
    memcpy(params, data, size);
    params[size] = '\0';
    make("routepack", params);
    make("token_kk+eplb", params);
    free(params);
    return 0;
}
