/* Device-side reads of a routing replay that every kernel over it needs (histogram.cu,
 * shift.cu): the sequence that holds a global token, and an expert id as uint32 in any id
 * width. One copy, so the kernels cannot drift apart on either. */
#ifndef RP_KERNELS_ROUTING_ACCESS_CUH
#define RP_KERNELS_ROUTING_ACCESS_CUH

#include <cstdint>

namespace rp_kernels {

/* Index of the sequence holding global token `tok` in cu_seqlens `cu` (n + 1 entries,
 * non-decreasing): the last s with cu[s] <= tok. The sequence found is never empty,
 * since cu[s + 1] > tok. */
__device__ inline int32_t seq_of(const int64_t *cu, int32_t n, int64_t tok)
{
    int32_t lo = 0, hi = n; /* first i in [0, n] with cu[i] > tok */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (cu[mid] > tok) hi = mid;
        else lo = mid + 1;
    }
    return lo - 1;
}

/* Id i of an array of T (uint8_t, uint16_t or int32_t) as uint32: negative int32 ids
 * become huge, so one compare `id < experts` checks both ends. */
template <typename T>
__device__ __forceinline__ uint32_t id_at(const T *base, int64_t i)
{
    return (uint32_t)base[i];
}

/* The same for an id width known only at run time (rp_id_width: 1, 2 or 4 bytes). */
__device__ __forceinline__ uint32_t id_at(const void *base, int width, int64_t i)
{
    switch (width) {
    case 1: return id_at(static_cast<const uint8_t *>(base), i);
    case 2: return id_at(static_cast<const uint16_t *>(base), i);
    default: return id_at(static_cast<const int32_t *>(base), i);
    }
}

} // namespace rp_kernels

#endif
