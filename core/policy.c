/* Policies: loading a policy's source into a fresh sandbox, checking its metadata and
 * params, and calling its init and plan functions under the sandbox's limits. Finding,
 * reading, listing and describing policy files: core/policy_find.c. */
#include "jsonx.h"
#include "policy_state.h"
#include "policy.h"

#include <lauxlib.h>

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- small helpers ---------------------------------------------------------------- */

bool policy_valid_name(const char *s, size_t len)
{
    if (len == 0 || len > 63) return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
}

/* "MAJOR.MINOR.PATCH", each a run of 1-9 digits. */
static bool valid_version(const char *s, size_t len)
{
    int parts = 0;
    size_t i = 0;
    while (parts < 3) {
        size_t start = i;
        while (i < len && s[i] >= '0' && s[i] <= '9') i++;
        if (i == start || i - start > 9) return false;
        parts++;
        if (parts < 3) {
            if (i >= len || s[i] != '.') return false;
            i++;
        }
    }
    return i == len;
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* ---- metadata ------------------------------------------------------------------------ */

/* What the metadata check fills; the messages it writes name the field. Runs inside
 * lua_cpcall and reads the policy table raw, so no policy code runs. */
typedef struct meta_job {
    rp_policy *pol;
    const char *chunk;   /* "policy.lua" */
    bool any_api;
    rp_status status;
    char msg[RP_ERROR_TEXT];
} meta_job;

static int meta_fail(meta_job *job, rp_status st, const char *fmt, ...) RP_PRINTF(3, 4);
static int meta_fail(meta_job *job, rp_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(job->msg, sizeof job->msg, fmt, ap);
    va_end(ap);
    job->status = st;
    return 0;
}

static const char *type_of(lua_State *L, int idx) { return luaL_typename(L, idx); }

/* Describe a value for a message: strings quoted, numbers as numbers, else the type. */
static void describe(lua_State *L, int idx, char *buf, size_t n)
{
    switch (lua_type(L, idx)) {
    case LUA_TSTRING: snprintf(buf, n, "'%.60s'", lua_tostring(L, idx)); break;
    case LUA_TNUMBER: snprintf(buf, n, "%.17g", lua_tonumber(L, idx)); break;
    case LUA_TBOOLEAN: snprintf(buf, n, "%s", lua_toboolean(L, idx) ? "true" : "false"); break;
    default: snprintf(buf, n, "%s", type_of(L, idx)); break;
    }
}

static int raw_field(lua_State *L, int t, const char *key)
{
    lua_pushstring(L, key);
    lua_rawget(L, t);
    return lua_type(L, -1);
}

static char *dup_lua_string(rp_context *ctx, lua_State *L, int idx)
{
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    char *d = rp_alloc(ctx, len + 1);
    if (d) {
        memcpy(d, s, len);
        d[len] = '\0';
    }
    return d;
}

static int compare_params(const void *a, const void *b)
{
    return strcmp(((const rp_param *)a)->name, ((const rp_param *)b)->name);
}

const char *policy_param_type_name(rp_param_type t)
{
    switch (t) {
    case RP_PARAM_INTEGER: return "integer";
    case RP_PARAM_NUMBER: return "number";
    case RP_PARAM_BOOLEAN: return "boolean";
    default: return "string";
    }
}

/* A number value of a param of type integer or number: integral for integers. */
static bool number_fits(rp_param_type t, double v)
{
    if (!isfinite(v)) return false;
    return t == RP_PARAM_NUMBER || (v == floor(v) && fabs(v) <= 9007199254740992.0);
}

/* Check one param spec at stack top (a table) and fill *p. */
static int read_param(lua_State *L, meta_job *job, int spec, rp_param *p)
{
    static const char *const keys[] = {"type", "default", "min", "max", "doc", "values", NULL};
    const char *C = job->chunk, *N = p->name;
    rp_context *ctx = job->pol->ctx;
    char got[96];
    if (lua_type(L, spec) != LUA_TTABLE)
        return meta_fail(job, RP_EPOLICY,
                         "%s: params.%s must be a table {type = ..., default = ..., doc = ...}, got %s", C, N,
                         type_of(L, spec));
    lua_pushnil(L);
    while (lua_next(L, spec)) {
        lua_pop(L, 1);
        bool known = false;
        if (lua_type(L, -1) == LUA_TSTRING)
            for (size_t i = 0; keys[i] && !known; i++) known = strcmp(lua_tostring(L, -1), keys[i]) == 0;
        if (!known) {
            describe(L, -1, got, sizeof got);
            lua_pop(L, 1);
            return meta_fail(job, RP_EPOLICY,
                             "%s: params.%s has an unknown field %s (fields: type, default, min, max, doc, values)", C,
                             N, got);
        }
    }
    int t = raw_field(L, spec, "type");
    const char *tn = t == LUA_TSTRING ? lua_tostring(L, -1) : "";
    if (strcmp(tn, "integer") == 0) p->type = RP_PARAM_INTEGER;
    else if (strcmp(tn, "number") == 0) p->type = RP_PARAM_NUMBER;
    else if (strcmp(tn, "boolean") == 0) p->type = RP_PARAM_BOOLEAN;
    else if (strcmp(tn, "string") == 0) p->type = RP_PARAM_STRING;
    else {
        describe(L, -1, got, sizeof got);
        return meta_fail(job, RP_EPOLICY,
                         "%s: params.%s.type must be \"integer\", \"number\", \"boolean\" or \"string\", got %s", C,
                         N, got);
    }
    lua_pop(L, 1);
    bool numeric = p->type == RP_PARAM_INTEGER || p->type == RP_PARAM_NUMBER;

    t = raw_field(L, spec, "doc");
    if (t != LUA_TSTRING || lua_objlen(L, -1) == 0 || lua_objlen(L, -1) > 1000)
        return meta_fail(job, RP_EPOLICY, "%s: params.%s.doc must be a string of 1..1000 bytes saying what it does, got %s",
                         C, N, t == LUA_TSTRING ? "a string of that length" : type_of(L, -1));
    p->doc = dup_lua_string(ctx, L, -1);
    lua_pop(L, 1);
    if (!p->doc) return luaL_error(L, "not enough memory");

    for (int bound = 0; bound < 2; bound++) {
        const char *key = bound ? "max" : "min";
        t = raw_field(L, spec, key);
        if (t != LUA_TNIL) {
            if (!numeric)
                return meta_fail(job, RP_EPOLICY, "%s: params.%s.%s is only allowed for integer and number params", C,
                                 N, key);
            double v = lua_tonumber(L, -1);
            if (t != LUA_TNUMBER || !number_fits(p->type, v)) {
                describe(L, -1, got, sizeof got);
                return meta_fail(job, RP_EPOLICY, "%s: params.%s.%s must be %s, got %s", C, N, key,
                                 p->type == RP_PARAM_INTEGER ? "an integer" : "a finite number", got);
            }
            if (bound) p->has_max = true, p->max = v;
            else p->has_min = true, p->min = v;
        }
        lua_pop(L, 1);
    }
    if (p->has_min && p->has_max && p->min > p->max)
        return meta_fail(job, RP_EPOLICY, "%s: params.%s.min (%g) is above its max (%g)", C, N, p->min, p->max);

    t = raw_field(L, spec, "values");
    if (t != LUA_TNIL) {
        if (p->type != RP_PARAM_STRING)
            return meta_fail(job, RP_EPOLICY, "%s: params.%s.values is only allowed for string params", C, N);
        size_t n = t == LUA_TTABLE ? lua_objlen(L, -1) : 0;
        if (t != LUA_TTABLE || n < 1 || n > RP_POLICY_MAX_VALUES)
            return meta_fail(job, RP_EPOLICY, "%s: params.%s.values must be a list of 1..%d strings", C, N,
                             RP_POLICY_MAX_VALUES);
        p->values = rp_calloc(ctx, n, sizeof *p->values);
        if (!p->values) return luaL_error(L, "not enough memory");
        for (size_t i = 0; i < n; i++) {
            lua_rawgeti(L, -1, (int)i + 1);
            if (lua_type(L, -1) != LUA_TSTRING)
                return meta_fail(job, RP_EPOLICY, "%s: params.%s.values[%zu] must be a string, got %s", C, N, i + 1,
                                 type_of(L, -1));
            p->values[i] = dup_lua_string(ctx, L, -1);
            if (!p->values[i]) return luaL_error(L, "not enough memory");
            p->num_values = (int32_t)i + 1;
            lua_pop(L, 1);
        }
    }
    lua_pop(L, 1);

    t = raw_field(L, spec, "default");
    bool ok = false;
    switch (p->type) {
    case RP_PARAM_INTEGER:
    case RP_PARAM_NUMBER:
        ok = t == LUA_TNUMBER && number_fits(p->type, lua_tonumber(L, -1));
        if (ok) p->dflt_num = lua_tonumber(L, -1);
        break;
    case RP_PARAM_BOOLEAN:
        ok = t == LUA_TBOOLEAN;
        if (ok) p->dflt_boolean = lua_toboolean(L, -1);
        break;
    case RP_PARAM_STRING:
        ok = t == LUA_TSTRING && lua_objlen(L, -1) <= 1000;
        if (ok) {
            p->dflt_str = dup_lua_string(ctx, L, -1);
            if (!p->dflt_str) return luaL_error(L, "not enough memory");
        }
        break;
    }
    if (!ok) {
        describe(L, -1, got, sizeof got);
        return meta_fail(job, RP_EPOLICY, "%s: params.%s.default must be %s %s, got %s", C, N,
                         p->type == RP_PARAM_INTEGER ? "an" : "a", policy_param_type_name(p->type), got);
    }
    lua_pop(L, 1);
    if (numeric && ((p->has_min && p->dflt_num < p->min) || (p->has_max && p->dflt_num > p->max)))
        return meta_fail(job, RP_EPOLICY, "%s: params.%s.default (%g) is outside its range %g..%g", C, N, p->dflt_num,
                         p->has_min ? p->min : -INFINITY, p->has_max ? p->max : INFINITY);
    if (p->num_values) {
        bool found = false;
        for (int32_t i = 0; i < p->num_values && !found; i++) found = strcmp(p->values[i], p->dflt_str) == 0;
        if (!found)
            return meta_fail(job, RP_EPOLICY, "%s: params.%s.default '%s' is not one of its values", C, N, p->dflt_str);
    }
    p->num = p->dflt_num;
    p->boolean = p->dflt_boolean;
    return 0;
}

static int read_params(lua_State *L, meta_job *job, int tbl)
{
    rp_policy *pol = job->pol;
    const char *C = job->chunk;
    int t = raw_field(L, tbl, "params");
    if (t == LUA_TNIL) return 0;
    if (t != LUA_TTABLE)
        return meta_fail(job, RP_EPOLICY, "%s: 'params' must be a table of parameter specs, got %s", C, type_of(L, -1));
    int params = lua_gettop(L);
    int32_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, params)) {
        lua_pop(L, 1);
        if (++n > RP_POLICY_MAX_PARAMS) {
            lua_pop(L, 1);
            return meta_fail(job, RP_EPOLICY, "%s: 'params' declares more than %d params", C, RP_POLICY_MAX_PARAMS);
        }
        size_t len = 0;
        const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
        if (!k || !policy_valid_name(k, len) || (k[0] >= '0' && k[0] <= '9')) {
            char got[96];
            describe(L, -1, got, sizeof got);
            lua_pop(L, 1);
            return meta_fail(job, RP_EPOLICY,
                             "%s: param names must be identifiers of lowercase letters, digits and '_' (at most 63), "
                             "got %s",
                             C, got);
        }
    }
    if (n == 0) return 0;
    pol->params = rp_calloc(pol->ctx, (size_t)n, sizeof *pol->params);
    if (!pol->params) return luaL_error(L, "not enough memory");
    int32_t i = 0;
    lua_pushnil(L);
    while (lua_next(L, params) && i < n) {
        lua_pop(L, 1);
        snprintf(pol->params[i].name, sizeof pol->params[i].name, "%s", lua_tostring(L, -1));
        pol->num_params = ++i;
    }
    /* lua_next visits string keys in a per-process order: sort, then read the specs */
    qsort(pol->params, (size_t)pol->num_params, sizeof *pol->params, compare_params);
    for (i = 0; i < pol->num_params; i++) {
        lua_pushstring(L, pol->params[i].name);
        lua_rawget(L, params);
        read_param(L, job, lua_gettop(L), &pol->params[i]);
        if (job->status != RP_OK) return 0;
        lua_pop(L, 1);
    }
    return 0;
}

/* What the engine asks its trampoline to do (see engine_call). */
typedef enum job_kind { JOB_META = 0, JOB_INIT = 1, JOB_PLAN = 2 } job_kind;

typedef struct call_job {
    job_kind kind;
    rp_policy *pol;
    meta_job *meta;
    int32_t num_seqs, base_mb;
    rp_lua_plan_out *out;
    bool converting;   /* the policy has returned; its value is being converted */
    bool returned_nil;
} call_job;

static int check_metadata(lua_State *L, meta_job *job, int value)
{
    rp_policy *pol = job->pol;
    const char *C = job->chunk;
    char got[96];
    lua_settop(L, value);
    if (lua_type(L, value) != LUA_TTABLE)
        return meta_fail(job, RP_EPOLICY,
                         "%s: the chunk must return the policy table (return {name = ..., version = ..., api = 1, "
                         "description = ..., params = {...}, plan = function(ctx) ... end}), got %s",
                         C, type_of(L, value));
    size_t len = 0;
    int t = raw_field(L, value, "name");
    const char *s = t == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
    if (!s || !policy_valid_name(s, len)) {
        describe(L, -1, got, sizeof got);
        return meta_fail(job, RP_EPOLICY,
                         "%s: 'name' must be a string of lowercase letters, digits and '_' (at most 63), got %s", C, got);
    }
    snprintf(pol->info.name, sizeof pol->info.name, "%s", s);
    lua_pop(L, 1);

    t = raw_field(L, value, "api");
    double api = lua_tonumber(L, -1);
    if (t != LUA_TNUMBER || api != floor(api) || api < 1 || api > INT32_MAX) {
        describe(L, -1, got, sizeof got);
        return meta_fail(job, RP_EPOLICY,
                         "%s: 'api' must be an integer, the policy API version it targets (this RoutePack serves %d), got %s",
                         C, RP_POLICY_API, got);
    }
    pol->info.api = (int32_t)api;
    lua_pop(L, 1);
    if (pol->info.api != RP_POLICY_API && !job->any_api)
        return meta_fail(job, RP_ENOTSUP, "policy '%s' targets policy API %d, but this RoutePack serves API %d",
                         pol->info.name, (int)pol->info.api, RP_POLICY_API);

    t = raw_field(L, value, "version");
    s = t == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
    if (!s || len >= sizeof pol->info.version || !valid_version(s, len)) {
        describe(L, -1, got, sizeof got);
        return meta_fail(job, RP_EPOLICY, "%s: 'version' must be a string like \"1.2.0\", got %s", C,
                         t == LUA_TSTRING ? got : type_of(L, -1));
    }
    snprintf(pol->info.version, sizeof pol->info.version, "%s", s);
    lua_pop(L, 1);

    t = raw_field(L, value, "description");
    s = t == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
    if (!s || len == 0 || len >= sizeof pol->info.description || strchr(s, '\n') || strlen(s) != len)
        return meta_fail(job, RP_EPOLICY, "%s: 'description' must be one line of 1..%zu bytes, got %s", C,
                         sizeof pol->info.description - 1,
                         t == LUA_TSTRING ? (len == 0 ? "an empty string" : "a longer or multi-line string")
                                          : type_of(L, -1));
    snprintf(pol->info.description, sizeof pol->info.description, "%s", s);
    lua_pop(L, 1);

    read_params(L, job, value);
    if (job->status != RP_OK) return 0;
    lua_settop(L, value);

    t = raw_field(L, value, "plan");
    if (t != LUA_TFUNCTION)
        return meta_fail(job, RP_EPOLICY, "%s: 'plan' must be a function (plan(ctx) returns the plan), got %s", C,
                         type_of(L, -1));
    pol->plan_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    t = raw_field(L, value, "init");
    if (t != LUA_TNIL && t != LUA_TFUNCTION)
        return meta_fail(job, RP_EPOLICY, "%s: 'init' must be a function (init(ctx) runs once after loading), got %s",
                         C, type_of(L, -1));
    if (t == LUA_TFUNCTION) pol->init_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    else lua_pop(L, 1);
    lua_newtable(L);
    pol->state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

static void push_params(lua_State *L, const rp_policy *pol)
{
    lua_createtable(L, 0, pol->num_params);
    for (int32_t i = 0; i < pol->num_params; i++) {
        const rp_param *p = &pol->params[i];
        switch (p->type) {
        case RP_PARAM_INTEGER:
        case RP_PARAM_NUMBER: lua_pushnumber(L, p->num); break;
        case RP_PARAM_BOOLEAN: lua_pushboolean(L, p->boolean); break;
        default: lua_pushstring(L, p->str ? p->str : ""); break;
        }
        lua_setfield(L, -2, p->name);
    }
}

/* The engine's entry into the sandbox, run by rp_sandbox_call with the job as its
 * first argument: checks metadata, or builds ctx, calls init or plan and converts the
 * returned plan, all under the call's limits. */
static int engine_call(lua_State *L)
{
    call_job *job = lua_touserdata(L, 1);
    rp_policy *pol = job->pol;
    if (job->kind == JOB_META) return check_metadata(L, job->meta, 2);
    lua_settop(L, 0);
    rp_sandbox_check_c_stack(L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, job->kind == JOB_INIT ? pol->init_ref : pol->plan_ref);
    rp_lua_push_ctx(L, &pol->host);
    push_params(L, pol);
    lua_setfield(L, -2, "params");
    lua_rawgeti(L, LUA_REGISTRYINDEX, pol->state_ref);
    lua_setfield(L, -2, "state");
    lua_call(L, 1, 1);
    if (job->kind == JOB_INIT) return 0;
    job->converting = true;
    if (lua_isnil(L, -1)) {
        job->returned_nil = true;
        return 0;
    }
    /* converted in the capped context of the policy's C objects: what the plan expands
     * to (share sets, lists) counts against the policy's memory limit, not the engine's */
    rp_lua_to_plan(L, -1, &pol->host, &pol->host.plan_ctx, "plan", job->num_seqs, job->base_mb, job->out);
    return 0;
}

/* ---- params ---------------------------------------------------------------------------- */

static rp_param *find_param(rp_policy *pol, const char *name)
{
    for (int32_t i = 0; i < pol->num_params; i++)
        if (strcmp(pol->params[i].name, name) == 0) return &pol->params[i];
    return NULL;
}

static rp_status unknown_param(rp_policy *pol, const char *key, rp_error *err)
{
    char list[400];
    size_t used = 0;
    list[0] = '\0';
    const char *best = NULL;
    size_t bd = 3;
    for (int32_t i = 0; i < pol->num_params && used < sizeof list; i++) {
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", pol->params[i].name);
        size_t d = rp_edit_distance(key, pol->params[i].name);
        if (d < bd) bd = d, best = pol->params[i].name;
    }
    if (pol->num_params == 0)
        return rp_fail(err, RP_EINVAL, "policy '%s': unknown param '%s' (the policy declares no params)", pol->info.name, key);
    if (best)
        return rp_fail(err, RP_EINVAL, "policy '%s': unknown param '%s' (did you mean '%s'? the policy declares: %s)",
                       pol->info.name, key, best, list);
    return rp_fail(err, RP_EINVAL, "policy '%s': unknown param '%s' (the policy declares: %s)", pol->info.name, key, list);
}

static const char *json_type_words(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static rp_status apply_param(rp_policy *pol, rp_param *p, json_t *v, rp_error *err)
{
    const char *P = pol->info.name;
    switch (p->type) {
    case RP_PARAM_INTEGER:
    case RP_PARAM_NUMBER: {
        if (!json_is_number(v))
            return rp_fail(err, RP_EINVAL, "policy '%s': param '%s' must be %s, got %s", P, p->name,
                           p->type == RP_PARAM_INTEGER ? "an integer" : "a number", json_type_words(v));
        double d = json_number_value(v);
        if (!number_fits(p->type, d))
            return rp_fail(err, RP_EINVAL, "policy '%s': param '%s' must be an integer, got %.17g", P, p->name, d);
        if (p->has_min && d < p->min)
            return rp_fail(err, RP_ERANGE, "policy '%s': param '%s' is %.17g, below its minimum %.17g", P, p->name, d, p->min);
        if (p->has_max && d > p->max)
            return rp_fail(err, RP_ERANGE, "policy '%s': param '%s' is %.17g, above its maximum %.17g", P, p->name, d, p->max);
        p->num = d;
        return RP_OK;
    }
    case RP_PARAM_BOOLEAN:
        if (!json_is_boolean(v))
            return rp_fail(err, RP_EINVAL, "policy '%s': param '%s' must be a boolean, got %s", P, p->name, json_type_words(v));
        p->boolean = json_is_true(v);
        return RP_OK;
    default: {
        if (!json_is_string(v))
            return rp_fail(err, RP_EINVAL, "policy '%s': param '%s' must be a string, got %s", P, p->name, json_type_words(v));
        const char *s = json_string_value(v);
        if (p->num_values) {
            bool found = false;
            for (int32_t i = 0; i < p->num_values && !found; i++) found = strcmp(p->values[i], s) == 0;
            if (!found) {
                char list[300];
                size_t used = 0;
                list[0] = '\0';
                for (int32_t i = 0; i < p->num_values && used < sizeof list; i++)
                    used += (size_t)snprintf(list + used, sizeof list - used, "%s'%s'", i ? ", " : "", p->values[i]);
                return rp_fail(err, RP_EINVAL, "policy '%s': param '%s' is '%s', not one of %s", P, p->name, s, list);
            }
        }
        char *copy = rp_strdup(pol->ctx, s);
        if (!copy) return rp_fail_nomem(err, "a param value");
        rp_free(pol->ctx, p->str);
        p->str = copy;
        return RP_OK;
    }
    }
}

static rp_status apply_params(rp_policy *pol, const char *json, rp_error *err)
{
    for (int32_t i = 0; i < pol->num_params; i++) {
        rp_param *p = &pol->params[i];
        if (p->type == RP_PARAM_STRING) {
            p->str = rp_strdup(pol->ctx, p->dflt_str);
            if (!p->str) return rp_fail_nomem(err, "a param value");
        }
    }
    pol->params_json = rp_strdup(pol->ctx, json && *json ? json : "{}");
    if (!pol->params_json) return rp_fail_nomem(err, "the params");
    if (!json || !*json) return RP_OK;
    json_error_t je;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!root) return rp_fail(err, RP_EFORMAT, "policy '%s': params are not valid JSON: %s", pol->info.name, je.text);
    rp_status st = RP_OK;
    if (!json_is_object(root)) {
        st = rp_fail(err, RP_EINVAL, "policy '%s': params must be a JSON object, got %s", pol->info.name,
                     json_type_words(root));
        goto out;
    }
    /* the first offending key in byte order, so the message does not depend on order */
    const char *key;
    json_t *v;
    const char *bad = NULL;
    json_object_foreach(root, key, v) {
        if (!find_param(pol, key) && (!bad || strcmp(key, bad) < 0)) bad = key;
    }
    if (bad) {
        st = unknown_param(pol, bad, err);
        goto out;
    }
    for (int32_t i = 0; i < pol->num_params; i++) {
        v = json_object_get(root, pol->params[i].name);
        if (v) RP_CHECK_GOTO(apply_param(pol, &pol->params[i], v, err), st, out);
    }
out:
    json_decref(root);
    return st;
}

/* ---- loading ---------------------------------------------------------------------------- */

static void free_param(rp_context *ctx, rp_param *p)
{
    rp_free(ctx, p->str);
    rp_free(ctx, p->dflt_str);
    rp_free(ctx, p->doc);
    for (int32_t i = 0; i < p->num_values; i++) rp_free(ctx, p->values[i]);
    rp_free(ctx, p->values);
}

void rp_policy_free(rp_policy *pol)
{
    if (!pol) return;
    rp_sandbox_free(pol->sb); /* first: its collector frees plans through the host */
    rp_lua_host_release(&pol->host);
    for (int32_t i = 0; i < pol->num_params; i++) free_param(pol->ctx, &pol->params[i]);
    rp_free(pol->ctx, pol->params);
    rp_free(pol->ctx, pol->params_json);
    rp_free(pol->ctx, pol->source);
    free(pol->kept.bytes);
    rp_free(pol->ctx, pol);
}

rp_status rp_policy_load(rp_context *ctx, const rp_config *cfg, const char *source, size_t len,
                         const char *path, const rp_sandbox_limits *limits, const char *params_json,
                         bool any_api, rp_policy **out, rp_error *err)
{
    if (!ctx || !cfg || (!source && len) || !out)
        return rp_fail(err, RP_EINVAL, "policy: context, config, source and output are required");
    if (len > RP_POLICY_MAX_BYTES)
        return rp_fail(err, RP_ERANGE, "policy %s%s%sis %zu bytes of source; a policy may be at most %zu bytes",
                       path ? "'" : "", path ? path : "", path ? "' " : "", len, RP_POLICY_MAX_BYTES);
    rp_policy *pol = rp_calloc(ctx, 1, sizeof *pol);
    if (!pol) return rp_fail_nomem(err, "a policy");
    pol->ctx = ctx;
    pol->cfg = cfg;
    pol->plan_ref = pol->init_ref = pol->state_ref = LUA_NOREF;
    snprintf(pol->info.path, sizeof pol->info.path, "%s", path ? path : "");
    pol->info.hash = rp_hash64(source ? source : "", len, 0);
    /* kept for rp_sched_save_state: a checkpoint reloads the policy from its own text */
    pol->source = rp_alloc(ctx, len + 1);
    if (!pol->source) {
        rp_free(ctx, pol);
        return rp_fail_nomem(err, "a policy");
    }
    if (len) memcpy(pol->source, source, len);
    pol->source[len] = '\0';
    pol->source_len = len;
    const char *chunk = path && *path ? base_name(path) : "policy";
    rp_status st;
    RP_CHECK_GOTO(rp_sandbox_new(ctx, limits, &pol->sb, err), st, fail);
    RP_CHECK_GOTO(rp_lua_host_init(&pol->host, ctx, cfg, pol->sb, engine_call, err), st, fail);
    RP_CHECK_GOTO(rp_sandbox_load_text(pol->sb, source, len, chunk, err), st, fail);

    /* The chunk's value is on the stack: hand it to the metadata check, run through the
     * engine's trampoline (pushed from the registry: nothing allocated unprotected). */
    lua_State *L = rp_sandbox_state(pol->sb);
    meta_job meta;
    memset(&meta, 0, sizeof meta);
    meta.pol = pol;
    meta.chunk = chunk;
    meta.any_api = any_api;
    meta.status = RP_OK;
    call_job job;
    memset(&job, 0, sizeof job);
    job.kind = JOB_META;
    job.pol = pol;
    job.meta = &meta;
    lua_rawgeti(L, LUA_REGISTRYINDEX, pol->host.engine_ref);
    lua_insert(L, -2);
    lua_pushlightuserdata(L, &job);
    lua_insert(L, -2);
    RP_CHECK_GOTO(rp_sandbox_call(pol->sb, 2, 0, err), st, fail);
    if (meta.status != RP_OK) {
        st = rp_fail(err, meta.status, "%s", meta.msg);
        goto fail;
    }
    snprintf(pol->host.policy_name, sizeof pol->host.policy_name, "%s", pol->info.name);
    RP_CHECK_GOTO(apply_params(pol, params_json, err), st, fail);
    *out = pol;
    return RP_OK;
fail:
    rp_policy_free(pol);
    return st;
}

static int new_state(lua_State *L)
{
    rp_policy *pol = lua_touserdata(L, 1);
    lua_newtable(L);
    pol->state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

static rp_status run_job(rp_policy *pol, call_job *job, const rp_lua_frame *frame, rp_error *err)
{
    lua_State *L = rp_sandbox_state(pol->sb);
    rp_sandbox_seed(pol->sb, frame ? frame->seed : 0);
    rp_lua_host_bind(&pol->host, frame);
    lua_rawgeti(L, LUA_REGISTRYINDEX, pol->host.engine_ref);
    lua_pushlightuserdata(L, job);
    rp_status st = rp_sandbox_call(pol->sb, 1, 0, err);
    rp_lua_host_bind(&pol->host, NULL);
    return st;
}

rp_status rp_policy_init(rp_policy *pol, const rp_lua_frame *frame, rp_error *err)
{
    lua_State *L = rp_sandbox_state(pol->sb);
    /* a fresh ctx.state: replace the registry slot's table (inside a protected call) */
    if (pol->state_ref != LUA_NOREF) {
        luaL_unref(L, LUA_REGISTRYINDEX, pol->state_ref);
        pol->state_ref = LUA_NOREF;
    }
    int status = lua_cpcall(L, new_state, pol);
    if (status != 0) {
        lua_pop(L, 1);
        return rp_fail_nomem(err, "the policy state");
    }
    rp_error e;
    rp_status st = RP_OK;
    if (pol->init_ref != LUA_NOREF) {
        call_job job;
        memset(&job, 0, sizeof job);
        job.kind = JOB_INIT;
        job.pol = pol;
        st = run_job(pol, &job, frame, &e);
    }
    /* the state a rebuild after a limit trip starts from until a plan call succeeds */
    if (st == RP_OK) st = policy_keep_state(pol, NULL, &e);
    if (st != RP_OK)
        return rp_fail(err, st, "policy '%s': init failed: %s", pol->info.name, e.text);
    return RP_OK;
}

rp_status rp_policy_plan(rp_policy *pol, const rp_lua_frame *frame, int32_t num_seqs, int32_t base_mb,
                         rp_lua_plan_out *out, rp_call_failure *why, int64_t *work, rp_error *err)
{
    memset(out, 0, sizeof *out);
    call_job job;
    memset(&job, 0, sizeof job);
    job.kind = JOB_PLAN;
    job.pol = pol;
    job.num_seqs = num_seqs;
    job.base_mb = base_mb;
    job.out = out;
    rp_error e;
    rp_error_clear(&e);
    rp_status st = run_job(pol, &job, frame, &e);
    if (work) *work = rp_sandbox_work(pol->sb);
    /* what a rebuild after a later limit trip starts from; a state that cannot be kept fails the call */
    bool keeping = st == RP_OK;
    if (keeping) st = policy_keep_state(pol, work, &e);
    if (st == RP_OK) {
        *why = RP_CALL_OK;
        return RP_OK;
    }
    rp_plan_free(out->plan);
    memset(out, 0, sizeof *out);
    pol->tainted = st == RP_ELIMIT; /* a limit tripped, in the call or keeping its state: policy_ready */
    const char *P = pol->info.name;
    if (keeping) {
        *why = st == RP_ELIMIT ? RP_CALL_LIMIT : st == RP_ENOMEM ? RP_CALL_NOMEM : RP_CALL_ERROR;
        return rp_fail(err, st == RP_EINVAL ? RP_EPOLICY : st, "policy '%s' %s: %s", P,
                       st == RP_ELIMIT ? "stopped" : "failed", e.text);
    }
    if (st == RP_ENOMEM) {
        *why = RP_CALL_NOMEM;
        return rp_fail(err, st, "policy '%s': %s", P, e.text);
    }
    if (st == RP_ELIMIT) {
        *why = RP_CALL_LIMIT;
        return rp_fail(err, st, "policy '%s' stopped: %s", P, e.text);
    }
    if (job.converting) {
        *why = RP_CALL_BAD_PLAN;
        return rp_fail(err, RP_EPLAN, "policy '%s' returned an invalid plan: %s", P, e.text);
    }
    *why = RP_CALL_ERROR;
    rp_status code = st == RP_EPOLICY ? RP_EPOLICY : st;
    rp_fail(err, code, "policy '%s' failed: %s", P, e.text);
    if (err) err->line = e.line;
    return code;
}
