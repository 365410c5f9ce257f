/* The shipped policies (every file in policies/), alone and in pairs: each returns a valid plan
 * without falling back on generated and edge-case batches (a single huge sequence,
 * all-equal lengths, one expert taking every token, more GPUs than sequences), is
 * deterministic, and the baselines written in Lua give exactly what the C baselines
 * (rp_baseline_plan) give. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;
static rp_config *cfg;

typedef struct test_batch {
    const char *name;
    rp_batch *batch;
    rp_routing routing;
    uint8_t *ids;
} test_batch;

#define MAX_BATCHES 8
static test_batch batches[MAX_BATCHES];
static int num_batches;

/* A hand-made batch: lengths given, routing from a fixed pattern (`hot`: every choice of
 * every token goes to expert 0). */
static void hand_batch(const char *name, int32_t n, const int32_t *prompt, const int32_t *response, bool hot)
{
    test_batch *tb = &batches[num_batches++];
    tb->name = name;
    rp_error err;
    if (rp_batch_new(ctx, n, prompt, response, NULL, &tb->batch, &err) != RP_OK) {
        diag("batch %s: %s", name, err.text);
        exit(1);
    }
    const rp_model *md = rp_config_model(cfg);
    int64_t tokens = rp_batch_num_tokens(tb->batch);
    size_t count = (size_t)tokens * (size_t)md->num_layers * (size_t)md->top_k;
    tb->ids = malloc(count + 1);
    uint64_t x = 12345;
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t l = 0; l < md->num_layers; l++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            int32_t base = (int32_t)((x >> 33) % (uint64_t)md->num_experts);
            /* skewed: low experts are hot */
            if ((x >> 20) % 4 == 0) base = base % 8;
            for (int32_t j = 0; j < md->top_k; j++)
                tb->ids[((size_t)t * md->num_layers + l) * md->top_k + j] =
                    hot ? 0 : (uint8_t)((base + j) % md->num_experts);
        }
    rp_routing_packed(&tb->routing, RP_ID_U8, md->num_layers, md->top_k, tb->ids);
}

static void gen_batches(void)
{
    rp_gen *gen = NULL;
    rp_error err;
    if (rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK) {
        diag("gen: %s", err.text);
        exit(1);
    }
    static const char *names[] = {"gen-small step 0", "gen-small step 1", "gen-small step 2"};
    for (int t = 0; t < 3; t++) {
        test_batch *tb = &batches[num_batches++];
        tb->name = names[t];
        rp_routing r;
        if (rp_gen_step(gen, t, &tb->batch, &r, &err) != RP_OK) {
            diag("gen: %s", err.text);
            exit(1);
        }
        size_t n = (size_t)rp_batch_num_tokens(tb->batch) * (size_t)r.num_layers * (size_t)r.top_k * (size_t)r.width;
        tb->ids = malloc(n);
        memcpy(tb->ids, r.base, n);
        rp_routing_packed(&tb->routing, r.width, r.num_layers, r.top_k, tb->ids);
    }
    rp_gen_free(gen);
}

static void make_batches(void)
{
    gen_batches();
    int32_t p[64], r[64];
    /* one sequence just under the 16384-token cap, and small ones */
    p[0] = 15000, r[0] = 1300;
    for (int i = 1; i < 9; i++) p[i] = 50, r[i] = 30;
    hand_batch("a single huge sequence", 9, p, r, false);
    for (int i = 0; i < 64; i++) p[i] = 120, r[i] = 80;
    hand_batch("all-equal lengths", 64, p, r, false);
    for (int i = 0; i < 40; i++) p[i] = 20 + 7 * i, r[i] = 30 + (i * 13) % 50;
    hand_batch("one expert taking every token", 40, p, r, true);
    p[0] = 100, r[0] = 40, p[1] = 7, r[1] = 3, p[2] = 300, r[2] = 1;
    hand_batch("more GPUs than sequences (3 on 8)", 3, p, r, false);
}

static rp_sched *make(const char *policy)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy;
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) diag("%s: %s", policy, err.text);
    return s;
}

static bool same_packing(const rp_plan *a, const rp_plan *b)
{
    if (!a || !b || !rp_plan_has_packing(a) || !rp_plan_has_packing(b)) return false;
    if (rp_plan_num_microbatches(a) != rp_plan_num_microbatches(b)) return false;
    for (int32_t g = 0; g < rp_plan_num_gpus(a); g++)
        for (int32_t m = 0; m < rp_plan_num_microbatches(a); m++) {
            int32_t ca, cb;
            const int32_t *la = rp_plan_microbatch(a, g, m, &ca), *lb = rp_plan_microbatch(b, g, m, &cb);
            if (ca != cb || (ca && memcmp(la, lb, (size_t)ca * 4) != 0)) return false;
        }
    return true;
}

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    if (!a || !b || !rp_plan_has_placement(a) || !rp_plan_has_placement(b)) return false;
    if (rp_plan_balancing(a) != rp_plan_balancing(b)) return false; /* how the placement runs */
    for (int32_t l = 0; l < rp_plan_num_layers(a); l++)
        if (memcmp(rp_plan_phy2log(a, l), rp_plan_phy2log(b, l), (size_t)rp_plan_total_slots(a) * 4) != 0) return false;
    return true;
}

static rp_plan *baseline(const test_batch *tb, const char *name)
{
    rp_stats *stats = NULL;
    rp_plan *p = NULL, *contiguous = NULL;
    rp_error err;
    /* the placement in use at a scheduler's first step: contiguous (slots renumbered
     * against it) */
    if (rp_plan_new(ctx, cfg, 1, &contiguous, &err) != RP_OK || rp_plan_set_contiguous(contiguous, &err) != RP_OK)
        diag("contiguous placement: %s", err.text);
    if (rp_stats_compute(ctx, tb->batch, &tb->routing, rp_config_model(cfg)->num_experts, 1, &stats, &err) == RP_OK &&
        rp_baseline_plan(ctx, cfg, tb->batch, stats, contiguous, name, 0, &p, &err) != RP_OK)
        diag("baseline %s on %s: %s", name, tb->name, err.text);
    rp_stats_free(stats);
    rp_plan_free(contiguous);
    return p;
}

/* Every batch in one scheduler (steps 0, 1, ...), then again in a second one. */
static void test_policy(const char *policy)
{
    rp_sched *s1 = make(policy), *s2 = make(policy);
    bool valid = s1 && s2, nofall = valid, determ = valid;
    for (int i = 0; i < num_batches && s1 && s2; i++) {
        const test_batch *tb = &batches[i];
        const rp_plan *p1 = NULL, *p2 = NULL;
        const rp_step_report *r1 = NULL, *r2 = NULL;
        rp_error err;
        if (rp_sched_step(s1, i, tb->batch, &tb->routing, &p1, &r1, &err) != RP_OK) {
            diag("%s on %s: %s", policy, tb->name, err.text);
            valid = nofall = determ = false;
            continue;
        }
        uint64_t h1 = r1->plan_hash;
        bool f1 = r1->fallback;
        char reason[RP_ERROR_TEXT];
        snprintf(reason, sizeof reason, "%s", r1->fallback_reason);
        rp_status v = rp_plan_validate(p1, cfg, tb->batch, &err);
        if (v != RP_OK) diag("%s on %s: invalid: %s", policy, tb->name, err.text);
        valid &= v == RP_OK;
        if (f1) diag("%s on %s fell back: %s", policy, tb->name, reason);
        nofall &= !f1;
        if (rp_sched_step(s2, i, tb->batch, &tb->routing, &p2, &r2, &err) != RP_OK) {
            determ = false;
            continue;
        }
        determ &= r2->plan_hash == h1;
    }
    ok(valid, "%s: a valid plan on every batch (generated, huge sequence, equal lengths, hot expert, 3 sequences)",
       policy);
    ok(nofall, "%s: no fallback on any of them", policy);
    ok(determ, "%s: a second scheduler gives the same plans", policy);
    rp_sched_free(s1);
    rp_sched_free(s2);
}

/* Each batch in a fresh scheduler (first step: slots renumbered against the contiguous
 * placement in use), against the C baseline of the same name. */
static void test_matches_baseline(const char *policy, const char *base, bool packing, bool placement)
{
    bool same = true;
    for (int i = 0; i < num_batches; i++) {
        const test_batch *tb = &batches[i];
        rp_sched *s = make(policy);
        const rp_plan *p = NULL;
        const rp_step_report *r = NULL;
        rp_error err;
        rp_plan *b = baseline(tb, base);
        bool ran = s && rp_sched_step(s, 0, tb->batch, &tb->routing, &p, &r, &err) == RP_OK && !r->fallback;
        bool eq = ran && b && (!packing || same_packing(p, b)) && (!placement || same_placement(p, b));
        if (!eq) diag("%s differs from rp_baseline(\"%s\") on %s", policy, base, tb->name);
        same &= eq;
        rp_plan_free(b);
        rp_sched_free(s);
    }
    ok(same, "%s gives the %s%s%s of rp_baseline(\"%s\") on every batch", policy, packing ? "packing" : "",
       packing && placement ? " and " : "", placement ? "placement" : "", base);
}

static void test_routepack_migration(void)
{
    /* with a huge horizon the new placement always pays: it follows EPLB each step;
     * with horizon 1 and the same batch twice, nothing is worth moving */
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "routepack";
    o.num_threads = 1;
    o.params_json = "{\"horizon\": 1, \"search_evaluations\": 0}";
    rp_sched *s = NULL;
    rp_error err;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK, "routepack with params");
    const rp_plan *p;
    const rp_step_report *r;
    bool ran = s && rp_sched_step(s, 0, batches[0].batch, &batches[0].routing, &p, &r, &err) == RP_OK &&
               rp_sched_step(s, 1, batches[0].batch, &batches[0].routing, &p, &r, &err) == RP_OK;
    ok(ran && r->experts_moved == 0 && r->migration_bytes == 0,
       "routepack keeps its placement when the same routing comes again (nothing to gain)");
    ran = ran && rp_sched_step(s, 2, batches[1].batch, &batches[1].routing, &p, &r, &err) == RP_OK;
    ok(ran && !r->fallback, "and plans the next batch");
    rp_sched_free(s);
}

/* token_kk's equal_size param reaches the packing: false gives rp_baseline_packing's
 * plain-KK packing, and a fixed microbatch count is kept. */
static void test_packing_params(void)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk";
    o.num_threads = 1;
    o.params_json = "{\"equal_size\": false, \"num_microbatches\": 2}";
    rp_sched *s = NULL;
    rp_error err;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK, "token_kk with params");
    const rp_plan *p = NULL;
    const rp_step_report *r = NULL;
    rp_plan *want = NULL;
    const test_batch *tb = &batches[0];
    bool ran = s && rp_sched_step(s, 0, tb->batch, &tb->routing, &p, &r, &err) == RP_OK && !r->fallback;
    ok(ran && rp_baseline_packing(ctx, cfg, tb->batch, NULL, "token_kk", 2, false, &want, &err) == RP_OK &&
       same_packing(p, want) && rp_plan_num_microbatches(p) == 2,
       "equal_size false and num_microbatches 2 give rp_baseline_packing's plain-KK packing of 2 microbatches");
    rp_plan_free(want);
    rp_sched_free(s);
}

int main(void)
{
    rp_error err;
    rp_context_new(NULL, NULL, &ctx);
    /* the bundled small config priced as these checks were written: the "ideal" executor,
     * which runs every lever (the balancer's policies included) */
    if (config_load_with(ctx, RP_SOURCE_DIR "/examples/config-small.json", EXECUTOR_IDEAL, &cfg, &err) != RP_OK) {
        ok(0, "config: %s", err.text);
        return tap_done();
    }
    make_batches();
    static const char *policies[] = {"token_kk", "verl_kk",       "attn_kk",      "eplb",
                                     "contiguous", "routepack", "token_kk+eplb", "verl_kk+eplb",
                                     "attn_kk+eplb", "token_kk+contiguous", "virtual_experts",
                                     "token_kk+virtual_experts", "slime_ff", "slime_kk", "slime_ff+eplb",
                                     "slime_kk+eplb"};
    for (size_t i = 0; i < sizeof policies / sizeof policies[0]; i++) test_policy(policies[i]);
    test_matches_baseline("token_kk", "token_kk+contiguous", true, true);
    test_matches_baseline("verl_kk", "verl_kk+contiguous", true, true);
    test_matches_baseline("attn_kk", "attn_kk+contiguous", true, true);
    test_matches_baseline("slime_ff", "slime_ff+contiguous", true, true);
    test_matches_baseline("slime_kk", "slime_kk+contiguous", true, true);
    test_matches_baseline("slime_ff+eplb", "slime_ff+eplb", true, true);
    test_matches_baseline("contiguous", "attn_kk+contiguous", true, true);
    test_matches_baseline("verl_kk+eplb", "verl_kk+eplb", true, true);
    test_matches_baseline("eplb", "attn_kk+eplb", true, true);
    test_matches_baseline("token_kk+eplb", "token_kk+eplb", true, true);
    test_matches_baseline("token_kk+virtual_experts", "token_kk+virtual_experts", true, true);
    test_matches_baseline("virtual_experts", "attn_kk+virtual_experts", false, true);
    test_routepack_migration();
    test_packing_params();
    for (int i = 0; i < num_batches; i++) {
        rp_batch_free(batches[i].batch);
        free(batches[i].ids);
    }
    rp_config_free(cfg);
    rp_context_free(ctx);
    return tap_done();
}
