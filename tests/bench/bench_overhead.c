/* Planning overhead per rank per step at the reference scale (config-reference.json,
 * gen-reference.json: 64 ranks, 4096 sequences), on the distributed path
 * (docs/distributed.md): statistics of the rank's own sequences (1/64 of the batch), the
 * exchange of the serialised parts (bytes, and time at the config's network bandwidth),
 * the merge (rp_stats_merge_serialized_reusing into the last step's statistics, as a trainer
 * merges step after step; merge_fresh_ms: into fresh memory), and rp_sched_step_stats_take
 * (the scheduler takes the merge and gives back the last step's, for the next merge) with
 * the config's policy (its policy call and the engine's work around it), with a placement in use (the third step); the step where the
 * policy next checks the fallbacks (check_*), the mean step of that interval (interval_*),
 * and the policy checking every step (fallback_interval 1: every_step_*), alternated in
 * each repetition; the joint construction alone (rp_joint_plan without fallbacks) and with
 * the shipped policy's fallback check (its cost, and whether it changed the plan). CPU times are this thread's (the policy
 * runs in it: rp_step_report.policy_cpu_s), the minimum of --reps runs. Memory: the peak RSS
 * of this process, which does one rank's work, and the routing it holds (its own sequences)
 * against the whole step's. The other ranks' parts are this rank's bytes again, under
 * shuffled global ids, so no rank ever generates the whole step's routing.
 * Planned ahead (plan_ahead_ms, exposed_ms): the third step planned on a thread while the
 * step before trains (a sleep of the predicted step, at most 1 s), the statistics and
 * exchange slept for their times there; exposed_ms is what the trainer then waits for in
 * the join, beside total_ms, what it waits for when it plans synchronously.
 * Usage: bench_overhead [--scale N] [--reps R] [--json] [--construction]; N in 1, 2, 4, 8
 * divides the sequences (a quick run). --construction times the joint construction alone
 * (first step and with a placement in use) and prints the plans' hashes, for comparing
 * builds; under callgrind, --toggle-collect=construct_once counts its instructions only.
 * Figures only; nothing is asserted. */
#include "bench_util.h"
#include "routepack/routepack.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define RANKS 64

static double thread_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what, const rp_error *err)
{
    fprintf(stderr, "bench_overhead: %s: %s\n", what, err ? err->text : "");
    exit(1);
}

/* One joint construction without fallbacks; its own function so that callgrind can count
 * it alone (--toggle-collect=construct_once). */
__attribute__((noinline)) static rp_plan *construct_once(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                                                         const rp_stats *stats, const rp_plan *previous,
                                                         const rp_joint_params *jp, double *cpu_s)
{
    rp_plan *plan = NULL;
    rp_error err;
    double t0 = thread_s();
    if (rp_joint_plan(ctx, cfg, batch, stats, previous, NULL, jp, &plan, NULL, &err) != RP_OK) die("joint", &err);
    *cpu_s = thread_s() - t0;
    return plan;
}

/* --construction: the least of reps constructions, first step and with a placement in use
 * (old and new builds alternated by the caller), and the plans' hashes. */
static void construction_only(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const rp_stats *stats,
                              const rp_plan *previous, int reps)
{
    rp_joint_params jp = rp_joint_defaults();
    const char *const none[] = {NULL};
    jp.fallbacks = none;
    double best[2] = {1e30, 1e30};
    uint64_t hash[2] = {0, 0};
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < 2; k++) {
            double t;
            rp_plan *p = construct_once(ctx, cfg, batch, stats, k ? previous : NULL, &jp, &t);
            best[k] = t < best[k] ? t : best[k];
            hash[k] = rp_plan_hash(p);
            rp_plan_free(p);
        }
    printf("construction (CPU ms, least of %d): first step %.3f, placement in use %.3f; plan hashes %016llx %016llx\n",
           reps, best[0] * 1e3, best[1] * 1e3, (unsigned long long)hash[0], (unsigned long long)hash[1]);

    /* the per-(microbatch, EP group) histogram pass the construction makes, alone: 56
     * cells (7 microbatches x 8 groups at the reference scale), sequences dealt in turn */
    const int32_t n = rp_stats_num_seqs(stats), cells = 56;
    const size_t per = (size_t)rp_stats_num_layers(stats) * rp_stats_num_experts(stats);
    int32_t *map = malloc(sizeof *map * (size_t)n);
    int64_t *loads = malloc(sizeof *loads * per * cells);
    if (!map || !loads) die("loads arrays", NULL);
    for (int32_t i = 0; i < n; i++) map[i] = i % cells;
    double loads_s = 1e30;
    rp_error err;
    for (int r = 0; r < reps; r++) {
        double t0 = thread_s();
        if (rp_stats_microbatch_loads(stats, map, cells, loads, &err) != RP_OK) die("loads", &err);
        double t = thread_s() - t0;
        loads_s = t < loads_s ? t : loads_s;
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < per * cells; i++) sum = sum * 31 + (uint64_t)loads[i];
    printf("microbatch loads pass (%d cells): %.3f ms (CPU, least of %d); loads hash %016llx\n", cells,
           loads_s * 1e3, reps, (unsigned long long)sum);
    free(map);
    free(loads);
}

/* What one step cost: the policy's calls (CPU and wall) and the engine around them (the
 * step's CPU time less the policy's), and the policy's fallback checks. */
typedef struct step_cost {
    double policy_s, policy_wall_s, engine_s;
    int checks;
} step_cost;

#define STEPS_MAX 64

/* The mean step of one interval: the steps after the first up to `last`, the check that
 * ends it (its checks summed). */
static step_cost interval_mean(const step_cost *cost, int last)
{
    step_cost mean = {0, 0, 0, 0};
    for (int t = 1; t <= last; t++) {
        mean.policy_s += cost[t].policy_s / last;
        mean.engine_s += cost[t].engine_s / last;
        mean.checks += cost[t].checks;
    }
    return mean;
}

/* The ranks' serialised parts of one step and their global ids: what a rank merges. */
typedef struct step_parts {
    const void *const *bytes;
    const size_t *lens;
    const int32_t *const *ids;
    int32_t num_seqs;
} step_parts;

/* Steps 0, 1, ... of a fresh scheduler on the same batch and statistics with the config's
 * policy under `params` (NULL: the config's), keeping each step's least cost in cost[t];
 * up to `steps`, or with `to_check` up to the first step from the third on that checks
 * the fallbacks. Each step as a trainer's rank runs it: the parts merged (untimed: the
 * merge has its own figure) into the statistics the scheduler gave back from the step
 * before, then rp_sched_step_stats_take. The predicted step time, the policy's name and
 * (when `first` points to NULL) a copy of the first step's plan come back. Returns the
 * last step run. */
static int run_steps(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const step_parts *in,
                     const char *params, int steps, bool to_check, step_cost *cost, double *predicted_s,
                     char policy[64], rp_plan **first)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.num_threads = 1;
    o.params_json = params;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) die("scheduler", &err);
    rp_stats *stats = NULL;
    int t = 0;
    for (; t < steps; t++) {
        const rp_plan *p;
        const rp_step_report *rep;
        if (rp_stats_merge_serialized_reusing(ctx, RANKS, in->bytes, in->lens, in->ids, in->num_seqs, &stats, &err) !=
            RP_OK)
            die("merge", &err);
        double t0 = thread_s();
        if (rp_sched_step_stats_take(s, t, batch, &stats, &p, &rep, &err) != RP_OK) die("step", &err);
        double step_cpu = thread_s() - t0;
        if (t == 0 && first && !*first && rp_plan_copy(p, first, &err) != RP_OK) die("plan copy", &err);
        step_cost *c = &cost[t];
        c->policy_s = rep->policy_cpu_s < c->policy_s ? rep->policy_cpu_s : c->policy_s;
        c->policy_wall_s = rep->policy_wall_s < c->policy_wall_s ? rep->policy_wall_s : c->policy_wall_s;
        double eng = step_cpu - rep->policy_cpu_s;
        c->engine_s = eng < c->engine_s ? eng : c->engine_s;
        c->checks = rep->fallback_checks;
        *predicted_s = rep->cost.step_s;
        snprintf(policy, 64, "%s", rep->policy_name);
        if (to_check && t >= 2 && rep->fallback_checks > 0) break;
    }
    rp_stats_free(stats);
    rp_sched_free(s);
    return t < steps ? t : steps - 1;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* One step planned on a host thread, as routepack.torch's DistributedScheduler.step_ahead
 * runs it: the rank's statistics and their exchange (their measured and modelled times,
 * slept: the thread waits on them as on the network), the merge into the statistics the
 * scheduler gave back, and rp_sched_step_stats_take. */
typedef struct plan_job {
    rp_context *ctx;
    rp_sched *sched;
    const rp_batch *batch;
    const step_parts *in;
    rp_stats **stats;
    double before_s; /* the rank's statistics and the exchange */
    int step;
    double wall_s;   /* the thread's wall time for the whole step */
} plan_job;

static void *plan_job_run(void *arg)
{
    plan_job *j = arg;
    rp_error err;
    const rp_plan *p;
    const rp_step_report *rep;
    double t0 = wall_s();
    sleep_s(j->before_s);
    if (rp_stats_merge_serialized_reusing(j->ctx, RANKS, j->in->bytes, j->in->lens, j->in->ids, j->in->num_seqs,
                                          j->stats, &err) != RP_OK)
        die("merge", &err);
    if (rp_sched_step_stats_take(j->sched, j->step, j->batch, j->stats, &p, &rep, &err) != RP_OK) die("step", &err);
    j->wall_s = wall_s() - t0;
    return NULL;
}

/* Planning ahead (steps 0 to 2 of the config's policy): step t + 1 is planned on a thread
 * while step t trains, here a sleep of `train_s`; what the trainer then waits for in the
 * join is the exposed part. Step 0 has no step before it; the third step's figures come
 * back (the steady state, as total_ms's), each the least of the calls. */
static void plan_ahead(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const step_parts *in,
                       double before_s, double train_s, double *plan_s, double *exposed_s)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) die("scheduler", &err);
    rp_stats *stats = NULL;
    for (int t = 0; t < 3; t++) {
        plan_job job = {ctx, s, batch, in, &stats, before_s, t, 0};
        pthread_t th;
        if (pthread_create(&th, NULL, plan_job_run, &job) != 0) die("pthread_create", NULL);
        if (t > 0) sleep_s(train_s); /* step t - 1 trains meanwhile */
        double t0 = wall_s();
        pthread_join(th, NULL);
        double waited = wall_s() - t0;
        if (t == 2) {
            *plan_s = job.wall_s < *plan_s ? job.wall_s : *plan_s;
            *exposed_s = waited < *exposed_s ? waited : *exposed_s;
        }
    }
    rp_stats_free(stats);
    rp_sched_free(s);
}

int main(int argc, char **argv)
{
    int scale = 1, reps = 3, as_json = 0, construction = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--scale") && i + 1 < argc) scale = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json")) as_json = 1;
        else if (!strcmp(argv[i], "--construction")) construction = 1;
        else {
            fprintf(stderr, "usage: bench_overhead [--scale 1|2|4|8] [--reps R] [--json] [--construction]\n");
            return 2;
        }
    }
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        fprintf(stderr, "bench_overhead: --scale must be 1, 2, 4 or 8\n");
        return 2;
    }
    if (reps < 1) reps = 1;
    rp_context *ctx = NULL;
    rp_config *cfg = NULL;
    rp_gen *gen = NULL;
    rp_error err;
    const char *gen_path = RP_SOURCE_DIR "/examples/gen-reference.json";
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) die("context", NULL);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-reference.json", &cfg, &err) != RP_OK) die("config", &err);

    /* one rank's share of the reference batch: 512 / 64 prompts of 8 responses */
    json_error_t je;
    json_t *settings = json_load_file(gen_path, 0, &je);
    if (!settings) die("gen settings", NULL);
    const int prompts = 8 / scale;
    json_object_set_new(settings, "num_prompts", json_integer(prompts));
    char *text = json_dumps(settings, JSON_COMPACT);
    json_decref(settings);
    if (rp_gen_parse(ctx, text, strlen(text), gen_path, RP_SOURCE_DIR "/examples", &gen, &err) != RP_OK)
        die("gen", &err);
    free(text);
    rp_batch *mine = NULL;
    rp_routing routing;
    if (rp_gen_step(gen, 0, &mine, &routing, &err) != RP_OK) die("gen step", &err);
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *topo = rp_config_topology(cfg);
    const int32_t m = rp_batch_num_seqs(mine), n = m * RANKS;

    /* 1. this rank's statistics */
    double stats_s = 1e30;
    rp_stats *part = NULL;
    for (int r = 0; r < (construction ? 1 : reps); r++) {
        rp_stats_free(part);
        part = NULL;
        double t0 = thread_s();
        if (rp_stats_compute(ctx, mine, &routing, md->num_experts, 1, &part, &err) != RP_OK) die("stats", &err);
        double t = thread_s() - t0;
        stats_s = t < stats_s ? t : stats_s;
    }

    /* 2. the exchange: every rank's part to every rank (a ring allgather across nodes) */
    const size_t part_bytes = rp_stats_serialized_bytes(part);
    unsigned char *bytes = malloc(part_bytes);
    if (rp_stats_serialize(part, bytes, part_bytes, &err) != RP_OK) die("serialise", &err);
    const double exchange_bytes = (double)part_bytes * RANKS;
    const double exchange_s =
        (RANKS - 1) * ((double)part_bytes / topo->net_bytes_per_s + topo->net_latency_s);

    /* 3. the merge: part r holds global ids perm[r * m .. (r + 1) * m) */
    int32_t *perm = malloc(sizeof *perm * (size_t)n);
    for (int32_t i = 0; i < n; i++) perm[i] = i;
    for (int32_t i = n - 1; i > 0; i--) {
        int32_t j = (int32_t)(next_u64() % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    const void *parts[RANKS];
    size_t lens[RANKS];
    const int32_t *ids[RANKS];
    for (int r = 0; r < RANKS; r++) parts[r] = bytes, lens[r] = part_bytes, ids[r] = perm + (size_t)r * m;
    double merge_s = 1e30, merge_fresh_s = 1e30;
    rp_stats *whole = NULL;
    for (int r = 0; r < (construction ? 1 : reps); r++) {
        rp_stats_free(whole);
        whole = NULL;
        double t0 = thread_s();
        if (rp_stats_merge_serialized(ctx, RANKS, parts, lens, ids, n, &whole, &err) != RP_OK) die("merge", &err);
        double t = thread_s() - t0;
        merge_fresh_s = t < merge_fresh_s ? t : merge_fresh_s;
    }
    /* a trainer's steady state: each step's merge into the last step's statistics */
    for (int r = 0; r < reps; r++) {
        double t0 = thread_s();
        if (rp_stats_merge_serialized_reusing(ctx, RANKS, parts, lens, ids, n, &whole, &err) != RP_OK)
            die("merge", &err);
        double t = thread_s() - t0;
        merge_s = t < merge_s ? t : merge_s;
    }

    /* the whole step's lengths, in global id order */
    int32_t *pl = malloc(sizeof *pl * (size_t)n), *rl = malloc(sizeof *rl * (size_t)n);
    for (int r = 0; r < RANKS; r++)
        for (int32_t i = 0; i < m; i++) {
            pl[ids[r][i]] = rp_batch_prompt_lens(mine)[i];
            rl[ids[r][i]] = rp_batch_response_lens(mine)[i];
        }
    rp_batch *batch = NULL;
    if (rp_batch_new(ctx, n, pl, rl, NULL, &batch, &err) != RP_OK) die("batch", &err);

    /* 4. the step from statistics, with a placement in use (the third step: the steady
     * state, a placement and the last step's inputs held from before): the policy's
     * calls in CPU time of this thread (rep->policy_cpu_s; the policy runs here) and the
     * engine's work around them (the step's CPU time less the policy's). The config's
     * policy runs on to its next fallback check (the shipped one checks the baselines
     * every fallback_interval steps): that step, and the mean over the steps 1 to it,
     * one interval; and alternated with it, the same policy checking every step
     * (fallback_interval 1, as before the interval): its third step. */
    step_cost every[STEPS_MAX], now[STEPS_MAX], alone[STEPS_MAX];
    for (int t = 0; t < STEPS_MAX; t++) every[t] = now[t] = alone[t] = (step_cost){1e30, 1e30, 1e30, 0};
    double predicted_s = 0;
    rp_plan *previous = NULL;
    char policy[64] = "", every_params[4096], alone_params[4096];
    for (int k = 0; k < 2; k++) {
        json_t *params = json_loads(rp_config_policy(cfg)->params_json, 0, &je);
        if (!params) die("the config's policy params", NULL);
        if (k == 0) json_object_set_new(params, "fallback_interval", json_integer(1));
        else json_object_set_new(params, "virtual_experts", json_false());
        char *text = json_dumps(params, JSON_COMPACT);
        snprintf(k == 0 ? every_params : alone_params, sizeof every_params, "%s", text);
        free(text);
        json_decref(params);
    }
    int alone_check = 0;
    int check_step = 0;
    const step_parts in = {parts, lens, ids, n};
    for (int r = 0; r < (construction ? 1 : reps); r++) {
        run_steps(ctx, cfg, batch, &in, every_params, construction ? 1 : 3, false, every, &predicted_s, policy,
                  &previous);
        if (construction) break;
        check_step = run_steps(ctx, cfg, batch, &in, NULL, STEPS_MAX, true, now, &predicted_s, policy, NULL);
        double unused;
        alone_check = run_steps(ctx, cfg, batch, &in, alone_params, STEPS_MAX, true, alone, &unused, policy, NULL);
    }

    if (construction) {
        construction_only(ctx, cfg, batch, whole, previous, reps);
        goto done;
    }
    /* Planned ahead: the training it hides behind is the step before's, the reference
     * step's predicted time, cut to 1 s to keep the benchmark short (a plan shorter than
     * that is hidden all the same by the whole step). */
    const double train_s = predicted_s < 1.0 ? predicted_s : 1.0;
    double ahead_s = 1e30, exposed_s = 1e30;
    for (int r = 0; r < reps; r++)
        plan_ahead(ctx, cfg, batch, &in, stats_s + exchange_s, train_s, &ahead_s, &exposed_s);
    const step_cost mean = interval_mean(now, check_step), alone_mean = interval_mean(alone, alone_check);
    const step_cost skip = now[2], check = now[check_step], old = every[2], alone_skip = alone[2];

    /* 5. the joint construction alone, with a placement in use, no fallbacks; then with the
     * shipped policy's fallback check (policies/routepack.lua's list): what the check costs
     * and whether it changed the plan on this batch */
    double construction_s = 1e30, checked_s = 1e30;
    rp_joint_params jp = rp_joint_defaults();
    const char *const none[] = {NULL};
    const char *const shipped[] = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb", NULL};
    rp_joint_report jrep;
    memset(&jrep, 0, sizeof jrep);
    for (int r = 0; r < reps; r++) {
        for (int checked = 0; checked < 2; checked++) {
            rp_plan *jplan = NULL;
            jp.fallbacks = checked ? shipped : none;
            double t0 = thread_s();
            if (rp_joint_plan(ctx, cfg, batch, whole, previous, NULL, &jp, &jplan, checked ? &jrep : NULL, &err) !=
                RP_OK)
                die("joint", &err);
            double t = thread_s() - t0;
            double *best = checked ? &checked_s : &construction_s;
            *best = t < *best ? t : *best;
            rp_plan_free(jplan);
        }
    }
    const int check_changed = strcmp(jrep.chosen, "joint") != 0;

    /* memory: this process is one rank; it holds its own routing only, never the step's */
    const double id_bytes = routing.width == RP_ID_U8 ? 1 : routing.width == RP_ID_U16 ? 2 : 4;
    const double rank_routing_bytes =
        (double)rp_batch_num_tokens(mine) * routing.num_layers * routing.top_k * id_bytes;
    const double step_routing_bytes = (double)rp_batch_num_tokens(batch) * routing.num_layers * routing.top_k * id_bytes;

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const double ms = 1e3, mib = 1.0 / (1 << 20);
    /* per step: this rank's statistics, the exchange and the merge, then the policy and the engine */
    const double fixed_s = stats_s + exchange_s + merge_s;
    const double total_s = fixed_s + skip.policy_s + skip.engine_s, check_total_s = fixed_s + check.policy_s + check.engine_s,
                 interval_total_s = fixed_s + mean.policy_s + mean.engine_s, old_total_s = fixed_s + old.policy_s + old.engine_s,
                 alone_total_s = fixed_s + alone_skip.policy_s + alone_skip.engine_s,
                 alone_interval_s = fixed_s + alone_mean.policy_s + alone_mean.engine_s;
    if (as_json) {
        printf("{\"scale\": %d, \"reps\": %d, \"ranks\": %d, \"num_seqs\": %d, \"rank_seqs\": %d, \"rank_tokens\": %lld, "
               "\"policy\": \"%s\", \"part_bytes\": %zu, \"exchange_bytes\": %.0f, \"stats_ms\": %.3f, "
               "\"exchange_ms\": %.3f, \"merge_ms\": %.3f, \"merge_fresh_ms\": %.3f, \"policy_ms\": %.3f, \"policy_wall_ms\": %.3f, "
               "\"validate_ms\": %.3f, \"total_ms\": %.3f, \"predicted_step_ms\": %.3f, \"overhead_percent\": %.4f, "
               "\"step_fallback_checks\": %d, \"check_step\": %d, \"check_policy_ms\": %.3f, \"check_validate_ms\": %.3f, "
               "\"check_total_ms\": %.3f, \"interval_checks\": %d, \"interval_policy_ms\": %.3f, "
               "\"interval_validate_ms\": %.3f, \"interval_total_ms\": %.3f, \"every_step_policy_ms\": %.3f, "
               "\"every_step_validate_ms\": %.3f, \"every_step_total_ms\": %.3f, \"no_balancer_policy_ms\": %.3f, "
               "\"no_balancer_validate_ms\": %.3f, \"no_balancer_total_ms\": %.3f, \"no_balancer_interval_total_ms\": %.3f, "
               "\"construction_ms\": %.3f, \"checked_construction_ms\": %.3f, \"fallback_check_ms\": %.3f, "
               "\"fallback_chosen\": \"%s\", \"fallback_changed\": %d, \"peak_rss_mib\": %.1f, "
               "\"rank_peak_mib\": %.1f, \"rank_routing_bytes\": %.0f, \"step_routing_bytes\": %.0f, "
               "\"stats_bytes\": %zu, \"plan_ahead_ms\": %.3f, \"plan_ahead_train_ms\": %.3f, \"exposed_ms\": %.3f, "
               "\"exposed_percent\": %.4f}\n",
               scale, reps, RANKS, n, m, (long long)rp_batch_num_tokens(mine), policy, part_bytes, exchange_bytes,
               stats_s * ms, exchange_s * ms, merge_s * ms, merge_fresh_s * ms, skip.policy_s * ms,
               skip.policy_wall_s * ms, skip.engine_s * ms, total_s * ms, predicted_s * ms, 100 * total_s / predicted_s,
               skip.checks, check_step, check.policy_s * ms, check.engine_s * ms, check_total_s * ms, mean.checks,
               mean.policy_s * ms, mean.engine_s * ms, interval_total_s * ms, old.policy_s * ms, old.engine_s * ms,
               old_total_s * ms, alone_skip.policy_s * ms, alone_skip.engine_s * ms, alone_total_s * ms,
               alone_interval_s * ms, construction_s * ms, checked_s * ms, (checked_s - construction_s) * ms, jrep.chosen,
               check_changed, ru.ru_maxrss / 1024.0, ru.ru_maxrss / 1024.0, rank_routing_bytes, step_routing_bytes,
               rp_stats_bytes(whole), ahead_s * ms, train_s * ms, exposed_s * ms, 100 * exposed_s / predicted_s);
    } else {
        printf("bench_overhead: reference config, %d ranks, %d sequences (this rank: %d, %lld tokens), scale 1/%d, "
               "policy %s; CPU ms of this thread, min of %d\n",
               RANKS, n, m, (long long)rp_batch_num_tokens(mine), scale, policy, reps);
        printf("  statistics of the rank's sequences  %10.3f ms\n", stats_s * ms);
        printf("  exchange: %zu bytes a part, %.0f in all  %10.3f ms at %.0f GB/s (modelled)\n", part_bytes,
               exchange_bytes, exchange_s * ms, topo->net_bytes_per_s / 1e9);
        printf("  merge of %d parts                   %10.3f ms into the last step's storage (%.3f ms into fresh "
               "memory)\n", RANKS, merge_s * ms, merge_fresh_s * ms);
        printf("  policy calls (step 2, placement in use, %d fallback checks) %7.3f ms (wall %.3f ms)\n", skip.checks,
               skip.policy_s * ms, skip.policy_wall_s * ms);
        printf("  engine around them (validate, evaluate, migration) %7.3f ms\n", skip.engine_s * ms);
        printf("  total                                %10.3f ms = %.3f%% of the predicted step (%.1f ms)\n",
               total_s * ms, 100 * total_s / predicted_s, predicted_s * ms);
        printf("  the step that checks the fallbacks (step %d): policy %.3f ms, engine %.3f ms, total %.3f ms = %.3f%%\n",
               check_step, check.policy_s * ms, check.engine_s * ms, check_total_s * ms,
               100 * check_total_s / predicted_s);
        printf("  a step of the interval (steps 1 to %d, %d checks): policy %.3f ms, engine %.3f ms, total %.3f ms = "
               "%.3f%%\n", check_step, mean.checks, mean.policy_s * ms, mean.engine_s * ms, interval_total_s * ms,
               100 * interval_total_s / predicted_s);
        printf("  checking every step (fallback_interval 1), step 2: policy %.3f ms, engine %.3f ms, total %.3f ms = "
               "%.3f%%\n", old.policy_s * ms, old.engine_s * ms, old_total_s * ms, 100 * old_total_s / predicted_s);
        printf("  without the balancer's candidate (virtual_experts false: the joint placement every step), step 2: "
               "policy %.3f ms, engine %.3f ms, total %.3f ms = %.3f%%; a step of its interval %.3f ms = %.3f%%\n",
               alone_skip.policy_s * ms, alone_skip.engine_s * ms, alone_total_s * ms, 100 * alone_total_s / predicted_s,
               alone_interval_s * ms, 100 * alone_interval_s / predicted_s);
        printf("  planned ahead (step t + 1 on a thread while step t trains, %.0f ms of it): the plan %.3f ms "
               "(wall), the trainer waited %.3f ms = %.4f%% of the predicted step\n",
               train_s * ms, ahead_s * ms, exposed_s * ms, 100 * exposed_s / predicted_s);
        printf("  joint construction alone (no fallbacks) %7.3f ms\n", construction_s * ms);
        printf("  with the fallback check (4 baselines)   %7.3f ms: the check %.3f ms, chose %s (%s the plan)\n",
               checked_s * ms, (checked_s - construction_s) * ms, jrep.chosen, check_changed ? "changed" : "kept");
        printf("  peak RSS of this rank %.1f MiB; it holds its own routing (%.1f MiB), never the step's (%.1f MiB); "
               "the step's statistics %.1f MiB\n",
               ru.ru_maxrss / 1024.0, rank_routing_bytes * mib, step_routing_bytes * mib,
               rp_stats_bytes(whole) * mib);
    }
done:
    rp_plan_free(previous);
    rp_batch_free(batch);
    rp_stats_free(whole);
    rp_stats_free(part);
    rp_batch_free(mine);
    rp_gen_free(gen);
    rp_config_free(cfg);
    rp_context_free(ctx);
    free(pl);
    free(rl);
    free(perm);
    free(bytes);
    return 0;
}
