/* Context parallelism (topology.context_parallel_size): the topology mapping (a DP rank is
 * TP x CP GPUs) and its config errors; the cost model against a hand-computed CP 2 toy
 * (1/CP of attention and of every token-linear term, the padding to 2 CP, the K/V ring);
 * CP 1 bit for bit as before CP existed (a hash frozen at c63111d); bound <= step and
 * try == full on random CP plans; the straggler and the joint planner's packing of a long
 * rollout at CP 1 and CP 2; memory per GPU. Uses the public API only. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;
static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": %d, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"num_kv_heads\": %d, \"head_dim\": 16},"               \
    " \"limits\": {\"max_tokens_per_microbatch\": 1000000}"

static rp_config *config_l(const char *topology, const char *extra, int layers, int kv_heads, rp_error *err)
{
    char json[4096], model[512];
    snprintf(model, sizeof model, MODEL, layers, kv_heads);
    snprintf(json, sizeof json, "{\"topology\": {%s},%s%s}", topology, model, extra);
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

static rp_config *config(const char *topology, const char *extra, rp_error *err)
{
    return config_l(topology, extra, 2, 4, err);
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-21; }

/* ---- the topology ---- */

static void test_mapping(void)
{
    rp_error err;
    rp_config *cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2,"
                            " \"context_parallel_size\": 2, \"expert_tensor_parallel_size\": 1, \"ep_size\": 8",
                            "", &err);
    ok(cfg != NULL, "TP 2, CP 2, ETP 1, EP 8 on 8 GPUs");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->num_gpus == 2 && t->dp_size == 2 && t->gpus_per_node == 2 && t->context_parallel_size == 2,
           "2 DP ranks of TP 2 x CP 2 GPUs, both on the node");
        ok(t->ep_size == 2 && t->num_ep_groups == 1 && t->slots[0] == 4 && t->slots[1] == 4,
           "EP 8 x ETP 1 = 8 GPUs is one EP group of 2 DP ranks, each holding 4 EP ranks' slot (4 slots)");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 2, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"context_parallel_size\": 4",
                 "", &err);
    ok(cfg != NULL, "CP 4 x TP 2 on 2 nodes of 4 GPUs: a DP rank spanning both nodes");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->num_gpus == 1 && t->gpus_per_node == 1 && t->num_nodes == 1 && t->expert_parallel_size == 4 &&
               t->ep_size == 1,
           "one DP rank (the planner's node), EP defaults to its 4 ETP groups");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8", "", &err);
    ok(cfg && rp_config_topology(cfg)->context_parallel_size == 1, "context_parallel_size defaults to 1");
    rp_config_free(cfg);
    static const config_refusal bad[] = {
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"context_parallel_size\": 3",
         "topology.context_parallel_size is 3, but a DP rank of tensor_parallel_size 1 x context_parallel_size 3 = 3 "
         "GPUs must divide the GPUs of a node (8) or be whole nodes, and divide the 8 GPUs",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"context_parallel_size\": 0",
         "topology.context_parallel_size must be >= 1", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 4, \"context_parallel_size\": 4",
         "topology.context_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 3, \"gpus_per_node\": 4, \"context_parallel_size\": 8",
         "topology.context_parallel_size is 8, but a DP rank of tensor_parallel_size 1 x context_parallel_size 8 = 8 "
         "GPUs must divide the GPUs of a node (4) or be whole nodes, and divide the 12 GPUs",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2, \"context_parallel_size\": 2,"
         " \"expert_tensor_parallel_size\": 1, \"ep_size\": 2",
         "topology.ep_size is 2 EP ranks x 1 GPUs (expert_tensor_parallel_size) = 2 GPUs, not a multiple of "
         "tensor_parallel_size 2 x context_parallel_size 2 = 4: an EP group must hold whole DP ranks",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"context_parallel_size\": 2, \"dp_size\": 8",
         "topology.dp_size must equal the GPUs over tensor_parallel_size x context_parallel_size x "
         "pipeline_parallel_size, 8 / (1 x 2 x 1) = 4, got 8",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"context_parallel_size\": 2, \"ep_size\": 8,"
         " \"slots_per_gpu\": [2, 2, 3, 2]",
         "topology.slots_per_gpu[2] is 3, but DP rank 2 holds 2 EP ranks (tensor_parallel_size 1 x "
         "context_parallel_size 2 / expert_tensor_parallel_size 1)",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"context_parallel_size\": 8",
         "topology.context_parallel_size", RP_ERANGE},
    };
    check_config_refusals(config, bad, sizeof bad / sizeof bad[0]);
}

/* ---- a hand-computed CP 2 toy ---- */

/* test_util.h's toy on `topology`, one copy per token-choice (the hand figures count
 * choices; the de-duplicated modes estimate copies from per-sequence histograms). */
static bool setup_make(toy_scene *s, const char *topology)
{
    rp_error err;
    rp_config *cfg = config(topology, ", \"execution\": {\"executor\": \"ideal\", \"dispatch_dedup\": \"choice\"}", &err);
    if (!cfg) {
        diag("config: %s", err.text);
        return false;
    }
    if (!toy_scene_make(ctx, s, cfg, &err)) {
        diag("setup: %s", err.text);
        return false;
    }
    return true;
}

/* The toy on 4 GPUs of one node: CP 1 (4 DP ranks would change the plan, so TP 2 stands
 * in: the same 2 DP ranks of 2 GPUs, heads split instead of sequences) against CP 2 (2 DP
 * ranks of 2 GPUs, EP 4 x ETP 1 = 2 DP ranks, 2 slots per EP rank).
 *
 * By hand, CP 2 (peak 989e12, eff_attn 0.25 below 512 tokens, dense_efficiency 0.7,
 * d 64, h = h_kv 4, d_h 16, bf16, hbm 4.8e12, token-linear 3200 B a token, fixed 40 us,
 * nvlink 450e9 B/s and 3 us; default backward multipliers 3, 2, 2, 2, 1, 2):
 *   padding to 2 CP = 4: lengths 30, 20, 10, 40 -> 32, 20, 12, 40; each rank 52 tokens.
 *   attention of the 30-token sequence per GPU: (2 x 32^2 x 4 x 16 / (989e12 x 0.25)
 *     + 2 x 32 x 64 x (4 x 4 x 16) / (989e12 x 0.7)) / 2 = (5.3012e-10 + 1.51463e-09) / 2
 *     = 1.022373e-09 s
 *   rank 0's cell: core (32^2 + 20^2) x 5.176946e-13 / 2 = 3.685986e-10 s, projections
 *     52 x 4.733208e-11 / 2 = 1.230634e-09 s, token-linear 52 x 3200 / 4.8e12 / 2
 *     = 1.733333e-08 s, fixed 4e-05 s;
 *   its ring: K and V of a token on one GPU 2 x 4 x 16 x 2 = 256 B; a step carries
 *     52 / 2 = 26 tokens: 26 x 256 / 450e9 + 3e-6 = 3.014791e-06 s forward, 3.029582e-06 s
 *     backward (K, V and their gradients), against one step's compute 1.842993e-10 s
 *     forward, 5.528979e-10 s backward: unhidden (2 - 1) x (3.014791e-06 - 1.842993e-10)
 *     + 3e-6 = 6.014607e-06 s forward, 6.029029e-06 s backward;
 *   A(0, 0) = core + projections + forward ring = 6.016206e-06 s.
 *   rank 1 (12 + 40 tokens): core 4.514297e-10 s; dense phase 4.603358e-05 s forward,
 *     8.606739e-05 s backward (rank 0: 4.603354e-05, 8.606726e-05).
 *   Experts: expert 0 and 5 take 100 tokens each, half a slot of 100 tokens per GPU:
 *     6 x 100 x 64 x 32 / (989e12 x 0.32125) / 2 = 1.933801e-09 s; dispatch 50 choices
 *     x 128 B over 2 GPUs' links: 50 x 128 / 900e9 + 3e-6 = 3.007111e-06 s.
 *   step = 2 layers x (4.603358e-05 + 8.606739e-05 + 3 x 1.933801e-09
 *     + 4 x 3.007111e-06) = 2.882704e-04 s. */
static void test_hand(void)
{
    toy_scene tp, cp;
    bool ok1 = setup_make(&tp, "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2,"
                               " \"expert_tensor_parallel_size\": 1, \"ep_size\": 4, \"slots_per_gpu\": 2");
    bool ok2 = setup_make(&cp, "\"num_nodes\": 1, \"gpus_per_node\": 4, \"context_parallel_size\": 2,"
                               " \"ep_size\": 4, \"slots_per_gpu\": 2");
    if (!ok1 || !ok2) {
        skip(8, "setup");
        goto out;
    }
    const double peak = 989e12, nv = 450e9, lat = 3e-6, d = 64, f = 32, h = 4, dh = 16, bpp = 2;
    const double hbm = 4.8e12, tl = (16 * d + 3 * 2 * d + 3 * 2 * f) * bpp, fixed = 40e-6;
    const double quad_s = 2 * h * dh / (peak * 0.25), lin_s = 2 * d * (4 * h * dh) / (peak * 0.7);
    ok(close_to(rp_cost_attention_s(cp.cost, 30), (32.0 * 32 * quad_s + 32 * lin_s) / 2) &&
           fabs(rp_cost_attention_s(cp.cost, 30) - 1.022373e-09) < 1e-15,
       "CP 2: a sequence of 30 tokens is padded to 32 and its attention halved (%.7g s)",
       rp_cost_attention_s(cp.cost, 30));
    ok(close_to(rp_cost_attention_s(cp.cost, 40), rp_cost_attention_s(tp.cost, 40)) &&
           close_to(rp_cost_dense_s(cp.cost, 40), rp_cost_dense_s(tp.cost, 40)),
       "a 40-token sequence (no padding): CP 2 divides its attention, and the dense work the joint planner's "
       "surrogate balances (rp_cost_dense_s), as TP 2 does");
    /* rank 0's cell */
    const double core = (32.0 * 32 + 20 * 20) * quad_s / 2, proj = 52 * lin_s / 2, lin = 52 * tl / hbm / 2;
    const double tok_s = 2 * 4 * dh * bpp / nv, chunk = 52 / 2.0;
    const double ring_f = (chunk * tok_s + lat - core / 2) + lat, ring_b = (2 * chunk * tok_s + lat - 3 * core / 2) + lat;
    const double *A = rp_cost_attention_breakdown(cp.cost);
    ok(close_to(A[0], core + proj + ring_f), "A(0, 0) = core + projections + the ring's unhidden forward (%.7g s)",
       A[0]);
    ok(fabs(A[0] - 6.016206e-06) < 1e-12, "which is 6.016206e-06 s, as computed by hand");
    /* the step: 2 layers, each the larger dense phase forward and backward, experts,
     * dispatch and combine (overlap none); rank 1 (12 + 40 padded tokens) has more core */
    const double core1 = (12.0 * 12 + 40 * 40) * quad_s / 2;
    const double rf1 = (chunk * tok_s + lat - core1 / 2) + lat, rb1 = (2 * chunk * tok_s + lat - 3 * core1 / 2) + lat;
    const double df0 = core + proj + lin + fixed + ring_f, db0 = 3 * core + 2 * proj + 2 * lin + 2 * fixed + ring_b;
    const double df1 = core1 + proj + lin + fixed + rf1, db1 = 3 * core1 + 2 * proj + 2 * lin + 2 * fixed + rb1;
    const double slot = 6.0 * 100 * d * f / (peak * (0.28 + 36.0 / 192 * 0.22)) / 2;
    const double disp = 50 * d * bpp / (2 * nv) + lat;
    const double step = 2 * (fmax(df0, df1) + fmax(db0, db1) + 3 * slot + 4 * disp);
    ok(close_to(cp.sum.step_s, step) && fabs(step - 2.882704e-04) < 1e-10,
       "the step by hand: %.9g s (model %.9g s)", step, cp.sum.step_s);
    const double *X = rp_cost_expert_breakdown(cp.cost), *D = rp_cost_dispatch_breakdown(cp.cost);
    ok(close_to(X[0], slot) && close_to(D[0], disp) && close_to(X[0], rp_cost_expert_breakdown(tp.cost)[0]) &&
           close_to(D[0], rp_cost_dispatch_breakdown(tp.cost)[0]),
       "experts and dispatch per GPU divide by CP (as by TP): %.6g s, %.7g s", X[0], D[0]);
    ok(cp.sum.step_s > tp.sum.step_s && cp.sum.lower_bound_s <= cp.sum.step_s,
       "CP pays its ring where TP pays nothing (tiny sequences: the ring's latency shows); bound <= step");
    /* a long sequence hides the ring: its per-step compute outgrows the K/V transfer */
    const double big = rp_cost_attention_s(cp.cost, 16384), big_tp = rp_cost_attention_s(tp.cost, 16384);
    ok(close_to(big, big_tp), "16k tokens: the same attention per GPU under CP 2 and TP 2 (%.6g s)", big);
out:
    if (ok1) toy_scene_free(&tp);
    if (ok2) toy_scene_free(&cp);
}

/* ---- random plans ---- */

#define LAYERS 4

/* A random batch of 6-29 sequences (a few long ones) routed over 8 experts at LAYERS
 * layers, packed at random into M microbatches, with a random placement. */
static bool scene_make(random_scene *s, const char *topo, const char *extra, int32_t M)
{
    rp_error err;
    bool made = random_scene_make(ctx, s, config_l(topo, extra, LAYERS, 1 << rnd(3), &err), 6, 400, 6000, M, true,
                                  &rng_state, &err);
    if (!made) diag("scene on %s: %s", topo, err.text);
    return made;
}

static uint64_t fnv(uint64_t h, double v)
{
    unsigned char b[sizeof v];
    memcpy(b, &v, sizeof v);
    for (size_t i = 0; i < sizeof v; i++) h = (h ^ b[i]) * 0x100000001B3ULL;
    return h;
}

static const char *const SYNCS[] = {"group", "global"}, *const OVERLAPS[] = {"none", "layer"},
                         *const DEDUPS[] = {"choice", "gpu", "node"};

/* A random CP 1 layout (TP 1-4, ETP | TP, PP 1-2) and what it costs: the step, the
 * bound, the attention of every cell, and a tried and an applied move, folded into a
 * hash. The same draws at c63111d (before CP; this function built against that
 * commit's library, x86-64 GCC RelWithDebInfo) gave FROZEN_CP1: `context_parallel_size`
 * 1, given or not, must change no bit. */
#define FROZEN_CP1 0xe440261227e6ca08ULL
static uint64_t cp1_hash(bool explicit_cp, int *cases)
{
    uint64_t h = 0xCBF29CE484222325ULL;
    rng_state = 0x5DEECE66DULL;
    *cases = 0;
    for (int it = 0; it < 30; it++) {
        int nodes = 1 + (int)rnd(2), gpn = 8, tp = 1 << rnd(3), etp = tp >> rnd(tp == 1 ? 1 : 2);
        int pp = 1 + (int)rnd(2), stage = nodes * gpn / pp;
        int ep_gpus = tp << rnd(3);
        if (stage % ep_gpus != 0) ep_gpus = tp << rnd(2);
        if (stage % ep_gpus != 0) ep_gpus = tp;
        int ep = ep_gpus / etp;
        char topo[512], extra[256];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": %d, \"gpus_per_node\": %d, \"tensor_parallel_size\": %d,"
                 " \"expert_tensor_parallel_size\": %d, \"ep_size\": %d, \"pipeline_parallel_size\": %d%s",
                 nodes, gpn, tp, etp, ep, pp, explicit_cp ? ", \"context_parallel_size\": 1" : "");
        snprintf(extra, sizeof extra,
                 ", \"execution\": {\"executor\": \"ideal\", \"sync\": \"%s\", \"overlap\": \"%s\", "
                 "\"dispatch_dedup\": \"%s\"}",
                 SYNCS[rnd(2)], OVERLAPS[rnd(2)], DEDUPS[rnd(3)]);
        random_scene s;
        if (!scene_make(&s, topo, extra, 1 + (int32_t)rnd(3))) {
            random_scene_free(&s);
            continue;
        }
        rp_error err;
        rp_cost *cost = NULL;
        rp_cost_summary sum;
        if (rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) == RP_OK &&
            rp_cost_evaluate(cost, s.plan, &sum, &err) == RP_OK) {
            (*cases)++;
            h = fnv(fnv(h, sum.step_s), sum.lower_bound_s);
            const double *A = rp_cost_attention_breakdown(cost);
            const int32_t G = rp_config_topology(s.cfg)->num_gpus;
            for (int32_t i = 0; i < G * s.M; i++) h = fnv(h, A[i]);
            int32_t q = (int32_t)rnd((uint32_t)s.n), g = (int32_t)rnd((uint32_t)G), m = (int32_t)rnd((uint32_t)s.M);
            h = fnv(h, rp_cost_try_move(cost, q, g, m));
            if (rp_cost_apply_move(cost, s.plan, q, g, m, &err) == RP_OK) h = fnv(h, rp_cost_current_s(cost));
        } else {
            diag("case %d: %s", it, err.text);
        }
        rp_cost_free(cost);
        random_scene_free(&s);
    }
    return h;
}

static void test_cp1_frozen(void)
{
    int n1, n2;
    uint64_t implicit = cp1_hash(false, &n1), given = cp1_hash(true, &n2);
    ok(implicit == FROZEN_CP1 && n1 == 30,
       "CP 1 on %d random plans (TP 1-4, ETP, PP 1-2, every sync, overlap, dedup): the step, bound, attention and "
       "moves of c63111d bit for bit (hash %#llx)",
       n1, (unsigned long long)implicit);
    ok(given == implicit && n2 == n1, "\"context_parallel_size\": 1 given: the same bits");
}

/* Random CP layouts: bound <= step, and tried moves and swaps equal full evaluations of
 * the changed plans bit for bit. */
static void test_random(void)
{
    int bad_bound = 0, bad_try = 0, cases = 0, tries = 0;
    rng_state = 0x2545F4914F6CDD1DULL;
    for (int it = 0; it < 40; it++) {
        int gpn = rnd(2) ? 8 : 4, tp = 1 << rnd(2), cp = 2 << rnd(2), rank = tp * cp;
        int nodes = rank > gpn ? 2 : 1 + (int)rnd(2);
        int pp = (nodes * gpn) % (2 * rank) == 0 && rnd(2) ? 2 : 1, stage = nodes * gpn / pp;
        if (pp == 2 && stage < gpn && gpn % stage != 0) pp = 1, stage = nodes * gpn;
        int etp = tp > 1 ? tp >> rnd(2) : 1, ep_gpus = stage % (2 * rank) == 0 && rnd(2) ? 2 * rank : rank;
        double speed = rnd(3) ? 1.0 : 0.5 + rnd(4) * 0.25;
        char topo[512], extra[256];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": %d, \"gpus_per_node\": %d, \"tensor_parallel_size\": %d,"
                 " \"context_parallel_size\": %d, \"expert_tensor_parallel_size\": %d, \"ep_size\": %d,"
                 " \"pipeline_parallel_size\": %d, \"gpu_speed\": %g",
                 nodes, gpn, tp, cp, etp, ep_gpus / etp, pp, speed);
        snprintf(extra, sizeof extra,
                 ", \"execution\": {\"sync\": \"%s\", \"overlap\": \"%s\", \"dispatch_dedup\": \"%s\"}",
                 SYNCS[rnd(2)], OVERLAPS[rnd(2)], DEDUPS[rnd(3)]);
        random_scene s;
        if (!scene_make(&s, topo, extra, 1 + (int32_t)rnd(3))) {
            bad_bound++;
            random_scene_free(&s);
            continue;
        }
        rp_error err;
        rp_cost *cost = NULL;
        rp_cost_summary sum;
        const int32_t G = rp_config_topology(s.cfg)->num_gpus;
        if (rp_cost_new(ctx, s.cfg, s.batch, s.stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &cost, &err) ||
            rp_cost_evaluate(cost, s.plan, &sum, &err)) {
            diag("case %d (%s): %s", it, topo, err.text);
            bad_bound++;
        } else {
            cases++;
            if (!(sum.lower_bound_s <= sum.step_s * (1 + 1e-12)) || !isfinite(sum.step_s)) {
                bad_bound++;
                diag("case %d (%s%s): bound %.9g > step %.9g", it, topo, extra, sum.lower_bound_s, sum.step_s);
            }
            for (int k = 0; k < 4; k++) {
                double tried;
                rp_status st;
                if (k % 2 == 0) {
                    int32_t q = (int32_t)rnd((uint32_t)s.n), g = (int32_t)rnd((uint32_t)G),
                            m = (int32_t)rnd((uint32_t)s.M);
                    tried = rp_cost_try_move(cost, q, g, m);
                    st = isfinite(tried) ? rp_cost_apply_move(cost, s.plan, q, g, m, &err) : RP_EINVAL;
                } else {
                    int32_t a = (int32_t)rnd((uint32_t)s.n), b = (int32_t)rnd((uint32_t)s.n);
                    tried = rp_cost_try_swap(cost, a, b);
                    st = isfinite(tried) ? rp_cost_apply_swap(cost, s.plan, a, b, &err) : RP_EINVAL;
                }
                if (st != RP_OK) continue;
                tries++;
                rp_cost *fresh = NULL;
                rp_cost_summary fs;
                rp_cost_new(ctx, s.cfg, s.batch, s.stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &fresh, &err);
                if (rp_cost_evaluate(fresh, s.plan, &fs, &err) != RP_OK || fs.step_s != tried ||
                    fs.step_s != rp_cost_current_s(cost) || !(fs.lower_bound_s <= fs.step_s * (1 + 1e-12))) {
                    bad_try++;
                    diag("case %d: try %.17g, full %.17g", it, tried, fs.step_s);
                }
                rp_cost_free(fresh);
            }
        }
        rp_cost_free(cost);
        random_scene_free(&s);
    }
    ok(bad_bound == 0 && cases == 40,
       "bound <= step on %d random plans with CP 2-4 (TP 1-2, ETP, PP 1-2, DP ranks across nodes, mixed speeds)",
       cases);
    ok(bad_try == 0 && tries > 60, "%d tried moves and swaps equal full evaluations of the changed plans bit for bit",
       tries);
}


/* ---- a long rollout: the straggler, and the joint planner's packing ---- */

/* A model where attention dominates (32 heads of 128, small experts), on 4 GPUs of one
 * node: CP 1 is 4 DP ranks, CP 2 is 2 DP ranks of 2 GPUs. */
static rp_config *long_config(int cp, rp_error *err)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"context_parallel_size\": %d,"
             " \"ep_size\": 4},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 256,"
             "  \"expert_ffn_size\": 128, \"num_heads\": 32, \"num_kv_heads\": 8, \"head_dim\": 128},"
             " \"limits\": {\"max_tokens_per_microbatch\": 65536, \"num_microbatches\": 1}}",
             cp);
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "long.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

/* One rollout of 6000 tokens and 16 of 1500-2500: the long one has about 30% of the
 * batch's attention, more than a quarter (a GPU's share at CP 1), less than half (a DP
 * rank's share at CP 2). */
#define LONG_N 17
static rp_batch *long_batch(rp_stats **stats, uint8_t **ids)
{
    rp_error err;
    int32_t lens[LONG_N], zero[LONG_N] = {0};
    lens[0] = 6000;
    for (int i = 1; i < LONG_N; i++) lens[i] = 1500 + 67 * ((i * 7) % 16);
    rp_batch *batch = NULL;
    if (rp_batch_new(ctx, LONG_N, lens, zero, NULL, &batch, &err) != RP_OK) return NULL;
    int64_t tokens = rp_batch_num_tokens(batch);
    *ids = malloc((size_t)tokens * 2 * 2);
    for (int64_t k = 0; k < tokens * 2; k++) {
        (*ids)[2 * k] = (uint8_t)(k % 8);
        (*ids)[2 * k + 1] = (uint8_t)((k + 3) % 8);
    }
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, *ids);
    if (rp_stats_compute(ctx, batch, &r, 8, 1, stats, &err) != RP_OK) {
        rp_batch_free(batch);
        return NULL;
    }
    return batch;
}

/* The rank and microbatch holding sequence 0, and how many sequences share its cell. */
static int32_t long_cell(const rp_plan *plan, int32_t *rank)
{
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    for (int32_t g = 0; g < G; g++)
        for (int32_t m = 0; m < M; m++) {
            int32_t n = 0;
            const int32_t *list = rp_plan_microbatch(plan, g, m, &n);
            for (int32_t k = 0; k < n; k++)
                if (list[k] == 0) {
                    *rank = g;
                    return n;
                }
        }
    *rank = -1;
    return 0;
}

static void test_long_rollout(void)
{
    rp_error err;
    rp_stats *stats = NULL;
    uint8_t *ids = NULL;
    rp_batch *batch = long_batch(&stats, &ids);
    rp_config *c1 = long_config(1, &err), *c2 = long_config(2, &err);
    if (!batch || !c1 || !c2) {
        diag("setup: %s", err.text);
        skip(6, "setup");
        goto out;
    }
    /* The straggler, same GPUs: at CP 1 the long rollout alone on GPU 0 and the others
     * spread over GPUs 1-3; at CP 2 it alone on DP rank 0 (GPUs 0-1), the others
     * on DP rank 1 (GPUs 2-3). */
    int32_t rank1[LONG_N], rank2[LONG_N], mb[LONG_N] = {0};
    for (int i = 0; i < LONG_N; i++) rank1[i] = i == 0 ? 0 : 1 + (i - 1) % 3, rank2[i] = i == 0 ? 0 : 1;
    rp_plan *p1 = NULL, *p2 = NULL;
    rp_cost *k1 = NULL, *k2 = NULL;
    rp_cost_summary s1, s2;
    if (rp_plan_new(ctx, c1, 1, &p1, &err) || rp_plan_set_packing(p1, LONG_N, rank1, mb, &err) ||
        rp_plan_set_contiguous(p1, &err) || rp_plan_new(ctx, c2, 1, &p2, &err) ||
        rp_plan_set_packing(p2, LONG_N, rank2, mb, &err) || rp_plan_set_contiguous(p2, &err) ||
        rp_cost_new(ctx, c1, batch, stats, RP_SPLIT_EVEN, &k1, &err) || rp_cost_evaluate(k1, p1, &s1, &err) ||
        rp_cost_new(ctx, c2, batch, stats, RP_SPLIT_EVEN, &k2, &err) || rp_cost_evaluate(k2, p2, &s2, &err)) {
        diag("plans: %s", err.text);
        skip(3, "plans");
    } else {
        ok(s1.straggler_gpu == 0 && s1.straggler_side == RP_SIDE_ATTENTION,
           "CP 1: the long rollout's GPU 0 is the straggler, on attention (step %.4g ms)", s1.step_s * 1e3);
        if (s2.straggler_gpu != 1) diag("straggler %d side %d", s2.straggler_gpu, (int)s2.straggler_side);
        ok(s2.straggler_gpu == 1 && s2.straggler_side == RP_SIDE_ATTENTION,
           "CP 2: split over GPUs 0-1, it is not: the straggler moves to DP rank 1, the short rollouts' (step %.4g ms)",
           s2.step_s * 1e3);
        const double *a1 = rp_cost_attention_breakdown(k1), *a2 = rp_cost_attention_breakdown(k2);
        ok(close_to(a2[0], a1[0] / 2 + 3e-6),
           "its attention per GPU halves, plus one NVLink latency: its ring hides behind its compute (%.4g -> %.4g ms)",
           a1[0] * 1e3, a2[0] * 1e3);
    }
    rp_cost_free(k1);
    rp_cost_free(k2);
    rp_plan_free(p1);
    rp_plan_free(p2);
    /* The joint planner prices through the cost model and its surrogate divides
     * attention by CP alike: at CP 1 the long rollout sits alone and sets the step (step
     * / bound near 1: the bound counts it alone too); at CP 2 it no longer dominates: it
     * shares its DP rank with short rollouts and the straggler is where the planner put
     * the most work, not necessarily there. */
    rp_plan *j1 = NULL, *j2 = NULL;
    rp_joint_report r1, r2;
    if (rp_joint_plan(ctx, c1, batch, stats, NULL, NULL, NULL, &j1, &r1, &err) ||
        rp_joint_plan(ctx, c2, batch, stats, NULL, NULL, NULL, &j2, &r2, &err)) {
        diag("joint: %s", err.text);
        skip(3, "joint");
    } else {
        int32_t g1, g2;
        int32_t n1 = long_cell(j1, &g1), n2 = long_cell(j2, &g2);
        ok(n1 == 1, "CP 1: the joint packing leaves the long rollout alone on rank %d (%d sequences)", g1, n1);
        ok(n2 > 1, "CP 2: it packs %d short rollouts beside it on DP rank %d", n2 - 1, g2);
        ok(r2.step_s < r1.step_s, "and the step falls from %.4g to %.4g ms (step / bound %.3f -> %.3f)",
           r1.step_s * 1e3, r2.step_s * 1e3, r1.ratio, r2.ratio);
    }
    rp_plan_free(j1);
    rp_plan_free(j2);
out:
    rp_config_free(c1);
    rp_config_free(c2);
    rp_stats_free(stats);
    free(ids);
    rp_batch_free(batch);
}

/* Memory per GPU: a DP rank of TP x CP GPUs spreads its experts over them; the dense
 * parameters are replicated over the CP ranks, their optimizer state sharded over DP x CP. */
static void test_memory(void)
{
    rp_error err;
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4",
                            ", \"execution\": {\"optimizer_sharding\": \"dp\"}", &err);
    rp_config *cp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"context_parallel_size\": 4,"
                           " \"ep_size\": 8, \"slots_per_gpu\": 1",
                           ", \"execution\": {\"optimizer_sharding\": \"dp\"}", &err);
    rp_gpu_memory a, b;
    if (!one || !cp || rp_memory_gpu(one, NULL, 0, &a, &err) != RP_OK || rp_memory_gpu(cp, NULL, 0, &b, &err) != RP_OK) {
        diag("%s", err.text);
        skip(4, "configs");
    } else {
        /* both: 2 DP ranks of 4 slots; CP 4: each GPU one EP rank of 1 slot */
        ok(close_to(b.expert_weight_bytes, a.expert_weight_bytes / 4) &&
               close_to(b.expert_grad_bytes, a.expert_grad_bytes / 4) &&
               close_to(b.expert_optimizer_bytes, a.expert_optimizer_bytes / 4) &&
               close_to(b.staging_bytes, a.staging_bytes / 4),
           "CP 4: a GPU holds its one slot of the DP rank's 4 (%.0f of %.0f bytes of expert weights)",
           b.expert_weight_bytes, a.expert_weight_bytes);
        ok(close_to(b.dense_weight_bytes, a.dense_weight_bytes) && close_to(b.dense_grad_bytes, a.dense_grad_bytes) &&
               b.dense_optimizer_shards == 8 && a.dense_optimizer_shards == 2 &&
               close_to(b.dense_optimizer_bytes, a.dense_optimizer_bytes / 4),
           "the dense weights and gradients whole on every CP rank, their optimizer state over DP x CP = 8 GPUs");
        ok(b.context_parallel_size == 4 && b.activation_tokens == 250000 && a.activation_tokens == 1000000,
           "a GPU holds a quarter of a microbatch's tokens (%lld of 1000000)", (long long)b.activation_tokens);
        ok(close_to(b.activation_bytes, a.activation_bytes / 4),
           "and a quarter of its activations: the default bytes per token divide by CP (%.4g of %.4g GB)",
           b.activation_bytes / 1e9, a.activation_bytes / 1e9);
    }
    rp_config_free(one);
    rp_config_free(cp);
}

/* The bundled CP example fits its GPUs, activations of a full microbatch included; a CP
 * config runs in `routepack simulate` (the bundled trace, 2 DP ranks of CP 2 x TP 2). */
static void test_examples(void)
{
    rp_error err;
    rp_config *cfg = NULL;
    rp_gpu_memory m;
    rp_status st = rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-qwen3-30b-cp2.json", &cfg, &err);
    memset(&m, 0, sizeof m);
    if (st == RP_OK) st = rp_memory_peak(cfg, NULL, &m, &err);
    ok(st == RP_OK &&
           m.total_bytes + m.activation_bytes <= m.capacity_bytes && m.context_parallel_size == 2 &&
           rp_config_topology(cfg)->num_gpus == 4 && rp_config_topology(cfg)->ep_size == 2,
       "config-qwen3-30b-cp2.json loads: 4 DP ranks of TP 2 x CP 2, EP groups of 2; it fits with a full "
       "microbatch's activations (%.1f + %.1f GB of %.0f GB)",
       st == RP_OK ? m.total_bytes / 1e9 : 0, st == RP_OK ? m.activation_bytes / 1e9 : 0,
       st == RP_OK ? m.capacity_bytes / 1e9 : 0);
    rp_config_free(cfg);

    char dir[64];
    if (!temp_dir_make(dir, sizeof dir, "cp")) {
        skip(2, "no scratch directory");
        return;
    }
    const char *text =
        "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2,"
        " \"context_parallel_size\": 2, \"expert_tensor_parallel_size\": 1, \"ep_size\": 8, \"slots_per_gpu\": 9},"
        " \"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8, \"hidden_size\": 2048,"
        " \"expert_ffn_size\": 1024, \"num_heads\": 16, \"head_dim\": 128},"
        " \"limits\": {\"max_tokens_per_microbatch\": 4096}}";
    char path[512];
    snprintf(path, sizeof path, "%s", temp_path(dir, "cp.json"));
    spit(path, text, strlen(text));
    static char out[1 << 16];
    int rc = run_routepack(out, sizeof out, "simulate --config '%s' --trace '%s/examples/small.rpt' --steps 2 --quiet",
                           path, RP_SOURCE_DIR);
    bool header = strstr(out, "2 DP ranks of TP 2 x CP 2, ETP 1 (8 GPUs, 1 node x 8), EP groups of 2 DP ranks");
    ok(rc == 0 && header, "routepack simulate runs a TP 2 x CP 2 config and names the layout");
    ok(strstr(out, "verdict:") != NULL, "and gives its verdict");
    if (rc != 0 || !header || !strstr(out, "verdict:")) diag("exit %d: %s", rc, out);
    temp_dir_remove(dir);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_mapping();
    test_hand();
    test_cp1_frozen();
    test_random();
    test_long_rollout();
    test_memory();
    test_examples();
    rp_context_free(ctx);
    return tap_done();
}
