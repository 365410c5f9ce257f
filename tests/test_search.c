/* Local search: never worse, exact against a full evaluation, valid, within budget and
 * neighbourhoods, deterministic for a seed; bad parameters leave the plan alone. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

typedef struct fixture {
    rp_config *cfg;
    rp_batch *batch;
    uint8_t *ids;
    rp_stats *stats;
} fixture;

/* 2 nodes of 2 GPUs, one EP group of 4 (slots 3, 3, 3, 3), 2 layers of 8 experts, top-2;
 * a long-tail batch with routing skewed towards a few experts. */
static bool fixture_make(fixture *f, int32_t n, uint64_t seed)
{
    const char *json =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 4, \"slots_per_gpu\": 3},"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 256,"
        "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
        " \"limits\": {\"max_tokens_per_microbatch\": 2048}}";
    rp_error err;
    memset(f, 0, sizeof *f);
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &f->cfg, &err) != RP_OK) {
        diag("config: %s", err.text);
        return false;
    }
    uint64_t x = seed * 2654435761u + 1;
    int32_t *lens = calloc((size_t)n, sizeof *lens), *zero = calloc((size_t)n, sizeof *zero);
    for (int32_t i = 0; i < n; i++) {
        xorshift64(&x);
        lens[i] = (int32_t)(x % 8 == 0 ? 300 + x % 700 : 20 + x % 120);
    }
    rp_status st = rp_batch_new(ctx, n, lens, zero, NULL, &f->batch, &err);
    free(lens);
    free(zero);
    if (st != RP_OK) return false;
    int64_t tokens = rp_batch_num_tokens(f->batch);
    f->ids = malloc((size_t)tokens * 4 + 1);
    for (int64_t t = 0; t < tokens * 2; t++) {
        xorshift64(&x);
        uint8_t a = (uint8_t)(x % 4 ? x % 2 : x % 8), b = (uint8_t)((x >> 20) % 8);
        if (b == a) b = (uint8_t)((a + 3) % 8);
        f->ids[2 * t] = a;
        f->ids[2 * t + 1] = b;
    }
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, f->ids);
    return rp_stats_compute(ctx, f->batch, &r, 8, 1, &f->stats, &err) == RP_OK;
}

static void fixture_free(fixture *f)
{
    rp_stats_free(f->stats);
    free(f->ids);
    rp_batch_free(f->batch);
    rp_config_free(f->cfg);
}

static double full_eval(const fixture *f, const rp_plan *p)
{
    rp_cost *c = NULL;
    rp_cost_summary s = {0};
    rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, &c, NULL);
    rp_status st = rp_cost_evaluate(c, p, &s, NULL);
    rp_cost_free(c);
    return st == RP_OK ? s.step_s : NAN;
}

/* A fresh copy of the starting plan (the baseline is deterministic). */
static rp_plan *start_plan(const fixture *f)
{
    rp_plan *p = NULL;
    rp_baseline_plan(ctx, f->cfg, f->batch, f->stats, NULL, "token_kk+contiguous", 0, &p, NULL);
    return p;
}

static void test_search(void)
{
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 96, 1)) {
        skip(1, "fixture");
        return;
    }
    rp_plan *base = NULL, *p = NULL, *q = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &base, &err), RP_OK,
           "starting plan: token_kk+contiguous");
    rp_cost *cost = NULL;
    is_int(rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err), RP_OK, "cost evaluator");

    rp_search_params prm = rp_search_defaults();
    prm.max_evaluations = 3000;
    p = start_plan(&f);
    rp_search_result r;
    is_int(rp_search_local(cost, p, &prm, &r, &err), RP_OK, "search runs");
    ok(r.final_s < r.initial_s, "search lowers the step time (%.6g -> %.6g, %.1f%%)", r.initial_s, r.final_s,
       100 * (1 - r.final_s / r.initial_s));
    is_double(r.initial_s, full_eval(&f, base), 1e-12 * r.initial_s, "initial time is the plan's evaluation");
    is_double(r.final_s, full_eval(&f, p), 1e-9 * r.final_s, "final time equals a full evaluation of the result");
    is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_OK, "the improved plan is valid");
    ok(r.evaluations <= prm.max_evaluations, "within the budget (%lld candidates)", (long long)r.evaluations);
    ok(r.moves + r.swaps + r.slots > 0, "changes applied: %lld moves, %lld swaps, %lld slot changes",
       (long long)r.moves, (long long)r.swaps, (long long)r.slots);
    diag("search: %lld iterations, %lld moves, %lld swaps, %lld slots", (long long)r.iterations,
         (long long)r.moves, (long long)r.swaps, (long long)r.slots);

    /* Deterministic for a seed. */
    q = start_plan(&f);
    rp_search_result r2;
    rp_search_local(cost, q, &prm, &r2, &err);
    ok(rp_plan_hash(p) == rp_plan_hash(q) && r2.final_s == r.final_s, "same seed, same plan and time");
    rp_plan_free(q);
    q = NULL;
    rp_search_params other = prm;
    other.seed = 12345;
    q = start_plan(&f);
    rp_search_local(cost, q, &other, &r2, &err);
    ok(r2.final_s <= r2.initial_s, "another seed is never worse either");
    rp_plan_free(q);
    q = NULL;

    /* Budget 0: nothing changes. */
    rp_search_params zero = prm;
    zero.max_evaluations = 0;
    q = start_plan(&f);
    is_int(rp_search_local(cost, q, &zero, &r2, &err), RP_OK, "budget 0");
    ok(rp_plan_hash(q) == rp_plan_hash(base) && r2.evaluations == 0, "budget 0 leaves the plan as it was");
    rp_plan_free(q);
    q = NULL;

    /* Neighbourhoods: moves and swaps only keep the placement; slots only keep the packing. */
    rp_search_params packing_only = prm;
    packing_only.slots = false;
    q = start_plan(&f);
    rp_search_local(cost, q, &packing_only, &r2, &err);
    bool placement_same = true;
    for (int l = 0; l < 2; l++)
        placement_same &= !memcmp(rp_plan_phy2log(q, l), rp_plan_phy2log(base, l), 12 * sizeof(int32_t));
    ok(placement_same && r2.slots == 0, "without slot changes the placement stays");
    rp_plan_free(q);
    q = NULL;
    rp_search_params slots_only = prm;
    slots_only.moves = slots_only.swaps = false;
    q = start_plan(&f);
    rp_search_local(cost, q, &slots_only, &r2, &err);
    bool packing_same = true;
    for (int32_t s = 0; s < rp_batch_num_seqs(f.batch); s++)
        packing_same &= rp_plan_seq_rank(q, s) == rp_plan_seq_rank(base, s) &&
                        rp_plan_seq_microbatch(q, s) == rp_plan_seq_microbatch(base, s);
    ok(packing_same && r2.moves == 0 && r2.swaps == 0, "with slot changes only the packing stays");
    ok(r2.final_s <= r2.initial_s && rp_plan_validate(q, f.cfg, f.batch, NULL) == RP_OK,
       "slot changes alone: valid and not worse (%.6g -> %.6g)", r2.initial_s, r2.final_s);
    /* no EP rank holds an expert twice */
    bool no_dup = true;
    for (int l = 0; l < 2; l++) {
        const int32_t *phy = rp_plan_phy2log(q, l);
        for (int j = 0; j < 4; j++)
            for (int a = 0; a < 3; a++)
                for (int b = a + 1; b < 3; b++)
                    if (phy[j * 3 + a] >= 0 && phy[j * 3 + a] == phy[j * 3 + b]) no_dup = false;
    }
    ok(no_dup, "slot changes never put two replicas of an expert on one EP rank");
    rp_plan_free(q);
    q = NULL;

    /* Search from EPLB's placement too. */
    rp_plan *ep = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "verl_kk+eplb", 0, &ep, &err);
    rp_search_local(cost, ep, &prm, &r2, &err);
    ok(r2.final_s <= r2.initial_s && rp_plan_validate(ep, f.cfg, f.batch, NULL) == RP_OK,
       "from verl_kk+eplb: %.6g -> %.6g", r2.initial_s, r2.final_s);
    rp_plan_free(ep);

    /* Bad parameters: errors, plan untouched. */
    rp_search_params bad = prm;
    bad.sample = 0;
    q = start_plan(&f);
    is_int(rp_search_local(cost, q, &bad, &r2, &err), RP_EINVAL, "sample 0 rejected");
    like(err.text, "sample = 0", "sample message");
    bad = prm;
    bad.max_evaluations = -5;
    is_int(rp_search_local(cost, q, &bad, &r2, &err), RP_EINVAL, "negative budget rejected");
    is_int(rp_search_local(cost, q, NULL, &r2, &err), RP_EINVAL, "no parameters");
    ok(rp_plan_hash(q) == rp_plan_hash(base), "plan untouched by rejected searches");
    rp_plan_free(q);
    rp_plan *empty = NULL;
    rp_plan_new(ctx, f.cfg, 1, &empty, NULL);
    is_int(rp_search_local(cost, empty, &prm, &r2, &err), RP_EINVAL, "a plan without packing or placement");
    rp_plan_free(empty);

    rp_cost_free(cost);
    rp_plan_free(p);
    rp_plan_free(base);
    fixture_free(&f);
}

/* The search's work is counted where it happens: its operations grow with the candidates
 * it tries (each at least one layer's pass over the experts), the count is the same on
 * every run, and an operations budget stops it right after the candidate that passes it. */
static void test_operations(void)
{
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 96, 3)) {
        skip(1, "fixture");
        return;
    }
    int64_t ops[3] = {0};
    const int64_t evals[3] = {200, 800, 800};
    bool counted = true;
    for (int i = 0; i < 3; i++) {
        rp_plan *p = start_plan(&f);
        rp_cost *cost = NULL;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err);
        rp_search_params prm = rp_search_defaults();
        prm.max_evaluations = evals[i];
        prm.seed = 5;
        rp_search_result r;
        int64_t before = rp_cost_operations(cost);
        counted &= rp_search_local(cost, p, &prm, &r, &err) == RP_OK && !r.stopped &&
                   r.operations == rp_cost_operations(cost) - before && r.operations >= r.evaluations / 2 * 8;
        ops[i] = r.operations;
        rp_cost_free(cost);
        rp_plan_free(p);
    }
    ok(counted, "the result's operations are the evaluator's count over the search");
    ok(ops[1] > 3 * ops[0], "4x the candidates, more than 3x the operations (%lld, %lld)", (long long)ops[0],
       (long long)ops[1]);
    is_int(ops[2], ops[1], "the same search counts the same operations");

    rp_plan *p = start_plan(&f);
    rp_cost *cost = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err);
    rp_search_params prm = rp_search_defaults();
    prm.max_evaluations = 800;
    prm.seed = 5;
    prm.max_operations = ops[1] / 4;
    rp_search_result r;
    is_int(rp_search_local(cost, p, &prm, &r, &err), RP_OK, "a search with an operations budget");
    ok(r.stopped && r.evaluations < 800 && r.operations > prm.max_operations &&
           r.operations < prm.max_operations + ops[1] / 50,
       "stops just past it (%lld operations for a budget of %lld, %lld candidates)", (long long)r.operations,
       (long long)prm.max_operations, (long long)r.evaluations);
    ok(rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK && fabs(full_eval(&f, p) - r.final_s) <= 1e-12 * r.final_s,
       "and leaves a valid plan that scores as reported");
    prm.max_operations = -1;
    is_int(rp_search_local(cost, p, &prm, &r, &err), RP_EINVAL, "a negative budget is refused");
    rp_cost_free(cost);
    rp_plan_free(p);
    fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_search();
    test_operations();
    rp_context_free(ctx);
    return tap_done();
}
