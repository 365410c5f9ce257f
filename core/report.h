/* The simulation report as one self-contained HTML page (inline CSS and SVG charts, no
 * scripts, nothing fetched). Private to the core: the CLI and, later, the Python binding
 * fill an rp_report and get the page back as text. */
#ifndef RP_REPORT_H
#define RP_REPORT_H

#include "routepack/cost.h"
#include "routepack/memory.h"

/* One distinct reason a policy's steps fell back: its text, the first step it occurred
 * at and how many steps gave it. */
typedef struct rp_report_reason {
    const char *text;
    int64_t first_step;
    int32_t count;
} rp_report_reason;

/* One policy of a simulation. Every pointer is borrowed for the duration of the call. */
typedef struct rp_report_policy {
    const char *label;          /* the policy spec as given ("token_kk+eplb", a path) */
    const char *error;          /* why it did not run (NULL: it ran); such a policy appears
                                   in the table only */
    const char *running;        /* what ran last: "name version" ("version" when the name
                                   is the label), or NULL */
    int32_t num_steps;          /* steps it ran (>= 1 unless error) */
    const int64_t *steps;       /* [num_steps] step indices */
    const double *ratio;        /* [num_steps] step time / lower bound */
    const bool *fallback;       /* [num_steps] the step used the last good plan; may be NULL */
    /* summary over its steps */
    double mean_step_s;
    double mean_ratio;
    double mean_shared_ratio;   /* mean of step / the step's shared bound (the least own bound
                                   of all plans of that step); NAN when not known */
    double speedup;             /* against the baseline; NAN when there is none */
    double attention_imbalance, expert_imbalance;
    int32_t fallbacks, swaps;
    double migrated_bytes_per_step;
    double mean_plan_s;
    /* at step rp_report.load_step (the per-GPU charts show one step for every policy, so
     * that they compare): its step / lower bound, its straggler (mb, layer) and the
     * forward time each GPU spends at that microbatch and layer; attention NULL when the
     * policy did not run that step */
    double load_ratio;
    int32_t straggler_mb, straggler_layer, straggler_gpu;
    rp_side straggler_side;
    const double *attention, *dispatch, *expert, *combine; /* [num_gpus] seconds */
    /* per step [num_steps]: predicted step time and migration time (seconds), bytes
     * migrated, rounds of the migration plan and the most staging one GPU used in a round
     * (0 without a migration), plan time (statistics + policy + validation, seconds);
     * NULL: the per-step time and migration sections leave the policy out */
    const double *step_s, *migration_s, *migration_bytes, *plan_s;
    const int32_t *migration_rounds;
    const int64_t *staging_bytes;
    /* forward expert time of each GPU at each layer, summed over the microbatches of step
     * rp_report.load_step, [num_layers * num_gpus] (layer-major), seconds: the expert load
     * the placement left; NULL when the policy did not run that step */
    const double *expert_layer;
    /* the most memory one GPU needed at any step of the run (rp_memory_peak of each step's
     * plan); NULL: the memory section leaves the policy out */
    const rp_gpu_memory *memory;
    /* why its steps fell back, distinct reasons in the order they first occurred (and
     * demotions, as reasons of their own); NULL or 0: none shown */
    const rp_report_reason *fallback_reasons;
    int32_t num_fallback_reasons;
} rp_report_policy;

typedef struct rp_report {
    const char *title;          /* page title, e.g. "RoutePack simulation" */
    const char *const *context; /* lines shown under the title (config, input, shape),
                                   NULL-terminated; may be NULL */
    const char *baseline;       /* label the speedups are against; may be NULL */
    int32_t num_gpus;
    int32_t gpus_per_node;      /* for node separators on the per-GPU charts */
    int32_t ep_size;            /* for EP group separators on the expert load heatmap */
    int32_t num_layers;         /* MoE layers (rows of rp_report_policy.expert_layer) */
    int32_t num_policies;
    const rp_report_policy *policies;
    int64_t load_step;          /* the step of the expert load and per-GPU charts (one for
                                   all policies, so their bars compare: the CLI takes the
                                   worst overall) */
    const char *verdict;        /* one line shown first (simulate's verdict); may be NULL */
} rp_report;

/* Render the page. *text is NUL-terminated, allocated through ctx (rp_text_free).
 * Up to 32 GPUs the expert load is drawn as bars per GPU; above, as a heatmap of GPU x
 * layer per policy (bars of 64-256 GPUs all look alike).
 * Errors: RP_EINVAL for a report without GPUs, policies or a policy's arrays (named),
 * RP_ENOMEM. Deterministic: the same report gives the same bytes. */
rp_status rp_report_html(rp_context *ctx, const rp_report *report, char **text, size_t *len,
                         rp_error *err);

#endif
