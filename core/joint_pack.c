/* Joint packing: sequences into (rank, microbatch) cells so that, inside every
 * microbatch, attention and tokens are balanced over the GPUs and tokens over the EP
 * groups, the longest sequences share microbatches, and the responses of one prompt
 * are spread over EP groups (docs/routepack-policy.md, "Packing"). */
#include "joint_internal.h"
#include "nonempty_internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

/* Cells are filled greedily, longest sequence first, each into the cell that raises the
 * surrogate step time least:
 *
 *   Phi = sum_m [ L max_g A(g, m) + alpha max_g tok(g, m) + gamma max_q Tok(m, q) ]
 *
 * (step seconds: the dense work of every layer; dispatch and combine of the tokens a GPU
 * sends; the expert work and receive volume of an EP group's tokens, spread over its
 * ranks; under the balancer's padding the expert work is in alpha's term instead: every
 * rank of a group runs its fullest cell's tokens), plus the prompt-spreading penalty. Among equal raises the emptiest cell
 * relative to the mean cell wins (then the lower microbatch and GPU). The first
 * sequences each set a microbatch's level; shorter ones fill under the levels at no
 * raise, so the long sequences end up together and every microbatch balanced. Under
 * trainer.equal_sequences_per_rank a rank holding N / G sequences takes no more. */
rp_status joint_pack(joint *jt, int32_t M, rp_error *err)
{
    if (jt->group_form) return joint_pack_group(jt, M, err); /* joint_pack_group.c */
    rp_context *ctx = jt->ctx;
    const int32_t N = jt->N, G = jt->G, Q = jt->Q, ep = jt->ep;
    const int64_t cells = (int64_t)G * M;
    const double L = jt->L, K = jt->K;
    /* under the balancer's equal-token padding (jt->vexp_pad) the expert work of a
     * microbatch is its fullest cell's tokens on every rank: it moves from the group
     * term to the cell term, ep times the group's per-token unit */
    const double gamma_x = L * K * jt->t_choice / ep;
    const double alpha = 2.0 * L * K * jt->d_choice + (jt->vexp_pad ? gamma_x * ep : 0.0);
    const double gamma = (jt->vexp_pad ? 0.0 : gamma_x) + 2.0 * L * K * jt->d_choice / ep;
    const double rho = jt->par->prompt_spread;
    rp_status st = RP_OK;

    joint_pack_prep p;
    double *A = rp_calloc(ctx, (size_t)cells, sizeof *A);       /* raw sum of a(L), speed 1 */
    int64_t *tok = rp_calloc(ctx, (size_t)cells, sizeof *tok);
    int64_t *TQ = rp_calloc(ctx, (size_t)M * Q, sizeof *TQ);
    double *amax = rp_calloc(ctx, (size_t)M, sizeof *amax);
    int64_t *tmax = rp_calloc(ctx, (size_t)M, sizeof *tmax), *tqmax = rp_calloc(ctx, (size_t)M, sizeof *tqmax);
    /* per microbatch: the least attention (per speed), tokens and group tokens of any
     * cell, for a lower bound of what the microbatch can offer a sequence */
    double *amin = rp_calloc(ctx, (size_t)M, sizeof *amin);
    int64_t *tmin = rp_calloc(ctx, (size_t)M, sizeof *tmin), *tqmin = rp_calloc(ctx, (size_t)M, sizeof *tqmin);
    /* the same per (microbatch, group), to skip a group's GPUs */
    double *gamin = rp_calloc(ctx, (size_t)M * Q, sizeof *gamin);
    int64_t *gtmin = rp_calloc(ctx, (size_t)M * Q, sizeof *gtmin);
    RP_CHECK_GOTO(joint_pack_prepare(jt, M, &p, err), st, out);
    if (!A || !tok || !TQ || !amax || !tmax || !tqmax || !amin || !tmin || !tqmin || !gamin || !gtmin) {
        st = rp_fail_nomem(err, "joint packing");
        goto out;
    }
    const double *len = p.len, *attn = p.attn, a_ref = p.a_ref, t_ref = p.t_ref;
    const int32_t *order = p.order, *prompt = p.prompt;
    int32_t *pcount = p.pcount;

    for (int32_t i = 0; i < N; i++) {
        const int32_t s = order[i];
        const double a = attn[s], n = len[s];
        const int64_t ni = (int64_t)n;
        const int32_t *pc = pcount && prompt[s] >= 0 ? pcount + (size_t)prompt[s] * M * Q : NULL;
        const double pen_unit = rho * gamma_x * n;
        double best_inc = INFINITY, best_tie = INFINITY;
        int32_t bg = -1, bm = -1;
        /* under the pipeline packing's limits, a cell beyond them takes nothing while any
         * cell within them is open (the second pass, without them, when none is) */
        for (int32_t pass = jt->pack_budget > 0 || jt->pack_cell_quota > 0 ? 0 : 1; pass < 2 && bg < 0; pass++)
        for (int32_t m = 0; m < M; m++) {
            const double am = amax[m];
            const size_t mu = (size_t)m / (size_t)p.Mk; /* the microbatch's mini-batch */
            const int64_t tm = tmax[m], tqm = tqmax[m];
            /* nothing in this microbatch can beat the best so far: skip it */
            double lb = (tqmin[m] + ni > tqm ? gamma * (double)(tqmin[m] + ni - tqm) : 0.0) +
                        (amin[m] + a / jt->speed_max > am ? L * (amin[m] + a / jt->speed_max - am) : 0.0) +
                        (tmin[m] + ni > tm ? alpha * (double)(tmin[m] + ni - tm) : 0.0);
            if (lb > best_inc) continue;
            if (lb == best_inc && amin[m] / a_ref + a / jt->speed_max / a_ref + (double)(tmin[m] + ni) / t_ref >= best_tie)
                continue;
            for (int32_t q = 0; q < Q; q++) {
                const int64_t tq = TQ[(size_t)m * Q + q] + ni;
                double inc_q = tq > tqm ? gamma * (double)(tq - tqm) : 0.0;
                if (pc) inc_q += pen_unit * pc[(size_t)m * Q + q];
                if (inc_q > best_inc) continue; /* every GPU of the group raises at least this */
                {
                    const double ga = gamin[(size_t)m * Q + q] + a / jt->speed_max;
                    const int64_t gt = gtmin[(size_t)m * Q + q] + ni;
                    double lb_q = inc_q + (ga > am ? L * (ga - am) : 0.0) + (gt > tm ? alpha * (double)(gt - tm) : 0.0);
                    if (lb_q > best_inc || (lb_q == best_inc && ga / a_ref + (double)gt / t_ref >= best_tie)) continue;
                }
                for (int32_t g = q * ep; g < (q + 1) * ep; g++) {
                    const size_t c = (size_t)g * M + m;
                    const int64_t t1 = tok[c] + ni;
                    if (t1 > jt->cap || !joint_pack_open(&p, (size_t)g * p.KB + mu, c, N - i)) continue; /* cap, quota, nonempty */
                    if (pass == 0 && !joint_pack_within(jt, &p, c, tq - ni, ni)) continue;
                    const double a1 = (A[c] + a) / jt->speed[g];
                    double inc = inc_q;
                    if (a1 > am) inc += L * (a1 - am);
                    if (t1 > tm) inc += alpha * (double)(t1 - tm);
                    if (inc > best_inc) continue;
                    const double tie = a1 / a_ref + (double)t1 / t_ref;
                    if (inc < best_inc || tie < best_tie) {
                        best_inc = inc;
                        best_tie = tie;
                        bg = g;
                        bm = m;
                    }
                }
            }
        }
        if (bg < 0) {
            st = joint_pack_nofit(jt, &p, s, M, err);
            goto out;
        }
        const size_t c = (size_t)bg * M + bm;
        const int32_t q = bg / ep;
        A[c] += a;
        tok[c] += ni;
        joint_pack_placed(&p, bg, c);
        TQ[(size_t)bm * Q + q] += ni;
        const double a1 = A[c] / jt->speed[bg];
        if (a1 > amax[bm]) amax[bm] = a1;
        if (tok[c] > tmax[bm]) tmax[bm] = tok[c];
        if (TQ[(size_t)bm * Q + q] > tqmax[bm]) tqmax[bm] = TQ[(size_t)bm * Q + q];
        if (pcount && prompt[s] >= 0) pcount[(size_t)prompt[s] * M * Q + (size_t)bm * Q + q]++;
        gamin[(size_t)bm * Q + q] = INFINITY;
        gtmin[(size_t)bm * Q + q] = INT64_MAX;
        for (int32_t g = q * ep; g < (q + 1) * ep; g++) {
            double ag = A[(size_t)g * M + bm] / jt->speed[g];
            gamin[(size_t)bm * Q + q] = ag < gamin[(size_t)bm * Q + q] ? ag : gamin[(size_t)bm * Q + q];
            gtmin[(size_t)bm * Q + q] = tok[(size_t)g * M + bm] < gtmin[(size_t)bm * Q + q] ? tok[(size_t)g * M + bm]
                                                                                            : gtmin[(size_t)bm * Q + q];
        }
        amin[bm] = INFINITY;
        tmin[bm] = tqmin[bm] = INT64_MAX;
        for (int32_t g = 0; g < G; g++) {
            double ag = A[(size_t)g * M + bm] / jt->speed[g];
            amin[bm] = ag < amin[bm] ? ag : amin[bm];
            tmin[bm] = tok[(size_t)g * M + bm] < tmin[bm] ? tok[(size_t)g * M + bm] : tmin[bm];
        }
        for (int32_t k = 0; k < Q; k++) tqmin[bm] = TQ[(size_t)bm * Q + k] < tqmin[bm] ? TQ[(size_t)bm * Q + k] : tqmin[bm];
        jt->seq_gpu[s] = bg;
        jt->seq_mb[s] = bm;
    }
    jt->M = M;
out:
    joint_pack_prep_free(jt, &p);
    rp_free(ctx, A);
    rp_free(ctx, tok);
    rp_free(ctx, TQ);
    rp_free(ctx, amax);
    rp_free(ctx, tmax);
    rp_free(ctx, tqmax);
    rp_free(ctx, amin);
    rp_free(ctx, tmin);
    rp_free(ctx, tqmin);
    rp_free(ctx, gamin);
    rp_free(ctx, gtmin);
    return st;
}
