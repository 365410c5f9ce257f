/* `routepack simulate`'s parts (core/cli): what one policy did in each step, the
 * options, and the calls between its files: cli/sim_input.c (options, the policy list,
 * the memory estimate) and cli/sim_output.c (summary, verdict, table, JSON, report) below
 * cli/cmd_simulate.c (the run loop). */
#ifndef RP_CLI_SIM_H
#define RP_CLI_SIM_H

#include "cli.h"
#include "internal.h"
#include "routepack/executor.h"
#include "routepack/memory.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

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

/* ---- cli/sim_input.c ---- */

/* Parse simulate's options into *o (outputs checked first). CLI_OK, or what to exit with. */
int sim_parse_opts(int argc, char **argv, sim_opts *o);
/* Split "a, b,c" into trimmed, non-empty specs; the watched file joins the list when it
 * is not in it. Returns the count; -1 when out of memory. */
int sim_split_policies(const char *list, const char *watch, bool vexp, bool slime, char ***out);
/* Refuse a run estimated to hold more than --max-memory, naming the figures and the
 * keys that set them. CLI_OK, or what to exit with. */
int sim_check_memory(rp_context *ctx, const rp_config *cfg, cli_input *in, const sim_opts *o, int np,
                     int32_t history);

/* ---- cli/sim_output.c ---- */

/* The best baseline over the run (step + migration), or NULL. */
const sim_policy *sim_best_baseline(const sim_policy *pol, int np);
void sim_print_table(const sim_policy *pol, int np, const sim_policy *base, const char *config,
                     const cli_input *in, int32_t steps, const rp_config *cfg, bool wide);
bool sim_print_json(const sim_policy *pol, int np, const sim_policy *base, const char *config,
                    const cli_input *in, int32_t steps, const rp_config *cfg, int64_t microbatches);
rp_status sim_write_report(rp_context *ctx, const char *path, const sim_policy *pol, int np,
                           const sim_policy *base, const char *config, const cli_input *in,
                           int32_t steps, const rp_config *cfg, rp_error *err);

#endif
