/* The trainer's constraints on a packing (config "trainer"): equal sequence counts per
 * DP rank (verl's DataProto.chunk), a microbatch count that is a multiple of N
 * (verl's num_batches_divided_by) and no empty microbatch (verl's partitioning). Config errors, validation messages, and every packer
 * (the baselines, the joint planner, the local search) under each constraint, with
 * hand-checked small cases. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

typedef batch_fixture fixture; /* test_util.h */

/* test_util.h's trainer_fixture_make on this file's random numbers. */
static bool fixture_make(fixture *f, int ep, int cap, const char *trainer, int32_t n, const int32_t *lens)
{
    rp_error err;
    bool made = trainer_fixture_make(ctx, f, ep, cap, trainer, n, lens, &rng_state, &err);
    if (!made) diag("fixture: %s", err.text);
    return made;
}

static int32_t rank_count(const rp_plan *p, int32_t g)
{
    int32_t total = 0;
    for (int32_t m = 0; m < rp_plan_num_microbatches(p); m++) {
        int32_t c;
        rp_plan_microbatch(p, g, m, &c);
        total += c;
    }
    return total;
}

static bool counts_equal(const rp_plan *p)
{
    for (int32_t g = 1; g < rp_plan_num_gpus(p); g++)
        if (rank_count(p, g) != rank_count(p, 0)) return false;
    return true;
}

/* ---- config ---- */

static rp_status parse(const char *json, rp_config **cfg, rp_error *err)
{
    return rp_config_parse(ctx, json, strlen(json), "t.json", cfg, err);
}

#define BASE_CONFIG                                                                                           \
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4},"                                              \
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"                \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"

#define BASE_CONFIG_SLOTS(n)                                                                                  \
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"slots_per_gpu\": " #n "},"                    \
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"                \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"

static void test_config(void)
{
    rp_config *cfg = NULL;
    rp_error err;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}}", &cfg, &err), RP_OK,
           "a config without a trainer section");
    if (cfg) {
        const rp_trainer *tr = rp_config_trainer(cfg);
        ok(!tr->equal_sequences_per_rank && tr->microbatch_multiple == 1,
           "defaults: no equal counts, microbatch multiple 1");
        rp_config_free(cfg);
        cfg = NULL;
    }
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64, \"num_microbatches\": 4},"
                 " \"trainer\": {\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2, \"comment\": \"x\"}}",
                 &cfg, &err),
           RP_OK, "both keys set");
    if (cfg) {
        const rp_trainer *tr = rp_config_trainer(cfg);
        ok(tr->equal_sequences_per_rank && tr->microbatch_multiple == 2, "read as given");
        rp_config_free(cfg);
        cfg = NULL;
    }
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64, \"num_microbatches\": 3},"
                 " \"trainer\": {\"microbatch_multiple\": 2}}",
                 &cfg, &err),
           RP_EINVAL, "a fixed microbatch count that is not a multiple is refused");
    like(err.text, "trainer.microbatch_multiple is 2, but limits.num_microbatches fixes 3 microbatches, not a "
                   "multiple of 2",
         "naming both keys and both numbers");
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"trainer\": {\"microbatch_multiple\": 0}}",
                 &cfg, &err),
           RP_ERANGE, "microbatch_multiple 0 is out of range");
    like(err.text, "trainer.microbatch_multiple", "named");
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64},"
                 " \"trainer\": {\"equal_sequences_per_rank\": 1}}",
                 &cfg, &err),
           RP_EINVAL, "equal_sequences_per_rank must be a boolean");
    like(err.text, "trainer.equal_sequences_per_rank must be true or false", "named");
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64},"
                 " \"trainer\": {\"equal_sequence_per_rank\": true}}",
                 &cfg, &err),
           RP_EINVAL, "a misspelt key");
    like(err.text, "did you mean 'equal_sequences_per_rank'", "with the suggestion");
}

/* ---- validation ---- */

typedef struct messages {
    char text[8][RP_ERROR_TEXT];
    int n;
} messages;

static void collect(void *ud, const char *msg)
{
    messages *m = ud;
    if (m->n < 8) snprintf(m->text[m->n], sizeof m->text[0], "%s", msg);
    m->n++;
}

static void test_validation(void)
{
    static const int32_t lens[8] = {10, 10, 10, 10, 10, 10, 10, 10};
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 4, 100, "\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2", 8, lens)) {
        skip(9, "fixture");
        return;
    }
    /* 3 microbatches, rank 0 runs 3 sequences, rank 1 one */
    rp_plan *p = NULL;
    rp_plan_new(ctx, f.cfg, 3, &p, &err);
    int32_t rank[8] = {0, 0, 0, 1, 2, 2, 3, 3}, mb[8] = {0, 1, 2, 0, 0, 1, 0, 1};
    rp_plan_set_packing(p, 8, rank, mb, &err);
    rp_plan_set_contiguous(p, &err);
    messages m = {.n = 0};
    is_int(rp_plan_check(p, f.cfg, f.batch, collect, &m), 3, "three violations");
    is_str(m.text[0], "plan: the plan runs 3 microbatches per rank, not a multiple of 2 (trainer.microbatch_multiple)",
           "the microbatch multiple, with the count and the key");
    is_str(m.text[1],
           "plan: rank 0 runs 3 sequences, but trainer.equal_sequences_per_rank needs 2 on every rank (8 sequences "
           "over 4 DP ranks)",
           "rank 0's count");
    is_str(m.text[2],
           "plan: rank 1 runs 1 sequences, but trainer.equal_sequences_per_rank needs 2 on every rank (8 sequences "
           "over 4 DP ranks)",
           "rank 1's count");
    is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_EPLAN, "rp_plan_validate refuses it");
    like(err.text, "plan: 3 problems; first: the plan runs 3 microbatches", "with the first problem");
    rp_plan_free(p);

    /* the same packing over 2 microbatches, counts equal: valid */
    p = NULL;
    rp_plan_new(ctx, f.cfg, 2, &p, &err);
    int32_t rank2[8] = {0, 0, 1, 1, 2, 2, 3, 3}, mb2[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    rp_plan_set_packing(p, 8, rank2, mb2, &err);
    rp_plan_set_contiguous(p, &err);
    is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_OK, "equal counts in 2 microbatches pass");
    rp_plan_free(p);
    batch_fixture_free(&f);

    /* 7 sequences over 4 ranks */
    if (!fixture_make(&f, 4, 100, "\"equal_sequences_per_rank\": true", 7, lens)) {
        skip(2, "fixture");
        return;
    }
    p = NULL;
    rp_plan_new(ctx, f.cfg, 1, &p, &err);
    int32_t rank3[7] = {0, 0, 1, 1, 2, 2, 3}, mb3[7] = {0};
    rp_plan_set_packing(p, 7, rank3, mb3, &err);
    rp_plan_set_contiguous(p, &err);
    is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_EPLAN, "7 sequences over 4 ranks cannot be valid");
    is_str(err.text,
           "plan: the batch has 7 sequences, which do not divide over the 4 DP ranks "
           "(trainer.equal_sequences_per_rank needs the same count on every rank)",
           "one message naming both numbers and the key");
    rp_plan_free(p);
    batch_fixture_free(&f);
}

/* ---- the packers ---- */

/* 100, then seven of 10 tokens (hand-checked below). */
static const int32_t SKEW[8] = {100, 10, 10, 10, 10, 10, 10, 10};

static void test_baselines_hand(void)
{
    fixture f;
    rp_error err;
    rp_plan *p = NULL;
    /* Without the constraint, plain KK over the ranks on tokens (equal_size false) puts
     * the 100-token sequence alone on a rank and the seven others over three ranks:
     * counts 1, 2, 2, 3 in some order. */
    if (!fixture_make(&f, 4, 1000, "", 8, SKEW)) {
        skip(8, "fixture");
        return;
    }
    is_int(rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, "token_kk", 0, false, &p, &err), RP_OK,
           "token_kk without equal_size, no constraint");
    if (p) {
        int32_t r0 = rp_plan_seq_rank(p, 0);
        is_int(rank_count(p, r0), 1, "the long sequence runs alone on its rank");
        ok(!counts_equal(p), "so the counts differ");
        rp_plan_free(p);
        p = NULL;
    }
    batch_fixture_free(&f);

    /* With it: 2 per rank, so the long one shares its rank with a 10 (KK with equal
     * sizes: the largest pairs with a smallest), and the cap of 1000 gives verl one
     * microbatch; a multiple of 2 makes it 2, one sequence each. */
    if (!fixture_make(&f, 4, 1000, "\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2", 8, SKEW)) {
        skip(6, "fixture");
        return;
    }
    is_int(rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, "token_kk", 0, false, &p, &err), RP_OK,
           "token_kk asked for equal_size false, under the constraint");
    if (p) {
        ok(counts_equal(p) && rank_count(p, 0) == 2, "every rank runs 2 sequences (the constraint wins)");
        is_int(rp_plan_num_microbatches(p), 2, "2 microbatches: verl's 1 rounded up to the multiple");
        int32_t r0 = rp_plan_seq_rank(p, 0), c0, c1;
        rp_plan_microbatch(p, r0, 0, &c0);
        rp_plan_microbatch(p, r0, 1, &c1);
        ok(c0 == 1 && c1 == 1, "the long sequence's rank splits its 2 over the 2 microbatches");
        is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_OK, "valid under the constraints");
        rp_plan_free(p);
        p = NULL;
    }
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", 3, &p, &err), RP_EINVAL,
           "an explicit count of 3 is refused");
    like(err.text, "baseline: 3 microbatches is not a multiple of 2 (trainer.microbatch_multiple)", "saying why");
    batch_fixture_free(&f);
}

static void test_every_packer(void)
{
    static const char *const trainers[] = {
        "\"equal_sequences_per_rank\": true",
        "\"microbatch_multiple\": 3",
        "\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2",
    };
    static const char *const packings[] = {"token_kk", "verl_kk", "attn_kk"};
    int32_t lens[24];
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < 24; i++) lens[i] = 3 + (int32_t)rnd(60);
        fixture f;
        rp_error err;
        if (!fixture_make(&f, 2, 70, trainers[t], 24, lens)) {
            skip(10, "fixture");
            continue;
        }
        const rp_trainer *tr = rp_config_trainer(f.cfg);
        for (const char *const *b = rp_baseline_names(); *b; b++) {
            rp_plan *p = NULL;
            rp_status st = rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, *b, 0, &p, &err);
            if (tr->equal_sequences_per_rank && !strncmp(*b, "slime_", 6)) {
                /* slime's ranks run different sequence counts: refused, naming the key */
                ok(st == RP_EINVAL && strstr(err.text, "trainer.equal_sequences_per_rank"),
                   "{%s}: %s is refused, naming the key", trainers[t], *b);
                continue;
            }
            ok(st == RP_OK && rp_plan_num_microbatches(p) % tr->microbatch_multiple == 0 &&
                   (!tr->equal_sequences_per_rank || counts_equal(p)) && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
               "{%s}: %s honours it (%d microbatches)", trainers[t], *b, p ? rp_plan_num_microbatches(p) : -1);
            rp_plan_free(p);
        }
        for (int k = 0; k < 3; k++) {
            rp_plan *p = NULL;
            rp_status st = rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, packings[k], 0, false, &p, &err);
            ok(st == RP_OK && rp_plan_num_microbatches(p) % tr->microbatch_multiple == 0 &&
                   (!tr->equal_sequences_per_rank || counts_equal(p)) && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
               "{%s}: rp_baseline_packing %s (equal_size false) honours it", trainers[t], packings[k]);
            rp_plan_free(p);
        }
        /* the joint planner, with its balancing swaps and a local search that moves */
        rp_joint_params jp = rp_joint_defaults();
        jp.refine_evaluations = 400;
        rp_plan *p = NULL;
        rp_joint_report rep;
        rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, &rep, &err);
        if (st != RP_OK) diag("joint: %s", err.text);
        ok(st == RP_OK && rp_plan_num_microbatches(p) % tr->microbatch_multiple == 0 &&
               (!tr->equal_sequences_per_rank || counts_equal(p)) && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
           "{%s}: the joint planner honours it (%d microbatches, chose %s)", trainers[t],
           p ? rp_plan_num_microbatches(p) : -1, st == RP_OK ? rep.chosen : "-");
        rp_plan_free(p);
        batch_fixture_free(&f);
    }
}

/* The joint planner's own packing (no fallbacks to hide behind), and the search alone. */
static void test_joint_and_search(void)
{
    int32_t lens[32];
    for (int i = 0; i < 32; i++) lens[i] = i < 4 ? 60 : 3 + (int32_t)rnd(20);
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 2, 80, "\"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2", 32, lens)) {
        skip(5, "fixture");
        return;
    }
    static const char *const none[] = {NULL};
    rp_joint_params jp = rp_joint_defaults();
    jp.fallbacks = none;
    jp.refine_evaluations = 2000;
    rp_plan *p = NULL;
    rp_joint_report rep;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, &rep, &err), RP_OK,
           "the joint planner without fallbacks");
    if (p) {
        ok(counts_equal(p) && rank_count(p, 0) == 8, "8 sequences on every rank after packing, swaps and search");
        ok(rp_plan_num_microbatches(p) % 2 == 0, "an even microbatch count (%d)", rp_plan_num_microbatches(p));
        is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_OK, "valid");
        rp_plan_free(p);
    }
    jp.num_microbatches = 3;
    p = NULL;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, &rep, &err), RP_EINVAL,
           "an explicit odd count is refused");
    like(err.text, "joint: 3 microbatches is not a multiple of 2 (trainer.microbatch_multiple)", "saying why");
    rp_plan_free(p);
    batch_fixture_free(&f);

    /* the search's moves keep each rank's count */
    if (!fixture_make(&f, 2, 80, "\"equal_sequences_per_rank\": true", 32, lens)) {
        skip(2, "fixture");
        return;
    }
    p = NULL;
    rp_cost *cost = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &p, &err);
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err);
    rp_search_params sp = rp_search_defaults();
    sp.swaps = false; /* moves alone */
    sp.slots = false;
    sp.max_evaluations = 3000;
    rp_search_result sr;
    is_int(rp_search_local(cost, p, &sp, &sr, &err), RP_OK, "a search of moves only");
    ok(counts_equal(p) && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
       "moves stay inside a rank: counts equal, plan valid (%lld moves applied)", (long long)sr.moves);
    rp_cost_free(cost);
    rp_plan_free(p);
    batch_fixture_free(&f);
}

static void test_not_divisible(void)
{
    static const int32_t lens[10] = {10, 20, 30, 40, 50, 10, 20, 30, 40, 50};
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 2, 100, "\"equal_sequences_per_rank\": true", 10, lens)) {
        skip(4, "fixture");
        return;
    }
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "verl_kk+contiguous", 0, &p, &err), RP_EINVAL,
           "a baseline refuses 10 sequences over 4 ranks");
    is_str(err.text,
           "baseline: the batch has 10 sequences, which do not divide over the 4 DP ranks; "
           "trainer.equal_sequences_per_rank needs the same count on every rank (verl's DataProto.chunk): give "
           "the step a multiple of 4 sequences or turn the key off",
           "naming both numbers and the key");
    rp_joint_params jp = rp_joint_defaults();
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, NULL, &err), RP_EINVAL,
           "so does the joint planner");
    like(err.text, "joint: the batch has 10 sequences, which do not divide over the 4 DP ranks", "in the same words");
    batch_fixture_free(&f);
}

/* ---- trainer.nonempty_microbatches ---- */

static int32_t empty_cells(const rp_plan *p)
{
    int32_t empty = 0;
    for (int32_t g = 0; g < rp_plan_num_gpus(p); g++)
        for (int32_t m = 0; m < rp_plan_num_microbatches(p); m++) {
            int32_t c;
            rp_plan_microbatch(p, g, m, &c);
            empty += c == 0;
        }
    return empty;
}

static void test_nonempty_config_and_validation(void)
{
    rp_config *cfg = NULL;
    rp_error err;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}}", &cfg, &err), RP_OK, "no trainer section");
    if (cfg) ok(!rp_config_trainer(cfg)->nonempty_microbatches, "nonempty_microbatches defaults to false");
    rp_config_free(cfg);
    cfg = NULL;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"trainer\": {\"nonempty_microbatches\": true}}", &cfg, &err), RP_OK,
           "nonempty_microbatches given");
    if (cfg) ok(rp_config_trainer(cfg)->nonempty_microbatches, "read as given");
    rp_config_free(cfg);
    cfg = NULL;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"trainer\": {\"nonempty_microbatches\": \"yes\"}}", &cfg, &err),
           RP_EINVAL, "nonempty_microbatches must be a boolean");
    like(err.text, "trainer.nonempty_microbatches must be true or false", "named");

    /* 8 sequences over 4 ranks in 3 microbatches: every rank has an empty one */
    static const int32_t lens[8] = {10, 20, 30, 40, 50, 15, 25, 35};
    fixture off, on;
    if (!fixture_make(&off, 4, 100, "", 8, lens)) {
        skip(6, "fixture");
        return;
    }
    if (!fixture_make(&on, 4, 100, "\"nonempty_microbatches\": true", 8, lens)) {
        batch_fixture_free(&off);
        skip(6, "fixture");
        return;
    }
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, off.cfg, off.batch, off.stats, NULL, "token_kk+contiguous", 3, &p, &err), RP_OK,
           "without the key, 3 microbatches of 8 sequences over 4 ranks");
    if (p) {
        ok(empty_cells(p) > 0, "leave empty microbatches (%d)", empty_cells(p));
        is_int(rp_plan_validate(p, off.cfg, off.batch, &err), RP_OK, "valid without the key");
        is_int(rp_plan_validate(p, on.cfg, on.batch, &err), RP_EPLAN, "refused under it");
        like(err.text, "rank 0 microbatch 2 runs no sequence, but trainer.nonempty_microbatches needs "
             "one in every microbatch (3 microbatches per rank)", "naming rank and microbatch");
        rp_plan_free(p);
        p = NULL;
    }
    /* fewer sequences per rank than microbatches: every packer says so */
    is_int(rp_baseline_plan(ctx, on.cfg, on.batch, on.stats, NULL, "token_kk+contiguous", 3, &p, &err), RP_EINVAL,
           "a baseline refuses 3 microbatches for 2 sequences a rank");
    is_str(err.text,
           "baseline: 3 microbatches on each of 4 DP ranks need at least 12 sequences, but the batch has 8 "
           "(trainer.nonempty_microbatches needs a sequence in every microbatch): give the step more sequences, "
           "fewer microbatches, or turn the key off",
           "naming both numbers and the key");
    rp_joint_params jp = rp_joint_defaults();
    jp.num_microbatches = 3;
    is_int(rp_joint_plan(ctx, on.cfg, on.batch, on.stats, NULL, NULL, &jp, &p, NULL, &err), RP_EINVAL,
           "so does the joint planner");
    is_str(err.text,
           "joint: 3 microbatches on each of 4 DP ranks need at least 12 sequences, but the batch has 8 "
           "(trainer.nonempty_microbatches needs a sequence in every microbatch): give the step more sequences, "
           "fewer microbatches, or turn the key off",
           "naming the numbers and the key");
    rp_plan_free(p);
    batch_fixture_free(&off);
    batch_fixture_free(&on);
}

/* Every packer on random batches, at fixed and chosen counts, leaves no cell empty under
 * the key (the joint packing without the key does, on the same batches: counted). */
static void test_nonempty_every_packer(void)
{
    static const char *const trainers[] = {
        "\"nonempty_microbatches\": true",
        "\"nonempty_microbatches\": true, \"equal_sequences_per_rank\": true",
        "\"nonempty_microbatches\": true, \"microbatch_multiple\": 2",
    };
    static const char *const none[] = {NULL};
    int32_t lens[16];
    int32_t joint_empty_off = 0;
    for (int round = 0; round < 6; round++) {
        for (int i = 0; i < 16; i++) lens[i] = i < 2 + round % 3 ? 50 + (int32_t)rnd(30) : 3 + (int32_t)rnd(40);
        for (int t = 0; t < 3; t++) {
            fixture f, off;
            rp_error err;
            if (!fixture_make(&f, 2, 80, trainers[t], 16, lens)) {
                skip(1, "fixture");
                continue;
            }
            if (!fixture_make(&off, 2, 80, "", 16, lens)) {
                batch_fixture_free(&f);
                skip(1, "fixture");
                continue;
            }
            bool all = true;
            char why[RP_ERROR_TEXT + 64] = "";
            for (int32_t fixed = 0; fixed <= 4; fixed += t == 2 ? 2 : 1) {
                if (fixed == 1) continue;
                for (const char *const *b = rp_baseline_names(); *b; b++) {
                    rp_plan *p = NULL;
                    rp_status st = rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, *b, fixed, &p, &err);
                    if (rp_config_trainer(f.cfg)->equal_sequences_per_rank && !strncmp(*b, "slime_", 6)) {
                        all &= st == RP_EINVAL; /* slime's ranks run different sequence counts */
                        continue;
                    }
                    if (st != RP_OK || empty_cells(p) || rp_plan_validate(p, f.cfg, f.batch, NULL) != RP_OK) {
                        all = false;
                        snprintf(why, sizeof why, "%s at %d: %s", *b, fixed, st != RP_OK ? err.text : "empty cell");
                    }
                    rp_plan_free(p);
                }
                rp_joint_params jp = rp_joint_defaults();
                jp.fallbacks = none;
                jp.refine_evaluations = 300;
                jp.num_microbatches = fixed;
                rp_plan *p = NULL;
                rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, NULL, &err);
                if (st != RP_OK || empty_cells(p) || rp_plan_validate(p, f.cfg, f.batch, NULL) != RP_OK) {
                    all = false;
                    snprintf(why, sizeof why, "joint at %d: %s", fixed, st != RP_OK ? err.text : "empty cell");
                }
                rp_plan_free(p);
                p = NULL;
                jp.refine_evaluations = 0;
                if (t == 0 && fixed > 0 &&
                    rp_joint_plan(ctx, off.cfg, off.batch, off.stats, NULL, NULL, &jp, &p, NULL, &err) == RP_OK)
                    joint_empty_off += empty_cells(p);
                rp_plan_free(p);
            }
            ok(all, "round %d {%s}: every baseline and the joint planner (packing, swaps, search) fill every "
               "microbatch %s", round, trainers[t], why);
            batch_fixture_free(&f);
            batch_fixture_free(&off);
        }
    }
    ok(joint_empty_off > 0, "without the key the joint packing leaves %d cells empty on the same batches",
       joint_empty_off);

    /* the search's moves alone never empty a cell */
    for (int i = 0; i < 16; i++) lens[i] = 3 + (int32_t)rnd(60);
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 2, 80, trainers[0], 16, lens)) {
        skip(2, "fixture");
        return;
    }
    rp_plan *p = NULL;
    rp_cost *cost = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 4, &p, &err);
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err);
    rp_search_params sp = rp_search_defaults();
    sp.swaps = false;
    sp.slots = false;
    sp.max_evaluations = 3000;
    rp_search_result sr;
    is_int(rp_search_local(cost, p, &sp, &sr, &err), RP_OK, "a search of moves only, 4 sequences a rank in 4");
    ok(p && empty_cells(p) == 0 && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
       "no move empties a cell (%lld moves applied)", (long long)sr.moves);
    rp_cost_free(cost);
    rp_plan_free(p);
    batch_fixture_free(&f);
}

/* The joint packing keeps the key as a rule of its greedy fill (joint_pack_open), not by
 * moving sequences afterwards: 8 sequences, 4 GPUs in one EP group, 2 microbatches. The
 * four longest set microbatch 0's level, one a GPU, and the four short ones fit under it,
 * so without the key microbatch 1 stays empty. Under the key the greedy places as before
 * while enough sequences remain for the empty cells; from the fifth on (4 left, 4 cells
 * empty) each goes to an empty cell: the short ones make microbatch 1, one a GPU, in
 * order (equal raises: the lower GPU). The repair after packing this replaces moved
 * the shortest sequence of the fullest cell into each empty one instead (3 tokens to
 * GPU 0, 4 to GPU 1, 2 to GPU 2, 5 to GPU 3). */
static void test_nonempty_packing_rule(void)
{
    static const int32_t lens[8] = {60, 50, 40, 30, 5, 4, 3, 2};
    static const char *const none[] = {NULL};
    static const int32_t want_rank[8] = {0, 1, 2, 3, 0, 1, 2, 3}, want_mb[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    fixture off, on;
    if (!fixture_make(&off, 4, 100, "", 8, lens) || !fixture_make(&on, 4, 100, "\"nonempty_microbatches\": true", 8, lens)) {
        skip(4, "fixture");
        return;
    }
    rp_joint_params jp = rp_joint_defaults();
    jp.fallbacks = none;
    jp.refine_evaluations = 0;
    jp.num_microbatches = 2;
    rp_error err;
    rp_plan *p = NULL;
    is_int(rp_joint_plan(ctx, off.cfg, off.batch, off.stats, NULL, NULL, &jp, &p, NULL, &err), RP_OK, "joint plan, key off");
    if (p) {
        is_int(empty_cells(p), 4, "without the key microbatch 1 is empty on every GPU");
    }
    rp_plan_free(p);
    p = NULL;
    is_int(rp_joint_plan(ctx, on.cfg, on.batch, on.stats, NULL, NULL, &jp, &p, NULL, &err), RP_OK, "joint plan, key on");
    if (p) {
        bool same = true;
        char got[256] = "";
        size_t used = 0;
        for (int32_t s = 0; s < 8; s++) {
            same = same && rp_plan_seq_rank(p, s) == want_rank[s] && rp_plan_seq_microbatch(p, s) == want_mb[s];
            used += (size_t)snprintf(got + used, sizeof got - used, " %d/%d", rp_plan_seq_rank(p, s), rp_plan_seq_microbatch(p, s));
        }
        ok(same, "under the key: the long ones on GPUs 0-3 in microbatch 0, the short ones on GPUs 0-3 in microbatch 1 (got rank/mb:%s)", got);
    }
    rp_plan_free(p);
    p = NULL;
    batch_fixture_free(&off);
    batch_fixture_free(&on);

    /* Karmarkar-Karp without equal sizes (rp_baseline_packing) gives the long sequence a
     * rank of its own: 1 sequence for 2 microbatches there, though the batch has 8 for 8
     * cells */
    static const int32_t lone[8] = {90, 10, 10, 10, 10, 10, 10, 10};
    if (!fixture_make(&on, 4, 100, "\"nonempty_microbatches\": true", 8, lone)) {
        skip(2, "fixture");
        return;
    }
    is_int(rp_baseline_packing(ctx, on.cfg, on.batch, on.stats, "token_kk", 2, false, &p, &err), RP_EINVAL,
           "a baseline rank with fewer sequences than microbatches is refused");
    like(err.text, "runs 1 sequences, fewer than its 2 microbatches (trainer.nonempty_microbatches needs a sequence "
         "in every microbatch): give the step more sequences, fewer microbatches, or turn the key off",
         "naming the rank's count, the microbatches and the key");
    rp_plan_free(p);
    batch_fixture_free(&on);
}

/* ---- trainer.per_forward_balancer ---- */

/* Whether the trainer runs Megatron's per-forward balancer at all: read (default: whether
 * execution.executor runs it, so false on the default routepack_torch),
 * refused beside execution.per_forward_balancing "virtual_experts", and where false no
 * plan may ask for the balancer (rp_vexp_check_config, so rp_plan_validate, the
 * *+virtual_experts baselines and the joint planner's candidate all follow it). */
static void test_per_forward_balancer(void)
{
    rp_config *cfg = NULL;
    rp_error err;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}}", &cfg, &err), RP_OK, "no trainer section");
    if (cfg) ok(!rp_config_trainer(cfg)->per_forward_balancer, "per_forward_balancer defaults to false (routepack_torch)");
    rp_config_free(cfg);
    cfg = NULL;
    static const char *const runs[] = {"megatron_balancer", "ideal"}, *const lacks[] = {"megatron_alltoall", "deepep"};
    for (int i = 0; i < 2; i++) {
        char json[1024];
        /* 2 slots a GPU: 8 experts held once, which every executor can run */
        snprintf(json, sizeof json, BASE_CONFIG_SLOTS(2) " \"limits\": {\"max_tokens_per_microbatch\": 64}, "
                 "\"execution\": {\"executor\": \"%s\"}}", runs[i]);
        is_int(parse(json, &cfg, &err), RP_OK, "executor %s", runs[i]);
        if (cfg) ok(rp_config_trainer(cfg)->per_forward_balancer, "%s: per_forward_balancer defaults to true", runs[i]);
        rp_config_free(cfg);
        cfg = NULL;
        snprintf(json, sizeof json, BASE_CONFIG_SLOTS(2) " \"limits\": {\"max_tokens_per_microbatch\": 64}, "
                 "\"execution\": {\"executor\": \"%s\"}}", lacks[i]);
        is_int(parse(json, &cfg, &err), RP_OK, "executor %s", lacks[i]);
        if (cfg) ok(!rp_config_trainer(cfg)->per_forward_balancer, "%s: per_forward_balancer defaults to false", lacks[i]);
        rp_config_free(cfg);
        cfg = NULL;
    }
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"trainer\": {\"per_forward_balancer\": false}}",
                 &cfg, &err),
           RP_OK, "per_forward_balancer given");
    if (cfg) ok(!rp_config_trainer(cfg)->per_forward_balancer, "read as given");
    rp_config_free(cfg);
    cfg = NULL;
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"trainer\": {\"per_forward_balancer\": 1}}", &cfg,
                 &err),
           RP_EINVAL, "per_forward_balancer must be a boolean");
    like(err.text, "trainer.per_forward_balancer must be true or false", "named");
    is_int(parse(BASE_CONFIG " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"execution\": {\"per_forward_balancing\": "
                 "\"virtual_experts\"}, \"trainer\": {\"per_forward_balancer\": false}}",
                 &cfg, &err),
           RP_EINVAL, "a trainer that always runs the balancer cannot lack it");
    like(err.text, "execution.per_forward_balancing is \"virtual_experts\", but virtual experts: "
         "trainer.per_forward_balancer is false", "naming both keys");
    rp_config_free(cfg);
    cfg = NULL;

    static const int32_t lens[8] = {10, 20, 30, 40, 50, 15, 25, 35};
    fixture on, off;
    if (!fixture_make(&on, 4, 100, "", 8, lens)) {
        skip(9, "fixture");
        return;
    }
    if (!fixture_make(&off, 4, 100, "\"per_forward_balancer\": false", 8, lens)) {
        batch_fixture_free(&on);
        skip(9, "fixture");
        return;
    }
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, on.cfg, on.batch, on.stats, NULL, "token_kk+virtual_experts", 2, &p, &err), RP_OK,
           "token_kk+virtual_experts where the trainer runs the balancer");
    if (p) {
        is_int(rp_plan_validate(p, off.cfg, off.batch, &err), RP_EPLAN, "its plan is refused where it does not");
        is_str(err.text,
               "plan: per_forward_balancing virtual_experts: virtual experts: trainer.per_forward_balancer is false: "
               "the trainer does not run Megatron's per-forward balancer; plan without it, or set the key true where "
               "the trainer runs it",
               "naming the key and what to do");
    }
    rp_plan_free(p);
    p = NULL;
    is_int(rp_baseline_plan(ctx, off.cfg, off.batch, off.stats, NULL, "token_kk+virtual_experts", 2, &p, &err),
           RP_EINVAL, "the baseline itself is refused there");
    like(err.text, "trainer.per_forward_balancer is false", "with the same reason");
    rp_plan_free(p);
    p = NULL;

    /* the joint planner's candidate with the balancer: scored where the trainer runs it,
     * never built where it does not */
    static const char *const none[] = {NULL};
    rp_joint_params jp = rp_joint_defaults();
    jp.fallbacks = none;
    jp.virtual_experts = true;
    rp_joint_report rep;
    is_int(rp_joint_plan(ctx, on.cfg, on.batch, on.stats, NULL, NULL, &jp, &p, &rep, &err), RP_OK, "joint, key true");
    ok(!isnan(rep.virtual_experts_step_s), "the candidate with the balancer is scored (%g s)", rep.virtual_experts_step_s);
    rp_plan_free(p);
    p = NULL;
    is_int(rp_joint_plan(ctx, off.cfg, off.batch, off.stats, NULL, NULL, &jp, &p, &rep, &err), RP_OK, "joint, key false");
    ok(isnan(rep.virtual_experts_step_s) && !rep.per_forward_balancing && p &&
           rp_plan_balancing(p) == RP_BALANCING_NONE && rp_plan_validate(p, off.cfg, off.batch, NULL) == RP_OK,
       "no candidate with the balancer, a valid plan without it");
    rp_plan_free(p);
    batch_fixture_free(&on);
    batch_fixture_free(&off);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_config();
    test_validation();
    test_baselines_hand();
    test_every_packer();
    test_joint_and_search();
    test_not_divisible();
    test_nonempty_config_and_validation();
    test_nonempty_every_packer();
    test_nonempty_packing_rule();
    test_per_forward_balancer();
    rp_context_free(ctx);
    return tap_done();
}
