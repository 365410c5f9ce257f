/* Shared by the in-process executor tests: NR ranks as threads over one local hub, a
 * scene (config, placements, buffers, transports, migration plan), one execution on
 * every rank, and the checks every test makes. */
#ifndef RP_TEST_MIGRATE_SCENE_H
#define RP_TEST_MIGRATE_SCENE_H

#include "routepack/routepack.h"
#include "transport.h"
#include "tap.h"
#include "mpi/migrate_world.h"

#include <pthread.h>
#include <time.h>

/* The exchanges' bound in the fault tests: a fault in a round's transfers is noticed
 * after the short transfer timeout, but ranks (threads, or processes on a loaded
 * machine) may reach an exchange far apart, and an exchange that times out ends the
 * transport, which is not what those tests test. */
#define SCENE_EXCHANGE_S 30.0

#define NR 4 /* ranks */

/* The rank of the thread running an execution (-1 elsewhere): lets an allocator fail
 * one rank's allocations only. */
static __thread int scene_thread_rank = -1;

typedef struct rank_run {
    int rank;
    const rp_migration_plan *mp;
    rp_registry *reg;
    rp_transport *t;
    rp_migration_exec_options opts;
    bool skip;          /* this rank does not call (a rank that never arrives) */
    double start_delay_s; /* this rank calls that much later than the others */
    rp_status st;
    rp_error err;
    rp_migration_result res;
} rank_run;

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    scene_thread_rank = r->rank;
    rp_error_clear(&r->err);
    if (r->start_delay_s > 0) {
        struct timespec ts = {(time_t)r->start_delay_s, (long)((r->start_delay_s - (double)(time_t)r->start_delay_s) * 1e9)};
        while (nanosleep(&ts, &ts) != 0) {}
    }
    if (!r->skip) r->st = rp_migration_execute(r->mp, r->reg, r->t, &r->opts, &r->res, &r->err);
    return NULL;
}

/* Run one execution on NR threads. */
static inline void run_all(rank_run *runs, int n)
{
    pthread_t th[NR * 2];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, rank_main, &runs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* A scenario: config, placements, layout, buffers, hub and transports. */
typedef struct scene {
    rp_context *ctx;
    rp_config *cfg;
    rp_plan *cur, *tgt;
    w_layout lay;
    w_gpu gpu[NR];
    rp_local_hub *hub;
    rp_transport *t[NR];
    rp_migration_plan *mp;
} scene;

static inline int scene_init(scene *s, rp_context *ctx, int nodes, int gpn, int ep, int slots, int L, int E,
                      const int32_t *cur, const int32_t *tgt, size_t max_tensor, int64_t budget)
{
    memset(s, 0, sizeof *s);
    s->ctx = ctx;
    s->cfg = w_config(ctx, nodes, gpn, ep, slots, L, E);
    if (!s->cfg) return -1;
    s->cur = w_plan(ctx, s->cfg, cur);
    s->tgt = w_plan(ctx, s->cfg, tgt);
    if (!s->cur || !s->tgt) return -1;
    w_random_layout(&s->lay, L, max_tensor);
    for (int g = 0; g < NR; g++)
        if (w_gpu_init(&s->gpu[g], ctx, &s->lay, s->cur, g) != 0) return -1;
    if (rp_local_hub_new(ctx, NR, &s->hub, NULL) != RP_OK) return -1;
    for (int g = 0; g < NR; g++)
        if (rp_transport_local_new(s->hub, g, &s->t[g], NULL) != RP_OK) return -1;
    rp_migration_options o = {s->lay.bytes, budget};
    rp_error err;
    if (rp_migration_plan_new(ctx, s->cfg, s->cur, s->tgt, &o, &s->mp, &err) != RP_OK) {
        diag("plan: %s", err.text);
        return -1;
    }
    return 0;
}

static inline void scene_free(scene *s)
{
    rp_migration_plan_free(s->mp);
    for (int g = 0; g < NR; g++) {
        rp_transport_free(s->t[g]);
        w_gpu_free(&s->gpu[g]);
    }
    rp_local_hub_free(s->hub);
    rp_plan_free(s->cur);
    rp_plan_free(s->tgt);
    rp_config_free(s->cfg);
}

static inline void scene_runs(scene *s, rank_run *runs, double timeout)
{
    for (int g = 0; g < NR; g++) {
        memset(&runs[g], 0, sizeof runs[g]);
        runs[g].rank = g;
        runs[g].mp = s->mp;
        runs[g].reg = s->gpu[g].reg;
        runs[g].t = s->t[g];
        rp_migration_exec_defaults(&runs[g].opts);
        runs[g].opts.timeout_s = timeout;
    }
}

/* As scene_runs, the transfers bounded by `timeout`, the exchanges by SCENE_EXCHANGE_S. */
static inline void scene_runs_fault(scene *s, rank_run *runs, double timeout)
{
    scene_runs(s, runs, timeout);
    for (int g = 0; g < NR; g++) runs[g].opts.exchange_timeout_s = SCENE_EXCHANGE_S;
}

static inline int scene_bad_slots(const scene *s, unsigned moved)
{
    int bad = 0;
    for (int g = 0; g < NR; g++) bad += w_gpu_bad_slots(&s->gpu[g], s->tgt, moved);
    return bad;
}

static inline bool scene_intact(const scene *s)
{
    bool all = true;
    for (int g = 0; g < NR; g++) all &= w_gpu_intact(&s->gpu[g]);
    return all;
}

/* The same status and text on every rank. */
static inline bool same_outcome(const rank_run *runs, int n)
{
    for (int g = 1; g < n; g++)
        if (runs[g].st != runs[0].st || strcmp(runs[g].err.text, runs[0].err.text) != 0) return false;
    return true;
}

#endif
