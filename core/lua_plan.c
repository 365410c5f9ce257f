/* Plans on the Lua side: the plan userdata (an rp_plan the collector frees, with
 * methods), conversion between the Lua table in the plan JSON shape and rp_plan with
 * errors that name the offending path, and composing a plan from the parts of others. */
#include "lua_api.h"

#include <lauxlib.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#define PLAN_MT "routepack.plan"

/* Caps on what a plan table may hold (far above any real plan). */
#define MAX_LEVERS 65536
#define MAX_MICROBATCHES 1048576

/* ---- composing ----------------------------------------------------------------------- */

rp_status rp_lua_plan_compose(rp_context *into, const rp_config *cfg, const rp_plan *packing,
                              const rp_plan *placement, const rp_plan *levers,
                              int32_t num_microbatches, rp_plan **out, rp_error *err)
{
    if (packing && !rp_plan_has_packing(packing)) packing = NULL;
    if (placement && !rp_plan_has_placement(placement)) placement = NULL;
    if (levers && rp_plan_num_extra_replicas(levers) == 0 && rp_plan_num_share_sets(levers) == 0) levers = NULL;
    int32_t M = packing ? rp_plan_num_microbatches(packing)
                : levers ? rp_plan_num_microbatches(levers)
                         : num_microbatches;
    rp_plan *plan = NULL;
    const int32_t **lists = NULL;
    int32_t *counts = NULL;
    rp_status st = rp_plan_new(into, cfg, M, &plan, err);
    if (st != RP_OK) return st;
    if (packing) {
        int32_t G = rp_plan_num_gpus(packing);
        size_t cells = (size_t)G * (size_t)M;
        lists = rp_alloc(into, (cells + 1) * sizeof *lists);
        counts = rp_alloc(into, (cells + 1) * sizeof *counts);
        if (!lists || !counts) {
            st = rp_fail_nomem(err, "a plan copy");
            goto out;
        }
        for (int32_t g = 0; g < G; g++)
            for (int32_t m = 0; m < M; m++)
                lists[(size_t)g * M + m] = rp_plan_microbatch(packing, g, m, &counts[(size_t)g * M + m]);
        RP_CHECK_GOTO(rp_plan_set_microbatches(plan, rp_plan_num_seqs(packing), (const int32_t *const *)lists,
                                               counts, err),
                      st, out);
        /* the microbatch order belongs to the packing */
        for (int32_t g = 0; g < G && rp_plan_has_microbatch_order(packing); g++)
            RP_CHECK_GOTO(rp_plan_set_microbatch_order(plan, g, rp_plan_microbatch_order(packing, g), err), st, out);
    }
    if (placement) {
        for (int32_t l = 0; l < rp_plan_num_layers(placement); l++)
            RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, rp_plan_phy2log(placement, l), err), st, out);
        /* per-forward balancing is how the placement runs: it travels with it */
        RP_CHECK_GOTO(rp_plan_set_balancing(plan, rp_plan_balancing(placement), err), st, out);
    }
    if (levers) {
        for (int32_t i = 0; i < rp_plan_num_extra_replicas(levers); i++) {
            int32_t mb, layer, expert, ep_rank;
            rp_plan_extra_replica(levers, i, &mb, &layer, &expert, &ep_rank);
            RP_CHECK_GOTO(rp_plan_add_extra_replica(plan, mb, layer, expert, ep_rank, err), st, out);
        }
        for (int32_t i = 0; i < rp_plan_num_share_sets(levers); i++) {
            int32_t mb, layer, expert, count;
            const double *shares = rp_plan_share_set(levers, i, &mb, &layer, &expert, &count);
            RP_CHECK_GOTO(rp_plan_set_shares(plan, mb, layer, expert, shares, count, err), st, out);
        }
    }
out:
    rp_free(into, lists);
    rp_free(into, counts);
    if (st != RP_OK) rp_plan_free(plan);
    else *out = plan;
    return st;
}

/* ---- the plan userdata ------------------------------------------------------------------ */

rp_lua_plan_out *rp_lua_push_plan(lua_State *L)
{
    rp_lua_plan_out *h = lua_newuserdata(L, sizeof *h);
    memset(h, 0, sizeof *h);
    luaL_getmetatable(L, PLAN_MT);
    lua_setmetatable(L, -2);
    return h;
}

const rp_plan *rp_lua_test_plan(lua_State *L, int idx)
{
    rp_lua_plan_out *h = luaL_testudata(L, idx, PLAN_MT);
    return h ? h->plan : NULL;
}

rp_plan *rp_lua_check_plan(lua_State *L, int idx, const char *fname)
{
    rp_lua_plan_out *h = luaL_testudata(L, idx, PLAN_MT);
    if (!h) rp_lua_error(L, "%s: expected a plan (from rp.plan, rp.baseline or ctx.plan), got %s", fname,
                         luaL_typename(L, idx));
    if (!h->plan) rp_lua_error(L, "%s: the plan is empty", fname);
    return h->plan;
}

static int plan_gc(lua_State *L)
{
    rp_lua_plan_out *h = luaL_checkudata(L, 1, PLAN_MT);
    rp_plan_free(h->plan);
    h->plan = NULL;
    return 0;
}

static rp_plan *self(lua_State *L, const char *method)
{
    char fname[64];
    snprintf(fname, sizeof fname, "plan:%s", method);
    return rp_lua_check_plan(L, 1, fname);
}

static void push_int_list(lua_State *L, const int32_t *v, int32_t n)
{
    lua_createtable(L, n, 0);
    for (int32_t i = 0; i < n; i++) {
        lua_pushinteger(L, v[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

void rp_lua_push_packing(lua_State *L, const rp_plan *plan)
{
    if (!rp_plan_has_packing(plan)) {
        lua_pushnil(L);
        return;
    }
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    rp_lua_charge(L, (int64_t)rp_plan_num_seqs(plan) + (int64_t)G * M);
    lua_createtable(L, G, 0);
    for (int32_t g = 0; g < G; g++) {
        lua_createtable(L, M, 0);
        for (int32_t m = 0; m < M; m++) {
            int32_t count;
            const int32_t *ids = rp_plan_microbatch(plan, g, m, &count);
            push_int_list(L, ids, count);
            lua_rawseti(L, -2, m + 1);
        }
        lua_rawseti(L, -2, g + 1);
    }
}

void rp_lua_push_placement(lua_State *L, const rp_plan *plan)
{
    if (!rp_plan_has_placement(plan)) {
        lua_pushnil(L);
        return;
    }
    int32_t Ly = rp_plan_num_layers(plan), ep = rp_plan_ep_size(plan);
    const int32_t *begin = rp_plan_slot_begin(plan);
    rp_lua_charge(L, (int64_t)Ly * (rp_plan_total_slots(plan) + ep));
    lua_createtable(L, Ly, 0);
    for (int32_t l = 0; l < Ly; l++) {
        const int32_t *phy = rp_plan_phy2log(plan, l);
        lua_createtable(L, ep, 0);
        for (int32_t j = 0; j < ep; j++) {
            push_int_list(L, phy + begin[j], begin[j + 1] - begin[j]);
            lua_rawseti(L, -2, j + 1);
        }
        lua_rawseti(L, -2, l + 1);
    }
}

static int m_packing(lua_State *L)
{
    rp_lua_push_packing(L, self(L, "packing"));
    return 1;
}

static int m_placement(lua_State *L)
{
    rp_lua_push_placement(L, self(L, "placement"));
    return 1;
}

static int m_num_microbatches(lua_State *L)
{
    lua_pushinteger(L, rp_plan_num_microbatches(self(L, "num_microbatches")));
    return 1;
}

static int m_num_seqs(lua_State *L)
{
    rp_plan *p = self(L, "num_seqs");
    if (rp_plan_has_packing(p)) lua_pushinteger(L, rp_plan_num_seqs(p));
    else lua_pushnil(L);
    return 1;
}

static int m_has_packing(lua_State *L)
{
    lua_pushboolean(L, rp_plan_has_packing(self(L, "has_packing")));
    return 1;
}

static int m_has_placement(lua_State *L)
{
    lua_pushboolean(L, rp_plan_has_placement(self(L, "has_placement")));
    return 1;
}

static int m_copy(lua_State *L)
{
    rp_plan *p = self(L, "copy");
    rp_lua_host *h = rp_lua_host_of(L);
    rp_lua_charge(L, (int64_t)rp_plan_num_seqs(p) + (int64_t)rp_plan_num_layers(p) * rp_plan_total_slots(p));
    if (h->plan_live > h->plan_cap / 2) lua_gc(L, LUA_GCCOLLECT, 0);
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_error err;
    rp_status st = rp_lua_plan_compose(&h->plan_ctx, h->cfg, p, p, p, rp_plan_num_microbatches(p), &holder->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "plan:copy", st, &err);
    return 1;
}

static int m_move(lua_State *L)
{
    rp_plan *p = self(L, "move");
    if (!rp_plan_has_packing(p)) return rp_lua_error(L, "plan:move: the plan has no packing");
    int32_t n = rp_plan_num_seqs(p), G = rp_plan_num_gpus(p), M = rp_plan_num_microbatches(p);
    int32_t seq = (int32_t)rp_lua_check_int(L, 2, "plan:move: sequence", 0, n - 1);
    int32_t rank = (int32_t)rp_lua_check_int(L, 3, "plan:move: rank", 0, G - 1);
    int32_t mb = (int32_t)rp_lua_check_int(L, 4, "plan:move: microbatch", 0, M - 1);
    /* a move shifts the lists it touches */
    int32_t c1 = 0, c2 = 0;
    int32_t r0 = rp_plan_seq_rank(p, seq), m0 = rp_plan_seq_microbatch(p, seq);
    if (r0 >= 0) rp_plan_microbatch(p, r0, m0, &c1);
    rp_plan_microbatch(p, rank, mb, &c2);
    rp_lua_charge(L, (int64_t)c1 + c2 + 1);
    rp_error err;
    rp_status st = rp_plan_move_sequence(p, seq, rank, mb, &err);
    if (st != RP_OK) return rp_lua_fail(L, rp_lua_host_of(L), "plan:move", st, &err);
    return 0;
}

/* Read a list of ids within [lo, hi] into a userdata buffer pushed on the stack. */
static int32_t *read_id_list(lua_State *L, int idx, const char *what, int32_t max_n, int32_t lo, int32_t hi,
                             int32_t *n_out)
{
    if (lua_type(L, idx) != LUA_TTABLE) rp_lua_error(L, "%s must be a list, got %s", what, luaL_typename(L, idx));
    size_t len = lua_objlen(L, idx);
    if (len > (size_t)max_n) rp_lua_error(L, "%s has %zu entries, at most %d", what, len, max_n);
    int32_t n = (int32_t)len;
    rp_lua_charge(L, n);
    int32_t *v = lua_newuserdata(L, ((size_t)n + 1) * sizeof *v);
    for (int32_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        double d = lua_tonumber(L, -1);
        if (lua_type(L, -1) != LUA_TNUMBER || d != floor(d) || d < lo || d > hi)
            rp_lua_error(L, "%s[%d] must be an integer within %d..%d, got %s", what, i + 1, lo, hi,
                         lua_type(L, -1) == LUA_TNUMBER ? lua_tostring(L, -1) : luaL_typename(L, -1));
        v[i] = (int32_t)d;
        lua_pop(L, 1);
    }
    *n_out = n;
    return v;
}

static int m_set_gpu_experts(lua_State *L)
{
    rp_plan *p = self(L, "set_gpu_experts");
    if (!rp_plan_has_placement(p)) return rp_lua_error(L, "plan:set_gpu_experts: the plan has no placement");
    int32_t Ly = rp_plan_num_layers(p), ep = rp_plan_ep_size(p), E = rp_plan_num_experts(p);
    int32_t layer = (int32_t)rp_lua_check_int(L, 2, "plan:set_gpu_experts: layer", 0, Ly - 1);
    int32_t j = (int32_t)rp_lua_check_int(L, 3, "plan:set_gpu_experts: EP rank", 0, ep - 1);
    const int32_t *begin = rp_plan_slot_begin(p);
    int32_t n;
    int32_t *experts = read_id_list(L, 4, "plan:set_gpu_experts: experts", begin[j + 1] - begin[j], -1, E - 1, &n);
    rp_lua_charge(L, (int64_t)rp_plan_total_slots(p) + E);
    rp_error err;
    rp_status st = rp_plan_set_gpu_experts(p, layer, j, experts, n, &err);
    if (st != RP_OK) return rp_lua_fail(L, rp_lua_host_of(L), "plan:set_gpu_experts", st, &err);
    return 0;
}

static int m_microbatch(lua_State *L)
{
    rp_plan *p = self(L, "microbatch");
    if (!rp_plan_has_packing(p)) return rp_lua_error(L, "plan:microbatch: the plan has no packing");
    int32_t rank = (int32_t)rp_lua_check_int(L, 2, "plan:microbatch: rank", 0, rp_plan_num_gpus(p) - 1);
    int32_t mb = (int32_t)rp_lua_check_int(L, 3, "plan:microbatch: microbatch", 0, rp_plan_num_microbatches(p) - 1);
    int32_t count;
    const int32_t *ids = rp_plan_microbatch(p, rank, mb, &count);
    rp_lua_charge(L, count);
    push_int_list(L, ids, count);
    return 1;
}

static int m_seq_rank(lua_State *L)
{
    rp_plan *p = self(L, "seq_rank");
    if (!rp_plan_has_packing(p)) return rp_lua_error(L, "plan:seq_rank: the plan has no packing");
    int32_t s = (int32_t)rp_lua_check_int(L, 2, "plan:seq_rank: sequence", 0, rp_plan_num_seqs(p) - 1);
    lua_pushinteger(L, rp_plan_seq_rank(p, s));
    lua_pushinteger(L, rp_plan_seq_microbatch(p, s));
    return 2;
}

static int m_phy2log(lua_State *L)
{
    rp_plan *p = self(L, "phy2log");
    if (!rp_plan_has_placement(p)) return rp_lua_error(L, "plan:phy2log: the plan has no placement");
    int32_t layer = (int32_t)rp_lua_check_int(L, 2, "plan:phy2log: layer", 0, rp_plan_num_layers(p) - 1);
    rp_lua_charge(L, rp_plan_total_slots(p));
    push_int_list(L, rp_plan_phy2log(p, layer), rp_plan_total_slots(p));
    return 1;
}

static int m_experts(lua_State *L)
{
    rp_plan *p = self(L, "experts");
    if (!rp_plan_has_placement(p)) return rp_lua_error(L, "plan:experts: the plan has no placement");
    int32_t layer = (int32_t)rp_lua_check_int(L, 2, "plan:experts: layer", 0, rp_plan_num_layers(p) - 1);
    int32_t j = (int32_t)rp_lua_check_int(L, 3, "plan:experts: EP rank", 0, rp_plan_ep_size(p) - 1);
    const int32_t *begin = rp_plan_slot_begin(p), *phy = rp_plan_phy2log(p, layer);
    lua_createtable(L, begin[j + 1] - begin[j], 0);
    int32_t m = 0;
    for (int32_t s = begin[j]; s < begin[j + 1]; s++)
        if (phy[s] >= 0) {
            lua_pushinteger(L, phy[s]);
            lua_rawseti(L, -2, ++m);
        }
    return 1;
}

static int m_logcnt(lua_State *L)
{
    rp_plan *p = self(L, "logcnt");
    if (!rp_plan_has_placement(p)) return rp_lua_error(L, "plan:logcnt: the plan has no placement");
    int32_t layer = (int32_t)rp_lua_check_int(L, 2, "plan:logcnt: layer", 0, rp_plan_num_layers(p) - 1);
    int32_t E = rp_plan_num_experts(p);
    rp_lua_charge(L, (int64_t)E + rp_plan_total_slots(p));
    int32_t *cnt = lua_newuserdata(L, ((size_t)E + 1) * sizeof *cnt);
    rp_plan_logcnt(p, layer, cnt);
    push_int_list(L, cnt, E);
    return 1;
}

static int m_hash(lua_State *L)
{
    rp_plan *p = self(L, "hash");
    rp_lua_charge(L, (int64_t)rp_plan_num_seqs(p) + (int64_t)rp_plan_num_layers(p) * rp_plan_total_slots(p));
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)rp_plan_hash(p));
    lua_pushstring(L, hex);
    return 1;
}

/* p:set(tbl): replace the parts that tbl (a plan table or plan) has; keep the others. */
static int m_set(lua_State *L)
{
    rp_plan *p = self(L, "set");
    rp_lua_host *h = rp_lua_host_of(L);
    luaL_checkany(L, 2);
    int32_t n = rp_plan_has_packing(p) ? rp_plan_num_seqs(p)
                : h->frame && h->frame->batch ? rp_batch_num_seqs(h->frame->batch)
                                              : -1;
    rp_lua_plan_out *part = rp_lua_push_plan(L);
    rp_lua_to_plan(L, 2, h, &h->plan_ctx, "plan", n, rp_plan_num_microbatches(p), part);
    rp_lua_plan_out *merged = rp_lua_push_plan(L);
    const rp_plan *q = part->plan;
    rp_error err;
    rp_status st = rp_lua_plan_compose(&h->plan_ctx, h->cfg, part->has_packing ? q : p,
                                       part->has_placement ? q : p,
                                       part->has_levers || part->has_packing ? q : p,
                                       rp_plan_num_microbatches(p), &merged->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "plan:set", st, &err);
    /* swap the merged plan into self; the old one goes with the temporary userdata */
    rp_lua_plan_out *me = luaL_checkudata(L, 1, PLAN_MT);
    rp_plan *old = me->plan;
    me->plan = merged->plan;
    merged->plan = old;
    return 0;
}

static const luaL_Reg plan_methods[] = {
    {"packing", m_packing},
    {"placement", m_placement},
    {"num_microbatches", m_num_microbatches},
    {"num_seqs", m_num_seqs},
    {"has_packing", m_has_packing},
    {"has_placement", m_has_placement},
    {"copy", m_copy},
    {"move", m_move},
    {"set_gpu_experts", m_set_gpu_experts},
    {"set", m_set},
    {"microbatch", m_microbatch},
    {"seq_rank", m_seq_rank},
    {"phy2log", m_phy2log},
    {"experts", m_experts},
    {"logcnt", m_logcnt},
    {"hash", m_hash},
    {NULL, NULL},
};

static int plan_index(lua_State *L)
{
    luaL_checkudata(L, 1, PLAN_MT);
    if (lua_type(L, 2) != LUA_TSTRING) {
        lua_pushnil(L);
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1)); /* the methods table, never handed out */
    return 1;
}

static int plan_newindex(lua_State *L)
{
    luaL_checkudata(L, 1, PLAN_MT);
    return rp_lua_error(L, "a plan is changed only through its methods (p:move, p:set_gpu_experts, p:set)");
}

static int plan_tostring(lua_State *L)
{
    rp_lua_plan_out *h = luaL_checkudata(L, 1, PLAN_MT);
    if (!h->plan) {
        lua_pushliteral(L, "plan (empty)");
        return 1;
    }
    const rp_plan *p = h->plan;
    char buf[160];
    snprintf(buf, sizeof buf, "plan (%d GPUs x %d microbatches; %s%d sequences; %s)", (int)rp_plan_num_gpus(p),
             (int)rp_plan_num_microbatches(p), rp_plan_has_packing(p) ? "packing of " : "no packing, ",
             rp_plan_has_packing(p) ? (int)rp_plan_num_seqs(p) : 0,
             rp_plan_has_placement(p) ? "placement" : "no placement");
    lua_pushstring(L, buf);
    return 1;
}

static const luaL_Reg plan_meta[] = {
    {"__index", plan_index}, {"__newindex", plan_newindex}, {"__gc", plan_gc}, {"__tostring", plan_tostring},
    {NULL, NULL},
};

void rp_lua_register_plan(lua_State *L, rp_lua_host *host)
{
    (void)host;
    rp_lua_register_metatable(L, PLAN_MT, plan_methods, plan_meta, "routepack plan");
}

/* ---- table -> plan ---------------------------------------------------------------------- */

/* Reject keys outside `known`: the first unknown key (rp_lua_first_unknown_key's order),
 * with a suggestion for a near miss. */
static void check_keys(lua_State *L, int idx, const char *path, const char *const *known)
{
    const int worst = rp_lua_first_unknown_key(L, idx, known);
    if (!worst) return;
    if (lua_type(L, worst) != LUA_TSTRING) {
        if (lua_type(L, worst) == LUA_TNUMBER)
            rp_lua_error(L, "%s: unexpected key %s (%s is an object with named keys)", path, lua_tostring(L, worst), path);
        rp_lua_error(L, "%s: unexpected key of type %s", path, luaL_typename(L, worst));
    }
    const char *k = lua_tostring(L, worst);
    const char *best = NULL;
    size_t bd = 3;
    for (size_t i = 0; known[i]; i++) {
        size_t d = rp_edit_distance(k, known[i]);
        if (d < bd) bd = d, best = known[i];
    }
    if (best) rp_lua_error(L, "%s: unknown key '%s' (did you mean '%s'?)", path, k, best);
    char list[320];
    size_t used = 0;
    list[0] = '\0';
    for (size_t i = 0; known[i] && used < sizeof list; i++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", known[i]);
    rp_lua_error(L, "%s: unknown key '%s' (keys: %s)", path, k, list);
}

/* Push t[key] (raw) and return its type. */
static int get_key(lua_State *L, int t, const char *key)
{
    lua_pushstring(L, key);
    lua_rawget(L, t);
    return lua_type(L, -1);
}

static int64_t want_int(lua_State *L, int idx, const char *path, int64_t lo, int64_t hi)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        rp_lua_error(L, "%s must be an integer, got %s", path, luaL_typename(L, idx));
    double v = lua_tonumber(L, idx);
    if (v != floor(v)) rp_lua_error(L, "%s must be an integer, got %.17g", path, v);
    if (v < (double)lo || v > (double)hi)
        rp_lua_error(L, "%s is %.17g, out of range (%lld..%lld)", path, v, (long long)lo, (long long)hi);
    return (int64_t)v;
}

static void want_table(lua_State *L, int idx, const char *path, const char *what)
{
    if (lua_type(L, idx) != LUA_TTABLE)
        rp_lua_error(L, "%s must be a table (%s), got %s", path, what, luaL_typename(L, idx));
}

static void check_shape(lua_State *L, int t, const char *what, const char *key, int64_t want, const char *words)
{
    char path[96];
    snprintf(path, sizeof path, "%s.%s", what, key);
    if (get_key(L, t, key) != LUA_TNIL) {
        int64_t v = want_int(L, -1, path, INT32_MIN, INT32_MAX);
        if (v != want) rp_lua_error(L, "%s is %lld, but the config has %lld %s", path, (long long)v, (long long)want, words);
    }
    lua_pop(L, 1);
}

typedef struct packing_scratch {
    int32_t M;
    int32_t *counts; /* [G * M] */
    int32_t *ids;    /* [total] */
} packing_scratch;

/* plan.packing -> counts and ids in userdata buffers left on the stack (two slots). */
static void read_packing(lua_State *L, int pk, const char *what, int32_t G, int32_t n, int32_t M_given,
                         int32_t M_max, packing_scratch *out)
{
    char path[128];
    snprintf(path, sizeof path, "%s.packing", what);
    want_table(L, pk, path, "packing[rank][microbatch] = list of sequence ids");
    size_t ranks = lua_objlen(L, pk);
    if (ranks != (size_t)G)
        rp_lua_error(L, "%s has %zu ranks, but the config has %d GPUs (one list per DP rank)", path, ranks, G);
    int32_t M = M_given;
    if (M < 1) {
        lua_rawgeti(L, pk, 1);
        snprintf(path, sizeof path, "%s.packing[1]", what);
        want_table(L, -1, path, "the microbatches of rank 0");
        size_t m = lua_objlen(L, -1);
        lua_pop(L, 1);
        if (m < 1) rp_lua_error(L, "%s has no microbatches; every rank runs at least one (it may be empty)", path);
        if (m > (size_t)M_max) rp_lua_error(L, "%s has %zu microbatches, more than the %d allowed", path, m, M_max);
        M = (int32_t)m;
    }
    size_t cells = (size_t)G * (size_t)M;
    rp_lua_charge(L, (int64_t)cells);
    int32_t *counts = lua_newuserdata(L, (cells + 1) * sizeof *counts);
    int32_t *ids = lua_newuserdata(L, ((size_t)n + 1) * sizeof *ids);
    int64_t total = 0;
    for (int32_t g = 0; g < G; g++) {
        lua_rawgeti(L, pk, g + 1);
        /* the paths are written only for an error: a plan read names no path otherwise */
        size_t m = lua_type(L, -1) == LUA_TTABLE ? lua_objlen(L, -1) : 0;
        if (lua_type(L, -1) != LUA_TTABLE || m != (size_t)M) {
            snprintf(path, sizeof path, "%s.packing[%d]", what, g + 1);
            want_table(L, -1, path, "the microbatches of one rank");
            rp_lua_error(L, "%s has %zu microbatches, but %s %d (every rank runs the same number)", path, m,
                         M_given >= 1 ? "num_microbatches is" : "rank 0 has", M);
        }
        int rank_idx = lua_gettop(L);
        for (int32_t mb = 0; mb < M; mb++) {
            lua_rawgeti(L, rank_idx, mb + 1);
            if (lua_type(L, -1) != LUA_TTABLE) {
                snprintf(path, sizeof path, "%s.packing[%d][%d]", what, g + 1, mb + 1);
                want_table(L, -1, path, "a list of sequence ids");
            }
            size_t len = lua_objlen(L, -1);
            if ((int64_t)len > (int64_t)n - total)
                rp_lua_error(L, "%s.packing lists more than %d sequence ids, but the batch has %d sequences (each "
                                "appears exactly once)",
                             what, n, n);
            rp_lua_charge(L, (int64_t)len + 1);
            for (size_t i = 0; i < len; i++) {
                lua_rawgeti(L, -1, (int)i + 1);
                double v = lua_tonumber(L, -1);
                if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v)) {
                    if (lua_type(L, -1) == LUA_TNUMBER)
                        rp_lua_error(L, "%s.packing[%d][%d][%zu]: sequence id %.17g is not an integer", what, g + 1,
                                     mb + 1, i + 1, v);
                    rp_lua_error(L, "%s.packing[%d][%d][%zu] must be a sequence id, got %s", what, g + 1, mb + 1,
                                 i + 1, luaL_typename(L, -1));
                }
                if (v < 0 || v >= n)
                    rp_lua_error(L, "%s.packing[%d][%d][%zu]: sequence id %.17g out of range (%d sequences)", what,
                                 g + 1, mb + 1, i + 1, v, n);
                ids[total++] = (int32_t)v;
                lua_pop(L, 1);
            }
            counts[(size_t)g * M + mb] = (int32_t)len;
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    out->M = M;
    out->counts = counts;
    out->ids = ids;
}

/* plan.placement -> phy2log[L * S] in a userdata left on the stack. */
static int32_t *read_placement(lua_State *L, int pl, const char *what, const rp_config *cfg,
                               const int32_t *slot_begin)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *md = rp_config_model(cfg);
    int32_t Ly = md->num_layers, ep = t->ep_size, E = md->num_experts, S = slot_begin[ep];
    char path[128];
    snprintf(path, sizeof path, "%s.placement", what);
    want_table(L, pl, path, "placement[layer][ep_rank] = list of experts in slot order");
    size_t layers = lua_objlen(L, pl);
    if (layers != (size_t)Ly)
        rp_lua_error(L, "%s has %zu layers, but the model has %d MoE layers", path, layers, Ly);
    rp_lua_charge(L, (int64_t)Ly * S);
    int32_t *phy = lua_newuserdata(L, ((size_t)Ly * S + 1) * sizeof *phy);
    for (size_t i = 0; i < (size_t)Ly * S; i++) phy[i] = -1;
    for (int32_t l = 0; l < Ly; l++) {
        lua_rawgeti(L, pl, l + 1);
        /* the paths are written only for an error: a plan read names no path otherwise */
        size_t ranks = lua_type(L, -1) == LUA_TTABLE ? lua_objlen(L, -1) : 0;
        if (lua_type(L, -1) != LUA_TTABLE || ranks != (size_t)ep) {
            snprintf(path, sizeof path, "%s.placement[%d]", what, l + 1);
            want_table(L, -1, path, "one list per EP rank");
            rp_lua_error(L, "%s has %zu EP ranks, but ep_size is %d", path, ranks, ep);
        }
        int layer_idx = lua_gettop(L);
        for (int32_t j = 0; j < ep; j++) {
            lua_rawgeti(L, layer_idx, j + 1);
#define RANK_PATH() snprintf(path, sizeof path, "%s.placement[%d][%d]", what, l + 1, j + 1)
            if (lua_type(L, -1) != LUA_TTABLE) {
                RANK_PATH();
                want_table(L, -1, path, "the experts in the rank's slots");
            }
            size_t len = lua_objlen(L, -1);
            int32_t slots = slot_begin[j + 1] - slot_begin[j];
            if (len > (size_t)slots) {
                RANK_PATH();
                rp_lua_error(L, "%s has %zu experts, but EP rank %d has %d slots", path, len, j, slots);
            }
            for (size_t k = 0; k < len; k++) {
                lua_rawgeti(L, -1, (int)k + 1);
                double v = lua_tonumber(L, -1);
                if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v)) {
                    RANK_PATH();
                    rp_lua_error(L, "%s[%zu] must be an expert id (or -1 for an empty slot), got %s", path, k + 1,
                                 lua_type(L, -1) == LUA_TNUMBER ? lua_tostring(L, -1) : luaL_typename(L, -1));
                }
                if (v < -1 || v >= E) {
                    RANK_PATH();
                    rp_lua_error(L, "%s[%zu]: expert id %.17g out of range (%d experts; -1 marks an empty slot)", path,
                                 k + 1, v, E);
                }
                phy[(size_t)l * S + slot_begin[j] + k] = (int32_t)v;
                lua_pop(L, 1);
            }
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    return phy;
}
#undef RANK_PATH

typedef struct lever_key {
    int32_t mb, layer, expert, ep_rank;
} lever_key;

static void read_lever_key(lua_State *L, int t, const char *path, int32_t M, const rp_config *cfg, bool with_rank,
                           lever_key *k)
{
    const rp_model *md = rp_config_model(cfg);
    char p[160];
    static const struct {
        const char *name;
        int which;
    } fields[] = {{"microbatch", 0}, {"layer", 1}, {"expert", 2}, {"ep_rank", 3}};
    for (int i = 0; i < (with_rank ? 4 : 3); i++) {
        snprintf(p, sizeof p, "%.140s.%s", path, fields[i].name); /* bounded: the key names fit */
        if (get_key(L, t, fields[i].name) == LUA_TNIL) rp_lua_error(L, "%s is required", p);
        int64_t hi = i == 0 ? M - 1 : i == 1 ? md->num_layers - 1 : i == 2 ? md->num_experts - 1
                                                                           : rp_config_topology(cfg)->ep_size - 1;
        int32_t v = (int32_t)want_int(L, -1, p, 0, hi);
        lua_pop(L, 1);
        if (i == 0) k->mb = v;
        else if (i == 1) k->layer = v;
        else if (i == 2) k->expert = v;
        else k->ep_rank = v;
    }
}

void rp_lua_to_plan(lua_State *L, int idx, rp_lua_host *host, rp_context *into, const char *what,
                    int32_t num_seqs, int32_t base_mb, rp_lua_plan_out *out)
{
    static const char *const keys[] = {"format", "version", "num_gpus", "ep_size", "num_layers", "num_experts",
                                       "num_microbatches", "num_seqs", "packing", "placement", "extra_replicas",
                                       "shares", "per_forward_balancing", "microbatch_order", NULL};
    static const char *const extra_keys[] = {"microbatch", "layer", "expert", "ep_rank", NULL};
    static const char *const share_keys[] = {"microbatch", "layer", "expert", "shares", NULL};
    const rp_config *cfg = host->cfg;
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *md = rp_config_model(cfg);
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    luaL_checkstack(L, 40, "plan conversion");
    rp_error err;

    const rp_plan *src = rp_lua_test_plan(L, idx);
    if (src) {
        rp_status st = rp_lua_plan_compose(into, cfg, src, src, src, rp_plan_num_microbatches(src), &out->plan, &err);
        if (st != RP_OK) rp_lua_fail(L, host, what, st, &err);
        out->has_packing = rp_plan_has_packing(src);
        out->has_placement = rp_plan_has_placement(src);
        out->has_levers = rp_plan_num_extra_replicas(src) > 0 || rp_plan_num_share_sets(src) > 0;
        return;
    }
    if (lua_type(L, idx) != LUA_TTABLE)
        rp_lua_error(L, "%s must be a table in the plan shape or a plan userdata, got %s", what, luaL_typename(L, idx));
    check_keys(L, idx, what, keys);

    char path[160];
    if (get_key(L, idx, "format") != LUA_TNIL) {
        const char *f = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!f || strcmp(f, "routepack-plan") != 0)
            rp_lua_error(L, "%s.format must be \"routepack-plan\", got %s", what, f ? f : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    if (get_key(L, idx, "version") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.version", what);
        int64_t v = want_int(L, -1, path, 0, INT32_MAX);
        if (v < 1 || v > RP_PLAN_VERSION)
            rp_lua_error(L, "%s is %lld, but this RoutePack reads plan versions 1 to %d", path, (long long)v,
                         RP_PLAN_VERSION);
    }
    lua_pop(L, 1);
    check_shape(L, idx, what, "num_gpus", t->num_gpus, "GPUs");
    check_shape(L, idx, what, "ep_size", t->ep_size, "as ep_size");
    check_shape(L, idx, what, "num_layers", md->num_layers, "MoE layers");
    check_shape(L, idx, what, "num_experts", md->num_experts, "experts");

    int32_t fixed_M = rp_config_limits(cfg)->num_microbatches;
    int32_t n = num_seqs;
    bool has_packing = get_key(L, idx, "packing") != LUA_TNIL;
    int packing_idx = lua_gettop(L);
    if (get_key(L, idx, "num_seqs") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.num_seqs", what);
        int64_t v = want_int(L, -1, path, 0, INT32_MAX);
        if (num_seqs >= 0 && v != num_seqs)
            rp_lua_error(L, "%s is %lld, but the batch has %d sequences", path, (long long)v, num_seqs);
        n = (int32_t)v;
    }
    lua_pop(L, 1);
    if (has_packing && n < 0)
        rp_lua_error(L, "%s.num_seqs is required with a packing when there is no batch", what);
    int32_t M_max = n > fixed_M ? n : fixed_M;
    if (M_max < 1) M_max = 1;
    if (M_max > MAX_MICROBATCHES) M_max = MAX_MICROBATCHES;
    int32_t M_given = 0;
    if (get_key(L, idx, "num_microbatches") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.num_microbatches", what);
        M_given = (int32_t)want_int(L, -1, path, 1, M_max);
    }
    lua_pop(L, 1);

    packing_scratch pk = {0, NULL, NULL};
    if (has_packing) read_packing(L, packing_idx, what, t->num_gpus, n, M_given, M_max, &pk);
    else lua_pushnil(L), lua_pushnil(L);
    int32_t M = has_packing ? pk.M : M_given > 0 ? M_given : base_mb;

    const int32_t *phy = NULL;
    if (get_key(L, idx, "placement") != LUA_TNIL) phy = read_placement(L, lua_gettop(L), what, cfg, host->slot_begin);
    else lua_pushnil(L);
    rp_balancing balancing = RP_BALANCING_NONE;
    if (get_key(L, idx, "per_forward_balancing") != LUA_TNIL) {
        const char *b = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!b || (strcmp(b, "none") != 0 && strcmp(b, "virtual_experts") != 0))
            rp_lua_error(L, "%s.per_forward_balancing must be \"none\" or \"virtual_experts\", got %s", what,
                         b ? b : luaL_typename(L, -1));
        if (!phy)
            rp_lua_error(L, "%s.per_forward_balancing goes with a placement (it is how the placement runs): give "
                         "placement too", what);
        if (strcmp(b, "virtual_experts") == 0) balancing = RP_BALANCING_VIRTUAL_EXPERTS;
    }
    lua_pop(L, 1);

    int extras_idx = 0, shares_idx = 0;
    size_t num_extras = 0, num_shares = 0;
    if (get_key(L, idx, "extra_replicas") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.extra_replicas", what);
        want_table(L, -1, path, "a list of {microbatch, layer, expert, ep_rank}");
        num_extras = lua_objlen(L, -1);
        if (num_extras > MAX_LEVERS) rp_lua_error(L, "%s has %zu entries, at most %d", path, num_extras, MAX_LEVERS);
        extras_idx = lua_gettop(L);
    }
    if (get_key(L, idx, "shares") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.shares", what);
        want_table(L, -1, path, "a list of {microbatch, layer, expert, shares}");
        num_shares = lua_objlen(L, -1);
        if (num_shares > MAX_LEVERS) rp_lua_error(L, "%s has %zu entries, at most %d", path, num_shares, MAX_LEVERS);
        shares_idx = lua_gettop(L);
    }
    if (M < 1) {
        /* levers without a packing go with the packing they will run with: ctx.plan's */
        const rp_lua_frame *f = host->frame;
        M = fixed_M > 0 ? fixed_M : 1;
        if ((num_extras || num_shares) && f && f->base) {
            rp_error_clear(&err);
            const rp_plan *base = f->base(f->base_ud, &err);
            if (!base) rp_lua_error(L, "%s: %s", what, err.text);
            M = rp_plan_num_microbatches(base);
        }
    }
    /* extra replicas are inserted in sorted position: quadratic in their number */
    rp_lua_charge(L, (int64_t)num_extras * ((int64_t)num_extras / 8 + 8) + (int64_t)num_shares * 8);

    /* Everything read; the plan is made now and parked in `out` before any call that
     * can fail, so an error from here on leaves it to the owner of `out`. */
    rp_status st = rp_plan_new(into, cfg, M, &out->plan, &err);
    if (st != RP_OK) rp_lua_fail(L, host, what, st, &err);
    out->has_packing = has_packing;
    out->has_placement = phy != NULL;
    out->has_levers = num_extras > 0 || num_shares > 0;
    if (has_packing) {
        size_t cells = (size_t)t->num_gpus * (size_t)M;
        const int32_t **lists = lua_newuserdata(L, (cells + 1) * sizeof *lists);
        size_t pos = 0;
        for (size_t c = 0; c < cells; c++) {
            lists[c] = pk.ids + pos;
            pos += (size_t)pk.counts[c];
        }
        st = rp_plan_set_microbatches(out->plan, n, lists, pk.counts, &err);
        if (st != RP_OK) rp_lua_fail(L, host, what, st, &err);
        lua_pop(L, 1);
    }
    /* microbatch_order[rank][k]: the microbatch rank runs k-th (docs/formats.md) */
    if (get_key(L, idx, "microbatch_order") != LUA_TNIL) {
        snprintf(path, sizeof path, "%s.microbatch_order", what);
        want_table(L, -1, path, "a list of one microbatch order per rank");
        int ord = lua_gettop(L);
        int32_t *ids = lua_newuserdata(L, (size_t)M * sizeof *ids);
        rp_lua_charge(L, (int64_t)t->num_gpus * M);
        for (int32_t g = 0; g < t->num_gpus; g++) {
            char rp[192];
            snprintf(rp, sizeof rp, "%s[%d]", path, g + 1);
            lua_rawgeti(L, ord, g + 1);
            want_table(L, -1, rp, "a list of microbatch ids (0-based) in run order");
            if (lua_objlen(L, -1) != (size_t)M)
                rp_lua_error(L, "%s has %d entries, but the plan has %d microbatches", rp, (int)lua_objlen(L, -1), M);
            for (int32_t k = 0; k < M; k++) {
                char ip[224];
                snprintf(ip, sizeof ip, "%s[%d]", rp, k + 1);
                lua_rawgeti(L, -1, k + 1);
                ids[k] = (int32_t)want_int(L, -1, ip, 0, M - 1);
                lua_pop(L, 1);
            }
            st = rp_plan_set_microbatch_order(out->plan, g, ids, &err);
            if (st != RP_OK) rp_lua_fail(L, host, rp, st, &err);
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    if (phy) {
        int32_t S = host->slot_begin[t->ep_size];
        for (int32_t l = 0; l < md->num_layers; l++) {
            st = rp_plan_set_phy2log(out->plan, l, phy + (size_t)l * S, &err);
            if (st != RP_OK) rp_lua_fail(L, host, what, st, &err);
        }
        st = rp_plan_set_balancing(out->plan, balancing, &err);
        if (st != RP_OK) rp_lua_fail(L, host, what, st, &err);
    }
    for (size_t i = 0; i < num_extras; i++) {
        lua_rawgeti(L, extras_idx, (int)i + 1);
        snprintf(path, sizeof path, "%s.extra_replicas[%zu]", what, i + 1);
        want_table(L, -1, path, "{microbatch = m, layer = l, expert = e, ep_rank = j}");
        int e = lua_gettop(L);
        check_keys(L, e, path, extra_keys);
        lever_key k = {0};
        read_lever_key(L, e, path, M, cfg, true, &k);
        st = rp_plan_add_extra_replica(out->plan, k.mb, k.layer, k.expert, k.ep_rank, &err);
        if (st != RP_OK) rp_lua_fail(L, host, path, st, &err);
        lua_pop(L, 1);
    }
    lever_key prev = {-1, -1, -1, -1};
    for (size_t i = 0; i < num_shares; i++) {
        lua_rawgeti(L, shares_idx, (int)i + 1);
        snprintf(path, sizeof path, "%s.shares[%zu]", what, i + 1);
        want_table(L, -1, path, "{microbatch = m, layer = l, expert = e, shares = {...}}");
        int e = lua_gettop(L);
        check_keys(L, e, path, share_keys);
        lever_key k = {0};
        read_lever_key(L, e, path, M, cfg, false, &k);
        /* a share set is inserted in sorted position: free at the end, but one out of
         * order moves up to all the sets before it */
        if (k.mb < prev.mb || (k.mb == prev.mb && (k.layer < prev.layer || (k.layer == prev.layer && k.expert <= prev.expert))))
            rp_lua_charge(L, (int64_t)i / 8 + 1);
        prev = k;
        char sp[192];
        snprintf(sp, sizeof sp, "%s.shares", path);
        if (get_key(L, e, "shares") == LUA_TNIL) rp_lua_error(L, "%s is required", sp);
        want_table(L, -1, sp, "one share per replica");
        size_t cnt = lua_objlen(L, -1);
        size_t cap = (size_t)host->slot_begin[t->ep_size] + (size_t)t->ep_size;
        if (cnt > cap) rp_lua_error(L, "%s has %zu shares, more than the %zu replicas an expert can have", sp, cnt, cap);
        rp_lua_charge(L, (int64_t)cnt);
        double *v = lua_newuserdata(L, (cnt + 1) * sizeof *v);
        for (size_t s = 0; s < cnt; s++) {
            lua_rawgeti(L, -2, (int)s + 1);
            if (lua_type(L, -1) != LUA_TNUMBER)
                rp_lua_error(L, "%s[%zu] must be a number, got %s", sp, s + 1, luaL_typename(L, -1));
            v[s] = lua_tonumber(L, -1);
            lua_pop(L, 1);
        }
        st = rp_plan_set_shares(out->plan, k.mb, k.layer, k.expert, v, (int32_t)cnt, &err);
        if (st != RP_OK) rp_lua_fail(L, host, path, st, &err);
        lua_pop(L, 3);
    }
}
