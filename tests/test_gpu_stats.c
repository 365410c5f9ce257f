/* GPU routing statistics (kernels/histogram.cu) against the CPU reference, bit for bit:
 * random and edge-case routing of every width and view, and rp_stats_compute given
 * device ids (its GPU path) against the same call on host ids. Without a GPU every
 * check prints "# SKIP no GPU"; the argument checks that need no device run everywhere. */
#include "internal.h"
#include "stats_internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "../kernels/gpu_support.h"

#include <stdlib.h>

/* Checks run on a GPU; skipped (and counted as such) without one. */
#define GPU_CHECKS 68

static uint64_t rng_state = 0x2545F4914F6CDD1DULL;
static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)((rng_state >> 11) % n);
}

static int gpu_checks_run;
#define gok(cond, ...) (gpu_checks_run++, ok(cond, __VA_ARGS__))

/* Host ids in a given width and view, and their device copy. */
typedef struct routing_case {
    rp_batch *batch;
    int32_t n, layers, k, experts;
    rp_id_width width;
    int64_t token_stride, layer_stride, k_stride, elems;
    void *host;       /* ids in `width`, laid out by the strides */
    void *dev;        /* device copy */
    void *cu_dev;
} routing_case;

static void put(routing_case *c, int64_t t, int32_t l, int32_t j, int64_t id)
{
    int64_t i = t * c->token_stride + l * c->layer_stride + j * c->k_stride;
    if (c->width == RP_ID_U8) ((uint8_t *)c->host)[i] = (uint8_t)id;
    else if (c->width == RP_ID_U16) ((uint16_t *)c->host)[i] = (uint16_t)id;
    else ((int32_t *)c->host)[i] = (int32_t)id;
}

/* order 0: [tokens][layers][k]; 1: padded tokens (+1 id); 2: [tokens][k][layers] */
static void case_init(routing_case *c, rp_context *ctx, int32_t n, const int32_t *lens,
                      int32_t layers, int32_t k, int32_t experts, rp_id_width width, int order)
{
    memset(c, 0, sizeof *c);
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_batch_new(ctx, n, lens, zero, NULL, &c->batch, NULL);
    free(zero);
    c->n = n, c->layers = layers, c->k = k, c->experts = experts, c->width = width;
    int64_t rec = (int64_t)layers * k;
    c->token_stride = order == 1 ? rec + 1 : rec;
    c->layer_stride = order == 2 ? 1 : k;
    c->k_stride = order == 2 ? layers : 1;
    c->elems = rp_batch_num_tokens(c->batch) * c->token_stride;
    c->host = calloc((size_t)c->elems + 1, (size_t)width);
}

static void case_fill_random(routing_case *c)
{
    int64_t T = rp_batch_num_tokens(c->batch);
    for (int64_t t = 0; t < T; t++)
        for (int32_t l = 0; l < c->layers; l++)
            for (int32_t j = 0; j < c->k; j++)
                put(c, t, l, j, rnd(4) ? rnd(3) : rnd((uint32_t)c->experts)); /* skewed */
}

static int case_upload(routing_case *c, rp_routing *dev_view, rp_routing *host_view)
{
    rp_error err;
    if (rp_gpu_dev_upload(c->host, (size_t)c->elems * c->width, &c->dev, &err) != RP_OK ||
        rp_gpu_dev_upload(rp_batch_cu_seqlens(c->batch), ((size_t)c->n + 1) * sizeof(int64_t),
                          &c->cu_dev, &err) != RP_OK) {
        diag("%s", err.text);
        return 0;
    }
    rp_routing_packed(host_view, c->width, c->layers, c->k, c->host);
    host_view->token_stride = c->token_stride;
    host_view->layer_stride = c->layer_stride;
    host_view->k_stride = c->k_stride;
    *dev_view = *host_view;
    dev_view->base = c->dev;
    return 1;
}

static void case_free(routing_case *c)
{
    rp_gpu_dev_free(c->dev);
    rp_gpu_dev_free(c->cu_dev);
    free(c->host);
    rp_batch_free(c->batch);
}

/* Compare the GPU's dense histograms and loads with the CPU statistics. */
static int same_as_cpu(const rp_stats *st, const uint32_t *seq_hist, const int64_t *load)
{
    const int32_t n = rp_stats_num_seqs(st), L = rp_stats_num_layers(st), E = rp_stats_num_experts(st);
    uint32_t *h = malloc((size_t)E * sizeof *h);
    int same = 1;
    for (int32_t s = 0; s < n && same; s++)
        for (int32_t l = 0; l < L && same; l++) {
            rp_stats_seq_hist(st, s, l, h);
            if (memcmp(h, seq_hist + ((size_t)s * L + l) * E, (size_t)E * sizeof *h)) {
                diag("sequence %d layer %d differs", s, l);
                same = 0;
            }
        }
    for (int32_t l = 0; l < L && same; l++)
        if (memcmp(rp_stats_expert_load(st, l), load + (size_t)l * E, (size_t)E * sizeof *load)) {
            diag("layer %d loads differ", l);
            same = 0;
        }
    free(h);
    return same;
}

/* Histograms, loads and microbatch loads of one case on the GPU against the CPU, and
 * rp_stats_compute on the device ids against the host ids: four checks. */
static void check_case(rp_context *ctx, routing_case *c, const char *what)
{
    rp_routing dev, host;
    rp_error err;
    rp_stats *st = NULL;
    const int32_t L = c->layers, E = c->experts, n = c->n;
    const size_t cells = (size_t)L * E;
    uint32_t *hist = calloc((size_t)n * cells + 1, sizeof *hist);
    int64_t *load = calloc(cells, sizeof *load);
    int32_t *map = malloc(((size_t)n + 1) * sizeof *map);
    const int32_t mbs = 4;
    int64_t *mb_gpu = calloc((size_t)mbs * cells, sizeof *mb_gpu), *mb_cpu = calloc((size_t)mbs * cells, sizeof *mb_cpu);
    void *map_dev = NULL;
    for (int32_t s = 0; s < n; s++) map[s] = s % 5 == 2 ? -1 : (int32_t)rnd(mbs);
    int up = case_upload(c, &dev, &host) &&
             rp_gpu_dev_upload(map, (size_t)n * sizeof *map, &map_dev, &err) == RP_OK;
    rp_status cpu = up ? rp_stats_compute(ctx, c->batch, &host, E, 2, &st, &err) : RP_EINVAL;
    if (cpu != RP_OK) diag("CPU reference: %s", err.text);
    rp_status gs = up ? rp_gpu_routing_histograms(&dev, c->cu_dev, n, E, hist, load, &err) : RP_EINVAL;
    if (gs != RP_OK) diag("GPU: %s", err.text);
    gok(cpu == RP_OK && gs == RP_OK && same_as_cpu(st, hist, load), "%s: histograms and loads equal the CPU's", what);
    int64_t sum = 0;
    for (size_t i = 0; i < cells; i++) sum += load[i];
    gok(sum == rp_batch_num_tokens(c->batch) * c->k * L, "%s: loads sum to tokens x k x layers", what);
    rp_status gm = up ? rp_gpu_microbatch_loads(&dev, c->cu_dev, n, E, map_dev, mbs, mb_gpu, &err) : RP_EINVAL;
    if (gm != RP_OK) diag("GPU microbatches: %s", err.text);
    rp_status cm = st ? rp_stats_microbatch_loads(st, map, mbs, mb_cpu, &err) : RP_EINVAL;
    gok(gm == RP_OK && cm == RP_OK && !memcmp(mb_gpu, mb_cpu, (size_t)mbs * cells * sizeof *mb_gpu),
        "%s: microbatch loads equal the CPU's", what);
    rp_stats *dst = NULL;
    rp_status ds = up ? rp_stats_compute(ctx, c->batch, &dev, E, 2, &dst, &err) : RP_EINVAL;
    if (ds != RP_OK) diag("rp_stats_compute on device ids: %s", err.text);
    gok(cpu == RP_OK && ds == RP_OK && stats_same(st, dst),
        "%s: rp_stats_compute on device ids equals it on host ids in every field", what);
    rp_stats_free(dst);
    rp_stats_free(st);
    rp_gpu_dev_free(map_dev);
    free(hist), free(load), free(map), free(mb_gpu), free(mb_cpu);
}

static void random_lengths(int32_t *lens, int32_t n, int32_t max)
{
    for (int32_t s = 0; s < n; s++) lens[s] = s % 11 == 3 ? 0 : s % 13 == 5 ? 1 : (int32_t)rnd((uint32_t)max);
}

static void test_random(rp_context *ctx)
{
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    int32_t lens[300];
    random_lengths(lens, 300, 900);
    lens[17] = 12000; /* spans several blocks */
    for (int w = 0; w < 3; w++) {
        routing_case c;
        char what[64];
        case_init(&c, ctx, 300, lens, 5, 3, 40, widths[w], 0);
        case_fill_random(&c);
        snprintf(what, sizeof what, "random %d-byte ids, packed", (int)widths[w]);
        check_case(ctx, &c, what);
        case_free(&c);
    }
    /* the strided kernel: padded tokens and [tokens][k][layers] order */
    for (int order = 1; order <= 2; order++) {
        routing_case c;
        case_init(&c, ctx, 120, lens, 4, 2, 24, RP_ID_U16, order);
        case_fill_random(&c);
        check_case(ctx, &c, order == 1 ? "padded tokens" : "tokens x k x layers order");
        case_free(&c);
    }
    /* top-8 of 128 experts over 48 layers, the reference shape, uint8 */
    routing_case c;
    int32_t few[40];
    random_lengths(few, 40, 3000);
    case_init(&c, ctx, 40, few, 48, 8, 128, RP_ID_U8, 0);
    case_fill_random(&c);
    check_case(ctx, &c, "48 layers, top-8, 128 experts");
    case_free(&c);
}

static void test_edges(rp_context *ctx)
{
    routing_case c;
    /* every token to one expert (all choices of a layer to the same id: contention) */
    int32_t lens[6] = {0, 1, 5000, 0, 1, 700};
    case_init(&c, ctx, 6, lens, 3, 2, 16, RP_ID_U8, 0);
    for (int64_t t = 0; t < rp_batch_num_tokens(c.batch); t++)
        for (int32_t l = 0; l < 3; l++)
            for (int32_t j = 0; j < 2; j++) put(&c, t, l, j, 7);
    check_case(ctx, &c, "all tokens to one expert, empty and one-token sequences");
    case_free(&c);

    /* ids at each width's maximum: 255 of 256 experts, 65535 of 65536, 99999 of 100000
     * (the last two too many for shared memory: the global-memory kernel) */
    const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    const int32_t experts[3] = {256, 65536, 100000};
    int32_t small[5] = {3, 0, 40, 1, 9};
    for (int w = 0; w < 3; w++) {
        char what[64];
        case_init(&c, ctx, 5, small, 2, 2, experts[w], widths[w], 0);
        for (int64_t t = 0; t < rp_batch_num_tokens(c.batch); t++)
            for (int32_t l = 0; l < 2; l++)
                for (int32_t j = 0; j < 2; j++)
                    put(&c, t, l, j, j == 0 || rnd(2) ? experts[w] - 1 : (int64_t)rnd((uint32_t)experts[w]));
        snprintf(what, sizeof what, "ids at the maximum of %d-byte ids", (int)widths[w]);
        check_case(ctx, &c, what);
        case_free(&c);
    }
}

/* An out-of-range id: RP_ERANGE naming the same position as the CPU, and the id
 * counted in none (the rest equal to the CPU's counts without it). */
static void test_bad_id(rp_context *ctx)
{
    routing_case c;
    rp_routing dev, host;
    rp_error err, cpu_err;
    int32_t lens[50];
    random_lengths(lens, 50, 400);
    lens[20] = 300;
    lens[33] = 200;
    case_init(&c, ctx, 50, lens, 4, 2, 30, RP_ID_U16, 0);
    case_fill_random(&c);
    const int64_t *cu = rp_batch_cu_seqlens(c.batch);
    put(&c, cu[33] + 7, 1, 0, 31);   /* a later sequence */
    put(&c, cu[20] + 150, 2, 1, 30); /* the first bad id */
    put(&c, cu[20] + 149, 3, 0, 5);  /* a valid id to replace it with, in the reference */
    if (!case_upload(&c, &dev, &host)) {
        skip(7, "upload failed");
        gpu_checks_run += 7;
        case_free(&c);
        return;
    }
    rp_stats *st = NULL;
    if (rp_stats_compute(ctx, c.batch, &host, 30, 3, &st, &cpu_err) == RP_OK) rp_stats_free(st);
    const size_t cells = (size_t)4 * 30;
    uint32_t *hist = calloc(50 * cells, sizeof *hist);
    int64_t *load = calloc(cells, sizeof *load);
    rp_status gs = rp_gpu_routing_histograms(&dev, c.cu_dev, 50, 30, hist, load, &err);
    gok(gs == RP_ERANGE && err.sequence == 20 && err.expert == 30, "out-of-range id: RP_ERANGE at sequence 20 (%s)", err.text);
    like(err.text, cpu_err.text, "the same position and id as the CPU reports");
    gpu_checks_run++;

    /* reference: the bad ids replaced by expert 0, then those counts removed */
    put(&c, cu[20] + 150, 2, 1, 0);
    put(&c, cu[33] + 7, 1, 0, 0);
    st = NULL;
    rp_stats_compute(ctx, c.batch, &host, 30, 1, &st, NULL);
    uint32_t *want = calloc(50 * cells, sizeof *want);
    int64_t *want_load = calloc(cells, sizeof *want_load);
    for (int32_t s = 0; st && s < 50; s++)
        for (int32_t l = 0; l < 4; l++) rp_stats_seq_hist(st, s, l, want + ((size_t)s * 4 + l) * 30);
    for (int32_t l = 0; st && l < 4; l++) memcpy(want_load + l * 30, rp_stats_expert_load(st, l), 30 * sizeof *load);
    want[((size_t)20 * 4 + 2) * 30 + 0]--, want_load[2 * 30 + 0]--;
    want[((size_t)33 * 4 + 1) * 30 + 0]--, want_load[1 * 30 + 0]--;
    gok(!memcmp(hist, want, 50 * cells * sizeof *hist) && !memcmp(load, want_load, cells * sizeof *load),
        "out-of-range ids are counted in none, everything else as the CPU counts it");

    /* microbatch map out of range: RP_EINVAL, nothing written */
    int32_t map[50];
    void *map_dev = NULL;
    for (int i = 0; i < 50; i++) map[i] = i % 3;
    map[41] = 3;
    int64_t *mb = malloc(3 * cells * sizeof *mb);
    for (size_t i = 0; i < 3 * cells; i++) mb[i] = -7;
    rp_gpu_dev_upload(map, sizeof map, &map_dev, &err);
    gs = rp_gpu_microbatch_loads(&dev, c.cu_dev, 50, 30, map_dev, 3, mb, &err);
    gok(gs == RP_EINVAL && err.sequence == 41, "microbatch id out of range rejected (%s)", err.text);
    int untouched = 1;
    for (size_t i = 0; i < 3 * cells; i++) untouched &= mb[i] == -7;
    gok(untouched, "loads untouched on error");

    /* rp_stats_compute on the device ids (which still hold the bad ids): the CPU's
     * error word for word, and no statistics */
    rp_stats *dst = NULL;
    gs = rp_stats_compute(ctx, c.batch, &dev, 30, 3, &dst, &err);
    gok(gs == RP_ERANGE && dst == NULL && err.sequence == 20 && err.expert == 30,
        "rp_stats_compute on device ids: RP_ERANGE, no statistics");
    gok(strcmp(err.text, cpu_err.text) == 0, "rp_stats_compute on device ids: the CPU's message (%s)",
        err.text);    rp_gpu_dev_free(map_dev);
    rp_stats_free(st);
    free(hist), free(load), free(want), free(want_load), free(mb);
    case_free(&c);
}

static void test_empty(rp_context *ctx)
{
    routing_case c;
    rp_routing dev, host;
    rp_error err;
    case_init(&c, ctx, 0, NULL, 3, 2, 8, RP_ID_U8, 0);
    int64_t load[24];
    memset(load, 0x55, sizeof load);
    int up = case_upload(&c, &dev, &host);
    rp_status gs = up ? rp_gpu_routing_histograms(&dev, c.cu_dev, 0, 8, NULL, load, &err) : RP_EINVAL;
    int zero = 1;
    for (int i = 0; i < 24; i++) zero &= load[i] == 0;
    gok(gs == RP_OK && zero, "empty batch: zero loads");
    case_free(&c);

    int32_t lens[4] = {0, 0, 0, 0};
    case_init(&c, ctx, 4, lens, 3, 2, 8, RP_ID_I32, 0);
    check_case(ctx, &c, "only empty sequences");
    case_free(&c);

    /* views the GPU path does not take */
    int32_t one[1] = {3};
    case_init(&c, ctx, 1, one, 3, 2, 8, RP_ID_U8, 0);
    up = case_upload(&c, &dev, &host);
    rp_routing per_seq = dev;
    per_seq.layout = RP_ROUTING_PER_SEQ;
    uint32_t hist[24];
    gok(up && rp_gpu_routing_histograms(&per_seq, c.cu_dev, 1, 8, hist, load, &err) == RP_EINVAL,
        "a per-sequence view is rejected (%s)", err.text);
    case_free(&c);
}

/* Host pointers given to the GPU path: an argument error naming the array, never a kernel
 * fault (which would end the process's CUDA context and every later check). */
static void test_host_pointers(rp_context *ctx)
{
    routing_case c;
    rp_routing dev, host;
    rp_error err;
    int32_t lens[3] = {4, 0, 7};
    case_init(&c, ctx, 3, lens, 2, 2, 8, RP_ID_U8, 0);
    case_fill_random(&c);
    int up = case_upload(&c, &dev, &host);
    uint32_t hist[3 * 16];
    int64_t load[16], mb[16];
    int32_t map[3] = {0, 0, 0};
    void *map_dev = NULL;
    up = up && rp_gpu_dev_upload(map, sizeof map, &map_dev, &err) == RP_OK;
    gok(up && rp_gpu_pointer_readable(c.dev) && !rp_gpu_pointer_readable(c.host),
        "device memory is readable by the kernels, malloc'd host memory is not");
    rp_status s1 = up ? rp_gpu_routing_histograms(&host, c.cu_dev, 3, 8, hist, load, &err) : RP_OK;
    gok(s1 == RP_EINVAL, "host routing ids rejected (%s)", err.text);
    rp_status s2 = up ? rp_gpu_routing_histograms(&dev, rp_batch_cu_seqlens(c.batch), 3, 8, hist, load, &err) : RP_OK;
    gok(s2 == RP_EINVAL, "host cu_seqlens rejected (%s)", err.text);
    rp_status s3 = up ? rp_gpu_microbatch_loads(&dev, c.cu_dev, 3, 8, map, 1, mb, &err) : RP_OK;
    gok(s3 == RP_EINVAL, "host microbatch map rejected (%s)", err.text);
    rp_status s4 = up ? rp_gpu_routing_histograms(&dev, c.cu_dev, 3, 8, hist, load, &err) : RP_EINVAL;
    gok(s4 == RP_OK, "the device is still usable afterwards");
    rp_gpu_dev_free(map_dev);
    case_free(&c);
}

/* Which path rp_stats_compute takes: device arrays go to the kernel, host arrays to the
 * CPU, a view mixing them or non-packed device arrays are errors. */
static void test_dispatch(rp_context *ctx)
{
    routing_case c;
    rp_routing dev, host;
    rp_error err;
    int32_t lens[3] = {4, 0, 7};
    case_init(&c, ctx, 3, lens, 2, 2, 8, RP_ID_U8, 0);
    case_fill_random(&c);
    int up = case_upload(&c, &dev, &host);
    gok(up && rp_gpu_pointer_on_device(c.dev) && !rp_gpu_pointer_on_device(c.host) &&
            !rp_gpu_pointer_on_device(NULL),
        "device memory is dispatched to the kernels, host memory is not");

    /* per-sequence views: sequence 0 and 2 hold tokens (the empty one is never read) */
    void *seq_dev[2] = {NULL, NULL};
    const size_t rec = 2 * 2;
    up = up && rp_gpu_dev_upload(c.host, 4 * rec, &seq_dev[0], &err) == RP_OK &&
         rp_gpu_dev_upload((uint8_t *)c.host + 4 * rec, 7 * rec, &seq_dev[1], &err) == RP_OK;
    const void *mixed[3] = {seq_dev[0], NULL, (uint8_t *)c.host + 4 * rec};
    const void *all_dev[3] = {seq_dev[0], NULL, seq_dev[1]};
    const void *all_host[3] = {c.host, NULL, (uint8_t *)c.host + 4 * rec};
    rp_routing r;
    rp_stats *st = NULL, *ref = NULL;
    rp_routing_per_seq(&r, RP_ID_U8, 2, 2, mixed, 3);
    rp_status s1 = up ? rp_stats_compute(ctx, c.batch, &r, 8, 1, &st, &err) : RP_OK;
    gok(s1 == RP_EINVAL && st == NULL && err.sequence == 2,
        "host and device arrays in one view: RP_EINVAL naming sequence 2 (%s)", err.text);
    rp_routing_per_seq(&r, RP_ID_U8, 2, 2, all_dev, 3);
    rp_status s2 = up ? rp_stats_compute(ctx, c.batch, &r, 8, 1, &st, &err) : RP_OK;
    gok(s2 == RP_ENOTSUP && st == NULL, "per-sequence device arrays: RP_ENOTSUP (%s)", err.text);
    rp_routing_per_seq(&r, RP_ID_U8, 2, 2, all_host, 3);
    rp_status s3 = up ? rp_stats_compute(ctx, c.batch, &r, 8, 1, &ref, &err) : RP_EINVAL;
    rp_status s4 = up ? rp_stats_compute(ctx, c.batch, &dev, 8, 1, &st, &err) : RP_EINVAL;
    gok(s3 == RP_OK && s4 == RP_OK && stats_same(ref, st),
        "per-sequence host arrays take the CPU path and equal the packed device view");
    rp_stats_free(st), rp_stats_free(ref);
    st = ref = NULL;
    const void *layers_mixed[2] = {seq_dev[0], c.host};
    rp_routing_per_layer(&r, RP_ID_U8, 2, 2, layers_mixed);
    rp_status s5 = up ? rp_stats_compute(ctx, c.batch, &r, 8, 1, &st, &err) : RP_OK;
    gok(s5 == RP_EINVAL && st == NULL, "per-layer host and device arrays: RP_EINVAL (%s)", err.text);
    rp_gpu_dev_free(seq_dev[0]);
    rp_gpu_dev_free(seq_dev[1]);
    case_free(&c);

    /* a batch of empty sequences reads no id: the device base is never used */
    int32_t zeros[2] = {0, 0};
    case_init(&c, ctx, 2, zeros, 2, 2, 8, RP_ID_U8, 0);
    up = case_upload(&c, &dev, &host);
    rp_status s6 = up ? rp_stats_compute(ctx, c.batch, &dev, 8, 1, &st, &err) : RP_EINVAL;
    rp_status s7 = up ? rp_stats_compute(ctx, c.batch, &host, 8, 1, &ref, &err) : RP_EINVAL;
    gok(s6 == RP_OK && s7 == RP_OK && stats_same(ref, st), "empty sequences: the same from either side");
    rp_stats_free(st), rp_stats_free(ref);
    case_free(&c);
}

/* A generated example trace (examples/gen-small.json, step 0: 64 GRPO sequences of an
 * OLMoE-like model, skewed real expert counts): GPU against CPU, four checks. */
static void test_generated(rp_context *ctx)
{
    rp_gen *gen = NULL;
    rp_batch *batch = NULL;
    rp_routing r;
    rp_error err;
    routing_case c;
    memset(&c, 0, sizeof c);
    if (rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK ||
        rp_gen_step(gen, 0, &batch, &r, &err) != RP_OK) {
        diag("generator: %s", err.text);
        rp_gen_free(gen);
        for (int i = 0; i < 4; i++) gok(0, "generated example trace");
        return;
    }
    c.batch = batch;
    c.n = rp_batch_num_seqs(batch), c.layers = r.num_layers, c.k = r.top_k;
    c.experts = rp_gen_get_info(gen)->num_experts, c.width = r.width;
    c.token_stride = r.token_stride, c.layer_stride = r.layer_stride, c.k_stride = r.k_stride;
    c.elems = rp_batch_num_tokens(batch) * c.token_stride;
    c.host = malloc((size_t)c.elems * c.width + 1);
    memcpy(c.host, r.base, (size_t)c.elems * c.width); /* the generator owns its ids */
    diag("generated step: %d sequences, %lld tokens, %d layers, top-%d of %d experts", c.n,
         (long long)rp_batch_num_tokens(batch), c.layers, c.k, c.experts);
    check_case(ctx, &c, "generated example trace (gen-small.json)");
    case_free(&c);
    rp_gen_free(gen);
}

/* Checks that run without a device too. */
static void test_without_device(void)
{
    rp_error err;
    rp_routing r;
    uint8_t ids[4] = {0, 1, 2, 3};
    int64_t cu[2] = {0, 1}, load[8];
    uint32_t hist[8];
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    rp_status s = rp_gpu_routing_histograms(&r, cu, 1, 4, hist, load, &err);
    is_int(s, RP_ENOTSUP, "histograms without a GPU: RP_ENOTSUP");
    like(err.text, rp_gpu_built() ? "no CUDA device" : "no CUDA kernels", "says why");
    int32_t map[1] = {0};
    is_int(rp_gpu_microbatch_loads(&r, cu, 1, 4, map, 1, load, &err), RP_ENOTSUP,
           "microbatch loads without a GPU: RP_ENOTSUP");
    void *dev = NULL;
    ok(rp_gpu_dev_upload(ids, sizeof ids, &dev, &err) != RP_OK && dev == NULL, "no device memory without a GPU");
    ok(!rp_gpu_pointer_readable(ids) && !rp_gpu_pointer_readable(NULL), "no pointer is GPU-readable without a GPU");
    ok(!rp_gpu_pointer_on_device(ids), "no pointer is dispatched to the kernels without a GPU");
    if (rp_gpu_built()) {
        r.layout = RP_ROUTING_PER_LAYER;
        is_int(rp_gpu_routing_histograms(&r, cu, 1, 4, hist, load, &err), RP_EINVAL,
               "arguments are checked before the device");
        rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
        is_int(rp_gpu_microbatch_loads(&r, cu, 1, 4, map, -1, load, &err), RP_EINVAL,
               "negative microbatch count rejected");
    } else {
        skip(2, "this build has no CUDA kernels");
    }
}

int main(void)
{
    int gpus = rp_gpu_count();
    diag("CUDA kernels %s, %d GPU%s visible", rp_gpu_built() ? "built" : "not built", gpus, gpus == 1 ? "" : "s");
    if (gpus == 0) {
        test_without_device();
        skip(GPU_CHECKS + 1, "no GPU");
        return tap_done();
    }
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_random(ctx);
    test_edges(ctx);
    test_bad_id(ctx);
    test_empty(ctx);
    test_host_pointers(ctx);
    test_dispatch(ctx);
    test_generated(ctx);
    ok(gpu_checks_run == GPU_CHECKS, "ran the %d planned GPU checks (%d)", GPU_CHECKS, gpu_checks_run);
    rp_context_free(ctx);
    return tap_done();
}
