/* The Lua sandbox policies run in: building the state (the whitelisted environment, the
 * prelude), loading chunks and calling them under the limits of sandbox_limits.c
 * (docs/sandbox.md; what a policy sees: docs/policies.md, "The sandbox"). */
#include "prng.h"
#include "sandbox_internal.h"

#include <lauxlib.h>
#include <luajit.h>
#include <lualib.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* The sandbox's Lua-side wrappers: lua/sandbox_prelude.lua, compiled in as
 * rp_lua_sandbox_prelude (a generated header; see cmake/EmbedLua.cmake). */
#include "lua_sandbox_prelude.h"

/* ---- building the sandbox ----------------------------------------------------------- */

/* LuaJIT's own functions given as they are; tonumber, string.sub/upper/lower/reverse/rep
 * and table.concat are the prelude's charged wrappers around LuaJIT's. */
static const char *const base_names[] = {
    "assert", "error",  "ipairs", "pcall",  "select",   "type",
    "rawequal", "rawget", "rawset", "rawlen", "setmetatable", NULL};
static const char *const math_names[] = {
    "abs", "acos", "asin", "atan", "atan2", "ceil", "cos", "cosh", "deg", "exp",
    "floor", "fmod", "frexp", "huge", "ldexp", "log", "log10", "max", "min", "modf",
    "pi", "pow", "rad", "sin", "sinh", "sqrt", "tan", "tanh", NULL};
static const char *const string_names[] = {"byte", "char", "len", NULL};
static const char *const table_names[] = {"remove", NULL}; /* LuaJIT's is Lua: hooked */

/* Copy the whitelisted fields that exist from table `from` into table `to`. */
static void copy_fields(lua_State *L, int from, int to, const char *const *names)
{
    for (; *names; names++) {
        lua_getfield(L, from, *names);
        if (lua_isnil(L, -1)) lua_pop(L, 1);
        else lua_setfield(L, to, *names);
    }
}

static void set_function(lua_State *L, int table, const char *name, lua_CFunction fn)
{
    lua_pushcfunction(L, fn);
    lua_setfield(L, table, name);
}

static int sandbox_msgh(lua_State *L);
static int error_object_text(lua_State *L);

/* Runs inside lua_cpcall: any allocation failure unwinds to rp_sandbox_new. */
static int build_sandbox(lua_State *L)
{
    rp_sandbox *sb = lua_touserdata(L, 1);
    static const struct {
        const char *name;
        lua_CFunction open;
    } libs[] = {{"", luaopen_base},
                {LUA_TABLIBNAME, luaopen_table},
                {LUA_STRLIBNAME, luaopen_string},
                {LUA_MATHLIBNAME, luaopen_math}};
    /* The libraries open into the state's own globals, which no policy can reach; the
     * environment gets copies of the whitelisted fields only. */
    for (size_t i = 0; i < sizeof libs / sizeof libs[0]; i++) {
        lua_pushcfunction(L, libs[i].open);
        lua_pushstring(L, libs[i].name);
        lua_call(L, 1, 0);
    }
    lua_settop(L, 0);
    /* Learn whether big strings can be told by LuaJIT's header (sandbox_big.c): build
     * one of known length and look at the block the allocator handed out for it. */
    static const char probe_bytes[20000];
    rp_big_classify(&sb->big);
    lua_pushlstring(L, probe_bytes, sizeof probe_bytes);
    for (int i = 0; i < sb->big.num_pending; i++)
        if (rp_big_is_string(sb->big.pending[i], sb->big.pending_size[i]))
            sb->big.headers_known = true;
    rp_big_classify(&sb->big);
    lua_pop(L, 1);
    lua_newtable(L); /* 1: env */
    copy_fields(L, LUA_GLOBALSINDEX, 1, base_names);
    set_function(L, 1, "pairs", sandbox_lib_pairs);
    set_function(L, 1, "next", sandbox_lib_next);
    set_function(L, 1, "tostring", sandbox_lib_tostring);
    set_function(L, 1, "getmetatable", sandbox_lib_getmetatable);
    set_function(L, 1, "collectgarbage", sandbox_lib_collectgarbage);

    lua_getglobal(L, LUA_MATHLIBNAME); /* 2 */
    lua_newtable(L);                   /* 3 */
    copy_fields(L, 2, 3, math_names);
    set_function(L, 3, "random", sandbox_lib_random);
    set_function(L, 3, "randomseed", sandbox_lib_randomseed);
    lua_setfield(L, 1, "math");
    lua_settop(L, 1);

    lua_getglobal(L, LUA_TABLIBNAME); /* 2 */
    lua_newtable(L);                  /* 3 */
    copy_fields(L, 2, 3, table_names);
    rp_sandbox_open_table(L, 1, 3);

    lua_getglobal(L, LUA_STRLIBNAME); /* 4 */
    lua_newtable(L);                  /* 5 */
    copy_fields(L, 4, 5, string_names);
    rp_sandbox_open_string(L, 5);

    /* The prelude's wrappers: xpcall, string.format, table.sort, the pre-charged
     * tonumber, string.sub/upper/lower/reverse/rep and table.concat, and table.maxn. */
    if (luaL_loadbuffer(L, rp_lua_sandbox_prelude, sizeof rp_lua_sandbox_prelude, PRELUDE_NAME) != 0)
        return lua_error(L);
    lua_newtable(L);
    lua_setfenv(L, -2); /* the prelude reads no globals */
    lua_getglobal(L, "xpcall");
    lua_pushcfunction(L, sandbox_lib_handler_for);
    lua_getfield(L, 4, "format");
    lua_pushcfunction(L, sandbox_lib_format_args);
    rp_sandbox_push_sort(L);
    lua_pushcfunction(L, sandbox_lib_sort_check);
    lua_pushcfunction(L, sandbox_lib_check_clock);
    lua_pushcfunction(L, sandbox_lib_charge_args);
    lua_getglobal(L, "tonumber");
    lua_getfield(L, 4, "sub");
    lua_getfield(L, 4, "upper");
    lua_getfield(L, 4, "lower");
    lua_getfield(L, 4, "reverse");
    lua_getfield(L, 4, "rep");
    lua_getfield(L, 2, "concat");
    lua_getglobal(L, "next");
    lua_getglobal(L, "type");
    lua_getfield(L, 2, "maxn");
    lua_getglobal(L, LUA_MATHLIBNAME);
    lua_getfield(L, -1, "max");
    lua_remove(L, -2);
    lua_call(L, 19, 11);
    lua_setfield(L, 3, "maxn");
    lua_setfield(L, 3, "concat");
    lua_setfield(L, 5, "rep");
    lua_setfield(L, 5, "reverse");
    lua_setfield(L, 5, "lower");
    lua_setfield(L, 5, "upper");
    lua_setfield(L, 5, "sub");
    lua_setfield(L, 1, "tonumber");
    lua_setfield(L, 3, "sort");
    lua_setfield(L, 5, "format");
    lua_setfield(L, 1, "xpcall");
    lua_pushvalue(L, 3);
    lua_setfield(L, 1, "table");
    lua_pushvalue(L, 5);
    lua_setfield(L, 1, "string");

    /* Method calls on strings ("x"):rep(3) go to the policy's string table, never to
     * the state's own (which has dump); getmetatable("") answers false. */
    lua_pushliteral(L, "");
    lua_getmetatable(L, -1); /* 7 */
    lua_pushvalue(L, 5);
    lua_setfield(L, -2, "__index");
    lua_pushboolean(L, 0);
    lua_setfield(L, -2, "__metatable");
    lua_settop(L, 1);

    lua_pushvalue(L, 1);
    lua_setfield(L, 1, "_G");
    lua_newtable(L);
    lua_setfield(L, 1, "rp");

    lua_pushvalue(L, 1);
    sb->refs[REF_ENV] = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushcfunction(L, sandbox_msgh);
    sb->refs[REF_MSGH] = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushcfunction(L, sandbox_gc_collect);
    sb->refs[REF_GC] = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushcfunction(L, error_object_text);
    sb->refs[REF_ERROR_TEXT] = luaL_ref(L, LUA_REGISTRYINDEX);
    for (int kind = 0; kind < TRIP_KINDS; kind++) {
        char msg[128];
        sandbox_limit_message(&sb->limits, (trip_kind)kind, msg, sizeof msg);
        lua_pushstring(L, msg);
        sb->refs[REF_MSG_FIRST + kind] = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    lua_settop(L, 0);
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}

rp_status rp_sandbox_new(rp_context *ctx, const rp_sandbox_limits *limits, rp_sandbox **out,
                         rp_error *err)
{
    rp_sandbox_limits lim = limits ? *limits : rp_sandbox_limits_default();
    rp_status st = sandbox_check_limits(&lim, err);
    if (st != RP_OK) return st;
    rp_sandbox *sb = rp_calloc(ctx, 1, sizeof *sb);
    if (!sb) return rp_fail_nomem(err, "a sandbox");
    sb->ctx = ctx;
    sb->big.ctx = ctx;
    if (lim.max_object_bytes == 0) lim.max_object_bytes = RP_SANDBOX_DEFAULT_OBJECT;
    if (lim.max_object_bytes > lim.max_memory_bytes) lim.max_object_bytes = lim.max_memory_bytes;
    sb->limits = lim;
    sb->object_cap = lim.max_object_bytes;
    sb->hook_period = RP_SANDBOX_HOOK_PERIOD;
    sb->gc_next = lim.max_memory_bytes / 2;
    sb->trace_line = -1;
    for (int i = 0; i < REF_COUNT; i++) sb->refs[i] = LUA_NOREF;
    rp_xoshiro_seed(sb->prng, 0);

    sb->boot_arena = rp_alloc(ctx, BOOT_ARENA_BYTES);
    if (!sb->boot_arena) {
        rp_free(ctx, sb);
        return rp_fail_nomem(err, "a sandbox");
    }
    sb->mem_armed = true;
    lua_State *L = lua_newstate(sandbox_alloc, sb);
    if (L && sb->boot_failed) {
        lua_close(L);
        L = NULL;
    }
    rp_free(ctx, sb->boot_arena);
    sb->boot_arena = NULL;
    if (!L) {
        st = sb->mem_refused
                 ? rp_fail(err, RP_ELIMIT, "sandbox: a fresh Lua state does not fit in max_memory_bytes %zu",
                           lim.max_memory_bytes)
                 : rp_fail_nomem(err, "a Lua state");
        rp_big_release(&sb->big);
        rp_free(ctx, sb);
        return st;
    }
    sb->L = L;
    sandbox_jit_off(L);
    int status = lua_cpcall(L, build_sandbox, sb);
    sb->mem_armed = false;
    if (status != 0) {
        /* the prelude's compile error is rethrown with lua_error, so ERRMEM may
         * arrive as ERRRUN carrying LuaJIT's fixed message */
        const char *msg = lua_tostring(L, -1);
        if (sb->mem_refused)
            st = rp_fail(err, RP_ELIMIT, "sandbox: the policy environment does not fit in max_memory_bytes %zu",
                         lim.max_memory_bytes);
        else if (status == LUA_ERRMEM || (msg && strcmp(msg, "not enough memory") == 0))
            st = rp_fail_nomem(err, "the policy environment");
        else
            st = rp_fail(err, RP_EPOLICY, "sandbox: building the environment failed: %s", msg ? msg : "?");
        lua_close(L);
        rp_big_release(&sb->big);
        rp_free(ctx, sb);
        return st;
    }
    sb->tripped = TRIP_NONE;
    *out = sb;
    return RP_OK;
}

void rp_sandbox_free(rp_sandbox *sb)
{
    if (!sb) return;
    lua_close(sb->L);
    rp_big_release(&sb->big);
    rp_free(sb->ctx, sb);
}

lua_State *rp_sandbox_state(rp_sandbox *sb) { return sb->L; }

void rp_sandbox_push_env(rp_sandbox *sb)
{
    lua_rawgeti(sb->L, LUA_REGISTRYINDEX, sb->refs[REF_ENV]);
}

void rp_sandbox_seed(rp_sandbox *sb, uint64_t seed) { rp_xoshiro_seed(sb->prng, seed); }

/* ---- calls -------------------------------------------------------------------------- */

/* Message handler of rp_sandbox_call: notes where the error came from, in C memory. */
static int sandbox_msgh(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!sb->trace[0]) sandbox_record_trace(sb, L);
    lua_settop(L, 1);
    return 1;
}

/* Runs protected: words for an error object that is not a string or a number. Its
 * __tostring is policy code, so it runs under the call's limits, which are still armed. */
static int error_object_text(lua_State *L)
{
    int t = lua_type(L, 1);
    if ((t == LUA_TTABLE || t == LUA_TUSERDATA) && luaL_getmetafield(L, 1, "__tostring")) {
        lua_pushvalue(L, 1);
        int status = lua_pcall(L, 1, 1, 0);
        if (status == 0 && lua_type(L, -1) == LUA_TSTRING) return 1;
        if (status != 0 && lua_type(L, -1) == LUA_TSTRING)
            lua_pushfstring(L, "(error object is a %s value; its __tostring failed: %s)",
                            lua_typename(L, t), lua_tostring(L, -1));
        else
            lua_pushfstring(L, "(error object is a %s value; its __tostring did not return a string)",
                            lua_typename(L, t));
        return 1;
    }
    lua_pushfstring(L, "(error object is a %s value)", lua_typename(L, t));
    return 1;
}

/* Words for the error object on top of the stack, into C memory. Nothing here may
 * allocate outside a protected call: an error there would reach LuaJIT's panic. */
static void error_text(rp_sandbox *sb, lua_State *L, char *buf, size_t n)
{
    int t = lua_type(L, -1);
    if (t == LUA_TSTRING) {
        snprintf(buf, n, "%s", lua_tostring(L, -1));
        return;
    }
    if (t == LUA_TNUMBER) {
        snprintf(buf, n, "%.14g", lua_tonumber(L, -1));
        return;
    }
    snprintf(buf, n, "(error object is a %s value)", lua_typename(L, t));
    if (sb->tripped != TRIP_NONE || !lua_checkstack(L, 2)) return;
    lua_rawgeti(L, LUA_REGISTRYINDEX, sb->refs[REF_ERROR_TEXT]);
    lua_pushvalue(L, -2);
    if (lua_pcall(L, 1, 1, 0) == 0 && lua_type(L, -1) == LUA_TSTRING)
        snprintf(buf, n, "%s", lua_tostring(L, -1));
    lua_pop(L, 1);
}

static rp_status describe_failure(rp_sandbox *sb, int status, rp_error *err)
{
    lua_State *L = sb->L;
    char text[RP_ERROR_TEXT];
    text[0] = '\0';
    if (status == LUA_ERRRUN) error_text(sb, L, text, sizeof text);
    if (sb->tripped != TRIP_NONE) {
        char msg[128];
        sandbox_limit_message(&sb->limits, sb->tripped, msg, sizeof msg);
        if (sb->where[0]) rp_fail(err, RP_ELIMIT, "%s, at %s", msg, sb->where);
        else rp_fail(err, RP_ELIMIT, "%s", msg);
        return RP_ELIMIT;
    }
    if (status == LUA_ERRMEM && sb->alloc_failed)
        return rp_fail(err, RP_ENOMEM, "policy: out of memory (the allocator failed)");
    if (status == LUA_ERRMEM) {
        /* LuaJIT raises its memory error without asking the allocator for an object it
         * cannot hold at all (string.rep('xx', 2^30): a string over 2 GiB). That is the
         * policy asking for too much, not the process running out: a limit. */
        char msg[128];
        sandbox_limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
        rp_fail(err, RP_ELIMIT, "%s (it asked for a string or table larger than LuaJIT can hold)%s%s", msg,
                sb->trace[0] ? ", at " : "", sb->trace);
        return RP_ELIMIT;
    }
    if (status == LUA_ERRERR) snprintf(text, sizeof text, "error in error handling");
    if (sb->trace[0]) rp_fail(err, RP_EPOLICY, "%s (traceback: %s)", text, sb->trace);
    else rp_fail(err, RP_EPOLICY, "%s", text);
    if (err) err->line = sb->trace_line;
    return RP_EPOLICY;
}

/* The C stack guard for a call whose frame is at `frame`: RP_SANDBOX_C_STACK_BYTES, or
 * what the thread has below less the reserve; RP_EINVAL when that is under the minimum
 * (`what`: "call the policy", "compile the policy"). */
static rp_status size_c_stack(rp_sandbox *sb, uintptr_t frame, size_t least, const char *what, rp_error *err)
{
    size_t room = sandbox_stack_room(&sb->stack, frame);
    if (room < RP_SANDBOX_C_STACK_RESERVE + least)
        return rp_fail(err, RP_EINVAL,
                       "sandbox: the calling thread has %zu KiB of stack left, and the sandbox needs %zu KiB to %s "
                       "safely (%zu KiB for LuaJIT and the sandbox, %zu KiB for C functions that call back); run it "
                       "on a thread with a larger stack",
                       room >> 10, (RP_SANDBOX_C_STACK_RESERVE + least) >> 10, what, RP_SANDBOX_C_STACK_RESERVE >> 10,
                       least >> 10);
    room -= RP_SANDBOX_C_STACK_RESERVE;
    sb->c_stack_bytes = room < RP_SANDBOX_C_STACK_BYTES ? room : RP_SANDBOX_C_STACK_BYTES;
    return RP_OK;
}

/* The function is at `func` with its arguments above it. */
static rp_status protected_call(rp_sandbox *sb, int func, int nargs, int nresults, rp_error *err)
{
    lua_State *L = sb->L;
    if (!lua_checkstack(L, LUA_MINSTACK)) {
        lua_settop(L, func - 1);
        return rp_fail(err, RP_ENOMEM, "sandbox: no Lua stack space left to call the policy");
    }
    rp_status sized = size_c_stack(sb, (uintptr_t)__builtin_frame_address(0), RP_SANDBOX_C_STACK_MIN,
                                   "call the policy", err);
    if (sized != RP_OK) {
        lua_settop(L, func - 1);
        return sized;
    }
    lua_rawgeti(L, LUA_REGISTRYINDEX, sb->refs[REF_MSGH]);
    lua_insert(L, func);
    sandbox_arm(sb, (uintptr_t)__builtin_frame_address(0));
    int status = lua_pcall(L, nargs, nresults, func);
    /* the clock after the call: C work at its end (a host primitive, a library function)
     * may have run past the limit with no hook after it; such a call fails even though
     * it returned */
    if (status == 0 && sb->tripped == TRIP_NONE && now_s(sb) > sb->deadline) {
        sandbox_trip(sb, TRIP_WALL);
        snprintf(sb->where, sizeof sb->where, "the end of the call");
    }
    rp_status st = RP_OK;
    if (status != 0 || sb->tripped != TRIP_NONE) st = describe_failure(sb, status, err);
    sandbox_disarm(sb);
    if (st != RP_OK) {
        lua_settop(L, func - 1);
        if (sb->mem_refused) sandbox_collect(sb, L);
    } else {
        lua_remove(L, func);
    }
    return st;
}

rp_status rp_sandbox_call(rp_sandbox *sb, int nargs, int nresults, rp_error *err)
{
    lua_State *L = sb->L;
    if (sb->in_call)
        return rp_fail(err, RP_EINVAL,
                       "sandbox: rp_sandbox_call cannot run inside a policy call (a C function "
                       "called by the policy calls Lua with lua_call)");
    if (nargs < 0 || lua_gettop(L) < nargs + 1 || !lua_isfunction(L, -nargs - 1))
        return rp_fail(err, RP_EINVAL,
                       "sandbox: rp_sandbox_call needs a function and %d arguments on the stack",
                       nargs);
    return protected_call(sb, lua_gettop(L) - nargs, nargs, nresults, err);
}

static int32_t message_line(const char *msg)
{
    /* "name:LINE: text": the first ":digits:" after the chunk name */
    for (const char *p = strchr(msg, ':'); p; p = strchr(p + 1, ':')) {
        const char *q = p + 1;
        long line = 0;
        while (*q >= '0' && *q <= '9' && line < INT32_MAX / 10) line = line * 10 + (*q++ - '0');
        if (q > p + 1 && *q == ':') return (int32_t)line;
    }
    return -1;
}

rp_status rp_sandbox_load_text(rp_sandbox *sb, const char *source, size_t len,
                               const char *chunkname, rp_error *err)
{
    lua_State *L = sb->L;
    if (!chunkname || !*chunkname) chunkname = "policy";
    if (!source && len) return rp_fail(err, RP_EINVAL, "%s: no source text", chunkname);
    if (sb->in_call)
        return rp_fail(err, RP_EINVAL, "%s: a chunk cannot be loaded inside a policy call", chunkname);
    /* Bytecode is never loaded: LuaJIT does not verify it, so crafted bytecode can read
     * and write memory. Both LuaJIT ("\x1bLJ") and Lua ("\x1bLua") dumps start with ESC;
     * mode "t" below refuses it again, also after a #! line. */
    if (len > 0 && source[0] == '\x1b')
        return rp_fail(err, RP_EPOLICY,
                       "%s: precompiled bytecode is refused; a policy is loaded from its source text",
                       chunkname);
    char name[256];
    snprintf(name, sizeof name, "%s%s", chunkname[0] == '=' || chunkname[0] == '@' ? "" : "=", chunkname);
    if (!lua_checkstack(L, LUA_MINSTACK))
        return rp_fail(err, RP_ENOMEM, "%s: no Lua stack space left", chunkname);
    /* LuaJIT's parser recurses in C, up to 200 levels of nesting */
    rp_status sized = size_c_stack(sb, (uintptr_t)__builtin_frame_address(0), 0, "compile the policy", err);
    if (sized != RP_OK) return sized;

    sb->tripped = TRIP_NONE;
    sb->mem_refused = false;
    sb->alloc_failed = false;
    sb->mem_armed = true;
    int status = luaL_loadbufferx(L, source ? source : "", len, name, "t");
    sb->mem_armed = false;
    if (status != 0) {
        rp_status st;
        if (sb->mem_refused) {
            char msg[128];
            sandbox_limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
            st = rp_fail(err, RP_ELIMIT, "%s: %s while compiling", chunkname, msg);
        } else if (status == LUA_ERRMEM && sb->alloc_failed) {
            st = rp_fail(err, RP_ENOMEM, "%s: out of memory while compiling", chunkname);
        } else if (status == LUA_ERRMEM) {
            char msg[128];
            sandbox_limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
            st = rp_fail(err, RP_ELIMIT, "%s: %s while compiling (a token larger than LuaJIT can hold)", chunkname,
                         msg);
        } else {
            const char *msg = lua_tostring(L, -1);
            st = rp_fail(err, RP_EPOLICY, "%s", msg ? msg : "syntax error");
            if (err && msg) err->line = message_line(msg);
        }
        lua_pop(L, 1);
        sb->tripped = TRIP_NONE;
        if (sb->mem_refused) sandbox_collect(sb, L);
        return st;
    }
    rp_sandbox_push_env(sb);
    lua_setfenv(L, -2);
    return protected_call(sb, lua_gettop(L), 0, 1, err);
}

