/* CUDA remap (rp_gpu_remap in routepack/gpu.h): the physical replica of every
 * token-choice of a microbatch, bit for bit the CPU reference core/remap.c. One warp per
 * tile (a run of tokens of one sequence); occurrence counters per split (layer, expert)
 * live in shared memory, and a per-source prefix over tiles makes every tile start
 * where the CPU's sequential count would be (docs/kernels.md). */
#include <cuda_runtime.h>

#include <climits>
#include <cstdio>
#include <cstdint>
#include <cstring>

extern "C" {
#include "internal.h"
#include "routing_access.h"
}
#include "remap_internal.h"
#include "routepack/gpu.h"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxWarps = 8;
constexpr int64_t kTileTokens = 256;
constexpr int64_t kMaxTileBytes = 1LL << 30; /* per-tile counters, all tiles */

/* n / d and n % d for 0 <= n < 2^31 by a multiply and a shift (Granlund-Montgomery,
 * as CUTLASS's FastDivmod): integer division by a runtime divisor costs ~20
 * instructions per element otherwise. */
struct fast_div {
    uint32_t d, m, s;
};

fast_div make_div(uint32_t d)
{
    fast_div f = {d, 0, 0};
    if (d > 1) {
        uint32_t l = 0;
        while ((1ull << l) < d) l++;
        const uint32_t p = 31 + l;
        f.m = (uint32_t)(((1ull << p) + d - 1) / d);
        f.s = p - 32;
    }
    return f;
}

__device__ __forceinline__ uint32_t div_of(const fast_div &f, uint32_t n)
{
    return f.d == 1 ? n : (__umulhi(n, f.m) >> f.s);
}

struct tile {
    int64_t tok0;  /* global index of the tile's first token */
    int32_t ntok;
    int32_t gpu;   /* source GPU */
};

/* Everything the kernels read. */
struct args {
    const void *ids;
    int64_t ts, ls, ks;
    int32_t L, k, E, ep, nsrc, num_keys, share_slots;
    uint32_t R; /* L * k */
    fast_div div_R, div_k;
    const tile *tiles;
    int32_t num_tiles;
    const remap_cand *cand;
    const int32_t *cand_phys;
    const uint64_t *weight;
    const int32_t *key_bofs, *key_first, *key_count;
    const int32_t *tile_begin; /* [G + 1] */
    uint32_t *tile_count;      /* [tiles][num_keys]: counts, then (scanned) bases */
    int64_t *bounds;           /* [G][share_slots] */
    int32_t *out;
};

/* Element i of a tile: its token, layer, choice, and expert id. */
template <typename T>
__device__ __forceinline__ uint32_t element(const args &a, const tile &tl, uint32_t i, uint32_t *layer)
{
    const uint32_t t = div_of(a.div_R, i), rem = i - t * a.R;
    const uint32_t l = div_of(a.div_k, rem), j = rem - l * (uint32_t)a.k;
    *layer = l;
    const int64_t at = (tl.tok0 + t) * a.ts + (int64_t)l * a.ls + (int64_t)j * a.ks;
    return (uint32_t)static_cast<const T *>(a.ids)[at];
}

/* Pass 1: each tile's occurrences of every split key. */
template <typename T>
__global__ void count_tiles(args a)
{
    extern __shared__ uint32_t smem[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t ti = (int64_t)blockIdx.x * (blockDim.x >> 5) + w;
    if (ti >= a.num_tiles) return;
    uint32_t *run = smem + (size_t)w * a.num_keys;
    for (int x = lane; x < a.num_keys; x += 32) run[x] = 0;
    __syncwarp();
    const tile tl = a.tiles[ti];
    const int32_t src = remap_src(tl.gpu, a.ep, a.nsrc);
    const uint32_t n = (uint32_t)tl.ntok * a.R;
    for (uint32_t i = lane; i < n; i += 32) {
        uint32_t l;
        const uint32_t e = element<T>(a, tl, i, &l);
        if (e >= (uint32_t)a.E) continue; /* checked before; never counted */
        const remap_cand c = a.cand[((size_t)l * a.E + e) * a.nsrc + src];
        if (c.count > 1) atomicAdd(&run[c.key], 1u); /* order does not matter for a count */
    }
    __syncwarp();
    uint32_t *dst = a.tile_count + (size_t)ti * a.num_keys;
    for (int x = lane; x < a.num_keys; x += 32) dst[x] = run[x];
}

/* Pass 2: per source GPU and key, the exclusive prefix over the source's tiles (in
 * list order), and the share boundaries from the source's total. */
__global__ void scan_tiles(args a, int32_t G)
{
    const int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= (int64_t)G * a.num_keys) return;
    const int32_t g = (int32_t)(col / a.num_keys), key = (int32_t)(col % a.num_keys);
    uint32_t run = 0;
    for (int32_t t = a.tile_begin[g]; t < a.tile_begin[g + 1]; t++) {
        uint32_t *p = a.tile_count + (size_t)t * a.num_keys + key;
        const uint32_t v = *p;
        *p = run;
        run += v;
    }
    if (a.key_bofs[key] >= 0)
        remap_apportion((int64_t)run, a.weight + a.key_first[key], a.key_count[key],
                        a.bounds + (size_t)g * a.share_slots + a.key_bofs[key]);
}

/* Pass 3: every element's physical id. Lanes take consecutive elements, so the warp
 * walks the tile in the CPU's order (token, layer, choice); lanes with the same key
 * rank among themselves by lane, after the occurrences of earlier steps. */
template <typename T>
__global__ void assign_tiles(args a)
{
    extern __shared__ uint32_t smem[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t ti = (int64_t)blockIdx.x * (blockDim.x >> 5) + w;
    if (ti >= a.num_tiles) return; /* the whole warp */
    uint32_t *run = smem + (size_t)w * a.num_keys;
    const uint32_t *base = a.tile_count + (size_t)ti * a.num_keys;
    for (int x = lane; x < a.num_keys; x += 32) run[x] = base[x];
    __syncwarp();
    const tile tl = a.tiles[ti];
    const int32_t src = remap_src(tl.gpu, a.ep, a.nsrc), js = tl.gpu % a.ep;
    const int64_t *bnd = a.bounds + (size_t)tl.gpu * a.share_slots;
    const uint32_t n = (uint32_t)tl.ntok * a.R;
    const unsigned lt_mask = (1u << lane) - 1u;
    int32_t *out = a.out + tl.tok0 * (int64_t)a.R;
    for (uint32_t b = 0; b < n; b += 32) {
        const uint32_t i = b + lane;
        const bool valid = i < n;
        remap_cand c = {-1, 1, -1, 0};
        if (valid) {
            uint32_t l;
            const uint32_t e = element<T>(a, tl, i, &l);
            if (e < (uint32_t)a.E) c = a.cand[((size_t)l * a.E + e) * a.nsrc + src];
        }
        const bool multi = valid && c.count > 1;
        int32_t phys = c.first;
        if (__any_sync(kFull, multi)) {
            const int kv = multi ? c.key : -1;
            const unsigned peers = __match_any_sync(kFull, kv);
            uint32_t o = 0;
            if (multi) o = run[kv] + (uint32_t)__popc(peers & lt_mask);
            __syncwarp();
            if (multi && (peers & lt_mask) == 0) run[kv] += (uint32_t)__popc(peers);
            __syncwarp();
            if (multi) {
                int32_t idx = 0;
                if (c.mode == REMAP_SHARES) {
                    const int64_t *cum = bnd + a.key_bofs[kv];
                    while (idx + 1 < c.count && (int64_t)o >= cum[idx]) idx++;
                } else {
                    idx = (int32_t)((o + (uint32_t)js) % (uint32_t)c.count);
                }
                phys = a.cand_phys[c.first + idx];
            }
        }
        if (valid) out[i] = phys;
    }
}

/* One GPU's own ids (tokens 0 .. n-1 of a local routing view): per-(layer, expert)
 * occurrences into out[0 .. L E), and the lowest flat index (token, layer, choice) of an
 * id outside [0, E) into out[L E] (left at ULLONG_MAX when every id is in range). The
 * rank-local remap's check and counts, read back by one copy. */
template <typename T>
__global__ void count_local(const void *ids, int64_t ts, int64_t ls, int64_t ks, int64_t n, int32_t L, int32_t k,
                            uint32_t E, unsigned long long *out)
{
    const int64_t total = n * (int64_t)L * k;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = i % k, l = (i / k) % L, t = i / ((int64_t)k * L);
        const uint32_t id = (uint32_t)static_cast<const T *>(ids)[t * ts + l * ls + j * ks];
        if (id >= E)
            atomicMin(&out[(int64_t)L * E], (unsigned long long)i);
        else
            atomicAdd(&out[l * (int64_t)E + id], 1ULL);
    }
}

rp_status cuda_fail(rp_error *err, cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return rp_fail(err, e == cudaErrorMemoryAllocation ? RP_ENOMEM : RP_EIO, "gpu remap: %s: %s", what,
                   cudaGetErrorString(e));
}

#define CU_CHECK(call, what)                   \
    do {                                       \
        cudaError_t e_ = (call);               \
        if (e_ != cudaSuccess) {               \
            st = cuda_fail(err, e_, what);     \
            goto out;                          \
        }                                      \
    } while (0)

/* Copy a host array to a new device allocation (nothing for 0 bytes), ordered on the
 * legacy default stream: the allocation and the copy do not wait for the device (a
 * pageable copy returns once its bytes are staged, so the host array may go). */
cudaError_t upload(void **dev, const void *host, size_t bytes)
{
    *dev = NULL;
    if (bytes == 0) return cudaSuccess;
    cudaError_t e = cudaMallocAsync(dev, bytes, 0);
    if (e != cudaSuccess) {
        *dev = NULL;
        return e;
    }
    return cudaMemcpyAsync(*dev, host, bytes, cudaMemcpyHostToDevice, 0);
}

void release(void *dev)
{
    if (dev) (void)cudaFreeAsync(dev, 0);
}

/* The rank-local check and counts (count_local), with the one wait of the call: the
 * copy of the counts back. Fills loads_row [L][E]. An id out of range: the per-sequence
 * check (rp_gpu_microbatch_loads) runs to name it as every other entry does. */
rp_status count_and_check(rp_context *ctx, const rp_routing *r, const int64_t *cu, int32_t num_seqs, int32_t E,
                          const int32_t *seq_gpu, int32_t G, int64_t *loads, int64_t *loads_row, rp_error *err)
{
    rp_status st = RP_OK;
    const int64_t n = cu[num_seqs] - cu[0];
    const size_t cells = (size_t)r->num_layers * (size_t)E;
    unsigned long long *out_dev = NULL, *out = NULL;
    void *cu_dev = NULL, *map_dev = NULL;
    if (n == 0) return RP_OK;
    out = (unsigned long long *)rp_alloc(ctx, (cells + 1) * sizeof *out);
    if (!out) return rp_fail_nomem(err, "gpu remap counts");
    CU_CHECK(cudaMallocAsync((void **)&out_dev, (cells + 1) * sizeof *out_dev, 0), "allocating counts");
    CU_CHECK(cudaMemsetAsync(out_dev, 0, cells * sizeof *out_dev, 0), "clearing counts");
    CU_CHECK(cudaMemsetAsync(out_dev + cells, 0xff, sizeof *out_dev, 0), "clearing counts");
    {
        const int64_t total = n * (int64_t)r->num_layers * r->top_k;
        const unsigned blocks = (unsigned)(total / 256 + 1 < 4096 ? total / 256 + 1 : 4096);
        const int64_t base = cu[0] * r->token_stride;
        switch (r->width) {
        case RP_ID_U8:
            count_local<uint8_t><<<blocks, 256>>>(static_cast<const uint8_t *>(r->base) + base, r->token_stride,
                                                   r->layer_stride, r->k_stride, n, r->num_layers, r->top_k,
                                                   (uint32_t)E, out_dev);
            break;
        case RP_ID_U16:
            count_local<uint16_t><<<blocks, 256>>>(static_cast<const uint16_t *>(r->base) + base, r->token_stride,
                                                    r->layer_stride, r->k_stride, n, r->num_layers, r->top_k,
                                                    (uint32_t)E, out_dev);
            break;
        default:
            count_local<int32_t><<<blocks, 256>>>(static_cast<const int32_t *>(r->base) + base, r->token_stride,
                                                   r->layer_stride, r->k_stride, n, r->num_layers, r->top_k,
                                                   (uint32_t)E, out_dev);
            break;
        }
    }
    CU_CHECK(cudaGetLastError(), "launching the id check");
    /* the one wait: the copy to pageable memory returns when the kernel and it are done */
    CU_CHECK(cudaMemcpy(out, out_dev, (cells + 1) * sizeof *out, cudaMemcpyDeviceToHost), "copying the counts");
    if (out[cells] != ULLONG_MAX) {
        /* an id out of range (the error path may wait more): name it as the others do */
        CU_CHECK(upload(&cu_dev, cu, sizeof(int64_t) * (size_t)(num_seqs + 1)), "copying cu_seqlens");
        CU_CHECK(upload(&map_dev, seq_gpu, sizeof(int32_t) * (size_t)num_seqs), "copying the sequence map");
        st = rp_gpu_microbatch_loads(r, (const int64_t *)cu_dev, num_seqs, E, (const int32_t *)map_dev, G, loads,
                                     err);
        if (st == RP_OK)
            st = rp_fail(err, RP_ERANGE, "gpu remap: an expert id at flat index %llu is outside [0, %d)",
                         (unsigned long long)out[cells], E);
        goto out;
    }
    for (size_t c = 0; c < cells; c++) loads_row[c] = (int64_t)out[c];
out:
    release(out_dev);
    release(cu_dev);
    release(map_dev);
    rp_free(ctx, out);
    return st;
}

template <typename T>
cudaError_t launch(const args &a, int warps, size_t smem, int32_t G)
{
    const unsigned blocks = (unsigned)((a.num_tiles + warps - 1) / warps);
    cudaError_t e;
    if (a.num_keys > 0) {
        if ((e = cudaFuncSetAttribute(count_tiles<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) !=
            cudaSuccess)
            return e;
        count_tiles<T><<<blocks, warps * 32, smem>>>(a);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
        const int64_t cols = (int64_t)G * a.num_keys;
        scan_tiles<<<(unsigned)((cols + 255) / 256), 256>>>(a, G);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
        if ((e = cudaFuncSetAttribute(assign_tiles<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem)) != cudaSuccess)
            return e;
    }
    assign_tiles<T><<<blocks, warps * 32, smem>>>(a);
    return cudaGetLastError();
}

/* The kernels over table `t`, whose sequences are those of a batch with offsets `cu`
 * (host): checks every id, writes phys_ids_dev, and fills `loads` [G][L][E] (host,
 * zeroed) with each source's occurrences. `local_gpu` < 0: every GPU's sequences
 * (rp_gpu_microbatch_loads checks and counts them) and the call synchronises before it
 * returns. `local_gpu` >= 0: the table lists that GPU's sequences only (rp_gpu_remap_rank):
 * the check and counts are one kernel and one copy back, the call's one wait for the
 * device; the tables go up after it and the remap kernels are left running on the legacy
 * default stream (work queued after the call on that stream, or on a stream that syncs
 * with it, such as torch's default stream, sees the ids). */
rp_status run_table(rp_context *ctx, const remap_table &t, const int64_t *cu, const rp_routing *routing_dev,
                    int32_t *phys_ids_dev, int64_t *loads, int32_t local_gpu, rp_error *err)
{
    rp_status st = RP_OK;
    const int32_t G = t.G, L = t.L, E = t.E;
    const int64_t R = (int64_t)L * t.k;
    void *cu_dev = NULL, *map_dev = NULL, *cand_dev = NULL, *phys_dev = NULL, *w_dev = NULL, *bofs_dev = NULL;
    void *first_dev = NULL, *count_dev = NULL, *tiles_dev = NULL, *tb_dev = NULL, *hist_dev = NULL;
    void *bounds_dev = NULL;
    tile *tiles = NULL;
    int32_t *tile_begin = NULL;
    int64_t num_tiles = 0, tile_tokens = kTileTokens;
    int device = 0, smem_max = 0, warps = kMaxWarps;
    size_t smem = 0;
    args a;

    if (t.num_order > 0 && !phys_ids_dev) {
        st = rp_fail(err, RP_EINVAL, "gpu remap: no output array");
        goto out;
    }
    if (rp_gpu_count() == 0) {
        st = rp_fail(err, RP_ENOTSUP, "gpu remap: no CUDA device is available");
        goto out;
    }
    /* a host pointer would fault in the kernel and end the process's CUDA context */
    if (t.num_order > 0 && routing_dev->base && !rp_gpu_pointer_readable(routing_dev->base)) {
        st = rp_fail(err, RP_EINVAL, "gpu remap: the routing ids are host memory; copy them to the device, "
                     "or use rp_remap for host data");
        goto out;
    }
    if (t.num_order > 0 && !rp_gpu_pointer_readable(phys_ids_dev)) {
        st = rp_fail(err, RP_EINVAL, "gpu remap: phys_ids is host memory; it must be device memory");
        goto out;
    }
    if (R > INT32_MAX / 2) {
        st = rp_fail(err, RP_ERANGE, "gpu remap: %lld ids per token are too many", (long long)R);
        goto out;
    }
    tile_begin = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * (size_t)(G + 1));
    if (!tile_begin) {
        st = rp_fail_nomem(err, "gpu remap tables");
        goto out;
    }
    /* Per-source totals, and every id checked, before anything is written. */
    if (local_gpu >= 0) {
        if (t.num_order > 0 &&
            (st = count_and_check(ctx, routing_dev, cu, t.num_seqs, E, t.seq_gpu, G, loads,
                                  loads + (size_t)local_gpu * (size_t)L * (size_t)E, err)) != RP_OK)
            goto out;
    } else {
        CU_CHECK(upload(&cu_dev, cu, sizeof(int64_t) * (size_t)(t.num_seqs + 1)), "copying cu_seqlens");
        CU_CHECK(upload(&map_dev, t.seq_gpu, sizeof(int32_t) * (size_t)t.num_seqs), "copying the sequence map");
    }
    if (local_gpu < 0 && t.num_order > 0) {
        st = rp_gpu_microbatch_loads(routing_dev, (const int64_t *)cu_dev, t.num_seqs, E, (const int32_t *)map_dev,
                                     G, loads, err);
        if (st != RP_OK) goto out;
    }

    /* Tiles in source order: GPU by GPU, sequences in list order, runs of tokens. */
    for (;;) {
        num_tiles = 0;
        for (int32_t i = 0; i < t.num_order; i++) {
            const int64_t len = cu[t.order[i] + 1] - cu[t.order[i]];
            num_tiles += (len + tile_tokens - 1) / tile_tokens;
        }
        if (num_tiles * t.num_keys * (int64_t)sizeof(uint32_t) <= kMaxTileBytes ||
            tile_tokens * 2 * R > INT32_MAX / 2)
            break;
        tile_tokens *= 2;
    }
    if (num_tiles > INT32_MAX / 2) {
        st = rp_fail(err, RP_ERANGE, "gpu remap: %lld tiles are too many", (long long)num_tiles);
        goto out;
    }
    tiles = (tile *)rp_alloc(ctx, sizeof(tile) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (!tiles) {
        st = rp_fail_nomem(err, "gpu remap tiles");
        goto out;
    }
    num_tiles = 0;
    for (int32_t g = 0; g < G; g++) {
        tile_begin[g] = (int32_t)num_tiles;
        for (int32_t i = t.gpu_begin[g]; i < t.gpu_begin[g + 1]; i++) {
            const int32_t s = t.order[i];
            for (int64_t t0 = cu[s]; t0 < cu[s + 1]; t0 += tile_tokens) {
                const int64_t n = cu[s + 1] - t0 < tile_tokens ? cu[s + 1] - t0 : tile_tokens;
                tiles[num_tiles++] = tile{t0, (int32_t)n, g};
            }
        }
    }
    tile_begin[G] = (int32_t)num_tiles;
    if (num_tiles > 0) {
        CU_CHECK(cudaGetDevice(&device), "cudaGetDevice");
        CU_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                 "device attributes");
        if (t.num_keys > 0) {
            const int64_t per_warp = (int64_t)t.num_keys * (int64_t)sizeof(uint32_t);
            if (per_warp > smem_max) {
                st = rp_fail(err, RP_ENOTSUP,
                             "gpu remap: %d split (layer, expert) pairs need %lld bytes of shared memory per warp, "
                             "more than the device's %d", t.num_keys, (long long)per_warp, smem_max);
                goto out;
            }
            warps = (int)(smem_max / per_warp);
            if (warps > kMaxWarps) warps = kMaxWarps;
            smem = (size_t)warps * (size_t)per_warp;
        }
        CU_CHECK(upload(&cand_dev, t.cand, sizeof(remap_cand) * (size_t)L * (size_t)E * (size_t)t.nsrc),
                 "copying the replica table");
        CU_CHECK(upload(&phys_dev, t.cand_phys, sizeof(int32_t) * (size_t)t.num_cand), "copying the replica table");
        CU_CHECK(upload(&w_dev, t.weight, sizeof(uint64_t) * (size_t)t.num_cand), "copying the shares");
        CU_CHECK(upload(&bofs_dev, t.key_bofs, sizeof(int32_t) * (size_t)t.num_keys), "copying the keys");
        CU_CHECK(upload(&first_dev, t.key_first, sizeof(int32_t) * (size_t)t.num_keys), "copying the keys");
        CU_CHECK(upload(&count_dev, t.key_count, sizeof(int32_t) * (size_t)t.num_keys), "copying the keys");
        CU_CHECK(upload(&tiles_dev, tiles, sizeof(tile) * (size_t)num_tiles), "copying the tiles");
        CU_CHECK(upload(&tb_dev, tile_begin, sizeof(int32_t) * (size_t)(G + 1)), "copying the tiles");
        if (t.num_keys > 0)
            CU_CHECK(cudaMallocAsync(&hist_dev, sizeof(uint32_t) * (size_t)num_tiles * (size_t)t.num_keys, 0),
                     "allocating tile counters");
        if (t.share_slots > 0)
            CU_CHECK(cudaMallocAsync(&bounds_dev, sizeof(int64_t) * (size_t)G * (size_t)t.share_slots, 0),
                     "allocating share bounds");
        memset(&a, 0, sizeof a);
        a.ids = routing_dev->base;
        a.ts = routing_dev->token_stride, a.ls = routing_dev->layer_stride, a.ks = routing_dev->k_stride;
        a.L = L, a.k = t.k, a.E = E, a.ep = t.ep, a.nsrc = t.nsrc, a.num_keys = t.num_keys;
        a.share_slots = t.share_slots;
        a.R = (uint32_t)R;
        a.div_R = make_div((uint32_t)R);
        a.div_k = make_div((uint32_t)t.k);
        a.tiles = (const tile *)tiles_dev;
        a.num_tiles = (int32_t)num_tiles;
        a.cand = (const remap_cand *)cand_dev;
        a.cand_phys = (const int32_t *)phys_dev;
        a.weight = (const uint64_t *)w_dev;
        a.key_bofs = (const int32_t *)bofs_dev;
        a.key_first = (const int32_t *)first_dev;
        a.key_count = (const int32_t *)count_dev;
        a.tile_begin = (const int32_t *)tb_dev;
        a.tile_count = (uint32_t *)hist_dev;
        a.bounds = (int64_t *)bounds_dev;
        a.out = phys_ids_dev;
        switch (routing_dev->width) {
        case RP_ID_U8: CU_CHECK(launch<uint8_t>(a, warps, smem, G), "launching the remap kernels"); break;
        case RP_ID_U16: CU_CHECK(launch<uint16_t>(a, warps, smem, G), "launching the remap kernels"); break;
        default: CU_CHECK(launch<int32_t>(a, warps, smem, G), "launching the remap kernels"); break;
        }
        if (local_gpu < 0) CU_CHECK(cudaStreamSynchronize(0), "running the remap kernels");
    }
out:
    /* stream-ordered: freed once the kernels are done, without waiting for them here */
    release(cu_dev);
    release(map_dev);
    release(cand_dev);
    release(phys_dev);
    release(w_dev);
    release(bofs_dev);
    release(first_dev);
    release(count_dev);
    release(tiles_dev);
    release(tb_dev);
    release(hist_dev);
    release(bounds_dev);
    rp_free(ctx, tiles);
    rp_free(ctx, tile_begin);
    return st;
}

} // namespace

extern "C" rp_status rp_gpu_remap(const rp_plan *plan, const rp_config *cfg, int32_t mb, const rp_batch *batch,
                                  const rp_routing *routing_dev, rp_split_rule rule, int32_t *phys_ids_dev,
                                  int64_t *slot_tokens, rp_error *err)
{
    if (!plan || !routing_dev || !batch) return rp_fail(err, RP_EINVAL, "gpu remap: missing plan, batch or routing");
    if (routing_dev->layout != RP_ROUTING_PACKED)
        return rp_fail(err, RP_ENOTSUP, "gpu remap: only the packed routing layout is supported on the device");
    rp_context *ctx = rp_plan_context(plan);
    remap_table t;
    rp_status st = remap_table_build(ctx, plan, cfg, mb, batch, routing_dev->num_layers, routing_dev->top_k, rule,
                                     &t, err);
    if (st != RP_OK) return st;
    const size_t rows = (size_t)t.L * (size_t)t.Q * (size_t)t.P;
    int64_t *loads = NULL;
    if ((st = rp_routing_check_shape(routing_dev, batch, t.E, err)) != RP_OK) goto out;
    loads = (int64_t *)rp_calloc(ctx, (size_t)t.G * (size_t)t.L * (size_t)t.E + 1, sizeof *loads);
    if (!loads) {
        st = rp_fail_nomem(err, "gpu remap tables");
        goto out;
    }
    if ((st = run_table(ctx, t, rp_batch_cu_seqlens(batch), routing_dev, phys_ids_dev, loads, -1, err)) != RP_OK)
        goto out;
    if (slot_tokens) {
        memset(slot_tokens, 0, rows * sizeof *slot_tokens);
        for (int32_t g = 0; g < t.G; g++)
            for (int32_t l = 0; l < t.L; l++)
                for (int32_t e = 0; e < t.E; e++)
                    remap_add_counts(&t, g, l, e, loads[((size_t)g * t.L + l) * t.E + e], slot_tokens);
    }
out:
    rp_free(ctx, loads);
    remap_table_free(ctx, &t);
    return st;
}

/* rp_remap_rank on the device: the table seen from GPU `gpu` alone, as core/remap.c's
 * rp_remap_rank builds it (its listed sequences are the local ones 0 .. m-1; the other
 * GPUs list none), run by the same kernels. */
extern "C" rp_status rp_gpu_remap_rank(const rp_plan *plan, const rp_config *cfg, int32_t mb, int32_t gpu,
                                       const rp_batch *batch, const rp_routing *local_routing_dev, rp_split_rule rule,
                                       int32_t *phys_ids_dev, int64_t *slot_tokens, rp_error *err)
{
    if (!plan || !local_routing_dev || !batch)
        return rp_fail(err, RP_EINVAL, "gpu remap: missing plan, batch or routing");
    if (local_routing_dev->layout != RP_ROUTING_PACKED)
        return rp_fail(err, RP_ENOTSUP, "gpu remap: only the packed routing layout is supported on the device");
    rp_context *ctx = rp_plan_context(plan);
    remap_table t;
    rp_status st = remap_table_build(ctx, plan, cfg, mb, batch, local_routing_dev->num_layers,
                                     local_routing_dev->top_k, rule, &t, err);
    if (st != RP_OK) return st;
    rp_batch *local = NULL;
    int32_t *plen = NULL, *rlen = NULL, *iota = NULL, *begin = NULL, *seq_gpu = NULL;
    int64_t *loads = NULL, *rows = NULL;
    int32_t m = 0;
    const int32_t *listed = NULL;
    remap_table lt;
    if (gpu < 0 || gpu >= t.G) {
        st = rp_fail(err, RP_EINVAL, "gpu remap: GPU %d is out of range (the plan has %d)", gpu, t.G);
        goto out;
    }
    m = t.gpu_begin[gpu + 1] - t.gpu_begin[gpu];
    listed = t.order + t.gpu_begin[gpu];
    plen = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    rlen = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    iota = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    seq_gpu = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * ((size_t)m + 1));
    begin = (int32_t *)rp_alloc(ctx, sizeof(int32_t) * ((size_t)t.G + 1));
    loads = (int64_t *)rp_calloc(ctx, (size_t)t.G * (size_t)t.L * (size_t)t.E + 1, sizeof *loads);
    rows = (int64_t *)rp_calloc(ctx, (size_t)t.L * (size_t)t.Q * (size_t)t.P + 1, sizeof *rows);
    if (!plen || !rlen || !iota || !seq_gpu || !begin || !loads || !rows) {
        st = rp_fail_nomem(err, "gpu remap tables");
        goto out;
    }
    for (int32_t i = 0; i < m; i++) {
        plen[i] = rp_batch_prompt_lens(batch)[listed[i]];
        rlen[i] = rp_batch_response_lens(batch)[listed[i]];
        iota[i] = i;
        seq_gpu[i] = gpu;
    }
    if ((st = rp_batch_new(ctx, m, plen, rlen, NULL, &local, err)) != RP_OK) goto out;
    if ((st = rp_routing_check_shape(local_routing_dev, local, t.E, err)) != RP_OK) goto out;
    for (int32_t g = 0; g <= t.G; g++) begin[g] = g <= gpu ? 0 : m;
    lt = t;
    lt.order = iota;
    lt.num_order = m;
    lt.num_seqs = m;
    lt.gpu_begin = begin;
    lt.seq_gpu = seq_gpu;
    st = run_table(ctx, lt, rp_batch_cu_seqlens(local), local_routing_dev, phys_ids_dev, loads, gpu, err);
    if (st == RP_ERANGE && err && err->sequence >= 0 && err->sequence < m) {
        /* the sequence an id error names is the global one, as on the CPU */
        const int32_t global = listed[err->sequence];
        const char *rest = strstr(err->text, " token ");
        char text[sizeof err->text];
        snprintf(text, sizeof text, "routing: sequence %d%s", global, rest ? rest : "");
        if (rest) memcpy(err->text, text, sizeof text);
        err->sequence = global;
    }
    if (st != RP_OK) goto out;
    if (slot_tokens) {
        const size_t q = (size_t)(gpu / t.ep);
        for (int32_t l = 0; l < t.L; l++)
            for (int32_t e = 0; e < t.E; e++)
                remap_add_counts(&t, gpu, l, e, loads[((size_t)gpu * t.L + l) * t.E + e], rows);
        for (int32_t l = 0; l < t.L; l++)
            memcpy(slot_tokens + (size_t)l * t.P, rows + ((size_t)l * t.Q + q) * t.P, (size_t)t.P * sizeof *rows);
    }
out:
    rp_batch_free(local);
    rp_free(ctx, plen);
    rp_free(ctx, rlen);
    rp_free(ctx, iota);
    rp_free(ctx, seq_gpu);
    rp_free(ctx, begin);
    rp_free(ctx, loads);
    rp_free(ctx, rows);
    remap_table_free(ctx, &t);
    return st;
}
