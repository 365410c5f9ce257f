/* An in-process rp_comm for tests: several ranks on threads meet at a shared hub for
 * allgather and broadcast. Every collective is a phase all ranks must enter with the
 * same operation, size and root; a rank that waits longer than the hub's timeout (a
 * rank skipped a collective: the bug the tests look for) makes every waiting rank
 * return RP_ETIMEOUT instead of hanging, and a mismatch is recorded. */
#ifndef RP_TEST_COMM_HUB_H
#define RP_TEST_COMM_HUB_H

#include "routepack/routepack.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HUB_MAX_RANKS 8

typedef struct comm_hub {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int size;
    double timeout_s;
    /* the phase in progress */
    int arrived, leaving;
    unsigned long phase;
    int op;               /* 1 allgather, 2 bcast */
    size_t bytes;
    int root;
    unsigned char *buf;   /* [size][bytes] for allgather, [bytes] for bcast */
    size_t cap;
    bool broken;          /* a rank timed out: every later call fails */
    bool mismatch;        /* ranks entered one phase with different operations */
    long collectives;     /* phases completed */
    /* a failure to inject: rank fail_rank's fail_at-th call (1-based) returns RP_ETRANSPORT */
    int fail_rank;
    long fail_at, calls[HUB_MAX_RANKS];
} comm_hub;

typedef struct hub_rank {
    comm_hub *hub;
    int rank;
} hub_rank;

static inline void hub_init(comm_hub *h, int size, double timeout_s)
{
    memset(h, 0, sizeof *h);
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->size = size;
    h->timeout_s = timeout_s;
    h->fail_rank = -1;
}

static inline void hub_destroy(comm_hub *h)
{
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h->buf);
}

/* Wait (mutex held) until `done` holds; false on timeout, which breaks the hub. */
#define HUB_WAIT(h, done)                                                                 \
    do {                                                                                  \
        struct timespec dl;                                                               \
        clock_gettime(CLOCK_REALTIME, &dl);                                               \
        dl.tv_sec += (time_t)(h)->timeout_s;                                              \
        while (!(done) && !(h)->broken)                                                   \
            if (pthread_cond_timedwait(&(h)->cv, &(h)->mu, &dl) == ETIMEDOUT) {           \
                (h)->broken = true;                                                       \
                pthread_cond_broadcast(&(h)->cv);                                         \
            }                                                                             \
    } while (0)

/* One collective: deposit, wait for all, copy out, wait for all to leave. */
static inline rp_status hub_phase(hub_rank *me, int op, const void *in, size_t bytes, void *out, int root)
{
    comm_hub *h = me->hub;
    pthread_mutex_lock(&h->mu);
    if (h->fail_rank == me->rank && ++h->calls[me->rank] == h->fail_at) {
        pthread_mutex_unlock(&h->mu);
        return RP_ETRANSPORT;
    }
    /* the previous phase must be fully left before a new one starts */
    HUB_WAIT(h, h->leaving == 0);
    if (h->broken) {
        pthread_mutex_unlock(&h->mu);
        return RP_ETIMEOUT;
    }
    if (h->arrived == 0) {
        size_t need = op == 1 ? bytes * (size_t)h->size : bytes;
        if (need > h->cap) {
            free(h->buf);
            h->buf = malloc(need ? need : 1);
            h->cap = need;
        }
        h->op = op, h->bytes = bytes, h->root = root;
    } else if (h->op != op || h->bytes != bytes || h->root != root) {
        h->mismatch = true;
    }
    if (!h->mismatch) {
        if (op == 1) memcpy(h->buf + (size_t)me->rank * bytes, in, bytes);
        else if (me->rank == root) memcpy(h->buf, in, bytes);
    }
    unsigned long phase = h->phase;
    if (++h->arrived == h->size) {
        h->arrived = 0;
        h->leaving = h->size;
        h->phase++;
        h->collectives++;
        pthread_cond_broadcast(&h->cv);
    } else {
        HUB_WAIT(h, h->phase != phase);
        if (h->broken) {
            pthread_mutex_unlock(&h->mu);
            return RP_ETIMEOUT;
        }
    }
    rp_status st = h->mismatch ? RP_ETRANSPORT : RP_OK;
    if (st == RP_OK) {
        if (op == 1) memcpy(out, h->buf, bytes * (size_t)h->size);
        else if (me->rank != root) memcpy(out, h->buf, bytes);
    }
    if (--h->leaving == 0) pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return st;
}

static inline rp_status hub_allgather(void *ud, const void *in, size_t bytes, void *out)
{
    return hub_phase(ud, 1, in, bytes, out, 0);
}

static inline rp_status hub_bcast(void *ud, void *buf, size_t bytes, int32_t root)
{
    return hub_phase(ud, 2, buf, bytes, buf, root);
}

/* The rp_comm of rank `rank` (me must outlive it). */
static inline rp_comm hub_comm(comm_hub *h, hub_rank *me, int rank)
{
    me->hub = h;
    me->rank = rank;
    rp_comm c = {rank, h->size, me, hub_allgather, hub_bcast};
    return c;
}

#endif
