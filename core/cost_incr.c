/* Incremental evaluation for local search: moving or swapping sequences and changing
 * one slot recompute only the cells, EP groups and layers the change touches, through
 * the same functions as a full evaluation, so the result equals a full evaluation of
 * the changed plan exactly. */
#include "cost_internal.h"

#include <math.h>
#include <string.h>

typedef struct seq_move {
    int32_t seq, g_from, m_from, g_to, m_to;
    int64_t len;
    uint32_t *hist; /* [L * E] */
} seq_move;

static int64_t seq_len(const rp_cost *c, int32_t seq)
{
    return c->cu_seqlens[seq + 1] - c->cu_seqlens[seq];
}

/* Whether a cell may take `delta` more tokens: the token cap and the activation
 * memory cap of the config. A cell that shrinks always may. */
static bool cell_fits(const rp_cost *c, const cost_state *st, int32_t g, int32_t m, int64_t delta,
                      int64_t *after)
{
    int64_t n = st->cell_tokens[(size_t)g * st->M + m] + delta;
    if (after) *after = n;
    if (delta <= 0) return true;
    if (n > c->token_cap) return false;
    if (c->act_cap > 0 && (double)n * c->act_per_token > c->act_cap) return false;
    return true;
}

/* Move the sequences' histograms between their cells in the integer state (counts and
 * group aggregates); sign -1 undoes it exactly. */
static void apply_deltas(rp_cost *c, cost_state *st, const seq_move *mv, int32_t n_mv, int32_t sign)
{
    const int32_t L = c->L, E = c->E;
    for (int32_t k = 0; k < n_mv; k++)
        for (int32_t l = 0; l < L; l++) {
            const uint32_t *h = mv[k].hist + (size_t)l * E;
            const int32_t *off = st->rep_off + (size_t)l * (E + 1), *rank = st->rep_rank + (size_t)l * st->S;
            cost_map map = cost_dst_map(c, st, mv[k].m_from, l, off, rank, true, &c->sc);
            cost_group_delta(c, st, mv[k].m_from, l, mv[k].g_from, h, -sign, map);
            map = cost_dst_map(c, st, mv[k].m_to, l, off, rank, true, &c->sc);
            cost_group_delta(c, st, mv[k].m_to, l, mv[k].g_to, h, sign, map);
        }
}

/* Per-GPU counts of the split experts only (the arithmetic reads no others per GPU). */
static void split_counts(const rp_cost *c, cost_state *st, int32_t m, int32_t l, int32_t gpu, const int32_t *h,
                         int32_t sign, cost_map map)
{
    int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + gpu) * (size_t)c->E;
    cost_count(c, 1 + map.seg[c->ep + 1] - map.seg[c->ep]);
    for (int32_t i = map.seg[c->ep]; i < map.seg[c->ep + 1]; i++) cnt[map.ord[i]] += sign * h[map.ord[i]];
}

/* Group q at (m, l) as it would be after the moves, without changing the state: its
 * aggregates are copied to the scratch space and changed there; the per-GPU counts of
 * split experts change in place and are restored (integers: exactly). */
static void trial_group(rp_cost *c, cost_state *st, const seq_move *mv, int32_t n_mv, int32_t m, int32_t l,
                        int32_t q, cost_map map, group_result *res)
{
    cost_scratch *sc = &c->sc;
    const int32_t E = c->E, ep = c->ep, L = c->L;
    const size_t gq = ((size_t)m * L + l) * c->Q + q;
    memcpy(sc->total, st->gtotal + gq * E, (size_t)E * sizeof *sc->total);
    memcpy(sc->pair, st->gpair + gq * ep * ep, (size_t)ep * ep * sizeof *sc->pair);
    cost_group_tokens(c, st, m, q, sc->tok);
    cost_count(c, E + 4 * (int64_t)ep + 4 * (int64_t)n_mv);
    for (int32_t pass = 0; pass < 2; pass++)
        for (int32_t k = 0; k < n_mv; k++) {
            const int32_t *h = (const int32_t *)(mv[k].hist + (size_t)l * E);
            for (int32_t side = 0; side < 2; side++) {
                int32_t g = side ? mv[k].g_to : mv[k].g_from, mk = side ? mv[k].m_to : mv[k].m_from;
                if (mk != m || g / ep != q) continue;
                int32_t sign = side ? 1 : -1;
                if (pass == 0) {
                    sc->tok[g % ep] += sign * mv[k].len;
                    cost_delta_aggregates(c, g % ep, h, sign, map, sc->total, sc->pair);
                    split_counts(c, st, m, l, g, h, sign, map);
                } else {
                    split_counts(c, st, m, l, g, h, -sign, map);
                }
            }
            if (pass == 0 && k == n_mv - 1)
                cost_group_eval(c, st, m, l, q, st->rep_off + (size_t)l * (E + 1), st->rep_rank + (size_t)l * st->S,
                                map, sc->total, sc->pair, sc->tok, sc->x, sc->d, res, sc);
        }
}

/* Step time after the moves, which exchange sequences between two distinct cells A
 * and B (a move: one sequence A -> B; a swap: one each way). With `commit` the state
 * keeps the result; without it every change to the state is undone. */
static double run_moves(rp_cost *c, seq_move *mv, int32_t n_mv, bool commit)
{
    cost_state *st = c->st;
    cost_scratch *sc = &c->sc;
    const int32_t L = c->L, G = c->G, E = c->E, M = st->M, ep = c->ep, Q = c->Q;
    const int32_t gA = mv[0].g_from, mA = mv[0].m_from, gB = mv[0].g_to, mB = mv[0].m_to;

    /* reading the histograms, copying the layer times, the per-layer group maxima */
    cost_count(c, (int64_t)n_mv * L * E + (commit ? 2 * (int64_t)n_mv * L : (int64_t)M * L) + 2 * (int64_t)L * (Q + 2));
    for (int32_t k = 0; k < n_mv; k++)
        for (int32_t l = 0; l < L; l++)
            rp_stats_seq_hist(c->stats, mv[k].seq, l, mv[k].hist + (size_t)l * E);
    if (commit) apply_deltas(c, st, mv, n_mv, +1);

    /* attention of the two cells */
    int64_t tokA = st->cell_tokens[(size_t)gA * M + mA], sqA = st->cell_quad[(size_t)gA * M + mA];
    int64_t tokB = st->cell_tokens[(size_t)gB * M + mB], sqB = st->cell_quad[(size_t)gB * M + mB];
    int64_t padA = st->cell_pad[(size_t)gA * M + mA], padB = st->cell_pad[(size_t)gB * M + mB];
    for (int32_t k = 0; k < n_mv; k++) {
        int64_t len = mv[k].len, sign = mv[k].g_from == gA && mv[k].m_from == mA ? 1 : -1;
        tokA -= sign * len;
        sqA -= sign * c->seq_quad[mv[k].seq];
        padA -= sign * cost_pad(c, len);
        tokB += sign * len;
        sqB += sign * c->seq_quad[mv[k].seq];
        padB += sign * cost_pad(c, len);
    }
    double aA = cost_cell_attention(c, sqA, tokA + padA, gA), aB = cost_cell_attention(c, sqB, tokB + padB, gB);
    double fA, bA, fB, bB;
    if (commit) { /* the groups' evaluation below reads the cells' tokens */
        st->cell_tokens[(size_t)gA * M + mA] = tokA;
        st->cell_tokens[(size_t)gB * M + mB] = tokB;
    }
    cost_cell_dense(c, sqA, tokA + padA, gA, &fA, &bA);
    cost_cell_dense(c, sqB, tokB + padB, gB, &fB, &bB);
    int32_t ms[2] = {mA, mB}, n_ms = mA == mB ? 1 : 2;
    const int32_t qA = gA / ep, qB = gB / ep;
    /* dense maxima of the changed (microbatch, group)s: [i][j] for ms[i] and group qs */
    double dfm[2][2], dbm[2][2];
    int32_t dfa[2][2];
    const int32_t LW = c->LW;
    double *layer_t = commit ? st->layer_t : sc->layer_t;

    if (!commit) memcpy(sc->layer_t, st->layer_t, (size_t)M * L * LW * sizeof(double));
    for (int32_t i = 0; i < n_ms; i++) {
        const int32_t m = ms[i];
        /* groups of this microbatch that changed */
        int32_t qs[2], n_qs = 0;
        if (m == mA) qs[n_qs++] = qA;
        if (m == mB && !(n_qs && qs[0] == qB)) qs[n_qs++] = qB;
        memcpy(sc->qdf, st->dfmax + (size_t)m * Q, (size_t)Q * sizeof(double));
        memcpy(sc->qdb, st->dbmax + (size_t)m * Q, (size_t)Q * sizeof(double));
        for (int32_t j = 0; j < n_qs; j++) {
            cost_group_dense(c, st, m, qs[j], gA, mA, fA, bA, gB, mB, fB, bB, &dfm[i][j], &dbm[i][j], &dfa[i][j]);
            sc->qdf[qs[j]] = dfm[i][j];
            sc->qdb[qs[j]] = dbm[i][j];
        }
        for (int32_t l = 0; l < L; l++) {
            const size_t ml = (size_t)m * L + l;
            const int32_t *off = st->rep_off + (size_t)l * (E + 1), *rank = st->rep_rank + (size_t)l * st->S;
            cost_map map = cost_dst_map(c, st, m, l, off, rank, true, sc);
            group_result r[2];
            for (int32_t j = 0; j < n_qs; j++) {
                const size_t gq = ml * Q + qs[j];
                if (commit) {
                    cost_group_tokens(c, st, m, qs[j], sc->tok);
                    cost_group_eval(c, st, m, l, qs[j], off, rank, map, st->gtotal + gq * E,
                                    st->gpair + gq * ep * ep, sc->tok, st->expert + ml * G + (size_t)qs[j] * ep,
                                    st->dispatch + ml * G + (size_t)qs[j] * ep, &r[j], sc);
                } else {
                    trial_group(c, st, mv, n_mv, m, l, qs[j], map, &r[j]);
                }
            }
            memcpy(sc->qx, st->xmax + ml * Q, (size_t)Q * sizeof(double));
            memcpy(sc->qd, st->dmax + ml * Q, (size_t)Q * sizeof(double));
            for (int32_t j = 0; j < n_qs; j++) {
                sc->qx[qs[j]] = r[j].xmax;
                sc->qd[qs[j]] = r[j].dmax;
            }
            cost_layer_times(c, sc->qdf, sc->qdb, sc->qd, sc->qx, layer_t + ml * LW);
            if (commit)
                for (int32_t j = 0; j < n_qs; j++) {
                    st->xmax[ml * Q + qs[j]] = r[j].xmax;
                    st->dmax[ml * Q + qs[j]] = r[j].dmax;
                    st->xarg[ml * Q + qs[j]] = r[j].xarg;
                    st->darg[ml * Q + qs[j]] = r[j].darg;
                }
        }
        if (commit)
            for (int32_t j = 0; j < n_qs; j++) {
                st->dfmax[(size_t)m * Q + qs[j]] = dfm[i][j];
                st->dbmax[(size_t)m * Q + qs[j]] = dbm[i][j];
                st->dfarg[(size_t)m * Q + qs[j]] = dfa[i][j];
            }
    }

    if (!commit) {
        sc->trial_cells = 2;
        sc->trial_g[0] = gA, sc->trial_m[0] = mA, sc->trial_tok[0] = tokA;
        sc->trial_g[1] = gB, sc->trial_m[1] = mB, sc->trial_tok[1] = tokB;
        double step = cost_step_from(c, st, sc->layer_t, st->grad_s);
        sc->trial_cells = 0;
        return step;
    }

    /* commit the rest: cells, maxima, sequence map, bound aggregates */
    st->cell_tokens[(size_t)gA * M + mA] = tokA;
    st->cell_quad[(size_t)gA * M + mA] = sqA;
    st->cell_pad[(size_t)gA * M + mA] = padA;
    st->cell_tokens[(size_t)gB * M + mB] = tokB;
    st->cell_quad[(size_t)gB * M + mB] = sqB;
    st->cell_pad[(size_t)gB * M + mB] = padB;
    st->attn[(size_t)gA * M + mA] = aA;
    st->attn[(size_t)gB * M + mB] = aB;
    st->dense_f[(size_t)gA * M + mA] = fA;
    st->dense_b[(size_t)gA * M + mA] = bA;
    st->dense_f[(size_t)gB * M + mB] = fB;
    st->dense_b[(size_t)gB * M + mB] = bB;
    for (int32_t k = 0; k < n_mv; k++) {
        const seq_move *v = &mv[k];
        st->seq_rank[v->seq] = v->g_to;
        st->seq_mb[v->seq] = v->m_to;
    }
    /* the sequence with the most attention in each of the two cells, from the (already
     * updated) plan; ties go to the lower sequence id, as in a full evaluation */
    int32_t cells[2][2] = {{gA, mA}, {gB, mB}};
    for (int32_t i = 0; i < 2; i++) {
        int32_t count = 0, top = -1;
        double best = -1.0;
        const int32_t *list = rp_plan_microbatch(st->plan, cells[i][0], cells[i][1], &count);
        cost_count(c, count + 1);
        for (int32_t k = 0; k < count; k++) {
            double a = cost_seq_attention(c, list[k]);
            if (a > best || (a == best && list[k] < top)) {
                best = a;
                top = list[k];
            }
        }
        st->cell_top[(size_t)cells[i][0] * M + cells[i][1]] = top;
    }
    st->step_s = cost_step_from(c, st, st->layer_t, st->grad_s);
    return st->step_s;
}

/* ---- sequence moves and swaps ---------------------------------------------------- */

/* Check a move; on success fill mv and return RP_OK (or RP_OK with *noop). */
static rp_status check_move(const rp_cost *c, int32_t seq, int32_t rank, int32_t mb, seq_move *mv,
                            bool *noop, rp_error *err)
{
    const cost_state *st = c->st;
    *noop = false;
    if (!st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    if (seq < 0 || seq >= c->N)
        return rp_fail(err, RP_EINVAL, "cost: sequence %d does not exist (%d sequences)", seq, c->N);
    if (rank < 0 || rank >= c->G || mb < 0 || mb >= st->M)
        return rp_fail(err, RP_EINVAL, "cost: rank %d mb %d does not exist (%d ranks, %d microbatches)", rank,
                       mb, c->G, st->M);
    mv->seq = seq;
    mv->g_from = st->seq_rank[seq];
    mv->m_from = st->seq_mb[seq];
    mv->g_to = rank;
    mv->m_to = mb;
    mv->len = seq_len(c, seq);
    mv->hist = c->sc.hist;
    if (mv->g_from == rank && mv->m_from == mb) {
        *noop = true;
        return RP_OK;
    }
    int64_t after;
    if (!cell_fits(c, st, rank, mb, mv->len, &after))
        return rp_fail(err, RP_EINVAL,
                       "cost: moving sequence %d (%lld tokens) to rank %d mb %d would give it %lld tokens, over "
                       "the token cap of %lld or the activation memory cap",
                       seq, (long long)mv->len, rank, mb, (long long)after, (long long)c->token_cap);
    return RP_OK;
}

static rp_status check_swap(const rp_cost *c, int32_t a, int32_t b, seq_move mv[2], bool *noop,
                            rp_error *err)
{
    const cost_state *st = c->st;
    *noop = false;
    if (!st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    if (a < 0 || a >= c->N || b < 0 || b >= c->N)
        return rp_fail(err, RP_EINVAL, "cost: cannot swap sequences %d and %d (%d sequences)", a, b, c->N);
    int32_t ga = st->seq_rank[a], ma = st->seq_mb[a], gb = st->seq_rank[b], mb = st->seq_mb[b];
    mv[0] = (seq_move){a, ga, ma, gb, mb, seq_len(c, a), c->sc.hist};
    mv[1] = (seq_move){b, gb, mb, ga, ma, seq_len(c, b), c->sc.hist + (size_t)c->L * c->E};
    if (ga == gb && ma == mb) {
        *noop = true;
        return RP_OK;
    }
    int64_t after;
    if (!cell_fits(c, st, ga, ma, mv[1].len - mv[0].len, &after) ||
        !cell_fits(c, st, gb, mb, mv[0].len - mv[1].len, &after))
        return rp_fail(err, RP_EINVAL,
                       "cost: swapping sequences %d and %d would give a microbatch %lld tokens, over the token "
                       "cap of %lld or the activation memory cap", a, b, (long long)after,
                       (long long)c->token_cap);
    return RP_OK;
}

double rp_cost_try_move(rp_cost *c, int32_t seq, int32_t rank, int32_t mb)
{
    seq_move mv = {0}; /* zeroed: at -O3 GCC cannot see that the check fills it on RP_OK */
    bool noop;
    if (!c || check_move(c, seq, rank, mb, &mv, &noop, NULL) != RP_OK) return INFINITY;
    if (noop) return c->st->step_s;
    return run_moves(c, &mv, 1, false);
}

double rp_cost_try_swap(rp_cost *c, int32_t a, int32_t b)
{
    seq_move mv[2] = {0}; /* zeroed: at -O3 GCC cannot see that the check fills it on RP_OK */
    bool noop;
    if (!c || check_swap(c, a, b, mv, &noop, NULL) != RP_OK) return INFINITY;
    if (noop) return c->st->step_s;
    return run_moves(c, mv, 2, false);
}

/* Moving a sequence in the plan shifts the two lists it leaves and joins. */
static void count_list_shift(const rp_cost *c, const rp_plan *plan, const seq_move *mv, int32_t n_mv)
{
    for (int32_t k = 0; k < n_mv; k++) {
        int32_t from = 0, to = 0;
        rp_plan_microbatch(plan, mv[k].g_from, mv[k].m_from, &from);
        rp_plan_microbatch(plan, mv[k].g_to, mv[k].m_to, &to);
        cost_count(c, (int64_t)from + to + 2);
    }
}

static rp_status check_bound(const rp_cost *c, const rp_plan *plan, rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    if (!c->st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    if (plan != c->st->plan)
        return rp_fail(err, RP_EINVAL, "cost: the plan given is not the one the evaluator is bound to "
                       "(evaluate it first)");
    return RP_OK;
}

rp_status rp_cost_apply_move(rp_cost *c, rp_plan *plan, int32_t seq, int32_t rank, int32_t mb,
                             rp_error *err)
{
    rp_status st = check_bound(c, plan, err);
    if (st != RP_OK) return st;
    seq_move mv = {0}; /* zeroed: at -O3 GCC cannot see that the check fills it on RP_OK */
    bool noop;
    if ((st = check_move(c, seq, rank, mb, &mv, &noop, err)) != RP_OK || noop) return st;
    cost_state_edited(c);
    count_list_shift(c, plan, &mv, 1);
    if ((st = rp_plan_move_sequence(plan, seq, rank, mb, err)) != RP_OK) return st;
    run_moves(c, &mv, 1, true);
    return RP_OK;
}

rp_status rp_cost_apply_swap(rp_cost *c, rp_plan *plan, int32_t a, int32_t b, rp_error *err)
{
    rp_status st = check_bound(c, plan, err);
    if (st != RP_OK) return st;
    seq_move mv[2] = {0}; /* zeroed: at -O3 GCC cannot see that the check fills it on RP_OK */
    bool noop;
    if ((st = check_swap(c, a, b, mv, &noop, err)) != RP_OK || noop) return st;
    cost_state_edited(c);
    count_list_shift(c, plan, mv, 2);
    if ((st = rp_plan_move_sequence(plan, a, mv[0].g_to, mv[0].m_to, err)) != RP_OK) return st;
    if ((st = rp_plan_move_sequence(plan, b, mv[1].g_to, mv[1].m_to, err)) != RP_OK) {
        rp_plan_move_sequence(plan, a, mv[0].g_from, mv[0].m_from, NULL); /* put it back */
        return st;
    }
    run_moves(c, mv, 2, true);
    return RP_OK;
}

/* ---- slot changes ---------------------------------------------------------------- */

static rp_status check_slot(const rp_cost *c, int32_t layer, int32_t slot, int32_t expert, bool *noop,
                            rp_error *err)
{
    const cost_state *st = c->st;
    *noop = false;
    if (!st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    if (layer < 0 || layer >= c->L)
        return rp_fail(err, RP_EINVAL, "cost: layer %d does not exist (%d layers)", layer, c->L);
    if (slot < 0 || slot >= st->S)
        return rp_fail(err, RP_EINVAL, "cost: slot %d does not exist (%d slots per EP group)", slot, st->S);
    if (expert < -1 || expert >= c->E)
        return rp_fail(err, RP_EINVAL, "cost: expert %d does not exist (%d experts; -1 empties a slot)", expert,
                       c->E);
    const int32_t old = st->phy2log[(size_t)layer * st->S + slot];
    if (old == expert) {
        *noop = true;
        return RP_OK;
    }
    /* any one slot change adds or removes an expert of one EP rank: not evenly owned */
    if (st->vexp)
        return rp_fail(err, RP_EINVAL, "cost: the plan runs with per-forward balancing (virtual experts), which "
                       "needs every expert once and num_experts / ep_size per EP rank: layer %d slot %d cannot change",
                       layer, slot);
    const int32_t *off = st->rep_off + (size_t)layer * (c->E + 1);
    if (old >= 0 && off[old + 1] - off[old] == 1)
        return rp_fail(err, RP_EINVAL, "cost: layer %d slot %d holds the only replica of expert %d", layer, slot,
                       old);
    for (int32_t m = 0; m < st->M; m++) {
        int32_t ml = m * c->L + layer;
        for (int32_t i = st->ov_begin[ml]; i < st->ov_begin[ml + 1]; i++) {
            const cost_override *o = &st->ov[i];
            if (o->num_shares && (o->expert == old || o->expert == expert))
                return rp_fail(err, RP_EINVAL,
                               "cost: expert %d has explicit shares at mb %d layer %d, which fix its replica set",
                               o->expert, m, layer);
        }
    }
    return RP_OK;
}

static double run_slot(rp_cost *c, int32_t layer, int32_t slot, int32_t expert, bool commit)
{
    cost_state *st = c->st;
    cost_scratch *sc = &c->sc;
    const int32_t L = c->L, G = c->G, E = c->E, S = st->S, M = st->M, ep = c->ep, Q = c->Q;
    memcpy(sc->row, st->phy2log + (size_t)layer * S, (size_t)S * sizeof(int32_t));
    sc->row[slot] = expert;
    cost_index_layer(E, S, st->slot_rank, sc->row, sc->rep_off, sc->rep_rank);
    /* the row, its index, the layer times' copy, each microbatch's group maxima */
    cost_count(c, 3 * (int64_t)S + 2 * (int64_t)E + (commit ? 0 : (int64_t)M * L * c->LW) + (int64_t)M * (Q + 2));
    if (!commit) memcpy(sc->layer_t, st->layer_t, (size_t)M * L * c->LW * sizeof(double));
    for (int32_t m = 0; m < M; m++) {
        const size_t ml = (size_t)m * L + layer;
        cost_map map = cost_dst_map(c, st, m, layer, sc->rep_off, sc->rep_rank, false, sc);
        for (int32_t q = 0; q < Q; q++) {
            group_result r;
            const size_t gq = ml * Q + q;
            double *x = commit ? st->expert + ml * G + (size_t)q * ep : sc->x;
            double *d = commit ? st->dispatch + ml * G + (size_t)q * ep : sc->d;
            int32_t *total = commit ? st->gtotal + gq * E : sc->total;
            int32_t *pair = commit ? st->gpair + gq * ep * ep : sc->pair;
            cost_group_rebuild(c, st, m, layer, q, map, total, pair);
            cost_group_tokens(c, st, m, q, sc->tok);
            cost_group_eval(c, st, m, layer, q, sc->rep_off, sc->rep_rank, map, total, pair, sc->tok, x, d, &r, sc);
            sc->qx[q] = r.xmax;
            sc->qd[q] = r.dmax;
            if (commit) {
                st->xmax[ml * Q + q] = r.xmax;
                st->dmax[ml * Q + q] = r.dmax;
                st->xarg[ml * Q + q] = r.xarg;
                st->darg[ml * Q + q] = r.darg;
            }
        }
        cost_layer_times(c, st->dfmax + (size_t)m * Q, st->dbmax + (size_t)m * Q, sc->qd, sc->qx,
                         (commit ? st->layer_t : sc->layer_t) + ml * c->LW);
    }
    cost_grad_layer(c, st, layer, sc->rep_off, sc->rep_rank, sc->grad_row, NULL);
    double grad = cost_grad_total(c, st, layer, sc->grad_row);
    if (!commit) return cost_step_from(c, st, sc->layer_t, grad);

    cost_count(c, 2 * (int64_t)S + E + G);
    memcpy(st->phy2log + (size_t)layer * S, sc->row, (size_t)S * sizeof(int32_t));
    memcpy(st->rep_off + (size_t)layer * (E + 1), sc->rep_off, (size_t)(E + 1) * sizeof(int32_t));
    memcpy(st->rep_rank + (size_t)layer * S, sc->rep_rank, (size_t)S * sizeof(int32_t));
    cost_layer_dst(c, st, layer, sc->rep_off, sc->rep_rank);
    memcpy(st->grad_gpu + (size_t)layer * G, sc->grad_row, (size_t)G * sizeof(double));
    st->grad_s = grad;
    st->step_s = cost_step_from(c, st, st->layer_t, st->grad_s);
    return st->step_s;
}

double rp_cost_try_slot(rp_cost *c, int32_t layer, int32_t slot, int32_t expert)
{
    bool noop;
    if (!c || check_slot(c, layer, slot, expert, &noop, NULL) != RP_OK) return INFINITY;
    if (noop) return c->st->step_s;
    return run_slot(c, layer, slot, expert, false);
}

rp_status rp_cost_apply_slot(rp_cost *c, rp_plan *plan, int32_t layer, int32_t slot, int32_t expert,
                             rp_error *err)
{
    rp_status st = check_bound(c, plan, err);
    if (st != RP_OK) return st;
    bool noop;
    if ((st = check_slot(c, layer, slot, expert, &noop, err)) != RP_OK || noop) return st;
    cost_state_edited(c);
    const int32_t S = c->st->S;
    int32_t *row = c->sc.row;
    memcpy(row, c->st->phy2log + (size_t)layer * S, (size_t)S * sizeof(int32_t));
    row[slot] = expert;
    cost_count(c, 2 * (int64_t)S + 2 * (int64_t)c->E); /* the plan's row and its replica index */
    if ((st = rp_plan_set_phy2log(plan, layer, row, err)) != RP_OK) return st;
    run_slot(c, layer, slot, expert, true);
    return RP_OK;
}
