/* ctx.state as JSON and back: the encoding a checkpoint holds (docs/formats.md,
 * "Scheduler state") and the copy the engine keeps after every successful call to rebuild
 * a policy from after a limit trip. Encoding is linear in the state: every table is
 * visited once, cycles are found in a hash set, and no key waits on the Lua stack. */
#include "policy_state.h"

#include <lauxlib.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PATH_LEN 256

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

/* ---- ctx.state -> JSON ------------------------------------------------------------------
 * A value is a boolean, a number (17 significant digits; {"number": "inf"} for what JSON
 * lacks), a string ({"bytes": hex} when not UTF-8 or holding NUL), or {"table": [[key,
 * value], ...]} with keys in the sandbox's pairs order: numbers ascending, strings by
 * their bytes, false, true. The walk allocates nothing in Lua (lua_next, raw reads), so
 * it runs unprotected once the stack is reserved: each level of tables holds two slots
 * (the key and value lua_next gave), whatever the number of keys. */

/* Tables already visited: open addressing over their addresses, at most half full. */
typedef struct table_set {
    const void **slot;
    size_t cap, count;
} table_set;

static size_t ptr_hash(const void *p)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

/* 1: added, 0: already there, -1: out of memory. */
static int set_add(table_set *s, const void *p)
{
    if (2 * (s->count + 1) > s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        const void **slot = calloc(cap, sizeof *slot);
        if (!slot) return -1;
        for (size_t i = 0; i < s->cap; i++) {
            if (!s->slot[i]) continue;
            size_t h = ptr_hash(s->slot[i]) & (cap - 1);
            while (slot[h]) h = (h + 1) & (cap - 1);
            slot[h] = s->slot[i];
        }
        free(s->slot);
        s->slot = slot;
        s->cap = cap;
    }
    size_t h = ptr_hash(p) & (s->cap - 1);
    while (s->slot[h]) {
        if (s->slot[h] == p) return 0;
        h = (h + 1) & (s->cap - 1);
    }
    s->slot[h] = p;
    s->count++;
    return 1;
}

typedef struct state_entry state_entry;

typedef struct state_enc {
    lua_State *L;
    const char *policy;
    table_set seen;
    state_entry *scratch; /* the keys of the tables being walked, each level above its parent's */
    size_t scratch_used, scratch_cap;
    int64_t units, max_units;
    size_t entries;
    rp_status st;
    rp_error *err;
} state_enc;

struct state_entry {
    int cls;             /* 0 number, 1 string, 2 boolean, 3 + type: refused */
    double num;
    const char *str;     /* held by the table, which nothing changes during the walk */
    size_t len;
    size_t visit;        /* its place in lua_next's order */
};

static int entry_cmp(const void *pa, const void *pb)
{
    const state_entry *a = pa, *b = pb;
    if (a->cls != b->cls) return a->cls < b->cls ? -1 : 1;
    if (a->cls > 2) return (a->visit > b->visit) - (a->visit < b->visit);
    if (a->cls == 0) return a->num < b->num ? -1 : a->num > b->num;
    if (a->cls == 2) return (a->num > b->num) - (a->num < b->num);
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->str, b->str, n);
    if (c) return c;
    return (a->len > b->len) - (a->len < b->len);
}

static json_t *enc_fail(state_enc *e, rp_status st, const char *fmt, ...) RP_PRINTF(3, 4);
static json_t *enc_fail(state_enc *e, rp_status st, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    e->st = rp_fail(e->err, st, "policy '%s': %s", e->policy, msg);
    return NULL;
}

static json_t *enc_nomem(state_enc *e) { return enc_fail(e, RP_ENOMEM, "out of memory saving ctx.state"); }

static bool is_identifier(const char *s, size_t n)
{
    if (n == 0 || !((s[0] >= 'a' && s[0] <= 'z') || (s[0] >= 'A' && s[0] <= 'Z') || s[0] == '_')) return false;
    for (size_t i = 1; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_'))
            return false;
    return true;
}

/* The path of the entry whose key is at stack index -2 ("ctx.state.avg[3]"). */
static void child_path(lua_State *L, const char *path, char *out)
{
    switch (lua_type(L, -2)) {
    case LUA_TNUMBER: snprintf(out, PATH_LEN, "%s[%.17g]", path, lua_tonumber(L, -2)); break;
    case LUA_TBOOLEAN: snprintf(out, PATH_LEN, "%s[%s]", path, lua_toboolean(L, -2) ? "true" : "false"); break;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, -2, &n);
        if (is_identifier(s, n)) snprintf(out, PATH_LEN, "%s.%.*s", path, (int)(n > 64 ? 64 : n), s);
        else snprintf(out, PATH_LEN, "%s[\"%.*s\"]", path, (int)(n > 64 ? 64 : n), s);
        break;
    }
    default: snprintf(out, PATH_LEN, "%s[<%s>]", path, lua_typename(L, lua_type(L, -2))); break;
    }
}

/* The checkpoint's work: RP_STATE_UNITS_PER_ENTRY units per entry and one per 16 bytes of
 * every string. Past the budget the walk stops. */
static bool enc_charge(state_enc *e, int64_t units)
{
    e->units += units;
    if (e->units <= e->max_units) return true;
    enc_fail(e, RP_ELIMIT,
             "saving ctx.state takes more than %lld work units (the policy's instruction limit, "
             "less what the call used); keep less in ctx.state",
             (long long)e->max_units);
    return false;
}

static json_t *encode_value(state_enc *e, int idx, const char *path, int depth);

/* The value at the top, its key below it: the entry at `path` (computed only when it is
 * needed: a table to descend into or a value to refuse). */
static json_t *encode_entry(state_enc *e, const char *path, int depth)
{
    lua_State *L = e->L;
    int t = lua_type(L, -1);
    if (t == LUA_TBOOLEAN || t == LUA_TNUMBER || t == LUA_TSTRING) return encode_value(e, lua_gettop(L), path, depth);
    char sub[PATH_LEN];
    child_path(L, path, sub);
    return encode_value(e, lua_gettop(L), sub, depth);
}

/* The keys are collected into C memory and sorted, then each value is fetched by its key
 * and encoded in key order (two stack slots a level, whatever the number of keys), so the
 * first problem reported, and which of two places holding one table is "the other", are
 * the same in every process whatever the string hash seed. Pushing a string key that
 * the table holds finds the interned string: nothing is allocated in Lua. */
static json_t *encode_table(state_enc *e, int idx, const char *path, int depth)
{
    lua_State *L = e->L;
    if (depth >= RP_STATE_MAX_DEPTH)
        return enc_fail(e, RP_EINVAL, "%s nests tables deeper than %d; a checkpoint cannot hold it", path,
                        RP_STATE_MAX_DEPTH);
    int added = set_add(&e->seen, lua_topointer(L, idx));
    if (added < 0) return enc_nomem(e);
    if (added == 0)
        return enc_fail(e, RP_EINVAL,
                        "%s is a table that ctx.state also holds at another place (a cycle or a shared table); a "
                        "checkpoint holds a tree of tables",
                        path);
    if (lua_getmetatable(L, idx)) {
        lua_pop(L, 1);
        return enc_fail(e, RP_EINVAL, "%s has a metatable; a checkpoint holds plain tables only", path);
    }
    size_t first = e->scratch_used, n = 0;
    json_t *out = NULL, *list = NULL;
    int base = lua_gettop(L);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (e->scratch_used == e->scratch_cap) {
            size_t cap = e->scratch_cap ? 2 * e->scratch_cap : 256;
            state_entry *more = realloc(e->scratch, cap * sizeof *more);
            if (!more) {
                lua_settop(L, base);
                enc_nomem(e);
                goto out;
            }
            e->scratch = more;
            e->scratch_cap = cap;
        }
        state_entry *en = &e->scratch[e->scratch_used++];
        memset(en, 0, sizeof *en);
        en->visit = n++;
        int kt = lua_type(L, -1);
        if (kt == LUA_TNUMBER) {
            en->num = lua_tonumber(L, -1);
        } else if (kt == LUA_TSTRING) {
            en->cls = 1;
            en->str = lua_tolstring(L, -1, &en->len);
        } else if (kt == LUA_TBOOLEAN) {
            en->cls = 2;
            en->num = lua_toboolean(L, -1);
        } else {
            en->cls = 3 + kt; /* refused below, in key order */
        }
        if (!enc_charge(e, RP_STATE_UNITS_PER_ENTRY + (int64_t)(en->len / 16))) {
            lua_settop(L, base);
            goto out;
        }
    }
    e->entries += n;
    if (n > 1) qsort(e->scratch + first, n, sizeof *e->scratch, entry_cmp);
    list = json_array();
    if (!list) {
        enc_nomem(e);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        state_entry en_copy = e->scratch[first + i]; /* deeper levels may move the scratch */
        const state_entry *en = &en_copy;
        if (en->cls > 2) {
            enc_fail(e, RP_EINVAL, "%s has a key that is %s; keys can be numbers, strings and booleans", path,
                     lua_typename(L, en->cls - 3));
            goto out;
        }
        for (int k = 0; k < 2; k++) { /* the key twice: one for the path, one for rawget */
            if (en->cls == 0) lua_pushnumber(L, en->num);
            else if (en->cls == 1) lua_pushlstring(L, en->str, en->len);
            else lua_pushboolean(L, en->num != 0);
        }
        lua_rawget(L, idx);
        json_t *key = en->cls == 0 ? state_encode_number(en->num)
                      : en->cls == 1 ? state_encode_bytes(en->str, en->len)
                                     : json_boolean(en->num != 0);
        json_t *value = key ? encode_entry(e, path, depth + 1) : enc_nomem(e);
        lua_settop(L, base);
        json_t *pair = value ? json_array() : NULL;
        if (pair) {
            json_array_append_new(pair, key); /* into an empty array: cannot fail but for memory */
            key = NULL;
            if (json_array_append_new(pair, value) != 0 || json_array_size(pair) != 2) {
                json_decref(pair);
                pair = NULL;
            }
            value = NULL;
        }
        json_decref(key);
        json_decref(value);
        if (!pair || json_array_append_new(list, pair) != 0) {
            if (e->st == RP_OK) enc_nomem(e);
            goto out;
        }
    }
    out = json_object();
    if (!out || json_object_set_new(out, "table", list) != 0) {
        json_decref(out);
        out = NULL;
        enc_nomem(e);
    }
    list = NULL;
out:
    e->scratch_used = first;
    json_decref(list);
    return out;
}

static json_t *encode_value(state_enc *e, int idx, const char *path, int depth)
{
    lua_State *L = e->L;
    json_t *j;
    int t = lua_type(L, idx);
    switch (t) {
    case LUA_TBOOLEAN: j = json_boolean(lua_toboolean(L, idx)); break;
    case LUA_TNUMBER: j = state_encode_number(lua_tonumber(L, idx)); break;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        if (!enc_charge(e, (int64_t)(n / 16))) return NULL;
        j = state_encode_bytes(s, n);
        break;
    }
    case LUA_TTABLE: return encode_table(e, idx, path, depth);
    default:
        return enc_fail(e, RP_EINVAL,
                        "%s is %s; a checkpoint holds tables, strings, numbers and booleans in ctx.state (keep "
                        "functions in the chunk, copy views with v:totable())",
                        path, t == LUA_TFUNCTION ? "a function" : t == LUA_TTHREAD ? "a coroutine" : "userdata");
    }
    if (!j) return enc_nomem(e);
    return j;
}

/* Grow the stack by *(int *)ud free slots (a protected call: growing may raise). */
static int reserve_stack(lua_State *L)
{
    const int *want = lua_touserdata(L, 1);
    if (!lua_checkstack(L, *want)) return luaL_error(L, "stack overflow");
    return 0;
}

json_t *policy_state_encode(const rp_policy *pol, int64_t max_units, rp_state_work *work, rp_status *st,
                            rp_error *err)
{
    lua_State *L = rp_sandbox_state(pol->sb);
    int want = 2 * RP_STATE_MAX_DEPTH + 16;
    if (lua_cpcall(L, reserve_stack, &want) != 0) {
        lua_pop(L, 1);
        *st = rp_fail_nomem(err, "saving ctx.state");
        return NULL;
    }
    int top = lua_gettop(L);
    state_enc e = {.L = L, .policy = pol->info.name, .max_units = max_units, .st = RP_OK, .err = err};
    lua_rawgeti(L, LUA_REGISTRYINDEX, pol->state_ref);
    json_t *j = lua_istable(L, -1) ? encode_value(&e, lua_gettop(L), "ctx.state", 0) : json_pack("{s:[]}", "table");
    if (!j && e.st == RP_OK) e.st = rp_fail_nomem(err, "saving ctx.state");
    lua_settop(L, top);
    free(e.seen.slot);
    free(e.scratch);
    if (work) {
        work->units = e.units;
        work->tables = e.seen.count;
        work->entries = e.entries;
    }
    *st = e.st;
    return j;
}

/* ---- JSON -> ctx.state ----------------------------------------------------------------- */

/* Push an encoded value (checked by check_value in sched_state.c). Raises only on memory. */
static void push_value(lua_State *L, json_t *v)
{
    double x;
    const char *s;
    size_t n;
    char *buf;
    if (json_is_boolean(v)) lua_pushboolean(L, json_is_true(v));
    else if (state_decode_number(v, &x)) lua_pushnumber(L, x);
    else if (state_decode_bytes(v, &s, &n, &buf)) {
        lua_pushlstring(L, s, n); /* on a memory error buf leaks: malloc'ed, tiny, rare */
        free(buf);
    } else {
        json_t *list = json_object_get(v, "table");
        luaL_checkstack(L, 4, "ctx.state");
        lua_createtable(L, 0, (int)json_array_size(list));
        size_t i;
        json_t *pair;
        json_array_foreach(list, i, pair) {
            push_value(L, json_array_get(pair, 0));
            push_value(L, json_array_get(pair, 1));
            lua_rawset(L, -3);
        }
    }
}

typedef struct build_job {
    json_t *state;
    int ref;
} build_job;

static int build_state(lua_State *L)
{
    build_job *job = lua_touserdata(L, 1);
    push_value(L, job->state);
    job->ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}


rp_status policy_state_restore(rp_policy *pol, json_t *state, rp_error *err)
{
    lua_State *L = rp_sandbox_state(pol->sb);
    build_job job = {state, LUA_NOREF};
    if (lua_cpcall(L, build_state, &job) != 0) {
        lua_pop(L, 1);
        return rp_fail_nomem(err, "rebuilding ctx.state");
    }
    luaL_unref(L, LUA_REGISTRYINDEX, pol->state_ref);
    pol->state_ref = job.ref;
    json_t *kept = json_incref(state);
    json_decref(pol->saved_state);
    pol->saved_state = kept;
    return RP_OK;
}

/* ---- the copy kept after every successful call ------------------------------------------- */

rp_status policy_keep_state(rp_policy *pol, int64_t *work, rp_error *err)
{
    const rp_sandbox_limits *lim = rp_sandbox_limits_of(pol->sb);
    int64_t used = rp_sandbox_work(pol->sb);
    int64_t left = lim->max_instructions > used ? lim->max_instructions - used : 0;
    rp_state_work w = {0};
    rp_status st = RP_OK;
    rp_error e;
    rp_error_clear(&e);
    json_t *saved = policy_state_encode(pol, left, &w, &st, &e);
    if (work) *work = used + w.units;
    if (!saved) {
        if (st == RP_ELIMIT)
            return rp_fail(err, st,
                           "policy exceeded the instruction limit (%lld) saving ctx.state after the call (%lld "
                           "units in the call, more than %lld left for %zu tables, %zu entries so far); keep less "
                           "in ctx.state",
                           (long long)lim->max_instructions, (long long)used, (long long)left, w.tables, w.entries);
        /* "policy 'x': ctx.state.f is a function; ..." without the name, which the
         * caller's message gives */
        const char *text = strstr(e.text, "': ");
        return rp_fail(err, st, "ctx.state cannot be kept after the call: %s", text ? text + 3 : e.text);
    }
    json_decref(pol->saved_state);
    pol->saved_state = saved;
    return RP_OK;
}
