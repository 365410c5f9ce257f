/* A config's "calibration": the file a fake device run wrote (tests/data/calibration/
 * fake.json, python -m routepack.calibrate --fake) fills the hardware keys the config
 * leaves out, checked field by field and through the cost model against hand-computed
 * values; explicit keys win; every kind of bad file is refused with a message naming
 * the file (and the shape key and the shapes it has); allocation failures are clean. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#define CAL_DIR RP_SOURCE_DIR "/tests/data/calibration/"
#define PEAK 989e12

static rp_context *ctx;

/* A test that cannot set itself up stops, as TAP's "Bail out!" says. */
#define BAIL_OUT(...)                                                                              \
    do {                                                                                           \
        printf("Bail out! ");                                                                      \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        exit(1);                                                                                   \
    } while (0)

static const rp_hardware *load(const char *path, rp_config **cfg, rp_status *st, rp_error *err)
{
    *cfg = NULL;
    *st = rp_config_load(ctx, path, cfg, err);
    return *st == RP_OK ? rp_config_hardware(*cfg) : NULL;
}

/* A curve at x as the config documents it: linear between points, flat beyond the ends. */
static double curve_at(const rp_eff_point *p, int32_t k, double x)
{
    if (x <= p[0].tokens) return p[0].efficiency;
    for (int32_t i = 1; i < k; i++)
        if (x <= p[i].tokens)
            return p[i - 1].efficiency +
                   (p[i].efficiency - p[i - 1].efficiency) * (x - p[i - 1].tokens) / (p[i].tokens - p[i - 1].tokens);
    return p[k - 1].efficiency;
}

static void test_fake_device_figures(void)
{
    rp_config *cfg;
    rp_status st;
    rp_error err;
    const rp_hardware *h = load(CAL_DIR "config-small.json", &cfg, &st, &err);
    is_int(st, RP_OK, "the config with the fake calibration loads");
    if (!h) {
        diag("%s", err.text);
        skip(26, "not loaded");
        return;
    }
    /* fake device: GEMM at 0.8 n / (n + 256), attention at 0.7 L / (L + 2048) */
    is_int(h->num_gemm_efficiency, 11, "gemm curve: the 11 measured token counts");
    is_double(h->gemm_efficiency[0].tokens, 1, 0, "gemm curve starts at 1 token");
    is_double(h->gemm_efficiency[0].efficiency, 0.003113, 0, "eff(1) = 0.8 / 257 to 6 digits");
    is_double(h->gemm_efficiency[5].tokens, 256, 0, "point 5 is 256 tokens");
    is_double(h->gemm_efficiency[5].efficiency, 0.4, 0, "eff(256) = 0.8 x 256 / 512");
    is_double(h->gemm_efficiency[10].tokens, 8192, 0, "last point 8192 tokens");
    is_int(h->num_attention_efficiency, 7, "attention curve: 512 .. 32768");
    is_double(h->attention_efficiency[2].tokens, 2048, 0, "attention point 2 is length 2048");
    is_double(h->attention_efficiency[2].efficiency, 0.35, 0, "attention eff(2048) = 0.7 x 2048 / 4096");
    is_double(h->dense_efficiency, 0.6, 0, "dense_efficiency: the config's 0.6 wins over the file's 0.75");
    is_double(h->backward.attention, 3.0, 0, "backward.attention: the config's 3.0 wins over the file's 2.5");
    is_double(h->backward.projections, 2.0, 0, "backward.projections from the file");
    is_double(h->backward.experts, 2.25, 0, "backward.experts from the file");
    is_double(h->backward.communication, 1.0, 0, "backward.communication keeps its default");
    is_double(h->hbm_bytes_per_s, 4e12, 0, "hbm_bytes_per_s from the file");
    is_double(h->layer_fixed_s, 40e-6, 1e-18, "layer_fixed_us 40 from the file");
    is_double(h->peak_flops, PEAK, 0, "peak_flops is the config's (the file's matches)");
    /* the grouped GEMM's figures: the fake device loops over its experts, so its tile is 1 */
    is_int(h->gemm_tile_rows, 1, "gemm_tile_rows 1 from the file");
    ok(h->num_grouped_gemm_efficiency > 0 && h->grouped_gemm_efficiency[0].tokens == 8 &&
           h->grouped_gemm_efficiency[0].efficiency == 0.003113,
       "grouped_gemm_efficiency from the file: its first point, 8 experts x 1 row, at eff(1)");
    ok(h->num_wgrad_efficiency == 7 && h->wgrad_efficiency[4].tokens == 256 && h->wgrad_efficiency[4].efficiency == 0.4,
       "wgrad_efficiency from the file: 0.6 n / (n + 128) at 256 rows = 0.4");
    is_double(h->backward_experts_dgrad, 1.05, 0, "backward.experts_dgrad from the file");

    /* the cost model with them, by hand: small model d 2048, f 1024, 16 heads of 128 */
    int32_t lens[1] = {2048}, zero[1] = {0};
    uint8_t *ids = calloc((size_t)2048 * 16 * 8, 1);
    for (int i = 0; i < 2048 * 16 * 8; i++) ids[i] = (uint8_t)(i % 64);
    rp_batch *b = NULL;
    rp_routing r;
    rp_stats *stats = NULL;
    rp_cost *c = NULL;
    rp_batch_new(ctx, 1, lens, zero, NULL, &b, &err);
    rp_routing_packed(&r, RP_ID_U8, 16, 8, ids);
    rp_stats_compute(ctx, b, &r, 64, 1, &stats, &err);
    if (rp_cost_new(ctx, cfg, b, stats, RP_SPLIT_EVEN, &c, &err) != RP_OK) {
        diag("%s", err.text);
        skip(4, "no evaluator");
    } else {
        /* routepack_torch's grouped GEMM with the file's figures, one expert alone: tile 1;
         * forward 6 n d f / (peak g(n)), g the grouped curve at its n rows; weight gradient
         * 6 n d f / (peak w(n)), at least the write of dW (3 d f x 4 B / 4e12 B/s = 6.3 us);
         * ((1 + 1.05) forward + weight gradient) / (1 + 2.25) */
        double d = 2048, f = 1024;
        const rp_hardware *hw = rp_config_hardware(cfg);
        const double dw = 3 * d * f * 4 / 4e12;
        const double ns[3] = {256, 768, 1};
        for (int i = 0; i < 3; i++) {
            const double n = ns[i];
            double fwd = 6 * n * d * f / (PEAK * curve_at(hw->grouped_gemm_efficiency, hw->num_grouped_gemm_efficiency, n));
            double w = 6 * n * d * f / (PEAK * curve_at(hw->wgrad_efficiency, hw->num_wgrad_efficiency, n));
            double want = (2.05 * fwd + (w > dw ? w : dw)) / 3.25;
            is_double(rp_cost_expert_s(c, n), want, 1e-12 * want, "grouped, one expert of %g rows: (2.05 x %.4g + "
                      "max(%.4g, %.4g)) / 3.25 s", n, fwd, w, dw);
        }
        double L = 2048;
        double want = 2 * L * L * 16 * 128 / (PEAK * 0.35) + 2 * L * d * (2 * 16 * 128 + 2 * 16 * 128) / (PEAK * 0.6);
        is_double(rp_cost_attention_s(c, 2048), want, 1e-12 * want,
                  "a(2048): attention at the calibrated 0.35, projections at the config's 0.6");
    }
    rp_cost_free(c);
    rp_stats_free(stats);
    rp_batch_free(b);
    free(ids);
    rp_config_free(cfg);
}

/* ---- variations written into a temp dir ---- */

static char dir[64];

static char *fake_text(void)
{
    char *t = slurp(CAL_DIR "fake.json", NULL);
    if (!t) BAIL_OUT("cannot read " CAL_DIR "fake.json");
    return t;
}

/* fake.json with the first `from` replaced by `to`, into DIR/name */
static void write_variant(const char *name, const char *from, const char *to)
{
    char *t = fake_text();
    char *at = from ? strstr(t, from) : NULL;
    if (from && !at) BAIL_OUT("fake.json has no '%s'", from);
    FILE *fh = fopen(temp_path(dir, name), "w");
    if (!fh) BAIL_OUT("cannot write %s", name);
    if (at) {
        fwrite(t, 1, (size_t)(at - t), fh);
        fputs(to, fh);
        fputs(at + strlen(from), fh);
    } else {
        fputs(t, fh);
    }
    fclose(fh);
    free(t);
}

/* config-small's topology and model with `calibration` and `hardware` into DIR/config.json */
static const char *write_config(const char *calibration, const char *hardware)
{
    char text[4096];
    snprintf(text, sizeof text,
             "{\"calibration\": %s, %s%s%s"
             "\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, \"ep_size\": 8, \"slots_per_gpu\": 10},"
             "\"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8, \"hidden_size\": 2048,"
             " \"expert_ffn_size\": 1024, \"num_heads\": 16, \"num_kv_heads\": 16, \"head_dim\": 128},"
             "\"limits\": {\"max_tokens_per_microbatch\": 16384}}",
             calibration, hardware ? "\"hardware\": " : "", hardware ? hardware : "", hardware ? ", " : "");
    const char *path = temp_path(dir, "config.json");
    spit(path, text, strlen(text));
    return path;
}

static void expect_error(const char *calibration, const char *hardware, rp_status want, const char *const *words,
                         const char *what)
{
    rp_config *cfg = NULL;
    rp_error err;
    err.text[0] = '\0';
    rp_status st = rp_config_load(ctx, write_config(calibration, hardware), &cfg, &err);
    int pass = st == want && cfg == NULL;
    for (int i = 0; words[i]; i++) pass &= strstr(err.text, words[i]) != NULL;
    ok(pass, "%s", what);
    if (!pass) diag("status %d (want %d): %s", st, want, err.text);
    rp_config_free(cfg);
}

static void test_explicit_keys_win(void)
{
    write_variant("fake.json", NULL, NULL);
    rp_config *cfg;
    rp_status st;
    rp_error err;
    const rp_hardware *h = load(write_config("\"fake.json\"", "{\"backward_multiplier\": 1.5, "
                                             "\"gemm_efficiency\": [[1, 0.5]], \"layer_fixed_us\": 7}"),
                                &cfg, &st, &err);
    ok(h != NULL, "a config with backward_multiplier, gemm_efficiency and layer_fixed_us loads");
    if (!h) {
        diag("%s", err.text);
        return;
    }
    ok(h->backward.attention == 1.5 && h->backward.projections == 1.5 && h->backward.experts == 1.5,
       "backward_multiplier sets every compute term: the file's ratios are not used");
    ok(h->num_gemm_efficiency == 1 && h->gemm_efficiency[0].efficiency == 0.5, "the config's gemm curve wins");
    is_double(h->layer_fixed_s, 7e-6, 1e-18, "the config's layer_fixed_us wins");
    ok(h->num_attention_efficiency == 7 && h->dense_efficiency == 0.75 && h->hbm_bytes_per_s == 4e12,
       "the keys it leaves out come from the file");
    rp_config_free(cfg);

    /* an absolute path works too */
    char abs[600];
    snprintf(abs, sizeof abs, "\"%s\"", temp_path(dir, "fake.json"));
    h = load(write_config(abs, NULL), &cfg, &st, &err);
    ok(h && h->num_gemm_efficiency == 11, "an absolute calibration path loads");
    rp_config_free(cfg);

    /* the grouped GEMM's keys: the config's win, one by one */
    h = load(write_config("\"fake.json\"", "{\"gemm_tile_rows\": 64, \"wgrad_efficiency\": [[1, 0.9]], "
                                             "\"backward\": {\"experts_dgrad\": 0.25}}"),
             &cfg, &st, &err);
    ok(h && h->gemm_tile_rows == 64 && h->num_wgrad_efficiency == 1 && h->wgrad_efficiency[0].efficiency == 0.9 &&
           h->backward_experts_dgrad == 0.25 && h->num_grouped_gemm_efficiency > 1 && h->backward.experts == 2.25,
       "the config's gemm_tile_rows, wgrad_efficiency and backward.experts_dgrad win; the grouped curve and "
       "backward.experts come from the file");
    rp_config_free(cfg);
}

/* A file written before the grouped GEMM's figures: fake.json without gemm_tile_rows,
 * grouped_gemm_efficiency, wgrad_efficiency and backward.experts_dgrad. */
static void test_old_file(void)
{
    char *t = fake_text();
    FILE *fh = fopen(temp_path(dir, "old.json"), "w");
    if (!fh) BAIL_OUT("cannot write old.json");
    for (char *line = t; *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) + 1 : strlen(line);
        char buf[4096];
        if (n >= sizeof buf) BAIL_OUT("a line of fake.json is too long");
        memcpy(buf, line, n);
        buf[n] = '\0';
        char *dg = strstr(buf, ", \"experts_dgrad\"");
        if (dg) memmove(dg, strchr(dg, '}'), strlen(strchr(dg, '}')) + 1);
        if (!strstr(buf, "\"gemm_tile_rows\"") && !strstr(buf, "\"grouped_gemm_efficiency\"") &&
            !strstr(buf, "\"wgrad_efficiency\""))
            fputs(buf, fh);
        line += n;
    }
    fclose(fh);
    free(t);
    rp_config *cfg;
    rp_status st;
    rp_error err;
    const rp_hardware *h = load(write_config("\"old.json\"", NULL), &cfg, &st, &err);
    ok(h != NULL, "a calibration file without the grouped GEMM's figures loads");
    if (!h) diag("%s", err.text);
    ok(h && h->gemm_tile_rows == 0 && h->num_grouped_gemm_efficiency == 0 && h->num_wgrad_efficiency == 0 &&
           h->backward_experts_dgrad < 0 && h->num_gemm_efficiency == 11 && h->backward.experts == 2.25,
       "... and leaves them to their defaults (the executor's tile, the per-expert curve, backward.experts - 1)");
    rp_config_free(cfg);
}

/* The file's links (what calibrate --links measured between ranks of one machine) set
 * the topology's link figures the config leaves out; the config's own win; bad links
 * are refused with the key named. */
static void test_links(void)
{
    const char *links = "\"version\": 1,\n \"links\": {\"backend\": \"gloo\", \"ranks\": 2, "
                        "\"bytes_per_s\": 8e8, \"latency_us\": 250},";
    write_variant("links.json", "\"version\": 1,", links);
    rp_config *cfg = NULL;
    rp_status st;
    rp_error err;
    const rp_hardware *h = load(write_config("\"links.json\"", NULL), &cfg, &st, &err);
    const rp_topology *t = cfg ? rp_config_topology(cfg) : NULL;
    ok(h && t && t->nvlink_bytes_per_s == 8e8 && fabs(t->nvlink_latency_s - 250e-6) < 1e-15,
       "the file's links set the topology's link figures the config leaves out");
    if (!h) diag("%s", err.text);
    rp_config_free(cfg);
    cfg = NULL;
    h = load(write_config("\"fake.json\"", NULL), &cfg, &st, &err);
    t = cfg ? rp_config_topology(cfg) : NULL;
    ok(h && t && t->nvlink_bytes_per_s == 450e9 && fabs(t->nvlink_latency_s - 3e-6) < 1e-15,
       "a file without links leaves the topology's defaults");
    rp_config_free(cfg);
    cfg = NULL;
    {   /* the config's own link figure wins, the other still comes from the file */
        char text[4096];
        snprintf(text, sizeof text,
                 "{\"calibration\": \"links.json\", \"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, "
                 "\"ep_size\": 8, \"slots_per_gpu\": 10, \"nvlink_bytes_per_s\": 1e11},"
                 "\"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8, \"hidden_size\": 2048,"
                 " \"expert_ffn_size\": 1024, \"num_heads\": 16, \"num_kv_heads\": 16, \"head_dim\": 128},"
                 "\"limits\": {\"max_tokens_per_microbatch\": 16384}}");
        const char *path = temp_path(dir, "config.json");
        spit(path, text, strlen(text));
        h = load(path, &cfg, &st, &err);
        t = cfg ? rp_config_topology(cfg) : NULL;
        ok(h && t && t->nvlink_bytes_per_s == 1e11 && fabs(t->nvlink_latency_s - 250e-6) < 1e-15,
           "the config's nvlink_bytes_per_s wins over the file's; its latency comes from the file");
        if (!h) diag("%s", err.text);
        rp_config_free(cfg);
    }
    {
        const char *w[] = {"links.ranks", "bad.json", NULL};
        write_variant("bad.json", "\"version\": 1,", "\"version\": 1, \"links\": {\"backend\": \"gloo\", "
                      "\"ranks\": 1, \"bytes_per_s\": 8e8, \"latency_us\": 250},");
        expect_error("\"bad.json\"", NULL, RP_ERANGE, w, "links measured on one rank are refused");
    }
    {
        const char *w[] = {"links.bytes_per_s", NULL};
        write_variant("bad.json", "\"version\": 1,", "\"version\": 1, \"links\": {\"backend\": \"gloo\", "
                      "\"ranks\": 2, \"bytes_per_s\": 0, \"latency_us\": 250},");
        expect_error("\"bad.json\"", NULL, RP_ERANGE, w, "a zero link bandwidth is refused");
    }
    {
        const char *w[] = {"bandwidth", "unknown key", NULL};
        write_variant("bad.json", "\"version\": 1,", "\"version\": 1, \"links\": {\"backend\": \"gloo\", "
                      "\"ranks\": 2, \"bandwidth\": 8e8, \"latency_us\": 250},");
        expect_error("\"bad.json\"", NULL, RP_EINVAL, w, "an unknown key in the links is refused");
    }
}

static void test_bad_files(void)
{
    write_variant("fake.json", NULL, NULL);
    {
        const char *w[] = {"other.json", "no calibration for the model's shape d2048_f1024_h16_kv16_dh128",
                           "the file has: d2048_f768_h32_kv4_dh128", NULL};
        /* a file with the reference model's entry only */
        char *t = fake_text();
        char *cut = strstr(t, "  \"d2048_f768_h32_kv4_dh128\"");
        char *start = strstr(t, "  \"d2048_f1024_h16_kv16_dh128\"");
        if (!cut || !start) BAIL_OUT("fake.json lacks its two shapes");
        FILE *fh = fopen(temp_path(dir, "other.json"), "w");
        fwrite(t, 1, (size_t)(start - t), fh);
        fputs(cut, fh);
        fclose(fh);
        free(t);
        expect_error("\"other.json\"", NULL, RP_EINVAL, w, "no entry for the shape: names the file, key and shapes");
    }
    {
        const char *w[] = {"gemm_efficiencyy", "unknown key", NULL};
        write_variant("bad.json", "\"gemm_efficiency\"", "\"gemm_efficiencyy\"");
        expect_error("\"bad.json\"", NULL, RP_EINVAL, w, "an unknown key in an entry is refused");
    }
    {
        const char *w[] = {"bad.json", "version", "is 2", NULL};
        write_variant("bad.json", "\"version\": 1", "\"version\": 2");
        expect_error("\"bad.json\"", NULL, RP_EFORMAT, w, "another version is refused");
    }
    {
        const char *w[] = {"not a calibration file", NULL};
        write_variant("bad.json", "routepack-calibration", "routepack-plan");
        expect_error("\"bad.json\"", NULL, RP_EFORMAT, w, "another format is refused");
    }
    {
        const char *w[] = {"attention_kernel", "unfused", NULL};
        write_variant("bad.json", "\"fake_flash_varlen\"", "\"math_reference\"");
        expect_error("\"bad.json\"", NULL, RP_EINVAL, w, "an unfused attention kernel's figures are refused");
    }
    {
        const char *w[] = {"bad.json", "gemm_efficiency[1][0]", "strictly increasing", NULL};
        write_variant("bad.json", "[1, 0.003113], [4,", "[1, 0.003113], [1,");
        expect_error("\"bad.json\"", NULL, RP_EINVAL, w, "a curve that does not increase is refused, by position");
    }
    {
        const char *w[] = {"efficiency", "(0, 1]", NULL};
        write_variant("bad.json", "[256, 0.4]", "[256, 1.4]");
        expect_error("\"bad.json\"", NULL, RP_ERANGE, w, "an efficiency above 1 is refused");
    }
    {
        const char *w[] = {"not the d2048_f1024_h16_kv16_dh128 its key says", NULL};
        write_variant("bad.json", "\"expert_ffn_size\": 1024", "\"expert_ffn_size\": 1025");
        expect_error("\"bad.json\"", NULL, RP_EINVAL, w, "an entry whose fields do not spell its key is refused");
    }
    {
        const char *w[] = {"backward.experts", NULL};
        write_variant("bad.json", "\"experts\": 2.25,", "\"experts\": -1,");
        expect_error("\"bad.json\"", NULL, RP_ERANGE, w, "a negative backward ratio is refused");
    }
    {
        const char *w[] = {"measured against peak_flops 9.89e+14", "hardware.peak_flops is 1e+15", NULL};
        expect_error("\"fake.json\"", "{\"peak_flops\": 1e15}", RP_EINVAL, w,
                     "a config whose peak differs from the one measured against is refused");
    }
    {
        const char *w[] = {"no-such.json", NULL};
        expect_error("\"no-such.json\"", NULL, RP_EIO, w, "a missing file is RP_EIO naming it");
    }
    {
        const char *w[] = {"calibration", "must be a path", NULL};
        expect_error("\"\"", NULL, RP_EINVAL, w, "an empty path is refused");
    }
    {
        const char *w[] = {"calibration", NULL};
        expect_error("5", NULL, RP_EINVAL, w, "a number is not a path");
    }
}

static void test_allocation_failures(void)
{
    write_variant("fake.json", NULL, NULL);
    const char *path = write_config("\"fake.json\"", NULL);
    int clean = 1, succeeded = 0;
    long n;
    for (n = 1; n < 10000 && !succeeded; n++) {
        counting c = {0};
        rp_context *cx;
        rp_context_new(counting_alloc, &c, &cx);
        c.fail_at = c.calls + n;
        rp_config *cfg = NULL;
        rp_error err;
        rp_status st = rp_config_load(cx, path, &cfg, &err);
        if (st == RP_OK) {
            succeeded = 1;
            clean &= rp_config_hardware(cfg)->num_gemm_efficiency == 11;
            rp_config_free(cfg);
        } else if (st != RP_ENOMEM || cfg != NULL) {
            clean = 0;
        }
        rp_context_free(cx);
        if (c.live != 0) clean = 0;
    }
    ok(succeeded && n > 3, "loading with a calibration succeeds once enough allocations do (%ld failure points)",
       n - 2);
    ok(clean, "every allocation failure gives RP_ENOMEM and leaks nothing");
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) BAIL_OUT("no context");
    if (!temp_dir_make(dir, sizeof dir, "calibration")) BAIL_OUT("no temp dir");
    test_fake_device_figures();
    test_explicit_keys_win();
    test_old_file();
    test_links();
    test_bad_files();
    test_allocation_failures();
    temp_dir_remove(dir);
    rp_context_free(ctx);
    return tap_done();
}
