/* bench_overhead --json at a small scale (issue 16's check): every key is there, the parts
 * add up to total_ms, and the bytes exchanged are the 64 ranks' serialised statistics,
 * each the size of this rank's part computed here from the same generated sequences. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <math.h>

static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

int main(void)
{
    static char out[1 << 14];
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s/bench/bench_overhead' --scale 8 --reps 1 --json 2>&1", RP_BINARY_DIR);
    FILE *p = popen(cmd, "r");
    size_t got = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[got] = '\0';
    int rc = p ? pclose(p) : -1;
    ok(rc == 0, "bench_overhead --scale 8 --json runs");
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    ok(o && json_is_object(o), "and prints one JSON object");
    if (!o) {
        diag("%s", out);
        return tap_done();
    }
    const char *keys[] = {"stats_ms", "exchange_bytes", "exchange_ms", "merge_ms", "policy_ms", "validate_ms",
                          "total_ms", "predicted_step_ms", "construction_ms", "part_bytes", "ranks", "peak_rss_mib",
                          "policy_wall_ms", "checked_construction_ms", "fallback_check_ms", "fallback_changed",
                          "rank_peak_mib", "rank_routing_bytes", "step_routing_bytes", "stats_bytes",
                          "check_step", "check_policy_ms", "check_validate_ms", "check_total_ms", "interval_checks",
                          "interval_policy_ms", "interval_validate_ms", "interval_total_ms", "every_step_policy_ms",
                          "every_step_validate_ms", "every_step_total_ms", "step_fallback_checks",
                          "no_balancer_policy_ms", "no_balancer_validate_ms", "no_balancer_total_ms",
                          "no_balancer_interval_total_ms", "plan_ahead_ms", "plan_ahead_train_ms", "exposed_ms",
                          "exposed_percent"};
    int all = 1;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!(num(o, keys[i]) >= 0)) all = 0, diag("missing or negative: %s", keys[i]);
    ok(all, "every key is there, a number >= 0");
    double parts = num(o, "stats_ms") + num(o, "exchange_ms") + num(o, "merge_ms") + num(o, "policy_ms") +
                   num(o, "validate_ms");
    ok(fabs(parts - num(o, "total_ms")) < 0.01, "the parts add up to total_ms (%.3f vs %.3f)", parts,
       num(o, "total_ms"));
    const double fixed = num(o, "stats_ms") + num(o, "exchange_ms") + num(o, "merge_ms");
    const char *const kinds[] = {"check", "interval", "every_step", "no_balancer"};
    for (int k = 0; k < 4; k++) {
        char policy[64], validate[64], total[64];
        snprintf(policy, sizeof policy, "%s_policy_ms", kinds[k]);
        snprintf(validate, sizeof validate, "%s_validate_ms", kinds[k]);
        snprintf(total, sizeof total, "%s_total_ms", kinds[k]);
        ok(fabs(fixed + num(o, policy) + num(o, validate) - num(o, total)) < 0.01, "and so do %s's", total);
    }
    /* the shipped policy checks on its first step and then every fallback_interval steps
     * while the joint plan wins: the third step skips, the interval ends with one check */
    ok(num(o, "step_fallback_checks") == 0 && num(o, "check_step") > 2 && num(o, "interval_checks") == 1,
       "the third step does not check the fallbacks; step %.0f does, the one check of its interval",
       num(o, "check_step"));
    ok(num(o, "predicted_step_ms") > 0,
       "a predicted step time");
    ok(json_is_string(json_object_get(o, "fallback_chosen")) &&
           (num(o, "fallback_changed") == 0 || num(o, "fallback_changed") == 1),
       "the fallback check names its choice and whether it changed the plan");
    /* every rank has this rank's sequences again, so the step's routing is 64 times its own */
    ok(num(o, "rank_routing_bytes") > 0 && num(o, "rank_routing_bytes") * num(o, "ranks") == num(o, "step_routing_bytes"),
       "a rank holds its own routing (%.0f bytes), 1/%.0f of the step's (%.0f)", num(o, "rank_routing_bytes"),
       num(o, "ranks"), num(o, "step_routing_bytes"));
    ok(num(o, "rank_peak_mib") * 1048576.0 < num(o, "step_routing_bytes"),
       "the rank's peak memory (%.1f MiB) is below the step's routing (%.1f MiB): it never held it",
       num(o, "rank_peak_mib"), num(o, "step_routing_bytes") / 1048576.0);

    /* this rank's part, computed here: the reference settings with one prompt */
    rp_context *ctx = NULL;
    rp_config *cfg = NULL;
    rp_gen *gen = NULL;
    rp_batch *b = NULL;
    rp_routing r;
    rp_stats *st = NULL;
    rp_error err;
    const char *gen_path = RP_SOURCE_DIR "/examples/gen-reference.json";
    json_t *settings = json_load_file(gen_path, 0, &je);
    json_object_set_new(settings, "num_prompts", json_integer(1));
    char *text = json_dumps(settings, JSON_COMPACT);
    rp_context_new(NULL, NULL, &ctx);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-reference.json", &cfg, &err) != RP_OK ||
        rp_gen_parse(ctx, text, strlen(text), gen_path, RP_SOURCE_DIR "/examples", &gen, &err) != RP_OK ||
        rp_gen_step(gen, 0, &b, &r, &err) != RP_OK ||
        rp_stats_compute(ctx, b, &r, rp_config_model(cfg)->num_experts, 1, &st, &err) != RP_OK)
        diag("setup: %s", err.text);
    double part = st ? (double)rp_stats_serialized_bytes(st) : -1;
    ok(num(o, "part_bytes") == part, "a part is this rank's serialised statistics (%.0f bytes)", part);
    ok(num(o, "exchange_bytes") == part * num(o, "ranks"), "exchange_bytes is every rank's part (%.0f x %.0f)", part,
       num(o, "ranks"));
    rp_stats_free(st);
    rp_batch_free(b);
    rp_gen_free(gen);
    rp_config_free(cfg);
    rp_context_free(ctx);
    free(text);
    json_decref(settings);
    json_decref(o);
    return tap_done();
}
