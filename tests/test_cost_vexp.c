/* The cost model under per-forward balancing (virtual experts): a hand-computed group,
 * refusals, incremental moves against full evaluations and the lower bound on random
 * plans. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>

static rp_context *ctx;

typedef batch_fixture fixture; /* test_util.h */

/* Prompt-only sequences with a packed [tokens][layers][k] uint8 routing. */
static bool fixture_make(fixture *f, const char *cfg_json, int32_t n, const int32_t *lens, const uint8_t *ids)
{
    rp_error err;
    if (batch_fixture_make(ctx, f, cfg_json, n, lens, NULL, ids, &err)) return true;
    diag("fixture: %s", err.text);
    return false;
}

/* 2 GPUs in one node, EP 2, 2 experts (one per rank), top-1, one layer.
 *   a token-choice: d bpp = 8 B, 1 s over NVLink (8 B/s), latency 0.5 s
 *   one expert's weights: 3 d f bpp = 48 B, a push 6 s + 0.5 s
 *   expert t(n) = max(n 6 d f / (peak eff(n)), 3 d f bpp / hbm) = max(0.75 n / eff(n), 1),
 *   eff 1 from 4 tokens: t(4) = 3, t(8) = 6
 *   backward_multiplier 2 sets the compute terms (experts: 1 + 2 = 3 times the forward);
 *   communication's backward stays 1, so a layer pays its dispatch 2 x (1 + 1) = 4 times,
 *   and the balancer's 3 transfers (push forward, push backward, gradient) are 3/4 push
 *   per dispatch; no overlap */
static const char *HAND =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": %s,"
    "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000, \"net_bytes_per_s\": 4, \"net_latency_us\": 1000000},"
    " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48, \"attention_efficiency\": 0.5,"
    "  \"dense_efficiency\": 1, \"gemm_efficiency\": [[1, 0.5], [4, 1]], \"backward_multiplier\": 2},"
    " \"execution\": {\"executor\": \"ideal\"},"
    " \"model\": {\"num_layers\": 1, \"num_experts\": 2, \"top_k\": 1, \"hidden_size\": 4,"
    "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"num_kv_heads\": 1, \"head_dim\": 2,"
    "  \"bytes_per_param\": 2, \"bytes_per_optimizer_state\": 12},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100}}";

/* Two sequences of 4 tokens, every token to expert 0 (rank 0's). */
static void test_hand(void)
{
    char json[2048];
    snprintf(json, sizeof json, HAND, "2");
    static const int32_t lens[] = {4, 4};
    static const uint8_t ids[8] = {0};
    fixture f;
    if (!fixture_make(&f, json, 2, lens, ids)) {
        ok(0, "hand fixture");
        return;
    }
    rp_error err;
    rp_cost *c = NULL;
    rp_plan *plan = NULL;
    const int32_t seq_rank[] = {0, 1}, seq_mb[] = {0, 0};
    if (rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &c, &err) != RP_OK ||
        rp_plan_new(ctx, f.cfg, 1, &plan, &err) != RP_OK ||
        rp_plan_set_packing(plan, 2, seq_rank, seq_mb, &err) != RP_OK || rp_plan_set_contiguous(plan, &err) != RP_OK) {
        ok(0, "hand setup: %s", err.text);
        goto out;
    }
    /* without balancing: expert 0 takes all 8 on rank 0 (t(8) = 6); rank 1 sends its 4 */
    rp_cost_summary sum;
    ok(rp_cost_evaluate(c, plan, &sum, &err) == RP_OK, "contiguous evaluates");
    const double *x = rp_cost_expert_breakdown(c), *d = rp_cost_dispatch_breakdown(c);
    is_double(x[0], 6.0, 1e-12, "contiguous: rank 0 expert time t(8) = 6 s");
    is_double(x[1], 0.0, 1e-12, "contiguous: rank 1 idle");
    is_double(d[0], 4.5, 1e-12, "contiguous: dispatch 4 choices x 1 s + 0.5 s");
    double step_plain = sum.step_s;

    /* with virtual experts: rank 1 computes its own 4 choices of expert 0 in a virtual
     * slot; no token moves; rank 0 pushes one expert to rank 1 */
    rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, &err);
    ok(rp_cost_evaluate(c, plan, &sum, &err) == RP_OK, "virtual experts evaluate");
    x = rp_cost_expert_breakdown(c);
    d = rp_cost_dispatch_breakdown(c);
    is_double(x[0], 3.0, 1e-12, "virtual experts: rank 0 computes 4, t(4) = 3 s");
    is_double(x[1], 3.0, 1e-12, "virtual experts: rank 1 computes 4 in its virtual slot, 3 s");
    is_double(d[0], 0.5 + 0.75 * 6.5, 1e-12, "virtual experts: dispatch = latency + 3/4 of a push (6.5 s) = 5.375 s");
    is_double(d[1], 5.375, 1e-12, "virtual experts: the receiver pays the push too");
    /* per layer: experts 6 -> 3 (x 3) and dispatch 4.5 -> 5.375 (x 4) */
    is_double(step_plain - sum.step_s, 3.0 * 3.0 - 4.0 * 0.875, 1e-9, "the step gains 3 x 3 - 4 x 0.875 = 5.5 s");
    ok(sum.lower_bound_s <= sum.step_s, "lower bound <= step under virtual experts");

    /* slot changes cannot keep even ownership */
    ok(isinf(rp_cost_try_slot(c, 0, 3, 0)), "try_slot under virtual experts: refused (infinite)");
    is_int(rp_cost_apply_slot(c, plan, 0, 3, 0, &err), RP_EINVAL, "apply_slot under virtual experts refused");
    like(err.text, "layer 0 slot 3 cannot change", "message names the slot");

    /* levers with the flag are refused, and the binding stays */
    rp_plan_add_extra_replica(plan, 0, 0, 1, 0, &err);
    is_int(rp_cost_evaluate(c, plan, NULL, &err), RP_EINVAL, "virtual experts with extra replicas refused");
    like(err.text, "makes its own replicas each forward, but it also has 1 extra replicas", "message");
    is_double(rp_cost_current_s(c), sum.step_s, 0, "the previous binding stays");
out:
    rp_plan_free(plan);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* A config where the balancer cannot run: a plan that asks for it is refused by name. */
static void test_refused_config(void)
{
    char json[2048];
    snprintf(json, sizeof json, HAND, "2");
    /* two nodes of one GPU: the EP group of 2 spans nodes */
    char *at = strstr(json, "\"num_nodes\": 1, \"gpus_per_node\": 2");
    memcpy(at, "\"num_nodes\": 2, \"gpus_per_node\": 1", strlen("\"num_nodes\": 2, \"gpus_per_node\": 1"));
    static const int32_t lens[] = {4, 4};
    static const uint8_t ids[8] = {0};
    fixture f;
    if (!fixture_make(&f, json, 2, lens, ids)) {
        ok(0, "spanning fixture");
        return;
    }
    rp_error err;
    rp_cost *c = NULL;
    rp_plan *plan = NULL;
    const int32_t seq_rank[] = {0, 1}, seq_mb[] = {0, 0};
    bool made = rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &c, &err) == RP_OK &&
                rp_plan_new(ctx, f.cfg, 1, &plan, &err) == RP_OK &&
                rp_plan_set_packing(plan, 2, seq_rank, seq_mb, &err) == RP_OK && rp_plan_set_contiguous(plan, &err) == RP_OK;
    ok(made, "a cost evaluator on a config the balancer rules out");
    if (made) {
        rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, &err);
        is_int(rp_cost_evaluate(c, plan, NULL, &err), RP_EINVAL, "a plan with virtual experts is refused");
        like(err.text, "an EP group of 2 GPUs spans nodes of 1 GPUs", "message names the limit");
        rp_plan_set_balancing(plan, RP_BALANCING_NONE, &err);
        is_int(rp_cost_evaluate(c, plan, NULL, &err), RP_OK, "the same plan without it evaluates");
    }
    rp_plan_free(plan);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

/* 4 GPUs (one node), EP 4, 8 experts, top-2, 2 layers, 2 microbatches, 16 sequences of
 * skewed routing: random moves and swaps tried and applied under virtual experts equal
 * full evaluations of the changed plans bit for bit, and the bound stays below the step. */
static const char *RANDOM =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
    " \"trainer\": {\"per_forward_balancer\": true},"
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
    "  \"expert_ffn_size\": 32, \"num_heads\": 2, \"num_kv_heads\": 1, \"head_dim\": 16},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}}";

static void test_random(void)
{
    enum { N = 16, L = 2, K = 2, E = 8, G = 4, M = 2 };
    uint64_t seed = 42;
    int32_t lens[N];
    int64_t tokens = 0;
    for (int i = 0; i < N; i++) tokens += lens[i] = 1 + (int32_t)(xorshift64(&seed) % 40);
    uint8_t *ids = malloc((size_t)tokens * L * K);
    for (int64_t t = 0; t < tokens * L; t++) {
        int32_t a = xorshift64(&seed) % 2 ? 0 : (int32_t)(xorshift64(&seed) % E); /* expert 0 is hot */
        int32_t b = (a + 1 + (int32_t)(xorshift64(&seed) % (E - 1))) % E;
        ids[t * K] = (uint8_t)a;
        ids[t * K + 1] = (uint8_t)b;
    }
    fixture f;
    bool made = fixture_make(&f, RANDOM, N, lens, ids);
    free(ids);
    if (!made) {
        ok(0, "random fixture");
        return;
    }
    rp_error err;
    rp_cost *c = NULL, *full = NULL;
    rp_plan *plan = NULL;
    int32_t seq_rank[N], seq_mb[N];
    for (int i = 0; i < N; i++) seq_rank[i] = i % G, seq_mb[i] = (i / G) % M;
    if (rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &c, &err) != RP_OK ||
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_LOCALITY, &full, &err) != RP_OK ||
        rp_plan_new(ctx, f.cfg, M, &plan, &err) != RP_OK || rp_plan_set_packing(plan, N, seq_rank, seq_mb, &err) != RP_OK ||
        rp_plan_set_contiguous(plan, &err) != RP_OK ||
        rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, &err) != RP_OK ||
        rp_cost_evaluate(c, plan, NULL, &err) != RP_OK) {
        ok(0, "random setup: %s", err.text);
        goto out;
    }
    int tries_bad = 0, applied_bad = 0, bound_bad = 0;
    for (int i = 0; i < 200; i++) {
        int32_t s = (int32_t)(xorshift64(&seed) % N), g = (int32_t)(xorshift64(&seed) % G),
                m = (int32_t)(xorshift64(&seed) % M), s2 = (int32_t)(xorshift64(&seed) % N);
        bool swap = xorshift64(&seed) % 3 == 0;
        double tried = swap ? rp_cost_try_swap(c, s, s2) : rp_cost_try_move(c, s, g, m);
        rp_plan *copy = NULL;
        rp_cost_summary want;
        if (rp_plan_copy(plan, &copy, &err) != RP_OK) break;
        rp_status moved = swap ? rp_plan_move_sequence(copy, s, rp_plan_seq_rank(plan, s2), rp_plan_seq_microbatch(plan, s2), &err)
                               : rp_plan_move_sequence(copy, s, g, m, &err);
        if (swap && moved == RP_OK)
            moved = rp_plan_move_sequence(copy, s2, rp_plan_seq_rank(plan, s), rp_plan_seq_microbatch(plan, s), &err);
        if (moved == RP_OK && rp_cost_evaluate(full, copy, &want, &err) == RP_OK) {
            if (tried != want.step_s) {
                if (tries_bad++ < 3) diag("try %d: %.17g, full %.17g", i, tried, want.step_s);
            }
            bound_bad += !(want.lower_bound_s <= want.step_s);
        }
        rp_plan_free(copy);
        if (i % 4 == 0) {
            rp_status st = swap ? rp_cost_apply_swap(c, plan, s, s2, &err) : rp_cost_apply_move(c, plan, s, g, m, &err);
            if (st == RP_OK) {
                rp_cost_summary now;
                if (rp_cost_evaluate(full, plan, &now, &err) != RP_OK || now.step_s != rp_cost_current_s(c))
                    applied_bad++;
            }
        }
    }
    is_int(tries_bad, 0, "200 random tries under virtual experts equal full evaluations bit for bit");
    is_int(applied_bad, 0, "applied moves keep the state equal to a full evaluation");
    is_int(bound_bad, 0, "lower bound <= step on every evaluated plan");
out:
    rp_plan_free(plan);
    rp_cost_free(c);
    rp_cost_free(full);
    batch_fixture_free(&f);
}

/* The joint planner when the trainer runs the balancer (execution.per_forward_balancing):
 * its plans say so, keep the contiguous placement, carry no levers, and its fallbacks are
 * the baselines' packings with virtual experts. */
static void test_joint(void)
{
    enum { N = 24, L = 2, K = 2, E = 8 };
    uint64_t seed = 7;
    int32_t lens[N];
    int64_t tokens = 0;
    for (int i = 0; i < N; i++) tokens += lens[i] = 1 + (int32_t)(xorshift64(&seed) % 60);
    uint8_t *ids = malloc((size_t)tokens * L * K);
    for (int64_t t = 0; t < tokens * L; t++) {
        int32_t a = xorshift64(&seed) % 2 ? 1 : (int32_t)(xorshift64(&seed) % E);
        ids[t * K] = (uint8_t)a;
        ids[t * K + 1] = (uint8_t)((a + 1 + (int32_t)(xorshift64(&seed) % (E - 1))) % E);
    }
    char json[1024];
    snprintf(json, sizeof json, "%.*s, \"execution\": {\"per_forward_balancing\": \"%s\"}}", (int)strlen(RANDOM) - 1,
             RANDOM, "virtual_experts");
    fixture f;
    bool made = fixture_make(&f, json, N, lens, ids);
    free(ids);
    if (!made) {
        ok(0, "joint fixture");
        return;
    }
    rp_plan *plan = NULL, *contiguous = NULL;
    rp_joint_report rep;
    rp_error err;
    rp_status st = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, NULL, &plan, &rep, &err);
    is_int(st, RP_OK, "the joint planner plans for the balancer");
    if (st == RP_OK) {
        is_int(rp_plan_balancing(plan), RP_BALANCING_VIRTUAL_EXPERTS, "its plan runs with virtual experts");
        ok(rp_plan_num_extra_replicas(plan) == 0 && rp_plan_num_share_sets(plan) == 0, "no extra replicas or shares");
        bool same = rp_plan_new(ctx, f.cfg, 1, &contiguous, &err) == RP_OK && rp_plan_set_contiguous(contiguous, &err) == RP_OK;
        for (int32_t l = 0; same && l < L; l++)
            same = !memcmp(rp_plan_phy2log(plan, l), rp_plan_phy2log(contiguous, l), (size_t)rp_plan_total_slots(plan) * 4);
        ok(same, "the contiguous placement the balancer requires");
        is_int(rp_plan_validate(plan, f.cfg, f.batch, &err), RP_OK, "a valid plan");
        like(rep.best_fallback, "+virtual_experts", "its fallbacks run with the balancer too (%s)", rep.best_fallback);
    }
    rp_plan_free(plan);
    rp_plan_free(contiguous);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_hand();
    test_refused_config();
    test_random();
    test_joint();
    rp_context_free(ctx);
    return tap_done();
}
