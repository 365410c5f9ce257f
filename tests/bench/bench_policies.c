/* The evidence for the joint policy: baselines, the two halves of the joint planner
 * and the joint planner on batches generated from the real data (OLMoE C4 and Tulu
 * routing counts, Azure prompt lengths, capped log-normal responses) at three scales,
 * several consecutive steps with routing drift, and a sweep of specialization. Prints
 * step / lower bound, speedups, where the imbalance lives, plan time and migration;
 * optionally markdown tables, a CSV and an SVG chart (docs/results.md). Figures only;
 * nothing is asserted. Run with --help. */
#include "routepack/routepack.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- setup --------------------------------------------------------------------------- */

typedef struct scale {
    const char *name;
    const char *configs[2];   /* evaluated on the same batches */
    const char *config_names[2];
    int32_t layers, experts, prompts, group;
    double prompt_scale, response_median;
    int32_t response_cap;
    int64_t cap_override;     /* > 0: the config's token cap is replaced (lengths scaled) */
    const char *note;
} scale;

static const scale scales[] = {
    {"small", {"config-small.json", NULL}, {"OLMoE-like, 8 GPUs, EP 8", NULL}, 16, 64, 64, 8, 1.0, 1000, 8192, 0,
     NULL},
    {"reference", {"config-reference.json", NULL}, {"Qwen3-30B-A3B-like, 64 GPUs, EP 8 in-node", NULL}, 48, 128, 512,
     8, 1.0, 2000, 20480, 0, NULL},
    {"large", {"config-large.json", "config-large-ep8.json"},
     {"GLM-4.5-Air-like, 256 GPUs, EP 64 across 8 nodes", "GLM-4.5-Air-like, 256 GPUs, EP 8 in-node"}, 45, 128, 512, 8,
     0.25, 500, 5120, 8192,
     "lengths (prompts x 0.25, responses median 500, cap 5120) and the microbatch cap (8192) are scaled by 1/4: the "
     "full batch (about 13M tokens, 6 G routing ids) is too big to generate quickly on a 2-core, 24 GiB machine"},
};

typedef struct batch_spec {
    const char *domain;   /* mix, c4, tulu */
    double sigma, concentration;
    int32_t steps;
} batch_spec;

/* The benchmark's batches at every scale: a sweep of response-length spread with two
 * consecutive steps (routing drift), each routing profile on its own, and a sweep of
 * specialization. */
static const batch_spec default_batches[] = {
    {"mix", 0.6, 8, 2}, {"mix", 1.0, 8, 2}, {"mix", 1.4, 8, 2}, {"c4", 1.0, 8, 1},
    {"tulu", 1.0, 8, 1}, {"mix", 1.0, 2, 1}, {"mix", 1.0, 32, 1}, {"mix", 1.0, 128, 1},
};

enum { POLICIES = 7 };
static const char *const policy_names[POLICIES] = {
    "token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb", "placement-only", "packing-only", "joint",
};
enum { BASE_CONTIG, BASE_TOKEN, BASE_VERL, BASE_ATTN, ABL_PLACE, ABL_PACK, JOINT };

typedef struct figures {
    double step_s, lb_s, ratio, plan_ms, migration_s, migration_bytes;
    double attn_excess, expert_excess, dispatch_excess; /* step seconds above a perfect spread */
    int32_t straggler[3];                               /* (mb, layer) decided by attention, dispatch, expert */
    int32_t microbatches;
} figures;

typedef struct row {
    char scale[16], config[64], domain[8];
    double sigma, concentration, specialization;
    int32_t step, seqs;
    int64_t tokens;
    figures f[POLICIES];
    double joint_build_ms, stats_pass_ms, joint_candidate_s;
    double build_step_s, build_migration_s; /* the construction alone's plan, scored */
    char chosen[32];
} row;

static row *rows;
static int32_t num_rows, cap_rows;

static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void die(const char *what, const rp_error *err)
{
    fprintf(stderr, "bench_policies: %s: %s\n", what, err ? err->text : "");
    exit(1);
}

/* --execution: members put into every config's "execution" object (added when the
 * config has none; a member the config already sets is a duplicate key, refused by the
 * config reader). */
static const char *execution_members = NULL;

static rp_config *load_config(rp_context *ctx, const char *file, int64_t cap_override)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/examples/%s", RP_SOURCE_DIR, file);
    FILE *f = fopen(path, "rb");
    if (!f) die(path, NULL);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    if (cap_override > 0) {
        char *at = strstr(text, "\"max_tokens_per_microbatch\": ");
        if (!at) die("no token cap to scale in the config", NULL);
        at += strlen("\"max_tokens_per_microbatch\": ");
        char *end = at;
        while (*end >= '0' && *end <= '9') end++;
        char tail[1 << 16];
        snprintf(tail, sizeof tail, "%s", end);
        snprintf(at, sizeof text - (size_t)(at - text), "%lld%s", (long long)cap_override, tail);
    }
    if (execution_members) {
        char *section = strstr(text, "\"execution\"");
        char *open = section ? strchr(section, '{') : strchr(text, '{');
        if (!open) die("--execution: the config is not a JSON object", NULL);
        char tail[1 << 16];
        snprintf(tail, sizeof tail, "%s", open + 1);
        if (section)
            snprintf(open + 1, sizeof text - (size_t)(open + 1 - text), "%s, %s", execution_members, tail);
        else
            snprintf(open + 1, sizeof text - (size_t)(open + 1 - text), "\"execution\": {%s}, %s", execution_members,
                     tail);
    }
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, text, strlen(text), path, &cfg, &err) != RP_OK) die("config", &err);
    return cfg;
}

static rp_gen *make_gen(rp_context *ctx, const scale *sc, const batch_spec *b, uint64_t seed, int32_t prompts,
                        int threads)
{
    char domains[64];
    if (!strcmp(b->domain, "c4")) snprintf(domains, sizeof domains, "{\"c4\": 1}");
    else if (!strcmp(b->domain, "tulu")) snprintf(domains, sizeof domains, "{\"tulu\": 1}");
    else snprintf(domains, sizeof domains, "{\"c4\": 0.5, \"tulu\": 0.5}");
    char json[4096];
    snprintf(json, sizeof json,
             "{\"seed\": %llu, \"num_prompts\": %d, \"group_size\": %d, \"threads\": %d,"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": 8},"
             " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"allenai/OLMoE-1B-7B-0924\","
             "  \"domains\": %s, \"concentration\": %g, \"drift\": 0.02},"
             " \"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\", \"column\": \"ContextTokens\"},"
             "  \"prompt_scale\": %g, \"prompt_cap\": %d,"
             "  \"response\": {\"lognormal\": {\"median\": %g, \"sigma\": %g}, \"cap\": %d}}}",
             (unsigned long long)seed, prompts, sc->group, threads, sc->layers, sc->experts, domains, b->concentration,
             sc->prompt_scale, sc->response_cap, sc->response_median, b->sigma, sc->response_cap);
    rp_gen *g = NULL;
    rp_error err;
    if (rp_gen_parse(ctx, json, strlen(json), "<bench>", RP_SOURCE_DIR "/examples", &g, &err) != RP_OK)
        die("generator settings", &err);
    return g;
}

/* Specialization as measured: over sequences of at least 256 tokens, the mean of the
 * largest expert count over the mean count at the middle layer (E / k at most). */
static double specialization(const rp_batch *b, const rp_stats *st)
{
    int32_t E = rp_stats_num_experts(st), L = rp_stats_num_layers(st), n = rp_batch_num_seqs(b);
    uint32_t *h = malloc((size_t)E * sizeof *h);
    double sum = 0;
    int32_t count = 0;
    for (int32_t s = 0; s < n; s++) {
        if (rp_batch_seq_len(b, s) < 256) continue;
        rp_stats_seq_hist(st, s, L / 2, h);
        double total = 0, top = 0;
        for (int32_t e = 0; e < E; e++) {
            total += h[e];
            top = h[e] > top ? h[e] : top;
        }
        if (total > 0) {
            sum += top / (total / E);
            count++;
        }
    }
    free(h);
    return count ? sum / count : NAN;
}

/* Where a plan's time goes beyond a perfect spread of the same work over the GPUs. */
static void breakdown(const rp_config *cfg, rp_cost *cost, const rp_plan *p, figures *f)
{
    const int32_t M = rp_plan_num_microbatches(p), L = rp_plan_num_layers(p), G = rp_plan_num_gpus(p);
    const double fb = 1.0 + rp_config_hardware(cfg)->backward.experts;
    const double *A = rp_cost_attention_breakdown(cost), *X = rp_cost_expert_breakdown(cost),
                 *D = rp_cost_dispatch_breakdown(cost);
    double ea = 0, ex = 0, ed = 0;
    f->straggler[0] = f->straggler[1] = f->straggler[2] = 0;
    for (int32_t m = 0; m < M; m++) {
        double sum = 0, mx = 0;
        for (int32_t g = 0; g < G; g++) {
            sum += A[(size_t)g * M + m];
            mx = A[(size_t)g * M + m] > mx ? A[(size_t)g * M + m] : mx;
        }
        ea += L * (mx - sum / G);
        for (int32_t l = 0; l < L; l++) {
            const double *x = X + ((size_t)m * L + l) * G, *d = D + ((size_t)m * L + l) * G;
            double sx = 0, mxx = 0, sd = 0, mxd = 0;
            for (int32_t g = 0; g < G; g++) {
                sx += x[g];
                sd += d[g];
                mxx = x[g] > mxx ? x[g] : mxx;
                mxd = d[g] > mxd ? d[g] : mxd;
            }
            ex += mxx - sx / G;
            ed += 2 * (mxd - sd / G);
            int32_t gpu;
            rp_side side = rp_cost_layer_straggler(cost, m, l, &gpu);
            f->straggler[side == RP_SIDE_ATTENTION ? 0 : side == RP_SIDE_EXPERT ? 2 : 1]++;
        }
    }
    f->attn_excess = fb * ea;
    f->expert_excess = fb * ex;
    f->dispatch_excess = fb * ed;
    f->microbatches = M;
}

static void score(rp_context *ctx, const rp_config *cfg, rp_cost *cost, const rp_plan *p, const rp_plan *prev,
                  figures *f)
{
    rp_cost_summary s;
    rp_error err;
    if (rp_cost_evaluate(cost, p, &s, &err) != RP_OK) die("evaluate", &err);
    f->step_s = s.step_s;
    f->lb_s = s.lower_bound_s;
    f->ratio = s.ratio;
    breakdown(cfg, cost, p, f);
    f->migration_s = f->migration_bytes = 0;
    if (prev && rp_cost_migration(cost, prev, p, &f->migration_s, &f->migration_bytes, &err) != RP_OK)
        die("migration", &err);
    (void)ctx;
}

/* ---- one batch ---------------------------------------------------------------------- */

typedef struct run_opts {
    bool tradeoff_done, want_tradeoff;
    int64_t refine;
    int32_t repeat; /* the joint construction is timed this many times; the least counts */
    const char *cache_dir; /* --stats-cache: batches and statistics kept between runs */
} run_opts;

/* --stats-cache DIR: a generated step's batch (lengths, group ids) and its serialised
 * statistics in one file a step, named by every setting that decides them, so a later
 * run (a --scores-against comparison) skips the generation and the statistics pass, which
 * take most of a reference-scale run. A file that is not there or does not read whole is
 * generated again; one from an older generator is not detected (empty the folder when
 * the generator or its data change). Layout: "RPBC1\n", i32 n, n x (prompt, response,
 * group) i32, u64 byte count, the statistics (rp_stats_serialize). */
static void cache_path(char *path, size_t size, const char *dir, const scale *sc, const batch_spec *bs,
                       uint64_t seed, int32_t prompts, int32_t step)
{
    snprintf(path, size, "%s/%s-%s-sigma%g-conc%g-steps%d-seed%llu-prompts%d-step%d.rpbc", dir, sc->name, bs->domain,
             bs->sigma, bs->concentration, bs->steps, (unsigned long long)seed, prompts, step);
}

static bool cache_load(rp_context *ctx, const char *path, rp_batch **b, rp_stats **st)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char magic[6];
    int32_t n = -1;
    uint64_t len = 0;
    int32_t *rows = NULL, *cols = NULL;
    unsigned char *bytes = NULL;
    bool good = fread(magic, 1, 6, f) == 6 && !memcmp(magic, "RPBC1\n", 6) && fread(&n, sizeof n, 1, f) == 1 && n >= 0 &&
                (rows = malloc(sizeof *rows * 3 * ((size_t)n + 1))) && (cols = malloc(sizeof *cols * 3 * ((size_t)n + 1))) &&
                fread(rows, sizeof *rows * 3, (size_t)n, f) == (size_t)n && fread(&len, sizeof len, 1, f) == 1 && len > 0 &&
                (bytes = malloc(len)) && fread(bytes, 1, len, f) == len;
    fclose(f);
    if (good) {
        /* rows of (prompt, response, group) to the three arrays rp_batch_new takes */
        for (int32_t i = 0; i < n; i++)
            for (int k = 0; k < 3; k++) cols[(size_t)k * n + i] = rows[3 * (size_t)i + k];
        rp_error err;
        good = rp_batch_new(ctx, n, cols, cols + n, cols + 2 * (size_t)n, b, &err) == RP_OK &&
               rp_stats_deserialize(ctx, bytes, len, st, &err) == RP_OK;
        if (!good) {
            rp_batch_free(*b);
            *b = NULL;
        }
    }
    free(rows);
    free(cols);
    free(bytes);
    return good;
}

static void cache_store(const char *path, const rp_batch *b, const rp_stats *st)
{
    const int32_t n = rp_batch_num_seqs(b);
    const int32_t *pl = rp_batch_prompt_lens(b), *rl = rp_batch_response_lens(b), *gid = rp_batch_group_ids(b);
    const uint64_t len = rp_stats_serialized_bytes(st);
    unsigned char *bytes = malloc(len);
    rp_error err;
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = bytes && rp_stats_serialize(st, bytes, len, &err) == RP_OK ? fopen(tmp, "wb") : NULL;
    bool good = f && fwrite("RPBC1\n", 1, 6, f) == 6 && fwrite(&n, sizeof n, 1, f) == 1;
    for (int32_t i = 0; good && i < n; i++) {
        int32_t t[3] = {pl[i], rl[i], gid ? gid[i] : i};
        good = fwrite(t, sizeof t, 1, f) == 1;
    }
    good = good && fwrite(&len, sizeof len, 1, f) == 1 && fwrite(bytes, 1, len, f) == len;
    if (f) good = fclose(f) == 0 && good;
    if (good) rename(tmp, path); /* whole or not at all */
    else if (f) remove(tmp);
    free(bytes);
}

static void tradeoff(rp_context *ctx, const rp_config *cfg, const rp_batch *b, const rp_stats *st, rp_cost *cost,
                     const char *label)
{
    static const char *const none[] = {NULL};
    struct {
        const char *name;
        int32_t rounds, extra;
        bool shares;
        int64_t balance, refine;
        bool fallbacks;
    } v[] = {
        {"packing + EPLB-style placement (no statistics pass)", 0, 0, false, 0, 0, false},
        {"+ per-microbatch placement search (4 rounds)", 4, 0, false, 0, 0, false},
        {"+ shares and extra replicas (the default construction)", 4, 1, true, 0, 0, false},
        {"+ 4000 profile trades between EP groups", 4, 1, true, 4000, 0, false},
        {"+ 200 exact local-search tries", 4, 1, true, 0, 200, false},
        {"+ 1000 exact local-search tries", 4, 1, true, 0, 1000, false},
        {"default + fallback check against 4 baselines", 4, 1, true, 0, 0, true},
    };
    printf("\n  plan time vs quality (%s):\n", label);
    printf("    %-58s %10s %10s %10s\n", "setting", "CPU ms", "step s", "step/LB");
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        rp_joint_params par = rp_joint_defaults();
        par.place_rounds = v[i].rounds;
        par.max_extra_per_rank = v[i].extra;
        par.shares = v[i].shares;
        par.balance_evaluations = v[i].balance;
        par.refine_evaluations = v[i].refine;
        par.fallbacks = v[i].fallbacks ? NULL : none;
        rp_plan *p = NULL;
        rp_error err;
        double t0 = cpu_ms();
        if (rp_joint_plan(ctx, cfg, b, st, NULL, cost, &par, &p, NULL, &err) != RP_OK) die("joint", &err);
        double t1 = cpu_ms();
        rp_cost_summary s;
        if (rp_cost_evaluate(cost, p, &s, &err) != RP_OK) die("evaluate", &err);
        printf("    %-58s %10.1f %10.4f %10.4f\n", v[i].name, t1 - t0, s.step_s, s.ratio);
        rp_plan_free(p);
    }
}

static void run_batch(rp_context *ctx, const scale *sc, const batch_spec *bs, uint64_t seed, int32_t prompts,
                      int threads, run_opts *opts)
{
    int32_t nconf = sc->configs[1] ? 2 : 1;
    rp_config *cfgs[2] = {NULL, NULL};
    for (int32_t c = 0; c < nconf; c++) cfgs[c] = load_config(ctx, sc->configs[c], sc->cap_override);
    rp_gen *g = make_gen(ctx, sc, bs, seed, prompts, threads);
    rp_plan *prev[2][POLICIES];
    /* the expert loads the shipped policy expects from its history: the mean of the past
     * steps' normalised loads (policies/routepack.lua); NULL on the first step */
    double *expected = NULL, *history = calloc((size_t)sc->layers * sc->experts, sizeof *history);
    memset(prev, 0, sizeof prev);
    for (int32_t step = 0; step < bs->steps; step++) {
        rp_batch *b = NULL;
        rp_routing r;
        rp_error err;
        double t0 = cpu_ms();
        rp_stats *st = NULL;
        char path[1024];
        if (opts->cache_dir) cache_path(path, sizeof path, opts->cache_dir, sc, bs, seed, prompts, step);
        if (!opts->cache_dir || !cache_load(ctx, path, &b, &st)) {
            if (rp_gen_step(g, step, &b, &r, &err) != RP_OK) die("generate", &err);
            if (rp_stats_compute(ctx, b, &r, sc->experts, threads, &st, &err) != RP_OK) die("statistics", &err);
            if (opts->cache_dir) cache_store(path, b, st);
        }
        double spec = specialization(b, st);
        fprintf(stderr, "  [%s %s sigma %.1f concentration %g step %d: %d sequences, %lld tokens, generated in %.0f s CPU]\n",
                sc->name, bs->domain, bs->sigma, bs->concentration, step, rp_batch_num_seqs(b),
                (long long)rp_batch_num_tokens(b), (cpu_ms() - t0) / 1e3);
        for (int32_t c = 0; c < nconf; c++) {
            const rp_config *cfg = cfgs[c];
            if (num_rows == cap_rows) {
                cap_rows = cap_rows ? 2 * cap_rows : 64;
                rows = realloc(rows, (size_t)cap_rows * sizeof *rows);
            }
            row *w = &rows[num_rows++];
            memset(w, 0, sizeof *w);
            snprintf(w->scale, sizeof w->scale, "%s", sc->name);
            snprintf(w->config, sizeof w->config, "%s", sc->configs[c]);
            snprintf(w->domain, sizeof w->domain, "%s", bs->domain);
            w->sigma = bs->sigma;
            w->concentration = bs->concentration;
            w->specialization = spec;
            w->step = step;
            w->seqs = rp_batch_num_seqs(b);
            w->tokens = rp_batch_num_tokens(b);
            rp_cost *cost = NULL;
            if (rp_cost_new(ctx, cfg, b, st, RP_SPLIT_EVEN, &cost, &err) != RP_OK) die("cost", &err);
            rp_plan *plans[POLICIES] = {NULL};
            for (int32_t k = 0; k < POLICIES; k++) {
                double ts = cpu_ms();
                if (k <= BASE_ATTN) {
                    if (rp_baseline_plan(ctx, cfg, b, st, prev[c][k], policy_names[k], 0, &plans[k], &err) != RP_OK)
                        die(policy_names[k], &err);
                } else {
                    static const char *const none[] = {NULL};
                    rp_joint_params par = rp_joint_defaults();
                    par.refine_evaluations = opts->refine;
                    par.expected_loads = expected;
                    if (k == ABL_PLACE) par.pack = false;
                    if (k == ABL_PACK) par.place = false;
                    if (k != JOINT) par.fallbacks = none;
                    rp_joint_report rep;
                    if (rp_joint_plan(ctx, cfg, b, st, prev[c][k], cost, &par, &plans[k], &rep, &err) != RP_OK)
                        die(policy_names[k], &err);
                    if (k == JOINT) {
                        snprintf(w->chosen, sizeof w->chosen, "%s", rep.chosen);
                        w->joint_candidate_s = rep.joint_step_s;
                    }
                }
                w->f[k].plan_ms = cpu_ms() - ts;
                score(ctx, cfg, cost, plans[k], prev[c][k], &w->f[k]);
            }
            /* the joint construction alone (no fallback check, no evaluation), and the one
             * statistics pass it contains, timed on the same packing */
            {
                static const char *const none[] = {NULL};
                rp_joint_params par = rp_joint_defaults();
                par.fallbacks = none;
                par.expected_loads = expected;
                rp_plan *p = NULL;
                w->joint_build_ms = INFINITY;
                for (int32_t r = 0; r < opts->repeat; r++) {
                    rp_plan_free(p);
                    double ts = cpu_ms();
                    if (rp_joint_plan(ctx, cfg, b, st, prev[c][JOINT], cost, &par, &p, NULL, &err) != RP_OK)
                        die("joint", &err);
                    w->joint_build_ms = fmin(w->joint_build_ms, cpu_ms() - ts);
                }
                const rp_topology *t = rp_config_topology(cfg);
                int32_t n = rp_batch_num_seqs(b), M = rp_plan_num_microbatches(p), Q = t->num_gpus / t->ep_size;
                int32_t *cell = malloc((size_t)n * sizeof *cell);
                int64_t *loads = malloc((size_t)M * Q * sc->layers * sc->experts * sizeof *loads);
                for (int32_t s = 0; s < n; s++)
                    cell[s] = rp_plan_seq_microbatch(p, s) * Q + rp_plan_seq_rank(p, s) / t->ep_size;
                double ts = cpu_ms();
                if (rp_stats_microbatch_loads(st, cell, M * Q, loads, &err) != RP_OK) die("loads", &err);
                w->stats_pass_ms = cpu_ms() - ts;
                free(cell);
                free(loads);
                figures bf;
                score(ctx, cfg, cost, p, prev[c][JOINT], &bf);
                w->build_step_s = bf.step_s;
                w->build_migration_s = bf.migration_s;
                rp_plan_free(p);
            }
            if (opts->want_tradeoff && !opts->tradeoff_done && step == 0) {
                char label[160];
                snprintf(label, sizeof label, "%s, %s, %s sigma %.1f concentration %g", sc->name, sc->configs[c],
                         bs->domain, bs->sigma, bs->concentration);
                tradeoff(ctx, cfg, b, st, cost, label);
                opts->tradeoff_done = true;
            }
            /* print */
            const figures *base = &w->f[BASE_TOKEN];
            printf("\n%s | %s | %s sigma %.1f concentration %g (measured specialization %.2f) | step %d | %d seqs, "
                   "%lld tokens | %d microbatches (joint %d)\n",
                   sc->name, sc->config_names[c], bs->domain, bs->sigma, bs->concentration, spec, step, w->seqs,
                   (long long)w->tokens, base->microbatches, w->f[JOINT].microbatches);
            printf("  %-20s %9s %8s %8s %9s %9s %9s %8s %9s %10s %8s\n", "policy", "step s", "step/LB", "speedup",
                   "attn+ s", "disp+ s", "exp+ s", "a/d/x", "plan ms", "migr. GB", "migr. s");
            for (int32_t k = 0; k < POLICIES; k++) {
                const figures *f = &w->f[k];
                char sides[32];
                snprintf(sides, sizeof sides, "%d/%d/%d", f->straggler[0], f->straggler[1], f->straggler[2]);
                printf("  %-20s %9.4f %8.4f %8.4f %9.4f %9.4f %9.4f %8s %9.1f %10.3f %8.4f\n", policy_names[k],
                       f->step_s, f->ratio, base->step_s / f->step_s, f->attn_excess, f->dispatch_excess, f->expert_excess,
                       sides, f->plan_ms, f->migration_bytes / 1e9, f->migration_s);
            }
            printf("  joint: chose %s (its own candidate %.4f s); construction %.1f ms CPU, of which the statistics "
                   "pass %.1f ms\n",
                   w->chosen, w->joint_candidate_s, w->joint_build_ms, w->stats_pass_ms);
            fflush(stdout);
            for (int32_t k = 0; k < POLICIES; k++) {
                rp_plan_free(prev[c][k]);
                prev[c][k] = plans[k];
            }
            rp_cost_free(cost);
        }
        /* this step joins the history the next step's joint plans expect */
        for (int32_t l = 0; l < sc->layers; l++) {
            const int64_t *load = rp_stats_expert_load(st, l);
            double total = 0;
            for (int32_t e = 0; e < sc->experts; e++) total += (double)load[e];
            for (int32_t e = 0; e < sc->experts && total > 0; e++)
                history[(size_t)l * sc->experts + e] += (double)load[e] / total;
        }
        expected = history;
        rp_stats_free(st);
        rp_batch_free(b);
    }
    for (int32_t c = 0; c < nconf; c++) {
        for (int32_t k = 0; k < POLICIES; k++) rp_plan_free(prev[c][k]);
        rp_config_free(cfgs[c]);
    }
    free(history);
    rp_gen_free(g);
}

/* ---- summary, markdown, CSV, SVG ------------------------------------------------------ */

static double best_baseline(const row *w)
{
    double b = INFINITY;
    for (int32_t k = 0; k <= BASE_ATTN; k++) b = w->f[k].step_s < b ? w->f[k].step_s : b;
    return b;
}

static void summary(FILE *out, bool md)
{
    fprintf(out, md ? "\n| scale | config | batches | joint mean step/LB | token_kk+eplb mean step/LB | mean speedup vs "
                      "token_kk+eplb | with migration | min gap closed | speedup where baseline >= 1.15 LB | worst joint / best "
                      "baseline | joint build ms (mean) | of which statistics pass |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                    : "\nSummary\n");
    for (int32_t i = 0; i < num_rows; i++) {
        bool first = true; /* one line per config, in order of appearance */
        for (int32_t k = 0; k < i; k++)
            if (!strcmp(rows[k].config, rows[i].config)) first = false;
        if (!first) continue;
        int32_t n = 0;
        double jr = 0, br = 0, sp = 0, spm = 0, gap_min = INFINITY, worst = 0, build = 0, pass = 0, sp115 = INFINITY;
        for (int32_t k = i; k < num_rows; k++) {
            const row *w = &rows[k];
            if (strcmp(w->config, rows[i].config)) continue;
            const figures *j = &w->f[JOINT], *b = &w->f[BASE_TOKEN];
            n++;
            jr += j->ratio;
            br += b->ratio;
            sp += b->step_s / j->step_s;
            spm += (b->step_s + b->migration_s) / (j->step_s + j->migration_s);
            double gap = (b->step_s - j->step_s) / (b->step_s - b->lb_s);
            gap_min = gap < gap_min ? gap : gap_min;
            double wv = j->step_s / best_baseline(w);
            worst = wv > worst ? wv : worst;
            build += w->joint_build_ms;
            pass += w->stats_pass_ms;
            if (b->ratio >= 1.15) sp115 = fmin(sp115, b->step_s / j->step_s);
        }
        char sp115s[32];
        if (isinf(sp115)) snprintf(sp115s, sizeof sp115s, "(none)");
        else snprintf(sp115s, sizeof sp115s, "min %.3fx", sp115);
        if (md)
            fprintf(out, "| %s | %s | %d | %.3f | %.3f | %.3fx | %.3fx | %.0f%% | %s | %.4f | %.1f | %.1f |\n",
                    rows[i].scale, rows[i].config, n, jr / n, br / n, sp / n, spm / n, 100 * gap_min, sp115s, worst,
                    build / n, pass / n);
        else
            fprintf(out,
                    "  %-9s %-24s %2d batches: joint step/LB %.3f (token_kk+eplb %.3f), speedup %.3fx (%.3fx with "
                    "migration), min gap closed "
                    "%.0f%%, where baseline >= 1.15: %s, worst joint/best baseline %.4f, build %.1f ms (statistics "
                    "pass %.1f ms)\n",
                    rows[i].scale, rows[i].config, n, jr / n, br / n, sp / n, spm / n, 100 * gap_min, sp115s, worst,
                    build / n, pass / n);
    }
}

static void markdown(FILE *out)
{
    fprintf(out, "\n| scale | config | batch | step | spec. | ");
    for (int32_t k = 0; k < POLICIES; k++) fprintf(out, "%s | ", policy_names[k]);
    fprintf(out, "speedup | joint ms | migration token_kk+eplb / joint |\n|---|---|---|---|---|");
    for (int32_t k = 0; k < POLICIES; k++) fprintf(out, "---|");
    fprintf(out, "---|---|---|\n");
    for (int32_t i = 0; i < num_rows; i++) {
        const row *w = &rows[i];
        fprintf(out, "| %s | %s | %s s%.1f c%g | %d | %.2f | ", w->scale, w->config, w->domain, w->sigma,
                w->concentration, w->step, w->specialization);
        for (int32_t k = 0; k < POLICIES; k++) fprintf(out, "%.3f | ", w->f[k].ratio);
        fprintf(out, "%.3fx | %.1f | %.0f GB %.3f s / %.0f GB %.3f s |\n", w->f[BASE_TOKEN].step_s / w->f[JOINT].step_s,
                w->joint_build_ms, w->f[BASE_TOKEN].migration_bytes / 1e9, w->f[BASE_TOKEN].migration_s,
                w->f[JOINT].migration_bytes / 1e9, w->f[JOINT].migration_s);
    }
    /* where the imbalance lives: the ablation */
    fprintf(out, "\nStep seconds above a perfect spread (attention / dispatch+combine / experts), summed over the "
                 "batches of each scale and config:\n\n| scale | config | ");
    for (int32_t k = 0; k < POLICIES; k++) fprintf(out, "%s | ", policy_names[k]);
    fprintf(out, "\n|---|---|");
    for (int32_t k = 0; k < POLICIES; k++) fprintf(out, "---|");
    fprintf(out, "\n");
    for (int32_t i = 0; i < num_rows; i++) {
        bool first = true;
        for (int32_t k = 0; k < i; k++)
            if (!strcmp(rows[k].config, rows[i].config)) first = false;
        if (!first) continue;
        double a[POLICIES] = {0}, d[POLICIES] = {0}, x[POLICIES] = {0};
        for (int32_t k = i; k < num_rows; k++) {
            if (strcmp(rows[k].config, rows[i].config)) continue;
            for (int32_t p = 0; p < POLICIES; p++) {
                a[p] += rows[k].f[p].attn_excess;
                d[p] += rows[k].f[p].dispatch_excess;
                x[p] += rows[k].f[p].expert_excess;
            }
        }
        fprintf(out, "| %s | %s | ", rows[i].scale, rows[i].config);
        for (int32_t p = 0; p < POLICIES; p++) fprintf(out, "%.2f / %.2f / %.2f | ", a[p], d[p], x[p]);
        fprintf(out, "\n");
    }
}

static void csv(FILE *out)
{
    fprintf(out, "scale,config,domain,sigma,concentration,specialization,step,seqs,tokens,policy,step_s,lower_bound_s,"
                 "ratio,speedup_vs_token_kk_eplb,attn_excess_s,dispatch_excess_s,expert_excess_s,plan_ms,"
                 "migration_s,migration_bytes,microbatches\n");
    for (int32_t i = 0; i < num_rows; i++) {
        const row *w = &rows[i];
        for (int32_t k = 0; k < POLICIES; k++) {
            const figures *f = &w->f[k];
            fprintf(out, "%s,%s,%s,%g,%g,%.4f,%d,%d,%lld,%s,%.9g,%.9g,%.6f,%.6f,%.6g,%.6g,%.6g,%.3f,%.6g,%.6g,%d\n",
                    w->scale, w->config, w->domain, w->sigma, w->concentration, w->specialization, w->step, w->seqs,
                    (long long)w->tokens, policy_names[k], f->step_s, f->lb_s, f->ratio,
                    w->f[BASE_TOKEN].step_s / f->step_s, f->attn_excess, f->dispatch_excess, f->expert_excess,
                    f->plan_ms, f->migration_s, f->migration_bytes, f->microbatches);
        }
    }
}

/* The joint construction's own plans' scores, one line a batch: what a faster
 * construction must keep (within 0.5% of step time, issue 16). */
static void scores_out(FILE *out)
{
    fprintf(out, "scale,config,domain,sigma,concentration,step,seqs,tokens,step_s,migration_s\n");
    for (int32_t i = 0; i < num_rows; i++) {
        const row *w = &rows[i];
        fprintf(out, "%s,%s,%s,%g,%g,%d,%d,%lld,%.9g,%.9g\n", w->scale, w->config, w->domain, w->sigma,
                w->concentration, w->step, w->seqs, (long long)w->tokens, w->build_step_s, w->build_migration_s);
    }
}

/* This run's construction scores against a file scores_out wrote (same batches, same
 * cost model): per batch and in sum, step time and step + migration. */
static void scores_against(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) die(path, NULL);
    char line[512];
    double old_step = 0, new_step = 0, old_total = 0, new_total = 0, worst = 0;
    int32_t matched = 0;
    printf("\njoint construction against %s (step s; migration s):\n", path);
    while (fgets(line, sizeof line, f)) {
        char sc[16], config[64], domain[8];
        double sigma, conc, step_s, migr_s;
        int step, seqs;
        long long tokens;
        if (sscanf(line, "%15[^,],%63[^,],%7[^,],%lf,%lf,%d,%d,%lld,%lf,%lf", sc, config, domain, &sigma, &conc, &step,
                   &seqs, &tokens, &step_s, &migr_s) != 10)
            continue; /* the header */
        for (int32_t i = 0; i < num_rows; i++) {
            const row *w = &rows[i];
            char ws[32], wc[32];
            snprintf(ws, sizeof ws, "%g", w->sigma);
            snprintf(wc, sizeof wc, "%g", w->concentration);
            char fs[32], fc[32];
            snprintf(fs, sizeof fs, "%g", sigma);
            snprintf(fc, sizeof fc, "%g", conc);
            if (strcmp(w->scale, sc) || strcmp(w->config, config) || strcmp(w->domain, domain) || strcmp(ws, fs) ||
                strcmp(wc, fc) || w->step != step || w->seqs != seqs || w->tokens != tokens)
                continue;
            double r = w->build_step_s / step_s;
            printf("  %-9s %-22s %-4s sigma %.1f conc %-3g step %d: %.4f -> %.4f s (%+.3f%%); migration %.4f -> %.4f s\n",
                   sc, config, domain, sigma, conc, step, step_s, w->build_step_s, 100 * (r - 1), migr_s,
                   w->build_migration_s);
            old_step += step_s;
            new_step += w->build_step_s;
            old_total += step_s + migr_s;
            new_total += w->build_step_s + w->build_migration_s;
            worst = r - 1 > worst ? r - 1 : worst;
            matched++;
        }
    }
    fclose(f);
    if (!matched) {
        printf("  no batch of this run is in the file\n");
        return;
    }
    printf("  %d batches: step time %+.3f%% in sum, %+.3f%% on the worst batch; step + migration %+.3f%% in sum\n",
           matched, 100 * (new_step / old_step - 1), 100 * worst, 100 * (new_total / old_total - 1));
}

/* Grouped bars: step / lower bound of every policy on every batch. */
static void svg(FILE *out)
{
    static const char *const colors[POLICIES] = {"#bbbbbb", "#8da0cb", "#66c2a5", "#a6d854",
                                                 "#ffd92f", "#e5c494", "#fc8d62"};
    const double bar = 5, gap = 10, left = 60, top = 40, height = 300;
    double width = left + num_rows * (POLICIES * bar + gap) + 20;
    double ymin = 1.0, ymax = 1.0;
    for (int32_t i = 0; i < num_rows; i++)
        for (int32_t k = 0; k < POLICIES; k++) ymax = rows[i].f[k].ratio > ymax ? rows[i].f[k].ratio : ymax;
    ymax = ceil(ymax * 10) / 10;
    fprintf(out, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
                 "font-size=\"10\">\n", width < 700 ? 700 : width, top + height + 150);
    fprintf(out, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(out, "<text x=\"%.0f\" y=\"20\" font-size=\"13\">Step time / lower bound per policy and batch "
                 "(cost model; lower is better)</text>\n", left);
    for (double y = ymin; y <= ymax + 1e-9; y += 0.1) {
        double py = top + height - (y - ymin) / (ymax - ymin) * height;
        fprintf(out, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#e0e0e0\"/>\n", left, py, width - 10,
                py);
        fprintf(out, "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.1f</text>\n", left - 5, py + 3, y);
    }
    double p105 = top + height - (1.05 - ymin) / (ymax - ymin) * height;
    fprintf(out, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"red\" stroke-dasharray=\"4,3\"/>\n",
            left, p105, width - 10, p105);
    fprintf(out, "<text x=\"%.0f\" y=\"%.1f\" fill=\"red\">target 1.05</text>\n", width - 80, p105 - 3);
    for (int32_t i = 0; i < num_rows; i++) {
        double x0 = left + i * (POLICIES * bar + gap) + gap / 2;
        for (int32_t k = 0; k < POLICIES; k++) {
            double r = rows[i].f[k].ratio, h = (r - ymin) / (ymax - ymin) * height;
            fprintf(out, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"><title>%s %s: %.3f</title>"
                         "</rect>\n", x0 + k * bar, top + height - h, bar, h, colors[k], rows[i].config, policy_names[k], r);
        }
        fprintf(out, "<text transform=\"translate(%.1f,%.0f) rotate(60)\">%s s%.1f c%g #%d%s</text>\n",
                x0 + 2, top + height + 8, rows[i].domain, rows[i].sigma, rows[i].concentration, rows[i].step,
                !strcmp(rows[i].config, "config-large-ep8.json") ? " ep8" : "");
    }
    /* scale separators */
    for (int32_t i = 1; i < num_rows; i++)
        if (strcmp(rows[i].config, rows[i - 1].config)) {
            double x = left + i * (POLICIES * bar + gap);
            fprintf(out, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#444\"/>\n", x, top, x,
                    top + height);
        }
    for (int32_t i = 0; i < num_rows; i++)
        if (i == 0 || strcmp(rows[i].config, rows[i - 1].config))
            fprintf(out, "<text x=\"%.1f\" y=\"%.0f\" font-weight=\"bold\">%s</text>\n",
                    left + i * (POLICIES * bar + gap) + 4, top + 12, rows[i].config);
    for (int32_t k = 0; k < POLICIES; k++) {
        double lx = left + (k % 4) * 160, ly = top + height + 110 + (k / 4) * 16;
        fprintf(out, "<rect x=\"%.0f\" y=\"%.0f\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                lx, ly - 9, colors[k], lx + 14, ly, policy_names[k]);
    }
    fprintf(out, "</svg>\n");
}

static void usage(void)
{
    printf("usage: bench_policies [--scale small|reference|large|all] [--domain mix|c4|tulu] [--sigma S]\n"
           "                      [--concentration C] [--steps N] [--prompts N] [--seed S] [--threads N]\n"
           "                      [--refine N] [--repeat N] [--tradeoff] [--markdown FILE] [--csv FILE] [--svg FILE]\n"
           "                      [--execution MEMBERS] [--scores-out FILE] [--scores-against FILE] [--stats-cache DIR]\n"
           "Without --domain/--sigma/--concentration/--steps every scale runs its default batches (a sweep of\n"
           "response spread 0.6/1.0/1.4 over two drifting steps, C4 and Tulu alone, concentration 2/32/128);\n"
           "with any of them, one batch with the given settings (defaults mix, 1.0, 8, 1 step).\n"
           "Default: --scale small. --prompts overrides the scale's prompt count (512 at the reference scale).\n"
           "--tradeoff prints plan time vs quality on the first batch of each scale. --refine adds exact local search to the\n"
           "joint policies. Times are CPU times of this thread; --repeat N (default 3) times the joint construction N\n"
           "times and reports the least, which a shared machine disturbs least.\n"
           "--execution '\"sync\": \"global\", \"overlap\": \"layer\"' adds an execution section to every config.\n"
           "--stats-cache DIR keeps each generated step's batch and statistics in DIR and reads them back on later runs\n"
           "(keyed by the batch settings; empty DIR when the generator changes).\n"
           "--scores-out FILE writes the joint construction's own plans' scores (no fallback check: step s and migration\n"
           "s from the previous joint plan), one line a batch; --scores-against FILE compares this run's with such a\n"
           "file (tests/bench/joint-scores-reference.csv holds the frozen ones), batch by batch and in sum.\n");
}

int main(int argc, char **argv)
{
    const char *scale_arg = "small", *md_path = NULL, *csv_path = NULL, *svg_path = NULL;
    const char *scores_path = NULL, *against_path = NULL;
    batch_spec custom = {"mix", 1.0, 8, 1};
    bool use_custom = false;
    uint64_t seed = 1;
    int32_t prompts = 0, threads = 2;
    run_opts opts = {false, false, 0, 3, NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--tradeoff")) {
            opts.want_tradeoff = true;
        } else if (!v) {
            fprintf(stderr, "bench_policies: %s needs a value\n", a);
            return 2;
        } else if (!strcmp(a, "--scale")) {
            scale_arg = v, i++;
        } else if (!strcmp(a, "--domain")) {
            custom.domain = v, use_custom = true, i++;
        } else if (!strcmp(a, "--sigma")) {
            custom.sigma = atof(v), use_custom = true, i++;
        } else if (!strcmp(a, "--concentration")) {
            custom.concentration = atof(v), use_custom = true, i++;
        } else if (!strcmp(a, "--steps")) {
            custom.steps = atoi(v), use_custom = true, i++;
        } else if (!strcmp(a, "--prompts")) {
            prompts = atoi(v), i++;
        } else if (!strcmp(a, "--seed")) {
            seed = strtoull(v, NULL, 10), i++;
        } else if (!strcmp(a, "--threads")) {
            threads = atoi(v), i++;
        } else if (!strcmp(a, "--refine")) {
            opts.refine = atoll(v), i++;
        } else if (!strcmp(a, "--repeat")) {
            opts.repeat = atoi(v), i++;
            if (opts.repeat < 1) {
                fprintf(stderr, "bench_policies: --repeat needs a count >= 1\n");
                return 2;
            }
        } else if (!strcmp(a, "--markdown")) {
            md_path = v, i++;
        } else if (!strcmp(a, "--csv")) {
            csv_path = v, i++;
        } else if (!strcmp(a, "--svg")) {
            svg_path = v, i++;
        } else if (!strcmp(a, "--execution")) {
            execution_members = v, i++;
        } else if (!strcmp(a, "--scores-out")) {
            scores_path = v, i++;
        } else if (!strcmp(a, "--scores-against")) {
            against_path = v, i++;
        } else if (!strcmp(a, "--stats-cache")) {
            opts.cache_dir = v, i++;
        } else {
            fprintf(stderr, "bench_policies: unknown option %s (--help)\n", a);
            return 2;
        }
    }
    if (custom.steps < 1 || custom.sigma < 0 || !(custom.concentration > 0) ||
        (strcmp(custom.domain, "mix") && strcmp(custom.domain, "c4") && strcmp(custom.domain, "tulu"))) {
        fprintf(stderr, "bench_policies: bad batch settings (--help)\n");
        return 2;
    }
    rp_context *ctx = NULL;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    printf("bench_policies: step time under the cost model (even split; seconds, forward and backward); step/LB is\n"
           "against each plan's own lower bound; speedup is token_kk+eplb's step time over the policy's; attn+, disp+,\n"
           "exp+ are the step seconds each side spends above a perfect spread of its work over the GPUs; a/d/x counts\n"
           "the (microbatch, layer) pairs whose largest term is attention, dispatch or experts; migr. GB: weights and\n"
           "optimizer state moved from the policy's own previous step, and migr. s the time it takes in the cost model\n"
           "(not part of step s; it overlaps nothing).\n");
    for (size_t s = 0; s < sizeof scales / sizeof scales[0]; s++) {
        const scale *sc = &scales[s];
        if (strcmp(scale_arg, "all") && strcmp(scale_arg, sc->name)) continue;
        int32_t np = prompts > 0 ? prompts : sc->prompts;
        printf("\n=== %s scale: %s%s%s; %d prompts x %d responses ===\n", sc->name, sc->config_names[0],
               sc->configs[1] ? " and " : "", sc->configs[1] ? sc->config_names[1] : "", np, sc->group);
        if (sc->note) printf("note: %s\n", sc->note);
        opts.tradeoff_done = false; /* once per scale */
        if (np != sc->prompts) printf("note: prompt count overridden (%d instead of %d)\n", np, sc->prompts);
        if (use_custom) {
            run_batch(ctx, sc, &custom, seed, np, threads, &opts);
        } else {
            for (size_t k = 0; k < sizeof default_batches / sizeof default_batches[0]; k++)
                run_batch(ctx, sc, &default_batches[k], seed + k, np, threads, &opts);
        }
    }
    if (!num_rows) {
        fprintf(stderr, "bench_policies: unknown scale '%s' (small, reference, large, all)\n", scale_arg);
        return 2;
    }
    summary(stdout, false);
    if (md_path) {
        FILE *f = fopen(md_path, "w");
        if (!f) die(md_path, NULL);
        summary(f, true);
        markdown(f);
        fclose(f);
    }
    if (csv_path) {
        FILE *f = fopen(csv_path, "w");
        if (!f) die(csv_path, NULL);
        csv(f);
        fclose(f);
    }
    if (svg_path) {
        FILE *f = fopen(svg_path, "w");
        if (!f) die(svg_path, NULL);
        svg(f);
        fclose(f);
    }
    if (scores_path) {
        FILE *f = fopen(scores_path, "w");
        if (!f) die(scores_path, NULL);
        scores_out(f);
        fclose(f);
    }
    if (against_path) scores_against(against_path);
    free(rows);
    rp_context_free(ctx);
    return 0;
}
