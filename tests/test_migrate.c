/* Migration planner and registry: residents stay, source preference, the minimum bytes
 * against a brute-force search, swaps and cycles, rounds within the staging budget,
 * determinism, predicted time, bad input, allocation failures. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"
#include "mpi/migrate_world.h"

#include <stdlib.h>
#include <string.h>

/* ---- fixtures ---- */

/* The model's expert size for w_config (mpi/migrate_world.h): 3 d f (2 + 12). */
#define MODEL_BYTES (3 * 8 * 4 * 14)

/* A plan whose layer l holds rows[l] (total_slots entries each). */
static rp_plan *make_plan(rp_context *ctx, const rp_config *cfg, const int32_t *rows)
{
    rp_plan *p = NULL;
    rp_error err;
    if (rp_plan_new(ctx, cfg, 1, &p, &err) != RP_OK) {
        diag("plan: %s", err.text);
        return NULL;
    }
    int32_t S = rp_plan_total_slots(p);
    for (int32_t l = 0; l < rp_plan_num_layers(p); l++)
        if (rp_plan_set_phy2log(p, l, rows + (size_t)l * S, &err) != RP_OK) {
            diag("plan: %s", err.text);
            rp_plan_free(p);
            return NULL;
        }
    return p;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)(xorshift64(&rng_state) % n); }

/* Count transfers of a plan matching a predicate on (src, dst, link). */
static int64_t count_links(const rp_migration_plan *mp, rp_link link)
{
    int64_t n = 0;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(mp, i, &t, NULL);
        n += t.link == link;
    }
    return n;
}

/* ---- registry ---- */

static void test_registry(rp_context *ctx)
{
    rp_registry *reg = NULL;
    rp_error err;
    is_int(rp_registry_new(ctx, 0, 2, &reg, &err), RP_EINVAL, "registry: zero layers refused");
    is_int(rp_registry_new(ctx, 2, 3, &reg, &err), RP_OK, "registry: created");
    static unsigned char mem[4096];
    rp_tensor ts[2] = {{mem, 100, RP_MEMORY_HOST}, {mem + 100, 28, RP_MEMORY_HOST}};
    is_int(rp_registry_expert_bytes(reg, 0), -1, "registry: nothing registered yet");
    is_int(rp_registry_set(reg, 0, 0, ts, 2, &err), RP_OK, "registry: first slot sets layer 0's layout");
    is_int(rp_registry_expert_bytes(reg, 0), 128, "registry: expert bytes are the tensors' sum");
    rp_tensor bad[2] = {{mem + 200, 100, RP_MEMORY_HOST}, {mem + 300, 29, RP_MEMORY_HOST}};
    is_int(rp_registry_set(reg, 0, 1, bad, 2, &err), RP_EINVAL, "registry: a wrong size is refused");
    like(err.text, "layer 0 slot 1 tensor 1 is 29 bytes, but layer 0's tensor 1 is 28 bytes (as registered for slot 0)",
         "registry: the wrong size is named");
    is_int(rp_registry_set(reg, 0, 1, bad, 1, &err), RP_EINVAL, "registry: a wrong count is refused");
    like(err.text, "registers 1 tensors, but layer 0 has 2", "registry: the wrong count is named");
    rp_tensor kind[2] = {{mem + 200, 100, RP_MEMORY_CUDA}, {mem + 300, 28, RP_MEMORY_HOST}};
    is_int(rp_registry_set(reg, 0, 1, kind, 2, &err), RP_EINVAL, "registry: a wrong memory kind is refused");
    like(err.text, "is CUDA memory, but layer 0's tensor 0 is host memory", "registry: the kind is named");
    rp_tensor null[1] = {{NULL, 8, RP_MEMORY_HOST}};
    is_int(rp_registry_set(reg, 1, 0, null, 1, &err), RP_EINVAL, "registry: a NULL pointer is refused");
    rp_tensor empty[1] = {{mem, 0, RP_MEMORY_HOST}};
    is_int(rp_registry_set(reg, 1, 0, empty, 1, &err), RP_EINVAL, "registry: an empty tensor is refused");
    is_int(rp_registry_set(reg, 2, 0, ts, 2, &err), RP_EINVAL, "registry: a layer out of range is refused");
    is_int(rp_registry_set(reg, 0, 3, ts, 2, &err), RP_EINVAL, "registry: a slot out of range is refused");
    is_int(rp_registry_set(reg, 0, 0, ts, 0, &err), RP_EINVAL, "registry: zero tensors are refused");
    /* The only registered slot may change its layer's layout. */
    rp_tensor one[1] = {{mem, 64, RP_MEMORY_HOST}};
    is_int(rp_registry_set(reg, 0, 0, one, 1, &err), RP_OK, "registry: re-registering the only slot re-lays the layer");
    is_int(rp_registry_expert_bytes(reg, 0), 64, "registry: the new layout counts");
    int32_t count = -1;
    const rp_tensor *got = rp_registry_tensors(reg, 0, 0, &count);
    ok(got && count == 1 && got[0].data == mem && got[0].bytes == 64, "registry: tensors read back");
    ok(rp_registry_tensors(reg, 1, 2, &count) == NULL && count == 0, "registry: an unregistered slot reads empty");

    is_int(rp_registry_check(reg, &err), RP_EINVAL, "registry: an incomplete registry fails the check");
    like(err.text, "layer 0 slot 1 is not registered", "registry: the first missing slot is named");
    for (int32_t l = 0; l < 2; l++)
        for (int32_t s = 0; s < 3; s++) {
            rp_tensor t = {mem + 1024 + (l * 3 + s) * 64, 64, RP_MEMORY_HOST};
            rp_registry_set(reg, l, s, &t, 1, NULL);
        }
    is_int(rp_registry_check(reg, &err), RP_OK, "registry: a complete registry passes");
    rp_tensor overlap = {mem + 1024 + 10, 64, RP_MEMORY_HOST};
    is_int(rp_registry_set(reg, 1, 2, &overlap, 1, &err), RP_OK, "registry: an overlapping tensor registers");
    is_int(rp_registry_check(reg, &err), RP_EINVAL, "registry: overlapping tensors fail the check");
    like(err.text, "overlaps layer 0 slot 0 tensor 0", "registry: the overlap is named");
    rp_registry_free(reg);
    rp_registry_free(NULL);
}

/* ---- planner: small hand-made cases ---- */

static void test_residents_and_local(rp_context *ctx)
{
    rp_config *cfg = w_config(ctx, 1, 2, 2, 3, 1, 4);
    /* GPU0 [0 1 2], GPU1 [3 0 1] */
    int32_t cur[6] = {0, 1, 2, 3, 0, 1};
    rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, cur);
    rp_migration_plan *mp = NULL;
    rp_error err;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err), RP_OK, "same placement: planned");
    rp_migration_summary s;
    rp_migration_plan_summary(mp, &s);
    ok(s.moved_bytes == 0 && s.writes == 0 && s.num_rounds == 0 && rp_migration_plan_num_transfers(mp) == 0,
       "same placement: nothing moves, no round");
    is_int(rp_migration_plan_layer_round(mp, 0), -1, "same placement: the layer is in no round");
    rp_migration_plan_free(mp);

    /* Reordered inside GPU0 ([2 0 1]) and GPU1 keeps two: only local copies. */
    int32_t re[6] = {2, 0, 1, 3, 0, 1};
    rp_plan *c = make_plan(ctx, cfg, re);
    is_int(rp_migration_plan_new(ctx, cfg, a, c, NULL, &mp, &err), RP_OK, "reordering: planned");
    rp_migration_plan_summary(mp, &s);
    ok(s.moved_bytes == 0 && s.min_bytes == 0, "reordering inside a GPU moves nothing between GPUs");
    is_int(s.local_copies, 3, "reordering: three local copies through staging");
    is_int(s.writes, 3, "reordering: three slots written");
    is_int(s.bytes[RP_LINK_LOCAL], 3 * MODEL_BYTES, "reordering: local bytes counted");
    for (int64_t i = 0; i < s.writes; i++) {
        rp_migration_write w;
        rp_migration_transfer t;
        rp_migration_plan_write(mp, i, &w, NULL);
        rp_migration_plan_transfer(mp, w.transfer, &t, NULL);
        ok(w.gpu == 0 && t.src_gpu == 0 && cur[t.src_slot] == re[w.slot] && t.expert == re[w.slot],
           "reordering: slot %d gets expert %d from local slot %d", w.slot, re[w.slot], t.src_slot);
    }
    rp_migration_plan_free(mp);

    /* A duplicated target expert on one GPU arrives once and fills both slots. */
    int32_t dup[6] = {3, 3, 2, 3, 0, 1};
    rp_plan *d = make_plan(ctx, cfg, dup);
    is_int(rp_migration_plan_new(ctx, cfg, a, d, NULL, &mp, &err), RP_OK, "duplicate: planned");
    rp_migration_plan_summary(mp, &s);
    is_int(s.transfers, 1, "duplicate: one copy between GPUs");
    is_int(s.writes, 2, "duplicate: two slots written from it");
    is_int(s.moved_bytes, MODEL_BYTES, "duplicate: one expert's bytes moved");
    rp_migration_plan_free(mp);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_plan_free(c);
    rp_plan_free(d);
    rp_config_free(cfg);
}

static void test_source_preference(rp_context *ctx)
{
    /* 2 nodes x 2 GPUs, one EP group of 4 across both nodes, 2 slots per GPU. */
    rp_config *cfg = w_config(ctx, 2, 2, 4, 2, 1, 6);
    rp_error err;
    rp_migration_plan *mp = NULL;
    rp_migration_transfer t;
    {
        /* GPU0 needs expert 2: GPU1 (same node) and GPU2 (other node) hold it. */
        int32_t cur[8] = {0, 1, 2, 3, 2, 4, 5, 3};
        int32_t tgt[8] = {2, 1, 2, 3, 2, 4, 5, 3};
        rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
        is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err), RP_OK, "same node: planned");
        rp_migration_plan_transfer(mp, 0, &t, NULL);
        ok(t.src_gpu == 1 && t.src_slot == 0 && t.link == RP_LINK_NVLINK && t.dst_gpu == 0,
           "a GPU of the same node is preferred over one of another node");
        rp_migration_plan_free(mp);
        /* GPU0 needs expert 1 in slot 0 while its slot 1 holds it: its own GPU. */
        int32_t own[8] = {1, 1, 2, 3, 2, 4, 5, 3};
        rp_plan *c = make_plan(ctx, cfg, own);
        is_int(rp_migration_plan_new(ctx, cfg, a, c, NULL, &mp, &err), RP_OK, "same GPU: planned");
        rp_migration_plan_transfer(mp, 0, &t, NULL);
        ok(t.src_gpu == 0 && t.src_slot == 1 && t.link == RP_LINK_LOCAL, "the GPU's own slot is preferred");
        rp_migration_plan_free(mp);
        rp_plan_free(a);
        rp_plan_free(b);
        rp_plan_free(c);
    }
    {
        /* GPU1 holds expert 2 in both its slots; GPU0 needs it: sent from the first */
        int32_t cur[8] = {0, 1, 2, 2, 3, 4, 5, 3};
        int32_t tgt[8] = {2, 1, 2, 2, 3, 4, 5, 3};
        rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
        is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err), RP_OK, "a sender's two slots: planned");
        rp_migration_plan_transfer(mp, 0, &t, NULL);
        ok(rp_migration_plan_num_transfers(mp) == 1 && t.src_gpu == 1 && t.src_slot == 0 && t.dst_gpu == 0,
           "a sender holding the expert twice sends from its first slot holding it");
        rp_migration_plan_free(mp);
        rp_plan_free(a);
        rp_plan_free(b);
    }
    {
        /* GPU2 and GPU3 (node 1) both hold 4 and 5; GPU0 needs 4, GPU1 needs 5. */
        int32_t cur[8] = {0, 1, 2, 3, 4, 5, 4, 5};
        int32_t tgt[8] = {4, 1, 5, 3, 4, 5, 4, 5};
        rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
        is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err), RP_OK, "across nodes: planned");
        rp_migration_transfer t0, t1;
        rp_migration_plan_transfer(mp, 0, &t0, NULL);
        rp_migration_plan_transfer(mp, 1, &t1, NULL);
        ok(t0.dst_gpu == 0 && t0.src_gpu == 2 && t0.link == RP_LINK_NET,
           "across nodes: a tie goes to the lowest GPU id");
        ok(t1.dst_gpu == 1 && t1.src_gpu == 3 && t1.link == RP_LINK_NET,
           "across nodes: the next copy goes to the least-loaded sender");
        rp_migration_gpu g2, g3;
        rp_migration_plan_gpu(mp, 2, &g2, NULL);
        rp_migration_plan_gpu(mp, 3, &g3, NULL);
        ok(g2.sent[RP_LINK_NET] == MODEL_BYTES && g3.sent[RP_LINK_NET] == MODEL_BYTES, "across nodes: sends spread");
        is_int(rp_migration_plan_gpu(mp, 4, &g3, &err), RP_EINVAL, "per-GPU figures: GPU out of range refused");
        rp_migration_plan_free(mp);
        rp_plan_free(a);
        rp_plan_free(b);
    }
    rp_config_free(cfg);
}

static void test_swaps_and_cycles(rp_context *ctx)
{
    rp_config *cfg = w_config(ctx, 1, 3, 3, 2, 1, 6);
    rp_error err;
    rp_migration_plan *mp = NULL;
    rp_migration_summary s;
    struct {
        const char *name;
        int32_t cur[6], tgt[6];
        int64_t transfers, local;
    } cases[] = {
        {"swap between two GPUs", {0, 1, 2, 3, 4, 5}, {2, 1, 0, 3, 4, 5}, 2, 0},
        {"cycle of three GPUs", {0, 1, 2, 3, 4, 5}, {4, 1, 0, 3, 2, 5}, 3, 0},
        {"swap inside one GPU", {0, 1, 2, 3, 4, 5}, {1, 0, 2, 3, 4, 5}, 0, 2},
        {"a slot's old expert feeds another slot", {0, 1, 2, 3, 4, 5}, {2, 0, 1, 3, 4, 5}, 2, 1},
        {"everything rotates", {0, 1, 2, 3, 4, 5}, {5, 2, 1, 4, 3, 0}, 6, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        rp_plan *a = make_plan(ctx, cfg, cases[c].cur), *b = make_plan(ctx, cfg, cases[c].tgt);
        is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err), RP_OK, "%s: planned", cases[c].name);
        rp_migration_plan_summary(mp, &s);
        ok(s.transfers == cases[c].transfers && s.local_copies == cases[c].local,
           "%s: %lld copies between GPUs, %lld inside (got %lld, %lld)", cases[c].name,
           (long long)cases[c].transfers, (long long)cases[c].local, (long long)s.transfers, (long long)s.local_copies);
        ok(s.moved_bytes == s.min_bytes, "%s: moved bytes are the minimum", cases[c].name);
        /* Every write's copy reads the expert that slot needs, from the current placement. */
        bool right = true;
        for (int64_t i = 0; i < s.writes; i++) {
            rp_migration_write w;
            rp_migration_transfer t;
            rp_migration_plan_write(mp, i, &w, NULL);
            rp_migration_plan_transfer(mp, w.transfer, &t, NULL);
            right &= t.dst_gpu == w.gpu && cases[c].cur[t.src_gpu * 2 + t.src_slot] == cases[c].tgt[w.gpu * 2 + w.slot];
        }
        ok(right, "%s: every written slot is fed its target expert from the current placement", cases[c].name);
        rp_migration_plan_free(mp);
        rp_plan_free(a);
        rp_plan_free(b);
    }
    rp_config_free(cfg);
}

/* ---- the minimum, by brute force ----
 * One EP group, one layer: n GPUs with s slots and one scratch buffer each. A move
 * copies an expert from any buffer to any other; it costs 1 between GPUs and 0 inside
 * one. 0-1 BFS over every content of every buffer finds the fewest copies between GPUs
 * that leave every slot with a target expert holding it: no cleverness assumed. */

#define BF_MAX_POS 9

static int64_t brute_force(int n, int s, int E, const int32_t *cur, const int32_t *tgt)
{
    const int P = n * (s + 1), V = E + 1; /* value E: garbage */
    int64_t states = 1;
    for (int i = 0; i < P; i++) states *= V;
    unsigned char *dist = malloc((size_t)states);
    /* A state is pushed again each time its distance drops (at most a few times). */
    int32_t *deque = malloc((size_t)states * 16 * sizeof(int32_t));
    memset(dist, 0xff, (size_t)states);
    int64_t pw[BF_MAX_POS];
    pw[0] = 1;
    for (int i = 1; i < P; i++) pw[i] = pw[i - 1] * V;
    int64_t start = 0;
    for (int g = 0; g < n; g++)
        for (int k = 0; k <= s; k++) {
            int v = k < s && cur[g * s + k] >= 0 ? cur[g * s + k] : E;
            start += v * pw[g * (s + 1) + k];
        }
    int64_t head = states * 8, tail = head; /* deque in [head, tail) */
    deque[tail++] = (int32_t)start;
    dist[start] = 0;
    int64_t answer = -1;
    while (head < tail) {
        int32_t st = deque[head++];
        int d = dist[st];
        int digits[BF_MAX_POS];
        int64_t x = st;
        for (int i = 0; i < P; i++) {
            digits[i] = (int)(x % V);
            x /= V;
        }
        bool goal = true;
        for (int g = 0; g < n && goal; g++)
            for (int k = 0; k < s && goal; k++)
                if (tgt[g * s + k] >= 0 && digits[g * (s + 1) + k] != tgt[g * s + k]) goal = false;
        if (goal) {
            answer = d;
            break;
        }
        for (int a = 0; a < P; a++) {
            if (digits[a] == E) continue;
            for (int b = 0; b < P; b++) {
                if (a == b || digits[b] == digits[a]) continue;
                int cost = a / (s + 1) != b / (s + 1);
                int64_t next = st + (int64_t)(digits[a] - digits[b]) * pw[b];
                if (dist[next] <= d + cost) continue;
                dist[next] = (unsigned char)(d + cost);
                if (cost) deque[tail++] = (int32_t)next;
                else deque[--head] = (int32_t)next;
            }
        }
    }
    free(dist);
    free(deque);
    return answer;
}

static void test_minimum_brute_force(rp_context *ctx)
{
    /* The search itself, on cases whose answer is known. */
    int32_t sw_c[2] = {0, 1}, sw_t[2] = {1, 0}, in_c[4] = {0, 1, 2, 3}, in_t[4] = {1, 0, 2, 3};
    int32_t dup_c[4] = {0, 1, 2, 3}, dup_t[4] = {2, 2, 2, 3};
    is_int(brute_force(2, 1, 2, sw_c, sw_t), 2, "brute force: a swap between GPUs takes two copies");
    is_int(brute_force(2, 2, 4, in_c, in_t), 0, "brute force: a swap inside a GPU takes none between GPUs");
    is_int(brute_force(2, 2, 4, dup_c, dup_t), 1, "brute force: one copy fills two slots of a GPU");
    struct { int n, s, E, cases; } shapes[] = {{2, 1, 2, 10}, {2, 2, 3, 12}, {2, 2, 4, 12}, {3, 1, 3, 12},
                                               {3, 2, 3, 4}};
    int total = 0, agree = 0, min_agree = 0;
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        int n = shapes[sh].n, s = shapes[sh].s, E = shapes[sh].E;
        rp_config *cfg = w_config(ctx, 1, n, n, s, 1, E);
        if (!cfg) continue;
        for (int c = 0; c < shapes[sh].cases; c++) {
            int32_t cur[6], tgt[6];
            /* Every expert somewhere in the current placement; the target draws from the
             * experts present (empty slots allowed in both, duplicates too). */
            for (int i = 0; i < n * s; i++) cur[i] = rnd(5) == 0 ? -1 : (int32_t)rnd((uint32_t)E);
            for (int e = 0; e < E && e < n * s; e++) cur[rnd((uint32_t)(n * s))] = e;
            for (int i = 0; i < n * s; i++) {
                tgt[i] = rnd(6) == 0 ? -1 : cur[rnd((uint32_t)(n * s))];
                if (rnd(3) == 0) tgt[i] = cur[i];
            }
            rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
            rp_migration_plan *mp = NULL;
            rp_error err;
            if (!a || !b || rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err) != RP_OK) {
                diag("case failed to plan: %s", err.text);
                rp_plan_free(a);
                rp_plan_free(b);
                continue;
            }
            rp_migration_summary sum;
            rp_migration_plan_summary(mp, &sum);
            int64_t bf = brute_force(n, s, E, cur, tgt);
            total++;
            if (bf * MODEL_BYTES == sum.moved_bytes) agree++;
            else
                diag("n %d s %d E %d: planner moves %lld experts, brute force needs %lld", n, s, E,
                     (long long)(sum.moved_bytes / MODEL_BYTES), (long long)bf);
            if (sum.min_bytes == sum.moved_bytes) min_agree++;
            rp_migration_plan_free(mp);
            rp_plan_free(a);
            rp_plan_free(b);
        }
        rp_config_free(cfg);
    }
    ok(total >= 45, "brute force: %d random small cases ran", total);
    is_int(agree, total, "brute force: the planner moves exactly the minimum in every case");
    is_int(min_agree, total, "brute force: the reported minimum equals the bytes moved");
}

/* Random valid placement of one layer: every expert once, spare slots random replicas
 * (or empty), shuffled over the slots. */
static void random_layer(int32_t *row, int S, int E)
{
    for (int i = 0; i < S; i++) row[i] = i < E ? i : (rnd(4) == 0 ? -1 : (int32_t)rnd((uint32_t)E));
    for (int i = S - 1; i > 0; i--) {
        int j = (int)rnd((uint32_t)i + 1);
        int32_t t = row[i];
        row[i] = row[j];
        row[j] = t;
    }
}

static void test_minimum_formula(rp_context *ctx)
{
    /* Several groups and layers: moved == the per-GPU set difference, counted here. */
    rp_config *cfg = w_config(ctx, 2, 4, 4, 5, 6, 12); /* 2 EP groups of 4 */
    const int S = 20, L = 6, E = 12, ep = 4, slots = 5, Q = 2;
    int32_t cur[6 * 20], tgt[6 * 20];
    int good = 0, runs = 20, cost_agrees = 0;
    /* The cost model's migration estimate counts the same bytes: a one-token batch is
     * enough to build an evaluator. */
    int32_t lens[1] = {1}, zero[1] = {0};
    uint8_t ids[6] = {0, 1, 2, 3, 4, 5};
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    rp_cost *cost = NULL;
    rp_routing routing;
    rp_routing_packed(&routing, RP_ID_U8, 6, 1, ids);
    bool have_cost = rp_batch_new(ctx, 1, lens, zero, NULL, &batch, NULL) == RP_OK &&
                     rp_stats_compute(ctx, batch, &routing, 12, 1, &stats, NULL) == RP_OK &&
                     rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, NULL) == RP_OK;
    for (int run = 0; run < runs; run++) {
        for (int l = 0; l < L; l++) {
            random_layer(cur + l * S, S, E);
            random_layer(tgt + l * S, S, E);
        }
        rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
        if (run % 2) rp_plan_stabilize_slots(b, a, NULL);
        rp_migration_plan *mp = NULL;
        if (rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, NULL) != RP_OK) continue;
        int64_t want = 0;
        for (int l = 0; l < L; l++) {
            const int32_t *c = rp_plan_phy2log(a, l), *t = rp_plan_phy2log(b, l);
            for (int r = 0; r < ep; r++)
                for (int e = 0; e < E; e++) {
                    bool in_t = false, in_c = false;
                    for (int k = 0; k < slots; k++) {
                        in_t |= t[r * slots + k] == e;
                        in_c |= c[r * slots + k] == e;
                    }
                    if (in_t && !in_c) want += Q * MODEL_BYTES;
                }
        }
        rp_migration_summary s;
        rp_migration_plan_summary(mp, &s);
        int64_t sent = 0, recv = 0;
        for (int g = 0; g < 8; g++) {
            rp_migration_gpu gs;
            rp_migration_plan_gpu(mp, g, &gs, NULL);
            sent += gs.sent[RP_LINK_NVLINK] + gs.sent[RP_LINK_NET];
            recv += gs.received[RP_LINK_NVLINK] + gs.received[RP_LINK_NET];
        }
        bool within_group = true;
        for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
            rp_migration_transfer t;
            rp_migration_plan_transfer(mp, i, &t, NULL);
            within_group &= t.src_gpu / ep == t.dst_gpu / ep;
        }
        if (s.moved_bytes == want && s.min_bytes == want && sent == want && recv == want && within_group) good++;
        double cost_bytes = -1, cost_s = 0;
        if (have_cost && rp_cost_migration(cost, a, b, &cost_s, &cost_bytes, NULL) == RP_OK &&
            cost_bytes == (double)s.moved_bytes)
            cost_agrees++;
        rp_migration_plan_free(mp);
        rp_plan_free(a);
        rp_plan_free(b);
    }
    is_int(good, runs, "two EP groups, six layers: bytes moved = per-GPU set difference, sent = received, each "
           "group moves inside itself");
    ok(have_cost, "a cost evaluator for the same config");
    is_int(cost_agrees, runs, "rp_cost_migration counts the same bytes as the planner moves");
    rp_cost_free(cost);
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(cfg);
}

/* ---- rounds, determinism, time ---- */

static void test_rounds(rp_context *ctx)
{
    rp_config *cfg = w_config(ctx, 1, 4, 4, 4, 8, 12);
    const int S = 16, L = 8, E = 12;
    int32_t cur[8 * 16], tgt[8 * 16];
    for (int l = 0; l < L; l++) {
        random_layer(cur + l * S, S, E);
        random_layer(tgt + l * S, S, E);
    }
    memcpy(tgt + 3 * S, cur + 3 * S, S * sizeof(int32_t)); /* layer 3 moves nothing */
    rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
    rp_migration_plan *one = NULL, *mp = NULL, *again = NULL;
    rp_error err;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, NULL, &one, &err), RP_OK, "no budget: planned");
    rp_migration_summary s1, s;
    rp_migration_plan_summary(one, &s1);
    is_int(s1.num_rounds, 1, "no budget: one round");
    is_int(s1.layers_moved, 7, "seven of eight layers move");
    is_int(rp_migration_plan_layer_round(one, 3), -1, "a layer that moves nothing is in no round");
    ok(s1.min_budget_bytes > 0 && s1.min_budget_bytes <= s1.max_staging_bytes, "the smallest budget is reported");

    rp_migration_options opts = {NULL, s1.min_budget_bytes};
    is_int(rp_migration_plan_new(ctx, cfg, a, b, &opts, &mp, &err), RP_OK, "smallest budget: planned");
    rp_migration_plan_summary(mp, &s);
    ok(s.num_rounds > 1, "smallest budget: %d rounds", s.num_rounds);
    is_int(s.moved_bytes, s1.moved_bytes, "rounds move the same bytes");
    /* Per round and GPU, staged bytes within the budget; layers in rounds in order. */
    int64_t stage[8][4];
    memset(stage, 0, sizeof stage);
    bool ordered = true, whole = true;
    int32_t last = -1;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(mp, i, &t, NULL);
        stage[t.round][t.dst_gpu] += t.bytes;
        ordered &= t.round >= last;
        last = t.round;
        whole &= t.round == rp_migration_plan_layer_round(mp, t.layer);
    }
    bool within = true;
    for (int r = 0; r < 8; r++)
        for (int g = 0; g < 4; g++) within &= stage[r][g] <= opts.staging_budget_bytes;
    ok(within, "every round's staging fits the budget on every GPU");
    ok(ordered && whole, "transfers come round by round, each layer whole in its round");
    ok(s.max_staging_bytes <= opts.staging_budget_bytes, "the largest staging is within the budget");
    for (int32_t l = 1; l < L; l++)
        if (rp_migration_plan_layer_round(mp, l) >= 0 && rp_migration_plan_layer_round(mp, l - 1) >= 0 &&
            rp_migration_plan_layer_round(mp, l) < rp_migration_plan_layer_round(mp, l - 1))
            ordered = false;
    ok(ordered, "rounds take layers in order");
    ok(s.predicted_s >= s1.predicted_s, "more rounds predict no less time");

    is_int(rp_migration_plan_new(ctx, cfg, a, b, &opts, &again, &err), RP_OK, "planned again");
    ok(rp_migration_plan_hash(again) == rp_migration_plan_hash(mp) &&
       rp_migration_plan_num_transfers(again) == rp_migration_plan_num_transfers(mp),
       "deterministic: the same inputs give the same plan hash");
    bool same = true;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
        rp_migration_transfer x, y;
        rp_migration_plan_transfer(mp, i, &x, NULL);
        rp_migration_plan_transfer(again, i, &y, NULL);
        same &= x.round == y.round && x.layer == y.layer && x.expert == y.expert && x.src_gpu == y.src_gpu &&
                x.src_slot == y.src_slot && x.dst_gpu == y.dst_gpu && x.link == y.link && x.bytes == y.bytes;
    }
    ok(same, "deterministic: the same transfers in the same order");
    ok(rp_migration_plan_hash(one) != rp_migration_plan_hash(mp), "a different budget gives a different hash");

    opts.staging_budget_bytes = s1.min_budget_bytes - 1;
    rp_migration_plan *none = (rp_migration_plan *)&opts;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, &opts, &none, &err), RP_ERANGE, "a budget below one layer is refused");
    like(err.text, "is below the", "the budget error names the shortfall");
    ok(none == NULL, "a refused plan is not returned");
    opts.staging_budget_bytes = -5;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, &opts, &none, &err), RP_EINVAL, "a negative budget is refused");

    int64_t bytes[8] = {100, 200, 300, 400, 500, 600, 700, 800};
    rp_migration_options sized = {bytes, 0};
    rp_migration_plan *mp2 = NULL;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, &sized, &mp2, &err), RP_OK, "per-layer expert bytes: planned");
    bool sizes_ok = true;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp2); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(mp2, i, &t, NULL);
        sizes_ok &= t.bytes == bytes[t.layer];
    }
    ok(sizes_ok && rp_migration_plan_expert_bytes(mp2, 7) == 800, "per-layer expert bytes are used");
    bytes[2] = 0;
    is_int(rp_migration_plan_new(ctx, cfg, a, b, &sized, &none, &err), RP_EINVAL, "zero expert bytes are refused");
    like(err.text, "layer 2 has 0 bytes per expert", "the zero size is named");

    rp_migration_plan_free(one);
    rp_migration_plan_free(mp);
    rp_migration_plan_free(mp2);
    rp_migration_plan_free(again);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_config_free(cfg);
}

static void test_predicted_time(rp_context *ctx)
{
    rp_config *cfg = w_config(ctx, 2, 2, 4, 2, 1, 6);
    const rp_topology *t = rp_config_topology(cfg);
    const rp_hardware *hw = rp_config_hardware(cfg);
    int32_t cur[8] = {0, 1, 2, 3, 4, 5, 4, 5};
    int32_t nv[8] = {2, 1, 2, 3, 4, 5, 4, 5};  /* one NVLink copy to GPU0 */
    int32_t net[8] = {4, 1, 2, 3, 4, 5, 4, 5}; /* one network copy to GPU0 */
    rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, nv), *c = make_plan(ctx, cfg, net);
    rp_migration_plan *mp = NULL;
    rp_migration_summary s;
    const double B = MODEL_BYTES;
    rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, NULL);
    rp_migration_plan_summary(mp, &s);
    is_double(s.predicted_s, B / t->nvlink_bytes_per_s + t->nvlink_latency_s + 2 * B / hw->hbm_bytes_per_s, 1e-15,
              "one NVLink copy: bytes / NVLink bandwidth + latency + the commit through HBM");
    rp_migration_plan_free(mp);
    rp_migration_plan_new(ctx, cfg, a, c, NULL, &mp, NULL);
    rp_migration_plan_summary(mp, &s);
    is_double(s.predicted_s, B / t->net_bytes_per_s + t->net_latency_s + 2 * B / hw->hbm_bytes_per_s, 1e-15,
              "one network copy: bytes / network bandwidth + latency + the commit through HBM");
    is_int(count_links(mp, RP_LINK_NET), 1, "the network copy is counted as such");
    rp_migration_plan_free(mp);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_plan_free(c);
    rp_config_free(cfg);
}

static void test_errors(rp_context *ctx)
{
    rp_config *cfg = w_config(ctx, 1, 2, 2, 2, 1, 4);
    rp_config *other = w_config(ctx, 1, 4, 4, 2, 1, 4);
    int32_t cur[4] = {0, 1, 2, 3}, miss[4] = {0, 1, 2, 2};
    rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, miss), *empty = NULL;
    rp_plan_new(ctx, cfg, 1, &empty, NULL);
    rp_migration_plan *mp = NULL;
    rp_error err;
    /* Target holds 3 twice ... build one whose expert is absent from current. */
    is_int(rp_migration_plan_new(ctx, cfg, b, a, NULL, &mp, &err), RP_EPLAN, "a target expert held nowhere: refused");
    like(err.text, "layer 0 expert 3 is in the target placement but in no slot of the current placement",
         "the missing expert is named");
    is_int(err.expert, 3, "err.expert names it");
    ok(mp == NULL, "nothing returned on error");
    is_int(rp_migration_plan_new(ctx, cfg, empty, a, NULL, &mp, &err), RP_EINVAL, "a plan without placement: refused");
    like(err.text, "the current plan has no placement", "which plan lacks it is named");
    is_int(rp_migration_plan_new(ctx, other, a, a, NULL, &mp, &err), RP_EINVAL, "a plan of another shape: refused");
    like(err.text, "shaped for 2 GPUs", "the shapes are named");
    is_int(rp_migration_plan_new(ctx, cfg, a, NULL, NULL, &mp, &err), RP_EINVAL, "a missing plan: refused");
    is_int(rp_migration_plan_new(ctx, cfg, a, a, NULL, NULL, &err), RP_EINVAL, "no output: refused");
    ok(rp_migration_plan_hash(NULL) == 0 && rp_migration_plan_num_transfers(NULL) == 0 &&
       rp_migration_plan_layer_round(NULL, 0) == -1, "accessors of NULL are harmless");
    rp_migration_plan_free(NULL);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_plan_free(empty);
    rp_config_free(cfg);
    rp_config_free(other);
}

/* ---- allocation failures (counting_alloc: test_util.h) ---- */

static void test_alloc_failures(void)
{
    counting c = {0};
    rp_context *ctx;
    rp_context_new(counting_alloc, &c, &ctx);
    rp_config *cfg = w_config(ctx, 2, 2, 2, 3, 3, 5);
    int32_t cur[3 * 6], tgt[3 * 6];
    for (int l = 0; l < 3; l++) {
        random_layer(cur + l * 6, 6, 5);
        random_layer(tgt + l * 6, 6, 5);
    }
    rp_plan *a = make_plan(ctx, cfg, cur), *b = make_plan(ctx, cfg, tgt);
    long base = c.live;
    int failures = 0, clean = 0, n;
    for (n = 1; n < 400; n++) {
        c.calls = 0;
        c.fail_at = n;
        rp_migration_plan *mp = NULL;
        rp_error err;
        rp_status st = rp_migration_plan_new(ctx, cfg, a, b, NULL, &mp, &err);
        c.fail_at = 0;
        if (st == RP_OK) {
            rp_migration_plan_free(mp);
            break;
        }
        failures++;
        if (st == RP_ENOMEM && mp == NULL && c.live == base) clean++;
    }
    ok(failures > 5 && failures == clean, "planner: each of %d allocation failures fails cleanly and leaks nothing",
       failures);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_config_free(cfg);
    rp_context_free(ctx);
    is_int(c.live, 0, "planner: everything was freed");
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_registry(ctx);
    test_residents_and_local(ctx);
    test_source_preference(ctx);
    test_swaps_and_cycles(ctx);
    test_minimum_brute_force(ctx);
    test_minimum_formula(ctx);
    test_rounds(ctx);
    test_predicted_time(ctx);
    test_errors(ctx);
    rp_context_free(ctx);
    test_alloc_failures();
    return tap_done();
}
