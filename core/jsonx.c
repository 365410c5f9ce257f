/* Strict JSON reading on top of jansson: typed getters, unknown-key checks, and
 * file:line:column positions of values found by re-scanning the source text. */
#include "jsonx.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PATH_MAX_TEXT 256

static const char *doc_name(const rp_jdoc *doc)
{
    return doc && doc->name ? doc->name : "<inline>";
}

rp_status rp_jdoc_parse(rp_jdoc *doc, const char *text, size_t len, const char *name,
                        rp_error *err)
{
    memset(doc, 0, sizeof *doc);
    doc->name = name;
    doc->text = text;
    doc->len = len;
    json_error_t jerr;
    /* Duplicate keys are rejected: with them, which value counts is a guess. Integers
     * beyond int64 and reals beyond double are syntax errors in jansson already. */
    doc->root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc->root) {
        int32_t line = jerr.line > 0 ? jerr.line : 1;
        int32_t column = jerr.column > 0 ? jerr.column : 1;
        rp_fail(err, RP_EFORMAT, "%s:%d:%d: %s", doc_name(doc), line, column, jerr.text);
        if (err) {
            err->line = line;
            err->column = column;
        }
        return RP_EFORMAT;
    }
    return RP_OK;
}

void rp_jdoc_free(rp_jdoc *doc)
{
    if (!doc) return;
    json_decref(doc->root);
    doc->root = NULL;
}

/* ---- locating a path in the source text --------------------------------------------
 * A small scanner, independent of jansson: it only has to find where a value starts.
 * It never reads past doc->len and stops quietly on text that is not JSON. */

typedef struct scanner {
    const char *s;
    size_t len;
    size_t pos;
} scanner;

static void skip_ws(scanner *sc)
{
    while (sc->pos < sc->len) {
        char c = sc->s[sc->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        sc->pos++;
    }
}

static bool at(const scanner *sc, char c)
{
    return sc->pos < sc->len && sc->s[sc->pos] == c;
}

/* At an opening quote: move past the closing quote. */
static bool skip_string(scanner *sc)
{
    if (!at(sc, '"')) return false;
    sc->pos++;
    while (sc->pos < sc->len) {
        char c = sc->s[sc->pos++];
        if (c == '\\') {
            if (sc->pos >= sc->len) return false;
            sc->pos++;
        } else if (c == '"') {
            return true;
        }
    }
    return false;
}

/* Move past one value of any kind. Containers are skipped by bracket depth (strings
 * skipped whole, so braces inside them do not count): no recursion on deep input. */
static bool skip_value(scanner *sc)
{
    skip_ws(sc);
    if (sc->pos >= sc->len) return false;
    char c = sc->s[sc->pos];
    if (c == '"') return skip_string(sc);
    if (c == '{' || c == '[') {
        size_t depth = 0;
        while (sc->pos < sc->len) {
            c = sc->s[sc->pos];
            if (c == '"') {
                if (!skip_string(sc)) return false;
                continue;
            }
            sc->pos++;
            if (c == '{' || c == '[') depth++;
            else if (c == '}' || c == ']') {
                if (--depth == 0) return true;
            }
        }
        return false;
    }
    /* number or literal */
    size_t start = sc->pos;
    while (sc->pos < sc->len) {
        c = sc->s[sc->pos];
        if (c == ',' || c == '}' || c == ']' || c == ' ' || c == '\t' || c == '\n' || c == '\r')
            break;
        sc->pos++;
    }
    return sc->pos > start;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool read_hex4(scanner *sc, uint32_t *out)
{
    if (sc->pos + 4 > sc->len) return false;
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_value(sc->s[sc->pos + (size_t)i]);
        if (h < 0) return false;
        v = v * 16 + (uint32_t)h;
    }
    sc->pos += 4;
    *out = v;
    return true;
}

static size_t utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* At an opening quote: decode the string and compare it with key[0..key_len); move
 * past the closing quote either way. */
static bool string_equals(scanner *sc, const char *key, size_t key_len, bool *equal)
{
    if (!at(sc, '"')) return false;
    sc->pos++;
    size_t matched = 0;
    bool same = true;
    while (sc->pos < sc->len) {
        char c = sc->s[sc->pos++];
        char bytes[4];
        size_t n = 1;
        if (c == '"') {
            *equal = same && matched == key_len;
            return true;
        }
        if (c != '\\') {
            bytes[0] = c;
        } else {
            if (sc->pos >= sc->len) return false;
            char e = sc->s[sc->pos++];
            switch (e) {
            case 'b': bytes[0] = '\b'; break;
            case 'f': bytes[0] = '\f'; break;
            case 'n': bytes[0] = '\n'; break;
            case 'r': bytes[0] = '\r'; break;
            case 't': bytes[0] = '\t'; break;
            case 'u': {
                uint32_t cp, low;
                if (!read_hex4(sc, &cp)) return false;
                if (cp >= 0xD800 && cp < 0xDC00 && sc->pos + 1 < sc->len &&
                    sc->s[sc->pos] == '\\' && sc->s[sc->pos + 1] == 'u') {
                    size_t save = sc->pos;
                    sc->pos += 2;
                    if (read_hex4(sc, &low) && low >= 0xDC00 && low < 0xE000)
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                    else
                        sc->pos = save;
                }
                n = utf8_encode(cp, bytes);
                break;
            }
            default: bytes[0] = e; break; /* \" \\ \/ */
            }
        }
        for (size_t i = 0; i < n && same; i++) {
            if (matched < key_len && key[matched] == bytes[i]) matched++;
            else same = false;
        }
    }
    return false;
}

/* Offset of the value at `path`, or of the deepest enclosing value found. With
 * `key_offset`, also the offset of the last key's opening quote when that key exists
 * (otherwise the same as the value offset). */
static size_t locate_offset(const rp_jdoc *doc, const char *path, size_t *key_offset)
{
    scanner sc = {doc->text, doc->text ? doc->len : 0, 0};
    skip_ws(&sc);
    size_t found = sc.pos < sc.len ? sc.pos : 0;
    size_t found_key = found;
    const char *p = path ? path : "";
    while (*p) {
        if (*p == '.') {
            p++;
            continue;
        }
        if (*p == '[') {
            p++;
            uint64_t index = 0;
            bool digits = false;
            while (*p >= '0' && *p <= '9') {
                if (index < UINT64_MAX / 16) index = index * 10 + (uint64_t)(*p - '0');
                digits = true;
                p++;
            }
            if (!digits || *p != ']') break;
            p++;
            if (!at(&sc, '[')) break;
            sc.pos++;
            skip_ws(&sc);
            if (at(&sc, ']')) break;
            bool ok = true;
            for (uint64_t i = 0; i < index && ok; i++) {
                ok = skip_value(&sc);
                skip_ws(&sc);
                if (ok && at(&sc, ',')) {
                    sc.pos++;
                    skip_ws(&sc);
                } else {
                    ok = false;
                }
            }
            if (!ok || sc.pos >= sc.len) break;
            found = found_key = sc.pos;
            continue;
        }
        const char *key = p;
        while (*p && *p != '.' && *p != '[') p++;
        size_t key_len = (size_t)(p - key);
        if (!at(&sc, '{')) break;
        sc.pos++;
        bool hit = false;
        for (;;) {
            skip_ws(&sc);
            if (!at(&sc, '"')) break;
            size_t key_start = sc.pos;
            bool equal = false;
            if (!string_equals(&sc, key, key_len, &equal)) break;
            skip_ws(&sc);
            if (!at(&sc, ':')) break;
            sc.pos++;
            skip_ws(&sc);
            if (equal) {
                if (sc.pos >= sc.len) break;
                found = sc.pos;
                found_key = key_start;
                hit = true;
                break;
            }
            if (!skip_value(&sc)) break;
            skip_ws(&sc);
            if (!at(&sc, ',')) break;
            sc.pos++;
        }
        if (!hit) break;
    }
    if (key_offset) *key_offset = found_key;
    return found;
}

/* Lines count '\n'; columns count characters (UTF-8 lead bytes), as jansson does. */
static void offset_position(const rp_jdoc *doc, size_t offset, int32_t *line, int32_t *column)
{
    int32_t l = 1, c = 1;
    for (size_t i = 0; i < offset && i < doc->len; i++) {
        unsigned char b = (unsigned char)doc->text[i];
        if (b == '\n') {
            if (l < INT32_MAX) l++;
            c = 1;
        } else if ((b & 0xC0) != 0x80 && c < INT32_MAX) {
            c++;
        }
    }
    *line = l;
    *column = c;
}

void rp_jdoc_locate(const rp_jdoc *doc, const char *path, int32_t *line, int32_t *column)
{
    offset_position(doc, locate_offset(doc, path, NULL), line, column);
}

static rp_status fail_at(const rp_jdoc *doc, rp_error *err, rp_status status, int32_t line,
                         int32_t column, const char *path, const char *fmt, va_list ap)
{
    char msg[RP_ERROR_TEXT];
    vsnprintf(msg, sizeof msg, fmt, ap);
    const char *p = path ? path : "";
    rp_fail(err, status, "%s:%d:%d: %s%s%s", doc_name(doc), line, column, p, *p ? " " : "", msg);
    if (err) {
        err->line = line;
        err->column = column;
    }
    return status;
}

rp_status rp_jdoc_fail(const rp_jdoc *doc, rp_error *err, rp_status status, const char *path,
                       const char *fmt, ...)
{
    int32_t line, column;
    rp_jdoc_locate(doc, path, &line, &column);
    va_list ap;
    va_start(ap, fmt);
    fail_at(doc, err, status, line, column, path, fmt, ap);
    va_end(ap);
    return status;
}

/* As rp_jdoc_fail, but pointing at the key of `path` rather than its value. */
static rp_status fail_at_key(const rp_jdoc *doc, rp_error *err, rp_status status,
                             const char *path, const char *fmt, ...) RP_PRINTF(5, 6);
static rp_status fail_at_key(const rp_jdoc *doc, rp_error *err, rp_status status,
                             const char *path, const char *fmt, ...)
{
    size_t key_offset;
    int32_t line, column;
    locate_offset(doc, path, &key_offset);
    offset_position(doc, key_offset, &line, &column);
    va_list ap;
    va_start(ap, fmt);
    fail_at(doc, err, status, line, column, "", fmt, ap);
    va_end(ap);
    return status;
}

/* ---- paths --------------------------------------------------------------------------- */

const char *rp_jpath_key(char *buf, size_t size, const char *path, const char *key)
{
    const char *p = path ? path : "";
    snprintf(buf, size, "%s%s%s", p, *p ? "." : "", key);
    return buf;
}

const char *rp_jpath_index(char *buf, size_t size, const char *path, size_t index)
{
    snprintf(buf, size, "%s[%zu]", path ? path : "", index);
    return buf;
}

/* ---- unknown keys --------------------------------------------------------------------- */

/* A key as it may be shown in a message: control bytes replaced, length capped. */
static void printable_key(char *out, size_t size, const char *key)
{
    size_t n = 0;
    for (const char *k = key; *k && n + 4 < size; k++)
        out[n++] = (unsigned char)*k < 0x20 || *k == 0x7F ? '?' : *k;
    if (key[n] && n + 4 >= size) {
        memcpy(out + n, "...", 3);
        n += 3;
    }
    out[n] = '\0';
}

const char *rp_jdoc_type_name(const json_t *v)
{
    if (!v) return "missing"; /* json_object_get of an absent key */
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    }
    return "a value";
}

rp_status rp_jdoc_check_keys(const rp_jdoc *doc, json_t *obj, const char *path,
                             const char *const *allowed, rp_error *err)
{
    const char *p = path ? path : "";
    if (!json_is_object(obj)) {
        if (*p) return rp_jdoc_fail(doc, err, RP_EINVAL, p, "must be an object, got %s", rp_jdoc_type_name(obj));
        return rp_jdoc_fail(doc, err, RP_EINVAL, p, "the document must be an object, got %s",
                            rp_jdoc_type_name(obj));
    }
    const char *key;
    json_t *value;
    json_object_foreach(obj, key, value) {
        bool known = false;
        for (size_t i = 0; allowed[i] && !known; i++) known = strcmp(key, allowed[i]) == 0;
        if (known) continue;

        /* Close means a typo, not another word: at most a third of the key's length
         * (at least one edit), and not a replacement of every character. Ties go to
         * the longer common prefix. */
        size_t key_len = strlen(key);
        size_t limit = key_len / 3 > 1 ? key_len / 3 : 1;
        const char *best = NULL;
        size_t best_distance = SIZE_MAX, best_prefix = 0;
        for (size_t i = 0; allowed[i]; i++) {
            size_t d = rp_edit_distance(key, allowed[i]);
            size_t cand_len = strlen(allowed[i]);
            if (d > limit || d >= (key_len > cand_len ? key_len : cand_len)) continue;
            size_t prefix = 0;
            while (key[prefix] && key[prefix] == allowed[i][prefix]) prefix++;
            if (d < best_distance || (d == best_distance && prefix > best_prefix)) {
                best_distance = d;
                best_prefix = prefix;
                best = allowed[i];
            }
        }
        char shown[RP_EDIT_DISTANCE_MAX_LEN + 8];
        printable_key(shown, sizeof shown, key);
        char where[PATH_MAX_TEXT + 2];
        snprintf(where, sizeof where, "%s%s", p, *p ? ": " : "");
        char key_path[PATH_MAX_TEXT];
        rp_jpath_key(key_path, sizeof key_path, p, key);
        if (best)
            return fail_at_key(doc, err, RP_EINVAL, key_path,
                               "%sunknown key '%s' (did you mean '%s'?)", where, shown, best);
        char list[RP_ERROR_TEXT / 2];
        size_t n = 0;
        list[0] = '\0';
        for (size_t i = 0; allowed[i] && n < sizeof list; i++) {
            int w = snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "", allowed[i]);
            if (w < 0) break;
            n += (size_t)w;
        }
        return fail_at_key(doc, err, RP_EINVAL, key_path, "%sunknown key '%s' (allowed: %s)",
                           where, shown, list);
    }
    return RP_OK;
}

/* ---- typed getters -------------------------------------------------------------------- */

/* Look up obj[key]; a missing required key fails at the enclosing object. */
static rp_status member(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                        bool required, json_t **out, char *key_path, size_t key_path_size,
                        rp_error *err)
{
    rp_jpath_key(key_path, key_path_size, path, key);
    *out = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    if (!*out && required) return rp_jdoc_fail(doc, err, RP_EINVAL, key_path, "is required");
    return RP_OK;
}

rp_status rp_jdoc_int_value(const rp_jdoc *doc, json_t *v, const char *path, int64_t min,
                            int64_t max, int64_t *out, rp_error *err)
{
    int64_t value;
    if (json_is_integer(v)) {
        value = json_integer_value(v);
    } else if (json_is_real(v)) {
        /* 1e6 or 4.0 are integers written as reals; 2.5 is not. */
        double r = json_real_value(v);
        if (r != floor(r))
            return rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an integer, got %.17g", r);
        if (!(r >= -9223372036854775808.0 && r < 9223372036854775808.0))
            return rp_jdoc_fail(doc, err, RP_ERANGE, path, "is out of the 64-bit integer range, got %g", r);
        value = (int64_t)r;
    } else {
        return rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be an integer, got %s", rp_jdoc_type_name(v));
    }
    if (value < min)
        return rp_jdoc_fail(doc, err, RP_ERANGE, path, "must be >= %" PRId64 ", got %" PRId64, min, value);
    if (value > max)
        return rp_jdoc_fail(doc, err, RP_ERANGE, path, "must be <= %" PRId64 ", got %" PRId64, max, value);
    *out = value;
    return RP_OK;
}

rp_status rp_jdoc_num_value(const rp_jdoc *doc, json_t *v, const char *path, double min,
                            double max, double *out, rp_error *err)
{
    if (!json_is_number(v))
        return rp_jdoc_fail(doc, err, RP_EINVAL, path, "must be a number, got %s", rp_jdoc_type_name(v));
    double value = json_number_value(v);
    if (!isfinite(value)) /* jansson rejects overflow, but be sure */
        return rp_jdoc_fail(doc, err, RP_ERANGE, path, "must be finite, got %g", value);
    if (value < min) return rp_jdoc_fail(doc, err, RP_ERANGE, path, "must be >= %g, got %g", min, value);
    if (value > max) return rp_jdoc_fail(doc, err, RP_ERANGE, path, "must be <= %g, got %g", max, value);
    *out = value;
    return RP_OK;
}

rp_status rp_jdoc_int(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, int64_t dflt, int64_t min, int64_t max, int64_t *out,
                      rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (!v) {
        *out = dflt;
        return RP_OK;
    }
    return rp_jdoc_int_value(doc, v, kp, min, max, out, err);
}

rp_status rp_jdoc_num(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, double dflt, double min, double max, double *out,
                      rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (!v) {
        *out = dflt;
        return RP_OK;
    }
    return rp_jdoc_num_value(doc, v, kp, min, max, out, err);
}

rp_status rp_jdoc_i32(const rp_jdoc *doc, json_t *obj, const char *path, const char *key, bool required,
                      int64_t dflt, int64_t min, int64_t max, int32_t *out, rp_error *err)
{
    int64_t v;
    rp_status st = rp_jdoc_int(doc, obj, path, key, required, dflt, min, max, &v, err);
    if (st == RP_OK) *out = (int32_t)v;
    return st;
}

rp_status rp_jdoc_positive(const rp_jdoc *doc, json_t *obj, const char *path, const char *key, bool required,
                           double dflt, double max, double *out, rp_error *err)
{
    rp_status st = rp_jdoc_num(doc, obj, path, key, required, dflt, -DBL_MAX, max, out, err);
    if (st != RP_OK) return st;
    if (*out > 0) return RP_OK;
    char kp[PATH_MAX_TEXT];
    return rp_jdoc_fail(doc, err, RP_ERANGE, rp_jpath_key(kp, sizeof kp, path, key), "must be > 0, got %g", *out);
}

rp_status rp_jdoc_bool(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                       bool required, bool dflt, bool *out, rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (!v) {
        *out = dflt;
        return RP_OK;
    }
    if (!json_is_boolean(v))
        return rp_jdoc_fail(doc, err, RP_EINVAL, kp, "must be true or false, got %s", rp_jdoc_type_name(v));
    *out = json_is_true(v);
    return RP_OK;
}

rp_status rp_jdoc_str(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, const char *dflt, const char **out, rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (!v) {
        *out = dflt;
        return RP_OK;
    }
    if (!json_is_string(v))
        return rp_jdoc_fail(doc, err, RP_EINVAL, kp, "must be a string, got %s", rp_jdoc_type_name(v));
    *out = json_string_value(v);
    return RP_OK;
}

rp_status rp_jdoc_choice(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                         const char *const *names, int dflt, int *out, rp_error *err)
{
    const char *s;
    rp_status st = rp_jdoc_str(doc, obj, path, key, false, NULL, &s, err);
    if (st != RP_OK) return st;
    if (!s) {
        *out = dflt;
        return RP_OK;
    }
    char list[256] = "", kp[256];
    for (int i = 0; names[i]; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = i;
            return RP_OK;
        }
        size_t used = strlen(list);
        snprintf(list + used, sizeof list - used, "%s\"%s\"", i ? ", " : "", names[i]);
    }
    return rp_jdoc_fail(doc, err, RP_EINVAL, rp_jpath_key(kp, sizeof kp, path, key),
                        "must be one of %s, got \"%s\"", list, s);
}

rp_status rp_jdoc_obj(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, json_t **out, rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (v && !json_is_object(v))
        return rp_jdoc_fail(doc, err, RP_EINVAL, kp, "must be an object, got %s", rp_jdoc_type_name(v));
    *out = v;
    return RP_OK;
}

rp_status rp_jdoc_arr(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, json_t **out, rp_error *err)
{
    char kp[PATH_MAX_TEXT];
    json_t *v;
    rp_status st = member(doc, obj, path, key, required, &v, kp, sizeof kp, err);
    if (st != RP_OK) return st;
    if (v && !json_is_array(v))
        return rp_jdoc_fail(doc, err, RP_EINVAL, kp, "must be an array, got %s", rp_jdoc_type_name(v));
    *out = v;
    return RP_OK;
}

rp_status rp_json_text(rp_context *ctx, json_t *root, const char *what, char **text, size_t *len, rp_error *err)
{
    char *dump = root ? json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
    json_decref(root);
    if (!dump) return rp_fail_nomem(err, what);
    size_t n = strlen(dump);
    *text = rp_alloc(ctx, n + 2);
    if (!*text) {
        free(dump);
        return rp_fail_nomem(err, what);
    }
    memcpy(*text, dump, n);
    (*text)[n] = '\n';
    (*text)[n + 1] = '\0';
    free(dump);
    if (len) *len = n + 1;
    return RP_OK;
}
