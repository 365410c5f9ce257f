/* The scheduler: one step's inputs (the safe default, history views), running a policy
 * set on them (merge, slot stabilising, validation, what the engine will evaluate), and
 * judging the plan in use (its cost and migration). Calls core/sched_set.c. */
#include "cost_internal.h"
#include "limits_internal.h"
#include "policy_state.h"
#include "sched_impl.h"

#include "routepack/baseline.h"
#include "routepack/joint.h"

#include <stdio.h>
#include <string.h>

/* The default instruction budget of a step's policy call: the sandbox's default, or 16
 * full evaluations of the cost model on this batch if that is more, so that a policy
 * that leans on the C primitives (rp.joint, rp.evaluate) is not stopped on a large batch
 * where the same work is legitimate (docs/policies.md, Limits); under pipeline
 * parallelism also those rp.joint makes to choose its packing. */
static int64_t step_instructions(const rp_sched *s, const rp_batch *b)
{
    int64_t eval = cost_evaluation_units(s->cfg, b) * (16 + rp_joint_packing_evaluations(s->cfg));
    return eval > RP_SANDBOX_DEFAULT_INSTRUCTIONS ? eval : RP_SANDBOX_DEFAULT_INSTRUCTIONS;
}

void sched_inputs_release(step_inputs *in)
{
    rp_plan_free(in->dflt);
    rp_plan_free(in->base);
    in->dflt = in->base = NULL;
}

/* What runs when the policy gives nothing: the safe default packing of this batch and
 * the placement in use (the initial placement on the first step). */
const rp_plan *sched_inputs_base(step_inputs *in, rp_error *err)
{
    if (!in->base_tried) {
        in->base_tried = true;
        rp_sched *s = in->s;
        rp_error_clear(&in->base_err);
        in->base_status = rp_baseline_plan(s->ctx, s->cfg, in->batch, in->stats, NULL, SAFE_DEFAULT, 0, &in->dflt,
                                           &in->base_err);
        if (in->base_status == RP_OK)
            in->base_status = rp_lua_plan_compose(s->ctx, s->cfg, in->dflt, in->placement ? in->placement : in->dflt,
                                                  NULL, rp_plan_num_microbatches(in->dflt), &in->base, &in->base_err);
        if (in->base_status != RP_OK) {
            char msg[RP_ERROR_TEXT];
            sched_textf(msg, sizeof msg, "%s", in->base_err.text);
            rp_fail(&in->base_err, in->base_status, "the safe default packing (%s) cannot pack this batch: %s",
                    SAFE_DEFAULT, msg);
        }
    }
    if (in->base_status != RP_OK) {
        if (err) *err = in->base_err;
        return NULL;
    }
    return in->base;
}

/* ctx.plan's content for the first policy of a step, or for the second (then `fixed`). */
typedef struct base_src {
    step_inputs *in;
    const rp_plan *fixed;
} base_src;

static const rp_plan *base_of(void *ud, rp_error *err)
{
    base_src *b = ud;
    return b->fixed ? b->fixed : sched_inputs_base(b->in, err);
}

/* History views, most recent first; `skip` drops the newest entries (a dry run sees
 * the history as it was before the step it replays). */
void sched_fill_history(rp_sched *s, step_inputs *in, int32_t skip)
{
    const rp_model *md = rp_config_model(s->cfg);
    size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
    int32_t count = s->hist_count - skip;
    if (count < 0) count = 0;
    for (int32_t i = 0; i < count; i++) {
        int32_t slot = ((s->hist_head - 1 - skip - i) % s->hist_cap + s->hist_cap) % s->hist_cap;
        s->hist_ptrs[i] = s->hist_loads + (size_t)slot * cells;
        s->hist_view_steps[i] = s->hist_steps[slot];
    }
    in->history.count = count;
    in->history.steps = s->hist_view_steps;
    in->history.loads = s->hist_ptrs;
}

void sched_push_history(rp_sched *s, int64_t step, const rp_stats *stats)
{
    if (s->hist_cap == 0) return;
    const rp_model *md = rp_config_model(s->cfg);
    size_t E = (size_t)md->num_experts;
    int64_t *dst = s->hist_loads + (size_t)s->hist_head * (size_t)md->num_layers * E;
    for (int32_t l = 0; l < md->num_layers; l++)
        memcpy(dst + (size_t)l * E, rp_stats_expert_load(stats, l), E * sizeof *dst);
    s->hist_steps[s->hist_head] = step;
    s->hist_head = (s->hist_head + 1) % s->hist_cap;
    if (s->hist_count < s->hist_cap) s->hist_count++;
}


static void mib_text(size_t bytes, char *buf, size_t n)
{
    if (bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else snprintf(buf, n, "%.1f MiB", (double)bytes / (1 << 20));
}

/* Whether the engine may pay for `plan`: its evaluation (the most the engine does with a
 * returned plan; merging, slot stabilising and validation are linear in the plan, which
 * the policy's memory cap bounds) must fit the limits the policy itself runs under,
 * decided from the plan's shape before anything is allocated. A plan the policy could
 * not have passed to rp.evaluate is refused (fallback), never evaluated at the engine's
 * expense. Fills `reason` when it refuses. RP_ENOMEM never: nothing is allocated. */
static bool engine_can_afford(const policy_set *ps, const step_inputs *in, const rp_plan *plan, char *reason,
                              size_t reason_len)
{
    int64_t units = 0;
    size_t bytes = 0;
    rp_error e;
    rp_error_clear(&e);
    if (rp_cost_evaluation_needs(in->cost, plan, &units, &bytes, &e) != RP_OK) {
        sched_textf(reason, reason_len, "%s", e.text);
        return false;
    }
    const rp_sandbox_limits *lim = rp_sandbox_limits_of(ps->pol[ps->count - 1]->sb);
    char shape[160];
    sched_textf(shape, sizeof shape, "%d microbatches x %d layers x %d GPUs x %d experts", rp_plan_num_microbatches(plan),
          rp_plan_num_layers(plan), rp_plan_num_gpus(plan), rp_plan_num_experts(plan));
    if (units > lim->max_instructions) {
        sched_textf(reason, reason_len,
              "evaluating it (%s) would take %lld work units, over the instruction limit of %lld that rp.evaluate "
              "would have charged them to",
              shape, (long long)units, (long long)lim->max_instructions);
        return false;
    }
    if (bytes > lim->max_memory_bytes) {
        char need[32], cap[32];
        mib_text(bytes, need, sizeof need);
        mib_text(lim->max_memory_bytes, cap, sizeof cap);
        sched_textf(reason, reason_len, "evaluating it (%s) needs %s, over the policy's memory limit of %s", shape, need,
              cap);
        return false;
    }
    return true;
}

/* Run the set's policies on `in` and return the merged, slot-stabilised, validated plan,
 * or the reason it failed (a policy error, a limit, an invalid plan, anything that failed
 * inside the policy's call). RP_ENOMEM of the engine's own merging and validation and a
 * batch the safe default cannot pack are errors of the step (status), not reasons. */
void sched_run_set(rp_sched *s, policy_set *ps, step_inputs *in, run_result *r)
{
    memset(r, 0, sizeof *r);
    const rp_plan *so_far = NULL; /* owned below as `merged` */
    rp_plan *merged = NULL;
    rp_error err;
    rp_error_clear(&err);
    int32_t n = rp_batch_num_seqs(in->batch);
    for (int32_t i = 0; i < ps->count; i++) {
        base_src src = {in, so_far};
        rp_lua_frame frame;
        memset(&frame, 0, sizeof frame);
        frame.step = in->step;
        frame.seed = sched_step_seed(s, in->step, i);
        frame.batch = in->batch;
        frame.stats = in->stats;
        frame.cost = in->cost;
        frame.placement = in->placement;
        frame.base = base_of;
        frame.base_ud = &src;
        frame.history = s->hist_cap > 0 ? &in->history : NULL;
        rp_lua_plan_out got;
        int64_t work = 0;
        if (s->opts.max_instructions == 0)
            rp_sandbox_set_max_instructions(ps->pol[i]->sb, step_instructions(s, in->batch));
        double t0 = sched_now_s(), c0 = sched_thread_cpu_s();
        /* after a limit trip: rebuilt from its source in the window of this call */
        rp_status st = policy_ready(&ps->pol[i], &err);
        if (st != RP_OK) r->why = RP_CALL_LIMIT;
        else st = rp_policy_plan(ps->pol[i], &frame, n, 0, &got, &r->why, &work, &err);
        r->wall_s += sched_now_s() - t0;
        r->cpu_s += sched_thread_cpu_s() - c0;
        if (ps->pol[i]->host.decision.set) r->decision = ps->pol[i]->host.decision;
        r->fallback_checks += ps->pol[i]->host.fallback_checks;
        r->fallback_changes += ps->pol[i]->host.fallback_changes;
        r->work += work;
        if (st != RP_OK) {
            /* whatever failed inside the policy's call, out of memory included, is the
             * policy's failure: the step falls back */
            sched_textf(r->reason, sizeof r->reason, "%s", err.text);
            goto fail;
        }
        /* what the policy omitted stays as ctx.plan had it */
        const rp_plan *base = so_far ? so_far : sched_inputs_base(in, &err);
        if (!base) {
            rp_plan_free(got.plan);
            r->status = in->base_status;
            sched_textf(r->reason, sizeof r->reason, "%s", err.text);
            goto fail;
        }
        rp_plan *next = NULL;
        const rp_plan *q = got.plan;
        st = rp_lua_plan_compose(s->ctx, s->cfg, q && got.has_packing ? q : base, q && got.has_placement ? q : base,
                                 q && (got.has_levers || got.has_packing) ? q : base, rp_plan_num_microbatches(base),
                                 &next, &err);
        rp_plan_free(got.plan);
        if (st != RP_OK) {
            if (st == RP_ENOMEM) r->status = st;
            r->why = RP_CALL_BAD_PLAN;
            sched_textf(r->reason, sizeof r->reason, "policy '%s' returned an invalid plan: %s", ps->pol[i]->info.name,
                     err.text);
            goto fail;
        }
        rp_plan_free(merged);
        merged = next;
        so_far = merged;
    }
    char why[RP_ERROR_TEXT];
    if (!engine_can_afford(ps, in, merged, why, sizeof why)) {
        r->why = RP_CALL_BAD_PLAN;
        sched_textf(r->reason, sizeof r->reason, "policy '%s' returned a plan the engine will not evaluate: %s", ps->name,
              why);
        goto fail;
    }
    /* physical slots: experts that stay on an EP rank keep their slot */
    rp_status st = RP_OK;
    if (in->placement) st = rp_plan_stabilize_slots(merged, in->placement, &err);
    if (st == RP_OK) st = rp_plan_validate(merged, s->cfg, in->batch, &err);
    if (st != RP_OK) {
        if (st == RP_ENOMEM) r->status = st;
        r->why = RP_CALL_BAD_PLAN;
        sched_textf(r->reason, sizeof r->reason, "policy '%s' returned an invalid plan: %s", ps->name, err.text);
        goto fail;
    }
    r->plan = merged;
    return;
fail:
    rp_plan_free(merged);
    r->plan = NULL;
    if (r->why == RP_CALL_OK) r->why = RP_CALL_ERROR;
}

/* The cost and the migration plan of `plan` (replacing what *migration held). */
rp_status sched_judge(rp_sched *s, step_inputs *in, const rp_plan *plan, rp_step_report *rep,
                       sched_migration_next *migration, rp_error *err)
{
    sched_migration_discard(s->ctx, migration);
    /* the summary only: the plan the policy returned was most likely just scored */
    rp_status st = cost_summary_of(in->cost, plan, &rep->cost, &rep->forward_s, err);
    if (st != RP_OK) return st;
    rp_cost_outside(in->cost, &rep->outside, NULL);
    st = sched_migration_prepare(&s->migration, s->ctx, s->cfg, in->placement, plan, migration, rep, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        sched_textf(msg, sizeof msg, "%s", err->text);
        return rp_fail(err, st, "sched: step %lld: %s", (long long)in->step, msg);
    }
    return RP_OK;
}
