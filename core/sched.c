/* The scheduler: one step is statistics -> policy (or packing policy then placement
 * policy) -> merge with what it omitted -> stable slots -> validation -> fallback ->
 * multi-rank agreement -> evaluation; plus hot swap at a step boundary after a dry run.
 * This file: creation, the step and the public accessors. Its parts, bottom to top, are
 * listed in core/sched_impl.h. */
#include "cost_internal.h"
#include "limits_internal.h"
#include "sched_impl.h"
#include "stats_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- options ------------------------------------------------------------------------- */

void rp_sched_options_default(rp_sched_options *opts)
{
    memset(opts, 0, sizeof *opts);
    opts->split = RP_SPLIT_EVEN;
    opts->history = 8;
}

static rp_status check_options(const rp_sched_options *o, rp_error *err)
{
    if (o->history < 0 || o->history > MAX_HISTORY)
        return rp_fail(err, RP_EINVAL, "sched: history is %d; it must be within 0..%d", o->history, MAX_HISTORY);
    if (o->split != RP_SPLIT_EVEN && o->split != RP_SPLIT_LOCALITY)
        return rp_fail(err, RP_EINVAL, "sched: unknown split rule %d", (int)o->split);
    if (o->max_instructions < 0 || o->max_depth < 0 || !(o->max_wall_s >= 0) || !isfinite(o->max_wall_s))
        return rp_fail(err, RP_EINVAL, "sched: sandbox limits must be >= 0 (0: the default)");
    if (o->comm && (o->comm->size < 1 || o->comm->rank < 0 || o->comm->rank >= o->comm->size ||
                    !o->comm->allgather || !o->comm->bcast))
        return rp_fail(err, RP_EINVAL, "sched: comm must have size >= 1, a rank in [0, size) and both operations");
    return RP_OK;
}

/* ---- creation ------------------------------------------------------------------------ */

void rp_sched_free(rp_sched *s)
{
    if (!s) return;
    rp_context *ctx = s->ctx;
    sched_set_free(&s->running);
    sched_set_free(&s->staged);
    sched_set_free(&s->previous);
    rp_plan_free(s->current);
    rp_plan_free(s->initial);
    sched_migration_free(&s->migration, ctx);
    rp_batch_free(s->prev_batch);
    rp_stats_free(s->prev_stats);
    rp_stats_free(s->spare_stats);
    rp_free(ctx, s->hist_steps);
    rp_free(ctx, s->hist_loads);
    rp_free(ctx, s->hist_ptrs);
    rp_free(ctx, s->hist_view_steps);
    rp_free(ctx, s->spec);
    rp_free(ctx, s->base_dir);
    rp_free(ctx, s->params_json);
    rp_free(ctx, s->gather_buf);
    rp_free(ctx, s->chunk_buf);
    rp_free(ctx, s);
}

const char *rp_sched_errmsg(const rp_sched *s) { return s ? s->errmsg : "no scheduler"; }

rp_status rp_sched_new(rp_context *ctx, const rp_config *cfg, const rp_sched_options *opts, rp_sched **out,
                       rp_error *err)
{
    if (!ctx || !cfg || !out) return rp_fail(err, RP_EINVAL, "sched: context, config and output are required");
    rp_sched_options defaults;
    rp_sched_options_default(&defaults);
    if (!opts) opts = &defaults;
    rp_status st = check_options(opts, err);
    if (st != RP_OK) return st;
    rp_sched *s = rp_calloc(ctx, 1, sizeof *s);
    if (!s) return rp_fail_nomem(err, "a scheduler");
    s->ctx = ctx;
    s->cfg = cfg;
    s->opts = *opts;
    s->opts.policy = NULL;
    s->opts.params_json = NULL;
    s->opts.comm = NULL;
    s->opts.initial_placement = NULL;
    if (s->opts.demote_after == 0) s->opts.demote_after = RP_SCHED_DEMOTE_AFTER;
    s->staged_at = -1;
    s->limits = rp_sandbox_limits_default();
    if (opts->max_instructions > 0) s->limits.max_instructions = opts->max_instructions;
    if (opts->max_wall_s > 0) s->limits.max_wall_s = opts->max_wall_s;
    if (opts->max_memory_bytes > 0) s->limits.max_memory_bytes = opts->max_memory_bytes;
    if (opts->max_depth > 0) s->limits.max_depth = opts->max_depth;
    if (opts->comm) {
        s->comm = *opts->comm;
        s->has_comm = true;
        /* held for the scheduler's life: no allocation stands between a rank and a
         * collective */
        s->gather_buf = rp_alloc(ctx, (size_t)s->comm.size * RECORD);
        s->chunk_buf = rp_alloc(ctx, PLAN_CHUNK);
        if (!s->gather_buf || !s->chunk_buf) {
            st = rp_fail_nomem(err, "a scheduler");
            goto fail;
        }
    }

    const rp_policy_config *pc = rp_config_policy(cfg);
    const char *spec = opts->policy ? opts->policy : pc->name;
    bool config_policy = !opts->policy || strcmp(opts->policy, pc->name) == 0;
    s->spec = rp_strdup(ctx, spec);
    const char *params = opts->params_json ? opts->params_json : config_policy ? pc->params_json : NULL;
    if (params) s->params_json = rp_strdup(ctx, params);
    if (!s->spec || (params && !s->params_json)) {
        st = rp_fail_nomem(err, "a scheduler");
        goto fail;
    }
    if (!opts->policy) {
        /* a relative policy path in the config is relative to the config's directory */
        const char *src = rp_config_source(cfg);
        const char *slash = src ? strrchr(src, '/') : NULL;
        if (slash) {
            size_t n = (size_t)(slash - src);
            s->base_dir = rp_alloc(ctx, n + 1);
            if (!s->base_dir) {
                st = rp_fail_nomem(err, "a scheduler");
                goto fail;
            }
            memcpy(s->base_dir, src, n);
            s->base_dir[n] = '\0';
        }
    }

    const rp_model *md = rp_config_model(cfg);
    s->hist_cap = opts->history;
    size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
    if (s->hist_cap > 0) {
        s->hist_steps = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_steps);
        s->hist_loads = rp_calloc(ctx, (size_t)s->hist_cap * cells, sizeof *s->hist_loads);
        s->hist_ptrs = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_ptrs);
        s->hist_view_steps = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_view_steps);
        if (!s->hist_steps || !s->hist_loads || !s->hist_ptrs || !s->hist_view_steps) {
            st = rp_fail_nomem(err, "the scheduler's history");
            goto fail;
        }
    }
    RP_CHECK_GOTO(sched_initial_placement(ctx, cfg, opts->initial_placement, &s->initial, err), st, fail);
    RP_CHECK_GOTO(sched_load_set(s, s->spec, s->base_dir, s->params_json, NULL, &s->running, err), st, fail);
    *out = s;
    return RP_OK;
fail:
    rp_sched_free(s);
    return st;
}

/* ---- the step ------------------------------------------------------------------------- */

static rp_status copy_batch(rp_context *ctx, const rp_batch *b, rp_batch **out, rp_error *err)
{
    return rp_batch_new(ctx, rp_batch_num_seqs(b), rp_batch_prompt_lens(b), rp_batch_response_lens(b),
                        rp_batch_group_ids(b), out, err);
}

/* The plan this rank proposes: the policy's, or the fallback (rep->fallback, with the
 * reason). Errors are the step's (no memory, a batch the safe default cannot pack). */
static rp_status propose(rp_sched *s, policy_set *use, step_inputs *in, rp_step_report *rep, rp_plan **out,
                         rp_error *err)
{
    const int64_t step = in->step;
    run_result r;
    sched_run_set(s, use, in, &r);
    if (r.status != RP_OK) return rp_fail(err, r.status, "sched: step %lld: %s", (long long)step, r.reason);
    rep->policy_work = r.work;
    rep->policy_wall_s = r.wall_s;
    rep->policy_cpu_s = r.cpu_s;
    if (r.plan) {
        rep->fallback_checks = r.fallback_checks;
        rep->fallback_check_changes = r.fallback_changes;
    }
    if (r.plan && r.decision.set) {
        rep->has_decision = true;
        rep->persistence = r.decision.persistence;
        rep->persistence_observations = r.decision.observations;
        rep->predicted_saving_s = r.decision.predicted_saving_s;
        rep->realised_scored = r.decision.realised_scored;
        rep->realised_saving_s = r.decision.realised_saving_s;
    }
    if (r.plan) {
        *out = r.plan;
        return RP_OK;
    }
    rep->fallback = true;
    sched_textf(rep->fallback_reason, sizeof rep->fallback_reason, "%s", r.reason);
    const rp_plan *base = sched_inputs_base(in, err);
    if (!base) {
        rp_status st = in->base_status;
        char msg[RP_ERROR_TEXT];
        sched_textf(msg, sizeof msg, "%s", err->text);
        return rp_fail(err, st, "sched: step %lld: no valid plan: %s (and the policy failed: %s)", (long long)step,
                       msg, r.reason);
    }
    rp_plan *plan = NULL;
    rp_status st = rp_lua_plan_compose(s->ctx, s->cfg, base, base, NULL, rp_plan_num_microbatches(base), &plan, err);
    if (st == RP_OK && in->placement) st = rp_plan_stabilize_slots(plan, in->placement, err);
    if (st == RP_OK) {
        st = rp_plan_validate(plan, s->cfg, in->batch, err);
        if (st != RP_OK) {
            char msg[RP_ERROR_TEXT];
            sched_textf(msg, sizeof msg, "%s", err->text);
            rp_fail(err, st, "sched: step %lld: the fallback plan is not valid for this batch: %s", (long long)step,
                    msg);
        }
    }
    if (st != RP_OK) {
        rp_plan_free(plan);
        return st;
    }
    *out = plan;
    return RP_OK;
}

/* One step from the whole step's statistics (owned; NULL when `prep`, the status of
 * making them, is an error): rp_sched_step and rp_sched_step_stats share it. */
static rp_status run_step(rp_sched *s, int64_t step, const rp_batch *batch, rp_stats *stats, rp_status prep,
                          double t0, const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    rp_cost *cost = NULL;
    rp_batch *copy = NULL;
    step_inputs in;
    memset(&in, 0, sizeof in);
    rp_plan *plan = NULL;
    rp_step_report rep;
    memset(&rep, 0, sizeof rep);
    rep.step = step;
    sched_migration_next migration = {0};
    rp_status st = prep;

    if (st == RP_OK) st = rp_cost_new(s->ctx, s->cfg, batch, stats, s->opts.split, &cost, err);
    if (st == RP_OK) st = copy_batch(s->ctx, batch, &copy, err);
    in.s = s;
    in.step = step;
    in.batch = batch;
    in.stats = stats;
    in.cost = cost;
    in.placement = s->current && rp_plan_has_placement(s->current) ? s->current : s->initial;
    if (st == RP_OK && s->hist_cap > 0) sched_fill_history(s, &in, 0);

    /* 1. a staged policy takes over at the boundary, after a dry run */
    swap_decision decision;
    char swap_reason[RP_ERROR_TEXT];
    RP_CHECK_GOTO(sched_decide_swap(s, &in, st, &decision, swap_reason, sizeof swap_reason, err), st, out);
    policy_set *use = decision == SWAP_DO ? &s->staged : &s->running;
    if (decision == SWAP_REFUSE) sched_textf(rep.swap_error, sizeof rep.swap_error, "%s", swap_reason);

    /* 2. the policy, or the fallback, and what it costs */
    st = propose(s, use, &in, &rep, &plan, err);
    if (st == RP_OK) st = sched_judge(s, &in, plan, &rep, &migration, err);
    rep.ranks_fell_back = rep.fallback ? 1 : 0;

    /* 3. every rank runs the same plan */
    rep.plan_from_rank = 0;
    if (sched_multi_rank(s)) st = sched_agree(s, &in, st, &plan, &rep, &migration, err);
    if (st != RP_OK) goto out;
    rep.plan_hash = rp_plan_hash(plan);

    /* 4. commit: nothing below can fail */
    if (decision == SWAP_DO) {
        sched_set_free(&s->previous);
        s->previous = s->running;
        s->running = s->staged;
        s->failed_steps = 0;
        memset(&s->staged, 0, sizeof s->staged);
        s->staged_at = -1;
        rep.swapped = true;
    } else if (decision == SWAP_REFUSE) {
        sched_set_free(&s->staged);
        s->staged_at = -1;
    }
    snprintf(rep.policy_name, sizeof rep.policy_name, "%s", s->running.name);
    snprintf(rep.policy_version, sizeof rep.policy_version, "%s", s->running.version);
    rep.policy_hash = s->running.hash;
    sched_push_history(s, step, stats);
    sched_migration_commit(&s->migration, s->ctx, &migration);
    rp_plan_free(s->current);
    s->current = plan;
    plan = NULL;
    rp_batch_free(s->prev_batch);
    rp_stats_free(s->spare_stats);
    s->spare_stats = NULL;
    if (s->keep_spare) s->spare_stats = s->prev_stats;
    else rp_stats_free(s->prev_stats);
    s->prev_batch = copy;
    s->prev_stats = stats;
    copy = NULL;
    stats = NULL;
    s->has_step = true;
    s->last_step = step;
    sched_demote_if_failing(s, &rep);
    rep.plan_wall_s = sched_now_s() - t0;
    s->report = rep;
    s->has_report = true;
    *plan_out = s->current;
    *report_out = &s->report;
    st = RP_OK;
out:
    sched_inputs_release(&in);
    sched_migration_discard(s->ctx, &migration);
    rp_plan_free(plan);
    rp_batch_free(copy);
    rp_stats_free(stats);
    rp_cost_free(cost);
    if (st != RP_OK) sched_fail_keep(s, st, err);
    return st;
}

/* Checks common to both step calls; an error here is returned at once, on this rank
 * only: it is a misuse of the call (missing arguments), the same on every rank. */
static rp_status step_begin(rp_sched *s, int64_t step, const rp_batch *batch, const void *input,
                            const char *input_name, const rp_plan **plan_out, const rp_step_report **report_out,
                            rp_error *err)
{
    s->errmsg[0] = '\0';
    /* a step call means the trainer is done with the last step's migration */
    s->migration.open = false;
    rp_error_clear(err);
    if (!batch || !input || !plan_out || !report_out)
        return sched_fail_keep(s, rp_fail(err, RP_EINVAL, "sched: batch, %s and outputs are required", input_name), err);
    if (rp_batch_num_seqs(batch) < 1)
        return sched_fail_keep(s, rp_fail(err, RP_EINVAL, "sched: step %lld: the batch has no sequences", (long long)step),
                         err);
    /* a batch no plan can pack fails here, with its cause, before the scan and the policy
     * (the batch is the whole step's, the same on every rank) */
    if (rp_limits_check_batch(rp_config_limits(s->cfg), batch, err) != RP_OK) {
        char msg[RP_ERROR_TEXT];
        sched_textf(msg, sizeof msg, "%s", err->text);
        return sched_fail_keep(s, rp_fail(err, RP_ERANGE, "sched: step %lld: %s", (long long)step, msg), err);
    }
    /* so does a batch the cost model refuses, before the routing is scanned (it was
     * scanned in full first: 173 s for a batch refused in the end) */
    rp_status st = cost_check_inputs(s->cfg, batch, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        sched_textf(msg, sizeof msg, "%s", err->text);
        return sched_fail_keep(s, rp_fail(err, st, "sched: step %lld: %s", (long long)step, msg), err);
    }
    return RP_OK;
}

rp_status rp_sched_step(rp_sched *s, int64_t step, const rp_batch *batch, const rp_routing *routing,
                        const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, routing, "routing", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = sched_now_s();
    const rp_model *md = rp_config_model(s->cfg);
    rp_stats *stats = NULL;
    st = rp_stats_compute(s->ctx, batch, routing, md->num_experts, s->opts.num_threads, &stats, err);
    s->keep_spare = false;
    return run_step(s, step, batch, stats, st, t0, plan_out, report_out, err);
}

/* Statistics that describe the batch and the config's model (both statistics calls;
 * an error goes through run_step, so every rank fails the step together). */
static rp_status check_step_stats(const rp_sched *s, int64_t step, const rp_batch *batch, const rp_stats *stats,
                                  rp_error *err)
{
    const rp_model *md = rp_config_model(s->cfg);
    if (rp_stats_num_layers(stats) != md->num_layers || rp_stats_num_experts(stats) != md->num_experts ||
        rp_stats_top_k(stats) != md->top_k)
        return rp_fail(err, RP_EINVAL,
                       "sched: step %lld: the statistics have %d layers, %d experts, top-%d; the config's model has "
                       "%d, %d, top-%d",
                       (long long)step, rp_stats_num_layers(stats), rp_stats_num_experts(stats),
                       rp_stats_top_k(stats), md->num_layers, md->num_experts, md->top_k);
    return rp_stats_check_batch(stats, batch, err);
}

rp_status rp_sched_step_stats(rp_sched *s, int64_t step, const rp_batch *batch, const rp_stats *stats,
                              const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, stats, "statistics", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = sched_now_s();
    rp_stats *copy = NULL;
    st = check_step_stats(s, step, batch, stats, err);
    s->keep_spare = true;
    if (st == RP_OK) st = stats_copy_reusing(s->ctx, stats, &s->spare_stats, &copy, err);
    return run_step(s, step, batch, copy, st, t0, plan_out, report_out, err);
}

rp_status rp_sched_step_stats_take(rp_sched *s, int64_t step, const rp_batch *batch, rp_stats **stats,
                                   const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, stats ? *stats : NULL, "statistics", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = sched_now_s();
    s->keep_spare = true;
    st = check_step_stats(s, step, batch, *stats, err);
    if (st != RP_OK) return run_step(s, step, batch, NULL, st, t0, plan_out, report_out, err); /* still the caller's */
    rp_stats *own = *stats;
    st = run_step(s, step, batch, own, RP_OK, t0, plan_out, report_out, err);
    /* taken: kept as the step's statistics, or freed with a failed step */
    *stats = s->spare_stats;
    s->spare_stats = NULL;
    return st;
}

const rp_plan *rp_sched_plan(const rp_sched *s) { return s ? s->current : NULL; }

/* ---- for the checkpoint (core/sched_state.c) --------------------------------------------- */

void sched_fields_of(rp_sched *s, sched_fields *f)
{
    *f = (sched_fields){
        .ctx = s->ctx, .cfg = s->cfg, .opts = &s->opts, .limits = &s->limits,
        .running = &s->running, .staged = &s->staged, .staged_at = &s->staged_at,
        .current = &s->current, .has_step = &s->has_step, .last_step = &s->last_step,
        .failed_steps = &s->failed_steps,
        .prev_batch = &s->prev_batch, .prev_stats = &s->prev_stats, .hist_cap = s->hist_cap,
        .hist_count = &s->hist_count, .hist_head = &s->hist_head, .hist_steps = s->hist_steps,
        .hist_loads = s->hist_loads, .has_report = &s->has_report, .migration = &s->migration,
        .errmsg = s->errmsg,
    };
}

const rp_migration_plan *rp_sched_migration(const rp_sched *s)
{
    return s && s->migration.open ? s->migration.plan : NULL;
}

rp_status rp_sched_migration_failed(rp_sched *s, const rp_migration_result *result, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_status st = sched_migration_rollback(&s->migration, s->current, result, err);
    return st == RP_OK ? RP_OK : sched_fail_keep(s, st, err);
}

rp_status rp_sched_set_migration_options(rp_sched *s, const rp_migration_options *opts, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_status st = sched_migration_set_options(&s->migration, s->ctx, s->cfg, opts, err);
    return st == RP_OK ? RP_OK : sched_fail_keep(s, st, err);
}
