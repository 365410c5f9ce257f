/* Every tested example of docs/policies.md runs: a ```lua block after a
 * `<!-- test: policy -->` line is loaded as a policy and planned for two steps of the
 * bundled example batch without falling back; one after `<!-- test: sandbox -->` runs as a
 * chunk in a fresh sandbox. */
#include "routepack/routepack.h"
#include "sandbox.h"
#include "tap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static rp_context *ctx;
static rp_config *cfg;
static rp_batch *batches[2];
static rp_routing routings[2];
static void *ids[2];
static char tmp[256];

static void run_policy(int index, const char *code, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/example%d.lua", tmp, index);
    FILE *f = fopen(path, "w");
    fwrite(code, 1, len, f);
    fclose(f);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = path;
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    bool pass = rp_sched_new(ctx, cfg, &o, &s, &err) == RP_OK;
    if (!pass) diag("load: %s", err.text);
    for (int t = 0; pass && t < 2; t++) {
        const rp_plan *plan;
        const rp_step_report *rep;
        if (rp_sched_step(s, t, batches[t], &routings[t], &plan, &rep, &err) != RP_OK) {
            diag("step %d: %s", t, err.text);
            pass = false;
        } else if (rep->fallback) {
            diag("step %d fell back: %s", t, rep->fallback_reason);
            pass = false;
        }
    }
    ok(pass, "docs/policies.md policy example %d loads and plans two steps without falling back", index);
    rp_sched_free(s);
}

static void run_chunk(int index, const char *code, size_t len)
{
    rp_sandbox *sb = NULL;
    rp_error err;
    bool pass = rp_sandbox_new(ctx, NULL, &sb, &err) == RP_OK;
    if (pass && rp_sandbox_load_text(sb, code, len, "example.lua", &err) != RP_OK) {
        diag("%s", err.text);
        pass = false;
    }
    ok(pass, "docs/policies.md sandbox example %d runs", index);
    rp_sandbox_free(sb);
}

int main(void)
{
    rp_error err;
    rp_context_new(NULL, NULL, &ctx);
    rp_gen *gen = NULL;
    char *doc = NULL;
    size_t len = 0;
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK ||
        rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK ||
        rp_read_file(ctx, RP_SOURCE_DIR "/docs/policies.md", &doc, &len, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    for (int t = 0; t < 2; t++) {
        rp_routing r;
        if (rp_gen_step(gen, t, &batches[t], &r, &err) != RP_OK) return 1;
        size_t n = (size_t)rp_batch_num_tokens(batches[t]) * (size_t)r.num_layers * (size_t)r.top_k * (size_t)r.width;
        ids[t] = malloc(n);
        memcpy(ids[t], r.base, n);
        rp_routing_packed(&routings[t], r.width, r.num_layers, r.top_k, ids[t]);
    }
    rp_gen_free(gen);
    snprintf(tmp, sizeof tmp, "/tmp/rp_test_policy_docs_XXXXXX");
    if (!mkdtemp(tmp)) return 1;
    unsetenv("RP_POLICY_PATH");

    int policies = 0, chunks = 0, untested = 0;
    const char *p = doc;
    const char *marker = NULL;
    while ((p = strstr(p, "```lua\n")) != NULL) {
        /* the marker must be on the line right before the fence */
        const char *line = p;
        const char *prev_end = line > doc ? line - 1 : doc;
        const char *prev = prev_end;
        while (prev > doc && prev[-1] != '\n') prev--;
        marker = NULL;
        if (prev < prev_end) {
            size_t n = (size_t)(prev_end - prev);
            if (n >= 21 && strncmp(prev, "<!-- test: policy -->", 21) == 0) marker = "policy";
            else if (n >= 22 && strncmp(prev, "<!-- test: sandbox -->", 22) == 0) marker = "sandbox";
        }
        const char *code = p + 7;
        const char *end = strstr(code, "```");
        if (!end) break;
        if (!marker) untested++;
        else if (strcmp(marker, "policy") == 0) run_policy(++policies, code, (size_t)(end - code));
        else run_chunk(++chunks, code, (size_t)(end - code));
        p = end + 3;
    }
    ok(policies >= 3, "docs/policies.md has its policy examples (%d)", policies);
    ok(chunks >= 2, "docs/policies.md has its sandbox examples (%d)", chunks);
    is_int(untested, 0, "every lua block is marked as tested");

    for (int t = 0; t < 2; t++) {
        rp_batch_free(batches[t]);
        free(ids[t]);
    }
    rp_free(ctx, doc);
    rp_config_free(cfg);
    rp_context_free(ctx);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) diag("could not remove %s", tmp);
    return tap_done();
}
