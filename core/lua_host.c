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
