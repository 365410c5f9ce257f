/* Fuzzes the config parser (rp_config_parse: JSON, every section's keys, types and
 * ranges). A config that parses must give a consistent topology: a plan for it can be
 * made and set to the contiguous placement. */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, (const char *)data, size, "<fuzz>", &cfg, &err) != RP_OK) return 0;
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    const rp_policy_config *policy = rp_config_policy(cfg);
    FUZZ_REQUIRE(topo && model && rp_config_hardware(cfg) && rp_config_limits(cfg) && policy,
                 "a parsed config lacks a section");
    FUZZ_REQUIRE(policy->name && policy->params_json, "a parsed config has no policy name or params");
    /* Only placements of a size a test would make: the sizes' own limits are the
     * config's business (docs/config.md), not this harness's memory. */
    int64_t slots = 0;
    for (int32_t g = 0; g < topo->ep_size && g < 4096; g++) slots += topo->slots[g];
    if (topo->num_gpus <= 4096 && (int64_t)model->num_layers * slots <= (1 << 16)) {
        rp_plan *plan = NULL;
        FUZZ_REQUIRE(rp_plan_new(ctx, cfg, 1, &plan, &err) == RP_OK, "rp_plan_new: %s", err.text);
        FUZZ_REQUIRE(rp_plan_set_contiguous(plan, &err) == RP_OK, "contiguous: %s", err.text);
        rp_plan_free(plan);
    }
    rp_config_free(cfg);
    return 0;
}
