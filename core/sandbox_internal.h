/* The sandbox's private state and the calls between its files (sandbox_limits.c at the
 * bottom, the library replacements above it, sandbox.c on top; sandbox_access.c's
 * accessors). Nothing outside the sandbox includes this. */
#ifndef RP_SANDBOX_INTERNAL_H
#define RP_SANDBOX_INTERNAL_H

#include "sandbox.h"
#include "sandbox_big.h"
#include "sandbox_stack.h"

#include <time.h>

typedef enum trip_kind {
    TRIP_NONE = 0,
    TRIP_INSTRUCTIONS,
    TRIP_WALL,
    TRIP_MEMORY,
    TRIP_DEPTH,
    TRIP_OBJECT,
    TRIP_KINDS
} trip_kind;

/* Registry references made at creation, so that raising a limit error, calling the
 * message handler or reaching the environment never allocates. */
enum { REF_ENV, REF_MSGH, REF_GC, REF_ERROR_TEXT, REF_MSG_FIRST, REF_COUNT = REF_MSG_FIRST + TRIP_KINDS };

struct rp_sandbox {
    rp_context *ctx;
    lua_State *L;
    rp_sandbox_limits limits;
    size_t object_cap; /* the largest block allowed while armed */
    /* Bytes the engine holds for the policy outside the state (the copy of ctx.state it
     * keeps, core/policy_state_bin.c), counted against max_memory_bytes with mem_live. */
    size_t held_bytes;
    int refs[REF_COUNT];
    uint64_t prng[4];

    /* Memory: live bytes as the allocator sees them; the cap is enforced while armed
     * (during creation, loading and calls), so the engine's own pushes between calls
     * never fail because a policy filled the state. */
    size_t mem_live;
    bool mem_armed;
    bool mem_refused;
    bool alloc_failed; /* the context's allocator failed (the process is out of memory) */
    size_t gc_next; /* live bytes at which the hook runs an emergency collection */
    rp_big_blocks big; /* which big blocks are strings: the hook period follows them */
    size_t alloc_rest; /* allocated bytes not yet charged (less than a unit) */
    /* LuaJIT 2.1's lua_newstate crashes when one of its first allocations fails (its
     * cleanup walks a string table not yet allocated). While it runs, a failed
     * allocation is served from this arena instead, and the finished state is then
     * closed and reported as out of memory. */
    char *boot_arena;
    size_t boot_used;
    bool boot_failed;

    /* The running call. */
    bool in_call;
    int64_t work;
    int64_t work_at_clock;
    int64_t work_at_depth;
    int hook_period; /* instructions between two hooks now */
    double deadline;
    bool window; /* deadline set by rp_sandbox_open_window for the next call */
    trip_kind tripped;
    bool rearmed; /* hook set to fire at every instruction */
    uintptr_t c_stack_base;
    size_t c_stack_bytes; /* the call's C stack guard: RP_SANDBOX_C_STACK_BYTES or less */
    sandbox_stack stack;  /* the calling thread's stack bounds */
    char where[192];  /* where the limit tripped */
    char trace[320];  /* short traceback of the error that reached rp_sandbox_call */
    int32_t trace_line;
};

static inline double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double now_s(const rp_sandbox *sb)
{
    return sb->limits.clock_s ? sb->limits.clock_s(sb->limits.clock_ud) : monotonic_s();
}

/* Chunk name of the sandbox's own Lua wrappers; their frames are left out of traces. */
#define PRELUDE_NAME "=(sandbox)"
/* Covers every allocation lua_newstate makes (52 allocations, 12 KB in LuaJIT 2.1). */
#define BOOT_ARENA_BYTES ((size_t)32 << 10)

/* sandbox_limits.c */

/* The message a tripped limit raises, into buf. */
void sandbox_limit_message(const rp_sandbox_limits *lim, trip_kind kind, char *buf, size_t n);
/* Record a trip (the first one wins); the hook or the next charge raises it. */
void sandbox_trip(rp_sandbox *sb, trip_kind kind);
/* A short traceback of the error at the top of L's stack, for rp_sandbox_call's message. */
void sandbox_record_trace(rp_sandbox *sb, lua_State *L);
/* lua_CFunction: a full collection (the registry's REF_GC). */
int sandbox_gc_collect(lua_State *L);
/* A protected full collection; sets the next collection's threshold. */
void sandbox_collect(rp_sandbox *sb, lua_State *L);
/* The capped lua_Alloc (ud: the sandbox). */
void *sandbox_alloc(void *ud, void *ptr, size_t old_size, size_t new_size);
void sandbox_jit_off(lua_State *L);
/* Arm the limits for one call (stack_base: the caller's frame) and disarm them after. */
void sandbox_arm(rp_sandbox *sb, uintptr_t stack_base);
void sandbox_disarm(rp_sandbox *sb);
rp_status sandbox_check_limits(const rp_sandbox_limits *lim, rp_error *err);

/* sandbox_lib.c: the library replacements (lua_CFunctions) */

int sandbox_lib_pairs(lua_State *L);
int sandbox_lib_next(lua_State *L);
int sandbox_lib_tostring(lua_State *L);
int sandbox_lib_getmetatable(lua_State *L);
int sandbox_lib_collectgarbage(lua_State *L);
int sandbox_lib_random(lua_State *L);
int sandbox_lib_randomseed(lua_State *L);
int sandbox_lib_handler_for(lua_State *L);
int sandbox_lib_format_args(lua_State *L);
int sandbox_lib_sort_check(lua_State *L);
int sandbox_lib_check_clock(lua_State *L);
int sandbox_lib_charge_args(lua_State *L);

#endif
