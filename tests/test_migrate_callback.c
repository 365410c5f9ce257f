/* The callback transport: the executor over callbacks that an in-process implementation
 * provides (4 ranks as threads, each callback forwarding to a local-hub transport, as
 * routepack.torch forwards to torch.distributed). Random migrations end with every
 * slot holding its expert; memory callbacks (a stand-in for CUDA) move every byte; a
 * callback failing on one rank rolls back every rank with its reason in the error. */
#include "routepack/routepack.h"
#include "transport.h"
#include "tap.h"
#include "mpi/migrate_world.h"

#include <pthread.h>

#define NR 4 /* ranks */

/* One rank's callback implementation: its local transport and what to inject. */
typedef struct cb_rank {
    rp_transport *inner;
    rp_transport_op ops[512];
    int32_t payload_batches;   /* batches started that carried expert bytes */
    int32_t fail_start_at;     /* fail the start of this payload batch; -1: never */
    int32_t fail_wait_at;      /* report a timeout from the wait of this payload batch */
    bool fail_allgather;       /* every allgather fails */
    bool waited_fail;          /* the current batch's wait must fail */
    int64_t copies[3];         /* memory callbacks: copies by rp_copy_kind */
    int64_t allocs, frees;
    int64_t checksum_calls;    /* the checksum callback's calls */
    int32_t checksum_wrong_at; /* its call that returns a wrong first checksum; -1: none */
    bool checksum_fail;        /* it fails */
    const w_gpu *gpu;          /* set: count its slots changed when the batch's wait starts */
    const rp_plan *plan;
    int32_t changed_at_wait;   /* slots not as before then (-1: not counted) */
} cb_rank;

static int32_t cb_start(void *ud, const rp_transport_message *msgs, int32_t n, int32_t *failed, char *why,
                        size_t why_bytes)
{
    cb_rank *r = ud;
    if (n > (int32_t)(sizeof r->ops / sizeof r->ops[0])) {
        snprintf(why, why_bytes, "the test's batch holds 512 messages, not %d", n);
        return RP_ENOMEM;
    }
    bool payload = false;
    for (int32_t i = 0; i < n; i++) {
        r->ops[i] = (rp_transport_op){msgs[i].peer, msgs[i].tag, msgs[i].send != 0, msgs[i].payload != 0, msgs[i].buf,
                                      msgs[i].bytes};
        payload |= msgs[i].payload != 0;
    }
    r->waited_fail = false;
    if (payload) {
        int32_t b = r->payload_batches++;
        if (b == r->fail_start_at) {
            *failed = 0;
            snprintf(why, why_bytes, "rank %d: injected send failure", r->inner->rank);
            return RP_ETRANSPORT;
        }
        r->waited_fail = b == r->fail_wait_at;
    }
    rp_error e;
    rp_status st = r->inner->vt->start(r->inner, r->ops, n, failed, &e);
    if (st != RP_OK) snprintf(why, why_bytes, "%s", e.text);
    return st;
}

/* The inner transport's wait for the whole batch (index -1) or one message of it, or the
 * injected timeout. */
static int32_t inner_wait(cb_rank *r, int32_t index, double timeout_s, int32_t *failed, char *why, size_t why_bytes)
{
    if (r->waited_fail) {
        snprintf(why, why_bytes, "rank %d: injected timeout", r->inner->rank);
        return RP_ETIMEOUT;
    }
    rp_error e;
    double deadline = rp_now_s() + timeout_s;
    rp_status st = index < 0 ? r->inner->vt->wait(r->inner, deadline, failed, &e)
                             : r->inner->vt->wait_op(r->inner, index, deadline, failed, &e);
    if (st != RP_OK) snprintf(why, why_bytes, "%s", e.text);
    return st;
}

static int32_t cb_wait(void *ud, double timeout_s, int32_t *failed, char *why, size_t why_bytes)
{
    cb_rank *r = ud;
    if (r->gpu && r->changed_at_wait < 0) r->changed_at_wait = w_gpu_bad_slots(r->gpu, r->plan, 0);
    return inner_wait(r, -1, timeout_s, failed, why, why_bytes);
}

/* One message (the executor commits each expert as it arrives): the local transport's. */
static int32_t cb_wait_one(void *ud, int32_t index, double timeout_s, int32_t *failed, char *why, size_t why_bytes)
{
    return inner_wait(ud, index, timeout_s, failed, why, why_bytes);
}

static int32_t cb_finish(void *ud)
{
    cb_rank *r = ud;
    return r->inner->vt->finish(r->inner) ? 1 : 0;
}

static int32_t cb_allgather(void *ud, const void *mine, void *all, size_t bytes, double timeout_s, char *why,
                            size_t why_bytes)
{
    cb_rank *r = ud;
    if (r->fail_allgather) {
        snprintf(why, why_bytes, "rank %d: injected exchange failure", r->inner->rank);
        return 4242; /* not an rp_status: counts as a transport failure */
    }
    rp_error e;
    rp_status st = r->inner->vt->allgather(r->inner, mine, all, bytes, rp_now_s() + timeout_s, &e);
    if (st != RP_OK) snprintf(why, why_bytes, "%s", e.text);
    return st;
}

/* Memory callbacks over host memory, counted: what a CUDA implementation would do with
 * cudaMalloc and cudaMemcpy. */
static void *cb_alloc(void *ud, size_t bytes)
{
    cb_rank *r = ud;
    r->allocs++;
    return malloc(bytes);
}

static void cb_free(void *ud, void *p)
{
    cb_rank *r = ud;
    r->frees++;
    free(p);
}

static int32_t cb_copy(void *ud, void *dst, const void *src, size_t bytes, rp_copy_kind kind, double timeout_s,
                       char *why, size_t why_bytes)
{
    cb_rank *r = ud;
    (void)timeout_s, (void)why, (void)why_bytes;
    r->copies[kind]++;
    memmove(dst, src, bytes);
    return RP_OK;
}

/* The caller's own checksums (as routepack.torch's torch ops): rp_checksum_expert, counted,
 * wrong or failing where asked. */
static int32_t cb_checksum(void *ud, const void *const *part_ptr, const size_t *part_bytes, const int32_t *part_begin,
                           int32_t n, uint64_t *sums, double timeout_s, char *why, size_t why_bytes)
{
    cb_rank *r = ud;
    (void)timeout_s;
    if (r->checksum_fail) {
        snprintf(why, why_bytes, "injected checksum failure");
        return RP_ETRANSPORT;
    }
    for (int32_t i = 0; i < n; i++)
        sums[i] = rp_checksum_expert(part_ptr + part_begin[i], part_bytes + part_begin[i],
                                     part_begin[i + 1] - part_begin[i]);
    if (r->checksum_calls++ == r->checksum_wrong_at && n > 0) sums[0] ^= 1;
    return RP_OK;
}

static const rp_transport_callbacks host_callbacks = {cb_start, cb_wait, cb_finish, cb_allgather, NULL,
                                                      NULL,     NULL,    0,         NULL,         NULL, cb_wait_one};
static const rp_transport_callbacks memory_callbacks = {cb_start,  cb_wait, cb_finish, cb_allgather, cb_alloc,
                                                        cb_free,   cb_copy, 0,         NULL,         NULL, NULL};

typedef struct rank_run {
    const rp_migration_plan *mp;
    rp_registry *reg;
    rp_transport *t;
    rp_migration_exec_options opts;
    rp_status st;
    rp_error err;
    rp_migration_result res;
} rank_run;

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    rp_error_clear(&r->err);
    r->st = rp_migration_execute(r->mp, r->reg, r->t, &r->opts, &r->res, &r->err);
    return NULL;
}

/* A scenario: placements, buffers, and per rank a local transport under a callback one. */
typedef struct scene {
    rp_config *cfg;
    rp_plan *cur, *tgt;
    w_layout lay;
    w_gpu gpu[NR];
    rp_local_hub *hub;
    cb_rank cb[NR];
    rp_transport *t[NR];
    rp_migration_plan *mp;
    rank_run runs[NR];
} scene;

static int scene_init(scene *s, rp_context *ctx, int nodes, int gpn, int ep, int slots, int L, int E,
                      const int32_t *cur, const int32_t *tgt, bool min_budget, rp_memory memory)
{
    memset(s, 0, sizeof *s);
    s->cfg = w_config(ctx, nodes, gpn, ep, slots, L, E);
    if (!s->cfg) return -1;
    s->cur = w_plan(ctx, s->cfg, cur);
    s->tgt = w_plan(ctx, s->cfg, tgt);
    if (!s->cur || !s->tgt) return -1;
    w_random_layout(&s->lay, L, 160);
    for (int g = 0; g < NR; g++) {
        if (w_gpu_init(&s->gpu[g], ctx, &s->lay, s->cur, g) != 0) return -1;
        if (memory != RP_MEMORY_HOST) { /* the same bytes, in a registry of the other kind */
            rp_registry *reg = NULL;
            if (rp_registry_new(ctx, L, slots, &reg, NULL) != RP_OK) return -1;
            for (int l = 0; l < L; l++)
                for (int k = 0; k < slots; k++) {
                    int32_t count = 0;
                    const rp_tensor *ts = rp_registry_tensors(s->gpu[g].reg, l, k, &count);
                    rp_tensor copy[W_MAX_TENSORS];
                    for (int i = 0; i < count; i++) copy[i] = (rp_tensor){ts[i].data, ts[i].bytes, memory};
                    if (rp_registry_set(reg, l, k, copy, count, NULL) != RP_OK) {
                        rp_registry_free(reg);
                        return -1;
                    }
                }
            if (rp_registry_set_placement(reg, s->cur, s->gpu[g].ep_rank, 0, NULL) != RP_OK) {
                rp_registry_free(reg);
                return -1;
            }
            rp_registry_free(s->gpu[g].reg);
            s->gpu[g].reg = reg;
        }
    }
    if (rp_local_hub_new(ctx, NR, &s->hub, NULL) != RP_OK) return -1;
    for (int g = 0; g < NR; g++) {
        s->cb[g].fail_start_at = s->cb[g].fail_wait_at = -1;
        if (rp_transport_local_new(s->hub, g, &s->cb[g].inner, NULL) != RP_OK) return -1;
        const rp_transport_callbacks *cb = memory == RP_MEMORY_HOST ? &host_callbacks : &memory_callbacks;
        rp_error err;
        if (rp_transport_callback_new(ctx, cb, &s->cb[g], g, NR, memory, &s->t[g], &err) != RP_OK) {
            diag("callback transport: %s", err.text);
            return -1;
        }
        /* Host memory posing as CUDA memory: where a GPU is, the checksum kernel must not
         * read it; without one the transport tries the kernel, gets RP_ENOTSUP and goes
         * through host copies (what the test counts). */
        if (rp_gpu_count() > 0) s->t[g]->device_checksum = false;
    }
    rp_migration_options o = {s->lay.bytes, 0};
    rp_error err;
    if (rp_migration_plan_new(ctx, s->cfg, s->cur, s->tgt, &o, &s->mp, &err) != RP_OK) {
        diag("plan: %s", err.text);
        return -1;
    }
    if (min_budget) {
        rp_migration_summary sum;
        rp_migration_plan_summary(s->mp, &sum);
        rp_migration_plan_free(s->mp);
        s->mp = NULL;
        o.staging_budget_bytes = sum.min_budget_bytes;
        if (rp_migration_plan_new(ctx, s->cfg, s->cur, s->tgt, &o, &s->mp, &err) != RP_OK) return -1;
    }
    return 0;
}

static void scene_free(scene *s)
{
    rp_migration_plan_free(s->mp);
    for (int g = 0; g < NR; g++) {
        rp_transport_free(s->t[g]);
        rp_transport_free(s->cb[g].inner);
        w_gpu_free(&s->gpu[g]);
    }
    rp_local_hub_free(s->hub);
    rp_plan_free(s->cur);
    rp_plan_free(s->tgt);
    rp_config_free(s->cfg);
}

static void scene_run(scene *s, double timeout)
{
    pthread_t th[NR];
    for (int g = 0; g < NR; g++) {
        rank_run *r = &s->runs[g];
        memset(r, 0, sizeof *r);
        r->mp = s->mp;
        r->reg = s->gpu[g].reg;
        r->t = s->t[g];
        rp_migration_exec_defaults(&r->opts);
        r->opts.timeout_s = timeout;
        pthread_create(&th[g], NULL, rank_main, r);
    }
    for (int g = 0; g < NR; g++) pthread_join(th[g], NULL);
}

static bool all_ok(const scene *s)
{
    bool good = true;
    for (int g = 0; g < NR; g++) {
        good &= s->runs[g].st == RP_OK;
        if (s->runs[g].st != RP_OK) diag("rank %d: %s", g, s->runs[g].err.text);
    }
    return good;
}

static int bad_slots(const scene *s, unsigned moved)
{
    int bad = 0;
    for (int g = 0; g < NR; g++) bad += w_gpu_bad_slots(&s->gpu[g], s->tgt, moved);
    return bad;
}

static bool intact(const scene *s)
{
    bool all = true;
    for (int g = 0; g < NR; g++) all &= w_gpu_intact(&s->gpu[g]);
    return all;
}

static bool same_outcome(const scene *s, rp_status want)
{
    for (int g = 0; g < NR; g++)
        if (s->runs[g].st != want || strcmp(s->runs[g].err.text, s->runs[0].err.text) != 0) return false;
    return true;
}

static void random_placements(int32_t *cur, int32_t *tgt, int L, int S, int E)
{
    for (int l = 0; l < L; l++) {
        w_random_layer(cur + l * S, S, E);
        w_random_layer(tgt + l * S, S, E);
    }
}

static void test_new(rp_context *ctx)
{
    cb_rank r = {0};
    rp_transport *t = NULL;
    rp_error err;
    rp_transport_callbacks cb = host_callbacks;
    cb.wait = NULL;
    is_int(rp_transport_callback_new(ctx, &cb, &r, 0, 2, RP_MEMORY_HOST, &t, &err), RP_EINVAL,
           "a missing wait callback: refused");
    like(err.text, "start, wait, finish and allgather are required", "the required callbacks are named");
    cb = host_callbacks;
    cb.alloc = cb_alloc;
    is_int(rp_transport_callback_new(ctx, &cb, &r, 0, 2, RP_MEMORY_HOST, &t, &err), RP_EINVAL,
           "alloc without free and copy: refused");
    is_int(rp_transport_callback_new(ctx, &host_callbacks, &r, 0, 2, RP_MEMORY_CUDA, &t, &err), RP_EINVAL,
           "CUDA memory without memory callbacks: refused");
    like(err.text, "CUDA memory needs the memory callbacks", "the reason is named");
    is_int(rp_transport_callback_new(ctx, &host_callbacks, &r, 2, 2, RP_MEMORY_HOST, &t, &err), RP_EINVAL,
           "rank 2 of 2: refused");
    like(err.text, "rank 2 is out of range", "the rank is named");
    ok(t == NULL, "nothing is returned on error");
    is_int(rp_transport_callback_new(ctx, &host_callbacks, &r, 1, 2, RP_MEMORY_HOST, &t, &err), RP_OK,
           "a host callback transport");
    ok(t && strcmp(rp_transport_name(t), "callback") == 0 && rp_transport_rank(t) == 1 && rp_transport_size(t) == 2 &&
           rp_transport_usable(t) && rp_transport_built("callback"),
       "its name, rank, size; rp_transport_built(\"callback\")");
    rp_transport_free(t);
}

static void test_property(rp_context *ctx)
{
    struct { int nodes, gpn, ep, slots, E; } shapes[] = {{2, 2, 4, 3, 9}, {1, 4, 2, 4, 6}, {4, 1, 4, 2, 7}};
    const int L = 3, per_shape = 6;
    int total = 0, good = 0, multi = 0;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        const int S = shapes[sh].ep * shapes[sh].slots;
        for (int run = 0; run < per_shape; run++) {
            int32_t cur[W_MAX_LAYERS * 16], tgt[W_MAX_LAYERS * 16];
            random_placements(cur, tgt, L, S, shapes[sh].E);
            scene s;
            total++;
            if (scene_init(&s, ctx, shapes[sh].nodes, shapes[sh].gpn, shapes[sh].ep, shapes[sh].slots, L, shapes[sh].E,
                           cur, tgt, run % 2 == 1, RP_MEMORY_HOST) != 0) {
                diag("scene setup failed");
                scene_free(&s);
                continue;
            }
            scene_run(&s, 20.0);
            rp_migration_summary sum;
            rp_migration_plan_summary(s.mp, &sum);
            int64_t recv = 0;
            for (int g = 0; g < NR; g++) recv += s.runs[g].res.bytes_received;
            if (all_ok(&s) && bad_slots(&s, (1u << L) - 1) == 0 && recv == sum.moved_bytes) good++;
            multi += sum.num_rounds > 1;
            scene_free(&s);
        }
    }
    is_int(good, total, "property: %d random migrations over callbacks leave every slot holding its expert's bytes",
           total);
    ok(multi > 0, "property: %d of them ran in several rounds", multi);
}

static void test_memory_callbacks(rp_context *ctx)
{
    const int L = 2, ep = 4, slots = 3, E = 8, S = ep * slots;
    int32_t cur[2 * 12], tgt[2 * 12];
    random_placements(cur, tgt, L, S, E);
    scene s;
    if (scene_init(&s, ctx, 2, 2, ep, slots, L, E, cur, tgt, false, RP_MEMORY_CUDA) != 0) {
        ok(0, "memory scene setup");
        scene_free(&s);
        return;
    }
    scene_run(&s, 20.0);
    ok(all_ok(&s) && bad_slots(&s, 3) == 0, "memory callbacks: every slot holds its expert's bytes");
    ok(!s.t[0]->device_checksum, "memory callbacks: %s", rp_gpu_count() > 0
           ? "the checksum kernel was kept off host memory"
           : "without a GPU the checksum kernel answered RP_ENOTSUP and host copies took over");
    /* the transports go first: each frees the device bounce buffer its swaps took */
    for (int g = 0; g < NR; g++) {
        rp_transport_free(s.t[g]);
        s.t[g] = NULL;
    }
    int64_t dev = 0, to_host = 0, from_host = 0, allocs = 0, frees = 0;
    for (int g = 0; g < NR; g++) {
        dev += s.cb[g].copies[RP_COPY_DEVICE];
        to_host += s.cb[g].copies[RP_COPY_TO_HOST];
        from_host += s.cb[g].copies[RP_COPY_FROM_HOST];
        allocs += s.cb[g].allocs;
        frees += s.cb[g].frees;
    }
    ok(dev > 0 && to_host > 0 && from_host > 0,
       "memory callbacks: device copies (%lld), copies to the host for checksums and headers (%lld) and from it (%lld)",
       (long long)dev, (long long)to_host, (long long)from_host);
    ok(allocs > 0 && allocs == frees,
       "memory callbacks: staging, headers and swap buffers allocated (%lld) and freed (%lld)",
       (long long)allocs, (long long)frees);
    scene_free(&s);
}

/* The scene of the tests below: 2 layers of 10 experts on 4 ranks (2 nodes of 2) of 3
 * slots each, every layer random and moved along by one rank, in `memory`; false, with
 * a failed check naming `what`, when it cannot be made. */
static bool rotated_scene(scene *s, rp_context *ctx, rp_memory memory, const char *what)
{
    enum { L = 2, EP = 4, SLOTS = 3, E = 10, S = EP * SLOTS };
    int32_t cur[L * S], tgt[L * S];
    for (int l = 0; l < L; l++) w_random_layer(cur + l * S, S, E);
    w_rotate(cur, tgt, L, EP, SLOTS);
    if (scene_init(s, ctx, 2, 2, EP, SLOTS, L, E, cur, tgt, false, memory) == 0) return true;
    ok(0, "%s scene setup", what);
    scene_free(s);
    return false;
}

/* A callback fails on one rank: every rank fails alike, every byte is intact, the reason
 * the callback gave is in the error, and a retry without the fault completes. */
static void test_failures(rp_context *ctx)
{
    const char *kinds[] = {"start", "wait", "allgather"};
    rp_status want[] = {RP_ETRANSPORT, RP_ETIMEOUT, RP_ETRANSPORT};
    const char *text[] = {"injected send failure", "injected timeout", "injected exchange failure"};
    for (int k = 0; k < 3; k++)
        for (int rank = 0; rank < NR; rank += 3) {
            scene s;
            if (!rotated_scene(&s, ctx, RP_MEMORY_HOST, "failure")) continue;
            if (k == 0) s.cb[rank].fail_start_at = 0;
            if (k == 1) s.cb[rank].fail_wait_at = 0;
            if (k == 2) s.cb[rank].fail_allgather = true;
            scene_run(&s, 0.3);
            if (k < 2) {
                ok(same_outcome(&s, want[k]), "%s fails on rank %d: every rank fails with %s", kinds[k], rank,
                   rp_strerror(want[k]));
                /* The error names the lowest rank that failed: a timeout on rank 3 also
                 * times out rank 0's sends to it. */
                if (k == 0 || rank == 0)
                    like(s.runs[0].err.text, text[k], "%s fails on rank %d: the callback's reason is in the error",
                         kinds[k], rank);
                like(s.runs[0].err.text, "rolled back on every rank", "%s fails on rank %d: rolled back", kinds[k],
                     rank);
            } else {
                /* The exchange itself failed: every rank fails, no agreement is possible. */
                bool every = true;
                for (int g = 0; g < NR; g++) every &= s.runs[g].st != RP_OK;
                ok(every && s.runs[rank].st == want[k], "allgather fails on rank %d: every rank fails", rank);
                like(s.runs[rank].err.text, text[k], "allgather fails on rank %d: its reason is in its error", rank);
                ok(!rp_transport_usable(s.t[rank]), "allgather fails on rank %d: its transport is unusable", rank);
            }
            ok(intact(&s), "%s fails on rank %d: every weight byte is intact", kinds[k], rank);
            if (k < 2) {
                scene_run(&s, 10.0);
                ok(all_ok(&s) && bad_slots(&s, 3) == 0, "%s fails on rank %d: a retry without the fault completes",
                   kinds[k], rank);
            }
            scene_free(&s);
        }
}

/* Bytes corrupted on the way (the inner transport flips one): the checksums the executor
 * computes around the callbacks catch it, named as rp_checksum_expert of both sides. */
static void test_corruption(rp_context *ctx)
{
    scene s;
    if (!rotated_scene(&s, ctx, RP_MEMORY_HOST, "corruption")) return;
    const int rank = 1;
    int tensor = -1;
    rp_migration_transfer t = {0};
    rp_migration_plan_transfer(s.mp, w_fault_message(s.mp, &s.lay, rank, 0, &tensor), &t, NULL);
    rp_fault f = {RP_FAULT_CORRUPT, 0, 0, false};
    rp_transport_set_fault(s.cb[rank].inner, &f);
    scene_run(&s, 5.0);
    ok(same_outcome(&s, RP_ECHECKSUM), "corruption: every rank fails with a checksum mismatch");
    uint64_t sent, received;
    w_expert_checksums(&s.gpu[0], t.layer, t.expert, tensor, &sent, &received);
    ok(w_error_has_checksums(s.runs[0].err.text, received, sent),
       "corruption: the error gives rp_checksum_expert as sent and as received");
    ok(intact(&s), "corruption: every weight byte is intact");
    scene_free(&s);
}

/* The commit as the experts arrive (wait_one): a receiver has written its first experts
 * into their slots before it waits for the whole batch; a sender's last message arrives
 * corrupt, so its check fails after others were committed, and every rank ends with
 * every byte as before. */
static void test_late_failure(rp_context *ctx)
{
    scene s;
    if (!rotated_scene(&s, ctx, RP_MEMORY_HOST, "late-failure")) return;
    const int sender = w_sender(s.mp, 1);
    int64_t messages = 0, last = -1;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(s.mp); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(s.mp, i, &t, NULL);
        if (t.src_gpu == sender && t.dst_gpu != sender) messages += s.lay.count[t.layer];
    }
    int tensor = -1;
    last = w_fault_message(s.mp, &s.lay, sender, messages - 1, &tensor);
    rp_migration_transfer lt = {0};
    rp_migration_plan_transfer(s.mp, last, &lt, NULL);
    const int receiver = lt.dst_gpu;
    int64_t to_receiver = 0;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(s.mp); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(s.mp, i, &t, NULL);
        to_receiver += t.src_gpu != receiver && t.dst_gpu == receiver;
    }
    ok(rp_migration_plan_num_rounds(s.mp) == 1 && to_receiver >= 2,
       "late failure: one round, rank %d receives %lld experts, the last message of rank %d among them", receiver,
       (long long)to_receiver, sender);
    ok(s.t[receiver]->wait_each, "late failure: a callback transport with wait_one waits for single messages");
    for (int g = 0; g < NR; g++) {
        s.cb[g].gpu = &s.gpu[g];
        s.cb[g].plan = s.tgt;
        s.cb[g].changed_at_wait = -1;
    }
    rp_transport_set_fault(s.cb[sender].inner, &(rp_fault){RP_FAULT_CORRUPT, messages - 1, 0, false});
    scene_run(&s, 5.0);
    ok(s.cb[receiver].changed_at_wait > 0,
       "late failure: rank %d had written %d slots before it waited for the whole batch", receiver,
       s.cb[receiver].changed_at_wait);
    ok(same_outcome(&s, RP_ECHECKSUM), "late failure: every rank fails with a checksum mismatch");
    uint64_t sent, received;
    w_expert_checksums(&s.gpu[0], lt.layer, lt.expert, tensor, &sent, &received);
    ok(w_error_has_checksums(s.runs[0].err.text, received, sent),
       "late failure: the error names the last expert's checksums as sent and as received");
    like(s.runs[0].err.text, "rolled back on every rank", "late failure: the error says every rank rolled back");
    ok(intact(&s), "late failure: every weight byte on every rank is as before");
    bool unknown = true;
    for (int g = 0; g < NR; g++) unknown &= s.runs[g].res.rounds_committed == 0 && s.runs[g].res.slots_written == 0;
    ok(unknown, "late failure: no rank counts a committed round or a written slot");
    /* The same migration again, without the fault: it completes. */
    for (int g = 0; g < NR; g++) s.cb[g].gpu = NULL;
    rp_transport_set_fault(s.cb[sender].inner, &(rp_fault){RP_FAULT_NONE, 0, 0, false});
    scene_run(&s, 5.0);
    ok(all_ok(&s) && bad_slots(&s, 3) == 0, "late failure: the retry moves every expert");
    scene_free(&s);
}

/* A checksum callback: every checksum of the executor goes through it (host memory and
 * memory callbacks alike), a migration completes; a wrong checksum from it on one rank
 * fails the round on every rank with a mismatch and every byte intact; a failing one
 * rolls back with its reason. */
static void test_checksum_callback(rp_context *ctx)
{
    for (int memory = 0; memory < 2; memory++)
        for (int mode = 0; mode < 3; mode++) {
            scene s;
            rp_memory mem = memory ? RP_MEMORY_CUDA : RP_MEMORY_HOST;
            const char *what = memory ? "memory callbacks" : "host memory";
            if (!rotated_scene(&s, ctx, mem, "checksum")) continue;
            /* the same transports again, with the checksum callback */
            for (int g = 0; g < NR; g++) {
                rp_transport_free(s.t[g]);
                s.t[g] = NULL;
                rp_transport_callbacks cb = memory ? memory_callbacks : host_callbacks;
                cb.checksum = cb_checksum;
                s.cb[g].checksum_wrong_at = -1;
                rp_error e;
                if (rp_transport_callback_new(ctx, &cb, &s.cb[g], g, NR, mem, &s.t[g], &e) != RP_OK)
                    diag("checksum transport: %s", e.text);
                else if (rp_gpu_count() > 0)
                    s.t[g]->device_checksum = false; /* host malloc standing in for device memory */
            }
            if (mode == 1) s.cb[2].checksum_wrong_at = 1; /* rank 2's check of the slots it wrote */
            if (mode == 2) s.cb[1].checksum_fail = true;
            scene_run(&s, 5.0);
            int64_t calls = 0;
            for (int g = 0; g < NR; g++) calls += s.cb[g].checksum_calls;
            if (mode == 0) {
                ok(all_ok(&s) && bad_slots(&s, 3) == 0, "checksum callback, %s: every slot holds its expert", what);
                ok(calls >= 2 * NR, "checksum callback, %s: every checksum went through it (%lld calls)", what,
                   (long long)calls);
                ok(memory || !s.t[0]->host_direct, "checksum callback, %s: the commit check is not fused", what);
            } else if (mode == 1) {
                ok(same_outcome(&s, RP_ECHECKSUM) && intact(&s),
                   "checksum callback, %s: a wrong checksum on one rank fails every rank, every byte intact", what);
            } else {
                ok(same_outcome(&s, RP_ETRANSPORT) && intact(&s), "checksum callback, %s: a failing one rolls back",
                   what);
                like(s.runs[0].err.text, "injected checksum failure", "checksum callback, %s: its reason is named",
                     what);
            }
            scene_free(&s);
        }
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_new(ctx);
    test_property(ctx);
    test_memory_callbacks(ctx);
    test_failures(ctx);
    test_corruption(ctx);
    test_late_failure(ctx);
    test_checksum_callback(ctx);
    rp_context_free(ctx);
    return tap_done();
}
