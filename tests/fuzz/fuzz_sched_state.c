/* Fuzzes the checkpoint loader (rp_sched_load_state, docs/formats.md "Scheduler
 * state") on a fresh scheduler per input, so a crash replays from its input alone. A
 * state that loads must be one the scheduler can save again as the same JSON document
 * (key order and white space aside), and then go on planning: save -> load -> save gives
 * the same bytes, and the next step runs. */
#include "fuzz_util.h"

#include <jansson.h>

static rp_sched *make(void)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    o.history = 2;
    rp_sched *s = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &s, &err) == RP_OK, "rp_sched_new: %s",
                 err.text);
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    rp_sched *sched = make();
    rp_error err;
    if (rp_sched_load_state(sched, (const char *)data, size, &err) == RP_OK) {
        char *saved = NULL, *again = NULL;
        size_t saved_len = 0, again_len = 0;
        FUZZ_REQUIRE(rp_sched_save_state(sched, &saved, &saved_len, &err) == RP_OK,
                     "a loaded state does not save: %s", err.text);
        json_t *in = json_loadb((const char *)data, size, 0, NULL), *out = json_loadb(saved, saved_len, 0, NULL);
        FUZZ_REQUIRE(in && out && json_equal(in, out), "a loaded state saves as another JSON document");
        json_decref(in);
        json_decref(out);
        rp_sched *other = make();
        FUZZ_REQUIRE(rp_sched_load_state(other, saved, saved_len, &err) == RP_OK,
                     "the scheduler's own checkpoint does not load: %s", err.text);
        FUZZ_REQUIRE(rp_sched_save_state(other, &again, &again_len, &err) == RP_OK,
                     "a reloaded state does not save: %s", err.text);
        FUZZ_REQUIRE(again_len == saved_len && memcmp(again, saved, saved_len) == 0,
                     "save -> load -> save changed the bytes (%zu, then %zu)", saved_len, again_len);
        rp_text_free(ctx, saved);
        rp_text_free(ctx, again);
        rp_sched_free(other);
        const rp_step_report *report = NULL;
        const rp_plan *plan = NULL;
        int64_t step = 1000000;
        rp_status st = rp_sched_step(sched, step, batch, &routing, &plan, &report, &err);
        FUZZ_REQUIRE(st == RP_OK, "the step after a loaded state failed: %s", err.text);
    }
    rp_sched_free(sched);
    return 0;
}
