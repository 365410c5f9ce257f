/* The policy loader's contract (core/policy.c, core/policy_find.c): a loaded, checked
 * policy in its own sandbox, how to find, load and call it. The scheduler (core/sched.c)
 * and the checkpoint (core/sched_state.c) use it. */
#ifndef RP_POLICY_H
#define RP_POLICY_H

#include "lua_api.h"
#include "routepack/sched.h"

/* At most this many params per policy, and values of a string param's list. */
#define RP_POLICY_MAX_PARAMS 256
#define RP_POLICY_MAX_VALUES 64

typedef enum rp_param_type {
    RP_PARAM_INTEGER = 0,
    RP_PARAM_NUMBER = 1,
    RP_PARAM_BOOLEAN = 2,
    RP_PARAM_STRING = 3
} rp_param_type;

/* One declared parameter, with the value in effect (its default, or the config's). */
typedef struct rp_param {
    char name[64];
    rp_param_type type;
    double num, dflt_num;        /* integer and number params */
    bool boolean, dflt_boolean;
    char *str, *dflt_str;        /* string params (allocated through the policy's context) */
    bool has_min, has_max;
    double min, max;
    char **values;               /* string params: the allowed values, NULL if any */
    int32_t num_values;
    char *doc;
} rp_param;

/* A policy's ctx.state in the engine's compact binary encoding (core/policy_state.h). */
typedef struct state_copy {
    unsigned char *bytes; /* malloc'ed */
    size_t len;
} state_copy;

typedef struct rp_policy {
    rp_context *ctx;
    const rp_config *cfg;
    rp_sandbox *sb;
    rp_lua_host host;
    rp_policy_info info;         /* name, version, api, description, path, hash */
    rp_param *params;            /* sorted by name */
    int32_t num_params;
    char *params_json;           /* the params object applied ("{}" when none) */
    int plan_ref, init_ref, state_ref, call_ref; /* registry references */
    char *source;                /* the text loaded (NUL-terminated), for checkpoints */
    size_t source_len;
    /* ctx.state as its last successful call (or init) left it, in the compact binary
     * encoding of core/policy_state.c (counted against the memory cap beside the state):
     * what a rebuild after a limit trip starts from */
    state_copy kept;
    /* a limit tripped in the last call: the Lua state is as the interrupted call left it,
     * and the policy is rebuilt from its source and `kept` before it runs again
     * (policy_ready, core/policy_rebuild.c) */
    bool tainted;
} rp_policy;

/* The longest policy source accepted (shipped policies are under 5 KiB): a larger file
 * or text is refused before anything is read or allocated for it. */
#define RP_POLICY_MAX_BYTES ((size_t)1 << 20)

/* Load a policy from source text into a fresh sandbox: run the chunk, check its metadata
 * (messages name the field: "policy.lua: 'version' must be a string like \"1.2.0\", got
 * number"), check that it targets RP_POLICY_API (unless `any_api`), read its params and
 * apply `params_json` (a JSON object; NULL or "{}": defaults; unknown param, wrong type
 * or out of range is RP_EINVAL naming it). `path` (may be NULL) is recorded and its
 * base name is the chunk name. Does not run init. */
rp_status rp_policy_load(rp_context *ctx, const rp_config *cfg, const char *source, size_t len,
                         const char *path, const rp_sandbox_limits *limits, const char *params_json,
                         bool any_api, rp_policy **out, rp_error *err);

/* Find a policy file: a name ([a-z0-9_]+) is looked up as NAME.lua in the config's
 * policy.search_path, then RP_POLICY_PATH (colon-separated), then the shipped policies
 * directory; anything else is a path, relative to `base_dir` when that is not NULL.
 * *path is allocated through ctx (rp_free). RP_EIO when nothing is found (the message
 * lists where it looked). */
rp_status rp_policy_resolve(rp_context *ctx, const rp_config *cfg, const char *name_or_path,
                            const char *base_dir, char **path, rp_error *err);

/* Resolve, read and load (rp_policy_load) in one go. The file must be a regular file
 * (checked without blocking: a FIFO is refused, not waited on) of at most
 * RP_POLICY_MAX_BYTES. */
rp_status rp_policy_open(rp_context *ctx, const rp_config *cfg, const char *name_or_path,
                         const char *base_dir, const rp_sandbox_limits *limits,
                         const char *params_json, rp_policy **out, rp_error *err);

void rp_policy_free(rp_policy *pol);

/* The shipped policies directory (the source tree's policies/ when it exists, else the
 * install data directory's). Static storage. */
const char *rp_policy_shipped_dir(void);

/* Run init(ctx) if the policy has one, with a fresh ctx.state. `frame` has no batch. */
rp_status rp_policy_init(rp_policy *pol, const rp_lua_frame *frame, rp_error *err);

/* Why a call failed, for the step report. */
typedef enum rp_call_failure {
    RP_CALL_OK = 0,
    RP_CALL_ERROR = 1,       /* the policy raised an error */
    RP_CALL_LIMIT = 2,       /* a sandbox limit tripped */
    RP_CALL_BAD_PLAN = 3,    /* what it returned is not a plan of the right shape */
    RP_CALL_NOMEM = 4        /* the engine ran out of memory */
} rp_call_failure;

/* Run plan(ctx) for `frame` with math.random seeded from frame->seed. On success *out
 * holds the converted plan (allocated in the policy's capped plan context, where it
 * counts against the memory limit; free it before the policy; NULL plan when the
 * policy returned nil) and the parts it gave. `num_seqs` is the batch's sequence count,
 * `base_mb` the microbatch count for levers given without a packing. On failure *why
 * says what kind, err the message; out->plan is NULL. *work receives the work units. */
rp_status rp_policy_plan(rp_policy *pol, const rp_lua_frame *frame, int32_t num_seqs, int32_t base_mb,
                         rp_lua_plan_out *out, rp_call_failure *why, int64_t *work, rp_error *err);

/* Metadata and params as JSON (rp_text_free), for rp_policy_describe. */
rp_status rp_policy_to_json(const rp_policy *pol, char **text, size_t *len, rp_error *err);

/* ---- shared by core/policy.c and core/policy_find.c ---- */

/* A policy name: 1 to 63 of [a-z0-9_]. */
bool policy_valid_name(const char *s, size_t len);
/* "integer", "number", "boolean" or "string". */
const char *policy_param_type_name(rp_param_type t);

#endif
