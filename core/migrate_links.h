/* The one rule that prices moving expert weights (docs/cost-model.md, "Migration"): an
 * expert lives on one EP rank, an ETP group of ETP GPUs, so its bytes run over those
 * GPUs' links, not over the whole DP rank's. The migration plan's predicted time
 * (migrate_plan.c), the cost model's estimate (cost_migrate.c, rp_cost_expert_move_s)
 * and the joint planner's per-layer migration (joint_place.c) all price with it. */
#ifndef RP_MIGRATE_LINKS_H
#define RP_MIGRATE_LINKS_H

#include "routepack/config.h"

typedef struct migrate_links {
    int32_t ep_ranks;        /* EP ranks of one DP rank: TP x CP / ETP (parallel folding) */
    double nv_bw, net_bw;    /* one EP rank's, per direction: ETP x one GPU's */
    double nv_lat, net_lat;  /* one GPU's: a copy pays its link's latency once */
    double hbm_bw;           /* one EP rank's HBM: ETP x one GPU's */
} migrate_links;

/* EP ranks of one DP rank of `t`: TP x CP / ETP. */
int32_t migrate_links_ep_ranks(const rp_topology *t);

/* The links of one EP rank of `t`, with one GPU's HBM bandwidth `hbm_bytes_per_s`. */
void migrate_links_init(migrate_links *ml, const rp_topology *t, double hbm_bytes_per_s);

/* Seconds one EP rank is busy: `nv_bytes` over NVLink and `net_bytes` over the network
 * (each the larger of what it sends and receives on that link: links are full duplex),
 * one latency per link it uses, and `hbm_bytes` read and written in its memory. */
double migrate_links_s(const migrate_links *ml, double nv_bytes, double net_bytes, double hbm_bytes);

/* Which of a DP rank's `ep_ranks` EP ranks holds its local slot `slot` of `slots`: the
 * first slots / ep_ranks to the first, and so on (docs/cost-model.md, "TP and ETP"). */
static inline int32_t migrate_links_ep_rank(int32_t ep_ranks, int32_t slots, int32_t slot)
{
    return slots > 0 ? (int32_t)((int64_t)slot * ep_ranks / slots) : 0;
}

/* The first local slot of EP rank `u` of a DP rank with `slots` slots: EP rank u holds
 * [first(u), first(u + 1)), the inverse of migrate_links_ep_rank. */
static inline int32_t migrate_links_first_slot(int32_t ep_ranks, int32_t slots, int32_t u)
{
    return (int32_t)(((int64_t)u * slots + ep_ranks - 1) / ep_ranks);
}

#endif
