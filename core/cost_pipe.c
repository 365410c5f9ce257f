/* The pipeline: the order in which every stage runs its forward and backward passes
 * (1F1B, Megatron's interleaved 1F1B) and the critical path of that dependency graph,
 * which is the step under pipeline parallelism (docs/cost-model.md, "Pipeline
 * parallelism"). */
#include "cost_internal.h"

#include <math.h>
#include <string.h>

int64_t cost_pipe_capacity(int32_t PP, int32_t V, int32_t M) { return 2 * (int64_t)PP * V * M; }

/* Megatron-Core's get_schedule_table (pipeline_parallel/schedules.py): the k-th forward of
 * a stage runs microbatch mb of model chunk chunk, in groups of `group` microbatches per
 * chunk; the last group takes what is left. */
static void table_entry(int32_t M, int32_t V, int32_t group, int32_t k, int32_t *mb, int32_t *chunk)
{
    int32_t first = 0;
    for (;;) {
        int32_t size = first + group >= M ? M - first : group;
        if (k < size * V) {
            *chunk = k / size;
            *mb = first + k % size;
            return;
        }
        k -= size * V;
        first += size;
    }
}

static void put(cost_pipe_op *ops, int32_t *n, int32_t kind, int32_t v, int32_t k)
{
    ops[*n] = (cost_pipe_op){.kind = kind, .v = v, .k = k};
    (*n)++;
}

void cost_pipe_schedule(int32_t PP, int32_t V, rp_pipeline_schedule schedule, int32_t M, cost_pipe_op *ops,
                        int32_t *begin)
{
    int32_t n = 0;
    const int32_t total = M * V, last = PP * V - 1;
    for (int32_t r = 0; r < PP; r++) {
        begin[r] = n;
        const int32_t first_op = n;
        /* warm-up forwards: 1F1B, PP - r - 1 (PipeDream-Flush); interleaved, Megatron's
         * (PP - r - 1) x 2 + (V - 1) x PP, all of them when that reaches the total */
        int32_t warmup = schedule == RP_SCHEDULE_INTERLEAVED ? (PP - r - 1) * 2 + (V - 1) * PP : PP - r - 1;
        if (warmup > total) warmup = total;
        for (int32_t j = 0; j < total + total; j++) {
            /* the j-th op of the stage: warm-up forwards, then forward i + warmup and
             * backward i alternating (1F1B), then the cool-down backwards */
            int32_t fwd, idx;
            if (j < warmup) fwd = 1, idx = j;
            else if (j < warmup + 2 * (total - warmup)) {
                int32_t i = (j - warmup) / 2;
                fwd = (j - warmup) % 2 == 0;
                idx = fwd ? i + warmup : i;
            } else {
                fwd = 0, idx = j - total;
            }
            int32_t mb, chunk;
            if (V == 1) mb = idx, chunk = 0;
            else table_entry(M, V, PP, idx, &mb, &chunk);
            if (!fwd) chunk = V - 1 - chunk; /* backwards run the chunks in reverse */
            put(ops, &n, fwd ? COST_PIPE_F : COST_PIPE_B, chunk * PP + r, mb);
        }
        /* A forward of the last virtual stage followed at once by its own backward is one
         * pass over the layers: priced by the layers' combined times, as with one stage. */
        int32_t w = first_op;
        for (int32_t i = first_op; i < n; i++) {
            cost_pipe_op op = ops[i];
            if (op.kind == COST_PIPE_F && op.v == last && i + 1 < n && ops[i + 1].kind == COST_PIPE_B &&
                ops[i + 1].v == last && ops[i + 1].k == op.k) {
                op.kind = COST_PIPE_FB;
                i++;
            }
            ops[w++] = op;
        }
        n = w;
    }
    begin[PP] = n;
}

double cost_pipe_run(int32_t PP, int32_t V, int32_t M, const cost_pipe_op *ops, const int32_t *begin,
                     cost_pipe_buf *buf, const cost_pipe_times *times)
{
    const int32_t VS = PP * V;
    for (int64_t i = 0; i < (int64_t)VS * M; i++) buf->fend[i] = buf->bend[i] = -1.0;
    for (int32_t r = 0; r < PP; r++) buf->tdev[r] = 0.0, buf->next[r] = begin[r];
    int64_t left = begin[PP] - begin[0];
    while (left > 0) {
        int64_t ran = 0;
        for (int32_t r = 0; r < PP; r++) {
            for (; buf->next[r] < begin[r + 1]; buf->next[r]++) {
                const cost_pipe_op op = ops[buf->next[r]];
                const int64_t cell = (int64_t)op.v * M + op.k;
                /* what the op waits for: the previous virtual stage's forward, the next
                 * one's backward (or, on the last, its own forward), sent over p2p */
                double ready = buf->tdev[r], dep;
                int32_t from;
                if (op.kind == COST_PIPE_B && op.v < VS - 1) from = op.v + 1, dep = buf->bend[cell + M];
                else if (op.kind == COST_PIPE_B) from = op.v, dep = buf->fend[cell];
                else if (op.v > 0) from = op.v - 1, dep = buf->fend[cell - M];
                else from = op.v, dep = 0.0;
                if (dep < 0) break; /* not yet run: another stage first */
                if (from != op.v) dep += times->p2p(times->ud, op.kind, from, op.v, op.k);
                if (dep > ready) ready = dep;
                double end = times->run(times->ud, op.kind, op.v, op.k, ready);
                if (op.kind != COST_PIPE_B) buf->fend[cell] = end;
                if (op.kind != COST_PIPE_F) buf->bend[cell] = end;
                buf->tdev[r] = end;
                ran++;
            }
        }
        if (ran == 0) return INFINITY; /* a schedule that deadlocks (never built here) */
        left -= ran;
    }
    double span = 0.0;
    for (int32_t r = 0; r < PP; r++)
        if (buf->tdev[r] > span) span = buf->tdev[r];
    return span;
}

/* ---- the cost model's op times --------------------------------------------------- */

typedef struct domain_times {
    const rp_cost *c;
    const cost_state *st;
    const double *layer_t;
    int32_t q;
    int32_t base;         /* the mini-batch's first position: an op's k counts from it */
    const int32_t *order; /* microbatch run at each position */
} domain_times;

/* An op's end: its start plus, layer by layer, the layers' times (forward, backward, or
 * both at once), accumulated onto the start so that one stage adds exactly as the sum
 * over (m, l) of PP 1 does. */
static double domain_run(void *ud, int32_t kind, int32_t v, int32_t k, double start)
{
    const domain_times *d = ud;
    const rp_cost *c = d->c;
    const int32_t pos = d->base + k, m = d->order ? d->order[pos] : pos, l0 = c->stage_begin[v],
                  l1 = l0 + c->stage_layers[v];
    const size_t off = kind == COST_PIPE_FB ? 0 : kind == COST_PIPE_F ? (size_t)c->NQ : 2 * (size_t)c->NQ;
    double t = start;
    for (int32_t l = l0; l < l1; l++) t += d->layer_t[((size_t)m * c->L + l) * c->LW + off + d->q];
    return t;
}

/* Activations (forward) or their gradients (backward) of one microbatch between
 * adjacent stages: the domain's largest cell, d x bytes_per_param per token, split over
 * the TP group's GPUs (Megatron's scatter-gather p2p), over NVLink inside a node. */
static double domain_p2p(void *ud, int32_t kind, int32_t from, int32_t to, int32_t k)
{
    (void)kind;
    const domain_times *d = ud;
    const rp_cost *c = d->c;
    const cost_state *st = d->st;
    const int32_t pos = d->base + k, m = d->order ? d->order[pos] : pos, M = st->M;
    const int32_t g0 = c->NQ == 1 ? 0 : d->q * c->ep, g1 = c->NQ == 1 ? c->G : g0 + c->ep;
    const cost_scratch *sc = &c->sc;
    const bool trial = d->layer_t == sc->layer_t && sc->trial_cells > 0;
    int64_t most = 0;
    for (int32_t g = g0; g < g1; g++) {
        int64_t tok = st->cell_tokens[(size_t)g * M + m];
        for (int32_t i = 0; trial && i < sc->trial_cells; i++)
            if (sc->trial_g[i] == g && sc->trial_m[i] == m) tok = sc->trial_tok[i];
        if (tok > most) most = tok;
    }
    const int32_t a = (from < to ? from : to) % c->PP;
    const bool same_node = c->pipe_same_node[a];
    return (double)most * c->p2p_token_bytes / (same_node ? c->nv_bw : c->net_bw) +
           (same_node ? c->nv_lat : c->net_lat);
}

double cost_pipe_domain(const rp_cost *c, const cost_state *st, const double *layer_t, int32_t q, int32_t b)
{
    const int32_t Mk = st->M / c->K; /* each mini-batch is a pipeline of its own */
    domain_times d = {.c = c, .st = st, .layer_t = layer_t, .q = q, .base = b * Mk,
                      .order = cost_domain_order(c, st, q)};
    cost_pipe_times times = {.run = domain_run, .p2p = domain_p2p, .ud = &d};
    cost_pipe_buf buf = {.fend = st->pipe_fend, .bend = st->pipe_bend, .tdev = st->pipe_tdev, .next = st->pipe_next};
    cost_count(c, (int64_t)Mk * c->L);
    return cost_pipe_run(c->PP, c->VPP, Mk, st->pipe_ops, st->pipe_begin, &buf, &times);
}

/* The order of the domain's first rank: validation keeps one order per EP group (per
 * job under global sync), so it is every rank's of the domain. */
const int32_t *cost_domain_order(const rp_cost *c, const cost_state *st, int32_t q)
{
    return rp_plan_microbatch_order(st->plan, c->NQ == 1 ? 0 : q * c->ep);
}

/* ---- choosing the microbatch order ------------------------------------------------ */

/* Pass times of one sync domain by (virtual stage, microbatch), summed once, and the p2p
 * times by (stage boundary, microbatch): a candidate order is then a run over the
 * schedule without the layers. The chosen order's step is computed afresh, exactly. */
typedef struct order_search {
    int32_t M, VS, PP;
    double *tf, *tb, *tfb; /* [VS * M] */
    double *p2p;           /* [PP * M]: from stage r's boundary (r to r + 1 mod PP) */
    double *work;          /* [M] every pass of each microbatch, summed */
    const int32_t *order;  /* the candidate */
} order_search;

static double search_run(void *ud, int32_t kind, int32_t v, int32_t k, double start)
{
    const order_search *o = ud;
    const size_t i = (size_t)v * o->M + o->order[k];
    return start + (kind == COST_PIPE_F ? o->tf[i] : kind == COST_PIPE_B ? o->tb[i] : o->tfb[i]);
}

static double search_p2p(void *ud, int32_t kind, int32_t from, int32_t to, int32_t k)
{
    (void)kind;
    const order_search *o = ud;
    const int32_t a = (from < to ? from : to) % o->PP;
    return o->p2p[(size_t)a * o->M + o->order[k]];
}

/* Orders up to this many microbatches are searched exhaustively (6! = 720 runs); up to
 * ORDER_SWAP_MAX, improved by pairwise swaps (at most ORDER_SWAP_ROUNDS sweeps). */
#define ORDER_EXACT_MAX 6
#define ORDER_SWAP_MAX 32
#define ORDER_SWAP_ROUNDS 3

static double try_order(const rp_cost *c, const cost_state *st, order_search *o, cost_pipe_buf *buf,
                        const int32_t *order)
{
    o->order = order;
    cost_pipe_times times = {.run = search_run, .p2p = search_p2p, .ud = o};
    cost_count(c, st->pipe_begin[c->PP]);
    return cost_pipe_run(c->PP, c->VPP, o->M, st->pipe_ops, st->pipe_begin, buf, &times);
}

/* The best order of one domain's mini-batch (o->M microbatches) into best[o->M]: every
 * permutation (Heap's algorithm) when it is small, else the better of the identity and
 * verl's (light microbatches at both ends, heavy ones in the middle) improved by pairwise
 * swaps while any helps. */
static void search_domain(const rp_cost *c, const cost_state *st, order_search *o, cost_pipe_buf *buf,
                          int32_t *best, int32_t *cur, int32_t *stack)
{
    const int32_t M = o->M;
    for (int32_t k = 0; k < M; k++) best[k] = cur[k] = k;
    double best_t = try_order(c, st, o, buf, best);
    if (M <= ORDER_EXACT_MAX) {
        for (int32_t k = 0; k < M; k++) stack[k] = 0;
        for (int32_t i = 1; i < M;) {
            if (stack[i] < i) {
                int32_t j = i % 2 == 0 ? 0 : stack[i], t = cur[j];
                cur[j] = cur[i];
                cur[i] = t;
                double span = try_order(c, st, o, buf, cur);
                if (span < best_t) {
                    best_t = span;
                    memcpy(best, cur, (size_t)M * sizeof *cur);
                }
                stack[i]++;
                i = 1;
            } else {
                stack[i++] = 0;
            }
        }
        return;
    }
    /* verl's rearrange_micro_batches: sorted by work descending, then [::2][::-1] + [1::2] */
    for (int32_t k = 0; k < M; k++) {
        stack[k] = k;
        o->work[k] = 0.0;
        for (int32_t v = 0; v < o->VS; v++) o->work[k] += o->tf[(size_t)v * M + k] + o->tb[(size_t)v * M + k];
    }
    /* a stable merge-free sort: insertion, fine for the M a pipeline runs */
    cost_count(c, (int64_t)M * M);
    for (int32_t a = 1; a < M; a++)
        for (int32_t b = a; b > 0 && o->work[stack[b]] > o->work[stack[b - 1]]; b--) {
            int32_t t = stack[b];
            stack[b] = stack[b - 1];
            stack[b - 1] = t;
        }
    int32_t n = 0;
    for (int32_t b = (M - 1) / 2 * 2; b >= 0; b -= 2) cur[n++] = stack[b];
    for (int32_t b = 1; b < M; b += 2) cur[n++] = stack[b];
    double cur_t = try_order(c, st, o, buf, cur);
    if (cur_t < best_t) {
        best_t = cur_t;
        memcpy(best, cur, (size_t)M * sizeof *cur);
    }
    memcpy(cur, best, (size_t)M * sizeof *cur);
    for (int32_t round = 0; M <= ORDER_SWAP_MAX && round < ORDER_SWAP_ROUNDS; round++) {
        bool better = false;
        for (int32_t i = 0; i < M; i++)
            for (int32_t j = i + 1; j < M; j++) {
                int32_t t = cur[i];
                cur[i] = cur[j];
                cur[j] = t;
                double span = try_order(c, st, o, buf, cur);
                if (span < best_t) {
                    best_t = span;
                    memcpy(best, cur, (size_t)M * sizeof *cur);
                    better = true;
                } else {
                    cur[j] = cur[i];
                    cur[i] = t;
                }
            }
        if (!better) break;
    }
}

/* Sum of a pass's layer times (forward, backward or both) for one search table. */
static double pass_sum(const rp_cost *c, const double *layer_t, int32_t m, int32_t v, size_t off, int32_t q)
{
    double t = 0.0;
    for (int32_t l = c->stage_begin[v]; l < c->stage_begin[v] + c->stage_layers[v]; l++)
        t += layer_t[((size_t)m * c->L + l) * c->LW + off + q];
    return t;
}

rp_status rp_cost_order_microbatches(rp_cost *c, rp_plan *plan, double *step_s, rp_error *err)
{
    if (!c || !plan) return rp_fail(err, RP_EINVAL, "cost: rp_cost_order_microbatches needs an evaluator and a plan");
    cost_state *st = c->st;
    if (!st || st->plan != plan)
        return rp_fail(err, RP_EINVAL, "cost: the plan to order is not the one the evaluator is bound to: evaluate it "
                       "first");
    const int32_t M = st->M, VS = c->PP * c->VPP, Mk = M / c->K;
    if (c->PP == 1 || Mk < 2 || M > 4096) { /* nothing to gain (one stage), or beyond the search's reach */
        if (step_s) *step_s = st->step_s;
        return RP_OK;
    }
    const size_t vm = (size_t)VS * M;
    double *dbuf = rp_alloc(c->ctx, (3 * vm + (size_t)c->PP * M + 2 * vm + c->PP + M) * sizeof(double));
    int32_t *ibuf = rp_alloc(c->ctx, ((size_t)(2 * c->NQ + 3) * M + c->PP) * sizeof(int32_t));
    if (!dbuf || !ibuf) {
        rp_free(c->ctx, dbuf);
        rp_free(c->ctx, ibuf);
        return rp_fail_nomem(err, "ordering the microbatches");
    }
    order_search o = {.M = Mk, .VS = VS, .PP = c->PP, .tf = dbuf, .tb = dbuf + vm, .tfb = dbuf + 2 * vm,
                      .p2p = dbuf + 3 * vm, .work = dbuf + 5 * vm + (size_t)c->PP * M + c->PP};
    cost_pipe_buf buf = {.fend = o.p2p + (size_t)c->PP * M, .bend = o.p2p + (size_t)c->PP * M + vm,
                         .tdev = o.p2p + (size_t)c->PP * M + 2 * vm, .next = ibuf + (size_t)(c->NQ + 3) * M};
    int32_t *chosen = ibuf, *cur = ibuf + (size_t)c->NQ * M, *stack = cur + M, *ident = stack + M,
            *before = ident + M + c->PP; /* [NQ * M] each domain's order as it was */
    for (int32_t k = 0; k < M; k++) ident[k] = k;
    /* each mini-batch is a pipeline of its own: its order permutes its own microbatches */
    for (int32_t q = 0; q < c->NQ; q++)
        for (int32_t b = 0; b < c->K; b++) {
            const int32_t base = b * Mk;
            cost_count(c, (int64_t)Mk * c->L * 3 + (int64_t)c->PP * Mk);
            for (int32_t v = 0; v < VS; v++)
                for (int32_t i = 0; i < Mk; i++) {
                    const size_t at = (size_t)v * Mk + i;
                    o.tf[at] = pass_sum(c, st->layer_t, base + i, v, (size_t)c->NQ, q);
                    o.tb[at] = pass_sum(c, st->layer_t, base + i, v, 2 * (size_t)c->NQ, q);
                    o.tfb[at] = pass_sum(c, st->layer_t, base + i, v, 0, q);
                }
            domain_times d = {.c = c, .st = st, .layer_t = st->layer_t, .q = q, .base = base, .order = ident};
            for (int32_t r = 0; r < c->PP; r++)
                for (int32_t i = 0; i < Mk; i++)
                    o.p2p[(size_t)r * Mk + i] = domain_p2p(&d, COST_PIPE_F, r, r + 1, i);
            int32_t *best = chosen + (size_t)q * M + base;
            search_domain(c, st, &o, &buf, best, cur, stack);
            for (int32_t i = 0; i < Mk; i++) best[i] += base;
        }
    cost_state_edited(c);
    /* commit: the first call may allocate the plan's order (nothing changed if it fails);
     * the others only fill it */
    const int32_t G = c->G, span = c->NQ == 1 ? G : c->ep;
    for (int32_t q = 0; q < c->NQ; q++)
        for (int32_t k = 0; k < M; k++) before[(size_t)q * M + k] = rp_plan_microbatch_at(plan, q * span, k);
    const double was = st->step_s;
    rp_status s = RP_OK;
    for (int32_t g = 0; g < G && s == RP_OK; g++)
        s = rp_plan_set_microbatch_order(plan, g, chosen + (size_t)(g / span) * M, err);
    if (s == RP_OK) {
        st->step_s = cost_step_from(c, st, st->layer_t, st->grad_s);
        /* the search compares sums of passes; the step adds layer by layer: keep the
         * order the plan had if the exact figure is not better */
        if (!(st->step_s < was)) {
            for (int32_t g = 0; g < G; g++) rp_plan_set_microbatch_order(plan, g, before + (size_t)(g / span) * M, NULL);
            st->step_s = was;
        }
    }
    rp_free(c->ctx, dbuf);
    rp_free(c->ctx, ibuf);
    if (s != RP_OK) return s;
    if (step_s) *step_s = st->step_s;
    return RP_OK;
}

/* The step, one rollout batch: per mini-batch, under group sync the slowest EP group's
 * own pipeline, under global sync the pipeline of the job-wide layer times (every
 * optimizer step waits for every group); then per mini-batch the replica gradient
 * reduction, once the extra-replica copies (they are per microbatch already), all of it
 * once per epoch. With one mini-batch and one epoch the terms add as they always did. */
double cost_step_from(const rp_cost *c, const cost_state *st, const double *layer_t, double grad_s)
{
    double run = 0.0;
    for (int32_t b = 0; b < c->K; b++) {
        double worst = 0.0;
        for (int32_t q = 0; q < c->NQ; q++) {
            double sum = cost_pipe_domain(c, st, layer_t, q, b);
            if (q == 0 || sum > worst) worst = sum;
        }
        run = b == 0 ? worst : run + worst;
    }
    const double epoch = run + (c->K == 1 ? grad_s : c->K * grad_s) + st->extra_s;
    return c->epochs == 1 ? epoch : c->epochs * epoch;
}

/* The domain with the largest time over all mini-batches. */
int32_t cost_critical_domain(const rp_cost *c, const cost_state *st)
{
    int32_t best = 0;
    double worst = 0.0;
    for (int32_t q = 0; q < c->NQ; q++) {
        double sum = 0.0;
        for (int32_t b = 0; b < c->K; b++) sum += cost_pipe_domain(c, st, st->layer_t, q, b);
        if (q == 0 || sum > worst) {
            worst = sum;
            best = q;
        }
    }
    return best;
}
