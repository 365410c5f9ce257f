/* The NCCL transport: grouped ncclSend/ncclRecv of device buffers on the trainer's
 * communicator and stream, bounded waits (cudaEventQuery plus ncclCommGetAsyncError
 * until a deadline, ncclCommAbort on failure), expert checksums by the GPU kernel
 * rp_gpu_checksum on the same stream (through host memory where it cannot run). */
#include "transport.h"

#ifdef RP_HAVE_NCCL

#include "checksum_internal.h"
#include "routepack/gpu.h"
#include "routepack/migrate_nccl.h"

#include <sched.h>
#include <stdio.h>
#include <string.h>

#define BOUNCE_BYTES ((size_t)4 << 20) /* pinned host buffer for headers and host checksums */
#define FINISH_BOUND_S 5.0             /* how long finish waits for a batch before aborting */
#define SCRATCH_BYTES ((size_t)4 << 20) /* device memory a swap goes through */

typedef struct nccl_transport {
    rp_transport base;
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t done;
    bool in_flight;        /* a batch was started and not finished */
    bool event_recorded;   /* the batch's completion event is on the stream */
    void **corrupt;        /* device copies sent instead of the real buffer (fault) */
    int32_t num_corrupt, cap_corrupt;
    unsigned char *bounce; /* pinned host memory, BOUNCE_BYTES */
    unsigned char *coll;   /* device memory for exchanges, taken at creation for the
                              executor's records so that its exchanges never allocate */
    size_t coll_cap;
    unsigned char *scratch; /* device memory, SCRATCH_BYTES, for swaps */
} nccl_transport;

static void nccl_abort(nccl_transport *nt, const char *why)
{
    if (nt->base.broken) return;
    ncclCommAbort(nt->comm);
    rp_transport_break(&nt->base, why);
}

static rp_status cuda_error(rp_error *err, cudaError_t rc, const char *what)
{
    return rp_fail(err, RP_ETRANSPORT, "transport: %s failed: %s", what, cudaGetErrorString(rc));
}

/* Wait until the work queued on the stream so far is done, or the deadline. Any
 * failure aborts the communicator, so nothing can hang on it later. After an abort the
 * communicator is gone: only the stream is waited for (copies that restore slots after
 * a failed exchange still run). */
static rp_status poll_until(nccl_transport *nt, double deadline, const char *what, rp_error *err)
{
    const bool comm_alive = !nt->base.broken;
    if (!nt->event_recorded && !comm_alive) {
        cudaError_t rc = cudaEventRecord(nt->done, nt->stream);
        if (rc != cudaSuccess) return cuda_error(err, rc, "recording a CUDA event");
        nt->event_recorded = true;
    }
    if (!nt->event_recorded) {
        /* A non-blocking communicator may still be enqueuing the group. */
        for (;;) {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(nt->comm, &async);
            if (async == ncclSuccess) break;
            if (async != ncclInProgress) {
                nccl_abort(nt, "an NCCL operation failed");
                return rp_fail(err, RP_ETRANSPORT, "transport: %s failed: %s", what, ncclGetErrorString(async));
            }
            if (rp_now_s() >= deadline) {
                nccl_abort(nt, "an NCCL operation timed out");
                return rp_fail(err, RP_ETIMEOUT, "transport: %s did not start before the deadline; the NCCL "
                               "communicator was aborted", what);
            }
            sched_yield();
        }
        cudaError_t rc = cudaEventRecord(nt->done, nt->stream);
        if (rc != cudaSuccess) {
            nccl_abort(nt, "recording a CUDA event failed");
            return cuda_error(err, rc, "recording a CUDA event");
        }
        nt->event_recorded = true;
    }
    for (;;) {
        cudaError_t rc = cudaEventQuery(nt->done);
        ncclResult_t async = ncclSuccess;
        if (comm_alive) ncclCommGetAsyncError(nt->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
            nccl_abort(nt, "an NCCL operation failed");
            return rp_fail(err, RP_ETRANSPORT, "transport: %s failed: %s; the NCCL communicator was aborted", what,
                           ncclGetErrorString(async));
        }
        if (rc == cudaSuccess) {
            nt->event_recorded = false;
            return RP_OK;
        }
        if (rc != cudaErrorNotReady) {
            nccl_abort(nt, "a CUDA operation failed");
            return cuda_error(err, rc, what);
        }
        if (rp_now_s() >= deadline) {
            nccl_abort(nt, "an NCCL operation timed out");
            return rp_fail(err, RP_ETIMEOUT, "transport: %s did not finish before the deadline; the NCCL "
                           "communicator was aborted", what);
        }
        sched_yield();
    }
}

/* Enqueue work that is not NCCL's, then wait for it. */
static rp_status sync_stream(nccl_transport *nt, double deadline, const char *what, rp_error *err)
{
    nt->event_recorded = false;
    return poll_until(nt, deadline, what, err);
}

static void keep_corrupt(nccl_transport *nt, void *p)
{
    if (nt->num_corrupt == nt->cap_corrupt) {
        int32_t cap = nt->cap_corrupt ? nt->cap_corrupt * 2 : 8;
        void **c = rp_realloc(nt->base.ctx, nt->corrupt, (size_t)cap * sizeof *c);
        if (!c) {
            cudaFree(p);
            return;
        }
        nt->corrupt = c;
        nt->cap_corrupt = cap;
    }
    nt->corrupt[nt->num_corrupt++] = p;
}

/* A device copy of a message with its middle byte flipped (fault injection). */
static rp_status make_corrupt(nccl_transport *nt, const rp_transport_op *op, void **out, rp_error *err)
{
    void *p = NULL;
    cudaError_t rc = cudaMalloc(&p, op->bytes);
    if (rc != cudaSuccess) return cuda_error(err, rc, "allocating a corrupted message");
    keep_corrupt(nt, p);
    size_t mid = op->bytes / 2;
    rc = cudaMemcpyAsync(p, op->buf, op->bytes, cudaMemcpyDeviceToDevice, nt->stream);
    if (rc == cudaSuccess) rc = cudaMemcpyAsync(nt->bounce, (unsigned char *)op->buf + mid, 1, cudaMemcpyDeviceToHost,
                                                nt->stream);
    if (rc != cudaSuccess) return cuda_error(err, rc, "copying a corrupted message");
    rp_status st = sync_stream(nt, rp_now_s() + FINISH_BOUND_S, "copying a corrupted message", err);
    if (st != RP_OK) return st;
    nt->bounce[0] ^= 0xff;
    rc = cudaMemcpyAsync((unsigned char *)p + mid, nt->bounce, 1, cudaMemcpyHostToDevice, nt->stream);
    if (rc != cudaSuccess) return cuda_error(err, rc, "copying a corrupted message");
    st = sync_stream(nt, rp_now_s() + FINISH_BOUND_S, "copying a corrupted message", err);
    if (st != RP_OK) return st;
    *out = p;
    return RP_OK;
}

static rp_status nccl_start(rp_transport *t, const rp_transport_op *ops, int32_t n, int32_t *failed, rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    *failed = -1;
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    if (nt->in_flight) return rp_fail(err, RP_EINVAL, "transport: a batch is already in flight");
    /* Decide every fault before enqueuing anything: a group is all or nothing. */
    rp_fault_kind *faults = rp_calloc(t->ctx, (size_t)n + 1, sizeof *faults);
    void **bufs = rp_calloc(t->ctx, (size_t)n + 1, sizeof *bufs);
    rp_status st = RP_OK;
    if (!faults || !bufs) {
        st = rp_fail_nomem(err, "the transport's operations");
        goto out;
    }
    for (int32_t i = 0; i < n; i++) {
        bufs[i] = ops[i].buf;
        if (ops[i].peer < 0 || ops[i].peer >= t->size) {
            *failed = i;
            st = rp_fail(err, RP_EINVAL, "transport: peer %d is out of range (%d ranks)", ops[i].peer, t->size);
            goto out;
        }
        if (!ops[i].send) continue;
        double delay = 0.0;
        faults[i] = rp_transport_send_fault(t, &ops[i], &delay);
        if (faults[i] == RP_FAULT_SEND_FAIL) {
            *failed = i;
            st = rp_fail(err, RP_ETRANSPORT, "transport: the send of %zu bytes to rank %d failed (injected fault)",
                         ops[i].bytes, ops[i].peer);
            goto out;
        }
        if (faults[i] == RP_FAULT_CORRUPT && (st = make_corrupt(nt, &ops[i], &bufs[i], err)) != RP_OK) {
            *failed = i;
            goto out;
        }
    }
    ncclResult_t rc = ncclGroupStart();
    for (int32_t i = 0; i < n && rc == ncclSuccess; i++) {
        /* A dropped message is never sent; NCCL cannot hold one back, send one short
         * (the receive would never match it) or keep one for a later group, so a
         * delayed, short or late one is not sent either: each leaves the receiver
         * waiting past its deadline. */
        if (faults[i] == RP_FAULT_DROP || faults[i] == RP_FAULT_DELAY || faults[i] == RP_FAULT_SHORT ||
            faults[i] == RP_FAULT_LATE)
            continue;
        if (ops[i].send) rc = ncclSend(bufs[i], ops[i].bytes, ncclUint8, ops[i].peer, nt->comm, nt->stream);
        else rc = ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, nt->comm, nt->stream);
    }
    ncclResult_t end = ncclGroupEnd();
    if (rc == ncclSuccess) rc = end;
    nt->in_flight = true;
    nt->event_recorded = false;
    if (rc != ncclSuccess && rc != ncclInProgress) {
        nccl_abort(nt, "starting NCCL sends and receives failed");
        st = rp_fail(err, RP_ETRANSPORT, "transport: starting %d NCCL sends and receives failed: %s; the NCCL "
                     "communicator was aborted", n, ncclGetErrorString(rc));
    }
out:
    rp_free(t->ctx, faults);
    rp_free(t->ctx, bufs);
    return st;
}

static rp_status nccl_wait(rp_transport *t, double deadline, int32_t *failed, rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    *failed = -1; /* NCCL tells whether a group finished, not which message is missing */
    if (!nt->in_flight) return RP_OK;
    return poll_until(nt, deadline, "a group of NCCL sends and receives", err);
}

static bool nccl_finish(rp_transport *t)
{
    nccl_transport *nt = (nccl_transport *)t;
    bool safe = true;
    if (nt->in_flight) {
        if (t->broken) {
            safe = false; /* aborted: whatever was enqueued may not have stopped yet */
        } else {
            rp_error e;
            if (poll_until(nt, rp_now_s() + FINISH_BOUND_S, "finishing a batch", &e) != RP_OK) safe = false;
        }
    }
    if (safe) {
        for (int32_t i = 0; i < nt->num_corrupt; i++) cudaFree(nt->corrupt[i]);
        nt->num_corrupt = 0;
    }
    nt->in_flight = false;
    nt->event_recorded = false;
    return safe;
}

static rp_status nccl_allgather(rp_transport *t, const void *mine, void *all, size_t bytes, double deadline,
                                rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    size_t total = bytes * (size_t)(t->size + 1);
    if (total > BOUNCE_BYTES)
        return rp_fail(err, RP_EINVAL, "transport: an exchange of %zu bytes from %d ranks is too large", bytes, t->size);
    if (total > nt->coll_cap) {
        void *p = NULL;
        cudaError_t rc = cudaMalloc(&p, total);
        if (rc != cudaSuccess) return cuda_error(err, rc, "allocating an exchange buffer");
        cudaFree(nt->coll);
        nt->coll = p;
        nt->coll_cap = total;
    }
    memcpy(nt->bounce, mine, bytes);
    cudaError_t crc = cudaMemcpyAsync(nt->coll, nt->bounce, bytes, cudaMemcpyHostToDevice, nt->stream);
    if (crc != cudaSuccess) return cuda_error(err, crc, "an exchange");
    ncclResult_t rc = ncclAllGather(nt->coll, nt->coll + bytes, bytes, ncclUint8, nt->comm, nt->stream);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        nccl_abort(nt, "an exchange failed");
        return rp_fail(err, RP_ETRANSPORT, "transport: an exchange failed: %s; the NCCL communicator was aborted",
                       ncclGetErrorString(rc));
    }
    nt->event_recorded = false;
    rp_status st = poll_until(nt, deadline, "an exchange between ranks", err);
    if (st != RP_OK) return st;
    crc = cudaMemcpyAsync(nt->bounce, nt->coll + bytes, bytes * (size_t)t->size, cudaMemcpyDeviceToHost, nt->stream);
    if (crc != cudaSuccess) return cuda_error(err, crc, "an exchange");
    st = sync_stream(nt, deadline, "an exchange between ranks", err);
    if (st != RP_OK) return st;
    memcpy(all, nt->bounce, bytes * (size_t)t->size);
    return RP_OK;
}

static void *nccl_alloc(rp_transport *t, size_t bytes)
{
    (void)t;
    void *p = NULL;
    return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}

static void nccl_free(rp_transport *t, void *p)
{
    (void)t;
    if (p) cudaFree(p);
}

static rp_status nccl_copy(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline, rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    cudaError_t rc = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nt->stream);
    if (rc != cudaSuccess) return cuda_error(err, rc, "a device copy");
    return sync_stream(nt, deadline, "a device copy", err);
}

/* The host checksum, where the kernel cannot run: device memory through the pinned
 * buffer, chunk by chunk, into the streaming form of rp_checksum_expert (slow: host copy
 * bandwidth bounds it). */
static rp_status host_checksum(nccl_transport *nt, const void *const *part_ptr, const size_t *part_bytes,
                               const int32_t *part_begin, int32_t num_experts, uint64_t *checksums, double deadline,
                               rp_error *err)
{
    for (int32_t i = 0; i < num_experts; i++) {
        rp_checksum_state cs;
        rp_checksum_init(&cs);
        for (int32_t p = part_begin[i]; p < part_begin[i + 1]; p++)
            for (size_t done = 0; done < part_bytes[p];) {
                size_t n = part_bytes[p] - done < BOUNCE_BYTES ? part_bytes[p] - done : BOUNCE_BYTES;
                cudaError_t rc = cudaMemcpyAsync(nt->bounce, (const unsigned char *)part_ptr[p] + done, n,
                                                 cudaMemcpyDeviceToHost, nt->stream);
                if (rc != cudaSuccess) return cuda_error(err, rc, "reading device memory for a checksum");
                rp_status s = sync_stream(nt, deadline, "reading device memory for a checksum", err);
                if (s != RP_OK) return s;
                rp_checksum_update(&cs, nt->bounce, n);
                done += n;
            }
        checksums[i] = rp_checksum_final(&cs);
    }
    return RP_OK;
}

/* Every expert of the batch in one rp_gpu_checksum call on the transport's stream. The
 * work queued there before is waited for first under the deadline (polling, abort on
 * failure), so the synchronisation inside rp_gpu_checksum waits only for its own
 * kernels, whose time is bounded by the bytes. */
static rp_status nccl_checksum(rp_transport *t, const void *const *part_ptr, const size_t *part_bytes,
                               const int32_t *part_begin, int32_t num_experts, uint64_t *checksums, double deadline,
                               rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    if (num_experts == 0) return RP_OK;
    if (t->device_checksum) {
        rp_status st = sync_stream(nt, deadline, "the work queued before the checksums", err);
        if (st != RP_OK) return st;
        rp_error e;
        rp_error_clear(&e);
        st = rp_gpu_checksum(t->ctx, part_ptr, part_bytes, part_begin, num_experts, checksums, nt->stream, &e);
        if (st == RP_OK) return RP_OK;
        if (st != RP_ENOTSUP)
            return rp_fail(err, st == RP_ENOMEM ? RP_ENOMEM : RP_ETRANSPORT, "transport: the checksum kernel "
                           "failed: %s", e.text);
        t->device_checksum = false; /* no device for the kernel: the host from now on */
    }
    return host_checksum(nt, part_ptr, part_bytes, part_begin, num_experts, checksums, deadline, err);
}

/* a <-> b through the device scratch, chunk by chunk, stream-ordered, then one wait. */
static rp_status nccl_swap(rp_transport *t, void *a, void *b, size_t bytes, double deadline, rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    unsigned char *pa = a, *pb = b;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < SCRATCH_BYTES ? bytes - done : SCRATCH_BYTES;
        cudaError_t rc = cudaMemcpyAsync(nt->scratch, pa + done, n, cudaMemcpyDeviceToDevice, nt->stream);
        if (rc == cudaSuccess) rc = cudaMemcpyAsync(pa + done, pb + done, n, cudaMemcpyDeviceToDevice, nt->stream);
        if (rc == cudaSuccess) rc = cudaMemcpyAsync(pb + done, nt->scratch, n, cudaMemcpyDeviceToDevice, nt->stream);
        if (rc != cudaSuccess) return cuda_error(err, rc, "a device swap");
        done += n;
    }
    return sync_stream(nt, deadline, "a device swap", err);
}

static rp_status nccl_to_host(rp_transport *t, void *host, const void *src, size_t bytes, double deadline,
                              rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < BOUNCE_BYTES ? bytes - done : BOUNCE_BYTES;
        cudaError_t rc = cudaMemcpyAsync(nt->bounce, (const unsigned char *)src + done, n, cudaMemcpyDeviceToHost,
                                         nt->stream);
        if (rc != cudaSuccess) return cuda_error(err, rc, "a copy to the host");
        rp_status s = sync_stream(nt, deadline, "a copy to the host", err);
        if (s != RP_OK) return s;
        memcpy((unsigned char *)host + done, nt->bounce, n);
        done += n;
    }
    return RP_OK;
}

static rp_status nccl_from_host(rp_transport *t, void *dst, const void *host, size_t bytes, double deadline,
                                rp_error *err)
{
    nccl_transport *nt = (nccl_transport *)t;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < BOUNCE_BYTES ? bytes - done : BOUNCE_BYTES;
        memcpy(nt->bounce, (const unsigned char *)host + done, n);
        cudaError_t rc = cudaMemcpyAsync((unsigned char *)dst + done, nt->bounce, n, cudaMemcpyHostToDevice,
                                         nt->stream);
        if (rc != cudaSuccess) return cuda_error(err, rc, "a copy to the device");
        rp_status s = sync_stream(nt, deadline, "a copy to the device", err);
        if (s != RP_OK) return s;
        done += n;
    }
    return RP_OK;
}

static void nccl_destroy(rp_transport *t)
{
    nccl_transport *nt = (nccl_transport *)t;
    bool safe = nccl_finish(t);
    if (safe) {
        cudaFree(nt->coll);
        cudaFree(nt->scratch);
    }
    rp_free(t->ctx, nt->corrupt);
    cudaEventDestroy(nt->done);
    cudaFreeHost(nt->bounce);
    rp_free(t->ctx, nt);
}

static const rp_transport_vtable nccl_vtable = {
    "nccl", nccl_start, nccl_wait, nccl_finish, nccl_allgather, nccl_alloc, nccl_free,
    nccl_copy, nccl_checksum, nccl_swap, nccl_to_host, nccl_from_host, nccl_destroy,
    NULL, /* one stream for the batch: the commit follows the whole batch, on the device */
};

rp_status rp_transport_nccl_new(rp_context *ctx, ncclComm_t comm, cudaStream_t stream, rp_transport **out,
                                rp_error *err)
{
    if (!ctx || !out || !comm) return rp_fail(err, RP_EINVAL, "transport: no context, communicator or output");
    *out = NULL;
    int rank = 0, size = 0;
    ncclResult_t rc = ncclCommUserRank(comm, &rank);
    if (rc == ncclSuccess) rc = ncclCommCount(comm, &size);
    if (rc != ncclSuccess)
        return rp_fail(err, RP_ETRANSPORT, "transport: reading the NCCL communicator failed: %s",
                       ncclGetErrorString(rc));
    nccl_transport *nt = rp_calloc(ctx, 1, sizeof *nt);
    if (!nt) return rp_fail_nomem(err, "an NCCL transport");
    cudaError_t crc = cudaEventCreateWithFlags(&nt->done, cudaEventDisableTiming);
    if (crc != cudaSuccess) {
        rp_free(ctx, nt);
        return cuda_error(err, crc, "creating a CUDA event");
    }
    crc = cudaMallocHost((void **)&nt->bounce, BOUNCE_BYTES);
    if (crc != cudaSuccess) {
        cudaEventDestroy(nt->done);
        rp_free(ctx, nt);
        return cuda_error(err, crc, "allocating pinned host memory");
    }
    nt->comm = comm;
    nt->stream = stream;
    rp_status st = rp_transport_init(&nt->base, &nccl_vtable, ctx, rank, size, RP_MEMORY_CUDA, SIZE_MAX, err);
    if (st == RP_OK) {
        size_t total = (size_t)(size + 1) * RP_EXCHANGE_RECORD_BYTES;
        if (total > BOUNCE_BYTES)
            st = rp_fail(err, RP_ERANGE, "transport: %d ranks are too many for one exchange", size);
        else if ((crc = cudaMalloc((void **)&nt->coll, total)) != cudaSuccess)
            st = cuda_error(err, crc, "allocating an exchange buffer");
        else
            nt->coll_cap = total;
    }
    if (st == RP_OK && (crc = cudaMalloc((void **)&nt->scratch, SCRATCH_BYTES)) != cudaSuccess)
        st = cuda_error(err, crc, "allocating swap scratch");
    if (st != RP_OK) {
        cudaFree(nt->coll);
        cudaFreeHost(nt->bounce);
        cudaEventDestroy(nt->done);
        rp_free(ctx, nt->base.records);
        rp_free(ctx, nt);
        return st;
    }
#ifdef RP_HAVE_CUDA
    /* rp_gpu_checksum takes its scratch with cudaMallocAsync: a device without
     * stream-ordered memory pools checksums through the host instead. */
    int device = 0, pools = 0;
    nt->base.device_checksum = cudaGetDevice(&device) == cudaSuccess &&
                               cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess &&
                               pools != 0;
#endif
    *out = &nt->base;
    return RP_OK;
}

#else

typedef int rp_transport_nccl_not_built; /* ISO C wants something in a translation unit */

#endif
