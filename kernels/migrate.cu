/* CUDA kernels for the migration executor (routepack/gpu.h): gather expert parts into a
 * contiguous buffer, scatter it back, and the two-level XXH64 checksum of each expert's
 * bytes, equal to rp_checksum_expert (core/checksum.c). */
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

extern "C" {
#include "internal.h"
}
#include "routepack/checksum.h"
#include "routepack/gpu.h"

namespace {

constexpr int kCopyThreads = 256;
constexpr uint64_t kCopyChunk = 64 * 1024; /* bytes one block copies */
constexpr int kHashThreads = 256;          /* 64 quads: one quad hashes one block */
constexpr unsigned kFull = 0xffffffffu;

/* ---- copies ------------------------------------------------------------------------ */

struct segment {
    const unsigned char *src;
    unsigned char *dst;
    uint64_t bytes;
    uint64_t chunk0; /* index of the segment's first chunk among all chunks */
};

/* Copy [a, b) of a segment: 16-byte vectors where source and destination share their
 * alignment, else 4-byte words where they can, else bytes. */
__device__ void copy_range(const unsigned char *src, unsigned char *dst, uint64_t n)
{
    const int tid = threadIdx.x, nt = blockDim.x;
    const uintptr_t sa = (uintptr_t)src, da = (uintptr_t)dst;
    if ((sa & 15) == (da & 15)) {
        const uint64_t head = ((16 - (sa & 15)) & 15) < n ? ((16 - (sa & 15)) & 15) : n;
        for (uint64_t i = tid; i < head; i += nt) dst[i] = src[i];
        const uint64_t nv = (n - head) / 16;
        const uint4 *s4 = reinterpret_cast<const uint4 *>(src + head);
        uint4 *d4 = reinterpret_cast<uint4 *>(dst + head);
        uint64_t i = tid;
        /* four loads in flight per thread before the stores */
        for (; i + 3 * (uint64_t)nt < nv; i += 4 * (uint64_t)nt) {
            const uint4 x0 = __ldg(s4 + i), x1 = __ldg(s4 + i + nt), x2 = __ldg(s4 + i + 2 * nt),
                        x3 = __ldg(s4 + i + 3 * nt);
            d4[i] = x0;
            d4[i + nt] = x1;
            d4[i + 2 * nt] = x2;
            d4[i + 3 * nt] = x3;
        }
        for (; i < nv; i += nt) d4[i] = __ldg(s4 + i);
        for (uint64_t j = head + nv * 16 + tid; j < n; j += nt) dst[j] = src[j];
    } else if ((sa & 3) == (da & 3)) {
        const uint64_t head = ((4 - (sa & 3)) & 3) < n ? ((4 - (sa & 3)) & 3) : n;
        for (uint64_t i = tid; i < head; i += nt) dst[i] = src[i];
        const uint64_t nw = (n - head) / 4;
        const uint32_t *s4 = reinterpret_cast<const uint32_t *>(src + head);
        uint32_t *d4 = reinterpret_cast<uint32_t *>(dst + head);
        for (uint64_t i = tid; i < nw; i += nt) d4[i] = s4[i];
        for (uint64_t j = head + nw * 4 + tid; j < n; j += nt) dst[j] = src[j];
    } else {
        for (uint64_t i = tid; i < n; i += nt) dst[i] = src[i];
    }
}

__global__ void copy_segments(const segment *seg, int32_t nseg, uint64_t nchunks)
{
    for (uint64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
        int32_t lo = 0, hi = nseg - 1; /* last segment with chunk0 <= c */
        while (lo < hi) {
            const int32_t mid = (lo + hi + 1) / 2;
            if (seg[mid].chunk0 <= c) lo = mid;
            else hi = mid - 1;
        }
        const segment s = seg[lo];
        const uint64_t a = (c - s.chunk0) * kCopyChunk;
        const uint64_t n = s.bytes - a < kCopyChunk ? s.bytes - a : kCopyChunk;
        copy_range(s.src + a, s.dst + a, n);
    }
}

/* ---- XXH64 ------------------------------------------------------------------------- */

constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL,
                   P4 = 0x85EBCA77C2B2AE63ULL, P5 = 0x27D4EB2F165667C5ULL;

__device__ __forceinline__ uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
__device__ __forceinline__ uint64_t merge64(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * P1 + P4; }

/* An expert's byte stream: its parts one after another. */
struct part {
    const unsigned char *ptr;
    uint64_t start; /* offset of the part in the expert's stream */
    uint64_t bytes;
};

struct expert {
    int32_t part0, nparts;
    uint64_t bytes;
    uint64_t block0; /* index of the expert's first block among all blocks */
};

/* Reads bytes [base, base + len) of an expert's stream. Fast: one 8-byte-aligned
 * pointer. Otherwise byte by byte through the parts, with a cursor that only moves
 * forward (each lane reads ascending offsets). */
struct reader {
    const unsigned char *direct; /* non-NULL: the fast path */
    const part *parts;
    int32_t np, cur;
    uint64_t base;

    __device__ unsigned char byte(uint64_t off)
    {
        if (direct) return direct[off];
        const uint64_t x = base + off;
        while (cur + 1 < np && x >= parts[cur].start + parts[cur].bytes) cur++;
        return parts[cur].ptr[x - parts[cur].start];
    }
    __device__ uint64_t word(uint64_t off)
    {
        if (direct) return *reinterpret_cast<const uint64_t *>(direct + off);
        uint64_t v = 0;
        for (int i = 0; i < 8; i++) v |= (uint64_t)byte(off + i) << (8 * i);
        return v;
    }
    __device__ uint32_t word32(uint64_t off)
    {
        if (direct) return *reinterpret_cast<const uint32_t *>(direct + off);
        uint32_t v = 0;
        for (int i = 0; i < 4; i++) v |= (uint32_t)byte(off + i) << (8 * i);
        return v;
    }
};

/* XXH64 (seed 0) of `len` bytes, by the four lanes of a quad: lane q runs accumulator
 * q over word q of every 32-byte stripe (XXH64's four lanes are independent), then
 * lane 0 merges and finishes. Every lane of the warp must call it (shuffles); lanes
 * with `active` false pass len 0 and get garbage. Returns the hash on lane q == 0. */
__device__ uint64_t xxh64_quad(reader &rd, uint64_t len)
{
    const int lane = threadIdx.x & 31, q = lane & 3;
    const uint64_t stripes = len / 32;
    uint64_t v = q == 0 ? P1 + P2 : q == 1 ? P2 : q == 2 ? 0 : 0 - P1;
    uint64_t s = 0;
    for (; s + 4 <= stripes; s += 4) {
        const uint64_t w0 = rd.word(s * 32 + q * 8), w1 = rd.word((s + 1) * 32 + q * 8),
                       w2 = rd.word((s + 2) * 32 + q * 8), w3 = rd.word((s + 3) * 32 + q * 8);
        v = round64(round64(round64(round64(v, w0), w1), w2), w3);
    }
    for (; s < stripes; s++) v = round64(v, rd.word(s * 32 + q * 8));
    const int lead = lane & ~3;
    const uint64_t v1 = __shfl_sync(kFull, v, lead), v2 = __shfl_sync(kFull, v, lead + 1),
                   v3 = __shfl_sync(kFull, v, lead + 2), v4 = __shfl_sync(kFull, v, lead + 3);
    if (q != 0) return 0;
    uint64_t h;
    if (len >= 32) {
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = merge64(merge64(merge64(merge64(h, v1), v2), v3), v4);
    } else {
        h = P5;
    }
    h += len;
    uint64_t p = stripes * 32;
    for (; p + 8 <= len; p += 8) h = rotl(h ^ round64(0, rd.word(p)), 27) * P1 + P4;
    if (p + 4 <= len) {
        h = rotl(h ^ ((uint64_t)rd.word32(p) * P1), 23) * P2 + P3;
        p += 4;
    }
    for (; p < len; p++) h = rotl(h ^ ((uint64_t)rd.byte(p) * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* Level 1: one quad per 4 KiB block of any expert. */
__global__ void hash_blocks(const expert *ex, int32_t nex, const part *parts, uint64_t nblocks, uint64_t *out)
{
    const uint64_t quad = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 4;
    const bool active = quad < nblocks;
    reader rd = {nullptr, parts, 0, 0, 0};
    uint64_t len = 0;
    __shared__ unsigned char dummy[8];
    rd.direct = dummy; /* inactive lanes read nothing (len 0) */
    if (active) {
        int32_t lo = 0, hi = nex - 1; /* last expert with block0 <= quad */
        while (lo < hi) {
            const int32_t mid = (lo + hi + 1) / 2;
            if (ex[mid].block0 <= quad) lo = mid;
            else hi = mid - 1;
        }
        const expert e = ex[lo];
        const uint64_t start = (quad - e.block0) * RP_CHECKSUM_BLOCK;
        len = e.bytes - start < RP_CHECKSUM_BLOCK ? e.bytes - start : RP_CHECKSUM_BLOCK;
        /* the part holding the block's first byte (skipping empty parts) */
        int32_t p = e.part0, pend = e.part0 + e.nparts;
        while (p + 1 < pend && start >= parts[p].start + parts[p].bytes) p++;
        const unsigned char *at = parts[p].ptr + (start - parts[p].start);
        if (start + len <= parts[p].start + parts[p].bytes && ((uintptr_t)at & 7) == 0) {
            rd.direct = at;
        } else {
            rd.direct = nullptr;
            rd.parts = parts + e.part0;
            rd.np = e.nparts;
            rd.cur = p - e.part0;
            rd.base = start;
        }
    }
    const uint64_t h = xxh64_quad(rd, len);
    if (active && (threadIdx.x & 3) == 0) out[quad] = h;
}

/* Level 2: one quad per expert, over its block hashes as little-endian words. */
__global__ void hash_experts(const expert *ex, int32_t nex, const uint64_t *block_hash, uint64_t *out)
{
    const int64_t quad = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 4;
    const bool active = quad < nex;
    __shared__ uint64_t dummy;
    reader rd = {reinterpret_cast<const unsigned char *>(&dummy), nullptr, 0, 0, 0};
    uint64_t len = 0;
    if (active) {
        const expert e = ex[quad];
        rd.direct = reinterpret_cast<const unsigned char *>(block_hash + e.block0);
        len = (e.bytes + RP_CHECKSUM_BLOCK - 1) / RP_CHECKSUM_BLOCK * 8;
    }
    const uint64_t h = xxh64_quad(rd, len);
    if (active && (threadIdx.x & 3) == 0) out[quad] = h;
}

/* ---- host side --------------------------------------------------------------------- */

rp_status cuda_fail(rp_error *err, cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return rp_fail(err, e == cudaErrorMemoryAllocation ? RP_ENOMEM : RP_EIO, "gpu migrate: %s: %s", what,
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

/* The argument checks shared by all three calls; *total gets the bytes of all experts. */
rp_status check_parts(rp_context *ctx, const char *what, const void *const *ptr, const size_t *bytes, const int32_t *begin,
                      int32_t n, uint64_t *total, int32_t *nparts, rp_error *err)
{
    *total = 0;
    *nparts = 0;
    if (n < 0) return rp_fail(err, RP_EINVAL, "%s: %d experts", what, n);
    if (n == 0) return RP_OK;
    if (!ctx) return rp_fail(err, RP_EINVAL, "%s: no context", what);
    if (!begin) return rp_fail(err, RP_EINVAL, "%s: no part_begin array", what);
    if (begin[0] != 0) return rp_fail(err, RP_EINVAL, "%s: part_begin[0] is %d, not 0", what, begin[0]);
    for (int32_t i = 0; i < n; i++)
        if (begin[i + 1] < begin[i])
            return rp_fail(err, RP_EINVAL, "%s: part_begin goes backwards at expert %d (%d after %d)", what, i,
                           begin[i + 1], begin[i]);
    *nparts = begin[n];
    if (*nparts > 0 && (!ptr || !bytes)) return rp_fail(err, RP_EINVAL, "%s: no part arrays", what);
    for (int32_t p = 0; p < *nparts; p++) {
        if (bytes[p] > 0 && !ptr[p]) return rp_fail(err, RP_EINVAL, "%s: part %d has %zu bytes and no pointer", what, p, bytes[p]);
        if (*total + bytes[p] < *total) return rp_fail(err, RP_ERANGE, "%s: the parts' sizes overflow", what);
        *total += bytes[p];
    }
    return RP_OK;
}

rp_status need_device(const char *what, rp_error *err)
{
    if (rp_gpu_count() == 0) return rp_fail(err, RP_ENOTSUP, "%s: no CUDA device is available", what);
    return RP_OK;
}

/* Gather (to_buffer) or scatter: one segment per non-empty part. */
rp_status copy_parts(rp_context *ctx, const char *what, bool to_buffer, const void *const *ptr, const size_t *bytes,
                     const int32_t *begin, int32_t n, unsigned char *buffer, size_t buffer_bytes, void *stream,
                     rp_error *err)
{
    uint64_t total = 0;
    int32_t np = 0, nseg = 0;
    rp_status st = check_parts(ctx, what, ptr, bytes, begin, n, &total, &np, err);
    if (st != RP_OK) return st;
    if (total > buffer_bytes)
        return rp_fail(err, RP_EINVAL, "%s: the experts hold %llu bytes, more than the buffer's %zu", what,
                       (unsigned long long)total, buffer_bytes);
    if (total == 0) return RP_OK;
    if (!buffer) return rp_fail(err, RP_EINVAL, "%s: no buffer", what);
    if ((st = need_device(what, err)) != RP_OK) return st;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    segment *seg = static_cast<segment *>(rp_alloc(ctx, sizeof(segment) * (size_t)np));
    segment *seg_dev = NULL;
    uint64_t off = 0, chunks = 0;
    if (!seg) return rp_fail_nomem(err, "copy segments");
    for (int32_t p = 0; p < np; p++) {
        if (bytes[p] == 0) continue;
        unsigned char *part_p = const_cast<unsigned char *>(static_cast<const unsigned char *>(ptr[p]));
        seg[nseg].src = to_buffer ? part_p : buffer + off;
        seg[nseg].dst = to_buffer ? buffer + off : part_p;
        seg[nseg].bytes = bytes[p];
        seg[nseg].chunk0 = chunks;
        chunks += (bytes[p] + kCopyChunk - 1) / kCopyChunk;
        off += bytes[p];
        nseg++;
    }
    {
        /* enough blocks to fill the device; each walks chunks grid-stride */
        const unsigned grid = (unsigned)(chunks < 65535 * 8 ? chunks : 65535 * 8);
        CU_CHECK(cudaMallocAsync((void **)&seg_dev, sizeof(segment) * (size_t)nseg, s), "allocating segments");
        CU_CHECK(cudaMemcpyAsync(seg_dev, seg, sizeof(segment) * (size_t)nseg, cudaMemcpyHostToDevice, s),
                 "copying segments");
        copy_segments<<<grid, kCopyThreads, 0, s>>>(seg_dev, nseg, chunks);
        CU_CHECK(cudaGetLastError(), "launching the copy");
    }
out:
    if (seg_dev) cudaFreeAsync(seg_dev, s);
    rp_free(ctx, seg);
    return st;
}

} // namespace

extern "C" rp_status rp_gpu_gather(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes, const int32_t *part_begin,
                                   int32_t num_experts, void *buffer_dev, size_t buffer_bytes, void *stream,
                                   rp_error *err)
{
    return copy_parts(ctx, "gpu gather", true, part_ptr, part_bytes, part_begin, num_experts,
                      static_cast<unsigned char *>(buffer_dev), buffer_bytes, stream, err);
}

extern "C" rp_status rp_gpu_scatter(rp_context *ctx, const void *buffer_dev, size_t buffer_bytes, void *const *part_ptr,
                                    const size_t *part_bytes, const int32_t *part_begin, int32_t num_experts,
                                    void *stream, rp_error *err)
{
    return copy_parts(ctx, "gpu scatter", false, const_cast<const void *const *>(part_ptr), part_bytes, part_begin,
                      num_experts, static_cast<unsigned char *>(const_cast<void *>(buffer_dev)), buffer_bytes,
                      stream, err);
}

extern "C" rp_status rp_gpu_checksum(rp_context *ctx, const void *const *part_ptr, const size_t *part_bytes,
                                     const int32_t *part_begin, int32_t num_experts, uint64_t *checksums,
                                     void *stream, rp_error *err)
{
    uint64_t total = 0, nblocks = 0;
    int32_t np = 0;
    rp_status st = check_parts(ctx, "gpu checksum", part_ptr, part_bytes, part_begin, num_experts, &total, &np, err);
    if (st != RP_OK) return st;
    if (num_experts == 0) return RP_OK;
    if (!checksums) return rp_fail(err, RP_EINVAL, "gpu checksum: no output array");
    if ((st = need_device("gpu checksum", err)) != RP_OK) return st;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    expert *ex = static_cast<expert *>(rp_alloc(ctx, sizeof(expert) * (size_t)num_experts));
    part *pa = static_cast<part *>(rp_alloc(ctx, sizeof(part) * (size_t)(np > 0 ? np : 1)));
    char *mem = NULL;
    if (!ex || !pa) {
        rp_free(ctx, ex);
        rp_free(ctx, pa);
        return rp_fail_nomem(err, "checksum descriptors");
    }
    for (int32_t i = 0; i < num_experts; i++) {
        uint64_t start = 0;
        for (int32_t p = part_begin[i]; p < part_begin[i + 1]; p++) {
            pa[p].ptr = static_cast<const unsigned char *>(part_ptr[p]);
            pa[p].start = start;
            pa[p].bytes = part_bytes[p];
            start += part_bytes[p];
        }
        ex[i].part0 = part_begin[i];
        ex[i].nparts = part_begin[i + 1] - part_begin[i];
        ex[i].bytes = start;
        ex[i].block0 = nblocks;
        nblocks += (start + RP_CHECKSUM_BLOCK - 1) / RP_CHECKSUM_BLOCK;
    }
    {
        const size_t ex_bytes = (sizeof(expert) * (size_t)num_experts + 255) / 256 * 256;
        const size_t pa_bytes = (sizeof(part) * (size_t)(np > 0 ? np : 1) + 255) / 256 * 256;
        const size_t bh_bytes = (sizeof(uint64_t) * (size_t)(nblocks > 0 ? nblocks : 1) + 255) / 256 * 256;
        const size_t out_bytes = sizeof(uint64_t) * (size_t)num_experts;
        CU_CHECK(cudaMallocAsync((void **)&mem, ex_bytes + pa_bytes + bh_bytes + out_bytes, s),
                 "allocating checksum scratch");
        expert *ex_dev = reinterpret_cast<expert *>(mem);
        part *pa_dev = reinterpret_cast<part *>(mem + ex_bytes);
        uint64_t *bh_dev = reinterpret_cast<uint64_t *>(mem + ex_bytes + pa_bytes);
        uint64_t *out_dev = reinterpret_cast<uint64_t *>(mem + ex_bytes + pa_bytes + bh_bytes);
        CU_CHECK(cudaMemcpyAsync(ex_dev, ex, sizeof(expert) * (size_t)num_experts, cudaMemcpyHostToDevice, s),
                 "copying checksum descriptors");
        if (np > 0)
            CU_CHECK(cudaMemcpyAsync(pa_dev, pa, sizeof(part) * (size_t)np, cudaMemcpyHostToDevice, s),
                     "copying checksum descriptors");
        if (nblocks > 0) {
            const uint64_t threads = nblocks * 4;
            hash_blocks<<<(unsigned)((threads + kHashThreads - 1) / kHashThreads), kHashThreads, 0, s>>>(
                ex_dev, num_experts, pa_dev, nblocks, bh_dev);
            CU_CHECK(cudaGetLastError(), "launching the block hashes");
        }
        const uint64_t threads = (uint64_t)num_experts * 4;
        hash_experts<<<(unsigned)((threads + kHashThreads - 1) / kHashThreads), kHashThreads, 0, s>>>(
            ex_dev, num_experts, bh_dev, out_dev);
        CU_CHECK(cudaGetLastError(), "launching the expert hashes");
        CU_CHECK(cudaMemcpyAsync(checksums, out_dev, out_bytes, cudaMemcpyDeviceToHost, s), "copying checksums");
        CU_CHECK(cudaStreamSynchronize(s), "running the checksum kernels");
    }
out:
    if (mem) {
        cudaFreeAsync(mem, s);
        if (st != RP_OK) (void)cudaStreamSynchronize(s);
    }
    rp_free(ctx, ex);
    rp_free(ctx, pa);
    return st;
}
