/* A plan's lever statistics (rp_plan_lever_stats): replicas, share sets, extra replicas
 * and what the executor fetches for them in one step. */
#include "internal.h"
#include "routepack/plan.h"

#include <string.h>

rp_status rp_plan_lever_stats(const rp_plan *plan, const rp_config *cfg, rp_lever_stats *out, rp_error *err)
{
    if (!plan || !cfg || !out) return rp_fail(err, RP_EINVAL, "lever stats: plan, config and output are required");
    memset(out, 0, sizeof *out);
    const rp_model *md = rp_config_model(cfg);
    const rp_execution *x = rp_config_execution(cfg);
    const int32_t L = rp_plan_num_layers(plan), E = rp_plan_num_experts(plan), ep = rp_plan_ep_size(plan);
    if (L != md->num_layers || E != md->num_experts)
        return rp_fail(err, RP_EINVAL, "lever stats: the plan has %d layers and %d experts, the config %d and %d", L, E,
                       md->num_layers, md->num_experts);
    if (rp_plan_has_placement(plan)) {
        const int32_t S = rp_plan_total_slots(plan);
        for (int32_t l = 0; l < L; l++) {
            const int32_t *p2l = rp_plan_phy2log(plan, l);
            int32_t held = 0;
            for (int32_t s = 0; s < S; s++) held += p2l[s] >= 0;
            out->replicas += held > E ? held - E : 0; /* every expert has a slot (rp_plan_check) */
        }
    }
    out->share_sets = rp_plan_num_share_sets(plan);
    const int32_t n = rp_plan_num_extra_replicas(plan);
    out->extra_replicas = n;
    if (x->extras_once && n > 0) {
        /* distinct (layer, expert, EP rank): the extras are sorted by (mb, layer, expert) */
        rp_context *ctx = rp_plan_context(plan);
        const size_t bits = (size_t)L * E * ep;
        unsigned char *seen = rp_calloc(ctx, bits / 8 + 1, 1);
        if (!seen) return rp_fail_nomem(err, "lever stats");
        for (int32_t i = 0; i < n; i++) {
            int32_t m, l, e, j;
            rp_plan_extra_replica(plan, i, &m, &l, &e, &j);
            size_t bit = ((size_t)l * E + e) * ep + j;
            if (!(seen[bit >> 3] & (1u << (bit & 7)))) {
                seen[bit >> 3] |= (unsigned char)(1u << (bit & 7));
                out->extras_fetched++;
            }
        }
        rp_free(ctx, seen);
    } else {
        out->extras_fetched = n;
    }
    out->bytes_fetched = out->extras_fetched * 3.0 * md->hidden_size * (double)md->expert_ffn_size * md->bytes_per_param;
    out->bytes_fetched_ahead = x->extras_once && x->extras_ahead ? out->bytes_fetched : 0.0;
    return RP_OK;
}
