/* The joint planner's extra replicas as routepack_torch runs them (issue 35, items 1 and
 * 2): fetched once a step, an extra that stays hot across microbatches is kept, not
 * re-fetched, and priced once; the levers it adds pay under the cost model; across nodes
 * it fetches over the network where the copy-per-microbatch executor finds no source; and
 * rp_plan_lever_stats counts a hand-made plan's levers. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

/* `nodes` x `gpn` GPUs, one EP group of all of them, `slots` slots a GPU, 1 layer of 2 x GPUs
 * experts, top-1; `exec`: the execution object's members. */
static rp_config *make_config(int nodes, int gpn, int slots, const char *exec)
{
    char json[2048];
    int G = nodes * gpn;
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": 1, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 1024,"
             "  \"expert_ffn_size\": 512, \"num_heads\": 8, \"head_dim\": 128},"
             " \"limits\": {\"max_tokens_per_microbatch\": 32768}, \"execution\": {%s}}",
             nodes, gpn, G, slots, 2 * G, exec);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

/* 16 sequences of 8000-14000 tokens; every token of every microbatch routed to expert 0
 * three times in four (a hot expert that stays hot across microbatches), else spread. */
static bool make(batch_fixture *f, rp_config *cfg)
{
    memset(f, 0, sizeof *f);
    f->cfg = cfg;
    if (!cfg) return false;
    const int32_t E = rp_config_model(cfg)->num_experts;
    int32_t lens[16];
    for (int i = 0; i < 16; i++) lens[i] = 8000 + 400 * i;
    rp_error err;
    if (!batch_fixture_batch(ctx, f, 16, lens, NULL, NULL, &err)) return false;
    const int64_t T = rp_batch_cu_seqlens(f->batch)[16];
    for (int64_t t = 0; t < T; t++) f->ids[t] = (uint8_t)(t % 4 != 0 ? 0 : (t / 4) % E);
    if (!batch_fixture_stats(ctx, f, &err)) {
        diag("stats: %s", err.text);
        return false;
    }
    return true;
}

static double step_of(const batch_fixture *f, const rp_plan *p)
{
    rp_cost *c = NULL;
    rp_cost_summary s = {0};
    if (rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, &c, NULL) != RP_OK) return NAN;
    rp_status st = rp_cost_evaluate(c, p, &s, NULL);
    rp_cost_free(c);
    return st == RP_OK ? s.step_s : NAN;
}

static const char *const no_fallbacks[] = {NULL};

static rp_plan *plan_of(const batch_fixture *f)
{
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    rp_plan *p = NULL;
    rp_error err;
    if (rp_joint_plan(ctx, f->cfg, f->batch, f->stats, NULL, NULL, &par, &p, NULL, &err) != RP_OK)
        diag("joint: %s", err.text);
    return p;
}

/* Whether some extra replica of the plan sits on an EP rank whose node holds no slot of
 * that expert (its fetch crosses nodes). */
static bool extra_across_nodes(const rp_plan *p, int gpn)
{
    const int32_t *slot_begin = rp_plan_slot_begin(p), *p2l = rp_plan_phy2log(p, 0);
    for (int32_t i = 0; i < rp_plan_num_extra_replicas(p); i++) {
        int32_t m, l, e, j;
        rp_plan_extra_replica(p, i, &m, &l, &e, &j);
        bool near = false;
        for (int32_t r = 0; r < rp_plan_ep_size(p) && !near; r++)
            for (int32_t s = slot_begin[r]; s < slot_begin[r + 1] && !near; s++)
                near = p2l[s] == e && r / gpn == j / gpn;
        if (!near) return true;
    }
    return false;
}

static void test_hot_across_microbatches(void)
{
    batch_fixture f;
    if (!make(&f, make_config(1, 4, 2, ""))) {
        skip(4, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_plan *p = plan_of(&f);
    rp_lever_stats s = {0};
    rp_error err;
    ok(p && rp_plan_lever_stats(p, f.cfg, &s, &err) == RP_OK, "routepack_torch: the planner plans and its levers count");
    ok(s.extra_replicas > s.extras_fetched && s.extras_fetched > 0,
       "the hot expert's extras are kept across microbatches: %d extra replicas, %d fetched for the step",
       s.extra_replicas, s.extras_fetched);
    rp_plan *bare = NULL;
    if (p && rp_plan_copy(p, &bare, &err) == RP_OK) rp_plan_clear_levers(bare);
    double with = p ? step_of(&f, p) : NAN, without = bare ? step_of(&f, bare) : NAN;
    ok(with < without, "and they pay under the cost model: %.6g s with the levers, %.6g s without", with, without);
    is_double(s.bytes_fetched_ahead, s.extras_fetched * 3.0 * 1024 * 512 * 2, 0,
              "all of it fetched ahead: %d x 3 x 1024 x 512 x 2 bytes", s.extras_fetched);
    rp_plan_free(bare);
    rp_plan_free(p);
    batch_fixture_free(&f);
}

static void test_across_nodes(void)
{
    batch_fixture t, i;
    /* 2 nodes of 2: EP 4 spans them */
    bool made = make(&t, make_config(2, 2, 2, "")) && make(&i, make_config(2, 2, 2, "\"executor\": \"ideal\""));
    if (!made) {
        skip(4, "fixture");
        batch_fixture_free(&t);
        batch_fixture_free(&i);
        return;
    }
    rp_plan *pt = plan_of(&t), *pi = plan_of(&i);
    ok(pt && pi, "both plan");
    ok(pt && extra_across_nodes(pt, 2), "routepack_torch fetches an extra replica across nodes (%d extras)",
       pt ? rp_plan_num_extra_replicas(pt) : -1);
    ok(pi && !extra_across_nodes(pi, 2), "ideal (copied per microbatch over NVLink) never does");
    rp_plan *bare = NULL;
    rp_error err;
    if (pt && rp_plan_copy(pt, &bare, &err) == RP_OK) rp_plan_clear_levers(bare);
    double with = pt ? step_of(&t, pt) : NAN, without = bare ? step_of(&t, bare) : NAN;
    ok(with < without, "its levers pay under the cost model across nodes: %.6g s with, %.6g s without", with, without);
    rp_plan_free(bare);
    rp_plan_free(pt);
    rp_plan_free(pi);
    batch_fixture_free(&t);
    batch_fixture_free(&i);
}

/* By hand: 4 GPUs, 8 experts in 3 slots each (12 slots: 4 replicas), 2 microbatches;
 * expert 0 extra on rank 1 in both microbatches (one fetch), expert 5 on rank 2 in
 * microbatch 1, shares for expert 0 in microbatch 0. */
static void test_lever_stats_by_hand(void)
{
    rp_config *cfg = make_config(1, 4, 3, "");
    rp_config *ideal = make_config(1, 4, 3, "\"executor\": \"ideal\"");
    rp_plan *p = NULL;
    rp_error err;
    static const int32_t p2l[12] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3};
    static const double sh[2] = {0.25, 0.75};
    bool made = cfg && ideal && rp_plan_new(ctx, cfg, 2, &p, &err) == RP_OK &&
                rp_plan_set_phy2log(p, 0, p2l, &err) == RP_OK &&
                rp_plan_add_extra_replica(p, 0, 0, 0, 1, &err) == RP_OK &&
                rp_plan_add_extra_replica(p, 1, 0, 0, 1, &err) == RP_OK &&
                rp_plan_add_extra_replica(p, 1, 0, 5, 2, &err) == RP_OK &&
                rp_plan_set_shares(p, 1, 0, 3, sh, 2, &err) == RP_OK;
    ok(made, "the hand-made plan builds");
    rp_lever_stats s = {0}, si = {0};
    if (made && rp_plan_lever_stats(p, cfg, &s, &err) == RP_OK && rp_plan_lever_stats(p, ideal, &si, &err) == RP_OK) {
        is_int(s.replicas, 4, "12 slots for 8 experts: 4 replicas");
        is_int(s.share_sets, 1, "one share set");
        is_int(s.extra_replicas, 3, "3 extra replicas");
        is_int(s.extras_fetched, 2, "routepack_torch fetches 2: expert 0 on rank 1 once for both microbatches");
        is_double(s.bytes_fetched, 2 * 3.0 * 1024 * 512 * 2, 0, "2 x 3 d f bpp = 6291456 bytes");
        is_double(s.bytes_fetched_ahead, s.bytes_fetched, 0, "all ahead");
        is_int(si.extras_fetched, 3, "ideal copies every one");
        is_double(si.bytes_fetched_ahead, 0, 0, "none ahead");
    } else {
        diag("lever stats: %s", err.text);
        skip(8, "lever stats");
    }
    ok(rp_plan_lever_stats(p, NULL, &s, &err) == RP_EINVAL, "no config: refused");
    rp_plan_free(p);
    rp_config_free(cfg);
    rp_config_free(ideal);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_hot_across_microbatches();
    test_across_nodes();
    test_lever_stats_by_hand();
    rp_context_free(ctx);
    return tap_done();
}
