/* C primitives that packing and placement policies compose: sorting, LPT, Karmarkar-Karp,
 * two-criteria partitioning, replica apportionment and placement. Pure, on arrays. */
#ifndef ROUTEPACK_PRIMITIVES_H
#define ROUTEPACK_PRIMITIVES_H

#include "routepack/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Contract shared by every function in this header:
 *
 * - Deterministic: the result depends only on the input values and their order. Ties
 *   are broken by the lower index (item, part, expert or GPU), never by an address or
 *   a hash order, so every rank computes the same answer from the same inputs.
 * - Bounded: the work is bounded by the input size (each function gives its
 *   complexity); no loop runs until a floating-point condition happens to hold.
 * - Validated: NULL arrays, counts out of range, NaN, infinite or negative weights are
 *   RP_EINVAL; caps that cannot be met are RP_ERANGE. The message names the offending
 *   item ("lpt: item 17 has weight nan"); its index is also stored in err->sequence
 *   (items of a partition, which are usually sequences) or err->expert (experts).
 * - All or nothing: output arrays are written only on success. Scratch memory comes
 *   from `ctx` and is freed before returning; an allocation failure is RP_ENOMEM.
 * - `err` may be NULL everywhere.
 */

/* ---- sorting ---- */

/* Stable argsort: idx[0..n) receives the indices of `values` ordered ascending (or
 * descending), equal values in ascending index order (in both directions).
 * O(n log n) time, O(n) scratch. Errors: n < 0, NULL arrays with n > 0, a NaN value. */
RP_API rp_status rp_sort_index(rp_context *ctx, const double *values, int32_t n, bool descending,
                               int32_t *idx, rp_error *err);

/* The k largest values: idx[0..k) receives their indices, largest first, equal values
 * in ascending index order (the first k entries of a descending rp_sort_index).
 * O(n log k) time, O(k) scratch. Errors: k < 1 (RP_EINVAL), k > n (RP_ERANGE), NaN. */
RP_API rp_status rp_sort_topk(rp_context *ctx, const double *values, int32_t n, int32_t k,
                              int32_t *idx, rp_error *err);

/* ---- k-way partitioning ----
 * Items 0..n-1 with weights >= 0 go into parts 0..k-1; the result is part[i], the part
 * of item i. A part's load is the sum of its items' weights divided by its speed. */

/* Optional limits and speeds of a partition. Pass NULL for none; a zeroed struct
 * also means none. */
typedef struct rp_part_limits {
    /* Second size of each item (e.g. tokens), [n], each >= 0 and finite. NULL: no size
     * cap. A part's total size must stay <= its cap: part_size_cap[p] when that array
     * is given ([k], each >= 0), else size_cap (>= 0) for every part. */
    const double *size;
    double size_cap;
    const double *part_size_cap;
    /* Most items a part may hold; 0: no limit. */
    int32_t max_items;
    /* Relative speed of each part, [k], each > 0 and finite; NULL: all 1. */
    const double *speed;
} rp_part_limits;

/* LPT (longest processing time first, Graham 1969). Items in descending weight order
 * (ties: lower index first) each go to the part where they finish earliest, i.e. the
 * least (load_p * speed_p + w) / speed_p, among the parts where they fit (size cap,
 * item limit); ties: lower part index. With equal speeds that is the least-loaded
 * part, and the makespan is within 4/3 - 1/(3k) of the optimum (without caps).
 * An item that fits in no part is RP_ERANGE naming the item (LPT is greedy: a feasible
 * partition may exist that it does not find; an item bigger than every cap, or more
 * items than k * max_items, are reported as such before anything is placed).
 * O(n log n + n log k) without size caps or speeds, O(n log n + n k) with them;
 * O(n + k) scratch. Errors: k < 1, n < 0, bad weights, sizes, caps or speeds. */
RP_API rp_status rp_partition_lpt(rp_context *ctx, const double *weight, int32_t n, int32_t k,
                                  const rp_part_limits *limits, int32_t *part, rp_error *err);

/* Karmarkar-Karp largest differencing method for k parts, as verl's
 * get_seqlen_balanced_partitions (verl/utils/seqlen_balancing.py) computes it: items
 * sorted ascending by (weight, index) become partial solutions ("states" of k sets:
 * one item each, or with `equal_size` each run of k consecutive sorted items, one per
 * set); the two states with the largest spread (largest set sum - smallest; ties: the
 * one whose largest set compares larger) are merged, the largest set of one with the
 * smallest of the other, until one state remains. The priority queue reproduces
 * Python's heapq exactly, and sets compare as verl's do (sum, then item count, then
 * item list), so the same weights give verl's partition, part p being verl's p-th
 * partition (parts in descending order of their sums).
 * Where it departs from verl: n < k is allowed (some parts stay empty) in the default
 * mode; weights are doubles (verl uses integers: equal for integer weights < 2^53); and
 * caps, which verl does not have, are enforced by a repair pass after the merge:
 * - default mode: each part over its size cap or item limit, in part order, gives up
 *   items (for a size cap: largest size first; for the item limit: lightest weight
 *   first) to the part that fits them with the least resulting load;
 * - equal_size mode: a part over its size cap swaps its largest-size item for a
 *   smaller-size item of another part (tried in ascending load order; the swap partner
 *   closest in weight), keeping every part at n / k items.
 * A part the repair cannot fix is RP_ERANGE naming the item that fits nowhere.
 * `equal_size` requires n divisible by k (else RP_EINVAL) and max_items >= n / k.
 * Speeds are not supported (RP_EINVAL): differencing assumes identical parts; use LPT.
 * O(n log n + n k log k) time and O(n + k * live states) scratch without caps; the
 * default-mode repair adds O(n log n + n k), the equal-size repair at most n swaps of
 * O(n) each. */
RP_API rp_status rp_partition_kk(rp_context *ctx, const double *weight, int32_t n, int32_t k,
                                 bool equal_size, const rp_part_limits *limits, int32_t *part,
                                 rp_error *err);

/* Two-criteria partitioning: items with two weights (w1: attention cost, w2: tokens)
 * into k parts, minimising
 *     objective = max over p of max(W1_p / (speed_p * A1), W2_p / (speed_p * A2))
 * where W_p is the part's sum and A = (sum over items) / (sum of speeds) is the
 * perfectly balanced load per unit speed (a criterion whose total is 0 contributes 0).
 * A perfect partition scores 1. Limits (size cap, item limit, speeds) as for LPT; the
 * size is typically the token count itself, with the token cap.
 * Greedy: items in descending order of max(w1/A1, w2/A2) (ties: lower index) go to the
 * fitting part with the least resulting part objective (ties: least sum of the two
 * normalised loads, then lower index). Then up to `max_rounds` improvement rounds: a
 * round takes the part with the largest objective (ties: lower index), evaluates every
 * move of one of its items to another part and every swap with an item of another part
 * that keeps both parts within their limits, and applies the one giving the smallest
 * max of the two parts' objectives if that is smaller than the part's objective (ties:
 * first in the order items of the part by index, other parts by index, the move before
 * the swaps, partner items by index). A round with no such change ends the search.
 * Every applied change lowers the sorted vector of part objectives lexicographically,
 * so the search never cycles.
 * `objective` (may be NULL) receives the final objective. O(n log n + n k) for the
 * greedy plus O(n * |largest part|) per round; O(n + k) scratch.
 * Errors: as for LPT, plus max_rounds < 0. */
RP_API rp_status rp_partition_two_criteria(rp_context *ctx, const double *w1, const double *w2,
                                           int32_t n, int32_t k, const rp_part_limits *limits,
                                           int32_t max_rounds, int32_t *part, double *objective,
                                           rp_error *err);

/* The two-criteria objective of a given partition (speeds may be NULL), computed as
 * rp_partition_two_criteria reports it. O(n + k) time and O(k) scratch.
 * Errors: bad weights or speeds, a part index out of [0, k). */
RP_API rp_status rp_partition_objective2(rp_context *ctx, const double *w1, const double *w2,
                                         int32_t n, int32_t k, const double *speed,
                                         const int32_t *part, double *objective, rp_error *err);

/* ---- replicas ---- */

/* Replica apportionment: num_slots >= num_experts replicas over the experts. Each
 * expert gets one; then each next replica goes to the expert with the largest load
 * per replica, load / count (ties: fewer replicas, then lower expert index), skipping
 * experts that have `max_replicas` (0: no limit). counts[num_experts] receives the
 * counts, which sum to num_slots. This minimises the max over experts of load/count,
 * among all allocations with the same limits (proof in core/replicas.c); it is
 * DeepSeek EPLB's replicate_experts, except that EPLB breaks exact ties by index only.
 * O(E + (S - E) log E) time, O(E) scratch. Errors: E < 1, num_slots < E or above
 * E * max_replicas (RP_ERANGE), NaN, infinite or negative loads (naming the expert). */
RP_API rp_status rp_replicas_apportion(rp_context *ctx, const double *load, int32_t num_experts,
                                       int32_t num_slots, int32_t max_replicas, int32_t *counts,
                                       rp_error *err);

/* ---- replica-to-GPU assignment ---- */

typedef enum rp_place_mode {
    /* All replicas, heaviest first (load / count; ties: lower expert), each to the GPU
     * of the EP group that finishes it earliest (the least-loaded with equal speeds)
     * among those with a free slot that do not hold the expert yet: DeepSeek EPLB's
     * balanced_packing, generalised to uneven slots and speeds. */
    RP_PLACE_GLOBAL = 0,
    /* DeepSeek EPLB's rebalance_experts_hierarchical: expert groups (num_groups
     * contiguous blocks of experts) are packed onto nodes first (LPT by group load,
     * num_groups / num_nodes groups per node), then replicas are apportioned inside
     * each node (when `replicas` is NULL), then each node's replicas are placed on its
     * GPUs as in the global mode. Every expert stays inside its group's node. */
    RP_PLACE_HIERARCHICAL = 1
} rp_place_mode;

typedef struct rp_place_input {
    int32_t num_experts;       /* E >= 1 */
    const double *load;        /* [E] load of each expert (tokens routed to it), >= 0 */
    /* [E] replica count of each expert (>= 1, at most the GPUs of its scope: the EP
     * group, or its node in the hierarchical mode; they sum to at most the slots).
     * NULL: apportioned here with rp_replicas_apportion over the whole group (global)
     * or over each node's slots after its groups are chosen (hierarchical, as EPLB),
     * filling every slot that can hold a distinct expert (a GPU holds at most one
     * replica of each; an expert at most one per GPU with a slot). Where uneven slots
     * make the apportioned counts impossible to place, the replica that finds no GPU
     * is dropped and its slot left empty (replicas_out says so). */
    const int32_t *replicas;
    int32_t num_gpus;          /* G: GPUs of the EP group, node-major */
    const int32_t *slots;      /* [G] expert slots of each GPU, >= 0 (may differ) */
    const double *speed;       /* [G] relative speed, > 0; NULL: all 1 */
    rp_place_mode mode;
    int32_t gpus_per_node;     /* hierarchical: divides G; nodes are blocks of GPUs */
    int32_t num_groups;        /* hierarchical: divides E; a multiple of G / gpus_per_node */
    /* After the greedy, up to this many rounds of local improvement in each scope: the
     * most loaded GPU (load / speed; ties: lower index) moves one replica to a GPU with
     * a free slot or swaps it with another GPU's replica, the change that most lowers
     * the larger of the two loads, if any does. 0: the greedy alone, as EPLB. */
    int32_t improve_rounds;
} rp_place_input;

/* Assign replicas to the GPUs of one EP group. A GPU's load is the sum of
 * load / count over the replicas it holds, divided by its speed. Guarantees: no GPU
 * holds two replicas of one expert, no GPU more replicas than its slots, every expert
 * at least one replica. When the greedy choice finds no GPU for a replica (every GPU
 * with a free slot already holds its expert), a repair reassigns a chain of replicas
 * (an augmenting path, shortest first) to free a place; it finds one whenever the
 * counts can be placed at all, so RP_ERANGE (naming the expert) means they cannot.
 * Outputs: slot_begin[G + 1] (GPU g owns slots [slot_begin[g], slot_begin[g+1]),
 * the prefix sums of `slots`), phy2log[slot_begin[G]] (the expert in each slot, in the
 * order the GPU received them, -1 for empty slots, which come last), and, if not NULL,
 * replicas_out[E] (the counts used). Where it departs from EPLB: uneven slots and
 * speeds, the no-duplicate rule (EPLB can put two replicas of an expert on one GPU),
 * stable tie-breaking (EPLB sorts with torch's unstable sort) and no identity shortcut
 * when a pack holds one item (EPLB keeps group g on node g there: same loads).
 * O(R log R + R G) for R replicas, plus the apportionment, plus O(G^2 slots^2) per
 * repair and O(slots_max * G * slots_max) per improvement round; O(E + G + R) scratch.
 * Errors: counts or shapes out of range, bad loads or speeds, a hierarchical shape
 * EPLB would reject (groups not divisible by nodes: use the global mode). */
RP_API rp_status rp_place_replicas(rp_context *ctx, const rp_place_input *in, int32_t *slot_begin,
                                   int32_t *phy2log, int32_t *replicas_out, rp_error *err);

/* Per-GPU loads of a placement: gpu_load[g] = sum over g's slots of load[e] / count[e]
 * (count[e]: e's replicas in phy2log) / speed[g] (speed NULL: 1). O(S + E + G).
 * Errors: an expert id out of range, an expert with load > 0 and no replica. */
RP_API rp_status rp_place_gpu_loads(rp_context *ctx, const double *load, int32_t num_experts,
                                    int32_t num_gpus, const int32_t *slot_begin,
                                    const int32_t *phy2log, const double *speed, double *gpu_load,
                                    rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
