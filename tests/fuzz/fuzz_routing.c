/* Fuzzes what a trainer hands the scheduler every step: a batch's lengths and group ids
 * (rp_batch_new) and its routing replay in each layout and id width (rp_routing_check),
 * then the statistics scan of what passed, compared with expert loads counted here.
 * Input: 6 bytes of shape (layout, width, sequences, layers, top_k, experts), 3 bytes a
 * sequence (prompt and response length, group), then the ids (zeros when short). Views
 * are dense, as the trainer's tensors are: the library cannot know a buffer's size. */
#include "fuzz_util.h"

#define MAX_SEQS 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 6) return 0;
    rp_context *ctx = fuzz_context();
    rp_routing_layout layout = (rp_routing_layout)(data[0] % 3);
    static const rp_id_width widths[3] = {RP_ID_U8, RP_ID_U16, RP_ID_I32};
    rp_id_width width = widths[data[1] % 3];
    int32_t num_seqs = data[2] % MAX_SEQS + 1, num_layers = data[3] % 4 + 1, top_k = data[4] % 4 + 1;
    int32_t num_experts = data[5] % 64 + 1;
    size_t at = 6;
    int32_t prompt[MAX_SEQS], response[MAX_SEQS], group[MAX_SEQS];
    for (int32_t s = 0; s < num_seqs; s++) {
        prompt[s] = at < size ? data[at] : 1;
        response[s] = at + 1 < size ? data[at + 1] : 1;
        group[s] = at + 2 < size ? (int8_t)data[at + 2] : s;
        at += 3;
    }
    rp_batch *batch = NULL;
    rp_error err;
    if (rp_batch_new(ctx, num_seqs, prompt, response, group, &batch, &err) != RP_OK) return 0;
    int64_t tokens = rp_batch_num_tokens(batch);
    size_t per_token = (size_t)num_layers * (size_t)top_k;
    size_t count = (size_t)tokens * per_token, bytes = count * (size_t)width;
    uint8_t *ids = calloc(bytes ? bytes : 1, 1);
    FUZZ_REQUIRE(ids, "out of memory");
    if (at < size) memcpy(ids, data + at, size - at < bytes ? size - at : bytes);

    /* The same ids seen through each layout: [tokens, layers, k] packed; per sequence the
     * slice of its tokens; per layer, [tokens, k] arrays (a transposed copy). */
    const void *bases[MAX_SEQS > 4 ? MAX_SEQS : 4];
    uint8_t *by_layer = NULL;
    rp_routing routing;
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    if (layout == RP_ROUTING_PACKED) {
        rp_routing_packed(&routing, width, num_layers, top_k, ids);
    } else if (layout == RP_ROUTING_PER_SEQ) {
        for (int32_t s = 0; s < num_seqs; s++) bases[s] = ids + (size_t)cu[s] * per_token * (size_t)width;
        rp_routing_per_seq(&routing, width, num_layers, top_k, bases, num_seqs);
    } else {
        by_layer = malloc(bytes ? bytes : 1);
        FUZZ_REQUIRE(by_layer, "out of memory");
        size_t layer_bytes = (size_t)tokens * (size_t)top_k * (size_t)width;
        for (int64_t t = 0; t < tokens; t++)
            for (int32_t l = 0; l < num_layers; l++)
                memcpy(by_layer + (size_t)l * layer_bytes + (size_t)t * (size_t)top_k * (size_t)width,
                       ids + ((size_t)t * per_token + (size_t)l * (size_t)top_k) * (size_t)width,
                       (size_t)top_k * (size_t)width);
        for (int32_t l = 0; l < num_layers; l++) bases[l] = by_layer + (size_t)l * layer_bytes;
        rp_routing_per_layer(&routing, width, num_layers, top_k, bases);
    }

    if (rp_routing_check(&routing, batch, num_experts, &err) == RP_OK) {
        int64_t want[4][64] = {{0}};
        for (size_t i = 0; i < count; i++) {
            int64_t id = width == RP_ID_U8    ? ids[i]
                         : width == RP_ID_U16 ? ((const uint16_t *)ids)[i]
                                              : ((const int32_t *)ids)[i];
            FUZZ_REQUIRE(id >= 0 && id < num_experts, "checked routing holds id %lld of %d experts", (long long)id,
                         num_experts);
            want[(i / (size_t)top_k) % (size_t)num_layers][id]++;
        }
        rp_stats *stats = NULL;
        FUZZ_REQUIRE(rp_stats_compute(ctx, batch, &routing, num_experts, 1, &stats, &err) == RP_OK,
                     "statistics of checked routing: %s", err.text);
        for (int32_t l = 0; l < num_layers; l++) {
            const int64_t *load = rp_stats_expert_load(stats, l);
            for (int32_t e = 0; e < num_experts; e++)
                FUZZ_REQUIRE(load[e] == want[l][e], "layer %d expert %d: load %lld, counted %lld", l, e,
                             (long long)load[e], (long long)want[l][e]);
        }
        rp_stats_free(stats);
    }
    free(by_layer);
    free(ids);
    rp_batch_free(batch);
    return 0;
}
