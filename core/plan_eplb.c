/* Placement layouts and dispatcher arrays: the contiguous start layout, slot
 * stabilisation against the previous placement, and DeepSeek EPLB's phy2log / log2phy /
 * logcnt arrays. */
#include "internal.h"
#include "routepack/plan.h"

#include <stdlib.h>
#include <string.h>

rp_status rp_plan_set_contiguous(rp_plan *plan, rp_error *err)
{
    rp_context *ctx = rp_plan_context(plan);
    int32_t E = rp_plan_num_experts(plan), ep = rp_plan_ep_size(plan);
    int32_t S = rp_plan_total_slots(plan), L = rp_plan_num_layers(plan);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    if (S < E)
        return rp_fail(err, RP_EINVAL, "plan: %d experts do not fit in %d slots per layer", E, S);
    int32_t *phy2log = rp_alloc(ctx, (size_t)S * sizeof *phy2log);
    int32_t *used = rp_calloc(ctx, (size_t)ep, sizeof *used);
    rp_status st = RP_OK;
    if (!phy2log || !used) {
        st = rp_fail_nomem(err, "a contiguous layout");
        goto out;
    }
    for (int32_t s = 0; s < S; s++) phy2log[s] = -1;
    /* Experts ascend, so each rank's experts come out in ascending slot order. */
    for (int32_t e = 0; e < E; e++) {
        int32_t home = (int32_t)((int64_t)e * ep / E);
        for (int32_t t = 0; t < ep; t++) {
            int32_t r = (home + t) % ep;
            if (used[r] < slot_begin[r + 1] - slot_begin[r]) {
                phy2log[slot_begin[r] + used[r]++] = e;
                break;
            }
        }
    }
    /* Cannot fail: every id is in range and every layer exists. */
    for (int32_t l = 0; l < L; l++) RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, phy2log, err), st, out);
out:
    rp_free(ctx, phy2log);
    rp_free(ctx, used);
    return st;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Inside one EP rank (slots [first, first + n)): every expert that `prev` has on the
 * rank keeps its slot; the others fill the free slots in ascending id order. A slot is
 * rewritten only if its expert changes, and a slot whose previous expert stays on the
 * rank keeps it, so no renumbering inside the rank rewrites fewer slots.
 * `count` is all zero on entry and on exit. */
static void stabilize_rank(const int32_t *cur, const int32_t *prev, int32_t *out, int32_t n,
                           int32_t *count, int32_t *rest)
{
    for (int32_t k = 0; k < n; k++) {
        if (cur[k] >= 0) count[cur[k]]++;
        out[k] = -1;
    }
    if (prev) {
        for (int32_t k = 0; k < n; k++) {
            int32_t e = prev[k];
            if (e >= 0 && count[e] > 0) {
                out[k] = e;
                count[e]--;
            }
        }
    }
    int32_t m = 0;
    for (int32_t k = 0; k < n; k++) {
        int32_t e = cur[k];
        while (e >= 0 && count[e] > 0) {
            rest[m++] = e;
            count[e]--;
        }
    }
    qsort(rest, (size_t)m, sizeof *rest, cmp_i32);
    for (int32_t k = 0, i = 0; k < n && i < m; k++)
        if (out[k] < 0) out[k] = rest[i++];
}

rp_status rp_plan_stabilize_slots(rp_plan *plan, const rp_plan *previous, rp_error *err)
{
    if (!rp_plan_has_placement(plan)) return rp_fail(err, RP_EINVAL, "plan: no placement to stabilize");
    if (!previous) return rp_fail(err, RP_EINVAL, "plan: no previous plan to stabilize against");
    int32_t E = rp_plan_num_experts(plan), ep = rp_plan_ep_size(plan);
    int32_t S = rp_plan_total_slots(plan), L = rp_plan_num_layers(plan);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    if (rp_plan_num_experts(previous) != E || rp_plan_ep_size(previous) != ep ||
        rp_plan_num_layers(previous) != L || rp_plan_total_slots(previous) != S ||
        memcmp(rp_plan_slot_begin(previous), slot_begin, ((size_t)ep + 1) * sizeof(int32_t)) != 0)
        return rp_fail(err, RP_EINVAL,
                       "plan: the previous plan has another placement shape (%d layers, %d experts, EP size %d, "
                       "%d slots; this plan: %d, %d, %d, %d)",
                       rp_plan_num_layers(previous), rp_plan_num_experts(previous), rp_plan_ep_size(previous),
                       rp_plan_total_slots(previous), L, E, ep, S);
    bool have_prev = rp_plan_has_placement(previous);
    rp_context *ctx = rp_plan_context(plan);
    int32_t *layout = rp_alloc(ctx, (size_t)L * S * sizeof *layout);
    int32_t *count = rp_calloc(ctx, (size_t)E, sizeof *count);
    int32_t *rest = rp_alloc(ctx, (size_t)S * sizeof *rest);
    rp_status st = RP_OK;
    if (!layout || !count || !rest) {
        st = rp_fail_nomem(err, "a slot layout");
        goto out;
    }
    /* Compute every layer first, then commit: nothing below can fail. */
    for (int32_t l = 0; l < L; l++) {
        const int32_t *cur = rp_plan_phy2log(plan, l);
        const int32_t *prev = have_prev ? rp_plan_phy2log(previous, l) : NULL;
        for (int32_t j = 0; j < ep; j++) {
            int32_t first = slot_begin[j], n = slot_begin[j + 1] - first;
            stabilize_rank(cur + first, prev ? prev + first : NULL, layout + (size_t)l * S + first, n,
                           count, rest);
        }
    }
    for (int32_t l = 0; l < L; l++)
        RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, layout + (size_t)l * S, err), st, out);
out:
    rp_free(ctx, layout);
    rp_free(ctx, count);
    rp_free(ctx, rest);
    return st;
}

rp_status rp_plan_eplb_arrays(const rp_plan *plan, int32_t max_replicas, int32_t *phy2log,
                              int32_t *log2phy, int32_t *logcnt, rp_error *err)
{
    int32_t E = rp_plan_num_experts(plan), S = rp_plan_total_slots(plan), L = rp_plan_num_layers(plan);
    if (!rp_plan_has_placement(plan)) return rp_fail(err, RP_EINVAL, "plan: no placement to export");
    if (max_replicas < 1)
        return rp_fail(err, RP_EINVAL, "plan: max_replicas is %d, must be >= 1", max_replicas);
    if ((!phy2log && S > 0) || !log2phy || !logcnt)
        return rp_fail(err, RP_EINVAL, "plan: phy2log, log2phy and logcnt are required");
    rp_context *ctx = rp_plan_context(plan);
    int32_t *cnt = rp_alloc(ctx, (size_t)E * sizeof *cnt);
    if (!cnt) return rp_fail_nomem(err, "replica counts");
    rp_status st = RP_OK;
    /* Check every layer before writing anything. */
    for (int32_t l = 0; l < L && st == RP_OK; l++) {
        int32_t largest = rp_plan_logcnt(plan, l, cnt);
        for (int32_t e = 0; e < E; e++) {
            if (cnt[e] == 0) {
                st = rp_fail(err, RP_EPLAN,
                             "plan: layer %d expert %d has no replica; dispatch arrays need one for every expert",
                             l, e);
                if (err) err->expert = e;
                break;
            }
            if (cnt[e] == largest && largest > max_replicas) {
                st = rp_fail(err, RP_EINVAL,
                             "plan: layer %d expert %d has %d replicas, more than max_replicas %d", l, e,
                             largest, max_replicas);
                if (err) err->expert = e;
                break;
            }
        }
    }
    if (st != RP_OK) goto out;
    for (int32_t l = 0; l < L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        int32_t *lc = logcnt + (size_t)l * E;
        int32_t *l2p = log2phy + (size_t)l * E * max_replicas;
        if (S > 0) memcpy(phy2log + (size_t)l * S, p2l, (size_t)S * sizeof *phy2log);
        for (size_t i = 0; i < (size_t)E * max_replicas; i++) l2p[i] = -1;
        memset(lc, 0, (size_t)E * sizeof *lc);
        /* ascending slots: replica r of an expert is its r-th lowest slot */
        for (int32_t s = 0; s < S; s++) {
            int32_t e = p2l[s];
            if (e >= 0) l2p[(size_t)e * max_replicas + lc[e]++] = s;
        }
    }
out:
    rp_free(ctx, cnt);
    return st;
}
