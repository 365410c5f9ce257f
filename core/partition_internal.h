/* What the partitioning primitives share: the resolved limits, the stable sort and the
 * input checks of core/partition.c, used by the Karmarkar-Karp file beside it. */
#ifndef RP_PARTITION_INTERNAL_H
#define RP_PARTITION_INTERNAL_H

#include "internal.h"
#include "routepack/primitives.h"

/* Limits resolved from an optional rp_part_limits. */
typedef struct limits_view {
    const double *size;
    const double *part_cap;
    double cap;
    int32_t max_items;
    const double *speed;
} limits_view;

static inline double part_cap_of(const limits_view *lv, int32_t p)
{
    return lv->part_cap ? lv->part_cap[p] : lv->cap;
}

static inline bool part_fits(const limits_view *lv, const double *psize, const int32_t *pcount,
                        int32_t p, int32_t item)
{
    if (lv->max_items > 0 && pcount[p] >= lv->max_items) return false;
    if (lv->size && psize[p] + lv->size[item] > part_cap_of(lv, p)) return false;
    return true;
}

/* A stable permutation of v's n indices, ascending or descending (tmp: n scratch). */
void part_sort_perm(const double *v, int32_t n, bool desc, int32_t *perm, int32_t *tmp);
/* rp_fail with the failing item in err->sequence. */
rp_status part_item_error(rp_error *err, rp_status status, int32_t item, const char *fmt, ...) RP_PRINTF(4, 5);
rp_status part_check_weights(const char *fn, const char *what, const double *w, int32_t n, rp_error *err);
rp_status part_check_shape(const char *fn, int32_t n, int32_t k, const int32_t *part, rp_error *err);
/* Check the limits and the caps that no partition can meet, resolving them into lv. */
rp_status part_check_limits(const char *fn, const rp_part_limits *lim, int32_t n, int32_t k,
                            limits_view *lv, rp_error *err);

#endif
