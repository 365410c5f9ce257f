/* The scheduler's policy sets (one joint policy, or packing then placement): loading,
 * reloading, describing and freeing them; and the scheduler's small shared helpers
 * (clocks, seeds, messages). The bottom of core/sched*.c. */
#include "sched_impl.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double sched_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double sched_thread_cpu_s(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0.0;
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* math.random's seed for a step: a function of the options' seed, the step and the
 * policy's position in a pair, never of time. */
uint64_t sched_step_seed(const rp_sched *s, int64_t step, int32_t which)
{
    return mix64(mix64(s->opts.seed) ^ mix64((uint64_t)step) ^ (uint64_t)which);
}

void sched_textf(char *dst, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, n, fmt, ap);
    va_end(ap);
}

/* Keep the message of a failed call in the handle (sqlite3_errmsg's contract). */
rp_status sched_fail_keep(rp_sched *s, rp_status st, const rp_error *err)
{
    sched_textf(s->errmsg, sizeof s->errmsg, "%s", err && err->text[0] ? err->text : rp_strerror(st));
    return st;
}

/* ---- policy sets ---------------------------------------------------------------------- */

void sched_set_free(policy_set *ps)
{
    for (int32_t i = 0; i < ps->count; i++) rp_policy_free(ps->pol[i]);
    memset(ps, 0, sizeof *ps);
}

void sched_set_describe(policy_set *ps)
{
    if (ps->count == 1) {
        const rp_policy_info *a = &ps->pol[0]->info;
        snprintf(ps->name, sizeof ps->name, "%s", a->name);
        snprintf(ps->version, sizeof ps->version, "%s", a->version);
        ps->hash = a->hash;
    } else {
        const rp_policy_info *a = &ps->pol[0]->info, *b = &ps->pol[1]->info;
        snprintf(ps->name, sizeof ps->name, "%.31s+%.31s", a->name, b->name);
        snprintf(ps->version, sizeof ps->version, "%.15s+%.15s", a->version, b->version);
        uint64_t both[2] = {a->hash, b->hash};
        ps->hash = rp_hash64(both, sizeof both, 0);
    }
}

/* The params object for component `name` of a pair ({"eplb": {...}}), as JSON text
 * (malloc'ed by jansson; NULL for none). */
static rp_status component_params(const char *pair_json, const char *a, const char *b, const char *name,
                                  char **out, rp_error *err)
{
    *out = NULL;
    if (!pair_json || !*pair_json) return RP_OK;
    json_error_t je;
    json_t *root = json_loads(pair_json, JSON_REJECT_DUPLICATES, &je);
    if (!root) return rp_fail(err, RP_EFORMAT, "policy '%s+%s': params are not valid JSON: %s", a, b, je.text);
    rp_status st = RP_OK;
    if (!json_is_object(root)) {
        st = rp_fail(err, RP_EINVAL, "policy '%s+%s': params must be a JSON object", a, b);
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, a) != 0 && strcmp(key, b) != 0) {
            st = rp_fail(err, RP_EINVAL,
                         "policy '%s+%s': unknown params key '%s'; a pair takes one object per component, named by "
                         "the policy: {\"%s\": {...}, \"%s\": {...}}",
                         a, b, key, a, b);
            goto out;
        }
        if (!json_is_object(v)) {
            st = rp_fail(err, RP_EINVAL, "policy '%s+%s': params.%s must be an object", a, b, key);
            goto out;
        }
    }
    v = json_object_get(root, name);
    if (v) {
        *out = json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (!*out) st = rp_fail_nomem(err, "params");
    }
out:
    json_decref(root);
    return st;
}

static rp_status open_one(rp_sched *s, const char *name_or_path, const char *base_dir, const char *params,
                          rp_policy **out, rp_error *err)
{
    return rp_policy_open(s->ctx, s->cfg, name_or_path, base_dir, &s->limits, params, out, err);
}

rp_status sched_init_policy(rp_sched *s, rp_policy *pol, int32_t which, rp_error *err)
{
    rp_lua_frame frame;
    memset(&frame, 0, sizeof frame);
    frame.step = -1;
    frame.seed = sched_step_seed(s, -1, which);
    return rp_policy_init(pol, &frame, err);
}

/* Load "NAME", "PATH" or "PACKING+PLACEMENT" into `ps` with its init run. `same_as`
 * (may be NULL): policies whose params carry over to a component of the same name. */
rp_status sched_load_set(rp_sched *s, const char *spec, const char *base_dir, const char *params_json,
                          const policy_set *same_as, policy_set *ps, rp_error *err)
{
    memset(ps, 0, sizeof *ps);
    const char *plus = strchr(spec, '+');
    char *resolved = NULL;
    bool single = !plus;
    if (plus) {
        /* a path may contain '+': an existing file wins */
        rp_error ignore;
        if (rp_policy_resolve(s->ctx, s->cfg, spec, base_dir, &resolved, &ignore) == RP_OK) single = true;
        rp_free(s->ctx, resolved);
    }
    rp_status st = RP_OK;
    char *sub = NULL;
    if (single) {
        const char *params = params_json;
        rp_policy *pol = NULL;
        RP_CHECK_GOTO(open_one(s, spec, base_dir, params, &pol, err), st, out);
        ps->pol[ps->count++] = pol;
        if (!params_json && same_as && same_as->count == 1 && strcmp(same_as->pol[0]->info.name, pol->info.name) == 0)
            params = same_as->pol[0]->params_json;
        /* the same policy as before, reloaded: its params carry over (and are checked
         * against what it declares now) */
        if (!params_json && params && strcmp(params, "{}") != 0) {
            sched_set_free(ps);
            RP_CHECK_GOTO(open_one(s, spec, base_dir, params, &pol, err), st, out);
            ps->pol[ps->count++] = pol;
        }
    } else {
        size_t alen = (size_t)(plus - spec);
        const char *b = plus + 1;
        if (alen == 0 || !*b || strchr(b, '+')) {
            st = rp_fail(err, RP_EINVAL, "policy '%s': a pair is PACKING+PLACEMENT, two policy names joined by one '+'", spec);
            goto out;
        }
        char a[1024];
        if (alen >= sizeof a) {
            st = rp_fail(err, RP_EINVAL, "policy '%s': name too long", spec);
            goto out;
        }
        memcpy(a, spec, alen);
        a[alen] = '\0';
        const char *parts[2] = {a, b};
        for (int i = 0; i < 2; i++) {
            rp_policy *pol = NULL;
            RP_CHECK_GOTO(open_one(s, parts[i], base_dir, NULL, &pol, err), st, out);
            ps->pol[ps->count++] = pol;
        }
        if (strcmp(ps->pol[0]->info.name, ps->pol[1]->info.name) == 0) {
            st = rp_fail(err, RP_EINVAL, "policy '%s': both components are policy '%s'", spec, ps->pol[0]->info.name);
            goto out;
        }
        for (int i = 0; i < 2; i++) {
            const char *name = ps->pol[i]->info.name;
            RP_CHECK_GOTO(component_params(params_json, ps->pol[0]->info.name, ps->pol[1]->info.name, name, &sub, err),
                          st, out);
            const char *params = sub;
            if (!params_json && same_as)
                for (int32_t k = 0; k < same_as->count; k++)
                    if (strcmp(same_as->pol[k]->info.name, name) == 0) params = same_as->pol[k]->params_json;
            if (params && strcmp(params, "{}") != 0) {
                rp_policy *pol = NULL;
                RP_CHECK_GOTO(open_one(s, parts[i], base_dir, params, &pol, err), st, out);
                rp_policy_free(ps->pol[i]);
                ps->pol[i] = pol;
            }
            free(sub);
            sub = NULL;
        }
    }
    for (int32_t i = 0; i < ps->count; i++) RP_CHECK_GOTO(sched_init_policy(s, ps->pol[i], i, err), st, out);
    sched_set_describe(ps);
out:
    free(sub);
    if (st != RP_OK) sched_set_free(ps);
    return st;
}

/* A fresh copy of `from`: every policy loaded again from its own source text with its
 * params, in a new sandbox, and its init run. A dry run that ran in the set it proves
 * would leave its globals and upvalues behind in the policy that then takes over; a copy
 * that is thrown away afterwards leaves nothing. */
rp_status sched_set_reload(rp_sched *s, const policy_set *from, policy_set *out, rp_error *err)
{
    memset(out, 0, sizeof *out);
    rp_status st = RP_OK;
    for (int32_t i = 0; i < from->count; i++) {
        const rp_policy *pol = from->pol[i];
        rp_policy *copy = NULL;
        st = rp_policy_load(s->ctx, s->cfg, pol->source, pol->source_len, pol->info.path[0] ? pol->info.path : NULL,
                            &s->limits, pol->params_json, false, &copy, err);
        if (st != RP_OK) break;
        out->pol[out->count++] = copy;
        st = sched_init_policy(s, copy, i, err);
        if (st != RP_OK) break;
    }
    if (st != RP_OK) sched_set_free(out);
    else sched_set_describe(out);
    return st;
}
