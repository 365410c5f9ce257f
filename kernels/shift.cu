/* CUDA kernel of the router-shift counts (routepack/shift.h) and its host wrapper
 * rp_gpu_router_shift (routepack/gpu.h). Its CPU reference is core/shift.c: the counts
 * are integers, so both give equal results. */
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

using rp_kernels::seq_of;

constexpr int kThreads = 256;
constexpr int64_t kTokensPerBlock = 2048;
/* Per-block counters of one layer ([3][experts] uint32) live in shared memory up to this
 * many bytes; more experts count straight into global memory. */
constexpr size_t kMaxSharedBytes = 48 * 1024;

/* A packed routing view: id (t, l, j) of global token t at base[t*ts + l*ls + j*ks]. */
struct view {
    const void *base;
    int64_t ts, ls, ks;
    int width;
};

struct flags {
    int bad_old_seq; /* lowest sequence with an old id out of range (INT_MAX: none) */
    int bad_new_seq;
    unsigned long long bad_key; /* first bad id of that sequence, (layer, token, choice) order */
};

__device__ __forceinline__ uint32_t id_at(const view &v, int64_t i)
{
    return rp_kernels::id_at(v.base, v.width, i);
}

/* One block per (chunk of tokens, layer); a thread per token. For each old choice j:
 * counted in old[e]; lost[e] and changed when e is in none of the k new entries; for each
 * new choice: arrived[e] when in none of the old entries. Every id of both views is
 * range-checked (none skipped), so the lowest bad sequence of each view is found. */
template <bool SHARED>
__global__ void __launch_bounds__(kThreads)
    shift_kernel(view o, view nw, const int64_t *cu, int32_t n, int32_t k, uint32_t experts,
                 unsigned long long *layer_changed, unsigned long long *seq_changed,
                 unsigned long long *g_old, unsigned long long *g_lost, unsigned long long *g_arrived,
                 flags *fl)
{
    extern __shared__ uint32_t sh[];
    __shared__ unsigned long long block_changed;
    const int32_t l = blockIdx.y;
    const size_t row = (size_t)l * experts;
    if (SHARED) {
        for (uint32_t c = threadIdx.x; c < 3 * experts; c += blockDim.x) sh[c] = 0;
    }
    if (threadIdx.x == 0) block_changed = 0;
    __syncthreads();
    const int64_t total = cu[n];
    const int64_t t0 = (int64_t)blockIdx.x * kTokensPerBlock, t1 = min(total, t0 + kTokensPerBlock);
    for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
        const int64_t ob = t * o.ts + (int64_t)l * o.ls, nb = t * nw.ts + (int64_t)l * nw.ls;
        bool bad_old = false, bad_new = false;
        unsigned long long changed = 0;
        for (int32_t j = 0; j < k; j++) {
            uint32_t e = id_at(o, ob + j * o.ks);
            if (e >= experts) {
                bad_old = true;
                continue;
            }
            bool in_new = false;
            for (int32_t i = 0; i < k; i++) in_new |= id_at(nw, nb + i * nw.ks) == e;
            if (SHARED) atomicAdd(&sh[e], 1u);
            else atomicAdd(&g_old[row + e], 1ull);
            if (!in_new) {
                changed++;
                if (SHARED) atomicAdd(&sh[experts + e], 1u);
                else atomicAdd(&g_lost[row + e], 1ull);
            }
        }
        for (int32_t j = 0; j < k; j++) {
            uint32_t e = id_at(nw, nb + j * nw.ks);
            if (e >= experts) {
                bad_new = true;
                continue;
            }
            bool in_old = false;
            for (int32_t i = 0; i < k; i++) in_old |= id_at(o, ob + i * o.ks) == e;
            if (!in_old) {
                if (SHARED) atomicAdd(&sh[2 * experts + e], 1u);
                else atomicAdd(&g_arrived[row + e], 1ull);
            }
        }
        if (bad_old || bad_new || changed) {
            const int32_t s = seq_of(cu, n, t);
            if (bad_old) atomicMin(&fl->bad_old_seq, s);
            if (bad_new) atomicMin(&fl->bad_new_seq, s);
            if (changed) {
                atomicAdd(&seq_changed[s], changed);
                atomicAdd(&block_changed, changed);
            }
        }
    }
    __syncthreads();
    if (SHARED) {
        for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) {
            if (sh[e]) atomicAdd(&g_old[row + e], (unsigned long long)sh[e]);
            if (sh[experts + e]) atomicAdd(&g_lost[row + e], (unsigned long long)sh[experts + e]);
            if (sh[2 * experts + e]) atomicAdd(&g_arrived[row + e], (unsigned long long)sh[2 * experts + e]);
        }
    }
    if (threadIdx.x == 0 && block_changed) atomicAdd(&layer_changed[l], block_changed);
}

/* The first bad id of sequence s in (layer, token, choice) order, as the CPU reports it. */
__global__ void locate_bad(view v, const int64_t *cu, int32_t s, int32_t layers, int32_t k, uint32_t experts,
                           flags *fl)
{
    const int64_t t0 = cu[s], len = cu[s + 1] - cu[s];
    const int64_t total = len * layers * k;
    for (int64_t key = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; key < total;
         key += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = key % k, t = (key / k) % len, l = key / ((int64_t)k * len);
        if (id_at(v, (t0 + t) * v.ts + l * v.ls + j * v.ks) >= experts)
            atomicMin(&fl->bad_key, (unsigned long long)key);
    }
}

rp_status fail_cuda(rp_error *err, cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return rp_fail(err, e == cudaErrorMemoryAllocation ? RP_ENOMEM : RP_EIO, "gpu: %s: %s", what,
                   cudaGetErrorString(e));
}

#define CU_CHECK(call, what)                   \
    do {                                       \
        cudaError_t e_ = (call);               \
        if (e_ != cudaSuccess) {               \
            st = fail_cuda(err, e_, what);     \
            goto out;                          \
        }                                      \
    } while (0)

rp_status check_one(const rp_routing *r, const char *which, rp_error *err)
{
    if (!r) return rp_fail(err, RP_EINVAL, "gpu: no %s routing view", which);
    if (r->layout != RP_ROUTING_PACKED)
        return rp_fail(err, RP_EINVAL, "gpu: %s routing layout %d given, the GPU path needs a packed "
                       "[tokens, layers, k] view", which, (int)r->layout);
    if (r->width != RP_ID_U8 && r->width != RP_ID_U16 && r->width != RP_ID_I32)
        return rp_fail(err, RP_EINVAL, "gpu: %s routing id width %d is not 1, 2 or 4 bytes", which, (int)r->width);
    if (r->num_layers < 1 || r->top_k < 1)
        return rp_fail(err, RP_EINVAL, "gpu: %s routing has %d layers and top-k %d, both must be >= 1", which,
                       r->num_layers, r->top_k);
    if (r->token_stride < 0 || r->layer_stride < 0 || r->k_stride < 0)
        return rp_fail(err, RP_EINVAL, "gpu: %s routing strides must not be negative", which);
    return RP_OK;
}

/* Report the first bad id of `which` routing's sequence `seq` with the CPU's message. */
rp_status report_bad(const rp_routing *r, const char *which, const int64_t *cu_dev, int32_t seq,
                     int32_t experts, flags *fl_dev, rp_error *err)
{
    rp_status st = RP_OK;
    view v = {r->base, r->token_stride, r->layer_stride, r->k_stride, (int)r->width};
    int64_t cu[2];
    flags fl;
    CU_CHECK(cudaMemcpy(cu, cu_dev + seq, sizeof cu, cudaMemcpyDeviceToHost), "reading cu_seqlens");
    locate_bad<<<256, 256>>>(v, cu_dev, seq, r->num_layers, r->top_k, (uint32_t)experts, fl_dev);
    CU_CHECK(cudaGetLastError(), "locating the bad id");
    CU_CHECK(cudaMemcpy(&fl, fl_dev, sizeof fl, cudaMemcpyDeviceToHost), "reading flags");
    {
        const int64_t len = cu[1] - cu[0], k = r->top_k, key = (int64_t)fl.bad_key;
        const int64_t j = key % k, t = (key / k) % len, l = key / (k * len);
        const int64_t at = (cu[0] + t) * r->token_stride + l * r->layer_stride + j * r->k_stride;
        unsigned char raw[4] = {0, 0, 0, 0};
        CU_CHECK(cudaMemcpy(raw, static_cast<const char *>(r->base) + at * (int64_t)r->width, (size_t)r->width,
                            cudaMemcpyDeviceToHost), "reading the bad id");
        const int32_t id = rp_id_load(raw, r->width, 0);
        st = rp_fail(err, RP_ERANGE,
                     "%s routing: sequence %d token %d layer %d choice %d has expert id %d, but the model "
                     "has %d experts", which, seq, (int)t, (int)l, (int)j, id, experts);
        if (err) err->sequence = seq, err->expert = id;
    }
out:
    return st;
}

} // namespace

extern "C" rp_status rp_gpu_router_shift(const rp_routing *old_dev, const rp_routing *new_dev,
                                         const int64_t *cu_seqlens_dev, int32_t num_seqs, int32_t num_experts,
                                         int64_t *layer_changed, int64_t *seq_changed, int64_t *expert_old,
                                         int64_t *expert_lost, int64_t *expert_arrived, rp_error *err)
{
    rp_status st;
    if ((st = check_one(old_dev, "old", err)) != RP_OK || (st = check_one(new_dev, "new", err)) != RP_OK) return st;
    if (old_dev->num_layers != new_dev->num_layers || old_dev->top_k != new_dev->top_k)
        return rp_fail(err, RP_EINVAL, "gpu: the old routing has %d layers x top-%d but the new routing has %d "
                       "layers x top-%d", old_dev->num_layers, old_dev->top_k, new_dev->num_layers, new_dev->top_k);
    if (num_experts < 1 || old_dev->top_k > num_experts)
        return rp_fail(err, RP_EINVAL, "gpu: %d experts for top-%d", num_experts, old_dev->top_k);
    if (num_seqs < 0 || (num_seqs > 0 && !cu_seqlens_dev))
        return rp_fail(err, RP_EINVAL, "gpu: %d sequences without cu_seqlens", num_seqs);
    if (!layer_changed || (num_seqs > 0 && !seq_changed) || !expert_old || !expert_lost || !expert_arrived)
        return rp_fail(err, RP_EINVAL, "gpu: missing output array");
    if (rp_gpu_count() == 0) return rp_fail(err, RP_ENOTSUP, "gpu: no CUDA device is available");
    if (num_seqs > 0 && !rp_gpu_pointer_readable(cu_seqlens_dev))
        return rp_fail(err, RP_EINVAL, "gpu: cu_seqlens is host memory; copy it to the device");

    const int32_t layers = old_dev->num_layers, k = old_dev->top_k;
    const size_t cells = (size_t)layers * (size_t)num_experts;
    const size_t words = (size_t)layers + (size_t)num_seqs + 3 * cells;
    char *mem = NULL;
    unsigned long long *d_layer, *d_seq, *d_old, *d_lost, *d_arr;
    flags *fl_dev, fl;
    int64_t tokens = 0;
    const size_t smem = 3 * (size_t)num_experts * sizeof(uint32_t);
    const bool shared = smem <= kMaxSharedBytes;
    CU_CHECK(cudaMalloc((void **)&mem, words * sizeof(unsigned long long) + sizeof(flags)), "allocating device memory");
    d_layer = reinterpret_cast<unsigned long long *>(mem);
    d_seq = d_layer + layers;
    d_old = d_seq + num_seqs;
    d_lost = d_old + cells;
    d_arr = d_lost + cells;
    fl_dev = reinterpret_cast<flags *>(mem + words * sizeof(unsigned long long));
    fl = {INT_MAX, INT_MAX, ULLONG_MAX};
    CU_CHECK(cudaMemset(mem, 0, words * sizeof(unsigned long long)), "clearing counts");
    CU_CHECK(cudaMemcpy(fl_dev, &fl, sizeof fl, cudaMemcpyHostToDevice), "writing flags");
    if (num_seqs > 0)
        CU_CHECK(cudaMemcpy(&tokens, cu_seqlens_dev + num_seqs, sizeof tokens, cudaMemcpyDeviceToHost),
                 "reading cu_seqlens");
    if (tokens > 0) {
        if (!rp_gpu_pointer_readable(old_dev->base) || !rp_gpu_pointer_readable(new_dev->base)) {
            st = rp_fail(err, RP_EINVAL, "gpu: a routing's ids are host memory; copy them to the device");
            goto out;
        }
        const int64_t chunks = (tokens + kTokensPerBlock - 1) / kTokensPerBlock;
        if (chunks > INT32_MAX || layers > 65535) {
            st = rp_fail(err, RP_ERANGE, "gpu: %lld tokens x %d layers are too many blocks", (long long)tokens,
                         layers);
            goto out;
        }
        view o = {old_dev->base, old_dev->token_stride, old_dev->layer_stride, old_dev->k_stride, (int)old_dev->width};
        view nw = {new_dev->base, new_dev->token_stride, new_dev->layer_stride, new_dev->k_stride,
                   (int)new_dev->width};
        dim3 grid((unsigned)chunks, (unsigned)layers);
        if (shared)
            shift_kernel<true><<<grid, kThreads, smem>>>(o, nw, cu_seqlens_dev, num_seqs, k, (uint32_t)num_experts,
                                                         d_layer, d_seq, d_old, d_lost, d_arr, fl_dev);
        else
            shift_kernel<false><<<grid, kThreads>>>(o, nw, cu_seqlens_dev, num_seqs, k, (uint32_t)num_experts,
                                                    d_layer, d_seq, d_old, d_lost, d_arr, fl_dev);
        CU_CHECK(cudaGetLastError(), "launching the shift kernel");
        CU_CHECK(cudaMemcpy(&fl, fl_dev, sizeof fl, cudaMemcpyDeviceToHost), "reading flags");
        if (fl.bad_old_seq != INT_MAX) {
            st = report_bad(old_dev, "old", cu_seqlens_dev, fl.bad_old_seq, num_experts, fl_dev, err);
            goto out;
        }
        if (fl.bad_new_seq != INT_MAX) {
            st = report_bad(new_dev, "new", cu_seqlens_dev, fl.bad_new_seq, num_experts, fl_dev, err);
            goto out;
        }
    }
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit counts");
    CU_CHECK(cudaMemcpy(layer_changed, d_layer, (size_t)layers * 8, cudaMemcpyDeviceToHost), "copying counts");
    if (num_seqs > 0)
        CU_CHECK(cudaMemcpy(seq_changed, d_seq, (size_t)num_seqs * 8, cudaMemcpyDeviceToHost), "copying counts");
    CU_CHECK(cudaMemcpy(expert_old, d_old, cells * 8, cudaMemcpyDeviceToHost), "copying counts");
    CU_CHECK(cudaMemcpy(expert_lost, d_lost, cells * 8, cudaMemcpyDeviceToHost), "copying counts");
    CU_CHECK(cudaMemcpy(expert_arrived, d_arr, cells * 8, cudaMemcpyDeviceToHost), "copying counts");
out:
    if (mem) cudaFree(mem);
    return st;
}
