/* Predicted cost of changing placements: which experts must move, over which links,
 * and how long the busiest EP rank spends receiving them (docs/cost-model.md, "Migration"). */
#include "cost_internal.h"

#include <string.h>

static rp_status check_placement(const rp_cost *c, const rp_plan *p, const char *which, rp_error *err)
{
    if (!p) return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan is missing", which);
    if (!rp_plan_has_placement(p))
        return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan has no placement", which);
    if (rp_plan_num_gpus(p) != c->G || rp_plan_ep_size(p) != c->ep || rp_plan_num_layers(p) != c->L ||
        rp_plan_num_experts(p) != c->E)
        return rp_fail(err, RP_EINVAL,
                       "cost: migration: the '%s' plan is shaped for %d GPUs, EP %d, %d layers, %d experts; the "
                       "config has %d, %d, %d, %d", which, rp_plan_num_gpus(p), rp_plan_ep_size(p),
                       rp_plan_num_layers(p), rp_plan_num_experts(p), c->G, c->ep, c->L, c->E);
    const int32_t *sb = rp_plan_slot_begin(p);
    if (!sb || sb[0] != 0 || sb[c->ep] != rp_plan_total_slots(p))
        return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's slot offsets are inconsistent", which);
    for (int32_t j = 0; j < c->ep; j++)
        if (sb[j + 1] < sb[j])
            return rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's EP rank %d has a negative slot count",
                           which, j);
    return RP_OK;
}

/* Which experts each EP rank holds at one layer: held[rank * E + e] = 1. */
static rp_status mark_held(const rp_cost *c, const rp_plan *p, const char *which, int32_t layer,
                           unsigned char *held, rp_error *err)
{
    const int32_t *sb = rp_plan_slot_begin(p), *row = rp_plan_phy2log(p, layer);
    memset(held, 0, (size_t)c->ep * c->E);
    for (int32_t r = 0; r < c->ep; r++)
        for (int32_t k = sb[r]; k < sb[r + 1]; k++) {
            int32_t e = row[k];
            if (e < -1 || e >= c->E) {
                rp_fail(err, RP_EINVAL, "cost: migration: the '%s' plan's layer %d slot %d holds expert %d, but "
                        "the model has %d", which, layer, k, e, c->E);
                if (err) err->expert = e;
                return RP_EINVAL;
            }
            if (e >= 0) held[(size_t)r * c->E + e] = 1;
        }
    return RP_OK;
}

rp_status rp_cost_migration(const rp_cost *c, const rp_plan *from, const rp_plan *to, double *seconds,
                            double *bytes, rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st;
    if ((st = check_placement(c, from, "from", err)) != RP_OK || (st = check_placement(c, to, "to", err)) != RP_OK)
        return st;
    const int32_t ep = c->ep, E = c->E, G = c->G, R = c->move_links.ep_ranks;
    const int32_t *sb = rp_plan_slot_begin(to);
    unsigned char *had = rp_alloc(c->ctx, (size_t)ep * E), *want = rp_alloc(c->ctx, (size_t)ep * E);
    /* per (pipeline stage, GPU, EP rank of the GPU): under PP a stage's GPUs receive only
     * its layers' experts, and the stages migrate at once; a copy lands on the EP rank
     * whose slot first wants it and runs over that rank's links */
    double *recv_nv = rp_calloc(c->ctx, (size_t)G * c->PP * R, sizeof(double));
    double *recv_net = rp_calloc(c->ctx, (size_t)G * c->PP * R, sizeof(double));
    double total = 0.0;
    if (!had || !want || !recv_nv || !recv_net) {
        st = rp_fail_nomem(err, "a migration estimate");
        goto out;
    }
    for (int32_t l = 0; l < c->L; l++) {
        RP_CHECK_GOTO(mark_held(c, from, "from", l, had, err), st, out);
        RP_CHECK_GOTO(mark_held(c, to, "to", l, want, err), st, out);
        const int32_t *row = rp_plan_phy2log(to, l);
        for (int32_t r = 0; r < ep; r++)
            for (int32_t e = 0; e < E; e++) {
                if (!want[(size_t)r * E + e] || had[(size_t)r * E + e]) continue;
                int32_t k = sb[r];
                while (row[k] != e) k++; /* want says one of r's slots holds e */
                const int32_t u = migrate_links_ep_rank(R, sb[r + 1] - sb[r], k - sb[r]);
                /* every EP group fetches its own copy from its nearest holder */
                bool anywhere = false;
                for (int32_t j = 0; j < ep && !anywhere; j++) anywhere = had[(size_t)j * E + e];
                if (!anywhere) {
                    rp_fail(err, RP_EINVAL, "cost: migration: layer %d expert %d is on no EP rank of the 'from' "
                            "placement, so it cannot be copied", l, e);
                    if (err) err->expert = e;
                    st = RP_EINVAL;
                    goto out;
                }
                for (int32_t q = 0; q < c->Q; q++) {
                    int32_t g = q * ep + r;
                    const size_t at = ((size_t)c->layer_stage[l] * G + g) * R + u;
                    bool near = false;
                    for (int32_t j = 0; j < ep && !near; j++)
                        near = had[(size_t)j * E + e] && c->gpu_node[q * ep + j] == c->gpu_node[g];
                    if (near) recv_nv[at] += c->expert_move_bytes;
                    else recv_net[at] += c->expert_move_bytes;
                    total += c->expert_move_bytes;
                }
            }
    }
    double worst = 0.0;
    for (size_t i = 0; i < (size_t)G * c->PP * R; i++) {
        double t = migrate_links_s(&c->move_links, recv_nv[i], recv_net[i], 0.0);
        if (t > worst) worst = t;
    }
    if (seconds) *seconds = worst;
    if (bytes) *bytes = total;
    st = RP_OK;
out:
    rp_free(c->ctx, had);
    rp_free(c->ctx, want);
    rp_free(c->ctx, recv_nv);
    rp_free(c->ctx, recv_net);
    return st;
}
