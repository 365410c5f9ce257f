/* .npz archives as numpy.savez writes them: a zip file whose members are .npy files,
 * stored (not compressed), zip64 where sizes or offsets need it (NumPy forces zip64
 * headers). The archive is mapped once and every member is checked at open: its
 * central-directory entry against its local header, its CRC-32, and its .npy header,
 * so a corrupt or hostile archive is refused before any of it is used. Nothing is
 * copied: each member's array points into the mapping. */
#include "internal.h"
#include "npy_internal.h"
#include "routepack/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SIG_LOCAL 0x04034b50u
#define SIG_CENTRAL 0x02014b50u
#define SIG_END 0x06054b50u
#define SIG_END64 0x06064b50u
#define SIG_END64_LOCATOR 0x07064b50u
#define NPZ_MAX_MEMBERS 1000000
#define NPZ_MAX_NAME 4096

typedef struct npz_member {
    char *name;      /* without the ".npy" suffix */
    rp_npy *array;
} npz_member;

struct rp_npz {
    rp_context *ctx;
    void *map;
    size_t map_bytes;
    int32_t count;
    npz_member *members;
};

static uint32_t le16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t le32(const unsigned char *p) { return le16(p) | le16(p + 2) << 16; }
static uint64_t le64(const unsigned char *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }

/* CRC-32 (IEEE 802.3, reflected), as zip stores it; a table built on the stack per
 * archive keeps the library free of global state. */
static uint32_t crc32_of(const unsigned char *p, uint64_t n)
{
    uint32_t table[256];
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[i] = c;
    }
    uint32_t crc = 0xFFFFFFFFu;
    for (uint64_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

/* Where the central directory is and how many entries it has, from the end record
 * (and the zip64 end record when the end record defers to it). */
static rp_status find_directory(const char *path, const unsigned char *m, uint64_t size,
                                uint64_t *cd_offset, uint64_t *cd_size, uint64_t *entries,
                                rp_error *err)
{
    if (size < 22) return rp_fail(err, RP_EFORMAT, "%s: %" PRIu64 " bytes, too short for a zip archive (.npz)", path, size);
    /* the end record is the last 22 bytes plus a comment of at most 65535 */
    uint64_t lowest = size > 22 + 65535 ? size - 22 - 65535 : 0, end = UINT64_MAX;
    for (uint64_t at = size - 22 + 1; at-- > lowest;)
        if (le32(m + at) == SIG_END && at + 22 + le16(m + at + 20) == size) {
            end = at;
            break;
        }
    if (end == UINT64_MAX) {
        if (size >= 6 && !memcmp(m, "\x93NUMPY", 6))
            return rp_fail(err, RP_EFORMAT, "%s: a .npy file, not an .npz archive", path);
        return rp_fail(err, RP_EFORMAT, "%s: not a zip archive (.npz): no end-of-directory record", path);
    }
    const unsigned char *e = m + end;
    if (le16(e + 4) != 0 || le16(e + 6) != 0)
        return rp_fail(err, RP_ENOTSUP, "%s: a multi-disk zip archive is not supported", path);
    *entries = le16(e + 10);
    *cd_size = le32(e + 12);
    *cd_offset = le32(e + 16);
    if (*entries == 0xFFFF || *cd_size == 0xFFFFFFFFu || *cd_offset == 0xFFFFFFFFu) {
        if (end < 20 || le32(m + end - 20) != SIG_END64_LOCATOR)
            return rp_fail(err, RP_EFORMAT, "%s: the end record defers to a zip64 record that is missing", path);
        uint64_t at = le64(m + end - 20 + 8);
        if (at > end - 20 || end - 20 - at < 56 || le32(m + at) != SIG_END64)
            return rp_fail(err, RP_EFORMAT, "%s: bad zip64 end-of-directory record at byte %" PRIu64, path, at);
        const unsigned char *z = m + at;
        if (le32(z + 16) != 0 || le32(z + 20) != 0)
            return rp_fail(err, RP_ENOTSUP, "%s: a multi-disk zip archive is not supported", path);
        *entries = le64(z + 32);
        *cd_size = le64(z + 40);
        *cd_offset = le64(z + 48);
        end = at; /* the directory ends before the zip64 record */
    }
    if (*cd_offset > end || *cd_size > end - *cd_offset)
        return rp_fail(err, RP_EFORMAT, "%s: the central directory (%" PRIu64 " bytes at byte %" PRIu64
                       ") lies outside the archive", path, *cd_size, *cd_offset);
    if (*entries > NPZ_MAX_MEMBERS || *entries > *cd_size / 46)
        return rp_fail(err, RP_EFORMAT, "%s: %" PRIu64 " members cannot fit a central directory of %" PRIu64
                       " bytes", path, *entries, *cd_size);
    return RP_OK;
}

/* The zip64 extended information of a central entry replaces the fields that are
 * 0xFFFFFFFF, in this order: uncompressed size, compressed size, local header offset. */
static rp_status read_zip64_extra(const char *path, const char *name, const unsigned char *extra,
                                  uint32_t extra_len, uint64_t *usize, uint64_t *csize,
                                  uint64_t *offset, rp_error *err)
{
    bool need_u = *usize == 0xFFFFFFFFu, need_c = *csize == 0xFFFFFFFFu, need_o = *offset == 0xFFFFFFFFu;
    if (!need_u && !need_c && !need_o) return RP_OK;
    for (uint32_t at = 0; at + 4 <= extra_len;) {
        uint32_t id = le16(extra + at), len = le16(extra + at + 2);
        if (at + 4 + len > extra_len) break;
        if (id == 0x0001) {
            const unsigned char *f = extra + at + 4;
            uint32_t used = 0;
            if (need_u) { if (used + 8 > len) break; *usize = le64(f + used); used += 8; }
            if (need_c) { if (used + 8 > len) break; *csize = le64(f + used); used += 8; }
            if (need_o) { if (used + 8 > len) break; *offset = le64(f + used); used += 8; }
            return RP_OK;
        }
        at += 4 + len;
    }
    return rp_fail(err, RP_EFORMAT, "%s: member '%s' needs a zip64 extra field, which is missing or short",
                   path, name);
}

rp_status rp_npz_open(rp_context *ctx, const char *path, rp_npz **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "npz: NULL argument");
    int fd;
    int64_t file_size = 0;
    rp_status st = rp_file_open_regular(path, O_RDONLY, &fd, &file_size, err);
    if (st != RP_OK) return st;
    if (file_size < 22) {
        close(fd);
        return rp_fail(err, RP_EFORMAT, "%s: %" PRId64 " bytes, too short for a zip archive (.npz)", path, file_size);
    }
    void *map = mmap(NULL, (size_t)file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return rp_fail(err, RP_EIO, "%s: cannot map: %s", path, strerror(errno));
    const unsigned char *m = map;
    const uint64_t size = (uint64_t)file_size;
    rp_npz *z = rp_calloc(ctx, 1, sizeof *z);
    if (!z) {
        munmap(map, (size_t)size);
        return rp_fail_nomem(err, "an .npz archive");
    }
    z->ctx = ctx;
    z->map = map;
    z->map_bytes = (size_t)size;

    uint64_t cd_offset = 0, cd_size = 0, entries = 0;
    RP_CHECK_GOTO(find_directory(path, m, size, &cd_offset, &cd_size, &entries, err), st, fail);
    if (!(z->members = rp_calloc(ctx, entries ? entries : 1, sizeof *z->members))) {
        st = rp_fail_nomem(err, "the members of an .npz archive");
        goto fail;
    }
    uint64_t at = cd_offset, cd_end = cd_offset + cd_size;
    for (uint64_t i = 0; i < entries; i++) {
        char name[NPZ_MAX_NAME + 1];
        if (cd_end - at < 46 || le32(m + at) != SIG_CENTRAL) {
            st = rp_fail(err, RP_EFORMAT, "%s: bad central directory entry %" PRIu64 " at byte %" PRIu64, path, i, at);
            goto fail;
        }
        const unsigned char *c = m + at;
        uint32_t flags = le16(c + 8), method = le16(c + 10), crc = le32(c + 16);
        uint64_t csize = le32(c + 20), usize = le32(c + 24), offset = le32(c + 42);
        uint32_t name_len = le16(c + 28), extra_len = le16(c + 30), comment_len = le16(c + 32);
        if (cd_end - at - 46 < (uint64_t)name_len + extra_len + comment_len) {
            st = rp_fail(err, RP_EFORMAT, "%s: central directory entry %" PRIu64 " runs past the directory", path, i);
            goto fail;
        }
        if (name_len == 0 || name_len > NPZ_MAX_NAME || memchr(c + 46, '\0', name_len)) {
            st = rp_fail(err, RP_EFORMAT, "%s: member %" PRIu64 " has an empty, over-long or NUL-holding name", path, i);
            goto fail;
        }
        memcpy(name, c + 46, name_len);
        name[name_len] = '\0';
        RP_CHECK_GOTO(read_zip64_extra(path, name, c + 46 + name_len, extra_len, &usize, &csize, &offset, err),
                      st, fail);
        if (flags & 1) {
            st = rp_fail(err, RP_ENOTSUP, "%s: member '%s' is encrypted", path, name);
            goto fail;
        }
        if (method != 0) {
            st = rp_fail(err, RP_ENOTSUP, "%s: member '%s' is compressed (method %u, as numpy.savez_compressed "
                         "writes): RoutePack maps arrays in place; save the run with numpy.savez", path, name, method);
            goto fail;
        }
        if (name_len < 5 || strcmp(name + name_len - 4, ".npy") != 0) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s' is not a .npy array", path, name);
            goto fail;
        }
        if (csize != usize) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s' is stored but its sizes differ (%" PRIu64 " and %" PRIu64 ")",
                         path, name, csize, usize);
            goto fail;
        }
        /* the local header: its name and extra field lengths give where the data starts */
        if (offset > cd_offset || cd_offset - offset < 30 || le32(m + offset) != SIG_LOCAL) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s': bad local header at byte %" PRIu64, path, name, offset);
            goto fail;
        }
        uint64_t data = offset + 30 + le16(m + offset + 26) + le16(m + offset + 28);
        if (le16(m + offset + 26) != name_len || memcmp(m + offset + 30, name, name_len) != 0) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s': the local header names another file", path, name);
            goto fail;
        }
        if (data > cd_offset || usize > cd_offset - data) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s' (%" PRIu64 " bytes at byte %" PRIu64 ") runs past the "
                         "archive's data", path, name, usize, data);
            goto fail;
        }
        if (crc32_of(m + data, usize) != crc) {
            st = rp_fail(err, RP_EFORMAT, "%s: member '%s': CRC-32 mismatch (the archive is corrupt)", path, name);
            goto fail;
        }
        name[name_len - 4] = '\0';
        for (int32_t j = 0; j < z->count; j++)
            if (!strcmp(z->members[j].name, name)) {
                st = rp_fail(err, RP_EFORMAT, "%s: two members are named '%s.npy'", path, name);
                goto fail;
            }
        char label[NPZ_MAX_NAME + 4096];
        snprintf(label, sizeof label, "%s:%s.npy", path, name);
        npz_member *mb = &z->members[z->count];
        if (!(mb->name = rp_strdup(ctx, name))) {
            st = rp_fail_nomem(err, "an .npz member name");
            goto fail;
        }
        z->count++;
        RP_CHECK_GOTO(rp_npy_parse(ctx, label, m + data, (int64_t)usize, NULL, 0, &mb->array, err), st, fail);
        at += 46 + (uint64_t)name_len + extra_len + comment_len;
    }
    *out = z;
    return RP_OK;
fail:
    rp_npz_close(z);
    return st;
}

void rp_npz_close(rp_npz *z)
{
    if (!z) return;
    for (int32_t i = 0; i < z->count; i++) {
        rp_npy_close(z->members[i].array);
        rp_free(z->ctx, z->members[i].name);
    }
    rp_free(z->ctx, z->members);
    munmap(z->map, z->map_bytes);
    rp_free(z->ctx, z);
}

int32_t rp_npz_count(const rp_npz *z) { return z->count; }
const char *rp_npz_name(const rp_npz *z, int32_t i) { return z->members[i].name; }
const rp_npy *rp_npz_array(const rp_npz *z, int32_t i) { return z->members[i].array; }

const rp_npy *rp_npz_find(const rp_npz *z, const char *name)
{
    for (int32_t i = 0; i < z->count; i++)
        if (!strcmp(z->members[i].name, name)) return z->members[i].array;
    return NULL;
}
