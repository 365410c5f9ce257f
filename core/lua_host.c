/* The policy host's bottom: where a Lua state keeps its host, the plans' counting
 * allocator, and the error and argument helpers every file of the `rp` API raises with
 * (lua_api.c, lua_plan.c, lua_views.c call these; these call none of them). */
#include "lua_api.h"

#include <lauxlib.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Registry key of the host: the address of a constant, never shown to a policy. */
static const char host_key = 'h';

void rp_lua_host_set(lua_State *L, rp_lua_host *host)
{
    lua_pushlightuserdata(L, (void *)&host_key);
    lua_pushlightuserdata(L, host);
    lua_rawset(L, LUA_REGISTRYINDEX);
}

rp_lua_host *rp_lua_host_of(lua_State *L)
{
    lua_pushlightuserdata(L, (void *)&host_key);
    lua_rawget(L, LUA_REGISTRYINDEX);
    rp_lua_host *h = lua_touserdata(L, -1);
    lua_pop(L, 1);
    return h;
}

/* Allocator of plan_ctx: counts live bytes and refuses growth past the cap. */
void *rp_lua_plan_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    rp_lua_host *h = ud;
    if (!ptr) old_size = 0;
    if (new_size == 0) {
        if (ptr) {
            h->ctx->alloc(h->ctx->alloc_ud, ptr, old_size, 0);
            h->plan_live -= old_size;
        }
        return NULL;
    }
    if (new_size > old_size &&
        (h->plan_live > h->plan_cap || new_size - old_size > h->plan_cap - h->plan_live)) {
        h->plan_refused = true;
        return NULL;
    }
    void *p = h->ctx->alloc(h->ctx->alloc_ud, ptr, old_size, new_size);
    if (p) h->plan_live = h->plan_live - old_size + new_size;
    return p;
}

int rp_lua_error(lua_State *L, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    luaL_where(L, 1);
    lua_pushstring(L, msg);
    lua_concat(L, 2);
    return lua_error(L);
}

void rp_lua_format_mib(size_t bytes, char *buf, size_t n)
{
    if (bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else snprintf(buf, n, "%zu bytes", bytes);
}

int rp_lua_fail(lua_State *L, rp_lua_host *host, const char *fname, rp_status st, const rp_error *err)
{
    if (st == RP_ENOMEM && host->plan_refused) {
        char cap[64];
        host->plan_refused = false;
        rp_lua_format_mib(host->plan_cap, cap, sizeof cap);
        return rp_lua_error(L, "%s: policy exceeded the memory limit of %s (plans and scratch of C calls)",
                            fname, cap);
    }
    return rp_lua_error(L, "%s: %s", fname, err && err->text[0] ? err->text : rp_strerror(st));
}

int64_t rp_lua_check_int(lua_State *L, int idx, const char *what, int64_t lo, int64_t hi)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        return rp_lua_error(L, "%s must be an integer, got %s", what, luaL_typename(L, idx));
    double v = lua_tonumber(L, idx);
    if (v != floor(v) || !isfinite(v))
        return rp_lua_error(L, "%s must be an integer, got %.17g", what, v);
    if (v < (double)lo || v > (double)hi)
        return rp_lua_error(L, "%s must be within %lld..%lld, got %.17g", what, (long long)lo,
                            (long long)hi, v);
    return (int64_t)v;
}

/* ---- argument helpers of the rp.* functions ---- */

double rp_lua_check_num(lua_State *L, int idx, const char *what)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        return rp_lua_error(L, "%s must be a number, got %s", what, luaL_typename(L, idx));
    return lua_tonumber(L, idx);
}

bool rp_lua_check_bool(lua_State *L, int idx, const char *what)
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

/* The first in key_before's order, so every rank and run gives the same message. */
int rp_lua_first_unknown_key(lua_State *L, int idx, const char *const *known)
{
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
    return worst;
}

void rp_lua_check_opts(lua_State *L, int idx, const char *fname, const char *const *known)
{
    if (lua_isnoneornil(L, idx)) return;
    if (lua_type(L, idx) != LUA_TTABLE)
        rp_lua_error(L, "%s: the options must be a table, got %s", fname, luaL_typename(L, idx));
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    const int worst = rp_lua_first_unknown_key(L, idx, known);
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
int rp_lua_opt(lua_State *L, int opts, const char *key)
{
    if (lua_type(L, opts) != LUA_TTABLE) {
        lua_pushnil(L);
        return LUA_TNIL;
    }
    lua_pushstring(L, key);
    lua_rawget(L, opts);
    return lua_type(L, -1);
}

int64_t rp_lua_log2_ceil(int64_t n)
{
    int64_t b = 0;
    while (b < 62 && (INT64_C(1) << b) < n) b++;
    return b;
}

int64_t rp_lua_sort_units(int64_t n) { return n * (rp_lua_log2_ceil(n) + 1); }

void rp_lua_register_metatable(lua_State *L, const char *name, const luaL_Reg *methods, const luaL_Reg *meta,
                               const char *shown)
{
    luaL_newmetatable(L, name);
    for (const luaL_Reg *r = meta; r->func; r++) {
        if (methods && !strcmp(r->name, "__index")) {
            lua_newtable(L);
            for (const luaL_Reg *m = methods; m->func; m++) {
                lua_pushcfunction(L, m->func);
                lua_setfield(L, -2, m->name);
            }
            lua_pushcclosure(L, r->func, 1);
        } else {
            lua_pushcfunction(L, r->func);
        }
        lua_setfield(L, -2, r->name);
    }
    lua_pushstring(L, shown);
    lua_setfield(L, -2, "__metatable");
    lua_pop(L, 1);
}
