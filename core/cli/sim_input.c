/* `routepack simulate`'s input: its options, the list of policies to compare (the
 * defaults the config allows), and the estimate of the memory a run will hold, checked
 * against --max-memory before any scheduler is made. */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* token_kk+virtual_experts (Megatron's per-forward balancing) joins where the config
 * allows the balancer (rp_vexp_check_config); slime's packings (its recipes' first fit and
 * its FLOPs balancing) where the trainer does not need equal sequence counts per rank
 * (verl's), which slime does not keep. */
#define SIM_VEXP "token_kk+virtual_experts"
static const char *const default_policies[] = {"token_kk+contiguous", "token_kk+eplb", "token_kk+eplb_periodic",
                                               "verl_kk+eplb", "attn_kk+eplb", "slime_ff+eplb", "slime_kk+eplb",
                                               SIM_VEXP, "routepack", NULL};

/* Default of --max-memory (docs/cli.md): the reference configs need well under it. */
#define SIM_MAX_MEMORY_DEFAULT ((int64_t)4 << 30)

int sim_parse_opts(int argc, char **argv, sim_opts *o)
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
        if (cli_flag(argv[i], "--json", &o->json)) continue;
        if (cli_flag(argv[i], "--wide", &o->wide)) continue;
        return cli_stray_arg("simulate", argv[i], " (use --trace or --config)");
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
int sim_split_policies(const char *list, const char *watch, bool vexp, bool slime, char ***out)
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
int sim_check_memory(rp_context *ctx, const rp_config *cfg, cli_input *in, const sim_opts *o, int np,
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
