/* Routing-statistics throughput at the reference scale (4096 sequences, ~13M tokens, 48
 * layers, top-8, 128 experts, uint8 ids), next to a plain read of the same bytes, in the
 * same run: the scan as rp_stats_compute runs it and the portable scan it had before the
 * uint8 top-8 kernel (stats_portable_scan), and, on one thread in CPU time, the counting
 * alone from cache (the bound of a scan that keeps a counter per id) and a counting
 * without a store per id (bit-sliced, AVX-512: bench_bitplane.h) from cache. */
#include "bench_bitplane.h"
#include "bench_util.h"
#include "routepack/routepack.h"
#include "stats_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

enum { NUM_SEQS = 4096, LAYERS = 48, TOP_K = 8, EXPERTS = 128, GROUP = 8, REPS = 2 };
/* Sequences are processed in chunks of at most this many tokens (x 384 ids = ~480 MB),
 * far larger than any cache, so both measurements read from memory. */
#define CHUNK_TOKENS 1250000

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- plain read: the sum of the same bytes as uint64 words ---------------------- */

typedef struct read_job { const uint64_t *words; size_t n; uint64_t sum; } read_job;

static void *read_words(void *arg)
{
    read_job *j = arg;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    size_t i = 0;
    for (; i + 4 <= j->n; i += 4) a += j->words[i], b += j->words[i + 1], c += j->words[i + 2], d += j->words[i + 3];
    for (; i < j->n; i++) a += j->words[i];
    j->sum = a + b + c + d;
    return NULL;
}

static uint64_t read_sum(const void *bytes, size_t len, int threads)
{
    read_job jobs[64];
    pthread_t tid[64];
    size_t words = len / 8, per = (words + (size_t)threads - 1) / (size_t)threads;
    for (int i = 0; i < threads; i++) {
        size_t lo = per * (size_t)i < words ? per * (size_t)i : words;
        size_t hi = lo + per < words ? lo + per : words;
        jobs[i] = (read_job){(const uint64_t *)bytes + lo, hi - lo, 0};
        if (i > 0) pthread_create(&tid[i], NULL, read_words, &jobs[i]);
    }
    read_words(&jobs[0]);
    uint64_t sum = jobs[0].sum;
    for (int i = 1; i < threads; i++) {
        pthread_join(tid[i], NULL);
        sum += jobs[i].sum;
    }
    return sum;
}

int main(void)
{
    /* The reference batch's shape: groups of 8 responses share a prompt; responses
     * log-normal (median 2000, sigma 1.0, cap 20480). Prompts are short here, as the
     * count that matters is the routed tokens. */
    static int32_t prompt[NUM_SEQS], response[NUM_SEQS];
    int64_t total = 0;
    for (int s = 0; s < NUM_SEQS; s++) {
        prompt[s] = s % GROUP ? prompt[s - 1] : lognormal(150, 0.6, 0, 4096);
        response[s] = lognormal(2000, 1.0, 0, 20480);
        total += prompt[s] + response[s];
    }
    const int64_t rec = (int64_t)LAYERS * TOP_K;

    /* chunks of whole sequences */
    int32_t first[NUM_SEQS + 1], chunks = 0;
    int64_t max_chunk = 0, run = 0;
    first[0] = 0;
    for (int s = 0; s < NUM_SEQS; s++) {
        int64_t len = prompt[s] + response[s];
        if (run > 0 && run + len > CHUNK_TOKENS) {
            first[++chunks] = s;
            run = 0;
        }
        run += len;
        if (run > max_chunk) max_chunk = run;
    }
    first[++chunks] = NUM_SEQS;

    /* ids: filled once, skewed like real routing (a few hot experts per layer) */
    size_t buf_bytes = (size_t)(max_chunk * rec + 64);
    uint8_t *ids = malloc(buf_bytes);
    if (!ids) {
        fprintf(stderr, "bench_stats: cannot allocate %zu bytes\n", buf_bytes);
        return 1;
    }
    uint8_t table[256];
    for (int i = 0; i < 256; i++) { /* Zipf-like: expert e has weight ~ 1/(e+8) */
        double u = (i + 0.5) / 256, norm = log((EXPERTS + 8.0) / 8.0);
        table[i] = (uint8_t)(8.0 * exp(u * norm) - 8.0);
    }
    double t0 = now();
    /* A router's top-8 of one token at one layer are 8 distinct experts: a drawn id already
     * taken moves to the next free one. */
    for (size_t i = 0; i + 8 <= buf_bytes; i += 8) {
        uint64_t r = next_u64(), taken[2] = {0, 0};
        for (int b = 0; b < 8; b++) {
            unsigned id = (table[(r >> (8 * b)) & 255] + 37 * ((i / 8) % LAYERS)) % EXPERTS;
            while (taken[id >> 6] >> (id & 63) & 1) id = (id + 1) % EXPERTS;
            taken[id >> 6] |= 1ULL << (id & 63);
            ids[i + b] = (uint8_t)id;
        }
    }
    double fill_s = now() - t0;

    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int nconf = cpus > 1 ? 2 : 1;
    int thread_counts[2] = {1, (int)(cpus > 64 ? 64 : cpus)};

    printf("bench_stats: reference scale: %d sequences, %.2fM tokens, %d layers, top-%d, %d experts, "
           "uint8 ids = %.2f GB\n", NUM_SEQS, total / 1e6, LAYERS, TOP_K, EXPERTS, total * rec / 1e9);
    printf("  processed in %d chunks of whole sequences (<= %.0f MB of ids each, filled once in %.1f s), "
           "best of %d passes\n\n", chunks, max_chunk * rec / 1e6, fill_s, REPS);
    printf("  %-8s %10s %16s %16s %11s %11s\n", "threads", "read GB/s", "portable GB/s", "stats GB/s",
           "stats/read", "vs portable");

    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    uint64_t sink = 0;
    size_t hist_bytes = 0;
    for (int c = 0; c < nconf; c++) {
        int threads = thread_counts[c];
        double best_read = 1e30, best_stats = 1e30, best_portable = 1e30;
        for (int rep = 0; rep < REPS; rep++) {
            double t_read = 0, t_stats = 0, t_portable = 0;
            size_t bytes = 0;
            for (int ch = 0; ch < chunks; ch++) {
                int32_t n = first[ch + 1] - first[ch];
                rp_batch *batch;
                rp_error err;
                if (rp_batch_new(ctx, n, prompt + first[ch], response + first[ch], NULL, &batch, &err)) {
                    fprintf(stderr, "bench_stats: %s\n", err.text);
                    return 1;
                }
                size_t len = (size_t)(rp_batch_num_tokens(batch) * rec);
                rp_routing r;
                rp_routing_packed(&r, RP_ID_U8, LAYERS, TOP_K, ids);
                double a = now();
                sink += read_sum(ids, len, threads);
                double b = now();
                rp_stats *st;
                if (rp_stats_compute(ctx, batch, &r, EXPERTS, threads, &st, &err) != RP_OK) {
                    fprintf(stderr, "bench_stats: %s\n", err.text);
                    return 1;
                }
                double e = now();
                rp_stats *before;
                stats_portable_scan = true;
                rp_status ps = rp_stats_compute(ctx, batch, &r, EXPERTS, threads, &before, &err);
                stats_portable_scan = false;
                double f = now();
                if (ps != RP_OK || !stats_same(st, before)) {
                    fprintf(stderr, "bench_stats: the portable scan disagrees: %s\n", ps ? err.text : "other counts");
                    return 1;
                }
                rp_stats_free(before);
                t_read += b - a;
                t_stats += e - b;
                t_portable += f - e;
                bytes += rp_stats_bytes(st);
                rp_stats_free(st);
                rp_batch_free(batch);
            }
            if (t_read < best_read) best_read = t_read;
            if (t_stats < best_stats) best_stats = t_stats;
            if (t_portable < best_portable) best_portable = t_portable;
            hist_bytes = bytes;
        }
        double gb = (double)total * rec / 1e9;
        printf("  %-8d %10.2f %16.2f %16.2f %10.0f%% %10.2fx\n", threads, gb / best_read, gb / best_portable,
               gb / best_stats, 100.0 * best_read / best_stats, best_portable / best_stats);
    }

    /* One thread in CPU time (the figures above are wall time, which other work on the
     * machine inflates), next to the counting alone: the increments of the scan, one load
     * and one store per id (as rp_stats_compute's inner loop does them), over a block of
     * ids that stays in cache, so no memory traffic. That is the most any scan with a
     * counter per id reaches on this core, and so a bound on stats/read. */
    {
        double best_read = 1e30, best_stats = 1e30, best_count = 1e30, best_portable = 1e30;
        int32_t n = first[1] - first[0];
        rp_batch *batch;
        rp_error err;
        if (rp_batch_new(ctx, n, prompt, response, NULL, &batch, &err)) return 1;
        size_t len = (size_t)(rp_batch_num_tokens(batch) * rec);
        rp_routing r;
        rp_routing_packed(&r, RP_ID_U8, LAYERS, TOP_K, ids);
        enum { BLOCK = 96 * 1024 }; /* a whole number of tokens' records (384 ids) */
        const size_t block = BLOCK / rec * rec;
        uint32_t *counts = calloc((size_t)LAYERS * EXPERTS, sizeof *counts);
        double best_bitplane = 0;
#if BITPLANE_AVAILABLE
        /* bit-sliced counting over the same block, checked against a plain count first */
        int bitplane_ok = bitplane_supported();
        if (bitplane_ok) {
            const size_t groups = (LAYERS + 7) / 8;
            uint64_t *cnt = aligned_alloc(64, groups * 256 * 8 * sizeof(uint64_t));
            __m512i *planes = aligned_alloc(64, groups * BITPLANE_SUPER * 8 * sizeof(__m512i));
            uint32_t *want = calloc((size_t)LAYERS * EXPERTS, sizeof *want);
            uint32_t *got = calloc((size_t)LAYERS * EXPERTS, sizeof *got);
            bitplane_init();
            for (size_t i = 0; i < block; i++) want[(i / TOP_K % LAYERS) * EXPERTS + ids[i]]++;
            bitplane_count(ids, (int64_t)(block / rec), LAYERS, EXPERTS, got, cnt, planes);
            if (memcmp(want, got, (size_t)LAYERS * EXPERTS * sizeof *want) != 0) {
                fprintf(stderr, "bench_stats: the bit-sliced count disagrees with a plain count\n");
                return 1;
            }
            best_bitplane = 1e30;
            for (int rep = 0; rep < REPS; rep++) {
                double a = cpu_now();
                for (size_t done = 0; done < len; done += block)
                    bitplane_count(ids, (int64_t)(block / rec), LAYERS, EXPERTS, got, cnt, planes);
                double b = cpu_now();
                if (b - a < best_bitplane) best_bitplane = b - a;
            }
            for (size_t i = 0; i < (size_t)LAYERS * EXPERTS; i++) sink += got[i];
            free(cnt), free(planes), free(want), free(got);
        }
#endif
        for (int rep = 0; rep < REPS; rep++) {
            double a = cpu_now();
            sink += read_sum(ids, len, 1);
            double b = cpu_now();
            rp_stats *st;
            if (rp_stats_compute(ctx, batch, &r, EXPERTS, 1, &st, &err) != RP_OK) return 1;
            double c = cpu_now(), t_stats = c - b;
            rp_stats_free(st);
            stats_portable_scan = true;
            double pa = cpu_now();
            if (rp_stats_compute(ctx, batch, &r, EXPERTS, 1, &st, &err) != RP_OK) return 1;
            double pb = cpu_now();
            stats_portable_scan = false;
            rp_stats_free(st);
            if (pb - pa < best_portable) best_portable = pb - pa;
            c = cpu_now();
            for (size_t done = 0; done < len; done += block) {
                const uint8_t *p = ids;
                for (size_t t = 0; t < block; t += (size_t)rec) {
                    uint32_t *row = counts;
                    for (int l = 0; l < LAYERS; l++, p += TOP_K, row += EXPERTS) {
                        uint64_t w;
                        memcpy(&w, p, 8);
                        row[w & 0xFF]++; row[(w >> 8) & 0xFF]++; row[(w >> 16) & 0xFF]++; row[(w >> 24) & 0xFF]++;
                        row[(w >> 32) & 0xFF]++; row[(w >> 40) & 0xFF]++; row[(w >> 48) & 0xFF]++; row[w >> 56]++;
                    }
                }
            }
            double d = cpu_now();
            if (b - a < best_read) best_read = b - a;
            if (t_stats < best_stats) best_stats = t_stats;
            if (d - c < best_count) best_count = d - c;
        }
        for (size_t i = 0; i < (size_t)LAYERS * EXPERTS; i++) sink += counts[i];
        free(counts);
        rp_batch_free(batch);
        double gb = (double)len / 1e9;
        printf("\n  one thread, CPU time, first chunk (%.2f GB): read %.2f GB/s, stats %.2f GB/s (%.0f%% of the read),\n"
               "  portable scan %.2f GB/s (%.0f%%);\n"
               "  counting alone from cache (one load and one store per id, no memory traffic): %.2f GB/s,\n"
               "  %.0f%% of the read: the bound on stats/read for a scan that keeps a counter per id\n",
               gb, gb / best_read, gb / best_stats, 100.0 * best_read / best_stats, gb / best_portable,
               100.0 * best_read / best_portable, gb / best_count, 100.0 * best_read / best_count);
        if (best_bitplane > 0)
            printf("  counting without a store per id (bit-sliced, AVX-512, bench_bitplane.h) from cache: %.2f GB/s,\n"
                   "  %.0f%% of the read\n", gb / best_bitplane, 100.0 * best_read / best_bitplane);
        else
            printf("  (bit-sliced counting not measured: it needs x86-64 AVX-512 VBMI, VPOPCNTDQ and GFNI)\n");
    }

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("\n  compact per-sequence histograms for the whole batch: %.1f MB (sum over the chunks;\n"
           "    dense uint32 would be %.1f MB; with distinct top-k ids no count passes 65535 at\n"
           "    this length cap, so real routing takes at most %.1f MB)\n",
           hist_bytes / 1e6, (double)NUM_SEQS * LAYERS * EXPERTS * 4 / 1e6,
           (double)NUM_SEQS * LAYERS * EXPERTS * 2 / 1e6);
    printf("  peak RSS: %.0f MB (ids buffer %.0f MB)\n", ru.ru_maxrss / 1024.0, buf_bytes / 1e6);
    printf("  (checksum %llu)\n", (unsigned long long)(sink & 0xFFFF));
    rp_context_free(ctx);
    free(ids);
    return 0;
}
