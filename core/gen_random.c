/* Random variates for the synthetic batch generator: normal and gamma draws and
 * Walker/Vose alias tables, all driven by the explicit streams of gen_internal.h. */
#include "gen_internal.h"

#include <math.h>

/* Marsaglia's polar method. The second variate is dropped so that a stream's state
 * is all there is to it (nothing cached between calls). */
double gen_normal(gen_rng *r)
{
    for (;;) {
        double u = 2.0 * gen_uniform(r) - 1.0;
        double v = 2.0 * gen_uniform(r) - 1.0;
        double s = u * u + v * v;
        if (s > 0.0 && s < 1.0) return u * sqrt(-2.0 * log(s) / s);
    }
}

/* Marsaglia and Tsang (2000), with their boost for shape < 1: G(a) = G(a + 1) U^(1/a),
 * kept in logs because U^(1/a) underflows for small a. */
double gen_log_gamma(gen_rng *r, double shape)
{
    double boost = 0.0;
    if (shape < 1.0) {
        boost = log(gen_uniform_pos(r)) / shape;
        shape += 1.0;
    }
    double d = shape - 1.0 / 3.0;
    double c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x, v;
        do {
            x = gen_normal(r);
            v = 1.0 + c * x;
        } while (v <= 0.0);
        v = v * v * v;
        double u = gen_uniform_pos(r);
        double x2 = x * x;
        if (u < 1.0 - 0.0331 * x2 * x2 || log(u) < 0.5 * x2 + d * (1.0 - v + log(v)))
            return log(d * v) + boost;
    }
}

void gen_alias_build(const double *weights, uint32_t n, const uint16_t *ids, uint64_t *table,
                     void *work)
{
    int32_t *small = work;
    int32_t *large = small + n;
    double *p = (double *)(void *)(large + n);
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) sum += weights[i];
    double scale = (double)n / sum;
    uint32_t ns = 0, nl = 0;
    for (uint32_t i = 0; i < n; i++) {
        p[i] = weights[i] * scale;
        if (p[i] < 1.0) small[ns++] = (int32_t)i;
        else large[nl++] = (int32_t)i;
    }
#define OUTCOME(i) ((uint64_t)(ids ? ids[i] : (uint16_t)(i)))
#define ENTRY(i, threshold, other) ((uint64_t)(threshold) | OUTCOME(i) << 32 | OUTCOME(other) << 48)
    while (ns > 0 && nl > 0) {
        int32_t s = small[--ns];
        int32_t l = large[nl - 1];
        double t = p[s] * 4294967296.0;
        table[s] = ENTRY(s, t >= 4294967295.0 ? UINT32_MAX : (uint32_t)t, l);
        p[l] = (p[l] + p[s]) - 1.0;
        if (p[l] < 1.0) {
            nl--;
            small[ns++] = l;
        }
    }
    /* What is left is 1 up to rounding: always accept, alias to itself. */
    while (nl > 0) {
        int32_t l = large[--nl];
        table[l] = ENTRY(l, UINT32_MAX, l);
    }
    while (ns > 0) {
        int32_t s = small[--ns];
        table[s] = ENTRY(s, UINT32_MAX, s);
    }
#undef ENTRY
#undef OUTCOME
}
