/* The ctx a policy receives: read-only userdata views of the topology, model, limits,
 * batch, routing statistics, history, placement in use and cost model, indexed by id
 * without copying the arrays behind them. */
#include "lua_api.h"

#include <lauxlib.h>

#include <math.h>
#include <string.h>

#define VIEW_MT "routepack.view"
#define OBJ_MT "routepack.ctxobj"
#define CTX_MT "routepack.ctx"

typedef enum view_kind {
    V_I32 = 0,
    V_I64 = 1,
    V_U32 = 2,
    V_F64 = 3,
    V_SEQLEN = 4, /* data: cu_seqlens (int64, n + 1) */
    V_NODE = 5    /* GPU g -> g / aux; no data */
} view_kind;

/* A view of n numbers. gen 0: always valid (config data, or data owned by the view
 * itself); otherwise valid only during the call of that generation, since the arrays
 * behind it belong to that step. */
typedef struct view {
    uint64_t gen;
    const void *data;
    int32_t n;
    int32_t kind;
    int32_t aux;
    const char *name;
} view;

typedef enum obj_kind {
    O_TOPOLOGY = 0,
    O_MODEL,
    O_LIMITS,
    O_BATCH,
    O_STATS,
    O_HISTORY,
    O_HISTORY_ENTRY,
    O_PLACEMENT,
    O_COST,
    O_TRAINER
} obj_kind;

static const char *const obj_names[] = {"ctx.topology", "ctx.stats" /* unused */, "ctx.limits",
                                        "ctx.batch",    "ctx.stats", "ctx.history",
                                        "ctx.history[i]", "ctx.placement", "ctx.cost", "ctx.trainer"};

typedef struct obj {
    uint64_t gen;
    int32_t kind;
    int32_t index; /* history entry: 0 = most recent */
} obj;

/* ---- generations -------------------------------------------------------------------- */

static const rp_lua_frame *live_frame(lua_State *L, rp_lua_host *h, uint64_t gen, const char *name)
{
    if (gen != 0 && (gen != h->generation || !h->frame))
        rp_lua_error(L, "%s belongs to an earlier call; views are valid only during the call that received "
                        "them (copy what you need, e.g. with v:totable())",
                     name);
    return h->frame;
}

/* ---- views -------------------------------------------------------------------------- */

static view *push_view(lua_State *L, uint64_t gen, const void *data, int32_t n, view_kind kind,
                       const char *name)
{
    view *v = lua_newuserdata(L, sizeof *v);
    v->gen = gen;
    v->data = data;
    v->n = n;
    v->kind = kind;
    v->aux = 0;
    v->name = name;
    luaL_getmetatable(L, VIEW_MT);
    lua_setmetatable(L, -2);
    return v;
}

/* A view that owns its numbers (decoded histograms, replica counts). */
static void *push_owned_view(lua_State *L, int32_t n, view_kind kind, const char *name)
{
    size_t elem = kind == V_I32 || kind == V_U32 ? 4 : 8;
    view *v = lua_newuserdata(L, sizeof *v + elem * ((size_t)n + 1));
    v->gen = 0;
    v->data = v + 1;
    v->n = n;
    v->kind = kind;
    v->aux = 0;
    v->name = name;
    luaL_getmetatable(L, VIEW_MT);
    lua_setmetatable(L, -2);
    return v + 1;
}

static double view_at(const view *v, int32_t i)
{
    switch (v->kind) {
    case V_I32: return ((const int32_t *)v->data)[i];
    case V_I64: return (double)((const int64_t *)v->data)[i];
    case V_U32: return ((const uint32_t *)v->data)[i];
    case V_F64: return ((const double *)v->data)[i];
    case V_SEQLEN: {
        const int64_t *cu = v->data;
        return (double)(cu[i + 1] - cu[i]);
    }
    default: return (double)(i / v->aux);
    }
}

static view *check_view(lua_State *L, int idx)
{
    view *v = luaL_checkudata(L, idx, VIEW_MT);
    live_frame(L, rp_lua_host_of(L), v->gen, v->name);
    return v;
}

int32_t rp_lua_view_length(lua_State *L, int idx)
{
    view *v = luaL_testudata(L, idx, VIEW_MT);
    if (!v) return -1;
    live_frame(L, rp_lua_host_of(L), v->gen, v->name);
    return v->n;
}

void rp_lua_view_to_doubles(lua_State *L, int idx, double *out)
{
    view *v = check_view(L, idx);
    for (int32_t i = 0; i < v->n; i++) out[i] = view_at(v, i);
}

static int view_sum(lua_State *L)
{
    view *v = check_view(L, 1);
    rp_lua_charge(L, v->n);
    double s = 0;
    for (int32_t i = 0; i < v->n; i++) s += view_at(v, i);
    lua_pushnumber(L, s);
    return 1;
}

/* Extreme value and its first index; nil, nil for an empty view. */
static int view_extreme(lua_State *L, bool want_max, bool want_index)
{
    view *v = check_view(L, 1);
    rp_lua_charge(L, v->n);
    if (v->n == 0) {
        lua_pushnil(L);
        return 1;
    }
    int32_t best = 0;
    double bv = view_at(v, 0);
    for (int32_t i = 1; i < v->n; i++) {
        double x = view_at(v, i);
        if (want_max ? x > bv : x < bv) bv = x, best = i;
    }
    if (want_index) lua_pushinteger(L, best);
    else lua_pushnumber(L, bv);
    return 1;
}

static int view_max(lua_State *L) { return view_extreme(L, true, false); }
static int view_min(lua_State *L) { return view_extreme(L, false, false); }
static int view_argmax(lua_State *L) { return view_extreme(L, true, true); }
static int view_argmin(lua_State *L) { return view_extreme(L, false, true); }

/* A 1-based Lua list copy: element i + 1 holds v[i]. */
static int view_totable(lua_State *L)
{
    view *v = check_view(L, 1);
    rp_lua_charge(L, v->n);
    lua_createtable(L, v->n, 0);
    for (int32_t i = 0; i < v->n; i++) {
        lua_pushnumber(L, view_at(v, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static const luaL_Reg view_methods[] = {
    {"sum", view_sum},       {"max", view_max},       {"min", view_min},
    {"argmax", view_argmax}, {"argmin", view_argmin}, {"totable", view_totable},
    {NULL, NULL},
};

static int view_index(lua_State *L)
{
    view *v = check_view(L, 1);
    if (lua_type(L, 2) == LUA_TNUMBER) {
        double k = lua_tonumber(L, 2);
        if (k >= 0 && k < v->n && k == floor(k)) lua_pushnumber(L, view_at(v, (int32_t)k));
        else lua_pushnil(L);
        return 1;
    }
    if (lua_type(L, 2) == LUA_TSTRING) {
        lua_pushvalue(L, 2);
        lua_rawget(L, lua_upvalueindex(1)); /* the methods table, never handed out */
        return 1;
    }
    lua_pushnil(L);
    return 1;
}

static int view_len(lua_State *L)
{
    lua_pushinteger(L, check_view(L, 1)->n);
    return 1;
}

static int view_newindex(lua_State *L)
{
    view *v = luaL_checkudata(L, 1, VIEW_MT);
    return rp_lua_error(L, "%s is read-only", v->name);
}

/* The key comes from the policy, so any number can arrive: the next id is computed in
 * doubles and checked against the view's range before it becomes an index (a key of
 * 2^31 - 1 plus one overflowed int32, a key of 2^32 wrapped to 0). */
static int view_next(lua_State *L)
{
    view *v = check_view(L, 1);
    double next = 0;
    if (!lua_isnil(L, 2)) {
        if (lua_type(L, 2) != LUA_TNUMBER)
            return rp_lua_error(L, "%s: the key after which to iterate must be an id, got %s", v->name,
                                luaL_typename(L, 2));
        double k = lua_tonumber(L, 2);
        next = k == floor(k) ? k + 1 : -1; /* NaN and fractions end the iteration */
    }
    if (!(next >= 0 && next < (double)v->n)) {
        lua_pushnil(L);
        return 1;
    }
    int32_t i = (int32_t)next;
    lua_pushinteger(L, i);
    lua_pushnumber(L, view_at(v, i));
    return 2;
}

/* pairs(view) visits ids 0 .. n-1 in order. */
static int view_pairs(lua_State *L)
{
    check_view(L, 1);
    lua_pushcfunction(L, view_next);
    lua_pushvalue(L, 1);
    lua_pushnil(L);
    return 3;
}

static int view_tostring(lua_State *L)
{
    view *v = luaL_checkudata(L, 1, VIEW_MT);
    lua_pushfstring(L, "view %s [%d]", v->name, (int)v->n);
    return 1;
}

/* ---- functions in the views ---------------------------------------------------------- */

static const rp_lua_frame *step_frame(lua_State *L, const char *what)
{
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = h->frame;
    if (!f || !f->batch) rp_lua_error(L, "%s is not available outside a step (in init)", what);
    return f;
}

static int32_t check_layer(lua_State *L, int idx, const char *fname)
{
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t Ly = rp_config_model(h->cfg)->num_layers;
    char what[96];
    snprintf(what, sizeof what, "%s: layer", fname);
    return (int32_t)rp_lua_check_int(L, idx, what, 0, Ly - 1);
}

static int stats_expert_load(lua_State *L)
{
    const rp_lua_frame *f = step_frame(L, "ctx.stats.expert_load");
    int32_t layer = check_layer(L, 1, "ctx.stats.expert_load");
    rp_lua_host *h = rp_lua_host_of(L);
    push_view(L, h->generation, rp_stats_expert_load(f->stats, layer), rp_stats_num_experts(f->stats), V_I64,
              "expert_load");
    return 1;
}

static int stats_seq_count(lua_State *L)
{
    const rp_lua_frame *f = step_frame(L, "ctx.stats.seq_count");
    int32_t n = rp_stats_num_seqs(f->stats), E = rp_stats_num_experts(f->stats);
    int32_t s = (int32_t)rp_lua_check_int(L, 1, "ctx.stats.seq_count: sequence", 0, n - 1);
    int32_t layer = check_layer(L, 2, "ctx.stats.seq_count");
    int32_t e = (int32_t)rp_lua_check_int(L, 3, "ctx.stats.seq_count: expert", 0, E - 1);
    rp_lua_charge(L, E);
    lua_pushnumber(L, rp_stats_seq_count(f->stats, s, layer, e));
    return 1;
}

static int stats_seq_hist(lua_State *L)
{
    const rp_lua_frame *f = step_frame(L, "ctx.stats.seq_hist");
    int32_t n = rp_stats_num_seqs(f->stats), E = rp_stats_num_experts(f->stats);
    int32_t s = (int32_t)rp_lua_check_int(L, 1, "ctx.stats.seq_hist: sequence", 0, n - 1);
    int32_t layer = check_layer(L, 2, "ctx.stats.seq_hist");
    rp_lua_charge(L, E);
    uint32_t *counts = push_owned_view(L, E, V_U32, "seq_hist");
    rp_stats_seq_hist(f->stats, s, layer, counts);
    return 1;
}

static int history_expert_load(lua_State *L)
{
    rp_lua_host *h = rp_lua_host_of(L);
    uint64_t gen = (uint64_t)lua_tonumber(L, lua_upvalueindex(1));
    int32_t index = (int32_t)lua_tointeger(L, lua_upvalueindex(2));
    const rp_lua_frame *f = live_frame(L, h, gen, "ctx.history[i].expert_load");
    int32_t layer = check_layer(L, 1, "ctx.history[i].expert_load");
    int32_t E = rp_config_model(h->cfg)->num_experts;
    push_view(L, h->generation, f->history->loads[index] + (size_t)layer * (size_t)E, E, V_I64, "expert_load");
    return 1;
}

/* ctx.history.share_sum(): for each (layer, expert), the sum over the entries, most
 * recent first, of the expert's load over the layer's total load in that entry (an entry
 * whose layer has none adds nothing): num_layers x num_experts numbers in a view of its
 * own, index layer x num_experts + expert. The doubles of the Lua loop over the views
 * (load:sum(), then load[e] / total added entry by entry), bit for bit, without a call
 * per element. */
static int history_share_sum(lua_State *L)
{
    rp_lua_host *h = rp_lua_host_of(L);
    uint64_t gen = (uint64_t)lua_tonumber(L, lua_upvalueindex(1));
    const rp_lua_frame *f = live_frame(L, h, gen, "ctx.history.share_sum");
    const rp_model *md = rp_config_model(h->cfg);
    const size_t E = (size_t)md->num_experts, n = (size_t)md->num_layers * E;
    if (n > INT32_MAX)
        return rp_lua_error(L, "ctx.history.share_sum: %d layers x %d experts is more numbers than a view holds",
                            md->num_layers, md->num_experts);
    rp_lua_charge(L, ((int64_t)f->history->count + 1) * (int64_t)n);
    double *sum = push_owned_view(L, (int32_t)n, V_F64, "share_sum");
    for (size_t i = 0; i < n; i++) sum[i] = 0;
    for (int32_t k = 0; k < f->history->count; k++)
        for (size_t base = 0; base < n; base += E) {
            const int64_t *load = f->history->loads[k] + base;
            double total = 0;
            for (size_t e = 0; e < E; e++) total += (double)load[e];
            if (total > 0)
                for (size_t e = 0; e < E; e++) sum[base + e] += (double)load[e] / total;
        }
    return 1;
}

static const rp_plan *placement_of(lua_State *L, const char *what)
{
    const rp_lua_frame *f = step_frame(L, what);
    if (!f->placement) rp_lua_error(L, "%s: there is no placement in use yet", what);
    return f->placement;
}

static int placement_phy2log(lua_State *L)
{
    const rp_plan *p = placement_of(L, "ctx.placement.phy2log");
    int32_t layer = check_layer(L, 1, "ctx.placement.phy2log");
    rp_lua_host *h = rp_lua_host_of(L);
    push_view(L, h->generation, rp_plan_phy2log(p, layer), rp_plan_total_slots(p), V_I32, "phy2log");
    return 1;
}

static int placement_logcnt(lua_State *L)
{
    const rp_plan *p = placement_of(L, "ctx.placement.logcnt");
    int32_t layer = check_layer(L, 1, "ctx.placement.logcnt");
    int32_t E = rp_plan_num_experts(p);
    rp_lua_charge(L, E + rp_plan_total_slots(p));
    int32_t *cnt = push_owned_view(L, E, V_I32, "logcnt");
    rp_plan_logcnt(p, layer, cnt);
    return 1;
}

/* experts(layer, j): the experts EP rank j holds, in slot order (empty slots left out). */
static int placement_experts(lua_State *L)
{
    const rp_plan *p = placement_of(L, "ctx.placement.experts");
    int32_t layer = check_layer(L, 1, "ctx.placement.experts");
    int32_t ep = rp_plan_ep_size(p);
    int32_t j = (int32_t)rp_lua_check_int(L, 2, "ctx.placement.experts: EP rank", 0, ep - 1);
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

/* table(): the whole placement in the plan table shape (placement[layer][ep_rank]). */
static int placement_table(lua_State *L)
{
    rp_lua_push_placement(L, placement_of(L, "ctx.placement.table"));
    return 1;
}

static rp_cost *cost_of(lua_State *L, const char *what)
{
    return step_frame(L, what)->cost;
}

static int cost_attention(lua_State *L)
{
    rp_cost *c = cost_of(L, "ctx.cost.attention");
    int64_t len = rp_lua_check_int(L, 1, "ctx.cost.attention: seq_len", 0, INT64_C(1) << 40);
    lua_pushnumber(L, rp_cost_attention_s(c, len));
    return 1;
}

static int cost_expert(lua_State *L)
{
    rp_cost *c = cost_of(L, "ctx.cost.expert");
    if (lua_type(L, 1) != LUA_TNUMBER)
        return rp_lua_error(L, "ctx.cost.expert: tokens must be a number, got %s", luaL_typename(L, 1));
    double tokens = lua_tonumber(L, 1);
    if (!(tokens >= 0) || !isfinite(tokens))
        return rp_lua_error(L, "ctx.cost.expert: tokens must be finite and >= 0, got %g", tokens);
    lua_pushnumber(L, rp_cost_expert_s(c, tokens));
    return 1;
}

static int cost_expert_move(lua_State *L)
{
    rp_cost *c = cost_of(L, "ctx.cost.expert_move");
    if (lua_type(L, 1) != LUA_TBOOLEAN)
        return rp_lua_error(L, "ctx.cost.expert_move: same_node must be a boolean, got %s", luaL_typename(L, 1));
    lua_pushnumber(L, rp_cost_expert_move_s(c, lua_toboolean(L, 1)));
    return 1;
}

/* ---- objects ------------------------------------------------------------------------ */

static obj *push_obj(lua_State *L, uint64_t gen, obj_kind kind, int32_t index)
{
    obj *o = lua_newuserdata(L, sizeof *o);
    o->gen = gen;
    o->kind = kind;
    o->index = index;
    luaL_getmetatable(L, OBJ_MT);
    lua_setmetatable(L, -2);
    return o;
}

static const char *obj_name(const obj *o) { return o->kind == O_MODEL ? "ctx.model" : obj_names[o->kind]; }

static bool field(const char *k, const char *name) { return strcmp(k, name) == 0; }

static int push_int(lua_State *L, double v)
{
    lua_pushnumber(L, v);
    return 1;
}

static int topology_index(lua_State *L, rp_lua_host *h, const char *k)
{
    const rp_topology *t = rp_config_topology(h->cfg);
    if (field(k, "num_nodes")) return push_int(L, t->num_nodes);
    if (field(k, "gpus_per_node")) return push_int(L, t->gpus_per_node);
    if (field(k, "num_gpus")) return push_int(L, t->num_gpus);
    if (field(k, "dp_size")) return push_int(L, t->dp_size);
    if (field(k, "ep_size")) return push_int(L, t->ep_size);
    if (field(k, "num_ep_groups")) return push_int(L, t->num_ep_groups);
    if (field(k, "total_slots")) return push_int(L, h->slot_begin[t->ep_size]);
    if (field(k, "slots")) return push_view(L, 0, t->slots, t->ep_size, V_I32, "ctx.topology.slots"), 1;
    if (field(k, "gpu_slots")) return push_view(L, 0, t->slots, t->num_gpus, V_I32, "ctx.topology.gpu_slots"), 1;
    if (field(k, "slot_begin"))
        return push_view(L, 0, h->slot_begin, t->ep_size + 1, V_I32, "ctx.topology.slot_begin"), 1;
    if (field(k, "speed")) return push_view(L, 0, t->speed, t->num_gpus, V_F64, "ctx.topology.speed"), 1;
    if (field(k, "node")) {
        view *v = push_view(L, 0, NULL, t->num_gpus, V_NODE, "ctx.topology.node");
        v->aux = t->gpus_per_node;
        return 1;
    }
    if (field(k, "pipeline_parallel_size")) return push_int(L, t->pipeline_parallel_size);
    if (field(k, "virtual_pipeline_size")) return push_int(L, t->virtual_pipeline_size);
    if (field(k, "context_parallel_size")) return push_int(L, t->context_parallel_size);
    if (field(k, "stage_of_layer")) {
        /* a table built once per access: num_layers entries, a policy reads it rarely */
        const int32_t L_ = rp_config_model(h->cfg)->num_layers, PV = t->pipeline_parallel_size * t->virtual_pipeline_size;
        rp_lua_charge(L, L_);
        lua_createtable(L, L_, 0);
        for (int32_t v = 0; v < PV; v++)
            for (int32_t l = t->stage_layer_begin[v]; l < t->stage_layer_begin[v] + t->layers_per_stage[v]; l++) {
                lua_pushnumber(L, v % t->pipeline_parallel_size);
                lua_rawseti(L, -2, l + 1);
            }
        return 1;
    }
    return 0;
}

static int model_index(lua_State *L, rp_lua_host *h, const char *k)
{
    const rp_model *m = rp_config_model(h->cfg);
    if (field(k, "num_layers")) return push_int(L, m->num_layers);
    if (field(k, "num_experts")) return push_int(L, m->num_experts);
    if (field(k, "top_k")) return push_int(L, m->top_k);
    if (field(k, "hidden_size")) return push_int(L, m->hidden_size);
    if (field(k, "expert_ffn_size")) return push_int(L, m->expert_ffn_size);
    if (field(k, "num_heads")) return push_int(L, m->num_heads);
    if (field(k, "num_kv_heads")) return push_int(L, m->num_kv_heads);
    if (field(k, "head_dim")) return push_int(L, m->head_dim);
    if (field(k, "bytes_per_param")) return push_int(L, m->bytes_per_param);
    if (field(k, "bytes_per_optimizer_state")) return push_int(L, m->bytes_per_optimizer_state);
    if (field(k, "bytes_per_grad")) return push_int(L, m->bytes_per_grad);
    if (field(k, "dense_params")) return push_int(L, (double)m->dense_params);
    return 0;
}

static int limits_index(lua_State *L, rp_lua_host *h, const char *k)
{
    const rp_limits *l = rp_config_limits(h->cfg);
    if (field(k, "max_tokens_per_microbatch")) return push_int(L, (double)l->max_tokens_per_microbatch);
    if (field(k, "num_microbatches")) return push_int(L, l->num_microbatches);
    if (field(k, "max_activation_bytes")) return push_int(L, l->max_activation_bytes);
    if (field(k, "activation_bytes_per_token")) return push_int(L, l->activation_bytes_per_token);
    return 0;
}

/* What the trainer demands of a packing and can run (docs/config.md, "trainer"). */
static int trainer_index(lua_State *L, rp_lua_host *h, const char *k)
{
    const rp_trainer *t = rp_config_trainer(h->cfg);
    bool b;
    if (field(k, "equal_sequences_per_rank")) b = t->equal_sequences_per_rank;
    else if (field(k, "nonempty_microbatches")) b = t->nonempty_microbatches;
    else if (field(k, "per_forward_balancer")) b = t->per_forward_balancer;
    else if (field(k, "microbatch_multiple")) return push_int(L, t->microbatch_multiple);
    else if (field(k, "mini_batches")) return push_int(L, t->mini_batches);
    else if (field(k, "epochs")) return push_int(L, t->epochs);
    else return 0;
    lua_pushboolean(L, b);
    return 1;
}

static int batch_index(lua_State *L, rp_lua_host *h, const rp_lua_frame *f, const char *k)
{
    const rp_batch *b = f->batch;
    int32_t n = rp_batch_num_seqs(b);
    if (field(k, "num_seqs")) return push_int(L, n);
    if (field(k, "num_tokens")) return push_int(L, (double)rp_batch_num_tokens(b));
    if (field(k, "max_seq_len")) return push_int(L, rp_batch_max_seq_len(b));
    if (field(k, "seq_len")) return push_view(L, h->generation, rp_batch_cu_seqlens(b), n, V_SEQLEN, "ctx.batch.seq_len"), 1;
    if (field(k, "prompt_len"))
        return push_view(L, h->generation, rp_batch_prompt_lens(b), n, V_I32, "ctx.batch.prompt_len"), 1;
    if (field(k, "response_len"))
        return push_view(L, h->generation, rp_batch_response_lens(b), n, V_I32, "ctx.batch.response_len"), 1;
    if (field(k, "group_id"))
        return push_view(L, h->generation, rp_batch_group_ids(b), n, V_I32, "ctx.batch.group_id"), 1;
    return 0;
}

static int push_fn(lua_State *L, lua_CFunction fn)
{
    lua_pushcfunction(L, fn);
    return 1;
}

static int stats_index(lua_State *L, const rp_lua_frame *f, const char *k)
{
    if (field(k, "num_seqs")) return push_int(L, rp_stats_num_seqs(f->stats));
    if (field(k, "num_layers")) return push_int(L, rp_stats_num_layers(f->stats));
    if (field(k, "num_experts")) return push_int(L, rp_stats_num_experts(f->stats));
    if (field(k, "expert_load")) return push_fn(L, stats_expert_load);
    if (field(k, "seq_count")) return push_fn(L, stats_seq_count);
    if (field(k, "seq_hist")) return push_fn(L, stats_seq_hist);
    return 0;
}

static int history_entry_index(lua_State *L, rp_lua_host *h, const rp_lua_frame *f, const obj *o, const char *k)
{
    if (field(k, "step")) return push_int(L, (double)f->history->steps[o->index]);
    if (field(k, "expert_load")) {
        lua_pushnumber(L, (double)h->generation);
        lua_pushinteger(L, o->index);
        lua_pushcclosure(L, history_expert_load, 2);
        return 1;
    }
    return 0;
}

static int placement_index(lua_State *L, rp_lua_host *h, const rp_lua_frame *f, const char *k)
{
    const rp_plan *p = f->placement;
    if (field(k, "total_slots")) return push_int(L, rp_plan_total_slots(p));
    if (field(k, "num_layers")) return push_int(L, rp_plan_num_layers(p));
    if (field(k, "slot_begin"))
        return push_view(L, h->generation, rp_plan_slot_begin(p), rp_plan_ep_size(p) + 1, V_I32,
                         "ctx.placement.slot_begin"),
               1;
    if (field(k, "phy2log")) return push_fn(L, placement_phy2log);
    if (field(k, "logcnt")) return push_fn(L, placement_logcnt);
    if (field(k, "experts")) return push_fn(L, placement_experts);
    if (field(k, "table")) return push_fn(L, placement_table);
    /* how the placement in use runs: "virtual_experts" when the trainer balances each
     * forward on top of it (Megatron's balancer), else "none" */
    if (field(k, "per_forward_balancing")) return lua_pushstring(L, rp_balancing_name(rp_plan_balancing(p))), 1;
    return 0;
}

static int cost_index(lua_State *L, const char *k)
{
    if (field(k, "attention")) return push_fn(L, cost_attention);
    if (field(k, "expert")) return push_fn(L, cost_expert);
    if (field(k, "expert_move")) return push_fn(L, cost_expert_move);
    return 0;
}

static int obj_index(lua_State *L)
{
    obj *o = luaL_checkudata(L, 1, OBJ_MT);
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = live_frame(L, h, o->gen, obj_name(o));
    if (o->kind == O_HISTORY) {
        if (lua_type(L, 2) == LUA_TNUMBER) {
            double i = lua_tonumber(L, 2);
            if (i >= 1 && i <= f->history->count && i == floor(i)) push_obj(L, o->gen, O_HISTORY_ENTRY, (int32_t)i - 1);
            else lua_pushnil(L);
            return 1;
        }
        if (lua_type(L, 2) == LUA_TSTRING && field(lua_tostring(L, 2), "share_sum")) {
            lua_pushnumber(L, (double)h->generation);
            lua_pushcclosure(L, history_share_sum, 1);
            return 1;
        }
        lua_pushnil(L);
        return 1;
    }
    if (lua_type(L, 2) != LUA_TSTRING) {
        lua_pushnil(L);
        return 1;
    }
    const char *k = lua_tostring(L, 2);
    int r = 0;
    switch (o->kind) {
    case O_TOPOLOGY: r = topology_index(L, h, k); break;
    case O_MODEL: r = model_index(L, h, k); break;
    case O_LIMITS: r = limits_index(L, h, k); break;
    case O_TRAINER: r = trainer_index(L, h, k); break;
    case O_BATCH: r = batch_index(L, h, f, k); break;
    case O_STATS: r = stats_index(L, f, k); break;
    case O_HISTORY_ENTRY: r = history_entry_index(L, h, f, o, k); break;
    case O_PLACEMENT: r = placement_index(L, h, f, k); break;
    case O_COST: r = cost_index(L, k); break;
    default: break;
    }
    if (!r) lua_pushnil(L);
    return 1;
}

static int obj_len(lua_State *L)
{
    obj *o = luaL_checkudata(L, 1, OBJ_MT);
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = live_frame(L, h, o->gen, obj_name(o));
    if (o->kind != O_HISTORY) return rp_lua_error(L, "attempt to get the length of %s", obj_name(o));
    lua_pushinteger(L, f->history->count);
    return 1;
}

static int obj_newindex(lua_State *L)
{
    obj *o = luaL_checkudata(L, 1, OBJ_MT);
    return rp_lua_error(L, "%s is read-only", obj_name(o));
}

static int obj_tostring(lua_State *L)
{
    obj *o = luaL_checkudata(L, 1, OBJ_MT);
    lua_pushstring(L, obj_name(o));
    return 1;
}

/* ---- ctx ------------------------------------------------------------------------------ */

/* ctx.plan, made on first use: the plan that runs if the policy returns nothing. */
static int ctx_index(lua_State *L)
{
    if (lua_type(L, 2) != LUA_TSTRING || strcmp(lua_tostring(L, 2), "plan") != 0) {
        lua_pushnil(L);
        return 1;
    }
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_lua_frame *f = h->frame;
    if (!f || !f->base) {
        lua_pushnil(L);
        return 1;
    }
    rp_error err;
    rp_error_clear(&err);
    const rp_plan *base = f->base(f->base_ud, &err);
    if (!base) return rp_lua_error(L, "ctx.plan: %s", err.text);
    rp_lua_charge(L, (int64_t)rp_plan_num_seqs(base) +
                         (int64_t)rp_plan_num_layers(base) * rp_plan_total_slots(base));
    rp_lua_plan_out *holder = rp_lua_push_plan(L);
    rp_status st = rp_lua_plan_compose(&h->plan_ctx, h->cfg, base, base, base, rp_plan_num_microbatches(base),
                                       &holder->plan, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "ctx.plan", st, &err);
    holder->has_packing = rp_plan_has_packing(base);
    holder->has_placement = rp_plan_has_placement(base);
    lua_pushvalue(L, 2);
    lua_pushvalue(L, -2);
    lua_rawset(L, 1);
    return 1;
}

void rp_lua_push_ctx(lua_State *L, rp_lua_host *h)
{
    const rp_lua_frame *f = h->frame;
    lua_createtable(L, 0, 16);
    if (f) {
        lua_pushnumber(L, (double)f->step);
        lua_setfield(L, -2, "step");
        /* 53 bits, so that the seed is an exact Lua number */
        lua_pushnumber(L, (double)(f->seed >> 11));
        lua_setfield(L, -2, "seed");
    }
    push_obj(L, 0, O_TOPOLOGY, 0);
    lua_setfield(L, -2, "topology");
    push_obj(L, 0, O_MODEL, 0);
    lua_setfield(L, -2, "model");
    push_obj(L, 0, O_LIMITS, 0);
    lua_setfield(L, -2, "limits");
    push_obj(L, 0, O_TRAINER, 0);
    lua_setfield(L, -2, "trainer");
    if (f && f->batch) {
        push_obj(L, h->generation, O_BATCH, 0);
        lua_setfield(L, -2, "batch");
        push_obj(L, h->generation, O_STATS, 0);
        lua_setfield(L, -2, "stats");
        push_obj(L, h->generation, O_COST, 0);
        lua_setfield(L, -2, "cost");
        if (f->history) {
            push_obj(L, h->generation, O_HISTORY, 0);
            lua_setfield(L, -2, "history");
        }
        if (f->placement) {
            push_obj(L, h->generation, O_PLACEMENT, 0);
            lua_setfield(L, -2, "placement");
        }
    }
    if (f && f->base) {
        luaL_getmetatable(L, CTX_MT);
        lua_setmetatable(L, -2);
    }
}

/* ---- registration ---------------------------------------------------------------------- */

static const luaL_Reg view_meta[] = {
    {"__index", view_index},   {"__len", view_len},           {"__newindex", view_newindex},
    {"__pairs", view_pairs},   {"__tostring", view_tostring}, {NULL, NULL},
};
static const luaL_Reg obj_meta[] = {
    {"__index", obj_index}, {"__len", obj_len}, {"__newindex", obj_newindex}, {"__tostring", obj_tostring},
    {NULL, NULL},
};
static const luaL_Reg ctx_meta[] = {{"__index", ctx_index}, {NULL, NULL}};

void rp_lua_register_views(lua_State *L, rp_lua_host *host)
{
    (void)host;
    rp_lua_register_metatable(L, VIEW_MT, view_methods, view_meta, "routepack view");
    rp_lua_register_metatable(L, OBJ_MT, NULL, obj_meta, "routepack view");
    rp_lua_register_metatable(L, CTX_MT, NULL, ctx_meta, "routepack ctx");
}

/* A list or a view of numbers as a C array, in a userdata pushed on the stack (so the
 * collector frees it whatever happens). Lists are 1-based (element i is item i-1),
 * views 0-based. */
double *rp_lua_read_vector(lua_State *L, int idx, const char *what, int32_t *n_out, int32_t max_n)
{
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    int32_t vn = rp_lua_view_length(L, idx);
    if (vn >= 0) {
        if (vn > max_n) rp_lua_error(L, "%s has %d entries, more than the %d allowed", what, vn, max_n);
        double *v = lua_newuserdata(L, ((size_t)vn + 1) * sizeof *v);
        rp_lua_view_to_doubles(L, idx, v);
        rp_lua_charge(L, vn);
        *n_out = vn;
        return v;
    }
    if (lua_type(L, idx) != LUA_TTABLE)
        rp_lua_error(L, "%s must be a list of numbers or a view, got %s", what, luaL_typename(L, idx));
    size_t len = lua_objlen(L, idx);
    if (len > (size_t)max_n)
        rp_lua_error(L, "%s has %zu entries, more than the %d allowed", what, len, max_n);
    int32_t n = (int32_t)len;
    rp_lua_charge(L, n);
    double *v = lua_newuserdata(L, ((size_t)n + 1) * sizeof *v);
    for (int32_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        if (lua_type(L, -1) != LUA_TNUMBER)
            rp_lua_error(L, "%s[%d] must be a number, got %s", what, i + 1, luaL_typename(L, -1));
        v[i] = lua_tonumber(L, -1);
        lua_pop(L, 1);
    }
    *n_out = n;
    return v;
}
