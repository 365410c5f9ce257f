/* The grouped GEMM's expert time on integer counts (cost_expert_add_int, what the
 * evaluator calls for every single-replica expert) gives the bits of the general path
 * (cost_expert_add on the same count as a double) at every count: inside the integer
 * table, and beyond it, where the rows are padded by a mask (a power-of-two tile) or a
 * division (any other tile) and the weight gradient's curve is read at its last point
 * without a search (cost_wgrad_padded), or searched where the curve goes on past the
 * table. Both equal the weight gradient's time written out here from its definition. */
#include "cost_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <string.h>

static rp_context *ctx;

#define N 8

/* tile rows, then the weight gradient's curve (a JSON list, or "" for the GEMM's own) */
static const char *CFG =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
    " \"hardware\": {\"peak_flops\": 1e12, \"hbm_bytes_per_s\": 1e11, \"gemm_tile_rows\": %d,"
    "  \"gemm_efficiency\": [[1, 0.05], [8, 0.3], [64, 0.7], [300, 0.9]]%s%s},"
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"num_kv_heads\": 2, \"head_dim\": 16},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}}";

static bool same_bits(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

/* The weight gradient's time as the cost model defines it (docs/cost-model.md,
 * "Experts"), written out here: n rows padded to the tile, at the curve's efficiency
 * there, at least the write of dW. */
static double reference_wgrad(const rp_cost *c, double n)
{
    if (!(n > 0)) return 0.0;
    const double p = ceil(n / c->tile) * c->tile;
    const double t = p * c->expert_token_s / cost_curve_at(c->weff, c->num_weff, p);
    return t > c->wgrad_floor_s ? t : c->wgrad_floor_s;
}

/* Counts 0 .. 3000 one by one, then up to 2^31 - 1 in growing steps, each with its
 * neighbours. Returns the first count whose results differ (-1: none). */
static int64_t first_difference(const rp_cost *c)
{
    for (int64_t base = 0; base < INT32_MAX;) {
        for (int64_t n = base > 1 ? base - 1 : base; n <= base + 1 && n <= INT32_MAX; n++) {
            double xi = 0.25, ri = 3.0, gi = 1.0, xd = 0.25, rd = 3.0, gd = 1.0;
            cost_expert_add_int(c, n, &xi, &ri, &gi);
            cost_expert_add(c, (double)n, &xd, &rd, &gd);
            if (!same_bits(xi, xd) || !same_bits(ri, rd) || !same_bits(gi, gd)) return n;
            const double ref = reference_wgrad(c, (double)n);
            if (!same_bits(cost_wgrad_time(c, (double)n), ref)) return n;
            if (n > 0 && (!same_bits(xi, 0.25 + ref) || !same_bits(ri, 3.0 + ceil((double)n / c->tile) * c->tile)))
                return n;
        }
        base = base < 3000 ? base + 1 : base + 1 + base / 97;
    }
    return -1;
}

static void check(int tile, const char *wgrad, const char *what)
{
    char json[2048];
    snprintf(json, sizeof json, CFG, tile, *wgrad ? ", \"wgrad_efficiency\": " : "", wgrad);
    batch_fixture f;
    memset(&f, 0, sizeof f);
    int32_t lens[N], tokens = 0;
    for (int i = 0; i < N; i++) tokens += lens[i] = 5 + 3 * i;
    uint8_t ids[2 * 2 * 200]; /* 2 layers, top 2: each token's choices 0 and 1 */
    for (int32_t k = 0; k < 2 * 2 * tokens; k++) ids[k] = (uint8_t)(k % 2);
    rp_error err;
    rp_cost *c = NULL;
    bool made = batch_fixture_make(ctx, &f, json, N, lens, NULL, ids, &err) &&
                rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &c, &err) == RP_OK;
    ok(made, "%s: an evaluator", what);
    if (!made) {
        diag("%s", err.text);
        batch_fixture_free(&f);
        return;
    }
    ok(c->grouped && c->tile_rows == tile, "%s: grouped GEMM, tile %d", what, tile);
    ok(c->slot_table_n == 301, "%s: the integer table ends at the GEMM curve's last point", what);
    int64_t n = first_difference(c);
    ok(n < 0, "%s: integer counts give the general path's bits", what);
    if (n >= 0) diag("first difference at %lld rows", (long long)n);
    rp_cost_free(c);
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    /* the curve ends at the table's end, below it, and far past it (searched beyond the
     * table), under power-of-two and other tiles */
    check(16, "", "tile 16, the GEMM's curve");
    check(1, "", "tile 1, the GEMM's curve");
    check(24, "", "tile 24, the GEMM's curve");
    check(16, "[[1, 0.01], [32, 0.2], [128, 0.5]]", "tile 16, a wgrad curve ending below the table");
    check(24, "[[1, 0.01], [32, 0.2], [128, 0.5]]", "tile 24, a wgrad curve ending below the table");
    check(16, "[[1, 0.01], [512, 0.4], [5000, 0.8], [100000, 0.95]]", "tile 16, a wgrad curve past the table");
    check(7, "[[1, 0.01], [512, 0.4], [5000, 0.8], [100000, 0.95]]", "tile 7, a wgrad curve past the table");
    check(1, "[[50000, 0.6]]", "tile 1, a one-point wgrad curve");
    rp_context_free(ctx);
    return tap_done();
}
