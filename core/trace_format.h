/* The trace format's shared layout (docs/formats.md), for its reader (core/trace.c) and
 * its writer (core/trace_write.c). */
#ifndef RP_TRACE_FORMAT_H
#define RP_TRACE_FORMAT_H

#include "internal.h"
#include "routepack/trace.h"

#include <stdbool.h>
#include <stdint.h>

/* PNG-style: the high byte catches 7-bit transfers, CR LF and LF catch line-ending
 * conversion, ^Z stops a DOS `type`. */
static const unsigned char TRACE_MAGIC[8] = {0x89, 'R', 'P', 'T', '\r', '\n', 0x1a, '\n'};

#define ALIGN 64                  /* every block and every payload array starts here */
#define PREFIX_BYTES 16           /* magic, uint32 header_bytes, uint32 reserved */
#define MAX_HEADER_BYTES 65536    /* a real header is ~250 bytes; bounds what we parse */
#define CHECKSUM_DIGITS 16

/* ---- layout of one step's payload ---- */

typedef struct layout {
    int64_t lens_bytes;    /* one int32[num_seqs] array, padded to ALIGN */
    int64_t ids_count;     /* num_tokens * num_layers * top_k */
    int64_t ids_bytes;     /* ids_count * width, unpadded */
    int64_t payload_bytes; /* 3 * lens_bytes + ids_bytes padded */
} layout;

static inline int64_t trace_pad_to_align(int64_t n) { return (n + ALIGN - 1) & ~(int64_t)(ALIGN - 1); }

/* False when a size does not fit in int64. */
static inline bool trace_compute_layout(int32_t num_seqs, int64_t num_tokens, int32_t num_layers,
                                        int32_t top_k, int width, layout *out)
{
    int64_t ids, bytes;
    if (rp_mul_overflow(num_tokens, num_layers, &ids) || rp_mul_overflow(ids, top_k, &ids) ||
        rp_mul_overflow(ids, width, &bytes) || bytes > INT64_MAX - ALIGN)
        return false;
    out->lens_bytes = trace_pad_to_align((int64_t)num_seqs * 4);
    out->ids_count = ids;
    out->ids_bytes = bytes;
    return !rp_add_overflow(trace_pad_to_align(bytes), 3 * out->lens_bytes, &out->payload_bytes);
}

/* An opened trace (core/trace.c); the writer reads one to append after it. */
struct rp_trace {
    rp_context *ctx;
    char *path;
    const unsigned char *map;
    size_t map_bytes;
    int32_t num_steps;
    rp_trace_step_info *steps;
};

/* Index of the first id in p[0..n) that is not below `limit` (unsigned: a negative
 * int32 is huge), or -1 (core/trace.c). */
int64_t trace_first_bad_id(const void *p, rp_id_width width, int64_t n, uint32_t limit);

/* The sequence that owns global token `token` (cu_seqlens non-decreasing, last entry
 * above `token`): the first s with cu[s + 1] > token, so empty sequences are skipped. */
int32_t trace_seq_of_token(const int64_t *cu, int32_t num_seqs, int64_t token);

#endif
