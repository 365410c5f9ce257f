/* A checkpoint's ctx.state, checked before anything is built from it: messages name the
 * JSON path (docs/formats.md, "Scheduler state"). */
#include "jsonx.h"
#include "policy_state.h"

#include <math.h>
#include <stdlib.h>

#define PATH_LEN 256

static rp_status check_value(const rp_jdoc *doc, json_t *v, const char *path, int depth, rp_error *err)
{
    if (json_is_boolean(v) || json_is_number(v) || json_is_string(v)) return RP_OK;
    double x;
    const char *s;
    size_t n;
    char *buf;
    if (state_decode_number(v, &x)) return RP_OK;
    if (state_decode_bytes(v, &s, &n, &buf)) {
        free(buf);
        return RP_OK;
    }
    json_t *list = json_is_object(v) && json_object_size(v) == 1 ? json_object_get(v, "table") : NULL;
    if (!json_is_array(list))
        return rp_jdoc_fail(doc, err, RP_EFORMAT, path,
                            "is %s; a state value is a boolean, a number, a string, {\"number\": \"inf\"|\"-inf\"|\"nan\"}, "
                            "{\"bytes\": hex} or {\"table\": [[key, value], ...]}",
                            rp_jdoc_type_name(v));
    if (depth >= RP_STATE_MAX_DEPTH)
        return rp_jdoc_fail(doc, err, RP_EFORMAT, path, "nests tables deeper than %d", RP_STATE_MAX_DEPTH);
    char sub[PATH_LEN], kv[PATH_LEN];
    size_t i;
    json_t *pair;
    json_array_foreach(list, i, pair) {
        rp_jpath_index(sub, sizeof sub, path, i);
        if (!json_is_array(pair) || json_array_size(pair) != 2)
            return rp_jdoc_fail(doc, err, RP_EFORMAT, sub, "must be a [key, value] pair");
        json_t *key = json_array_get(pair, 0);
        bool key_ok = json_is_boolean(key) || (state_decode_number(key, &x) && !isnan(x));
        if (!key_ok && state_decode_bytes(key, &s, &n, &buf)) {
            free(buf);
            key_ok = true;
        }
        if (!key_ok)
            return rp_jdoc_fail(doc, err, RP_EFORMAT, rp_jpath_index(kv, sizeof kv, sub, 0),
                                "is %s; a key is a number (not NaN), a string or a boolean", rp_jdoc_type_name(key));
        rp_status st = check_value(doc, json_array_get(pair, 1), rp_jpath_index(kv, sizeof kv, sub, 1), depth + 1, err);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

rp_status policy_state_check(const rp_jdoc *doc, json_t *state, const char *path, rp_error *err)
{
    return check_value(doc, state, path, 0, err);
}
