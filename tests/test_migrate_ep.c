/* Migration priced per EP rank (docs/cost-model.md, "Migration"; core/migrate_links.h):
 * under TP / CP a DP rank's slots belong to TP x CP / ETP EP ranks, each an ETP group
 * that moves its own experts over its own GPUs' links. Hand-computed round times at
 * TP 2 ETP 1 and TP 2 ETP 2, the cost model's estimate equal to the migration plan's
 * prediction on the same plans (it is computed by the same rule, migrate_build.c), and
 * TP = CP = ETP = 1 against the formulas from before the rule, bit for bit, on random
 * plans. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <string.h>

static rp_context *ctx;

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"                                     \
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}"

/* test_util.h's toy (its cost evaluator) on `topology`. */
static bool scene_make(toy_scene *s, const char *topology)
{
    char json[2048];
    snprintf(json, sizeof json, "{\"topology\": {%s}," MODEL "}", topology);
    rp_error err;
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, &err) != RP_OK) {
        diag("config: %s", err.text);
        return false;
    }
    if (!toy_scene_make(ctx, s, cfg, &err)) {
        diag("setup: %s", err.text);
        return false;
    }
    return true;
}

/* A placement-only plan with these rows, one per layer. */
static rp_plan *placed(const rp_config *cfg, const int32_t *rows)
{
    rp_plan *p = NULL;
    if (rp_plan_new(ctx, cfg, 1, &p, NULL) != RP_OK) return NULL;
    const int32_t S = rp_plan_total_slots(p);
    for (int32_t l = 0; l < rp_plan_num_layers(p); l++)
        if (rp_plan_set_phy2log(p, l, rows + (size_t)l * S, NULL) != RP_OK) {
            rp_plan_free(p);
            return NULL;
        }
    return p;
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b); }

/* 2 DP ranks of TP 2 (4 GPUs, one node), 8 slots in all, the contiguous placement at
 * both layers; at layer 0 the target is
 *     DP rank 0: 4 5 2 6 | DP rank 1: 0 1 3 7
 * so each DP rank receives 3 experts and sends 3, over NVLink. Under ETP 1 a DP rank is
 * 2 EP ranks of 2 slots: EP rank 0 (slots 0-1) receives 2 and sends 2 (experts 0 and 1
 * leave DP rank 0's first two slots), EP rank 1 one each way. Under ETP 2 the DP rank is
 * one EP rank of 4 slots over both GPUs' links. */
static void test_hand(void)
{
    static const int32_t cur[16] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7};
    static const int32_t tgt[16] = {4, 5, 2, 6, 0, 1, 3, 7, 0, 1, 2, 3, 4, 5, 6, 7};
    static const char *const topo[2] = {
        "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"expert_tensor_parallel_size\": 1,"
        " \"ep_size\": 4, \"slots_per_gpu\": 2",
        "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4"};
    const double nv = 450e9, lat = 3e-6, hbm = 4.8e12;
    for (int i = 0; i < 2; i++) {
        const int etp = i == 0 ? 1 : 2;
        toy_scene s;
        rp_plan *from = NULL, *to = NULL;
        rp_migration_plan *mp = NULL;
        rp_error err;
        if (!scene_make(&s, topo[i]) || !(from = placed(s.cfg, cur)) || !(to = placed(s.cfg, tgt)) ||
            rp_migration_plan_new(ctx, s.cfg, from, to, NULL, &mp, &err) != RP_OK) {
            skip(4, "setup");
            goto next;
        }
        /* weights and optimizer state: 3 d f (2 + 12) bytes */
        const double B = (double)rp_memory_expert_move_bytes(s.cfg);
        ok(B == 3 * 64 * 32 * 14.0, "ETP %d: an expert moves 3 d f (bpp + bos) = %.0f bytes", etp, B);
        /* the busiest EP rank: ETP 1, EP rank 0 of either DP rank, 2 experts each way and
         * 2 slots written (a read and a write each); ETP 2, the DP rank, 3 each way and 3
         * slots, over 2 GPUs' links and HBM */
        const double link = etp == 1 ? 2 * B / nv + lat : 3 * B / (2 * nv) + lat;
        const double commit = etp == 1 ? 2 * 2 * B / hbm : 2 * 3 * B / (2 * hbm);
        rp_migration_summary sum;
        rp_migration_plan_summary(mp, &sum);
        rp_migration_gpu g0, g1;
        rp_migration_plan_gpu(mp, 0, &g0, NULL);
        rp_migration_plan_gpu(mp, 1, &g1, NULL);
        ok(close_to(sum.predicted_s, link + commit) && close_to(g0.predicted_s, link + commit) &&
               close_to(g1.predicted_s, link + commit) && sum.moved_bytes == (int64_t)(6 * B) &&
               g0.received[RP_LINK_NVLINK] == (int64_t)(3 * B),
           "ETP %d: the plan's round, by hand: %.4f us (one GPU's links for the DP rank, as before: %.4f us)", etp,
           sum.predicted_s * 1e6, (3 * B / nv + lat + 6 * B / hbm) * 1e6);
        double est_s = 0, est_bytes = 0;
        is_int(rp_cost_migration(s.cost, from, to, &est_s, &est_bytes, &err), RP_OK, "ETP %d: the estimate", etp);
        /* the estimate is the plan's prediction, commit included (the receiving side
         * alone, as the estimate once counted, would be `link`, commit * 1e6 us less) */
        ok(close_to(est_s, link + commit) && est_s == sum.predicted_s && est_bytes == 6 * B,
           "ETP %d: the cost model's estimate, %.4f us, is the plan's prediction (%.4f us), commit (%.4f us) "
           "included", etp, est_s * 1e6, sum.predicted_s * 1e6, commit * 1e6);
    next:
        rp_migration_plan_free(mp);
        rp_plan_free(from);
        rp_plan_free(to);
        toy_scene_free(&s);
    }
}

/* On random plans the estimate is the plan's prediction, bit for bit (the same copies,
 * sources, rounds and EP ranks: one rule), under TP, ETP 1 and CP, with and without a
 * staging budget that splits the migration into rounds. */
static void test_estimate_equal(void)
{
    /* the last: the first with a staging budget of one layer's worst (a DP rank's 4
     * slots of 86016 bytes), so a migration moving both layers takes two rounds
     * ("topology" closes before "execution") */
    static const char *const topo[4] = {
        "\"num_nodes\": 2, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"expert_tensor_parallel_size\": 1,"
        " \"ep_size\": 8, \"slots_per_gpu\": 2",
        "\"num_nodes\": 2, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"ep_size\": 4, \"slots_per_gpu\": 3",
        "\"num_nodes\": 2, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"context_parallel_size\": 2,"
        " \"expert_tensor_parallel_size\": 1, \"ep_size\": 8, \"slots_per_gpu\": 1",
        "\"num_nodes\": 2, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"expert_tensor_parallel_size\": 1,"
        " \"ep_size\": 8, \"slots_per_gpu\": 2}, \"execution\": {\"staging_budget_bytes\": 344064"};
    static const char *const name[4] = {"TP 2 ETP 1", "TP 2 ETP 2", "TP 2 CP 2 ETP 1", "TP 2 ETP 1, a budget"};
    uint64_t rng = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < 4; i++) {
        toy_scene s;
        if (!scene_make(&s, topo[i])) {
            skip(1, "setup");
            toy_scene_free(&s);
            continue;
        }
        const int32_t *sb = rp_plan_slot_begin(s.plan), S = rp_plan_total_slots(s.plan);
        int32_t *rows = malloc(2 * 2 * (size_t)S * sizeof(int32_t));
        int tries = 0, equal = 0, moved = 0, rounds = 0;
        /* the budget the scheduler plans with until the trainer sets one */
        const rp_migration_options opts = {NULL, rp_config_execution(s.cfg)->staging_budget_bytes};
        for (int n = 0; n < 30 && rows; n++) {
            for (int w = 0; w < 4; w++) random_placement(rows + (size_t)w * S, sb, S, 8, &rng);
            rp_plan *from = placed(s.cfg, rows), *to = placed(s.cfg, rows + 2 * (size_t)S);
            rp_migration_plan *mp = NULL;
            double est = 0;
            rp_error err;
            if (from && to && rp_migration_plan_new(ctx, s.cfg, from, to, &opts, &mp, &err) == RP_OK &&
                rp_cost_migration(s.cost, from, to, &est, NULL, &err) == RP_OK) {
                rp_migration_summary sum;
                rp_migration_plan_summary(mp, &sum);
                tries++;
                equal += est == sum.predicted_s;
                moved += sum.moved_bytes > 0;
                rounds += sum.num_rounds > 1;
            } else if (from && to) {
                diag("%s: %s", name[i], err.text);
            }
            rp_migration_plan_free(mp);
            rp_plan_free(from);
            rp_plan_free(to);
        }
        ok(tries == 30 && equal == 30 && moved > 0 && (opts.staging_budget_bytes == 0 ? rounds == 0 : rounds > 0),
           "%s: estimate == the plan's prediction on %d of %d random plans (%d of several rounds)", name[i], equal,
           tries, rounds);
        free(rows);
        toy_scene_free(&s);
    }
}

/* TP = CP = ETP = 1: each EP rank is a GPU, and the plan's figures are main's before the
 * rule, bit for bit: the round as max(sent, received) per link at one GPU's bandwidth
 * plus its HBM reads and writes. The estimate is that prediction; the receiving side
 * alone (recomputed here from the plan's transfers: the estimate's rule before it became
 * the plan's) is never above it, and below it wherever anything is written (the commit).
 * On `nodes` nodes of 4 / nodes GPUs, one EP group of 4: over 2 nodes NVLink and network
 * copies. */
static void test_tp1_unchanged(int nodes)
{
    toy_scene s;
    char topo[256];
    snprintf(topo, sizeof topo, "\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": 4, \"slots_per_gpu\": 3",
             nodes, 4 / nodes);
    if (!scene_make(&s, topo)) {
        skip(2, "setup");
        toy_scene_free(&s);
        return;
    }
    const rp_topology *t = rp_config_topology(s.cfg);
    const double hbm = rp_config_hardware(s.cfg)->hbm_bytes_per_s;
    const int32_t *sb = rp_plan_slot_begin(s.plan), S = rp_plan_total_slots(s.plan), G = t->num_gpus;
    int32_t *rows = malloc(2 * 2 * (size_t)S * sizeof(int32_t));
    uint64_t rng = 0x243F6A8885A308D3ULL;
    int same_plan = 0, same_est = 0, tries = 0, mixed = 0, above = 0;
    for (int n = 0; n < 40 && rows; n++) {
        for (int w = 0; w < 4; w++) random_placement(rows + (size_t)w * S, sb, S, 8, &rng);
        rp_plan *from = placed(s.cfg, rows), *to = placed(s.cfg, rows + 2 * (size_t)S);
        rp_migration_plan *mp = NULL;
        double est = 0;
        if (!from || !to || rp_migration_plan_new(ctx, s.cfg, from, to, NULL, &mp, NULL) != RP_OK ||
            rp_cost_migration(s.cost, from, to, &est, NULL, NULL) != RP_OK)
            goto next;
        tries++;
        double hbm_bytes[4] = {0}, recv[4][RP_NUM_LINKS] = {{0}};
        for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
            rp_migration_transfer tr;
            rp_migration_plan_transfer(mp, i, &tr, NULL);
            recv[tr.dst_gpu][tr.link] += (double)tr.bytes;
            if (tr.link == RP_LINK_LOCAL) hbm_bytes[tr.dst_gpu] += 2.0 * (double)tr.bytes;
        }
        for (int64_t i = 0; i < rp_migration_plan_num_writes(mp); i++) {
            rp_migration_write w;
            rp_migration_plan_write(mp, i, &w, NULL);
            hbm_bytes[w.gpu] += 2.0 * (double)rp_migration_plan_expert_bytes(mp, w.layer);
        }
        double plan_s = 0, est_s = 0;
        bool gpus_same = true, both = false;
        for (int32_t g = 0; g < G; g++) {
            rp_migration_gpu gs;
            rp_migration_plan_gpu(mp, g, &gs, NULL);
            /* main's round_time, one round */
            double nv = (double)(gs.sent[RP_LINK_NVLINK] > gs.received[RP_LINK_NVLINK] ? gs.sent[RP_LINK_NVLINK]
                                                                                     : gs.received[RP_LINK_NVLINK]);
            double net = (double)(gs.sent[RP_LINK_NET] > gs.received[RP_LINK_NET] ? gs.sent[RP_LINK_NET]
                                                                                : gs.received[RP_LINK_NET]);
            double x = 0.0;
            if (nv > 0) x += nv / t->nvlink_bytes_per_s + t->nvlink_latency_s;
            if (net > 0) x += net / t->net_bytes_per_s + t->net_latency_s;
            x = x + hbm_bytes[g] / hbm;
            gpus_same &= gs.predicted_s == x;
            if (x > plan_s) plan_s = x;
            /* the receiving side alone (rp_cost_migration's rule before this one) */
            double rn = recv[g][RP_LINK_NVLINK], rx = recv[g][RP_LINK_NET];
            double y = rn / t->nvlink_bytes_per_s + rx / t->net_bytes_per_s + (rn > 0 ? t->nvlink_latency_s : 0.0) +
                       (rx > 0 ? t->net_latency_s : 0.0);
            if (y > est_s) est_s = y;
            both |= rn > 0 && rx > 0;
        }
        rp_migration_summary sum;
        rp_migration_plan_summary(mp, &sum);
        same_plan += gpus_same && sum.predicted_s == plan_s;
        same_est += est == sum.predicted_s;
        above += sum.writes > 0 ? est > est_s : est == est_s;
        mixed += both;
    next:
        rp_migration_plan_free(mp);
        rp_plan_free(from);
        rp_plan_free(to);
    }
    ok(tries == 40 && same_plan == 40,
       "TP 1, %d node(s): the plan's prediction is main's, bit for bit, on %d of %d random plans", nodes, same_plan,
       tries);
    ok(tries == 40 && same_est == 40 && above == 40 && (nodes == 1 ? mixed == 0 : mixed > 0),
       "TP 1, %d node(s): the estimate is the plan's prediction on %d of %d random plans, above the receiving "
       "side alone on %d (%d with a GPU receiving over both links)", nodes, same_est, tries, above, mixed);
    free(rows);
    toy_scene_free(&s);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_hand();
    test_estimate_equal();
    test_tp1_unchanged(1);
    test_tp1_unchanged(2);
    rp_context_free(ctx);
    return tap_done();
}
