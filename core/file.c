/* Opening the files the library and the CLI read (configs, plans, generator settings and
 * their counts files, traces, .npy arrays): never blocking in open(), regular files only,
 * text read whole under a size cap decided before anything is allocated. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *rp_file_kind(unsigned mode)
{
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

rp_status rp_file_open_regular(const char *path, int flags, int *fd_out, int64_t *size, rp_error *err)
{
    /* O_NONBLOCK: opening a FIFO without a writer (or for writing without a reader)
     * would block for ever; a device may block too. The type is checked on the open
     * descriptor (fstat), so nothing can swap the file between the check and the read. */
    int fd = open(path, flags | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return rp_fail(err, RP_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    rp_status st = RP_OK;
    if (fstat(fd, &sb) != 0) {
        st = rp_fail(err, RP_EIO, "%s: cannot stat: %s", path, strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        st = rp_fail(err, RP_EIO, "%s: is %s, not a regular file (RoutePack reads its inputs from regular files)",
                     path, rp_file_kind((unsigned)sb.st_mode));
    } else {
        /* back to blocking reads: O_NONBLOCK was only for the open */
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
            st = rp_fail(err, RP_EIO, "%s: cannot set blocking mode: %s", path, strerror(errno));
    }
    if (st != RP_OK) {
        close(fd);
        return st;
    }
    *fd_out = fd;
    if (size) *size = (int64_t)sb.st_size;
    return RP_OK;
}

rp_status rp_read_fd_whole(rp_context *ctx, int fd, int64_t size, const char *path, char **text, size_t *len,
                           rp_error *err)
{
    /* one byte past the size, so a file growing meanwhile is noticed, and the NUL */
    size_t want = (size_t)size + 1, got = 0;
    char *buf = rp_alloc(ctx, want + 1);
    if (!buf) return rp_fail_nomem(err, path);
    rp_status st = RP_OK;
    while (got < want) {
        ssize_t n = read(fd, buf + got, want - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            st = rp_fail(err, RP_EIO, "%s: read error: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0) break;
        got += (size_t)n;
    }
    if (got > (size_t)size) {
        st = rp_fail(err, RP_EIO, "%s: grew while it was read (from %lld bytes); read it again", path,
                     (long long)size);
        goto out;
    }
    buf[got] = '\0';
    *text = buf;
    *len = got;
    buf = NULL;
out:
    rp_free(ctx, buf);
    return st;
}

rp_status rp_read_file_max(rp_context *ctx, const char *path, size_t max_bytes, char **text, size_t *len,
                           rp_error *err)
{
    int fd = -1;      /* set: at -O3 GCC cannot see that the open fills both on RP_OK */
    int64_t size = 0;
    rp_status st = rp_file_open_regular(path, O_RDONLY, &fd, &size, err);
    if (st != RP_OK) return st;
    if (size < 0 || (uint64_t)size > max_bytes)
        st = rp_fail(err, RP_ERANGE, "%s: is %lld bytes; a file read whole may be at most %zu bytes", path,
                     (long long)size, max_bytes);
    else
        st = rp_read_fd_whole(ctx, fd, size, path, text, len, err);
    close(fd);
    return st;
}

rp_status rp_read_file(rp_context *ctx, const char *path, char **text, size_t *len, rp_error *err)
{
    return rp_read_file_max(ctx, path, RP_TEXT_FILE_MAX_BYTES, text, len, err);
}
