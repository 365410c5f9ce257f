/* What every transport shares: the handle functions of the public API, the clock, the
 * exchange room, the host checksum and swap, and fault injection (transport_fault.h). */
#include "transport.h"

#include "routepack/checksum.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

double rp_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

rp_status rp_transport_init(rp_transport *t, const rp_transport_vtable *vt, rp_context *ctx, int32_t rank,
                            int32_t size, rp_memory memory, size_t max_message_bytes, rp_error *err)
{
    memset(t, 0, sizeof *t);
    t->vt = vt;
    t->ctx = ctx;
    t->rank = rank;
    t->size = size;
    t->memory = memory;
    t->max_message_bytes = max_message_bytes;
    t->host_direct = memory == RP_MEMORY_HOST; /* the callback transport clears it for memory callbacks */
    if (size < 1 || (size_t)size > SIZE_MAX / RP_EXCHANGE_RECORD_BYTES)
        return rp_fail(err, RP_ERANGE, "transport: %d ranks are too many to exchange records", size);
    t->records = rp_alloc(ctx, (size_t)size * RP_EXCHANGE_RECORD_BYTES);
    if (!t->records) return rp_fail_nomem(err, "a transport's exchange records");
    return RP_OK;
}

void rp_transport_break(rp_transport *t, const char *why)
{
    if (t->broken) return;
    t->broken = true;
    snprintf(t->broken_why, sizeof t->broken_why, "%s", why);
}

/* ---- fault injection ---- */

static rp_fault_site fault_site(const rp_fault *f)
{
    switch (f->kind) {
    case RP_FAULT_STALL_DECISION:
    case RP_FAULT_LOSE_DECISION: return RP_FAULT_SITE_DECISION;
    case RP_FAULT_COMMIT_FAIL: return RP_FAULT_SITE_COMMIT_WRITE;
    case RP_FAULT_CORRUPT_STAGING: return RP_FAULT_SITE_STAGED;
    default: return f->header ? RP_FAULT_SITE_HEADER : RP_FAULT_SITE_PAYLOAD;
    }
}

void rp_transport_set_fault(rp_transport *t, const rp_fault *fault)
{
    if (!t) return;
    memset(t->faults, 0, sizeof t->faults);
    memset(t->fault_events, 0, sizeof t->fault_events);
    t->num_faults = 0;
    rp_transport_add_fault(t, fault);
}

void rp_transport_add_fault(rp_transport *t, const rp_fault *fault)
{
    if (!t || !fault || fault->kind == RP_FAULT_NONE || t->num_faults == RP_MAX_FAULTS) return;
    t->faults[t->num_faults++] = *fault;
}

rp_fault_kind rp_transport_fault_at(rp_transport *t, rp_fault_site site, double *delay_s)
{
    int64_t n = t->fault_events[site]++;
    for (int32_t i = 0; i < t->num_faults; i++) {
        rp_fault *f = &t->faults[i];
        if (f->kind == RP_FAULT_NONE || fault_site(f) != site || f->nth != n) continue;
        rp_fault_kind kind = f->kind;
        if (delay_s) *delay_s = f->delay_s;
        f->kind = RP_FAULT_NONE; /* once */
        return kind;
    }
    return RP_FAULT_NONE;
}

rp_fault_kind rp_transport_send_fault(rp_transport *t, const rp_transport_op *op, double *delay_s)
{
    rp_fault_kind kind = rp_transport_fault_at(t, op->payload ? RP_FAULT_SITE_PAYLOAD : RP_FAULT_SITE_HEADER, delay_s);
    if (kind == RP_FAULT_STALL) {
        /* The rank stops responding: its thread does nothing for that long. */
        double s = delay_s ? *delay_s : 0.0;
        struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
        while (nanosleep(&ts, &ts) != 0) {}
        return RP_FAULT_NONE;
    }
    return kind;
}

/* ---- host memory helpers ---- */

rp_status rp_transport_checksum_host(rp_transport *t, const void *const *part_ptr, const size_t *part_bytes,
                                     const int32_t *part_begin, int32_t num_experts, uint64_t *checksums,
                                     double deadline, rp_error *err)
{
    (void)t, (void)deadline, (void)err;
    for (int32_t i = 0; i < num_experts; i++)
        checksums[i] = rp_checksum_expert(part_ptr + part_begin[i], part_bytes + part_begin[i],
                                          part_begin[i + 1] - part_begin[i]);
    return RP_OK;
}

rp_status rp_transport_swap_host(rp_transport *t, void *a, void *b, size_t bytes, double deadline, rp_error *err)
{
    (void)t, (void)deadline, (void)err;
    unsigned char tmp[4096], *pa = a, *pb = b;
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < sizeof tmp ? bytes - done : sizeof tmp;
        memcpy(tmp, pa + done, n);
        memcpy(pa + done, pb + done, n);
        memcpy(pb + done, tmp, n);
        done += n;
    }
    return RP_OK;
}

void rp_transport_swap_sum_host(void *a, void *b, size_t bytes, rp_checksum_state *sum)
{
    /* Chunks of 8 checksum blocks (32 KiB, in cache when hashed), so the blocks are
     * hashed side by side (rp_checksum_blocks), each swapped through a 4 KiB buffer. */
    enum { CHUNK = 8 * RP_CHECKSUM_BLOCK };
    unsigned char tmp[RP_CHECKSUM_BLOCK], *pa = a, *pb = b;
    for (size_t done = 0; done < bytes;) {
        size_t chunk = bytes - done < CHUNK ? bytes - done : CHUNK;
        for (size_t i = 0; i < chunk;) {
            size_t n = chunk - i < sizeof tmp ? chunk - i : sizeof tmp;
            memcpy(tmp, pa + done + i, n);
            memcpy(pa + done + i, pb + done + i, n);
            memcpy(pb + done + i, tmp, n);
            i += n;
        }
        rp_checksum_update(sum, pa + done, chunk); /* what the slot now holds, still in cache */
        done += chunk;
    }
}

rp_status rp_transport_barrier(rp_transport *t, double deadline, rp_error *err)
{
    if (!t) return rp_fail(err, RP_EINVAL, "transport: no transport");
    if (t->broken) return rp_fail(err, RP_ETRANSPORT, "transport: unusable (%s)", t->broken_why);
    /* One byte each, exchanged through the record room (never allocates). */
    unsigned char mine = 1;
    return t->vt->allgather(t, &mine, t->records, 1, deadline, err);
}

/* ---- handles ---- */

void rp_transport_free(rp_transport *t)
{
    if (!t) return;
    rp_context *ctx = t->ctx;
    void *records = t->records;
    t->vt->destroy(t);
    rp_free(ctx, records);
}

int32_t rp_transport_rank(const rp_transport *t) { return t ? t->rank : -1; }
int32_t rp_transport_size(const rp_transport *t) { return t ? t->size : 0; }
const char *rp_transport_name(const rp_transport *t) { return t ? t->vt->name : "none"; }
bool rp_transport_usable(const rp_transport *t) { return t && !t->broken; }

bool rp_transport_built(const char *name)
{
    if (!name) return false;
    if (strcmp(name, "local") == 0 || strcmp(name, "callback") == 0) return true;
#ifdef RP_HAVE_MPI
    if (strcmp(name, "mpi") == 0) return true;
#endif
#ifdef RP_HAVE_NCCL
    if (strcmp(name, "nccl") == 0) return true;
#endif
    return false;
}
