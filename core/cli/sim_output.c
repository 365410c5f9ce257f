/* `routepack simulate`'s outputs: the summary of each policy's run, the verdict (the
 * fastest policy against the best shipped baseline, and why), the table, the JSON and
 * the HTML report. */
#include "fallback_reasons.h"
#include "levers.h"
#include "report.h"
#include "sched_internal.h"
#include "sim.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
const sim_policy *sim_best_baseline(const sim_policy *pol, int np)
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
    v->best_base = sim_best_baseline(pol, np);
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

void sim_print_table(const sim_policy *pol, int np, const sim_policy *base, const char *config,
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
bool sim_print_json(const sim_policy *pol, int np, const sim_policy *base, const char *config,
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
    if (!good) {
        json_decref(root);
        return false;
    }
    return cli_print_json(root, 9);
}

rp_status sim_write_report(rp_context *ctx, const char *path, const sim_policy *pol, int np,
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
        st = rp_fail(err, RP_ENOMEM, "out of memory building the report");
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
            st = rp_fail(err, RP_ENOMEM, "out of memory building the report");
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
        st = rp_fail(err, RP_EIO, "%s: cannot write the report: %s", path, strerror(errno));
        goto out;
    }
    bool ok = fwrite(text, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    if (!ok) st = rp_fail(err, RP_EIO, "%s: cannot write the report: %s", path, strerror(errno));
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
