/* Soak: many steps of one scheduler on the small config (examples/config-small.json,
 * the four steps of examples/small.rpt in turn) with a hot swap every 100 steps, a
 * policy that errors every 37 steps (fallback), and every 100 steps (at 50) a staged
 * policy that fails its dry run (refused). Prints the process RSS and the library's live
 * heap (blocks and bytes held through the context's allocator) at intervals, and their
 * slopes over the second half: a leak or a cache that grows shows as a slope. Build it
 * with -DRP_SANITIZE=address so LeakSanitizer checks the exit too (docs/fuzzing.md,
 * "Soak"). Figures only, except that the step counts (fallbacks, swaps, refusals) must
 * be the ones asked for, else the run says so and exits 1.
 * Usage: bench_soak [STEPS] [INTERVAL]   (default 10000 steps, a line every 500) */
#include "routepack/routepack.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SWAP_EVERY 100
#define FAIL_EVERY 37
#define REFUSED_AT 50 /* step % SWAP_EVERY at which a broken policy is staged */

typedef struct heap {
    long long live_bytes, live_blocks;
} heap;

/* The context's allocator: malloc, counting what is held (the sandbox's Lua states and
 * every library object go through it). */
static void *counting_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    heap *h = ud;
    if (new_size == 0) {
        if (ptr) {
            __atomic_sub_fetch(&h->live_bytes, (long long)old_size, __ATOMIC_RELAXED);
            __atomic_sub_fetch(&h->live_blocks, 1, __ATOMIC_RELAXED);
        }
        free(ptr);
        return NULL;
    }
    void *p = realloc(ptr, new_size);
    if (p) {
        __atomic_add_fetch(&h->live_bytes, (long long)new_size - (ptr ? (long long)old_size : 0),
                           __ATOMIC_RELAXED);
        if (!ptr) __atomic_add_fetch(&h->live_blocks, 1, __ATOMIC_RELAXED);
    }
    return p;
}

static void die(const char *what, const rp_error *err)
{
    fprintf(stderr, "bench_soak: %s: %s\n", what, err ? err->text : "");
    exit(1);
}

/* Resident set size in MiB (/proc/self/statm). */
static double rss_mib(void)
{
    long pages_total = 0, pages_resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f || fscanf(f, "%ld %ld", &pages_total, &pages_resident) != 2) die("/proc/self/statm", NULL);
    fclose(f);
    return (double)pages_resident * (double)sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0);
}

/* The running policy, in two versions that a swap alternates: each plans with a
 * baseline and keeps a counter in ctx.state, and errors at every FAIL_EVERY-th step. */
static char *soak_policy(char version)
{
    static char text[2][1024];
    char *s = text[version == 'a' ? 0 : 1];
    snprintf(s, sizeof text[0],
             "return {name = 'soak', version = '1.0.%d', api = 1,\n"
             "  description = 'soak benchmark: a baseline plan, an error every %d steps',\n"
             "  init = function(ctx) ctx.state.planned = 0 end,\n"
             "  plan = function(ctx)\n"
             "    if ctx.step %% %d == 0 then error('soak: failing on purpose at step ' .. ctx.step) end\n"
             "    ctx.state.planned = ctx.state.planned + 1\n"
             "    return rp.baseline('%s')\n"
             "  end}\n",
             version == 'a' ? 0 : 1, FAIL_EVERY, FAIL_EVERY, version == 'a' ? "token_kk+eplb" : "attn_kk+eplb");
    return s;
}

/* Loads and inits, then errors in every plan: its dry run fails and it is dropped. */
static const char *BROKEN =
    "return {name = 'broken', version = '1.0.0', api = 1,\n"
    "  description = 'soak benchmark: fails its dry run',\n"
    "  plan = function(ctx) local t = {} for i = 1, 1000 do t[i] = i end error('broken: refuses to plan') end}\n";

/* Smallest and largest of y[0..n). */
static void range(const double *y, int n, double *lo, double *hi)
{
    *lo = *hi = y[0];
    for (int i = 1; i < n; i++) {
        if (y[i] < *lo) *lo = y[i];
        if (y[i] > *hi) *hi = y[i];
    }
}

/* Least-squares slope of y over x. */
static double slope(const double *x, const double *y, int n)
{
    double mx = 0, my = 0, sxy = 0, sxx = 0;
    for (int i = 0; i < n; i++) mx += x[i], my += y[i];
    mx /= n, my /= n;
    for (int i = 0; i < n; i++) sxy += (x[i] - mx) * (y[i] - my), sxx += (x[i] - mx) * (x[i] - mx);
    return sxx > 0 ? sxy / sxx : 0;
}

int main(int argc, char **argv)
{
    int64_t steps = argc > 1 ? atoll(argv[1]) : 10000;
    int64_t interval = argc > 2 ? atoll(argv[2]) : 500;
    if (steps < 2 * SWAP_EVERY || interval < 1) {
        fprintf(stderr, "usage: bench_soak [STEPS >= %d] [INTERVAL >= 1]\n", 2 * SWAP_EVERY);
        return 2;
    }
    heap h = {0, 0};
    rp_context *ctx;
    rp_config *cfg;
    rp_trace *trace;
    rp_error err;
    if (rp_context_new(counting_alloc, &h, &ctx) != RP_OK) die("context", NULL);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK) die("config", &err);
    if (rp_trace_open(ctx, RP_SOURCE_DIR "/examples/small.rpt", 0, &trace, &err) != RP_OK) die("trace", &err);
    int32_t num_batches = rp_trace_num_steps(trace);
    rp_batch **batches = calloc((size_t)num_batches, sizeof *batches);
    rp_routing *routings = calloc((size_t)num_batches, sizeof *routings);
    if (!batches || !routings) die("out of memory", NULL);
    for (int32_t i = 0; i < num_batches; i++)
        if (rp_trace_read_step(trace, i, &batches[i], &routings[i], &err) != RP_OK) die("trace step", &err);

    char policy_path[] = "/tmp/rp-soak-XXXXXX.lua";
    int fd = mkstemps(policy_path, 4);
    if (fd < 0) die("temporary policy file", NULL);
    const char *first = soak_policy('a');
    if (write(fd, first, strlen(first)) != (ssize_t)strlen(first)) die("write policy", NULL);
    close(fd);
    rp_sched_options opts;
    rp_sched_options_default(&opts);
    opts.policy = policy_path;
    opts.num_threads = 1;
    rp_sched *sched;
    rp_status st = rp_sched_new(ctx, cfg, &opts, &sched, &err);
    unlink(policy_path);
    if (st != RP_OK) die("rp_sched_new", &err);

    int points = (int)(steps / interval) + 1;
    double *xs = calloc((size_t)points, sizeof *xs), *rss = calloc((size_t)points, sizeof *rss);
    double *bytes = calloc((size_t)points, sizeof *bytes), *blocks = calloc((size_t)points, sizeof *blocks);
    if (!xs || !rss || !bytes || !blocks) die("out of memory", NULL);
    int n = 0;
    int64_t fallbacks = 0, swaps = 0, refused = 0, want_fallbacks = 0, want_swaps = 0, want_refused = 0;
    char next = 'b';
    double t0 = now(), c0 = cpu();
    printf("bench_soak: %lld steps on config-small (%d batches of small.rpt in turn): swap every %d, "
           "error every %d, refused swap every %d (at %d)\n",
           (long long)steps, num_batches, SWAP_EVERY, FAIL_EVERY, SWAP_EVERY, REFUSED_AT);
    printf("%8s %10s %14s %12s %9s\n", "step", "rss_MiB", "heap_bytes", "heap_blocks", "wall_s");
    for (int64_t t = 0; t < steps; t++) {
        if (t > 0 && t % SWAP_EVERY == 0) {
            if (rp_sched_stage_policy(sched, "soak.lua", soak_policy(next), -1, &err) != RP_OK)
                die("stage soak policy", &err);
            next = next == 'a' ? 'b' : 'a';
            /* The dry run replays step t - 1, where the new policy errors too. */
            if ((t - 1) % FAIL_EVERY == 0) want_refused++;
            else want_swaps++;
        } else if (t % SWAP_EVERY == REFUSED_AT) {
            if (rp_sched_stage_policy(sched, "broken.lua", BROKEN, -1, &err) != RP_OK) die("stage broken", &err);
            want_refused++;
        }
        if (t % FAIL_EVERY == 0) want_fallbacks++;
        const rp_plan *plan;
        const rp_step_report *report;
        int32_t b = (int32_t)(t % num_batches);
        if (rp_sched_step(sched, t, batches[b], &routings[b], &plan, &report, &err) != RP_OK) die("step", &err);
        fallbacks += report->fallback;
        swaps += report->swapped;
        refused += report->swap_error[0] != '\0';
        /* Sampled at one phase of the swap cycle (use an INTERVAL that is a multiple of
         * SWAP_EVERY), so the figures compare like with like. */
        if (t % interval == 0) {
            xs[n] = (double)t;
            rss[n] = rss_mib();
            bytes[n] = (double)__atomic_load_n(&h.live_bytes, __ATOMIC_RELAXED);
            blocks[n] = (double)__atomic_load_n(&h.live_blocks, __ATOMIC_RELAXED);
            printf("%8lld %10.1f %14.0f %12.0f %9.1f\n", (long long)t, rss[n], bytes[n], blocks[n], now() - t0);
            fflush(stdout);
            n++;
        }
    }
    double wall = now() - t0, cpu_s = cpu() - c0;
    int half = n / 2;
    printf("steps %lld in %.1f s wall, %.1f s CPU (%.2f ms a step)\n", (long long)steps, wall, cpu_s,
           1e3 * cpu_s / (double)steps);
    printf("fallbacks %lld (want %lld), swaps %lld (want %lld), refused swaps %lld (want %lld)\n",
           (long long)fallbacks, (long long)want_fallbacks, (long long)swaps, (long long)want_swaps,
           (long long)refused, (long long)want_refused);
    /* The second half (from the middle sample on): after warm-up, where flat means flat. */
    const struct {
        const char *name, *unit;
        const double *y;
    } series[] = {{"rss", "MiB", rss}, {"heap", "bytes", bytes}, {"heap", "blocks", blocks}};
    for (int i = 0; i < 3; i++) {
        double lo, hi;
        range(series[i].y + half, n - half, &lo, &hi);
        printf("%s %s: first %.1f, at step %.0f %.1f, last %.1f (step %.0f); second half %.1f..%.1f, "
               "slope %.3f %s per 1000 steps\n",
               series[i].name, series[i].unit, series[i].y[0], xs[half], series[i].y[half], series[i].y[n - 1],
               xs[n - 1], lo, hi, 1000 * slope(xs + half, series[i].y + half, n - half), series[i].unit);
    }

    rp_sched_free(sched);
    for (int32_t i = 0; i < num_batches; i++) rp_batch_free(batches[i]);
    rp_trace_close(trace);
    rp_config_free(cfg);
    rp_context_free(ctx);
    printf("after freeing everything: heap %lld bytes in %lld blocks\n", h.live_bytes, h.live_blocks);
    bool ok = fallbacks == want_fallbacks && swaps == want_swaps && refused == want_refused &&
              h.live_blocks == 0;
    free(batches);
    free(routings);
    free(xs);
    free(rss);
    free(bytes);
    free(blocks);
    if (!ok) {
        fprintf(stderr, "bench_soak: the counts above are not the ones asked for, or blocks were left\n");
        return 1;
    }
    return 0;
}
