/* GPU remap, gather/scatter and checksum kernels (kernels/remap.cu, kernels/migrate.cu)
 * against their CPU references, bit for bit, on random and edge-case inputs, and
 * rp_remap given device memory (forwarded to the kernel). Without a GPU every planned
 * check prints "# SKIP no GPU". */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"
#include "../kernels/gpu_support.h"

#ifdef RP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <stdlib.h>

/* Checks that need a device; printed as skipped without one. */
#define REMAP_CHECKS 24
#define COPY_CHECKS 8
#define CHECKSUM_CHECKS 7
#define GPU_CHECKS (REMAP_CHECKS + COPY_CHECKS + CHECKSUM_CHECKS)

static rp_context *ctx;

#ifdef RP_HAVE_CUDA
static int gpu_checks_run;
#define gok(cond, ...) (gpu_checks_run++, ok(cond, __VA_ARGS__))

static bool download(void *host, const void *dev, size_t bytes)
{
    return bytes == 0 || cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
}

static void *dev_alloc(size_t bytes, const void *host)
{
    void *d = NULL;
    rp_error err;
    if (rp_gpu_dev_upload(host, bytes, &d, &err) != RP_OK) diag("%s", err.text);
    return d;
}

/* ---- remap ------------------------------------------------------------------------- */

static rp_config *config_of(int32_t nodes, int32_t gpn, int32_t ep, int32_t slots, int32_t layers, int32_t experts,
                            int32_t k)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": %d, \"hidden_size\": 64,"
             " \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": 100000000}}",
             nodes, gpn, ep, slots, layers, experts, k);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

typedef struct rcase {
    rp_config *cfg;
    rp_plan *plan;
    rp_batch *batch;
    int32_t n, L, k, E, M;
    rp_id_width width;
    int64_t tokens, token_stride;
    void *ids;      /* host, [tokens][token_stride] with (l, j) at l * k + j */
} rcase;

static void put_id(rcase *c, int64_t i, int64_t id)
{
    if (c->width == RP_ID_U8) ((uint8_t *)c->ids)[i] = (uint8_t)id;
    else if (c->width == RP_ID_U16) ((uint16_t *)c->ids)[i] = (uint16_t)id;
    else ((int32_t *)c->ids)[i] = (int32_t)id;
}

/* kind 0: random ids skewed to the first experts; 1: every id the same expert (a
 * replicated one); 2: ids near the width's maximum. */
static bool rcase_make(rcase *c, uint64_t *rng, int32_t nodes, int32_t gpn, int32_t ep, int32_t slots, int32_t E,
                       int32_t L, int32_t k, const int32_t *lens, int32_t n, int32_t M, rp_id_width width, int kind,
                       int pad)
{
    memset(c, 0, sizeof *c);
    c->cfg = config_of(nodes, gpn, ep, slots, L, E, k);
    if (!c->cfg || rp_plan_new(ctx, c->cfg, M, &c->plan, NULL) != RP_OK) return false;
    c->n = n, c->L = L, c->k = k, c->E = E, c->M = M, c->width = width;
    const int32_t G = nodes * gpn, S = ep * slots;
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero), *rank = malloc(sizeof *rank * (size_t)n + 4),
            *mb = malloc(sizeof *mb * (size_t)n + 4);
    rp_batch_new(ctx, n, lens, zero, NULL, &c->batch, NULL);
    for (int32_t s = 0; s < n; s++) {
        rank[s] = (int32_t)(xorshift64(rng) % G);
        mb[s] = (int32_t)(xorshift64(rng) % M);
    }
    rp_plan_set_packing(c->plan, n, rank, mb, NULL);
    free(zero), free(rank), free(mb);
    c->tokens = rp_batch_num_tokens(c->batch);
    c->token_stride = (int64_t)L * k + pad;
    c->ids = calloc((size_t)(c->tokens * c->token_stride + 1), (size_t)width);
    const int32_t hot = kind == 2 ? E - 1 : 0;
    for (int64_t t = 0; t < c->tokens; t++)
        for (int32_t l = 0; l < L; l++)
            for (int32_t j = 0; j < k; j++) {
                int64_t id;
                uint64_t x = xorshift64(rng) % 100;
                if (kind == 1) id = hot;
                else if (kind == 2) id = x < 50 ? E - 1 - (int64_t)(x % 3) : (int64_t)(xorshift64(rng) % E);
                else id = x < 40 ? (int64_t)(x % 3) : (int64_t)(xorshift64(rng) % E);
                put_id(c, t * c->token_stride + (int64_t)l * k + j, id);
            }
    /* every expert once, then the hot ones (0..2, or the last three) on spare slots */
    int32_t *p2l = malloc(sizeof *p2l * (size_t)S);
    for (int32_t l = 0; l < L; l++) {
        for (int32_t p = 0; p < S; p++) p2l[p] = p < E ? p : -1;
        for (int32_t p = 0; p < S; p++) {
            int32_t q = (int32_t)(xorshift64(rng) % S), tmp = p2l[p];
            p2l[p] = p2l[q], p2l[q] = tmp;
        }
        for (int32_t p = 0; p < S; p++)
            if (p2l[p] < 0) {
                int32_t e = (int32_t)(xorshift64(rng) % 3);
                e = kind == 2 ? E - 1 - e : e;
                bool dup = false;
                for (int32_t q = p / slots * slots; q < (p / slots + 1) * slots; q++) dup |= p2l[q] == e;
                if (!dup) p2l[p] = e;
            }
        rp_plan_set_phy2log(c->plan, l, p2l, NULL);
    }
    free(p2l);
    for (int32_t x = 0; x < 4; x++) {
        int32_t m = (int32_t)(xorshift64(rng) % M), l = (int32_t)(xorshift64(rng) % L);
        int32_t e = (int32_t)(xorshift64(rng) % 3), j = (int32_t)(xorshift64(rng) % ep);
        e = kind == 2 ? E - 1 - e : e;
        int32_t reps = 0, *eranks = NULL;
        reps = rp_plan_replicas(c->plan, m, l, e, NULL, NULL, 0);
        eranks = malloc(sizeof *eranks * (size_t)(reps + 1));
        rp_plan_replicas(c->plan, m, l, e, eranks, NULL, reps);
        bool held = false;
        for (int32_t i = 0; i < reps; i++) held |= eranks[i] == j;
        free(eranks);
        if (!held) rp_plan_add_extra_replica(c->plan, m, l, e, j, NULL);
    }
    for (int32_t x = 0; x < 3; x++) {
        int32_t m = (int32_t)(xorshift64(rng) % M), l = (int32_t)(xorshift64(rng) % L);
        int32_t e = (int32_t)(xorshift64(rng) % 3);
        e = kind == 2 ? E - 1 - e : e;
        int32_t r = rp_plan_replicas(c->plan, m, l, e, NULL, NULL, 0);
        double *sh = malloc(sizeof *sh * (size_t)r), sum = 0;
        for (int32_t i = 0; i < r; i++) sum += sh[i] = (double)(1 + xorshift64(rng) % 5);
        for (int32_t i = 0; i < r; i++) sh[i] /= sum;
        rp_plan_set_shares(c->plan, m, l, e, sh, r, NULL);
        free(sh);
    }
    return true;
}

static void rcase_free(rcase *c)
{
    rp_plan_free(c->plan);
    rp_batch_free(c->batch);
    rp_config_free(c->cfg);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

/* Remap every microbatch of a case on the CPU, with rp_gpu_remap, and with rp_remap
 * given the device arrays; true if all three give the same ids and counts. */
static bool remap_agrees(rcase *c, rp_split_rule rule, const char *what)
{
    rp_routing hr, dr;
    hr.layout = RP_ROUTING_PACKED, hr.width = c->width, hr.num_layers = c->L, hr.top_k = c->k;
    hr.token_stride = c->token_stride, hr.layer_stride = c->k, hr.k_stride = 1;
    hr.base = c->ids, hr.bases = NULL, hr.num_bases = 0;
    dr = hr;
    const size_t id_bytes = (size_t)(c->tokens * c->token_stride) * (size_t)c->width;
    const size_t out_n = (size_t)(c->tokens * c->L * c->k);
    void *ids_dev = dev_alloc(id_bytes, c->ids);
    int32_t *want = malloc(sizeof *want * (out_n + 1)), *got = malloc(sizeof *got * (out_n + 1));
    for (size_t i = 0; i < out_n; i++) want[i] = got[i] = -3;
    void *out_dev = dev_alloc(sizeof *got * (out_n + 1), got);
    void *fwd_dev = dev_alloc(sizeof *got * (out_n + 1), got);
    dr.base = ids_dev;
    bool same = ids_dev && out_dev && fwd_dev;
    for (int32_t mb = 0; same && mb < c->M; mb++) {
        const size_t rows = (size_t)c->L * (rp_plan_num_gpus(c->plan) / rp_plan_ep_size(c->plan)) *
                            (size_t)rp_remap_num_physical(c->plan, mb);
        int64_t *wc = calloc(rows + 1, sizeof *wc), *gc = calloc(rows + 1, sizeof *gc);
        rp_error err;
        rp_status a = rp_remap(c->plan, c->cfg, mb, c->batch, &hr, rule, 2, want, wc, &err);
        if (a != RP_OK) diag("%s: cpu: %s", what, err.text);
        rp_status b = rp_gpu_remap(c->plan, c->cfg, mb, c->batch, &dr, rule, (int32_t *)out_dev, gc, &err);
        if (b != RP_OK) diag("%s: gpu: %s", what, err.text);
        same = a == RP_OK && b == RP_OK && memcmp(wc, gc, rows * sizeof *wc) == 0;
        if (!same && a == RP_OK && b == RP_OK) diag("%s: mb %d: per-slot counts differ", what, mb);
        memset(gc, 0x5a, rows * sizeof *gc);
        rp_status f = rp_remap(c->plan, c->cfg, mb, c->batch, &dr, rule, 2, (int32_t *)fwd_dev, gc, &err);
        if (f != RP_OK) diag("%s: rp_remap on device memory: %s", what, err.text);
        if (same && (f != RP_OK || memcmp(wc, gc, rows * sizeof *wc) != 0)) {
            if (f == RP_OK) diag("%s: mb %d: rp_remap on device memory: per-slot counts differ", what, mb);
            same = false;
        }
        free(wc), free(gc);
    }
    for (int side = 0; same && side < 2; side++) {
        same = download(got, side ? fwd_dev : out_dev, sizeof *got * out_n) &&
               memcmp(want, got, sizeof *got * out_n) == 0;
        if (!same)
            for (size_t i = 0; i < out_n; i++)
                if (want[i] != got[i]) {
                    diag("%s: first difference at id %zu: cpu %d, %s %d", what, i, want[i],
                         side ? "rp_remap on device memory" : "gpu", got[i]);
                    break;
                }
    }
    rp_gpu_dev_free(ids_dev);
    rp_gpu_dev_free(out_dev);
    rp_gpu_dev_free(fwd_dev);
    free(want), free(got);
    return same;
}

/* One GPU's own tokens of every microbatch of a case (rp_remap_rank's local order: the
 * listed sequences' ids concatenated): the CPU reference rp_remap_rank, the kernel
 * rp_gpu_remap_rank, and rp_remap_rank given the device arrays; true if all three give
 * the same ids and counts on every GPU. */
static bool rank_agrees(rcase *c, rp_split_rule rule, const char *what)
{
    const int64_t *cu = rp_batch_cu_seqlens(c->batch);
    const int32_t G = rp_plan_num_gpus(c->plan);
    const size_t rec = (size_t)c->token_stride * (size_t)c->width, nid = (size_t)c->L * c->k;
    bool same = true;
    for (int32_t mb = 0; same && mb < c->M; mb++)
        for (int32_t g = 0; same && g < G; g++) {
            int32_t cnt = 0;
            const int32_t *seqs = rp_plan_microbatch(c->plan, g, mb, &cnt);
            int64_t tok = 0;
            for (int32_t i = 0; i < cnt; i++) tok += cu[seqs[i] + 1] - cu[seqs[i]];
            unsigned char *mine = malloc((size_t)tok * rec + 1), *p = mine;
            for (int32_t i = 0; i < cnt; i++) {
                const size_t n = (size_t)(cu[seqs[i] + 1] - cu[seqs[i]]) * rec;
                memcpy(p, (unsigned char *)c->ids + (size_t)cu[seqs[i]] * rec, n);
                p += n;
            }
            rp_routing hr, dr;
            hr.layout = RP_ROUTING_PACKED, hr.width = c->width, hr.num_layers = c->L, hr.top_k = c->k;
            hr.token_stride = c->token_stride, hr.layer_stride = c->k, hr.k_stride = 1;
            hr.base = mine, hr.bases = NULL, hr.num_bases = 0;
            dr = hr;
            const size_t out_n = (size_t)tok * nid, P = (size_t)rp_remap_num_physical(c->plan, mb);
            int32_t *want = malloc(sizeof *want * (out_n + 1)), *got = malloc(sizeof *got * (out_n + 1));
            for (size_t i = 0; i < out_n; i++) want[i] = got[i] = -3;
            void *ids_dev = dev_alloc((size_t)tok * rec + 1, mine);
            void *out_dev = dev_alloc(sizeof *got * (out_n + 1), got), *fwd_dev = dev_alloc(sizeof *got * (out_n + 1), got);
            int64_t *wc = calloc((size_t)c->L * P + 1, sizeof *wc), *gc = calloc((size_t)c->L * P + 1, sizeof *gc);
            int64_t *fc = calloc((size_t)c->L * P + 1, sizeof *fc);
            dr.base = ids_dev;
            rp_error err;
            rp_status a = rp_remap_rank(c->plan, c->cfg, mb, g, c->batch, &hr, rule, want, wc, &err);
            if (a != RP_OK) diag("%s: cpu: %s", what, err.text);
            rp_status b = rp_gpu_remap_rank(c->plan, c->cfg, mb, g, c->batch, &dr, rule, (int32_t *)out_dev, gc, &err);
            if (b != RP_OK) diag("%s: gpu: %s", what, err.text);
            rp_status f = rp_remap_rank(c->plan, c->cfg, mb, g, c->batch, &dr, rule, (int32_t *)fwd_dev, fc, &err);
            if (f != RP_OK) diag("%s: rp_remap_rank on device memory: %s", what, err.text);
            same = ids_dev && out_dev && fwd_dev && a == RP_OK && b == RP_OK && f == RP_OK &&
                   memcmp(wc, gc, (size_t)c->L * P * sizeof *wc) == 0 && memcmp(wc, fc, (size_t)c->L * P * sizeof *wc) == 0;
            if (!same && a == RP_OK && b == RP_OK && f == RP_OK) diag("%s: mb %d gpu %d: per-slot counts differ", what, mb, g);
            for (int side = 0; same && side < 2; side++) {
                same = download(got, side ? fwd_dev : out_dev, sizeof *got * out_n) &&
                       memcmp(want, got, sizeof *got * out_n) == 0;
                if (!same) diag("%s: mb %d gpu %d: %s ids differ from the CPU's", what, mb, g,
                                side ? "rp_remap_rank on device memory" : "rp_gpu_remap_rank");
            }
            rp_gpu_dev_free(ids_dev);
            rp_gpu_dev_free(out_dev);
            rp_gpu_dev_free(fwd_dev);
            free(mine), free(want), free(got), free(wc), free(gc), free(fc);
        }
    return same;
}

static void test_remap(void)
{
    uint64_t rng = 0xC0FFEE;
    int32_t lens[64];
    rcase c;
    /* random sequences, a few empty, every width, both rules */
    for (int32_t s = 0; s < 64; s++) lens[s] = xorshift64(&rng) % 6 == 0 ? 0 : (int32_t)(1 + xorshift64(&rng) % 300);
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    for (int w = 0; w < 3; w++) {
        bool okay = rcase_make(&c, &rng, 2, 4, 8, 3, 20, 3, 4, lens, 64, 3, widths[w], 0, w == 2 ? 3 : 0);
        gok(okay && remap_agrees(&c, RP_SPLIT_LOCALITY, "random/locality") && remap_agrees(&c, RP_SPLIT_EVEN, "random/even"),
            "remap: random routing, %d-byte ids%s, both rules: GPU equals CPU", (int)widths[w], w == 2 ? ", padded tokens" : "");
        gok(okay && rank_agrees(&c, RP_SPLIT_LOCALITY, "rank/locality") && rank_agrees(&c, RP_SPLIT_EVEN, "rank/even"),
            "remap_rank: each GPU's own tokens, %d-byte ids%s, both rules: rp_gpu_remap_rank and rp_remap_rank on "
            "device memory equal rp_remap_rank on the CPU", (int)widths[w], w == 2 ? ", padded tokens" : "");
        rcase_free(&c);
    }
    /* groups that nodes cut unevenly (gpus per node 3, EP size 2): per-GPU sources */
    gok(rcase_make(&c, &rng, 2, 3, 2, 4, 6, 2, 2, lens, 40, 2, RP_ID_U8, 0, 0) &&
            remap_agrees(&c, RP_SPLIT_LOCALITY, "uneven nodes") && rank_agrees(&c, RP_SPLIT_LOCALITY, "rank/uneven"),
        "remap: EP groups split unevenly by nodes (whole microbatch and each GPU's own tokens)");
    rcase_free(&c);
    /* long sequences: many tiles per sequence and per GPU */
    int32_t longs[6] = {5000, 1, 0, 7777, 300, 2600};
    gok(rcase_make(&c, &rng, 1, 4, 4, 3, 8, 4, 8, longs, 6, 1, RP_ID_U8, 0, 0) &&
            remap_agrees(&c, RP_SPLIT_EVEN, "long/even") && remap_agrees(&c, RP_SPLIT_LOCALITY, "long/locality") &&
            rank_agrees(&c, RP_SPLIT_EVEN, "rank/long"),
        "remap: long sequences (many tiles per sequence), top-8 (whole microbatch and each GPU's own tokens)");
    rcase_free(&c);
    /* every id the same (replicated) expert */
    gok(rcase_make(&c, &rng, 2, 2, 4, 3, 6, 2, 2, longs, 6, 2, RP_ID_U16, 1, 0) &&
            remap_agrees(&c, RP_SPLIT_EVEN, "one expert"),
        "remap: all tokens to one expert");
    rcase_free(&c);
    /* empty sequences only, and a single token */
    int32_t empties[4] = {0, 0, 0, 0}, one[1] = {1};
    gok(rcase_make(&c, &rng, 1, 2, 2, 3, 5, 2, 2, empties, 4, 1, RP_ID_U8, 0, 0) &&
            remap_agrees(&c, RP_SPLIT_EVEN, "empty"),
        "remap: only empty sequences");
    rcase_free(&c);
    gok(rcase_make(&c, &rng, 1, 2, 2, 3, 5, 2, 2, one, 1, 1, RP_ID_U8, 0, 0) &&
            remap_agrees(&c, RP_SPLIT_LOCALITY, "one token"),
        "remap: one token");
    rcase_free(&c);
    /* ids at the width's maximum: 256 experts in uint8 (id 255), 65536 in uint16 */
    int32_t mid[8] = {40, 0, 33, 1, 90, 17, 64, 5};
    gok(rcase_make(&c, &rng, 1, 4, 4, 66, 256, 2, 4, mid, 8, 2, RP_ID_U8, 2, 0) &&
            remap_agrees(&c, RP_SPLIT_LOCALITY, "u8 max"),
        "remap: uint8 ids up to 255 (256 experts)");
    rcase_free(&c);
    gok(rcase_make(&c, &rng, 1, 2, 2, 32770, 65536, 1, 2, mid, 8, 1, RP_ID_U16, 2, 0) &&
            remap_agrees(&c, RP_SPLIT_EVEN, "u16 max"),
        "remap: uint16 ids up to 65535 (65536 experts)");
    rcase_free(&c);

    /* errors: an id out of range is reported as on the CPU and nothing is written */
    rcase_make(&c, &rng, 1, 2, 2, 3, 5, 2, 2, mid, 8, 1, RP_ID_U8, 0, 0);
    put_id(&c, 2 * c.token_stride + 1, 9);
    void *ids_dev = dev_alloc((size_t)(c.tokens * c.token_stride), c.ids);
    const size_t out_n = (size_t)(c.tokens * c.L * c.k);
    int32_t *fill = malloc(sizeof *fill * out_n);
    for (size_t i = 0; i < out_n; i++) fill[i] = -5;
    void *out_dev = dev_alloc(sizeof *fill * out_n, fill);
    rp_routing dr, hr;
    rp_routing_packed(&dr, RP_ID_U8, c.L, c.k, ids_dev);
    rp_routing_packed(&hr, RP_ID_U8, c.L, c.k, c.ids);
    rp_error e1, e2;
    rp_status s1 = rp_remap(c.plan, c.cfg, 0, c.batch, &hr, RP_SPLIT_EVEN, 1, fill, NULL, &e1);
    rp_status s2 = rp_gpu_remap(c.plan, c.cfg, 0, c.batch, &dr, RP_SPLIT_EVEN, (int32_t *)out_dev, NULL, &e2);
    gok(s1 == RP_ERANGE && s2 == RP_ERANGE, "remap: an id out of range is RP_ERANGE on both sides");
    like(e2.text, "has expert id 9, but the model has 5 experts", "remap: the GPU error names the id");
    gpu_checks_run++;
    int untouched = download(fill, out_dev, sizeof *fill * out_n);
    for (size_t i = 0; i < out_n; i++) untouched &= fill[i] == -5;
    gok(untouched, "remap: nothing is written on error");
    rp_routing per_seq;
    rp_routing_per_seq(&per_seq, RP_ID_U8, c.L, c.k, NULL, 0);
    gok(rp_gpu_remap(c.plan, c.cfg, 0, c.batch, &per_seq, RP_SPLIT_EVEN, (int32_t *)out_dev, NULL, &e2) == RP_ENOTSUP,
        "remap: a per-sequence view is RP_ENOTSUP on the device");

    /* rp_remap given device memory: the kernel's answer, and errors for mixed sides */
    rp_error e3;
    rp_status s3 = rp_remap(c.plan, c.cfg, 0, c.batch, &dr, RP_SPLIT_EVEN, 1, (int32_t *)out_dev, NULL, &e3);
    gok(s3 == RP_ERANGE && e3.sequence == e1.sequence && e3.expert == 9 && strcmp(e3.text, e1.text) == 0,
        "rp_remap on device ids: an id out of range is RP_ERANGE with the CPU's message (%s)", e3.text);
    untouched = download(fill, out_dev, sizeof *fill * out_n);
    for (size_t i = 0; i < out_n; i++) untouched &= fill[i] == -5;
    gok(untouched, "rp_remap on device ids: nothing is written on error");
    put_id(&c, 2 * c.token_stride + 1, 1);
    rp_gpu_dev_free(ids_dev);
    ids_dev = dev_alloc((size_t)(c.tokens * c.token_stride), c.ids);
    dr.base = ids_dev;
    const size_t rows = (size_t)c.L * (rp_plan_num_gpus(c.plan) / rp_plan_ep_size(c.plan)) *
                        (size_t)rp_remap_num_physical(c.plan, 0);
    int64_t *slots = calloc(rows + 1, sizeof *slots);
    void *slots_dev = dev_alloc(sizeof(int64_t) * rows, slots);
    rp_status m1 = rp_remap(c.plan, c.cfg, 0, c.batch, &dr, RP_SPLIT_EVEN, 1, fill, slots, &e3);
    gok(m1 == RP_EINVAL && strstr(e3.text, "phys_ids is host memory"),
        "rp_remap: device ids with a host phys_ids is RP_EINVAL (%s)", e3.text);
    rp_status m2 = rp_remap(c.plan, c.cfg, 0, c.batch, &hr, RP_SPLIT_EVEN, 1, (int32_t *)out_dev, slots, &e3);
    gok(m2 == RP_EINVAL && strstr(e3.text, "phys_ids is device memory"),
        "rp_remap: host ids with a device phys_ids is RP_EINVAL (%s)", e3.text);
    rp_status m3 = rp_remap(c.plan, c.cfg, 0, c.batch, &dr, RP_SPLIT_EVEN, 1, (int32_t *)out_dev,
                            (int64_t *)slots_dev, &e3);
    gok(slots_dev && m3 == RP_EINVAL && strstr(e3.text, "slot_tokens is device memory"),
        "rp_remap: slot_tokens in device memory is RP_EINVAL (%s)", e3.text);
    const void *seq_arrays[8] = {ids_dev, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    const int64_t *cu = rp_batch_cu_seqlens(c.batch);
    void *seq_dev[8] = {NULL};
    for (int32_t s = 1; s < 8; s++) {
        const size_t bytes = (size_t)((cu[s + 1] - cu[s]) * c.token_stride);
        seq_dev[s] = dev_alloc(bytes ? bytes : 1, (uint8_t *)c.ids + cu[s] * c.token_stride);
        seq_arrays[s] = seq_dev[s];
    }
    rp_routing_per_seq(&per_seq, RP_ID_U8, c.L, c.k, seq_arrays, 8);
    rp_status m4 = rp_remap(c.plan, c.cfg, 0, c.batch, &per_seq, RP_SPLIT_EVEN, 1, (int32_t *)out_dev, slots, &e3);
    gok(m4 == RP_ENOTSUP, "rp_remap: per-sequence device arrays are RP_ENOTSUP (%s)", e3.text);
    seq_arrays[4] = (uint8_t *)c.ids + cu[4] * c.token_stride;
    rp_status m5 = rp_remap(c.plan, c.cfg, 0, c.batch, &per_seq, RP_SPLIT_EVEN, 1, (int32_t *)out_dev, slots, &e3);
    gok(m5 == RP_EINVAL && strstr(e3.text, "sequence 4"),
        "rp_remap: a per-sequence view on both sides is RP_EINVAL naming the sequence (%s)", e3.text);
    for (int32_t s = 1; s < 8; s++) rp_gpu_dev_free(seq_dev[s]);
    rp_gpu_dev_free(slots_dev);
    free(slots);
    rp_gpu_dev_free(ids_dev);
    rp_gpu_dev_free(out_dev);
    free(fill);
    rcase_free(&c);
}

/* ---- gather, scatter, checksum ------------------------------------------------------ */

/* Experts of random parts at odd offsets of one device allocation, and their host copy. */
typedef struct parts {
    int32_t num_experts, num_parts;
    int32_t *begin;
    size_t *bytes;
    void **dev_ptr;
    unsigned char **host_ptr;
    unsigned char *host, *dev;
    size_t total, arena;
} parts;

static void parts_make(parts *p, uint64_t *rng, int32_t experts, int32_t max_parts, size_t max_bytes, bool aligned)
{
    memset(p, 0, sizeof *p);
    p->num_experts = experts;
    p->begin = calloc((size_t)experts + 1, sizeof *p->begin);
    for (int32_t i = 0; i < experts; i++)
        p->begin[i + 1] = p->begin[i] + (int32_t)(xorshift64(rng) % (uint64_t)(max_parts + 1));
    p->num_parts = p->begin[experts];
    p->bytes = calloc((size_t)p->num_parts + 1, sizeof *p->bytes);
    p->dev_ptr = calloc((size_t)p->num_parts + 1, sizeof *p->dev_ptr);
    p->host_ptr = calloc((size_t)p->num_parts + 1, sizeof *p->host_ptr);
    size_t *off = calloc((size_t)p->num_parts + 1, sizeof *off), at = 0;
    for (int32_t i = 0; i < p->num_parts; i++) {
        uint64_t x = xorshift64(rng) % 10;
        p->bytes[i] = x == 0 ? 0 : x < 3 ? (size_t)(xorshift64(rng) % 40) : (size_t)(xorshift64(rng) % max_bytes);
        if (aligned) p->bytes[i] = (p->bytes[i] + 15) / 16 * 16;
        at += aligned ? 256 : 1 + xorshift64(rng) % 13; /* a gap, so parts start misaligned */
        off[i] = at;
        at += p->bytes[i];
        p->total += p->bytes[i];
    }
    p->arena = at + 16;
    p->host = malloc(p->arena);
    for (size_t i = 0; i < p->arena; i++) p->host[i] = (unsigned char)(xorshift64(rng) >> 24);
    p->dev = dev_alloc(p->arena, p->host);
    for (int32_t i = 0; i < p->num_parts; i++) {
        p->dev_ptr[i] = p->dev ? p->dev + off[i] : NULL;
        p->host_ptr[i] = p->host + off[i];
    }
    free(off);
}

static void parts_free(parts *p)
{
    rp_gpu_dev_free(p->dev);
    free(p->begin), free(p->bytes), free(p->dev_ptr), free(p->host_ptr), free(p->host);
}

static void test_copies(void)
{
    uint64_t rng = 99;
    for (int aligned = 1; aligned >= 0; aligned--) {
        parts p;
        parts_make(&p, &rng, 37, 4, 300000, aligned);
        unsigned char *want = malloc(p.total + 1), *got = malloc(p.total + 1);
        for (int32_t i = 0, at = 0; i < p.num_parts; i++) {
            memcpy(want + at, p.host_ptr[i], p.bytes[i]);
            at += (int32_t)p.bytes[i];
        }
        void *buf = NULL;
        rp_error err;
        rp_gpu_dev_upload(want, p.total + 1, &buf, &err); /* any bytes: overwritten */
        cudaMemset(buf, 0, p.total + 1);
        rp_status st = rp_gpu_gather(ctx, (const void *const *)p.dev_ptr, p.bytes, p.begin, p.num_experts, buf,
                                     p.total + 1, NULL, &err);
        if (st != RP_OK) diag("gather: %s", err.text);
        gok(st == RP_OK && cudaDeviceSynchronize() == cudaSuccess && download(got, buf, p.total) &&
                memcmp(got, want, p.total) == 0,
            "gather: %d experts, %d parts (%s), %zu bytes: the buffer is their concatenation", p.num_experts,
            p.num_parts, aligned ? "16-byte aligned" : "odd sizes and offsets", p.total);
        /* scatter a changed buffer back into zeroed parts */
        for (size_t i = 0; i < p.total; i++) want[i] = (unsigned char)(want[i] ^ 0x5a);
        cudaMemcpy(buf, want, p.total, cudaMemcpyHostToDevice);
        cudaMemset(p.dev, 0, p.arena);
        st = rp_gpu_scatter(ctx, buf, p.total, p.dev_ptr, p.bytes, p.begin, p.num_experts, NULL, &err);
        unsigned char *arena = malloc(p.arena);
        bool same = st == RP_OK && cudaDeviceSynchronize() == cudaSuccess && download(arena, p.dev, p.arena);
        size_t at = 0, gaps_zero = 1;
        for (int32_t i = 0; same && i < p.num_parts; i++) {
            same = memcmp(arena + (p.host_ptr[i] - p.host), want + at, p.bytes[i]) == 0;
            at += p.bytes[i];
        }
        unsigned char *mark = calloc(p.arena, 1);
        for (int32_t i = 0; i < p.num_parts; i++) memset(mark + (p.host_ptr[i] - p.host), 1, p.bytes[i]);
        for (size_t i = 0; i < p.arena; i++) gaps_zero &= mark[i] || arena[i] == 0;
        gok(same && gaps_zero, "scatter: every part gets its bytes back and nothing outside the parts is written");
        free(mark);
        free(arena);
        rp_gpu_dev_free(buf);
        free(want), free(got);
        parts_free(&p);
    }
    /* large aligned copy on a stream: more chunks than blocks */
    {
        const size_t n = (64u << 20) + 4096 + 48;
        unsigned char *h = malloc(n);
        for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + (i >> 12));
        void *src = dev_alloc(n, h), *dst = NULL;
        cudaMalloc(&dst, n);
        cudaStream_t s;
        cudaStreamCreate(&s);
        const void *pp[1] = {src};
        size_t pb[1] = {n};
        int32_t pbeg[2] = {0, 1};
        rp_error err;
        unsigned char *back = malloc(n);
        gok(rp_gpu_gather(ctx, pp, pb, pbeg, 1, dst, n, s, &err) == RP_OK && cudaStreamSynchronize(s) == cudaSuccess &&
                download(back, dst, n) && memcmp(back, h, n) == 0,
            "gather: one 64 MiB part on a stream");
        cudaStreamDestroy(s);
        free(back);
        free(h);
        rp_gpu_dev_free(src);
        cudaFree(dst);
    }
    /* argument errors */
    {
        char dummy[16];
        const void *pp[2] = {dummy, NULL};
        size_t pb[2] = {16, 4};
        int32_t pbeg[2] = {0, 1}, back[3] = {0, 2, 1};
        rp_error err;
        gok(rp_gpu_gather(ctx, pp, pb, pbeg, 1, dummy, 8, NULL, &err) == RP_EINVAL &&
                strstr(err.text, "more than the buffer's 8") != NULL,
            "gather: a buffer too small is RP_EINVAL");
        gok(rp_gpu_gather(ctx, pp, pb, back, 2, dummy, 64, NULL, &err) == RP_EINVAL &&
                rp_gpu_scatter(ctx, dummy, 64, (void *const *)pp, pb, (int32_t[]){0, 2}, 1, NULL, &err) == RP_EINVAL &&
                strstr(err.text, "part 1 has 4 bytes and no pointer") != NULL,
            "gather/scatter: part_begin going backwards, a NULL part: RP_EINVAL");
        gok(rp_gpu_gather(ctx, NULL, NULL, NULL, 0, NULL, 0, NULL, &err) == RP_OK, "gather: no experts is a no-op");
    }
}

static void test_checksums(void)
{
    uint64_t rng = 4242;
    for (int aligned = 1; aligned >= 0; aligned--) {
        parts p;
        parts_make(&p, &rng, 41, 5, 20000, aligned);
        uint64_t *got = calloc((size_t)p.num_experts, sizeof *got);
        int same = 1;
        rp_error err;
        rp_status st = rp_gpu_checksum(ctx, (const void *const *)p.dev_ptr, p.bytes, p.begin, p.num_experts, got, NULL, &err);
        if (st != RP_OK) diag("checksum: %s", err.text);
        for (int32_t i = 0; st == RP_OK && i < p.num_experts; i++) {
            const int32_t b = p.begin[i], n = p.begin[i + 1] - b;
            same &= got[i] == rp_checksum_expert((const void *const *)(p.host_ptr + b), p.bytes + b, n);
        }
        gok(st == RP_OK && same, "checksum: %d experts of %d parts (%s): GPU equals CPU", p.num_experts, p.num_parts,
            aligned ? "aligned" : "blocks across parts, misaligned");
        free(got);
        parts_free(&p);
    }
    /* boundaries: empty, one byte, 31/32/33, a block -1/+0/+1, many blocks */
    static const size_t sizes[] = {0, 1, 31, 32, 33, 4095, 4096, 4097, 8191, 3 * 4096 + 5, 1 << 20};
    enum { NS = sizeof sizes / sizeof sizes[0] };
    size_t total = 0;
    for (int i = 0; i < NS; i++) total += sizes[i];
    unsigned char *h = malloc(total + 8);
    for (size_t i = 0; i < total + 8; i++) h[i] = (unsigned char)(i * 131 + (i >> 8) * 7 + 1);
    void *d = dev_alloc(total + 8, h);
    for (int shift = 0; shift < 2; shift++) {
        const void *pp[NS];
        size_t pb[NS];
        int32_t pbeg[NS + 1];
        uint64_t got[NS];
        size_t at = (size_t)shift * 3;
        for (int i = 0; i < NS; i++) {
            pp[i] = (unsigned char *)d + at;
            pb[i] = sizes[i];
            pbeg[i] = i;
            at += sizes[i];
        }
        pbeg[NS] = NS;
        rp_error err;
        int same = rp_gpu_checksum(ctx, pp, pb, pbeg, NS, got, NULL, &err) == RP_OK;
        at = (size_t)shift * 3;
        for (int i = 0; same && i < NS; i++) {
            same &= got[i] == rp_checksum_bytes(h + at, sizes[i]);
            at += sizes[i];
        }
        gok(same, "checksum: sizes at every boundary (0 to 1 MiB)%s", shift ? ", 3 bytes off alignment" : "");
    }
    /* one expert as the whole gathered buffer equals the same expert in parts */
    {
        const void *pp[3] = {d, (unsigned char *)d + 5000, (unsigned char *)d + 5001};
        size_t pb[3] = {5000, 1, 9000};
        int32_t parts3[2] = {0, 3}, whole1[2] = {0, 1};
        const void *wp[1] = {d};
        size_t wb[1] = {14001};
        uint64_t a = 0, b = 1;
        rp_error err;
        gok(rp_gpu_checksum(ctx, pp, pb, parts3, 1, &a, NULL, &err) == RP_OK &&
                rp_gpu_checksum(ctx, wp, wb, whole1, 1, &b, NULL, &err) == RP_OK && a == b &&
                a == rp_checksum_bytes(h, 14001),
            "checksum: an expert in parts and gathered in one buffer have one checksum");
    }
    {
        uint64_t x = 7;
        rp_error err;
        gok(rp_gpu_checksum(ctx, NULL, NULL, (int32_t[]){0, 0}, 1, &x, NULL, &err) == RP_OK &&
                x == 0xEF46DB3751D8E999ULL,
            "checksum: an expert with no parts is xxh64 of nothing");
    }
    /* corruption of one byte is seen */
    {
        unsigned char flip = (unsigned char)(h[4097] ^ 1);
        cudaMemcpy((unsigned char *)d + 4097, &flip, 1, cudaMemcpyHostToDevice);
        const void *pp[1] = {d};
        size_t pb[1] = {8192};
        uint64_t x = 0;
        rp_error err;
        gok(rp_gpu_checksum(ctx, pp, pb, (int32_t[]){0, 1}, 1, &x, NULL, &err) == RP_OK &&
                x != rp_checksum_bytes(h, 8192),
            "checksum: one flipped byte changes the device checksum");
    }
    rp_gpu_dev_free(d);
    free(h);
}
#endif /* RP_HAVE_CUDA */

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    rp_error err;
    if (!rp_gpu_built() || rp_gpu_count() == 0) {
        /* Without a device every entry point refuses cleanly. */
        ok(rp_gpu_checksum(ctx, NULL, NULL, (int32_t[]){0, 0}, 1, (uint64_t[1]){0}, NULL, &err) == RP_ENOTSUP,
           "without a GPU: rp_gpu_checksum is RP_ENOTSUP");
        like(err.text, rp_gpu_built() ? "no CUDA device" : "no CUDA kernels", "and says why");
        ok(rp_gpu_remap_rank(NULL, NULL, 0, 0, NULL, NULL, RP_SPLIT_EVEN, NULL, NULL, &err) ==
               (rp_gpu_built() ? RP_EINVAL : RP_ENOTSUP),
           "without a GPU: rp_gpu_remap_rank refuses (%s)", err.text);
        skip(GPU_CHECKS, "no GPU");
        rp_context_free(ctx);
        return tap_done();
    }
#ifdef RP_HAVE_CUDA
    diag("running on %d CUDA device(s)", rp_gpu_count());
    test_remap();
    test_copies();
    test_checksums();
    ok(gpu_checks_run == GPU_CHECKS, "ran the %d planned GPU checks (%d)", GPU_CHECKS, gpu_checks_run);
#endif
    rp_context_free(ctx);
    return tap_done();
}
