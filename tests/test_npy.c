/* .npy reading and writing: files written by real NumPy (tests/data/npy, every accepted
 * dtype and format version), files written by rp_npy_write, and malformed ones. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define DATA RP_SOURCE_DIR "/tests/data/npy/"

static char tmpdir[64];
static char pathbuf[512]; /* a path in tests/data/npy */

static const char *tmp(const char *name) { return temp_path(tmpdir, name); }

/* A .npy file with the given version and dict text, padded to 64 with a newline when
 * `pad`, followed by `data`. */
static void write_raw(const char *path, int major, int minor, const char *dict, bool pad,
                      const void *data, size_t data_bytes)
{
    unsigned char buf[4096];
    size_t len_bytes = major == 1 ? 2 : 4, pre = 8 + len_bytes, hl = strlen(dict);
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (unsigned char)major, buf[7] = (unsigned char)minor;
    memcpy(buf + pre, dict, hl);
    if (pad) {
        size_t total = (pre + hl + 1 + 63) / 64 * 64;
        memset(buf + pre + hl, ' ', total - pre - hl);
        buf[total - 1] = '\n';
        hl = total - pre;
    }
    uint32_t v = (uint32_t)hl;
    memcpy(buf + 8, &v, len_bytes);
    memcpy(buf + pre + hl, data, data_bytes);
    spit(path, buf, pre + hl + data_bytes);
}

static rp_status open_err(rp_context *ctx, const char *path, rp_error *err)
{
    rp_npy *a = NULL;
    rp_status st = rp_npy_open(ctx, path, &a, err);
    rp_npy_close(a);
    return st;
}

static void test_numpy_files(rp_context *ctx)
{
    static const struct {
        const char *file;
        rp_npy_dtype dtype;
        int64_t values[6];
    } cases[] = {
        {"i1.npy", RP_NPY_I8, {-128, -1, 0, 1, 2, 127}},
        {"u1.npy", RP_NPY_U8, {0, 1, 0, 1, 2, 255}},
        {"i2.npy", RP_NPY_I16, {-32768, -1, 0, 1, 2, 32767}},
        {"u2.npy", RP_NPY_U16, {0, 1, 0, 1, 2, 65535}},
        {"i4.npy", RP_NPY_I32, {INT32_MIN, -1, 0, 1, 2, INT32_MAX}},
        {"u4.npy", RP_NPY_U32, {0, 1, 0, 1, 2, UINT32_MAX}},
        {"i8.npy", RP_NPY_I64, {INT64_MIN, -1, 0, 1, 2, INT64_MAX}},
        {"u8.npy", RP_NPY_U64, {0, 1, 0, 1, 2, -1 /* 2^64-1 reads as -1 */}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        rp_npy *a;
        rp_error err;
        snprintf(pathbuf, sizeof pathbuf, DATA "%s", cases[c].file);
        rp_status st = rp_npy_open(ctx, pathbuf, &a, &err);
        if (!ok(st == RP_OK, "NumPy's %s opens", cases[c].file)) {
            diag("%s", err.text);
            continue;
        }
        int good = rp_npy_type(a) == cases[c].dtype && rp_npy_ndim(a) == 2 && rp_npy_shape(a)[0] == 2 &&
                   rp_npy_shape(a)[1] == 3 && rp_npy_count(a) == 6;
        for (int i = 0; i < 6; i++) good &= rp_npy_get(a, i) == cases[c].values[i];
        ok(good, "%s: dtype, shape and values (extremes included)", cases[c].file);
        rp_npy_close(a);
    }

    rp_npy *a;
    rp_error err;
    is_int(open_err(ctx, DATA, &err), RP_EIO, "a directory is not a .npy file");
    like(err.text, "not a regular file", "directory message");
    is_int(rp_npy_open(ctx, DATA "v2.npy", &a, &err), RP_OK, "format version 2.0");
    ok(rp_npy_ndim(a) == 1 && rp_npy_shape(a)[0] == 4 && rp_npy_get(a, 3) == 3 &&
       rp_npy_type(a) == RP_NPY_I32, "version 2.0 shape and values");
    rp_npy_close(a);
    is_int(rp_npy_open(ctx, DATA "v3.npy", &a, &err), RP_OK, "format version 3.0");
    ok(rp_npy_ndim(a) == 2 && rp_npy_count(a) == 4 && rp_npy_get(a, 3) == 3 &&
       rp_npy_type(a) == RP_NPY_U16, "version 3.0 shape and values");
    rp_npy_close(a);
    is_int(rp_npy_open(ctx, DATA "scalar.npy", &a, &err), RP_OK, "a 0-d array");
    ok(rp_npy_ndim(a) == 0 && rp_npy_count(a) == 1 && rp_npy_get(a, 0) == 7, "0-d array has one element");
    rp_npy_close(a);
    is_int(rp_npy_open(ctx, DATA "empty.npy", &a, &err), RP_OK, "an empty (0, 3) array");
    ok(rp_npy_ndim(a) == 2 && rp_npy_shape(a)[0] == 0 && rp_npy_count(a) == 0, "empty array shape");
    rp_npy_close(a);

    static const struct { const char *file; rp_status st; const char *msg; } bad[] = {
        {"big_endian.npy", RP_ENOTSUP, "big-endian dtype '>i4' is not supported"},
        {"fortran.npy", RP_ENOTSUP, "Fortran-ordered arrays are not supported"},
        {"float32.npy", RP_ENOTSUP, "dtype '<f4' is floating-point"},
        {"bool.npy", RP_ENOTSUP, "dtype '|b1' is boolean"},
        {"object.npy", RP_ENOTSUP, "object array"},
        {"structured.npy", RP_ENOTSUP, "structured dtypes are not supported"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        snprintf(pathbuf, sizeof pathbuf, DATA "%s", bad[c].file);
        is_int(open_err(ctx, pathbuf, &err), bad[c].st, "NumPy's %s is rejected", bad[c].file);
        like(err.text, bad[c].msg, "%s: the reason", bad[c].file);
    }
}

static void test_write(rp_context *ctx)
{
    /* byte for byte what NumPy writes for the same arrays */
    static const struct { const char *file; rp_npy_dtype dtype; int bytes; } same[] = {
        {"i1.npy", RP_NPY_I8, 1}, {"u1.npy", RP_NPY_U8, 1}, {"i2.npy", RP_NPY_I16, 2},
        {"u2.npy", RP_NPY_U16, 2}, {"i4.npy", RP_NPY_I32, 4}, {"u4.npy", RP_NPY_U32, 4},
        {"i8.npy", RP_NPY_I64, 8}, {"u8.npy", RP_NPY_U64, 8},
    };
    for (size_t c = 0; c < sizeof same / sizeof same[0]; c++) {
        snprintf(pathbuf, sizeof pathbuf, DATA "%s", same[c].file);
        size_t n = 0, m = 0;
        unsigned char *want = slurp(pathbuf, &n);
        rp_npy *a;
        rp_error err;
        if (rp_npy_open(ctx, pathbuf, &a, &err) != RP_OK) {
            ok(0, "reopen %s: %s", same[c].file, err.text);
            free(want);
            continue;
        }
        int64_t shape[2] = {2, 3};
        rp_status st = rp_npy_write(tmp("w.npy"), same[c].dtype, 2, shape, rp_npy_data(a), &err);
        rp_npy_close(a);
        unsigned char *got = slurp(tmp("w.npy"), &m);
        ok(st == RP_OK && want && got && n == m && memcmp(want, got, n) == 0,
           "rp_npy_write of %s matches NumPy's file byte for byte", same[c].file);
        free(want);
        free(got);
    }

    /* shapes: 0-d, 1-d, 3-d, empty; data 64-aligned */
    int32_t values[24];
    for (int i = 0; i < 24; i++) values[i] = i * 1000 - 5000;
    static const struct { int32_t ndim; int64_t shape[3]; } shapes[] = {
        {0, {0}}, {1, {24}}, {3, {2, 3, 4}}, {2, {0, 5}},
    };
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        rp_error err;
        rp_npy *a = NULL;
        rp_status st = rp_npy_write(tmp("s.npy"), RP_NPY_I32, shapes[c].ndim, shapes[c].shape, values, &err);
        if (st == RP_OK) st = rp_npy_open(ctx, tmp("s.npy"), &a, &err);
        if (!ok(st == RP_OK, "write and read back a %d-d array", shapes[c].ndim)) {
            diag("%s", err.text);
            continue;
        }
        int64_t count = 1;
        int good = rp_npy_ndim(a) == shapes[c].ndim;
        for (int32_t d = 0; d < shapes[c].ndim; d++) {
            good &= rp_npy_shape(a)[d] == shapes[c].shape[d];
            count *= shapes[c].shape[d];
        }
        good &= rp_npy_count(a) == count;
        for (int64_t i = 0; i < count; i++) good &= rp_npy_get(a, i) == values[i];
        good &= (file_size(tmp("s.npy")) - count * 4) % 64 == 0;
        ok(good, "%d-d round trip: shape, values, data aligned to 64", shapes[c].ndim);
        rp_npy_close(a);
    }

    rp_error err;
    int64_t neg[1] = {-1}, huge[2] = {INT64_MAX / 2, 4};
    is_int(rp_npy_write(tmp("x.npy"), RP_NPY_I32, 1, neg, values, &err), RP_EINVAL, "write rejects a negative dimension");
    is_int(rp_npy_write(tmp("x.npy"), RP_NPY_I32, 2, huge, values, &err), RP_ERANGE, "write rejects an overflowing shape");
    is_int(rp_npy_write(tmp("x.npy"), (rp_npy_dtype)42, 1, shapes[1].shape, values, &err), RP_EINVAL, "write rejects an unknown dtype");
    is_int(rp_npy_write("/nonexistent-dir/x.npy", RP_NPY_I32, 1, shapes[1].shape, values, &err), RP_EIO,
           "write to a missing directory fails");
    ok(access(tmp("x.npy"), F_OK) != 0, "failed writes leave no file");
    if (access("/dev/full", W_OK) == 0) {
        int64_t big[1] = {1 << 16};
        int32_t *lots = calloc(1 << 16, 4);
        is_int(rp_npy_write("/dev/full", RP_NPY_I32, 1, big, lots, &err), RP_EIO, "a full disk is a write error");
        like(err.text, "write error", "write error message");
        free(lots);
    } else {
        skip(2, "no /dev/full");
    }
}

static void test_malformed(rp_context *ctx)
{
    rp_error err;
    int32_t data[6] = {1, 2, 3, 4, 5, 6};
    const char *good = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }";
    write_raw(tmp("ok.npy"), 1, 0, good, true, data, sizeof data);
    is_int(open_err(ctx, tmp("ok.npy"), &err), RP_OK, "a hand-made version 1.0 file opens");

    /* not padded: data at an odd offset is still read correctly */
    write_raw(tmp("odd.npy"), 1, 0, "{'descr':'<i4','fortran_order':False,'shape':(2,3)}\n", false, data, sizeof data);
    rp_npy *a;
    if (rp_npy_open(ctx, tmp("odd.npy"), &a, &err) == RP_OK) {
        ok(rp_npy_get(a, 5) == 6 && rp_npy_get(a, 0) == 1, "unaligned data reads correctly");
        rp_npy_close(a);
    } else {
        ok(0, "unaligned data reads correctly: %s", err.text);
    }
    write_raw(tmp("dq.npy"), 2, 0, "{\"shape\": (6L,), \"fortran_order\": False, \"descr\": \"<i4\"}", true, data, sizeof data);
    is_int(open_err(ctx, tmp("dq.npy"), &err), RP_OK, "double quotes, any key order, Python 2 long suffix");

    static const struct { int major, minor; const char *dict; rp_status st; const char *msg; } cases[] = {
        {4, 0, NULL, RP_ENOTSUP, "version 4.0 is not supported"},
        {1, 1, NULL, RP_ENOTSUP, "version 1.1 is not supported"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False}", RP_EFORMAT, "key 'shape' is missing"},
        {1, 0, "{'descr': '<i4', 'shape': (2, 3)}", RP_EFORMAT, "key 'fortran_order' is missing"},
        {1, 0, "{'fortran_order': False, 'shape': (2, 3)}", RP_EFORMAT, "key 'descr' is missing"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}", RP_EFORMAT, "unknown key 'extra'"},
        {1, 0, "{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (2, 3)}", RP_EFORMAT, "key 'descr' appears twice"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (6)}", RP_EFORMAT, "needs a trailing comma"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (-6,)}", RP_EFORMAT, "non-negative integers"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': [2, 3]}", RP_EFORMAT, "shape must be a tuple"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2 3)}", RP_EFORMAT, "expected ',' or ')'"},
        {1, 0, "{'descr': '<i4', 'fortran_order': 0, 'shape': (2, 3)}", RP_EFORMAT, "fortran_order must be True or False"},
        {1, 0, "{'descr': '<i4', 'fortran_order': Falsey, 'shape': (2, 3)}", RP_EFORMAT, "fortran_order must be True or False"},
        {1, 0, "{'descr': <i4, 'fortran_order': False, 'shape': (2, 3)}", RP_EFORMAT, "expected a quoted descr"},
        {1, 0, "{'descr': '<i4, 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "dtype '<i4, ' is not supported"},
        {1, 0, "{'descr' '<i4', 'fortran_order': False, 'shape': (2, 3)}", RP_EFORMAT, "expected ':' after 'descr'"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3)} x", RP_EFORMAT, "after the dict"},
        {1, 0, "['descr', '<i4']", RP_EFORMAT, "expected a dict"},
        {1, 0, "{'descr': '<i4' 'fortran_order': False, 'shape': (2, 3)}", RP_EFORMAT, "expected ',' or '}'"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3)", RP_EFORMAT, "expected ',' or '}' at the end of the header"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), ", RP_EFORMAT, "expected a quoted key at the end of the header"},
        {1, 0, "{'descr': '=i4', 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "dtype '=i4' is not supported"},
        {1, 0, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "floating-point"},
        {1, 0, "{'descr': '|O', 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "object array"},
        {1, 0, "{'descr': '<U3', 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "not supported"},
        {1, 0, "{'descr': '>u8', 'fortran_order': False, 'shape': (2, 3)}", RP_ENOTSUP, "big-endian"},
        {1, 0, "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3)}", RP_ENOTSUP, "Fortran"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (3037000500, 3037000500, 4)}", RP_ERANGE, "overflows"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (99999999999999999999,)}", RP_ERANGE, "does not fit in 64 bits"},
        {1, 0, "{'descr': '<i8', 'fortran_order': False, 'shape': (1152921504606846976,)}", RP_ERANGE, "overflows 64 bits"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 4), }", RP_EFORMAT, "truncated: the shape needs 32 data bytes, the file has 24 (8 missing)"},
        {1, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (5,), }", RP_EFORMAT, "trailing bytes: the shape needs 20 data bytes, the file has 24 (4 too many)"},
        {2, 0, "{'descr': '<i4', 'fortran_order': False, 'shape': (3, 3), }", RP_EFORMAT, "truncated"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        write_raw(tmp("bad.npy"), cases[c].major, cases[c].minor, cases[c].dict ? cases[c].dict : good,
                  true, data, sizeof data);
        is_int(open_err(ctx, tmp("bad.npy"), &err), cases[c].st, "malformed %zu rejected (%s)", c, cases[c].msg);
        like(err.text, cases[c].msg, "malformed %zu: the reason", c);
    }

    size_t n = 0;
    unsigned char *buf = slurp(tmp("ok.npy"), &n);
    if (!buf || n < 64) {
        ok(0, "read back ok.npy");
        free(buf);
        return;
    }
    buf[1] = 'X';
    spit(tmp("bad.npy"), buf, n);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "bad magic");
    like(err.text, "bad magic", "bad magic message");
    buf[1] = 'N';
    spit(tmp("bad.npy"), buf, n - 1);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "data cut by one byte");
    like(err.text, "(1 missing)", "how many bytes are missing");
    spit(tmp("bad.npy"), buf, 40);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "header cut short");
    like(err.text, "truncated: the header ends at byte 128, but the file has 40 bytes (88 missing)", "truncated header message");
    buf[20] = '\0';
    spit(tmp("bad.npy"), buf, n);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "NUL in the header");
    spit(tmp("bad.npy"), buf, 7);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "a 7-byte file");
    like(err.text, "too short", "too short message");
    spit(tmp("bad.npy"), buf, 0);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "an empty file");
    like(err.text, "empty file", "empty file message");
    static const unsigned char cut_v2[11] = {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 0x10, 0, 0};
    spit(tmp("bad.npy"), cut_v2, sizeof cut_v2);
    is_int(open_err(ctx, tmp("bad.npy"), &err), RP_EFORMAT, "version 2.0 with a cut header length");
    like(err.text, "the header length needs 12 bytes", "cut header length message");
    is_int(open_err(ctx, tmp("missing.npy"), &err), RP_EIO, "a missing file");
    like(err.text, "missing.npy: cannot open", "missing file message");
    free(buf);
}

static void test_alloc_failures(void)
{
    int cleanly = 1, opened = 0;
    for (long n = 1; n < 10; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        c.fail_at = n + 1;
        rp_npy *a = NULL;
        rp_status st = rp_npy_open(ctx, DATA "i4.npy", &a, NULL);
        if (st == RP_OK) opened++, rp_npy_close(a);
        else if (st != RP_ENOMEM) cleanly = 0;
        rp_context_free(ctx);
        if (c.live != 0) cleanly = 0;
    }
    ok(cleanly && opened > 0, "rp_npy_open fails cleanly at every allocation and leaks nothing");
}

int main(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "npy")) {
        printf("Bail out! mkdtemp failed\n");
        return 1;
    }
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_numpy_files(ctx);
    test_write(ctx);
    test_malformed(ctx);
    test_alloc_failures();
    rp_context_free(ctx);
    temp_dir_remove(tmpdir);
    return tap_done();
}
