/* The joint packing under pipeline parallelism (issue 19): with few sequences a rank and a
 * cap they all fit under, the surrogate's sum over microbatches packs the whole batch
 * under the level of the longest sequence in one microbatch, which then crosses every
 * stage in turn with all the batch's expert work and dispatch; the pipeline packings
 * (joint.c, pack_pipeline) spread it, and the joint plan is no slower than attn_kk+eplb. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

/* 4 DP ranks a stage (one EP group of 4, 3 slots each for 8 experts), 2 sequences a rank:
 * one long sequence and seven of a quarter of its length, routed at random with a skew
 * towards experts 0-2. */
static bool scene_make(batch_fixture *f, int32_t pp, rp_error *err)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": 4, \"pipeline_parallel_size\": %d,"
             " \"ep_size\": 4, \"slots_per_gpu\": 3},"
             " \"model\": {\"num_layers\": 8, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 1024,"
             " \"expert_ffn_size\": 512, \"num_heads\": 8, \"head_dim\": 128},"
             " \"limits\": {\"max_tokens_per_microbatch\": 100000},"
             " \"trainer\": {\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2}}",
             pp, pp);
    const int32_t lens[8] = {6000, 1500, 1500, 1500, 1500, 1500, 1500, 1500};
    if (!batch_fixture_make(ctx, f, json, 8, lens, NULL, NULL, err)) return false;
    uint64_t rng = 0x2545F4914F6CDD1DULL;
    const int64_t choices = rp_batch_num_tokens(f->batch) * 8;
    for (int64_t k = 0; k < choices; k++) {
        uint8_t a = (uint8_t)(xorshift64(&rng) % 4 ? xorshift64(&rng) % 3 : xorshift64(&rng) % 8);
        uint8_t b = (uint8_t)(xorshift64(&rng) % 8);
        if (b == a) b = (uint8_t)((a + 1) % 8);
        f->ids[2 * k] = a;
        f->ids[2 * k + 1] = b;
    }
    if (!batch_fixture_stats(ctx, f, err)) {
        batch_fixture_free(f);
        return false;
    }
    return true;
}

/* Step time of `plan` with its microbatches in their best order, as the planner orders a
 * plan under PP. */
static bool ordered_step(const batch_fixture *f, rp_plan *plan, double *step_s, rp_error *err)
{
    rp_cost *cost = NULL;
    bool good = rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, &cost, err) == RP_OK &&
                rp_cost_evaluate(cost, plan, NULL, err) == RP_OK &&
                rp_cost_order_microbatches(cost, plan, step_s, err) == RP_OK;
    rp_cost_free(cost);
    return good;
}

static void test_spread(void)
{
    batch_fixture f;
    rp_error err;
    if (!scene_make(&f, 2, &err)) {
        ok(false, "scene: %s", err.text);
        return;
    }
    const char *none[] = {NULL};
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = none;
    rp_plan *joint = NULL, *base = NULL;
    rp_joint_report rep;
    double joint_s = 0, base_s = 0;
    bool made = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &joint, &rep, &err) == RP_OK &&
                rp_plan_validate(joint, f.cfg, f.batch, &err) == RP_OK && ordered_step(&f, joint, &joint_s, &err) &&
                rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "attn_kk+eplb", 0, &base, &err) == RP_OK &&
                ordered_step(&f, base, &base_s, &err);
    if (!made) {
        ok(false, "plans: %s", err.text);
    } else {
        /* the packing alone: how many sequences share the long one's microbatch */
        int32_t with_long = 0, M = rp_plan_num_microbatches(joint);
        for (int32_t s = 0; s < 8; s++) with_long += rp_plan_seq_microbatch(joint, s) == rp_plan_seq_microbatch(joint, 0);
        ok(M == 2 && with_long < 7, "PP 2: the joint packing spreads the batch over its %d microbatches (%d of 8 "
           "sequences with the long one; all 8 with the surrogate's packing alone)", M, with_long);
        ok(joint_s <= base_s, "PP 2: the joint plan (no fallbacks) %.6f ms, attn_kk+eplb %.6f ms, both in their best "
           "microbatch order", joint_s * 1e3, base_s * 1e3);
    }
    rp_plan_free(joint);
    rp_plan_free(base);
    batch_fixture_free(&f);

    /* PP 1: the step is the sum over microbatches, which one microbatch minimises: the
     * packing is the surrogate's alone, the long sequence's microbatch takes them all */
    if (!scene_make(&f, 1, &err)) {
        ok(false, "scene PP 1: %s", err.text);
        return;
    }
    if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &joint, &rep, &err) != RP_OK) {
        ok(false, "PP 1: %s", err.text);
    } else {
        int32_t with_long = 0;
        for (int32_t s = 0; s < 8; s++) with_long += rp_plan_seq_microbatch(joint, s) == rp_plan_seq_microbatch(joint, 0);
        ok(with_long >= 7, "PP 1: the joint packing keeps %d of 8 sequences with the long one (no budget)", with_long);
    }
    rp_plan_free(joint);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_spread();
    rp_context_free(ctx);
    return tap_done();
}
