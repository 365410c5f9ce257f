/* Fuzzes the routing trace reader (.rpt): rp_trace_open's header, size and checksum
 * checks, rp_trace_read_step on every step, rp_trace_validate, and the routing
 * statistics of a trace that validates. Opened without the checksum pass too, since
 * a trainer may skip it: reading steps must still be safe then. */
#include "fuzz_util.h"

static void read_steps(rp_trace *trace)
{
    int32_t n = rp_trace_num_steps(trace);
    for (int32_t i = 0; i < n; i++) {
        const rp_trace_step_info *info = rp_trace_step(trace, i);
        FUZZ_REQUIRE(info, "step %d of %d has no info", i, n);
        rp_batch *batch = NULL;
        rp_routing routing;
        rp_error err;
        if (rp_trace_read_step(trace, i, &batch, &routing, &err) != RP_OK) continue;
        FUZZ_REQUIRE(rp_batch_num_seqs(batch) == info->num_seqs, "step %d: %d sequences, header says %d",
                     i, rp_batch_num_seqs(batch), info->num_seqs);
        FUZZ_REQUIRE(rp_batch_num_tokens(batch) == info->num_tokens, "step %d: token count differs", i);
        rp_batch_free(batch);
    }
    FUZZ_REQUIRE(rp_trace_step(trace, n) == NULL && rp_trace_step(trace, -1) == NULL,
                 "a step out of range has info");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    fuzz_file f;
    fuzz_file_open(&f, data, size);
    rp_trace *trace = NULL;
    rp_error err;
    if (rp_trace_open(ctx, f.path, RP_TRACE_NO_VERIFY, &trace, &err) == RP_OK) {
        read_steps(trace);
        rp_trace_close(trace);
    }
    if (rp_trace_open(ctx, f.path, 0, &trace, &err) == RP_OK) {
        read_steps(trace);
        const rp_trace_step_info *info = rp_trace_step(trace, 0);
        /* A validated step is safe input for the statistics scan (whose histograms,
         * sequences x layers x experts, are kept to a size a test would use). */
        if (rp_trace_validate(trace, &err) == RP_OK && info &&
            (int64_t)info->num_seqs * info->num_layers * info->num_experts <= (1 << 22)) {
            rp_batch *batch = NULL;
            rp_routing routing;
            FUZZ_REQUIRE(rp_trace_read_step(trace, 0, &batch, &routing, &err) == RP_OK,
                         "a validated trace's step 0 does not read: %s", err.text);
            rp_stats *stats = NULL;
            rp_status st = rp_stats_compute(ctx, batch, &routing, info->num_experts, 1,
                                            &stats, &err);
            FUZZ_REQUIRE(st == RP_OK || st == RP_ENOMEM, "statistics of a validated step: %s", err.text);
            rp_stats_free(stats);
            rp_batch_free(batch);
        }
        rp_trace_close(trace);
    }
    fuzz_file_close(&f);
    return 0;
}
