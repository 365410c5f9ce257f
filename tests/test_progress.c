/* Progress inside one huge step. The library's progress hook (rp_context_set_progress):
 * the trace writer reports the bytes of a step's payload written, rp_trace_open and
 * rp_trace_validate the payload bytes read, in order, ending at the total. The tool's
 * line on stderr (core/cli/progress.c): `trace import` of one step larger than the
 * writer's 4 MB chunk redraws its line inside the step (ids checked, then bytes written,
 * with rate and ETA), `trace validate` while it reads; nothing when stderr is not a
 * terminal or with --quiet. RP_PROGRESS_TERMINAL forces the terminal decision, so the
 * test reads the lines through a pipe; RP_PROGRESS_AFTER_S / _EVERY_S = 0 draw every
 * update, so no check depends on the clock. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char tmpdir[64];
static char out[1 << 20];

static const char *tmp(const char *name) { return temp_path(tmpdir, name); }
#define rp(...) run_routepack(out, sizeof out, __VA_ARGS__)

/* ---- the library's hook ---- */

typedef struct pass_log {
    char what[32];
    int calls;
    bool ordered;  /* done never decreased, total never changed */
    int64_t first_done, last_done, total;
} pass_log;

typedef struct hook_log {
    pass_log pass[8];
    int num_passes;
} hook_log;

static void record(void *ud, const char *what, int64_t done, int64_t total)
{
    hook_log *h = ud;
    pass_log *p = h->num_passes ? &h->pass[h->num_passes - 1] : NULL;
    if (!p || strcmp(p->what, what) != 0 || done < p->last_done) {
        if (h->num_passes == 8) return;
        p = &h->pass[h->num_passes++];
        snprintf(p->what, sizeof p->what, "%s", what);
        p->ordered = true;
        p->first_done = done;
        p->total = total;
    }
    p->ordered &= done >= p->last_done && total == p->total;
    p->last_done = done;
    p->calls++;
}

/* A step of 2 sequences and `tokens` tokens, 64 layers, top-8, 1-byte ids (ids_bytes =
 * tokens * 512), written with the hook on; then read back with it. */
static void test_hook(void)
{
    enum { LAYERS = 64, K = 8, TOKENS = 20000 }; /* 10.24 MB of ids: three 4 MB chunks */
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    hook_log log;
    memset(&log, 0, sizeof log);
    rp_context_set_progress(ctx, record, &log);
    int32_t prompt[2] = {100, 200}, response[2] = {9700, TOKENS - 10000};
    rp_batch *b = NULL;
    rp_error err;
    rp_batch_new(ctx, 2, prompt, response, NULL, &b, &err);
    size_t n = (size_t)TOKENS * LAYERS * K;
    uint8_t *ids = malloc(n);
    for (size_t i = 0; i < n; i++) ids[i] = (uint8_t)(i * 7 % 64);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, LAYERS, K, ids);
    rp_trace_writer *w = NULL;
    const char *path = tmp("hook.rpt");
    ok(rp_trace_writer_open(ctx, path, 64, &w, &err) == RP_OK, "writer opens");
    ok(rp_trace_writer_append(w, 0, b, &r, &err) == RP_OK, "a 10 MB step is written (%s)", err.text);
    rp_trace_writer_close(w, &err);
    is_int(log.num_passes, 1, "one pass reported while writing");
    rp_trace *t = NULL;
    int64_t payload = 0;
    if (rp_trace_open(ctx, path, RP_TRACE_NO_VERIFY, &t, &err) == RP_OK) {
        payload = rp_trace_step(t, 0)->payload_bytes;
        rp_trace_close(t);
    }
    is_int(log.num_passes, 1, "opening without the checksum pass reports nothing");
    pass_log *p = &log.pass[0];
    is_str(p->what, "writing", "the writer's pass is 'writing'");
    ok(p->calls >= 3, "it is reported inside the step, chunk by chunk (%d calls)", p->calls);
    ok(p->ordered, "done never decreases and the total stays");
    ok(p->first_done < p->total, "the first report comes before the step is written (%lld of %lld)",
       (long long)p->first_done, (long long)p->total);
    ok(p->last_done == p->total && p->total == payload,
       "it ends at done == total == the step's payload_bytes (%lld, %lld, %lld)", (long long)p->last_done,
       (long long)p->total, (long long)payload);

    memset(&log, 0, sizeof log);
    ok(rp_trace_open(ctx, path, 0, &t, &err) == RP_OK, "open with the checksum pass");
    ok(t && rp_trace_validate(t, &err) == RP_OK, "validate");
    rp_trace_close(t);
    is_int(log.num_passes, 2, "two passes reported: the checksums at open, then validation");
    is_str(log.pass[0].what, "verifying", "open's pass is 'verifying'");
    is_str(log.pass[1].what, "validating", "validate's pass is 'validating'");
    for (int i = 0; i < 2; i++)
        ok(log.pass[i].ordered && log.pass[i].last_done == payload && log.pass[i].total == payload,
           "%s: in order, ends at the payload bytes (%lld of %lld)", log.pass[i].what,
           (long long)log.pass[i].last_done, (long long)log.pass[i].total);

    /* no hook: nothing is called (the default), and the hook can be removed */
    rp_context_set_progress(ctx, NULL, NULL);
    memset(&log, 0, sizeof log);
    ok(rp_trace_open(ctx, path, 0, &t, &err) == RP_OK, "open with the hook removed");
    rp_trace_close(t);
    is_int(log.num_passes, 0, "a removed hook is not called");

    /* an empty step still ends its pass at done == total */
    rp_context_set_progress(ctx, record, &log);
    rp_batch *empty = NULL;
    int32_t zero[1] = {0};
    rp_batch_new(ctx, 1, zero, zero, NULL, &empty, &err);
    ok(rp_trace_writer_open(ctx, tmp("empty.rpt"), 64, &w, &err) == RP_OK &&
       rp_trace_writer_append(w, 0, empty, &r, &err) == RP_OK, "an empty step is written");
    rp_trace_writer_close(w, &err);
    ok(log.num_passes == 1 && log.pass[0].last_done == log.pass[0].total,
       "its pass ends at done == total (%lld of %lld)", (long long)log.pass[0].last_done,
       (long long)log.pass[0].total);
    rp_batch_free(empty);
    free(ids);
    rp_batch_free(b);
    rp_context_free(ctx);
}

/* ---- the tool's line ---- */

static double unit_bytes(const char *unit)
{
    return !strcmp(unit, "GB") ? 1e9 : !strcmp(unit, "MB") ? 1e6 : !strcmp(unit, "KB") ? 1e3 : 1;
}

/* The redraws of `prefix` (ending ", ", before the bytes) in out: how many, how many had
 * `detail`, whether their byte counts never decreased; the last count in *last_bytes. */
static int redraws(const char *prefix, const char *detail, int *with_detail, bool *ordered, double *last_bytes)
{
    char start[128];
    snprintf(start, sizeof start, "\r\033[K%s", prefix);
    int n = 0;
    double prev = -1;
    *with_detail = 0;
    *ordered = true;
    *last_bytes = 0;
    for (const char *p = strstr(out, start); p; p = strstr(p + 1, start)) {
        n++;
        const char *end = strchr(p + 1, '\r');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), p);
        if (detail && strstr(line, detail)) (*with_detail)++;
        double v; /* the prefix ends with ", ": the bytes follow */
        char unit[8];
        if (sscanf(line + strlen(start), "%lf %7s", &v, unit) == 2) {
            v *= unit_bytes(unit);
            *ordered &= v >= prev;
            prev = v;
            *last_bytes = v;
        }
    }
    return n;
}

/* One step of 40000 tokens x 64 layers x top-8 as uint16 (41 MB read, 20.5 MB written:
 * the check reads the input in 16 MB blocks, the writer writes 4 MB chunks). */
static void test_import_line(void)
{
    enum { TOKENS = 40000, LAYERS = 64, K = 8 };
    size_t n = (size_t)TOKENS * LAYERS * K;
    uint16_t *ids = malloc(n * sizeof *ids);
    for (size_t i = 0; i < n; i++) ids[i] = (uint16_t)(i * 7 % 64);
    int64_t shape[3] = {TOKENS, LAYERS, K}, one[1] = {4};
    int32_t lens[4] = {10000, 10000, 10000, 10000};
    rp_error err;
    rp_npy_write(tmp("r.npy"), RP_NPY_U16, 3, shape, ids, &err);
    rp_npy_write(tmp("l.npy"), RP_NPY_I32, 1, one, lens, &err);
    free(ids);

    setenv("RP_PROGRESS_AFTER_S", "0", 1);
    setenv("RP_PROGRESS_EVERY_S", "0", 1);
    setenv("RP_PROGRESS_TERMINAL", "1", 1);
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("r.npy"), tmp("l.npy"),
              tmp("a.rpt")), 0, "import of one 41 MB step on a (forced) terminal");
    int checking = 0, writing = 0;
    bool ordered;
    double last;
    int lines = redraws("trace import: step 0/1, ", "checking ids", &checking, &ordered, &last);
    redraws("trace import: step 0/1, ", "writing", &writing, &ordered, &last);
    ok(checking >= 2, "the line moves while the ids of the one step are checked (%d redraws)", checking);
    ok(writing >= 4, "and while they are written, chunk by chunk (%d redraws)", writing);
    ok(lines == checking + writing, "every redraw inside the step says which (%d of %d)", checking + writing, lines);
    ok(ordered, "the byte count never goes back");
    double total = 2.0 * n + (double)n; /* read as uint16, written as 1-byte ids */
    ok(last > 0.99 * total && last < 1.01 * total, "it ends at the bytes read and written (%.0f of ~%.0f)",
       last, total);
    like(out, " of ~61.4 MB, ", "the total is the bytes read and written");
    like(out, "/s, ETA ", "with rate and ETA");
    like(out, "trace import: step 1/1", "and the step count when it is done");
    const char *erase = NULL;
    for (const char *q = strstr(out, "\r\033[K"); q; q = strstr(q + 1, "\r\033[K")) erase = q;
    ok(erase && strncmp(erase + 4, "trace import", 12) != 0, "the last thing drawn erases the line");
    int64_t size_a = file_size(tmp("a.rpt"));

    /* validate reads the trace twice (checksums, then ids): both passes on the line */
    is_int(rp("trace validate %s", tmp("a.rpt")), 0, "validate on a (forced) terminal");
    int verifying = 0, validating = 0;
    char prefix[512];
    snprintf(prefix, sizeof prefix, "%s, ", tmp("a.rpt"));
    redraws(prefix, "verifying", &verifying, &ordered, &last);
    redraws(prefix, "validating", &validating, &ordered, &last);
    ok(verifying >= 1 && validating >= 1, "validate: 'verifying' (%d) and 'validating' (%d) redraws", verifying,
       validating);
    ok(last > 0.99 * (double)size_a && last < 1.01 * (double)size_a,
       "it ends at the trace's payload bytes (%.0f as printed, file %lld)", last, (long long)size_a);

    /* not a terminal: nothing; --quiet: nothing */
    setenv("RP_PROGRESS_TERMINAL", "0", 1);
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("r.npy"), tmp("l.npy"),
              tmp("b.rpt")), 0, "import when stderr is not a terminal");
    ok(!strchr(out, '\033') && !strstr(out, "trace import: step"), "no progress line at all");
    is_int(rp("trace validate %s", tmp("a.rpt")), 0, "validate when stderr is not a terminal");
    ok(!strchr(out, '\033') && !strstr(out, "verifying"), "no progress line at all");
    setenv("RP_PROGRESS_TERMINAL", "1", 1);
    is_int(rp("trace import --quiet --routing %s --lens %s --experts 64 --out %s", tmp("r.npy"), tmp("l.npy"),
              tmp("c.rpt")), 0, "import --quiet on a (forced) terminal");
    ok(!strchr(out, '\033') && !strstr(out, "trace import: step"), "--quiet: no progress line");
    ok(file_size(tmp("b.rpt")) == size_a && file_size(tmp("c.rpt")) == size_a, "the same trace every time");

    /* trace gen: the writer's hook redraws the line inside a step as well */
    is_int(rp("trace gen %s/examples/gen-small.json --steps 2 --out %s", RP_SOURCE_DIR, tmp("g.rpt")), 0,
           "trace gen on a (forced) terminal");
    ok(redraws("trace gen: step 0/2, ", "writing", &writing, &ordered, &last) >= 1 && writing >= 1,
       "trace gen: step 0's bytes move the line while it is written (%d redraws)", writing);
    unsetenv("RP_PROGRESS_TERMINAL");
    unsetenv("RP_PROGRESS_AFTER_S");
    unsetenv("RP_PROGRESS_EVERY_S");
    /* without the variable isatty decides: rp() gives the tool a pipe */
    setenv("RP_PROGRESS_AFTER_S", "0", 1);
    is_int(rp("trace validate %s", tmp("a.rpt")), 0, "validate with the terminal decided by isatty");
    ok(!strchr(out, '\033'), "a pipe gets no progress line");
    unsetenv("RP_PROGRESS_AFTER_S");
}

int main(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "progress")) {
        printf("Bail out! mkdtemp failed\n");
        return 1;
    }
    test_hook();
    if (access(RP_BINARY_DIR "/routepack", X_OK) == 0) test_import_line();
    else ok(0, "the routepack binary exists (build the routepack_cli target)");
    temp_dir_remove(tmpdir);
    return tap_done();
}
