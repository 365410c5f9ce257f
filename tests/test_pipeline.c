/* Pipeline parallelism (topology.pipeline_parallel_size, virtual_pipeline_size,
 * pipeline_schedule, layers_per_stage): the topology a stage gives the planner, its config
 * errors and the memory of a stage's GPU; the schedules and their critical path against
 * hand-computed figures; the cost model under PP (PP 1 bit for bit as before, bound <=
 * step, try == full) on random plans. */
#include "cost_internal.h"
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static rp_context *ctx;

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": 6, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"                                     \
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}"

/* limits.max_tokens_per_microbatch for the next config() (MODEL's 100000 when 0) */
static int64_t token_cap;

static rp_config *config(const char *topology, const char *extra, rp_error *err)
{
    char json[2048];
    snprintf(json, sizeof json, "{\"topology\": {%s}," MODEL "%s}", topology, extra);
    if (token_cap > 0) {
        char *at = strstr(json, "100000");
        char tail[2048];
        snprintf(tail, sizeof tail, "%s", at + 6);
        snprintf(at, sizeof json - (size_t)(at - json), "%lld%s", (long long)token_cap, tail);
    }
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-21; }

static void test_config(void)
{
    rp_error err;
    rp_config *cfg = config("\"num_nodes\": 4, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2,"
                            " \"tensor_parallel_size\": 2",
                            "", &err);
    ok(cfg != NULL, "PP 2, TP 2 on 4 x 8 GPUs");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->pipeline_parallel_size == 2 && t->virtual_pipeline_size == 1 &&
               t->pipeline_schedule == RP_SCHEDULE_1F1B,
           "VPP defaults to 1 and the schedule to 1f1b");
        ok(t->num_gpus == 8 && t->num_nodes == 2 && t->gpus_per_node == 4 && t->physical_num_nodes == 4,
           "a stage is 2 nodes of 4 DP ranks: the planner sees 8 DP ranks (%d), 2 nodes (%d)", t->num_gpus,
           t->num_nodes);
        ok(t->ep_size == 4 && t->expert_parallel_size == 4 && t->num_ep_groups == 2,
           "EP defaults to one node's ETP groups, inside the stage");
        ok(t->layers_per_stage[0] == 3 && t->layers_per_stage[1] == 3 && t->stage_layer_begin[1] == 3,
           "6 layers split 3 + 3");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4,"
                 " \"virtual_pipeline_size\": 2, \"layers_per_stage\": [1, 0, 1, 1, 1, 1, 0, 1]",
                 "", &err);
    ok(cfg != NULL, "PP 4 x VPP 2 on one node with an explicit layer split");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->pipeline_schedule == RP_SCHEDULE_INTERLEAVED && t->num_gpus == 2 && t->num_nodes == 1 &&
               t->gpus_per_node == 2 && t->ep_size == 2,
           "interleaved by default; a stage is 2 GPUs of the node, one EP group of 2");
        ok(t->stage_layer_begin[2] == 1 && t->stage_layer_begin[7] == 5, "virtual stage 2 starts at layer 1, 7 at 5");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4, \"virtual_pipeline_size\": 4",
                 "", &err);
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        int32_t sum = 0;
        for (int s = 0; s < 16; s++) sum += t->layers_per_stage[s];
        ok(t->layers_per_stage[0] == 1 && t->layers_per_stage[5] == 1 && t->layers_per_stage[6] == 0 && sum == 6,
           "6 layers over 16 virtual stages: the first 6 take one each");
        rp_config_free(cfg);
    } else {
        ok(0, "PP 4 x VPP 4: %s", err.text);
    }
    static const config_refusal bad[] = {
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 3",
         "topology.pipeline_parallel_size is 3, but the 8 GPUs (num_nodes 1 x gpus_per_node 8) do not split into 3 "
         "stages", RP_EINVAL},
        {"\"num_nodes\": 3, \"gpus_per_node\": 4, \"pipeline_parallel_size\": 2",
         "topology.pipeline_parallel_size is 2, but the 12 GPUs", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 16",
         "topology.pipeline_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"virtual_pipeline_size\": 2",
         "topology.virtual_pipeline_size is 2, but pipeline_parallel_size is 1", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"pipeline_schedule\": \"interleaved\"",
         "topology.pipeline_schedule is \"interleaved\", but virtual_pipeline_size is 1", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"virtual_pipeline_size\": 3,"
         " \"pipeline_schedule\": \"1f1b\"",
         "topology.pipeline_schedule is \"1f1b\", but virtual_pipeline_size is 3", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"pipeline_schedule\": \"gpipe\"",
         "topology.pipeline_schedule must be one of \"1f1b\", \"interleaved\", got \"gpipe\"", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [4, 1]",
         "topology.layers_per_stage sums to 5 layers, but model.num_layers is 6", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [6]",
         "topology.layers_per_stage must be an array of 2 layer counts, one per virtual stage", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [7, -1]",
         "topology.layers_per_stage[0]", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 8",
         "topology.ep_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 16",
         "topology.ep_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 3",
         "topology.ep_size must give EP groups that divide one pipeline stage: 3 EP ranks x 1 GPUs "
         "(expert_tensor_parallel_size) = 3 GPUs, but a stage has 8", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4, \"tensor_parallel_size\": 4",
         "topology.tensor_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"dp_size\": 16",
         "topology.dp_size must equal the GPUs over tensor_parallel_size x pipeline_parallel_size, 16 / (1 x 2) = 8, "
         "got 16", RP_EINVAL},
    };
    check_config_refusals(config, bad, sizeof bad / sizeof bad[0]);
}

/* Memory: a GPU holds only its stage's layers; the busiest stage decides. */
static void test_memory(void)
{
    rp_error err;
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 4, \"slots_per_gpu\": 2", "", &err);
    rp_config *pp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2,"
                           " \"slots_per_gpu\": 2, \"layers_per_stage\": [2, 4]",
                           "", &err);
    rp_gpu_memory a, b;
    if (!one || !pp || rp_memory_gpu(one, NULL, 0, &a, &err) != RP_OK || rp_memory_gpu(pp, NULL, 0, &b, &err) != RP_OK) {
        diag("%s", err.text);
        skip(3, "configs");
    } else {
        ok(a.pipeline_stage == 0 && a.stage_layers == 6, "PP 1: stage 0 holds all 6 layers");
        ok(b.pipeline_stage == 1 && b.stage_layers == 4, "PP 2 with [2, 4]: stage 1 is the busiest, 4 layers");
        ok(close_to(b.expert_weight_bytes, a.expert_weight_bytes * 4 / 6) &&
               close_to(b.staging_bytes, a.staging_bytes * 4 / 6) &&
               close_to(b.dense_weight_bytes, a.dense_weight_bytes * 4 / 6),
           "its expert, staging and dense bytes are 4/6 of PP 1's (%.0f of %.0f expert weight bytes)",
           b.expert_weight_bytes, a.expert_weight_bytes);
    }
    rp_config_free(one);
    rp_config_free(pp);
}

/* ---- the schedule and its critical path, with op times set by hand ---- */

typedef struct hand_times {
    const double *fwd, *bwd; /* [k] by position, the same on every stage */
    double p2p;
} hand_times;

static double hand_run(void *ud, int32_t kind, int32_t v, int32_t k, double start)
{
    (void)v;
    const hand_times *h = ud;
    if (kind == COST_PIPE_F) return start + h->fwd[k];
    if (kind == COST_PIPE_B) return start + h->bwd[k];
    return start + h->fwd[k] + h->bwd[k];
}

static double hand_p2p(void *ud, int32_t kind, int32_t from, int32_t to, int32_t k)
{
    (void)kind, (void)from, (void)to, (void)k;
    return ((const hand_times *)ud)->p2p;
}

static double critical_path(int32_t PP, int32_t V, rp_pipeline_schedule sched, int32_t M, const double *fwd,
                            const double *bwd, double p2p, int32_t *num_ops)
{
    int64_t cap = cost_pipe_capacity(PP, V, M);
    cost_pipe_op *ops = malloc((size_t)cap * sizeof *ops);
    int32_t begin[17], next[16];
    double *fend = malloc((size_t)PP * V * M * sizeof(double)), *bend = malloc((size_t)PP * V * M * sizeof(double)),
           tdev[16];
    cost_pipe_schedule(PP, V, sched, M, ops, begin);
    hand_times h = {fwd, bwd, p2p};
    cost_pipe_times times = {hand_run, hand_p2p, &h};
    cost_pipe_buf buf = {fend, bend, tdev, next};
    double span = cost_pipe_run(PP, V, M, ops, begin, &buf, &times);
    if (num_ops) *num_ops = begin[PP];
    /* every (virtual stage, position) runs its forward and its backward exactly once */
    int32_t *seen = calloc((size_t)PP * V * M, sizeof(int32_t));
    bool once = true;
    for (int32_t i = 0; i < begin[PP]; i++) seen[(size_t)ops[i].v * M + ops[i].k] += ops[i].kind == COST_PIPE_FB ? 3 : ops[i].kind + 1;
    for (int32_t i = 0; i < PP * V * M; i++) once &= seen[i] == 3;
    if (!once) span = -1;
    free(seen);
    free(ops);
    free(fend);
    free(bend);
    return span;
}

static void test_schedule(void)
{
    /* 2 stages x 3 microbatches, forward w, backward 2w, the same on both stages:
     * stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0B0 F1B1 F2B2 (its forward and backward of
     * a microbatch back to back). By hand, w = 1, 2, 3: F0 0-1 | F1 1-3 || FB0 1-4 | B0
     * 4-6 | F2 6-9 || FB1 4-10 | B1 10-14 || FB2 10-19 | B2 19-25: 25. */
    double w[3] = {1, 2, 3}, w2[3] = {2, 4, 6};
    int32_t n = 0;
    ok(critical_path(2, 1, RP_SCHEDULE_1F1B, 3, w, w2, 0, &n) == 25.0 && n == 9,
       "2 stages x 3 microbatches (1, 2, 3): critical path 25, 9 ops");
    /* with a p2p of 0.5 on each of the 9 stage crossings of the critical path... by hand:
     * F0 0-1 | F1 1-3 || FB0 1.5-4.5 | B0 5-7 | F2 7-10 || FB1 4.5-10.5 | B1 11-15 ||
     * FB2 10.5-19.5 | B2 20-26 */
    ok(critical_path(2, 1, RP_SCHEDULE_1F1B, 3, w, w2, 0.5, NULL) == 26.0, "with a p2p of 0.5: 26");
    /* one heavy microbatch among light ones: its position changes the step */
    double first[3] = {3, 1, 1}, middle[3] = {1, 3, 1}, last[3] = {1, 1, 3}, b1[3], b2[3], b3[3];
    for (int i = 0; i < 3; i++) b1[i] = 2 * first[i], b2[i] = 2 * middle[i], b3[i] = 2 * last[i];
    double s_first = critical_path(2, 1, RP_SCHEDULE_1F1B, 3, first, b1, 0, NULL);
    double s_middle = critical_path(2, 1, RP_SCHEDULE_1F1B, 3, middle, b2, 0, NULL);
    double s_last = critical_path(2, 1, RP_SCHEDULE_1F1B, 3, last, b3, 0, NULL);
    ok(s_first == 24.0 && s_middle == 21.0 && s_last == 24.0,
       "heavy first 24, in the middle 21, last 24 (got %g, %g, %g)", s_first, s_middle, s_last);
    /* uniform microbatches: (M + PP - 1) (f + b) for 1F1B */
    int bad = 0;
    double f[16], b[16];
    for (int i = 0; i < 16; i++) f[i] = 1.0, b[i] = 2.0;
    for (int32_t PP = 1; PP <= 4; PP++)
        for (int32_t M = 1; M <= 12; M++) {
            double span = critical_path(PP, 1, RP_SCHEDULE_1F1B, M, f, b, 0, NULL);
            if (span != (M + PP - 1) * 3.0) bad++, diag("PP %d M %d: %g", PP, M, span);
        }
    ok(bad == 0, "uniform microbatches under 1F1B: (M + PP - 1) x (f + b) for PP 1-4, M 1-12");
    /* interleaved: every pass once, no deadlock, and fewer bubbles than 1F1B with the same
     * work per stage (Narayanan et al. 2021: the bubble shrinks by V) */
    bad = 0;
    int better = 0, cases = 0;
    for (int32_t PP = 2; PP <= 4; PP++)
        for (int32_t V = 2; V <= 3; V++)
            for (int32_t M = PP; M <= 12; M += PP) {
                double fv[16], bv[16];
                for (int i = 0; i < 16; i++) fv[i] = 1.0 / V, bv[i] = 2.0 / V;
                double span = critical_path(PP, V, RP_SCHEDULE_INTERLEAVED, M, fv, bv, 0, NULL);
                double plain = critical_path(PP, 1, RP_SCHEDULE_1F1B, M, f, b, 0, NULL);
                cases++;
                if (!(span > 0) || !isfinite(span)) bad++, diag("PP %d V %d M %d: %g", PP, V, M, span);
                if (span < plain - 1e-9 && span >= M * 3.0 - 1e-9) better++;
                else diag("PP %d V %d M %d: interleaved %g, 1F1B %g", PP, V, M, span, plain);
            }
    ok(bad == 0, "interleaved (PP 2-4, V 2-3, M a multiple of PP up to 12): every pass once, no deadlock");
    ok(better == cases, "and a critical path between the work (M x 3) and 1F1B's in each of the %d cases", cases);
    /* hand-checked interleaved: PP 2, V 2, M 2, f 1 b 2 per virtual stage. Warm-up on stage 0
     * is 2 + 2 = 4 (all its forwards), on stage 1 2. Stage 0 runs F(v0,0) F(v0,1) F(v2,0)
     * F(v2,1) B(v2,0) B(v2,1) B(v0,0) B(v0,1), stage 1 F(v1,0) F(v1,1) FB(v3,0) FB(v3,1)
     * B(v1,0) B(v1,1). By hand: s0 0-1 1-2 | s1 1-2 2-3 | s0 2-3 3-4 | s1 3-6 6-9 | s0 B v2
     * 6-8 9-11 | s1 B v1 9-11 11-13 | s0 B v0 11-13 13-15: 15 */
    double f2[2] = {1, 1}, bb2[2] = {2, 2};
    int32_t n2 = 0;
    double span = critical_path(2, 2, RP_SCHEDULE_INTERLEAVED, 2, f2, bb2, 0, &n2);
    ok(span == 15.0 && n2 == 14, "interleaved PP 2 x V 2, 2 microbatches: 15 by hand, 14 ops (got %g, %d)", span, n2);
}

/* ---- the cost model under PP on random plans ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

/* A random batch of 8-31 sequences routed over 8 experts at 6 layers, packed at random
 * into M microbatches, with a random placement (extra replicas where slots are spare). */
static bool scene_make(random_scene *s, const char *topo, const char *extra, int32_t M)
{
    rp_error err;
    /* a random packing breaks a low token cap: only the joint test sets one, and plans itself */
    bool made = random_scene_make(ctx, s, config(topo, extra, &err), 8, 300, 0, M, token_cap == 0, &rng_state, &err);
    if (!made) diag("scene on %s: %s", topo, err.text);
    return made;
}

/* PP 1 is the sum over (m, l) of the layer times, added in that order, as before pipelines:
 * under global sync with no replica to reduce, the step is exactly that sum. */
static void test_pp1_exact(void)
{
    int bad = 0, cases = 0;
    for (int it = 0; it < 20; it++) {
        random_scene s;
        const char *topo = it % 2 ? "\"num_nodes\": 1, \"gpus_per_node\": 4, \"pipeline_parallel_size\": 1"
                                  : "\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 2";
        const char *extra = it % 4 < 2 ? ", \"execution\": {\"sync\": \"global\"}"
                                       : ", \"execution\": {\"sync\": \"global\", \"overlap\": \"layer\"}";
        rp_cost *cost = NULL;
        rp_cost_summary sum;
        rp_error err;
        if (!scene_make(&s, topo, extra, 1 + (int32_t)rnd(4)) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK) {
            bad++;
        } else {
            double ref = 0.0;
            for (int32_t m = 0; m < s.M; m++)
                for (int32_t l = 0; l < 6; l++) ref += rp_cost_layer_s(cost, m, l);
            ref += sum.grad_reduce_s + sum.extra_copy_s;
            cases++;
            if (sum.step_s != ref) bad++, diag("case %d: step %.17g, sum of layers %.17g", it, sum.step_s, ref);
        }
        rp_cost_free(cost);
        random_scene_free(&s);
    }
    ok(bad == 0 && cases == 20, "PP 1: the step is the sum of T(m, l) in (m, l) order, bit for bit (%d plans)", cases);
}

/* Uniform microbatches through the evaluator: PP 2 with one layer per stage, every
 * microbatch the same sequences' worth... approximated by identical cells: the step is
 * (M + 1) x T where T is one layer's combined time (no p2p: infinite bandwidth, no latency). */
static void test_uniform(void)
{
    rp_error err;
    char topo[] = "\"num_nodes\": 1, \"gpus_per_node\": 2, \"pipeline_parallel_size\": 2,"
                  " \"nvlink_latency_us\": 0, \"net_latency_us\": 0, \"nvlink_bytes_per_s\": 1e300,"
                  " \"layers_per_stage\": [3, 3]";
    rp_config *cfg = config(topo, ", \"execution\": {\"sync\": \"global\"}", &err);
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 1", ", \"execution\": {\"sync\": \"global\"}", &err);
    if (!cfg || !one) {
        diag("%s", err.text);
        skip(2, "config");
        rp_config_free(cfg);
        rp_config_free(one);
        return;
    }
    /* 4 microbatches of one sequence of 100 tokens each, every token to experts 0 and 1 */
    int32_t lens[4] = {100, 100, 100, 100}, zero[4] = {0}, rank[4] = {0}, mb[4] = {0, 1, 2, 3};
    rp_batch *batch = NULL;
    rp_batch_new(ctx, 4, lens, zero, NULL, &batch, &err);
    uint8_t *ids = malloc(400 * 6 * 2);
    for (int k = 0; k < 400 * 6; k++) ids[2 * k] = 0, ids[2 * k + 1] = 1;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 6, 2, ids);
    rp_stats *stats = NULL;
    rp_stats_compute(ctx, batch, &r, 8, 1, &stats, &err);
    rp_plan *pp = NULL, *flat = NULL;
    rp_plan_new(ctx, cfg, 4, &pp, &err);
    rp_plan_new(ctx, one, 4, &flat, &err);
    rp_plan_set_packing(pp, 4, rank, mb, &err);
    rp_plan_set_packing(flat, 4, rank, mb, &err);
    rp_plan_set_contiguous(pp, &err);
    rp_plan_set_contiguous(flat, &err);
    rp_cost *c_pp = NULL, *c_flat = NULL;
    rp_cost_summary a, b;
    if (rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &c_pp, &err) != RP_OK ||
        rp_cost_evaluate(c_pp, pp, &a, &err) != RP_OK ||
        rp_cost_new(ctx, one, batch, stats, RP_SPLIT_EVEN, &c_flat, &err) != RP_OK ||
        rp_cost_evaluate(c_flat, flat, &b, &err) != RP_OK) {
        diag("%s", err.text);
        skip(2, "evaluation");
    } else {
        /* one GPU, one stage: 4 microbatches x 6 layers of T; PP 2 of 3 layers each:
         * (4 + 2 - 1) x 3 T, as 1F1B's (M + PP - 1) x (f + b) */
        double T = b.step_s / 24.0;
        ok(fabs(a.step_s - 5 * 3 * T) <= 1e-12 * a.step_s, "PP 2, 4 uniform microbatches: 5 x 3 T = %.6g s (got %.6g)",
           15 * T, a.step_s);
        ok(a.lower_bound_s <= a.step_s && fabs(a.lower_bound_s - b.lower_bound_s / 2) <= 1e-9 * a.step_s,
           "the bound: the busiest stage's work, half the one-stage bound");
        /* the pipeline figures: path 5 x 3 T, each stage busy 4 x 3 T, idle (PP - 1) x 3 T;
         * the sums over (mb, layer) are every stage's work, 24 T's worth as on one stage */
        rp_pipeline_summary p, p1;
        rp_status pst = rp_cost_pipeline_summary(c_pp, &p, &err), pst1 = rp_cost_pipeline_summary(c_flat, &p1, &err);
        ok(pst == RP_OK && pst1 == RP_OK && p.stages == 2 && p.step_s == a.step_s && fabs(p.critical_path_s - 15 * T) <= 1e-12 * a.step_s &&
               fabs(p.stage_busy_s - 12 * T) <= 1e-12 * a.step_s && fabs(p.bubble_s - 3 * T) <= 1e-12 * a.step_s &&
               p.busiest_stage == 0,
           "pipeline: critical path 15 T (%.6g s), busiest stage 12 T (%.6g s), bubble 3 T (%.6g s)",
           p.critical_path_s, p.stage_busy_s, p.bubble_s);
        ok(p1.stages == 1 && p1.critical_path_s == b.step_s - b.grad_reduce_s - b.extra_copy_s &&
               p1.stage_busy_s == p1.critical_path_s && p1.bubble_s == 0 &&
               fabs(a.expert_s - b.expert_s) <= 1e-12 * b.expert_s,
           "PP 1: path = busy = the step, no bubble; the expert term sums every stage's work (PP 2 %.6g s = PP 1 "
           "%.6g s)", a.expert_s, b.expert_s);
        /* 2 mini-batches of 2 microbatches, 2 epochs: each mini-batch its own pipeline,
         * path (2 + 1) x 3 T each, 2 x 2 x 9 T = 36 T; each stage busy 2 x 4 x 3 T = 24 T */
        rp_config *mb2 = config(topo, ", \"execution\": {\"sync\": \"global\"},"
                                " \"trainer\": {\"mini_batches\": 2, \"epochs\": 2}", &err);
        rp_cost *c_mb = NULL;
        rp_cost_summary sm;
        pst = mb2 ? rp_cost_new(ctx, mb2, batch, stats, RP_SPLIT_EVEN, &c_mb, &err) : RP_EINVAL;
        if (pst == RP_OK) pst = rp_cost_evaluate(c_mb, pp, &sm, &err);
        if (pst == RP_OK) pst = rp_cost_pipeline_summary(c_mb, &p, &err);
        ok(pst == RP_OK && fabs(p.critical_path_s - 36 * T) <= 1e-12 * sm.step_s &&
               fabs(p.stage_busy_s - 24 * T) <= 1e-12 * sm.step_s && fabs(p.bubble_s - 12 * T) <= 1e-12 * sm.step_s &&
               fabs(sm.step_s - 36 * T) <= 1e-12 * sm.step_s,
           "2 mini-batches x 2 epochs: path 36 T (%.6g s), busiest stage 24 T, bubble 12 T", p.critical_path_s);
        if (pst != RP_OK) diag("%s", err.text);
        rp_cost_free(c_mb);
        rp_config_free(mb2);
        rp_cost *fresh = NULL;
        pst = rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &fresh, &err);
        if (pst == RP_OK) pst = rp_cost_pipeline_summary(fresh, &p, &err);
        ok(pst == RP_EINVAL && strstr(err.text, "no plan has been evaluated"), "before an evaluation: %s", err.text);
        rp_cost_free(fresh);
    }
    rp_cost_free(c_pp);
    rp_cost_free(c_flat);
    rp_plan_free(pp);
    rp_plan_free(flat);
    rp_stats_free(stats);
    free(ids);
    rp_batch_free(batch);
    rp_config_free(cfg);
    rp_config_free(one);
}

static void test_random(void)
{
    static const char *const syncs[] = {"group", "global"}, *const overlaps[] = {"none", "layer"};
    int bad_bound = 0, bad_try = 0, cases = 0, tries = 0;
    for (int it = 0; it < 40; it++) {
        int pp = 2 << rnd(2), vpp = it % 3 == 0 ? 1 + (int)rnd(2) : 1, nodes = 1 + (int)rnd(2);
        char topo[512], extra[256];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": %d, \"gpus_per_node\": 8, \"pipeline_parallel_size\": %d,"
                 " \"virtual_pipeline_size\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d",
                 nodes, pp, vpp, 1 << rnd(2), 8 + (int)rnd(2));
        snprintf(extra, sizeof extra, ", \"execution\": {\"sync\": \"%s\", \"overlap\": \"%s\"}", syncs[rnd(2)],
                 overlaps[rnd(2)]);
        int32_t M = vpp > 1 ? pp * (1 + (int32_t)rnd(2)) : 1 + (int32_t)rnd(5);
        random_scene s;
        rp_cost *cost = NULL;
        rp_cost_summary sum;
        rp_error err;
        if (!scene_make(&s, topo, extra, M) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK) {
            diag("case %d (%s): %s", it, topo, err.text);
            bad_bound++;
        } else {
            cases++;
            if (!(sum.lower_bound_s <= sum.step_s * (1 + 1e-12)) || !isfinite(sum.step_s)) {
                bad_bound++;
                diag("case %d (%s%s): bound %.9g > step %.9g", it, topo, extra, sum.lower_bound_s, sum.step_s);
            }
            const int32_t G = rp_config_topology(s.cfg)->num_gpus;
            for (int k = 0; k < 3; k++) {
                int32_t q = (int32_t)rnd((uint32_t)s.n), g = (int32_t)rnd((uint32_t)G), m = (int32_t)rnd((uint32_t)M);
                double tried = rp_cost_try_move(cost, q, g, m);
                if (isfinite(tried) && rp_cost_apply_move(cost, s.plan, q, g, m, &err) == RP_OK) {
                    rp_cost *fresh = NULL;
                    rp_cost_summary fs;
                    rp_cost_new(ctx, s.cfg, s.batch, s.stats, it % 2 ? RP_SPLIT_LOCALITY : RP_SPLIT_EVEN, &fresh, &err);
                    tries++;
                    if (rp_cost_evaluate(fresh, s.plan, &fs, &err) != RP_OK || fs.step_s != tried) {
                        bad_try++;
                        diag("case %d: try %.17g, full %.17g", it, tried, fs.step_s);
                    }
                    rp_cost_free(fresh);
                }
            }
        }
        rp_cost_free(cost);
        random_scene_free(&s);
    }
    ok(bad_bound == 0 && cases == 40, "bound <= step on %d random plans with PP 2-4, VPP 1-2, every sync and overlap",
       cases);
    ok(bad_try == 0 && tries > 40, "a tried move equals a full evaluation of the moved plan, bit for bit (%d moves)",
       tries);
}

/* ---- the microbatch order: plan API, format, validation, cost ---- */

static void test_order(void)
{
    rp_error err;
    rp_config *cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 2,"
                            " \"nvlink_latency_us\": 0, \"nvlink_bytes_per_s\": 1e300",
                            "", &err);
    if (!cfg) {
        diag("%s", err.text);
        skip(12, "config");
        return;
    }
    /* 4 DP ranks in 2 EP groups of 2; 3 microbatches, microbatch 0 heavy */
    int32_t lens[6] = {400, 400, 40, 40, 40, 40}, zero[6] = {0};
    int32_t rank[6] = {0, 2, 0, 2, 0, 2}, mb[6] = {0, 0, 1, 1, 2, 2};
    rp_batch *batch = NULL;
    rp_batch_new(ctx, 6, lens, zero, NULL, &batch, &err);
    int64_t tokens = rp_batch_num_tokens(batch);
    uint8_t *ids = malloc((size_t)tokens * 6 * 2);
    for (int64_t k = 0; k < tokens * 6; k++) ids[2 * k] = (uint8_t)(k % 8), ids[2 * k + 1] = (uint8_t)((k + 3) % 8);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 6, 2, ids);
    rp_stats *stats = NULL;
    rp_stats_compute(ctx, batch, &r, 8, 1, &stats, &err);
    rp_plan *plan = NULL;
    rp_plan_new(ctx, cfg, 3, &plan, &err);
    rp_plan_set_packing(plan, 6, rank, mb, &err);
    rp_plan_set_contiguous(plan, &err);

    ok(!rp_plan_has_microbatch_order(plan) && rp_plan_microbatch_order(plan, 1) == NULL &&
           rp_plan_microbatch_at(plan, 1, 2) == 2,
       "a new plan has no order: every rank runs 0, 1, 2");
    int32_t bad1[3] = {0, 3, 1}, bad2[3] = {2, 0, 2}, middle[3] = {1, 0, 2};
    ok(rp_plan_set_microbatch_order(plan, 1, bad1, &err) == RP_EINVAL &&
           strstr(err.text, "rank 1's microbatch order has 3 at position 1, but the plan has 3 microbatches"),
       "refused: a value out of range (%s)", err.text);
    ok(rp_plan_set_microbatch_order(plan, 3, bad2, &err) == RP_EINVAL &&
           strstr(err.text, "rank 3's microbatch order lists microbatch 2 twice (positions 0 and 2)"),
       "refused: a value twice (%s)", err.text);
    ok(rp_plan_set_microbatch_order(plan, 4, middle, &err) == RP_EINVAL && !rp_plan_has_microbatch_order(plan),
       "refused: a rank out of range; nothing changed");

    rp_cost *cost = NULL;
    rp_cost_summary first, mid;
    uint64_t h0 = rp_plan_hash(plan);
    rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, &err);
    rp_cost_evaluate(cost, plan, &first, &err);
    /* EP group 0 (ranks 0, 1) runs the heavy microbatch in the middle: only rank 0 differs */
    rp_plan_set_microbatch_order(plan, 0, middle, &err);
    ok(rp_plan_validate(plan, cfg, batch, &err) == RP_EPLAN &&
           strstr(err.text, "rank 1 runs microbatch 0 at position 0, but rank 0 of its EP group runs 1"),
       "validation: one order per EP group (%s)", err.text);
    rp_plan_set_microbatch_order(plan, 1, middle, &err);
    ok(rp_plan_validate(plan, cfg, batch, &err) == RP_OK, "both ranks of the group in that order: valid");
    ok(rp_plan_hash(plan) != h0, "the order is part of the plan hash");
    rp_status st = rp_cost_evaluate(cost, plan, &mid, &err);
    /* group 0 holds the heavy cells (rank 0), group 1 too (rank 2): group 1 still runs
     * it first, so reorder both groups */
    rp_plan_set_microbatch_order(plan, 2, middle, &err);
    rp_plan_set_microbatch_order(plan, 3, middle, &err);
    st = st == RP_OK ? rp_cost_evaluate(cost, plan, &mid, &err) : st;
    ok(st == RP_OK && mid.step_s < first.step_s,
       "PP 2: the heavy microbatch in the middle shortens the step (%.6g s, first %.6g s)", mid.step_s, first.step_s);

    /* the format: version 2 with the order, read back the same; without it version 1 */
    char *text = NULL;
    size_t len = 0;
    rp_plan *back = NULL;
    rp_plan_to_json(plan, &text, &len, &err);
    ok(text && strstr(text, "\"version\": 2") && strstr(text, "\"microbatch_order\": [\n    [1, 0, 2],"),
       "written as version 2 with microbatch_order");
    ok(rp_plan_parse(ctx, cfg, text, len, "p.json", &back, &err) == RP_OK && rp_plan_hash(back) == rp_plan_hash(plan),
       "read back: the same plan (hash)");
    rp_text_free(ctx, text);
    rp_plan_free(back);
    for (int32_t g = 0; g < 4; g++) rp_plan_set_microbatch_order(plan, g, NULL, &err);
    text = NULL;
    rp_plan_to_json(plan, &text, &len, &err);
    ok(!rp_plan_has_microbatch_order(plan) && text && strstr(text, "\"version\": 1") &&
           !strstr(text, "microbatch_order") && rp_plan_hash(plan) == h0,
       "every rank back to the identity: no order, version 1, the first hash");
    rp_text_free(ctx, text);

    rp_cost_free(cost);
    rp_plan_free(plan);
    rp_stats_free(stats);
    free(ids);
    rp_batch_free(batch);
    rp_config_free(cfg);
}

/* ---- choosing the order ---- */

static bool next_permutation(int32_t *a, int32_t n)
{
    int32_t i = n - 2;
    while (i >= 0 && a[i] >= a[i + 1]) i--;
    if (i < 0) return false;
    int32_t j = n - 1;
    while (a[j] <= a[i]) j--;
    int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
    for (int32_t l = i + 1, r = n - 1; l < r; l++, r--) t = a[l], a[l] = a[r], a[r] = t;
    return true;
}

/* rp_cost_order_microbatches against every order, under global sync (one order for the
 * job): for M <= 6 it finds the best one; for larger M it is never worse than index order. */
static void test_order_search(void)
{
    int bad_exact = 0, bad_large = 0, cases = 0, improved = 0, stale = 0;
    for (int it = 0; it < 16; it++) {
        int pp = 2 << rnd(2);
        int32_t M = it < 12 ? 2 + (int32_t)rnd(4) : 7 + (int32_t)rnd(6);
        char topo[256];
        snprintf(topo, sizeof topo,
                 "\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": %d, \"ep_size\": %d", pp,
                 8 / pp);
        random_scene s;
        rp_cost *cost = NULL;
        rp_error err;
        rp_cost_summary sum;
        if (!scene_make(&s, topo, ", \"execution\": {\"sync\": \"global\"}", M) ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, s.plan, &sum, &err) != RP_OK) {
            bad_exact++;
            rp_cost_free(cost);
            random_scene_free(&s);
            continue;
        }
        const int32_t G = rp_config_topology(s.cfg)->num_gpus;
        double identity = sum.step_s, best = INFINITY;
        if (M <= 6) {
            int32_t perm[8];
            for (int32_t k = 0; k < M; k++) perm[k] = k;
            do {
                for (int32_t g = 0; g < G; g++) rp_plan_set_microbatch_order(s.plan, g, perm, &err);
                rp_cost_evaluate(cost, s.plan, &sum, &err);
                if (sum.step_s < best) best = sum.step_s;
            } while (next_permutation(perm, M));
            for (int32_t g = 0; g < G; g++) rp_plan_set_microbatch_order(s.plan, g, NULL, &err);
            rp_cost_evaluate(cost, s.plan, &sum, &err);
        }
        double got = NAN;
        rp_status st = rp_cost_order_microbatches(cost, s.plan, &got, &err);
        rp_cost_summary again;
        rp_cost *fresh = NULL;
        rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &fresh, &err);
        bool same = rp_plan_validate(s.plan, s.cfg, s.batch, &err) == RP_OK &&
                    rp_cost_evaluate(fresh, s.plan, &again, &err) == RP_OK && again.step_s == got;
        /* the evaluator's state now holds the chosen order: the plan in index order (what
         * it was bound to) is evaluated again, not taken for the bound one */
        rp_plan *unordered = NULL;
        rp_cost_summary back;
        if (rp_plan_copy(s.plan, &unordered, &err) == RP_OK) {
            for (int32_t g = 0; g < G; g++) rp_plan_set_microbatch_order(unordered, g, NULL, &err);
            if (rp_cost_evaluate(cost, unordered, &back, &err) != RP_OK || back.step_s != identity)
                stale++, diag("case %d: index order evaluates to %.17g after ordering, %.17g before", it, back.step_s,
                              identity);
        }
        rp_plan_free(unordered);
        cases++;
        if (got < identity) improved++;
        if (M <= 6) {
            if (st != RP_OK || !same || fabs(got - best) > 1e-12 * best)
                bad_exact++, diag("case %d (PP %d, M %d): chose %.17g, best %.17g, identity %.17g", it, pp, M, got, best,
                                  identity);
        } else if (st != RP_OK || !same || got > identity) {
            bad_large++, diag("case %d (PP %d, M %d): chose %.17g, identity %.17g", it, pp, M, got, identity);
        }
        rp_cost_free(fresh);
        rp_cost_free(cost);
        random_scene_free(&s);
    }
    ok(bad_exact == 0, "M <= 6: the chosen order's step is the best over every order (brute force), and the plan's");
    ok(bad_large == 0, "M 7-12: never slower than index order");
    ok(stale == 0, "after ordering, the plan in index order evaluates to its own step again");
    diag("%d of %d plans ordered to a shorter step", improved, cases);
}

/* The joint planner under PP: a valid plan, ordered, never slower than its own packing
 * run in index order. */
static void test_joint(void)
{
    int bad = 0, ordered = 0, cases = 0;
    for (int it = 0; it < 6; it++) {
        random_scene s;
        rp_error err;
        char topo[256];
        snprintf(topo, sizeof topo, "\"num_nodes\": 2, \"gpus_per_node\": 4, \"pipeline_parallel_size\": 2,"
                                    " \"ep_size\": 4, \"slots_per_gpu\": 3");
        token_cap = 300 + 100 * it; /* several microbatches per rank */
        bool made = scene_make(&s, topo, it % 2 ? ", \"execution\": {\"sync\": \"global\"}" : "", 2);
        token_cap = 0;
        if (!made) {
            random_scene_free(&s);
            bad++;
            continue;
        }
        rp_joint_params par = rp_joint_defaults();
        rp_plan *plan = NULL;
        rp_joint_report rep;
        rp_cost *cost = NULL;
        rp_cost_summary with, without;
        if (rp_joint_plan(ctx, s.cfg, s.batch, s.stats, NULL, NULL, &par, &plan, &rep, &err) != RP_OK ||
            rp_plan_validate(plan, s.cfg, s.batch, &err) != RP_OK ||
            rp_cost_new(ctx, s.cfg, s.batch, s.stats, RP_SPLIT_EVEN, &cost, &err) != RP_OK ||
            rp_cost_evaluate(cost, plan, &with, &err) != RP_OK) {
            diag("case %d: %s", it, err.text);
            bad++;
        } else {
            cases++;
            ordered += rp_plan_has_microbatch_order(plan);
            for (int32_t g = 0; g < rp_plan_num_gpus(plan); g++) rp_plan_set_microbatch_order(plan, g, NULL, &err);
            rp_cost_evaluate(cost, plan, &without, &err);
            if (with.step_s > without.step_s) bad++, diag("case %d: ordered %.9g, index order %.9g", it, with.step_s, without.step_s);
        }
        rp_cost_free(cost);
        rp_plan_free(plan);
        random_scene_free(&s);
    }
    ok(bad == 0 && cases == 6, "the joint planner under PP 2: valid plans, ordered no slower than index order (%d of %d "
       "carry an order)", ordered, cases);
}

/* The bundled PP example fits its GPUs; a PP config runs in `routepack simulate` (the
 * bundled trace, a small pipeline: 2 stages of 4 GPUs, interleaved). */
static void test_examples(void)
{
    rp_error err;
    rp_config *cfg = NULL;
    rp_gpu_memory m;
    rp_status st = rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-qwen3-30b-pp2.json", &cfg, &err);
    ok(st == RP_OK && rp_memory_peak(cfg, NULL, &m, &err) == RP_OK && m.total_bytes <= m.capacity_bytes &&
           rp_config_topology(cfg)->pipeline_parallel_size == 2 && m.stage_layers == 24,
       "config-qwen3-30b-pp2.json loads and fits (%.1f GB of %.0f GB, 24 of 48 layers a GPU)",
       st == RP_OK ? m.total_bytes / 1e9 : 0, st == RP_OK ? m.capacity_bytes / 1e9 : 0);
    rp_config_free(cfg);
    cfg = NULL;
    st = rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-deepseek-v3-pp.json", &cfg, &err);
    if (st == RP_OK) st = rp_memory_peak(cfg, NULL, &m, &err); /* before ok() reads m for its message */
    const rp_topology *t = st == RP_OK ? rp_config_topology(cfg) : NULL;
    ok(t && m.total_bytes <= m.capacity_bytes &&
           t->pipeline_parallel_size == 4 && t->num_gpus == 64 && t->ep_size == 64 && t->num_ep_groups == 1 &&
           t->physical_num_nodes == 32 && m.stage_layers == 15 && rp_config_model(cfg)->num_layers == 58 &&
           rp_config_model(cfg)->num_experts == 256,
       "config-deepseek-v3-pp.json: EP 64 over a stage's 8 nodes, PP 4 on 32 nodes, 15 of 58 MoE layers a GPU, "
       "%.1f GB of %.0f GB", t ? m.total_bytes / 1e9 : 0, t ? m.capacity_bytes / 1e9 : 0);
    if (!t) diag("%s", err.text);
    rp_config_free(cfg);

    char dir[64];
    if (!temp_dir_make(dir, sizeof dir, "pipeline")) {
        skip(3, "no scratch directory");
        return;
    }
    const char *text =
        "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2,"
        " \"virtual_pipeline_size\": 2, \"ep_size\": 4, \"slots_per_gpu\": 18},"
        " \"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8, \"hidden_size\": 2048,"
        " \"expert_ffn_size\": 1024, \"num_heads\": 16, \"head_dim\": 128},"
        " \"limits\": {\"max_tokens_per_microbatch\": 1024}}";
    char path[512];
    snprintf(path, sizeof path, "%s", temp_path(dir, "pp.json"));
    spit(path, text, strlen(text));
    static char out[1 << 16];
    int rc = run_routepack(out, sizeof out, "simulate --config '%s' --trace '%s/examples/small.rpt' --steps 2 --quiet",
                           path, RP_SOURCE_DIR);
    bool header = strstr(out, "per pipeline stage, of 2 (interleaved, 2 virtual stages each; 8 GPUs on 1 node in all)");
    ok(rc == 0 && header, "routepack simulate runs a PP 2 x VPP 2 config");
    ok(strstr(out, "verdict:") != NULL, "and gives its verdict");
    if (rc != 0 || !header || !strstr(out, "verdict:")) diag("exit %d: %s", rc, out);
    /* plan eval names the pipeline's figures and what the sums are */
    rc = run_routepack(out, sizeof out, "simulate --config '%s' --trace '%s/examples/small.rpt' --steps 1 --quiet "
                       "--policies token_kk --plans '%s'", path, RP_SOURCE_DIR, temp_path(dir, "plans"));
    if (rc == 0)
        rc = run_routepack(out, sizeof out, "plan eval --config '%s' --trace '%s/examples/small.rpt' --step 0 --plan "
                           "'%s/token_kk/step-0.json'", path, RP_SOURCE_DIR, temp_path(dir, "plans"));
    ok(rc == 0 && strstr(out, "pipeline             2 stages: the step is the schedule's critical path") &&
           strstr(out, "  busiest stage  ") && strstr(out, "  bubble  ") &&
           strstr(out, "sum over microbatches and the layers of every stage"),
       "plan eval under PP prints the critical path, the busiest stage, the bubble, and names the sums");
    if (rc != 0) diag("exit %d: %s", rc, out);
    unlink(temp_path(dir, "plans/token_kk/step-0.json")); /* temp_dir_remove takes no subdirectories */
    rmdir(temp_path(dir, "plans/token_kk"));
    rmdir(temp_path(dir, "plans"));
    temp_dir_remove(dir);
}

/* Migration under PP: the stages migrate at once, so moving every layer's experts takes
 * the busiest stage's time, half of PP 1's when the 2 stages hold half the layers each. */
static void test_migration(void)
{
    rp_error err;
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 2", "", &err);
    rp_config *pp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 4,"
                           " \"slots_per_gpu\": 2", "", &err);
    int32_t lens[1] = {10}, zero[1] = {0};
    rp_batch *batch = NULL;
    rp_batch_new(ctx, 1, lens, zero, NULL, &batch, &err);
    uint8_t ids[10 * 6 * 2] = {0};
    for (int k = 0; k < 60; k++) ids[2 * k + 1] = 1;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 6, 2, ids);
    rp_stats *stats = NULL;
    rp_stats_compute(ctx, batch, &r, 8, 1, &stats, &err);
    double t[2] = {0, 0}, b[2] = {0, 0};
    rp_config *cfgs[2] = {one, pp};
    for (int i = 0; i < 2; i++) {
        rp_plan *from = NULL, *to = NULL;
        rp_cost *cost = NULL;
        if (!cfgs[i] || rp_plan_new(ctx, cfgs[i], 1, &from, &err) != RP_OK || rp_plan_set_contiguous(from, &err) ||
            rp_plan_copy(from, &to, &err) || rp_cost_new(ctx, cfgs[i], batch, stats, RP_SPLIT_EVEN, &cost, &err)) {
            diag("%s", err.text);
        } else {
            /* every layer: EP ranks 0 and 1 swap their experts */
            for (int32_t l = 0; l < 6; l++) {
                int32_t row[8];
                memcpy(row, rp_plan_phy2log(from, l), sizeof row);
                for (int k = 0; k < 2; k++) {
                    int32_t x = row[k];
                    row[k] = row[2 + k];
                    row[2 + k] = x;
                }
                rp_plan_set_phy2log(to, l, row, &err);
            }
            rp_cost_migration(cost, from, to, &t[i], &b[i], &err);
        }
        rp_cost_free(cost);
        rp_plan_free(from);
        rp_plan_free(to);
    }
    /* one GPU's copies over NVLink: bytes / bw + 3 us of latency, half the bytes per stage */
    const double lat = 3e-6, half = (t[0] - lat) / 2 + lat;
    ok(t[0] > lat && b[0] == b[1] && fabs(t[1] - half) <= 1e-9 * t[0],
       "the same bytes move (%.0f); the time is the busiest stage's: half the bytes (%.4g us, PP 1 %.4g us)", b[1],
       t[1] * 1e6, t[0] * 1e6);
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(one);
    rp_config_free(pp);
}

/* Extra replicas under PP: a stage's GPUs copy (and hold) only its own layers' extra
 * replicas, and the stages copy at once, so the step counts the stage with the most copy
 * time and a GPU's memory the extras of its own stage (before: the sum over every layer). */
static void test_extras(void)
{
    rp_error err;
    /* extras copied per microbatch and layer, as the "ideal" executor prices them
     * (routepack_torch fetches a step's extras once: test_cost_executor.c) */
    rp_config *pp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 4,"
                           " \"slots_per_gpu\": 2", ", \"execution\": {\"executor\": \"ideal\"}", &err);
    int32_t lens[1] = {10}, zero[1] = {0}, rank[1] = {0}, mb[1] = {0};
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    rp_plan *plan = NULL;
    rp_cost *cost = NULL;
    uint8_t ids[10 * 6 * 2] = {0};
    for (int k = 0; k < 60; k++) ids[2 * k + 1] = 1;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 6, 2, ids);
    rp_cost_summary sum;
    rp_gpu_memory m1, m2;
    /* EP rank j holds experts 2j and 2j + 1; rank 1 also gets expert 0 at layer 0 (stage 0)
     * and experts 0 and 1 at layer 3 (stage 1) */
    if (!pp || rp_batch_new(ctx, 1, lens, zero, NULL, &batch, &err) != RP_OK ||
        rp_stats_compute(ctx, batch, &r, 8, 1, &stats, &err) != RP_OK || rp_plan_new(ctx, pp, 1, &plan, &err) ||
        rp_plan_set_contiguous(plan, &err) || rp_plan_set_packing(plan, 1, rank, mb, &err) ||
        rp_plan_add_extra_replica(plan, 0, 0, 0, 1, &err) || rp_plan_add_extra_replica(plan, 0, 3, 0, 1, &err) ||
        rp_plan_add_extra_replica(plan, 0, 3, 1, 1, &err) ||
        rp_cost_new(ctx, pp, batch, stats, RP_SPLIT_EVEN, &cost, &err) || rp_cost_evaluate(cost, plan, &sum, &err) ||
        rp_memory_gpu(pp, plan, 1, &m1, &err) || rp_memory_gpu(pp, plan, 2, &m2, &err)) {
        diag("%s", err.text);
        skip(3, "no scene");
        goto out;
    }
    const rp_model *md = rp_config_model(pp);
    const rp_topology *t = rp_config_topology(pp);
    const double bytes = 3.0 * md->hidden_size * md->expert_ffn_size * md->bytes_per_param;
    const double s0 = 2 * (1 * bytes / t->nvlink_bytes_per_s + t->nvlink_latency_s);
    const double s1 = 2 * (2 * bytes / t->nvlink_bytes_per_s + t->nvlink_latency_s);
    ok(close_to(sum.extra_copy_s, s1), "extra-replica copies: the busier stage's %.4g us (stage 0 %.4g us; the sum "
       "would be %.4g us)", sum.extra_copy_s * 1e6, s0 * 1e6, (s0 + s1) * 1e6);
    ok(m1.extra_replicas == 2 && m1.pipeline_stage == 1 &&
           close_to(m1.extra_replica_bytes, 2 * bytes / md->bytes_per_param * (md->bytes_per_param + md->bytes_per_grad)),
       "GPU 1's memory: the 2 extra replicas of its stage 1 (%lld; all layers would count 3)",
       (long long)m1.extra_replicas);
    ok(m2.extra_replicas == 0 && m2.pipeline_stage == 0 && m2.total_bytes < m1.total_bytes,
       "GPU 2 (no extras): the lowest of the equal stages");
out:
    rp_cost_free(cost);
    rp_plan_free(plan);
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(pp);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_config();
    test_memory();
    test_schedule();
    test_pp1_exact();
    test_uniform();
    test_random();
    test_order();
    test_order_search();
    test_joint();
    test_examples();
    test_migration();
    test_extras();
    rp_context_free(ctx);
    return tap_done();
}
