/* What both joint packers (joint_pack.c, joint_pack_group.c) need before their greedy
 * fill: the prompts' dense ids, the sequences' lengths, attention and order, the quotas
 * and counters (joint_internal.h, joint_pack_prep), and the message for a sequence that
 * fits nowhere. Calls none of the packers. */
#include "joint_internal.h"
#include "nonempty_internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

/* Dense ids of the prompts that have several sequences (-1 for a sequence alone in its
 * group, which needs no spreading), via a stable sort of the group ids. */
rp_status joint_prompt_ids(const joint *jt, int32_t *prompt, int32_t *num_prompts, rp_error *err)
{
    const int32_t N = jt->N;
    const int32_t *gid = rp_batch_group_ids(jt->batch);
    double *key = rp_alloc(jt->ctx, (size_t)N * sizeof *key);
    int32_t *order = rp_alloc(jt->ctx, (size_t)N * sizeof *order);
    rp_status st = RP_OK;
    *num_prompts = 0;
    if (!key || !order) {
        st = rp_fail_nomem(err, "joint packing: prompt ids");
        goto out;
    }
    for (int32_t s = 0; s < N; s++) key[s] = gid ? (double)gid[s] : (double)s;
    RP_CHECK_GOTO(rp_sort_index(jt->ctx, key, N, false, order, err), st, out);
    for (int32_t i = 0; i < N;) {
        int32_t k = i;
        while (k < N && key[order[k]] == key[order[i]]) k++;
        int32_t id = k - i > 1 ? (*num_prompts)++ : -1;
        for (; i < k; i++) prompt[order[i]] = id;
    }
out:
    rp_free(jt->ctx, key);
    rp_free(jt->ctx, order);
    return st;
}

/* What both packers need before the greedy fill (joint_internal.h). */
rp_status joint_pack_prepare(joint *jt, int32_t M, joint_pack_prep *p, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const int32_t N = jt->N, G = jt->G;
    const int64_t cells = (int64_t)G * M, mq = (int64_t)M * jt->Q;
    memset(p, 0, sizeof *p);
    p->len = rp_alloc(ctx, (size_t)N * sizeof *p->len);
    p->attn = rp_alloc(ctx, (size_t)N * sizeof *p->attn);
    p->order = rp_alloc(ctx, (size_t)N * sizeof *p->order);
    p->prompt = rp_alloc(ctx, (size_t)N * sizeof *p->prompt);
    /* quotas and empty cells per (rank, mini-batch): verl splits a rank's chunk into
     * trainer.mini_batches mini-batches by count */
    p->M = M;
    p->KB = rp_config_trainer(jt->cfg)->mini_batches;
    p->Mk = M / p->KB;
    p->rank_count = rp_calloc(ctx, (size_t)G * p->KB, sizeof *p->rank_count);
    /* trainer.equal_sequences_per_rank: a rank takes N / G sequences, then no more */
    p->rank_quota = rp_config_trainer(jt->cfg)->equal_sequences_per_rank ? N / G / p->KB : INT32_MAX;
    if (!p->len || !p->attn || !p->order || !p->prompt || !p->rank_count)
        return rp_fail_nomem(err, "joint packing");
    if (jt->pack_cell_quota > 0 && !(p->cell_seqs = rp_calloc(ctx, (size_t)cells, sizeof *p->cell_seqs)))
        return rp_fail_nomem(err, "joint packing: sequences per cell");
    if (rp_config_trainer(jt->cfg)->nonempty_microbatches) {
        rp_status st = rp_nonempty_check_counts(N, G, M, "joint", err);
        if (st != RP_OK) return st;
        p->cell_count = rp_calloc(ctx, (size_t)cells, sizeof *p->cell_count);
        p->empty_rank = rp_alloc(ctx, (size_t)G * p->KB * sizeof *p->empty_rank);
        if (!p->cell_count || !p->empty_rank) return rp_fail_nomem(err, "joint packing: cell counts");
        /* with quotas, N >= G M (checked above) gives every (rank, mini-batch) N / G / KB >= Mk */
        for (int32_t u = 0; u < G * p->KB; u++) p->empty_rank[u] = p->Mk;
        p->empty = cells;
    }
    double sum_a = 0, sum_len = 0, speed_sum = 0;
    for (int32_t s = 0; s < N; s++) {
        int64_t n = rp_batch_seq_len(jt->batch, s);
        if (n > jt->cap)
            return rp_fail_seq(err, RP_ERANGE, s, "joint: sequence %d has %lld tokens, longer than the microbatch cap of %lld",
                               s, (long long)n, (long long)jt->cap);
        p->len[s] = (double)n;
        p->attn[s] = rp_cost_dense_s(jt->cost, n);
        sum_a += p->attn[s];
        sum_len += p->len[s];
    }
    for (int32_t g = 0; g < G; g++) speed_sum += jt->speed[g];
    p->a_ref = sum_a > 0 ? sum_a / speed_sum / M : 1.0;
    p->t_ref = sum_len > 0 ? sum_len / (double)cells : 1.0;
    rp_status st = rp_sort_index(ctx, p->len, N, true, p->order, err);
    if (st != RP_OK) return st;
    if (jt->par->prompt_spread > 0) {
        int32_t P = 0;
        if ((st = joint_prompt_ids(jt, p->prompt, &P, err)) != RP_OK) return st;
        int64_t n_count;
        /* a penalty table larger than this is not worth its memory: spreading is off */
        if (P > 0 && !rp_mul_overflow((int64_t)P, mq, &n_count) && n_count <= ((int64_t)1 << 24)) {
            p->pcount = rp_calloc(ctx, (size_t)n_count, sizeof *p->pcount);
            if (!p->pcount) return rp_fail_nomem(err, "joint packing: prompt counts");
        }
    }
    return RP_OK;
}

void joint_pack_prep_free(const joint *jt, joint_pack_prep *p)
{
    rp_free(jt->ctx, p->len);
    rp_free(jt->ctx, p->attn);
    rp_free(jt->ctx, p->order);
    rp_free(jt->ctx, p->prompt);
    rp_free(jt->ctx, p->pcount);
    rp_free(jt->ctx, p->rank_count);
    rp_free(jt->ctx, p->cell_count);
    rp_free(jt->ctx, p->empty_rank);
    rp_free(jt->ctx, p->cell_seqs);
    memset(p, 0, sizeof *p);
}

rp_status joint_pack_nofit(const joint *jt, const joint_pack_prep *p, int32_t s, int32_t M, rp_error *err)
{
    return rp_fail_seq(err, RP_ERANGE, s,
                       "joint: sequence %d (%lld tokens) fits in no cell of %d microbatches under the cap of %lld "
                       "tokens%s",
                       s, (long long)p->len[s], M, (long long)jt->cap,
                       p->rank_quota == INT32_MAX ? ""
                       : p->KB == 1 ? " on a rank below its quota (trainer.equal_sequences_per_rank)"
                                    : " on a rank's mini-batch below its quota (trainer.equal_sequences_per_rank, "
                                      "trainer.mini_batches)");
}
