/* Local search: improve a plan by sequence moves and swaps and expert slot changes,
 * judged by the cost model's incremental evaluation, within an evaluation budget. */
#include "internal.h"
#include "prng.h"
#include "routepack/baseline.h"

#include <math.h>

rp_search_params rp_search_defaults(void)
{
    return (rp_search_params){.max_evaluations = 20000, .sample = 8, .seed = 0,
                              .moves = true, .swaps = true, .slots = true, .max_operations = 0};
}

/* Uniform in [0, n), n >= 1 (multiply-shift; no modulo bias worth a branch here). */
static int32_t draw(uint64_t *state, int32_t n)
{
    return (int32_t)(((unsigned __int128)rp_splitmix64(state) * (uint64_t)n) >> 64);
}

typedef enum cand_kind { CAND_MOVE, CAND_SWAP, CAND_SLOT } cand_kind;

typedef struct candidate {
    cand_kind kind;
    int32_t a, b, c; /* move: seq, rank, mb; swap: seq_a, seq_b; slot: layer, slot, expert */
} candidate;

typedef struct search_state {
    rp_cost *cost;
    rp_plan *plan;
    uint64_t rng;
    int32_t G, M, L, E, ep, S, n;
    int32_t Mk;           /* microbatches of one mini-batch: no sequence leaves its mini-batch */
    bool same_rank_moves; /* moves keep each rank's sequence count */
    bool keep_nonempty;   /* trainer.nonempty_microbatches: no move empties a cell */
    const int32_t *slot_begin;
    rp_cost_summary sum;
} search_state;

static bool rank_holds(const search_state *s, const int32_t *phy, int32_t ep_rank, int32_t expert)
{
    for (int32_t p = s->slot_begin[ep_rank]; p < s->slot_begin[ep_rank + 1]; p++)
        if (phy[p] == expert) return true;
    return false;
}

/* A sequence: from the straggler's (rank, mb) when aimed and it holds any, else any. */
static int32_t pick_seq(search_state *s, bool aimed)
{
    if (aimed && s->sum.straggler_gpu >= 0 && s->sum.straggler_mb >= 0) {
        int32_t count;
        const int32_t *seqs = rp_plan_microbatch(s->plan, s->sum.straggler_gpu, s->sum.straggler_mb, &count);
        if (count > 0) return seqs[draw(&s->rng, count)];
    }
    return draw(&s->rng, s->n);
}

/* Draw one candidate; false when the draw is pointless (it still counts against the
 * budget, which keeps the loop bounded whatever the plan looks like). */
static bool make_candidate(search_state *s, cand_kind kind, bool aimed, candidate *c)
{
    c->kind = kind;
    switch (kind) {
    case CAND_MOVE: {
        c->a = pick_seq(s, aimed);
        int32_t rank = rp_plan_seq_rank(s->plan, c->a), mb = rp_plan_seq_microbatch(s->plan, c->a);
        if (s->keep_nonempty) {
            /* trainer.nonempty_microbatches: the sequence's cell keeps another */
            int32_t count;
            rp_plan_microbatch(s->plan, rank, mb, &count);
            if (count < 2) return false;
        }
        /* inside the sequence's mini-batch (trainer.mini_batches; all of them with one) */
        const int32_t Mk = s->Mk, m0 = mb / Mk * Mk;
        if (s->same_rank_moves) {
            /* trainer.equal_sequences_per_rank: another microbatch of the same rank */
            if (Mk < 2) return false;
            int32_t other = draw(&s->rng, Mk - 1);
            c->b = rank;
            c->c = m0 + (other >= mb - m0 ? other + 1 : other);
            return true;
        }
        int32_t cells = s->G * Mk;
        if (cells < 2) return false;
        /* any other cell of the mini-batch, uniformly */
        int32_t cell = draw(&s->rng, cells - 1), here = rank * Mk + (mb - m0);
        if (cell >= here) cell++;
        c->b = cell / Mk;
        c->c = m0 + cell % Mk;
        return true;
    }
    case CAND_SWAP: {
        if (s->n < 2) return false;
        c->a = pick_seq(s, aimed);
        int32_t other = draw(&s->rng, s->n - 1);
        if (other >= c->a) other++;
        c->b = other;
        const int32_t mb_a = rp_plan_seq_microbatch(s->plan, c->a), mb_b = rp_plan_seq_microbatch(s->plan, c->b);
        if (mb_a / s->Mk != mb_b / s->Mk) return false; /* no sequence leaves its mini-batch */
        return rp_plan_seq_rank(s->plan, c->a) != rp_plan_seq_rank(s->plan, c->b) || mb_a != mb_b;
    }
    case CAND_SLOT: {
        bool expert_side = s->sum.straggler_side == RP_SIDE_EXPERT && s->sum.straggler_layer >= 0;
        int32_t layer = aimed && expert_side ? s->sum.straggler_layer : draw(&s->rng, s->L);
        const int32_t *phy = rp_plan_phy2log(s->plan, layer);
        int32_t hot = aimed && expert_side ? s->sum.straggler_gpu % s->ep : -1;
        int32_t rank, expert;
        if (hot >= 0 && (draw(&s->rng, 2) == 0 || s->ep < 2)) {
            /* relieve the straggling EP rank: empty one of its slots (its expert must
             * keep a replica elsewhere, which try_slot checks) */
            rank = hot;
            expert = -1;
        } else if (hot >= 0) {
            /* or give one of its experts a replica on another EP rank */
            int32_t hot_slots = s->slot_begin[hot + 1] - s->slot_begin[hot];
            if (hot_slots == 0) return false;
            expert = phy[s->slot_begin[hot] + draw(&s->rng, hot_slots)];
            if (expert < 0) return false;
            rank = draw(&s->rng, s->ep - 1);
            if (rank >= hot) rank++;
        } else {
            rank = draw(&s->rng, s->ep);
            expert = draw(&s->rng, s->E + 1) - 1; /* -1: empty the slot */
        }
        int32_t nslots = s->slot_begin[rank + 1] - s->slot_begin[rank];
        if (nslots == 0) return false;
        int32_t slot = s->slot_begin[rank] + draw(&s->rng, nslots);
        if (phy[slot] == expert) return false;
        if (expert >= 0 && rank_holds(s, phy, rank, expert)) return false; /* one replica per EP rank */
        c->a = layer;
        c->b = slot;
        c->c = expert;
        return true;
    }
    }
    return false;
}

static double try_candidate(search_state *s, const candidate *c)
{
    switch (c->kind) {
    case CAND_MOVE: return rp_cost_try_move(s->cost, c->a, c->b, c->c);
    case CAND_SWAP: return rp_cost_try_swap(s->cost, c->a, c->b);
    default: return rp_cost_try_slot(s->cost, c->a, c->b, c->c);
    }
}

static rp_status apply_candidate(search_state *s, const candidate *c, rp_search_result *r, rp_error *err)
{
    switch (c->kind) {
    case CAND_MOVE:
        r->moves++;
        return rp_cost_apply_move(s->cost, s->plan, c->a, c->b, c->c, err);
    case CAND_SWAP:
        r->swaps++;
        return rp_cost_apply_swap(s->cost, s->plan, c->a, c->b, err);
    default:
        r->slots++;
        return rp_cost_apply_slot(s->cost, s->plan, c->a, c->b, c->c, err);
    }
}

rp_status rp_search_local(rp_cost *cost, rp_plan *plan, const rp_search_params *params,
                          rp_search_result *result, rp_error *err)
{
    if (!cost || !plan || !params)
        return rp_fail(err, RP_EINVAL, "search: cost, plan and parameters are required");
    if (params->max_evaluations < 0)
        return rp_fail(err, RP_EINVAL, "search: max_evaluations = %lld, must be >= 0",
                       (long long)params->max_evaluations);
    if (params->sample < 1) return rp_fail(err, RP_EINVAL, "search: sample = %d, must be >= 1", params->sample);
    if (params->max_operations < 0)
        return rp_fail(err, RP_EINVAL, "search: max_operations = %lld, must be >= 0 (0: no limit)",
                       (long long)params->max_operations);
    if (!rp_plan_has_packing(plan) || !rp_plan_has_placement(plan))
        return rp_fail(err, RP_EINVAL, "search: the plan needs both a packing and a placement");

    search_state s = {.cost = cost, .plan = plan, .rng = params->seed};
    rp_search_result r = {0};
    const int64_t ops0 = rp_cost_operations(cost);
    rp_status st = rp_cost_evaluate(cost, plan, &s.sum, err);
    r.operations = rp_cost_operations(cost) - ops0;
    if (st != RP_OK) return st;
    s.G = rp_plan_num_gpus(plan);
    s.M = rp_plan_num_microbatches(plan);
    s.L = rp_plan_num_layers(plan);
    s.E = rp_plan_num_experts(plan);
    s.ep = rp_plan_ep_size(plan);
    s.S = rp_plan_total_slots(plan);
    s.n = rp_plan_num_seqs(plan);
    s.slot_begin = rp_plan_slot_begin(plan);
    s.same_rank_moves = rp_config_trainer(rp_cost_config(cost))->equal_sequences_per_rank;
    s.Mk = s.M / rp_config_trainer(rp_cost_config(cost))->mini_batches; /* the evaluation checked M % K */
    s.keep_nonempty = rp_config_trainer(rp_cost_config(cost))->nonempty_microbatches;
    r.initial_s = r.final_s = rp_cost_current_s(cost);

    cand_kind kinds[3];
    int32_t num_kinds = 0;
    if (params->moves && s.n > 0) kinds[num_kinds++] = CAND_MOVE;
    if (params->swaps && s.n > 1) kinds[num_kinds++] = CAND_SWAP;
    if (params->slots && s.S > 0 && s.L > 0) kinds[num_kinds++] = CAND_SLOT;

    /* the operations budget is checked after every candidate: one candidate's work is
     * bounded (a few passes over one layer's groups, or one layer over the microbatches) */
    const int64_t max_ops = params->max_operations > 0 ? params->max_operations : INT64_MAX;
    while (num_kinds > 0 && r.evaluations < params->max_evaluations && !r.stopped) {
        r.iterations++;
        st = rp_cost_current_summary(cost, &s.sum, err);
        if (st != RP_OK) goto out;
        double current = rp_cost_current_s(cost), best_v = current * (1 - 1e-12);
        candidate best = {0};
        bool found = false;
        for (int32_t k = 0; k < params->sample && r.evaluations < params->max_evaluations; k++) {
            if (rp_cost_operations(cost) - ops0 > max_ops) {
                r.stopped = true;
                break;
            }
            candidate c;
            cand_kind kind = kinds[draw(&s.rng, num_kinds)];
            r.evaluations++;
            if (!make_candidate(&s, kind, k % 2 == 0, &c)) continue;
            double v = try_candidate(&s, &c);
            if (v < best_v) {
                best_v = v;
                best = c;
                found = true;
            }
        }
        if (found) {
            st = apply_candidate(&s, &best, &r, err);
            if (st != RP_OK) goto out;
        }
    }
out:
    r.final_s = rp_cost_current_s(cost);
    r.operations = rp_cost_operations(cost) - ops0;
    if (r.operations > max_ops) r.stopped = true;
    if (result) *result = r;
    return st;
}
