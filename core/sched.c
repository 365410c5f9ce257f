/* The scheduler: one step is statistics -> policy (or packing policy then placement
 * policy) -> merge with what it omitted -> stable slots -> validation -> fallback ->
 * multi-rank agreement -> evaluation; plus hot swap at a step boundary after a dry run. */
#include "cost_internal.h"
#include "jsonx.h"
#include "limits_internal.h"
#include "policy_state.h"
#include "sched_internal.h"
#include "sched_migrate.h"
#include "stats_internal.h"

#include "routepack/baseline.h"
#include "routepack/joint.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* The safe default (docs/policies.md): verl's two-level Karmarkar-Karp keyed by each
 * sequence's attention time, token cap enforced; placement contiguous. */
#define SAFE_DEFAULT "attn_kk+contiguous"
#define MAX_HISTORY 1024
/* Multi-rank: a rank's record in each allgather: bytes 0-3 flags, 4-7 the rank's
 * status (little-endian), 8-15 a hash. */
#define RECORD 16
/* The agreed plan is broadcast in pieces of this size into a buffer held by the
 * scheduler, so a rank that cannot allocate the whole text still takes part. */
#define PLAN_CHUNK ((size_t)256 * 1024)

/* policy_set: sched_internal.h (the checkpoint, core/sched_state.c, reads it too) */

struct rp_sched {
    rp_context *ctx;
    const rp_config *cfg;
    rp_sched_options opts;
    char *spec;              /* the policy as given */
    char *base_dir;          /* for a config-relative policy path; NULL: the working dir */
    char *params_json;       /* NULL: defaults */
    rp_comm comm;
    bool has_comm;
    unsigned char *gather_buf; /* [comm.size][RECORD]: the step's allgathers */
    unsigned char *chunk_buf;  /* [PLAN_CHUNK]: the agreed plan's broadcast */
    rp_sandbox_limits limits;

    policy_set running;
    policy_set staged;
    policy_set previous;     /* what the last hot swap replaced: a demotion's target */
    int32_t failed_steps;    /* steps in a row that fell back on every rank */
    int64_t staged_at;       /* -1: the next step */

    rp_plan *current;        /* the plan in use */
    rp_plan *initial;        /* the placement in use before the first step */
    bool has_step;
    int64_t last_step;
    rp_batch *prev_batch;    /* the last step's inputs, for dry runs */
    rp_stats *prev_stats;
    /* the statistics of the step before prev_stats, kept (only on the path from
     * statistics) so the next step's copy reuses their storage: stats_copy_reusing */
    rp_stats *spare_stats;
    bool keep_spare;

    int32_t hist_cap, hist_count, hist_head; /* ring; head = next slot to write */
    int64_t *hist_steps;
    int64_t *hist_loads;     /* [cap][L * E] */
    const int64_t **hist_ptrs;
    int64_t *hist_view_steps;

    rp_step_report report;
    bool has_report;
    char errmsg[RP_ERROR_TEXT];
    sched_migration migration; /* the last step's migration plan (core/sched_migrate.c) */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double thread_cpu_s(void)
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
/* The default instruction budget of a step's policy call: the sandbox's default, or 16
 * full evaluations of the cost model on this batch if that is more, so that a policy
 * that leans on the C primitives (rp.joint, rp.evaluate) is not stopped on a large batch
 * where the same work is legitimate (docs/policies.md, Limits); under pipeline
 * parallelism also those rp.joint makes to choose its packing. */
static int64_t step_instructions(const rp_sched *s, const rp_batch *b)
{
    int64_t eval = rp_lua_evaluation_units(s->cfg, b) * (16 + rp_joint_packing_evaluations(s->cfg));
    return eval > RP_SANDBOX_DEFAULT_INSTRUCTIONS ? eval : RP_SANDBOX_DEFAULT_INSTRUCTIONS;
}

static uint64_t step_seed(const rp_sched *s, int64_t step, int32_t which)
{
    return mix64(mix64(s->opts.seed) ^ mix64((uint64_t)step) ^ (uint64_t)which);
}

/* snprintf that may cut long messages (reasons nest other messages). */
static void textf(char *dst, size_t n, const char *fmt, ...) RP_PRINTF(3, 4);
static void textf(char *dst, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, n, fmt, ap);
    va_end(ap);
}

/* Keep the message of a failed call in the handle (sqlite3_errmsg's contract). */
static rp_status fail_keep(rp_sched *s, rp_status st, const rp_error *err)
{
    textf(s->errmsg, sizeof s->errmsg, "%s", err && err->text[0] ? err->text : rp_strerror(st));
    return st;
}

/* ---- options ------------------------------------------------------------------------- */

void rp_sched_options_default(rp_sched_options *opts)
{
    memset(opts, 0, sizeof *opts);
    opts->split = RP_SPLIT_EVEN;
    opts->history = 8;
}

static rp_status check_options(const rp_sched_options *o, rp_error *err)
{
    if (o->history < 0 || o->history > MAX_HISTORY)
        return rp_fail(err, RP_EINVAL, "sched: history is %d; it must be within 0..%d", o->history, MAX_HISTORY);
    if (o->split != RP_SPLIT_EVEN && o->split != RP_SPLIT_LOCALITY)
        return rp_fail(err, RP_EINVAL, "sched: unknown split rule %d", (int)o->split);
    if (o->max_instructions < 0 || o->max_depth < 0 || !(o->max_wall_s >= 0) || !isfinite(o->max_wall_s))
        return rp_fail(err, RP_EINVAL, "sched: sandbox limits must be >= 0 (0: the default)");
    if (o->comm && (o->comm->size < 1 || o->comm->rank < 0 || o->comm->rank >= o->comm->size ||
                    !o->comm->allgather || !o->comm->bcast))
        return rp_fail(err, RP_EINVAL, "sched: comm must have size >= 1, a rank in [0, size) and both operations");
    return RP_OK;
}

/* ---- policy sets ---------------------------------------------------------------------- */

static void set_free(policy_set *ps)
{
    for (int32_t i = 0; i < ps->count; i++) rp_policy_free(ps->pol[i]);
    memset(ps, 0, sizeof *ps);
}

static void set_describe(policy_set *ps)
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

static rp_status init_policy(rp_sched *s, rp_policy *pol, int32_t which, rp_error *err)
{
    rp_lua_frame frame;
    memset(&frame, 0, sizeof frame);
    frame.step = -1;
    frame.seed = step_seed(s, -1, which);
    return rp_policy_init(pol, &frame, err);
}

/* Load "NAME", "PATH" or "PACKING+PLACEMENT" into `ps` with its init run. `same_as`
 * (may be NULL): policies whose params carry over to a component of the same name. */
static rp_status load_set(rp_sched *s, const char *spec, const char *base_dir, const char *params_json,
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
            set_free(ps);
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
    for (int32_t i = 0; i < ps->count; i++) RP_CHECK_GOTO(init_policy(s, ps->pol[i], i, err), st, out);
    set_describe(ps);
out:
    free(sub);
    if (st != RP_OK) set_free(ps);
    return st;
}

/* ---- creation ------------------------------------------------------------------------ */

void rp_sched_free(rp_sched *s)
{
    if (!s) return;
    rp_context *ctx = s->ctx;
    set_free(&s->running);
    set_free(&s->staged);
    set_free(&s->previous);
    rp_plan_free(s->current);
    rp_plan_free(s->initial);
    sched_migration_free(&s->migration, ctx);
    rp_batch_free(s->prev_batch);
    rp_stats_free(s->prev_stats);
    rp_stats_free(s->spare_stats);
    rp_free(ctx, s->hist_steps);
    rp_free(ctx, s->hist_loads);
    rp_free(ctx, s->hist_ptrs);
    rp_free(ctx, s->hist_view_steps);
    rp_free(ctx, s->spec);
    rp_free(ctx, s->base_dir);
    rp_free(ctx, s->params_json);
    rp_free(ctx, s->gather_buf);
    rp_free(ctx, s->chunk_buf);
    rp_free(ctx, s);
}

const char *rp_sched_errmsg(const rp_sched *s) { return s ? s->errmsg : "no scheduler"; }

rp_status rp_sched_new(rp_context *ctx, const rp_config *cfg, const rp_sched_options *opts, rp_sched **out,
                       rp_error *err)
{
    if (!ctx || !cfg || !out) return rp_fail(err, RP_EINVAL, "sched: context, config and output are required");
    rp_sched_options defaults;
    rp_sched_options_default(&defaults);
    if (!opts) opts = &defaults;
    rp_status st = check_options(opts, err);
    if (st != RP_OK) return st;
    rp_sched *s = rp_calloc(ctx, 1, sizeof *s);
    if (!s) return rp_fail_nomem(err, "a scheduler");
    s->ctx = ctx;
    s->cfg = cfg;
    s->opts = *opts;
    s->opts.policy = NULL;
    s->opts.params_json = NULL;
    s->opts.comm = NULL;
    s->opts.initial_placement = NULL;
    if (s->opts.demote_after == 0) s->opts.demote_after = RP_SCHED_DEMOTE_AFTER;
    s->staged_at = -1;
    s->limits = rp_sandbox_limits_default();
    if (opts->max_instructions > 0) s->limits.max_instructions = opts->max_instructions;
    if (opts->max_wall_s > 0) s->limits.max_wall_s = opts->max_wall_s;
    if (opts->max_memory_bytes > 0) s->limits.max_memory_bytes = opts->max_memory_bytes;
    if (opts->max_depth > 0) s->limits.max_depth = opts->max_depth;
    if (opts->comm) {
        s->comm = *opts->comm;
        s->has_comm = true;
        /* held for the scheduler's life: no allocation stands between a rank and a
         * collective */
        s->gather_buf = rp_alloc(ctx, (size_t)s->comm.size * RECORD);
        s->chunk_buf = rp_alloc(ctx, PLAN_CHUNK);
        if (!s->gather_buf || !s->chunk_buf) {
            st = rp_fail_nomem(err, "a scheduler");
            goto fail;
        }
    }

    const rp_policy_config *pc = rp_config_policy(cfg);
    const char *spec = opts->policy ? opts->policy : pc->name;
    bool config_policy = !opts->policy || strcmp(opts->policy, pc->name) == 0;
    s->spec = rp_strdup(ctx, spec);
    const char *params = opts->params_json ? opts->params_json : config_policy ? pc->params_json : NULL;
    if (params) s->params_json = rp_strdup(ctx, params);
    if (!s->spec || (params && !s->params_json)) {
        st = rp_fail_nomem(err, "a scheduler");
        goto fail;
    }
    if (!opts->policy) {
        /* a relative policy path in the config is relative to the config's directory */
        const char *src = rp_config_source(cfg);
        const char *slash = src ? strrchr(src, '/') : NULL;
        if (slash) {
            size_t n = (size_t)(slash - src);
            s->base_dir = rp_alloc(ctx, n + 1);
            if (!s->base_dir) {
                st = rp_fail_nomem(err, "a scheduler");
                goto fail;
            }
            memcpy(s->base_dir, src, n);
            s->base_dir[n] = '\0';
        }
    }

    const rp_model *md = rp_config_model(cfg);
    s->hist_cap = opts->history;
    size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
    if (s->hist_cap > 0) {
        s->hist_steps = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_steps);
        s->hist_loads = rp_calloc(ctx, (size_t)s->hist_cap * cells, sizeof *s->hist_loads);
        s->hist_ptrs = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_ptrs);
        s->hist_view_steps = rp_calloc(ctx, (size_t)s->hist_cap, sizeof *s->hist_view_steps);
        if (!s->hist_steps || !s->hist_loads || !s->hist_ptrs || !s->hist_view_steps) {
            st = rp_fail_nomem(err, "the scheduler's history");
            goto fail;
        }
    }
    RP_CHECK_GOTO(sched_initial_placement(ctx, cfg, opts->initial_placement, &s->initial, err), st, fail);
    RP_CHECK_GOTO(load_set(s, s->spec, s->base_dir, s->params_json, NULL, &s->running, err), st, fail);
    *out = s;
    return RP_OK;
fail:
    rp_sched_free(s);
    return st;
}

/* ---- one step's inputs ------------------------------------------------------------------ */

typedef struct step_inputs {
    rp_sched *s;
    int64_t step;
    const rp_batch *batch;
    const rp_stats *stats;
    rp_cost *cost;
    const rp_plan *placement;  /* in use: the initial placement on the first step */
    rp_lua_history history;
    rp_plan *dflt;             /* the safe default for this batch, made on first use */
    rp_plan *base;             /* dflt's packing + the placement in use */
    rp_status base_status;
    rp_error base_err;
    bool base_tried;
} step_inputs;

static void inputs_release(step_inputs *in)
{
    rp_plan_free(in->dflt);
    rp_plan_free(in->base);
    in->dflt = in->base = NULL;
}

/* What runs when the policy gives nothing: the safe default packing of this batch and
 * the placement in use (the initial placement on the first step). */
static const rp_plan *inputs_base(step_inputs *in, rp_error *err)
{
    if (!in->base_tried) {
        in->base_tried = true;
        rp_sched *s = in->s;
        rp_error_clear(&in->base_err);
        in->base_status = rp_baseline_plan(s->ctx, s->cfg, in->batch, in->stats, NULL, SAFE_DEFAULT, 0, &in->dflt,
                                           &in->base_err);
        if (in->base_status == RP_OK)
            in->base_status = rp_lua_plan_compose(s->ctx, s->cfg, in->dflt, in->placement ? in->placement : in->dflt,
                                                  NULL, rp_plan_num_microbatches(in->dflt), &in->base, &in->base_err);
        if (in->base_status != RP_OK) {
            char msg[RP_ERROR_TEXT];
            textf(msg, sizeof msg, "%s", in->base_err.text);
            rp_fail(&in->base_err, in->base_status, "the safe default packing (%s) cannot pack this batch: %s",
                    SAFE_DEFAULT, msg);
        }
    }
    if (in->base_status != RP_OK) {
        if (err) *err = in->base_err;
        return NULL;
    }
    return in->base;
}

/* ctx.plan's content for the first policy of a step, or for the second (then `fixed`). */
typedef struct base_src {
    step_inputs *in;
    const rp_plan *fixed;
} base_src;

static const rp_plan *base_of(void *ud, rp_error *err)
{
    base_src *b = ud;
    return b->fixed ? b->fixed : inputs_base(b->in, err);
}

/* History views, most recent first; `skip` drops the newest entries (a dry run sees
 * the history as it was before the step it replays). */
static void fill_history(rp_sched *s, step_inputs *in, int32_t skip)
{
    const rp_model *md = rp_config_model(s->cfg);
    size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
    int32_t count = s->hist_count - skip;
    if (count < 0) count = 0;
    for (int32_t i = 0; i < count; i++) {
        int32_t slot = ((s->hist_head - 1 - skip - i) % s->hist_cap + s->hist_cap) % s->hist_cap;
        s->hist_ptrs[i] = s->hist_loads + (size_t)slot * cells;
        s->hist_view_steps[i] = s->hist_steps[slot];
    }
    in->history.count = count;
    in->history.steps = s->hist_view_steps;
    in->history.loads = s->hist_ptrs;
}

static void push_history(rp_sched *s, int64_t step, const rp_stats *stats)
{
    if (s->hist_cap == 0) return;
    const rp_model *md = rp_config_model(s->cfg);
    size_t E = (size_t)md->num_experts;
    int64_t *dst = s->hist_loads + (size_t)s->hist_head * (size_t)md->num_layers * E;
    for (int32_t l = 0; l < md->num_layers; l++)
        memcpy(dst + (size_t)l * E, rp_stats_expert_load(stats, l), E * sizeof *dst);
    s->hist_steps[s->hist_head] = step;
    s->hist_head = (s->hist_head + 1) % s->hist_cap;
    if (s->hist_count < s->hist_cap) s->hist_count++;
}

/* ---- running the policies ------------------------------------------------------------- */

typedef struct run_result {
    rp_plan *plan;       /* merged, stable, valid; NULL on failure */
    rp_lua_decision decision; /* the last rp.decision of the set's policies */
    int32_t fallback_checks, fallback_changes; /* rp.joint's checks, over the set */
    int64_t work;
    double wall_s;       /* in the policy calls */
    double cpu_s;        /* the same, this thread's CPU time */
    rp_call_failure why;
    rp_status status;
    char reason[RP_ERROR_TEXT];
} run_result;

static void mib_text(size_t bytes, char *buf, size_t n)
{
    if (bytes % ((size_t)1 << 20) == 0) snprintf(buf, n, "%zu MiB", bytes >> 20);
    else snprintf(buf, n, "%.1f MiB", (double)bytes / (1 << 20));
}

/* Whether the engine may pay for `plan`: its evaluation (the most the engine does with a
 * returned plan; merging, slot stabilising and validation are linear in the plan, which
 * the policy's memory cap bounds) must fit the limits the policy itself runs under,
 * decided from the plan's shape before anything is allocated. A plan the policy could
 * not have passed to rp.evaluate is refused (fallback), never evaluated at the engine's
 * expense. Fills `reason` when it refuses. RP_ENOMEM never: nothing is allocated. */
static bool engine_can_afford(const policy_set *ps, const step_inputs *in, const rp_plan *plan, char *reason,
                              size_t reason_len)
{
    int64_t units = 0;
    size_t bytes = 0;
    rp_error e;
    rp_error_clear(&e);
    if (rp_cost_evaluation_needs(in->cost, plan, &units, &bytes, &e) != RP_OK) {
        textf(reason, reason_len, "%s", e.text);
        return false;
    }
    const rp_sandbox_limits *lim = rp_sandbox_limits_of(ps->pol[ps->count - 1]->sb);
    char shape[160];
    textf(shape, sizeof shape, "%d microbatches x %d layers x %d GPUs x %d experts", rp_plan_num_microbatches(plan),
          rp_plan_num_layers(plan), rp_plan_num_gpus(plan), rp_plan_num_experts(plan));
    if (units > lim->max_instructions) {
        textf(reason, reason_len,
              "evaluating it (%s) would take %lld work units, over the instruction limit of %lld that rp.evaluate "
              "would have charged them to",
              shape, (long long)units, (long long)lim->max_instructions);
        return false;
    }
    if (bytes > lim->max_memory_bytes) {
        char need[32], cap[32];
        mib_text(bytes, need, sizeof need);
        mib_text(lim->max_memory_bytes, cap, sizeof cap);
        textf(reason, reason_len, "evaluating it (%s) needs %s, over the policy's memory limit of %s", shape, need,
              cap);
        return false;
    }
    return true;
}

/* Run the set's policies on `in` and return the merged, slot-stabilised, validated plan,
 * or the reason it failed (a policy error, a limit, an invalid plan, anything that failed
 * inside the policy's call). RP_ENOMEM of the engine's own merging and validation and a
 * batch the safe default cannot pack are errors of the step (status), not reasons. */
static void run_set(rp_sched *s, policy_set *ps, step_inputs *in, run_result *r)
{
    memset(r, 0, sizeof *r);
    const rp_plan *so_far = NULL; /* owned below as `merged` */
    rp_plan *merged = NULL;
    rp_error err;
    rp_error_clear(&err);
    int32_t n = rp_batch_num_seqs(in->batch);
    for (int32_t i = 0; i < ps->count; i++) {
        base_src src = {in, so_far};
        rp_lua_frame frame;
        memset(&frame, 0, sizeof frame);
        frame.step = in->step;
        frame.seed = step_seed(s, in->step, i);
        frame.batch = in->batch;
        frame.stats = in->stats;
        frame.cost = in->cost;
        frame.placement = in->placement;
        frame.base = base_of;
        frame.base_ud = &src;
        frame.history = s->hist_cap > 0 ? &in->history : NULL;
        rp_lua_plan_out got;
        int64_t work = 0;
        if (s->opts.max_instructions == 0)
            rp_sandbox_set_max_instructions(ps->pol[i]->sb, step_instructions(s, in->batch));
        double t0 = now_s(), c0 = thread_cpu_s();
        /* after a limit trip: rebuilt from its source in the window of this call */
        rp_status st = policy_ready(&ps->pol[i], &err);
        if (st != RP_OK) r->why = RP_CALL_LIMIT;
        else st = rp_policy_plan(ps->pol[i], &frame, n, 0, &got, &r->why, &work, &err);
        r->wall_s += now_s() - t0;
        r->cpu_s += thread_cpu_s() - c0;
        if (ps->pol[i]->host.decision.set) r->decision = ps->pol[i]->host.decision;
        r->fallback_checks += ps->pol[i]->host.fallback_checks;
        r->fallback_changes += ps->pol[i]->host.fallback_changes;
        r->work += work;
        if (st != RP_OK) {
            /* whatever failed inside the policy's call, out of memory included, is the
             * policy's failure: the step falls back */
            textf(r->reason, sizeof r->reason, "%s", err.text);
            goto fail;
        }
        /* what the policy omitted stays as ctx.plan had it */
        const rp_plan *base = so_far ? so_far : inputs_base(in, &err);
        if (!base) {
            rp_plan_free(got.plan);
            r->status = in->base_status;
            textf(r->reason, sizeof r->reason, "%s", err.text);
            goto fail;
        }
        rp_plan *next = NULL;
        const rp_plan *q = got.plan;
        st = rp_lua_plan_compose(s->ctx, s->cfg, q && got.has_packing ? q : base, q && got.has_placement ? q : base,
                                 q && (got.has_levers || got.has_packing) ? q : base, rp_plan_num_microbatches(base),
                                 &next, &err);
        rp_plan_free(got.plan);
        if (st != RP_OK) {
            if (st == RP_ENOMEM) r->status = st;
            r->why = RP_CALL_BAD_PLAN;
            textf(r->reason, sizeof r->reason, "policy '%s' returned an invalid plan: %s", ps->pol[i]->info.name,
                     err.text);
            goto fail;
        }
        rp_plan_free(merged);
        merged = next;
        so_far = merged;
    }
    char why[RP_ERROR_TEXT];
    if (!engine_can_afford(ps, in, merged, why, sizeof why)) {
        r->why = RP_CALL_BAD_PLAN;
        textf(r->reason, sizeof r->reason, "policy '%s' returned a plan the engine will not evaluate: %s", ps->name,
              why);
        goto fail;
    }
    /* physical slots: experts that stay on an EP rank keep their slot */
    rp_status st = RP_OK;
    if (in->placement) st = rp_plan_stabilize_slots(merged, in->placement, &err);
    if (st == RP_OK) st = rp_plan_validate(merged, s->cfg, in->batch, &err);
    if (st != RP_OK) {
        if (st == RP_ENOMEM) r->status = st;
        r->why = RP_CALL_BAD_PLAN;
        textf(r->reason, sizeof r->reason, "policy '%s' returned an invalid plan: %s", ps->name, err.text);
        goto fail;
    }
    r->plan = merged;
    return;
fail:
    rp_plan_free(merged);
    r->plan = NULL;
    if (r->why == RP_CALL_OK) r->why = RP_CALL_ERROR;
}

/* ---- multi-rank agreement (docs/distributed.md) ------------------------------------------
 * Every rank reaches every collective of a step whatever happens to it locally: a local
 * error travels in the rank's record, and then every rank returns an error and nothing
 * changes anywhere. The buffers the collectives use are allocated with the scheduler,
 * so no allocation can keep a rank away from one. */

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}


static bool multi_rank(const rp_sched *s) { return s->has_comm && s->comm.size > 1; }

static void put_status(unsigned char *rec, rp_status st)
{
    for (int i = 0; i < 4; i++) rec[4 + i] = (unsigned char)((uint32_t)st >> (8 * i));
}

static rp_status get_status(const unsigned char *rec)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)rec[4 + i] << (8 * i);
    /* a code this build does not know is still a failure */
    return v <= (uint32_t)RP_EPLAN ? (rp_status)v : RP_ETRANSPORT;
}

/* Allgather one record per rank; *all points into the scheduler's buffer. */
static rp_status gather(rp_sched *s, const unsigned char *mine, const unsigned char **all, rp_error *err)
{
    rp_status st = s->comm.allgather(s->comm.ud, mine, RECORD, s->gather_buf);
    if (st != RP_OK)
        return rp_fail(err, RP_ETRANSPORT, "sched: allgather across %d ranks failed: %s", s->comm.size,
                       rp_strerror(st));
    *all = s->gather_buf;
    return RP_OK;
}

/* After a gather: this rank's own error (its message is in err), else the status of the
 * lowest rank that failed, else RP_OK. */
static rp_status ranks_failure(rp_sched *s, const unsigned char *all, rp_status mine, int64_t step, const char *phase,
                               rp_error *err)
{
    if (mine != RP_OK) return mine;
    for (int32_t q = 0; q < s->comm.size; q++) {
        rp_status st = get_status(all + (size_t)q * RECORD);
        if (st != RP_OK)
            return rp_fail(err, st, "sched: step %lld: rank %d failed %s (%s); no rank changes its plan",
                           (long long)step, (int)q, phase, rp_strerror(st));
    }
    return RP_OK;
}

/* Every rank takes rank `root`'s plan: its JSON length, then the text in pieces. A root
 * that cannot write its plan sends length 0 and every rank fails; a rank that cannot
 * hold or parse the text still receives every piece and returns its error (the caller
 * agrees on the outcome afterwards). */
static rp_status take_plan_of(rp_sched *s, int32_t root, rp_plan **plan, rp_error *err)
{
    char *text = NULL;
    size_t len = 0;
    rp_status st = RP_OK;
    const bool is_root = s->comm.rank == root;
    unsigned char lenbuf[8];
    memset(lenbuf, 0, sizeof lenbuf);
    if (is_root) {
        st = rp_plan_to_json(*plan, &text, &len, err);
        put_u64(lenbuf, st == RP_OK ? (uint64_t)len : 0);
    }
    rp_status cst = s->comm.bcast(s->comm.ud, lenbuf, sizeof lenbuf, root);
    if (cst != RP_OK) {
        st = rp_fail(err, RP_ETRANSPORT, "sched: broadcasting the plan's length from rank %d failed", root);
        goto out;
    }
    const uint64_t n = get_u64(lenbuf);
    if (n == 0 || n > ((uint64_t)1 << 40)) {
        if (st == RP_OK)
            st = rp_fail(err, RP_ETRANSPORT, "sched: rank %d sent a plan of %llu bytes (it could not write its plan)",
                         root, (unsigned long long)n);
        goto out;
    }
    rp_status local = RP_OK;
    if (!is_root) {
        text = rp_alloc(s->ctx, (size_t)n + 1);
        if (!text) local = rp_fail_nomem(err, "the broadcast plan");
    }
    for (uint64_t at = 0; at < n; at += PLAN_CHUNK) {
        const size_t piece = n - at < PLAN_CHUNK ? (size_t)(n - at) : PLAN_CHUNK;
        if (is_root) memcpy(s->chunk_buf, text + at, piece);
        cst = s->comm.bcast(s->comm.ud, s->chunk_buf, piece, root);
        if (cst != RP_OK) {
            st = rp_fail(err, RP_ETRANSPORT, "sched: broadcasting the plan from rank %d failed", root);
            goto out;
        }
        if (!is_root && text) memcpy(text + at, s->chunk_buf, piece);
    }
    if (local != RP_OK) {
        st = local;
        goto out;
    }
    if (!is_root) {
        text[n] = '\0';
        char name[64];
        snprintf(name, sizeof name, "<plan of rank %d>", (int)root);
        rp_plan *theirs = NULL;
        RP_CHECK_GOTO(rp_plan_parse(s->ctx, s->cfg, text, (size_t)n, name, &theirs, err), st, out);
        rp_plan_free(*plan);
        *plan = theirs;
    }
out:
    if (text) {
        if (is_root) rp_text_free(rp_plan_context(*plan), text);
        else rp_free(s->ctx, text);
    }
    return st;
}

/* ---- hot swap ------------------------------------------------------------------------- */

typedef enum swap_decision { SWAP_NONE = 0, SWAP_DO, SWAP_REFUSE, SWAP_WAIT } swap_decision;

/* A fresh copy of `from`: every policy loaded again from its own source text with its
 * params, in a new sandbox, and its init run. A dry run that ran in the set it proves
 * would leave its globals and upvalues behind in the policy that then takes over; a copy
 * that is thrown away afterwards leaves nothing. */
static rp_status set_reload(rp_sched *s, const policy_set *from, policy_set *out, rp_error *err)
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
        st = init_policy(s, copy, i, err);
        if (st != RP_OK) break;
    }
    if (st != RP_OK) set_free(out);
    else set_describe(out);
    return st;
}

/* Dry-run the staged set on the previous step's inputs (this step's when there is none),
 * in a fresh copy of it that is thrown away afterwards. */
static rp_status dry_run(rp_sched *s, step_inputs *now, bool *ok, char *reason, size_t reason_len, rp_error *err)
{
    step_inputs in;
    memset(&in, 0, sizeof in);
    rp_cost *cost = NULL;
    policy_set dry;
    memset(&dry, 0, sizeof dry);
    rp_status st = RP_OK;
    in.s = s;
    in.placement = s->current && rp_plan_has_placement(s->current) ? s->current : s->initial;
    if (s->prev_batch) {
        RP_CHECK_GOTO(rp_cost_new(s->ctx, s->cfg, s->prev_batch, s->prev_stats, s->opts.split, &cost, err), st, out);
        in.step = s->last_step;
        in.batch = s->prev_batch;
        in.stats = s->prev_stats;
        in.cost = cost;
        if (s->hist_cap > 0) fill_history(s, &in, 1);
    } else {
        in.step = now->step;
        in.batch = now->batch;
        in.stats = now->stats;
        in.cost = now->cost;
        in.history = now->history;
    }
    /* any failure of the dry run, the engine's out-of-memory included, refuses the
     * staged policy (dropped, with the reason): were it an error of the step, a staged
     * policy that fails every time would fail every later step */
    rp_error le;
    if (set_reload(s, &s->staged, &dry, &le) != RP_OK) {
        *ok = false;
        textf(reason, reason_len, "the dry run of policy '%s' failed: it did not load again: %s", s->staged.name,
              le.text);
        goto out;
    }
    run_result r;
    run_set(s, &dry, &in, &r);
    *ok = r.plan != NULL;
    if (!*ok) textf(reason, reason_len, "the dry run of policy '%s' failed: %s", s->staged.name, r.reason);
    rp_plan_free(r.plan);
out:
    set_free(&dry);
    inputs_release(&in);
    rp_cost_free(cost);
    return st;
}

/* Whether a staged policy takes over at this step. A due policy is dry-run (in a copy
 * thrown away afterwards) and, when that passes, loaded afresh from its source with its
 * init run, here, before the ranks agree, so that once they agree to swap nothing local
 * can stop one of them, and the policy that runs carries nothing from the dry run. `local` is
 * the step's status so far: with several ranks a failed rank still takes part and the
 * step fails on every rank. */
static rp_status decide_swap(rp_sched *s, step_inputs *in, rp_status local, swap_decision *decision, char *reason,
                             size_t reason_len, rp_error *err)
{
    *decision = SWAP_NONE;
    reason[0] = '\0';
    bool due = local == RP_OK && s->staged.count > 0 && (s->staged_at < 0 || in->step >= s->staged_at);
    bool ok = false;
    if (due) {
        local = dry_run(s, in, &ok, reason, reason_len, err);
        if (local == RP_OK && ok) {
            policy_set fresh;
            rp_error ie;
            if (set_reload(s, &s->staged, &fresh, &ie) != RP_OK) {
                ok = false;
                textf(reason, reason_len, "policy '%s': %s", s->staged.name, ie.text);
            } else {
                set_free(&s->staged); /* staged_at stays */
                s->staged = fresh;
            }
        }
    }
    if (!multi_rank(s)) {
        if (local != RP_OK) return local;
        if (due) *decision = ok ? SWAP_DO : SWAP_REFUSE;
        return RP_OK;
    }
    unsigned char mine[RECORD];
    const unsigned char *all = NULL;
    memset(mine, 0, sizeof mine);
    mine[0] = due;
    mine[1] = ok;
    put_status(mine, local);
    put_u64(mine + 8, due ? s->staged.hash : 0);
    rp_status st = gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    st = ranks_failure(s, all, local, in->step, "before the policy ran", err);
    if (st != RP_OK) return st;
    bool all_due = true, all_ok = true, same = true;
    int32_t failed_rank = -1, other_rank = -1;
    for (int32_t r = 0; r < s->comm.size; r++) {
        const unsigned char *rec = all + (size_t)r * RECORD;
        all_due &= rec[0] != 0;
        if (rec[0] && !rec[1] && failed_rank < 0) failed_rank = r;
        all_ok &= rec[1] != 0;
        if (get_u64(rec + 8) != get_u64(all + 8) && other_rank < 0) other_rank = r;
        same &= get_u64(rec + 8) == get_u64(all + 8);
    }
    if (!due) *decision = SWAP_NONE;
    else if (!all_due) *decision = SWAP_WAIT;
    else if (!same) {
        *decision = SWAP_REFUSE;
        textf(reason, reason_len, "ranks staged different policies (rank %d's differs from rank 0's); no rank swaps",
              (int)other_rank);
    } else if (!all_ok) {
        *decision = SWAP_REFUSE;
        if (ok) textf(reason, reason_len, "the dry run failed on rank %d; no rank swaps", (int)failed_rank);
    } else {
        *decision = SWAP_DO;
    }
    return RP_OK;
}

/* ---- the step ------------------------------------------------------------------------- */

static rp_status copy_batch(rp_context *ctx, const rp_batch *b, rp_batch **out, rp_error *err)
{
    return rp_batch_new(ctx, rp_batch_num_seqs(b), rp_batch_prompt_lens(b), rp_batch_response_lens(b),
                        rp_batch_group_ids(b), out, err);
}

/* The plan this rank proposes: the policy's, or the fallback (rep->fallback, with the
 * reason). Errors are the step's (no memory, a batch the safe default cannot pack). */
static rp_status propose(rp_sched *s, policy_set *use, step_inputs *in, rp_step_report *rep, rp_plan **out,
                         rp_error *err)
{
    const int64_t step = in->step;
    run_result r;
    run_set(s, use, in, &r);
    if (r.status != RP_OK) return rp_fail(err, r.status, "sched: step %lld: %s", (long long)step, r.reason);
    rep->policy_work = r.work;
    rep->policy_wall_s = r.wall_s;
    rep->policy_cpu_s = r.cpu_s;
    if (r.plan) {
        rep->fallback_checks = r.fallback_checks;
        rep->fallback_check_changes = r.fallback_changes;
    }
    if (r.plan && r.decision.set) {
        rep->has_decision = true;
        rep->persistence = r.decision.persistence;
        rep->persistence_observations = r.decision.observations;
        rep->predicted_saving_s = r.decision.predicted_saving_s;
        rep->realised_scored = r.decision.realised_scored;
        rep->realised_saving_s = r.decision.realised_saving_s;
    }
    if (r.plan) {
        *out = r.plan;
        return RP_OK;
    }
    rep->fallback = true;
    textf(rep->fallback_reason, sizeof rep->fallback_reason, "%s", r.reason);
    const rp_plan *base = inputs_base(in, err);
    if (!base) {
        rp_status st = in->base_status;
        char msg[RP_ERROR_TEXT];
        textf(msg, sizeof msg, "%s", err->text);
        return rp_fail(err, st, "sched: step %lld: no valid plan: %s (and the policy failed: %s)", (long long)step,
                       msg, r.reason);
    }
    rp_plan *plan = NULL;
    rp_status st = rp_lua_plan_compose(s->ctx, s->cfg, base, base, NULL, rp_plan_num_microbatches(base), &plan, err);
    if (st == RP_OK && in->placement) st = rp_plan_stabilize_slots(plan, in->placement, err);
    if (st == RP_OK) {
        st = rp_plan_validate(plan, s->cfg, in->batch, err);
        if (st != RP_OK) {
            char msg[RP_ERROR_TEXT];
            textf(msg, sizeof msg, "%s", err->text);
            rp_fail(err, st, "sched: step %lld: the fallback plan is not valid for this batch: %s", (long long)step,
                    msg);
        }
    }
    if (st != RP_OK) {
        rp_plan_free(plan);
        return st;
    }
    *out = plan;
    return RP_OK;
}

/* The cost and the migration plan of `plan` (replacing what *migration held). */
static rp_status judge(rp_sched *s, step_inputs *in, const rp_plan *plan, rp_step_report *rep,
                       sched_migration_next *migration, rp_error *err)
{
    sched_migration_discard(s->ctx, migration);
    /* the summary only: the plan the policy returned was most likely just scored */
    rp_status st = cost_summary_of(in->cost, plan, &rep->cost, &rep->forward_s, err);
    if (st != RP_OK) return st;
    rp_cost_outside(in->cost, &rep->outside, NULL);
    st = sched_migration_prepare(&s->migration, s->ctx, s->cfg, in->placement, plan, migration, rep, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        textf(msg, sizeof msg, "%s", err->text);
        return rp_fail(err, st, "sched: step %lld: %s", (long long)in->step, msg);
    }
    return RP_OK;
}

/* Every rank runs the same plan: the ranks gather (status, fallback, plan hash); any
 * failure fails the step on every rank; when hashes or fallback flags differ, the lowest
 * rank whose own policy succeeded (rank 0 when none did) broadcasts its plan, and a
 * third gather makes sure every rank took it before any commits. */
static rp_status agree(rp_sched *s, step_inputs *in, rp_status local, rp_plan **plan, rp_step_report *rep,
                       sched_migration_next *migration, rp_error *err)
{
    unsigned char mine[RECORD];
    const unsigned char *all = NULL;
    memset(mine, 0, sizeof mine);
    mine[0] = rep->fallback;
    put_status(mine, local);
    put_u64(mine + 8, local == RP_OK ? rp_plan_hash(*plan) : 0);
    rp_status st = gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    st = ranks_failure(s, all, local, in->step, "while planning", err);
    if (st != RP_OK) return st;
    bool disagree = false;
    int32_t winner = -1, fell_back = 0;
    for (int32_t q = 0; q < s->comm.size; q++) {
        const unsigned char *rec = all + (size_t)q * RECORD;
        if (get_u64(rec + 8) != get_u64(all + 8) || rec[0] != all[0]) disagree = true;
        if (rec[0]) fell_back++;
        else if (winner < 0) winner = q; /* the lowest rank whose policy succeeded */
    }
    rep->ranks_fell_back = fell_back;
    rep->plan_from_rank = winner < 0 ? 0 : winner;
    if (!disagree) return RP_OK;
    rep->ranks_disagreed = true;
    local = take_plan_of(s, rep->plan_from_rank, plan, err);
    if (local == RP_OK && s->comm.rank != rep->plan_from_rank) local = judge(s, in, *plan, rep, migration, err);
    put_status(mine, local);
    st = gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    return ranks_failure(s, all, local, in->step, "taking the agreed plan", err);
}

/* Count the step's outcome and demote the running set after demote_after steps in a row
 * that fell back on every rank (so every rank demotes at the same step): to the set the
 * last hot swap replaced, else to RP_SCHED_DEMOTE_TO. Runs after the step committed: a
 * replacement that cannot be loaded leaves the running set and says so. */
static void demote_if_failing(rp_sched *s, rp_step_report *rep)
{
    bool failed = rep->ranks_fell_back >= (multi_rank(s) ? s->comm.size : 1);
    s->failed_steps = failed ? s->failed_steps + 1 : 0;
    rep->failed_steps = s->failed_steps;
    if (s->opts.demote_after < 0 || s->failed_steps < s->opts.demote_after) return;
    policy_set next;
    memset(&next, 0, sizeof next);
    if (s->previous.count > 0) {
        next = s->previous;
        memset(&s->previous, 0, sizeof s->previous);
    } else {
        if (strcmp(s->running.name, RP_SCHED_DEMOTE_TO) == 0) return; /* nothing safer to run */
        rp_error e;
        if (load_set(s, RP_SCHED_DEMOTE_TO, NULL, NULL, NULL, &next, &e) != RP_OK) {
            textf(rep->demote_error, sizeof rep->demote_error, "%s", e.text);
            return;
        }
    }
    set_free(&s->running);
    s->running = next;
    s->failed_steps = 0;
    rep->demoted = true;
    textf(rep->demoted_to, sizeof rep->demoted_to, "%s", s->running.name);
}

/* One step from the whole step's statistics (owned; NULL when `prep`, the status of
 * making them, is an error): rp_sched_step and rp_sched_step_stats share it. */
static rp_status run_step(rp_sched *s, int64_t step, const rp_batch *batch, rp_stats *stats, rp_status prep,
                          double t0, const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    rp_cost *cost = NULL;
    rp_batch *copy = NULL;
    step_inputs in;
    memset(&in, 0, sizeof in);
    rp_plan *plan = NULL;
    rp_step_report rep;
    memset(&rep, 0, sizeof rep);
    rep.step = step;
    sched_migration_next migration = {0};
    rp_status st = prep;

    if (st == RP_OK) st = rp_cost_new(s->ctx, s->cfg, batch, stats, s->opts.split, &cost, err);
    if (st == RP_OK) st = copy_batch(s->ctx, batch, &copy, err);
    in.s = s;
    in.step = step;
    in.batch = batch;
    in.stats = stats;
    in.cost = cost;
    in.placement = s->current && rp_plan_has_placement(s->current) ? s->current : s->initial;
    if (st == RP_OK && s->hist_cap > 0) fill_history(s, &in, 0);

    /* 1. a staged policy takes over at the boundary, after a dry run */
    swap_decision decision;
    char swap_reason[RP_ERROR_TEXT];
    RP_CHECK_GOTO(decide_swap(s, &in, st, &decision, swap_reason, sizeof swap_reason, err), st, out);
    policy_set *use = decision == SWAP_DO ? &s->staged : &s->running;
    if (decision == SWAP_REFUSE) textf(rep.swap_error, sizeof rep.swap_error, "%s", swap_reason);

    /* 2. the policy, or the fallback, and what it costs */
    st = propose(s, use, &in, &rep, &plan, err);
    if (st == RP_OK) st = judge(s, &in, plan, &rep, &migration, err);
    rep.ranks_fell_back = rep.fallback ? 1 : 0;

    /* 3. every rank runs the same plan */
    rep.plan_from_rank = 0;
    if (multi_rank(s)) st = agree(s, &in, st, &plan, &rep, &migration, err);
    if (st != RP_OK) goto out;
    rep.plan_hash = rp_plan_hash(plan);

    /* 4. commit: nothing below can fail */
    if (decision == SWAP_DO) {
        set_free(&s->previous);
        s->previous = s->running;
        s->running = s->staged;
        s->failed_steps = 0;
        memset(&s->staged, 0, sizeof s->staged);
        s->staged_at = -1;
        rep.swapped = true;
    } else if (decision == SWAP_REFUSE) {
        set_free(&s->staged);
        s->staged_at = -1;
    }
    snprintf(rep.policy_name, sizeof rep.policy_name, "%s", s->running.name);
    snprintf(rep.policy_version, sizeof rep.policy_version, "%s", s->running.version);
    rep.policy_hash = s->running.hash;
    push_history(s, step, stats);
    sched_migration_commit(&s->migration, s->ctx, &migration);
    rp_plan_free(s->current);
    s->current = plan;
    plan = NULL;
    rp_batch_free(s->prev_batch);
    rp_stats_free(s->spare_stats);
    s->spare_stats = NULL;
    if (s->keep_spare) s->spare_stats = s->prev_stats;
    else rp_stats_free(s->prev_stats);
    s->prev_batch = copy;
    s->prev_stats = stats;
    copy = NULL;
    stats = NULL;
    s->has_step = true;
    s->last_step = step;
    demote_if_failing(s, &rep);
    rep.plan_wall_s = now_s() - t0;
    s->report = rep;
    s->has_report = true;
    *plan_out = s->current;
    *report_out = &s->report;
    st = RP_OK;
out:
    inputs_release(&in);
    sched_migration_discard(s->ctx, &migration);
    rp_plan_free(plan);
    rp_batch_free(copy);
    rp_stats_free(stats);
    rp_cost_free(cost);
    if (st != RP_OK) fail_keep(s, st, err);
    return st;
}

/* Checks common to both step calls; an error here is returned at once, on this rank
 * only: it is a misuse of the call (missing arguments), the same on every rank. */
static rp_status step_begin(rp_sched *s, int64_t step, const rp_batch *batch, const void *input,
                            const char *input_name, const rp_plan **plan_out, const rp_step_report **report_out,
                            rp_error *err)
{
    s->errmsg[0] = '\0';
    /* a step call means the trainer is done with the last step's migration */
    s->migration.open = false;
    rp_error_clear(err);
    if (!batch || !input || !plan_out || !report_out)
        return fail_keep(s, rp_fail(err, RP_EINVAL, "sched: batch, %s and outputs are required", input_name), err);
    if (rp_batch_num_seqs(batch) < 1)
        return fail_keep(s, rp_fail(err, RP_EINVAL, "sched: step %lld: the batch has no sequences", (long long)step),
                         err);
    /* a batch no plan can pack fails here, with its cause, before the scan and the policy
     * (the batch is the whole step's, the same on every rank) */
    if (rp_limits_check_batch(rp_config_limits(s->cfg), batch, err) != RP_OK) {
        char msg[RP_ERROR_TEXT];
        textf(msg, sizeof msg, "%s", err->text);
        return fail_keep(s, rp_fail(err, RP_ERANGE, "sched: step %lld: %s", (long long)step, msg), err);
    }
    /* so does a batch the cost model refuses, before the routing is scanned (it was
     * scanned in full first: 173 s for a batch refused in the end) */
    rp_status st = cost_check_inputs(s->cfg, batch, err);
    if (st != RP_OK) {
        char msg[RP_ERROR_TEXT];
        textf(msg, sizeof msg, "%s", err->text);
        return fail_keep(s, rp_fail(err, st, "sched: step %lld: %s", (long long)step, msg), err);
    }
    return RP_OK;
}

rp_status rp_sched_step(rp_sched *s, int64_t step, const rp_batch *batch, const rp_routing *routing,
                        const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, routing, "routing", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = now_s();
    const rp_model *md = rp_config_model(s->cfg);
    rp_stats *stats = NULL;
    st = rp_stats_compute(s->ctx, batch, routing, md->num_experts, s->opts.num_threads, &stats, err);
    s->keep_spare = false;
    return run_step(s, step, batch, stats, st, t0, plan_out, report_out, err);
}

/* Statistics that describe the batch and the config's model (both statistics calls;
 * an error goes through run_step, so every rank fails the step together). */
static rp_status check_step_stats(const rp_sched *s, int64_t step, const rp_batch *batch, const rp_stats *stats,
                                  rp_error *err)
{
    const rp_model *md = rp_config_model(s->cfg);
    if (rp_stats_num_layers(stats) != md->num_layers || rp_stats_num_experts(stats) != md->num_experts ||
        rp_stats_top_k(stats) != md->top_k)
        return rp_fail(err, RP_EINVAL,
                       "sched: step %lld: the statistics have %d layers, %d experts, top-%d; the config's model has "
                       "%d, %d, top-%d",
                       (long long)step, rp_stats_num_layers(stats), rp_stats_num_experts(stats),
                       rp_stats_top_k(stats), md->num_layers, md->num_experts, md->top_k);
    return rp_stats_check_batch(stats, batch, err);
}

rp_status rp_sched_step_stats(rp_sched *s, int64_t step, const rp_batch *batch, const rp_stats *stats,
                              const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, stats, "statistics", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = now_s();
    rp_stats *copy = NULL;
    st = check_step_stats(s, step, batch, stats, err);
    s->keep_spare = true;
    if (st == RP_OK) st = stats_copy_reusing(s->ctx, stats, &s->spare_stats, &copy, err);
    return run_step(s, step, batch, copy, st, t0, plan_out, report_out, err);
}

rp_status rp_sched_step_stats_take(rp_sched *s, int64_t step, const rp_batch *batch, rp_stats **stats,
                                   const rp_plan **plan_out, const rp_step_report **report_out, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_status st = step_begin(s, step, batch, stats ? *stats : NULL, "statistics", plan_out, report_out, err);
    if (st != RP_OK) return st;
    double t0 = now_s();
    s->keep_spare = true;
    st = check_step_stats(s, step, batch, *stats, err);
    if (st != RP_OK) return run_step(s, step, batch, NULL, st, t0, plan_out, report_out, err); /* still the caller's */
    rp_stats *own = *stats;
    st = run_step(s, step, batch, own, RP_OK, t0, plan_out, report_out, err);
    /* taken: kept as the step's statistics, or freed with a failed step */
    *stats = s->spare_stats;
    s->spare_stats = NULL;
    return st;
}

/* ---- staging ---------------------------------------------------------------------------- */

rp_status rp_sched_stage_policy(rp_sched *s, const char *name_or_path, const char *source, int64_t at_step,
                                rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_error local;
    if (!err) err = &local;
    if ((!name_or_path || !*name_or_path) && !source)
        return fail_keep(s, rp_fail(err, RP_EINVAL, "sched: stage a policy by name, path or source text"), err);
    if (at_step < -1)
        return fail_keep(s, rp_fail(err, RP_EINVAL, "sched: at_step is %lld; give a step >= 0 or -1 for the next step",
                                    (long long)at_step),
                         err);
    policy_set ps;
    memset(&ps, 0, sizeof ps);
    rp_status st;
    if (source) {
        rp_policy *pol = NULL;
        size_t len = strlen(source);
        st = rp_policy_load(s->ctx, s->cfg, source, len, name_or_path, &s->limits, NULL, false, &pol, err);
        if (st == RP_OK && s->running.count == 1 && strcmp(s->running.pol[0]->info.name, pol->info.name) == 0 &&
            strcmp(s->running.pol[0]->params_json, "{}") != 0) {
            /* the same policy, edited: its params carry over */
            rp_policy_free(pol);
            pol = NULL;
            st = rp_policy_load(s->ctx, s->cfg, source, len, name_or_path, &s->limits,
                                s->running.pol[0]->params_json, false, &pol, err);
        }
        if (st == RP_OK) {
            ps.pol[ps.count++] = pol;
            st = init_policy(s, pol, 0, err);
            if (st == RP_OK) set_describe(&ps);
        }
    } else {
        st = load_set(s, name_or_path, NULL, NULL, &s->running, &ps, err);
    }
    if (st != RP_OK) {
        set_free(&ps);
        return fail_keep(s, st, err);
    }
    set_free(&s->staged);
    s->staged = ps;
    s->staged_at = at_step;
    return RP_OK;
}

const rp_plan *rp_sched_plan(const rp_sched *s) { return s ? s->current : NULL; }

/* ---- for the checkpoint (core/sched_state.c) --------------------------------------------- */

void sched_set_free(policy_set *ps) { set_free(ps); }
void sched_set_describe(policy_set *ps) { set_describe(ps); }

void sched_fields_of(rp_sched *s, sched_fields *f)
{
    *f = (sched_fields){
        .ctx = s->ctx, .cfg = s->cfg, .opts = &s->opts, .limits = &s->limits,
        .running = &s->running, .staged = &s->staged, .staged_at = &s->staged_at,
        .current = &s->current, .has_step = &s->has_step, .last_step = &s->last_step,
        .failed_steps = &s->failed_steps,
        .prev_batch = &s->prev_batch, .prev_stats = &s->prev_stats, .hist_cap = s->hist_cap,
        .hist_count = &s->hist_count, .hist_head = &s->hist_head, .hist_steps = s->hist_steps,
        .hist_loads = s->hist_loads, .has_report = &s->has_report, .migration = &s->migration,
        .errmsg = s->errmsg,
    };
}

const rp_migration_plan *rp_sched_migration(const rp_sched *s)
{
    return s && s->migration.open ? s->migration.plan : NULL;
}

rp_status rp_sched_migration_failed(rp_sched *s, const rp_migration_result *result, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_status st = sched_migration_rollback(&s->migration, s->current, result, err);
    return st == RP_OK ? RP_OK : fail_keep(s, st, err);
}

rp_status rp_sched_set_migration_options(rp_sched *s, const rp_migration_options *opts, rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_status st = sched_migration_set_options(&s->migration, s->ctx, s->cfg, opts, err);
    return st == RP_OK ? RP_OK : fail_keep(s, st, err);
}

/* ---- the report as JSON ------------------------------------------------------------------ */

static const char *side_words(rp_side side)
{
    switch (side) {
    case RP_SIDE_ATTENTION: return "attention";
    case RP_SIDE_DISPATCH: return "dispatch";
    case RP_SIDE_EXPERT: return "expert";
    default: return "combine";
    }
}

static void hex64(char *buf, uint64_t v) { snprintf(buf, 17, "%016llx", (unsigned long long)v); }

rp_status rp_sched_attach_shift(rp_sched *s, const rp_shift *shift, rp_error *err)
{
    if (!s || !shift) return rp_fail(err, RP_EINVAL, "sched: scheduler and router shift are required");
    if (!s->has_report || !s->prev_batch) return rp_fail(err, RP_EINVAL, "sched: no step has run yet");
    const rp_model *md = rp_config_model(s->cfg);
    const int32_t n = rp_batch_num_seqs(s->prev_batch);
    const int64_t choices = rp_batch_num_tokens(s->prev_batch) * md->num_layers * md->top_k;
    if (rp_shift_num_seqs(shift) != n || rp_shift_choices(shift) != choices)
        return rp_fail(err, RP_EINVAL,
                       "sched: the router shift covers %d sequences and %lld token-choices, but step %lld has "
                       "%d sequences and %lld token-choices",
                       rp_shift_num_seqs(shift), (long long)rp_shift_choices(shift), (long long)s->report.step, n,
                       (long long)choices);
    if (rp_shift_num_layers(shift) != md->num_layers || rp_shift_num_experts(shift) != md->num_experts ||
        rp_shift_top_k(shift) != md->top_k)
        return rp_fail(err, RP_EINVAL,
                       "sched: the router shift has %d layers x %d experts x top-%d, but the model has %d x %d x "
                       "top-%d",
                       rp_shift_num_layers(shift), rp_shift_num_experts(shift), rp_shift_top_k(shift),
                       md->num_layers, md->num_experts, md->top_k);
    s->report.shift = rp_shift_summarize(shift);
    s->report.has_shift = true;
    return RP_OK;
}

rp_status rp_sched_report_json(const rp_sched *s, char **text, size_t *len, rp_error *err)
{
    if (!s || !text) return rp_fail(err, RP_EINVAL, "sched: scheduler and output are required");
    if (!s->has_report) return rp_fail(err, RP_EINVAL, "sched: no step has run yet");
    const rp_step_report *r = &s->report;
    char h1[17], h2[17];
    hex64(h1, r->policy_hash);
    hex64(h2, r->plan_hash);
    json_t *cost = json_pack(
        "{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:{s:i, s:i, s:i, s:s}}", "step_s", r->cost.step_s,
        "lower_bound_s", r->cost.lower_bound_s, "ratio", r->cost.ratio, "attention_s", r->cost.attention_s,
        "dispatch_s", r->cost.dispatch_s, "expert_s", r->cost.expert_s, "combine_s", r->cost.combine_s,
        "grad_reduce_s", r->cost.grad_reduce_s, "extra_copy_s", r->cost.extra_copy_s, "attention_imbalance",
        r->cost.attention_imbalance, "expert_imbalance", r->cost.expert_imbalance, "straggler", "gpu",
        (int)r->cost.straggler_gpu, "microbatch", (int)r->cost.straggler_mb, "layer", (int)r->cost.straggler_layer,
        "side", side_words(r->cost.straggler_side));
    json_t *root = json_pack("{s:I, s:{s:s, s:s, s:s}, s:s, s:o, s:f, s:I, s:b, s:s?, s:b, s:s?, s:i, s:b, s:i, "
                             "s:f, s:f, s:f}",
                             "step", (json_int_t)r->step, "policy", "name", r->policy_name, "version", r->policy_version,
                             "hash", h1, "plan_hash", h2, "cost", cost, "plan_wall_s", r->plan_wall_s, "policy_work",
                             (json_int_t)r->policy_work, "fallback", r->fallback, "fallback_reason",
                             r->fallback ? r->fallback_reason : NULL, "swapped", r->swapped, "swap_error",
                             r->swap_error[0] ? r->swap_error : NULL, "plan_from_rank", (int)r->plan_from_rank,
                             "ranks_disagreed", r->ranks_disagreed, "experts_moved", (int)r->experts_moved,
                             "migration_bytes", r->migration_bytes, "migration_s", r->migration_s, "policy_wall_s",
                             r->policy_wall_s);
    /* demotion: the steps in a row that fell back, and the policy that replaced this one */
    if (root && (json_object_set_new(root, "failed_steps", json_integer(r->failed_steps)) != 0 ||
                 (r->demoted && json_object_set_new(root, "demoted_to", json_string(r->demoted_to)) != 0) ||
                 (r->demote_error[0] && json_object_set_new(root, "demote_error", json_string(r->demote_error)) != 0))) {
        json_decref(root);
        root = NULL;
    }
    if (root && r->has_shift) {
        const rp_shift_summary *m = &r->shift;
        json_t *shift = json_pack("{s:I, s:I, s:f, s:f, s:i, s:f, s:i, s:f, s:i, s:i}", "choices",
                                  (json_int_t)m->choices, "changed", (json_int_t)m->changed, "fraction",
                                  m->fraction, "max_layer_fraction", m->max_layer_fraction, "max_layer",
                                  (int)m->max_layer, "max_seq_fraction", m->max_seq_fraction, "max_seq",
                                  (int)m->max_seq, "max_expert_lost_fraction", m->max_expert_lost_fraction,
                                  "max_expert_layer", (int)m->max_expert_layer, "max_expert", (int)m->max_expert);
        if (!shift || json_object_set_new(root, "router_shift", shift) != 0) {
            json_decref(root);
            root = NULL;
        }
    }
    if (!root || json_object_set_new(root, "metrics", rp_step_metrics_json(r)) != 0) {
        json_decref(root);
        return rp_fail_nomem(err, "the step report");
    }
    return rp_json_text(s->ctx, root, "the step report", text, len, err);
}
