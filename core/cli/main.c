/* routepack: the command-line tool. Dispatches to one file per command group. */
#include "cli.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const cli_command commands[] = {
    {"trace", "gen", cmd_trace_gen, "SETTINGS.json --out TRACE.rpt [--steps N] [--seed S]",
     "generate a calibrated synthetic multi-step trace"},
    {"trace", "info", cmd_trace_info, "TRACE.rpt [--json]", "print a trace's steps and shape"},
    {"trace", "validate", cmd_trace_validate, "TRACE.rpt",
     "check checksums, lengths and every expert id"},
    {"trace", "import", cmd_trace_import,
     "--routing R.npy (--lens L.npy | --prompt-lens P.npy --response-lens Q.npy) "
     "[--group-ids G.npy] --experts E [--step K] [--append] --out TRACE.rpt",
     "convert .npy arrays dumped from Python into a trace"},
    {"stats", NULL, cmd_stats, "TRACE.rpt [--step K] [--json] [--threads N]",
     "routing statistics: expert loads, skew, per-sequence histograms"},
    {"simulate", NULL, cmd_simulate,
     "[--config C] [--trace T | --gen SETTINGS] [--policies P1,P2,...] [--steps N] [--json] "
     "[--report OUT.html] [--watch POLICY.lua] [--microbatches M]",
     "compare policies side by side over the same steps (no arguments: the bundled example)"},
    {"policy", "list", cmd_policy_list, "[--config C] [--json]",
     "the policies found on the search path: name, version, API version, description"},
    {"policy", "check", cmd_policy_check, "POLICY.lua [--config C] [--trace T [--step K]]",
     "load a policy in the sandbox, show its metadata and what it does on a small batch"},
    {"plan", "baseline", cmd_plan_baseline,
     "NAME --config C --trace T [--step K] [--microbatches M] [--out PLAN.json]",
     "build a baseline plan (token_kk+eplb, verl_kk+contiguous, ...) for one step"},
    {"plan", "eval", cmd_plan_eval, "--config C --trace T [--step K] --plan PLAN.json [--json]",
     "cost breakdown of a plan: step time, lower bound, straggler"},
    {"plan", "validate", cmd_plan_validate, "--config C [--trace T [--step K]] PLAN.json",
     "check a plan file; print every violation"},
};
#define NUM_COMMANDS (sizeof commands / sizeof commands[0])

static void print_usage(FILE *out)
{
    fprintf(out, "usage: routepack COMMAND [ARGS]\n\ncommands:\n");
    for (size_t i = 0; i < NUM_COMMANDS; i++) {
        const cli_command *c = &commands[i];
        fprintf(out, "  %s%s%s %s\n      %s\n", c->group, c->name ? " " : "", c->name ? c->name : "",
                c->usage, c->summary);
    }
    fprintf(out, "  version\n      print the library version and the parts this build has\n");
    fprintf(out, "\nDocumentation: docs/cli.md\n");
}

static void log_to_stderr(void *ud, rp_log_level level, const char *message)
{
    (void)ud;
    static const char *names[] = {"debug", "info", "warning", "error"};
    fprintf(stderr, "routepack: %s: %s\n", names[level], message);
}

int cli_fail(const rp_error *err)
{
    fprintf(stderr, "routepack: %s\n", err->text[0] ? err->text : rp_strerror(err->status));
    return CLI_FAIL;
}

int cli_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "routepack: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return CLI_USAGE;
}

bool cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad)
{
    if (strcmp(argv[*i], name) != 0) return false;
    if (*i + 1 >= argc) {
        cli_usage("%s needs a value", name);
        *bad = true;
        return true;
    }
    *value = argv[++*i];
    return true;
}

bool cli_int(const char *name, const char *text, int64_t *out)
{
    char *end;
    long long v = strtoll(text, &end, 10);
    if (!*text || *end) {
        cli_usage("%s expects an integer, got '%s'", name, text);
        return false;
    }
    *out = v;
    return true;
}

const char *cli_example_path(const char *file)
{
    static char path[4096];
    const char *dirs[3] = {getenv("RP_EXAMPLES_DIR"), RP_SOURCE_DIR "/examples", RP_DATADIR "/examples"};
    for (int i = 0; i < 3; i++) {
        if (!dirs[i]) continue;
        snprintf(path, sizeof path, "%s/%s", dirs[i], file);
        if (access(path, R_OK) == 0) return path;
    }
    return NULL;
}

static int version(void)
{
    printf("routepack %s (CUDA kernels: %s, GPUs visible: %d)\n", RP_VERSION_STRING,
           rp_gpu_built() ? "built" : "not built", rp_gpu_count());
    return CLI_OK;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) return version();
    for (size_t i = 0; i < NUM_COMMANDS; i++) {
        const cli_command *c = &commands[i];
        if (strcmp(argv[1], c->group) != 0) continue;
        int first = 2;
        if (c->name) {
            if (argc < 3 || strcmp(argv[2], c->name) != 0) continue;
            first = 3;
        }
        rp_context *ctx;
        if (rp_context_new(NULL, NULL, &ctx) != RP_OK) {
            fprintf(stderr, "routepack: out of memory\n");
            return CLI_FAIL;
        }
        rp_context_set_log(ctx, log_to_stderr, NULL, RP_LOG_WARN);
        int rc = c->run(ctx, argc - first, argv + first);
        rp_context_free(ctx);
        return rc;
    }
    /* a known group without one of its subcommands: list them */
    char names[256] = "";
    size_t used = 0;
    for (size_t i = 0; i < NUM_COMMANDS && used < sizeof names; i++)
        if (commands[i].name && !strcmp(argv[1], commands[i].group))
            used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", commands[i].name);
    if (used) {
        if (argc > 2) cli_usage("%s: unknown subcommand '%s' (subcommands: %s)", argv[1], argv[2], names);
        else cli_usage("%s needs a subcommand: %s (try: routepack help)", argv[1], names);
        return CLI_USAGE;
    }
    cli_usage("unknown command '%s%s%s' (try: routepack help)", argv[1], argc > 2 ? " " : "",
              argc > 2 ? argv[2] : "");
    return CLI_USAGE;
}
