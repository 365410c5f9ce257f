/* The transport interface the migration executor drives (private): batches of
 * non-blocking sends and receives waited on with a deadline, allgather, barrier, and
 * the memory operations and expert checksums of the transport's memory kind. Built in: in-process threads
 * (transport_local.c), MPI (transport_mpi.c), NCCL (transport_nccl.c). */
#ifndef RP_TRANSPORT_H
#define RP_TRANSPORT_H

#include "internal.h"
#include "routepack/migrate.h"
#include "checksum_internal.h"
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
    /* Checksums of `num_experts` experts in transport memory: expert i is the
     * concatenation of parts part_begin[i] .. part_begin[i+1]-1 (part_ptr[p], part_bytes[p];
     * the arrays are host memory), and checksums[i] (host) = rp_checksum_expert of those
     * bytes (routepack/checksum.h), whatever computes it, so the checksums of any two
     * transports compare. Host memory: rp_transport_checksum_host. NCCL: the GPU kernel
     * rp_gpu_checksum on the transport's stream (docs/migration.md). Bounded by `deadline`. */
    rp_status (*checksum)(rp_transport *t, const void *const *part_ptr, const size_t *part_bytes,
                          const int32_t *part_begin, int32_t num_experts, uint64_t *checksums,
                          double deadline, rp_error *err);
    /* a <-> b, both transport memory, `bytes` bytes, not overlapping; bounded by
     * `deadline`. The commit swaps each staged expert with its slot, so that staging
     * then holds the slot's old bytes and the commit can be undone. */
    rp_status (*swap)(rp_transport *t, void *a, void *b, size_t bytes, double deadline, rp_error *err);
    /* Host <-> transport memory, for headers. */
    rp_status (*to_host)(rp_transport *t, void *host, const void *src, size_t bytes,
                         double deadline, rp_error *err);
    rp_status (*from_host)(rp_transport *t, void *dst, const void *host, size_t bytes,
                           double deadline, rp_error *err);
    void (*destroy)(rp_transport *t);
    /* Optional (NULL: none; the executor uses it only where t->wait_each): wait until op
     * `op` of the batch in flight completed, until `deadline`, making progress on the
     * others as wait does (a receive that only moves inside a wait moves here too), so
     * that the executor can commit each expert as it arrives while later ones are still
     * on the way. Failures as wait's; the batch stays in flight until finish. */
    rp_status (*wait_op)(rp_transport *t, int32_t op, double deadline, int32_t *failed, rp_error *err);
} rp_transport_vtable;

struct rp_transport {
    const rp_transport_vtable *vt;
    rp_context *ctx;
    int32_t rank, size;
    rp_memory memory;          /* the memory kind it moves */
    size_t max_message_bytes;  /* larger payloads are split by the executor */
    uint64_t calls;            /* executor calls so far: ranks compare it */
    void *records;             /* host room for one exchange of the executor's records
                                * (size * RP_EXCHANGE_RECORD_BYTES), taken when the
                                * transport is created so that no exchange allocates */
    bool broken;               /* unusable after a failure (see rp_transport_usable) */
    char broken_why[160];
    rp_fault faults[RP_MAX_FAULTS]; /* injected faults (tests only; see transport_fault.h) */
    int32_t num_faults;
    int64_t fault_events[RP_FAULT_NUM_SITES]; /* events per site since the faults were set */
    bool device_checksum;      /* NCCL, and callbacks with CUDA memory: checksums run on the GPU;
                                * false: through the host (where the kernel cannot run; tests
                                * clear it to test that) */
    bool host_direct;          /* its memory is host memory that copy, swap and checksum reach
                                * with memcpy and rp_checksum_expert (host memory without memory
                                * callbacks): the commit then swaps and checks in one pass
                                * (rp_transport_swap_sum_host) */
    bool wait_each;            /* host_direct and vt->wait_op waits for single ops: the
                                * executor commits each received expert as it arrives
                                * (migrate_round.c); else after the whole batch */
};

/* Every rank waits until all have arrived (an allgather of one byte), until `deadline`. */
rp_status rp_transport_barrier(rp_transport *t, double deadline, rp_error *err);

/* Monotonic clock in seconds. */
double rp_now_s(void);
/* The bytes of one rank's record in the executor's exchanges (agreement, decision,
 * commit); every transport can exchange records of this size without allocating. */
#define RP_EXCHANGE_RECORD_BYTES 512

/* Initialise the shared fields of a transport and take its exchange room (`records`;
 * freed by rp_transport_free). Errors: RP_ENOMEM (nothing to undo but the struct). */
rp_status rp_transport_init(rp_transport *t, const rp_transport_vtable *vt, rp_context *ctx,
                            int32_t rank, int32_t size, rp_memory memory, size_t max_message_bytes,
                            rp_error *err);
/* The checksum callback of the host transports: rp_checksum_expert of each expert. */
rp_status rp_transport_checksum_host(rp_transport *t, const void *const *part_ptr, const size_t *part_bytes,
                                     const int32_t *part_begin, int32_t num_experts, uint64_t *checksums,
                                     double deadline, rp_error *err);
/* Mark a transport unusable, keeping the first reason. */
void rp_transport_break(rp_transport *t, const char *why);
/* The fault that the next event of `site` meets (counts the event), or RP_FAULT_NONE. A
 * fault fires once. */
rp_fault_kind rp_transport_fault_at(rp_transport *t, rp_fault_site site, double *delay_s);
/* The same for a send: the payload or header site by the op. */
rp_fault_kind rp_transport_send_fault(rp_transport *t, const rp_transport_op *op, double *delay_s);
/* The host swap for host transports: through a small buffer on the stack. */
rp_status rp_transport_swap_host(rp_transport *t, void *a, void *b, size_t bytes, double deadline, rp_error *err);
/* The same swap (host memory, t->host_direct) that also feeds the bytes `a` holds after
 * it to `sum`, each 32 KiB chunk hashed while it is in cache: the commit's write and its
 * check in one pass over the bytes. */
void rp_transport_swap_sum_host(void *a, void *b, size_t bytes, rp_checksum_state *sum);

#endif
