/* Per-microbatch levers of the joint plan: explicit token shares among an expert's
 * replicas (free: decided at dispatch time) and extra replicas copied over NVLink for
 * one (microbatch, layer), each added only where the surrogate saving exceeds its copy
 * time (docs/routepack-policy.md, "Shares and extra replicas"). */
#include "joint_internal.h"
#include "memory_internal.h"

#include <math.h>
#include <string.h>

/* Expert slot time t(n) (forward, speed 1) from the cost model: a table of its values
 * at integer loads up to the efficiency curve's last point, linear in between, and the
 * curve's flat tail beyond; never below the weight-read floor. */
double joint_slot_time(const joint *jt, double n)
{
    if (!(n > 0)) return 0.0;
    double t;
    if (n < jt->t_table_n) {
        int32_t i = (int32_t)n;
        double f = n - i;
        t = jt->t_table[i] + (jt->t_table[i + 1] - jt->t_table[i]) * f;
    } else {
        t = n * jt->t_slope;
    }
    return t > jt->t_mem ? t : jt->t_mem;
}

/* The replicas of every expert at one (mb, layer): base replicas in ascending EP rank,
 * then extra ones in the order added, with their shares. Loads are token-choices per
 * unit of GPU speed (linear: at the loads where balance matters the grouped GEMM runs
 * at its full efficiency); the exact slot times decide at the end whether the levers
 * of this (mb, layer) are kept. */
typedef struct lever_state {
    int32_t *cnt;          /* [E] replicas */
    int32_t *base;         /* [E] of which base (the rest are extras) */
    int32_t *rank;         /* [E * ep] */
    double *w;             /* [E * ep] shares */
    bool *explicit_shares; /* [E] */
    double *U;             /* [Q * ep] token-choices / speed */
    double *tq;            /* [Q] one expert's token-choices per group */
    double *inv_tq;        /* [Q] minmax_fill at unit speed: 1 / tq (0 where tq is 0) */
    double *base_load;     /* [Q * (ep + 1)] trial: loads without the expert */
    double *wt, *best_w;   /* [ep + 1] trial shares */
    int32_t *rk;           /* [ep + 1] trial ranks */
    double *rank_u;        /* [ep] largest U over groups */
    unsigned char *touched; /* [ep] trial_max: ranks a trial changes */
    int32_t *extra_count;  /* [ep] */
    int32_t *extra_e, *extra_r;
    int32_t n_extra;
    double extra_price;    /* step seconds of this (mb, layer)'s extras: the largest of
                              rank_price (extras_once) */
    double *rank_price;    /* [ep] each rank's fetches and gradient messages for them */
    int32_t *reps;         /* [E] replicated experts, heaviest first */
    double *rtot;          /* [E] */
    double *fill_a, *fill_c; /* [(ep + 1) * Q] minmax_fill's lines */
    /* Memory (docs/cost-model.md, "Memory per GPU"): a GPU keeps every extra replica of
     * the step, once per (layer, expert), so each EP rank may take only as many new ones
     * as its free memory holds. */
    int64_t *room;         /* [ep] extra replicas that still fit */
    int32_t *fresh;        /* [ep] extras of this (mb, layer) not held in an earlier one */
    unsigned char *held;   /* bit (l E + e) ep + j: rank j holds e at layer l this step;
                              NULL when too large: every extra counts as new */
} lever_state;

static bool held_extra(const joint *jt, const lever_state *ls, int32_t l, int32_t e, int32_t j)
{
    if (!ls->held) return false;
    size_t bit = ((size_t)l * jt->E + e) * jt->ep + j;
    return ls->held[bit >> 3] & (1u << (bit & 7));
}

static inline double gspeed(const joint *jt, int32_t q, int32_t j) { return jt->speed[q * jt->ep + j]; }

/* Step seconds an extra replica of expert e on EP rank j at (m, l) adds, under an executor
 * that fetches a step's extras once (routepack_torch, docs/cost-model.md "Extra replicas"):
 * nothing when an earlier microbatch of the step put it there already; else rank j pays
 * its fetch from the expert's first replica (NVLink in a node, the network across: the
 * most it can cost, fetched ahead it is mostly hidden) and its gradient's exchange with
 * every holder, and each holder one gradient message to j; ranks pay at once, so the price
 * is what the busiest rank's sum (ls->rank_price) grows by. `commit`: add the charges.
 * A microbatch m weighs it over the M - m microbatches from it on: the step's buffer keeps
 * the extra for them, and an expert hot now mostly stays hot (the later ones then hold
 * it for free). */
static double extra_price_once(const joint *jt, lever_state *ls, int32_t l, int32_t e, int32_t j, bool commit)
{
    if (held_extra(jt, ls, l, e, j)) return 0.0;
    const int32_t *rk = ls->rank + (size_t)e * jt->ep;
    const int32_t node = jt->node_of_rank[j];
    double mine = jt->node_of_rank[rk[0]] == node ? jt->copy_s + jt->nv_lat : jt->copy_net_s + jt->net_lat;
    double most = ls->extra_price, after = most;
    for (int32_t i = 0; i < ls->cnt[e]; i++) {
        double g = jt->node_of_rank[rk[i]] == node ? jt->grad_nv_s : jt->grad_net_s;
        mine += g;
        double theirs = ls->rank_price[rk[i]] + g;
        if (theirs > after) after = theirs;
        if (commit) ls->rank_price[rk[i]] = theirs;
    }
    if (ls->rank_price[j] + mine > after) after = ls->rank_price[j] + mine;
    if (commit) {
        ls->rank_price[j] += mine;
        ls->extra_price = after;
    }
    return after - most;
}

/* Add (sign +1) or remove (-1) expert e's load at (m, l) to U. */
static void contribute(const joint *jt, lever_state *ls, int32_t m, int32_t l, int32_t e, double sign)
{
    const int32_t ep = jt->ep;
    const int32_t *rk = ls->rank + (size_t)e * ep;
    const double *w = ls->w + (size_t)e * ep;
    for (int32_t q = 0; q < jt->Q; q++) {
        double v = (double)grp_row(jt, m, q, l)[e];
        if (!(v > 0)) continue;
        for (int32_t i = 0; i < ls->cnt[e]; i++) ls->U[(size_t)q * ep + rk[i]] += joint_per_speed(jt, sign * v * w[i], q, rk[i]);
    }
}

static double u_max(const joint *jt, const lever_state *ls)
{
    double best = 0;
    for (int32_t i = 0; i < jt->Q * jt->ep; i++) best = ls->U[i] > best ? ls->U[i] : best;
    return best;
}

/* Shares of expert e over the ranks rk[0..R) that minimise the largest load of those
 * ranks over every group, the other experts' loads fixed (base_load[q * (ep + 1) + i]
 * is rank rk[i]'s load in group q without e; tq[q] e's token-choices in group q).
 * At a common level h, rank i can take s_i(h) = min over groups of
 * (h - base) speed / tq; the h with sum s_i(h) = 1 is the level of 28 halvings of
 * [lo, hi] (joint_fill_level). Returns the level. */
static double minmax_fill(const joint *jt, lever_state *ls, const int32_t *rk, int32_t R, double *share)
{
    const int32_t Q = jt->Q, stride = jt->ep + 1;
    /* s_i(h) = min over groups with tq > 0 of slope * h - offset */
    double *slope = ls->fill_a, *offset = ls->fill_c;
    double lo = 0, hi = 0;
    if (jt->unit_speed) {
        /* the same lines without the 2 R Q divisions: tq / 1 is tq, and 1 / tq is
         * computed once per group (slope is 1 / tq there whatever the rank) */
        double *inv = ls->inv_tq;
        for (int32_t q = 0; q < Q; q++) inv[q] = ls->tq[q] > 0 ? 1.0 / ls->tq[q] : 0.0;
        for (int32_t i = 0; i < R; i++)
            for (int32_t q = 0; q < Q; q++) {
                double b = ls->base_load[(size_t)q * stride + i], all = b + ls->tq[q];
                lo = b > lo ? b : lo;
                hi = all > hi ? all : hi;
                slope[(size_t)i * Q + q] = inv[q];
                offset[(size_t)i * Q + q] = b * inv[q];
            }
    } else {
        for (int32_t i = 0; i < R; i++)
            for (int32_t q = 0; q < Q; q++) {
                double b = ls->base_load[(size_t)q * stride + i], sp = gspeed(jt, q, rk[i]);
                double all = b + ls->tq[q] / sp;
                lo = b > lo ? b : lo;
                hi = all > hi ? all : hi;
                double k = ls->tq[q] > 0 ? sp / ls->tq[q] : 0.0;
                slope[(size_t)i * Q + q] = k;
                offset[(size_t)i * Q + q] = b * k;
            }
    }
    if (!(hi > lo)) {
        for (int32_t i = 0; i < R; i++) share[i] = 1.0 / R;
        return lo;
    }
    hi = joint_fill_level(slope, offset, R, Q, lo, hi, NULL);
    double norm = 0;
    for (int32_t i = 0; i < R; i++) {
        double s = INFINITY;
        for (int32_t q = 0; q < Q; q++) {
            double k = slope[(size_t)i * Q + q];
            if (k == 0) continue;
            double v = k * hi - offset[(size_t)i * Q + q];
            s = v < s ? v : s;
        }
        share[i] = s > 0 ? (s < 1 ? s : 1) : 0;
        norm += share[i];
    }
    for (int32_t i = 0; i < R; i++) share[i] = norm > 0 ? share[i] / norm : 1.0 / R;
    return hi;
}

/* Load each group's rank would have without expert e: base_load for ranks rk[0..R);
 * e's current contribution is taken out where it has a replica. */
static void prepare(const joint *jt, lever_state *ls, int32_t m, int32_t l, int32_t e, const int32_t *rk, int32_t R)
{
    const int32_t ep = jt->ep, stride = ep + 1;
    for (int32_t q = 0; q < jt->Q; q++) {
        ls->tq[q] = (double)grp_row(jt, m, q, l)[e];
        for (int32_t i = 0; i < R; i++) {
            double u = ls->U[(size_t)q * ep + rk[i]];
            for (int32_t k = 0; k < ls->cnt[e]; k++)
                if (ls->rank[(size_t)e * ep + k] == rk[i])
                    u -= joint_per_speed(jt, ls->tq[q] * ls->w[(size_t)e * ep + k], q, rk[i]);
            ls->base_load[(size_t)q * stride + i] = u;
        }
    }
}

/* Largest load over all groups and ranks if e's replicas become rk[0..R) with shares
 * `share` (base_load prepared for rk). */
static double trial_max(const joint *jt, lever_state *ls, int32_t e, const int32_t *rk, int32_t R,
                        const double *share)
{
    const int32_t ep = jt->ep, stride = ep + 1;
    unsigned char *touched = ls->touched;
    memset(touched, 0, (size_t)ep);
    for (int32_t k = 0; k < ls->cnt[e]; k++) touched[ls->rank[(size_t)e * ep + k]] = 1;
    for (int32_t i = 0; i < R; i++) touched[rk[i]] = 1;
    double best = 0;
    for (int32_t q = 0; q < jt->Q; q++)
        for (int32_t j = 0; j < ep; j++) {
            if (touched[j]) continue;
            double u = ls->U[(size_t)q * ep + j];
            best = u > best ? u : best;
        }
    for (int32_t q = 0; q < jt->Q; q++)
        for (int32_t i = 0; i < R; i++) {
            double u = ls->base_load[(size_t)q * stride + i] + joint_per_speed(jt, ls->tq[q] * share[i], q, rk[i]);
            best = u > best ? u : best;
        }
    return best;
}

/* A floor under trial_max for the same trial, without the fill: the ranks the trial
 * leaves alone keep their loads (rank_u: each rank's largest over the groups), and in
 * each group the touched ranks rk[0..R) (e's replicas and the new one) keep their total
 * work, so the largest of their loads per speed is at least that work over their summed
 * speed. Scaled down by 1e-9 so that rounding (U's running sums, the fill's shares summing
 * to 1) never puts it above the maximum trial_max computes. */
static double trial_floor(const joint *jt, const lever_state *ls, const int32_t *rk, int32_t R)
{
    const int32_t ep = jt->ep;
    unsigned char *touched = ls->touched;
    memset(touched, 0, (size_t)ep);
    for (int32_t i = 0; i < R; i++) touched[rk[i]] = 1;
    double best = 0;
    for (int32_t j = 0; j < ep; j++)
        if (!touched[j]) best = ls->rank_u[j] > best ? ls->rank_u[j] : best;
    for (int32_t q = 0; q < jt->Q; q++) {
        double work = 0, speed = 0;
        for (int32_t i = 0; i < R; i++) {
            double sp = gspeed(jt, q, rk[i]);
            work += ls->U[(size_t)q * ep + rk[i]] * sp;
            speed += sp;
        }
        best = work / speed > best ? work / speed : best;
    }
    return best * (1.0 - 1e-9);
}

/* joint_slot_time of an integer load n >= 0, without its interpolation: the table's
 * entry itself (the interpolation adds (T[n + 1] - T[n]) x 0 to it), the same bits. */
static inline double slot_time_whole(const joint *jt, int64_t n)
{
    if (n <= 0) return 0.0;
    double t = n < jt->t_table_n ? jt->t_table[n] : (double)n * jt->t_slope;
    return t > jt->t_mem ? t : jt->t_mem;
}

/* Exact expert time of the slowest GPU at (m, l) under the current replicas and
 * shares (forward seconds), from the cost model's slot time. */
static double exact_max(const joint *jt, const lever_state *ls, int32_t m, int32_t l, double *acc)
{
    const int32_t ep = jt->ep;
    double best = 0;
    for (int32_t q = 0; q < jt->Q; q++) {
        for (int32_t j = 0; j < ep; j++) acc[j] = 0;
        const int64_t *h = grp_row(jt, m, q, l);
        for (int32_t e = 0; e < jt->E; e++) {
            const int32_t *rk = ls->rank + (size_t)e * ep;
            const double *w = ls->w + (size_t)e * ep;
            if (ls->cnt[e] == 1 && w[0] == 1.0) { /* a whole expert: an integer load */
                acc[rk[0]] += slot_time_whole(jt, h[e]);
                continue;
            }
            for (int32_t i = 0; i < ls->cnt[e]; i++) acc[rk[i]] += joint_slot_time(jt, (double)h[e] * w[i]);
        }
        for (int32_t j = 0; j < ep; j++) {
            double x = joint_per_speed(jt, acc[j], q, j);
            best = x > best ? x : best;
        }
    }
    return best;
}

static bool has_rank(const lever_state *ls, int32_t ep, int32_t e, int32_t j)
{
    for (int32_t i = 0; i < ls->cnt[e]; i++)
        if (ls->rank[(size_t)e * ep + i] == j) return true;
    return false;
}

static void reset_even(const joint *jt, lever_state *ls, int32_t l)
{
    const joint_layer *lay = &jt->layers[l];
    const int32_t ep = jt->ep;
    for (int32_t e = 0; e < jt->E; e++) {
        int32_t R = lay->rep_off[e + 1] - lay->rep_off[e];
        ls->cnt[e] = ls->base[e] = R;
        ls->explicit_shares[e] = false;
        for (int32_t i = 0; i < R; i++) {
            ls->rank[(size_t)e * ep + i] = lay->rep_rank[lay->rep_off[e] + i];
            ls->w[(size_t)e * ep + i] = 1.0 / R;
        }
    }
    for (int32_t j = 0; j < ep; j++) ls->extra_count[j] = 0, ls->fresh[j] = 0, ls->rank_price[j] = 0.0;
    ls->n_extra = 0;
    ls->extra_price = 0.0;
}

bool joint_extras_may_gain(const joint *jt, const double *U)
{
    double most = 0, level = 0;
    for (int32_t q = 0; q < jt->Q; q++) {
        const double *u = U + (size_t)q * jt->ep;
        double work = 0, speed = 0;
        for (int32_t j = 0; j < jt->ep; j++) {
            double sp = gspeed(jt, q, j);
            work += u[j] * sp;
            speed += sp;
            most = u[j] > most ? u[j] : most;
        }
        level = work / speed > level ? work / speed : level;
    }
    return most > (1.0 + JOINT_EXTRAS_MARGIN) * level;
}

/* One (mb, layer): shares, then extra replicas while they pay; kept only if the exact
 * slot times say the slowest GPU got faster by more than the copies cost. */
static void plan_levers(joint *jt, lever_state *ls, int32_t m, int32_t l)
{
    const int32_t E = jt->E, ep = jt->ep;
    const rp_joint_params *par = jt->par;
    reset_even(jt, ls, l);
    /* every expert's load, as contribute(+1) adds it, a group's row at a time */
    memset(ls->U, 0, (size_t)jt->Q * ep * sizeof *ls->U);
    for (int32_t q = 0; q < jt->Q; q++) {
        const int64_t *h = grp_row(jt, m, q, l);
        double *u = ls->U + (size_t)q * ep;
        for (int32_t e = 0; e < E; e++) {
            double v = (double)h[e];
            if (!(v > 0)) continue;
            const int32_t *rk = ls->rank + (size_t)e * ep;
            const double *w = ls->w + (size_t)e * ep;
            for (int32_t i = 0; i < ls->cnt[e]; i++) u[rk[i]] += joint_per_speed(jt, v * w[i], q, rk[i]);
        }
    }
    double *acc = ls->rank_u; /* scratch of ep doubles for exact_max */
    const double even_exact = exact_max(jt, ls, m, l, acc);

    if (par->shares) {
        /* replicated experts, heaviest first (ties: lower id); two Gauss-Seidel passes */
        int32_t nrep = 0;
        for (int32_t e = 0; e < E; e++) {
            if (ls->cnt[e] < 2) continue;
            double total = 0;
            for (int32_t q = 0; q < jt->Q; q++) total += (double)grp_row(jt, m, q, l)[e];
            if (!(total > 0)) continue;
            int32_t at = nrep++;
            while (at > 0 && ls->rtot[at - 1] < total) {
                ls->reps[at] = ls->reps[at - 1];
                ls->rtot[at] = ls->rtot[at - 1];
                at--;
            }
            ls->reps[at] = e;
            ls->rtot[at] = total;
        }
        for (int32_t pass = 0; pass < 2; pass++)
            for (int32_t k = 0; k < nrep; k++) {
                int32_t e = ls->reps[k], R = ls->cnt[e];
                const int32_t *rk = ls->rank + (size_t)e * ep;
                prepare(jt, ls, m, l, e, rk, R);
                minmax_fill(jt, ls, rk, R, ls->wt);
                contribute(jt, ls, m, l, e, -1);
                memcpy(ls->w + (size_t)e * ep, ls->wt, (size_t)R * sizeof *ls->wt);
                ls->explicit_shares[e] = true;
                contribute(jt, ls, m, l, e, +1);
            }
    }

    if (par->max_extra_per_rank > 0 && ep > 1 && joint_extras_may_gain(jt, ls->U)) {
        double cur = u_max(jt, ls);
        for (int32_t iter = 0; iter < par->max_extra_per_rank * ep; iter++) {
            int32_t hq = 0, hj = 0;
            for (int32_t i = 0; i < jt->Q * ep; i++)
                if (ls->U[i] > ls->U[(size_t)hq * ep + hj]) hq = i / ep, hj = i % ep;
            /* the hot rank's three heaviest experts in the hot group */
            int32_t cand[3], nc = 0;
            double cw[3];
            for (int32_t e = 0; e < E; e++) {
                if (!has_rank(ls, ep, e, hj) || ls->cnt[e] >= ep) continue;
                double v = (double)grp_row(jt, m, hq, l)[e];
                if (!(v > 0)) continue;
                int32_t at = nc < 3 ? nc++ : 3;
                while (at > 0 && cw[at - 1] < v) {
                    if (at < 3) {
                        cw[at] = cw[at - 1];
                        cand[at] = cand[at - 1];
                    }
                    at--;
                }
                if (at < 3) {
                    cw[at] = v;
                    cand[at] = e;
                }
            }
            /* targets: the two coolest ranks (largest load over groups) with room */
            for (int32_t j = 0; j < ep; j++) {
                ls->rank_u[j] = 0;
                for (int32_t q = 0; q < jt->Q; q++)
                    ls->rank_u[j] = ls->U[(size_t)q * ep + j] > ls->rank_u[j] ? ls->U[(size_t)q * ep + j] : ls->rank_u[j];
            }
            int32_t cool[2], ncool = 0;
            for (int32_t j = 0; j < ep; j++) {
                if (ls->extra_count[j] >= par->max_extra_per_rank || ls->fresh[j] >= ls->room[j]) continue;
                int32_t at = ncool < 2 ? ncool++ : 2;
                while (at > 0 && ls->rank_u[cool[at - 1]] > ls->rank_u[j]) {
                    if (at < 2) cool[at] = cool[at - 1];
                    at--;
                }
                if (at < 2) cool[at] = j;
            }
            int32_t kmax = 0;
            for (int32_t j = 0; j < ep; j++) kmax = ls->extra_count[j] > kmax ? ls->extra_count[j] : kmax;
            double best_gain = 0;
            int32_t best_e = -1, best_j = -1;
            for (int32_t c = 0; c < nc; c++) {
                int32_t e = cand[c], R = ls->cnt[e];
                for (int32_t t = 0; t < ncool; t++) {
                    int32_t j2 = cool[t];
                    if (has_rank(ls, ep, e, j2)) continue;
                    /* copied per microbatch: from a base replica in the same node only;
                     * fetched once a step: from anywhere, at its link's price */
                    bool source = jt->extras_once;
                    for (int32_t i = 0; i < ls->base[e] && !source; i++)
                        source = jt->node_of_rank[ls->rank[(size_t)e * ep + i]] == jt->node_of_rank[j2];
                    if (!source) continue;
                    memcpy(ls->rk, ls->rank + (size_t)e * ep, (size_t)R * sizeof *ls->rk);
                    ls->rk[R] = j2;
                    int32_t k_after = ls->extra_count[j2] + 1 > kmax ? ls->extra_count[j2] + 1 : kmax;
                    double copy = jt->extras_once
                                      ? extra_price_once(jt, ls, l, e, j2, false) / (jt->M - m)
                                      : 2.0 * ((k_after - kmax) * jt->copy_s + (kmax == 0 ? jt->nv_lat : 0.0));
                    /* the most this trial could save: skip the fill when that cannot win */
                    if (!(joint_mb_value(jt, m, cur) - joint_mb_value(jt, m, trial_floor(jt, ls, ls->rk, R + 1)) - copy >
                          best_gain))
                        continue;
                    prepare(jt, ls, m, l, e, ls->rk, R + 1);
                    minmax_fill(jt, ls, ls->rk, R + 1, ls->wt);
                    double nm = trial_max(jt, ls, e, ls->rk, R + 1, ls->wt);
                    /* net saving, step seconds */
                    double gain = joint_mb_value(jt, m, cur) - joint_mb_value(jt, m, nm) - copy;
                    if (gain > best_gain) {
                        best_gain = gain;
                        best_e = e;
                        best_j = j2;
                        memcpy(ls->best_w, ls->wt, (size_t)(R + 1) * sizeof *ls->wt);
                    }
                }
            }
            if (best_e < 0) break;
            if (jt->extras_once) extra_price_once(jt, ls, l, best_e, best_j, true);
            contribute(jt, ls, m, l, best_e, -1);
            int32_t R = ls->cnt[best_e];
            ls->rank[(size_t)best_e * ep + R] = best_j;
            ls->cnt[best_e] = R + 1;
            memcpy(ls->w + (size_t)best_e * ep, ls->best_w, (size_t)(R + 1) * sizeof *ls->best_w);
            ls->explicit_shares[best_e] = true;
            contribute(jt, ls, m, l, best_e, +1);
            ls->extra_count[best_j]++;
            if (!held_extra(jt, ls, l, best_e, best_j)) ls->fresh[best_j]++;
            ls->extra_e[ls->n_extra] = best_e;
            ls->extra_r[ls->n_extra] = best_j;
            ls->n_extra++;
            cur = u_max(jt, ls);
        }
    }

    /* keep the levers only if they pay under the exact slot times */
    int32_t kmax = 0;
    for (int32_t j = 0; j < ep; j++) kmax = ls->extra_count[j] > kmax ? ls->extra_count[j] : kmax;
    double copy = jt->extras_once ? ls->extra_price / (jt->M - m)
                                  : kmax > 0 ? 2.0 * (kmax * jt->copy_s + jt->nv_lat) : 0.0;
    bool any = ls->n_extra > 0;
    for (int32_t e = 0; e < E && !any; e++) any = ls->explicit_shares[e];
    if (any && !(exact_max(jt, ls, m, l, acc) + copy / jt->x_mult < even_exact)) reset_even(jt, ls, l);
}

rp_status joint_levers(joint *jt, rp_plan *plan, int32_t *share_sets, int32_t *extras, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const int32_t E = jt->E, ep = jt->ep, Q = jt->Q;
    lever_state ls;
    memset(&ls, 0, sizeof ls);
    rp_status st = RP_OK;
    const size_t ee = (size_t)E * ep;
    const int32_t max_extras = jt->par->max_extra_per_rank > 0 ? jt->par->max_extra_per_rank * ep : 0;
    ls.cnt = rp_alloc(ctx, (size_t)E * sizeof *ls.cnt);
    ls.base = rp_alloc(ctx, (size_t)E * sizeof *ls.base);
    ls.rank = rp_alloc(ctx, ee * sizeof *ls.rank);
    ls.w = rp_alloc(ctx, ee * sizeof *ls.w);
    ls.explicit_shares = rp_alloc(ctx, (size_t)E * sizeof *ls.explicit_shares);
    ls.U = rp_alloc(ctx, (size_t)Q * ep * sizeof *ls.U);
    ls.tq = rp_alloc(ctx, (size_t)Q * sizeof *ls.tq);
    ls.inv_tq = rp_alloc(ctx, (size_t)Q * sizeof *ls.inv_tq);
    ls.base_load = rp_alloc(ctx, (size_t)Q * (ep + 1) * sizeof *ls.base_load);
    ls.wt = rp_alloc(ctx, ((size_t)ep + 1) * sizeof *ls.wt);
    ls.best_w = rp_alloc(ctx, ((size_t)ep + 1) * sizeof *ls.best_w);
    ls.rk = rp_alloc(ctx, ((size_t)ep + 1) * sizeof *ls.rk);
    ls.rank_u = rp_alloc(ctx, (size_t)ep * sizeof *ls.rank_u);
    ls.rank_price = rp_alloc(ctx, (size_t)ep * sizeof *ls.rank_price);
    ls.touched = rp_alloc(ctx, (size_t)ep);
    ls.extra_count = rp_alloc(ctx, (size_t)ep * sizeof *ls.extra_count);
    ls.extra_e = rp_alloc(ctx, ((size_t)max_extras + 1) * sizeof *ls.extra_e);
    ls.extra_r = rp_alloc(ctx, ((size_t)max_extras + 1) * sizeof *ls.extra_r);
    ls.reps = rp_alloc(ctx, (size_t)E * sizeof *ls.reps);
    ls.rtot = rp_alloc(ctx, (size_t)E * sizeof *ls.rtot);
    ls.fill_a = rp_alloc(ctx, ((size_t)ep + 1) * Q * sizeof *ls.fill_a);
    ls.fill_c = rp_alloc(ctx, ((size_t)ep + 1) * Q * sizeof *ls.fill_c);
    int32_t *order = rp_alloc(ctx, ((size_t)max_extras + 1) * sizeof *order);
    ls.room = rp_alloc(ctx, (size_t)ep * sizeof *ls.room);
    ls.fresh = rp_calloc(ctx, (size_t)ep, sizeof *ls.fresh);
    rp_gpu_memory *mem = rp_alloc(ctx, (size_t)ep * sizeof *mem);
    const size_t held_bits = (size_t)jt->L * (size_t)E * (size_t)ep;
    if (held_bits <= ((size_t)1 << 30)) {
        ls.held = rp_calloc(ctx, held_bits / 8 + 1, 1);
        if (!ls.held) {
            st = rp_fail_nomem(err, "joint: extra replicas");
            goto out;
        }
    }
    if (!ls.room || !ls.fresh || !mem) {
        st = rp_fail_nomem(err, "joint: extra replicas");
        goto out;
    }
    RP_CHECK_GOTO(memory_per_rank(jt->cfg, NULL, mem, err), st, out);
    const double extra_bytes = memory_extra_replica_bytes(jt->cfg);
    for (int32_t j = 0; j < ep; j++) {
        double free_bytes = mem[j].capacity_bytes - mem[j].total_bytes;
        double n = free_bytes > 0 && extra_bytes > 0 ? floor(free_bytes / extra_bytes) : 0;
        ls.room[j] = n < (double)INT32_MAX ? (int64_t)n : INT32_MAX;
    }
    if (!ls.cnt || !ls.base || !ls.rank || !ls.w || !ls.explicit_shares || !ls.U || !ls.tq || !ls.inv_tq || !ls.base_load ||
        !ls.wt || !ls.best_w || !ls.rk || !ls.rank_u || !ls.rank_price || !ls.touched || !ls.extra_count || !ls.extra_e || !ls.extra_r || !ls.reps ||
        !ls.rtot || !ls.fill_a || !ls.fill_c || !order) {
        st = rp_fail_nomem(err, "joint: shares and extra replicas");
        goto out;
    }
    *share_sets = *extras = 0;
    for (int32_t m = 0; m < jt->M; m++)
        for (int32_t l = 0; l < jt->L; l++) {
            plan_levers(jt, &ls, m, l);
            /* extras in ascending expert order (insertion order kept per expert), so the
             * plan appends them; then the shares of every expert that has explicit ones */
            for (int32_t i = 0; i < ls.n_extra; i++) order[i] = i;
            for (int32_t i = 1; i < ls.n_extra; i++)
                for (int32_t k = i; k > 0 && ls.extra_e[order[k - 1]] > ls.extra_e[order[k]]; k--) {
                    int32_t t = order[k];
                    order[k] = order[k - 1];
                    order[k - 1] = t;
                }
            for (int32_t i = 0; i < ls.n_extra; i++) {
                int32_t k = order[i];
                RP_CHECK_GOTO(rp_plan_add_extra_replica(plan, m, l, ls.extra_e[k], ls.extra_r[k], err), st, out);
                (*extras)++;
                if (!held_extra(jt, &ls, l, ls.extra_e[k], ls.extra_r[k])) {
                    ls.room[ls.extra_r[k]]--;
                    if (ls.held) {
                        size_t bit = ((size_t)l * E + ls.extra_e[k]) * ep + ls.extra_r[k];
                        ls.held[bit >> 3] |= (unsigned char)(1u << (bit & 7));
                    }
                }
            }
            for (int32_t e = 0; e < E; e++) {
                if (!ls.explicit_shares[e]) continue;
                RP_CHECK_GOTO(rp_plan_set_shares(plan, m, l, e, ls.w + (size_t)e * ep, ls.cnt[e], err), st, out);
                (*share_sets)++;
            }
        }
out:
    rp_free(ctx, ls.room);
    rp_free(ctx, ls.fresh);
    rp_free(ctx, ls.held);
    rp_free(ctx, mem);
    rp_free(ctx, ls.cnt);
    rp_free(ctx, ls.base);
    rp_free(ctx, ls.rank);
    rp_free(ctx, ls.w);
    rp_free(ctx, ls.explicit_shares);
    rp_free(ctx, ls.U);
    rp_free(ctx, ls.tq);
    rp_free(ctx, ls.inv_tq);
    rp_free(ctx, ls.base_load);
    rp_free(ctx, ls.wt);
    rp_free(ctx, ls.best_w);
    rp_free(ctx, ls.rk);
    rp_free(ctx, ls.rank_u);
    rp_free(ctx, ls.rank_price);
    rp_free(ctx, ls.touched);
    rp_free(ctx, ls.extra_count);
    rp_free(ctx, ls.extra_e);
    rp_free(ctx, ls.extra_r);
    rp_free(ctx, ls.reps);
    rp_free(ctx, ls.rtot);
    rp_free(ctx, ls.fill_a);
    rp_free(ctx, ls.fill_c);
    rp_free(ctx, order);
    return st;
}
