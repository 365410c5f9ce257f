/* .npy files (NumPy format versions 1.0, 2.0, 3.0): mapping C-ordered little-endian
 * integer arrays dumped from Python, with a strict parser of the header dict; and a
 * version 1.0 writer for tests and tools. */
#include "internal.h"
#include "npy_internal.h"
#include "routepack/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error ".npy data is mapped in place as little-endian: big-endian hosts are not supported"
#endif

static const unsigned char NPY_MAGIC[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
#define NPY_MAX_DIMS 64 /* NumPy's own limit (NPY_MAXDIMS) */

struct rp_npy {
    rp_context *ctx;
    void *map;
    size_t map_bytes;
    rp_npy_dtype dtype;
    int32_t ndim;
    int64_t *shape;
    int64_t count;
    const unsigned char *data;
};

static const struct {
    const char *descr;
    rp_npy_dtype dtype;
} npy_types[] = {
    {"|i1", RP_NPY_I8}, {"<i1", RP_NPY_I8}, {"|u1", RP_NPY_U8}, {"<u1", RP_NPY_U8},
    {"<i2", RP_NPY_I16}, {"<u2", RP_NPY_U16}, {"<i4", RP_NPY_I32}, {"<u4", RP_NPY_U32},
    {"<i8", RP_NPY_I64}, {"<u8", RP_NPY_U64},
};

/* The descr rp_npy_write uses for each type. */
static const char *const write_descr[] = {"|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8"};

static int item_bytes(rp_npy_dtype t)
{
    switch (t) {
    case RP_NPY_I8: case RP_NPY_U8: return 1;
    case RP_NPY_I16: case RP_NPY_U16: return 2;
    case RP_NPY_I32: case RP_NPY_U32: return 4;
    default: return 8;
    }
}

/* ---- the header dict, a Python literal: {'descr': '<i4', 'fortran_order': False,
 * 'shape': (3, 4), } ---- */

typedef struct scanner {
    const char *p, *end;
    const char *path;
    rp_error *err;
    char at[32]; /* near()'s text */
} scanner;

static rp_status dict_fail(scanner *s, rp_status st, const char *fmt, ...) RP_PRINTF(3, 4);
static rp_status dict_fail(scanner *s, rp_status st, const char *fmt, ...)
{
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rp_fail(s->err, st, "%s: bad .npy header: %s", s->path, msg);
}

static void skip_space(scanner *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static bool take(scanner *s, char c)
{
    skip_space(s);
    if (s->p < s->end && *s->p == c) {
        s->p++;
        return true;
    }
    return false;
}

/* Where the scanner stands, for messages: "at '...'" or "at the end of the header". */
static const char *near(scanner *s)
{
    if (s->p >= s->end) return "at the end of the header";
    int n = (int)(s->end - s->p < 20 ? s->end - s->p : 20);
    snprintf(s->at, sizeof s->at, "at '%.*s'", n, s->p);
    return s->at;
}

/* A quoted string without escapes, into buf. */
static rp_status scan_string(scanner *s, char *buf, size_t size, const char *what)
{
    skip_space(s);
    if (s->p >= s->end || (*s->p != '\'' && *s->p != '"'))
        return dict_fail(s, RP_EFORMAT, "expected a quoted %s %s", what, near(s));
    char quote = *s->p++;
    size_t n = 0;
    while (s->p < s->end && *s->p != quote) {
        if (*s->p == '\\' || (unsigned char)*s->p < 0x20)
            return dict_fail(s, RP_EFORMAT, "unexpected character in a %s", what);
        if (n + 1 >= size) return dict_fail(s, RP_EFORMAT, "%s is too long", what);
        buf[n++] = *s->p++;
    }
    if (s->p >= s->end) return dict_fail(s, RP_EFORMAT, "unterminated %s", what);
    s->p++;
    buf[n] = '\0';
    return RP_OK;
}

static bool take_word(scanner *s, const char *word)
{
    size_t n = strlen(word);
    skip_space(s);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return false;
    if (s->p + n < s->end && (s->p[n] == '_' || (s->p[n] >= 'a' && s->p[n] <= 'z') ||
                              (s->p[n] >= 'A' && s->p[n] <= 'Z') || (s->p[n] >= '0' && s->p[n] <= '9')))
        return false;
    s->p += n;
    return true;
}

/* A non-negative integer literal (Python 2 files may add an L). */
static rp_status scan_dim(scanner *s, int64_t *out)
{
    skip_space(s);
    if (s->p >= s->end || *s->p < '0' || *s->p > '9')
        return dict_fail(s, RP_EFORMAT, "shape must hold non-negative integers, got %s", near(s));
    int64_t v = 0;
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
        if (rp_mul_overflow(v, 10, &v) || rp_add_overflow(v, *s->p - '0', &v))
            return dict_fail(s, RP_ERANGE, "a shape dimension does not fit in 64 bits");
        s->p++;
    }
    if (s->p < s->end && *s->p == 'L') s->p++;
    *out = v;
    return RP_OK;
}

/* A tuple "()", "(5,)", "(3, 4)", "(3, 4,)". "(5)" is not a tuple in Python. */
static rp_status scan_shape(scanner *s, int64_t *shape, int32_t *ndim)
{
    if (!take(s, '(')) return dict_fail(s, RP_EFORMAT, "shape must be a tuple, got %s", near(s));
    int32_t n = 0;
    bool comma = false;
    while (!take(s, ')')) {
        if (n > 0 && !comma) return dict_fail(s, RP_EFORMAT, "expected ',' or ')' in shape %s", near(s));
        if (n == NPY_MAX_DIMS) return dict_fail(s, RP_EFORMAT, "more than %d dimensions", NPY_MAX_DIMS);
        rp_status st = scan_dim(s, &shape[n++]);
        if (st != RP_OK) return st;
        comma = take(s, ',');
    }
    if (n == 1 && !comma) return dict_fail(s, RP_EFORMAT, "shape (%" PRId64 ") is not a tuple (a one-element tuple needs a trailing comma)", shape[0]);
    *ndim = n;
    return RP_OK;
}

static rp_status check_descr(scanner *s, const char *descr, rp_npy_dtype *out)
{
    for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
        if (strcmp(descr, npy_types[i].descr) == 0) {
            *out = npy_types[i].dtype;
            return RP_OK;
        }
    char kind = descr[0] && strchr("<>|=", descr[0]) ? descr[1] : descr[0];
    if (descr[0] == '>' && (kind == 'i' || kind == 'u'))
        return dict_fail(s, RP_ENOTSUP, "big-endian dtype '%s' is not supported (save it with "
                         "arr.astype('<%s'))", descr, descr + 1);
    if (kind == 'f' || kind == 'c')
        return dict_fail(s, RP_ENOTSUP, "dtype '%s' is floating-point; routing ids and lengths "
                         "must be integers", descr);
    if (kind == 'b' || kind == '?')
        return dict_fail(s, RP_ENOTSUP, "dtype '%s' is boolean, not an integer type", descr);
    if (kind == 'O')
        return dict_fail(s, RP_ENOTSUP, "dtype '%s' is an object array (pickled data is never "
                         "loaded)", descr);
    return dict_fail(s, RP_ENOTSUP, "dtype '%s' is not supported (little-endian integers of 1, "
                     "2, 4 or 8 bytes are)", descr);
}

static rp_status parse_dict(scanner *s, rp_npy_dtype *dtype, int64_t *shape, int32_t *ndim)
{
    bool seen_descr = false, seen_order = false, seen_shape = false;
    rp_status st;
    if (!take(s, '{')) return dict_fail(s, RP_EFORMAT, "expected a dict, got %s", near(s));
    while (!take(s, '}')) {
        char key[32], descr[32];
        if ((st = scan_string(s, key, sizeof key, "key")) != RP_OK) return st;
        if (!take(s, ':')) return dict_fail(s, RP_EFORMAT, "expected ':' after '%s'", key);
        if (strcmp(key, "descr") == 0 && !seen_descr) {
            seen_descr = true;
            skip_space(s);
            if (s->p < s->end && *s->p == '[')
                return dict_fail(s, RP_ENOTSUP, "structured dtypes are not supported");
            if ((st = scan_string(s, descr, sizeof descr, "descr")) != RP_OK) return st;
            if ((st = check_descr(s, descr, dtype)) != RP_OK) return st;
        } else if (strcmp(key, "fortran_order") == 0 && !seen_order) {
            seen_order = true;
            if (take_word(s, "True"))
                return dict_fail(s, RP_ENOTSUP, "Fortran-ordered arrays are not supported (save "
                                 "np.ascontiguousarray(arr))");
            if (!take_word(s, "False"))
                return dict_fail(s, RP_EFORMAT, "fortran_order must be True or False, got %s", near(s));
        } else if (strcmp(key, "shape") == 0 && !seen_shape) {
            seen_shape = true;
            if ((st = scan_shape(s, shape, ndim)) != RP_OK) return st;
        } else if (!strcmp(key, "descr") || !strcmp(key, "fortran_order") || !strcmp(key, "shape")) {
            return dict_fail(s, RP_EFORMAT, "key '%s' appears twice", key);
        } else {
            return dict_fail(s, RP_EFORMAT, "unknown key '%s'", key);
        }
        if (!take(s, ',')) {
            if (take(s, '}')) break;
            return dict_fail(s, RP_EFORMAT, "expected ',' or '}' %s", near(s));
        }
    }
    const char *missing = !seen_descr ? "descr" : !seen_order ? "fortran_order" : !seen_shape ? "shape" : NULL;
    if (missing) return dict_fail(s, RP_EFORMAT, "key '%s' is missing", missing);
    /* NumPy pads with spaces and ends the header with a newline */
    for (; s->p < s->end; s->p++)
        if (*s->p != ' ' && *s->p != '\n')
            return dict_fail(s, RP_EFORMAT, "unexpected '%.20s' after the dict", s->p);
    return RP_OK;
}

/* Parse the .npy bytes m[0, size) named `name` in messages. The array borrows the
 * bytes: `map` (map_bytes long) is unmapped by rp_npy_close when not NULL, else the
 * bytes belong to whoever gave them (an .npz archive). */
rp_status rp_npy_parse(rp_context *ctx, const char *name, const unsigned char *m, int64_t size,
                       void *map, size_t map_bytes, rp_npy **out, rp_error *err)
{
    rp_status st = RP_OK;
    rp_npy *npy = NULL;
    int64_t shape[NPY_MAX_DIMS];
    if (size < 10) {
        st = rp_fail(err, RP_EFORMAT, "%s: %s (%" PRId64 " bytes), not a .npy file", name,
                     size == 0 ? "empty file" : "too short", size);
        goto out;
    }
    if (memcmp(m, NPY_MAGIC, sizeof NPY_MAGIC) != 0) {
        st = rp_fail(err, RP_EFORMAT, "%s: bad magic, not a .npy file", name);
        if (err) err->offset = 0;
        goto out;
    }
    int major = m[6], minor = m[7];
    if ((major != 1 && major != 2 && major != 3) || minor != 0) {
        st = rp_fail(err, RP_ENOTSUP, "%s: .npy format version %d.%d is not supported (1.0, 2.0 "
                     "and 3.0 are)", name, major, minor);
        if (err) err->offset = 6;
        goto out;
    }
    int64_t len_bytes = major == 1 ? 2 : 4, header_len;
    if (major == 1) {
        header_len = m[8] | (int64_t)m[9] << 8;
    } else {
        if (size < 12) {
            st = rp_fail(err, RP_EFORMAT, "%s: truncated: the header length needs 12 bytes, the "
                         "file has %" PRId64, name, size);
            goto out;
        }
        uint32_t v;
        memcpy(&v, m + 8, 4);
        header_len = v;
    }
    int64_t data_offset = 8 + len_bytes + header_len;
    if (data_offset > size) {
        st = rp_fail(err, RP_EFORMAT, "%s: truncated: the header ends at byte %" PRId64 ", but "
                     "the file has %" PRId64 " bytes (%" PRId64 " missing)", name, data_offset,
                     size, data_offset - size);
        if (err) err->offset = size;
        goto out;
    }
    scanner sc = {(const char *)m + 8 + len_bytes, (const char *)m + data_offset, name, err, ""};
    if (memchr(sc.p, '\0', (size_t)header_len)) {
        st = rp_fail(err, RP_EFORMAT, "%s: bad .npy header: it contains a NUL byte", name);
        goto out;
    }
    rp_npy_dtype dtype = RP_NPY_I8;
    int32_t ndim = 0;
    RP_CHECK_GOTO(parse_dict(&sc, &dtype, shape, &ndim), st, out);
    int64_t count = 1, bytes;
    for (int32_t d = 0; d < ndim; d++)
        if (rp_mul_overflow(count, shape[d], &count)) {
            st = rp_fail(err, RP_ERANGE, "%s: the shape's element count overflows 64 bits", name);
            goto out;
        }
    if (rp_mul_overflow(count, item_bytes(dtype), &bytes)) {
        st = rp_fail(err, RP_ERANGE, "%s: the data size (%" PRId64 " elements of %d bytes) "
                     "overflows 64 bits", name, count, item_bytes(dtype));
        goto out;
    }
    if (bytes != size - data_offset) {
        bool shorter = bytes > size - data_offset;
        st = rp_fail(err, RP_EFORMAT, "%s: %s: the shape needs %" PRId64 " data bytes, the file "
                     "has %" PRId64 " (%" PRId64 " %s)", name, shorter ? "truncated" : "trailing bytes",
                     bytes, size - data_offset,
                     shorter ? bytes - (size - data_offset) : (size - data_offset) - bytes,
                     shorter ? "missing" : "too many");
        if (err) err->offset = shorter ? size : data_offset + bytes;
        goto out;
    }
    npy = rp_calloc(ctx, 1, sizeof *npy);
    if (!npy || !(npy->shape = rp_alloc(ctx, (size_t)(ndim + 1) * sizeof(int64_t)))) {
        st = rp_fail_nomem(err, "a .npy array");
        goto out;
    }
    npy->ctx = ctx;
    npy->map = map;
    npy->map_bytes = map_bytes;
    npy->dtype = dtype;
    npy->ndim = ndim;
    if (ndim) memcpy(npy->shape, shape, (size_t)ndim * sizeof(int64_t));
    npy->count = count;
    npy->data = m + data_offset;
    *out = npy;
    npy = NULL;
out:
    if (npy) {
        rp_free(ctx, npy->shape);
        rp_free(ctx, npy);
    }
    return st;
}

rp_status rp_npy_open(rp_context *ctx, const char *path, rp_npy **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "npy: NULL argument");
    int fd;
    int64_t size = 0;
    rp_status st = rp_file_open_regular(path, O_RDONLY, &fd, &size, err);
    if (st != RP_OK) return st;
    if (size < 10) {
        close(fd);
        return rp_fail(err, RP_EFORMAT, "%s: %s (%" PRId64 " bytes), not a .npy file", path,
                       size == 0 ? "empty file" : "too short", size);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return rp_fail(err, RP_EIO, "%s: cannot map: %s", path, strerror(errno));
    st = rp_npy_parse(ctx, path, map, size, map, (size_t)size, out, err);
    if (st != RP_OK) munmap(map, (size_t)size);
    return st;
}

void rp_npy_close(rp_npy *npy)
{
    if (!npy) return;
    if (npy->map) munmap(npy->map, npy->map_bytes);
    rp_free(npy->ctx, npy->shape);
    rp_free(npy->ctx, npy);
}

rp_npy_dtype rp_npy_type(const rp_npy *npy) { return npy->dtype; }
int32_t rp_npy_ndim(const rp_npy *npy) { return npy->ndim; }
const int64_t *rp_npy_shape(const rp_npy *npy) { return npy->shape; }
int64_t rp_npy_count(const rp_npy *npy) { return npy->count; }
const void *rp_npy_data(const rp_npy *npy) { return npy->data; }

int64_t rp_npy_get(const rp_npy *npy, int64_t i)
{
    /* memcpy: NumPy aligns the data to 16 or 64 bytes, other writers may not */
    const unsigned char *p = npy->data + i * item_bytes(npy->dtype);
    switch (npy->dtype) {
    case RP_NPY_I8: return (int8_t)p[0];
    case RP_NPY_U8: return p[0];
    case RP_NPY_I16: { int16_t v; memcpy(&v, p, 2); return v; }
    case RP_NPY_U16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case RP_NPY_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case RP_NPY_U32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case RP_NPY_I64: { int64_t v; memcpy(&v, p, 8); return v; }
    case RP_NPY_U64: { uint64_t v; memcpy(&v, p, 8); return (int64_t)v; } /* > 2^63-1 reads negative */
    }
    return 0;
}

rp_status rp_npy_write(const char *path, rp_npy_dtype dtype, int32_t ndim, const int64_t *shape,
                       const void *data, rp_error *err)
{
    if (!path || (ndim > 0 && !shape)) return rp_fail(err, RP_EINVAL, "npy: NULL argument");
    if ((unsigned)dtype > RP_NPY_U64) return rp_fail(err, RP_EINVAL, "%s: unknown dtype %d", path, (int)dtype);
    if (ndim < 0 || ndim > 32) return rp_fail(err, RP_EINVAL, "%s: %d dimensions, must be 0..32", path, ndim);
    char header[1024];
    int n = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                     write_descr[dtype]);
    int64_t count = 1;
    for (int32_t d = 0; d < ndim; d++) {
        if (shape[d] < 0) return rp_fail(err, RP_EINVAL, "%s: dimension %d is negative", path, d);
        if (rp_mul_overflow(count, shape[d], &count))
            return rp_fail(err, RP_ERANGE, "%s: the shape's element count overflows", path);
        n += snprintf(header + n, sizeof header - (size_t)n, "%s%" PRId64, d ? ", " : "", shape[d]);
    }
    n += snprintf(header + n, sizeof header - (size_t)n, "%s), }", ndim == 1 ? "," : "");
    int64_t bytes;
    if (rp_mul_overflow(count, item_bytes(dtype), &bytes))
        return rp_fail(err, RP_ERANGE, "%s: the data size overflows", path);
    if (bytes > 0 && !data) return rp_fail(err, RP_EINVAL, "npy: NULL data");
    /* pad with spaces and a final newline so magic + length + header is a multiple of
     * 64, as NumPy does: the data is then aligned for any element type */
    int total = (10 + n + 1 + 63) / 64 * 64;
    memset(header + n, ' ', (size_t)(total - 10 - n));
    header[total - 10 - 1] = '\n';
    unsigned char prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                (unsigned char)((total - 10) & 0xff), (unsigned char)((total - 10) >> 8)};
    FILE *f = fopen(path, "wb");
    if (!f) return rp_fail(err, RP_EIO, "%s: cannot create: %s", path, strerror(errno));
    bool ok = fwrite(prefix, 1, 10, f) == 10 &&
              fwrite(header, 1, (size_t)(total - 10), f) == (size_t)(total - 10) &&
              (bytes == 0 || fwrite(data, 1, (size_t)bytes, f) == (size_t)bytes);
    int saved = errno;
    if (fclose(f) != 0 && ok) ok = false, saved = errno;
    if (!ok) {
        remove(path);
        return rp_fail(err, RP_EIO, "%s: write error: %s", path, strerror(saved));
    }
    return RP_OK;
}
