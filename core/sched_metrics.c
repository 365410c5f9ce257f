/* A step's flat metrics: the scalars a trainer logs every step (TensorBoard, W&B), as
 * vLLM logs `balancedness` and verl `log_seqlen_unbalance`. One definition, used by the
 * step report's JSON (so Python's StepResult.metrics()) and by `routepack simulate
 * --json`, so the keys are the same everywhere. docs/python.md lists them. */
#include "sched_internal.h"

#include <jansson.h>

json_t *rp_step_metrics_json(const rp_step_report *r)
{
    const rp_cost_summary *c = &r->cost;
    json_t *m = json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:f, s:f, s:i, s:i, s:i,"
                     " s:f, s:i, s:f, s:f, s:i, s:i, s:i}",
                     "step_time_ms", c->step_s * 1e3,
                     "lower_bound_ms", c->lower_bound_s * 1e3,
                     "step_over_lower_bound", c->ratio,
                     "attention_ms", c->attention_s * 1e3,
                     "dispatch_ms", c->dispatch_s * 1e3,
                     "expert_ms", c->expert_s * 1e3,
                     "combine_ms", c->combine_s * 1e3,
                     "attention_imbalance", c->attention_imbalance,
                     "expert_imbalance", c->expert_imbalance,
                     /* vLLM's balancedness: mean over max, the inverse of the imbalance */
                     "expert_balancedness", c->expert_imbalance > 0 ? 1.0 / c->expert_imbalance : 1.0,
                     "migration_bytes", r->migration_bytes,
                     "migration_ms", r->migration_s * 1e3,
                     "experts_moved", (int)r->experts_moved,
                     "plan_ms", r->plan_wall_s * 1e3,
                     "policy_ms", r->policy_wall_s * 1e3,
                     "fallback", r->fallback ? 1 : 0,
                     "swapped", r->swapped ? 1 : 0,
                     "ranks_disagreed", r->ranks_disagreed ? 1 : 0,
                     /* the policy's migration decision (rp.decision); -1: it gave none */
                     "persistence", r->has_decision ? r->persistence : -1.0,
                     "persistence_observations", (int)r->persistence_observations,
                     "predicted_saving_ms", r->predicted_saving_s * 1e3,
                     "realised_saving_ms", r->realised_saving_s * 1e3,
                     "realised_scored", r->realised_scored ? 1 : 0,
                     /* rp.joint's fallback check: how often it ran, how often it changed the plan */
                     "fallback_checks", (int)r->fallback_checks,
                     "fallback_check_changes", (int)r->fallback_check_changes);
    /* router shift: only once the trainer attached it (rp_sched_attach_shift) */
    if (m && r->has_shift &&
        (json_object_set_new(m, "router_shift_fraction", json_real(r->shift.fraction)) != 0 ||
         json_object_set_new(m, "router_shift_max_layer_fraction", json_real(r->shift.max_layer_fraction)) != 0 ||
         json_object_set_new(m, "router_shift_max_seq_fraction", json_real(r->shift.max_seq_fraction)) != 0 ||
         json_object_set_new(m, "router_shift_max_expert_lost_fraction",
                             json_real(r->shift.max_expert_lost_fraction)) != 0)) {
        json_decref(m);
        return NULL;
    }
    return m;
}
