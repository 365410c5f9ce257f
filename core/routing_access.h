/* Where the ids of one (sequence, layer) start in a routing view, whatever its layout.
 * Not installed. */
#ifndef RP_ROUTING_ACCESS_H
#define RP_ROUTING_ACCESS_H

#include "internal.h"
#include "routepack/batch.h"

/* Address of the id of (token 0 of `seq`, `layer`, choice 0); the next token is
 * token_stride ids further, the next choice k_stride ids further. */
static inline const void *rp_routing_at(const rp_routing *r, const int64_t *cu_seqlens,
                                        int32_t seq, int32_t layer)
{
    const char *base;
    int64_t elem;
    switch (r->layout) {
    case RP_ROUTING_PER_SEQ:
        base = (const char *)r->bases[seq];
        elem = (int64_t)layer * r->layer_stride;
        break;
    case RP_ROUTING_PER_LAYER:
        base = (const char *)r->bases[layer];
        elem = cu_seqlens[seq] * r->token_stride;
        break;
    default:
        base = (const char *)r->base;
        elem = cu_seqlens[seq] * r->token_stride + (int64_t)layer * r->layer_stride;
        break;
    }
    return base + elem * (int64_t)r->width;
}

/* Test seam: when set, the CPU scans that read routing ids (statistics, remap) call it
 * where, before each id was read once, a buffer changed by another thread turned a
 * checked id into an unchecked one: between checking a block of ids and counting it
 * (statistics), between the remap's checking and assigning passes. Tests change the
 * routing there (tests/test_stats.c, tests/test_remap.c); NULL otherwise. */
extern void (*routing_scan_hook)(void);

/* Shape, layout and stride checks of rp_routing_check, without scanning the ids. */
rp_status rp_routing_check_shape(const rp_routing *r, const rp_batch *batch,
                                 int32_t num_experts, rp_error *err);

#endif
