/* Sequence lengths for the synthetic batch generator: constant, log-normal or drawn
 * from a real trace's column, scaled, rounded and clamped to [1, cap]. */
#include "gen_internal.h"

#include <math.h>

/* The raw draw before scaling. */
static double draw_raw(const gen_lengths *d, gen_rng *rng)
{
    switch (d->kind) {
    case GEN_LEN_CONSTANT: return (double)d->constant;
    case GEN_LEN_LOGNORMAL: return d->median * exp(d->sigma * gen_normal(rng));
    case GEN_LEN_EMPIRICAL: return (double)d->values[gen_below(rng, (uint32_t)d->num_values)];
    }
    return 1.0;
}

/* Rounding is half away from zero, so a draw x lands on the cap exactly when
 * x >= cap - 1/2; that threshold is what gen_lengths_clip_mass integrates. */
static int32_t round_clamp(double x, int32_t cap)
{
    if (!(x < (double)cap - 0.5)) return cap; /* also NaN and inf */
    double r = round(x);
    return r < 1.0 ? 1 : (int32_t)r;
}

int32_t gen_lengths_draw(const gen_lengths *d, gen_rng *rng)
{
    return round_clamp(d->scale * draw_raw(d, rng), d->cap);
}

double gen_lengths_clip_mass(const gen_lengths *d)
{
    double threshold = (double)d->cap - 0.5;
    switch (d->kind) {
    case GEN_LEN_CONSTANT:
        return d->scale * d->constant >= threshold ? 1.0 : 0.0;
    case GEN_LEN_LOGNORMAL: {
        double m = d->scale * d->median;
        if (d->sigma == 0.0) return m >= threshold ? 1.0 : 0.0;
        double z = log(threshold / m) / d->sigma;
        return 0.5 * erfc(z / sqrt(2.0));
    }
    case GEN_LEN_EMPIRICAL: {
        int64_t n = 0;
        for (int32_t i = 0; i < d->num_values; i++)
            if (d->scale * d->values[i] >= threshold) n++;
        return d->num_values ? (double)n / d->num_values : 0.0;
    }
    }
    return 0.0;
}

void gen_lengths_free(rp_context *ctx, gen_lengths *d)
{
    if (!d) return;
    rp_free(ctx, d->values);
    d->values = NULL;
    d->num_values = 0;
}
