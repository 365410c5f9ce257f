/* The Lua host of the policy engine (private): the `rp` API table, the read-only `ctx`
 * views and the plan userdata that policies see, built on the sandbox (core/sandbox.h).
 * The user-facing reference is docs/policies.md. */
#ifndef RP_LUA_API_H
#define RP_LUA_API_H

#include "internal.h"
#include "sandbox.h"
#include "routepack/cost.h"

#include <lauxlib.h>
#include <lua.h>

/* Past steps' expert loads, most recent first (ctx.history). */
typedef struct rp_lua_history {
    int32_t count;
    const int64_t *steps;          /* [count] */
    const int64_t *const *loads;   /* [count], each [num_layers * num_experts] */
} rp_lua_history;

/* What one policy call sees. Everything is borrowed for the duration of the call. */
typedef struct rp_lua_frame {
    int64_t step;
    uint64_t seed;
    const rp_batch *batch;       /* NULL in init */
    const rp_stats *stats;       /* NULL in init */
    rp_cost *cost;               /* NULL in init */
    const rp_plan *placement;    /* the placement in use; NULL on the first step and in init */
    /* ctx.plan's content, made on first use (the packing so far, else the safe default
     * packing; the placement in use, else contiguous). NULL with err set on failure. */
    const rp_plan *(*base)(void *ud, rp_error *err);
    void *base_ud;
    const rp_lua_history *history; /* NULL: no history */
} rp_lua_frame;

/* One per sandbox. Plans and scratch that the policy's C calls allocate go through
 * plan_ctx, whose live bytes are capped (the sandbox's memory limit), so a policy cannot
 * exhaust memory through C objects the Lua allocator does not see. */
/* A policy's account of its migration decision this step (rp.decision): the step
 * report's persistence fields (routepack/sched.h). */
typedef struct rp_lua_decision {
    bool set;
    double persistence;          /* the persistence estimate the decision used, [0, 1] */
    int32_t observations;        /* scored steps behind it (0: the prior) */
    double predicted_saving_s;   /* this step's placement change: its saving on this batch */
    bool realised_scored;
    double realised_saving_s;    /* an earlier change's saving on this batch */
} rp_lua_decision;

typedef struct rp_lua_host {
    rp_context *ctx;             /* the engine's context */
    rp_context plan_ctx;
    size_t plan_live, plan_cap;
    bool plan_refused;
    const rp_config *cfg;
    rp_sandbox *sb;
    int32_t *slot_begin;         /* [ep_size + 1] per EP rank, from the config */
    char policy_name[64];        /* for rp.log */
    int engine_ref;              /* registry: the engine's trampoline (rp_lua_host_init) */
    uint64_t generation;         /* of the running call; views of other calls are dead */
    const rp_lua_frame *frame;   /* the running call's; NULL outside calls */
    /* rp.log in the running call: records and bytes sent, records dropped past the
     * per-call limits (RP_LUA_LOG_RECORDS, RP_LUA_LOG_BYTES) */
    int64_t log_records, log_bytes, log_dropped;
    /* rp.decision in the running call (cleared when a call starts): what the policy
     * says about its migration decision, copied into the step report */
    rp_lua_decision decision;
    /* rp.joint's fallback check in the running call (cleared when a call starts): calls
     * that ran it, and of them those where a baseline beat the joint plan */
    int32_t fallback_checks, fallback_changes;
} rp_lua_host;

/* What rp.log may send to the context's log in one call (one step of one policy): a
 * policy that logs in a loop cannot flood the trainer's log. Past either limit records
 * are counted, not sent, and one line at the end of the call says how many. */
#define RP_LUA_LOG_RECORDS 100
#define RP_LUA_LOG_BYTES ((int64_t)64 << 10)

/* Prepare `host` for sandbox `sb` and fill its `rp` table (inside a protected call).
 * `engine` is kept in the registry (host->engine_ref), so that the engine can call it
 * later without allocating outside a protected call: push it with lua_rawgeti and run
 * it with rp_sandbox_call. The host must outlive the sandbox (plans the policy holds are
 * freed by the sandbox's collector through host->plan_ctx). */
rp_status rp_lua_host_init(rp_lua_host *host, rp_context *ctx, const rp_config *cfg, rp_sandbox *sb,
                           lua_CFunction engine, rp_error *err);
/* Free what the host holds (after rp_sandbox_free). */
void rp_lua_host_release(rp_lua_host *host);

/* Make `frame` the running call's and start a new generation; NULL ends it (and
 * reports the log records the call dropped, if any). */
void rp_lua_host_bind(rp_lua_host *host, const rp_lua_frame *frame);

/* ---- inside a call (these raise Lua errors) ---- */

/* The host of a state (stored in the registry by rp_lua_host_init, through
 * rp_lua_host_set; core/lua_host.c, with the helpers below). */
rp_lua_host *rp_lua_host_of(lua_State *L);
void rp_lua_host_set(lua_State *L, rp_lua_host *host);
/* plan_ctx's allocator (ud: the host): counts live bytes and refuses growth past the cap. */
void *rp_lua_plan_alloc(void *ud, void *ptr, size_t old_size, size_t new_size);
/* "N MiB" for whole MiB, else "N bytes", into buf. */
void rp_lua_format_mib(size_t bytes, char *buf, size_t n);

/* Push a new ctx table for the bound frame: step, seed, topology, model, limits, and
 * (when the frame has a batch) batch, stats, history, placement, cost and a lazy plan.
 * The caller adds params and state. */
void rp_lua_push_ctx(lua_State *L, rp_lua_host *host);

/* Where a conversion stores the plan it allocates as soon as it exists, so that an
 * error raised later does not leak it (the owner frees *slot). */
typedef struct rp_lua_plan_out {
    rp_plan *plan;
    bool has_packing, has_placement, has_levers;
} rp_lua_plan_out;

/* Convert the plan at `idx` (a table in the plan shape, or a plan userdata) into a new
 * plan allocated in `into`. `what` names it in messages ("plan"). `num_seqs` is the
 * batch's sequence count (-1: none; the table must then give num_seqs with a packing);
 * `base_mb` the microbatch count to use for levers when the table has no packing.
 * Raises an error naming the offending path ("plan.packing[3][2][5]: sequence id 9000
 * out of range (4096 sequences)"); work is charged to the sandbox. */
void rp_lua_to_plan(lua_State *L, int idx, rp_lua_host *host, rp_context *into, const char *what,
                    int32_t num_seqs, int32_t base_mb, rp_lua_plan_out *out);

/* Is the value at idx a plan userdata holding a plan? Then its plan, else NULL. */
const rp_plan *rp_lua_test_plan(lua_State *L, int idx);
/* The plan of a plan userdata argument, or an error naming the function. */
rp_plan *rp_lua_check_plan(lua_State *L, int idx, const char *fname);
/* Push a new, empty plan userdata and return its holder: the caller parks the plan it
 * makes (allocated in host->plan_ctx) in holder->plan at once; the userdata frees it
 * when collected, so a plan parked there never leaks, whatever error follows. */
rp_lua_plan_out *rp_lua_push_plan(lua_State *L);
/* Push the packing / placement of `plan` as Lua tables in the plan shape (nil if it
 * has none). */
void rp_lua_push_packing(lua_State *L, const rp_plan *plan);
void rp_lua_push_placement(lua_State *L, const rp_plan *plan);

/* Deep copy of `src` made in `into` (rp_plan_copy keeps the source's context). Parts
 * are taken from the sources given (NULL: none): packing (with its microbatch count),
 * placement, levers (extra replicas and shares). The microbatch count is the packing
 * source's, else the levers source's, else `num_microbatches`. */
rp_status rp_lua_plan_compose(rp_context *into, const rp_config *cfg, const rp_plan *packing,
                              const rp_plan *placement, const rp_plan *levers,
                              int32_t num_microbatches, rp_plan **out, rp_error *err);

/* Views: the length of the view at idx (-1 if it is not a view; an error if it is a
 * view from another call), and its values as doubles. */
int32_t rp_lua_view_length(lua_State *L, int idx);
void rp_lua_view_to_doubles(lua_State *L, int idx, double *out);

/* The C primitives of the `rp` table (core/lua_prims.c): rp.argsort, rp.topk, rp.lpt,
 * rp.kk, rp.partition2, rp.replicas, rp.place. */
int rp_lua_argsort(lua_State *L);
int rp_lua_topk(lua_State *L);
int rp_lua_lpt(lua_State *L);
int rp_lua_kk(lua_State *L);
int rp_lua_partition2(lua_State *L);
int rp_lua_replicas(lua_State *L);
int rp_lua_place(lua_State *L);

/* Largest part counts and rounds an rp.* call accepts from a policy. */
#define RP_LUA_MAX_PARTS (1 << 16)
#define RP_LUA_MAX_ROUNDS 100000

/* Argument helpers of the rp.* functions (core/lua_host.c; these raise Lua errors). */
double rp_lua_check_num(lua_State *L, int idx, const char *what);
bool rp_lua_check_bool(lua_State *L, int idx, const char *what);
/* opts[key] pushed (nil when opts is absent); raw access, so no policy code runs. */
int rp_lua_opt(lua_State *L, int opts, const char *key);
/* A list or a view of numbers as a C array, in a userdata pushed on the stack (so the
 * collector frees it whatever happens). Lists are 1-based, views 0-based
 * (core/lua_views.c). */
double *rp_lua_read_vector(lua_State *L, int idx, const char *what, int32_t *n_out, int32_t max_n);
int64_t rp_lua_log2_ceil(int64_t n);
/* The work units of sorting n items: n (log2 n + 1). */
int64_t rp_lua_sort_units(int64_t n);

/* Register metatable `name` (luaL_newmetatable) with the metamethods of `meta` (a
 * NULL-terminated list); with `methods`, "__index" is a closure over a table of them
 * (its upvalue). "__metatable" is `shown`, so a policy can neither read nor replace it.
 * core/lua_host.c; the plan, view, object and ctx metatables. */
void rp_lua_register_metatable(lua_State *L, const char *name, const luaL_Reg *methods, const luaL_Reg *meta,
                               const char *shown);

/* Helpers shared by the C files of the host. */
void rp_lua_register_plan(lua_State *L, rp_lua_host *host);   /* plan metatable */
void rp_lua_register_views(lua_State *L, rp_lua_host *host);  /* view metatables */
/* Raise "fname: message" at the caller's level. */
int rp_lua_error(lua_State *L, const char *fmt, ...) RP_PRINTF(2, 3);
/* Raise for a failed rp_* call: a memory refusal of plan_ctx becomes the memory limit. */
int rp_lua_fail(lua_State *L, rp_lua_host *host, const char *fname, rp_status st, const rp_error *err);
/* Reject keys of the options table at `idx` outside `known` (NULL-terminated). */
void rp_lua_check_opts(lua_State *L, int idx, const char *fname, const char *const *known);
/* The table at absolute `idx`'s first key outside `known` (NULL-terminated), in one
 * order whatever order lua_next visits the table in (numbers ascending, then strings by
 * bytes, then the rest), pushed; its stack index, or 0 (nothing pushed) when every key
 * is known. Charges one unit a key. */
int rp_lua_first_unknown_key(lua_State *L, int idx, const char *const *known);
/* An integer argument or table value, checked to be integral and in [lo, hi]. */
int64_t rp_lua_check_int(lua_State *L, int idx, const char *what, int64_t lo, int64_t hi);
/* Charge work (raises the limit error when the budget is spent). */
static inline void rp_lua_charge(lua_State *L, int64_t units) { rp_sandbox_charge(L, units); }

#endif
