/* routepack trace gen: write a calibrated synthetic multi-step trace from generator
 * settings (docs/gen.md) and print what came out: lengths, clip mass, expert loads. */
#include "cli.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>

typedef struct summary {
    int32_t num_layers, num_experts;
    int64_t *load;            /* [L x E] token-choices over all steps */
    int32_t *prompt, *response;
    size_t num_lengths, cap_lengths;
    int64_t tokens, sequences, ids;
    int64_t prompt_clipped, response_clipped;
} summary;

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank quantile of a sorted array. */
static int32_t quantile(const int32_t *v, size_t n, double q)
{
    if (n == 0) return 0;
    size_t i = (size_t)ceil(q * (double)n);
    return v[i > 0 ? i - 1 : 0];
}

static bool add_step(summary *s, const rp_gen_info *info, const rp_batch *b, const rp_routing *r)
{
    int32_t n = rp_batch_num_seqs(b);
    if (s->num_lengths + (size_t)n > s->cap_lengths) {
        size_t cap = s->cap_lengths ? s->cap_lengths * 2 : 4096;
        while (cap < s->num_lengths + (size_t)n) cap *= 2;
        int32_t *p = realloc(s->prompt, cap * sizeof(int32_t));
        if (!p) return false;
        s->prompt = p;
        int32_t *q = realloc(s->response, cap * sizeof(int32_t));
        if (!q) return false;
        s->response = q;
        s->cap_lengths = cap;
    }
    const int32_t *pl = rp_batch_prompt_lens(b), *rl = rp_batch_response_lens(b);
    for (int32_t i = 0; i < n; i++) {
        s->prompt[s->num_lengths + (size_t)i] = pl[i];
        s->response[s->num_lengths + (size_t)i] = rl[i];
        s->prompt_clipped += pl[i] == info->prompt_cap;
        s->response_clipped += rl[i] == info->response_cap;
    }
    s->num_lengths += (size_t)n;
    s->sequences += n;
    int64_t tokens = rp_batch_num_tokens(b);
    s->tokens += tokens;
    int64_t per_token = (int64_t)info->num_layers * info->top_k;
    s->ids += tokens * per_token;
    /* packed, dense [tokens, layers, k]: the generator's layout */
    int32_t L = info->num_layers, E = info->num_experts, k = info->top_k;
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t l = 0; l < L; l++) {
            int64_t at = (t * L + l) * k;
            int64_t *row = s->load + (size_t)l * E;
            switch (r->width) {
            case RP_ID_U8: {
                const uint8_t *ids = (const uint8_t *)r->base + at;
                for (int32_t j = 0; j < k; j++) row[ids[j]]++;
                break;
            }
            case RP_ID_U16: {
                const uint16_t *ids = (const uint16_t *)r->base + at;
                for (int32_t j = 0; j < k; j++) row[ids[j]]++;
                break;
            }
            default: {
                const int32_t *ids = (const int32_t *)r->base + at;
                for (int32_t j = 0; j < k; j++) row[ids[j]]++;
                break;
            }
            }
        }
    return true;
}

static void skew_of(const double *v, int32_t n, double *cv, double *max_over_mean)
{
    double mean = 0, var = 0, top = 0;
    for (int32_t i = 0; i < n; i++) mean += v[i];
    mean /= n;
    for (int32_t i = 0; i < n; i++) {
        var += (v[i] - mean) * (v[i] - mean);
        if (v[i] > top) top = v[i];
    }
    *cv = mean > 0 ? sqrt(var / n) / mean : 0;
    *max_over_mean = mean > 0 ? top / mean : 0;
}

static void print_lengths(const char *what, int32_t *v, size_t n, int64_t clipped, double expected)
{
    qsort(v, n, sizeof *v, cmp_i32);
    double mean = 0;
    for (size_t i = 0; i < n; i++) mean += v[i];
    mean = n ? mean / (double)n : 0;
    printf("  %-9s mean %.0f  p50 %d  p90 %d  p99 %d  max %d  at cap %.2f%% (expected %.2f%%)\n", what,
           mean, quantile(v, n, 0.5), quantile(v, n, 0.9), quantile(v, n, 0.99), n ? v[n - 1] : 0,
           n ? 100.0 * (double)clipped / (double)n : 0.0, 100.0 * expected);
}

static void print_summary(const summary *s, const rp_gen_info *info, const rp_gen *gen, double seconds)
{
    static const char *width_names[] = {"", "uint8", "uint16", "", "int32"};
    int32_t L = info->num_layers, E = info->num_experts;
    printf("  shape     %d MoE layers x %d experts, top-%d, %s ids\n", L, E, info->top_k,
           width_names[info->width]);
    printf("  steps     %d (seed %" PRIu64 "), %d sequences a step = %d prompts x %d responses\n",
           info->num_steps, info->seed, info->num_seqs, info->num_prompts, info->group_size);
    printf("  tokens    %" PRId64 " (%.0f a step), %" PRId64 " routing ids (%.1f MB)\n", s->tokens,
           (double)s->tokens / info->num_steps, s->ids, (double)s->ids * info->width / 1e6);
    print_lengths("prompts", s->prompt, s->num_lengths, s->prompt_clipped, info->prompt_clip_mass);
    print_lengths("responses", s->response, s->num_lengths, s->response_clipped, info->response_clip_mass);
    printf("  generated in %.2f s (%.1f M ids/s)\n", seconds, seconds > 0 ? (double)s->ids / seconds / 1e6 : 0);
    printf("  expert load per layer, all steps (target: the counts file's, mapped, at step 0):\n");
    printf("    layer     cv  max/mean   target cv  max/mean\n");
    double *v = malloc((size_t)E * sizeof(double)), *t = malloc((size_t)E * sizeof(double));
    if (!v || !t) {
        free(v);
        free(t);
        return;
    }
    for (int32_t l = 0; l < L; l++) {
        double cv, mm, tcv = 0, tmm = 0;
        for (int32_t e = 0; e < E; e++) v[e] = (double)s->load[(size_t)l * E + e];
        skew_of(v, E, &cv, &mm);
        rp_error err;
        if (rp_gen_target_load(gen, l, t, &err) == RP_OK) skew_of(t, E, &tcv, &tmm);
        printf("    %5d  %5.3f  %8.3f   %9.3f  %8.3f\n", l, cv, mm, tcv, tmm);
    }
    free(v);
    free(t);
}

/* Bytes a step adds to the trace: its routing ids and three int32 arrays (lengths and
 * groups); the header is small beside them. */
static double step_payload_bytes(const rp_gen_info *info, const rp_batch *b)
{
    return (double)rp_batch_num_tokens(b) * info->num_layers * info->top_k * (double)info->width +
           12.0 * rp_batch_num_seqs(b);
}

/* Before anything is written: how much will be (from step 0: steps differ by their
 * lengths), and a warning when the output's file system has less room. */
static void announce(const char *out, const rp_gen_info *info, const rp_batch *step0, double estimate)
{
    if (cli_progress_quiet_p()) return;
    char size[32], room[32];
    fprintf(stderr, "routepack trace gen: about %s to write (%d step%s like step 0: %" PRId64
            " tokens x %d layers x top-%d, %d-byte ids)\n", cli_human_bytes(estimate, size, sizeof size),
            info->num_steps, info->num_steps == 1 ? "" : "s", rp_batch_num_tokens(step0), info->num_layers,
            info->top_k, (int)info->width);
    struct statvfs vfs;
    if (statvfs(out, &vfs) == 0) {
        double free_bytes = (double)vfs.f_bavail * (double)vfs.f_frsize;
        if (free_bytes < estimate)
            fprintf(stderr, "routepack: warning: %s has %s free, less than the estimate\n", out,
                    cli_human_bytes(free_bytes, room, sizeof room));
    }
}

int cmd_trace_gen(rp_context *ctx, int argc, char **argv)
{
    const char *settings = NULL, *out = NULL, *steps_text = NULL, *seed_text = NULL;
    bool bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--out", &out, &bad) || cli_opt(argc, argv, &i, "--steps", &steps_text, &bad) ||
            cli_opt(argc, argv, &i, "--seed", &seed_text, &bad))
            continue;
        if (argv[i][0] == '-' && argv[i][1] != '\0')
            return cli_unknown_option("trace gen", argv[i]);
        if (settings) return cli_usage("trace gen: one settings file, got '%s' and '%s'", settings, argv[i]);
        settings = argv[i];
    }
    if (bad) return CLI_USAGE;
    if (!settings || !out)
        return cli_usage("usage: routepack trace gen SETTINGS.json --out TRACE.rpt [--steps N] [--seed S]");
    if (cli_check_output_file("--out", out) != CLI_OK) return CLI_USAGE;
    int64_t steps = 0, seed = 0;
    if (steps_text && !cli_int("--steps", steps_text, &steps)) return CLI_USAGE;
    if (seed_text && !cli_int("--seed", seed_text, &seed)) return CLI_USAGE;
    if (seed_text && seed < 0) return cli_usage("--seed must be >= 0, got %s", seed_text);
    if (steps_text && (steps < 1 || steps > INT32_MAX))
        return cli_usage("--steps must be >= 1, got %s", steps_text);

    rp_error err;
    rp_error_clear(&err);
    rp_gen *gen = NULL;
    rp_trace_writer *w = NULL;
    summary s;
    memset(&s, 0, sizeof s);
    int rc = CLI_FAIL;
    if (rp_gen_load(ctx, settings, &gen, &err) != RP_OK) return cli_fail(&err);
    if (seed_text) rp_gen_set_seed(gen, (uint64_t)seed);
    if (steps_text && rp_gen_set_steps(gen, (int32_t)steps, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto done;
    }
    const rp_gen_info *info = rp_gen_get_info(gen);
    s.num_layers = info->num_layers;
    s.num_experts = info->num_experts;
    s.load = calloc((size_t)info->num_layers * (size_t)info->num_experts, sizeof(int64_t));
    if (!s.load) {
        fprintf(stderr, "routepack: out of memory\n");
        goto done;
    }
    if (rp_trace_writer_open(ctx, out, info->num_experts, &w, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto done;
    }
    double seconds = 0, written = 0, estimate = 0;
    cli_progress_begin("trace gen: step", info->num_steps, 0);
    for (int32_t step = 0; step < info->num_steps; step++) {
        rp_batch *b;
        rp_routing r;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (rp_gen_step(gen, step, &b, &r, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto done;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double step_bytes = step_payload_bytes(info, b);
        if (step == 0) {
            estimate = step_bytes * info->num_steps;
            announce(out, info, b, estimate);
            cli_progress_begin("trace gen: step", info->num_steps, estimate);
        }
        cli_progress_at(step, written); /* the writer's hook moves the line inside the step */
        rp_status st = rp_trace_writer_append(w, step, b, &r, &err);
        written += step_bytes;
        cli_progress_update(step + 1, written, NULL);
        bool added = st == RP_OK && add_step(&s, info, b, &r);
        rp_batch_free(b);
        if (st != RP_OK) {
            rc = cli_fail(&err);
            goto done;
        }
        if (!added) {
            fprintf(stderr, "routepack: out of memory\n");
            goto done;
        }
    }
    cli_progress_end();
    rp_trace_writer *closing = w;
    w = NULL;
    if (rp_trace_writer_close(closing, &err) != RP_OK) {
        remove(out);
        rc = cli_fail(&err);
        goto done;
    }
    printf("routepack trace gen: %s -> %s\n", settings, out);
    print_summary(&s, info, gen, seconds);
    rc = CLI_OK;
done:
    cli_progress_end();
    if (w) {
        rp_error ignored;
        rp_trace_writer_close(w, &ignored);
        remove(out); /* a half-written trace is no trace */
    }
    free(s.load);
    free(s.prompt);
    free(s.response);
    rp_gen_free(gen);
    return rc;
}
