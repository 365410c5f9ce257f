/* The replica table shared by the CPU remap (core/remap.c) and its CUDA kernel
 * (kernels/remap.cu): which physical ids each (layer, expert, source) may dispatch to,
 * and the integer split rule both compute bit for bit. Not installed. */
#ifndef RP_REMAP_INTERNAL_H
#define RP_REMAP_INTERNAL_H

#include "routepack/remap.h"

#ifdef __CUDACC__
#define RP_HD __host__ __device__
#else
#define RP_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Fixed-point shares: the weights of one share set sum to exactly 2^32. */
#define REMAP_ONE (1ULL << 32)

enum { REMAP_ROUND_ROBIN = 0, REMAP_SHARES = 1 };

/* Where (layer, expert) tokens of one source go. count == 1: all to physical id
 * `first`. count > 1: to the `count` candidates cand_phys[first ..], split by `mode`;
 * `key` numbers the (layer, expert) among those split for some source (the counter
 * the occurrence index runs on). 16 bytes, the same layout on the device. */
typedef struct remap_cand {
    int32_t first, count, key, mode;
} remap_cand;

typedef struct remap_table {
    int32_t G, ep, Q, L, E, S, P, mb, k;
    int32_t gpus_per_node;
    int32_t nsrc;          /* sources the table distinguishes: ep, or G when nodes cut groups unevenly */
    int32_t num_keys;      /* split (layer, expert) pairs */
    int32_t share_slots;   /* candidates of all keys with shares (bounds per source) */
    remap_cand *cand;      /* [L][E][nsrc] */
    int32_t *cand_phys;    /* candidate lists */
    uint64_t *weight;      /* [num_cand] fixed-point shares (REMAP_SHARES lists only) */
    int64_t num_cand;
    int32_t *key_layer, *key_expert; /* [num_keys] */
    int32_t *key_bofs;     /* [num_keys] offset of a share key's bounds, -1 otherwise */
    int32_t *key_first, *key_count;  /* [num_keys] the share key's list (the same for every source) */
    int32_t *phys_rank;    /* [L][P] EP rank holding each physical id, -1 unused */
    int32_t *seq_gpu;      /* [num_seqs] source GPU of each sequence of the microbatch, -1 other */
    int32_t *order;        /* the microbatch's sequences, GPU by GPU in list order */
    int32_t *gpu_begin;    /* [G + 1] each GPU's range of `order` */
    int32_t num_seqs, num_order;
} remap_table;

/* Build the table for microbatch `mb` and check plan, config, batch and routing
 * against each other (routing NULL: only its layer count `num_layers` and `top_k` are
 * used; ids are not read). */
rp_status remap_table_build(rp_context *ctx, const rp_plan *plan, const rp_config *cfg, int32_t mb,
                            const rp_batch *batch, int32_t num_layers, int32_t top_k,
                            rp_split_rule rule, remap_table *t, rp_error *err);
void remap_table_free(rp_context *ctx, remap_table *t);

/* The table's index of the source GPU `g`. */
static inline RP_HD int32_t remap_src(int32_t g, int32_t ep, int32_t nsrc)
{
    return nsrc == ep ? g % ep : g;
}

/* Largest-remainder apportionment of `total` occurrences over r fixed-point weights
 * (summing to 2^32): candidate i gets floor(total w_i / 2^32), plus one if its
 * remainder is among the `left` largest (ties to the lower index), where `left` is
 * what the floors leave over. Integers only, so CPU and GPU agree. Requires
 * total < 2^31 (total w_i < 2^63). */
static inline RP_HD int64_t remap_share_n(int64_t total, const uint64_t *w, int32_t r, int32_t i)
{
    int64_t sum = 0, above = 0;
    const uint64_t qi = (uint64_t)total * w[i], ri = qi & 0xffffffffULL;
    for (int32_t j = 0; j < r; j++) {
        const uint64_t qj = (uint64_t)total * w[j], rj = qj & 0xffffffffULL;
        sum += (int64_t)(qj >> 32);
        above += rj > ri || (rj == ri && j < i);
    }
    return (int64_t)(qi >> 32) + (above < total - sum ? 1 : 0);
}

/* The running sums cum[i] = n_0 + ... + n_i of remap_share_n: occurrence o goes to the
 * first candidate i with o < cum[i]. */
static inline RP_HD void remap_apportion(int64_t total, const uint64_t *w, int32_t r, int64_t *cum)
{
    int64_t run = 0;
    for (int32_t i = 0; i < r; i++) {
        run += remap_share_n(total, w, r, i);
        cum[i] = run;
    }
}

/* Round robin: occurrence o of a source at EP rank js goes to candidate (o + js) mod
 * count; this many of `total` occurrences land on candidate p. */
static inline RP_HD int64_t remap_rr_count(int64_t total, int32_t count, int32_t js, int32_t p)
{
    const int32_t o0 = (int32_t)((((int64_t)p - js) % count + count) % count);
    return total > o0 ? (total - 1 - o0) / count + 1 : 0;
}

/* Add `total` occurrences of (layer, expert) from source GPU g to the counts of the
 * physical ids of its EP group, slot_tokens[(l * Q + q) * P + p], as the split rule
 * distributes them (closed form: the kernel's counts come from this). */
void remap_add_counts(const remap_table *t, int32_t g, int32_t l, int32_t e, int64_t total,
                      int64_t *slot_tokens);

#ifdef __cplusplus
}
#endif
#endif
