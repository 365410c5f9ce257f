/* The distributed step's statistics exchange (docs/distributed.md, "Bytes per step"): one
 * generated step split over the config's ranks (each rolled out a contiguous block of
 * sequences, whole GRPO groups), what each rank sends and receives, and the time to
 * compute a part, serialise it, merge all parts and plan from the merge, against a
 * single process's rp_sched_step on the whole routing. Figures only; nothing is asserted
 * except that the merge equals the whole batch's statistics (else the figures are wrong).
 * Usage: bench_stats_exchange [CONFIG GEN] (default: examples/config-small.json and
 * examples/gen-small.json). */
#include "bench_util.h"
#include "stats_internal.h"
#include "routepack/routepack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double mib(double b) { return b / (1024.0 * 1024.0); }

int main(int argc, char **argv)
{
    const char *cfg_path = argc > 2 ? argv[1] : RP_SOURCE_DIR "/examples/config-small.json";
    const char *gen_path = argc > 2 ? argv[2] : RP_SOURCE_DIR "/examples/gen-small.json";
    rp_context *ctx = NULL;
    rp_config *cfg = NULL;
    rp_gen *gen = NULL;
    rp_batch *batch = NULL;
    rp_routing routing;
    rp_error err;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK || rp_config_load(ctx, cfg_path, &cfg, &err) != RP_OK ||
        rp_gen_load(ctx, gen_path, &gen, &err) != RP_OK) {
        fprintf(stderr, "bench_stats_exchange: %s\n", err.text);
        return 1;
    }
    double t0 = now();
    if (rp_gen_step(gen, 0, &batch, &routing, &err) != RP_OK) {
        fprintf(stderr, "bench_stats_exchange: gen: %s\n", err.text);
        return 1;
    }
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *md = rp_config_model(cfg);
    const int32_t P = topo->num_gpus, n = rp_batch_num_seqs(batch);
    const int64_t tokens = rp_batch_num_tokens(batch);
    const size_t rec = (size_t)md->num_layers * (size_t)md->top_k * (size_t)routing.width;
    printf("bench_stats_exchange: %s, %s\n", cfg_path, gen_path);
    printf("  step: %d sequences, %lld tokens, %d layers x %d experts, top-%d, %d ranks; routing %.1f MiB "
           "(generated in %.1f s)\n",
           n, (long long)tokens, md->num_layers, md->num_experts, md->top_k, P, mib((double)tokens * rec),
           now() - t0);

    /* the whole batch's statistics, the reference */
    rp_stats *whole = NULL;
    t0 = now();
    if (rp_stats_compute(ctx, batch, &routing, md->num_experts, 0, &whole, &err) != RP_OK) {
        fprintf(stderr, "bench_stats_exchange: %s\n", err.text);
        return 1;
    }
    const double whole_scan_s = now() - t0;

    /* each rank's part: a contiguous block of sequences, cut at whole groups of 8 */
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    const int32_t *pl = rp_batch_prompt_lens(batch), *rl = rp_batch_response_lens(batch);
    int32_t *first = malloc(sizeof *first * (size_t)(P + 1));
    for (int32_t r = 0; r <= P; r++) first[r] = (int32_t)((int64_t)n * r / P);
    unsigned char **bytes = calloc((size_t)P, sizeof *bytes);
    size_t *lens = calloc((size_t)P, sizeof *lens);
    int32_t **ids = calloc((size_t)P, sizeof *ids);
    double part_s = 0, ser_s = 0;
    size_t sent_min = SIZE_MAX, sent_max = 0, sent_sum = 0;
    for (int32_t r = 0; r < P; r++) {
        const int32_t m = first[r + 1] - first[r];
        rp_batch *lb = NULL;
        rp_stats *part = NULL;
        rp_routing lr;
        rp_routing_packed(&lr, routing.width, md->num_layers, md->top_k,
                          (const unsigned char *)routing.base + (size_t)cu[first[r]] * rec);
        ids[r] = malloc(sizeof(int32_t) * ((size_t)m + 1));
        for (int32_t i = 0; i < m; i++) ids[r][i] = first[r] + i;
        if (rp_batch_new(ctx, m, pl + first[r], rl + first[r], NULL, &lb, &err) != RP_OK) return 1;
        t0 = now();
        if (rp_stats_compute(ctx, lb, &lr, md->num_experts, 1, &part, &err) != RP_OK) return 1;
        part_s += now() - t0;
        lens[r] = rp_stats_serialized_bytes(part);
        bytes[r] = malloc(lens[r]);
        t0 = now();
        rp_stats_serialize(part, bytes[r], lens[r], &err);
        ser_s += now() - t0;
        sent_min = lens[r] < sent_min ? lens[r] : sent_min;
        sent_max = lens[r] > sent_max ? lens[r] : sent_max;
        sent_sum += lens[r];
        rp_stats_free(part);
        rp_batch_free(lb);
    }
    rp_stats *merged = NULL;
    t0 = now();
    if (rp_stats_merge_serialized(ctx, P, (const void *const *)bytes, lens, (const int32_t *const *)ids, n, &merged,
                                  &err) != RP_OK) {
        fprintf(stderr, "bench_stats_exchange: merge: %s\n", err.text);
        return 1;
    }
    const double merge_s = now() - t0;
    if (!stats_same(merged, whole)) {
        fprintf(stderr, "bench_stats_exchange: the merge differs from the whole batch's statistics\n");
        return 1;
    }
    int32_t widths[5] = {0};
    size_t hist = 0;
    for (int32_t r = 0; r < P; r++) {
        const unsigned char *w = bytes[r] + RP_STATS_WIRE_HEADER_BYTES;
        for (int32_t i = 0; i < first[r + 1] - first[r]; i++) widths[w[i]]++;
        hist += lens[r] - RP_STATS_WIRE_HEADER_BYTES - (size_t)(first[r + 1] - first[r]);
    }
    printf("  widths: %d sequences at 0 bytes a count, %d at 1, %d at 2, %d at 4; histograms %.2f MiB in all\n",
           widths[0], widths[1], widths[2], widths[4], mib((double)hist));
    printf("  serialised whole step: %zu bytes (%.2f MiB); the scheduler's rp_stats holds %.2f MiB\n",
           rp_stats_serialized_bytes(whole), mib((double)rp_stats_serialized_bytes(whole)),
           mib((double)rp_stats_bytes(whole)));
    printf("  per rank, statistics part: sends %zu .. %zu bytes (mean %.0f), receives %zu .. %zu\n", sent_min,
           sent_max, (double)sent_sum / P, sent_sum - sent_max, sent_sum - sent_min);
    printf("  per rank, global ids (int32): sends %d .. %d bytes, receives %d\n", 4 * (n / P), 4 * ((n + P - 1) / P),
           4 * n - 4 * (n / P));
    printf("  per rank, padded all_gather: sends %zu bytes (+8 size), receives %zu (%.2f MiB)\n", sent_max,
           (size_t)(P - 1) * sent_max, mib((double)(P - 1) * (double)sent_max));
    printf("  per rank, scheduler agreement: sends 32 bytes, receives %d (2 allgathers of 16); when ranks "
           "disagree, the plan JSON as well\n", 32 * (P - 1));

    /* the plan: from the merge vs the whole routing */
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    rp_sched *a = NULL, *b = NULL;
    const rp_plan *pa, *pb;
    const rp_step_report *ra, *rb;
    if (rp_sched_new(ctx, cfg, &o, &a, &err) != RP_OK || rp_sched_new(ctx, cfg, &o, &b, &err) != RP_OK) return 1;
    t0 = now();
    if (rp_sched_step(a, 0, batch, &routing, &pa, &ra, &err) != RP_OK) return 1;
    const double step_s = now() - t0;
    t0 = now();
    if (rp_sched_step_stats(b, 0, batch, merged, &pb, &rb, &err) != RP_OK) return 1;
    const double step_stats_s = now() - t0;
    char *json = NULL;
    size_t json_len = 0;
    rp_plan_to_json(pb, &json, &json_len, &err);
    printf("  plan JSON (broadcast only when ranks disagree): %zu bytes\n", json_len);
    rp_text_free(ctx, json);
    printf("  times (one CPU thread per part; %s): whole-batch scan %.3f s (all CPUs); parts %.3f s in all, "
           "%.4f s per rank; serialise %.4f s per rank; merge of %d parts %.3f s\n",
           "figures from this machine", whole_scan_s, part_s, part_s / P, ser_s / P, P, merge_s);
    printf("  step: rp_sched_step %.3f s, rp_sched_step_stats %.3f s, same plan: %s\n", step_s, step_stats_s,
           rp_plan_hash(pa) == rp_plan_hash(pb) ? "yes" : "NO");
    rp_sched_free(a);
    rp_sched_free(b);
    for (int32_t r = 0; r < P; r++) {
        free(bytes[r]);
        free(ids[r]);
    }
    free(bytes);
    free(lens);
    free(ids);
    free(first);
    rp_stats_free(merged);
    rp_stats_free(whole);
    rp_batch_free(batch);
    rp_gen_free(gen);
    rp_config_free(cfg);
    rp_context_free(ctx);
    return 0;
}
