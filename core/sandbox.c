/* The Lua sandbox policies run in: a state with a capped allocator and the JIT off, the
 * whitelisted environment, and per-call limits enforced by a count hook (docs/sandbox.md;
 * what a policy sees: docs/policies.md, "The sandbox"). */
#include "sandbox_internal.h"

#include <lauxlib.h>
#include <luajit.h>
#include <lualib.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Units the string matcher and other C functions may accumulate between clock reads. */
#define CLOCK_EVERY_UNITS 65536
/* Covers every allocation lua_newstate makes (52 allocations, 12 KB in LuaJIT 2.1). */
#define BOOT_ARENA_BYTES ((size_t)32 << 10)
/* Bytes of a string the library wrappers charge one unit for when they scan or compare
 * it (measured: comparing two long strings runs at ~0.7 GB/s, coercing one to a number
 * at ~0.25 GB/s, against ~200 M VM instructions a second). */
#define SCAN_BYTES_PER_UNIT 4
/* Chunk name of the sandbox's own Lua wrappers; their frames are left out of traces. */
#define PRELUDE_NAME "=(sandbox)"
/* Keys pairs and next visit between two charges (a charge may raise: nothing is held). */
#define KEYS_PER_CHARGE 4096
/* Bytes of two string keys memcmp compares for one unit (pairs' sort, next). */
#define KEY_BYTES_PER_UNIT 64

/* The sandbox's Lua-side wrappers: lua/sandbox_prelude.lua, compiled in as
 * rp_lua_sandbox_prelude (a generated header; see cmake/EmbedLua.cmake). */
#include "lua_sandbox_prelude.h"

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

static void limit_message(const rp_sandbox_limits *lim, trip_kind kind, char *buf, size_t n)
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
static void record_trace(rp_sandbox *sb, lua_State *L)
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

static void trip(rp_sandbox *sb, trip_kind kind)
{
    if (sb->tripped == TRIP_NONE) sb->tripped = kind;
}

/* A limit tripped where no error can be raised (in the allocator): make the hook fire
 * at the next instruction, where it raises. */
static void trip_soon(rp_sandbox *sb, trip_kind kind)
{
    trip(sb, kind);
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

static int gc_collect(lua_State *L)
{
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}

/* Protected full collection (a finalizer error or a refused string-table resize
 * cannot escape into the hook or the caller). */
static void collect(rp_sandbox *sb, lua_State *L)
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
        if (sb->work > sb->limits.max_instructions) trip(sb, TRIP_INSTRUCTIONS);
        else if (now_s(sb) > sb->deadline) trip(sb, TRIP_WALL);
        else if (depth_due && lua_getstack(L, sb->limits.max_depth, &deep)) trip(sb, TRIP_DEPTH);
        else {
            if (depth_due) sb->work_at_depth = sb->work;
            sb->work_at_clock = sb->work;
            if (sb->mem_live >= sb->gc_next) collect(sb, L);
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
        trip(sb, TRIP_INSTRUCTIONS);
        return false;
    }
    if (sb->work - sb->work_at_clock >= CLOCK_EVERY_UNITS) {
        sb->work_at_clock = sb->work;
        if (now_s(sb) > sb->deadline) {
            trip(sb, TRIP_WALL);
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
    if (spend(sb, RP_SANDBOX_CALLBACK_UNITS) && now_s(sb) > sb->deadline) trip(sb, TRIP_WALL);
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
    if (sb->tripped == TRIP_NONE && now_s(sb) > sb->deadline) trip(sb, TRIP_WALL);
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
        trip(sb, TRIP_DEPTH);
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
static void *sandbox_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
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

/* ---- deterministic PRNG (xoshiro256**, seeded through splitmix64) ------------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void prng_seed(uint64_t s[4], uint64_t seed)
{
    for (int i = 0; i < 4; i++) s[i] = splitmix64(&seed);
}

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t prng_next(uint64_t s[4])
{
    uint64_t result = rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

static double bounded_integer_arg(lua_State *L, int arg)
{
    double v = floor(luaL_checknumber(L, arg));
    if (!(fabs(v) <= 9007199254740992.0)) luaL_argerror(L, arg, "number out of range (beyond 2^53)");
    return v;
}

/* math.random with Lua 5.1's signature: () in [0,1), (m) in [1,m], (m,n) in [m,n];
 * integers are uniform (rejection sampling, no modulo bias). */
static int sb_random(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    int nargs = lua_gettop(L);
    double lo, hi;
    if (nargs == 0) {
        lua_pushnumber(L, (double)(prng_next(sb->prng) >> 11) * 0x1.0p-53);
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
    do x = prng_next(sb->prng);
    while (x >= limit);
    lua_pushnumber(L, lo + (double)(x % range));
    return 1;
}

static int sb_randomseed(lua_State *L)
{
    double v = luaL_checknumber(L, 1);
    uint64_t bits;
    if (v == 0) v = 0; /* -0 and 0 seed alike */
    memcpy(&bits, &v, sizeof bits);
    prng_seed(rp_sandbox_of(L)->prng, bits);
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

static int sb_tostring(lua_State *L)
{
    luaL_checkany(L, 1);
    rp_sandbox_tostring(L, 1);
    return 1;
}

/* The real metatable only of tables; of anything else (strings, the engine's userdata)
 * only its __metatable field, so the shared string metatable is never handed out. */
static int sb_getmetatable(lua_State *L)
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

static int sb_collectgarbage(lua_State *L)
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

static int sb_pairs(lua_State *L)
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
static int sb_next(lua_State *L)
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
static int sb_sort_check(lua_State *L)
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

static int sb_check_clock(lua_State *L)
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
static int sb_charge_args(lua_State *L)
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

static int sb_handler_for(lua_State *L)
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
static int sb_format_args(lua_State *L)
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
static void jit_off(lua_State *L);

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
    set_function(L, 1, "pairs", sb_pairs);
    set_function(L, 1, "next", sb_next);
    set_function(L, 1, "tostring", sb_tostring);
    set_function(L, 1, "getmetatable", sb_getmetatable);
    set_function(L, 1, "collectgarbage", sb_collectgarbage);

    lua_getglobal(L, LUA_MATHLIBNAME); /* 2 */
    lua_newtable(L);                   /* 3 */
    copy_fields(L, 2, 3, math_names);
    set_function(L, 3, "random", sb_random);
    set_function(L, 3, "randomseed", sb_randomseed);
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
    lua_pushcfunction(L, sb_handler_for);
    lua_getfield(L, 4, "format");
    lua_pushcfunction(L, sb_format_args);
    rp_sandbox_push_sort(L);
    lua_pushcfunction(L, sb_sort_check);
    lua_pushcfunction(L, sb_check_clock);
    lua_pushcfunction(L, sb_charge_args);
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
    lua_pushcfunction(L, gc_collect);
    sb->refs[REF_GC] = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushcfunction(L, error_object_text);
    sb->refs[REF_ERROR_TEXT] = luaL_ref(L, LUA_REGISTRYINDEX);
    for (int kind = 0; kind < TRIP_KINDS; kind++) {
        char msg[128];
        limit_message(&sb->limits, (trip_kind)kind, msg, sizeof msg);
        lua_pushstring(L, msg);
        sb->refs[REF_MSG_FIRST + kind] = luaL_ref(L, LUA_REGISTRYINDEX);
    }
    lua_settop(L, 0);
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}

rp_sandbox_limits rp_sandbox_limits_default(void)
{
    rp_sandbox_limits lim = {RP_SANDBOX_DEFAULT_INSTRUCTIONS, RP_SANDBOX_DEFAULT_WALL_S,
                             RP_SANDBOX_DEFAULT_MEMORY, RP_SANDBOX_DEFAULT_DEPTH, RP_SANDBOX_DEFAULT_OBJECT, NULL, NULL};
    return lim;
}

static rp_status check_limits(const rp_sandbox_limits *lim, rp_error *err)
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

rp_status rp_sandbox_new(rp_context *ctx, const rp_sandbox_limits *limits, rp_sandbox **out,
                         rp_error *err)
{
    rp_sandbox_limits lim = limits ? *limits : rp_sandbox_limits_default();
    rp_status st = check_limits(&lim, err);
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
    prng_seed(sb->prng, 0);

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
    jit_off(L);
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

void rp_sandbox_seed(rp_sandbox *sb, uint64_t seed) { prng_seed(sb->prng, seed); }

/* ---- calls -------------------------------------------------------------------------- */

/* Message handler of rp_sandbox_call: notes where the error came from, in C memory. */
static int sandbox_msgh(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    if (!sb->trace[0]) record_trace(sb, L);
    lua_settop(L, 1);
    return 1;
}

/* Count hooks do not fire inside JIT-compiled traces (Debian's LuaJIT is built without
 * LUAJIT_ENABLE_CHECKHOOK). LuaJIT 2.1 only turns its compiler on in luaopen_jit, which
 * the sandbox never calls; it is still flushed and switched off before every call, so
 * whatever the engine did to the state, each loop a call runs is interpreted and hooked.
 * Without a JIT in the build the calls fail harmlessly. */
static void jit_off(lua_State *L)
{
    luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_FLUSH);
    luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
}

static void arm(rp_sandbox *sb, uintptr_t stack_base)
{
    jit_off(sb->L);
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
    if (rp_big_largest(&sb->big) >= 0) collect(sb, sb->L);
    sb->in_call = true;
    sb->hook_period = period_for(sb);
    lua_sethook(sb->L, sandbox_hook, LUA_MASKCOUNT, sb->hook_period);
}

static void disarm(rp_sandbox *sb)
{
    lua_sethook(sb->L, NULL, 0, 0);
    sb->mem_armed = false;
    sb->in_call = false;
    sb->c_stack_base = 0;
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
        limit_message(&sb->limits, sb->tripped, msg, sizeof msg);
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
        limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
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
    arm(sb, (uintptr_t)__builtin_frame_address(0));
    int status = lua_pcall(L, nargs, nresults, func);
    /* the clock after the call: C work at its end (a host primitive, a library function)
     * may have run past the limit with no hook after it; such a call fails even though
     * it returned */
    if (status == 0 && sb->tripped == TRIP_NONE && now_s(sb) > sb->deadline) {
        trip(sb, TRIP_WALL);
        snprintf(sb->where, sizeof sb->where, "the end of the call");
    }
    rp_status st = RP_OK;
    if (status != 0 || sb->tripped != TRIP_NONE) st = describe_failure(sb, status, err);
    disarm(sb);
    if (st != RP_OK) {
        lua_settop(L, func - 1);
        if (sb->mem_refused) collect(sb, L);
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
            limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
            st = rp_fail(err, RP_ELIMIT, "%s: %s while compiling", chunkname, msg);
        } else if (status == LUA_ERRMEM && sb->alloc_failed) {
            st = rp_fail(err, RP_ENOMEM, "%s: out of memory while compiling", chunkname);
        } else if (status == LUA_ERRMEM) {
            char msg[128];
            limit_message(&sb->limits, TRIP_MEMORY, msg, sizeof msg);
            st = rp_fail(err, RP_ELIMIT, "%s: %s while compiling (a token larger than LuaJIT can hold)", chunkname,
                         msg);
        } else {
            const char *msg = lua_tostring(L, -1);
            st = rp_fail(err, RP_EPOLICY, "%s", msg ? msg : "syntax error");
            if (err && msg) err->line = message_line(msg);
        }
        lua_pop(L, 1);
        sb->tripped = TRIP_NONE;
        if (sb->mem_refused) collect(sb, L);
        return st;
    }
    rp_sandbox_push_env(sb);
    lua_setfenv(L, -2);
    return protected_call(sb, lua_gettop(L), 0, 1, err);
}
