/* Joint packing in the group form (execution.sync group, several EP groups): EP groups
 * meet only at the end of the step, so the step is the slowest group's own sum over
 * microbatches and the packing balances each group's sum, not every microbatch over
 * all groups (docs/routepack-policy.md, "The configured structure"). */
#include "joint_internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

/* The surrogate of one (microbatch, EP group), step seconds: the dense work of its
 * slowest GPU at every layer (`a`, with the fixed cost), the expert work of its tokens
 * spread over its ranks (`T`), and dispatch and combine of its busiest sender (`t`
 * tokens; what a rank receives, T / ep tokens' choices, is never more); with per-layer
 * overlap the longer of compute and communication. */
typedef struct group_units {
    double L, fixed, gx, px, alpha;
    bool overlap;
} group_units;

/* Under the balancer's equal-token padding (jt->vexp_pad) every rank of the group runs
 * its fullest cell's tokens: the expert work is px t (gx 0) instead of gx T. */
static inline double group_value(const group_units *u, double a, double t, double T)
{
    double compute = u->L * a + u->fixed + u->gx * T + u->px * t, comm = u->alpha * t;
    if (u->overlap) return compute > comm ? compute : comm;
    return compute + comm;
}

/* Greedy, longest sequence first, as joint_pack; a cell's key is (the largest group sum
 * after the placement, the raise of its own group's sum, the emptiest cell relative to
 * the mean cell), then the lower microbatch and GPU. The first key spreads the long
 * sequences over the groups (a group at the top takes nothing while another has room);
 * the second fills under the levels the long ones set inside a group. */
rp_status joint_pack_group(joint *jt, int32_t M, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const int32_t N = jt->N, G = jt->G, Q = jt->Q, ep = jt->ep;
    const int64_t cells = (int64_t)G * M, mq = (int64_t)M * Q;
    const double L = jt->L, K = jt->K;
    const group_units u = {.L = L, .fixed = L * jt->fixed_s, .gx = jt->vexp_pad ? 0.0 : L * K * jt->t_choice / ep,
                           .px = jt->vexp_pad ? L * K * jt->t_choice : 0.0,
                           .alpha = 2.0 * L * K * jt->d_choice, .overlap = jt->overlap};
    const double rho = jt->par->prompt_spread;
    rp_status st = RP_OK;

    joint_pack_prep p;
    double *A = rp_calloc(ctx, (size_t)cells, sizeof *A); /* raw sum of the dense work, speed 1 */
    int64_t *tok = rp_calloc(ctx, (size_t)cells, sizeof *tok);
    /* per (microbatch, group): tokens, the largest dense work (per speed) and tokens of a
     * cell, the least of each (a bound of what its cells can offer), the current value */
    int64_t *TQ = rp_calloc(ctx, (size_t)mq, sizeof *TQ);
    double *amax = rp_calloc(ctx, (size_t)mq, sizeof *amax), *amin = rp_calloc(ctx, (size_t)mq, sizeof *amin);
    int64_t *tmax = rp_calloc(ctx, (size_t)mq, sizeof *tmax), *tmin = rp_calloc(ctx, (size_t)mq, sizeof *tmin);
    double *val = rp_calloc(ctx, (size_t)mq, sizeof *val);
    /* each group's sum per mini-batch, penalties included: every optimizer step waits for
     * the slowest group, so the step is the sum over mini-batches of their largest */
    const int32_t KB = rp_config_trainer(jt->cfg)->mini_batches, Mk = M / KB;
    double *phi = rp_calloc(ctx, (size_t)KB * Q, sizeof *phi);  /* [KB * Q] */
    double *phimax = rp_calloc(ctx, (size_t)KB, sizeof *phimax); /* [KB] */
    RP_CHECK_GOTO(joint_pack_prepare(jt, M, &p, err), st, out);
    if (!A || !tok || !TQ || !amax || !amin || !tmax || !tmin || !val || !phi || !phimax) {
        st = rp_fail_nomem(err, "joint packing");
        goto out;
    }
    const double *len = p.len, *attn = p.attn, a_ref = p.a_ref, t_ref = p.t_ref;
    const int32_t *order = p.order, *prompt = p.prompt;
    int32_t *pcount = p.pcount;
    for (int64_t i = 0; i < mq; i++) val[i] = group_value(&u, 0, 0, 0);
    for (int32_t q = 0; q < KB * Q; q++) phi[q] = Mk * group_value(&u, 0, 0, 0);

    for (int32_t i = 0; i < N; i++) {
        const int32_t s = order[i];
        const double a = attn[s];
        const int64_t ni = (int64_t)len[s];
        const int32_t *pc = pcount && prompt[s] >= 0 ? pcount + (size_t)prompt[s] * mq : NULL;
        const double pen_unit = rho * u.gx * len[s];
        for (int32_t b = 0; b < KB; b++) {
            phimax[b] = 0;
            for (int32_t q = 0; q < Q; q++) phimax[b] = phi[(size_t)b * Q + q] > phimax[b] ? phi[(size_t)b * Q + q] : phimax[b];
        }
        double best_top = INFINITY, best_inc = INFINITY, best_tie = INFINITY;
        int32_t bg = -1, bm = -1;
        /* under the pipeline packing's limits, a cell beyond them takes nothing while any
         * cell within them is open (the second pass, without them, when none is) */
        for (int32_t pass = jt->pack_budget > 0 || jt->pack_cell_quota > 0 ? 0 : 1; pass < 2 && bg < 0; pass++)
        for (int32_t m = 0; m < M; m++)
            for (int32_t q = 0; q < Q; q++) {
                const size_t k = (size_t)m * Q + q;
                const double pen = pc ? pen_unit * pc[k] : 0.0;
                /* the candidate's mini-batch: its largest group sum is what the step pays;
                 * with several, the key is how much that largest rises */
                const int32_t b = m / Mk;
                const double top0 = phimax[b], base = KB == 1 ? 0.0 : top0, phi_q = phi[(size_t)b * Q + q];
                /* the value is monotone in each argument: a bound for every GPU of the group */
                {
                    double a_lb = amin[k] + a / jt->speed_max;
                    int64_t t_lb = tmin[k] + ni;
                    double inc_lb = group_value(&u, a_lb > amax[k] ? a_lb : amax[k],
                                                (double)(t_lb > tmax[k] ? t_lb : tmax[k]), (double)(TQ[k] + ni)) -
                                    val[k] + pen;
                    double top_lb = (phi_q + inc_lb > top0 ? phi_q + inc_lb : top0) - base;
                    if (top_lb > best_top || (top_lb == best_top && inc_lb > best_inc)) continue;
                }
                for (int32_t g = q * ep; g < (q + 1) * ep; g++) {
                    const size_t c = (size_t)g * M + m;
                    const int64_t t1 = tok[c] + ni;
                    if (t1 > jt->cap || !joint_pack_open(&p, (size_t)g * p.KB + (size_t)b, c, N - i)) continue; /* cap, quota, nonempty */
                    if (pass == 0 && !joint_pack_within(jt, &p, c, TQ[k], ni)) continue;
                    const double a1 = joint_per_speed(jt, A[c] + a, q, g - q * ep);
                    const double inc = group_value(&u, a1 > amax[k] ? a1 : amax[k],
                                                   (double)(t1 > tmax[k] ? t1 : tmax[k]), (double)(TQ[k] + ni)) -
                                       val[k] + pen;
                    const double top = (phi_q + inc > top0 ? phi_q + inc : top0) - base;
                    /* the tie-break (two divisions) only for a candidate the first keys do
                     * not already decide: most lose on them */
                    if (top > best_top || (top == best_top && inc > best_inc)) continue;
                    const double tie = a1 / a_ref + (double)t1 / t_ref;
                    if (top == best_top && inc == best_inc && !(tie < best_tie)) continue;
                    best_top = top;
                    best_inc = inc;
                    best_tie = tie;
                    bg = g;
                    bm = m;
                }
            }
        if (bg < 0) {
            st = joint_pack_nofit(jt, &p, s, M, err);
            goto out;
        }
        const size_t c = (size_t)bg * M + bm;
        const int32_t q = bg / ep;
        const size_t k = (size_t)bm * Q + q;
        A[c] += a;
        tok[c] += ni;
        joint_pack_placed(&p, bg, c);
        TQ[k] += ni;
        const double a1 = A[c] / jt->speed[bg];
        if (a1 > amax[k]) amax[k] = a1;
        if (tok[c] > tmax[k]) tmax[k] = tok[c];
        amin[k] = INFINITY;
        tmin[k] = INT64_MAX;
        for (int32_t g = q * ep; g < (q + 1) * ep; g++) {
            double ag = A[(size_t)g * M + bm] / jt->speed[g];
            amin[k] = ag < amin[k] ? ag : amin[k];
            tmin[k] = tok[(size_t)g * M + bm] < tmin[k] ? tok[(size_t)g * M + bm] : tmin[k];
        }
        phi[(size_t)(bm / Mk) * Q + q] += best_inc;
        val[k] = group_value(&u, amax[k], (double)tmax[k], (double)TQ[k]);
        if (pcount && prompt[s] >= 0) pcount[(size_t)prompt[s] * mq + k]++;
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
    rp_free(ctx, amin);
    rp_free(ctx, tmax);
    rp_free(ctx, tmin);
    rp_free(ctx, val);
    rp_free(ctx, phi);
    rp_free(ctx, phimax);
    return st;
}
