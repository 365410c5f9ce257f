/* The in-process transport: ranks are threads of one process sharing a hub. A send is
 * queued by reference and completes when the receiver has copied it (rendezvous), so
 * the executor's bytes move once, as they would through a NIC. */
#include "transport.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef enum msg_state { MSG_QUEUED = 0, MSG_CLAIMED = 1, MSG_DONE = 2 } msg_state;

/* A posted send, owned by the sending rank's op until finish. */
typedef struct local_msg {
    struct local_msg *next;
    int32_t src, tag;
    const void *buf;
    size_t bytes;
    double visible_at;  /* a delayed message is invisible until then */
    bool corrupt;
    bool orphan;        /* a late message (fault): it owns its bytes and the hub owns it;
                           whoever receives it, or the hub at the end, frees it */
    msg_state state;
} local_msg;

struct rp_local_hub {
    rp_context *ctx;
    int32_t size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t version;      /* bumped on every change, so waiters never miss a wakeup */
    local_msg **head;      /* [size * size] FIFO of sends, index dst * size + src */
    bool *attached;        /* [size] a transport exists for the rank */
    /* allgather: ranks deposit, wait for all, copy out; the last one out resets */
    unsigned char *coll_buf;
    size_t coll_cap, coll_bytes;
    int32_t arrived, departed;
    uint64_t epoch;
    bool broken;
    rp_status broken_status; /* what breaking it returned (a timeout stays a timeout) */
    char why[128];
};

typedef struct local_op {
    rp_transport_op op;
    local_msg *msg;  /* sends: NULL when dropped */
    bool done;
} local_op;

typedef struct local_transport {
    rp_transport base;
    rp_local_hub *hub;
    local_op *ops;
    int32_t n, cap;
} local_transport;

static void deadline_ts(double deadline, struct timespec *ts)
{
    /* rp_now_s is CLOCK_MONOTONIC and the condition variable waits on that clock. */
    double whole = (double)(time_t)deadline;
    ts->tv_sec = (time_t)deadline;
    ts->tv_nsec = (long)((deadline - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
    if (ts->tv_nsec < 0) ts->tv_nsec = 0;
}

/* Wait on the hub (lock held) until something changes after `seen` or `until`. */
static void hub_wait(rp_local_hub *h, uint64_t seen, double until)
{
    struct timespec ts;
    deadline_ts(until, &ts);
    while (h->version == seen) {
        int rc = pthread_cond_timedwait(&h->cv, &h->mu, &ts);
        if (rc == ETIMEDOUT) break;
    }
}

static void hub_changed(rp_local_hub *h)
{
    h->version++;
    pthread_cond_broadcast(&h->cv);
}

rp_status rp_local_hub_new(rp_context *ctx, int32_t size, rp_local_hub **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "transport: no context or output");
    *out = NULL;
    if (size < 1 || size > 65536)
        return rp_fail(err, RP_EINVAL, "transport: a local hub of %d ranks; 1 to 65536 are allowed", size);
    rp_local_hub *h = rp_calloc(ctx, 1, sizeof *h);
    if (!h) return rp_fail_nomem(err, "a local hub");
    h->ctx = ctx;
    h->size = size;
    h->head = rp_calloc(ctx, (size_t)size * (size_t)size, sizeof *h->head);
    h->attached = rp_calloc(ctx, (size_t)size, sizeof *h->attached);
    /* Room for the executor's exchanges up front, so they never allocate. */
    h->coll_cap = (size_t)size * RP_EXCHANGE_RECORD_BYTES;
    h->coll_buf = rp_alloc(ctx, h->coll_cap);
    if (!h->head || !h->attached || !h->coll_buf) {
        rp_free(ctx, h->head);
        rp_free(ctx, h->attached);
        rp_free(ctx, h->coll_buf);
        rp_free(ctx, h);
        return rp_fail_nomem(err, "a local hub");
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, &ca);
    pthread_condattr_destroy(&ca);
    *out = h;
    return RP_OK;
}

void rp_local_hub_free(rp_local_hub *h)
{
    if (!h) return;
    rp_context *ctx = h->ctx;
    /* Late messages nobody received (fault injection) are the hub's. */
    for (size_t q = 0; h->head && q < (size_t)h->size * (size_t)h->size; q++)
        for (local_msg *m = h->head[q], *next; m; m = next) {
            next = m->next;
            if (m->orphan) {
                rp_free(ctx, (void *)m->buf);
                rp_free(ctx, m);
            }
        }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    rp_free(ctx, h->head);
    rp_free(ctx, h->attached);
    rp_free(ctx, h->coll_buf);
    rp_free(ctx, h);
}

/* ---- point to point ---- */

static rp_status local_start(rp_transport *t, const rp_transport_op *ops, int32_t n, int32_t *failed,
                             rp_error *err)
{
    local_transport *lt = (local_transport *)t;
    rp_local_hub *h = lt->hub;
    *failed = -1;
    if (lt->n) return rp_fail(err, RP_EINVAL, "transport: a batch is already in flight");
    if (n > lt->cap) {
        local_op *o = rp_realloc(t->ctx, lt->ops, (size_t)n * sizeof *o);
        if (!o) return rp_fail_nomem(err, "the transport's operations");
        lt->ops = o;
        lt->cap = n;
    }
    for (int32_t i = 0; i < n; i++) {
        const rp_transport_op *op = &ops[i];
        if (op->peer < 0 || op->peer >= t->size) {
            *failed = i;
            return rp_fail(err, RP_EINVAL, "transport: peer %d is out of range (%d ranks)", op->peer, t->size);
        }
        local_op *lo = &lt->ops[lt->n];
        lo->op = *op;
        lo->msg = NULL;
        lo->done = false;
        if (op->send) {
            double delay = 0.0;
            rp_fault_kind fault = rp_transport_send_fault(t, op, &delay);
            if (fault == RP_FAULT_SEND_FAIL) {
                *failed = i;
                return rp_fail(err, RP_ETRANSPORT, "transport: the send of %zu bytes to rank %d failed (injected fault)",
                               op->bytes, op->peer);
            }
            if (fault == RP_FAULT_DROP) {
                lo->done = true; /* lost on the way: the sender cannot tell */
                lt->n++;
                continue;
            }
            local_msg *m = rp_calloc(t->ctx, 1, sizeof *m);
            void *late_copy = fault == RP_FAULT_LATE ? rp_alloc(t->ctx, op->bytes) : NULL;
            if (!m || (fault == RP_FAULT_LATE && !late_copy)) {
                rp_free(t->ctx, m);
                *failed = i;
                return rp_fail_nomem(err, "a message");
            }
            m->src = t->rank;
            m->tag = op->tag;
            m->buf = op->buf;
            m->bytes = fault == RP_FAULT_SHORT && op->bytes > 0 ? op->bytes - 1 : op->bytes;
            m->corrupt = fault == RP_FAULT_CORRUPT;
            m->visible_at = fault == RP_FAULT_DELAY ? rp_now_s() + delay : 0.0;
            m->state = MSG_QUEUED;
            lo->msg = m;
            if (fault == RP_FAULT_LATE) {
                /* Buffered and sent, as far as the sender knows; it arrives after
                 * delay_s (past the call's deadlines), carrying its own copy of the
                 * bytes, and stays queued for whichever receive matches it. */
                memcpy(late_copy, op->buf, op->bytes);
                m->buf = late_copy;
                m->orphan = true;
                m->visible_at = rp_now_s() + delay;
                lo->msg = NULL;
                lo->done = true;
            }
            pthread_mutex_lock(&h->mu);
            local_msg **q = &h->head[(size_t)op->peer * h->size + t->rank];
            while (*q) q = &(*q)->next;
            *q = m;
            hub_changed(h);
            pthread_mutex_unlock(&h->mu);
        }
        lt->n++;
    }
    return RP_OK;
}

/* Try to take the message a receive waits for; returns 1 when done, 0 when it is not
 * there yet, -1 on a size mismatch (error filled). */
static int try_receive(local_transport *lt, local_op *lo, rp_error *err)
{
    rp_local_hub *h = lt->hub;
    const int32_t me = lt->base.rank;
    pthread_mutex_lock(&h->mu);
    local_msg **q = &h->head[(size_t)me * h->size + lo->op.peer], *m = NULL;
    for (; *q; q = &(*q)->next)
        if ((*q)->tag == lo->op.tag) {
            /* FIFO per tag: a held-back message holds back its successors. */
            if ((*q)->visible_at > 0.0 && rp_now_s() < (*q)->visible_at) break;
            m = *q;
            *q = m->next;
            m->state = MSG_CLAIMED;
            break;
        }
    pthread_mutex_unlock(&h->mu);
    if (!m) return 0;
    int rc = 1;
    if (m->bytes != lo->op.bytes) {
        rp_fail(err, RP_ETRANSPORT, "transport: a message of %zu bytes arrived from rank %d where %zu were expected",
                m->bytes, lo->op.peer, lo->op.bytes);
        rc = -1;
    } else {
        memcpy(lo->op.buf, m->buf, m->bytes);
        if (m->corrupt) ((unsigned char *)lo->op.buf)[m->bytes / 2] ^= 0xff;
        lo->done = true;
    }
    if (m->orphan) { /* nobody waits for it: it is ours to free */
        rp_free(lt->base.ctx, (void *)m->buf);
        rp_free(lt->base.ctx, m);
        return rc;
    }
    pthread_mutex_lock(&h->mu);
    m->state = MSG_DONE; /* the sender may free it from now on */
    hub_changed(h);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* Make progress on every op of the batch (receives copy what has arrived) until op
 * `target` is done (-1: every op), or `deadline`. */
static rp_status local_wait_until(rp_transport *t, int32_t target, double deadline, int32_t *failed, rp_error *err)
{
    local_transport *lt = (local_transport *)t;
    rp_local_hub *h = lt->hub;
    *failed = -1;
    if (target >= lt->n) return rp_fail(err, RP_EINVAL, "transport: op %d of a batch of %d", target, lt->n);
    for (;;) {
        pthread_mutex_lock(&h->mu);
        uint64_t seen = h->version;
        pthread_mutex_unlock(&h->mu);
        int32_t pending = -1;
        for (int32_t i = 0; i < lt->n; i++) {
            local_op *lo = &lt->ops[i];
            if (lo->done) continue;
            if (!lo->op.send) {
                int rc = try_receive(lt, lo, err);
                if (rc < 0) {
                    *failed = i;
                    return RP_ETRANSPORT;
                }
            } else {
                pthread_mutex_lock(&h->mu);
                lo->done = lo->msg->state == MSG_DONE;
                pthread_mutex_unlock(&h->mu);
            }
            if (!lo->done && pending < 0) pending = i;
        }
        if (target >= 0 ? lt->ops[target].done : pending < 0) return RP_OK;
        if (target >= 0) pending = target;
        double now = rp_now_s();
        if (now >= deadline) {
            const local_op *lo = &lt->ops[pending];
            *failed = pending;
            return rp_fail(err, RP_ETIMEOUT, lo->op.send
                               ? "transport: rank %d did not take the message before the deadline"
                               : "transport: nothing arrived from rank %d before the deadline",
                           lo->op.peer);
        }
        pthread_mutex_lock(&h->mu);
        /* Wake at least every 50 ms: a held-back message becomes visible without any
         * change to the hub. */
        hub_wait(h, seen, deadline < now + 0.05 ? deadline : now + 0.05);
        pthread_mutex_unlock(&h->mu);
    }
}

static rp_status local_wait(rp_transport *t, double deadline, int32_t *failed, rp_error *err)
{
    return local_wait_until(t, -1, deadline, failed, err);
}

static rp_status local_wait_op(rp_transport *t, int32_t op, double deadline, int32_t *failed, rp_error *err)
{
    return local_wait_until(t, op < 0 ? 0 : op, deadline, failed, err);
}

static bool local_finish(rp_transport *t)
{
    local_transport *lt = (local_transport *)t;
    rp_local_hub *h = lt->hub;
    pthread_mutex_lock(&h->mu);
    for (int32_t i = 0; i < lt->n; i++) {
        local_msg *m = lt->ops[i].msg;
        if (!m) continue;
        if (m->state == MSG_QUEUED) {
            local_msg **q = &h->head[(size_t)lt->ops[i].op.peer * h->size + t->rank];
            while (*q != m) q = &(*q)->next;
            *q = m->next;
        }
        /* A receiver copying it right now finishes in memcpy time. */
        while (m->state == MSG_CLAIMED) pthread_cond_wait(&h->cv, &h->mu);
        rp_free(t->ctx, m);
    }
    pthread_mutex_unlock(&h->mu);
    lt->n = 0;
    return true;
}

/* ---- collectives ---- */

static rp_status local_allgather(rp_transport *t, const void *mine, void *all, size_t bytes, double deadline,
                                 rp_error *err)
{
    local_transport *lt = (local_transport *)t;
    rp_local_hub *h = lt->hub;
    rp_status st = RP_OK;
    pthread_mutex_lock(&h->mu);
    while (!h->broken && h->arrived == h->size) { /* the previous exchange is still being read */
        if (rp_now_s() >= deadline) break;
        hub_wait(h, h->version, deadline);
    }
    if (h->broken) {
        st = rp_fail(err, h->broken_status, "transport: the hub is unusable (%s)", h->why);
        goto out;
    }
    if (h->arrived == h->size) {
        snprintf(h->why, sizeof h->why, "rank %d timed out waiting for an earlier exchange to finish", t->rank);
        h->broken = true;
        h->broken_status = RP_ETIMEOUT;
        hub_changed(h);
        st = rp_fail(err, RP_ETIMEOUT, "transport: %s", h->why);
        goto out;
    }
    if (h->arrived == 0) {
        size_t need = bytes * (size_t)h->size;
        if (need > h->coll_cap) {
            unsigned char *b = rp_realloc(t->ctx, h->coll_buf, need);
            if (!b) {
                st = rp_fail_nomem(err, "an exchange buffer");
                goto out;
            }
            h->coll_buf = b;
            h->coll_cap = need;
        }
        h->coll_bytes = bytes;
    } else if (bytes != h->coll_bytes) {
        snprintf(h->why, sizeof h->why, "rank %d exchanged %zu bytes where the others exchanged %zu", t->rank, bytes,
                 h->coll_bytes);
        h->broken = true;
        h->broken_status = RP_ETRANSPORT;
        hub_changed(h);
        st = rp_fail(err, RP_ETRANSPORT, "transport: %s", h->why);
        goto out;
    }
    memcpy(h->coll_buf + (size_t)t->rank * bytes, mine, bytes);
    h->arrived++;
    uint64_t epoch = h->epoch;
    hub_changed(h);
    while (!h->broken && h->epoch == epoch && h->arrived < h->size) {
        if (rp_now_s() >= deadline) {
            snprintf(h->why, sizeof h->why, "rank %d timed out in an exchange (%d of %d ranks arrived)", t->rank,
                     h->arrived, h->size);
            h->broken = true;
            h->broken_status = RP_ETIMEOUT;
            hub_changed(h);
            st = rp_fail(err, RP_ETIMEOUT, "transport: %s", h->why);
            goto out;
        }
        hub_wait(h, h->version, deadline);
    }
    if (h->broken) {
        st = rp_fail(err, h->broken_status, "transport: the hub is unusable (%s)", h->why);
        goto out;
    }
    memcpy(all, h->coll_buf, bytes * (size_t)h->size);
    if (++h->departed == h->size) {
        h->arrived = h->departed = 0;
        h->epoch++;
        hub_changed(h);
    }
out:
    if (st != RP_OK) rp_transport_break(t, err ? err->text : "an exchange failed");
    pthread_mutex_unlock(&h->mu);
    return st;
}

/* ---- memory: plain host memory through the context's allocator ---- */

static void *local_alloc(rp_transport *t, size_t bytes) { return rp_alloc(t->ctx, bytes ? bytes : 1); }
static void local_free(rp_transport *t, void *p) { rp_free(t->ctx, p); }

static rp_status local_copy(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline,
                            rp_error *err)
{
    (void)t, (void)deadline, (void)err;
    memmove(dst, src, bytes);
    return RP_OK;
}

static void local_destroy(rp_transport *t)
{
    local_transport *lt = (local_transport *)t;
    local_finish(t);
    pthread_mutex_lock(&lt->hub->mu);
    lt->hub->attached[t->rank] = false;
    pthread_mutex_unlock(&lt->hub->mu);
    rp_free(t->ctx, lt->ops);
    rp_free(t->ctx, lt);
}

static const rp_transport_vtable local_vtable = {
    "local", local_start, local_wait, local_finish, local_allgather, local_alloc, local_free,
    local_copy, rp_transport_checksum_host, rp_transport_swap_host, local_copy, local_copy, local_destroy,
    local_wait_op,
};

rp_status rp_transport_local_new(rp_local_hub *h, int32_t rank, rp_transport **out, rp_error *err)
{
    if (!h || !out) return rp_fail(err, RP_EINVAL, "transport: no hub or output");
    *out = NULL;
    if (rank < 0 || rank >= h->size)
        return rp_fail(err, RP_EINVAL, "transport: rank %d is out of range (the hub has %d ranks)", rank, h->size);
    local_transport *lt = rp_calloc(h->ctx, 1, sizeof *lt);
    if (!lt) return rp_fail_nomem(err, "a local transport");
    pthread_mutex_lock(&h->mu);
    bool taken = h->attached[rank];
    h->attached[rank] = true;
    pthread_mutex_unlock(&h->mu);
    if (taken) {
        rp_free(h->ctx, lt);
        return rp_fail(err, RP_EINVAL, "transport: rank %d of the hub already has a transport", rank);
    }
    rp_status st = rp_transport_init(&lt->base, &local_vtable, h->ctx, rank, h->size, RP_MEMORY_HOST, SIZE_MAX, err);
    if (st != RP_OK) {
        pthread_mutex_lock(&h->mu);
        h->attached[rank] = false;
        pthread_mutex_unlock(&h->mu);
        rp_free(h->ctx, lt);
        return st;
    }
    lt->hub = h;
    lt->base.wait_each = true;
    *out = &lt->base;
    return RP_OK;
}
