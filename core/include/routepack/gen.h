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
} rp_gen_info;
RP_API const rp_gen_info *rp_gen_get_info(const rp_gen *gen);

/* Generate step `step` (0-based; any order, each step depends only on the seed and
 * its index). Returns a new batch (caller frees) and a packed routing view whose ids
 * the generator owns until the next call on it or rp_gen_free. */
RP_API rp_status rp_gen_step(rp_gen *gen, int32_t step, rp_batch **batch, rp_routing *routing,
                      rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
