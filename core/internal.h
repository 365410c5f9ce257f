/* Private helpers shared by the core: allocation through the context, error reports,
 * logging and checked size arithmetic. Not installed. */
#ifndef RP_INTERNAL_H
#define RP_INTERNAL_H

#include "routepack/base.h"

#include <stdarg.h>
#include <stdbool.h>

struct rp_context {
    rp_alloc_fn alloc;
    void *alloc_ud;
    rp_log_fn log;
    void *log_ud;
    rp_log_level log_min;
    rp_progress_fn progress;
    void *progress_ud;
};

#if defined(__GNUC__)
#define RP_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define RP_PRINTF(f, a)
#endif

/* Allocation through the context's hook. Blocks carry their size in a small header,
 * so rp_free needs no size; the hook still sees exact sizes. rp_alloc and rp_calloc
 * return NULL on failure or on a size that overflows. */
void *rp_alloc(rp_context *ctx, size_t size);
void *rp_calloc(rp_context *ctx, size_t count, size_t size);
void *rp_realloc(rp_context *ctx, void *ptr, size_t size);
void rp_free(rp_context *ctx, void *ptr);
char *rp_strdup(rp_context *ctx, const char *s);

/* Report a pass's progress through the context's hook, if any (see rp_progress_fn). */
void rp_progress(rp_context *ctx, const char *what, int64_t done_bytes, int64_t total_bytes);

/* Fill `err` (may be NULL) and return `status`. Positions are reset to -1; set the
 * ones that apply after the call. */
rp_status rp_fail(rp_error *err, rp_status status, const char *fmt, ...) RP_PRINTF(3, 4);
rp_status rp_failv(rp_error *err, rp_status status, const char *fmt, va_list ap);
/* rp_fail that also names the offending sequence (err->sequence = seq). */
rp_status rp_fail_seq(rp_error *err, rp_status status, int64_t seq, const char *fmt, ...) RP_PRINTF(4, 5);
/* Report an allocation failure of `what`. */
rp_status rp_fail_nomem(rp_error *err, const char *what);

void rp_log(rp_context *ctx, rp_log_level level, const char *fmt, ...) RP_PRINTF(3, 4);

/* Optimal string alignment distance between a and b (Levenshtein plus adjacent
 * transpositions, the commonest typo), for suggesting a near-miss name; SIZE_MAX when
 * either is longer than RP_EDIT_DISTANCE_MAX_LEN bytes. */
#define RP_EDIT_DISTANCE_MAX_LEN 64
size_t rp_edit_distance(const char *a, const char *b);

/* rp_registry_check over the layers with layers[l] set (NULL: every layer): under PP a
 * rank registers only its pipeline stage's layers (core/registry.c). */
struct rp_registry;
rp_status registry_check_layers(const struct rp_registry *r, const unsigned char *layers, rp_error *err);

/* Checked arithmetic for sizes read from files or callers: true on overflow. */
static inline bool rp_mul_overflow(int64_t a, int64_t b, int64_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}
static inline bool rp_add_overflow(int64_t a, int64_t b, int64_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

/* Files the library and the CLI read (core/file.c). */

/* The largest text file read whole (configs, plans, generator settings, counts files):
 * checked against the file's size before anything is allocated. */
#define RP_TEXT_FILE_MAX_BYTES ((size_t)256 << 20)

/* Open `path` with `flags` (O_RDONLY, O_WRONLY) without blocking in open() (a FIFO
 * without a writer would block it for ever) and refuse anything but a regular file
 * (RP_EIO: "x.json: is a FIFO, not a regular file ..."); the descriptor is blocking
 * again and close-on-exec. *size (may be NULL) gets the file's size. */
rp_status rp_file_open_regular(const char *path, int flags, int *fd, int64_t *size, rp_error *err);

/* Words for a file type in messages ("a FIFO", "a character device"); `mode` as
 * struct stat's st_mode. */
const char *rp_file_kind(unsigned mode);

/* Read a whole regular file, NUL-terminated, into memory from ctx: one larger than
 * max_bytes is RP_ERANGE before anything is allocated, one that grows while it is read
 * is RP_EIO. rp_read_file caps at RP_TEXT_FILE_MAX_BYTES. */
/* Read the rest of an open regular file of `size` bytes whole, NUL-terminated (caller
 * frees with rp_free); a file that grew past `size` meanwhile is RP_EIO. `path` names it
 * in messages. The size cap is the caller's, decided before this allocates. */
rp_status rp_read_fd_whole(rp_context *ctx, int fd, int64_t size, const char *path, char **text, size_t *len,
                           rp_error *err);
rp_status rp_read_file_max(rp_context *ctx, const char *path, size_t max_bytes, char **text, size_t *len,
                           rp_error *err);
rp_status rp_read_file(rp_context *ctx, const char *path, char **text, size_t *len,
                       rp_error *err);

/* Run `call`; on failure keep its status in `st` and jump to `label`. */
#define RP_CHECK_GOTO(call, st, label) \
    do {                               \
        (st) = (call);                 \
        if ((st) != RP_OK) goto label; \
    } while (0)

/* Load one routing id of any width. */
static inline int32_t rp_id_load(const void *base, rp_id_width width, int64_t index)
{
    switch (width) {
    case RP_ID_U8: return ((const uint8_t *)base)[index];
    case RP_ID_U16: return ((const uint16_t *)base)[index];
    default: return ((const int32_t *)base)[index];
    }
}

#endif
