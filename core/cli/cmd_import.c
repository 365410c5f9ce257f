/* `routepack trace import`: routing replay dumped by a Python trainer into a trace (.rpt):
 * one step from .npy files, or every step of a run from one .npz archive (numpy.savez).
 * Everything is checked before anything is written, and the trace is all or nothing:
 * a new trace is written beside its destination and renamed into place; an append that
 * fails is cut back to the trace as it was. */
#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *shape_text(const rp_npy *a, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int32_t d = 0; d < rp_npy_ndim(a) && n < size; d++)
        n += (size_t)snprintf(buf + n, size - n, "%s%" PRId64, d ? ", " : "", rp_npy_shape(a)[d]);
    if (n < size) snprintf(buf + n, size - n, "%s)", rp_npy_ndim(a) == 1 ? "," : "");
    return buf;
}

/* Column `col` of a [n] (ncols 0) or [n, ncols] array into out[n], each in [min, max]. */
static int read_column(const char *name, const rp_npy *a, int64_t ncols, int64_t col, int32_t min,
                       int32_t max, const char *what, int32_t *out)
{
    int64_t n = rp_npy_shape(a)[0], stride = ncols ? ncols : 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = rp_npy_get(a, i * stride + col);
        bool huge = rp_npy_type(a) == RP_NPY_U64 && v < 0;
        if (huge || v < min || v > max)
            return cli_message(CLI_FAIL, "%s: %s of sequence %" PRId64 " is %s%" PRId64 ", must be in [%d, %d]",
                               name, what, i, huge ? "above 2^63, read as " : "", v, min, max);
        out[i] = (int32_t)v;
    }
    return CLI_OK;
}

/* A one-dimensional [n] array of sequences; n must match *num_seqs when that is >= 0. */
static int check_seq_array(const char *name, const rp_npy *a, int64_t *num_seqs, bool allow_pairs)
{
    char sh[256];
    bool pairs = allow_pairs && rp_npy_ndim(a) == 2 && rp_npy_shape(a)[1] == 2;
    if (rp_npy_ndim(a) != 1 && !pairs)
        return cli_message(CLI_FAIL, "%s: expected shape [sequences]%s, got %s", name,
                           allow_pairs ? " or [sequences, 2] (prompt, response)" : "",
                           shape_text(a, sh, sizeof sh));
    int64_t n = rp_npy_shape(a)[0];
    if (n > INT32_MAX) return cli_message(CLI_FAIL, "%s: %" PRId64 " sequences, at most 2^31-1", name, n);
    if (*num_seqs >= 0 && n != *num_seqs)
        return cli_message(CLI_FAIL, "%s has %" PRId64 " sequences, the other length arrays %" PRId64, name, n,
                           *num_seqs);
    *num_seqs = n;
    return CLI_OK;
}

static int npy_item_bytes(rp_npy_dtype t)
{
    static const int bytes[] = {1, 1, 2, 2, 4, 4, 8, 8};
    return bytes[t];
}

/* The first routing id of [from, from + count) outside [0, num_experts), or -1.
 * Unsigned compare: negative values become huge. Loads use memcpy since the data may be
 * unaligned. */
#define SCAN(T)                                                                  \
    for (int64_t i = from; i < from + count; i++) {                              \
        T v;                                                                     \
        memcpy(&v, p + i * (int64_t)sizeof(T), sizeof(T));                       \
        if ((uint64_t)(int64_t)v >= limit) return i;                             \
    }                                                                            \
    return -1;

static int64_t first_bad_in(const rp_npy *a, int64_t from, int64_t count, uint64_t limit)
{
    const unsigned char *p = rp_npy_data(a);
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

#define SCAN_BLOCK_BYTES ((int64_t)16 << 20) /* ids checked between progress updates */

/* The first routing id outside [0, num_experts), or -1; the progress line moves on by
 * the bytes read, from `bytes_before` (a huge step is one long scan). */
static int64_t first_bad_npy_id(const rp_npy *a, uint64_t limit, int64_t step_unit, double bytes_before)
{
    int64_t count = rp_npy_count(a), item = npy_item_bytes(rp_npy_type(a));
    int64_t block = SCAN_BLOCK_BYTES / item;
    for (int64_t from = 0; from < count; from += block) {
        int64_t n = count - from < block ? count - from : block;
        int64_t bad = first_bad_in(a, from, n, limit);
        if (bad >= 0) return bad;
        cli_progress_update(step_unit, bytes_before + (double)((from + n) * item), "checking ids");
    }
    return -1;
}

typedef struct import_opts {
    const char *routing, *lens, *prompt_lens, *response_lens, *group_ids, *npz, *out;
    int64_t experts, step;
    bool have_step, append, force;
    bool per_layer; /* --layout per_layer: routing is [layers, tokens, k] (Megatron's) */
} import_opts;

/* One step to import: its arrays (borrowed from files or the archive) and their names. */
typedef struct import_step {
    int64_t step;
    bool have_step;
    const rp_npy *routing, *lens, *prompt, *response, *groups;
    char routing_name[512], lens_name[512], prompt_name[512], response_name[512], groups_name[512];
} import_step;

/* What a step costs the progress line: its routing read by the id check, then the
 * trace payload written (ids in `width`, three int32 arrays per sequence). */
static double step_input_bytes(const import_step *s)
{
    return (double)rp_npy_count(s->routing) * npy_item_bytes(rp_npy_type(s->routing));
}

static double pad64(double bytes)
{
    return ceil(bytes / 64) * 64;
}

/* The step's payload as the writer reports it (docs/formats.md: three int32 arrays and
 * the ids, each padded to 64 bytes), so the count only grows at the step's end. */
static double step_output_bytes(const import_step *s, rp_id_width width)
{
    const rp_npy *lens = s->lens ? s->lens : s->prompt;
    double seqs = rp_npy_ndim(lens) > 0 ? (double)rp_npy_shape(lens)[0] : 0;
    return 3 * pad64(4 * seqs) + pad64((double)rp_npy_count(s->routing) * (double)width);
}

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
        if (cli_opt(argc, argv, &i, "--npz", &o->npz, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--experts", &experts, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--step", &step, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--out", &o->out, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--layout", &layout, &bad)) continue;
        if (cli_flag(argv[i], "--append", &o->append)) continue;
        if (cli_flag(argv[i], "--force", &o->force)) continue;
        if (argv[i][0] == '-' && argv[i][1]) return cli_unknown_option("trace import", argv[i]);
        return cli_usage("trace import: unknown argument '%s'", argv[i]);
    }
    if (bad) return CLI_USAGE;
    if (o->npz && (o->routing || o->lens || o->prompt_lens || o->response_lens || o->group_ids))
        return cli_usage("trace import: --npz holds the arrays; give it alone, without --routing, "
                         "--lens, --prompt-lens, --response-lens or --group-ids");
    if ((!o->routing && !o->npz) || !experts || !o->out)
        return cli_usage("trace import needs --routing R.npy (or --npz RUN.npz), --experts E and "
                         "--out TRACE.rpt");
    if (cli_check_output_file("--out", o->out) != CLI_OK) return CLI_USAGE;
    if (!o->npz && (!o->lens == !(o->prompt_lens || o->response_lens) ||
                    (!o->lens && !(o->prompt_lens && o->response_lens))))
        return cli_usage("trace import needs --lens L.npy, or both --prompt-lens P.npy and "
                         "--response-lens Q.npy");
    if (o->append && o->force)
        return cli_usage("trace import: --append adds steps and --force replaces the trace; "
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

/* ---- the steps of an .npz archive ---- */

static const char *const npz_roles[] = {"routing", "lens", "prompt_lens", "response_lens", "group_ids"};
enum { ROLE_ROUTING, ROLE_LENS, ROLE_PROMPT, ROLE_RESPONSE, ROLE_GROUPS, NUM_ROLES };

/* "routing" -> (ROLE_ROUTING, no step); "lens_12" -> (ROLE_LENS, 12); false otherwise. */
static bool npz_member_role(const char *name, int *role, int64_t *step)
{
    for (int r = NUM_ROLES - 1; r >= 0; r--) { /* longest names first: "lens" ends "prompt_lens" */
        size_t n = strlen(npz_roles[r]);
        if (strncmp(name, npz_roles[r], n) != 0) continue;
        if (!name[n]) {
            *role = r, *step = -1;
            return true;
        }
        if (name[n] != '_' || !name[n + 1]) continue;
        char *end;
        errno = 0;
        long long k = strtoll(name + n + 1, &end, 10);
        if (*end || errno || k < 0 || name[n + 1] < '0' || name[n + 1] > '9') continue;
        *role = r, *step = k;
        return true;
    }
    return false;
}

static int cmp_step(const void *a, const void *b)
{
    int64_t x = ((const import_step *)a)->step, y = ((const import_step *)b)->step;
    return (x > y) - (x < y);
}

/* Group the archive's members into steps (ascending step index). A run is either one
 * unnumbered step (routing, lens, ...) or numbered ones (routing_0, lens_0, ...). */
static int npz_steps(const char *path, const rp_npz *z, import_step **out, int32_t *count)
{
    int32_t n = rp_npz_count(z), num = 0;
    import_step *steps = calloc((size_t)(n ? n : 1), sizeof *steps);
    if (!steps) return cli_message(CLI_FAIL, "out of memory");
    bool numbered = false, unnumbered = false;
    for (int32_t i = 0; i < n; i++) {
        const char *name = rp_npz_name(z, i);
        int role;
        int64_t k;
        if (!npz_member_role(name, &role, &k)) {
            free(steps);
            return cli_message(CLI_FAIL, "%s: unexpected array '%s': an import archive holds routing, lens (or "
                               "prompt_lens and response_lens) and optional group_ids, each either "
                               "unnumbered (one step) or as NAME_K for step K", path, name);
        }
        *(k < 0 ? &unnumbered : &numbered) = true;
        int32_t at = 0;
        while (at < num && steps[at].step != k) at++;
        if (at == num) {
            steps[num].step = k;
            steps[num].have_step = k >= 0;
            num++;
        }
        import_step *s = &steps[at];
        const rp_npy *a = rp_npz_array(z, i);
        char *label = role == ROLE_ROUTING ? s->routing_name : role == ROLE_LENS ? s->lens_name
                      : role == ROLE_PROMPT ? s->prompt_name : role == ROLE_RESPONSE ? s->response_name
                      : s->groups_name;
        snprintf(label, sizeof s->routing_name, "%s:%s.npy", path, name);
        switch (role) {
        case ROLE_ROUTING: s->routing = a; break;
        case ROLE_LENS: s->lens = a; break;
        case ROLE_PROMPT: s->prompt = a; break;
        case ROLE_RESPONSE: s->response = a; break;
        default: s->groups = a; break;
        }
    }
    if (numbered && unnumbered) {
        free(steps);
        return cli_message(CLI_FAIL, "%s: mixes unnumbered arrays (one step) with numbered ones (NAME_K): use "
                           "one form", path);
    }
    if (num == 0) {
        free(steps);
        return cli_message(CLI_FAIL, "%s: the archive holds no arrays", path);
    }
    qsort(steps, (size_t)num, sizeof *steps, cmp_step);
    for (int32_t i = 0; i < num; i++) {
        import_step *s = &steps[i];
        char which[32] = "";
        if (s->have_step) snprintf(which, sizeof which, "_%" PRId64, s->step);
        const char *missing = !s->routing ? "routing"
                              : !s->lens && !(s->prompt && s->response) ? "lens (or prompt_lens and response_lens)"
                              : NULL;
        if (s->lens && (s->prompt || s->response)) {
            free(steps);
            return cli_message(CLI_FAIL, "%s: step has both lens%s and prompt_lens%s/response_lens%s: give one form",
                               path, which, which, which);
        }
        if (missing) {
            free(steps);
            return cli_message(CLI_FAIL, "%s: no %s%s for the step of routing%s", path, missing, which, which);
        }
    }
    *out = steps;
    *count = num;
    return CLI_OK;
}

/* ---- one step ---- */

/* The batch from a step's length arrays. */
static int import_batch(rp_context *ctx, const import_step *s, rp_batch **batch)
{
    const rp_npy *a[3] = {s->lens ? s->lens : s->prompt, s->lens ? NULL : s->response, s->groups};
    const char *names[3] = {s->lens ? s->lens_name : s->prompt_name, s->response_name, s->groups_name};
    int32_t *prompt = NULL, *response = NULL, *group = NULL;
    int64_t n = -1;
    int rc = CLI_OK;
    rp_error err;
    for (int i = 0; i < 3 && rc == CLI_OK; i++)
        if (a[i]) rc = check_seq_array(names[i], a[i], &n, i == 0 && s->lens);
    if (rc != CLI_OK) return rc;
    prompt = calloc((size_t)n + 1, sizeof *prompt);
    response = calloc((size_t)n + 1, sizeof *response);
    group = calloc((size_t)n + 1, sizeof *group);
    if (!prompt || !response || !group) {
        rc = cli_message(CLI_FAIL, "out of memory for %" PRId64 " sequences", n);
        goto out;
    }
    if (s->lens && rp_npy_ndim(a[0]) == 2) {
        rc = read_column(names[0], a[0], 2, 0, 0, INT32_MAX, "the prompt length", prompt);
        if (rc == CLI_OK) rc = read_column(names[0], a[0], 2, 1, 0, INT32_MAX, "the response length", response);
    } else if (s->lens) {
        /* whole-sequence lengths: no prompt/response split is known */
        rc = read_column(names[0], a[0], 0, 0, 0, INT32_MAX, "the length", response);
    } else {
        rc = read_column(names[0], a[0], 0, 0, 0, INT32_MAX, "the prompt length", prompt);
        if (rc == CLI_OK) rc = read_column(names[1], a[1], 0, 0, 0, INT32_MAX, "the response length", response);
    }
    if (rc == CLI_OK && a[2]) rc = read_column(names[2], a[2], 0, 0, INT32_MIN, INT32_MAX, "the group id", group);
    if (rc == CLI_OK && rp_batch_new(ctx, (int32_t)n, prompt, response, a[2] ? group : NULL, batch, &err) != RP_OK)
        rc = cli_fail(&err);
out:
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

/* A routing view of the array in `width`. Ids are known to be in [0, num_experts), so
 * when the input elements are at least `width` bytes and aligned, the view reads the low
 * `width` bytes of each little-endian element in place, with strides scaled by the size
 * ratio (and by the layout): the writer then streams it in chunks and nothing is copied,
 * whatever the input's size. Only an input narrower than the id width (or unaligned) is
 * widened into *copy. */
static int routing_view(const rp_npy *a, bool per_layer, rp_id_width width, rp_routing *r, void **copy)
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
    if (!buf) return cli_message(CLI_FAIL, "out of memory widening %" PRId64 " routing ids", count);
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

/* What the trace already holds, for appends and for the checks of later steps. */
typedef struct trace_shape {
    bool known;
    int64_t layers, top_k;
    rp_id_width width;
    int64_t *steps; /* step indexes held, in file order */
    int32_t num_steps;
} trace_shape;

/* Where the trace holds step index `step` (its position), or -1. */
static int32_t shape_find_step(const trace_shape *t, int64_t step)
{
    for (int32_t i = 0; i < t->num_steps; i++)
        if (t->steps[i] == step) return i;
    return -1;
}

/* Check one step's arrays against each other, the expert count and the trace; then
 * append it. *batch_out (caller frees) says what was written. */
static int import_one(rp_context *ctx, const import_opts *o, const import_step *s, int64_t step,
                      trace_shape *t, rp_trace_writer *w, const char *trace_path, int32_t index,
                      double bytes_before, rp_batch **batch_out)
{
    const rp_npy *ra = s->routing;
    const char *rname = s->routing_name;
    char sh[256];
    const int64_t *shape = rp_npy_shape(ra);
    const char *layout_text = o->per_layer ? "[layers, tokens, k] (--layout per_layer)"
                                           : "[tokens, layers, k] (--layout packed)";
    if (rp_npy_ndim(ra) != 3)
        return cli_message(CLI_FAIL, "%s: routing must have shape %s, got %s", rname, layout_text, shape_text(ra, sh, sizeof sh));
    /* the [tokens, layers, k] extents, whatever the layout in the file */
    int64_t num_tokens = shape[o->per_layer ? 1 : 0], num_layers = shape[o->per_layer ? 0 : 1];
    int64_t top_k = shape[2];
    if (num_layers < 1 || num_layers > INT32_MAX || top_k < 1 || top_k > INT32_MAX)
        return cli_message(CLI_FAIL, "%s: routing must have shape %s with layers and k >= 1, got %s", rname, layout_text,
                           shape_text(ra, sh, sizeof sh));
    if (top_k > o->experts)
        return cli_message(CLI_FAIL, "%s: top-k %" PRId64 " exceeds the %" PRId64 " experts", rname, top_k, o->experts);
    rp_batch *batch = NULL;
    int rc = import_batch(ctx, s, &batch);
    if (rc != CLI_OK) return rc;
    void *copy = NULL;
    if (rp_batch_num_tokens(batch) != num_tokens) {
        /* the usual mistake: Megatron's per-layer [layers, tokens, k] read as packed */
        int64_t other = shape[o->per_layer ? 0 : 1];
        const char *hint = other == rp_batch_num_tokens(batch)
            ? (o->per_layer ? "; its first dimension matches: drop --layout per_layer"
                            : "; its second dimension matches: is it [layers, tokens, k]? "
                              "pass --layout per_layer")
            : "";
        rc = cli_message(CLI_FAIL, "%s: routing of shape %s read as %s has %" PRId64 " tokens, but the "
                         "sequence lengths sum to %" PRId64 "%s", rname, shape_text(ra, sh, sizeof sh),
                         layout_text, num_tokens, rp_batch_num_tokens(batch), hint);
        goto out;
    }
    int64_t bad = first_bad_npy_id(ra, (uint64_t)o->experts, index, bytes_before);
    if (bad >= 0) {
        /* flat index -> (token, layer, choice) in the file's layout */
        int64_t choice = bad % top_k, rest = bad / top_k;
        int64_t token = o->per_layer ? rest % num_tokens : rest / num_layers;
        int64_t layer = o->per_layer ? rest / num_tokens : rest % num_layers;
        const int64_t *cu = rp_batch_cu_seqlens(batch);
        int32_t q = 0;
        while (cu[q + 1] <= token) q++;
        char value[32];
        if (rp_npy_type(ra) == RP_NPY_U64)
            snprintf(value, sizeof value, "%" PRIu64, (uint64_t)rp_npy_get(ra, bad));
        else
            snprintf(value, sizeof value, "%" PRId64, rp_npy_get(ra, bad));
        rc = cli_message(CLI_FAIL, "%s: token %" PRId64 " (sequence %d token %" PRId64 ") layer %" PRId64
                         " choice %" PRId64 " has expert id %s, but --experts is %" PRId64, rname, token, q,
                         token - cu[q], layer, choice, value, o->experts);
        goto out;
    }
    if (t->known && (t->layers != num_layers || t->top_k != top_k)) {
        rc = cli_message(CLI_FAIL, "%s: cannot append: the trace has %" PRId64 " layers, top-%" PRId64 " and %" PRId64
                         " experts; the new step has %" PRId64 " layers, top-%" PRId64 " and %" PRId64 " experts",
                         trace_path, t->layers, t->top_k, o->experts, num_layers, top_k, o->experts);
        goto out;
    }
    int32_t held = shape_find_step(t, step);
    if (held >= 0) {
        int64_t next = t->steps[0];
        for (int32_t i = 1; i < t->num_steps; i++) next = t->steps[i] > next ? t->steps[i] : next;
        rc = cli_message(CLI_FAIL, "%s already holds step %" PRId64 " (its step #%d): pass another --step, or leave "
                         "--step out to append step %" PRId64, trace_path, step, (int)held, next + 1);
        goto out;
    }
    rp_routing view;
    if ((rc = routing_view(ra, o->per_layer, t->width, &view, &copy)) != CLI_OK) goto out;
    rp_error err;
    /* the writer's progress hook (cli_progress_hook) counts on from the checked input */
    cli_progress_at(index, bytes_before + step_input_bytes(s));
    if (rp_trace_writer_append(w, step, batch, &view, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    int64_t *grown = realloc(t->steps, (size_t)(t->num_steps + 1) * sizeof *grown);
    if (!grown) {
        rc = cli_message(CLI_FAIL, "out of memory");
        goto out;
    }
    t->steps = grown;
    t->steps[t->num_steps++] = step;
    t->known = true, t->layers = num_layers, t->top_k = top_k;
    *batch_out = batch;
    batch = NULL;
out:
    free(copy);
    rp_batch_free(batch);
    return rc;
}

/* The trace `path` as it is, for --append: shape, id width, step indexes. */
static int read_trace_shape(rp_context *ctx, const char *path, int64_t experts, trace_shape *t)
{
    rp_trace *existing = NULL;
    rp_error err;
    if (rp_trace_open(ctx, path, RP_TRACE_NO_VERIFY, &existing, &err) != RP_OK) return cli_fail(&err);
    int32_t n = rp_trace_num_steps(existing);
    const rp_trace_step_info *last = rp_trace_step(existing, n - 1);
    int rc = CLI_OK;
    if (last->num_experts != experts) {
        rc = cli_message(CLI_FAIL, "%s: cannot append: the trace has %d experts, --experts is %" PRId64, path,
                         last->num_experts, experts);
    } else if (!(t->steps = malloc((size_t)n * sizeof *t->steps))) {
        rc = cli_message(CLI_FAIL, "out of memory");
    } else {
        for (int32_t i = 0; i < n; i++) t->steps[i] = rp_trace_step(existing, i)->step;
        t->num_steps = n;
        t->known = true;
        t->layers = last->num_layers;
        t->top_k = last->top_k;
        t->width = last->width; /* steps of one trace share the id width */
    }
    rp_trace_close(existing);
    return rc;
}

int cmd_trace_import(rp_context *ctx, int argc, char **argv)
{
    import_opts o;
    int rc = parse_import(argc, argv, &o);
    if (rc != CLI_OK) return rc;

    rp_npy *files[5] = {NULL, NULL, NULL, NULL, NULL};
    rp_npz *archive = NULL;
    import_step *steps = NULL, one;
    int32_t num_steps = 0;
    rp_trace_writer *w = NULL;
    rp_batch **written = NULL;
    trace_shape t = {.width = narrowest_width(o.experts)};
    char *tmp = NULL;
    int64_t size_before = -1;
    rp_error err;

    /* 1. the arrays: one step from .npy files, or the steps of an archive */
    if (o.npz) {
        if (rp_npz_open(ctx, o.npz, &archive, &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        if ((rc = npz_steps(o.npz, archive, &steps, &num_steps)) != CLI_OK) goto out;
        if (o.have_step && (num_steps > 1 || steps[0].have_step)) {
            rc = cli_usage("--step applies to an archive of one unnumbered step; %s numbers its steps",
                           o.npz);
            goto out;
        }
    } else {
        memset(&one, 0, sizeof one);
        const char *paths[5] = {o.routing, o.lens, o.prompt_lens, o.response_lens, o.group_ids};
        char *names[5] = {one.routing_name, one.lens_name, one.prompt_name, one.response_name, one.groups_name};
        const rp_npy **slots[5] = {&one.routing, &one.lens, &one.prompt, &one.response, &one.groups};
        for (int i = 0; i < 5; i++) {
            if (!paths[i]) continue;
            if (rp_npy_open(ctx, paths[i], &files[i], &err) != RP_OK) {
                rc = cli_fail(&err);
                goto out;
            }
            *slots[i] = files[i];
            snprintf(names[i], sizeof one.routing_name, "%s", paths[i]);
        }
        steps = &one;
        num_steps = 1;
    }
    if (!(written = calloc((size_t)num_steps, sizeof *written))) {
        rc = cli_message(CLI_FAIL, "out of memory");
        goto out;
    }

    /* 2. the destination: never replaced silently; --append to a missing file creates it */
    struct stat out_sb;
    bool out_exists = stat(o.out, &out_sb) == 0;
    if (!out_exists && errno != ENOENT) {
        rc = cli_message(CLI_FAIL, "%s: %s", o.out, strerror(errno));
        goto out;
    }
    if (out_exists && !o.append && !o.force) {
        rc = cli_message(CLI_FAIL, "%s exists: pass --append to add to it, or --force to replace it", o.out);
        goto out;
    }
    bool append = o.append && out_exists;
    if (append) {
        if ((rc = read_trace_shape(ctx, o.out, o.experts, &t)) != CLI_OK) goto out;
        size_before = (int64_t)out_sb.st_size;
    } else {
        /* a new trace is written beside its destination and renamed into place */
        size_t n = strlen(o.out) + 32;
        if (!(tmp = malloc(n))) {
            rc = cli_message(CLI_FAIL, "out of memory");
            goto out;
        }
        snprintf(tmp, n, "%s.tmp.%ld", o.out, (long)getpid());
    }
    if ((append ? rp_trace_writer_open_append(ctx, o.out, (int32_t)o.experts, &w, &err)
                : rp_trace_writer_open(ctx, tmp, (int32_t)o.experts, &w, &err)) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }

    /* 3. every step, checked and appended; any failure undoes them all (below) */
    /* the line counts the bytes read (the id check) and written (the trace) */
    double total_bytes = 0, bytes_done = 0;
    for (int32_t i = 0; i < num_steps; i++)
        if (steps[i].routing && (steps[i].lens || steps[i].prompt))
            total_bytes += step_input_bytes(&steps[i]) + step_output_bytes(&steps[i], t.width);
    cli_progress_begin("trace import: step", num_steps, total_bytes);
    for (int32_t i = 0; i < num_steps && rc == CLI_OK; i++) {
        int64_t step = steps[i].have_step ? steps[i].step
                       : o.have_step ? o.step
                       : t.num_steps ? t.steps[t.num_steps - 1] + 1 : 0;
        rc = import_one(ctx, &o, &steps[i], step, &t, w, o.out, i, bytes_done, &written[i]);
        bytes_done += step_input_bytes(&steps[i]) + step_output_bytes(&steps[i], t.width);
        cli_progress_update(i + 1, bytes_done, NULL);
    }
    cli_progress_end();
    rp_trace_writer *closing = w;
    w = NULL;
    rp_error close_err;
    if (rp_trace_writer_close(closing, &close_err) != RP_OK && rc == CLI_OK) rc = cli_fail(&close_err);
    if (rc == CLI_OK && tmp && rename(tmp, o.out) != 0)
        rc = cli_message(CLI_FAIL, "%s: cannot rename %s into place: %s", o.out, tmp, strerror(errno));
    if (rc != CLI_OK) goto out;
    for (int32_t i = 0; i < num_steps; i++) {
        const rp_batch *b = written[i];
        printf("%s: %s step %" PRId64 " (%d sequences, %" PRId64 " tokens, %" PRId64 " layers, top-%" PRId64
               ", %" PRId64 " experts, %d-byte ids)", o.out, append || i ? "appended" : "wrote",
               t.steps[t.num_steps - num_steps + i], rp_batch_num_seqs(b), rp_batch_num_tokens(b), t.layers,
               t.top_k, o.experts, (int)t.width);
        if (i == num_steps - 1) printf("; the trace has %d step%s", t.num_steps, t.num_steps == 1 ? "" : "s");
        printf("\n");
    }
out:
    if (w) {
        rp_error ignored;
        rp_trace_writer_close(w, &ignored);
    }
    if (rc != CLI_OK) {
        if (tmp) unlink(tmp);
        /* an append that failed part way leaves the trace as it was */
        if (size_before >= 0 && truncate(o.out, size_before) != 0)
            fprintf(stderr, "routepack: %s: cannot cut back to its %" PRId64 " bytes: %s\n", o.out,
                    size_before, strerror(errno));
    }
    for (int32_t i = 0; written && i < num_steps; i++) rp_batch_free(written[i]);
    free(written);
    if (steps != &one) free(steps);
    rp_npz_close(archive);
    for (int i = 0; i < 5; i++) rp_npy_close(files[i]);
    free(t.steps);
    free(tmp);
    return rc;
}
