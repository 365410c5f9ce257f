/* The joint planner's candidates and migration levers added for issue 15: the joint
 * packing run with the per-forward balancer (rp_joint_params.virtual_experts), chosen when
 * it scores better and never offered where the balancer cannot run; the joint
 * placement's recurring re-fit migration (recurring_migration_s); and the relabelling of
 * a re-placed layer's EP ranks (relabel), which keeps experts where they are. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

typedef batch_fixture fixture; /* test_util.h */

static rp_config *make_config(int nodes, int gpn, int ep, int slots)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"execution\": {\"executor\": \"ideal\"},"
             " \"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": 4, \"num_experts\": 16, \"top_k\": 4, \"hidden_size\": 256,"
             "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}",
             nodes, gpn, ep, slots);
    rp_error err;
    rp_config *cfg = test_config_parse(ctx, json, &err);
    if (!cfg) diag("config: %s", err.text);
    return cfg;
}

/* One generated step (skewed OLMoE-like routing) under `cfg` (taken over). */
static bool fixture_make(fixture *f, rp_config *cfg, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    f->cfg = cfg;
    char json[2048];
    snprintf(json, sizeof json,
             "{\"seed\": %llu, \"num_prompts\": 16, \"group_size\": 4, \"threads\": 1,"
             " \"model\": {\"num_layers\": 4, \"num_experts\": 16, \"top_k\": 4},"
             " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\","
             "  \"model\": \"allenai/OLMoE-1B-7B-0924\", \"domains\": {\"c4\": 0.5, \"tulu\": 0.5},"
             "  \"concentration\": 8},"
             " \"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\"}, \"prompt_scale\": 0.05,"
             "  \"response\": {\"lognormal\": {\"median\": 60, \"sigma\": 1.0}, \"cap\": 600}}}",
             (unsigned long long)seed);
    rp_error err;
    rp_routing r;
    if (!cfg || rp_gen_parse(ctx, json, strlen(json), "<test>", RP_SOURCE_DIR "/examples", &f->gen, &err) != RP_OK ||
        rp_gen_step(f->gen, 0, &f->batch, &r, &err) != RP_OK ||
        rp_stats_compute(ctx, f->batch, &r, 16, 1, &f->stats, &err) != RP_OK) {
        diag("fixture: %s", err.text);
        return false;
    }
    return true;
}

static const char *const no_fallbacks[] = {NULL};

static bool same_packing(const rp_plan *a, const rp_plan *b)
{
    if (rp_plan_num_seqs(a) != rp_plan_num_seqs(b) || rp_plan_num_microbatches(a) != rp_plan_num_microbatches(b))
        return false;
    for (int32_t s = 0; s < rp_plan_num_seqs(a); s++)
        if (rp_plan_seq_rank(a, s) != rp_plan_seq_rank(b, s) || rp_plan_seq_microbatch(a, s) != rp_plan_seq_microbatch(b, s))
            return false;
    return true;
}

static bool contiguous_sets(const rp_plan *p)
{
    int32_t ep = rp_plan_ep_size(p), E = rp_plan_num_experts(p);
    const int32_t *sb = rp_plan_slot_begin(p);
    for (int32_t l = 0; l < rp_plan_num_layers(p); l++) {
        const int32_t *x = rp_plan_phy2log(p, l);
        for (int32_t j = 0; j < ep; j++)
            for (int32_t s = sb[j]; s < sb[j + 1]; s++)
                if (x[s] >= 0 && x[s] / (E / ep) != j) return false;
    }
    return true;
}

/* ---- the per-forward balancer candidate ---- */

/* A fallback is weighed against the plan chosen so far, the balancer's when it beat the
 * joint one, not against the joint one it replaced: with the joint placement's re-fits
 * made dear (so the balancer's plan always beats it) and token_kk+contiguous as the one
 * fallback (nothing migrates from the contiguous placement, so its total is its step),
 * the returned plan is the better of the two on every seed, and on some seeds that is
 * the balancer's. */
static void test_fallback_against_the_balancer(void)
{
    static const char *const one_fallback[] = {"token_kk+contiguous", NULL};
    int right = 0, balancer_wins = 0, seeds = 0;
    for (uint64_t seed = 1; seed <= 24; seed++) {
        fixture f;
        if (!fixture_make(&f, make_config(1, 4, 4, 5), seed)) {
            batch_fixture_free(&f);
            continue;
        }
        rp_error err;
        rp_plan *contig = NULL, *p = NULL;
        rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &contig, &err);
        rp_joint_params par = rp_joint_defaults();
        par.fallbacks = one_fallback;
        par.virtual_experts = true;
        par.recurring_migration_s = 1e3;
        rp_joint_report rep;
        if (rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &p, &rep, &err) == RP_OK) {
            bool vx_better = rep.virtual_experts_step_s < rep.best_fallback_step_s;
            seeds++;
            balancer_wins += vx_better;
            right += vx_better ? rep.per_forward_balancing && !strcmp(rep.chosen, "joint")
                               : !strcmp(rep.chosen, "token_kk+contiguous");
            if (vx_better && strcmp(rep.chosen, "joint"))
                diag("seed %llu: balancer %.6g s, fallback %.6g s, chose %s", (unsigned long long)seed,
                     rep.virtual_experts_step_s, rep.best_fallback_step_s, rep.chosen);
        } else {
            diag("seed %llu: %s", (unsigned long long)seed, err.text);
        }
        rp_plan_free(p);
        rp_plan_free(contig);
        batch_fixture_free(&f);
    }
    ok(seeds == 24 && right == seeds, "the better of the balancer's plan and the fallback is returned (%d of %d seeds)",
       right, seeds);
    ok(balancer_wins > 0, "the balancer's plan beats the fallback on %d of them", balancer_wins);
}

static void test_virtual_experts_candidate(void)
{
    fixture f;
    if (!fixture_make(&f, make_config(2, 4, 4, 5), 7)) {
        skip(15, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_error err;
    rp_plan *contig = NULL, *own = NULL, *vx = NULL, *either = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &contig, &err);
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    ok(!par.virtual_experts, "rp_joint_defaults: no balancer candidate (the trainer may not run one)");
    rp_joint_report rep;

    /* off: the joint placement, no balancer */
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &own, &rep, &err), RP_OK,
           "plans without the candidate");
    ok(own && rp_plan_balancing(own) == RP_BALANCING_NONE && !rep.per_forward_balancing,
       "without it the plan runs without the balancer");
    ok(isnan(rep.virtual_experts_step_s), "and no candidate was scored");

    /* on, with the joint placement's re-fits too dear to stay on it: the balancer's plan */
    par.virtual_experts = true;
    par.recurring_migration_s = 1e3;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &vx, &rep, &err), RP_OK,
           "plans with the candidate and a dear re-fit");
    ok(vx && rp_plan_balancing(vx) == RP_BALANCING_VIRTUAL_EXPERTS && rep.per_forward_balancing,
       "the returned plan runs with the balancer");
    is_str(rep.chosen, "joint", "it is the joint plan (no fallback)");
    ok(vx && own && same_packing(vx, own), "with the joint packing");
    ok(vx && contiguous_sets(vx) && rp_plan_num_extra_replicas(vx) == 0 && rp_plan_num_share_sets(vx) == 0,
       "on the contiguous placement, no levers (the balancer makes its own replicas)");
    ok(vx && rp_plan_validate(vx, f.cfg, f.batch, &err) == RP_OK, "valid");
    is_double(rep.step_s, rep.virtual_experts_step_s, 0, "the report gives the candidate's step");
    is_double(rep.migration_bytes, 0, 0, "nothing migrates from the contiguous placement");

    /* on, no recurring charge: whichever scores better under step + migration / horizon */
    par.recurring_migration_s = 0;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &either, &rep, &err), RP_OK,
           "plans with the candidate");
    double joint_total = rep.joint_step_s, vx_total = rep.virtual_experts_step_s;
    if (!rep.per_forward_balancing) joint_total += rep.migration_s / par.horizon_steps;
    ok(isfinite(joint_total) && isfinite(vx_total) &&
           rep.per_forward_balancing == (vx_total < joint_total) &&
           rep.step_s == (rep.per_forward_balancing ? rep.virtual_experts_step_s : rep.joint_step_s),
       "the better of the two is returned (joint %.6g s + migration, balancer %.6g s: %s)", rep.joint_step_s,
       rep.virtual_experts_step_s, rep.per_forward_balancing ? "balancer" : "joint");

    /* after a step under the balancer its candidate is scored last: the caller's evaluator
     * stays bound to it, so evaluating the returned plan again (as the scheduler does)
     * repeats none of the work */
    rp_cost *c = NULL;
    rp_plan *next = NULL;
    par.recurring_migration_s = 1e3;
    bool bound = false;
    if (vx && rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
        rp_joint_plan(ctx, f.cfg, f.batch, f.stats, vx, c, &par, &next, &rep, &err) == RP_OK && rep.per_forward_balancing) {
        rp_cost_summary again;
        int64_t o0 = rp_cost_operations(c);
        bound = rp_cost_evaluate(c, next, &again, &err) == RP_OK && again.step_s == rep.step_s;
        int64_t repeat = rp_cost_operations(c) - o0;
        rp_cost *fresh = NULL;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err);
        o0 = rp_cost_operations(fresh);
        rp_cost_evaluate(fresh, next, NULL, &err);
        int64_t full = rp_cost_operations(fresh) - o0;
        if (!(repeat * 4 < full)) bound = false, diag("operations: %lld again, %lld in full", (long long)repeat, (long long)full);
        rp_cost_free(fresh);
    }
    ok(bound, "after a balancer step, the returned balancer plan is the one the evaluator is bound to");
    rp_plan_free(next);
    rp_cost_free(c);

    rp_plan *bad = NULL;
    par.recurring_migration_s = -1;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &bad, &rep, &err), RP_EINVAL,
           "a negative recurring migration is refused");
    like(err.text, "recurring_migration_s = -1", "naming the field and value");
    par.recurring_migration_s = NAN;
    ok(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, contig, NULL, &par, &bad, &rep, &err) == RP_EINVAL && !bad,
       "so is NaN, and no plan is returned");
    rp_plan_free(contig);
    rp_plan_free(own);
    rp_plan_free(vx);
    rp_plan_free(either);
    batch_fixture_free(&f);

    /* an EP group across nodes: the balancer cannot run, so it is never offered */
    if (!fixture_make(&f, make_config(2, 2, 4, 5), 7)) {
        skip(2, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_plan *p = NULL;
    par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    par.virtual_experts = true;
    par.recurring_migration_s = 1e3;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, &rep, &err), RP_OK,
           "plans where EP groups span nodes");
    ok(p && rp_plan_balancing(p) == RP_BALANCING_NONE && isnan(rep.virtual_experts_step_s),
       "without the candidate the balancer could not run");
    rp_plan_free(p);
    batch_fixture_free(&f);
}

/* ---- packing for the balancer's equal-token padding (issue 35) ---- */

static rp_config *balancer_config(const char *executor, bool every_plan)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"execution\": {\"executor\": \"%s\"%s},"
             " \"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 4},"
             " \"model\": {\"num_layers\": 4, \"num_experts\": 16, \"top_k\": 4, \"hidden_size\": 256,"
             "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}",
             executor, every_plan ? ", \"per_forward_balancing\": \"virtual_experts\"" : "");
    rp_error err;
    rp_config *cfg = test_config_parse(ctx, json, &err);
    if (!cfg) diag("config: %s", err.text);
    return cfg;
}

/* Where the executor charges the balancer's padding (megatron_balancer), the candidate
 * that runs with it is the better of the joint packing and a packing made for the
 * padding: never slower than the joint packing under the balancer, and on some seeds
 * another packing, faster. Where every plan runs with the balancer, the packing itself
 * is made for the padding: priced under megatron_balancer, over 8 seeds it is faster than
 * the packing made where the padding is not charged (ideal; per seed it may not be). */
static void test_packing_for_the_padding(void)
{
    int other = 0, never_slower = 0, seeds = 0, differ = 0;
    int priced = 0;
    double padded_s = 0, plain_s = 0;
    rp_error err;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        fixture f;
        if (!fixture_make(&f, balancer_config("megatron_balancer", false), seed)) {
            batch_fixture_free(&f);
            continue;
        }
        rp_joint_params par = rp_joint_defaults();
        par.fallbacks = no_fallbacks;
        rp_joint_report rep;
        rp_plan *own = NULL, *vx = NULL, *mine = NULL;
        rp_cost *c = NULL;
        rp_cost_summary a, b;
        bool run = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &own, &rep, &err) == RP_OK;
        par.virtual_experts = true;
        par.recurring_migration_s = 1e3; /* the balancer's plan wins */
        run = run && rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &vx, &rep, &err) == RP_OK &&
              rep.per_forward_balancing;
        /* the joint packing under the balancer, by hand */
        run = run && rp_plan_new(ctx, f.cfg, rp_plan_num_microbatches(own), &mine, &err) == RP_OK;
        if (run) {
            int32_t n = rp_plan_num_seqs(own);
            int32_t *gpu = malloc(sizeof *gpu * (size_t)n), *mb = malloc(sizeof *mb * (size_t)n);
            for (int32_t s = 0; s < n; s++) gpu[s] = rp_plan_seq_rank(own, s), mb[s] = rp_plan_seq_microbatch(own, s);
            run = rp_plan_set_packing(mine, n, gpu, mb, &err) == RP_OK && rp_plan_set_contiguous(mine, &err) == RP_OK &&
                  rp_plan_set_balancing(mine, RP_BALANCING_VIRTUAL_EXPERTS, &err) == RP_OK &&
                  rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
                  rp_cost_evaluate(c, mine, &a, &err) == RP_OK && rp_cost_evaluate(c, vx, &b, &err) == RP_OK;
            free(gpu);
            free(mb);
        }
        if (!run) diag("seed %llu: %s", (unsigned long long)seed, err.text);
        seeds += run;
        never_slower += run && b.step_s <= a.step_s;
        other += run && !same_packing(vx, own) && b.step_s < a.step_s;
        rp_cost_free(c);
        rp_plan_free(own);
        rp_plan_free(vx);
        rp_plan_free(mine);
        batch_fixture_free(&f);

        /* every plan with the balancer: padded (megatron_balancer) against plain (ideal) */
        fixture g, h;
        rp_plan *pp = NULL, *pl = NULL;
        par = rp_joint_defaults();
        par.fallbacks = no_fallbacks;
        if (fixture_make(&g, balancer_config("megatron_balancer", true), seed) &&
            fixture_make(&h, balancer_config("ideal", true), seed) &&
            rp_joint_plan(ctx, g.cfg, g.batch, g.stats, NULL, NULL, &par, &pp, &rep, &err) == RP_OK &&
            rp_joint_plan(ctx, h.cfg, h.batch, h.stats, NULL, NULL, &par, &pl, &rep, &err) == RP_OK) {
            differ += !same_packing(pp, pl);
            /* both packings priced under megatron_balancer */
            rp_cost *cc = NULL;
            rp_plan *q = NULL;
            rp_cost_summary x, y;
            int32_t n = rp_plan_num_seqs(pl);
            int32_t *gpu = malloc(sizeof *gpu * (size_t)n), *mb = malloc(sizeof *mb * (size_t)n);
            for (int32_t s = 0; s < n; s++) gpu[s] = rp_plan_seq_rank(pl, s), mb[s] = rp_plan_seq_microbatch(pl, s);
            if (rp_plan_new(ctx, g.cfg, rp_plan_num_microbatches(pl), &q, &err) == RP_OK &&
                rp_plan_set_packing(q, n, gpu, mb, &err) == RP_OK && rp_plan_set_contiguous(q, &err) == RP_OK &&
                rp_plan_set_balancing(q, RP_BALANCING_VIRTUAL_EXPERTS, &err) == RP_OK &&
                rp_cost_new(ctx, g.cfg, g.batch, g.stats, RP_SPLIT_EVEN, &cc, &err) == RP_OK &&
                rp_cost_evaluate(cc, pp, &x, &err) == RP_OK && rp_cost_evaluate(cc, q, &y, &err) == RP_OK) {
                padded_s += x.step_s;
                plain_s += y.step_s;
                priced++;
            }
            free(gpu);
            free(mb);
            rp_plan_free(q);
            rp_cost_free(cc);
        } else {
            diag("seed %llu, every plan balanced: %s", (unsigned long long)seed, err.text);
        }
        rp_plan_free(pp);
        rp_plan_free(pl);
        batch_fixture_free(&g);
        batch_fixture_free(&h);
    }
    is_int(seeds, 8, "the balancer's candidate planned on every seed");
    is_int(never_slower, seeds, "it is never slower than the joint packing under the balancer");
    ok(other > 0, "on %d of %d seeds it is another packing, faster", other, seeds);
    ok(differ > 0, "where every plan runs with the balancer, the charged padding changes the packing (%d of 8 seeds)",
       differ);
    is_int(priced, 8, "both packings priced under megatron_balancer on every seed");
    ok(padded_s < plain_s, "over the seeds the packing made for the padding is faster there: %.6g s against %.6g s",
       padded_s, plain_s);
}

/* Under pipeline parallelism the candidate gets its own microbatch order, as the joint
 * plan does (rp_cost_order_microbatches). */
static void test_candidate_under_pp(void)
{
    const char *json = "{\"execution\": {\"executor\": \"ideal\"},"
                       " \"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 5,"
                       " \"pipeline_parallel_size\": 2},"
                       " \"model\": {\"num_layers\": 4, \"num_experts\": 16, \"top_k\": 4, \"hidden_size\": 256,"
                       "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
                       " \"limits\": {\"max_tokens_per_microbatch\": 700}}";
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    fixture f;
    if (!fixture_make(&f, cfg, 5)) {
        skip(2, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    par.virtual_experts = true;
    par.recurring_migration_s = 1e3;
    rp_plan *p = NULL, *plain = NULL;
    rp_joint_report rep;
    rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &p, &rep, &err);
    ok(st == RP_OK && p && rp_plan_balancing(p) == RP_BALANCING_VIRTUAL_EXPERTS, "under PP 2 the candidate is returned%s%s",
       st == RP_OK ? "" : ": ", st == RP_OK ? "" : err.text);
    /* the same plan in index order is slower on this batch (with index order kept, as
     * before the candidate was ordered, the two were equal) */
    if (p && rp_plan_copy(p, &plain, NULL) == RP_OK) {
        int32_t M = rp_plan_num_microbatches(plain), order[4096];
        for (int32_t m = 0; m < M && m < 4096; m++) order[m] = m;
        for (int32_t g = 0; g < rp_plan_num_gpus(plain); g++) rp_plan_set_microbatch_order(plain, g, order, NULL);
    }
    rp_cost *c = NULL;
    rp_cost_summary a = {0}, b = {0};
    bool scored = plain && rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, NULL) == RP_OK &&
                  rp_cost_evaluate(c, p, &a, NULL) == RP_OK && rp_cost_evaluate(c, plain, &b, NULL) == RP_OK;
    ok(scored && a.step_s > 0 && a.step_s < b.step_s, "in an order faster than index order (%.9g < %.9g s)",
       a.step_s, b.step_s);
    rp_cost_free(c);
    rp_plan_free(p);
    rp_plan_free(plain);
    batch_fixture_free(&f);
}

/* ---- relabelling a re-placed layer's ranks ---- */

/* `p`'s placement with EP ranks a and b traded at every layer. */
static rp_plan *traded(const fixture *f, const rp_plan *p, int32_t a, int32_t b)
{
    rp_plan *q = NULL;
    if (rp_plan_new(ctx, f->cfg, 1, &q, NULL) != RP_OK) return NULL;
    int32_t ep = rp_plan_ep_size(p);
    for (int32_t l = 0; l < rp_plan_num_layers(p); l++)
        for (int32_t j = 0; j < ep; j++) {
            int32_t from = j == a ? b : j == b ? a : j, n = 0;
            int32_t list[64];
            const int32_t *sb = rp_plan_slot_begin(p), *x = rp_plan_phy2log(p, l);
            for (int32_t s = sb[from]; s < sb[from + 1]; s++)
                if (x[s] >= 0) list[n++] = x[s];
            if (rp_plan_set_gpu_experts(q, l, j, list, n, NULL) != RP_OK) {
                rp_plan_free(q);
                return NULL;
            }
        }
    return q;
}

static void test_relabel(void)
{
    fixture f;
    if (!fixture_make(&f, make_config(2, 4, 4, 5), 11)) {
        skip(5, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_error err;
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    ok(par.relabel, "rp_joint_defaults: relabel on");
    rp_plan *first = NULL, *prev = NULL, *with = NULL, *without = NULL;
    rp_joint_report rep_with, rep_without;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &first, NULL, &err);
    /* the placement in use is this step's own with two ranks of one node traded: every
     * layer re-placed (horizon INFINITY) comes out the same up to those ranks */
    prev = first ? traded(&f, first, 0, 1) : NULL;
    par.horizon_steps = INFINITY;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, prev, NULL, &par, &with, &rep_with, &err), RP_OK,
           "re-places with relabelling");
    par.relabel = false;
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, prev, NULL, &par, &without, &rep_without, &err), RP_OK,
           "re-places without");
    is_double(rep_with.migration_bytes, 0, 0, "relabelled, the re-placed layers keep every expert where it is");
    ok(rep_without.migration_bytes > 0, "without relabelling they move (%.3g bytes)", rep_without.migration_bytes);
    rp_plan_free(first);
    rp_plan_free(prev);
    rp_plan_free(with);
    rp_plan_free(without);
    batch_fixture_free(&f);
}

/* ---- allocation failures on the new paths ---- */

static void test_alloc_failures(void)
{
    fixture f;
    if (!fixture_make(&f, make_config(2, 4, 4, 5), 3)) {
        skip(1, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_plan *first = NULL, *prev = NULL;
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &first, NULL, NULL);
    prev = first ? traded(&f, first, 0, 1) : NULL;
    bool clean = prev != NULL, done = false;
    long attempts = 0;
    for (long n = 1; n < 20000 && !done && prev; n++) {
        counting c = {0};
        rp_context *cx;
        rp_context_new(counting_alloc, &c, &cx);
        long base = c.live;
        c.fail_at = c.calls + n;
        rp_plan *p = NULL;
        par.virtual_experts = true;
        par.horizon_steps = INFINITY;
        rp_status st = rp_joint_plan(cx, f.cfg, f.batch, f.stats, prev, NULL, &par, &p, NULL, NULL);
        attempts++;
        if (st == RP_OK) {
            done = true;
            rp_plan_free(p);
        } else if (st != RP_ENOMEM || p != NULL) {
            clean = false;
        }
        if (c.live != base) clean = false;
        rp_context_free(cx);
    }
    ok(clean && done, "with the candidate and relabelling: fails cleanly at every allocation, leaks nothing (%ld runs)",
       attempts);
    rp_plan_free(first);
    rp_plan_free(prev);
    batch_fixture_free(&f);
}

/* After a step that ran under the balancer, keeping a layer of its placement without the
 * balancer is no plan anyone runs: the joint placement re-places every layer, and the
 * candidates' scores (step + migration) decide. From the same contiguous placement run
 * without the balancer, a horizon of one step keeps the layers whose move does not pay. */
static void test_previous_balanced(void)
{
    fixture f;
    if (!fixture_make(&f, make_config(2, 4, 4, 5), 7)) {
        skip(2, "fixture");
        batch_fixture_free(&f);
        return;
    }
    rp_error err;
    rp_plan *plain = NULL, *balanced = NULL, *a = NULL, *b = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &plain, &err);
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &balanced, &err);
    if (balanced) rp_plan_set_balancing(balanced, RP_BALANCING_VIRTUAL_EXPERTS, &err);
    rp_joint_params par = rp_joint_defaults();
    par.fallbacks = no_fallbacks;
    par.horizon_steps = 1;
    rp_joint_report ra, rb;
    memset(&ra, 0, sizeof ra);
    memset(&rb, 0, sizeof rb);
    rp_status sa = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, plain, NULL, &par, &a, &ra, &err);
    rp_status sb = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, balanced, NULL, &par, &b, &rb, &err);
    ok(sa == RP_OK && sb == RP_OK && rb.layers_replaced == 4,
       "after the balancer's step every layer is re-placed (%d of 4)", rb.layers_replaced);
    ok(sa == RP_OK && ra.layers_replaced < rb.layers_replaced,
       "after the same placement without it, only the moves that pay in one step (%d of 4 layers)",
       ra.layers_replaced);
    rp_plan_free(plain);
    rp_plan_free(balanced);
    rp_plan_free(a);
    rp_plan_free(b);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_virtual_experts_candidate();
    test_fallback_against_the_balancer();
    test_candidate_under_pp();
    test_relabel();
    test_previous_balanced();
    test_packing_for_the_padding();
    test_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
