/* `routepack stats --shift OLD.rpt NEW.rpt`, run as a user would: two traces of the same
 * tokens written here (one token's layer-0 top-k moved), the text and JSON figures
 * against the hand count, and the refusals (traces of other tokens or models, one
 * trace, a missing step). */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <stdlib.h>
#include <unistd.h>

static char tmpdir[64];
static char out[1 << 17];

static const char *tmp(const char *name) { return temp_path(tmpdir, name); }
#define rp(...) run_routepack(out, sizeof out, __VA_ARGS__)

/* 3 sequences (one empty), 7 tokens, 2 layers, top-2, 8 experts */
enum { NSEQ = 3, T = 7, L = 2, K = 2, E = 8 };
static const int32_t prompt[NSEQ] = {2, 0, 1}, response[NSEQ] = {2, 0, 2};

static void write_trace(rp_context *ctx, const char *path, const int32_t *ids, int32_t experts, int32_t layers)
{
    rp_batch *b = NULL;
    rp_error err;
    rp_batch_new(ctx, NSEQ, prompt, response, NULL, &b, &err);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_I32, layers, K, ids);
    rp_trace_writer *w = NULL;
    rp_status st = rp_trace_writer_open(ctx, path, experts, &w, &err);
    if (st == RP_OK) st = rp_trace_writer_append(w, 0, b, &r, &err);
    if (st == RP_OK) st = rp_trace_writer_close(w, &err);
    if (st != RP_OK) diag("writing %s: %s", path, err.text);
    rp_batch_free(b);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "shift")) return 1;
    int32_t old_ids[T * L * K], new_ids[T * L * K];
    for (int i = 0; i < T * L * K; i += 2) old_ids[i] = i % E, old_ids[i + 1] = (i + 1) % E;
    memcpy(new_ids, old_ids, sizeof new_ids);
    /* token 4 (sequence 2, its first token), layer 0: {0,1} -> {1,5}: one choice changed */
    int at = (4 * L + 0) * K;
    new_ids[at] = 5, new_ids[at + 1] = old_ids[at + 1];
    write_trace(ctx, tmp("old.rpt"), old_ids, E, L);
    write_trace(ctx, tmp("new.rpt"), new_ids, E, L);

    int rc = rp("stats --shift '%s' '%s'", tmp("old.rpt"), tmp("new.rpt"));
    ok(rc == 0 && strstr(out, "1 of 28 token-choices changed (0.0357)"), "text: 1 of 28 choices changed");
    ok(strstr(out, "worst sequence 2 (0.0833)") != NULL, "text: the worst sequence is 2 with 1 of 12");
    if (rc != 0) diag("%s", out);

    rc = rp("stats --shift '%s' '%s' --json", tmp("old.rpt"), tmp("new.rpt"));
    json_error_t je;
    json_t *root = rc == 0 ? json_loads(out, 0, &je) : NULL;
    json_t *sum = json_object_get(root, "summary"), *layers = json_object_get(root, "layers");
    json_t *l0 = json_array_get(layers, 0);
    ok(root && json_integer_value(json_object_get(sum, "changed")) == 1 &&
           json_integer_value(json_object_get(sum, "choices")) == 28 &&
           json_integer_value(json_object_get(l0, "changed")) == 1 &&
           json_integer_value(json_object_get(json_array_get(layers, 1), "changed")) == 0,
       "json: summary and per-layer counts");
    /* old expert of token 4 layer 0 choice 0 is (4*2*2) % 8 = 0: it lost 1, expert 5 gained 1 */
    ok(json_integer_value(json_array_get(json_object_get(l0, "expert_lost"), 0)) == 1 &&
           json_integer_value(json_array_get(json_object_get(l0, "expert_arrived"), 5)) == 1,
       "json: expert 0 lost a choice, expert 5 gained one, at layer 0");
    ok(json_integer_value(json_array_get(json_object_get(root, "seq_changed"), 2)) == 1 &&
           json_integer_value(json_array_get(json_object_get(root, "seq_choices"), 2)) == 12 &&
           json_integer_value(json_array_get(json_object_get(root, "seq_choices"), 1)) == 0,
       "json: per-sequence changed and choices");
    json_decref(root);

    rc = rp("stats --shift '%s' '%s' --json", tmp("old.rpt"), tmp("old.rpt"));
    ok(rc == 0 && strstr(out, "\"changed\": 0"), "the same trace twice: nothing changed");

    write_trace(ctx, tmp("wide.rpt"), old_ids, 16, L);
    rc = rp("stats --shift '%s' '%s'", tmp("old.rpt"), tmp("wide.rpt"));
    ok(rc == 1 && strstr(out, "8 experts") && strstr(out, "16"), "traces of other models are refused: %s", out);
    rc = rp("stats --shift '%s'", tmp("old.rpt"));
    ok(rc == 2 && strstr(out, "needs two traces"), "one trace with --shift is a usage error");
    rc = rp("stats '%s' '%s'", tmp("old.rpt"), tmp("new.rpt"));
    ok(rc == 2 && strstr(out, "need --shift"), "two traces without --shift are a usage error");
    rc = rp("stats --shift '%s' '%s' --step 1", tmp("old.rpt"), tmp("new.rpt"));
    ok(rc == 2 && strstr(out, "--step 1 does not exist"), "a missing step is a usage error");

    temp_dir_remove(tmpdir);
    rp_context_free(ctx);
    return tap_done();
}
