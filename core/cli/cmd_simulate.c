/* `routepack simulate`: run several policies over the same steps, each in its own
 * scheduler, and compare them side by side (a table, JSON, or an HTML report).
 * The run loop; its input is cli/sim_input.c, its outputs cli/sim_output.c (cli/sim.h). */
#include "cli.h"
#include "sim.h"
#include "fallback_reasons.h"
#include "levers.h"
#include "internal.h"
#include "sched_internal.h"
#include "report.h"
#include "routepack/executor.h"
#include "routepack/memory.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- the simulation ---- */

static char *dup_or_null(const char *s)
{
    return s && s[0] ? strdup(s) : NULL;
}

static bool file_changed(const struct stat *a, const struct stat *b)
{
    return a->st_mtim.tv_sec != b->st_mtim.tv_sec || a->st_mtim.tv_nsec != b->st_mtim.tv_nsec ||
           a->st_size != b->st_size || a->st_ino != b->st_ino;
}

/* --watch: when the file changed since it was last seen, stage its new text. */
static void watch_check(sim_policy *p, int64_t step)
{
    struct stat now;
    if (stat(p->spec, &now) != 0) {
        cli_progress_clear();
        fprintf(stderr, "routepack: watch: %s: %s; the running policy stays\n", p->spec, strerror(errno));
        return;
    }
    if (!file_changed(&now, &p->seen)) return;
    p->seen = now;
    size_t len;
    char *text = NULL;
    rp_error err;
    /* the library's reader: a FIFO or device put in the policy's place is refused, not
     * waited on, and a file over the policy size cap is not read */
    rp_status rst = rp_read_file_max(p->ctx, p->spec, RP_POLICY_MAX_BYTES, &text, &len, &err);
    cli_progress_clear();
    if (rst != RP_OK) {
        fprintf(stderr, "routepack: watch: cannot read %s; the running policy stays\n", err.text);
        return;
    }
    rp_error_clear(&err);
    if (rp_sched_stage_policy(p->sched, p->spec, text, -1, &err) != RP_OK)
        fprintf(stderr, "routepack: watch: %s changed; not staged: %s; the running policy stays\n",
                p->spec, err.text[0] ? err.text : rp_strerror(err.status));
    else
        fprintf(stderr, "routepack: watch: %s changed; staged for step %" PRId64 "\n", p->spec, step);
    rp_text_free(p->ctx, text);
}

static void record_step(step_rec *r, const rp_step_report *rep, const rp_plan *plan,
                        const rp_migration_plan *migration, const rp_config *cfg)
{
    const int32_t logprob_forwards = rp_config_trainer(cfg)->logprob_forwards;
    memset(r, 0, sizeof *r);
    r->moe_s = rep->cost.step_s + logprob_forwards * rep->forward_s;
    r->outside_s = rep->outside.total_s;
    r->step = rep->step;
    r->cost = rep->cost;
    r->num_microbatches = plan ? rp_plan_num_microbatches(plan) : 0;
    r->plan_s = rep->plan_wall_s;
    r->policy_work = rep->policy_work;
    r->fallback = rep->fallback;
    r->swapped = rep->swapped;
    r->fallback_reason = dup_or_null(rep->fallback_reason);
    r->swap_error = dup_or_null(rep->swap_error);
    if (rep->demoted || rep->demote_error[0]) {
        char text[RP_ERROR_TEXT + 128];
        if (rep->demoted)
            snprintf(text, sizeof text, "demoted after %d steps in a row fell back: '%s' runs from the next step",
                     (int)rep->failed_steps, rep->demoted_to);
        else
            snprintf(text, sizeof text, "demoting it failed: %s", rep->demote_error);
        r->demotion = dup_or_null(text);
    }
    snprintf(r->policy_name, sizeof r->policy_name, "%s", rep->policy_name);
    snprintf(r->policy_version, sizeof r->policy_version, "%s", rep->policy_version);
    r->policy_hash = rep->policy_hash;
    r->plan_hash = rep->plan_hash;
    r->experts_moved = rep->experts_moved;
    r->migration_bytes = rep->migration_bytes;
    r->migration_s = rep->migration_s;
    r->metrics = rp_step_metrics_json(rep);
    r->levers = cli_levers_json(plan, cfg);
    if (migration) {
        rp_migration_summary sum;
        rp_migration_plan_summary(migration, &sum);
        r->migration_rounds = sum.num_rounds;
        r->migration_staging_bytes = sum.max_staging_bytes;
    }
}

/* Price the step's plan with our own evaluator (built for the step with the scheduler's
 * split rule, so the arrays are the cost model's own): keep each GPU's expert time, and
 * the per-GPU breakdown at the step's straggler (microbatch, layer). */
static rp_status track_step(sim_policy *p, rp_cost *cost, const rp_plan *plan, const rp_config *cfg,
                            rp_error *err)
{
    int32_t last = p->num_steps - 1;
    rp_cost_summary sum;
    rp_status st = rp_cost_evaluate(cost, plan, &sum, err);
    if (st != RP_OK) return st;
    rp_gpu_memory mem;
    if ((st = rp_memory_peak(cfg, plan, &mem, err)) != RP_OK) return st;
    if (!p->have_memory || mem.total_bytes > p->memory_peak.total_bytes) p->memory_peak = mem, p->have_memory = true;
    const int32_t G = rp_config_topology(cfg)->num_gpus, L = rp_config_model(cfg)->num_layers;
    const int32_t M = rp_plan_num_microbatches(plan);
    const double *A = rp_cost_attention_breakdown(cost), *D = rp_cost_dispatch_breakdown(cost);
    const double *X = rp_cost_expert_breakdown(cost), *C = rp_cost_combine_breakdown(cost);
    double *rows = p->expert_by_step + (size_t)last * L * G;
    for (int32_t l = 0; l < L; l++)
        for (int32_t g = 0; g < G; g++) {
            double total = 0;
            for (int32_t m = 0; m < M; m++) total += X[((size_t)m * L + l) * G + g];
            rows[(size_t)l * G + g] = total;
        }
    int32_t mb = sum.straggler_mb, layer = sum.straggler_layer;
    if (mb < 0 || mb >= M || layer < 0 || layer >= L)
        return rp_fail(err, RP_EINVAL, "the cost model named microbatch %d layer %d as the straggler "
                         "of a plan with %d microbatches and %d layers", mb, layer, M, L);
    int32_t *at_step = p->straggler + (size_t)last * 4;
    at_step[0] = mb, at_step[1] = layer, at_step[2] = sum.straggler_gpu, at_step[3] = (int32_t)sum.straggler_side;
    const size_t row = (size_t)last * G;
    for (int32_t g = 0; g < G; g++) {
        size_t at = ((size_t)mb * L + layer) * G + g;
        p->attention[row + g] = A[(size_t)g * M + mb];
        p->dispatch[row + g] = D[at];
        p->expert[row + g] = X[at];
        p->combine[row + g] = C[at];
    }
    p->tracked = p->num_steps;
    return RP_OK;
}

static void free_policies(sim_policy *pol, int np)
{
    for (int i = 0; i < np; i++) {
        sim_policy *p = &pol[i];
        rp_sched_free(p->sched);
        for (int32_t k = 0; k < p->num_steps; k++) {
            free(p->steps[k].fallback_reason);
            free(p->steps[k].swap_error);
            free(p->steps[k].demotion);
            json_decref(p->steps[k].metrics);
            json_decref(p->steps[k].levers);
        }
        free(p->steps);
        free(p->name);
        free(p->params_json);
        free(p->error);
        free(p->straggler);
        free(p->attention);
        free(p->dispatch);
        free(p->expert);
        free(p->combine);
        free(p->expert_by_step);
    }
    free(pol);
}

/* --plans DIR: the plan a policy ran at a step, as DIR/<policy>/step-<index>.json, where
 * <policy> is the spec (a path's file name without .lua) with characters other than
 * letters, digits and "+-._" replaced by "_". */
static rp_status save_step_plan(const char *dir, const char *spec, int64_t step, const rp_plan *plan,
                                rp_error *err)
{
    const char *base = strrchr(spec, '/');
    base = base ? base + 1 : spec;
    char name[256];
    size_t n = strlen(base);
    if (n > 4 && !strcmp(base + n - 4, ".lua")) n -= 4;
    if (n >= sizeof name) n = sizeof name - 1;
    for (size_t i = 0; i < n; i++) {
        char c = base[i];
        bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '+' || c == '-' || c == '.' || c == '_';
        name[i] = keep ? c : '_';
    }
    name[n] = '\0';
    if (!n || !strcmp(name, ".") || !strcmp(name, "..")) snprintf(name, sizeof name, "policy");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (mkdir(path, 0777) != 0 && errno != EEXIST)
        return rp_fail(err, RP_EIO, "--plans: cannot create %s: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/%s/step-%" PRId64 ".json", dir, name, step);
    return rp_plan_save(plan, path, err);
}

/* Stop a policy after a failed step: the others go on. */
static void policy_stop(sim_policy *p, int64_t step, const rp_error *err)
{
    char buf[RP_ERROR_TEXT + 64];
    snprintf(buf, sizeof buf, "step %" PRId64 ": %s", step, err->text[0] ? err->text : rp_strerror(err->status));
    free(p->error);
    p->error = strdup(buf);
    cli_progress_clear();
    fprintf(stderr, "routepack: policy '%s' stopped at %s\n", p->spec, buf);
    rp_sched_free(p->sched);
    p->sched = NULL;
}

int cmd_simulate(rp_context *ctx, int argc, char **argv)
{
    sim_opts o;
    int rc = sim_parse_opts(argc, argv, &o);
    if (rc != CLI_OK) return rc;

    const char *ex_config = NULL, *ex_trace = NULL, *ex_gen = NULL;
    if ((!o.config || (!o.trace && !o.gen)) && !cli_default_example(&ex_config, &ex_trace, &ex_gen)) {
        fprintf(stderr, "routepack: cannot find the bundled example (examples/config-small.json and "
                "gen-example.json, small.rpt or gen-small.json); set RP_EXAMPLES_DIR or give --config and --trace\n");
        return CLI_FAIL;
    }
    const char *config = o.config ? o.config : ex_config;
    if (!o.trace && !o.gen) o.trace = ex_trace, o.gen = ex_gen;

    rp_config *cfg = NULL;
    cli_input in;
    memset(&in, 0, sizeof in);
    char **specs = NULL;
    int np = 0;
    sim_policy *pol = NULL;
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    rp_cost *cost = NULL;
    rp_error err;
    rp_error_clear(&err);
    rc = CLI_FAIL;

    if (cli_config_load(ctx, config, o.microbatches, &cfg, &err) != RP_OK ||
        cli_input_open(ctx, o.trace, o.gen, &in, &err) != RP_OK || cli_input_check(&in, cfg, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    int32_t steps = in.num_steps;
    if (o.steps) {
        if (in.trace && o.steps > in.num_steps) {
            rc = cli_usage("--steps %" PRId64 ", but %s has %d step%s", o.steps, in.path, in.num_steps,
                           in.num_steps == 1 ? "" : "s");
            goto out;
        }
        steps = (int32_t)o.steps; /* the generator makes any number of steps */
    }
    if ((np = sim_split_policies(o.policies, o.watch, rp_vexp_check_config(cfg, NULL) == RP_OK,
                             !rp_config_trainer(cfg)->equal_sequences_per_rank, &specs)) < 0 ||
        !(pol = calloc((size_t)(np ? np : 1), sizeof *pol))) {
        fprintf(stderr, "routepack: out of memory\n");
        np = np < 0 ? 0 : np;
        goto out;
    }

    const int32_t G = rp_config_topology(cfg)->num_gpus, L = rp_config_model(cfg)->num_layers;
    rp_sched_options opts;
    rp_sched_options_default(&opts);
    /* params on the command line are checked before anything runs: a typo is a usage error */
    for (int i = 0; i < np; i++) {
        pol[i].spec = specs[i];
        if ((rc = cli_policy_params(ctx, cfg, specs[i], &pol[i].name, &pol[i].params_json)) != CLI_OK) goto out;
    }
    if ((rc = sim_check_memory(ctx, cfg, &in, &o, np, opts.history)) != CLI_OK) goto out;
    rc = CLI_FAIL;
    int loaded = 0;
    for (int i = 0; i < np; i++) {
        sim_policy *p = &pol[i];
        p->spec = specs[i];
        p->steps = calloc((size_t)steps, sizeof *p->steps);
        if (o.report) {
            p->straggler = calloc((size_t)steps * 4, sizeof(int32_t));
            p->attention = calloc((size_t)steps * (size_t)G, sizeof(double));
            p->dispatch = calloc((size_t)steps * (size_t)G, sizeof(double));
            p->expert = calloc((size_t)steps * (size_t)G, sizeof(double));
            p->combine = calloc((size_t)steps * (size_t)G, sizeof(double));
            p->expert_by_step = calloc((size_t)steps * (size_t)L * (size_t)G, sizeof(double));
        }
        if (!p->steps || (o.report && (!p->straggler || !p->attention || !p->dispatch || !p->expert || !p->combine ||
                                       !p->expert_by_step))) {
            fprintf(stderr, "routepack: out of memory\n");
            goto out;
        }
        /* stat before loading: a change made while it loads is seen at the first step */
        p->watched = o.watch && !strcmp(p->spec, o.watch);
        p->ctx = ctx;
        if (p->watched && stat(p->spec, &p->seen) != 0) memset(&p->seen, 0, sizeof p->seen);
        opts.policy = p->name;
        opts.params_json = p->params_json;
        rp_error_clear(&err);
        if (rp_sched_new(ctx, cfg, &opts, &p->sched, &err) != RP_OK) {
            p->sched = NULL;
            p->error = strdup(err.text[0] ? err.text : rp_strerror(err.status));
            fprintf(stderr, "routepack: policy '%s' did not load: %s\n", p->spec, p->error ? p->error : "");
            continue;
        }
        loaded++;
    }
    if (loaded == 0) {
        fprintf(stderr, "routepack: no policy could be loaded\n");
        goto out;
    }

    cli_progress_begin("simulate: step", steps, 0);
    for (int32_t i = 0; i < steps; i++) {
        int64_t step_index;
        rp_routing routing;
        rp_batch_free(batch);
        batch = NULL;
        rp_stats_free(stats);
        stats = NULL;
        rp_cost_free(cost);
        cost = NULL;
        if (cli_input_read(&in, i, &batch, &routing, &step_index, &err) != RP_OK) {
            cli_progress_clear();
            rc = cli_fail(&err);
            goto out;
        }
        if (o.report && (rp_stats_compute(ctx, batch, &routing, in.num_experts, opts.num_threads, &stats,
                                          &err) != RP_OK ||
                         rp_cost_new(ctx, cfg, batch, stats, opts.split, &cost, &err) != RP_OK)) {
            cli_progress_clear();
            fprintf(stderr, "routepack: %s: step %" PRId64 ": %s\n", in.path, step_index, err.text);
            goto out;
        }
        for (int j = 0; j < np; j++) {
            sim_policy *p = &pol[j];
            if (!p->sched) continue;
            cli_progress_update(i, 0, p->spec);
            if (p->watched) watch_check(p, step_index);
            const rp_plan *plan;
            const rp_step_report *rep;
            rp_error_clear(&err);
            if (rp_sched_step(p->sched, step_index, batch, &routing, &plan, &rep, &err) != RP_OK) {
                policy_stop(p, step_index, &err);
                continue;
            }
            record_step(&p->steps[p->num_steps++], rep, plan, rp_sched_migration(p->sched), cfg);
            if (o.plans && save_step_plan(o.plans, p->spec, step_index, plan, &err) != RP_OK) {
                cli_progress_clear();
                rc = cli_fail(&err);
                goto out;
            }
            if (p->watched) {
                const step_rec *r = &p->steps[p->num_steps - 1];
                cli_progress_clear();
                if (r->swapped)
                    fprintf(stderr, "routepack: watch: step %" PRId64 ": swapped in %s %s (%016" PRIx64 ")\n",
                            step_index, r->policy_name, r->policy_version, r->policy_hash);
                if (r->swap_error)
                    fprintf(stderr, "routepack: watch: step %" PRId64 ": staged policy refused: %s\n",
                            step_index, r->swap_error);
                fprintf(stderr, "routepack: watch: step %" PRId64 ": %s %s, step/LB %.3f%s\n", step_index,
                        r->policy_name, r->policy_version, r->cost.ratio, r->fallback ? " (fallback)" : "");
                fflush(stderr);
            }
            if (cost && track_step(p, cost, plan, cfg, &err) != RP_OK) policy_stop(p, step_index, &err);
        }
    }
    cli_progress_end();

    const sim_policy *base = sim_best_baseline(pol, np);
    if (o.json) {
        if (!sim_print_json(pol, np, base, config, &in, steps, cfg, o.microbatches)) {
            fprintf(stderr, "routepack: could not write the JSON output\n");
            goto out;
        }
    } else {
        sim_print_table(pol, np, base, config, &in, steps, cfg, o.wide);
    }
    if (o.report) {
        if (sim_write_report(ctx, o.report, pol, np, base, config, &in, steps, cfg, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        if (!o.json) printf("report: %s\n", o.report);
    }
    rc = CLI_OK;
    for (int i = 0; i < np; i++)
        if (pol[i].error) rc = CLI_FAIL; /* said above; the others' results stand */
out:
    if (fflush(stdout) != 0) rc = CLI_FAIL;
    rp_cost_free(cost);
    rp_stats_free(stats);
    rp_batch_free(batch);
    if (pol) free_policies(pol, np);
    for (int i = 0; i < np && specs; i++) free(specs[i]);
    free(specs);
    cli_input_close(&in);
    rp_config_free(cfg);
    return rc;
}
