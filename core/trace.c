/* Routing traces (.rpt): reading (mmap, header checks, one streaming checksum pass, full
 * validation) and writing (streamed in chunks, checksummed, all or nothing per step).
 * The format, byte by byte, is in docs/formats.md. */
#include "internal.h"
#include "routing_access.h"
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

/* PNG-style: the high byte catches 7-bit transfers, CR LF and LF catch line-ending
 * conversion, ^Z stops a DOS `type`. */
static const unsigned char MAGIC[8] = {0x89, 'R', 'P', 'T', '\r', '\n', 0x1a, '\n'};

#define ALIGN 64                  /* every block and every payload array starts here */
#define PREFIX_BYTES 16           /* magic, uint32 header_bytes, uint32 reserved */
#define MAX_HEADER_BYTES 65536    /* a real header is ~250 bytes; bounds what we parse */
#define CHECKSUM_DIGITS 16
#define WRITE_CHUNK ((size_t)4 << 20)  /* writer buffer */
#define HASH_CHUNK ((int64_t)64 << 20) /* pages dropped behind the checksum pass */
#define SCAN_BLOCK 4096           /* ids range-checked at once before an id-by-id search */

static const char *const header_keys[] = {
    "format", "version", "step", "num_seqs", "num_tokens", "num_layers", "num_experts",
    "top_k", "id_width", "payload_bytes", "checksum", NULL};

/* ---- layout of one step's payload ---- */

typedef struct layout {
    int64_t lens_bytes;    /* one int32[num_seqs] array, padded to ALIGN */
    int64_t ids_count;     /* num_tokens * num_layers * top_k */
    int64_t ids_bytes;     /* ids_count * width, unpadded */
    int64_t payload_bytes; /* 3 * lens_bytes + ids_bytes padded */
} layout;

static int64_t pad_to_align(int64_t n) { return (n + ALIGN - 1) & ~(int64_t)(ALIGN - 1); }

/* False when a size does not fit in int64. */
static bool compute_layout(int32_t num_seqs, int64_t num_tokens, int32_t num_layers,
                           int32_t top_k, int width, layout *out)
{
    int64_t ids, bytes;
    if (rp_mul_overflow(num_tokens, num_layers, &ids) || rp_mul_overflow(ids, top_k, &ids) ||
        rp_mul_overflow(ids, width, &bytes) || bytes > INT64_MAX - ALIGN)
        return false;
    out->lens_bytes = pad_to_align((int64_t)num_seqs * 4);
    out->ids_count = ids;
    out->ids_bytes = bytes;
    return !rp_add_overflow(pad_to_align(bytes), 3 * out->lens_bytes, &out->payload_bytes);
}

static int64_t ids_offset(const rp_trace_step_info *info)
{
    return info->payload_offset + 3 * pad_to_align((int64_t)info->num_seqs * 4);
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
static int64_t first_bad_id(const void *p, rp_id_width width, int64_t n, uint32_t limit)
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
static int32_t seq_of_token(const int64_t *cu, int32_t num_seqs, int64_t token)
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

struct rp_trace {
    rp_context *ctx;
    char *path;
    const unsigned char *map;
    size_t map_bytes;
    int32_t num_steps;
    rp_trace_step_info *steps;
};

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
    if (!compute_layout(info->num_seqs, info->num_tokens, info->num_layers, info->top_k,
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
    size_t cmp = left < (int64_t)sizeof MAGIC ? (size_t)left : sizeof MAGIC;
    if (memcmp(map + block, MAGIC, cmp) != 0) {
        /* LF where CR LF should be: the file went through a text-mode transfer */
        bool mangled = cmp >= 5 && memcmp(map + block, MAGIC, 4) == 0 && map[block + 4] == '\n';
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
    info->payload_offset = block + pad_to_align(PREFIX_BYTES + (int64_t)header_bytes);
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
    int64_t lens = pad_to_align((int64_t)s->num_seqs * 4);
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
    int64_t lens = pad_to_align((int64_t)s->num_seqs * 4), total = 0;
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
                int64_t r = first_bad_id(t->map + lo, s->width, (hi - lo) / s->width,
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

/* ---- writing ---- */

struct rp_trace_writer {
    rp_context *ctx;
    char *path;
    int fd;
    int32_t num_experts;
    int64_t end;               /* file size: where the next block starts */
    int32_t num_steps;
    int32_t num_layers, top_k; /* of the trace's steps; 0 before the first */
    rp_id_width width;
    bool broken;               /* a failed rollback left a partial step behind */
    unsigned char *buf;        /* WRITE_CHUNK bytes, allocated at the first append */
};

/* Buffered, optionally hashed output at an explicit file position. */
typedef struct sink {
    rp_trace_writer *w;
    int64_t pos;   /* file position of buf[0] */
    size_t fill;
    bool hashing;  /* in the payload: hashed, and its progress reported */
    rp_hash_state hash;
    int64_t payload, payload_bytes; /* file position and size of the payload */
    int64_t reported;               /* payload bytes last reported, -1 before any */
    rp_error *err;
} sink;

/* Payload bytes written so far, through the context's progress hook. */
static void sink_progress(sink *s)
{
    if (!s->hashing || s->pos - s->payload == s->reported) return;
    s->reported = s->pos - s->payload;
    rp_progress(s->w->ctx, "writing", s->reported, s->payload_bytes);
}

static rp_status pwrite_all(rp_trace_writer *w, const void *data, size_t n, int64_t pos,
                            rp_error *err)
{
    const char *p = data;
    while (n > 0) {
        ssize_t got = pwrite(w->fd, p, n, (off_t)pos);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            return rp_fail(err, RP_EIO, "write error at byte %" PRId64 ": %s", pos,
                           got < 0 ? strerror(errno) : "no progress");
        p += got;
        pos += got;
        n -= (size_t)got;
    }
    return RP_OK;
}

static rp_status sink_flush(sink *s)
{
    if (s->fill == 0) return RP_OK;
    if (s->hashing) rp_hash_update(&s->hash, s->w->buf, s->fill);
    rp_status st = pwrite_all(s->w, s->w->buf, s->fill, s->pos, s->err);
    s->pos += (int64_t)s->fill;
    s->fill = 0;
    if (st == RP_OK) sink_progress(s);
    return st;
}

static rp_status sink_put(sink *s, const void *data, size_t n)
{
    const unsigned char *p = data;
    while (n > 0) {
        size_t take = WRITE_CHUNK - s->fill < n ? WRITE_CHUNK - s->fill : n;
        if (p) memcpy(s->w->buf + s->fill, p, take), p += take;
        else memset(s->w->buf + s->fill, 0, take);
        s->fill += take;
        n -= take;
        if (s->fill == WRITE_CHUNK) {
            rp_status st = sink_flush(s);
            if (st != RP_OK) return st;
        }
    }
    return RP_OK;
}

/* Zero bytes up to the next multiple of ALIGN from `since` (a file position). */
static rp_status sink_pad(sink *s, int64_t since)
{
    int64_t at = s->pos + (int64_t)s->fill - since;
    return sink_put(s, NULL, (size_t)(pad_to_align(at) - at));
}

/* Write caller memory without copying it into the buffer. */
static rp_status sink_direct(sink *s, const void *data, size_t n)
{
    rp_status st = sink_flush(s);
    if (st != RP_OK) return st;
    if (s->hashing) rp_hash_update(&s->hash, data, n);
    st = pwrite_all(s->w, data, n, s->pos, s->err);
    s->pos += (int64_t)n;
    if (st == RP_OK) sink_progress(s);
    return st;
}

/* "path: appending step K: <message of err>", keeping err's positions. */
static rp_status prefix_fail(rp_error *err, rp_status st, const rp_trace_writer *w, int64_t step)
{
    if (!err) return st;
    char msg[RP_ERROR_TEXT];
    snprintf(msg, sizeof msg, "%s", err->text);
    int64_t sequence = err->sequence, expert = err->expert, offset = err->offset;
    rp_fail(err, st, "%s: appending step %" PRId64 ": %s", w->path, step, msg);
    err->sequence = sequence, err->expert = expert, err->offset = offset;
    return st;
}

static rp_status bad_write_id(rp_error *err, int32_t seq, int64_t token, int32_t layer,
                              int64_t choice, int32_t id, int32_t num_experts)
{
    rp_fail(err, RP_ERANGE,
            "sequence %d token %" PRId64 " layer %d choice %" PRId64
            " has expert id %d, but the model has %d experts",
            seq, token, layer, choice, id, num_experts);
    if (err) err->sequence = seq, err->expert = id;
    return RP_ERANGE;
}

/* Ids of a contiguous run that is already in packed order (a dense packed array, or a
 * dense per-sequence array): checked and written in chunks straight from the caller's
 * memory. `first_token` is the run's first global token, for messages. */
static rp_status write_run(sink *s, const void *ids, int64_t count, const rp_routing *r,
                           const int64_t *cu, int32_t num_seqs, int64_t first_token)
{
    const size_t width = (size_t)r->width;
    const int64_t chunk = (int64_t)(WRITE_CHUNK / width);
    const int64_t per_token = (int64_t)r->num_layers * r->top_k;
    for (int64_t off = 0; off < count; off += chunk) {
        int64_t n = count - off < chunk ? count - off : chunk;
        const unsigned char *p = (const unsigned char *)ids + off * (int64_t)width;
        int64_t bad = first_bad_id(p, r->width, n, (uint32_t)s->w->num_experts);
        if (bad >= 0) {
            int64_t index = off + bad, token = first_token + index / per_token;
            int64_t rest = index % per_token;
            int32_t seq = seq_of_token(cu, num_seqs, token);
            return bad_write_id(s->err, seq, token - cu[seq], (int32_t)(rest / r->top_k),
                                rest % r->top_k, rp_id_load(p, r->width, bad), s->w->num_experts);
        }
        rp_status st = sink_direct(s, p, (size_t)n * width);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

/* Check, hash and write the gathered ids in the buffer; `*done` counts the ids of the
 * step written before them, to name the position of a bad one. */
static rp_status flush_gathered(sink *s, const rp_routing *r, const int64_t *cu, int32_t num_seqs,
                                int64_t *done)
{
    int64_t n = (int64_t)(s->fill / (size_t)r->width);
    int64_t bad = first_bad_id(s->w->buf, r->width, n, (uint32_t)s->w->num_experts);
    if (bad >= 0) {
        int64_t per_token = (int64_t)r->num_layers * r->top_k, index = *done + bad;
        int64_t token = index / per_token, rest = index % per_token;
        int32_t seq = seq_of_token(cu, num_seqs, token);
        return bad_write_id(s->err, seq, token - cu[seq], (int32_t)(rest / r->top_k),
                            rest % r->top_k, rp_id_load(s->w->buf, r->width, bad),
                            s->w->num_experts);
    }
    *done += n;
    return sink_flush(s);
}

/* Ids of any layout, gathered into the buffer in packed order: the k choices of one
 * (token, layer) are one copy when they are contiguous. Ids are checked a buffer at a
 * time, before the buffer is hashed and written. */
static rp_status write_gathered(sink *s, const rp_routing *r, const int64_t *cu,
                                int32_t num_seqs, const void **layer_at)
{
    const size_t width = (size_t)r->width;
    const size_t room_ids = WRITE_CHUNK / width;
    int64_t done = 0;
    rp_status st = sink_flush(s); /* the buffer then holds ids only */
    if (st != RP_OK) return st;
    for (int32_t q = 0; q < num_seqs; q++) {
        int64_t len = cu[q + 1] - cu[q];
        for (int32_t l = 0; l < r->num_layers; l++) layer_at[l] = rp_routing_at(r, cu, q, l);
        for (int64_t tok = 0; tok < len; tok++)
            for (int32_t l = 0; l < r->num_layers; l++) {
                const unsigned char *src = (const unsigned char *)layer_at[l] +
                                           tok * r->token_stride * (int64_t)width;
                for (int32_t j = 0; j < r->top_k;) {
                    size_t free_ids = room_ids - s->fill / width;
                    if (free_ids == 0) {
                        if ((st = flush_gathered(s, r, cu, num_seqs, &done)) != RP_OK) return st;
                        free_ids = room_ids;
                    }
                    size_t take = (size_t)(r->top_k - j) < free_ids ? (size_t)(r->top_k - j) : free_ids;
                    unsigned char *dst = s->w->buf + s->fill;
                    if (r->k_stride == 1) {
                        memcpy(dst, src + (size_t)j * width, take * width);
                    } else {
                        for (size_t x = 0; x < take; x++) {
                            const unsigned char *from = src + (j + (int64_t)x) * r->k_stride * (int64_t)width;
                            switch (width) {
                            case 1: dst[x] = *from; break;
                            case 2: memcpy(dst + 2 * x, from, 2); break;
                            default: memcpy(dst + 4 * x, from, 4); break;
                            }
                        }
                    }
                    s->fill += take * width;
                    j += (int32_t)take;
                }
            }
    }
    return flush_gathered(s, r, cu, num_seqs, &done);
}

static bool dense_strides(const rp_routing *r)
{
    return r->k_stride == 1 && r->layer_stride == r->top_k &&
           r->token_stride == (int64_t)r->num_layers * r->top_k;
}

static rp_status write_ids(sink *s, const rp_routing *r, const rp_batch *batch,
                           const void **layer_at)
{
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    int32_t num_seqs = rp_batch_num_seqs(batch);
    int64_t per_token = (int64_t)r->num_layers * r->top_k;
    if (r->layout == RP_ROUTING_PACKED && dense_strides(r))
        return write_run(s, r->base, cu[num_seqs] * per_token, r, cu, num_seqs, 0);
    if (r->layout == RP_ROUTING_PER_SEQ && dense_strides(r)) {
        for (int32_t q = 0; q < num_seqs; q++) {
            rp_status st = write_run(s, r->bases[q], (cu[q + 1] - cu[q]) * per_token, r, cu,
                                     num_seqs, cu[q]);
            if (st != RP_OK) return st;
        }
        return RP_OK;
    }
    return write_gathered(s, r, cu, num_seqs, layer_at);
}

/* The writer without its file (allocated first: an allocation failure must not leave
 * a new, empty file behind). */
static rp_trace_writer *writer_new(rp_context *ctx, const char *path, int32_t num_experts)
{
    rp_trace_writer *w = rp_calloc(ctx, 1, sizeof *w);
    if (!w || !(w->path = rp_strdup(ctx, path))) {
        rp_free(ctx, w);
        return NULL;
    }
    w->ctx = ctx;
    w->fd = -1;
    w->num_experts = num_experts;
    return w;
}

static void writer_free(rp_trace_writer *w)
{
    rp_context *ctx = w->ctx;
    rp_free(ctx, w->buf);
    rp_free(ctx, w->path);
    rp_free(ctx, w);
}

rp_status rp_trace_writer_open(rp_context *ctx, const char *path, int32_t num_experts,
                               rp_trace_writer **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    if (num_experts < 1)
        return rp_fail(err, RP_EINVAL, "%s: %d experts, must be >= 1", path, num_experts);
    rp_trace_writer *w = writer_new(ctx, path, num_experts);
    if (!w) return rp_fail_nomem(err, "a trace writer");
    w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (w->fd < 0) {
        rp_status st = rp_fail(err, RP_EIO, "%s: cannot create: %s", path, strerror(errno));
        writer_free(w);
        return st;
    }
    *out = w;
    return RP_OK;
}

rp_status rp_trace_writer_open_append(rp_context *ctx, const char *path, int32_t num_experts,
                                      rp_trace_writer **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    rp_trace *t = NULL;
    rp_trace_writer *w = NULL;
    rp_status st = rp_trace_open(ctx, path, RP_TRACE_NO_VERIFY, &t, err);
    if (st != RP_OK) return st;
    const rp_trace_step_info *first = &t->steps[0];
    int64_t size = (int64_t)t->map_bytes;
    struct stat sb;
    if (first->num_experts != num_experts) {
        st = rp_fail(err, RP_EINVAL, "%s: the trace has %d experts, not %d", path,
                     first->num_experts, num_experts);
    } else if (!(w = writer_new(ctx, path, num_experts))) {
        st = rp_fail_nomem(err, "a trace writer");
    } else if ((st = rp_file_open_regular(path, O_WRONLY, &w->fd, NULL, err)) != RP_OK) {
        w->fd = -1; /* replaced by a FIFO or device since it was read: refused, never blocks */
    } else if (fstat(w->fd, &sb) != 0 || sb.st_size != size) {
        st = rp_fail(err, RP_EIO, "%s: the file changed while it was opened for appending", path);
    } else {
        w->end = size;
        w->num_steps = t->num_steps;
        w->num_layers = first->num_layers;
        w->top_k = first->top_k;
        w->width = first->width;
        *out = w;
        w = NULL;
    }
    if (w) {
        if (w->fd >= 0) close(w->fd);
        writer_free(w);
    }
    rp_trace_close(t);
    return st;
}

/* The header text of a step, with a placeholder checksum, into buf (NUL-terminated);
 * its length, or 0 when jansson ran out of memory or the text does not fit. */
static size_t header_text(char *buf, size_t size, int64_t step, int32_t num_seqs,
                          int64_t num_tokens, const rp_routing *r, int32_t num_experts,
                          int64_t payload_bytes)
{
    json_t *h = json_object();
    if (!h) return 0;
    int bad = 0;
    bad |= json_object_set_new(h, "format", json_string("routepack-trace"));
    bad |= json_object_set_new(h, "version", json_integer(RP_TRACE_VERSION));
    bad |= json_object_set_new(h, "step", json_integer(step));
    bad |= json_object_set_new(h, "num_seqs", json_integer(num_seqs));
    bad |= json_object_set_new(h, "num_tokens", json_integer(num_tokens));
    bad |= json_object_set_new(h, "num_layers", json_integer(r->num_layers));
    bad |= json_object_set_new(h, "num_experts", json_integer(num_experts));
    bad |= json_object_set_new(h, "top_k", json_integer(r->top_k));
    bad |= json_object_set_new(h, "id_width", json_integer((int)r->width));
    bad |= json_object_set_new(h, "payload_bytes", json_integer(payload_bytes));
    bad |= json_object_set_new(h, "checksum", json_string("0000000000000000"));
    size_t n = bad ? 0 : json_dumpb(h, buf, size - 1, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (n == 0 || n >= size) return 0;
    buf[n] = '\0';
    return n;
}

rp_status rp_trace_writer_append(rp_trace_writer *w, int64_t step, const rp_batch *batch,
                                 const rp_routing *routing, rp_error *err)
{
    if (!w || !batch || !routing) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    if (w->broken)
        return rp_fail(err, RP_EIO, "%s: an earlier failed append could not be undone; the "
                       "file is not a valid trace", w->path);
    rp_status st = RP_OK;
    char header[1024];
    const void **layer_at = NULL;
    int64_t start = w->end;
    sink s = {.w = w, .pos = start, .err = err, .reported = -1};

    if (step < 0) return rp_fail(err, RP_EINVAL, "%s: step index %" PRId64 " is negative", w->path, step);
    st = rp_routing_check_shape(routing, batch, w->num_experts, err);
    if (st != RP_OK) return prefix_fail(err, st, w, step);
    if (w->num_experts > rp_id_width_capacity(routing->width))
        return rp_fail(err, RP_EINVAL, "%s: appending step %" PRId64 ": %d-byte ids cannot hold "
                       "the trace's %d experts (at most %" PRId64 ")", w->path, step,
                       (int)routing->width, w->num_experts, rp_id_width_capacity(routing->width));
    if (w->num_layers &&
        (routing->num_layers != w->num_layers || routing->top_k != w->top_k || routing->width != w->width))
        return rp_fail(err, RP_EINVAL, "%s: appending step %" PRId64 ": shape %d layers, top-%d, "
                       "%d-byte ids differs from the trace's %d layers, top-%d, %d-byte ids",
                       w->path, step, routing->num_layers, routing->top_k, (int)routing->width,
                       w->num_layers, w->top_k, (int)w->width);
    int32_t num_seqs = rp_batch_num_seqs(batch);
    int64_t num_tokens = rp_batch_num_tokens(batch);
    layout lay;
    if (!compute_layout(num_seqs, num_tokens, routing->num_layers, routing->top_k,
                        routing->width, &lay))
        return rp_fail(err, RP_ERANGE, "%s: appending step %" PRId64 ": %" PRId64 " tokens x %d "
                       "layers x top-%d x %d-byte ids overflow 64 bits", w->path, step, num_tokens,
                       routing->num_layers, routing->top_k, (int)routing->width);
    if (!w->buf && !(w->buf = rp_alloc(w->ctx, WRITE_CHUNK)))
        return rp_fail_nomem(err, "the trace writer's buffer");
    if (!(layer_at = rp_alloc(w->ctx, (size_t)routing->num_layers * sizeof *layer_at)))
        return rp_fail_nomem(err, "the trace writer's layer table");
    size_t header_bytes = header_text(header, sizeof header, step, num_seqs, num_tokens, routing,
                                      w->num_experts, lay.payload_bytes);
    if (header_bytes == 0) {
        st = rp_fail_nomem(err, "a trace header");
        goto out;
    }
    const char *placeholder = strstr(header, "\"checksum\":\"0000000000000000\"");
    int64_t checksum_at = start + PREFIX_BYTES + (placeholder - header) + 12;
    /* from here on the file changes: any failure truncates it back to `start` */
    unsigned char prefix[PREFIX_BYTES] = {0};
    uint32_t hb = (uint32_t)header_bytes;
    memcpy(prefix, MAGIC, sizeof MAGIC);
    memcpy(prefix + 8, &hb, 4);
    RP_CHECK_GOTO(sink_put(&s, prefix, sizeof prefix), st, rollback);
    RP_CHECK_GOTO(sink_put(&s, header, header_bytes), st, rollback);
    RP_CHECK_GOTO(sink_pad(&s, start), st, rollback);
    RP_CHECK_GOTO(sink_flush(&s), st, rollback);
    s.hashing = true;
    rp_hash_init(&s.hash, 0);
    int64_t payload = s.pos;
    s.payload = payload;
    s.payload_bytes = lay.payload_bytes;
    const int32_t *arrays[3] = {rp_batch_prompt_lens(batch), rp_batch_response_lens(batch),
                                rp_batch_group_ids(batch)};
    for (int a = 0; a < 3; a++) {
        RP_CHECK_GOTO(sink_put(&s, arrays[a], (size_t)num_seqs * 4), st, rollback);
        RP_CHECK_GOTO(sink_pad(&s, payload), st, rollback);
    }
    RP_CHECK_GOTO(write_ids(&s, routing, batch, layer_at), st, rollback);
    RP_CHECK_GOTO(sink_pad(&s, payload), st, rollback);
    RP_CHECK_GOTO(sink_flush(&s), st, rollback);
    char hex[CHECKSUM_DIGITS + 1];
    snprintf(hex, sizeof hex, "%016" PRIx64, rp_hash_final(&s.hash));
    RP_CHECK_GOTO(pwrite_all(w, hex, CHECKSUM_DIGITS, checksum_at, err), st, rollback);
    sink_progress(&s); /* done == total, also for an empty payload */
    w->end = s.pos;
    w->num_steps++;
    w->num_layers = routing->num_layers;
    w->top_k = routing->top_k;
    w->width = routing->width;
    goto out;
rollback:
    prefix_fail(err, st, w, step);
    while (ftruncate(w->fd, (off_t)start) != 0) {
        if (errno == EINTR) continue;
        w->broken = true;
        if (err)
            snprintf(err->text + strlen(err->text), sizeof err->text - strlen(err->text),
                     "; and truncating the partial step away failed: %s", strerror(errno));
        break;
    }
out:
    rp_free(w->ctx, layer_at);
    return st;
}

rp_status rp_trace_writer_close(rp_trace_writer *w, rp_error *err)
{
    if (!w) return RP_OK;
    rp_status st = RP_OK;
    if (close(w->fd) != 0) st = rp_fail(err, RP_EIO, "%s: close failed: %s", w->path, strerror(errno));
    else if (w->broken)
        st = rp_fail(err, RP_EIO, "%s: an earlier failed append could not be undone; the file "
                     "is not a valid trace", w->path);
    writer_free(w);
    return st;
}
