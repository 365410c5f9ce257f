/* The `rp` table policies call: the C primitives (sorting, LPT, Karmarkar-Karp,
 * two-criteria partitioning, replicas, placement), baselines, plan evaluation and local
 * search, each bounded in its input sizes and charging its work to the sandbox. */
#include "cost_internal.h"
#include "limits_internal.h"
#include "lua_api.h"
#include "utf8_internal.h"

#include "routepack/baseline.h"
#include "routepack/joint.h"
#include "routepack/primitives.h"

#include <lauxlib.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Largest inputs a primitive accepts from a policy: far beyond any real batch, small
 * enough that no single call runs for long where no hook can fire. */
#define MAX_ITEMS (1 << 24)
#define MAX_PARTS (1 << 16)
#define MAX_EXPERTS (1 << 16)
#define MAX_EVALUATIONS INT64_C(100000000)
#define MAX_ROUNDS 100000
/* Worst-case elementary steps one two-criteria call may take (rounds x n x (n + k)). */
#define MAX_PARTITION2_STEPS 1e10

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

static double check_num(lua_State *L, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        return rp_lua_error(L, "%s must be a number, got %s", what, luaL_typename(L, idx));
    return lua_tonumber(L, idx);
}

static bool check_bool(lua_State *L, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TBOOLEAN)
        return rp_lua_error(L, "%s must be a boolean, got %s", what, luaL_typename(L, idx));
    return lua_toboolean(L, idx);
}

/* Keys in a deterministic order for messages: numbers ascending, then strings. */
static bool key_before(lua_State *L, int a, int b)
{
    int ta = lua_type(L, a), tb = lua_type(L, b);
    if (ta != tb) return ta == LUA_TNUMBER || (ta == LUA_TSTRING && tb != LUA_TNUMBER);
    if (ta == LUA_TNUMBER) return lua_tonumber(L, a) < lua_tonumber(L, b);
    if (ta == LUA_TSTRING) {
        size_t la, lb;
        const char *sa = lua_tolstring(L, a, &la), *sb = lua_tolstring(L, b, &lb);
        int c = memcmp(sa, sb, la < lb ? la : lb);
        return c < 0 || (c == 0 && la < lb);
    }
    return false;
}

static bool known_key(lua_State *L, int idx, const char *const *known)
{
    if (lua_type(L, idx) != LUA_TSTRING) return false;
    const char *k = lua_tostring(L, idx);
    for (size_t i = 0; known[i]; i++)
        if (strcmp(k, known[i]) == 0) return true;
    return false;
}

static void describe_key(lua_State *L, int idx, char *buf, size_t n)
{
    if (lua_type(L, idx) == LUA_TSTRING) snprintf(buf, n, "'%s'", lua_tostring(L, idx));
    else if (lua_type(L, idx) == LUA_TNUMBER) snprintf(buf, n, "%.17g", lua_tonumber(L, idx));
    else snprintf(buf, n, "of type %s", luaL_typename(L, idx));
}

/* The unknown key reported is the first in key_before's order, so every rank and run
 * gives the same message whatever order lua_next visits the table in. */
void rp_lua_check_opts(lua_State *L, int idx, const char *fname, const char *const *known)
{
    if (lua_isnoneornil(L, idx)) return;
    if (lua_type(L, idx) != LUA_TTABLE)
        rp_lua_error(L, "%s: the options must be a table, got %s", fname, luaL_typename(L, idx));
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    int worst = 0;
    int64_t keys = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        keys++;
        if (known_key(L, -1, known)) continue;
        if (!worst) {
            lua_pushvalue(L, -1);
            lua_insert(L, -2);
            worst = lua_gettop(L) - 1;
        } else if (key_before(L, -1, worst)) {
            lua_pushvalue(L, -1);
            lua_replace(L, worst);
        }
    }
    rp_lua_charge(L, keys);
    if (!worst) return;
    char key[96], list[256];
    describe_key(L, worst, key, sizeof key);
    size_t used = 0;
    list[0] = '\0';
    for (size_t i = 0; known[i] && used < sizeof list; i++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", known[i]);
    rp_lua_error(L, "%s: unknown option %s (options: %s)", fname, key, list);
}

/* opts[key] pushed (nil when opts is absent); raw access, so no policy code runs. */
static int opt(lua_State *L, int opts, const char *key)
{
    if (lua_type(L, opts) != LUA_TTABLE) {
        lua_pushnil(L);
        return LUA_TNIL;
    }
    lua_pushstring(L, key);
    lua_rawget(L, opts);
    return lua_type(L, -1);
}

/* A list or a view of numbers as a C array, in a userdata pushed on the stack (so the
 * collector frees it whatever happens). Lists are 1-based (element i is item i-1),
 * views 0-based. */
static double *read_vector(lua_State *L, int idx, const char *what, int32_t *n_out, int32_t max_n)
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

static int32_t *read_ints(lua_State *L, int idx, const char *what, int32_t *n_out, int32_t max_n,
                          int32_t lo, int32_t hi)
{
    int32_t n;
    double *d = read_vector(L, idx, what, &n, max_n);
    int32_t *v = lua_newuserdata(L, ((size_t)n + 1) * sizeof *v);
    for (int32_t i = 0; i < n; i++) {
        if (d[i] != floor(d[i]) || d[i] < lo || d[i] > hi)
            rp_lua_error(L, "%s[%d] must be an integer within %d..%d, got %.17g", what, i + 1, lo, hi, d[i]);
        v[i] = (int32_t)d[i];
    }
    lua_remove(L, -2);
    *n_out = n;
    return v;
}

static int64_t log2_ceil(int64_t n)
{
    int64_t b = 0;
    while (b < 62 && (INT64_C(1) << b) < n) b++;
    return b;
}

static int64_t sort_units(int64_t n) { return n * (log2_ceil(n) + 1); }

/* Push parts as a list of k lists of item ids (ascending within a part). */
static void push_parts(lua_State *L, const int32_t *part, int32_t n, int32_t k)
{
    int32_t *count = lua_newuserdata(L, ((size_t)k + 1) * sizeof *count);
    memset(count, 0, ((size_t)k + 1) * sizeof *count);
    for (int32_t i = 0; i < n; i++) count[part[i]]++;
    lua_createtable(L, k, 0);
    int parts = lua_gettop(L);
    for (int32_t p = 0; p < k; p++) {
        lua_createtable(L, count[p], 0);
        lua_rawseti(L, parts, p + 1);
        count[p] = 0;
    }
    for (int32_t i = 0; i < n; i++) {
        lua_rawgeti(L, parts, part[i] + 1);
        lua_pushinteger(L, i);
        lua_rawseti(L, -2, ++count[part[i]]);
        lua_pop(L, 1);
    }
    lua_remove(L, -2);
}

static void push_ids(lua_State *L, const int32_t *ids, int32_t n)
{
    lua_createtable(L, n, 0);
    for (int32_t i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

/* ---- sorting ------------------------------------------------------------------------ */

static int l_argsort(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.argsort");
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *v = read_vector(L, 1, "rp.argsort: values", &n, MAX_ITEMS);
    bool desc = lua_isnoneornil(L, 2) ? false : check_bool(L, 2, "rp.argsort: desc");
    rp_lua_charge(L, sort_units(n));
    int32_t *idx = lua_newuserdata(L, ((size_t)n + 1) * sizeof *idx);
    rp_error err;
    rp_status st = rp_sort_index(&h->plan_ctx, v, n, desc, idx, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.argsort", st, &err);
    push_ids(L, idx, n);
    return 1;
}

static int l_topk(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.topk");
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *v = read_vector(L, 1, "rp.topk: values", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.topk: k", 1, n > 0 ? n : 1);
    rp_lua_charge(L, n * (log2_ceil(k) + 1));
    int32_t *idx = lua_newuserdata(L, ((size_t)k + 1) * sizeof *idx);
    rp_error err;
    rp_status st = rp_sort_topk(&h->plan_ctx, v, n, k, idx, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.topk", st, &err);
    push_ids(L, idx, k);
    return 1;
}

/* ---- partitioning ------------------------------------------------------------------- */

/* Read the limits shared by lpt, kk and partition2 from opts (stack index `opts`); the
 * arrays they point at stay on the stack. */
static void read_part_limits(lua_State *L, int opts, const char *fname, int32_t n, int32_t k,
                             bool speeds_allowed, rp_part_limits *lim)
{
    char what[96];
    memset(lim, 0, sizeof *lim);
    if (opt(L, opts, "sizes") != LUA_TNIL) {
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.sizes", fname);
        lim->size = read_vector(L, -1, what, &m, MAX_ITEMS);
        if (m != n) rp_lua_error(L, "%s has %d entries, but there are %d items", what, m, n);
    } else {
        lua_pushnil(L);
    }
    bool have_cap = opt(L, opts, "cap") != LUA_TNIL;
    if (have_cap) {
        snprintf(what, sizeof what, "%s: opts.cap", fname);
        lim->size_cap = check_num(L, -1, what);
    }
    if (opt(L, opts, "caps") != LUA_TNIL) {
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.caps", fname);
        lim->part_size_cap = read_vector(L, -1, what, &m, MAX_PARTS);
        if (m != k) rp_lua_error(L, "%s has %d entries, but there are %d parts", what, m, k);
        if (have_cap) rp_lua_error(L, "%s: give opts.cap or opts.caps, not both", fname);
    } else {
        lua_pushnil(L);
    }
    if ((have_cap || lim->part_size_cap) && !lim->size)
        rp_lua_error(L, "%s: a size cap needs opts.sizes", fname);
    if (lim->size && !have_cap && !lim->part_size_cap)
        rp_lua_error(L, "%s: opts.sizes needs opts.cap or opts.caps", fname);
    if (opt(L, opts, "max_items") != LUA_TNIL) {
        snprintf(what, sizeof what, "%s: opts.max_items", fname);
        lim->max_items = (int32_t)rp_lua_check_int(L, -1, what, 0, MAX_ITEMS);
    }
    lua_pop(L, 1);
    if (opt(L, opts, "speeds") != LUA_TNIL) {
        if (!speeds_allowed) rp_lua_error(L, "%s: opts.speeds is not supported (use rp.lpt)", fname);
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.speeds", fname);
        lim->speed = read_vector(L, -1, what, &m, MAX_PARTS);
        if (m != k) rp_lua_error(L, "%s has %d entries, but there are %d parts", what, m, k);
    } else {
        lua_pushnil(L);
    }
    (void)have_cap;
}

static int l_lpt(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.lpt");
    static const char *const known[] = {"sizes", "cap", "caps", "max_items", "speeds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *w = read_vector(L, 1, "rp.lpt: weights", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.lpt: k", 1, MAX_PARTS);
    rp_lua_check_opts(L, 3, "rp.lpt", known);
    rp_part_limits lim;
    read_part_limits(L, 3, "rp.lpt", n, k, true, &lim);
    bool linear = lim.size || lim.speed || lim.max_items;
    rp_lua_charge(L, sort_units(n) + (linear ? (int64_t)n * k : n * (log2_ceil(k) + 1)));
    int32_t *part = lua_newuserdata(L, ((size_t)n + 1) * sizeof *part);
    rp_error err;
    rp_status st = rp_partition_lpt(&h->plan_ctx, w, n, k, &lim, part, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.lpt", st, &err);
    push_parts(L, part, n, k);
    return 1;
}

static int l_kk(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.kk");
    static const char *const known[] = {"equal_size", "sizes", "cap", "caps", "max_items", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *w = read_vector(L, 1, "rp.kk: weights", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.kk: k", 1, MAX_PARTS);
    rp_lua_check_opts(L, 3, "rp.kk", known);
    bool equal = false;
    if (opt(L, 3, "equal_size") != LUA_TNIL) equal = check_bool(L, -1, "rp.kk: opts.equal_size");
    lua_pop(L, 1);
    rp_part_limits lim;
    read_part_limits(L, 3, "rp.kk", n, k, false, &lim);
    int64_t units = sort_units(n) + (int64_t)n * k * (log2_ceil(k) + 1);
    if (lim.size || lim.max_items) units += equal ? (int64_t)n * n : sort_units(n) + (int64_t)n * k;
    rp_lua_charge(L, units);
    int32_t *part = lua_newuserdata(L, ((size_t)n + 1) * sizeof *part);
    rp_error err;
    rp_status st = rp_partition_kk(&h->plan_ctx, w, n, k, equal, &lim, part, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.kk", st, &err);
    push_parts(L, part, n, k);
    return 1;
}

static int l_partition2(lua_State *L)
{
    lua_settop(L, 4); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.partition2");
    static const char *const known[] = {"sizes", "cap", "caps", "max_items", "speeds", "rounds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n, n2;
    double *w1 = read_vector(L, 1, "rp.partition2: w1", &n, MAX_ITEMS);
    double *w2 = read_vector(L, 2, "rp.partition2: w2", &n2, MAX_ITEMS);
    if (n2 != n) rp_lua_error(L, "rp.partition2: w1 has %d entries but w2 has %d", n, n2);
    int32_t k = (int32_t)rp_lua_check_int(L, 3, "rp.partition2: k", 1, MAX_PARTS);
    rp_lua_check_opts(L, 4, "rp.partition2", known);
    int32_t rounds = 10;
    if (opt(L, 4, "rounds") != LUA_TNIL)
        rounds = (int32_t)rp_lua_check_int(L, -1, "rp.partition2: opts.rounds", 0, MAX_ROUNDS);
    lua_pop(L, 1);
    /* A round scans the worst part's items against every other item; bound the worst
     * case so that no call can run for minutes, and charge the typical case. */
    double worst = (double)rounds * (double)n * ((double)n + k);
    if (worst > MAX_PARTITION2_STEPS)
        rp_lua_error(L, "rp.partition2: %d rounds on %d items and %d parts could take %.3g steps, more than the "
                     "%.3g allowed per call; use fewer rounds",
                     rounds, n, k, worst, MAX_PARTITION2_STEPS);
    rp_part_limits lim;
    read_part_limits(L, 4, "rp.partition2", n, k, true, &lim);
    int64_t per_part = 2 * ((int64_t)n / k) + 1;
    rp_lua_charge(L, sort_units(n) + (int64_t)n * k + (int64_t)rounds * per_part * ((int64_t)n + k));
    int32_t *part = lua_newuserdata(L, ((size_t)n + 1) * sizeof *part);
    double objective = 0;
    rp_error err;
    rp_status st = rp_partition_two_criteria(&h->plan_ctx, w1, w2, n, k, &lim, rounds, part, &objective, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.partition2", st, &err);
    push_parts(L, part, n, k);
    lua_pushnumber(L, objective);
    return 2;
}

/* ---- replicas and placement ---------------------------------------------------------- */

static int l_replicas(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.replicas");
    static const char *const known[] = {"max_replicas", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t E;
    double *load = read_vector(L, 1, "rp.replicas: loads", &E, MAX_EXPERTS);
    int32_t slots = (int32_t)rp_lua_check_int(L, 2, "rp.replicas: slots", 1, (int64_t)MAX_EXPERTS * 64);
    rp_lua_check_opts(L, 3, "rp.replicas", known);
    int32_t max_rep = 0;
    if (opt(L, 3, "max_replicas") != LUA_TNIL)
        max_rep = (int32_t)rp_lua_check_int(L, -1, "rp.replicas: opts.max_replicas", 0, MAX_EXPERTS);
    lua_pop(L, 1);
    rp_lua_charge(L, E + (int64_t)(slots > E ? slots - E : 0) * (log2_ceil(E) + 1));
    int32_t *counts = lua_newuserdata(L, ((size_t)E + 1) * sizeof *counts);
    rp_error err;
    rp_status st = rp_replicas_apportion(&h->plan_ctx, load, E, slots, max_rep, counts, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.replicas", st, &err);
    push_ids(L, counts, E);
    return 1;
}

static int l_place(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.place");
    static const char *const known[] = {"mode", "groups", "improve_rounds", "speeds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_topology *t = rp_config_topology(h->cfg);
    const int32_t ep = t->ep_size;
    int32_t E;
    double *load = read_vector(L, 1, "rp.place: loads", &E, MAX_EXPERTS);
    const int32_t *counts = NULL;
    if (!lua_isnoneornil(L, 2)) {
        int32_t m;
        counts = read_ints(L, 2, "rp.place: counts", &m, MAX_EXPERTS, 1, ep);
        if (m != E) rp_lua_error(L, "rp.place: counts has %d entries, but loads has %d", m, E);
    } else {
        lua_pushnil(L);
    }
    rp_lua_check_opts(L, 3, "rp.place", known);
    rp_place_input in;
    memset(&in, 0, sizeof in);
    in.num_experts = E;
    in.load = load;
    in.replicas = counts;
    in.num_gpus = ep;
    in.slots = t->slots; /* EP rank j of every group has GPU j's slot count */
    in.mode = RP_PLACE_GLOBAL;
    int32_t nodes = ep % t->gpus_per_node == 0 ? ep / t->gpus_per_node : 1;
    in.gpus_per_node = ep / nodes;
    in.num_groups = 0;
    if (opt(L, 3, "mode") != LUA_TNIL) {
        const char *mode = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
        if (strcmp(mode, "hierarchical") == 0) in.mode = RP_PLACE_HIERARCHICAL;
        else if (strcmp(mode, "global") != 0)
            rp_lua_error(L, "rp.place: opts.mode must be \"global\" or \"hierarchical\", got %s",
                         lua_type(L, -1) == LUA_TSTRING ? mode : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    if (opt(L, 3, "groups") != LUA_TNIL)
        in.num_groups = (int32_t)rp_lua_check_int(L, -1, "rp.place: opts.groups", 1, E > 0 ? E : 1);
    lua_pop(L, 1);
    if (in.mode == RP_PLACE_HIERARCHICAL && in.num_groups == 0)
        rp_lua_error(L, "rp.place: the hierarchical mode needs opts.groups (expert groups)");
    if (opt(L, 3, "improve_rounds") != LUA_TNIL)
        in.improve_rounds = (int32_t)rp_lua_check_int(L, -1, "rp.place: opts.improve_rounds", 0, 10000);
    lua_pop(L, 1);
    if (opt(L, 3, "speeds") != LUA_TNIL) {
        int32_t m;
        in.speed = read_vector(L, -1, "rp.place: opts.speeds", &m, MAX_PARTS);
        if (m != ep) rp_lua_error(L, "rp.place: opts.speeds has %d entries, but an EP group has %d GPUs", m, ep);
    }
    int32_t S = h->slot_begin[ep], smax = 0;
    for (int32_t j = 0; j < ep; j++) smax = t->slots[j] > smax ? t->slots[j] : smax;
    int64_t R = S > E ? S : E;
    rp_lua_charge(L, sort_units(R) + R * ep + (int64_t)E * (log2_ceil(E) + 1) +
                         (int64_t)in.improve_rounds * smax * smax * ep);
    int32_t *begin = lua_newuserdata(L, ((size_t)ep + 1) * sizeof *begin);
    int32_t *phy2log = lua_newuserdata(L, ((size_t)S + 1) * sizeof *phy2log);
    int32_t *used = lua_newuserdata(L, ((size_t)E + 1) * sizeof *used);
    rp_error err;
    rp_status st = rp_place_replicas(&h->plan_ctx, &in, begin, phy2log, used, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.place", st, &err);
    lua_createtable(L, ep, 0);
    for (int32_t j = 0; j < ep; j++) {
        int32_t m = 0;
        while (m < begin[j + 1] - begin[j] && phy2log[begin[j] + m] >= 0) m++;
        push_ids(L, phy2log + begin[j], m);
        lua_rawseti(L, -2, j + 1);
    }
    push_ids(L, used, E);
    return 2;
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

static const char *side_name(rp_side s)
{
    switch (s) {
    case RP_SIDE_ATTENTION: return "attention";
    case RP_SIDE_DISPATCH: return "dispatch";
    case RP_SIDE_EXPERT: return "expert";
    default: return "combine";
    }
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
    lua_pushstring(L, side_name(s->straggler_side));
    lua_setfield(L, -2, "straggler_side");
}

int64_t rp_lua_expected_microbatches(const rp_config *cfg, const rp_batch *b)
{
    /* what a plan runs: the fixed count, or the fewest the caps and the trainer's
     * mini-batches and microbatch multiple allow (the joint planner's first try) */
    int32_t fixed = rp_config_limits(cfg)->num_microbatches;
    return fixed > 0 ? fixed : rp_limits_least_microbatches(cfg, rp_batch_num_tokens(b));
}

int64_t rp_lua_evaluation_units(const rp_config *cfg, const rp_batch *b)
{
    /* a plan of the expected microbatches over the topology's slots (rp_plan_new counts
     * an EP group's from its EP ranks'), priced as rp_cost_evaluation_needs prices it */
    const rp_topology *t = rp_config_topology(cfg);
    int64_t slots = 0;
    for (int32_t j = 0; j < t->ep_size; j++) slots += t->slots[j];
    return cost_work_units(cfg, b, rp_lua_expected_microbatches(cfg, b), slots);
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

/* Experts that arrive on an EP rank that did not hold them (per layer, any EP group). */
static int32_t experts_moved(const rp_plan *from, const rp_plan *to, uint8_t *held, int32_t E)
{
    int32_t moved = 0, Ly = rp_plan_num_layers(to), ep = rp_plan_ep_size(to);
    const int32_t *begin = rp_plan_slot_begin(to);
    for (int32_t l = 0; l < Ly; l++) {
        const int32_t *a = rp_plan_phy2log(from, l), *b = rp_plan_phy2log(to, l);
        for (int32_t j = 0; j < ep; j++) {
            memset(held, 0, (size_t)E);
            for (int32_t s = begin[j]; s < begin[j + 1]; s++)
                if (a[s] >= 0) held[a[s]] = 1;
            for (int32_t s = begin[j]; s < begin[j + 1]; s++)
                if (b[s] >= 0 && !held[b[s]]) {
                    held[b[s]] = 1;
                    moved++;
                }
        }
    }
    return moved;
}

int32_t rp_lua_experts_moved(rp_context *ctx, const rp_plan *from, const rp_plan *to)
{
    if (!from || !to || !rp_plan_has_placement(from) || !rp_plan_has_placement(to)) return 0;
    int32_t E = rp_plan_num_experts(to);
    uint8_t *held = rp_alloc(ctx, (size_t)E + 1);
    if (!held) return -1;
    int32_t moved = experts_moved(from, to, held, E);
    rp_free(ctx, held);
    return moved;
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
    int32_t moved = experts_moved(f->placement, p, held, E);
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
    if (opt(L, 2, "num_microbatches") != LUA_TNIL)
        M = (int32_t)rp_lua_check_int(L, -1, "rp.baseline: opts.num_microbatches", 0, MAX_PARTS);
    lua_pop(L, 1);
    reclaim(L, h);
    const rp_model *md = rp_config_model(h->cfg);
    int64_t n = rp_batch_num_seqs(f->batch), G = rp_config_topology(h->cfg)->num_gpus;
    rp_lua_charge(L, 4 * sort_units(n) + n * G +
                         (int64_t)md->num_layers * (md->num_experts * (log2_ceil(md->num_experts) + 1) +
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
    if (opt(L, 2, "num_microbatches") != LUA_TNIL)
        M = (int32_t)rp_lua_check_int(L, -1, "rp.kk_packing: opts.num_microbatches", 0, MAX_PARTS);
    lua_pop(L, 1);
    bool equal_size = true;
    if (opt(L, 2, "equal_size") != LUA_TNIL) {
        if (!lua_isboolean(L, -1))
            return rp_lua_error(L, "rp.kk_packing: opts.equal_size must be a boolean, got %s", luaL_typename(L, -1));
        equal_size = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    reclaim(L, h);
    int64_t n = rp_batch_num_seqs(f->batch), G = rp_config_topology(h->cfg)->num_gpus;
    rp_lua_charge(L, 4 * sort_units(n) + n * G);
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
    if (opt(L, 2, "evaluations") != LUA_TNIL)
        sp.max_evaluations = rp_lua_check_int(L, -1, "rp.local_search: opts.evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (opt(L, 2, "sample") != LUA_TNIL)
        sp.sample = (int32_t)rp_lua_check_int(L, -1, "rp.local_search: opts.sample", 1, 4096);
    lua_pop(L, 1);
    if (opt(L, 2, "seed") != LUA_TNIL)
        sp.seed = (uint64_t)rp_lua_check_int(L, -1, "rp.local_search: opts.seed", 0, INT64_C(1) << 53);
    lua_pop(L, 1);
    if (opt(L, 2, "moves") != LUA_TNIL) sp.moves = check_bool(L, -1, "rp.local_search: opts.moves");
    lua_pop(L, 1);
    if (opt(L, 2, "swaps") != LUA_TNIL) sp.swaps = check_bool(L, -1, "rp.local_search: opts.swaps");
    lua_pop(L, 1);
    if (opt(L, 2, "slots") != LUA_TNIL) sp.slots = check_bool(L, -1, "rp.local_search: opts.slots");
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
    if (opt(L, 1, "persistence") != LUA_TNIL) {
        d.persistence = check_num(L, -1, "rp.decision: persistence");
        if (!(d.persistence >= 0 && d.persistence <= 1))
            rp_lua_error(L, "rp.decision: persistence must be within [0, 1], got %g", d.persistence);
    }
    lua_pop(L, 1);
    if (opt(L, 1, "observations") != LUA_TNIL)
        d.observations = (int32_t)rp_lua_check_int(L, -1, "rp.decision: observations", 0, INT32_MAX);
    lua_pop(L, 1);
    if (opt(L, 1, "predicted_saving_s") != LUA_TNIL)
        d.predicted_saving_s = check_num(L, -1, "rp.decision: predicted_saving_s");
    lua_pop(L, 1);
    if (opt(L, 1, "realised_saving_s") != LUA_TNIL) {
        d.realised_saving_s = check_num(L, -1, "rp.decision: realised_saving_s");
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
    if (opt(L, 1, "num_microbatches") != LUA_TNIL)
        par.num_microbatches = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.num_microbatches", 0, MAX_PARTS);
    lua_pop(L, 1);
    if (opt(L, 1, "pack") != LUA_TNIL) par.pack = check_bool(L, -1, "rp.joint: opts.pack");
    lua_pop(L, 1);
    if (opt(L, 1, "place") != LUA_TNIL) par.place = check_bool(L, -1, "rp.joint: opts.place");
    lua_pop(L, 1);
    if (opt(L, 1, "prompt_spread") != LUA_TNIL) par.prompt_spread = check_num(L, -1, "rp.joint: opts.prompt_spread");
    lua_pop(L, 1);
    if (opt(L, 1, "balance_evaluations") != LUA_TNIL)
        par.balance_evaluations =
            rp_lua_check_int(L, -1, "rp.joint: opts.balance_evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (opt(L, 1, "place_rounds") != LUA_TNIL)
        par.place_rounds = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.place_rounds", 0, MAX_ROUNDS);
    lua_pop(L, 1);
    if (opt(L, 1, "shares") != LUA_TNIL) par.shares = check_bool(L, -1, "rp.joint: opts.shares");
    lua_pop(L, 1);
    if (opt(L, 1, "max_extra_per_rank") != LUA_TNIL)
        par.max_extra_per_rank = (int32_t)rp_lua_check_int(L, -1, "rp.joint: opts.max_extra_per_rank", 0, 64);
    lua_pop(L, 1);
    if (opt(L, 1, "horizon") != LUA_TNIL) par.horizon_steps = check_num(L, -1, "rp.joint: opts.horizon");
    lua_pop(L, 1);
    if (opt(L, 1, "persistence") != LUA_TNIL) par.persistence = check_num(L, -1, "rp.joint: opts.persistence");
    lua_pop(L, 1);
    if (opt(L, 1, "refine_evaluations") != LUA_TNIL)
        par.refine_evaluations = rp_lua_check_int(L, -1, "rp.joint: opts.refine_evaluations", 0, MAX_EVALUATIONS);
    lua_pop(L, 1);
    if (opt(L, 1, "virtual_experts") != LUA_TNIL)
        par.virtual_experts = check_bool(L, -1, "rp.joint: opts.virtual_experts");
    lua_pop(L, 1);
    if (opt(L, 1, "relabel") != LUA_TNIL) par.relabel = check_bool(L, -1, "rp.joint: opts.relabel");
    lua_pop(L, 1);
    if (opt(L, 1, "recurring_migration_s") != LUA_TNIL)
        par.recurring_migration_s = check_num(L, -1, "rp.joint: opts.recurring_migration_s");
    lua_pop(L, 1);
    if (opt(L, 1, "fallback_above_ratio") != LUA_TNIL)
        par.fallback_above_ratio = check_num(L, -1, "rp.joint: opts.fallback_above_ratio");
    lua_pop(L, 1);
    if (opt(L, 1, "balancer_first") != LUA_TNIL) par.balancer_first = check_bool(L, -1, "rp.joint: opts.balancer_first");
    lua_pop(L, 1);
    /* fallbacks: a list of baseline names (the strings stay alive in opts meanwhile) */
    int32_t num_fallbacks = 4; /* rp_joint_defaults' list */
    if (opt(L, 1, "fallbacks") != LUA_TNIL) {
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
    if (opt(L, 1, "expected_loads") != LUA_TNIL) {
        int32_t want = md->num_layers * md->num_experts, got;
        par.expected_loads = read_vector(L, -1, "rp.joint: opts.expected_loads", &got, want);
        if (got != want)
            rp_lua_error(L, "rp.joint: opts.expected_loads has %d entries, must have num_layers x num_experts = %d",
                         got, want);
    } else {
        lua_pushnil(L); /* keep the stack shape */
    }
    /* work: the construction reads every histogram about once; the fallback check builds
     * and evaluates each baseline and the joint candidate; refinement as rp.local_search */
    const rp_topology *t = rp_config_topology(h->cfg);
    int64_t n = rp_batch_num_seqs(f->batch), M = rp_lua_expected_microbatches(h->cfg, f->batch);
    int64_t eval = rp_lua_evaluation_units(h->cfg, f->batch);
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
    rp_lua_charge(L, evaluations + placement + (int64_t)num_fallbacks * 4 * sort_units(n) +
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
    {"argsort", l_argsort},
    {"topk", l_topk},
    {"lpt", l_lpt},
    {"kk", l_kk},
    {"partition2", l_partition2},
    {"replicas", l_replicas},
    {"place", l_place},
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
