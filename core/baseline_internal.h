/* slime's packings for baseline.c (baseline_slime.c: pack first, distribute second).
 * Not installed. */
#ifndef RP_BASELINE_INTERNAL_H
#define RP_BASELINE_INTERNAL_H

#include "internal.h"
#include "routepack/batch.h"
#include "routepack/config.h"
#include "routepack/plan.h"

/* slime's workload of one sequence of `len` tokens (calculate_fwd_flops, dense
 * attention): per layer 2 L d (h + 2 h_kv) d_h + 2 L d^2 + 6 L d f k for the
 * projections and expert MLPs, + 2 h d_h L^2 for causal attention, times the layers. */
double rp_slime_workload(const rp_model *md, double len);

/* slime's --use-dynamic-batch-size packing with --balance-data (docs/baselines.md):
 * each mini-batch (consecutive ids) is split into microbatches, by first fit under the
 * token cap (`first_fit`, slime_ff) or by Karmarkar-Karp on `key` (--balance-by-flops,
 * slime_kk), their count aligned to a multiple of the ranks x
 * trainer.microbatch_multiple by splitting the largest, and then dealt to the ranks by
 * Karmarkar-Karp on `key` with equal counts. `fixed_M` > 0 fixes the count per rank. On
 * success *out is a new plan holding the packing and no placement. */
rp_status rp_baseline_pack_slime(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const double *key,
                                 bool first_fit, int32_t fixed_M, rp_plan **out, rp_error *err);

#endif
