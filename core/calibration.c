/* calibration.json: the hardware figures a device run measured, one entry per model
 * shape (docs/calibration.md). Read as strictly as a config: every entry is checked,
 * unknown keys and out-of-range values are errors naming file:line:column. */
#include "calibration.h"

#include "jsonx.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAX_CURVE_POINTS 4096
#define MAX_SHAPES_LISTED 16

static const char *const top_keys[] = {
    "format", "version", "device", "torch", "cuda", "created", "shapes", "comment", "links", NULL,
};
static const char *const links_keys[] = {"backend", "ranks", "bytes_per_s", "latency_us", NULL};
static const char *const shape_keys[] = {
    "hidden_size", "expert_ffn_size", "num_heads", "num_kv_heads", "head_dim", "peak_flops",
    "gemm_efficiency", "gemm_kernel", "attention_efficiency", "attention_kernel",
    "dense_efficiency", "backward", "hbm_bytes_per_s", "layer_fixed_us", "gemm_tile_rows",
    "grouped_gemm_efficiency", "wgrad_efficiency", NULL,
};
static const char *const backward_keys[] = {"attention", "projections", "experts", "experts_dgrad", NULL};

const char *calib_shape_key(char *buf, size_t size, const rp_model *m)
{
    snprintf(buf, size, "d%d_f%d_h%d_kv%d_dh%d", m->hidden_size, m->expert_ffn_size, m->num_heads,
             m->num_kv_heads, m->head_dim);
    return buf;
}

void calib_shape_free(rp_context *ctx, calib_shape *s)
{
    if (!s) return;
    rp_free(ctx, s->gemm);
    rp_free(ctx, s->attention);
    rp_free(ctx, s->grouped);
    rp_free(ctx, s->wgrad);
    s->gemm = s->attention = s->grouped = s->wgrad = NULL;
}

/* [[x, efficiency], ...]: x > 0 strictly increasing, efficiency in (0, 1]; `what` names x. */
static rp_status read_curve(rp_context *ctx, const rp_jdoc *doc, json_t *obj, const char *path,
                            const char *key, const char *what, rp_eff_point **out, int32_t *count,
                            rp_error *err)
{
    char cp[256];
    json_t *arr;
    rp_status st = rp_jdoc_arr(doc, obj, path, key, true, &arr, err);
    if (st != RP_OK) return st;
    rp_jpath_key(cp, sizeof cp, path, key);
    size_t n = json_array_size(arr);
    if (n == 0) return rp_jdoc_fail(doc, err, RP_EINVAL, cp, "must have at least one [%s, efficiency] point", what);
    if (n > MAX_CURVE_POINTS)
        return rp_jdoc_fail(doc, err, RP_ERANGE, cp, "has %zu points, more than the %d supported", n,
                            MAX_CURVE_POINTS);
    rp_eff_point *pts = rp_calloc(ctx, n, sizeof *pts);
    if (!pts) return rp_fail_nomem(err, "a calibration curve");
    for (size_t i = 0; i < n; i++) {
        char ip[288], xp[300], ep[300];
        rp_jpath_index(ip, sizeof ip, cp, i);
        rp_jpath_index(xp, sizeof xp, ip, 0);
        rp_jpath_index(ep, sizeof ep, ip, 1);
        json_t *point = json_array_get(arr, i);
        if (!json_is_array(point) || json_array_size(point) != 2 || !json_is_number(json_array_get(point, 0)) ||
            !json_is_number(json_array_get(point, 1))) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, ip, "must be a [%s, efficiency] pair of numbers", what);
            goto fail;
        }
        double x = json_number_value(json_array_get(point, 0));
        double eff = json_number_value(json_array_get(point, 1));
        if (!(x > 0) || x > DBL_MAX) {
            st = rp_jdoc_fail(doc, err, RP_ERANGE, xp, "(%s) must be > 0 and finite, got %g", what, x);
            goto fail;
        }
        if (i > 0 && !(x > pts[i - 1].tokens)) {
            st = rp_jdoc_fail(doc, err, RP_EINVAL, xp,
                              "(%s) must be greater than the previous point's %g, got %g: points are sorted, "
                              "strictly increasing",
                              what, pts[i - 1].tokens, x);
            goto fail;
        }
        if (!(eff > 0 && eff <= 1)) {
            st = rp_jdoc_fail(doc, err, RP_ERANGE, ep, "(efficiency) must be in (0, 1], got %g", eff);
            goto fail;
        }
        pts[i].tokens = x;
        pts[i].efficiency = eff;
    }
    *out = pts;
    *count = (int32_t)n;
    return RP_OK;
fail:
    rp_free(ctx, pts);
    return st;
}

/* One entry, checked whole; its shape fields must spell its key. */
static rp_status read_shape(rp_context *ctx, const rp_jdoc *doc, const char *key, json_t *obj,
                            calib_shape *s, rp_error *err)
{
    char path[256], kp[300];
    rp_jpath_key(path, sizeof path, "shapes", key);
    rp_status st;
    const char *kernel;
    json_t *bwd;
    rp_model m = {0};
    int64_t v[5];
    static const char *const dims[] = {"hidden_size", "expert_ffn_size", "num_heads", "num_kv_heads", "head_dim"};
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, obj, path, shape_keys, err), st, out);
    for (int i = 0; i < 5; i++)
        RP_CHECK_GOTO(rp_jdoc_int(doc, obj, path, dims[i], true, 0, 1, INT32_MAX, &v[i], err), st, out);
    m.hidden_size = (int32_t)v[0];
    m.expert_ffn_size = (int32_t)v[1];
    m.num_heads = (int32_t)v[2];
    m.num_kv_heads = (int32_t)v[3];
    m.head_dim = (int32_t)v[4];
    char spelled[128];
    if (strcmp(calib_shape_key(spelled, sizeof spelled, &m), key) != 0) {
        st = rp_jdoc_fail(doc, err, RP_EINVAL, path, "has the shape %s, not the %s its key says", spelled, key);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, path, "peak_flops", true, 0, DBL_MIN, DBL_MAX, &s->peak_flops, err), st, out);
    RP_CHECK_GOTO(read_curve(ctx, doc, obj, path, "gemm_efficiency", "tokens", &s->gemm, &s->num_gemm, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(doc, obj, path, "gemm_kernel", true, NULL, &kernel, err), st, out);
    RP_CHECK_GOTO(read_curve(ctx, doc, obj, path, "attention_efficiency", "sequence length", &s->attention,
                             &s->num_attention, err),
                  st, out);
    RP_CHECK_GOTO(rp_jdoc_str(doc, obj, path, "attention_kernel", true, NULL, &kernel, err), st, out);
    if (strcmp(kernel, "math_reference") == 0) {
        /* an unfused kernel's figure would price attention several times too high */
        rp_jpath_key(kp, sizeof kp, path, "attention_kernel");
        st = rp_jdoc_fail(doc, err, RP_EINVAL, kp, "is math_reference, an unfused kernel: its efficiency is not "
                                                   "the trainer's; calibrate where a fused kernel runs");
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, path, "dense_efficiency", true, 0, DBL_MIN, 1.0, &s->dense_efficiency, err),
                  st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(doc, obj, path, "backward", true, &bwd, err), st, out);
    rp_jpath_key(kp, sizeof kp, path, "backward");
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, bwd, kp, backward_keys, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, bwd, kp, "attention", true, 0, 0, 1e3, &s->backward_attention, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, bwd, kp, "projections", true, 0, 0, 1e3, &s->backward_projections, err), st,
                  out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, bwd, kp, "experts", true, 0, 0, 1e3, &s->backward_experts, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, bwd, kp, "experts_dgrad", false, -1.0, 0, 1e3, &s->backward_experts_dgrad, err),
                  st, out);
    int64_t tile;
    RP_CHECK_GOTO(rp_jdoc_int(doc, obj, path, "gemm_tile_rows", false, 0, 1, 1 << 16, &tile, err), st, out);
    s->gemm_tile_rows = (int32_t)tile;
    if (json_object_get(obj, "grouped_gemm_efficiency"))
        RP_CHECK_GOTO(read_curve(ctx, doc, obj, path, "grouped_gemm_efficiency", "rows", &s->grouped, &s->num_grouped,
                                 err),
                      st, out);
    if (json_object_get(obj, "wgrad_efficiency"))
        RP_CHECK_GOTO(read_curve(ctx, doc, obj, path, "wgrad_efficiency", "rows", &s->wgrad, &s->num_wgrad, err), st,
                      out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, path, "hbm_bytes_per_s", true, 0, DBL_MIN, DBL_MAX, &s->hbm_bytes_per_s, err),
                  st, out);
    double fixed_us;
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, path, "layer_fixed_us", true, 0, 0, 1e9, &fixed_us, err), st, out);
    s->layer_fixed_s = fixed_us * 1e-6;
out:
    if (st != RP_OK) calib_shape_free(ctx, s);
    return st;
}

/* "links": {"backend": "gloo", "ranks": N >= 2, "bytes_per_s": > 0, "latency_us": >= 0}. */
static rp_status read_links(const rp_jdoc *doc, json_t *root, calib_links *l, rp_error *err)
{
    json_t *obj;
    const char *backend;
    int64_t ranks;
    double us;
    rp_status st = rp_jdoc_obj(doc, root, "", "links", false, &obj, err);
    if (st != RP_OK || !obj) return st;
    RP_CHECK_GOTO(rp_jdoc_check_keys(doc, obj, "links", links_keys, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(doc, obj, "links", "backend", true, NULL, &backend, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_int(doc, obj, "links", "ranks", true, 0, 2, INT32_MAX, &ranks, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, "links", "bytes_per_s", true, 0, DBL_MIN, DBL_MAX, &l->bytes_per_s, err), st,
                  out);
    RP_CHECK_GOTO(rp_jdoc_num(doc, obj, "links", "latency_us", true, 0, 0, 1e9, &us, err), st, out);
    l->latency_s = us * 1e-6;
    l->present = true;
out:
    return st;
}

/* "a, b, c" (the first MAX_SHAPES_LISTED, then "and N more") into buf. */
static void list_shapes(json_t *shapes, char *buf, size_t size)
{
    const char *key;
    json_t *value;
    size_t used = 0, i = 0, n = json_object_size(shapes);
    buf[0] = '\0';
    if (n == 0) {
        snprintf(buf, size, "none");
        return;
    }
    json_object_foreach(shapes, key, value) {
        (void)value;
        if (i == MAX_SHAPES_LISTED) {
            snprintf(buf + used, size - used, ", and %zu more", n - i);
            return;
        }
        int w = snprintf(buf + used, size - used, "%s%s", i ? ", " : "", key);
        if (w < 0 || (size_t)w >= size - used) return;
        used += (size_t)w;
        i++;
    }
}

rp_status calib_read(rp_context *ctx, const char *path, const char *shape_key, calib_shape *out,
                     calib_links *links, rp_error *err)
{
    char *text = NULL;
    size_t len;
    rp_jdoc doc = {0};
    calib_shape found = {0}, other = {0};
    calib_links l = {0};
    bool have = false;
    rp_status st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) return st;
    RP_CHECK_GOTO(rp_jdoc_parse(&doc, text, len, path, err), st, out);
    json_t *root = doc.root, *shapes, *value;
    const char *s, *key;
    int64_t version;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&doc, root, "", top_keys, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(&doc, root, "", "format", true, NULL, &s, err), st, out);
    if (strcmp(s, RP_CALIBRATION_FORMAT) != 0) {
        st = rp_jdoc_fail(&doc, err, RP_EFORMAT, "format", "is \"%s\", not \"%s\": not a calibration file", s,
                          RP_CALIBRATION_FORMAT);
        goto out;
    }
    RP_CHECK_GOTO(rp_jdoc_int(&doc, root, "", "version", true, 0, INT32_MIN, INT32_MAX, &version, err), st, out);
    if (version != RP_CALIBRATION_VERSION) {
        st = rp_jdoc_fail(&doc, err, RP_EFORMAT, "version", "is %lld; this RoutePack reads version %d",
                          (long long)version, RP_CALIBRATION_VERSION);
        goto out;
    }
    static const char *const strings[] = {"device", "torch", "cuda", "created", "comment"};
    for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++)
        RP_CHECK_GOTO(rp_jdoc_str(&doc, root, "", strings[i], false, NULL, &s, err), st, out);
    RP_CHECK_GOTO(read_links(&doc, root, &l, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&doc, root, "", "shapes", true, &shapes, err), st, out);
    if (!json_is_object(shapes)) {
        st = rp_jdoc_fail(&doc, err, RP_EINVAL, "shapes", "must be an object keyed by model shape, got %s",
                          rp_jdoc_type_name(shapes));
        goto out;
    }
    json_object_foreach(shapes, key, value) {
        calib_shape *dst = strcmp(key, shape_key) == 0 ? &found : &other;
        char sp[256];
        if (!json_is_object(value)) {
            st = rp_jdoc_fail(&doc, err, RP_EINVAL, rp_jpath_key(sp, sizeof sp, "shapes", key),
                              "must be an object, got %s", rp_jdoc_type_name(value));
            goto out;
        }
        RP_CHECK_GOTO(read_shape(ctx, &doc, key, value, dst, err), st, out);
        if (dst == &found)
            have = true;
        else
            calib_shape_free(ctx, &other);
    }
    if (!have) {
        char list[1024];
        list_shapes(shapes, list, sizeof list);
        st = rp_fail(err, RP_EINVAL, "%s: no calibration for the model's shape %s; the file has: %s (calibrate this "
                                     "shape with scripts/device-check.sh or python -m routepack.calibrate)",
                     path, shape_key, list);
        goto out;
    }
    *out = found;
    if (links) *links = l;
    have = false; /* owned by the caller now */
out:
    if (have || st != RP_OK) calib_shape_free(ctx, &found);
    calib_shape_free(ctx, &other);
    rp_jdoc_free(&doc);
    rp_free(ctx, text);
    return st;
}

static bool explicit_key(json_t *hardware, const char *key)
{
    return hardware && json_object_get(hardware, key) != NULL;
}

void calib_apply_links(const calib_links *l, json_t *topology, rp_topology *t)
{
    if (!l->present) return;
    if (!explicit_key(topology, "nvlink_bytes_per_s")) t->nvlink_bytes_per_s = l->bytes_per_s;
    if (!explicit_key(topology, "nvlink_latency_us")) t->nvlink_latency_s = l->latency_s;
}

rp_status calib_apply(rp_context *ctx, const char *path, const char *shape_key, calib_shape *s,
                      json_t *hardware, rp_hardware *h, calib_stores stores, rp_error *err)
{
    rp_eff_point **gemm_store = stores.gemm, **attention_store = stores.attention;
    if (!(fabs(s->peak_flops - h->peak_flops) <= 1e-9 * h->peak_flops))
        return rp_fail(err, RP_EINVAL,
                       "%s: shape %s was measured against peak_flops %g, but the config's hardware.peak_flops is "
                       "%g: its efficiencies are fractions of the peak they were measured against; calibrate with "
                       "this config, or set hardware.peak_flops to %g",
                       path, shape_key, s->peak_flops, h->peak_flops, s->peak_flops);
    if (!explicit_key(hardware, "gemm_efficiency")) {
        rp_free(ctx, *gemm_store);
        *gemm_store = s->gemm;
        h->gemm_efficiency = s->gemm;
        h->num_gemm_efficiency = s->num_gemm;
        s->gemm = NULL;
    }
    if (!explicit_key(hardware, "attention_efficiency")) {
        rp_free(ctx, *attention_store);
        *attention_store = s->attention;
        h->attention_efficiency = s->attention;
        h->num_attention_efficiency = s->num_attention;
        s->attention = NULL;
    }
    if (s->grouped && !explicit_key(hardware, "grouped_gemm_efficiency")) {
        rp_free(ctx, *stores.grouped);
        *stores.grouped = s->grouped;
        h->grouped_gemm_efficiency = s->grouped;
        h->num_grouped_gemm_efficiency = s->num_grouped;
        s->grouped = NULL;
    }
    if (s->wgrad && !explicit_key(hardware, "wgrad_efficiency")) {
        rp_free(ctx, *stores.wgrad);
        *stores.wgrad = s->wgrad;
        h->wgrad_efficiency = s->wgrad;
        h->num_wgrad_efficiency = s->num_wgrad;
        s->wgrad = NULL;
    }
    if (s->gemm_tile_rows > 0 && !explicit_key(hardware, "gemm_tile_rows")) h->gemm_tile_rows = s->gemm_tile_rows;
    if (!explicit_key(hardware, "dense_efficiency")) h->dense_efficiency = s->dense_efficiency;
    if (!explicit_key(hardware, "hbm_bytes_per_s")) h->hbm_bytes_per_s = s->hbm_bytes_per_s;
    if (!explicit_key(hardware, "layer_fixed_us")) h->layer_fixed_s = s->layer_fixed_s;
    if (!explicit_key(hardware, "backward_multiplier")) {
        json_t *bwd = hardware ? json_object_get(hardware, "backward") : NULL;
        if (!(bwd && json_object_get(bwd, "attention"))) h->backward.attention = s->backward_attention;
        if (!(bwd && json_object_get(bwd, "projections"))) h->backward.projections = s->backward_projections;
        if (!(bwd && json_object_get(bwd, "experts"))) h->backward.experts = s->backward_experts;
        if (s->backward_experts_dgrad >= 0 && !(bwd && json_object_get(bwd, "experts_dgrad")))
            h->backward_experts_dgrad = s->backward_experts_dgrad;
    }
    return RP_OK;
}
