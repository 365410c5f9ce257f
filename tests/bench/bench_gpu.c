/* GPU kernel benchmark: each kernel's bandwidth next to a device-to-device cudaMemcpy
 * moving the same bytes in the same run, one full statistics pass at the reference
 * scale, and cost-model calibration printed as config entries. Without a GPU it prints
 * "no GPU" and exits 0. Run by scripts/device-check.sh. */
#include "routepack/routepack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef RP_HAVE_CUDA
#include <cuda_runtime_api.h>

/* tests/bench/bench_gpu_kernels.cu */
int bench_gen_ids(void *ids_dev, int64_t tokens, int32_t layers, int32_t k, int32_t experts, uint64_t seed);
double bench_memcpy_s(size_t bytes, int reps);
int bench_gemm_s(int32_t d, int32_t f, const int32_t *ns, int32_t count, int reps, double *seconds, char *why,
                 size_t why_len);
int bench_attention_s(int32_t heads, int32_t dh, const int32_t *lens, int32_t count, int reps, double *seconds,
                      char *why, size_t why_len);

/* The reference scale: a Qwen3-30B-A3B-like MoE (d 2048, expert f 768, 48 MoE layers,
 * 128 experts, top-8, 32 heads of 128) and an RL step of 4096 sequences, ~13M tokens. */
enum { SEQS = 4096, LAYERS = 48, TOPK = 8, EXPERTS = 128, D = 2048, F = 768, HEADS = 32, HEAD_DIM = 128 };
#define PEAK_FLOPS 989e12 /* the config's default dense BF16 peak (H200 SXM) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One row of the bandwidth table. `traffic` is the least memory traffic the kernel
 * needs (bytes read + written); the baseline copies traffic / 2 bytes, which reads and
 * writes the same amount. */
static void row(const char *name, double traffic, double seconds, int reps_copy)
{
    double copy_s = bench_memcpy_s((size_t)(traffic / 2), reps_copy);
    double gbs = traffic / seconds / 1e9, copy_gbs = copy_s > 0 ? traffic / copy_s / 1e9 : 0;
    printf("  %-34s %9.1f MB %9.3f ms %8.0f GB/s   memcpy %8.0f GB/s   %5.0f%%\n", name, traffic / 1e6,
           seconds * 1e3, gbs, copy_gbs, copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0);
}

static int fail(const char *what, const rp_error *err)
{
    printf("bench_gpu: %s: %s\n", what, err ? err->text : "");
    return 1;
}

#define CUDA_OK(call) ((call) == cudaSuccess)

/* The reference batch: lengths 256..6399 (mean ~3300), ids generated on the device. */
static int stats_and_remap(rp_context *ctx)
{
    rp_error err;
    int32_t *lens = malloc(sizeof *lens * SEQS), *zero = calloc(SEQS, sizeof *zero);
    uint64_t x = 88172645463325252ULL;
    for (int i = 0; i < SEQS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        lens[i] = 256 + (int32_t)(x % 6144);
    }
    rp_batch *batch = NULL;
    if (rp_batch_new(ctx, SEQS, lens, zero, NULL, &batch, &err) != RP_OK) return fail("batch", &err);
    free(lens), free(zero);
    const int64_t tokens = rp_batch_num_tokens(batch), ids_n = tokens * LAYERS * TOPK;
    void *ids = NULL, *cu = NULL;
    if (!CUDA_OK(cudaMalloc(&ids, (size_t)ids_n)) || !CUDA_OK(cudaMalloc(&cu, sizeof(int64_t) * (SEQS + 1)))) {
        printf("bench_gpu: cannot allocate %.1f GB of routing ids\n", ids_n / 1e9);
        return 1;
    }
    cudaMemcpy(cu, rp_batch_cu_seqlens(batch), sizeof(int64_t) * (SEQS + 1), cudaMemcpyHostToDevice);
    if (bench_gen_ids(ids, tokens, LAYERS, TOPK, EXPERTS, 7) != 0) return fail("generating ids", NULL);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, LAYERS, TOPK, ids);

    /* statistics: the full pass and per-microbatch loads */
    uint32_t *hist = malloc(sizeof *hist * (size_t)SEQS * LAYERS * EXPERTS);
    int64_t *load = malloc(sizeof *load * LAYERS * EXPERTS * 8);
    int32_t *map = malloc(sizeof *map * SEQS);
    for (int s = 0; s < SEQS; s++) map[s] = s % 8;
    void *map_dev = NULL;
    cudaMalloc(&map_dev, sizeof *map * SEQS);
    cudaMemcpy(map_dev, map, sizeof *map * SEQS, cudaMemcpyHostToDevice);
    if (rp_gpu_routing_histograms(&r, cu, SEQS, EXPERTS, hist, load, &err) != RP_OK) return fail("histograms", &err);
    const int reps = 3;
    double t0 = now_s();
    for (int i = 0; i < reps; i++) rp_gpu_routing_histograms(&r, cu, SEQS, EXPERTS, hist, load, &err);
    const double hist_s = (now_s() - t0) / reps;
    rp_gpu_microbatch_loads(&r, cu, SEQS, EXPERTS, map_dev, 8, load, &err);
    t0 = now_s();
    for (int i = 0; i < reps; i++) rp_gpu_microbatch_loads(&r, cu, SEQS, EXPERTS, map_dev, 8, load, &err);
    const double loads_s = (now_s() - t0) / reps;
    printf("\nstatistics pass at the reference scale: %d sequences, %.2fM tokens, %d layers, top-%d, %d experts, "
           "uint8 ids generated on the device (%.2f GB)\n",
           SEQS, tokens / 1e6, LAYERS, TOPK, EXPERTS, ids_n / 1e9);
    printf("  rp_gpu_routing_histograms: %.2f ms per pass (with the %.0f MB of per-sequence histograms copied to the "
           "host)\n",
           hist_s * 1e3, (double)SEQS * LAYERS * EXPERTS * 4 / 1e6);
    printf("  rp_gpu_microbatch_loads (8 rows): %.2f ms\n", loads_s * 1e3);
    printf("\n  %-34s %12s %12s %13s %20s %7s\n", "kernel (least traffic)", "traffic", "time", "bandwidth",
           "copy, same bytes", "ratio");
    row("routing histograms (API call)", (double)ids_n, hist_s, 3);
    row("microbatch loads (API call)", (double)ids_n, loads_s, 3);

    /* remap: 8 GPUs, one EP group, 17 slots each (128 experts + 8 spare replicas of hot
     * experts), 4 microbatches */
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, \"ep_size\": 8, \"slots_per_gpu\": 17},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": %d, \"hidden_size\": %d,"
             " \"expert_ffn_size\": %d, \"num_heads\": %d, \"num_kv_heads\": 4, \"head_dim\": %d},"
             " \"limits\": {\"max_tokens_per_microbatch\": 100000000}}",
             LAYERS, EXPERTS, TOPK, D, F, HEADS, HEAD_DIM);
    rp_config *cfg = NULL;
    rp_plan *plan = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "<bench>", &cfg, &err) != RP_OK) return fail("config", &err);
    if (rp_plan_new(ctx, cfg, 4, &plan, &err) != RP_OK) return fail("plan", &err);
    int32_t *rank = malloc(sizeof *rank * SEQS), *mb = malloc(sizeof *mb * SEQS);
    for (int s = 0; s < SEQS; s++) rank[s] = s % 8, mb[s] = (s / 8) % 4;
    rp_plan_set_packing(plan, SEQS, rank, mb, &err);
    for (int l = 0; l < LAYERS; l++)
        for (int j = 0; j < 8; j++) {
            int32_t ex[17];
            for (int i = 0; i < 16; i++) ex[i] = j * 16 + i;
            ex[16] = j == 0 ? 16 : j; /* hot experts 1..7 get a second replica */
            rp_plan_set_gpu_experts(plan, l, j, ex, 17, &err);
        }
    int32_t *phys = NULL;
    if (!CUDA_OK(cudaMalloc((void **)&phys, sizeof(int32_t) * (size_t)ids_n))) {
        printf("bench_gpu: cannot allocate %.1f GB for remapped ids; remap skipped\n", ids_n * 4 / 1e9);
    } else {
        const int32_t P = rp_remap_num_physical(plan, 0);
        int64_t *slots = malloc(sizeof *slots * (size_t)LAYERS * P);
        int64_t mb_tokens = 0;
        const int64_t *cuh = rp_batch_cu_seqlens(batch);
        for (int s = 0; s < SEQS; s++)
            if (mb[s] == 0) mb_tokens += cuh[s + 1] - cuh[s];
        for (int rule = 0; rule < 2; rule++) {
            if (rp_gpu_remap(plan, cfg, 0, batch, &r, (rp_split_rule)rule, phys, slots, &err) != RP_OK)
                return fail("remap", &err);
            t0 = now_s();
            for (int i = 0; i < reps; i++) rp_gpu_remap(plan, cfg, 0, batch, &r, (rp_split_rule)rule, phys, slots, &err);
            const double remap_s = (now_s() - t0) / reps;
            char name[64];
            snprintf(name, sizeof name, "remap, 1 of 4 microbatches (%s)", rule ? "locality" : "even");
            row(name, (double)mb_tokens * LAYERS * TOPK * 5, remap_s, 3);
        }
        free(slots);
        cudaFree(phys);
    }
    free(rank), free(mb), free(map), free(hist), free(load);
    cudaFree(map_dev);
    cudaFree(ids);
    cudaFree(cu);
    rp_plan_free(plan);
    rp_config_free(cfg);
    rp_batch_free(batch);
    return 0;
}

/* Migration buffers: 16 experts of the reference model, each bf16 weights plus fp32
 * moments and master weights (4 parts, 66 MB). */
static int migration(rp_context *ctx)
{
    enum { N = 16, PARTS = 4 };
    const size_t w = (size_t)3 * D * F * 2, s = (size_t)3 * D * F * 4;
    const size_t sizes[PARTS] = {w, s, s, s};
    void *ptr[N * PARTS];
    size_t bytes[N * PARTS];
    int32_t begin[N + 1];
    size_t total = 0;
    for (int e = 0; e < N; e++) {
        begin[e] = e * PARTS;
        for (int p = 0; p < PARTS; p++) {
            if (!CUDA_OK(cudaMalloc(&ptr[e * PARTS + p], sizes[p]))) {
                printf("bench_gpu: cannot allocate expert buffers\n");
                return 1;
            }
            cudaMemset(ptr[e * PARTS + p], e + p, sizes[p]);
            bytes[e * PARTS + p] = sizes[p];
            total += sizes[p];
        }
    }
    begin[N] = N * PARTS;
    void *buf = NULL;
    if (!CUDA_OK(cudaMalloc(&buf, total))) {
        printf("bench_gpu: cannot allocate the migration buffer\n");
        return 1;
    }
    rp_error err;
    uint64_t sums[N];
    const int reps = 5;
    if (rp_gpu_gather(ctx, (const void *const *)ptr, bytes, begin, N, buf, total, NULL, &err) != RP_OK)
        return fail("gather", &err);
    cudaDeviceSynchronize();
    double t0 = now_s();
    for (int i = 0; i < reps; i++) rp_gpu_gather(ctx, (const void *const *)ptr, bytes, begin, N, buf, total, NULL, &err);
    cudaDeviceSynchronize();
    const double gather_s = (now_s() - t0) / reps;
    t0 = now_s();
    for (int i = 0; i < reps; i++) rp_gpu_scatter(ctx, buf, total, ptr, bytes, begin, N, NULL, &err);
    cudaDeviceSynchronize();
    const double scatter_s = (now_s() - t0) / reps;
    if (rp_gpu_checksum(ctx, (const void *const *)ptr, bytes, begin, N, sums, NULL, &err) != RP_OK)
        return fail("checksum", &err);
    t0 = now_s();
    for (int i = 0; i < reps; i++) rp_gpu_checksum(ctx, (const void *const *)ptr, bytes, begin, N, sums, NULL, &err);
    const double sum_s = (now_s() - t0) / reps;
    char name[64];
    snprintf(name, sizeof name, "gather (%d experts x %d parts)", N, PARTS);
    row(name, 2.0 * total, gather_s, 5);
    row("scatter", 2.0 * total, scatter_s, 5);
    row("checksum (two-level XXH64)", (double)total, sum_s, 5);
    for (int i = 0; i < N * PARTS; i++) cudaFree(ptr[i]);
    cudaFree(buf);
    return 0;
}

static void calibration(void)
{
    char why[256] = "";
    static const int32_t ns[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
    enum { NN = sizeof ns / sizeof ns[0] };
    double t[NN];
    printf("\ncost-model calibration (peak %.0f TFLOP/s, the config's default):\n", PEAK_FLOPS / 1e12);
    if (bench_gemm_s(D, F, ns, NN, 20, t, why, sizeof why) == 0) {
        printf("  one expert forward (3 cuBLAS bf16 GEMMs, d %d, f %d):\n", D, F);
        for (int i = 0; i < NN; i++)
            printf("    n %6d: %8.1f us  %6.1f TFLOP/s\n", ns[i], t[i] * 1e6, 6.0 * ns[i] * D * F / t[i] / 1e12);
        printf("  \"gemm_efficiency\": [");
        for (int i = 0; i < NN; i++)
            printf("%s[%d, %.4g]", i ? ", " : "", ns[i], 6.0 * ns[i] * D * F / t[i] / PEAK_FLOPS);
        printf("],\n");
    } else {
        printf("  gemm_efficiency: not measured (%s)\n", why);
    }
    static const int32_t lens[] = {512, 1024, 2048, 4096, 8192, 16384};
    enum { NL = sizeof lens / sizeof lens[0] };
    double ta[NL];
    if (bench_attention_s(HEADS, HEAD_DIM, lens, NL, 3, ta, why, sizeof why) == 0) {
        printf("  causal attention forward, %d heads of %d (blocked: cuBLAS scores, softmax kernel, cuBLAS P.V;\n"
               "  unfused, so a lower bound of what FlashAttention reaches):\n",
               HEADS, HEAD_DIM);
        double eff_sum = 0, w_sum = 0;
        for (int i = 0; i < NL; i++) {
            const double flops = 2.0 * lens[i] * (double)lens[i] * HEADS * HEAD_DIM;
            printf("    L %6d: %9.3f ms  efficiency %.3f\n", lens[i], ta[i] * 1e3, flops / ta[i] / PEAK_FLOPS);
            eff_sum += flops / PEAK_FLOPS, w_sum += ta[i];
        }
        /* printed as a figure, never as a config entry: an unfused kernel's efficiency
         * is not the trainer's (calibration.json holds fused kernels' figures) */
        printf("  unfused attention efficiency %.3f (time-weighted over the lengths above; a lower bound,\n"
               "  not a value for hardware.attention_efficiency: see docs/calibration.md)\n", eff_sum / w_sum);
    } else {
        printf("  attention_efficiency: not measured (%s)\n", why);
    }
}

int main(void)
{
    if (rp_gpu_count() == 0) {
        printf("bench_gpu: no GPU (%s)\n", rp_gpu_built() ? "no CUDA device is visible" : "built without CUDA");
        return 0;
    }
    struct cudaDeviceProp prop;
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&prop, dev);
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    printf("bench_gpu: %s, %d SMs, %.1f GiB, CUDA runtime %d.%d, driver %d.%d\n", prop.name, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1 << 30), rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
    printf("  device-to-device cudaMemcpy, 1 GiB: %.0f GB/s (bytes read + written)\n",
           2.0 * (1 << 30) / bench_memcpy_s((size_t)1 << 30, 10) / 1e9);
    rp_context *ctx = NULL;
    rp_context_new(NULL, NULL, &ctx);
    int rc = stats_and_remap(ctx);
    if (rc == 0) rc = migration(ctx);
    calibration();
    rp_context_free(ctx);
    return rc;
}

#else

int main(void)
{
    printf("bench_gpu: no GPU (built without CUDA)\n");
    return 0;
}

#endif
