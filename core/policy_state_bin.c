/* A checkpoint's ctx.state values (strings JSON cannot hold as {"bytes": hex}, numbers
 * JSON lacks as {"number": "inf"}), and reading the kept copy of ctx.state (the compact
 * binary encoding of core/policy_state.h): into a checkpoint's JSON, and back into the
 * policy's Lua state when it is rebuilt after a limit trip. The copy was written by policy_state_copy, so it is well formed; the
 * readers still stop at its end. */
#include "policy_state.h"

#include <lauxlib.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- values: strings that JSON cannot hold verbatim go as {"bytes": hex} ------------- */

json_t *state_encode_bytes(const char *s, size_t n)
{
    if (!memchr(s, '\0', n)) {
        json_t *j = json_stringn(s, n); /* NULL: not UTF-8 (or no memory: retried below) */
        if (j) return j;
    }
    static const char digits[] = "0123456789abcdef";
    char *hex = malloc(2 * n + 1);
    if (!hex) return NULL;
    for (size_t i = 0; i < n; i++) {
        hex[2 * i] = digits[(unsigned char)s[i] >> 4];
        hex[2 * i + 1] = digits[(unsigned char)s[i] & 15];
    }
    hex[2 * n] = '\0';
    json_t *j = json_pack("{s:s}", "bytes", hex);
    free(hex);
    return j;
}

/* The bytes of an encoded string: a JSON string, or {"bytes": hex} decoded into *buf
 * (malloc'ed; the caller frees it). False when `v` is neither. */
bool state_decode_bytes(json_t *v, const char **s, size_t *n, char **buf)
{
    *buf = NULL;
    if (json_is_string(v)) {
        *s = json_string_value(v);
        *n = json_string_length(v);
        return true;
    }
    json_t *h = json_is_object(v) && json_object_size(v) == 1 ? json_object_get(v, "bytes") : NULL;
    if (!json_is_string(h)) return false;
    size_t hn = json_string_length(h);
    const char *hex = json_string_value(h);
    if (hn % 2) return false;
    *buf = malloc(hn / 2 + 1);
    if (!*buf) return false;
    for (size_t i = 0; i < hn / 2; i++) {
        int d[2];
        for (int k = 0; k < 2; k++) {
            char c = hex[2 * i + (size_t)k];
            d[k] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        }
        if (d[0] < 0 || d[1] < 0) {
            free(*buf);
            *buf = NULL;
            return false;
        }
        (*buf)[i] = (char)(d[0] << 4 | d[1]);
    }
    *s = *buf;
    *n = hn / 2;
    return true;
}

json_t *state_encode_number(double x)
{
    if (isfinite(x)) return json_real(x);
    return json_pack("{s:s}", "number", isnan(x) ? "nan" : x > 0 ? "inf" : "-inf");
}

bool state_decode_number(json_t *v, double *x)
{
    if (json_is_number(v)) {
        *x = json_number_value(v);
        return true;
    }
    json_t *w = json_is_object(v) && json_object_size(v) == 1 ? json_object_get(v, "number") : NULL;
    const char *s = json_string_value(w);
    if (!s) return false;
    if (strcmp(s, "nan") == 0) *x = NAN;
    else if (strcmp(s, "inf") == 0) *x = INFINITY;
    else if (strcmp(s, "-inf") == 0) *x = -INFINITY;
    else return false;
    return true;
}

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
