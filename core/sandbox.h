/* The Lua sandbox that policies run in: a whitelisted environment, per-call limits
 * (instructions, wall time, memory, call depth) and bounded library functions.
 * Private to the core (not installed); the policy engine builds `rp` on top of it. */
#ifndef RP_SANDBOX_H
#define RP_SANDBOX_H

#include "internal.h"

#include <lua.h>

/* Limits of one sandbox. Every limit applies afresh to each rp_sandbox_call (and to
 * the chunk run by rp_sandbox_load_text); the memory cap covers the whole state. */
typedef struct rp_sandbox_limits {
    /* Work per call: Lua VM instructions (counted by a hook every
     * RP_SANDBOX_HOOK_PERIOD instructions) plus the work units that bounded C functions
     * charge (one unit per matcher step, per element sorted, ...). >= 1. */
    int64_t max_instructions;
    /* Wall-clock seconds per call, a safety stop only (plans must not depend on time).
     * Finite, > 0. */
    double max_wall_s;
    /* Live bytes of the whole Lua state (everything the policy and the engine put in it).
     * At least RP_SANDBOX_MIN_MEMORY. */
    size_t max_memory_bytes;
    /* Lua call depth (stack levels, as lua_getstack counts them), 1 ..
     * RP_SANDBOX_MAX_DEPTH. */
    int32_t max_depth;
    /* The largest single block the state may allocate during a call: the longest string
     * a policy can build (and the largest array or hash part of one table). One VM
     * instruction can do work proportional to a string's length (a comparison, a
     * coercion to a number) with no hook in between, so this bounds what one instruction
     * costs. 0 means RP_SANDBOX_DEFAULT_OBJECT; else at least RP_SANDBOX_MIN_OBJECT.
     * Never more than max_memory_bytes in effect. */
    size_t max_object_bytes;
    /* The clock the wall-time limit reads, in seconds (monotonic, any origin); NULL:
     * CLOCK_MONOTONIC. Tests inject one (rp_sandbox_set_clock), so that they do not
     * depend on the machine's speed; a policy rebuilt from its limits keeps it. */
    double (*clock_s)(void *ud);
    void *clock_ud;
} rp_sandbox_limits;

#define RP_SANDBOX_DEFAULT_INSTRUCTIONS INT64_C(200000000)
#define RP_SANDBOX_DEFAULT_WALL_S 5.0
#define RP_SANDBOX_DEFAULT_MEMORY ((size_t)256 << 20)
#define RP_SANDBOX_DEFAULT_DEPTH 200
#define RP_SANDBOX_MIN_MEMORY ((size_t)1 << 20)
#define RP_SANDBOX_MAX_DEPTH 10000
#define RP_SANDBOX_DEFAULT_OBJECT ((size_t)8 << 20)
#define RP_SANDBOX_MIN_OBJECT ((size_t)64 << 10)
/* The count hook runs every this many VM instructions, fewer while big objects live
 * (RP_SANDBOX_TOUCH_BYTES). */
#define RP_SANDBOX_HOOK_PERIOD 1000
/* While blocks of 16 KiB or more are live, the hook period shrinks so that the
 * instructions between two hooks touch at most about this many bytes of strings:
 * period = min(1000, RP_SANDBOX_TOUCH_BYTES / the largest live block's size class),
 * at least 1. */
#define RP_SANDBOX_TOUCH_BYTES ((size_t)8 << 20)
/* Allocated bytes are work: one unit per this many bytes a call allocates (about the
 * cost of one VM instruction in copying and initialising them). */
#define RP_SANDBOX_BYTES_PER_UNIT 16
/* C stack a call may use below rp_sandbox_call's frame for C functions that call back
 * into Lua (gsub with a function, sort with a comparator, __tostring, ...). Deeper
 * nesting trips the depth limit. On a thread with less stack the guard shrinks to what
 * the thread has below the call less RP_SANDBOX_C_STACK_RESERVE (found with
 * pthread_getattr_np), and a call that would get less than RP_SANDBOX_C_STACK_MIN is
 * refused (RP_EINVAL). */
#define RP_SANDBOX_C_STACK_BYTES ((size_t)256 << 10)
/* Kept free below the guard for LuaJIT itself (its parser, the allocator, raising an
 * error) and the sandbox's own C frames: measured under 40 KiB without sanitizers;
 * AddressSanitizer's frames are several times larger. */
#if defined(__SANITIZE_ADDRESS__)
#define RP_SANDBOX_C_STACK_RESERVE ((size_t)256 << 10)
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RP_SANDBOX_C_STACK_RESERVE ((size_t)256 << 10)
#endif
#endif
#ifndef RP_SANDBOX_C_STACK_RESERVE
#define RP_SANDBOX_C_STACK_RESERVE ((size_t)64 << 10)
#endif
/* The least guard a call runs with: C callbacks two levels deep (gsub holds 8 KiB). */
#define RP_SANDBOX_C_STACK_MIN ((size_t)16 << 10)

/* What one callback from a C loop into Lua or C costs (rp_sandbox_charge_callback): the
 * call's own frame, about as much as a few VM instructions. */
#define RP_SANDBOX_CALLBACK_UNITS 4

typedef struct rp_sandbox rp_sandbox;

/* The documented defaults: 200M instructions, 5 s, 256 MiB, 200 levels. */
rp_sandbox_limits rp_sandbox_limits_default(void);

/* Create a sandbox: a fresh lua_State whose allocator goes through `ctx` and enforces
 * limits->max_memory_bytes, with LuaJIT's JIT compiler off (so count hooks fire in every
 * loop) and the policy environment built by whitelist (see docs/sandbox.md). `limits`
 * NULL means the defaults. RP_EINVAL for a limit out of range, RP_ELIMIT when the memory
 * cap cannot hold a fresh state, RP_ENOMEM when the allocator fails. The caller frees
 * *out with rp_sandbox_free. One sandbox holds one policy and is used by one thread at
 * a time; sandboxes share nothing, so several may run on different threads at once. */
rp_status rp_sandbox_new(rp_context *ctx, const rp_sandbox_limits *limits, rp_sandbox **out,
                         rp_error *err);
/* Close the state and free everything it holds. NULL is a no-op. */
void rp_sandbox_free(rp_sandbox *sb);

/* The sandbox's state, for the engine to push values and build the `rp` API. Calls that
 * allocate (pushes, table building) must run inside rp_sandbox_call or lua_cpcall: an
 * error outside a protected call would make LuaJIT's panic handler exit. Policy code
 * must only run through rp_sandbox_call, which is what arms the limits. */
lua_State *rp_sandbox_state(rp_sandbox *sb);
/* The sandbox that owns `L` (the main state or any of its threads). */
rp_sandbox *rp_sandbox_of(lua_State *L);
/* Push the policy environment (the table policy chunks run with as their globals). The
 * engine sets `rp` in it; it starts as an empty table. Pushing does not allocate. */
void rp_sandbox_push_env(rp_sandbox *sb);
/* Seed math.random (xoshiro256**, the sandbox's own state): same seed, same sequence,
 * on every rank and in every sandbox. A new sandbox is seeded with 0. */
void rp_sandbox_seed(rp_sandbox *sb, uint64_t seed);
/* Live bytes held by the state now. */
size_t rp_sandbox_memory_bytes(const rp_sandbox *sb);
/* Work units (instructions and charged C work) the last call used. */
int64_t rp_sandbox_work(const rp_sandbox *sb);
const rp_sandbox_limits *rp_sandbox_limits_of(const rp_sandbox *sb);
/* The instruction limit of later calls (>= 1; the engine sizes it to the step). */
void rp_sandbox_set_max_instructions(rp_sandbox *sb, int64_t max_instructions);
/* The clock the wall-time limit reads, in seconds (monotonic, any origin); NULL restores
 * CLOCK_MONOTONIC. For tests of the wall-time limit: an injected clock makes them
 * independent of the machine's speed. Takes effect at the next call. */
void rp_sandbox_set_clock(rp_sandbox *sb, double (*clock_s)(void *ud), void *ud);
/* The wall-time limit of later calls (> 0, finite; tests shorten it after loading). */
void rp_sandbox_set_max_wall_s(rp_sandbox *sb, double max_wall_s);
/* The clock the wall-time limit reads, now. */
double rp_sandbox_now(const rp_sandbox *sb);
/* The next call's wall-time limit counts from `start` (a reading of rp_sandbox_now)
 * instead of from the call's start: work the engine does for the policy before the
 * call (rebuilding it after a limit trip, core/policy_rebuild.c) is charged to the
 * call's wall time. The deadline is start + max_wall_s from now on. */
void rp_sandbox_open_window(rp_sandbox *sb, double start);
/* Whether the clock has passed the deadline of the last call (or of the window opened
 * for the next): engine work after or before a call reads it to stop at the limit. */
bool rp_sandbox_past_deadline(const rp_sandbox *sb);
/* Bytes the engine holds for the policy outside its state (the copy of ctx.state kept
 * after each call): counted against max_memory_bytes together with the state's live
 * bytes from now on, so a call can use that much less. */
void rp_sandbox_hold_bytes(rp_sandbox *sb, size_t bytes);
size_t rp_sandbox_held_bytes(const rp_sandbox *sb);

/* Compile `source` (text only: precompiled bytecode is refused) as a chunk named
 * `chunkname` ("policy.lua"; NULL means "policy"), give it the policy environment, run
 * it under the limits, and push its first return value (nil if none). Errors:
 * RP_EPOLICY for bytecode, a syntax error ("policy.lua:3: ...", err->line set) or a
 * runtime error, RP_ELIMIT when a limit trips, RP_ENOMEM; the stack is then unchanged. */
rp_status rp_sandbox_load_text(rp_sandbox *sb, const char *source, size_t len,
                               const char *chunkname, rp_error *err);

/* lua_pcall with the limits armed afresh: the function and `nargs` arguments on top of
 * the stack are replaced by `nresults` results (LUA_MULTRET for all). On failure they
 * are removed and nothing is pushed: RP_ELIMIT ("policy exceeded the instruction limit
 * (200000000)", "... the wall-time limit of 5 s", "... the memory limit of 256 MiB",
 * "... the call depth limit of 200", each followed by where it ran), RP_EPOLICY for a
 * Lua error (its message, then a short traceback; err->line is the innermost policy
 * line), RP_ENOMEM when the context's allocator failed, RP_EINVAL for a bad stack or a
 * nested call. A tripped limit cannot be caught by the policy's pcall. Afterwards the
 * state is usable again (limits disarmed, garbage collected after a memory trip); the
 * policy's own tables are as the interrupted code left them. */
rp_status rp_sandbox_call(rp_sandbox *sb, int nargs, int nresults, rp_error *err);

/* For C functions reachable from a policy. Charge `units` of work to the running call's
 * instruction budget (and check the wall clock); raises the limit error (a Lua error:
 * hold no malloc'ed memory across it) when a limit trips. Outside a call it does
 * nothing. Every C function whose work can exceed the memory it produces must charge
 * before or while it works. */
void rp_sandbox_charge(lua_State *L, int64_t units);
/* For a C loop that calls back into Lua or C (a comparator, a metamethod, a replacement
 * function): charge RP_SANDBOX_CALLBACK_UNITS and read the clock, before each callback.
 * Raises the limit error when a limit has tripped. Outside a call it does nothing. */
void rp_sandbox_charge_callback(lua_State *L);
/* The non-raising form: charge and return RP_ELIMIT when a limit has tripped; the
 * caller frees what it holds and then calls rp_sandbox_raise(L). */
rp_status rp_sandbox_try_charge(lua_State *L, int64_t units);
/* Work units the running call may still charge before the instruction limit trips
 * (0 once it has; INT64_MAX outside a call): the budget a C function that counts its
 * work as it goes gives itself, stopping when it is spent. */
int64_t rp_sandbox_work_left(lua_State *L);
/* Raise the error of the tripped limit (does not return). */
int rp_sandbox_raise(lua_State *L);
/* Read the clock now and raise the wall-time limit's error if the call's time is up
 * (or any limit has tripped). Call it after C work that may have run long (a host
 * primitive, a library function), so that such a call fails even when it returned. */
void rp_sandbox_check_clock(lua_State *L);
/* Call before a C function calls back into Lua: trips the depth limit when the C stack
 * below rp_sandbox_call exceeds the call's guard (RP_SANDBOX_C_STACK_BYTES, less on a
 * small thread stack). */
void rp_sandbox_check_c_stack(lua_State *L);

/* Inside the sandbox (sandbox_string.c): set the bounded pattern functions find, match,
 * gmatch and gsub in the table at stack index `table`. */
void rp_sandbox_open_string(lua_State *L, int table);
/* Inside the sandbox (sandbox_table.c): set the charged table.insert in the table at stack
 * index `table` and unpack in the environment at `env`. */
void rp_sandbox_open_table(lua_State *L, int env, int table);
/* Push the C part of table.sort (every comparison charged; the prelude wraps it). */
void rp_sandbox_push_sort(lua_State *L);
/* Push the sandbox's tostring of the value at `idx` (no addresses). */
void rp_sandbox_tostring(lua_State *L, int idx);

#endif
