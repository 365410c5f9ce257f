/* routepack: the command-line tool. Dispatches to one file per command group. */
#include "cli.h"
#include "internal.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Each command's help page: its options with their defaults, then one example. The
 * usage line and summary come first from the table itself. */
static const cli_command commands[] = {
    {"trace", "gen", cmd_trace_gen, "SETTINGS.json --out TRACE.rpt [--steps N] [--seed S]",
     "generate a calibrated synthetic multi-step trace",
     "  SETTINGS.json      generator settings (docs/gen.md)\n"
     "  --out TRACE.rpt    where to write the trace (required; written whole or not at all)\n"
     "  --steps N          steps to generate (default: the settings' \"steps\")\n"
     "  --seed S           random seed (default: the settings' \"seed\")\n",
     "routepack trace gen examples/gen-small.json --out small.rpt --steps 4"},
    {"trace", "info", cmd_trace_info, "TRACE.rpt... [--json]", "print a trace's steps and shape",
     "  TRACE.rpt...       one or more traces (headers only; payloads are not read)\n"
     "  --json             one JSON document per file instead of the table\n",
     "routepack trace info examples/small.rpt"},
    {"trace", "validate", cmd_trace_validate, "TRACE.rpt...",
     "check checksums, lengths and every expert id",
     "  TRACE.rpt...       one or more traces; the first problem of each is reported\n",
     "routepack trace validate examples/small.rpt"},
    {"trace", "import", cmd_trace_import,
     "(--routing R.npy (--lens L.npy | --prompt-lens P.npy --response-lens Q.npy) [--group-ids G.npy] "
     "| --npz RUN.npz) --experts E [--layout L] [--step K] [--append | --force] --out TRACE.rpt",
     "convert .npy arrays, or a whole run saved by numpy.savez, into a trace",
     "  --routing R.npy    routing replay, sequences back to back\n"
     "  --layout L         packed: [tokens, layers, k] (default); per_layer: [layers, tokens, k]\n"
     "  --lens L.npy       sequence lengths [n], or [n, 2] prompt and response\n"
     "  --prompt-lens P.npy  prompt lengths [n] (with --response-lens, instead of --lens)\n"
     "  --response-lens Q.npy  response lengths [n]\n"
     "  --group-ids G.npy  GRPO group of each sequence (default: one group each)\n"
     "  --npz RUN.npz      every step of a run from one numpy.savez archive: routing_K,\n"
     "                     lens_K (or prompt_lens_K, response_lens_K), group_ids_K for step K\n"
     "  --experts E        the model's expert count (required; every id is checked)\n"
     "  --step K           step index to record (default 0; with --append the last + 1)\n"
     "  --append           add the step to the trace (created if missing; shape must match;\n"
     "                     a step index it already holds is refused)\n"
     "  --force            replace an existing trace (default: refuse to overwrite it)\n"
     "  --out TRACE.rpt    the trace to write (required)\n",
     "routepack trace import --routing routing.npy --lens lens.npy --experts 64 --out run.rpt"},
    {"stats", NULL, cmd_stats, "TRACE.rpt [--step K] [--json] [--threads N] | --shift OLD.rpt NEW.rpt [...]",
     "routing statistics: expert loads, skew, per-sequence histograms; router shift",
     "  TRACE.rpt          the trace\n"
     "  --shift OLD NEW    router shift instead: the share of OLD's token-choices (the replayed\n"
     "                     routing) whose expert is not in NEW's top-k for the same tokens\n"
     "                     (the training forward's), per layer, expert and sequence\n"
     "  --step K           which step, counted from 0 (default 0)\n"
     "  --json             the statistics as JSON instead of the table\n"
     "  --threads N        threads of the scan, 0 to 1024 (default 0: all CPUs)\n",
     "routepack stats examples/small.rpt --step 1"},
    {"simulate", NULL, cmd_simulate,
     "[--config C] [--trace T | --gen SETTINGS] [--policies P1,P2,...] [--steps N] [--json] [--wide] "
     "[--report OUT.html] [--plans DIR] [--watch POLICY.lua] [--microbatches M] [--max-memory BYTES]",
     "compare policies side by side over the same steps (no arguments: the bundled example)",
     "  --config C         config (default: the bundled config-small.json)\n"
     "  --trace T          steps to plan (default: the bundled example, 16 steps generated\n"
     "                     in memory from gen-example.json)\n"
     "  --gen SETTINGS     generate the steps in memory instead of reading a trace\n"
     "  --policies P1,...  policies to compare (default: token_kk+contiguous,token_kk+eplb,\n"
     "                     token_kk+eplb_periodic,verl_kk+eplb,attn_kk+eplb,\n"
     "                     slime_ff+eplb,slime_kk+eplb unless the config's trainer needs\n"
     "                     equal sequences per rank, token_kk+virtual_experts where the\n"
     "                     config allows Megatron's virtual experts, routepack);\n"
     "                     NAME:KEY=VALUE[:KEY=VALUE] sets the policy's params\n"
     "                     (routepack:virtual_experts=false; in a pair, eplb.KEY=VALUE)\n"
     "  --steps N          run the first N steps (default: every step of the trace)\n"
     "  --json             the whole run as JSON instead of the table\n"
     "  --wide             every column of the table (default: those that fit 100 columns)\n"
     "  --report OUT.html  also write the HTML report (its folder is checked first)\n"
     "  --plans DIR        write each policy's plan of each step to DIR/POLICY/step-K.json\n"
     "                     (DIR is created when its parent exists)\n"
     "  --watch POLICY.lua reload this policy file between steps when it changes\n"
     "  --microbatches M   fix every plan's microbatch count (default: the config's)\n"
     "  --max-memory BYTES refuse a run estimated to hold more (default 4294967296: 4 GiB)\n",
     "routepack simulate --policies token_kk+eplb,routepack --report run.html"},
    {"policy", "list", cmd_policy_list, "[--config C] [--json]",
     "the policies found on the search path: name, version, API version, description",
     "  --config C         config whose policy.search_path is searched first\n"
     "                     (default: the bundled config-small.json)\n"
     "  --json             the list as JSON instead of the table\n",
     "routepack policy list"},
    {"policy", "check", cmd_policy_check, "POLICY.lua [--config C] [--trace T [--step K]]",
     "load a policy in the sandbox, show its metadata and what it does on a small batch",
     "  POLICY.lua         the policy file to try\n"
     "  --config C         config (default: the bundled config-small.json)\n"
     "  --trace T          run the policy on this trace's step (default: the bundled\n"
     "                     example's first step, from gen-example.json)\n"
     "  --step K           which step of --trace, counted from 0 (default 0)\n",
     "routepack policy check policies/eplb.lua"},
    {"plan", "baseline", cmd_plan_baseline,
     "NAME --config C (--trace T | --gen SETTINGS) [--step K] [--microbatches M] [--out PLAN.json]",
     "build a baseline plan (token_kk+eplb, verl_kk+contiguous, ...) for one step",
     "  NAME               the baseline (docs/baselines.md lists them)\n"
     "  --config C         config (required)\n"
     "  --trace T          the trace\n"
     "  --gen SETTINGS     generate the step in memory instead of reading a trace\n"
     "  --step K           which step, counted from 0 (default 0)\n"
     "  --microbatches M   microbatch count (default: the config's, else verl's rule)\n"
     "  --out PLAN.json    write the plan there (default: the plan to stdout)\n",
     "routepack plan baseline token_kk+eplb --config examples/config-small.json "
     "--trace examples/small.rpt --out plan.json"},
    {"plan", "eval", cmd_plan_eval,
     "--config C (--trace T | --gen SETTINGS) [--step K] --plan PLAN.json [--json]",
     "cost breakdown of a plan: step time, lower bound, straggler",
     "  --config C         config (required)\n"
     "  --trace T          the trace\n"
     "  --gen SETTINGS     generate the step in memory instead of reading a trace\n"
     "  --step K           which step, counted from 0 (default 0)\n"
     "  --plan PLAN.json   the plan to price (required)\n"
     "  --json             the breakdown as JSON instead of text\n",
     "routepack plan eval --config examples/config-small.json --trace examples/small.rpt "
     "--plan plan.json"},
    {"plan", "validate", cmd_plan_validate,
     "--config C [(--trace T | --gen SETTINGS) [--step K]] PLAN.json",
     "check a plan file; print every violation",
     "  PLAN.json          the plan to check\n"
     "  --config C         config (required)\n"
     "  --trace T          also check against this trace's step\n"
     "  --gen SETTINGS     ... or against a step generated in memory\n"
     "  --step K           which step, counted from 0 (default 0)\n",
     "routepack plan validate --config examples/config-small.json plan.json"},
    {"memory", NULL, cmd_memory, "[--config C] [--plan PLAN.json] [--json]",
     "memory per GPU: expert slots, dense parameters, optimizer state, extra replicas, staging",
     "  --config C         config (default: the bundled config-small.json)\n"
     "  --plan PLAN.json   also count this plan's extra replicas\n"
     "  --json             the figures as JSON instead of the table\n"
     "                     (exit 1 when a GPU needs more than hardware.hbm_bytes)\n",
     "routepack memory --config examples/config-reference.json"},
};
#define NUM_COMMANDS (sizeof commands / sizeof commands[0])

static size_t command_options(const cli_command *c, const char **out, size_t cap);

/* An unknown option a command met (cli_unknown_option): the closest option its help page
 * names, or where to look. */
static int print_unknown_option(const char *command, const char *option)
{
    const char *names[66];
    size_t n = 0;
    for (size_t i = 0; i < NUM_COMMANDS && !n; i++) {
        const cli_command *c = &commands[i];
        size_t g = strlen(c->group);
        if (!strncmp(command, c->group, g) &&
            (c->name ? command[g] == ' ' && !strcmp(command + g + 1, c->name) : command[g] == '\0'))
            n = command_options(c, names, sizeof names / sizeof names[0]);
    }
    const char *near = cli_closest(option, names, n);
    if (near) return cli_usage("%s: unknown option '%s' (did you mean '%s'?)", command, option, near);
    return cli_usage("%s: unknown option '%s' (try: routepack help %s)", command, option, command);
}

static void print_usage(FILE *out)
{
    fprintf(out, "usage: routepack COMMAND [ARGS]\n\ncommands:\n");
    for (size_t i = 0; i < NUM_COMMANDS; i++) {
        const cli_command *c = &commands[i];
        fprintf(out, "  %s%s%s %s\n      %s\n", c->group, c->name ? " " : "", c->name ? c->name : "",
                c->usage, c->summary);
    }
    fprintf(out, "  version\n      print the library version and the parts this build has\n");
    fprintf(out, "\nDocumentation: docs/cli.md; `routepack help COMMAND` or `routepack COMMAND --help`\n"
                 "for one command's options.\n");
}

static void print_command_help(const cli_command *c)
{
    const char *sub = c->name ? " " : "";
    printf("usage: routepack %s%s%s %s\n\n%s.\n\noptions:\n%s  --quiet            no progress line (shown on a terminal for work over ~2 s)\n"
           "  --help, -h         this page\n\n"
           "example:\n  %s\n",
           c->group, sub, c->name ? c->name : "", c->usage, c->summary, c->options, c->example);
}

/* The help page for `group [name]`: one command's page, or a group's subcommands. */
static int print_help_for(const char *group, const char *name)
{
    if (!strcmp(group, "version")) {
        printf("usage: routepack version\n\nprint the library version and the parts this build has.\n");
        return CLI_OK;
    }
    bool known_group = false;
    for (size_t i = 0; i < NUM_COMMANDS; i++) {
        const cli_command *c = &commands[i];
        if (strcmp(group, c->group) != 0) continue;
        known_group = true;
        if (!c->name || (name && !strcmp(name, c->name))) {
            print_command_help(c);
            return CLI_OK;
        }
    }
    if (!known_group) return cli_usage("help: unknown command '%s' (try: routepack help)", group);
    if (name) return cli_usage("help: '%s' has no subcommand '%s' (try: routepack help %s)", group, name, group);
    printf("usage: routepack %s SUBCOMMAND [ARGS]\n\nsubcommands:\n", group);
    for (size_t i = 0; i < NUM_COMMANDS; i++)
        if (!strcmp(group, commands[i].group) && commands[i].name) /* top-level commands have none */
            printf("  %s %s %s\n      %s\n", group, commands[i].name, commands[i].usage, commands[i].summary);
    printf("\n`routepack help %s SUBCOMMAND` for one subcommand's options.\n", group);
    return CLI_OK;
}

static bool asks_for_help(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return true;
    return false;
}

static void log_to_stderr(void *ud, rp_log_level level, const char *message)
{
    (void)ud;
    static const char *names[] = {"debug", "info", "warning", "error"};
    fprintf(stderr, "routepack: %s: %s\n", names[level], message);
}

/* The options a command's help page names ("--config", ...; --quiet and --help for
 * all), collected from its usage line and options text into `out` (static storage). */
static size_t command_options(const cli_command *c, const char **out, size_t cap)
{
    static char words[64][32];
    size_t n = 0;
    const char *texts[2] = {c->usage, c->options};
    out[n++] = "--quiet", out[n++] = "--help";
    for (int t = 0; t < 2; t++)
        for (const char *p = texts[t]; (p = strstr(p, "--")) != NULL;) {
            size_t len = 2;
            while ((p[len] >= 'a' && p[len] <= 'z') || p[len] == '-') len++;
            bool seen = len == 2 || len >= sizeof words[0];
            for (size_t i = 0; i < n && !seen; i++) seen = strlen(out[i]) == len && !strncmp(out[i], p, len);
            if (!seen && n < cap && n - 2 < sizeof words / sizeof words[0]) {
                memcpy(words[n - 2], p, len);
                words[n - 2][len] = '\0';
                out[n] = words[n - 2];
                n++;
            }
            p += len;
        }
    return n;
}

static int version(void)
{
    printf("routepack %s (CUDA kernels: %s, GPUs visible: %d)\n", RP_VERSION_STRING,
           rp_gpu_built() ? "built" : "not built", rp_gpu_count());
    return CLI_OK;
}

int main(int argc, char **argv)
{
    if (argc < 2 || (!strcmp(argv[1], "help") && argc == 2) || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "-h")) {
        print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    if (!strcmp(argv[1], "help")) {
        if (argc > 4) return cli_usage("help takes a command and a subcommand at most (try: routepack help)");
        return print_help_for(argv[2], argc > 3 ? argv[3] : NULL);
    }
    /* --quiet, anywhere after the command: no progress line (core/cli/progress.c) */
    int kept = 2;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--quiet")) cli_progress_quiet(true);
        else argv[kept++] = argv[i];
    }
    argc = kept;
    if (asks_for_help(argc - 2, argv + 2)) {
        /* `routepack trace gen ... --help`: the subcommand's page when the word after the
         * group is one of its subcommands, else the group's page */
        return print_help_for(argv[1], argc > 2 && argv[2][0] != '-' ? argv[2] : NULL);
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
        rp_context_set_progress(ctx, cli_progress_hook, NULL);
        int rc = c->run(ctx, argc - first, argv + first);
        rp_context_free(ctx);
        const char *command, *option;
        if (cli_unknown_option_taken(&command, &option)) return print_unknown_option(command, option);
        return rc;
    }
    /* a known group without one of its subcommands: list them */
    char names[256] = "";
    size_t used = 0;
    const char *subs[NUM_COMMANDS], *groups[NUM_COMMANDS + 2] = {"help", "version"};
    size_t num_subs = 0, num_groups = 2;
    for (size_t i = 0; i < NUM_COMMANDS; i++) {
        bool seen = false;
        for (size_t j = 0; j < num_groups && !seen; j++) seen = !strcmp(groups[j], commands[i].group);
        if (!seen) groups[num_groups++] = commands[i].group;
        if (commands[i].name && !strcmp(argv[1], commands[i].group)) {
            subs[num_subs++] = commands[i].name;
            if (used < sizeof names)
                used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", commands[i].name);
        }
    }
    if (used) {
        const char *near = argc > 2 ? cli_closest(argv[2], subs, num_subs) : NULL;
        if (near) cli_usage("%s: unknown subcommand '%s' (did you mean '%s %s'?)", argv[1], argv[2], argv[1], near);
        else if (argc > 2) cli_usage("%s: unknown subcommand '%s' (subcommands: %s)", argv[1], argv[2], names);
        else cli_usage("%s needs a subcommand: %s (try: routepack help)", argv[1], names);
        return CLI_USAGE;
    }
    const char *near = cli_closest(argv[1], groups, num_groups);
    if (near)
        cli_usage("unknown command '%s' (did you mean '%s'? try: routepack help)", argv[1], near);
    else
        cli_usage("unknown command '%s%s%s' (try: routepack help)", argv[1], argc > 2 ? " " : "",
                  argc > 2 ? argv[2] : "");
    return CLI_USAGE;
}
