/* Readers for the real data that calibrates the generator: per-expert routing counts
 * (the schema of OLMoE's routing analysis, docs/gen.md) and a length column of a CSV
 * request trace. */
#include "gen_internal.h"
#include "jsonx.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#define JPATH 512

/* ---- counts file ------------------------------------------------------------------- */

typedef struct counts_reader {
    rp_context *ctx;
    rp_jdoc doc;
    const char *path;
    rp_error *err;
} counts_reader;

/* "a, b, c" of an object's keys, for messages. */
static void list_keys(json_t *obj, char *buf, size_t size)
{
    size_t n = 0;
    const char *key;
    json_t *value;
    buf[0] = '\0';
    json_object_foreach(obj, key, value) {
        (void)value;
        int w = snprintf(buf + n, size - n, "%s%s", n ? ", " : "", key);
        if (w < 0 || (size_t)w >= size - n) break;
        n += (size_t)w;
    }
}

/* A list of `n` non-negative integers at `path`; their sum into *sum. */
static rp_status read_count_list(counts_reader *rd, json_t *arr, const char *path, int32_t n,
                                 double *out, int64_t *sum)
{
    if (!json_is_array(arr))
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, path, "must be a list of %d counts, got %s",
                            n, rp_jdoc_type_name(arr));
    if ((int64_t)json_array_size(arr) != n)
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, path,
                            "has %zu counts, but the model has %d experts", json_array_size(arr), n);
    int64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        char ip[JPATH];
        int64_t v;
        rp_status st = rp_jdoc_int_value(&rd->doc, json_array_get(arr, (size_t)i),
                                         rp_jpath_index(ip, sizeof ip, path, (size_t)i), 0,
                                         INT64_MAX / 2, &v, rd->err);
        if (st != RP_OK) return st;
        if (rp_add_overflow(total, v, &total))
            return rp_jdoc_fail(&rd->doc, rd->err, RP_ERANGE, path, "sum overflows 64 bits");
        out[i] = (double)v;
    }
    *sum = total;
    return RP_OK;
}

/* crosslayer_topk_pairs["a->b"]: a list of [e_a, e_b, count]; repeated pairs add up. */
static rp_status read_pairs(counts_reader *rd, json_t *arr, const char *path, int32_t n,
                            double *out)
{
    if (!json_is_array(arr))
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, path,
                            "must be a list of [expert_a, expert_b, count], got %s", rp_jdoc_type_name(arr));
    double total = 0.0;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        char ip[JPATH], vp[JPATH];
        json_t *triple = json_array_get(arr, i);
        rp_jpath_index(ip, sizeof ip, path, i);
        if (!json_is_array(triple) || json_array_size(triple) != 3)
            return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, ip,
                                "must be [expert_a, expert_b, count]");
        int64_t a, b, c;
        rp_status st;
        if ((st = rp_jdoc_int_value(&rd->doc, json_array_get(triple, 0), rp_jpath_index(vp, sizeof vp, ip, 0),
                                    0, n - 1, &a, rd->err)) != RP_OK ||
            (st = rp_jdoc_int_value(&rd->doc, json_array_get(triple, 1), rp_jpath_index(vp, sizeof vp, ip, 1),
                                    0, n - 1, &b, rd->err)) != RP_OK ||
            (st = rp_jdoc_int_value(&rd->doc, json_array_get(triple, 2), rp_jpath_index(vp, sizeof vp, ip, 2),
                                    0, INT64_MAX / 2, &c, rd->err)) != RP_OK)
            return st;
        out[a * n + b] += (double)c;
        total += (double)c;
    }
    if (!(total > 0.0))
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, path, "has no counts");
    return RP_OK;
}

static rp_status read_domain(counts_reader *rd, json_t *dom, const char *dpath, const gen_source *src,
                             gen_src_domain *out)
{
    rp_status st;
    char kp[JPATH], lp[JPATH];
    int32_t ne = src->num_experts;
    if (!json_is_object(dom))
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, dpath, "must be an object, got %s",
                            rp_jdoc_type_name(dom));
    int64_t tokens;
    st = rp_jdoc_int(&rd->doc, dom, dpath, "tokens", true, 0, 1, INT64_MAX / 2, &tokens, rd->err);
    if (st != RP_OK) return st;
    int64_t expected;
    if (rp_mul_overflow(tokens, src->top_k, &expected))
        return rp_jdoc_fail(&rd->doc, rd->err, RP_ERANGE, rp_jpath_key(kp, sizeof kp, dpath, "tokens"),
                            "times top_k overflows 64 bits");
    json_t *topk;
    st = rp_jdoc_obj(&rd->doc, dom, dpath, "topk_counts", true, &topk, rd->err);
    if (st != RP_OK) return st;
    rp_jpath_key(kp, sizeof kp, dpath, "topk_counts");

    size_t share_n = (size_t)src->num_recorded * (size_t)ne;
    out->share = rp_calloc(rd->ctx, share_n, sizeof(double));
    out->pairs = rp_calloc(rd->ctx, (size_t)src->num_recorded, sizeof(double *));
    if (!out->share || !out->pairs) return rp_fail_nomem(rd->err, "expert counts");
    for (int32_t r = 0; r < src->num_recorded; r++) {
        char key[24];
        snprintf(key, sizeof key, "%d", src->recorded[r]);
        rp_jpath_key(lp, sizeof lp, kp, key);
        json_t *list = json_object_get(topk, key);
        if (!list)
            return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, kp,
                                "has no counts for recorded layer %s", key);
        int64_t sum = 0;
        double *row = out->share + (size_t)r * (size_t)ne;
        st = read_count_list(rd, list, lp, ne, row, &sum);
        if (st != RP_OK) return st;
        if (sum != expected)
            return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, lp,
                                "sums to %" PRId64 ", but tokens x top_k is %" PRId64 " x %d = %" PRId64,
                                sum, tokens, src->top_k, expected);
        for (int32_t e = 0; e < ne; e++) row[e] /= (double)sum;
    }

    json_t *pairs;
    st = rp_jdoc_obj(&rd->doc, dom, dpath, "crosslayer_topk_pairs", false, &pairs, rd->err);
    if (st != RP_OK || !pairs) return st;
    rp_jpath_key(kp, sizeof kp, dpath, "crosslayer_topk_pairs");
    for (int32_t r = 0; r + 1 < src->num_recorded; r++) {
        char key[48];
        snprintf(key, sizeof key, "%d->%d", src->recorded[r], src->recorded[r + 1]);
        json_t *list = json_object_get(pairs, key);
        if (!list) continue;
        out->pairs[r] = rp_calloc(rd->ctx, (size_t)ne * (size_t)ne, sizeof(double));
        if (!out->pairs[r]) return rp_fail_nomem(rd->err, "cross-layer pair counts");
        st = read_pairs(rd, list, rp_jpath_key(lp, sizeof lp, kp, key), ne, out->pairs[r]);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

static rp_status read_model_shape(counts_reader *rd, json_t *model, const char *mpath, gen_source *src)
{
    rp_status st;
    int64_t v;
    st = rp_jdoc_int(&rd->doc, model, mpath, "num_experts", true, 0, 1, GEN_MAX_EXPERTS, &v, rd->err);
    if (st != RP_OK) return st;
    src->num_experts = (int32_t)v;
    st = rp_jdoc_int(&rd->doc, model, mpath, "top_k", true, 0, 1, src->num_experts, &v, rd->err);
    if (st != RP_OK) return st;
    src->top_k = (int32_t)v;
    st = rp_jdoc_int(&rd->doc, model, mpath, "num_moe_layers", true, 0, 1, GEN_MAX_LAYERS, &v, rd->err);
    if (st != RP_OK) return st;
    src->num_layers = (int32_t)v;
    json_t *rec;
    st = rp_jdoc_arr(&rd->doc, model, mpath, "layers_recorded", true, &rec, rd->err);
    if (st != RP_OK) return st;
    char rp[JPATH], ip[JPATH];
    rp_jpath_key(rp, sizeof rp, mpath, "layers_recorded");
    size_t n = json_array_size(rec);
    if (n == 0) return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, rp, "is empty");
    if (n > (size_t)src->num_layers)
        return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, rp, "lists %zu layers, but the model has %d",
                            n, src->num_layers);
    src->recorded = rp_alloc(rd->ctx, n * sizeof(int32_t));
    if (!src->recorded) return rp_fail_nomem(rd->err, "recorded layers");
    src->num_recorded = (int32_t)n;
    for (size_t i = 0; i < n; i++) {
        st = rp_jdoc_int_value(&rd->doc, json_array_get(rec, i), rp_jpath_index(ip, sizeof ip, rp, i), 0,
                               src->num_layers - 1, &v, rd->err);
        if (st != RP_OK) return st;
        if (i > 0 && v <= src->recorded[i - 1])
            return rp_jdoc_fail(&rd->doc, rd->err, RP_EFORMAT, ip,
                                "must be greater than the layer before it (%d), got %" PRId64,
                                src->recorded[i - 1], v);
        src->recorded[i] = (int32_t)v;
    }
    return RP_OK;
}

rp_status gen_read_counts(rp_context *ctx, const char *path, const char *model_id,
                          const char *const *domain_names, const double *domain_weights,
                          int32_t num_domains, gen_source *out, gen_counts_miss *miss,
                          int32_t *miss_index, rp_error *err)
{
    counts_reader rd = {ctx, {0}, path, err};
    gen_source src;
    memset(&src, 0, sizeof src);
    char *text = NULL;
    size_t len = 0;
    rp_status st;
    char names[RP_ERROR_TEXT / 2];
    *miss = GEN_MISS_NONE;
    *miss_index = -1;

    st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) {
        *miss = GEN_MISS_FILE;
        return st;
    }
    RP_CHECK_GOTO(rp_jdoc_parse(&rd.doc, text, len, path, err), st, out);
    if (!json_is_object(rd.doc.root)) {
        st = rp_jdoc_fail(&rd.doc, err, RP_EFORMAT, "", "the document must be an object, got %s",
                          rp_jdoc_type_name(rd.doc.root));
        goto out;
    }
    json_t *models;
    RP_CHECK_GOTO(rp_jdoc_obj(&rd.doc, rd.doc.root, "", "models", true, &models, err), st, out);
    if (json_object_size(models) == 0) {
        st = rp_jdoc_fail(&rd.doc, err, RP_EFORMAT, "models", "is empty");
        goto out;
    }
    list_keys(models, names, sizeof names);
    if (!model_id) {
        if (json_object_size(models) != 1) {
            *miss = GEN_MISS_MODEL;
            st = rp_fail(err, RP_EINVAL, "%s has %zu models; name one (models: %s)", path,
                         json_object_size(models), names);
            goto out;
        }
        model_id = json_object_iter_key(json_object_iter(models));
    }
    json_t *model = json_object_get(models, model_id);
    if (!model) {
        *miss = GEN_MISS_MODEL;
        st = rp_fail(err, RP_EINVAL, "model '%s' is not in %s (models: %s)", model_id, path, names);
        goto out;
    }
    char mpath[JPATH], dpath[JPATH], dsp[JPATH];
    rp_jpath_key(mpath, sizeof mpath, "models", model_id);
    if (!json_is_object(model)) {
        st = rp_jdoc_fail(&rd.doc, err, RP_EFORMAT, mpath, "must be an object, got %s",
                          rp_jdoc_type_name(model));
        goto out;
    }
    RP_CHECK_GOTO(read_model_shape(&rd, model, mpath, &src), st, out);
    json_t *domains;
    RP_CHECK_GOTO(rp_jdoc_obj(&rd.doc, model, mpath, "domains", true, &domains, err), st, out);
    rp_jpath_key(dsp, sizeof dsp, mpath, "domains");
    list_keys(domains, names, sizeof names);
    int32_t nd = domain_names ? num_domains : (int32_t)json_object_size(domains);
    if (nd < 1 || nd > GEN_MAX_DOMAINS) {
        st = rp_jdoc_fail(&rd.doc, err, RP_EFORMAT, dsp, "has %d domains; 1 to %d are supported", nd,
                          GEN_MAX_DOMAINS);
        goto out;
    }
    src.domains = rp_calloc(ctx, (size_t)nd, sizeof(gen_src_domain));
    if (!src.domains) {
        st = rp_fail_nomem(err, "domains");
        goto out;
    }
    src.num_domains = nd;
    void *it = json_object_iter(domains);
    for (int32_t d = 0; d < nd; d++) {
        const char *name;
        if (domain_names) {
            name = domain_names[d];
        } else {
            name = json_object_iter_key(it);
            it = json_object_iter_next(domains, it);
        }
        json_t *dom = json_object_get(domains, name);
        if (!dom) {
            *miss = GEN_MISS_DOMAIN;
            *miss_index = d;
            st = rp_fail(err, RP_EINVAL, "domain '%s' is not in model '%s' of %s (domains: %s)", name,
                         model_id, path, names);
            goto out;
        }
        src.domains[d].name = rp_strdup(ctx, name);
        if (!src.domains[d].name) {
            st = rp_fail_nomem(err, "a domain name");
            goto out;
        }
        src.domains[d].weight = domain_weights && domain_names ? domain_weights[d] : 1.0 / nd;
        RP_CHECK_GOTO(read_domain(&rd, dom, rp_jpath_key(dpath, sizeof dpath, dsp, name), &src,
                                  &src.domains[d]),
                      st, out);
    }
    src.path = rp_strdup(ctx, path);
    if (!src.path) {
        st = rp_fail_nomem(err, "a path");
        goto out;
    }
    *out = src;
    memset(&src, 0, sizeof src);
out:
    gen_source_free(ctx, &src);
    rp_jdoc_free(&rd.doc);
    rp_free(ctx, text);
    return st;
}

void gen_source_free(rp_context *ctx, gen_source *src)
{
    if (!src) return;
    for (int32_t d = 0; d < src->num_domains; d++) {
        gen_src_domain *dom = &src->domains[d];
        rp_free(ctx, dom->name);
        rp_free(ctx, dom->share);
        if (dom->pairs)
            for (int32_t r = 0; r + 1 < src->num_recorded; r++) rp_free(ctx, dom->pairs[r]);
        rp_free(ctx, dom->pairs);
    }
    rp_free(ctx, src->domains);
    rp_free(ctx, src->recorded);
    rp_free(ctx, src->path);
    memset(src, 0, sizeof *src);
}

/* ---- CSV column -------------------------------------------------------------------- */

/* A cursor over one CSV record (RFC 4180: fields may be quoted, quotes doubled inside;
 * CR LF or LF line ends). */
typedef struct csv_cursor {
    const char *s;
    size_t len, pos;
    int64_t line;       /* 1-based line of pos */
    size_t line_start;  /* offset where that line starts */
} csv_cursor;

/* Read the next field into [*begin, *end) (quotes kept for quoted fields); returns
 * the character that ended it: ',', '\n' or 0 at the end of the text. */
static char csv_field(csv_cursor *c, size_t *begin, size_t *end)
{
    *begin = c->pos;
    bool quoted = c->pos < c->len && c->s[c->pos] == '"';
    if (quoted) c->pos++;
    while (c->pos < c->len) {
        char ch = c->s[c->pos];
        if (quoted) {
            if (ch == '"') {
                if (c->pos + 1 < c->len && c->s[c->pos + 1] == '"') {
                    c->pos += 2;
                    continue;
                }
                quoted = false;
            } else if (ch == '\n') {
                c->line++;
                c->line_start = c->pos + 1;
            }
            c->pos++;
            continue;
        }
        if (ch == ',' || ch == '\n') {
            *end = c->pos;
            if (*end > *begin && c->s[*end - 1] == '\r') (*end)--;
            c->pos++;
            if (ch == '\n') {
                c->line++;
                c->line_start = c->pos;
            }
            return ch;
        }
        c->pos++;
    }
    *end = c->pos;
    if (*end > *begin && c->s[*end - 1] == '\r') (*end)--;
    return 0;
}

/* Field text without surrounding quotes or blanks, for comparing and showing. */
static void field_text(const char *s, size_t b, size_t e, char *out, size_t size)
{
    while (b < e && (s[b] == ' ' || s[b] == '\t')) b++;
    while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) e--;
    if (e - b >= 2 && s[b] == '"' && s[e - 1] == '"') b++, e--;
    size_t n = 0;
    for (size_t i = b; i < e && n + 1 < size; i++) {
        if (s[i] == '"' && i + 1 < e && s[i + 1] == '"') i++;
        out[n++] = (unsigned char)s[i] < 0x20 ? '?' : s[i];
    }
    out[n] = '\0';
}

rp_status gen_read_csv_column(rp_context *ctx, const char *path, const char *column,
                              int32_t **values, int32_t *count, bool *missing_column,
                              rp_error *err)
{
    char *text = NULL;
    size_t len = 0;
    int32_t *vals = NULL;
    size_t cap = 0, n = 0;
    *missing_column = false;
    rp_status st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) return st;

    csv_cursor c = {text, len, 0, 1, 0};
    /* header */
    int32_t want = -1, num_fields = 0;
    char cols[RP_ERROR_TEXT / 2];
    size_t cols_n = 0;
    cols[0] = '\0';
    for (;;) {
        size_t b, e;
        char end = csv_field(&c, &b, &e);
        char name[128];
        field_text(text, b, e, name, sizeof name);
        if (num_fields == 0 && (unsigned char)name[0] == 0xEF && (unsigned char)name[1] == 0xBB &&
            (unsigned char)name[2] == 0xBF)
            memmove(name, name + 3, strlen(name + 3) + 1); /* UTF-8 byte order mark */
        if (want < 0 && strcmp(name, column) == 0) want = num_fields;
        if (cols_n < sizeof cols) {
            int w = snprintf(cols + cols_n, sizeof cols - cols_n, "%s%s", num_fields ? ", " : "", name);
            if (w > 0) cols_n += (size_t)w;
        }
        num_fields++;
        if (end != ',') break;
    }
    if (want < 0) {
        *missing_column = true;
        st = rp_fail(err, RP_EINVAL, "%s has no column '%s' (columns: %s)", path, column, cols);
        goto out;
    }
    while (c.pos < c.len) {
        int64_t line = c.line;
        /* blank lines (and a final line end) carry no record */
        size_t p = c.pos;
        while (p < c.len && (text[p] == '\r' || text[p] == ' ' || text[p] == '\t')) p++;
        if (p >= c.len || text[p] == '\n') {
            c.pos = p < c.len ? p + 1 : p;
            if (p < c.len) {
                c.line++;
                c.line_start = c.pos;
            }
            continue;
        }
        int32_t field = 0;
        bool got = false;
        char end;
        do {
            size_t b, e;
            size_t col_at = c.pos - c.line_start + 1;
            end = csv_field(&c, &b, &e);
            if (field == want) {
                char shown[64];
                field_text(text, b, e, shown, sizeof shown);
                int64_t v = 0;
                bool ok = shown[0] != '\0';
                for (const char *q = shown; *q && ok; q++) {
                    if (*q < '0' || *q > '9' || v > INT32_MAX / 10) ok = false;
                    else v = v * 10 + (*q - '0');
                }
                if (!ok || v > INT32_MAX) {
                    st = rp_fail(err, RP_EFORMAT, "%s:%" PRId64 ":%zu: column %s: '%s' is not a "
                                 "non-negative integer below 2^31", path, line, col_at, column, shown);
                    if (err) err->line = (int32_t)line, err->column = (int32_t)col_at;
                    goto out;
                }
                if (n == cap) {
                    size_t ncap = cap ? cap * 2 : 1024;
                    if (ncap > (size_t)INT32_MAX) {
                        st = rp_fail(err, RP_ERANGE, "%s: more than 2^31 rows", path);
                        goto out;
                    }
                    int32_t *nv = rp_realloc(ctx, vals, ncap * sizeof(int32_t));
                    if (!nv) {
                        st = rp_fail_nomem(err, path);
                        goto out;
                    }
                    vals = nv;
                    cap = ncap;
                }
                vals[n++] = (int32_t)v;
                got = true;
            }
            field++;
        } while (end == ',');
        if (!got || field != num_fields) {
            st = rp_fail(err, RP_EFORMAT, "%s:%" PRId64 ": has %d fields, but the header has %d", path,
                         line, field, num_fields);
            if (err) err->line = (int32_t)line;
            goto out;
        }
    }
    if (n == 0) {
        st = rp_fail(err, RP_EFORMAT, "%s has a header but no rows", path);
        goto out;
    }
    *values = vals;
    *count = (int32_t)n;
    vals = NULL;
out:
    rp_free(ctx, vals);
    rp_free(ctx, text);
    return st;
}
