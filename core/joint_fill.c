/* The water level of the shares' min-max fill (joint_levers.c): the level 28 halvings of
 * [lo, hi] reach, found with a handful of evaluations by Newton's method on the
 * piecewise-linear fill (docs/routepack-policy.md, "Shares and extra replicas"). */
#include "joint_internal.h"

#include <math.h>

/* F(h) = sum over the ranks of s_i(h), s_i(h) = min over the lines with slope > 0 of
 * slope * h - offset, clamped to [0, 1]; *deriv gets F's slope at h (the slopes of the
 * unclamped ranks' lowest lines). The computed F is nondecreasing in h: every operation
 * in it (a product, a difference, a minimum, a clamp, a sum of nonnegative terms) rounds
 * monotonically. */
static double fill_sum(const double *slope, const double *offset, int32_t R, int32_t Q, double h, double *deriv)
{
    double sum = 0, d = 0;
    for (int32_t i = 0; i < R; i++) {
        double s = INFINITY, k_at = 0;
        for (int32_t q = 0; q < Q; q++) {
            double k = slope[(size_t)i * Q + q];
            if (k == 0) continue;
            double v = k * h - offset[(size_t)i * Q + q];
            if (v < s) s = v, k_at = k;
        }
        if (s >= 1) {
            sum += 1;
        } else if (s > 0) {
            sum += s;
            d += k_at;
        }
    }
    *deriv = d;
    return sum;
}

/* The bisection's answer is fixed by the side of 1 on which F falls at each of its 28
 * midpoints. F is piecewise linear and continuous, so Newton's method (kept inside the
 * bracket) finds its root in a few evaluations, and each evaluation at h settles the side
 * at every point below h (F(h) < 1) or above it (F(h) >= 1), by monotonicity. Two more
 * evaluations just around the root bracket it within a quarter of the last halving's
 * step; the halvings are then replayed from these facts, evaluating F only at the
 * midpoints they leave open. The result is the bisection's, bit for bit. */
double joint_fill_level(const double *slope, const double *offset, int32_t R, int32_t Q, double lo, double hi,
                        int64_t *evaluations)
{
    const double delta = 0x1p-30 * (hi - lo);
    int64_t evals = 0;
    /* below: the largest h evaluated with F(h) < 1; above: the least with F(h) >= 1 */
    double below = -INFINITY, above = INFINITY, d;
    double a = lo, b = hi, h = 0.5 * (lo + hi);
    bool root = false;
    for (int it = 0; it < 16 && b - a > 2 * delta; it++) {
        double f = fill_sum(slope, offset, R, Q, h, &d);
        evals++;
        if (f >= 1) {
            above = h < above ? h : above;
            b = h;
        } else {
            below = h > below ? h : below;
            a = h;
        }
        if ((root = fabs(f - 1) <= 1e-12)) break;
        double next = d > 0 ? h + (1 - f) / d : NAN;
        /* F may exceed 1 right above lo (ranks far below the highest base each take all
         * there): then the halvings end next to lo; probe just above it */
        if (next <= a && below == -INFINITY) next = a + delta;
        h = next > a && next < b ? next : 0.5 * (a + b);
    }
    for (int side = 0; root && side < 2; side++) {
        double x = side ? h + delta : h - delta;
        if (!(x > below && x < above)) continue;
        evals++;
        if (fill_sum(slope, offset, R, Q, x, &d) >= 1) above = x;
        else below = x;
    }
    for (int it = 0; it < 28; it++) { /* 2^-28 of the range: far below what matters */
        double mid = 0.5 * (lo + hi);
        bool ge;
        if (mid <= below) {
            ge = false;
        } else if (mid >= above) {
            ge = true;
        } else {
            ge = fill_sum(slope, offset, R, Q, mid, &d) >= 1;
            evals++;
            if (ge) above = mid;
            else below = mid;
        }
        if (ge) hi = mid;
        else lo = mid;
    }
    if (evaluations) *evaluations += evals;
    return hi;
}
