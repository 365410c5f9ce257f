/* trainer.nonempty_microbatches: fill the empty (rank, microbatch) cells of a baseline's
 * packing (nonempty_internal.h; the joint packers never leave one, joint_pack_open). Moving one short sequence out of the fullest cell changes the
 * packing least; it keeps every cap, since a sequence fits a cell alone (the packers check
 * it) and the donor only loses tokens. */
#include "nonempty_internal.h"
#include "routepack/batch.h"

rp_status rp_nonempty_check_counts(int32_t N, int32_t G, int32_t M, const char *who, rp_error *err)
{
    const int64_t cells = (int64_t)G * M;
    if ((int64_t)N >= cells) return RP_OK;
    return rp_fail(err, RP_EINVAL,
                   "%s: %d microbatches on each of %d DP ranks need at least %lld sequences, but the batch has %d "
                   "(trainer.nonempty_microbatches needs a sequence in every microbatch): give the step more "
                   "sequences, fewer microbatches, or turn the key off",
                   who, M, G, (long long)cells, N);
}

rp_status rp_fill_empty_cells(rp_context *ctx, const rp_batch *batch, int32_t G, int32_t M, int32_t K,
                              int32_t *seq_rank, int32_t *seq_mb, bool keep_rank_counts, const char *who,
                              rp_error *err)
{
    const int32_t Mk = M / K; /* microbatches of one mini-batch */
    const int32_t N = rp_batch_num_seqs(batch);
    const int64_t cells = (int64_t)G * M;
    rp_status cst = rp_nonempty_check_counts(N, G, M, who, err);
    if (cst != RP_OK) return cst;
    int32_t *count = rp_calloc(ctx, (size_t)cells, sizeof *count);
    int32_t *per_rank = rp_calloc(ctx, (size_t)G * K, sizeof *per_rank); /* per (rank, mini-batch) */
    rp_status st = RP_OK;
    if (!count || !per_rank) {
        st = rp_fail_nomem(err, "nonempty microbatches: cell counts");
        goto out;
    }
    for (int32_t s = 0; s < N; s++) {
        count[(size_t)seq_rank[s] * M + seq_mb[s]]++;
        per_rank[(size_t)seq_rank[s] * K + seq_mb[s] / Mk]++;
    }
    if (keep_rank_counts)
        for (int32_t g = 0; g < G; g++)
            for (int32_t b = 0; b < K; b++) {
                const int32_t have = per_rank[(size_t)g * K + b];
                if (have >= Mk) continue;
                if (K == 1)
                    st = rp_fail(err, RP_EINVAL,
                                 "%s: rank %d runs %d sequences, fewer than its %d microbatches "
                                 "(trainer.nonempty_microbatches needs a sequence in every microbatch): give the step "
                                 "more sequences, fewer microbatches, or turn the key off",
                                 who, g, have, M);
                else
                    st = rp_fail(err, RP_EINVAL,
                                 "%s: rank %d mini-batch %d runs %d sequences, fewer than its %d microbatches "
                                 "(trainer.nonempty_microbatches needs a sequence in every microbatch; "
                                 "trainer.mini_batches %d): give the step more sequences, fewer microbatches or "
                                 "mini-batches, or turn the key off",
                                 who, g, b, have, Mk, K);
                goto out;
            }
    for (int64_t c = 0; c < cells; c++) {
        if (count[c] > 0) continue;
        const int32_t g = (int32_t)(c / M), m0 = (int32_t)(c % M) / Mk * Mk; /* its mini-batch's first */
        int64_t donor = -1;
        for (int32_t m = m0; m < m0 + Mk; m++) {
            int64_t d = (int64_t)g * M + m;
            if (count[d] >= 2 && (donor < 0 || count[d] > count[donor])) donor = d;
        }
        /* only without keep_rank_counts: the rank's mini-batch has fewer than M / K; first
         * from the same mini-batch on another rank (it keeps every mini-batch's work), then
         * from anywhere */
        for (int32_t g2 = 0; g2 < G && donor < 0 && K > 1; g2++)
            for (int32_t m = m0; m < m0 + Mk; m++) {
                int64_t d = (int64_t)g2 * M + m;
                if (count[d] >= 2 && (donor < 0 || count[d] > count[donor])) donor = d;
            }
        if (donor < 0)
            for (int64_t d = 0; d < cells; d++)
                if (count[d] >= 2 && (donor < 0 || count[d] > count[donor])) donor = d;
        if (donor < 0) { /* N >= cells leaves a cell of two while one is empty */
            st = rp_fail(err, RP_EINVAL, "%s: no cell to fill rank %d microbatch %d from", who, g,
                         (int32_t)(c % M));
            goto out;
        }
        int32_t pick = -1;
        for (int32_t s = 0; s < N; s++)
            if ((int64_t)seq_rank[s] * M + seq_mb[s] == donor &&
                (pick < 0 || rp_batch_seq_len(batch, s) < rp_batch_seq_len(batch, pick)))
                pick = s;
        seq_rank[pick] = g;
        seq_mb[pick] = (int32_t)(c % M);
        count[donor]--;
        count[c]++;
    }
out:
    rp_free(ctx, count);
    rp_free(ctx, per_rank);
    return st;
}
