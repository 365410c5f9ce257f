/* Policies: loading a policy file into a fresh sandbox, checking its metadata and
 * params, finding it by name on the search path, listing what is installed, and calling
 * its init and plan functions under the sandbox's limits. */
#include "jsonx.h"
#include "policy_state.h"
#include "sched_internal.h"

#include <lauxlib.h>

#include <dirent.h>
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

static bool valid_name(const char *s, size_t len)
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

static bool is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

const char *rp_policy_shipped_dir(void)
{
#ifdef RP_SOURCE_DIR
    if (is_dir(RP_SOURCE_DIR "/policies")) return RP_SOURCE_DIR "/policies";
#endif
#ifdef RP_DATADIR
    return RP_DATADIR "/policies";
#else
    return "policies";
#endif
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

static const char *param_type_name(rp_param_type t)
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
                         p->type == RP_PARAM_INTEGER ? "an" : "a", param_type_name(p->type), got);
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
        if (!k || !valid_name(k, len) || (k[0] >= '0' && k[0] <= '9')) {
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
    if (!s || !valid_name(s, len)) {
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

/* ---- reading policy files ------------------------------------------------------------ */

/* Read a policy file whole: opened without blocking (a FIFO with no writer would block
 * open() for ever), checked to be a regular file of at most RP_POLICY_MAX_BYTES before
 * anything is allocated, and read up to one byte past its size so that a file that
 * grows meanwhile is still capped. */
static rp_status read_policy_file(rp_context *ctx, const char *path, char **text, size_t *len, rp_error *err)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return rp_fail(err, RP_EIO, "policy file '%s': cannot open: %s", path, strerror(errno));
    rp_status st = RP_OK;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = rp_fail(err, RP_EIO, "policy file '%s': cannot stat: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = rp_fail(err, RP_EIO, "policy file '%s' is %s; a policy is read from a regular .lua file", path,
                     rp_file_kind((unsigned)sb.st_mode));
        goto out;
    }
    if (sb.st_size < 0 || (uint64_t)sb.st_size > RP_POLICY_MAX_BYTES) {
        st = rp_fail(err, RP_ERANGE, "policy file '%s' is %lld bytes; a policy file may be at most %zu bytes", path,
                     (long long)sb.st_size, RP_POLICY_MAX_BYTES);
        goto out;
    }
    st = rp_read_fd_whole(ctx, fd, (int64_t)sb.st_size, path, text, len, err);
out:
    close(fd);
    return st;
}

/* ---- finding policies --------------------------------------------------------------- */

static char *join_path(rp_context *ctx, const char *dir, const char *name, const char *suffix)
{
    size_t a = strlen(dir), b = strlen(name), c = strlen(suffix);
    char *p = rp_alloc(ctx, a + b + c + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t at = a;
    if (a && dir[a - 1] != '/') p[at++] = '/';
    memcpy(p + at, name, b);
    memcpy(p + at + b, suffix, c + 1);
    return p;
}

/* The search path: config dirs, RP_POLICY_PATH, the shipped dir. `each` returns true
 * to stop. */
static bool walk_dirs(const rp_config *cfg, bool (*each)(void *ud, const char *dir), void *ud)
{
    const rp_policy_config *pc = cfg ? rp_config_policy(cfg) : NULL;
    if (pc && pc->search_path)
        for (size_t i = 0; pc->search_path[i]; i++)
            if (each(ud, pc->search_path[i])) return true;
    const char *env = getenv("RP_POLICY_PATH");
    if (env && *env) {
        char dir[4096];
        const char *p = env;
        while (*p) {
            const char *colon = strchr(p, ':');
            size_t n = colon ? (size_t)(colon - p) : strlen(p);
            if (n > 0 && n < sizeof dir) {
                memcpy(dir, p, n);
                dir[n] = '\0';
                if (each(ud, dir)) return true;
            }
            p += n;
            if (*p == ':') p++;
        }
    }
    return each(ud, rp_policy_shipped_dir());
}

typedef struct find_job {
    rp_context *ctx;
    const char *name;
    char *found;
    char looked[600];
    size_t used;
    bool nomem;
} find_job;

static bool find_in(void *ud, const char *dir)
{
    find_job *f = ud;
    char *p = join_path(f->ctx, dir, f->name, ".lua");
    if (!p) {
        f->nomem = true;
        return true;
    }
    if (is_file(p)) {
        f->found = p;
        return true;
    }
    rp_free(f->ctx, p);
    if (f->used < sizeof f->looked)
        f->used += (size_t)snprintf(f->looked + f->used, sizeof f->looked - f->used, "%s%s", f->used ? ", " : "", dir);
    return false;
}

/* The "did you mean" of an unknown policy name: the closest file name (without .lua) on
 * the search path, at most 2 edits away and fewer than the name's length. */
typedef struct near_job {
    const char *name;
    char best[128];
    size_t best_d;
} near_job;

static bool near_in(void *ud, const char *dir)
{
    near_job *f = ud;
    DIR *d = opendir(dir);
    if (!d) return false;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t n = strlen(e->d_name);
        if (n <= 4 || n - 4 >= sizeof f->best || strcmp(e->d_name + n - 4, ".lua") != 0) continue;
        char stem[sizeof f->best];
        memcpy(stem, e->d_name, n - 4);
        stem[n - 4] = '\0';
        size_t dist = rp_edit_distance(f->name, stem);
        if (dist < f->best_d) f->best_d = dist, memcpy(f->best, stem, n - 3);
    }
    closedir(d);
    return false;
}

rp_status rp_policy_resolve(rp_context *ctx, const rp_config *cfg, const char *name_or_path,
                            const char *base_dir, char **path, rp_error *err)
{
    if (!name_or_path || !*name_or_path) return rp_fail(err, RP_EINVAL, "policy: no policy name or path given");
    size_t len = strlen(name_or_path);
    if (valid_name(name_or_path, len)) {
        find_job f;
        memset(&f, 0, sizeof f);
        f.ctx = ctx;
        f.name = name_or_path;
        walk_dirs(cfg, find_in, &f);
        if (f.nomem) return rp_fail_nomem(err, "a policy path");
        if (!f.found) {
            near_job near = {name_or_path, "", len > 2 ? 3 : len};
            walk_dirs(cfg, near_in, &near);
            char hint[sizeof near.best + 32] = "";
            if (near.best[0]) snprintf(hint, sizeof hint, "did you mean '%s'? ", near.best);
            return rp_fail(err, RP_EIO,
                           "policy '%s' not found (%slooked for %s.lua in: %s; set policy.search_path in the config "
                           "or RP_POLICY_PATH, or give a path)",
                           name_or_path, hint, name_or_path, f.looked);
        }
        *path = f.found;
        return RP_OK;
    }
    char *p = name_or_path[0] != '/' && base_dir && *base_dir ? join_path(ctx, base_dir, name_or_path, "")
                                                               : rp_strdup(ctx, name_or_path);
    if (!p) return rp_fail_nomem(err, "a policy path");
    struct stat sb;
    if (stat(p, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        rp_status st = rp_fail(err, RP_EIO, "policy file '%s' is %s; a policy is read from a regular .lua file", p,
                               rp_file_kind((unsigned)sb.st_mode));
        rp_free(ctx, p);
        return st;
    }
    if (!is_file(p)) {
        rp_status st = rp_fail(err, RP_EIO, "policy file '%s' not found (a policy is a name like 'routepack' or a path to a .lua file)", p);
        rp_free(ctx, p);
        return st;
    }
    *path = p;
    return RP_OK;
}

rp_status rp_policy_open(rp_context *ctx, const rp_config *cfg, const char *name_or_path,
                         const char *base_dir, const rp_sandbox_limits *limits,
                         const char *params_json, rp_policy **out, rp_error *err)
{
    char *path = NULL, *text = NULL;
    size_t len = 0;
    rp_status st;
    RP_CHECK_GOTO(rp_policy_resolve(ctx, cfg, name_or_path, base_dir, &path, err), st, out);
    RP_CHECK_GOTO(read_policy_file(ctx, path, &text, &len, err), st, out);
    st = rp_policy_load(ctx, cfg, text, len, path, limits, params_json, false, out, err);
out:
    rp_free(ctx, text);
    rp_free(ctx, path);
    return st;
}

/* ---- listing ---------------------------------------------------------------------------- */

typedef struct list_job {
    rp_context *ctx;
    char **seen;         /* directories listed so far (real paths): each is listed once */
    int32_t num_seen;
    const rp_config *cfg;
    rp_policy_info *infos;
    int32_t count, cap;
    rp_status status;
    rp_error *err;
} list_job;

static int compare_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool list_dir(void *ud, const char *dir)
{
    list_job *j = ud;
    char *real = realpath(dir, NULL);
    if (!real) return false;
    for (int32_t i = 0; i < j->num_seen; i++)
        if (strcmp(j->seen[i], real) == 0) {
            free(real);
            return false;
        }
    char **grown_seen = rp_realloc(j->ctx, j->seen, ((size_t)j->num_seen + 1) * sizeof *grown_seen);
    char *kept = rp_strdup(j->ctx, real);
    free(real);
    if (grown_seen) j->seen = grown_seen;
    if (!grown_seen || !kept) {
        rp_free(j->ctx, kept);
        return false;
    }
    j->seen[j->num_seen++] = kept;
    DIR *d = opendir(dir);
    if (!d) return false;
    char **names = NULL;
    int32_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".lua") != 0 || e->d_name[0] == '.') continue;
        if (n == cap) {
            int32_t nc = cap ? cap * 2 : 16;
            char **grown = rp_realloc(j->ctx, names, (size_t)nc * sizeof *grown);
            if (!grown) break;
            names = grown;
            cap = nc;
        }
        names[n] = rp_strdup(j->ctx, e->d_name);
        if (names[n]) n++;
    }
    closedir(d);
    /* directory order is the file system's: sort, so every listing reads the same */
    if (n) qsort(names, (size_t)n, sizeof *names, compare_names);
    for (int32_t i = 0; i < n; i++) {
        char *path = join_path(j->ctx, dir, names[i], "");
        char *text = NULL;
        size_t len = 0;
        rp_policy *pol = NULL;
        rp_error e2;
        if (path && read_policy_file(j->ctx, path, &text, &len, &e2) == RP_OK &&
            rp_policy_load(j->ctx, j->cfg, text, len, path, NULL, NULL, true, &pol, &e2) == RP_OK) {
            if (j->count == j->cap) {
                int32_t nc = j->cap ? j->cap * 2 : 16;
                rp_policy_info *grown = rp_realloc(j->ctx, j->infos, (size_t)nc * sizeof *grown);
                if (grown) j->infos = grown, j->cap = nc;
            }
            if (j->count < j->cap) {
                rp_policy_info *info = &j->infos[j->count];
                *info = pol->info;
                info->shadowed = false;
                for (int32_t k = 0; k < j->count; k++)
                    if (strcmp(j->infos[k].name, info->name) == 0) info->shadowed = true;
                j->count++;
            }
        } else if (path) {
            rp_log(j->ctx, RP_LOG_WARN, "policy list: skipping %s: %s", path, e2.text);
        }
        rp_policy_free(pol);
        rp_free(j->ctx, text);
        rp_free(j->ctx, path);
        rp_free(j->ctx, names[i]);
    }
    rp_free(j->ctx, names);
    return false;
}

rp_status rp_policy_list(rp_context *ctx, const rp_config *cfg, rp_policy_info **infos,
                         int32_t *count, rp_error *err)
{
    if (!ctx || !cfg || !infos || !count)
        return rp_fail(err, RP_EINVAL, "policy list: context, config and outputs are required");
    list_job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.cfg = cfg;
    j.err = err;
    walk_dirs(cfg, list_dir, &j);
    for (int32_t i = 0; i < j.num_seen; i++) rp_free(ctx, j.seen[i]);
    rp_free(ctx, j.seen);
    *infos = j.infos;
    *count = j.count;
    return RP_OK;
}

/* ---- describing ----------------------------------------------------------------------- */

static json_t *param_value_json(const rp_param *p, bool dflt)
{
    switch (p->type) {
    case RP_PARAM_INTEGER: return json_integer((json_int_t)(dflt ? p->dflt_num : p->num));
    case RP_PARAM_NUMBER: return json_real(dflt ? p->dflt_num : p->num);
    case RP_PARAM_BOOLEAN: return json_boolean(dflt ? p->dflt_boolean : p->boolean);
    default: return json_string(dflt ? p->dflt_str : p->str);
    }
}

rp_status rp_policy_to_json(const rp_policy *pol, char **text, size_t *len, rp_error *err)
{
    char hash[17];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)pol->info.hash);
    json_t *root = json_object(), *params = json_array();
    if (!root || !params) goto nomem;
    json_object_set_new(root, "name", json_string(pol->info.name));
    json_object_set_new(root, "version", json_string(pol->info.version));
    json_object_set_new(root, "api", json_integer(pol->info.api));
    json_object_set_new(root, "description", json_string(pol->info.description));
    json_object_set_new(root, "path", json_string(pol->info.path));
    json_object_set_new(root, "hash", json_string(hash));
    json_object_set_new(root, "has_init", json_boolean(pol->init_ref != LUA_NOREF));
    for (int32_t i = 0; i < pol->num_params; i++) {
        const rp_param *p = &pol->params[i];
        json_t *o = json_object();
        if (!o) goto nomem;
        json_object_set_new(o, "name", json_string(p->name));
        json_object_set_new(o, "type", json_string(param_type_name(p->type)));
        json_object_set_new(o, "default", param_value_json(p, true));
        json_object_set_new(o, "value", param_value_json(p, false));
        if (p->has_min) json_object_set_new(o, "min", json_real(p->min));
        if (p->has_max) json_object_set_new(o, "max", json_real(p->max));
        if (p->num_values) {
            json_t *vals = json_array();
            for (int32_t k = 0; k < p->num_values; k++) json_array_append_new(vals, json_string(p->values[k]));
            json_object_set_new(o, "values", vals);
        }
        json_object_set_new(o, "doc", json_string(p->doc));
        json_array_append_new(params, o);
    }
    json_object_set_new(root, "params", params);
    params = NULL;
    return rp_json_text(pol->ctx, root, "the policy description", text, len, err);
nomem:
    json_decref(root);
    json_decref(params);
    return rp_fail_nomem(err, "the policy description");
}

rp_status rp_policy_describe(rp_context *ctx, const rp_config *cfg, const char *name_or_path, char **json,
                             size_t *len, rp_error *err)
{
    if (!ctx || !cfg || !name_or_path || !json)
        return rp_fail(err, RP_EINVAL, "policy describe: context, config, policy and output are required");
    rp_policy *pol = NULL;
    rp_status st = rp_policy_open(ctx, cfg, name_or_path, NULL, NULL, NULL, &pol, err);
    if (st != RP_OK) return st;
    st = rp_policy_to_json(pol, json, len, err);
    rp_policy_free(pol);
    return st;
}
