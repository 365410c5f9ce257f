/* `routepack simulate`: run several policies over the same steps, each in its own
 * scheduler, and compare them side by side (a table, JSON, or an HTML report). */
#include "cli.h"
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

/* token_kk+virtual_experts (Megatron's per-forward balancing) joins where the config
 * allows the balancer (rp_vexp_check_config); slime's packings (its recipes' first fit and
 * its FLOPs balancing) where the trainer does not need equal sequence counts per rank
 * (verl's), which slime does not keep. */
#define SIM_VEXP "token_kk+virtual_experts"
static const char *const default_policies[] = {"token_kk+contiguous", "token_kk+eplb", "token_kk+eplb_periodic",
                                               "verl_kk+eplb", "attn_kk+eplb", "slime_ff+eplb", "slime_kk+eplb",
                                               SIM_VEXP, "routepack", NULL};

/* The shipped baselines' components (docs/baselines.md): a policy made only of these
 * ("token_kk+eplb_periodic", "eplb") is a baseline; speedups and the verdict compare
 * every policy against the best of them on step + migration over the run. */
static const char *const baseline_parts[] = {"token_kk", "verl_kk", "attn_kk", "slime_ff", "slime_kk", "contiguous",
                                             "eplb", "eplb_periodic", "virtual_experts", NULL};

static bool is_baseline_part(const char *name, size_t len)
{
    for (const char *const *b = baseline_parts; *b; b++)
        if (strlen(*b) == len && !strncmp(*b, name, len)) return true;
    return false;
}

static bool is_baseline_spec(const char *spec)
{
    /* NAME or NAME:KEY=VALUE...: a baseline with params is still that baseline */
    const char *colon = strchr(spec, ':');
    const size_t len = colon ? (size_t)(colon - spec) : strlen(spec);
    const char *plus = memchr(spec, '+', len);
    if (!plus) return is_baseline_part(spec, len);
    return is_baseline_part(spec, (size_t)(plus - spec)) &&
           is_baseline_part(plus + 1, len - (size_t)(plus - spec) - 1);
}

/* ---- the simulation ---- */

/* What one policy did in one step (the scheduler's report, copied). */
typedef struct step_rec {
    int64_t step;
    rp_cost_summary cost;
    int32_t num_microbatches;
    double plan_s;
    int64_t policy_work;
    bool fallback, swapped;
    char *fallback_reason, *swap_error; /* NULL when empty */
    char *demotion;                     /* the policy was demoted after this step; NULL if not */
    char policy_name[64], policy_version[32];
    uint64_t policy_hash, plan_hash;
    int32_t experts_moved;
    double migration_bytes, migration_s;
    int32_t migration_rounds;          /* of the step's migration plan; 0 when none */
    int64_t migration_staging_bytes;   /* the most staging one GPU uses in one round */
    json_t *metrics;                   /* rp_step_metrics_json of the step's report */
    json_t *levers;                    /* cli_levers_json of the step's plan, or NULL */
    /* the whole step (docs/cost-model.md, "The whole step"): the MoE layers' time (the
     * step and trainer.logprob_forwards forward passes) and what the step does outside
     * them; end to end = moe_s + outside_s + migration_s */
    double moe_s, outside_s;
} step_rec;

typedef struct sim_policy {
    const char *spec;     /* as given: NAME or NAME:KEY=VALUE... */
    char *name;           /* the policy to load, and its params (NULL: the defaults) */
    char *params_json;
    rp_context *ctx;      /* the command's, for reading the watched file */
    rp_sched *sched;
    char *error;          /* why it stopped (load or step), NULL while fine */
    step_rec *steps;
    int32_t num_steps;
    /* --watch */
    bool watched;
    struct stat seen;     /* the file as last loaded or staged */
    /* --report: every step's per-GPU breakdown at its straggler (microbatch, layer), so
     * that the report can show all policies at one step */
    int32_t tracked;      /* steps priced so far (the first `tracked` of steps) */
    int32_t *straggler;   /* [steps x 4]: microbatch, layer, GPU, side */
    double *attention, *dispatch, *expert, *combine; /* [steps x G] each */
    /* forward expert time of each GPU at each layer, summed over microbatches, per step
     * run [steps x L x G], for the expert load chart */
    double *expert_by_step;
    /* the most memory any GPU needed at any step (rp_memory_peak of each plan), for --report */
    rp_gpu_memory memory_peak;
    bool have_memory;
} sim_policy;

typedef struct sim_opts {
    const char *config, *trace, *gen, *policies, *report, *watch, *plans;
    int64_t steps, microbatches;
    int64_t max_memory_bytes;  /* --max-memory: what the estimate may reach */
    bool json;
    bool wide;                 /* --wide: every column of the table */
} sim_opts;

/* Default of --max-memory (docs/cli.md): the reference configs need well under it. */
#define SIM_MAX_MEMORY_DEFAULT ((int64_t)4 << 30)

static char *dup_or_null(const char *s)
{
    return s && s[0] ? strdup(s) : NULL;
}

static int parse_sim_opts(int argc, char **argv, sim_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_memory_bytes = SIM_MAX_MEMORY_DEFAULT;
    const char *steps = NULL, *mbs = NULL, *max_mem = NULL;
    bool bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--config", &o->config, &bad) ||
            cli_opt(argc, argv, &i, "--trace", &o->trace, &bad) ||
            cli_opt(argc, argv, &i, "--gen", &o->gen, &bad) ||
            cli_opt(argc, argv, &i, "--policies", &o->policies, &bad) ||
            cli_opt(argc, argv, &i, "--steps", &steps, &bad) ||
            cli_opt(argc, argv, &i, "--report", &o->report, &bad) ||
            cli_opt(argc, argv, &i, "--plans", &o->plans, &bad) ||
            cli_opt(argc, argv, &i, "--watch", &o->watch, &bad) ||
            cli_opt(argc, argv, &i, "--microbatches", &mbs, &bad) ||
            cli_opt(argc, argv, &i, "--max-memory", &max_mem, &bad))
            continue;
        if (!strcmp(argv[i], "--json")) {
            o->json = true;
            continue;
        }
        if (!strcmp(argv[i], "--wide")) {
            o->wide = true;
            continue;
        }
        if (argv[i][0] == '-' && argv[i][1]) return cli_unknown_option("simulate", argv[i]);
        return cli_usage("simulate takes no positional arguments, got '%s' (use --trace or --config)",
                         argv[i]);
    }
    if (bad) return CLI_USAGE;
    if (o->trace && o->gen) return cli_usage("simulate: give --trace or --gen, not both");
    /* outputs first: a long run must not end in "cannot write" */
    if (o->report && cli_check_output_file("--report", o->report) != CLI_OK) return CLI_USAGE;
    if (o->plans && cli_make_output_dir("--plans", o->plans) != CLI_OK) return CLI_USAGE;
    if (steps) {
        if (!cli_int("--steps", steps, &o->steps)) return CLI_USAGE;
        if (o->steps < 1 || o->steps > INT32_MAX)
            return cli_usage("--steps must be >= 1, got %s", steps);
    }
    if (max_mem) {
        if (!cli_int("--max-memory", max_mem, &o->max_memory_bytes)) return CLI_USAGE;
        if (o->max_memory_bytes < 1) return cli_usage("--max-memory must be >= 1 (bytes), got %s", max_mem);
    }
    if (mbs) {
        if (!cli_int("--microbatches", mbs, &o->microbatches)) return CLI_USAGE;
        if (o->microbatches < 1 || o->microbatches > (1 << 20))
            return cli_usage("--microbatches must be in [1, 1048576], got %s", mbs);
    }
    if (o->policies) {
        bool any = false;
        for (const char *p = o->policies; *p; p++) any |= *p != ',' && *p != ' ';
        if (!any) return cli_usage("--policies is empty");
    }
    return CLI_OK;
}

/* Split "a, b,c" into trimmed, non-empty specs; the watched file joins the list when it
 * is not in it. Returns the count; -1 when out of memory. */
static int split_policies(const char *list, const char *watch, bool vexp, bool slime, char ***out)
{
    char *copy = strdup(list ? list : "");
    int n = 0, cap = 8;
    char **v = malloc((size_t)cap * sizeof *v);
    if (!copy || !v) goto oom;
    if (!list)
        for (const char *const *d = default_policies; *d; d++) {
            if ((!vexp && !strcmp(*d, SIM_VEXP)) || (!slime && !strncmp(*d, "slime_", 6))) continue;
            if (n == cap && !(v = realloc(v, (size_t)(cap *= 2) * sizeof *v))) goto oom;
            if (!(v[n++] = strdup(*d))) goto oom;
        }
    for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ' || *tok == '\t') tok++;
        size_t len = strlen(tok);
        while (len && (tok[len - 1] == ' ' || tok[len - 1] == '\t')) tok[--len] = '\0';
        if (!len) continue;
        if (n == cap && !(v = realloc(v, (size_t)(cap *= 2) * sizeof *v))) goto oom;
        if (!(v[n++] = strdup(tok))) goto oom;
    }
    if (watch) {
        bool found = false;
        for (int i = 0; i < n; i++) found |= !strcmp(v[i], watch);
        if (!found) {
            if (n == cap && !(v = realloc(v, (size_t)(cap + 1) * sizeof *v))) goto oom;
            if (!(v[n++] = strdup(watch))) goto oom;
        }
    }
    free(copy);
    *out = v;
    return n;
oom:
    free(copy);
    if (v)
        for (int i = 0; i < n; i++) free(v[i]);
    free(v);
    return -1;
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
        return cli_error(err, RP_EINVAL, "the cost model named microbatch %d layer %d as the straggler "
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

typedef struct sim_summary {
    double mean_step_s, mean_lb_s, mean_ratio, speedup, attn_imb, expert_imb, migrated, migration_s, plan_s;
    double mean_shared_ratio; /* mean of step / the step's shared bound (NAN without one) */
    int32_t fallbacks, swaps;
    int32_t worst; /* index of the step with the largest step / lower bound (the first) */
} sim_summary;

/* The shared lower bound of step i: the least of the own lower bounds of every plan
 * made for that step (each is at most its own plan's step time, so the least is at most
 * every plan's step time: one bound all plans of the step share). docs/cli.md. */
static double shared_bound(const sim_policy *pol, int np, int32_t i)
{
    double lb = INFINITY;
    for (int j = 0; j < np; j++)
        if (pol[j].num_steps > i && pol[j].steps[i].cost.lower_bound_s < lb) lb = pol[j].steps[i].cost.lower_bound_s;
    return lb;
}

/* The steps every policy that ran at all ran (a policy that stopped early shortens the
 * comparison for all, so totals compare like with like). */
static int32_t common_steps(const sim_policy *pol, int np)
{
    int32_t n = -1;
    for (int i = 0; i < np; i++)
        if (pol[i].num_steps > 0 && (n < 0 || pol[i].num_steps < n)) n = pol[i].num_steps;
    return n < 0 ? 0 : n;
}

/* One step end to end: the MoE layers, the rest of the step, the migration. */
static double step_total(const step_rec *r) { return r->moe_s + r->outside_s + r->migration_s; }

/* Step + migration time, end to end, summed over the first n steps. */
static double run_total(const sim_policy *p, int32_t n)
{
    double t = 0;
    for (int32_t i = 0; i < n && i < p->num_steps; i++) t += step_total(&p->steps[i]);
    return t;
}

/* The baseline with the least step + migration over the common steps; NULL if none ran. */
static const sim_policy *best_baseline(const sim_policy *pol, int np)
{
    const int32_t n = common_steps(pol, np);
    const sim_policy *best = NULL;
    for (int i = 0; i < np; i++)
        if (pol[i].num_steps > 0 && is_baseline_spec(pol[i].spec) &&
            (!best || run_total(&pol[i], n) < run_total(best, n)))
            best = &pol[i];
    return best;
}

/* The summary of policy p over its steps; speedup against `base`; mean step / shared
 * bound over the run's policies `pol`. */
static void summarize_shared(const sim_policy *p, const sim_policy *pol, int np, const sim_policy *base,
                             sim_summary *s)
{
    memset(s, 0, sizeof *s);
    int32_t n = p->num_steps;
    s->mean_shared_ratio = pol ? 0.0 : NAN;
    for (int32_t i = 0; i < n; i++) {
        const step_rec *r = &p->steps[i];
        if (pol) s->mean_shared_ratio += r->cost.step_s / shared_bound(pol, np, i);
        s->mean_step_s += r->cost.step_s;
        s->mean_lb_s += r->cost.lower_bound_s;
        s->mean_ratio += r->cost.ratio;
        s->attn_imb += r->cost.attention_imbalance;
        s->expert_imb += r->cost.expert_imbalance;
        s->migrated += r->migration_bytes;
        s->migration_s += r->migration_s;
        s->plan_s += r->plan_s;
        s->fallbacks += r->fallback;
        s->swaps += r->swapped;
        if (r->cost.ratio > p->steps[s->worst].cost.ratio) s->worst = i;
    }
    if (n > 0) {
        s->mean_step_s /= n, s->mean_lb_s /= n, s->mean_ratio /= n, s->attn_imb /= n;
        s->expert_imb /= n, s->migrated /= n, s->migration_s /= n, s->plan_s /= n;
        if (pol) s->mean_shared_ratio /= n;
    }
    /* over the steps both ran, so a policy that stopped early is compared fairly; a step
     * waits for its migration too (the cost model overlaps it with nothing) */
    s->speedup = NAN;
    if (base && base->num_steps > 0 && n > 0) {
        int32_t common = n < base->num_steps ? n : base->num_steps;
        double mine = 0, theirs = 0;
        for (int32_t i = 0; i < common; i++) {
            mine += step_total(&p->steps[i]);
            theirs += step_total(&base->steps[i]);
        }
        if (mine > 0) s->speedup = theirs / mine;
    }
}

/* The verdict of a run (docs/cli.md): the fastest policy on step + migration over the
 * common steps, how it compares with the best baseline, and whether it fell back. */
typedef struct sim_verdict {
    const sim_policy *fastest, *best_base, *best_other; /* best_other: fastest non-baseline */
    int32_t steps;
    double fastest_s, base_s, other_s;                 /* totals over `steps`, end to end */
    const char *executor;                              /* execution.executor priced */
    double moe_share;                                  /* the fastest's MoE layers / its total */
} sim_verdict;

static void make_verdict(const sim_policy *pol, int np, const rp_config *cfg, sim_verdict *v)
{
    memset(v, 0, sizeof *v);
    v->executor = rp_executor_name(rp_config_execution(cfg)->executor);
    v->steps = common_steps(pol, np);
    v->best_base = best_baseline(pol, np);
    for (int i = 0; i < np; i++) {
        const sim_policy *p = &pol[i];
        if (p->num_steps == 0) continue;
        double t = run_total(p, v->steps);
        if (!v->fastest || t < v->fastest_s) v->fastest = p, v->fastest_s = t;
        if (!is_baseline_spec(p->spec) && (!v->best_other || t < v->other_s)) v->best_other = p, v->other_s = t;
    }
    if (v->best_base) v->base_s = run_total(v->best_base, v->steps);
    double moe = 0;
    for (int32_t i = 0; v->fastest && i < v->steps; i++) moe += v->fastest->steps[i].moe_s;
    v->moe_share = v->fastest_s > 0 ? moe / v->fastest_s : 1.0;
}

static int32_t fallbacks_of(const sim_policy *p)
{
    int32_t n = 0;
    for (int32_t i = 0; i < p->num_steps; i++) n += p->steps[i].fallback;
    return n;
}

static void verdict_body(const sim_verdict *v, char *buf, size_t n);

/* One line, no newline: "verdict: ...", then what it assumed: the executor, and that the
 * times are end to end with the MoE layers' share of them. */
static void verdict_text(const sim_verdict *v, char *buf, size_t n)
{
    verdict_body(v, buf, n);
    if (!v->fastest) return;
    size_t used = strlen(buf);
    snprintf(buf + used, n - used, "; end to end, executor %s, MoE layers %.0f%% of the step", v->executor,
             v->moe_share * 100);
}

static void verdict_body(const sim_verdict *v, char *buf, size_t n)
{
    if (!v->fastest) {
        snprintf(buf, n, "verdict: no policy ran");
        return;
    }
    const double per = v->steps > 0 ? 1e3 / v->steps : 0;
    char fb[160];
    const sim_policy *judged = v->best_other ? v->best_other : v->fastest;
    int32_t f = fallbacks_of(judged);
    if (f == 0) snprintf(fb, sizeof fb, "%s never fell back", judged->spec);
    else snprintf(fb, sizeof fb, "%s fell back at %d of %d steps", judged->spec, f, judged->num_steps);
    if (!v->best_base) {
        snprintf(buf, n, "verdict: %s is the fastest on predicted step + migration (%.3f ms a step over %d steps); "
                 "no baseline ran; %s", v->fastest->spec, v->fastest_s * per, v->steps, fb);
        return;
    }
    if (!is_baseline_spec(v->fastest->spec)) {
        snprintf(buf, n,
                 "verdict: %s is the fastest on predicted step + migration, %.1f%% faster than the best baseline %s "
                 "(%.3f vs %.3f ms a step over %d steps); %s",
                 v->fastest->spec, (v->base_s / v->fastest_s - 1) * 100, v->best_base->spec, v->fastest_s * per,
                 v->base_s * per, v->steps, fb);
    } else if (v->best_other) {
        snprintf(buf, n,
                 "verdict: the baseline %s is the fastest on predicted step + migration (%.3f ms a step over %d "
                 "steps); %s is %.1f%% slower (%.3f ms); %s",
                 v->fastest->spec, v->fastest_s * per, v->steps, v->best_other->spec,
                 (v->other_s / v->base_s - 1) * 100, v->other_s * per, fb);
    } else {
        snprintf(buf, n, "verdict: the baseline %s is the fastest on predicted step + migration (%.3f ms a step "
                 "over %d steps); only baselines ran", v->fastest->spec, v->fastest_s * per, v->steps);
    }
}

/* The cost model's terms of a run, means per step over its first n steps: what the
 * `why:` line compares. Communication is dispatch + combine + the replicas' gradient
 * reduction and extra-replica copies. */
typedef struct sim_terms {
    double attention_s, expert_s, communication_s, migration_s, attn_imb, expert_imb;
} sim_terms;

static void mean_terms(const sim_policy *p, int32_t n, sim_terms *t)
{
    memset(t, 0, sizeof *t);
    if (n > p->num_steps) n = p->num_steps;
    for (int32_t i = 0; i < n; i++) {
        const rp_cost_summary *c = &p->steps[i].cost;
        t->attention_s += c->attention_s;
        t->expert_s += c->expert_s;
        t->communication_s += c->dispatch_s + c->combine_s + c->grad_reduce_s + c->extra_copy_s;
        t->migration_s += p->steps[i].migration_s;
        t->attn_imb += c->attention_imbalance;
        t->expert_imb += c->expert_imbalance;
    }
    if (n > 0)
        t->attention_s /= n, t->expert_s /= n, t->communication_s /= n, t->migration_s /= n, t->attn_imb /= n,
            t->expert_imb /= n;
}

/* What the verdict's winner is compared with: the best baseline when the winner is not
 * one, else the best non-baseline, else the next fastest policy; NULL when it ran alone. */
static const sim_policy *why_reference(const sim_policy *pol, int np, const sim_verdict *v)
{
    if (!v->fastest) return NULL;
    if (!is_baseline_spec(v->fastest->spec)) return v->best_base;
    if (v->best_other) return v->best_other;
    const sim_policy *next = NULL;
    for (int i = 0; i < np; i++)
        if (&pol[i] != v->fastest && pol[i].num_steps > 0 &&
            (!next || run_total(&pol[i], v->steps) < run_total(next, v->steps)))
            next = &pol[i];
    return next;
}

/* One line, no newline: "why: ..." (docs/cli.md): the cost model's terms of the winner
 * against its reference, the term it reduced most named first, with both values. */
static void why_text(const sim_policy *pol, int np, const sim_verdict *v, char *buf, size_t n)
{
    const sim_policy *ref = why_reference(pol, np, v);
    if (!ref) {
        snprintf(buf, n, "why: %s", v->fastest ? "no other policy ran to compare with" : "no policy ran");
        return;
    }
    sim_terms w, r;
    mean_terms(v->fastest, v->steps, &w);
    mean_terms(ref, v->steps, &r);
    const char *names[4] = {"attention", "expert", "communication", "migration"};
    const double mine[4] = {w.attention_s, w.expert_s, w.communication_s, w.migration_s};
    const double theirs[4] = {r.attention_s, r.expert_s, r.communication_s, r.migration_s};
    int order[4] = {0, 1, 2, 3};
    for (int i = 1; i < 4; i++) /* by what the winner saves, most first (stable) */
        for (int j = i; j > 0 && theirs[order[j]] - mine[order[j]] > theirs[order[j - 1]] - mine[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    size_t used = 0;
    const int top = order[0];
    const double saved = theirs[top] - mine[top];
    if (saved > 0)
        used += (size_t)snprintf(buf + used, n - used, "why: %s reduced %s most against %s (predicted ms a step): ",
                                 v->fastest->spec, names[top], ref->spec);
    else
        used += (size_t)snprintf(buf + used, n - used, "why: %s reduced no term against %s (predicted ms a step): ",
                                 v->fastest->spec, ref->spec);
    for (int i = 0; i < 4 && used < n; i++) {
        const int k = order[i];
        used += (size_t)snprintf(buf + used, n - used, "%s%s %.3f vs %.3f", i ? "; " : "", names[k], mine[k] * 1e3,
                                 theirs[k] * 1e3);
        if (used < n && k == 0)
            used += (size_t)snprintf(buf + used, n - used, " (imbalance %.3f vs %.3f)", w.attn_imb, r.attn_imb);
        if (used < n && k == 1)
            used += (size_t)snprintf(buf + used, n - used, " (imbalance %.3f vs %.3f)", w.expert_imb, r.expert_imb);
    }
}

/* Planning is measured wall time on this machine; on a tiny example's step it looks
 * large. Above 2% of the winner's predicted step (twice the reference scale's), one line
 * says what it is at the reference scale (docs/results.md, the planning overhead). False
 * when there is nothing to say. */
static bool plan_note(const sim_verdict *v, char *buf, size_t n)
{
    if (!v->fastest || v->fastest->num_steps == 0) return false;
    sim_summary s;
    summarize_shared(v->fastest, NULL, 0, NULL, &s);
    if (!(s.mean_step_s > 0) || !(s.plan_s > 0.02 * s.mean_step_s)) return false;
    snprintf(buf, n,
             "note: planning took %.1f ms a step here (measured), %.0f%% of this small example's predicted %.1f ms "
             "step; at the reference scale (64 GPUs, 4096 sequences a step) it is about 0.7-1%% of the step "
             "(docs/results.md)",
             s.plan_s * 1e3, 100 * s.plan_s / s.mean_step_s, s.mean_step_s * 1e3);
    return true;
}

/* Why the policy's steps fell back (and when it was demoted), distinct reasons first
 * occurrence first. */
static void collect_reasons(const sim_policy *p, cli_reasons *r)
{
    for (int32_t k = 0; k < p->num_steps; k++) {
        if (p->steps[k].fallback) cli_reasons_add(r, p->steps[k].fallback_reason, p->steps[k].step);
        if (p->steps[k].demotion) cli_reasons_add(r, p->steps[k].demotion, p->steps[k].step);
    }
}

static void print_table(const sim_policy *pol, int np, const sim_policy *base, const char *config,
                        const cli_input *in, int32_t steps, const rp_config *cfg, bool wide)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    printf("routepack simulate: %s, %s %s, %d step%s\n", config, in->trace ? "trace" : "generated from",
           in->path, steps, steps == 1 ? "" : "s");
    if (t->context_parallel_size > 1) /* the plan's "GPUs" are DP ranks (TP x CP groups) */
        printf("  %d DP ranks of TP %d x CP %d, ETP %d (%d GPUs, %d node%s x %d), EP groups of %d DP ranks; %d MoE "
               "layers x %d experts, top-%d\n",
               t->num_gpus, t->tensor_parallel_size, t->context_parallel_size, t->expert_tensor_parallel_size,
               t->num_gpus * t->tensor_parallel_size * t->context_parallel_size,
               t->physical_num_nodes / t->pipeline_parallel_size > 0 ? t->physical_num_nodes / t->pipeline_parallel_size
                                                                    : 1,
               t->physical_num_nodes / t->pipeline_parallel_size > 1 ? "s" : "", t->physical_gpus_per_node,
               t->ep_size, m->num_layers, m->num_experts, m->top_k);
    else if (t->tensor_parallel_size > 1) /* the plan's "GPUs" are DP ranks (TP groups) */
        printf("  %d DP ranks of TP %d, ETP %d (%d GPUs, %d node%s x %d), EP groups of %d DP ranks; %d MoE layers "
               "x %d experts, top-%d\n",
               t->num_gpus, t->tensor_parallel_size, t->expert_tensor_parallel_size,
               t->num_gpus * t->tensor_parallel_size, t->num_nodes, t->num_nodes == 1 ? "" : "s",
               t->physical_gpus_per_node, t->ep_size, m->num_layers, m->num_experts, m->top_k);
    else
        printf("  %d GPUs (%d node%s x %d), EP groups of %d; %d MoE layers x %d experts, top-%d\n",
               t->num_gpus, t->num_nodes, t->num_nodes == 1 ? "" : "s", t->gpus_per_node, t->ep_size,
               m->num_layers, m->num_experts, m->top_k);
    if (t->pipeline_parallel_size > 1) /* the lines above are one pipeline stage's */
        printf("  per pipeline stage, of %d (%s%s%.0d%s; %d GPUs on %d node%s in all): the step is the pipeline's "
               "critical path\n",
               t->pipeline_parallel_size, t->pipeline_schedule == RP_SCHEDULE_INTERLEAVED ? "interleaved" : "1F1B",
               t->virtual_pipeline_size > 1 ? ", " : "", t->virtual_pipeline_size > 1 ? t->virtual_pipeline_size : 0,
               t->virtual_pipeline_size > 1 ? " virtual stages each" : "",
               t->physical_num_nodes * t->physical_gpus_per_node, t->physical_num_nodes,
               t->physical_num_nodes == 1 ? "" : "s");
    printf("\n");
    int w = 6;
    for (int i = 0; i < np; i++) w = (int)strlen(pol[i].spec) > w ? (int)strlen(pol[i].spec) : w;
    /* the default table fits 100 columns with the shipped names; --wide adds the bounds and
     * the bytes moved */
    printf("%-*s  %9s", w, "policy", "step ms");
    if (wide) printf("  %8s  %9s", "step/LB", "step/sLB");
    printf("  %9s  %8s  %8s  %10s  %9s", "migr. ms", "speedup", "attn imb", "expert imb", "fallbacks");
    if (wide) printf("  %13s", "migrated/step");
    printf("  %8s\n", "plan ms");
    for (int i = 0; i < np; i++) {
        const sim_policy *p = &pol[i];
        if (p->num_steps == 0) {
            printf("%-*s  did not run: %s\n", w, p->spec, p->error ? p->error : "unknown error");
            continue;
        }
        sim_summary s;
        summarize_shared(p, pol, np, base, &s);
        char speed[32], mig[32];
        if (isnan(s.speedup)) snprintf(speed, sizeof speed, "-");
        else snprintf(speed, sizeof speed, "%.3fx", s.speedup);
        printf("%-*s  %9.3f", w, p->spec, s.mean_step_s * 1e3);
        if (wide) printf("  %8.3f  %9.3f", s.mean_ratio, s.mean_shared_ratio);
        printf("  %9.3f  %8s  %8.3f  %10.3f  %9d", s.migration_s * 1e3, speed, s.attn_imb, s.expert_imb, s.fallbacks);
        if (wide) printf("  %13s", cli_human_bytes(s.migrated, mig, sizeof mig));
        printf("  %8.2f%s\n", s.plan_s * 1e3, p->error ? "  (stopped early)" : "");
    }
    /* why the policies fell back, under the table (the steps' reasons are in --json too) */
    bool titled = false;
    for (int i = 0; i < np; i++) {
        cli_reasons why = {0};
        collect_reasons(&pol[i], &why);
        if (why.count && !titled) printf("\nFallbacks:\n");
        titled |= why.count > 0;
        cli_reasons_print(stdout, pol[i].spec, &why, fallbacks_of(&pol[i]), 5);
        cli_reasons_free(&why);
    }
    printf("\nAll times are predicted by the cost model for the config's GPUs, except plan ms.\n"
           "step ms: mean predicted step time (forward + backward); migr. ms: mean predicted\n"
           "expert migration time per step; speedup: the best baseline's (%s)\n"
           "step + migration time / the policy's, over the steps both ran; imbalance: max/mean over\n"
           "GPUs (attention per microbatch, experts per microbatch, layer and EP group), mean over\n"
           "steps; plan ms: statistics + policy + validation per step, measured on this machine.\n",
           base ? base->spec : "none ran");
    if (wide)
        printf("step/LB: mean of step time / the plan's own lower bound (its imbalance); step/sLB:\n"
               "mean of step time / the step's shared bound (the least of all plans' own bounds for\n"
               "that step: comparable across policies); migrated/step: expert bytes moved per step.\n");
    else
        printf("--wide adds step/LB, step/sLB (step time over lower bounds) and migrated/step.\n");
    sim_verdict v;
    make_verdict(pol, np, cfg, &v);
    char line[1024];
    verdict_text(&v, line, sizeof line);
    printf("\n%s\n", line);
    why_text(pol, np, &v, line, sizeof line);
    printf("%s\n", line);
    if (plan_note(&v, line, sizeof line)) printf("%s\n", line);
}

static json_t *step_json(const step_rec *r)
{
    char plan_hash[17], policy_hash[17];
    snprintf(plan_hash, sizeof plan_hash, "%016" PRIx64, r->plan_hash);
    snprintf(policy_hash, sizeof policy_hash, "%016" PRIx64, r->policy_hash);
    const rp_cost_summary *c = &r->cost;
    json_t *o = json_pack("{s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f,"
                     " s:{s:i, s:i, s:i, s:s}, s:i, s:f, s:I, s:b, s:s?, s:b, s:s?,"
                     " s:{s:s, s:s, s:s}, s:s, s:i, s:f, s:f, s:i, s:I, s:o}",
                     "step", (json_int_t)r->step, "step_ms", c->step_s * 1e3, "lower_bound_ms",
                     c->lower_bound_s * 1e3, "ratio", c->ratio, "attention_ms", c->attention_s * 1e3,
                     "dispatch_ms", c->dispatch_s * 1e3, "expert_ms", c->expert_s * 1e3, "combine_ms",
                     c->combine_s * 1e3, "grad_reduce_ms", c->grad_reduce_s * 1e3, "extra_copy_ms",
                     c->extra_copy_s * 1e3, "attention_imbalance", c->attention_imbalance,
                     "expert_imbalance", c->expert_imbalance, "straggler", "gpu", c->straggler_gpu,
                     "microbatch", c->straggler_mb, "layer", c->straggler_layer, "side",
                     cli_side_name(c->straggler_side), "num_microbatches", r->num_microbatches,
                     "plan_ms", r->plan_s * 1e3, "policy_work", (json_int_t)r->policy_work,
                     "fallback", r->fallback, "fallback_reason", r->fallback_reason, "swapped",
                     r->swapped, "swap_error", r->swap_error, "policy", "name", r->policy_name,
                     "version", r->policy_version, "hash", policy_hash, "plan_hash", plan_hash,
                     "experts_moved", r->experts_moved, "migration_bytes", r->migration_bytes,
                     "migration_ms", r->migration_s * 1e3, "migration_rounds", r->migration_rounds,
                     "migration_staging_bytes", (json_int_t)r->migration_staging_bytes, "metrics",
                     r->metrics ? json_deep_copy(r->metrics) : json_null());
    /* the whole step: the MoE layers (the step and the log-prob forwards), the rest, and
     * end to end with the migration (what speedups and the verdict compare) */
    if (o && (json_object_set_new(o, "moe_ms", json_real(r->moe_s * 1e3)) != 0 ||
              json_object_set_new(o, "outside_ms", json_real(r->outside_s * 1e3)) != 0 ||
              json_object_set_new(o, "end_to_end_ms", json_real(step_total(r) * 1e3)) != 0 ||
              json_object_set_new(o, "levers", r->levers ? json_deep_copy(r->levers) : json_null()) != 0)) {
        json_decref(o);
        o = NULL;
    }
    return o;
}

/* The whole run as one JSON object on stdout (schema: docs/cli.md); false on failure. */
static bool print_json(const sim_policy *pol, int np, const sim_policy *base, const char *config,
                       const cli_input *in, int32_t steps, const rp_config *cfg, int64_t microbatches)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    json_t *arr = json_array();
    json_t *root = json_pack("{s:s, s:i, s:s, s:{s:s, s:s, s:i}, s:{s:i, s:i, s:i, s:i, s:i, s:i, s:i},"
                             " s:o?, s:o, s:o}",
                             "format", "routepack-simulate", "version", 1, "config", config, "input",
                             "kind", in->trace ? "trace" : "gen", "path", in->path, "steps", steps,
                             "shape", "num_gpus", t->num_gpus, "num_nodes", t->num_nodes,
                             "gpus_per_node", t->gpus_per_node, "ep_size", t->ep_size, "num_layers",
                             m->num_layers, "num_experts", m->num_experts, "top_k", m->top_k,
                             "microbatches", microbatches > 0 ? json_integer(microbatches) : NULL,
                             "baseline", base ? json_string(base->spec) : json_null(), "policies", arr);
    if (!root) return false;
    bool good = true;
    for (int i = 0; i < np && good; i++) {
        const sim_policy *p = &pol[i];
        json_t *steps_arr = json_array();
        for (int32_t k = 0; steps_arr && k < p->num_steps; k++) {
            json_t *sj = step_json(&p->steps[k]);
            const double shared = shared_bound(pol, np, k);
            if (!sj || json_object_set_new(sj, "shared_lower_bound_ms", json_real(shared * 1e3)) != 0 ||
                json_object_set_new(sj, "shared_ratio", json_real(p->steps[k].cost.step_s / shared)) != 0 ||
                json_array_append_new(steps_arr, sj) != 0)
                good = false;
        }
        json_t *summary = NULL;
        if (p->num_steps > 0) {
            sim_summary s;
            summarize_shared(p, pol, np, base, &s);
            summary = json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:o, s:f, s:f, s:i, s:i, s:f, s:f, s:I, s:f, s:b}",
                                "steps", p->num_steps, "mean_step_ms", s.mean_step_s * 1e3,
                                "mean_migration_ms", s.migration_s * 1e3,
                                "mean_lower_bound_ms", s.mean_lb_s * 1e3, "mean_ratio", s.mean_ratio,
                                "mean_shared_ratio", s.mean_shared_ratio,
                                "speedup", isnan(s.speedup) ? json_null() : json_real(s.speedup),
                                "attention_imbalance", s.attn_imb, "expert_imbalance", s.expert_imb,
                                "fallbacks", s.fallbacks, "swaps", s.swaps, "migrated_bytes_per_step",
                                s.migrated, "mean_plan_ms", s.plan_s * 1e3, "worst_step",
                                (json_int_t)p->steps[s.worst].step, "worst_ratio",
                                p->steps[s.worst].cost.ratio, "baseline", is_baseline_spec(p->spec));
            if (!summary) good = false;
        }
        json_t *o = json_pack("{s:s, s:s, s:s?, s:o, s:o}", "policy", p->spec, "status",
                              !p->error ? "ok" : p->num_steps ? "stopped" : "failed", "error", p->error,
                              "summary", summary ? summary : json_null(), "steps",
                              steps_arr ? steps_arr : json_array());
        if (!o || json_array_append_new(arr, o) != 0) good = false;
    }
    sim_verdict v;
    make_verdict(pol, np, cfg, &v);
    char line[1024];
    verdict_text(&v, line, sizeof line);
    char why[1024], note[512];
    why_text(pol, np, &v, why, sizeof why);
    bool noted = plan_note(&v, note, sizeof note);
    json_t *vj = json_pack("{s:s, s:s, s:s?, s:s?, s:s?, s:i, s:o, s:b, s:i}", "text", line, "why", why, "note",
                           noted ? note : NULL, "fastest",
                           v.fastest ? v.fastest->spec : NULL, "best_baseline", v.best_base ? v.best_base->spec : NULL,
                           "steps", v.steps,
                           "margin_over_best_baseline",
                           v.fastest && v.best_base ? json_real(v.base_s / v.fastest_s - 1) : json_null(),
                           "fastest_is_baseline", v.fastest && is_baseline_spec(v.fastest->spec),
                           "fastest_fallbacks", v.fastest ? fallbacks_of(v.fastest) : 0);
    /* what the verdict assumed (issue 30): the executor priced, the fastest's MoE share */
    if (vj && (json_object_set_new(vj, "executor", json_string(v.executor)) != 0 ||
               json_object_set_new(vj, "moe_share", json_real(v.moe_share)) != 0))
        good = false;
    if (!vj || json_object_set_new(root, "verdict", vj) != 0) good = false;
    if (good)
        good = json_dumpf(root, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9)) == 0 &&
               putchar('\n') != EOF;
    json_decref(root);
    return good;
}

static rp_status write_report(rp_context *ctx, const char *path, const sim_policy *pol, int np,
                              const sim_policy *base, const char *config, const cli_input *in,
                              int32_t steps, const rp_config *cfg, rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    rp_report_policy *rp = calloc((size_t)np, sizeof *rp);
    int64_t **idx = calloc((size_t)np, sizeof *idx);
    double **ratio = calloc((size_t)np, sizeof *ratio);
    bool **fb = calloc((size_t)np, sizeof *fb);
    double **per_step = calloc((size_t)np, sizeof *per_step); /* [4 x steps]: step, migration, bytes, plan */
    int32_t **rounds = calloc((size_t)np, sizeof *rounds);
    int64_t **staging = calloc((size_t)np, sizeof *staging);
    char (*running)[128] = calloc((size_t)np, sizeof *running);
    cli_reasons *reasons = calloc((size_t)np, sizeof *reasons);
    char *text = NULL;
    rp_status st = RP_OK;
    if (!rp || !idx || !ratio || !fb || !per_step || !rounds || !staging || !running || !reasons) {
        st = cli_error(err, RP_ENOMEM, "out of memory building the report");
        goto out;
    }
    for (int i = 0; i < np; i++) {
        const sim_policy *p = &pol[i];
        rp_report_policy *r = &rp[i];
        r->label = p->spec;
        if (p->num_steps == 0 || p->tracked == 0) {
            r->error = p->error ? p->error : "did not run";
            continue;
        }
        int32_t n = p->num_steps;
        idx[i] = malloc((size_t)n * sizeof **idx);
        ratio[i] = malloc((size_t)n * sizeof **ratio);
        fb[i] = malloc((size_t)n * sizeof **fb);
        per_step[i] = malloc((size_t)n * 4 * sizeof **per_step);
        rounds[i] = malloc((size_t)n * sizeof **rounds);
        staging[i] = malloc((size_t)n * sizeof **staging);
        if (!idx[i] || !ratio[i] || !fb[i] || !per_step[i] || !rounds[i] || !staging[i]) {
            st = cli_error(err, RP_ENOMEM, "out of memory building the report");
            goto out;
        }
        for (int32_t k = 0; k < n; k++) {
            idx[i][k] = p->steps[k].step;
            ratio[i][k] = p->steps[k].cost.ratio;
            fb[i][k] = p->steps[k].fallback;
            per_step[i][k] = p->steps[k].cost.step_s;
            per_step[i][n + k] = p->steps[k].migration_s;
            per_step[i][2 * n + k] = p->steps[k].migration_bytes;
            per_step[i][3 * n + k] = p->steps[k].plan_s;
            rounds[i][k] = p->steps[k].migration_rounds;
            staging[i][k] = p->steps[k].migration_staging_bytes;
        }
        sim_summary s;
        summarize_shared(p, pol, np, base, &s);
        const step_rec *last = &p->steps[n - 1];
        if (!strcmp(last->policy_name, p->spec))
            snprintf(running[i], sizeof running[i], "%s", last->policy_version);
        else
            snprintf(running[i], sizeof running[i], "%s %s", last->policy_name, last->policy_version);
        r->error = p->error;
        r->running = running[i];
        r->num_steps = n;
        r->steps = idx[i];
        r->ratio = ratio[i];
        r->fallback = fb[i];
        r->step_s = per_step[i];
        r->migration_s = per_step[i] + n;
        r->migration_bytes = per_step[i] + 2 * n;
        r->plan_s = per_step[i] + 3 * n;
        r->migration_rounds = rounds[i];
        r->staging_bytes = staging[i];
        r->memory = p->have_memory ? &p->memory_peak : NULL;
        r->mean_step_s = s.mean_step_s;
        r->mean_ratio = s.mean_ratio;
        r->mean_shared_ratio = s.mean_shared_ratio;
        r->speedup = s.speedup;
        r->attention_imbalance = s.attn_imb;
        r->expert_imbalance = s.expert_imb;
        r->fallbacks = s.fallbacks;
        r->swaps = s.swaps;
        r->migrated_bytes_per_step = s.migrated;
        r->mean_plan_s = s.plan_s;
        collect_reasons(p, &reasons[i]);
        r->fallback_reasons = reasons[i].list;
        r->num_fallback_reasons = reasons[i].count;
    }
    /* the expert load and per-GPU charts compare the policies at one step: the worst
     * overall, the largest mean step / lower bound over the policies that ran it */
    int32_t load_at = -1;
    double load_worst = -1;
    for (int32_t k = 0; k < steps; k++) {
        double sum = 0;
        int ran = 0;
        for (int i = 0; i < np; i++)
            if (pol[i].tracked > k) sum += pol[i].steps[k].cost.ratio, ran++;
        if (ran && sum / ran > load_worst) load_worst = sum / ran, load_at = k;
    }
    int64_t load_step = 0;
    for (int i = 0; i < np && load_at >= 0; i++) {
        const sim_policy *p = &pol[i];
        if (p->tracked <= load_at) continue;
        load_step = p->steps[load_at].step;
        rp[i].expert_layer = p->expert_by_step + (size_t)load_at * m->num_layers * t->num_gpus;
        const int32_t *at_step = p->straggler + (size_t)load_at * 4;
        const size_t row = (size_t)load_at * t->num_gpus;
        rp[i].load_ratio = p->steps[load_at].cost.ratio;
        rp[i].straggler_mb = at_step[0], rp[i].straggler_layer = at_step[1];
        rp[i].straggler_gpu = at_step[2], rp[i].straggler_side = (rp_side)at_step[3];
        rp[i].attention = p->attention + row;
        rp[i].dispatch = p->dispatch + row;
        rp[i].expert = p->expert + row;
        rp[i].combine = p->combine + row;
    }
    char line1[1200], line2[512];
    snprintf(line1, sizeof line1, "config %s; %s %s; %d step%s", config,
             in->trace ? "trace" : "generated from", in->path, steps, steps == 1 ? "" : "s");
    snprintf(line2, sizeof line2,
             "%d GPUs (%d node%s x %d), EP groups of %d; %d MoE layers x %d experts, top-%d; "
             "backward / forward: attention %.2f, experts %.2f, communication %.2f",
             t->num_gpus, t->num_nodes, t->num_nodes == 1 ? "" : "s", t->gpus_per_node, t->ep_size,
             m->num_layers, m->num_experts, m->top_k, rp_config_hardware(cfg)->backward.attention,
             rp_config_hardware(cfg)->backward.experts, rp_config_hardware(cfg)->backward.communication);
    const char *context[] = {line1, line2, NULL};
    char base_label[160];
    snprintf(base_label, sizeof base_label, "the best baseline, %s", base ? base->spec : "");
    sim_verdict verdict;
    char verdict_line[1024];
    make_verdict(pol, np, cfg, &verdict);
    verdict_text(&verdict, verdict_line, sizeof verdict_line);
    rp_report report = {"RoutePack simulation", context, base ? base_label : NULL, t->num_gpus,
                        t->gpus_per_node, t->ep_size, m->num_layers, np, rp, load_step, verdict_line};
    size_t len;
    if ((st = rp_report_html(ctx, &report, &text, &len, err)) != RP_OK) goto out;
    FILE *f = fopen(path, "wb");
    if (!f) {
        st = cli_error(err, RP_EIO, "%s: cannot write the report: %s", path, strerror(errno));
        goto out;
    }
    bool ok = fwrite(text, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    if (!ok) st = cli_error(err, RP_EIO, "%s: cannot write the report: %s", path, strerror(errno));
out:
    rp_text_free(ctx, text);
    for (int i = 0; i < np && idx && ratio && fb && per_step && rounds && staging; i++) {
        free(idx[i]);
        free(ratio[i]);
        free(fb[i]);
        free(per_step[i]);
        free(rounds[i]);
        free(staging[i]);
    }
    free(idx);
    free(ratio);
    free(fb);
    free(per_step);
    free(rounds);
    free(staging);
    free(running);
    for (int i = 0; reasons && i < np; i++) cli_reasons_free(&reasons[i]);
    free(reasons);
    free(rp);
    return st;
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
        return cli_error(err, RP_EIO, "--plans: cannot create %s: %s", path, strerror(errno));
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

/* The bytes one evaluation of a plan of `mbs` microbatches takes for this batch
 * (rp_cost_evaluation_needs on a plan of that shape: everything in microbatch 0 of rank
 * 0, experts laid out contiguously); 0 with err set when it cannot be told. */
static size_t evaluation_bytes(rp_context *ctx, const rp_config *cfg, const rp_cost *cost, int32_t num_seqs,
                               int32_t mbs, rp_error *err)
{
    rp_plan *plan = NULL;
    size_t bytes = 0;
    int32_t *zeros = calloc((size_t)num_seqs + 1, sizeof *zeros);
    if (!zeros) {
        snprintf(err->text, sizeof err->text, "out of memory");
        return 0;
    }
    if (rp_plan_new(ctx, cfg, mbs, &plan, err) == RP_OK && rp_plan_set_packing(plan, num_seqs, zeros, zeros, err) == RP_OK &&
        rp_plan_set_contiguous(plan, err) == RP_OK && rp_cost_evaluation_needs(cost, plan, NULL, &bytes, err) != RP_OK)
        bytes = 0;
    rp_plan_free(plan);
    free(zeros);
    return bytes;
}

/* What the run will hold at once, estimated from the first step's shape before any
 * scheduler is made (a config inside the documented ranges, as limits.num_microbatches
 * = 100000 or slots_per_gpu = 10^6, made simulate take gigabytes with no warning): for
 * each policy two evaluations of a plan of the run's microbatch count (the evaluator
 * keeps the plan's, and the previous plan's while the next is evaluated), two plans and
 * the history of expert loads; the statistics of a step; with --report, one more
 * evaluation. Over --max-memory the run is refused naming the figures and the keys
 * that set them. CLI_OK, or what to exit with. */
static int check_memory(rp_context *ctx, const rp_config *cfg, cli_input *in, const sim_opts *o, int np,
                        int32_t history)
{
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    rp_cost *cost = NULL;
    rp_routing routing;
    int64_t step_index;
    rp_error err;
    rp_error_clear(&err);
    int rc = CLI_FAIL;
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *tp = rp_config_topology(cfg);
    int32_t mbs = o->microbatches ? (int32_t)o->microbatches : rp_config_limits(cfg)->num_microbatches;
    if (mbs < 1) mbs = 1; /* the policy chooses: at least one */
    /* a plan's count is a multiple of trainer.microbatch_multiple (PP under the
     * interleaved schedule) in each of trainer.mini_batches: the smallest plan has that
     * many (the config caps the product at 2^20) */
    const int32_t least = rp_config_trainer(cfg)->microbatch_multiple * rp_config_trainer(cfg)->mini_batches;
    if (mbs % least != 0) mbs += least - mbs % least;
    if (cli_input_read(in, 0, &batch, &routing, &step_index, &err) != RP_OK ||
        rp_stats_compute(ctx, batch, &routing, in->num_experts, 0, &stats, &err) != RP_OK ||
        rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    const int32_t n = rp_batch_num_seqs(batch);
    size_t eval = evaluation_bytes(ctx, cfg, cost, n, mbs, &err);
    size_t eval1 = mbs > least && eval ? evaluation_bytes(ctx, cfg, cost, n, least, &err) : eval;
    if (!eval || !eval1) {
        fprintf(stderr, "routepack: simulate: cannot estimate the memory of a plan of %d microbatches: %s\n", mbs,
                err.text);
        goto out;
    }
    int64_t slots = 0;
    for (int32_t g = 0; g < tp->ep_size; g++) slots += tp->slots[g];
    const double cells = (double)md->num_layers * md->num_experts;
    const double plan = (double)md->num_layers * (double)slots * 8.0 + (double)tp->num_gpus * mbs * 8.0 + n * 8.0;
    const double hist = (double)history * cells * 8.0;
    const double per_policy = 2.0 * (double)eval + 2.0 * plan + hist;
    const double total = np * per_policy + (double)rp_stats_bytes(stats) + (o->report ? (double)eval : 0.0);
    if (total <= (double)o->max_memory_bytes) {
        rc = CLI_OK;
        goto out;
    }
    /* the part the microbatch count adds, the part the slots add (plans and their
     * evaluations: two each), the rest */
    const double by_mbs = 2.0 * ((double)eval - (double)eval1) * np;
    const double by_slots = 4.0 * (double)md->num_layers * (double)slots * 8.0 * np;
    const char *key = by_mbs >= by_slots && by_mbs >= total / 2
                          ? (o->microbatches ? "--microbatches" : "limits.num_microbatches")
                      : by_slots >= total / 2 ? "topology.slots_per_gpu"
                      : hist * np >= total / 2 ? "the history length (rp_sched_options.history)"
                                               : "model.num_layers or model.num_experts";
    /* each figure in its own unit (cli_human_bytes): a small --max-memory must not read
     * "0.00 GB > 0.00 GB" */
    char b_total[32], b_max[32], b_eval[32], b_plan[32], b_hist[32], b_stats[32];
    fprintf(stderr,
            "routepack: simulate: the run would hold about %s at once, more than --max-memory %s (%lld bytes): "
            "%d polic%s x (2 evaluations of %s for plans of %d microbatches x %d layers x %d GPUs x %d "
            "experts, %lld slots a layer; plans %s; history %s) + statistics %s%s; lower %s, or "
            "raise --max-memory\n",
            cli_human_bytes(total, b_total, sizeof b_total),
            cli_human_bytes((double)o->max_memory_bytes, b_max, sizeof b_max), (long long)o->max_memory_bytes, np,
            np == 1 ? "y" : "ies", cli_human_bytes((double)eval, b_eval, sizeof b_eval), mbs, md->num_layers,
            tp->num_gpus, md->num_experts, (long long)slots, cli_human_bytes(2.0 * plan, b_plan, sizeof b_plan),
            cli_human_bytes(hist, b_hist, sizeof b_hist),
            cli_human_bytes((double)rp_stats_bytes(stats), b_stats, sizeof b_stats),
            o->report ? " + one evaluation for --report" : "", key);
out:
    rp_cost_free(cost);
    rp_stats_free(stats);
    rp_batch_free(batch);
    return rc;
}

int cmd_simulate(rp_context *ctx, int argc, char **argv)
{
    sim_opts o;
    int rc = parse_sim_opts(argc, argv, &o);
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
    if ((np = split_policies(o.policies, o.watch, rp_vexp_check_config(cfg, NULL) == RP_OK,
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
    if ((rc = check_memory(ctx, cfg, &in, &o, np, opts.history)) != CLI_OK) goto out;
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

    const sim_policy *base = best_baseline(pol, np);
    if (o.json) {
        if (!print_json(pol, np, base, config, &in, steps, cfg, o.microbatches)) {
            fprintf(stderr, "routepack: could not write the JSON output\n");
            goto out;
        }
    } else {
        print_table(pol, np, base, config, &in, steps, cfg, o.wide);
    }
    if (o.report) {
        if (write_report(ctx, o.report, pol, np, base, config, &in, steps, cfg, &err) != RP_OK) {
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
