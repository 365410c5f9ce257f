/* The MPI transport: host buffers, MPI_Isend/MPI_Irecv polled with MPI_Test until a
 * deadline (the whole batch, or one op of it: the executor commits each expert as it
 * arrives), MPI_Iallgather for the exchanges, on a private duplicate of the trainer's
 * communicator. Built when CMake finds MPI. */
#include "transport.h"

#ifdef RP_HAVE_MPI

#include "routepack/migrate_mpi.h"

#include <sched.h>
#include <stdio.h>
#include <string.h>

#define MAX_MESSAGE (1u << 30)  /* MPI counts are int */
#define CANCEL_BOUND_S 5.0      /* how long a cancelled receive may take to complete */

typedef struct mpi_op {
    rp_transport_op op;
    MPI_Request req;
    bool posted, done;
    double post_at;   /* a held-back send (fault) is started then */
    void *corrupt;    /* a corrupted copy sent instead of op.buf (fault) */
    size_t send_bytes; /* what is sent: op.bytes, one less for a short message (fault) */
} mpi_op;

/* A late message (fault): sent, without waiting, once its time has come. */
typedef struct late_msg {
    void *buf;
    size_t bytes;
    int32_t peer, tag;
    double post_at;
} late_msg;

typedef struct mpi_transport {
    rp_transport base;
    late_msg late[8];
    int32_t num_late;
    MPI_Comm comm;
    mpi_op *ops;
    int32_t n, cap;
    void **orphans;   /* corrupted copies of sends MPI may still read; freed at the end */
    int32_t num_orphans, cap_orphans;
    unsigned char *coll;  /* exchange buffers, owned here so a timed-out one stays valid */
    size_t coll_cap;
} mpi_transport;

static rp_status mpi_error(rp_error *err, int rc, const char *what, int32_t peer)
{
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error %d", rc);
    if (peer >= 0) return rp_fail(err, RP_ETRANSPORT, "transport: %s with rank %d failed: %s", what, peer, text);
    return rp_fail(err, RP_ETRANSPORT, "transport: %s failed: %s", what, text);
}

static rp_status post_send(mpi_transport *mt, mpi_op *mo, rp_error *err)
{
    const void *buf = mo->corrupt ? mo->corrupt : mo->op.buf;
    int rc = MPI_Isend(buf, (int)mo->send_bytes, MPI_BYTE, mo->op.peer, mo->op.tag, mt->comm, &mo->req);
    if (rc != MPI_SUCCESS) return mpi_error(err, rc, "a send", mo->op.peer);
    mo->posted = true;
    return RP_OK;
}

static void keep_orphan(mpi_transport *mt, void *p);

/* Send the late messages (fault) whose time has come; their bytes stay until the end. */
static void post_late(mpi_transport *mt)
{
    double now = rp_now_s();
    for (int32_t i = 0; i < mt->num_late;) {
        late_msg *m = &mt->late[i];
        if (now < m->post_at) {
            i++;
            continue;
        }
        MPI_Request req;
        if (MPI_Isend(m->buf, (int)m->bytes, MPI_BYTE, m->peer, m->tag, mt->comm, &req) == MPI_SUCCESS)
            MPI_Request_free(&req);
        keep_orphan(mt, m->buf);
        mt->late[i] = mt->late[--mt->num_late];
    }
}

static rp_status mpi_start(rp_transport *t, const rp_transport_op *ops, int32_t n, int32_t *failed, rp_error *err)
{
    mpi_transport *mt = (mpi_transport *)t;
    *failed = -1;
    post_late(mt);
    if (mt->n) return rp_fail(err, RP_EINVAL, "transport: a batch is already in flight");
    if (n > mt->cap) {
        mpi_op *o = rp_realloc(t->ctx, mt->ops, (size_t)n * sizeof *o);
        if (!o) return rp_fail_nomem(err, "the transport's operations");
        mt->ops = o;
        mt->cap = n;
    }
    for (int32_t i = 0; i < n; i++) {
        const rp_transport_op *op = &ops[i];
        if (op->peer < 0 || op->peer >= t->size || op->bytes > MAX_MESSAGE) {
            *failed = i;
            return rp_fail(err, RP_EINVAL, "transport: a message of %zu bytes for rank %d is out of range", op->bytes,
                           op->peer);
        }
        mpi_op *mo = &mt->ops[mt->n];
        memset(mo, 0, sizeof *mo);
        mo->op = *op;
        mo->req = MPI_REQUEST_NULL;
        if (!op->send) {
            int rc = MPI_Irecv(op->buf, (int)op->bytes, MPI_BYTE, op->peer, op->tag, mt->comm, &mo->req);
            if (rc != MPI_SUCCESS) {
                *failed = i;
                return mpi_error(err, rc, "a receive", op->peer);
            }
            mo->posted = true;
            mt->n++;
            continue;
        }
        double delay = 0.0;
        rp_fault_kind fault = rp_transport_send_fault(t, op, &delay);
        mo->send_bytes = fault == RP_FAULT_SHORT && op->bytes > 0 ? op->bytes - 1 : op->bytes;
        if (fault == RP_FAULT_SEND_FAIL) {
            *failed = i;
            return rp_fail(err, RP_ETRANSPORT, "transport: the send of %zu bytes to rank %d failed (injected fault)",
                           op->bytes, op->peer);
        }
        mt->n++;
        if (fault == RP_FAULT_DROP) {
            mo->done = true;
            continue;
        }
        if (fault == RP_FAULT_DELAY) {
            mo->post_at = rp_now_s() + delay;
            continue;
        }
        if (fault == RP_FAULT_LATE) {
            /* Buffered now and complete for the sender; it leaves after delay_s, past
             * the call's deadlines, and stays queued at the receiver. */
            mo->done = true;
            void *copy = mt->num_late < 8 ? rp_alloc(t->ctx, op->bytes ? op->bytes : 1) : NULL;
            if (!copy) continue; /* then it is simply lost */
            memcpy(copy, op->buf, op->bytes);
            mt->late[mt->num_late++] = (late_msg){copy, op->bytes, op->peer, op->tag, rp_now_s() + delay};
            continue;
        }
        if (fault == RP_FAULT_CORRUPT) {
            mo->corrupt = rp_alloc(t->ctx, op->bytes);
            if (!mo->corrupt) {
                *failed = i;
                return rp_fail_nomem(err, "a corrupted message");
            }
            memcpy(mo->corrupt, op->buf, op->bytes);
            ((unsigned char *)mo->corrupt)[op->bytes / 2] ^= 0xff;
        }
        rp_status st = post_send(mt, mo, err);
        if (st != RP_OK) {
            *failed = i;
            return st;
        }
    }
    return RP_OK;
}

/* Test every op of the batch (and post the held-back sends whose time has come) until op
 * `target` is done (-1: every op), or `deadline`. */
static rp_status mpi_wait_until(rp_transport *t, int32_t target, double deadline, int32_t *failed, rp_error *err)
{
    mpi_transport *mt = (mpi_transport *)t;
    *failed = -1;
    if (target >= mt->n) return rp_fail(err, RP_EINVAL, "transport: op %d of a batch of %d", target, mt->n);
    for (;;) {
        int32_t pending = -1;
        bool progressed = false;
        double now = rp_now_s();
        for (int32_t i = 0; i < mt->n; i++) {
            mpi_op *mo = &mt->ops[i];
            if (mo->done) continue;
            if (!mo->posted) {
                if (now >= mo->post_at) {
                    rp_status st = post_send(mt, mo, err);
                    if (st != RP_OK) {
                        *failed = i;
                        return st;
                    }
                }
            }
            if (mo->posted) {
                int flag = 0;
                MPI_Status status;
                int rc = MPI_Test(&mo->req, &flag, &status);
                if (rc != MPI_SUCCESS) {
                    *failed = i;
                    return mpi_error(err, rc, mo->op.send ? "a send" : "a receive", mo->op.peer);
                }
                if (flag) {
                    mo->done = true;
                    progressed = true;
                    if (!mo->op.send) {
                        int count = -1;
                        MPI_Get_count(&status, MPI_BYTE, &count);
                        if (count != (int)mo->op.bytes) {
                            *failed = i;
                            return rp_fail(err, RP_ETRANSPORT, "transport: a message of %d bytes arrived from rank %d "
                                           "where %zu were expected", count, mo->op.peer, mo->op.bytes);
                        }
                    }
                }
            }
            if (!mo->done && pending < 0) pending = i;
        }
        if (target >= 0 ? mt->ops[target].done : pending < 0) return RP_OK;
        if (target >= 0) pending = target;
        if (rp_now_s() >= deadline) {
            *failed = pending;
            return rp_fail(err, RP_ETIMEOUT, mt->ops[pending].op.send
                               ? "transport: rank %d did not take the message before the deadline"
                               : "transport: nothing arrived from rank %d before the deadline",
                           mt->ops[pending].op.peer);
        }
        post_late(mt);
        if (!progressed) sched_yield(); /* ranks may share cores (mpirun --oversubscribe) */
    }
}

static rp_status mpi_wait(rp_transport *t, double deadline, int32_t *failed, rp_error *err)
{
    return mpi_wait_until(t, -1, deadline, failed, err);
}

static rp_status mpi_wait_op(rp_transport *t, int32_t op, double deadline, int32_t *failed, rp_error *err)
{
    return mpi_wait_until(t, op < 0 ? 0 : op, deadline, failed, err);
}

/* Keep memory MPI may still read until the transport is freed (if even the list cannot
 * grow, leak it: freeing it would be worse). */
static void keep_orphan(mpi_transport *mt, void *p)
{
    if (mt->num_orphans == mt->cap_orphans) {
        int32_t cap = mt->cap_orphans ? mt->cap_orphans * 2 : 8;
        void **o = rp_realloc(mt->base.ctx, mt->orphans, (size_t)cap * sizeof *o);
        if (!o) return;
        mt->orphans = o;
        mt->cap_orphans = cap;
    }
    mt->orphans[mt->num_orphans++] = p;
}

static bool mpi_finish(rp_transport *t)
{
    mpi_transport *mt = (mpi_transport *)t;
    bool safe = true;
    for (int32_t i = 0; i < mt->n; i++) {
        mpi_op *mo = &mt->ops[i];
        if (mo->posted && !mo->done) {
            MPI_Cancel(&mo->req);
            int flag = 0;
            double until = rp_now_s() + (mo->op.send ? 0.0 : CANCEL_BOUND_S);
            do {
                MPI_Test(&mo->req, &flag, MPI_STATUS_IGNORE);
                if (!flag) sched_yield();
            } while (!flag && rp_now_s() < until);
            if (!flag) {
                /* A send MPI cannot cancel only reads; a receive could still write. */
                MPI_Request_free(&mo->req);
                if (!mo->op.send) safe = false;
                if (mo->corrupt) keep_orphan(mt, mo->corrupt);
                mo->corrupt = NULL;
            }
        }
        rp_free(t->ctx, mo->corrupt);
        mo->corrupt = NULL;
    }
    mt->n = 0;
    return safe;
}

static rp_status mpi_allgather(rp_transport *t, const void *mine, void *all, size_t bytes, double deadline,
                               rp_error *err)
{
    mpi_transport *mt = (mpi_transport *)t;
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    size_t need = bytes * (size_t)(t->size + 1);
    if (bytes > MAX_MESSAGE) return rp_fail(err, RP_EINVAL, "transport: an exchange of %zu bytes is too large", bytes);
    if (need > mt->coll_cap) {
        unsigned char *b = rp_realloc(t->ctx, mt->coll, need);
        if (!b) return rp_fail_nomem(err, "an exchange buffer");
        mt->coll = b;
        mt->coll_cap = need;
    }
    memcpy(mt->coll, mine, bytes);
    MPI_Request req;
    int rc = MPI_Iallgather(mt->coll, (int)bytes, MPI_BYTE, mt->coll + bytes, (int)bytes, MPI_BYTE, mt->comm, &req);
    if (rc != MPI_SUCCESS) {
        rp_transport_break(t, "an exchange could not start");
        return mpi_error(err, rc, "an exchange", -1);
    }
    for (;;) {
        int flag = 0;
        rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            rp_transport_break(t, "an exchange failed");
            return mpi_error(err, rc, "an exchange", -1);
        }
        if (flag) break;
        if (rp_now_s() >= deadline) {
            /* A collective cannot be cancelled: the communicator is out of step. */
            rp_transport_break(t, "an exchange between ranks timed out");
            return rp_fail(err, RP_ETIMEOUT, "transport: rank %d timed out in an exchange between ranks", t->rank);
        }
        sched_yield();
    }
    memcpy(all, mt->coll + bytes, bytes * (size_t)t->size);
    return RP_OK;
}

static void *mpi_alloc(rp_transport *t, size_t bytes) { return rp_alloc(t->ctx, bytes ? bytes : 1); }
static void mpi_free(rp_transport *t, void *p) { rp_free(t->ctx, p); }

static rp_status mpi_copy(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline, rp_error *err)
{
    (void)t, (void)deadline, (void)err;
    memmove(dst, src, bytes);
    return RP_OK;
}

static void mpi_destroy(rp_transport *t)
{
    mpi_transport *mt = (mpi_transport *)t;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        mpi_finish(t);
        MPI_Comm_free(&mt->comm);
    }
    for (int32_t i = 0; i < mt->num_late; i++) rp_free(t->ctx, mt->late[i].buf); /* never sent */
    for (int32_t i = 0; i < mt->num_orphans; i++) rp_free(t->ctx, mt->orphans[i]);
    rp_free(t->ctx, mt->orphans);
    rp_free(t->ctx, mt->ops);
    rp_free(t->ctx, mt->coll);
    rp_free(t->ctx, mt);
}

static const rp_transport_vtable mpi_vtable = {
    "mpi", mpi_start, mpi_wait, mpi_finish, mpi_allgather, mpi_alloc, mpi_free,
    mpi_copy, rp_transport_checksum_host, rp_transport_swap_host, mpi_copy, mpi_copy, mpi_destroy,
    mpi_wait_op,
};

rp_status rp_transport_mpi_new(rp_context *ctx, MPI_Comm comm, rp_transport **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "transport: no context or output");
    *out = NULL;
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return rp_fail(err, RP_EINVAL, "transport: MPI is not initialised (call MPI_Init first)");
    mpi_transport *mt = rp_calloc(ctx, 1, sizeof *mt);
    if (!mt) return rp_fail_nomem(err, "an MPI transport");
    int rc = MPI_Comm_dup(comm, &mt->comm);
    if (rc != MPI_SUCCESS) {
        rp_free(ctx, mt);
        return mpi_error(err, rc, "duplicating the communicator", -1);
    }
    MPI_Comm_set_errhandler(mt->comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 0;
    MPI_Comm_rank(mt->comm, &rank);
    MPI_Comm_size(mt->comm, &size);
    rp_status st = rp_transport_init(&mt->base, &mpi_vtable, ctx, rank, size, RP_MEMORY_HOST, MAX_MESSAGE, err);
    /* The executor's exchanges never allocate: their buffer is taken now. */
    if (st == RP_OK) {
        mt->coll_cap = (size_t)(size + 1) * RP_EXCHANGE_RECORD_BYTES;
        mt->coll = rp_alloc(ctx, mt->coll_cap);
        if (!mt->coll) st = rp_fail_nomem(err, "an MPI transport's exchange buffer");
    }
    if (st != RP_OK) {
        MPI_Comm_free(&mt->comm);
        rp_free(ctx, mt->base.records);
        rp_free(ctx, mt);
        return st;
    }
    mt->base.wait_each = true; /* host memory, single ops waited on: each expert is committed as it arrives */
    *out = &mt->base;
    return RP_OK;
}

#else

typedef int rp_transport_mpi_not_built; /* ISO C wants something in a translation unit */

#endif
