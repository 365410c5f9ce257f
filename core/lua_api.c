/* The `rp` table policies call: its setup and binding to a call, and the functions on
 * plans (baselines, evaluation, validation, migration, local search, the joint planner,
 * rp.decision, rp.log), each bounded in its input sizes and charging its work to the
 * sandbox. The C primitives (sorting, partitioning, replicas, placement) are
 * core/lua_prims.c; the argument helpers core/lua_host.c. */
#include "cost_internal.h"
#include "limits_internal.h"
#include "lua_api.h"
#include "plan_internal.h"
#include "utf8_internal.h"

#include "routepack/baseline.h"
#include "routepack/joint.h"
#include "routepack/primitives.h"
#include "routepack/sched.h"

#include <lauxlib.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* The most evaluations an API call accepts from a policy (the other bounds,
 * RP_LUA_MAX_PARTS and RP_LUA_MAX_ROUNDS: lua_api.h). */
#define MAX_EVALUATIONS INT64_C(100000000)

/* ---- the host ---------------------------------------------------------------------- */

void rp_lua_host_bind(rp_lua_host *host, const rp_lua_frame *frame)
{
    if (!frame && host->log_dropped > 0)
        rp_log(host->ctx, RP_LOG_WARN,
               "policy '%s': %lld log records dropped in this call (a call may log %d records or %lld bytes)",
               host->policy_name, (long long)host->log_dropped, RP_LUA_LOG_RECORDS, (long long)RP_LUA_LOG_BYTES);
    host->log_records = host->log_bytes = host->log_dropped = 0;
    if (frame) memset(&host->decision, 0, sizeof host->decision);
    if (frame) host->fallback_checks = host->fallback_changes = 0;
    host->frame = frame;
    host->generation++;
}

/* ---- errors and argument helpers --------------------------------------------------- */

/* Before work that allocates plans: free the plans the policy dropped, since the Lua
 * collector does not see their C memory. */
static void reclaim(lua_State *L, rp_lua_host *h)
{
    h->plan_refused = false;
    if (h->plan_live > h->plan_cap / 2) lua_gc(L, LUA_GCCOLLECT, 0);
}

/* ---- plans -------------------------------------------------------------------------- */

static const rp_lua_frame *need_step(lua_State *L, rp_lua_host *h, const char *fname)
{
    const rp_lua_frame *f = h->frame;
    if (!f || !f->batch)
        rp_lua_error(L, "%s needs this step's batch (it is not available in init)", fname);
    return f;
}

static int l_plan(lua_State *L)
{
    lua_settop(L, 1); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.plan");
    rp_lua_host *h = rp_lua_host_of(L);
    reclaim(L, h);
    const rp_lua_frame *f = h->frame;
    int32_t n = f && f->batch ? rp_batch_num_seqs(f->batch) : -1;
    int32_t base_mb = rp_config_limits(h->cfg)->num_microbatches;
    if (base_mb < 1) base_mb = 1;
    /* the conversion parks its plan in the new userdata, which frees it on any error */
    rp_lua_plan_out *out = rp_lua_push_plan(L);
    int holder = lua_gettop(L);
    rp_lua_to_plan(L, 1, h, &h->plan_ctx, "plan", n, base_mb, out);
    lua_pushvalue(L, holder);
    return 1;
}

static void set_num(lua_State *L, const char *key, double v)
{
    lua_pushnumber(L, v);
    lua_setfield(L, -2, key);
}

static void push_summary(lua_State *L, const rp_cost_summary *s)
{
    lua_createtable(L, 0, 16);
    set_num(L, "step_s", s->step_s);
    set_num(L, "lower_bound_s", s->lower_bound_s);
    set_num(L, "ratio", s->ratio);
    set_num(L, "attention_s", s->attention_s);
    set_num(L, "dispatch_s", s->dispatch_s);
    set_num(L, "expert_s", s->expert_s);
    set_num(L, "combine_s", s->combine_s);
    set_num(L, "grad_reduce_s", s->grad_reduce_s);
    set_num(L, "extra_copy_s", s->extra_copy_s);
    set_num(L, "attention_imbalance", s->attention_imbalance);
    set_num(L, "expert_imbalance", s->expert_imbalance);
    set_num(L, "straggler_gpu", s->straggler_gpu);
    set_num(L, "straggler_mb", s->straggler_mb);
    set_num(L, "straggler_layer", s->straggler_layer);
    lua_pushstring(L, cost_side_name(s->straggler_side));
    lua_setfield(L, -2, "straggler_side");
}

/* A full evaluation of `p` on the step's evaluator, paid for before it runs: its work is
 * charged, and its memory (allocated by the evaluator, in the engine's context) must
 * fit what the policy has left of its cap on C-side memory, together with the state
 * the evaluator already holds, or the call fails naming the size. Returns the work. */
/* Raise unless `bytes` more for the evaluator of `cost` (on top of what it holds) fit
 * what is left of the C-side budget. `what` names the plan ("this plan (...)"). */
static void check_evaluator_memory(lua_State *L, rp_lua_host *h, const rp_cost *cost, double bytes, int32_t M,
                                   const char *what, const char *fname)
{
    reclaim(L, h);
    const rp_model *md = rp_config_model(h->cfg);
    size_t held = rp_cost_bytes(cost), left = h->plan_live < h->plan_cap ? h->plan_cap - h->plan_live : 0;
    if (bytes > (double)left || (double)held > (double)left - bytes) {
        char cap[64];
        rp_lua_format_mib(h->plan_cap, cap, sizeof cap);
        rp_lua_error(L,
                     "%s: evaluating %s (%d microbatches x %d layers x %d GPUs x %d experts) needs %.1f MiB, "
                     "and the evaluator holds %.1f MiB; %.1f MiB are left of the policy's memory limit of %s (plans "
                     "and scratch of C calls)",
                     fname, what, M, md->num_layers, rp_config_topology(h->cfg)->num_gpus, md->num_experts,
                     bytes / (1 << 20), (double)held / (1 << 20), (double)left / (1 << 20), cap);
    }
}

static int64_t pay_evaluation(lua_State *L, rp_lua_host *h, rp_cost *cost, const rp_plan *p, const char *fname)
{
    int64_t units = 0;
    size_t bytes = 0;
    rp_error err;
    rp_status st = rp_cost_evaluation_needs(cost, p, &units, &bytes, &err);
    if (st != RP_OK) rp_lua_fail(L, h, fname, st, &err);
    check_evaluator_memory(L, h, cost, (double)bytes, rp_plan_num_microbatches(p), "this plan", fname);
    rp_lua_charge(L, units);
    return units;
}

/* After C work on `cost` that began when it had counted `before` operations and of which
 * `precharged` units were paid up front: charge what was counted beyond that (raises the
 * limit error when it passes the budget, so a call that ran over fails even though its
 * work is done). */
static void charge_counted(lua_State *L, const rp_cost *cost, int64_t before, int64_t precharged)
{
    int64_t counted = rp_cost_operations(cost) - before;
    if (counted > precharged) rp_lua_charge(L, counted - precharged);
}

/* The operations budget to give C work that counts as it goes: what the call has left,
 * plus what was paid up front for it. */
static int64_t operations_budget(lua_State *L, int64_t precharged)
{
    int64_t left = rp_sandbox_work_left(L);
    return left > INT64_MAX - precharged - 1 ? INT64_MAX : left + precharged + 1;
}

static void check_complete(lua_State *L, const rp_plan *p, const char *fname)
{
    if (!rp_plan_has_packing(p) || !rp_plan_has_placement(p))
        rp_lua_error(L, "%s: the plan has no %s (take the rest from ctx.plan)", fname,
                     rp_plan_has_packing(p) ? "placement" : "packing");
}

static int l_evaluate(lua_State *L)
{
    lua_settop(L, 1); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.evaluate");
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.evaluate");
    rp_plan *p = rp_lua_check_plan(L, 1, "rp.evaluate");
    check_complete(L, p, "rp.evaluate");
    if (rp_plan_num_seqs(p) != rp_batch_num_seqs(f->batch))
        rp_lua_error(L, "rp.evaluate: the plan packs %d sequences, but the batch has %d", rp_plan_num_seqs(p),
                     rp_batch_num_seqs(f->batch));
    int64_t before = rp_cost_operations(f->cost);
    int64_t paid = pay_evaluation(L, h, f->cost, p, "rp.evaluate");
    rp_cost_summary s;
    rp_error err;
    rp_status st = rp_cost_evaluate(f->cost, p, &s, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.evaluate", st, &err);
    charge_counted(L, f->cost, before, paid);
    push_summary(L, &s);
    return 1;
}

typedef struct first_problem {
    char text[RP_ERROR_TEXT];
    int32_t count;
} first_problem;

static void note_problem(void *ud, const char *message)
{
    first_problem *fp = ud;
    if (fp->count++ == 0) snprintf(fp->text, sizeof fp->text, "%s", message);
}

static int l_validate(lua_State *L)
{
    lua_settop(L, 1); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.validate");
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = h->frame;
    rp_plan *p = rp_lua_check_plan(L, 1, "rp.validate");
    const rp_batch *batch = f ? f->batch : NULL;
    rp_lua_charge(L, (int64_t)rp_plan_num_seqs(p) * 4 +
                         (int64_t)rp_plan_num_layers(p) * (rp_plan_total_slots(p) + rp_plan_num_experts(p)) +
                         (int64_t)rp_plan_num_gpus(p) * rp_plan_num_microbatches(p));
    first_problem fp;
    fp.text[0] = '\0';
    fp.count = 0;
    fp.count = rp_plan_check(p, h->cfg, batch, note_problem, &fp); /* every one, also those not listed */
    if (fp.count == 0) {
        lua_pushboolean(L, 1);
        return 1;
    }
    lua_pushboolean(L, 0);
    lua_pushstring(L, fp.text);
    lua_pushinteger(L, fp.count);
    return 3;
}

static int l_migration(lua_State *L)
{
    lua_settop(L, 1); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.migration");
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.migration");
    rp_plan *p = rp_lua_check_plan(L, 1, "rp.migration");
    if (!rp_plan_has_placement(p)) rp_lua_error(L, "rp.migration: the plan has no placement");
    if (!f->placement) {
        lua_pushnumber(L, 0);
        lua_pushnumber(L, 0);
        lua_pushinteger(L, 0);
        return 3;
    }
    int32_t E = rp_plan_num_experts(p);
    rp_lua_charge(L, (int64_t)rp_plan_num_layers(p) * (rp_plan_total_slots(p) * 4 + (int64_t)E * rp_plan_ep_size(p)));
    double seconds = 0, bytes = 0;
    rp_error err;
    rp_status st = rp_cost_migration(f->cost, f->placement, p, &seconds, &bytes, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.migration", st, &err);
    uint8_t *held = lua_newuserdata(L, (size_t)E + 1);
    int32_t moved = plan_experts_moved_into(f->placement, p, held, E);
    lua_pushnumber(L, seconds);
    lua_pushnumber(L, bytes);
    lua_pushinteger(L, moved);
    return 3;
}

static int l_baseline(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.baseline");
    static const char *const known[] = {"num_microbatches", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.baseline");
    const char *name = luaL_checkstring(L, 1);
    rp_lua_check_opts(L, 2, "rp.baseline", known);
    int32_t M = 0;
    if (rp_lua_opt(L, 2, "num_microbatches") != LUA_TNIL)
        M = (int32_t)rp_lua_check_int(L, -1, "rp.baseline: opts.num_microbatches", 0, RP_LUA_MAX_PARTS);
    lua_pop(L, 1);
    reclaim(L, h);
    const rp_model *md = rp_config_model(h->cfg);
    int64_t n = rp_batch_num_seqs(f->batch), G = rp_config_topology(h->cfg)->num_gpus;
    rp_lua_charge(L, 4 * rp_lua_sort_units(n) + n * G +
                         (int64_t)md->num_layers * (md->num_experts * (rp_lua_log2_ceil(md->num_experts) + 1) +
                                                    h->slot_begin[rp_config_topology(h->cfg)->ep_size] * 16));
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_error err;
    rp_status st = rp_baseline_plan(&h->plan_ctx, h->cfg, f->batch, f->stats, f->placement, name, M,
                                    &holder->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.baseline", st, &err);
    holder->has_packing = holder->has_placement = true;
    return 1;
}

/* rp.kk_packing(name, opts): the packing of the token_kk, verl_kk, attn_kk, slime_ff or
 * slime_kk baseline (rp_baseline_packing), a plan with no placement. The shipped packing
 * policies are this call. */
static int l_kk_packing(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.kk_packing");
    static const char *const known[] = {"num_microbatches", "equal_size", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.kk_packing");
    const char *name = luaL_checkstring(L, 1);
    rp_lua_check_opts(L, 2, "rp.kk_packing", known);
    int32_t M = 0;
    if (rp_lua_opt(L, 2, "num_microbatches") != LUA_TNIL)
        M = (int32_t)rp_lua_check_int(L, -1, "rp.kk_packing: opts.num_microbatches", 0, RP_LUA_MAX_PARTS);
    lua_pop(L, 1);
    bool equal_size = true;
    if (rp_lua_opt(L, 2, "equal_size") != LUA_TNIL) {
        if (!lua_isboolean(L, -1))
            return rp_lua_error(L, "rp.kk_packing: opts.equal_size must be a boolean, got %s", luaL_typename(L, -1));
        equal_size = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    reclaim(L, h);
    int64_t n = rp_batch_num_seqs(f->batch), G = rp_config_topology(h->cfg)->num_gpus;
    rp_lua_charge(L, 4 * rp_lua_sort_units(n) + n * G);
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_error err;
    rp_status st = rp_baseline_packing(&h->plan_ctx, h->cfg, f->batch, f->stats, name, M, equal_size,
                                       &holder->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.kk_packing", st, &err);
    holder->has_packing = true;
    return 1;
}

static int l_local_search(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.locarp.search");
    static const char *const known[] = {"evaluations", "sample", "seed", "moves", "swaps", "slots", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.local_search");
    rp_plan *p = rp_lua_check_plan(L, 1, "rp.local_search");
    check_complete(L, p, "rp.local_search");
    rp_lua_check_opts(L, 2, "rp.local_search", known);
    rp_search_params sp = rp_search_defaults();
    sp.seed = f->seed;
    if (rp_lua_opt(L, 2, "evaluations") != LUA_TNIL)
        sp.max_evaluations = rp_lua_check_int(L, -1, "rp.local_search: opts.evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 2, "sample") != LUA_TNIL)
        sp.sample = (int32_t)rp_lua_check_int(L, -1, "rp.local_search: opts.sample", 1, 4096);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 2, "seed") != LUA_TNIL)
        sp.seed = (uint64_t)rp_lua_check_int(L, -1, "rp.local_search: opts.seed", 0, INT64_C(1) << 53);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 2, "moves") != LUA_TNIL) sp.moves = rp_lua_check_bool(L, -1, "rp.local_search: opts.moves");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 2, "swaps") != LUA_TNIL) sp.swaps = rp_lua_check_bool(L, -1, "rp.local_search: opts.swaps");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 2, "slots") != LUA_TNIL) sp.slots = rp_lua_check_bool(L, -1, "rp.local_search: opts.slots");
    lua_pop(L, 1);
    if (rp_plan_num_seqs(p) != rp_batch_num_seqs(f->batch))
        rp_lua_error(L, "rp.local_search: the plan packs %d sequences, but the batch has %d", rp_plan_num_seqs(p),
                     rp_batch_num_seqs(f->batch));
    /* the search needs a valid start (it keeps validity, it does not create it) */
    first_problem fp;
    fp.text[0] = '\0';
    fp.count = 0;
    rp_plan_check(p, h->cfg, f->batch, note_problem, &fp);
    if (fp.count) rp_lua_error(L, "rp.local_search: the plan is not valid: %s", fp.text);
    /* The search's work is measured, not estimated: its first evaluation is paid up front
     * (with its memory); every operation the evaluator counts after that is charged when
     * the search returns, and the search stops once it has counted what the call has left
     * (the charge then trips the limit: a search that ran over fails the call). */
    int64_t before = rp_cost_operations(f->cost);
    int64_t paid = pay_evaluation(L, h, f->cost, p, "rp.local_search");
    sp.max_operations = operations_budget(L, paid);
    reclaim(L, h);
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_error err;
    rp_status st = rp_lua_plan_compose(&h->plan_ctx, h->cfg, p, p, p, rp_plan_num_microbatches(p),
                                       &holder->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.local_search", st, &err);
    holder->has_packing = holder->has_placement = true;
    rp_search_result r;
    st = rp_search_local(f->cost, holder->plan, &sp, &r, &err);
    charge_counted(L, f->cost, before, paid);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.local_search", st, &err);
    lua_createtable(L, 0, 8);
    set_num(L, "initial_s", r.initial_s);
    set_num(L, "final_s", r.final_s);
    set_num(L, "evaluations", (double)r.evaluations);
    set_num(L, "iterations", (double)r.iterations);
    set_num(L, "moves", (double)r.moves);
    set_num(L, "swaps", (double)r.swaps);
    set_num(L, "slots", (double)r.slots);
    set_num(L, "operations", (double)r.operations);
    return 2;
}

/* rp.decision(tbl): the policy's account of this step's migration decision, into the
 * step report (rp_step_report's persistence fields; docs/policies.md). Keys:
 * persistence (in [0, 1]), observations (>= 0), predicted_saving_s, realised_saving_s
 * (optional: absent when no earlier change was scored). The last call of a step wins. */
static int l_decision(lua_State *L)
{
    static const char *const known[] = {"persistence", "observations", "predicted_saving_s", "realised_saving_s",
                                        NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    need_step(L, h, "rp.decision");
    luaL_checktype(L, 1, LUA_TTABLE);
    rp_lua_check_opts(L, 1, "rp.decision", known);
    rp_lua_charge(L, 16);
    rp_lua_decision d;
    memset(&d, 0, sizeof d);
    d.set = true;
    d.persistence = -1;
    if (rp_lua_opt(L, 1, "persistence") != LUA_TNIL) {
        d.persistence = rp_lua_check_num(L, -1, "rp.decision: persistence");
        if (!(d.persistence >= 0 && d.persistence <= 1))
            rp_lua_error(L, "rp.decision: persistence must be within [0, 1], got %g", d.persistence);
    }
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "observations") != LUA_TNIL)
        d.observations = (int32_t)rp_lua_check_int(L, -1, "rp.decision: observations", 0, INT32_MAX);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "predicted_saving_s") != LUA_TNIL)
        d.predicted_saving_s = rp_lua_check_num(L, -1, "rp.decision: predicted_saving_s");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "realised_saving_s") != LUA_TNIL) {
        d.realised_saving_s = rp_lua_check_num(L, -1, "rp.decision: realised_saving_s");
        d.realised_scored = true;
    }
    lua_pop(L, 1);
    if (!isfinite(d.predicted_saving_s) || !isfinite(d.realised_saving_s))
        rp_lua_error(L, "rp.decision: savings must be finite numbers");
    h->decision = d;
    return 0;
}

/* rp.joint(opts): the joint planner (rp_joint_plan, docs/routepack-policy.md) on this
 * step's batch, statistics and cost model, migration-aware against the placement in use.
 * Returns the plan and a report table. */
static int l_joint(lua_State *L)
{
    lua_settop(L, 1); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.joint");
    static const char *const known[] = {"num_microbatches", "pack", "place", "prompt_spread", "balance_evaluations",
                                        "place_rounds", "shares", "max_extra_per_rank", "horizon",
                                        "refine_evaluations", "fallbacks", "expected_loads", "persistence",
                                        "virtual_experts", "relabel", "recurring_migration_s",
                                        "fallback_above_ratio", "balancer_first", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = need_step(L, h, "rp.joint");
    rp_lua_check_opts(L, 1, "rp.joint", known);
    rp_joint_params par = rp_joint_defaults();
    par.seed = f->seed;
    if (rp_lua_opt(L, 1, "num_microbatches") != LUA_TNIL)
        par.num_microbatches = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.num_microbatches", 0, RP_LUA_MAX_PARTS);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "pack") != LUA_TNIL) par.pack = rp_lua_check_bool(L, -1, "rp.joint: opts.pack");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "place") != LUA_TNIL) par.place = rp_lua_check_bool(L, -1, "rp.joint: opts.place");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "prompt_spread") != LUA_TNIL) par.prompt_spread = rp_lua_check_num(L, -1, "rp.joint: opts.prompt_spread");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "balance_evaluations") != LUA_TNIL)
        par.balance_evaluations =
            rp_lua_check_int(L, -1, "rp.joint: opts.balance_evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "place_rounds") != LUA_TNIL)
        par.place_rounds = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.place_rounds", 0, RP_LUA_MAX_ROUNDS);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "shares") != LUA_TNIL) par.shares = rp_lua_check_bool(L, -1, "rp.joint: opts.shares");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "max_extra_per_rank") != LUA_TNIL)
        par.max_extra_per_rank = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.max_extra_per_rank", 0, 64);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "horizon") != LUA_TNIL) par.horizon_steps = rp_lua_check_num(L, -1, "rp.joint: opts.horizon");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "persistence") != LUA_TNIL) par.persistence = rp_lua_check_num(L, -1, "rp.joint: opts.persistence");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "refine_evaluations") != LUA_TNIL)
        par.refine_evaluations = rp_lua_check_int(L, -1, "rp.joint: opts.refine_evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "virtual_experts") != LUA_TNIL)
        par.virtual_experts = rp_lua_check_bool(L, -1, "rp.joint: opts.virtual_experts");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "relabel") != LUA_TNIL) par.relabel = rp_lua_check_bool(L, -1, "rp.joint: opts.relabel");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "recurring_migration_s") != LUA_TNIL)
        par.recurring_migration_s = rp_lua_check_num(L, -1, "rp.joint: opts.recurring_migration_s");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "fallback_above_ratio") != LUA_TNIL)
        par.fallback_above_ratio = rp_lua_check_num(L, -1, "rp.joint: opts.fallback_above_ratio");
    lua_pop(L, 1);
    if (rp_lua_opt(L, 1, "balancer_first") != LUA_TNIL) par.balancer_first = rp_lua_check_bool(L, -1, "rp.joint: opts.balancer_first");
    lua_pop(L, 1);
    /* fallbacks: a list of baseline names (the strings stay alive in opts meanwhile) */
    int32_t num_fallbacks = 4; /* rp_joint_defaults' list */
    if (rp_lua_opt(L, 1, "fallbacks") != LUA_TNIL) {
        if (lua_type(L, -1) != LUA_TTABLE)
            rp_lua_error(L, "rp.joint: opts.fallbacks must be a list of baseline names, got %s", luaL_typename(L, -1));
        size_t n = lua_objlen(L, -1);
        if (n > 64) rp_lua_error(L, "rp.joint: opts.fallbacks has %zu names, more than the 64 allowed", n);
        const char **names = lua_newuserdata(L, (n + 1) * sizeof *names);
        for (size_t i = 0; i < n; i++) {
            lua_rawgeti(L, -2, (int)i + 1);
            if (lua_type(L, -1) != LUA_TSTRING)
                rp_lua_error(L, "rp.joint: opts.fallbacks[%zu] must be a baseline name, got %s", i + 1,
                             luaL_typename(L, -1));
            names[i] = lua_tostring(L, -1);
            lua_pop(L, 1);
        }
        names[n] = NULL;
        par.fallbacks = names;
        num_fallbacks = (int32_t)n;
    } else {
        lua_pushnil(L); /* keep the stack shape */
    }
    const rp_model *md = rp_config_model(h->cfg);
    if (rp_lua_opt(L, 1, "expected_loads") != LUA_TNIL) {
        int32_t want = md->num_layers * md->num_experts, got;
        par.expected_loads = rp_lua_read_vector(L, -1, "rp.joint: opts.expected_loads", &got, want);
        if (got != want)
            rp_lua_error(L, "rp.joint: opts.expected_loads has %d entries, must have num_layers x num_experts = %d",
                         got, want);
    } else {
        lua_pushnil(L); /* keep the stack shape */
    }
    /* work: the construction reads every histogram about once; the fallback check builds
     * and evaluates each baseline and the joint candidate; refinement as rp.local_search */
    const rp_topology *t = rp_config_topology(h->cfg);
    int64_t n = rp_batch_num_seqs(f->batch), M = rp_limits_expected_microbatches(h->cfg, f->batch);
    int64_t eval = cost_evaluation_units(h->cfg, f->batch);
    int64_t placement = (int64_t)md->num_layers * (par.place_rounds + 2) * M * md->num_experts *
                        (t->num_gpus / t->ep_size);
    /* the evaluations are paid up front at their estimate and the refinement not at all:
     * both are measured by the evaluator, and what it counts beyond the estimate is
     * charged after the call (the refinement stops once it has counted what the call has
     * left, and the charge then trips the limit) */
    int64_t evaluations = eval + (num_fallbacks > 0 || par.refine_evaluations > 0 || par.virtual_experts ? eval : 0) +
                          (int64_t)(num_fallbacks + par.virtual_experts) * eval +
                          (par.pack ? (int64_t)rp_joint_packing_evaluations(h->cfg) * eval : 0);
    /* the evaluator's memory for the planner's plans: ctx.plan's, scaled to the
     * microbatches the planner uses (the fewest the caps and the trainer allow, one step
     * of K x microbatch_multiple more when it retries), checked before it runs */
    rp_error berr;
    rp_error_clear(&berr);
    const rp_plan *base = f->base(f->base_ud, &berr);
    if (!base) rp_lua_error(L, "rp.joint: %s", berr.text);
    size_t base_bytes = 0;
    if (rp_cost_evaluation_needs(f->cost, base, NULL, &base_bytes, &berr) != RP_OK) rp_lua_error(L, "rp.joint: %s", berr.text);
    int64_t base_mb = rp_plan_num_microbatches(base);
    int64_t joint_mb = par.num_microbatches > 0 ? par.num_microbatches : M + rp_limits_microbatch_step(h->cfg);
    if (joint_mb < base_mb) joint_mb = base_mb;
    check_evaluator_memory(L, h, f->cost, (double)base_bytes / (double)base_mb * (double)joint_mb, (int32_t)joint_mb,
                           "the planner's plans", "rp.joint");
    int64_t before = rp_cost_operations(f->cost);
    rp_lua_charge(L, evaluations + placement + (int64_t)num_fallbacks * 4 * rp_lua_sort_units(n) +
                         par.balance_evaluations * md->num_layers * 8);
    par.refine_max_operations = operations_budget(L, evaluations);
    reclaim(L, h);
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_joint_report rep;
    rp_error err;
    rp_status st = rp_joint_plan(&h->plan_ctx, h->cfg, f->batch, f->stats, f->placement, f->cost, &par,
                                 &holder->plan, &rep, &err);
    charge_counted(L, f->cost, before, evaluations);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.joint", st, &err);
    holder->has_packing = holder->has_placement = true;
    if (rep.fallbacks_checked) {
        h->fallback_checks++;
        if (strcmp(rep.chosen, "joint") != 0) h->fallback_changes++;
    }
    lua_createtable(L, 0, 16);
    lua_pushstring(L, rep.chosen);
    lua_setfield(L, -2, "chosen");
    set_num(L, "step_s", rep.step_s);
    set_num(L, "ratio", rep.ratio);
    set_num(L, "joint_step_s", rep.joint_step_s);
    set_num(L, "joint_ratio", rep.joint_ratio);
    set_num(L, "best_fallback_step_s", rep.best_fallback_step_s);
    set_num(L, "migration_s", rep.migration_s);
    set_num(L, "migration_bytes", rep.migration_bytes);
    set_num(L, "num_microbatches", rep.num_microbatches);
    set_num(L, "layers_replaced", rep.layers_replaced);
    set_num(L, "refine_operations", (double)rep.refine_operations);
    lua_pushboolean(L, rep.per_forward_balancing);
    lua_setfield(L, -2, "per_forward_balancing");
    set_num(L, "virtual_experts_step_s", rep.virtual_experts_step_s);
    lua_pushboolean(L, rep.fallbacks_checked);
    lua_setfield(L, -2, "fallbacks_checked");
    lua_pushboolean(L, rep.joint_built);
    lua_setfield(L, -2, "joint_built");
    return 2;
}

/* ---- diagnostics -------------------------------------------------------------------- */

/* Append `len` bytes of `s` to msg[*used], control characters escaped (\n, \t, \r,
 * \\, \xHH): a policy's text can never start a log line of its own. Returns false
 * when msg is full. */
static bool append_escaped(char *msg, size_t cap, size_t *used, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[4];
        size_t n = 0;
        if (c >= 0x80) { /* a well-formed UTF-8 character passes whole; any other byte is escaped */
            size_t seq = utf8_sequence((const unsigned char *)s + i, len - i);
            if (seq) {
                if (*used + seq >= cap) return false;
                memcpy(msg + *used, s + i, seq);
                *used += seq;
                i += seq - 1;
                continue;
            }
            esc[n++] = '\\', esc[n++] = 'x', esc[n++] = hex[c >> 4], esc[n++] = hex[c & 15];
        } else if (c == '\n') esc[n++] = '\\', esc[n++] = 'n';
        else if (c == '\t') esc[n++] = '\\', esc[n++] = 't';
        else if (c == '\r') esc[n++] = '\\', esc[n++] = 'r';
        else if (c == '\\') esc[n++] = '\\', esc[n++] = '\\';
        else if (c < 0x20 || c == 0x7f) esc[n++] = '\\', esc[n++] = 'x', esc[n++] = hex[c >> 4], esc[n++] = hex[c & 15];
        else esc[n++] = (char)c;
        if (*used + n >= cap) return false;
        memcpy(msg + *used, esc, n);
        *used += n;
    }
    return true;
}

/* rp.log(...): strings and numbers joined by spaces, to the context's log at INFO, with
 * control characters and bytes that are not well-formed UTF-8 escaped (\xNN), so the
 * embedder's log sink always receives valid UTF-8; at most RP_LUA_LOG_RECORDS records
 * and RP_LUA_LOG_BYTES bytes a call, the rest counted and reported once when the call
 * ends. */
static int l_log(lua_State *L)
{
    rp_lua_host *h = rp_lua_host_of(L);
    char msg[900]; /* rp_log's 1024 bytes hold it after "policy '<name>': " */
    static const char cut[] = " [cut]";
    size_t used = 0, room = sizeof msg - sizeof cut;
    bool full = false;
    int n = lua_gettop(L);
    for (int i = 1; i <= n; i++) {
        int t = lua_type(L, i);
        if (t != LUA_TSTRING && t != LUA_TNUMBER && t != LUA_TBOOLEAN && t != LUA_TNIL)
            rp_lua_error(L, "rp.log: argument %d is a %s; pass strings, numbers, booleans or nil", i,
                         lua_typename(L, t));
        size_t len = 0;
        const char *s;
        if (t == LUA_TBOOLEAN) s = lua_toboolean(L, i) ? "true" : "false", len = strlen(s);
        else if (t == LUA_TNIL) s = "nil", len = 3;
        else s = lua_tolstring(L, i, &len); /* numbers convert on the stack copy below */
        rp_lua_charge(L, (int64_t)len);
        if (!full && i > 1) full = !append_escaped(msg, room, &used, " ", 1);
        if (!full) full = !append_escaped(msg, room, &used, s, len);
    }
    if (full) {
        memcpy(msg + used, cut, sizeof cut - 1);
        used += sizeof cut - 1;
    }
    msg[used] = '\0';
    if (h->log_records >= RP_LUA_LOG_RECORDS || h->log_bytes + (int64_t)used > RP_LUA_LOG_BYTES) {
        h->log_dropped++;
        return 0;
    }
    h->log_records++;
    h->log_bytes += (int64_t)used;
    rp_log(h->ctx, RP_LOG_INFO, "policy '%s': %s", h->policy_name, msg);
    return 0;
}

/* ---- setup -------------------------------------------------------------------------- */

typedef struct api_job {
    rp_lua_host *host;
    lua_CFunction engine;
} api_job;

static const luaL_Reg api_funcs[] = {
    {"argsort", rp_lua_argsort},
    {"topk", rp_lua_topk},
    {"lpt", rp_lua_lpt},
    {"kk", rp_lua_kk},
    {"partition2", rp_lua_partition2},
    {"replicas", rp_lua_replicas},
    {"place", rp_lua_place},
    {"plan", l_plan},
    {"baseline", l_baseline},
    {"kk_packing", l_kk_packing},
    {"evaluate", l_evaluate},
    {"validate", l_validate},
    {"migration", l_migration},
    {"local_search", l_local_search},
    {"joint", l_joint},
    {"decision", l_decision},
    {"log", l_log},
    {NULL, NULL},
};

/* Every rp.* function runs through this: the primitive (upvalue: its index in
 * api_funcs), then the clock. A primitive charges its work before it runs, but its
 * wall time is known only after: one that ran past the wall-time limit fails the call
 * at once, even when the policy would return right after it. */
static int api_call(lua_State *L)
{
    int results = api_funcs[lua_tointeger(L, lua_upvalueindex(1))].func(L);
    rp_sandbox_check_clock(L);
    return results;
}

static int build_api(lua_State *L)
{
    api_job *job = lua_touserdata(L, 1);
    rp_lua_host *h = job->host;
    lua_pushcfunction(L, job->engine);
    h->engine_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    rp_lua_host_set(L, h);
    rp_lua_register_views(L, h);
    rp_lua_register_plan(L, h);

    rp_sandbox_push_env(h->sb);
    lua_getfield(L, -1, "rp");
    for (int i = 0; api_funcs[i].name; i++) {
        lua_pushinteger(L, i);
        lua_pushcclosure(L, api_call, 1);
        lua_setfield(L, -2, api_funcs[i].name);
    }
    lua_pushinteger(L, RP_POLICY_API);
    lua_setfield(L, -2, "api");
    lua_pushstring(L, RP_VERSION_STRING);
    lua_setfield(L, -2, "version");
    return 0;
}

rp_status rp_lua_host_init(rp_lua_host *host, rp_context *ctx, const rp_config *cfg, rp_sandbox *sb,
                           lua_CFunction engine, rp_error *err)
{
    memset(host, 0, sizeof *host);
    host->ctx = ctx;
    host->cfg = cfg;
    host->sb = sb;
    host->plan_ctx = *ctx;
    host->plan_ctx.alloc = rp_lua_plan_alloc;
    host->plan_ctx.alloc_ud = host;
    host->plan_cap = rp_sandbox_limits_of(sb)->max_memory_bytes;
    snprintf(host->policy_name, sizeof host->policy_name, "?");
    const rp_topology *t = rp_config_topology(cfg);
    host->slot_begin = rp_alloc(ctx, ((size_t)t->ep_size + 1) * sizeof *host->slot_begin);
    if (!host->slot_begin) return rp_fail_nomem(err, "the policy host");
    host->slot_begin[0] = 0;
    for (int32_t j = 0; j < t->ep_size; j++) host->slot_begin[j + 1] = host->slot_begin[j] + t->slots[j];
    lua_State *L = rp_sandbox_state(sb);
    api_job job = {host, engine};
    host->engine_ref = LUA_NOREF;
    int status = lua_cpcall(L, build_api, &job);
    if (status != 0) {
        lua_pop(L, 1);
        rp_free(ctx, host->slot_begin);
        host->slot_begin = NULL;
        return rp_fail(err, status == LUA_ERRMEM ? RP_ENOMEM : RP_EPOLICY, "policy: building the rp API failed");
    }
    return RP_OK;
}

void rp_lua_host_release(rp_lua_host *host)
{
    if (host && host->slot_begin) {
        rp_free(host->ctx, host->slot_begin);
        host->slot_begin = NULL;
    }
}
