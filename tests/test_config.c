/* Configuration: the bundled examples, defaults, the strict JSON layer (positions,
 * unknown keys, typed getters), the invalid-config suite and allocation failures. */
#include "internal.h"
#include "jsonx.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <dirent.h>
#include <stdlib.h>

#define EXAMPLES RP_SOURCE_DIR "/examples/"
#define INVALID_DIR RP_SOURCE_DIR "/tests/data/invalid/config"

static rp_status parse_inline(rp_context *ctx, const char *text, rp_config **cfg, rp_error *err)
{
    return rp_config_parse(ctx, text, strlen(text), NULL, cfg, err);
}

static void test_small_example(rp_context *ctx)
{
    rp_config *cfg = NULL;
    rp_error err;
    rp_status st = rp_config_load(ctx, EXAMPLES "config-small.json", &cfg, &err);
    is_int(st, RP_OK, "config-small.json loads");
    if (st != RP_OK) {
        diag("%s", err.text);
        return;
    }
    like(rp_config_source(cfg), "examples/config-small.json", "source is the file name");
    const rp_topology *t = rp_config_topology(cfg);
    is_int(t->num_nodes, 1, "small: 1 node");
    is_int(t->gpus_per_node, 8, "small: 8 GPUs per node");
    is_int(t->num_gpus, 8, "small: 8 GPUs");
    is_int(t->dp_size, 8, "small: DP size is the GPU count");
    is_int(t->ep_size, 8, "small: EP 8");
    is_int(t->num_ep_groups, 1, "small: one EP group");
    int all10 = 1;
    for (int g = 0; g < 8; g++) all10 &= t->slots[g] == 10 && t->speed[g] == 1.0;
    ok(all10, "small: 10 slots and speed 1.0 on every GPU");
    is_double(t->nvlink_bytes_per_s, 450e9, 0, "default NVLink bandwidth");
    is_double(t->nvlink_latency_s, 3e-6, 1e-15, "default NVLink latency in seconds");
    is_double(t->net_bytes_per_s, 50e9, 0, "default network bandwidth");
    is_double(t->net_latency_s, 10e-6, 1e-15, "default network latency in seconds");

    const rp_hardware *h = rp_config_hardware(cfg);
    is_double(h->peak_flops, 989e12, 0, "default peak FLOP/s");
    is_double(h->hbm_bytes_per_s, 4.8e12, 0, "default HBM bandwidth");
    is_double(h->hbm_bytes, 141e9, 0, "default HBM capacity");
    is_int(h->num_attention_efficiency, 6, "default attention efficiency curve has 6 points");
    ok(h->attention_efficiency[0].tokens == 512 && h->attention_efficiency[0].efficiency == 0.25,
       "attention curve starts at 0.25 at 512 tokens");
    ok(h->attention_efficiency[5].tokens == 16384 && h->attention_efficiency[5].efficiency == 0.6,
       "attention curve ends at 0.6 at 16384 tokens");
    is_double(h->dense_efficiency, 0.7, 0, "default dense efficiency");
    ok(h->backward.attention == 3.0 && h->backward.projections == 2.0 && h->backward.experts == 2.0 &&
           h->backward.token_linear == 2.0 && h->backward.communication == 1.0 && h->backward.fixed == 2.0,
       "default backward multipliers: attention 3, GEMMs and elementwise 2, communication 1, fixed 2");
    is_double(h->token_linear_bytes_per_token, (16.0 * 2048 + 3.0 * 8 * 2048 + 3.0 * 8 * 1024) * 2, 0,
              "default token-linear bytes = (16 d + 3 k d + 3 k f) x bytes_per_param");
    is_double(h->layer_fixed_s, 40e-6, 1e-18, "default fixed cost 40 us per (microbatch, layer)");
    is_int(h->num_gemm_efficiency, 6, "default GEMM efficiency curve has 6 points");
    is_double(h->gemm_efficiency[0].tokens, 1, 0, "curve starts at 1 token");
    is_double(h->gemm_efficiency[5].tokens, 4096, 0, "curve ends at 4096 tokens");
    is_double(h->gemm_efficiency[5].efficiency, 0.78, 0, "efficiency 0.78 at 4096 tokens");
    const rp_execution *x = rp_config_execution(cfg);
    ok(x->sync == RP_SYNC_GROUP && x->overlap == RP_OVERLAP_NONE && x->dispatch_dedup == RP_DEDUP_GPU &&
           x->dispatch_bytes_per_element == 2 && x->combine_bytes_per_element == 2,
       "default execution: sync group, overlap none, a copy per destination GPU (routepack_torch), 2 bytes per "
       "element each way (bytes_per_param)");
    /* routepack_torch on config-small: gradients exchanged among holders in the weights'
     * dtype; one 15 us sync a layer forward; extras fetched once, not stacked */
    ok(x->executor == RP_EXECUTOR_ROUTEPACK_TORCH && x->replica_grad_reduce == RP_GRAD_REDUCE_HOLDERS &&
           x->replica_grad_bytes_per_element == 2 && fabs(x->host_s_per_layer - 15e-6) < 1e-15 &&
           x->levers == (RP_LEVER_REPLICAS | RP_LEVER_SHARES | RP_LEVER_EXTRAS) && !x->extras_stacked &&
           x->extras_once,
       "default executor routepack_torch: holders exchange in BF16, 15 us of host costs a layer, replicas, shares "
       "and extras");
    ok(!rp_config_trainer(cfg)->per_forward_balancer, "and no per-forward balancer");

    const rp_model *m = rp_config_model(cfg);
    is_int(m->num_layers, 16, "small: 16 layers");
    is_int(m->num_experts, 64, "small: 64 experts");
    is_int(m->top_k, 8, "small: top-8");
    is_int(m->hidden_size, 2048, "small: hidden 2048");
    is_int(m->expert_ffn_size, 1024, "small: expert FFN 1024");
    is_int(m->num_heads, 16, "small: 16 heads");
    is_int(m->num_kv_heads, 16, "small: 16 KV heads");
    is_int(m->head_dim, 128, "small: head dim 128");
    is_int(m->bytes_per_param, 2, "default bytes per parameter");
    is_int(m->bytes_per_optimizer_state, 12, "default optimizer bytes per parameter");
    is_int(m->bytes_per_grad, 4, "default gradient bytes per parameter: FP32 main grads");
    /* 16 layers x (attention projections d dh (2h + 2hkv) + router d E) */
    ok(m->dense_params == (int64_t)16 * (2048LL * 128 * (2 * 16 + 2 * 16) + 2048LL * 64),
       "default dense parameters: attention projections and routers of every layer (%lld)",
       (long long)m->dense_params);
    ok(x->optimizer_sharding == RP_OPTIMIZER_SHARDING_NONE, "default optimizer sharding: none");
    ok(x->staging_budget_bytes == 0, "default staging budget: 0, no limit (the scheduler's default)");

    const rp_limits *l = rp_config_limits(cfg);
    is_int(l->max_tokens_per_microbatch, 16384, "small: 16384 tokens per microbatch");
    is_int(l->num_microbatches, 0, "default: the plan chooses the microbatch count");
    is_double(l->max_activation_bytes, 0, 0, "default: no activation cap");
    is_double(l->activation_bytes_per_token, 17.0 * 2048 * 2 * 16, 0,
              "default activation bytes per token = 17 * hidden * bytes_per_param * layers");

    const rp_policy_config *p = rp_config_policy(cfg);
    is_str(p->name, "routepack", "policy name");
    is_str(p->params_json, "{}", "absent params are an empty object");
    ok(p->search_path && p->search_path[0] == NULL, "empty search path is NULL-terminated");
    rp_config_free(cfg);
}

static void test_reference_and_large(rp_context *ctx)
{
    rp_config *cfg = NULL;
    rp_error err;
    rp_status st = rp_config_load(ctx, EXAMPLES "config-reference.json", &cfg, &err);
    is_int(st, RP_OK, "config-reference.json loads");
    if (st == RP_OK) {
        const rp_topology *t = rp_config_topology(cfg);
        const rp_model *m = rp_config_model(cfg);
        is_int(t->num_gpus, 64, "reference: 64 GPUs");
        is_int(t->num_ep_groups, 8, "reference: 8 EP groups of 8");
        is_int(t->slots[63], 18, "reference: 18 slots per GPU");
        is_int(m->num_layers, 48, "reference: 48 layers");
        is_int(m->num_experts, 128, "reference: 128 experts");
        is_int(m->num_kv_heads, 4, "reference: 4 KV heads (GQA)");
        is_int(m->expert_ffn_size, 768, "reference: expert FFN 768");
        is_int(rp_config_limits(cfg)->max_tokens_per_microbatch, 32768, "reference: 32768 tokens");
        const rp_policy_config *p = rp_config_policy(cfg);
        ok(p->search_path[0] && p->search_path[1] == NULL, "reference: one search path entry");
        like(p->search_path[0], "/examples/../policies", "relative search path resolved against the config's directory");
        rp_config_free(cfg);
    } else {
        diag("%s", err.text);
    }

    st = rp_config_load(ctx, EXAMPLES "config-large.json", &cfg, &err);
    is_int(st, RP_OK, "config-large.json loads");
    if (st == RP_OK) {
        const rp_topology *t = rp_config_topology(cfg);
        const rp_model *m = rp_config_model(cfg);
        is_int(t->num_gpus, 256, "large: 256 GPUs");
        is_int(t->num_nodes, 32, "large: 32 nodes");
        is_int(t->ep_size, 64, "large: EP 64 across nodes");
        is_int(t->num_ep_groups, 4, "large: 4 EP groups");
        is_int(t->slots[100], 3, "large: 3 slots per GPU");
        is_int(m->num_layers, 45, "large: 45 layers");
        is_int(m->num_experts, 128, "large: 128 experts");
        is_int(m->hidden_size, 4096, "large: hidden 4096");
        ok(rp_config_execution(cfg)->optimizer_sharding == RP_OPTIMIZER_SHARDING_DP, "large: distributed optimizer");
        rp_config_free(cfg);
    } else {
        diag("%s", err.text);
    }

    /* every bundled example fits its GPUs (rp_config_parse refuses one that does not) */
    st = rp_config_load(ctx, EXAMPLES "config-large-ep8.json", &cfg, &err);
    is_int(st, RP_OK, "config-large-ep8.json loads: it fits in GPU memory");
    if (st == RP_OK) {
        is_int(rp_config_topology(cfg)->ep_size, 8, "large-ep8: EP 8 in-node");
        is_int(rp_config_execution(cfg)->staging_budget_bytes, 2000000000, "large-ep8: 2 GB staging budget");
        rp_config_free(cfg);
    } else {
        diag("%s", err.text);
    }
}

static const char *const minimal =
    "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 4},\n"
    " \"model\": {\"num_layers\": 2, \"num_experts\": 10, \"top_k\": 2, \"hidden_size\": 64,\n"
    "   \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},\n"
    " \"limits\": {\"max_tokens_per_microbatch\": 1e3}}";

static void test_defaults_and_forms(rp_context *ctx)
{
    rp_config *cfg = NULL;
    rp_error err;
    rp_status st = parse_inline(ctx, minimal, &cfg, &err);
    is_int(st, RP_OK, "minimal inline config parses");
    if (st != RP_OK) {
        diag("%s", err.text);
        return;
    }
    const rp_topology *t = rp_config_topology(cfg);
    is_str(rp_config_source(cfg), "<inline>", "inline source name");
    is_int(t->ep_size, 4, "ep_size defaults to gpus_per_node");
    is_int(t->num_ep_groups, 2, "two EP groups");
    is_int(t->slots[0], 3, "slots default to ceil(experts / ep_size)");
    is_int(rp_config_model(cfg)->num_kv_heads, 4, "num_kv_heads defaults to num_heads");
    is_int(rp_config_limits(cfg)->max_tokens_per_microbatch, 1000, "1e3 accepted for an integer");
    is_str(rp_config_policy(cfg)->name, "routepack", "policy section is optional");
    rp_config_free(cfg);

    const char *full =
        "{\"$schema\": \"x\", \"comment\": \"c\",\n"
        " \"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 4, \"dp_size\": 4,\n"
        "   \"slots_per_gpu\": [3, 2, 3, 2], \"gpu_speed\": [1, 0.5, 1, 2.0],\n"
        "   \"nvlink_bytes_per_s\": 1e9, \"nvlink_latency_us\": 0, \"net_bytes_per_s\": 2.5e8,\n"
        "   \"net_latency_us\": 20},\n"
        " \"hardware\": {\"gemm_efficiency\": [[8, 0.25], [100.5, 1]], \"backward_multiplier\": 3,\n"
        "   \"peak_flops\": 1e15, \"dense_efficiency\": 1},\n"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 10, \"top_k\": 10, \"hidden_size\": 64,\n"
        "   \"expert_ffn_size\": 32, \"num_heads\": 8, \"num_kv_heads\": 2, \"head_dim\": 16,\n"
        "   \"bytes_per_param\": 4, \"bytes_per_optimizer_state\": 0},\n"
        " \"limits\": {\"max_tokens_per_microbatch\": 4096, \"num_microbatches\": 3,\n"
        "   \"max_activation_bytes\": 8e9, \"activation_bytes_per_token\": 1000.5},\n"
        " \"policy\": {\"name\": \"eplb\", \"params\": {\"b\": [1, 2.5], \"a\": \"x\\\"y\"},\n"
        "   \"search_path\": [\"/abs/dir\", \"rel\"]}}";
    st = rp_config_parse(ctx, full, strlen(full), "conf/dir/my.json", &cfg, &err);
    is_int(st, RP_OK, "config with every key parses");
    if (st != RP_OK) {
        diag("%s", err.text);
        return;
    }
    t = rp_config_topology(cfg);
    is_int(t->num_ep_groups, 1, "EP group spanning two nodes");
    ok(t->slots[0] == 3 && t->slots[1] == 2 && t->slots[3] == 2, "per-GPU slots array");
    ok(t->speed[1] == 0.5 && t->speed[3] == 2.0, "per-GPU speed array");
    is_double(t->nvlink_latency_s, 0, 0, "zero latency allowed");
    is_double(t->net_latency_s, 20e-6, 1e-15, "latency converted to seconds");
    is_double(t->net_bytes_per_s, 2.5e8, 0, "network bandwidth");
    const rp_hardware *h = rp_config_hardware(cfg);
    is_int(h->num_gemm_efficiency, 2, "custom GEMM curve");
    is_double(h->gemm_efficiency[1].tokens, 100.5, 0, "curve tokens");
    is_double(h->gemm_efficiency[1].efficiency, 1, 0, "efficiency 1 allowed");
    ok(h->backward.attention == 3 && h->backward.experts == 3 && h->backward.fixed == 3 &&
           h->backward.communication == 1,
       "backward_multiplier sets every compute term, not communication");
    is_double(h->attention_efficiency[0].efficiency, 0.25, 0, "unset hardware keys keep defaults");
    const rp_model *m = rp_config_model(cfg);
    is_int(m->top_k, 10, "top_k may equal num_experts");
    is_int(m->bytes_per_optimizer_state, 0, "no optimizer state allowed");
    const rp_limits *l = rp_config_limits(cfg);
    is_int(l->num_microbatches, 3, "num_microbatches");
    is_double(l->max_activation_bytes, 8e9, 0, "activation cap");
    is_double(l->activation_bytes_per_token, 1000.5, 0, "explicit activation bytes per token");
    const rp_policy_config *p = rp_config_policy(cfg);
    is_str(p->name, "eplb", "policy name");
    is_str(p->params_json, "{\"b\":[1,2.5],\"a\":\"x\\\"y\"}", "params kept as compact JSON, key order kept");
    is_str(p->search_path[0], "/abs/dir", "absolute search path kept");
    is_str(p->search_path[1], "conf/dir/rel", "relative search path joined to the config's directory");
    ok(p->search_path[2] == NULL, "search path NULL-terminated");
    rp_config_free(cfg);
    rp_config_free(NULL);

    /* errors leave the output alone */
    rp_config *untouched = (rp_config *)&err;
    is_int(parse_inline(ctx, "{\"topology\": 1}", &untouched, &err), RP_EINVAL, "bad config fails");
    ok(untouched == (rp_config *)&err, "failed parse leaves *out unchanged");
    is_int(rp_config_load(ctx, RP_SOURCE_DIR "/tests/data/no-such-config.json", &cfg, &err), RP_EIO,
           "missing file is an I/O error");
    like(err.text, "no-such-config.json: cannot open", "missing file message names the file");
}

/* The JSON layer alone: positions, paths and getters. */
/* The cost-model structure keys of issue 14: attention curve, per-term backward,
 * token-linear bytes, fixed cost, and the execution section. */
static void test_structure_keys(rp_context *ctx)
{
    rp_config *cfg = NULL;
    rp_error err;
    const char *text =
        "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2},\n"
        " \"hardware\": {\"attention_efficiency\": [[100, 0.2], [1000.5, 0.7]], \"backward_multiplier\": 1.5,\n"
        "   \"backward\": {\"attention\": 2.75, \"communication\": 0, \"comment\": \"c\"},\n"
        "   \"token_linear_bytes_per_token\": 0, \"layer_fixed_us\": 12.5},\n"
        " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 64,\n"
        "   \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16, \"bytes_per_param\": 1},\n"
        " \"limits\": {\"max_tokens_per_microbatch\": 100},\n"
        " \"execution\": {\"executor\": \"deepep\", \"sync\": \"global\", \"overlap\": \"layer\",\n"
        "   \"dispatch_dedup\": \"node\", \"dispatch_bytes_per_element\": 1, \"comment\": \"FP8 dispatch\"}}";
    rp_status st = parse_inline(ctx, text, &cfg, &err);
    is_int(st, RP_OK, "config with every structure key parses");
    if (st != RP_OK) {
        diag("%s", err.text);
        return;
    }
    const rp_hardware *h = rp_config_hardware(cfg);
    ok(h->num_attention_efficiency == 2 && h->attention_efficiency[1].tokens == 1000.5 &&
           h->attention_efficiency[1].efficiency == 0.7,
       "attention efficiency curve by sequence length");
    ok(h->backward.attention == 2.75 && h->backward.communication == 0, "backward object overrides terms");
    ok(h->backward.projections == 1.5 && h->backward.experts == 1.5 && h->backward.token_linear == 1.5 &&
           h->backward.fixed == 1.5,
       "other compute terms take backward_multiplier");
    is_double(h->token_linear_bytes_per_token, 0, 0, "token-linear bytes 0 means none, not the default");
    is_double(h->layer_fixed_s, 12.5e-6, 1e-18, "layer_fixed_us in seconds");
    const rp_execution *x = rp_config_execution(cfg);
    ok(x->sync == RP_SYNC_GLOBAL && x->overlap == RP_OVERLAP_LAYER && x->dispatch_dedup == RP_DEDUP_NODE &&
           x->dispatch_bytes_per_element == 1 && x->combine_bytes_per_element == 2,
       "execution: sync global, overlap layer, dedup node, 1 byte per element (combine stays deepep's BF16 2)");
    rp_config_free(cfg);

    cfg = NULL;
    text = "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2},\n"
           " \"hardware\": {\"attention_efficiency\": 0.4},\n"
           " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 64,\n"
           "   \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},\n"
           " \"limits\": {\"max_tokens_per_microbatch\": 100},\n"
           " \"execution\": {\"dispatch_dedup\": \"choice\"}}";
    st = parse_inline(ctx, text, &cfg, &err);
    is_int(st, RP_OK, "a number for attention_efficiency parses");
    if (st == RP_OK) {
        h = rp_config_hardware(cfg);
        ok(h->num_attention_efficiency == 1 && h->attention_efficiency[0].efficiency == 0.4,
           "... as a flat curve of one point");
        is_double(h->token_linear_bytes_per_token, (16.0 * 64 + 3.0 * 2 * 64 + 3.0 * 2 * 32) * 2, 0,
                  "token-linear default follows the model shape");
        ok(h->backward.attention == 3.0 && h->backward.experts == 2.0, "per-term defaults without the shorthand");
        ok(rp_config_execution(cfg)->dispatch_dedup == RP_DEDUP_CHOICE &&
               rp_config_execution(cfg)->sync == RP_SYNC_GROUP,
           "dedup per choice; sync keeps its default");
    } else {
        diag("%s", err.text);
    }
    rp_config_free(cfg);
}

static void test_jsonx(void)
{
    const char *text =
        "{\n"
        "  \"a\": {\"b\": [10, {\"c\": \"x{y}[z]\\\"\"}, 30],\n"
        "        \"s\": \"}\\\\\", \"t\": true},\n"
        "  \"k\\u00e9y\": 5, \"d\\\"q\": [ [1, 2], [3, [4, 5]] ],\n"
        "\t\"\xc3\xa9\": 7, \"n\": -1.5e3, \"f\": 0.25\n"
        "}\n";
    rp_jdoc doc;
    rp_error err;
    is_int(rp_jdoc_parse(&doc, text, strlen(text), "t.json", &err), RP_OK, "jdoc parses");
    int32_t line, col;
    rp_jdoc_locate(&doc, "", &line, &col);
    ok(line == 1 && col == 1, "root at 1:1 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a", &line, &col);
    ok(line == 2 && col == 8, "a at 2:8 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.b", &line, &col);
    ok(line == 2 && col == 14, "a.b at 2:14 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.b[0]", &line, &col);
    ok(line == 2 && col == 15, "a.b[0] at 2:15 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.b[2]", &line, &col);
    ok(line == 2 && col == 39, "a.b[2] after a string with braces and an escaped quote at 2:39 (got %d:%d)",
       line, col);
    rp_jdoc_locate(&doc, "a.b[1].c", &line, &col);
    ok(line == 2 && col == 25, "a.b[1].c at 2:25 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.t", &line, &col);
    ok(line == 3 && col == 26, "a.t after a string ending in an escaped backslash at 3:26 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "k\xc3\xa9y", &line, &col);
    ok(line == 4 && col == 15, "key written with a \\u escape matches at 4:15 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "d\"q[1][1][0]", &line, &col);
    ok(line == 4 && col == 41, "nested arrays under a key with an escaped quote at 4:41 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "n", &line, &col);
    ok(line == 5 && col == 15, "columns count a tab and a UTF-8 character once: 5:15 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.missing", &line, &col);
    ok(line == 2 && col == 8, "missing key reported at its object 2:8 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.b[7]", &line, &col);
    ok(line == 2 && col == 14, "index past the end reported at its array 2:14 (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "a.b[1].c.deeper", &line, &col);
    ok(line == 2 && col == 25, "path through a string stops at the string (got %d:%d)", line, col);
    rp_jdoc_locate(&doc, "x.y.z", &line, &col);
    ok(line == 1 && col == 1, "missing top key reported at the root (got %d:%d)", line, col);

    /* getters */
    json_t *a = json_object_get(doc.root, "a");
    json_t *v;
    int64_t i;
    double d;
    bool b;
    const char *s;
    is_int(rp_jdoc_int(&doc, doc.root, "", "k\xc3\xa9y", true, 0, 0, 10, &i, &err), RP_OK, "int getter");
    is_int(i, 5, "int value");
    is_int(rp_jdoc_int(&doc, doc.root, "", "n", true, 0, INT64_MIN, INT64_MAX, &i, &err), RP_OK,
           "int getter accepts -1.5e3, an integer written as a real");
    is_int(i, -1500, "integral real value");
    is_int(rp_jdoc_int(&doc, doc.root, "", "f", true, 0, INT64_MIN, INT64_MAX, &i, &err), RP_EINVAL,
           "int getter rejects a fraction");
    like(err.text, "t.json:5:28: f must be an integer, got 0.25", "fraction message with position");
    is_int(rp_jdoc_int(&doc, doc.root, "", "k\xc3\xa9y", true, 0, 6, 10, &i, &err), RP_ERANGE, "int below min");
    like(err.text, "t.json:4:15: k\xc3\xa9y must be >= 6, got 5", "min message with position");
    is_int(err.line, 4, "err.line set");
    is_int(err.column, 15, "err.column set");
    is_int(rp_jdoc_int(&doc, doc.root, "", "nope", false, 42, 0, 1, &i, &err), RP_OK, "absent optional int");
    is_int(i, 42, "default stored (even outside the range: the caller's choice)");
    is_int(rp_jdoc_int(&doc, a, "a", "nope", true, 0, 0, 1, &i, &err), RP_EINVAL, "absent required int");
    like(err.text, "t.json:2:8: a.nope is required", "required message at the object");
    is_int(rp_jdoc_num(&doc, doc.root, "", "n", true, 0, -2000, 0, &d, &err), RP_OK, "number getter");
    is_double(d, -1500, 0, "number value");
    is_int(rp_jdoc_num(&doc, a, "a", "t", true, 0, 0, 1, &d, &err), RP_EINVAL, "number getter rejects true");
    like(err.text, "a.t must be a number, got true", "type message");
    is_int(rp_jdoc_bool(&doc, a, "a", "t", true, false, &b, &err), RP_OK, "bool getter");
    ok(b, "bool value");
    is_int(rp_jdoc_bool(&doc, a, "a", "s", true, false, &b, &err), RP_EINVAL, "bool getter rejects a string");
    like(err.text, "t.json:3:14: a.s must be true or false, got a string", "bool type message");
    is_int(rp_jdoc_str(&doc, a, "a", "s", true, NULL, &s, &err), RP_OK, "string getter");
    is_str(s, "}\\", "string value decoded");
    is_int(rp_jdoc_str(&doc, a, "a", "zz", false, "dflt", &s, &err), RP_OK, "absent string");
    is_str(s, "dflt", "default string");
    is_int(rp_jdoc_arr(&doc, a, "a", "b", true, &v, &err), RP_OK, "array getter");
    ok(json_is_array(v), "array value");
    is_int(rp_jdoc_obj(&doc, a, "a", "b", true, &v, &err), RP_EINVAL, "object getter rejects an array");
    like(err.text, "t.json:2:14: a.b must be an object, got an array", "object type message");
    is_int(rp_jdoc_obj(&doc, a, "a", "none", false, &v, &err), RP_OK, "absent optional object");
    ok(v == NULL, "absent object is NULL");
    is_int(rp_jdoc_int_value(&doc, json_array_get(json_object_get(a, "b"), 2), "a.b[2]", 0, 20, &i, &err),
           RP_ERANGE, "element getter checks the range");
    like(err.text, "t.json:2:39: a.b[2] must be <= 20, got 30", "element message at the element");

    static const char *const allowed_a[] = {"b", "s", "t", NULL};
    is_int(rp_jdoc_check_keys(&doc, a, "a", allowed_a, &err), RP_OK, "all keys allowed");
    static const char *const allowed_root[] = {"a", "k\xc3\xa9y", "d\"q", "\xc3\xa9", "nn", "f", NULL};
    is_int(rp_jdoc_check_keys(&doc, doc.root, "", allowed_root, &err), RP_EINVAL, "unknown key found");
    like(err.text, "t.json:5:10: unknown key 'n' (did you mean 'nn'?)",
         "unknown key at the key's position with a suggestion");
    static const char *const far[] = {"alpha", "beta", NULL};
    is_int(rp_jdoc_check_keys(&doc, a, "a", far, &err), RP_EINVAL, "no close key");
    like(err.text, "t.json:2:9: a: unknown key 'b' (allowed: alpha, beta)", "no suggestion lists the allowed keys");
    is_int(rp_jdoc_check_keys(&doc, json_object_get(a, "b"), "a.b", far, &err), RP_EINVAL,
           "check_keys rejects a non-object");
    like(err.text, "a.b must be an object, got an array", "non-object message");
    rp_jdoc_free(&doc);
    rp_jdoc_free(&doc); /* idempotent */

    char buf[64];
    is_str(rp_jpath_key(buf, sizeof buf, "", "c"), "c", "path join at the root");
    is_str(rp_jpath_key(buf, sizeof buf, "a.b", "c"), "a.b.c", "path join");
    is_str(rp_jpath_index(buf, sizeof buf, "a", 3), "a[3]", "path index");

    /* a syntax error keeps jansson's text and position */
    const char *bad = "{\n  \"a\": [1,\n  2,, 3]}";
    is_int(rp_jdoc_parse(&doc, bad, strlen(bad), "bad.json", &err), RP_EFORMAT, "syntax error");
    like(err.text, "bad.json:3:5: unexpected token near ','", "syntax error message and position");
    is_int(err.line, 3, "syntax error line");
    ok(doc.root == NULL, "no document after a syntax error");
    rp_jdoc_free(&doc);

    /* the locator survives text that is not JSON */
    rp_jdoc junk = {"j", "{\"a\": [1, \"unterminated", 23, NULL};
    rp_jdoc_locate(&junk, "a[5].b", &line, &col);
    ok(line == 1 && col == 7, "truncated text: deepest found value (got %d:%d)", line, col);
    rp_jdoc empty = {"e", "", 0, NULL};
    rp_jdoc_locate(&empty, "a", &line, &col);
    ok(line == 1 && col == 1, "empty text locates at 1:1");
}

/* The example in docs/config.md must load, so the documentation cannot rot. */
static void test_docs_example(rp_context *ctx)
{
    char *md = slurp(RP_SOURCE_DIR "/docs/config.md", NULL);
    ok(md != NULL, "read docs/config.md");
    if (!md) return;
    char *start = strstr(md, "```json\n");
    char *end = start ? strstr(start + 8, "```") : NULL;
    ok(start && end, "docs/config.md has a json example");
    if (start && end) {
        rp_config *cfg = NULL;
        rp_error err;
        rp_status st = rp_config_parse(ctx, start + 8, (size_t)(end - start - 8), "docs/config.md", &cfg, &err);
        is_int(st, RP_OK, "the documented example loads");
        if (st == RP_OK) {
            is_int(rp_config_topology(cfg)->slots[7], 10, "documented example: 10 slots per GPU");
            is_str(rp_config_policy(cfg)->params_json, "{\"horizon\":10}", "documented example: params");
            rp_config_free(cfg);
        } else {
            diag("%s", err.text);
        }
    }
    free(md);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* tests/data/invalid/config/NAME.json must fail with a message containing NAME.expect. */
static void test_invalid_suite(rp_context *ctx)
{
    DIR *dir = opendir(INVALID_DIR);
    ok(dir != NULL, "open %s", INVALID_DIR);
    if (!dir) return;
    char *names[256];
    size_t count = 0;
    struct dirent *de;
    while ((de = readdir(dir)) && count < 256) {
        size_t n = strlen(de->d_name);
        if (n > 5 && strcmp(de->d_name + n - 5, ".json") == 0) names[count++] = strdup(de->d_name);
    }
    closedir(dir);
    qsort(names, count, sizeof names[0], cmp_names);
    ok(count >= 30, "invalid suite has %zu cases", count);
    for (size_t c = 0; c < count; c++) {
        char path[1024], expect_path[1024];
        snprintf(path, sizeof path, "%s/%s", INVALID_DIR, names[c]);
        snprintf(expect_path, sizeof expect_path, "%s/%.*s.expect", INVALID_DIR,
                 (int)(strlen(names[c]) - 5), names[c]);
        char *expect = slurp(expect_path, NULL);
        if (!expect) {
            ok(0, "%s has a .expect file", names[c]);
            free(names[c]);
            continue;
        }
        size_t n = strlen(expect);
        while (n && (expect[n - 1] == '\n' || expect[n - 1] == '\r')) expect[--n] = '\0';
        rp_config *cfg = NULL;
        rp_error err;
        rp_status st = rp_config_load(ctx, path, &cfg, &err);
        ok(st != RP_OK && cfg == NULL, "%s is rejected", names[c]);
        if (st == RP_OK) rp_config_free(cfg);
        like(err.text, expect, "%s: message", names[c]);
        ok(err.line >= 1 && err.column >= 1, "%s: error carries line and column", names[c]);
        free(expect);
        free(names[c]);
    }
}

/* Fail each allocation of a parse in turn: every failure is RP_ENOMEM, nothing leaks,
 * and the context still works afterwards. */
static void test_alloc_failures(void)
{
    size_t len;
    char *text = slurp(EXAMPLES "config-reference.json", &len);
    ok(text != NULL, "read config-reference.json");
    if (!text) return;
    const char *files[2] = {EXAMPLES "config-small.json", EXAMPLES "config-reference.json"};
    for (int which = 0; which < 2; which++) {
        free(text);
        text = slurp(files[which], &len);
        int clean = 1, succeeded = 0;
        long n;
        for (n = 1; n < 10000 && !succeeded; n++) {
            counting c = {0};
            rp_context *ctx;
            rp_context_new(counting_alloc, &c, &ctx);
            c.fail_at = c.calls + n;
            rp_config *cfg = NULL;
            rp_error err;
            rp_status st = rp_config_parse(ctx, text, len, files[which], &cfg, &err);
            if (st == RP_OK) {
                succeeded = 1;
                rp_config_free(cfg);
            } else {
                if (st != RP_ENOMEM || cfg != NULL) clean = 0;
                c.fail_at = 0;
                st = rp_config_parse(ctx, text, len, files[which], &cfg, &err);
                if (st != RP_OK) clean = 0;
                else rp_config_free(cfg);
            }
            rp_context_free(ctx);
            if (c.live != 0) clean = 0;
        }
        ok(succeeded && n > 3, "parse %s succeeds once enough allocations succeed (%ld failure points)",
           which ? "reference" : "small", n - 2);
        ok(clean, "every allocation failure gives RP_ENOMEM, leaks nothing and leaves the context usable");
    }
    free(text);

    /* and through rp_config_load, which also reads the file */
    int clean = 1, succeeded = 0;
    for (long n = 1; n < 10000 && !succeeded; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        c.fail_at = c.calls + n;
        rp_config *cfg = NULL;
        rp_status st = rp_config_load(ctx, EXAMPLES "config-small.json", &cfg, NULL);
        if (st == RP_OK) {
            succeeded = 1;
            rp_config_free(cfg);
        } else if (st != RP_ENOMEM) {
            clean = 0;
        }
        rp_context_free(ctx);
        if (c.live != 0) clean = 0;
    }
    ok(succeeded && clean, "rp_config_load fails cleanly at every allocation");
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_small_example(ctx);
    test_reference_and_large(ctx);
    test_defaults_and_forms(ctx);
    test_structure_keys(ctx);
    test_jsonx();
    test_docs_example(ctx);
    test_invalid_suite(ctx);
    test_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
