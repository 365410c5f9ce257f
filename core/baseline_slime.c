/* slime's data balancing as baseline packings (docs/baselines.md): pack first, distribute
 * second, as THUDM/slime's build_dp_schedule does with --use-dynamic-batch-size and
 * --balance-data (slime_ff: first-fit microbatches) or --balance-by-flops (slime_kk:
 * Karmarkar-Karp microbatches); slime/utils/dp_schedule.py at 624b824a. */
#include "baseline_internal.h"
#include "limits_internal.h"
#include "nonempty_internal.h"
#include "routepack/primitives.h"

#include <string.h>

double rp_slime_workload(const rp_model *md, double len)
{
    const double d = md->hidden_size, h = md->num_heads, hkv = md->num_kv_heads, dh = md->head_dim;
    const double ffn = (double)md->expert_ffn_size * md->top_k;
    const double linear = 2 * d * h * dh + 4 * d * hkv * dh + 2 * d * d + 6 * d * ffn;
    return md->num_layers * (linear * len + 2 * h * dh * len * len);
}

/* One mini-batch's sequences lo .. lo + m - 1 into microbatches ("bins"); bin[j] is
 * sequence lo + j's bin; returns the bin count, or -1 with err set.
 * - first fit (slime's first_fit_pack): in id order, each sequence into the first bin
 *   it fits under the cap, else a new bin;
 * - Karmarkar-Karp (--balance-by-flops): ceil(tokens / cap) bins, Karmarkar-Karp on the
 *   key without equal sizes; one sequence per bin when the count reaches the sequences.
 *   slime does not check the cap here; with `repair` we do (rp_partition_kk's repair
 *   pass), and where it cannot fit, one more bin. */
static int32_t slime_bins(rp_context *ctx, const rp_batch *batch, const double *key, bool first_fit, bool repair,
                          int64_t cap, int32_t lo, int32_t m, double *tok, int32_t *bin, rp_error *err)
{
    int64_t tokens = 0;
    for (int32_t j = 0; j < m; j++) {
        tok[j] = (double)rp_batch_seq_len(batch, lo + j);
        tokens += rp_batch_seq_len(batch, lo + j);
    }
    if (first_fit) {
        int32_t nb = 0;
        double *sum = tok + m; /* [m]: a bin's tokens */
        for (int32_t j = 0; j < m; j++) {
            int32_t b = 0;
            while (b < nb && sum[b] + tok[j] > (double)cap) b++;
            if (b == nb) sum[nb++] = 0;
            sum[b] += tok[j];
            bin[j] = b;
        }
        return nb;
    }
    int64_t want = (tokens + cap - 1) / cap;
    for (int32_t k = want < 1 ? 1 : (int32_t)(want < m ? want : m); k < m; k++) {
        rp_part_limits lim = {.size = tok, .size_cap = (double)cap};
        rp_error kk_err;
        rp_status st = rp_partition_kk(ctx, key + lo, m, k, false, repair ? &lim : NULL, bin, &kk_err);
        if (st == RP_OK) return k;
        if (st != RP_ERANGE || !repair) {
            *err = kk_err;
            return -1;
        }
    }
    for (int32_t j = 0; j < m; j++) bin[j] = j;
    return m;
}

/* slime's expand_bins_by_splitting: while fewer than `target` bins, the multi-sequence
 * bin with the most tokens (ties: the later bin) is split in two by LPT on tokens, its
 * sequences longest first (ties: lower id) each to the lighter half (ties: the first);
 * the first half keeps the bin, the second becomes the last. Stops when every bin holds
 * one sequence. Returns the bin count; tokens[b] and members[b] ([target]) are then each
 * bin's tokens and sequences (0 for the bins left empty). */
static int32_t slime_split(rp_context *ctx, const rp_batch *batch, int32_t lo, int32_t m, int32_t nb,
                           int32_t target, int32_t *bin, double *tokens, int32_t *members, double *len,
                           int32_t *order, rp_error *err)
{
    for (int32_t b = 0; b < target; b++) tokens[b] = 0, members[b] = 0;
    for (int32_t j = 0; j < m; j++) tokens[bin[j]] += (double)rp_batch_seq_len(batch, lo + j), members[bin[j]]++;
    while (nb < target) {
        int32_t best = -1;
        for (int32_t b = 0; b < nb; b++)
            if (members[b] > 1 && (best < 0 || tokens[b] >= tokens[best])) best = b;
        if (best < 0) break;
        int32_t c = 0;
        for (int32_t j = 0; j < m; j++)
            if (bin[j] == best) len[c] = (double)rp_batch_seq_len(batch, lo + j), order[c++] = j;
        /* order[] holds the members ascending; a stable descending sort by length */
        int32_t *idx = order + m;
        if (rp_sort_index(ctx, len, c, true, idx, err) != RP_OK) return -1;
        double half[2] = {0, 0};
        int32_t count[2] = {0, 0};
        for (int32_t i = 0; i < c; i++) {
            int32_t j = order[idx[i]], h = half[0] <= half[1] ? 0 : 1;
            half[h] += len[idx[i]];
            count[h]++;
            bin[j] = h == 0 ? best : nb;
        }
        tokens[best] = half[0], members[best] = count[0];
        tokens[nb] = half[1], members[nb] = count[1];
        nb++;
    }
    return nb;
}

rp_status rp_baseline_pack_slime(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const double *key,
                                 bool first_fit, int32_t fixed_M, rp_plan **out, rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_trainer *tr = rp_config_trainer(cfg);
    const int32_t G = t->num_gpus, n = rp_batch_num_seqs(batch), K = tr->mini_batches,
                  N = tr->microbatch_multiple;
    const int64_t cap = rp_limits_token_cap(rp_config_limits(cfg));
    if (tr->equal_sequences_per_rank)
        return rp_fail(err, RP_EINVAL,
                       "baseline: slime's packings deal microbatches, not sequences, to the DP ranks, so ranks run "
                       "different sequence counts; trainer.equal_sequences_per_rank (verl's DataProto.chunk) "
                       "rules it out: turn the key off or use token_kk, verl_kk or attn_kk");
    if (fixed_M > 0 && fixed_M % (K * N) != 0)
        return rp_fail(err, RP_EINVAL,
                       "baseline: %d microbatches is not a multiple of %d (trainer.mini_batches %d x "
                       "trainer.microbatch_multiple %d)", fixed_M, K * N, K, N);
    rp_status st = rp_limits_check_batch(rp_config_limits(cfg), batch, err);
    if (st != RP_OK) return st;
    /* slime's alignment: every rank the same count, a multiple of microbatch_multiple */
    const int64_t align = (int64_t)G * N;
    size_t nz = (size_t)n + 1;
    int32_t *bin = rp_alloc(ctx, 2 * nz * sizeof *bin), *order = rp_alloc(ctx, 2 * nz * sizeof *order);
    int32_t *nbins = rp_alloc(ctx, (size_t)K * sizeof *nbins);
    int32_t *cell_rank = rp_alloc(ctx, nz * sizeof *cell_rank), *cell_mb = rp_alloc(ctx, nz * sizeof *cell_mb);
    double *scratch = rp_alloc(ctx, 2 * nz * sizeof *scratch);
    double *weight = NULL;
    int32_t *rank_of = NULL, *slot = NULL, *members = NULL;
    rp_plan *plan = NULL;
    if (!bin || !order || !nbins || !cell_rank || !cell_mb || !scratch) goto nomem;
    int32_t *bin0 = bin + nz; /* the mini-batches' bins before splitting */

    /* 1. each mini-batch (slime's global_batch_size of consecutive rollouts) into bins */
    for (int32_t b = 0; b < K; b++) {
        int32_t lo = (int32_t)((int64_t)b * n / K), m = (int32_t)((int64_t)(b + 1) * n / K) - lo;
        nbins[b] = m < 1 ? 0 : slime_bins(ctx, batch, key, first_fit, false, cap, lo, m, scratch, bin0 + lo, err);
        if (nbins[b] < 0) {
            st = err->status;
            goto out;
        }
    }
    /* 2. align: the count of the mini-batch that needs the most (slime aligns each on its
     * own; a plan runs one count in every mini-batch), reached by splitting. A
     * mini-batch whose split bins break the cap is packed again with the repair, and
     * the alignment starts over (at most once per mini-batch: repaired bins fit, and
     * splitting a bin never makes one heavier). */
    int32_t T;
    for (;;) {
        int64_t target = align;
        for (int32_t b = 0; b < K; b++) {
            int64_t aligned = (nbins[b] + align - 1) / align * align;
            if (aligned > target) target = aligned;
        }
        if (fixed_M > 0) {
            const int64_t fixed = (int64_t)(fixed_M / K) * G;
            for (int32_t b = 0; b < K; b++)
                if (nbins[b] > fixed) {
                    st = rp_fail(err, RP_ERANGE,
                                 "baseline: slime's packing needs %d microbatches for mini-batch %d within the cap of "
                                 "%lld tokens, more than the %d ranks x %d fixed microbatches",
                                 nbins[b], b, (long long)cap, G, fixed_M / K);
                    goto out;
                }
            target = fixed;
        }
        if (target * K > INT32_MAX) {
            st = rp_fail(err, RP_ERANGE, "baseline: %d mini-batches of %lld microbatches overflow", K,
                         (long long)target);
            goto out;
        }
        T = (int32_t)target;
        rp_free(ctx, weight);
        rp_free(ctx, members);
        weight = rp_alloc(ctx, (size_t)T * sizeof *weight);
        members = rp_alloc(ctx, (size_t)T * sizeof *members);
        if (!weight || !members) goto nomem;
        bool again = false;
        for (int32_t b = 0; b < K && !again; b++) {
            int32_t lo = (int32_t)((int64_t)b * n / K), m = (int32_t)((int64_t)(b + 1) * n / K) - lo;
            if (m < 1) continue;
            memcpy(bin + lo, bin0 + lo, (size_t)m * sizeof *bin);
            /* weight[] is then each bin's tokens */
            if (slime_split(ctx, batch, lo, m, nbins[b], T, bin + lo, weight, members, scratch, order, err) < 0) {
                st = err->status;
                goto out;
            }
            bool over = false;
            for (int32_t j = 0; j < T; j++) over |= weight[j] > (double)cap;
            if (!over) continue;
            nbins[b] = slime_bins(ctx, batch, key, first_fit, true, cap, lo, m, scratch, bin0 + lo, err);
            if (nbins[b] < 0) {
                st = err->status;
                goto out;
            }
            again = true;
        }
        if (!again) break;
    }
    const int32_t Mk = T / G, M = Mk * K;

    /* 3. deal each mini-batch's bins to the ranks: Karmarkar-Karp with equal counts on
     * the bins' workloads, a rank running its bins in ascending order. Bins that stay
     * empty (fewer sequences than bins) weigh 0. */
    rank_of = rp_alloc(ctx, 2 * (size_t)T * sizeof *rank_of);
    slot = rp_alloc(ctx, (size_t)G * sizeof *slot);
    if (!rank_of || !slot) goto nomem;
    int32_t *mb_of = rank_of + T; /* bin -> microbatch of its rank */
    for (int32_t b = 0; b < K && st == RP_OK; b++) {
        int32_t lo = (int32_t)((int64_t)b * n / K), m = (int32_t)((int64_t)(b + 1) * n / K) - lo;
        for (int32_t j = 0; j < T; j++) weight[j] = 0;
        for (int32_t j = 0; j < m; j++) weight[bin[lo + j]] += key[lo + j];
        if ((st = rp_partition_kk(ctx, weight, T, G, true, NULL, rank_of, err)) != RP_OK) break;
        for (int32_t g = 0; g < G; g++) slot[g] = b * Mk;
        for (int32_t j = 0; j < T; j++) mb_of[j] = slot[rank_of[j]]++;
        for (int32_t j = 0; j < m; j++) {
            cell_rank[lo + j] = rank_of[bin[lo + j]];
            cell_mb[lo + j] = mb_of[bin[lo + j]];
        }
    }
    if (st != RP_OK) goto out;
    if (tr->nonempty_microbatches &&
        (st = rp_fill_empty_cells(ctx, batch, G, M, K, cell_rank, cell_mb, false, "baseline", err)) != RP_OK)
        goto out;

    /* inside a microbatch ascending id (slime's order differs for split bins; it does not
     * change what the microbatch costs) */
    if ((st = rp_plan_new(ctx, cfg, M, &plan, err)) == RP_OK &&
        (st = rp_plan_set_packing(plan, n, cell_rank, cell_mb, err)) == RP_OK) {
        *out = plan;
        plan = NULL;
    }
    goto out;
nomem:
    st = rp_fail_nomem(err, "a slime packing");
out:
    rp_plan_free(plan);
    rp_free(ctx, bin);
    rp_free(ctx, order);
    rp_free(ctx, nbins);
    rp_free(ctx, cell_rank);
    rp_free(ctx, cell_mb);
    rp_free(ctx, scratch);
    rp_free(ctx, weight);
    rp_free(ctx, rank_of);
    rp_free(ctx, slot);
    rp_free(ctx, members);
    return st;
}
