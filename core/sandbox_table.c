/* The sandbox's table functions that LuaJIT implements in C with loops no hook can see:
 * table.insert, table.sort and unpack, each charged for its work before or while it does
 * it; sort also charges every comparison and reads the clock before every callback (a
 * comparator or an __lt metamethod). table.maxn is the prelude's (Lua, hooked); LuaJIT's
 * table.remove is Lua already. docs/sandbox.md,
 * "Every C function a policy can reach", lists them with their charges. */
#include "sandbox.h"

#include <lauxlib.h>

/* Bytes of two strings the default sort order compares for one unit (memcmp; the
 * library wrappers' scans use 4 bytes a unit, see sandbox_lib.c). */
#define COMPARE_BYTES_PER_UNIT 4

/* The first argument's length as table functions read it (the border #t). */
static int table_length(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    size_t n = lua_objlen(L, 1);
    if (n >= INT32_MAX) luaL_argerror(L, 1, "table too large");
    return (int)n;
}

/* table.insert with a bounded position (Lua 5.3's rule): LuaJIT's shifts from the end
 * down to any position, 2^31 steps for insert(t, -2^31, v) with no hook able to fire.
 * The shift is charged one unit per element moved. */
static int tab_insert(lua_State *L)
{
    int64_t e = (int64_t)table_length(L) + 1, pos;
    switch (lua_gettop(L)) {
    case 2: pos = e; break;
    case 3: {
        double at = luaL_checknumber(L, 2);
        luaL_argcheck(L, at >= 1 && at < (double)e + 1, 2, "position out of bounds");
        pos = (int64_t)at; /* truncated, as LuaJIT does */
        rp_sandbox_charge(L, e - pos);
        for (int64_t i = e; i > pos; i--) {
            lua_rawgeti(L, 1, (int)(i - 1));
            lua_rawseti(L, 1, (int)i);
        }
        break;
    }
    default: return luaL_error(L, "wrong number of arguments to 'insert'");
    }
    lua_rawseti(L, 1, (int)pos);
    return 0;
}

/* unpack(t [, i [, j]]) as Lua 5.1's, charged one unit per value before it pushes them
 * (at most 8000: LuaJIT's C stack limit). */
static int base_unpack(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    int i = luaL_optint(L, 2, 1);
    int e = lua_isnoneornil(L, 3) ? (int)lua_objlen(L, 1) : luaL_checkint(L, 3);
    if (i > e) return 0;
    int64_t n = (int64_t)e - i + 1;
    if (n >= INT32_MAX || !lua_checkstack(L, (int)n)) return luaL_error(L, "too many results to unpack");
    rp_sandbox_charge(L, n);
    for (int64_t k = i; k <= e; k++) lua_rawgeti(L, 1, (int)k);
    return (int)n;
}

/* ---- sort: Lua 5.1's auxsort (ltablib.c, MIT), the algorithm LuaJIT's table.sort runs,
 * so a consistent order sorts exactly as before; every comparison is charged. */

/* a < b for the values at stack indexes a and b (negative, relative to the top). */
static int sort_less(lua_State *L, int a, int b)
{
    if (!lua_isnil(L, 2)) { /* the comparator: a callback */
        rp_sandbox_charge_callback(L);
        lua_pushvalue(L, 2);
        lua_pushvalue(L, a - 1);
        lua_pushvalue(L, b - 2);
        lua_call(L, 2, 1);
        int less = lua_toboolean(L, -1);
        lua_pop(L, 1);
        return less;
    }
    int ta = lua_type(L, a), tb = lua_type(L, b);
    if (ta == LUA_TNUMBER && tb == LUA_TNUMBER) {
        rp_sandbox_charge(L, 1);
        return lua_tonumber(L, a) < lua_tonumber(L, b);
    }
    if (ta == LUA_TSTRING && tb == LUA_TSTRING) {
        size_t la = lua_objlen(L, a), lb = lua_objlen(L, b);
        rp_sandbox_charge(L, 1 + (int64_t)((la < lb ? la : lb) / COMPARE_BYTES_PER_UNIT));
        return lua_lessthan(L, a, b);
    }
    /* anything else runs an __lt metamethod (or raises): a callback */
    rp_sandbox_charge_callback(L);
    return lua_lessthan(L, a, b);
}

static void set2(lua_State *L, int i, int j)
{
    lua_rawseti(L, 1, i);
    lua_rawseti(L, 1, j);
}

static int order_error(lua_State *L)
{
    luaL_where(L, 2); /* level 1 is the prelude's wrapper */
    lua_pushliteral(L, "invalid order function for sorting");
    lua_concat(L, 2);
    return lua_error(L);
}

static void auxsort(lua_State *L, int l, int u)
{
    while (l < u) { /* the larger half loops, the smaller recurses: depth O(log n) */
        lua_rawgeti(L, 1, l);
        lua_rawgeti(L, 1, u);
        if (sort_less(L, -1, -2)) set2(L, l, u); /* a[u] < a[l] */
        else lua_pop(L, 2);
        if (u - l == 1) break;
        int i = l + (u - l) / 2, j;
        lua_rawgeti(L, 1, i);
        lua_rawgeti(L, 1, l);
        if (sort_less(L, -2, -1)) { /* a[i] < a[l] */
            set2(L, i, l);
        } else {
            lua_pop(L, 1);
            lua_rawgeti(L, 1, u);
            if (sort_less(L, -1, -2)) set2(L, i, u); /* a[u] < a[i] */
            else lua_pop(L, 2);
        }
        if (u - l == 2) break;
        lua_rawgeti(L, 1, i); /* the pivot */
        lua_pushvalue(L, -1);
        lua_rawgeti(L, 1, u - 1);
        set2(L, i, u - 1);
        i = l;
        j = u - 1;
        for (;;) { /* a[l..i] <= P <= a[j..u] */
            while (lua_rawgeti(L, 1, ++i), sort_less(L, -1, -2)) {
                if (i >= u) order_error(L);
                lua_pop(L, 1);
            }
            while (lua_rawgeti(L, 1, --j), sort_less(L, -3, -1)) {
                if (j <= l) order_error(L);
                lua_pop(L, 1);
            }
            if (j < i) {
                lua_pop(L, 3);
                break;
            }
            set2(L, i, j);
        }
        lua_rawgeti(L, 1, u - 1);
        lua_rawgeti(L, 1, i);
        set2(L, u - 1, i);
        if (i - l < u - i) {
            j = l;
            i = i - 1;
            l = i + 2;
        } else {
            j = i + 1;
            i = u;
            u = j - 2;
        }
        auxsort(L, j, i);
    }
}

/* table.sort's C part, called by the prelude's wrapper after its checks (types, the C
 * stack, no C comparator). */
static int tab_sort(lua_State *L)
{
    int n = table_length(L);
    luaL_checkstack(L, 40, "sort");
    lua_settop(L, 2);
    rp_sandbox_charge(L, n);
    auxsort(L, 1, n);
    return 0;
}

void rp_sandbox_open_table(lua_State *L, int env, int table)
{
    lua_pushcfunction(L, tab_insert);
    lua_setfield(L, table, "insert");
    lua_pushcfunction(L, base_unpack);
    lua_setfield(L, env, "unpack");
}

void rp_sandbox_push_sort(lua_State *L) { lua_pushcfunction(L, tab_sort); }
