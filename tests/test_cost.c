/* Cost model: hand-computed tiny cases to the last digit, the efficiency curve, split
 * rules, straggler naming, the lower bound against random plans, incremental against
 * full evaluation, migration, the JSON breakdown, and bad input. */
#include "cost_internal.h"
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <stdlib.h>

#define REL(x, want) (fabs(want) * 1e-12 + 1e-300)

static rp_context *ctx;

/* ---- fixtures -------------------------------------------------------------------- */

typedef batch_fixture fixture; /* test_util.h */

/* Batch of prompt-only sequences and stats of a packed [tokens][L][k] uint8 routing. */
static bool fixture_make(fixture *f, const char *cfg_json, int32_t n, const int32_t *lens, const uint8_t *ids)
{
    rp_error err;
    if (batch_fixture_make(ctx, f, cfg_json, n, lens, NULL, ids, &err)) return true;
    diag("fixture: %s", err.text);
    return false;
}

/* The hand case's machine and model, with round constants:
 *   attention a(L) = 2 L^2 h d_h / (peak 0.5) + 2 L d (2 h d_h + 2 h_kv d_h) / peak
 *                  = 4 L^2 / 32 + 64 L / 64 = L^2 / 8 + L    (h = h_kv = 1, d_h = 2, d = 4, peak 64)
 *   expert t(n) = max(6 n d f / (peak eff(n)), 3 d f bpp / hbm) = max(0.75 n / eff(n), 1)
 *                 with eff = 0.5 up to 1 token, 1.0 from 4 tokens, linear between
 *   a token-choice is d bpp = 8 bytes: 1 s over NVLink (8 B/s), 2 s over the network (4 B/s);
 *   latencies 0.5 s (NVLink) and 1 s (network); backward = 2 x forward, so step = 3 x forward. */
static const char *HAND_CFG =
    "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": 2, \"slots_per_gpu\": %d,"
    "  \"gpu_speed\": %s, \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000,"
    "  \"net_bytes_per_s\": 4, \"net_latency_us\": 1000000},"
    " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48,"
    "  \"dense_efficiency\": 1, \"gemm_efficiency\": [[1, 0.5], [4, 1]], %s},"
    " \"execution\": {%s},"
    " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 4,"
    "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"num_kv_heads\": 1, \"head_dim\": 2,"
    "  \"bytes_per_param\": 2, \"bytes_per_optimizer_state\": 12},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100}}";

/* Three sequences (4, 2 and 3 tokens), top-2 over 4 experts at 2 layers; per token:
 * layer 0 pair, layer 1 pair. Histograms:
 *   s0  L0 [3,2,2,1]  L1 [1,1,3,3]
 *   s1  L0 [1,0,2,1]  L1 [2,2,0,0]
 *   s2  L0 [1,1,1,3]  L1 [1,3,1,1] */
static const int32_t HAND_LENS[3] = {4, 2, 3};
static const uint8_t HAND_IDS[] = {
    0, 1, 2, 3,  0, 2, 2, 3,  0, 3, 0, 2,  1, 2, 1, 3, /* s0 */
    2, 3, 0, 1,  0, 2, 0, 1,                           /* s1 */
    3, 1, 1, 2,  2, 3, 1, 3,  0, 3, 0, 1,              /* s2 */
};

/* The hand cases' hardware terms and execution as the first model had them: one backward
 * multiplier of 2 for every term, no token-linear work, no fixed cost, one global
 * synchronisation, a copy per token-choice, and the executor it priced ("ideal": pairwise
 * replica reductions, no host costs, extras copied per microbatch; the profiles' own
 * terms are checked by hand in test_cost_executor.c). */
static const char *const HAND_HW =
    "\"attention_efficiency\": 0.5, \"backward_multiplier\": 2, \"backward\": {\"communication\": 2},"
    " \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 0";
static const char *const HAND_EXEC = "\"executor\": \"ideal\", \"sync\": \"global\", \"dispatch_dedup\": \"choice\"";

static bool hand_fixture_with(fixture *f, int nodes, int per_node, int slots, const char *speed, const char *hw,
                              const char *exec)
{
    char json[2048], x[512];
    /* the executor the hand figures were derived under, unless the case names one */
    snprintf(x, sizeof x, "%s%s%s", strstr(exec, "executor") ? "" : "\"executor\": \"ideal\"",
             strstr(exec, "executor") || !*exec ? "" : ", ", exec);
    snprintf(json, sizeof json, HAND_CFG, nodes, per_node, slots, speed, hw, x);
    return fixture_make(f, json, 3, HAND_LENS, HAND_IDS);
}

static bool hand_fixture(fixture *f, int nodes, int per_node, int slots, const char *speed)
{
    return hand_fixture_with(f, nodes, per_node, slots, speed, HAND_HW, HAND_EXEC);
}

static rp_plan *plan_of(const fixture *f, int32_t M, const int32_t *rank, const int32_t *mb,
                        const int32_t *phy2log /* [L][S] or NULL */)
{
    rp_plan *p = NULL;
    rp_error err;
    if (rp_plan_new(ctx, f->cfg, M, &p, &err) != RP_OK) {
        diag("plan: %s", err.text);
        return NULL;
    }
    int32_t n = rp_batch_num_seqs(f->batch);
    if (rank && rp_plan_set_packing(p, n, rank, mb, &err) != RP_OK) diag("packing: %s", err.text);
    if (phy2log) {
        int32_t S = rp_plan_total_slots(p);
        for (int32_t l = 0; l < rp_plan_num_layers(p); l++)
            if (rp_plan_set_phy2log(p, l, phy2log + (size_t)l * S, &err) != RP_OK) diag("placement: %s", err.text);
    }
    return p;
}

/* The hand tests' opening: a cost model of f (even split) and plan_of(f, ...) evaluated
 * by it into *s, checked ("evaluates"). */
static rp_plan *evaluated(const fixture *f, rp_cost **c, int32_t M, const int32_t *rank, const int32_t *mb,
                          const int32_t *phy2log, rp_cost_summary *s)
{
    rp_error err;
    rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, c, &err);
    rp_plan *p = plan_of(f, M, rank, mb, phy2log);
    is_int(rp_cost_evaluate(*c, p, s, &err), RP_OK, "evaluates");
    return p;
}

static const int32_t HAND_RANK[3] = {0, 1, 1}, HAND_MB[3] = {0, 0, 0};
static const int32_t CONTIG4[2 * 4] = {0, 1, 2, 3, 0, 1, 2, 3};

/* ---- hand-computed cases --------------------------------------------------------- */

static void test_hand_one_node(void)
{
    fixture f;
    ok(hand_fixture(&f, 1, 2, 2, "1"), "hand case: 2 GPUs on 1 node");
    rp_cost *c = NULL;
    rp_error err;
    is_int(rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err), RP_OK, "evaluator created");
    is_double(rp_cost_attention_s(c, 4), 6.0, 1e-15, "a(4) = 16/8 + 4 = 6");
    is_double(rp_cost_attention_s(c, 3), 4.125, 1e-15, "a(3) = 9/8 + 3");
    ok(isnan(rp_cost_current_s(c)) && !rp_cost_attention_breakdown(c), "nothing bound before evaluation");

    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_summary s;
    is_int(rp_cost_evaluate(c, p, &s, &err), RP_OK, "hand plan evaluates");
    /* A(0) = a(4) = 6; A(1) = a(2) + a(3) = 2.5 + 4.125 = 6.625.
     * Counts L0: GPU0 [3,2,2,1], GPU1 [2,1,3,4]; experts 0,1 on GPU0, 2,3 on GPU1.
     *  loads [5,3,5,5]: X0 = t(5) + t(3) = 3.75 + 2.7 = 6.45; X1 = 3.75 + 3.75 = 7.5
     *  GPU0 sends 2+1 = 3 and receives 2+1 = 3: 3 s + 0.5 = 3.5 on both
     *  T(0,0) = 6.625 + 3.5 + 7.5 + 3.5 = 21.125
     * Counts L1: GPU0 [1,1,3,3], GPU1 [3,5,1,1]: loads [4,6,4,4]
     *  X0 = t(4) + t(6) = 3 + 4.5 = 7.5; X1 = 3 + 3 = 6
     *  GPU0 sends 6, receives 8: 8.5 on both.  T(0,1) = 6.625 + 8.5 + 7.5 + 8.5 = 31.125
     * step = 3 (21.125 + 31.125) = 156.75 */
    is_double(s.step_s, 156.75, REL(0, 156.75), "step time");
    is_double(rp_cost_layer_s(c, 0, 0), 3 * (21.125), 3 * (REL(0, 21.125)), "T(0,0)");
    is_double(rp_cost_layer_s(c, 0, 1), 3 * (31.125), 3 * (REL(0, 31.125)), "T(0,1)");
    is_double(s.attention_s, 39.75, REL(0, 39.75), "attention term 3 x 2 x 6.625");
    is_double(s.dispatch_s, 36.0, REL(0, 36.0), "dispatch term 3 x (3.5 + 8.5)");
    is_double(s.combine_s, 36.0, REL(0, 36.0), "combine term equals dispatch");
    is_double(s.expert_s, 45.0, REL(0, 45.0), "expert term 3 x (7.5 + 7.5)");
    is_double(s.grad_reduce_s, 0.0, 0.0, "no replicas, no gradient reduction");
    is_double(s.extra_copy_s, 0.0, 0.0, "no extra replicas");
    /* Lower bound: every term at its mean over the GPUs.
     * attention: max((6 + 6.625) / 2, a(4) / 1) = 6.3125.
     * experts L0: (6.45 + 7.5) / 2 = 6.975; L1: (7.5 + 6) / 2 = 6.75.
     * dispatch L0: (3.5 + 3.5) / 2 = 3.5; L1: 8.5.
     * bound = 3 ((6.3125 + 3.5 + 6.975 + 3.5) + (6.3125 + 8.5 + 6.75 + 8.5)) = 151.05 */
    is_double(s.lower_bound_s, 151.05, REL(0, 151.05), "lower bound");
    is_double(s.ratio, 156.75 / 151.05, 1e-12, "ratio");
    is_double(s.attention_imbalance, 6.625 / 6.3125, 1e-12, "attention imbalance max/mean");
    is_double(s.expert_imbalance, (7.5 / 6.975 + 7.5 / 6.75) / 2, 1e-12, "expert imbalance");
    /* largest term: dispatch 8.5 at layer 1 (GPU 0 and 1 tie: the first) */
    is_int(s.straggler_side, RP_SIDE_DISPATCH, "straggler side");
    is_int(s.straggler_layer, 1, "straggler layer");
    is_int(s.straggler_gpu, 0, "straggler GPU");
    int32_t g;
    is_int(rp_cost_layer_straggler(c, 0, 0, &g), RP_SIDE_EXPERT, "layer 0 is decided by experts");
    is_int(g, 1, "... on GPU 1");
    const double *A = rp_cost_attention_breakdown(c), *X = rp_cost_expert_breakdown(c),
                 *D = rp_cost_dispatch_breakdown(c), *C = rp_cost_combine_breakdown(c);
    ok(A[0] == 6.0 && A[1] == 6.625, "attention breakdown per GPU");
    is_double(X[0], 6.45, 1e-13, "expert breakdown (mb 0, layer 0, GPU 0)");
    ok(X[1] == 7.5 && X[2] == 7.5 && X[3] == 6.0, "expert breakdown of the other cells");
    ok(D[0] == 3.5 && D[1] == 3.5 && D[2] == 8.5 && D[3] == 8.5, "dispatch breakdown");
    ok(C[2] == 8.5, "combine breakdown");
    is_double(rp_cost_current_s(c), 156.75, 1e-12, "current step time");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

static void test_hand_two_nodes(void)
{
    fixture f;
    ok(hand_fixture(&f, 2, 1, 2, "1"), "hand case: 2 GPUs on 2 nodes");
    rp_cost *c = NULL;
    rp_cost_summary s;
    rp_plan *p = evaluated(&f, &c, 1, HAND_RANK, HAND_MB, CONTIG4, &s);
    /* Same volumes over the network: L0 3 x 2 s + 0.5 + 1 = 7.5; L1 8 x 2 + 1.5 = 17.5.
     * T = 6.625 + 7.5 + 7.5 + 7.5 = 29.125 and 6.625 + 17.5 + 7.5 + 17.5 = 49.125;
     * step = 3 x 78.25 = 234.75. Bound: dispatch is the same on both GPUs:
     * 3 ((6.3125 + 7.5 + 6.975 + 7.5) + (6.3125 + 17.5 + 6.75 + 17.5)) = 229.05. */
    is_double(s.step_s, 234.75, 1e-12 * 234.75, "step over the network");
    is_double(s.lower_bound_s, 229.05, 1e-12 * 229.05, "bound pays the network's traffic too");
    const double *D = rp_cost_dispatch_breakdown(c);
    ok(D[0] == 7.5 && D[2] == 17.5, "dispatch pays the network and both latencies");
    /* and its commit, 2 x 336 bytes of HBM at 48 B/s: 14 s */
    is_double(rp_cost_expert_move_s(c, false), 336.0 / 4 + 1 + 14, 1e-12, "expert move over the network");
    is_double(rp_cost_expert_move_s(c, true), 336.0 / 8 + 0.5 + 14, 1e-12, "expert move over NVLink");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* Layer 0 with a spare slot on each GPU: expert 2 on both (slots 2 and 3). */
static const int32_t SPARE_P2L[2 * 6] = {0, 1, 2, 2, 3, -1, 0, 1, -1, 2, 3, -1};

static void test_hand_replicas(void)
{
    fixture f;
    ok(hand_fixture(&f, 1, 2, 3, "1"), "hand case with a spare slot per GPU");
    rp_cost *even = NULL, *local = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &even, &err);
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &local, &err);
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, SPARE_P2L);
    rp_cost_summary s;
    /* Gradient reduction: expert 2 of layer 0 has a second replica on GPU 1; both GPUs
     * exchange 3 d f bpp = 48 bytes over NVLink: 48/8 + 0.5 = 6.5 s. Layer 1 is as in
     * the first case: 31.125. */
    is_int(rp_cost_evaluate(even, p, &s, &err), RP_OK, "even split evaluates");
    /* Even: expert 2's 5 choices split 2.5 / 2.5; t(2.5) = 0.75 x 2.5 / 0.75 = 2.5.
     *  X0 = 3.75 + 2.7 + 2.5 = 8.95, X1 = 2.5 + 3.75 = 6.25.
     *  GPU0 sends 1 (half its expert-2) + 1 (expert 3) = 2; GPU1 sends 2 + 1 + 1.5 = 4.5
     *  dispatch = 4.5 + 0.5 = 5.  T(0,0) = 6.625 + 5 + 8.95 + 5 = 25.575
     *  step = 3 (25.575 + 31.125) + 6.5 = 176.6 */
    is_double(s.grad_reduce_s, 6.5, 1e-12, "gradient reduction of one extra replica");
    is_double(rp_cost_layer_s(even, 0, 0), 3 * (25.575), 3 * (1e-12 * 25.575), "T(0,0), even split");
    is_double(s.step_s, 176.6, 1e-12 * 176.6, "step, even split");
    /* Locality: each source keeps its expert-2 choices on its own replica: loads 2 / 3.
     *  X0 = 3.75 + 2.7 + t(2) = 2.25 -> 8.7; X1 = t(3) + 3.75 = 6.45; sends 1 and 3:
     *  dispatch 3.5.  T(0,0) = 6.625 + 3.5 + 8.7 + 3.5 = 22.325; step = 3 x 53.45 + 6.5 */
    is_int(rp_cost_evaluate(local, p, &s, &err), RP_OK, "locality split evaluates");
    is_double(rp_cost_layer_s(local, 0, 0), 3 * (22.325), 3 * (1e-12 * 22.325), "T(0,0), locality split");
    is_double(s.step_s, 166.85, 1e-12 * 166.85, "step, locality split");

    /* Explicit shares 1/4, 3/4 override either rule: loads 1.25 and 3.75.
     *  eff(1.25) = 0.5 + 0.5 (0.25 / 3) = 13/24: t = 0.9375 x 24/13 = 22.5/13
     *  eff(3.75) = 0.5 + 0.5 (2.75 / 3) = 5.75/6: t = 2.8125 x 6/5.75 = 16.875/5.75
     *  X0 = 6.45 + 22.5/13 (the larger), X1 = 16.875/5.75 + 3.75
     *  GPU0 sends 1.5 + 1 = 2.5, GPU1 sends 2 + 1 + 0.75 = 3.75: dispatch 4.25 */
    double shares[2] = {0.25, 0.75};
    is_int(rp_plan_set_shares(p, 0, 0, 2, shares, 2, &err), RP_OK, "shares set");
    double t00 = 6.625 + 4.25 + (6.45 + 22.5 / 13) + 4.25;
    is_int(rp_cost_evaluate(local, p, &s, &err), RP_OK, "explicit shares evaluate");
    is_double(rp_cost_layer_s(local, 0, 0), 3 * (t00), 3 * (1e-12 * t00), "T(0,0) with explicit shares (locality rule)");
    rp_cost_evaluate(even, p, &s, &err);
    is_double(rp_cost_layer_s(even, 0, 0), 3 * t00, 3e-12 * t00, "... and the same under the even rule");
    is_double(rp_cost_expert_breakdown(even)[1], 16.875 / 5.75 + 3.75, 1e-12 * 7, "X1 with shares");
    rp_plan_free(p);
    rp_cost_free(even);
    rp_cost_free(local);
    batch_fixture_free(&f);
}

static void test_hand_extra_replica(void)
{
    fixture f;
    ok(hand_fixture(&f, 1, 2, 2, "1"), "hand case for an extra replica");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    is_int(rp_plan_add_extra_replica(p, 0, 1, 1, 1, &err), RP_OK, "extra replica of expert 1 on EP rank 1");
    rp_cost_summary s;
    is_int(rp_cost_evaluate(c, p, &s, &err), RP_OK, "evaluates");
    /* L1: expert 1's 6 choices split 3 / 3 (GPU0 sends 0.5 of its 1, GPU1 keeps 2.5 of 5).
     *  X0 = t(4) + t(3) = 5.7; X1 = t(4) + t(4) + t(3) = 8.7
     *  GPU0 sends 0.5 + 3 + 3 = 6.5, GPU1 sends 3 + 2.5 = 5.5: dispatch 7
     *  T(0,1) = 6.625 + 7 + 8.7 + 7 = 29.325; copy 2 (48/8 + 0.5) = 13
     *  step = 3 (21.125 + 29.325) + 13 = 164.35
     * Bound: L0 as without it, 20.2875; L1 6.3125 + 7 + (5.7 + 8.7) / 2 + 7 = 27.5125;
     *  the copy spread over both EP ranks: 2 (0.5 x 48/8 + 0.5) = 7;
     *  bound = 3 (20.2875 + 27.5125) + 7 = 150.4 */
    is_double(s.extra_copy_s, 13.0, 1e-12, "extra copy: weights over and gradient back");
    is_double(rp_cost_layer_s(c, 0, 1), 3 * (29.325), 3 * (1e-12 * 29.325), "T(0,1) with the extra replica");
    is_double(s.step_s, 164.35, 1e-12 * 164.35, "step with an extra replica");
    is_double(s.lower_bound_s, 150.4, 1e-12 * 150.4, "bound spreads the extra copy");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* Locality's node tier: 2 nodes x 2 GPUs in one EP group; expert 3 on rank 1 (node 0)
 * and rank 3 (node 1); one single-token sequence per GPU, all to expert 3 (top-1). */
static void test_locality_nodes(void)
{
    static const char *cfg =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 4, \"slots_per_gpu\": 2,"
        "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000, \"net_bytes_per_s\": 4,"
        "  \"net_latency_us\": 1000000},"
        " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48, \"attention_efficiency\": 0.5,"
        "  \"dense_efficiency\": 1, \"gemm_efficiency\": [[1, 0.5], [4, 1]], \"backward_multiplier\": 2,"
        "  \"backward\": {\"communication\": 2}, \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 0},"
        " \"execution\": {\"executor\": \"ideal\", \"sync\": \"global\", \"dispatch_dedup\": \"choice\"},"
        " \"model\": {\"num_layers\": 1, \"num_experts\": 4, \"top_k\": 1, \"hidden_size\": 4,"
        "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"head_dim\": 2},"
        " \"limits\": {\"max_tokens_per_microbatch\": 100}}";
    int32_t lens[4] = {1, 1, 1, 1}, rank[4] = {0, 1, 2, 3}, mb[4] = {0, 0, 0, 0};
    uint8_t ids[4] = {3, 3, 3, 3};
    int32_t p2l[8] = {0, -1, 1, 3, 2, -1, 3, -1};
    fixture f;
    ok(fixture_make(&f, cfg, 4, lens, ids), "node-tier fixture");
    rp_cost *local = NULL, *even = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &local, &err);
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &even, &err);
    rp_plan *p = plan_of(&f, 1, rank, mb, p2l);
    rp_cost_evaluate(local, p, NULL, &err);
    rp_cost_evaluate(even, p, NULL, &err);
    const double *D = rp_cost_dispatch_breakdown(local), *X = rp_cost_expert_breakdown(local);
    /* Locality: GPU0 sends its choice to rank 1 (same node), GPU2 to rank 3: one
     * choice over NVLink each, no network: 1 + 0.5 = 1.5 everywhere. Loads 2 and 2. */
    ok(D[0] == 1.5 && D[1] == 1.5 && D[2] == 1.5 && D[3] == 1.5, "locality stays inside each node");
    ok(X[0] == 0 && X[1] == 2.25 && X[2] == 0 && X[3] == 2.25, "locality loads: two choices per replica");
    /* Even: every source sends half to each replica.
     *  GPU0: 0.5 NVLink + 0.5 network: 0.5 + 1 + 0.5 + 1 = 3
     *  GPU1: receives 0.5 over NVLink, sends 0.5 and receives 1 over the network: 0.5 + 2 + 1.5 = 4 */
    D = rp_cost_dispatch_breakdown(even);
    ok(D[0] == 3.0 && D[1] == 4.0 && D[2] == 3.0 && D[3] == 4.0, "even split crosses nodes");
    rp_plan_free(p);
    rp_cost_free(local);
    rp_cost_free(even);
    batch_fixture_free(&f);
}

/* Issue 14's terms on the one-node hand case (forward values as in test_hand_one_node):
 *   GPU0 holds s0 (4 tokens): attention core L^2/8 = 2, projections L = 4
 *   GPU1 holds s1, s2 (5 tokens): core (4 + 9)/8 = 1.625, projections 5
 *   experts L0 X = 6.45, 7.5; L1 7.5, 6; dispatch L0 3.5, L1 8.5 on both GPUs
 * token-linear 48 bytes per token over 48 B/s = 1 s per token; fixed 0.25 s;
 * backward: attention 3, projections 1, experts 2, token-linear 1, communication 1, fixed 0. */
static const char *const TERMS_HW =
    "\"attention_efficiency\": 0.5, \"backward\": {\"attention\": 3, \"projections\": 1, \"experts\": 2,"
    " \"token_linear\": 1, \"communication\": 1, \"fixed\": 0}, \"token_linear_bytes_per_token\": 48,"
    " \"layer_fixed_us\": 250000";

static void test_hand_terms(void)
{
    const char *exec[2] = {"\"sync\": \"global\", \"dispatch_dedup\": \"choice\"",
                           "\"sync\": \"global\", \"dispatch_dedup\": \"choice\", \"overlap\": \"layer\""};
    for (int v = 0; v < 2; v++) {
        fixture f;
        ok(hand_fixture_with(&f, 1, 2, 2, "1", TERMS_HW, exec[v]), "terms fixture, overlap %s", v ? "layer" : "none");
        rp_cost *c = NULL;
        rp_cost_summary s;
        rp_plan *p = evaluated(&f, &c, 1, HAND_RANK, HAND_MB, CONTIG4, &s);
        rp_error err;
        /* s0 alone: (1 + 3) 2 + (1 + 1) 4 + (1 + 1) 4, forward and backward, no fixed cost */
        is_double(rp_cost_dense_s(c, 4), 24.0, 1e-12, "rp_cost_dense_s: a sequence's dense work, each term at its multiplier");
        /* dense forward: GPU0 2 + 4 + 4 + 0.25 = 10.25, GPU1 1.625 + 5 + 5 + 0.25 = 11.875
         * dense backward: GPU0 3 x 2 + 4 + 4 + 0 = 14, GPU1 3 x 1.625 + 5 + 5 = 14.875
         * no overlap: T(0,0) = 11.875 + 14.875 + 3 x 7.5 + 2 x 2 x 3.5 = 63.25
         *             T(0,1) = 26.75 + 22.5 + 2 x 2 x 8.5 = 83.25; step 146.5
         * overlap:    T(0,0) = max(49.25, 14) = 49.25, T(0,1) = max(49.25, 34) = 49.25; step 98.5 */
        double t0 = v ? 49.25 : 63.25, t1 = v ? 49.25 : 83.25;
        is_double(rp_cost_layer_s(c, 0, 0), t0, 1e-12 * t0, "T(0,0) with per-term backward, token-linear, fixed");
        is_double(rp_cost_layer_s(c, 0, 1), t1, 1e-12 * t1, "T(0,1)");
        is_double(s.step_s, t0 + t1, 1e-12 * (t0 + t1), "step");
        is_double(s.attention_s, 53.5, 1e-12 * 53.5, "dense phase term 2 x (11.875 + 14.875)");
        is_double(s.expert_s, 45.0, 1e-12 * 45, "expert term (1 + 2) x (7.5 + 7.5)");
        is_double(s.dispatch_s, 24.0, 1e-12 * 24, "dispatch term (1 + 1) x (3.5 + 8.5)");
        /* bound: dense 25.5 both layers (means 11.0625 + 14.4375 beat s0 alone, 10.25 + 14);
         * experts means 6.975 and 6.75; dispatch 3.5 and 8.5.
         * none: 25.5 + 20.925 + 14 + 25.5 + 20.25 + 34 = 140.175; layer: 46.425 + 45.75 */
        double lb = v ? 92.175 : 140.175;
        is_double(s.lower_bound_s, lb, 1e-12 * lb, "lower bound");
        char *text = NULL;
        size_t len = 0;
        is_int(rp_cost_breakdown_json(c, &text, &len, &err), RP_OK, "breakdown JSON");
        json_error_t jerr;
        json_t *root = text ? json_loadb(text, len, 0, &jerr) : NULL;
        json_t *cmp = json_object_get(root, "compute"), *x = json_object_get(root, "execution");
        /* compute(g, 0, 0): GPU0 10.25 + 14 + 3 x 6.45 = 43.6; GPU1 11.875 + 14.875 + 22.5 = 49.25 */
        is_double(json_number_value(json_array_get(json_array_get(json_array_get(cmp, 0), 0), 0)), 43.6, 1e-12,
                  "compute[mb 0][layer 0][gpu 0]");
        is_double(json_number_value(json_array_get(json_array_get(json_array_get(cmp, 0), 0), 1)), 49.25, 1e-12,
                  "compute[mb 0][layer 0][gpu 1]");
        is_str(json_string_value(json_object_get(x, "sync")), "global", "execution.sync");
        is_str(json_string_value(json_object_get(x, "overlap")), v ? "layer" : "none", "execution.overlap");
        is_str(json_string_value(json_object_get(x, "dispatch_dedup")), "choice", "execution.dispatch_dedup");
        json_decref(root);
        rp_text_free(ctx, text);
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

/* The attention curve by length: eff 0.25 at 2 tokens, 1 at 4, linear between; the core
 * is 2 L^2 h d_h / (peak eff(L)) = L^2 / (16 eff(L)). */
static void test_hand_attention_curve(void)
{
    fixture f;
    const char *hw = "\"attention_efficiency\": [[2, 0.25], [4, 1]], \"backward_multiplier\": 2, "
                     "\"backward\": {\"communication\": 2}, \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 0";
    ok(hand_fixture_with(&f, 1, 2, 2, "1", hw, HAND_EXEC), "attention curve fixture");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    is_double(rp_cost_attention_s(c, 2), 1.0 + 2, 1e-15, "a(2) = 4 / (16 x 0.25) + 2");
    is_double(rp_cost_attention_s(c, 3), 0.9 + 3, 1e-15, "a(3) = 9 / (16 x 0.625) + 3: eff interpolated");
    is_double(rp_cost_attention_s(c, 4), 1.0 + 4, 1e-15, "a(4) = 16 / 16 + 4");
    is_double(rp_cost_attention_s(c, 8), 4.0 + 8, 1e-15, "flat beyond the last point");
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, p, NULL, &err);
    const double *A = rp_cost_attention_breakdown(c);
    is_double(A[0], 5.0, 1e-12, "A(GPU0) = a(4)");
    is_double(A[1], 6.9, 1e-12, "A(GPU1) = a(2) + a(3): each sequence at its own efficiency");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* Group synchronisation: 4 GPUs in 2 EP groups of 2; s0 on GPU0, s1 on GPU1 (group 0),
 * s2 on GPU2 (group 1), GPU3 idle. Forward, per group and layer:
 *   group 0: L0 A 6, D 3.5, X 5.25 -> 18.25; L1 A 6, D 6.5, X 5.4 -> 24.4; sum 42.65
 *   group 1: L0 A 4.125, D 4.5, X 4.2 -> 17.325; L1 4.125, 2.5, 4.2 -> 13.325; sum 30.65
 *   group step = 3 x 42.65; global: L0 6 + 2 x 4.5 + 5.25 = 20.25, L1 24.4 -> 3 x 44.65
 * bounds: group, the mean of each group's own balanced layers:
 *   3 x (18.25 + 24.4 + (4.125 + 9 + 3.6) + (4.125 + 5 + 3.6)) / 2 = 108.15
 *   global: L0 6 + 2 x 4 + 4.425, L1 6 + 2 x 4.5 + 4.5: 3 x 37.925 = 113.775 */
static void test_hand_sync(void)
{
    static const int32_t rank[3] = {0, 1, 2}, mb[3] = {0, 0, 0};
    const char *exec[2] = {"\"sync\": \"group\", \"dispatch_dedup\": \"choice\"", HAND_EXEC};
    const double step[2] = {3 * 42.65, 3 * 44.65}, bound[2] = {108.15, 113.775};
    for (int v = 0; v < 2; v++) {
        fixture f;
        ok(hand_fixture_with(&f, 1, 4, 2, "1", HAND_HW, exec[v]), "sync %s fixture", v ? "global" : "group");
        rp_cost *c = NULL;
        rp_cost_summary s;
        rp_plan *p = evaluated(&f, &c, 1, rank, mb, CONTIG4, &s);
        is_double(s.step_s, step[v], 1e-12 * step[v], "step under sync %s", v ? "global" : "group");
        is_double(s.lower_bound_s, bound[v], 1e-12 * bound[v], "lower bound under sync %s", v ? "global" : "group");
        is_double(rp_cost_layer_s(c, 0, 0), v ? 3 * 20.25 : 3 * 18.25, 1e-12 * 60, "T(0,0): %s",
                  v ? "job-wide phase maxima" : "the slowest group's");
        if (!v) {
            is_int(s.straggler_side, RP_SIDE_DISPATCH, "straggler of the critical group: dispatch");
            ok(s.straggler_gpu == 0 && s.straggler_layer == 1, "... GPU 0 at layer 1");
            is_double(s.attention_s + s.expert_s + s.dispatch_s + s.combine_s, step[0], 1e-12 * step[0],
                      "the critical group's terms add up to the step");
        }
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

/* A layer's straggler follows the sync domain. The group case of test_hand_sync with GPU 3
 * (EP rank 1 of group 1: experts 2 and 3) at half speed: its expert time doubles, to
 * 2 x (t(1) + t(3)) = 2 x (1.5 + 2.7) = 8.4 at layer 0 and 2 x (t(1) + t(1)) = 6 at layer 1,
 * so group 1 sums 4.125 + 2 x 4.5 + 8.4 = 21.525 and 4.125 + 2 x 2.5 + 6 = 15.125: 36.65,
 * still below group 0's 42.65. At layer 0 the largest phase of the whole job is GPU 3's
 * experts (8.4 > attention 6); in the critical group 0 it is GPU 0's attention (6 > X 5.25
 * > D 3.5). Under global sync the job is the domain: GPU 3's experts. */
static void test_layer_straggler_domain(void)
{
    static const int32_t rank[3] = {0, 1, 2}, mb[3] = {0, 0, 0};
    const char *exec[2] = {"\"sync\": \"group\", \"dispatch_dedup\": \"choice\"", HAND_EXEC};
    for (int v = 0; v < 2; v++) {
        fixture f;
        ok(hand_fixture_with(&f, 1, 4, 2, "[1, 1, 1, 0.5]", HAND_HW, exec[v]), "straggler fixture, sync %s",
           v ? "global" : "group");
        rp_cost *c = NULL;
        rp_cost_summary s;
        rp_plan *p = evaluated(&f, &c, 1, rank, mb, CONTIG4, &s);
        rp_error err;
        is_double(rp_cost_expert_breakdown(c)[3], 8.4, 1e-12, "GPU 3's experts at layer 0 take 8.4");
        int32_t g = -1;
        rp_side side = rp_cost_layer_straggler(c, 0, 0, &g);
        if (!v) {
            is_double(s.step_s, 3 * 42.65, 1e-12 * 128, "group 0 still sets the step");
            ok(side == RP_SIDE_ATTENTION && g == 0, "layer 0's straggler in the critical group: attention on GPU 0 "
               "(side %d, GPU %d)", (int)side, g);
        } else {
            ok(side == RP_SIDE_EXPERT && g == 3, "under global sync: the experts of GPU 3 (side %d, GPU %d)", (int)side,
               g);
        }
        char *text = NULL;
        size_t len = 0;
        rp_cost_breakdown_json(c, &text, &len, &err);
        json_error_t jerr;
        json_t *root = text ? json_loadb(text, len, 0, &jerr) : NULL;
        json_t *l0 = json_array_get(json_object_get(root, "layers"), 0);
        const char *l0_side = json_string_value(json_object_get(l0, "straggler_side"));
        ok(json_integer_value(json_object_get(l0, "straggler_gpu")) == (v ? 3 : 0) && l0_side &&
               !strcmp(l0_side, v ? "expert" : "attention"),
           "the breakdown's layer 0 names the same straggler");
        json_decref(root);
        rp_text_free(ctx, text);
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

/* FP8 dispatch: a token-choice is d x 1 byte = 4 B, 0.5 s over NVLink; on the one-node
 * hand case dispatch becomes 1.5 + 0.5 = 2 at L0 and 4 + 0.5 = 4.5 at L1. */
static void test_hand_dispatch_bytes(void)
{
    /* Combine in FP8 too: 3 copies at L0 and 8 at L1 at 0.5 s each, plus the latency.
     * Combine in BF16 (the default, as DeepEP): a copy of dispatch and combine is priced
     * at their mean, 1.5 B per element, 0.75 s: 3 x 0.75 + 0.5 = 2.75 and 8 x 0.75 + 0.5
     * = 6.5, so dispatch + combine = 2 x 2.75 = 2 + 3.5 (FP8 one way, BF16 the other). */
    const char *combine[2] = {", \"combine_bytes_per_element\": 1", ""};
    const double want[2][2] = {{2.0, 4.5}, {2.75, 6.5}};
    for (int v = 0; v < 2; v++) {
        fixture f;
        char exec[256];
        snprintf(exec, sizeof exec, "\"sync\": \"global\", \"dispatch_dedup\": \"choice\", "
                 "\"dispatch_bytes_per_element\": 1%s", combine[v]);
        ok(hand_fixture_with(&f, 1, 2, 2, "1", HAND_HW, exec), "FP8 dispatch fixture, combine %s", v ? "BF16" : "FP8");
        rp_cost *c = NULL;
        rp_error err;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
        rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
        rp_cost_evaluate(c, p, NULL, &err);
        const double *D = rp_cost_dispatch_breakdown(c), *C = rp_cost_combine_breakdown(c);
        ok(D[0] == want[v][0] && D[1] == want[v][0] && D[2] == want[v][1] && D[3] == want[v][1] &&
               C[0] == D[0] && C[3] == D[3],
           "dispatch and combine at %s: %g, %g, %g, %g", v ? "1 and 2 bytes per element" : "1 byte per element",
           D[0], D[1], D[2], D[3]);
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

/* Dispatch once per destination GPU on the one-node hand case (each GPU holds 2 experts,
 * top-2, so a token sends at most m = 2 choices to a GPU): a source with n tokens sending
 * c choices sends n (1 - (1 - c / 2n)^2) copies.
 *   L0: GPU0 (4 tokens) 3 choices: 4 (1 - (5/8)^2) = 2.4375; GPU1 (5 tokens) 3: 2.55
 *       D = 2.55 + 0.5 = 3.05 on both GPUs (one sends what the other receives)
 *   L1: GPU0 6 choices: 4 (1 - (1/4)^2) = 3.75; GPU1 8: 5 (1 - 0.2^2) = 4.8; D = 5.3 */
static void test_hand_dedup_gpu(void)
{
    fixture f;
    ok(hand_fixture_with(&f, 1, 2, 2, "1", HAND_HW, "\"sync\": \"global\", \"dispatch_dedup\": \"gpu\""),
       "dedup per GPU fixture");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, p, NULL, &err);
    const double *D = rp_cost_dispatch_breakdown(c);
    is_double(D[0], 3.05, 1e-12, "L0 GPU0: receives 2.55 copies");
    is_double(D[1], 3.05, 1e-12, "L0 GPU1: sends 2.55 copies");
    is_double(D[2], 5.3, 1e-12, "L1 GPU0");
    is_double(D[3], 5.3, 1e-12, "L1 GPU1");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* Dispatch across nodes: 2 nodes x 2 GPUs in one EP group, one expert per GPU, top-2.
 * One sequence of 2 tokens on GPU0: token 0 -> experts 2, 3; token 1 -> experts 2, 0.
 * GPU0 sends 2 choices to GPU2 and 1 to GPU3, both on node 1. A copy is 8 bytes: 1 s over
 * NVLink, 2 s over the network; latencies 0.5 and 1.
 *   choice, and gpu (each GPU holds one expert: no token has two choices for one GPU):
 *     GPU0 sends 3 over the network: 6 + 0.5 + 1 = 7.5; GPU2 receives 2: 5.5; GPU3 1: 3.5
 *   node: 3 choices for node 1 (2 experts there, m = 2): 2 (1 - (1 - 3/4)^2) = 1.875 copies
 *     over the network to GPU2 (GPU0's local index on node 1), which forwards GPU3's one
 *     copy over NVLink: GPU0 3.75 + 1.5 = 5.25; GPU2 1 + 3.75 + 1.5 = 6.25; GPU3 1 + 0.5 */
static void test_hand_dedup_node(void)
{
    static const char *cfg =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 4, \"slots_per_gpu\": 1,"
        "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000, \"net_bytes_per_s\": 4,"
        "  \"net_latency_us\": 1000000},"
        " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48, \"token_linear_bytes_per_token\": 0},"
        " \"execution\": {\"executor\": \"ideal\", \"dispatch_dedup\": \"%s\"},"
        " \"model\": {\"num_layers\": 1, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 4,"
        "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"head_dim\": 2},"
        " \"limits\": {\"max_tokens_per_microbatch\": 100}}";
    const char *modes[3] = {"choice", "gpu", "node"};
    const double want[3][4] = {{7.5, 0.5, 5.5, 3.5}, {7.5, 0.5, 5.5, 3.5}, {5.25, 0.5, 6.25, 1.5}};
    for (int v = 0; v < 3; v++) {
        char json[2048];
        snprintf(json, sizeof json, cfg, modes[v]);
        int32_t lens[1] = {2}, rank[1] = {0}, mb[1] = {0};
        uint8_t ids[4] = {2, 3, 2, 0};
        int32_t p2l[4] = {0, 1, 2, 3};
        fixture f;
        ok(fixture_make(&f, json, 1, lens, ids), "two-node fixture, dedup %s", modes[v]);
        rp_cost *c = NULL;
        rp_error err;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
        rp_plan *p = plan_of(&f, 1, rank, mb, p2l);
        is_int(rp_cost_evaluate(c, p, NULL, &err), RP_OK, "evaluates");
        const double *D = rp_cost_dispatch_breakdown(c);
        ok(D && fabs(D[0] - want[v][0]) < 1e-12 && fabs(D[1] - want[v][1]) < 1e-12 &&
               fabs(D[2] - want[v][2]) < 1e-12 && fabs(D[3] - want[v][3]) < 1e-12,
           "dedup %s: dispatch %g %g %g %g", modes[v], D ? D[0] : -1, D ? D[1] : -1, D ? D[2] : -1, D ? D[3] : -1);
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

static void test_units(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 2, "1");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    /* t(n) = max(0.75 n / eff(n), 1) */
    is_double(rp_cost_expert_s(c, 0), 0.0, 0.0, "an empty slot costs nothing");
    is_double(rp_cost_expert_s(c, -3), 0.0, 0.0, "negative tokens cost nothing");
    is_double(rp_cost_expert_s(c, 0.5), 1.0, 0.0, "half a token: the weight-read floor");
    is_double(rp_cost_expert_s(c, 1), 1.5, 1e-15, "1 token at eff 0.5");
    is_double(rp_cost_expert_s(c, 2), 2.25, 1e-15, "2 tokens at eff 2/3 (interpolated)");
    is_double(rp_cost_expert_s(c, 2.5), 2.5, 1e-15, "2.5 tokens at eff 0.75");
    is_double(rp_cost_expert_s(c, 4), 3.0, 1e-15, "4 tokens at eff 1");
    is_double(rp_cost_expert_s(c, 100), 75.0, 1e-13, "flat beyond the last point");
    /* attention grows with L^2: the second difference of a(L) = a L^2 + b L */
    double a1 = rp_cost_attention_s(c, 1000), a2 = rp_cost_attention_s(c, 2000), a4 = rp_cost_attention_s(c, 4000);
    is_double((a4 - 2 * a2) / (a2 - 2 * a1), 4.0, 1e-9, "quadratic part scales as L^2");
    is_double(rp_cost_attention_s(c, 0), 0.0, 0.0, "empty sequence");
    rp_cost_free(c);
    batch_fixture_free(&f);

    /* The reference config's constants, formula by formula. */
    rp_config *cfg = NULL;
    char path[512];
    snprintf(path, sizeof path, "%s/examples/config-reference.json", RP_SOURCE_DIR);
    if (rp_config_load(ctx, path, &cfg, &err) != RP_OK) {
        skip(2, "reference config not loadable");
        return;
    }
    int32_t lens[1] = {1};
    uint8_t ids[48 * 8];
    for (int i = 0; i < 48 * 8; i++) ids[i] = (uint8_t)(i % 8);
    rp_batch *b = NULL;
    int32_t zero[1] = {0};
    rp_batch_new(ctx, 1, lens, zero, NULL, &b, &err);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 48, 8, ids);
    rp_stats *st = NULL;
    rp_stats_compute(ctx, b, &r, 128, 1, &st, &err);
    rp_cost_new(ctx, cfg, b, st, RP_SPLIT_EVEN, &c, &err);
    double L = 4096, want = 2 * L * L * 32 * 128 / (989e12 * 0.5) + 2 * L * 2048 * (2 * 32 * 128 + 2 * 4 * 128) / (989e12 * 0.7);
    is_double(rp_cost_attention_s(c, 4096), want, 1e-12 * want, "reference attention of 4096 tokens");
    /* routepack_torch's grouped GEMM pads the 1000 rows to its 16-row tile; the weight
     * gradient at the same curve (above the write of dW) and the data gradient at
     * backward.experts - 1 make the forward-equivalent the forward's */
    want = 6.0 * 1008 * 2048 * 768 / (989e12 * (0.6 + 0.2 * (1008.0 - 256) / 768));
    is_double(rp_cost_expert_s(c, 1000), want, 1e-12 * want, "reference expert of 1000 tokens (1008 padded rows)");
    rp_cost_free(c);
    rp_stats_free(st);
    rp_batch_free(b);
    rp_config_free(cfg);
}

static void test_straggler(void)
{
    const char *speeds[2] = {"[1, 0.25]", "[0.25, 1]"};
    /* GPU 1 at quarter speed: its L0 experts take 4 x 7.5 = 30, the largest term.
     * GPU 0 at quarter speed: its L1 experts take 4 x 7.5 = 30. */
    int32_t want_gpu[2] = {1, 0}, want_layer[2] = {0, 1};
    for (int i = 0; i < 2; i++) {
        fixture f;
        hand_fixture(&f, 1, 2, 2, speeds[i]);
        rp_cost *c = NULL;
        rp_error err;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
        rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
        rp_cost_summary s;
        rp_cost_evaluate(c, p, &s, &err);
        is_int(s.straggler_gpu, want_gpu[i], "slow GPU %d is named the straggler", want_gpu[i]);
        is_int(s.straggler_side, RP_SIDE_EXPERT, "... on the expert side");
        is_int(s.straggler_layer, want_layer[i], "... at layer %d", want_layer[i]);
        is_double(rp_cost_expert_breakdown(c)[(size_t)want_layer[i] * 2 + want_gpu[i]], 30.0, 1e-12,
                  "its expert time is divided by its speed");
        is_double(rp_cost_attention_breakdown(c)[want_gpu[i]], i == 0 ? 26.5 : 24.0, 1e-12,
                  "its attention is divided by its speed");
        /* bound: the attention share uses the total speed 1.25 */
        rp_plan_free(p);
        rp_cost_free(c);
        batch_fixture_free(&f);
    }
}

/* Two identical sequences on two GPUs, each spreading 8 tokens evenly over the four
 * experts (4 choices each): every term is balanced, so the bound is reached. */
static void test_bound_tight(void)
{
    fixture f;
    char json[2048];
    snprintf(json, sizeof json, HAND_CFG, 1, 2, 2, "1", HAND_HW, HAND_EXEC);
    char *one = strstr(json, "\"num_layers\": 2");
    one[14] = '1';
    int32_t lens[2] = {8, 8}, rank[2] = {0, 1}, mb[2] = {0, 0};
    uint8_t ids[32];
    for (int t = 0; t < 16; t++) {
        ids[2 * t] = (uint8_t)(t % 2 ? 2 : 0);
        ids[2 * t + 1] = (uint8_t)(t % 2 ? 3 : 1);
    }
    ok(fixture_make(&f, json, 2, lens, ids), "balanced fixture");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    int32_t p2l[4] = {0, 1, 2, 3};
    rp_plan *p = plan_of(&f, 1, rank, mb, p2l);
    rp_cost_summary s;
    is_int(rp_cost_evaluate(c, p, &s, &err), RP_OK, "evaluates");
    /* a(8) = 16; experts t(8) = 6, 12 per GPU; dispatch 8 choices each way: 8.5.
     * step = 3 (16 + 8.5 + 12 + 8.5) = 135 */
    is_double(s.step_s, 135.0, 1e-12 * 135, "balanced step");
    is_double(s.lower_bound_s, s.step_s, 1e-12 * s.step_s, "bound equals step when all is balanced");
    is_double(s.ratio, 1.0, 1e-12, "ratio 1");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* ---- migration ------------------------------------------------------------------- */

static void test_migration(void)
{
    static const char *cfg_fmt =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": %d, \"slots_per_gpu\": 2,"
        "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000, \"net_bytes_per_s\": 4,"
        "  \"net_latency_us\": 1000000},"
        " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48},"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 1, \"hidden_size\": 4,"
        "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"head_dim\": 2, \"bytes_per_param\": 2,"
        "  \"bytes_per_optimizer_state\": 12},"
        " \"limits\": {\"max_tokens_per_microbatch\": 100}}";
    char json[2048];
    int32_t lens[1] = {1};
    uint8_t ids[2] = {0, 0};
    fixture f;
    rp_error err;
    /* One EP group over both nodes (ranks 0,1 on node 0; 2,3 on node 1). One expert
     * is 3 d f (2 + 12) = 336 bytes. */
    snprintf(json, sizeof json, cfg_fmt, 4);
    ok(fixture_make(&f, json, 1, lens, ids), "migration fixture, EP 4 over 2 nodes");
    rp_cost *c = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    /* L0: ranks 0, 1 keep their experts in another order; rank 2 gains 0 and rank 3
     *     gains 1, both only on node 0: network.
     * L1: experts 0 and 2 swap between ranks 0 and 1 (NVLink both ways); rank 2 keeps
     *     0; rank 3 gains 3 from rank 1 on the other node: network. */
    int32_t from[16] = {0, 1, 2, 3, -1, -1, -1, -1, /**/ 0, 1, 2, 3, 0, -1, -1, -1};
    int32_t to[16] = {1, 0, 3, 2, 0, -1, 1, -1, /**/ 2, 1, 0, 3, 0, -1, 3, -1};
    rp_plan *pf = plan_of(&f, 1, NULL, NULL, from), *pt = plan_of(&f, 1, NULL, NULL, to);
    double secs = -1, bytes = -1;
    is_int(rp_cost_migration(c, pf, pt, &secs, &bytes, &err), RP_OK, "migration estimate");
    /* The migration plan's copies (docs/migration.md): 5 between GPUs x 336 = 1680 bytes;
     * GPUs 0 and 1 each copy their 2 L0 slots locally (a read and a write, 2 x 336 bytes of
     * HBM each, and 2 x 336 to write the slot). A GPU is busy max(sent, received) per link
     * at its bandwidth plus its latency, plus its HBM bytes at 48 B/s:
     *   GPU 0 sends 0, 1 over the network (L0) and 0 over NVLink (L1), receives 2 (L1):
     *         336/8 + 0.5 + 672/4 + 1 + (4 x 672 + 672)/48 = 42.5 + 169 + 70 = 281.5 s
     *   GPU 1: NVLink 336 each way, sends 3 over the network: 42.5 + 85 + 70 = 197.5 s
     *   GPU 2: receives 0 over the network: 85 + 14 = 99 s; GPU 3: 2 of them: 169 + 28 = 197 s
     * The busiest is a sender: the receiving side alone (GPU 3's 169 s) misses it. */
    is_double(bytes, 1680.0, 0.0, "bytes moved");
    is_double(secs, 281.5, 1e-12, "time of the busiest GPU, sends and commit included");
    is_int(rp_cost_migration(c, pf, pf, &secs, &bytes, &err), RP_OK, "no change");
    ok(secs == 0 && bytes == 0, "nothing moves when nothing changes");
    int32_t bad[16] = {0, 1, 2, 2, -1, -1, -1, -1, /**/ 0, 1, 2, 3, 0, -1, -1, -1};
    rp_plan *pb = plan_of(&f, 1, NULL, NULL, bad);
    is_int(rp_cost_migration(c, pb, pt, &secs, &bytes, &err), RP_EINVAL, "a 'from' missing an expert fails");
    like(err.text, "layer 0 expert 3 is on no EP rank", "... naming it");
    rp_plan *pe = plan_of(&f, 1, NULL, NULL, NULL);
    is_int(rp_cost_migration(c, pe, pt, &secs, &bytes, &err), RP_EINVAL, "a plan without placement fails");
    like(err.text, "'from' plan has no placement", "... with a message");
    rp_plan_free(pf);
    rp_plan_free(pt);
    rp_plan_free(pb);
    rp_plan_free(pe);
    rp_cost_free(c);
    batch_fixture_free(&f);

    /* Two EP groups, one per node: a swap of experts 1 and 2 is copied in each group
     * over its own NVLink: 4 copies, 1344 bytes; each GPU sends and receives one,
     * 336/8 + 0.5 = 42.5 s, and writes it, 672/48 = 14 s: 56.5 s. */
    snprintf(json, sizeof json, cfg_fmt, 2);
    fixture_make(&f, json, 1, lens, ids);
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    int32_t from2[8] = {0, 1, 2, 3, 0, 1, 2, 3}, to2[8] = {0, 2, 1, 3, 0, 1, 2, 3};
    pf = plan_of(&f, 1, NULL, NULL, from2);
    pt = plan_of(&f, 1, NULL, NULL, to2);
    is_int(rp_cost_migration(c, pf, pt, &secs, &bytes, &err), RP_OK, "migration in two EP groups");
    is_double(bytes, 1344.0, 0.0, "every group moves its own copies");
    is_double(secs, 56.5, 1e-12, "in parallel, over NVLink, each written");
    rp_plan_free(pf);
    rp_plan_free(pt);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* ---- random plans: bound and incremental ----------------------------------------- */

typedef struct rng { uint64_t s; } rng;
static uint64_t rnd(rng *r) { return xorshift64(&r->s); }
static int32_t rnd_int(rng *r, int32_t n) { return (int32_t)(rnd(r) % (uint64_t)n); }

#define RN 40
#define RL 3
#define RE 12
#define RK 3

static const char *RANDOM_CFG =
    "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 4, \"ep_size\": %d, \"slots_per_gpu\": %d,"
    "  \"gpu_speed\": %s},"
    " \"hardware\": {\"peak_flops\": 1e9, \"hbm_bytes_per_s\": 1e9, \"layer_fixed_us\": 2,"
    "  \"attention_efficiency\": [[4, 0.2], [16, 0.45], [40, 0.7]],"
    "  \"gemm_efficiency\": [[1, 0.05], [8, 0.3], [32, 0.9]]},"
    " \"execution\": {%s},"
    " \"model\": {\"num_layers\": 3, \"num_experts\": 12, \"top_k\": 3, \"hidden_size\": 64,"
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"num_kv_heads\": 2, \"head_dim\": 16},"
    " \"limits\": {\"max_tokens_per_microbatch\": %d}}";

/* The execution settings of the random fixtures (JSON members of "execution"). */
static const char *random_execution = "";

static bool random_fixture(fixture *f, rng *r, int ep, int slots, const char *speed, int cap)
{
    char json[2048];
    snprintf(json, sizeof json, RANDOM_CFG, ep, slots, speed, random_execution, cap);
    int32_t lens[RN];
    int64_t tokens = 0;
    for (int i = 0; i < RN; i++) {
        lens[i] = i % 13 == 5 ? 0 : 1 + rnd_int(r, 40);
        tokens += lens[i];
    }
    uint8_t *ids = malloc((size_t)tokens * RL * RK + 1);
    int64_t t = 0;
    for (int i = 0; i < RN; i++) {
        int32_t pref = rnd_int(r, RE); /* each sequence leans towards a few experts */
        for (int32_t k = 0; k < lens[i]; k++, t++)
            for (int l = 0; l < RL; l++) {
                int32_t first = rnd_int(r, 3) ? (pref + rnd_int(r, 3)) % RE : rnd_int(r, RE);
                for (int j = 0; j < RK; j++) ids[(t * RL + l) * RK + j] = (uint8_t)((first + j * 5) % RE);
            }
    }
    bool done = fixture_make(f, json, RN, lens, ids);
    free(ids);
    return done;
}

static rp_plan *random_plan(const fixture *f, rng *r, int32_t M, bool levers)
{
    int32_t rank[RN], mb[RN];
    int32_t G = rp_config_topology(f->cfg)->num_gpus, ep = rp_config_topology(f->cfg)->ep_size;
    for (int i = 0; i < RN; i++) {
        rank[i] = rnd_int(r, G);
        mb[i] = rnd_int(r, M);
    }
    rp_plan *p = plan_of(f, M, rank, mb, NULL);
    int32_t S = rp_plan_total_slots(p), row[256];
    rp_error err;
    for (int l = 0; l < RL; l++) {
        for (int s = 0; s < S; s++) row[s] = rnd_int(r, 3) ? rnd_int(r, RE) : -1;
        for (int e = 0; e < RE; e++) row[rnd_int(r, S)] = -2 - e; /* placeholders: one replica each */
        for (int e = 0, s = 0; e < RE; e++) {
            bool found = false;
            for (s = 0; s < S; s++)
                if (row[s] == -2 - e) found = true;
            if (!found) {
                int32_t free_slot;
                do free_slot = rnd_int(r, S);
                while (row[free_slot] <= -2);
                row[free_slot] = -2 - e;
            }
        }
        for (int s = 0; s < S; s++)
            if (row[s] <= -2) row[s] = -2 - row[s];
        rp_plan_set_phy2log(p, l, row, &err);
    }
    if (levers) {
        for (int i = 0; i < 3; i++)
            rp_plan_add_extra_replica(p, rnd_int(r, M), rnd_int(r, RL), rnd_int(r, RE), rnd_int(r, ep), &err);
        for (int i = 0; i < 3; i++) {
            int32_t m = rnd_int(r, M), l = rnd_int(r, RL), e = rnd_int(r, RE);
            int32_t n = rp_plan_replicas(p, m, l, e, NULL, NULL, 0);
            double w[64], sum = 0;
            for (int k = 0; k < n; k++) sum += w[k] = 1 + rnd_int(r, 5);
            for (int k = 0; k < n; k++) w[k] /= sum;
            rp_plan_set_shares(p, m, l, e, w, n, &err);
        }
    }
    return p;
}

static void test_bound_random(void)
{
    rng r = {0x9E3779B97F4A7C15ULL};
    const char *speeds[2] = {"1", "[1, 1, 0.5, 1, 2, 1, 1, 0.7]"};
    int eps[2] = {4, 8}, fails = 0, runs = 0;
    double worst = 0;
    for (int v = 0; v < 4; v++) {
        fixture f;
        random_fixture(&f, &r, eps[v % 2], eps[v % 2] == 4 ? 4 : 2, speeds[v / 2], 100000);
        rp_cost *c[2] = {NULL, NULL};
        rp_error err;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c[0], &err);
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &c[1], &err);
        for (int i = 0; i < 25; i++) {
            rp_plan *p = random_plan(&f, &r, 1 + rnd_int(&r, 3), i % 3 == 0);
            for (int k = 0; k < 2; k++) {
                rp_cost_summary s;
                if (rp_cost_evaluate(c[k], p, &s, &err) != RP_OK) {
                    diag("evaluate: %s", err.text);
                    fails++;
                    continue;
                }
                runs++;
                if (!(s.lower_bound_s > 0 && s.lower_bound_s <= s.step_s * (1 + 1e-12))) {
                    fails++;
                    diag("bound %.17g > step %.17g", s.lower_bound_s, s.step_s);
                }
                if (s.ratio > worst) worst = s.ratio;
            }
            rp_plan_free(p);
        }
        rp_cost_free(c[0]);
        rp_cost_free(c[1]);
        batch_fixture_free(&f);
    }
    is_int(runs, 200, "200 random plans evaluated {%s}", random_execution);
    is_int(fails, 0, "lower bound <= step on every random plan (largest ratio %.2f) {%s}", worst, random_execution);
}

/* An evaluator that already holds a plan's packing copies its sums instead of reading
 * the histograms again: evaluating a plan with the same packing and another placement
 * (and levers) gives, bit for bit, what a fresh evaluator gives. */
static void test_same_packing(void)
{
    rng r = {0xD1B54A32D192ED03ULL};
    int same = 0, runs = 0;
    for (int v = 0; v < 2; v++) {
        fixture f;
        random_fixture(&f, &r, v ? 8 : 4, v ? 2 : 4, "1", 100000);
        rp_error err;
        for (int i = 0; i < 10; i++) {
            int32_t M = 1 + rnd_int(&r, 3);
            rp_plan *p = random_plan(&f, &r, M, i % 2 == 0), *q = random_plan(&f, &r, M, i % 3 == 0);
            int32_t n = rp_batch_num_seqs(f.batch);
            int32_t *rank = malloc((size_t)n * sizeof *rank), *mb = malloc((size_t)n * sizeof *mb);
            for (int32_t k = 0; k < n; k++) {
                rank[k] = rp_plan_seq_rank(p, k);
                mb[k] = rp_plan_seq_microbatch(p, k);
            }
            rp_status set = rp_plan_set_packing(q, n, rank, mb, &err);
            rp_cost *warm = NULL, *fresh = NULL;
            rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &warm, &err);
            rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err);
            rp_cost_summary a, b;
            if (set == RP_OK && rp_cost_evaluate(warm, p, NULL, &err) == RP_OK &&
                rp_cost_evaluate(warm, q, &a, &err) == RP_OK && rp_cost_evaluate(fresh, q, &b, &err) == RP_OK) {
                runs++;
                const int32_t G = rp_plan_num_gpus(q), L = rp_plan_num_layers(q);
                size_t cells = (size_t)M * L * G;
                same += memcmp(&a.step_s, &b.step_s, sizeof a.step_s) == 0 &&
                        memcmp(&a.lower_bound_s, &b.lower_bound_s, sizeof a.lower_bound_s) == 0 &&
                        memcmp(rp_cost_attention_breakdown(warm), rp_cost_attention_breakdown(fresh),
                               (size_t)G * M * sizeof(double)) == 0 &&
                        memcmp(rp_cost_expert_breakdown(warm), rp_cost_expert_breakdown(fresh), cells * sizeof(double)) == 0 &&
                        memcmp(rp_cost_dispatch_breakdown(warm), rp_cost_dispatch_breakdown(fresh),
                               cells * sizeof(double)) == 0;
            } else {
                diag("same packing: %s", err.text);
            }
            rp_cost_free(warm);
            rp_cost_free(fresh);
            free(rank);
            free(mb);
            rp_plan_free(p);
            rp_plan_free(q);
        }
        batch_fixture_free(&f);
    }
    is_int(runs, 20, "20 plan pairs with one packing evaluated");
    is_int(same, runs, "a second placement on a bound packing evaluates as on a fresh evaluator, bit for bit");
}

static bool same_summary(const rp_cost_summary *a, const rp_cost_summary *b)
{
    double fields_a[] = {a->step_s, a->lower_bound_s, a->attention_s, a->expert_s, a->dispatch_s,
                         a->grad_reduce_s, a->extra_copy_s, a->attention_imbalance, a->expert_imbalance};
    double fields_b[] = {b->step_s, b->lower_bound_s, b->attention_s, b->expert_s, b->dispatch_s,
                         b->grad_reduce_s, b->extra_copy_s, b->attention_imbalance, b->expert_imbalance};
    for (size_t i = 0; i < sizeof fields_a / sizeof fields_a[0]; i++)
        if (fabs(fields_a[i] - fields_b[i]) > 1e-9 * fabs(fields_b[i])) {
            diag("summary field %zu: %.17g vs %.17g", i, fields_a[i], fields_b[i]);
            return false;
        }
    return a->straggler_gpu == b->straggler_gpu && a->straggler_mb == b->straggler_mb &&
           a->straggler_layer == b->straggler_layer && a->straggler_side == b->straggler_side;
}


/* Evaluating a plan equal to the one the evaluator is bound to returns the bound state's
 * summary without the work, and binds the evaluator to the new copy; once a move or a
 * slot change edited the bound state, an equal plan of the old content is evaluated
 * again in full (it no longer matches the state). Each result against a fresh
 * evaluator's. */
static void test_evaluated_again(void)
{
    rng r = {0x9E3779B97F4A7C15ULL};
    int hits = 0, fresh_after_edit = 0, differ = 0, runs = 0;
    for (int i = 0; i < 8; i++) {
        fixture f;
        random_fixture(&f, &r, i % 2 ? 8 : 4, i % 2 ? 2 : 4, "1", 100000);
        rp_error err;
        const int32_t M = 1 + rnd_int(&r, 3);
        rp_plan *p = random_plan(&f, &r, M, true), *copy = NULL, *again = NULL;
        rp_cost *c = NULL, *fresh = NULL;
        rp_cost_summary a, b, want;
        if (rp_plan_copy(p, &copy, &err) != RP_OK || rp_plan_copy(p, &again, &err) != RP_OK ||
            rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) != RP_OK ||
            rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err) != RP_OK ||
            rp_cost_evaluate(fresh, p, &want, &err) != RP_OK) {
            diag("setup: %s", err.text);
            goto next;
        }
        runs++;
        int64_t o0 = rp_cost_operations(c);
        rp_cost_evaluate(c, p, &a, &err);
        int64_t full = rp_cost_operations(c) - o0;
        o0 = rp_cost_operations(c);
        rp_status st = rp_cost_evaluate(c, copy, &b, &err);
        int64_t second = rp_cost_operations(c) - o0;
        /* the same summary, a fraction of the work, and bound to the copy */
        if (st == RP_OK && memcmp(&a, &b, sizeof a) == 0 && same_summary(&a, &want) && second * 4 < full &&
            rp_cost_apply_move(c, p, 0, 0, 0, NULL) == RP_EINVAL)
            hits++;
        else
            diag("run %d: status %d, second evaluation %lld operations of %lld", i, st, (long long)second,
                 (long long)full);
        /* an edit of the bound plan (a move, then a slot change): the old content is new to it */
        const int32_t G = rp_plan_num_gpus(copy);
        int32_t seq = 0;
        while (seq < RN && rp_plan_seq_rank(copy, seq) < 0) seq++;
        int32_t to = (rp_plan_seq_rank(copy, seq) + 1) % G;
        rp_cost_summary after;
        if (rp_cost_apply_move(c, copy, seq, to, 0, &err) == RP_OK && rp_cost_evaluate(c, again, &after, &err) == RP_OK &&
            same_summary(&after, &want) && memcmp(&after.step_s, &want.step_s, sizeof want.step_s) == 0)
            fresh_after_edit++;
        else
            diag("run %d: after a move: %s", i, err.text);
        /* without levers (any slot change is then valid): bound to `bare`, a slot change on
         * it, then `again` (its old content) evaluates afresh; a plan that differs from the
         * bound one only in its levers is not taken for it */
        rp_plan *bare = NULL, *bare_old = NULL;
        rp_cost_summary bare_want, got, lv;
        rp_status made = rp_plan_copy(p, &bare, &err);
        if (made == RP_OK) rp_plan_clear_levers(bare);
        if (made == RP_OK && rp_plan_copy(bare, &bare_old, &err) == RP_OK && rp_cost_evaluate(fresh, bare, &bare_want, &err) == RP_OK &&
            rp_cost_evaluate(c, bare, NULL, &err) == RP_OK) {
            const int32_t S = rp_plan_total_slots(bare);
            const int32_t *row = rp_plan_phy2log(bare, 0);
            int32_t slot = -1, expert = -1;
            for (int32_t k = 0; k < S && slot < 0; k++) {
                int32_t n = 0;
                for (int32_t j = 0; j < S; j++) n += row[j] == row[k];
                if (row[k] < 0) slot = k, expert = 0; /* a second replica of expert 0 */
                else if (n > 1) slot = k, expert = -1; /* one of two replicas dropped */
            }
            if (rp_cost_apply_slot(c, bare, 0, slot, expert, &err) == RP_OK &&
                rp_cost_evaluate(c, bare_old, &got, &err) == RP_OK &&
                memcmp(&got.step_s, &bare_want.step_s, sizeof got.step_s) == 0 && same_summary(&got, &bare_want))
                fresh_after_edit++;
            else
                diag("run %d: after a slot change (slot %d to %d): %s", i, slot, expert, err.text);
            if (rp_cost_evaluate(c, p, &lv, &err) == RP_OK && memcmp(&lv.step_s, &want.step_s, sizeof lv.step_s) == 0 &&
                same_summary(&lv, &want))
                differ++;
            else
                diag("run %d: with its levers: %s", i, err.text);
        } else {
            diag("run %d: without levers: %s", i, err.text);
        }
        rp_plan_free(bare);
        rp_plan_free(bare_old);
    next:
        rp_plan_free(p);
        rp_plan_free(copy);
        rp_plan_free(again);
        rp_cost_free(c);
        rp_cost_free(fresh);
        batch_fixture_free(&f);
    }
    is_int(runs, 8, "8 plans evaluated twice");
    is_int(hits, runs, "an equal plan: the bound summary, bit for bit, without the work, bound to the new copy");
    is_int(fresh_after_edit, 2 * runs, "after a move or a slot change the old content evaluates as on a fresh evaluator");
    is_int(differ, runs, "a plan that differs from the bound one only in its levers evaluates as on a fresh evaluator");
}

/* cost_summary_of: a plan among the last COST_MEMO evaluated comes back with its
 * summary, no work and the binding unchanged; an older one is evaluated again (and bound). */
static void test_summary_of(void)
{
    rng r = {0xC2B2AE3D27D4EB4FULL};
    fixture f;
    random_fixture(&f, &r, 4, 4, "1", 100000);
    rp_error err;
    rp_cost *c = NULL, *fresh = NULL;
    rp_plan *p[COST_MEMO + 2] = {NULL};
    rp_cost_summary want[COST_MEMO + 2];
    bool made = rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err) == RP_OK;
    for (int i = 0; made && i < COST_MEMO + 2; i++) {
        p[i] = random_plan(&f, &r, 1 + i % 3, i % 2 == 0);
        made = rp_cost_evaluate(fresh, p[i], &want[i], &err) == RP_OK;
    }
    /* evaluated in order: the last COST_MEMO are remembered, the bound one is the newest */
    for (int i = 0; made && i < COST_MEMO + 2; i++) made = rp_cost_evaluate(c, p[i], NULL, &err) == RP_OK;
    ok(made, "setup: %s", made ? "" : err.text);
    if (made) {
        const int newest = COST_MEMO + 1, oldest_kept = 2;
        rp_cost_summary got;
        rp_plan *copy = NULL;
        rp_plan_copy(p[oldest_kept], &copy, &err);
        int64_t o0 = rp_cost_operations(c);
        rp_status st = cost_summary_of(c, copy, &got, NULL, &err);
        ok(st == RP_OK && memcmp(&got, &want[oldest_kept], sizeof got) == 0 && rp_cost_operations(c) == o0,
           "a remembered plan (an equal copy): its summary bit for bit, no work counted");
        ok(rp_cost_current_s(c) == want[newest].step_s, "... and the evaluator still bound to the newest plan");
        o0 = rp_cost_operations(c);
        st = cost_summary_of(c, p[1], &got, NULL, &err);
        ok(st == RP_OK && memcmp(&got.step_s, &want[1].step_s, sizeof got.step_s) == 0 && rp_cost_operations(c) > o0 &&
               rp_cost_current_s(c) == want[1].step_s,
           "a plan evaluated %d evaluations ago is evaluated again, and bound", COST_MEMO + 1);
        rp_plan_free(copy);
    }
    for (int i = 0; i < COST_MEMO + 2; i++) rp_plan_free(p[i]);
    rp_cost_free(c);
    rp_cost_free(fresh);
    batch_fixture_free(&f);
}

/* The evaluator's memory of the plans it evaluated lives in its own context: a plan made
 * (and freed, with its context) elsewhere, as a policy's sandbox does, leaves nothing
 * behind that the evaluator frees later (under the sanitizer build: no use after free). */
static void test_memo_context(void)
{
    rng r = {0x94D049BB133111EBULL};
    fixture f;
    random_fixture(&f, &r, 4, 4, "1", 100000);
    rp_error err;
    rp_context *other = NULL;
    rp_cost *c = NULL;
    rp_plan *p = random_plan(&f, &r, 2, true), *q = NULL;
    rp_cost_summary a, b;
    bool fine = rp_context_new(NULL, NULL, &other) == RP_OK &&
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
                rp_plan_new(other, f.cfg, rp_plan_num_microbatches(p), &q, &err) == RP_OK;
    /* q: p's content, made in the other context */
    for (int32_t l = 0; fine && l < rp_plan_num_layers(p); l++)
        fine = rp_plan_set_phy2log(q, l, rp_plan_phy2log(p, l), &err) == RP_OK;
    int32_t rank[RN], mb[RN];
    for (int32_t k = 0; k < RN; k++) rank[k] = rp_plan_seq_rank(p, k), mb[k] = rp_plan_seq_microbatch(p, k);
    fine = fine && rp_plan_set_packing(q, RN, rank, mb, &err) == RP_OK && rp_cost_evaluate(c, q, &a, &err) == RP_OK;
    rp_plan_free(q);
    rp_context_free(other);
    rp_plan_clear_levers(p);
    fine = fine && cost_summary_of(c, p, &b, NULL, &err) == RP_OK && memcmp(&a, &b, sizeof a) == 0;
    ok(fine, "a plan of another context, freed with it after its evaluation: the evaluator's memory of it stays "
             "valid (%s)", fine ? "its summary comes back" : err.text);
    rp_cost_free(c);
    rp_plan_free(p);
    batch_fixture_free(&f);
}

static int64_t cell_tokens(const rp_plan *p, const rp_batch *b, int32_t g, int32_t m)
{
    int32_t count = 0;
    const int32_t *list = rp_plan_microbatch(p, g, m, &count);
    int64_t n = 0;
    for (int32_t k = 0; k < count; k++) n += rp_batch_seq_len(b, list[k]);
    return n;
}

static void test_incremental(void)
{
    rng r = {0x243F6A8885A308D3ULL};
    int mismatches = 0, trials = 0, exact = 0, invalid_ok = 0, invalid = 0, apply_bad = 0, applies = 0;
    rp_error err;
    for (int v = 0; v < 6; v++) {
        fixture f;
        int ep = v % 2 ? 8 : 4;
        random_fixture(&f, &r, ep, ep == 4 ? 4 : 2, v >= 4 ? "[1, 1, 0.5, 1, 2, 1, 1, 0.7]" : "1", 150);
        rp_cost *c = NULL, *full = NULL;
        rp_split_rule rule = v % 3 == 1 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, rule, &c, &err);
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, rule, &full, &err);
        int32_t M = 2 + v % 2, G = 8, S = 0;
        rp_plan *p = random_plan(&f, &r, M, v >= 2);
        if (rp_cost_evaluate(c, p, NULL, &err) != RP_OK) diag("evaluate: %s", err.text);
        S = rp_plan_total_slots(p);
        for (int i = 0; i < 60; i++) {
            int kind = rnd_int(&r, 3);
            double pred;
            rp_plan *q = NULL;
            rp_plan_copy(p, &q, &err);
            bool valid = true;
            if (kind == 0) {
                int32_t s = rnd_int(&r, RN), g = rnd_int(&r, G), m = rnd_int(&r, M);
                bool same = rp_plan_seq_rank(p, s) == g && rp_plan_seq_microbatch(p, s) == m;
                valid = same || rp_batch_seq_len(f.batch, s) == 0 ||
                        cell_tokens(p, f.batch, g, m) + rp_batch_seq_len(f.batch, s) <= 150;
                pred = rp_cost_try_move(c, s, g, m);
                rp_plan_move_sequence(q, s, g, m, &err);
            } else if (kind == 1) {
                int32_t a = rnd_int(&r, RN), b = rnd_int(&r, RN);
                int32_t ga = rp_plan_seq_rank(p, a), ma = rp_plan_seq_microbatch(p, a);
                int32_t gb = rp_plan_seq_rank(p, b), mb = rp_plan_seq_microbatch(p, b);
                int64_t la = rp_batch_seq_len(f.batch, a), lb = rp_batch_seq_len(f.batch, b);
                bool same = ga == gb && ma == mb;
                valid = same || ((lb <= la || cell_tokens(p, f.batch, ga, ma) - la + lb <= 150) &&
                                 (la <= lb || cell_tokens(p, f.batch, gb, mb) - lb + la <= 150));
                pred = rp_cost_try_swap(c, a, b);
                if (!same) {
                    rp_plan_move_sequence(q, a, gb, mb, &err);
                    rp_plan_move_sequence(q, b, ga, ma, &err);
                }
            } else {
                int32_t l = rnd_int(&r, RL), slot = rnd_int(&r, S), e = rnd_int(&r, RE + 1) - 1;
                int32_t row[256], logcnt[RE];
                memcpy(row, rp_plan_phy2log(p, l), (size_t)S * sizeof(int32_t));
                rp_plan_logcnt(p, l, logcnt);
                int32_t old = row[slot];
                bool shares = false;
                for (int32_t m = 0; m < M; m++) {
                    double w[64];
                    int32_t ranks[64];
                    if (old >= 0 && rp_plan_replicas(p, m, l, old, ranks, w, 64) > 0 && w[0] >= 0) shares = true;
                    if (e >= 0 && old != e && rp_plan_replicas(p, m, l, e, ranks, w, 64) > 0 && w[0] >= 0) shares = true;
                }
                valid = old == e || ((old < 0 || logcnt[old] > 1) && !shares);
                pred = rp_cost_try_slot(c, l, slot, e);
                row[slot] = e;
                rp_plan_set_phy2log(q, l, row, &err);
            }
            if (!valid) {
                invalid++;
                if (isinf(pred)) invalid_ok++;
                else diag("kind %d: invalid change predicted %.17g", kind, pred);
                rp_plan_free(q);
                continue;
            }
            rp_cost_summary s;
            trials++;
            if (rp_cost_evaluate(full, q, &s, &err) != RP_OK) {
                diag("full: %s", err.text);
                mismatches++;
            } else if (!(fabs(pred - s.step_s) <= 1e-9 * s.step_s)) {
                diag("kind %d: incremental %.17g, full %.17g", kind, pred, s.step_s);
                mismatches++;
            } else if (pred == s.step_s) {
                exact++;
            }
            rp_plan_free(q);
            /* every fourth change is applied, then checked against a full evaluation */
            if (i % 4 == 3) {
                rp_status st;
                if (kind == 0) st = rp_cost_apply_move(c, p, rnd_int(&r, RN), rnd_int(&r, G), rnd_int(&r, M), &err);
                else if (kind == 1) st = rp_cost_apply_swap(c, p, rnd_int(&r, RN), rnd_int(&r, RN), &err);
                else st = rp_cost_apply_slot(c, p, rnd_int(&r, RL), rnd_int(&r, S), rnd_int(&r, RE), &err);
                if (st != RP_OK) continue; /* an invalid change: nothing happened */
                applies++;
                rp_cost_summary mine, ref;
                rp_cost_current_summary(c, &mine, &err);
                if (rp_cost_evaluate(full, p, &ref, &err) != RP_OK || !same_summary(&mine, &ref) ||
                    rp_cost_current_s(c) != ref.step_s) {
                    apply_bad++;
                    continue;
                }
                const double *x1 = rp_cost_expert_breakdown(c), *x2 = rp_cost_expert_breakdown(full);
                const double *d1 = rp_cost_dispatch_breakdown(c), *d2 = rp_cost_dispatch_breakdown(full);
                const double *a1 = rp_cost_attention_breakdown(c), *a2 = rp_cost_attention_breakdown(full);
                for (int32_t k = 0; k < M * RL * G; k++)
                    if (x1[k] != x2[k] || d1[k] != d2[k]) apply_bad++;
                for (int32_t k = 0; k < M * G; k++)
                    if (a1[k] != a2[k]) apply_bad++;
            }
        }
        rp_plan_free(p);
        rp_cost_free(c);
        rp_cost_free(full);
        batch_fixture_free(&f);
    }
    const char *x = random_execution; /* the setting, so a failing check says which */
    ok(trials > 200, "%d incremental changes compared with full evaluations {%s}", trials, x);
    is_int(mismatches, 0, "try_move/swap/slot equal a full evaluation of the changed plan {%s}", x);
    diag("%d of %d bit-identical", exact, trials);
    ok(invalid > 0, "%d invalid changes tried (caps, last replicas, shares) {%s}", invalid, x);
    is_int(invalid_ok, invalid, "each invalid change is predicted as infinite {%s}", x);
    ok(applies > 10, "%d changes applied {%s}", applies, x);
    is_int(apply_bad, 0, "after apply_*, state, summary and breakdown equal a full evaluation {%s}", x);
}

/* ---- JSON breakdown ---------------------------------------------------------------- */

static void test_json(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 2, "1");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    char *text = NULL;
    size_t len = 0;
    is_int(rp_cost_breakdown_json(c, &text, &len, &err), RP_EINVAL, "no breakdown before evaluation");
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, p, NULL, &err);
    is_int(rp_cost_breakdown_json(c, &text, &len, &err), RP_OK, "breakdown as JSON");
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    ok(root != NULL, "the breakdown parses as JSON");
    if (root) {
        json_t *sum = json_object_get(root, "summary");
        is_double(json_number_value(json_object_get(sum, "step_s")), 156.75, 1e-12, "summary.step_s");
        is_str(json_string_value(json_object_get(json_object_get(sum, "straggler"), "side")), "dispatch",
               "summary.straggler.side");
        json_t *layers = json_object_get(root, "layers");
        is_int(json_array_size(layers), 2, "one entry per (mb, layer)");
        json_t *l0 = json_array_get(layers, 0);
        is_str(json_string_value(json_object_get(l0, "straggler_side")), "expert", "layer 0 straggler side");
        is_int(json_integer_value(json_object_get(l0, "straggler_gpu")), 1, "layer 0 straggler GPU");
        is_double(json_number_value(json_object_get(l0, "lower_bound_s")), 3 * 20.2875, 1e-12, "layer 0 bound (forward and backward)");
        is_double(json_number_value(json_array_get(json_array_get(json_object_get(root, "attention"), 1), 0)), 6.625,
                  1e-12, "attention[gpu 1][mb 0]");
        json_t *x = json_object_get(root, "expert");
        is_double(json_number_value(json_array_get(json_array_get(json_array_get(x, 0), 1), 0)), 7.5, 1e-12,
                  "expert[mb 0][layer 1][gpu 0]");
        ok(json_object_get(root, "dispatch") && json_object_get(root, "combine"), "dispatch and combine present");
        json_decref(root);
    }
    rp_text_free(ctx, text);
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* ---- bad input ------------------------------------------------------------------- */

static void expect_new_fails(const fixture *f, const char *what, const char *needle)
{
    rp_cost *c = NULL;
    rp_error err;
    rp_status st = rp_cost_new(ctx, f->cfg, f->batch, f->stats, RP_SPLIT_EVEN, &c, &err);
    is_int(st, RP_EINVAL, "rp_cost_new rejects %s", what);
    like(st == RP_OK ? "" : err.text, needle, "... naming it");
    rp_cost_free(c);
}

static void test_bad_constants(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 2, "1");
    /* Configs come validated; poke the views the way a careless embedder could. */
    rp_hardware *hw = (rp_hardware *)rp_config_hardware(f.cfg);
    rp_topology *tp = (rp_topology *)rp_config_topology(f.cfg);
    double saved = hw->peak_flops;
    hw->peak_flops = NAN;
    expect_new_fails(&f, "a NaN peak", "hardware.peak_flops is nan");
    hw->peak_flops = 0;
    expect_new_fails(&f, "a zero peak", "hardware.peak_flops is 0");
    hw->peak_flops = saved;
    saved = tp->nvlink_bytes_per_s;
    tp->nvlink_bytes_per_s = -1;
    expect_new_fails(&f, "a negative NVLink bandwidth", "topology.nvlink_bytes_per_s is -1");
    tp->nvlink_bytes_per_s = saved;
    saved = tp->net_bytes_per_s;
    tp->net_bytes_per_s = INFINITY;
    expect_new_fails(&f, "an infinite network bandwidth", "topology.net_bytes_per_s");
    tp->net_bytes_per_s = saved;
    rp_eff_point *ap = (rp_eff_point *)&hw->attention_efficiency[0];
    saved = ap->efficiency;
    ap->efficiency = 0;
    expect_new_fails(&f, "a zero attention efficiency", "hardware.attention_efficiency[0] efficiency is 0");
    ap->efficiency = saved;
    saved = hw->backward.attention;
    hw->backward.attention = NAN;
    expect_new_fails(&f, "a NaN attention backward multiplier", "hardware.backward.attention is nan");
    hw->backward.attention = saved;
    saved = hw->layer_fixed_s;
    hw->layer_fixed_s = -1;
    expect_new_fails(&f, "a negative fixed cost", "hardware.layer_fixed_s is -1");
    hw->layer_fixed_s = saved;
    saved = hw->hbm_bytes_per_s;
    hw->hbm_bytes_per_s = NAN;
    expect_new_fails(&f, "a NaN HBM bandwidth", "hardware.hbm_bytes_per_s");
    hw->hbm_bytes_per_s = saved;
    rp_eff_point *pt = (rp_eff_point *)&hw->gemm_efficiency[1];
    saved = pt->efficiency;
    pt->efficiency = NAN;
    expect_new_fails(&f, "a NaN point of the efficiency curve", "hardware.gemm_efficiency[1] efficiency");
    pt->efficiency = saved;
    double *speed = (double *)tp->speed;
    speed[1] = -2;
    expect_new_fails(&f, "a negative GPU speed", "topology.gpu_speed[1] is -2");
    speed[1] = 1;
    saved = tp->nvlink_latency_s;
    tp->nvlink_latency_s = NAN;
    expect_new_fails(&f, "a NaN latency", "topology.nvlink_latency_s");
    tp->nvlink_latency_s = saved;
    rp_cost *c = NULL;
    rp_error err;
    is_int(rp_cost_new(ctx, f.cfg, f.batch, f.stats, (rp_split_rule)7, &c, &err), RP_EINVAL, "unknown split rule");
    is_int(rp_cost_new(ctx, f.cfg, f.batch, NULL, RP_SPLIT_EVEN, &c, &err), RP_EINVAL, "missing statistics");
    is_int(rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err), RP_OK, "restored config is accepted");
    rp_cost_free(c);
    batch_fixture_free(&f);
}

static void test_bad_batch(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 2, "1");
    rp_error err;
    rp_cost *c = NULL;
    /* statistics of another batch: 2 sequences */
    rp_batch *b2 = NULL;
    int32_t lens[2] = {4, 2}, zero[2] = {0, 0};
    rp_batch_new(ctx, 2, lens, zero, NULL, &b2, &err);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, HAND_IDS);
    rp_stats *s2 = NULL, *s_layers = NULL, *s_experts = NULL, *s_empty = NULL;
    rp_stats_compute(ctx, b2, &r, 4, 1, &s2, &err);
    is_int(rp_cost_new(ctx, f.cfg, f.batch, s2, RP_SPLIT_EVEN, &c, &err), RP_EINVAL, "statistics of another batch");
    like(err.text, "statistics cover 2 sequences, but the batch has 3", "... message");
    /* one layer instead of two (same ids read with a layer stride of one pair) */
    rp_routing r1;
    rp_routing_packed(&r1, RP_ID_U8, 1, 2, HAND_IDS);
    r1.token_stride = 4;
    if (rp_stats_compute(ctx, f.batch, &r1, 4, 1, &s_layers, &err) == RP_OK) {
        is_int(rp_cost_new(ctx, f.cfg, f.batch, s_layers, RP_SPLIT_EVEN, &c, &err), RP_EINVAL, "statistics of 1 layer");
        like(err.text, "statistics have 1 layers, but the model has 2", "... message");
    } else {
        skip(2, "one-layer statistics not computable");
    }
    rp_routing_packed(&r, RP_ID_U8, 2, 2, HAND_IDS);
    rp_stats_compute(ctx, f.batch, &r, 8, 1, &s_experts, &err);
    is_int(rp_cost_new(ctx, f.cfg, f.batch, s_experts, RP_SPLIT_EVEN, &c, &err), RP_EINVAL, "statistics of 8 experts");
    like(err.text, "statistics have 8 experts, but the model has 4", "... message");
    rp_batch *b0 = NULL;
    rp_batch_new(ctx, 0, NULL, NULL, NULL, &b0, &err);
    rp_routing_packed(&r, RP_ID_U8, 2, 2, HAND_IDS);
    if (rp_stats_compute(ctx, b0, &r, 4, 1, &s_empty, &err) == RP_OK) {
        is_int(rp_cost_new(ctx, f.cfg, b0, s_empty, RP_SPLIT_EVEN, &c, &err), RP_EINVAL, "an empty batch");
        like(err.text, "batch is empty", "... message");
    } else {
        skip(2, "empty statistics not computable");
    }
    rp_stats_free(s2);
    rp_stats_free(s_layers);
    rp_stats_free(s_experts);
    rp_stats_free(s_empty);
    rp_batch_free(b2);
    rp_batch_free(b0);
    batch_fixture_free(&f);
}

static void test_bad_plans(void)
{
    fixture f, other;
    hand_fixture(&f, 1, 2, 2, "1");
    hand_fixture(&other, 2, 2, 2, "1");
    rp_error err;
    rp_cost *c = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    rp_plan *good = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, good, NULL, &err);
    double before = rp_cost_current_s(c);

    is_int(rp_cost_evaluate(c, NULL, NULL, &err), RP_EINVAL, "no plan");
    rp_plan *p = plan_of(&f, 1, NULL, NULL, CONTIG4);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "plan without packing");
    like(err.text, "has no packing", "... message");
    rp_plan_free(p);
    p = plan_of(&f, 1, HAND_RANK, HAND_MB, NULL);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "plan without placement");
    like(err.text, "has no placement", "... message");
    rp_plan_free(p);
    int32_t rank4[3] = {0, 3, 2};
    p = plan_of(&other, 1, rank4, HAND_MB, CONTIG4);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "plan of another shape");
    like(err.text, "the plan has 4 GPUs, but the config has 2", "... message");
    rp_plan_free(p);
    int32_t missing[2] = {0, 1}, twice[3] = {0, 1, 1}, one[1] = {2}, counts[2] = {2, 1};
    const int32_t *lists[2] = {missing, one};
    p = plan_of(&f, 1, NULL, NULL, CONTIG4);
    int32_t counts_missing[2] = {2, 0};
    rp_plan_set_microbatches(p, 3, lists, counts_missing, &err);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "a sequence not packed");
    like(err.text, "sequence 2 is not packed", "... message");
    is_int(err.sequence, 2, "... with its id");
    lists[0] = twice;
    counts[0] = 3;
    rp_plan_set_microbatches(p, 3, lists, counts, &err);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "a sequence packed twice");
    like(err.text, "sequence 1 is packed twice (rank 0 mb 0, rank 0 mb 0)", "... message");
    rp_plan_free(p);
    int32_t holes[8] = {0, 1, 2, -1, 0, 1, 2, 3};
    p = plan_of(&f, 1, HAND_RANK, HAND_MB, holes);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "an expert without a replica");
    like(err.text, "layer 0 expert 3 has no replica", "... message");
    rp_plan_free(p);
    p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    double bad_shares[2] = {0.5, 0.6};
    rp_plan_add_extra_replica(p, 0, 0, 0, 1, &err);
    rp_plan_set_shares(p, 0, 0, 0, bad_shares, 2, &err);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "shares not summing to 1");
    like(err.text, "mb 0 layer 0 expert 0 has shares summing to 1.1", "... message");
    bad_shares[1] = NAN;
    rp_plan_set_shares(p, 0, 0, 0, bad_shares, 2, &err);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "a NaN share");
    rp_plan_set_shares(p, 0, 0, 0, bad_shares, 1, &err);
    is_int(rp_cost_evaluate(c, p, NULL, &err), RP_EINVAL, "too few shares");
    like(err.text, "has 1 shares for 2 replicas", "... message");
    is_double(rp_cost_current_s(c), before, 0, "failed evaluations keep the previous binding");

    /* incremental calls against the bound plan */
    ok(isinf(rp_cost_try_move(c, 7, 0, 0)), "try_move of an unknown sequence is infinite");
    ok(isinf(rp_cost_try_move(c, 0, 2, 0)), "try_move to an unknown rank is infinite");
    ok(isinf(rp_cost_try_swap(c, 0, -1)), "try_swap of an unknown sequence is infinite");
    ok(isinf(rp_cost_try_slot(c, 0, 0, 1)), "try_slot removing the last replica is infinite");
    ok(isinf(rp_cost_try_slot(c, 2, 0, 1)), "try_slot of an unknown layer is infinite");
    is_double(rp_cost_try_move(c, 0, 0, 0), before, 0, "a move to where it is changes nothing");
    is_int(rp_cost_apply_move(c, p, 0, 1, 0, &err), RP_EINVAL, "apply to a plan the evaluator is not bound to");
    like(err.text, "not the one the evaluator is bound to", "... message");
    uint64_t hash = rp_plan_hash(good);
    is_int(rp_cost_apply_slot(c, good, 0, 0, 1, &err), RP_EINVAL, "apply_slot removing the last replica");
    like(err.text, "layer 0 slot 0 holds the only replica of expert 0", "... message");
    ok(rp_plan_hash(good) == hash && rp_cost_current_s(c) == before, "... and nothing changed");
    rp_plan_free(p);
    rp_plan_free(good);
    rp_cost_free(c);

    /* the token cap: 6 tokens per microbatch; moving s1 (2 tokens) onto s0 (4) fits,
     * moving s2 (3) does not */
    char json[2048];
    snprintf(json, sizeof json, HAND_CFG, 1, 2, 2, "1", HAND_HW, HAND_EXEC);
    char *cap = strstr(json, "\"max_tokens_per_microbatch\": 100");
    memcpy(cap + 29, "6  ", 3);
    fixture capped;
    fixture_make(&capped, json, 3, HAND_LENS, HAND_IDS);
    rp_cost_new(ctx, capped.cfg, capped.batch, capped.stats, RP_SPLIT_EVEN, &c, &err);
    good = plan_of(&capped, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, good, NULL, &err);
    ok(isfinite(rp_cost_try_move(c, 1, 0, 0)), "a move within the token cap is priced");
    ok(isinf(rp_cost_try_move(c, 2, 0, 0)), "a move over the token cap is infinite");
    is_int(rp_cost_apply_move(c, good, 2, 0, 0, &err), RP_EINVAL, "apply_move over the token cap fails");
    like(err.text, "would give it 7 tokens, over the token cap of 6", "... message");
    is_int(rp_plan_seq_rank(good, 2), 1, "... and the plan is unchanged");
    is_int(rp_cost_apply_move(c, good, 1, 0, 0, &err), RP_OK, "apply_move within the cap");
    is_int(rp_plan_seq_rank(good, 1), 0, "... moves the sequence in the plan");
    rp_plan_free(good);
    rp_cost_free(c);
    batch_fixture_free(&capped);

    /* the activation memory cap: 10 bytes per token, 60 bytes: again 6 tokens */
    snprintf(json, sizeof json, HAND_CFG, 1, 2, 2, "1", HAND_HW, HAND_EXEC);
    cap = strstr(json, "\"max_tokens_per_microbatch\": 100");
    const char *act = "\"max_tokens_per_microbatch\": 100, \"max_activation_bytes\": 60, "
                      "\"activation_bytes_per_token\": 10}}";
    memcpy(cap, act, strlen(act) + 1);
    ok(fixture_make(&capped, json, 3, HAND_LENS, HAND_IDS), "config with an activation memory cap");
    rp_cost_new(ctx, capped.cfg, capped.batch, capped.stats, RP_SPLIT_EVEN, &c, &err);
    good = plan_of(&capped, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_evaluate(c, good, NULL, &err);
    ok(isfinite(rp_cost_try_move(c, 1, 0, 0)), "a move within the memory cap is priced");
    ok(isinf(rp_cost_try_move(c, 2, 0, 0)), "a move over the memory cap is infinite");
    /* GPU 0 holds s0 (4), GPU 1 s1 + s2 (2 + 3) */
    ok(isfinite(rp_cost_try_swap(c, 0, 2)), "a swap that keeps both within the cap is priced (3 and 6 tokens)");
    ok(isinf(rp_cost_try_swap(c, 0, 1)), "a swap that overfills one microbatch is infinite (2 and 7 tokens)");
    rp_plan_free(good);
    rp_cost_free(c);
    batch_fixture_free(&capped);
    batch_fixture_free(&f);
    batch_fixture_free(&other);
}

static void test_unbound(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 2, "1");
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, CONTIG4);
    rp_cost_summary s;
    size_t before = rp_cost_bytes(c);
    ok(isinf(rp_cost_try_move(c, 0, 1, 0)) && isinf(rp_cost_try_swap(c, 0, 1)) && isinf(rp_cost_try_slot(c, 0, 0, 1)),
       "tries before any evaluation are infinite");
    is_int(rp_cost_apply_move(c, p, 0, 1, 0, &err), RP_EINVAL, "apply before any evaluation fails");
    like(err.text, "no plan has been evaluated yet", "... message");
    is_int(rp_cost_current_summary(c, &s, &err), RP_EINVAL, "no summary before any evaluation");
    ok(isnan(rp_cost_layer_s(c, 0, 0)), "no layer time before any evaluation");
    rp_cost_evaluate(c, p, NULL, &err);
    ok(rp_cost_bytes(c) > before, "the evaluator's memory counts its state (%zu bytes)", rp_cost_bytes(c));
    int32_t g = 7;
    rp_cost_layer_straggler(c, 0, 5, &g);
    is_int(g, -1, "straggler of a layer out of range");
    ok(isnan(rp_cost_layer_s(c, 1, 0)), "layer time of a microbatch out of range");
    is_int(rp_cost_current_summary(c, &s, &err), RP_OK, "summary of the bound state");
    is_double(s.step_s, 156.75, 1e-12, "... equals the evaluation's");
    /* apply a swap and check it moved both sequences in the plan */
    is_int(rp_cost_apply_swap(c, p, 0, 2, &err), RP_OK, "apply_swap");
    ok(rp_plan_seq_rank(p, 0) == 1 && rp_plan_seq_rank(p, 2) == 0, "... swaps the sequences' ranks in the plan");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* Fail the N-th allocation of new, evaluate and the JSON dump, for every N. */
static void test_alloc_failures(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 3, "1");
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, SPARE_P2L);
    rp_error err;
    rp_plan_add_extra_replica(p, 0, 1, 1, 1, &err);
    rp_cost *ref = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &ref, &err);
    rp_cost_evaluate(ref, p, NULL, &err);
    const double want = rp_cost_current_s(ref);
    rp_cost_free(ref);
    int failures = 0, bad = 0;
    for (long n = 1; n < 1000; n++) {
        counting k = {0};
        rp_context *cx = NULL;
        rp_context_new(counting_alloc, &k, &cx);
        k.fail_at = n;
        k.calls = 0;
        rp_cost *c = NULL;
        char *text = NULL;
        rp_status st = rp_cost_new(cx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &c, &err);
        if (st == RP_OK) st = rp_cost_evaluate(c, p, NULL, &err);
        if (st == RP_OK) st = rp_cost_breakdown_json(c, &text, NULL, &err);
        if (st == RP_OK) {
            double secs, bytes;
            st = rp_cost_migration(c, p, p, &secs, &bytes, &err);
        }
        bool done = st == RP_OK && k.calls < n;
        if (st != RP_OK) {
            failures++;
            if (st != RP_ENOMEM) bad++;
            k.fail_at = 0; /* the evaluator stays usable */
            if (c && (rp_cost_evaluate(c, p, NULL, &err) != RP_OK || rp_cost_current_s(c) != want)) bad++;
        }
        rp_text_free(cx, text);
        rp_cost_free(c);
        rp_context_free(cx);
        if (k.live != 0) bad++;
        if (done) break;
    }
    ok(failures > 5, "%d allocation failures injected", failures);
    is_int(bad, 0, "each fails with RP_ENOMEM, leaks nothing and leaves the evaluator usable");
    rp_plan_free(p);
    batch_fixture_free(&f);
}

/* A second placement on the bound packing (with a lever: the full evaluation) takes the bound
 * state's counts over, only once nothing can fail: an allocation failure at any point leaves
 * the bound state whole (its step, and moves that read its counts, as if never seen). */
static void test_same_packing_failures(void)
{
    fixture f;
    hand_fixture(&f, 1, 2, 3, "1");
    static const int32_t other[2 * 6] = {0, 1, 2, 3, 3, -1, 0, 1, 2, -1, 3, -1};
    rp_plan *p = plan_of(&f, 1, HAND_RANK, HAND_MB, SPARE_P2L), *q = plan_of(&f, 1, HAND_RANK, HAND_MB, other);
    rp_error err;
    rp_plan_add_extra_replica(q, 0, 1, 0, 1, &err);
    rp_cost *ref = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &ref, &err);
    rp_cost_evaluate(ref, p, NULL, &err);
    const double want = rp_cost_current_s(ref), want_move = rp_cost_try_move(ref, 0, 1, 0);
    rp_cost_evaluate(ref, q, NULL, &err);
    const double want_q = rp_cost_current_s(ref);
    rp_cost_free(ref);
    int failures = 0, bad = 0;
    for (long n = 1; n < 1000; n++) {
        counting k = {0};
        rp_context *cx = NULL;
        rp_context_new(counting_alloc, &k, &cx);
        rp_cost *c = NULL;
        bool bound = rp_cost_new(cx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
                     rp_cost_evaluate(c, p, NULL, &err) == RP_OK;
        if (!bound) bad++;
        k.calls = 0;
        k.fail_at = n;
        rp_status st = bound ? rp_cost_evaluate(c, q, NULL, &err) : RP_ENOMEM;
        bool done = st == RP_OK && k.calls < n;
        k.fail_at = 0;
        if (st != RP_OK && bound) {
            failures++;
            if (st != RP_ENOMEM || rp_cost_current_s(c) != want || rp_cost_try_move(c, 0, 1, 0) != want_move) bad++;
        } else if (st == RP_OK && rp_cost_current_s(c) != want_q) {
            bad++;
        }
        rp_cost_free(c);
        rp_context_free(cx);
        if (k.live != 0) bad++;
        if (done) break;
    }
    ok(failures > 5, "%d allocation failures injected into a same-packing evaluation", failures);
    is_int(bad, 0, "each leaves the bound state whole (its step, and a move that reads its counts)");
    rp_plan_free(p);
    rp_plan_free(q);
    batch_fixture_free(&f);
}

/* rp_cost_evaluation_needs tells, before anything is allocated, exactly the bytes an
 * evaluation takes (what rp_cost_bytes grows by on a fresh evaluator), with and without
 * levers, over microbatch counts; the work grows with M x L x G x E. */
static void test_evaluation_needs(void)
{
    rng r = {0x2545F4914F6CDD1DULL};
    int exact = 0, runs = 0;
    for (int v = 0; v < 2; v++) {
        fixture f;
        random_fixture(&f, &r, v ? 8 : 4, v ? 2 : 4, "1", 100000);
        rp_error err;
        int64_t last_units = 0;
        for (int32_t M = 1; M <= 9; M += 4)
            for (int lv = 0; lv < 2; lv++) {
                rp_cost *c = NULL;
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
                rp_plan *p = random_plan(&f, &r, M, lv);
                int64_t units = 0;
                size_t bytes = 0;
                size_t before = rp_cost_bytes(c);
                bool got = rp_cost_evaluation_needs(c, p, &units, &bytes, &err) == RP_OK &&
                           rp_cost_evaluate(c, p, NULL, &err) == RP_OK;
                runs++;
                if (got && rp_cost_bytes(c) - before == bytes && (lv ? units >= last_units : units > last_units)) exact++;
                else diag("M %d levers %d: estimated %zu bytes, evaluation took %zu (%s)", M, lv, bytes,
                          rp_cost_bytes(c) - before, got ? "ok" : err.text);
                if (!lv) last_units = units;
                rp_plan_free(p);
                rp_cost_free(c);
            }
        batch_fixture_free(&f);
    }
    is_int(exact, runs, "the estimate is exactly what %d evaluations allocated, and the work grows with M", runs);

    /* a plan too large to evaluate at all is refused by the estimate, without allocating */
    fixture f;
    random_fixture(&f, &r, 4, 4, "1", 100000);
    rp_cost *c = NULL;
    rp_error err;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err);
    rp_plan *p = NULL;
    rp_plan_new(ctx, f.cfg, 1, &p, &err);
    is_int(rp_cost_evaluation_needs(c, p, NULL, NULL, &err), RP_EINVAL, "a plan without a packing is refused");
    like(err.text, "has no packing", "... saying so");
    rp_plan_free(p);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    test_hand_one_node();
    test_hand_two_nodes();
    test_hand_replicas();
    test_hand_extra_replica();
    test_locality_nodes();
    test_hand_terms();
    test_hand_attention_curve();
    test_hand_sync();
    test_layer_straggler_domain();
    test_hand_dispatch_bytes();
    test_hand_dedup_gpu();
    test_hand_dedup_node();
    test_units();
    test_straggler();
    test_bound_tight();
    test_migration();
    /* every (sync, overlap) pair, with the three dispatch de-duplications among them */
    static const char *const executions[] = {
        "\"sync\": \"global\", \"overlap\": \"none\", \"dispatch_dedup\": \"choice\"",
        "\"sync\": \"global\", \"overlap\": \"layer\", \"dispatch_dedup\": \"gpu\"",
        "\"sync\": \"group\", \"overlap\": \"none\", \"dispatch_dedup\": \"node\"",
        "\"sync\": \"group\", \"overlap\": \"layer\", \"dispatch_dedup\": \"gpu\"",
        "\"sync\": \"group\", \"overlap\": \"none\", \"dispatch_dedup\": \"choice\", "
        "\"dispatch_bytes_per_element\": 1",
    };
    for (size_t i = 0; i < sizeof executions / sizeof executions[0]; i++) {
        random_execution = executions[i];
        test_bound_random();
        test_incremental();
    }
    random_execution = "";
    test_same_packing();
    test_evaluated_again();
    test_summary_of();
    test_memo_context();
    test_evaluation_needs();
    test_json();
    test_bad_constants();
    test_bad_batch();
    test_bad_plans();
    test_unbound();
    test_alloc_failures();
    test_same_packing_failures();
    rp_context_free(ctx);
    return tap_done();
}
