/* Throughput of migration over MPI against a plain MPI_Sendrecv of the same bytes in the
 * same run: the MPI transport alone (the executor's batch of MPI_Isend/MPI_Irecv polled
 * with MPI_Test) and the whole executor (agreement, source and destination checksums,
 * staging, commit). Run by hand: mpirun -np 4 build/tests/mpi/bench_migrate_mpi [MiB per
 * expert]. Every rank hands its slots' experts to the previous rank at every layer.
 * Figures only; nothing is asserted. */
#include "routepack/routepack.h"
#include "routepack/migrate_mpi.h"
#include "transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 4, SLOTS = 4, TENSORS = 2, REPS = 5 };

static int rank, size;

/* Wall time of the slowest rank for one run of fn, started together. */
static double timed(void (*fn)(void *), void *arg)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    fn(arg);
    double t = MPI_Wtime() - t0, worst = 0;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

typedef struct bench {
    size_t tensor;              /* bytes of one tensor */
    unsigned char *slots;       /* [LAYERS][SLOTS][TENSORS] tensors */
    unsigned char *recv;        /* as much again, for the baselines */
    rp_transport *t;
    rp_registry *reg;
    rp_migration_plan *there, *back;
    int forward;
    rp_migration_exec_options opts; /* with or without a staging buffer of the caller's */
    rp_status st;
    rp_error err;
    rp_migration_result res;
} bench;

static unsigned char *tensor_at(bench *b, unsigned char *base, int l, int k, int i)
{
    return base + (((size_t)l * SLOTS + k) * TENSORS + i) * b->tensor;
}

static void run_sendrecv(void *arg)
{
    bench *b = arg;
    int to = (rank + size - 1) % size, from = (rank + 1) % size;
    for (int l = 0; l < LAYERS; l++)
        for (int k = 0; k < SLOTS; k++)
            for (int i = 0; i < TENSORS; i++)
                MPI_Sendrecv(tensor_at(b, b->slots, l, k, i), (int)b->tensor, MPI_BYTE, to, 7,
                             tensor_at(b, b->recv, l, k, i), (int)b->tensor, MPI_BYTE, from, 7, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
}

static void run_transport(void *arg)
{
    bench *b = arg;
    int to = (rank + size - 1) % size, from = (rank + 1) % size, n = 0;
    rp_transport_op ops[2 * LAYERS * SLOTS * TENSORS];
    for (int l = 0; l < LAYERS; l++)
        for (int k = 0; k < SLOTS; k++)
            for (int i = 0; i < TENSORS; i++) {
                int tag = (l * SLOTS + k) * TENSORS + i;
                ops[n++] = (rp_transport_op){from, tag, false, true, tensor_at(b, b->recv, l, k, i), b->tensor};
                ops[n++] = (rp_transport_op){to, tag, true, true, tensor_at(b, b->slots, l, k, i), b->tensor};
            }
    int32_t failed;
    b->st = b->t->vt->start(b->t, ops, n, &failed, &b->err);
    if (b->st == RP_OK) b->st = b->t->vt->wait(b->t, rp_now_s() + 60, &failed, &b->err);
    b->t->vt->finish(b->t);
}

static void run_executor(void *arg)
{
    bench *b = arg;
    b->st = rp_migration_execute(b->forward ? b->there : b->back, b->reg, b->t, &b->opts, &b->res, &b->err);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    double mib = argc > 1 ? atof(argv[1]) : 4.0;
    if (size < 2 || !(mib > 0)) {
        if (rank == 0) printf("bench_migrate_mpi: needs at least 2 ranks and a positive size\n");
        MPI_Finalize();
        return 1;
    }
    bench b;
    memset(&b, 0, sizeof b);
    b.tensor = (size_t)(mib * 1048576.0 / TENSORS);
    size_t total = (size_t)LAYERS * SLOTS * TENSORS * b.tensor;
    b.slots = malloc(total);
    b.recv = malloc(total);
    memset(b.slots, rank + 1, total);
    memset(b.recv, 0, total);

    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    char json[512];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 8,"
             " \"expert_ffn_size\": 4, \"num_heads\": 1, \"head_dim\": 8},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}", size, size, SLOTS, LAYERS, size * SLOTS);
    rp_config *cfg = NULL;
    rp_error err;
    rp_status st = rp_config_parse(ctx, json, strlen(json), "<bench>", &cfg, &err);
    rp_plan *cur = NULL, *tgt = NULL;
    if (st == RP_OK) st = rp_plan_new(ctx, cfg, 1, &cur, &err);
    if (st == RP_OK) st = rp_plan_new(ctx, cfg, 1, &tgt, &err);
    const int S = size * SLOTS;
    int32_t *row = malloc((size_t)S * sizeof *row), *trow = malloc((size_t)S * sizeof *trow);
    for (int s = 0; s < S; s++) {
        row[s] = s;
        trow[s] = (s + SLOTS) % S; /* the next rank's experts */
    }
    for (int l = 0; l < LAYERS && st == RP_OK; l++) {
        rp_plan_set_phy2log(cur, l, row, NULL);
        rp_plan_set_phy2log(tgt, l, trow, NULL);
    }
    int64_t bytes[LAYERS];
    for (int l = 0; l < LAYERS; l++) bytes[l] = (int64_t)(TENSORS * b.tensor);
    rp_migration_options o = {bytes, 0};
    if (st == RP_OK) st = rp_migration_plan_new(ctx, cfg, cur, tgt, &o, &b.there, &err);
    if (st == RP_OK) st = rp_migration_plan_new(ctx, cfg, tgt, cur, &o, &b.back, &err);
    if (st == RP_OK) st = rp_registry_new(ctx, LAYERS, SLOTS, &b.reg, &err);
    for (int l = 0; l < LAYERS && st == RP_OK; l++)
        for (int k = 0; k < SLOTS; k++) {
            rp_tensor ts[TENSORS];
            for (int i = 0; i < TENSORS; i++) ts[i] = (rp_tensor){tensor_at(&b, b.slots, l, k, i), b.tensor, RP_MEMORY_HOST};
            rp_registry_set(b.reg, l, k, ts, TENSORS, NULL);
        }
    if (st == RP_OK) st = rp_registry_set_placement(b.reg, cur, rank, 0, &err);
    if (st == RP_OK) st = rp_transport_mpi_new(ctx, MPI_COMM_WORLD, &b.t, &err);
    if (st != RP_OK) {
        printf("bench_migrate_mpi: rank %d: %s\n", rank, err.text);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    /* A trainer that keeps a staging buffer between steps passes it; otherwise each call
     * allocates (and the kernel zero-fills) it afresh. */
    rp_migration_gpu gs;
    rp_migration_plan_gpu(b.there, rank, &gs, NULL);
    void *staging = malloc((size_t)gs.staging_bytes);
    memset(staging, 0, (size_t)gs.staging_bytes);
    double best_sr = 1e30, best_tr = 1e30, best_ex = 1e30, best_own = 1e30;
    int failures = 0;
    for (int rep = 0; rep < REPS; rep++) {
        double t = timed(run_sendrecv, &b);
        if (t < best_sr) best_sr = t;
        t = timed(run_transport, &b);
        failures += b.st != RP_OK;
        if (t < best_tr) best_tr = t;
        for (int own = 0; own < 2; own++) {
            rp_migration_exec_defaults(&b.opts);
            if (own) {
                b.opts.staging = staging;
                b.opts.staging_bytes = (size_t)gs.staging_bytes;
            }
            b.forward = 1;
            t = timed(run_executor, &b);
            failures += b.st != RP_OK;
            if (own && t < best_ex) best_ex = t;
            if (!own && t < best_own) best_own = t;
            b.forward = 0;
            timed(run_executor, &b); /* back, so the next run moves again */
            failures += b.st != RP_OK;
        }
    }
    free(staging);
    if (failures && b.st != RP_OK) printf("bench_migrate_mpi: rank %d: %s\n", rank, b.err.text);
    int64_t used = b.res.staging_bytes, max_staging = 0;
    MPI_Reduce(&used, &max_staging, 1, MPI_INT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        double per_rank = (double)total / 1e9;
        printf("migration over MPI, %d ranks: each rank sends and receives %.1f MB per run (%d layers x %d slots,"
               " experts of %.2f MiB in %d tensors), best of %d\n", size, total / 1e6, LAYERS, SLOTS, mib, TENSORS,
               REPS);
        printf("  MPI_Sendrecv, same messages   %7.2f GB/s per rank\n", per_rank / best_sr);
        printf("  RoutePack MPI transport       %7.2f GB/s per rank   transport / Sendrecv %.2f\n",
               per_rank / best_tr, best_sr / best_tr);
        printf("  RoutePack executor            %7.2f GB/s per rank   executor / Sendrecv  %.2f  (staging passed in)\n",
               per_rank / best_ex, best_sr / best_ex);
        printf("  RoutePack executor            %7.2f GB/s per rank   executor / Sendrecv  %.2f  (staging allocated per "
               "call)\n", per_rank / best_own, best_sr / best_own);
        printf("  (the executor also hashes every byte at its source, stages it, swaps it into its slot as it\n"
               "   arrives, hashing it there, and keeps the round only if every rank checked its slots; else\n"
               "   every rank swaps them back)\n");
        printf("  staging per rank              %7.1f MB\n", max_staging / 1e6);
        if (failures) printf("  %d runs failed\n", failures);
    }
    rp_transport_free(b.t);
    rp_registry_free(b.reg);
    rp_migration_plan_free(b.there);
    rp_migration_plan_free(b.back);
    rp_plan_free(cur);
    rp_plan_free(tgt);
    rp_config_free(cfg);
    rp_context_free(ctx);
    free(row);
    free(trow);
    free(b.slots);
    free(b.recv);
    MPI_Finalize();
    return 0;
}
