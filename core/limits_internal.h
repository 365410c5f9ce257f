/* The microbatch caps of a config's limits (core/limits.c). */
#ifndef RP_LIMITS_INTERNAL_H
#define RP_LIMITS_INTERNAL_H

#include "routepack/batch.h"
#include "routepack/config.h"

/* The largest token count of one microbatch on one GPU: the token cap, lowered by the
 * activation memory cap when there is one. */
int64_t rp_limits_token_cap(const rp_limits *lim);

/* RP_ERANGE when some sequence cannot fit one microbatch under either cap; the message
 * names the longest sequence, the cap it breaks and the config key to raise (err->sequence
 * is set). RP_OK for an empty batch. */
rp_status rp_limits_check_batch(const rp_limits *lim, const rp_batch *batch, rp_error *err);

#endif
