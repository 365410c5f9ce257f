/* Plans: shape, packing and placement setters, levers, every check message, validate,
 * copy, hash, EPLB arrays, the contiguous layout, slot stabilisation and allocation
 * failures. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>

/* A config for the tests: `slots` is the slots_per_gpu JSON value, `limits` extra
 * members of "limits" (starting with a comma) or "". */
static rp_config *make_config(rp_context *ctx, int nodes, int gpn, int ep, const char *slots, int layers,
                              int experts, long long cap, const char *limits)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %s},\n"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 64,\n"
             "           \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},\n"
             " \"limits\": {\"max_tokens_per_microbatch\": %lld%s}}",
             nodes, gpn, ep, slots, layers, experts, cap, limits);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test config>", &cfg, &err) != RP_OK) {
        printf("Bail out! test config rejected: %s\n", err.text);
        exit(1);
    }
    return cfg;
}

/* The usual test shape: 2 nodes x 2 GPUs, one EP group of 4 with uneven slots
 * [3, 2, 3, 2] (slot_begin 0 3 5 8 10), 2 layers of 6 experts, cap 100 tokens. */
static rp_config *config_a(rp_context *ctx, const char *limits)
{
    return make_config(ctx, 2, 2, 4, "[3, 2, 3, 2]", 2, 6, 100, limits);
}

static rp_batch *make_batch(rp_context *ctx, int n, const int32_t *lens)
{
    int32_t prompt[64], response[64];
    for (int i = 0; i < n; i++) prompt[i] = lens[i] / 2, response[i] = lens[i] - lens[i] / 2;
    rp_batch *b = NULL;
    if (rp_batch_new(ctx, n, prompt, response, NULL, &b, NULL) != RP_OK) {
        printf("Bail out! test batch rejected\n");
        exit(1);
    }
    return b;
}

static bool same_ints(const int32_t *a, const int32_t *b, int n)
{
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return false;
    return true;
}

static bool list_is(const rp_plan *p, int rank, int mb, const int32_t *want, int n)
{
    int32_t count;
    const int32_t *got = rp_plan_microbatch(p, rank, mb, &count);
    return count == n && same_ints(got, want, n);
}

/* Placement used by several tests (config_a): layer 0 with replicas, layer 1 contiguous.
 *   layer 0: rank0 [0 1 2] rank1 [3 4] rank2 [5 0 -] rank3 [1 0]
 *   layer 1: rank0 [0 1 -] rank1 [2 -] rank2 [3 4 -] rank3 [5 -] */
static const int32_t layer0[10] = {0, 1, 2, 3, 4, 5, 0, -1, 1, 0};
static const int32_t layer1[10] = {0, 1, -1, 2, -1, 3, 4, -1, 5, -1};

/* A valid plan for config_a and the batch lengths {30, 40, 50, 20, 10, 60}:
 * rank0 {0,1} {2}; rank1 {3} {4}; rank2 {5} {}; rank3 {} {}. */
static const int32_t base_lens[6] = {30, 40, 50, 20, 10, 60};

static rp_plan *base_plan(rp_context *ctx, const rp_config *cfg)
{
    rp_plan *p = NULL;
    rp_error err;
    int32_t rank[6] = {0, 0, 0, 1, 1, 2}, mb[6] = {0, 0, 1, 0, 1, 0};
    if (rp_plan_new(ctx, cfg, 2, &p, &err) != RP_OK || rp_plan_set_packing(p, 6, rank, mb, &err) != RP_OK ||
        rp_plan_set_phy2log(p, 0, layer0, &err) != RP_OK || rp_plan_set_phy2log(p, 1, layer1, &err) != RP_OK) {
        printf("Bail out! base plan: %s\n", err.text);
        exit(1);
    }
    return p;
}

/* ---- collecting check messages ---- */

typedef struct messages {
    int n;
    char text[32][RP_ERROR_TEXT];
} messages;

static void collect(void *ud, const char *message)
{
    messages *m = ud;
    if (m->n < 32) snprintf(m->text[m->n], RP_ERROR_TEXT, "%s", message);
    m->n++;
}

static bool has_message(const messages *m, const char *want)
{
    for (int i = 0; i < m->n && i < 32; i++)
        if (strcmp(m->text[i], want) == 0) return true;
    return false;
}

static void show(const messages *m)
{
    for (int i = 0; i < m->n && i < 32; i++) diag("  %s", m->text[i]);
}

/* Check `p` and expect exactly `count` messages, one of them `want`. */
static void expect_check(const rp_plan *p, const rp_config *cfg, const rp_batch *b, int count, const char *want,
                         const char *name)
{
    messages m = {0};
    int32_t n = rp_plan_check(p, cfg, b, collect, &m);
    bool pass = n == count && m.n == count && (!want || has_message(&m, want));
    ok(pass, "%s", name);
    if (!pass) {
        diag("expected %d message(s)%s%s, got %d:", count, want ? " including " : "", want ? want : "", n);
        show(&m);
    }
}

/* ---- tests ---- */

static void test_shape(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p = NULL;
    rp_error err;
    is_int(rp_plan_new(ctx, cfg, 0, &p, &err), RP_EINVAL, "zero microbatches rejected");
    like(err.text, "0 microbatches, must be >= 1", "zero microbatches message");
    is_int(rp_plan_new(ctx, cfg, 3, &p, &err), RP_OK, "new plan");
    is_int(rp_plan_num_gpus(p), 4, "GPUs");
    is_int(rp_plan_num_microbatches(p), 3, "microbatches");
    is_int(rp_plan_ep_size(p), 4, "EP size");
    is_int(rp_plan_num_layers(p), 2, "layers");
    is_int(rp_plan_num_experts(p), 6, "experts");
    is_int(rp_plan_total_slots(p), 10, "total slots");
    int32_t begin[5] = {0, 3, 5, 8, 10};
    ok(same_ints(rp_plan_slot_begin(p), begin, 5), "slot_begin follows the uneven slots");
    ok(!rp_plan_has_packing(p) && !rp_plan_has_placement(p), "a new plan has neither packing nor placement");
    int32_t empty[10] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    ok(same_ints(rp_plan_phy2log(p, 1), empty, 10), "every slot starts empty");
    ok(rp_plan_phy2log(p, 2) == NULL && rp_plan_phy2log(p, -1) == NULL, "phy2log of a missing layer is NULL");
    int32_t count = 7;
    ok(rp_plan_microbatch(p, 4, 0, &count) == NULL && count == 0, "microbatch out of range is NULL");
    is_int(rp_plan_seq_rank(p, 0), -1, "no sequence is packed");
    ok(rp_plan_context(p) == ctx, "the plan knows its context");
    rp_plan_free(p);
    rp_plan_free(NULL);
    rp_config_free(cfg);
}

static void test_packing(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p;
    rp_error err;
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    int32_t rank[5] = {3, 0, 3, 0, 1}, mb[5] = {1, 0, 1, 1, 0};
    is_int(rp_plan_set_packing(p, 5, rank, mb, &err), RP_OK, "set packing from per-sequence places");
    ok(rp_plan_has_packing(p), "plan has a packing");
    is_int(rp_plan_num_seqs(p), 5, "sequence count");
    ok(list_is(p, 3, 1, (int32_t[]){0, 2}, 2), "sequences keep ascending id order in a microbatch");
    ok(list_is(p, 0, 1, (int32_t[]){3}, 1) && list_is(p, 0, 0, (int32_t[]){1}, 1) && list_is(p, 2, 0, NULL, 0),
       "every list as assigned");
    is_int(rp_plan_seq_rank(p, 4), 1, "rank of a sequence");
    is_int(rp_plan_seq_microbatch(p, 0), 1, "microbatch of a sequence");
    is_int(rp_plan_seq_rank(p, 5), -1, "rank of a sequence beyond the count is -1");

    uint64_t h = rp_plan_hash(p);
    int32_t bad_rank[5] = {3, 0, 4, 0, 1};
    is_int(rp_plan_set_packing(p, 5, bad_rank, mb, &err), RP_EINVAL, "rank out of range rejected");
    is_str(err.text, "plan: sequence 2 is assigned to rank 4, but there are 4 ranks", "rank out of range message");
    is_int(err.sequence, 2, "error carries the sequence");
    int32_t bad_mb[5] = {1, 0, 1, -1, 0};
    is_int(rp_plan_set_packing(p, 5, rank, bad_mb, &err), RP_EINVAL, "negative microbatch rejected");
    like(err.text, "sequence 3 is assigned to microbatch -1, but there are 2 microbatches", "microbatch message");
    is_int(rp_plan_set_packing(p, -1, rank, mb, &err), RP_EINVAL, "negative sequence count rejected");
    is_int(rp_plan_hash(p), h, "rejected packings leave the plan unchanged");

    /* explicit lists: kept verbatim, duplicates and gaps allowed until check */
    int32_t r0m0[3] = {4, 1, 4}, r1m1[1] = {0}, r3m0[2] = {2, 1};
    const int32_t *lists[8] = {r0m0, NULL, NULL, r1m1, NULL, NULL, r3m0, NULL};
    int32_t counts[8] = {3, 0, 0, 1, 0, 0, 2, 0};
    is_int(rp_plan_set_microbatches(p, 6, lists, counts, &err), RP_OK, "set explicit microbatch lists");
    ok(list_is(p, 0, 0, r0m0, 3) && list_is(p, 3, 0, r3m0, 2), "lists kept verbatim, order and repeats");
    is_int(rp_plan_num_seqs(p), 6, "sequence count from the call");
    is_int(rp_plan_seq_rank(p, 1), 0, "a repeated sequence reports its first occurrence (rank)");
    is_int(rp_plan_seq_microbatch(p, 1), 0, "a repeated sequence reports its first occurrence (mb)");
    is_int(rp_plan_seq_rank(p, 5), -1, "a sequence in no list is not packed");
    h = rp_plan_hash(p);
    int32_t bad_list[2] = {2, 6};
    lists[6] = bad_list;
    is_int(rp_plan_set_microbatches(p, 6, lists, counts, &err), RP_EINVAL, "sequence id out of range rejected");
    is_str(err.text, "plan: rank 3 mb 0 position 1 holds sequence 6, but there are 6 sequences",
           "sequence id out of range message");
    bad_list[1] = -1;
    is_int(rp_plan_set_microbatches(p, 6, lists, counts, &err), RP_EINVAL, "negative sequence id rejected");
    lists[6] = r3m0;
    counts[1] = -2;
    is_int(rp_plan_set_microbatches(p, 6, lists, counts, &err), RP_EINVAL, "negative list size rejected");
    counts[1] = 1;
    is_int(rp_plan_set_microbatches(p, 6, lists, counts, &err), RP_EINVAL, "a size without a list rejected");
    is_int(rp_plan_hash(p), h, "rejected lists leave the plan unchanged");
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void test_move(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p;
    rp_error err;
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    is_int(rp_plan_move_sequence(p, 0, 0, 0, &err), RP_EINVAL, "move needs a packing");
    /* lists: (0,0) {0 1 2}, (1,1) {3}, (3,0) {4 5}; sequence 6 not packed */
    int32_t a[3] = {0, 1, 2}, b[1] = {3}, c[2] = {4, 5};
    const int32_t *lists[8] = {a, NULL, NULL, b, NULL, NULL, c, NULL};
    int32_t counts[8] = {3, 0, 0, 1, 0, 0, 2, 0};
    rp_plan_set_microbatches(p, 7, lists, counts, NULL);
    is_int(rp_plan_move_sequence(p, 1, 3, 0, &err), RP_OK, "move forward");
    ok(list_is(p, 0, 0, (int32_t[]){0, 2}, 2) && list_is(p, 3, 0, (int32_t[]){4, 5, 1}, 3),
       "moved forward to the end of the target");
    is_int(rp_plan_seq_rank(p, 1), 3, "moved sequence's rank");
    is_int(rp_plan_move_sequence(p, 5, 0, 1, &err), RP_OK, "move backward");
    ok(list_is(p, 0, 1, (int32_t[]){5}, 1) && list_is(p, 3, 0, (int32_t[]){4, 1}, 2) &&
           list_is(p, 1, 1, (int32_t[]){3}, 1),
       "moved backward; lists between keep their content");
    is_int(rp_plan_move_sequence(p, 0, 0, 0, &err), RP_OK, "move within the same microbatch");
    ok(list_is(p, 0, 0, (int32_t[]){2, 0}, 2), "moved to the end of its own microbatch");
    is_int(rp_plan_move_sequence(p, 6, 1, 0, &err), RP_OK, "move an unpacked sequence packs it");
    ok(list_is(p, 1, 0, (int32_t[]){6}, 1) && rp_plan_seq_microbatch(p, 6) == 0, "unpacked sequence now packed");
    is_int(rp_plan_move_sequence(p, 4, 3, 1, &err), RP_OK, "move to the last list");
    ok(list_is(p, 3, 1, (int32_t[]){4}, 1) && list_is(p, 3, 0, (int32_t[]){1}, 1), "last list");
    uint64_t h = rp_plan_hash(p);
    is_int(rp_plan_move_sequence(p, 7, 0, 0, &err), RP_EINVAL, "move of a missing sequence rejected");
    is_int(rp_plan_move_sequence(p, 0, 4, 0, &err), RP_EINVAL, "move to a missing rank rejected");
    is_int(rp_plan_move_sequence(p, 0, 0, 2, &err), RP_EINVAL, "move to a missing microbatch rejected");
    is_int(rp_plan_hash(p), h, "rejected moves leave the plan unchanged");

    /* a repeated sequence: moving its first copy exposes the other one */
    int32_t d[2] = {0, 1}, e[1] = {0};
    const int32_t *lists2[8] = {NULL, d, NULL, NULL, e, NULL, NULL, NULL};
    int32_t counts2[8] = {0, 2, 0, 0, 1, 0, 0, 0};
    rp_plan_set_microbatches(p, 2, lists2, counts2, NULL);
    rp_plan_move_sequence(p, 0, 3, 1, NULL);
    ok(rp_plan_seq_rank(p, 0) == 2 && rp_plan_seq_microbatch(p, 0) == 0,
       "after a move the first remaining copy is the first occurrence");

    /* random moves against a plain model of the lists */
    enum { N = 20, LISTS = 8, CAP = 64 };
    int32_t model[LISTS][CAP], size[LISTS] = {0};
    int32_t rank[N], mb[N];
    uint32_t seed = 99;
#define RAND(n) ((seed = seed * 1103515245u + 12345u), (int32_t)((seed >> 16) % (uint32_t)(n)))
    for (int s = 0; s < N; s++) {
        rank[s] = RAND(4);
        mb[s] = RAND(2);
        int l = rank[s] * 2 + mb[s];
        model[l][size[l]++] = s;
    }
    rp_plan_set_packing(p, N, rank, mb, NULL);
    bool agree = true;
    for (int step = 0; step < 2000 && agree; step++) {
        int32_t s = RAND(N), r = RAND(4), m = RAND(2);
        for (int l = 0; l < LISTS; l++)
            for (int k = 0; k < size[l]; k++)
                if (model[l][k] == s) {
                    memmove(&model[l][k], &model[l][k + 1], (size_t)(size[l] - k - 1) * sizeof(int32_t));
                    size[l]--;
                }
        model[r * 2 + m][size[r * 2 + m]++] = s;
        if (rp_plan_move_sequence(p, s, r, m, NULL) != RP_OK) agree = false;
        for (int l = 0; l < LISTS; l++) agree = agree && list_is(p, l / 2, l % 2, model[l], size[l]);
        agree = agree && rp_plan_seq_rank(p, s) == r && rp_plan_seq_microbatch(p, s) == m;
    }
#undef RAND
    ok(agree, "2000 random moves keep every list as a plain model says");
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void test_placement(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p;
    rp_error err;
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    is_int(rp_plan_set_phy2log(p, 0, layer0, &err), RP_OK, "set a layer's slots");
    ok(rp_plan_has_placement(p), "plan has a placement");
    ok(same_ints(rp_plan_phy2log(p, 0), layer0, 10), "phy2log kept");
    int32_t logcnt[6];
    is_int(rp_plan_logcnt(p, 0, logcnt), 3, "largest replica count");
    ok(same_ints(logcnt, (int32_t[]){3, 2, 1, 1, 1, 1}, 6), "replica counts");
    is_int(rp_plan_logcnt(p, 1, logcnt), 0, "an unset layer has no replica");
    is_int(rp_plan_logcnt(p, 2, logcnt), -1, "logcnt of a missing layer is -1");

    uint64_t h = rp_plan_hash(p);
    int32_t bad[10] = {0, 1, 2, 3, 4, 5, 6, -1, -1, -1};
    is_int(rp_plan_set_phy2log(p, 0, bad, &err), RP_EINVAL, "expert id out of range rejected");
    is_str(err.text, "plan: layer 0 slot 6 holds expert 6, but the model has 6 experts", "expert id message");
    is_int(err.expert, 6, "error carries the expert");
    bad[6] = -2;
    is_int(rp_plan_set_phy2log(p, 0, bad, &err), RP_EINVAL, "expert id below -1 rejected");
    is_int(rp_plan_set_phy2log(p, 2, layer0, &err), RP_EINVAL, "missing layer rejected");
    is_int(rp_plan_set_gpu_experts(p, 1, 1, (int32_t[]){1, 2, 3}, 3, &err), RP_EINVAL,
           "more experts than the rank's slots rejected");
    is_str(err.text, "plan: layer 1 EP rank 1 is given 3 experts, but it has 2 slots", "too many experts message");
    is_int(rp_plan_set_gpu_experts(p, 1, 4, (int32_t[]){1}, 1, &err), RP_EINVAL, "missing EP rank rejected");
    is_int(rp_plan_set_gpu_experts(p, 1, 2, (int32_t[]){1, 9}, 2, &err), RP_EINVAL, "bad expert id rejected");
    like(err.text, "layer 1 slot 6 holds expert 9", "bad expert id names its slot");
    is_int(rp_plan_hash(p), h, "rejected placements leave the plan unchanged");

    is_int(rp_plan_set_gpu_experts(p, 1, 2, (int32_t[]){4, 3}, 2, &err), RP_OK, "set one rank's experts");
    ok(same_ints(rp_plan_phy2log(p, 1) + 5, (int32_t[]){4, 3, -1}, 3), "given order, rest of the rank empty");
    is_int(rp_plan_set_gpu_experts(p, 1, 2, (int32_t[]){2}, 1, &err), RP_OK, "set fewer experts");
    ok(same_ints(rp_plan_phy2log(p, 1) + 5, (int32_t[]){2, -1, -1}, 3), "the rank's other slots emptied");
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void test_levers(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p = base_plan(ctx, cfg);
    rp_error err;
    int32_t ranks[8];
    double shares[8];
    /* expert 0 at layer 0: slots 0, 6, 9 -> EP ranks 0, 2, 3 */
    is_int(rp_plan_replicas(p, 0, 0, 0, ranks, shares, 8), 3, "three replicas");
    ok(same_ints(ranks, (int32_t[]){0, 2, 3}, 3), "replicas in ascending slot order");
    ok(shares[0] == -1 && shares[2] == -1, "no explicit shares: -1");
    is_int(rp_plan_add_extra_replica(p, 1, 0, 0, 1, &err), RP_OK, "extra replica");
    is_int(rp_plan_add_extra_replica(p, 0, 1, 2, 0, &err), RP_OK, "extra replica of an earlier key");
    is_int(rp_plan_add_extra_replica(p, 1, 0, 0, 0, &err), RP_OK, "second extra replica of the same key");
    is_int(rp_plan_num_extra_replicas(p), 3, "extra replica count");
    int32_t mb, layer, expert, rank;
    rp_plan_extra_replica(p, 0, &mb, &layer, &expert, &rank);
    ok(mb == 0 && layer == 1 && expert == 2 && rank == 0, "extras sorted by key");
    rp_plan_extra_replica(p, 2, &mb, &layer, &expert, &rank);
    ok(mb == 1 && layer == 0 && expert == 0 && rank == 0, "insertion order kept within a key");
    is_int(rp_plan_replicas(p, 1, 0, 0, ranks, shares, 8), 5, "replicas include the extras of the microbatch");
    ok(same_ints(ranks, (int32_t[]){0, 2, 3, 1, 0}, 5), "extras after the placement's replicas, in order");
    is_int(rp_plan_replicas(p, 0, 0, 0, ranks, shares, 8), 3, "other microbatches do not see them");
    is_int(rp_plan_replicas(p, 1, 0, 0, ranks, shares, 2), 5, "count returned even past cap");

    double s3[3] = {0.5, 0.25, 0.25};
    is_int(rp_plan_set_shares(p, 0, 0, 0, s3, 3, &err), RP_OK, "set shares");
    rp_plan_replicas(p, 0, 0, 0, ranks, shares, 8);
    ok(shares[0] == 0.5 && shares[1] == 0.25 && shares[2] == 0.25, "explicit shares returned per replica");
    double s2[2] = {0.75, 0.25};
    is_int(rp_plan_set_shares(p, 0, 0, 0, s2, 2, &err), RP_OK, "replace shares");
    is_int(rp_plan_num_share_sets(p), 1, "replacing keeps one set");
    int32_t count;
    const double *got = rp_plan_share_set(p, 0, &mb, &layer, &expert, &count);
    ok(count == 2 && got[0] == 0.75 && mb == 0 && layer == 0 && expert == 0, "share set accessor");
    rp_plan_replicas(p, 0, 0, 0, ranks, shares, 8);
    ok(shares[2] == -1, "a replica beyond the given shares reads -1");
    rp_plan_set_shares(p, 1, 1, 5, (double[]){1.0}, 1, NULL);
    rp_plan_set_shares(p, 0, 1, 3, (double[]){1.0}, 1, NULL);
    rp_plan_share_set(p, 1, &mb, &layer, &expert, &count);
    ok(mb == 0 && layer == 1 && expert == 3, "share sets sorted by key");

    uint64_t h = rp_plan_hash(p);
    is_int(rp_plan_add_extra_replica(p, 2, 0, 0, 0, &err), RP_EINVAL, "extra in a missing microbatch rejected");
    is_int(rp_plan_add_extra_replica(p, 0, 2, 0, 0, &err), RP_EINVAL, "extra in a missing layer rejected");
    is_int(rp_plan_add_extra_replica(p, 0, 0, 6, 0, &err), RP_EINVAL, "extra of a missing expert rejected");
    is_int(err.expert, 6, "error carries the expert");
    is_int(rp_plan_add_extra_replica(p, 0, 0, 0, 4, &err), RP_EINVAL, "extra on a missing EP rank rejected");
    is_int(rp_plan_set_shares(p, 0, 0, -1, s2, 2, &err), RP_EINVAL, "shares of a missing expert rejected");
    is_int(rp_plan_set_shares(p, 0, 0, 0, s2, -1, &err), RP_EINVAL, "negative share count rejected");
    is_int(rp_plan_hash(p), h, "rejected levers leave the plan unchanged");
    rp_plan_clear_levers(p);
    ok(rp_plan_num_extra_replicas(p) == 0 && rp_plan_num_share_sets(p) == 0, "levers cleared");
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void test_check_packing(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_batch *b = make_batch(ctx, 6, base_lens);
    rp_plan *p = base_plan(ctx, cfg);
    rp_error err;
    expect_check(p, cfg, b, 0, NULL, "the base plan is valid");
    is_int(rp_plan_validate(p, cfg, b, &err), RP_OK, "validate accepts it");

    int32_t r0m0[2] = {0, 1}, r0m1[1] = {2}, r1m0[1] = {3}, r2m0[1] = {5}, r3m1[1] = {3};
    const int32_t *lists[8] = {r0m0, r0m1, r1m0, NULL, r2m0, NULL, NULL, r3m1};
    int32_t counts[8] = {2, 1, 1, 0, 1, 0, 0, 1};
    rp_plan_set_microbatches(p, 6, lists, counts, NULL);
    messages m = {0};
    is_int(rp_plan_check(p, cfg, b, collect, &m), 2, "a missing and a repeated sequence: 2 violations");
    ok(has_message(&m, "plan: sequence 4 is not packed"), "missing sequence message");
    ok(has_message(&m, "plan: sequence 3 is packed twice (rank 1 mb 0, rank 3 mb 1)"), "packed twice message");
    if (m.n != 2) show(&m);

    int32_t thrice[3] = {3, 4, 3};
    lists[7] = thrice;
    counts[7] = 3;
    rp_plan_set_microbatches(p, 6, lists, counts, NULL);
    expect_check(p, cfg, b, 1, "plan: sequence 3 is packed 3 times (rank 1 mb 0, rank 3 mb 1, rank 3 mb 1)",
                 "packed three times, twice in one microbatch");

    rp_plan_free(p);
    p = base_plan(ctx, cfg);
    rp_batch *b7 = make_batch(ctx, 7, (int32_t[]){30, 40, 50, 20, 10, 60, 5});
    expect_check(p, cfg, b7, 1, "plan: the packing has 6 sequences, but the batch has 7",
                 "sequence count differs from the batch");

    rp_plan_move_sequence(p, 2, 0, 0, NULL); /* rank 0 mb 0: 30 + 40 + 50 */
    expect_check(p, cfg, b, 1, "plan: rank 0 mb 0 holds 120 tokens, over the cap of 100", "token cap message");

    rp_batch *blong = make_batch(ctx, 6, (int32_t[]){30, 40, 50, 20, 10, 150});
    rp_plan_move_sequence(p, 2, 0, 1, NULL);
    expect_check(p, cfg, blong, 1,
                 "plan: sequence 5 has 150 tokens, longer than the microbatch cap of 100: no packing can hold it",
                 "sequence longer than the cap; its microbatch is not reported again");
    is_int(rp_plan_validate(p, cfg, blong, &err), RP_EPLAN, "validate a plan with a long sequence");
    is_int(err.sequence, 5, "validate's error carries the first violation's sequence");
    rp_plan_move_sequence(p, 4, 2, 0, NULL); /* rank 2 mb 0: 150 + 10 */
    expect_check(p, cfg, blong, 2, "plan: rank 2 mb 0 holds 160 tokens, over the cap of 100",
                 "a long sequence with company: both reported");

    /* memory cap: 10 bytes a token, 600 bytes a microbatch: 60 tokens */
    rp_config *mem = make_config(ctx, 2, 2, 4, "[3, 2, 3, 2]", 2, 6, 1000,
                                 ", \"max_activation_bytes\": 600, \"activation_bytes_per_token\": 10");
    rp_plan_free(p);
    p = base_plan(ctx, mem);
    expect_check(p, mem, b, 1,
                 "plan: rank 0 mb 0 needs 700 bytes of activations (70 tokens), over the memory cap of 600 bytes",
                 "memory cap message");
    rp_batch *bmem = make_batch(ctx, 6, (int32_t[]){30, 20, 50, 20, 10, 61});
    expect_check(p, mem, bmem, 1,
                 "plan: sequence 5 needs 610 bytes of activations (61 tokens), more than the microbatch memory cap "
                 "of 600 bytes: no packing can hold it",
                 "sequence over the memory cap");

    rp_config *fixed = config_a(ctx, ", \"num_microbatches\": 3");
    expect_check(p, fixed, b, 1,
                 "plan: the plan runs 2 microbatches per rank, but the config fixes 3 (limits.num_microbatches)",
                 "microbatch count differs from the config");

    is_int(rp_plan_validate(p, fixed, b, &err), RP_EPLAN, "validate fails on one violation");
    is_str(err.text, "plan: the plan runs 2 microbatches per rank, but the config fixes 3 (limits.num_microbatches)",
           "one violation: just its message");

    /* several at once */
    rp_plan_set_microbatches(p, 6, lists, counts, NULL); /* 3 thrice, 4 packed, 0 1 2 5 fine */
    rp_plan_move_sequence(p, 2, 0, 0, NULL);              /* rank 0 mb 0 120 tokens, 1200 bytes */
    rp_plan_move_sequence(p, 4, 3, 0, NULL);              /* 4 now packed once */
    expect_check(p, fixed, b7, 4, NULL, "four violations counted");
    uint64_t h = rp_plan_hash(p);
    is_int(rp_plan_validate(p, fixed, b7, &err), RP_EPLAN, "validate fails on several violations");
    is_str(err.text,
           "plan: 4 problems; first: the plan runs 2 microbatches per rank, but the config fixes 3 "
           "(limits.num_microbatches)",
           "several violations: the count and the first");
    is_int(rp_plan_hash(p), h, "validate changes nothing");

    /* a packing-only plan checks only the packing */
    rp_plan_free(p);
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    rp_plan_set_packing(p, 6, (int32_t[]){0, 0, 0, 1, 1, 2}, (int32_t[]){0, 0, 1, 0, 1, 0}, NULL);
    expect_check(p, cfg, b, 0, NULL, "a packing-only plan with empty slots is valid");
    expect_check(p, cfg, NULL, 0, NULL, "without a batch, token caps are not checked");
    rp_plan_free(p);
    rp_batch_free(b);
    rp_batch_free(b7);
    rp_batch_free(blong);
    rp_batch_free(bmem);
    rp_config_free(cfg);
    rp_config_free(mem);
    rp_config_free(fixed);
}

static void test_check_placement(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_batch *b = make_batch(ctx, 6, base_lens);
    rp_plan *p;
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    rp_plan_set_phy2log(p, 0, layer0, NULL);
    rp_plan_set_phy2log(p, 1, layer1, NULL);
    expect_check(p, cfg, b, 0, NULL, "a placement-only plan checks only the placement");

    int32_t l1[10] = {0, 1, -1, 2, -1, 3, 5, -1, 5, -1}; /* expert 4 gone */
    rp_plan_set_phy2log(p, 1, l1, NULL);
    expect_check(p, cfg, b, 1, "plan: layer 1 expert 4 has no replica", "expert without a replica");
    rp_error err;
    is_int(rp_plan_validate(p, cfg, b, &err), RP_EPLAN, "validate a plan with an expert missing");
    is_int(err.expert, 4, "validate's error carries the first violation's expert");
    int32_t l0[10] = {0, 1, 1, 3, 4, 5, 0, -1, 2, 0}; /* rank 0 holds 1 twice */
    rp_plan_set_phy2log(p, 0, l0, NULL);
    rp_plan_set_phy2log(p, 1, layer1, NULL);
    expect_check(p, cfg, b, 1, "plan: layer 0 EP rank 0 holds expert 1 twice (slots 1 and 2)",
                 "the same expert twice on one EP rank");
    rp_plan_set_phy2log(p, 0, (int32_t[]){-1, -1, -1, -1, -1, -1, -1, -1, -1, -1}, NULL);
    expect_check(p, cfg, b, 6, "plan: layer 0 expert 5 has no replica", "every missing expert reported");

    /* the plan's shape against another config */
    rp_config *more = make_config(ctx, 2, 2, 4, "[3, 2, 3, 2]", 2, 5, 100, "");
    rp_plan_set_phy2log(p, 0, layer0, NULL);
    expect_check(p, more, b, 3, "plan: the plan has 6 experts per layer, but the model has 5",
                 "expert count differs from the config");
    expect_check(p, more, b, 3, "plan: layer 0 slot 5 holds expert 5, but the model has 5 experts",
                 "slot id out of the config's range");
    expect_check(p, more, b, 3, "plan: layer 1 slot 8 holds expert 5, but the model has 5 experts",
                 "slot id out of the config's range");
    rp_config *gpus = make_config(ctx, 2, 4, 4, "[3, 2, 3, 2, 3, 2, 3, 2]", 2, 6, 100, "");
    expect_check(p, gpus, b, 1, "plan: the plan has 4 GPUs, but the config has 8", "GPU count differs");
    rp_config *slots = make_config(ctx, 2, 2, 4, "[3, 3, 3, 2]", 2, 6, 100, "");
    expect_check(p, slots, b, 1, "plan: EP rank 1 has 2 slots in the plan, but 3 in the config",
                 "slot count differs");
    rp_config *layers = make_config(ctx, 2, 2, 4, "[3, 2, 3, 2]", 3, 6, 100, "");
    expect_check(p, layers, b, 1, "plan: the plan has 2 layers, but the model has 3", "layer count differs");
    /* The config refuses EP groups with different slots (one placement is shared). */
    const char *groups_json =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": [3, 2, 3, 3]},"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 1, \"hidden_size\": 64,"
        " \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
        " \"limits\": {\"max_tokens_per_microbatch\": 100}}";
    rp_config *groups = NULL;
    is_int(rp_config_parse(ctx, groups_json, strlen(groups_json), "<groups>", &groups, NULL), RP_EINVAL,
           "EP groups with different slots are refused by the config");
    rp_plan_free(p);
    rp_batch_free(b);
    rp_config_free(cfg);
    rp_config_free(more);
    rp_config_free(gpus);
    rp_config_free(slots);
    rp_config_free(layers);
    rp_config_free(groups);
}

static void test_check_levers(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_batch *b = make_batch(ctx, 6, base_lens);
    rp_plan *p = base_plan(ctx, cfg);
    /* nodes: EP ranks 0 1 on node 0, 2 3 on node 1 */
    rp_plan_add_extra_replica(p, 0, 0, 5, 3, NULL); /* 5 is on rank 2, same node */
    rp_plan_set_shares(p, 0, 0, 5, (double[]){0.25, 0.75}, 2, NULL);
    rp_plan_set_shares(p, 1, 0, 0, (double[]){0.1, 0.2, 0.7}, 3, NULL);
    expect_check(p, cfg, b, 0, NULL, "valid extra replica and shares");

    rp_plan_add_extra_replica(p, 0, 0, 0, 0, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 0 layer 0: extra replica of expert 0 on EP rank 0, which already holds it",
                 "extra replica where the expert already is");
    rp_plan_clear_levers(p);
    rp_plan_add_extra_replica(p, 1, 1, 2, 0, NULL);
    rp_plan_add_extra_replica(p, 1, 1, 2, 0, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 1 layer 1: extra replica of expert 2 on EP rank 0, which already holds it",
                 "the same extra replica twice");
    rp_plan_clear_levers(p);
    rp_plan_add_extra_replica(p, 0, 0, 3, 2, NULL); /* 3 only on rank 1, node 0 */
    {
        /* the config's limits object closed early: the same config under "ideal" */
        rp_config *ideal = config_a(ctx, "}, \"execution\": {\"executor\": \"ideal\"");
        expect_check(p, ideal, b, 1,
                     "plan: mb 0 layer 0: extra replica of expert 3 on EP rank 2 has no replica of the expert in "
                     "its node (node 1) to copy from over NVLink (execution.executor \"ideal\" copies extras per "
                     "microbatch; \"routepack_torch\" fetches them across nodes)",
                     "ideal: extra replica without an in-node source");
        rp_config_free(ideal);
    }
    expect_check(p, cfg, b, 0, NULL, "routepack_torch fetches it from node 0 over the network (issue 35)");
    rp_plan_clear_levers(p);

    rp_plan_set_shares(p, 0, 0, 5, (double[]){0.5, 0.4}, 2, NULL);
    expect_check(p, cfg, b, 2, "plan: mb 0 layer 0 expert 5 shares sum to 0.9, not 1", "shares not summing to 1");
    expect_check(p, cfg, b, 2, "plan: mb 0 layer 0 expert 5 has 2 shares for 1 replica", "share count mismatch");
    rp_plan_clear_levers(p);
    rp_plan_set_shares(p, 0, 1, 5, (double[]){1 + 5e-10}, 1, NULL);
    expect_check(p, cfg, b, 0, NULL, "a sum within 1e-9 of 1 passes");
    rp_plan_set_shares(p, 0, 1, 5, (double[]){1 + 2e-9}, 1, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 0 layer 1 expert 5 shares sum to 1.000000002, not 1",
                 "a sum 2e-9 off fails");
    rp_plan_set_shares(p, 0, 0, 1, (double[]){-0.5, 1.5}, 2, NULL);
    expect_check(p, cfg, b, 2, "plan: mb 0 layer 0 expert 1 share 0 is negative (-0.5)", "negative share");
    rp_plan_clear_levers(p);
    rp_plan_set_shares(p, 0, 0, 1, (double[]){NAN, 1.0}, 2, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 0 layer 0 expert 1 share 0 is NaN", "NaN share (and no sum message)");
    rp_plan_set_shares(p, 0, 0, 1, (double[]){INFINITY, 1.0}, 2, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 0 layer 0 expert 1 share 0 is infinite", "infinite share");
    rp_plan_set_shares(p, 0, 0, 1, (double[]){1.0}, 1, NULL);
    expect_check(p, cfg, b, 1, "plan: mb 0 layer 0 expert 1 has 1 share for 2 replicas", "too few shares");
    rp_plan_add_extra_replica(p, 0, 0, 1, 1, NULL); /* 1 is on rank 0, node 0: fine, now 3 replicas */
    rp_plan_set_shares(p, 0, 0, 1, (double[]){0.2, 0.3, 0.5}, 3, NULL);
    expect_check(p, cfg, b, 0, NULL, "shares count extra replicas too");

    /* everything at once: counted one by one */
    rp_plan_add_extra_replica(p, 1, 0, 4, 1, NULL);                      /* already held */
    rp_plan_set_shares(p, 1, 1, 0, (double[]){0.5}, 1, NULL);             /* sum */
    rp_plan_set_phy2log(p, 1, (int32_t[]){0, 1, -1, 2, -1, 3, -1, -1, 5, -1}, NULL); /* 4 missing */
    rp_plan_move_sequence(p, 2, 0, 0, NULL);                              /* 120 tokens */
    expect_check(p, cfg, b, 4, NULL, "violations in packing, placement and levers all counted");

    rp_plan *q;
    rp_plan_new(ctx, cfg, 2, &q, NULL);
    rp_plan_set_packing(q, 6, (int32_t[]){0, 0, 0, 1, 1, 2}, (int32_t[]){0, 0, 1, 0, 1, 0}, NULL);
    rp_plan_add_extra_replica(q, 0, 0, 1, 1, NULL);
    expect_check(q, cfg, b, 1,
                 "plan: the plan has extra replicas or shares (1 and 0), but no placement for them to refer to",
                 "levers without a placement");
    rp_plan_free(q);
    rp_plan_free(p);
    rp_batch_free(b);
    rp_config_free(cfg);
}

static void test_copy_and_hash(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p = base_plan(ctx, cfg);
    rp_plan_add_extra_replica(p, 0, 0, 5, 3, NULL);
    rp_plan_set_shares(p, 0, 0, 5, (double[]){0.25, 0.75}, 2, NULL);
    rp_plan *c;
    rp_error err;
    is_int(rp_plan_copy(p, &c, &err), RP_OK, "copy");
    uint64_t h = rp_plan_hash(p);
    is_int(rp_plan_hash(c), h, "the copy hashes equal");
    ok(rp_plan_equal(c, p) && rp_plan_equal(p, p), "... and is equal");
    ok(!rp_plan_equal(c, NULL) && !rp_plan_equal(NULL, c) && rp_plan_equal(NULL, NULL), "NULL equals only NULL");
    rp_plan_move_sequence(c, 0, 3, 1, NULL);
    rp_plan_set_phy2log(c, 0, layer1, NULL);
    rp_plan_add_extra_replica(c, 1, 1, 1, 1, NULL);
    rp_plan_set_shares(c, 0, 0, 5, (double[]){0.5, 0.5}, 2, NULL);
    ok(rp_plan_hash(c) != h, "the mutated copy differs");
    ok(!rp_plan_equal(c, p), "... and is not equal");
    is_int(rp_plan_hash(p), h, "mutating the copy leaves the original");
    ok(list_is(p, 0, 0, (int32_t[]){0, 1}, 2) && same_ints(rp_plan_phy2log(p, 0), layer0, 10),
       "the original's packing and placement intact");
    rp_plan_free(c);

    /* The hash of one tiny canonical plan. It is a format: if this value changes, plans
     * hashed by an older build no longer compare equal. Change it only on purpose. */
    rp_config *tiny = make_config(ctx, 1, 2, 2, "[2, 1]", 1, 3, 100, "");
    rp_plan *t;
    rp_plan_new(ctx, tiny, 1, &t, NULL);
    rp_plan_set_packing(t, 3, (int32_t[]){1, 0, 1}, (int32_t[]){0, 0, 0}, NULL);
    rp_plan_set_phy2log(t, 0, (int32_t[]){0, 1, 2}, NULL);
    rp_plan_add_extra_replica(t, 0, 0, 2, 0, NULL);
    rp_plan_set_shares(t, 0, 0, 2, (double[]){0.75, 0.25}, 2, NULL);
    uint64_t canonical = rp_plan_hash(t);
    diag("canonical plan hash 0x%016llx", (unsigned long long)canonical);
    is_int(canonical, (long long)0x2aa010d9dbb96407ULL, "hash of the canonical tiny plan is stable");
    /* ... and it is XXH64 of the serialisation that docs/formats.md describes */
    unsigned char bytes[256];
    size_t nb = 0;
    memcpy(bytes, "rp-plan1", 8);
    nb = 8;
    const int32_t fields[] = {2, 1, 2, 1, 3, 3, 0, 2, 3, /* G M ep L E S slot_begin */
                              1, 3, 1, 1, 2, 0, 2,       /* packing: flag, seqs, lists */
                              1, 0, 1, 2,                /* placement: flag, phy2log */
                              1, 0, 0, 2, 0,             /* one extra replica */
                              1, 0, 0, 2, 2};            /* one share set, 2 shares */
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        for (int k = 0; k < 4; k++) bytes[nb++] = (unsigned char)((uint32_t)fields[i] >> (8 * k));
    const double values[2] = {0.75, 0.25};
    for (int i = 0; i < 2; i++) {
        uint64_t bits;
        memcpy(&bits, &values[i], 8);
        for (int k = 0; k < 8; k++) bytes[nb++] = (unsigned char)(bits >> (8 * k));
    }
    is_int(rp_hash64(bytes, nb, 0), (long long)canonical, "the hash is XXH64 of the documented serialisation");

    /* independent of history: the same plan built another way */
    rp_plan *u;
    rp_plan_new(ctx, tiny, 1, &u, NULL);
    rp_plan_set_shares(u, 0, 0, 2, (double[]){0.5, 0.5}, 2, NULL);
    rp_plan_set_phy2log(u, 0, (int32_t[]){2, -1, 0}, NULL);
    rp_plan_set_gpu_experts(u, 0, 0, (int32_t[]){0, 1}, 2, NULL);
    rp_plan_set_gpu_experts(u, 0, 1, (int32_t[]){2}, 1, NULL);
    const int32_t l0[2] = {1}, l1[2] = {0, 2};
    rp_plan_set_microbatches(u, 3, (const int32_t *[]){l0, l1}, (int32_t[]){1, 2}, NULL);
    rp_plan_add_extra_replica(u, 0, 0, 2, 0, NULL);
    rp_plan_set_shares(u, 0, 0, 2, (double[]){0.75, 0.25}, 2, NULL);
    is_int(rp_plan_hash(u), canonical, "same content built another way hashes equal");
    ok(rp_plan_equal(u, t), "... and is equal");

    /* sensitive to each field */
    struct { const char *what; uint64_t h; } seen[16];
    int n = 0;
#define VARIANT(name, body)                                        \
    do {                                                           \
        rp_plan *v;                                                \
        rp_plan_copy(t, &v, NULL);                                 \
        body;                                                      \
        seen[n].what = name;                                       \
        seen[n++].h = rp_plan_hash(v);                             \
        ok(rp_plan_hash(v) != canonical, "hash sees %s", name);    \
        ok(!rp_plan_equal(v, t), "equality sees %s", name);       \
        rp_plan_free(v);                                           \
    } while (0)
    VARIANT("a sequence's rank", rp_plan_move_sequence(v, 0, 0, 0, NULL));
    VARIANT("the order inside a microbatch", rp_plan_move_sequence(v, 0, 1, 0, NULL));
    VARIANT("the sequence count",
            rp_plan_set_microbatches(v, 4, (const int32_t *[]){l0, l1}, (int32_t[]){1, 2}, NULL));
    VARIANT("one slot", rp_plan_set_gpu_experts(v, 0, 0, (int32_t[]){1, 0}, 2, NULL));
    VARIANT("an extra replica's rank", (rp_plan_clear_levers(v), rp_plan_add_extra_replica(v, 0, 0, 2, 1, NULL),
                                        rp_plan_set_shares(v, 0, 0, 2, (double[]){0.75, 0.25}, 2, NULL)));
    VARIANT("a share's last bit",
            rp_plan_set_shares(v, 0, 0, 2, (double[]){0.75, nextafter(0.25, 1.0)}, 2, NULL));
    VARIANT("no shares", (rp_plan_clear_levers(v), rp_plan_add_extra_replica(v, 0, 0, 2, 0, NULL)));
    VARIANT("an empty packing",
            rp_plan_set_microbatches(v, 0, (const int32_t *[]){NULL, NULL}, (int32_t[]){0, 0}, NULL));
    VARIANT("the balancing", rp_plan_set_balancing(v, RP_BALANCING_VIRTUAL_EXPERTS, NULL));
#undef VARIANT
    rp_plan *w, *w3;
    rp_config *tiny2 = make_config(ctx, 1, 2, 2, "[1, 2]", 1, 3, 100, "");
    rp_plan_new(ctx, tiny, 2, &w, NULL);
    rp_plan_new(ctx, tiny2, 2, &w3, NULL);
    ok(rp_plan_hash(w) != rp_plan_hash(w3), "hash sees the slots of each EP rank");
    ok(!rp_plan_equal(w, w3), "equality sees the slots of each EP rank");
    rp_plan_free(w3);
    rp_config_free(tiny2);
    rp_plan *w1;
    rp_plan_new(ctx, tiny, 1, &w1, NULL);
    ok(rp_plan_hash(w) != rp_plan_hash(w1), "hash sees the microbatch count");
    ok(!rp_plan_equal(w, w1), "equality sees the microbatch count");
    rp_plan_set_packing(w1, 0, NULL, NULL, NULL);
    rp_plan *w2;
    rp_plan_new(ctx, tiny, 1, &w2, NULL);
    ok(rp_plan_hash(w1) != rp_plan_hash(w2), "hash sees an empty packing vs none");
    ok(!rp_plan_equal(w1, w2), "equality sees an empty packing vs none");
    bool distinct = true;
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (seen[i].h == seen[j].h) distinct = false;
    ok(distinct, "every variant hashes differently");
    rp_plan_free(w);
    rp_plan_free(w1);
    rp_plan_free(w2);
    rp_plan_free(t);
    rp_plan_free(u);
    rp_plan_free(p);
    rp_config_free(cfg);
    rp_config_free(tiny);
}

static void test_eplb_arrays(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p;
    rp_error err;
    rp_plan_new(ctx, cfg, 1, &p, NULL);
    int32_t phy2log[2 * 10], log2phy[2 * 6 * 4], logcnt[2 * 6];
    is_int(rp_plan_eplb_arrays(p, 3, phy2log, log2phy, logcnt, &err), RP_EINVAL, "arrays need a placement");
    rp_plan_set_phy2log(p, 0, layer0, NULL);
    rp_plan_set_phy2log(p, 1, layer1, NULL);
    /* Worked by hand from layer0 / layer1 (slot_begin 0 3 5 8 10):
     * layer 0: expert 0 in slots 0, 6, 9; expert 1 in 1, 8; 2..5 in 2, 3, 4, 5.
     * layer 1: experts 0..5 in slots 0, 1, 3, 5, 6, 8. */
    is_int(rp_plan_eplb_arrays(p, 3, phy2log, log2phy, logcnt, &err), RP_OK, "EPLB arrays");
    ok(same_ints(phy2log, layer0, 10) && same_ints(phy2log + 10, layer1, 10), "phy2log [L][S]");
    ok(same_ints(logcnt, (int32_t[]){3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 12), "logcnt [L][E]");
    const int32_t want3[2 * 6 * 3] = {
        0, 6, 9,   1, 8, -1,  2, -1, -1, 3, -1, -1, 4, -1, -1, 5, -1, -1,
        0, -1, -1, 1, -1, -1, 3, -1, -1, 5, -1, -1, 6, -1, -1, 8, -1, -1,
    };
    ok(same_ints(log2phy, want3, 36), "log2phy [L][E][3], ascending slots, -1 padding");
    is_int(rp_plan_eplb_arrays(p, 4, phy2log, log2phy, logcnt, &err), RP_OK, "wider padding");
    ok(log2phy[0] == 0 && log2phy[2] == 9 && log2phy[3] == -1 && log2phy[4] == 1 && log2phy[7] == -1 &&
           log2phy[24] == 0 && log2phy[47] == -1,
       "log2phy [L][E][4] padded with -1");
    int32_t before = log2phy[5];
    is_int(rp_plan_eplb_arrays(p, 2, phy2log, log2phy, logcnt, &err), RP_EINVAL, "max_replicas too small");
    is_str(err.text, "plan: layer 0 expert 0 has 3 replicas, more than max_replicas 2", "max_replicas message");
    is_int(log2phy[5], before, "nothing written on error");
    rp_plan_set_phy2log(p, 1, (int32_t[]){0, 1, -1, 2, -1, 3, 4, -1, -1, -1}, NULL);
    is_int(rp_plan_eplb_arrays(p, 3, phy2log, log2phy, logcnt, &err), RP_EPLAN, "an expert without a replica");
    like(err.text, "layer 1 expert 5 has no replica", "no replica message");
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void contiguous_case(rp_context *ctx, int nodes, int gpn, int ep, const char *slots, int experts,
                            const int32_t *want, int total, const char *name)
{
    rp_config *cfg = make_config(ctx, nodes, gpn, ep, slots, 2, experts, 100, "");
    rp_plan *p;
    rp_plan_new(ctx, cfg, 1, &p, NULL);
    rp_error err;
    is_int(rp_plan_set_contiguous(p, &err), RP_OK, "contiguous: %s", name);
    bool match = rp_plan_total_slots(p) == total && same_ints(rp_plan_phy2log(p, 0), want, total) &&
                 same_ints(rp_plan_phy2log(p, 1), want, total);
    ok(match, "contiguous layout: %s", name);
    if (!match)
        for (int s = 0; s < rp_plan_total_slots(p); s++) diag("slot %d: %d", s, rp_plan_phy2log(p, 0)[s]);
    rp_plan_free(p);
    rp_config_free(cfg);
}

static void test_contiguous(rp_context *ctx)
{
    contiguous_case(ctx, 1, 4, 4, "2", 8, (int32_t[]){0, 1, 2, 3, 4, 5, 6, 7}, 8, "8 experts on 4 ranks");
    contiguous_case(ctx, 1, 4, 4, "3", 8, (int32_t[]){0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7, -1}, 12,
                    "spare slots stay empty");
    contiguous_case(ctx, 1, 4, 4, "2", 6, (int32_t[]){0, 1, 2, -1, 3, 4, 5, -1}, 8,
                    "6 experts on 4 ranks: expert e on rank floor(4e/6)");
    contiguous_case(ctx, 1, 4, 4, "[1, 1, 3, 3]", 6, (int32_t[]){0, 1, 2, 3, 4, 5, -1, -1}, 8,
                    "uneven slots: overflow to the next rank");
    contiguous_case(ctx, 1, 4, 4, "[3, 3, 1, 1]", 6, (int32_t[]){0, 1, 5, 2, -1, -1, 3, 4}, 8,
                    "uneven slots: overflow wraps to the first rank with room");
}

/* Slots whose expert changes from `prev` to `next` and is not empty: weight copies. */
static int moves(const int32_t *prev, const int32_t *next, int n)
{
    int m = 0;
    for (int i = 0; i < n; i++) m += next[i] >= 0 && next[i] != prev[i];
    return m;
}

/* Fewest moves over every ordering of a rank's slots (n <= 5). */
static int best_moves(const int32_t *prev, const int32_t *cur, int n)
{
    int perm[5] = {0, 1, 2, 3, 4}, best = n + 1;
    int32_t next[5];
    /* Heap's algorithm, iterative */
    int c[5] = {0};
    for (int i = 0; i < n; i++) next[i] = cur[perm[i]];
    best = moves(prev, next, n);
    for (int i = 1; i < n;) {
        if (c[i] < i) {
            int j = i % 2 ? c[i] : 0;
            int t = perm[j];
            perm[j] = perm[i];
            perm[i] = t;
            for (int k = 0; k < n; k++) next[k] = cur[perm[k]];
            int m = moves(prev, next, n);
            if (m < best) best = m;
            c[i]++;
            i = 1;
        } else {
            c[i++] = 0;
        }
    }
    return best;
}

static bool same_multiset(const int32_t *a, const int32_t *b, int n)
{
    int count[16] = {0};
    for (int i = 0; i < n; i++) count[a[i] + 1]++, count[b[i] + 1]--;
    for (int i = 0; i < 16; i++)
        if (count[i]) return false;
    return true;
}

static void test_stabilize(rp_context *ctx)
{
    rp_config *cfg = make_config(ctx, 1, 2, 2, "[3, 4]", 2, 5, 100, "");
    rp_plan *prev, *p;
    rp_error err;
    rp_plan_new(ctx, cfg, 1, &prev, NULL);
    rp_plan_new(ctx, cfg, 1, &p, NULL);
    is_int(rp_plan_stabilize_slots(p, prev, &err), RP_EINVAL, "stabilize needs a placement");
    rp_plan_set_phy2log(prev, 0, (int32_t[]){0, 1, 2, 3, 4, 0, -1}, NULL);
    rp_plan_set_phy2log(prev, 1, (int32_t[]){4, 3, 2, 1, 0, -1, -1}, NULL);
    rp_plan_set_phy2log(p, 0, (int32_t[]){2, 3, -1, 1, 4, 0, -1}, NULL);
    rp_plan_set_phy2log(p, 1, (int32_t[]){2, 3, 4, 1, 0, -1, -1}, NULL);
    is_int(rp_plan_stabilize_slots(p, prev, &err), RP_OK, "stabilize");
    /* rank 0: prev [0 1 2], now {2 3}: 2 keeps slot 2, 3 takes the free slot 0.
     * rank 1: prev [3 4 0 -], now {1 4 0}: 4 and 0 keep slots 4 and 5, 1 fills slot 3. */
    ok(same_ints(rp_plan_phy2log(p, 0), (int32_t[]){3, -1, 2, 1, 4, 0, -1}, 7), "residents keep their slots");
    ok(same_ints(rp_plan_phy2log(p, 1), (int32_t[]){4, 3, 2, 1, 0, -1, -1}, 7),
       "a rank with unchanged experts ends exactly as before");
    rp_plan *none;
    rp_plan_new(ctx, cfg, 1, &none, NULL);
    rp_plan_set_phy2log(p, 1, (int32_t[]){3, -1, 2, -1, 4, 1, 0}, NULL);
    is_int(rp_plan_stabilize_slots(p, none, &err), RP_OK, "stabilize against a plan without placement");
    ok(same_ints(rp_plan_phy2log(p, 1), (int32_t[]){2, 3, -1, 0, 1, 4, -1}, 7),
       "without residents: ascending ids, empty slots last");
    rp_config *other = make_config(ctx, 1, 2, 2, "[4, 3]", 2, 5, 100, "");
    rp_plan *q;
    rp_plan_new(ctx, other, 1, &q, NULL);
    rp_plan_set_contiguous(q, NULL);
    uint64_t h = rp_plan_hash(p);
    is_int(rp_plan_stabilize_slots(p, q, &err), RP_EINVAL, "another shape rejected");
    is_int(rp_plan_hash(p), h, "rejected stabilize leaves the plan");

    /* Brute force: random per-rank expert sets against a random previous placement;
     * stabilize must keep every rank's experts and reach the fewest moves that any
     * ordering of each rank's slots reaches. */
    uint32_t seed = 12345;
#define RAND(n) ((seed = seed * 1103515245u + 12345u), (int32_t)((seed >> 16) % (uint32_t)(n)))
    bool all_minimal = true, all_sets = true, all_residents = true;
    for (int trial = 0; trial < 300; trial++) {
        int32_t a[7], b[7];
        for (int s = 0; s < 7; s++) a[s] = RAND(6) - 1, b[s] = RAND(6) - 1; /* may repeat: fine here */
        rp_plan_set_phy2log(prev, 0, a, NULL);
        rp_plan_set_phy2log(p, 0, b, NULL);
        rp_plan_stabilize_slots(p, prev, NULL);
        const int32_t *got = rp_plan_phy2log(p, 0);
        const int first[2] = {0, 3}, n[2] = {3, 4};
        for (int j = 0; j < 2; j++) {
            const int32_t *pr = a + first[j], *cu = b + first[j], *ne = got + first[j];
            if (!same_multiset(cu, ne, n[j])) all_sets = false;
            if (moves(pr, ne, n[j]) != best_moves(pr, cu, n[j])) all_minimal = false;
            for (int k = 0; k < n[j]; k++) {
                int in_cur = 0, kept_before = 0;
                for (int i = 0; i < n[j]; i++) in_cur += cu[i] == pr[k];
                for (int i = 0; i < k; i++) kept_before += pr[i] == pr[k];
                if (pr[k] >= 0 && in_cur > kept_before && ne[k] != pr[k]) all_residents = false;
            }
        }
    }
#undef RAND
    ok(all_sets, "brute force: every rank keeps its experts");
    ok(all_residents, "brute force: every resident keeps its slot");
    ok(all_minimal, "brute force: no ordering of the slots moves fewer experts");
    rp_plan_free(prev);
    rp_plan_free(p);
    rp_plan_free(none);
    rp_plan_free(q);
    rp_config_free(cfg);
    rp_config_free(other);
}

static void test_alloc_failures(void)
{
    bool clean = true, copied = false;
    for (long n = 1; n < 200 && !copied; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        rp_config *cfg = config_a(ctx, "");
        rp_plan *p = base_plan(ctx, cfg);
        rp_plan_add_extra_replica(p, 0, 0, 5, 3, NULL);
        rp_plan_set_shares(p, 0, 0, 5, (double[]){0.25, 0.75}, 2, NULL);
        rp_plan_set_shares(p, 1, 0, 5, (double[]){0.5, 0.5}, 2, NULL);
        uint64_t h = rp_plan_hash(p);
        long live = c.live;
        c.fail_at = c.calls + n;
        rp_plan *copy = NULL;
        rp_status st = rp_plan_copy(p, &copy, NULL);
        c.fail_at = 0;
        if (st == RP_OK) {
            copied = true;
            if (rp_plan_hash(copy) != h) clean = false;
            rp_plan_free(copy);
        } else if (st != RP_ENOMEM || c.live != live) {
            clean = false;
        }
        if (rp_plan_hash(p) != h) clean = false;
        rp_plan_free(p);
        rp_config_free(cfg);
        rp_context_free(ctx);
        if (c.live != 0) clean = false;
    }
    ok(copied && clean, "copy fails cleanly at every allocation, leaks nothing, and keeps the source");

    /* the setters too: a failed allocation leaves the plan as it was */
    clean = true;
    for (long n = 1; n < 12; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        rp_config *cfg = config_a(ctx, "");
        rp_plan *p = base_plan(ctx, cfg);
        uint64_t h = rp_plan_hash(p);
        c.fail_at = c.calls + n;
        rp_status st = rp_plan_set_packing(p, 6, (int32_t[]){3, 3, 3, 3, 3, 3}, (int32_t[]){0, 0, 0, 0, 0, 0}, NULL);
        if (st != RP_OK && (st != RP_ENOMEM || rp_plan_hash(p) != h)) clean = false;
        c.fail_at = c.calls + n;
        st = rp_plan_set_shares(p, 0, 0, 1, (double[]){0.5, 0.5}, 2, NULL);
        if (st != RP_OK && st != RP_ENOMEM) clean = false;
        c.fail_at = c.calls + n;
        st = rp_plan_add_extra_replica(p, 0, 0, 1, 1, NULL);
        if (st != RP_OK && st != RP_ENOMEM) clean = false;
        c.fail_at = c.calls + n;
        st = rp_plan_stabilize_slots(p, p, NULL);
        if (st != RP_OK && st != RP_ENOMEM) clean = false;
        c.fail_at = 0;
        messages m = {0};
        rp_plan_set_microbatches(p, 6, (const int32_t *[]){(int32_t[]){1, 1}}, (int32_t[]){2, 0, 0, 0, 0, 0, 0, 0},
                                 NULL);
        c.fail_at = c.calls + n;
        int32_t found = rp_plan_check(p, cfg, NULL, collect, &m);
        if (found < 1) clean = false; /* repeated and missing sequences, or out of memory */
        c.fail_at = 0;
        rp_plan_free(p);
        rp_config_free(cfg);
        rp_context_free(ctx);
        if (c.live != 0) clean = false;
    }
    ok(clean, "setters and check fail cleanly when memory runs out");
}

/* ---- a flood of violations ---- */

typedef struct last_message {
    int n;
    char text[RP_ERROR_TEXT];
} last_message;

static void keep_last(void *ud, const char *message)
{
    last_message *m = ud;
    snprintf(m->text, sizeof m->text, "%s", message);
    m->n++;
}

/* A packing that lists none of its 100000 sequences has 100000 violations: the count
 * is exact, the messages stop at 100 and one line stands for the rest. */
static void test_check_flood(rp_context *ctx)
{
    rp_config *cfg = config_a(ctx, "");
    rp_plan *p = base_plan(ctx, cfg);
    int32_t counts[8] = {0};
    is_int(rp_plan_set_microbatches(p, 100000, NULL, counts, NULL), RP_OK, "a packing of no ids for 100000 sequences");
    last_message m = {0, ""};
    is_int(rp_plan_check(p, cfg, NULL, keep_last, &m), 100000, "every missing sequence is counted");
    is_int(m.n, 101, "100 messages and one summing up the rest");
    is_str(m.text, "plan: ... and 99900 more problems (only the first 100 are listed)", "the summary line");
    rp_error err;
    is_int(rp_plan_validate(p, cfg, NULL, &err), RP_EPLAN, "validate refuses it");
    like(err.text, "plan: 100000 problems; first: sequence 0 is not packed", "with the exact count");
    rp_plan_free(p);
    rp_config_free(cfg);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_shape(ctx);
    test_packing(ctx);
    test_move(ctx);
    test_placement(ctx);
    test_levers(ctx);
    test_check_packing(ctx);
    test_check_placement(ctx);
    test_check_levers(ctx);
    test_check_flood(ctx);
    test_copy_and_hash(ctx);
    test_eplb_arrays(ctx);
    test_contiguous(ctx);
    test_stabilize(ctx);
    test_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
