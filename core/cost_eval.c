/* A whole plan's evaluation: the state's arrays, reading a plan into them, what an
 * evaluation will take before it is paid, and rp_cost_evaluate (docs/cost-model.md). */
#include "cost_internal.h"
#include "limits_internal.h"
#include "plan_internal.h"
#include "stats_internal.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

/* ---- state ----------------------------------------------------------------------- */

void cost_state_free(rp_context *ctx, cost_state *s)
{
    if (!s) return;
    void *arrays[] = {s->slot_begin, s->phy2log, s->rep_off, s->rep_rank, s->ov_begin, s->ov,
                      s->extra_rank, s->share_val, s->extra_count, s->seq_rank, s->seq_mb,
                      s->cell_tokens, s->cell_quad, s->cell_pad, s->counts, s->attn,
                      s->dense_f, s->dense_b, s->dfmax, s->dbmax, s->dfarg, s->expert, s->dispatch, s->xmax, s->dmax, s->xarg,
                      s->darg, s->layer_t, s->grad_gpu, s->slot_rank, s->cell_top, s->gtotal,
                      s->gpair, s->lay_dst, s->lay_seg, s->lay_ord, s->vexp_owner,
                      s->pipe_ops, s->pipe_begin, s->pipe_fend, s->pipe_bend, s->pipe_tdev, s->pipe_next};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) rp_free(ctx, arrays[i]);
    rp_free(ctx, s);
}

/* Remember `plan` (a copy) and its summary as the newest evaluation, the bound state's. */
static void memo_push(rp_cost *c, const rp_plan *plan, const rp_cost_summary *sum, double forward_s)
{
    const int32_t at = c->memo_next;
    c->memo_next = (at + 1) % COST_MEMO;
    rp_plan_free(c->memo[at].plan);
    c->memo[at].plan = NULL;
    c->memo_bound = -1;
    if (plan_copy_in(c->ctx, plan, &c->memo[at].plan, NULL) != RP_OK) { /* only a shortcut lost */
        c->memo[at].plan = NULL;
        return;
    }
    c->memo[at].sum = *sum;
    c->memo[at].forward_s = forward_s;
    c->memo_bound = at;
}

rp_status cost_summary_of(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, double *forward_s, rp_error *err)
{
    for (int32_t i = 0; c && plan && i < COST_MEMO; i++)
        if (c->memo[i].plan && rp_plan_equal(c->memo[i].plan, plan)) {
            *out = c->memo[i].sum;
            if (forward_s) *forward_s = c->memo[i].forward_s;
            return RP_OK;
        }
    rp_status st = rp_cost_evaluate(c, plan, out, err);
    if (st == RP_OK && forward_s) *forward_s = c->st->forward_s;
    return st;
}

void cost_scratch_free(rp_context *ctx, cost_scratch *sc)
{
    void *arrays[] = {sc->hist, sc->x, sc->d, sc->si, sc->ri, sc->se, sc->re, sc->xacc, sc->rk,
                      sc->w, sc->load, sc->layer_t, sc->qdf, sc->qdb, sc->qx, sc->qd, sc->rep_off, sc->rep_rank, sc->row,
                      sc->grad_row, sc->total, sc->pair, sc->sp, sc->tok, sc->dst, sc->seg, sc->ord};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) rp_free(ctx, arrays[i]);
    memset(sc, 0, sizeof *sc);
}

/* count * size in bytes, or 0 with *bad set when it overflows. */
static size_t bytes_of(int64_t count, size_t size, bool *bad)
{
    int64_t total;
    if (count < 0 || rp_mul_overflow(count, (int64_t)size, &total) || (uint64_t)total > SIZE_MAX / 2) {
        *bad = true;
        return 0;
    }
    return (size_t)total + 1; /* never a zero-byte request */
}

/* One array of `count` elements, its bytes added to *total. */
static void *take(rp_context *ctx, int64_t count, size_t size, bool zero, bool *bad, size_t *total)
{
    size_t n = bytes_of(count, size, bad);
    if (*bad) return NULL;
    void *p = zero ? rp_calloc(ctx, n, 1) : rp_alloc(ctx, n);
    if (p) *total += n;
    return p;
}

static rp_status scratch_alloc(rp_cost *c, const cost_state *s, cost_scratch *sc, rp_error *err)
{
    bool bad = false;
    rp_context *ctx = c->ctx;
    size_t *total = &sc->bytes;
    int64_t LE = (int64_t)c->L * c->E, ML = (int64_t)s->M * c->L;
    memset(sc, 0, sizeof *sc);
    sc->bytes = 0;
    sc->hist = take(ctx, 2 * LE, sizeof(uint32_t), false, &bad, total);
    sc->x = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->d = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->si = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->ri = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->se = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->re = take(ctx, c->ep, sizeof(double), false, &bad, total);
    /* times, tokens, padded rows, groups */
    sc->xacc = take(ctx, 7 * (int64_t)c->ep, sizeof(double), false, &bad, total);
    sc->rk = take(ctx, s->max_replicas, sizeof(int32_t), false, &bad, total);
    sc->w = take(ctx, s->max_replicas, sizeof(double), false, &bad, total);
    sc->load = take(ctx, s->max_replicas, sizeof(double), false, &bad, total);
    sc->layer_t = take(ctx, ML * c->LW, sizeof(double), false, &bad, total);
    sc->qdf = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qdb = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qx = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qd = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->rep_off = take(ctx, (int64_t)c->E + 1, sizeof(int32_t), false, &bad, total);
    sc->rep_rank = take(ctx, s->S, sizeof(int32_t), false, &bad, total);
    sc->row = take(ctx, s->S, sizeof(int32_t), false, &bad, total);
    sc->grad_row = take(ctx, c->G, sizeof(double), false, &bad, total);
    sc->total = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    sc->pair = take(ctx, (int64_t)c->ep * c->ep, sizeof(int32_t), false, &bad, total);
    sc->sp = take(ctx, (int64_t)c->ep * c->ep, sizeof(double), false, &bad, total);
    sc->tok = take(ctx, c->ep, sizeof(int64_t), false, &bad, total);
    sc->dst = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    sc->seg = take(ctx, (int64_t)c->ep + 2, sizeof(int32_t), false, &bad, total);
    sc->ord = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    if (bad || !sc->total || !sc->pair || !sc->sp || !sc->tok || !sc->dst || !sc->seg || !sc->ord || !sc->hist || !sc->x || !sc->d || !sc->si || !sc->ri || !sc->se || !sc->re ||
        !sc->xacc || !sc->rk || !sc->w || !sc->load || !sc->layer_t || !sc->rep_off || !sc->qdf || !sc->qdb ||
        !sc->qx || !sc->qd ||
        !sc->rep_rank || !sc->row || !sc->grad_row) {
        cost_scratch_free(ctx, sc);
        return bad ? rp_fail(err, RP_ERANGE, "cost: the plan is too large to evaluate")
                   : rp_fail_nomem(err, "the cost evaluator's scratch space");
    }
    return RP_OK;
}

static rp_status fail_expert(rp_error *err, int32_t expert, const char *fmt, ...) RP_PRINTF(3, 4);
static rp_status fail_expert(rp_error *err, int32_t expert, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, RP_EINVAL, fmt, ap);
    va_end(ap);
    if (err) err->expert = expert;
    return RP_EINVAL;
}

/* Shape of the plan against the evaluator's config and batch. */
static rp_status check_plan_shape(const rp_cost *c, const rp_plan *plan, rp_error *err)
{
    if (!plan) return rp_fail(err, RP_EINVAL, "cost: no plan to evaluate");
    if (!rp_plan_has_packing(plan)) return rp_fail(err, RP_EINVAL, "cost: the plan has no packing");
    if (!rp_plan_has_placement(plan)) return rp_fail(err, RP_EINVAL, "cost: the plan has no placement");
    if (rp_plan_num_gpus(plan) != c->G)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d GPUs, but the config has %d", rp_plan_num_gpus(plan),
                       c->G);
    if (rp_plan_ep_size(plan) != c->ep)
        return rp_fail(err, RP_EINVAL, "cost: the plan has EP groups of %d GPUs, but the config has %d",
                       rp_plan_ep_size(plan), c->ep);
    if (rp_plan_num_layers(plan) != c->L)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d layers, but the model has %d",
                       rp_plan_num_layers(plan), c->L);
    if (rp_plan_num_experts(plan) != c->E)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d experts, but the model has %d",
                       rp_plan_num_experts(plan), c->E);
    if (rp_plan_num_microbatches(plan) < 1)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d microbatches", rp_plan_num_microbatches(plan));
    if (rp_plan_num_microbatches(plan) % c->K != 0)
        return rp_fail(err, RP_EINVAL,
                       "cost: the plan has %d microbatches, not a multiple of trainer.mini_batches %d (every "
                       "mini-batch runs the same number)", rp_plan_num_microbatches(plan), c->K);
    if (c->schedule == RP_SCHEDULE_INTERLEAVED && rp_plan_num_microbatches(plan) / c->K % c->PP != 0)
        return rp_fail(err, RP_EINVAL,
                       "cost: the plan has %d microbatches per mini-batch, not a multiple of pipeline_parallel_size "
                       "%d, which the interleaved schedule needs (Megatron)", rp_plan_num_microbatches(plan) / c->K,
                       c->PP);
    const int32_t *sb = rp_plan_slot_begin(plan);
    if (!sb || sb[0] != 0 || sb[c->ep] != rp_plan_total_slots(plan))
        return rp_fail(err, RP_EINVAL, "cost: the plan's slot offsets are inconsistent");
    for (int32_t j = 0; j < c->ep; j++)
        if (sb[j + 1] < sb[j])
            return rp_fail(err, RP_EINVAL, "cost: the plan's EP rank %d has a negative slot count", j);
    return RP_OK;
}

/* Read the packing into seq_rank/seq_mb; every sequence exactly once. */
static rp_status read_packing(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    if (rp_plan_num_seqs(plan) != c->N)
        return rp_fail(err, RP_EINVAL, "cost: the plan packs %d sequences, but the batch has %d",
                       rp_plan_num_seqs(plan), c->N);
    for (int32_t i = 0; i < c->N; i++) s->seq_rank[i] = -1;
    for (int32_t g = 0; g < c->G; g++)
        for (int32_t m = 0; m < s->M; m++) {
            int32_t count = 0;
            const int32_t *list = rp_plan_microbatch(plan, g, m, &count);
            for (int32_t k = 0; k < count; k++) {
                int32_t q = list[k];
                if (q < 0 || q >= c->N)
                    return rp_fail_seq(err, RP_EINVAL, q, "cost: rank %d mb %d holds sequence %d, but the batch has %d",
                                    g, m, q, c->N);
                if (s->seq_rank[q] >= 0)
                    return rp_fail_seq(err, RP_EINVAL, q, "cost: sequence %d is packed twice (rank %d mb %d, rank %d mb %d)",
                                    q, s->seq_rank[q], s->seq_mb[q], g, m);
                s->seq_rank[q] = g;
                s->seq_mb[q] = m;
            }
        }
    for (int32_t i = 0; i < c->N; i++)
        if (s->seq_rank[i] < 0) return rp_fail_seq(err, RP_EINVAL, i, "cost: sequence %d is not packed", i);
    return RP_OK;
}

/* Extra replicas and share sets of the plan, merged per (mb, layer) by expert. */
typedef struct lever_counts {
    int32_t entries, extras, shares;
} lever_counts;

static lever_counts count_levers(const rp_plan *plan)
{
    lever_counts n = {0, 0, 0};
    n.extras = rp_plan_num_extra_replicas(plan);
    int32_t sets = rp_plan_num_share_sets(plan);
    for (int32_t i = 0; i < sets; i++) {
        int32_t count = 0;
        rp_plan_share_set(plan, i, NULL, NULL, NULL, &count);
        if (count > 0) n.shares += count;
    }
    n.entries = n.extras + sets;
    return n;
}

static int key_cmp(int32_t m1, int32_t l1, int32_t e1, int32_t m2, int32_t l2, int32_t e2)
{
    if (m1 != m2) return m1 < m2 ? -1 : 1;
    if (l1 != l2) return l1 < l2 ? -1 : 1;
    if (e1 != e2) return e1 < e2 ? -1 : 1;
    return 0;
}

static rp_status read_levers(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    const int32_t L = c->L, ML = s->M * L;
    int32_t nx = rp_plan_num_extra_replicas(plan), ns = rp_plan_num_share_sets(plan);
    int32_t ix = 0, is = 0, n_ov = 0, n_extra = 0, n_share = 0;
    memset(s->ov_begin, 0, ((size_t)ML + 1) * sizeof *s->ov_begin);
    memset(s->extra_count, 0, (size_t)ML * c->ep * sizeof *s->extra_count);
    int32_t most_extras = 0; /* of one key: with S, bounds every replica set, also after slot moves */
    while (ix < nx || is < ns) {
        int32_t xm, xl, xe, xr, sm = 0, sl = 0, se = 0, scount = 0;
        const double *vals = NULL;
        rp_plan_extra_replica(plan, ix, &xm, &xl, &xe, &xr);
        if (is < ns) vals = rp_plan_share_set(plan, is, &sm, &sl, &se, &scount);
        int cmp = ix >= nx ? 1 : is >= ns ? -1 : key_cmp(xm, xl, xe, sm, sl, se);
        int32_t m = cmp <= 0 ? xm : sm, l = cmp <= 0 ? xl : sl, e = cmp <= 0 ? xe : se;
        if (m < 0 || m >= s->M || l < 0 || l >= L || e < 0 || e >= c->E)
            return fail_expert(err, e, "cost: a lever names mb %d layer %d expert %d, outside the plan", m, l, e);
        cost_override *o = &s->ov[n_ov++];
        o->expert = e;
        o->num_extra = 0;
        o->extra_off = n_extra;
        o->num_shares = 0;
        o->share_off = 0;
        /* every extra replica of this key (they are contiguous and keep insertion order) */
        while (ix < nx) {
            rp_plan_extra_replica(plan, ix, &xm, &xl, &xe, &xr);
            if (key_cmp(xm, xl, xe, m, l, e) != 0) break;
            if (xr < 0 || xr >= c->ep)
                return fail_expert(err, e, "cost: mb %d layer %d expert %d has an extra replica on EP rank %d, "
                                   "but EP groups have %d ranks", m, l, e, xr, c->ep);
            s->extra_rank[n_extra++] = xr;
            s->extra_count[((size_t)m * L + l) * c->ep + xr]++;
            o->num_extra++;
            ix++;
        }
        int32_t nb = s->rep_off[(size_t)l * (c->E + 1) + e + 1] - s->rep_off[(size_t)l * (c->E + 1) + e];
        int32_t R = nb + o->num_extra;
        if (o->num_extra > most_extras) most_extras = o->num_extra;
        if (is < ns && key_cmp(sm, sl, se, m, l, e) == 0) {
            is++;
            if (scount > 0) {
                if (scount != R)
                    return fail_expert(err, e, "cost: mb %d layer %d expert %d has %d shares for %d replicas",
                                       m, l, e, scount, R);
                double sum = 0.0;
                for (int32_t i = 0; i < R; i++) {
                    if (!isfinite(vals[i]) || vals[i] < 0)
                        return fail_expert(err, e, "cost: mb %d layer %d expert %d has share %g for replica %d; "
                                           "shares must be finite and >= 0", m, l, e, vals[i], i);
                    sum += vals[i];
                }
                if (!(fabs(sum - 1.0) <= 1e-6))
                    return fail_expert(err, e, "cost: mb %d layer %d expert %d has shares summing to %.9g, not 1",
                                       m, l, e, sum);
                o->num_shares = R;
                o->share_off = n_share;
                for (int32_t i = 0; i < R; i++) s->share_val[n_share++] = vals[i] / sum;
            }
        }
        s->ov_begin[m * L + l + 1]++;
    }
    for (int32_t i = 0; i < ML; i++) s->ov_begin[i + 1] += s->ov_begin[i];
    if ((int64_t)s->S + most_extras > INT32_MAX / 8)
        return rp_fail(err, RP_ERANGE, "cost: %d slots and %d extra replicas of one expert are too many",
                       s->S, most_extras);
    s->max_replicas = s->S + most_extras;
    return RP_OK;
}

static rp_status read_placement(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    const int32_t S = s->S, E = c->E;
    for (int32_t l = 0; l < c->L; l++) {
        const int32_t *row = rp_plan_phy2log(plan, l);
        int32_t *dst = s->phy2log + (size_t)l * S;
        for (int32_t k = 0; k < S; k++) {
            if (row[k] < -1 || row[k] >= E)
                return fail_expert(err, row[k], "cost: layer %d slot %d holds expert %d, but the model has %d",
                                   l, k, row[k], E);
            dst[k] = row[k];
        }
        int32_t *off = s->rep_off + (size_t)l * (E + 1);
        cost_index_layer(E, S, s->slot_rank, dst, off, s->rep_rank + (size_t)l * S);
        for (int32_t e = 0; e < E; e++)
            if (off[e + 1] == off[e])
                return fail_expert(err, e, "cost: layer %d expert %d has no replica", l, e);
    }
    return RP_OK;
}

static rp_status state_alloc(rp_cost *c, const rp_plan *plan, cost_state **out, rp_error *err)
{
    rp_context *ctx = c->ctx;
    bool bad = false;
    const int64_t M = rp_plan_num_microbatches(plan), S = rp_plan_total_slots(plan);
    const int64_t G = c->G, L = c->L, E = c->E, ep = c->ep, Q = c->Q;
    int64_t ML = M * L, cells = 0; /* M, L < 2^31: no overflow */
    /* every other array is at most a few times `cells`, or L x S < 2^47 */
    if (rp_mul_overflow(ML, G, &cells) || rp_mul_overflow(cells, E, &cells) || cells > ((int64_t)1 << 56))
        return rp_fail(err, RP_ERANGE, "cost: %lld microbatches x %lld layers x %lld GPUs x %lld experts is too "
                       "large to evaluate", (long long)M, (long long)L, (long long)G, (long long)E);
    cost_state *s = rp_calloc(ctx, 1, sizeof *s);
    if (!s) return rp_fail_nomem(err, "a cost evaluation");
    lever_counts lv = count_levers(plan);
    s->bytes = sizeof *s;
    s->plan = plan;
    s->M = (int32_t)M;
    s->S = (int32_t)S;
    s->slot_begin = take(ctx, ep + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->slot_rank = take(ctx, S, sizeof(int32_t), false, &bad, &s->bytes);
    s->phy2log = take(ctx, L * S, sizeof(int32_t), false, &bad, &s->bytes);
    s->rep_off = take(ctx, L * (E + 1), sizeof(int32_t), false, &bad, &s->bytes);
    s->rep_rank = take(ctx, L * S, sizeof(int32_t), false, &bad, &s->bytes);
    s->ov_begin = take(ctx, ML + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->ov = take(ctx, lv.entries, sizeof(cost_override), false, &bad, &s->bytes);
    s->extra_rank = take(ctx, lv.extras, sizeof(int32_t), false, &bad, &s->bytes);
    s->share_val = take(ctx, lv.shares, sizeof(double), false, &bad, &s->bytes);
    s->extra_count = take(ctx, ML * ep, sizeof(int32_t), false, &bad, &s->bytes);
    s->seq_rank = take(ctx, c->N, sizeof(int32_t), false, &bad, &s->bytes);
    s->seq_mb = take(ctx, c->N, sizeof(int32_t), false, &bad, &s->bytes);
    s->cell_tokens = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_quad = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_pad = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_top = take(ctx, G * M, sizeof(int32_t), true, &bad, &s->bytes);
    /* s->counts: by bind_counts, once the packing is read (it may be the bound state's) */
    s->gtotal = take(ctx, ML * Q * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->gpair = take(ctx, ML * Q * ep * ep, sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_dst = take(ctx, L * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_seg = take(ctx, L * (ep + 2), sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_ord = take(ctx, L * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->attn = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dense_f = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dense_b = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dfmax = take(ctx, M * Q, sizeof(double), false, &bad, &s->bytes);
    s->dbmax = take(ctx, M * Q, sizeof(double), false, &bad, &s->bytes);
    s->dfarg = take(ctx, M * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->expert = take(ctx, ML * G, sizeof(double), false, &bad, &s->bytes);
    s->dispatch = take(ctx, ML * G, sizeof(double), false, &bad, &s->bytes);
    s->xmax = take(ctx, ML * Q, sizeof(double), false, &bad, &s->bytes);
    s->dmax = take(ctx, ML * Q, sizeof(double), false, &bad, &s->bytes);
    s->xarg = take(ctx, ML * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->darg = take(ctx, ML * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->layer_t = take(ctx, ML * c->LW, sizeof(double), false, &bad, &s->bytes);
    s->grad_gpu = take(ctx, L * G, sizeof(double), false, &bad, &s->bytes);
    const int64_t PV = (int64_t)c->PP * c->VPP;
    s->pipe_ops = take(ctx, cost_pipe_capacity(c->PP, c->VPP, (int32_t)M), sizeof(cost_pipe_op), false, &bad,
                       &s->bytes);
    s->pipe_begin = take(ctx, c->PP + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->pipe_fend = take(ctx, PV * M, sizeof(double), false, &bad, &s->bytes);
    s->pipe_bend = take(ctx, PV * M, sizeof(double), false, &bad, &s->bytes);
    s->pipe_tdev = take(ctx, c->PP, sizeof(double), false, &bad, &s->bytes);
    s->pipe_next = take(ctx, c->PP, sizeof(int32_t), false, &bad, &s->bytes);
    if (bad || !s->slot_begin || !s->slot_rank || !s->phy2log || !s->rep_off || !s->rep_rank ||
        !s->ov_begin || !s->ov || !s->extra_rank || !s->share_val || !s->extra_count ||
        !s->seq_rank || !s->seq_mb || !s->cell_tokens || !s->cell_quad || !s->cell_pad || !s->cell_top ||
        !s->gtotal || !s->gpair || !s->lay_dst || !s->lay_seg || !s->lay_ord || !s->attn || !s->dense_f || !s->dense_b ||
        !s->dfmax || !s->dbmax || !s->dfarg ||
        !s->expert || !s->dispatch || !s->xmax || !s->dmax || !s->xarg || !s->darg ||
        !s->layer_t || !s->grad_gpu || !s->pipe_ops || !s->pipe_begin || !s->pipe_fend || !s->pipe_bend ||
        !s->pipe_tdev || !s->pipe_next) {
        cost_state_free(ctx, s);
        return bad ? rp_fail(err, RP_ERANGE, "cost: a plan of %lld microbatches is too large to evaluate",
                             (long long)M)
                   : rp_fail_nomem(err, "a cost evaluation");
    }
    cost_pipe_schedule(c->PP, c->VPP, c->schedule, (int32_t)M / c->K, s->pipe_ops, s->pipe_begin);
    *out = s;
    return RP_OK;
}

/* ---- what an evaluation will take, before it is paid ----------------------------------- */

int64_t cost_work_units(const rp_config *cfg, const rp_batch *batch, int64_t M, int64_t S)
{
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *t = rp_config_topology(cfg);
    const int64_t L = md->num_layers, E = md->num_experts, G = t->num_gpus, ep = t->ep_size, Q = G / ep;
    const int64_t N = rp_batch_num_seqs(batch);
    /* as the evaluator counts its operations: every sequence's histogram at every layer,
     * read whole and added (2 E); then per (microbatch, layer): the slots, the (GPU,
     * expert) counts, and each EP group's dispatch pairs, 2 x ep x (E + ep)
     * (cost_group_rebuild; with EP 64 and 256 experts twice the counts), and its pass over
     * its ranks, 3 ep^2 + 5 E + 9 ep (cost_group_eval, cost_dst_map). Without the pass and
     * with only the nonzero experts of a histogram, one evaluation at the DeepSeek-V3-like
     * example was priced at 70% of what it counts (17.1 of 24.2 M) */
    double work = (double)L * ((double)M * S + (double)M * G * E + (double)N * 2.0 * E +
                               (double)M * Q * (2.0 * ep * (E + ep) + 3.0 * ep * ep + 5.0 * E + 9.0 * ep)) + N;
    return work < 9e18 ? (int64_t)work : INT64_MAX;
}

int64_t cost_evaluation_units(const rp_config *cfg, const rp_batch *b)
{
    /* a plan of the expected microbatches over the topology's slots (rp_plan_new counts
     * an EP group's from its EP ranks'), priced as rp_cost_evaluation_needs prices it */
    const rp_topology *t = rp_config_topology(cfg);
    int64_t slots = 0;
    for (int32_t j = 0; j < t->ep_size; j++) slots += t->slots[j];
    return cost_work_units(cfg, b, rp_limits_expected_microbatches(cfg, b), slots);
}

/* Bytes of take(count, size): the same rounding, so the sums below equal what
 * state_alloc and scratch_alloc hand out (tests/test_cost.c holds them to it). */
static void need(int64_t count, size_t size, bool *bad, size_t *total)
{
    size_t n = bytes_of(count, size, bad);
    if (!*bad && n > SIZE_MAX / 4 - *total) *bad = true;
    if (!*bad) *total += n;
}

/* Most extra replicas one (microbatch, layer, expert) has: they are stored sorted by key. */
static int32_t most_extras_of(const rp_plan *plan)
{
    int32_t nx = rp_plan_num_extra_replicas(plan), most = 0, run = 0, pm = -1, pl = -1, pe = -1;
    for (int32_t i = 0; i < nx; i++) {
        int32_t m, l, e, r;
        rp_plan_extra_replica(plan, i, &m, &l, &e, &r);
        run = (m == pm && l == pl && e == pe) ? run + 1 : 1;
        pm = m, pl = l, pe = e;
        if (run > most) most = run;
    }
    return most;
}

rp_status rp_cost_evaluation_needs(const rp_cost *c, const rp_plan *plan, int64_t *units, size_t *bytes,
                                   rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st = check_plan_shape(c, plan, err);
    if (st != RP_OK) return st;
    const int64_t M = rp_plan_num_microbatches(plan), S = rp_plan_total_slots(plan);
    const int64_t G = c->G, L = c->L, E = c->E, ep = c->ep, Q = c->Q, ML = M * L;
    int64_t cells;
    if (rp_mul_overflow(ML, G, &cells) || rp_mul_overflow(cells, E, &cells) || cells > ((int64_t)1 << 56))
        return rp_fail(err, RP_ERANGE, "cost: %lld microbatches x %lld layers x %lld GPUs x %lld experts is too "
                       "large to evaluate", (long long)M, (long long)L, (long long)G, (long long)E);
    lever_counts lv = count_levers(plan);
    bool bad = false;
    size_t total = sizeof(cost_state);
    /* state_alloc, array by array */
    need(ep + 1, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(L * S, sizeof(int32_t), &bad, &total);
    need(L * (E + 1), sizeof(int32_t), &bad, &total);
    need(L * S, sizeof(int32_t), &bad, &total);
    need(ML + 1, sizeof(int32_t), &bad, &total);
    need(lv.entries, sizeof(cost_override), &bad, &total);
    need(lv.extras, sizeof(int32_t), &bad, &total);
    need(lv.shares, sizeof(double), &bad, &total);
    need(ML * ep, sizeof(int32_t), &bad, &total);
    need(c->N, sizeof(int32_t), &bad, &total);
    need(c->N, sizeof(int32_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total); /* cell_pad */
    need(G * M, sizeof(int32_t), &bad, &total);
    need(cells, sizeof(int32_t), &bad, &total);
    need(ML * Q * E, sizeof(int32_t), &bad, &total);
    need(ML * Q * ep * ep, sizeof(int32_t), &bad, &total);
    need(L * E, sizeof(int32_t), &bad, &total);
    need(L * (ep + 2), sizeof(int32_t), &bad, &total);
    need(L * E, sizeof(int32_t), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(M * Q, sizeof(double), &bad, &total);
    need(M * Q, sizeof(double), &bad, &total);
    need(M * Q, sizeof(int32_t), &bad, &total);
    need(ML * G, sizeof(double), &bad, &total);
    need(ML * G, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(int32_t), &bad, &total);
    need(ML * Q, sizeof(int32_t), &bad, &total);
    need(ML * c->LW, sizeof(double), &bad, &total);
    need(L * G, sizeof(double), &bad, &total);
    const int64_t PV = (int64_t)c->PP * c->VPP;
    need(cost_pipe_capacity(c->PP, c->VPP, (int32_t)M), sizeof(cost_pipe_op), &bad, &total);
    need(c->PP + 1, sizeof(int32_t), &bad, &total);
    need(PV * M, sizeof(double), &bad, &total);
    need(PV * M, sizeof(double), &bad, &total);
    need(c->PP, sizeof(double), &bad, &total);
    need(c->PP, sizeof(int32_t), &bad, &total);
    /* scratch_alloc, with max_replicas as read_levers sets it */
    int64_t R = S + most_extras_of(plan);
    need(2 * L * E, sizeof(uint32_t), &bad, &total);
    for (int i = 0; i < 6; i++) need(ep, sizeof(double), &bad, &total);
    need(7 * ep, sizeof(double), &bad, &total); /* xacc */
    need(R, sizeof(int32_t), &bad, &total);
    need(R, sizeof(double), &bad, &total);
    need(R, sizeof(double), &bad, &total);
    need(ML * c->LW, sizeof(double), &bad, &total);
    for (int i = 0; i < 4; i++) need(Q, sizeof(double), &bad, &total);
    need(E + 1, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(G, sizeof(double), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    need(ep * ep, sizeof(int32_t), &bad, &total);
    need(ep * ep, sizeof(double), &bad, &total);
    need(ep, sizeof(int64_t), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    need(ep + 2, sizeof(int32_t), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    if (bad)
        return rp_fail(err, RP_ERANGE, "cost: a plan of %lld microbatches is too large to evaluate", (long long)M);
    if (units) *units = cost_work_units(c->cfg, c->batch, M, S);
    if (bytes) *bytes = total;
    return RP_OK;
}

/* Attention and the dense phase of every cell, and the per-(microbatch, group) maxima. */
static void eval_dense(const rp_cost *c, cost_state *s)
{
    for (int32_t g = 0; g < c->G; g++)
        for (int32_t m = 0; m < s->M; m++) {
            size_t i = (size_t)g * s->M + m;
            const int64_t tok = s->cell_tokens[i] + s->cell_pad[i];
            s->attn[i] = cost_cell_attention(c, s->cell_quad[i], tok, g);
            cost_cell_dense(c, s->cell_quad[i], tok, g, &s->dense_f[i], &s->dense_b[i]);
        }
    for (int32_t m = 0; m < s->M; m++)
        for (int32_t q = 0; q < c->Q; q++) {
            size_t mq = (size_t)m * c->Q + q;
            cost_group_dense(c, s, m, q, -1, 0, 0, 0, -1, 0, 0, 0, &s->dfmax[mq], &s->dbmax[mq], &s->dfarg[mq]);
        }
}

/* Whether `s` packs every sequence where the bound state does, in as many microbatches:
 * then its per-(mb, layer, GPU, expert) counts are the bound state's. */
static bool same_packing(const rp_cost *c, const cost_state *old, const cost_state *s)
{
    return old && old->M == s->M && memcmp(old->seq_rank, s->seq_rank, (size_t)c->N * sizeof *s->seq_rank) == 0 &&
           memcmp(old->seq_mb, s->seq_mb, (size_t)c->N * sizeof *s->seq_mb) == 0;
}

/* The counts array of `s`: fresh zeroed memory, or with the bound state's packing none:
 * the bound state's array is taken over once nothing can fail any more (the commit frees
 * that state anyway), so scoring placements on one packing, as policies and the fallback
 * check do, copies no 12.6 MB per evaluation (reference scale) and faults in no fresh
 * pages for it. Counted in s->bytes either way. */
static rp_status bind_counts(rp_cost *c, cost_state *s, bool same, rp_error *err)
{
    bool bad = false;
    const int64_t cells = (int64_t)s->M * c->L * c->G * c->E; /* state_alloc checked the product */
    if (same) {
        s->bytes += bytes_of(cells, sizeof(int32_t), &bad);
        return RP_OK;
    }
    s->counts = take(c->ctx, cells, sizeof(int32_t), true, &bad, &s->bytes);
    if (!s->counts)
        return bad ? rp_fail(err, RP_ERANGE, "cost: the plan is too large to evaluate")
                   : rp_fail_nomem(err, "a cost evaluation");
    return RP_OK;
}

/* ---- a packing's counts -------------------------------------------------------------- */

/* State s takes a packing's cell sums (copied) and its counts (*counts moves to s and
 * becomes NULL): those of the bound state or of cost_read_packing, instead of reading
 * the histograms again. */
static void take_cells(const rp_cost *c, cost_state *s, const int64_t *tokens, const int64_t *quad,
                       const int64_t *pad, const int32_t *top, int32_t **counts)
{
    const size_t cells = (size_t)c->G * s->M;
    cost_count(c, 2 * (int64_t)c->N + 3 * (int64_t)cells);
    memcpy(s->cell_tokens, tokens, cells * sizeof *s->cell_tokens);
    memcpy(s->cell_quad, quad, cells * sizeof *s->cell_quad);
    memcpy(s->cell_pad, pad, cells * sizeof *s->cell_pad);
    memcpy(s->cell_top, top, cells * sizeof *s->cell_top);
    s->counts = *counts;
    *counts = NULL;
}

/* The cells' tokens, quadratic attention, padding and top sequence, and the per-(mb,
 * layer, GPU, expert) counts of a packing, from the per-sequence histograms (the arrays
 * zeroed by the caller; cell_top is set here). */
static void count_cells(const rp_cost *c, int32_t M, const int32_t *seq_rank, const int32_t *seq_mb,
                        int64_t *cell_tokens, int64_t *cell_quad, int64_t *cell_pad, int32_t *cell_top,
                        int32_t *counts)
{
    const int32_t G = c->G, L = c->L, E = c->E;
    cost_count(c, (int64_t)c->N * (1 + 2 * (int64_t)L * E) + (int64_t)G * M);
    for (size_t i = 0; i < (size_t)G * M; i++) cell_top[i] = -1;
    for (int32_t q = 0; q < c->N; q++) {
        int32_t g = seq_rank[q], m = seq_mb[q];
        int64_t len = c->cu_seqlens[q + 1] - c->cu_seqlens[q];
        size_t cell = (size_t)g * M + m;
        cell_tokens[cell] += len;
        cell_quad[cell] += c->seq_quad[q];
        cell_pad[cell] += cost_pad(c, len);
        if (cell_top[cell] < 0 || cost_seq_attention(c, q) > cost_seq_attention(c, cell_top[cell])) cell_top[cell] = q;
        stats_add_layers(c->stats, q, counts + ((size_t)m * L * G + g) * E, (size_t)G * E);
    }
}

void cost_packed_free(rp_context *ctx, cost_packed *p)
{
    if (!p) return;
    void *arrays[] = {p->seq_rank, p->seq_mb, p->cell_tokens, p->cell_quad, p->cell_pad, p->cell_top, p->counts};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) rp_free(ctx, arrays[i]);
    rp_free(ctx, p);
}

rp_status cost_read_packing(rp_cost *c, int32_t M, const int32_t *seq_rank, const int32_t *seq_mb,
                            const int32_t **counts, rp_error *err)
{
    if (!c || !seq_rank || !seq_mb || !counts) return rp_fail(err, RP_EINVAL, "cost: a packing to read needs its arrays");
    const int32_t N = c->N, G = c->G;
    if (M < 1) return rp_fail(err, RP_EINVAL, "cost: a packing of %d microbatches", M);
    for (int32_t q = 0; q < N; q++)
        if (seq_rank[q] < 0 || seq_rank[q] >= G || seq_mb[q] < 0 || seq_mb[q] >= M)
            return rp_fail_seq(err, RP_EINVAL, q, "cost: sequence %d is on GPU %d microbatch %d, outside %d GPUs x %d "
                               "microbatches", q, seq_rank[q], seq_mb[q], G, M);
    cost_count(c, 2 * (int64_t)N);
    const size_t n = (size_t)N * sizeof *seq_rank;
    const cost_state *b = c->st;
    if (b && b->counts && b->M == M && memcmp(b->seq_rank, seq_rank, n) == 0 && memcmp(b->seq_mb, seq_mb, n) == 0) {
        *counts = b->counts;
        return RP_OK;
    }
    cost_packed *p = c->packed;
    if (p && p->M == M && memcmp(p->seq_rank, seq_rank, n) == 0 && memcmp(p->seq_mb, seq_mb, n) == 0) {
        *counts = p->counts;
        return RP_OK;
    }
    cost_packed_free(c->ctx, c->packed);
    c->packed = NULL;
    int64_t cells;
    if (rp_mul_overflow((int64_t)M * c->L, (int64_t)G * c->E, &cells) || cells > ((int64_t)1 << 56))
        return rp_fail(err, RP_ERANGE, "cost: %d microbatches of the packing are too many to read", M);
    bool bad = false;
    size_t bytes = sizeof *p;
    p = rp_calloc(c->ctx, 1, sizeof *p);
    if (!p) return rp_fail_nomem(err, "a packing's counts");
    p->M = M;
    p->seq_rank = take(c->ctx, N, sizeof(int32_t), false, &bad, &bytes);
    p->seq_mb = take(c->ctx, N, sizeof(int32_t), false, &bad, &bytes);
    p->cell_tokens = take(c->ctx, (int64_t)G * M, sizeof(int64_t), true, &bad, &bytes);
    p->cell_quad = take(c->ctx, (int64_t)G * M, sizeof(int64_t), true, &bad, &bytes);
    p->cell_pad = take(c->ctx, (int64_t)G * M, sizeof(int64_t), true, &bad, &bytes);
    p->cell_top = take(c->ctx, (int64_t)G * M, sizeof(int32_t), true, &bad, &bytes);
    p->counts = take(c->ctx, cells, sizeof(int32_t), true, &bad, &bytes);
    if (bad || !p->seq_rank || !p->seq_mb || !p->cell_tokens || !p->cell_quad || !p->cell_pad || !p->cell_top ||
        !p->counts) {
        cost_packed_free(c->ctx, p);
        return bad ? rp_fail(err, RP_ERANGE, "cost: the packing is too large to read")
                   : rp_fail_nomem(err, "a packing's counts");
    }
    p->bytes = bytes;
    memcpy(p->seq_rank, seq_rank, n);
    memcpy(p->seq_mb, seq_mb, n);
    count_cells(c, M, seq_rank, seq_mb, p->cell_tokens, p->cell_quad, p->cell_pad, p->cell_top, p->counts);
    c->packed = p;
    *counts = p->counts;
    return RP_OK;
}

/* Every EP group of (m, l) and the layer's times there, into the state. */
static void eval_layer_at(const rp_cost *c, cost_state *s, cost_scratch *sc, int32_t m, int32_t l)
{
    const int32_t G = c->G, L = c->L, E = c->E, ep = c->ep;
    size_t ml = (size_t)m * L + l;
    const int32_t *off = s->rep_off + (size_t)l * (E + 1), *rank = s->rep_rank + (size_t)l * s->S;
    cost_map map = cost_dst_map(c, s, m, l, off, rank, true, sc);
    for (int32_t q = 0; q < c->Q; q++) {
        group_result r;
        size_t gq = ml * c->Q + q;
        int32_t *total = s->gtotal + gq * E;
        int32_t *pair = s->gpair + gq * ep * ep;
        cost_group_rebuild(c, s, m, l, q, map, total, pair);
        cost_group_tokens(c, s, m, q, sc->tok);
        cost_group_eval(c, s, m, l, q, off, rank, map, total, pair, sc->tok, s->expert + ml * G + (size_t)q * ep,
                        s->dispatch + ml * G + (size_t)q * ep, &r, sc);
        s->xmax[gq] = r.xmax;
        s->dmax[gq] = r.dmax;
        s->xarg[gq] = r.xarg;
        s->darg[gq] = r.darg;
    }
    cost_layer_times(c, s->dfmax + (size_t)m * c->Q, s->dbmax + (size_t)m * c->Q, s->dmax + ml * c->Q,
                     s->xmax + ml * c->Q, s->layer_t + ml * c->LW);
}

/* What follows the layers: the gradient reduction over the layers' rows, the extra
 * replicas' copies and the step. */
static void eval_tail(const rp_cost *c, cost_state *s)
{
    const int32_t L = c->L, M = s->M, ep = c->ep;
    s->grad_s = cost_grad_total(c, s, -1, NULL);
    /* Extra replicas: a weight copy over NVLink before the microbatch's layer and its
     * gradient back after it; copies to different GPUs run in parallel. Under PP a
     * stage's GPUs copy only its own layers' replicas, and the stages copy at once: the
     * stage with the most copy time counts (PP 1: the sum, in the same order). */
    s->extra_s = 0.0;
    for (int32_t r = 0; r < c->PP; r++) {
        double stage_s = 0.0;
        if (c->extras_once) {
            stage_s = cost_extras_once(c, s, r, false, c->extras_ahead);
            if (stage_s > s->extra_s) s->extra_s = stage_s;
            continue;
        }
        for (int32_t i = 0; i < M * L; i++) {
            if (c->layer_stage[i % L] != r) continue;
            int32_t most = 0;
            for (int32_t j = 0; j < ep; j++)
                if (s->extra_count[(size_t)i * ep + j] > most) most = s->extra_count[(size_t)i * ep + j];
            if (most > 0) stage_s += 2.0 * (most * c->expert_bytes / c->nv_bw + c->nv_lat);
        }
        if (stage_s > s->extra_s) s->extra_s = stage_s;
    }
    s->step_s = cost_step_from(c, s, s->layer_t, s->grad_s);
}

/* ---- a placement change on the bound packing ------------------------------------- */

/* Whether `plan` is the bound state's plan (the memo's copy: the state is its evaluation,
 * unedited) with other placement rows only: the same shape, packing and microbatch order,
 * neither with levers (extra replicas, shares) nor per-forward balancing. Its evaluation
 * then differs from the bound state's in the changed layers alone, as a policy scoring
 * placements on one packing compares them (policies/routepack.lua's persistence measure:
 * placements a step or two apart, a few layers re-placed). */
static bool rows_only(const rp_cost *c, const rp_plan *plan)
{
    if (!c->st || c->memo_bound < 0 || c->st->vexp) return false;
    const rp_plan *b = c->memo[c->memo_bound].plan;
    if (!b || !rp_plan_has_packing(plan) || !rp_plan_has_placement(plan) ||
        rp_plan_balancing(plan) == RP_BALANCING_VIRTUAL_EXPERTS || rp_plan_num_extra_replicas(plan) > 0 ||
        rp_plan_num_share_sets(plan) > 0)
        return false;
    /* the comparison reads the packing's lists once */
    cost_count(c, (int64_t)c->N + (int64_t)c->G * rp_plan_num_microbatches(plan) + c->ep);
    return plan_equal_but_rows(b, plan);
}

/* rp_cost_evaluate of a plan rows_only accepts: the changed layers' rows are checked as
 * read_placement checks them (the state is untouched when one fails), then re-read and
 * re-evaluated at every microbatch through the full evaluation's functions, in place,
 * and the gradient, extras and step follow from all layers' results. The result equals a
 * full evaluation's bit for bit: every (microbatch, layer) result depends on its own
 * layer's row, counts and levers only. */
static rp_status evaluate_rows(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, rp_error *err)
{
    cost_state *s = c->st;
    cost_scratch *sc = &c->sc;
    const rp_plan *b = c->memo[c->memo_bound].plan;
    const int32_t L = c->L, E = c->E, S = s->S, M = s->M, G = c->G;
    cost_count(c, (int64_t)L * S);
    for (int32_t l = 0; l < L; l++) {
        const int32_t *row = rp_plan_phy2log(plan, l);
        if (memcmp(row, rp_plan_phy2log(b, l), (size_t)S * sizeof *row) == 0) continue;
        cost_count(c, 2 * (int64_t)S + 2 * (int64_t)E);
        for (int32_t k = 0; k < S; k++)
            if (row[k] < -1 || row[k] >= E)
                return fail_expert(err, row[k], "cost: layer %d slot %d holds expert %d, but the model has %d", l, k,
                                   row[k], E);
        cost_index_layer(E, S, s->slot_rank, row, sc->rep_off, sc->rep_rank);
        for (int32_t e = 0; e < E; e++)
            if (sc->rep_off[e + 1] == sc->rep_off[e])
                return fail_expert(err, e, "cost: layer %d expert %d has no replica", l, e);
    }
    cost_state_edited(c);
    s->plan = plan; /* the bound plan's copy may be gone; this one has its microbatch order */
    for (int32_t l = 0; l < L; l++) {
        const int32_t *row = rp_plan_phy2log(plan, l);
        int32_t *dst = s->phy2log + (size_t)l * S;
        if (memcmp(row, dst, (size_t)S * sizeof *row) == 0) continue;
        int32_t *off = s->rep_off + (size_t)l * (E + 1), *rank = s->rep_rank + (size_t)l * S;
        memcpy(dst, row, (size_t)S * sizeof *row);
        cost_index_layer(E, S, s->slot_rank, dst, off, rank);
        cost_count(c, 3 * (int64_t)S + 3 * (int64_t)E + (int64_t)M * (c->Q + c->ep + 1));
        cost_layer_dst(c, s, l, off, rank);
        for (int32_t m = 0; m < M; m++) eval_layer_at(c, s, sc, m, l);
        cost_grad_layer(c, s, l, off, rank, s->grad_gpu + (size_t)l * G, NULL);
    }
    eval_tail(c, s);
    rp_cost_summary sum;
    cost_summary(c, s, &sum);
    s->forward_s = cost_forward_s(c, s);
    memo_push(c, plan, &sum, s->forward_s);
    if (out) *out = sum;
    return RP_OK;
}

rp_status rp_cost_evaluate(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st = check_plan_shape(c, plan, err);
    if (st != RP_OK) return st;
    if (c->st && c->memo_bound >= 0 && rp_plan_equal(c->memo[c->memo_bound].plan, plan)) {
        /* the bound state is this plan's evaluation: bind it to this copy of the plan */
        c->st->plan = plan;
        if (out) *out = c->memo[c->memo_bound].sum;
        return RP_OK;
    }
    if (rows_only(c, plan)) return evaluate_rows(c, plan, out, err);
    cost_state *s = NULL;
    cost_scratch sc;
    memset(&sc, 0, sizeof sc);
    RP_CHECK_GOTO(state_alloc(c, plan, &s, err), st, out);
    const int32_t G = c->G, L = c->L, E = c->E, M = s->M, ep = c->ep;
    memcpy(s->slot_begin, rp_plan_slot_begin(plan), ((size_t)ep + 1) * sizeof(int32_t));
    s->slots_max = 0;
    for (int32_t j = 0; j < ep; j++) {
        int32_t n = s->slot_begin[j + 1] - s->slot_begin[j];
        if (n > s->slots_max) s->slots_max = n;
        for (int32_t k = s->slot_begin[j]; k < s->slot_begin[j + 1]; k++) s->slot_rank[k] = j;
    }
    /* reading the plan, zeroing the counts (calloc) and the slots' ranks */
    cost_count(c, (int64_t)G * M + 2 * (int64_t)c->N + (int64_t)L * (2 * (int64_t)s->S + 3 * (int64_t)E + s->S) +
                      rp_plan_num_extra_replicas(plan) + rp_plan_num_share_sets(plan) + (int64_t)M * L * (ep + 1) +
                      (int64_t)M * L * G * E + s->S);
    RP_CHECK_GOTO(read_packing(c, plan, s, err), st, out);
    const bool same = same_packing(c, c->st, s);
    const bool ahead = !same && c->packed && c->packed->M == s->M &&
                       memcmp(c->packed->seq_rank, s->seq_rank, (size_t)c->N * sizeof *s->seq_rank) == 0 &&
                       memcmp(c->packed->seq_mb, s->seq_mb, (size_t)c->N * sizeof *s->seq_mb) == 0;
    RP_CHECK_GOTO(bind_counts(c, s, same || ahead, err), st, out);
    RP_CHECK_GOTO(read_placement(c, plan, s, err), st, out);
    RP_CHECK_GOTO(read_levers(c, plan, s, err), st, out);
    RP_CHECK_GOTO(scratch_alloc(c, s, &sc, err), st, out);
    if (rp_plan_balancing(plan) == RP_BALANCING_VIRTUAL_EXPERTS) {
        RP_CHECK_GOTO(cost_vexp_check(c, plan, err), st, out);
        s->vexp_owner = rp_alloc(c->ctx, (size_t)L * E * sizeof *s->vexp_owner);
        if (!s->vexp_owner) {
            st = rp_fail_nomem(err, "the experts' owners");
            goto out;
        }
        cost_vexp_owners(c, plan, s->vexp_owner);
        s->vexp = true;
    }

    /* Counts per (mb, layer, GPU, expert) from the per-sequence histograms; when the
     * packing is the one already bound (the same plan with another placement, as
     * policies compare them), the sums are copied instead of read again. */
    if (same) {
        /* nothing below fails: the bound state's counts become this state's */
        cost_state *old = c->st;
        cost_count(c, (int64_t)M * L * G * E);
        take_cells(c, s, old->cell_tokens, old->cell_quad, old->cell_pad, old->cell_top, &old->counts);
    } else if (ahead) {
        /* the same, from the counts read ahead (cost_read_packing), which are then spent */
        cost_packed *pk = c->packed;
        take_cells(c, s, pk->cell_tokens, pk->cell_quad, pk->cell_pad, pk->cell_top, &pk->counts);
        cost_packed_free(c->ctx, pk);
        c->packed = NULL;
    } else {
        count_cells(c, M, s->seq_rank, s->seq_mb, s->cell_tokens, s->cell_quad, s->cell_pad, s->cell_top, s->counts);
    }

    eval_dense(c, s);
    cost_count(c, (int64_t)M * G + (int64_t)M * L * (c->Q + ep + 1));
    for (int32_t l = 0; l < L; l++)
        cost_layer_dst(c, s, l, s->rep_off + (size_t)l * (E + 1), s->rep_rank + (size_t)l * s->S);
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < L; l++) eval_layer_at(c, s, &sc, m, l);
    for (int32_t l = 0; l < L; l++)
        cost_grad_layer(c, s, l, s->rep_off + (size_t)l * (E + 1), s->rep_rank + (size_t)l * s->S,
                        s->grad_gpu + (size_t)l * G, NULL);
    eval_tail(c, s);

    /* commit (nothing below can fail) */
    cost_state_free(c->ctx, c->st);
    cost_scratch_free(c->ctx, &c->sc);
    c->st = s;
    c->sc = sc;
    s = NULL;
    memset(&sc, 0, sizeof sc);
    rp_cost_summary sum;
    cost_summary(c, c->st, &sum);
    c->st->forward_s = cost_forward_s(c, c->st);
    memo_push(c, plan, &sum, c->st->forward_s);
    if (out) *out = sum;
out:
    cost_state_free(c->ctx, s);
    cost_scratch_free(c->ctx, &sc);
    return st;
}
