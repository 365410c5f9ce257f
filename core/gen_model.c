/* The generator's routing model, built once from the counts file: the mapping of the
 * recorded layers and experts onto the shape to generate, the Plackett-Luce weights
 * calibrated so that top-k sampling reproduces the recorded loads, and the cross-layer
 * couplings fitted to the recorded pair counts. The method is in docs/gen.md. */
#include "gen_internal.h"

#include <math.h>
#include <string.h>

/* ---- Plackett-Luce inclusion probabilities -------------------------------------------
 * Drawing k experts without replacement, each time proportionally to w among those
 * left, is an exponential race: expert j arrives at T_j ~ Exp(w_j) and the first k
 * arrivals are taken. So
 *     pi_e = integral_0^inf w_e exp(-w_e u) P(fewer than k others arrived by u) du,
 * where the others arrive by u independently with q_j(u) = 1 - exp(-w_j u): a
 * Poisson-binomial tail, computed for all e at once with prefix and suffix count
 * distributions truncated at k (O(n k) a node, no unstable deconvolution). The
 * integral runs on Gauss-Legendre panels in log u around the median k-th arrival. */

#define GL_NODES 8
static const double gl_x[GL_NODES] = {-0.9602898564975363, -0.7966664774136267, -0.5255324099163290,
                                      -0.1834346424956498, 0.1834346424956498,  0.5255324099163290,
                                      0.7966664774136267,  0.9602898564975363};
static const double gl_w[GL_NODES] = {0.1012285362903763, 0.2223810344533745, 0.3137066458778873,
                                      0.3626837833783620, 0.3626837833783620, 0.3137066458778873,
                                      0.2223810344533745, 0.1012285362903763};
#define LOG_PANELS 40

typedef struct pl_work {
    double *w;      /* [n] normalized weights */
    double *q;      /* [n] */
    double *prefix; /* [n x k] */
    double *loo;    /* [n] P(fewer than k of the others) */
    double suffix[GEN_MAX_TOP_K], cum[GEN_MAX_TOP_K];
} pl_work;

/* Expected arrivals by u. */
static double arrivals(const double *w, int32_t n, double u)
{
    double s = 0;
    for (int32_t j = 0; j < n; j++) s += -expm1(-w[j] * u);
    return s;
}

/* P(fewer than k arrivals by u) of everyone (returned) and, per e, of everyone else. */
static double race_tails(pl_work *pw, int32_t n, int32_t k, double u, bool per_expert)
{
    double *a = pw->prefix;
    for (int32_t j = 0; j < n; j++) pw->q[j] = -expm1(-pw->w[j] * u);
    /* prefix[j] = count distribution of experts 0..j-1, entries 0..k-1 (exact: counts
     * only grow, so truncation loses nothing below k) */
    a[0] = 1;
    for (int32_t m = 1; m < k; m++) a[m] = 0;
    for (int32_t j = 0; j + 1 < n; j++) {
        const double *cur = a + (size_t)j * k;
        double *next = a + (size_t)(j + 1) * k;
        double q = pw->q[j], p = 1 - q;
        next[0] = cur[0] * p;
        for (int32_t m = 1; m < k; m++) next[m] = cur[m] * p + cur[m - 1] * q;
    }
    double *b = pw->suffix, *cb = pw->cum;
    b[0] = 1;
    for (int32_t m = 1; m < k; m++) b[m] = 0;
    for (int32_t j = n - 1; j >= 0; j--) {
        if (per_expert) {
            double c = 0;
            for (int32_t m = 0; m < k; m++) cb[m] = c += b[m];
            const double *pre = a + (size_t)j * k;
            double s = 0;
            for (int32_t m = 0; m < k; m++) s += pre[m] * cb[k - 1 - m];
            pw->loo[j] = s;
        }
        double q = pw->q[j], p = 1 - q;
        for (int32_t m = k - 1; m > 0; m--) b[m] = b[m] * p + b[m - 1] * q;
        b[0] *= p;
    }
    double all = 0;
    for (int32_t m = 0; m < k; m++) all += b[m];
    return all;
}

static void accumulate(pl_work *pw, int32_t n, int32_t k, double u, double weight, double *pi)
{
    race_tails(pw, n, k, u, true);
    for (int32_t e = 0; e < n; e++) pi[e] += weight * pw->w[e] * exp(-pw->w[e] * u) * pw->loo[e];
}

static rp_status pl_work_new(rp_context *ctx, int32_t n, int32_t k, pl_work *pw, rp_error *err)
{
    memset(pw, 0, sizeof *pw);
    pw->w = rp_alloc(ctx, (size_t)n * sizeof(double));
    pw->q = rp_alloc(ctx, (size_t)n * sizeof(double));
    pw->loo = rp_alloc(ctx, (size_t)n * sizeof(double));
    pw->prefix = rp_calloc(ctx, (size_t)n * (size_t)k, sizeof(double));
    if (!pw->w || !pw->q || !pw->loo || !pw->prefix) return rp_fail_nomem(err, "calibration tables");
    return RP_OK;
}

static void pl_work_free(rp_context *ctx, pl_work *pw)
{
    rp_free(ctx, pw->w);
    rp_free(ctx, pw->q);
    rp_free(ctx, pw->loo);
    rp_free(ctx, pw->prefix);
}

static void pl_inclusion_with(pl_work *pw, const double *w, int32_t n, int32_t k, double *pi)
{
    if (k >= n) {
        for (int32_t e = 0; e < n; e++) pi[e] = 1;
        return;
    }
    double total = 0;
    for (int32_t e = 0; e < n; e++) total += w[e];
    for (int32_t e = 0; e < n; e++) pw->w[e] = w[e] / total;
    /* median of the k-th arrival, roughly: where k arrivals are expected */
    double lo = 0, hi = (double)k;
    while (arrivals(pw->w, n, hi) < k && hi < 1e300) hi *= 2;
    for (int it = 0; it < 200 && hi - lo > 1e-12 * hi; it++) {
        double mid = 0.5 * (lo + hi);
        if (arrivals(pw->w, n, mid) < k) lo = mid;
        else hi = mid;
    }
    double u_mid = hi;
    double u_max = 2 * u_mid;
    while (race_tails(pw, n, k, u_max, false) > 1e-17 && u_max < 1e300) u_max *= 2;
    double u_min = u_mid * 1e-4;

    for (int32_t e = 0; e < n; e++) pi[e] = 0;
    /* [0, u_min]: one panel; then log-spaced panels up to u_max */
    for (int i = 0; i < GL_NODES; i++) {
        double u = 0.5 * u_min * (gl_x[i] + 1);
        accumulate(pw, n, k, u, 0.5 * u_min * gl_w[i], pi);
    }
    double l0 = log(u_min), l1 = log(u_max), h = (l1 - l0) / LOG_PANELS;
    for (int p = 0; p < LOG_PANELS; p++) {
        double a = l0 + p * h;
        for (int i = 0; i < GL_NODES; i++) {
            double lu = a + 0.5 * h * (gl_x[i] + 1);
            double u = exp(lu);
            accumulate(pw, n, k, u, 0.5 * h * gl_w[i] * u, pi);
        }
    }
    /* The exact total is k; what quadrature misses is spread proportionally. */
    double sum = 0;
    for (int32_t e = 0; e < n; e++) sum += pi[e];
    for (int32_t e = 0; e < n; e++) {
        pi[e] *= k / sum;
        if (pi[e] > 1) pi[e] = 1;
    }
}

rp_status gen_pl_inclusion(rp_context *ctx, const double *w, int32_t n, int32_t k, double *pi,
                           rp_error *err)
{
    if (n < 1 || k < 1 || k > GEN_MAX_TOP_K || k > n)
        return rp_fail(err, RP_EINVAL, "inclusion: %d experts, top-k %d", n, k);
    pl_work pw;
    rp_status st = pl_work_new(ctx, n, k, &pw, err);
    if (st == RP_OK) pl_inclusion_with(&pw, w, n, k, pi);
    pl_work_free(ctx, &pw);
    return st;
}

/* Fixed point in the variable -log(1 - pi), which is nearly proportional to w_e
 * (pi_e ~ 1 - exp(-w_e tau) for a common threshold tau): a few iterations suffice. */
rp_status gen_pl_calibrate(rp_context *ctx, const double *target, int32_t n, int32_t k,
                           double *w, double *max_error, rp_error *err)
{
    if (n < 1 || k < 1 || k > GEN_MAX_TOP_K || k > n)
        return rp_fail(err, RP_EINVAL, "calibration: %d experts, top-k %d", n, k);
    *max_error = 0;
    if (k == n) {
        for (int32_t e = 0; e < n; e++) w[e] = 1.0 / n;
        return RP_OK;
    }
    pl_work pw;
    double *pi = rp_alloc(ctx, (size_t)n * sizeof(double));
    rp_status st = pi ? pl_work_new(ctx, n, k, &pw, err) : rp_fail_nomem(err, "calibration");
    if (st != RP_OK) {
        if (pi) pl_work_free(ctx, &pw);
        rp_free(ctx, pi);
        return st;
    }
    for (int32_t e = 0; e < n; e++) w[e] = target[e] / k;
    double worst = 1;
    for (int it = 0; it < 100; it++) {
        pl_inclusion_with(&pw, w, n, k, pi);
        worst = 0;
        for (int32_t e = 0; e < n; e++) {
            double r = fabs(pi[e] / target[e] - 1);
            if (r > worst) worst = r;
        }
        if (worst < 1e-9) break;
        double total = 0;
        for (int32_t e = 0; e < n; e++) {
            double p = pi[e] < 1 - 1e-15 ? pi[e] : 1 - 1e-15;
            w[e] *= log1p(-target[e]) / log1p(-p);
            total += w[e];
        }
        for (int32_t e = 0; e < n; e++) w[e] /= total;
    }
    *max_error = worst;
    pl_work_free(ctx, &pw);
    rp_free(ctx, pi);
    return RP_OK;
}

/* ---- mapping the recorded experts onto the target's ---------------------------------
 * Each source expert is cut into r = ceil(E / E_src) pieces (r = 1 when E <= E_src)
 * whose shares of its load carry a fixed log-normal jitter, so split experts are not
 * identical twins; the r E_src pieces, in order, are then spread evenly over the E
 * target experts (target e covers pieces [e r E_src / E, (e + 1) r E_src / E)). With
 * E = E_src this is the identity, with E = r E_src a pure split (skew kept up to the
 * jitter), with E < E_src neighbouring experts merge. */

typedef struct expert_map {
    int32_t *begin; /* [E + 1] into src/frac */
    int32_t *src;
    double *frac;   /* share of source expert src[i] that target e gets */
} expert_map;

static void expert_map_free(rp_context *ctx, expert_map *m)
{
    rp_free(ctx, m->begin);
    rp_free(ctx, m->src);
    rp_free(ctx, m->frac);
}

static rp_status expert_map_build(rp_context *ctx, int32_t ne, int32_t ns, double jitter, expert_map *m,
                                  rp_error *err)
{
    memset(m, 0, sizeof *m);
    int64_t r = ne > ns ? (ne + ns - 1) / ns : 1;
    int64_t np = r * ns;
    /* each target touches at most ceil(np / ne) + 1 pieces */
    int64_t per = np / ne + 2;
    double *piece = rp_alloc(ctx, (size_t)np * sizeof(double));
    m->begin = rp_alloc(ctx, ((size_t)ne + 1) * sizeof(int32_t));
    m->src = rp_alloc(ctx, (size_t)(per * ne) * sizeof(int32_t));
    m->frac = rp_alloc(ctx, (size_t)(per * ne) * sizeof(double));
    if (!piece || !m->begin || !m->src || !m->frac) {
        rp_free(ctx, piece);
        expert_map_free(ctx, m);
        return rp_fail_nomem(err, "the expert mapping");
    }
    for (int64_t a = 0; a < ns; a++) {
        double total = 0;
        for (int64_t i = 0; i < r; i++) {
            double f = 1;
            if (r > 1 && jitter > 0) {
                gen_rng rng;
                gen_rng_stream(&rng, 0, GEN_TAG_JITTER, (uint64_t)a, (uint64_t)i);
                f = exp(jitter * gen_normal(&rng));
            }
            piece[a * r + i] = f;
            total += f;
        }
        for (int64_t i = 0; i < r; i++) piece[a * r + i] /= total;
    }
    int32_t at = 0;
    for (int64_t e = 0; e < ne; e++) {
        m->begin[e] = at;
        /* in units of 1/ne piece */
        int64_t lo = e * np, hi = (e + 1) * np;
        for (int64_t p = lo / ne; p * ne < hi; p++) {
            int64_t a = p * ne > lo ? p * ne : lo;
            int64_t b = (p + 1) * ne < hi ? (p + 1) * ne : hi;
            if (b <= a) continue;
            m->src[at] = (int32_t)(p / r);
            m->frac[at] = piece[p] * (double)(b - a) / (double)ne;
            at++;
        }
    }
    m->begin[ne] = at;
    rp_free(ctx, piece);
    return RP_OK;
}

/* Target inclusion probabilities of one recorded layer: mapped shares times k, with a
 * floor (so every expert can be drawn) and a cap below 1 (k distinct draws cannot
 * include an expert always unless k = E); the excess over the cap goes to the others
 * in proportion. */
static void target_of(const expert_map *m, const double *share, int32_t ne, int32_t k, double *t)
{
    if (k == ne) {
        for (int32_t e = 0; e < ne; e++) t[e] = 1;
        return;
    }
    double floor_t = 1e-6 * k / ne, total = 0;
    for (int32_t e = 0; e < ne; e++) {
        double s = 0;
        for (int32_t i = m->begin[e]; i < m->begin[e + 1]; i++) s += m->frac[i] * share[m->src[i]];
        t[e] = s > floor_t / k ? s : floor_t / k;
        total += t[e];
    }
    for (int32_t e = 0; e < ne; e++) t[e] *= k / total;
    double cap = 1 - 0.01 * (1 - (double)k / ne);
    for (int round = 0; round < 64; round++) {
        double excess = 0, free_mass = 0;
        for (int32_t e = 0; e < ne; e++) {
            if (t[e] > cap) {
                excess += t[e] - cap;
                t[e] = cap;
            } else if (t[e] < cap) {
                free_mass += t[e];
            }
        }
        if (excess <= 0 || free_mass <= 0) break;
        double grow = 1 + excess / free_mass;
        for (int32_t e = 0; e < ne; e++)
            if (t[e] < cap) t[e] *= grow;
    }
}

/* ---- cross-layer couplings ------------------------------------------------------------
 * The recorded pair counts C (layer a choice j -> layer b choice j) mapped onto the
 * target experts (M C M^T), lightly smoothed, and scaled by Sinkhorn's iteration to
 * the two target layers' inclusion vectors: a joint distribution with the recorded
 * association (its odds ratios) and exactly the target marginals, so drawing layer l
 * from layer l - 1 through it keeps layer l's load. */

static rp_status coupling_build(rp_context *ctx, const expert_map *m, const double *pairs, int32_t ns,
                                int32_t ne, const double *row_t, const double *col_t, gen_coupling *out,
                                rp_error *err)
{
    size_t nn = (size_t)ne * (size_t)ne;
    double *c = rp_calloc(ctx, nn, sizeof(double));
    double *rs = rp_alloc(ctx, (size_t)ne * sizeof(double));
    double *cs = rp_alloc(ctx, (size_t)ne * sizeof(double));
    void *work = rp_alloc(ctx, GEN_ALIAS_WORK_BYTES(ne));
    out->table = rp_alloc(ctx, nn * sizeof(uint64_t));
    rp_status st = RP_OK;
    if (!c || !rs || !cs || !work || !out->table) {
        st = rp_fail_nomem(err, "a cross-layer coupling");
        goto out;
    }
    double total = 0;
    for (int32_t e = 0; e < ne; e++)
        for (int32_t f = 0; f < ne; f++) {
            double s = 0;
            for (int32_t i = m->begin[e]; i < m->begin[e + 1]; i++)
                for (int32_t j = m->begin[f]; j < m->begin[f + 1]; j++)
                    s += m->frac[i] * m->frac[j] * pairs[(size_t)m->src[i] * ns + m->src[j]];
            c[(size_t)e * ne + f] = s;
            total += s;
        }
    double eps = 1e-6 * total / (double)nn;
    for (size_t i = 0; i < nn; i++) c[i] += eps;
    for (int it = 0; it < 1000; it++) {
        double worst = 0;
        for (int32_t e = 0; e < ne; e++) {
            double s = 0;
            for (int32_t f = 0; f < ne; f++) s += c[(size_t)e * ne + f];
            double g = row_t[e] / s;
            if (fabs(g - 1) > worst) worst = fabs(g - 1);
            for (int32_t f = 0; f < ne; f++) c[(size_t)e * ne + f] *= g;
        }
        for (int32_t f = 0; f < ne; f++) cs[f] = 0;
        for (int32_t e = 0; e < ne; e++)
            for (int32_t f = 0; f < ne; f++) cs[f] += c[(size_t)e * ne + f];
        for (int32_t f = 0; f < ne; f++) {
            double g = col_t[f] / cs[f];
            if (fabs(g - 1) > worst) worst = fabs(g - 1);
            rs[f] = g;
        }
        for (int32_t e = 0; e < ne; e++)
            for (int32_t f = 0; f < ne; f++) c[(size_t)e * ne + f] *= rs[f];
        if (worst < 1e-9) break;
    }
    for (int32_t e = 0; e < ne; e++)
        gen_alias_build(c + (size_t)e * ne, (uint32_t)ne, NULL, out->table + (size_t)e * ne, work);
out:
    rp_free(ctx, c);
    rp_free(ctx, rs);
    rp_free(ctx, cs);
    rp_free(ctx, work);
    return st;
}

/* ---- layers ---------------------------------------------------------------------------- */

/* The recorded layer nearest in relative depth (l / (L - 1) against r / (S - 1)), in
 * exact integer arithmetic; *exact when the depths are equal. */
static int32_t nearest_recorded(const gen_source *src, int32_t l, int32_t nl, bool *exact)
{
    int64_t best = INT64_MAX;
    int32_t arg = 0;
    int64_t sl = src->num_layers > 1 ? src->num_layers - 1 : 1;
    int64_t tl = nl > 1 ? nl - 1 : 1;
    for (int32_t r = 0; r < src->num_recorded; r++) {
        int64_t x = (int64_t)(nl > 1 ? l : 0) * sl;
        int64_t y = (int64_t)(src->num_layers > 1 ? src->recorded[r] : 0) * tl;
        int64_t d = x > y ? x - y : y - x;
        if (d < best) {
            best = d;
            arg = r;
        }
    }
    *exact = best == 0;
    return arg;
}

/* The recorded segment (r -> r + 1) around the transition l - 1 -> l: the one holding
 * the midpoint depth (l - 1/2) / (L - 1), clamped to the recorded range. */
static int32_t segment_of(const gen_source *src, int32_t l, int32_t nl)
{
    if (src->num_recorded < 2 || nl < 2) return -1;
    double x = ((double)l - 0.5) / (nl - 1) * (src->num_layers > 1 ? src->num_layers - 1 : 0);
    for (int32_t r = 0; r + 1 < src->num_recorded; r++)
        if (x <= src->recorded[r + 1]) return r;
    return src->num_recorded - 2;
}

/* ---- correcting for the couplings ----------------------------------------------------
 * A pick drawn through a coupling must still differ from the token's other picks, and
 * the popular experts are the ones most often taken already, so the coupled picks come
 * out a little flatter than their marginal (about 4% less CV at layer_correlation 0.5
 * on the c4 counts). Simulating the sampler itself, with every sequence at the base
 * preferences (the effect does not depend on the concentration), measures the loads
 * of each coupled layer; the flattening is smooth in the target, so a weighted fit of
 * log(target / measured) = a + b log(target) captures it from few tokens, free of
 * their noise; the base weights then move by gain x (a + b log target), with gain
 * 1 / (1 - correlation), the step that would close the gap if only the uncoupled
 * share of picks responded. */

#define CORRECTION_ROUNDS 4
#define CORRECTION_PICKS (1 << 20)    /* picks simulated per round */
#define CORRECTION_SEQ_LEN 512
#define CORRECTION_SEED 0x6f6c6d6f65ULL

static rp_status correct_for_couplings(rp_context *ctx, const gen_settings *s, gen_model *m, int32_t d,
                                       rp_error *err)
{
    int32_t nl = m->num_layers, ne = m->num_experts, k = m->top_k;
    size_t le = (size_t)nl * (size_t)ne;
    /* about 2000 picks an expert would do; the fit needs less, the budget caps it */
    int64_t tokens = CORRECTION_PICKS / ((int64_t)nl * k);
    if (tokens > 2048 * (int64_t)ne / k) tokens = 2048 * (int64_t)ne / k;
    if (tokens < 4 * CORRECTION_SEQ_LEN) tokens = 4 * CORRECTION_SEQ_LEN;
    int32_t groups = (int32_t)(tokens / CORRECTION_SEQ_LEN);
    tokens = (int64_t)groups * CORRECTION_SEQ_LEN;
    gen_settings sim = *s;
    sim.locality = 0;
    sim.share_prompt_routing = false;
    sim.group_size = 1;
    sim.num_prompts = groups;
    sim.width = RP_ID_U16; /* couplings need E <= GEN_MAX_CORR_EXPERTS */
    gen_domain *dom = &m->domains[d];
    double *alpha = rp_calloc(ctx, (size_t)m->num_domains * le, sizeof(double));
    double *load = rp_alloc(ctx, le * sizeof(double));
    int32_t *group_domain = rp_alloc(ctx, (size_t)groups * sizeof(int32_t));
    int32_t *prompt_len = rp_alloc(ctx, (size_t)groups * sizeof(int32_t));
    int64_t *cu = rp_alloc(ctx, ((size_t)groups + 1) * sizeof(int64_t));
    uint16_t *ids = rp_alloc(ctx, (size_t)tokens * (size_t)nl * (size_t)k * sizeof(uint16_t));
    rp_status st = RP_OK;
    if (!alpha || !load || !group_domain || !prompt_len || !cu || !ids) {
        st = rp_fail_nomem(err, "the coupling correction");
        goto out;
    }
    for (int32_t g = 0; g <= groups; g++) cu[g] = (int64_t)g * CORRECTION_SEQ_LEN;
    for (int32_t g = 0; g < groups; g++) {
        group_domain[g] = d;
        prompt_len[g] = CORRECTION_SEQ_LEN;
    }
    double gain = 1 / (1 - (s->layer_correlation < 0.75 ? s->layer_correlation : 0.75));
    for (int round = 0; round < CORRECTION_ROUNDS; round++) {
        /* a huge concentration: every sequence at the base preferences */
        double *a = alpha + (size_t)d * le;
        for (int32_t l = 0; l < nl; l++) {
            const double *lb = dom->log_base + (size_t)l * ne;
            double top = -INFINITY, sum = 0;
            for (int32_t e = 0; e < ne; e++) top = lb[e] > top ? lb[e] : top;
            for (int32_t e = 0; e < ne; e++) sum += exp(lb[e] - top);
            for (int32_t e = 0; e < ne; e++) a[(size_t)l * ne + e] = 1e12 * exp(lb[e] - top) / sum;
        }
        gen_step_job job = {&sim, m, CORRECTION_SEED, round, alpha, group_domain, cu, prompt_len, ids};
        RP_CHECK_GOTO(gen_routing_run(ctx, &job, s->threads, err), st, out);
        memset(load, 0, le * sizeof(double));
        for (int64_t t = 0; t < tokens; t++)
            for (int32_t l = 0; l < nl; l++) {
                const uint16_t *row = ids + ((size_t)t * nl + l) * k;
                for (int32_t j = 0; j < k; j++) load[(size_t)l * ne + row[j]] += 1;
            }
        for (int32_t l = 0; l < nl; l++) {
            if (dom->coupling[l] < 0) continue; /* exact already */
            double *lb = dom->log_base + (size_t)l * ne;
            const double *t = dom->target + (size_t)l * ne;
            const double *got = load + (size_t)l * ne;
            /* weighted least squares of log(target / measured) on log(target): the
             * weights are the counts, whose inverse is the variance of the log */
            double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
            for (int32_t e = 0; e < ne; e++) {
                if (got[e] <= 0) continue;
                double x = log(t[e]), y = log(t[e] * (double)tokens / got[e]), wgt = got[e];
                sw += wgt, sx += wgt * x, sy += wgt * y, sxx += wgt * x * x, sxy += wgt * x * y;
            }
            double mx = sx / sw, my = sy / sw, vx = sxx / sw - mx * mx;
            double slope = vx > 1e-12 ? (sxy / sw - mx * my) / vx : 0;
            for (int32_t e = 0; e < ne; e++) lb[e] += gain * (my + slope * (log(t[e]) - mx));
        }
    }
out:
    rp_free(ctx, alpha);
    rp_free(ctx, load);
    rp_free(ctx, group_domain);
    rp_free(ctx, prompt_len);
    rp_free(ctx, cu);
    rp_free(ctx, ids);
    return st;
}

void gen_model_free(rp_context *ctx, gen_model *m)
{
    if (!m) return;
    for (int32_t d = 0; d < m->num_domains && m->domains; d++) {
        gen_domain *dom = &m->domains[d];
        rp_free(ctx, dom->target);
        rp_free(ctx, dom->log_base);
        rp_free(ctx, dom->coupling);
        for (int32_t c = 0; c < dom->num_couplings; c++) rp_free(ctx, dom->couplings[c].table);
        rp_free(ctx, dom->couplings);
    }
    rp_free(ctx, m->domains);
    rp_free(ctx, m->src_layer);
    rp_free(ctx, m->perm);
    rp_free(ctx, m->inv);
    memset(m, 0, sizeof *m);
}

rp_status gen_model_build(rp_context *ctx, const gen_settings *s, gen_model *out, rp_error *err)
{
    const gen_source *src = &s->source;
    int32_t nl = s->num_layers, ne = s->num_experts, k = s->top_k, ns = src->num_experts;
    int32_t nr = src->num_recorded;
    size_t le = (size_t)nl * (size_t)ne;
    gen_model m;
    memset(&m, 0, sizeof m);
    m.num_layers = nl;
    m.num_experts = ne;
    m.top_k = k;
    expert_map map;
    memset(&map, 0, sizeof map);
    double *t_rec = NULL, *w_rec = NULL;
    /* coupling cache key per built coupling: segment, source layer of l - 1, of l */
    int32_t (*keys)[3] = NULL;
    rp_status st = expert_map_build(ctx, ne, ns, s->split_jitter, &map, err);
    if (st != RP_OK) return st;

    m.src_layer = rp_alloc(ctx, (size_t)nl * sizeof(int32_t));
    m.perm = rp_alloc(ctx, le * sizeof(int32_t));
    m.inv = rp_alloc(ctx, le * sizeof(int32_t));
    m.domains = rp_calloc(ctx, (size_t)src->num_domains, sizeof(gen_domain));
    t_rec = rp_alloc(ctx, (size_t)nr * ne * sizeof(double));
    w_rec = rp_alloc(ctx, (size_t)nr * ne * sizeof(double));
    keys = rp_alloc(ctx, (size_t)nl * sizeof *keys);
    if (!m.src_layer || !m.perm || !m.inv || !m.domains || !t_rec || !w_rec || !keys) {
        st = rp_fail_nomem(err, "the routing model");
        goto out;
    }
    m.num_domains = src->num_domains;

    /* layers: nearest recorded layer; relabeled experts unless it is that layer */
    for (int32_t l = 0; l < nl; l++) {
        bool exact;
        m.src_layer[l] = nearest_recorded(src, l, nl, &exact);
        int32_t *perm = m.perm + (size_t)l * ne;
        for (int32_t e = 0; e < ne; e++) perm[e] = e;
        if (!exact) {
            gen_rng rng;
            gen_rng_stream(&rng, 0, GEN_TAG_RELABEL, (uint64_t)l, 0);
            for (int32_t e = ne - 1; e > 0; e--) {
                int32_t j = (int32_t)gen_below(&rng, (uint32_t)e + 1);
                int32_t t = perm[e];
                perm[e] = perm[j];
                perm[j] = t;
            }
        }
        for (int32_t e = 0; e < ne; e++) m.inv[(size_t)l * ne + perm[e]] = e;
    }

    for (int32_t d = 0; d < src->num_domains; d++) {
        const gen_src_domain *sd = &src->domains[d];
        gen_domain *dom = &m.domains[d];
        dom->target = rp_alloc(ctx, le * sizeof(double));
        dom->log_base = rp_alloc(ctx, le * sizeof(double));
        dom->coupling = rp_alloc(ctx, (size_t)nl * sizeof(int32_t));
        if (!dom->target || !dom->log_base || !dom->coupling) {
            st = rp_fail_nomem(err, "the routing model");
            goto out;
        }
        for (int32_t r = 0; r < nr; r++) {
            double worst;
            double *t = t_rec + (size_t)r * ne, *w = w_rec + (size_t)r * ne;
            target_of(&map, sd->share + (size_t)r * ns, ne, k, t);
            RP_CHECK_GOTO(gen_pl_calibrate(ctx, t, ne, k, w, &worst, err), st, out);
            if (worst > m.calibration_error) m.calibration_error = worst;
        }
        for (int32_t l = 0; l < nl; l++) {
            const double *t = t_rec + (size_t)m.src_layer[l] * ne, *w = w_rec + (size_t)m.src_layer[l] * ne;
            const int32_t *perm = m.perm + (size_t)l * ne;
            for (int32_t i = 0; i < ne; i++) {
                dom->target[(size_t)l * ne + perm[i]] = t[i];
                dom->log_base[(size_t)l * ne + perm[i]] = log(w[i] > 1e-300 ? w[i] : 1e-300);
            }
        }
        /* couplings, one per distinct (segment, source layers) */
        for (int32_t l = 0; l < nl; l++) {
            dom->coupling[l] = -1;
            int32_t seg = l > 0 && s->layer_correlation > 0 ? segment_of(src, l, nl) : -1;
            if (seg < 0 || !sd->pairs[seg]) continue;
            int32_t key[3] = {seg, m.src_layer[l - 1], m.src_layer[l]};
            int32_t c;
            for (c = 0; c < dom->num_couplings; c++)
                if (!memcmp(keys[c], key, sizeof key)) break;
            if (c == dom->num_couplings) {
                gen_coupling *grown = rp_realloc(ctx, dom->couplings, (size_t)(c + 1) * sizeof(gen_coupling));
                if (!grown) {
                    st = rp_fail_nomem(err, "a cross-layer coupling");
                    goto out;
                }
                dom->couplings = grown;
                memset(&dom->couplings[c], 0, sizeof dom->couplings[c]);
                dom->num_couplings++;
                memcpy(keys[c], key, sizeof key);
                RP_CHECK_GOTO(coupling_build(ctx, &map, sd->pairs[seg], ns, ne, t_rec + (size_t)key[1] * ne,
                                             t_rec + (size_t)key[2] * ne, &dom->couplings[c], err),
                              st, out);
            }
            dom->coupling[l] = c;
        }
        if (dom->num_couplings > 0) RP_CHECK_GOTO(correct_for_couplings(ctx, s, &m, d, err), st, out);
    }
    *out = m;
    memset(&m, 0, sizeof m);
out:
    gen_model_free(ctx, &m);
    expert_map_free(ctx, &map);
    rp_free(ctx, t_rec);
    rp_free(ctx, w_rec);
    rp_free(ctx, keys);
    return st;
}
