/* Plan JSON: the exact output layout, bit-exact round trips, partial plans, files, the
 * documented example, the invalid-plan suite and allocation failures in the parser. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#define PLANS_DIR RP_SOURCE_DIR "/tests/data/plans/"
#define INVALID_DIR RP_SOURCE_DIR "/tests/data/invalid/plan"

static rp_config *load_config(rp_context *ctx, const char *path)
{
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_load(ctx, path, &cfg, &err) != RP_OK) {
        printf("Bail out! %s\n", err.text);
        exit(1);
    }
    return cfg;
}

static rp_plan *parse(rp_context *ctx, const rp_config *cfg, const char *text, rp_error *err)
{
    rp_plan *p = NULL;
    if (rp_plan_parse(ctx, cfg, text, strlen(text), "inline.json", &p, err) != RP_OK) return NULL;
    return p;
}

/* Serialise, parse back, serialise again: the hash and the text must not change. */
static void round_trip(rp_context *ctx, const rp_config *cfg, const rp_plan *p, const char *name)
{
    char *text = NULL, *again = NULL;
    size_t len = 0, len2 = 0;
    rp_error err;
    rp_plan *q = NULL;
    rp_status st = rp_plan_to_json(p, &text, &len, &err);
    if (st == RP_OK) st = rp_plan_parse(ctx, cfg, text, len, name, &q, &err);
    if (st == RP_OK) st = rp_plan_to_json(q, &again, &len2, &err);
    ok(st == RP_OK && rp_plan_hash(q) == rp_plan_hash(p) && len == len2 && memcmp(text, again, len) == 0 &&
           strlen(text) == len,
       "round trip: %s", name);
    if (st != RP_OK) diag("%s", err.text);
    rp_text_free(ctx, text);
    rp_text_free(ctx, again);
    rp_plan_free(q);
}

static void test_fixture(rp_context *ctx, const rp_config *cfg)
{
    size_t len;
    char *want = slurp(PLANS_DIR "small.json", &len);
    rp_plan *p = NULL;
    rp_error err;
    is_int(rp_plan_load(ctx, cfg, PLANS_DIR "small.json", &p, &err), RP_OK, "load the fixture plan");
    if (!p) {
        diag("%s", err.text);
        free(want);
        return;
    }
    is_int(rp_plan_num_microbatches(p), 2, "microbatches from the file");
    int32_t count;
    const int32_t *mb = rp_plan_microbatch(p, 0, 0, &count);
    ok(count == 2 && mb[0] == 0 && mb[1] == 3, "packing read");
    is_int(rp_plan_phy2log(p, 0)[6], 0, "placement read");
    is_int(rp_plan_num_extra_replicas(p), 1, "extra replica read");
    is_int(rp_plan_num_share_sets(p), 1, "share set read");
    char *text = NULL;
    size_t n = 0;
    is_int(rp_plan_to_json(p, &text, &n, &err), RP_OK, "write it back");
    ok(want && text && n == len && memcmp(text, want, n) == 0, "the writer reproduces the fixture byte for byte");
    if (want && text && (n != len || memcmp(text, want, n) != 0)) diag("wrote:\n%s", text);
    rp_error clean;
    ok(rp_plan_validate(p, cfg, NULL, &clean) == RP_OK, "the fixture is a valid plan");
    rp_text_free(ctx, text);
    rp_plan_free(p);
    free(want);
}

static void test_round_trips(rp_context *ctx, const rp_config *cfg)
{
    rp_plan *p;
    rp_plan_new(ctx, cfg, 3, &p, NULL);
    round_trip(ctx, cfg, p, "an empty plan");
    rp_plan_set_contiguous(p, NULL);
    round_trip(ctx, cfg, p, "placement only");
    int32_t a[3] = {5, 2, 5}, b[1] = {0};
    const int32_t *lists[12] = {a, NULL, NULL, NULL, b};
    int32_t counts[12] = {3, 0, 0, 0, 1};
    rp_plan_set_microbatches(p, 7, lists, counts, NULL);
    round_trip(ctx, cfg, p, "repeated and missing sequences kept verbatim");
    rp_plan_add_extra_replica(p, 2, 1, 4, 0, NULL);
    rp_plan_add_extra_replica(p, 0, 1, 4, 3, NULL);
    rp_plan_add_extra_replica(p, 2, 1, 4, 1, NULL);
    /* shares whose decimal forms are hard: 0.1, 1/3, -0, the smallest subnormal, huge */
    rp_plan_set_shares(p, 0, 0, 1, (double[]){0.1, 1.0 / 3.0, -0.0, 5e-324, 1.7976931348623157e308}, 5, NULL);
    rp_plan_set_shares(p, 2, 1, 4, (double[]){1, 0, 2.5e-7}, 3, NULL);
    rp_plan_set_shares(p, 1, 0, 0, NULL, 0, NULL);
    round_trip(ctx, cfg, p, "levers with awkward doubles keep their bits");

    rp_plan *q;
    rp_plan_new(ctx, cfg, 1, &q, NULL);
    rp_plan_set_packing(q, 0, NULL, NULL, NULL);
    round_trip(ctx, cfg, q, "an empty packing of no sequences");
    rp_plan_free(q);

    /* a microbatch order and nothing after num_experts (nor before it): found by
     * fuzz_plan, num_experts was written as the last member, without its comma */
    rp_plan_new(ctx, cfg, 2, &q, NULL);
    for (int32_t r = 0; r < rp_plan_num_gpus(q); r++) rp_plan_set_microbatch_order(q, r, (int32_t[]){1, 0}, NULL);
    round_trip(ctx, cfg, q, "a microbatch order alone");
    rp_plan_set_balancing(q, RP_BALANCING_VIRTUAL_EXPERTS, NULL);
    round_trip(ctx, cfg, q, "a microbatch order and per-forward balancing alone");
    rp_plan_free(q);

    /* a plan on the bigger example config */
    rp_config *small = load_config(ctx, RP_SOURCE_DIR "/examples/config-small.json");
    rp_plan_new(ctx, small, 4, &q, NULL);
    rp_plan_set_contiguous(q, NULL);
    int32_t rank[500], mbs[500];
    uint32_t seed = 7;
    for (int s = 0; s < 500; s++) {
        seed = seed * 1103515245u + 12345u;
        rank[s] = (int32_t)((seed >> 16) % 8);
        mbs[s] = (int32_t)((seed >> 8) % 4);
    }
    rp_plan_set_packing(q, 500, rank, mbs, NULL);
    for (int l = 0; l < 16; l++) {
        int32_t extra[80];
        memcpy(extra, rp_plan_phy2log(q, l), sizeof extra);
        for (int j = 0; j < 8; j++) extra[j * 10 + 8] = (l * 7 + j * 3) % 64;
        rp_plan_set_phy2log(q, l, extra, NULL);
    }
    round_trip(ctx, small, q, "500 sequences, 16 layers of 64 experts with replicas");
    rp_plan_free(q);
    rp_config_free(small);

    /* the text itself */
    char *text;
    size_t len;
    rp_plan_to_json(p, &text, &len, NULL);
    like(text, "\"num_seqs\": 7,\n  \"packing\": [\n    [[5, 2, 5], [], []],\n", "one rank per line");
    like(text, "{\"microbatch\": 0, \"layer\": 1, \"expert\": 4, \"ep_rank\": 3},\n", "extras sorted, one a line");
    like(text, "\"shares\": [0.10000000000000001, 0.33333333333333331, -0.0, 4.9406564584124654e-324, "
               "1.7976931348623157e308]",
         "shares written with 17 significant digits");
    rp_text_free(ctx, text);

    rp_plan_set_shares(p, 0, 0, 2, (double[]){NAN}, 1, NULL);
    rp_error err;
    is_int(rp_plan_to_json(p, &text, &len, &err), RP_EINVAL, "a NaN share cannot be written");
    is_str(err.text, "plan: mb 0 layer 0 expert 2 share 0 is nan, which JSON cannot hold", "NaN share message");
    rp_plan_free(p);
}

static void test_inferred(rp_context *ctx, const rp_config *cfg)
{
    rp_error err;
    rp_plan *p = parse(ctx, cfg,
                       "{\"format\": \"routepack-plan\", \"version\": 1, \"num_seqs\": 2,\n"
                       " \"packing\": [[[0], [], []], [[1], [], []], [[], [], []], [[], [], []]]}",
                       &err);
    ok(p != NULL, "shape keys may be left out");
    if (p) {
        is_int(rp_plan_num_microbatches(p), 3, "microbatch count from the packing");
        ok(!rp_plan_has_placement(p), "no placement given, none made");
    }
    rp_plan_free(p);
    p = parse(ctx, cfg,
              "{\"format\": \"routepack-plan\", \"version\": 1,\n"
              " \"placement\": [[[0, 1, 2], [3, 4], [5]], [[5, 4, 3], [2, 1], [0], [-1, 1]]]}",
              &err);
    ok(p == NULL, "a layer with 3 EP ranks of 4 rejected");
    like(err.text, "inline.json:2:16: placement[0] has 3 EP ranks, but ep_size is 4", "EP rank count message");
    p = parse(ctx, cfg,
              "{\"format\": \"routepack-plan\", \"version\": 1,\n"
              " \"placement\": [[[0, 1, 2], [3, 4], [5], []], [[5, 4, 3], [2, 1], [0], [-1, 1]]]}",
              &err);
    ok(p != NULL, "placement only, short rank lists");
    if (p) {
        is_int(rp_plan_num_microbatches(p), 1, "one microbatch when neither packing nor config says");
        const int32_t *l0 = rp_plan_phy2log(p, 0), *l1 = rp_plan_phy2log(p, 1);
        ok(l0[5] == 5 && l0[6] == -1 && l0[9] == -1 && l1[8] == -1 && l1[9] == 1, "short lists end in empty slots");
        ok(!rp_plan_has_packing(p), "no packing given, none made");
    }
    rp_plan_free(p);
    rp_config *fixed = NULL;
    const char *fixed_json =
        "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 4, \"slots_per_gpu\": [3, 2, 3, 2]},"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 6, \"top_k\": 2, \"hidden_size\": 64,"
        " \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
        " \"limits\": {\"max_tokens_per_microbatch\": 100, \"num_microbatches\": 5}}";
    rp_config_parse(ctx, fixed_json, strlen(fixed_json), "<fixed>", &fixed, NULL);
    p = parse(ctx, fixed, "{\"format\": \"routepack-plan\", \"version\": 1}", &err);
    ok(p && rp_plan_num_microbatches(p) == 5, "without a packing the config's microbatch count applies");
    rp_plan_free(p);
    rp_config_free(fixed);
}

static void test_files(rp_context *ctx, const rp_config *cfg)
{
    char dir[64];
    if (!temp_dir_make(dir, sizeof dir, "plan-json")) {
        skip(4, "no temporary directory");
        return;
    }
    char path[256];
    snprintf(path, sizeof path, "%s/plan.json", dir);
    rp_plan *p, *q = NULL;
    rp_error err;
    rp_plan_new(ctx, cfg, 2, &p, NULL);
    rp_plan_set_contiguous(p, NULL);
    rp_plan_set_packing(p, 3, (int32_t[]){0, 3, 1}, (int32_t[]){1, 0, 1}, NULL);
    is_int(rp_plan_save(p, path, &err), RP_OK, "save a plan");
    is_int(rp_plan_load(ctx, cfg, path, &q, &err), RP_OK, "load it back");
    ok(q && rp_plan_hash(q) == rp_plan_hash(p), "saved and loaded plans hash equal");
    rp_plan_free(q);
    unlink(path);
    is_int(rp_plan_load(ctx, cfg, path, &q, &err), RP_EIO, "a missing file");
    like(err.text, "plan.json: cannot open", "missing file message");
    snprintf(path, sizeof path, "%s/no/such/dir/plan.json", dir);
    is_int(rp_plan_save(p, path, &err), RP_EIO, "save into a missing directory");
    like(err.text, "cannot open for writing", "save error message");
    rp_plan_free(p);
    temp_dir_remove(dir);
}

/* The text of the first ```json block after `marker` in a Markdown file (malloc'd). */
static char *doc_block(const char *doc, const char *marker)
{
    const char *m = strstr(doc, marker);
    if (!m) return NULL;
    const char *start = strstr(m, "```json\n");
    if (!start) return NULL;
    start += 8;
    const char *end = strstr(start, "```");
    if (!end) return NULL;
    char *block = malloc((size_t)(end - start) + 1);
    memcpy(block, start, (size_t)(end - start));
    block[end - start] = '\0';
    return block;
}

/* The example in the plan format documentation (docs/formats.md) parses against its
 * config, is valid, and is exactly what the writer produces. */
static void test_doc_example(rp_context *ctx)
{
    const char *docs[1] = {RP_SOURCE_DIR "/docs/formats.md"};
    int found = 0;
    for (int i = 0; i < 1; i++) {
        char *doc = slurp(docs[i], NULL);
        if (!doc) continue;
        char *cfg_text = doc_block(doc, "<!-- plan example config -->");
        char *plan_text = doc_block(doc, "<!-- plan example -->");
        if (cfg_text && plan_text) {
            found++;
            rp_config *cfg = NULL;
            rp_plan *p = NULL;
            rp_error err;
            rp_status st = rp_config_parse(ctx, cfg_text, strlen(cfg_text), "doc config", &cfg, &err);
            if (st == RP_OK) st = rp_plan_parse(ctx, cfg, plan_text, strlen(plan_text), "doc plan", &p, &err);
            if (st == RP_OK) st = rp_plan_validate(p, cfg, NULL, &err);
            ok(st == RP_OK, "the documented example plan parses and is valid (%s)", docs[i]);
            if (st != RP_OK) diag("%s", err.text);
            char *text = NULL;
            size_t len;
            if (p && rp_plan_to_json(p, &text, &len, &err) == RP_OK) {
                ok(strcmp(text, plan_text) == 0, "the documented example is the writer's exact output");
                if (strcmp(text, plan_text) != 0) diag("writer:\n%s", text);
            } else {
                ok(0, "the documented example is the writer's exact output");
            }
            rp_text_free(ctx, text);
            rp_plan_free(p);
            rp_config_free(cfg);
        }
        free(cfg_text);
        free(plan_text);
        free(doc);
    }
    ok(found > 0, "the plan format documentation has its example");
}

/* Every tests/data/invalid/plan/NAME.json fails to load with a message containing
 * the text of NAME.expect (first line). */
static void test_invalid(rp_context *ctx, const rp_config *cfg)
{
    DIR *d = opendir(INVALID_DIR);
    if (!d) {
        ok(0, "open %s", INVALID_DIR);
        return;
    }
    char names[128][128];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 128) {
        size_t len = strlen(e->d_name);
        if (len > 5 && len < 120 && strcmp(e->d_name + len - 5, ".json") == 0) {
            memcpy(names[n], e->d_name, len - 5);
            names[n++][len - 5] = '\0';
        }
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    ok(n >= 8, "the invalid-plan suite has its cases (%d)", n);
    for (int i = 0; i < n; i++) {
        char path[1024], expect_path[1024];
        snprintf(path, sizeof path, "%s/%.120s.json", INVALID_DIR, names[i]);
        snprintf(expect_path, sizeof expect_path, "%s/%.120s.expect", INVALID_DIR, names[i]);
        char *expect = slurp(expect_path, NULL);
        if (!expect) {
            ok(0, "%s has a .expect file", names[i]);
            continue;
        }
        char *nl = strchr(expect, '\n');
        if (nl) *nl = '\0';
        rp_plan *p = NULL;
        rp_error err;
        rp_error_clear(&err);
        rp_status st = rp_plan_load(ctx, cfg, path, &p, &err);
        ok(st != RP_OK && p == NULL && strstr(err.text, expect) != NULL && err.line > 0 && err.column > 0,
           "invalid plan %s: %s", names[i], expect);
        if (st == RP_OK || !strstr(err.text, expect)) diag("got: %s", err.text);
        rp_plan_free(p);
        free(expect);
    }
}

static void test_alloc_failures(void)
{
    size_t len;
    char *text = slurp(PLANS_DIR "small.json", &len);
    char *cfg_text = slurp(PLANS_DIR "config.json", NULL);
    bool clean = text && cfg_text, parsed = false;
    for (long n = 1; n < 1000 && clean && !parsed; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        rp_config *cfg = NULL;
        rp_config_parse(ctx, cfg_text, strlen(cfg_text), "config.json", &cfg, NULL);
        long live = c.live;
        c.fail_at = c.calls + n;
        rp_plan *p = NULL;
        rp_error err;
        rp_status st = rp_plan_parse(ctx, cfg, text, len, "small.json", &p, &err);
        if (st == RP_OK) {
            parsed = true;
            /* the writer, too, under the same sweep */
            for (long k = 1; k < 100; k++) {
                char *out = NULL;
                size_t out_len;
                c.fail_at = c.calls + k;
                rp_status w = rp_plan_to_json(p, &out, &out_len, NULL);
                c.fail_at = 0;
                rp_text_free(ctx, out);
                if (w == RP_OK) break;
                if (w != RP_ENOMEM) clean = false;
            }
            rp_plan_free(p);
        } else if (st != RP_ENOMEM || p != NULL || c.live != live) {
            diag("allocation %ld: status %d, %s", n, st, err.text);
            clean = false;
        }
        c.fail_at = 0;
        rp_config_free(cfg);
        rp_context_free(ctx);
        if (c.live != 0) clean = false;
    }
    ok(clean && parsed, "parse and write fail cleanly at every allocation and leak nothing");
    free(text);
    free(cfg_text);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    rp_config *cfg = load_config(ctx, PLANS_DIR "config.json");
    test_fixture(ctx, cfg);
    test_round_trips(ctx, cfg);
    test_inferred(ctx, cfg);
    test_files(ctx, cfg);
    test_doc_example(ctx);
    test_invalid(ctx, cfg);
    test_alloc_failures();
    rp_config_free(cfg);
    rp_context_free(ctx);
    return tap_done();
}
