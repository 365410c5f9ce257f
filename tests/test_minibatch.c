/* Mini-batches and epochs (trainer.mini_batches, trainer.epochs): one RoutePack step is one
 * rollout batch, trained as K mini-batches of M / K consecutive microbatches, E times.
 * Config errors; the step and its bound against hand-computed figures (a pipeline per
 * mini-batch with its own warm-up and cool-down; every optimizer step waiting for the
 * slowest EP group; gradient reduction per mini-batch; everything per epoch); try ==
 * full; validation messages; every packer keeping each mini-batch's counts and balance,
 * and the local search keeping each sequence in its mini-batch. */
#include "internal.h"
#include "limits_internal.h"
#include "lua_api.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

static uint64_t rng_state = 0x2545F4914F6CDD1DULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-21; }

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": 6, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"                                     \
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}"

/* A config of `topology` and `extra` (sections after the limits, each starting with ",")
 * with trainer section body `trainer` ("" for none). */
static rp_config *config(const char *topology, const char *extra, const char *trainer, rp_error *err)
{
    char json[2048];
    snprintf(json, sizeof json, "{\"topology\": {%s}," MODEL "%s%s%s%s}", topology, extra,
             *trainer ? ", \"trainer\": {" : "", trainer, *trainer ? "}" : "");
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

/* ---- config ---- */

/* Replace the first `from` in `text` (with room for the result) by `to`. */
static void at_replace(char *text, const char *from, const char *to)
{
    char *at = strstr(text, from), tail[1024];
    snprintf(tail, sizeof tail, "%s", at + strlen(from));
    strcpy(at, to);
    strcat(at, tail);
}

static void test_config(void)
{
    rp_error err;
    const char *topo = "\"num_nodes\": 1, \"gpus_per_node\": 4";
    rp_config *cfg = config(topo, "", "", &err);
    ok(cfg && rp_config_trainer(cfg)->mini_batches == 1 && rp_config_trainer(cfg)->epochs == 1,
       "mini_batches and epochs default to 1");
    rp_config_free(cfg);
    cfg = config(topo, "", "\"mini_batches\": 4, \"epochs\": 2", &err);
    ok(cfg && rp_config_trainer(cfg)->mini_batches == 4 && rp_config_trainer(cfg)->epochs == 2, "read as given");
    rp_config_free(cfg);
    cfg = config(topo, "", "\"mini_batches\": 0", &err);
    ok(!cfg && strstr(err.text, "trainer.mini_batches"), "mini_batches 0 is refused, named: %s", err.text);
    cfg = config(topo, "", "\"epochs\": 0", &err);
    ok(!cfg && strstr(err.text, "trainer.epochs"), "epochs 0 is refused, named: %s", err.text);
    cfg = config(topo, "", "\"epochs\": 2.5", &err);
    ok(!cfg && strstr(err.text, "trainer.epochs"), "epochs must be an integer: %s", err.text);
    /* a fixed count that is not a multiple of mini_batches x microbatch_multiple */
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {%s}, \"model\": {\"num_layers\": 6, \"num_experts\": 8, \"top_k\": 2, "
             "\"hidden_size\": 64, \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16}, \"limits\": "
             "{\"max_tokens_per_microbatch\": 1000, \"num_microbatches\": 6}, \"trainer\": {\"mini_batches\": 4}}",
             topo);
    is_int(rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, &err), RP_EINVAL,
           "limits.num_microbatches 6 with 4 mini-batches");
    like(err.text,
         "trainer.mini_batches is 4, but limits.num_microbatches fixes 6 microbatches, not a multiple of 4 (every "
         "mini-batch runs the same number of microbatches, a multiple of trainer.microbatch_multiple 1): give "
         "limits.num_microbatches a multiple of 4",
         "naming both keys and what to do");
    at_replace(json, "\"mini_batches\": 4}", "\"mini_batches\": 2, \"microbatch_multiple\": 2}");
    is_int(rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, &err), RP_EINVAL,
           "6 microbatches, 2 mini-batches, multiple 2");
    like(err.text, "not a multiple of 4 (every mini-batch runs the same number of microbatches, a multiple of "
         "trainer.microbatch_multiple 2)", "each mini-batch's count a multiple: %s", err.text);
    cfg = config(topo, "", "\"mini_batches\": 65536, \"microbatch_multiple\": 64", &err);
    ok(!cfg && strstr(err.text, "trainer.mini_batches is 65536: with trainer.microbatch_multiple 64"),
       "a product beyond 2^20 microbatches is refused: %s", err.text);
}

/* ---- the step, by hand ---- */

/* A batch of `n` sequences of `lens`, every token routed to experts 0 and 1 at each of
 * the 6 layers, so a cell's time depends on its lengths only. */
typedef struct uniform {
    rp_batch *batch;
    rp_stats *stats;
    uint8_t *ids;
} uniform;

static bool uniform_make(uniform *u, int32_t n, const int32_t *lens)
{
    rp_error err;
    int32_t zero[16] = {0};
    memset(u, 0, sizeof *u);
    if (rp_batch_new(ctx, n, lens, zero, NULL, &u->batch, &err) != RP_OK) return false;
    int64_t tokens = rp_batch_num_tokens(u->batch);
    u->ids = malloc((size_t)tokens * 6 * 2);
    for (int64_t k = 0; k < tokens * 6; k++) u->ids[2 * k] = 0, u->ids[2 * k + 1] = 1;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 6, 2, u->ids);
    return rp_stats_compute(ctx, u->batch, &r, 8, 1, &u->stats, &err) == RP_OK;
}

static void uniform_free(uniform *u)
{
    rp_stats_free(u->stats);
    free(u->ids);
    rp_batch_free(u->batch);
}

/* The summary of `cfg`'s evaluation of the packing (rank, mb) with contiguous experts. */
static bool eval(rp_config *cfg, const uniform *u, int32_t M, const int32_t *rank, const int32_t *mb,
                 rp_cost_summary *out)
{
    rp_error err;
    rp_plan *plan = NULL;
    rp_cost *cost = NULL;
    bool good = rp_plan_new(ctx, cfg, M, &plan, &err) == RP_OK &&
                rp_plan_set_packing(plan, rp_batch_num_seqs(u->batch), rank, mb, &err) == RP_OK &&
                rp_plan_set_contiguous(plan, &err) == RP_OK &&
                rp_cost_new(ctx, cfg, u->batch, u->stats, RP_SPLIT_EVEN, &cost, &err) == RP_OK &&
                rp_cost_evaluate(cost, plan, out, &err) == RP_OK;
    if (!good) diag("eval: %s", err.text);
    rp_cost_free(cost);
    rp_plan_free(plan);
    return good;
}

/* PP 2 (3 layers a stage), 4 identical microbatches of one 100-token sequence on one
 * GPU a stage, no p2p time: with one mini-batch 1F1B takes (4 + 2 - 1) x 3 T, T one
 * layer's forward and backward; with 2 mini-batches each is a pipeline of 2, (2 + 1) x
 * 3 T, with its own warm-up and cool-down: 18 T; two epochs: 36 T. T from one GPU and
 * one stage: its step over 4 microbatches x 6 layers is 24 T. */
static void test_pipeline_by_hand(void)
{
    rp_error err;
    const char *topo = "\"num_nodes\": 1, \"gpus_per_node\": 2, \"pipeline_parallel_size\": 2,"
                       " \"nvlink_latency_us\": 0, \"net_latency_us\": 0, \"nvlink_bytes_per_s\": 1e300,"
                       " \"layers_per_stage\": [3, 3]";
    const char *glob = ", \"execution\": {\"sync\": \"global\"}";
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 1", glob, "", &err);
    rp_config *k1 = config(topo, glob, "", &err);
    rp_config *k2 = config(topo, glob, "\"mini_batches\": 2", &err);
    rp_config *k2e2 = config(topo, glob, "\"mini_batches\": 2, \"epochs\": 2", &err);
    rp_config *k4 = config(topo, glob, "\"mini_batches\": 4", &err);
    uniform u;
    int32_t lens[4] = {100, 100, 100, 100}, rank[4] = {0}, mb[4] = {0, 1, 2, 3};
    rp_cost_summary s1, a, b, c, d;
    if (!one || !k1 || !k2 || !k2e2 || !k4 || !uniform_make(&u, 4, lens) || !eval(one, &u, 4, rank, mb, &s1) ||
        !eval(k1, &u, 4, rank, mb, &a) || !eval(k2, &u, 4, rank, mb, &b) || !eval(k2e2, &u, 4, rank, mb, &c) ||
        !eval(k4, &u, 4, rank, mb, &d)) {
        skip(6, "setup");
    } else {
        const double T = s1.step_s / 24.0;
        ok(close_to(a.step_s, 15 * T), "1 mini-batch of 4: 5 x 3 T = %.6g (got %.6g)", 15 * T, a.step_s);
        ok(close_to(b.step_s, 18 * T), "2 mini-batches of 2: 2 x 3 x 3 T = %.6g (got %.6g)", 18 * T, b.step_s);
        ok(close_to(c.step_s, 36 * T), "and 2 epochs: 36 T = %.6g (got %.6g)", 36 * T, c.step_s);
        ok(close_to(d.step_s, 24 * T), "4 mini-batches of 1: 4 x 2 x 3 T = %.6g (got %.6g)", 24 * T, d.step_s);
        /* the bound claims no bubble: the busiest stage's work, E times */
        ok(b.lower_bound_s == a.lower_bound_s && close_to(c.lower_bound_s, 2 * a.lower_bound_s) &&
               c.lower_bound_s <= c.step_s,
           "the bound: the same per epoch (%.6g), twice over 2 epochs (%.6g)", a.lower_bound_s, c.lower_bound_s);
        ok(close_to(c.attention_s, 2 * a.attention_s) && close_to(c.expert_s, 2 * a.expert_s) &&
               close_to(c.dispatch_s, 2 * a.dispatch_s),
           "the summary's phase sums count every epoch");
    }
    uniform_free(&u);
    rp_config_free(one);
    rp_config_free(k1);
    rp_config_free(k2);
    rp_config_free(k2e2);
    rp_config_free(k4);
}

/* Group sync, two EP groups of one GPU, two microbatches: group 0 runs 200 then 100
 * tokens, group 1 100 then 200. One mini-batch: each group's sum is T(200) + T(100), the
 * step that. Two mini-batches: every optimizer step waits for the slower group, so 2
 * T(200); three epochs: 6 T(200). T(n) from one GPU running one n-token sequence. */
static void test_group_by_hand(void)
{
    rp_error err;
    const char *topo = "\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 1, \"slots_per_gpu\": 8";
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 1", "", "", &err);
    rp_config *k1 = config(topo, "", "", &err);
    rp_config *k2 = config(topo, "", "\"mini_batches\": 2, \"epochs\": 3", &err);
    uniform u, u200, u100;
    int32_t lens[4] = {200, 100, 100, 200}, rank[4] = {0, 1, 0, 1}, mb[4] = {0, 0, 1, 1};
    int32_t l200 = 200, l100 = 100, zero = 0;
    rp_cost_summary t200, t100, a, b;
    if (!one || !k1 || !k2 || !uniform_make(&u, 4, lens) || !uniform_make(&u200, 1, &l200) ||
        !uniform_make(&u100, 1, &l100) || !eval(one, &u200, 1, &zero, &zero, &t200) ||
        !eval(one, &u100, 1, &zero, &zero, &t100) || !eval(k1, &u, 2, rank, mb, &a) || !eval(k2, &u, 2, rank, mb, &b)) {
        skip(3, "setup");
    } else {
        ok(close_to(a.step_s, t200.step_s + t100.step_s), "1 mini-batch: T(200) + T(100) = %.6g (got %.6g)",
           t200.step_s + t100.step_s, a.step_s);
        ok(close_to(b.step_s, 3 * (2 * t200.step_s)), "2 mini-batches, 3 epochs: 3 x 2 T(200) = %.6g (got %.6g)",
           6 * t200.step_s, b.step_s);
        ok(b.lower_bound_s <= b.step_s && close_to(b.lower_bound_s, 3 * a.lower_bound_s),
           "the bound: 3 epochs of the groups' mean");
    }
    uniform_free(&u);
    uniform_free(&u200);
    uniform_free(&u100);
    rp_config_free(one);
    rp_config_free(k1);
    rp_config_free(k2);
}

/* ---- random plans: the step's terms, try == full, the bound ---- */

/* A random batch of 8-31 sequences over 8 experts and 6 layers, packed at random into M
 * microbatches (a multiple of K), with a random placement with replicas where slots are
 * spare (so the replica gradient reduction is not zero). */
static bool scene_make(random_scene *s, const char *topo, const char *extra, const char *trainer, int32_t M)
{
    rp_error err;
    bool made = random_scene_make(ctx, s, config(topo, extra, trainer, &err), 8, 300, 0, M, true, &rng_state, &err);
    if (!made) diag("scene on %s {%s}: %s", topo, trainer, err.text);
    return made;
}

/* Without PP under global sync the step is E x (the sum of every T(m, l) + K x the
 * gradient reduction + the extra copies); the summary's terms are the single pass's,
 * E and E x K times. */
static void test_terms(void)
{
    int bad = 0, cases = 0, with_grad = 0;
    for (int it = 0; it < 24; it++) {
        const int32_t K = 1 + (int32_t)rnd(3), E = 1 + (int32_t)rnd(3), M = K * (1 + (int32_t)rnd(3));
        char trainer[128], extra[128];
        snprintf(trainer, sizeof trainer, "\"mini_batches\": %d, \"epochs\": %d", K, E);
        snprintf(extra, sizeof extra, ", \"execution\": {\"sync\": \"global\", \"overlap\": \"%s\"}",
                 it % 2 ? "layer" : "none");
        const char *topo = "\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 6";
        random_scene s;
        rp_cost *cost = NULL, *flat = NULL;
        rp_cost_summary sum, one;
        rp_error err;
        rp_config *flat_cfg = NULL; /* the same with K = E = 1 */
        if (!scene_make(&s, topo, extra, trainer, M) || !(flat_cfg = config(topo, extra, "", &err)) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK ||
            rp_cost_new(ctx, flat_cfg, s.batch, s.stats, RP_SPLIT_EVEN, &flat, &err) != RP_OK ||
            rp_cost_evaluate(flat, s.plan, &one, &err) != RP_OK) {
            bad++;
        } else {
            double layers = 0.0;
            for (int32_t m = 0; m < M; m++)
                for (int32_t l = 0; l < 6; l++) layers += rp_cost_layer_s(cost, m, l);
            const double want = E * (layers + K * one.grad_reduce_s + one.extra_copy_s);
            cases++;
            with_grad += one.grad_reduce_s > 0;
            if (!close_to(sum.step_s, want) || sum.grad_reduce_s != (double)E * K * one.grad_reduce_s ||
                sum.extra_copy_s != E * one.extra_copy_s || !close_to(sum.attention_s, E * one.attention_s) ||
                !(sum.lower_bound_s <= sum.step_s * (1 + 1e-12))) {
                bad++;
                diag("case %d K %d E %d: step %.17g, want %.17g; grad %.17g vs %.17g", it, K, E, sum.step_s, want,
                     sum.grad_reduce_s, one.grad_reduce_s);
            }
        }
        rp_cost_free(cost);
        rp_cost_free(flat);
        rp_config_free(flat_cfg);
        random_scene_free(&s);
    }
    ok(bad == 0 && cases == 24 && with_grad > 0,
       "step = E (sum T(m, l) + K grad + extra), summary terms x E and x E K (%d plans, %d with replica gradients)",
       cases, with_grad);
}

/* K = E = 1 given explicitly is today's step, bit for bit; under PP with K > 1 tries equal
 * full evaluations bit for bit and the bound stays below the step. */
static void test_random_pp(void)
{
    static const char *const syncs[] = {"group", "global"}, *const overlaps[] = {"none", "layer"};
    int bad_same = 0, bad_bound = 0, bad_try = 0, cases = 0, tries = 0;
    for (int it = 0; it < 30; it++) {
        const int pp = 2 << rnd(2), vpp = it % 3 == 0 ? 2 : 1;
        const int32_t K = it % 5 == 0 ? 1 : 2 + (int32_t)rnd(2), E = 1 + (int32_t)rnd(2);
        const int32_t Mk = vpp > 1 ? pp * (1 + (int32_t)rnd(2)) : 1 + (int32_t)rnd(4);
        char topo[512], extra[256], trainer[128];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": %d, \"gpus_per_node\": 8, \"pipeline_parallel_size\": %d,"
                 " \"virtual_pipeline_size\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d",
                 1 + (int)rnd(2), pp, vpp, 1 << rnd(2), 8 + (int)rnd(2));
        snprintf(extra, sizeof extra, ", \"execution\": {\"sync\": \"%s\", \"overlap\": \"%s\"}", syncs[rnd(2)],
                 overlaps[rnd(2)]);
        snprintf(trainer, sizeof trainer, "\"mini_batches\": %d, \"epochs\": %d", K, K == 1 ? 1 : E);
        random_scene s;
        rp_cost *cost = NULL, *flat = NULL;
        rp_cost_summary sum, one;
        rp_error err;
        rp_config *flat_cfg = NULL; /* the same with K = E = 1 */
        if (!scene_make(&s, topo, extra, trainer, K * Mk) || !(flat_cfg = config(topo, extra, "", &err)) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK ||
            rp_cost_new(ctx, flat_cfg, s.batch, s.stats, RP_SPLIT_EVEN, &flat, &err) != RP_OK ||
            rp_cost_evaluate(flat, s.plan, &one, &err) != RP_OK) {
            diag("case %d: %s", it, err.text);
            bad_bound++;
        } else {
            cases++;
            if (K == 1 && memcmp(&sum, &one, sizeof sum) != 0) bad_same++;
            if (!(sum.lower_bound_s <= sum.step_s * (1 + 1e-12)) || !isfinite(sum.step_s)) bad_bound++;
            const int32_t G = rp_config_topology(s.cfg)->num_gpus;
            for (int k = 0; k < 3; k++) {
                int32_t q = (int32_t)rnd((uint32_t)s.n), g = (int32_t)rnd((uint32_t)G);
                int32_t m = (int32_t)rnd((uint32_t)s.M);
                double tried = rp_cost_try_move(cost, q, g, m);
                if (isfinite(tried) && rp_cost_apply_move(cost, s.plan, q, g, m, &err) == RP_OK) {
                    rp_cost *fresh = NULL;
                    rp_cost_summary fs;
                    rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &fresh, &err);
                    tries++;
                    if (rp_cost_evaluate(fresh, s.plan, &fs, &err) != RP_OK || fs.step_s != tried) {
                        bad_try++;
                        diag("case %d: try %.17g, full %.17g", it, tried, fs.step_s);
                    }
                    rp_cost_free(fresh);
                }
            }
        }
        rp_cost_free(cost);
        rp_cost_free(flat);
        rp_config_free(flat_cfg);
        random_scene_free(&s);
    }
    ok(bad_same == 0, "mini_batches 1, epochs 1 given: the summary of a config without them, bit for bit");
    ok(bad_bound == 0 && cases == 30, "bound <= step on %d random PP plans with 1-3 mini-batches and 1-2 epochs",
       cases);
    ok(bad_try == 0 && tries > 30, "a tried move equals a full evaluation, bit for bit (%d moves)", tries);
}

/* rp_cost_order_microbatches orders each mini-batch on its own: the order it sets keeps
 * every microbatch in its mini-batch (the plan validates), and its step is a fresh
 * evaluation's and no longer than before. */
static void test_order_per_mini_batch(void)
{
    int bad = 0, cases = 0, reordered = 0;
    for (int it = 0; it < 12; it++) {
        const int32_t K = 2 + (int32_t)rnd(2), Mk = 3 + (int32_t)rnd(3);
        char trainer[64];
        snprintf(trainer, sizeof trainer, "\"mini_batches\": %d", K);
        random_scene s;
        rp_cost *cost = NULL, *fresh = NULL;
        rp_cost_summary sum, fs;
        rp_error err;
        double ordered = 0;
        if (!scene_make(&s, "\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 2",
                        ", \"execution\": {\"sync\": \"group\"}", trainer, K * Mk) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK ||
            rp_cost_order_microbatches(cost, s.plan, &ordered, &err) != RP_OK ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &fresh, &err) != RP_OK ||
            rp_cost_evaluate(fresh, s.plan, &fs, &err) != RP_OK) {
            diag("case %d: %s", it, err.text);
            bad++;
        } else {
            cases++;
            bool moved = false;
            for (int32_t g = 0; g < rp_plan_num_gpus(s.plan); g++)
                for (int32_t k = 0; k < K * Mk; k++) moved |= rp_plan_microbatch_at(s.plan, g, k) != k;
            reordered += moved;
            if (rp_plan_validate(s.plan, s.cfg, s.batch, &err) != RP_OK || fs.step_s != ordered ||
                ordered > sum.step_s) {
                bad++;
                diag("case %d: %s; ordered %.17g, fresh %.17g, before %.17g", it, err.text, ordered, fs.step_s,
                     sum.step_s);
            }
        }
        rp_cost_free(cost);
        rp_cost_free(fresh);
        random_scene_free(&s);
    }
    ok(bad == 0 && cases == 12 && reordered > 0,
       "PP 2: each mini-batch ordered on its own, the plan valid, its step a fresh evaluation's and no longer "
       "(%d plans, %d reordered)", cases, reordered);
}

/* ---- validation ---- */

static void test_validation(void)
{
    rp_error err;
    const char *topo = "\"num_nodes\": 1, \"gpus_per_node\": 2, \"pipeline_parallel_size\": 1";
    rp_config *cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 2", "", "\"mini_batches\": 2, "
                            "\"equal_sequences_per_rank\": true", &err);
    (void)topo;
    uniform u;
    int32_t lens[8] = {10, 20, 30, 40, 50, 60, 70, 80};
    if (!cfg || !uniform_make(&u, 8, lens)) {
        skip(8, "setup");
        rp_config_free(cfg);
        return;
    }
    rp_plan *p = NULL;
    /* 3 microbatches: not a multiple of 2 */
    int32_t rank[8] = {0, 0, 0, 0, 1, 1, 1, 1}, mb3[8] = {0, 1, 2, 0, 0, 1, 2, 0};
    rp_plan_new(ctx, cfg, 3, &p, &err);
    rp_plan_set_packing(p, 8, rank, mb3, &err);
    rp_plan_set_contiguous(p, &err);
    is_int(rp_plan_validate(p, cfg, u.batch, &err), RP_EPLAN, "3 microbatches under 2 mini-batches");
    like(err.text, "plan: the plan runs 3 microbatches per rank, not a multiple of trainer.mini_batches 2 (every "
         "mini-batch runs the same number of microbatches)", "saying so");
    rp_plan_free(p);
    p = NULL;
    /* 4 microbatches, rank 0 runs 3 sequences in mini-batch 0 and 1 in mini-batch 1 */
    int32_t mb4[8] = {0, 1, 0, 2, 0, 1, 2, 3};
    rp_plan_new(ctx, cfg, 4, &p, &err);
    rp_plan_set_packing(p, 8, rank, mb4, &err);
    rp_plan_set_contiguous(p, &err);
    is_int(rp_plan_validate(p, cfg, u.batch, &err), RP_EPLAN, "unequal counts per mini-batch");
    like(err.text, "rank 0 mini-batch 0 (microbatches 0 to 1) runs 3 sequences, but trainer.equal_sequences_per_rank "
         "needs 2 in every mini-batch of every rank (4 sequences per rank over trainer.mini_batches 2)",
         "naming rank, mini-batch and counts: %s", err.text);
    rp_plan_free(p);
    p = NULL;
    /* equal counts; an order that runs microbatch 2 in mini-batch 0 */
    int32_t mb_ok[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    rp_plan_new(ctx, cfg, 4, &p, &err);
    rp_plan_set_packing(p, 8, rank, mb_ok, &err);
    rp_plan_set_contiguous(p, &err);
    is_int(rp_plan_validate(p, cfg, u.batch, &err), RP_OK, "2 sequences in each mini-batch of each rank: valid");
    int32_t inside[4] = {1, 0, 3, 2}, across[4] = {2, 1, 0, 3};
    for (int32_t g = 0; g < 2; g++) rp_plan_set_microbatch_order(p, g, inside, &err);
    is_int(rp_plan_validate(p, cfg, u.batch, &err), RP_OK, "an order inside each mini-batch is valid");
    for (int32_t g = 0; g < 2; g++) rp_plan_set_microbatch_order(p, g, across, &err);
    is_int(rp_plan_validate(p, cfg, u.batch, &err), RP_EPLAN, "an order across mini-batches is not");
    like(err.text, "rank 0 runs microbatch 2 at position 0, in mini-batch 0 (positions 0 to 1), but microbatch 2 "
         "belongs to mini-batch 1: microbatch_order permutes only within a mini-batch (trainer.mini_batches 2)",
         "saying why: %s", err.text);
    rp_plan_free(p);
    /* the evaluator refuses a count that does not divide */
    rp_cost *cost = NULL;
    rp_plan_new(ctx, cfg, 3, &p, &err);
    rp_plan_set_packing(p, 8, rank, mb3, &err);
    rp_plan_set_contiguous(p, &err);
    rp_cost_new(ctx, cfg, u.batch, u.stats, RP_SPLIT_EVEN, &cost, &err);
    is_int(rp_cost_evaluate(cost, p, NULL, &err), RP_EINVAL, "the evaluator refuses 3 microbatches in 2 mini-batches");
    like(err.text, "cost: the plan has 3 microbatches, not a multiple of trainer.mini_batches 2", "saying so");
    rp_cost_free(cost);
    rp_plan_free(p);
    uniform_free(&u);
    rp_config_free(cfg);
}

/* ---- planning ---- */

typedef batch_fixture fixture; /* test_util.h */

/* test_util.h's trainer_fixture_make on this file's random numbers. */
static bool fixture_make(fixture *f, int ep, int cap, const char *trainer, int32_t n, const int32_t *lens)
{
    rp_error err;
    bool made = trainer_fixture_make(ctx, f, ep, cap, trainer, n, lens, &rng_state, &err);
    if (!made) diag("fixture: %s", err.text);
    return made;
}

/* Sequences and tokens of rank g in mini-batch b. */
static void mini_batch_load(const rp_plan *p, const rp_batch *batch, int32_t K, int32_t g, int32_t b,
                            int32_t *count, int64_t *tokens)
{
    const int32_t Mk = rp_plan_num_microbatches(p) / K;
    *count = 0;
    *tokens = 0;
    for (int32_t m = b * Mk; m < (b + 1) * Mk; m++) {
        int32_t c;
        const int32_t *seqs = rp_plan_microbatch(p, g, m, &c);
        *count += c;
        for (int32_t i = 0; i < c; i++) *tokens += rp_batch_seq_len(batch, seqs[i]);
    }
}

/* Every mini-batch: the same count on every rank (when asked) and, when `balance` > 0,
 * no rank above `balance` x the mean rank's tokens. */
static bool mini_batches_ok(const rp_plan *p, const rp_batch *batch, int32_t K, bool equal, double balance,
                            double *worst)
{
    const int32_t G = rp_plan_num_gpus(p);
    if (rp_plan_num_microbatches(p) % K != 0) return false;
    *worst = 1.0;
    for (int32_t b = 0; b < K; b++) {
        int32_t c0 = -1;
        int64_t most = 0, sum = 0;
        for (int32_t g = 0; g < G; g++) {
            int32_t c;
            int64_t t;
            mini_batch_load(p, batch, K, g, b, &c, &t);
            if (equal && c0 >= 0 && c != c0) return false;
            c0 = c;
            most = t > most ? t : most;
            sum += t;
        }
        double ratio = sum > 0 ? (double)most * G / (double)sum : 1.0;
        *worst = ratio > *worst ? ratio : *worst;
    }
    return balance <= 0 || *worst <= balance;
}

static void test_every_packer(void)
{
    static const char *const trainers[] = {
        "\"mini_batches\": 2",
        "\"mini_batches\": 2, \"equal_sequences_per_rank\": true",
        "\"mini_batches\": 3, \"equal_sequences_per_rank\": true, \"microbatch_multiple\": 2",
        "\"mini_batches\": 2, \"equal_sequences_per_rank\": true, \"nonempty_microbatches\": true, \"epochs\": 2",
    };
    int32_t lens[48];
    for (int t = 0; t < 4; t++)
        for (int round = 0; round < 2; round++) {
            for (int i = 0; i < 48; i++) lens[i] = i < 3 ? 150 + (int32_t)rnd(50) : 5 + (int32_t)rnd(80);
            fixture f;
            rp_error err;
            if (!fixture_make(&f, 2, 400, trainers[t], 48, lens)) {
                skip(17, "fixture");
                continue;
            }
            const rp_trainer *tr = rp_config_trainer(f.cfg);
            const int32_t K = tr->mini_batches;
            for (const char *const *b = rp_baseline_names(); *b; b++) {
                rp_plan *p = NULL;
                double worst = 0;
                rp_status st = rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, *b, 0, &p, &err);
                if (!strncmp(*b, "slime_", 6) && tr->equal_sequences_per_rank) {
                    /* slime's ranks run different sequence counts: refused, naming the key */
                    ok(st == RP_EINVAL && strstr(err.text, "trainer.equal_sequences_per_rank"),
                       "{%s}: %s is refused, naming the key", trainers[t], *b);
                    rp_plan_free(p);
                    continue;
                }
                if (st != RP_OK) diag("%s: %s", *b, err.text);
                ok(st == RP_OK && (rp_plan_num_microbatches(p) / K) % tr->microbatch_multiple == 0 &&
                       mini_batches_ok(p, f.batch, K, tr->equal_sequences_per_rank, 0, &worst) &&
                       rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
                   "{%s}: %s: %d microbatches in %d mini-batches, valid", trainers[t], *b,
                   p ? rp_plan_num_microbatches(p) : -1, K);
                rp_plan_free(p);
            }
            rp_joint_params jp = rp_joint_defaults();
            jp.refine_evaluations = 400;
            rp_plan *p = NULL;
            rp_joint_report rep;
            double worst = 0;
            rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, &rep, &err);
            if (st != RP_OK) diag("joint: %s", err.text);
            bool good = st == RP_OK && mini_batches_ok(p, f.batch, K, tr->equal_sequences_per_rank, 1.35, &worst);
            ok(good && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
               "{%s}: the joint planner: valid, every mini-batch's ranks within 1.35 x the mean tokens (worst %.3f, "
               "chose %s)", trainers[t], worst, st == RP_OK ? rep.chosen : "-");
            rp_plan_free(p);
            batch_fixture_free(&f);
        }
}

/* verl's split as the baselines model it: token_kk's local order is ascending id, so on
 * every rank the first mini-batch holds the lower ids. */
static void test_baseline_split(void)
{
    int32_t lens[16];
    for (int i = 0; i < 16; i++) lens[i] = 10 + (int32_t)rnd(50);
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 4, 1000, "\"mini_batches\": 2, \"equal_sequences_per_rank\": true", 16, lens)) {
        skip(2, "fixture");
        return;
    }
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &p, &err), RP_OK,
           "token_kk with 2 mini-batches");
    bool split = p != NULL;
    for (int32_t g = 0; p && g < 4; g++) {
        int32_t hi0 = -1, lo1 = INT32_MAX, M = rp_plan_num_microbatches(p);
        for (int32_t m = 0; m < M; m++) {
            int32_t c;
            const int32_t *seqs = rp_plan_microbatch(p, g, m, &c);
            for (int32_t i = 0; i < c; i++) {
                if (m < M / 2 && seqs[i] > hi0) hi0 = seqs[i];
                if (m >= M / 2 && seqs[i] < lo1) lo1 = seqs[i];
            }
        }
        split &= hi0 < lo1;
    }
    ok(split, "each rank's 4 sequences split in id order: 2 then 2 (verl's DataProto.split)");
    rp_plan_free(p);
    p = NULL;
    batch_fixture_free(&f);
    /* 12 sequences over 4 ranks: 3 a rank do not divide into 2 mini-batches */
    if (!fixture_make(&f, 4, 1000, "\"mini_batches\": 2, \"equal_sequences_per_rank\": true", 12, lens)) {
        skip(4, "fixture");
        return;
    }
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &p, &err), RP_EINVAL,
           "3 sequences a rank, 2 mini-batches: a baseline refuses");
    like(err.text, "baseline: each of the 4 DP ranks runs 3 sequences, which do not divide into trainer.mini_batches "
         "2 mini-batches", "naming the numbers: %s", err.text);
    rp_joint_params jp = rp_joint_defaults();
    is_int(rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &jp, &p, NULL, &err), RP_EINVAL,
           "so does the joint planner");
    like(err.text, "give the step a multiple of 8 sequences or turn the key off", "saying what to do: %s", err.text);
    batch_fixture_free(&f);
}

/* The local search moves and swaps sequences only inside their mini-batch. */
static void test_search_keeps_mini_batches(void)
{
    int32_t lens[32];
    for (int i = 0; i < 32; i++) lens[i] = i < 4 ? 90 : 3 + (int32_t)rnd(40);
    static const char *const trainers[] = {"\"mini_batches\": 2", "\"mini_batches\": 2, \"equal_sequences_per_rank\": true"};
    for (int t = 0; t < 2; t++) {
        fixture f;
        rp_error err;
        if (!fixture_make(&f, 2, 1000, trainers[t], 32, lens)) {
            skip(2, "fixture");
            continue;
        }
        rp_plan *p = NULL;
        rp_cost *cost = NULL;
        rp_search_params sp = rp_search_defaults();
        sp.max_evaluations = 3000;
        sp.slots = false;
        rp_search_result res;
        int32_t before[32];
        bool built = rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 4, &p, &err) == RP_OK &&
                     rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err) == RP_OK;
        for (int32_t s = 0; built && s < 32; s++) before[s] = rp_plan_seq_microbatch(p, s) / 2;
        if (!built || rp_search_local(cost, p, &sp, &res, &err) != RP_OK) {
            diag("%s", err.text);
            skip(2, "search");
        } else {
            int32_t left = 0;
            for (int32_t s = 0; s < 32; s++) left += rp_plan_seq_microbatch(p, s) / 2 != before[s];
            ok(res.moves + res.swaps > 0 && left == 0, "{%s}: %lld moves and %lld swaps, no sequence left its "
               "mini-batch (%d did)", trainers[t], (long long)res.moves, (long long)res.swaps, left);
            ok(rp_plan_validate(p, f.cfg, f.batch, &err) == RP_OK && res.final_s <= res.initial_s,
               "the plan stays valid and no slower (%.6g -> %.6g)", res.initial_s, res.final_s);
        }
        rp_cost_free(cost);
        rp_plan_free(p);
        batch_fixture_free(&f);
    }
}

/* rp.joint's work and memory estimate and the scheduler's instruction budget size a plan
 * by rp_limits_expected_microbatches: the count the joint planner starts its packing at
 * (rp_limits_least_microbatches), not the token cap's alone, which was below it under
 * trainer.mini_batches and microbatch_multiple (and one above at an exact fit). */
static void test_expected_microbatches(void)
{
    static const struct {
        const char *limits, *trainer;
        int64_t want;
        const char *why;
    } cases[] = {
        {"\"max_tokens_per_microbatch\": 400", "", 1, "480 tokens under 4 x 400: 1"},
        {"\"max_tokens_per_microbatch\": 400", "\"mini_batches\": 3, \"microbatch_multiple\": 2", 6,
         "K 3 x multiple 2: 1 rounds up to 6"},
        {"\"max_tokens_per_microbatch\": 400", "\"mini_batches\": 4", 4, "K 4: 4"},
        {"\"max_tokens_per_microbatch\": 120", "", 1, "480 tokens under 4 x 120, an exact fit: 1"},
        {"\"max_tokens_per_microbatch\": 400, \"max_activation_bytes\": 600, \"activation_bytes_per_token\": 10", "",
         2, "the activation cap (60 tokens) under the token cap: ceil(480 / 240) = 2"},
        {"\"max_tokens_per_microbatch\": 400, \"num_microbatches\": 6", "\"mini_batches\": 2", 6,
         "limits.num_microbatches 6: 6"},
    };
    int32_t lens[48];
    for (int i = 0; i < 48; i++) lens[i] = 10;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 2, \"slots_per_gpu\": 5},"
                 " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
                 "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
                 " \"limits\": {%s}, \"trainer\": {%s}}",
                 cases[i].limits, cases[i].trainer);
        fixture f;
        rp_error err;
        if (!batch_fixture_make(ctx, &f, json, 48, lens, NULL, NULL, &err)) {
            diag("fixture: %s", err.text);
            skip(2, "fixture");
            continue;
        }
        int64_t tokens = rp_batch_num_tokens(f.batch);
        for (int64_t t = 0; t < tokens * 2; t++) {
            f.ids[2 * t] = (uint8_t)rnd(4);
            f.ids[2 * t + 1] = (uint8_t)(4 + rnd(4));
        }
        if (!batch_fixture_stats(ctx, &f, &err)) {
            diag("stats: %s", err.text);
            skip(2, "stats");
            batch_fixture_free(&f);
            continue;
        }
        int64_t M = rp_limits_expected_microbatches(f.cfg, f.batch);
        ok(M == cases[i].want, "expected microbatches: %s (got %lld)", cases[i].why, (long long)M);
        /* the joint planner runs that count when the batch packs at its first try (48
         * sequences of 10 tokens do, under every cap here) */
        rp_plan *p = NULL;
        rp_joint_report rep;
        rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, NULL, &p, &rep, &err);
        if (st != RP_OK) diag("joint: %s", err.text);
        ok(st == RP_OK && rp_plan_num_microbatches(p) == M, "the joint planner's plan has %d microbatches",
           p ? rp_plan_num_microbatches(p) : -1);
        rp_plan_free(p);
        batch_fixture_free(&f);
    }
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_config();
    test_pipeline_by_hand();
    test_group_by_hand();
    test_terms();
    test_random_pp();
    test_order_per_mini_batch();
    test_validation();
    test_every_packer();
    test_baseline_split();
    test_search_keeps_mini_batches();
    test_expected_microbatches();
    rp_context_free(ctx);
    return tap_done();
}
