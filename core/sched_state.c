/* Scheduler checkpoints: rp_sched_save_state writes what decides future plans as one
 * JSON document; rp_sched_load_state parses and rebuilds all of it (policies reloaded
 * from their saved text, ctx.state rebuilt) before swapping it in. docs/formats.md,
 * "Scheduler state", gives the layout. */
#include "jsonx.h"
#include "policy_state.h"
#include "sched_internal.h"
#include "sched_migrate.h"
#include "stats_internal.h"

#include "routepack/stats.h"

#include <lauxlib.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STATE_FORMAT "routepack-sched-state"
#define STATE_VERSION 1
#define PATH_LEN 256
#define DUMP_FLAGS (JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17))

static void hex64(char *buf, uint64_t v) { snprintf(buf, 17, "%016llx", (unsigned long long)v); }

static bool parse_hex64(const char *s, uint64_t *out)
{
    if (!s || strlen(s) != 16) return false;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return true;
}

/* ---- policy sets -------------------------------------------------------------------------- */

static json_t *encode_set(const policy_set *ps, int64_t at_step, bool staged, rp_status *st, rp_error *err)
{
    char h[17];
    hex64(h, ps->hash);
    json_t *pols = json_array();
    json_t *out = NULL;
    if (!pols) goto nomem;
    for (int32_t i = 0; i < ps->count; i++) {
        const rp_policy *pol = ps->pol[i];
        json_t *state = policy_state_encode(pol, INT64_MAX, NULL, st, err);
        if (!state) goto fail;
        char ph[17];
        hex64(ph, pol->info.hash);
        json_t *one = json_pack("{s:s, s:s, s:s, s:s, s:s, s:o, s:o}", "name", pol->info.name, "version",
                                pol->info.version, "path", pol->info.path, "hash", ph, "params", pol->params_json,
                                "source", state_encode_bytes(pol->source, pol->source_len), "state", state);
        if (!one || json_array_append_new(pols, one) != 0) goto nomem;
    }
    out = json_pack("{s:s, s:s, s:s, s:O}", "name", ps->name, "version", ps->version, "hash", h, "policies", pols);
    if (!out) goto nomem;
    if (staged && json_object_set_new(out, "at_step", json_integer((json_int_t)at_step)) != 0) goto nomem;
    json_decref(pols);
    return out;
nomem:
    *st = rp_fail_nomem(err, "the scheduler state");
fail:
    json_decref(out);
    json_decref(pols);
    return NULL;
}

static rp_status load_set(const rp_jdoc *doc, const sched_fields *f, json_t *obj, const char *path, bool staged,
                          policy_set *ps, int64_t *at_step, rp_error *err)
{
    static const char *const keys[] = {"name", "version", "hash", "policies", "at_step", NULL};
    static const char *const keys_run[] = {"name", "version", "hash", "policies", NULL};
    static const char *const pol_keys[] = {"name", "version", "path", "hash", "params", "source", "state", NULL};
    memset(ps, 0, sizeof *ps);
    rp_status st;
    char sub[PATH_LEN], key[PATH_LEN];
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, obj, path, staged ? keys : keys_run, err), st, fail);
    const char *hash_text;
    uint64_t set_hash;
    RP_CHECK_GOTO(rp_jdoc_str(doc, obj, path, "hash", true, NULL, &hash_text, err), st, fail);
    if (!parse_hex64(hash_text, &set_hash)) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_key(sub, sizeof sub, path, "hash"),
                          "must be 16 lower-case hex digits, got \"%s\"", hash_text);
        goto fail;
    }
    if (staged) RP_CHECK_GOTO(rp_jdoc_int(doc, obj, path, "at_step", true, 0, -1, INT64_MAX, at_step, err), st, fail);
    json_t *pols;
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, path, "policies", true, &pols, err), st, fail);
    rp_jpath_key(sub, sizeof sub, path, "policies");
    if (json_array_size(pols) < 1 || json_array_size(pols) > 2) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, sub, "must list 1 or 2 policies (a joint one, or packing+placement), got %zu",
                          json_array_size(pols));
        goto fail;
    }
    for (size_t i = 0; i < json_array_size(pols); i++) {
        json_t *one = json_array_get(pols, i);
        char at[PATH_LEN];
        rp_jpath_index(at, sizeof at, sub, i);
        RP_CHECK_GOTO(rp_jdoc_check_keys(doc, one, at, pol_keys, err), st, fail);
        const char *ppath, *phash, *params;
        RP_CHECK_GOTO(rp_jdoc_str(doc, one, at, "path", true, NULL, &ppath, err), st, fail);
        RP_CHECK_GOTO(rp_jdoc_str(doc, one, at, "hash", true, NULL, &phash, err), st, fail);
        RP_CHECK_GOTO(rp_jdoc_str(doc, one, at, "params", true, NULL, &params, err), st, fail);
        uint64_t want;
        if (!parse_hex64(phash, &want)) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_key(key, sizeof key, at, "hash"),
                              "must be 16 lower-case hex digits, got \"%s\"", phash);
            goto fail;
        }
        const char *src;
        size_t src_len;
        char *buf;
        json_t *source = json_object_get(one, "source");
        if (!source || !state_decode_bytes(source, &src, &src_len, &buf)) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_key(key, sizeof key, at, "source"),
                              "must be the policy's text (a string or {\"bytes\": hex})");
            goto fail;
        }
        json_t *state = json_object_get(one, "state");
        rp_jpath_key(key, sizeof key, at, "state");
        st = !state ? rp_jdoc_fail(doc, err, RP_EFORMAT, key, "is required")
             : !json_is_object(state) || !json_is_array(json_object_get(state, "table"))
                 ? rp_jdoc_fail(doc, err, RP_EFORMAT, key, "must be a table ({\"table\": [...]})")
                 : policy_state_check(doc, state, key, err);
        if (st != RP_OK) {
            free(buf);
            goto fail;
        }
        uint64_t got = rp_hash64(src, src_len, 0);
        if (got != want) {
            free(buf);
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_key(key, sizeof key, at, "source"),
                              "does not match its hash (saved %s, the text hashes to %016llx): the state was edited "
                              "or damaged",
                              phash, (unsigned long long)got);
            goto fail;
        }
        rp_policy *pol = NULL;
        rp_error le;
        st = rp_policy_load(f->ctx, f->cfg, src, src_len, *ppath ? ppath : NULL, f->limits, params, false, &pol, &le);
        free(buf);
        if (st != RP_OK) {
            rp_fail(err, st, "state: %s: the saved policy no longer loads: %s", at, le.text);
            goto fail;
        }
        ps->pol[ps->count++] = pol;
        RP_CHECK_GOTO(policy_state_restore(pol, state, err), st, fail);
    }
    if (ps->count == 2 && strcmp(ps->pol[0]->info.name, ps->pol[1]->info.name) == 0) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, sub, "names policy '%s' twice", ps->pol[0]->info.name);
        goto fail;
    }
    sched_set_describe(ps);
    if (ps->hash != set_hash) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_key(sub, sizeof sub, path, "hash"),
                          "is %s but its policies hash to %016llx", hash_text, (unsigned long long)ps->hash);
        goto fail;
    }
    return RP_OK;
fail:
    sched_set_free(ps);
    return st;
}

/* ---- the document --------------------------------------------------------------------- */

static json_t *int32_array(const int32_t *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer(v[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *int64_array(const int64_t *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer((json_int_t)v[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *encode_config(const rp_config *cfg)
{
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *tp = rp_config_topology(cfg);
    return json_pack("{s:i, s:i, s:i, s:i, s:i, s:o}", "num_layers", (int)md->num_layers, "num_experts",
                     (int)md->num_experts, "top_k", (int)md->top_k, "num_gpus", (int)tp->num_gpus, "ep_size",
                     (int)tp->ep_size, "slots", int32_array(tp->slots, (size_t)tp->num_gpus));
}

/* The last step's batch and statistics: lengths, group ids, the expert loads and every
 * nonzero per-sequence count as flat (seq, layer, expert, count) quadruples. */
static json_t *encode_last_batch(const rp_batch *b, const rp_stats *stats, int32_t L, int32_t E)
{
    int32_t n = rp_batch_num_seqs(b);
    json_t *loads = json_array(), *hist = json_array(), *out = NULL;
    uint32_t *counts = malloc((size_t)E * sizeof *counts);
    if (!loads || !hist || !counts) goto out;
    for (int32_t l = 0; l < L; l++) {
        const int64_t *el = rp_stats_expert_load(stats, l);
        for (int32_t e = 0; e < E; e++)
            if (json_array_append_new(loads, json_integer((json_int_t)el[e])) != 0) goto out;
    }
    for (int32_t s = 0; s < n; s++)
        for (int32_t l = 0; l < L; l++) {
            rp_stats_seq_hist(stats, s, l, counts);
            for (int32_t e = 0; e < E; e++) {
                if (!counts[e]) continue;
                json_int_t quad[4] = {s, l, e, (json_int_t)counts[e]};
                for (int k = 0; k < 4; k++)
                    if (json_array_append_new(hist, json_integer(quad[k])) != 0) goto out;
            }
        }
    out = json_pack("{s:o, s:o, s:o, s:O, s:O}", "prompt_lens", int32_array(rp_batch_prompt_lens(b), (size_t)n),
                    "response_lens", int32_array(rp_batch_response_lens(b), (size_t)n), "group_ids",
                    int32_array(rp_batch_group_ids(b), (size_t)n), "expert_load", loads, "seq_hist", hist);
out:
    free(counts);
    json_decref(loads);
    json_decref(hist);
    return out;
}

/* The document for the scheduler state `f` points at (a scheduler's own, or one just
 * loaded, to check that it round-trips). */
static json_t *encode_root(const sched_fields *f, rp_status *st, rp_error *err)
{
    const rp_model *md = rp_config_model(f->cfg);
    int32_t L = md->num_layers, E = md->num_experts;
    size_t cells = (size_t)L * (size_t)E;
    json_t *root = NULL, *plan = NULL, *running = NULL, *staged = NULL, *history = NULL, *last = NULL;
    char *plan_text = NULL;
    char seed[17], plan_hash[17];
    *st = RP_OK;
    hex64(seed, f->opts->seed);
    if (*f->current) {
        size_t n;
        RP_CHECK_GOTO(rp_plan_to_json(*f->current, &plan_text, &n, err), *st, out);
        json_error_t je;
        plan = json_loadb(plan_text, n, 0, &je);
        if (!plan) {
            *st = rp_fail(err, RP_ENOMEM, "sched: the plan in use could not be re-read: %s", je.text);
            goto out;
        }
        hex64(plan_hash, rp_plan_hash(*f->current));
    }
    running = encode_set(f->running, 0, false, st, err);
    if (!running) goto out;
    if (f->staged->count > 0) {
        staged = encode_set(f->staged, *f->staged_at, true, st, err);
        if (!staged) goto out;
    }
    history = json_array();
    if (!history) goto nomem;
    for (int32_t i = *f->hist_count - 1; i >= 0; i--) { /* oldest first */
        int32_t slot = ((*f->hist_head - 1 - i) % f->hist_cap + f->hist_cap) % f->hist_cap;
        json_t *entry = json_pack("{s:I, s:o}", "step", (json_int_t)f->hist_steps[slot], "expert_load",
                                  int64_array(f->hist_loads + (size_t)slot * cells, cells));
        if (!entry || json_array_append_new(history, entry) != 0) goto nomem;
    }
    if (*f->prev_batch && *f->prev_stats) {
        last = encode_last_batch(*f->prev_batch, *f->prev_stats, L, E);
        if (!last) goto nomem;
    }
    root = json_pack("{s:s, s:i, s:o, s:s, s:s, s:i, s:o, s:O?, s:s?, s:O, s:O?, s:O, s:O?}", "format", STATE_FORMAT,
                     "version", STATE_VERSION, "config", encode_config(f->cfg), "seed", seed, "split",
                     f->opts->split == RP_SPLIT_LOCALITY ? "locality" : "even", "history_length", (int)f->hist_cap,
                     "last_step", *f->has_step ? json_integer((json_int_t)*f->last_step) : json_null(), "plan", plan,
                     "plan_hash", plan ? plan_hash : NULL, "running", running, "staged", staged, "history", history,
                     "last_batch", last);
    if (!root || (*f->failed_steps > 0 && json_object_set_new(root, "failed_steps", json_integer(*f->failed_steps)) != 0))
        goto nomem;
    goto out;
nomem:
    *st = rp_fail_nomem(err, "the scheduler state");
out:
    json_decref(plan);
    json_decref(running);
    json_decref(staged);
    json_decref(history);
    json_decref(last);
    if (plan_text) rp_text_free(rp_plan_context(*f->current), plan_text);
    if (*st != RP_OK) {
        json_decref(root);
        root = NULL;
    }
    return root;
}

rp_status rp_sched_save_state(const rp_sched *sched, char **json, size_t *len, rp_error *err)
{
    if (!sched || !json) return rp_fail(err, RP_EINVAL, "sched: scheduler and output are required");
    rp_error local;
    if (!err) err = &local;
    sched_fields f;
    sched_fields_of((rp_sched *)sched, &f);
    f.errmsg[0] = '\0';
    rp_status st;
    char *dump = NULL;
    json_t *root = encode_root(&f, &st, err);
    if (!root) goto out;
    dump = json_dumps(root, DUMP_FLAGS);
    if (!dump) goto nomem;
    size_t n = strlen(dump);
    *json = rp_alloc(f.ctx, n + 2);
    if (!*json) goto nomem;
    memcpy(*json, dump, n);
    (*json)[n] = '\n';
    (*json)[n + 1] = '\0';
    if (len) *len = n + 1;
    goto out;
nomem:
    st = rp_fail_nomem(err, "the scheduler state");
out:
    free(dump);
    json_decref(root);
    if (st != RP_OK) snprintf(f.errmsg, RP_ERROR_TEXT, "%s", err->text);
    return st;
}

/* ---- loading -------------------------------------------------------------------------- */

/* Everything rp_sched_load_state builds before it commits. */
typedef struct loaded {
    policy_set running, staged;
    int64_t staged_at;
    rp_plan *plan;
    bool has_step;
    int64_t last_step;
    int32_t failed_steps;
    uint64_t seed;
    rp_batch *batch;
    rp_stats *stats;
    int32_t hist_count;
    int64_t *hist_steps, *hist_loads;
    int32_t *lens;   /* scratch: prompt, response, group ids */
    uint32_t *seq_hist;
    int64_t *expert_load;
} loaded;

static void loaded_free(rp_context *ctx, loaded *ld)
{
    sched_set_free(&ld->running);
    sched_set_free(&ld->staged);
    rp_plan_free(ld->plan);
    rp_batch_free(ld->batch);
    rp_stats_free(ld->stats);
    rp_free(ctx, ld->hist_steps);
    rp_free(ctx, ld->hist_loads);
    rp_free(ctx, ld->lens);
    rp_free(ctx, ld->seq_hist);
    rp_free(ctx, ld->expert_load);
}

static rp_status shape_mismatch(const rp_jdoc *doc, rp_error *err, const char *what, int64_t saved, int64_t mine)
{
    char path[64];
    snprintf(path, sizeof path, "config.%s", what);
    return rp_jdoc_fail(doc, err, RP_EINVAL, path,
                        "is %lld in the state, but this scheduler's config has %lld: a state loads only into a "
                        "scheduler of the same shape",
                        (long long)saved, (long long)mine);
}

static rp_status check_config(const rp_jdoc *doc, json_t *root, const rp_config *cfg, rp_error *err)
{
    static const char *const keys[] = {"num_layers", "num_experts", "top_k", "num_gpus", "ep_size", "slots", NULL};
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *tp = rp_config_topology(cfg);
    json_t *c;
    rp_status st = rp_jdoc_obj(doc, root, "", "config", true, &c, err);
    if (st == RP_OK) st = rp_jdoc_check_keys(doc, c, "config", keys, err);
    if (st != RP_OK) return st;
    const char *names[] = {"num_layers", "num_experts", "top_k", "num_gpus", "ep_size"};
    int64_t mine[] = {md->num_layers, md->num_experts, md->top_k, tp->num_gpus, tp->ep_size};
    for (int i = 0; i < 5; i++) {
        int64_t v;
        st = rp_jdoc_int(doc, c, "config", names[i], true, 0, 0, INT32_MAX, &v, err);
        if (st != RP_OK) return st;
        if (v != mine[i]) return shape_mismatch(doc, err, names[i], v, mine[i]);
    }
    json_t *slots;
    st = rp_jdoc_arr(doc, c, "config", "slots", true, &slots, err);
    if (st != RP_OK) return st;
    if ((int64_t)json_array_size(slots) != tp->num_gpus)
        return rp_jdoc_fail(doc, err, RP_EFORMAT, "config.slots", "has %zu entries for %d GPUs", json_array_size(slots),
                            (int)tp->num_gpus);
    for (int32_t g = 0; g < tp->num_gpus; g++) {
        char path[64];
        int64_t v;
        rp_jpath_index(path, sizeof path, "config.slots", (size_t)g);
        st = rp_jdoc_int_value(doc, json_array_get(slots, (size_t)g), path, 0, INT32_MAX, &v, err);
        if (st != RP_OK) return st;
        if (v != tp->slots[g]) {
            char what[32];
            snprintf(what, sizeof what, "slots[%d]", (int)g);
            return shape_mismatch(doc, err, what, v, tp->slots[g]);
        }
    }
    return RP_OK;
}

/* Read a JSON array of exactly `n` integers in [min, max] at `path` into `out`. */
static rp_status read_ints(const rp_jdoc *doc, json_t *arr, const char *path, size_t n, int64_t min, int64_t max,
                           int64_t *out64, int32_t *out32, rp_error *err)
{
    if (!json_is_array(arr))
        return rp_jdoc_fail(doc, err, RP_EFORMAT, path, "must be an array, got %s", rp_jdoc_type_name(arr));
    if (json_array_size(arr) != n)
        return rp_jdoc_fail(doc, err, RP_EFORMAT, path, "has %zu entries; %zu expected", json_array_size(arr), n);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        int64_t x;
        if (!json_is_integer(v) || (x = (int64_t)json_integer_value(v)) < min || x > max) {
            char at[PATH_LEN];
            return rp_jdoc_int_value(doc, v, rp_jpath_index(at, sizeof at, path, i), min, max, &x, err);
        }
        if (out64) out64[i] = x;
        if (out32) out32[i] = (int32_t)x;
    }
    return RP_OK;
}

/* One (sequence, layer, expert, count) entry of last_batch.seq_hist. */
typedef struct hist_quad {
    int32_t seq, layer, expert;
    uint32_t count;
} hist_quad;

/* The quads of the last batch, in (sequence, layer, expert) order, handed to
 * stats_from_rows one sequence at a time: the dense n x layers x experts array is
 * never built (a state listing a million empty sequences costs what they hold). */
typedef struct quad_rows {
    const hist_quad *quads;
    const size_t *first;  /* [n + 1]: each sequence's range of quads */
    int32_t num_experts;
    size_t cells;
} quad_rows;

static void quad_row(void *ud, int32_t seq, uint32_t *counts)
{
    const quad_rows *q = ud;
    memset(counts, 0, q->cells * sizeof *counts);
    for (size_t i = q->first[seq]; i < q->first[seq + 1]; i++)
        counts[(size_t)q->quads[i].layer * (size_t)q->num_experts + (size_t)q->quads[i].expert] = q->quads[i].count;
}

/* last_batch as rp_sched_save_state writes it, checked against everything the writer
 * guarantees: every key present; lengths and group ids in range, one per sequence;
 * seq_hist quadruples in strictly increasing (sequence, layer, expert) order (no
 * duplicates), counts >= 1; each (sequence, layer) counting the sequence's tokens x
 * top_k; each (layer, expert) load the sum of its counts. */
static rp_status load_last_batch(const rp_jdoc *doc, const sched_fields *f, json_t *obj, loaded *ld, rp_error *err)
{
    static const char *const keys[] = {"prompt_lens", "response_lens", "group_ids", "expert_load", "seq_hist", NULL};
    const rp_model *md = rp_config_model(f->cfg);
    const int32_t L = md->num_layers, E = md->num_experts;
    const size_t cells = (size_t)L * (size_t)E;
    json_t *pl, *rl, *gi, *el, *hist;
    hist_quad *quads = NULL;
    size_t *first = NULL;
    int64_t *sums = NULL;
    rp_status st;
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, obj, "last_batch", keys, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, "last_batch", "prompt_lens", true, &pl, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, "last_batch", "response_lens", true, &rl, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, "last_batch", "group_ids", true, &gi, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, "last_batch", "expert_load", true, &el, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(doc, obj, "last_batch", "seq_hist", true, &hist, err), st, out);
    size_t n = json_array_size(pl);
    if (n < 1 || n > INT32_MAX / 3) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "last_batch.prompt_lens", "has %zu sequences; a step has 1 to %d", n,
                          INT32_MAX / 3);
        goto out;
    }
    ld->lens = rp_alloc(f->ctx, 3 * n * sizeof *ld->lens);
    ld->expert_load = rp_alloc(f->ctx, cells * sizeof *ld->expert_load);
    if (!ld->lens || !ld->expert_load) {
        st = rp_fail_nomem(err, "the state's last batch");
        goto out;
    }
    int32_t *prompt = ld->lens, *response = ld->lens + n, *group = ld->lens + 2 * n;
    RP_CHECK_GOTO(read_ints(doc, pl, "last_batch.prompt_lens", n, 0, INT32_MAX, NULL, prompt, err), st, out);
    RP_CHECK_GOTO(read_ints(doc, rl, "last_batch.response_lens", n, 0, INT32_MAX, NULL, response, err), st, out);
    RP_CHECK_GOTO(read_ints(doc, gi, "last_batch.group_ids", n, INT32_MIN, INT32_MAX, NULL, group, err), st, out);
    RP_CHECK_GOTO(read_ints(doc, el, "last_batch.expert_load", cells, 0, INT64_MAX, ld->expert_load, NULL, err), st,
                  out);
    RP_CHECK_GOTO(rp_batch_new(f->ctx, (int32_t)n, prompt, response, group, &ld->batch, err), st, out);
    const int64_t tokens = rp_batch_num_tokens(ld->batch);

    /* top_k as the step's routing had it: the loads of a layer sum to tokens * top_k */
    int64_t layer0 = 0;
    for (int32_t e = 0; e < E; e++)
        if (rp_add_overflow(layer0, ld->expert_load[e], &layer0)) break;
    int64_t top_k = tokens > 0 ? layer0 / tokens : md->top_k;
    if (tokens > 0 && (layer0 % tokens || top_k < 1 || top_k > E)) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "last_batch.expert_load",
                          "counts %lld token-choices at layer 0 for %lld tokens: not tokens x top-k with top-k in "
                          "[1, %d]",
                          (long long)layer0, (long long)tokens, (int)E);
        goto out;
    }

    size_t hn = json_array_size(hist);
    if (hn % 4) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "last_batch.seq_hist",
                          "has %zu numbers; it is a flat list of (sequence, layer, expert, count) quadruples", hn);
        goto out;
    }
    size_t nq = hn / 4;
    quads = rp_alloc(f->ctx, (nq ? nq : 1) * sizeof *quads);
    first = rp_calloc(f->ctx, n + 1, sizeof *first);
    sums = rp_calloc(f->ctx, cells, sizeof *sums);
    if (!quads || !first || !sums) {
        st = rp_fail_nomem(err, "the state's last batch");
        goto out;
    }
    for (size_t i = 0; i < nq; i++) {
        int64_t q[4];
        const int64_t max[4] = {(int64_t)n - 1, L - 1, E - 1, UINT32_MAX};
        char at[PATH_LEN];
        for (int k = 0; k < 4; k++) {
            rp_jpath_index(at, sizeof at, "last_batch.seq_hist", 4 * i + (size_t)k);
            RP_CHECK_GOTO(rp_jdoc_int_value(doc, json_array_get(hist, 4 * i + (size_t)k), at, k == 3 ? 1 : 0, max[k],
                                            &q[k], err),
                          st, out);
        }
        hist_quad h = {(int32_t)q[0], (int32_t)q[1], (int32_t)q[2], (uint32_t)q[3]};
        if (i > 0) {
            const hist_quad *p = &quads[i - 1];
            bool after = h.seq != p->seq ? h.seq > p->seq : h.layer != p->layer ? h.layer > p->layer
                                                                                 : h.expert > p->expert;
            if (!after) {
                rp_jpath_index(at, sizeof at, "last_batch.seq_hist", 4 * i);
                st = rp_jdoc_fail(doc, err, RP_EFORMAT, at,
                                  "(sequence %d, layer %d, expert %d) %s: quadruples come once each, in increasing "
                                  "(sequence, layer, expert) order",
                                  (int)h.seq, (int)h.layer, (int)h.expert,
                                  h.seq == p->seq && h.layer == p->layer && h.expert == p->expert
                                      ? "is listed twice"
                                      : "comes after a later one");
                goto out;
            }
        }
        quads[i] = h;
        first[h.seq + 1] = i + 1;
        sums[(size_t)h.layer * (size_t)E + (size_t)h.expert] += h.count; /* < 2^31 quads x 2^32: no overflow */
    }
    for (size_t s = 1; s <= n; s++)
        if (first[s] < first[s - 1]) first[s] = first[s - 1]; /* sequences without quads */
    /* each (sequence, layer) holds len * top_k choices */
    for (int32_t s = 0; s < (int32_t)n; s++) {
        const int64_t want = (int64_t)rp_batch_seq_len(ld->batch, s) * top_k;
        size_t i = first[s];
        for (int32_t l = 0; l < L; l++) {
            int64_t got = 0;
            for (; i < first[s + 1] && quads[i].layer == l; i++) got += quads[i].count;
            if (got != want) {
                char at[PATH_LEN];
                snprintf(at, sizeof at, "last_batch.seq_hist");
                st = rp_jdoc_fail(doc, err, RP_EFORMAT, at,
                                  "counts %lld choices for sequence %d at layer %d, but its %d tokens make %lld at "
                                  "top-%lld",
                                  (long long)got, (int)s, (int)l, (int)rp_batch_seq_len(ld->batch, s), (long long)want,
                                  (long long)top_k);
                if (err) err->sequence = s;
                goto out;
            }
        }
    }
    for (size_t c = 0; c < cells; c++)
        if (sums[c] != ld->expert_load[c]) {
            char at[PATH_LEN];
            rp_jpath_index(at, sizeof at, "last_batch.expert_load", c);
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, at,
                              "is %lld, but seq_hist counts %lld choices of layer %d expert %d",
                              (long long)ld->expert_load[c], (long long)sums[c], (int)(c / (size_t)E),
                              (int)(c % (size_t)E));
            goto out;
        }
    quad_rows rows = {quads, first, E, cells};
    RP_CHECK_GOTO(stats_from_rows(f->ctx, (int32_t)n, L, E, (int32_t)top_k, tokens, quad_row, &rows, ld->expert_load,
                                  &ld->stats, err),
                  st, out);
out:
    rp_free(f->ctx, quads);
    rp_free(f->ctx, first);
    rp_free(f->ctx, sums);
    return st;
}

/* The history, oldest first, as written: at most history_length entries, each a step
 * and that step's expert loads (every layer counting the same number of choices). */
static rp_status load_history(const rp_jdoc *doc, const sched_fields *f, json_t *arr, loaded *ld, rp_error *err)
{
    const rp_model *md = rp_config_model(f->cfg);
    const size_t E = (size_t)md->num_experts, cells = (size_t)md->num_layers * E;
    if (!json_is_array(arr)) return rp_jdoc_fail(doc, err, RP_EFORMAT, "history", "must be an array");
    size_t n = json_array_size(arr);
    if (n > (size_t)f->hist_cap)
        return rp_jdoc_fail(doc, err, RP_EFORMAT, "history", "has %zu entries, more than history_length %d", n,
                            (int)f->hist_cap);
    ld->hist_count = (int32_t)n;
    if (n == 0) return RP_OK;
    ld->hist_steps = rp_alloc(f->ctx, n * sizeof *ld->hist_steps);
    ld->hist_loads = rp_alloc(f->ctx, n * cells * sizeof *ld->hist_loads);
    if (!ld->hist_steps || !ld->hist_loads) return rp_fail_nomem(err, "the state's history");
    static const char *const keys[] = {"step", "expert_load", NULL};
    for (size_t i = 0; i < n; i++) {
        char at[PATH_LEN], sub[PATH_LEN];
        json_t *e = json_array_get(arr, i), *loads = NULL;
        rp_jpath_index(at, sizeof at, "history", i);
        rp_status st = rp_jdoc_check_keys(doc, e, at, keys, err);
        if (st == RP_OK) st = rp_jdoc_int(doc, e, at, "step", true, 0, INT64_MIN, INT64_MAX, &ld->hist_steps[i], err);
        if (st == RP_OK) st = rp_jdoc_arr(doc, e, at, "expert_load", true, &loads, err);
        if (st == RP_OK)
            st = read_ints(doc, loads, rp_jpath_key(sub, sizeof sub, at, "expert_load"), cells, 0, INT64_MAX,
                           ld->hist_loads + i * cells, NULL, err);
        if (st != RP_OK) return st;
        const int64_t *row = ld->hist_loads + i * cells;
        int64_t layer0 = 0;
        for (int32_t l = 0; l < md->num_layers; l++) {
            int64_t sum = 0;
            for (size_t x = 0; x < E; x++)
                if (rp_add_overflow(sum, row[(size_t)l * E + x], &sum)) sum = -1;
            if (l == 0) layer0 = sum;
            if (sum < 0 || sum != layer0)
                return rp_jdoc_fail(doc, err, RP_EFORMAT, sub,
                                    "counts %lld choices at layer %d but %lld at layer 0: every layer routes the same "
                                    "tokens",
                                    (long long)sum, (int)l, (long long)layer0);
        }
    }
    return RP_OK;
}

static rp_status parse_state(const rp_jdoc *doc, const sched_fields *f, loaded *ld, rp_error *err)
{
    static const char *const keys[] = {"format", "version", "config", "seed", "split", "history_length", "last_step",
                                       "plan", "plan_hash", "running", "staged", "history", "last_batch", "failed_steps", NULL};
    json_t *root = doc->root;
    const char *format = NULL, *text;
    int64_t v;
    rp_status st;
    if (!json_is_object(root))
        return rp_jdoc_fail(doc, err, RP_EFORMAT, "", "is %s, not a RoutePack scheduler state (an object with "
                            "\"format\": \"" STATE_FORMAT "\")", rp_jdoc_type_name(root));
    json_t *fmt = json_object_get(root, "format");
    if (!fmt)
        return rp_jdoc_fail(doc, err, RP_EFORMAT, "format",
                            "is missing: not a RoutePack scheduler state (\"format\": \"" STATE_FORMAT "\")");
    if (!json_is_string(fmt) || strcmp((format = json_string_value(fmt)), STATE_FORMAT) != 0) {
        if (json_is_string(fmt))
            return rp_jdoc_fail(doc, err, RP_EFORMAT, "format", "is \"%s\", not \"" STATE_FORMAT "\": not a scheduler state",
                                format);
        return rp_jdoc_fail(doc, err, RP_EFORMAT, "format", "is %s, not \"" STATE_FORMAT "\": not a scheduler state",
                            rp_jdoc_type_name(fmt));
    }
    RP_CHECK_GOTO(rp_jdoc_int(doc, root, "", "version", true, 0, 1, INT32_MAX, &v, err), st, out);
    if (v != STATE_VERSION) {
        st = rp_jdoc_fail(doc, err, RP_ENOTSUP, "version", "is %lld; this library reads version %d", (long long)v,
                          STATE_VERSION);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, root, "", keys, err), st, out);
    /* the writer writes every key (null where there is nothing) */
    for (size_t i = 0; keys[i] && strcmp(keys[i], "failed_steps") != 0; i++)
        if (!json_object_get(root, keys[i])) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, keys[i], "is required%s", strcmp(keys[i], "plan") == 0 ||
                              strcmp(keys[i], "plan_hash") == 0 || strcmp(keys[i], "staged") == 0 ||
                              strcmp(keys[i], "last_batch") == 0 || strcmp(keys[i], "last_step") == 0
                                  ? " (null when there is none)" : "");
            goto out;
        }
    RP_CHECK_GOTO(check_config(doc, root, f->cfg, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(doc, root, "", "seed", true, NULL, &text, err), st, out);
    if (!parse_hex64(text, &ld->seed)) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "seed", "must be 16 lower-case hex digits, got \"%s\"", text);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_str(doc, root, "", "split", true, NULL, &text, err), st, out);
    const char *mine = f->opts->split == RP_SPLIT_LOCALITY ? "locality" : "even";
    if (strcmp(text, mine) != 0) {
        st = rp_jdoc_fail(doc, err, RP_EINVAL, "split", "is \"%s\" in the state, but this scheduler splits \"%s\"", text,
                          mine);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_int(doc, root, "", "history_length", true, 0, 0, INT32_MAX, &v, err), st, out);
    if (v != f->hist_cap) {
        st = rp_jdoc_fail(doc, err, RP_EINVAL, "history_length",
                          "is %lld in the state, but this scheduler keeps %d steps of history (options.history)",
                          (long long)v, (int)f->hist_cap);
        goto out;
    }
    json_t *last = json_object_get(root, "last_step");
    ld->has_step = !json_is_null(last);
    if (ld->has_step) RP_CHECK_GOTO(rp_jdoc_int(doc, root, "", "last_step", true, 0, INT64_MIN, INT64_MAX, &ld->last_step, err), st, out);
    /* written only when a streak is under way (older states have none) */
    RP_CHECK_GOTO(rp_jdoc_int(doc, root, "", "failed_steps", false, 0, 1, INT32_MAX, &v, err), st, out);
    ld->failed_steps = (int32_t)v;

    json_t *plan = json_object_get(root, "plan");
    if (plan && !json_is_null(plan)) {
        if (!ld->has_step) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan", "is given but last_step is null");
            goto out;
        }
        const char *hash_text;
        uint64_t want;
        RP_CHECK_GOTO(rp_jdoc_str(doc, root, "", "plan_hash", true, NULL, &hash_text, err), st, out);
        if (!parse_hex64(hash_text, &want)) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan_hash", "must be 16 lower-case hex digits, got \"%s\"", hash_text);
            goto out;
        }
        char *ptext = json_dumps(plan, DUMP_FLAGS);
        if (!ptext) {
            st = rp_fail_nomem(err, "the state's plan");
            goto out;
        }
        rp_error pe;
        st = rp_plan_parse(f->ctx, f->cfg, ptext, strlen(ptext), "state.plan", &ld->plan, &pe);
        free(ptext);
        if (st != RP_OK) {
            rp_fail(err, st, "%s: plan: %s", doc->name, pe.text);
            goto out;
        }
        if (!rp_plan_has_placement(ld->plan) || rp_plan_hash(ld->plan) != want) {
            if (rp_plan_has_placement(ld->plan))
                st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan",
                                  "does not match plan_hash %s: the state was edited or damaged", hash_text);
            else
                st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan", "has no placement (plan_hash %s)", hash_text);
            goto out;
        }
    } else if (ld->has_step) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan", "is required after a step (last_step is %lld)",
                          (long long)ld->last_step);
        goto out;
    } else if (!json_is_null(json_object_get(root, "plan_hash"))) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan_hash", "must be null when there is no plan");
        goto out;
    }

    json_t *obj;
    RP_CHECK_GOTO(rp_jdoc_obj(doc, root, "", "running", true, &obj, err), st, out);
    RP_CHECK_GOTO(load_set(doc, f, obj, "running", false, &ld->running, NULL, err), st, out);
    obj = json_object_get(root, "staged");
    ld->staged_at = -1;
    if (obj && !json_is_null(obj))
        RP_CHECK_GOTO(load_set(doc, f, obj, "staged", true, &ld->staged, &ld->staged_at, err), st, out);
    json_t *hist;
    RP_CHECK_GOTO(rp_jdoc_arr(doc, root, "", "history", true, &hist, err), st, out);
    RP_CHECK_GOTO(load_history(doc, f, hist, ld, err), st, out);
    obj = json_object_get(root, "last_batch");
    if (!json_is_null(obj) != ld->has_step) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "last_batch",
                          ld->has_step ? "is required after a step (the step's batch and statistics)"
                                       : "is given but last_step is null");
        goto out;
    }
    if (ld->has_step) {
        RP_CHECK_GOTO(load_last_batch(doc, f, obj, ld, err), st, out);
        if (rp_plan_has_packing(ld->plan) && rp_plan_num_seqs(ld->plan) != rp_batch_num_seqs(ld->batch)) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, "plan",
                              "packs %d sequences, but the last batch has %d: the plan was made for another batch",
                              (int)rp_plan_num_seqs(ld->plan), (int)rp_batch_num_seqs(ld->batch));
            goto out;
        }
    }
    /* every step enters the history (when there is one): the newest entry is the last
     * step with its batch's loads, and there is none before the first step */
    if (!ld->has_step && ld->hist_count > 0) {
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, "history", "has %d entries but last_step is null",
                          (int)ld->hist_count);
        goto out;
    }
    if (ld->has_step && f->hist_cap > 0) {
        const rp_model *md = rp_config_model(f->cfg);
        const size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
        int32_t newest = ld->hist_count - 1;
        char at[PATH_LEN];
        rp_jpath_index(at, sizeof at, "history", (size_t)(newest < 0 ? 0 : newest));
        if (newest < 0 || ld->hist_steps[newest] != ld->last_step) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, newest < 0 ? "history" : at,
                              "must end with the last step (%lld) and its expert loads", (long long)ld->last_step);
            goto out;
        }
        if (memcmp(ld->hist_loads + (size_t)newest * cells, ld->expert_load, cells * sizeof *ld->expert_load) != 0) {
            st = rp_jdoc_fail(doc, err, RP_EFORMAT, at,
                              "holds other expert loads than last_batch, but both are the last step's");
            goto out;
        }
    }
    st = RP_OK;
out:
    return st;
}

/* A short rendering of a JSON value for messages: scalars as JSON, containers by size. */
static void describe_value(json_t *v, char *buf, size_t size)
{
    if (!v) snprintf(buf, size, "nothing");
    else if (json_is_object(v)) snprintf(buf, size, "an object of %zu keys", json_object_size(v));
    else if (json_is_array(v)) snprintf(buf, size, "an array of %zu entries", json_array_size(v));
    else {
        char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
        snprintf(buf, size, "%.60s%s", text ? text : "a value", text && strlen(text) > 60 ? "..." : "");
        free(text);
    }
}

/* The first place (JSON path into `path`) where `got` (the document) and `want` (what
 * the writer writes for what it loaded) differ, and the two values there. */
static void first_difference(json_t *got, json_t *want, char *path, size_t size, json_t **g, json_t **w)
{
    *g = got;
    *w = want;
    if (json_typeof(got) != json_typeof(want)) return;
    char sub[PATH_LEN];
    if (json_is_object(got)) {
        const char *key;
        json_t *v;
        json_object_foreach(got, key, v) {
            json_t *o = json_object_get(want, key);
            if (!o || !json_equal(v, o)) {
                rp_jpath_key(sub, sizeof sub, path, key);
                snprintf(path, size, "%s", sub);
                if (o) first_difference(v, o, path, size, g, w);
                else *g = v, *w = NULL;
                return;
            }
        }
        json_object_foreach(want, key, v)
            if (!json_object_get(got, key)) {
                rp_jpath_key(sub, sizeof sub, path, key);
                snprintf(path, size, "%s", sub);
                *g = NULL, *w = v;
                return;
            }
    } else if (json_is_array(got) && json_array_size(got) == json_array_size(want)) {
        for (size_t i = 0; i < json_array_size(got); i++)
            if (!json_equal(json_array_get(got, i), json_array_get(want, i))) {
                rp_jpath_index(sub, sizeof sub, path, i);
                snprintf(path, size, "%s", sub);
                first_difference(json_array_get(got, i), json_array_get(want, i), path, size, g, w);
                return;
            }
    }
}

/* What was loaded must save to the same document (up to layout and key order): a state
 * is refused if it holds anything the writer would not write for it (a duplicate
 * ctx.state key, an integer where a number is written, hex bytes for a plain string, a
 * policy's name or params other than its text gives, ...), so every state that loads
 * saves again, byte for byte as this library writes it, and loads again. */
static rp_status check_round_trip(const rp_jdoc *doc, const sched_fields *f, loaded *ld, rp_error *err)
{
    rp_sched_options opts = *f->opts;
    opts.seed = ld->seed;
    int32_t head = f->hist_cap > 0 ? ld->hist_count % f->hist_cap : 0;
    sched_fields v = *f;
    v.opts = &opts;
    v.running = &ld->running;
    v.staged = &ld->staged;
    v.staged_at = &ld->staged_at;
    v.current = &ld->plan;
    v.has_step = &ld->has_step;
    v.last_step = &ld->last_step;
    v.failed_steps = &ld->failed_steps;
    v.prev_batch = &ld->batch;
    v.prev_stats = &ld->stats;
    v.hist_count = &ld->hist_count;
    v.hist_head = &head;
    v.hist_steps = ld->hist_steps;
    v.hist_loads = ld->hist_loads;
    rp_status st;
    json_t *again = encode_root(&v, &st, err);
    if (!again) return st;
    if (!json_equal(again, doc->root)) {
        char path[PATH_LEN] = "";
        char got[96], want[96];
        json_t *g, *w;
        first_difference(doc->root, again, path, sizeof path, &g, &w);
        describe_value(g, got, sizeof got);
        describe_value(w, want, sizeof want);
        st = rp_jdoc_fail(doc, err, RP_EFORMAT, path,
                          "is %s, but what the state holds saves as %s: not a state this library wrote (edited or "
                          "damaged)",
                          got, want);
    }
    json_decref(again);
    return st;
}

rp_status rp_sched_load_state(rp_sched *sched, const char *json, size_t len, rp_error *err)
{
    if (!sched) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    rp_error local;
    if (!err) err = &local;
    rp_error_clear(err);
    sched_fields f;
    sched_fields_of(sched, &f);
    f.errmsg[0] = '\0';
    if (!json) {
        rp_fail(err, RP_EINVAL, "sched: no state text");
        snprintf(f.errmsg, RP_ERROR_TEXT, "%s", err->text);
        return RP_EINVAL;
    }
    const rp_model *md = rp_config_model(f.cfg);
    size_t cells = (size_t)md->num_layers * (size_t)md->num_experts;
    rp_jdoc doc;
    memset(&doc, 0, sizeof doc);
    loaded ld;
    memset(&ld, 0, sizeof ld);
    rp_status st;
    RP_CHECK_GOTO(rp_jdoc_parse(&doc, json, len, "state", err), st, out);
    RP_CHECK_GOTO(parse_state(&doc, &f, &ld, err), st, out);
    RP_CHECK_GOTO(check_round_trip(&doc, &f, &ld, err), st, out);

    /* commit: nothing below can fail */
    sched_set_free(f.running);
    *f.running = ld.running;
    memset(&ld.running, 0, sizeof ld.running);
    sched_set_free(f.staged);
    *f.staged = ld.staged;
    memset(&ld.staged, 0, sizeof ld.staged);
    *f.staged_at = ld.staged_at;
    rp_plan_free(*f.current);
    *f.current = ld.plan;
    ld.plan = NULL;
    *f.has_step = ld.has_step;
    *f.last_step = ld.has_step ? ld.last_step : 0;
    *f.failed_steps = ld.failed_steps;
    rp_batch_free(*f.prev_batch);
    rp_stats_free(*f.prev_stats);
    *f.prev_batch = ld.batch;
    *f.prev_stats = ld.stats;
    ld.batch = NULL;
    ld.stats = NULL;
    if (ld.hist_count > 0) {
        memcpy(f.hist_steps, ld.hist_steps, (size_t)ld.hist_count * sizeof *f.hist_steps);
        memcpy(f.hist_loads, ld.hist_loads, (size_t)ld.hist_count * cells * sizeof *f.hist_loads);
    }
    *f.hist_count = ld.hist_count;
    *f.hist_head = f.hist_cap > 0 ? ld.hist_count % f.hist_cap : 0;
    f.opts->seed = ld.seed;
    *f.has_report = false;
    f.migration->open = false;
    st = RP_OK;
out:
    loaded_free(f.ctx, &ld);
    rp_jdoc_free(&doc);
    if (st != RP_OK) snprintf(f.errmsg, RP_ERROR_TEXT, "%s", err->text);
    return st;
}
