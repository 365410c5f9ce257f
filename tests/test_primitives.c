/* Primitives against brute force on small cases (and KK against verl's outputs), plus
 * determinism, bad input, allocation failures and work bounds. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint64_t rnd(void) { return xorshift64(&rng_state); }
static int32_t rnd_int(int32_t lo, int32_t hi) { return lo + (int32_t)(rnd() % (uint64_t)(hi - lo + 1)); }

static double makespan(const double *w, int32_t n, int32_t k, const double *speed, const int32_t *part)
{
    double load[64] = {0}, best = 0;
    for (int32_t i = 0; i < n; i++) load[part[i]] += w[i];
    for (int32_t p = 0; p < k; p++) {
        double l = speed ? load[p] / speed[p] : load[p];
        if (l > best) best = l;
    }
    return best;
}

static bool valid_partition(const int32_t *part, int32_t n, int32_t k)
{
    for (int32_t i = 0; i < n; i++)
        if (part[i] < 0 || part[i] >= k) return false;
    return true;
}

/* Brute force over all k^n assignments: the least makespan subject to the limits
 * (size caps, item limit); INFINITY when none is feasible. */
static double brute_makespan(const double *w, int32_t n, int32_t k, const rp_part_limits *lim)
{
    int32_t part[16] = {0};
    double best = INFINITY;
    for (;;) {
        double size[8] = {0};
        int32_t cnt[8] = {0};
        bool okay = true;
        for (int32_t i = 0; i < n; i++) {
            cnt[part[i]]++;
            if (lim && lim->size) size[part[i]] += lim->size[i];
        }
        for (int32_t p = 0; p < k && lim; p++) {
            if (lim->max_items > 0 && cnt[p] > lim->max_items) okay = false;
            if (lim->size && size[p] > (lim->part_size_cap ? lim->part_size_cap[p] : lim->size_cap)) okay = false;
        }
        if (okay) {
            double m = makespan(w, n, k, lim ? lim->speed : NULL, part);
            if (m < best) best = m;
        }
        int32_t i = 0;
        while (i < n && ++part[i] == k) part[i++] = 0;
        if (i == n) break;
    }
    return best;
}

/* ---- sorting ---- */

static const double *ref_values;
static int ref_desc;
static int cmp_ref(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    double vx = ref_values[x], vy = ref_values[y];
    if (vx != vy) return (ref_desc ? vx > vy : vx < vy) ? -1 : 1;
    return x < y ? -1 : 1;
}

static void test_sort(rp_context *ctx)
{
    rp_error err;
    double v[8] = {3, 1, 2, 3, 1, -5, INFINITY, 2};
    int32_t idx[8];
    is_int(rp_sort_index(ctx, v, 8, false, idx, &err), RP_OK, "argsort ascending");
    int32_t asc[8] = {5, 1, 4, 2, 7, 0, 3, 6};
    ok(memcmp(idx, asc, sizeof asc) == 0, "ascending order, equal values by index");
    is_int(rp_sort_index(ctx, v, 8, true, idx, &err), RP_OK, "argsort descending");
    int32_t desc[8] = {6, 0, 3, 2, 7, 1, 4, 5};
    ok(memcmp(idx, desc, sizeof desc) == 0, "descending order, equal values still by index");

    int all_ok = 1, topk_ok = 1;
    static double big[5000];
    static int32_t got[5000], want[5000];
    for (int t = 0; t < 20; t++) {
        int32_t n = rnd_int(1, 5000);
        for (int32_t i = 0; i < n; i++) big[i] = (double)rnd_int(0, t % 2 ? 20 : 1000000);
        for (int d = 0; d < 2; d++) {
            for (int32_t i = 0; i < n; i++) want[i] = i;
            ref_values = big;
            ref_desc = d;
            qsort(want, (size_t)n, sizeof *want, cmp_ref);
            if (rp_sort_index(ctx, big, n, d, got, &err) != RP_OK || memcmp(got, want, (size_t)n * 4))
                all_ok = 0;
            if (d) {
                int32_t k = rnd_int(1, n);
                if (rp_sort_topk(ctx, big, n, k, got, &err) != RP_OK || memcmp(got, want, (size_t)k * 4))
                    topk_ok = 0;
            }
        }
    }
    ok(all_ok, "argsort equals a reference sort by (value, index) on 40 random arrays");
    ok(topk_ok, "top-k equals the head of the descending argsort on 20 random arrays");

    double tk[6] = {5, 9, 5, 1, 9, 5};
    int32_t top[3];
    is_int(rp_sort_topk(ctx, tk, 6, 3, top, &err), RP_OK, "top-3 with ties");
    ok(top[0] == 1 && top[1] == 4 && top[2] == 0, "top-3 is 1, 4, 0 (ties by index)");

    is_int(rp_sort_index(ctx, v, 0, false, idx, &err), RP_OK, "argsort of nothing");
    double bad[3] = {1, NAN, 2};
    int32_t keep[3] = {7, 7, 7};
    is_int(rp_sort_index(ctx, bad, 3, false, keep, &err), RP_EINVAL, "argsort rejects NaN");
    like(err.text, "value 1 is NaN", "NaN error names the value");
    is_int(err.sequence, 1, "NaN error carries the index");
    ok(keep[0] == 7 && keep[2] == 7, "output untouched on error");
    is_int(rp_sort_index(ctx, v, -1, false, idx, &err), RP_EINVAL, "argsort rejects n < 0");
    is_int(rp_sort_topk(ctx, tk, 6, 0, top, &err), RP_EINVAL, "top-k rejects k = 0");
    like(err.text, "k = 0", "k = 0 message");
    is_int(rp_sort_topk(ctx, tk, 2, 3, top, &err), RP_ERANGE, "top-k rejects k > n");
    like(err.text, "k = 3 but there are only 2 values", "k > n message");
    is_int(rp_sort_topk(ctx, bad, 3, 1, top, &err), RP_EINVAL, "top-k rejects NaN");
}

/* ---- LPT ---- */

static void test_lpt(rp_context *ctx)
{
    rp_error err;
    double w[7] = {2, 7, 3, 5, 3, 4, 1};
    int32_t part[16];
    is_int(rp_partition_lpt(ctx, w, 7, 3, NULL, part, &err), RP_OK, "lpt on 7 items, 3 parts");
    /* 7->p0, 5->p1, 4->p2, 3(i2)->p2, 3(i4)->p1, 2->p0, 1->p2 */
    int32_t want[7] = {0, 0, 2, 1, 1, 2, 2};
    ok(memcmp(part, want, sizeof want) == 0, "lpt hand case: heaviest first to the least-loaded part");
    is_double(makespan(w, 7, 3, NULL, part), 9, 0, "lpt hand case makespan 9 (optimum 9)");

    /* Graham's tight example: 2k+1 jobs, LPT = (4/3 - 1/(3k)) OPT. k = 3: 5,5,4,4,3,3,3. */
    double g[7] = {5, 5, 4, 4, 3, 3, 3};
    rp_partition_lpt(ctx, g, 7, 3, NULL, part, &err);
    is_double(makespan(g, 7, 3, NULL, part), 11, 0, "Graham's example: LPT makespan 11");
    is_double(brute_makespan(g, 7, 3, NULL), 9, 0, "Graham's example: optimum 9 (ratio 11/9 = 4/3 - 1/9)");

    /* Bound on random cases, and the limits on random cases. */
    int bound_ok = 1, caps_ok = 1, cases = 0, lpt_failed_feasible = 0;
    double worst = 1;
    for (int t = 0; t < 400; t++) {
        int32_t n = rnd_int(1, 9), k = rnd_int(1, 3);
        double wt[9], sz[9];
        for (int32_t i = 0; i < n; i++) {
            wt[i] = t % 3 ? (double)rnd_int(1, 100) : (double)rnd_int(0, 5);
            sz[i] = (double)rnd_int(0, 50);
        }
        if (rp_partition_lpt(ctx, wt, n, k, NULL, part, &err) != RP_OK || !valid_partition(part, n, k)) {
            bound_ok = 0;
            continue;
        }
        double opt = brute_makespan(wt, n, k, NULL), got = makespan(wt, n, k, NULL, part);
        double bound = 4.0 / 3.0 - 1.0 / (3.0 * k);
        if (got > bound * opt * (1 + 1e-12)) bound_ok = 0;
        if (opt > 0 && got / opt > worst) worst = got / opt;

        rp_part_limits lim = {.size = sz, .size_cap = (double)rnd_int(50, 150), .max_items = rnd_int(0, 4)};
        if (brute_makespan(wt, n, k, &lim) == INFINITY) continue;
        cases++;
        rp_status st = rp_partition_lpt(ctx, wt, n, k, &lim, part, &err);
        if (st == RP_ERANGE) {
            lpt_failed_feasible++;
            continue;
        }
        double psize[3] = {0};
        int32_t cnt[3] = {0};
        for (int32_t i = 0; i < n; i++) psize[part[i]] += sz[i], cnt[part[i]]++;
        for (int32_t p = 0; p < k; p++)
            if (psize[p] > lim.size_cap || (lim.max_items && cnt[p] > lim.max_items)) caps_ok = 0;
    }
    ok(bound_ok, "lpt within 4/3 - 1/(3k) of the brute-force optimum on 400 cases (n <= 9, k <= 3)");
    diag("lpt worst ratio to the optimum: %.4f", worst);
    ok(caps_ok, "lpt respects size caps and item limits (%d feasible capped cases)", cases);
    diag("lpt found no placement in %d of %d feasible capped cases (greedy)", lpt_failed_feasible, cases);

    /* Heap path (no size cap) and scan path (infinite cap) choose alike. */
    int same = 1;
    for (int t = 0; t < 50; t++) {
        int32_t n = rnd_int(1, 300), k = rnd_int(1, 17);
        static double wt[300], sz[300];
        static int32_t a[300], b[300];
        for (int32_t i = 0; i < n; i++) wt[i] = (double)rnd_int(0, 40), sz[i] = 1;
        rp_part_limits inf = {.size = sz, .size_cap = INFINITY, .max_items = t % 2 ? (n + k - 1) / k : 0};
        rp_part_limits none = {.max_items = inf.max_items};
        rp_partition_lpt(ctx, wt, n, k, &none, a, NULL);
        rp_partition_lpt(ctx, wt, n, k, &inf, b, NULL);
        if (memcmp(a, b, (size_t)n * 4)) same = 0;
    }
    ok(same, "lpt: the heap path and the scan path give the same partition");

    /* Speeds: a part twice as fast takes twice the work. */
    double ws[6] = {4, 4, 4, 4, 4, 4}, speed[2] = {2, 1};
    rp_part_limits sp = {.speed = speed};
    rp_partition_lpt(ctx, ws, 6, 2, &sp, part, &err);
    int fast = 0;
    for (int i = 0; i < 6; i++) fast += part[i] == 0;
    is_int(fast, 4, "lpt with speeds 2:1 gives the fast part 4 of 6 equal items");
    int speed_ok = 1;
    for (int t = 0; t < 200; t++) {
        int32_t n = rnd_int(1, 8), k = rnd_int(2, 3);
        double wt[8], spd[3];
        for (int32_t i = 0; i < n; i++) wt[i] = (double)rnd_int(1, 50);
        for (int32_t p = 0; p < k; p++) spd[p] = rnd_int(1, 4) * 0.5;
        rp_part_limits l = {.speed = spd};
        rp_partition_lpt(ctx, wt, n, k, &l, part, NULL);
        /* LPT for uniform machines is within 2 of optimal (Gonzalez et al. 1977: 2 - 2/(k+1)). */
        if (makespan(wt, n, k, spd, part) > (2.0 - 2.0 / (k + 1)) * brute_makespan(wt, n, k, &l) * (1 + 1e-12))
            speed_ok = 0;
    }
    ok(speed_ok, "lpt with speeds within 2 - 2/(k+1) of the brute-force optimum on 200 cases");

    /* Bad input. */
    int32_t keep[3] = {9, 9, 9};
    double nanw[3] = {1, NAN, 1}, negw[3] = {1, 2, -1};
    is_int(rp_partition_lpt(ctx, nanw, 3, 2, NULL, keep, &err), RP_EINVAL, "lpt rejects a NaN weight");
    like(err.text, "lpt: item 1 has weight nan", "NaN weight names the item");
    is_int(err.sequence, 1, "error carries the item");
    ok(keep[0] == 9 && keep[1] == 9 && keep[2] == 9, "part untouched on error");
    is_int(rp_partition_lpt(ctx, negw, 3, 2, NULL, keep, &err), RP_EINVAL, "lpt rejects a negative weight");
    like(err.text, "item 2 has weight -1", "negative weight names the item");
    is_int(rp_partition_lpt(ctx, w, 7, 0, NULL, part, &err), RP_EINVAL, "lpt rejects k = 0");
    like(err.text, "k = 0 parts", "k = 0 message");
    is_int(rp_partition_lpt(ctx, w, -2, 2, NULL, part, &err), RP_EINVAL, "lpt rejects n < 0");
    double sizes[3] = {10, 40, 10};
    rp_partition_lpt(ctx, w, 3, 2, NULL, keep, NULL);
    memcpy(part, keep, sizeof keep);
    rp_part_limits cap = {.size = sizes, .size_cap = 30};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &cap, keep, &err), RP_ERANGE, "lpt: an item over every cap");
    like(err.text, "item 1 has size 40, over every part's cap (largest 30)", "over-cap item named");
    is_int(err.sequence, 1, "over-cap error carries the item");
    ok(memcmp(keep, part, sizeof keep) == 0, "part untouched on a cap error");
    rp_part_limits lim2 = {.max_items = 1};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &lim2, keep, &err), RP_ERANGE, "lpt: more items than k * max_items");
    like(err.text, "3 items do not fit in 2 parts of at most 1 items", "item limit message");
    /* Feasible in total but not greedily: sizes 6,6,4,4,4 (weights alike) in caps 12. */
    double w5[5] = {6, 6, 4, 4, 4}, s5[5] = {6, 6, 4, 4, 4};
    rp_part_limits c12 = {.size = s5, .size_cap = 12};
    is_int(rp_partition_lpt(ctx, w5, 5, 2, &c12, part, &err), RP_ERANGE,
           "lpt: an item that fits nowhere once the parts fill up");
    like(err.text, "item 4 (weight 4, size 4) fits in no part", "the stuck item is named");
    double total_cap[2] = {5, 5}, sz2[3] = {4, 4, 4};
    rp_part_limits tc = {.size = sz2, .part_size_cap = total_cap};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &tc, part, &err), RP_ERANGE, "lpt: total size over the total cap");
    like(err.text, "total size 12 exceeds the parts' total cap 10", "total cap message");
    double badspeed[2] = {1, 0};
    rp_part_limits bs = {.speed = badspeed};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &bs, part, &err), RP_EINVAL, "lpt rejects speed 0");
    like(err.text, "part 1 has speed 0", "speed message");
    rp_part_limits neg_items = {.max_items = -1};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &neg_items, part, &err), RP_EINVAL, "lpt rejects max_items < 0");
    double nan_cap[2] = {NAN, 3};
    rp_part_limits nc = {.size = sz2, .part_size_cap = nan_cap};
    is_int(rp_partition_lpt(ctx, w, 3, 2, &nc, part, &err), RP_EINVAL, "lpt rejects a NaN cap");
    is_int(rp_partition_lpt(ctx, w, 0, 2, NULL, NULL, &err), RP_OK, "lpt of no items");
}

/* ---- Karmarkar-Karp ---- */

/* Partitions computed by verl's karmarkar_karp (verl/utils/seqlen_balancing.py, the
 * same in v0.6.0 and main), item i -> part, for these inputs. */
typedef struct kk_case {
    int32_t k;
    bool equal;
    int32_t n;
    double w[20];
    int32_t verl[20];
} kk_case;

static const kk_case kk_cases[] = {
    {2, false, 5, {4, 5, 6, 7, 8}, {0, 0, 1, 0, 1}},
    {3, false, 9, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 0, 2, 2, 1, 0, 2, 0, 1}},
    {2, true, 8, {8, 7, 6, 5, 4, 3, 2, 1}, {1, 0, 0, 1, 0, 1, 1, 0}},
    {3, true, 6, {5, 5, 5, 5, 5, 5}, {0, 1, 2, 2, 1, 0}},
    {4, false, 7, {5, 5, 5, 5, 5, 5, 5}, {2, 1, 0, 0, 1, 2, 3}},
    {2, false, 4, {0, 0, 0, 3}, {1, 1, 1, 0}},
    {4, false, 13, {3, 4, 3, 3, 4, 4, 1, 1, 4, 3, 4, 1, 0}, {0, 1, 0, 2, 0, 1, 1, 3, 3, 3, 2, 2, 2}},
    {3, true, 12, {29268, 19884, 9293, 5943, 2745, 25963, 29688, 10322, 984, 4140, 3903, 2337},
     {2, 0, 1, 1, 2, 0, 1, 2, 0, 2, 0, 1}},
    {8, false, 20, {192032497, 257691712, 868977025, 25204132, 604760137, 377085456, 563177232,
                    850917465, 198283777, 707436457, 246808081, 329798385, 670687281, 3733777,
                    76200385, 592876132, 307093465, 505286980, 770248960, 74455281},
     {1, 3, 1, 6, 5, 6, 0, 2, 2, 3, 4, 5, 7, 7, 5, 6, 7, 0, 4, 3}},
    {5, true, 15, {2, 2, 1, 4, 2, 0, 0, 4, 0, 3, 0, 2, 3, 0, 0}, {0, 1, 2, 2, 3, 0, 1, 4, 2, 1, 3, 3, 0, 4, 4}},
    {2, false, 9, {36, 13993, 13745, 3430, 30802, 24607, 26046, 27512, 4787}, {1, 1, 0, 0, 0, 0, 1, 1, 1}},
    {6, false, 17, {800295705, 202181905, 295439697, 393200640, 78345792, 354625252, 386642025,
                    12461281, 510780681, 109989081, 127861657, 263616100, 92365056, 8951665,
                    52096057, 606575632, 646559137},
     {4, 5, 3, 3, 0, 1, 1, 3, 0, 3, 2, 0, 1, 4, 2, 5, 2}},
};

static void test_kk(rp_context *ctx)
{
    rp_error err;
    int32_t part[64];
    int same = 1;
    for (size_t c = 0; c < sizeof kk_cases / sizeof *kk_cases; c++) {
        const kk_case *kc = &kk_cases[c];
        if (rp_partition_kk(ctx, kc->w, kc->n, kc->k, kc->equal, NULL, part, &err) != RP_OK ||
            memcmp(part, kc->verl, (size_t)kc->n * 4)) {
            same = 0;
            diag("case %zu differs from verl", c);
        }
    }
    ok(same, "kk reproduces verl's partitions on 12 cases (ties, equal sizes, workloads)");

    /* The textbook example: LDM leaves {4,5,7} | {6,8}, difference 2, optimum 0. */
    rp_partition_kk(ctx, kk_cases[0].w, 5, 2, false, NULL, part, &err);
    is_double(makespan(kk_cases[0].w, 5, 2, NULL, part), 16, 0, "kk on 4..8 gives 16 | 14, as the method does");
    /* Hand cases where it is optimal (checked by brute force). It is not always: on 1..9
     * in 3 parts it gives 16 against 15, as verl does. */
    rp_partition_kk(ctx, kk_cases[1].w, 9, 3, false, NULL, part, &err);
    is_double(makespan(kk_cases[1].w, 9, 3, NULL, part), 16, 0, "kk on 1..9 in 3 parts gives 16 (optimum 15)");
    struct { int32_t n, k; bool eq; double w[9]; double opt; } hand[] = {
        {8, 2, true, {8, 7, 6, 5, 4, 3, 2, 1}, 18},
        {6, 3, true, {5, 5, 5, 5, 5, 5}, 10},
        {6, 3, true, {1, 1, 1, 1, 9, 9}, 10},
        {5, 3, false, {8, 7, 6, 5, 4}, 11},
        {8, 4, false, {9, 8, 7, 6, 5, 4, 3, 2}, 11},
        {9, 3, false, {10, 10, 10, 7, 7, 7, 6, 6, 6}, 23},
    };
    for (size_t h = 0; h < sizeof hand / sizeof *hand; h++) {
        rp_partition_kk(ctx, hand[h].w, hand[h].n, hand[h].k, hand[h].eq, NULL, part, &err);
        is_double(makespan(hand[h].w, hand[h].n, hand[h].k, NULL, part), hand[h].opt, 0,
                  "kk optimal on hand case %zu (makespan %g)", h, hand[h].opt);
    }

    /* Random cases: valid partitions, equal sizes in equal_size mode; compared to LPT. */
    int valid = 1, equal_ok = 1, kk_better = 0, lpt_better = 0, cases = 0;
    double worst_vs_lpt = 1, worst_vs_opt = 1;
    for (int t = 0; t < 300; t++) {
        int32_t k = rnd_int(1, 3), n = rnd_int(1, 9);
        bool eq = t % 2;
        if (eq) n = k * rnd_int(1, 9 / k);
        double w[9];
        int32_t lp[9];
        for (int32_t i = 0; i < n; i++) w[i] = (double)rnd_int(0, 100);
        if (rp_partition_kk(ctx, w, n, k, eq, NULL, part, &err) != RP_OK || !valid_partition(part, n, k)) {
            valid = 0;
            continue;
        }
        if (eq) {
            int32_t cnt[3] = {0};
            for (int32_t i = 0; i < n; i++) cnt[part[i]]++;
            for (int32_t p = 0; p < k; p++)
                if (cnt[p] != n / k) equal_ok = 0;
            continue;
        }
        cases++;
        rp_partition_lpt(ctx, w, n, k, NULL, lp, NULL);
        double a = makespan(w, n, k, NULL, part), b = makespan(w, n, k, NULL, lp);
        double opt = brute_makespan(w, n, k, NULL);
        kk_better += a < b;
        lpt_better += b < a;
        if (b > 0 && a / b > worst_vs_lpt) worst_vs_lpt = a / b;
        if (opt > 0 && a / opt > worst_vs_opt) worst_vs_opt = a / opt;
    }
    ok(valid, "kk gives valid partitions on 300 random cases");
    ok(equal_ok, "kk equal_size gives every part n/k items");
    diag("kk vs lpt on %d random cases: kk better %d, lpt better %d, worst kk/lpt %.3f, worst kk/opt %.3f",
         cases, kk_better, lpt_better, worst_vs_lpt, worst_vs_opt);

    /* Repair of the item limit: KK puts 9 alone and the nine 1s together. */
    double w10[10] = {9, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    rp_partition_kk(ctx, w10, 10, 2, false, NULL, part, &err);
    int c0 = 0;
    for (int i = 0; i < 10; i++) c0 += part[i] == part[0];
    is_int(c0, 1, "kk without limits: item 0 alone (9 | 1x9)");
    rp_part_limits six = {.max_items = 6};
    is_int(rp_partition_kk(ctx, w10, 10, 2, false, &six, part, &err), RP_OK, "kk with an item limit of 6");
    int32_t cnt[2] = {0};
    for (int i = 0; i < 10; i++) cnt[part[i]]++;
    ok(cnt[0] <= 6 && cnt[1] <= 6, "repair keeps both parts within 6 items (%d, %d)", cnt[0], cnt[1]);

    /* Repair of a size cap in the default mode, on random cases. */
    int cap_ok = 1, cap_cases = 0, cap_fail = 0;
    for (int t = 0; t < 300; t++) {
        int32_t k = rnd_int(2, 4), n = rnd_int(2, 30);
        double w[30], s[30], total = 0, mx = 0;
        for (int32_t i = 0; i < n; i++) {
            w[i] = (double)rnd_int(0, 1000);
            s[i] = (double)rnd_int(1, 100);
            total += s[i];
            if (s[i] > mx) mx = s[i];
        }
        double capv = fmax(mx, total / k * (1.05 + (t % 5) * 0.1));
        rp_part_limits l = {.size = s, .size_cap = capv};
        rp_status st = rp_partition_kk(ctx, w, n, k, false, &l, part, &err);
        if (st == RP_ERANGE) {
            cap_fail++;
            continue;
        }
        cap_cases++;
        double ps[4] = {0};
        for (int32_t i = 0; i < n; i++) ps[part[i]] += s[i];
        for (int32_t p = 0; p < k; p++)
            if (ps[p] > capv) cap_ok = 0;
    }
    ok(cap_ok, "kk repair keeps every part within its size cap (%d cases)", cap_cases);
    diag("kk repair failed (RP_ERANGE) in %d of 300 capped cases", cap_fail);

    /* Equal-size repair by swaps: KK pairs items 0 and 2 (sizes 5+5 > 6). */
    double we[4] = {10, 9, 1, 1}, se[4] = {5, 1, 5, 1};
    rp_partition_kk(ctx, we, 4, 2, true, NULL, part, &err);
    ok(part[0] == part[2], "kk equal_size without caps pairs items 0 and 2");
    rp_part_limits c6 = {.size = se, .size_cap = 6};
    is_int(rp_partition_kk(ctx, we, 4, 2, true, &c6, part, &err), RP_OK, "kk equal_size with a size cap");
    ok(part[0] == part[3] && part[1] == part[2] && part[0] != part[1],
       "swap repair: item 0 traded item 2 for item 1 (closest weight), parts keep 2 items");
    int eq_cap_ok = 1;
    for (int t = 0; t < 200; t++) {
        int32_t k = rnd_int(2, 4), n = k * rnd_int(1, 8);
        double w[32], s[32], total = 0, mx = 0;
        for (int32_t i = 0; i < n; i++) {
            w[i] = (double)rnd_int(0, 1000);
            s[i] = (double)rnd_int(1, 100);
            total += s[i];
            if (s[i] > mx) mx = s[i];
        }
        rp_part_limits l = {.size = s, .size_cap = fmax(mx, total / k * 1.1)};
        if (rp_partition_kk(ctx, w, n, k, true, &l, part, &err) != RP_OK) continue;
        double ps[4] = {0};
        int32_t pc[4] = {0};
        for (int32_t i = 0; i < n; i++) ps[part[i]] += s[i], pc[part[i]]++;
        for (int32_t p = 0; p < k; p++)
            if (ps[p] > l.size_cap || pc[p] != n / k) eq_cap_ok = 0;
    }
    ok(eq_cap_ok, "kk equal_size repair keeps n/k items per part and every part within its cap");

    /* Bad input. */
    int32_t keep[5] = {4, 4, 4, 4, 4};
    is_int(rp_partition_kk(ctx, kk_cases[0].w, 5, 2, true, NULL, keep, &err), RP_EINVAL,
           "kk equal_size with n not divisible by k");
    like(err.text, "equal_size needs the 5 items to divide into 2 parts", "divisibility message");
    ok(keep[0] == 4 && keep[4] == 4, "part untouched");
    double speed[2] = {1, 1};
    rp_part_limits sp = {.speed = speed};
    is_int(rp_partition_kk(ctx, kk_cases[0].w, 5, 2, false, &sp, part, &err), RP_EINVAL, "kk rejects speeds");
    like(err.text, "speeds are not supported", "speeds message");
    double nanw[2] = {NAN, 1};
    is_int(rp_partition_kk(ctx, nanw, 2, 2, false, NULL, part, &err), RP_EINVAL, "kk rejects NaN");
    like(err.text, "kk: item 0 has weight nan", "kk NaN names the item");
    is_int(rp_partition_kk(ctx, nanw, 2, 0, false, NULL, part, &err), RP_EINVAL, "kk rejects k = 0");
    rp_part_limits lim1 = {.max_items = 1};
    is_int(rp_partition_kk(ctx, kk_cases[2].w, 8, 2, true, &lim1, part, &err), RP_ERANGE,
           "kk equal_size over the item limit");
    /* A cap the repair cannot meet although the total fits: sizes 6,6,6 | caps 9,9. */
    double w3[3] = {1, 2, 3}, s3[3] = {6, 6, 6};
    rp_part_limits c9 = {.size = s3, .size_cap = 9};
    is_int(rp_partition_kk(ctx, w3, 3, 2, false, &c9, keep, &err), RP_ERANGE, "kk repair that cannot succeed");
    like(err.text, "fits in no other part", "repair failure names the stuck item");
    ok(err.sequence >= 0 && err.sequence < 3, "repair failure carries the item");
    is_int(rp_partition_kk(ctx, w3, 0, 3, false, NULL, NULL, &err), RP_OK, "kk of no items");
    is_int(rp_partition_kk(ctx, w3, 2, 3, false, NULL, part, &err), RP_OK, "kk with fewer items than parts");
    ok(part[0] != part[1], "two items in three parts go apart");
}

/* ---- two criteria ---- */

static void test_two_criteria(rp_context *ctx)
{
    rp_error err;
    /* One long sequence (L = 2000) and 40 short ones (L = 316): attention ~ L^2, tokens L. */
    enum { N = 41 };
    double att[N], tok[N];
    att[0] = 2000.0 * 2000.0;
    tok[0] = 2000;
    for (int i = 1; i < N; i++) att[i] = 316.0 * 316.0, tok[i] = 316;
    int32_t part[N], p_att[N], p_tok[N];
    double obj, o_att, o_tok;
    is_int(rp_partition_two_criteria(ctx, att, tok, N, 2, NULL, 100, part, &obj, &err), RP_OK,
           "two-criteria on a long-tail batch");
    rp_partition_lpt(ctx, att, N, 2, NULL, p_att, NULL);
    rp_partition_lpt(ctx, tok, N, 2, NULL, p_tok, NULL);
    rp_partition_objective2(ctx, att, tok, N, 2, NULL, p_att, &o_att, &err);
    rp_partition_objective2(ctx, att, tok, N, 2, NULL, p_tok, &o_tok, &err);
    ok(obj < o_att && obj < o_tok, "two-criteria %.3f beats LPT on attention %.3f and on tokens %.3f", obj,
       o_att, o_tok);
    double check;
    rp_partition_objective2(ctx, att, tok, N, 2, NULL, part, &check, &err);
    is_double(obj, check, 0, "reported objective equals rp_partition_objective2 of the result");

    /* Within a token cap: the cap binds, and is respected. */
    rp_part_limits cap = {.size = tok, .size_cap = 7400};
    is_int(rp_partition_two_criteria(ctx, att, tok, N, 2, &cap, 100, part, &obj, &err), RP_OK,
           "two-criteria with a token cap of 7400");
    double t0 = 0, t1 = 0;
    for (int i = 0; i < N; i++) *(part[i] ? &t1 : &t0) += tok[i];
    ok(t0 <= 7400 && t1 <= 7400, "token cap respected (%g, %g)", t0, t1);

    /* Random: never over the cap; search never worse than greedy; near brute force. */
    int caps_ok = 1, improve_ok = 1, cases = 0;
    double worst = 1;
    for (int t = 0; t < 300; t++) {
        int32_t n = rnd_int(1, 9), k = rnd_int(1, 3);
        double a[9], b[9], total = 0, mx = 0;
        int32_t pg[9];
        for (int32_t i = 0; i < n; i++) {
            double L = (double)rnd_int(1, 100);
            b[i] = L;
            a[i] = L * L;
            total += L;
            if (L > mx) mx = L;
        }
        rp_part_limits l = {.size = b, .size_cap = fmax(mx, total / k * 1.3)};
        double og, os;
        if (rp_partition_two_criteria(ctx, a, b, n, k, &l, 0, pg, &og, NULL) != RP_OK) continue;
        if (rp_partition_two_criteria(ctx, a, b, n, k, &l, 50, part, &os, NULL) != RP_OK) {
            improve_ok = 0;
            continue;
        }
        cases++;
        if (os > og * (1 + 1e-12)) improve_ok = 0;
        double ps[3] = {0};
        for (int32_t i = 0; i < n; i++) ps[part[i]] += b[i];
        for (int32_t p = 0; p < k; p++)
            if (ps[p] > l.size_cap) caps_ok = 0;
        /* brute force of the objective under the cap */
        int32_t q[9] = {0};
        double best = INFINITY;
        for (;;) {
            double s2[3] = {0};
            for (int32_t i = 0; i < n; i++) s2[q[i]] += b[i];
            bool fit = true;
            for (int32_t p = 0; p < k; p++) fit = fit && s2[p] <= l.size_cap;
            double o;
            if (fit && rp_partition_objective2(ctx, a, b, n, k, NULL, q, &o, NULL) == RP_OK && o < best) best = o;
            int32_t i = 0;
            while (i < n && ++q[i] == k) q[i++] = 0;
            if (i == n) break;
        }
        if (os / best > worst) worst = os / best;
    }
    ok(caps_ok, "two-criteria never exceeds the token cap (%d random cases)", cases);
    ok(improve_ok, "improvement rounds never make the greedy result worse");
    diag("two-criteria worst ratio to the brute-force optimum: %.4f", worst);
    ok(worst < 1.5, "two-criteria within 1.5 of the optimum on small cases");

    /* Bad input. */
    double nanw[2] = {1, NAN};
    int32_t keep[2] = {5, 5};
    is_int(rp_partition_two_criteria(ctx, att, nanw, 2, 2, NULL, 1, keep, &obj, &err), RP_EINVAL,
           "two-criteria rejects a NaN w2");
    like(err.text, "item 1 has w2 nan", "names the item and the weight");
    ok(keep[0] == 5 && keep[1] == 5, "part untouched");
    is_int(rp_partition_two_criteria(ctx, att, tok, N, 2, NULL, -1, part, &obj, &err), RP_EINVAL,
           "two-criteria rejects max_rounds < 0");
    is_int(rp_partition_two_criteria(ctx, att, tok, N, 0, NULL, 1, part, &obj, &err), RP_EINVAL,
           "two-criteria rejects k = 0");
    rp_part_limits tight = {.size = tok, .size_cap = 1000};
    is_int(rp_partition_two_criteria(ctx, att, tok, N, 2, &tight, 1, part, &obj, &err), RP_ERANGE,
           "two-criteria with the long sequence over the cap");
    like(err.text, "item 0 has size 2000, over every part's cap", "names the long sequence");
    int32_t badpart[2] = {0, 2};
    is_int(rp_partition_objective2(ctx, att, tok, 2, 2, NULL, badpart, &obj, &err), RP_EINVAL,
           "objective2 rejects a part out of range");
    like(err.text, "item 1 is in part 2, outside [0, 2)", "part out of range message");
}

/* ---- replicas ---- */

/* Brute force: the least max load/count over all counts >= 1 (<= cap) summing to S. */
static double brute_apportion(const double *load, int32_t E, int32_t S, int32_t cap, int32_t e, int32_t left,
                              int32_t *c)
{
    if (e == E) {
        if (left != 0) return INFINITY;
        double m = 0;
        for (int32_t i = 0; i < E; i++) m = fmax(m, load[i] / c[i]);
        return m;
    }
    double best = INFINITY;
    for (int32_t x = 1; x <= left - (E - e - 1) && (!cap || x <= cap); x++) {
        c[e] = x;
        best = fmin(best, brute_apportion(load, E, S, cap, e + 1, left - x, c));
    }
    return best;
}

static void test_apportion(rp_context *ctx)
{
    rp_error err;
    double load[4] = {90, 30, 60, 0};
    int32_t counts[4];
    is_int(rp_replicas_apportion(ctx, load, 4, 8, 0, counts, &err), RP_OK, "apportion 8 slots over 4 experts");
    /* 1,1,1,1 -> 90/1 -> e0:2 -> 60/1 -> e2:2 -> 45 -> e0:3 -> 30,30 (e1 1 rep vs e2 2) -> e1:2 */
    ok(counts[0] == 3 && counts[1] == 2 && counts[2] == 2 && counts[3] == 1, "apportion hand case 3,2,2,1");
    double zero[3] = {0, 0, 0};
    is_int(rp_replicas_apportion(ctx, zero, 3, 7, 0, counts, &err), RP_OK, "apportion of all-zero loads");
    ok(counts[0] == 3 && counts[1] == 2 && counts[2] == 2, "zero loads spread round-robin (3,2,2)");
    is_int(rp_replicas_apportion(ctx, load, 4, 8, 2, counts, &err), RP_OK, "apportion with max 2 replicas");
    ok(counts[0] == 2 && counts[1] == 2 && counts[2] == 2 && counts[3] == 2, "the limit holds (2,2,2,2)");

    int optimal = 1, capped_ok = 1, cases = 0;
    for (int t = 0; t < 500; t++) {
        int32_t E = rnd_int(1, 5), S = E + rnd_int(0, 6), cap = t % 3 ? 0 : rnd_int(1, 4);
        if (cap && (int64_t)cap * E < S) cap = 0;
        double l[5];
        int32_t c[5], cb[5];
        for (int32_t e = 0; e < E; e++) l[e] = t % 4 ? (double)rnd_int(0, 1000) : (double)rnd_int(0, 3);
        if (rp_replicas_apportion(ctx, l, E, S, cap, c, &err) != RP_OK) {
            optimal = 0;
            continue;
        }
        cases++;
        double got = 0;
        int32_t sum = 0;
        for (int32_t e = 0; e < E; e++) {
            got = fmax(got, l[e] / c[e]);
            sum += c[e];
            if (c[e] < 1 || (cap && c[e] > cap)) capped_ok = 0;
        }
        if (sum != S) capped_ok = 0;
        if (got != brute_apportion(l, E, S, cap, 0, S, cb)) optimal = 0;
    }
    ok(optimal, "apportionment equals the brute-force optimum of max load/count (%d cases)", cases);
    ok(capped_ok, "counts sum to S, each >= 1 and within the limit");

    int32_t keep[4] = {8, 8, 8, 8};
    is_int(rp_replicas_apportion(ctx, load, 4, 3, 0, keep, &err), RP_ERANGE, "apportion with S < E");
    like(err.text, "3 slots for 4 experts", "S < E message");
    ok(keep[0] == 8 && keep[3] == 8, "counts untouched");
    double bad[2] = {1, -2};
    is_int(rp_replicas_apportion(ctx, bad, 2, 4, 0, counts, &err), RP_EINVAL, "apportion rejects negative loads");
    like(err.text, "expert 1 has load -2", "names the expert");
    is_int(err.expert, 1, "error carries the expert");
    double nanl[2] = {NAN, 1};
    is_int(rp_replicas_apportion(ctx, nanl, 2, 4, 0, counts, &err), RP_EINVAL, "apportion rejects NaN");
    is_int(rp_replicas_apportion(ctx, load, 4, 9, 2, counts, &err), RP_ERANGE, "apportion over E * max");
    like(err.text, "9 slots but 4 experts with at most 2 replicas each hold only 8", "limit message");
    is_int(rp_replicas_apportion(ctx, load, 0, 4, 0, counts, &err), RP_EINVAL, "apportion with no experts");
    is_int(rp_replicas_apportion(ctx, load, 4, 8, -1, counts, &err), RP_EINVAL, "apportion with max < 0");
}

/* ---- placement ---- */

/* Check the placement invariants; returns false and says why. */
static bool placement_ok(const rp_place_input *in, const int32_t *begin, const int32_t *phy2log,
                         const int32_t *counts, const char **why)
{
    int32_t seen[64] = {0};
    for (int32_t g = 0; g < in->num_gpus; g++) {
        if (begin[g + 1] - begin[g] != in->slots[g]) return *why = "slot counts", false;
        bool tail = false;
        for (int32_t s = begin[g]; s < begin[g + 1]; s++) {
            int32_t e = phy2log[s];
            if (e == -1) {
                tail = true;
                continue;
            }
            if (tail) return *why = "an expert after an empty slot", false;
            if (e < 0 || e >= in->num_experts) return *why = "expert id out of range", false;
            for (int32_t s2 = begin[g]; s2 < s; s2++)
                if (phy2log[s2] == e) return *why = "two replicas of one expert on a GPU", false;
            seen[e]++;
        }
    }
    for (int32_t e = 0; e < in->num_experts; e++) {
        if (seen[e] < 1) return *why = "an expert without a replica", false;
        if (seen[e] != counts[e]) return *why = "counts do not match phy2log", false;
        if (in->replicas && counts[e] != in->replicas[e]) return *why = "given counts not kept", false;
    }
    return true;
}

static double max_gpu_load(rp_context *ctx, const rp_place_input *in, const int32_t *begin,
                           const int32_t *phy2log)
{
    double gl[16];
    rp_place_gpu_loads(ctx, in->load, in->num_experts, in->num_gpus, begin, phy2log, in->speed, gl, NULL);
    double m = 0;
    for (int32_t g = 0; g < in->num_gpus; g++) m = fmax(m, gl[g]);
    return m;
}

/* Brute force: each expert's replicas on a subset of GPUs (one each), slots respected. */
static void brute_place(const rp_place_input *in, int32_t e, int32_t *used, double *gl, double *best)
{
    if (e == in->num_experts) {
        double m = 0;
        for (int32_t g = 0; g < in->num_gpus; g++) m = fmax(m, gl[g] / (in->speed ? in->speed[g] : 1));
        if (m < *best) *best = m;
        return;
    }
    int32_t G = in->num_gpus, c = in->replicas[e];
    double w = in->load[e] / c;
    for (int32_t mask = 0; mask < (1 << G); mask++) {
        if (__builtin_popcount((unsigned)mask) != c) continue;
        bool fit = true;
        for (int32_t g = 0; g < G; g++)
            if ((mask >> g & 1) && used[g] >= in->slots[g]) fit = false;
        if (!fit) continue;
        for (int32_t g = 0; g < G; g++)
            if (mask >> g & 1) used[g]++, gl[g] += w;
        brute_place(in, e + 1, used, gl, best);
        for (int32_t g = 0; g < G; g++)
            if (mask >> g & 1) used[g]--, gl[g] -= w;
    }
}

static void test_place(rp_context *ctx)
{
    rp_error err;
    int32_t begin[17], phy[128], counts[64];
    const char *why = "";

    /* EPLB-like: 8 experts, 4 GPUs of 3 slots, global with apportionment. */
    double load8[8] = {100, 10, 10, 10, 40, 40, 5, 5};
    int32_t slots4[4] = {3, 3, 3, 3};
    rp_place_input in = {.num_experts = 8, .load = load8, .num_gpus = 4, .slots = slots4, .mode = RP_PLACE_GLOBAL};
    is_int(rp_place_replicas(ctx, &in, begin, phy, counts, &err), RP_OK, "global placement with apportionment");
    ok(placement_ok(&in, begin, phy, counts, &why), "global placement is valid (%s)", why);
    is_int(counts[0], 3, "the hot expert gets 3 replicas (100/3 > 40/2)");
    is_int(begin[4], 12, "slot_begin ends at the total slot count");
    double gl[4];
    rp_place_gpu_loads(ctx, load8, 8, 4, begin, phy, NULL, gl, &err);
    double mx = 0, sum = 0;
    for (int g = 0; g < 4; g++) mx = fmax(mx, gl[g]), sum += gl[g];
    is_double(sum, 220, 1e-9, "GPU loads add up to the total load");
    ok(mx <= 60, "max GPU load %g close to the mean 55", mx);

    /* The repair: slots {1,3}; X fills GPU 0, A's second replica has nowhere to go. */
    double lr[3] = {10, 2, 0.5};
    int32_t cr[3] = {1, 2, 1}, sr[2] = {1, 3};
    rp_place_input rin = {.num_experts = 3, .load = lr, .replicas = cr, .num_gpus = 2, .slots = sr,
                          .mode = RP_PLACE_GLOBAL};
    is_int(rp_place_replicas(ctx, &rin, begin, phy, counts, &err), RP_OK, "placement that needs the repair");
    ok(placement_ok(&rin, begin, phy, counts, &why), "repaired placement is valid (%s)", why);
    ok(phy[0] == 1, "expert 1 took expert 0's slot on GPU 0; expert 0 moved to GPU 1");
    /* Counts that fit the slots in total but cannot be placed: expert 0 needs all three
     * GPUs, leaving expert 1 only GPU 0. */
    int32_t c_inf[2] = {3, 2}, s_inf[3] = {3, 1, 1};
    double l_inf[2] = {1, 1};
    rp_place_input iin = {.num_experts = 2, .load = l_inf, .replicas = c_inf, .num_gpus = 3, .slots = s_inf,
                          .mode = RP_PLACE_GLOBAL};
    is_int(rp_place_replicas(ctx, &iin, begin, phy, counts, &err), RP_ERANGE, "counts that cannot be placed");
    like(err.text, "cannot place a replica of expert", "says which replica found no GPU");
    ok(err.expert == 0 || err.expert == 1, "carries the expert");

    /* Hierarchical: 16 experts in 4 groups, 2 nodes of 2 GPUs, uneven slots. */
    double load16[16];
    for (int e = 0; e < 16; e++) load16[e] = (double)((e * 37) % 23 + (e < 4 ? 40 : 0));
    int32_t slots_h[4] = {6, 5, 5, 6};
    rp_place_input hin = {.num_experts = 16, .load = load16, .num_gpus = 4, .slots = slots_h,
                          .mode = RP_PLACE_HIERARCHICAL, .gpus_per_node = 2, .num_groups = 4};
    is_int(rp_place_replicas(ctx, &hin, begin, phy, counts, &err), RP_OK, "hierarchical placement");
    ok(placement_ok(&hin, begin, phy, counts, &why), "hierarchical placement is valid (%s)", why);
    int32_t node_of[16];
    for (int e = 0; e < 16; e++) node_of[e] = -1;
    bool inside = true;
    for (int g = 0; g < 4; g++)
        for (int s = begin[g]; s < begin[g + 1]; s++) {
            int e = phy[s];
            if (e < 0) continue;
            int grp_node = node_of[(e / 4) * 4];
            if (grp_node >= 0 && grp_node != g / 2) inside = false;
            if (node_of[e] >= 0 && node_of[e] != g / 2) inside = false;
            node_of[e] = node_of[(e / 4) * 4] = g / 2;
        }
    ok(inside, "every expert group stays inside one node");
    int filled = 0;
    for (int s = 0; s < 22; s++) filled += phy[s] >= 0;
    is_int(filled, 22, "hierarchical apportionment fills every slot");

    /* Random cases: validity, brute force within a factor, greedy alone and improved. */
    int valid = 1, within = 1, improved_ok = 1, cases = 0;
    double worst = 1, worst_improved = 1;
    for (int t = 0; t < 600; t++) {
        int32_t G = rnd_int(1, 3), E = rnd_int(1, 4);
        int32_t sl[3], cnt[4];
        double ld[4], sp[3];
        int32_t total = 0;
        for (int32_t g = 0; g < G; g++) sl[g] = rnd_int(1, 3), total += sl[g], sp[g] = rnd_int(1, 3) * 0.5;
        if (total < E) continue;
        int32_t left = total;
        for (int32_t e = 0; e < E; e++) {
            ld[e] = (double)rnd_int(0, 100);
            cnt[e] = 1;
            left--;
        }
        for (int32_t e = 0; e < E && left > 0; e++) {
            int32_t extra = rnd_int(0, G - 1 < left ? G - 1 : left);
            cnt[e] += extra;
            left -= extra;
        }
        rp_place_input r = {.num_experts = E, .load = ld, .replicas = cnt, .num_gpus = G, .slots = sl,
                            .speed = t % 2 ? sp : NULL, .mode = RP_PLACE_GLOBAL};
        double best = INFINITY, glb[3] = {0};
        int32_t used[3] = {0};
        brute_place(&r, 0, used, glb, &best);
        if (best == INFINITY) continue; /* counts that cannot be placed at all */
        rp_status st = rp_place_replicas(ctx, &r, begin, phy, counts, &err);
        if (st != RP_OK || !placement_ok(&r, begin, phy, counts, &why)) {
            valid = 0;
            diag("case %d: %s %s", t, rp_strerror(st), st ? err.text : why);
            continue;
        }
        double got = max_gpu_load(ctx, &r, begin, phy);
        r.improve_rounds = 20;
        st = rp_place_replicas(ctx, &r, begin, phy, counts, &err);
        if (st != RP_OK || !placement_ok(&r, begin, phy, counts, &why)) {
            valid = 0;
            continue;
        }
        double imp = max_gpu_load(ctx, &r, begin, phy);
        cases++;
        if (imp > got * (1 + 1e-12)) improved_ok = 0;
        if (best > 0 && got / best > worst) worst = got / best;
        if (best > 0 && imp / best > worst_improved) worst_improved = imp / best;
        if (got > 3 * best * (1 + 1e-12)) within = 0;
    }
    ok(valid, "placement valid whenever brute force finds one (uneven slots, speeds; %d cases)", cases);
    ok(within, "greedy placement (EPLB's rule) within 3 of brute force");
    ok(improved_ok, "improvement rounds never raise the max GPU load");
    ok(worst_improved <= 1.25, "improved placement within 1.25 of brute force, speeds included");
    diag("placement worst ratio to brute force: greedy %.4f, with 20 improvement rounds %.4f", worst,
         worst_improved);

    int hier_ok = 1;
    for (int t = 0; t < 100; t++) {
        int32_t nodes = rnd_int(1, 3), gpn = rnd_int(1, 3), G = nodes * gpn;
        int32_t groups = nodes * rnd_int(1, 3), gs = rnd_int(1, 3), E = groups * gs;
        double ld[64];
        int32_t sl[9];
        for (int32_t e = 0; e < E; e++) ld[e] = (double)rnd_int(0, 1000);
        /* enough slots in every node for its groups' experts */
        int32_t need = (groups / nodes) * gs;
        for (int32_t g = 0; g < G; g++) sl[g] = (need + gpn - 1) / gpn + rnd_int(0, 2);
        rp_place_input h = {.num_experts = E, .load = ld, .num_gpus = G, .slots = sl,
                            .mode = RP_PLACE_HIERARCHICAL, .gpus_per_node = gpn, .num_groups = groups};
        rp_status st = rp_place_replicas(ctx, &h, begin, phy, counts, &err);
        if (st != RP_OK || !placement_ok(&h, begin, phy, counts, &why)) {
            hier_ok = 0;
            diag("hier case %d: %s %s", t, rp_strerror(st), st ? err.text : why);
            continue;
        }
        int32_t gnode[64];
        for (int32_t q = 0; q < groups; q++) gnode[q] = -1;
        for (int32_t g = 0; g < G; g++)
            for (int32_t s = begin[g]; s < begin[g + 1]; s++) {
                if (phy[s] < 0) continue;
                int32_t q = phy[s] / gs;
                if (gnode[q] >= 0 && gnode[q] != g / gpn) hier_ok = 0;
                gnode[q] = g / gpn;
            }
    }
    ok(hier_ok, "hierarchical: valid and every group inside one node on 100 random shapes");

    /* Bad input. */
    int32_t too_many[3] = {3, 1, 1};
    rp_place_input b = rin;
    b.replicas = too_many;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_ERANGE, "more replicas of an expert than GPUs");
    like(err.text, "expert 0 has 3 replicas but only 2 GPUs can hold it", "names the expert");
    is_int(err.expert, 0, "carries the expert");
    int32_t over[3] = {2, 2, 2}, small_slots[2] = {2, 2};
    b.replicas = over;
    b.slots = small_slots;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_ERANGE, "more replicas than slots");
    like(err.text, "6 replicas but only 4 slots", "replicas over slots message");
    int32_t zero_rep[3] = {1, 0, 1};
    b.replicas = zero_rep;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "an expert with 0 replicas");
    like(err.text, "expert 1 has 0 replicas", "zero replicas message");
    b = in;
    int32_t tiny[4] = {1, 1, 1, 1};
    b.slots = tiny;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_ERANGE, "fewer slots than experts");
    like(err.text, "8 experts but only 4 slots", "slots < experts message");
    b = hin;
    b.num_groups = 3;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "groups not dividing experts");
    b.num_groups = 1;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "nodes not dividing groups");
    like(err.text, "2 nodes do not divide the 1 expert groups; use the global mode", "names the fix");
    b.num_groups = 4;
    b.gpus_per_node = 3;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "GPUs per node not dividing GPUs");
    double nanl[8] = {1, 1, 1, NAN, 1, 1, 1, 1};
    b = in;
    b.load = nanl;
    int32_t keep_phy[12];
    for (int i = 0; i < 12; i++) keep_phy[i] = 77;
    is_int(rp_place_replicas(ctx, &b, begin, keep_phy, counts, &err), RP_EINVAL, "NaN load");
    like(err.text, "expert 3 has load nan", "NaN load names the expert");
    ok(keep_phy[0] == 77 && keep_phy[11] == 77, "phy2log untouched on error");
    b = in;
    double badsp[4] = {1, -1, 1, 1};
    b.speed = badsp;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "negative speed");
    b = in;
    b.mode = (rp_place_mode)7;
    is_int(rp_place_replicas(ctx, &b, begin, phy, counts, &err), RP_EINVAL, "unknown mode");
    int32_t hole[2] = {0, -1};
    int32_t hb[3] = {0, 1, 2};
    double l2[2] = {1, 1};
    is_int(rp_place_gpu_loads(ctx, l2, 2, 2, hb, hole, NULL, gl, &err), RP_EINVAL, "gpu loads: expert without replica");
    like(err.text, "expert 1 has load 1 but no replica", "names the expert");
    int32_t bad_id[2] = {0, 5};
    is_int(rp_place_gpu_loads(ctx, l2, 2, 2, hb, bad_id, NULL, gl, &err), RP_EINVAL, "gpu loads: id out of range");
}

/* ---- determinism, allocation failures, work bounds ---- */

static void test_determinism(rp_context *ctx)
{
    enum { N = 500 };
    static double w[N], s[N], w2[N];
    static int32_t a[N], b[N];
    for (int i = 0; i < N; i++) {
        w[i] = (double)rnd_int(0, 50); /* many ties */
        w2[i] = (double)rnd_int(0, 50);
        s[i] = (double)rnd_int(1, 10);
    }
    rp_part_limits lim = {.size = s, .size_cap = 200, .max_items = 40};
    int same = 1;
    for (int rep = 0; rep < 3; rep++) {
        rp_partition_lpt(ctx, w, N, 16, &lim, a, NULL);
        rp_partition_lpt(ctx, w, N, 16, &lim, b, NULL);
        same &= !memcmp(a, b, sizeof a);
        rp_partition_kk(ctx, w, N, 20, true, NULL, a, NULL);
        rp_partition_kk(ctx, w, N, 20, true, NULL, b, NULL);
        same &= !memcmp(a, b, sizeof a);
        rp_partition_kk(ctx, w, N, 16, false, &lim, a, NULL);
        rp_partition_kk(ctx, w, N, 16, false, &lim, b, NULL);
        same &= !memcmp(a, b, sizeof a);
        rp_partition_two_criteria(ctx, w, w2, N, 16, &lim, 20, a, NULL, NULL);
        rp_partition_two_criteria(ctx, w, w2, N, 16, &lim, 20, b, NULL, NULL);
        same &= !memcmp(a, b, sizeof a);
    }
    ok(same, "partitions repeat exactly across calls (ties everywhere)");

    int32_t slots[8] = {5, 5, 5, 5, 4, 6, 5, 5}, b1[9], b2[9], p1[40], p2[40];
    rp_place_input in = {.num_experts = 32, .load = w, .num_gpus = 8, .slots = slots,
                         .mode = RP_PLACE_HIERARCHICAL, .gpus_per_node = 4, .num_groups = 4};
    rp_place_replicas(ctx, &in, b1, p1, NULL, NULL);
    rp_place_replicas(ctx, &in, b2, p2, NULL, NULL);
    ok(!memcmp(p1, p2, sizeof p1), "placement repeats exactly across calls");
}

/* Fail each allocation in turn: every call must fail with RP_ENOMEM, leak nothing and
 * leave its output alone. */
static void test_alloc_failures(void)
{
    enum { N = 60 };
    double w[N], s[N];
    for (int i = 0; i < N; i++) w[i] = (double)(i * 7 % 13), s[i] = 1 + i % 3;
    int32_t slots[4] = {5, 5, 5, 5};
    rp_part_limits lim = {.size = s, .size_cap = 40};
    const char *names[] = {"sort", "lpt", "kk", "kk with repair", "two-criteria", "apportion", "place"};
    for (int f = 0; f < 7; f++) {
        bool clean = true, succeeded = false;
        for (long n = 1; n < 200 && !succeeded; n++) {
            counting c = {0};
            rp_context *ctx;
            rp_context_new(counting_alloc, &c, &ctx);
            long base = c.live;
            c.fail_at = c.calls + n;
            int32_t out[N + 40], begin[5];
            for (int i = 0; i < N + 40; i++) out[i] = -7;
            rp_status st = RP_OK;
            switch (f) {
            case 0: st = rp_sort_index(ctx, w, N, true, out, NULL); break;
            case 1: st = rp_partition_lpt(ctx, w, N, 4, &lim, out, NULL); break;
            case 2: st = rp_partition_kk(ctx, w, N, 4, false, NULL, out, NULL); break;
            case 3: st = rp_partition_kk(ctx, w, N, 4, false, &lim, out, NULL); break;
            case 4: st = rp_partition_two_criteria(ctx, w, s, N, 4, &lim, 5, out, NULL, NULL); break;
            case 5: st = rp_replicas_apportion(ctx, w, 8, 20, 0, out, NULL); break;
            default: {
                rp_place_input in = {.num_experts = 16, .load = w, .num_gpus = 4, .slots = slots,
                                     .mode = RP_PLACE_HIERARCHICAL, .gpus_per_node = 2, .num_groups = 4};
                st = rp_place_replicas(ctx, &in, begin, out, NULL, NULL);
            }
            }
            if (st == RP_OK) succeeded = true;
            else if (st != RP_ENOMEM || out[0] != -7) clean = false;
            if (c.live != base) clean = false;
            rp_context_free(ctx);
        }
        ok(clean && succeeded, "%s fails cleanly at every allocation and leaks nothing", names[f]);
    }
}

static void test_work_bounds(void)
{
    counting c = {0};
    rp_context *ctx;
    rp_context_new(counting_alloc, &c, &ctx);
    const int32_t n = 1 << 17, k = 64;
    double *w = malloc((size_t)n * sizeof *w), *s = malloc((size_t)n * sizeof *s);
    int32_t *part = malloc((size_t)n * sizeof *part);
    for (int32_t i = 0; i < n; i++) w[i] = (double)rnd_int(1, 32768), s[i] = w[i];
    long base = c.live;

    c.peak = base;
    is_int(rp_partition_lpt(ctx, w, n, k, NULL, part, NULL), RP_OK, "lpt on 2^17 items, 64 parts");
    ok(c.peak - base <= 16L * n + 64L * k + 1024, "lpt scratch %ld bytes <= 16 n + 64 k", c.peak - base);
    double ms = makespan(w, n, k, NULL, part), total = 0, mxw = 0;
    for (int32_t i = 0; i < n; i++) total += w[i], mxw = fmax(mxw, w[i]);
    ok(ms <= total / k + mxw, "lpt makespan within mean + largest item");

    c.peak = base;
    rp_part_limits lim = {.size = s, .size_cap = total / k * 1.01};
    is_int(rp_partition_lpt(ctx, w, n, k, &lim, part, NULL), RP_OK, "lpt with a size cap on 2^17 items");

    c.peak = base;
    is_int(rp_partition_kk(ctx, w, n, k, false, NULL, part, NULL), RP_OK, "kk on 2^17 items, 64 parts");
    ok(c.peak - base <= 32L * n + 24L * k * 4096, "kk scratch %ld bytes: O(n) plus a few merged states",
       c.peak - base);
    c.peak = base;
    is_int(rp_partition_kk(ctx, w, n, k, true, NULL, part, NULL), RP_OK, "kk equal_size on 2^17 items");

    is_int(rp_sort_index(ctx, w, n, true, part, NULL), RP_OK, "argsort of 2^17 values");
    bool sorted = true;
    for (int32_t i = 1; i < n; i++)
        if (w[part[i - 1]] < w[part[i]]) sorted = false;
    ok(sorted, "argsort of 2^17 values is sorted");

    double *load = malloc(4096 * sizeof *load);
    int32_t *cnt = malloc(4096 * sizeof *cnt);
    for (int e = 0; e < 4096; e++) load[e] = w[e];
    is_int(rp_replicas_apportion(ctx, load, 4096, 4096 * 8, 64, cnt, NULL), RP_OK,
           "apportion 32768 slots over 4096 experts");
    free(load);
    free(cnt);
    free(w);
    free(s);
    free(part);
    rp_context_free(ctx);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_sort(ctx);
    test_lpt(ctx);
    test_kk(ctx);
    test_two_criteria(ctx);
    test_apportion(ctx);
    test_place(ctx);
    test_determinism(ctx);
    test_alloc_failures();
    test_work_bounds();
    rp_context_free(ctx);
    return tap_done();
}
