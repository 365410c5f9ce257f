/* Router shift (core/shift.c, kernels/shift.cu): hand-computed cases (no shift, a
 * reordered top-k, full shift, one changed choice per layer, expert and sequence),
 * mixed layouts and widths, random routings against a naive count at several thread
 * counts, bad input, allocation failures, the summary; the GPU path against the CPU
 * (SKIP without a GPU). */
#include "internal.h"
#include "routepack/routepack.h"
#include "../kernels/gpu_support.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <stdlib.h>

static uint64_t rng = 0x243F6A8885A308D3ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)((xorshift64(&rng) >> 11) % n); }

static rp_batch *make_batch(rp_context *ctx, int32_t n, const int32_t *lens)
{
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_batch *b = NULL;
    rp_batch_new(ctx, n, lens, zero, NULL, &b, NULL);
    free(zero);
    return b;
}

static rp_shift *shift_of(rp_context *ctx, rp_batch *b, int32_t layers, int32_t k, int32_t E,
                          const int32_t *old_ids, const int32_t *new_ids, int32_t threads, rp_error *err)
{
    rp_routing o, n;
    rp_routing_packed(&o, RP_ID_I32, layers, k, old_ids);
    rp_routing_packed(&n, RP_ID_I32, layers, k, new_ids);
    rp_shift *sh = NULL;
    if (rp_shift_compute(ctx, b, &o, &n, E, threads, &sh, err) != RP_OK) return NULL;
    return sh;
}

/* Two sequences of 2 and 1 tokens, 2 layers, top-2, 4 experts: ids [token][layer][k]. */
static const int32_t lens3[2] = {2, 1};
static const int32_t base_ids[12] = {0, 1, 2, 3, /* t0 */ 1, 2, 0, 3, /* t1 */ 3, 0, 1, 2 /* t2 */};

static void test_hand(rp_context *ctx)
{
    rp_batch *b = make_batch(ctx, 2, lens3);
    rp_error err;

    rp_shift *sh = shift_of(ctx, b, 2, 2, 4, base_ids, base_ids, 1, &err);
    ok(sh && rp_shift_choices(sh) == 12 && rp_shift_changed(sh) == 0,
       "no shift: 12 choices compared, none changed");
    rp_shift_summary m = rp_shift_summarize(sh);
    is_double(m.fraction, 0.0, 0, "no shift: fraction 0");
    const int64_t *old = rp_shift_expert_old(sh);
    /* layer 0 old ids: {0,1},{1,2},{3,0}: expert 0 x2, 1 x2, 2 x1, 3 x1 */
    ok(old[0] == 2 && old[1] == 2 && old[2] == 1 && old[3] == 1, "expert_old is the old routing's load");
    rp_shift_free(sh);

    /* the same sets in another order: no shift */
    int32_t swapped[12];
    for (int i = 0; i < 12; i += 2) swapped[i] = base_ids[i + 1], swapped[i + 1] = base_ids[i];
    sh = shift_of(ctx, b, 2, 2, 4, base_ids, swapped, 1, &err);
    ok(sh && rp_shift_changed(sh) == 0, "order within the top-k is ignored");
    rp_shift_free(sh);

    /* full shift: every new top-k is the complement of the old one */
    int32_t comp[12];
    for (int i = 0; i < 12; i += 2) {
        int c = 0;
        for (int e = 0; e < 4; e++)
            if (e != base_ids[i] && e != base_ids[i + 1]) comp[i + c++] = e;
    }
    sh = shift_of(ctx, b, 2, 2, 4, base_ids, comp, 1, &err);
    m = rp_shift_summarize(sh);
    ok(sh && rp_shift_changed(sh) == 12, "full shift: all 12 choices changed");
    is_double(m.fraction, 1.0, 0, "full shift: fraction 1");
    is_double(m.max_expert_lost_fraction, 1.0, 0, "full shift: every expert lost all its old choices");
    const int64_t *arr = rp_shift_expert_arrived(sh);
    /* layer 0 new sets: {2,3},{0,3},{1,2}: arrivals 0:1 1:1 2:2 3:2 */
    ok(arr[0] == 1 && arr[1] == 1 && arr[2] == 2 && arr[3] == 2, "full shift: arrivals per expert");
    rp_shift_free(sh);

    /* partial: token 0 layer 0 {0,1} -> {0,3} (expert 1 lost, 3 arrives);
     * token 2 layer 1 {1,2} -> {2,0} (expert 1 lost, 0 arrives); the rest unchanged */
    int32_t part[12];
    memcpy(part, base_ids, sizeof part);
    part[1] = 3;
    part[10] = 2, part[11] = 0;
    sh = shift_of(ctx, b, 2, 2, 4, base_ids, part, 1, &err);
    ok(sh != NULL, "partial shift computed");
    const int64_t *lc = rp_shift_layer_changed(sh), *sc = rp_shift_seq_changed(sh);
    const int64_t *scn = rp_shift_seq_choices(sh);
    const int64_t *lost = rp_shift_expert_lost(sh);
    arr = rp_shift_expert_arrived(sh);
    old = rp_shift_expert_old(sh);
    ok(rp_shift_changed(sh) == 2 && lc[0] == 1 && lc[1] == 1, "partial: one changed choice in each layer");
    ok(sc[0] == 1 && sc[1] == 1 && scn[0] == 8 && scn[1] == 4, "partial: per sequence 1 of 8 and 1 of 4");
    /* layer 1 old: {2,3},{0,3},{1,2}: expert 1 has 1 old choice, lost */
    ok(lost[1] == 1 && old[1] == 2 && lost[4 + 1] == 1 && old[4 + 1] == 1 && lost[4 + 2] == 0,
       "partial: expert 1 lost 1 of 2 at layer 0 and 1 of 1 at layer 1");
    ok(arr[3] == 1 && arr[4 + 0] == 1 && arr[0] == 0, "partial: arrivals of expert 3 (layer 0) and 0 (layer 1)");
    m = rp_shift_summarize(sh);
    is_double(m.fraction, 2.0 / 12, 1e-15, "partial: fraction 2/12");
    ok(m.max_layer == 0 && fabs(m.max_layer_fraction - 1.0 / 6) < 1e-15, "partial: worst layer 0 at 1/6 (first)");
    ok(m.max_seq == 1 && fabs(m.max_seq_fraction - 0.25) < 1e-15, "partial: worst sequence 1 at 1/4");
    ok(m.max_expert_layer == 1 && m.max_expert == 1 && m.max_expert_lost_fraction == 1.0,
       "partial: worst expert: layer 1 expert 1 lost all its old choices");
    rp_shift_free(sh);

    /* a repeated id counts once per entry: old {2,2} new {2,1}: nothing lost, 1 arrives */
    int32_t o1[2] = {2, 2}, n1[2] = {2, 1}, one = 1;
    rp_batch *b1 = make_batch(ctx, 1, &one);
    sh = shift_of(ctx, b1, 1, 2, 4, o1, n1, 1, &err);
    ok(sh && rp_shift_changed(sh) == 0 && rp_shift_expert_old(sh)[2] == 2 && rp_shift_expert_arrived(sh)[1] == 1,
       "repeated ids: counted once per entry");
    rp_shift_free(sh);
    rp_batch_free(b1);
    rp_batch_free(b);
}

/* Old packed uint8, new per-layer int32 (Megatron's buffers): the same counts. */
static void test_layouts(rp_context *ctx)
{
    rp_batch *b = make_batch(ctx, 2, lens3);
    int32_t part[12];
    memcpy(part, base_ids, sizeof part);
    part[1] = 3;
    part[10] = 2, part[11] = 0;
    uint8_t old8[12];
    for (int i = 0; i < 12; i++) old8[i] = (uint8_t)base_ids[i];
    int32_t layer0[6], layer1[6];
    for (int t = 0; t < 3; t++)
        for (int j = 0; j < 2; j++) layer0[t * 2 + j] = part[(t * 2 + 0) * 2 + j], layer1[t * 2 + j] = part[(t * 2 + 1) * 2 + j];
    const void *layers[2] = {layer0, layer1};
    rp_routing o, n;
    rp_routing_packed(&o, RP_ID_U8, 2, 2, old8);
    rp_routing_per_layer(&n, RP_ID_I32, 2, 2, layers);
    rp_shift *sh = NULL;
    rp_error err;
    rp_status s = rp_shift_compute(ctx, b, &o, &n, 4, 0, &sh, &err);
    ok(s == RP_OK && rp_shift_changed(sh) == 2 && rp_shift_layer_changed(sh)[1] == 1 && rp_shift_seq_changed(sh)[1] == 1,
       "mixed layouts and widths: the same counts (%s)", s ? err.text : "ok");
    rp_shift_free(sh);
    rp_batch_free(b);
}

/* A naive count over int32 [tokens][layers][k]: O(k^2) membership. */
static void naive(const rp_batch *b, int32_t L, int32_t k, int32_t E, const int32_t *o, const int32_t *nw,
                  int64_t *layer, int64_t *seq, int64_t *eold, int64_t *elost, int64_t *earr)
{
    const int64_t *cu = rp_batch_cu_seqlens(b);
    for (int32_t s = 0; s < rp_batch_num_seqs(b); s++)
        for (int64_t t = cu[s]; t < cu[s + 1]; t++)
            for (int32_t l = 0; l < L; l++) {
                const int32_t *a = o + (t * L + l) * k, *c = nw + (t * L + l) * k;
                for (int32_t j = 0; j < k; j++) {
                    bool in = false, in_old = false;
                    for (int32_t i = 0; i < k; i++) in |= c[i] == a[j], in_old |= a[i] == c[j];
                    eold[l * E + a[j]]++;
                    if (!in) elost[l * E + a[j]]++, layer[l]++, seq[s]++;
                    if (!in_old) earr[l * E + c[j]]++;
                }
            }
}

static void test_random(rp_context *ctx)
{
    enum { N = 40, L = 3, K = 4, E = 16 };
    int32_t lens[N];
    for (int i = 0; i < N; i++) lens[i] = (int32_t)rnd(60);
    rp_batch *b = make_batch(ctx, N, lens);
    const int64_t T = rp_batch_num_tokens(b);
    int32_t *o = malloc((size_t)T * L * K * sizeof *o), *nw = malloc((size_t)T * L * K * sizeof *nw);
    for (int64_t t = 0; t < T * L; t++) {
        /* distinct ids per top-k; the new one keeps each old id with probability 3/4 */
        int32_t *a = o + t * K, *c = nw + t * K;
        for (int j = 0; j < K; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)rnd(E);
                dup = false;
                for (int i = 0; i < j; i++) dup |= a[i] == e;
            } while (dup);
            a[j] = e;
        }
        for (int j = 0; j < K; j++) {
            int32_t e = rnd(4) ? a[j] : (int32_t)rnd(E);
            bool dup = false;
            for (int i = 0; i < j; i++) dup |= c[i] == e;
            c[j] = dup ? a[j] : e;
        }
        for (int j = K - 1; j > 0; j--) { /* shuffle the new order */
            int i = (int)rnd((uint32_t)j + 1);
            int32_t x = c[i];
            c[i] = c[j], c[j] = x;
        }
    }
    int64_t layer[L] = {0}, seq[N] = {0}, eold[L * E] = {0}, elost[L * E] = {0}, earr[L * E] = {0};
    naive(b, L, K, E, o, nw, layer, seq, eold, elost, earr);
    int64_t total = 0;
    for (int l = 0; l < L; l++) total += layer[l];
    int threads[4] = {1, 3, 8, 0};
    for (int i = 0; i < 4; i++) {
        rp_error err;
        rp_shift *sh = shift_of(ctx, b, L, K, E, o, nw, threads[i], &err);
        ok(sh && rp_shift_changed(sh) == total && total > 0 &&
               !memcmp(rp_shift_layer_changed(sh), layer, sizeof layer) &&
               !memcmp(rp_shift_seq_changed(sh), seq, sizeof seq) &&
               !memcmp(rp_shift_expert_old(sh), eold, sizeof eold) &&
               !memcmp(rp_shift_expert_lost(sh), elost, sizeof elost) &&
               !memcmp(rp_shift_expert_arrived(sh), earr, sizeof earr),
           "random routing, %d threads: equal to a naive count (%lld changed)", threads[i], (long long)total);
        rp_shift_free(sh);
    }

    /* GPU: both views in device memory give the CPU's counts */
    if (rp_gpu_count() == 0) {
        skip(2, "no GPU");
    } else {
        void *od = NULL, *nd = NULL;
        rp_error err;
        size_t bytes = (size_t)T * L * K * sizeof *o;
        bool up = rp_gpu_dev_upload(o, bytes, &od, &err) == RP_OK && rp_gpu_dev_upload(nw, bytes, &nd, &err) == RP_OK;
        rp_routing ov, nv;
        rp_routing_packed(&ov, RP_ID_I32, L, K, od);
        rp_routing_packed(&nv, RP_ID_I32, L, K, nd);
        rp_shift *g = NULL, *c = shift_of(ctx, b, L, K, E, o, nw, 1, &err);
        rp_status s = up ? rp_shift_compute(ctx, b, &ov, &nv, E, 0, &g, &err) : RP_EIO;
        ok(s == RP_OK && g && c && rp_shift_changed(g) == rp_shift_changed(c) &&
               !memcmp(rp_shift_layer_changed(g), rp_shift_layer_changed(c), sizeof layer) &&
               !memcmp(rp_shift_seq_changed(g), rp_shift_seq_changed(c), sizeof seq) &&
               !memcmp(rp_shift_expert_old(g), rp_shift_expert_old(c), sizeof eold) &&
               !memcmp(rp_shift_expert_lost(g), rp_shift_expert_lost(c), sizeof elost) &&
               !memcmp(rp_shift_expert_arrived(g), rp_shift_expert_arrived(c), sizeof earr),
           "GPU: device routings give the CPU's counts (%s)", s ? err.text : "ok");
        rp_shift_free(g);
        /* an id out of range in the new routing: the CPU's message */
        nw[5 * L * K + 1 * K + 2] = 99;
        rp_gpu_dev_free(nd);
        nd = NULL;
        up = up && rp_gpu_dev_upload(nw, bytes, &nd, &err) == RP_OK;
        rp_routing_packed(&nv, RP_ID_I32, L, K, nd);
        rp_error gerr, cerr;
        rp_status gs = up ? rp_shift_compute(ctx, b, &ov, &nv, E, 0, &g, &gerr) : RP_EIO;
        rp_routing oh, nh;
        rp_routing_packed(&oh, RP_ID_I32, L, K, o);
        rp_routing_packed(&nh, RP_ID_I32, L, K, nw);
        rp_shift *h = NULL;
        rp_status cs = rp_shift_compute(ctx, b, &oh, &nh, E, 1, &h, &cerr);
        ok(gs == RP_ERANGE && cs == RP_ERANGE && strcmp(gerr.text, cerr.text) == 0,
           "GPU: a bad new id gives the CPU's message ('%s' vs '%s')", gerr.text, cerr.text);
        nw[5 * L * K + 1 * K + 2] = 0;
        rp_shift_free(c);
        rp_gpu_dev_free(od);
        rp_gpu_dev_free(nd);
    }
    free(o), free(nw);
    rp_batch_free(b);
}

static void test_errors(rp_context *ctx)
{
    rp_batch *b = make_batch(ctx, 2, lens3);
    rp_routing o, n;
    rp_shift *sh = NULL;
    rp_error err;
    int32_t bad[12];
    memcpy(bad, base_ids, sizeof bad);

    rp_routing_packed(&o, RP_ID_I32, 2, 2, base_ids);
    rp_routing_packed(&n, RP_ID_I32, 3, 2, base_ids);
    ok(rp_shift_compute(ctx, b, &o, &n, 4, 1, &sh, &err) == RP_EINVAL && strstr(err.text, "2 layers x top-2") &&
           strstr(err.text, "3 layers x top-2") && !sh,
       "mismatched layers are named: %s", err.text);
    rp_routing_packed(&n, RP_ID_I32, 2, 1, base_ids);
    ok(rp_shift_compute(ctx, b, &o, &n, 4, 1, &sh, &err) == RP_EINVAL && strstr(err.text, "top-1") && !sh,
       "mismatched top-k is named: %s", err.text);
    rp_routing_packed(&n, RP_ID_I32, 2, 5, base_ids);
    ok(rp_shift_compute(ctx, b, &o, &n, 4, 1, &sh, &err) == RP_EINVAL &&
           strncmp(err.text, "new routing: top-k 5 exceeds", 28) == 0,
       "a bad view names which routing: %s", err.text);

    bad[2 * 4 + 1 * 2 + 1] = 9; /* token 2 = sequence 1 token 0, layer 1, choice 1 */
    rp_routing_packed(&n, RP_ID_I32, 2, 2, bad);
    ok(rp_shift_compute(ctx, b, &o, &n, 4, 1, &sh, &err) == RP_ERANGE && !sh &&
           strcmp(err.text, "new routing: sequence 1 token 0 layer 1 choice 1 has expert id 9, but the model "
                            "has 4 experts") == 0 &&
           err.sequence == 1 && err.expert == 9,
       "an id out of range in the new routing is named: %s", err.text);
    int32_t bad_old[12];
    memcpy(bad_old, base_ids, sizeof bad_old);
    bad_old[5] = -1; /* sequence 0 token 1 layer 0 choice 1 */
    rp_routing_packed(&o, RP_ID_I32, 2, 2, bad_old);
    ok(rp_shift_compute(ctx, b, &o, &n, 4, 1, &sh, &err) == RP_ERANGE &&
           strcmp(err.text, "old routing: sequence 0 token 1 layer 0 choice 1 has expert id -1, but the model "
                            "has 4 experts") == 0,
       "with both bad, the old routing's id is named first: %s", err.text);
    ok(rp_shift_compute(ctx, b, NULL, &n, 4, 1, &sh, &err) == RP_EINVAL, "a missing routing is refused");

    /* every allocation fails cleanly and leaks nothing */
    int cleanly = 1, tried = 0;
    for (long k = 1; k < 40; k++) {
        counting c = {0};
        rp_context *fctx;
        rp_context_new(counting_alloc, &c, &fctx);
        c.fail_at = k + 1; /* the context took call 1 */
        rp_batch *fb = make_batch(ctx, 2, lens3);
        sh = NULL;
        rp_routing_packed(&o, RP_ID_I32, 2, 2, base_ids);
        rp_routing_packed(&n, RP_ID_I32, 2, 2, base_ids);
        rp_status s = rp_shift_compute(fctx, fb, &o, &n, 4, 2, &sh, NULL);
        if (s == RP_OK) rp_shift_free(sh);
        else if (s != RP_ENOMEM || sh) cleanly = 0;
        int all_tried = c.fail_at > c.calls;
        rp_batch_free(fb);
        rp_context_free(fctx);
        if (c.live != 0) cleanly = 0;
        if (all_tried) break;
        tried++;
    }
    ok(tried >= 7 && cleanly, "each of %d allocations fails cleanly, leaking nothing", tried);

    /* an empty batch: nothing compared */
    rp_batch *empty = make_batch(ctx, 0, NULL);
    rp_routing_packed(&o, RP_ID_I32, 2, 2, NULL);
    rp_routing_packed(&n, RP_ID_I32, 2, 2, NULL);
    ok(rp_shift_compute(ctx, empty, &o, &n, 4, 0, &sh, &err) == RP_OK && rp_shift_choices(sh) == 0 &&
           rp_shift_summarize(sh).fraction == 0 && rp_shift_summarize(sh).max_seq == -1,
       "an empty batch: 0 choices, fraction 0, no worst sequence");
    rp_shift_free(sh);
    rp_shift_free(NULL);
    rp_batch_free(empty);
    rp_batch_free(b);
}

/* The step report, its JSON and the flat metrics carry an attached shift. */
static void test_sched(rp_context *ctx)
{
    rp_config *cfg = NULL;
    rp_gen *gen = NULL;
    rp_error err;
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK ||
        rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK) {
        ok(0, "sched setup: %s", err.text);
        return;
    }
    const rp_model *md = rp_config_model(cfg);
    rp_batch *b = NULL;
    rp_routing r;
    uint8_t *ids = gen_step_copy(gen, 0, &b, &r, &err);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.num_threads = 1;
    rp_sched *s = NULL;
    ok(rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK, "sched: created (%s)", err.text);
    const int64_t n_ids = rp_batch_num_tokens(b) * md->num_layers * md->top_k;
    uint8_t *moved = malloc((size_t)n_ids);
    memcpy(moved, ids, (size_t)n_ids);
    /* token 0: its layer-0 top-k becomes experts none of which it had */
    int32_t next = 0;
    for (int32_t j = 0; j < md->top_k; j++) {
        for (;;) {
            bool had = false;
            for (int32_t i = 0; i < md->top_k; i++) had |= ids[i] == next;
            if (!had) break;
            next++;
        }
        moved[j] = (uint8_t)next++;
    }
    rp_routing nr;
    rp_routing_packed(&nr, RP_ID_U8, md->num_layers, md->top_k, moved);
    rp_shift *sh = NULL;
    ok(rp_shift_compute(ctx, b, &r, &nr, md->num_experts, 1, &sh, &err) == RP_OK &&
           rp_shift_changed(sh) == md->top_k,
       "sched: the shift of one moved token counts its %d choices", md->top_k);
    ok(rp_sched_attach_shift(s, sh, &err) == RP_EINVAL && strstr(err.text, "no step"),
       "sched: attaching before a step is refused: %s", err.text);
    const rp_plan *plan;
    const rp_step_report *rep;
    ok(rp_sched_step(s, 0, b, &r, &plan, &rep, &err) == RP_OK && !rep->has_shift, "sched: a step has no shift");
    char *text = NULL;
    rp_sched_report_json(s, &text, NULL, &err);
    ok(text && !strstr(text, "router_shift"), "sched: nor does its JSON");
    rp_text_free(ctx, text);
    ok(rp_sched_attach_shift(s, sh, &err) == RP_OK && rep->has_shift && rep->shift.changed == md->top_k &&
           rep->shift.max_seq == 0,
       "sched: attached, the report carries the summary");
    text = NULL;
    rp_sched_report_json(s, &text, NULL, &err);
    json_error_t je;
    json_t *root = text ? json_loads(text, 0, &je) : NULL;
    json_t *rs = json_object_get(root, "router_shift"), *m = json_object_get(root, "metrics");
    ok(json_integer_value(json_object_get(rs, "changed")) == md->top_k &&
           json_integer_value(json_object_get(rs, "max_seq")) == 0,
       "sched: the JSON report has router_shift");
    ok(fabs(json_real_value(json_object_get(m, "router_shift_fraction")) - (double)md->top_k / (double)n_ids) < 1e-15 &&
           json_real_value(json_object_get(m, "router_shift_max_layer_fraction")) > 0 &&
           json_object_get(m, "router_shift_max_seq_fraction") &&
           json_object_get(m, "router_shift_max_expert_lost_fraction"),
       "sched: the flat metrics have the router_shift_* keys");
    json_decref(root);
    rp_text_free(ctx, text);

    /* a shift of another batch is refused and changes nothing */
    rp_batch *other = NULL;
    rp_routing orr;
    uint8_t *oids = gen_step_copy(gen, 1, &other, &orr, &err);
    rp_shift *osh = NULL;
    rp_shift_compute(ctx, other, &orr, &orr, md->num_experts, 1, &osh, &err);
    rp_status st = rp_sched_attach_shift(s, osh, &err);
    ok(st == RP_EINVAL && strstr(err.text, "but step 0 has") && rep->shift.changed == md->top_k,
       "sched: a shift of another batch is refused, the attached one stays: %s", err.text);
    ok(rp_sched_step(s, 1, other, &orr, &plan, &rep, &err) == RP_OK && !rep->has_shift,
       "sched: the next step starts without a shift");
    rp_shift_free(osh);
    rp_shift_free(sh);
    free(oids);
    free(moved);
    free(ids);
    rp_batch_free(other);
    rp_batch_free(b);
    rp_sched_free(s);
    rp_gen_free(gen);
    rp_config_free(cfg);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_hand(ctx);
    test_layouts(ctx);
    test_random(ctx);
    test_errors(ctx);
    test_sched(ctx);
    rp_context_free(ctx);
    return tap_done();
}
