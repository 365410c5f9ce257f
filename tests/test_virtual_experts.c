/* The virtual-expert offload plan (core/virtual_experts.c) on hand-computed forwards,
 * its invariants on random ones, the config limits and bad input. */
#include "tap.h"
#include "test_util.h"

#include "routepack/virtual_experts.h"

static rp_context *ctx;

static rp_vexp *planner(int32_t ep, int32_t E)
{
    rp_vexp *v = NULL;
    rp_error err;
    if (rp_vexp_new(ctx, ep, E, &v, &err) != RP_OK) diag("rp_vexp_new: %s", err.text);
    return v;
}

static bool same64(const int64_t *got, const int64_t *want, int n)
{
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) {
            diag("index %d: got %lld, want %lld", i, (long long)got[i], (long long)want[i]);
            return false;
        }
    return true;
}

static bool same32(const int32_t *got, const int32_t *want, int n)
{
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) {
            diag("index %d: got %d, want %d", i, (int)got[i], (int)want[i]);
            return false;
        }
    return true;
}

/* Balanced: every rank's experts receive what the rank routes; nothing moves. */
static void test_balanced(void)
{
    rp_vexp *v = planner(2, 4);
    const int32_t counts[] = {1, 1, 1, 1, /* rank 0 */ 1, 1, 1, 1 /* rank 1 */};
    rp_error err;
    is_int(rp_vexp_plan(v, counts, NULL, &err), RP_OK, "balanced: plans");
    is_int(rp_vexp_num_virtual(v), 0, "balanced: no virtual expert");
    ok(same64(rp_vexp_rank_load(v), (int64_t[]){4, 4}, 2), "balanced: loads 4, 4");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){-1, -1, -1, -1}, 4), "balanced: slots empty");
    ok(same64(rp_vexp_traffic(v), (int64_t[]){2, 2, 2, 2}, 4), "balanced: each rank sends 2 to the other");
    ok(same32(rp_vexp_pushes_out(v), (int32_t[]){0, 0}, 2) && same32(rp_vexp_pushes_in(v), (int32_t[]){0, 0}, 2),
       "balanced: no weight push");
    rp_vexp_free(v);
}

/* One hot expert: every rank routes its 10 choices to expert 0 (rank 0's). Rank 0 is 30
 * over; ranks 1, 2, 3 (lowest first) each take their whole deficit of 10 from it, all of
 * expert 0. The choices of expert 0 ordered by source fill the destinations in rank
 * order, so every rank computes its own choices: no token leaves its GPU. */
static void test_one_hot_expert(void)
{
    rp_vexp *v = planner(4, 8);
    int32_t counts[32] = {0};
    for (int r = 0; r < 4; r++) counts[r * 8] = 10;
    rp_error err;
    is_int(rp_vexp_plan(v, counts, NULL, &err), RP_OK, "one hot expert: plans");
    ok(same64(rp_vexp_rank_load(v), (int64_t[]){10, 10, 10, 10}, 4), "one hot expert: every rank computes 10");
    int64_t alloc0[4];
    memcpy(alloc0, rp_vexp_allocation(v), sizeof alloc0);
    ok(same64(alloc0, (int64_t[]){10, 10, 10, 10}, 4), "one hot expert: expert 0 split 10 per rank");
    is_int(rp_vexp_num_virtual(v), 3, "one hot expert: three virtual experts");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){-1, -1, 0, -1, 0, -1, 0, -1}, 8),
       "one hot expert: expert 0 in slot 0 of ranks 1, 2, 3");
    ok(same32(rp_vexp_pushes_out(v), (int32_t[]){3, 0, 0, 0}, 4), "one hot expert: rank 0 pushes 3 copies");
    ok(same32(rp_vexp_pushes_in(v), (int32_t[]){0, 1, 1, 1}, 4), "one hot expert: ranks 1-3 receive one each");
    int64_t diag_only[16] = {0};
    for (int r = 0; r < 4; r++) diag_only[r * 4 + r] = 10;
    ok(same64(rp_vexp_traffic(v), diag_only, 16), "one hot expert: every choice computed on its own GPU");
    rp_vexp_free(v);
}

/* Several overloaded ranks, one expert each (ep 4, E 4). Every rank routes 10:
 *   rank 0 [7,3,0,0], ranks 1-3 [6,4,0,0]  ->  expert totals [25,15,0,0]
 * balances [15, 5, -10, -10]:
 *   round 1: rank 0 -> rank 2 (lowest of the two -10s) 10: [5, 5, 0, -10]
 *   round 2: rank 0 (lowest of the two 5s) -> rank 3 10:   [-5, 5, 0, 0]  (rank 0 overshoots)
 *   round 3: rank 1 -> rank 0 5:                            [0, 0, 0, 0]
 * allocation e0 [5,0,10,10], e1 [5,10,0,0]; virtual: rank 0 holds e1, ranks 2 and 3 e0.
 * Routes, sources in order filling destinations in order:
 *   e0: r0 7 -> 5 to r0, 2 to r2; r1 6 -> r2; r2 6 -> 2 to r2, 4 to r3; r3 6 -> r3
 *   e1: r0 3 -> r0; r1 4 -> 2 to r0, 2 to r1; r2 4 -> r1; r3 4 -> r1 */
static void test_several_overloaded(void)
{
    rp_vexp *v = planner(4, 4);
    const int32_t counts[] = {7, 3, 0, 0, 6, 4, 0, 0, 6, 4, 0, 0, 6, 4, 0, 0};
    rp_error err;
    is_int(rp_vexp_plan(v, counts, NULL, &err), RP_OK, "several overloaded: plans");
    ok(same64(rp_vexp_rank_load(v), (int64_t[]){10, 10, 10, 10}, 4), "several overloaded: loads all 10");
    ok(same64(rp_vexp_allocation(v), (int64_t[]){5, 0, 10, 10, 5, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 16),
       "several overloaded: allocation by hand");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){1, -1, 0, 0}, 4), "several overloaded: virtual slots by hand");
    is_int(rp_vexp_num_virtual(v), 3, "several overloaded: three virtual experts");
    ok(same32(rp_vexp_pushes_out(v), (int32_t[]){2, 1, 0, 0}, 4), "several overloaded: pushes out 2, 1, 0, 0");
    ok(same32(rp_vexp_pushes_in(v), (int32_t[]){1, 0, 1, 1}, 4), "several overloaded: pushes in 1, 0, 1, 1");
    ok(same64(rp_vexp_traffic(v), (int64_t[]){8, 0, 2, 0, 2, 2, 6, 0, 0, 4, 2, 4, 0, 4, 0, 6}, 16),
       "several overloaded: routes by hand");
    rp_vexp_free(v);
}

/* Unequal route counts and a tie: rank 1 routes [3,3,0,0], all to rank 0's experts, and
 * rank 0 routes nothing. Targets are the mean, 3 and 3; the quota of 3 takes expert 0
 * (lowest local expert on a tie between 3 and 3). Expert 1 stays home and its choices
 * travel from rank 1 to rank 0; expert 0's are computed where they were routed. */
static void test_unequal_and_tie(void)
{
    rp_vexp *v = planner(2, 4);
    const int32_t counts[] = {0, 0, 0, 0, 3, 3, 0, 0};
    rp_error err;
    is_int(rp_vexp_plan(v, counts, NULL, &err), RP_OK, "unequal: plans");
    ok(same64(rp_vexp_rank_load(v), (int64_t[]){3, 3}, 2), "unequal: both ranks compute the mean, 3");
    ok(same64(rp_vexp_allocation(v), (int64_t[]){0, 3, 3, 0, 0, 0, 0, 0}, 8), "unequal: expert 0 offloaded on a tie");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){-1, -1, 0, -1}, 4), "unequal: rank 1 holds expert 0");
    ok(same64(rp_vexp_traffic(v), (int64_t[]){0, 0, 3, 3}, 4), "unequal: rank 1 sends expert 1's 3 to rank 0");
    /* an odd total: 7 over 2 ranks is 4 (rank 0) and 3 */
    const int32_t odd[] = {0, 0, 0, 0, 4, 3, 0, 0};
    is_int(rp_vexp_plan(v, odd, NULL, &err), RP_OK, "odd total: plans");
    ok(same64(rp_vexp_rank_load(v), (int64_t[]){4, 3}, 2), "odd total: the remainder goes to rank 0");
    rp_vexp_free(v);
}

/* Ownership given by the caller (a permuted even placement). */
static void test_owner_map(void)
{
    rp_vexp *v = planner(2, 4);
    const int32_t owner[] = {1, 0, 1, 0};  /* rank 0: e1, e3; rank 1: e0, e2 */
    const int32_t counts[] = {4, 0, 0, 0, 4, 0, 0, 0};
    rp_error err;
    is_int(rp_vexp_plan(v, counts, owner, &err), RP_OK, "owner map: plans");
    ok(same64(rp_vexp_allocation(v), (int64_t[]){4, 4, 0, 0, 0, 0, 0, 0}, 8), "owner map: e0 split 4 on rank 0, 4 on its owner");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){0, -1, -1, -1}, 4), "owner map: rank 0 receives e0");
    const int32_t uneven[] = {0, 0, 0, 1};
    is_int(rp_vexp_plan(v, counts, uneven, &err), RP_EINVAL, "owner map: uneven ownership refused");
    like(err.text, "EP rank 0 owns more than 2 experts", "owner map: message names the rank and the count");
    ok(same32(rp_vexp_slot_expert(v), (int32_t[]){0, -1, -1, -1}, 4), "owner map: the last plan stays on error");
    const int32_t outside[] = {0, 0, 1, 2};
    is_int(rp_vexp_plan(v, counts, outside, &err), RP_EINVAL, "owner map: owner out of range refused");
    like(err.text, "expert 3 is owned by EP rank 2, outside 0..1", "owner map: message names the expert");
    rp_vexp_free(v);
}

static void test_bad_input(void)
{
    rp_vexp *v = NULL;
    rp_error err;
    is_int(rp_vexp_new(ctx, 1, 4, &v, &err), RP_EINVAL, "ep_size 1 refused");
    like(err.text, "ep_size is 1; the balancer runs on EP groups of 2 to 64 GPUs", "ep_size 1: message");
    is_int(rp_vexp_new(ctx, 65, 130, &v, &err), RP_EINVAL, "ep_size 65 refused");
    is_int(rp_vexp_new(ctx, 4, 6, &v, &err), RP_EINVAL, "6 experts over 4 ranks refused");
    like(err.text, "6 experts cannot be owned evenly by 4 EP ranks", "uneven: message");
    ok(v == NULL, "no planner on error");
    v = planner(64, 64);
    ok(v != NULL, "ep_size 64 accepted");
    rp_vexp_free(v);
    v = planner(2, 2);
    const int32_t neg[] = {1, -1, 0, 0};
    is_int(rp_vexp_plan(v, neg, NULL, &err), RP_EINVAL, "negative count refused");
    like(err.text, "EP rank 0 routes -1 token-choices to expert 1", "negative: message");
    is_int(rp_vexp_plan(v, NULL, NULL, &err), RP_EINVAL, "NULL counts refused");
    const int32_t big[] = {INT32_MAX, 1, 0, 0};
    is_int(rp_vexp_plan(v, big, NULL, &err), RP_ERANGE, "a rank beyond 2^31 - 1 refused");
    rp_vexp_free(v);
    rp_vexp_free(NULL);
    ok(rp_vexp_rank_load(NULL) == NULL && rp_vexp_num_virtual(NULL) == 0, "accessors take NULL");
}

/* Invariants on random forwards (skewed histograms, unequal route counts): every rank
 * computes the group's mean (remainder to the lowest ranks); each expert's allocation sums to its total; routes sent by a source are
 * what it routed and routes received what the destination computes; a rank's virtual
 * slots come from one owner; push counts match the slots. */
static void test_random(void)
{
    uint64_t seed = 0x9e3779b97f4a7c15ULL;
    int bad = 0, cases = 0;
    for (int t = 0; t < 300; t++) {
        int32_t ep = 2 + (int32_t)(xorshift64(&seed) % 15), pr = 1 + (int32_t)(xorshift64(&seed) % 6);
        int32_t E = ep * pr;
        int32_t *counts = calloc((size_t)ep * E, sizeof *counts);
        for (int32_t r = 0; r < ep; r++) {
            int32_t n = (int32_t)(xorshift64(&seed) % 200);
            int32_t hot = (int32_t)(xorshift64(&seed) % E);
            for (int32_t i = 0; i < n; i++) {
                int32_t e = xorshift64(&seed) % 3 == 0 ? hot : (int32_t)(xorshift64(&seed) % E);
                counts[(size_t)r * E + e]++;
            }
        }
        rp_vexp *v = planner(ep, E);
        rp_error err;
        if (!v || rp_vexp_plan(v, counts, NULL, &err) != RP_OK) {
            diag("case %d: %s", t, err.text);
            bad++;
            free(counts);
            rp_vexp_free(v);
            continue;
        }
        cases++;
        const int64_t *load = rp_vexp_rank_load(v), *alloc = rp_vexp_allocation(v), *tr = rp_vexp_traffic(v);
        const int32_t *slot = rp_vexp_slot_expert(v), *pout = rp_vexp_pushes_out(v), *pin = rp_vexp_pushes_in(v);
        bool good = true;
        int32_t used = 0, sum_out = 0;
        int64_t group = 0;
        for (size_t i = 0; i < (size_t)ep * E; i++) group += counts[i];
        for (int32_t r = 0; r < ep; r++) {
            int64_t own = 0, sent = 0, recv = 0;
            for (int32_t e = 0; e < E; e++) own += counts[(size_t)r * E + e];
            for (int32_t d = 0; d < ep; d++) sent += tr[(size_t)r * ep + d], recv += tr[(size_t)d * ep + r];
            good &= load[r] == group / ep + (r < group % ep) && sent == own && recv == load[r];
            int32_t sender = -1, n = 0;
            for (int32_t s = 0; s < pr; s++) {
                int32_t e = slot[(size_t)r * pr + s];
                if (e < 0) continue;
                n++;
                good &= e / pr != r && alloc[(size_t)e * ep + r] > 0;
                good &= sender < 0 || sender == e / pr;
                sender = e / pr;
            }
            for (int32_t e = 0; e < E; e++) {
                if (e / pr == r || alloc[(size_t)e * ep + r] == 0) continue;
                bool found = false;
                for (int32_t s = 0; s < pr; s++) found |= slot[(size_t)r * pr + s] == e;
                good &= found;
            }
            good &= pin[r] == n;
            used += n;
            sum_out += pout[r];
        }
        for (int32_t e = 0; e < E; e++) {
            int64_t total = 0, got = 0;
            for (int32_t r = 0; r < ep; r++) total += counts[(size_t)r * E + e], got += alloc[(size_t)e * ep + r];
            good &= total == got;
            for (int32_t r = 0; r < ep; r++) good &= alloc[(size_t)e * ep + r] >= 0;
        }
        good &= used == rp_vexp_num_virtual(v) && sum_out == used;
        if (!good) {
            diag("case %d (ep %d, E %d) breaks an invariant", t, ep, E);
            bad++;
        }
        rp_vexp_free(v);
        free(counts);
    }
    is_int(bad, 0, "300 random forwards: loads, allocations, routes and slots consistent (%d planned)", cases);
}

/* The plan as first written (every expert and rank visited in steps 3 and 4), kept here
 * as the reference: the planner visits only the experts step 2 splits, and must give the
 * same allocation, slots, routes, loads and pushes bit for bit. */
typedef struct ref_plan {
    int64_t load[16], alloc[16 * 96], traffic[16 * 16];
    int32_t slot[16 * 6], pout[16], pin[16], num_virtual;
} ref_plan;

static int32_t ref_argmax(const int64_t *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int32_t ref_argmin(const int64_t *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] < x[best]) best = i;
    return best;
}

static void reference(int32_t ep, int32_t E, const int32_t *counts, const int32_t *owner_in, ref_plan *o)
{
    const int32_t pr = E / ep;
    int32_t owner[96], owned[96], fill[16] = {0};
    int64_t native[96] = {0}, bal[16] = {0}, quota[16 * 16] = {0}, remaining[6], total = 0;
    memset(o, 0, sizeof *o);
    for (int32_t e = 0; e < E; e++) {
        owner[e] = owner_in ? owner_in[e] : e / pr;
        owned[owner[e] * pr + fill[owner[e]]++] = e;
    }
    for (int32_t r = 0; r < ep; r++)
        for (int32_t e = 0; e < E; e++) native[e] += counts[r * E + e], total += counts[r * E + e];
    for (int32_t r = 0; r < ep; r++) bal[r] = -(total / ep + (r < total % ep ? 1 : 0));
    for (int32_t e = 0; e < E; e++) bal[owner[e]] += native[e];
    for (int32_t round = 0; round < ep; round++) {
        int32_t hi = ref_argmax(bal, ep), lo = ref_argmin(bal, ep);
        if (bal[hi] <= 0) break;
        quota[hi * ep + lo] = -bal[lo];
        bal[hi] += bal[lo];
        bal[lo] = 0;
    }
    for (int32_t e = 0; e < E; e++) o->alloc[e * ep + owner[e]] = native[e];
    for (int32_t s = 0; s < ep; s++) {
        const int32_t *mine = owned + s * pr;
        int64_t *q = quota + s * ep;
        for (int32_t i = 0; i < pr; i++) remaining[i] = native[mine[i]];
        for (int32_t step = 0; step < ep + pr; step++) {
            int32_t dst = ref_argmax(q, ep);
            if (q[dst] <= 0) break;
            int32_t i = ref_argmax(remaining, pr);
            int64_t moved = q[dst] < remaining[i] ? q[dst] : remaining[i];
            if (moved <= 0) break;
            o->alloc[mine[i] * ep + dst] += moved;
            o->alloc[mine[i] * ep + s] -= moved;
            remaining[i] -= moved;
            q[dst] -= moved;
        }
    }
    for (int32_t r = 0; r < ep; r++) {
        int32_t *row = o->slot + r * pr, used = 0;
        for (int32_t s = 0; s < pr; s++) row[s] = -1;
        for (int32_t e = E - 1; e >= 0; e--) {
            int64_t n = o->alloc[e * ep + r];
            if (owner[e] == r || n <= 0) continue;
            int32_t at = used++;
            while (at > 0 && o->alloc[row[at - 1] * ep + r] < n) {
                row[at] = row[at - 1];
                at--;
            }
            row[at] = e;
            o->pout[owner[e]]++;
            o->pin[r]++;
            o->num_virtual++;
        }
    }
    for (int32_t e = 0; e < E; e++) {
        int32_t src = 0, dst = 0;
        int64_t src_left = counts[e], dst_left = o->alloc[e * ep];
        for (;;) {
            while (src < ep && src_left == 0) {
                src++;
                if (src < ep) src_left = counts[src * E + e];
            }
            while (dst < ep && dst_left == 0) {
                dst++;
                if (dst < ep) dst_left = o->alloc[e * ep + dst];
            }
            if (src == ep || dst == ep) break;
            int64_t n = src_left < dst_left ? src_left : dst_left;
            o->traffic[src * ep + dst] += n;
            src_left -= n;
            dst_left -= n;
        }
        for (int32_t r = 0; r < ep; r++) o->load[r] += o->alloc[e * ep + r];
    }
}

static void test_reference(void)
{
    uint64_t seed = 0x2545F4914F6CDD1DULL;
    int same = 0, cases = 0;
    for (int t = 0; t < 40; t++) {
        int32_t ep = 2 + (int32_t)(xorshift64(&seed) % 15), pr = 1 + (int32_t)(xorshift64(&seed) % 6);
        int32_t E = ep * pr;
        rp_vexp *v = planner(ep, E);
        /* one planner, many forwards: what a plan leaves behind must not leak into the next */
        for (int f = 0; f < 12 && v; f++) {
            int32_t counts[16 * 96] = {0}, owner[96];
            for (int32_t e = 0; e < E; e++) owner[e] = e / pr;
            if (f % 3 == 1) /* a shuffled ownership, each rank still pr experts */
                for (int32_t e = E - 1; e > 0; e--) {
                    int32_t j = (int32_t)(xorshift64(&seed) % (uint64_t)(e + 1)), x = owner[e];
                    owner[e] = owner[j], owner[j] = x;
                }
            const int skew = f % 4;
            for (int32_t r = 0; r < ep; r++) {
                int32_t n = f % 5 == 4 ? 0 : (int32_t)(xorshift64(&seed) % 400);
                int32_t hot = (int32_t)(xorshift64(&seed) % E);
                for (int32_t i = 0; i < n; i++) {
                    int32_t e = skew && xorshift64(&seed) % 4 < (uint64_t)skew ? hot : (int32_t)(xorshift64(&seed) % E);
                    counts[r * E + e]++;
                }
            }
            ref_plan want;
            reference(ep, E, counts, f % 3 == 1 ? owner : NULL, &want);
            rp_error err;
            cases++;
            if (rp_vexp_plan(v, counts, f % 3 == 1 ? owner : NULL, &err) != RP_OK) {
                diag("case %d/%d: %s", t, f, err.text);
                continue;
            }
            same += same64(rp_vexp_rank_load(v), want.load, ep) && same64(rp_vexp_allocation(v), want.alloc, E * ep) &&
                    same64(rp_vexp_traffic(v), want.traffic, ep * ep) &&
                    same32(rp_vexp_slot_expert(v), want.slot, ep * pr) && same32(rp_vexp_pushes_out(v), want.pout, ep) &&
                    same32(rp_vexp_pushes_in(v), want.pin, ep) && rp_vexp_num_virtual(v) == want.num_virtual;
        }
        rp_vexp_free(v);
    }
    is_int(same, cases, "%d forwards (skewed, balanced, empty, shuffled owners; one planner each 12 times): "
           "the plan equals the reference that visits every expert, bit for bit", cases);
}

static const char *CFG =
    "{\"trainer\": {\"per_forward_balancer\": true},"
    " \"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %s},"
    " \"model\": {\"num_layers\": 2, \"num_experts\": %d, \"top_k\": 2, \"hidden_size\": 4,"
    "  \"expert_ffn_size\": 2, \"num_heads\": 1, \"num_kv_heads\": 1, \"head_dim\": 2},"
    " \"limits\": {\"max_tokens_per_microbatch\": 100}}";

static rp_status check(int nodes, int gpn, int ep, const char *slots, int E, rp_error *err)
{
    char json[1024];
    snprintf(json, sizeof json, CFG, nodes, gpn, ep, slots, E);
    rp_config *cfg = NULL;
    rp_status st = rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, err);
    if (st != RP_OK) {
        diag("config: %s", err->text);
        return RP_EIO;
    }
    st = rp_vexp_check_config(cfg, err);
    rp_config_free(cfg);
    return st;
}

static void test_config_limits(void)
{
    rp_error err;
    is_int(check(2, 8, 8, "8", 64, &err), RP_OK, "EP 8 in nodes of 8, 64 experts, 8 slots: accepted");
    is_int(check(2, 8, 4, "18", 64, &err), RP_OK, "EP 4 in nodes of 8, spare slots: accepted");
    is_int(check(2, 8, 16, "4", 64, &err), RP_EINVAL, "EP group spanning nodes refused");
    like(err.text, "an EP group of 16 GPUs spans nodes of 8 GPUs", "spanning: message names both sizes");
    is_int(check(1, 8, 8, "10", 60, &err), RP_EINVAL, "60 experts over 8 ranks refused");
    like(err.text, "model.num_experts 60 is not a multiple of topology.ep_size 8", "uneven: message");
    is_int(check(1, 8, 8, "[7, 9, 8, 8, 8, 8, 8, 8]", 64, &err), RP_EINVAL, "7 slots for 8 owned experts refused");
    like(err.text, "GPU 0 has 7 expert slots", "slots: message names the GPU");
    is_int(check(1, 8, 1, "64", 64, &err), RP_EINVAL, "EP 1 refused");
    like(err.text, "topology.ep_size is 1", "EP 1: message");
}

static void test_expert_bytes(void)
{
    rp_model m = {.hidden_size = 2048, .expert_ffn_size = 768, .bytes_per_param = 2};
    is_double(rp_vexp_expert_bytes(&m), 3.0 * 2048 * 768 * 2, 0, "expert bytes = 3 d f bpp (9,437,184 B)");
}

static rp_config *load_cfg(int nodes, int gpn, int ep, const char *slots, int E)
{
    char json[1024];
    snprintf(json, sizeof json, CFG, nodes, gpn, ep, slots, E);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) diag("config: %s", err.text);
    return cfg;
}

static void collect(void *ud, const char *message)
{
    char *buf = ud;
    size_t n = strlen(buf);
    snprintf(buf + n, 2048 - n, "%s\n", message);
}

/* The plan flag: set, copied, written and read back, hashed, validated. */
static void test_plan_flag(void)
{
    rp_config *cfg = load_cfg(1, 4, 4, "3", 8); /* 2 experts per rank, 1 spare slot */
    rp_plan *plan = NULL, *copy = NULL, *back = NULL;
    rp_error err;
    if (!cfg || rp_plan_new(ctx, cfg, 1, &plan, &err) != RP_OK || rp_plan_set_contiguous(plan, &err) != RP_OK) {
        ok(0, "plan: %s", err.text);
        rp_config_free(cfg);
        return;
    }
    is_int(rp_plan_balancing(plan), RP_BALANCING_NONE, "a new plan has no per-forward balancing");
    uint64_t h0 = rp_plan_hash(plan);
    is_int(rp_plan_set_balancing(plan, (rp_balancing)7, &err), RP_EINVAL, "an unknown balancing is refused");
    is_int(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, &err), RP_OK, "virtual experts set");
    ok(rp_plan_hash(plan) != h0, "the flag changes the plan hash");
    is_int(rp_plan_check(plan, cfg, NULL, NULL, NULL), 0, "a contiguous plan with virtual experts is valid");
    ok(rp_plan_copy(plan, &copy, &err) == RP_OK && rp_plan_balancing(copy) == RP_BALANCING_VIRTUAL_EXPERTS,
       "a copy keeps the flag");
    char *text = NULL;
    size_t len = 0;
    ok(rp_plan_to_json(plan, &text, &len, &err) == RP_OK && strstr(text, "\"per_forward_balancing\": \"virtual_experts\""),
       "the JSON says per_forward_balancing virtual_experts");
    ok(text && rp_plan_parse(ctx, cfg, text, len, "<plan>", &back, &err) == RP_OK &&
       rp_plan_balancing(back) == RP_BALANCING_VIRTUAL_EXPERTS && rp_plan_hash(back) == rp_plan_hash(plan),
       "read back: the same flag and hash");
    rp_text_free(ctx, text);
    rp_plan_free(back);
    back = NULL;
    const char *bad = "{\"format\": \"routepack-plan\", \"version\": 1, \"num_gpus\": 4, \"ep_size\": 4,"
                      " \"num_layers\": 2, \"num_experts\": 8, \"per_forward_balancing\": \"moonep\"}";
    is_int(rp_plan_parse(ctx, cfg, bad, strlen(bad), "<plan>", &back, &err), RP_EINVAL, "an unknown balancing name is refused");
    like(err.text, "per_forward_balancing must be \"none\" or \"virtual_experts\", got \"moonep\"", "message");
    rp_plan_free(back);

    /* levers and uneven ownership are refused with the flag */
    char msgs[2048] = "";
    rp_plan_add_extra_replica(copy, 0, 0, 0, 1, &err);
    ok(rp_plan_check(copy, cfg, NULL, collect, msgs) > 0, "extra replicas with virtual experts: invalid");
    like(msgs, "makes its own replicas each forward, but the plan also has 1 extra replica", "message names the levers");
    const int32_t lopsided[] = {0, 1, -1, 2, 3, -1, 4, 5, 6, 7, -1, -1}; /* rank 2 three, rank 3 one */
    rp_plan_clear_levers(copy);
    rp_plan_set_phy2log(copy, 1, lopsided, &err);
    msgs[0] = 0;
    ok(rp_plan_check(copy, cfg, NULL, collect, msgs) > 0, "uneven ownership with virtual experts: invalid");
    like(msgs, "needs 2 experts (num_experts / ep_size) on every EP rank, but layer 1 EP rank 2 holds 3", "message names the layer and rank");
    rp_plan_set_balancing(copy, RP_BALANCING_NONE, &err);
    is_int(rp_plan_check(copy, cfg, NULL, NULL, NULL), 0, "the same placement without the flag is valid");
    rp_plan_free(copy);
    rp_plan_free(plan);
    rp_config_free(cfg);

    /* an EP group spanning nodes: the plan is refused, and so is the baseline */
    cfg = load_cfg(2, 2, 4, "2", 8);
    plan = NULL;
    if (cfg && rp_plan_new(ctx, cfg, 1, &plan, &err) == RP_OK && rp_plan_set_contiguous(plan, &err) == RP_OK) {
        rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, &err);
        msgs[0] = 0;
        ok(rp_plan_check(plan, cfg, NULL, collect, msgs) == 1, "virtual experts on EP groups spanning nodes: invalid");
        like(msgs, "an EP group of 4 GPUs spans nodes of 2 GPUs", "message names the group and the node");
    } else {
        ok(0, "plan: %s", err.text);
        ok(0, "(skipped)");
    }
    rp_plan_free(plan);
    rp_config_free(cfg);
}

/* Every allocation of rp_vexp_new failing in turn: RP_ENOMEM, nothing leaked. */
static void test_alloc_failures(void)
{
    int bad = 0, n;
    for (n = 1; n < 100; n++) {
        counting c = {0};
        rp_context *cx = NULL;
        if (rp_context_new(counting_alloc, &c, &cx) != RP_OK) continue; /* the context's own allocation */
        c.fail_at = c.calls + n;
        rp_vexp *v = NULL;
        rp_error err;
        rp_status st = rp_vexp_new(cx, 4, 8, &v, &err);
        if (st == RP_OK) {
            rp_vexp_free(v);
            rp_context_free(cx);
            break;
        }
        bad += st != RP_ENOMEM || v != NULL;
        rp_context_free(cx);
        bad += c.live != 0;
    }
    ok(n > 1 && n < 100, "rp_vexp_new succeeds once its %d allocations succeed", n - 1);
    is_int(bad, 0, "each failing allocation gives RP_ENOMEM and leaks nothing");
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_balanced();
    test_one_hot_expert();
    test_several_overloaded();
    test_unequal_and_tie();
    test_owner_map();
    test_bad_input();
    test_random();
    test_reference();
    test_config_limits();
    test_expert_bytes();
    test_alloc_failures();
    test_plan_flag();
    rp_context_free(ctx);
    return tap_done();
}
