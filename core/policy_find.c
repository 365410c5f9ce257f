/* Policies: finding a policy file by name on the search path, reading it, listing what
 * is installed and describing a policy (metadata and params as JSON). Loading and calling
 * are core/policy.c. */
#include "jsonx.h"
#include "policy.h"

#include <lauxlib.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
    if (policy_valid_name(name_or_path, len)) {
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
        json_object_set_new(o, "type", json_string(policy_param_type_name(p->type)));
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
