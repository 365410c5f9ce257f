/* Executor profiles (execution.executor, routepack/executor.h): every term a profile
 * changes, computed by hand on tiny configs, and the levers each one runs. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>

static rp_context *ctx;

/* G GPUs in one node, EP size ep, E experts, top-1, one layer, `bpp` bytes a parameter:
 *   a token-choice's hidden vector d = 4 elements; NVLink 8 B/s, latency 0.5 s
 *   one expert's parameters 3 d f = 24: weights 24 bpp bytes (48 at BF16)
 *   t(n) = max(0.75 n / eff(n), 3 d f bpp / hbm); no token-linear work, no fixed cost;
 *   backward 2 x forward for every compute term; the communication's stays 1. */
static const char *CFG =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d,"
    "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000, \"net_bytes_per_s\": 4, \"net_latency_us\": 1000000},"
    " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48, \"attention_efficiency\": 0.5,"
    "  \"dense_efficiency\": 1, \"gemm_efficiency\": [[1, 0.5], [4, 1]], \"backward_multiplier\": 2,"
    "  \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 0},"
    " \"execution\": {%s},"
    " \"model\": {\"num_layers\": 1, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 4,"
    "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"num_kv_heads\": 1, \"head_dim\": 2, \"bytes_per_param\": %d},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100}}";

typedef struct scene {
    batch_fixture f;
    rp_cost *cost;
    rp_plan *plan;
    rp_cost_summary sum;
    bool good;
} scene;

static void scene_free(scene *s)
{
    rp_plan_free(s->plan);
    rp_cost_free(s->cost);
    if (s->good || s->f.cfg) batch_fixture_free(&s->f);
    memset(s, 0, sizeof *s);
}

/* The 4-GPU scene: EP 4, 5 experts in 2 slots a GPU (rank 0 [0 1], rank 1 [1 2],
 * rank 2 [2 3], rank 3 [4 0]: experts 0, 1 and 2 twice), 8 one-token sequences (GPU g,
 * microbatch m = s / 4), sequence s routed to expert s % 5, and an extra replica of expert
 * 3 on EP rank 0 in both microbatches. */
static bool scene4_nodes(scene *s, const char *exec, int bpp, bool extras, bool two_nodes)
{
    memset(s, 0, sizeof *s);
    char json[2048];
    snprintf(json, sizeof json, CFG, 4, 4, 2, exec, 5, bpp);
    if (two_nodes) { /* the same 4 GPUs as 2 nodes of 2: EP ranks 0, 1 | 2, 3 */
        char *at = strstr(json, "\"num_nodes\": 1, \"gpus_per_node\": 4");
        if (at) memcpy(at, "\"num_nodes\": 2, \"gpus_per_node\": 2", strlen("\"num_nodes\": 2, \"gpus_per_node\": 2"));
    }
    static const int32_t lens[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    static const uint8_t ids[8] = {0, 1, 2, 3, 4, 0, 1, 2};
    static const int32_t rank[8] = {0, 1, 2, 3, 0, 1, 2, 3}, mb[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    static const int32_t p2l[8] = {0, 1, 1, 2, 2, 3, 4, 0};
    rp_error err;
    if (!batch_fixture_make(ctx, &s->f, json, 8, lens, NULL, ids, &err)) {
        diag("fixture: %s", err.text);
        return false;
    }
    s->good = rp_cost_new(ctx, s->f.cfg, s->f.batch, s->f.stats, RP_SPLIT_EVEN, &s->cost, &err) == RP_OK &&
              rp_plan_new(ctx, s->f.cfg, 2, &s->plan, &err) == RP_OK &&
              rp_plan_set_packing(s->plan, 8, rank, mb, &err) == RP_OK &&
              rp_plan_set_phy2log(s->plan, 0, p2l, &err) == RP_OK &&
              (!extras || (rp_plan_add_extra_replica(s->plan, 0, 0, 3, 0, &err) == RP_OK &&
                           rp_plan_add_extra_replica(s->plan, 1, 0, 3, 0, &err) == RP_OK)) &&
              rp_cost_evaluate(s->cost, s->plan, &s->sum, &err) == RP_OK;
    if (!s->good) diag("scene: %s", err.text);
    return s->good;
}

static bool scene4(scene *s, const char *exec, int bpp, bool extras)
{
    return scene4_nodes(s, exec, bpp, extras, false);
}

/* routepack_torch (issue 29's layer): replica gradients exchanged among the holders in
 * the weights' dtype, the step's extras fetched once (their gradients in the same
 * exchange) and run from buffers (no stack), one sync a layer; against "ideal" (the model
 * before profiles) and against the group all-reduce the layer ran before. */
static void test_routepack_torch(void)
{
    scene t, i, t0, g, tl;
    bool made = scene4(&t, "", 2, true) && scene4(&i, "\"executor\": \"ideal\"", 2, true) &&
                scene4(&t0, "\"host_us_per_layer\": 0", 2, true) &&
                scene4(&g, "\"replica_grad_reduce\": \"group\"", 2, true) &&
                scene4(&tl, "\"expert_gemm\": \"loop\"", 2, true);
    ok(made, "routepack_torch, ideal, routepack_torch without host costs, with a group all-reduce and with the "
       "per-expert loop evaluate");
    if (made) {
        /* holders: expert 0 on ranks 0 and 3, 1 on 0 and 1, 2 on 1 and 2, 3 on 2 (slot)
         * and 0 (extra): rank 0 sends 3 messages of 48 B (6 s + 0.5 s each: experts 0, 1,
         * and 3 to its slot holder, rank 2) and receives 2 (experts 0 and 1; none for the
         * extra, which it drops after the step): the longer, 19.5 s; through its memory
         * (48 B / 48 B/s a pass) it sends, receives and adds in place the two it keeps in
         * slots, 1 + 4 = 5 passes each, and only reads the extra's to send it, 1 pass.
         * Rank 2 sends 1 and receives 2 (13 s), 5 + 4 passes: 22 s */
        is_double(t.sum.grad_reduce_s, 30.5, 1e-9, "routepack_torch: rank 0 sends 3 gradients to their slot "
                  "holders, 3 x (48 B / 8 B/s + 0.5 s) = 19.5 s (it receives 2), and moves them through its "
                  "memory, (5 + 5 + 1) x 48 B / 48 B/s = 11 s");
        /* the layer before issue 29: R = 4 experts in one ring all-reduce over the EP group
         * of 4: 2 (ep - 1) / ep x 4 x 48 B / 8 B/s + 2 (ep - 1) x 0.5 s = 36 + 3 */
        is_double(g.sum.grad_reduce_s, 39.0, 1e-9, "replica_grad_reduce group: one ring all-reduce of 4 experts' "
                  "gradients over the EP group of 4: 39 s");
        /* pairwise (ideal): GPU 0 in two pairs (experts 0 and 1), 2 x (48 / 8 + 0.5) */
        is_double(i.sum.grad_reduce_s, 13.0, 1e-9, "ideal: two-party all-reduces, GPU 0 in two of 6.5 s = 13 s");
        /* once a step: EP rank 0 fetches expert 3 once, 48 B / 8 + 0.5 = 6.5 s, ahead: from
         * the step's start, behind the first microbatch's dense forward phase before the
         * layer's dispatch, the slowest GPU's: a one-token sequence's attention 2 L^2 h d_h
         * / (peak 0.5) = 4 / 32 = 0.125 s and projections 2 L d (2 h d_h + 2 h_kv d_h) / peak
         * = 64 / 64 = 1 s, and the 15 us sync: exposed 6.5 - 1.125 - 15e-6. ideal: a copy
         * and the gradient back in each microbatch, 2 x 2 x 6.5 */
        is_double(t.sum.extra_copy_s, 6.5 - 1.125 - 15e-6, 1e-9, "routepack_torch fetches the step's extra replica "
                  "once, ahead: 6.5 s less the 1.125 s + 15 us dense forward before the layer");
        is_double(i.sum.extra_copy_s, 26.0, 1e-9, "ideal: a copy and its gradient in each microbatch: 26 s");
        /* no stack: the experts' time is ideal's (the extra replica splits the same load),
         * both priced per expert (ideal loops; routepack_torch's grouped GEMM: test_cost_gemm) */
        const double *xt = rp_cost_expert_breakdown(tl.cost), *xi = rp_cost_expert_breakdown(i.cost);
        bool same = true;
        for (int k = 0; k < 8; k++) same = same && xt[k] == xi[k];
        ok(same, "no per-forward stack: every GPU's expert time is ideal's (both per expert)");
        /* host costs: one 15 us sync a (microbatch, layer) forward, 3 x with the backward,
         * 2 microbatches */
        is_double(rp_config_execution(t.f.cfg)->host_s_per_layer, 15e-6, 1e-15, "host costs 15 us a layer forward");
        is_double(t.sum.step_s - t0.sum.step_s, 3 * 2 * 15e-6 - 15e-6, 1e-9,
                  "the step pays them: 3 x 2 x 15 us, less the first one's 15 us the fetch hides behind");
        /* the breakdown gives what each GPU sends, as the layer counts it */
        char *text = NULL;
        size_t len = 0;
        rp_error err;
        ok(rp_cost_breakdown_json(t.cost, &text, &len, &err) == RP_OK && text &&
               strstr(text, "\"replica_grad\": {\"form\": \"holders\", \"bytes_per_element\": 2, \"layers\": "
                            "[{\"experts\": 4, \"bytes\": 192, \"sent_bytes\": [144, 96, 48, 48]}]}") &&
               strstr(text, "\"executor\": \"routepack_torch\""),
           "breakdown JSON: executor routepack_torch; ranks 0-3 send 3, 2, 1 and 1 gradients of 48 B (rank 2, "
           "expert 3's only slot holder, sends it to nobody)");
        rp_text_free(ctx, text);
        /* a copy per destination GPU, as ideal's */
        const double *dt = rp_cost_dispatch_breakdown(t.cost), *di = rp_cost_dispatch_breakdown(i.cost);
        same = true;
        for (int k = 0; k < 8; k++) same = same && dt[k] == di[k];
        ok(same, "routepack_torch dispatches a copy per destination GPU (ideal's \"gpu\")");
    } else {
        skip(11, "no scene");
    }
    scene_free(&t);
    scene_free(&i);
    scene_free(&t0);
    scene_free(&g);
    scene_free(&tl);
    /* no replica, no extra: no collective at all */
    scene n;
    char json[2048];
    snprintf(json, sizeof json, CFG, 4, 4, 2, "", 5, 2);
    if (scene4(&n, "", 2, false)) {
        rp_plan_clear_levers(n.plan);
        static const int32_t once[8] = {0, 1, 2, 3, 4, -1, -1, -1};
        rp_error err;
        ok(rp_plan_set_phy2log(n.plan, 0, once, &err) == RP_OK && rp_cost_evaluate(n.cost, n.plan, &n.sum, &err) == RP_OK &&
               n.sum.grad_reduce_s == 0 && n.sum.extra_copy_s == 0,
           "every expert once, no extras: no reduction, no copies");
    } else {
        ok(0, "no-replica scene");
    }
    scene_free(&n);
}

/* Dispatch and combine dtype: 2 GPUs, EP 2, 2 experts once each, one token on each GPU
 * routed to the other's expert, at 4 bytes a parameter. routepack_torch and
 * megatron_alltoall send and combine in the activations' dtype (4 B), deepep in BF16
 * (2 B): a copy is d (dbpe + cbpe) / 2 bytes, 16 against 8, 2 s against 1 s over 8 B/s. */
/* The step's extras fetched ahead or not, over NVLink or the network (issue 35): the
 * 4-GPU scene's extra replica of expert 3 on EP rank 0 comes from expert 3's first slot
 * (slot 5, EP rank 2). */
static void test_extras_ahead(void)
{
    scene in, nv, net, net_in;
    bool made = scene4(&in, "\"extras_ahead\": false", 2, true) && scene4_nodes(&nv, "", 2, true, false) &&
                scene4_nodes(&net, "", 2, true, true) &&
                scene4_nodes(&net_in, "\"extras_ahead\": false", 2, true, true);
    ok(made, "the scene on one node and on two, fetched ahead and not, evaluates");
    if (made) {
        /* not ahead: the fetch before the forward, 48 B / 8 B/s + 0.5 s */
        is_double(in.sum.extra_copy_s, 6.5, 1e-9, "extras_ahead false: the whole fetch, 6.5 s");
        is_double(in.sum.step_s - nv.sum.step_s, 1.125 + 15e-6, 1e-9,
                  "ahead, the step is shorter by the dense forward the fetch hid behind (1.125 s + 15 us)");
        /* two nodes (ranks 0, 1 | 2, 3): rank 0 fetches from rank 2 over the network,
         * 48 B / 4 B/s + 1 s = 13 s; ahead, 13 - 1.125 - 15e-6 */
        is_double(net_in.sum.extra_copy_s, 13.0, 1e-9, "across nodes: 48 B / 4 B/s + 1 s = 13 s over the network");
        is_double(net.sum.extra_copy_s, 13.0 - 1.125 - 15e-6, 1e-9,
                  "across nodes, ahead: 13 s less the 1.125 s + 15 us it hides behind");
    }
    scene_free(&in);
    scene_free(&nv);
    scene_free(&net);
    scene_free(&net_in);
}

static void test_combine_dtype(void)
{
    static const char *const exec[3] = {"", "\"executor\": \"megatron_alltoall\"", "\"executor\": \"deepep\""};
    static const double want[3] = {2.0 + 0.5, 2.0 + 0.5, 1.0 + 0.5};
    static const int32_t lens[2] = {1, 1}, rank[2] = {0, 1}, mb[2] = {0, 0};
    static const uint8_t ids[2] = {1, 0};
    for (int k = 0; k < 3; k++) {
        char json[2048];
        snprintf(json, sizeof json, CFG, 2, 2, 1, exec[k], 2, 4);
        batch_fixture f;
        rp_error err;
        rp_cost *c = NULL;
        rp_plan *p = NULL;
        bool good = batch_fixture_make(ctx, &f, json, 2, lens, NULL, ids, &err);
        good = good && rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
               rp_plan_new(ctx, f.cfg, 1, &p, &err) == RP_OK && rp_plan_set_packing(p, 2, rank, mb, &err) == RP_OK &&
               rp_plan_set_contiguous(p, &err) == RP_OK && rp_cost_evaluate(c, p, NULL, &err) == RP_OK;
        if (!good) diag("%s", err.text);
        ok(good && fabs(rp_cost_dispatch_breakdown(c)[0] - want[k]) < 1e-12,
           "%s: one copy each way is %g s with the latency", k ? exec[k] : "routepack_torch", want[k]);
        rp_plan_free(p);
        rp_cost_free(c);
        if (f.cfg) batch_fixture_free(&f);
    }
}

/* Megatron's and DeepEP's dispatchers hold every expert once per EP group: spare slots
 * are refused by name; their host costs (one sync a layer), de-duplication, reduction
 * dtype; a plan with extra replicas is invalid under them, and the joint planner makes
 * none. */
static void test_stock_executors(void)
{
    static const char *const names[3] = {"megatron_alltoall", "deepep", "megatron_balancer"};
    static const rp_dispatch_dedup dedup[3] = {RP_DEDUP_CHOICE, RP_DEDUP_NODE, RP_DEDUP_GPU};
    for (int k = 0; k < 3; k++) {
        char exec[64], json[2048];
        snprintf(exec, sizeof exec, "\"executor\": \"%s\"", names[k]);
        snprintf(json, sizeof json, CFG, 4, 4, 2, exec, 4, 2);
        rp_config *cfg = NULL;
        rp_error err;
        is_int(rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err), RP_EINVAL, "%s: spare slots refused",
               names[k]);
        like(err.text, "which holds every expert once per EP group, but topology.slots_per_gpu gives an EP group 8 "
                       "slots for 4 experts", "%s: the message names the executor's limit", names[k]);
        snprintf(json, sizeof json, CFG, 4, 4, 1, exec, 4, 2);
        cfg = test_config_parse(ctx, json, &err);
        ok(cfg != NULL, "%s: one slot an expert reads", names[k]);
        if (!cfg) {
            skip(2, "config");
            continue;
        }
        const rp_execution *x = rp_config_execution(cfg);
        ok(x->dispatch_dedup == dedup[k] && x->replica_grad_bytes_per_element == 4 &&
               fabs(x->host_s_per_layer - 15e-6) < 1e-15 && !x->extras_stacked && !x->extras_once,
           "%s: its de-duplication, FP32 reductions, one 15 us sync a layer", names[k]);
        ok(rp_config_trainer(cfg)->per_forward_balancer == (k == 2), "%s: per_forward_balancer defaults to %s",
           names[k], k == 2 ? "true" : "false");
        rp_config_free(cfg);
    }

    /* an extra replica under megatron_alltoall: refused by name; the joint planner makes none */
    char json[2048];
    snprintf(json, sizeof json, CFG, 4, 4, 1, "\"executor\": \"megatron_alltoall\"", 4, 2);
    static const int32_t lens[8] = {3, 1, 1, 1, 2, 1, 1, 1};
    static const uint8_t ids[11] = {0, 0, 0, 1, 2, 3, 0, 0, 1, 2, 3};
    batch_fixture f;
    rp_error err;
    rp_plan *p = NULL, *j = NULL;
    static const int32_t rank[8] = {0, 1, 2, 3, 0, 1, 2, 3}, mb[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    bool good = batch_fixture_make(ctx, &f, json, 8, lens, NULL, ids, &err) &&
                rp_plan_new(ctx, f.cfg, 2, &p, &err) == RP_OK && rp_plan_set_packing(p, 8, rank, mb, &err) == RP_OK &&
                rp_plan_set_contiguous(p, &err) == RP_OK && rp_plan_add_extra_replica(p, 0, 0, 0, 1, &err) == RP_OK;
    ok(good, "megatron_alltoall scene");
    if (good) {
        is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_EPLAN, "a plan with an extra replica is invalid");
        like(err.text, "execution.executor \"megatron_alltoall\" cannot run extra replicas (it runs: none), but the "
                       "plan has 1 extra replica", "named");
        rp_joint_params par = rp_joint_defaults();
        par.max_extra_per_rank = 4;
        par.shares = true;
        good = rp_joint_plan(ctx, f.cfg, f.batch, f.stats, NULL, NULL, &par, &j, NULL, &err) == RP_OK;
        if (!good) diag("%s", err.text);
        ok(good && rp_plan_num_extra_replicas(j) == 0 && rp_plan_num_share_sets(j) == 0 &&
               rp_plan_validate(j, f.cfg, f.batch, &err) == RP_OK,
           "the joint planner asked for extras and shares makes none under megatron_alltoall, and its plan is valid");
    } else {
        diag("%s", err.text);
        skip(3, "scene");
    }
    rp_plan_free(p);
    rp_plan_free(j);
    if (f.cfg) batch_fixture_free(&f);
}

/* megatron_routepack (routepack.adapters.megatron_layer): Megatron's all-to-all dispatcher
 * over the plan's slots. The 4-GPU scene's replicas in spare slots are accepted, its
 * gradients exchanged among the holders in FP32 main_grad (4 B a parameter at 2 B
 * weights: rank 0 sends 2 messages of 96 B, 2 x (96 / 8 + 0.5) = 25 s, and sums them,
 * 2 x 5 x 96 / 48 = 20 s), a copy per
 * token-choice; the scene's extra replica is refused by name, and the joint planner,
 * asked for shares and extras, makes shares only. */
static void test_megatron_routepack(void)
{
    scene m, t;
    bool made = scene4(&m, "\"executor\": \"megatron_routepack\"", 2, false) && scene4(&t, "", 2, false);
    ok(made, "megatron_routepack: replicas in spare slots accepted");
    if (made) {
        const rp_execution *x = rp_config_execution(m.f.cfg);
        ok(x->dispatch_dedup == RP_DEDUP_CHOICE && x->replica_grad_reduce == RP_GRAD_REDUCE_HOLDERS &&
               x->replica_grad_bytes_per_element == 4 && fabs(x->host_s_per_layer - 15e-6) < 1e-15 &&
               x->levers == (RP_LEVER_REPLICAS | RP_LEVER_SHARES) && !rp_config_trainer(m.f.cfg)->per_forward_balancer,
           "megatron_routepack: a copy per choice, holders in FP32, one sync a layer, replicas and shares, no balancer");
        /* holders without the extra: expert 0 on ranks 0 and 3, 1 on 0 and 1, 2 on 1 and 2;
         * each of rank 0's 2 gradients (both in slots) also through its memory 5 times */
        is_double(m.sum.grad_reduce_s, 45.0, 1e-9, "rank 0 sends 2 FP32 gradients of 96 B: 2 x (96 / 8 + 0.5) = 25 s, "
                  "and sums them: 2 x 5 x 96 / 48 = 20 s");
        is_double(t.sum.grad_reduce_s, 23.0, 1e-9, "routepack_torch (weights' dtype): 2 x (48 / 8 + 0.5) = 13 s, "
                  "and 2 x 5 x 48 / 48 = 10 s");
    } else {
        skip(3, "no scene");
    }
    scene_free(&m);
    scene_free(&t);

    scene e;
    memset(&e, 0, sizeof e);
    made = scene4(&e, "\"executor\": \"megatron_routepack\"", 2, true);
    ok(made, "megatron_routepack with an extra replica evaluates");
    if (made) {
        rp_error err;
        is_int(rp_plan_validate(e.plan, e.f.cfg, e.f.batch, &err), RP_EPLAN, "a plan with extra replicas is invalid");
        like(err.text, "execution.executor \"megatron_routepack\" cannot run extra replicas (it runs: replicas, "
                       "shares), but the plan has 2 extra replicas", "named, with what it runs");
        rp_joint_params par = rp_joint_defaults();
        par.max_extra_per_rank = 4;
        par.shares = true;
        rp_plan *j = NULL;
        bool good = rp_joint_plan(ctx, e.f.cfg, e.f.batch, e.f.stats, NULL, NULL, &par, &j, NULL, &err) == RP_OK;
        if (!good) diag("%s", err.text);
        ok(good && rp_plan_num_extra_replicas(j) == 0 && rp_plan_validate(j, e.f.cfg, e.f.batch, &err) == RP_OK,
           "the joint planner asked for extras makes none under megatron_routepack, and its plan is valid");
        rp_plan_free(j);
    } else {
        skip(3, "no scene");
    }
    scene_free(&e);
}

/* Megatron's balancer charges what it costs: 2 GPUs, EP 2, 2 experts, sequences of 6 and
 * 2 tokens (GPU 0 and GPU 1) all routed to expert 0 (rank 0's). The balancer gives each
 * rank 4 choices (rank 0 sends 2 to rank 1's virtual slot) and pushes expert 0 to rank 1.
 *   padding: every rank runs the largest cell's 6 tokens' share: t(4) x 6 / 4 = 4.5 s
 *   SM contention: the push (48 B / 8 + 0.5 = 6.5 s) beside the GEMMs takes 32 of 132
 *     SMs: + 32 / 100 x min(6.5, 4.5) = 1.44 s
 *   dispatch: 2 copies x 1 s + 0.5 s, plus (2 pushes of 6.5 s + the FP32 gradient,
 *     96 B / 8 + 0.5 = 12.5 s) over the 2 (1 + 1) dispatch terms a layer pays (the
 *     communication's backward stays 1): 2.5 + 25.5 / 4 = 8.875 s */
static void test_balancer(void)
{
    static const int32_t lens[2] = {6, 2}, rank[2] = {0, 1}, mb[2] = {0, 0};
    static const uint8_t ids[8] = {0};
    char json[2048];
    snprintf(json, sizeof json, CFG, 2, 2, 1, "\"executor\": \"megatron_balancer\"", 2, 2);
    batch_fixture f;
    rp_error err;
    rp_cost *c = NULL;
    rp_plan *p = NULL;
    bool good = batch_fixture_make(ctx, &f, json, 2, lens, NULL, ids, &err) &&
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK &&
                rp_plan_new(ctx, f.cfg, 1, &p, &err) == RP_OK && rp_plan_set_packing(p, 2, rank, mb, &err) == RP_OK &&
                rp_plan_set_contiguous(p, &err) == RP_OK &&
                rp_plan_set_balancing(p, RP_BALANCING_VIRTUAL_EXPERTS, &err) == RP_OK &&
                rp_cost_evaluate(c, p, NULL, &err) == RP_OK;
    if (!good) diag("%s", err.text);
    ok(good, "megatron_balancer evaluates a plan with the balancer");
    if (good) {
        const double *x = rp_cost_expert_breakdown(c), *d = rp_cost_dispatch_breakdown(c);
        const double xs = 4.5 + 32.0 / 100.0 * 4.5;
        is_double(x[0], xs, 1e-12, "rank 0: padded to 6 tokens' share, slowed by the push's SMs: 5.94 s");
        is_double(x[1], xs, 1e-12, "rank 1 the same");
        is_double(d[0], 2.5 + 25.5 / 4.0, 1e-12, "dispatch with two weight pushes and an FP32 gradient push: 8.875 s");
        is_double(d[1], 2.5 + 25.5 / 4.0, 1e-12, "the receiver pays the same");
    } else {
        skip(4, "scene");
    }
    rp_plan_free(p);
    rp_cost_free(c);
    if (f.cfg) batch_fixture_free(&f);
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    test_routepack_torch();
    test_extras_ahead();
    test_combine_dtype();
    test_stock_executors();
    test_megatron_routepack();
    test_balancer();
    rp_context_free(ctx);
    return tap_done();
}
