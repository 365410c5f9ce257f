/* Routing traces (.rpt): one or more consecutive steps of a batch and its routing
 * replay, byte by byte in docs/formats.md; and .npy import of arrays dumped from Python. */
#ifndef ROUTEPACK_TRACE_H
#define ROUTEPACK_TRACE_H

#include "routepack/batch.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RP_TRACE_VERSION 1

/* What the header of one step says. */
typedef struct rp_trace_step_info {
    int64_t step;            /* step index as recorded */
    int32_t num_seqs;
    int64_t num_tokens;
    int32_t num_layers;
    int32_t num_experts;
    int32_t top_k;
    rp_id_width width;
    uint64_t checksum;       /* XXH64 of the payload */
    int64_t offset;          /* byte offset of the step's magic in the file */
    int64_t payload_offset;  /* byte offset of its payload */
    int64_t payload_bytes;
} rp_trace_step_info;

typedef struct rp_trace rp_trace;

/* Skip the payload checksum pass at open (headers and sizes are still checked). */
#define RP_TRACE_NO_VERIFY 1u

/* Open a trace: map it, check every step's header, sizes and (unless
 * RP_TRACE_NO_VERIFY) payload checksum in one streaming pass. A trace that opens is
 * whole: truncation, bad magic, unknown versions, overflowing sizes and checksum
 * mismatches fail here with the byte offset. The file is memory-mapped, never read
 * whole into memory. */
RP_API rp_status rp_trace_open(rp_context *ctx, const char *path, unsigned flags, rp_trace **out,
                        rp_error *err);
RP_API void rp_trace_close(rp_trace *trace);

RP_API int32_t rp_trace_num_steps(const rp_trace *trace);
/* Borrowed, valid until rp_trace_close; NULL if i is out of range. */
RP_API const rp_trace_step_info *rp_trace_step(const rp_trace *trace, int32_t i);

/* The batch of step i (a new object the caller frees) and a routing view into the
 * mapped file (valid until rp_trace_close). Lengths are checked against the token
 * count; expert ids are not scanned here (rp_trace_validate does that). */
RP_API rp_status rp_trace_read_step(rp_trace *trace, int32_t i, rp_batch **batch, rp_routing *routing,
                             rp_error *err);

/* Full validation: checksums, lengths, and every expert id in range. The first problem
 * is reported with its step, sequence, token and byte offset. */
RP_API rp_status rp_trace_validate(rp_trace *trace, rp_error *err);

typedef struct rp_trace_writer rp_trace_writer;

/* Create (truncate) a trace file for a model with num_experts experts. */
RP_API rp_status rp_trace_writer_open(rp_context *ctx, const char *path, int32_t num_experts,
                               rp_trace_writer **out, rp_error *err);
/* Open an existing trace to append steps to it. Its headers and sizes are checked as
 * by rp_trace_open with RP_TRACE_NO_VERIFY (payloads are not read); num_experts must
 * be the trace's, and appended steps must have its layers, top-k and id width. */
RP_API rp_status rp_trace_writer_open_append(rp_context *ctx, const char *path, int32_t num_experts,
                                      rp_trace_writer **out, rp_error *err);
/* Append one step. Ids are written in the routing view's width, in packed
 * [tokens, layers, k] order whatever the view's layout; every id is checked. Steps of
 * one trace share layers, top-k and id width. On error the file is truncated back to
 * where the step began, so it holds exactly the steps appended before. */
RP_API rp_status rp_trace_writer_append(rp_trace_writer *w, int64_t step, const rp_batch *batch,
                                 const rp_routing *routing, rp_error *err);
/* Flush and close; frees the writer whatever the result. */
RP_API rp_status rp_trace_writer_close(rp_trace_writer *w, rp_error *err);

/* ---- .npy (NumPy format versions 1-3, C order, little-endian integers) ---- */

typedef enum rp_npy_dtype {
    RP_NPY_I8, RP_NPY_U8, RP_NPY_I16, RP_NPY_U16, RP_NPY_I32, RP_NPY_U32, RP_NPY_I64, RP_NPY_U64
} rp_npy_dtype;

typedef struct rp_npy rp_npy;

/* Map a .npy file. Rejects Fortran order, big-endian and non-integer dtypes, and a
 * data size that does not match the shape, with the reason. */
RP_API rp_status rp_npy_open(rp_context *ctx, const char *path, rp_npy **out, rp_error *err);
RP_API void rp_npy_close(rp_npy *npy);
RP_API rp_npy_dtype rp_npy_type(const rp_npy *npy);
RP_API int32_t rp_npy_ndim(const rp_npy *npy);
RP_API const int64_t *rp_npy_shape(const rp_npy *npy);
RP_API int64_t rp_npy_count(const rp_npy *npy);       /* number of elements */
RP_API const void *rp_npy_data(const rp_npy *npy);   /* borrowed, valid until rp_npy_close */
/* Element i as int64 (bounds-checked by the caller). */
RP_API int64_t rp_npy_get(const rp_npy *npy, int64_t i);

/* Write a C-ordered little-endian .npy (version 1.0); for tests and tools. */
RP_API rp_status rp_npy_write(const char *path, rp_npy_dtype dtype, int32_t ndim, const int64_t *shape,
                       const void *data, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
