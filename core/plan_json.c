/* The plan JSON schema (docs/formats.md): strict reading with name:line:column
 * errors, and writing through jansson, one rank or layer per line. */
#include "internal.h"
#include "jsonx.h"
#include "routepack/plan.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define PLAN_FORMAT "routepack-plan"
/* Far beyond any real step; keeps a typo from allocating G x 2^31 lists. */
#define MAX_MICROBATCHES 1048576
#define PATH_TEXT 256

/* "" or "s" after a count in a message. */
static const char *plural(size_t n)
{
    return n == 1 ? "" : "s";
}

/* ---- reading --------------------------------------------------------------------- */

static const char *const plan_keys[] = {
    "format", "version", "num_gpus", "ep_size", "num_microbatches", "num_layers", "num_experts",
    "num_seqs", "packing", "placement", "extra_replicas", "shares", "per_forward_balancing", "microbatch_order", NULL,
};
static const char *const extra_keys[] = {"microbatch", "layer", "expert", "ep_rank", NULL};
static const char *const share_keys[] = {"microbatch", "layer", "expert", "shares", NULL};

/* An optional shape key must match the config's value when present. */
static rp_status shape_key(const rp_jdoc *doc, json_t *root, const char *key, int32_t want,
                           const char *what, rp_error *err)
{
    int64_t v;
    rp_status st = rp_jdoc_int(doc, root, "", key, false, want, INT64_MIN, INT64_MAX, &v, err);
    if (st != RP_OK) return st;
    if (v != want)
        return rp_jdoc_fail(doc, err, RP_EINVAL, key, "is %lld, but the config has %d %s", (long long)v, want,
                            what);
    return RP_OK;
}

/* An index member of a lever entry: 0 <= value < limit. */
static rp_status index_key(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                           int32_t limit, const char *what, int32_t *out, rp_error *err)
{
    char kp[PATH_TEXT];
    int64_t v;
    rp_status st = rp_jdoc_int(doc, obj, path, key, true, 0, INT64_MIN, INT64_MAX, &v, err);
    if (st != RP_OK) return st;
    if (v < 0 || v >= limit) {
        rp_jdoc_fail(doc, err, RP_ERANGE, rp_jpath_key(kp, sizeof kp, path, key), "is %lld, but the plan has %d %s",
                     (long long)v, limit, what);
        if (err && strcmp(key, "expert") == 0) err->expert = v;
        return RP_ERANGE;
    }
    *out = (int32_t)v;
    return RP_OK;
}

static rp_status read_packing(const rp_jdoc *doc, json_t *packing, rp_plan *plan, int32_t num_seqs,
                              rp_error *err)
{
    rp_context *ctx = rp_plan_context(plan);
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    size_t lists = (size_t)G * M, total = 0;
    char path[PATH_TEXT];
    /* every id is at least one byte of text: the total cannot overflow */
    for (int32_t r = 0; r < G; r++)
        for (int32_t m = 0; m < M; m++) {
            json_t *mb = json_array_get(json_array_get(packing, (size_t)r), (size_t)m);
            snprintf(path, sizeof path, "packing[%d][%d]", r, m);
            if (!json_is_array(mb))
                return rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an array of sequence ids, got %s",
                                    rp_jdoc_type_name(mb));
            total += json_array_size(mb);
        }
    int32_t *ids = rp_alloc(ctx, total * sizeof *ids + 1);
    int32_t *counts = rp_alloc(ctx, lists * sizeof *counts + 1);
    const int32_t **ptrs = rp_alloc(ctx, lists * sizeof *ptrs + 1);
    rp_status st = RP_OK;
    if (!ids || !counts || !ptrs) {
        st = rp_fail_nomem(err, "a packing");
        goto out;
    }
    size_t at = 0;
    for (int32_t r = 0; r < G; r++)
        for (int32_t m = 0; m < M; m++) {
            json_t *mb = json_array_get(json_array_get(packing, (size_t)r), (size_t)m);
            size_t i = (size_t)r * M + m, n = json_array_size(mb);
            ptrs[i] = ids + at;
            counts[i] = (int32_t)n;
            for (size_t k = 0; k < n; k++) {
                int64_t s;
                snprintf(path, sizeof path, "packing[%d][%d][%zu]", r, m, k);
                RP_CHECK_GOTO(rp_jdoc_int_value(doc, json_array_get(mb, k), path, INT64_MIN, INT64_MAX, &s, err),
                              st, out);
                if (s < 0 || s >= num_seqs) {
                    st = rp_jdoc_fail(doc, err, RP_ERANGE, path, "is sequence %lld, but num_seqs is %d",
                                      (long long)s, num_seqs);
                    if (err) err->sequence = s;
                    goto out;
                }
                ids[at++] = (int32_t)s;
            }
        }
    st = rp_plan_set_microbatches(plan, num_seqs, ptrs, counts, err);
out:
    rp_free(ctx, ids);
    rp_free(ctx, counts);
    rp_free(ctx, ptrs);
    return st;
}

static rp_status read_placement(const rp_jdoc *doc, json_t *placement, rp_plan *plan, rp_error *err)
{
    rp_context *ctx = rp_plan_context(plan);
    int32_t L = rp_plan_num_layers(plan), ep = rp_plan_ep_size(plan), E = rp_plan_num_experts(plan);
    int32_t S = rp_plan_total_slots(plan);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    char path[PATH_TEXT];
    if (json_array_size(placement) != (size_t)L)
        return rp_jdoc_fail(doc, err, RP_EINVAL, "placement", "has %zu layer%s, but the model has %d",
                            json_array_size(placement), plural(json_array_size(placement)), L);
    int32_t *phy2log = rp_alloc(ctx, (size_t)S * sizeof *phy2log + 1);
    if (!phy2log) return rp_fail_nomem(err, "a placement");
    rp_status st = RP_OK;
    for (int32_t l = 0; l < L; l++) {
        json_t *layer = json_array_get(placement, (size_t)l);
        snprintf(path, sizeof path, "placement[%d]", l);
        if (!json_is_array(layer)) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an array of EP ranks, got %s",
                              rp_jdoc_type_name(layer));
            goto out;
        }
        if (json_array_size(layer) != (size_t)ep) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "has %zu EP rank%s, but ep_size is %d",
                              json_array_size(layer), plural(json_array_size(layer)), ep);
            goto out;
        }
        for (int32_t j = 0; j < ep; j++) {
            json_t *rank = json_array_get(layer, (size_t)j);
            int32_t slots = slot_begin[j + 1] - slot_begin[j];
            snprintf(path, sizeof path, "placement[%d][%d]", l, j);
            if (!json_is_array(rank)) {
                st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an array of expert ids, got %s",
                                  rp_jdoc_type_name(rank));
                goto out;
            }
            size_t n = json_array_size(rank);
            if (n > (size_t)slots) {
                st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "has %zu experts, but EP rank %d has %d slot%s", n, j,
                                  slots, plural((size_t)slots));
                goto out;
            }
            for (int32_t k = 0; k < slots; k++) {
                int64_t e = -1;
                if ((size_t)k < n) {
                    snprintf(path, sizeof path, "placement[%d][%d][%d]", l, j, k);
                    RP_CHECK_GOTO(rp_jdoc_int_value(doc, json_array_get(rank, (size_t)k), path, INT64_MIN, INT64_MAX,
                                                    &e, err),
                                  st, out);
                    if (e < -1 || e >= E) {
                        st = rp_jdoc_fail(doc, err, RP_ERANGE, path,
                                          "is expert %lld, but the model has %d experts (-1 marks an empty slot)",
                                          (long long)e, E);
                        if (err) err->expert = e;
                        goto out;
                    }
                }
                phy2log[slot_begin[j] + k] = (int32_t)e;
            }
        }
        RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, phy2log, err), st, out);
    }
out:
    rp_free(ctx, phy2log);
    return st;
}

static rp_status read_extras(const rp_jdoc *doc, json_t *extras, rp_plan *plan, rp_error *err)
{
    char path[PATH_TEXT];
    for (size_t i = 0; i < json_array_size(extras); i++) {
        json_t *x = json_array_get(extras, i);
        int32_t mb, l, e, j;
        snprintf(path, sizeof path, "extra_replicas[%zu]", i);
        rp_status st = rp_jdoc_check_keys(doc, x, path, extra_keys, err);
        if (st == RP_OK)
            st = index_key(doc, x, path, "microbatch", rp_plan_num_microbatches(plan), "microbatches", &mb, err);
        if (st == RP_OK) st = index_key(doc, x, path, "layer", rp_plan_num_layers(plan), "layers", &l, err);
        if (st == RP_OK) st = index_key(doc, x, path, "expert", rp_plan_num_experts(plan), "experts", &e, err);
        if (st == RP_OK) st = index_key(doc, x, path, "ep_rank", rp_plan_ep_size(plan), "EP ranks", &j, err);
        if (st == RP_OK) st = rp_plan_add_extra_replica(plan, mb, l, e, j, err);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

static rp_status read_shares(const rp_jdoc *doc, json_t *sets, rp_plan *plan, rp_error *err)
{
    rp_context *ctx = rp_plan_context(plan);
    char path[PATH_TEXT], vpath[PATH_TEXT];
    double *values = NULL;
    rp_status st = RP_OK;
    for (size_t i = 0; i < json_array_size(sets) && st == RP_OK; i++) {
        json_t *x = json_array_get(sets, i), *arr;
        int32_t mb, l, e;
        snprintf(path, sizeof path, "shares[%zu]", i);
        RP_CHECK_GOTO(rp_jdoc_check_keys(doc, x, path, share_keys, err), st, out);
        RP_CHECK_GOTO(index_key(doc, x, path, "microbatch", rp_plan_num_microbatches(plan), "microbatches", &mb, err),
                      st, out);
        RP_CHECK_GOTO(index_key(doc, x, path, "layer", rp_plan_num_layers(plan), "layers", &l, err), st, out);
        RP_CHECK_GOTO(index_key(doc, x, path, "expert", rp_plan_num_experts(plan), "experts", &e, err), st, out);
        RP_CHECK_GOTO(rp_jdoc_arr(doc, x, path, "shares", true, &arr, err), st, out);
        size_t n = json_array_size(arr);
        if (n > INT32_MAX) {
            st = rp_jdoc_fail(doc, err, RP_ERANGE, rp_jpath_key(vpath, sizeof vpath, path, "shares"), "is too long");
            goto out;
        }
        values = rp_alloc(ctx, n * sizeof *values + 1);
        if (!values) {
            st = rp_fail_nomem(err, "shares");
            goto out;
        }
        for (size_t k = 0; k < n; k++) {
            snprintf(vpath, sizeof vpath, "shares[%zu].shares[%zu]", i, k);
            /* range is for rp_plan_check to judge; JSON has no NaN or infinity */
            RP_CHECK_GOTO(rp_jdoc_num_value(doc, json_array_get(arr, k), vpath, -INFINITY, INFINITY, &values[k], err),
                          st, out);
        }
        int32_t before = rp_plan_num_share_sets(plan);
        RP_CHECK_GOTO(rp_plan_set_shares(plan, mb, l, e, values, (int32_t)n, err), st, out);
        if (rp_plan_num_share_sets(plan) == before) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, path,
                              "repeats microbatch %d layer %d expert %d: give each expert's shares once", mb, l, e);
            if (err) err->expert = e;
            goto out;
        }
        rp_free(ctx, values);
        values = NULL;
    }
out:
    rp_free(ctx, values);
    return st;
}

/* "microbatch_order": num_gpus arrays of M microbatch ids, each a permutation of
 * 0 .. M - 1 (version 2). Absent: every rank in index order. */
static rp_status read_order(rp_jdoc *doc, json_t *root, rp_plan *plan, rp_error *err)
{
    json_t *order;
    rp_status st = rp_jdoc_arr(doc, root, "", "microbatch_order", false, &order, err);
    if (st != RP_OK || !order) return st;
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    if (json_array_size(order) != (size_t)G)
        return rp_jdoc_fail(doc, err, RP_EINVAL, "microbatch_order", "has %zu ranks, but the plan has %d",
                            json_array_size(order), G);
    int32_t *ids = rp_alloc(rp_plan_context(plan), (size_t)M * sizeof *ids);
    if (!ids) return rp_fail_nomem(err, "a microbatch order");
    for (int32_t r = 0; r < G && st == RP_OK; r++) {
        char path[PATH_TEXT];
        json_t *rank = json_array_get(order, (size_t)r);
        snprintf(path, sizeof path, "microbatch_order[%d]", r);
        if (!json_is_array(rank) || json_array_size(rank) != (size_t)M) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an array of the %d microbatch ids in run order, got %s",
                              M, json_is_array(rank) ? "an array of another length" : rp_jdoc_type_name(rank));
            break;
        }
        for (int32_t k = 0; k < M && st == RP_OK; k++) {
            char ip[PATH_TEXT + 16];
            int64_t v;
            snprintf(ip, sizeof ip, "%s[%d]", path, k);
            st = rp_jdoc_int_value(doc, json_array_get(rank, (size_t)k), ip, 0, M - 1, &v, err);
            ids[k] = (int32_t)v;
        }
        if (st == RP_OK && (st = rp_plan_set_microbatch_order(plan, r, ids, err)) != RP_OK) {
            /* point at the rank's list, keeping the message that names the value */
            char why[RP_ERROR_TEXT];
            snprintf(why, sizeof why, "%s", err ? err->text : "");
            const char *text = strncmp(why, "plan: ", 6) == 0 ? why + 6 : why;
            st = rp_jdoc_fail(doc, err, st, path, "is not a permutation: %s", text);
        }
    }
    rp_free(rp_plan_context(plan), ids);
    return st;
}

rp_status rp_plan_parse(rp_context *ctx, const rp_config *cfg, const char *text, size_t len,
                        const char *name, rp_plan **out, rp_error *err)
{
    if (!ctx || !cfg || !out || (!text && len > 0))
        return rp_fail(err, RP_EINVAL, "plan: context, config, text and output are required");
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    const rp_limits *lim = rp_config_limits(cfg);
    rp_jdoc doc;
    rp_plan *plan = NULL;
    rp_status st = rp_jdoc_parse(&doc, text ? text : "", len, name ? name : "<inline>", err);
    if (st != RP_OK) return st;
    json_t *root = doc.root, *packing, *placement, *extras, *shares;
    const char *format;
    int64_t version, num_seqs = -1, num_mb = 0;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&doc, root, "", plan_keys, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(&doc, root, "", "format", true, NULL, &format, err), st, out);
    if (strcmp(format, PLAN_FORMAT) != 0) {
        st = rp_jdoc_fail(&doc, err, RP_EFORMAT, "format", "must be \"%s\", got \"%.64s\"", PLAN_FORMAT, format);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_int(&doc, root, "", "version", true, 0, INT64_MIN, INT64_MAX, &version, err), st, out);
    if (version < 1 || version > RP_PLAN_VERSION) {
        st = rp_jdoc_fail(&doc, err, RP_ENOTSUP, "version", "is %lld, but this build reads versions 1 to %d",
                          (long long)version, RP_PLAN_VERSION);
        goto out;
    }
    if (version < 2 && json_object_get(root, "microbatch_order")) {
        st = rp_jdoc_fail(&doc, err, RP_EINVAL, "microbatch_order",
                          "needs plan version 2 (the document says version %lld)", (long long)version);
        goto out;
    }
    RP_CHECK_GOTO(shape_key(&doc, root, "num_gpus", topo->num_gpus, "GPUs", err), st, out);
    RP_CHECK_GOTO(shape_key(&doc, root, "ep_size", topo->ep_size, "GPUs per EP group", err), st, out);
    RP_CHECK_GOTO(shape_key(&doc, root, "num_layers", model->num_layers, "MoE layers", err), st, out);
    RP_CHECK_GOTO(shape_key(&doc, root, "num_experts", model->num_experts, "experts", err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(&doc, root, "", "packing", false, &packing, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(&doc, root, "", "placement", false, &placement, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(&doc, root, "", "extra_replicas", false, &extras, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_arr(&doc, root, "", "shares", false, &shares, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_int(&doc, root, "", "num_microbatches", false, 0, 1, MAX_MICROBATCHES, &num_mb, err), st,
                  out);
    if (packing) {
        if (!json_object_get(root, "num_seqs")) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, "num_seqs",
                              "is required with a packing (the batch's sequence count)");
            goto out;
        }
        RP_CHECK_GOTO(rp_jdoc_int(&doc, root, "", "num_seqs", true, 0, 0, INT32_MAX, &num_seqs, err), st, out);
        /* num_seqs is trusted only as far as the text backs it: each sequence is listed
         * once and every id takes at least one byte, so a plan of this batch cannot
         * have more sequences than its text has bytes; what loading and checking it
         * allocates per sequence then stays proportional to the input */
        if ((uint64_t)num_seqs > (uint64_t)len) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, "num_seqs",
                              "is %lld, more than the %zu bytes of the plan text could list (each sequence "
                              "appears once in the packing)",
                              (long long)num_seqs, len);
            goto out;
        }
        if (json_array_size(packing) != (size_t)topo->num_gpus) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, "packing", "has %zu rank%s, but the config has %d GPUs",
                              json_array_size(packing), plural(json_array_size(packing)), topo->num_gpus);
            goto out;
        }
        for (int32_t r = 0; r < topo->num_gpus; r++) {
            char path[PATH_TEXT];
            json_t *rank = json_array_get(packing, (size_t)r);
            snprintf(path, sizeof path, "packing[%d]", r);
            if (!json_is_array(rank)) {
                st = rp_jdoc_fail(&doc, err, RP_EINVAL, path, "must be an array of microbatches, got %s",
                                  rp_jdoc_type_name(rank));
                goto out;
            }
            size_t n = json_array_size(rank);
            if (num_mb == 0) {
                /* rank 0 sets the count when num_microbatches is left out */
                if (n == 0) {
                    st = rp_jdoc_fail(&doc, err, RP_EINVAL, path, "has no microbatch; every rank runs at least one");
                    goto out;
                }
                if (n > MAX_MICROBATCHES) {
                    st = rp_jdoc_fail(&doc, err, RP_ERANGE, path, "has %zu microbatches, more than %d", n,
                                      MAX_MICROBATCHES);
                    goto out;
                }
                num_mb = (int64_t)n;
            } else if (n != (size_t)num_mb) {
                st = rp_jdoc_fail(&doc, err, RP_EINVAL, path,
                                  "has %zu microbatch%s, but %s %lld (every rank runs the same number)", n,
                                  n == 1 ? "" : "es",
                                  json_object_get(root, "num_microbatches") ? "num_microbatches is" : "rank 0 has",
                                  (long long)num_mb);
                goto out;
            }
        }
    } else {
        if (json_object_get(root, "num_seqs")) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, "num_seqs", "is given, but the plan has no packing");
            goto out;
        }
        if (num_mb == 0) num_mb = lim->num_microbatches > 0 ? lim->num_microbatches : 1;
    }
    RP_CHECK_GOTO(rp_plan_new(ctx, cfg, (int32_t)num_mb, &plan, err), st, out);
    if (packing) RP_CHECK_GOTO(read_packing(&doc, packing, plan, (int32_t)num_seqs, err), st, out);
    if (placement) RP_CHECK_GOTO(read_placement(&doc, placement, plan, err), st, out);
    if (extras) RP_CHECK_GOTO(read_extras(&doc, extras, plan, err), st, out);
    if (shares) RP_CHECK_GOTO(read_shares(&doc, shares, plan, err), st, out);
    RP_CHECK_GOTO(read_order(&doc, root, plan, err), st, out);
    const char *balancing = NULL;
    RP_CHECK_GOTO(rp_jdoc_str(&doc, root, "", "per_forward_balancing", false, NULL, &balancing, err), st, out);
    if (balancing && strcmp(balancing, "none") != 0) {
        if (strcmp(balancing, "virtual_experts") != 0) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, "per_forward_balancing",
                              "must be \"none\" or \"virtual_experts\", got \"%.64s\"", balancing);
            goto out;
        }
        RP_CHECK_GOTO(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, err), st, out);
    }
out:
    rp_jdoc_free(&doc);
    if (st != RP_OK) {
        rp_plan_free(plan);
        return st;
    }
    *out = plan;
    return RP_OK;
}

rp_status rp_plan_load(rp_context *ctx, const rp_config *cfg, const char *path, rp_plan **out,
                       rp_error *err)
{
    if (!ctx || !path) return rp_fail(err, RP_EINVAL, "plan: context and path are required");
    char *text;
    size_t len;
    rp_status st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) return st;
    st = rp_plan_parse(ctx, cfg, text, len, path, out, err);
    rp_free(ctx, text);
    return st;
}

/* ---- writing ----------------------------------------------------------------------
 * The document is built as jansson values and laid out by hand: top-level keys one a
 * line, and the big arrays one element (a rank's microbatches, a layer's placement, a
 * lever) a line, each element in jansson's one-line form. */

typedef struct text_out {
    rp_context *ctx;
    char *buf;
    size_t len, cap;
    bool nomem;
} text_out;

static char *reserve(text_out *o, size_t n)
{
    if (o->nomem) return NULL;
    if (o->len + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 4096;
        while (cap < o->len + n + 1) {
            if (cap > SIZE_MAX / 2) {
                o->nomem = true;
                return NULL;
            }
            cap *= 2;
        }
        char *grown = rp_realloc(o->ctx, o->buf, cap);
        if (!grown) {
            o->nomem = true;
            return NULL;
        }
        o->buf = grown;
        o->cap = cap;
    }
    return o->buf + o->len;
}

static void put(text_out *o, const char *s)
{
    size_t n = strlen(s);
    char *p = reserve(o, n);
    if (!p) return;
    memcpy(p, s, n + 1);
    o->len += n;
}

/* One value in jansson's one-line form (", " and ": " separators). */
static void put_json(text_out *o, const json_t *v)
{
    const size_t flags = JSON_REAL_PRECISION(17) | JSON_ENCODE_ANY;
    if (!v) {
        o->nomem = true;
        return;
    }
    size_t n = json_dumpb(v, NULL, 0, flags);
    if (n == 0) {
        o->nomem = true;
        return;
    }
    char *p = reserve(o, n);
    if (!p) return;
    json_dumpb(v, p, n, flags);
    o->len += n;
    o->buf[o->len] = '\0';
}

static void put_member(text_out *o, const char *key, json_t *v, bool last)
{
    put(o, "  \"");
    put(o, key);
    put(o, "\": ");
    put_json(o, v);
    put(o, last ? "\n" : ",\n");
    json_decref(v);
}

/* A top-level array with one element a line; consumes `items`. */
static void put_lines(text_out *o, const char *key, json_t *items, bool last)
{
    put(o, "  \"");
    put(o, key);
    put(o, "\": [");
    if (!items) {
        o->nomem = true;
        return;
    }
    size_t n = json_array_size(items);
    for (size_t i = 0; i < n; i++) {
        put(o, i ? ",\n    " : "\n    ");
        put_json(o, json_array_get(items, i));
    }
    put(o, n ? "\n  ]" : "]");
    put(o, last ? "\n" : ",\n");
    json_decref(items);
}

/* jansson's setters return -1 when they cannot allocate. */
static bool append(json_t *arr, json_t *v)
{
    return arr && json_array_append_new(arr, v) == 0;
}

static json_t *packing_lines(const rp_plan *plan)
{
    json_t *lines = json_array();
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    for (int32_t r = 0; r < G; r++) {
        json_t *rank = json_array();
        for (int32_t m = 0; m < M; m++) {
            int32_t count;
            const int32_t *seqs = rp_plan_microbatch(plan, r, m, &count);
            json_t *mb = json_array();
            for (int32_t k = 0; k < count; k++)
                if (!append(mb, json_integer(seqs[k]))) goto fail_mb;
            if (!append(rank, mb)) goto fail_rank;
            continue;
        fail_mb:
            json_decref(mb);
            goto fail_rank;
        }
        if (!append(lines, rank)) goto fail;
        continue;
    fail_rank:
        json_decref(rank);
        goto fail;
    }
    return lines;
fail:
    json_decref(lines);
    return NULL;
}

static json_t *order_lines(const rp_plan *plan)
{
    json_t *lines = json_array();
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    for (int32_t r = 0; r < G; r++) {
        json_t *rank = json_array();
        for (int32_t k = 0; k < M; k++)
            if (!append(rank, json_integer(rp_plan_microbatch_at(plan, r, k)))) {
                json_decref(rank);
                json_decref(lines);
                return NULL;
            }
        if (!append(lines, rank)) {
            json_decref(lines);
            return NULL;
        }
    }
    return lines;
}

static json_t *placement_lines(const rp_plan *plan)
{
    json_t *lines = json_array();
    int32_t L = rp_plan_num_layers(plan), ep = rp_plan_ep_size(plan);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    for (int32_t l = 0; l < L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        json_t *layer = json_array();
        for (int32_t j = 0; j < ep; j++) {
            json_t *rank = json_array();
            for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++)
                if (!append(rank, json_integer(p2l[s]))) goto fail_rank;
            if (!append(layer, rank)) goto fail_layer;
            continue;
        fail_rank:
            json_decref(rank);
            goto fail_layer;
        }
        if (!append(lines, layer)) goto fail;
        continue;
    fail_layer:
        json_decref(layer);
        goto fail;
    }
    return lines;
fail:
    json_decref(lines);
    return NULL;
}

static json_t *extra_lines(const rp_plan *plan)
{
    json_t *lines = json_array();
    for (int32_t i = 0; i < rp_plan_num_extra_replicas(plan); i++) {
        int32_t mb, l, e, j;
        rp_plan_extra_replica(plan, i, &mb, &l, &e, &j);
        json_t *x = json_pack("{s:i, s:i, s:i, s:i}", "microbatch", mb, "layer", l, "expert", e, "ep_rank", j);
        if (!x || !append(lines, x)) {
            json_decref(lines);
            return NULL;
        }
    }
    return lines;
}

static json_t *share_lines(const rp_plan *plan)
{
    json_t *lines = json_array();
    for (int32_t i = 0; i < rp_plan_num_share_sets(plan); i++) {
        int32_t mb, l, e, count;
        const double *shares = rp_plan_share_set(plan, i, &mb, &l, &e, &count);
        json_t *values = json_array();
        for (int32_t k = 0; k < count; k++)
            if (!append(values, json_real(shares[k]))) {
                json_decref(values);
                values = NULL;
                break;
            }
        json_t *x = values ? json_pack("{s:i, s:i, s:i, s:o}", "microbatch", mb, "layer", l, "expert", e, "shares",
                                       values)
                           : NULL;
        if (!x || !append(lines, x)) {
            json_decref(lines);
            return NULL;
        }
    }
    return lines;
}

rp_status rp_plan_to_json(const rp_plan *plan, char **text, size_t *len, rp_error *err)
{
    if (!plan || !text) return rp_fail(err, RP_EINVAL, "plan: plan and output are required");
    /* JSON has no NaN or infinity: say which share cannot be written */
    for (int32_t i = 0; i < rp_plan_num_share_sets(plan); i++) {
        int32_t mb, l, e, count;
        const double *shares = rp_plan_share_set(plan, i, &mb, &l, &e, &count);
        for (int32_t k = 0; k < count; k++)
            if (!isfinite(shares[k])) {
                rp_fail(err, RP_EINVAL, "plan: mb %d layer %d expert %d share %d is %g, which JSON cannot hold", mb,
                        l, e, k, shares[k]);
                if (err) err->expert = e;
                return RP_EINVAL;
            }
    }
    text_out o = {rp_plan_context(plan), NULL, 0, 0, false};
    bool has_packing = rp_plan_has_packing(plan), has_placement = rp_plan_has_placement(plan);
    bool has_extras = rp_plan_num_extra_replicas(plan) > 0, has_shares = rp_plan_num_share_sets(plan) > 0;
    put(&o, "{\n");
    put_member(&o, "format", json_string(PLAN_FORMAT), false);
    /* version 1 unless the plan needs 2's microbatch order: older readers keep reading it */
    const bool ordered = rp_plan_has_microbatch_order(plan);
    put_member(&o, "version", json_integer(ordered ? 2 : 1), false);
    put_member(&o, "num_gpus", json_integer(rp_plan_num_gpus(plan)), false);
    put_member(&o, "ep_size", json_integer(rp_plan_ep_size(plan)), false);
    put_member(&o, "num_microbatches", json_integer(rp_plan_num_microbatches(plan)), false);
    put_member(&o, "num_layers", json_integer(rp_plan_num_layers(plan)), false);
    bool more = has_packing || ordered || has_placement || has_extras || has_shares;
    bool balanced = rp_plan_balancing(plan) != RP_BALANCING_NONE;
    put_member(&o, "num_experts", json_integer(rp_plan_num_experts(plan)), !more && !balanced);
    if (balanced)
        put_member(&o, "per_forward_balancing", json_string(rp_balancing_name(rp_plan_balancing(plan))), !more);
    if (has_packing) {
        put_member(&o, "num_seqs", json_integer(rp_plan_num_seqs(plan)), false);
        put_lines(&o, "packing", packing_lines(plan), !(ordered || has_placement || has_extras || has_shares));
    }
    if (ordered) put_lines(&o, "microbatch_order", order_lines(plan), !(has_placement || has_extras || has_shares));
    if (has_placement) put_lines(&o, "placement", placement_lines(plan), !(has_extras || has_shares));
    if (has_extras) put_lines(&o, "extra_replicas", extra_lines(plan), !has_shares);
    if (has_shares) put_lines(&o, "shares", share_lines(plan), true);
    put(&o, "}\n");
    if (o.nomem) {
        rp_free(o.ctx, o.buf);
        return rp_fail_nomem(err, "the plan JSON");
    }
    *text = o.buf;
    if (len) *len = o.len;
    return RP_OK;
}

rp_status rp_plan_save(const rp_plan *plan, const char *path, rp_error *err)
{
    if (!plan || !path) return rp_fail(err, RP_EINVAL, "plan: plan and path are required");
    char *text;
    size_t len;
    rp_status st = rp_plan_to_json(plan, &text, &len, err);
    if (st != RP_OK) return st;
    FILE *f = fopen(path, "wb");
    if (!f) {
        st = rp_fail(err, RP_EIO, "%s: cannot open for writing: %s", path, strerror(errno));
    } else {
        bool written = fwrite(text, 1, len, f) == len;
        int saved = errno;
        if (fclose(f) != 0 && written) {
            written = false;
            saved = errno;
        }
        if (!written) st = rp_fail(err, RP_EIO, "%s: write error: %s", path, strerror(saved));
    }
    rp_text_free(rp_plan_context(plan), text);
    return st;
}
