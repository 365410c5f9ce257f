/* The rp_stats layout and its constructor from dense counts, shared by the GPU path of
 * rp_stats_compute, the exchange (core/stats_exchange.c) and the tests. Not installed. */
#ifndef RP_STATS_INTERNAL_H
#define RP_STATS_INTERNAL_H

#include "internal.h"
#include "routepack/stats.h"

#include <string.h>

/* Per-sequence histograms are stored densely as [layer][expert] counts, each sequence
 * in the narrowest of 1, 2 or 4 bytes per count that holds its largest count, or in
 * no bytes at all when every count is zero (an empty sequence). `offset` gives each
 * sequence's byte position, so access is O(1). */
struct rp_stats {
    rp_context *ctx;
    int32_t num_seqs, num_layers, num_experts, top_k;
    int64_t num_tokens;
    size_t bytes;            /* everything held, struct included */
    int64_t *expert_load;    /* [num_layers][num_experts] */
    uint8_t *width;          /* [num_seqs]: bytes per count, 0 when all are zero */
    uint64_t *offset;        /* [num_seqs + 1]: byte offset of each sequence's block */
    unsigned char *hist;
    size_t hist_cap;         /* bytes allocated at hist, where a merge made them (so a later
                                merge may write into them: rp_stats_merge_serialized_reusing);
                                0: unknown, never reused */
};

/* Count i of a block stored 2 or 4 bytes a count. A block starts wherever the blocks
 * before it end (L x E x width bytes each), so with an odd L x E it is not aligned:
 * counts are read and written through memcpy, never a uint16_t or uint32_t pointer
 * (compilers turn these into plain loads and stores). */
static inline uint32_t stats_u16_at(const unsigned char *block, size_t i)
{
    uint16_t v;
    memcpy(&v, block + 2 * i, 2);
    return v;
}
static inline uint32_t stats_u32_at(const unsigned char *block, size_t i)
{
    uint32_t v;
    memcpy(&v, block + 4 * i, 4);
    return v;
}
static inline void stats_u16_put(unsigned char *block, size_t i, uint32_t v)
{
    uint16_t h = (uint16_t)v;
    memcpy(block + 2 * i, &h, 2);
}

/* Build statistics from dense counts: seq_hist[(s * num_layers + l) * num_experts + e]
 * for num_seqs sequences (NULL when num_seqs is 0) and expert_load[l * num_experts + e].
 * The result is stored as rp_stats_compute stores it (each sequence in the narrowest
 * width of 1, 2 or 4 bytes holding its largest count, none when all are zero), so a
 * scan of the same routing gives equal statistics (stats_same). num_tokens and top_k
 * are recorded as given. Errors: sizes that overflow memory (RP_ERANGE), no memory. */
rp_status stats_from_counts(rp_context *ctx, int32_t num_seqs, int32_t num_layers,
                            int32_t num_experts, int32_t top_k, int64_t num_tokens,
                            const uint32_t *seq_hist, const int64_t *expert_load,
                            rp_stats **out, rp_error *err);

/* The same from one sequence at a time: row(ud, s, counts) writes sequence s's
 * [num_layers][num_experts] counts into `counts` (it is called once or twice per
 * sequence, with the same result each time), so a caller holding sparse counts (the
 * checkpoint loader) never builds the dense num_seqs x layers x experts array. */
typedef void (*stats_row_fn)(void *ud, int32_t seq, uint32_t *counts);
rp_status stats_from_rows(rp_context *ctx, int32_t num_seqs, int32_t num_layers, int32_t num_experts,
                          int32_t top_k, int64_t num_tokens, stats_row_fn row, void *ud,
                          const int64_t *expert_load, rp_stats **out, rp_error *err);

/* Add sequence `seq`'s counts to 32-bit rows: layer l's num_experts counts to
 * rows + l * stride. The caller knows the sums fit (the cost model checks its batch);
 * `seq` must exist. */
void stats_add_layers(const rp_stats *stats, int32_t seq, int32_t *rows, size_t stride);

/* The sum of one row of `n` native counts of `width` bytes (0, 1, 2 or 4): one loop per
 * width, which the compiler vectorizes, in 32-bit sums where they cannot wrap (up to
 * STATS_NARROW_MAX counts below 2^16). */
static inline int64_t stats_row_sum(const unsigned char *row, int32_t n, int width)
{
    uint64_t sum = 0;
    uint32_t s32 = 0;
    if (width == 4 || n > 65537)
        for (int32_t e = 0; e < n; e++)
            sum += width == 1 ? row[e] : width == 2 ? stats_u16_at(row, (size_t)e) : stats_u32_at(row, (size_t)e);
    else if (width == 1)
        for (int32_t e = 0; e < n; e++) s32 += row[e];
    else if (width == 2)
        for (int32_t e = 0; e < n; e++) s32 += stats_u16_at(row, (size_t)e);
    return (int64_t)(sum + s32);
}

/* 32-bit partial loads of 1- and 2-byte counts (rp_stats_microbatch_loads, the merge):
 * stats_add_narrow adds `cells` counts of `width` 1 or 2 to acc; after STATS_NARROW_MAX
 * such adds (65537 x 65535 = 2^32 - 1: no wrap) stats_flush_loads adds acc to the 64-bit
 * loads and zeroes it. */
#define STATS_NARROW_MAX 65537
void stats_add_narrow(uint32_t *acc, const unsigned char *counts, int width, size_t cells);
/* The same while copying the counts from `from` to `to` (one pass over them). */
void stats_copy_add_narrow(uint32_t *acc, unsigned char *to, const unsigned char *from, int width, size_t cells);
void stats_flush_loads(int64_t *loads, uint32_t *acc, size_t cells);

/* A copy of `stats` allocated through ctx (the scheduler keeps the last step's
 * inputs). Errors: no memory. */
rp_status stats_copy(rp_context *ctx, const rp_stats *stats, rp_stats **out, rp_error *err);

/* stats_copy into the storage of *spare (statistics no longer needed; NULL: none) when
 * its sequences, layers and experts match, so a caller that copies every step (the
 * scheduler) writes into memory it already touched instead of new pages; *spare is then
 * taken (NULL), or freed when it does not fit. On error (no memory) *spare stays as it
 * was and nothing is returned. */
rp_status stats_copy_reusing(rp_context *ctx, const rp_stats *stats, rp_stats **spare, rp_stats **out,
                             rp_error *err);

/* Seam for the benchmark and the tests: when true, rp_stats_compute's CPU scan takes the
 * portable path for every view (each block of ids copied into a private snapshot,
 * checked, then counted), never the kernel for dense uint8 ids with top-k a multiple of
 * 8; both give bit-identical statistics and errors. false (the default) outside
 * bench_stats and test_stats. */
extern bool stats_portable_scan;

/* True when a and b hold the same statistics in the same storage: every count, width,
 * offset, load and size. */
bool stats_same(const rp_stats *a, const rp_stats *b);

#endif
