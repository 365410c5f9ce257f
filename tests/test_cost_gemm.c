/* The experts of a GPU as a grouped GEMM (core/cost_gemm.c; docs/cost-model.md,
 * "Experts"), computed by hand on a tiny config: rows padded per expert to the tile, the
 * forward at the efficiency of the GPU's total padded rows, the weight gradient per
 * expert at its own curve with the write of dW as its floor, the data gradient like the
 * forward; the defaults when a config or an old calibration gives none of it; the loop
 * form where the executor loops; a skewed count vector against a uniform one of the same
 * total rows. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>

static rp_context *ctx;

/* 2 GPUs, EP 2, 4 experts in 2 slots a GPU (rank 0 experts 0 and 1), top-1, one layer,
 * d = 4, f = 2, peak 64 FLOP/s, HBM 48 B/s, BF16 weights, FP32 gradients:
 *   6 d f / peak = 0.75 s a row at efficiency 1
 *   the weights' read 3 d f bpp / hbm = 1 s; the write of dW 3 d f 4 / hbm = 2 s
 *   gemm_efficiency (the per-expert curve) [[1, 0.5], [4, 1]]
 * The first %s adds hardware keys, the second sets execution keys. */
static const char *CFG =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 2,"
    "  \"nvlink_bytes_per_s\": 8, \"nvlink_latency_us\": 500000},"
    " \"hardware\": {\"peak_flops\": 64, \"hbm_bytes_per_s\": 48, \"attention_efficiency\": 0.5,"
    "  \"dense_efficiency\": 1, \"gemm_efficiency\": [[1, 0.5], [4, 1]],"
    "  \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 0%s},"
    " \"execution\": {%s},"
    " \"model\": {\"num_layers\": 1, \"num_experts\": 4, \"top_k\": 1, \"hidden_size\": 4,"
    "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"num_kv_heads\": 1, \"head_dim\": 2, \"bytes_per_param\": 2,"
    "  \"bytes_per_grad\": 4},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100}}";

/* the grouped figures a calibration writes: tile 4, a flat 0.5 for the grouped forward,
 * the weight gradient at 0.25 (1 row) to 0.5 (8 rows), data gradient 0.5 x the forward */
static const char *MEASURED = ", \"gemm_tile_rows\": 4, \"grouped_gemm_efficiency\": [[1, 0.5]],"
                              " \"wgrad_efficiency\": [[1, 0.25], [8, 0.5]],"
                              " \"backward\": {\"experts\": 2, \"experts_dgrad\": 0.5}";

typedef struct scene {
    batch_fixture f;
    rp_cost *cost;
    rp_plan *plan;
    bool good;
} scene;

static void scene_free(scene *s)
{
    rp_plan_free(s->plan);
    rp_cost_free(s->cost);
    if (s->f.cfg) batch_fixture_free(&s->f);
    memset(s, 0, sizeof *s);
}

/* 8 one-token sequences (4 on each GPU, one microbatch), `hot` of them routed to expert 0
 * and the rest to expert 1: EP rank 0 runs rows (hot, 8 - hot), rank 1 none. */
static bool scene_make(scene *s, const char *hw, const char *exec, int hot)
{
    memset(s, 0, sizeof *s);
    char json[2048];
    snprintf(json, sizeof json, CFG, hw, exec);
    static const int32_t lens[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    static const int32_t rank[8] = {0, 0, 0, 0, 1, 1, 1, 1}, mb[8] = {0};
    static const int32_t p2l[4] = {0, 1, 2, 3};
    uint8_t ids[8];
    for (int i = 0; i < 8; i++) ids[i] = i < hot ? 0 : 1;
    rp_error err;
    if (!batch_fixture_make(ctx, &s->f, json, 8, lens, NULL, ids, &err)) {
        diag("fixture: %s", err.text);
        return false;
    }
    s->good = rp_cost_new(ctx, s->f.cfg, s->f.batch, s->f.stats, RP_SPLIT_EVEN, &s->cost, &err) == RP_OK &&
              rp_plan_new(ctx, s->f.cfg, 1, &s->plan, &err) == RP_OK &&
              rp_plan_set_packing(s->plan, 8, rank, mb, &err) == RP_OK &&
              rp_plan_set_phy2log(s->plan, 0, p2l, &err) == RP_OK &&
              rp_cost_evaluate(s->cost, s->plan, NULL, &err) == RP_OK;
    if (!s->good) diag("scene: %s", err.text);
    return s->good;
}

static double gpu0(const scene *s) { return rp_cost_expert_breakdown(s->cost)[0]; }

/* Uniform rows (4, 4) against skewed (6, 2): the same 8 rows on EP rank 0. */
static void test_grouped_by_hand(void)
{
    scene u, k;
    bool made = scene_make(&u, MEASURED, "", 4) && scene_make(&k, MEASURED, "", 6);
    ok(made, "the measured grouped figures: uniform and skewed scenes evaluate");
    if (made) {
        ok(rp_config_execution(u.f.cfg)->expert_gemm == RP_EXPERT_GEMM_GROUPED,
           "routepack_torch runs a grouped GEMM");
        /* uniform: rows 4 + 4, both on the tile: P = 8, forward 8 x 0.75 / 0.5 = 12 s;
         * weight gradient per expert 4 x 0.75 / eff_w(4), eff_w(4) = 0.25 + 3/7 x 0.25,
         * 8.4 s each (above the 2 s dW write); backward 0.5 x 12 + 16.8 = 22.8 s; the
         * layer pays (1 + 2) x the forward-equivalent: (12 + 22.8) / 3 = 11.6 s */
        is_double(gpu0(&u), 11.6, 1e-9, "uniform (4, 4): forward 12 s, backward 6 + 2 x 8.4 s: 34.8 / 3 = 11.6 s");
        is_double(rp_cost_expert_breakdown(u.cost)[1], 0.0, 0, "EP rank 1 runs no rows: 0");
        /* skewed: rows 6 and 2 padded to 8 and 4: P = 12, forward 18 s; weight gradient
         * 8 x 0.75 / 0.5 = 12 s and 8.4 s; backward 9 + 20.4; (18 + 29.4) / 3 = 15.8 s */
        is_double(gpu0(&k), 15.8, 1e-9, "skewed (6, 2): padded to (8, 4): forward 18 s, backward 9 + 12 + 8.4 s: "
                  "47.4 / 3 = 15.8 s");
        /* the difference: 4 padding rows through forward and data gradient (4 x 0.75 /
         * 0.5 x 1.5 = 9 s) and the weight gradient's (20.4 - 16.8 = 3.6 s), over 3 */
        is_double(gpu0(&k) - gpu0(&u), (9.0 + 3.6) / 3.0, 1e-9,
                  "skewed prices higher than uniform of the same total rows by the padding (9 s) and the weight "
                  "gradient at small n (3.6 s), over 1 + backward.experts");
        /* one expert alone, 1 row: padded to 4, forward 6 s, weight gradient 8.4 s:
         * (6 x 1.5 + 8.4) / 3 */
        is_double(rp_cost_expert_s(u.cost, 1), (6.0 * 1.5 + 8.4) / 3.0, 1e-9,
                  "rp_cost_expert_s(1): one expert of 1 row alone on its GPU, padded to the tile: 5.8 s");
    }
    scene_free(&u);
    scene_free(&k);
}

/* routepack_torch runs a GPU's extra replicas from their buffers as a grouped GEMM of their
 * own, beside its slots' (kernels.expert_mlp on the extras' rows): 4 tokens to expert 0
 * (rank 0's slot), 2 to expert 1 (rank 0), 2 to expert 2 (rank 1's slot), and an extra
 * replica of expert 0 on EP rank 1 taking half its rows. Rank 1 runs 2 rows of expert 2 in
 * its slots' GEMM and 2 rows of expert 0 in its extras' GEMM, each padded to the tile (4)
 * at a grouped curve that rises with the total rows, 0.25 at 4 rows, 0.5 at 8. */
static void test_extras_apart(void)
{
    static const char *HW = ", \"gemm_tile_rows\": 4, \"grouped_gemm_efficiency\": [[4, 0.25], [8, 0.5]],"
                            " \"wgrad_efficiency\": [[1, 0.25], [8, 0.5]],"
                            " \"backward\": {\"experts\": 2, \"experts_dgrad\": 0.5}";
    char json[2048];
    snprintf(json, sizeof json, CFG, HW, "");
    static const int32_t lens[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    static const int32_t rank[8] = {0, 0, 0, 0, 1, 1, 1, 1}, mb[8] = {0};
    static const int32_t p2l[4] = {0, 1, 2, 3};
    static const uint8_t ids[8] = {0, 0, 0, 0, 1, 1, 2, 2};
    static const double half[2] = {0.5, 0.5};
    scene s;
    memset(&s, 0, sizeof s);
    rp_error err;
    bool made = batch_fixture_make(ctx, &s.f, json, 8, lens, NULL, ids, &err) &&
                rp_cost_new(ctx, s.f.cfg, s.f.batch, s.f.stats, RP_SPLIT_EVEN, &s.cost, &err) == RP_OK &&
                rp_plan_new(ctx, s.f.cfg, 1, &s.plan, &err) == RP_OK &&
                rp_plan_set_packing(s.plan, 8, rank, mb, &err) == RP_OK &&
                rp_plan_set_phy2log(s.plan, 0, p2l, &err) == RP_OK &&
                rp_plan_add_extra_replica(s.plan, 0, 0, 0, 1, &err) == RP_OK &&
                rp_plan_set_shares(s.plan, 0, 0, 0, half, 2, &err) == RP_OK &&
                rp_cost_evaluate(s.cost, s.plan, NULL, &err) == RP_OK;
    s.good = made;
    if (!made) diag("scene: %s", err.text);
    ok(made, "a plan with an extra replica on EP rank 1 evaluates under routepack_torch");
    if (made) {
        /* each GEMM: 4 padded rows at 0.25, forward 4 x 0.75 / 0.25 = 12 s; weight gradient
         * 4 x 0.75 / eff_w(4) = 8.4 s; (12 x 1.5 + 8.4) / 3 = 8.8 s; two of them. One GEMM of
         * all 8 rows would be 8 x 0.75 / 0.5 = 12 s forward: (18 + 16.8) / 3 = 11.6 s */
        is_double(rp_cost_expert_breakdown(s.cost)[1], 17.6, 1e-9,
                  "EP rank 1: its slots' GEMM (4 padded rows, 8.8 s) and its extras' own (8.8 s), not one GEMM of "
                  "8 rows (11.6 s)");
        /* rank 0: experts 0 (2 rows after the share) and 1 (2 rows), one GEMM of 8 padded
         * rows: 11.6 s */
        is_double(rp_cost_expert_breakdown(s.cost)[0], 11.6, 1e-9, "EP rank 0: one GEMM of its slots' 8 padded "
                  "rows, 11.6 s");
    } else {
        skip(2, "no scene");
    }
    scene_free(&s);
}

/* Where the executor loops over its experts (Megatron's SequentialMLP): the per-expert sum
 * t(n) = max(0.75 n / eff(n), 1 s), no tile, the backward at (1 + 2) x. */
static void test_loop_form(void)
{
    scene u, k;
    bool made = scene_make(&u, MEASURED, "\"expert_gemm\": \"loop\"", 4) &&
                scene_make(&k, MEASURED, "\"expert_gemm\": \"loop\"", 6);
    ok(made, "execution.expert_gemm loop: the scenes evaluate");
    if (made) {
        is_double(gpu0(&u), 6.0, 1e-9, "loop, (4, 4): t(4) + t(4) = 3 + 3 s");
        /* t(6) = 4.5 s, t(2) = 1.5 / eff(2), eff(2) = 0.5 + 0.5 / 3 */
        is_double(gpu0(&k), 4.5 + 1.5 / (0.5 + 0.5 / 3.0), 1e-9, "loop, (6, 2): t(6) + t(2) = 4.5 + 2.25 s");
    }
    scene_free(&u);
    scene_free(&k);
}

/* Without the grouped figures (a config or a calibration file from before them): the
 * forward at the per-expert curve at the mean padded rows, the weight gradient at the
 * per-expert curve, the data gradient at backward.experts - 1 (here 2 - 1). */
static void test_defaults(void)
{
    scene u, k, fl;
    bool made = scene_make(&u, ", \"gemm_tile_rows\": 4", "", 4) && scene_make(&k, ", \"gemm_tile_rows\": 4", "", 6) &&
                scene_make(&fl, ", \"gemm_tile_rows\": 1, \"wgrad_efficiency\": [[1, 0.75]]", "", 4);
    ok(made, "tile alone, and tile 1 with a fast weight gradient: the scenes evaluate");
    if (made) {
        /* uniform: mean 4 rows, eff(4) = 1: forward 6 s; weight gradient 3 s each;
         * (6 + 1 x 6 + 6) / 3 = 6 s: the loop form's, as the defaults intend */
        is_double(gpu0(&u), 6.0, 1e-9, "defaults, (4, 4): (6 + 6 + 6) / 3 = 6 s, the per-expert sum's");
        /* skewed: padded (8, 4), mean 6, eff 1: forward 9 s; weight gradient 6 + 3 s;
         * (9 + 9 + 9) / 3 = 9 s */
        is_double(gpu0(&k), 9.0, 1e-9, "defaults, (6, 2): padded to (8, 4): (9 + 9 + 9) / 3 = 9 s");
        /* one row, tile 1: forward 0.75 / 0.5 = 1.5 s (above the 1 s weights' read);
         * weight gradient 0.75 / 0.75 = 1 s, below the 2 s write of dW: 2 s;
         * (1.5 + 1.5 + 2) / 3 */
        is_double(rp_cost_expert_s(fl.cost, 1), 5.0 / 3.0, 1e-9,
                  "one row: the weight gradient's floor, writing dW (3 d f x 4 B / 48 B/s = 2 s), binds");
    }
    scene_free(&u);
    scene_free(&k);
    scene_free(&fl);
}

/* The tile each profile pads to when the hardware does not say: routepack_torch's 16
 * (routepack/torch/kernels.py GROUP_ALIGN_ROWS), Megatron's 1; ideal loops. */
static void test_profiles(void)
{
    static const struct {
        const char *exec;
        double want;
        const char *why;
    } rows[] = {
        /* 1 row padded to 16: forward 12 s (eff(16) = 1), weight gradient 12 s: (24 + 12) / 3 */
        {"", 12.0, "routepack_torch: 1 row padded to 16, (12 x 2 + 12) / 3 = 12 s"},
        /* forward 1.5 s, weight gradient max(1.5, 2) s: (3 + 2) / 3 */
        {"\"executor\": \"megatron_alltoall\"", 5.0 / 3.0, "megatron_alltoall: no padding, (1.5 x 2 + 2) / 3 s"},
        {"\"executor\": \"ideal\"", 1.5, "ideal: the per-expert t(1) = 0.75 / 0.5 s"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        scene s;
        bool made = scene_make(&s, "", rows[i].exec, 4);
        if (made)
            is_double(rp_cost_expert_s(s.cost, 1), rows[i].want, 1e-9, "%s", rows[i].why);
        else
            ok(false, "%s: the scene does not evaluate", rows[i].why);
        scene_free(&s);
    }
}

static void test_config_errors(void)
{
    char json[2048];
    rp_error err;
    snprintf(json, sizeof json, CFG, ", \"gemm_tile_rows\": 0", "");
    rp_config *cfg = test_config_parse(ctx, json, &err);
    ok(!cfg && strstr(err.text, "hardware.gemm_tile_rows"), "gemm_tile_rows 0 is refused, naming the key: %s",
       err.text);
    rp_config_free(cfg);
    snprintf(json, sizeof json, CFG, ", \"wgrad_efficiency\": [[4, 0.5], [2, 0.6]]", "");
    cfg = test_config_parse(ctx, json, &err);
    ok(!cfg && strstr(err.text, "hardware.wgrad_efficiency"), "an unsorted wgrad curve is refused: %s", err.text);
    rp_config_free(cfg);
    snprintf(json, sizeof json, CFG, "", "\"expert_gemm\": \"fused\"");
    cfg = test_config_parse(ctx, json, &err);
    ok(!cfg && strstr(err.text, "execution.expert_gemm"), "an unknown expert_gemm is refused: %s", err.text);
    rp_config_free(cfg);
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    test_grouped_by_hand();
    test_extras_apart();
    test_loop_form();
    test_defaults();
    test_profiles();
    test_config_errors();
    rp_context_free(ctx);
    return tap_done();
}
