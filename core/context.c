/* The context: allocator hook, log hook and progress hook. */
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

void rp_context_set_progress(rp_context *ctx, rp_progress_fn fn, void *ud)
{
    ctx->progress = fn;
    ctx->progress_ud = ud;
}

void rp_progress(rp_context *ctx, const char *what, int64_t done_bytes, int64_t total_bytes)
{
    if (ctx->progress) ctx->progress(ctx->progress_ud, what, done_bytes, total_bytes);
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

