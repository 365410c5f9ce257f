/* The sandbox's limits: the work count, the wall clock and the trips they cause, the count
 * hook, the capped allocator, and arming them around a call (docs/sandbox.md). The bottom
 * of the sandbox: the library replacements (sandbox_lib.c, sandbox_string.c,
 * sandbox_table.c) charge through it, and sandbox.c builds and calls with it. */
#include "sandbox_internal.h"

#include <lauxlib.h>
#include <luajit.h>
#include <lualib.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Units the string matcher and other C functions may accumulate between clock reads. */
#define CLOCK_EVERY_UNITS 65536

/* ---- time, budget, trips ------------------------------------------------------------ */

rp_sandbox *rp_sandbox_of(lua_State *L)
{
    void *ud = NULL;
    lua_getallocf(L, &ud);
    return ud;
}

static void format_bytes(size_t bytes, char *buf, size_t n)
{
    if (bytes % ((size_t)1 << 30) == 0) snprintf(buf, n, "%zu GiB", bytes >> 30);
    else if (bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else if (bytes % ((size_t)1 << 10) == 0) snprintf(buf, n, "%zu KiB", bytes >> 10);
    else snprintf(buf, n, "%zu bytes", bytes);
}

void sandbox_limit_message(const rp_sandbox_limits *lim, trip_kind kind, char *buf, size_t n)
{
    char size[64];
    switch (kind) {
    case TRIP_INSTRUCTIONS:
        snprintf(buf, n, "policy exceeded the instruction limit (%lld)",
                 (long long)lim->max_instructions);
        break;
    case TRIP_WALL:
        snprintf(buf, n, "policy exceeded the wall-time limit of %g s", lim->max_wall_s);
        break;
    case TRIP_MEMORY:
        format_bytes(lim->max_memory_bytes, size, sizeof size);
        snprintf(buf, n, "policy exceeded the memory limit of %s", size);
        break;
    case TRIP_DEPTH:
        snprintf(buf, n, "policy exceeded the call depth limit of %d", (int)lim->max_depth);
        break;
    case TRIP_OBJECT:
        format_bytes(lim->max_object_bytes, size, sizeof size);
        snprintf(buf, n, "policy exceeded the object size limit of %s", size);
        break;
    default: snprintf(buf, n, "no limit tripped"); break;
    }
}

/* "policy.lua:12 in function 'plan'" for one frame; false for C and prelude frames. */
static bool describe_frame(lua_State *L, lua_Debug *ar, char *buf, size_t n)
{
    if (!lua_getinfo(L, "Sln", ar) || ar->currentline <= 0) return false;
    if (ar->source && strcmp(ar->source, PRELUDE_NAME) == 0) return false;
    if (ar->name)
        snprintf(buf, n, "%s:%d in function '%s'", ar->short_src, ar->currentline, ar->name);
    else if (ar->what && strcmp(ar->what, "main") == 0)
        snprintf(buf, n, "%s:%d in the main chunk", ar->short_src, ar->currentline);
    else
        snprintf(buf, n, "%s:%d", ar->short_src, ar->currentline);
    return true;
}

static void record_where(rp_sandbox *sb, lua_State *L)
{
    lua_Debug ar;
    for (int level = 0; level < 12 && lua_getstack(L, level, &ar); level++)
        if (describe_frame(L, &ar, sb->where, sizeof sb->where)) return;
}

/* Up to 5 policy frames, innermost first, into sb->trace (C memory: the message
 * handler must not allocate, the state may be at its memory cap). */
void sandbox_record_trace(rp_sandbox *sb, lua_State *L)
{
    lua_Debug ar;
    size_t used = 0;
    int shown = 0;
    for (int level = 0; shown < 5 && level < 64 && lua_getstack(L, level, &ar); level++) {
        char frame[160];
        if (!describe_frame(L, &ar, frame, sizeof frame)) continue;
        if (shown == 0) sb->trace_line = ar.currentline;
        int w = snprintf(sb->trace + used, sizeof sb->trace - used, "%s%s", shown ? "; " : "", frame);
        if (w < 0 || (size_t)w >= sizeof sb->trace - used) break;
        used += (size_t)w;
        shown++;
    }
}

static void sandbox_hook(lua_State *L, lua_Debug *ar);

/* Raise the tripped limit's error, and keep raising it: the hook fires at every
 * instruction from now on, so a policy's pcall cannot swallow it (as Redis does). */
static int raise_trip(rp_sandbox *sb, lua_State *L)
{
    if (!sb->rearmed) {
        sb->rearmed = true;
        lua_sethook(L, sandbox_hook, LUA_MASKCOUNT, 1);
    }
    if (!sb->where[0]) record_where(sb, L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, sb->refs[REF_MSG_FIRST + sb->tripped]);
    return lua_error(L);
}

void sandbox_trip(rp_sandbox *sb, trip_kind kind)
{
    if (sb->tripped == TRIP_NONE) sb->tripped = kind;
}

/* A limit tripped where no error can be raised (in the allocator): make the hook fire
 * at the next instruction, where it raises. */
static void trip_soon(rp_sandbox *sb, trip_kind kind)
{
    sandbox_trip(sb, kind);
    if (sb->in_call && !sb->rearmed && sb->L) {
        sb->rearmed = true;
        lua_sethook(sb->L, sandbox_hook, LUA_MASKCOUNT, 1);
    }
}

/* The hook period for the longest live string: the instructions between two hooks touch
 * at most about RP_SANDBOX_TOUCH_BYTES of it (a comparison or a number coercion of a
 * long string is one instruction with work proportional to its length). Blocks not yet
 * classified count as strings until the next hook reads their headers. */
static int period_for(rp_sandbox *sb)
{
    if (sb->big.num_pending > 0) return 1;
    int k = rp_big_largest(&sb->big);
    if (k < 0) return RP_SANDBOX_HOOK_PERIOD;
    int shift = RP_BIG_SHIFT + k + 1; /* the class's blocks are below 2^shift bytes */
    size_t period = shift >= 63 ? 1 : RP_SANDBOX_TOUCH_BYTES >> shift;
    return period < 1 ? 1 : period > RP_SANDBOX_HOOK_PERIOD ? RP_SANDBOX_HOOK_PERIOD : (int)period;
}

/* Shorten (from the allocator, at once) or restore (from the hook) the hook period. The
 * instructions since the last hook are unknown when it is shortened mid-way: the
 * interval is charged as if complete (the count errs high, never low). */
static void set_period(rp_sandbox *sb, int period, bool mid_interval)
{
    if (!sb->in_call || sb->rearmed || period == sb->hook_period) return;
    if (mid_interval) sb->work = sb->work > INT64_MAX - sb->hook_period ? INT64_MAX : sb->work + sb->hook_period;
    sb->hook_period = period;
    lua_sethook(sb->L, sandbox_hook, LUA_MASKCOUNT, period);
}

int sandbox_gc_collect(lua_State *L)
{
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}

/* Protected full collection (a finalizer error or a refused string-table resize
 * cannot escape into the hook or the caller). */
void sandbox_collect(rp_sandbox *sb, lua_State *L)
{
    lua_rawgeti(L, LUA_REGISTRYINDEX, sb->refs[REF_GC]); /* no closure to allocate */
    if (lua_pcall(L, 0, 0, 0) != 0) lua_pop(L, 1);
    size_t cap = sb->limits.max_memory_bytes, live = sb->mem_live;
    size_t gap = live < cap ? cap - live : 0;
    size_t step = gap / 2 > cap / 8 ? gap / 2 : cap / 8;
    sb->gc_next = live + step;
}

/* LuaJIT's collector starts a cycle at twice the live estimate, so garbage can fill the
 * cap before it runs and a refused allocation is never retried after a collection.
 * The hook therefore collects when live bytes pass gc_next (half the cap at first). */
static void sandbox_hook(lua_State *L, lua_Debug *ar)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    (void)ar;
    if (sb->tripped == TRIP_NONE) {
        lua_Debug deep;
        sb->work += sb->hook_period;
        bool depth_due = sb->work - sb->work_at_depth >= RP_SANDBOX_HOOK_PERIOD;
        if (sb->work > sb->limits.max_instructions) sandbox_trip(sb, TRIP_INSTRUCTIONS);
        else if (now_s(sb) > sb->deadline) sandbox_trip(sb, TRIP_WALL);
        else if (depth_due && lua_getstack(L, sb->limits.max_depth, &deep)) sandbox_trip(sb, TRIP_DEPTH);
        else {
            if (depth_due) sb->work_at_depth = sb->work;
            sb->work_at_clock = sb->work;
            if (sb->mem_live >= sb->gc_next) sandbox_collect(sb, L);
            rp_big_classify(&sb->big);
            set_period(sb, period_for(sb), false); /* longer again once big strings have died */
            return;
        }
    }
    raise_trip(sb, L);
}

static bool spend(rp_sandbox *sb, int64_t units)
{
    if (!sb->in_call) return true;
    if (sb->tripped != TRIP_NONE) return false;
    if (units > 0) sb->work = units > INT64_MAX - sb->work ? INT64_MAX : sb->work + units;
    if (sb->work > sb->limits.max_instructions) {
        sandbox_trip(sb, TRIP_INSTRUCTIONS);
        return false;
    }
    if (sb->work - sb->work_at_clock >= CLOCK_EVERY_UNITS) {
        sb->work_at_clock = sb->work;
        if (now_s(sb) > sb->deadline) {
            sandbox_trip(sb, TRIP_WALL);
            return false;
        }
    }
    return true;
}

/* A C loop calls back into Lua or C (a comparator, a metamethod, a gsub replacement, a
 * __tostring, __pairs): the callback's own work is hooked (Lua) or bounded and charged
 * (every C function a policy can reach, docs/sandbox.md's inventory), but between two
 * callbacks no hook fires, so the loop charges each one and reads the clock at each. */
void rp_sandbox_charge_callback(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!sb->in_call) return;
    if (spend(sb, RP_SANDBOX_CALLBACK_UNITS) && now_s(sb) > sb->deadline) sandbox_trip(sb, TRIP_WALL);
    if (sb->tripped != TRIP_NONE) raise_trip(sb, L);
}

void rp_sandbox_charge(lua_State *L, int64_t units)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!spend(sb, units)) raise_trip(sb, L);
}

rp_status rp_sandbox_try_charge(lua_State *L, int64_t units)
{
    return spend(rp_sandbox_of(L), units) ? RP_OK : RP_ELIMIT;
}

int64_t rp_sandbox_work_left(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!sb->in_call) return INT64_MAX;
    if (sb->tripped != TRIP_NONE || sb->work >= sb->limits.max_instructions) return 0;
    return sb->limits.max_instructions - sb->work;
}

void rp_sandbox_check_clock(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!sb->in_call) return;
    if (sb->tripped == TRIP_NONE && now_s(sb) > sb->deadline) sandbox_trip(sb, TRIP_WALL);
    if (sb->tripped != TRIP_NONE) raise_trip(sb, L);
}

int rp_sandbox_raise(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (sb->tripped == TRIP_NONE) return luaL_error(L, "rp_sandbox_raise: no limit has tripped");
    return raise_trip(sb, L);
}

void rp_sandbox_check_c_stack(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    uintptr_t here = (uintptr_t)__builtin_frame_address(0);
    if (sb->c_stack_base && here < sb->c_stack_base &&
        sb->c_stack_base - here > sb->c_stack_bytes) {
        sandbox_trip(sb, TRIP_DEPTH);
        raise_trip(sb, L);
    }
    if (sb->tripped != TRIP_NONE && sb->in_call) raise_trip(sb, L);
}

/* ---- allocator ---------------------------------------------------------------------- */

static bool in_boot_arena(const rp_sandbox *sb, const void *p)
{
    return sb->boot_arena && (const char *)p >= sb->boot_arena &&
           (const char *)p < sb->boot_arena + BOOT_ARENA_BYTES;
}

static void *boot_arena_take(rp_sandbox *sb, size_t size)
{
    size_t at = (sb->boot_used + 15) & ~(size_t)15;
    if (!sb->boot_arena || size > BOOT_ARENA_BYTES - at) return NULL;
    sb->boot_used = at + size;
    sb->boot_failed = true;
    return sb->boot_arena + at;
}


/* Allocation is work: copying and initialising the bytes (a string rebuilt by each
 * concatenation costs its length). Charged here without raising; a trip is raised by
 * the hook at the next instruction. Only blocks of 2^RP_BIG_SHIFT bytes or more are
 * charged: whether LuaJIT allocates a small block (a table's rehash after deletions, a
 * short string still interned or already collected) depends on its string hash, seeded
 * per process, and a call's work must be the same on every rank. */
static void charge_bytes(rp_sandbox *sb, size_t bytes)
{
    sb->alloc_rest += bytes;
    int64_t units = (int64_t)(sb->alloc_rest / RP_SANDBOX_BYTES_PER_UNIT);
    sb->alloc_rest %= RP_SANDBOX_BYTES_PER_UNIT;
    sb->work = units > INT64_MAX - sb->work ? INT64_MAX : sb->work + units;
    if (sb->work > sb->limits.max_instructions) trip_soon(sb, TRIP_INSTRUCTIONS);
}

/* Counts live bytes and refuses growth past the cap and blocks past the object cap;
 * frees and shrinks always pass. A refusal is remembered, so a policy that catches
 * "not enough memory" still fails. During a call, allocated bytes are charged as work
 * and a new big block shortens the hook period at once. */
void *sandbox_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    rp_sandbox *sb = ud;
    rp_context *ctx = sb->ctx;
    if (!ptr) old_size = 0;
    bool boot_block = ptr && in_boot_arena(sb, ptr);
    if (new_size == 0) {
        if (ptr) {
            if (!boot_block) ctx->alloc(ctx->alloc_ud, ptr, old_size, 0);
            sb->mem_live -= old_size;
            if (old_size >> RP_BIG_SHIFT) rp_big_removed(&sb->big, ptr, old_size);
        }
        return NULL;
    }
    if (new_size > old_size && sb->mem_armed) {
        size_t cap = sb->limits.max_memory_bytes, growth = new_size - old_size, used = sb->mem_live + sb->held_bytes;
        if (used > cap || growth > cap - used) {
            sb->mem_refused = true;
            trip_soon(sb, TRIP_MEMORY);
            return NULL;
        }
        if (new_size > sb->object_cap) {
            sb->mem_refused = true;
            trip_soon(sb, TRIP_OBJECT);
            return NULL;
        }
    }
    void *p = boot_block ? NULL : ctx->alloc(ctx->alloc_ud, ptr, old_size, new_size);
    if (!p && sb->boot_arena) {
        p = boot_block ? ctx->alloc(ctx->alloc_ud, NULL, 0, new_size) : NULL;
        if (!p) p = boot_arena_take(sb, new_size);
        if (p && ptr) {
            memcpy(p, ptr, old_size < new_size ? old_size : new_size);
            if (!boot_block) ctx->alloc(ctx->alloc_ud, ptr, old_size, 0);
        }
    }
    if (!p) {
        sb->alloc_failed = true;
        return NULL;
    }
    sb->mem_live = sb->mem_live - old_size + new_size;
    if (ptr && old_size >> RP_BIG_SHIFT) rp_big_removed(&sb->big, ptr, old_size);
    if (new_size >> RP_BIG_SHIFT) {
        rp_big_added(&sb->big, p, new_size);
        /* hook at the next instruction, which reads the header: a long string must
         * not live through a whole period of 1000 instructions */
        if (sb->in_call && sb->hook_period > 1) set_period(sb, 1, true);
    }
    if (sb->in_call && new_size > old_size && new_size >> RP_BIG_SHIFT) charge_bytes(sb, new_size - old_size);
    return p;
}

/* ---- arming a call, and the limits themselves --------------------------------------- */

/* Count hooks do not fire inside JIT-compiled traces (Debian's LuaJIT is built without
 * LUAJIT_ENABLE_CHECKHOOK). LuaJIT 2.1 only turns its compiler on in luaopen_jit, which
 * the sandbox never calls; it is still flushed and switched off before every call, so
 * whatever the engine did to the state, each loop a call runs is interpreted and hooked.
 * Without a JIT in the build the calls fail harmlessly. */
void sandbox_jit_off(lua_State *L)
{
    luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_FLUSH);
    luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
}


void sandbox_arm(rp_sandbox *sb, uintptr_t stack_base)
{
    sandbox_jit_off(sb->L);
    sb->work = sb->work_at_clock = sb->work_at_depth = 0;
    sb->alloc_rest = 0;
    sb->tripped = TRIP_NONE;
    sb->rearmed = false;
    sb->mem_refused = false;
    sb->alloc_failed = false;
    sb->where[0] = sb->trace[0] = '\0';
    sb->trace_line = -1;
    if (!sb->window) sb->deadline = now_s(sb) + sb->limits.max_wall_s;
    sb->window = false;
    sb->c_stack_base = stack_base;
    sb->mem_armed = true;
    /* big strings may live from earlier calls (a long string kept in ctx.state); dead
     * ones are collected first (not charged: the call has not begun), so that they do
     * not slow this call down */
    rp_big_classify(&sb->big);
    if (rp_big_largest(&sb->big) >= 0) sandbox_collect(sb, sb->L);
    sb->in_call = true;
    sb->hook_period = period_for(sb);
    lua_sethook(sb->L, sandbox_hook, LUA_MASKCOUNT, sb->hook_period);
}


void sandbox_disarm(rp_sandbox *sb)
{
    lua_sethook(sb->L, NULL, 0, 0);
    sb->mem_armed = false;
    sb->in_call = false;
    sb->c_stack_base = 0;
}


rp_sandbox_limits rp_sandbox_limits_default(void)
{
    rp_sandbox_limits lim = {RP_SANDBOX_DEFAULT_INSTRUCTIONS, RP_SANDBOX_DEFAULT_WALL_S,
                             RP_SANDBOX_DEFAULT_MEMORY, RP_SANDBOX_DEFAULT_DEPTH, RP_SANDBOX_DEFAULT_OBJECT, NULL, NULL};
    return lim;
}


rp_status sandbox_check_limits(const rp_sandbox_limits *lim, rp_error *err)
{
    if (lim->max_instructions < 1)
        return rp_fail(err, RP_EINVAL, "sandbox: max_instructions is %lld; it must be at least 1",
                       (long long)lim->max_instructions);
    if (!(lim->max_wall_s > 0) || !isfinite(lim->max_wall_s))
        return rp_fail(err, RP_EINVAL,
                       "sandbox: max_wall_s is %g; it must be a positive finite number of seconds",
                       lim->max_wall_s);
    if (lim->max_memory_bytes < RP_SANDBOX_MIN_MEMORY)
        return rp_fail(err, RP_EINVAL, "sandbox: max_memory_bytes is %zu; it must be at least %zu",
                       lim->max_memory_bytes, RP_SANDBOX_MIN_MEMORY);
    if (lim->max_depth < 1 || lim->max_depth > RP_SANDBOX_MAX_DEPTH)
        return rp_fail(err, RP_EINVAL, "sandbox: max_depth is %d; it must be within 1..%d",
                       (int)lim->max_depth, RP_SANDBOX_MAX_DEPTH);
    if (lim->max_object_bytes != 0 && lim->max_object_bytes < RP_SANDBOX_MIN_OBJECT)
        return rp_fail(err, RP_EINVAL, "sandbox: max_object_bytes is %zu; it must be 0 (the default) or at least %zu",
                       lim->max_object_bytes, RP_SANDBOX_MIN_OBJECT);
    return RP_OK;
}

