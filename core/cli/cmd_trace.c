/* `routepack trace info | validate`: look at and fully check routing traces (.rpt).
 * `trace import` is in cmd_import.c. */
#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Collect the non-option arguments; true when every option was known. `json` may be
 * NULL when --json is not accepted. */
static bool trace_args(const char *command, int argc, char **argv, bool *json, const char **paths, int *num_paths)
{
    *num_paths = 0;
    for (int i = 0; i < argc; i++) {
        if (json && !strcmp(argv[i], "--json")) *json = true;
        else if (argv[i][0] == '-' && argv[i][1]) {
            cli_unknown_option(command, argv[i]);
            return false;
        } else paths[(*num_paths)++] = argv[i];
    }
    return true;
}

static void print_info_text(const char *path, const rp_trace *t)
{
    int32_t n = rp_trace_num_steps(t);
    const rp_trace_step_info *last = rp_trace_step(t, n - 1);
    printf("%s: %d step%s, %" PRId64 " bytes (headers checked; `routepack trace validate` "
           "checks the payloads)\n", path, n, n == 1 ? "" : "s",
           last->payload_offset + last->payload_bytes);
    printf("%5s %10s %10s %12s %7s %8s %6s %9s %14s  %s\n", "#", "step", "sequences", "tokens",
           "layers", "experts", "top-k", "id-width", "payload-bytes", "checksum");
    for (int32_t i = 0; i < n; i++) {
        const rp_trace_step_info *s = rp_trace_step(t, i);
        printf("%5d %10" PRId64 " %10d %12" PRId64 " %7d %8d %6d %9d %14" PRId64 "  %016" PRIx64 "\n",
               i, s->step, s->num_seqs, s->num_tokens, s->num_layers, s->num_experts, s->top_k,
               (int)s->width, s->payload_bytes, s->checksum);
    }
}

/* One JSON object for the trace; false when jansson ran out of memory. */
static bool print_info_json(const char *path, const rp_trace *t)
{
    int32_t n = rp_trace_num_steps(t);
    const rp_trace_step_info *last = rp_trace_step(t, n - 1);
    json_t *steps = json_array();
    json_t *root = json_pack("{s:s, s:I, s:i, s:o}", "path", path, "file_bytes",
                             (json_int_t)(last->payload_offset + last->payload_bytes), "num_steps",
                             n, "steps", steps);
    if (!root) return false;
    for (int32_t i = 0; i < n; i++) {
        const rp_trace_step_info *s = rp_trace_step(t, i);
        char hex[17];
        snprintf(hex, sizeof hex, "%016" PRIx64, s->checksum);
        json_t *o = json_pack("{s:i, s:I, s:i, s:I, s:i, s:i, s:i, s:i, s:I, s:s, s:I, s:I}",
                              "index", i, "step", (json_int_t)s->step, "num_seqs", s->num_seqs,
                              "num_tokens", (json_int_t)s->num_tokens, "num_layers", s->num_layers,
                              "num_experts", s->num_experts, "top_k", s->top_k, "id_width",
                              (int)s->width, "payload_bytes", (json_int_t)s->payload_bytes,
                              "checksum", hex, "offset", (json_int_t)s->offset, "payload_offset",
                              (json_int_t)s->payload_offset);
        if (!o || json_array_append_new(steps, o) != 0) {
            json_decref(root);
            return false;
        }
    }
    return cli_print_json(root, 0);
}

int cmd_trace_info(rp_context *ctx, int argc, char **argv)
{
    bool json = false;
    const char **paths = calloc((size_t)argc + 1, sizeof *paths);
    int num_paths;
    if (!paths) return cli_usage("out of memory");
    if (!trace_args("trace info", argc, argv, &json, paths, &num_paths)) {
        free(paths);
        return CLI_USAGE;
    }
    if (num_paths == 0) {
        free(paths);
        return cli_usage("trace info needs a TRACE.rpt file");
    }
    int rc = CLI_OK;
    for (int p = 0; p < num_paths; p++) {
        rp_trace *t;
        rp_error err;
        if (rp_trace_open(ctx, paths[p], RP_TRACE_NO_VERIFY, &t, &err) != RP_OK) {
            rc = cli_fail(&err);
            continue;
        }
        if (!json) print_info_text(paths[p], t);
        else if (!print_info_json(paths[p], t)) {
            fprintf(stderr, "routepack: out of memory printing %s\n", paths[p]);
            rc = CLI_FAIL;
        }
        rp_trace_close(t);
    }
    free(paths);
    fflush(stdout);
    return rc;
}

int cmd_trace_validate(rp_context *ctx, int argc, char **argv)
{
    const char **paths = calloc((size_t)argc + 1, sizeof *paths);
    int num_paths;
    if (!paths) return cli_usage("out of memory");
    if (!trace_args("trace validate", argc, argv, NULL, paths, &num_paths)) {
        free(paths);
        return CLI_USAGE;
    }
    if (num_paths == 0) {
        free(paths);
        return cli_usage("trace validate needs a TRACE.rpt file");
    }
    int rc = CLI_OK;
    for (int p = 0; p < num_paths; p++) {
        rp_trace *t = NULL;
        rp_error err;
        /* two passes over a huge trace (checksums at open, then every id): both on the line */
        cli_progress_begin(paths[p], 0, 0);
        bool valid = rp_trace_open(ctx, paths[p], 0, &t, &err) == RP_OK && rp_trace_validate(t, &err) == RP_OK;
        cli_progress_end();
        if (!valid)
            rc = cli_fail(&err);
        else
            printf("%s: %d step%s, OK\n", paths[p], rp_trace_num_steps(t),
                   rp_trace_num_steps(t) == 1 ? "" : "s");
        rp_trace_close(t);
    }
    free(paths);
    fflush(stdout);
    return rc;
}
