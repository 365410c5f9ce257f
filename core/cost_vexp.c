/* The cost model under per-forward balancing (Megatron-Core's virtual experts, MoonEP):
 * what a plan must be for it (every EP rank owns num_experts / ep_size experts) and who
 * owns what. The group's terms under it (from each forward's offload plan, with the
 * weight pushes and the gradient reduction the plan costs) are cost_group_eval_vexp in
 * cost_group.c. docs/cost-model.md, "Per-forward balancing". */
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
