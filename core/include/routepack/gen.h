/* Calibrated synthetic batches: multi-step RL batches whose expert loads come from a
 * real routing-count file and whose lengths come from a real request trace or a
 * distribution. Deterministic for a seed. Settings are documented in docs/gen.md. */
#ifndef ROUTEPACK_GEN_H
#define ROUTEPACK_GEN_H

#include "routepack/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rp_gen rp_gen;

/* Read generator settings (JSON). Data files named in it are resolved relative to
 * the settings file's directory. Unknown keys and bad values are errors with
 * path:line:column. */
RP_API rp_status rp_gen_load(rp_context *ctx, const char *path, rp_gen **out, rp_error *err);
/* Same from memory; relative paths resolve against base_dir ("." if NULL). */
RP_API rp_status rp_gen_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                       const char *base_dir, rp_gen **out, rp_error *err);
RP_API void rp_gen_free(rp_gen *gen);

/* Shape of what the generator makes. */
typedef struct rp_gen_info {
    int32_t num_steps;
    int32_t num_seqs;          /* per step */
    int32_t num_layers, num_experts, top_k;
    rp_id_width width;
    uint64_t seed;
    double concentration;      /* per-sequence specialization; see docs/gen.md */
    /* Added after the first version (append only). */
    int32_t num_prompts;       /* prompt groups per step */
    int32_t group_size;        /* responses per prompt; num_seqs = num_prompts * group_size */
    int32_t prompt_cap, response_cap;      /* lengths are clamped to [1, cap] */
    double prompt_clip_mass;   /* expected fraction of prompts at prompt_cap */
    double response_clip_mass; /* expected fraction of responses at response_cap */
    double locality, layer_correlation, drift;
    int32_t num_domains;       /* domains in the mixture */
    double calibration_error;  /* largest |inclusion / target - 1| left by calibration */
} rp_gen_info;
/* Borrowed, valid until rp_gen_free (or the next rp_gen_set_* call). */
RP_API const rp_gen_info *rp_gen_get_info(const rp_gen *gen);

/* Replace the settings' seed or step count (the command line's --seed, --steps). */
RP_API void rp_gen_set_seed(rp_gen *gen, uint64_t seed);
RP_API rp_status rp_gen_set_steps(rp_gen *gen, int32_t steps, rp_error *err);

/* The expected share of token-choices of each expert of `layer` at step 0 (before
 * drift): what calibration aims the global load at, the mixture of the counts file's
 * domains mapped onto the generated shape. share[num_experts] sums to 1. */
RP_API rp_status rp_gen_target_load(const rp_gen *gen, int32_t layer, double *share, rp_error *err);

/* Generate step `step` (0-based; any order, each step depends only on the seed and
 * its index). Returns a new batch (caller frees) and a packed routing view whose ids
 * the generator owns until the next call on it or rp_gen_free. Any step >= 0 may be
 * asked for (num_steps is what the command line writes). One call at a time per
 * generator; the work is spread over the settings' "threads", which never changes
 * the result. Errors: RP_ENOMEM for the ids (tokens x layers x top_k x width bytes). */
RP_API rp_status rp_gen_step(rp_gen *gen, int32_t step, rp_batch **batch, rp_routing *routing,
                      rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
