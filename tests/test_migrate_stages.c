/* Migration under pipeline parallelism: a layer's experts live on the GPUs of the stage
 * holding it, so the migration plan moves them between that stage's GPUs (physical DP
 * ranks s * G + g), each stage fills its own rounds, the stages migrate at once (a round
 * takes its busiest GPU of any stage, not the sum), and the executor moves each rank's
 * own stage's layers only, from a registry that holds just those. */
#include "migrate_scene.h"

#include <math.h>

static rp_context *ctx;

/* 1 node of `gpn` GPUs in `pp` stages, EP 2, one slot per EP rank, 2 experts. */
static rp_config *pp_config(int gpn, int pp, int layers)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": %d, \"pipeline_parallel_size\": %d,"
             " \"ep_size\": 2, \"slots_per_gpu\": 1},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": 2, \"top_k\": 1, \"hidden_size\": 8,"
             " \"expert_ffn_size\": 4, \"num_heads\": 1, \"head_dim\": 8},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}",
             gpn, pp, layers);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) {
        diag("config: %s", err.text);
        return NULL;
    }
    return cfg;
}

/* Placements where EP ranks 0 and 1 swap their experts at every layer. */
static void swap_rows(int layers, int32_t *cur, int32_t *tgt)
{
    for (int l = 0; l < layers; l++) {
        cur[2 * l] = 0;
        cur[2 * l + 1] = 1;
        tgt[2 * l] = 1;
        tgt[2 * l + 1] = 0;
    }
}

/* A GPU that sends and receives `b` bytes over NVLink and writes one slot of them. */
static double nv_time(const rp_config *cfg, double b)
{
    const rp_topology *t = rp_config_topology(cfg);
    return b / t->nvlink_bytes_per_s + t->nvlink_latency_s + 2 * b / rp_config_hardware(cfg)->hbm_bytes_per_s;
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b); }

static void test_plan(void)
{
    rp_error err;
    rp_config *pp = pp_config(4, 2, 2), *one = pp_config(2, 1, 2);
    int32_t cur[4], tgt[4];
    swap_rows(2, cur, tgt);
    rp_plan *pc = w_plan(ctx, pp, cur), *pt = w_plan(ctx, pp, tgt);
    rp_plan *oc = w_plan(ctx, one, cur), *ot = w_plan(ctx, one, tgt);
    const int64_t bytes[2] = {1000000, 3000000};
    rp_migration_options o = {bytes, 0};
    rp_migration_plan *mp = NULL, *m1 = NULL;
    if (!pc || !pt || !oc || !ot || rp_migration_plan_new(ctx, pp, pc, pt, &o, &mp, &err) != RP_OK ||
        rp_migration_plan_new(ctx, one, oc, ot, &o, &m1, &err) != RP_OK) {
        diag("%s", err.text);
        skip(8, "no plan");
        goto out;
    }
    ok(rp_migration_plan_num_gpus(mp) == 4 && rp_migration_plan_num_stages(mp) == 2 &&
           rp_migration_plan_layer_stage(mp, 0) == 0 && rp_migration_plan_layer_stage(mp, 1) == 1 &&
           rp_migration_plan_layer_stage(mp, 2) == -1 && rp_migration_plan_num_stages(m1) == 1,
       "PP 2: the plan spans both stages' 2 DP ranks (4 GPUs), layer 0 on stage 0, layer 1 on stage 1");
    /* transfers by round, layer, group, destination: layer 0 into GPUs 0 and 1, layer 1
     * into GPUs 2 and 3 */
    const int32_t want_src[4] = {1, 0, 3, 2}, want_dst[4] = {0, 1, 2, 3};
    bool placed = rp_migration_plan_num_transfers(mp) == 4;
    for (int64_t i = 0; placed && i < 4; i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(mp, i, &t, NULL);
        placed = t.layer == (int32_t)i / 2 && t.src_gpu == want_src[i] && t.dst_gpu == want_dst[i] &&
                 t.link == RP_LINK_NVLINK && t.round == 0 && t.bytes == bytes[i / 2];
    }
    ok(placed, "each layer's copies run between its own stage's GPUs (0 <-> 1 for layer 0, 2 <-> 3 for layer 1)");
    bool writes = rp_migration_plan_num_writes(mp) == 4;
    for (int64_t i = 0; writes && i < 4; i++) {
        rp_migration_write w;
        rp_migration_plan_write(mp, i, &w, NULL);
        writes = w.gpu == want_dst[i] && w.slot == 0 && w.transfer == i;
    }
    ok(writes, "and write the slots of that stage's GPUs");
    rp_migration_summary s, s1;
    rp_migration_plan_summary(mp, &s);
    rp_migration_plan_summary(m1, &s1);
    /* the stages migrate at once: max of the stages, not their sum */
    const double t0 = nv_time(pp, 1e6), t1 = nv_time(pp, 3e6);
    ok(close_to(s.predicted_s, t1) && s.num_rounds == 1 && s.moved_bytes == 8000000,
       "time = the slowest stage's, %.6g us (stage 0 %.6g us, stage 1 %.6g us; the sum would be %.6g us)",
       s.predicted_s * 1e6, t0 * 1e6, t1 * 1e6, (t0 + t1) * 1e6);
    ok(close_to(s1.predicted_s, nv_time(one, 4e6)) && s1.moved_bytes == s.moved_bytes,
       "PP 1 on one stage's 2 GPUs: the same bytes, one GPU receives both layers (%.6g us)", s1.predicted_s * 1e6);
    rp_migration_gpu g2, g0;
    ok(rp_migration_plan_gpu(mp, 2, &g2, &err) == RP_OK && rp_migration_plan_gpu(mp, 0, &g0, NULL) == RP_OK &&
           g2.received[RP_LINK_NVLINK] == 3000000 && g0.received[RP_LINK_NVLINK] == 1000000 &&
           g2.staging_bytes == 3000000 && close_to(g2.predicted_s, t1),
       "per-GPU figures of stage 1's GPU 2: its layer's bytes and staging only");
    ok(rp_migration_plan_gpu(mp, 4, &g2, &err) == RP_EINVAL && strstr(err.text, "the plan has 4 GPUs"),
       "GPU 4 is out of range: %s", err.text);
    ok(rp_migration_plan_hash(mp) != rp_migration_plan_hash(m1), "the stages are part of the plan's hash");
out:
    rp_migration_plan_free(mp);
    rp_migration_plan_free(m1);
    rp_plan_free(pc);
    rp_plan_free(pt);
    rp_plan_free(oc);
    rp_plan_free(ot);
    rp_config_free(pp);
    rp_config_free(one);
}

/* A staging budget of one layer: each stage fills its own rounds, and round k of every
 * stage runs at once. */
static void test_rounds(void)
{
    rp_error err;
    rp_config *pp = pp_config(4, 2, 4), *one = pp_config(2, 1, 4);
    int32_t cur[8], tgt[8];
    swap_rows(4, cur, tgt);
    rp_plan *pc = w_plan(ctx, pp, cur), *pt = w_plan(ctx, pp, tgt);
    rp_plan *oc = w_plan(ctx, one, cur), *ot = w_plan(ctx, one, tgt);
    const int64_t bytes[4] = {1000000, 4000000, 3000000, 2000000};
    rp_migration_options o = {bytes, 4000000};
    rp_migration_plan *mp = NULL, *m1 = NULL;
    if (!pc || !pt || !oc || !ot || rp_migration_plan_new(ctx, pp, pc, pt, &o, &mp, &err) != RP_OK ||
        rp_migration_plan_new(ctx, one, oc, ot, &o, &m1, &err) != RP_OK) {
        diag("%s", err.text);
        skip(3, "no plan");
        goto out;
    }
    ok(rp_migration_plan_num_rounds(mp) == 2 && rp_migration_plan_layer_round(mp, 0) == 0 &&
           rp_migration_plan_layer_round(mp, 1) == 1 && rp_migration_plan_layer_round(mp, 2) == 0 &&
           rp_migration_plan_layer_round(mp, 3) == 1 && rp_migration_plan_num_rounds(m1) == 4,
       "PP 2 (layers 0-1 on stage 0, 2-3 on stage 1): rounds {0, 2}, {1, 3}; PP 1 needs 4 rounds");
    rp_migration_summary s, s1;
    rp_migration_plan_summary(mp, &s);
    rp_migration_plan_summary(m1, &s1);
    const double want = fmax(nv_time(pp, 1e6), nv_time(pp, 3e6)) + fmax(nv_time(pp, 4e6), nv_time(pp, 2e6));
    ok(close_to(s.predicted_s, want), "time = sum over rounds of the busiest stage: %.6g us (want %.6g)",
       s.predicted_s * 1e6, want * 1e6);
    const double want1 = nv_time(one, 1e6) + nv_time(one, 4e6) + nv_time(one, 3e6) + nv_time(one, 2e6);
    ok(close_to(s1.predicted_s, want1) && s.max_staging_bytes == 4000000,
       "PP 1: one layer a round, %.6g us; PP 2's staging per GPU stays within the budget",
       s1.predicted_s * 1e6);
out:
    rp_migration_plan_free(mp);
    rp_migration_plan_free(m1);
    rp_plan_free(pc);
    rp_plan_free(pt);
    rp_plan_free(oc);
    rp_plan_free(ot);
    rp_config_free(pp);
    rp_config_free(one);
}

/* The executor over every stage's GPUs (4 threads, 2 stages of 2), each rank's registry
 * holding only its stage's layers: each layer moves on its stage's GPUs. */
static void test_execute(bool break_one)
{
    rp_error err;
    const int L = 4;
    rp_config *cfg = pp_config(4, 2, L);
    int32_t cur[8], tgt[8];
    swap_rows(L, cur, tgt);
    rp_plan *pc = cfg ? w_plan(ctx, cfg, cur) : NULL, *pt = cfg ? w_plan(ctx, cfg, tgt) : NULL;
    w_layout lay;
    w_random_layout(&lay, L, 300);
    w_gpu gpu[NR];
    rp_registry *reg[NR] = {NULL};
    rp_transport *t[NR] = {NULL};
    rp_local_hub *hub = NULL;
    rp_migration_plan *mp = NULL;
    memset(gpu, 0, sizeof gpu);
    rp_migration_options o = {lay.bytes, 0};
    bool ready = pc && pt && rp_migration_plan_new(ctx, cfg, pc, pt, &o, &mp, &err) == RP_OK &&
                 rp_local_hub_new(ctx, NR, &hub, NULL) == RP_OK;
    for (int g = 0; ready && g < NR; g++) {
        /* buffers for every layer, but the registry names only the stage's */
        ready = w_gpu_init(&gpu[g], ctx, &lay, pc, g) == 0 && rp_registry_new(ctx, L, 1, &reg[g], NULL) == RP_OK &&
                rp_transport_local_new(hub, g, &t[g], NULL) == RP_OK;
        for (int l = 0; ready && l < L; l++) {
            if (rp_migration_plan_layer_stage(mp, l) != g / 2) continue;
            if (break_one && g == 3 && l == 3) continue; /* rank 3 forgets its layer 3 */
            int32_t count = 0;
            const rp_tensor *ts = rp_registry_tensors(gpu[g].reg, l, 0, &count);
            ready = rp_registry_set(reg[g], l, 0, ts, count, NULL) == RP_OK;
        }
        ready = ready && rp_registry_set_placement(reg[g], pc, g % 2, 0, NULL) == RP_OK;
    }
    if (!ready) {
        diag("setup failed");
        skip(2, "no scene");
        goto out;
    }
    rank_run runs[NR];
    for (int g = 0; g < NR; g++) {
        memset(&runs[g], 0, sizeof runs[g]);
        runs[g].rank = g;
        runs[g].mp = mp;
        runs[g].reg = reg[g];
        runs[g].t = t[g];
        rp_migration_exec_defaults(&runs[g].opts);
    }
    run_all(runs, NR);
    int bad = 0;
    for (int g = 0; g < NR; g++)
        bad += w_gpu_bad_slots(&gpu[g], pt, break_one ? 0u : (g < 2 ? 0x3u : 0xcu));
    if (break_one) {
        ok(runs[0].st == RP_EINVAL && same_outcome(runs, NR) &&
               strstr(runs[0].err.text, "rank 3: registry: layer 3 slot 0 is not registered (every layer of this "
                                        "rank's pipeline stage and slot must be); nothing moved"),
           "a rank without one of its stage's layers: every rank says so, nothing moved: %s", runs[0].err.text);
        ok(bad == 0, "every slot as before");
    } else {
        bool all_ok = true;
        for (int g = 0; g < NR; g++) all_ok &= runs[g].st == RP_OK;
        if (!all_ok) diag("%s", runs[0].err.text);
        ok(all_ok && runs[0].res.rounds_committed == 1,
           "every rank succeeds with only its stage's layers registered");
        ok(bad == 0, "stage 0's GPUs hold layers 0-1 of the target, stage 1's layers 2-3, nothing else changed");
    }
out:
    rp_migration_plan_free(mp);
    for (int g = 0; g < NR; g++) {
        rp_transport_free(t[g]);
        rp_registry_free(reg[g]);
        w_gpu_free(&gpu[g]);
    }
    rp_local_hub_free(hub);
    rp_plan_free(pc);
    rp_plan_free(pt);
    rp_config_free(cfg);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_plan();
    test_rounds();
    test_execute(false);
    test_execute(true);
    rp_context_free(ctx);
    return tap_done();
}
