/* The per-(microbatch, EP group) expert histograms of a packing, which everything after
 * the packing reads: summed from the evaluator's per-GPU counts of the packing
 * (cost_read_packing), which the evaluation of the plan on this packing then takes over,
 * so the per-sequence histograms are read once for both. */
#include "cost_internal.h"
#include "joint_internal.h"

rp_status joint_group_hist(joint *jt, rp_error *err)
{
    const int32_t L = jt->L, E = jt->E, M = jt->M, Q = jt->Q, ep = jt->ep;
    int64_t n;
    if (rp_mul_overflow((int64_t)M * Q, (int64_t)L * E, &n) || n > ((int64_t)1 << 40) || (int64_t)M * Q > INT32_MAX)
        return rp_fail(err, RP_ERANGE, "joint: %d microbatches x %d groups x %d layers x %d experts is too large", M,
                       Q, L, E);
    rp_free(jt->ctx, jt->grp_hist);
    jt->grp_hist = rp_alloc(jt->ctx, (size_t)n * sizeof *jt->grp_hist);
    if (!jt->grp_hist) return rp_fail_nomem(err, "joint: group histograms");
    const int32_t *counts = NULL;
    rp_status st = cost_read_packing(jt->cost, M, jt->seq_gpu, jt->seq_mb, &counts, err);
    if (st != RP_OK) {
        rp_free(jt->ctx, jt->grp_hist);
        jt->grp_hist = NULL;
        return st;
    }
    /* group q's rows are GPUs q ep .. q ep + ep - 1 of each (mb, layer): integer sums, the
     * per-sequence histograms' in any order */
    const int32_t G = jt->G;
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < L; l++)
            for (int32_t q = 0; q < Q; q++) {
                int64_t *out = jt->grp_hist + (((size_t)m * Q + q) * L + l) * E;
                const int32_t *row = counts + (((size_t)m * L + l) * G + (size_t)q * ep) * E;
                for (int32_t e = 0; e < E; e++) out[e] = row[e];
                for (int32_t j = 1; j < ep; j++) {
                    row += E;
                    for (int32_t e = 0; e < E; e++) out[e] += row[e];
                }
            }
    return RP_OK;
}
