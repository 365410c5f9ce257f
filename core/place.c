/* Replica-to-GPU assignment inside one EP group, in DeepSeek EPLB's global and
 * hierarchical modes, generalised to uneven slots and GPU speeds. */
#include "internal.h"
#include "routepack/primitives.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static rp_status expert_error(rp_error *err, rp_status status, int32_t expert, const char *fmt, ...)
    RP_PRINTF(4, 5);
static rp_status expert_error(rp_error *err, rp_status status, int32_t expert, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, status, fmt, ap);
    va_end(ap);
    if (err) err->expert = expert;
    return status;
}

/* Working state of one placement. GPU g's experts are list[begin[g] .. begin[g]+used[g]). */
typedef struct placer {
    const double *load;
    int32_t *count;         /* [E] replica counts */
    const double *speed;    /* [G] or NULL */
    const int32_t *slots;   /* [G] */
    const int32_t *begin;   /* [G + 1] */
    int32_t *list;          /* [S] */
    int32_t *used;          /* [G] */
    int32_t *stamp;         /* [G]: the expert most recently placed on g */
    int32_t *bfs;           /* [4 G] repair scratch */
    double *gpu_load;       /* [G] sum of load/count, not divided by speed */
} placer;

static inline double replica_weight(const placer *pl, int32_t e)
{
    return pl->load[e] / pl->count[e];
}

static bool gpu_holds(const placer *pl, int32_t g, int32_t e)
{
    const int32_t *l = pl->list + pl->begin[g];
    for (int32_t t = 0; t < pl->used[g]; t++)
        if (l[t] == e) return true;
    return false;
}

/* The value a GPU is chosen by: its finishing time with the replica (equal speeds:
 * its load, as EPLB compares, which picks the same GPU without rounding noise). */
static inline double gpu_value(const placer *pl, int32_t g, double w)
{
    return pl->speed ? (pl->gpu_load[g] + w) / pl->speed[g] : pl->gpu_load[g];
}

/* No GPU of [g0, g1) with a free slot lacks expert e. Replicas and GPUs form a flow
 * network (expert -> GPU edges of capacity 1, GPU -> sink of capacity its slots), and
 * a placement is an integral flow; search for an augmenting path by breadth-first
 * search: e goes to a GPU h0 without it, which gives one of its replicas f1 to a GPU
 * h1 without f1, ..., until a GPU with a free slot. If any complete placement exists,
 * such a path exists (the difference between it and the current flow carries a unit
 * through e), so this never fails on a feasible input. GPUs are visited once each, in
 * ascending load (ties: lower index), replicas in slot order: O(G^2 * slots^2).
 * Returns false when no path exists. */
static bool place_repair(placer *pl, int32_t g0, int32_t g1, int32_t e, double w)
{
    int32_t G = g1 - g0;
    int32_t *ord = pl->bfs, *parent = ord + G, *pslot = parent + G, *queue = pslot + G;
    for (int32_t i = 0; i < G; i++) {
        /* insertion sort by (load / speed, index): repairs are rare and G is small */
        int32_t g = g0 + i, j = i;
        double lg = pl->gpu_load[g] / (pl->speed ? pl->speed[g] : 1.0);
        while (j > 0) {
            int32_t o = ord[j - 1];
            if (pl->gpu_load[o] / (pl->speed ? pl->speed[o] : 1.0) <= lg) break;
            ord[j] = o;
            j--;
        }
        ord[j] = g;
        parent[i] = -2; /* unvisited; indexed by g - g0 */
    }
    int32_t head = 0, tail = 0, end = -1;
    for (int32_t i = 0; i < G; i++) {
        int32_t g = ord[i];
        if (!gpu_holds(pl, g, e)) {
            parent[g - g0] = -1;
            queue[tail++] = g;
        }
    }
    while (head < tail && end < 0) {
        int32_t h = queue[head++];
        if (pl->used[h] < pl->slots[h]) {
            end = h;
            break;
        }
        const int32_t *hl = pl->list + pl->begin[h];
        for (int32_t t = 0; t < pl->used[h]; t++) {
            int32_t f = hl[t];
            for (int32_t i = 0; i < G; i++) {
                int32_t g = ord[i];
                if (parent[g - g0] != -2 || gpu_holds(pl, g, f)) continue;
                parent[g - g0] = h;
                pslot[g - g0] = t;
                queue[tail++] = g;
            }
        }
    }
    if (end < 0) return false;
    /* Apply the path from its end: each GPU takes its parent's replica into the slot
     * its own outgoing replica left (the end GPU into a free slot). */
    int32_t cur = end, free_pos = -1;
    for (;;) {
        int32_t p = parent[cur - g0];
        int32_t incoming = p == -1 ? e : pl->list[pl->begin[p] + pslot[cur - g0]];
        double wi = p == -1 ? w : replica_weight(pl, incoming);
        if (free_pos < 0) pl->list[pl->begin[cur] + pl->used[cur]++] = incoming;
        else pl->list[pl->begin[cur] + free_pos] = incoming;
        pl->gpu_load[cur] += wi;
        if (p == -1) break;
        pl->gpu_load[p] -= wi;
        free_pos = pslot[cur - g0];
        cur = p;
    }
    /* The path may have moved replicas of e too: recompute which GPUs hold it. */
    for (int32_t g = g0; g < g1; g++) pl->stamp[g] = gpu_holds(pl, g, e) ? e : -1;
    return true;
}

/* Bounded local improvement of GPUs [g0, g1): each round takes the GPU with the
 * largest load / speed (ties: lower index) and applies the best move of one of its
 * replicas to a GPU with a free slot, or swap with a replica of another GPU, that
 * keeps the one-replica-per-GPU rule and lowers the larger of the two GPUs' loads
 * below its load (ties: first found, in slot, GPU, slot order). Every change lowers
 * the sorted load vector lexicographically, so it never cycles. */
static void place_improve(placer *pl, int32_t g0, int32_t g1, int32_t rounds)
{
    for (int32_t round = 0; round < rounds; round++) {
        int32_t gm = -1;
        double lm = 0;
        for (int32_t g = g0; g < g1; g++) {
            double l = pl->gpu_load[g] / (pl->speed ? pl->speed[g] : 1.0);
            if (gm < 0 || l > lm) {
                gm = g;
                lm = l;
            }
        }
        double sm = pl->speed ? pl->speed[gm] : 1.0, best = lm * (1 - 1e-12);
        int32_t bt = -1, bq = -1, bu = -1;
        int32_t *ml = pl->list + pl->begin[gm];
        for (int32_t t = 0; t < pl->used[gm]; t++) {
            int32_t x = ml[t];
            double wx = replica_weight(pl, x);
            for (int32_t q = g0; q < g1; q++) {
                if (q == gm || gpu_holds(pl, q, x)) continue;
                double sq = pl->speed ? pl->speed[q] : 1.0;
                if (pl->used[q] < pl->slots[q]) {
                    double v = fmax((pl->gpu_load[gm] - wx) / sm, (pl->gpu_load[q] + wx) / sq);
                    if (v < best) {
                        best = v;
                        bt = t;
                        bq = q;
                        bu = -1;
                    }
                }
                const int32_t *ql = pl->list + pl->begin[q];
                for (int32_t u = 0; u < pl->used[q]; u++) {
                    int32_t y = ql[u];
                    if (gpu_holds(pl, gm, y)) continue;
                    double wy = replica_weight(pl, y);
                    double v = fmax((pl->gpu_load[gm] - wx + wy) / sm, (pl->gpu_load[q] - wy + wx) / sq);
                    if (v < best) {
                        best = v;
                        bt = t;
                        bq = q;
                        bu = u;
                    }
                }
            }
        }
        if (bt < 0) return;
        int32_t x = ml[bt];
        double wx = replica_weight(pl, x);
        int32_t *ql = pl->list + pl->begin[bq];
        if (bu >= 0) {
            int32_t y = ql[bu];
            double wy = replica_weight(pl, y);
            ml[bt] = y;
            ql[bu] = x;
            pl->gpu_load[gm] += wy - wx;
            pl->gpu_load[bq] += wx - wy;
        } else {
            for (int32_t t = bt; t + 1 < pl->used[gm]; t++) ml[t] = ml[t + 1];
            pl->used[gm]--;
            ql[pl->used[bq]++] = x;
            pl->gpu_load[gm] -= wx;
            pl->gpu_load[bq] += wx;
        }
    }
}

/* Place the replicas of experts[0..m) (in tie-break order) on GPUs [g0, g1): heaviest
 * replica first, each to the GPU with a free slot, without its expert, of least value.
 * Scratch: weight/order/tmp/rep [R] for R replicas. */
static rp_status place_scope(rp_context *ctx, placer *pl, const int32_t *experts, int32_t m,
                             int32_t g0, int32_t g1, int32_t rounds, bool may_drop, rp_error *err)
{
    int64_t r64 = 0;
    for (int32_t j = 0; j < m; j++) r64 += pl->count[experts[j]];
    size_t rz = (size_t)r64;
    double *weight = rp_alloc(ctx, rz * sizeof *weight);
    int32_t *ibuf = rp_alloc(ctx, 2 * rz * sizeof *ibuf);
    rp_status st = RP_OK;
    if (!weight || !ibuf) {
        st = rp_fail_nomem(err, "placement scratch");
        goto out;
    }
    int32_t *rep = ibuf, *order = ibuf + rz, R = 0;
    for (int32_t j = 0; j < m; j++) {
        int32_t e = experts[j];
        for (int32_t r = 0; r < pl->count[e]; r++) {
            rep[R] = e;
            weight[R++] = replica_weight(pl, e);
        }
    }
    /* Stable: equal weights keep (expert order, replica rank), so the replicas of one
     * expert are consecutive. */
    st = rp_sort_index(ctx, weight, R, true, order, err);
    if (st != RP_OK) goto out;
    for (int32_t g = g0; g < g1; g++) pl->stamp[g] = -1;
    for (int32_t j = 0; j < R; j++) {
        int32_t e = rep[order[j]];
        double w = replica_weight(pl, e); /* live: a dropped replica raises the others' */
        int32_t best = -1;
        double best_val = 0;
        for (int32_t g = g0; g < g1; g++) {
            if (pl->used[g] >= pl->slots[g] || pl->stamp[g] == e) continue;
            double v = gpu_value(pl, g, w);
            if (best < 0 || v < best_val) {
                best = g;
                best_val = v;
            }
        }
        if (best >= 0) {
            pl->list[pl->begin[best] + pl->used[best]++] = e;
            pl->gpu_load[best] += w;
            pl->stamp[best] = e;
        } else if (place_repair(pl, g0, g1, e, w)) {
            continue;
        } else if (may_drop && pl->count[e] > 1) {
            /* Apportioned counts on uneven slots can be unplaceable: drop this replica,
             * leave its slot empty, and reweigh the expert's placed replicas. */
            pl->count[e]--;
            double dw = replica_weight(pl, e) - w;
            for (int32_t g = g0; g < g1; g++)
                if (gpu_holds(pl, g, e)) pl->gpu_load[g] += dw;
        } else {
            st = expert_error(err, RP_ERANGE, e,
                              "place: cannot place a replica of expert %d on GPUs %d..%d: every GPU "
                              "with a free slot already holds it, and no reassignment frees one",
                              e, g0, g1 - 1);
            goto out;
        }
    }
    place_improve(pl, g0, g1, rounds);
out:
    rp_free(ctx, weight);
    rp_free(ctx, ibuf);
    return st;
}

static rp_status check_input(const rp_place_input *in, int64_t *total_slots, rp_error *err)
{
    if (!in) return rp_fail(err, RP_EINVAL, "place: the input is required");
    int32_t E = in->num_experts, G = in->num_gpus;
    if (E < 1) return rp_fail(err, RP_EINVAL, "place: %d experts, must be >= 1", E);
    if (G < 1) return rp_fail(err, RP_EINVAL, "place: %d GPUs, must be >= 1", G);
    if (!in->load || !in->slots) return rp_fail(err, RP_EINVAL, "place: load and slots are required");
    if (in->improve_rounds < 0)
        return rp_fail(err, RP_EINVAL, "place: improve_rounds = %d, must be >= 0", in->improve_rounds);
    if (in->mode != RP_PLACE_GLOBAL && in->mode != RP_PLACE_HIERARCHICAL)
        return rp_fail(err, RP_EINVAL, "place: unknown mode %d", (int)in->mode);
    for (int32_t e = 0; e < E; e++)
        if (!isfinite(in->load[e]) || in->load[e] < 0)
            return expert_error(err, RP_EINVAL, e, "place: expert %d has load %g; it must be finite and >= 0",
                                e, in->load[e]);
    int64_t total = 0;
    for (int32_t g = 0; g < G; g++) {
        if (in->slots[g] < 0)
            return rp_fail(err, RP_EINVAL, "place: GPU %d has %d slots, must be >= 0", g, in->slots[g]);
        total += in->slots[g];
        if (in->speed && (!isfinite(in->speed[g]) || in->speed[g] <= 0))
            return rp_fail(err, RP_EINVAL, "place: GPU %d has speed %g; it must be finite and > 0", g,
                           in->speed[g]);
    }
    if (total > INT32_MAX) return rp_fail(err, RP_ERANGE, "place: %lld slots in all, over 2^31-1", (long long)total);
    if (total < E)
        return rp_fail(err, RP_ERANGE, "place: %d experts but only %lld slots; every expert needs one",
                       E, (long long)total);
    if (in->mode == RP_PLACE_HIERARCHICAL) {
        int32_t gpn = in->gpus_per_node, groups = in->num_groups;
        if (gpn < 1 || G % gpn != 0)
            return rp_fail(err, RP_EINVAL, "place: %d GPUs per node must be >= 1 and divide the %d GPUs",
                           gpn, G);
        int32_t nodes = G / gpn;
        if (groups < 1 || E % groups != 0)
            return rp_fail(err, RP_EINVAL, "place: %d expert groups must be >= 1 and divide the %d experts",
                           groups, E);
        if (groups % nodes != 0)
            return rp_fail(err, RP_EINVAL,
                           "place: %d nodes do not divide the %d expert groups; use the global mode "
                           "(as EPLB does)",
                           nodes, groups);
    }
    int32_t scope = in->mode == RP_PLACE_HIERARCHICAL ? in->gpus_per_node : G;
    if (in->replicas) {
        int64_t sum = 0;
        for (int32_t e = 0; e < E; e++) {
            int32_t c = in->replicas[e];
            if (c < 1)
                return expert_error(err, RP_EINVAL, e, "place: expert %d has %d replicas, must be >= 1", e, c);
            if (c > scope)
                return expert_error(err, RP_ERANGE, e,
                                    "place: expert %d has %d replicas but only %d GPUs can hold it "
                                    "(at most one replica per GPU)",
                                    e, c, scope);
            sum += c;
        }
        if (sum > total)
            return rp_fail(err, RP_ERANGE, "place: %lld replicas but only %lld slots", (long long)sum,
                           (long long)total);
    }
    *total_slots = total;
    return RP_OK;
}

/* Prefix `err`'s message with what we were doing. */
static rp_status wrap_error(rp_error *err, rp_status st, const char *doing)
{
    if (err && st != RP_OK) {
        char text[RP_ERROR_TEXT];
        int len = snprintf(text, sizeof text, "place: %s: ", doing);
        if (len > 0 && (size_t)len < sizeof text) {
            size_t room = sizeof text - (size_t)len;
            memcpy(text + len, err->text, room - 1);
            text[sizeof text - 1] = '\0';
            memcpy(err->text, text, sizeof text);
        }
    }
    return st;
}

rp_status rp_place_replicas(rp_context *ctx, const rp_place_input *in, int32_t *slot_begin,
                            int32_t *phy2log, int32_t *replicas_out, rp_error *err)
{
    int64_t total = 0;
    rp_status st = check_input(in, &total, err);
    if (st != RP_OK) return st;
    if (!slot_begin || !phy2log) return rp_fail(err, RP_EINVAL, "place: slot_begin and phy2log are required");

    int32_t E = in->num_experts, G = in->num_gpus;
    bool hier = in->mode == RP_PLACE_HIERARCHICAL;
    int32_t gpn = hier ? in->gpus_per_node : G;
    int32_t nodes = G / gpn, groups = hier ? in->num_groups : 1;
    int32_t group_size = E / groups;
    size_t ez = (size_t)E, gz = (size_t)G, sz = (size_t)total, grz = (size_t)groups, nz = (size_t)nodes;

    int32_t *ibuf = rp_alloc(ctx, (sz + 7 * gz + 1 + 3 * ez + 2 * grz + nz) * sizeof(int32_t));
    double *dbuf = rp_alloc(ctx, (gz + ez + 2 * grz + 2 * nz) * sizeof(double));
    if (!ibuf || !dbuf) {
        st = rp_fail_nomem(err, "placement scratch");
        goto out;
    }
    int32_t *list = ibuf, *used = list + sz, *stamp = used + G, *begin = stamp + G, /* [G+1] */
        *count = begin + G + 1, *experts = count + E, *local_count = experts + E,
        *group_node = local_count + E, *group_order = group_node + groups, *node_slots = group_order + groups,
        *bfs = node_slots + nodes; /* [4 G] */
    double *gpu_load = dbuf, *local_load = gpu_load + G, *group_load = local_load + E,
           *group_size_w = group_load + groups, *node_cap = group_size_w + groups,
           *node_speed = node_cap + nodes;

    begin[0] = 0;
    for (int32_t g = 0; g < G; g++) {
        begin[g + 1] = begin[g] + in->slots[g];
        used[g] = 0;
        gpu_load[g] = 0;
    }
    for (int32_t n = 0; n < nodes; n++) {
        node_slots[n] = begin[(n + 1) * gpn] - begin[n * gpn];
        node_cap[n] = node_slots[n];
        node_speed[n] = 0;
        for (int32_t g = n * gpn; g < (n + 1) * gpn; g++) node_speed[n] += in->speed ? in->speed[g] : 1.0;
    }

    /* Step 1 (hierarchical): expert groups onto nodes, by group load, an equal number of
     * groups per node, within each node's slots. */
    for (int32_t q = 0; q < groups; q++) {
        group_load[q] = 0;
        group_size_w[q] = 0;
        for (int32_t e = q * group_size; e < (q + 1) * group_size; e++) {
            group_load[q] += in->load[e];
            group_size_w[q] += in->replicas ? in->replicas[e] : 1;
        }
    }
    if (nodes > 1) {
        rp_part_limits lim = {.size = group_size_w, .part_size_cap = node_cap,
                              .max_items = groups / nodes, .speed = in->speed ? node_speed : NULL};
        st = rp_partition_lpt(ctx, group_load, groups, nodes, &lim, group_node, err);
        if (st != RP_OK) {
            wrap_error(err, st, "packing expert groups onto nodes");
            goto out;
        }
    } else {
        for (int32_t q = 0; q < groups; q++) group_node[q] = 0;
    }
    /* EPLB numbers a node's experts in the order its groups were packed (descending
     * group load), experts ascending inside a group: our tie-break order. */
    st = rp_sort_index(ctx, group_load, groups, true, group_order, err);
    if (st != RP_OK) goto out;

    placer pl = {in->load, count, in->speed, in->slots, begin, list, used, stamp, bfs, gpu_load};
    for (int32_t n = 0; n < nodes; n++) {
        int32_t m = 0;
        for (int32_t j = 0; j < groups; j++) {
            int32_t q = group_order[j];
            if (group_node[q] != n) continue;
            for (int32_t e = q * group_size; e < (q + 1) * group_size; e++) experts[m++] = e;
        }
        if (in->replicas) {
            for (int32_t j = 0; j < m; j++) count[experts[j]] = in->replicas[experts[j]];
        } else if (m > 0) {
            /* Step 2: replicas inside the node, filling its slots, at most one per GPU:
             * a GPU holds at most min(slots, m) of them, an expert at most one per GPU
             * that has a slot. */
            int64_t fill = 0;
            int32_t gpus_with_slots = 0;
            for (int32_t g = n * gpn; g < (n + 1) * gpn; g++) {
                fill += in->slots[g] < m ? in->slots[g] : m;
                gpus_with_slots += in->slots[g] > 0;
            }
            for (int32_t j = 0; j < m; j++) local_load[j] = in->load[experts[j]];
            st = rp_replicas_apportion(ctx, local_load, m, (int32_t)fill, gpus_with_slots, local_count, err);
            if (st != RP_OK) {
                if (err && err->expert >= 0) err->expert = experts[err->expert];
                wrap_error(err, st, "apportioning replicas inside a node");
                goto out;
            }
            for (int32_t j = 0; j < m; j++) count[experts[j]] = local_count[j];
        }
        /* Step 3: the node's replicas onto its GPUs. */
        st = place_scope(ctx, &pl, experts, m, n * gpn, (n + 1) * gpn, in->improve_rounds,
                         in->replicas == NULL, err);
        if (st != RP_OK) goto out;
    }

    for (int32_t g = 0; g <= G; g++) slot_begin[g] = begin[g];
    for (int32_t g = 0; g < G; g++)
        for (int32_t t = 0; t < in->slots[g]; t++)
            phy2log[begin[g] + t] = t < used[g] ? list[begin[g] + t] : -1;
    if (replicas_out) memcpy(replicas_out, count, ez * sizeof *count);
out:
    rp_free(ctx, ibuf);
    rp_free(ctx, dbuf);
    return st;
}

rp_status rp_place_gpu_loads(rp_context *ctx, const double *load, int32_t num_experts,
                             int32_t num_gpus, const int32_t *slot_begin, const int32_t *phy2log,
                             const double *speed, double *gpu_load, rp_error *err)
{
    if (num_experts < 1 || num_gpus < 1)
        return rp_fail(err, RP_EINVAL, "gpu_loads: %d experts and %d GPUs, both must be >= 1",
                       num_experts, num_gpus);
    if (!load || !slot_begin || !phy2log || !gpu_load)
        return rp_fail(err, RP_EINVAL, "gpu_loads: load, slot_begin, phy2log and gpu_load are required");
    if (slot_begin[0] != 0) return rp_fail(err, RP_EINVAL, "gpu_loads: slot_begin[0] is %d, not 0", slot_begin[0]);
    for (int32_t g = 0; g < num_gpus; g++) {
        if (slot_begin[g + 1] < slot_begin[g])
            return rp_fail(err, RP_EINVAL, "gpu_loads: slot_begin decreases at GPU %d", g);
        if (speed && (!isfinite(speed[g]) || speed[g] <= 0))
            return rp_fail(err, RP_EINVAL, "gpu_loads: GPU %d has speed %g; it must be finite and > 0", g,
                           speed[g]);
    }
    for (int32_t e = 0; e < num_experts; e++)
        if (!isfinite(load[e]) || load[e] < 0)
            return expert_error(err, RP_EINVAL, e, "gpu_loads: expert %d has load %g; it must be finite and >= 0",
                                e, load[e]);
    int32_t S = slot_begin[num_gpus];
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] < -1 || phy2log[s] >= num_experts)
            return rp_fail(err, RP_EINVAL, "gpu_loads: slot %d holds expert %d, outside [-1, %d)", s,
                           phy2log[s], num_experts);
    int32_t *count = rp_calloc(ctx, (size_t)num_experts, sizeof *count);
    if (!count) return rp_fail_nomem(err, "gpu_loads scratch");
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] >= 0) count[phy2log[s]]++;
    rp_status st = RP_OK;
    for (int32_t e = 0; e < num_experts; e++)
        if (count[e] == 0 && load[e] > 0) {
            st = expert_error(err, RP_EINVAL, e, "gpu_loads: expert %d has load %g but no replica", e, load[e]);
            goto out;
        }
    for (int32_t g = 0; g < num_gpus; g++) {
        double sum = 0;
        for (int32_t s = slot_begin[g]; s < slot_begin[g + 1]; s++)
            if (phy2log[s] >= 0) sum += load[phy2log[s]] / count[phy2log[s]];
        gpu_load[g] = speed ? sum / speed[g] : sum;
    }
out:
    rp_free(ctx, count);
    return st;
}
