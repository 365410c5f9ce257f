/* The C primitives of the `rp` table: sorting (rp.argsort, rp.topk), partitioning
 * (rp.lpt, rp.kk, rp.partition2), replica counts (rp.replicas) and placement
 * (rp.place), each bounded in its input sizes and charging its work to the sandbox
 * before it runs. core/lua_api.c registers them. */
#include "lua_api.h"

#include "routepack/primitives.h"

#include <lauxlib.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Largest inputs a primitive accepts from a policy: far beyond any real batch, small
 * enough that no single call runs for long where no hook can fire. */
#define MAX_ITEMS (1 << 24)
#define MAX_EXPERTS (1 << 16)
/* Worst-case elementary steps one two-criteria call may take (rounds x n x (n + k)). */
#define MAX_PARTITION2_STEPS 1e10

static int32_t *read_ints(lua_State *L, int idx, const char *what, int32_t *n_out, int32_t max_n,
                          int32_t lo, int32_t hi)
{
    int32_t n;
    double *d = rp_lua_read_vector(L, idx, what, &n, max_n);
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

int rp_lua_argsort(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.argsort");
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *v = rp_lua_read_vector(L, 1, "rp.argsort: values", &n, MAX_ITEMS);
    bool desc = lua_isnoneornil(L, 2) ? false : rp_lua_check_bool(L, 2, "rp.argsort: desc");
    rp_lua_charge(L, rp_lua_sort_units(n));
    int32_t *idx = lua_newuserdata(L, ((size_t)n + 1) * sizeof *idx);
    rp_error err;
    rp_status st = rp_sort_index(&h->plan_ctx, v, n, desc, idx, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.argsort", st, &err);
    push_ids(L, idx, n);
    return 1;
}

int rp_lua_topk(lua_State *L)
{
    lua_settop(L, 2); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.topk");
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *v = rp_lua_read_vector(L, 1, "rp.topk: values", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.topk: k", 1, n > 0 ? n : 1);
    rp_lua_charge(L, n * (rp_lua_log2_ceil(k) + 1));
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
    if (rp_lua_opt(L, opts, "sizes") != LUA_TNIL) {
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.sizes", fname);
        lim->size = rp_lua_read_vector(L, -1, what, &m, MAX_ITEMS);
        if (m != n) rp_lua_error(L, "%s has %d entries, but there are %d items", what, m, n);
    } else {
        lua_pushnil(L);
    }
    bool have_cap = rp_lua_opt(L, opts, "cap") != LUA_TNIL;
    if (have_cap) {
        snprintf(what, sizeof what, "%s: opts.cap", fname);
        lim->size_cap = rp_lua_check_num(L, -1, what);
    }
    if (rp_lua_opt(L, opts, "caps") != LUA_TNIL) {
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.caps", fname);
        lim->part_size_cap = rp_lua_read_vector(L, -1, what, &m, RP_LUA_MAX_PARTS);
        if (m != k) rp_lua_error(L, "%s has %d entries, but there are %d parts", what, m, k);
        if (have_cap) rp_lua_error(L, "%s: give opts.cap or opts.caps, not both", fname);
    } else {
        lua_pushnil(L);
    }
    if ((have_cap || lim->part_size_cap) && !lim->size)
        rp_lua_error(L, "%s: a size cap needs opts.sizes", fname);
    if (lim->size && !have_cap && !lim->part_size_cap)
        rp_lua_error(L, "%s: opts.sizes needs opts.cap or opts.caps", fname);
    if (rp_lua_opt(L, opts, "max_items") != LUA_TNIL) {
        snprintf(what, sizeof what, "%s: opts.max_items", fname);
        lim->max_items = (int32_t)rp_lua_check_int(L, -1, what, 0, MAX_ITEMS);
    }
    lua_pop(L, 1);
    if (rp_lua_opt(L, opts, "speeds") != LUA_TNIL) {
        if (!speeds_allowed) rp_lua_error(L, "%s: opts.speeds is not supported (use rp.lpt)", fname);
        int32_t m;
        snprintf(what, sizeof what, "%s: opts.speeds", fname);
        lim->speed = rp_lua_read_vector(L, -1, what, &m, RP_LUA_MAX_PARTS);
        if (m != k) rp_lua_error(L, "%s has %d entries, but there are %d parts", what, m, k);
    } else {
        lua_pushnil(L);
    }
    (void)have_cap;
}

int rp_lua_lpt(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.lpt");
    static const char *const known[] = {"sizes", "cap", "caps", "max_items", "speeds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *w = rp_lua_read_vector(L, 1, "rp.lpt: weights", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.lpt: k", 1, RP_LUA_MAX_PARTS);
    rp_lua_check_opts(L, 3, "rp.lpt", known);
    rp_part_limits lim;
    read_part_limits(L, 3, "rp.lpt", n, k, true, &lim);
    bool linear = lim.size || lim.speed || lim.max_items;
    rp_lua_charge(L, rp_lua_sort_units(n) + (linear ? (int64_t)n * k : n * (rp_lua_log2_ceil(k) + 1)));
    int32_t *part = lua_newuserdata(L, ((size_t)n + 1) * sizeof *part);
    rp_error err;
    rp_status st = rp_partition_lpt(&h->plan_ctx, w, n, k, &lim, part, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.lpt", st, &err);
    push_parts(L, part, n, k);
    return 1;
}

int rp_lua_kk(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.kk");
    static const char *const known[] = {"equal_size", "sizes", "cap", "caps", "max_items", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n;
    double *w = rp_lua_read_vector(L, 1, "rp.kk: weights", &n, MAX_ITEMS);
    int32_t k = (int32_t)rp_lua_check_int(L, 2, "rp.kk: k", 1, RP_LUA_MAX_PARTS);
    rp_lua_check_opts(L, 3, "rp.kk", known);
    bool equal = false;
    if (rp_lua_opt(L, 3, "equal_size") != LUA_TNIL) equal = rp_lua_check_bool(L, -1, "rp.kk: opts.equal_size");
    lua_pop(L, 1);
    rp_part_limits lim;
    read_part_limits(L, 3, "rp.kk", n, k, false, &lim);
    int64_t units = rp_lua_sort_units(n) + (int64_t)n * k * (rp_lua_log2_ceil(k) + 1);
    if (lim.size || lim.max_items) units += equal ? (int64_t)n * n : rp_lua_sort_units(n) + (int64_t)n * k;
    rp_lua_charge(L, units);
    int32_t *part = lua_newuserdata(L, ((size_t)n + 1) * sizeof *part);
    rp_error err;
    rp_status st = rp_partition_kk(&h->plan_ctx, w, n, k, equal, &lim, part, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.kk", st, &err);
    push_parts(L, part, n, k);
    return 1;
}

int rp_lua_partition2(lua_State *L)
{
    lua_settop(L, 4); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.partition2");
    static const char *const known[] = {"sizes", "cap", "caps", "max_items", "speeds", "rounds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t n, n2;
    double *w1 = rp_lua_read_vector(L, 1, "rp.partition2: w1", &n, MAX_ITEMS);
    double *w2 = rp_lua_read_vector(L, 2, "rp.partition2: w2", &n2, MAX_ITEMS);
    if (n2 != n) rp_lua_error(L, "rp.partition2: w1 has %d entries but w2 has %d", n, n2);
    int32_t k = (int32_t)rp_lua_check_int(L, 3, "rp.partition2: k", 1, RP_LUA_MAX_PARTS);
    rp_lua_check_opts(L, 4, "rp.partition2", known);
    int32_t rounds = 10;
    if (rp_lua_opt(L, 4, "rounds") != LUA_TNIL)
        rounds = (int32_t)rp_lua_check_int(L, -1, "rp.partition2: opts.rounds", 0, RP_LUA_MAX_ROUNDS);
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
    rp_lua_charge(L, rp_lua_sort_units(n) + (int64_t)n * k + (int64_t)rounds * per_part * ((int64_t)n + k));
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

int rp_lua_replicas(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.replicas");
    static const char *const known[] = {"max_replicas", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    int32_t E;
    double *load = rp_lua_read_vector(L, 1, "rp.replicas: loads", &E, MAX_EXPERTS);
    int32_t slots = (int32_t)rp_lua_check_int(L, 2, "rp.replicas: slots", 1, (int64_t)MAX_EXPERTS * 64);
    rp_lua_check_opts(L, 3, "rp.replicas", known);
    int32_t max_rep = 0;
    if (rp_lua_opt(L, 3, "max_replicas") != LUA_TNIL)
        max_rep = (int32_t)rp_lua_check_int(L, -1, "rp.replicas: opts.max_replicas", 0, MAX_EXPERTS);
    lua_pop(L, 1);
    rp_lua_charge(L, E + (int64_t)(slots > E ? slots - E : 0) * (rp_lua_log2_ceil(E) + 1));
    int32_t *counts = lua_newuserdata(L, ((size_t)E + 1) * sizeof *counts);
    rp_error err;
    rp_status st = rp_replicas_apportion(&h->plan_ctx, load, E, slots, max_rep, counts, &err);
    if (st != RP_OK) return rp_lua_fail(L, h, "rp.replicas", st, &err);
    push_ids(L, counts, E);
    return 1;
}

int rp_lua_place(lua_State *L)
{
    lua_settop(L, 3); /* fixed argument slots: scratch is pushed above them */
    luaL_checkstack(L, 40, "rp.place");
    static const char *const known[] = {"mode", "groups", "improve_rounds", "speeds", NULL};
    rp_lua_host *h = rp_lua_host_of(L);
    const rp_topology *t = rp_config_topology(h->cfg);
    const int32_t ep = t->ep_size;
    int32_t E;
    double *load = rp_lua_read_vector(L, 1, "rp.place: loads", &E, MAX_EXPERTS);
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
    if (rp_lua_opt(L, 3, "mode") != LUA_TNIL) {
        const char *mode = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
        if (strcmp(mode, "hierarchical") == 0) in.mode = RP_PLACE_HIERARCHICAL;
        else if (strcmp(mode, "global") != 0)
            rp_lua_error(L, "rp.place: opts.mode must be \"global\" or \"hierarchical\", got %s",
                         lua_type(L, -1) == LUA_TSTRING ? mode : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    if (rp_lua_opt(L, 3, "groups") != LUA_TNIL)
        in.num_groups = (int32_t)rp_lua_check_int(L, -1, "rp.place: opts.groups", 1, E > 0 ? E : 1);
    lua_pop(L, 1);
    if (in.mode == RP_PLACE_HIERARCHICAL && in.num_groups == 0)
        rp_lua_error(L, "rp.place: the hierarchical mode needs opts.groups (expert groups)");
    if (rp_lua_opt(L, 3, "improve_rounds") != LUA_TNIL)
        in.improve_rounds = (int32_t)rp_lua_check_int(L, -1, "rp.place: opts.improve_rounds", 0, 10000);
    lua_pop(L, 1);
    if (rp_lua_opt(L, 3, "speeds") != LUA_TNIL) {
        int32_t m;
        in.speed = rp_lua_read_vector(L, -1, "rp.place: opts.speeds", &m, RP_LUA_MAX_PARTS);
        if (m != ep) rp_lua_error(L, "rp.place: opts.speeds has %d entries, but an EP group has %d GPUs", m, ep);
    }
    int32_t S = h->slot_begin[ep], smax = 0;
    for (int32_t j = 0; j < ep; j++) smax = t->slots[j] > smax ? t->slots[j] : smax;
    int64_t R = S > E ? S : E;
    rp_lua_charge(L, rp_lua_sort_units(R) + R * ep + (int64_t)E * (rp_lua_log2_ceil(E) + 1) +
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
