/* The microbatch caps of a config's limits (core/limits.c). */
#ifndef RP_LIMITS_INTERNAL_H
#define RP_LIMITS_INTERNAL_H

#include "routepack/batch.h"
#include "routepack/config.h"

/* The largest token count of one microbatch on one GPU: the token cap, lowered by the
 * activation memory cap when there is one. */
int64_t rp_limits_token_cap(const rp_limits *lim);

/* Every mini-batch runs the same count of microbatches, a multiple of
 * trainer.microbatch_multiple: a plan's count is a multiple of this step,
 * trainer.mini_batches x trainer.microbatch_multiple. */
int32_t rp_limits_microbatch_step(const rp_config *cfg);

/* The fewest microbatches a plan of `tokens` tokens may run (where the joint planner's
 * packing starts): the token cap's ceil(tokens / (DP ranks x cap)), at least 1, rounded
 * up to rp_limits_microbatch_step (verl's num_batches_divided_by, per mini-batch). */
int64_t rp_limits_least_microbatches(const rp_config *cfg, int64_t tokens);

/* Microbatches a plan for `batch` is expected to have: limits.num_microbatches when set,
 * else the fewest the caps, trainer.mini_batches and microbatch_multiple allow
 * (rp_limits_least_microbatches): the joint planner's first try. */
int64_t rp_limits_expected_microbatches(const rp_config *cfg, const rp_batch *batch);

/* RP_ERANGE when some sequence cannot fit one microbatch under either cap; the message
 * names the longest sequence, the cap it breaks and the config key to raise (err->sequence
 * is set). RP_OK for an empty batch. */
rp_status rp_limits_check_batch(const rp_limits *lim, const rp_batch *batch, rp_error *err);

#endif
