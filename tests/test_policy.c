/* Loading policies: every metadata field checked with a message that names it, the API
 * version, params (defaults, config values, every kind of bad value), finding a policy
 * by name on the search path and RP_POLICY_PATH, listing and describing policies. */
#include "policy.h"
#include "tap.h"
#include "test_util.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static rp_context *ctx;
static rp_config *cfg;
static char tmp[256];

static const char *config_text =
    "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
    " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
    " \"limits\": {\"max_tokens_per_microbatch\": 1000}}";

#define HEAD "name = 'demo', version = '1.2.3', api = 1, description = 'a demo policy', "
#define PLAN "plan = function(ctx) return nil end"

/* Load source text as "policy.lua"; "" on success, else "STATUS|message". */
static char result[1024];
static rp_policy *last;
static const char *load_ex(const char *src, const char *params, bool any_api)
{
    rp_error err;
    rp_error_clear(&err);
    rp_policy_free(last);
    last = NULL;
    /* the default limits, but wall time out of reach: a loop must stop at the instruction
     * limit, which 200 M instructions reach in seconds on a loaded machine */
    rp_sandbox_limits limits = rp_sandbox_limits_default();
    limits.max_wall_s = 3600;
    rp_status st = rp_policy_load(ctx, cfg, src, strlen(src), "dir/policy.lua", &limits, params, any_api, &last, &err);
    if (st == RP_OK) result[0] = '\0';
    else snprintf(result, sizeof result, "%d|%s", (int)st, err.text);
    return result;
}

static const char *load(const char *src) { return load_ex(src, NULL, false); }

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void test_valid(void)
{
    const char *src = "return {" HEAD
                      "params = {k = {type = 'integer', default = 3, min = 1, max = 9, doc = 'parts'}}, " PLAN "}";
    is_str(load(src), "", "a complete policy loads");
    if (!last) return;
    is_str(last->info.name, "demo", "its name is read");
    is_str(last->info.version, "1.2.3", "its version is read");
    is_int(last->info.api, 1, "its API version is read");
    is_str(last->info.description, "a demo policy", "its description is read");
    is_str(last->info.path, "dir/policy.lua", "its path is kept");
    ok(last->info.hash == rp_hash64(src, strlen(src), 0), "its hash is XXH64 of the source text");
    is_int(last->num_params, 1, "its param is read");
    is_double(last->params[0].num, 3, 0, "the param starts at its default");
    is_str(load("return {" HEAD "init = function(ctx) ctx.state.n = 1 end, extra = 5, helper = function() end, " PLAN "}"),
           "", "init, helper functions and other fields are allowed");
}

typedef struct bad_case {
    const char *what, *src, *message;
    int status;
} bad_case;

static void test_metadata_errors(void)
{
    static const bad_case cases[] = {
        {"a chunk returning nothing", "local x = 1", "policy.lua: the chunk must return the policy table", RP_EPOLICY},
        {"a chunk returning a number", "return 5", "must return the policy table (return {name = ", RP_EPOLICY},
        {"a missing name", "return {version = '1.0.0', api = 1, description = 'd', " PLAN "}",
         "policy.lua: 'name' must be a string of lowercase letters, digits and '_' (at most 63), got nil", RP_EPOLICY},
        {"a name with capitals", "return {name = 'Demo', version = '1.0.0', api = 1, description = 'd', " PLAN "}",
         "'name' must be a string of lowercase letters, digits and '_' (at most 63), got 'Demo'", RP_EPOLICY},
        {"a name of 64 characters",
         "return {name = string.rep('a', 64), version = '1.0.0', api = 1, description = 'd', " PLAN "}",
         "'name' must be a string", RP_EPOLICY},
        {"a version that is a number", "return {name = 'x', version = 1.2, api = 1, description = 'd', " PLAN "}",
         "policy.lua: 'version' must be a string like \"1.2.0\", got number", RP_EPOLICY},
        {"a version with two parts", "return {name = 'x', version = '1.2', api = 1, description = 'd', " PLAN "}",
         "'version' must be a string like \"1.2.0\", got '1.2'", RP_EPOLICY},
        {"a version with letters", "return {name = 'x', version = '1.2.x', api = 1, description = 'd', " PLAN "}",
         "got '1.2.x'", RP_EPOLICY},
        {"a missing api", "return {name = 'x', version = '1.0.0', description = 'd', " PLAN "}",
         "policy.lua: 'api' must be an integer, the policy API version it targets (this RoutePack serves 1), got nil",
         RP_EPOLICY},
        {"an api that is a string", "return {name = 'x', version = '1.0.0', api = '1', description = 'd', " PLAN "}",
         "'api' must be an integer", RP_EPOLICY},
        {"an api of another version", "return {name = 'x', version = '1.0.0', api = 2, description = 'd', " PLAN "}",
         "policy 'x' targets policy API 2, but this RoutePack serves API 1", RP_ENOTSUP},
        {"a missing description", "return {name = 'x', version = '1.0.0', api = 1, " PLAN "}",
         "policy.lua: 'description' must be one line of 1..255 bytes, got nil", RP_EPOLICY},
        {"a description of two lines",
         "return {name = 'x', version = '1.0.0', api = 1, description = 'a\\nb', " PLAN "}",
         "'description' must be one line", RP_EPOLICY},
        {"an empty description", "return {name = 'x', version = '1.0.0', api = 1, description = '', " PLAN "}",
         "got an empty string", RP_EPOLICY},
        {"a missing plan", "return {" HEAD "}",
         "policy.lua: 'plan' must be a function (plan(ctx) returns the plan), got nil", RP_EPOLICY},
        {"a plan that is a table", "return {" HEAD "plan = {}}", "'plan' must be a function", RP_EPOLICY},
        {"an init that is a string", "return {" HEAD "init = 'x', " PLAN "}",
         "policy.lua: 'init' must be a function (init(ctx) runs once after loading), got string", RP_EPOLICY},
        {"params that are a list of strings", "return {" HEAD "params = 'k', " PLAN "}",
         "policy.lua: 'params' must be a table of parameter specs, got string", RP_EPOLICY},
        {"a param with a bad name", "return {" HEAD "params = {['Bad-Name'] = {type = 'integer', default = 1, doc = 'd'}}, " PLAN "}",
         "param names must be identifiers", RP_EPOLICY},
        {"a param spec that is not a table", "return {" HEAD "params = {k = 5}, " PLAN "}",
         "policy.lua: params.k must be a table", RP_EPOLICY},
        {"a param of an unknown type", "return {" HEAD "params = {k = {type = 'int', default = 1, doc = 'd'}}, " PLAN "}",
         "policy.lua: params.k.type must be \"integer\", \"number\", \"boolean\" or \"string\", got 'int'", RP_EPOLICY},
        {"a param without a default", "return {" HEAD "params = {k = {type = 'integer', doc = 'd'}}, " PLAN "}",
         "policy.lua: params.k.default must be an integer, got nil", RP_EPOLICY},
        {"an integer param with a fractional default",
         "return {" HEAD "params = {k = {type = 'integer', default = 2.5, doc = 'd'}}, " PLAN "}",
         "params.k.default must be an integer, got 2.5", RP_EPOLICY},
        {"a boolean param with a string default",
         "return {" HEAD "params = {k = {type = 'boolean', default = 'yes', doc = 'd'}}, " PLAN "}",
         "params.k.default must be a boolean, got 'yes'", RP_EPOLICY},
        {"a param without doc", "return {" HEAD "params = {k = {type = 'integer', default = 1}}, " PLAN "}",
         "policy.lua: params.k.doc must be a string", RP_EPOLICY},
        {"a param with min above max",
         "return {" HEAD "params = {k = {type = 'number', default = 1, min = 5, max = 2, doc = 'd'}}, " PLAN "}",
         "params.k.min (5) is above its max (2)", RP_EPOLICY},
        {"a default outside the range",
         "return {" HEAD "params = {k = {type = 'integer', default = 0, min = 1, doc = 'd'}}, " PLAN "}",
         "params.k.default (0) is outside its range 1..inf", RP_EPOLICY},
        {"a range on a string param",
         "return {" HEAD "params = {k = {type = 'string', default = 'a', min = 1, doc = 'd'}}, " PLAN "}",
         "params.k.min is only allowed for integer and number params", RP_EPOLICY},
        {"values on a number param",
         "return {" HEAD "params = {k = {type = 'number', default = 1, values = {'a'}, doc = 'd'}}, " PLAN "}",
         "params.k.values is only allowed for string params", RP_EPOLICY},
        {"a default outside the values",
         "return {" HEAD "params = {k = {type = 'string', default = 'c', values = {'a', 'b'}, doc = 'd'}}, " PLAN "}",
         "params.k.default 'c' is not one of its values", RP_EPOLICY},
        {"an unknown field in a param spec",
         "return {" HEAD "params = {k = {type = 'integer', default = 1, doc = 'd', mni = 0}}, " PLAN "}",
         "params.k has an unknown field 'mni'", RP_EPOLICY},
        {"a syntax error", "return {" HEAD PLAN "\nend end", "policy.lua:2:", RP_EPOLICY},
        {"a runtime error in the chunk", "local t = nil\nreturn t.x", "policy.lua:2: attempt to index", RP_EPOLICY},
        {"precompiled bytecode", "\x1bLJ\x02\x00", "precompiled bytecode is refused", RP_EPOLICY},
        {"an infinite loop in the chunk", "while true do end", "policy exceeded the instruction limit", RP_ELIMIT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *r = load(cases[i].src);
        char want[32];
        snprintf(want, sizeof want, "%d|", cases[i].status);
        int pass = strncmp(r, want, strlen(want)) == 0 && strstr(r, cases[i].message) != NULL;
        if (!tap_ok_at(pass, __FILE__, __LINE__, "refused: %s", cases[i].what))
            printf("#          got: '%s'\n#       wanted: %s'%s'\n", r, want, cases[i].message);
    }
    /* the API check comes before the other fields: an API 2 policy may use new ones */
    like(load("return {name = 'future', version = 'next', api = 2, plan = 5}"),
         "policy 'future' targets policy API 2, but this RoutePack serves API 1",
         "another API version is reported before fields this version would refuse");
    is_str(load_ex("return {name = 'future', version = '1.0.0', api = 2, description = 'd', " PLAN "}", NULL, true), "",
           "listing reads a policy of another API version");
}

static const char *params_src =
    "return {" HEAD "params = {"
    " k = {type = 'integer', default = 3, min = 1, max = 9, doc = 'parts'},"
    " rate = {type = 'number', default = 0.5, min = 0, max = 1, doc = 'a rate'},"
    " fast = {type = 'boolean', default = false, doc = 'go fast'},"
    " mode = {type = 'string', default = 'a', values = {'a', 'b'}, doc = 'a mode'},"
    " label = {type = 'string', default = 'x', doc = 'free text'}}, " PLAN "}";

static rp_param *param(const char *name)
{
    for (int32_t i = 0; last && i < last->num_params; i++)
        if (strcmp(last->params[i].name, name) == 0) return &last->params[i];
    return NULL;
}

static void test_params(void)
{
    is_str(load_ex(params_src, "{\"k\": 7, \"rate\": 1, \"fast\": true, \"mode\": \"b\", \"label\": \"hi\"}", false), "",
           "config params of every type are accepted");
    if (last && param("k") && param("mode") && param("label")) {
        is_double(param("k")->num, 7, 0, "integer param from the config");
        is_double(param("rate")->num, 1, 0, "number param from an integer in JSON");
        ok(param("fast")->boolean, "boolean param from the config");
        is_str(param("mode")->str, "b", "string param with values from the config");
        is_str(param("label")->str, "hi", "free string param from the config");
        is_str(last->params_json, "{\"k\": 7, \"rate\": 1, \"fast\": true, \"mode\": \"b\", \"label\": \"hi\"}",
               "the params applied are kept as given");
    }
    is_str(load_ex(params_src, "{\"k\": 4.0}", false), "", "an integral JSON real is an integer");
    is_str(load_ex(params_src, "{}", false), "", "no params: all defaults");
    if (last && param("rate")) is_double(param("rate")->num, 0.5, 0, "the default stays without a config value");
    ok(last && strcmp(last->params[0].name, "fast") == 0 && strcmp(last->params[4].name, "rate") == 0,
       "params are kept in name order");

    static const struct {
        const char *json, *message, *what;
        int status;
    } bad[] = {
        {"{\"kk\": 2}", "policy 'demo': unknown param 'kk' (did you mean 'k'? the policy declares: fast, k, label, mode, rate)",
         "an unknown param, with a suggestion", RP_EINVAL},
        {"{\"omed\": 2}", "unknown param 'omed' (did you mean 'mode'? the policy declares: fast, k, label, mode, rate)",
         "two swaps of neighbours are two edits, near enough to suggest", RP_EINVAL},
        {"{\"zzzzzz\": 2}", "unknown param 'zzzzzz' (the policy declares: fast, k, label, mode, rate)",
         "an unknown param without a near name", RP_EINVAL},
        {"{\"k\": \"3\"}", "policy 'demo': param 'k' must be an integer, got a string", "an integer given as a string",
         RP_EINVAL},
        {"{\"k\": 2.5}", "param 'k' must be an integer, got 2.5", "an integer given as a fraction", RP_EINVAL},
        {"{\"k\": 0}", "policy 'demo': param 'k' is 0, below its minimum 1", "below the minimum", RP_ERANGE},
        {"{\"rate\": 1.5}", "param 'rate' is 1.5, above its maximum 1", "above the maximum", RP_ERANGE},
        {"{\"fast\": 1}", "param 'fast' must be a boolean, got an integer", "a boolean given as a number", RP_EINVAL},
        {"{\"mode\": \"c\"}", "param 'mode' is 'c', not one of 'a', 'b'", "a string outside its values", RP_EINVAL},
        {"{\"label\": null}", "param 'label' must be a string, got null", "a string given as null", RP_EINVAL},
        {"[1, 2]", "policy 'demo': params must be a JSON object, got an array", "params that are not an object",
         RP_EINVAL},
        {"{\"k\": ", "policy 'demo': params are not valid JSON", "params that are not JSON", RP_EFORMAT},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *r = load_ex(params_src, bad[i].json, false);
        char want[32];
        snprintf(want, sizeof want, "%d|", bad[i].status);
        int pass = strncmp(r, want, strlen(want)) == 0 && strstr(r, bad[i].message) != NULL;
        if (!tap_ok_at(pass, __FILE__, __LINE__, "params refused: %s", bad[i].what))
            printf("#          got: '%s'\n#       wanted: %s'%s'\n", r, want, bad[i].message);
    }
    like(load_ex("return {" HEAD PLAN "}", "{\"k\": 1}", false),
         "unknown param 'k' (the policy declares no params)", "params for a policy without params");
}

static void test_params_reach_ctx(void)
{
    /* end to end: the config's params arrive in ctx.params */
    char path[512];
    snprintf(path, sizeof path, "%s/p.lua", tmp);
    write_file(path, "return {name = 'p', version = '1.0.0', api = 1, description = 'd',\n"
                     " params = {k = {type = 'integer', default = 3, doc = 'k'}, mode = {type = 'string', default = 'a', doc = 'm'}},\n"
                     " plan = function(ctx) error('k=' .. ctx.params.k .. ' mode=' .. ctx.params.mode) end}\n");
    char text[2048];
    snprintf(text, sizeof text,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
             "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1000},"
             " \"policy\": {\"name\": \"%s\", \"params\": {\"k\": 7}}}",
             path);
    rp_config *c2 = NULL;
    rp_error err;
    rp_sched *s = NULL;
    if (rp_config_parse(ctx, text, strlen(text), "<inline>", &c2, &err) != RP_OK) {
        ok(0, "config: %s", err.text);
        return;
    }
    int32_t prompt[3] = {3, 4, 5}, resp[3] = {1, 2, 3};
    rp_batch *b = NULL;
    rp_batch_new(ctx, 3, prompt, resp, NULL, &b, &err);
    uint8_t *ids = calloc(18 * 2 * 2, 1);
    for (int i = 0; i < 18 * 2 * 2; i++) ids[i] = (uint8_t)(i % 8);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    const rp_plan *plan;
    const rp_step_report *rep;
    ok(rp_sched_new(ctx, c2, NULL, &s, &err) == RP_OK, "a scheduler runs the config's policy with its params");
    if (s && rp_sched_step(s, 0, b, &r, &plan, &rep, &err) == RP_OK) {
        like(rep->fallback_reason, "k=7 mode=a", "ctx.params holds the config's value and the other default");
        ok(rep->fallback, "the failing policy falls back");
    } else {
        ok(0, "step: %s", err.text);
        ok(0, "step");
    }
    rp_sched_free(s);
    s = NULL;
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk";
    ok(rp_sched_new(ctx, c2, &o, &s, &err) == RP_OK, "another policy than the config's does not get its params");
    rp_sched_free(s);
    s = NULL;
    o.params_json = "{\"k\": 1}";
    ok(rp_sched_new(ctx, c2, &o, &s, &err) != RP_OK && strstr(err.text, "unknown param 'k'"),
       "explicit params are checked against the policy that runs");
    rp_sched_free(s);
    free(ids);
    rp_batch_free(b);
    rp_config_free(c2);
}

static void test_search_path(void)
{
    char a[300], b[300], path[512];
    snprintf(a, sizeof a, "%s/a", tmp);
    snprintf(b, sizeof b, "%s/b", tmp);
    mkdir(a, 0700);
    mkdir(b, 0700);
    snprintf(path, sizeof path, "%s/mine.lua", a);
    write_file(path, "return {name = 'mine', version = '1.0.0', api = 1, description = 'from a', " PLAN "}\n");
    snprintf(path, sizeof path, "%s/mine.lua", b);
    write_file(path, "return {name = 'mine', version = '2.0.0', api = 1, description = 'from b', " PLAN "}\n");
    snprintf(path, sizeof path, "%s/only_b.lua", b);
    write_file(path, "return {name = 'only_b', version = '1.0.0', api = 1, description = 'b', " PLAN "}\n");
    snprintf(path, sizeof path, "%s/broken.lua", b);
    write_file(path, "return {name = 'broken'\n");
    snprintf(path, sizeof path, "%s/future.lua", b);
    write_file(path, "return {name = 'future', version = '3.0.0', api = 2, description = 'needs API 2', " PLAN "}\n");

    rp_error err;
    char *found = NULL;
    unsetenv("RP_POLICY_PATH");
    ok(rp_policy_resolve(ctx, cfg, "token_kk", NULL, &found, &err) == RP_OK && found &&
           strstr(found, "/policies/token_kk.lua"),
       "a shipped policy is found by name in the shipped directory");
    rp_free(ctx, found);
    found = NULL;
    rp_status st = rp_policy_resolve(ctx, cfg, "mine", NULL, &found, &err);
    ok(st == RP_EIO && strstr(err.text, "policy 'mine' not found (looked for mine.lua in: ") &&
           strstr(err.text, "RP_POLICY_PATH"),
       "a missing name is RP_EIO listing where it looked");
    st = rp_policy_resolve(ctx, cfg, "routepak", NULL, &found, &err);
    ok(st == RP_EIO && strstr(err.text, "policy 'routepak' not found (did you mean 'routepack'? looked for"),
       "a misspelt name suggests the policy on the search path it is closest to");
    if (st != RP_EIO) rp_free(ctx, found), found = NULL;
    st = rp_policy_resolve(ctx, cfg, "zzzzzz", NULL, &found, &err);
    ok(st == RP_EIO && !strstr(err.text, "did you mean"), "a name close to none suggests nothing");

    char env[700];
    snprintf(env, sizeof env, "%s::%s", b, a);
    setenv("RP_POLICY_PATH", env, 1);
    st = rp_policy_resolve(ctx, cfg, "mine", NULL, &found, &err);
    snprintf(path, sizeof path, "%s/mine.lua", b);
    ok(st == RP_OK && found && strcmp(found, path) == 0, "RP_POLICY_PATH is searched in order (b before a)");
    rp_free(ctx, found);
    found = NULL;

    /* the config's search path comes before RP_POLICY_PATH */
    char text[1500];
    snprintf(text, sizeof text,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": 3},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
             "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1000},"
             " \"policy\": {\"name\": \"mine\", \"search_path\": [\"%s\"]}}",
             a);
    rp_config *c2 = NULL;
    if (rp_config_parse(ctx, text, strlen(text), "<inline>", &c2, &err) != RP_OK) {
        ok(0, "config: %s", err.text);
        return;
    }
    st = rp_policy_resolve(ctx, c2, "mine", NULL, &found, &err);
    snprintf(path, sizeof path, "%s/mine.lua", a);
    ok(st == RP_OK && found && strcmp(found, path) == 0, "the config's policy.search_path comes first");
    rp_free(ctx, found);
    found = NULL;
    ok(rp_policy_resolve(ctx, c2, "only_b", NULL, &found, &err) == RP_OK, "then RP_POLICY_PATH");
    rp_free(ctx, found);
    found = NULL;

    /* paths */
    snprintf(path, sizeof path, "%s/mine.lua", a);
    ok(rp_policy_resolve(ctx, cfg, path, NULL, &found, &err) == RP_OK && strcmp(found, path) == 0,
       "an absolute path is taken as it is");
    rp_free(ctx, found);
    found = NULL;
    ok(rp_policy_resolve(ctx, cfg, "mine.lua", a, &found, &err) == RP_OK && strcmp(found, path) == 0,
       "a relative path is relative to the base directory");
    rp_free(ctx, found);
    found = NULL;
    st = rp_policy_resolve(ctx, cfg, "nowhere/x.lua", NULL, &found, &err);
    ok(st == RP_EIO && strstr(err.text, "policy file 'nowhere/x.lua' not found"), "a missing file is RP_EIO naming it");
    st = rp_policy_resolve(ctx, cfg, "", NULL, &found, &err);
    ok(st == RP_EINVAL, "an empty name is refused");

    /* loading by name and refusing another API version */
    rp_policy *pol = NULL;
    ok(rp_policy_open(ctx, c2, "mine", NULL, NULL, NULL, &pol, &err) == RP_OK && pol &&
           strcmp(pol->info.version, "1.0.0") == 0,
       "rp_policy_open loads the first policy of that name");
    rp_policy_free(pol);
    pol = NULL;
    st = rp_policy_open(ctx, c2, "future", NULL, NULL, NULL, &pol, &err);
    ok(st == RP_ENOTSUP && strstr(err.text, "policy 'future' targets policy API 2, but this RoutePack serves API 1"),
       "a policy for API 2 is refused saying which version it needs");
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "future";
    rp_sched *s = NULL;
    st = rp_sched_new(ctx, c2, &o, &s, &err);
    ok(st == RP_ENOTSUP && strstr(err.text, "targets policy API 2"), "rp_sched_new refuses it too");
    rp_sched_free(s);

    /* listing */
    rp_policy_info *infos = NULL;
    int32_t count = 0;
    ok(rp_policy_list(ctx, c2, &infos, &count, &err) == RP_OK, "rp_policy_list succeeds");
    int mine_a = -1, mine_b = -1, future = -1, broken = -1, shipped = 0;
    for (int32_t i = 0; i < count; i++) {
        if (strcmp(infos[i].name, "mine") == 0) {
            if (strcmp(infos[i].version, "1.0.0") == 0) mine_a = i;
            else mine_b = i;
        }
        if (strcmp(infos[i].name, "future") == 0) future = i;
        if (strcmp(infos[i].name, "broken") == 0) broken = i;
        if (strstr(infos[i].path, "/policies/") && !infos[i].shadowed &&
            (!strcmp(infos[i].name, "token_kk") || !strcmp(infos[i].name, "attn_kk") || !strcmp(infos[i].name, "eplb") ||
             !strcmp(infos[i].name, "routepack") || !strcmp(infos[i].name, "verl_kk") ||
             !strcmp(infos[i].name, "contiguous")))
            shipped++;
    }
    ok(mine_a >= 0 && mine_b > mine_a && !infos[mine_a].shadowed && infos[mine_b].shadowed,
       "a name in a later directory is listed after and marked shadowed");
    ok(future >= 0 && infos[future].api == 2 && strcmp(infos[future].description, "needs API 2") == 0,
       "a policy for another API is listed with its API version");
    ok(broken < 0, "a file that does not load is skipped");
    is_int(shipped, 6, "the six shipped policies are listed");
    ok(count > 0 && infos[0].hash != 0 && infos[0].path[0], "each entry has its path and hash");
    rp_text_free(ctx, (char *)infos);

    /* describing */
    char *json = NULL;
    size_t len = 0;
    ok(rp_policy_describe(ctx, c2, "routepack", &json, &len, &err) == RP_OK && json && strlen(json) == len,
       "rp_policy_describe gives JSON");
    like(json, "\"name\": \"routepack\"", "it names the policy");
    like(json, "\"name\": \"horizon\"", "it lists the params");
    like(json, "\"doc\": ", "with their docs");
    rp_text_free(ctx, json);
    ok(rp_policy_describe(ctx, c2, "future", &json, &len, &err) == RP_ENOTSUP, "describing an API 2 policy is refused");

    unsetenv("RP_POLICY_PATH");
    rp_config_free(c2);
}

static void test_shipped_load(void)
{
    static const char *names[] = {"token_kk", "verl_kk", "attn_kk", "eplb", "contiguous", "routepack"};
    for (size_t i = 0; i < 6; i++) {
        rp_policy *pol = NULL;
        rp_error err;
        rp_status st = rp_policy_open(ctx, cfg, names[i], NULL, NULL, NULL, &pol, &err);
        bool want_params = strcmp(names[i], "contiguous") != 0; /* it has nothing to tune */
        ok(st == RP_OK && pol && strcmp(pol->info.name, names[i]) == 0 && (pol->num_params > 0) == want_params,
           "shipped policy %s loads%s", names[i], want_params ? " with its params" : "");
        if (st != RP_OK) diag("%s", err.text);
        rp_policy_free(pol);
    }
}

/* ---- policy files that are not small regular files ---------------------------------- */

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "Bail out! reading a policy file hung (a FIFO?)\n";
    ssize_t w = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(1);
}

static void sparse_file(const char *path, off_t size)
{
    FILE *f = fopen(path, "w");
    if (f) {
        fputs("return {}", f);
        fclose(f);
    }
    if (truncate(path, size) != 0) diag("truncate %s failed", path);
}

static int warnings_seen;
static char warnings[4096];
static void collect_warning(void *ud, rp_log_level level, const char *message)
{
    (void)ud;
    if (level != RP_LOG_WARN) return;
    warnings_seen++;
    size_t used = strlen(warnings);
    snprintf(warnings + used, sizeof warnings - used, "%s\n", message);
}

static void test_policy_files(void)
{
    signal(SIGALRM, on_alarm);
    alarm(60);
    char dir[300], path[512];
    snprintf(dir, sizeof dir, "%s/files", tmp);
    mkdir(dir, 0700);
    snprintf(path, sizeof path, "%s/good.lua", dir);
    write_file(path, "return {name = 'good', version = '1.0.0', api = 1, description = 'fine', " PLAN "}\n");
    char fifo[512], huge[512], over[512], at_cap[512];
    snprintf(fifo, sizeof fifo, "%s/fifo.lua", dir);
    bool have_fifo = mkfifo(fifo, 0600) == 0;
    snprintf(huge, sizeof huge, "%s/huge.lua", dir);
    sparse_file(huge, (off_t)1 << 30);
    snprintf(over, sizeof over, "%s/over.lua", dir);
    sparse_file(over, (off_t)RP_POLICY_MAX_BYTES + 1);
    snprintf(at_cap, sizeof at_cap, "%s/at_cap.lua", tmp);
    sparse_file(at_cap, (off_t)RP_POLICY_MAX_BYTES);

    /* a context that counts its memory: nothing near the file's size is allocated */
    counting c;
    memset(&c, 0, sizeof c);
    rp_context *cc = NULL;
    rp_context_new(counting_alloc, &c, &cc);
    rp_context_set_log(cc, collect_warning, NULL, RP_LOG_WARN);
    rp_error err;
    rp_policy *pol = NULL;
    c.peak = c.live;
    rp_status st = rp_policy_open(cc, cfg, huge, NULL, NULL, NULL, &pol, &err);
    ok(st == RP_ERANGE && strstr(err.text, "huge.lua' is 1073741824 bytes; a policy file may be at most 1048576 bytes"),
       "a 1 GiB policy file is refused by its size");
    if (st != RP_ERANGE) diag("%s", err.text);
    ok(c.peak - c.live < 64 << 10, "before anything is read (peak %ld bytes above the start)", c.peak - c.live);
    rp_policy_free(pol);
    pol = NULL;
    st = rp_policy_open(cc, cfg, over, NULL, NULL, NULL, &pol, &err);
    ok(st == RP_ERANGE && strstr(err.text, "is 1048577 bytes"), "one byte over the cap is refused");
    rp_policy_free(pol);
    pol = NULL;
    st = rp_policy_open(cc, cfg, at_cap, NULL, NULL, NULL, &pol, &err);
    ok(st == RP_EPOLICY, "a file at the cap is read and compiled (its NUL bytes are a syntax error: %s)", err.text);
    rp_policy_free(pol);
    pol = NULL;
    char *text = calloc(1, RP_POLICY_MAX_BYTES + 2);
    memset(text, ' ', RP_POLICY_MAX_BYTES + 1);
    st = rp_policy_load(cc, cfg, text, RP_POLICY_MAX_BYTES + 1, "inline.lua", NULL, NULL, false, &pol, &err);
    ok(st == RP_ERANGE && strstr(err.text, "policy 'inline.lua' is 1048577 bytes of source; a policy may be at most"),
       "source text over the cap is refused too (staged or from a checkpoint)");
    free(text);
    rp_policy_free(pol);
    pol = NULL;
    if (have_fifo) {
        st = rp_policy_open(cc, cfg, fifo, NULL, NULL, NULL, &pol, &err);
        ok(st == RP_EIO && strstr(err.text, "fifo.lua' is a FIFO; a policy is read from a regular .lua file"),
           "a FIFO is not opened as a policy: %s", err.text);
        rp_policy_free(pol);
        pol = NULL;
    } else {
        skip(1, "mkfifo failed");
    }

    /* the listing skips each of them with a warning, without hanging or reading them */
    setenv("RP_POLICY_PATH", dir, 1);
    rp_policy_info *infos = NULL;
    int32_t count = 0;
    c.peak = c.live;
    st = rp_policy_list(cc, cfg, &infos, &count, &err);
    bool good = false;
    for (int32_t i = 0; st == RP_OK && i < count; i++) good |= strcmp(infos[i].name, "good") == 0;
    ok(st == RP_OK && good, "the listing still lists the good policy");
    ok(c.peak - c.live < 32 << 20, "and reads none of the big files (peak %ld bytes above the start)", c.peak - c.live);
    ok(strstr(warnings, "huge.lua' is 1073741824 bytes") && strstr(warnings, "over.lua' is 1048577 bytes"),
       "it warns about each big file by size");
    if (have_fifo) ok(strstr(warnings, "fifo.lua' is a FIFO; a policy is read from a regular .lua file") != NULL,
                      "and about the FIFO, which it does not wait on");
    else skip(1, "mkfifo failed");
    if (!strstr(warnings, "FIFO")) diag("%s", warnings);
    unsetenv("RP_POLICY_PATH");
    rp_text_free(cc, (char *)infos);
    rp_context_free(cc);
    alarm(0);
    unlink(huge);
    unlink(over);
    unlink(at_cap);
}

/* ---- the clock after a host primitive --------------------------------------------------- */

/* Time stands at 0 for the first read (arming the call) and is 1000 s after it. */
static int clock_reads;
static double jumping_clock(void *ud)
{
    (void)ud;
    return clock_reads++ == 0 ? 0 : 1000;
}

static void test_clock_after_primitive(void)
{
    rp_policy *pol = NULL;
    rp_error err;
    const char *src = "return {" HEAD "init = function(ctx) rp.argsort({3, 1, 2}) error('not stopped') end, " PLAN "}";
    rp_status st = rp_policy_load(ctx, cfg, src, strlen(src), "clock.lua", NULL, NULL, false, &pol, &err);
    ok(st == RP_OK, "a policy whose init calls a primitive loads");
    if (st != RP_OK) return;
    rp_sandbox_set_clock(pol->sb, jumping_clock, NULL);
    clock_reads = 0;
    st = rp_policy_init(pol, NULL, &err);
    ok(st == RP_ELIMIT && strstr(err.text, "policy exceeded the wall-time limit of 5 s"),
       "an rp.* call after which the time is up fails the call at once (%s)", err.text);
    rp_sandbox_set_clock(pol->sb, NULL, NULL);
    rp_policy_free(pol);
}

int main(void)
{
    rp_error err;
    rp_context_new(NULL, NULL, &ctx);
    if (rp_config_parse(ctx, config_text, strlen(config_text), "<inline>", &cfg, &err) != RP_OK) {
        ok(0, "config: %s", err.text);
        return tap_done();
    }
    snprintf(tmp, sizeof tmp, "/tmp/rp_test_policy_XXXXXX");
    if (!mkdtemp(tmp)) {
        ok(0, "mkdtemp");
        return tap_done();
    }
    test_valid();
    test_metadata_errors();
    test_params();
    test_params_reach_ctx();
    test_search_path();
    test_shipped_load();
    test_policy_files();
    test_clock_after_primitive();
    rp_policy_free(last);
    rp_config_free(cfg);
    rp_context_free(ctx);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) diag("could not remove %s", tmp);
    return tap_done();
}
