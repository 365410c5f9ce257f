/* A step whose batch the cost model refuses is refused before its routing is scanned
 * (before, every id was read first: 173 s for a batch refused in the end). The routing
 * here repeats one token's ids for every token (token stride 0), so a scan would read
 * 2^31 ids; routing_scan_hook counts whether one started. */
#include "routepack/routepack.h"
#include "routing_access.h"
#include "tap.h"

#include <stdlib.h>
#include <string.h>

static long scan_calls;
static void count_scan(void) { scan_calls++; }

int main(void)
{
    rp_error err;
    rp_context *ctx = NULL;
    rp_config *cfg = NULL;
    rp_context_new(NULL, NULL, &ctx);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    const rp_model *md = rp_config_model(cfg);
    const int64_t cap = rp_config_limits(cfg)->max_tokens_per_microbatch;
    /* every sequence fits a microbatch, but tokens x top_k passes 2^31 - 1 */
    const int32_t n = (int32_t)((INT32_MAX / md->top_k) / cap + 1);
    int32_t *prompt = calloc((size_t)n, sizeof *prompt), *response = calloc((size_t)n, sizeof *response);
    for (int32_t s = 0; s < n; s++) response[s] = (int32_t)cap;
    rp_batch *batch = NULL;
    if (rp_batch_new(ctx, n, prompt, response, NULL, &batch, &err) != RP_OK) {
        ok(0, "batch: %s", err.text);
        return tap_done();
    }
    uint8_t *ids = calloc((size_t)md->num_layers * (size_t)md->top_k, 1);
    for (int32_t i = 0; i < md->num_layers * md->top_k; i++) ids[i] = (uint8_t)(i % md->top_k);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, md->num_layers, md->top_k, ids);
    r.token_stride = 0; /* one token's ids for all */

    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    rp_sched *s = NULL;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) {
        ok(0, "sched: %s", err.text);
        return tap_done();
    }
    const rp_plan *plan = NULL;
    const rp_step_report *rep = NULL;
    routing_scan_hook = count_scan;
    rp_status st = rp_sched_step(s, 0, batch, &r, &plan, &rep, &err);
    routing_scan_hook = NULL;
    is_int(st, RP_ERANGE, "a batch of %lld tokens x top-%d is refused", (long long)rp_batch_num_tokens(batch),
           md->top_k);
    like(err.text, "token-choices per layer, over the evaluator's limit of 2^31-1", "by the cost model's limit: %s",
         err.text);
    is_int(scan_calls, 0, "before its routing is scanned");
    like(rp_sched_errmsg(s), "2^31-1", "the scheduler keeps the message");
    ok(rp_sched_plan(s) == NULL, "and has no plan");
    rp_sched_free(s);
    rp_batch_free(batch);
    free(ids);
    free(prompt);
    free(response);
    rp_config_free(cfg);
    rp_context_free(ctx);
    return tap_done();
}
