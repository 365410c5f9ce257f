/* `routepack stats`: routing statistics of one step of a trace: per-layer expert-load
 * skew, per-sequence specialization, memory and time, as text or JSON. */
#include "cli.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* What one layer's figures are. */
typedef struct layer_figures {
    rp_skew skew;
    int64_t min;
    double seq_top_share; /* mean over non-empty sequences of (largest count / tokens) */
} layer_figures;

static double seconds_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* "12.3 MB", "4.1 KB": into buf */
static const char *human_bytes(double bytes, char *buf, size_t size)
{
    if (bytes >= 1e9) snprintf(buf, size, "%.2f GB", bytes / 1e9);
    else if (bytes >= 1e6) snprintf(buf, size, "%.1f MB", bytes / 1e6);
    else if (bytes >= 1e3) snprintf(buf, size, "%.1f KB", bytes / 1e3);
    else snprintf(buf, size, "%.0f bytes", bytes);
    return buf;
}

static const char *human_seconds(double s, char *buf, size_t size)
{
    if (s >= 1) snprintf(buf, size, "%.2f s", s);
    else snprintf(buf, size, "%.1f ms", s * 1e3);
    return buf;
}

static const char *width_name(rp_id_width w)
{
    return w == RP_ID_U8 ? "uint8" : w == RP_ID_U16 ? "uint16" : "int32";
}

/* Per-layer figures; false when out of memory. */
static bool compute_figures(const rp_stats *st, const rp_batch *batch, layer_figures *fig)
{
    const int32_t layers = rp_stats_num_layers(st), experts = rp_stats_num_experts(st);
    const int32_t n = rp_stats_num_seqs(st);
    uint32_t *counts = malloc((size_t)experts * sizeof *counts);
    if (!counts) return false;
    for (int32_t l = 0; l < layers; l++) {
        const int64_t *load = rp_stats_expert_load(st, l);
        fig[l].skew = rp_skew_of(load, experts);
        fig[l].min = load[0];
        for (int32_t e = 1; e < experts; e++)
            if (load[e] < fig[l].min) fig[l].min = load[e];
        double share = 0;
        int32_t nonempty = 0;
        for (int32_t s = 0; s < n; s++) {
            int32_t len = rp_batch_seq_len(batch, s);
            if (len == 0) continue;
            rp_stats_seq_hist(st, s, l, counts);
            uint32_t top = 0;
            for (int32_t e = 0; e < experts; e++) top = counts[e] > top ? counts[e] : top;
            share += (double)top / len;
            nonempty++;
        }
        fig[l].seq_top_share = nonempty ? share / nonempty : 0;
    }
    free(counts);
    return true;
}

static void print_text(const char *path, int32_t step, int32_t num_steps, const rp_trace_step_info *info,
                       const rp_stats *st, const layer_figures *fig, int threads, double open_s,
                       double stats_s)
{
    const int32_t layers = info->num_layers, experts = info->num_experts;
    const double id_bytes = (double)info->num_tokens * layers * info->top_k * info->width;
    char mem[32], took[32], opened[32];
    printf("%s: step %d (of %d, counted from 0; recorded as step %lld): %d sequences, %lld tokens, "
           "%d layers, top-%d, %d experts, %s ids\n", path, step, num_steps, (long long)info->step,
           info->num_seqs, (long long)info->num_tokens, layers, info->top_k, experts,
           width_name(info->width));
    printf("statistics: %s in memory, computed in %s with up to %d threads (%.2f GB/s of ids); "
           "trace opened and verified in %s\n\n", human_bytes((double)rp_stats_bytes(st), mem, sizeof mem),
           human_seconds(stats_s, took, sizeof took), threads,
           stats_s > 0 ? id_bytes / stats_s / 1e9 : 0.0, human_seconds(open_s, opened, sizeof opened));
    printf("seq top share: mean over sequences of the share of a sequence's tokens that its\n"
           "favourite expert gets (%.3f if routing were uniform)\n\n", (double)info->top_k / experts);
    printf("%5s  %7s  %8s  %8s  %14s  %13s\n", "layer", "cv", "max/mean", "min/mean", "hottest (load)",
           "seq top share");
    double cv_sum = 0, share_sum = 0, worst = 0;
    int32_t worst_layer = 0;
    for (int32_t l = 0; l < layers; l++) {
        const rp_skew *k = &fig[l].skew;
        char hot[48];
        snprintf(hot, sizeof hot, "%d (%lld)", k->argmax, (long long)k->max);
        printf("%5d  %7.3f  %8.3f  %8.3f  %14s  %13.3f\n", l, k->cv, k->max_over_mean,
               k->min_over_mean, hot, fig[l].seq_top_share);
        cv_sum += k->cv;
        share_sum += fig[l].seq_top_share;
        if (k->max_over_mean > worst) worst = k->max_over_mean, worst_layer = l;
    }
    printf("\nall layers: mean cv %.3f, worst max/mean %.3f (layer %d), mean seq top share %.3f\n",
           cv_sum / layers, worst, worst_layer, share_sum / layers);
}

/* The same as JSON; false when out of memory or the write failed. */
static bool print_json(const char *path, int32_t step, int32_t num_steps, const rp_trace_step_info *info,
                       const rp_stats *st, const layer_figures *fig, int threads, double open_s,
                       double stats_s)
{
    const int32_t layers = info->num_layers, experts = info->num_experts;
    json_t *arr = json_array();
    bool good = arr != NULL;
    double cv_sum = 0, share_sum = 0, worst = 0;
    int32_t worst_layer = 0;
    for (int32_t l = 0; good && l < layers; l++) {
        const rp_skew *k = &fig[l].skew;
        json_t *loads = json_array();
        const int64_t *load = rp_stats_expert_load(st, l);
        for (int32_t e = 0; loads && e < experts; e++)
            if (json_array_append_new(loads, json_integer(load[e]))) good = false;
        /* json_pack and the *_new calls take the reference even when they fail */
        json_t *o = json_pack("{s:i, s:f, s:f, s:f, s:f, s:I, s:I, s:i, s:f, s:o}", "layer", l,
                              "mean", k->mean, "cv", k->cv, "max_over_mean", k->max_over_mean,
                              "min_over_mean", k->min_over_mean, "max", (json_int_t)k->max,
                              "min", (json_int_t)fig[l].min, "hottest_expert", k->argmax,
                              "seq_top_share_mean", fig[l].seq_top_share, "expert_load", loads);
        if (!o || json_array_append_new(arr, o)) good = false;
        cv_sum += k->cv;
        share_sum += fig[l].seq_top_share;
        if (k->max_over_mean > worst) worst = k->max_over_mean, worst_layer = l;
    }
    json_t *summary = json_pack("{s:f, s:f, s:i, s:f, s:f}", "mean_cv", cv_sum / layers,
                                "worst_max_over_mean", worst, "worst_layer", worst_layer,
                                "seq_top_share_mean", share_sum / layers, "uniform_share",
                                (double)info->top_k / experts);
    json_t *root = json_object();
    if (!root) {
        json_decref(arr);
        json_decref(summary);
        return false;
    }
    /* `|`, not `||`: every call runs, so root owns every value whatever fails */
    int failed = json_object_set_new(root, "trace", json_string(path)) |
                 json_object_set_new(root, "step", json_integer(step)) |
                 json_object_set_new(root, "num_steps", json_integer(num_steps)) |
                 json_object_set_new(root, "recorded_step", json_integer(info->step)) |
                 json_object_set_new(root, "num_seqs", json_integer(info->num_seqs)) |
                 json_object_set_new(root, "num_tokens", json_integer(info->num_tokens)) |
                 json_object_set_new(root, "num_layers", json_integer(layers)) |
                 json_object_set_new(root, "num_experts", json_integer(experts)) |
                 json_object_set_new(root, "top_k", json_integer(info->top_k)) |
                 json_object_set_new(root, "id_width_bytes", json_integer(info->width)) |
                 json_object_set_new(root, "threads", json_integer(threads)) |
                 json_object_set_new(root, "stats_bytes", json_integer((json_int_t)rp_stats_bytes(st))) |
                 json_object_set_new(root, "stats_seconds", json_real(stats_s)) |
                 json_object_set_new(root, "open_seconds", json_real(open_s)) |
                 json_object_set_new(root, "summary", summary) |
                 json_object_set_new(root, "layers", arr);
    if (!good || failed) {
        json_decref(root);
        return false;
    }
    return cli_print_json(root, 6);
}

int cmd_stats(rp_context *ctx, int argc, char **argv)
{
    const char *path = NULL, *new_path = NULL, *value;
    int64_t step = 0, threads = 0;
    bool json = false, bad = false, shift = false;
    for (int i = 0; i < argc; i++) {
        if (cli_opt(argc, argv, &i, "--step", &value, &bad)) {
            if (bad || !cli_int("--step", value, &step)) return CLI_USAGE;
        } else if (cli_opt(argc, argv, &i, "--threads", &value, &bad)) {
            if (bad || !cli_int("--threads", value, &threads)) return CLI_USAGE;
            if (threads < 0 || threads > 1024)
                return cli_usage("--threads must be in [0, 1024] (0: all CPUs), got %lld", (long long)threads);
        } else if (!strcmp(argv[i], "--json")) {
            json = true;
        } else if (!strcmp(argv[i], "--shift")) {
            shift = true;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return cli_unknown_option("stats", argv[i]);
        } else if (new_path) {
            return cli_usage("stats takes at most two traces, got '%s', '%s' and '%s'", path, new_path, argv[i]);
        } else if (path) {
            new_path = argv[i];
        } else {
            path = argv[i];
        }
    }
    if (shift) {
        if (!new_path) return cli_usage("stats --shift needs two traces: OLD.rpt (replayed) and NEW.rpt");
        return cmd_stats_shift(ctx, path, new_path, step, (int32_t)threads, json);
    }
    if (new_path) return cli_usage("stats takes one TRACE.rpt, got '%s' and '%s' (two traces need --shift)", path, new_path);
    if (!path) return cli_usage("stats needs a TRACE.rpt file");

    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rp_trace *trace = NULL;
    rp_batch *batch = NULL;
    rp_stats *st = NULL;
    layer_figures *fig = NULL;
    rp_routing routing;
    rp_error err;
    int rc = CLI_OK;
    if (cli_trace_open(ctx, path, 0, &trace, &err) != RP_OK) return cli_fail(&err);
    double open_s = seconds_since(&t0);
    int32_t num_steps = rp_trace_num_steps(trace);
    if (step < 0 || step >= num_steps) {
        rc = cli_usage("%s has %d step%s (0 to %d), --step %lld does not exist", path, num_steps,
                       num_steps == 1 ? "" : "s", num_steps - 1, (long long)step);
        goto out;
    }
    const rp_trace_step_info *info = rp_trace_step(trace, (int32_t)step);
    if (rp_trace_read_step(trace, (int32_t)step, &batch, &routing, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (rp_stats_compute(ctx, batch, &routing, info->num_experts, (int32_t)threads, &st, &err) != RP_OK) {
        fprintf(stderr, "routepack: %s: step %lld: %s\n", path, (long long)step, err.text);
        rc = CLI_FAIL;
        goto out;
    }
    double stats_s = seconds_since(&t0);
    int resolved = (int)threads;
    if (resolved == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        resolved = cpus < 1 ? 1 : cpus > 64 ? 64 : (int)cpus;
    }
    fig = calloc((size_t)info->num_layers, sizeof *fig);
    if (!fig || !compute_figures(st, batch, fig)) {
        fprintf(stderr, "routepack: out of memory\n");
        rc = CLI_FAIL;
        goto out;
    }
    if (!json)
        print_text(path, (int32_t)step, num_steps, info, st, fig, resolved, open_s, stats_s);
    else if (!print_json(path, (int32_t)step, num_steps, info, st, fig, resolved, open_s, stats_s)) {
        fprintf(stderr, "routepack: could not write the JSON output\n");
        rc = CLI_FAIL;
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    free(fig);
    rp_stats_free(st);
    rp_batch_free(batch);
    rp_trace_close(trace);
    return rc;
}
