/* Multi-rank plan agreement over MPI (run with 4 ranks by tests/test_mpi.c): identical
 * inputs agree without a broadcast; a rank with other params, or a rank whose policy
 * falls back, ends up with rank 0's plan and every report says so; a swap staged for
 * step 3 takes effect at step 3 on every rank. Rank 0 prints TAP lines. */
#include "routepack/mpi.h"
#include "routepack/routepack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 5

typedef struct rank_result {
    uint64_t hash[STEPS];
    uint64_t policy_hash[STEPS];
    int32_t disagreed[STEPS], from_rank[STEPS], fallback[STEPS], swapped[STEPS];
    int32_t failed;
    char error[256];
} rank_result;

static int tests, failures;
static rp_batch *batches[STEPS];
static rp_routing routings[STEPS];
static void *ids[STEPS];

static void tap(int pass, const char *what)
{
    printf("%sok %d - %s\n", pass ? "" : "not ", ++tests, what);
    if (!pass) failures++;
    fflush(stdout);
}

/* Run STEPS steps of `policy` (params, limit, staged swap as given) on this rank. */
static void run(rp_context *ctx, const rp_config *cfg, const rp_comm *comm, const char *policy,
                const char *params, int64_t max_instructions, const char *stage, int64_t stage_at, rank_result *out)
{
    memset(out, 0, sizeof *out);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy;
    o.params_json = params;
    o.num_threads = 1;
    o.comm = comm;
    o.max_instructions = max_instructions;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) {
        out->failed = 1;
        snprintf(out->error, sizeof out->error, "new: %.200s", err.text);
        return;
    }
    if (stage && rp_sched_stage_policy(s, stage, NULL, stage_at, &err) != RP_OK) {
        out->failed = 1;
        snprintf(out->error, sizeof out->error, "stage: %.200s", err.text);
    }
    for (int step = 0; step < STEPS && !out->failed; step++) {
        const rp_plan *plan;
        const rp_step_report *rep;
        if (rp_sched_step(s, step, batches[step], &routings[step], &plan, &rep, &err) != RP_OK) {
            out->failed = 1;
            snprintf(out->error, sizeof out->error, "step %d: %.200s", step, err.text);
        } else {
            out->hash[step] = rp_plan_hash(plan);
            out->policy_hash[step] = rep->policy_hash;
            out->disagreed[step] = rep->ranks_disagreed;
            out->from_rank[step] = rep->plan_from_rank;
            out->fallback[step] = rep->fallback;
            out->swapped[step] = rep->swapped;
        }
    }
    rp_sched_free(s);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    rp_context *ctx = NULL;
    rp_config *cfg = NULL;
    rp_gen *gen = NULL;
    rp_error err;
    rp_comm comm;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK ||
        rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK ||
        rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK ||
        rp_comm_mpi(&comm, MPI_COMM_WORLD) != RP_OK) {
        fprintf(stderr, "rank %d: setup failed\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int t = 0; t < STEPS; t++) {
        rp_routing r;
        if (rp_gen_step(gen, t, &batches[t], &r, &err) != RP_OK) MPI_Abort(MPI_COMM_WORLD, 1);
        size_t n = (size_t)rp_batch_num_tokens(batches[t]) * (size_t)r.num_layers * (size_t)r.top_k * (size_t)r.width;
        ids[t] = malloc(n);
        memcpy(ids[t], r.base, n);
        rp_routing_packed(&routings[t], r.width, r.num_layers, r.top_k, ids[t]);
    }
    rank_result mine, *all = malloc(sizeof *all * (size_t)size);
    if (rank == 0) printf("# %d ranks\n", size);
    int ok_comm = comm.size == size && comm.rank == rank, all_ok_comm = 0;
    MPI_Reduce(&ok_comm, &all_ok_comm, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
    if (rank == 0) tap(all_ok_comm, "rp_comm_mpi reports each rank's rank and the size");

    /* 1. identical inputs: identical plans, no broadcast needed */
    run(ctx, cfg, &comm, "token_kk+eplb", NULL, 0, NULL, -1, &mine);
    MPI_Gather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        int same = 1, agreed = 1, ran = 1;
        for (int q = 0; q < size; q++) {
            if (all[q].failed) ran = 0, printf("# rank %d: %s\n", q, all[q].error);
            for (int t = 0; t < STEPS; t++) {
                same &= all[q].hash[t] == all[0].hash[t];
                agreed &= !all[q].disagreed[t] && all[q].from_rank[t] == 0 && !all[q].fallback[t];
            }
        }
        tap(ran, "identical inputs: every rank ran 5 steps");
        tap(same, "identical inputs: the same plan hash on every rank at every step");
        tap(agreed, "identical inputs: no rank reports a disagreement");
    }

    /* 2. rank 2 runs the packing with other params: everyone takes rank 0's plan */
    run(ctx, cfg, &comm, "token_kk+eplb", rank == 2 ? "{\"token_kk\": {\"equal_size\": false}}" : NULL, 0, NULL,
        -1, &mine);
    rank_result *before = malloc(sizeof *before * (size_t)size);
    memcpy(before, all, sizeof *all * (size_t)size);
    MPI_Gather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        int same = 1, said = 1, ran = 1;
        for (int q = 0; q < size; q++) {
            if (all[q].failed) ran = 0, printf("# rank %d: %s\n", q, all[q].error);
            for (int t = 0; t < STEPS; t++) {
                same &= all[q].hash[t] == before[0].hash[t];
                said &= all[q].disagreed[t] && all[q].from_rank[t] == 0;
            }
        }
        tap(ran, "other params on rank 2: every rank ran 5 steps");
        tap(same, "other params on rank 2: every rank uses rank 0's plan");
        tap(said, "other params on rank 2: every report says the ranks disagreed and the plan came from rank 0");
    }

    /* 3. rank 2's policy falls back (an instruction limit it alone has) */
    run(ctx, cfg, &comm, "token_kk+eplb", NULL, rank == 2 ? 100 : 0, NULL, -1, &mine);
    MPI_Gather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        int same = 1, said = 1, fell = 1, ran = 1;
        for (int q = 0; q < size; q++) {
            if (all[q].failed) ran = 0, printf("# rank %d: %s\n", q, all[q].error);
            for (int t = 0; t < STEPS; t++) {
                same &= all[q].hash[t] == before[0].hash[t];
                said &= all[q].disagreed[t] && all[q].from_rank[t] == 0;
                fell &= all[q].fallback[t] == (q == 2);
            }
        }
        tap(ran, "fallback on rank 2: every rank ran 5 steps");
        tap(fell, "fallback on rank 2: only rank 2 reports a fallback");
        tap(same && said, "fallback on rank 2: every rank uses rank 0's plan and says so");
    }

    /* 4. a swap staged for step 3 takes effect at step 3 on every rank */
    run(ctx, cfg, &comm, "token_kk", NULL, 0, "attn_kk", 3, &mine);
    MPI_Gather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        int at3 = 1, same = 1, ran = 1;
        for (int q = 0; q < size; q++) {
            if (all[q].failed) ran = 0, printf("# rank %d: %s\n", q, all[q].error);
            for (int t = 0; t < STEPS; t++) {
                at3 &= all[q].swapped[t] == (t == 3);
                at3 &= (all[q].policy_hash[t] == all[q].policy_hash[0]) == (t < 3);
                same &= all[q].hash[t] == all[0].hash[t] && !all[q].disagreed[t];
            }
        }
        tap(ran, "staged swap: every rank ran 5 steps");
        tap(at3, "staged swap: the new policy runs from step 3 on, on every rank");
        tap(same, "staged swap: the ranks agree at every step");
    }

    if (rank == 0) printf("1..%d\n", tests);
    free(all);
    free(before);
    for (int t = 0; t < STEPS; t++) {
        rp_batch_free(batches[t]);
        free(ids[t]);
    }
    rp_gen_free(gen);
    rp_config_free(cfg);
    rp_context_free(ctx);
    MPI_Finalize();
    return rank == 0 && failures ? 1 : 0;
}
