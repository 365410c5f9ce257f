/* `routepack trace info | validate | import`: look at, fully check, and create routing
 * traces (.rpt) from .npy arrays dumped by Python trainers. */
#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Collect the non-option arguments; true when every option was known. `json` may be
 * NULL when --json is not accepted. */
static bool trace_args(int argc, char **argv, bool *json, const char **paths, int *num_paths)
{
    *num_paths = 0;
    for (int i = 0; i < argc; i++) {
        if (json && !strcmp(argv[i], "--json")) *json = true;
        else if (argv[i][0] == '-' && argv[i][1]) {
            cli_usage("unknown option '%s'", argv[i]);
            return false;
        } else paths[(*num_paths)++] = argv[i];
    }
    return true;
}

static void print_info_text(const char *path, const rp_trace *t)
{
    int32_t n = rp_trace_num_steps(t);
    const rp_trace_step_info *last = rp_trace_step(t, n - 1);
    printf("%s: %d step%s, %" PRId64 " bytes (headers checked; `routepack trace validate` "
           "checks the payloads)\n", path, n, n == 1 ? "" : "s",
           last->payload_offset + last->payload_bytes);
    printf("%5s %10s %10s %12s %7s %8s %6s %9s %14s  %s\n", "#", "step", "sequences", "tokens",
           "layers", "experts", "top-k", "id-width", "payload-bytes", "checksum");
    for (int32_t i = 0; i < n; i++) {
        const rp_trace_step_info *s = rp_trace_step(t, i);
        printf("%5d %10" PRId64 " %10d %12" PRId64 " %7d %8d %6d %9d %14" PRId64 "  %016" PRIx64 "\n",
               i, s->step, s->num_seqs, s->num_tokens, s->num_layers, s->num_experts, s->top_k,
               (int)s->width, s->payload_bytes, s->checksum);
    }
}

/* One JSON object for the trace; false when jansson ran out of memory. */
static bool print_info_json(const char *path, const rp_trace *t)
{
    int32_t n = rp_trace_num_steps(t);
    const rp_trace_step_info *last = rp_trace_step(t, n - 1);
    json_t *steps = json_array();
    json_t *root = json_pack("{s:s, s:I, s:i, s:o}", "path", path, "file_bytes",
                             (json_int_t)(last->payload_offset + last->payload_bytes), "num_steps",
                             n, "steps", steps);
    if (!root) return false;
    for (int32_t i = 0; i < n; i++) {
        const rp_trace_step_info *s = rp_trace_step(t, i);
        char hex[17];
        snprintf(hex, sizeof hex, "%016" PRIx64, s->checksum);
        json_t *o = json_pack("{s:i, s:I, s:i, s:I, s:i, s:i, s:i, s:i, s:I, s:s, s:I, s:I}",
                              "index", i, "step", (json_int_t)s->step, "num_seqs", s->num_seqs,
                              "num_tokens", (json_int_t)s->num_tokens, "num_layers", s->num_layers,
                              "num_experts", s->num_experts, "top_k", s->top_k, "id_width",
                              (int)s->width, "payload_bytes", (json_int_t)s->payload_bytes,
                              "checksum", hex, "offset", (json_int_t)s->offset, "payload_offset",
                              (json_int_t)s->payload_offset);
        if (!o || json_array_append_new(steps, o) != 0) {
            json_decref(root);
            return false;
        }
    }
    int rc = json_dumpf(root, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    printf("\n");
    return rc == 0;
}

int cmd_trace_info(rp_context *ctx, int argc, char **argv)
{
    bool json = false;
    const char **paths = calloc((size_t)argc + 1, sizeof *paths);
    int num_paths;
    if (!paths) return cli_usage("out of memory");
    if (!trace_args(argc, argv, &json, paths, &num_paths)) {
        free(paths);
        return CLI_USAGE;
    }
    if (num_paths == 0) {
        free(paths);
        return cli_usage("trace info needs a TRACE.rpt file");
    }
    int rc = CLI_OK;
    for (int p = 0; p < num_paths; p++) {
        rp_trace *t;
        rp_error err;
        if (rp_trace_open(ctx, paths[p], RP_TRACE_NO_VERIFY, &t, &err) != RP_OK) {
            rc = cli_fail(&err);
            continue;
        }
        if (!json) print_info_text(paths[p], t);
        else if (!print_info_json(paths[p], t)) {
            fprintf(stderr, "routepack: out of memory printing %s\n", paths[p]);
            rc = CLI_FAIL;
        }
        rp_trace_close(t);
    }
    free(paths);
    fflush(stdout);
    return rc;
}

int cmd_trace_validate(rp_context *ctx, int argc, char **argv)
{
    const char **paths = calloc((size_t)argc + 1, sizeof *paths);
    int num_paths;
    if (!paths) return cli_usage("out of memory");
    if (!trace_args(argc, argv, NULL, paths, &num_paths)) {
        free(paths);
        return CLI_USAGE;
    }
    if (num_paths == 0) {
        free(paths);
        return cli_usage("trace validate needs a TRACE.rpt file");
    }
    int rc = CLI_OK;
    for (int p = 0; p < num_paths; p++) {
        rp_trace *t = NULL;
        rp_error err;
        if (rp_trace_open(ctx, paths[p], 0, &t, &err) != RP_OK || rp_trace_validate(t, &err) != RP_OK)
            rc = cli_fail(&err);
        else
            printf("%s: %d step%s, OK\n", paths[p], rp_trace_num_steps(t),
                   rp_trace_num_steps(t) == 1 ? "" : "s");
        rp_trace_close(t);
    }
    free(paths);
    fflush(stdout);
    return rc;
}

/* ---- import ---- */

static int npy_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int npy_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "routepack: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return CLI_FAIL;
}

static const char *shape_text(const rp_npy *a, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int32_t d = 0; d < rp_npy_ndim(a) && n < size; d++)
        n += (size_t)snprintf(buf + n, size - n, "%s%" PRId64, d ? ", " : "", rp_npy_shape(a)[d]);
    if (n < size) snprintf(buf + n, size - n, "%s)", rp_npy_ndim(a) == 1 ? "," : "");
    return buf;
}

/* Column `col` of a [n] (ncols 0) or [n, ncols] array into out[n], each in [min, max]. */
static int read_column(const char *path, const rp_npy *a, int64_t ncols, int64_t col, int32_t min,
                       int32_t max, const char *what, int32_t *out)
{
    int64_t n = rp_npy_shape(a)[0], stride = ncols ? ncols : 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = rp_npy_get(a, i * stride + col);
        bool huge = rp_npy_type(a) == RP_NPY_U64 && v < 0;
        if (huge || v < min || v > max)
            return npy_fail("%s: %s of sequence %" PRId64 " is %s%" PRId64 ", must be in [%d, %d]",
                            path, what, i, huge ? "above 2^63, read as " : "", v, min, max);
        out[i] = (int32_t)v;
    }
    return CLI_OK;
}

/* A one-dimensional [n] array of sequences; n must match *num_seqs when that is >= 0. */
static int check_seq_array(const char *path, const rp_npy *a, int64_t *num_seqs, bool allow_pairs)
{
    char sh[256];
    bool pairs = allow_pairs && rp_npy_ndim(a) == 2 && rp_npy_shape(a)[1] == 2;
    if (rp_npy_ndim(a) != 1 && !pairs)
        return npy_fail("%s: expected shape [sequences]%s, got %s", path,
                        allow_pairs ? " or [sequences, 2] (prompt, response)" : "",
                        shape_text(a, sh, sizeof sh));
    int64_t n = rp_npy_shape(a)[0];
    if (n > INT32_MAX) return npy_fail("%s: %" PRId64 " sequences, at most 2^31-1", path, n);
    if (*num_seqs >= 0 && n != *num_seqs)
        return npy_fail("%s has %" PRId64 " sequences, the other length arrays %" PRId64, path, n,
                        *num_seqs);
    *num_seqs = n;
    return CLI_OK;
}

/* The first routing id outside [0, num_experts), or -1. Unsigned compare: negative
 * values become huge. Loads use memcpy since the data may be unaligned. */
#define SCAN(T)                                                                  \
    for (int64_t i = 0; i < count; i++) {                                        \
        T v;                                                                     \
        memcpy(&v, p + i * (int64_t)sizeof(T), sizeof(T));                       \
        if ((uint64_t)(int64_t)v >= limit) return i;                             \
    }                                                                            \
    return -1;

static int64_t first_bad_npy_id(const rp_npy *a, uint64_t limit)
{
    const unsigned char *p = rp_npy_data(a);
    int64_t count = rp_npy_count(a);
    switch (rp_npy_type(a)) {
    case RP_NPY_I8: SCAN(int8_t)
    case RP_NPY_U8: SCAN(uint8_t)
    case RP_NPY_I16: SCAN(int16_t)
    case RP_NPY_U16: SCAN(uint16_t)
    case RP_NPY_I32: SCAN(int32_t)
    case RP_NPY_U32: SCAN(uint32_t)
    case RP_NPY_I64: SCAN(int64_t)
    case RP_NPY_U64: SCAN(uint64_t)
    }
    return -1;
}
#undef SCAN

static int npy_item_bytes(rp_npy_dtype t)
{
    static const int bytes[] = {1, 1, 2, 2, 4, 4, 8, 8};
    return bytes[t];
}

typedef struct import_opts {
    const char *routing, *lens, *prompt_lens, *response_lens, *group_ids, *out;
    int64_t experts, step;
    bool have_step, append, force;
    bool per_layer; /* --layout per_layer: routing is [layers, tokens, k] (Megatron's) */
} import_opts;

static int parse_import(int argc, char **argv, import_opts *o)
{
    memset(o, 0, sizeof *o);
    const char *experts = NULL, *step = NULL, *layout = NULL;
    bool bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--routing", &o->routing, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--lens", &o->lens, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--prompt-lens", &o->prompt_lens, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--response-lens", &o->response_lens, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--group-ids", &o->group_ids, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--experts", &experts, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--step", &step, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--out", &o->out, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--layout", &layout, &bad)) continue;
        if (!strcmp(argv[i], "--append")) {
            o->append = true;
            continue;
        }
        if (!strcmp(argv[i], "--force")) {
            o->force = true;
            continue;
        }
        return cli_usage("trace import: unknown argument '%s'", argv[i]);
    }
    if (bad) return CLI_USAGE;
    if (!o->routing || !experts || !o->out)
        return cli_usage("trace import needs --routing R.npy, --experts E and --out TRACE.rpt");
    if (cli_check_output_file("--out", o->out) != CLI_OK) return CLI_USAGE;
    if (!o->lens == !(o->prompt_lens || o->response_lens) ||
        (!o->lens && !(o->prompt_lens && o->response_lens)))
        return cli_usage("trace import needs --lens L.npy, or both --prompt-lens P.npy and "
                         "--response-lens Q.npy");
    if (o->append && o->force)
        return cli_usage("trace import: --append adds a step and --force replaces the trace; "
                         "pass one of them");
    if (layout && strcmp(layout, "packed") != 0 && strcmp(layout, "per_layer") != 0)
        return cli_usage("--layout must be packed ([tokens, layers, k]) or per_layer "
                         "([layers, tokens, k]), got '%s'", layout);
    o->per_layer = layout && !strcmp(layout, "per_layer");
    if (!cli_int("--experts", experts, &o->experts)) return CLI_USAGE;
    if (o->experts < 1 || o->experts > INT32_MAX)
        return cli_usage("--experts must be in [1, 2147483647], got %" PRId64, o->experts);
    if (step) {
        if (!cli_int("--step", step, &o->step)) return CLI_USAGE;
        if (o->step < 0) return cli_usage("--step must be >= 0, got %" PRId64, o->step);
        o->have_step = true;
    }
    return CLI_OK;
}

/* The batch from the length arrays. */
static int import_batch(rp_context *ctx, const import_opts *o, rp_batch **batch)
{
    rp_npy *a[4] = {NULL, NULL, NULL, NULL}; /* lens or prompt, response, groups */
    const char *paths[4] = {o->lens ? o->lens : o->prompt_lens, o->lens ? NULL : o->response_lens,
                            o->group_ids, NULL};
    int32_t *prompt = NULL, *response = NULL, *group = NULL;
    int64_t n = -1;
    int rc = CLI_OK;
    rp_error err;
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        if (!paths[i]) continue;
        if (rp_npy_open(ctx, paths[i], &a[i], &err) != RP_OK) rc = cli_fail(&err);
        else rc = check_seq_array(paths[i], a[i], &n, i == 0 && o->lens);
    }
    if (rc != CLI_OK) goto out;
    prompt = calloc((size_t)n + 1, sizeof *prompt);
    response = calloc((size_t)n + 1, sizeof *response);
    group = calloc((size_t)n + 1, sizeof *group);
    if (!prompt || !response || !group) {
        rc = npy_fail("out of memory for %" PRId64 " sequences", n);
        goto out;
    }
    if (o->lens && rp_npy_ndim(a[0]) == 2) {
        rc = read_column(paths[0], a[0], 2, 0, 0, INT32_MAX, "the prompt length", prompt);
        if (rc == CLI_OK) rc = read_column(paths[0], a[0], 2, 1, 0, INT32_MAX, "the response length", response);
    } else if (o->lens) {
        /* whole-sequence lengths: no prompt/response split is known */
        rc = read_column(paths[0], a[0], 0, 0, 0, INT32_MAX, "the length", response);
    } else {
        rc = read_column(paths[0], a[0], 0, 0, 0, INT32_MAX, "the prompt length", prompt);
        if (rc == CLI_OK) rc = read_column(paths[1], a[1], 0, 0, 0, INT32_MAX, "the response length", response);
    }
    if (rc == CLI_OK && a[2])
        rc = read_column(paths[2], a[2], 0, 0, INT32_MIN, INT32_MAX, "the group id", group);
    if (rc == CLI_OK && rp_batch_new(ctx, (int32_t)n, prompt, response, a[2] ? group : NULL, batch,
                                     &err) != RP_OK)
        rc = cli_fail(&err);
out:
    for (int i = 0; i < 3; i++) rp_npy_close(a[i]);
    free(prompt);
    free(response);
    free(group);
    return rc;
}

/* Narrowest id width that addresses num_experts experts. */
static rp_id_width narrowest_width(int64_t num_experts)
{
    if (num_experts <= rp_id_width_capacity(RP_ID_U8)) return RP_ID_U8;
    if (num_experts <= rp_id_width_capacity(RP_ID_U16)) return RP_ID_U16;
    return RP_ID_I32;
}

/* A routing view of the [tokens, layers, k] array in `width`. Ids are known to be in
 * [0, num_experts), so when the input elements are at least `width` bytes and
 * aligned, the view reads the low `width` bytes of each little-endian element in
 * place, with strides scaled by the size ratio: the writer then streams it in chunks
 * and nothing is copied, whatever the input's size. Only an input narrower than the
 * id width (or unaligned) is widened into *copy. */
static int routing_view(const rp_npy *a, bool per_layer, rp_id_width width, rp_routing *r,
                        void **copy)
{
    const int64_t *shape = rp_npy_shape(a);
    int64_t tokens = shape[per_layer ? 1 : 0];
    int32_t layers = (int32_t)shape[per_layer ? 0 : 1], k = (int32_t)shape[2];
    int item = npy_item_bytes(rp_npy_type(a));
    const void *data = rp_npy_data(a);
    *copy = NULL;
    if (item >= (int)width && (uintptr_t)data % (uintptr_t)width == 0) {
        int64_t ratio = item / (int)width;
        rp_routing_packed(r, width, layers, k, data);
        r->token_stride = (per_layer ? k : (int64_t)layers * k) * ratio;
        r->layer_stride = (per_layer ? tokens * k : k) * ratio;
        r->k_stride = ratio;
        return CLI_OK;
    }
    int64_t count = rp_npy_count(a);
    unsigned char *buf = malloc((size_t)(count > 0 ? count : 1) * (size_t)width);
    if (!buf) return npy_fail("out of memory widening %" PRId64 " routing ids", count);
    for (int64_t i = 0; i < count; i++) {
        int64_t v = rp_npy_get(a, i);
        uint8_t v8 = (uint8_t)v;
        uint16_t v16 = (uint16_t)v;
        int32_t v32 = (int32_t)v;
        memcpy(buf + i * (int64_t)width, width == RP_ID_U8 ? (void *)&v8 : width == RP_ID_U16 ?
               (void *)&v16 : (void *)&v32, (size_t)width);
    }
    rp_routing_packed(r, width, layers, k, buf);
    if (per_layer) {
        r->token_stride = k;
        r->layer_stride = tokens * k;
    }
    *copy = buf;
    return CLI_OK;
}

int cmd_trace_import(rp_context *ctx, int argc, char **argv)
{
    import_opts o;
    int rc = parse_import(argc, argv, &o);
    if (rc != CLI_OK) return rc;

    rp_npy *routing_npy = NULL;
    rp_batch *batch = NULL;
    rp_trace *existing = NULL;
    rp_trace_writer *w = NULL;
    void *copy = NULL;
    char *tmp = NULL;
    rp_error err;
    char sh[256];
    rp_id_width width = narrowest_width(o.experts);
    int64_t step = o.have_step ? o.step : 0;
    int32_t steps_before = 0;

    if (rp_npy_open(ctx, o.routing, &routing_npy, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    const int64_t *shape = rp_npy_shape(routing_npy);
    const char *layout_text = o.per_layer ? "[layers, tokens, k] (--layout per_layer)"
                                          : "[tokens, layers, k] (--layout packed)";
    if (rp_npy_ndim(routing_npy) != 3) {
        rc = npy_fail("%s: routing must have shape %s, got %s", o.routing, layout_text,
                      shape_text(routing_npy, sh, sizeof sh));
        goto out;
    }
    /* the [tokens, layers, k] extents, whatever the layout in the file */
    int64_t num_tokens = shape[o.per_layer ? 1 : 0], num_layers = shape[o.per_layer ? 0 : 1];
    int64_t top_k = shape[2];
    if (num_layers < 1 || num_layers > INT32_MAX || top_k < 1 || top_k > INT32_MAX) {
        rc = npy_fail("%s: routing must have shape %s with layers and k >= 1, got %s", o.routing,
                      layout_text, shape_text(routing_npy, sh, sizeof sh));
        goto out;
    }
    if (top_k > o.experts) {
        rc = npy_fail("%s: top-k %" PRId64 " exceeds the %" PRId64 " experts", o.routing, top_k,
                      o.experts);
        goto out;
    }
    if ((rc = import_batch(ctx, &o, &batch)) != CLI_OK) goto out;
    if (rp_batch_num_tokens(batch) != num_tokens) {
        /* the usual mistake: Megatron's per-layer [layers, tokens, k] read as packed */
        int64_t other = shape[o.per_layer ? 0 : 1];
        const char *hint = other == rp_batch_num_tokens(batch)
            ? (o.per_layer ? "; its first dimension matches: drop --layout per_layer"
                           : "; its second dimension matches: is it [layers, tokens, k]? "
                             "pass --layout per_layer")
            : "";
        rc = npy_fail("%s: routing of shape %s read as %s has %" PRId64 " tokens, but the "
                      "sequence lengths sum to %" PRId64 "%s", o.routing,
                      shape_text(routing_npy, sh, sizeof sh), layout_text, num_tokens,
                      rp_batch_num_tokens(batch), hint);
        goto out;
    }
    int64_t bad = first_bad_npy_id(routing_npy, (uint64_t)o.experts);
    if (bad >= 0) {
        /* flat index -> (token, layer, choice) in the file's layout */
        int64_t choice = bad % top_k, rest = bad / top_k;
        int64_t token = o.per_layer ? rest % num_tokens : rest / num_layers;
        int64_t layer = o.per_layer ? rest / num_tokens : rest % num_layers;
        const int64_t *cu = rp_batch_cu_seqlens(batch);
        int32_t q = 0;
        while (cu[q + 1] <= token) q++;
        char value[32];
        if (rp_npy_type(routing_npy) == RP_NPY_U64)
            snprintf(value, sizeof value, "%" PRIu64, (uint64_t)rp_npy_get(routing_npy, bad));
        else
            snprintf(value, sizeof value, "%" PRId64, rp_npy_get(routing_npy, bad));
        rc = npy_fail("%s: token %" PRId64 " (sequence %d token %" PRId64 ") layer %" PRId64
                      " choice %" PRId64 " has expert id %s, but --experts is %" PRId64, o.routing,
                      token, q, token - cu[q], layer, choice, value, o.experts);
        goto out;
    }

    struct stat out_sb;
    bool out_exists = stat(o.out, &out_sb) == 0;
    if (!out_exists && errno != ENOENT) {
        rc = npy_fail("%s: %s", o.out, strerror(errno));
        goto out;
    }
    if (out_exists && !o.append && !o.force) {
        rc = npy_fail("%s exists: pass --append to add this step to it, or --force to replace it",
                      o.out);
        goto out;
    }
    bool append = o.append && out_exists; /* --append to a missing file creates it */
    if (append) {
        if (rp_trace_open(ctx, o.out, RP_TRACE_NO_VERIFY, &existing, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        steps_before = rp_trace_num_steps(existing);
        const rp_trace_step_info *last = rp_trace_step(existing, steps_before - 1);
        if (last->num_layers != num_layers || last->top_k != top_k || last->num_experts != o.experts) {
            rc = npy_fail("%s: cannot append: the trace has %d layers, top-%d and %d experts; the "
                          "new step has %" PRId64 " layers, top-%" PRId64 " and %" PRId64 " experts",
                          o.out, last->num_layers, last->top_k, last->num_experts, num_layers,
                          top_k, o.experts);
            goto out;
        }
        width = last->width; /* steps of one trace share the id width */
        if (!o.have_step) step = last->step + 1;
        for (int32_t i = 0; i < steps_before; i++)
            if (rp_trace_step(existing, i)->step == step) {
                rc = npy_fail("%s already holds step %" PRId64 " (its step #%d): pass another "
                              "--step, or leave --step out to append step %" PRId64, o.out, step,
                              (int)i, last->step + 1);
                goto out;
            }
        rp_trace_close(existing);
        existing = NULL;
    }
    rp_routing view;
    if ((rc = routing_view(routing_npy, o.per_layer, width, &view, &copy)) != CLI_OK) goto out;

    /* a new trace is written beside its destination and renamed into place, so a
     * failed import never leaves a broken file or clobbers a good one */
    if (!append) {
        size_t n = strlen(o.out) + 32;
        if (!(tmp = malloc(n))) {
            rc = npy_fail("out of memory");
            goto out;
        }
        snprintf(tmp, n, "%s.tmp.%ld", o.out, (long)getpid());
    }
    rp_status st = append ? rp_trace_writer_open_append(ctx, o.out, (int32_t)o.experts, &w, &err)
                            : rp_trace_writer_open(ctx, tmp, (int32_t)o.experts, &w, &err);
    if (st == RP_OK) st = rp_trace_writer_append(w, step, batch, &view, &err);
    if (w) {
        rp_error close_err;
        rp_status cst = rp_trace_writer_close(w, &close_err);
        if (st == RP_OK && cst != RP_OK) st = cst, err = close_err;
        w = NULL;
    }
    if (st == RP_OK && tmp && rename(tmp, o.out) != 0) {
        rp_error rerr;
        rerr.status = RP_EIO;
        snprintf(rerr.text, sizeof rerr.text, "%s: cannot rename %s into place: %s", o.out, tmp,
                 strerror(errno));
        err = rerr;
        st = RP_EIO;
    }
    if (st != RP_OK) {
        if (tmp) unlink(tmp);
        rc = cli_fail(&err);
        goto out;
    }
    printf("%s: %s step %" PRId64 " (%d sequences, %" PRId64 " tokens, %" PRId64 " layers, top-%"
           PRId64 ", %" PRId64 " experts, %d-byte ids); the trace has %d step%s\n", o.out,
           append ? "appended" : "wrote", step, rp_batch_num_seqs(batch),
           rp_batch_num_tokens(batch), num_layers, top_k, o.experts, (int)width,
           steps_before + 1, steps_before ? "s" : "");
out:
    rp_trace_close(existing);
    rp_batch_free(batch);
    rp_npy_close(routing_npy);
    free(copy);
    free(tmp);
    return rc;
}
