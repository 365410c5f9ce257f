/* Tensor and expert-tensor parallelism (topology.tensor_parallel_size,
 * expert_tensor_parallel_size): the topology mapping (a DP rank is a TP group, EP ranks
 * are ETP groups), its config errors, the cost model's divisors against hand-computed
 * figures, and bound <= step (and try == full evaluation) on random plans with TP/ETP > 1. */
#include "internal.h"
#include "joint_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;
static uint64_t rng_state = 0x243F6A8885A308D3ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"                                     \
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}"

static rp_config *config(const char *topology, const char *extra, rp_error *err)
{
    char json[2048];
    snprintf(json, sizeof json, "{\"topology\": {%s}," MODEL "%s}", topology, extra);
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

static void test_mapping(void)
{
    rp_error err;
    rp_config *cfg = config("\"num_nodes\": 2, \"gpus_per_node\": 8, \"tensor_parallel_size\": 4,"
                            " \"expert_tensor_parallel_size\": 1, \"ep_size\": 8",
                            "", &err);
    ok(cfg != NULL, "TP 4, ETP 1, EP 8 on 2 x 8 GPUs");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->num_gpus == 4 && t->dp_size == 4 && t->gpus_per_node == 2 && t->physical_gpus_per_node == 8,
           "4 DP ranks (TP groups), 2 per node, 8 GPUs per node");
        ok(t->ep_size == 2 && t->num_ep_groups == 2 && t->expert_parallel_size == 8,
           "an EP group of 8 EP ranks x 1 GPU is 2 DP ranks; 2 groups");
        ok(t->slots[0] == 4 && t->slots[3] == 4, "slots default to ceil(8 / 8) = 1 per EP rank, 4 per DP rank");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2", "", &err);
    ok(cfg != NULL, "TP 2 alone");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->expert_tensor_parallel_size == 2 && t->expert_parallel_size == 4 && t->ep_size == 4 &&
               t->slots[0] == 2,
           "ETP defaults to TP (Megatron), EP to the node's 4 ETP groups, 2 slots per EP rank = per DP rank");
        rp_config_free(cfg);
    }
    static const config_refusal bad[] = {
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 3",
         "topology.tensor_parallel_size must divide gpus_per_node, 8, got 3: a TP group stays inside a node",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 16",
         "topology.tensor_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 4, \"expert_tensor_parallel_size\": 3",
         "topology.expert_tensor_parallel_size must divide tensor_parallel_size, 4, got 3", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 4, \"expert_tensor_parallel_size\": 1,"
         " \"ep_size\": 2",
         "topology.ep_size is 2 EP ranks x 1 GPUs (expert_tensor_parallel_size) = 2 GPUs, not a multiple of "
         "tensor_parallel_size 4: an EP group must hold whole DP ranks",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2, \"expert_tensor_parallel_size\": 1,"
         " \"ep_size\": 6",
         "topology.ep_size must give EP groups that divide the GPUs: 6 EP ranks x 1 GPUs "
         "(expert_tensor_parallel_size) = 6 GPUs, but the topology has 8",
         RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2, \"dp_size\": 8",
         "topology.dp_size must equal the GPUs over tensor_parallel_size, 8 / 2 = 4, got 8", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2, \"expert_tensor_parallel_size\": 1,"
         " \"slots_per_gpu\": [4, 4, 3, 4]",
         "topology.slots_per_gpu[2] is 3, but DP rank 2 holds 2 EP ranks", RP_EINVAL},
    };
    check_config_refusals(config, bad, sizeof bad / sizeof bad[0]);
}

/* ---- hand-computed divisors ---- */

/* test_util.h's toy on `topology`, one copy per token-choice (the hand figures count
 * choices; the de-duplicated modes estimate copies from per-sequence histograms). */
static bool setup_make(toy_scene *s, const char *topology)
{
    rp_error err;
    rp_config *cfg = config(topology, ", \"execution\": {\"dispatch_dedup\": \"choice\"}", &err);
    if (!cfg) {
        diag("config: %s", err.text);
        return false;
    }
    if (!toy_scene_make(ctx, s, cfg, &err)) {
        diag("setup: %s", err.text);
        return false;
    }
    return true;
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-21; }

static void test_divisors(void)
{
    toy_scene one, tp, fold;
    /* TP 1: 2 GPUs; TP 2 ETP 2: 4 GPUs in 2 TP groups, each one EP rank of 4 slots;
     * TP 2 ETP 1 (folding): 4 GPUs, 4 EP ranks of 2 slots, 2 per DP rank. Same plan shape. */
    bool ok1 = setup_make(&one, "\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4");
    bool ok2 = setup_make(&tp, "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2, \"ep_size\": 2,"
                               " \"slots_per_gpu\": 4");
    bool ok3 = setup_make(&fold, "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2,"
                                 " \"expert_tensor_parallel_size\": 1, \"ep_size\": 4, \"slots_per_gpu\": 2");
    if (!ok1 || !ok2 || !ok3) {
        skip(9, "setup");
        goto out;
    }
    const double peak = 989e12, nv = 450e9, lat = 3e-6, d = 64, f = 32, h = 4, dh = 16, bpe = 2;
    /* attention of the 30-token sequence: 2 L^2 h dh / (peak eff(L)) with eff flat 0.25
     * below 512, plus projections 2 L d (2 h dh + 2 h dh) / (peak 0.7) */
    double attn1 = 2.0 * 30 * 30 * h * dh / (peak * 0.25) + 2.0 * 30 * d * (4 * h * dh) / (peak * 0.7);
    ok(close_to(rp_cost_attention_s(one.cost, 30), attn1), "TP 1: attention of 30 tokens, by hand (%.6g s)", attn1);
    ok(close_to(rp_cost_attention_s(tp.cost, 30), attn1 / 2), "TP 2: half of it");
    /* an expert of 100 tokens alone on its GPU, routepack_torch's grouped GEMM: padded to
     * its 16-row tile, 112 rows, forward F = 6 n d f / (peak eff(112)), eff(112) = 0.28 +
     * 48/192 x 0.22; data gradient F (backward.experts 2 - 1); weight gradient at the same
     * curve, but at least the write of dW, 3 d f bytes_per_grad / hbm; (2 F + W) / 3 */
    const rp_model *md = rp_config_model(one.cfg);
    const double F = 6.0 * 112 * d * f / (peak * (0.28 + 48.0 / 192 * 0.22));
    const double dw = 3.0 * d * f * (md->bytes_per_grad > 0 ? md->bytes_per_grad : md->bytes_per_param) / 4.8e12;
    double slot1 = (2.0 * F + (F > dw ? F : dw)) / 3.0;
    ok(close_to(rp_cost_expert_s(one.cost, 100), slot1), "TP 1: expert slot of 100 tokens, by hand (%.6g s)", slot1);
    ok(close_to(rp_cost_expert_s(tp.cost, 100), slot1 / 2) && close_to(rp_cost_expert_s(fold.cost, 100), slot1 / 2),
       "TP 2: half, with ETP 2 (split GEMM) and ETP 1 (two EP ranks pooled) alike");
    const double *x1 = rp_cost_expert_breakdown(one.cost), *x2 = rp_cost_expert_breakdown(tp.cost);
    ok(close_to(x1[0], slot1) && close_to(x2[0], slot1 / 2) && close_to(x2[1], slot1 / 2),
       "rank 0's and rank 1's expert time (expert 0 and 5, 100 tokens each): halved under TP 2");
    /* dispatch: 50 choices each way over NVLink, d bpe bytes each, plus the latency */
    const double *d1 = rp_cost_dispatch_breakdown(one.cost), *d2 = rp_cost_dispatch_breakdown(tp.cost),
                 *d3 = rp_cost_dispatch_breakdown(fold.cost);
    double a2a = 50 * d * bpe / nv;
    ok(close_to(d1[0], a2a + lat), "TP 1: dispatch of rank 0 = 50 d bpe / bw_nv + lat, by hand");
    ok(close_to(d3[0], a2a / 2 + lat) && close_to(d3[1], a2a / 2 + lat),
       "TP 2 ETP 1: the all-to-all over 2 GPUs' links: half, no all-gather");
    /* ETP 2: each ETP group all-gathers the 100 tokens its expert takes: (2 - 1) copies,
     * over the DP rank's 2 GPUs' NVLink */
    double gather = 100 * (2 - 1) * d * bpe / (2 * nv);
    ok(close_to(d2[0], a2a / 2 + gather + lat) && close_to(d2[1], a2a / 2 + gather + lat),
       "TP 2 ETP 2: plus the ETP all-gather, 100 tokens x 1 copy x d bpe / (2 bw_nv)");
    ok(close_to(rp_cost_expert_move_s(tp.cost, true) - lat, (rp_cost_expert_move_s(one.cost, true) - lat) / 2),
       "TP 2 ETP 2: moving an expert into its EP rank of 2 GPUs: twice the bandwidth");
out:
    if (ok1) toy_scene_free(&one);
    if (ok2) toy_scene_free(&tp);
    if (ok3) toy_scene_free(&fold);
}

/* Memory per GPU: a DP rank of TP GPUs holds the same as one GPU at TP 1, over TP. */
static void test_memory(void)
{
    rp_error err;
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4", "", &err);
    rp_config *tp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 4,"
                           " \"expert_tensor_parallel_size\": 1, \"ep_size\": 8, \"slots_per_gpu\": 1",
                           "", &err);
    rp_gpu_memory a, b;
    if (!one || !tp || rp_memory_gpu(one, NULL, 0, &a, &err) != RP_OK || rp_memory_gpu(tp, NULL, 0, &b, &err) != RP_OK) {
        skip(2, "configs");
    } else {
        /* both: 2 DP ranks of 4 slots; TP 4: each GPU one EP rank of 1 slot */
        ok(close_to(b.expert_weight_bytes, a.expert_weight_bytes / 4) &&
               close_to(b.expert_grad_bytes, a.expert_grad_bytes / 4) &&
               close_to(b.staging_bytes, a.staging_bytes / 4),
           "TP 4, ETP 1: a GPU holds its one slot of the DP rank's 4 (%.0f of %.0f bytes of expert weights)",
           b.expert_weight_bytes, a.expert_weight_bytes);
        ok(close_to(b.dense_weight_bytes, a.dense_weight_bytes / 4) && close_to(b.total_bytes, a.total_bytes / 4),
           "and a quarter of the dense parameters");
    }
    rp_config_free(one);
    rp_config_free(tp);
}

/* ---- random plans ---- */

static void test_random(void)
{
    static const char *const syncs[] = {"group", "global"}, *const overlaps[] = {"none", "layer"};
    int bad_bound = 0, bad_try = 0, cases = 0;
    for (int it = 0; it < 40; it++) {
        int nodes = 1 + (int)rnd(2), gpn = 8, tp = 1 << (1 + rnd(2)), etp = 1 << rnd(tp == 2 ? 2 : 3);
        int ep_gpus_min = tp, ep = (ep_gpus_min << rnd(2)) / etp; /* EP group of tp or 2 tp GPUs */
        char topo[512], extra[256];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": %d, \"gpus_per_node\": %d, \"tensor_parallel_size\": %d,"
                 " \"expert_tensor_parallel_size\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d",
                 nodes, gpn, tp, etp, ep, (8 + ep - 1) / ep + (int)rnd(2));
        static const char *const dedups[] = {"choice", "gpu", "node"};
        snprintf(extra, sizeof extra,
                 ", \"execution\": {\"sync\": \"%s\", \"overlap\": \"%s\", \"dispatch_dedup\": \"%s\"}",
                 syncs[rnd(2)], overlaps[rnd(2)], dedups[rnd(3)]);
        rp_error err;
        rp_config *cfg = config(topo, extra, &err);
        if (!cfg) {
            diag("config %s: %s", topo, err.text);
            bad_bound++;
            continue;
        }
        const rp_topology *t = rp_config_topology(cfg);
        int32_t n = 8 + (int32_t)rnd(24), lens[32], zero[32] = {0};
        for (int i = 0; i < n; i++) lens[i] = 1 + (int32_t)rnd(300);
        rp_batch *batch = NULL;
        rp_batch_new(ctx, n, lens, zero, NULL, &batch, &err);
        int64_t tokens = rp_batch_num_tokens(batch);
        uint8_t *ids = malloc((size_t)tokens * 4);
        random_top2(ids, tokens * 2, 8, 4, &rng_state);
        rp_routing r;
        rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
        rp_stats *stats = NULL;
        rp_stats_compute(ctx, batch, &r, 8, 1, &stats, &err);
        int32_t M = 1 + (int32_t)rnd(3), rank[32], mb[32];
        for (int i = 0; i < n; i++) rank[i] = (int32_t)rnd((uint32_t)t->num_gpus), mb[i] = (int32_t)rnd((uint32_t)M);
        rp_plan *plan = NULL;
        rp_plan_new(ctx, cfg, M, &plan, &err);
        rp_plan_set_packing(plan, n, rank, mb, &err);
        /* a random placement: the experts shuffled over the first 8 slots, a random
         * extra replica where a rank does not hold the expert yet */
        int32_t S = rp_plan_total_slots(plan), phy[64];
        const int32_t *sb = rp_plan_slot_begin(plan);
        for (int32_t l = 0; l < 2; l++) {
            random_placement(phy, sb, S, 8, &rng_state);
            rp_plan_set_phy2log(plan, l, phy, &err);
        }
        rp_cost *cost = NULL;
        rp_cost_summary sum;
        if (rp_plan_validate(plan, cfg, batch, &err) != RP_OK ||
            rp_cost_new(ctx, cfg, batch, stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, plan, &sum, &err) != RP_OK) {
            diag("case %d (%s): %s", it, topo, err.text);
            bad_bound++;
        } else {
            cases++;
            if (!(sum.lower_bound_s <= sum.step_s * (1 + 1e-12))) {
                bad_bound++;
                diag("case %d (%s%s): bound %.9g > step %.9g", it, topo, extra, sum.lower_bound_s, sum.step_s);
            }
            /* a move tried, applied, and evaluated afresh */
            int32_t s = (int32_t)rnd((uint32_t)n), g = (int32_t)rnd((uint32_t)t->num_gpus), m = (int32_t)rnd((uint32_t)M);
            double tried = rp_cost_try_move(cost, s, g, m);
            if (isfinite(tried) && rp_cost_apply_move(cost, plan, s, g, m, &err) == RP_OK) {
                rp_cost *fresh = NULL;
                rp_cost_summary fs;
                rp_cost_new(ctx, cfg, batch, stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &fresh, &err);
                if (rp_cost_evaluate(fresh, plan, &fs, &err) != RP_OK || fs.step_s != tried) {
                    bad_try++;
                    diag("case %d: try %.17g, full %.17g", it, tried, fs.step_s);
                }
                rp_cost_free(fresh);
            }
        }
        rp_cost_free(cost);
        rp_plan_free(plan);
        rp_stats_free(stats);
        free(ids);
        rp_batch_free(batch);
        rp_config_free(cfg);
    }
    ok(bad_bound == 0 && cases == 40, "bound <= step on %d random plans with TP in {2, 4}, ETP | TP, every sync, overlap and dedup", cases);
    ok(bad_try == 0, "a tried move equals a full evaluation of the moved plan, bit for bit");
}

/* The joint planner's surrogate prices a DP rank's transfers at the bandwidth of its
 * TP x CP GPUs' links, as the cost model does (it priced them at one GPU's before, and
 * overweighted communication by TP): the dispatch of a token-choice, an extra replica's
 * copy and its gradient reduction, against the cost model's own figures for the same
 * config and by hand. */
static void test_surrogate_comm(void)
{
    static const char *const topo[3] = {
        "\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 4",
        "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2,"
        " \"expert_tensor_parallel_size\": 1, \"ep_size\": 4, \"slots_per_gpu\": 2",
        "\"num_nodes\": 1, \"gpus_per_node\": 8, \"tensor_parallel_size\": 2, \"context_parallel_size\": 2,"
        " \"expert_tensor_parallel_size\": 1, \"ep_size\": 8, \"slots_per_gpu\": 1"};
    static const char *const name[3] = {"TP 1", "TP 2 ETP 1", "TP 2 CP 2 ETP 1"};
    const double nv = 450e9, lat = 3e-6, d = 64, f = 32, bpe = 2;
    for (int i = 0; i < 3; i++) {
        toy_scene s;
        if (!setup_make(&s, topo[i])) {
            skip(5, "setup");
            continue;
        }
        const rp_topology *t = rp_config_topology(s.cfg);
        const double rank_gpus = (double)t->tensor_parallel_size * t->context_parallel_size;
        joint jt;
        memset(&jt, 0, sizeof jt);
        jt.cfg = s.cfg;
        jt.ep = t->ep_size;
        jt.gpn = t->gpus_per_node;
        jt.K = rp_config_model(s.cfg)->top_k;
        joint_comm_costs(&jt);
        /* the cost model's dispatch of rank 0: 50 choices over NVLink plus the latency
         * (test_divisors); the surrogate's choice leaves its rank with probability
         * (ep - 1) / ep = 1/2 and is sent forward and backward */
        const double bc = rp_config_hardware(s.cfg)->backward.communication;
        const double per_choice = (rp_cost_dispatch_breakdown(s.cost)[0] - lat) / 50;
        ok(close_to(per_choice, d * bpe / (rank_gpus * nv)) && close_to(jt.d_choice, (1 + bc) * 0.5 * per_choice),
           "%s: the surrogate's dispatch of a token-choice is the cost model's, (1 + backward) / 2 x d bpe / "
           "(%g bw_nv)", name[i], rank_gpus);
        /* the cost model's bandwidth into the rank, from its dispatch: replica copies and
         * gradient reduction run over the DP rank's links, as the tokens do */
        const double bw_nv = d * bpe / per_choice, bw_net = rank_gpus * t->net_bytes_per_s;
        const double x = 3 * d * f * bpe; /* an expert's weights */
        ok(close_to(jt.copy_s, x / bw_nv) && close_to(jt.copy_s, x / (rank_gpus * nv)),
           "%s: an extra replica's copy, 3 d f bpe / (%g bw_nv), as the cost model prices it", name[i], rank_gpus);
        ok(close_to(jt.grad_nv_s, x / bw_nv + lat) && jt.nv_lat == lat,
           "%s: a replica's gradient reduction over NVLink, the latency undivided", name[i]);
        ok(close_to(jt.grad_net_s, x / bw_net + t->net_latency_s), "%s: and across nodes", name[i]);
        /* a migrating expert lands on one EP rank, ETP GPUs, and runs over their links only */
        const double m = (double)rp_memory_expert_move_bytes(s.cfg), etp = t->expert_tensor_parallel_size;
        const double commit = 2 * m / (etp * rp_config_hardware(s.cfg)->hbm_bytes_per_s);
        ok(close_to(rp_cost_expert_move_s(s.cost, true), m / (etp * nv) + lat + commit) &&
               close_to(rp_cost_expert_move_s(s.cost, false),
                        m / (etp * t->net_bytes_per_s) + t->net_latency_s + commit),
           "%s: moving an expert (the surrogate's migration) runs over one EP rank's %g GPUs' links and HBM",
           name[i], etp);
        toy_scene_free(&s);
    }
}

/* The joint planner's per-layer migration is the migration plan's prediction for that
 * layer alone (tests/test_migrate_ep.c has the same plan by hand): TP 2 ETP 1, DP rank
 * 0's slots 0-1 (EP rank 0) take experts 4 and 5, slot 3 (EP rank 1) expert 6, and DP
 * rank 1 the mirror image; the busiest EP rank sends and receives 2 copies over one GPU's
 * NVLink and writes 2 slots (a read and a write each in HBM). */
static void test_joint_migration(void)
{
    toy_scene s;
    if (!setup_make(&s, "\"num_nodes\": 1, \"gpus_per_node\": 4, \"tensor_parallel_size\": 2,"
                        " \"expert_tensor_parallel_size\": 1, \"ep_size\": 4, \"slots_per_gpu\": 2")) {
        skip(1, "setup");
        return;
    }
    int32_t cur[8] = {0, 1, 2, 3, 4, 5, 6, 7}, tgt[8] = {4, 5, 2, 6, 0, 1, 3, 7};
    int32_t off[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8}, rank[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    joint jt;
    memset(&jt, 0, sizeof jt);
    jt.ctx = ctx;
    jt.cfg = s.cfg;
    jt.ep = 2;
    jt.slot_begin = rp_plan_slot_begin(s.plan);
    joint_layer from = {cur, off, rank}, to = {tgt, off, rank};
    double joint_s = -1;
    rp_status st = joint_layer_migration_s(&jt, 0, &from, &to, &joint_s, NULL);
    /* the migration plan of the same change at layer 0 (layer 1 stays) */
    rp_plan *a = NULL, *b = NULL;
    rp_migration_plan *mp = NULL;
    rp_migration_summary sum = {0};
    if (rp_plan_new(ctx, s.cfg, 1, &a, NULL) == RP_OK && rp_plan_new(ctx, s.cfg, 1, &b, NULL) == RP_OK &&
        rp_plan_set_phy2log(a, 0, cur, NULL) == RP_OK && rp_plan_set_phy2log(a, 1, cur, NULL) == RP_OK &&
        rp_plan_set_phy2log(b, 0, tgt, NULL) == RP_OK && rp_plan_set_phy2log(b, 1, cur, NULL) == RP_OK &&
        rp_migration_plan_new(ctx, s.cfg, a, b, NULL, &mp, NULL) == RP_OK)
        rp_migration_plan_summary(mp, &sum);
    const double m = (double)rp_memory_expert_move_bytes(s.cfg), nv = 450e9, lat = 3e-6, hbm = 4.8e12;
    ok(st == RP_OK && close_to(joint_s, 2 * m / nv + lat + 4 * m / hbm) && joint_s == sum.predicted_s,
       "TP 2 ETP 1: the joint planner's layer migration, 2 copies into one EP rank and their commit "
       "(2 m / bw_nv + lat + 4 m / bw_hbm = %.4f us), is the migration plan's prediction (%.4f us); the "
       "receiving side alone would be %.4f us", joint_s * 1e6, sum.predicted_s * 1e6, (2 * m / nv + lat) * 1e6);
    rp_migration_plan_free(mp);
    rp_plan_free(a);
    rp_plan_free(b);
    toy_scene_free(&s);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_mapping();
    test_divisors();
    test_surrogate_comm();
    test_joint_migration();
    test_memory();
    test_random();
    rp_context_free(ctx);
    return tap_done();
}
