/* The memory module's private contract with plan validation and the joint planner. */
#ifndef RP_MEMORY_INTERNAL_H
#define RP_MEMORY_INTERNAL_H

#include "routepack/memory.h"

/* Bytes of one extra replica held for a step: weights and gradient buffer. */
double memory_extra_replica_bytes(const rp_config *cfg);
/* The memory of GPU j (EP rank j of group 0, standing for its EP rank in every group)
 * for j < ep_size, into per_rank[ep_size]. Errors: a plan of another shape, no memory. */
rp_status memory_per_rank(const rp_config *cfg, const rp_plan *plan, rp_gpu_memory *per_rank, rp_error *err);

#endif
