/* `routepack policy list | check`: the policies found on the search path, and a policy
 * file tried out: loaded in the sandbox, its metadata shown, run on a small batch. */
#include "cli.h"
#include "prng.h"

#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- list ---- */

int cmd_policy_list(rp_context *ctx, int argc, char **argv)
{
    const char *config = NULL;
    bool json = false, bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--config", &config, &bad)) continue;
        if (cli_flag(argv[i], "--json", &json)) continue;
        return cli_stray_arg("policy list", argv[i], "");
    }
    if (bad) return CLI_USAGE;
    rp_config *cfg = NULL;
    rp_policy_info *infos = NULL;
    int32_t count = 0;
    rp_error err;
    rp_error_clear(&err);
    int rc = CLI_OK;
    /* without --config, the bundled example's config: its policy search path is empty,
     * so only RP_POLICY_PATH and the shipped policies are searched */
    if (!config) {
        const char *trace, *gen;
        if (!cli_default_example(&config, &trace, &gen)) config = NULL;
    }
    if (config && rp_config_load(ctx, config, &cfg, &err) != RP_OK) return cli_fail(&err);
    if (rp_policy_list(ctx, cfg, &infos, &count, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    if (json) {
        json_t *arr = json_array();
        bool good = arr != NULL;
        for (int32_t i = 0; good && i < count; i++) {
            const rp_policy_info *p = &infos[i];
            char hash[17];
            snprintf(hash, sizeof hash, "%016" PRIx64, p->hash);
            json_t *o = json_pack("{s:s, s:s, s:i, s:s, s:s, s:s, s:b}", "name", p->name, "version",
                                  p->version, "api", p->api, "description", p->description, "path", p->path,
                                  "hash", hash, "shadowed", p->shadowed);
            if (!o || json_array_append_new(arr, o) != 0) good = false;
        }
        json_t *root = good ? json_pack("{s:i, s:o}", "api", RP_POLICY_API, "policies", arr) : NULL;
        if (!root) json_decref(arr);
        if (!cli_print_json(root, 0)) {
            fprintf(stderr, "routepack: could not write the JSON output\n");
            rc = CLI_FAIL;
        }
    } else {
        int wn = 4, wv = 7;
        for (int32_t i = 0; i < count; i++) {
            int n = (int)strlen(infos[i].name), v = (int)strlen(infos[i].version);
            wn = n > wn ? n : wn;
            wv = v > wv ? v : wv;
        }
        printf("%-*s  %-*s  %3s  %s\n", wn, "name", wv, "version", "api", "description");
        for (int32_t i = 0; i < count; i++) {
            const rp_policy_info *p = &infos[i];
            printf("%-*s  %-*s  %3d  %s\n%-*s  %s%s%s\n", wn, p->name, wv, p->version, p->api,
                   p->description, wn + wv + 7, "", p->path,
                   p->shadowed ? " (shadowed by an earlier one of the same name)" : "",
                   p->api != RP_POLICY_API ? " (another API version: cannot run here)" : "");
        }
        printf("\n%d polic%s found (this build serves policy API %d)\n", count, count == 1 ? "y" : "ies",
               RP_POLICY_API);
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    rp_text_free(ctx, (char *)infos);
    rp_config_free(cfg);
    return rc;
}

/* ---- check ---- */

/* A small fixed batch for any config: 4 sequences per GPU (2 prompts x 2 responses
 * each), lengths spread over a decade and within the token cap, routing skewed towards
 * a few experts per layer so a placement policy has something to balance. The ids are
 * owned by *ids (free). */
static int handmade_batch(rp_context *ctx, const rp_config *cfg, rp_batch **batch, rp_routing *routing,
                          void **ids)
{
    const rp_model *m = rp_config_model(cfg);
    const int32_t G = rp_config_topology(cfg)->num_gpus, n = 4 * G;
    int64_t cap = rp_config_limits(cfg)->max_tokens_per_microbatch;
    int64_t longest = cap < 4096 ? cap : 4096;
    /* about 2^17 tokens in all (the lengths below average a third of the longest): the
     * routing is tokens x layers x top-k choices, which took minutes to draw on the
     * largest example configs at 4096 tokens a sequence */
    int64_t budget = (int64_t)3 * 131072 / n;
    if (longest > budget) longest = budget > 16 ? budget : 16;
    int32_t *prompt = malloc((size_t)n * sizeof *prompt), *response = malloc((size_t)n * sizeof *response);
    int32_t *group = malloc((size_t)n * sizeof *group);
    int rc = CLI_FAIL;
    rp_error err;
    *ids = NULL;
    if (!prompt || !response || !group) goto oom;
    for (int32_t s = 0; s < n; s++) {
        /* geometric spread: the longest about 16x the shortest, as RL responses are */
        double f = pow(16.0, (double)((s * 7) % n) / n) / 16.0;
        int32_t len = (int32_t)(longest * f);
        if (len < 2) len = 2;
        prompt[s] = len / 4 > 0 ? len / 4 : 1;
        response[s] = len - prompt[s];
        group[s] = s / 2;
    }
    if (rp_batch_new(ctx, n, prompt, response, group, batch, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    int64_t tokens = rp_batch_num_tokens(*batch), per_token = (int64_t)m->num_layers * m->top_k;
    int32_t *id = malloc((size_t)(tokens * per_token > 0 ? tokens * per_token : 1) * sizeof *id);
    if (!id) goto oom;
    uint64_t state = 42;
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t l = 0; l < m->num_layers; l++) {
            int32_t *row = id + (t * m->num_layers + l) * m->top_k;
            for (int32_t j = 0; j < m->top_k; j++) {
                int32_t e;
                bool again;
                do {
                    /* half the choices go to the first eighth of the experts (shifted per layer) */
                    uint64_t r = rp_splitmix64(&state); /* the same ids on every machine */
                    int32_t hot = m->num_experts / 8 > 0 ? m->num_experts / 8 : 1;
                    e = (int32_t)((r & 1) ? (r >> 1) % (uint64_t)m->num_experts
                                          : ((r >> 1) % (uint64_t)hot + (uint64_t)l * 3) % (uint64_t)m->num_experts);
                    again = false;
                    for (int32_t q = 0; q < j; q++) again |= row[q] == e;
                } while (again);
                row[j] = e;
            }
        }
    rp_routing_packed(routing, RP_ID_I32, m->num_layers, m->top_k, id);
    *ids = id;
    rc = CLI_OK;
    goto out;
oom:
    fprintf(stderr, "routepack: out of memory making the check batch\n");
out:
    free(prompt);
    free(response);
    free(group);
    return rc;
}

/* A JSON value as short text: strings bare, numbers as %g, others as JSON. */
static void value_text(json_t *v, char *buf, size_t size)
{
    if (!v || json_is_null(v)) snprintf(buf, size, "-");
    else if (json_is_string(v)) snprintf(buf, size, "%s", json_string_value(v));
    else if (json_is_number(v)) snprintf(buf, size, "%.10g", json_number_value(v));
    else if (json_is_true(v)) snprintf(buf, size, "true");
    else if (json_is_false(v)) snprintf(buf, size, "false");
    else {
        char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        snprintf(buf, size, "%s", t ? t : "?");
        free(t);
    }
}

/* Print rp_policy_describe's JSON: metadata, then one line per param. */
static bool print_description(const char *file, const char *config, const char *text, size_t len)
{
    json_t *d = json_loadb(text, len, 0, NULL);
    if (!json_is_object(d)) {
        json_decref(d);
        return false;
    }
    printf("%s: loaded in the sandbox; metadata and params checked (config %s)\n", file, config);
    printf("  name         %s\n", json_string_value(json_object_get(d, "name")));
    printf("  version      %s\n", json_string_value(json_object_get(d, "version")));
    printf("  api          %lld (this build serves %d)\n",
           (long long)json_integer_value(json_object_get(d, "api")), RP_POLICY_API);
    printf("  description  %s\n", json_string_value(json_object_get(d, "description")));
    printf("  path         %s\n", json_string_value(json_object_get(d, "path")));
    printf("  source hash  %s\n", json_string_value(json_object_get(d, "hash")));
    printf("  init         %s\n", json_is_true(json_object_get(d, "has_init")) ? "yes" : "no");
    json_t *params = json_object_get(d, "params");
    size_t n = json_array_size(params);
    printf("  params       %zu%s\n", n, n ? ":" : "");
    size_t i;
    json_t *p;
    json_array_foreach(params, i, p) {
        char dflt[128], value[128], range[256] = "";
        value_text(json_object_get(p, "default"), dflt, sizeof dflt);
        value_text(json_object_get(p, "value"), value, sizeof value);
        json_t *min = json_object_get(p, "min"), *max = json_object_get(p, "max"), *values = json_object_get(p, "values");
        if (min || max) {
            char lo[64], hi[64];
            value_text(min, lo, sizeof lo);
            value_text(max, hi, sizeof hi);
            snprintf(range, sizeof range, ", range [%s, %s]", min ? lo : "-inf", max ? hi : "inf");
        } else if (values) {
            char list[200];
            value_text(values, list, sizeof list);
            snprintf(range, sizeof range, ", one of %s", list);
        }
        printf("    %-20s %-8s default %s%s%s%s%s\n", json_string_value(json_object_get(p, "name")),
               json_string_value(json_object_get(p, "type")), dflt, range,
               strcmp(dflt, value) ? " (here: " : "", strcmp(dflt, value) ? value : "", strcmp(dflt, value) ? ")" : "");
        const char *doc = json_string_value(json_object_get(p, "doc"));
        if (doc && doc[0]) printf("      %s\n", doc);
    }
    json_decref(d);
    return true;
}

/* Steps `policy check` runs: a policy failing from its third step, or after a few steps
 * of history or state, or only once rp.joint's fallback check comes round, fails here;
 * with the scheduler's default demote_after (3) the last failures show the demotion. */
#define CHECK_STEPS 8

typedef struct check_opts {
    const char *file, *config, *trace;
    int64_t step;
    bool json;
} check_opts;

/* What the plan does, rank by rank. */
static void print_plan(const rp_plan *plan, const rp_batch *batch)
{
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    printf("  packing: %d microbatch%s per rank; tokens per microbatch:\n", M, M == 1 ? "" : "es");
    for (int32_t g = 0; g < G; g++) {
        int32_t seqs = 0;
        int64_t total = 0;
        printf("    rank %3d:", g);
        for (int32_t mb = 0; mb < M; mb++) {
            int32_t count;
            const int32_t *ids = rp_plan_microbatch(plan, g, mb, &count);
            int64_t tokens = 0;
            for (int32_t i = 0; i < count; i++) tokens += rp_batch_seq_len(batch, ids[i]);
            if (mb < 8) printf(" %6" PRId64, tokens);
            seqs += count;
            total += tokens;
        }
        printf("%s  (%d sequences, %" PRId64 " tokens)\n", M > 8 ? " ..." : "", seqs, total);
    }
    const int32_t L = rp_plan_num_layers(plan), E = rp_plan_num_experts(plan);
    int32_t replicated = 0, max_replicas = 0;
    int32_t *logcnt = malloc((size_t)E * sizeof *logcnt);
    for (int32_t l = 0; logcnt && l < L; l++) {
        int32_t mx = rp_plan_logcnt(plan, l, logcnt);
        max_replicas = mx > max_replicas ? mx : max_replicas;
        for (int32_t e = 0; e < E; e++) replicated += logcnt[e] > 1;
    }
    free(logcnt);
    printf("  placement: %d experts x %d layers over %d slots per layer; %d (expert, layer) pairs "
           "replicated, at most %d replica%s\n", E, L, rp_plan_total_slots(plan), replicated, max_replicas,
           max_replicas == 1 ? "" : "s");
    if (rp_plan_num_extra_replicas(plan) || rp_plan_num_share_sets(plan))
        printf("  levers: %d extra replicas, %d share sets\n", rp_plan_num_extra_replicas(plan),
               rp_plan_num_share_sets(plan));
}

int cmd_policy_check(rp_context *ctx, int argc, char **argv)
{
    check_opts o;
    memset(&o, 0, sizeof o);
    const char *step = NULL;
    bool bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--config", &o.config, &bad) || cli_opt(argc, argv, &i, "--trace", &o.trace, &bad) ||
            cli_opt(argc, argv, &i, "--step", &step, &bad))
            continue;
        if (argv[i][0] == '-' && argv[i][1]) return cli_unknown_option("policy check", argv[i]);
        if (o.file) return cli_usage("policy check takes one POLICY.lua, got '%s' and '%s'", o.file, argv[i]);
        o.file = argv[i];
    }
    if (bad) return CLI_USAGE;
    if (!o.file) return cli_usage("usage: routepack policy check POLICY.lua [--config C] [--trace T [--step K]]");
    if (step) {
        if (!cli_int("--step", step, &o.step)) return CLI_USAGE;
        if (!o.trace) return cli_usage("policy check: --step needs --trace");
        if (o.step < 0 || o.step > INT32_MAX) return cli_usage("--step must be >= 0, got %s", step);
    }
    const char *ex_config = NULL, *ex_trace = NULL, *ex_gen = NULL;
    bool have_example = cli_default_example(&ex_config, &ex_trace, &ex_gen);
    const char *config = o.config ? o.config : ex_config;
    if (!config) {
        fprintf(stderr, "routepack: cannot find the bundled example config; give --config\n");
        return CLI_FAIL;
    }

    rp_config *cfg = NULL;
    rp_sched *sched = NULL;
    cli_input in;
    memset(&in, 0, sizeof in);
    rp_batch *batch = NULL;
    rp_routing routing;
    void *ids = NULL;
    rp_stats *stats = NULL;
    rp_cost *cost = NULL;
    rp_plan *base_plan = NULL;
    rp_error err;
    rp_error_clear(&err);
    int rc = CLI_FAIL;
    const char *batch_what = "a hand-made batch";
    char batch_desc[1200];

    if (cli_config_load(ctx, config, 0, &cfg, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    /* the batch: the given trace step, else the bundled example's first step (simulate's
     * default input) when its model is the config's, else the hand-made one */
    const char *trace = o.trace ? o.trace : have_example ? ex_trace : NULL;
    const char *gen = !o.trace && have_example ? ex_gen : NULL;
    if (trace || gen) {
        if (cli_input_open(ctx, trace, gen, &in, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        if (cli_input_check(&in, cfg, &err) != RP_OK) {
            if (o.trace) {
                rc = cli_fail(&err);
                goto out;
            }
            cli_input_close(&in); /* another model: the hand-made batch fits any */
        }
    }
    int64_t step_index = 0;
    if (in.trace || in.gen) {
        if (in.trace && o.step >= in.num_steps) {
            rc = cli_usage("%s has %d step%s, --step %" PRId64 " does not exist", in.path, in.num_steps,
                           in.num_steps == 1 ? "" : "s", o.step);
            goto out;
        }
        if (cli_input_read(&in, (int32_t)o.step, &batch, &routing, &step_index, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        batch_what = o.trace ? "step of a trace" : "the bundled example's first step";
        snprintf(batch_desc, sizeof batch_desc, "%s (%s)", batch_what, in.path);
    } else {
        if ((rc = handmade_batch(ctx, cfg, &batch, &routing, &ids)) != CLI_OK) goto out;
        rc = CLI_FAIL;
        snprintf(batch_desc, sizeof batch_desc, "%s", batch_what);
    }

    /* metadata and params, checked as rp_sched_new checks them */
    char *desc = NULL;
    size_t desc_len;
    if (rp_policy_describe(ctx, cfg, o.file, &desc, &desc_len, &err) != RP_OK) {
        fprintf(stderr, "routepack: %s: %s\n", o.file, err.text[0] ? err.text : rp_strerror(err.status));
        goto out;
    }
    bool printed = print_description(o.file, config, desc, desc_len);
    rp_text_free(ctx, desc);
    if (!printed) {
        fprintf(stderr, "routepack: %s: could not read the policy's description\n", o.file);
        goto out;
    }

    rp_sched_options opts;
    rp_sched_options_default(&opts);
    opts.policy = o.file;
    if (rp_sched_new(ctx, cfg, &opts, &sched, &err) != RP_OK) {
        fprintf(stderr, "routepack: %s: %s\n", o.file, err.text[0] ? err.text : rp_strerror(err.status));
        goto out;
    }
    bool successive = (in.trace || in.gen) && in.num_steps > 1;
    printf("\nbatch: %s: %d sequences, %" PRId64 " tokens, %d GPUs; %s %d steps\n", batch_desc,
           rp_batch_num_seqs(batch), rp_batch_num_tokens(batch), rp_config_topology(cfg)->num_gpus,
           successive ? "then the input's next steps, for" : "the same batch for", CHECK_STEPS);

    /* CHECK_STEPS steps, each with the state and history the ones before left, as in
     * training: the input's next steps (wrapping around), or the hand-made batch again */
    bool failed = false, good_before = false;
    const rp_plan *plan = NULL;
    for (int k = 0; k < CHECK_STEPS; k++) {
        const rp_step_report *rep;
        if (k > 0 && successive) {
            rp_batch_free(batch);
            batch = NULL;
            int64_t ignored;
            if (cli_input_read(&in, (int32_t)((o.step + k) % in.num_steps), &batch, &routing, &ignored, &err) != RP_OK) {
                rc = cli_fail(&err);
                goto out;
            }
        }
        if (rp_sched_step(sched, step_index + k, batch, &routing, &plan, &rep, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        printf("step %" PRId64 ": ", step_index + k);
        if (rep->fallback) {
            printf("FAILED, %s was used:\n  %s\n", good_before ? "the last good plan" : "the safe default plan",
                   rep->fallback_reason);
            failed = true;
        } else {
            good_before = true;
            printf("step %.3f ms, lower bound %.3f ms, step / lower bound %.3f; attention imbalance %.3f, "
                   "expert imbalance %.3f; %" PRId64 " work units, %.1f ms\n", rep->cost.step_s * 1e3,
                   rep->cost.lower_bound_s * 1e3, rep->cost.ratio, rep->cost.attention_imbalance,
                   rep->cost.expert_imbalance, rep->policy_work, rep->plan_wall_s * 1e3);
        }
        if (rep->demoted)
            printf("  after %d steps in a row that fell back the policy was demoted: '%s' runs from the next step\n",
                   (int)rep->failed_steps, rep->demoted_to);
    }
    /* what the plan in use does (after a failure: the fallback plan; the reason above
     * lists the validation problems of the plan the policy returned) */
    printf("\nthe plan %s:\n", failed ? "in use after the failure" : "of the last step");
    print_plan(plan, batch);

    /* for scale: the users' baseline on the same batch */
    rp_cost_summary base;
    if (rp_stats_compute(ctx, batch, &routing, rp_config_model(cfg)->num_experts, 0, &stats, &err) == RP_OK &&
        rp_baseline_plan(ctx, cfg, batch, stats, NULL, "token_kk+eplb", 0, &base_plan, &err) == RP_OK &&
        rp_cost_new(ctx, cfg, batch, stats, opts.split, &cost, &err) == RP_OK &&
        rp_cost_evaluate(cost, base_plan, &base, &err) == RP_OK)
        printf("  for comparison, token_kk+eplb on this batch: step / lower bound %.3f\n", base.ratio);
    else
        printf("  (token_kk+eplb could not be built on this batch: %s)\n", err.text);

    if (failed) {
        fprintf(stderr, "routepack: %s: the policy failed on the check batch\n", o.file);
        rc = CLI_FAIL;
    } else {
        printf("\n%s: OK\n", o.file);
        rc = CLI_OK;
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    rp_plan_free(base_plan);
    rp_cost_free(cost);
    rp_stats_free(stats);
    rp_sched_free(sched);
    rp_batch_free(batch);
    free(ids);
    cli_input_close(&in);
    rp_config_free(cfg);
    return rc;
}
