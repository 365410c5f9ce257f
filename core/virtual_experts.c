/* The per-forward offload plan of Megatron-Core's virtual-expert balancer (MoonEP) for
 * one EP group, re-derived from the algorithm its planner kernel runs
 * (docs/baselines.md, "Virtual experts (MoonEP)"), and the limits a trainer must meet. */
#include "internal.h"
#include "routepack/virtual_experts.h"
#include "virtual_experts_internal.h"

#include <stdint.h>
#include <string.h>

struct rp_vexp {
    rp_context *ctx;
    int32_t ep, E, per_rank;
    /* results of the last plan */
    int64_t *rank_load;    /* [ep] */
    int64_t *allocation;   /* [E * ep] */
    int32_t *slot_expert;  /* [ep * per_rank] */
    int64_t *traffic;      /* [ep * ep] */
    int32_t *pushes_out, *pushes_in; /* [ep] */
    int32_t num_virtual;
    /* scratch */
    int64_t *native_total; /* [E] */
    int64_t *balance;      /* [ep] */
    int64_t *quota;        /* [ep * ep] quota[sender * ep + receiver] */
    int64_t *remaining;    /* [per_rank] */
    int32_t *owned;        /* [ep * per_rank] experts of each rank, ascending */
    int32_t *fill;         /* [ep] */
    int32_t *owner;        /* [E] */
    int32_t *n_alloc;      /* [ep * per_rank] scratch for the next plan's slots */
    int64_t *n_rank_load, *n_allocation, *n_traffic;
    int32_t *n_pushes_out, *n_pushes_in;
    /* the (expert, receiver) pairs step 2 of a plan allocates, and which experts it splits:
     * only those need the general route fill and a virtual slot */
    int32_t *pair_expert, *pair_rank; /* [ep * (ep + per_rank)] */
    uint8_t *split;                   /* [E] */
};

rp_status rp_vexp_check_config(const rp_config *cfg, rp_error *err)
{
    if (!cfg) return rp_fail(err, RP_EINVAL, "virtual experts: no config");
    if (!rp_config_trainer(cfg)->per_forward_balancer)
        return rp_fail(err, RP_EINVAL,
                       "virtual experts: trainer.per_forward_balancer is false: the trainer does not run Megatron's "
                       "per-forward balancer; plan without it, or set the key true where the trainer runs it");
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    if (t->ep_size < RP_VEXP_MIN_EP || t->ep_size > RP_VEXP_MAX_EP)
        return rp_fail(err, RP_EINVAL,
                       "virtual experts: topology.ep_size is %d; the balancer runs on EP groups of %d to %d GPUs",
                       (int)t->ep_size, RP_VEXP_MIN_EP, RP_VEXP_MAX_EP);
    if (t->ep_size > t->gpus_per_node || t->gpus_per_node % t->ep_size != 0)
        return rp_fail(err, RP_EINVAL,
                       "virtual experts: an EP group of %d GPUs spans nodes of %d GPUs; the balancer pushes "
                       "weights through NVLink symmetric memory, so every EP group must lie inside one node",
                       (int)t->ep_size, (int)t->gpus_per_node);
    if (m->num_experts % t->ep_size != 0)
        return rp_fail(err, RP_EINVAL,
                       "virtual experts: model.num_experts %d is not a multiple of topology.ep_size %d; "
                       "the balancer needs every EP rank to own the same number of experts",
                       (int)m->num_experts, (int)t->ep_size);
    const int32_t per_rank = m->num_experts / t->ep_size;
    for (int32_t g = 0; g < t->num_gpus; g++)
        if (t->slots[g] < per_rank)
            return rp_fail(err, RP_EINVAL,
                           "virtual experts: GPU %d has %d expert slots; owning %d experts evenly "
                           "(model.num_experts / topology.ep_size) needs at least %d",
                           (int)g, (int)t->slots[g], (int)m->num_experts, (int)per_rank);
    return RP_OK;
}

double rp_vexp_expert_bytes(const rp_model *model)
{
    return 3.0 * (double)model->hidden_size * (double)model->expert_ffn_size * (double)model->bytes_per_param;
}

void rp_vexp_free(rp_vexp *v)
{
    if (!v) return;
    rp_context *ctx = v->ctx;
    void *blocks[] = {v->rank_load, v->allocation, v->slot_expert, v->traffic, v->pushes_out, v->pushes_in,
                      v->native_total, v->balance, v->quota, v->remaining, v->owned, v->fill, v->owner,
                      v->n_alloc, v->n_rank_load, v->n_allocation, v->n_traffic, v->n_pushes_out,
                      v->n_pushes_in, v->pair_expert, v->pair_rank, v->split};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) rp_free(ctx, blocks[i]);
    rp_free(ctx, v);
}

rp_status rp_vexp_new(rp_context *ctx, int32_t ep_size, int32_t num_experts, rp_vexp **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "virtual experts: NULL context or output");
    *out = NULL;
    if (ep_size < RP_VEXP_MIN_EP || ep_size > RP_VEXP_MAX_EP)
        return rp_fail(err, RP_EINVAL, "virtual experts: ep_size is %d; the balancer runs on EP groups of %d to %d GPUs",
                       (int)ep_size, RP_VEXP_MIN_EP, RP_VEXP_MAX_EP);
    if (num_experts <= 0 || num_experts % ep_size != 0)
        return rp_fail(err, RP_EINVAL,
                       "virtual experts: %d experts cannot be owned evenly by %d EP ranks (it must be a positive multiple)",
                       (int)num_experts, (int)ep_size);
    rp_vexp *v = rp_calloc(ctx, 1, sizeof *v);
    if (!v) return rp_fail_nomem(err, "virtual-expert planner");
    v->ctx = ctx;
    v->ep = ep_size;
    v->E = num_experts;
    v->per_rank = num_experts / ep_size;
    const size_t ep = (size_t)ep_size, E = (size_t)num_experts, pr = (size_t)v->per_rank;
    v->rank_load = rp_calloc(ctx, ep, sizeof(int64_t));
    v->allocation = rp_calloc(ctx, E * ep, sizeof(int64_t));
    v->slot_expert = rp_calloc(ctx, ep * pr, sizeof(int32_t));
    v->traffic = rp_calloc(ctx, ep * ep, sizeof(int64_t));
    v->pushes_out = rp_calloc(ctx, ep, sizeof(int32_t));
    v->pushes_in = rp_calloc(ctx, ep, sizeof(int32_t));
    v->native_total = rp_calloc(ctx, E, sizeof(int64_t));
    v->balance = rp_calloc(ctx, ep, sizeof(int64_t));
    v->quota = rp_calloc(ctx, ep * ep, sizeof(int64_t));
    v->remaining = rp_calloc(ctx, pr, sizeof(int64_t));
    v->owned = rp_calloc(ctx, ep * pr, sizeof(int32_t));
    v->fill = rp_calloc(ctx, ep, sizeof(int32_t));
    v->owner = rp_calloc(ctx, E, sizeof(int32_t));
    v->n_alloc = rp_calloc(ctx, ep * pr, sizeof(int32_t));
    v->n_rank_load = rp_calloc(ctx, ep, sizeof(int64_t));
    v->n_allocation = rp_calloc(ctx, E * ep, sizeof(int64_t));
    v->n_traffic = rp_calloc(ctx, ep * ep, sizeof(int64_t));
    v->n_pushes_out = rp_calloc(ctx, ep, sizeof(int32_t));
    v->n_pushes_in = rp_calloc(ctx, ep, sizeof(int32_t));
    v->pair_expert = rp_calloc(ctx, ep * (ep + pr), sizeof(int32_t));
    v->pair_rank = rp_calloc(ctx, ep * (ep + pr), sizeof(int32_t));
    v->split = rp_calloc(ctx, E, 1);
    if (!v->pair_expert || !v->pair_rank || !v->split || !v->rank_load || !v->allocation || !v->slot_expert || !v->traffic || !v->pushes_out || !v->pushes_in ||
        !v->native_total || !v->balance || !v->quota || !v->remaining || !v->owned || !v->fill || !v->owner ||
        !v->n_alloc || !v->n_rank_load || !v->n_allocation || !v->n_traffic || !v->n_pushes_out ||
        !v->n_pushes_in) {
        rp_vexp_free(v);
        return rp_fail_nomem(err, "virtual-expert planner");
    }
    for (size_t i = 0; i < ep * pr; i++) v->slot_expert[i] = -1;
    *out = v;
    return RP_OK;
}

int32_t rp_vexp_ep_size(const rp_vexp *v) { return v ? v->ep : 0; }
int32_t rp_vexp_experts_per_rank(const rp_vexp *v) { return v ? v->per_rank : 0; }
const int64_t *rp_vexp_rank_load(const rp_vexp *v) { return v ? v->rank_load : NULL; }
const int64_t *rp_vexp_allocation(const rp_vexp *v) { return v ? v->allocation : NULL; }
const int32_t *rp_vexp_slot_expert(const rp_vexp *v) { return v ? v->slot_expert : NULL; }
const int64_t *rp_vexp_traffic(const rp_vexp *v) { return v ? v->traffic : NULL; }
int32_t rp_vexp_num_virtual(const rp_vexp *v) { return v ? v->num_virtual : 0; }
const int32_t *rp_vexp_pushes_out(const rp_vexp *v) { return v ? v->pushes_out : NULL; }
const int32_t *rp_vexp_pushes_in(const rp_vexp *v) { return v ? v->pushes_in : NULL; }

/* Index of the largest value among the first n, the lowest index on ties. */
int32_t vexp_argmax_low(const int64_t *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int32_t argmin_low(const int64_t *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] < x[best]) best = i;
    return best;
}

void vexp_quotas(int64_t *bal, int64_t *quota, int32_t ep)
{
    memset(quota, 0, (size_t)ep * ep * sizeof *quota);
    for (int32_t round = 0; round < ep; round++) {
        int32_t hi = vexp_argmax_low(bal, ep), lo = argmin_low(bal, ep);
        if (bal[hi] <= 0) break;
        int64_t moved = -bal[lo];
        quota[(size_t)hi * ep + lo] = moved;
        bal[hi] -= moved;
        bal[lo] = 0;
    }
}

/* Check the inputs and fill owner[], owned[] and native totals; nothing of the last plan
 * changes here (only scratch). */
static rp_status plan_inputs(rp_vexp *v, const int32_t *counts, const int32_t *owner, rp_error *err)
{
    const int32_t ep = v->ep, E = v->E, pr = v->per_rank;
    int64_t total = 0;
    for (int32_t r = 0; r < ep; r++) v->fill[r] = 0;
    for (int32_t e = 0; e < E; e++) {
        int32_t r = owner ? owner[e] : e / pr;
        if (r < 0 || r >= ep) {
            rp_status st = rp_fail(err, RP_EINVAL, "virtual experts: expert %d is owned by EP rank %d, outside 0..%d",
                                   (int)e, (int)r, (int)ep - 1);
            if (err) err->expert = e;
            return st;
        }
        if (v->fill[r] == pr) {
            rp_status st = rp_fail(err, RP_EINVAL,
                                   "virtual experts: EP rank %d owns more than %d experts (expert %d is one too many); "
                                   "the balancer needs every rank to own exactly num_experts / ep_size",
                                   (int)r, (int)pr, (int)e);
            if (err) err->expert = e;
            return st;
        }
        v->owner[e] = r;
        v->owned[(size_t)r * pr + v->fill[r]++] = e; /* ascending expert id: the local order */
        v->native_total[e] = 0;
    }
    for (int32_t r = 0; r < ep; r++) {
        int64_t own = 0;
        for (int32_t e = 0; e < E; e++) {
            int32_t c = counts[(size_t)r * E + e];
            if (c < 0) {
                rp_status st = rp_fail(err, RP_EINVAL, "virtual experts: EP rank %d routes %d token-choices to expert %d",
                                       (int)r, (int)c, (int)e);
                if (err) err->expert = e;
                return st;
            }
            own += c;
            v->native_total[e] += c;
        }
        if (own > INT32_MAX)
            return rp_fail(err, RP_ERANGE, "virtual experts: EP rank %d routes %lld token-choices, more than 2^31 - 1",
                           (int)r, (long long)own);
        v->balance[r] = 0;
        total += own;
    }
    /* Every rank's target is the group's mean (Megatron's ranks all route the same
     * count, tokens x top_k, which is then the mean); a remainder goes to the lowest
     * ranks. Equal targets are what keep a sender's quota within what it holds. */
    for (int32_t r = 0; r < ep; r++) v->balance[r] = -(total / ep + (r < total % ep ? 1 : 0));
    for (int32_t e = 0; e < E; e++) {
        if (v->native_total[e] > INT32_MAX)
            return rp_fail(err, RP_ERANGE, "virtual experts: expert %d receives %lld token-choices, more than 2^31 - 1",
                           (int)e, (long long)v->native_total[e]);
        v->balance[v->owner[e]] += v->native_total[e];
    }
    return RP_OK;
}

rp_status rp_vexp_plan(rp_vexp *v, const int32_t *counts, const int32_t *owner, rp_error *err)
{
    if (!v || !counts) return rp_fail(err, RP_EINVAL, "virtual experts: NULL planner or counts");
    const int32_t ep = v->ep, E = v->E, pr = v->per_rank;
    rp_status st = plan_inputs(v, counts, owner, err);
    if (st != RP_OK) return st;

    /* 1. Quotas between ranks. balance[r] = native load - target; the balances sum to
     * zero. Pair the most overloaded rank with the most underloaded one (lowest rank on
     * ties) and move the receiver's whole deficit from that one sender; the receiver is
     * then balanced for good. A sender may overshoot into deficit and receive later, but
     * every receiver has exactly one sender, so E / ep virtual slots always suffice. Each
     * round balances at least one rank for good: at most ep rounds. */
    int64_t *quota = v->quota;
    vexp_quotas(v->balance, quota, ep);

    /* 2. Each sender splits its quotas over its own experts (vexp_split_move): the
     * largest quota takes the expert with the most routes left (lowest rank, then lowest
     * local expert on ties), min(quota, left) at a time; each move empties a quota or an
     * expert. */
    int64_t *alloc = v->n_allocation;
    int32_t num_pairs = 0;
    memset(alloc, 0, (size_t)E * ep * sizeof *alloc);
    memset(v->split, 0, (size_t)E);
    for (int32_t e = 0; e < E; e++) alloc[(size_t)e * ep + v->owner[e]] = v->native_total[e];
    for (int32_t s = 0; s < ep; s++) {
        const int32_t *mine = v->owned + (size_t)s * pr;
        int64_t *q = quota + (size_t)s * ep;
        for (int32_t i = 0; i < pr; i++) v->remaining[i] = v->native_total[mine[i]];
        for (int32_t step = 0; step < ep + pr; step++) {
            int32_t dst, i;
            int64_t moved = vexp_split_move(q, v->remaining, ep, pr, &dst, &i);
            if (moved == 0) break;
            /* each (expert, receiver) pair once: the move emptied the quota or the expert */
            v->pair_expert[num_pairs] = mine[i];
            v->pair_rank[num_pairs++] = dst;
            v->split[mine[i]] = 1;
            alloc[(size_t)mine[i] * ep + dst] += moved;
            alloc[(size_t)mine[i] * ep + s] -= moved;
        }
    }

    /* 3. Virtual slots of each rank: the remote experts allocated to it, largest
     * allocation first (highest expert id on ties, as Megatron's kernel). */
    int32_t *slots = v->n_alloc;
    int32_t *pout = v->n_pushes_out, *pin = v->n_pushes_in;
    int32_t num_virtual = 0;
    for (int32_t r = 0; r < ep; r++) pout[r] = pin[r] = 0;
    for (int32_t r = 0; r < ep; r++) {
        int32_t *row = slots + (size_t)r * pr, used = 0;
        for (int32_t s = 0; s < pr; s++) row[s] = -1;
        /* descending expert id, each inserted behind the larger allocations: ties keep the
         * higher expert first. A remote expert allocated to r is one of step 2's pairs
         * (nothing else leaves its owner), so only their experts are visited, in that
         * order: the next lower expert id among r's pairs each time. */
        for (int32_t e = E;;) {
            int32_t next = -1;
            for (int32_t k = 0; k < num_pairs; k++)
                if (v->pair_rank[k] == r && v->pair_expert[k] < e && v->pair_expert[k] > next) next = v->pair_expert[k];
            if (next < 0) break;
            e = next;
            int64_t n = alloc[(size_t)e * ep + r];
            if (v->owner[e] == r || n <= 0) continue;
            if (used == pr)
                return rp_fail(err, RP_EINVAL, "virtual experts: EP rank %d needs more than %d virtual slots "
                               "(internal error: a receiver has one sender)", (int)r, (int)pr);
            int32_t at = used++;
            while (at > 0 && alloc[(size_t)row[at - 1] * ep + r] < n) {
                row[at] = row[at - 1];
                at--;
            }
            row[at] = e;
            pout[v->owner[e]]++;
            pin[r]++;
            num_virtual++;
        }
    }

    /* 4. Routes: expert e's choices, ordered by source rank, fill its destinations in
     * rank order (Megatron's destination boundaries are the prefix sums of the
     * allocation over ranks). */
    int64_t *traffic = v->n_traffic, *load = v->n_rank_load;
    memset(traffic, 0, (size_t)ep * ep * sizeof *traffic);
    for (int32_t r = 0; r < ep; r++) load[r] = 0;
    for (int32_t e = 0; e < E; e++) {
        if (!v->split[e]) {
            /* every choice stays with the owner: each source's count goes there whole */
            const int32_t own = v->owner[e];
            for (int32_t src = 0; src < ep; src++) traffic[(size_t)src * ep + own] += counts[(size_t)src * E + e];
            load[own] += alloc[(size_t)e * ep + own];
            continue;
        }
        int32_t src = 0, dst = 0;
        int64_t src_left = counts[e], dst_left = alloc[(size_t)e * ep];
        for (;;) {
            while (src < ep && src_left == 0) {
                src++;
                if (src < ep) src_left = counts[(size_t)src * E + e];
            }
            while (dst < ep && dst_left == 0) {
                dst++;
                if (dst < ep) dst_left = alloc[(size_t)e * ep + dst];
            }
            if (src == ep || dst == ep) break;
            int64_t n = src_left < dst_left ? src_left : dst_left;
            traffic[(size_t)src * ep + dst] += n;
            src_left -= n;
            dst_left -= n;
        }
        for (int32_t r = 0; r < ep; r++) load[r] += alloc[(size_t)e * ep + r];
    }

    /* Commit: swap the new results in. */
    int64_t *t64;
    int32_t *t32;
    t64 = v->allocation; v->allocation = v->n_allocation; v->n_allocation = t64;
    t64 = v->traffic; v->traffic = v->n_traffic; v->n_traffic = t64;
    t64 = v->rank_load; v->rank_load = v->n_rank_load; v->n_rank_load = t64;
    t32 = v->slot_expert; v->slot_expert = v->n_alloc; v->n_alloc = t32;
    t32 = v->pushes_out; v->pushes_out = v->n_pushes_out; v->n_pushes_out = t32;
    t32 = v->pushes_in; v->pushes_in = v->n_pushes_in; v->n_pushes_in = t32;
    v->num_virtual = num_virtual;
    return RP_OK;
}
