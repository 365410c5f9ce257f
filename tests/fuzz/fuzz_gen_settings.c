/* Fuzzes the generator settings parser (gen_settings_parse, docs/gen.md) with data files
 * resolved against examples/ (the bundled counts file and request trace). Settings of a
 * small shape then build the whole generator (rp_gen_parse: calibration) and its first
 * step; large shapes only parse, since calibrating them takes seconds by design. */
#include "fuzz_util.h"
#include "gen_internal.h"

#define BASE_DIR RP_SOURCE_DIR "/examples"

static void generate(const uint8_t *data, size_t size)
{
    rp_gen *gen = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_gen_parse(fuzz_context(), (const char *)data, size, "<fuzz>", BASE_DIR, &gen, &err) == RP_OK,
                 "settings that parse do not build a generator: %s", err.text);
    const rp_gen_info *info = rp_gen_get_info(gen);
    FUZZ_REQUIRE(info->num_seqs == info->num_prompts * info->group_size, "%d sequences, %d x %d",
                 info->num_seqs, info->num_prompts, info->group_size);
    FUZZ_REQUIRE(info->top_k >= 1 && info->top_k <= info->num_experts, "top_k %d of %d experts", info->top_k,
                 info->num_experts);
    int64_t ids = (int64_t)info->num_seqs * ((int64_t)info->prompt_cap + info->response_cap) *
                  info->num_layers * info->top_k;
    if (ids <= (1 << 20)) {
        rp_batch *batch = NULL;
        rp_routing routing;
        FUZZ_REQUIRE(rp_gen_step(gen, 0, &batch, &routing, &err) == RP_OK, "step 0: %s", err.text);
        FUZZ_REQUIRE(rp_batch_num_seqs(batch) == info->num_seqs, "step 0 has %d sequences, info says %d",
                     rp_batch_num_seqs(batch), info->num_seqs);
        FUZZ_REQUIRE(rp_routing_check(&routing, batch, info->num_experts, &err) == RP_OK,
                     "generated routing is invalid: %s", err.text);
        rp_batch_free(batch);
    }
    rp_gen_free(gen);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    gen_settings s;
    rp_error err;
    if (gen_settings_parse(ctx, (const char *)data, size, "<fuzz>", BASE_DIR, &s, &err) != RP_OK) return 0;
    bool small = s.num_layers <= 4 && s.num_experts <= 64 && s.num_prompts * (int64_t)s.group_size <= 64;
    gen_settings_free(ctx, &s);
    if (small) generate(data, size);
    return 0;
}
