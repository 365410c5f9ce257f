/* The configuration's loader: one JSON document read with jansson, validated key by key
 * into the topology, hardware, model, limits, execution, trainer and policy structs
 * (docs/config.md), then checked as a whole (memory, per-forward balancing). It sits
 * above the plan's checks (docs/layers.md, floor 4); the object it fills and its
 * accessors are config.c's, below everything that reads a config. The topology section
 * is config_topology.c; the loader's state and key readers are in config_load.h. */
#include "calibration.h"
#include "config_load.h"
#include "routepack/virtual_experts.h"
#include "jsonx.h"
#include "routepack/config.h"
#include "routepack/executor.h"
#include "routepack/memory.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Hard limits that keep every later size product inside int64 and memory sane. */
#define MAX_EXPERTS 65536
#define MAX_LAYERS 65536
#define MAX_DIM (1 << 24)
#define MAX_HEADS 65536
#define MAX_GEMM_POINTS 4096
#define MAX_SEARCH_PATH 1024
/* 10^15 parameters: far beyond any model, and every byte count stays exact in a double. */
#define MAX_DENSE_PARAMS ((int64_t)1000000000000000)


/* Default curves (docs/cost-model.md gives the sources). Grouped-GEMM efficiency of one
 * expert by its tokens: a large BF16 GEMM on an H200 reaches 0.78-0.81 of peak, grouped
 * MoE kernels at small per-expert batches far less. */
static const rp_eff_point default_gemm_efficiency[] = {
    {1, 0.02}, {16, 0.1}, {64, 0.28}, {256, 0.5}, {1024, 0.68}, {4096, 0.78},
};

/* Causal FlashAttention forward efficiency by sequence length (FlashAttention-2/3 on
 * Hopper, head dim 128: it rises about 2x from 512 to 16k tokens). */
static const rp_eff_point default_attention_efficiency[] = {
    {512, 0.25}, {1024, 0.35}, {2048, 0.45}, {4096, 0.52}, {8192, 0.56}, {16384, 0.6},
};

/* ---- hardware ------------------------------------------------------------------------ */

static const char *const hardware_keys[] = {
    "peak_flops", "hbm_bytes_per_s", "hbm_bytes", "attention_efficiency", "dense_efficiency",
    "gemm_efficiency", "backward_multiplier", "backward", "token_linear_bytes_per_token",
    "layer_fixed_us", "gemm_tile_rows", "grouped_gemm_efficiency", "wgrad_efficiency", "comment", NULL,
};

static const char *const backward_keys[] = {
    "attention", "projections", "experts", "experts_dgrad", "token_linear", "communication", "fixed", "comment",
    NULL,
};

/* An efficiency curve at `path`: absent, the default; else an array of [x, efficiency]
 * pairs with x > 0 strictly increasing and efficiency in (0, 1]. `xname` names x in
 * messages ("tokens", "sequence_length"). */
static rp_status load_curve(loader *ld, json_t *arr, const char *path, const char *xname,
                            const rp_eff_point *dflt, size_t num_dflt, rp_eff_point **out, int32_t *count)
{
    size_t n = arr ? json_array_size(arr) : num_dflt;
    if (arr && n == 0)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path, "must have at least one [%s, efficiency] point",
                            xname);
    if (n > MAX_GEMM_POINTS)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, path, "has %zu points, more than the %d supported",
                            n, MAX_GEMM_POINTS);
    rp_eff_point *pts = rp_calloc(ld->ctx, n, sizeof(rp_eff_point));
    if (!pts) return rp_fail_nomem(ld->err, "an efficiency curve");
    *out = pts;
    *count = (int32_t)n;
    if (!arr) {
        memcpy(pts, dflt, num_dflt * sizeof *pts);
        return RP_OK;
    }
    for (size_t i = 0; i < n; i++) {
        char ip[96], tp[96], ep[96];
        rp_jpath_index(ip, sizeof ip, path, i);
        rp_jpath_index(tp, sizeof tp, ip, 0);
        rp_jpath_index(ep, sizeof ep, ip, 1);
        json_t *point = json_array_get(arr, i);
        if (!json_is_array(point) || json_array_size(point) != 2 ||
            !json_is_number(json_array_get(point, 0)) || !json_is_number(json_array_get(point, 1)))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, ip, "must be a [%s, efficiency] pair of numbers",
                                xname);
        double x = json_number_value(json_array_get(point, 0));
        double eff = json_number_value(json_array_get(point, 1));
        if (!(x > 0))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, tp, "(%s) must be > 0, got %g", xname, x);
        if (i > 0 && !(x > pts[i - 1].tokens))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, tp,
                                "(%s) must be greater than the previous point's %g, got %g: points "
                                "are sorted by %s, strictly increasing",
                                xname, pts[i - 1].tokens, x, xname);
        if (!(eff > 0 && eff <= 1))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, ep,
                                "(efficiency) must be in (0, 1], got %g", eff);
        pts[i].tokens = x;
        pts[i].efficiency = eff;
    }
    return RP_OK;
}

/* attention_efficiency: one number (a flat curve) or a curve by sequence length. */
static rp_status load_attention_efficiency(loader *ld, json_t *obj)
{
    rp_hardware *h = &ld->cfg->hardware;
    const char *path = "hardware.attention_efficiency";
    json_t *v = json_object_get(obj, "attention_efficiency");
    rp_status st;
    if (v && !json_is_array(v)) {
        if (!json_is_number(v))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                                "must be a number or an array of [sequence_length, efficiency] pairs, got %s",
                                rp_jdoc_type_name(v));
        double eff;
        if ((st = get_fraction(ld, obj, "hardware", "attention_efficiency", 0.5, &eff)) != RP_OK) return st;
        const rp_eff_point flat = {1, eff};
        st = load_curve(ld, NULL, path, "sequence_length", &flat, 1, &ld->cfg->attention,
                        &h->num_attention_efficiency);
    } else {
        st = load_curve(ld, v, path, "sequence_length", default_attention_efficiency,
                        sizeof default_attention_efficiency / sizeof default_attention_efficiency[0],
                        &ld->cfg->attention, &h->num_attention_efficiency);
    }
    h->attention_efficiency = ld->cfg->attention;
    return st;
}

/* backward_multiplier sets every compute term; the backward object overrides terms one
 * by one. Defaults per term: docs/cost-model.md. */
static rp_status load_backward(loader *ld, json_t *obj)
{
    rp_backward *b = &ld->cfg->hardware.backward;
    const char *P = "hardware.backward";
    rp_status st;
    double all = 0;
    bool has_all = json_object_get(obj, "backward_multiplier") != NULL;
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, "hardware", "backward_multiplier", false, 2.0, 1.0, 1e3, &all,
                              ld->err),
                  st, out);
    ld->cfg->hardware.backward_experts_dgrad = -1.0; /* not given */
    *b = (rp_backward){
        .attention = has_all ? all : 3.0,
        .projections = all,
        .experts = all,
        .token_linear = all,
        .communication = 1.0,
        .fixed = all,
    };
    json_t *bo;
    RP_CHECK_GOTO(rp_jdoc_obj(&ld->doc, obj, "hardware", "backward", false, &bo, ld->err), st, out);
    if (!bo) return RP_OK;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, bo, P, backward_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, bo, P), st, out);
    struct {
        const char *key;
        double *field;
    } terms[] = {{"attention", &b->attention},       {"projections", &b->projections},
                 {"experts", &b->experts},           {"token_linear", &b->token_linear},
                 {"communication", &b->communication}, {"fixed", &b->fixed}};
    for (size_t i = 0; i < sizeof terms / sizeof terms[0]; i++)
        RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, bo, P, terms[i].key, false, *terms[i].field, 0.0, 1e3,
                                  terms[i].field, ld->err),
                      st, out);
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, bo, P, "experts_dgrad", false, -1.0, 0.0, 1e3,
                              &ld->cfg->hardware.backward_experts_dgrad, ld->err),
                  st, out);
out:
    return st;
}

static rp_status load_hardware(loader *ld, json_t *obj)
{
    const char *P = "hardware";
    rp_hardware *h = &ld->cfg->hardware;
    rp_status st;
    json_t *empty = NULL;
    if (!obj) obj = empty = json_object(); /* every key has a default */
    if (!obj) return rp_fail_nomem(ld->err, "the hardware section");
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, hardware_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(get_positive(ld, obj, P, "peak_flops", 989e12, DBL_MAX, &h->peak_flops), st, out);
    RP_CHECK_GOTO(get_positive(ld, obj, P, "hbm_bytes_per_s", 4.8e12, DBL_MAX, &h->hbm_bytes_per_s), st, out);
    RP_CHECK_GOTO(get_positive(ld, obj, P, "hbm_bytes", 141e9, DBL_MAX, &h->hbm_bytes), st, out);
    RP_CHECK_GOTO(load_attention_efficiency(ld, obj), st, out);
    RP_CHECK_GOTO(get_fraction(ld, obj, P, "dense_efficiency", 0.7, &h->dense_efficiency), st, out);
    json_t *gemm;
    RP_CHECK_GOTO(rp_jdoc_arr(&ld->doc, obj, P, "gemm_efficiency", false, &gemm, ld->err), st, out);
    RP_CHECK_GOTO(load_curve(ld, gemm, "hardware.gemm_efficiency", "tokens", default_gemm_efficiency,
                             sizeof default_gemm_efficiency / sizeof default_gemm_efficiency[0], &ld->cfg->gemm,
                             &h->num_gemm_efficiency),
                  st, out);
    h->gemm_efficiency = ld->cfg->gemm;
    /* the grouped GEMM's curves: absent, the cost model derives them from gemm_efficiency
     * (docs/cost-model.md, "Experts") */
    struct {
        const char *key, *xname;
        rp_eff_point **store;
        const rp_eff_point **view;
        int32_t *count;
    } optional[] = {
        {"grouped_gemm_efficiency", "rows", &ld->cfg->grouped_gemm, &h->grouped_gemm_efficiency,
         &h->num_grouped_gemm_efficiency},
        {"wgrad_efficiency", "rows", &ld->cfg->wgrad, &h->wgrad_efficiency, &h->num_wgrad_efficiency},
    };
    for (size_t i = 0; i < sizeof optional / sizeof optional[0]; i++) {
        json_t *arr;
        char kp[96];
        RP_CHECK_GOTO(rp_jdoc_arr(&ld->doc, obj, P, optional[i].key, false, &arr, ld->err), st, out);
        if (!arr) continue;
        RP_CHECK_GOTO(load_curve(ld, arr, rp_jpath_key(kp, sizeof kp, P, optional[i].key), optional[i].xname, NULL,
                                 0, optional[i].store, optional[i].count),
                      st, out);
        *optional[i].view = *optional[i].store;
    }
    RP_CHECK_GOTO(get_i32(ld, obj, P, "gemm_tile_rows", false, 0, 1, 1 << 16, &h->gemm_tile_rows), st, out);
    RP_CHECK_GOTO(load_backward(ld, obj), st, out);
    double us;
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, P, "layer_fixed_us", false, 40.0, 0, 1e9, &us, ld->err), st, out);
    h->layer_fixed_s = us * 1e-6;
out:
    json_decref(empty);
    return st;
}

/* token_linear_bytes_per_token defaults to a formula of the model shape: read after the
 * model. Per token and layer, forward, in elements of bytes_per_param (docs/cost-model.md):
 * two RMSNorms 2 x 2d, RoPE on q and k 4d, two residual adds 2 x 3d, the router's read d,
 * permute k x 2d, SwiGLU's activation k x 3f, unpermute and weighted sum k d + d. */
static rp_status load_token_linear(loader *ld, json_t *obj)
{
    rp_hardware *h = &ld->cfg->hardware;
    const rp_model *m = &ld->cfg->model;
    double d = m->hidden_size, k = m->top_k, f = m->expert_ffn_size;
    double dflt = (16.0 * d + 3.0 * k * d + 3.0 * k * f) * m->bytes_per_param;
    if (!obj) {
        h->token_linear_bytes_per_token = dflt;
        return RP_OK;
    }
    return rp_jdoc_num(&ld->doc, obj, "hardware", "token_linear_bytes_per_token", false, dflt, 0, DBL_MAX,
                       &h->token_linear_bytes_per_token, ld->err);
}

/* ---- model --------------------------------------------------------------------------- */

static const char *const model_keys[] = {
    "num_layers", "num_experts", "top_k", "hidden_size", "expert_ffn_size", "num_heads",
    "num_kv_heads", "head_dim", "bytes_per_param", "bytes_per_optimizer_state", "bytes_per_grad",
    "dense_params", "vocab_size", "dense_layers", "dense_ffn_size", "comment", NULL,
};

static rp_status load_model(loader *ld, json_t *obj)
{
    const char *P = "model";
    rp_model *m = &ld->cfg->model;
    rp_status st;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, model_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_layers", true, 0, 1, MAX_LAYERS, &m->num_layers), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_experts", true, 0, 1, MAX_EXPERTS, &m->num_experts), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "top_k", true, 0, 1, MAX_EXPERTS, &m->top_k), st, out);
    if (m->top_k > m->num_experts)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, "model.top_k",
                            "must be <= num_experts (%d), got %d", m->num_experts, m->top_k);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "hidden_size", true, 0, 1, MAX_DIM, &m->hidden_size), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "expert_ffn_size", true, 0, 1, MAX_DIM, &m->expert_ffn_size), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_heads", true, 0, 1, MAX_HEADS, &m->num_heads), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_kv_heads", false, m->num_heads, 1, MAX_HEADS, &m->num_kv_heads),
                  st, out);
    if (m->num_kv_heads > m->num_heads || m->num_heads % m->num_kv_heads != 0)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "model.num_kv_heads",
                            "must divide num_heads (%d), got %d", m->num_heads, m->num_kv_heads);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "head_dim", true, 0, 1, MAX_HEADS, &m->head_dim), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "bytes_per_param", false, 2, 1, 16, &m->bytes_per_param), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "bytes_per_optimizer_state", false, 12, 0, 256,
                          &m->bytes_per_optimizer_state),
                  st, out);
    /* Megatron keeps FP32 main gradients for BF16 weights (its distributed-optimizer
     * table: 18 bytes per parameter = 2 weight + 4 grad + 12 optimizer; docs/config.md). */
    RP_CHECK_GOTO(get_i32(ld, obj, P, "bytes_per_grad", false, 4, 0, 16, &m->bytes_per_grad), st, out);
    /* Default: what the shape gives, the attention projections and the router of every
     * layer; embeddings, norms, shared experts and dense layers need the explicit key. */
    double dense = (double)m->num_layers * ((double)m->hidden_size * m->head_dim * (2.0 * m->num_heads +
                                                                                   2.0 * m->num_kv_heads) +
                                            (double)m->hidden_size * m->num_experts);
    int64_t dense_dflt = dense < (double)MAX_DENSE_PARAMS ? (int64_t)dense : MAX_DENSE_PARAMS;
    RP_CHECK_GOTO(rp_jdoc_int(&ld->doc, obj, P, "dense_params", false, dense_dflt, 0, MAX_DENSE_PARAMS,
                              &m->dense_params, ld->err),
                  st, out);
    /* outside the MoE layers (docs/cost-model.md, "The whole step"): 0 leaves a part out */
    RP_CHECK_GOTO(get_i32(ld, obj, P, "vocab_size", false, 0, 0, 1 << 24, &m->vocab_size), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "dense_layers", false, 0, 0, MAX_LAYERS, &m->dense_layers), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "dense_ffn_size", false, 0, 0, MAX_DIM, &m->dense_ffn_size), st, out);
out:
    return st;
}

/* ---- limits -------------------------------------------------------------------------- */

static const char *const limits_keys[] = {
    "max_tokens_per_microbatch", "num_microbatches", "max_activation_bytes",
    "activation_bytes_per_token", "comment", NULL,
};

static rp_status load_limits(loader *ld, json_t *obj)
{
    const char *P = "limits";
    rp_limits *l = &ld->cfg->limits;
    const rp_model *m = &ld->cfg->model;
    rp_status st;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, limits_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(rp_jdoc_int(&ld->doc, obj, P, "max_tokens_per_microbatch", true, 0, 1, (int64_t)1 << 40,
                              &l->max_tokens_per_microbatch, ld->err),
                  st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_microbatches", false, 0, 0, 1 << 20, &l->num_microbatches), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, P, "max_activation_bytes", false, 0.0, 0.0, DBL_MAX,
                              &l->max_activation_bytes, ld->err),
                  st, out);
    /* Rough default (docs/config.md): Korthikanti et al. 2022 count 34*d bytes per token
     * per layer at 16-bit activations without the attention-score term, i.e. 17*d per
     * byte of activation width, over all MoE layers. Per GPU of a DP rank: with tensor and
     * sequence parallelism they count 34*d/t (each of the t GPUs holds 1/t), and under
     * context parallelism a GPU holds 1/CP of each token of its DP rank's microbatch. */
    double dflt = 17.0 * m->hidden_size * m->bytes_per_param * m->num_layers;
    const rp_topology *t = &ld->cfg->topology;
    if (t->tensor_parallel_size * t->context_parallel_size > 1)
        dflt /= (double)t->tensor_parallel_size * t->context_parallel_size;
    RP_CHECK_GOTO(get_positive(ld, obj, P, "activation_bytes_per_token", dflt, DBL_MAX,
                               &l->activation_bytes_per_token),
                  st, out);
out:
    return st;
}

/* ---- execution ----------------------------------------------------------------------- */

static const char *const execution_keys[] = {
    "sync", "overlap", "dispatch_dedup", "dispatch_bytes_per_element", "combine_bytes_per_element", "optimizer_sharding",
    "staging_budget_bytes", "per_forward_balancing", "executor", "replica_grad_reduce",
    "replica_grad_bytes_per_element", "host_us_per_layer", "extras_ahead", "expert_gemm", "comment", NULL,
};

static const char *const sync_names[] = {"group", "global", NULL};
static const char *const overlap_names[] = {"none", "layer", NULL};
static const char *const dedup_names[] = {"choice", "gpu", "node", NULL};
static const char *const sharding_names[] = {"none", "dp", NULL};
/* in rp_executor order */
static const char *const executor_names[] = {"routepack_torch",   "megatron_alltoall", "deepep",
                                             "megatron_balancer", "ideal",             "megatron_routepack",
                                             NULL};

/* execution.executor alone, before the trainer (whose per_forward_balancer defaults to
 * whether the executor runs the balancer) and the rest of the section. */
static rp_status load_executor(loader *ld, json_t *obj)
{
    int v = RP_EXECUTOR_ROUTEPACK_TORCH;
    rp_status st = obj ? get_choice(ld, obj, "execution", "executor", executor_names, RP_EXECUTOR_ROUTEPACK_TORCH, &v)
                       : RP_OK;
    ld->cfg->execution.executor = (rp_executor)v;
    return st;
}

/* What the executor's profile sets (routepack/executor.h), each key an override. An
 * executor that holds every expert once per EP group has no room for replicas: a config
 * that gives it spare slots is refused here, naming the executor. */
static rp_status load_profile(loader *ld, json_t *obj)
{
    const char *P = "execution";
    rp_execution *x = &ld->cfg->execution;
    const rp_model *m = &ld->cfg->model;
    const rp_topology *t = &ld->cfg->topology;
    const rp_executor_profile *pf = rp_executor_profile_of(x->executor);
    rp_status st;
    int v;
    x->levers = pf->levers;
    x->extras_stacked = pf->extras_stacked;
    x->extras_once = pf->extras_once;
    static const char *const gemm_names[] = {"grouped", "loop", NULL};
    RP_CHECK_GOTO(get_choice(ld, obj, P, "expert_gemm", gemm_names,
                             pf->grouped_gemm ? RP_EXPERT_GEMM_GROUPED : RP_EXPERT_GEMM_LOOP, &v),
                  st, out);
    x->expert_gemm = (rp_expert_gemm)v;
    static const char *const grad_names[] = {"pairwise", "group", "holders", NULL};
    RP_CHECK_GOTO(get_choice(ld, obj, P, "replica_grad_reduce", grad_names, pf->grad_reduce, &v), st, out);
    x->replica_grad_reduce = (rp_grad_reduce)v;
    int32_t grad_dflt = pf->grad_in_grad_dtype && m->bytes_per_grad > 0 ? m->bytes_per_grad : m->bytes_per_param;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "replica_grad_bytes_per_element", false, grad_dflt, 1, 16,
                          &x->replica_grad_bytes_per_element),
                  st, out);
    /* local experts of one EP rank (a DP rank's slots over its TP x CP / ETP EP ranks) */
    int32_t most = 0;
    for (int32_t g = 0; g < t->num_gpus; g++)
        if (t->slots[g] > most) most = t->slots[g];
    int64_t ep_ranks = (int64_t)t->tensor_parallel_size * t->context_parallel_size / t->expert_tensor_parallel_size;
    double local = ep_ranks > 0 ? (double)most / (double)ep_ranks : most;
    double host_dflt = pf->host_syncs_per_layer * RP_HOST_SYNC_US + pf->launches_per_local_expert * local *
                       RP_HOST_LAUNCH_US;
    double us;
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, P, "host_us_per_layer", false, host_dflt, 0, 1e9, &us, ld->err), st, out);
    x->host_s_per_layer = us * 1e-6;
    RP_CHECK_GOTO(rp_jdoc_bool(&ld->doc, obj, P, "extras_ahead", false, pf->extras_ahead, &x->extras_ahead, ld->err),
                  st, out);
    if (!(pf->levers & RP_LEVER_REPLICAS)) {
        int64_t held = 0;
        for (int32_t g = 0; g < t->ep_size; g++) held += t->slots[g];
        if (held != m->num_experts) {
            char kp[64];
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, rp_jpath_key(kp, sizeof kp, P, "executor"),
                                "is \"%s\", which holds every expert once per EP group, but topology.slots_per_gpu "
                                "gives an EP group %lld slots for %d experts: give num_experts / ep_size slots per "
                                "GPU, or an executor that runs replicas (\"routepack_torch\")",
                                pf->name, (long long)held, m->num_experts);
        }
    }
out:
    return st;
}

static rp_status load_execution(loader *ld, json_t *obj)
{
    const char *P = "execution";
    rp_execution *x = &ld->cfg->execution;
    rp_status st;
    json_t *empty = NULL;
    if (!obj) obj = empty = json_object(); /* every key has a default */
    if (!obj) return rp_fail_nomem(ld->err, "the execution section");
    int v;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, execution_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(get_choice(ld, obj, P, "sync", sync_names, RP_SYNC_GROUP, &v), st, out);
    x->sync = (rp_sync)v;
    RP_CHECK_GOTO(get_choice(ld, obj, P, "overlap", overlap_names, RP_OVERLAP_NONE, &v), st, out);
    x->overlap = (rp_overlap)v;
    const rp_executor_profile *pf = rp_executor_profile_of(x->executor);
    RP_CHECK_GOTO(get_choice(ld, obj, P, "dispatch_dedup", dedup_names, pf->dispatch_dedup, &v), st, out);
    x->dispatch_dedup = (rp_dispatch_dedup)v;
    /* an executor dispatches in the dtype it combines in unless told (FP8 dispatch: 1):
     * the activations' for routepack_torch and Megatron's all-to-all, BF16 for DeepEP */
    const int32_t act_bytes = pf->combine_bytes_per_element ? pf->combine_bytes_per_element
                                                            : ld->cfg->model.bytes_per_param;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "dispatch_bytes_per_element", false, act_bytes, 1, 16,
                          &x->dispatch_bytes_per_element),
                  st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "combine_bytes_per_element", false, act_bytes, 1, 16,
                          &x->combine_bytes_per_element),
                  st, out);
    RP_CHECK_GOTO(load_profile(ld, obj), st, out);
    RP_CHECK_GOTO(get_choice(ld, obj, P, "optimizer_sharding", sharding_names, RP_OPTIMIZER_SHARDING_NONE, &v), st,
                  out);
    x->optimizer_sharding = (rp_optimizer_sharding)v;
    /* 0, the scheduler's default: no limit, every migration in one round. */
    RP_CHECK_GOTO(rp_jdoc_int(&ld->doc, obj, P, "staging_budget_bytes", false, 0, 0, (int64_t)1 << 53,
                              &x->staging_budget_bytes, ld->err),
                  st, out);
    static const char *const balancing_names[] = {"none", "virtual_experts", NULL};
    RP_CHECK_GOTO(get_choice(ld, obj, P, "per_forward_balancing", balancing_names, RP_BALANCING_NONE, &v), st, out);
    x->per_forward_balancing = (rp_balancing)v;
    if (x->per_forward_balancing == RP_BALANCING_VIRTUAL_EXPERTS) {
        /* the trainer says it runs the balancer: its limits must hold */
        rp_error why;
        if (rp_vexp_check_config(ld->cfg, &why) != RP_OK) {
            st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "execution.per_forward_balancing",
                              "is \"virtual_experts\", but %s", why.text);
            goto out;
        }
    }
out:
    json_decref(empty);
    return st;
}

/* The slots, dense parameters and staging must fit before any plan adds extra replicas:
 * a config whose GPUs cannot hold them is refused here, naming the keys to change. */
static rp_status check_memory(loader *ld, json_t *topology)
{
    rp_gpu_memory mem;
    rp_status st = rp_memory_peak(ld->cfg, NULL, &mem, ld->err);
    if (st != RP_OK || mem.total_bytes <= mem.capacity_bytes) return st;
    char what[RP_ERROR_TEXT / 2];
    rp_memory_describe(&mem, what, sizeof what);
    rp_execution *x = &ld->cfg->execution;
    const char *path = json_object_get(topology, "slots_per_gpu") ? "topology.slots_per_gpu" : "topology";
    /* sharding the optimizer state is suggested only where it lowers the peak: an
     * expert's state shards over the EP groups holding its slot (none to share with in
     * one EP group), a dense parameter's over every GPU (nothing with no dense params) */
    const char *dp = "";
    if (x->optimizer_sharding == RP_OPTIMIZER_SHARDING_NONE) {
        rp_gpu_memory sharded;
        x->optimizer_sharding = RP_OPTIMIZER_SHARDING_DP;
        st = rp_memory_peak(ld->cfg, NULL, &sharded, ld->err);
        x->optimizer_sharding = RP_OPTIMIZER_SHARDING_NONE;
        if (st != RP_OK) return st;
        if (sharded.total_bytes < mem.total_bytes) dp = ", set execution.optimizer_sharding \"dp\"";
    }
    return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, path,
                        "does not fit in GPU memory: %s; lower topology.slots_per_gpu%s%s or raise "
                        "hardware.hbm_bytes",
                        what, dp, x->staging_budget_bytes == 0 ? ", set execution.staging_budget_bytes" : "");
}

/* ---- trainer ------------------------------------------------------------------------- */

static const char *const trainer_keys[] = {"equal_sequences_per_rank", "microbatch_multiple",
                                           "nonempty_microbatches", "per_forward_balancer", "mini_batches",
                                           "epochs", "logprob_forwards", "comment", NULL};

/* The trainer's demands on a packing; read after the limits (a fixed microbatch count
 * must be a multiple of microbatch_multiple). */
static rp_status load_trainer(loader *ld, json_t *obj)
{
    const char *P = "trainer";
    rp_trainer *tr = &ld->cfg->trainer;
    rp_status st;
    json_t *empty = NULL;
    if (!obj) obj = empty = json_object(); /* every key has a default */
    if (!obj) return rp_fail_nomem(ld->err, "the trainer section");
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, trainer_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(rp_jdoc_bool(&ld->doc, obj, P, "equal_sequences_per_rank", false, false,
                               &tr->equal_sequences_per_rank, ld->err),
                  st, out);
    RP_CHECK_GOTO(rp_jdoc_bool(&ld->doc, obj, P, "nonempty_microbatches", false, false,
                               &tr->nonempty_microbatches, ld->err),
                  st, out);
    /* by default what the executor runs: a stock trainer (routepack_torch, Megatron's
     * all-to-all or DeepEP dispatcher) has no per-forward balancer; megatron_balancer has */
    const bool balancer = (rp_executor_profile_of(ld->cfg->execution.executor)->levers & RP_LEVER_BALANCER) != 0;
    RP_CHECK_GOTO(rp_jdoc_bool(&ld->doc, obj, P, "per_forward_balancer", false, balancer, &tr->per_forward_balancer,
                               ld->err),
                  st, out);
    /* Megatron's interleaved schedule runs microbatches in groups of PP per model chunk and
     * needs their count to be a multiple of PP: the default under it */
    const rp_topology *t = &ld->cfg->topology;
    const bool interleaved = t->pipeline_schedule == RP_SCHEDULE_INTERLEAVED;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "microbatch_multiple", false, interleaved ? t->pipeline_parallel_size : 1, 1,
                          1 << 20, &tr->microbatch_multiple),
                  st, out);
    if (interleaved && tr->microbatch_multiple % t->pipeline_parallel_size != 0) {
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "trainer.microbatch_multiple",
                          "is %d, but the interleaved schedule needs a microbatch count that is a multiple of "
                          "topology.pipeline_parallel_size %d (Megatron): give a multiple of %d or leave it out",
                          tr->microbatch_multiple, t->pipeline_parallel_size, t->pipeline_parallel_size);
        goto out;
    }
    RP_CHECK_GOTO(get_i32(ld, obj, P, "mini_batches", false, 1, 1, 1 << 16, &tr->mini_batches), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "epochs", false, 1, 1, 1 << 16, &tr->epochs), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "logprob_forwards", false, 0, 0, 16, &tr->logprob_forwards), st, out);
    /* every mini-batch runs the same count, itself a multiple of microbatch_multiple (verl
     * calls rearrange_micro_batches on each mini-batch) */
    if ((int64_t)tr->mini_batches * tr->microbatch_multiple > 1 << 20) {
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, "trainer.mini_batches",
                          "is %d: with trainer.microbatch_multiple %d a plan would run at least %lld microbatches "
                          "per rank, more than 1048576: lower one of them",
                          tr->mini_batches, tr->microbatch_multiple,
                          (long long)tr->mini_batches * tr->microbatch_multiple);
        goto out;
    }
    int32_t fixed = ld->cfg->limits.num_microbatches;
    if (fixed > 0 && fixed % tr->microbatch_multiple != 0)
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "trainer.microbatch_multiple",
                          "is %d, but limits.num_microbatches fixes %d microbatches, not a multiple of %d",
                          tr->microbatch_multiple, fixed, tr->microbatch_multiple);
    else if (fixed > 0 && fixed % (tr->mini_batches * tr->microbatch_multiple) != 0)
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "trainer.mini_batches",
                          "is %d, but limits.num_microbatches fixes %d microbatches, not a multiple of %d "
                          "(every mini-batch runs the same number of microbatches, a multiple of "
                          "trainer.microbatch_multiple %d): give limits.num_microbatches a multiple of %d",
                          tr->mini_batches, fixed, tr->mini_batches * tr->microbatch_multiple,
                          tr->microbatch_multiple, tr->mini_batches * tr->microbatch_multiple);
out:
    json_decref(empty);
    return st;
}

/* ---- policy -------------------------------------------------------------------------- */

static const char *const policy_keys[] = {"name", "params", "search_path", "initial_placement", "comment", NULL};

/* Copy jansson's malloc'd text into context memory. */
static char *dup_json(loader *ld, json_t *value)
{
    char *text = json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) return NULL;
    char *copy = rp_strdup(ld->ctx, text);
    free(text);
    return copy;
}

static rp_status load_policy(loader *ld, json_t *obj)
{
    const char *P = "policy";
    rp_config *cfg = ld->cfg;
    rp_policy_config *p = &cfg->policy;
    rp_context *ctx = ld->ctx;
    rp_status st;
    json_t *empty = NULL;
    if (!obj) obj = empty = json_object();
    if (!obj) return rp_fail_nomem(ld->err, "the policy section");
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, policy_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);

    const char *name;
    RP_CHECK_GOTO(rp_jdoc_str(&ld->doc, obj, P, "name", false, "routepack", &name, ld->err), st, out);
    if (!*name) {
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "policy.name", "must not be empty");
        goto out;
    }
    cfg->policy_name = rp_strdup(ctx, name);
    if (!cfg->policy_name) {
        st = rp_fail_nomem(ld->err, "the policy name");
        goto out;
    }
    p->name = cfg->policy_name;

    json_t *params;
    RP_CHECK_GOTO(rp_jdoc_obj(&ld->doc, obj, P, "params", false, &params, ld->err), st, out);
    cfg->params_json = params ? dup_json(ld, params) : rp_strdup(ctx, "{}");
    if (!cfg->params_json) {
        st = rp_fail_nomem(ld->err, "the policy parameters");
        goto out;
    }
    p->params_json = cfg->params_json;

    json_t *dirs;
    RP_CHECK_GOTO(rp_jdoc_arr(&ld->doc, obj, P, "search_path", false, &dirs, ld->err), st, out);
    size_t n = dirs ? json_array_size(dirs) : 0;
    if (n > MAX_SEARCH_PATH) {
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, "policy.search_path",
                          "has %zu entries, more than the %d supported", n, MAX_SEARCH_PATH);
        goto out;
    }
    cfg->search_path = rp_calloc(ctx, n + 1, sizeof(char *));
    if (!cfg->search_path) {
        st = rp_fail_nomem(ld->err, "the policy search path");
        goto out;
    }
    p->search_path = (const char *const *)cfg->search_path;
    for (size_t i = 0; i < n; i++) {
        char ip[64];
        rp_jpath_index(ip, sizeof ip, "policy.search_path", i);
        json_t *e = json_array_get(dirs, i);
        if (!json_is_string(e) || json_string_length(e) == 0) {
            st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, ip, "must be a non-empty directory name");
            goto out;
        }
        const char *dir = json_string_value(e);
        if (strlen(dir) != json_string_length(e)) {
            st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, ip, "must not contain a NUL character");
            goto out;
        }
        /* Relative entries are relative to the config file, not the working directory. */
        size_t prefix = dir[0] == '/' ? 0 : ld->dir_len;
        size_t len = strlen(dir);
        char *full = rp_alloc(ctx, prefix + len + 1);
        if (!full) {
            st = rp_fail_nomem(ld->err, "the policy search path");
            goto out;
        }
        memcpy(full, ld->dir, prefix);
        memcpy(full + prefix, dir, len + 1);
        cfg->search_path[i] = full;
    }

    /* the placement in use before the first step: "contiguous" or a plan file, relative
     * to the config file like the search path (read by the scheduler, not here) */
    const char *initial;
    RP_CHECK_GOTO(rp_jdoc_str(&ld->doc, obj, P, "initial_placement", false, "contiguous", &initial, ld->err), st,
                  out);
    if (!*initial) {
        st = rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "policy.initial_placement",
                          "must be \"contiguous\" or a plan file, not empty");
        goto out;
    }
    {
        size_t prefix = (initial[0] == '/' || !strcmp(initial, "contiguous")) ? 0 : ld->dir_len;
        size_t len = strlen(initial);
        cfg->initial_placement = rp_alloc(ctx, prefix + len + 1);
        if (!cfg->initial_placement) {
            st = rp_fail_nomem(ld->err, "policy.initial_placement");
            goto out;
        }
        memcpy(cfg->initial_placement, ld->dir, prefix);
        memcpy(cfg->initial_placement + prefix, initial, len + 1);
        p->initial_placement = cfg->initial_placement;
    }
    st = RP_OK;
out:
    json_decref(empty);
    return st;
}

/* ---- the document -------------------------------------------------------------------- */

static const char *const top_keys[] = {
    "topology", "hardware", "model", "limits", "execution", "trainer", "policy", "calibration", "comment",
    "$schema", NULL,
};

/* "calibration": a calibration.json path, relative to the config's directory: its entry
 * for the model's shape fills the hardware keys the config leaves out, its links the
 * topology's link keys (core/calibration.c). */
static rp_status load_calibration(loader *ld, json_t *root, json_t *topology, json_t *hardware)
{
    const char *rel;
    rp_status st = rp_jdoc_str(&ld->doc, root, "", "calibration", false, NULL, &rel, ld->err);
    if (st != RP_OK || !rel) return st;
    if (!*rel) return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "calibration", "must be a path, got \"\"");
    size_t dir_len = rel[0] == '/' ? 0 : ld->dir_len, n = strlen(rel);
    char *path = rp_alloc(ld->ctx, dir_len + n + 1);
    if (!path) return rp_fail_nomem(ld->err, "the calibration path");
    memcpy(path, ld->dir, dir_len);
    memcpy(path + dir_len, rel, n + 1);
    char key[128];
    calib_shape shape = {0};
    calib_links links = {0};
    calib_shape_key(key, sizeof key, &ld->cfg->model);
    st = calib_read(ld->ctx, path, key, &shape, &links, ld->err);
    if (st == RP_OK)
        st = calib_apply(ld->ctx, path, key, &shape, hardware, &ld->cfg->hardware,
                         (calib_stores){&ld->cfg->gemm, &ld->cfg->attention, &ld->cfg->grouped_gemm, &ld->cfg->wgrad},
                         ld->err);
    if (st == RP_OK) calib_apply_links(&links, topology, &ld->cfg->topology);
    calib_shape_free(ld->ctx, &shape);
    rp_free(ld->ctx, path);
    return st;
}


rp_status rp_config_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                          rp_config **out, rp_error *err)
{
    if (!name) name = "<inline>";
    if (!ctx || !out || (!text && len))
        return rp_fail(err, RP_EINVAL, "%s: rp_config_parse needs a context, text and an output", name);
    loader ld = {.ctx = ctx, .err = err};
    const char *slash = strrchr(name, '/');
    ld.dir = name;
    ld.dir_len = slash ? (size_t)(slash - name) + 1 : 0;

    rp_status st = rp_jdoc_parse(&ld.doc, text ? text : "", len, name, err);
    if (st != RP_OK) return st;
    rp_config *cfg = rp_calloc(ctx, 1, sizeof *cfg);
    if (!cfg) {
        st = rp_fail_nomem(err, "a config");
        goto out;
    }
    cfg->ctx = ctx;
    ld.cfg = cfg;
    cfg->source = rp_strdup(ctx, name);
    if (!cfg->source) {
        st = rp_fail_nomem(err, "a config");
        goto out;
    }
    ld.doc.name = cfg->source;

    json_t *root = ld.doc.root, *topology, *hardware, *model, *limits, *execution, *trainer, *policy;
    const char *s;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld.doc, root, "", top_keys, err), st, out);
    RP_CHECK_GOTO(check_comment(&ld, root, ""), st, out);
    RP_CHECK_GOTO(rp_jdoc_str(&ld.doc, root, "", "$schema", false, NULL, &s, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "topology", true, &topology, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "hardware", false, &hardware, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "model", true, &model, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "limits", true, &limits, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "execution", false, &execution, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "trainer", false, &trainer, err), st, out);
    RP_CHECK_GOTO(rp_jdoc_obj(&ld.doc, root, "", "policy", false, &policy, err), st, out);

    /* Document order; slots_per_gpu is checked once the expert count is known. */
    RP_CHECK_GOTO(config_load_topology(&ld, topology), st, out);
    RP_CHECK_GOTO(load_hardware(&ld, hardware), st, out);
    RP_CHECK_GOTO(load_model(&ld, model), st, out);
    RP_CHECK_GOTO(config_load_slots(&ld, topology), st, out);
    RP_CHECK_GOTO(config_load_stage_layers(&ld, topology), st, out);
    RP_CHECK_GOTO(load_token_linear(&ld, hardware), st, out);
    RP_CHECK_GOTO(load_calibration(&ld, root, topology, hardware), st, out);
    RP_CHECK_GOTO(load_limits(&ld, limits), st, out);
    /* the executor, then the trainer: trainer.per_forward_balancer defaults to what the
     * executor runs, and execution.per_forward_balancing needs it */
    RP_CHECK_GOTO(load_executor(&ld, execution), st, out);
    RP_CHECK_GOTO(load_trainer(&ld, trainer), st, out);
    RP_CHECK_GOTO(load_execution(&ld, execution), st, out);
    RP_CHECK_GOTO(check_memory(&ld, topology), st, out);
    RP_CHECK_GOTO(load_policy(&ld, policy), st, out);

    *out = cfg;
    cfg = NULL;
out:
    rp_config_free(cfg);
    rp_jdoc_free(&ld.doc);
    return st;
}

rp_status rp_config_load(rp_context *ctx, const char *path, rp_config **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "rp_config_load needs a context, a path and an output");
    char *text;
    size_t len;
    rp_status st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) return st;
    st = rp_config_parse(ctx, text, len, path, out, err);
    rp_free(ctx, text);
    return st;
}
