/* RoutePack base: status codes, error reports, the per-context allocator and log hook.
 * Everything else in the public API builds on these. */
#ifndef ROUTEPACK_BASE_H
#define ROUTEPACK_BASE_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the exported symbols of the shared library (built with hidden visibility). */
#if defined(__GNUC__)
#define RP_API __attribute__((visibility("default")))
#else
#define RP_API
#endif

#define RP_VERSION_MAJOR 0
#define RP_VERSION_MINOR 1
#define RP_VERSION_PATCH 0
#define RP_VERSION_STRING "0.1.0"

/* Result of every fallible call. Codes are appended, never renumbered. */
typedef enum rp_status {
    RP_OK = 0,
    RP_EINVAL = 1,     /* an argument or an input value is invalid */
    RP_ENOMEM = 2,     /* an allocation failed */
    RP_EIO = 3,        /* a file could not be opened, read or written */
    RP_EFORMAT = 4,    /* a file or text is malformed (bad magic, syntax, truncation) */
    RP_ERANGE = 5,     /* a value is out of range, or sizes overflow */
    RP_ENOTSUP = 6,    /* not supported by this build or this version */
    RP_EPOLICY = 7,    /* a policy failed (error, invalid metadata) */
    RP_ELIMIT = 8,     /* a sandbox limit was hit */
    RP_ETRANSPORT = 9, /* a transport failed */
    RP_ECHECKSUM = 10, /* data does not match its checksum */
    RP_ETIMEOUT = 11,  /* a deadline passed */
    RP_EPLAN = 12      /* a plan is invalid */
} rp_status;

/* Words for a status code; never NULL, static storage. */
RP_API const char *rp_strerror(rp_status status);

#define RP_ERROR_TEXT 512

/* The detail of a failure, filled by the call that failed (jansson's json_error_t).
 * `text` is the whole message, location first ("config.json:14:9: ..."); the other
 * fields repeat the location for programs, -1 where they do not apply. */
typedef struct rp_error {
    rp_status status;
    int32_t line, column;   /* 1-based position in a text file */
    int64_t offset;         /* byte offset in a binary file */
    int64_t sequence;       /* offending sequence id */
    int64_t expert;         /* offending expert id */
    char text[RP_ERROR_TEXT];
} rp_error;

/* Reset an error report to "no error". */
RP_API void rp_error_clear(rp_error *err);

/* The size in bytes of the public struct `name` ("rp_execution", "rp_trainer", ...; every
 * struct of these headers) as this build lays it out: a binding that mirrors the structs
 * (Python's ctypes classes) checks its mirror against the library it loads. 0 for a
 * name it does not know or NULL. */
RP_API size_t rp_struct_size(const char *name);

/* Allocator hook, with lua_Alloc's contract: new_size == 0 frees `ptr` and returns
 * NULL; otherwise behaves like realloc (ptr may be NULL). Must be thread-safe if the
 * context is used by several threads. */
typedef void *(*rp_alloc_fn)(void *ud, void *ptr, size_t old_size, size_t new_size);

typedef enum rp_log_level {
    RP_LOG_DEBUG = 0,
    RP_LOG_INFO = 1,
    RP_LOG_WARN = 2,
    RP_LOG_ERROR = 3
} rp_log_level;

/* Log hook. The library never prints; what it has to say goes here. */
typedef void (*rp_log_fn)(void *ud, rp_log_level level, const char *message);

/* Progress hook. Long byte passes report how far they are, so that a tool can show
 * progress inside one huge step: writing a trace step's payload ("writing": bytes of
 * that step's payload written, of its payload size), the checksum pass of rp_trace_open
 * ("verifying") and rp_trace_validate ("validating": payload bytes of the whole trace
 * read). It is called on the caller's thread from inside the call, about every 4 MB
 * written or 64 MB read, and once with done_bytes == total_bytes at the end of a pass
 * that completes; done_bytes never decreases within a pass. It must not call the library
 * on the objects the call is working on. */
typedef void (*rp_progress_fn)(void *ud, const char *what, int64_t done_bytes, int64_t total_bytes);

/* A context carries the allocator, the log hook and the progress hook. Every object is
 * created in one and must be freed before it. A context has no other state, so several
 * schedulers in one process never interfere. */
typedef struct rp_context rp_context;

/* Create a context. `alloc` NULL means the C library's malloc. */
RP_API rp_status rp_context_new(rp_alloc_fn alloc, void *alloc_ud, rp_context **out);
RP_API void rp_context_free(rp_context *ctx);
/* Messages below `min_level` are dropped. `fn` NULL disables logging (the default). */
RP_API void rp_context_set_log(rp_context *ctx, rp_log_fn fn, void *ud, rp_log_level min_level);
/* `fn` NULL disables progress reports (the default). */
RP_API void rp_context_set_progress(rp_context *ctx, rp_progress_fn fn, void *ud);

/* Free text the library allocated through `ctx` (JSON dumps, reports). NULL is a no-op. */
RP_API void rp_text_free(rp_context *ctx, char *text);

/* Width of a routing id as it arrives from the trainer. The value is its byte size. */
typedef enum rp_id_width {
    RP_ID_U8 = 1,
    RP_ID_U16 = 2,
    RP_ID_I32 = 4
} rp_id_width;

/* Largest expert count a width can address. */
RP_API int64_t rp_id_width_capacity(rp_id_width width);

/* XXH64 of a byte range (seed as given). Used for trace payloads, plan hashes and
 * migration checksums, so it is stable across versions and machines. */
RP_API uint64_t rp_hash64(const void *data, size_t len, uint64_t seed);

/* Streaming form of rp_hash64: same result as one call over the concatenation. */
typedef struct rp_hash_state {
    uint64_t v[4];
    uint64_t total_len;
    uint64_t seed;
    unsigned char buf[32];
    uint32_t buf_len;
} rp_hash_state;
RP_API void rp_hash_init(rp_hash_state *st, uint64_t seed);
RP_API void rp_hash_update(rp_hash_state *st, const void *data, size_t len);
RP_API uint64_t rp_hash_final(const rp_hash_state *st);

#ifdef __cplusplus
}
#endif
#endif
