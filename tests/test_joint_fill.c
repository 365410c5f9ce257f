/* The shares' water level (core/joint_fill.c): on random fills of every shape the
 * minmax fill meets (ranks far below the highest base, groups without tokens, uneven
 * speeds, flats where one rank takes everything), the level is the plain 28-halving
 * bisection's bit for bit, from a few evaluations of the fill instead of 28. */
#include "joint_internal.h"
#include "tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x243F6A8885A308D3ULL;
static double uniform01(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

/* The bisection joint_fill_level stands for, as the shares' fill ran it before. */
static double bisect(const double *slope, const double *offset, int32_t R, int32_t Q, double lo, double hi)
{
    for (int it = 0; it < 28; it++) {
        double h = 0.5 * (lo + hi), sum = 0;
        for (int32_t i = 0; i < R; i++) {
            double s = INFINITY;
            for (int32_t q = 0; q < Q; q++) {
                double k = slope[(size_t)i * Q + q];
                if (k == 0) continue;
                double v = k * h - offset[(size_t)i * Q + q];
                s = v < s ? v : s;
            }
            sum += s > 0 ? (s < 1 ? s : 1) : 0;
        }
        if (sum >= 1) hi = h;
        else lo = h;
    }
    return hi;
}

enum { MAX_R = 9, MAX_Q = 8 };

/* One fill as the levers build it: rank i's load without the expert in group q, the
 * expert's token-choices tq[q] per group, GPU speeds; `kind` shapes the case. */
static bool make_fill(int kind, int32_t R, int32_t Q, double *slope, double *offset, double *lo, double *hi)
{
    double base[MAX_Q][MAX_R], tq[MAX_Q], sp[MAX_Q][MAX_R];
    for (int32_t q = 0; q < Q; q++) {
        tq[q] = kind == 1 && q % 3 == 0 ? 0.0 : floor(1 + 5000 * uniform01());
        for (int32_t i = 0; i < R; i++) {
            base[q][i] = floor(20000 * uniform01());
            if (kind == 2 && i > 0) base[q][i] = floor(100 * uniform01()); /* far below rank 0 */
            if (kind == 4) base[q][i] = i == 0 ? 0.0 : 1e6;                 /* rank 0 takes it all */
            sp[q][i] = kind == 3 ? 0.5 + uniform01() : 1.0;
        }
        if (kind == 5) tq[q] = 777; /* equal in every group */
    }
    *lo = *hi = 0;
    for (int32_t i = 0; i < R; i++)
        for (int32_t q = 0; q < Q; q++) {
            double b = base[q][i], all = b + tq[q] / sp[q][i];
            *lo = b > *lo ? b : *lo;
            *hi = all > *hi ? all : *hi;
            double k = tq[q] > 0 ? sp[q][i] / tq[q] : 0.0;
            slope[(size_t)i * Q + q] = k;
            offset[(size_t)i * Q + q] = b * k;
        }
    return *hi > *lo;
}

int main(void)
{
    static const char *const kinds[] = {"random", "groups without tokens", "ranks far below the highest base",
                                        "uneven speeds", "one rank takes everything", "equal tokens per group"};
    double slope[MAX_R * MAX_Q], offset[MAX_R * MAX_Q];
    for (int kind = 0; kind < 6; kind++) {
        int64_t evaluations = 0, fills = 0, differ = 0;
        for (int n = 0; n < 4000; n++) {
            int32_t R = 2 + (int32_t)(uniform01() * (MAX_R - 1)), Q = 1 + (int32_t)(uniform01() * MAX_Q);
            double lo, hi;
            if (!make_fill(kind, R, Q, slope, offset, &lo, &hi)) continue;
            double want = bisect(slope, offset, R, Q, lo, hi);
            double got = joint_fill_level(slope, offset, R, Q, lo, hi, &evaluations);
            if (memcmp(&want, &got, sizeof got) != 0) {
                if (!differ) diag("%s: R %d Q %d: %.17g, the bisection %.17g", kinds[kind], R, Q, got, want);
                differ++;
            }
            fills++;
        }
        ok(fills > 3000 && differ == 0, "%s: the level is the bisection's on %lld fills of %lld", kinds[kind],
           (long long)(fills - differ), (long long)fills);
        /* the point of it: about a quarter of the bisection's 28 evaluations, or less */
        ok(evaluations <= 8 * fills, "%s: %.2f evaluations of the fill per level (the bisection: 28)", kinds[kind],
           fills ? (double)evaluations / fills : 0.0);
    }
    int64_t none = 0;
    double one[2] = {1.0, 1.0}, zero[2] = {0.0, 0.0};
    double level = joint_fill_level(one, zero, 2, 1, 0.25, 1.0, &none);
    ok(level == bisect(one, zero, 2, 1, 0.25, 1.0) && fabs(level - 0.5) < 1e-8,
       "two equal ranks from zero meet at half the expert each (level %.10g)", level);
    return tap_done();
}
