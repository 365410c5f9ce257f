/* The sandbox's replacements for the base library: a deterministic PRNG, tostring,
 * getmetatable and collectgarbage, key-ordered pairs and next, and the C helpers of the
 * prelude's charged wrappers (format, sort, xpcall) (docs/sandbox.md). The string and
 * table functions are in sandbox_string.c and sandbox_table.c. */
#include "prng.h"
#include "sandbox_internal.h"

#include <lauxlib.h>
#include <luajit.h>
#include <lualib.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bytes of a string the library wrappers charge one unit for when they scan or compare
 * it (measured: comparing two long strings runs at ~0.7 GB/s, coercing one to a number
 * at ~0.25 GB/s, against ~200 M VM instructions a second). */
#define SCAN_BYTES_PER_UNIT 4
/* Keys pairs and next visit between two charges (a charge may raise: nothing is held). */
#define KEYS_PER_CHARGE 4096
/* Bytes of two string keys memcmp compares for one unit (pairs' sort, next). */
#define KEY_BYTES_PER_UNIT 64

/* ---- math.random: xoshiro256** (prng.h), deterministic per seed ---------------------- */

static double bounded_integer_arg(lua_State *L, int arg)
{
    double v = floor(luaL_checknumber(L, arg));
    if (!(fabs(v) <= 9007199254740992.0)) luaL_argerror(L, arg, "number out of range (beyond 2^53)");
    return v;
}

/* math.random with Lua 5.1's signature: () in [0,1), (m) in [1,m], (m,n) in [m,n];
 * integers are uniform (rejection sampling, no modulo bias). */
int sandbox_lib_random(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    int nargs = lua_gettop(L);
    double lo, hi;
    if (nargs == 0) {
        lua_pushnumber(L, (double)(rp_xoshiro_next(sb->prng) >> 11) * 0x1.0p-53);
        return 1;
    } else if (nargs == 1) {
        lo = 1;
        hi = bounded_integer_arg(L, 1);
        luaL_argcheck(L, lo <= hi, 1, "interval is empty");
    } else if (nargs == 2) {
        lo = bounded_integer_arg(L, 1);
        hi = bounded_integer_arg(L, 2);
        luaL_argcheck(L, lo <= hi, 2, "interval is empty");
    } else {
        return luaL_error(L, "wrong number of arguments");
    }
    uint64_t range = (uint64_t)((int64_t)hi - (int64_t)lo) + 1; /* <= 2^54 + 1 */
    uint64_t limit = UINT64_MAX - UINT64_MAX % range, x;
    do x = rp_xoshiro_next(sb->prng);
    while (x >= limit);
    lua_pushnumber(L, lo + (double)(x % range));
    return 1;
}

int sandbox_lib_randomseed(lua_State *L)
{
    double v = luaL_checknumber(L, 1);
    uint64_t bits;
    if (v == 0) v = 0; /* -0 and 0 seed alike */
    memcpy(&bits, &v, sizeof bits);
    rp_xoshiro_seed(rp_sandbox_of(L)->prng, bits);
    return 0;
}

/* ---- base functions ----------------------------------------------------------------- */

static int abs_index(lua_State *L, int idx)
{
    return idx < 0 && idx > LUA_REGISTRYINDEX ? lua_gettop(L) + idx + 1 : idx;
}

/* tostring without addresses: tables, functions, userdata and threads print as their
 * type name, since an address differs between runs and ranks. */
void rp_sandbox_tostring(lua_State *L, int idx)
{
    idx = abs_index(L, idx);
    if (luaL_getmetafield(L, idx, "__tostring")) {
        rp_sandbox_check_c_stack(L);
        rp_sandbox_charge_callback(L);
        lua_pushvalue(L, idx);
        lua_call(L, 1, 1);
        if (!lua_isstring(L, -1)) luaL_error(L, "'__tostring' must return a string");
        return;
    }
    switch (lua_type(L, idx)) {
    case LUA_TNUMBER:
        lua_pushvalue(L, idx);
        lua_tolstring(L, -1, NULL);
        break;
    case LUA_TSTRING: lua_pushvalue(L, idx); break;
    case LUA_TBOOLEAN: lua_pushstring(L, lua_toboolean(L, idx) ? "true" : "false"); break;
    case LUA_TNIL: lua_pushliteral(L, "nil"); break;
    default: lua_pushstring(L, luaL_typename(L, idx)); break;
    }
}

int sandbox_lib_tostring(lua_State *L)
{
    luaL_checkany(L, 1);
    rp_sandbox_tostring(L, 1);
    return 1;
}

/* The real metatable only of tables; of anything else (strings, the engine's userdata)
 * only its __metatable field, so the shared string metatable is never handed out. */
int sandbox_lib_getmetatable(lua_State *L)
{
    luaL_checkany(L, 1);
    if (!lua_getmetatable(L, 1)) {
        lua_pushnil(L);
        return 1;
    }
    lua_pushliteral(L, "__metatable");
    lua_rawget(L, -2);
    if (!lua_isnil(L, -1)) return 1;
    lua_pop(L, 1);
    if (lua_type(L, 1) != LUA_TTABLE) lua_pushnil(L);
    return 1;
}

int sandbox_lib_collectgarbage(lua_State *L)
{
    const char *opt = luaL_optstring(L, 1, "collect");
    if (strcmp(opt, "count") != 0)
        return luaL_error(L, "collectgarbage(\"%s\") is not allowed in a policy (only \"count\")", opt);
    lua_pushnumber(L, lua_gc(L, LUA_GCCOUNT, 0) + lua_gc(L, LUA_GCCOUNTB, 0) / 1024.0);
    return 1;
}

/* ---- deterministic iteration -------------------------------------------------------- */

/* LuaJIT seeds its string hash per state, so next() visits string keys in a different
 * order in every state: on every rank. pairs and next visit keys in one canonical
 * order instead: numbers ascending, then strings by bytes, then false, true. */
typedef struct key_entry {
    int rank; /* 0 number, 1 string, 2 boolean */
    double number;
    const char *text;
    size_t len;
    int slot;
} key_entry;

static bool classify_key(lua_State *L, int idx, key_entry *e)
{
    e->number = 0;
    e->text = NULL;
    e->len = 0;
    switch (lua_type(L, idx)) {
    case LUA_TNUMBER: e->rank = 0; e->number = lua_tonumber(L, idx); return true;
    case LUA_TSTRING: e->rank = 1; e->text = lua_tolstring(L, idx, &e->len); return true;
    case LUA_TBOOLEAN: e->rank = 2; e->number = lua_toboolean(L, idx); return true;
    default: return false;
    }
}

static int compare_keys(const key_entry *a, const key_entry *b)
{
    if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
    if (a->rank != 1) return a->number < b->number ? -1 : a->number > b->number;
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->text, b->text, n);
    if (c) return c < 0 ? -1 : 1;
    return a->len < b->len ? -1 : a->len > b->len;
}

static int compare_entries(const void *a, const void *b) { return compare_keys(a, b); }

static int unordered_key_error(lua_State *L, const char *who, int idx)
{
    return luaL_error(L,
                      "%s: a table key of type %s has no deterministic order (policies must "
                      "compute the same plan on every rank); keep such keys in an array",
                      who, luaL_typename(L, idx));
}

static int64_t sort_cost(int64_t n)
{
    int64_t log2n = 1;
    while (((int64_t)1 << log2n) < n && log2n < 62) log2n++;
    return n * log2n;
}

static bool is_run_key(const key_entry *e, lua_Integer run)
{
    return e->rank == 0 && e->number >= 1 && e->number <= (double)run &&
           e->number == (double)(lua_Integer)e->number;
}

/* Push an array of the keys of table `t` in canonical order, leaving out the integer
 * keys 1..*run (the iterator visits those first, straight from the table). If another
 * number key would sort among them (0, -3, 2.5), *run becomes 0 and every key is in
 * the array. Returns the array's length. */
static int push_ordered_keys(lua_State *L, int t, const char *who, lua_Integer *run)
{
    /* Nothing below may depend on the order lua_next visits keys in (LuaJIT seeds its
     * string hash per state): not the work charged, not what is allocated. */
    int n = 0, others = 0, total = 0;
    bool mixed = false;
    size_t longest = 0; /* the longest string key: what one comparison of the sort may read */
    lua_pushnil(L); /* first pass: check the keys, count those outside the run */
    while (lua_next(L, t)) {
        lua_pop(L, 1);
        key_entry probe;
        if (++total % KEYS_PER_CHARGE == 0) rp_sandbox_charge(L, KEYS_PER_CHARGE);
        if (!classify_key(L, -1, &probe)) unordered_key_error(L, who, -1);
        if (probe.len > longest) longest = probe.len;
        if (is_run_key(&probe, *run)) continue;
        /* rare: another number sorts among the run: one sorted array of all keys */
        if (*run > 0 && probe.rank == 0 && probe.number < (double)*run) mixed = true;
        others++;
    }
    if (mixed) {
        *run = 0;
        others = total;
    }
    rp_sandbox_charge(L, total % KEYS_PER_CHARGE);
    lua_createtable(L, others, 0);
    int keys = lua_gettop(L);
    lua_pushnil(L);
    while (lua_next(L, t)) {
        lua_pop(L, 1);
        key_entry probe;
        classify_key(L, -1, &probe);
        if (is_run_key(&probe, *run)) continue;
        lua_pushvalue(L, -1);
        lua_rawseti(L, keys, ++n);
    }
    if (n < 2) return n;
    key_entry small[64], *e = small;
    if (n > 64) e = lua_newuserdata(L, (size_t)n * sizeof *e);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, keys, i + 1);
        classify_key(L, -1, &e[i]); /* strings stay alive in `keys` */
        lua_pop(L, 1);
        e[i].slot = i + 1;
    }
    /* sorted and rebuilt even when lua_next happened to visit them in order; a
     * comparison of string keys reads up to the longest key */
    int64_t per_comparison = 1 + (int64_t)(longest / KEY_BYTES_PER_UNIT), comparisons = sort_cost(n);
    rp_sandbox_charge(L, comparisons > INT64_MAX / per_comparison ? INT64_MAX : comparisons * per_comparison);
    qsort(e, (size_t)n, sizeof *e, compare_entries); /* keys are distinct: a strict order */
    if (n <= 64 && lua_checkstack(L, n)) { /* reorder in place through the stack */
        for (int i = 0; i < n; i++) lua_rawgeti(L, keys, e[i].slot);
        for (int i = n; i >= 1; i--) lua_rawseti(L, keys, i);
    } else {
        lua_createtable(L, n, 0);
        for (int i = 0; i < n; i++) {
            lua_rawgeti(L, keys, e[i].slot);
            lua_rawseti(L, -2, i + 1);
        }
        lua_replace(L, keys);
    }
    lua_settop(L, keys);
    return n;
}

/* Upvalues: the table, the other keys in order, the position reached, the length of
 * the run 1..run visited first. Keys removed during the traversal are skipped; keys
 * added are not visited (Lua leaves that undefined). */
static int pairs_iter(lua_State *L)
{
    lua_Integer pos = lua_tointeger(L, lua_upvalueindex(3));
    lua_Integer run = lua_tointeger(L, lua_upvalueindex(4));
    for (;;) {
        pos++;
        if (pos <= run) {
            lua_pushinteger(L, pos);
            lua_rawgeti(L, lua_upvalueindex(1), (int)pos);
        } else {
            lua_rawgeti(L, lua_upvalueindex(2), (int)(pos - run));
            if (lua_isnil(L, -1)) break;
            lua_pushvalue(L, -1);
            lua_rawget(L, lua_upvalueindex(1));
        }
        if (!lua_isnil(L, -1)) {
            lua_pushinteger(L, pos);
            lua_replace(L, lua_upvalueindex(3));
            return 2;
        }
        lua_pop(L, 2);
    }
    lua_pushinteger(L, pos - 1);
    lua_replace(L, lua_upvalueindex(3));
    lua_pushnil(L);
    return 1;
}

int sandbox_lib_pairs(lua_State *L)
{
    luaL_checkany(L, 1);
    if (luaL_getmetafield(L, 1, "__pairs")) { /* views the engine exposes as userdata */
        rp_sandbox_check_c_stack(L);
        rp_sandbox_charge_callback(L);
        lua_pushvalue(L, 1);
        lua_call(L, 1, 3);
        return 3;
    }
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    lua_Integer run = 0;
    for (;;) {
        lua_rawgeti(L, 1, (int)(run + 1));
        bool present = !lua_isnil(L, -1);
        lua_pop(L, 1);
        if (!present || run + 1 >= INT32_MAX) break;
        run++;
    }
    rp_sandbox_charge(L, run);
    push_ordered_keys(L, 1, "pairs", &run);
    lua_pushinteger(L, 0);
    lua_pushinteger(L, run);
    lua_pushcclosure(L, pairs_iter, 4);
    lua_pushvalue(L, 1);
    lua_pushnil(L);
    return 3;
}

/* next(t, k): the key after k in the canonical order, O(number of keys) per call;
 * iterate with pairs. */
int sandbox_lib_next(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 2);
    key_entry after, best, e;
    bool have_after = !lua_isnil(L, 2), have_best = false;
    if (have_after && !classify_key(L, 2, &after)) return unordered_key_error(L, "next", 2);
    lua_pushnil(L); /* 3: best key so far */
    int64_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, 1)) {
        lua_pop(L, 1);
        if (!classify_key(L, 4, &e)) unordered_key_error(L, "next", 4);
        n += 1 + (int64_t)(2 * e.len / KEY_BYTES_PER_UNIT); /* two comparisons read up to the key */
        if (n >= KEYS_PER_CHARGE) {
            rp_sandbox_charge(L, n);
            n = 0;
        }
        if (have_after && compare_keys(&e, &after) <= 0) continue;
        if (!have_best || compare_keys(&e, &best) < 0) {
            lua_pushvalue(L, 4);
            lua_replace(L, 3);
            classify_key(L, 3, &best); /* points into the key kept in slot 3 */
            have_best = true;
        }
    }
    rp_sandbox_charge(L, n);
    if (!have_best) {
        lua_pushnil(L);
        return 1;
    }
    lua_pushvalue(L, 3);
    lua_pushvalue(L, 3);
    lua_rawget(L, 1);
    return 2;
}

/* ---- table functions ---------------------------------------------------------------- */

static int error_at_caller(lua_State *L, const char *message)
{
    luaL_where(L, 2); /* level 1 is the prelude wrapper */
    lua_pushstring(L, message);
    lua_concat(L, 2);
    return lua_error(L);
}

/* "bad argument" for a function the policy called through a prelude wrapper. */
static int wrapper_argerror(lua_State *L, int arg, const char *fname, const char *expected)
{
    lua_pushfstring(L, "bad argument #%d to '%s' (%s expected, got %s)", arg, fname, expected,
                    luaL_typename(L, arg));
    return error_at_caller(L, lua_tostring(L, -1));
}

/* Checks for the prelude's sort before the sandbox's (sandbox_table.c, which charges
 * every comparison) runs: argument types, the C stack (a comparator may sort again). A C
 * function as comparator is refused: a policy has no use for one, and its comparisons
 * would only be bounded by the charges of the function itself. */
int sandbox_lib_sort_check(lua_State *L)
{
    if (lua_type(L, 1) != LUA_TTABLE) return wrapper_argerror(L, 1, "sort", "table");
    if (!lua_isnoneornil(L, 2) && lua_type(L, 2) != LUA_TFUNCTION)
        return wrapper_argerror(L, 2, "sort", "function");
    if (lua_iscfunction(L, 2))
        return error_at_caller(L, "bad argument #2 to 'sort' (a C function as comparator is not available to "
                                  "policies: its comparisons run where no limit is checked; pass a Lua function)");
    rp_sandbox_check_c_stack(L);
    return 0;
}

int sandbox_lib_check_clock(lua_State *L)
{
    rp_sandbox_check_clock(L);
    return 0;
}

/* A string argument's length; a number's longest text (never converted in place:
 * lua_objlen would turn the argument itself into a string). */
static size_t arg_len(lua_State *L, int idx)
{
    int t = lua_type(L, idx);
    return t == LUA_TSTRING ? lua_objlen(L, idx) : t == LUA_TNUMBER ? 24 : 0;
}

/* LuaJIT's string.sub index rule: negative counts from the end, clamped to 1..len. */
static int64_t sub_position(lua_State *L, int idx, int64_t len, int64_t dflt)
{
    if (lua_type(L, idx) != LUA_TNUMBER) return dflt;
    double v = lua_tonumber(L, idx);
    if (!(v == v)) return dflt;
    if (v < 0) v = (double)len + v + 1;
    return v < 0 ? 0 : v > (double)len + 1 ? len + 1 : (int64_t)v;
}

/* The prelude's pre-charge: charge(kind, args of the library function). kind 0: one
 * pass over the first string (tonumber, upper, lower, reverse); 1: string.sub's result;
 * 2: string.rep's result (up to the object cap: anything longer is refused before it is
 * built); 3: table.concat's elements and their bytes. Bad arguments are left to the
 * library function's own error. */
int sandbox_lib_charge_args(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    int kind = (int)lua_tointeger(L, 1);
    double bytes = 0;
    int64_t elements = 0;
    switch (kind) {
    case 0: bytes = (double)arg_len(L, 2); break;
    case 1: {
        int64_t len = (int64_t)arg_len(L, 2);
        int64_t i = sub_position(L, 3, len, 1), j = sub_position(L, 4, len, len);
        if (i < 1) i = 1;
        if (j > len) j = len;
        bytes = j >= i ? (double)(j - i + 1) : 0;
        break;
    }
    case 2: {
        double n = lua_type(L, 3) == LUA_TNUMBER ? lua_tonumber(L, 3) : 0;
        if (n >= 1) bytes = (double)arg_len(L, 2) * n + (double)arg_len(L, 4) * (n - 1);
        if (!(bytes <= (double)sb->object_cap)) bytes = (double)sb->object_cap;
        break;
    }
    default: {
        if (lua_type(L, 2) != LUA_TTABLE) break;
        int64_t len = (int64_t)lua_objlen(L, 2);
        double i = lua_type(L, 4) == LUA_TNUMBER ? lua_tonumber(L, 4) : 1;
        double j = lua_type(L, 5) == LUA_TNUMBER ? lua_tonumber(L, 5) : (double)len;
        if (i < 1) i = 1;
        if (j > (double)len + 1) j = (double)len + 1; /* concat stops at the first missing value */
        if (!(j >= i)) break;
        elements = (int64_t)(j - i) + 1;
        rp_sandbox_charge(L, elements);
        size_t sep = arg_len(L, 3);
        for (int64_t k = (int64_t)i; k <= (int64_t)j && k <= len; k++) {
            lua_rawgeti(L, 2, (int)k);
            bytes += (double)(arg_len(L, -1) + sep);
            lua_pop(L, 1);
        }
        break;
    }
    }
    rp_sandbox_charge(L, 1 + (int64_t)(bytes / SCAN_BYTES_PER_UNIT));
    return 0;
}

/* ---- xpcall ------------------------------------------------------------------------- */

/* LuaJIT runs an error handler where the error was raised. For a limit error that is
 * inside the count hook, where no hook fires: a handler with a loop would never stop.
 * So once a limit has tripped the policy's handler is skipped. */
static int xpcall_handler(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    lua_settop(L, 1);
    if (sb->tripped != TRIP_NONE) return 1;
    rp_sandbox_check_c_stack(L);
    rp_sandbox_charge_callback(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, 1, 1);
    return 1;
}

int sandbox_lib_handler_for(lua_State *L)
{
    if (!lua_isfunction(L, 1)) {
        lua_pushfstring(L, "bad argument #2 to 'xpcall' (function expected, got %s)",
                        luaL_typename(L, 1));
        return error_at_caller(L, lua_tostring(L, -1));
    }
    lua_settop(L, 1);
    lua_pushcclosure(L, xpcall_handler, 1);
    return 1;
}

/* string.format's arguments: %p is refused, and for %s and %q a value that is not a
 * string or number is converted here with the sandbox's tostring: LuaJIT's own
 * conversion prints addresses (different on every rank) and calls __tostring from C
 * without the C stack guard (recursion through it overflowed a 1 MiB thread stack). */
int sandbox_lib_format_args(lua_State *L)
{
    int top = lua_gettop(L), arg = 1;
    size_t len;
    if (lua_type(L, 1) != LUA_TSTRING) return top; /* string.format reports it */
    const char *p = lua_tolstring(L, 1, &len), *end = p + len;
    double bytes = (double)len; /* the output copies the format and the strings */
    for (int i = 2; i <= top; i++) bytes += (double)arg_len(L, i);
    rp_sandbox_charge(L, 1 + (int64_t)(bytes / SCAN_BYTES_PER_UNIT));
    while (p < end) {
        if (*p++ != '%') continue;
        if (p < end && *p == '%') {
            p++;
            continue;
        }
        while (p < end && memchr("-+ #0", *p, 5)) p++;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p < end && *p == '.') p++;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p >= end) break;
        char conversion = *p++;
        arg++;
        if (conversion == 'p')
            return error_at_caller(L, "bad argument to 'format' (%p is not available to "
                                      "policies: addresses differ between runs and ranks)");
        if ((conversion == 's' || conversion == 'q') && arg <= top) {
            int t = lua_type(L, arg);
            if (t != LUA_TSTRING && t != LUA_TNUMBER) {
                rp_sandbox_tostring(L, arg);
                lua_replace(L, arg);
            }
        }
    }
    return top;
}
