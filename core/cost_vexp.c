/* The cost model under per-forward balancing (Megatron-Core's virtual experts, MoonEP):
 * the expert and dispatch terms of one EP group at one (microbatch, layer) from that
 * forward's offload plan (core/virtual_experts.c), with the weight pushes and the
 * gradient reduction the plan costs. docs/cost-model.md, "Per-forward balancing". */
#include "cost_internal.h"
#include "routepack/executor.h"
#include "routepack/virtual_experts.h"

/* Owner of every expert at every layer, from an evenly owned placement (checked by
 * cost_vexp_check before): owner[l * E + e]. */
void cost_vexp_owners(const rp_cost *c, const rp_plan *plan, int32_t *owner)
{
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    for (int32_t l = 0; l < c->L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        for (int32_t j = 0; j < c->ep; j++)
            for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++)
                if (p2l[s] >= 0) owner[(size_t)l * c->E + p2l[s]] = j;
    }
    cost_count(c, (int64_t)c->L * slot_begin[c->ep]);
}

rp_status cost_vexp_check(const rp_cost *c, const rp_plan *plan, rp_error *err)
{
    if (!c->vexp) {
        rp_error why;
        rp_vexp_check_config(c->cfg, &why);
        return rp_fail(err, RP_EINVAL, "cost: the plan runs with per-forward balancing (virtual experts), but %s",
                       why.text);
    }
    if (rp_plan_num_extra_replicas(plan) || rp_plan_num_share_sets(plan))
        return rp_fail(err, RP_EINVAL, "cost: the plan runs with per-forward balancing (virtual experts), which makes "
                       "its own replicas each forward, but it also has %d extra replicas and %d share sets",
                       rp_plan_num_extra_replicas(plan), rp_plan_num_share_sets(plan));
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    const int32_t per_rank = c->E / c->ep;
    for (int32_t l = 0; l < c->L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        for (int32_t j = 0; j < c->ep; j++) {
            int32_t held = 0;
            for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++) held += p2l[s] >= 0;
            if (held != per_rank)
                return rp_fail(err, RP_EINVAL, "cost: per-forward balancing (virtual experts) needs %d experts "
                               "(num_experts / ep_size) on every EP rank, but layer %d EP rank %d holds %d",
                               per_rank, l, j, held);
        }
    }
    return RP_OK;
}

static inline double slot_time(const rp_cost *c, int64_t n)
{
    return n < c->slot_table_n ? c->slot_table[n] : cost_slot_time(c, (double)n);
}

void cost_group_eval_vexp(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                          const int32_t *pair, const int64_t *tokens, double *x_out, double *d_out,
                          group_result *res, cost_scratch *sc)
{
    const int32_t ep = c->ep, E = c->E, g0 = q * ep, per_rank = E / ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    const int32_t *owner = st->vexp_owner + (size_t)l * E;
    rp_vexp *v = c->vexp;
    /* Cannot fail: the ownership was checked when the plan was bound, counts are
     * non-negative and a group's total is at most the batch's token-choices (< 2^31). */
    rp_status planned = rp_vexp_plan(v, cnt, owner, NULL);
    (void)planned;
    cost_count(c, 4 * (int64_t)E * ep + 4 * (int64_t)ep * ep);
    const int64_t *alloc = rp_vexp_allocation(v), *traffic = rp_vexp_traffic(v);
    const int32_t *slot = rp_vexp_slot_expert(v), *pin = rp_vexp_pushes_in(v), *pout = rp_vexp_pushes_out(v);
    double *xa = sc->xacc, *sp = sc->sp;
    for (int32_t r = 0; r < ep; r++) xa[r] = 0.0;
    for (int32_t e = 0; e < E; e++) xa[owner[e]] += slot_time(c, alloc[(size_t)e * ep + owner[e]]);
    for (int32_t r = 0; r < ep; r++)
        for (int32_t s = 0; s < per_rank; s++) {
            int32_t e = slot[(size_t)r * per_rank + s];
            if (e >= 0) xa[r] += slot_time(c, alloc[(size_t)e * ep + r]);
        }
    /* The route map's choices between GPUs (every expert counts as split under
     * balancing, so `pair` holds none), de-duplicated as the dispatcher would. All inside
     * the group's node: the balancer's limit. */
    for (size_t i = 0; i < (size_t)ep * ep; i++) sp[i] = (double)traffic[i];
    for (int32_t r = 0; r < ep; r++) sp[(size_t)r * ep + r] = 0.0;
    cost_group_traffic(c, st, g0, pair, sp, tokens, sc);

    /* Megatron pads every rank of the group to the same token count (the balancer's
     * static shapes): each rank's experts run the largest cell's tokens, the group's
     * balanced load scaled by max / mean tokens */
    int64_t most = 0, sum = 0;
    for (int32_t r = 0; r < ep; r++) {
        sum += tokens[r];
        if (tokens[r] > most) most = tokens[r];
    }
    const double pad = sum > 0 && c->vexp_charges ? (double)most * ep / (double)sum : 1.0;
    res->xmax = res->dmax = -1.0;
    res->xarg = res->darg = g0;
    for (int32_t r = 0; r < ep; r++) {
        double send = sc->si[r], recv = sc->ri[r];
        int32_t copies = pin[r] > pout[r] ? pin[r] : pout[r];
        /* two weight pushes (forward, backward) and the gradients back in FP32 main-grad
         * dtype (bytes_per_grad) */
        double push = copies ? copies * c->expert_bytes / c->nv_bw + c->nv_lat : 0.0;
        double push_grad = copies ? copies * (c->vexp_charges ? c->vexp_grad_bytes : c->expert_bytes) / c->nv_bw +
                                        c->nv_lat
                                  : 0.0;
        double x = xa[r] * pad / c->speed[g0 + r];
        /* the push's copy kernels hold RP_BALANCER_PUSH_SM_FRACTION of the SMs while it
         * runs beside the expert GEMMs: the GEMMs overlapping it run that much slower */
        if (c->vexp_charges)
            x += RP_BALANCER_PUSH_SM_FRACTION / (1.0 - RP_BALANCER_PUSH_SM_FRACTION) * (push < x ? push : x);
        double d = (send > recv ? send : recv) * c->token_bytes / c->nv_bw + c->nv_lat +
                   c->vexp_comm_scale * (2.0 * push + push_grad);
        x_out[r] = x;
        d_out[r] = d;
        group_result_note(res, g0 + r, x, d);
    }
}
