/* The microbatch caps (core/limits.c): the token cap lowered by the activation memory
 * cap, exact at the boundary; a batch with a sequence no microbatch can hold is refused
 * with a message naming the config key to raise, by the checker and by the scheduler
 * before it scans the routing or runs a policy. */
#include "limits_internal.h"
#include "routepack/routepack.h"
#include "routepack/sched.h"
#include "tap.h"

#include <stdlib.h>
#include <unistd.h>

static rp_context *ctx;

static rp_config *config(const char *limits)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
             "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": %s}",
             limits);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

static rp_batch *batch_of(int32_t n, const int32_t *lens)
{
    int32_t zero[16] = {0};
    rp_batch *b = NULL;
    rp_batch_new(ctx, n, lens, zero, NULL, &b, NULL);
    return b;
}

static void test_token_cap(void)
{
    rp_limits lim = {.max_tokens_per_microbatch = 1000};
    is_int(rp_limits_token_cap(&lim), 1000, "no memory cap: the token cap");
    lim.max_activation_bytes = 700;
    lim.activation_bytes_per_token = 1;
    is_int(rp_limits_token_cap(&lim), 700, "a memory cap below it lowers the cap");
    lim.activation_bytes_per_token = 0.1; /* a ratio that is inexact in doubles */
    lim.max_tokens_per_microbatch = 100000;
    int64_t cap = rp_limits_token_cap(&lim);
    ok((double)cap * 0.1 <= 700 && (double)(cap + 1) * 0.1 > 700,
       "the cap is the largest count within the memory cap, in the checks' arithmetic (%lld)", (long long)cap);
    lim.max_activation_bytes = 1e30;
    is_int(rp_limits_token_cap(&lim), 100000, "a memory cap above it changes nothing");
}

static void test_check_batch(void)
{
    rp_error err;
    int32_t lens[4] = {10, 150, 20, 140};
    rp_batch *b = batch_of(4, lens);
    rp_limits lim = {.max_tokens_per_microbatch = 100, .activation_bytes_per_token = 2};
    is_int(rp_limits_check_batch(&lim, b, &err), RP_ERANGE, "a sequence over the token cap");
    like(err.text, "sequence 1 has 150 tokens, more than one microbatch holds "
         "(limits.max_tokens_per_microbatch = 100): no plan can pack this batch; raise "
         "limits.max_tokens_per_microbatch to at least 150", "names the longest sequence and the key");
    is_int(err.sequence, 1, "carries the sequence");
    lim.max_tokens_per_microbatch = 150;
    is_int(rp_limits_check_batch(&lim, b, &err), RP_OK, "a sequence exactly at the cap fits");
    lim.max_activation_bytes = 250;
    is_int(rp_limits_check_batch(&lim, b, &err), RP_ERANGE, "a sequence over the memory cap");
    like(err.text, "sequence 1 needs 300 bytes of activations (150 tokens x "
         "limits.activation_bytes_per_token = 2), more than one microbatch holds "
         "(limits.max_activation_bytes = 250): no plan can pack this batch; raise "
         "limits.max_activation_bytes to at least 300", "names the memory keys");
    rp_batch_free(b);
}

static const char *runaway_policy =
    "return { name = 'counting', version = '1.0.0', api = 1, description = 'never returns',\n"
    "  plan = function(ctx) while true do end end }\n";

static void test_scheduler_refuses_early(void)
{
    rp_config *cfg = config("{\"max_tokens_per_microbatch\": 64}");
    char path[] = "/tmp/rp-limits-XXXXXX.lua";
    int fd = mkstemps(path, 4);
    FILE *f = fdopen(fd, "w");
    fputs(runaway_policy, f);
    fclose(f);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = path;
    /* an instruction limit the policy would need a long time to reach: a step that ran
     * it would report a fallback, not the cap */
    rp_sched *s = NULL;
    rp_error err;
    ok(cfg && rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK, "scheduler");
    int32_t lens[3] = {10, 90, 20};
    rp_batch *b = batch_of(3, lens);
    /* ids out of range: a scan before the check would report them instead */
    uint8_t ids[120 * 2 * 2];
    memset(ids, 200, sizeof ids);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    is_int(rp_sched_step(s, 0, b, &r, &p, &rep, &err), RP_ERANGE, "the step fails");
    like(err.text, "sched: step 0: sequence 1 has 90 tokens, more than one microbatch holds "
         "(limits.max_tokens_per_microbatch = 64): no plan can pack this batch; raise "
         "limits.max_tokens_per_microbatch to at least 90", "with the cause alone, before the scan and the policy");
    ok(p == NULL && rp_sched_plan(s) == NULL, "no plan");
    rp_batch_free(b);
    rp_sched_free(s);
    rp_config_free(cfg);
    unlink(path);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_token_cap();
    test_check_batch();
    test_scheduler_refuses_early();
    rp_context_free(ctx);
    return tap_done();
}
