/* Reading the kept copy of ctx.state (the compact binary encoding of core/policy_state.h):
 * into a checkpoint's JSON, and back into the policy's Lua state when it is rebuilt after
 * a limit trip. The copy was written by policy_state_copy, so it is well formed; the
 * readers still stop at its end. */
#include "policy_state.h"

#include <lauxlib.h>
#include <math.h>
#include <string.h>

typedef struct reader {
    const unsigned char *p, *end;
} reader;

static uint64_t get_varint(reader *r)
{
    uint64_t v = 0;
    for (int shift = 0; r->p < r->end && shift < 64; shift += 7) {
        unsigned char b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) break;
    }
    return v;
}

static double get_int(reader *r)
{
    uint64_t z = get_varint(r);
    return (double)(int64_t)((z >> 1) ^ (~(z & 1) + 1));
}

static double get_double(reader *r)
{
    double x = 0;
    if ((size_t)(r->end - r->p) >= sizeof x) memcpy(&x, r->p, sizeof x);
    r->p += sizeof x;
    return x;
}

static const char *get_string(reader *r, size_t *n)
{
    *n = (size_t)get_varint(r);
    const char *s = (const char *)r->p;
    if (*n > (size_t)(r->end - r->p)) *n = (size_t)(r->end - r->p);
    r->p += *n;
    return s;
}

/* ---- to JSON ----------------------------------------------------------------------------- */

static json_t *to_json(reader *r)
{
    if (r->p >= r->end) return NULL;
    switch (*r->p++) {
    case STATE_BIN_FALSE: return json_false();
    case STATE_BIN_TRUE: return json_true();
    case STATE_BIN_INT: return state_encode_number(get_int(r));
    case STATE_BIN_DOUBLE: return state_encode_number(get_double(r));
    case STATE_BIN_STRING: {
        size_t n;
        const char *s = get_string(r, &n);
        return state_encode_bytes(s, n);
    }
    case STATE_BIN_TABLE: {
        get_varint(r); /* the array hint */
        uint64_t n = get_varint(r);
        json_t *list = json_array();
        for (uint64_t i = 0; list && i < n; i++) {
            json_t *key = to_json(r), *value = key ? to_json(r) : NULL;
            json_t *pair = value ? json_array() : NULL;
            if (!pair || json_array_append_new(pair, key) != 0 || json_array_append_new(pair, value) != 0 ||
                json_array_append_new(list, pair) != 0) {
                if (!pair) {
                    json_decref(key);
                    json_decref(value);
                }
                json_decref(list);
                return NULL;
            }
        }
        json_t *out = list ? json_object() : NULL;
        if (!out || json_object_set_new(out, "table", list) != 0) {
            json_decref(out);
            return NULL;
        }
        return out;
    }
    default: return NULL;
    }
}

json_t *state_copy_to_json(const state_copy *copy)
{
    reader r = {copy->bytes, copy->bytes + copy->len};
    if (!copy->len) return json_pack("{s:[]}", "table");
    return to_json(&r);
}

/* ---- to Lua ------------------------------------------------------------------------------ */

typedef struct restore_job {
    reader r;
    const rp_sandbox *clock;
    size_t since_clock;
    bool late; /* stopped at the deadline */
    int ref;
} restore_job;

#define RESTORE_CLOCK_EVERY 4096

/* Push the next value. Raises on memory, and at the deadline. */
static void push_value(lua_State *L, restore_job *job)
{
    reader *r = &job->r;
    if (r->p >= r->end) {
        lua_pushnil(L);
        return;
    }
    switch (*r->p++) {
    case STATE_BIN_FALSE: lua_pushboolean(L, 0); break;
    case STATE_BIN_TRUE: lua_pushboolean(L, 1); break;
    case STATE_BIN_INT: lua_pushnumber(L, get_int(r)); break;
    case STATE_BIN_DOUBLE: lua_pushnumber(L, get_double(r)); break;
    case STATE_BIN_STRING: {
        size_t n;
        const char *s = get_string(r, &n);
        lua_pushlstring(L, s, n);
        break;
    }
    case STATE_BIN_TABLE: {
        uint64_t array = get_varint(r), n = get_varint(r);
        luaL_checkstack(L, 4, "ctx.state");
        lua_createtable(L, array > INT32_MAX ? INT32_MAX : (int)array, n - array > INT32_MAX ? INT32_MAX : (int)(n - array));
        for (uint64_t i = 0; i < n; i++) {
            if (job->clock && ++job->since_clock >= RESTORE_CLOCK_EVERY) {
                job->since_clock = 0;
                if (rp_sandbox_past_deadline(job->clock)) {
                    job->late = true;
                    luaL_error(L, "past the deadline");
                }
            }
            push_value(L, job);
            push_value(L, job);
            if (lua_isnil(L, -2)) lua_pop(L, 2); /* a damaged copy: never written */
            else lua_rawset(L, -3);
        }
        break;
    }
    default: lua_pushnil(L); break;
    }
}

static int build_state(lua_State *L)
{
    restore_job *job = lua_touserdata(L, 1);
    push_value(L, job);
    job->ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

rp_status state_copy_restore(rp_policy *pol, const state_copy *copy, const rp_sandbox *clock, rp_error *err)
{
    lua_State *L = rp_sandbox_state(pol->sb);
    restore_job job = {.r = {copy->bytes, copy->bytes + copy->len}, .clock = clock, .ref = LUA_NOREF};
    if (!copy->len) return RP_OK; /* no copy: the fresh state's empty table stays */
    if (lua_cpcall(L, build_state, &job) != 0) {
        lua_pop(L, 1);
        lua_gc(L, LUA_GCCOLLECT, 0);
        if (job.late)
            return rp_fail(err, RP_ELIMIT,
                           "policy exceeded the wall-time limit of %g s restoring ctx.state from its kept copy (%zu "
                           "bytes) after a limit trip",
                           rp_sandbox_limits_of(pol->sb)->max_wall_s, copy->len);
        return rp_fail_nomem(err, "rebuilding ctx.state");
    }
    luaL_unref(L, LUA_REGISTRYINDEX, pol->state_ref);
    pol->state_ref = job.ref;
    return RP_OK;
}
