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

/* ---- .npz (what numpy.savez writes: a zip of .npy members, stored, zip64 as needed) ---- */

typedef struct rp_npz rp_npz;

/* Map an .npz archive and check every member before returning: the zip structure
 * (central directory against local headers, zip64 records and extra fields), each
 * member's CRC-32, and each member's .npy header as rp_npy_open checks it. Compressed
 * (numpy.savez_compressed) and encrypted members are RP_ENOTSUP with the reason; a
 * member that is not a .npy, two members of one name, or anything outside the file is
 * RP_EFORMAT. Members are read in place, never copied. */
RP_API rp_status rp_npz_open(rp_context *ctx, const char *path, rp_npz **out, rp_error *err);
RP_API void rp_npz_close(rp_npz *npz);
RP_API int32_t rp_npz_count(const rp_npz *npz);
/* Member i's name without ".npy" (the keyword numpy.savez was given), in archive order. */
RP_API const char *rp_npz_name(const rp_npz *npz, int32_t i);
/* Member i's array (borrowed, valid until rp_npz_close; never pass it to rp_npy_close). */
RP_API const rp_npy *rp_npz_array(const rp_npz *npz, int32_t i);
/* The member of that name (without ".npy"), or NULL. */
RP_API const rp_npy *rp_npz_find(const rp_npz *npz, const char *name);

/* Write a C-ordered little-endian .npy (version 1.0); for tests and tools. */
RP_API rp_status rp_npy_write(const char *path, rp_npy_dtype dtype, int32_t ndim, const int64_t *shape,
                       const void *data, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
