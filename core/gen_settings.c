/* Generator settings: one strict JSON document (docs/gen.md) read key by key, with the
 * data files it names loaded and checked; every error points at the settings file's
 * line and column, or at the data file's own. */
#include "gen_internal.h"
#include "jsonx.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define JPATH 256

/* Defaults that are not read from data (each is justified in docs/gen.md). */
#define DEFAULT_CONCENTRATION 8.0
#define DEFAULT_LOCALITY 0.1
#define DEFAULT_LAYER_CORRELATION 0.5
#define DEFAULT_DRIFT 0.02
#define DEFAULT_DRIFT_REVERSION 0.0
#define DEFAULT_SPLIT_JITTER 0.1
#define DEFAULT_RESPONSE_MEDIAN 2000.0
#define DEFAULT_RESPONSE_SIGMA 1.0
#define DEFAULT_RESPONSE_CAP 20480

typedef struct parser {
    rp_context *ctx;
    rp_jdoc doc;
    const char *base_dir;
    rp_error *err;
} parser;

/* The key readers (jsonx.h's) on the parser's document. */
static rp_status get_i32(parser *p, json_t *obj, const char *path, const char *key, bool required,
                         int64_t dflt, int64_t min, int64_t max, int32_t *out)
{
    return rp_jdoc_i32(&p->doc, obj, path, key, required, dflt, min, max, out, p->err);
}

static rp_status get_positive(parser *p, json_t *obj, const char *path, const char *key,
                              bool required, double dflt, double max, double *out)
{
    return rp_jdoc_positive(&p->doc, obj, path, key, required, dflt, max, out, p->err);
}

/* A data file path: relative ones resolve against the settings file's directory. */
static rp_status resolve(parser *p, const char *path, const char *file, char **out)
{
    size_t need = strlen(file) + 1;
    bool relative = file[0] != '/' && p->base_dir && p->base_dir[0];
    if (relative) need += strlen(p->base_dir) + 1;
    char *s = rp_alloc(p->ctx, need);
    if (!s) return rp_fail_nomem(p->err, path);
    if (relative) snprintf(s, need, "%s/%s", p->base_dir, file);
    else memcpy(s, file, need);
    *out = s;
    return RP_OK;
}

/* ---- lengths ------------------------------------------------------------------------- */

/* One length distribution: exactly one of csv (+ column), lognormal, constant; the
 * response also takes its cap here. */
static rp_status parse_dist(parser *p, json_t *obj, const char *path, bool is_response,
                            gen_lengths *out)
{
    static const char *const prompt_keys[] = {"csv", "column", "lognormal", "constant", NULL};
    static const char *const response_keys[] = {"csv", "column", "lognormal", "constant", "cap", NULL};
    char kp[JPATH];
    rp_status st = rp_jdoc_check_keys(&p->doc, obj, path, is_response ? response_keys : prompt_keys, p->err);
    if (st != RP_OK) return st;
    json_t *csv = json_object_get(obj, "csv"), *logn = json_object_get(obj, "lognormal"),
           *constant = json_object_get(obj, "constant");
    int kinds = (csv != NULL) + (logn != NULL) + (constant != NULL);
    if (kinds != 1)
        return rp_jdoc_fail(&p->doc, p->err, RP_EINVAL, path,
                            "needs exactly one of 'csv', 'lognormal' or 'constant', got %d", kinds);
    if (json_object_get(obj, "column") && !csv)
        return rp_jdoc_fail(&p->doc, p->err, RP_EINVAL, rp_jpath_key(kp, sizeof kp, path, "column"),
                            "only applies to 'csv'");
    memset(out, 0, sizeof *out);
    out->scale = 1.0;
    if (constant) {
        out->kind = GEN_LEN_CONSTANT;
        st = get_i32(p, obj, path, "constant", true, 0, 1, GEN_MAX_LEN, &out->constant);
    } else if (logn) {
        static const char *const keys[] = {"median", "sigma", NULL};
        out->kind = GEN_LEN_LOGNORMAL;
        rp_jpath_key(kp, sizeof kp, path, "lognormal");
        if ((st = rp_jdoc_check_keys(&p->doc, logn, kp, keys, p->err)) != RP_OK ||
            (st = get_positive(p, logn, kp, "median", true, 0, GEN_MAX_LEN, &out->median)) != RP_OK ||
            (st = rp_jdoc_num(&p->doc, logn, kp, "sigma", true, 0, 0, 10, &out->sigma, p->err)) != RP_OK)
            return st;
    } else {
        const char *file, *column;
        char cp[JPATH];
        out->kind = GEN_LEN_EMPIRICAL;
        if ((st = rp_jdoc_str(&p->doc, obj, path, "csv", true, NULL, &file, p->err)) != RP_OK ||
            (st = rp_jdoc_str(&p->doc, obj, path, "column", false,
                              is_response ? "GeneratedTokens" : "ContextTokens", &column, p->err)) != RP_OK)
            return st;
        char *resolved;
        if ((st = resolve(p, path, file, &resolved)) != RP_OK) return st;
        bool missing_column;
        rp_error inner;
        rp_error_clear(&inner);
        st = gen_read_csv_column(p->ctx, resolved, column, &out->values, &out->num_values,
                                 &missing_column, &inner);
        rp_free(p->ctx, resolved);
        if (st != RP_OK) {
            /* A missing file or column is the settings' fault: point there. A bad row is
             * the data's: keep its own position. */
            if (missing_column)
                return rp_jdoc_fail(&p->doc, p->err, st, rp_jpath_key(cp, sizeof cp, path, "column"),
                                    "%s", inner.text);
            if (st == RP_EIO)
                return rp_jdoc_fail(&p->doc, p->err, st, rp_jpath_key(cp, sizeof cp, path, "csv"), "%s",
                                    inner.text);
            if (p->err) *p->err = inner;
            return st;
        }
    }
    if (st != RP_OK) return st;
    out->cap = GEN_MAX_LEN;
    if (is_response)
        st = get_i32(p, obj, path, "cap", false, DEFAULT_RESPONSE_CAP, 1, GEN_MAX_LEN, &out->cap);
    return st;
}

static rp_status parse_lengths(parser *p, json_t *root, gen_settings *s)
{
    static const char *const keys[] = {"prompt", "prompt_scale", "prompt_cap", "response", NULL};
    json_t *lengths, *prompt, *response;
    rp_status st;
    if ((st = rp_jdoc_obj(&p->doc, root, "", "lengths", true, &lengths, p->err)) != RP_OK ||
        (st = rp_jdoc_check_keys(&p->doc, lengths, "lengths", keys, p->err)) != RP_OK ||
        (st = rp_jdoc_obj(&p->doc, lengths, "lengths", "prompt", true, &prompt, p->err)) != RP_OK ||
        (st = parse_dist(p, prompt, "lengths.prompt", false, &s->prompt)) != RP_OK ||
        (st = get_positive(p, lengths, "lengths", "prompt_scale", false, 1.0, 1e6, &s->prompt.scale)) != RP_OK ||
        (st = get_i32(p, lengths, "lengths", "prompt_cap", false, GEN_MAX_LEN, 1, GEN_MAX_LEN,
                      &s->prompt.cap)) != RP_OK ||
        (st = rp_jdoc_obj(&p->doc, lengths, "lengths", "response", false, &response, p->err)) != RP_OK)
        return st;
    if (response) return parse_dist(p, response, "lengths.response", true, &s->response);
    memset(&s->response, 0, sizeof s->response);
    s->response.kind = GEN_LEN_LOGNORMAL;
    s->response.median = DEFAULT_RESPONSE_MEDIAN;
    s->response.sigma = DEFAULT_RESPONSE_SIGMA;
    s->response.scale = 1.0;
    s->response.cap = DEFAULT_RESPONSE_CAP;
    return RP_OK;
}

/* ---- experts ------------------------------------------------------------------------- */

static rp_status parse_experts(parser *p, json_t *root, gen_settings *s)
{
    static const char *const keys[] = {"counts_file", "model", "domains", "concentration", "locality",
                                       "layer_correlation", "drift", "drift_reversion", "split_jitter",
                                       "share_prompt_routing", NULL};
    json_t *ex, *domains;
    const char *file, *model_id;
    rp_status st;
    char kp[JPATH];
    if ((st = rp_jdoc_obj(&p->doc, root, "", "experts", true, &ex, p->err)) != RP_OK ||
        (st = rp_jdoc_check_keys(&p->doc, ex, "experts", keys, p->err)) != RP_OK ||
        (st = rp_jdoc_str(&p->doc, ex, "experts", "counts_file", true, NULL, &file, p->err)) != RP_OK ||
        (st = rp_jdoc_str(&p->doc, ex, "experts", "model", false, NULL, &model_id, p->err)) != RP_OK ||
        (st = rp_jdoc_obj(&p->doc, ex, "experts", "domains", false, &domains, p->err)) != RP_OK ||
        (st = get_positive(p, ex, "experts", "concentration", false, DEFAULT_CONCENTRATION, 1e9,
                           &s->concentration)) != RP_OK ||
        (st = rp_jdoc_num(&p->doc, ex, "experts", "locality", false, DEFAULT_LOCALITY, 0, 1, &s->locality,
                          p->err)) != RP_OK ||
        (st = rp_jdoc_num(&p->doc, ex, "experts", "layer_correlation", false, DEFAULT_LAYER_CORRELATION, 0, 1,
                          &s->layer_correlation, p->err)) != RP_OK ||
        (st = rp_jdoc_num(&p->doc, ex, "experts", "drift", false, DEFAULT_DRIFT, 0, 10, &s->drift,
                          p->err)) != RP_OK ||
        (st = rp_jdoc_num(&p->doc, ex, "experts", "drift_reversion", false, DEFAULT_DRIFT_REVERSION, 0, 1,
                          &s->drift_reversion, p->err)) != RP_OK ||
        (st = rp_jdoc_num(&p->doc, ex, "experts", "split_jitter", false, DEFAULT_SPLIT_JITTER, 0, 2,
                          &s->split_jitter, p->err)) != RP_OK ||
        (st = rp_jdoc_bool(&p->doc, ex, "experts", "share_prompt_routing", false, true,
                           &s->share_prompt_routing, p->err)) != RP_OK)
        return st;

    /* the mixture: {"domain": weight, ...} */
    const char *names[GEN_MAX_DOMAINS];
    double weights[GEN_MAX_DOMAINS];
    int32_t nd = 0;
    if (domains) {
        const char *name;
        json_t *w;
        double total = 0;
        if (json_object_size(domains) == 0)
            return rp_jdoc_fail(&p->doc, p->err, RP_EINVAL, "experts.domains",
                                "is empty; name at least one domain with a weight");
        if (json_object_size(domains) > GEN_MAX_DOMAINS)
            return rp_jdoc_fail(&p->doc, p->err, RP_ERANGE, "experts.domains", "has more than %d domains",
                                GEN_MAX_DOMAINS);
        json_object_foreach(domains, name, w) {
            rp_jpath_key(kp, sizeof kp, "experts.domains", name);
            if ((st = rp_jdoc_num_value(&p->doc, w, kp, 0, 1e12, &weights[nd], p->err)) != RP_OK) return st;
            names[nd] = name;
            total += weights[nd++];
        }
        if (!(total > 0))
            return rp_jdoc_fail(&p->doc, p->err, RP_EINVAL, "experts.domains",
                                "weights are all 0; at least one must be > 0");
        for (int32_t d = 0; d < nd; d++) weights[d] /= total;
    }

    char *resolved;
    if ((st = resolve(p, "experts.counts_file", file, &resolved)) != RP_OK) return st;
    gen_counts_miss miss;
    int32_t miss_index;
    rp_error inner;
    rp_error_clear(&inner);
    st = gen_read_counts(p->ctx, resolved, model_id, domains ? names : NULL, domains ? weights : NULL, nd,
                         &s->source, &miss, &miss_index, &inner);
    rp_free(p->ctx, resolved);
    if (st == RP_OK) return RP_OK;
    switch (miss) {
    case GEN_MISS_FILE:
        return rp_jdoc_fail(&p->doc, p->err, st, "experts.counts_file", "%s", inner.text);
    case GEN_MISS_MODEL:
        return rp_jdoc_fail(&p->doc, p->err, st, model_id ? "experts.model" : "experts", "%s", inner.text);
    case GEN_MISS_DOMAIN:
        return rp_jdoc_fail(&p->doc, p->err, st,
                            rp_jpath_key(kp, sizeof kp, "experts.domains", names[miss_index]), "%s",
                            inner.text);
    default:
        if (p->err) *p->err = inner;
        return st;
    }
}

/* ---- the whole document -------------------------------------------------------------- */

static rp_status parse_root(parser *p, gen_settings *s)
{
    static const char *const keys[] = {"comment", "seed", "steps", "num_prompts", "group_size", "id_width",
                                       "threads", "model", "experts", "lengths", NULL};
    static const char *const model_keys[] = {"num_layers", "num_experts", "top_k", NULL};
    json_t *root = p->doc.root, *model;
    rp_status st;
    int64_t seed;
    const char *comment;
    if ((st = rp_jdoc_check_keys(&p->doc, root, "", keys, p->err)) != RP_OK ||
        (st = rp_jdoc_str(&p->doc, root, "", "comment", false, "", &comment, p->err)) != RP_OK ||
        (st = rp_jdoc_int(&p->doc, root, "", "seed", false, 0, 0, INT64_MAX, &seed, p->err)) != RP_OK ||
        (st = get_i32(p, root, "", "steps", false, 1, 1, GEN_MAX_STEPS, &s->steps)) != RP_OK ||
        (st = get_i32(p, root, "", "num_prompts", true, 0, 1, GEN_MAX_PROMPTS, &s->num_prompts)) != RP_OK ||
        (st = get_i32(p, root, "", "group_size", false, 1, 1, GEN_MAX_GROUP, &s->group_size)) != RP_OK ||
        (st = get_i32(p, root, "", "threads", false, 0, 0, GEN_MAX_THREADS, &s->threads)) != RP_OK)
        return st;
    s->seed = (uint64_t)seed;
    if ((int64_t)s->num_prompts * s->group_size > GEN_MAX_SEQS)
        return rp_jdoc_fail(&p->doc, p->err, RP_ERANGE, "group_size",
                            "gives num_prompts x group_size = %d x %d sequences, more than %d",
                            s->num_prompts, s->group_size, GEN_MAX_SEQS);

    if ((st = parse_experts(p, root, s)) != RP_OK) return st;

    /* the shape to generate; the counts file's model by default */
    if ((st = rp_jdoc_obj(&p->doc, root, "", "model", false, &model, p->err)) != RP_OK) return st;
    if (model && (st = rp_jdoc_check_keys(&p->doc, model, "model", model_keys, p->err)) != RP_OK) return st;
    if ((st = get_i32(p, model, "model", "num_layers", false, s->source.num_layers, 1, GEN_MAX_LAYERS,
                      &s->num_layers)) != RP_OK ||
        (st = get_i32(p, model, "model", "num_experts", false, s->source.num_experts, 1, GEN_MAX_EXPERTS,
                      &s->num_experts)) != RP_OK)
        return st;
    int32_t max_k = s->num_experts < GEN_MAX_TOP_K ? s->num_experts : GEN_MAX_TOP_K;
    int32_t dflt_k = s->source.top_k < max_k ? s->source.top_k : max_k;
    if ((st = get_i32(p, model, "model", "top_k", false, dflt_k, 1, max_k, &s->top_k)) != RP_OK) return st;
    if (s->layer_correlation > 0 && s->num_experts > GEN_MAX_CORR_EXPERTS) {
        for (int32_t d = 0; d < s->source.num_domains; d++)
            for (int32_t r = 0; r + 1 < s->source.num_recorded; r++)
                if (s->source.domains[d].pairs[r])
                    return rp_jdoc_fail(&p->doc, p->err, RP_ERANGE, "experts.layer_correlation",
                                        "needs model.num_experts <= %d (dense coupling tables), got %d "
                                        "experts; set it to 0", GEN_MAX_CORR_EXPERTS, s->num_experts);
    }

    int64_t width, narrowest = s->num_experts <= 256 ? 1 : s->num_experts <= 65536 ? 2 : 4;
    if ((st = rp_jdoc_int(&p->doc, root, "", "id_width", false, narrowest, 1, 4, &width, p->err)) != RP_OK)
        return st;
    if (width == 3)
        return rp_jdoc_fail(&p->doc, p->err, RP_EINVAL, "id_width", "must be 1, 2 or 4 bytes, got 3");
    if (rp_id_width_capacity((rp_id_width)width) < s->num_experts)
        return rp_jdoc_fail(&p->doc, p->err, RP_ERANGE, "id_width",
                            "of %d byte(s) holds expert ids below %lld, but the model has %d experts",
                            (int)width, (long long)rp_id_width_capacity((rp_id_width)width), s->num_experts);
    s->width = (rp_id_width)width;

    return parse_lengths(p, root, s);
}

rp_status gen_settings_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                             const char *base_dir, gen_settings *out, rp_error *err)
{
    parser p = {ctx, {0}, base_dir, err};
    gen_settings s;
    memset(&s, 0, sizeof s);
    rp_status st = rp_jdoc_parse(&p.doc, text, len, name ? name : "<settings>", err);
    if (st == RP_OK) st = parse_root(&p, &s);
    rp_jdoc_free(&p.doc);
    if (st != RP_OK) {
        gen_settings_free(ctx, &s);
        return st;
    }
    *out = s;
    return RP_OK;
}

void gen_settings_free(rp_context *ctx, gen_settings *s)
{
    if (!s) return;
    gen_lengths_free(ctx, &s->prompt);
    gen_lengths_free(ctx, &s->response);
    gen_source_free(ctx, &s->source);
}
