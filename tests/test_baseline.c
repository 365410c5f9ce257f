/* Baselines: verl's packing list for list (0.6.0 and 0.6.1), attention keys, contiguous
 * and EPLB placement, slot stability, validity, determinism and bad input. */
#include "baseline_internal.h"
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

static uint64_t rng_state = 0x2545F4914F6CDD1DULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

typedef batch_fixture fixture; /* test_util.h */

/* 4 GPUs in `nodes` nodes, one EP group of 4 with 3 slots each, 2 layers of 8 experts,
 * top-2, microbatch cap `cap` tokens, `trainer` the config's trainer object ("{}": the
 * defaults). Routing skewed towards low expert ids. */
static bool fixture_make_trainer(fixture *f, int nodes, int cap, const char *slots, int32_t n, const int32_t *lens,
                                 const char *trainer)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"execution\": {\"executor\": \"ideal\"},"
             " \"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": 4, \"slots_per_gpu\": %s},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
             "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": %d}, \"trainer\": %s}",
             nodes, 4 / nodes, slots, cap, trainer);
    rp_error err;
    bool made = batch_fixture_random(ctx, f, json, n, lens, &rng_state, &err);
    if (!made) diag("fixture: %s", err.text);
    return made;
}

static bool fixture_make(fixture *f, int nodes, int cap, const char *slots, int32_t n, const int32_t *lens)
{
    return fixture_make_trainer(f, nodes, cap, slots, n, lens, "{}");
}

/* Lists a plan's packing as text "[[a, b], [c]] [[..]] ..." per rank. */
static void packing_text(const rp_plan *p, char *buf, size_t cap)
{
    size_t o = 0;
    buf[0] = 0;
    for (int32_t g = 0; g < rp_plan_num_gpus(p); g++) {
        o += (size_t)snprintf(buf + o, cap - o, "%s[", g ? " " : "");
        for (int32_t m = 0; m < rp_plan_num_microbatches(p); m++) {
            int32_t count;
            const int32_t *s = rp_plan_microbatch(p, g, m, &count);
            o += (size_t)snprintf(buf + o, cap - o, "%s[", m ? ", " : "");
            for (int32_t k = 0; k < count; k++) o += (size_t)snprintf(buf + o, cap - o, "%s%d", k ? ", " : "", s[k]);
            o += (size_t)snprintf(buf + o, cap - o, "]");
        }
        o += (size_t)snprintf(buf + o, cap - o, "]");
    }
}

/* 24 sequences, 4 ranks, cap 70. Expected lists from verl's own get_seqlen_balanced_partitions
 * driven through the steps of _balance_batch and rearrange_micro_batches (v0.6.0 for
 * token_kk, v0.6.1 for verl_kk), each rank's microbatches in verl's order. */
static const int32_t VERL_LENS[24] = {18, 40, 37, 11, 26, 33, 40, 7, 3, 33, 19, 38,
                                      17, 15, 33, 37, 38, 33, 28, 12, 17, 12, 36, 27};
static const char *VERL_060 =
    "[[1, 3], [5, 10], [12, 17]] [[4, 14], [15, 21], [7, 11]] [[2, 20], [6, 8], [18, 23]] "
    "[[16, 19], [13, 22], [0, 9]]";
static const char *VERL_061 =
    "[[7, 11], [15, 20], [4, 18]] [[5, 12], [10, 17], [3, 1]] [[8, 6], [23, 14], [2, 21]] "
    "[[19, 16], [22, 13], [0, 9]]";

static void test_verl_lists(void)
{
    fixture f;
    rp_error err;
    char text[2048];
    if (!fixture_make(&f, 1, 70, "3", 24, VERL_LENS)) {
        skip(4, "fixture");
        return;
    }
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &p, &err), RP_OK,
           "token_kk+contiguous on 24 sequences");
    if (p) {
        packing_text(p, text, sizeof text);
        is_str(text, VERL_060, "token_kk gives verl 0.6.0's microbatch lists, in verl's order");
        rp_plan_free(p);
    }
    p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "verl_kk+contiguous", 0, &p, &err), RP_OK,
           "verl_kk+contiguous on 24 sequences");
    if (p) {
        packing_text(p, text, sizeof text);
        is_str(text, VERL_061, "verl_kk gives verl 0.6.1's microbatch lists, in verl's order");
        rp_plan_free(p);
    }
    batch_fixture_free(&f);
}

/* The same 24 sequences through slime's own build_dp_schedule (THUDM/slime 624b824a,
 * slime/utils/dp_schedule.py; dynamic batch size, balance_data, dp 4, max_tokens_per_gpu
 * 70, global_batch_size 24 / K, one sample per rollout, the fixture's model with vocab 0
 * (RoutePack's workload has no output head), microbatch_group_size_per_vp_stage 2 with
 * vpp 2 for the multiple 2): each rank's microbatches in slime's order, each microbatch's
 * ids ascending. */
static const struct {
    const char *packing, *trainer, *lists;
} SLIME_CASES[] = {
    {"slime_ff", "{}",
     "[[0, 1, 3], [17, 19, 20], [23]] [[6, 10], [16, 18], [12, 13]] [[5, 8, 9], [21, 22], [14]] "
     "[[2, 4, 7], [11], [15]]"},
    {"slime_ff", "{\"microbatch_multiple\": 2}",
     "[[2], [17, 19, 20], [23], [4, 7]] [[6, 10], [15], [14], [18]] [[11], [21, 22], [9], [0, 3]] "
     "[[1], [5, 8], [16], [12, 13]]"},
    {"slime_ff", "{\"mini_batches\": 2}",
     "[[6, 10], [0, 3], [12, 13, 14], [18]] [[2], [5, 8], [15], [22]] [[1], [4, 7], [21, 23], [17]] "
     "[[11], [9], [16], [19, 20]]"},
    {"slime_kk", "{}",
     "[[0, 15, 19], [16, 18], [14]] [[2, 3, 10], [4, 6], [12, 13]] [[5, 8], [1, 23], [22]] "
     "[[7, 9], [11, 20, 21], [17]]"},
    {"slime_kk", "{\"microbatch_multiple\": 2}",
     "[[2], [4, 6], [12, 13], [20, 21]] [[22], [16, 18], [14], [23]] [[7, 9], [5, 8], [15], [0, 19]] "
     "[[1], [11], [17], [3, 10]]"},
    {"slime_kk", "{\"mini_batches\": 2}",
     "[[3, 6, 7], [4], [17, 18], [13, 21]] [[0, 1], [8, 10], [16, 20], [23]] [[5], [11], [22], [14]] "
     "[[2], [9], [15], [12, 19]]"},
};

static void test_slime_lists(void)
{
    for (size_t c = 0; c < sizeof SLIME_CASES / sizeof *SLIME_CASES; c++) {
        fixture f;
        rp_error err;
        char text[2048], name[64];
        if (!fixture_make_trainer(&f, 1, 70, "3", 24, VERL_LENS, SLIME_CASES[c].trainer)) {
            skip(2, "fixture");
            continue;
        }
        snprintf(name, sizeof name, "%s+contiguous", SLIME_CASES[c].packing);
        rp_plan *p = NULL;
        is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, name, 0, &p, &err), RP_OK, "%s, trainer %s",
               name, SLIME_CASES[c].trainer);
        if (p) {
            packing_text(p, text, sizeof text);
            is_str(text, SLIME_CASES[c].lists, "%s gives slime's microbatch lists, in slime's order (trainer %s)",
                   SLIME_CASES[c].packing, SLIME_CASES[c].trainer);
            rp_plan_free(p);
        } else {
            diag("%s", err.text);
            skip(1, "no plan");
        }
        batch_fixture_free(&f);
    }
}

/* What slime's packings do beyond the pinned lists: the workload by hand, the cap kept
 * where slime's Karmarkar-Karp would break it, verl's constraint refused, a fixed
 * count, and fewer sequences than microbatches. */
static void test_slime_rules(void)
{
    fixture f;
    rp_error err;
    /* fixture model, 10 tokens: per layer 2 d (h + 2 h_kv) d_h + 2 d^2 + 6 d f k
     * = 2*64*12*16 + 2*64*64 + 6*64*32*2 = 57344 a token, 2 h d_h = 128 per L^2; 2 layers */
    if (!fixture_make(&f, 1, 70, "3", 24, VERL_LENS)) {
        skip(12, "fixture");
        return;
    }
    is_double(rp_slime_workload(rp_config_model(f.cfg), 10), 2 * (57344.0 * 10 + 128.0 * 100), 0,
              "slime's workload of 10 tokens, by hand");
    rp_plan *p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "slime_ff+contiguous", 2, &p, &err), RP_ERANGE,
           "2 fixed microbatches a rank (8 in all) cannot hold 651 tokens under a cap of 70");
    like(err.text, "needs 10 microbatches for mini-batch 0 within the cap of 70 tokens, more than the 4 ranks x 2 fixed",
         "says how many it needs");
    batch_fixture_free(&f);

    /* One 60-token sequence and many short ones under a cap of 64: slime's
     * Karmarkar-Karp on FLOPs (ceil(tokens / cap) bins) would put short ones beside the
     * long one; the plan keeps the cap. */
    int32_t lens[17] = {60};
    for (int i = 1; i < 17; i++) lens[i] = 4 + i % 5;
    if (!fixture_make(&f, 1, 64, "3", 17, lens)) {
        skip(11, "fixture");
        return;
    }
    for (int k = 0; k < 2; k++) {
        const char *name = k ? "slime_kk+eplb" : "slime_ff+eplb";
        rp_plan *p = NULL;
        is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, name, 0, &p, &err), RP_OK, "%s builds", name);
        int64_t worst = 0;
        for (int32_t g = 0; p && g < rp_plan_num_gpus(p); g++)
            for (int32_t m = 0; m < rp_plan_num_microbatches(p); m++) {
                int32_t c;
                const int32_t *seq = rp_plan_microbatch(p, g, m, &c);
                int64_t t = 0;
                for (int32_t i = 0; i < c; i++) t += lens[seq[i]];
                if (t > worst) worst = t;
            }
        ok(p && worst <= 64, "%s keeps the 64-token cap (largest microbatch %lld)", name, (long long)worst);
        rp_plan_free(p);
    }
    /* a fixed count: 2 per rank */
    p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "slime_kk+contiguous", 2, &p, &err), RP_OK,
           "slime_kk with 2 microbatches fixed");
    ok(p && rp_plan_num_microbatches(p) == 2, "runs 2 microbatches a rank");
    rp_plan_free(p);
    batch_fixture_free(&f);

    /* verl's equal sequence counts are not slime's */
    if (!fixture_make_trainer(&f, 1, 70, "3", 24, VERL_LENS, "{\"equal_sequences_per_rank\": true}")) {
        skip(5, "fixture");
        return;
    }
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "slime_ff+eplb", 0, &p, &err), RP_EINVAL,
           "slime_ff is refused under trainer.equal_sequences_per_rank");
    like(err.text, "trainer.equal_sequences_per_rank", "names the key");
    batch_fixture_free(&f);

    /* 3 sequences, 4 ranks: slime asserts; RoutePack leaves a microbatch empty, and
     * refuses under trainer.nonempty_microbatches */
    int32_t few[3] = {10, 20, 30};
    if (!fixture_make(&f, 1, 70, "3", 3, few)) {
        skip(3, "fixture");
        return;
    }
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "slime_kk+eplb", 0, &p, &err), RP_OK,
           "3 sequences over 4 ranks");
    is_int(p ? rp_plan_validate(p, f.cfg, f.batch, &err) : RP_EINVAL, RP_OK, "a valid plan with an empty microbatch");
    rp_plan_free(p);
    batch_fixture_free(&f);
    if (!fixture_make_trainer(&f, 1, 70, "3", 3, few, "{\"nonempty_microbatches\": true}")) {
        skip(2, "fixture");
        return;
    }
    p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "slime_kk+eplb", 0, &p, &err), RP_EINVAL,
           "refused under trainer.nonempty_microbatches");
    like(err.text, "nonempty_microbatches", "names the key");
    batch_fixture_free(&f);
}

/* Loads of EP ranks at a layer under a plan's placement. */
static double max_rank_load(const fixture *f, const rp_plan *p, int32_t layer)
{
    const int64_t *el = rp_stats_expert_load(f->stats, layer);
    double load[8], gl[4];
    for (int e = 0; e < 8; e++) load[e] = (double)el[e];
    rp_place_gpu_loads(ctx, load, 8, 4, rp_plan_slot_begin(p), rp_plan_phy2log(p, layer), NULL, gl, NULL);
    double m = 0;
    for (int g = 0; g < 4; g++) m = fmax(m, gl[g]);
    return m;
}

static void test_all_baselines(void)
{
    enum { N = 64 };
    int32_t lens[N];
    for (int i = 0; i < N; i++) lens[i] = 1 + (int32_t)(rnd(4) ? rnd(30) : rnd(200)); /* long tail */
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 2, 256, "[3, 4, 2, 3]", N, lens)) {
        skip(1, "fixture");
        return;
    }
    const char *const *names = rp_baseline_names();
    int count = 0;
    for (; names[count]; count++) {
        rp_plan *p = NULL, *q = NULL;
        rp_status st = rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, names[count], 0, &p, &err);
        if (strstr(names[count], "+virtual_experts")) {
            /* EP groups of 4 over nodes of 2: the balancer cannot run here */
            is_int(st, RP_EINVAL, "%s is refused on EP groups spanning nodes", names[count]);
            like(err.text, "an EP group of 4 GPUs spans nodes of 2 GPUs", "%s names the limit", names[count]);
            rp_plan_free(p);
            continue;
        }
        is_int(st, RP_OK, "%s builds", names[count]);
        if (st != RP_OK) {
            diag("%s", err.text);
            continue;
        }
        is_int(rp_plan_validate(p, f.cfg, f.batch, &err), RP_OK, "%s is a valid plan", names[count]);
        rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, names[count], 0, &q, &err);
        ok(q && rp_plan_hash(p) == rp_plan_hash(q), "%s is deterministic", names[count]);
        rp_plan_free(p);
        rp_plan_free(q);
    }
    is_int(count, 15, "fifteen baselines are named");

    /* DP level: rank p holds KK partition p of the key, equal counts (64 / 4). */
    rp_plan *tk = NULL, *vk = NULL, *ak = NULL, *ep = NULL, *ct = NULL;
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &tk, &err);
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "verl_kk+contiguous", 0, &vk, &err);
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "attn_kk+contiguous", 0, &ak, &err);
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", 0, &ep, &err);
    rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+contiguous", 0, &ct, &err);
    double tok[N], wl[N], att[N];
    int32_t part[N];
    rp_cost *cost = NULL;
    rp_cost_new(ctx, f.cfg, f.batch, f.stats, RP_SPLIT_EVEN, &cost, &err);
    for (int i = 0; i < N; i++) {
        tok[i] = lens[i];
        wl[i] = 24576.0 * lens[i] + (double)lens[i] * lens[i];
        att[i] = rp_cost_attention_s(cost, lens[i]);
    }
    struct { rp_plan *p; const double *key; const char *name; } lv[3] = {
        {tk, tok, "token_kk"}, {vk, wl, "verl_kk"}, {ak, att, "attn_kk"}};
    for (int v = 0; v < 3; v++) {
        rp_partition_kk(ctx, lv[v].key, N, 4, true, NULL, part, NULL);
        bool same = true;
        for (int i = 0; i < N; i++) same &= rp_plan_seq_rank(lv[v].p, i) == part[i];
        ok(same, "%s: rank p holds Karmarkar-Karp partition p of its key", lv[v].name);
        bool equal = true;
        for (int g = 0; g < 4; g++) {
            int32_t total = 0, c;
            for (int m = 0; m < rp_plan_num_microbatches(lv[v].p); m++) {
                rp_plan_microbatch(lv[v].p, g, m, &c);
                total += c;
            }
            equal &= total == N / 4;
        }
        ok(equal, "%s: every rank gets %d sequences", lv[v].name, N / 4);
    }

    /* Microbatch count (verl's rule) and order. */
    int32_t want_M = 0;
    for (int g = 0; g < 4; g++) {
        int64_t tokens = 0;
        int32_t n_r = 0;
        for (int i = 0; i < N; i++)
            if (rp_plan_seq_rank(tk, i) == g) tokens += lens[i], n_r++;
        int32_t m = (int32_t)((tokens + 255) / 256);
        if (m > n_r) m = n_r;
        if (m > want_M) want_M = m;
    }
    is_int(rp_plan_num_microbatches(tk), want_M, "token_kk: microbatch count max over ranks of ceil(tokens / cap)");
    bool desc = true, vshape = true;
    for (int g = 0; g < 4; g++) {
        double prev = INFINITY, sums[64];
        int32_t M = rp_plan_num_microbatches(tk), c;
        for (int m = 0; m < M; m++) {
            const int32_t *s = rp_plan_microbatch(tk, g, m, &c);
            double sq = 0;
            for (int k = 0; k < c; k++) sq += (double)lens[s[k]] * lens[s[k]];
            desc &= sq <= prev;
            prev = sq;
        }
        M = rp_plan_num_microbatches(vk);
        for (int m = 0; m < M; m++) {
            const int32_t *s = rp_plan_microbatch(vk, g, m, &c);
            sums[m] = 0;
            for (int k = 0; k < c; k++) sums[m] += wl[s[k]];
        }
        /* sorted[::2][::-1] + sorted[1::2]: rises to the largest, then falls */
        int32_t peak = (M - 1) / 2;
        for (int m = 1; m <= peak; m++) vshape &= sums[m - 1] <= sums[m];
        for (int m = peak + 1; m < M; m++) vshape &= sums[m] <= sums[m - 1];
    }
    ok(desc, "token_kk: microbatches in descending sum of squared lengths (verl 0.6.0)");
    ok(vshape, "verl_kk: microbatches small at both ends (verl 0.6.1)");

    /* Caps: every microbatch within 256 tokens. */
    bool capped = true;
    for (int v = 0; v < 3; v++)
        for (int g = 0; g < 4; g++)
            for (int m = 0; m < rp_plan_num_microbatches(lv[v].p); m++) {
                int32_t c;
                const int32_t *s = rp_plan_microbatch(lv[v].p, g, m, &c);
                int64_t t = 0;
                for (int k = 0; k < c; k++) t += lens[s[k]];
                capped &= t <= 256;
            }
    ok(capped, "every baseline microbatch within the token cap");

    /* attn_kk balances attention across ranks at least as well as token_kk here. */
    double a_tk[4] = {0}, a_ak[4] = {0}, mean = 0;
    for (int i = 0; i < N; i++) {
        a_tk[rp_plan_seq_rank(tk, i)] += att[i];
        a_ak[rp_plan_seq_rank(ak, i)] += att[i];
        mean += att[i] / 4;
    }
    double mx_tk = 0, mx_ak = 0;
    for (int g = 0; g < 4; g++) mx_tk = fmax(mx_tk, a_tk[g]), mx_ak = fmax(mx_ak, a_ak[g]);
    ok(mx_ak <= mx_tk, "attn_kk: attention max/mean %.3f <= token_kk's %.3f", mx_ak / mean, mx_tk / mean);

    /* Placement: contiguous is the plan's contiguous layout; eplb fills the slots and
     * lowers the hottest EP rank's load. */
    rp_plan *c2 = NULL;
    rp_plan_new(ctx, f.cfg, 1, &c2, NULL);
    rp_plan_set_contiguous(c2, NULL);
    ok(!memcmp(rp_plan_phy2log(ct, 0), rp_plan_phy2log(c2, 0), 12 * sizeof(int32_t)),
       "contiguous: the trainer's layout");
    int32_t filled = 0;
    for (int s = 0; s < 12; s++) filled += rp_plan_phy2log(ep, 0)[s] >= 0;
    is_int(filled, 12, "eplb: every slot holds a replica");
    for (int l = 0; l < 2; l++)
        ok(max_rank_load(&f, ep, l) <= max_rank_load(&f, ct, l), "eplb: layer %d hottest EP rank %.0f <= contiguous %.0f",
           l, max_rank_load(&f, ep, l), max_rank_load(&f, ct, l));
    /* EPLB's own greedy on these loads gives the same per-rank sets. */
    const int64_t *el = rp_stats_expert_load(f.stats, 0);
    double load[8];
    for (int e = 0; e < 8; e++) load[e] = (double)el[e];
    int32_t slots[4] = {3, 4, 2, 3}, begin[5], phy[12];
    rp_place_input in = {.num_experts = 8, .load = load, .num_gpus = 4, .slots = slots,
                         .mode = RP_PLACE_HIERARCHICAL, .gpus_per_node = 2, .num_groups = 1};
    is_int(rp_place_replicas(ctx, &in, begin, phy, NULL, &err), RP_EINVAL,
           "with 2 nodes per EP group and 1 expert group, EPLB's hierarchical mode does not apply");
    in.mode = RP_PLACE_GLOBAL;
    rp_place_replicas(ctx, &in, begin, phy, NULL, &err);
    ok(!memcmp(phy, rp_plan_phy2log(ep, 0), sizeof phy), "eplb: layer 0 is the global mode's placement");

    rp_plan_free(tk);
    rp_plan_free(vk);
    rp_plan_free(ak);
    rp_plan_free(ep);
    rp_plan_free(ct);
    rp_plan_free(c2);
    rp_cost_free(cost);
    batch_fixture_free(&f);
}

/* eplb with the previous step's plan: experts already on an EP rank keep their slot. */
static void test_stability(void)
{
    enum { N = 32 };
    int32_t lens[N];
    for (int i = 0; i < N; i++) lens[i] = 1 + (int32_t)rnd(40);
    fixture a, b;
    rp_error err;
    if (!fixture_make(&a, 1, 128, "3", N, lens) || !fixture_make(&b, 1, 128, "3", N, lens)) {
        skip(2, "fixture");
        return;
    }
    rp_plan *pa = NULL, *pb = NULL, *fresh = NULL;
    rp_baseline_plan(ctx, a.cfg, a.batch, a.stats, NULL, "verl_kk+eplb", 0, &pa, &err);
    is_int(rp_baseline_plan(ctx, b.cfg, b.batch, b.stats, pa, "verl_kk+eplb", 0, &pb, &err), RP_OK,
           "eplb with the previous plan");
    rp_baseline_plan(ctx, b.cfg, b.batch, b.stats, NULL, "verl_kk+eplb", 0, &fresh, &err);
    bool kept = true, same_sets = true;
    for (int l = 0; l < 2; l++) {
        const int32_t *x = rp_plan_phy2log(pa, l), *y = rp_plan_phy2log(pb, l), *z = rp_plan_phy2log(fresh, l);
        for (int j = 0; j < 4; j++)
            for (int s = j * 3; s < j * 3 + 3; s++) {
                /* an expert on rank j in both plans sits in the same slot */
                for (int t = j * 3; t < j * 3 + 3; t++)
                    if (y[t] >= 0 && y[t] == x[s] && t != s) kept = false;
                bool found = false;
                for (int t = j * 3; t < j * 3 + 3; t++) found |= y[t] == z[s];
                same_sets &= found;
            }
    }
    ok(kept, "experts resident on an EP rank keep their slot index");
    ok(same_sets, "each EP rank holds the same experts as without the previous plan");
    rp_plan_free(pa);
    rp_plan_free(pb);
    rp_plan_free(fresh);
    batch_fixture_free(&a);
    batch_fixture_free(&b);
}

static void test_bad_input(void)
{
    int32_t lens[9] = {10, 20, 30, 40, 50, 60, 70, 80, 90};
    fixture f;
    rp_error err;
    if (!fixture_make(&f, 1, 100, "3", 9, lens)) {
        skip(1, "fixture");
        return;
    }
    rp_plan *p = (rp_plan *)&f; /* must stay untouched on error */
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "kk+eplb", 0, &p, &err), RP_EINVAL, "unknown packing");
    like(err.text, "unknown baseline 'kk+eplb'", "names the baseline");
    like(err.text, "token_kk, verl_kk, attn_kk, slime_ff or slime_kk", "lists the packings");
    ok(p == (rp_plan *)&f, "output untouched on error");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk", 0, &p, &err), RP_EINVAL,
           "a packing without placement");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+random", 0, &p, &err), RP_EINVAL,
           "unknown placement");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, NULL, NULL, "token_kk+eplb", 0, &p, &err), RP_EINVAL,
           "eplb without statistics");
    like(err.text, "needs this step's routing statistics", "says what is missing");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, NULL, NULL, "attn_kk+contiguous", 0, &p, &err), RP_EINVAL,
           "attn_kk without statistics");
    p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, NULL, NULL, "token_kk+contiguous", 0, &p, &err), RP_OK,
           "token_kk+contiguous needs no statistics");
    ok(p && rp_plan_validate(p, f.cfg, f.batch, NULL) == RP_OK,
       "9 sequences over 4 ranks: a valid plan (the batch is padded for verl's equal split)");
    if (p) {
        int32_t most = 0, least = 99;
        for (int g = 0; g < 4; g++) {
            int32_t total = 0, c;
            for (int m = 0; m < rp_plan_num_microbatches(p); m++) {
                rp_plan_microbatch(p, g, m, &c);
                total += c;
            }
            most = total > most ? total : most;
            least = total < least ? total : least;
        }
        ok(most - least <= 1, "ranks differ by at most one sequence (%d..%d)", least, most);
    }
    rp_plan_free(p);
    p = NULL;
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", 1, &p, &err), RP_ERANGE,
           "one microbatch cannot hold a rank's tokens");
    like(err.text, "cannot split its sequences into 1 microbatches within the cap of 100 tokens", "names the cap");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", -1, &p, &err), RP_EINVAL,
           "negative microbatch count");
    is_int(rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, "token_kk+eplb", 5, &p, &err), RP_OK,
           "a fixed count of 5 microbatches");
    if (p) is_int(rp_plan_num_microbatches(p), 5, "the fixed count is kept");
    rp_plan_free(p);

    int32_t long_lens[3] = {10, 150, 20};
    fixture g;
    if (fixture_make(&g, 1, 100, "3", 3, long_lens)) {
        is_int(rp_baseline_plan(ctx, g.cfg, g.batch, g.stats, NULL, "verl_kk+eplb", 0, &p, &err), RP_ERANGE,
               "a sequence longer than the cap");
        like(err.text, "sequence 1 has 150 tokens, more than one microbatch holds (limits.max_tokens_per_microbatch = 100): no plan can pack this batch; raise limits.max_tokens_per_microbatch to at least 150", "names the sequence and the key to raise");
        is_int(err.sequence, 1, "carries the sequence");
        /* statistics of another batch */
        is_int(rp_baseline_plan(ctx, f.cfg, f.batch, g.stats, NULL, "verl_kk+eplb", 0, &p, &err), RP_EINVAL,
               "statistics of another batch");
        like(err.text, "the statistics cover 3 sequences", "says what does not match");
        batch_fixture_free(&g);
    }
    rp_batch *empty = NULL;
    rp_batch_new(ctx, 0, NULL, NULL, NULL, &empty, NULL);
    is_int(rp_baseline_plan(ctx, f.cfg, empty, NULL, NULL, "token_kk+contiguous", 0, &p, &err), RP_EINVAL,
           "an empty batch");
    like(err.text, "the batch is empty", "empty batch message");
    rp_batch_free(empty);
    batch_fixture_free(&f);
}

static void test_alloc_failures(void)
{
    int32_t lens[16];
    for (int i = 0; i < 16; i++) lens[i] = 5 + i * 3;
    fixture f;
    if (!fixture_make(&f, 1, 100, "3", 16, lens)) {
        skip(1, "fixture");
        return;
    }
    const char *names[2] = {"attn_kk+eplb", "token_kk+contiguous"};
    for (int v = 0; v < 2; v++) {
        bool clean = true, done = false;
        for (long n = 1; n < 400 && !done; n++) {
            counting c = {0};
            rp_context *cx;
            rp_context_new(counting_alloc, &c, &cx);
            long base = c.live;
            c.fail_at = c.calls + n;
            rp_plan *p = NULL;
            rp_status st = rp_baseline_plan(cx, f.cfg, f.batch, f.stats, NULL, names[v], 0, &p, NULL);
            if (st == RP_OK) {
                done = true;
                rp_plan_free(p);
            } else if (st != RP_ENOMEM || p != NULL) {
                clean = false;
            }
            if (c.live != base) clean = false;
            rp_context_free(cx);
        }
        ok(clean && done, "%s fails cleanly at every allocation and leaks nothing", names[v]);
    }
    batch_fixture_free(&f);
}

/* rp_baseline_packing: the packing half alone (what the token_kk, verl_kk and attn_kk
 * policies run): the baseline's packing exactly with equal_size, no placement, plain KK
 * over the ranks without it. */
static void test_packing_alone(void)
{
    /* 9 sequences over 4 ranks: one long one, so equal counts per rank cost balance */
    int32_t lens[9] = {400, 10, 12, 9, 11, 13, 8, 10, 12};
    fixture f;
    if (!fixture_make(&f, 1, 1000, "3", 9, lens)) return;
    static const char *const names[] = {"token_kk", "verl_kk", "attn_kk"};
    rp_error err;
    for (int i = 0; i < 3; i++) {
        char full[64], a[4096], b[4096];
        snprintf(full, sizeof full, "%s+contiguous", names[i]);
        rp_plan *pk = NULL, *whole = NULL;
        ok(rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, names[i], 0, true, &pk, &err) == RP_OK &&
           rp_baseline_plan(ctx, f.cfg, f.batch, f.stats, NULL, full, 0, &whole, &err) == RP_OK,
           "%s: packing alone and the whole baseline", names[i]);
        if (pk && whole) {
            packing_text(pk, a, sizeof a);
            packing_text(whole, b, sizeof b);
            is_str(a, b, "%s: the same packing as %s", names[i], full);
            ok(rp_plan_has_packing(pk) && !rp_plan_has_placement(pk), "%s: a packing, no placement", names[i]);
        }
        rp_plan_free(pk);
        rp_plan_free(whole);
    }
    /* equal_size false: the long sequence's rank takes fewer sequences, the others more */
    rp_plan *eq = NULL, *plain = NULL;
    ok(rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, "token_kk", 1, true, &eq, &err) == RP_OK &&
       rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, "token_kk", 1, false, &plain, &err) == RP_OK,
       "token_kk with and without equal sizes");
    if (eq && plain) {
        int32_t most_eq = 0, most_plain = 0, count, with_long_eq = 0, with_long_plain = 0;
        int64_t worst_eq = 0, worst_plain = 0;
        for (int32_t g = 0; g < 4; g++) {
            const int32_t *s = rp_plan_microbatch(eq, g, 0, &count);
            int64_t tok = 0;
            for (int32_t j = 0; j < count; j++) tok += lens[s[j]];
            if (tok > worst_eq) worst_eq = tok;
            if (count > most_eq) most_eq = count;
            for (int32_t j = 0; j < count; j++)
                if (s[j] == 0) with_long_eq = count;
            s = rp_plan_microbatch(plain, g, 0, &count);
            tok = 0;
            for (int32_t j = 0; j < count; j++) tok += lens[s[j]];
            if (tok > worst_plain) worst_plain = tok;
            if (count > most_plain) most_plain = count;
            for (int32_t j = 0; j < count; j++)
                if (s[j] == 0) with_long_plain = count;
        }
        is_int(most_eq, 3, "equal sizes: at most ceil(9 / 4) sequences a rank");
        ok(with_long_eq >= 2, "equal sizes: the long sequence shares its rank (%d sequences)", with_long_eq);
        is_int(with_long_plain, 1, "plain KK: the long sequence's rank holds it alone");
        ok(worst_plain < worst_eq, "so the largest rank is smaller (%lld < %lld tokens)", (long long)worst_plain,
           (long long)worst_eq);
    }
    rp_plan_free(eq);
    rp_plan_free(plain);
    rp_plan *bad = NULL;
    is_int(rp_baseline_packing(ctx, f.cfg, f.batch, f.stats, "token_kk+eplb", 0, true, &bad, &err), RP_EINVAL,
           "a whole baseline's name is not a packing");
    like(err.text, "unknown packing 'token_kk+eplb'; the packings are token_kk, verl_kk, attn_kk, slime_ff and slime_kk",
         "the message lists the packings");
    is_int(rp_baseline_packing(ctx, f.cfg, f.batch, NULL, "attn_kk", 0, true, &bad, &err), RP_EINVAL,
           "attn_kk without statistics");
    batch_fixture_free(&f);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_verl_lists();
    test_slime_lists();
    test_slime_rules();
    test_all_baselines();
    test_stability();
    test_bad_input();
    test_alloc_failures();
    test_packing_alone();
    rp_context_free(ctx);
    return tap_done();
}
