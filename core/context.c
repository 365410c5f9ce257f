/* The context: allocator hook and log hook. */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Each block starts with its size, padded to keep max_align_t alignment. */
#define HEADER 16

static void *default_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    (void)ud;
    (void)old_size;
    if (new_size == 0) {
        free(ptr);
        return NULL;
    }
    return realloc(ptr, new_size);
}

rp_status rp_context_new(rp_alloc_fn alloc, void *alloc_ud, rp_context **out)
{
    rp_alloc_fn fn = alloc ? alloc : default_alloc;
    rp_context *ctx = fn(alloc_ud, NULL, 0, sizeof *ctx);
    if (!ctx) return RP_ENOMEM;
    memset(ctx, 0, sizeof *ctx);
    ctx->alloc = fn;
    ctx->alloc_ud = alloc_ud;
    ctx->log_min = RP_LOG_INFO;
    *out = ctx;
    return RP_OK;
}

void rp_context_free(rp_context *ctx)
{
    if (ctx) ctx->alloc(ctx->alloc_ud, ctx, sizeof *ctx, 0);
}

void rp_context_set_log(rp_context *ctx, rp_log_fn fn, void *ud, rp_log_level min_level)
{
    ctx->log = fn;
    ctx->log_ud = ud;
    ctx->log_min = min_level;
}

void *rp_alloc(rp_context *ctx, size_t size)
{
    if (size > SIZE_MAX - HEADER) return NULL;
    char *p = ctx->alloc(ctx->alloc_ud, NULL, 0, size + HEADER);
    if (!p) return NULL;
    memcpy(p, &size, sizeof size);
    return p + HEADER;
}

void *rp_calloc(rp_context *ctx, size_t count, size_t size)
{
    size_t total;
    if (__builtin_mul_overflow(count, size, &total)) return NULL;
    void *p = rp_alloc(ctx, total);
    if (p) memset(p, 0, total);
    return p;
}

void *rp_realloc(rp_context *ctx, void *ptr, size_t size)
{
    if (!ptr) return rp_alloc(ctx, size);
    if (size > SIZE_MAX - HEADER) return NULL;
    char *block = (char *)ptr - HEADER;
    size_t old;
    memcpy(&old, block, sizeof old);
    char *p = ctx->alloc(ctx->alloc_ud, block, old + HEADER, size + HEADER);
    if (!p) return NULL;
    memcpy(p, &size, sizeof size);
    return p + HEADER;
}

void rp_free(rp_context *ctx, void *ptr)
{
    if (!ptr) return;
    char *block = (char *)ptr - HEADER;
    size_t old;
    memcpy(&old, block, sizeof old);
    ctx->alloc(ctx->alloc_ud, block, old + HEADER, 0);
}

void rp_text_free(rp_context *ctx, char *text)
{
    rp_free(ctx, text);
}

char *rp_strdup(rp_context *ctx, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = rp_alloc(ctx, n);
    if (p) memcpy(p, s, n);
    return p;
}

void rp_log(rp_context *ctx, rp_log_level level, const char *fmt, ...)
{
    if (!ctx || !ctx->log || level < ctx->log_min) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ctx->log(ctx->log_ud, level, msg);
}

rp_status rp_read_file(rp_context *ctx, const char *path, char **text, size_t *len,
                       rp_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return rp_fail(err, RP_EIO, "%s: cannot open: %s", path, strerror(errno));
    rp_status st = RP_OK;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            size_t ncap = cap ? cap * 2 : 65536;
            char *nb = rp_realloc(ctx, buf, ncap);
            if (!nb) {
                st = rp_fail_nomem(err, path);
                goto out;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        st = rp_fail(err, RP_EIO, "%s: read error: %s", path, strerror(errno));
        goto out;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    buf = NULL;
out:
    rp_free(ctx, buf);
    fclose(f);
    return st;
}
