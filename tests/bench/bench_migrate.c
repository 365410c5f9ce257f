/* Migration at the reference scale (64 GPUs on 8 nodes, EP 8, 48 layers x 128 experts,
 * 18 slots per GPU, experts of 3 d f (2 + 12) bytes): bytes moved against the minimum
 * and against a slot-by-slot copier, planner time, rounds under a staging budget; and
 * the in-process executor's throughput with small synthetic experts against memcpy of
 * the same bytes in the same run. Figures only; nothing is asserted. */
#include "routepack/routepack.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t rng = 0x243F6A8885A308D3ULL;
static uint32_t rnd(uint32_t n)
{
    uint64_t z = (rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (uint32_t)((z ^ (z >> 31)) % n);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A valid placement of one layer: every expert once, spare slots hold replicas of
 * experts not yet on that GPU, shuffled over the group's slots and then per GPU. */
static void random_layer(int32_t *row, int ep, int slots, int E)
{
    const int S = ep * slots;
    for (int i = 0; i < S; i++) row[i] = i < E ? i : -1;
    for (int i = S - 1; i > 0; i--) {
        int j = (int)rnd((uint32_t)i + 1), t = row[i];
        row[i] = row[j];
        row[j] = t;
    }
    for (int s = 0; s < S; s++) {
        if (row[s] >= 0) continue;
        int r = s / slots, e;
        bool on_gpu;
        do {
            e = (int)rnd((uint32_t)E);
            on_gpu = false;
            for (int k = 0; k < slots; k++) on_gpu |= row[r * slots + k] == e;
        } while (on_gpu);
        row[s] = e;
    }
}

/* A rebalance: `moves` spare-slot replicas per layer change expert. */
static void rebalance_layer(const int32_t *cur, int32_t *tgt, int ep, int slots, int E, int moves)
{
    const int S = ep * slots;
    memcpy(tgt, cur, (size_t)S * sizeof *tgt);
    int32_t *count = calloc((size_t)E, sizeof *count);
    for (int s = 0; s < S; s++) count[tgt[s]]++;
    for (int m = 0; m < moves; m++) {
        int s = (int)rnd((uint32_t)S);
        if (count[tgt[s]] < 2) continue; /* only a replica may leave */
        int r = s / slots, e;
        bool on_gpu;
        do {
            e = (int)rnd((uint32_t)E);
            on_gpu = false;
            for (int k = 0; k < slots; k++) on_gpu |= tgt[r * slots + k] == e;
        } while (on_gpu);
        count[tgt[s]]--;
        tgt[s] = e;
        count[e]++;
    }
    free(count);
}

static void planner_figures(rp_context *ctx, const rp_config *cfg, const char *name, rp_plan *cur, rp_plan *tgt)
{
    const rp_topology *topo = rp_config_topology(cfg);
    rp_error err;
    rp_migration_plan *mp = NULL;
    const int reps = 5;
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        rp_migration_plan_free(mp);
        mp = NULL;
        double t0 = now();
        if (rp_migration_plan_new(ctx, cfg, cur, tgt, NULL, &mp, &err) != RP_OK) {
            printf("  %s: %s\n", name, err.text);
            return;
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    rp_migration_summary s;
    rp_migration_plan_summary(mp, &s);
    /* A slot-by-slot copier: every slot whose expert changes is fetched over a link. */
    int64_t naive = 0;
    int64_t bytes = rp_migration_plan_expert_bytes(mp, 0);
    for (int32_t l = 0; l < rp_plan_num_layers(cur); l++) {
        const int32_t *c = rp_plan_phy2log(cur, l), *t = rp_plan_phy2log(tgt, l);
        for (int32_t k = 0; k < rp_plan_total_slots(cur); k++)
            if (t[k] >= 0 && t[k] != c[k]) naive += (int64_t)topo->num_ep_groups * bytes;
    }
    printf("  %s\n", name);
    printf("    bytes moved / minimum      %.4f  (%.2f GB moved, %.2f GB minimum)\n",
           s.min_bytes ? (double)s.moved_bytes / (double)s.min_bytes : 1.0, s.moved_bytes / 1e9, s.min_bytes / 1e9);
    printf("    slot-by-slot copier / min  %.3f  (%.2f GB: fetching every changed slot)\n",
           s.min_bytes ? (double)naive / (double)s.min_bytes : 1.0, naive / 1e9);
    printf("    copies                     %lld between GPUs (%.2f GB NVLink, %.2f GB network), %lld inside\n",
           (long long)s.transfers, s.bytes[RP_LINK_NVLINK] / 1e9, s.bytes[RP_LINK_NET] / 1e9,
           (long long)s.local_copies);
    printf("    planner time               %.2f ms (best of %d)\n", best * 1e3, reps);
    printf("    one round: staging         %.2f GB on the busiest GPU; predicted %.3f s\n",
           s.max_staging_bytes / 1e9, s.predicted_s);
    int64_t budgets[2] = {(int64_t)2 << 30, s.min_budget_bytes};
    for (int b = 0; b < 2; b++) {
        if (budgets[b] < s.min_budget_bytes) continue;
        rp_migration_options o = {NULL, budgets[b]};
        rp_migration_plan *mb = NULL;
        if (rp_migration_plan_new(ctx, cfg, cur, tgt, &o, &mb, &err) != RP_OK) continue;
        rp_migration_summary sb;
        rp_migration_plan_summary(mb, &sb);
        printf("    budget %6.2f GB           %d rounds, staging %.2f GB, predicted %.3f s\n", budgets[b] / 1e9,
               sb.num_rounds, sb.max_staging_bytes / 1e9, sb.predicted_s);
        rp_migration_plan_free(mb);
    }
    rp_migration_plan_free(mp);
}

/* ---- in-process executor throughput ---- */

typedef struct worker {
    const rp_migration_plan *mp;
    rp_registry *reg;
    rp_transport *t;
    rp_status st;
    rp_migration_result res;
    rp_error err;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    w->st = rp_migration_execute(w->mp, w->reg, w->t, NULL, &w->res, &w->err);
    return NULL;
}

typedef struct copier { unsigned char *dst, *src; size_t bytes; } copier;
static void *copy_work(void *arg)
{
    copier *c = arg;
    memcpy(c->dst, c->src, c->bytes);
    return NULL;
}

static void executor_figures(rp_context *ctx)
{
    enum { G = 4, L = 8, E = 16, SLOTS = 5 };
    const size_t tensor = 512 << 10; /* two tensors of 512 KiB: 1 MiB experts */
    char json[512];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 8,"
             " \"expert_ffn_size\": 4, \"num_heads\": 1, \"head_dim\": 8},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}", G, G, SLOTS, L, E);
    rp_config *cfg = NULL;
    rp_config_parse(ctx, json, strlen(json), "<bench>", &cfg, NULL);
    rp_plan *cur = NULL, *tgt = NULL;
    rp_plan_new(ctx, cfg, 1, &cur, NULL);
    rp_plan_new(ctx, cfg, 1, &tgt, NULL);
    int32_t row[G * SLOTS], trow[G * SLOTS];
    for (int l = 0; l < L; l++) {
        random_layer(row, G, SLOTS, E);
        random_layer(trow, G, SLOTS, E);
        rp_plan_set_phy2log(cur, l, row, NULL);
        rp_plan_set_phy2log(tgt, l, trow, NULL);
    }
    rp_plan_stabilize_slots(tgt, cur, NULL);
    int64_t bytes[L];
    for (int l = 0; l < L; l++) bytes[l] = 2 * (int64_t)tensor;
    rp_migration_options o = {bytes, 0};
    rp_migration_plan *mp = NULL;
    rp_migration_plan_new(ctx, cfg, cur, tgt, &o, &mp, NULL);
    rp_migration_summary s;
    rp_migration_plan_summary(mp, &s);
    unsigned char *mem[G];
    rp_registry *reg[G];
    for (int g = 0; g < G; g++) {
        mem[g] = malloc((size_t)L * SLOTS * 2 * tensor);
        memset(mem[g], g + 1, (size_t)L * SLOTS * 2 * tensor);
        rp_registry_new(ctx, L, SLOTS, &reg[g], NULL);
        for (int l = 0; l < L; l++)
            for (int k = 0; k < SLOTS; k++) {
                unsigned char *p = mem[g] + ((size_t)l * SLOTS + k) * 2 * tensor;
                rp_tensor ts[2] = {{p, tensor, RP_MEMORY_HOST}, {p + tensor, tensor, RP_MEMORY_HOST}};
                rp_registry_set(reg[g], l, k, ts, 2, NULL);
            }
        rp_registry_set_placement(reg[g], cur, g, 0, NULL);
    }
    rp_local_hub *hub = NULL;
    rp_local_hub_new(ctx, G, &hub, NULL);
    worker w[G];
    for (int g = 0; g < G; g++) {
        memset(&w[g], 0, sizeof w[g]);
        w[g].mp = mp;
        w[g].reg = reg[g];
        rp_transport_local_new(hub, g, &w[g].t, NULL);
    }
    /* Move there and back: the second plan is the reverse (so every run moves). */
    rp_migration_plan *back = NULL;
    rp_migration_plan_new(ctx, cfg, tgt, cur, &o, &back, NULL);
    double best = 1e30;
    int64_t staging = 0;
    for (int rep = 0; rep < 6; rep++) {
        for (int g = 0; g < G; g++) w[g].mp = rep % 2 ? back : mp;
        pthread_t th[G];
        double t0 = now();
        for (int g = 0; g < G; g++) pthread_create(&th[g], NULL, work, &w[g]);
        for (int g = 0; g < G; g++) pthread_join(th[g], NULL);
        double t = now() - t0;
        for (int g = 0; g < G; g++)
            if (w[g].st != RP_OK) printf("  executor failed: %s\n", w[g].err.text);
        if (rep % 2 == 0 && t < best) best = t;
        for (int g = 0; g < G; g++)
            if (w[g].res.staging_bytes > staging) staging = w[g].res.staging_bytes;
    }
    /* Baseline: each rank memcpy's the bytes it receives, once, on its own thread. */
    int64_t total = s.moved_bytes + s.bytes[RP_LINK_LOCAL];
    copier cp[G];
    unsigned char *scratch[G];
    for (int g = 0; g < G; g++) {
        rp_migration_gpu gs;
        rp_migration_plan_gpu(mp, g, &gs, NULL);
        cp[g].bytes = (size_t)(gs.received[RP_LINK_NVLINK] + gs.received[RP_LINK_NET] + gs.received[RP_LINK_LOCAL]);
        scratch[g] = malloc(cp[g].bytes + 1);
        memset(scratch[g], 0, cp[g].bytes + 1);
        cp[g].dst = scratch[g];
        cp[g].src = mem[(g + 1) % G];
    }
    double base = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        pthread_t th[G];
        double t0 = now();
        for (int g = 0; g < G; g++) pthread_create(&th[g], NULL, copy_work, &cp[g]);
        for (int g = 0; g < G; g++) pthread_join(th[g], NULL);
        double t = now() - t0;
        if (t < base) base = t;
    }
    printf("  in-process executor, 4 ranks as threads, %d layers, 1 MiB experts in 2 tensors\n", L);
    printf("    moved %.1f MB between ranks + %.1f MB inside, in %.1f ms: %.2f GB/s (best of 3)\n",
           s.moved_bytes / 1e6, s.bytes[RP_LINK_LOCAL] / 1e6, best * 1e3, total / best / 1e9);
    printf("    memcpy of the same bytes once, same threads: %.2f GB/s; executor / memcpy %.2f\n",
           total / base / 1e9, base / best);
    printf("    (the executor copies each byte into staging, swaps it with the slot's old bytes so that the\n"
           "     commit can be undone, and hashes it three times: at the source, staged, and in the slot)\n");
    printf("    staging per rank: %.1f MB\n", staging / 1e6);
    for (int g = 0; g < G; g++) {
        rp_transport_free(w[g].t);
        rp_registry_free(reg[g]);
        free(mem[g]);
        free(scratch[g]);
    }
    rp_local_hub_free(hub);
    rp_migration_plan_free(mp);
    rp_migration_plan_free(back);
    rp_plan_free(cur);
    rp_plan_free(tgt);
    rp_config_free(cfg);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-reference.json", &cfg, &err) != RP_OK) {
        printf("bench_migrate: %s\n", err.text);
        return 1;
    }
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    const int ep = t->ep_size, slots = t->slots[0], E = m->num_experts, L = m->num_layers;
    printf("migration at the reference scale: %d GPUs on %d nodes, EP %d, %d layers x %d experts, %d slots per GPU,"
           " %.1f MB per expert\n", t->num_gpus, t->num_nodes, ep, L, E, slots,
           3.0 * m->hidden_size * m->expert_ffn_size * (m->bytes_per_param + m->bytes_per_optimizer_state) / 1e6);
    rp_plan *cur = NULL, *rand_tgt = NULL, *rebal = NULL;
    rp_plan_new(ctx, cfg, 1, &cur, NULL);
    rp_plan_new(ctx, cfg, 1, &rand_tgt, NULL);
    rp_plan_new(ctx, cfg, 1, &rebal, NULL);
    int32_t *row = malloc((size_t)ep * slots * sizeof *row), *trow = malloc((size_t)ep * slots * sizeof *trow);
    for (int l = 0; l < L; l++) {
        random_layer(row, ep, slots, E);
        rp_plan_set_phy2log(cur, l, row, NULL);
        rebalance_layer(row, trow, ep, slots, E, 8);
        rp_plan_set_phy2log(rebal, l, trow, NULL);
        random_layer(trow, ep, slots, E);
        rp_plan_set_phy2log(rand_tgt, l, trow, NULL);
    }
    planner_figures(ctx, cfg, "random target placement, as given (slot order not stabilised)", cur, rand_tgt);
    rp_plan_stabilize_slots(rand_tgt, cur, NULL);
    planner_figures(ctx, cfg, "random target placement, slots stabilised (rp_plan_stabilize_slots)", cur, rand_tgt);
    planner_figures(ctx, cfg, "rebalance: up to 8 replicas per layer change expert", cur, rebal);
    executor_figures(ctx);
    free(row);
    free(trow);
    rp_plan_free(cur);
    rp_plan_free(rand_tgt);
    rp_plan_free(rebal);
    rp_config_free(cfg);
    rp_context_free(ctx);
    return 0;
}
