/* Device code for tests/bench/bench_gpu.c: routing ids generated on the device, the
 * device-to-device copy baseline, and the cost-model calibration loops (expert GEMMs
 * through cuBLAS, blocked causal attention from cuBLAS GEMMs and a softmax kernel). */
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>

#ifdef RP_HAVE_CUBLAS
#include <cublas_v2.h>
#endif

namespace {

__device__ __forceinline__ uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ULL;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dULL;
    x ^= x >> 33;
    return x;
}

/* ids[t][l][j]: a skewed base expert per (token, layer) (30% of them among 8 hot
 * experts), the k choices base + 17 j mod E: distinct within a token when E is a power
 * of two (17 is odd). */
__global__ void gen_ids(uint8_t *ids, int64_t records, int32_t k, int32_t experts, uint64_t seed)
{
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < records;
         r += (int64_t)gridDim.x * blockDim.x) {
        const uint64_t h = mix(seed ^ (uint64_t)r * 0x9E3779B97F4A7C15ULL);
        const uint32_t base = (h % 100) < 30 ? (uint32_t)((h >> 8) % 8) : (uint32_t)((h >> 8) % (uint64_t)experts);
        for (int32_t j = 0; j < k; j++) ids[r * k + j] = (uint8_t)((base + 17u * (uint32_t)j) % (uint32_t)experts);
    }
}

__global__ void fill_bf16(__nv_bfloat16 *p, int64_t n, uint64_t seed)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const double u = (double)(mix(seed + (uint64_t)i) >> 11) * (1.0 / 9007199254740992.0);
        p[i] = __float2bfloat16((float)(u * 2.0 - 1.0));
    }
}

/* Causal softmax of one query column of a score block: keys 0 .. limit-1 are visible
 * (limit = the query's position + 1), the rest get probability 0. One block per
 * (head, query). */
__global__ void causal_softmax(const float *s, __nv_bfloat16 *p, int32_t keys, int32_t queries, int32_t q0,
                               float scale)
{
    const int32_t q = blockIdx.x, h = blockIdx.y;
    const float *col = s + ((int64_t)h * queries + q) * keys;
    __nv_bfloat16 *out = p + ((int64_t)h * queries + q) * keys;
    const int32_t limit = q0 + q + 1;
    __shared__ float red[32];
    float m = -INFINITY;
    for (int32_t i = threadIdx.x; i < limit; i += blockDim.x) m = fmaxf(m, col[i] * scale);
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    m = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x / 32); i++) m = fmaxf(m, red[i]);
    __syncthreads();
    float sum = 0.f;
    for (int32_t i = threadIdx.x; i < limit; i += blockDim.x) sum += __expf(col[i] * scale - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.f;
    for (int i = 0; i < (int)(blockDim.x / 32); i++) sum += red[i];
    const float inv = 1.f / sum;
    for (int32_t i = threadIdx.x; i < keys; i += blockDim.x)
        out[i] = __float2bfloat16(i < limit ? __expf(col[i] * scale - m) * inv : 0.f);
}

double now_s()
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void say(char *why, size_t len, const char *what, cudaError_t e)
{
    if (why && len) snprintf(why, len, "%s: %s", what, cudaGetErrorString(e));
}

} // namespace

extern "C" int bench_gen_ids(void *ids_dev, int64_t tokens, int32_t layers, int32_t k, int32_t experts,
                             uint64_t seed)
{
    gen_ids<<<4096, 256>>>(static_cast<uint8_t *>(ids_dev), tokens * layers, k, experts, seed);
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}

/* Mean seconds of one device-to-device cudaMemcpy of `bytes` (after a warm-up). */
extern "C" double bench_memcpy_s(size_t bytes, int reps)
{
    void *a = nullptr, *b = nullptr;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        cudaFree(a);
        (void)cudaGetLastError();
        return -1.0;
    }
    cudaMemset(a, 1, bytes);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    for (int i = 0; i < reps; i++) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return ms * 1e-3 / reps;
}

/* Forward time of one SwiGLU expert on n tokens: gate and up [n, d] x [d, f], down
 * [n, f] x [f, d], bf16 in and out, fp32 accumulation. Returns 0, or -1 (why says). */
extern "C" int bench_gemm_s(int32_t d, int32_t f, const int32_t *ns, int32_t count, int reps, double *seconds,
                            char *why, size_t why_len)
{
#ifndef RP_HAVE_CUBLAS
    (void)d, (void)f, (void)ns, (void)count, (void)reps, (void)seconds;
    if (why && why_len) snprintf(why, why_len, "built without cuBLAS");
    return -1;
#else
    int32_t nmax = 1;
    for (int32_t i = 0; i < count; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    __nv_bfloat16 *x = nullptr, *w = nullptr, *y = nullptr;
    cublasHandle_t h = nullptr;
    int rc = -1;
    cudaError_t e;
    const size_t xs = (size_t)nmax * (d > f ? d : f), ws = (size_t)d * f;
    if ((e = cudaMalloc(&x, xs * 2)) != cudaSuccess || (e = cudaMalloc(&w, ws * 2 * 3)) != cudaSuccess ||
        (e = cudaMalloc(&y, xs * 2)) != cudaSuccess) {
        say(why, why_len, "allocating GEMM operands", e);
        goto out;
    }
    fill_bf16<<<1024, 256>>>(x, (int64_t)xs, 1);
    fill_bf16<<<1024, 256>>>(w, (int64_t)ws * 3, 2);
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        if (why && why_len) snprintf(why, why_len, "cublasCreate failed");
        goto out;
    }
    for (int32_t i = 0; i < count; i++) {
        const int n = ns[i];
        const float one = 1.f, zero = 0.f;
        auto expert = [&]() {
            /* column-major: out^T [f, n] = W^T [f, d] . X^T [d, n] */
            cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, f, n, d, &one, w, CUDA_R_16BF, f, x, CUDA_R_16BF, d, &zero, y,
                         CUDA_R_16BF, f, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, f, n, d, &one, w + ws, CUDA_R_16BF, f, x, CUDA_R_16BF, d, &zero,
                         y, CUDA_R_16BF, f, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, n, f, &one, w + 2 * ws, CUDA_R_16BF, d, y, CUDA_R_16BF, f,
                         &zero, x, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        expert(); /* warm-up: picks the algorithm */
        cudaDeviceSynchronize();
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0);
        for (int r = 0; r < reps; r++) expert();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, e0, e1);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        seconds[i] = ms * 1e-3 / reps;
    }
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
        say(why, why_len, "running GEMMs", e);
        goto out;
    }
    rc = 0;
out:
    if (h) cublasDestroy(h);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    (void)cudaGetLastError();
    return rc;
#endif
}

/* Forward time of causal attention over one sequence of each length (all heads,
 * head_dim d_h, bf16), as blocks of queries: scores of a block against the keys up to
 * its end (cuBLAS, fp32), a causal softmax (bf16 probabilities), then P V (cuBLAS). The
 * work is the causal half plus the diagonal blocks, as a fused kernel's would be, but
 * the scores go through memory: a fused FlashAttention kernel is faster, so this is a
 * lower bound of the efficiency. Returns 0, or -1 (why says). */
extern "C" int bench_attention_s(int32_t heads, int32_t dh, const int32_t *lens, int32_t count, int reps,
                                 double *seconds, char *why, size_t why_len)
{
#ifndef RP_HAVE_CUBLAS
    (void)heads, (void)dh, (void)lens, (void)count, (void)reps, (void)seconds;
    if (why && why_len) snprintf(why, why_len, "built without cuBLAS");
    return -1;
#else
    int32_t lmax = 1;
    for (int32_t i = 0; i < count; i++) lmax = lens[i] > lmax ? lens[i] : lmax;
    const int32_t B = 1024;
    __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *p = nullptr;
    float *s = nullptr;
    cublasHandle_t h = nullptr;
    int rc = -1;
    cudaError_t e;
    const size_t qkv = (size_t)heads * lmax * dh, sc = (size_t)heads * B * lmax;
    if ((e = cudaMalloc(&q, qkv * 2)) != cudaSuccess || (e = cudaMalloc(&k, qkv * 2)) != cudaSuccess ||
        (e = cudaMalloc(&v, qkv * 2)) != cudaSuccess || (e = cudaMalloc(&o, qkv * 2)) != cudaSuccess ||
        (e = cudaMalloc(&s, sc * 4)) != cudaSuccess || (e = cudaMalloc(&p, sc * 2)) != cudaSuccess) {
        say(why, why_len, "allocating attention operands", e);
        goto out;
    }
    fill_bf16<<<1024, 256>>>(q, (int64_t)qkv, 3);
    fill_bf16<<<1024, 256>>>(k, (int64_t)qkv, 4);
    fill_bf16<<<1024, 256>>>(v, (int64_t)qkv, 5);
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        if (why && why_len) snprintf(why, why_len, "cublasCreate failed");
        goto out;
    }
    for (int32_t i = 0; i < count; i++) {
        const int32_t L = lens[i], b = L < B ? L : B;
        const float one = 1.f, zero = 0.f, scale = 1.f / sqrtf((float)dh);
        auto attention = [&]() {
            for (int32_t q0 = 0; q0 < L; q0 += b) {
                const int32_t nq = L - q0 < b ? L - q0 : b, keys = q0 + nq;
                /* S (keys x nq, per head) = K^T[keys x dh] . Q[dh x nq] (column-major per head) */
                cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, keys, nq, dh, &one, k, CUDA_R_16BF, dh,
                                           (long long)L * dh, q + (size_t)q0 * dh, CUDA_R_16BF, dh,
                                           (long long)L * dh, &zero, s, CUDA_R_32F, keys, (long long)keys * nq,
                                           heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                causal_softmax<<<dim3((unsigned)nq, (unsigned)heads), 256>>>(s, p, keys, nq, q0, scale);
                /* O[dh x nq] = V[dh x keys] . P[keys x nq] */
                cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, dh, nq, keys, &one, v, CUDA_R_16BF, dh,
                                           (long long)L * dh, p, CUDA_R_16BF, keys, (long long)keys * nq, &zero,
                                           o + (size_t)q0 * dh, CUDA_R_16BF, dh, (long long)L * dh, heads,
                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            }
        };
        attention();
        cudaDeviceSynchronize();
        const double t0 = now_s();
        for (int r = 0; r < reps; r++) attention();
        if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
            say(why, why_len, "running attention", e);
            goto out;
        }
        seconds[i] = (now_s() - t0) / reps;
    }
    rc = 0;
out:
    if (h) cublasDestroy(h);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(s);
    cudaFree(p);
    (void)cudaGetLastError();
    return rc;
#endif
}
