/* Router-shift throughput (rp_shift_compute, CPU) at a medium scale: 512 sequences of
 * about 512 tokens, 48 layers, top-8, 128 experts, uint8 ids, 10% of the choices moved,
 * next to rp_stats_compute over the same old routing (one routing read, not two). */
#include "bench_util.h"
#include "routepack/routepack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NUM_SEQS = 512, LAYERS = 48, TOP_K = 8, EXPERTS = 128, REPS = 3 };

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    int32_t prompt[NUM_SEQS], response[NUM_SEQS];
    for (int s = 0; s < NUM_SEQS; s++) prompt[s] = 64, response[s] = lognormal(448, 0.6, 1, 4096);
    rp_batch *b = NULL;
    rp_error err;
    rp_batch_new(ctx, NUM_SEQS, prompt, response, NULL, &b, &err);
    const int64_t tokens = rp_batch_num_tokens(b), rows = tokens * LAYERS;
    uint8_t *old_ids = malloc((size_t)rows * TOP_K), *new_ids = malloc((size_t)rows * TOP_K);
    for (int64_t r = 0; r < rows; r++) {
        /* distinct ids: a random start and stride coprime with 128 */
        uint32_t start = (uint32_t)(next_u64() % EXPERTS), stride = 2 * (uint32_t)(next_u64() % 64) + 1;
        for (int j = 0; j < TOP_K; j++) old_ids[r * TOP_K + j] = (uint8_t)((start + j * stride) % EXPERTS);
        memcpy(new_ids + r * TOP_K, old_ids + r * TOP_K, TOP_K);
        if (uniform() < 0.1 * TOP_K) { /* one choice moves to an expert outside the old set */
            int j = (int)(next_u64() % TOP_K);
            new_ids[r * TOP_K + j] = (uint8_t)((start + TOP_K * stride) % EXPERTS);
        }
    }
    rp_routing o, n;
    rp_routing_packed(&o, RP_ID_U8, LAYERS, TOP_K, old_ids);
    rp_routing_packed(&n, RP_ID_U8, LAYERS, TOP_K, new_ids);
    printf("router shift: %d sequences, %lld tokens, %d layers, top-%d, %d experts (%.1f MB of ids per routing)\n",
           NUM_SEQS, (long long)tokens, LAYERS, TOP_K, EXPERTS, (double)rows * TOP_K / 1e6);
    int threads[3] = {1, 2, 0};
    for (int i = 0; i < 3; i++) {
        double best_shift = 1e30, best_stats = 1e30;
        int64_t changed = 0;
        for (int rep = 0; rep < REPS; rep++) {
            rp_shift *sh = NULL;
            double t0 = now();
            if (rp_shift_compute(ctx, b, &o, &n, EXPERTS, threads[i], &sh, &err) != RP_OK) {
                fprintf(stderr, "shift: %s\n", err.text);
                return 1;
            }
            double t1 = now();
            changed = rp_shift_changed(sh);
            rp_shift_free(sh);
            rp_stats *st = NULL;
            double t2 = now();
            rp_stats_compute(ctx, b, &o, EXPERTS, threads[i], &st, &err);
            double t3 = now();
            rp_stats_free(st);
            if (t1 - t0 < best_shift) best_shift = t1 - t0;
            if (t3 - t2 < best_stats) best_stats = t3 - t2;
        }
        printf("threads %d (0: all CPUs): shift %.1f ms (%.2f G choices/s, %lld changed, %.4f), "
               "statistics of one routing %.1f ms, shift / statistics %.2f\n",
               threads[i], best_shift * 1e3, (double)rows * TOP_K / best_shift / 1e9, (long long)changed,
               (double)changed / ((double)rows * TOP_K), best_stats * 1e3, best_shift / best_stats);
    }
    free(old_ids), free(new_ids);
    rp_batch_free(b);
    rp_context_free(ctx);
    return 0;
}
