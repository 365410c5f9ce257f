/* The callback transport: the trainer's communication library moves the executor's
 * messages through function pointers (routepack.torch passes torch.distributed), so the
 * executor's agreement, checksums and all-or-nothing commit hold over any framework. */
#include "transport.h"

#include "routepack/checksum.h"
#include "routepack/gpu.h"

#include <stdio.h>
#include <string.h>

typedef struct callback_transport {
    rp_transport base;
    rp_transport_callbacks cb;
    void *ud;
    rp_transport_message *msgs;  /* the batch as the callbacks see it */
    int32_t cap;
    bool in_flight;
    unsigned char *swap_host;    /* memory callbacks: the host bounce buffer of swap */
    void *swap_device;           /* CUDA memory: a device bounce buffer of swap (taken at the
                                    first swap; NULL: none could be, the host one serves) */
    bool swap_device_tried;
} callback_transport;

#define SWAP_CHUNK (1u << 20)

/* The remaining time to a deadline, never negative. */
static double remaining_s(double deadline)
{
    double left = deadline - rp_now_s();
    return left > 0.0 ? left : 0.0;
}

/* A status a callback returned, made one the executor understands: a code outside
 * rp_status is a transport failure. */
static rp_status known_status(int32_t st)
{
    return st >= RP_OK && st <= RP_EPLAN ? (rp_status)st : RP_ETRANSPORT;
}

/* Fill `err` from a failed callback: its own words, or a generic line when it gave none. */
static rp_status callback_fail(rp_error *err, int32_t st, const char *why, const char *what)
{
    rp_status s = known_status(st);
    if (s == RP_OK) s = RP_ETRANSPORT;
    if (why[0]) return rp_fail(err, s, "transport: %s", why);
    return rp_fail(err, s, "transport: the %s callback failed (%s)", what, rp_strerror(s));
}

static rp_status cb_start(rp_transport *t, const rp_transport_op *ops, int32_t n, int32_t *failed, rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    *failed = -1;
    if (ct->in_flight) return rp_fail(err, RP_EINVAL, "transport: a batch is already in flight");
    if (n > ct->cap) {
        rp_transport_message *m = rp_realloc(t->ctx, ct->msgs, (size_t)n * sizeof *m);
        if (!m) return rp_fail_nomem(err, "the transport's messages");
        ct->msgs = m;
        ct->cap = n;
    }
    for (int32_t i = 0; i < n; i++) {
        if (ops[i].peer < 0 || ops[i].peer >= t->size) {
            *failed = i;
            return rp_fail(err, RP_EINVAL, "transport: peer %d is out of range (%d ranks)", ops[i].peer, t->size);
        }
        ct->msgs[i] = (rp_transport_message){ops[i].peer, ops[i].tag, ops[i].send ? 1 : 0, ops[i].payload ? 1 : 0,
                                             ops[i].buf, ops[i].bytes};
    }
    /* From here the callbacks own the batch: finish is called even when start fails, so
     * what it did start is abandoned there. */
    ct->in_flight = true;
    char why[RP_ERROR_TEXT];
    why[0] = '\0';
    int32_t bad = -1;
    int32_t st = ct->cb.start(ct->ud, ct->msgs, n, &bad, why, sizeof why);
    why[sizeof why - 1] = '\0';
    if (st != RP_OK) {
        *failed = bad >= 0 && bad < n ? bad : -1;
        return callback_fail(err, st, why, "start");
    }
    return RP_OK;
}

static rp_status cb_wait(rp_transport *t, double deadline, int32_t *failed, rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    *failed = -1;
    if (!ct->in_flight) return RP_OK;
    char why[RP_ERROR_TEXT];
    why[0] = '\0';
    int32_t bad = -1;
    int32_t st = ct->cb.wait(ct->ud, remaining_s(deadline), &bad, why, sizeof why);
    why[sizeof why - 1] = '\0';
    if (st != RP_OK) {
        *failed = bad;
        return callback_fail(err, st, why, "wait");
    }
    return RP_OK;
}

static rp_status cb_wait_op(rp_transport *t, int32_t op, double deadline, int32_t *failed, rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    *failed = -1;
    if (!ct->in_flight) return RP_OK;
    if (!ct->cb.wait_one) return cb_wait(t, deadline, failed, err);
    char why[RP_ERROR_TEXT];
    why[0] = '\0';
    int32_t bad = -1;
    int32_t st = ct->cb.wait_one(ct->ud, op, remaining_s(deadline), &bad, why, sizeof why);
    why[sizeof why - 1] = '\0';
    if (st != RP_OK) {
        *failed = bad;
        return callback_fail(err, st, why, "wait_one");
    }
    return RP_OK;
}

static bool cb_finish(rp_transport *t)
{
    callback_transport *ct = (callback_transport *)t;
    if (!ct->in_flight) return true;
    ct->in_flight = false;
    bool safe = ct->cb.finish(ct->ud) != 0;
    if (!safe) rp_transport_break(t, "a receive could not be cancelled");
    return safe;
}

static rp_status cb_allgather(rp_transport *t, const void *mine, void *all, size_t bytes, double deadline,
                              rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    char why[RP_ERROR_TEXT];
    why[0] = '\0';
    int32_t st = ct->cb.allgather(ct->ud, mine, all, bytes, remaining_s(deadline), why, sizeof why);
    why[sizeof why - 1] = '\0';
    if (st != RP_OK) {
        /* A collective cannot be taken back: the ranks may be out of step from here. */
        rp_status s = callback_fail(err, st, why, "allgather");
        rp_transport_break(t, err ? err->text : "an exchange failed");
        return s;
    }
    return RP_OK;
}

/* ---- memory: host memory through the context's allocator, else the callbacks ---- */

static void *cb_alloc(rp_transport *t, size_t bytes)
{
    callback_transport *ct = (callback_transport *)t;
    if (!ct->cb.alloc) return rp_alloc(t->ctx, bytes ? bytes : 1);
    return ct->cb.alloc(ct->ud, bytes ? bytes : 1);
}

static void cb_free(rp_transport *t, void *p)
{
    callback_transport *ct = (callback_transport *)t;
    if (!p) return;
    if (!ct->cb.free) rp_free(t->ctx, p);
    else ct->cb.free(ct->ud, p);
}

static rp_status cb_copy_kind(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline,
                              rp_copy_kind kind, rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    if (!ct->cb.copy) {
        memmove(dst, src, bytes);
        return RP_OK;
    }
    char why[RP_ERROR_TEXT];
    why[0] = '\0';
    int32_t st = ct->cb.copy(ct->ud, dst, src, bytes, kind, remaining_s(deadline), why, sizeof why);
    why[sizeof why - 1] = '\0';
    return st == RP_OK ? RP_OK : callback_fail(err, st, why, "copy");
}

static rp_status cb_copy(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline, rp_error *err)
{
    return cb_copy_kind(t, dst, src, bytes, deadline, RP_COPY_DEVICE, err);
}

static rp_status cb_to_host(rp_transport *t, void *host, const void *src, size_t bytes, double deadline,
                            rp_error *err)
{
    return cb_copy_kind(t, host, src, bytes, deadline, RP_COPY_TO_HOST, err);
}

static rp_status cb_from_host(rp_transport *t, void *dst, const void *host, size_t bytes, double deadline,
                              rp_error *err)
{
    return cb_copy_kind(t, dst, host, bytes, deadline, RP_COPY_FROM_HOST, err);
}

/* Checksums: CUDA memory on the device through the kernel where it runs, else the
 * callbacks' own checksum where they give one (torch ops on the device), else host
 * memory directly, else each expert's parts brought to the host and summed there; every
 * way equals rp_checksum_expert wherever the bytes live. */
static rp_status cb_checksum(rp_transport *t, const void *const *part_ptr, const size_t *part_bytes,
                             const int32_t *part_begin, int32_t num_experts, uint64_t *checksums, double deadline,
                             rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    if (ct->cb.checksum && num_experts > 0 && !(t->memory == RP_MEMORY_CUDA && t->device_checksum)) {
        char why[RP_ERROR_TEXT];
        why[0] = '\0';
        int32_t st = ct->cb.checksum(ct->ud, part_ptr, part_bytes, part_begin, num_experts, checksums,
                                     remaining_s(deadline), why, sizeof why);
        why[sizeof why - 1] = '\0';
        return st == RP_OK ? RP_OK : callback_fail(err, st, why, "checksum");
    }
    if (!ct->cb.copy)
        return rp_transport_checksum_host(t, part_ptr, part_bytes, part_begin, num_experts, checksums, deadline, err);
    if (t->device_checksum && num_experts > 0) {
        /* On the callbacks' stream, after the copies they queued there (the kernel
         * synchronises its stream before returning). */
        rp_error e;
        rp_error_clear(&e);
        rp_status gs = rp_gpu_checksum(t->ctx, part_ptr, part_bytes, part_begin, num_experts, checksums,
                                       ct->cb.stream, &e);
        if (gs == RP_OK) return RP_OK;
        if (gs != RP_ENOTSUP)
            return rp_fail(err, gs == RP_ENOMEM ? RP_ENOMEM : RP_ETRANSPORT,
                           "transport: the checksum kernel failed: %s", e.text);
        t->device_checksum = false; /* no device for the kernel: the callbacks' checksum or host copies */
        if (ct->cb.checksum) return cb_checksum(t, part_ptr, part_bytes, part_begin, num_experts, checksums, deadline, err);
    }
    rp_status st = RP_OK;
    size_t cap = 0;
    int32_t max_parts = 0;
    for (int32_t i = 0; i < num_experts; i++) {
        size_t total = 0;
        for (int32_t p = part_begin[i]; p < part_begin[i + 1]; p++) total += part_bytes[p];
        if (total > cap) cap = total;
        if (part_begin[i + 1] - part_begin[i] > max_parts) max_parts = part_begin[i + 1] - part_begin[i];
    }
    unsigned char *host = rp_alloc(t->ctx, cap ? cap : 1);
    const void **host_parts = rp_alloc(t->ctx, (size_t)(max_parts + 1) * sizeof *host_parts);
    if (!host || !host_parts) {
        st = rp_fail_nomem(err, "host memory for checksums");
        goto out;
    }
    for (int32_t i = 0; i < num_experts; i++) {
        size_t off = 0;
        for (int32_t p = part_begin[i]; p < part_begin[i + 1]; p++) {
            st = cb_to_host(t, host + off, part_ptr[p], part_bytes[p], deadline, err);
            if (st != RP_OK) goto out;
            host_parts[p - part_begin[i]] = host + off;
            off += part_bytes[p];
        }
        checksums[i] = rp_checksum_expert(host_parts, part_bytes + part_begin[i], part_begin[i + 1] - part_begin[i]);
    }
out:
    rp_free(t->ctx, host);
    rp_free(t->ctx, host_parts);
    return st;
}

/* A copy into or out of a swap's bounce buffer (cb_copy, cb_to_host or cb_from_host). */
typedef rp_status (*stage_fn)(rp_transport *t, void *dst, const void *src, size_t bytes, double deadline,
                              rp_error *err);

/* a <-> b in memory the callbacks own, a chunk at a time through a bounce buffer taken
 * before the commit, so that the commit (and its undo) never allocates: a -> bounce,
 * b -> a, bounce -> b. With CUDA memory the bounce is device memory (taken at the first
 * swap) and all three copies stay queued on the device; where none could be had, the
 * host buffer taken when the transport was made, through to_host and from_host. */
static rp_status cb_swap(rp_transport *t, void *a, void *b, size_t bytes, double deadline, rp_error *err)
{
    callback_transport *ct = (callback_transport *)t;
    if (!ct->cb.copy) return rp_transport_swap_host(t, a, b, bytes, deadline, err);
    if (t->memory == RP_MEMORY_CUDA && !ct->swap_device_tried) {
        ct->swap_device_tried = true;
        ct->swap_device = ct->cb.alloc(ct->ud, SWAP_CHUNK);
    }
    void *bounce = ct->swap_device ? ct->swap_device : (void *)ct->swap_host;
    stage_fn out = ct->swap_device ? cb_copy : cb_to_host, in = ct->swap_device ? cb_copy : cb_from_host;
    unsigned char *pa = a, *pb = b;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < SWAP_CHUNK ? bytes - done : SWAP_CHUNK;
        rp_status st = out(t, bounce, pa + done, n, deadline, err);
        if (st == RP_OK) st = cb_copy(t, pa + done, pb + done, n, deadline, err);
        if (st == RP_OK) st = in(t, pb + done, bounce, n, deadline, err);
        if (st != RP_OK) return st;
        done += n;
    }
    return RP_OK;
}

static void cb_destroy(rp_transport *t)
{
    callback_transport *ct = (callback_transport *)t;
    cb_finish(t);
    if (ct->swap_device) ct->cb.free(ct->ud, ct->swap_device);
    rp_free(t->ctx, ct->msgs);
    rp_free(t->ctx, ct->swap_host);
    rp_free(t->ctx, ct);
}

static const rp_transport_vtable callback_vtable = {
    "callback", cb_start, cb_wait, cb_finish, cb_allgather, cb_alloc, cb_free,
    cb_copy, cb_checksum, cb_swap, cb_to_host, cb_from_host, cb_destroy, cb_wait_op,
};

rp_status rp_transport_callback_new(rp_context *ctx, const rp_transport_callbacks *cb, void *ud, int32_t rank,
                                    int32_t size, rp_memory memory, rp_transport **out, rp_error *err)
{
    if (!ctx || !cb || !out) return rp_fail(err, RP_EINVAL, "transport: no context, callbacks or output");
    *out = NULL;
    if (!cb->start || !cb->wait || !cb->finish || !cb->allgather)
        return rp_fail(err, RP_EINVAL, "transport: the callbacks start, wait, finish and allgather are required");
    if (size < 1 || size > 65536)
        return rp_fail(err, RP_EINVAL, "transport: a callback transport of %d ranks; 1 to 65536 are allowed", size);
    if (rank < 0 || rank >= size)
        return rp_fail(err, RP_EINVAL, "transport: rank %d is out of range (%d ranks)", rank, size);
    if (memory != RP_MEMORY_HOST && memory != RP_MEMORY_CUDA)
        return rp_fail(err, RP_EINVAL, "transport: memory kind %d is neither host (0) nor CUDA (1)", (int)memory);
    bool has_memory = cb->alloc && cb->free && cb->copy;
    if ((cb->alloc || cb->free || cb->copy) && !has_memory)
        return rp_fail(err, RP_EINVAL, "transport: the memory callbacks alloc, free and copy go together");
    if (memory != RP_MEMORY_HOST && !has_memory)
        return rp_fail(err, RP_EINVAL, "transport: CUDA memory needs the memory callbacks alloc, free and copy");
    callback_transport *ct = rp_calloc(ctx, 1, sizeof *ct);
    if (!ct) return rp_fail_nomem(err, "a callback transport");
    if (has_memory && !(ct->swap_host = rp_alloc(ctx, SWAP_CHUNK))) {
        rp_free(ctx, ct);
        return rp_fail_nomem(err, "a callback transport's swap buffer");
    }
    rp_status st = rp_transport_init(&ct->base, &callback_vtable, ctx, rank, size, memory,
                                     cb->max_message_bytes ? cb->max_message_bytes : SIZE_MAX, err);
    if (st != RP_OK) {
        rp_free(ctx, ct->swap_host);
        rp_free(ctx, ct);
        return st;
    }
    ct->cb = *cb;
    ct->ud = ud;
    /* its memory is reached through the callbacks, or the callbacks give the checksums */
    if (has_memory || cb->checksum) ct->base.host_direct = false;
    ct->base.wait_each = ct->base.host_direct && cb->wait_one != NULL;
    ct->base.device_checksum = memory == RP_MEMORY_CUDA; /* tried at the first checksum */
    *out = &ct->base;
    return RP_OK;
}
