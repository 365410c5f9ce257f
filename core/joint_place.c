/* Joint placement of one layer: replicas apportioned by this step's load and placed
 * node-aware, then replica moves, swaps and re-assignments judged by the expert time of
 * every (microbatch, EP group) rather than the step's aggregate, optionally anchored
 * to the previous placement so that only moves that pay are made
 * (docs/routepack-policy.md, "Placement"). */
#include "joint_internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

rp_status joint_layer_alloc(const joint *jt, joint_layer *lay, rp_error *err)
{
    lay->phy2log = rp_alloc(jt->ctx, (size_t)jt->S * sizeof *lay->phy2log + 1);
    lay->rep_off = rp_alloc(jt->ctx, ((size_t)jt->E + 1) * sizeof *lay->rep_off);
    lay->rep_rank = rp_alloc(jt->ctx, (size_t)jt->S * sizeof *lay->rep_rank + 1);
    if (!lay->phy2log || !lay->rep_off || !lay->rep_rank) {
        joint_layer_free(jt, lay);
        return rp_fail_nomem(err, "joint: a layer's placement");
    }
    return RP_OK;
}

void joint_layer_free(const joint *jt, joint_layer *lay)
{
    rp_free(jt->ctx, lay->phy2log);
    rp_free(jt->ctx, lay->rep_off);
    rp_free(jt->ctx, lay->rep_rank);
    memset(lay, 0, sizeof *lay);
}

void joint_layer_index(const joint *jt, joint_layer *lay)
{
    const int32_t E = jt->E, S = jt->S;
    memset(lay->rep_off, 0, ((size_t)E + 1) * sizeof *lay->rep_off);
    for (int32_t s = 0; s < S; s++)
        if (lay->phy2log[s] >= 0) lay->rep_off[lay->phy2log[s] + 1]++;
    for (int32_t e = 0; e < E; e++) lay->rep_off[e + 1] += lay->rep_off[e];
    for (int32_t s = 0; s < S; s++)
        if (lay->phy2log[s] >= 0) lay->rep_rank[lay->rep_off[lay->phy2log[s]]++] = jt->slot_rank[s];
    for (int32_t e = E; e > 0; e--) lay->rep_off[e] = lay->rep_off[e - 1];
    lay->rep_off[0] = 0;
}

rp_status joint_layer_copy_from_plan(const joint *jt, const rp_plan *plan, int32_t l, joint_layer *lay,
                                     rp_error *err)
{
    const int32_t *row = rp_plan_phy2log(plan, l);
    for (int32_t s = 0; s < jt->S; s++) {
        if (row[s] < -1 || row[s] >= jt->E)
            return rp_fail(err, RP_EINVAL, "joint: the previous plan's layer %d slot %d holds expert %d, but the "
                           "model has %d", l, s, row[s], jt->E);
        lay->phy2log[s] = row[s];
    }
    joint_layer_index(jt, lay);
    for (int32_t e = 0; e < jt->E; e++) {
        for (int32_t i = lay->rep_off[e] + 1; i < lay->rep_off[e + 1]; i++)
            if (lay->rep_rank[i] == lay->rep_rank[i - 1]) {
                rp_fail(err, RP_EINVAL, "joint: the previous plan's layer %d holds expert %d twice on EP rank %d", l,
                        e, lay->rep_rank[i]);
                if (err) err->expert = e;
                return RP_EINVAL;
            }
        if (lay->rep_off[e + 1] == lay->rep_off[e]) {
            rp_fail(err, RP_EINVAL, "joint: the previous plan's layer %d has no replica of expert %d", l, e);
            if (err) err->expert = e;
            return RP_EINVAL;
        }
    }
    return RP_OK;
}

/* ---- the surrogate: expert load of every (mb, group, rank) ----------------------- */

/* Scratch layout (doubles): U[M * Q * ep] loads in token-choices, rmax[M * ep] the
 * largest over groups of each rank's load / speed, a row of Q * ep for trials, E for
 * per-replica loads, gm[M * Q] the largest over ranks of each (mb, group) and Q group
 * sums (the group form). joint_place_score_ideal lays its own over the start: 2 ep + Q
 * doubles and E + ep + 1 ints, which fit as the total is at least 3 ep + Q + E doubles. */
size_t joint_place_scratch_doubles(const joint *jt)
{
    return (size_t)jt->M * jt->Q * jt->ep + (size_t)jt->M * jt->ep + (size_t)jt->Q * jt->ep + (size_t)jt->E + 16 +
           (size_t)jt->M * jt->Q + (size_t)jt->Q;
}

/* gm and the group sums inside the scratch (after per_replica). */
static double *scratch_gm(const joint *jt, double *scratch)
{
    return scratch + (size_t)jt->M * jt->Q * jt->ep + (size_t)jt->M * jt->ep + (size_t)jt->Q * jt->ep + (size_t)jt->E + 16;
}

/* A load split evenly over R replicas. Most experts have one, and x / 1 is x bit for
 * bit, so the division (several cycles in the search's inner loops) is skipped there. */
static inline double per_replica_load(int64_t load, int32_t R)
{
    return R == 1 ? (double)load : (double)load / R;
}

/* Loads of every (mb, group, rank) with an even split over replicas. */
static void layer_loads(const joint *jt, int32_t l, const joint_layer *lay, double *U)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    for (int32_t m = 0; m < M; m++)
        for (int32_t q = 0; q < Q; q++) {
            double *u = U + ((size_t)m * Q + q) * ep;
            const int64_t *h = grp_row(jt, m, q, l);
            for (int32_t j = 0; j < ep; j++) u[j] = 0.0;
            for (int32_t e = 0; e < E; e++) {
                if (!h[e]) continue;
                int32_t a = lay->rep_off[e], b = lay->rep_off[e + 1];
                double w = per_replica_load(h[e], b - a);
                for (int32_t i = a; i < b; i++) u[lay->rep_rank[i]] += w;
            }
        }
}

static inline double gpu_speed(const joint *jt, int32_t q, int32_t j) { return jt->speed[q * jt->ep + j]; }



/* rmax[m * ep + j] = max over groups of U / speed. */
static void rank_maxima(const joint *jt, const double *U, double *rmax)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep;
    for (int32_t m = 0; m < M; m++)
        for (int32_t j = 0; j < ep; j++) {
            double best = 0;
            for (int32_t q = 0; q < Q; q++) {
                double x = joint_per_speed(jt, U[((size_t)m * Q + q) * ep + j], q, j);
                if (x > best) best = x;
            }
            rmax[(size_t)m * ep + j] = best;
        }
}

/* gm[m * Q + q] = max over the ranks of group q of U / speed. */
static void group_maxima(const joint *jt, const double *U, double *gm)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep;
    for (int32_t m = 0; m < M; m++)
        for (int32_t q = 0; q < Q; q++) {
            const double *u = U + ((size_t)m * Q + q) * ep;
            double best = 0;
            for (int32_t j = 0; j < ep; j++) {
                double x = joint_per_speed(jt, u[j], q, j);
                if (x > best) best = x;
            }
            gm[(size_t)m * Q + q] = best;
        }
}

/* The group form (execution.sync group): the slowest EP group's own sum over
 * microbatches, each (mb, group) waiting only for its own busiest rank. */
static double group_value(const joint *jt, const double *gm)
{
    double worst = 0;
    for (int32_t q = 0; q < jt->Q; q++) {
        double sum = 0;
        for (int32_t m = 0; m < jt->M; m++) sum += joint_mq_value(jt, m, q, gm[(size_t)m * jt->Q + q]);
        worst = sum > worst ? sum : worst;
    }
    return worst;
}

static double total_value(const joint *jt, const double *rmax)
{
    double sum = 0;
    for (int32_t m = 0; m < jt->M; m++) {
        double best = 0;
        for (int32_t j = 0; j < jt->ep; j++)
            if (rmax[(size_t)m * jt->ep + j] > best) best = rmax[(size_t)m * jt->ep + j];
        sum += joint_mb_value(jt, m, best);
    }
    return sum;
}

/* Surrogate values are step seconds already (joint_mb_value). */
static double to_seconds(const joint *jt, double value)
{
    (void)jt;
    return value;
}

/* The score of the loads U (scratch laid out as joint_place_score's). */
static double loads_score(const joint *jt, double *scratch)
{
    double *U = scratch, *rmax = U + (size_t)jt->M * jt->Q * jt->ep;
    if (jt->group_form) {
        double *gm = scratch_gm(jt, scratch);
        group_maxima(jt, U, gm);
        return group_value(jt, gm);
    }
    rank_maxima(jt, U, rmax);
    return to_seconds(jt, total_value(jt, rmax));
}

double joint_place_score(const joint *jt, int32_t l, const joint_layer *lay, double *scratch)
{
    layer_loads(jt, l, lay, scratch);
    return loads_score(jt, scratch);
}

/* Like joint_place_score, but with every replicated expert's load poured into its
 * ranks by water-filling in each (mb, group) separately: what shares could reach at
 * best (shares are common to the groups, so this is optimistic), to compare replica
 * counts fairly. */
double joint_place_score_ideal(const joint *jt, int32_t l, const joint_layer *lay, double *scratch)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    double *u = scratch, *lv = u + ep, *gsum = lv + ep; /* lv: at most ep replicas */
    /* The experts sorted once for every (mb, group): ids[first[j], first[j + 1]) have one
     * replica, on rank j, ascending; ids[first[ep], n) several, ascending. So each rank's
     * single experts add up in a register in the order a scatter over the experts would
     * add them. E + ep + 1 ints, within the ep + E doubles joint_place_scratch_doubles
     * leaves after gsum. */
    int32_t *ids = (int32_t *)(gsum + Q), *first = ids + E, n = 0;
    for (int32_t j = 0; j <= ep; j++) first[j] = 0;
    for (int32_t e = 0; e < E; e++)
        if (lay->rep_off[e + 1] - lay->rep_off[e] == 1) first[lay->rep_rank[lay->rep_off[e]] + 1]++;
    for (int32_t j = 0; j < ep; j++) first[j + 1] += first[j];
    for (int32_t e = 0; e < E; e++)
        if (lay->rep_off[e + 1] - lay->rep_off[e] == 1) ids[first[lay->rep_rank[lay->rep_off[e]]]++] = e;
    for (int32_t j = ep; j > 0; j--) first[j] = first[j - 1];
    first[0] = 0;
    n = first[ep];
    for (int32_t e = 0; e < E; e++)
        if (lay->rep_off[e + 1] - lay->rep_off[e] >= 2) ids[n++] = e;
    int32_t ord[64];
    double sum = 0;
    for (int32_t q = 0; q < Q; q++) gsum[q] = 0;
    for (int32_t m = 0; m < M; m++) {
        double best = 0;
        for (int32_t q = 0; q < Q; q++) {
            double best_q = 0;
            const int64_t *h = grp_row(jt, m, q, l);
            for (int32_t j = 0; j < ep; j++) {
                double sum_j = 0;
                for (int32_t i = first[j]; i < first[j + 1]; i++) sum_j += (double)h[ids[i]];
                u[j] = sum_j;
            }
            for (int32_t x = first[ep]; x < n; x++) {
                const int32_t e = ids[x], a = lay->rep_off[e], R = lay->rep_off[e + 1] - a;
                if (!h[e]) continue;
                if (R > 64) { /* spread evenly: bounded work */
                    for (int32_t i = 0; i < R; i++) u[lay->rep_rank[a + i]] += (double)h[e] / R;
                    continue;
                }
                for (int32_t i = 0; i < R; i++) {
                    int32_t r = lay->rep_rank[a + i], k = i;
                    lv[i] = u[r] / gpu_speed(jt, q, r);
                    while (k > 0 && lv[ord[k - 1]] > lv[i]) {
                        ord[k] = ord[k - 1];
                        k--;
                    }
                    ord[k] = i;
                }
                double left = (double)h[e], sc = 0, sl = 0, level = 0;
                int32_t k = 0;
                while (k < R) {
                    int32_t r = lay->rep_rank[a + ord[k]];
                    sl += lv[ord[k]] * gpu_speed(jt, q, r);
                    sc += gpu_speed(jt, q, r);
                    k++;
                    level = (left + sl) / sc;
                    if (k == R || level <= lv[ord[k]]) break;
                }
                for (int32_t i = 0; i < k; i++) {
                    int32_t r = lay->rep_rank[a + ord[i]];
                    u[r] = level * gpu_speed(jt, q, r);
                }
            }
            for (int32_t j = 0; j < ep; j++) {
                double x = joint_per_speed(jt, u[j], q, j);
                best_q = x > best_q ? x : best_q;
            }
            if (jt->group_form) gsum[q] += joint_mq_value(jt, m, q, best_q);
            best = best_q > best ? best_q : best;
        }
        if (!jt->group_form) sum += joint_mb_value(jt, m, best);
    }
    if (jt->group_form)
        for (int32_t q = 0; q < Q; q++) sum = gsum[q] > sum ? gsum[q] : sum;
    return to_seconds(jt, sum);
}

/* The gradient all-reduces a layer's replicas add (docs/cost-model.md): every replica
 * beyond an expert's first (lowest rank) pairs with the first, each of the two GPUs
 * paying one gradient transfer. The cost model charges the busiest GPU's sum over
 * layers, which the per-layer means add up to when the pairs spread over the ranks
 * (placements spread replicas); the mean is this layer's share, step seconds. */
double joint_layer_grad_s(const joint *jt, const joint_layer *lay, double *per_rank)
{
    for (int32_t j = 0; j < jt->ep; j++) per_rank[j] = 0;
    for (int32_t e = 0; e < jt->E; e++) {
        int32_t a = lay->rep_off[e], b = lay->rep_off[e + 1];
        if (b - a < 2) continue;
        int32_t first = lay->rep_rank[a];
        for (int32_t i = a + 1; i < b; i++) {
            int32_t r = lay->rep_rank[i];
            double t = jt->node_of_rank[r] == jt->node_of_rank[first] ? jt->grad_nv_s : jt->grad_net_s;
            per_rank[first] += t;
            per_rank[r] += t;
        }
    }
    double sum = 0;
    for (int32_t j = 0; j < jt->ep; j++) sum += per_rank[j];
    return sum / jt->ep;
}

/* ---- a fresh placement -------------------------------------------------------------- */

/* EPLB's two steps on this step's loads (apportion, then pack replicas onto ranks),
 * node-aware: when an EP group spans several nodes, also the hierarchical layout
 * (experts packed onto nodes first, replicas inside their node, where an extra
 * replica always finds a same-node source); the one the surrogate prefers is kept. */
rp_status joint_place_fresh(joint *jt, int32_t l, joint_layer *lay, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const int32_t E = jt->E, ep = jt->ep, gpn = jt->gpn, S = jt->S;
    const int64_t *el = rp_stats_expert_load(jt->stats, l);
    rp_status st = RP_OK;
    double *load = rp_alloc(ctx, (size_t)E * sizeof *load);
    double *rank_speed = rp_alloc(ctx, (size_t)ep * sizeof *rank_speed);
    int32_t *slots = rp_alloc(ctx, (size_t)ep * sizeof *slots);
    int32_t *begin = rp_alloc(ctx, ((size_t)ep + 1) * sizeof *begin);
    int32_t *counts = rp_alloc(ctx, (size_t)E * sizeof *counts);
    int32_t *best = rp_alloc(ctx, (size_t)S * sizeof *best + 1);
    double *scratch = jt->grp_hist ? rp_alloc(ctx, joint_place_scratch_doubles(jt) * sizeof *scratch) : NULL;
    if (!load || !rank_speed || !slots || !begin || !counts || !best || (jt->grp_hist && !scratch)) {
        st = rp_fail_nomem(err, "joint: placement");
        goto out;
    }
    int32_t max_rep = 0;
    for (int32_t e = 0; e < E; e++) load[e] = (double)el[e];
    for (int32_t j = 0; j < ep; j++) {
        slots[j] = jt->slot_begin[j + 1] - jt->slot_begin[j];
        max_rep += slots[j] > 0;
        /* one placement serves every group: a rank position is as fast as its slowest GPU */
        double v = INFINITY;
        for (int32_t q = 0; q < jt->Q; q++) v = gpu_speed(jt, q, j) < v ? gpu_speed(jt, q, j) : v;
        rank_speed[j] = v;
    }
    /* Candidates: every spare slot used (EPLB), or none (replicas cost a gradient
     * all-reduce each, which at small expert loads outweighs what they balance; a
     * middle count is not tried: the shares added later need replicas to work with,
     * which the even-split surrogate does not see); global packing, and hierarchical
     * when an EP group
     * spans nodes (experts packed onto nodes first, replicas inside their node, where
     * an extra replica always finds a same-node source). Without the per-(mb, group)
     * loads (the reference for mixing) only EPLB's choice is made. The surrogate's
     * expert time plus the replicas' gradient time decides. */
    const int32_t nodes = ep % gpn == 0 ? ep / gpn : 1;
    const int32_t spare = S - E < E * (max_rep - 1) ? S - E : E * (max_rep - 1);
    double best_v = INFINITY;
    int32_t found = 0;
    for (int32_t variant = 0; variant < 6; variant++) {
        int32_t budget = variant % 3 == 0 ? spare : 0;
        bool hier = variant >= 3;
        if (variant % 3 == 1) continue;
        if (variant % 3 == 2 && (!scratch || spare == 0)) continue;
        if (hier && (!scratch || nodes < 2 || E % nodes != 0)) continue;
        rp_place_input in = {.num_experts = E, .load = load, .num_gpus = ep, .slots = slots,
                             .speed = jt->uniform_speed ? NULL : rank_speed,
                             .mode = hier ? RP_PLACE_HIERARCHICAL : RP_PLACE_GLOBAL,
                             .gpus_per_node = gpn, .num_groups = E, .improve_rounds = 0};
        if (!hier || budget != spare) {
            /* explicit counts (hierarchical apportions inside nodes itself) */
            if (hier) continue;
            rp_status as = rp_replicas_apportion(ctx, load, E, E + budget, max_rep, counts, err);
            if (as != RP_OK) {
                st = as;
                goto out;
            }
            in.replicas = counts;
        }
        rp_error perr;
        rp_status ps = rp_place_replicas(ctx, &in, begin, lay->phy2log, NULL, &perr);
        if (ps == RP_ENOMEM) {
            st = rp_fail_nomem(err, "joint: placement");
            goto out;
        }
        if (ps != RP_OK) {
            if (variant == 0) { /* EPLB's own choice must place */
                st = ps;
                if (err) *err = perr;
                goto out;
            }
            continue; /* an infeasible alternative shape: skip it */
        }
        joint_layer_index(jt, lay);
        double v = 0;
        if (scratch)
            v = joint_place_score_ideal(jt, l, lay, scratch) + joint_layer_grad_s(jt, lay, scratch);
        if (!found || v < best_v) {
            best_v = v;
            memcpy(best, lay->phy2log, (size_t)S * sizeof *best);
        }
        found++;
    }
    memcpy(lay->phy2log, best, (size_t)S * sizeof *best);
    joint_layer_index(jt, lay);
out:
    rp_free(ctx, load);
    rp_free(ctx, rank_speed);
    rp_free(ctx, slots);
    rp_free(ctx, begin);
    rp_free(ctx, counts);
    rp_free(ctx, best);
    rp_free(ctx, scratch);
    return st;
}

/* ---- improvement ----------------------------------------------------------------- */

/* Per microbatch, the three ranks with the largest rmax (ties: lower rank), so that the
 * maximum over the ranks a change leaves alone is a lookup. */
static void top3(const joint *jt, const double *rmax, int32_t *top)
{
    const int32_t ep = jt->ep;
    for (int32_t m = 0; m < jt->M; m++) {
        const double *r = rmax + (size_t)m * ep;
        int32_t *t = top + (size_t)m * 3;
        t[0] = t[1] = t[2] = -1;
        for (int32_t j = 0; j < ep; j++) {
            if (t[0] < 0 || r[j] > r[t[0]]) {
                t[2] = t[1];
                t[1] = t[0];
                t[0] = j;
            } else if (t[1] < 0 || r[j] > r[t[1]]) {
                t[2] = t[1];
                t[1] = j;
            } else if (t[2] < 0 || r[j] > r[t[2]]) {
                t[2] = j;
            }
        }
    }
}

/* Value after a move or swap between ranks a and b: `d(m, q)` token-choices leave a for
 * b (replica counts unchanged, so no other rank changes). */
static double trial_pair(const joint *jt, const double *pr, const double *U, const double *rmax, const int32_t *top,
                         int32_t ra, int32_t rb, int32_t e, int32_t f)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    double sum = 0;
    for (int32_t m = 0; m < M; m++) {
        double other = 0;
        const int32_t *t = top + (size_t)m * 3;
        for (int k = 0; k < 3; k++)
            if (t[k] >= 0 && t[k] != ra && t[k] != rb) {
                other = rmax[(size_t)m * ep + t[k]];
                break;
            }
        double na = 0, nb = 0;
        for (int32_t q = 0; q < Q; q++) {
            const double *w = pr + ((size_t)m * Q + q) * E;
            double d = w[e] - (f >= 0 ? w[f] : 0.0);
            const double *u = U + ((size_t)m * Q + q) * ep;
            double xa = joint_per_speed(jt, u[ra] - d, q, ra), xb = joint_per_speed(jt, u[rb] + d, q, rb);
            na = xa > na ? xa : na;
            nb = xb > nb ? xb : nb;
        }
        double best = other > na ? other : na;
        sum += joint_mb_value(jt, m, best > nb ? best : nb);
    }
    return sum;
}

/* Per (microbatch, group), the three ranks with the largest U / speed (ties: lower
 * rank): the group form's lookup of the maximum over the ranks a change leaves alone. */
static void top3_groups(const joint *jt, const double *U, int32_t *top)
{
    const int32_t ep = jt->ep, Q = jt->Q;
    for (int32_t m = 0; m < jt->M; m++)
        for (int32_t q = 0; q < Q; q++) {
            const double *u = U + ((size_t)m * Q + q) * ep;
            int32_t *t = top + ((size_t)m * Q + q) * 3;
            double v[3] = {-1, -1, -1};
            t[0] = t[1] = t[2] = -1;
            for (int32_t j = 0; j < ep; j++) {
                double x = joint_per_speed(jt, u[j], q, j);
                if (x > v[0]) {
                    t[2] = t[1], v[2] = v[1];
                    t[1] = t[0], v[1] = v[0];
                    t[0] = j, v[0] = x;
                } else if (x > v[1]) {
                    t[2] = t[1], v[2] = v[1];
                    t[1] = j, v[1] = x;
                } else if (x > v[2]) {
                    t[2] = j, v[2] = x;
                }
            }
        }
}

/* trial_pair in the group form: every group's own sum, the slowest group's. */
static double trial_pair_group(const joint *jt, const double *pr, const double *U, const int32_t *top, int32_t ra,
                               int32_t rb, int32_t e, int32_t f)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    double worst = 0;
    for (int32_t q = 0; q < Q; q++) {
        double sum = 0;
        for (int32_t m = 0; m < M; m++) {
            const double *u = U + ((size_t)m * Q + q) * ep;
            const int32_t *t = top + ((size_t)m * Q + q) * 3;
            double best = 0;
            for (int k = 0; k < 3; k++)
                if (t[k] >= 0 && t[k] != ra && t[k] != rb) {
                    best = joint_per_speed(jt, u[t[k]], q, t[k]);
                    break;
                }
            const double *w = pr + ((size_t)m * Q + q) * E;
            double d = w[e] - (f >= 0 ? w[f] : 0.0);
            double xa = joint_per_speed(jt, u[ra] - d, q, ra), xb = joint_per_speed(jt, u[rb] + d, q, rb);
            best = xa > best ? xa : best;
            best = xb > best ? xb : best;
            sum += joint_mq_value(jt, m, q, best);
        }
        worst = sum > worst ? sum : worst;
    }
    return worst;
}

/* Value after slot `b` (on rank rb, holding f with several replicas) is given to
 * another replica of e: every rank holding e or f changes. */
static double trial_replace(const joint *jt, int32_t l, const joint_layer *lay, const double *pr, const double *U,
                            const double *rmax, int32_t rb, int32_t e, int32_t f, double *row, double *gsum)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    const int32_t Re = lay->rep_off[e + 1] - lay->rep_off[e], Rf = lay->rep_off[f + 1] - lay->rep_off[f];
    double sum = 0;
    for (int32_t q = 0; q < Q; q++) gsum[q] = 0;
    for (int32_t m = 0; m < M; m++) {
        /* row: the (q, j) loads of the changed ranks, rebuilt from U */
        double *u2 = row;
        memcpy(u2, U + (size_t)m * Q * ep, (size_t)Q * ep * sizeof *u2);
        for (int32_t q = 0; q < Q; q++) {
            const int64_t *h = grp_row(jt, m, q, l);
            double *u = u2 + (size_t)q * ep;
            const double *w = pr + ((size_t)m * Q + q) * E;
            double we_old = w[e], we_new = (double)h[e] / (Re + 1);
            double wf_old = w[f], wf_new = Rf > 1 ? per_replica_load(h[f], Rf - 1) : 0.0;
            for (int32_t i = lay->rep_off[e]; i < lay->rep_off[e + 1]; i++) u[lay->rep_rank[i]] += we_new - we_old;
            for (int32_t i = lay->rep_off[f]; i < lay->rep_off[f + 1]; i++) {
                int32_t r = lay->rep_rank[i];
                u[r] += r == rb ? -wf_old : wf_new - wf_old;
            }
            u[rb] += we_new;
        }
        if (jt->group_form) { /* each group's own busiest rank, changed or not */
            for (int32_t q = 0; q < Q; q++) {
                double best = 0;
                for (int32_t j = 0; j < ep; j++) {
                    double v = joint_per_speed(jt, u2[(size_t)q * ep + j], q, j);
                    best = v > best ? v : best;
                }
                gsum[q] += joint_mq_value(jt, m, q, best);
            }
            continue;
        }
        double best = 0;
        for (int32_t j = 0; j < ep; j++) {
            bool changed = j == rb;
            for (int32_t i = lay->rep_off[e]; i < lay->rep_off[e + 1] && !changed; i++) changed = lay->rep_rank[i] == j;
            for (int32_t i = lay->rep_off[f]; i < lay->rep_off[f + 1] && !changed; i++) changed = lay->rep_rank[i] == j;
            double x = 0;
            if (!changed) x = rmax[(size_t)m * ep + j];
            else
                for (int32_t q = 0; q < Q; q++) {
                    double v = joint_per_speed(jt, u2[(size_t)q * ep + j], q, j);
                    x = v > x ? v : x;
                }
            best = x > best ? x : best;
        }
        sum += joint_mb_value(jt, m, best);
    }
    if (jt->group_form)
        for (int32_t q = 0; q < Q; q++) sum = gsum[q] > sum ? gsum[q] : sum;
    return sum;
}

/* Replicas an EP rank holds that the anchor did not have there. */
static int32_t new_pairs(const joint *jt, const joint_layer *lay, const unsigned char *held)
{
    if (!held) return 0;
    int32_t n = 0;
    for (int32_t j = 0; j < jt->ep; j++)
        for (int32_t s = jt->slot_begin[j]; s < jt->slot_begin[j + 1]; s++)
            if (lay->phy2log[s] >= 0 && !held[(size_t)j * jt->E + lay->phy2log[s]]) n++;
    return n;
}

/* Change in new_pairs when slot on rank j goes from expert y to x. */
static int32_t pair_delta(const joint *jt, const unsigned char *held, int32_t j, int32_t y, int32_t x)
{
    if (!held) return 0;
    return (x >= 0 && !held[(size_t)j * jt->E + x]) - (y >= 0 && !held[(size_t)j * jt->E + y]);
}

/* The search's per-replica loads, pr[(m * Q + q) * E + e] = per_replica_load of expert e
 * at (m, q) under the layout's replica counts, for experts [e0, e1): divided once, not in
 * every trial and column the search computes from them. */
static void replica_loads(const joint *jt, int32_t l, const joint_layer *lay, int32_t e0, int32_t e1, double *pr)
{
    const int32_t Q = jt->Q, E = jt->E;
    for (int32_t m = 0; m < jt->M; m++)
        for (int32_t q = 0; q < Q; q++) {
            const int64_t *h = grp_row(jt, m, q, l);
            double *w = pr + ((size_t)m * Q + q) * E;
            for (int32_t e = e0; e < e1; e++) w[e] = per_replica_load(h[e], lay->rep_off[e + 1] - lay->rep_off[e]);
        }
}

/* Rank j's column of U (every (mb, group)) recomputed from the layout: its experts in
 * ascending id, each adding its load over its replica count, the very additions
 * layer_loads makes to it, so the column comes out bit for bit as a full pass would
 * give it (the experts with no load add +0.0, which leaves a sum of nonnegative loads
 * as it is). `experts` is scratch of the rank's slot count. */
static void rank_loads(const joint *jt, const double *pr, int32_t j, const joint_layer *lay, double *U,
                       int32_t *experts)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    int32_t n = 0;
    for (int32_t s = jt->slot_begin[j]; s < jt->slot_begin[j + 1]; s++) {
        int32_t e = lay->phy2log[s], k = n++;
        if (e < 0) {
            n--;
            continue;
        }
        while (k > 0 && experts[k - 1] > e) {
            experts[k] = experts[k - 1];
            k--;
        }
        experts[k] = e;
    }
    for (int32_t m = 0; m < M; m++)
        for (int32_t q = 0; q < Q; q++) {
            const double *w = pr + ((size_t)m * Q + q) * E;
            double u = 0.0;
            for (int32_t k = 0; k < n; k++) u += w[experts[k]];
            U[((size_t)m * Q + q) * ep + j] = u;
        }
}

/* Rounds of best improvement. The hottest rank is the one whose load, summed over
 * microbatches (its largest over groups), is largest; the cool rank the one with the
 * least. Candidates: each replica of the hottest rank moves to a free slot of the cool
 * rank, or swaps with the cool rank's replica whose aggregate load best halves the
 * gap; and the two heaviest replicas of the hottest rank each take, as an extra
 * replica, the slot of the lightest replica of an expert that has several (a change of
 * replica counts). Each round applies the best candidate if it lowers
 * value + copy_penalty x (replicas an EP rank holds that the anchor had not). */
rp_status joint_place_improve(joint *jt, int32_t l, joint_layer *lay, const joint_layer *anchor,
                              double copy_penalty, int32_t rounds, double *scratch, double *first_s,
                              double *final_s, rp_error *err)
{
    const int32_t M = jt->M, Q = jt->Q, ep = jt->ep, E = jt->E;
    if (ep < 2 || rounds <= 0) {
        if (first_s || final_s) {
            double v = joint_place_score(jt, l, lay, scratch);
            if (first_s) *first_s = v;
            if (final_s) *final_s = v;
        }
        return RP_OK;
    }
    double *U = scratch, *rmax = U + (size_t)M * Q * ep;
    double *row = rmax + (size_t)M * ep, *per_replica = row + (size_t)Q * ep;
    double *gm = scratch_gm(jt, scratch), *gsum = gm + (size_t)M * Q;
    int32_t top[3 * 64], *topv = top;
    int32_t *topa = NULL;
    unsigned char *held = NULL;
    /* per expert: its load summed over (mb, group), and behind it the per-replica loads
     * (replica_loads); per (rank, expert): held (rank_has as a lookup); a rank's experts
     * (rank_loads); the ranks a change touches */
    double *expert_sum = rp_alloc(jt->ctx, ((size_t)E + (size_t)M * Q * E) * sizeof *expert_sum);
    double *pr = expert_sum ? expert_sum + E : NULL; /* [M * Q * E]; set in round 0 */
    unsigned char *holds = rp_alloc(jt->ctx, (size_t)ep * E);
    int32_t *list = rp_alloc(jt->ctx, ((size_t)jt->S + 1) * sizeof *list);
    unsigned char *changed = rp_alloc(jt->ctx, (size_t)ep);
    if (!expert_sum || !holds || !list || !changed) {
        rp_free(jt->ctx, expert_sum);
        rp_free(jt->ctx, holds);
        rp_free(jt->ctx, list);
        rp_free(jt->ctx, changed);
        return rp_fail_nomem(err, "joint: placement search");
    }
    /* row by row (a column read strides L x E loads between rows); each expert's sum
     * still adds in (m, q) order */
    for (int32_t e = 0; e < E; e++) expert_sum[e] = 0;
    for (int32_t m = 0; m < M; m++)
        for (int32_t q = 0; q < Q; q++) {
            const int64_t *h = grp_row(jt, m, q, l);
            for (int32_t e = 0; e < E; e++) expert_sum[e] += h[e];
        }
    memset(holds, 0, (size_t)ep * E);
    for (int32_t s = 0; s < jt->S; s++)
        if (lay->phy2log[s] >= 0) holds[(size_t)jt->slot_rank[s] * E + lay->phy2log[s]] = 1;
    /* the group form keeps three ranks per (mb, group), the global one per mb */
    const size_t top_rows = jt->group_form ? (size_t)M * Q : (size_t)M;
    if (top_rows > 64) {
        topa = rp_alloc(jt->ctx, top_rows * 3 * sizeof *topa);
        if (!topa) {
            rp_free(jt->ctx, expert_sum);
            rp_free(jt->ctx, holds);
            rp_free(jt->ctx, list);
            rp_free(jt->ctx, changed);
            return rp_fail_nomem(err, "joint: placement search");
        }
        topv = topa;
    }
    if (anchor) {
        held = rp_calloc(jt->ctx, (size_t)ep * E, 1);
        if (!held) {
            rp_free(jt->ctx, topa);
            rp_free(jt->ctx, expert_sum);
            rp_free(jt->ctx, holds);
            rp_free(jt->ctx, list);
            rp_free(jt->ctx, changed);
            return rp_fail_nomem(err, "joint: placement search");
        }
        for (int32_t j = 0; j < ep; j++)
            for (int32_t s = jt->slot_begin[j]; s < jt->slot_begin[j + 1]; s++)
                if (anchor->phy2log[s] >= 0) held[(size_t)j * E + anchor->phy2log[s]] = 1;
    }
    const double pen = copy_penalty; /* values are step seconds */
    double last_value = 0; /* the score of the layout as the last round found it */
    bool scored = false;   /* ... and nothing has moved since */
    for (int32_t round = 0; round < rounds; round++) {
        if (round == 0) { /* later rounds: kept current below */
            replica_loads(jt, l, lay, 0, E, pr);
            /* rank by rank: each sum in a register, where layer_loads' scatter into U
             * chains every add of a rank through memory (a quarter of the search) */
            for (int32_t j = 0; j < ep; j++) rank_loads(jt, pr, j, lay, U, list);
        }
        rank_maxima(jt, U, rmax);
        int32_t crit = -1; /* group form: the group whose sum sets the value */
        double value;
        if (jt->group_form) {
            group_maxima(jt, U, gm);
            top3_groups(jt, U, topv);
            double worst = -1;
            for (int32_t q = 0; q < Q; q++) {
                double sum = 0;
                for (int32_t m = 0; m < M; m++) sum += joint_mq_value(jt, m, q, gm[(size_t)m * Q + q]);
                if (sum > worst) worst = sum, crit = q;
            }
            value = worst;
        } else {
            top3(jt, rmax, topv);
            value = total_value(jt, rmax);
        }
        /* the same sums and maxima as joint_place_score's over the same loads */
        if (round == 0 && first_s) *first_s = value;
        last_value = value;
        scored = true;
        const int32_t pairs = new_pairs(jt, lay, held);
        value += pen * pairs;
        const double grad_now = joint_layer_grad_s(jt, lay, row);
        for (int32_t e = 0; e < E; e++) {
            int32_t R = lay->rep_off[e + 1] - lay->rep_off[e];
            per_replica[e] = R > 0 ? expert_sum[e] / R : 0.0;
        }
        int32_t hot = 0, jc = -1;
        double heat_hot = -1, heat_cool = INFINITY;
        for (int32_t j = 0; j < ep; j++) {
            /* heat: the rank's load summed over microbatches, its largest over groups, or
             * in the group form its load in the critical group */
            double h = 0;
            for (int32_t m = 0; m < M; m++)
                h += crit >= 0 ? joint_per_speed(jt, U[((size_t)m * Q + crit) * ep + j], crit, j) : rmax[(size_t)m * ep + j];
            if (h > heat_hot) {
                heat_hot = h;
                hot = j;
            }
            if (h < heat_cool) {
                heat_cool = h;
                jc = j;
            }
        }
        int32_t ba = -1, bxa = -1, bb = -1, bxb = -1; /* best: slot a gets xa, slot b gets xb */
        double best_v = value - 1e-9 * (value > 0 ? value : 1.0);
        /* moves and swaps with the coolest rank only: the second coolest too (twice the
         * trials, a fifth of the construction at the reference scale) shortened the frozen
         * batches' step by 0.024% in sum */
        if (jc >= 0 && jc != hot) {
            /* heat is per group (largest over groups); per_replica sums over groups */
            double gap = (heat_hot - heat_cool) * Q;
            for (int32_t a = jt->slot_begin[hot]; a < jt->slot_begin[hot + 1]; a++) {
                int32_t e = lay->phy2log[a];
                if (e < 0 || holds[(size_t)jc * E + e]) continue;
                /* partner: a free slot, or the replica whose swap moves closest to half the gap */
                int32_t pb = -1;
                double pd = INFINITY;
                for (int32_t b = jt->slot_begin[jc]; b < jt->slot_begin[jc + 1]; b++) {
                    int32_t f = lay->phy2log[b];
                    if (f >= 0 && holds[(size_t)hot * E + f]) continue;
                    double moved = per_replica[e] - (f >= 0 ? per_replica[f] : 0.0);
                    if (moved <= 0) continue;
                    double d = fabs(moved - gap / 2);
                    if (d < pd) {
                        pd = d;
                        pb = b;
                    }
                }
                if (pb < 0) continue;
                int32_t f = lay->phy2log[pb];
                double v = jt->group_form ? trial_pair_group(jt, pr, U, topv, hot, jc, e, f)
                                          : trial_pair(jt, pr, U, rmax, topv, hot, jc, e, f);
                v += pen * (pairs + pair_delta(jt, held, hot, e, f) + pair_delta(jt, held, jc, f, e));
                if (v < best_v) {
                    best_v = v;
                    ba = a, bxa = f, bb = pb, bxb = e;
                }
            }
        }
        /* replica re-assignment: the hottest rank's two heaviest experts */
        int32_t heavy[2] = {-1, -1};
        for (int32_t a = jt->slot_begin[hot]; a < jt->slot_begin[hot + 1]; a++) {
            int32_t e = lay->phy2log[a];
            if (e < 0) continue;
            if (heavy[0] < 0 || per_replica[e] > per_replica[heavy[0]]) {
                heavy[1] = heavy[0];
                heavy[0] = e;
            } else if (heavy[1] < 0 || per_replica[e] > per_replica[heavy[1]]) {
                heavy[1] = e;
            }
        }
        for (int32_t k = 0; k < 2; k++) {
            int32_t e = heavy[k];
            if (e < 0) continue;
            int32_t pb = -1;
            for (int32_t b = 0; b < jt->S; b++) {
                int32_t f = lay->phy2log[b];
                if (f < 0 || f == e || lay->rep_off[f + 1] - lay->rep_off[f] < 2) continue;
                if (holds[(size_t)jt->slot_rank[b] * E + e]) continue;
                if (pb < 0 || per_replica[f] < per_replica[lay->phy2log[pb]]) pb = b;
            }
            if (pb < 0) continue;
            int32_t f = lay->phy2log[pb], rb = jt->slot_rank[pb];
            double v = trial_replace(jt, l, lay, pr, U, rmax, rb, e, f, row, gsum);
            v += pen * (pairs + pair_delta(jt, held, rb, f, e));
            /* replica counts change: so does the gradient all-reduce they add */
            lay->phy2log[pb] = e;
            joint_layer_index(jt, lay);
            double grad_new = joint_layer_grad_s(jt, lay, row);
            lay->phy2log[pb] = f;
            joint_layer_index(jt, lay);
            v += grad_new - grad_now; /* step seconds, as the values */
            if (v < best_v) {
                best_v = v;
                ba = pb, bxa = e, bb = -1, bxb = -1;
            }
        }
        if (ba < 0) break;
        /* the ranks whose loads change: the two of a move or swap; for a re-assignment
         * (replica counts change) every holder of either expert */
        memset(changed, 0, (size_t)ep);
        int32_t was_a = lay->phy2log[ba];
        changed[jt->slot_rank[ba]] = 1;
        if (bb >= 0) changed[jt->slot_rank[bb]] = 1;
        else
            for (int32_t k = 0; k < 2; k++) {
                int32_t x = k ? was_a : bxa;
                for (int32_t i = lay->rep_off[x]; i < lay->rep_off[x + 1]; i++) changed[lay->rep_rank[i]] = 1;
            }
        /* slot a always held an expert; slot b (a move's target) may be free, and a
         * move leaves slot a free */
        holds[(size_t)jt->slot_rank[ba] * E + was_a] = 0;
        if (bb >= 0 && lay->phy2log[bb] >= 0) holds[(size_t)jt->slot_rank[bb] * E + lay->phy2log[bb]] = 0;
        lay->phy2log[ba] = bxa;
        if (bb >= 0) lay->phy2log[bb] = bxb;
        if (bxa >= 0) holds[(size_t)jt->slot_rank[ba] * E + bxa] = 1;
        if (bb >= 0) holds[(size_t)jt->slot_rank[bb] * E + bxb] = 1;
        joint_layer_index(jt, lay);
        if (bb < 0) { /* a re-assignment: two experts' replica counts changed */
            replica_loads(jt, l, lay, was_a, was_a + 1, pr);
            replica_loads(jt, l, lay, bxa, bxa + 1, pr);
        }
        for (int32_t j = 0; j < ep; j++)
            if (changed[j]) rank_loads(jt, pr, j, lay, U, list);
        scored = false;
    }
    /* the last round moved something: score the loads it left (kept current) */
    if (final_s) *final_s = scored ? last_value : loads_score(jt, scratch);
    rp_free(jt->ctx, topa);
    rp_free(jt->ctx, held);
    rp_free(jt->ctx, expert_sum);
    rp_free(jt->ctx, holds);
    rp_free(jt->ctx, list);
    rp_free(jt->ctx, changed);
    return RP_OK;
}
