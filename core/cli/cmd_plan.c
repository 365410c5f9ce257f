/* `routepack plan baseline | eval | validate`: build a baseline plan for one step, price
 * a plan with the cost model (breakdown, straggler, step / lower bound), and check a
 * plan file, listing every violation. What a user debugging a slow step reaches for. */
#include "cli.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

typedef struct plan_opts {
    const char *name, *config, *trace, *gen, *plan, *out;
    int64_t step, microbatches;
    bool have_step, json;
} plan_opts;

/* Options of the three subcommands; `positional` receives the one non-option argument
 * (NULL when none is accepted). */
static int parse_plan_opts(const char *cmd, int argc, char **argv, plan_opts *o, const char **positional,
                           bool allow_out, bool allow_json, bool allow_plan, bool allow_mbs)
{
    memset(o, 0, sizeof *o);
    const char *step = NULL, *mbs = NULL, *out = NULL, *plan = NULL;
    bool bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--config", &o->config, &bad) ||
            cli_opt(argc, argv, &i, "--trace", &o->trace, &bad) ||
            cli_opt(argc, argv, &i, "--gen", &o->gen, &bad) || cli_opt(argc, argv, &i, "--step", &step, &bad))
            continue;
        if (allow_out && cli_opt(argc, argv, &i, "--out", &out, &bad)) continue;
        if (allow_plan && cli_opt(argc, argv, &i, "--plan", &plan, &bad)) continue;
        if (allow_mbs && cli_opt(argc, argv, &i, "--microbatches", &mbs, &bad)) continue;
        if (allow_json && !strcmp(argv[i], "--json")) {
            o->json = true;
            continue;
        }
        if (argv[i][0] == '-' && argv[i][1]) {
            char command[32];
            snprintf(command, sizeof command, "plan %s", cmd);
            return cli_unknown_option(command, argv[i]);
        }
        if (!positional) return cli_usage("plan %s takes no positional argument, got '%s'", cmd, argv[i]);
        if (*positional) return cli_usage("plan %s: one argument expected, got '%s' and '%s'", cmd, *positional, argv[i]);
        *positional = argv[i];
    }
    if (bad) return CLI_USAGE;
    o->out = out;
    o->plan = plan;
    if (o->trace && o->gen) return cli_usage("plan %s: give --trace or --gen, not both", cmd);
    if (!o->config) return cli_usage("plan %s needs --config CONFIG.json", cmd);
    if (o->out && cli_check_output_file("--out", o->out) != CLI_OK) return CLI_USAGE;
    if (step) {
        if (!cli_int("--step", step, &o->step)) return CLI_USAGE;
        if (o->step < 0 || o->step > INT32_MAX) return cli_usage("--step must be >= 0, got %s", step);
        o->have_step = true;
    }
    if (mbs) {
        if (!cli_int("--microbatches", mbs, &o->microbatches)) return CLI_USAGE;
        if (o->microbatches < 1 || o->microbatches > (1 << 20))
            return cli_usage("--microbatches must be in [1, 1048576], got %s", mbs);
    }
    return CLI_OK;
}

/* One step of the run: config, batch, routing and statistics. */
typedef struct plan_step {
    rp_config *cfg;
    cli_input in;
    rp_batch *batch;
    rp_routing routing;
    rp_stats *stats;
    int64_t step_index; /* as recorded */
} plan_step;

static void plan_step_free(plan_step *s)
{
    rp_stats_free(s->stats);
    rp_batch_free(s->batch);
    cli_input_close(&s->in);
    rp_config_free(s->cfg);
    memset(s, 0, sizeof *s);
}

/* Load the config and, when a trace or settings are given, the step's batch (with its
 * statistics when `stats`). */
static int plan_step_open(rp_context *ctx, const plan_opts *o, bool stats, plan_step *s)
{
    memset(s, 0, sizeof *s);
    rp_error err;
    rp_error_clear(&err);
    if (cli_config_load(ctx, o->config, 0, &s->cfg, &err) != RP_OK) return cli_fail(&err);
    if (!o->trace && !o->gen) return CLI_OK;
    if (cli_input_open(ctx, o->trace, o->gen, &s->in, &err) != RP_OK ||
        cli_input_check(&s->in, s->cfg, &err) != RP_OK)
        return cli_fail(&err);
    if (s->in.trace && o->step >= s->in.num_steps)
        return cli_usage("%s has %d step%s (0 to %d), --step %" PRId64 " does not exist", s->in.path,
                         s->in.num_steps, s->in.num_steps == 1 ? "" : "s", s->in.num_steps - 1, o->step);
    if (cli_input_read(&s->in, (int32_t)o->step, &s->batch, &s->routing, &s->step_index, &err) != RP_OK)
        return cli_fail(&err);
    if (stats && rp_stats_compute(ctx, s->batch, &s->routing, s->in.num_experts, 0, &s->stats, &err) != RP_OK) {
        fprintf(stderr, "routepack: %s: step %" PRId64 ": %s\n", s->in.path, o->step, err.text);
        return CLI_FAIL;
    }
    return CLI_OK;
}

/* The split rule the scheduler prices plans with, so plan eval agrees with simulate. */
static rp_split_rule default_split(void)
{
    rp_sched_options opts;
    rp_sched_options_default(&opts);
    return opts.split;
}

static void print_violation(void *ud, const char *message)
{
    FILE *f = ud;
    fprintf(f, "%s\n", message);
}

int cmd_plan_baseline(rp_context *ctx, int argc, char **argv)
{
    plan_opts o;
    const char *name = NULL;
    int rc = parse_plan_opts("baseline", argc, argv, &o, &name, true, false, false, true);
    if (rc != CLI_OK) return rc;
    if (!name || (!o.trace && !o.gen))
        return cli_usage("usage: routepack plan baseline NAME --config C --trace T [--step K] "
                         "[--microbatches M] [--out PLAN.json]");
    plan_step s;
    rp_plan *plan = NULL;
    rp_cost *cost = NULL;
    char *text = NULL;
    rp_error err;
    rp_error_clear(&err);
    if ((rc = plan_step_open(ctx, &o, true, &s)) != CLI_OK) goto out;
    rp_cost_summary sum;
    size_t len;
    if (rp_baseline_plan(ctx, s.cfg, s.batch, s.stats, NULL, name, (int32_t)o.microbatches, &plan, &err) != RP_OK ||
        rp_plan_validate(plan, s.cfg, s.batch, &err) != RP_OK ||
        rp_cost_new(ctx, s.cfg, s.batch, s.stats, default_split(), &cost, &err) != RP_OK ||
        rp_cost_evaluate(cost, plan, &sum, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    char line[512];
    snprintf(line, sizeof line, "%s for step %" PRId64 " of %s: %d ranks x %d microbatch%s; step %.3f ms, "
             "lower bound %.3f ms, step / lower bound %.3f", name, o.step, s.in.path, rp_plan_num_gpus(plan),
             rp_plan_num_microbatches(plan), rp_plan_num_microbatches(plan) == 1 ? "" : "es", sum.step_s * 1e3,
             sum.lower_bound_s * 1e3, sum.ratio);
    if (o.out) {
        if (rp_plan_save(plan, o.out, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        printf("%s: %s\n", o.out, line);
    } else {
        /* the plan alone on stdout, so it can be piped; the summary on stderr */
        if (rp_plan_to_json(plan, &text, &len, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        if (fwrite(text, 1, len, stdout) != len) rc = CLI_FAIL;
        fprintf(stderr, "routepack: %s\n", line);
    }
    if (fflush(stdout) != 0) {
        fprintf(stderr, "routepack: could not write the output\n");
        rc = CLI_FAIL;
    }
out:
    rp_text_free(ctx, text);
    rp_cost_free(cost);
    rp_plan_free(plan);
    plan_step_free(&s);
    return rc;
}

/* Load a plan and check it against the step; violations go to stderr. */
static int load_valid_plan(rp_context *ctx, const char *path, const plan_step *s, rp_plan **plan)
{
    rp_error err;
    rp_error_clear(&err);
    if (rp_plan_load(ctx, s->cfg, path, plan, &err) != RP_OK) return cli_fail(&err);
    if (!rp_plan_has_packing(*plan) || !rp_plan_has_placement(*plan)) {
        fprintf(stderr, "routepack: %s: the cost model needs both a packing and a placement; this plan "
                "has %s\n", path, rp_plan_has_packing(*plan) ? "no placement" :
                rp_plan_has_placement(*plan) ? "no packing" : "neither");
        return CLI_FAIL;
    }
    int32_t n = rp_plan_check(*plan, s->cfg, s->batch, print_violation, stderr);
    if (n > 0) {
        fprintf(stderr, "routepack: %s: %d problem%s with step %" PRId64 " of %s; cannot evaluate it\n", path,
                n, n == 1 ? "" : "s", s->step_index, s->in.path);
        return CLI_FAIL;
    }
    return CLI_OK;
}

/* Text breakdown: figures, straggler, slowest layers, per microbatch and per GPU. */
static void print_eval_text(const char *path, const plan_step *s, const rp_plan *plan, const rp_cost *cost,
                            const rp_cost_summary *sum)
{
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan), L = rp_plan_num_layers(plan);
    const rp_topology *t = rp_config_topology(s->cfg);
    const rp_backward *bwd = &rp_config_hardware(s->cfg)->backward;
    printf("%s on step %" PRId64 " of %s (%d sequences, %" PRId64 " tokens): %d ranks x %d microbatch%s, "
           "%d MoE layers\n\n", path, s->step_index, s->in.path, rp_batch_num_seqs(s->batch),
           rp_batch_num_tokens(s->batch), G, M, M == 1 ? "" : "es", L);
    printf("step time            %10.3f ms  (forward and backward; backward / forward: attention %.2f, "
           "experts %.2f, communication %.2f)\n",
           sum->step_s * 1e3, bwd->attention, bwd->experts, bwd->communication);
    const rp_execution *x = rp_config_execution(s->cfg);
    static const char *const sync_words[] = {"group (the slowest EP group's own sum)", "global (every layer waits for the slowest GPU)"};
    static const char *const dedup_words[] = {"per token-choice", "per destination GPU", "per destination node"};
    printf("execution            sync %s, overlap %s, dispatch %s at %d byte%s per element, combine at %d\n",
           sync_words[x->sync], x->overlap == RP_OVERLAP_LAYER ? "layer" : "none", dedup_words[x->dispatch_dedup],
           x->dispatch_bytes_per_element, x->dispatch_bytes_per_element == 1 ? "" : "s", x->combine_bytes_per_element);
    printf("lower bound          %10.3f ms\n", sum->lower_bound_s * 1e3);
    printf("step / lower bound   %10.3f\n", sum->ratio);
    rp_pipeline_summary pipe;
    if (t->pipeline_parallel_size > 1 && rp_cost_pipeline_summary(cost, &pipe, NULL) == RP_OK) {
        /* the step is the pipeline's; the terms below are work summed over every stage */
        printf("pipeline             %d stages: the step is the schedule's critical path plus the gradient "
               "reduction and extra copies\n", pipe.stages);
        printf("  critical path      %10.3f ms\n", pipe.critical_path_s * 1e3);
        printf("  busiest stage      %10.3f ms  (stage %d's passes, forward and backward, every microbatch)\n",
               pipe.stage_busy_s * 1e3, pipe.busiest_stage);
        printf("  bubble             %10.3f ms  (that stage idle: warm-up, cool-down, p2p, other stages)\n",
               pipe.bubble_s * 1e3);
        printf("  dense (attention)  %10.3f ms  } each: sum over microbatches and the layers of every stage\n",
               sum->attention_s * 1e3);
        printf("  dispatch           %10.3f ms  } of the slowest GPU's term: work, not time along the\n",
               sum->dispatch_s * 1e3);
        printf("                                   pipeline (the stages run at once)\n");
    } else {
        printf("  dense (attention)  %10.3f ms  } each: sum over microbatches and layers of the slowest\n",
               sum->attention_s * 1e3);
        printf("  dispatch           %10.3f ms  } GPU's term (in the slowest group under group sync);\n",
               sum->dispatch_s * 1e3);
        printf("                                   with overlap they add up to more than the step\n");
    }
    printf("  expert             %10.3f ms\n", sum->expert_s * 1e3);
    printf("  combine            %10.3f ms\n", sum->combine_s * 1e3);
    printf("  gradient reduce    %10.3f ms  (extra, for replicas)\n", sum->grad_reduce_s * 1e3);
    printf("  extra copies       %10.3f ms  (per-microbatch extra replicas)\n", sum->extra_copy_s * 1e3);
    printf("attention imbalance  %10.3f     (max/mean across GPUs, mean over microbatches)\n",
           sum->attention_imbalance);
    printf("expert imbalance     %10.3f     (max/mean across GPUs of an EP group, mean over microbatches, "
           "layers, groups)\n", sum->expert_imbalance);
    printf("straggler            GPU %d (node %d), microbatch %d, layer %d, %s side (the largest single "
           "term)\n\n", sum->straggler_gpu,
           t->gpus_per_node > 0 ? sum->straggler_gpu / t->gpus_per_node : 0, sum->straggler_mb,
           sum->straggler_layer, cli_side_name(sum->straggler_side));

    /* the five slowest (microbatch, layer) pairs: where to look first */
    int32_t top[5] = {-1, -1, -1, -1, -1};
    for (int32_t ml = 0; ml < M * L; ml++) {
        double v = rp_cost_layer_s(cost, ml / L, ml % L);
        for (int k = 0; k < 5; k++) {
            if (top[k] < 0 || v > rp_cost_layer_s(cost, top[k] / L, top[k] % L)) {
                memmove(top + k + 1, top + k, (size_t)(4 - k) * sizeof *top);
                top[k] = ml;
                break;
            }
        }
    }
    printf("slowest layers (forward and backward):\n   mb  layer   time ms  straggler\n");
    for (int k = 0; k < 5 && top[k] >= 0; k++) {
        int32_t gpu;
        rp_side side = rp_cost_layer_straggler(cost, top[k] / L, top[k] % L, &gpu);
        printf("  %3d  %5d  %8.4f  GPU %d, %s\n", top[k] / L, top[k] % L,
               rp_cost_layer_s(cost, top[k] / L, top[k] % L) * 1e3, gpu, cli_side_name(side));
    }

    const double *A = rp_cost_attention_breakdown(cost), *D = rp_cost_dispatch_breakdown(cost);
    const double *X = rp_cost_expert_breakdown(cost), *C = rp_cost_combine_breakdown(cost);
    printf("\nper microbatch (time forward and backward; sides: how many layers each side decides):\n"
           "   mb  max tokens  time ms  attention max/mean  attention/dispatch/expert\n");
    for (int32_t m = 0; m < M; m++) {
        double time = 0, amax = 0, asum = 0;
        int32_t sides[4] = {0, 0, 0, 0};
        int64_t max_tokens = 0;
        for (int32_t l = 0; l < L; l++) {
            int32_t gpu;
            time += rp_cost_layer_s(cost, m, l);
            sides[rp_cost_layer_straggler(cost, m, l, &gpu) & 3]++;
        }
        for (int32_t g = 0; g < G; g++) {
            double a = A[(size_t)g * M + m];
            amax = a > amax ? a : amax;
            asum += a;
            int32_t count;
            const int32_t *ids = rp_plan_microbatch(plan, g, m, &count);
            int64_t tokens = 0;
            for (int32_t i = 0; i < count; i++) tokens += rp_batch_seq_len(s->batch, ids[i]);
            max_tokens = tokens > max_tokens ? tokens : max_tokens;
        }
        printf("  %3d  %10" PRId64 "  %7.3f  %18.3f  %d/%d/%d\n", m, max_tokens, time * 1e3,
               asum > 0 ? amax / (asum / G) : 1.0, sides[RP_SIDE_ATTENTION], sides[RP_SIDE_DISPATCH],
               sides[RP_SIDE_EXPERT]);
    }

    printf("\nper GPU (forward, ms, summed over microbatches and layers):\n"
           "  gpu  node  sequences   tokens  attention  dispatch    expert   combine\n");
    for (int32_t g = 0; g < G; g++) {
        double a = 0, d = 0, x = 0, c = 0;
        int64_t tokens = 0;
        int32_t seqs = 0;
        for (int32_t m = 0; m < M; m++) {
            a += A[(size_t)g * M + m] * L;
            int32_t count;
            const int32_t *ids = rp_plan_microbatch(plan, g, m, &count);
            seqs += count;
            for (int32_t i = 0; i < count; i++) tokens += rp_batch_seq_len(s->batch, ids[i]);
            for (int32_t l = 0; l < L; l++) {
                size_t at = ((size_t)m * L + l) * G + g;
                d += D[at];
                x += X[at];
                c += C[at];
            }
        }
        printf("  %3d  %4d  %9d  %7" PRId64 "  %9.3f  %8.3f  %8.3f  %8.3f\n", g,
               t->gpus_per_node > 0 ? g / t->gpus_per_node : 0, seqs, tokens, a * 1e3, d * 1e3, x * 1e3, c * 1e3);
    }
}

int cmd_plan_eval(rp_context *ctx, int argc, char **argv)
{
    plan_opts o;
    int rc = parse_plan_opts("eval", argc, argv, &o, NULL, false, true, true, false);
    if (rc != CLI_OK) return rc;
    if (!o.plan || (!o.trace && !o.gen))
        return cli_usage("usage: routepack plan eval --config C --trace T [--step K] --plan PLAN.json [--json]");
    plan_step s;
    rp_plan *plan = NULL;
    rp_cost *cost = NULL;
    char *text = NULL;
    rp_error err;
    rp_error_clear(&err);
    if ((rc = plan_step_open(ctx, &o, true, &s)) != CLI_OK) goto out;
    if ((rc = load_valid_plan(ctx, o.plan, &s, &plan)) != CLI_OK) goto out;
    rp_cost_summary sum;
    if (rp_cost_new(ctx, s.cfg, s.batch, s.stats, default_split(), &cost, &err) != RP_OK ||
        rp_cost_evaluate(cost, plan, &sum, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    if (!o.json) {
        print_eval_text(o.plan, &s, plan, cost, &sum);
    } else {
        size_t len;
        if (rp_cost_breakdown_json(cost, &text, &len, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        json_error_t jerr;
        json_t *breakdown = json_loadb(text, len, 0, &jerr);
        char hash[17];
        snprintf(hash, sizeof hash, "%016" PRIx64, rp_plan_hash(plan));
        json_t *root = breakdown ? json_pack("{s:s, s:i, s:s, s:s, s:I, s:s, s:s, s:o}", "format",
                                             "routepack-plan-eval", "version", 1, "config", o.config,
                                             "input", s.in.path, "step", (json_int_t)s.step_index, "plan",
                                             o.plan, "plan_hash", hash, "breakdown", breakdown)
                                 : NULL;
        /* the busiest GPU's memory with the plan's extra replicas (routepack memory) */
        rp_gpu_memory mem;
        if (root && rp_memory_peak(s.cfg, plan, &mem, &err) == RP_OK)
            json_object_set_new(root, "memory", cli_memory_json(&mem));
        if (!cli_print_json(root, 17)) {
            fprintf(stderr, "routepack: could not write the JSON output\n");
            rc = CLI_FAIL;
        }
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    rp_text_free(ctx, text);
    rp_cost_free(cost);
    rp_plan_free(plan);
    plan_step_free(&s);
    return rc;
}

int cmd_plan_validate(rp_context *ctx, int argc, char **argv)
{
    plan_opts o;
    const char *path = NULL;
    int rc = parse_plan_opts("validate", argc, argv, &o, &path, false, false, false, false);
    if (rc != CLI_OK) return rc;
    if (!path) return cli_usage("usage: routepack plan validate --config C [--trace T [--step K]] PLAN.json");
    if (o.have_step && !o.trace && !o.gen) return cli_usage("plan validate: --step needs --trace");
    plan_step s;
    rp_plan *plan = NULL;
    rp_error err;
    rp_error_clear(&err);
    if ((rc = plan_step_open(ctx, &o, false, &s)) != CLI_OK) goto out;
    if (rp_plan_load(ctx, s.cfg, path, &plan, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    int32_t n = rp_plan_check(plan, s.cfg, s.batch, print_violation, stdout);
    if (n > 0) {
        fprintf(stderr, "routepack: %s: %d problem%s\n", path, n, n == 1 ? "" : "s");
        rc = CLI_FAIL;
    } else {
        printf("%s: valid (%d ranks x %d microbatch%s%s%s)", path, rp_plan_num_gpus(plan),
               rp_plan_num_microbatches(plan), rp_plan_num_microbatches(plan) == 1 ? "" : "es",
               rp_plan_has_packing(plan) ? ", packing" : "",
               rp_plan_has_placement(plan) ? ", placement" : "");
        if (s.batch)
            printf(" against step %" PRId64 " of %s\n", s.step_index, s.in.path);
        else
            printf("; without --trace the token caps and the sequence count are not checked\n");
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    rp_plan_free(plan);
    plan_step_free(&s);
    return rc;
}
