/* Cost model at the reference scale (64 GPUs on 8 nodes, EP 8, 48 layers x 128 experts,
 * top-8, 4096 sequences): full evaluations, incremental tries and applies per second,
 * and the evaluator's memory. Figures only; nothing is asserted. */
#include "bench_util.h"
#include "routepack/routepack.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { NUM_SEQS = 4096, LAYERS = 48, TOP_K = 8, EXPERTS = 128, GROUP = 8, GPUS = 64, MICROBATCHES = 8 };
/* The reference batch holds ~13M tokens: 5 GB of uint8 routing ids, too much for a
 * shared machine. Lengths are scaled by 1/8 (~1.6M tokens, ~0.6 GB of ids). */
#define LENGTH_SCALE 8

/* The evaluator whose counted operations (rp_cost_operations, what the sandbox charges
 * as work units) the timings are set against. */
static const rp_cost *counted;
typedef struct timer { double wall, cpu; int64_t ops; } timer;
static timer start(void) { return (timer){now(), cpu(), counted ? rp_cost_operations(counted) : 0}; }
/* Print "name: W us wall, C us CPU (R per second of CPU)" for n operations, and the
 * evaluator's counted operations per call and per CPU second. */
static void report(const char *name, timer t, int n, const char *extra)
{
    double wall = (now() - t.wall) / n, used = (cpu() - t.cpu) / n;
    double ops = counted ? (double)(rp_cost_operations(counted) - t.ops) / n : 0;
    char ops_text[96] = "";
    if (ops > 0)
        snprintf(ops_text, sizeof ops_text, "; %.0f counted operations each, %.0f million per CPU second", ops,
                 ops / used / 1e6);
    printf("  %-16s %9.1f us wall, %9.1f us CPU (%.0f per CPU second)%s%s\n", name, wall * 1e6, used * 1e6, 1 / used,
           ops_text, extra ? extra : "");
}

/* Prompt lengths from the bundled Azure conversation trace (ContextTokens), as the
 * reference batch does; a log-normal stand-in if the file cannot be read. */
static int32_t *azure_prompts(int32_t *count)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/examples/data/azure_llm_inference_2023_conv.csv", RP_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    int32_t cap = 8192, n = 0, *out = malloc(cap * sizeof *out);
    char line[512];
    if (!fgets(line, sizeof line, f)) n = 0; /* header */
    while (out && fgets(line, sizeof line, f)) {
        char *comma = strchr(line, ',');
        if (!comma) continue;
        long v = strtol(comma + 1, NULL, 10);
        if (v <= 0) continue;
        if (n == cap) break;
        out[n++] = (int32_t)v;
    }
    fclose(f);
    *count = n;
    return out;
}

/* Routing ids with skewed expert preferences: per layer a popularity order of the
 * experts; per (sequence, layer) a preferred window biased towards popular experts;
 * each token takes 8 consecutive experts of that order, starting in the window three
 * times out of four and anywhere otherwise (so its choices are distinct). */
static void make_routing(const int64_t *cu, uint8_t *ids)
{
    uint8_t order[LAYERS][EXPERTS];
    for (int l = 0; l < LAYERS; l++) {
        for (int e = 0; e < EXPERTS; e++) order[l][e] = (uint8_t)e;
        for (int e = EXPERTS - 1; e > 0; e--) {
            int j = (int)(next_u64() % (uint64_t)(e + 1));
            uint8_t t = order[l][e];
            order[l][e] = order[l][j];
            order[l][j] = t;
        }
    }
    for (int32_t s = 0; s < NUM_SEQS; s++) {
        int32_t pref[LAYERS];
        for (int l = 0; l < LAYERS; l++) {
            uint64_t r = next_u64();
            pref[l] = (int32_t)((r & 127) * ((r >> 7) & 127) / 128);
        }
        for (int64_t t = cu[s]; t < cu[s + 1]; t++) {
            uint64_t r = next_u64();
            for (int l = 0; l < LAYERS; l++, r = r >> 9 | r << 55) {
                int32_t base = (r & 3) ? pref[l] + (int32_t)((r >> 2) & 15) : (int32_t)((r >> 2) & 127);
                uint8_t *out = ids + (t * LAYERS + l) * TOP_K;
                for (int j = 0; j < TOP_K; j++) out[j] = order[l][(base + j) & 127];
            }
        }
    }
}

/* The reference config with the token cap lifted: the scaled batch would otherwise
 * reject many random moves at once and flatter the tries per second. */
static rp_config *reference_config(rp_context *ctx)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/examples/config-reference.json", RP_SOURCE_DIR);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    static char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    char *cap = strstr(text, "\"max_tokens_per_microbatch\": 32768");
    if (cap) memcpy(cap + strlen("\"max_tokens_per_microbatch\": "), "99999", 5);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, text, n, path, &cfg, &err) != RP_OK) {
        fprintf(stderr, "bench_cost: %s\n", err.text);
        return NULL;
    }
    return cfg;
}

int main(void)
{
    rp_context *ctx = NULL;
    rp_error err;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    rp_config *cfg = reference_config(ctx);
    if (!cfg) return 1;

    static int32_t prompt[NUM_SEQS], response[NUM_SEQS];
    int32_t n_azure = 0, *azure = azure_prompts(&n_azure);
    for (int32_t s = 0; s < NUM_SEQS; s++) {
        if (s % GROUP == 0) {
            int32_t p = azure && n_azure ? azure[next_u64() % (uint64_t)n_azure] : lognormal(1000, 0.8, 1, 8192);
            prompt[s] = (p + LENGTH_SCALE - 1) / LENGTH_SCALE;
        } else {
            prompt[s] = prompt[s - 1];
        }
        response[s] = (lognormal(2000, 1.0, 1, 20480) + LENGTH_SCALE - 1) / LENGTH_SCALE;
    }
    free(azure);
    rp_batch *batch = NULL;
    if (rp_batch_new(ctx, NUM_SEQS, prompt, response, NULL, &batch, &err) != RP_OK) return 1;
    int64_t tokens = rp_batch_num_tokens(batch);
    uint8_t *ids = malloc((size_t)tokens * LAYERS * TOP_K);
    if (!ids) {
        fprintf(stderr, "bench_cost: no memory for %lld tokens of routing\n", (long long)tokens);
        return 1;
    }
    double t0 = now();
    make_routing(rp_batch_cu_seqlens(batch), ids);
    double t_gen = now() - t0;
    rp_routing routing;
    rp_routing_packed(&routing, RP_ID_U8, LAYERS, TOP_K, ids);
    rp_stats *stats = NULL;
    t0 = now();
    if (rp_stats_compute(ctx, batch, &routing, EXPERTS, 0, &stats, &err) != RP_OK) {
        fprintf(stderr, "bench_cost: %s\n", err.text);
        return 1;
    }
    double t_stats = now() - t0;
    free(ids);

    printf("bench_cost: reference scale, lengths scaled by 1/%d: %d sequences, %lld tokens "
           "(routing made in %.2f s, statistics in %.2f s, %.1f MB)\n",
           LENGTH_SCALE, NUM_SEQS, (long long)tokens, t_gen, t_stats, rp_stats_bytes(stats) / 1e6);
    printf("  prompts from the Azure conversation trace, responses log-normal (median 2000, sigma 1, cap 20480), "
           "groups of %d, all scaled; synthetic skewed routing; token cap lifted\n", GROUP);

    /* round-robin packing, contiguous placement */
    rp_plan *plan = NULL;
    if (rp_plan_new(ctx, cfg, MICROBATCHES, &plan, &err) != RP_OK) return 1;
    static int32_t rank[NUM_SEQS], mb[NUM_SEQS];
    for (int32_t s = 0; s < NUM_SEQS; s++) {
        rank[s] = s % GPUS;
        mb[s] = (s / GPUS) % MICROBATCHES;
    }
    if (rp_plan_set_packing(plan, NUM_SEQS, rank, mb, &err) != RP_OK ||
        rp_plan_set_contiguous(plan, &err) != RP_OK) {
        fprintf(stderr, "bench_cost: %s\n", err.text);
        return 1;
    }
    rp_cost *cost = NULL;
    if (rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK) {
        fprintf(stderr, "bench_cost: %s\n", err.text);
        return 1;
    }
    rp_cost_summary sum;
    t0 = now();
    if (rp_cost_evaluate(cost, plan, &sum, &err) != RP_OK) {
        fprintf(stderr, "bench_cost: %s\n", err.text);
        return 1;
    }
    double t_first = now() - t0;
    int reps = 5;
    printf("  plan: %d GPUs x %d microbatches, contiguous placement, round-robin packing\n", GPUS, MICROBATCHES);
    static const char *sides[4] = {"attention", "dispatch", "expert", "combine"};
    printf("  step %.4f s, lower bound %.4f s, ratio %.3f; attention %.4f, dispatch %.4f, experts %.4f, "
           "combine %.4f s; straggler GPU %d mb %d layer %d (%s)\n",
           sum.step_s, sum.lower_bound_s, sum.ratio, sum.attention_s, sum.dispatch_s, sum.expert_s, sum.combine_s,
           sum.straggler_gpu, sum.straggler_mb, sum.straggler_layer, sides[sum.straggler_side & 3]);
    printf("  the first evaluation, which also fills the bound's per-sequence cache: %.1f ms wall\n", t_first * 1e3);
    counted = cost;
    timer t = start();
    for (int i = 0; i < reps; i++) rp_cost_evaluate(cost, plan, &sum, &err);
    report("full evaluation", t, reps, NULL);
    printf("  evaluator memory: %.1f MB\n", rp_cost_bytes(cost) / 1e6);

    int n_try = 3000, finite = 0;
    double checksum = 0;
    char note[128];
    t = start();
    for (int i = 0; i < n_try; i++) {
        double v = rp_cost_try_move(cost, (int32_t)(next_u64() % NUM_SEQS), (int32_t)(next_u64() % GPUS),
                                    (int32_t)(next_u64() % MICROBATCHES));
        if (isfinite(v)) finite++, checksum += v;
    }
    snprintf(note, sizeof note, "; %d of %d finite", finite, n_try);
    report("try_move", t, n_try, note);

    t = start();
    for (int i = 0; i < n_try; i++)
        checksum += rp_cost_try_swap(cost, (int32_t)(next_u64() % NUM_SEQS), (int32_t)(next_u64() % NUM_SEQS));
    report("try_swap", t, n_try, NULL);

    /* slots: put a random expert into an empty (spare) slot */
    int32_t total_slots = rp_plan_total_slots(plan), spare[1024], n_spare = 0;
    const int32_t *row = rp_plan_phy2log(plan, 0);
    for (int32_t k = 0; k < total_slots && n_spare < 1024; k++)
        if (row[k] < 0) spare[n_spare++] = k;
    int n_slot = 300;
    if (n_spare > 0) {
        t = start();
        for (int i = 0; i < n_slot; i++)
            checksum += rp_cost_try_slot(cost, (int32_t)(next_u64() % LAYERS), spare[next_u64() % (uint64_t)n_spare],
                                         (int32_t)(next_u64() % EXPERTS));
        report("try_slot", t, n_slot, " (a spare slot gets a replica)");
    }

    int n_apply = 1000, applied = 0;
    t = start();
    for (int i = 0; i < n_apply; i++)
        if (rp_cost_apply_move(cost, plan, (int32_t)(next_u64() % NUM_SEQS), (int32_t)(next_u64() % GPUS),
                               (int32_t)(next_u64() % MICROBATCHES), &err) == RP_OK)
            applied++;
    snprintf(note, sizeof note, "; %d applied", applied);
    report("apply_move", t, n_apply, note);

    /* the incremental state against a fresh evaluation of the changed plan */
    double incremental = rp_cost_current_s(cost);
    rp_cost *fresh = NULL;
    counted = NULL;
    rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &fresh, &err);
    rp_cost_evaluate(fresh, plan, &sum, &err);
    printf("  after %d applied moves: incremental step %.17g s, full evaluation %.17g s (relative gap %.1e)\n",
           applied, incremental, sum.step_s, fabs(incremental - sum.step_s) / sum.step_s);
    printf("  (checksum %.6g)\n", checksum);

    /* The baseline planners users compare against, timed on the same batch. */
    printf("  baseline planners (statistics already computed; 5 runs each):\n");
    const char *const *names = rp_baseline_names();
    for (int i = 0; names[i]; i++) {
        rp_plan *baseline = NULL;
        timer tb = start();
        rp_status st = RP_OK;
        for (int rep = 0; rep < 5 && st == RP_OK; rep++) {
            rp_plan_free(baseline);
            baseline = NULL;
            st = rp_baseline_plan(ctx, cfg, batch, stats, NULL, names[i], 0, &baseline, &err);
        }
        if (st != RP_OK) {
            printf("    %-22s failed: %s\n", names[i], err.text);
            continue;
        }
        rp_cost_summary bsum;
        char extra[96] = "";
        if (rp_cost_evaluate(fresh, baseline, &bsum, &err) == RP_OK)
            snprintf(extra, sizeof extra, "; step/LB %.3f", bsum.ratio);
        report(names[i], tb, 5, extra);
        rp_plan_free(baseline);
    }

    rp_cost_free(fresh);
    rp_cost_free(cost);
    rp_plan_free(plan);
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(cfg);
    rp_context_free(ctx);
    return 0;
}
