/* CUDA kernels for the routing statistics (dense per-(sequence, layer) expert
 * histograms, per-layer expert loads, per-microbatch loads of a packing) and the host
 * wrappers of routepack/gpu.h. Their CPU reference is core/stats.c. */
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

extern "C" {
#include "internal.h"
}
#include "routepack/gpu.h"
#include "routing_access.cuh"

namespace {

using rp_kernels::id_at;
using rp_kernels::seq_of;

constexpr int kThreads = 512;
/* Tokens per block: large enough that the per-block cost (clearing and flushing the
 * shared histogram) is small next to the ids counted, small enough for many blocks. */
constexpr int64_t kMinChunkTokens = 256, kMaxChunkTokens = 4096;
constexpr int kMaxSeqGroups = 128; /* blocks per column in the load reduction */

/* A packed routing view, flattened for the kernels. Element (t, l, j) of global token t
 * sits at base[t * ts + l * ls + j * ks]. */
struct view {
    const void *base;
    int64_t ts, ls, ks;
    int32_t layers, k;
};

/* Written by the kernels, read once by the host. */
struct flags {
    int bad_seq;                /* lowest sequence with an id out of range */
    int bad_cu;                 /* lowest s with cu[s+1] < cu[s] (or cu[0] < 0) */
    int bad_map;                /* lowest sequence with a microbatch out of range */
    int pad;
    unsigned long long bad_key; /* first bad id of bad_seq, in (layer, token, choice) order */
};

/* Count ids [e0, e1) of a dense view (each token a contiguous record of R = layers * k
 * ids, the record of token t at t * R) into the shared histogram [layers][experts].
 * The body reads 16 bytes per thread per load (base is 16-byte aligned), four loads in
 * flight before the first is used. Returns true if an id was out of range. */
template <typename T>
__device__ bool count_dense(const T *base, int64_t e0, int64_t e1, int32_t R, int32_t k,
                            int32_t layers, uint32_t experts, uint32_t *sh)
{
    constexpr int V = 16 / sizeof(T);
    constexpr int U = 4;
    bool bad = false;
    const int tid = threadIdx.x, nthr = blockDim.x;
    auto one = [&](int64_t e) {
        uint32_t id = id_at(base, e);
        int32_t l = (int32_t)((e % R) / k);
        if (id < experts) atomicAdd(&sh[l * experts + id], 1u);
        else bad = true;
    };
    const int64_t head_end = min(e1, (e0 + V - 1) / V * V);
    const int64_t vb = head_end / V, ve = e1 / V; /* whole vectors [vb, ve) */
    for (int64_t e = e0 + tid; e < head_end; e += nthr) one(e);
    for (int64_t e = max(ve * V, head_end) + tid; e < e1; e += nthr) one(e);
    if (vb >= ve) return bad;

    const uint4 *vec = reinterpret_cast<const uint4 *>(base);
    /* Position within the record of each vector's first id, kept incrementally: it
     * advances by a fixed step per iteration, so no 64-bit division in the loop. */
    int32_t r[U];
    for (int u = 0; u < U; u++) r[u] = (int32_t)(((vb + tid + (int64_t)u * nthr) * V) % R);
    const int32_t ustep = (int32_t)(((int64_t)U * nthr * V) % R);
    for (int64_t v0 = vb + tid; v0 < ve; v0 += (int64_t)U * nthr) {
        uint4 w[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (v0 + (int64_t)u * nthr < ve) w[u] = __ldg(vec + v0 + (int64_t)u * nthr);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (v0 + (int64_t)u * nthr >= ve) break;
            int32_t l = r[u] / k, j = r[u] - l * k;
            uint32_t *row = sh + l * experts;
            const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
            for (int i = 0; i < V; i++) {
                uint32_t word = words[i * (int)sizeof(T) / 4];
                uint32_t id;
                if (sizeof(T) == 1) id = (word >> (8 * (i % 4))) & 0xFFu;
                else if (sizeof(T) == 2) id = (word >> (16 * (i % 2))) & 0xFFFFu;
                else id = word;
                if (id < experts) atomicAdd(&row[id], 1u);
                else bad = true;
                if (++j == k) {
                    j = 0;
                    row += experts;
                    if (++l == layers) l = 0, row = sh;
                }
            }
            r[u] += ustep;
            if (r[u] >= R) r[u] -= R;
        }
    }
    return bad;
}

/* Count tokens [p0, p1) of any strided view, layers [l0, l0 + G), into the shared
 * histogram [G][experts]. Threads own fixed (layer, choice) positions, so there is no
 * division in the loop; consecutive threads read consecutive choices. */
template <typename T>
__device__ bool count_strided(const view &v, int64_t p0, int64_t p1, int32_t l0, int32_t G,
                              uint32_t experts, uint32_t *sh)
{
    const T *base = static_cast<const T *>(v.base);
    const int32_t gk = G * v.k;
    const int tid = threadIdx.x, nthr = blockDim.x;
    bool bad = false;
    if (gk <= nthr) {
        const int32_t lanes = nthr / gk, lane = tid / gk, q = tid % gk;
        if (lane >= lanes) return false;
        const int32_t g = q / v.k, j = q % v.k;
        const int64_t off = (int64_t)(l0 + g) * v.ls + (int64_t)j * v.ks;
        uint32_t *row = sh + g * experts;
        for (int64_t t = p0 + lane; t < p1; t += lanes) {
            uint32_t id = id_at(base, t * v.ts + off);
            if (id < experts) atomicAdd(&row[id], 1u);
            else bad = true;
        }
        return bad;
    }
    for (int32_t q = tid; q < gk; q += nthr) {
        const int32_t g = q / v.k, j = q % v.k;
        const int64_t off = (int64_t)(l0 + g) * v.ls + (int64_t)j * v.ks;
        uint32_t *row = sh + g * experts;
        for (int64_t t = p0; t < p1; t++) {
            uint32_t id = id_at(base, t * v.ts + off);
            if (id < experts) atomicAdd(&row[id], 1u);
            else bad = true;
        }
    }
    return bad;
}

/* One block per (chunk of global tokens, group of layers). A chunk may span several
 * sequences (short ones) or part of one (long ones); each piece is counted in shared
 * memory and flushed with one global atomic per non-zero cell into its row:
 * rows[row][layer][expert], where row is the sequence, or its microbatch when row_map
 * is given (-1: not read). D is the row counter type. */
template <typename T, typename D, bool DENSE>
__global__ void __launch_bounds__(kThreads)
    histogram_kernel(view v, const int64_t *cu, int32_t n, uint32_t experts, int64_t chunk,
                     int32_t group_layers, const int32_t *row_map, D *rows, flags *fl)
{
    extern __shared__ uint32_t sh[];
    __shared__ int32_t first_seq;
    const int32_t l0 = blockIdx.y * group_layers;
    const int32_t G = min(group_layers, v.layers - l0);
    const uint32_t cells = (uint32_t)G * experts;
    const int tid = threadIdx.x, nthr = blockDim.x;
    for (uint32_t c = tid; c < cells; c += nthr) sh[c] = 0;
    const int64_t a = cu[0] + (int64_t)blockIdx.x * chunk, b = min(a + chunk, cu[n]);
    if (tid == 0) first_seq = seq_of(cu, n, a);
    __syncthreads();
    const int32_t R = v.layers * v.k;
    for (int32_t s = first_seq; s < n && cu[s] < b; s++) {
        const int64_t p0 = max(a, cu[s]), p1 = min(b, cu[s + 1]);
        const int32_t row = row_map ? row_map[s] : s;
        if (p0 >= p1 || row < 0) continue; /* the same for every thread of the block */
        bool bad;
        if (DENSE)
            bad = count_dense<T>(static_cast<const T *>(v.base), p0 * R, p1 * R, R, v.k,
                                 v.layers, experts, sh);
        else
            bad = count_strided<T>(v, p0, p1, l0, G, experts, sh);
        if (bad) atomicMin(&fl->bad_seq, s);
        __syncthreads();
        D *dst = rows + ((size_t)row * v.layers + l0) * experts;
        for (uint32_t c = tid; c < cells; c += nthr) {
            uint32_t x = sh[c];
            if (x) {
                atomicAdd(dst + c, (D)x);
                sh[c] = 0;
            }
        }
        __syncthreads();
    }
}

/* The same counts straight into global memory, for expert counts whose per-layer
 * histogram does not fit in shared memory (tens of thousands of experts): one global
 * atomic per id, slow but exact. */
template <typename T, typename D>
__global__ void __launch_bounds__(kThreads)
    histogram_global_kernel(view v, const int64_t *cu, int32_t n, uint32_t experts, int64_t chunk,
                            const int32_t *row_map, D *rows, flags *fl)
{
    __shared__ int32_t first_seq;
    const T *base = static_cast<const T *>(v.base);
    const int64_t a = cu[0] + (int64_t)blockIdx.x * chunk, b = min(a + chunk, cu[n]);
    if (threadIdx.x == 0) first_seq = seq_of(cu, n, a);
    __syncthreads();
    const int64_t per_token = (int64_t)v.layers * v.k;
    for (int32_t s = first_seq; s < n && cu[s] < b; s++) {
        const int64_t p0 = max(a, cu[s]), p1 = min(b, cu[s + 1]);
        const int32_t row = row_map ? row_map[s] : s;
        if (p0 >= p1 || row < 0) continue;
        D *dst = rows + (size_t)row * v.layers * experts;
        bool bad = false;
        for (int64_t q = threadIdx.x; q < (p1 - p0) * per_token; q += blockDim.x) {
            const int64_t t = p0 + q / per_token, r = q % per_token, l = r / v.k, j = r % v.k;
            uint32_t id = id_at(base, t * v.ts + l * v.ls + j * v.ks);
            if (id < experts) atomicAdd(dst + (size_t)l * experts + id, (D)1);
            else bad = true;
        }
        if (bad) atomicMin(&fl->bad_seq, s);
    }
}

/* expert_load[c] = sum over sequences of hist[s][c]; blockIdx.y takes every
 * gridDim.y-th sequence, so each column gets gridDim.y atomics at most. */
__global__ void column_sums(const uint32_t *hist, int32_t n, int64_t cells,
                            unsigned long long *load)
{
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cells) return;
    unsigned long long sum = 0;
    for (int64_t s = blockIdx.y; s < n; s += gridDim.y) sum += hist[s * cells + c];
    if (sum) atomicAdd(load + c, sum);
}

/* Offsets must not run backwards; microbatch ids must be in [-1, m). */
__global__ void check_inputs(const int64_t *cu, int32_t n, const int32_t *map, int32_t m,
                             flags *fl)
{
    for (int32_t s = blockIdx.x * blockDim.x + threadIdx.x; s <= n; s += gridDim.x * blockDim.x) {
        if ((s == 0 && cu[0] < 0) || (s > 0 && cu[s] < cu[s - 1])) atomicMin(&fl->bad_cu, s);
        if (map && s < n && (map[s] < -1 || map[s] >= m)) atomicMin(&fl->bad_map, s);
    }
}

/* The first bad id of sequence s in (layer, token, choice) order, as the CPU reports it. */
template <typename T>
__global__ void locate_bad(view v, const int64_t *cu, int32_t s, uint32_t experts, flags *fl)
{
    const T *base = static_cast<const T *>(v.base);
    const int64_t t0 = cu[s], len = cu[s + 1] - cu[s];
    const int64_t total = len * v.layers * v.k;
    for (int64_t key = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; key < total;
         key += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = key % v.k, t = (key / v.k) % len, l = key / ((int64_t)v.k * len);
        if (id_at(base, (t0 + t) * v.ts + l * v.ls + j * v.ks) >= experts)
            atomicMin(&fl->bad_key, (unsigned long long)key);
    }
}

/* ---- host side -------------------------------------------------------------------- */

rp_status cuda_fail(rp_error *err, cudaError_t e, const char *what)
{
    (void)cudaGetLastError(); /* reset a non-sticky error so the next call starts clean */
    return rp_fail(err, e == cudaErrorMemoryAllocation ? RP_ENOMEM : RP_EIO, "gpu: %s: %s", what,
                   cudaGetErrorString(e));
}

#define CU_CHECK(call, what)                                  \
    do {                                                      \
        cudaError_t e_ = (call);                              \
        if (e_ != cudaSuccess) {                              \
            st = cuda_fail(err, e_, what);                    \
            goto out;                                         \
        }                                                     \
    } while (0)

rp_status check_view(const rp_routing *r, const int64_t *cu_dev, int32_t n, int32_t experts,
                     rp_error *err)
{
    if (!r) return rp_fail(err, RP_EINVAL, "gpu: no routing view");
    if (r->layout != RP_ROUTING_PACKED)
        return rp_fail(err, RP_EINVAL, "gpu: routing layout %d given, the GPU path needs a packed "
                       "[tokens, layers, k] view", (int)r->layout);
    if (r->width != RP_ID_U8 && r->width != RP_ID_U16 && r->width != RP_ID_I32)
        return rp_fail(err, RP_EINVAL, "gpu: id width %d is not 1, 2 or 4 bytes", (int)r->width);
    if (r->num_layers < 1 || r->top_k < 1)
        return rp_fail(err, RP_EINVAL, "gpu: %d layers and top-k %d, both must be >= 1",
                       r->num_layers, r->top_k);
    if (experts < 1) return rp_fail(err, RP_EINVAL, "gpu: %d experts, must be >= 1", experts);
    if (r->top_k > experts)
        return rp_fail(err, RP_EINVAL, "gpu: top-k %d exceeds the %d experts", r->top_k, experts);
    if (r->token_stride < 0 || r->layer_stride < 0 || r->k_stride < 0)
        return rp_fail(err, RP_EINVAL, "gpu: strides must not be negative");
    if (n < 0) return rp_fail(err, RP_EINVAL, "gpu: sequence count %d is negative", n);
    if (n > 0 && !cu_dev) return rp_fail(err, RP_EINVAL, "gpu: no cu_seqlens");
    if ((int64_t)r->num_layers * experts > INT32_MAX / 2)
        return rp_fail(err, RP_ERANGE, "gpu: %d layers x %d experts is too many cells",
                       r->num_layers, experts);
    return RP_OK;
}

/* After the arguments: the kernels need a device. */
rp_status need_device(rp_error *err)
{
    if (rp_gpu_count() == 0) return rp_fail(err, RP_ENOTSUP, "gpu: no CUDA device is available");
    return RP_OK;
}

/* The device arrays must be readable by a kernel: a host pointer would fault and end
 * the CUDA context for the whole process, so it is an argument error instead. */
rp_status need_readable(const rp_routing *r, const int64_t *cu_dev, const int32_t *map_dev, int32_t n,
                        rp_error *err)
{
    if (n == 0) return RP_OK;
    if (!rp_gpu_pointer_readable(cu_dev))
        return rp_fail(err, RP_EINVAL, "gpu: cu_seqlens is host memory; copy it to the device, or "
                       "use rp_stats_compute for host data");
    if (r->base && !rp_gpu_pointer_readable(r->base))
        return rp_fail(err, RP_EINVAL, "gpu: the routing ids are host memory; copy them to the device, "
                       "or use rp_stats_compute for host data");
    if (map_dev && !rp_gpu_pointer_readable(map_dev))
        return rp_fail(err, RP_EINVAL, "gpu: the sequence -> microbatch map is host memory; copy it to "
                       "the device, or use rp_stats_microbatch_loads for host data");
    return RP_OK;
}

/* group == 0: the histograms do not fit in shared memory, count in global memory. */
template <typename T, typename D>
cudaError_t launch_histogram(const view &v, bool dense, const int64_t *cu, int32_t n,
                             uint32_t experts, int64_t chunks, int64_t chunk, int32_t group,
                             size_t smem, const int32_t *row_map, D *rows, flags *fl)
{
    if (group == 0) {
        histogram_global_kernel<T, D><<<(unsigned)chunks, kThreads>>>(v, cu, n, experts, chunk,
                                                                      row_map, rows, fl);
        return cudaGetLastError();
    }
    dim3 grid((unsigned)chunks, (unsigned)((v.layers + group - 1) / group));
    cudaError_t e;
    if (dense) {
        e = cudaFuncSetAttribute(histogram_kernel<T, D, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
        histogram_kernel<T, D, true><<<grid, kThreads, smem>>>(v, cu, n, experts, chunk, group,
                                                               row_map, rows, fl);
    } else {
        e = cudaFuncSetAttribute(histogram_kernel<T, D, false>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
        histogram_kernel<T, D, false><<<grid, kThreads, smem>>>(v, cu, n, experts, chunk, group,
                                                                row_map, rows, fl);
    }
    return cudaGetLastError();
}

/* The common part of both entry points: check the inputs on the device, then count
 * every packed sequence into `rows` (zeroed here; D counters, rows_count rows). On
 * success *bad_seq is the lowest sequence with an id out of range, or -1. */
template <typename D>
rp_status count_rows(const rp_routing *r, const int64_t *cu_dev, int32_t n, int32_t experts,
                     const int32_t *map_dev, int32_t num_rows, D *rows_dev, flags *fl_dev,
                     int32_t *bad_seq, rp_error *err)
{
    rp_status st = RP_OK;
    flags fl = {INT_MAX, INT_MAX, INT_MAX, 0, ULLONG_MAX};
    int64_t cu_ends[2] = {0, 0};
    const int64_t cells = (int64_t)r->num_layers * experts;
    view v = {r->base, r->token_stride, r->layer_stride, r->k_stride, r->num_layers, r->top_k};
    int device = 0, sms = 0, smem_max = 0;
    *bad_seq = -1;

    CU_CHECK(cudaMemcpy(fl_dev, &fl, sizeof fl, cudaMemcpyHostToDevice), "copying flags");
    CU_CHECK(cudaMemset(rows_dev, 0, (size_t)num_rows * cells * sizeof(D)), "clearing counts");
    if (n == 0) return RP_OK;
    check_inputs<<<(n + 256) / 256 < 1024 ? (n + 256) / 256 : 1024, 256>>>(cu_dev, n, map_dev,
                                                                         num_rows, fl_dev);
    CU_CHECK(cudaGetLastError(), "checking cu_seqlens");
    CU_CHECK(cudaMemcpy(&fl, fl_dev, sizeof fl, cudaMemcpyDeviceToHost), "reading flags");
    if (fl.bad_cu != INT_MAX) {
        st = rp_fail(err, RP_EINVAL, "gpu: cu_seqlens runs backwards (or starts below 0) at entry %d",
                     fl.bad_cu);
        if (err) err->sequence = fl.bad_cu;
        return st;
    }
    if (fl.bad_map != INT_MAX) {
        int32_t mb = 0;
        CU_CHECK(cudaMemcpy(&mb, map_dev + fl.bad_map, sizeof mb, cudaMemcpyDeviceToHost),
                 "reading the microbatch map");
        st = rp_fail(err, RP_EINVAL,
                     "gpu: sequence %d is in microbatch %d, but there are %d microbatches "
                     "(-1 means not packed)", fl.bad_map, mb, num_rows);
        if (err) err->sequence = fl.bad_map;
        return st;
    }
    CU_CHECK(cudaMemcpy(&cu_ends[0], cu_dev, sizeof(int64_t), cudaMemcpyDeviceToHost), "reading cu_seqlens");
    CU_CHECK(cudaMemcpy(&cu_ends[1], cu_dev + n, sizeof(int64_t), cudaMemcpyDeviceToHost),
             "reading cu_seqlens");
    {
        const int64_t tokens = cu_ends[1] - cu_ends[0];
        if (tokens == 0) return RP_OK;
        if (!r->base) return rp_fail(err, RP_EINVAL, "gpu: packed layout without a base array");
        CU_CHECK(cudaGetDevice(&device), "cudaGetDevice");
        CU_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device attributes");
        CU_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                 "device attributes");
        /* as many layers per block as shared memory holds; none: global memory */
        const int64_t cell_bytes = (int64_t)experts * (int64_t)sizeof(uint32_t);
        int32_t group = (int32_t)(smem_max / cell_bytes);
        if (group > r->num_layers) group = r->num_layers;
        if (group > 0 && (r->num_layers + group - 1) / group > 65535)
            return rp_fail(err, RP_ENOTSUP, "gpu: %d layers are too many", r->num_layers);
        const size_t smem = (size_t)group * cell_bytes;
        int64_t chunk = tokens / ((int64_t)sms * 8);
        chunk = chunk < kMinChunkTokens ? kMinChunkTokens : chunk > kMaxChunkTokens ? kMaxChunkTokens : chunk;
        const int64_t chunks = (tokens + chunk - 1) / chunk;
        if (chunks > INT32_MAX) return rp_fail(err, RP_ENOTSUP, "gpu: %lld tokens are too many", (long long)tokens);
        const int64_t R = (int64_t)r->num_layers * r->top_k;
        const bool dense = group == r->num_layers && group > 0 && r->k_stride == 1 && r->layer_stride == r->top_k &&
                           r->token_stride == R && (uintptr_t)r->base % 16 == 0;
        cudaError_t e;
        switch (r->width) {
        case RP_ID_U8:
            e = launch_histogram<uint8_t, D>(v, dense, cu_dev, n, (uint32_t)experts, chunks, chunk,
                                             group, smem, map_dev, rows_dev, fl_dev);
            break;
        case RP_ID_U16:
            e = launch_histogram<uint16_t, D>(v, dense, cu_dev, n, (uint32_t)experts, chunks, chunk,
                                              group, smem, map_dev, rows_dev, fl_dev);
            break;
        default:
            e = launch_histogram<int32_t, D>(v, dense, cu_dev, n, (uint32_t)experts, chunks, chunk,
                                             group, smem, map_dev, rows_dev, fl_dev);
            break;
        }
        CU_CHECK(e, "launching the histogram kernel");
        CU_CHECK(cudaMemcpy(&fl, fl_dev, sizeof fl, cudaMemcpyDeviceToHost), "reading flags");
        if (fl.bad_seq != INT_MAX) *bad_seq = fl.bad_seq;
    }
out:
    return st;
}

/* Report the first bad id of sequence `seq` with the CPU's message. */
rp_status report_bad(const rp_routing *r, const int64_t *cu_dev, int32_t seq, int32_t experts,
                     flags *fl_dev, rp_error *err)
{
    rp_status st = RP_OK;
    view v = {r->base, r->token_stride, r->layer_stride, r->k_stride, r->num_layers, r->top_k};
    int64_t cu[2];
    flags fl;
    int32_t id = 0;
    CU_CHECK(cudaMemcpy(cu, cu_dev + seq, sizeof cu, cudaMemcpyDeviceToHost), "reading cu_seqlens");
    switch (r->width) {
    case RP_ID_U8: locate_bad<uint8_t><<<256, 256>>>(v, cu_dev, seq, (uint32_t)experts, fl_dev); break;
    case RP_ID_U16: locate_bad<uint16_t><<<256, 256>>>(v, cu_dev, seq, (uint32_t)experts, fl_dev); break;
    default: locate_bad<int32_t><<<256, 256>>>(v, cu_dev, seq, (uint32_t)experts, fl_dev); break;
    }
    CU_CHECK(cudaGetLastError(), "locating the bad id");
    CU_CHECK(cudaMemcpy(&fl, fl_dev, sizeof fl, cudaMemcpyDeviceToHost), "reading flags");
    {
        const int64_t len = cu[1] - cu[0], k = r->top_k;
        const int64_t key = (int64_t)fl.bad_key;
        const int64_t j = key % k, t = (key / k) % len, l = key / (k * len);
        const int64_t at = (cu[0] + t) * r->token_stride + l * r->layer_stride + j * r->k_stride;
        unsigned char raw[4] = {0, 0, 0, 0};
        CU_CHECK(cudaMemcpy(raw, static_cast<const char *>(r->base) + at * (int64_t)r->width,
                            (size_t)r->width, cudaMemcpyDeviceToHost), "reading the bad id");
        id = rp_id_load(raw, r->width, 0);
        st = rp_fail(err, RP_ERANGE,
                     "routing: sequence %d token %lld layer %lld choice %lld has expert id %d, "
                     "but the model has %d experts (counted in none)",
                     seq, (long long)t, (long long)l, (long long)j, id, experts);
        if (err) err->sequence = seq, err->expert = id;
    }
out:
    return st;
}

} // namespace

extern "C" {

int rp_gpu_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver or no device: not an error here */
        return 0;
    }
    return n;
}

int rp_gpu_built(void) { return 1; }

int rp_gpu_pointer_readable(const void *ptr)
{
    cudaPointerAttributes at;
    int device = 0, pageable = 0;
    if (!ptr || rp_gpu_count() == 0) return 0;
    if (cudaPointerGetAttributes(&at, ptr) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged) return 1;
    if (at.type == cudaMemoryTypeHost) return at.devicePointer != NULL; /* pinned, mapped (UVA) */
    /* plain host memory: readable only where the device walks the host's page tables */
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return pageable != 0;
}

rp_status rp_gpu_routing_histograms(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                    int32_t num_seqs, int32_t num_experts, uint32_t *seq_hist,
                                    int64_t *expert_load, rp_error *err)
{
    rp_status st = check_view(routing_dev, cu_seqlens_dev, num_seqs, num_experts, err);
    if (st != RP_OK) return st;
    if ((num_seqs > 0 && !seq_hist) || !expert_load)
        return rp_fail(err, RP_EINVAL, "gpu: missing output array");
    if ((st = need_device(err)) != RP_OK) return st;
    if ((st = need_readable(routing_dev, cu_seqlens_dev, NULL, num_seqs, err)) != RP_OK) return st;
    const int64_t cells = (int64_t)routing_dev->num_layers * num_experts;
    const size_t hist_bytes = ((size_t)num_seqs * cells * sizeof(uint32_t) + 255) / 256 * 256;
    const size_t load_bytes = ((size_t)cells * sizeof(unsigned long long) + 255) / 256 * 256;
    char *mem = NULL;
    uint32_t *hist_dev;
    unsigned long long *load_dev;
    flags *fl_dev;
    int32_t bad_seq = -1;
    CU_CHECK(cudaMalloc((void **)&mem, hist_bytes + load_bytes + sizeof(flags)), "allocating device memory");
    hist_dev = reinterpret_cast<uint32_t *>(mem);
    load_dev = reinterpret_cast<unsigned long long *>(mem + hist_bytes);
    fl_dev = reinterpret_cast<flags *>(mem + hist_bytes + load_bytes);
    CU_CHECK(cudaMemset(load_dev, 0, load_bytes), "clearing loads");
    st = count_rows<uint32_t>(routing_dev, cu_seqlens_dev, num_seqs, num_experts, NULL,
                              num_seqs, hist_dev, fl_dev, &bad_seq, err);
    if (st != RP_OK) goto out;
    if (num_seqs > 0) {
        dim3 grid((unsigned)((cells + 255) / 256),
                  (unsigned)(num_seqs < kMaxSeqGroups ? num_seqs : kMaxSeqGroups));
        column_sums<<<grid, 256>>>(hist_dev, num_seqs, cells, load_dev);
        CU_CHECK(cudaGetLastError(), "launching the load reduction");
    }
    if (bad_seq >= 0) st = report_bad(routing_dev, cu_seqlens_dev, bad_seq, num_experts, fl_dev, err);
    if (st != RP_OK && st != RP_ERANGE) goto out;
    /* Written even with ids out of range (counted in none), as the header says. */
    if (num_seqs > 0)
        CU_CHECK(cudaMemcpy(seq_hist, hist_dev, (size_t)num_seqs * cells * sizeof(uint32_t),
                            cudaMemcpyDeviceToHost), "copying histograms");
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit loads");
    CU_CHECK(cudaMemcpy(expert_load, load_dev, (size_t)cells * sizeof(int64_t), cudaMemcpyDeviceToHost),
             "copying loads");
out:
    if (mem) cudaFree(mem);
    return st;
}

rp_status rp_gpu_microbatch_loads(const rp_routing *routing_dev, const int64_t *cu_seqlens_dev,
                                  int32_t num_seqs, int32_t num_experts,
                                  const int32_t *seq_microbatch_dev, int32_t num_microbatches,
                                  int64_t *loads, rp_error *err)
{
    rp_status st = check_view(routing_dev, cu_seqlens_dev, num_seqs, num_experts, err);
    if (st != RP_OK) return st;
    if (num_microbatches < 0)
        return rp_fail(err, RP_EINVAL, "gpu: %d microbatches, must be >= 0", num_microbatches);
    if ((num_seqs > 0 && !seq_microbatch_dev) || (num_microbatches > 0 && !loads))
        return rp_fail(err, RP_EINVAL, "gpu: missing sequence map or output array");
    if ((st = need_device(err)) != RP_OK) return st;
    if ((st = need_readable(routing_dev, cu_seqlens_dev, seq_microbatch_dev, num_seqs, err)) != RP_OK) return st;
    const int64_t cells = (int64_t)routing_dev->num_layers * num_experts;
    const size_t rows_bytes =
        ((size_t)num_microbatches * cells * sizeof(unsigned long long) + 255) / 256 * 256;
    char *mem = NULL;
    unsigned long long *rows_dev;
    flags *fl_dev;
    int32_t bad_seq = -1;
    CU_CHECK(cudaMalloc((void **)&mem, rows_bytes + sizeof(flags)), "allocating device memory");
    rows_dev = reinterpret_cast<unsigned long long *>(mem);
    fl_dev = reinterpret_cast<flags *>(mem + rows_bytes);
    st = count_rows<unsigned long long>(routing_dev, cu_seqlens_dev, num_seqs, num_experts,
                                        seq_microbatch_dev, num_microbatches, rows_dev, fl_dev,
                                        &bad_seq, err);
    if (st != RP_OK) goto out;
    if (bad_seq >= 0) st = report_bad(routing_dev, cu_seqlens_dev, bad_seq, num_experts, fl_dev, err);
    if (st != RP_OK && st != RP_ERANGE) goto out;
    if (num_microbatches > 0)
        CU_CHECK(cudaMemcpy(loads, rows_dev, (size_t)num_microbatches * cells * sizeof(int64_t),
                            cudaMemcpyDeviceToHost), "copying loads");
out:
    if (mem) cudaFree(mem);
    return st;
}

} // extern "C"
