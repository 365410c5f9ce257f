/* The joint planner's surrogates follow the configured structure: hand-computed values
 * of the placement score in the group form (the slowest EP group's own sum) against
 * the global form (sum over microbatches of maxima over all groups), with the dense
 * phase inside max(compute, communication) under overlap; a placement improvement
 * driven by the critical group; and the group-form packing's choices. */
#include "joint_internal.h"
#include "routepack/routepack.h"
#include "tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

/* A hand-built planner state: M microbatches, Q groups of ep ranks, one layer, E
 * experts, `per` slots per rank, every GPU at speed 1, the group histograms `hist`
 * ([M][Q][E]); unit costs t_choice 1 and d_choice 0 unless the test sets them. */
typedef struct hand {
    joint jt;
    int32_t slot_begin[9];
    int32_t slot_rank[16];
    int32_t node_of_rank[8];
    double speed[16];
    int64_t hist[64];
    joint_layer lay;
} hand;

static void hand_init(hand *h, int32_t M, int32_t Q, int32_t ep, int32_t E, int32_t per, const int64_t *hist,
                      const int32_t *phy2log)
{
    memset(h, 0, sizeof *h);
    joint *jt = &h->jt;
    jt->ctx = ctx;
    jt->M = M, jt->Q = Q, jt->ep = ep, jt->G = Q * ep, jt->L = 1, jt->E = E, jt->K = 1, jt->S = ep * per, jt->gpn = ep;
    for (int32_t j = 0; j <= ep; j++) h->slot_begin[j] = j * per;
    for (int32_t s = 0; s < jt->S; s++) h->slot_rank[s] = s / per;
    for (int32_t g = 0; g < jt->G; g++) h->speed[g] = 1.0;
    memcpy(h->hist, hist, (size_t)M * Q * E * sizeof *hist);
    jt->slot_begin = h->slot_begin;
    jt->slot_rank = h->slot_rank;
    jt->node_of_rank = h->node_of_rank;
    jt->speed = h->speed;
    jt->uniform_speed = true;
    jt->rank_speed_min = jt->speed_max = 1.0;
    jt->grp_hist = h->hist;
    jt->t_choice = 1.0;
    jt->x_mult = 1.0;
    joint_layer_alloc(jt, &h->lay, NULL);
    memcpy(h->lay.phy2log, phy2log, (size_t)jt->S * sizeof *phy2log);
    joint_layer_index(jt, &h->lay);
}

static double score(hand *h, bool ideal)
{
    double *scratch = calloc(joint_place_scratch_doubles(&h->jt), sizeof *scratch);
    double v = ideal ? joint_place_score_ideal(&h->jt, 0, &h->lay, scratch) : joint_place_score(&h->jt, 0, &h->lay, scratch);
    free(scratch);
    return v;
}

/* Two microbatches, two EP groups of two ranks, expert j on rank j. Token-choices:
 *   mb 0: group 0 [4, 0], group 1 [1, 1];  mb 1: group 0 [1, 1], group 1 [0, 4]
 * With t = 1, d = 0: the global form charges each microbatch its busiest rank of any
 * group, 4 + 4 = 8; the group form each group its own sum, 4 + 1 = 1 + 4 = 5.
 * With d = 0.5, every send 3 and the dense phase 2 where a group holds the 4 (mb 0
 * group 0, mb 1 group 1), 0 elsewhere (global: 2 per microbatch):
 *   overlap layer, group: max(2 + 4, 2 x 0.5 x max(4, 3)) + max(0 + 1, 3) = 6 + 3 = 9
 *     per group (without the dense phase inside the max it would be 4 + 3 = 7);
 *     global: 2 x max(2 + 4, 4) = 12
 *   overlap none, group: (2 + 4 + 4) + (0 + 1 + 3) = 14; global: 2 x (2 + 4 + 4) = 20 */
static void test_place_score(void)
{
    static const int64_t hist[8] = {4, 0, 1, 1, 1, 1, 0, 4};
    static const int32_t p2l[2] = {0, 1};
    hand h;
    hand_init(&h, 2, 2, 2, 2, 1, hist, p2l);
    h.jt.group_form = false;
    is_double(score(&h, false), 8.0, 1e-12, "global form: sum over microbatches of the busiest rank of any group");
    h.jt.group_form = true;
    is_double(score(&h, false), 5.0, 1e-12, "group form: the slowest group's own sum");
    is_double(score(&h, true), 5.0, 1e-12, "... the water-filled score too (no replicas to fill)");

    double send_max[2] = {3, 3}, send_mq[4] = {3, 3, 3, 3};
    double dense_max[2] = {2, 2}, dense_mq[4] = {2, 0, 0, 2};
    h.jt.d_choice = 0.5;
    h.jt.send_max = send_max, h.jt.send_mq = send_mq;
    h.jt.dense_max = dense_max, h.jt.dense_mq = dense_mq;
    h.jt.overlap = true;
    is_double(score(&h, false), 9.0, 1e-12, "overlap, group form: the dense phase is inside max(compute, comm)");
    is_double(score(&h, true), 9.0, 1e-12, "... water-filled alike");
    h.jt.group_form = false;
    is_double(score(&h, false), 12.0, 1e-12, "overlap, global form");
    h.jt.overlap = false;
    is_double(score(&h, false), 20.0, 1e-12, "no overlap, global form");
    h.jt.group_form = true;
    is_double(score(&h, false), 14.0, 1e-12, "no overlap, group form");
    joint_layer_free(&h.jt, &h.lay);
}

/* One microbatch, two groups of two ranks with two slots each, experts {0, 1 | 2, 3}.
 * Group 0 sends [4, 4, 0, 0], group 1 [0, 0, 1, 1]: group 0's rank 0 holds 8, the
 * group form's value is 8. The critical group's hottest rank is rank 0, its coolest
 * rank 1; every expert has one replica of load 8 / 2 = 4 (experts 0, 1: 4 per
 * replica summed over groups) or 1 (experts 2, 3), the swap of expert 0 with expert 2
 * moves 3, the closest to half the gap; it leaves group 0 at 4 | 4 and group 1 at
 * 1 | 1: value 4, and no swap improves on it. Placement {2, 1 | 0, 3}. */
static void test_place_improve(void)
{
    static const int64_t hist[8] = {4, 4, 0, 0, 0, 0, 1, 1};
    static const int32_t p2l[4] = {0, 1, 2, 3};
    hand h;
    hand_init(&h, 1, 2, 2, 4, 2, hist, p2l);
    h.jt.group_form = true;
    is_double(score(&h, false), 8.0, 1e-12, "before: group 0's rank 0 holds 8");
    double *scratch = calloc(joint_place_scratch_doubles(&h.jt), sizeof *scratch);
    rp_error err;
    is_int(joint_place_improve(&h.jt, 0, &h.lay, NULL, 0.0, 4, scratch, NULL, NULL, &err), RP_OK, "improves");
    free(scratch);
    ok(h.lay.phy2log[0] == 2 && h.lay.phy2log[1] == 1 && h.lay.phy2log[2] == 0 && h.lay.phy2log[3] == 3,
       "expert 0 swapped with expert 2 (placement %d %d | %d %d)", h.lay.phy2log[0], h.lay.phy2log[1],
       h.lay.phy2log[2], h.lay.phy2log[3]);
    is_double(score(&h, false), 4.0, 1e-12, "after: every rank of group 0 holds 4");
    joint_layer_free(&h.jt, &h.lay);
}

/* Moves and swaps go to the coolest rank only. One group of three ranks with two slots,
 * experts {0, 1 | 2, 3 | 4, 5} of loads {6, 6 | 4, 4 | 1, 6}: rank 0 holds 12 (the
 * value), rank 1 8, rank 2 (the coolest) 7. With rank 2 the swap closest to half the gap
 * (2.5) gives it expert 0 for expert 4: rank 2 would hold 12, no better; nothing moves. The
 * swap of expert 0 with expert 2 on rank 1, the second coolest (10 | 10 | 7), is not tried.
 * With rank 1 at 3 + 4 and rank 2 at 4 + 4, rank 1 is the coolest and its swap pays:
 * expert 0 for expert 2 (moving 3, as close to 2.5 as moving 2) leaves 9 | 10 | 8, so
 * the placement becomes {2, 1 | 0, 3 | 4, 5}. */
static void test_place_improve_coolest(void)
{
    static const int64_t hist[6] = {6, 6, 4, 4, 1, 6};
    static const int32_t p2l[6] = {0, 1, 2, 3, 4, 5};
    hand h;
    hand_init(&h, 1, 1, 3, 6, 2, hist, p2l);
    is_double(score(&h, false), 12.0, 1e-12, "before: rank 0 holds 12");
    double *scratch = calloc(joint_place_scratch_doubles(&h.jt), sizeof *scratch);
    rp_error err;
    is_int(joint_place_improve(&h.jt, 0, &h.lay, NULL, 0.0, 4, scratch, NULL, NULL, &err), RP_OK, "improves");
    ok(!memcmp(h.lay.phy2log, p2l, sizeof p2l), "the coolest rank's one swap does not pay: nothing moves, "
       "though a swap with the second coolest would (placement %d %d | %d %d | %d %d)", h.lay.phy2log[0],
       h.lay.phy2log[1], h.lay.phy2log[2], h.lay.phy2log[3], h.lay.phy2log[4], h.lay.phy2log[5]);
    /* rank 1 the coolest: experts 2, 3 hold 3 and 4, experts 4, 5 hold 4 and 4 */
    static const int64_t hist2[6] = {6, 6, 3, 4, 4, 4};
    memcpy(h.hist, hist2, sizeof hist2);
    is_int(joint_place_improve(&h.jt, 0, &h.lay, NULL, 0.0, 1, scratch, NULL, NULL, &err), RP_OK, "improves");
    ok(h.lay.phy2log[0] == 2 && h.lay.phy2log[2] == 0, "with rank 1 the coolest, its swap is made (placement %d %d | "
       "%d %d | %d %d)", h.lay.phy2log[0], h.lay.phy2log[1], h.lay.phy2log[2], h.lay.phy2log[3],
       h.lay.phy2log[4], h.lay.phy2log[5]);
    free(scratch);
    joint_layer_free(&h.jt, &h.lay);
}

/* Group-form packing with only the dense term (t = d = 0, no fixed cost, L = 1), four
 * GPUs in two EP groups of two, two microbatches, lengths 40, 38, 20, 10, 10 (dense
 * work a(n) rises with n, a(38) + a(20) > a(40), and 2 a(10) < a(20): attention is
 * quadratic). Keys: (the largest group sum after, the raise of the own group, the
 * emptiest cell), then the lower microbatch and GPU:
 *   40 -> GPU 0 mb 0 (every cell alike: the first);
 *   38 -> GPU 1 mb 0 (under group 0's level: no raise; group 1 would raise by a(38));
 *   20 -> GPU 2 mb 0 (group 0 would rise above a(40); group 1 rises by a(20) and stays
 *         under the top, like its mb 1, which comes later);
 *   10 -> GPU 3 mb 0 (under the levels of both groups: the emptiest cell);
 *   10 -> GPU 3 mb 0 (2 a(10) < a(20), the emptier of the cells with no raise).
 * Groups: a(40) and a(20); the step's microbatch 1 stays empty. */
static void test_pack_group(void)
{
    static const int32_t lens[5] = {40, 38, 20, 10, 10};
    const char *json = "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 2, \"slots_per_gpu\": 1},"
                       " \"model\": {\"num_layers\": 1, \"num_experts\": 2, \"top_k\": 1, \"hidden_size\": 256,"
                       "  \"expert_ffn_size\": 128, \"num_heads\": 4, \"head_dim\": 64},"
                       " \"limits\": {\"max_tokens_per_microbatch\": 1000}}";
    rp_config *cfg = NULL;
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    rp_cost *cost = NULL;
    rp_error err;
    int32_t zero[5] = {0}, gid[5] = {0, 1, 2, 3, 4};
    uint8_t ids[118] = {0};
    bool okay = rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) == RP_OK &&
                rp_batch_new(ctx, 5, lens, zero, gid, &batch, &err) == RP_OK;
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 1, 1, ids);
    okay = okay && rp_stats_compute(ctx, batch, &r, 2, 1, &stats, &err) == RP_OK &&
           rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, &err) == RP_OK;
    ok(okay, "fixture");
    if (!okay) {
        diag("%s", err.text);
        return;
    }
    ok(rp_cost_dense_s(cost, 38) + rp_cost_dense_s(cost, 20) > rp_cost_dense_s(cost, 40) &&
           2 * rp_cost_dense_s(cost, 10) < rp_cost_dense_s(cost, 20),
       "the dense work is superlinear, as the case needs");
    rp_joint_params par = rp_joint_defaults();
    par.prompt_spread = 0;
    joint jt;
    memset(&jt, 0, sizeof jt);
    double speed[4] = {1, 1, 1, 1};
    int32_t seq_gpu[5], seq_mb[5];
    jt.ctx = ctx, jt.cfg = cfg, jt.batch = batch, jt.stats = stats, jt.cost = cost, jt.par = &par;
    jt.N = 5, jt.G = 4, jt.ep = 2, jt.Q = 2, jt.gpn = 4, jt.L = 1, jt.E = 2, jt.K = 1;
    jt.speed = speed, jt.speed_max = jt.rank_speed_min = 1.0, jt.uniform_speed = true;
    jt.cap = 1000;
    jt.group_form = true;
    jt.seq_gpu = seq_gpu, jt.seq_mb = seq_mb;
    is_int(joint_pack(&jt, 2, &err), RP_OK, "packs");
    static const int32_t want_gpu[5] = {0, 1, 2, 3, 3};
    bool same = true;
    for (int32_t s = 0; s < 5; s++) same = same && seq_gpu[s] == want_gpu[s] && seq_mb[s] == 0;
    ok(same, "cells (GPU, mb): (%d,%d) (%d,%d) (%d,%d) (%d,%d) (%d,%d)", seq_gpu[0], seq_mb[0], seq_gpu[1], seq_mb[1],
       seq_gpu[2], seq_mb[2], seq_gpu[3], seq_mb[3], seq_gpu[4], seq_mb[4]);
    rp_cost_free(cost);
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(cfg);
}

/* A random valid layout of E experts over ep x per slots: every expert once, the
 * spare slots extra replicas on ranks that lack them, or free. */
static uint64_t rng = 0x2545F4914F6CDD1DULL;
static uint32_t draw(uint32_t n)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static void random_layout(int32_t E, int32_t ep, int32_t per, int32_t *p2l)
{
    for (;;) {
        const int32_t S = ep * per;
        for (int32_t s = 0; s < S; s++) p2l[s] = s < E ? s : (draw(3) ? (int32_t)draw((uint32_t)E) : -1);
        for (int32_t s = S - 1; s > 0; s--) {
            int32_t k = (int32_t)draw((uint32_t)s + 1), t = p2l[s];
            p2l[s] = p2l[k], p2l[k] = t;
        }
        bool good = true;
        for (int32_t s = 0; s < S && good; s++)
            for (int32_t t = s + 1; t < (s / per + 1) * per && good; t++) good = p2l[s] < 0 || p2l[s] != p2l[t];
        if (good) return;
    }
}

/* joint_place_improve's first and final scores are joint_place_score's of the layout
 * before and after, bit for bit (the construction uses them instead of scoring again):
 * random loads, layouts with replicas and free slots, speeds that differ by rank and
 * group, both forms, 0 to 5 rounds, with and without an anchor and a copy penalty. And a
 * relabelled placement scores as before, bit for bit. */
static void test_improve_scores(void)
{
    enum { M = 2, Q = 2, EP = 4, E = 6, PER = 2 };
    int bad_first = 0, bad_final = 0, bad_relabel = 0, cases = 0;
    for (int c = 0; c < 400; c++) {
        int64_t hist[M * Q * E];
        int32_t p2l[EP * PER], anchor_p2l[EP * PER];
        for (int32_t i = 0; i < M * Q * E; i++) hist[i] = draw(4) ? (int64_t)draw(1000) : 0;
        random_layout(E, EP, PER, p2l);
        random_layout(E, EP, PER, anchor_p2l);
        hand h;
        hand_init(&h, M, Q, EP, E, PER, hist, p2l);
        h.jt.group_form = c % 2;
        h.jt.overlap = c % 4 >= 2;
        double send_max[M] = {3, 5}, send_mq[M * Q] = {3, 1, 2, 5}, dense_max[M] = {2, 4}, dense_mq[M * Q] = {2, 0, 4, 1};
        h.jt.d_choice = 0.25;
        h.jt.send_max = send_max, h.jt.send_mq = send_mq, h.jt.dense_max = dense_max, h.jt.dense_mq = dense_mq;
        const bool ranks_differ = c % 8 >= 4;
        for (int32_t q = 0; q < Q; q++)
            for (int32_t j = 0; j < EP; j++) h.speed[q * EP + j] = ranks_differ && draw(2) ? 0.5 : q ? 0.75 : 1.0;
        h.jt.uniform_speed = false;
        joint_layer anchor;
        joint_layer_alloc(&h.jt, &anchor, NULL);
        memcpy(anchor.phy2log, anchor_p2l, sizeof anchor_p2l);
        joint_layer_index(&h.jt, &anchor);
        double *scratch = calloc(joint_place_scratch_doubles(&h.jt), sizeof *scratch);
        double before = score(&h, false), first = -1, final = -1;
        rp_error err;
        const bool anchored = c % 3 == 0;
        joint_place_improve(&h.jt, 0, &h.lay, anchored ? &anchor : NULL, anchored ? 0.5 : 0.0, c % 6, scratch, &first,
                            &final, &err);
        bad_first += first != before;
        bad_final += final != score(&h, false);
        if (!ranks_differ) { /* every rank interchangeable: relabel toward the anchor */
            int32_t *rs = calloc(joint_relabel_scratch_ints(&h.jt), sizeof *rs);
            double was = score(&h, false);
            joint_relabel(&h.jt, &h.lay, &anchor, rs);
            bad_relabel += score(&h, false) != was;
            free(rs);
        }
        cases++;
        free(scratch);
        joint_layer_free(&h.jt, &anchor);
        joint_layer_free(&h.jt, &h.lay);
    }
    ok(!bad_first, "the search's first score is joint_place_score's before it (%d of %d differ)", bad_first, cases);
    ok(!bad_final, "its final score is joint_place_score's after it (%d of %d differ)", bad_final, cases);
    ok(!bad_relabel, "a relabelled placement scores the same, bit for bit (%d differ)", bad_relabel);
}

/* joint_extras_may_gain: extras are tried only where the busiest rank is more than
 * JOINT_EXTRAS_MARGIN (10%) above the balanced level, the largest over the groups of
 * work / summed speed. Two groups of two ranks. */
static void test_extras_margin(void)
{
    static const int64_t hist[4] = {1, 1, 1, 1};
    static const int32_t p2l[2] = {0, 1};
    hand h;
    hand_init(&h, 1, 2, 2, 2, 1, hist, p2l);
    /* group 0 at level 1.025, busiest 1.05: within the margin */
    const double near[4] = {1.0, 1.05, 1.0, 1.0};
    ok(!joint_extras_may_gain(&h.jt, near), "a cell 2.4%% above its balanced level is left to the shares");
    /* group 1 at level 1.25, busiest 1.5: 20% above */
    const double hot[4] = {1.0, 1.0, 1.0, 1.5};
    ok(joint_extras_may_gain(&h.jt, hot), "a cell 20%% above its balanced level tries extra replicas");
    /* per speed: rank 1 of group 0 twice as fast takes twice the work at the same load per
     * speed, balanced; a plain mean of the loads per speed would not see it */
    h.speed[1] = 2.0;
    const double fast[4] = {1.0, 1.0, 0.5, 0.5};
    ok(!joint_extras_may_gain(&h.jt, fast), "equal loads per speed on unequal GPUs are balanced");
    const double slow[4] = {1.3, 1.0, 0.5, 0.5}; /* level (1.3 + 2) / 3 = 1.1, busiest 18% above */
    ok(joint_extras_may_gain(&h.jt, slow), "the balanced level weighs each rank's load per speed by its speed");
    joint_layer_free(&h.jt, &h.lay);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_place_score();
    test_place_improve();
    test_place_improve_coolest();
    test_improve_scores();
    test_pack_group();
    test_extras_margin();
    rp_context_free(ctx);
    return tap_done();
}
