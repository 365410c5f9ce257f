/* Sequence swaps that mix routing profiles across EP groups: inside a microbatch, a
 * sequence of the group whose expert load overflows the placement trades places with
 * a sequence of about the same length in another group, when the surrogate says the
 * step gets shorter (docs/routepack-policy.md, "Mixing routing profiles"). */
#include "joint_internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

/* Sequences of about the same length compared with a candidate on each side. */
#define NEIGHBOURS 4

typedef struct balancer {
    joint *jt;
    const joint_layer *ref;
    int32_t M, Q, L, E, ep, G;
    double *U;             /* [M][Q][L][ep] token-choices each rank receives */
    double *gmax;          /* [M][L][Q] largest over ranks of U / speed */
    int32_t *top;          /* [M][L][3] the groups with the largest gmax, best first */
    float *prof;           /* [N][L][ep] a sequence's share of U, computed on demand */
    unsigned char *have;   /* [N] */
    double *A;             /* [G * M] attention of a cell, speed 1 */
    int64_t *tok;          /* [G * M] tokens of a cell */
    double *attn;          /* [N] a(L) */
    int32_t *mb_begin, *by_len; /* each microbatch's sequences, ascending length */
    uint32_t *h;           /* [E] */
    double *row;           /* [2 * ep] trial rows */
    double w_x, w_a, w_t;  /* step seconds per token-choice of the hottest rank,
                              per second of the slowest cell's dense work (x L), per
                              token of the fullest cell (dispatch and combine) */
    /* The group form (jt->group_form): each group's own sum of the same terms over its
     * microbatches, maxima over its own GPUs; a trade is judged by the largest sum. [Q] */
    double *tot;
} balancer;

static inline double *U_row(const balancer *b, int32_t m, int32_t q, int32_t l)
{
    return b->U + (((size_t)m * b->Q + q) * b->L + l) * b->ep;
}

static inline double spd(const balancer *b, int32_t q, int32_t j) { return b->jt->speed[q * b->ep + j]; }

static const float *profile(balancer *b, int32_t s)
{
    float *p = b->prof + (size_t)s * b->L * b->ep;
    if (b->have[s]) return p;
    for (int32_t l = 0; l < b->L; l++) {
        float *pl = p + (size_t)l * b->ep;
        const joint_layer *lay = &b->ref[l];
        double acc[64];
        double *a = b->ep <= 64 ? acc : b->row; /* row holds 2 ep doubles */
        for (int32_t j = 0; j < b->ep; j++) a[j] = 0;
        rp_stats_seq_hist(b->jt->stats, s, l, b->h);
        for (int32_t e = 0; e < b->E; e++) {
            if (!b->h[e]) continue;
            int32_t r0 = lay->rep_off[e], r1 = lay->rep_off[e + 1];
            double w = (double)b->h[e] / (r1 - r0);
            for (int32_t r = r0; r < r1; r++) a[lay->rep_rank[r]] += w;
        }
        for (int32_t j = 0; j < b->ep; j++) pl[j] = (float)a[j];
    }
    b->have[s] = 1;
    return p;
}

static void group_max(balancer *b, int32_t m, int32_t q, int32_t l)
{
    const double *u = U_row(b, m, q, l);
    double best = 0;
    for (int32_t j = 0; j < b->ep; j++) {
        double x = u[j] / spd(b, q, j);
        best = x > best ? x : best;
    }
    b->gmax[((size_t)m * b->L + l) * b->Q + q] = best;
}

static void layer_top(balancer *b, int32_t m, int32_t l)
{
    const double *g = b->gmax + ((size_t)m * b->L + l) * b->Q;
    int32_t *t = b->top + ((size_t)m * b->L + l) * 3;
    t[0] = t[1] = t[2] = -1;
    for (int32_t q = 0; q < b->Q; q++) {
        if (t[0] < 0 || g[q] > g[t[0]]) {
            t[2] = t[1];
            t[1] = t[0];
            t[0] = q;
        } else if (t[1] < 0 || g[q] > g[t[1]]) {
            t[2] = t[1];
            t[1] = q;
        } else if (t[2] < 0 || g[q] > g[t[2]]) {
            t[2] = q;
        }
    }
}

/* Group q's slowest cell of microbatch m, dense work (per speed) and tokens, with cell
 * `ca` holding `a1` and `ta` instead, and `cb` `a2` and `tb` (cells of other groups are
 * never looked at). */
static void group_cells(const balancer *b, int32_t m, int32_t q, size_t ca, double a1, int64_t ta, size_t cb,
                        double a2, int64_t tb, double *amax, double *tmax)
{
    const joint *jt = b->jt;
    double am = 0, tm = 0;
    for (int32_t g = q * b->ep; g < (q + 1) * b->ep; g++) {
        const size_t c = (size_t)g * b->M + m;
        double av = c == ca ? a1 : c == cb ? a2 : b->A[c] / jt->speed[g];
        double tv = (double)(c == ca ? ta : c == cb ? tb : b->tok[c]);
        am = av > am ? av : am;
        tm = tv > tm ? tv : tm;
    }
    *amax = am;
    *tmax = tm;
}

/* Group q's own sum over microbatches (the group form's b->tot[q]). */
static double group_total(const balancer *b, int32_t q)
{
    double sum = 0;
    for (int32_t m = 0; m < b->M; m++) {
        double am, tm;
        group_cells(b, m, q, SIZE_MAX, 0, 0, SIZE_MAX, 0, 0, &am, &tm);
        sum += b->w_a * am + b->w_t * tm;
        for (int32_t l = 0; l < b->L; l++) sum += b->w_x * b->gmax[((size_t)m * b->L + l) * b->Q + q];
    }
    return sum;
}

/* The two cells of a trade: sequences sa (GPU ga, EP group qa, cell ca) and sb (gb, qb,
 * cb) of one microbatch change places; ta, tb the cells' tokens after it, a1, a2 their
 * dense work per speed. Filled once per trial, read by both scoring forms. */
typedef struct trade_cells {
    int32_t ga, gb, qa, qb;
    size_t ca, cb;
    int64_t ta, tb;
    double a1, a2;
} trade_cells;

/* false when the trade would put a cell over the token cap */
static bool trade_fill(const balancer *b, int32_t m, int32_t sa, int32_t sb, trade_cells *t)
{
    const joint *jt = b->jt;
    t->ga = jt->seq_gpu[sa];
    t->gb = jt->seq_gpu[sb];
    t->qa = t->ga / b->ep;
    t->qb = t->gb / b->ep;
    const int64_t la = rp_batch_seq_len(jt->batch, sa), lb = rp_batch_seq_len(jt->batch, sb);
    t->ca = (size_t)t->ga * b->M + m;
    t->cb = (size_t)t->gb * b->M + m;
    t->ta = b->tok[t->ca] - la + lb;
    t->tb = b->tok[t->cb] - lb + la;
    if (t->ta > jt->cap || t->tb > jt->cap) return false;
    t->a1 = (b->A[t->ca] - b->attn[sa] + b->attn[sb]) / jt->speed[t->ga];
    t->a2 = (b->A[t->cb] - b->attn[sb] + b->attn[sa]) / jt->speed[t->gb];
    return true;
}

/* trial in the group form: the change of the largest group sum when sequences a (group
 * qa) and b (group qb) of microbatch m trade cells. */
static double trial_group(balancer *b, int32_t m, int32_t sa, int32_t sb, const trade_cells *t)
{
    const int32_t qa = t->qa, qb = t->qb, ep = b->ep;
    double new_tot[2];
    const int32_t qs[2] = {qa, qb};
    for (int k = 0; k < 2; k++) {
        double a_old, t_old, a_new, t_new;
        group_cells(b, m, qs[k], SIZE_MAX, 0, 0, SIZE_MAX, 0, 0, &a_old, &t_old);
        group_cells(b, m, qs[k], t->ca, t->a1, t->ta, t->cb, t->a2, t->tb, &a_new, &t_new);
        new_tot[k] = b->tot[qs[k]] + b->w_a * (a_new - a_old) + b->w_t * (t_new - t_old);
    }
    const float *pa = profile(b, sa), *pb = profile(b, sb);
    for (int32_t l = 0; l < b->L; l++) {
        const double *g = b->gmax + ((size_t)m * b->L + l) * b->Q;
        const double *ua = U_row(b, m, qa, l), *ub = U_row(b, m, qb, l);
        const float *xa = pa + (size_t)l * ep, *xb = pb + (size_t)l * ep;
        double va_max = 0, vb_max = 0;
        for (int32_t j = 0; j < ep; j++) {
            double d = (double)xb[j] - (double)xa[j];
            double va = (ua[j] + d) / spd(b, qa, j), vb = (ub[j] - d) / spd(b, qb, j);
            va_max = va > va_max ? va : va_max;
            vb_max = vb > vb_max ? vb : vb_max;
        }
        new_tot[0] += b->w_x * (va_max - g[qa]);
        new_tot[1] += b->w_x * (vb_max - g[qb]);
    }
    double old_top = 0, new_top = new_tot[0] > new_tot[1] ? new_tot[0] : new_tot[1];
    for (int32_t q = 0; q < b->Q; q++) {
        old_top = b->tot[q] > old_top ? b->tot[q] : old_top;
        if (q != qa && q != qb) new_top = b->tot[q] > new_top ? b->tot[q] : new_top;
    }
    return new_top - old_top;
}

/* Surrogate change of microbatch m's time if sequences a and b trade cells. */
static double trial(balancer *b, int32_t m, int32_t sa, int32_t sb)
{
    trade_cells tc;
    if (!trade_fill(b, m, sa, sb, &tc)) return INFINITY;
    if (b->tot) return trial_group(b, m, sa, sb, &tc);
    const joint *jt = b->jt;
    const int32_t ga = tc.ga, gb = tc.gb, qa = tc.qa, qb = tc.qb, ep = b->ep;
    const int32_t M = b->M;
    /* attention and tokens of the two cells, against the rest of the microbatch */
    double a_rest = 0, a_old = 0, t_rest = 0, t_old = 0;
    for (int32_t g = 0; g < b->G; g++) {
        double av = b->A[(size_t)g * M + m] / jt->speed[g], tv = (double)b->tok[(size_t)g * M + m];
        a_old = av > a_old ? av : a_old;
        t_old = tv > t_old ? tv : t_old;
        if (g == ga || g == gb) continue;
        a_rest = av > a_rest ? av : a_rest;
        t_rest = tv > t_rest ? tv : t_rest;
    }
    double a_new = a_rest > tc.a1 ? a_rest : tc.a1;
    a_new = a_new > tc.a2 ? a_new : tc.a2;
    double t_new = t_rest > (double)tc.ta ? t_rest : (double)tc.ta;
    t_new = t_new > (double)tc.tb ? t_new : (double)tc.tb;
    double delta = b->w_a * (a_new - a_old) + b->w_t * (t_new - t_old);
    /* expert side: the two groups' rows change by the profiles' difference */
    const float *pa = profile(b, sa), *pb = profile(b, sb);
    double dx = 0;
    for (int32_t l = 0; l < b->L; l++) {
        const int32_t *t = b->top + ((size_t)m * b->L + l) * 3;
        const double *g = b->gmax + ((size_t)m * b->L + l) * b->Q;
        double other = 0;
        for (int k = 0; k < 3; k++)
            if (t[k] >= 0 && t[k] != qa && t[k] != qb) {
                other = g[t[k]];
                break;
            }
        const double *ua = U_row(b, m, qa, l), *ub = U_row(b, m, qb, l);
        const float *xa = pa + (size_t)l * ep, *xb = pb + (size_t)l * ep;
        double best = other;
        for (int32_t j = 0; j < ep; j++) {
            double d = (double)xb[j] - (double)xa[j];
            double va = (ua[j] + d) / spd(b, qa, j), vb = (ub[j] - d) / spd(b, qb, j);
            best = va > best ? va : best;
            best = vb > best ? vb : best;
        }
        dx += best - g[t[0]];
    }
    return delta + b->w_x * dx;
}

static void apply_swap(balancer *b, int32_t m, int32_t sa, int32_t sb)
{
    joint *jt = b->jt;
    const int32_t ga = jt->seq_gpu[sa], gb = jt->seq_gpu[sb], qa = ga / b->ep, qb = gb / b->ep;
    const int32_t M = b->M, ep = b->ep;
    const int64_t la = rp_batch_seq_len(jt->batch, sa), lb = rp_batch_seq_len(jt->batch, sb);
    const size_t ca = (size_t)ga * M + m, cb = (size_t)gb * M + m;
    b->A[ca] += b->attn[sb] - b->attn[sa];
    b->A[cb] += b->attn[sa] - b->attn[sb];
    b->tok[ca] += lb - la;
    b->tok[cb] += la - lb;
    const float *pa = profile(b, sa), *pb = profile(b, sb);
    for (int32_t l = 0; l < b->L; l++) {
        double *ua = U_row(b, m, qa, l), *ub = U_row(b, m, qb, l);
        for (int32_t j = 0; j < ep; j++) {
            double d = (double)pb[(size_t)l * ep + j] - (double)pa[(size_t)l * ep + j];
            ua[j] += d;
            ub[j] -= d;
        }
        group_max(b, m, qa, l);
        group_max(b, m, qb, l);
        layer_top(b, m, l);
    }
    /* the exact integer histograms of the two groups */
    if (qa != qb)
        for (int32_t l = 0; l < b->L; l++) {
            int64_t *ra = jt->grp_hist + (((size_t)m * b->Q + qa) * b->L + l) * b->E;
            int64_t *rb = jt->grp_hist + (((size_t)m * b->Q + qb) * b->L + l) * b->E;
            rp_stats_seq_hist(jt->stats, sa, l, b->h);
            for (int32_t e = 0; e < b->E; e++) {
                ra[e] -= b->h[e];
                rb[e] += b->h[e];
            }
            rp_stats_seq_hist(jt->stats, sb, l, b->h);
            for (int32_t e = 0; e < b->E; e++) {
                rb[e] -= b->h[e];
                ra[e] += b->h[e];
            }
        }
    jt->seq_gpu[sa] = gb;
    jt->seq_gpu[sb] = ga;
    if (b->tot) {
        b->tot[qa] = group_total(b, qa);
        b->tot[qb] = group_total(b, qb);
    }
}

/* One round in microbatch m: the group that is the hottest at the most layers (by its
 * margin over the next group) offers each of its sequences to the NEIGHBOURS
 * sequences of nearest length on each side that sit in other groups; the best trade
 * that shortens the step is made. Returns the candidates evaluated (0: nothing to
 * try), and sets *improved. */
static int64_t round_mb(balancer *b, int32_t m, int64_t budget, bool *improved)
{
    joint *jt = b->jt;
    *improved = false;
    double hv[256];
    if (b->Q > 256) return 0; /* bounded work: not tried at that many groups */
    for (int32_t q = 0; q < b->Q; q++) hv[q] = 0;
    for (int32_t l = 0; l < b->L; l++) {
        const int32_t *t = b->top + ((size_t)m * b->L + l) * 3;
        const double *g = b->gmax + ((size_t)m * b->L + l) * b->Q;
        if (t[0] >= 0) hv[t[0]] += g[t[0]] - (t[1] >= 0 ? g[t[1]] : 0.0);
    }
    int32_t hot = 0;
    for (int32_t q = 1; q < b->Q; q++)
        if (b->tot ? b->tot[q] > b->tot[hot] : hv[q] > hv[hot]) hot = q; /* group form: the largest sum */
    const int32_t begin = b->mb_begin[m], end = b->mb_begin[m + 1];
    int64_t used = 0;
    int32_t best_a = -1, best_b = -1;
    double best = 0;
    for (int32_t i = begin; i < end && used < budget; i++) {
        int32_t sa = b->by_len[i];
        if (jt->seq_gpu[sa] / b->ep != hot) continue;
        for (int32_t side = -1; side <= 1; side += 2) {
            int32_t found = 0;
            for (int32_t k = i + side; k >= begin && k < end && found < NEIGHBOURS && used < budget; k += side) {
                int32_t sb = b->by_len[k];
                if (jt->seq_gpu[sb] / b->ep == hot) continue;
                found++;
                used++;
                double d = trial(b, m, sa, sb);
                if (d < best) {
                    best = d;
                    best_a = sa;
                    best_b = sb;
                }
            }
        }
    }
    if (best_a >= 0 && best < 0) {
        apply_swap(b, m, best_a, best_b);
        *improved = true;
    }
    return used;
}

rp_status joint_balance(joint *jt, const joint_layer *ref, int64_t budget, int64_t *used, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    *used = 0;
    if (budget <= 0 || jt->Q < 2) return RP_OK;
    balancer b;
    memset(&b, 0, sizeof b);
    b.jt = jt;
    b.ref = ref;
    b.M = jt->M, b.Q = jt->Q, b.L = jt->L, b.E = jt->E, b.ep = jt->ep, b.G = jt->G;
    const int32_t N = jt->N, M = b.M;
    rp_status st = RP_OK;
    int64_t nu, np;
    if (rp_mul_overflow((int64_t)M * b.Q * b.L, b.ep, &nu) || rp_mul_overflow((int64_t)N * b.L, b.ep, &np) ||
        np > ((int64_t)1 << 30))
        return RP_OK; /* too large to be worth it: the packing stays as it is */
    b.U = rp_calloc(ctx, (size_t)nu, sizeof *b.U);
    b.gmax = rp_alloc(ctx, (size_t)M * b.L * b.Q * sizeof *b.gmax);
    b.top = rp_alloc(ctx, (size_t)M * b.L * 3 * sizeof *b.top);
    b.prof = rp_alloc(ctx, (size_t)np * sizeof *b.prof);
    b.have = rp_calloc(ctx, (size_t)N, 1);
    b.A = rp_calloc(ctx, (size_t)b.G * M, sizeof *b.A);
    b.tok = rp_calloc(ctx, (size_t)b.G * M, sizeof *b.tok);
    b.attn = rp_alloc(ctx, (size_t)N * sizeof *b.attn);
    b.mb_begin = rp_calloc(ctx, (size_t)M + 1, sizeof *b.mb_begin);
    b.by_len = rp_alloc(ctx, (size_t)N * sizeof *b.by_len);
    int32_t *next = rp_alloc(ctx, (size_t)M * sizeof *next + 1);
    unsigned char *stuck = rp_calloc(ctx, (size_t)M, 1);
    b.h = rp_alloc(ctx, (size_t)b.E * sizeof *b.h);
    b.row = rp_alloc(ctx, 2 * (size_t)b.ep * sizeof *b.row);
    double *len = rp_alloc(ctx, (size_t)N * sizeof *len);
    int32_t *order = rp_alloc(ctx, (size_t)N * sizeof *order);
    if (jt->group_form && !(b.tot = rp_calloc(ctx, (size_t)b.Q, sizeof *b.tot))) {
        st = rp_fail_nomem(err, "joint: profile mixing");
        goto out;
    }
    if (!b.U || !b.gmax || !b.top || !b.prof || !b.have || !b.A || !b.tok || !b.attn || !b.mb_begin || !b.by_len ||
        !next || !stuck || !b.h || !b.row || !len || !order) {
        st = rp_fail_nomem(err, "joint: profile mixing");
        goto out;
    }
    const double L = jt->L, K = jt->K;
    b.w_x = jt->t_choice + 2.0 * jt->d_choice;
    b.w_a = L;
    b.w_t = 2.0 * L * K * jt->d_choice;
    for (int32_t s = 0; s < N; s++) {
        int64_t n = rp_batch_seq_len(jt->batch, s);
        size_t c = (size_t)jt->seq_gpu[s] * M + jt->seq_mb[s];
        b.attn[s] = rp_cost_dense_s(jt->cost, n);
        b.A[c] += b.attn[s];
        b.tok[c] += n;
        len[s] = (double)n;
        b.mb_begin[jt->seq_mb[s] + 1]++;
    }
    for (int32_t m = 0; m < M; m++) b.mb_begin[m + 1] += b.mb_begin[m];
    /* by microbatch, ascending length inside (ties: lower id): a stable sort by length,
     * then a stable counting pass by microbatch */
    RP_CHECK_GOTO(rp_sort_index(ctx, len, N, false, order, err), st, out);
    for (int32_t m = 0; m < M; m++) next[m] = b.mb_begin[m];
    for (int32_t i = 0; i < N; i++) {
        int32_t s = order[i];
        b.by_len[next[jt->seq_mb[s]]++] = s;
    }
    /* loads of every (mb, group, layer, rank) under the reference placement */
    for (int32_t m = 0; m < M; m++)
        for (int32_t q = 0; q < b.Q; q++)
            for (int32_t l = 0; l < b.L; l++) {
                const int64_t *hist = grp_row(jt, m, q, l);
                const joint_layer *lay = &ref[l];
                double *u = U_row(&b, m, q, l);
                for (int32_t e = 0; e < b.E; e++) {
                    if (!hist[e]) continue;
                    int32_t r0 = lay->rep_off[e], r1 = lay->rep_off[e + 1];
                    double w = (double)hist[e] / (r1 - r0);
                    for (int32_t r = r0; r < r1; r++) u[lay->rep_rank[r]] += w;
                }
                group_max(&b, m, q, l);
            }
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < b.L; l++) layer_top(&b, m, l);
    if (b.tot)
        for (int32_t q = 0; q < b.Q; q++) b.tot[q] = group_total(&b, q);

    /* microbatches in turn, each with an even share of what is left; a microbatch
     * where no trade helps is done (only its own trades change it) */
    bool any = true;
    while (any && *used < budget) {
        any = false;
        int32_t live = 0;
        for (int32_t m = 0; m < M; m++) live += !stuck[m];
        for (int32_t m = 0; m < M && *used < budget; m++) {
            if (stuck[m]) continue;
            int64_t share = (budget - *used) / (live > 0 ? live : 1) + 1;
            live--;
            bool improved = false;
            *used += round_mb(&b, m, share, &improved);
            if (improved) any = true;
            else stuck[m] = 1;
        }
    }
out:
    rp_free(ctx, b.U);
    rp_free(ctx, b.gmax);
    rp_free(ctx, b.top);
    rp_free(ctx, b.prof);
    rp_free(ctx, b.have);
    rp_free(ctx, b.A);
    rp_free(ctx, b.tok);
    rp_free(ctx, b.attn);
    rp_free(ctx, b.mb_begin);
    rp_free(ctx, b.by_len);
    rp_free(ctx, next);
    rp_free(ctx, stuck);
    rp_free(ctx, b.h);
    rp_free(ctx, b.row);
    rp_free(ctx, b.tot);
    rp_free(ctx, len);
    rp_free(ctx, order);
    return st;
}
