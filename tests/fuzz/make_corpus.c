/* Writes the seeds of tests/fuzz/corpus that are made by the library rather than copied
 * from the repository's files: a small trace (fuzz_trace), scheduler checkpoints
 * (fuzz_sched_state) and serialised statistics (fuzz_stats_wire), for the fuzzers' small
 * config and batch (fuzz_util.h).
 * Usage: make_corpus CORPUS_DIR   (docs/fuzzing.md, "Seed corpora") */
#include "fuzz_util.h"

#include <sys/stat.h>

static const char *dir;

static void write_file(const char *sub, const char *name, const char *text, size_t len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/%s/%s", dir, sub, name);
    FILE *f = fopen(path, "wb");
    FUZZ_REQUIRE(f && fwrite(text, 1, len, f) == len && fclose(f) == 0, "cannot write %s", path);
}

static void trace(void)
{
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    char path[1024];
    snprintf(path, sizeof path, "%s/fuzz_trace", dir);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/fuzz_trace/small-2steps.rpt", dir);
    rp_trace_writer *w = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_trace_writer_open(fuzz_context(), path, 6, &w, &err) == RP_OK, "%s", err.text);
    FUZZ_REQUIRE(rp_trace_writer_append(w, 0, batch, &routing, &err) == RP_OK, "%s", err.text);
    FUZZ_REQUIRE(rp_trace_writer_append(w, 1, batch, &routing, &err) == RP_OK, "%s", err.text);
    FUZZ_REQUIRE(rp_trace_writer_close(w, &err) == RP_OK, "%s", err.text);
}

/* Serialised statistics (the ranks' exchange) of the small batch, and of a batch of 3
 * cells a sequence whose 2-byte counts follow 1-byte ones at an odd offset. */
static void stats_wire(void)
{
    rp_context *ctx = fuzz_context();
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    rp_error err;
    rp_batch *odd = NULL;
    int32_t prompt[2] = {5, 300}, response[2] = {0, 0};
    FUZZ_REQUIRE(rp_batch_new(ctx, 2, prompt, response, NULL, &odd, &err) == RP_OK, "%s", err.text);
    static uint8_t odd_ids[305];
    for (int t = 0; t < 305; t++) odd_ids[t] = (uint8_t)(t < 5 ? t % 3 : 1);
    rp_routing odd_routing;
    rp_routing_packed(&odd_routing, RP_ID_U8, 1, 1, odd_ids);
    const struct {
        const char *name;
        const rp_batch *batch;
        const rp_routing *routing;
        int32_t experts;
    } cases[] = {{"small.bin", batch, &routing, 6}, {"odd-offsets.bin", odd, &odd_routing, 3}};
    for (int i = 0; i < 2; i++) {
        rp_stats *stats = NULL;
        FUZZ_REQUIRE(rp_stats_compute(ctx, cases[i].batch, cases[i].routing, cases[i].experts, 1, &stats, &err) == RP_OK,
                     "%s", err.text);
        size_t n = rp_stats_serialized_bytes(stats);
        char *bytes = malloc(n);
        FUZZ_REQUIRE(bytes && rp_stats_serialize(stats, bytes, n, &err) == RP_OK, "%s", err.text);
        write_file("fuzz_stats_wire", cases[i].name, bytes, n);
        free(bytes);
        rp_stats_free(stats);
    }
    rp_batch_free(odd);
}

/* Keeps a counter and a list in ctx.state, so the checkpoint carries a policy state. */
static const char *STATEFUL =
    "return {name = 'stateful', version = '1.0.0', api = 1, description = 'keeps state',\n"
    "params = {every = {type = 'integer', default = 2, doc = 'plan by attention every this many steps'}},\n"
    "init = function(ctx) ctx.state.n = 0; ctx.state.seen = {} end,\n"
    "plan = function(ctx)\n"
    "  ctx.state.n = ctx.state.n + 1\n"
    "  ctx.state.seen[#ctx.state.seen + 1] = {step = ctx.step, x = 0.5}\n"
    "  if ctx.state.n % ctx.params.every == 0 then return rp.baseline('attn_kk+eplb') end\n"
    "  return rp.baseline('token_kk+eplb')\n"
    "end}\n";

static void state(const char *name, const char *policy, const char *source, int steps, bool stage)
{
    const rp_batch *batch;
    rp_routing routing;
    fuzz_small_batch(&batch, &routing);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    o.history = 2;
    rp_sched *s = NULL;
    rp_error err;
    FUZZ_REQUIRE(rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &s, &err) == RP_OK, "%s", err.text);
    if (source) {
        FUZZ_REQUIRE(rp_sched_stage_policy(s, policy, source, -1, &err) == RP_OK, "%s", err.text);
    }
    const rp_plan *plan;
    const rp_step_report *report;
    for (int t = 0; t < steps; t++)
        FUZZ_REQUIRE(rp_sched_step(s, t, batch, &routing, &plan, &report, &err) == RP_OK, "%s", err.text);
    if (stage) FUZZ_REQUIRE(rp_sched_stage_policy(s, "attn_kk+eplb", NULL, steps + 3, &err) == RP_OK, "%s", err.text);
    char *text;
    size_t len;
    FUZZ_REQUIRE(rp_sched_save_state(s, &text, &len, &err) == RP_OK, "%s", err.text);
    /* The policies' paths name this checkout; the seeds name the source tree's. */
    static const char prefix[] = RP_SOURCE_DIR "/";
    char *out = malloc(len + 1);
    FUZZ_REQUIRE(out, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        if (len - i >= sizeof prefix - 1 && memcmp(text + i, prefix, sizeof prefix - 1) == 0) {
            i += sizeof prefix - 1;
        } else {
            out[n++] = text[i++];
        }
    }
    rp_text_free(fuzz_context(), text);
    rp_sched_free(s);
    /* A seed that does not load would only teach the fuzzer the loader's first error. */
    FUZZ_REQUIRE(rp_sched_new(fuzz_context(), fuzz_small_config(), &o, &s, &err) == RP_OK, "%s", err.text);
    FUZZ_REQUIRE(rp_sched_load_state(s, out, n, &err) == RP_OK, "%s does not load: %s", name, err.text);
    rp_sched_free(s);
    write_file("fuzz_sched_state", name, out, n);
    free(out);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_corpus CORPUS_DIR\n");
        return 2;
    }
    dir = argv[1];
    trace();
    stats_wire();
    state("fresh.json", NULL, NULL, 0, false);
    state("pair-3steps.json", NULL, NULL, 3, false);
    state("stateful-staged.json", "stateful.lua", STATEFUL, 3, true);
    return 0;
}
