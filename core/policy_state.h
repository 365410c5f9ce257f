/* ctx.state as JSON and back (core/policy_state.c): what a checkpoint holds of a policy's
 * state, and the copy the engine keeps to rebuild a policy after a limit trip. */
#ifndef RP_POLICY_STATE_H
#define RP_POLICY_STATE_H

#include "sched_internal.h"

#include <jansson.h>

/* Tables nested deeper than this in ctx.state are refused (the C stack of the walk). */
#define RP_STATE_MAX_DEPTH 64

/* Work units one entry of ctx.state costs to encode: its key and value become jansson
 * objects (allocations, a sort of the keys), about 80-100 ns an entry here against 5-6 ns
 * a VM instruction, so an encoding costs about the time its units would in Lua. */
#define RP_STATE_UNITS_PER_ENTRY 16

/* What encoding a state took: its work units (RP_STATE_UNITS_PER_ENTRY per entry and one
 * per 16 bytes of every string), tables and entries. */
typedef struct rp_state_work {
    int64_t units;
    size_t tables, entries;
} rp_state_work;

/* ctx.state of `pol` as JSON (a new reference), in time linear in its size. NULL with
 * *st and err set when it cannot be saved: RP_EINVAL for what a checkpoint cannot hold
 * (a function, a cycle or shared table, a metatable, a key of another type, nesting
 * deeper than RP_STATE_MAX_DEPTH; the message names the path, the first in key order),
 * RP_ELIMIT when the walk would take more than `max_units` work units, RP_ENOMEM. */
json_t *policy_state_encode(const rp_policy *pol, int64_t max_units, rp_state_work *work, rp_status *st,
                            rp_error *err);
/* Replace ctx.state of `pol` by the encoded `state` (checked: policy_state_encode's
 * output or a checkpoint's checked value), which also becomes pol->saved_state (a new
 * reference). RP_ENOMEM leaves the old state. */
rp_status policy_state_restore(rp_policy *pol, json_t *state, rp_error *err);

/* After a successful call of `pol` (or its init): keep ctx.state encoded in
 * pol->saved_state, the walk's work counted against what the call left of its
 * instruction limit (*work: the call's units plus the walk's). A state that cannot be
 * kept fails the call: RP_ELIMIT ("policy exceeded the instruction limit (N) saving
 * ctx.state after the call ..."), RP_EINVAL (what a checkpoint cannot hold, named),
 * RP_ENOMEM; the previous copy stays. */
rp_status policy_keep_state(rp_policy *pol, int64_t *work, rp_error *err);
/* (core/policy_rebuild.c) Replace *pol by a fresh policy loaded from its source text, params and limits (the
 * injected clock too), with ctx.state rebuilt from the copy kept at its last successful
 * call: after a limit trip, nothing the interrupted call did survives. On failure *pol
 * is left as it was. */
rp_status policy_rebuild(rp_policy **pol, rp_error *err);

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
