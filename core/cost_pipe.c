/* The pipeline: the order in which every stage runs its forward and backward passes
 * (1F1B, Megatron's interleaved 1F1B) and the critical path of that dependency graph,
 * which is the step under pipeline parallelism (docs/cost-model.md, "Pipeline
 * parallelism"). */
#include "cost_internal.h"

#include <math.h>

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
    const int32_t *order; /* microbatch run at each position */
} domain_times;

/* An op's end: its start plus, layer by layer, the layers' times (forward, backward, or
 * both at once), accumulated onto the start so that one stage adds exactly as the sum
 * over (m, l) of PP 1 does. */
static double domain_run(void *ud, int32_t kind, int32_t v, int32_t k, double start)
{
    const domain_times *d = ud;
    const rp_cost *c = d->c;
    const int32_t m = d->order ? d->order[k] : k, l0 = c->stage_begin[v], l1 = l0 + c->stage_layers[v];
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
    const int32_t m = d->order ? d->order[k] : k, M = st->M;
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

double cost_pipe_domain(const rp_cost *c, const cost_state *st, const double *layer_t, int32_t q)
{
    domain_times d = {.c = c, .st = st, .layer_t = layer_t, .q = q, .order = cost_domain_order(c, st, q)};
    cost_pipe_times times = {.run = domain_run, .p2p = domain_p2p, .ud = &d};
    cost_pipe_buf buf = {.fend = st->pipe_fend, .bend = st->pipe_bend, .tdev = st->pipe_tdev, .next = st->pipe_next};
    cost_count(c, (int64_t)st->M * c->L);
    return cost_pipe_run(c->PP, c->VPP, st->M, st->pipe_ops, st->pipe_begin, &buf, &times);
}

/* The order of the domain's first rank: validation keeps one order per EP group (per
 * job under global sync), so it is every rank's of the domain. */
const int32_t *cost_domain_order(const rp_cost *c, const cost_state *st, int32_t q)
{
    return rp_plan_microbatch_order(st->plan, c->NQ == 1 ? 0 : q * c->ep);
}
