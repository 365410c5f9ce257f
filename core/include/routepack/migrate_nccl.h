/* The NCCL transport for expert migration: grouped ncclSend/ncclRecv of CUDA device
 * buffers on the trainer's communicator and stream. Not included by routepack.h, since
 * it needs <nccl.h> and the CUDA runtime; available when the library was built with
 * NCCL (rp_transport_built("nccl")). */
#ifndef ROUTEPACK_MIGRATE_NCCL_H
#define ROUTEPACK_MIGRATE_NCCL_H

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "routepack/migrate.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A transport over the ranks of `comm` (rank r = GPU r, or EP rank r of one group),
 * enqueuing on `stream` after the work already queued there. Registered tensors and
 * staging are device memory of the current device (staging: cudaMalloc, unless the
 * caller passes its own). Every wait polls cudaEventQuery and ncclCommGetAsyncError
 * until the deadline; on a deadline or an asynchronous NCCL error the transport calls
 * ncclCommAbort(comm): the communicator is then gone and the trainer must create a new
 * one (or end the job), as after any NCCL failure. Expert checksums run on the GPU
 * (rp_gpu_checksum, one launch per round's batch, on `stream`); a device without
 * stream-ordered memory pools computes them on the host through a pinned buffer,
 * correct but slow (docs/migration.md). The communicator and stream are borrowed;
 * rp_transport_free frees only what the transport allocated. */
RP_API rp_status rp_transport_nccl_new(rp_context *ctx, ncclComm_t comm, cudaStream_t stream,
                                       rp_transport **out, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
