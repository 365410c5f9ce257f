/* ctx.state as JSON and back (core/policy_state.c): what a checkpoint holds of a policy's
 * state, and the copy the engine keeps to rebuild a policy after a limit trip. */
#ifndef RP_POLICY_STATE_H
#define RP_POLICY_STATE_H

#include "policy.h"

#include <jansson.h>

/* Tables nested deeper than this in ctx.state are refused (the C stack of the walk). */
#define RP_STATE_MAX_DEPTH 64

/* Work units one entry of ctx.state costs to encode: its key and value become jansson
 * objects (allocations, a sort of the keys), about 80-100 ns an entry here against 5-6 ns
 * a VM instruction, so an encoding costs about the time its units would in Lua. */
#define RP_STATE_UNITS_PER_ENTRY 16

/* The kept copy: a value is a tag byte and its payload, host byte order, in memory only
 * (never written anywhere: checkpoints hold the JSON of docs/formats.md):
 * STATE_BIN_FALSE, STATE_BIN_TRUE; STATE_BIN_INT + a zigzag varint (an integral number
 * within 2^53, not -0); STATE_BIN_DOUBLE + 8 bytes; STATE_BIN_STRING + a varint length +
 * the bytes; STATE_BIN_TABLE + a varint hint (its keys 1..n, for the array part) + a
 * varint count + that many key, value pairs in the sandbox's pairs order. About 3-10
 * bytes an entry of numbers, against 16-40 in Lua and 100-200 in jansson objects. */
enum { STATE_BIN_FALSE = 1, STATE_BIN_TRUE, STATE_BIN_INT, STATE_BIN_DOUBLE, STATE_BIN_STRING, STATE_BIN_TABLE };

/* Which limit stopped a walk (RP_ELIMIT). */
typedef enum state_limit {
    STATE_LIMIT_NONE = 0,
    STATE_LIMIT_UNITS, /* the call's instruction limit, less what the call used */
    STATE_LIMIT_BYTES, /* the memory cap, less the state's live bytes */
    STATE_LIMIT_WALL   /* the call's wall-time deadline */
} state_limit;

/* What a walk of ctx.state took: its work units (RP_STATE_UNITS_PER_ENTRY per entry and
 * one per 16 bytes of every string), tables, entries, the copy's bytes, and which limit
 * stopped it. */
typedef struct rp_state_work {
    int64_t units;
    size_t tables, entries, bytes;
    state_limit limit;
} rp_state_work;

/* What a walk may take: work units, bytes of the copy, and (when `clock` is set) that
 * sandbox's deadline, read every 4096 entries. */
typedef struct state_budget {
    int64_t max_units;
    size_t max_bytes;
    const rp_sandbox *clock;
} state_budget;

/* ctx.state of `pol` as the kept copy (*out, malloc'ed), in time linear in its size.
 * False with *st and err set when it cannot be: RP_EINVAL for what a checkpoint cannot
 * hold (a function, a cycle or shared table, a metatable, a key of another type,
 * nesting deeper than RP_STATE_MAX_DEPTH; the message names the path, the first in key
 * order), RP_ELIMIT past the budget (work->limit says which), RP_ENOMEM. */
bool policy_state_copy(const rp_policy *pol, const state_budget *budget, state_copy *out, rp_state_work *work,
                       rp_status *st, rp_error *err);
/* ctx.state of `pol` as a checkpoint's JSON (a new reference): the kept copy's after a
 * limit trip (what the next step rebuilds from), else the live state's, within
 * `max_units`. NULL with *st and err set as policy_state_copy. */
json_t *policy_state_encode(const rp_policy *pol, int64_t max_units, rp_state_work *work, rp_status *st,
                            rp_error *err);
/* Replace ctx.state of `pol` by the checkpoint's `state` (checked by
 * policy_state_check) and keep its copy. RP_ENOMEM leaves the old state. */
rp_status policy_state_restore(rp_policy *pol, json_t *state, rp_error *err);
/* Make `copy` the kept copy of `pol` (taking its bytes; *copy is emptied), held against
 * the memory cap. */
void policy_state_replace(rp_policy *pol, state_copy *copy);

/* After a successful call of `pol` (or its init): keep ctx.state as pol->kept. The walk
 * is charged to what the call left of its instruction limit (*work: the call's units
 * plus the walk's), its bytes to what the state's live bytes leave of the memory cap,
 * and it stops at the call's wall-time deadline (read every 4096 entries). A state that
 * cannot be kept fails the call: RP_ELIMIT naming the limit ("policy exceeded the
 * instruction limit (N) saving ctx.state after the call ...", "... the memory limit of
 * 256 MiB keeping ctx.state ...", "... the wall-time limit of 5 s keeping ctx.state
 * ..."), RP_EINVAL (what a checkpoint cannot hold, named), RP_ENOMEM; the previous copy
 * stays. */
rp_status policy_keep_state(rp_policy *pol, int64_t *work, rp_error *err);

/* (core/policy_state_bin.c) The kept copy as a checkpoint's JSON; NULL when out of
 * memory. */
json_t *state_copy_to_json(const state_copy *copy);
/* Replace ctx.state of `pol` by the Lua tables of `copy` (a protected call), stopping at
 * `clock`'s deadline when it is set (read every 4096 entries): RP_ELIMIT ("... past
 * the wall-time limit"), RP_ENOMEM; the old state stays then. */
rp_status state_copy_restore(rp_policy *pol, const state_copy *copy, const rp_sandbox *clock, rp_error *err);

/* (core/policy_rebuild.c) Make a policy whose last call tripped a limit (pol->tainted)
 * ready to run: replace *pol by a fresh policy loaded from its source text, params and
 * limits (the injected clock too), with ctx.state rebuilt from its kept copy, so nothing
 * the interrupted call did survives. The rebuild is charged to the next call's wall
 * time: loading, restoring and that call run in one window of max_wall_s from the
 * rebuild's start (rp_sandbox_open_window). A policy that is not tainted is left as it
 * is. On failure (its load or restore past a limit, RP_ELIMIT; RP_EPOLICY; RP_ENOMEM)
 * *pol is left as it was, still tainted. */
rp_status policy_ready(rp_policy **pol, rp_error *err);

struct rp_jdoc;
/* (core/policy_state_check.c) A checkpoint's encoded ctx.state at `path` of `doc`,
 * checked before anything is built from it: RP_EFORMAT naming the JSON path. */
rp_status policy_state_check(const struct rp_jdoc *doc, json_t *state, const char *path, rp_error *err);

/* Strings JSON cannot hold verbatim (not UTF-8, or holding NUL) go as {"bytes": hex}. */
json_t *state_encode_bytes(const char *s, size_t n);
/* The bytes of an encoded string: a JSON string, or {"bytes": hex} decoded into *buf
 * (malloc'ed; the caller frees it). False when `v` is neither. */
bool state_decode_bytes(json_t *v, const char **s, size_t *n, char **buf);
/* Numbers; {"number": "inf" | "-inf" | "nan"} for what JSON lacks. */
json_t *state_encode_number(double x);
bool state_decode_number(json_t *v, double *x);

#endif
