/* trainer.nonempty_microbatches: every (rank, microbatch) cell runs a sequence (verl's
 * micro-batch partitioning asserts it). The joint packers keep it as a rule of their
 * greedy fill (joint_pack_open); the baselines pack as verl does (Karmarkar-Karp, which
 * leaves a cell empty only after the cap repair or with fewer sequences than cells), then
 * fill each empty cell from the fullest cell (nonempty.c). Not installed. */
#ifndef RP_NONEMPTY_INTERNAL_H
#define RP_NONEMPTY_INTERNAL_H

#include "internal.h"
#include "routepack/batch.h"

/* RP_EINVAL, naming the numbers and the key, when N sequences cannot fill G x M cells;
 * "who" prefixes the message ("joint", "baseline"). */
rp_status rp_nonempty_check_counts(int32_t N, int32_t G, int32_t M, const char *who, rp_error *err);

/* seq_rank[s], seq_mb[s]: sequence s's cell, over G ranks and M microbatches, which are
 * K mini-batches of M / K consecutive ones (trainer.mini_batches). Each empty cell takes
 * the shortest sequence (tokens of batch, then the lower id) of the fullest cell of its
 * own rank and mini-batch (most sequences, then the lower microbatch); with
 * keep_rank_counts false, when there is none, of the fullest cell of its mini-batch on any
 * rank, then of any cell. With keep_rank_counts no sequence leaves its (rank, mini-batch).
 * A cell that holds one sequence is never a donor, so no cell empties. RP_EINVAL, naming
 * the numbers and the key, when the batch (or, with keep_rank_counts, a rank's
 * mini-batch) has fewer sequences than cells; "who" prefixes the message ("joint",
 * "baseline"). Nothing changes then. */
rp_status rp_fill_empty_cells(rp_context *ctx, const rp_batch *batch, int32_t G, int32_t M, int32_t K,
                              int32_t *seq_rank, int32_t *seq_mb, bool keep_rank_counts, const char *who,
                              rp_error *err);

#endif
