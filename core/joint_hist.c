/* The per-(microbatch, EP group) expert histograms of a packing: one pass over the
 * statistics' per-sequence histograms, which everything after the packing reads. */
#include "joint_internal.h"
#include "routepack/stats.h"

rp_status joint_group_hist(joint *jt, rp_error *err)
{
    const int32_t L = jt->L, E = jt->E, M = jt->M, Q = jt->Q, ep = jt->ep;
    int64_t n;
    if (rp_mul_overflow((int64_t)M * Q, (int64_t)L * E, &n) || n > ((int64_t)1 << 40) || (int64_t)M * Q > INT32_MAX)
        return rp_fail(err, RP_ERANGE, "joint: %d microbatches x %d groups x %d layers x %d experts is too large", M,
                       Q, L, E);
    rp_free(jt->ctx, jt->grp_hist);
    jt->grp_hist = rp_alloc(jt->ctx, (size_t)n * sizeof *jt->grp_hist);
    int32_t *cell = rp_alloc(jt->ctx, (size_t)jt->N * sizeof *cell);
    rp_status st = RP_OK;
    if (!jt->grp_hist || !cell) {
        st = rp_fail_nomem(err, "joint: group histograms");
        goto out;
    }
    /* one "microbatch" of the statistics per (microbatch, EP group) */
    for (int32_t s = 0; s < jt->N; s++) cell[s] = jt->seq_mb[s] * Q + jt->seq_gpu[s] / ep;
    st = rp_stats_microbatch_loads(jt->stats, cell, M * Q, jt->grp_hist, err);
out:
    if (st != RP_OK) {
        rp_free(jt->ctx, jt->grp_hist);
        jt->grp_hist = NULL;
    }
    rp_free(jt->ctx, cell);
    return st;
}
