/* The joint planner: deterministic bit for bit, never an invalid plan on randomized
 * batches of awkward shapes, never worse than the baselines under the cost model,
 * migration-aware, ablations and refinement valid, bad input and allocation failures
 * handled cleanly. */
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

/* Members of the configs' "execution" object (empty: the defaults). */
static const char *config_execution = "";

/* A config of `nodes` x `gpn` GPUs in EP groups of `ep`, `slots` slots per GPU, L layers
 * of E experts, top-K, a cap of `cap` tokens. */
static rp_config *make_config(int nodes, int gpn, int ep, int slots, int L, int E, int K, int cap,
                              const char *extra_topology)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d%s},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": %d, \"hidden_size\": 256,"
             "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
             " \"limits\": {\"max_tokens_per_microbatch\": %d}, \"execution\": {%s}}",
             nodes, gpn, ep, slots, extra_topology ? extra_topology : "", L, E, K, cap, config_execution);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

/* Routing: each group of 4 sequences prefers a window of experts (skew `hot`: 0 spreads
 * evenly, 1 sends every choice of every token to experts 0..K-1, i.e. one expert takes
 * all tokens at K = 1). */
static bool fixture_make(fixture *f, rp_config *cfg, int32_t n, const int32_t *lens, double hot)
{
    memset(f, 0, sizeof *f);
    f->cfg = cfg;
    if (!cfg) return false;
    const rp_model *md = rp_config_model(cfg);
    const int32_t E = md->num_experts, K = md->top_k, L = md->num_layers;
    int32_t *gid = calloc((size_t)n + 1, sizeof *gid);
    for (int32_t s = 0; s < n; s++) gid[s] = s / 4;
    rp_error err;
    bool made = batch_fixture_batch(ctx, f, n, lens, gid, NULL, &err);
    free(gid);
    if (!made) return false;
    const int64_t per = (int64_t)L * K;
    const int64_t *cu = rp_batch_cu_seqlens(f->batch);
    for (int32_t s = 0; s < n; s++) {
        int32_t pref = (int32_t)rnd((uint32_t)E);
        for (int64_t t = cu[s]; t < cu[s + 1]; t++)
            for (int32_t l = 0; l < L; l++) {
                uint8_t *out = f->ids + t * per + (int64_t)l * K;
                int32_t start;
                if (hot >= 1.0) start = 0;
                else if (rnd(1000) < (uint32_t)(hot * 1000)) start = (pref + l * 3) % E;
                else start = (int32_t)rnd((uint32_t)E);
                for (int32_t k = 0; k < K; k++) out[k] = (uint8_t)((start + k) % E);
            }
    }
    if (!batch_fixture_stats(ctx, f, &err)) {
        diag("stats: %s", err.text);
        return false;
    }
    return true;
}

static const char *const no_fallbacks[] = {NULL};

static double step_of(const fixture *f, const rp_plan *p)
{
    rp_cost *c = NULL;
    rp_cost_summary s = {0};
    if (rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, &c, NULL) != RP_OK) return NAN;
    rp_status st = rp_cost_evaluate(c, p, &s, NULL);
    rp_cost_free(c);
    return st == RP_OK ? s.step_s : NAN;
}

/* ---- determinism ---- */

static void test_determinism(void)
{
    int32_t lens[48];
    for (int i = 0; i < 48; i++) lens[i] = 20 + (int32_t)rnd(400);
    fixture f;
    if (!fixture_make(&f, make_config(2, 4, 4, 3, 3, 8, 2, 1024, NULL), 48, lens, 0.7)) {
        skip(4, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_joint_params par = rp_joint_defaults();
    par.refine_evaluations = 200;
    par.balance_evaluations = 500;
    rp_plan *a = NULL, *b = NULL, *c = NULL;
    rp_error err;
    rp_joint_report ra, rb;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &a, &ra, &err), RP_OK, "plans");
    /* a fresh context and a shared evaluator must not change anything */
    rp_context *other;
    rp_context_new(NULL, NULL, &other);
    rp_cost *cost = NULL;
    rp_cost_new(other, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, NULL);
    is_int(rp_joint_plan(other, f.cfg, f.batch, f.stats, NULL, cost, &par, &b, &rb, &err), RP_OK, "plans again");
    ok(a && b && rp_plan_hash(a) == rp_plan_hash(b), "the same inputs give the same plan, bit for bit");
    ok(ra.step_s == rb.step_s && ra.joint_step_s == rb.joint_step_s && !strcmp(ra.chosen, rb.chosen),
       "and the same report");
    /* with a previous plan too */
    rp_plan *d = NULL;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, a, NULL, &par, &c, NULL, &err);
    rp_joint_plan(other, f.cfg, f.batch, f.stats, b, cost, &par, &d, NULL, &err);
    ok(c && d && rp_plan_hash(c) == rp_plan_hash(d), "deterministic with a previous plan");
    rp_plan_free(a);
    rp_plan_free(b);
    rp_plan_free(c);
    rp_plan_free(d);
    rp_cost_free(cost);
    rp_context_free(other);
    batch_fixture_free(&f);
}

/* ---- property: always a valid plan ---- */

typedef struct shape {
    const char *name;
    int nodes, gpn, ep, slots, L, E, K, cap;
} shape;

static void test_random_batches(void)
{
    const shape shapes[] = {
        {"1 node, EP 4", 1, 4, 4, 3, 2, 8, 2, 600},
        {"2 nodes, EP 2 per node", 2, 2, 2, 5, 3, 8, 2, 500},
        {"2 nodes, EP 4 across nodes", 2, 2, 4, 3, 2, 8, 2, 700},
        {"4 nodes, EP 8 across nodes, uneven", 4, 2, 8, 2, 2, 12, 3, 400},
        {"one GPU", 1, 1, 1, 8, 2, 8, 2, 800},
        {"no spare slots", 1, 4, 4, 2, 2, 8, 1, 900},
    };
    const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
    int plans = 0, invalid = 0, failures = 0, worse = 0;
    char first_problem[RP_ERROR_TEXT + 128] = "";
    /* every (sync, overlap) pair: the surrogates take the group or the global form */
    static const char *const executions[4] = {"", "\"overlap\": \"layer\"", "\"sync\": \"global\"",
                                              "\"sync\": \"global\", \"overlap\": \"layer\""};
    for (int seed = 0; seed < 60; seed++) {
        const shape *sh = &shapes[seed % nshapes];
        config_execution = executions[(seed / 7) % 4];
        int kind = (seed / nshapes) % 5;
        int32_t n = 1 + (int32_t)rnd(40), lens[64];
        const char *what = "random lengths";
        double hot = rnd(3) == 0 ? 0.0 : 0.8;
        for (int32_t i = 0; i < n; i++) lens[i] = 1 + (int32_t)rnd((uint32_t)sh->cap / 3);
        if (kind == 1) { /* a single huge sequence */
            lens[rnd((uint32_t)n)] = sh->cap;
            what = "a single huge sequence";
        } else if (kind == 2) {
            for (int32_t i = 0; i < n; i++) lens[i] = 37;
            what = "all lengths equal";
        } else if (kind == 3) {
            hot = 1.0;
            what = "one expert set takes all tokens";
        } else if (kind == 4) {
            n = 1 + (int32_t)rnd(3); /* more GPUs than sequences */
            for (int32_t i = 0; i < n; i++) lens[i] = 1 + (int32_t)rnd(50);
            what = "more GPUs than sequences";
        }
        if (rnd(7) == 0) lens[rnd((uint32_t)n)] = 0; /* an empty sequence */
        fixture f;
        if (!fixture_make(&f, make_config(sh->nodes, sh->gpn, sh->ep, sh->slots, sh->L, sh->E, sh->K, sh->cap, NULL),
                          n, lens, hot)) {
            failures++;
            batch_fixture_free(&f);
            continue;
        }
        rp_joint_params par = rp_joint_defaults();
        par.fallbacks = no_fallbacks;
        par.balance_evaluations = seed % 2 ? 300 : 0;
        par.max_extra_per_rank = seed % 3;
        par.refine_evaluations = seed % 4 == 0 ? 50 : 0;
        par.horizon_steps = seed % 5 == 0 ? INFINITY : 10;
        rp_plan *p = NULL, *p2 = NULL;
        rp_error err;
        rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err);
        if (st != RP_OK) {
            failures++;
            if (!*first_problem) snprintf(first_problem, sizeof first_problem, "%s, %s: %s", sh->name, what, err.text);
        } else {
            plans++;
            if (rp_plan_validate(p, f.cfg, f.batch, &err) != RP_OK || !isfinite(step_of(&f, p))) {
                invalid++;
                if (!*first_problem)
                    snprintf(first_problem, sizeof first_problem, "%s, %s: %s", sh->name, what, err.text);
            }
            /* the next step from this one, with the same batch: still valid */
            if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, p, NULL, &par, &p2, NULL, &err) != RP_OK ||
                rp_plan_validate(p2, f.cfg, f.batch, &err) != RP_OK) {
                invalid++;
                if (!*first_problem)
                    snprintf(first_problem, sizeof first_problem, "%s, %s, second step: %s", sh->name, what, err.text);
            }
            /* with the default fallbacks the result is no worse than token_kk+eplb */
            rp_joint_params fb = par;
            fb.fallbacks = NULL;
            rp_plan *pf = NULL, *base = NULL;
            if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &fb, &pf, NULL, &err) == RP_OK &&
                rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", 0, &base, &err) == RP_OK) {
                if (!(step_of(&f, pf) <= step_of(&f, base))) worse++;
            } else {
                failures++;
            }
            rp_plan_free(pf);
            rp_plan_free(base);
        }
        rp_plan_free(p);
        rp_plan_free(p2);
        batch_fixture_free(&f);
    }
    config_execution = "";
    if (*first_problem) diag("first problem: %s", first_problem);
    is_int(failures, 0, "60 randomized batches of 6 shapes (huge sequence, equal lengths, one hot expert set, "
                        "more GPUs than sequences, empty sequences), under every (sync, overlap) pair, all plan");
    is_int(invalid, 0, "every plan (%d, and the step after each) is valid and evaluates", plans);
    is_int(worse, 0, "with fallbacks, never worse than token_kk+eplb");
}

/* ---- never worse than the baselines, and the joint candidate itself wins ---- */

static rp_gen *small_gen(uint64_t seed, double concentration)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"seed\": %llu, \"num_prompts\": 16, \"group_size\": 4, \"threads\": 1,"
             " \"model\": {\"num_layers\": 4, \"num_experts\": 16, \"top_k\": 4},"
             " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\","
             "  \"model\": \"allenai/OLMoE-1B-7B-0924\", \"domains\": {\"c4\": 0.5, \"tulu\": 0.5},"
             "  \"concentration\": %g},"
             " \"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\"}, \"prompt_scale\": 0.05,"
             "  \"response\": {\"lognormal\": {\"median\": 60, \"sigma\": 1.0}, \"cap\": 600}}}",
             (unsigned long long)seed, concentration);
    rp_gen *g = NULL;
    rp_error err;
    if (rp_gen_parse(ctx, json, strlen(json), "<test>", RP_SOURCE_DIR "/examples", &g, &err) != RP_OK)
        diag("gen: %s", err.text);
    return g;
}

/* 2 nodes x 4 GPUs, EP 4 inside each node (2 groups), 5 slots for 16 experts. */
static bool gen_fixture(fixture *f, rp_gen *g, int32_t step)
{
    memset(f, 0, sizeof *f);
    f->cfg = make_config(2, 4, 4, 5, 4, 16, 4, 1024, NULL);
    rp_routing r;
    rp_error err;
    if (!f->cfg || rp_gen_step(g, step, &f->batch, &r, &err) != RP_OK) return false;
    return rp_stats_compute(ctx, f->batch, &r, 16, 1, &f->stats, &err) == RP_OK;
}

static void test_never_worse(void)
{
    const char *names[] = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb"};
    int batches = 0, worse = 0, joint_wins = 0, report_bad = 0;
    for (int b = 0; b < 6; b++) {
        rp_gen *g = small_gen(100 + b, b % 2 ? 4 : 16);
        fixture f;
        if (!g || !gen_fixture(&f, g, 0)) {
            rp_gen_free(g);
            batch_fixture_free(&f);
            continue;
        }
        batches++;
        rp_plan *p = NULL, *pure = NULL;
        rp_joint_report rep, rep_pure;
        rp_error err;
        rp_joint_params par = rp_joint_defaults();
        if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, &rep, &err) != RP_OK) {
            diag("joint: %s", err.text);
            worse++;
        } else {
            double mine = step_of(&f, p), best_base = INFINITY;
            if (!(fabs(mine - rep.step_s) <= 1e-12 * mine)) report_bad++;
            for (int i = 0; i < 4; i++) {
                rp_plan *base = NULL;
                if (rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, names[i], 0, &base, NULL) == RP_OK) {
                    double s = step_of(&f, base);
                    if (s < best_base) best_base = s;
                    if (mine > s) worse++;
                }
                rp_plan_free(base);
            }
            par.fallbacks = no_fallbacks;
            if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &pure, &rep_pure, &err) == RP_OK &&
                step_of(&f, pure) < best_base)
                joint_wins++;
            if (!(rep.best_fallback_step_s >= rep.step_s)) report_bad++;
        }
        rp_plan_free(p);
        rp_plan_free(pure);
        batch_fixture_free(&f);
        rp_gen_free(g);
    }
    is_int(batches, 6, "six generated batches (OLMoE C4 and Tulu profiles, Azure prompts)");
    is_int(worse, 0, "the returned plan is never worse than any baseline under the cost model");
    is_int(report_bad, 0, "the report's step time is the returned plan's, and no fallback beat it");
    is_int(joint_wins, 6, "the joint candidate alone beats the best baseline on every one");
}

/* ---- migration awareness ---- */

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    int32_t L = rp_plan_num_layers(a), ep = rp_plan_ep_size(a), E = rp_plan_num_experts(a);
    const int32_t *sb = rp_plan_slot_begin(a);
    for (int32_t l = 0; l < L; l++) {
        const int32_t *x = rp_plan_phy2log(a, l), *y = rp_plan_phy2log(b, l);
        for (int32_t j = 0; j < ep; j++)
            for (int32_t e = 0; e < E; e++) {
                bool in_a = false, in_b = false;
                for (int32_t s = sb[j]; s < sb[j + 1]; s++) {
                    in_a |= x[s] == e;
                    in_b |= y[s] == e;
                }
                if (in_a != in_b) return false;
            }
    }
    return true;
}

static void test_migration(void)
{
    rp_gen *g = small_gen(7, 8);
    fixture f;
    if (!g || !gen_fixture(&f, g, 0)) {
        skip(7, "fixture");
        rp_gen_free(g);
        batch_fixture_free(&f);
        return;
    }
    rp_error err;
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    rp_plan *first = NULL, *kept = NULL, *moved = NULL, *contig = NULL;
    rp_joint_report rep;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &first, NULL, &err);
    /* a horizon of a millionth of a step: no saving can pay for any copy */
    par.horizon_steps = 1e-6;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, first, NULL, &par, &kept, &rep, &err), RP_OK,
           "plans with a tiny horizon");
    ok(kept && same_placement(first, kept), "with migration this expensive the placement is kept");
    is_int(rep.layers_replaced, 0, "no layer re-placed");
    is_double(rep.migration_bytes, 0, 0, "nothing migrates");

    /* a previous placement far from this step's loads: contiguous, no replicas */
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &contig, &err);
    par.horizon_steps = 100;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &moved, &rep, &err), RP_OK,
           "plans from a contiguous placement");
    ok(rep.layers_replaced > 0 && rep.migration_bytes > 0, "a big shift in loads is re-placed (%d layers, %.3g bytes)",
       rep.layers_replaced, rep.migration_bytes);
    ok(moved && contig && step_of(&f, moved) < step_of(&f, contig), "and the step is faster for it");

    /* expected loads: this step's own give the same plan as none; flat ones (no lasting
     * shift in popularity: the step's skew is noise) leave fewer layers worth moving */
    const rp_model *md = rp_config_model(f.cfg);
    size_t LE = (size_t)md->num_layers * md->num_experts;
    double *own = malloc(LE * sizeof *own), *flat = malloc(LE * sizeof *flat);
    for (int32_t l = 0; l < md->num_layers; l++)
        for (int32_t e = 0; e < md->num_experts; e++) {
            own[(size_t)l * md->num_experts + e] = (double)rp_stats_expert_load(f.stats, l)[e] * 3.0; /* any scale */
            flat[(size_t)l * md->num_experts + e] = 1.0;
        }
    rp_plan *same = NULL, *calm = NULL;
    rp_joint_report rep_flat;
    int32_t replaced_own = rep.layers_replaced;
    par.expected_loads = own;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &same, &rep, &err), RP_OK,
           "plans with the step's own loads expected");
    ok(same && moved && rp_plan_hash(same) == rp_plan_hash(moved), "the same plan as without expected loads");
    par.expected_loads = flat;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &calm, &rep_flat, &err), RP_OK,
           "plans with flat loads expected");
    ok(rep_flat.layers_replaced < replaced_own, "flat expected loads re-place fewer layers (%d, against %d)",
       rep_flat.layers_replaced, replaced_own);
    flat[5] = NAN;
    rp_plan *bad = NULL;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &bad, &rep, &err), RP_EINVAL,
           "a NaN expected load is refused");
    like(err.text, "expected_loads[5] (layer 0, expert 5)", "naming the entry");
    flat[5] = -1;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &bad, &rep, &err), RP_EINVAL,
           "a negative expected load is refused");
    ok(bad == NULL, "and no plan returned");
    par.expected_loads = NULL;
    free(own);
    free(flat);
    rp_plan_free(same);
    rp_plan_free(calm);
    rp_plan_free(first);
    rp_plan_free(kept);
    rp_plan_free(moved);
    rp_plan_free(contig);
    batch_fixture_free(&f);
    rp_gen_free(g);
}

/* ---- ablations, refinement, report ---- */

static void test_options(void)
{
    rp_gen *g = small_gen(11, 8);
    fixture f;
    if (!g || !gen_fixture(&f, g, 0)) {
        skip(6, "fixture");
        rp_gen_free(g);
        batch_fixture_free(&f);
        return;
    }
    rp_error err;
    int valid = 0;
    for (int v = 0; v < 4; v++) {
        rp_joint_params par = rp_joint_defaults();
        par.fallbacks = no_fallbacks;
        par.pack = v != 1;
        par.place = v != 2;
        par.shares = v != 3;
        par.max_extra_per_rank = v == 3 ? 0 : 2;
        rp_plan *p = NULL;
        rp_joint_report rep;
        if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, &rep, &err) == RP_OK &&
            rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK) {
            valid++;
            if (!par.place && (rp_plan_num_share_sets(p) || rp_plan_num_extra_replicas(p))) valid--;
            if (!par.shares && !par.max_extra_per_rank && rp_plan_num_share_sets(p)) valid--;
        }
        rp_plan_free(p);
    }
    is_int(valid, 4, "placement-only, packing-only, without levers: valid plans, levers only where asked");

    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    rp_plan *p0 = NULL, *p1 = NULL;
    rp_joint_report r0, r1;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p0, &r0, &err);
    ok(!r0.evaluated && isnan(r0.step_s), "without fallbacks or refinement nothing is evaluated");
    par.refine_evaluations = 300;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p1, &r1, &err);
    ok(r1.evaluated && r1.refine_evaluations > 0 && r1.refine_evaluations <= 300, "refinement spends its budget (%lld)",
       (long long)r1.refine_evaluations);
    ok(p0 && p1 && step_of(&f, p1) <= step_of(&f, p0), "and never makes the plan slower");
    par.num_microbatches = 3;
    rp_plan *p3 = NULL;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p3, &r1, &err), RP_OK, "a fixed count");
    ok(p3 && rp_plan_num_microbatches(p3) == 3 && r1.num_microbatches == 3, "is honoured");
    rp_plan_free(p0);
    rp_plan_free(p1);
    rp_plan_free(p3);
    batch_fixture_free(&f);
    rp_gen_free(g);
}

/* ---- bad input ---- */

static void test_bad_input(void)
{
    int32_t lens[12];
    for (int i = 0; i < 12; i++) lens[i] = 60 + i;
    fixture f;
    if (!fixture_make(&f, make_config(1, 4, 4, 3, 2, 8, 2, 100, NULL), 12, lens, 0.5)) {
        skip(19, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_plan *p = NULL;
    rp_error err;
    rp_joint_params par = rp_joint_defaults();
    is_int(rp_joint_plan(NULL, f.cfg, f.batch, f.stats, NULL, NULL, NULL, &p, NULL, &err), RP_EINVAL, "no context");
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, NULL, NULL, NULL, NULL, &p, NULL, &err), RP_EINVAL, "no statistics");
    par.place_rounds = -1;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_EINVAL, "negative rounds");
    like(err.text, "place_rounds = -1", "names the field");
    par = rp_joint_defaults();
    par.prompt_spread = NAN;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_EINVAL, "NaN spread");
    par = rp_joint_defaults();
    par.horizon_steps = 0;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_EINVAL, "zero horizon");
    par = rp_joint_defaults();
    const char *bad_fallbacks[] = {"token_kk+eplb", "magic+eplb", NULL};
    par.fallbacks = bad_fallbacks;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_EINVAL,
           "unknown fallback");
    like(err.text, "magic+eplb", "names it");
    par = rp_joint_defaults();
    par.num_microbatches = 1; /* 786 tokens do not fit 4 cells of 100 */
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_ERANGE,
           "a fixed count the cap cannot meet");
    ok(p == NULL, "returns no plan");

    /* statistics of another batch, a previous plan of another shape, a too long sequence */
    int32_t other_lens[3] = {5, 6, 7};
    fixture g;
    if (fixture_make(&g, make_config(1, 4, 4, 3, 2, 8, 2, 100, NULL), 3, other_lens, 0.5)) {
        is_int(rp_joint_plan(ctx, f.cfg, f.batch, g.stats, NULL, NULL, NULL, &p, NULL, &err), RP_EINVAL,
               "statistics of another batch");
        rp_plan *other = NULL;
        rp_config *cfg8 = make_config(2, 4, 4, 3, 2, 8, 2, 100, NULL);
        rp_plan_new(ctx, cfg8, 1, &other, NULL);
        rp_plan_set_contiguous(other, NULL);
        is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, other, NULL, NULL, &p, NULL, &err), RP_EINVAL,
               "a previous plan of another shape");
        like(err.text, "previous plan", "says so");
        rp_plan_free(other);
        rp_config_free(cfg8);
    } else {
        skip(3, "fixture");
    }
    batch_fixture_free(&g);
    int32_t long_lens[2] = {50, 150};
    fixture h;
    if (fixture_make(&h, make_config(1, 4, 4, 3, 2, 8, 2, 100, NULL), 2, long_lens, 0.5)) {
        is_int(rp_joint_plan(ctx, h.cfg, h.batch, h.stats, NULL, NULL, NULL, &p, NULL, &err), RP_ERANGE,
               "a sequence longer than the cap");
        like(err.text, "sequence 1", "names the sequence");
    } else {
        skip(2, "fixture");
    }
    batch_fixture_free(&h);
    batch_fixture_free(&f);
}

/* ---- allocation failures (counting_alloc: test_util.h) ---- */

static void test_alloc_failures(void)
{
    int32_t lens[16];
    for (int i = 0; i < 16; i++) lens[i] = 5 + i * 3;
    fixture f;
    if (!fixture_make(&f, make_config(2, 2, 4, 3, 2, 8, 2, 100, NULL), 16, lens, 0.6)) {
        skip(1, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_plan *prev = NULL;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, NULL, &prev, NULL, NULL);
    bool clean = true, done = false;
    long attempts = 0;
    for (long n = 1; n < 5000 && !done; n++) {
        counting c = {0};
        rp_context *cx;
        rp_context_new(counting_alloc, &c, &cx);
        long base = c.live;
        c.fail_at = c.calls + n;
        rp_plan *p = NULL;
        rp_joint_params par = rp_joint_defaults();
        par.balance_evaluations = 100;
        par.refine_evaluations = 20;
        par.fallbacks = n % 2 ? NULL : no_fallbacks;
        rp_status st = rp_joint_plan(cx, f.cfg, f.batch, f.stats, prev, NULL, &par, &p, NULL, NULL);
        attempts++;
        if (st == RP_OK) {
            done = n % 2 == 1; /* done once the run with fallbacks succeeds too */
            rp_plan_free(p);
        } else if (st != RP_ENOMEM || p != NULL) {
            clean = false;
        }
        if (c.live != base) clean = false;
        rp_context_free(cx);
    }
    ok(clean && done, "fails cleanly at every allocation and leaks nothing (%ld runs)", attempts);
    rp_plan_free(prev);
    batch_fixture_free(&f);
}

/* ---- the evaluator the caller passes: the returned plan's packing stays bound ---- */

/* rp_joint_plan with the caller's evaluator (rp.joint passes the engine's) leaves it bound
 * to the joint plan's packing, so evaluating the returned plan again (the engine does)
 * reuses the counts: it counts fewer operations than an evaluation that reads every
 * histogram. */
static void test_evaluator_reuse(void)
{
    rp_gen *g = small_gen(300, 16);
    fixture f;
    int reused = 0, ran = 0;
    if (g && gen_fixture(&f, g, 0)) {
        rp_cost *c = NULL;
        rp_plan *p = NULL, *other = NULL;
        rp_joint_report rep;
        rp_joint_params par = rp_joint_defaults();
        rp_error err;
        if (rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
            rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, c, &par, &p, &rep, &err) == RP_OK &&
            strcmp(rep.chosen, "joint") == 0 &&
            rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "attn_kk+eplb", 0, &other, &err) == RP_OK) {
            ran = 1;
            int64_t o0 = rp_cost_operations(c);
            rp_cost_evaluate(c, p, NULL, NULL);
            int64_t after_joint = rp_cost_operations(c) - o0;
            rp_cost_evaluate(c, other, NULL, NULL);
            o0 = rp_cost_operations(c);
            rp_cost_evaluate(c, p, NULL, NULL);
            int64_t after_other = rp_cost_operations(c) - o0;
            reused = after_joint < after_other;
            if (!reused) diag("operations: %lld after the planner, %lld after another packing", (long long)after_joint,
                              (long long)after_other);
        } else {
            diag("setup: %s", err.text);
        }
        rp_plan_free(p);
        rp_plan_free(other);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
    rp_gen_free(g);
    ok(ran && reused, "the caller's evaluator stays bound to the returned plan's packing (its counts are reused)");
}

/* ---- extra replicas where a cell can gain ---- */

/* No spare slot (8 experts in 4 x 2 slots) and every token on expert 0 (K = 1): shares have
 * nothing to split, the cell's busiest rank holds all of it, four times its balanced level,
 * so the extras are tried (joint_extras_may_gain) and the planner copies expert 0 out. */
static void test_extras_where_they_gain(void)
{
    int32_t lens[16];
    for (int i = 0; i < 16; i++) lens[i] = 2000 + 100 * i;
    fixture f;
    if (!fixture_make(&f, make_config(1, 4, 4, 2, 1, 8, 1, 65536, NULL), 16, lens, 1.0)) {
        skip(2, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    rp_plan *p = NULL;
    rp_error err;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, NULL, &err), RP_OK, "plans");
    ok(p && rp_plan_num_extra_replicas(p) > 0, "a cell whose one hot expert shares cannot split gets extra replicas (%d)",
       p ? rp_plan_num_extra_replicas(p) : -1);
    rp_plan_free(p);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_extras_where_they_gain();
    test_determinism();
    test_random_batches();
    test_never_worse();
    test_migration();
    test_options();
    test_bad_input();
    test_alloc_failures();
    test_evaluator_reuse();
    rp_context_free(ctx);
    return tap_done();
}
