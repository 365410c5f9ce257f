/* The calibrated synthetic batch generator: determinism, ids, calibration against the
 * counts file, lengths, specialization, drift, locality, couplings, shape mapping, bad
 * settings, allocation failures and the `routepack trace gen` command. */
#include "gen_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXAMPLES RP_SOURCE_DIR "/examples"
#define COUNTS EXAMPLES "/data/olmoe_expert_counts.json"
#define CSV EXAMPLES "/data/azure_llm_inference_2023_conv.csv"
#define OLMOE "allenai/OLMoE-1B-7B-0924"

static rp_context *ctx;
static char tmpdir[64];

/* ---- helpers ----------------------------------------------------------------------- */

/* Settings text from a template with printf arguments. */
static char *settings(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *settings(const char *fmt, ...)
{
    static char buf[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

static rp_status parse(const char *text, rp_gen **g, rp_error *err)
{
    rp_error_clear(err);
    return rp_gen_parse(ctx, text, strlen(text), "settings.json", EXAMPLES, g, err);
}

static rp_gen *must_parse(const char *text)
{
    rp_gen *g = NULL;
    rp_error err;
    if (parse(text, &g, &err) != RP_OK) {
        diag("settings failed: %s", err.text);
        return NULL;
    }
    return g;
}

/* A small generator: `shape` and `experts` and `lengths` bodies spliced in. */
static char *small_settings(const char *top, const char *shape, const char *experts, const char *lengths)
{
    return settings("{%s\"num_prompts\": 8, \"group_size\": 4, \"model\": {%s},"
                    " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
                    " \"layer_correlation\": 0%s},"
                    " \"lengths\": {%s}}",
                    top, shape, experts, lengths);
}

#define SMALL_LENGTHS "\"prompt\": {\"constant\": 20}, \"response\": {\"lognormal\": {\"median\": 30, \"sigma\": 0.5}, \"cap\": 200}"

static uint64_t hash_step(const rp_batch *b, const rp_routing *r)
{
    int32_t n = rp_batch_num_seqs(b);
    uint64_t h = rp_hash64(rp_batch_prompt_lens(b), (size_t)n * sizeof(int32_t), 1);
    h = rp_hash64(rp_batch_response_lens(b), (size_t)n * sizeof(int32_t), h);
    size_t bytes = (size_t)rp_batch_num_tokens(b) * (size_t)r->num_layers * (size_t)r->top_k * (size_t)r->width;
    return rp_hash64(r->base, bytes, h);
}

static uint64_t step_hash(rp_gen *g, int32_t step)
{
    rp_batch *b;
    rp_routing r;
    rp_error err;
    if (rp_gen_step(g, step, &b, &r, &err) != RP_OK) {
        diag("step %d failed: %s", step, err.text);
        return 0;
    }
    uint64_t h = hash_step(b, &r);
    rp_batch_free(b);
    return h;
}

static int32_t id_at(const rp_routing *r, int64_t t, int32_t l, int32_t j)
{
    return rp_id_load(r->base, r->width, (t * r->num_layers + l) * r->top_k + j);
}

typedef struct skew {
    double cv, max_over_mean;
} skew;

static skew skew_of(const double *v, int32_t n)
{
    double mean = 0, var = 0, top = 0;
    for (int32_t i = 0; i < n; i++) mean += v[i];
    mean /= n;
    for (int32_t i = 0; i < n; i++) {
        var += (v[i] - mean) * (v[i] - mean);
        if (v[i] > top) top = v[i];
    }
    skew s = {sqrt(var / n) / mean, top / mean};
    return s;
}

/* Global expert load of one layer of a step. */
static void layer_load(const rp_batch *b, const rp_routing *r, int32_t layer, int32_t num_experts, double *load)
{
    for (int32_t e = 0; e < num_experts; e++) load[e] = 0;
    int64_t tokens = rp_batch_num_tokens(b);
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t j = 0; j < r->top_k; j++) load[id_at(r, t, layer, j)] += 1;
}

/* A recorded layer's counts straight from the data file. */
static bool source_counts(const char *domain, int32_t layer, double *out)
{
    json_error_t jerr;
    json_t *root = json_load_file(COUNTS, 0, &jerr);
    if (!root) return false;
    char key[16];
    snprintf(key, sizeof key, "%d", layer);
    json_t *list = json_object_get(json_object_get(json_object_get(json_object_get(json_object_get(
                       json_object_get(root, "models"), OLMOE), "domains"), domain), "topk_counts"), key);
    bool ok = json_is_array(list) && json_array_size(list) == 64;
    for (size_t i = 0; ok && i < 64; i++) out[i] = (double)json_integer_value(json_array_get(list, i));
    json_decref(root);
    return ok;
}

/* Integer column of the bundled CSV, read independently of the library. */
static int32_t *csv_column(int col, size_t *n)
{
    FILE *f = fopen(CSV, "r");
    if (!f) return NULL;
    char line[256];
    size_t cap = 8192, count = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!fgets(line, sizeof line, f)) count = 0;
    while (v && fgets(line, sizeof line, f)) {
        char *p = line;
        for (int i = 0; i < col && p; i++) p = strchr(p, ','), p = p ? p + 1 : NULL;
        if (!p) continue;
        if (count == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        if (v) v[count++] = atoi(p);
    }
    fclose(f);
    *n = count;
    return v;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static double quantile_of(int32_t *v, size_t n, double q)
{
    qsort(v, n, sizeof *v, cmp_i32);
    size_t i = (size_t)ceil(q * (double)n);
    return v[i ? i - 1 : 0];
}

/* ---- tests --------------------------------------------------------------------------- */

/* Plackett-Luce inclusion by enumerating every ordered draw of k from n. */
static void enumerate(const double *w, int n, int k, int depth, double prob, double rest, int *taken, double *pi)
{
    if (depth == k) {
        for (int e = 0; e < n; e++) pi[e] += taken[e] ? prob : 0;
        return;
    }
    for (int e = 0; e < n; e++) {
        if (taken[e]) continue;
        taken[e] = 1;
        enumerate(w, n, k, depth + 1, prob * w[e] / rest, rest - w[e], taken, pi);
        taken[e] = 0;
    }
}

static void test_inclusion(void)
{
    double w[9] = {30, 10, 5, 2, 1, 1, 0.5, 0.1, 0.01}, exact[9] = {0}, pi[9], back[9], total = 0, err_max = 0;
    int taken[9] = {0};
    rp_error err;
    for (int e = 0; e < 9; e++) total += w[e];
    enumerate(w, 9, 4, 0, 1.0, total, taken, exact);
    is_int(gen_pl_inclusion(ctx, w, 9, 4, pi, &err), RP_OK, "inclusion probabilities by quadrature");
    for (int e = 0; e < 9; e++) err_max = fmax(err_max, fabs(pi[e] - exact[e]));
    ok(err_max < 1e-7, "quadrature matches exact enumeration of top-4 of 9 (max error %.2g)", err_max);
    double worst;
    is_int(gen_pl_calibrate(ctx, exact, 9, 4, back, &worst, &err), RP_OK, "calibration");
    err_max = 0;
    for (int e = 0; e < 9; e++) err_max = fmax(err_max, fabs(back[e] / (w[e] / total) - 1));
    ok(worst < 1e-8 && err_max < 1e-5, "calibration recovers the weights from their inclusion (%.2g)", err_max);
    is_int(gen_pl_inclusion(ctx, w, 3, 4, pi, &err), RP_EINVAL, "top-k above the expert count rejected");
}

static void test_small_example(void)
{
    rp_gen *g;
    rp_error err;
    is_int(rp_gen_load(ctx, EXAMPLES "/gen-small.json", &g, &err), RP_OK, "examples/gen-small.json loads");
    if (!g) {
        diag("%s", err.text);
        return;
    }
    const rp_gen_info *in = rp_gen_get_info(g);
    ok(in->num_layers == 16 && in->num_experts == 64 && in->top_k == 8, "OLMoE-like shape 16 x 64, top-8");
    is_int(in->num_steps, 4, "4 steps");
    is_int(in->num_seqs, 64, "64 sequences a step");
    is_int(in->num_prompts * in->group_size, in->num_seqs, "num_seqs = num_prompts x group_size");
    is_int(in->width, RP_ID_U8, "narrowest id width by default");
    is_int(in->num_domains, 2, "a mixture of two domains");
    ok(in->calibration_error < 1e-6, "calibration converged (%.3g)", in->calibration_error);
    ok(in->response_clip_mass > 0.005 && in->response_clip_mass < 0.05, "expected response clip mass %.4f",
       in->response_clip_mass);

    rp_batch *b;
    rp_routing r;
    is_int(rp_gen_step(g, 0, &b, &r, &err), RP_OK, "step 0");
    is_int(rp_routing_check(&r, b, in->num_experts, &err), RP_OK, "every id in range");
    is_int(r.layout, RP_ROUTING_PACKED, "packed [tokens, layers, k] view");
    int64_t bad = 0, tokens = rp_batch_num_tokens(b);
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t l = 0; l < r.num_layers; l++) {
            uint64_t seen[1] = {0};
            for (int32_t j = 0; j < r.top_k; j++) {
                int32_t e = id_at(&r, t, l, j);
                if (seen[0] >> e & 1) bad++;
                seen[0] |= 1ULL << e;
            }
        }
    is_int(bad, 0, "k distinct experts for every token and layer");
    const int32_t *grp = rp_batch_group_ids(b), *pl = rp_batch_prompt_lens(b), *rl = rp_batch_response_lens(b);
    const int64_t *cu = rp_batch_cu_seqlens(b);
    bool groups_ok = true, prompts_shared = true, responses_differ = false;
    size_t row = (size_t)r.num_layers * r.top_k;
    for (int32_t s = 0; s < rp_batch_num_seqs(b); s++) {
        int32_t lead = s / 8 * 8;
        groups_ok &= grp[s] == s / 8 && pl[s] == pl[lead] && rl[s] >= 1 && pl[s] >= 1;
        prompts_shared &= !memcmp((const uint8_t *)r.base + cu[s] * row, (const uint8_t *)r.base + cu[lead] * row,
                                  (size_t)pl[s] * row);
        if (s != lead && (rl[s] != rl[lead] || memcmp((const uint8_t *)r.base + (cu[s] + pl[s]) * row,
                                                      (const uint8_t *)r.base + (cu[lead] + pl[s]) * row, row)))
            responses_differ = true;
    }
    ok(groups_ok, "groups of 8 responses share a prompt length and a group id");
    ok(prompts_shared, "a group's prompt is routed once, the same for every response");
    ok(responses_differ, "responses of a group differ");
    rp_batch_free(b);

    is_int(rp_gen_step(g, -1, &b, &r, &err), RP_EINVAL, "negative step rejected");
    double share[64];
    is_int(rp_gen_target_load(g, 16, share, &err), RP_ERANGE, "target load of a layer out of range");
    is_int(rp_gen_set_steps(g, 0, &err), RP_ERANGE, "zero steps rejected");
    is_int(rp_gen_set_steps(g, 7, &err), RP_OK, "steps overridden");
    is_int(rp_gen_get_info(g)->num_steps, 7, "info shows the override");
    rp_gen_free(g);
    rp_gen_free(NULL);
}

static void test_determinism(void)
{
    const char *text = small_settings("\"seed\": 7, \"threads\": 1,", "\"num_layers\": 4", "", SMALL_LENGTHS);
    rp_gen *a = must_parse(text), *b = must_parse(text);
    if (!a || !b) {
        rp_gen_free(a);
        rp_gen_free(b);
        return;
    }
    uint64_t a0 = step_hash(a, 0), a1 = step_hash(a, 1), a2 = step_hash(a, 2);
    /* b in another order: late step first, then back (the drift walk restarts) */
    uint64_t b2 = step_hash(b, 2), b0 = step_hash(b, 0), b1 = step_hash(b, 1);
    ok(a0 && a0 == b0 && a1 == b1 && a2 == b2, "same seed: identical ids and lengths, in any step order");
    ok(a0 != a1 && a1 != a2, "steps differ from each other");
    rp_gen_set_seed(b, 8);
    ok(step_hash(b, 0) != a0, "another seed gives another batch");
    rp_gen_set_seed(b, 7);
    is_int(step_hash(b, 1), a1, "back to the seed, back to the same batch");
    rp_gen_free(b);

    rp_gen *c = must_parse(small_settings("\"seed\": 7, \"threads\": 3,", "\"num_layers\": 4", "", SMALL_LENGTHS));
    ok(c && step_hash(c, 2) == a2 && step_hash(c, 0) == a0, "3 threads give the same ids as 1");
    rp_gen_free(c);
    rp_gen_free(a);
}

/* Per recorded layer, the generated global load's skew against the file's. */
static void check_calibration(const char *domain, const char *extra)
{
    /* 1200 sequences of 100 tokens: 120k tokens, enough sequences that their
     * specialization averages out (seeds 1-4 at 100k tokens stay within 5%) */
    rp_gen *g = must_parse(settings(
        "{\"seed\": 3, \"num_prompts\": 1200, \"group_size\": 1,"
        " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
        " \"domains\": {\"%s\": 1}%s},"
        " \"lengths\": {\"prompt\": {\"constant\": 1}, \"response\": {\"constant\": 99}}}",
        domain, extra));
    if (!g) {
        skip(7, "generator did not load");
        return;
    }
    rp_batch *b;
    rp_routing r;
    rp_error err;
    if (rp_gen_step(g, 0, &b, &r, &err) != RP_OK) {
        diag("%s", err.text);
        skip(7, "step failed");
        rp_gen_free(g);
        return;
    }
    is_int(rp_batch_num_tokens(b), 120000, "%s: 120k tokens", domain);
    static const int32_t layers[3] = {0, 7, 15};
    for (int i = 0; i < 3; i++) {
        double src[64], got[64];
        if (!source_counts(domain, layers[i], src)) {
            skip(2, "counts not readable");
            continue;
        }
        layer_load(b, &r, layers[i], 64, got);
        skew s = skew_of(src, 64), gsk = skew_of(got, 64);
        ok(fabs(gsk.cv / s.cv - 1) < 0.10, "%s layer %d: load CV %.3f vs the file's %.3f", domain, layers[i], gsk.cv,
           s.cv);
        ok(fabs(gsk.max_over_mean / s.max_over_mean - 1) < 0.10, "%s layer %d: max/mean %.3f vs the file's %.3f",
           domain, layers[i], gsk.max_over_mean, s.max_over_mean);
    }
    rp_batch_free(b);
    rp_gen_free(g);
}

static void test_calibration(void)
{
    /* c4 has cross-layer pairs (couplings on, corrected by simulation); tulu has none */
    check_calibration("c4", "");
    check_calibration("tulu", "");
    /* the same shape as the file with the mapping at work: target = file exactly */
    rp_gen *g = must_parse(small_settings("", "", ", \"domains\": {\"tulu\": 1}", SMALL_LENGTHS));
    if (g) {
        double share[64], src[64];
        rp_error err;
        bool same = source_counts("tulu", 7, src) && rp_gen_target_load(g, 7, share, &err) == RP_OK;
        double total = 0, worst = 0;
        for (int e = 0; e < 64; e++) total += src[e];
        for (int e = 0; same && e < 64; e++) worst = fmax(worst, fabs(share[e] - src[e] / total));
        ok(same && worst < 1e-12, "file's own shape: layer 7's target is the file's load, expert by expert");
        rp_gen_target_load(g, 3, share, &err);
        skew a = skew_of(share, 64);
        source_counts("tulu", 0, src);
        skew b = skew_of(src, 64);
        ok(fabs(a.cv - b.cv) < 1e-9, "layer 3 takes its nearest recorded layer (0), relabeled");
        ok(memcmp(share, src, sizeof share) != 0, "relabeled: not the same expert ids");
    } else {
        skip(3, "generator did not load");
    }
    rp_gen_free(g);
}

static void test_shapes(void)
{
    double src[64];
    source_counts("c4", 0, src);
    skew s = skew_of(src, 64);
    static const struct {
        int32_t experts;
        double jitter;
        double tol;
    } cases[] = {{128, 0.0, 1e-9}, {256, 0.0, 1e-9}, {100, 0.1, 0.25}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rp_gen *g = must_parse(settings(
            "{\"num_prompts\": 4, \"model\": {\"num_layers\": 24, \"num_experts\": %d, \"top_k\": 8},"
            " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
            " \"domains\": {\"c4\": 1}, \"split_jitter\": %g, \"layer_correlation\": 0},"
            " \"lengths\": {\"prompt\": {\"constant\": 16}, \"response\": {\"constant\": 16}}}",
            cases[i].experts, cases[i].jitter));
        double *share = malloc((size_t)cases[i].experts * sizeof(double));
        rp_error err;
        if (!g || !share || rp_gen_target_load(g, 0, share, &err) != RP_OK) {
            skip(2, "generator did not load");
        } else {
            double total = 0;
            for (int32_t e = 0; e < cases[i].experts; e++) total += share[e];
            skew t = skew_of(share, cases[i].experts);
            ok(fabs(total - 1) < 1e-9 && fabs(t.cv / s.cv - 1) <= cases[i].tol,
               "%d experts (jitter %g): layer 0 target CV %.4f vs the file's %.4f", cases[i].experts, cases[i].jitter,
               t.cv, s.cv);
            rp_batch *b;
            rp_routing r;
            ok(rp_gen_step(g, 0, &b, &r, &err) == RP_OK && rp_routing_check(&r, b, cases[i].experts, &err) == RP_OK,
               "%d experts, 24 layers: ids in range", cases[i].experts);
            if (b) rp_batch_free(b);
        }
        free(share);
        rp_gen_free(g);
    }
    /* fewer experts than the file: merged, flatter, still valid */
    rp_gen *g = must_parse(small_settings("", "\"num_layers\": 3, \"num_experts\": 16, \"top_k\": 4", "", SMALL_LENGTHS));
    rp_batch *b = NULL;
    rp_routing r;
    rp_error err;
    ok(g && rp_gen_step(g, 0, &b, &r, &err) == RP_OK && rp_routing_check(&r, b, 16, &err) == RP_OK &&
           r.top_k == 4 && r.num_layers == 3,
       "16 experts, top-4, 3 layers: merged experts, ids in range");
    rp_batch_free(b);
    rp_gen_free(g);
    g = must_parse(small_settings("\"id_width\": 4,", "\"num_experts\": 300, \"num_layers\": 2", "", SMALL_LENGTHS));
    b = NULL;
    ok(g && rp_gen_get_info(g)->width == RP_ID_I32 && rp_gen_step(g, 0, &b, &r, &err) == RP_OK &&
           rp_routing_check(&r, b, 300, &err) == RP_OK,
       "300 experts in int32 ids");
    rp_batch_free(b);
    rp_gen_free(g);
    g = must_parse(small_settings("", "\"num_experts\": 300, \"num_layers\": 2", "", SMALL_LENGTHS));
    ok(g && rp_gen_get_info(g)->width == RP_ID_U16, "300 experts default to uint16 ids");
    rp_gen_free(g);
    g = must_parse(small_settings("", "\"num_experts\": 8, \"top_k\": 8, \"num_layers\": 2", "", SMALL_LENGTHS));
    b = NULL;
    ok(g && rp_gen_step(g, 0, &b, &r, &err) == RP_OK && rp_routing_check(&r, b, 8, &err) == RP_OK,
       "top-k = experts: every token takes all of them");
    rp_batch_free(b);
    rp_gen_free(g);
}

static void test_lengths(void)
{
    /* responses: many short sequences on a tiny model; median 200, cap 10.24 x median
     * (the reference's ratio, so the same clip mass, about 1%) */
    rp_gen *g = must_parse(settings(
        "{\"seed\": 11, \"num_prompts\": 2500, \"group_size\": 8, \"model\": {\"num_layers\": 1, \"num_experts\": 8, \"top_k\": 1},"
        " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\", \"domains\": {\"tulu\": 1}},"
        " \"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\"}, \"prompt_scale\": 0.1,"
        " \"prompt_cap\": 300, \"response\": {\"lognormal\": {\"median\": 200, \"sigma\": 1.0}, \"cap\": 2048}}}"));
    rp_batch *b = NULL;
    rp_routing r;
    rp_error err;
    if (!g || rp_gen_step(g, 0, &b, &r, &err) != RP_OK) {
        skip(8, "generator failed");
        rp_gen_free(g);
        return;
    }
    const rp_gen_info *in = rp_gen_get_info(g);
    int32_t n = rp_batch_num_seqs(b);
    int32_t *resp = malloc((size_t)n * sizeof(int32_t)), *prompt = malloc((size_t)(n / 8) * sizeof(int32_t));
    int64_t clipped = 0, prompt_clipped = 0;
    for (int32_t s = 0; s < n; s++) {
        resp[s] = rp_batch_response_lens(b)[s];
        clipped += resp[s] == 2048;
        if (s % 8 == 0) {
            prompt[s / 8] = rp_batch_prompt_lens(b)[s];
            prompt_clipped += prompt[s / 8] == 300;
        }
    }
    double p50 = quantile_of(resp, (size_t)n, 0.5), p90 = quantile_of(resp, (size_t)n, 0.9);
    ok(fabs(p50 / 200 - 1) < 0.04, "response p50 %.0f vs the log-normal's 200", p50);
    ok(fabs(p90 / (200 * exp(1.2815516)) - 1) < 0.05, "response p90 %.0f vs the log-normal's %.0f", p90,
       200 * exp(1.2815516));
    double expected = 0.5 * erfc(log(2047.5 / 200) / sqrt(2.0));
    is_double(in->response_clip_mass, expected, 1e-12, "expected clip mass is P(X >= cap - 1/2) = %.5f", expected);
    is_double((double)clipped / n, expected, 0.004, "clip mass of the batch %.4f", (double)clipped / n);

    size_t nc;
    int32_t *col = csv_column(1, &nc);
    if (col) {
        int32_t *scaled = malloc(nc * sizeof(int32_t));
        int64_t at_cap = 0;
        for (size_t i = 0; i < nc; i++) {
            double x = col[i] * 0.1;
            scaled[i] = x >= 299.5 ? 300 : (int32_t)fmax(1, round(x));
            at_cap += scaled[i] == 300;
        }
        double c50 = quantile_of(scaled, nc, 0.5), c90 = quantile_of(scaled, nc, 0.9);
        double g50 = quantile_of(prompt, (size_t)(n / 8), 0.5), g90 = quantile_of(prompt, (size_t)(n / 8), 0.9);
        ok(fabs(g50 / c50 - 1) < 0.06, "prompt p50 %.0f vs the CSV's %.0f (scaled 0.1)", g50, c50);
        ok(fabs(g90 / c90 - 1) < 0.06, "prompt p90 %.0f vs the CSV's %.0f (scaled 0.1)", g90, c90);
        is_double(in->prompt_clip_mass, (double)at_cap / nc, 1e-12, "expected prompt clip mass from the CSV: %.4f",
                  (double)at_cap / nc);
        is_double((double)prompt_clipped / (n / 8), (double)at_cap / nc, 0.015, "prompts at prompt_cap: %.4f",
                  (double)prompt_clipped / (n / 8));
        free(scaled);
    } else {
        skip(4, "CSV not readable");
    }
    free(col);
    free(resp);
    free(prompt);
    rp_batch_free(b);
    rp_gen_free(g);
}

/* Mean over sequences of max/mean of the sequence's own expert histogram at a layer. */
static double specialization(double concentration)
{
    rp_gen *g = must_parse(settings(
        "{\"seed\": 5, \"num_prompts\": 48, \"model\": {\"num_layers\": 8},"
        " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
        " \"domains\": {\"tulu\": 1}, \"concentration\": %g, \"locality\": 0},"
        " \"lengths\": {\"prompt\": {\"constant\": 1}, \"response\": {\"constant\": 799}}}",
        concentration));
    rp_batch *b = NULL;
    rp_routing r;
    rp_error err;
    double total = 0;
    if (!g || rp_gen_step(g, 0, &b, &r, &err) != RP_OK) {
        rp_gen_free(g);
        return NAN;
    }
    const int64_t *cu = rp_batch_cu_seqlens(b);
    for (int32_t s = 0; s < rp_batch_num_seqs(b); s++) {
        double h[64] = {0};
        for (int64_t t = cu[s]; t < cu[s + 1]; t++)
            for (int32_t j = 0; j < 8; j++) h[id_at(&r, t, 4, j)] += 1;
        total += skew_of(h, 64).max_over_mean;
    }
    total /= rp_batch_num_seqs(b);
    rp_batch_free(b);
    rp_gen_free(g);
    return total;
}

static void test_concentration(void)
{
    double low = specialization(2), mid = specialization(16), high = specialization(256);
    ok(low > mid && mid > high, "per-sequence max/mean falls as concentration rises: %.2f (2) > %.2f (16) > %.2f (256)",
       low, mid, high);
    /* the ceiling is E / k = 8 (k favourites always); the floor is the global load's
     * own max/mean at that layer (tulu layer 7: 4.45) */
    ok(low > 7.5 && high < 5.2, "low concentration nearly always takes the same k experts, high barely more "
                                "than the global skew");
}

static void test_drift(void)
{
    double moved[2];
    for (int i = 0; i < 2; i++) {
        rp_gen *g = must_parse(settings(
            "{\"seed\": 9, \"num_prompts\": 400, \"model\": {\"num_layers\": 2},"
            " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
            " \"domains\": {\"c4\": 0.5, \"tulu\": 0.5}, \"concentration\": 1000, \"drift\": %g},"
            " \"lengths\": {\"prompt\": {\"constant\": 1}, \"response\": {\"constant\": 99}}}",
            i ? 0.1 : 0.0));
        double a[64], c[64];
        moved[i] = NAN;
        for (int s = 0; g && s < 2; s++) {
            rp_batch *b;
            rp_routing r;
            rp_error err;
            if (rp_gen_step(g, s ? 10 : 0, &b, &r, &err) != RP_OK) break;
            layer_load(b, &r, 1, 64, s ? c : a);
            int64_t n = rp_batch_num_tokens(b) * 8;
            rp_batch_free(b);
            if (s) {
                moved[i] = 0;
                for (int e = 0; e < 64; e++) moved[i] += fabs(a[e] - c[e]) / (double)n;
            }
        }
        rp_gen_free(g);
    }
    ok(moved[1] > 3 * moved[0], "drift moves the global load between steps 0 and 10: L1 %.3f vs %.3f without",
       moved[1], moved[0]);
}

static void test_locality_and_coupling(void)
{
    /* locality: the share of (token, layer) sets equal to the token before's */
    double same[2];
    for (int i = 0; i < 2; i++) {
        rp_gen *g = must_parse(small_settings("", "\"num_layers\": 2",
                                              i ? ", \"locality\": 0.8" : ", \"locality\": 0", SMALL_LENGTHS));
        rp_batch *b = NULL;
        rp_routing r;
        rp_error err;
        same[i] = NAN;
        if (g && rp_gen_step(g, 0, &b, &r, &err) == RP_OK) {
            const int64_t *cu = rp_batch_cu_seqlens(b);
            int64_t eq = 0, all = 0;
            for (int32_t s = 0; s < rp_batch_num_seqs(b); s++)
                for (int64_t t = cu[s] + 1; t < cu[s + 1]; t++) {
                    bool e = true;
                    for (int32_t j = 0; j < 8; j++) e &= id_at(&r, t, 1, j) == id_at(&r, t - 1, 1, j);
                    eq += e;
                    all++;
                }
            same[i] = (double)eq / all;
        }
        rp_batch_free(b);
        rp_gen_free(g);
    }
    ok(same[0] < 0.1 && fabs(same[1] - 0.8) < 0.05, "locality: a token reuses the previous set %.2f (0.8) vs %.2f (0)",
       same[1], same[0]);

    /* couplings: rank-aligned association between consecutive layers (mutual
     * information of choice j at layer 0 and choice j at layer 1) */
    double mi[2];
    for (int i = 0; i < 2; i++) {
        rp_gen *g = must_parse(settings(
            "{\"seed\": 2, \"num_prompts\": 500, \"model\": {\"num_layers\": 2},"
            " \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\","
            " \"domains\": {\"c4\": 1}, \"concentration\": 1e6, \"locality\": 0, \"layer_correlation\": %d},"
            " \"lengths\": {\"prompt\": {\"constant\": 1}, \"response\": {\"constant\": 99}}}",
            i));
        rp_batch *b = NULL;
        rp_routing r;
        rp_error err;
        mi[i] = NAN;
        if (g && rp_gen_step(g, 0, &b, &r, &err) == RP_OK) {
            static double c[64][64];
            double ra[64] = {0}, cb[64] = {0}, n = 0;
            memset(c, 0, sizeof c);
            for (int64_t t = 0; t < rp_batch_num_tokens(b); t++)
                for (int32_t j = 0; j < 8; j++) {
                    int x = id_at(&r, t, 0, j), y = id_at(&r, t, 1, j);
                    c[x][y]++, ra[x]++, cb[y]++, n++;
                }
            mi[i] = 0;
            for (int x = 0; x < 64; x++)
                for (int y = 0; y < 64; y++)
                    if (c[x][y] > 0) mi[i] += c[x][y] / n * log(c[x][y] * n / ra[x] / cb[y]);
        }
        rp_batch_free(b);
        rp_gen_free(g);
    }
    ok(mi[0] < 0.02 && mi[1] > 0.05, "layer_correlation 1 couples consecutive layers: MI %.3f nats vs %.3f at 0",
       mi[1], mi[0]);
}

/* Each bad settings text and the words its error must contain (with its position). */
static void test_bad_settings(void)
{
    static const struct {
        const char *text;
        const char *want;
    } cases[] = {
        {"{\"num_prompts\": 2,\n  \"seeed\": 1}", "settings.json:2:3: unknown key 'seeed' (did you mean 'seed'?)"},
        {"{\"num_prompts\": 2, \"model\": {\"top_k\": 0},\n \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", "
         "\"model\": \"" OLMOE "\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "settings.json:1:39: model.top_k must be >= 1, got 0"},
        {"{\"num_prompts\": 2, \"model\": {\"num_experts\": 4, \"top_k\": 8}, \"experts\": {\"counts_file\": "
         "\"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "model.top_k must be <= 4, got 8"},
        {"{\"num_prompts\": 2,\n \"experts\": {\"counts_file\": \"data/nope.json\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "settings.json:2:29: experts.counts_file"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\",\n \"model\": \"gpt-5\"}, "
         "\"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "settings.json:2:11: experts.model model 'gpt-5' is not in"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\"}, "
         "\"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "has 3 models; name one"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\",\n"
         "  \"domains\": {\"c4\": 1, \"arxiv\": 2}}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "settings.json:2:33: experts.domains.arxiv domain 'arxiv' is not in model"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"},\n"
         " \"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\", \"column\": \"Tokens\"}}}",
         "settings.json:2:84: lengths.prompt.column"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, "
         "\"lengths\": {\"prompt\": {\"csv\": \"data/azure_llm_inference_2023_conv.csv\", \"column\": \"Tokens\"}}}",
         "has no column 'Tokens' (columns: TIMESTAMP, ContextTokens, GeneratedTokens)"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, "
         "\"lengths\": {\"prompt\": {\"constant\": 3, \"lognormal\": {\"median\": 5, \"sigma\": 1}}}}",
         "lengths.prompt needs exactly one of 'csv', 'lognormal' or 'constant', got 2"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, "
         "\"lengths\": {\"prompt\": {\"lognormal\": {\"median\": 0, \"sigma\": 1}}}}",
         "lengths.prompt.lognormal.median must be > 0, got 0"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\", "
         "\"locality\": 1.5}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "experts.locality must be <= 1, got 1.5"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\", "
         "\"concentration\": 0}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "experts.concentration must be > 0, got 0"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\", "
         "\"domains\": {\"c4\": 0}}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "experts.domains weights are all 0"},
        {"{\"num_prompts\": 2, \"id_width\": 1, \"model\": {\"num_experts\": 300}, \"experts\": {\"counts_file\": "
         "\"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "id_width of 1 byte(s) holds expert ids below 256, but the model has 300 experts"},
        {"{\"num_prompts\": 2, \"id_width\": 3, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", "
         "\"model\": \"" OLMOE "\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "id_width must be 1, 2 or 4 bytes, got 3"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, "
         "\"lengths\": {\"prompt\": {\"constant\": 3}, \"response\": {\"constant\": 5, \"cap\": 0}}}",
         "lengths.response.cap must be >= 1, got 0"},
        {"{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}}",
         "settings.json:1:1: lengths is required"},
        {"{\"num_prompts\": 2, \"group_size\": 5000, \"experts\": {}}", "settings.json:1:34: group_size must be <= 4096, got 5000"},
        {"{\"num_prompts\": 2,, }", "settings.json:1:19:"},
        {"{\"num_prompts\": 2, \"model\": {\"num_experts\": 2000}, \"experts\": {\"counts_file\": "
         "\"data/olmoe_expert_counts.json\", \"model\": \"" OLMOE "\"}, \"lengths\": {\"prompt\": {\"constant\": 3}}}",
         "experts.layer_correlation needs model.num_experts <= 1024 (dense coupling tables), got 2000 experts"},
        {"[1, 2]", "the document must be an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rp_gen *g = NULL;
        rp_error err;
        rp_status st = parse(cases[i].text, &g, &err);
        ok(st != RP_OK && g == NULL, "bad settings %zu rejected (%s)", i, rp_strerror(st));
        like(err.text, cases[i].want, "bad settings %zu: message", i);
    }
    rp_gen *g = NULL;
    rp_error err;
    rp_status st = parse(cases[0].text, &g, &err);
    ok(st == RP_EINVAL && err.line == 2 && err.column == 3, "error carries line and column (%d:%d)", err.line,
       err.column);
    is_int(rp_gen_load(ctx, EXAMPLES "/no-such-settings.json", &g, &err), RP_EIO, "missing settings file");
    like(err.text, "no-such-settings.json: cannot open", "missing settings file message");
}

static bool write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fputs(text, f);
    return fclose(f) == 0;
}

/* Bad data files: each error points into the data file itself. */
static void test_bad_data(void)
{
    char path[512], counts[512], csv[512];
    snprintf(counts, sizeof counts, "%s/counts.json", tmpdir);
    snprintf(csv, sizeof csv, "%s/lens.csv", tmpdir);
    snprintf(path, sizeof path, "%s/gen.json", tmpdir);
    static const struct {
        const char *counts;
        const char *want;
    } cases[] = {
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0],\n"
         " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, 5, 4]}}}}}}",
         "counts.json:2:55: models.m.domains.d.topk_counts.0 sums to 19, but tokens x top_k is 10 x 2 = 20"},
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0],\n"
         " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, 10]}}}}}}",
         "topk_counts.0 has 3 counts, but the model has 4 experts"},
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [1, 0],\n"
         " \"domains\": {}}}}",
         "layers_recorded[1] must be greater than the layer before it (1), got 0"},
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0, 1],\n"
         " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, 5, 5], \"1\": [5, 5, 5, 5]},"
         " \"crosslayer_topk_pairs\": {\"0->1\": [[0, 9, 3]]}}}}}}",
         "crosslayer_topk_pairs.0->1[0][1] must be <= 3, got 9"},
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0, 1],\n"
         " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, 5, 5]}}}}}}",
         "topk_counts has no counts for recorded layer 1"},
        {"{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0],\n"
         " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, -5, 15]}}}}}}",
         "topk_counts.0[2] must be >= 0, got -5"},
        {"{\"models\": {\"m\": {\"num_experts\": 4}}}", "counts.json:1:18: models.m.top_k is required"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_file(counts, cases[i].counts);
        write_file(path, "{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"counts.json\", \"domains\": {\"d\": 1}},"
                         " \"lengths\": {\"prompt\": {\"constant\": 3}}}");
        rp_gen *g = NULL;
        rp_error err;
        rp_error_clear(&err);
        ok(rp_gen_load(ctx, path, &g, &err) != RP_OK && !g, "bad counts file %zu rejected", i);
        like(err.text, cases[i].want, "bad counts file %zu: message", i);
    }
    /* a counts file that works: every default from it (shape, model, all domains) */
    write_file(counts, "{\"models\": {\"m\": {\"num_experts\": 4, \"top_k\": 2, \"num_moe_layers\": 2, \"layers_recorded\": [0, 1],"
                       " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 5, 5, 5], \"1\": [8, 6, 4, 2]},"
                       " \"crosslayer_topk_pairs\": {\"0->1\": [[0, 0, 3], [1, 2, 4], [0, 0, 1]]}},"
                       " \"e\": {\"tokens\": 5, \"topk_counts\": {\"0\": [1, 2, 3, 4], \"1\": [4, 3, 2, 1]}}}}}}");
    write_file(path, "{\"num_prompts\": 3, \"experts\": {\"counts_file\": \"counts.json\"},"
                     " \"lengths\": {\"prompt\": {\"constant\": 3}}}");
    rp_gen *g = NULL;
    rp_error err;
    ok(rp_gen_load(ctx, path, &g, &err) == RP_OK, "counts file relative to the settings file, defaults from it");
    if (g) {
        const rp_gen_info *in = rp_gen_get_info(g);
        ok(in->num_layers == 2 && in->num_experts == 4 && in->top_k == 2 && in->num_domains == 2,
           "shape and domains default to the file's only model");
        rp_batch *b;
        rp_routing r;
        ok(rp_gen_step(g, 0, &b, &r, &err) == RP_OK && rp_routing_check(&r, b, 4, &err) == RP_OK, "and generates");
        rp_batch_free(b);
        rp_gen_free(g);
    }

    static const struct {
        const char *csv;
        const char *want;
    } csvs[] = {
        {"a,ContextTokens\nx,12\ny,1.5\n", "lens.csv:3:3: column ContextTokens: '1.5' is not a non-negative integer"},
        {"a,ContextTokens\nx,12\ny\n", "lens.csv:3: has 1 fields, but the header has 2"},
        {"a,ContextTokens\n", "has a header but no rows"},
        {"a,ContextTokens\nx,-4\n", "'-4' is not a non-negative integer"},
    };
    for (size_t i = 0; i < sizeof csvs / sizeof csvs[0]; i++) {
        write_file(csv, csvs[i].csv);
        write_file(path, "{\"num_prompts\": 2, \"experts\": {\"counts_file\": \"counts.json\"},"
                         " \"lengths\": {\"prompt\": {\"csv\": \"lens.csv\"}}}");
        g = NULL;
        rp_error_clear(&err);
        ok(rp_gen_load(ctx, path, &g, &err) != RP_OK && !g, "bad CSV %zu rejected", i);
        like(err.text, csvs[i].want, "bad CSV %zu: message", i);
    }
    write_file(csv, "\xEF\xBB\xBF\"a\",\"ContextTokens\"\r\n\"x,y\",12\r\n\r\nz,\"7\"\r\n");
    g = NULL;
    ok(rp_gen_load(ctx, path, &g, &err) == RP_OK, "CSV with BOM, quotes, CR LF and a blank line reads");
    rp_gen_free(g);
    remove(csv);
    remove(counts);
    remove(path);
}

static void test_alloc_failures(void)
{
    /* a small counts file with pairs (couplings, so the correction simulation runs
     * too), two domains, a CSV, two threads */
    char counts[512];
    snprintf(counts, sizeof counts, "%s/chaos.json", tmpdir);
    write_file(counts, "{\"models\": {\"m\": {\"num_experts\": 8, \"top_k\": 2, \"num_moe_layers\": 4, \"layers_recorded\": [0, 3],"
                       " \"domains\": {\"d\": {\"tokens\": 10, \"topk_counts\": {\"0\": [5, 1, 1, 1, 3, 3, 3, 3], \"3\": [1, 1, 1, 1, 1, 1, 4, 10]},"
                       " \"crosslayer_topk_pairs\": {\"0->3\": [[0, 7, 3], [1, 6, 4], [2, 2, 1], [4, 7, 5], [5, 6, 2]]}},"
                       " \"e\": {\"tokens\": 5, \"topk_counts\": {\"0\": [1, 2, 3, 4, 0, 0, 0, 0], \"3\": [4, 3, 2, 1, 0, 0, 0, 0]}}}}}}");
    const char *text = settings(
        "{\"num_prompts\": 3, \"group_size\": 2, \"threads\": 2, \"model\": {\"num_layers\": 3, \"num_experts\": 16},"
        " \"experts\": {\"counts_file\": \"chaos.json\", \"domains\": {\"d\": 1, \"e\": 1}},"
        " \"lengths\": {\"prompt\": {\"csv\": \"" CSV "\"}, \"prompt_scale\": 0.01,"
        " \"response\": {\"constant\": 4}}}");
    int failures = 0, leaks = 0, wrong = 0;
    long n;
    uint64_t want = 0;
    {
        rp_gen *g = NULL;
        rp_error err;
        if (rp_gen_parse(ctx, text, strlen(text), "settings.json", tmpdir, &g, &err) != RP_OK) diag("%s", err.text);
        want = g ? step_hash(g, 1) : 0;
        rp_gen_free(g);
    }
    for (n = 1; n < 100000; n++) {
        counting c = {0};
        rp_context *cc;
        if (rp_context_new(counting_alloc, &c, &cc) != RP_OK) break;
        c.fail_at = c.calls + n;
        rp_gen *g = NULL;
        rp_error err;
        rp_status st = rp_gen_parse(cc, text, strlen(text), "settings.json", tmpdir, &g, &err);
        bool done = false;
        if (st == RP_OK) {
            rp_batch *b = NULL;
            rp_routing r;
            st = rp_gen_step(g, 1, &b, &r, &err);
            if (st == RP_OK) {
                done = c.calls < c.fail_at; /* nothing failed: every allocation was tried */
                if (hash_step(b, &r) != want) wrong++;
                rp_batch_free(b);
            } else if (st != RP_ENOMEM) {
                wrong++;
            } else {
                failures++;
                /* the generator stays usable after a failed step */
                c.fail_at = 0;
                if (rp_gen_step(g, 1, &b, &r, &err) != RP_OK || hash_step(b, &r) != want) wrong++;
                rp_batch_free(b);
            }
            rp_gen_free(g);
        } else if (st == RP_ENOMEM) {
            failures++;
        } else {
            diag("allocation %ld: %s", n, err.text);
            wrong++;
        }
        rp_context_free(cc);
        leaks += c.live != 0;
        if (done) break;
    }
    remove(counts);
    ok(want != 0 && failures > 20, "failed every one of %d allocations in load and step", failures);
    is_int(wrong, 0, "each failure is RP_ENOMEM and the retried step is right");
    is_int(leaks, 0, "no leak after any failure");
}

static int run(const char *cmd)
{
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_cli(void)
{
    char cmd[2048], out[512], log[512];
    snprintf(out, sizeof out, "%s/small.rpt", tmpdir);
    snprintf(log, sizeof log, "%s/log.txt", tmpdir);
    snprintf(cmd, sizeof cmd, "%s/routepack trace gen %s/gen-small.json --out %s --steps 2 --seed 5 > %s 2>&1",
             RP_BINARY_DIR, EXAMPLES, out, log);
    is_int(run(cmd), 0, "routepack trace gen runs");
    rp_trace *t = NULL;
    rp_error err;
    if (rp_trace_open(ctx, out, 0, &t, &err) != RP_OK) {
        diag("%s", err.text);
        skip(3, "no trace");
    } else {
        is_int(rp_trace_num_steps(t), 2, "--steps 2 wrote 2 steps");
        is_int(rp_trace_validate(t, &err), RP_OK, "the trace validates");
        rp_gen *g;
        rp_batch *tb, *gb;
        rp_routing tr, gr;
        bool same = false;
        if (rp_gen_load(ctx, EXAMPLES "/gen-small.json", &g, &err) == RP_OK) {
            rp_gen_set_seed(g, 5);
            if (rp_trace_read_step(t, 1, &tb, &tr, &err) == RP_OK) {
                if (rp_gen_step(g, 1, &gb, &gr, &err) == RP_OK) {
                    same = hash_step(tb, &tr) == hash_step(gb, &gr);
                    rp_batch_free(gb);
                }
                rp_batch_free(tb);
            }
            rp_gen_free(g);
        }
        ok(same, "the trace's step 1 is rp_gen_step(1) with --seed 5");
        rp_trace_close(t);
    }
    char text[8192] = "";
    FILE *f = fopen(log, "r");
    if (f) {
        size_t got = fread(text, 1, sizeof text - 1, f);
        text[got] = '\0';
        fclose(f);
    }
    like(text, "responses mean", "summary prints length quantiles");
    like(text, "at cap", "summary prints the clip mass");
    like(text, "max/mean", "summary prints per-layer skew");

    snprintf(cmd, sizeof cmd, "%s/routepack trace gen %s/gen-small.json > %s 2>&1", RP_BINARY_DIR, EXAMPLES, log);
    is_int(run(cmd), 2, "missing --out is a usage error");
    snprintf(cmd, sizeof cmd, "%s/routepack trace gen %s/gen-small.json --out %s --steps x > %s 2>&1", RP_BINARY_DIR,
             EXAMPLES, out, log);
    is_int(run(cmd), 2, "--steps x is a usage error");
    snprintf(cmd, sizeof cmd, "%s/routepack trace gen %s/no-such.json --out %s > %s 2>&1", RP_BINARY_DIR, EXAMPLES,
             out, log);
    is_int(run(cmd), 1, "missing settings fail");
    remove(out);
    remove(log);
}

/* The example in docs/gen.md must load and generate, so the documentation cannot rot. */
static void test_doc_example(void)
{
    char *text = NULL;
    size_t len = 0;
    rp_error err;
    if (rp_read_file(ctx, RP_SOURCE_DIR "/docs/gen.md", &text, &len, &err) != RP_OK) {
        skip(2, "docs/gen.md not readable");
        return;
    }
    char *begin = strstr(text, "```json\n"), *end = begin ? strstr(begin + 8, "```") : NULL;
    ok(begin && end, "docs/gen.md has a JSON example");
    if (begin && end) {
        *end = '\0';
        rp_gen *g = NULL;
        rp_batch *b = NULL;
        rp_routing r;
        rp_status st = parse(begin + 8, &g, &err);
        if (st == RP_OK) st = rp_gen_step(g, 2, &b, &r, &err);
        if (st != RP_OK) diag("%s", err.text);
        ok(st == RP_OK && rp_batch_num_seqs(b) == 128 && rp_gen_get_info(g)->num_steps == 3,
           "the documented example loads and generates 16 x 8 sequences");
        rp_batch_free(b);
        rp_gen_free(g);
    }
    rp_free(ctx, text);
}

static void test_bundled_trace(void)
{
    rp_trace *t = NULL;
    rp_error err;
    if (access(EXAMPLES "/small.rpt", R_OK) != 0) {
        skip(2, "examples/small.rpt not generated yet");
        return;
    }
    is_int(rp_trace_open(ctx, EXAMPLES "/small.rpt", 0, &t, &err), RP_OK, "examples/small.rpt opens and checks");
    const rp_trace_step_info *s0 = t ? rp_trace_step(t, 0) : NULL;
    ok(t && rp_trace_num_steps(t) == 4 && s0 && s0->num_seqs == 64 && s0->num_layers == 16 && s0->num_experts == 64 &&
           s0->top_k == 8,
       "it is gen-small.json's shape: 4 steps of 64 sequences, 16 x 64, top-8");
    rp_trace_close(t);
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK || !temp_dir_make(tmpdir, sizeof tmpdir, "gen")) return 1;
    test_inclusion();
    test_small_example();
    test_determinism();
    test_calibration();
    test_shapes();
    test_lengths();
    test_concentration();
    test_drift();
    test_locality_and_coupling();
    test_bad_settings();
    test_bad_data();
    test_alloc_failures();
    test_cli();
    test_doc_example();
    test_bundled_trace();
    temp_dir_remove(tmpdir);
    rp_context_free(ctx);
    return tap_done();
}
