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

/* ---- ctx.state -> the kept copy --------------------------------------------------------
 * The walk writes a compact binary copy (core/policy_state.h, "The kept copy"): every
 * table's entries in the sandbox's pairs order (numbers ascending, strings by their
 * bytes, false, true), so the checkpoint's JSON, converted from it, lists them in that
 * order. The walk allocates nothing in Lua (lua_next, raw reads), so it runs unprotected
 * once the stack is reserved: each level of tables holds two slots. */

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

/* One entry of a table being walked: its key (cls 0 number, 1 string, 2 boolean, 3 +
 * type: refused) and, for a scalar, its value (vt: the Lua type), read in lua_next's
 * pass so that only tables are fetched again. Strings are held by the table, which
 * nothing changes during the walk. */
typedef struct state_entry {
    int cls, vt;
    double num, vnum;
    const char *str, *vstr;
    size_t len, vlen;
    size_t visit; /* its place in lua_next's order */
} state_entry;

typedef struct state_enc {
    lua_State *L;
    const char *policy;
    const rp_sandbox *clock; /* the call's deadline is read every ENC_CLOCK_EVERY entries; NULL: never */
    table_set seen;
    state_entry *scratch; /* the keys of the tables being walked, each level above its parent's */
    size_t scratch_used, scratch_cap;
    unsigned char *out;
    size_t out_len, out_cap, max_bytes;
    int64_t units, max_units;
    size_t entries, since_clock;
    state_limit limit; /* which limit stopped the walk */
    rp_status st;
    rp_error *err;
} state_enc;

#define ENC_CLOCK_EVERY 4096

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

static bool enc_fail(state_enc *e, rp_status st, const char *fmt, ...) RP_PRINTF(3, 4);
static bool enc_fail(state_enc *e, rp_status st, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    e->st = rp_fail(e->err, st, "policy '%s': %s", e->policy, msg);
    return false;
}

static bool enc_nomem(state_enc *e) { return enc_fail(e, RP_ENOMEM, "out of memory saving ctx.state"); }

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

/* The copy's work: RP_STATE_UNITS_PER_ENTRY units per entry and one per 16 bytes of
 * every string; the call's deadline read every ENC_CLOCK_EVERY entries. Past either
 * the walk stops. */
static bool enc_charge(state_enc *e, int64_t units, bool entry)
{
    e->units += units;
    if (e->units > e->max_units) {
        e->limit = STATE_LIMIT_UNITS;
        return enc_fail(e, RP_ELIMIT, "saving ctx.state takes more than %lld work units",
                        (long long)e->max_units);
    }
    if (entry && e->clock && ++e->since_clock >= ENC_CLOCK_EVERY) {
        e->since_clock = 0;
        if (rp_sandbox_past_deadline(e->clock)) {
            e->limit = STATE_LIMIT_WALL;
            return enc_fail(e, RP_ELIMIT, "saving ctx.state ran past the wall-time limit");
        }
    }
    return true;
}

static bool put(state_enc *e, const void *p, size_t n)
{
    if (n > e->max_bytes - e->out_len) {
        e->limit = STATE_LIMIT_BYTES;
        return enc_fail(e, RP_ELIMIT, "its copy takes more than %zu bytes", e->max_bytes);
    }
    if (e->out_len + n > e->out_cap) {
        size_t cap = e->out_cap ? e->out_cap : 256;
        while (cap < e->out_len + n) cap *= 2;
        unsigned char *more = realloc(e->out, cap);
        if (!more) return enc_nomem(e);
        e->out = more;
        e->out_cap = cap;
    }
    memcpy(e->out + e->out_len, p, n);
    e->out_len += n;
    return true;
}

static bool put_varint(state_enc *e, uint64_t v)
{
    unsigned char b[10];
    size_t n = 0;
    do {
        b[n++] = (unsigned char)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return put(e, b, n);
}

static bool put_number(state_enc *e, double x)
{
    /* integral values (not -0) within 2^53 as zigzag varints: array indexes and counts
     * take 1-3 bytes */
    if (x == floor(x) && fabs(x) <= 9007199254740992.0 && !(x == 0 && signbit(x))) {
        int64_t i = (int64_t)x;
        unsigned char tag = STATE_BIN_INT;
        return put(e, &tag, 1) && put_varint(e, ((uint64_t)i << 1) ^ (uint64_t)(i >> 63));
    }
    unsigned char tag = STATE_BIN_DOUBLE;
    return put(e, &tag, 1) && put(e, &x, sizeof x);
}

static bool put_string(state_enc *e, const char *s, size_t n)
{
    unsigned char tag = STATE_BIN_STRING;
    return put(e, &tag, 1) && put_varint(e, n) && put(e, s, n);
}

static bool put_bool(state_enc *e, bool b)
{
    unsigned char tag = b ? STATE_BIN_TRUE : STATE_BIN_FALSE;
    return put(e, &tag, 1);
}

static bool encode_table(state_enc *e, int idx, const char *path, int depth);

/* The value at the top of the stack (a table, or what a checkpoint cannot hold) at
 * `path`. */
static bool encode_other(state_enc *e, const char *path, int depth)
{
    lua_State *L = e->L;
    int t = lua_type(L, -1);
    if (t == LUA_TTABLE) return encode_table(e, lua_gettop(L), path, depth);
    return enc_fail(e, RP_EINVAL,
                    "%s is %s; a checkpoint holds tables, strings, numbers and booleans in ctx.state (keep "
                    "functions in the chunk, copy views with v:totable())",
                    path, t == LUA_TFUNCTION ? "a function" : t == LUA_TTHREAD ? "a coroutine" : "userdata");
}

/* The keys are collected into C memory and sorted, then written in key order (a table
 * value fetched again by its key: two stack slots a level, whatever the number of
 * keys), so the first problem reported, and which of two places holding one table is
 * "the other", are the same in every process whatever the string hash seed. Pushing a
 * string key that the table holds finds the interned string: nothing is allocated. */
static bool encode_table(state_enc *e, int idx, const char *path, int depth)
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
    size_t first = e->scratch_used, n = 0, array = 0;
    bool good = false, sorted = true;
    int base = lua_gettop(L);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
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
        int kt = lua_type(L, -2);
        if (kt == LUA_TNUMBER) {
            en->num = lua_tonumber(L, -2);
        } else if (kt == LUA_TSTRING) {
            en->cls = 1;
            en->str = lua_tolstring(L, -2, &en->len);
        } else if (kt == LUA_TBOOLEAN) {
            en->cls = 2;
            en->num = lua_toboolean(L, -2);
        } else {
            en->cls = 3 + kt; /* refused below, in key order */
        }
        en->vt = lua_type(L, -1);
        if (en->vt == LUA_TNUMBER) en->vnum = lua_tonumber(L, -1);
        else if (en->vt == LUA_TBOOLEAN) en->vnum = lua_toboolean(L, -1);
        else if (en->vt == LUA_TSTRING) en->vstr = lua_tolstring(L, -1, &en->vlen);
        lua_pop(L, 1);
        if (en->cls == 0 && en->num >= 1 && en->num <= (double)SIZE_MAX && en->num == floor(en->num)) array++;
        if (n > 1 && sorted && entry_cmp(en - 1, en) > 0) sorted = false;
        if (!enc_charge(e, RP_STATE_UNITS_PER_ENTRY + (int64_t)(en->len / 16) +
                                (en->vt == LUA_TSTRING ? (int64_t)(en->vlen / 16) : 0),
                        true)) {
            lua_settop(L, base);
            goto out;
        }
    }
    e->entries += n;
    if (!sorted) qsort(e->scratch + first, n, sizeof *e->scratch, entry_cmp);
    unsigned char tag = STATE_BIN_TABLE;
    if (!put(e, &tag, 1) || !put_varint(e, array > n ? n : array) || !put_varint(e, n)) goto out;
    for (size_t i = 0; i < n; i++) {
        state_entry en = e->scratch[first + i]; /* deeper levels may move the scratch */
        if (en.cls > 2) {
            enc_fail(e, RP_EINVAL, "%s has a key that is %s; keys can be numbers, strings and booleans", path,
                     lua_typename(L, en.cls - 3));
            goto out;
        }
        bool ok = en.cls == 0 ? put_number(e, en.num) : en.cls == 1 ? put_string(e, en.str, en.len)
                                                                     : put_bool(e, en.num != 0);
        if (ok && en.vt == LUA_TNUMBER) ok = put_number(e, en.vnum);
        else if (ok && en.vt == LUA_TBOOLEAN) ok = put_bool(e, en.vnum != 0);
        else if (ok && en.vt == LUA_TSTRING) ok = put_string(e, en.vstr, en.vlen);
        else if (ok) {
            for (int k = 0; k < 2; k++) { /* the key twice: one for the path, one for rawget */
                if (en.cls == 0) lua_pushnumber(L, en.num);
                else if (en.cls == 1) lua_pushlstring(L, en.str, en.len);
                else lua_pushboolean(L, en.num != 0);
            }
            lua_rawget(L, idx);
            char sub[PATH_LEN];
            child_path(L, path, sub);
            ok = encode_other(e, sub, depth + 1);
            lua_settop(L, base);
        }
        if (!ok) goto out;
    }
    good = true;
out:
    e->scratch_used = first;
    return good;
}

/* Grow the stack by *(int *)ud free slots (a protected call: growing may raise). */
static int reserve_stack(lua_State *L)
{
    const int *want = lua_touserdata(L, 1);
    if (!lua_checkstack(L, *want)) return luaL_error(L, "stack overflow");
    return 0;
}

bool policy_state_copy(const rp_policy *pol, const state_budget *budget, state_copy *out, rp_state_work *work,
                       rp_status *st, rp_error *err)
{
    memset(out, 0, sizeof *out);
    lua_State *L = rp_sandbox_state(pol->sb);
    int want = 2 * RP_STATE_MAX_DEPTH + 16;
    if (lua_cpcall(L, reserve_stack, &want) != 0) {
        lua_pop(L, 1);
        *st = rp_fail_nomem(err, "saving ctx.state");
        return false;
    }
    int top = lua_gettop(L);
    state_enc e = {.L = L, .policy = pol->info.name, .clock = budget->clock, .max_units = budget->max_units,
                   .max_bytes = budget->max_bytes, .st = RP_OK, .err = err};
    lua_rawgeti(L, LUA_REGISTRYINDEX, pol->state_ref);
    bool good;
    if (lua_istable(L, -1)) {
        good = encode_table(&e, lua_gettop(L), "ctx.state", 0);
    } else { /* no state yet: an empty table */
        unsigned char empty[3] = {STATE_BIN_TABLE, 0, 0};
        good = put(&e, empty, sizeof empty);
    }
    if (!good && e.st == RP_OK) e.st = rp_fail_nomem(err, "saving ctx.state");
    lua_settop(L, top);
    free(e.seen.slot);
    free(e.scratch);
    if (work) {
        work->units = e.units;
        work->tables = e.seen.count;
        work->entries = e.entries;
        work->bytes = e.out_len;
        work->limit = e.limit;
    }
    *st = e.st;
    if (!good) {
        free(e.out);
        return false;
    }
    out->bytes = e.out;
    out->len = e.out_len;
    return true;
}

json_t *policy_state_encode(const rp_policy *pol, int64_t max_units, rp_state_work *work, rp_status *st,
                            rp_error *err)
{
    /* after a limit trip the Lua state is as the interrupted call left it, and the next
     * step rebuilds the policy from the kept copy: that copy is the policy's state */
    if (pol->tainted) {
        json_t *j = state_copy_to_json(&pol->kept);
        *st = j ? RP_OK : rp_fail_nomem(err, "saving ctx.state");
        return j;
    }
    state_budget budget = {.max_units = max_units, .max_bytes = SIZE_MAX};
    state_copy copy;
    if (!policy_state_copy(pol, &budget, &copy, work, st, err)) return NULL;
    json_t *j = state_copy_to_json(&copy);
    free(copy.bytes);
    if (!j) *st = rp_fail_nomem(err, "saving ctx.state");
    return j;
}

/* ---- JSON -> ctx.state (a checkpoint) --------------------------------------------------- */

/* Push an encoded value (checked by policy_state_check). Raises only on memory. */
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
    /* the copy a rebuild after a limit trip starts from */
    state_budget budget = {.max_units = INT64_MAX, .max_bytes = SIZE_MAX};
    state_copy copy;
    rp_status st;
    if (!policy_state_copy(pol, &budget, &copy, NULL, &st, err)) return st;
    policy_state_replace(pol, &copy);
    return RP_OK;
}

void policy_state_replace(rp_policy *pol, state_copy *copy)
{
    free(pol->kept.bytes);
    pol->kept = *copy;
    memset(copy, 0, sizeof *copy);
    rp_sandbox_hold_bytes(pol->sb, pol->kept.len);
}

/* ---- the copy kept after every successful call ------------------------------------------- */

static void mib(size_t bytes, char *buf, size_t n)
{
    if (bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else snprintf(buf, n, "%.1f MiB", (double)bytes / (1 << 20));
}

rp_status policy_keep_state(rp_policy *pol, int64_t *work, rp_error *err)
{
    const rp_sandbox_limits *lim = rp_sandbox_limits_of(pol->sb);
    int64_t used = rp_sandbox_work(pol->sb);
    int64_t left = lim->max_instructions > used ? lim->max_instructions - used : 0;
    size_t live = rp_sandbox_memory_bytes(pol->sb);
    state_budget budget = {.max_units = left,
                           .max_bytes = lim->max_memory_bytes > live ? lim->max_memory_bytes - live : 0,
                           .clock = pol->sb};
    rp_state_work w = {0};
    rp_status st = RP_OK;
    rp_error e;
    rp_error_clear(&e);
    state_copy copy;
    bool good = policy_state_copy(pol, &budget, &copy, &w, &st, &e);
    if (work) *work = used + w.units;
    if (!good) {
        char cap[32], state[32];
        switch (st == RP_ELIMIT ? w.limit : STATE_LIMIT_NONE) {
        case STATE_LIMIT_UNITS:
            return rp_fail(err, st,
                           "policy exceeded the instruction limit (%lld) saving ctx.state after the call (%lld "
                           "units in the call, more than %lld left for %zu tables, %zu entries so far); keep less "
                           "in ctx.state",
                           (long long)lim->max_instructions, (long long)used, (long long)left, w.tables, w.entries);
        case STATE_LIMIT_BYTES:
            mib(lim->max_memory_bytes, cap, sizeof cap);
            mib(live, state, sizeof state);
            return rp_fail(err, st,
                           "policy exceeded the memory limit of %s keeping ctx.state after the call: the copy the "
                           "engine keeps (%zu tables, %zu entries so far) takes more than the %zu bytes the state's "
                           "%s leave; keep less in ctx.state",
                           cap, w.tables, w.entries, budget.max_bytes, state);
        case STATE_LIMIT_WALL:
            return rp_fail(err, st,
                           "policy exceeded the wall-time limit of %g s keeping ctx.state after the call (%zu "
                           "tables, %zu entries so far); keep less in ctx.state",
                           lim->max_wall_s, w.tables, w.entries);
        default: break;
        }
        /* "policy 'x': ctx.state.f is a function; ..." without the name, which the
         * caller's message gives */
        const char *text = strstr(e.text, "': ");
        return rp_fail(err, st, "ctx.state cannot be kept after the call: %s", text ? text + 3 : e.text);
    }
    policy_state_replace(pol, &copy);
    return RP_OK;
}
