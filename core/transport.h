/* The transport interface the migration executor drives (private): batches of
 * non-blocking sends and receives waited on with a deadline, allgather, barrier, and
 * the memory operations of the transport's memory kind. Built in: in-process threads
 * (transport_local.c), MPI (transport_mpi.c), NCCL (transport_nccl.c). */
#ifndef RP_TRANSPORT_H
#define RP_TRANSPORT_H

#include "internal.h"
#include "routepack/migrate.h"
#include "transport_fault.h"

/* One point-to-point operation of a batch. Messages between one pair of ranks with the
 * same tag are matched in the order they were started (as MPI and NCCL do). */
typedef struct rp_transport_op {
    int32_t peer;      /* transport rank */
    int32_t tag;       /* 0 .. 2^15-1 */
    bool send;
    bool payload;      /* carries expert bytes (fault injection targets only these) */
    void *buf;         /* transport memory; a send only reads it */
    size_t bytes;      /* 1 .. max_message_bytes */
} rp_transport_op;

typedef struct rp_transport_vtable {
    const char *name;
    /* Start a batch (at most one batch is in flight). On an error, ops already started
     * stay in flight until cancel; *failed is the op that could not start. */
    rp_status (*start)(rp_transport *t, const rp_transport_op *ops, int32_t n, int32_t *failed,
                       rp_error *err);
    /* Wait for every op of the batch until `deadline` (rp_now_s clock). On failure
     * *failed is the op that failed or was still pending (-1 when the transport cannot
     * tell); the batch stays in flight until cancel. */
    rp_status (*wait)(rp_transport *t, double deadline, int32_t *failed, rp_error *err);
    /* Abandon the batch in flight (after a failure) or forget a completed one. Returns
     * false when a receive could not be cancelled within a bounded time, so its buffer
     * may still be written: the caller must then never free or reuse it (the
     * transport is marked unusable). */
    bool (*finish)(rp_transport *t);
    /* Every rank contributes `bytes` bytes of host memory; `all` receives size * bytes,
     * rank-major. A deadline passed leaves the transport unusable. */
    rp_status (*allgather)(rp_transport *t, const void *mine, void *all, size_t bytes,
                           double deadline, rp_error *err);
    /* Memory of the transport's kind (host or CUDA). alloc returns NULL on failure. */
    void *(*alloc)(rp_transport *t, size_t bytes);
    void (*free)(rp_transport *t, void *ptr);
    /* dst <- src, both transport memory, `bytes` bytes; bounded by `deadline`. */
    rp_status (*copy)(rp_transport *t, void *dst, const void *src, size_t bytes,
                      double deadline, rp_error *err);
    /* Feed `bytes` bytes of transport memory to a hash (device memory goes through the
     * host: slow, see docs/migration.md). */
    rp_status (*hash)(rp_transport *t, rp_hash_state *st, const void *src, size_t bytes,
                      double deadline, rp_error *err);
    /* Host <-> transport memory, for headers. */
    rp_status (*to_host)(rp_transport *t, void *host, const void *src, size_t bytes,
                         double deadline, rp_error *err);
    rp_status (*from_host)(rp_transport *t, void *dst, const void *host, size_t bytes,
                           double deadline, rp_error *err);
    void (*destroy)(rp_transport *t);
} rp_transport_vtable;

struct rp_transport {
    const rp_transport_vtable *vt;
    rp_context *ctx;
    int32_t rank, size;
    rp_memory memory;          /* the memory kind it moves */
    size_t max_message_bytes;  /* larger payloads are split by the executor */
    uint64_t calls;            /* executor calls so far: ranks compare it */
    bool broken;               /* unusable after a failure (see rp_transport_usable) */
    char broken_why[160];
    rp_fault fault;            /* injected fault (tests only; see transport_fault.h) */
    int64_t payload_sends;     /* payload sends started since the fault was set */
};

/* Every rank waits until all have arrived (an allgather of one byte), until `deadline`. */
rp_status rp_transport_barrier(rp_transport *t, double deadline, rp_error *err);

/* Monotonic clock in seconds. */
double rp_now_s(void);
/* Initialise the shared fields of a transport. */
void rp_transport_init(rp_transport *t, const rp_transport_vtable *vt, rp_context *ctx,
                       int32_t rank, int32_t size, rp_memory memory, size_t max_message_bytes);
/* Mark a transport unusable, keeping the first reason. */
void rp_transport_break(rp_transport *t, const char *why);
/* The fault to apply to the next payload send (counts it), or RP_FAULT_NONE. A fault
 * fires once and then clears. */
rp_fault_kind rp_transport_next_send_fault(rp_transport *t, double *delay_s);

#endif
