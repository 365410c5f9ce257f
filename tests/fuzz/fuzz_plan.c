/* Fuzzes the plan reader (rp_plan_parse against a small config) and what reads a plan
 * next: rp_plan_check against a batch, and the JSON round trip. A plan that parses must
 * be checkable without crashing, and its JSON must parse back to the same hash. */
#include "fuzz_util.h"

static void ignore(void *ud, const char *message)
{
    (void)ud;
    (void)message;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    const rp_config *cfg = fuzz_small_config();
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    rp_plan *plan = NULL;
    rp_error err;
    if (rp_plan_parse(ctx, cfg, (const char *)data, size, "<fuzz>", &plan, &err) != RP_OK) return 0;
    rp_plan_check(plan, cfg, NULL, ignore, NULL);
    rp_plan_check(plan, cfg, batch, ignore, NULL);
    char *text = NULL;
    size_t len = 0;
    if (rp_plan_to_json(plan, &text, &len, &err) == RP_OK) {
        rp_plan *again = NULL;
        FUZZ_REQUIRE(rp_plan_parse(ctx, cfg, text, len, "<round trip>", &again, &err) == RP_OK,
                     "a plan's own JSON does not parse: %s\n%s", err.text, text);
        FUZZ_REQUIRE(rp_plan_hash(again) == rp_plan_hash(plan), "the JSON round trip changed the hash:\n%s",
                     text);
        rp_plan_free(again);
        rp_text_free(ctx, text);
    }
    rp_plan_free(plan);
    return 0;
}
