/* Routing traces (.rpt): reading (mmap, header checks, one streaming checksum pass, full
 * validation). The writer is core/trace_write.c; the shared layout core/trace_format.h.
 * The format, byte by byte, is in docs/formats.md. */
#include "internal.h"
#include "routing_access.h"
#include "trace_format.h"
#include "routepack/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "traces are little-endian and read in place: big-endian hosts are not supported"
#endif

#define HASH_CHUNK ((int64_t)64 << 20) /* pages dropped behind the checksum pass */
#define SCAN_BLOCK 4096           /* ids range-checked at once before an id-by-id search */

static const char *const header_keys[] = {
    "format", "version", "step", "num_seqs", "num_tokens", "num_layers", "num_experts",
    "top_k", "id_width", "payload_bytes", "checksum", NULL};


static int64_t ids_offset(const rp_trace_step_info *info)
{
    return info->payload_offset + 3 * trace_pad_to_align((int64_t)info->num_seqs * 4);
}

/* Whether any id of q[0..n) is >= limit. GCC/Clang vector extensions (16 bytes: SSE2
 * or NEON) with one compare and one OR per vector, as -O2 does not vectorize this
 * reduction by itself; the scan then runs at memory speed. */
#define ANY_AT_LEAST(T, name)                                                   \
    static bool name(const T *q, int64_t n, T limit)                            \
    {                                                                           \
        typedef T vec __attribute__((vector_size(16)));                         \
        enum { LANES = 16 / sizeof(T) };                                        \
        vec lim = (vec){0} + limit, a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};     \
        int64_t i = 0;                                                          \
        for (; i + 4 * LANES <= n; i += 4 * LANES) {                            \
            vec v0, v1, v2, v3;                                                 \
            memcpy(&v0, q + i, 16);                                             \
            memcpy(&v1, q + i + LANES, 16);                                     \
            memcpy(&v2, q + i + 2 * LANES, 16);                                 \
            memcpy(&v3, q + i + 3 * LANES, 16);                                 \
            a0 |= (vec)(v0 >= lim);                                             \
            a1 |= (vec)(v1 >= lim);                                             \
            a2 |= (vec)(v2 >= lim);                                             \
            a3 |= (vec)(v3 >= lim);                                             \
        }                                                                       \
        vec acc = a0 | a1 | a2 | a3;                                            \
        bool any = false;                                                       \
        for (int j = 0; j < LANES; j++) any |= acc[j] != 0;                     \
        for (; i < n; i++) any |= q[i] >= limit;                                \
        return any;                                                             \
    }
ANY_AT_LEAST(uint8_t, any_at_least_u8)
ANY_AT_LEAST(uint16_t, any_at_least_u16)
ANY_AT_LEAST(uint32_t, any_at_least_u32)
#undef ANY_AT_LEAST

/* Index of the first id in p[0..n) that is not below `limit` (unsigned: a negative
 * int32 is huge), or -1. Blocks are tested whole; only a failing block is searched id
 * by id. */
int64_t trace_first_bad_id(const void *p, rp_id_width width, int64_t n, uint32_t limit)
{
    if (limit > (uint32_t)(rp_id_width_capacity(width) - 1) && width != RP_ID_I32)
        return -1; /* every id of this width is in range */
    for (int64_t b = 0; b < n; b += SCAN_BLOCK) {
        int64_t m = n - b < SCAN_BLOCK ? n - b : SCAN_BLOCK;
        bool any;
        switch (width) {
        case RP_ID_U8: any = any_at_least_u8((const uint8_t *)p + b, m, (uint8_t)limit); break;
        case RP_ID_U16: any = any_at_least_u16((const uint16_t *)p + b, m, (uint16_t)limit); break;
        default: any = any_at_least_u32((const uint32_t *)p + b, m, limit); break;
        }
        if (!any) continue;
        for (int64_t i = 0; i < m; i++)
            if ((uint32_t)rp_id_load(p, width, b + i) >= limit) return b + i;
    }
    return -1;
}

/* The sequence that owns global token `token` (cu_seqlens non-decreasing, last entry
 * above `token`): the first s with cu[s + 1] > token, so empty sequences are skipped. */
int32_t trace_seq_of_token(const int64_t *cu, int32_t num_seqs, int64_t token)
{
    int32_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (cu[mid + 1] <= token) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "a value";
}

/* ---- reading ---- */

/* struct rp_trace: core/trace_format.h (the writer appends after an opened trace) */

/* "path: step block at byte N: ..." with err->offset = `offset`. */
static rp_status block_fail(rp_error *err, rp_status st, const char *path, int64_t block,
                            int64_t offset, const char *fmt, ...) RP_PRINTF(6, 7);
static rp_status block_fail(rp_error *err, rp_status st, const char *path, int64_t block,
                            int64_t offset, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rp_fail(err, st, "%s: step block at byte %" PRId64 ": %s", path, block, msg);
    if (err) err->offset = offset;
    return st;
}

/* "path: step i: ..." (the i-th block of the file, 0-based). */
static rp_status step_fail(rp_error *err, rp_status st, const rp_trace *t, int32_t i,
                           int64_t offset, const char *fmt, ...) RP_PRINTF(6, 7);
static rp_status step_fail(rp_error *err, rp_status st, const rp_trace *t, int32_t i,
                           int64_t offset, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rp_fail(err, st, "%s: step %d %s", t->path, i, msg);
    if (err) err->offset = offset;
    return st;
}

typedef struct header_ctx {
    const char *path;
    int64_t block;
    json_t *obj;
    rp_error *err;
} header_ctx;

static rp_status header_int(const header_ctx *h, const char *key, int64_t min, int64_t max,
                            int64_t *out)
{
    json_t *v = json_object_get(h->obj, key);
    int64_t hdr = h->block + PREFIX_BYTES;
    if (!v) return block_fail(h->err, RP_EFORMAT, h->path, h->block, hdr, "header key '%s' is missing", key);
    if (!json_is_integer(v))
        return block_fail(h->err, RP_EFORMAT, h->path, h->block, hdr,
                          "header key '%s' must be an integer, got %s", key, json_type_name(v));
    int64_t x = json_integer_value(v);
    if (x < min || x > max)
        return block_fail(h->err, RP_ERANGE, h->path, h->block, hdr,
                          "header key '%s' is %" PRId64 ", must be in [%" PRId64 ", %" PRId64 "]",
                          key, x, min, max);
    *out = x;
    return RP_OK;
}

/* Parse and check the JSON header of the block at `block` (its text is `text`, `len`
 * bytes, no NUL) into `info`; sizes are checked but not against the file. */
static rp_status parse_header(const char *path, int64_t block, const char *text, size_t len,
                              rp_trace_step_info *info, rp_error *err)
{
    rp_status st = RP_OK;
    int64_t hdr = block + PREFIX_BYTES;
    json_error_t jerr;
    json_t *obj = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!obj)
        return block_fail(err, RP_EFORMAT, path, block, hdr + jerr.position,
                          "header is not valid JSON: %s (header byte %d)", jerr.text, jerr.position);
    header_ctx h = {path, block, obj, err};
    if (!json_is_object(obj)) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr, "header is %s, not a JSON object",
                        json_type_name(obj));
        goto out;
    }
    /* format and version first: a later version may have other keys */
    json_t *format = json_object_get(obj, "format");
    if (!format) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr, "header key 'format' is missing");
        goto out;
    }
    if (!json_is_string(format)) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr, "header key 'format' must be a string, got %s",
                        json_type_name(format));
        goto out;
    }
    if (strcmp(json_string_value(format), "routepack-trace") != 0) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr,
                        "header format is \"%s\", not \"routepack-trace\"", json_string_value(format));
        goto out;
    }
    int64_t version, v;
    RP_CHECK_GOTO(header_int(&h, "version", 0, INT64_MAX, &version), st, out);
    if (version != RP_TRACE_VERSION) {
        st = block_fail(err, RP_ENOTSUP, path, block, hdr,
                        "unknown trace version %" PRId64 " (this build reads version %d)", version,
                        RP_TRACE_VERSION);
        goto out;
    }
    const char *key;
    json_t *value;
    json_object_foreach(obj, key, value) {
        bool known = false;
        for (const char *const *k = header_keys; *k && !known; k++) known = strcmp(*k, key) == 0;
        if (!known) {
            st = block_fail(err, RP_EFORMAT, path, block, hdr, "unknown header key '%s'", key);
            goto out;
        }
    }
    memset(info, 0, sizeof *info);
    info->offset = block;
    RP_CHECK_GOTO(header_int(&h, "step", 0, INT64_MAX, &info->step), st, out);
    RP_CHECK_GOTO(header_int(&h, "num_seqs", 0, INT32_MAX, &v), st, out);
    info->num_seqs = (int32_t)v;
    RP_CHECK_GOTO(header_int(&h, "num_tokens", 0, INT64_MAX, &info->num_tokens), st, out);
    RP_CHECK_GOTO(header_int(&h, "num_layers", 1, INT32_MAX, &v), st, out);
    info->num_layers = (int32_t)v;
    RP_CHECK_GOTO(header_int(&h, "num_experts", 1, INT32_MAX, &v), st, out);
    info->num_experts = (int32_t)v;
    RP_CHECK_GOTO(header_int(&h, "top_k", 1, info->num_experts, &v), st, out);
    info->top_k = (int32_t)v;
    RP_CHECK_GOTO(header_int(&h, "id_width", 1, 4, &v), st, out);
    if (v == 3) {
        st = block_fail(err, RP_ERANGE, path, block, hdr, "header key 'id_width' is 3, must be 1, 2 or 4");
        goto out;
    }
    info->width = (rp_id_width)v;
    if (info->num_experts > rp_id_width_capacity(info->width)) {
        st = block_fail(err, RP_ERANGE, path, block, hdr,
                        "%d experts do not fit %d-byte ids (at most %" PRId64 ")", info->num_experts,
                        (int)info->width, rp_id_width_capacity(info->width));
        goto out;
    }
    RP_CHECK_GOTO(header_int(&h, "payload_bytes", 0, INT64_MAX, &info->payload_bytes), st, out);
    json_t *sum = json_object_get(obj, "checksum");
    if (!sum) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr, "header key 'checksum' is missing");
        goto out;
    }
    const char *hex = json_is_string(sum) ? json_string_value(sum) : NULL;
    bool hex_ok = hex && strlen(hex) == CHECKSUM_DIGITS;
    for (int i = 0; hex_ok && i < CHECKSUM_DIGITS; i++)
        hex_ok = (hex[i] >= '0' && hex[i] <= '9') || (hex[i] >= 'a' && hex[i] <= 'f');
    if (!hex_ok) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr,
                        "header key 'checksum' must be 16 lowercase hex digits, got %s%s%s",
                        hex ? "\"" : "", hex ? hex : json_type_name(sum), hex ? "\"" : "");
        goto out;
    }
    info->checksum = strtoull(hex, NULL, 16);

    layout lay;
    if (!trace_compute_layout(info->num_seqs, info->num_tokens, info->num_layers, info->top_k,
                        info->width, &lay)) {
        st = block_fail(err, RP_ERANGE, path, block, hdr,
                        "sizes overflow: %" PRId64 " tokens x %d layers x top-%d x %d-byte ids "
                        "does not fit in 64 bits",
                        info->num_tokens, info->num_layers, info->top_k, (int)info->width);
        goto out;
    }
    if (lay.payload_bytes != info->payload_bytes) {
        st = block_fail(err, RP_EFORMAT, path, block, hdr,
                        "payload_bytes is %" PRId64 ", but %d sequences and %" PRId64
                        " tokens x %d layers x top-%d x %d-byte ids make %" PRId64,
                        info->payload_bytes, info->num_seqs, info->num_tokens, info->num_layers,
                        info->top_k, (int)info->width, lay.payload_bytes);
        goto out;
    }
out:
    json_decref(obj);
    return st;
}

static uint32_t load_u32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Check the block that starts at `block` and fill `info`. */
static rp_status parse_block(const char *path, const unsigned char *map, int64_t size,
                             int64_t block, rp_trace_step_info *info, rp_error *err)
{
    int64_t left = size - block;
    size_t cmp = left < (int64_t)sizeof TRACE_MAGIC ? (size_t)left : sizeof TRACE_MAGIC;
    if (memcmp(map + block, TRACE_MAGIC, cmp) != 0) {
        /* LF where CR LF should be: the file went through a text-mode transfer */
        bool mangled = cmp >= 5 && memcmp(map + block, TRACE_MAGIC, 4) == 0 && map[block + 4] == '\n';
        return block_fail(err, RP_EFORMAT, path, block, block, "bad magic: %s%s",
                          block == 0 ? "not a routing trace" : "not the start of a step block (trailing garbage?)",
                          mangled ? " (line endings were converted: copy the file in binary mode)" : "");
    }
    if (left < PREFIX_BYTES)
        return block_fail(err, RP_EFORMAT, path, block, size,
                          "truncated: the block prefix ends at byte %" PRId64 ", but the file has %"
                          PRId64 " bytes (%" PRId64 " missing)", block + PREFIX_BYTES, size,
                          PREFIX_BYTES - left);
    uint32_t header_bytes = load_u32(map + block + 8), reserved = load_u32(map + block + 12);
    if (reserved != 0)
        return block_fail(err, RP_EFORMAT, path, block, block + 12,
                          "reserved field at byte %" PRId64 " is %u, must be 0", block + 12, reserved);
    if (header_bytes == 0 || header_bytes > MAX_HEADER_BYTES)
        return block_fail(err, RP_EFORMAT, path, block, block + 8,
                          "header size %u is out of range [1, %d]", header_bytes, MAX_HEADER_BYTES);
    int64_t header_end = block + PREFIX_BYTES + header_bytes;
    if (header_end > size)
        return block_fail(err, RP_EFORMAT, path, block, size,
                          "truncated: the header ends at byte %" PRId64 ", but the file has %" PRId64
                          " bytes (%" PRId64 " missing)", header_end, size, header_end - size);
    const char *text = (const char *)map + block + PREFIX_BYTES;
    const char *nul = memchr(text, '\0', header_bytes);
    if (nul)
        return block_fail(err, RP_EFORMAT, path, block, (int64_t)((const unsigned char *)nul - map),
                          "header has a NUL byte at byte %" PRId64,
                          (int64_t)((const unsigned char *)nul - map));
    rp_status st = parse_header(path, block, text, header_bytes, info, err);
    if (st != RP_OK) return st;
    info->payload_offset = block + trace_pad_to_align(PREFIX_BYTES + (int64_t)header_bytes);
    int64_t end;
    if (rp_add_overflow(info->payload_offset, info->payload_bytes, &end) || end > size) {
        int64_t need = end > size ? end : INT64_MAX;
        return block_fail(err, RP_EFORMAT, path, block, size,
                          "truncated: the payload ends at byte %" PRId64 ", but the file has %" PRId64
                          " bytes (%" PRId64 " missing)", need, size, need - size);
    }
    for (int64_t p = header_end; p < info->payload_offset; p++)
        if (map[p] != 0)
            return block_fail(err, RP_EFORMAT, path, block, p,
                              "header padding byte at %" PRId64 " is 0x%02x, must be 0", p, map[p]);
    return RP_OK;
}

/* Drop the whole pages of a mapped range that a pass has finished with from this
 * process (they stay in the page cache and fault back in if touched), so a pass over
 * a 6 GB trace does not grow the resident set by 6 GB. */
static void drop_pages(const unsigned char *map, int64_t begin, int64_t len)
{
    int64_t page = sysconf(_SC_PAGESIZE);
    int64_t lo = (begin + page - 1) / page * page, hi = (begin + len) / page * page;
    if (hi > lo) madvise((void *)(map + lo), (size_t)(hi - lo), MADV_DONTNEED);
}

/* Payload bytes of every step: the total of a pass over the trace's payloads. */
static int64_t payload_total(const rp_trace *t)
{
    int64_t total = 0;
    for (int32_t i = 0; i < t->num_steps; i++) total += t->steps[i].payload_bytes; /* <= file size */
    return total;
}

/* XXH64 of a mapped range, in one sequential pass; progress as "verifying", the range
 * being bytes [*done, *done + len) of `total`. */
static uint64_t hash_mapped(rp_context *ctx, const unsigned char *map, int64_t begin, int64_t len,
                            int64_t *done, int64_t total)
{
    rp_hash_state hs;
    rp_hash_init(&hs, 0);
    for (int64_t off = 0; off < len; off += HASH_CHUNK) {
        int64_t n = len - off < HASH_CHUNK ? len - off : HASH_CHUNK;
        rp_hash_update(&hs, map + begin + off, (size_t)n);
        drop_pages(map, begin + off, n);
        *done += n;
        rp_progress(ctx, "verifying", *done, total);
    }
    return rp_hash_final(&hs);
}

static rp_status checksum_fail(rp_error *err, const rp_trace *t, int32_t i, uint64_t got)
{
    const rp_trace_step_info *s = &t->steps[i];
    return step_fail(err, RP_ECHECKSUM, t, i, s->payload_offset,
                     "(block at byte %" PRId64 "): payload checksum mismatch: bytes %" PRId64
                     "..%" PRId64 " hash to %016" PRIx64 ", the header says %016" PRIx64
                     ": the file is corrupt", s->offset, s->payload_offset,
                     s->payload_offset + s->payload_bytes, got, s->checksum);
}

rp_status rp_trace_open(rp_context *ctx, const char *path, unsigned flags, rp_trace **out,
                        rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "trace: NULL argument");
    if (flags & ~RP_TRACE_NO_VERIFY)
        return rp_fail(err, RP_EINVAL, "%s: unknown flags 0x%x", path, flags & ~RP_TRACE_NO_VERIFY);
    rp_status st = RP_OK;
    rp_trace *t = NULL;
    void *map = MAP_FAILED;
    struct stat sb;
    int fd;
    if ((st = rp_file_open_regular(path, O_RDONLY, &fd, NULL, err)) != RP_OK) return st;
    if (fstat(fd, &sb) != 0) {
        st = rp_fail(err, RP_EIO, "%s: cannot stat: %s", path, strerror(errno));
        goto out;
    }
    if (sb.st_size == 0) {
        st = rp_fail(err, RP_EFORMAT, "%s: empty file, not a routing trace", path);
        if (err) err->offset = 0;
        goto out;
    }
    map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        st = rp_fail(err, RP_EIO, "%s: cannot map: %s", path, strerror(errno));
        goto out;
    }
    t = rp_calloc(ctx, 1, sizeof *t);
    if (!t || !(t->path = rp_strdup(ctx, path))) {
        st = rp_fail_nomem(err, "a trace");
        goto out;
    }
    t->ctx = ctx;
    t->map = map;
    t->map_bytes = (size_t)sb.st_size;
    int32_t cap = 0;
    for (int64_t block = 0; block < sb.st_size;) {
        rp_trace_step_info info;
        RP_CHECK_GOTO(parse_block(path, map, sb.st_size, block, &info, err), st, out);
        if (t->num_steps > 0) {
            const rp_trace_step_info *first = &t->steps[0];
            if (info.num_layers != first->num_layers || info.num_experts != first->num_experts ||
                info.top_k != first->top_k || info.width != first->width) {
                st = block_fail(err, RP_EFORMAT, path, block, block,
                                "shape %d layers, %d experts, top-%d, %d-byte ids differs from the "
                                "first step's %d layers, %d experts, top-%d, %d-byte ids",
                                info.num_layers, info.num_experts, info.top_k, (int)info.width,
                                first->num_layers, first->num_experts, first->top_k, (int)first->width);
                goto out;
            }
        }
        if (t->num_steps == INT32_MAX) {
            st = block_fail(err, RP_ERANGE, path, block, block, "more than 2^31-1 steps");
            goto out;
        }
        if (t->num_steps == cap) {
            int32_t ncap = cap ? (cap > INT32_MAX / 2 ? INT32_MAX : cap * 2) : 8;
            rp_trace_step_info *ns = rp_realloc(ctx, t->steps, (size_t)ncap * sizeof *ns);
            if (!ns) {
                st = rp_fail_nomem(err, "the step table of a trace");
                goto out;
            }
            t->steps = ns;
            cap = ncap;
        }
        t->steps[t->num_steps++] = info;
        block = info.payload_offset + info.payload_bytes;
    }
    if (!(flags & RP_TRACE_NO_VERIFY)) {
        madvise(map, (size_t)sb.st_size, MADV_SEQUENTIAL);
        int64_t done = 0, total = payload_total(t);
        for (int32_t i = 0; i < t->num_steps; i++) {
            uint64_t got = hash_mapped(ctx, t->map, t->steps[i].payload_offset, t->steps[i].payload_bytes,
                                       &done, total);
            if (got != t->steps[i].checksum) {
                st = checksum_fail(err, t, i, got);
                goto out;
            }
        }
        madvise(map, (size_t)sb.st_size, MADV_NORMAL);
    }
    *out = t;
    t = NULL;
    map = MAP_FAILED;
out:
    if (t) {
        rp_free(ctx, t->steps);
        rp_free(ctx, t->path);
        rp_free(ctx, t);
    }
    if (map != MAP_FAILED) munmap(map, (size_t)sb.st_size);
    close(fd);
    return st;
}

void rp_trace_close(rp_trace *t)
{
    if (!t) return;
    munmap((void *)t->map, t->map_bytes);
    rp_free(t->ctx, t->steps);
    rp_free(t->ctx, t->path);
    rp_free(t->ctx, t);
}

int32_t rp_trace_num_steps(const rp_trace *t) { return t->num_steps; }

const rp_trace_step_info *rp_trace_step(const rp_trace *t, int32_t i)
{
    return i >= 0 && i < t->num_steps ? &t->steps[i] : NULL;
}

/* The three int32 arrays of step i (aligned: the map is page-aligned, arrays 64). */
static void step_arrays(const rp_trace *t, int32_t i, const int32_t **prompt,
                        const int32_t **response, const int32_t **group)
{
    const rp_trace_step_info *s = &t->steps[i];
    int64_t lens = trace_pad_to_align((int64_t)s->num_seqs * 4);
    *prompt = (const int32_t *)(t->map + s->payload_offset);
    *response = (const int32_t *)(t->map + s->payload_offset + lens);
    *group = (const int32_t *)(t->map + s->payload_offset + 2 * lens);
}

/* Lengths non-negative, each sequence below 2^31 tokens, summing to num_tokens. */
static rp_status check_lengths(const rp_trace *t, int32_t i, rp_error *err)
{
    const rp_trace_step_info *s = &t->steps[i];
    const int32_t *prompt, *response, *group;
    step_arrays(t, i, &prompt, &response, &group);
    int64_t lens = trace_pad_to_align((int64_t)s->num_seqs * 4), total = 0;
    for (int32_t q = 0; q < s->num_seqs; q++) {
        if (prompt[q] < 0 || response[q] < 0) {
            bool p = prompt[q] < 0;
            step_fail(err, RP_EFORMAT, t, i,
                      s->payload_offset + (p ? 0 : lens) + (int64_t)q * 4,
                      "sequence %d has a negative %s length %d (byte %" PRId64 ")", q,
                      p ? "prompt" : "response", p ? prompt[q] : response[q],
                      s->payload_offset + (p ? 0 : lens) + (int64_t)q * 4);
            if (err) err->sequence = q;
            return RP_EFORMAT;
        }
        if (prompt[q] > INT32_MAX - response[q]) {
            step_fail(err, RP_EFORMAT, t, i, s->payload_offset + (int64_t)q * 4,
                      "sequence %d is longer than 2^31-1 tokens (prompt %d, response %d)", q,
                      prompt[q], response[q]);
            if (err) err->sequence = q;
            return RP_EFORMAT;
        }
        total += (int64_t)prompt[q] + response[q]; /* < 2^31 * 2^31: no overflow */
    }
    if (total != s->num_tokens)
        return step_fail(err, RP_EFORMAT, t, i, s->payload_offset,
                         "sequence lengths sum to %" PRId64 " tokens, but the header says %" PRId64,
                         total, s->num_tokens);
    return RP_OK;
}

rp_status rp_trace_read_step(rp_trace *t, int32_t i, rp_batch **batch, rp_routing *routing,
                             rp_error *err)
{
    if (!t || !batch || !routing) return rp_fail(err, RP_EINVAL, "trace: NULL argument");
    if (i < 0 || i >= t->num_steps)
        return rp_fail(err, RP_EINVAL, "%s: step %d does not exist (the trace has %d steps)",
                       t->path, i, t->num_steps);
    rp_status st = check_lengths(t, i, err);
    if (st != RP_OK) return st;
    const rp_trace_step_info *s = &t->steps[i];
    const int32_t *prompt, *response, *group;
    step_arrays(t, i, &prompt, &response, &group);
    rp_batch *b;
    st = rp_batch_new(t->ctx, s->num_seqs, prompt, response, group, &b, err);
    if (st != RP_OK) return st;
    *batch = b;
    rp_routing_packed(routing, s->width, s->num_layers, s->top_k, t->map + ids_offset(s));
    return RP_OK;
}

/* Report the id at packed index `index` of step i as out of range. Lengths are valid. */
static rp_status bad_id_fail(const rp_trace *t, int32_t i, int64_t index, rp_error *err)
{
    const rp_trace_step_info *s = &t->steps[i];
    const int32_t *prompt, *response, *group;
    step_arrays(t, i, &prompt, &response, &group);
    int64_t per_token = (int64_t)s->num_layers * s->top_k;
    int64_t token = index / per_token, rest = index % per_token, first = 0;
    int32_t q = 0;
    for (; q < s->num_seqs; q++) {
        int64_t len = (int64_t)prompt[q] + response[q];
        if (token < first + len) break;
        first += len;
    }
    int64_t at = ids_offset(s) + index * (int64_t)s->width;
    int32_t id = rp_id_load(t->map + ids_offset(s), s->width, index);
    step_fail(err, RP_ERANGE, t, i, at,
              "sequence %d token %" PRId64 " layer %" PRId64 " choice %" PRId64
              " has expert id %d, but the model has %d experts (byte %" PRId64 ")",
              q, token - first, rest / s->top_k, rest % s->top_k, id, s->num_experts, at);
    if (err) err->sequence = q, err->expert = id;
    return RP_ERANGE;
}

rp_status rp_trace_validate(rp_trace *t, rp_error *err)
{
    if (!t) return rp_fail(err, RP_EINVAL, "trace: NULL argument");
    /* One pass a step: hash every chunk and scan the ids in it. A checksum mismatch
     * is reported before a bad id, since corruption is then the likelier cause. */
    madvise((void *)t->map, t->map_bytes, MADV_SEQUENTIAL);
    rp_status st = RP_OK;
    int64_t done = 0, total = payload_total(t);
    for (int32_t i = 0; i < t->num_steps && st == RP_OK; i++) {
        const rp_trace_step_info *s = &t->steps[i];
        int64_t ids_begin = ids_offset(s);
        int64_t ids_end = ids_begin + (s->num_tokens * s->num_layers * s->top_k) * (int64_t)s->width;
        int64_t end = s->payload_offset + s->payload_bytes, bad = -1;
        rp_hash_state hs;
        rp_hash_init(&hs, 0);
        for (int64_t off = s->payload_offset; off < end; off += HASH_CHUNK) {
            int64_t n = end - off < HASH_CHUNK ? end - off : HASH_CHUNK;
            rp_hash_update(&hs, t->map + off, (size_t)n);
            int64_t lo = off > ids_begin ? off : ids_begin;
            int64_t hi = off + n < ids_end ? off + n : ids_end;
            if (bad < 0 && hi > lo) {
                int64_t r = trace_first_bad_id(t->map + lo, s->width, (hi - lo) / s->width,
                                         (uint32_t)s->num_experts);
                if (r >= 0) bad = (lo - ids_begin) / s->width + r;
            }
            drop_pages(t->map, off, n);
            done += n;
            rp_progress(t->ctx, "validating", done, total);
        }
        uint64_t got = rp_hash_final(&hs);
        if (got != s->checksum) st = checksum_fail(err, t, i, got);
        else if ((st = check_lengths(t, i, err)) != RP_OK) break;
        else if (bad >= 0) st = bad_id_fail(t, i, bad, err);
    }
    madvise((void *)t->map, t->map_bytes, MADV_NORMAL);
    return st;
}
