/* Replica apportionment: how many replicas each expert gets out of a fixed number of
 * slots, minimising the largest load per replica. */
#include "internal.h"
#include "routepack/primitives.h"

#include <math.h>

/* Why the greedy rule is optimal.
 *
 * Greedy: every expert starts with one replica; each further replica goes to an
 * expert e, below its limit, with the largest ratio load_e / count_e. Let c be the
 * final counts and M = max_e load_e / c_e, reached at expert e*.
 *
 * Claim: every allocation c' with c'_e >= 1, c'_e <= limit and sum c' = sum c has
 * max_e load_e / c'_e >= M.
 *
 * Suppose not: max_e load_e / c'_e < M. If M = 0 that is impossible, so load_e* > 0,
 * and load_e* / c'_e* < M = load_e* / c_e* gives c'_e* > c_e*. The sums are equal, so
 * some f has c'_f < c_f; as c'_f >= 1, c_f >= 2: f received a spare replica, its
 * c_f-th. At that moment e* had some count t <= c_e* < c'_e* <= limit, so e* was
 * eligible with ratio load_e* / t >= M, and greedy picked f, so
 * load_f / (c_f - 1) >= load_e* / t >= M. Then load_f / c'_f >= load_f / (c_f - 1) >= M,
 * contradicting max < M. The tie-break never enters the argument: any order among
 * equal ratios is optimal. (This is D'Hondt/Jefferson apportionment.) */

typedef struct app_heap {
    const double *load;
    const int32_t *count;
    int32_t *items;
    int32_t size;
} app_heap;

/* `a` gets the next replica before `b`: larger load per replica, then fewer
 * replicas (spreads all-equal ratios, e.g. all-zero loads, round-robin), then lower
 * index. */
static inline bool app_before(const app_heap *h, int32_t a, int32_t b)
{
    double ra = h->load[a] / h->count[a], rb = h->load[b] / h->count[b];
    if (ra != rb) return ra > rb;
    if (h->count[a] != h->count[b]) return h->count[a] < h->count[b];
    return a < b;
}

static void app_sift_down(app_heap *h, int32_t pos)
{
    int32_t item = h->items[pos];
    for (;;) {
        int32_t child = 2 * pos + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && app_before(h, h->items[child + 1], h->items[child])) child++;
        if (!app_before(h, h->items[child], item)) break;
        h->items[pos] = h->items[child];
        pos = child;
    }
    h->items[pos] = item;
}

rp_status rp_replicas_apportion(rp_context *ctx, const double *load, int32_t num_experts,
                                int32_t num_slots, int32_t max_replicas, int32_t *counts,
                                rp_error *err)
{
    if (num_experts < 1)
        return rp_fail(err, RP_EINVAL, "apportion: %d experts, must be >= 1", num_experts);
    if (!load || !counts) return rp_fail(err, RP_EINVAL, "apportion: load and counts are required");
    if (max_replicas < 0)
        return rp_fail(err, RP_EINVAL, "apportion: max_replicas = %d, must be >= 0", max_replicas);
    for (int32_t e = 0; e < num_experts; e++)
        if (!isfinite(load[e]) || load[e] < 0) {
            rp_fail(err, RP_EINVAL, "apportion: expert %d has load %g; it must be finite and >= 0", e,
                    load[e]);
            if (err) err->expert = e;
            return RP_EINVAL;
        }
    if (num_slots < num_experts)
        return rp_fail(err, RP_ERANGE, "apportion: %d slots for %d experts; every expert needs one",
                       num_slots, num_experts);
    if (max_replicas > 0 && (int64_t)max_replicas * num_experts < num_slots)
        return rp_fail(err, RP_ERANGE,
                       "apportion: %d slots but %d experts with at most %d replicas each hold only %lld",
                       num_slots, num_experts, max_replicas, (long long)max_replicas * num_experts);

    size_t ez = (size_t)num_experts;
    int32_t *count = rp_alloc(ctx, ez * sizeof *count);
    int32_t *items = rp_alloc(ctx, ez * sizeof *items);
    rp_status st = RP_OK;
    if (!count || !items) {
        st = rp_fail_nomem(err, "apportion scratch");
        goto out;
    }
    app_heap h = {load, count, items, 0};
    for (int32_t e = 0; e < num_experts; e++) {
        count[e] = 1;
        if (max_replicas != 1) items[h.size++] = e;
    }
    for (int32_t pos = h.size / 2 - 1; pos >= 0; pos--) app_sift_down(&h, pos);
    for (int32_t s = num_experts; s < num_slots; s++) {
        /* h.size > 0: max_replicas * E >= num_slots was checked. */
        int32_t e = h.items[0];
        count[e]++;
        if (max_replicas > 0 && count[e] >= max_replicas) h.items[0] = h.items[--h.size];
        if (h.size > 0) app_sift_down(&h, 0);
    }
    for (int32_t e = 0; e < num_experts; e++) counts[e] = count[e];
out:
    rp_free(ctx, count);
    rp_free(ctx, items);
    return st;
}
