/* Strict reading of JSON documents (configs, generator settings, plans): typed getters
 * that reject unknown keys and out-of-range values, with errors that give
 * file:line:column of the offending value and its JSON path. jansson reports positions
 * only for syntax errors, so value positions come from re-scanning the source text
 * along the path (rp_jdoc_locate). Not installed. */
#ifndef RP_JSONX_H
#define RP_JSONX_H

#include "internal.h"

#include <jansson.h>

typedef struct rp_jdoc {
    const char *name;   /* file name for messages, borrowed */
    const char *text;   /* source text, borrowed */
    size_t len;
    json_t *root;       /* owned; freed by rp_jdoc_free */
} rp_jdoc;

/* Parse `text`. A syntax error reads "name:line:column: <jansson's message>". */
rp_status rp_jdoc_parse(rp_jdoc *doc, const char *text, size_t len, const char *name,
                        rp_error *err);
void rp_jdoc_free(rp_jdoc *doc);

/* 1-based line and column of the value at `path` ("topology.slots_per_gpu[3]"); of the
 * nearest enclosing value that exists when the path is not found (a missing key is
 * reported at its object). */
void rp_jdoc_locate(const rp_jdoc *doc, const char *path, int32_t *line, int32_t *column);

/* Fail with "name:line:column: path <message>"; sets err->line and err->column. */
rp_status rp_jdoc_fail(const rp_jdoc *doc, rp_error *err, rp_status status, const char *path,
                       const char *fmt, ...) RP_PRINTF(5, 6);

/* Reject keys of `obj` (at `path`, "" for the root) not in the NULL-terminated
 * `allowed`, suggesting the closest allowed key: "unknown key 'gpus_per_nod' (did you
 * mean 'gpus_per_node'?)". Also fails if `obj` is not an object. */
rp_status rp_jdoc_check_keys(const rp_jdoc *doc, json_t *obj, const char *path,
                             const char *const *allowed, rp_error *err);

/* Typed getters for obj[key] where obj sits at `path`. When the key is absent:
 * `required` true fails ("path.key is required"), false stores `dflt`. A present
 * value of the wrong type or outside [min, max] fails naming both
 * ("topology.gpus_per_node must be >= 1, got 0"). Integers reject fractions;
 * numbers accept integers. */
rp_status rp_jdoc_int(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, int64_t dflt, int64_t min, int64_t max, int64_t *out,
                      rp_error *err);
rp_status rp_jdoc_num(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, double dflt, double min, double max, double *out,
                      rp_error *err);
/* rp_jdoc_int into an int32 (min and max inside int32's range). */
rp_status rp_jdoc_i32(const rp_jdoc *doc, json_t *obj, const char *path, const char *key, bool required,
                      int64_t dflt, int64_t min, int64_t max, int32_t *out, rp_error *err);
/* A number > 0 and <= max (a minimum cannot say "exclusive"): "must be > 0, got 0". */
rp_status rp_jdoc_positive(const rp_jdoc *doc, json_t *obj, const char *path, const char *key, bool required,
                           double dflt, double max, double *out, rp_error *err);
rp_status rp_jdoc_bool(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                       bool required, bool dflt, bool *out, rp_error *err);
/* The string stays owned by the document. */
rp_status rp_jdoc_str(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, const char *dflt, const char **out, rp_error *err);
/* A string member that must be one of `names` (NULL-terminated): its index in *out (dflt
 * when absent); anything else fails naming the choices. */
rp_status rp_jdoc_choice(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                         const char *const *names, int dflt, int *out, rp_error *err);
/* An object or array member (type checked); *out NULL when absent and not required. */
rp_status rp_jdoc_obj(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, json_t **out, rp_error *err);
rp_status rp_jdoc_arr(const rp_jdoc *doc, json_t *obj, const char *path, const char *key,
                      bool required, json_t **out, rp_error *err);

/* The same checks for a value already in hand, e.g. an array element at `path`
 * ("topology.slots_per_gpu[3]"). */
rp_status rp_jdoc_int_value(const rp_jdoc *doc, json_t *value, const char *path, int64_t min,
                            int64_t max, int64_t *out, rp_error *err);
rp_status rp_jdoc_num_value(const rp_jdoc *doc, json_t *value, const char *path, double min,
                            double max, double *out, rp_error *err);
/* Words for a value's type in messages: "an object", "a string", "null", ... */
const char *rp_jdoc_type_name(const json_t *value);

/* Join a path and a key ("a.b" + "c" -> "a.b.c"; "" + "c" -> "c") or an index
 * ("a" + 3 -> "a[3]") into buf. */
const char *rp_jpath_key(char *buf, size_t size, const char *path, const char *key);
const char *rp_jpath_index(char *buf, size_t size, const char *path, size_t index);

/* `root` (taken over, may be NULL) as indented text in key order, ending with a newline,
 * allocated from ctx (rp_text_free); its length without the NUL in *len when len is not
 * NULL. RP_ENOMEM naming `what` ("the step report") when it cannot be made. */
rp_status rp_json_text(rp_context *ctx, json_t *root, const char *what, char **text, size_t *len, rp_error *err);

#endif
