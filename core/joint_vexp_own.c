/* The balancer's candidate on a planned ownership (issue 35): the same packing with the
 * experts of each layer evenly owned (E / ep per EP rank, as the balancer requires) but
 * chosen so that the balancer has less to push. Megatron's balancer pays its weight pushes
 * per (microbatch, layer) and EP group by the rank that pushes or receives the most virtual
 * experts (cost_group_eval_vexp); that count follows from each expert's token-choices in
 * the group and who owns it alone (steps 1 to 3 of rp_vexp_plan). The planner sees every
 * microbatch's counts before the step, so it can own the experts where that count is low:
 * a local search over swaps of two experts' owners, each swap scored by the exact count
 * summed over the step's (microbatch, EP group) cells and kept where the pushes it saves
 * pay for the two experts' migration over the horizon. docs/routepack-policy.md, "Beside
 * the per-forward balancer". */
#include "joint_internal.h"
#include "routepack/stats.h"
#include "virtual_experts_internal.h"

#include <math.h>
#include <string.h>

/* The balancer's largest EP group (RP_VEXP_MAX_EP): the per-rank fill below is on the stack */
#define OWN_MAX_EP 64
/* Operations (count units) the search may spend a step, split evenly over the layers: about
 * 15 ms on one core for the small config's 16 layers x 12 microbatches */
#define OWN_OPERATIONS 10000000

/* Scratch of joint_vexp_pushes for ep ranks and E experts. */
typedef struct push_scratch {
    int64_t *bal, *quota, *left;  /* [ep], [ep * ep], [E / ep] */
    int32_t *pin, *pout;          /* [ep] */
} push_scratch;

int32_t joint_vexp_pushes(int32_t ep, int32_t E, const int64_t *nat, const int32_t *owned, void *scratch)
{
    push_scratch *s = scratch;
    const int32_t pr = E / ep;
    int64_t *bal = s->bal, *quota = s->quota, total = 0;
    for (int32_t r = 0; r < ep; r++) {
        int64_t own = 0;
        for (int32_t i = 0; i < pr; i++) own += nat[owned[(size_t)r * pr + i]];
        bal[r] = own;
        total += own;
        s->pin[r] = s->pout[r] = 0;
    }
    for (int32_t r = 0; r < ep; r++) bal[r] -= total / ep + (r < total % ep ? 1 : 0);
    /* step 1: rp_vexp_plan's quotas, the same code */
    vexp_quotas(bal, quota, ep);
    /* step 2: rp_vexp_plan's split, the same code; each move is one (expert, receiver)
     * pair, one virtual expert pushed */
    for (int32_t r = 0; r < ep; r++) {
        int64_t *q = quota + (size_t)r * ep;
        for (int32_t i = 0; i < pr; i++) s->left[i] = nat[owned[(size_t)r * pr + i]];
        for (int32_t step = 0; step < ep + pr; step++) {
            int32_t dst, i;
            if (vexp_split_move(q, s->left, ep, pr, &dst, &i) == 0) break;
            s->pout[r]++;
            s->pin[dst]++;
        }
    }
    int32_t most = 0;
    for (int32_t r = 0; r < ep; r++) {
        int32_t k = s->pin[r] > s->pout[r] ? s->pin[r] : s->pout[r];
        if (k > most) most = k;
    }
    return most;
}

size_t joint_vexp_pushes_scratch(int32_t ep, int32_t E)
{
    return sizeof(push_scratch) + (size_t)(ep + (size_t)ep * ep + E / ep) * sizeof(int64_t) +
           2 * (size_t)ep * sizeof(int32_t);
}

void *joint_vexp_pushes_init(void *mem, int32_t ep, int32_t E)
{
    push_scratch *s = mem;
    int64_t *p = (int64_t *)(s + 1);
    s->bal = p;
    s->quota = p + ep;
    s->left = p + ep + (size_t)ep * ep;
    s->pin = (int32_t *)(s->left + E / ep);
    s->pout = s->pin + ep;
    return s;
}

/* owned[r * pr + i]: rank r's experts, ascending id (the balancer's local order, which
 * its tie rule reads); rebuilt from owner[] after a swap. */
static void owned_of(int32_t ep, int32_t E, const int32_t *owner, int32_t *owned)
{
    const int32_t pr = E / ep;
    int32_t fill[OWN_MAX_EP] = {0};
    for (int32_t e = 0; e < E; e++) owned[(size_t)owner[e] * pr + fill[owner[e]]++] = e;
}

static int64_t step_load(const int64_t *row, int32_t C, int32_t E, int32_t e)
{
    int64_t t = 0;
    for (int32_t c = 0; c < C; c++) t += row[(size_t)c * E + e];
    return t;
}

/* The pushes of one layer's cells under owner[], summed (cells: [C] rows of E). */
static int64_t layer_pushes(int32_t ep, int32_t E, const int64_t *nat, int32_t C, const int32_t *owner,
                            int32_t *owned, void *sc, int64_t *ops)
{
    owned_of(ep, E, owner, owned);
    int64_t sum = 0;
    for (int32_t c = 0; c < C; c++) sum += joint_vexp_pushes(ep, E, nat + (size_t)c * E, owned, sc);
    *ops += (int64_t)C * (2 * E + 3 * (int64_t)ep * ep);
    return sum;
}

rp_status joint_vexp_owned(const joint *jt, const rp_plan *base, const rp_plan *previous_placed, rp_plan **out,
                           rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const int32_t ep = jt->ep, E = jt->E, L = jt->L, Q = jt->Q, N = jt->N, pr = E / ep;
    const int32_t M = rp_plan_num_microbatches(base), C = M * Q;
    *out = NULL;
    if (ep > OWN_MAX_EP || E % ep) return RP_OK;
    /* the start: the placement in use where it is evenly owned (so a swap moves two
     * experts), else the base plan's contiguous one */
    const rp_plan *start = base;
    const int32_t *sb = rp_plan_slot_begin(base);
    if (previous_placed && rp_plan_has_placement(previous_placed) &&
        rp_plan_total_slots(previous_placed) == rp_plan_total_slots(base)) {
        bool even = true;
        for (int32_t l = 0; l < L && even; l++) {
            const int32_t *p2l = rp_plan_phy2log(previous_placed, l);
            int32_t seen = 0;
            for (int32_t j = 0; j < ep && even; j++) {
                int32_t held = 0;
                for (int32_t s = sb[j]; s < sb[j + 1]; s++) held += p2l[s] >= 0;
                even = held == pr;
                seen += held;
            }
            even = even && seen == E;
        }
        if (even) start = previous_placed;
    }
    rp_plan *plan = NULL;
    rp_status st = RP_OK;
    int32_t *cell = rp_alloc(ctx, (size_t)N * sizeof *cell);
    int64_t *nat = rp_alloc(ctx, (size_t)C * L * E * sizeof *nat);
    int64_t *row = rp_alloc(ctx, (size_t)C * E * sizeof *row);
    int32_t *owner = rp_alloc(ctx, 4 * (size_t)E * sizeof *owner);
    void *scmem = rp_alloc(ctx, joint_vexp_pushes_scratch(ep, E));
    if (!cell || !nat || !row || !owner || !scmem) {
        st = rp_fail_nomem(err, "joint: the balancer's ownership");
        goto out;
    }
    void *sc = joint_vexp_pushes_init(scmem, ep, E);
    int32_t *owned = owner + E, *home = owner + 2 * (size_t)E, *order = owner + 3 * (size_t)E;
    /* each (microbatch, EP group) cell's token-choices per expert: cell m * Q + q */
    for (int32_t s = 0; s < N; s++) {
        int32_t g = rp_plan_seq_rank(base, s), m = rp_plan_seq_microbatch(base, s);
        cell[s] = g < 0 || m < 0 ? -1 : m * Q + g / ep;
    }
    RP_CHECK_GOTO(rp_stats_microbatch_loads(jt->stats, cell, C, nat, err), st, out);
    RP_CHECK_GOTO(rp_plan_copy(base, &plan, err), st, out);
    /* a push saved in one cell: the two weight pushes and the gradient back (the
     * gradient at least at the weights' bytes), one push's time each */
    const double push_s = 3.0 * jt->copy_s;
    const double H = jt->par->horizon_steps;
    const double move_s = start == base || isinf(H) ? 0.0 : 2.0 * jt->move_nv_s / H;
    int64_t ops = 0;
    const int64_t budget = OWN_OPERATIONS;
    for (int32_t l = 0; l < L && budget > 0; l++) {
        const int32_t *p2l = rp_plan_phy2log(start, l);
        for (int32_t j = 0; j < ep; j++)
            for (int32_t s = sb[j]; s < sb[j + 1]; s++)
                if (p2l[s] >= 0) owner[p2l[s]] = j;
        memcpy(home, owner, (size_t)E * sizeof *home);
        for (int32_t c = 0; c < C; c++) memcpy(row + (size_t)c * E, nat + ((size_t)c * L + l) * E, (size_t)E * sizeof *row);
        int64_t cur = layer_pushes(ep, E, row, C, owner, owned, sc, &ops);
        /* the experts by their token-choices over the step, most first (lowest id on
         * ties): the hot experts' owners decide the pushes, so their swaps come first */
        for (int32_t e = 0; e < E; e++) {
            int64_t te = 0;
            for (int32_t c = 0; c < C; c++) te += row[(size_t)c * E + e];
            int32_t at = e;
            while (at > 0 && step_load(row, C, E, order[at - 1]) < te) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = e;
        }
        ops += (int64_t)E * E;
        const int64_t layer_budget = budget / L;
        int64_t used = 0;
        /* first improvement over swaps of two experts of different owners, lowest pair
         * first; a swap is kept when its pushes saved pay for its moves */
        for (bool better = true; better && used < layer_budget;) {
            better = false;
            for (int32_t i = 0; i < E && used < layer_budget; i++)
                for (int32_t j = i + 1; j < E && used < layer_budget; j++) {
                    const int32_t a = order[i], b = order[j];
                    int32_t oa = owner[a], ob = owner[b];
                    if (oa == ob) continue;
                    int32_t moved = (oa != home[a]) + (ob != home[b]);
                    owner[a] = ob;
                    owner[b] = oa;
                    int64_t before = ops;
                    int64_t k = layer_pushes(ep, E, row, C, owner, owned, sc, &ops);
                    used += ops - before;
                    int32_t moved_after = (ob != home[a]) + (oa != home[b]);
                    double gain = (double)(cur - k) * push_s - (moved_after - moved) * 0.5 * move_s;
                    if (k < cur && gain > 0.0) {
                        cur = k;
                        better = true;
                    } else {
                        owner[a] = oa;
                        owner[b] = ob;
                    }
                }
        }
        owned_of(ep, E, owner, owned);
        for (int32_t j = 0; j < ep; j++)
            RP_CHECK_GOTO(rp_plan_set_gpu_experts(plan, l, j, owned + (size_t)j * pr, pr, err), st, out);
    }
    if (previous_placed) RP_CHECK_GOTO(rp_plan_stabilize_slots(plan, previous_placed, err), st, out);
    RP_CHECK_GOTO(rp_plan_validate(plan, jt->cfg, jt->batch, err), st, out);
    *out = plan;
    plan = NULL;
out:
    rp_plan_free(plan);
    rp_free(ctx, cell);
    rp_free(ctx, nat);
    rp_free(ctx, row);
    rp_free(ctx, owner);
    rp_free(ctx, scmem);
    return st;
}
