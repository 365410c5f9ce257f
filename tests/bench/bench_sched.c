/* Overhead of the policy engine at the reference scale (examples/config-reference.json,
 * a batch from examples/gen-reference.json): a trivial policy's step (Lua call, merge
 * with the safe default, validation, evaluation) without and with the statistics, the
 * pieces of it, and each shipped policy's plan time and work. Figures only. */
#include "routepack/routepack.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The reference batch has ~13M tokens (5 GB of uint8 ids); lengths are scaled by 1/8
 * here so that it fits a shared machine (~1.6M tokens, ~0.6 GB of ids). */
#define LENGTH_SCALE 8
#define STEPS 4

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static rp_context *ctx;
static rp_config *cfg;
static rp_batch *batches[2];
static rp_routing routings[2];
static void *ids[2];

static void die(const char *what, const rp_error *err)
{
    fprintf(stderr, "bench_sched: %s: %s\n", what, err ? err->text : "");
    exit(1);
}

/* gen-reference.json with its lengths scaled down. */
static rp_gen *load_gen(void)
{
    json_error_t je;
    json_t *root = json_load_file(RP_SOURCE_DIR "/examples/gen-reference.json", 0, &je);
    if (!root) die("gen-reference.json", NULL);
    json_t *lengths = json_object_get(root, "lengths");
    json_object_set_new(lengths, "prompt_scale", json_real(1.0 / LENGTH_SCALE));
    json_t *resp = json_object_get(lengths, "response");
    json_t *ln = json_object_get(json_object_get(resp, "lognormal"), "median");
    double median = json_number_value(ln);
    json_object_set_new(json_object_get(resp, "lognormal"), "median", json_real(median / LENGTH_SCALE));
    json_object_set_new(resp, "cap", json_integer(json_integer_value(json_object_get(resp, "cap")) / LENGTH_SCALE));
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    rp_gen *gen = NULL;
    rp_error err;
    if (rp_gen_parse(ctx, text, strlen(text), "gen-reference.json (lengths / 8)", RP_SOURCE_DIR "/examples", &gen,
                     &err) != RP_OK)
        die("generator", &err);
    free(text);
    return gen;
}

static void time_step(const char *label, const char *policy, bool detail)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) die(policy, &err);
    double wall = 0, used = 0, policy_wall = 0, ratio = 0;
    int64_t work = 0;
    int fallbacks = 0, counted = 0;
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *plan;
        const rp_step_report *rep;
        double w0 = now(), c0 = cpu();
        if (rp_sched_step(s, t, batches[t % 2], &routings[t % 2], &plan, &rep, &err) != RP_OK) die(policy, &err);
        if (t == 0) continue; /* steps with a placement in use */
        wall += now() - w0;
        used += cpu() - c0;
        policy_wall += rep->policy_wall_s;
        work += rep->policy_work;
        ratio += rep->cost.ratio;
        fallbacks += rep->fallback;
        counted++;
        if (detail && t == 1)
            printf("    (plan of step 1: %d microbatches, step %.4f s predicted, ratio %.3f)\n",
                   rp_plan_num_microbatches(plan), rep->cost.step_s, rep->cost.ratio);
    }
    printf("  %-14s %8.1f ms step  %8.1f ms CPU  %7.1f ms policy  %11lld work units  ratio %.3f%s\n", label,
           1e3 * wall / counted, 1e3 * used / counted, 1e3 * policy_wall / counted, (long long)(work / counted),
           ratio / counted, fallbacks ? "  (FELL BACK)" : "");
    rp_sched_free(s);
}

int main(void)
{
    rp_error err;
    rp_context_new(NULL, NULL, &ctx);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-reference.json", &cfg, &err) != RP_OK)
        die("config-reference.json", &err);
    rp_gen *gen = load_gen();
    double g0 = now();
    for (int t = 0; t < 2; t++) {
        rp_routing r;
        if (rp_gen_step(gen, t, &batches[t], &r, &err) != RP_OK) die("generating", &err);
        size_t n = (size_t)rp_batch_num_tokens(batches[t]) * (size_t)r.num_layers * (size_t)r.top_k * (size_t)r.width;
        ids[t] = malloc(n);
        memcpy(ids[t], r.base, n);
        rp_routing_packed(&routings[t], r.width, r.num_layers, r.top_k, ids[t]);
    }
    rp_gen_free(gen);
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *md = rp_config_model(cfg);
    printf("bench_sched: reference scale, %d GPUs (%d nodes, EP %d), %d layers x %d experts, top-%d\n", topo->num_gpus,
           topo->num_nodes, topo->ep_size, md->num_layers, md->num_experts, md->top_k);
    printf("  batch: %d sequences, %lld tokens: gen-reference.json with lengths scaled by 1/%d (the full batch's\n"
           "  ~13M tokens would need 5 GB of routing ids); generated in %.1f s\n",
           rp_batch_num_seqs(batches[0]), (long long)rp_batch_num_tokens(batches[0]), LENGTH_SCALE, now() - g0);
    printf("  times: mean over steps 1..%d (step 0 has no placement in use); CPU counts every thread\n\n", STEPS - 1);

    /* the pieces of a step */
    rp_stats *stats = NULL;
    double w0 = now(), c0 = cpu();
    if (rp_stats_compute(ctx, batches[0], &routings[0], md->num_experts, 0, &stats, &err) != RP_OK)
        die("statistics", &err);
    double stats_wall = now() - w0, stats_cpu = cpu() - c0;
    rp_plan *dflt = NULL;
    w0 = now();
    if (rp_baseline_plan(ctx, cfg, batches[0], stats, NULL, "attn_kk+contiguous", 0, &dflt, &err) != RP_OK)
        die("safe default", &err);
    double dflt_wall = now() - w0;
    w0 = now();
    rp_status vst = rp_plan_validate(dflt, cfg, batches[0], &err);
    double validate_wall = now() - w0;
    rp_cost *cost = NULL;
    rp_cost_summary sum;
    w0 = now();
    if (vst != RP_OK || rp_cost_new(ctx, cfg, batches[0], stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK)
        die("cost", &err);
    double cost_new_wall = now() - w0;
    w0 = now();
    if (rp_cost_evaluate(cost, dflt, &sum, &err) != RP_OK) die("evaluate", &err);
    double eval_wall = now() - w0;
    printf("pieces of a step (one run each):\n");
    printf("  statistics              %8.1f ms wall  %8.1f ms CPU\n", 1e3 * stats_wall, 1e3 * stats_cpu);
    printf("  safe default (attn_kk)  %8.1f ms\n", 1e3 * dflt_wall);
    printf("  validation              %8.1f ms\n", 1e3 * validate_wall);
    printf("  cost model setup        %8.1f ms\n", 1e3 * cost_new_wall);
    printf("  evaluation              %8.1f ms\n\n", 1e3 * eval_wall);
    rp_cost_free(cost);
    rp_plan_free(dflt);
    rp_stats_free(stats);

    /* a trivial policy: the Lua call returns nothing, so the step is the engine alone */
    char path[] = "/tmp/rp_bench_sched_XXXXXX.lua";
    int fd = mkstemps(path, 4);
    if (fd < 0) die("temp file", NULL);
    FILE *f = fdopen(fd, "w");
    fputs("return {name = 'trivial', version = '1.0.0', api = 1, description = 'keeps everything',\n"
          "plan = function(ctx) return nil end}\n",
          f);
    fclose(f);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = path;
    rp_sched *s = NULL;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) die("trivial", &err);
    double step_wall = 0, trivial_policy = 0;
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *plan;
        const rp_step_report *rep;
        w0 = now();
        if (rp_sched_step(s, t, batches[t % 2], &routings[t % 2], &plan, &rep, &err) != RP_OK) die("trivial", &err);
        if (t > 0) step_wall += now() - w0, trivial_policy += rep->policy_wall_s;
    }
    step_wall /= STEPS - 1;
    rp_sched_free(s);
    remove(path);
    printf("trivial policy (returns nil: safe default packing, placement kept):\n");
    printf("  step, statistics included  %8.1f ms\n", 1e3 * step_wall);
    printf("  step, statistics excluded  %8.1f ms\n", 1e3 * (step_wall - stats_wall));
    printf("  the Lua call itself           %8.3f ms\n\n", 1e3 * trivial_policy / (STEPS - 1));

    printf("shipped policies (step: statistics included; policy: its calls alone, report->policy_wall_s):\n");
    time_step("token_kk", "token_kk", false);
    time_step("attn_kk", "attn_kk", false);
    time_step("eplb", "eplb", false);
    time_step("token_kk+eplb", "token_kk+eplb", false);
    time_step("routepack", "routepack", true);

    for (int t = 0; t < 2; t++) {
        rp_batch_free(batches[t]);
        free(ids[t]);
    }
    rp_config_free(cfg);
    rp_context_free(ctx);
    return 0;
}
