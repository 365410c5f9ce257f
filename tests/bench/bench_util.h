/* Helpers the benchmarks share: a seeded random source for synthetic batches and clocks. */
#ifndef RP_BENCH_UTIL_H
#define RP_BENCH_UTIL_H

#include <math.h>
#include <stdint.h>
#include <time.h>

/* splitmix64 from one fixed seed, so every run of a benchmark measures the same batch. */
static inline uint64_t next_u64(void)
{
    static uint64_t state = 0x243F6A8885A308D3ULL;
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1): 53 random bits, never 0, so log() stays finite. */
static inline double uniform(void) { return ((double)(next_u64() >> 11) + 0.5) / 9007199254740992.0; }

/* Standard normal (Box-Muller). */
static inline double normal(void) { return sqrt(-2 * log(uniform())) * cos(6.283185307179586 * uniform()); }

/* A log-normal length with the given median, truncated to an integer and clamped to
 * [min, cap]; min 0 lets short draws become empty sequences. */
static inline int32_t lognormal(double median, double sigma, int32_t min, int32_t cap)
{
    double x = median * exp(sigma * normal());
    return x > cap ? cap : x < min ? min : (int32_t)x;
}

/* Wall-clock seconds from an arbitrary start. */
static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU time of this thread: the figure to quote on a shared machine. */
static inline double cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#endif
