/* Fuzzes the generator's routing-counts reader (gen_read_counts: the schema of OLMoE's
 * routing analysis, docs/gen.md), taking the file's only model and all its domains, as
 * settings that name neither do. */
#include "fuzz_util.h"
#include "gen_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    fuzz_file f;
    fuzz_file_open(&f, data, size);
    gen_source src;
    gen_counts_miss miss;
    int32_t miss_index;
    rp_error err;
    if (gen_read_counts(ctx, f.path, NULL, NULL, NULL, 0, &src, &miss, &miss_index, &err) == RP_OK) {
        FUZZ_REQUIRE(src.num_experts > 0 && src.num_recorded > 0 && src.num_domains > 0,
                     "a counts file read with %d experts, %d recorded layers, %d domains", src.num_experts,
                     src.num_recorded, src.num_domains);
        for (int32_t d = 0; d < src.num_domains; d++) {
            const gen_src_domain *dom = &src.domains[d];
            for (int32_t r = 0; r < src.num_recorded; r++) {
                double sum = 0;
                for (int32_t e = 0; e < src.num_experts; e++) sum += dom->share[(size_t)r * src.num_experts + e];
                FUZZ_REQUIRE(sum > 0.999 && sum < 1.001, "domain %d layer %d: shares sum to %g", d, r, sum);
            }
        }
        gen_source_free(ctx, &src);
    }
    fuzz_file_close(&f);
    return 0;
}
