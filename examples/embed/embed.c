/* Embedding RoutePack from C: load a config, describe a batch and its routing replay as
 * the trainer holds it, and compute routing statistics. Build: see CMakeLists.txt here,
 * or `cc embed.c $(pkg-config --cflags --libs routepack)`. */
#include <routepack/routepack.h>

#include <stdio.h>
#include <stdlib.h>

static void log_line(void *ud, rp_log_level level, const char *message)
{
    (void)ud;
    fprintf(stderr, "[routepack %d] %s\n", (int)level, message);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CONFIG.json\n", argv[0]);
        return 2;
    }
    rp_context *ctx;
    rp_error err;
    rp_config *cfg = NULL;
    rp_batch *batch = NULL;
    rp_stats *stats = NULL;
    uint8_t *ids = NULL;
    int rc = 1;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    rp_context_set_log(ctx, log_line, NULL, RP_LOG_WARN);
    if (rp_config_load(ctx, argv[1], &cfg, &err) != RP_OK) goto fail;
    const rp_model *model = rp_config_model(cfg);

    /* Four sequences; routing replay as one [tokens, layers, k] uint8 array. */
    int32_t prompt[4] = {100, 80, 120, 60}, response[4] = {300, 20, 900, 40};
    if (rp_batch_new(ctx, 4, prompt, response, NULL, &batch, &err) != RP_OK) goto fail;
    int64_t tokens = rp_batch_num_tokens(batch);
    size_t per_token = (size_t)model->num_layers * (size_t)model->top_k;
    ids = malloc((size_t)tokens * per_token);
    if (!ids) goto fail;
    for (int64_t t = 0; t < tokens; t++)
        for (size_t j = 0; j < per_token; j++)
            ids[t * per_token + j] = (uint8_t)((t * 7 + j * 13 + j % model->top_k) % model->num_experts);
    rp_routing routing;
    rp_routing_packed(&routing, RP_ID_U8, model->num_layers, model->top_k, ids);
    if (rp_stats_compute(ctx, batch, &routing, model->num_experts, 0, &stats, &err) != RP_OK) goto fail;
    rp_skew skew = rp_skew_of(rp_stats_expert_load(stats, 0), model->num_experts);
    printf("embed: %lld tokens, layer 0 expert load max/mean %.3f\n", (long long)tokens,
           skew.max_over_mean);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "embed: %s\n", err.text);
out:
    rp_stats_free(stats);
    rp_batch_free(batch);
    rp_config_free(cfg);
    free(ids);
    rp_context_free(ctx);
    return rc;
}
