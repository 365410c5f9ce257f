/* A step's flat metrics: the scalars a trainer logs every step (TensorBoard, W&B), as
 * vLLM logs `balancedness` and verl `log_seqlen_unbalance`. One definition, used by the
 * step report's JSON (so Python's StepResult.metrics()) and by `routepack simulate
 * --json`, so the keys are the same everywhere. docs/python.md lists them. Also the
 * step report as JSON (rp_sched_report_json) and the router shift attached to it. */
#include "cost_internal.h"
#include "jsonx.h"
#include "sched_impl.h"

#include <jansson.h>
#include <stdio.h>

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

/* ---- the report as JSON ------------------------------------------------------------------ */

static void hex64(char *buf, uint64_t v) { snprintf(buf, 17, "%016llx", (unsigned long long)v); }

rp_status rp_sched_attach_shift(rp_sched *s, const rp_shift *shift, rp_error *err)
{
    if (!s || !shift) return rp_fail(err, RP_EINVAL, "sched: scheduler and router shift are required");
    if (!s->has_report || !s->prev_batch) return rp_fail(err, RP_EINVAL, "sched: no step has run yet");
    const rp_model *md = rp_config_model(s->cfg);
    const int32_t n = rp_batch_num_seqs(s->prev_batch);
    const int64_t choices = rp_batch_num_tokens(s->prev_batch) * md->num_layers * md->top_k;
    if (rp_shift_num_seqs(shift) != n || rp_shift_choices(shift) != choices)
        return rp_fail(err, RP_EINVAL,
                       "sched: the router shift covers %d sequences and %lld token-choices, but step %lld has "
                       "%d sequences and %lld token-choices",
                       rp_shift_num_seqs(shift), (long long)rp_shift_choices(shift), (long long)s->report.step, n,
                       (long long)choices);
    if (rp_shift_num_layers(shift) != md->num_layers || rp_shift_num_experts(shift) != md->num_experts ||
        rp_shift_top_k(shift) != md->top_k)
        return rp_fail(err, RP_EINVAL,
                       "sched: the router shift has %d layers x %d experts x top-%d, but the model has %d x %d x "
                       "top-%d",
                       rp_shift_num_layers(shift), rp_shift_num_experts(shift), rp_shift_top_k(shift),
                       md->num_layers, md->num_experts, md->top_k);
    s->report.shift = rp_shift_summarize(shift);
    s->report.has_shift = true;
    return RP_OK;
}

rp_status rp_sched_report_json(const rp_sched *s, char **text, size_t *len, rp_error *err)
{
    if (!s || !text) return rp_fail(err, RP_EINVAL, "sched: scheduler and output are required");
    if (!s->has_report) return rp_fail(err, RP_EINVAL, "sched: no step has run yet");
    const rp_step_report *r = &s->report;
    char h1[17], h2[17];
    hex64(h1, r->policy_hash);
    hex64(h2, r->plan_hash);
    json_t *cost = json_pack(
        "{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:{s:i, s:i, s:i, s:s}}", "step_s", r->cost.step_s,
        "lower_bound_s", r->cost.lower_bound_s, "ratio", r->cost.ratio, "attention_s", r->cost.attention_s,
        "dispatch_s", r->cost.dispatch_s, "expert_s", r->cost.expert_s, "combine_s", r->cost.combine_s,
        "grad_reduce_s", r->cost.grad_reduce_s, "extra_copy_s", r->cost.extra_copy_s, "attention_imbalance",
        r->cost.attention_imbalance, "expert_imbalance", r->cost.expert_imbalance, "straggler", "gpu",
        (int)r->cost.straggler_gpu, "microbatch", (int)r->cost.straggler_mb, "layer", (int)r->cost.straggler_layer,
        "side", cost_side_name(r->cost.straggler_side));
    json_t *root = json_pack("{s:I, s:{s:s, s:s, s:s}, s:s, s:o, s:f, s:I, s:b, s:s?, s:b, s:s?, s:i, s:b, s:i, "
                             "s:f, s:f, s:f}",
                             "step", (json_int_t)r->step, "policy", "name", r->policy_name, "version", r->policy_version,
                             "hash", h1, "plan_hash", h2, "cost", cost, "plan_wall_s", r->plan_wall_s, "policy_work",
                             (json_int_t)r->policy_work, "fallback", r->fallback, "fallback_reason",
                             r->fallback ? r->fallback_reason : NULL, "swapped", r->swapped, "swap_error",
                             r->swap_error[0] ? r->swap_error : NULL, "plan_from_rank", (int)r->plan_from_rank,
                             "ranks_disagreed", r->ranks_disagreed, "experts_moved", (int)r->experts_moved,
                             "migration_bytes", r->migration_bytes, "migration_s", r->migration_s, "policy_wall_s",
                             r->policy_wall_s);
    /* demotion: the steps in a row that fell back, and the policy that replaced this one */
    if (root && (json_object_set_new(root, "failed_steps", json_integer(r->failed_steps)) != 0 ||
                 (r->demoted && json_object_set_new(root, "demoted_to", json_string(r->demoted_to)) != 0) ||
                 (r->demote_error[0] && json_object_set_new(root, "demote_error", json_string(r->demote_error)) != 0))) {
        json_decref(root);
        root = NULL;
    }
    if (root && r->has_shift) {
        const rp_shift_summary *m = &r->shift;
        json_t *shift = json_pack("{s:I, s:I, s:f, s:f, s:i, s:f, s:i, s:f, s:i, s:i}", "choices",
                                  (json_int_t)m->choices, "changed", (json_int_t)m->changed, "fraction",
                                  m->fraction, "max_layer_fraction", m->max_layer_fraction, "max_layer",
                                  (int)m->max_layer, "max_seq_fraction", m->max_seq_fraction, "max_seq",
                                  (int)m->max_seq, "max_expert_lost_fraction", m->max_expert_lost_fraction,
                                  "max_expert_layer", (int)m->max_expert_layer, "max_expert", (int)m->max_expert);
        if (!shift || json_object_set_new(root, "router_shift", shift) != 0) {
            json_decref(root);
            root = NULL;
        }
    }
    if (!root || json_object_set_new(root, "metrics", rp_step_metrics_json(r)) != 0) {
        json_decref(root);
        return rp_fail_nomem(err, "the step report");
    }
    return rp_json_text(s->ctx, root, "the step report", text, len, err);
}
