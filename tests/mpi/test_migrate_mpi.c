/* The migration executor over the MPI transport, one process per rank (run by
 * tests/test_migrate_mpi.c under mpirun -np 4): the property test over random
 * placements and weights, rollback under every injected fault on every rank, a plan
 * mismatch refused. Rank 0 prints TAP; every check is agreed over all ranks. */
#include "routepack/routepack.h"
#include "routepack/migrate_mpi.h"
#include "transport.h"
#include "tap.h"
#include "mpi/migrate_world.h"

static int my_rank, num_ranks;

/* A check passes when it passes on every rank; rank 0 reports it. */
static void check(bool mine, const char *fmt, ...) RP_PRINTF(2, 3);
static void check(bool mine, const char *fmt, ...)
{
    int v = mine, all = 0;
    MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    if (my_rank != 0) {
        tap_count++;
        return;
    }
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    ok(all, "%s", text);
}

typedef struct mscene {
    rp_config *cfg;
    rp_plan *cur, *tgt;
    w_layout lay;
    w_gpu gpu;
    rp_migration_plan *mp;
} mscene;

static int mscene_init(mscene *s, rp_context *ctx, int nodes, int gpn, int ep, int slots, int L, int E,
                       const int32_t *cur, const int32_t *tgt, size_t max_tensor, int64_t budget)
{
    memset(s, 0, sizeof *s);
    s->cfg = w_config(ctx, nodes, gpn, ep, slots, L, E);
    if (!s->cfg) return -1;
    s->cur = w_plan(ctx, s->cfg, cur);
    s->tgt = w_plan(ctx, s->cfg, tgt);
    w_random_layout(&s->lay, L, max_tensor); /* same draws on every rank */
    if (!s->cur || !s->tgt || w_gpu_init(&s->gpu, ctx, &s->lay, s->cur, my_rank) != 0) return -1;
    rp_migration_options o = {s->lay.bytes, budget};
    return rp_migration_plan_new(ctx, s->cfg, s->cur, s->tgt, &o, &s->mp, NULL) == RP_OK ? 0 : -1;
}

static void mscene_free(mscene *s)
{
    rp_migration_plan_free(s->mp);
    w_gpu_free(&s->gpu);
    rp_plan_free(s->cur);
    rp_plan_free(s->tgt);
    rp_config_free(s->cfg);
}

/* The transfers bounded by `timeout`; the exchanges by 30 s, since ranks on a loaded
 * machine may reach one far apart and an exchange that times out ends the transport (a
 * fault test checks the fault, not that). */
static rp_status run(mscene *s, rp_transport *t, const rp_migration_plan *mp, double timeout, rp_error *err,
                     rp_migration_result *res)
{
    rp_migration_exec_options o;
    rp_migration_exec_defaults(&o);
    o.timeout_s = timeout;
    o.exchange_timeout_s = 30.0;
    rp_error_clear(err);
    return rp_migration_execute(mp ? mp : s->mp, s->gpu.reg, t, &o, res, err);
}

static void test_property(rp_context *ctx, rp_transport *t)
{
    struct { int nodes, gpn, ep, slots, E; } shapes[] = {{2, 2, 4, 3, 9}, {1, 4, 2, 4, 6}};
    const int L = 3, runs_per_shape = 6;
    int good = 0, total = 0;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        const int ep = shapes[sh].ep, slots = shapes[sh].slots, E = shapes[sh].E, S = ep * slots;
        for (int r = 0; r < runs_per_shape; r++) {
            int32_t cur[3 * 12], tgt[3 * 12];
            for (int l = 0; l < L; l++) {
                w_random_layer(cur + l * S, S, E);
                w_random_layer(tgt + l * S, S, E);
            }
            mscene s;
            bool fine = mscene_init(&s, ctx, shapes[sh].nodes, shapes[sh].gpn, ep, slots, L, E, cur, tgt, 300, 0) == 0;
            if (fine && r % 2) { /* several rounds */
                rp_migration_summary sum;
                rp_migration_plan_summary(s.mp, &sum);
                rp_migration_plan_free(s.mp);
                s.mp = NULL;
                rp_migration_options o = {s.lay.bytes, sum.min_budget_bytes};
                fine = rp_migration_plan_new(ctx, s.cfg, s.cur, s.tgt, &o, &s.mp, NULL) == RP_OK;
            }
            rp_error err;
            rp_migration_result res;
            rp_status st = fine ? run(&s, t, NULL, 30.0, &err, &res) : RP_EINVAL;
            int bad = fine ? w_gpu_bad_slots(&s.gpu, s.tgt, (1u << L) - 1) : -1;
            if (st != RP_OK || bad != 0) printf("# rank %d: %s (%d slots wrong)\n", my_rank, err.text, bad);
            int mine = st == RP_OK && bad == 0, all = 0;
            MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
            good += all;
            total++;
            mscene_free(&s);
        }
    }
    check(good == total, "mpi property: after %d random migrations every slot holds exactly its expert's bytes on "
          "every rank (%d good)", total, good);
}

static void test_faults(rp_context *ctx, rp_transport *t)
{
    const int L = 2, ep = 4, slots = 3, E = 10, S = ep * slots;
    rp_fault_kind kinds[] = {RP_FAULT_DROP, RP_FAULT_CORRUPT, RP_FAULT_DELAY, RP_FAULT_SEND_FAIL};
    const char *names[] = {"drop", "corrupt", "delay", "send failure"};
    rp_status want[] = {RP_ETIMEOUT, RP_ECHECKSUM, RP_ETIMEOUT, RP_ETRANSPORT};
    for (size_t k = 0; k < 4; k++)
        for (int rank = 0; rank < num_ranks; rank++) {
            int32_t cur[2 * 12], tgt[2 * 12];
            for (int l = 0; l < L; l++) w_random_layer(cur + l * S, S, E);
            w_rotate(cur, tgt, L, ep, slots);
            mscene s;
            bool fine = mscene_init(&s, ctx, 2, 2, ep, slots, L, E, cur, tgt, 200, 0) == 0;
            int64_t nth = (int64_t)(rank + k) % 3;
            rp_migration_transfer tr = {0};
            int tensor = -1;
            if (fine) rp_migration_plan_transfer(s.mp, w_fault_message(s.mp, &s.lay, rank, nth, &tensor), &tr, NULL);
            if (rank == my_rank) {
                rp_fault f = {kinds[k], nth, 30.0, false};
                rp_transport_set_fault(t, &f);
            }
            rp_error err;
            rp_migration_result res;
            rp_status st = fine ? run(&s, t, NULL, 0.4, &err, &res) : RP_EINVAL;
            rp_transport_set_fault(t, NULL);
            char who[32], what[64];
            snprintf(who, sizeof who, "rank %d", rank);
            snprintf(what, sizeof what, "layer %d expert %d", tr.layer, tr.expert);
            if (st != want[k]) printf("# rank %d got %s: %s\n", my_rank, rp_strerror(st), err.text);
            else if (my_rank == 0 && rank == 1) printf("# %s\n", err.text);
            check(st == want[k], "mpi %s on rank %d: every rank fails with %s", names[k], rank, rp_strerror(want[k]));
            check(fine && w_gpu_intact(&s.gpu), "mpi %s on rank %d: every weight byte is intact", names[k], rank);
            check(strstr(err.text, who) && strstr(err.text, what),
                  "mpi %s on rank %d: the error names the rank, layer and expert", names[k], rank);
            check(res.failed_layer == tr.layer && res.failed_expert == tr.expert && res.rounds_committed == 0,
                  "mpi %s on rank %d: the result names the failure", names[k], rank);
            if (kinds[k] == RP_FAULT_CORRUPT) {
                uint64_t sent = 0, received = 0;
                if (fine) w_expert_checksums(&s.gpu, tr.layer, tr.expert, tensor, &sent, &received);
                check(fine && w_error_has_checksums(err.text, received, sent),
                      "mpi corrupt on rank %d: the error's checksums are rp_checksum_expert of the expert as sent "
                      "and as received", rank);
            }
            st = fine ? run(&s, t, NULL, 30.0, &err, &res) : RP_EINVAL;
            if (st != RP_OK) printf("# rank %d retry: %s\n", my_rank, err.text);
            check(st == RP_OK && w_gpu_bad_slots(&s.gpu, s.tgt, 3) == 0,
                  "mpi %s on rank %d: a retry without the fault completes", names[k], rank);
            mscene_free(&s);
        }
}

/* One op of a batch waited on alone (what lets the executor commit each expert as it
 * arrives): every rank sends two messages to the next rank, the second held back 2 s
 * (fault); waiting for the first receive returns while the second cannot have arrived,
 * a wait for the second before then times out naming it, and the batch then completes
 * with both in place. */
static void test_wait_op(rp_transport *t)
{
    check(t->wait_each && t->vt->wait_op != NULL, "mpi: the executor commits each expert as it arrives (wait_each)");
    if (!t->vt->wait_op) return;
    const int32_t next = (my_rank + 1) % num_ranks, prev = (my_rank + num_ranks - 1) % num_ranks;
    unsigned char out[2][64], in[2][64];
    for (int m = 0; m < 2; m++) {
        memset(out[m], 16 * my_rank + m + 1, sizeof out[m]);
        memset(in[m], 0, sizeof in[m]);
    }
    rp_transport_op ops[4] = {
        {prev, 7, false, true, in[0], sizeof in[0]}, {prev, 8, false, true, in[1], sizeof in[1]},
        {next, 7, true, true, out[0], sizeof out[0]}, {next, 8, true, true, out[1], sizeof out[1]},
    };
    rp_fault hold = {RP_FAULT_DELAY, 1, 2.0, false};
    rp_transport_set_fault(t, &hold);
    int32_t failed = -1;
    rp_error err;
    rp_status st = t->vt->start(t, ops, 4, &failed, &err);
    check(st == RP_OK, "mpi wait_op: the batch starts");
    st = t->vt->wait_op(t, 0, rp_now_s() + 1.0, &failed, &err);
    check(st == RP_OK && in[0][0] == 16 * prev + 1 && in[0][63] == 16 * prev + 1,
          "mpi wait_op: the first message is in place while the second is held back");
    st = t->vt->wait_op(t, 1, rp_now_s() + 0.2, &failed, &err);
    check(st == RP_ETIMEOUT && failed == 1 && strstr(err.text, "nothing arrived from rank") != NULL,
          "mpi wait_op: a wait for the held-back one times out naming it");
    st = t->vt->wait_op(t, 4, rp_now_s() + 1.0, &failed, &err);
    check(st == RP_EINVAL, "mpi wait_op: an op outside the batch is refused");
    st = t->vt->wait(t, rp_now_s() + 10.0, &failed, &err);
    check(st == RP_OK && in[1][0] == 16 * prev + 2 && in[1][63] == 16 * prev + 2,
          "mpi wait_op: then the batch completes, both messages in place");
    check(t->vt->finish(t), "mpi wait_op: nothing left in flight");
    rp_transport_set_fault(t, NULL);
}

/* The faults the in-process tests cover in depth (tests/test_migrate_faults.c), once
 * each over MPI: the same status on every rank, every byte intact, the transport
 * usable, a retry that completes. */
static void test_more_faults(rp_context *ctx, rp_transport *t)
{
    const int L = 2, ep = 4, slots = 3, E = 10, S = ep * slots;
    struct {
        const char *name;
        rp_fault f, g;     /* on the chosen sender; g on another sender (kind 0: none) */
        rp_status want;
        const char *text;
    } cases[] = {
        {"corrupt header", {RP_FAULT_CORRUPT, 0, 0, true}, {0, 0, 0, false}, RP_ETRANSPORT,
         "is corrupt (header checksum"},
        {"short header", {RP_FAULT_SHORT, 0, 0, true}, {0, 0, 0, false}, RP_ETRANSPORT, "bytes arrived from rank"},
        {"short message", {RP_FAULT_SHORT, 0, 0, false}, {0, 0, 0, false}, RP_ETRANSPORT, "bytes arrived from rank"},
        {"late header", {RP_FAULT_LATE, 0, 1.0, true}, {0, 0, 0, false}, RP_ETIMEOUT, "before the deadline"},
        {"stall mid-round", {RP_FAULT_STALL, 0, 0.6, false}, {0, 0, 0, false}, RP_ETIMEOUT, "before the deadline"},
        {"a failing write at commit", {RP_FAULT_COMMIT_FAIL, 0, 0, false}, {0, 0, 0, false}, RP_ETRANSPORT,
         "the slots it wrote were restored"},
        {"staging corrupted before the commit", {RP_FAULT_CORRUPT_STAGING, 0, 0, false}, {0, 0, 0, false},
         RP_ECHECKSUM, "the slots it wrote were restored"},
        {"two faults on two ranks", {RP_FAULT_CORRUPT, 0, 0, false}, {RP_FAULT_SEND_FAIL, 0, 0, false}, 0,
         "rolled back on every rank"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int32_t cur[2 * 12], tgt[2 * 12];
        for (int l = 0; l < L; l++) w_random_layer(cur + l * S, S, E);
        w_rotate(cur, tgt, L, ep, slots);
        mscene s;
        bool fine = mscene_init(&s, ctx, 2, 2, ep, slots, L, E, cur, tgt, 200, 0) == 0;
        int a = fine ? w_sender(s.mp, (int)c % 4) : 0, b = fine ? w_sender(s.mp, (a + 2) % 4) : 0;
        if (my_rank == a) rp_transport_set_fault(t, &cases[c].f);
        if (cases[c].g.kind != RP_FAULT_NONE && my_rank == b && b != a) rp_transport_set_fault(t, &cases[c].g);
        rp_error err;
        rp_migration_result res;
        rp_status st = fine ? run(&s, t, NULL, 0.4, &err, &res) : RP_EINVAL;
        rp_transport_set_fault(t, NULL);
        /* The same status and message on every rank: compare with rank 0's. */
        int mine[2] = {(int)st, (int)rp_checksum_bytes(err.text, strlen(err.text))}, zero[2];
        memcpy(zero, mine, sizeof zero);
        MPI_Bcast(zero, 2, MPI_INT, 0, MPI_COMM_WORLD);
        if (cases[c].want != RP_OK && st != cases[c].want) printf("# rank %d: %s\n", my_rank, err.text);
        check(st != RP_OK && (cases[c].want == RP_OK || st == cases[c].want) && zero[0] == mine[0] &&
              zero[1] == mine[1], "mpi %s (rank %d): every rank returns %s with the same message", cases[c].name, a,
              rp_strerror(st));
        check(strstr(err.text, cases[c].text) != NULL, "mpi %s: the error says what happened", cases[c].name);
        check(fine && w_gpu_intact(&s.gpu), "mpi %s: every weight byte is intact", cases[c].name);
        check(rp_transport_usable(t), "mpi %s: the transport is still usable", cases[c].name);
        st = fine ? run(&s, t, NULL, 30.0, &err, &res) : RP_EINVAL;
        if (st != RP_OK) printf("# rank %d retry: %s\n", my_rank, err.text);
        check(st == RP_OK && w_gpu_bad_slots(&s.gpu, s.tgt, 3) == 0, "mpi %s: a retry without the fault completes",
              cases[c].name);
        mscene_free(&s);
    }
}

static void test_mismatch(rp_context *ctx, rp_transport *t)
{
    const int L = 2, ep = 4, slots = 3, E = 10, S = ep * slots;
    int32_t cur[2 * 12], tgt[2 * 12], other[2 * 12];
    for (int l = 0; l < L; l++) w_random_layer(cur + l * S, S, E);
    w_rotate(cur, tgt, L, ep, slots);
    w_rotate(tgt, other, L, ep, slots);
    mscene s;
    bool fine = mscene_init(&s, ctx, 2, 2, ep, slots, L, E, cur, tgt, 100, 0) == 0;
    rp_plan *p2 = w_plan(ctx, s.cfg, other);
    rp_migration_plan *mp2 = NULL;
    rp_migration_options o = {s.lay.bytes, 0};
    rp_migration_plan_new(ctx, s.cfg, s.cur, p2, &o, &mp2, NULL);
    rp_error err;
    rp_migration_result res;
    rp_status st = fine ? run(&s, t, my_rank == 2 ? mp2 : NULL, 5.0, &err, &res) : RP_EINVAL;
    check(st == RP_EPLAN && strstr(err.text, "rank 2 has plan hash") != NULL,
          "mpi plan mismatch: every rank refuses and names rank 2");
    check(fine && w_gpu_intact(&s.gpu), "mpi plan mismatch: every byte intact");
    rp_migration_plan_free(mp2);
    rp_plan_free(p2);
    mscene_free(&s);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &my_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &num_ranks);
    if (num_ranks != 4) {
        if (my_rank == 0) printf("1..0 # SKIP needs 4 ranks (mpirun -np 4), has %d\n", num_ranks);
        MPI_Finalize();
        return 0;
    }
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    rp_transport *t = NULL;
    rp_error err;
    rp_status st = rp_transport_mpi_new(ctx, MPI_COMM_WORLD, &t, &err);
    check(st == RP_OK && rp_transport_rank(t) == my_rank && rp_transport_size(t) == 4 &&
          strcmp(rp_transport_name(t), "mpi") == 0 && rp_transport_built("mpi"),
          "mpi transport over MPI_COMM_WORLD");
    if (st == RP_OK) {
        test_wait_op(t);
        test_property(ctx, t);
        test_faults(ctx, t);
        test_more_faults(ctx, t);
        test_mismatch(ctx, t);
        check(rp_transport_usable(t), "mpi transport still usable after every fault");
    }
    rp_transport_free(t);
    rp_context_free(ctx);
    MPI_Finalize();
    return my_rank == 0 ? tap_done() : 0;
}
