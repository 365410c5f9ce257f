/* The cost model reusing what it read: a plan equal to the bound one but for some
 * placement rows (same packing, neither with levers nor per-forward balancing) re-evaluates
 * only the changed layers, bit for bit as on a fresh evaluator, for a fraction of a full
 * evaluation's operations; a bad row is refused with the state kept; anything else
 * (levers, another packing) takes the full evaluation. A packing's counts read ahead
 * (cost_read_packing, the joint planner's group histograms) are the histograms' sums and
 * are taken over by the evaluation of a plan with that packing. */
#include "cost_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

typedef batch_fixture fixture; /* test_util.h */

#define N 48
#define L 6
#define E 12
#define K 3

/* 8 GPUs on 2 nodes, EP 4 or 8, spare slots; the execution settings and the topology's
 * extra members vary (sync, overlap, pipeline parallelism, executors). */
static const char *CFG =
    "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 4, \"ep_size\": %d, \"slots_per_gpu\": %d%s},"
    " \"hardware\": {\"peak_flops\": 1e9, \"hbm_bytes_per_s\": 1e9, \"layer_fixed_us\": 2,"
    "  \"attention_efficiency\": [[4, 0.2], [16, 0.45], [40, 0.7]],"
    "  \"gemm_efficiency\": [[1, 0.05], [8, 0.3], [32, 0.9]]},"
    " \"execution\": {%s},"
    " \"model\": {\"num_layers\": 6, \"num_experts\": 12, \"top_k\": 3, \"hidden_size\": 64,"
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"num_kv_heads\": 2, \"head_dim\": 16},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}}";

typedef struct variant {
    int ep, slots;
    const char *topology, *execution;
} variant;

static const variant VARIANTS[] = {
    {4, 4, "", ""},
    {8, 2, "", "\"sync\": \"global\""},
    {4, 4, "", "\"overlap\": \"layer\""},
    {4, 4, ", \"pipeline_parallel_size\": 2", ""},
    {8, 2, "", "\"executor\": \"megatron_routepack\""},
    {4, 4, "", "\"executor\": \"ideal\""},
};

static bool make(fixture *f, const variant *v, uint64_t *rng)
{
    char json[2048];
    snprintf(json, sizeof json, CFG, v->ep, v->slots, v->topology, v->execution);
    int32_t lens[N];
    int64_t tokens = 0;
    for (int i = 0; i < N; i++) tokens += lens[i] = 1 + (int32_t)(xorshift64(rng) % 40);
    uint8_t *ids = malloc((size_t)tokens * L * K);
    for (int64_t t = 0; t < tokens; t++)
        for (int l = 0; l < L; l++) {
            int32_t first = (int32_t)(xorshift64(rng) % 4 ? xorshift64(rng) % 4 : xorshift64(rng) % E);
            for (int j = 0; j < K; j++) ids[(t * L + l) * K + j] = (uint8_t)((first + j * 5) % E);
        }
    rp_error err;
    bool made = batch_fixture_make(ctx, f, json, N, lens, NULL, ids, &err);
    if (!made) diag("fixture: %s", err.text);
    free(ids);
    return made;
}

/* A plan of M microbatches, sequences dealt at random, every layer's row random. */
static rp_plan *random_plan(const fixture *f, int32_t M, uint64_t *rng)
{
    const int32_t G = rp_config_topology(f->cfg)->num_gpus;
    int32_t rank[N], mb[N];
    for (int i = 0; i < N; i++) {
        rank[i] = (int32_t)(xorshift64(rng) % (uint64_t)G);
        mb[i] = (int32_t)(xorshift64(rng) % (uint64_t)M);
    }
    rp_plan *p = NULL;
    rp_error err;
    if (rp_plan_new(ctx, f->cfg, M, &p, &err) != RP_OK || rp_plan_set_packing(p, N, rank, mb, &err) != RP_OK) {
        diag("plan: %s", err.text);
        rp_plan_free(p);
        return NULL;
    }
    int32_t row[256];
    const int32_t S = rp_plan_total_slots(p);
    for (int32_t l = 0; l < L; l++) {
        random_placement(row, rp_plan_slot_begin(p), S, E, rng);
        rp_plan_set_phy2log(p, l, row, &err);
    }
    return p;
}

/* `p` with `n` of its rows (at random) placed afresh. */
static rp_plan *rows_changed(const rp_plan *p, int n, uint64_t *rng)
{
    rp_plan *q = NULL;
    rp_error err;
    if (rp_plan_copy(p, &q, &err) != RP_OK) return NULL;
    int32_t row[256];
    const int32_t S = rp_plan_total_slots(q);
    for (int i = 0; i < n; i++) {
        random_placement(row, rp_plan_slot_begin(q), S, E, rng);
        rp_plan_set_phy2log(q, (int32_t)(xorshift64(rng) % L), row, &err);
    }
    return q;
}

static bool same_bits(const double *a, const double *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

/* Everything the two evaluators give out about their bound plans, bit for bit. */
static bool same_evaluation(const rp_cost *a, const rp_cost *b, const rp_cost_summary *sa, const rp_cost_summary *sb,
                            const rp_plan *p)
{
    const int32_t G = rp_plan_num_gpus(p), M = rp_plan_num_microbatches(p);
    const size_t cells = (size_t)M * L * G;
    if (memcmp(sa, sb, sizeof *sa) != 0) return false;
    if (!same_bits(rp_cost_expert_breakdown(a), rp_cost_expert_breakdown(b), cells) ||
        !same_bits(rp_cost_dispatch_breakdown(a), rp_cost_dispatch_breakdown(b), cells) ||
        !same_bits(rp_cost_attention_breakdown(a), rp_cost_attention_breakdown(b), (size_t)G * M))
        return false;
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < L; l++) {
            double x = rp_cost_layer_s(a, m, l), y = rp_cost_layer_s(b, m, l);
            if (memcmp(&x, &y, sizeof x) != 0) return false;
        }
    double x = rp_cost_current_s(a), y = rp_cost_current_s(b);
    return memcmp(&x, &y, sizeof x) == 0;
}

/* Chains of row changes on one packing: each evaluated on the warm evaluator (bound to
 * the previous plan) and on a fresh one. */
static void test_rows_random(void)
{
    uint64_t rng = 0x243F6A8885A308D3ULL;
    int runs = 0, same = 0, cheaper = 0, nochange = 0;
    const int nv = (int)(sizeof VARIANTS / sizeof VARIANTS[0]);
    for (int v = 0; v < nv; v++) {
        fixture f;
        if (!make(&f, &VARIANTS[v], &rng)) {
            ok(0, "variant %d fixture", v);
            continue;
        }
        rp_error err;
        const int32_t M = VARIANTS[v].topology[0] ? 4 : 1 + (int32_t)(xorshift64(&rng) % 3);
        rp_plan *p = random_plan(&f, M, &rng);
        rp_cost *warm = NULL;
        rp_cost_summary s;
        if (!p || rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &warm, &err) != RP_OK ||
            rp_cost_evaluate(warm, p, &s, &err) != RP_OK) {
            ok(0, "variant %d setup: %s", v, err.text);
            rp_plan_free(p);
            rp_cost_free(warm);
            batch_fixture_free(&f);
            continue;
        }
        /* a full evaluation's operations, on a fresh evaluator of the same fixture */
        rp_cost *probe = NULL;
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &probe, &err);
        int64_t o = rp_cost_operations(probe);
        rp_cost_evaluate(probe, p, NULL, &err);
        const int64_t full_ops = rp_cost_operations(probe) - o;
        rp_cost_free(probe);
        for (int i = 0; i < 12; i++) {
            const int n = i % 4 == 3 ? 0 : 1 + (int)(xorshift64(&rng) % 2);
            rp_plan *q = rows_changed(p, n, &rng);
            rp_cost *fresh = NULL;
            rp_cost_summary a, b;
            o = rp_cost_operations(warm);
            if (!q || rp_cost_evaluate(warm, q, &a, &err) != RP_OK ||
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err) != RP_OK ||
                rp_cost_evaluate(fresh, q, &b, &err) != RP_OK) {
                diag("variant %d run %d: %s", v, i, err.text);
            } else {
                runs++;
                const int64_t used = rp_cost_operations(warm) - o;
                if (same_evaluation(warm, fresh, &a, &b, q)) same++;
                else diag("variant %d run %d: step %.17g against %.17g", v, i, a.step_s, b.step_s);
                /* at most 2 of 6 layers changed: well under a full evaluation */
                if (used * 2 < full_ops) cheaper++;
                else diag("variant %d run %d: %lld operations against a full evaluation's %lld", v, i,
                          (long long)used, (long long)full_ops);
                if (rp_plan_equal(p, q)) nochange++;
            }
            rp_cost_free(fresh);
            rp_plan_free(p);
            p = q;
        }
        rp_plan_free(p);
        rp_cost_free(warm);
        batch_fixture_free(&f);
    }
    is_int(runs, 12 * nv, "%d row changes evaluated on a bound packing", 12 * nv);
    is_int(same, runs, "each as on a fresh evaluator, bit for bit (summary, breakdowns, layer times)");
    is_int(cheaper, runs, "each for under half a full evaluation's operations");
    ok(nochange > 0 && nochange < runs, "some chains keep their rows (%d of %d)", nochange, runs);
}

/* A changed row that leaves an expert without a replica is refused as a full evaluation
 * refuses it, and the bound state stays the previous plan's; levers or another packing
 * take the full evaluation (as many operations as a fresh evaluator's). */
static void test_rows_refused(void)
{
    uint64_t rng = 0x13198A2E03707344ULL;
    fixture f;
    if (!make(&f, &VARIANTS[0], &rng)) {
        ok(0, "fixture");
        return;
    }
    rp_error err;
    rp_plan *p = random_plan(&f, 2, &rng), *bad = NULL, *lever = NULL, *other = NULL;
    rp_cost *c = NULL, *fresh = NULL;
    rp_cost_summary want, got;
    if (!p || rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) != RP_OK ||
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err) != RP_OK ||
        rp_cost_evaluate(c, p, &want, &err) != RP_OK || rp_plan_copy(p, &bad, &err) != RP_OK ||
        rp_plan_copy(p, &lever, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        goto out;
    }
    /* layer 2 without expert 5: every slot of it emptied */
    int32_t row[256];
    const int32_t S = rp_plan_total_slots(bad);
    memcpy(row, rp_plan_phy2log(bad, 2), (size_t)S * sizeof *row);
    for (int32_t k = 0; k < S; k++)
        if (row[k] == 5) row[k] = -1;
    rp_plan_set_phy2log(bad, 2, row, &err);
    err.expert = -1;
    is_int(rp_cost_evaluate(c, bad, NULL, &err), RP_EINVAL, "a row without expert 5 is refused");
    ok(strstr(err.text, "layer 2 expert 5 has no replica") != NULL && err.expert == 5, "with the layer and expert: %s",
       err.text);
    is_double(rp_cost_current_s(c), want.step_s, 0.0, "the bound state is still the previous plan's");
    int64_t o = rp_cost_operations(c);
    ok(rp_cost_evaluate(c, p, &got, &err) == RP_OK && memcmp(&got, &want, sizeof got) == 0 &&
           rp_cost_operations(c) - o < 1000,
       "and the previous plan is still bound (no work to evaluate it again)");

    /* levers: the full evaluation */
    int32_t full_ops;
    o = rp_cost_operations(fresh);
    rp_cost_evaluate(fresh, p, NULL, &err);
    full_ops = (int32_t)(rp_cost_operations(fresh) - o);
    rp_plan_add_extra_replica(lever, 0, 1, 3, 1, &err);
    o = rp_cost_operations(c);
    rp_cost_summary lv, lv_fresh;
    ok(rp_cost_evaluate(c, lever, &lv, &err) == RP_OK && rp_cost_evaluate(fresh, lever, &lv_fresh, &err) == RP_OK &&
           memcmp(&lv, &lv_fresh, sizeof lv) == 0,
       "a plan with an extra replica evaluates as on a fresh evaluator");
    ok(rp_cost_operations(c) - o >= full_ops / 2, "through the full evaluation (%lld operations, a full one %d)",
       (long long)(rp_cost_operations(c) - o), full_ops);
    /* another packing, bound to a plan without levers first */
    rp_cost_evaluate(c, p, NULL, &err);
    other = random_plan(&f, 2, &rng);
    o = rp_cost_operations(c);
    rp_cost_summary ot, ot_fresh;
    ok(other && rp_cost_evaluate(c, other, &ot, &err) == RP_OK && rp_cost_evaluate(fresh, other, &ot_fresh, &err) == RP_OK &&
           memcmp(&ot, &ot_fresh, sizeof ot) == 0 && rp_cost_operations(c) - o >= full_ops / 2,
       "another packing: the full evaluation, as on a fresh evaluator");
out:
    rp_plan_free(p);
    rp_plan_free(bad);
    rp_plan_free(lever);
    rp_plan_free(other);
    rp_cost_free(c);
    rp_cost_free(fresh);
    batch_fixture_free(&f);
}

/* cost_read_packing: the per-GPU counts of a packing, summed over each EP group, are the
 * statistics' per-(microbatch, group) loads; the evaluation of a plan with that packing
 * then skips the histogram pass (fewer operations than a fresh evaluator's) and equals a
 * fresh evaluator's bit for bit; a second read of the same packing, or of the bound
 * state's, does no work; a sequence outside the packing's GPUs is refused. */
static void test_read_packing(void)
{
    uint64_t rng = 0xA4093822299F31D0ULL;
    fixture f;
    if (!make(&f, &VARIANTS[1], &rng)) {
        ok(0, "fixture");
        return;
    }
    rp_error err;
    const int32_t M = 3, G = rp_config_topology(f.cfg)->num_gpus, ep = rp_config_topology(f.cfg)->ep_size, Q = G / ep;
    rp_plan *p = random_plan(&f, M, &rng);
    rp_cost *c = NULL, *fresh = NULL;
    int32_t rank[N], mb[N], cell[N];
    int64_t *loads = malloc(sizeof *loads * (size_t)M * Q * L * E);
    const int32_t *counts = NULL, *again = NULL;
    if (!p || !loads || rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) != RP_OK ||
        rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &fresh, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        goto out;
    }
    for (int32_t s = 0; s < N; s++) {
        rank[s] = rp_plan_seq_rank(p, s);
        mb[s] = rp_plan_seq_microbatch(p, s);
        cell[s] = mb[s] * Q + rank[s] / ep;
    }
    rp_stats_microbatch_loads(f.stats, cell, M * Q, loads, &err);
    is_int(cost_read_packing(c, M, rank, mb, &counts, &err), RP_OK, "a packing's counts read");
    int bad = 0;
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < L; l++)
            for (int32_t q = 0; q < Q; q++)
                for (int32_t e = 0; e < E; e++) {
                    int64_t sum = 0;
                    for (int32_t j = 0; j < ep; j++) sum += counts[(((size_t)m * L + l) * G + q * ep + j) * E + e];
                    bad += sum != loads[(((size_t)m * Q + q) * L + l) * E + e];
                }
    is_int(bad, 0, "summed over each EP group: the statistics' per-(microbatch, group) loads");
    int64_t o = rp_cost_operations(c);
    ok(cost_read_packing(c, M, rank, mb, &again, &err) == RP_OK && again == counts && rp_cost_operations(c) - o < 4 * N,
       "read again: the same counts, no pass");
    o = rp_cost_operations(fresh);
    rp_cost_summary a, b;
    rp_cost_evaluate(fresh, p, &b, &err);
    const int64_t full = rp_cost_operations(fresh) - o;
    o = rp_cost_operations(c);
    ok(rp_cost_evaluate(c, p, &a, &err) == RP_OK && same_evaluation(c, fresh, &a, &b, p),
       "the plan of that packing evaluates as on a fresh evaluator, bit for bit");
    const int64_t used = rp_cost_operations(c) - o, pass = (int64_t)N * L * E; /* half the pass at least */
    ok(used + pass <= full, "without the histogram pass (%lld operations, a fresh evaluator %lld)", (long long)used,
       (long long)full);
    o = rp_cost_operations(c);
    ok(cost_read_packing(c, M, rank, mb, &again, &err) == RP_OK && rp_cost_operations(c) - o < 4 * N,
       "the bound state's packing: its counts, no pass");
    rank[7] = G;
    err.sequence = -1;
    is_int(cost_read_packing(c, M, rank, mb, &again, &err), RP_EINVAL, "a sequence on GPU %d is refused", G);
    ok(err.sequence == 7, "naming the sequence: %s", err.text);
out:
    free(loads);
    rp_plan_free(p);
    rp_cost_free(c);
    rp_cost_free(fresh);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_rows_random();
    test_rows_refused();
    test_read_packing();
    rp_context_free(ctx);
    return tap_done();
}
