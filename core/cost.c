/* The cost model: per-sequence attention, per-slot expert time, dispatch and combine
 * traffic, and the full evaluation of a plan with its breakdown (docs/cost-model.md). */
#include "cost_internal.h"
#include "plan_internal.h"
#include "routepack/executor.h"
#include "routepack/memory.h"
#include "routepack/virtual_experts.h"
#include "stats_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define SLOT_TABLE_MAX 16384

static double curve_at(const rp_eff_point *p, int32_t k, double x);
static rp_status attention_weights(rp_cost *c, rp_error *err);

/* ---- constants and checks -------------------------------------------------------- */

static rp_status check_positive(rp_error *err, const char *name, double v)
{
    if (isfinite(v) && v > 0) return RP_OK;
    return rp_fail(err, RP_EINVAL, "cost: %s is %g; it must be a positive finite number", name, v);
}

static rp_status check_nonnegative(rp_error *err, const char *name, double v)
{
    if (isfinite(v) && v >= 0) return RP_OK;
    return rp_fail(err, RP_EINVAL, "cost: %s is %g; it must be a finite number >= 0", name, v);
}

static rp_status check_fraction(rp_error *err, const char *name, double v)
{
    if (isfinite(v) && v > 0 && v <= 1) return RP_OK;
    return rp_fail(err, RP_EINVAL, "cost: %s is %g; it must be in (0, 1]", name, v);
}

/* A curve: at least one point, x > 0 increasing, efficiencies in (0, 1]. */
static rp_status check_curve(rp_error *err, const char *curve, const rp_eff_point *pts, int32_t n)
{
    char name[96];
    rp_status st;
    if (n < 1 || !pts) return rp_fail(err, RP_EINVAL, "cost: %s has no points", curve);
    for (int32_t i = 0; i < n; i++) {
        const rp_eff_point *p = &pts[i];
        snprintf(name, sizeof name, "%s[%d] x", curve, i);
        if ((st = check_positive(err, name, p->tokens)) != RP_OK) return st;
        snprintf(name, sizeof name, "%s[%d] efficiency", curve, i);
        if ((st = check_fraction(err, name, p->efficiency)) != RP_OK) return st;
        if (i > 0 && !(p->tokens > pts[i - 1].tokens))
            return rp_fail(err, RP_EINVAL, "cost: %s[%d] x %g is not above the previous point's %g", curve, i,
                           p->tokens, pts[i - 1].tokens);
    }
    return RP_OK;
}

/* Every constant the model divides by or multiplies with: the config reader checks
 * them too, but the evaluator is a public API and a config's views are writable by
 * whoever holds the pointer. */
static rp_status check_config(const rp_config *cfg, rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_hardware *h = rp_config_hardware(cfg);
    const rp_model *md = rp_config_model(cfg);
    const rp_limits *lim = rp_config_limits(cfg);
    rp_status st;
    char name[96];
    if (t->num_gpus < 1 || t->gpus_per_node < 1 || t->ep_size < 1 || t->num_gpus % t->ep_size != 0)
        return rp_fail(err, RP_EINVAL, "cost: %d GPUs, %d per node, in EP groups of %d is not a valid topology",
                       t->num_gpus, t->gpus_per_node, t->ep_size);
    for (int32_t g = 0; g < t->num_gpus; g++) {
        snprintf(name, sizeof name, "topology.gpu_speed[%d]", g);
        if ((st = check_positive(err, name, t->speed[g])) != RP_OK) return st;
        if (t->slots[g] < 0)
            return rp_fail(err, RP_EINVAL, "cost: topology.slots_per_gpu[%d] is %d; it must be >= 0", g,
                           t->slots[g]);
    }
    if ((st = check_positive(err, "topology.nvlink_bytes_per_s", t->nvlink_bytes_per_s)) ||
        (st = check_positive(err, "topology.net_bytes_per_s", t->net_bytes_per_s)) ||
        (st = check_nonnegative(err, "topology.nvlink_latency_s", t->nvlink_latency_s)) ||
        (st = check_nonnegative(err, "topology.net_latency_s", t->net_latency_s)) ||
        (st = check_positive(err, "hardware.peak_flops", h->peak_flops)) ||
        (st = check_positive(err, "hardware.hbm_bytes_per_s", h->hbm_bytes_per_s)) ||
        (st = check_fraction(err, "hardware.dense_efficiency", h->dense_efficiency)) ||
        (st = check_nonnegative(err, "hardware.backward.attention", h->backward.attention)) ||
        (st = check_nonnegative(err, "hardware.backward.projections", h->backward.projections)) ||
        (st = check_nonnegative(err, "hardware.backward.experts", h->backward.experts)) ||
        (st = check_nonnegative(err, "hardware.backward.token_linear", h->backward.token_linear)) ||
        (st = check_nonnegative(err, "hardware.backward.communication", h->backward.communication)) ||
        (st = check_nonnegative(err, "hardware.backward.fixed", h->backward.fixed)) ||
        (st = check_nonnegative(err, "hardware.token_linear_bytes_per_token", h->token_linear_bytes_per_token)) ||
        (st = check_nonnegative(err, "hardware.layer_fixed_s", h->layer_fixed_s)) ||
        (st = check_curve(err, "hardware.gemm_efficiency", h->gemm_efficiency, h->num_gemm_efficiency)) ||
        (st = check_curve(err, "hardware.attention_efficiency", h->attention_efficiency,
                          h->num_attention_efficiency)))
        return st;
    const rp_execution *x = rp_config_execution(cfg);
    if ((x->sync != RP_SYNC_GROUP && x->sync != RP_SYNC_GLOBAL) ||
        (x->overlap != RP_OVERLAP_NONE && x->overlap != RP_OVERLAP_LAYER) ||
        (x->dispatch_dedup != RP_DEDUP_CHOICE && x->dispatch_dedup != RP_DEDUP_GPU &&
         x->dispatch_dedup != RP_DEDUP_NODE) ||
        x->dispatch_bytes_per_element < 1 || x->dispatch_bytes_per_element > 16 ||
        x->combine_bytes_per_element < 1 || x->combine_bytes_per_element > 16)
        return rp_fail(err, RP_EINVAL,
                       "cost: execution settings are invalid (sync %d, overlap %d, dispatch_dedup %d, "
                       "dispatch_bytes_per_element %d, combine_bytes_per_element %d)",
                       (int)x->sync, (int)x->overlap, (int)x->dispatch_dedup, x->dispatch_bytes_per_element,
                       x->combine_bytes_per_element);
    if (md->num_layers < 1 || md->num_experts < 1 || md->top_k < 1 || md->hidden_size < 1 ||
        md->expert_ffn_size < 1 || md->num_heads < 1 || md->num_kv_heads < 1 || md->head_dim < 1 ||
        md->bytes_per_param < 1 || md->bytes_per_optimizer_state < 0)
        return rp_fail(err, RP_EINVAL,
                       "cost: model shape is invalid (layers %d, experts %d, top_k %d, hidden %d, ffn %d, "
                       "heads %d, kv heads %d, head dim %d, bytes/param %d, optimizer bytes/param %d)",
                       md->num_layers, md->num_experts, md->top_k, md->hidden_size, md->expert_ffn_size,
                       md->num_heads, md->num_kv_heads, md->head_dim, md->bytes_per_param,
                       md->bytes_per_optimizer_state);
    if (lim->max_tokens_per_microbatch < 1)
        return rp_fail(err, RP_EINVAL, "cost: limits.max_tokens_per_microbatch is %lld; it must be >= 1",
                       (long long)lim->max_tokens_per_microbatch);
    if ((st = check_nonnegative(err, "limits.max_activation_bytes", lim->max_activation_bytes)) ||
        (st = check_nonnegative(err, "limits.activation_bytes_per_token", lim->activation_bytes_per_token)))
        return st;
    return RP_OK;
}

rp_status cost_check_inputs(const rp_config *cfg, const rp_batch *batch, rp_error *err)
{
    rp_status st = check_config(cfg, err);
    if (st != RP_OK) return st;
    const rp_model *md = rp_config_model(cfg);
    if (rp_batch_num_seqs(batch) < 1) return rp_fail(err, RP_EINVAL, "cost: the batch is empty (no sequences to plan)");
    /* Token-choice counts per (GPU, mb, layer, expert) are int32: bounded by the batch's
     * tokens times top_k. Sums of L^2 per cell are int64: bounded by tokens * max L. */
    int64_t tokens = rp_batch_num_tokens(batch), choices, sq;
    if (rp_mul_overflow(tokens, md->top_k, &choices) || choices > INT32_MAX)
        return rp_fail(err, RP_ERANGE,
                       "cost: the batch has %lld tokens x top-%d token-choices per layer, over the "
                       "evaluator's limit of 2^31-1", (long long)tokens, md->top_k);
    if (rp_mul_overflow(tokens, rp_batch_max_seq_len(batch), &sq))
        return rp_fail(err, RP_ERANGE, "cost: the batch's sum of squared lengths overflows 64 bits");
    return RP_OK;
}

rp_status rp_cost_new(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                      const rp_stats *stats, rp_split_rule rule, rp_cost **out, rp_error *err)
{
    if (!ctx || !cfg || !batch || !stats || !out)
        return rp_fail(err, RP_EINVAL, "cost: context, config, batch, statistics and output are required");
    if (rule != RP_SPLIT_EVEN && rule != RP_SPLIT_LOCALITY)
        return rp_fail(err, RP_EINVAL, "cost: split rule %d is neither RP_SPLIT_EVEN nor RP_SPLIT_LOCALITY",
                       (int)rule);
    rp_status st = cost_check_inputs(cfg, batch, err);
    if (st != RP_OK) return st;
    const rp_topology *t = rp_config_topology(cfg);
    const rp_hardware *h = rp_config_hardware(cfg);
    const rp_model *md = rp_config_model(cfg);
    const rp_limits *lim = rp_config_limits(cfg);

    int32_t n = rp_batch_num_seqs(batch);
    if (rp_stats_num_seqs(stats) != n)
        return rp_fail(err, RP_EINVAL, "cost: the statistics cover %d sequences, but the batch has %d",
                       rp_stats_num_seqs(stats), n);
    if (rp_stats_num_layers(stats) != md->num_layers)
        return rp_fail(err, RP_EINVAL, "cost: the statistics have %d layers, but the model has %d",
                       rp_stats_num_layers(stats), md->num_layers);
    if (rp_stats_num_experts(stats) != md->num_experts)
        return rp_fail(err, RP_EINVAL, "cost: the statistics have %d experts, but the model has %d",
                       rp_stats_num_experts(stats), md->num_experts);
    rp_cost *c = rp_calloc(ctx, 1, sizeof *c);
    if (!c) return rp_fail_nomem(err, "a cost evaluator");
    c->ctx = ctx;
    c->memo_bound = -1;
    c->cfg = cfg;
    c->batch = batch;
    c->stats = stats;
    c->rule = rule;
    c->G = t->num_gpus;
    c->ep = t->ep_size;
    c->Q = t->num_gpus / t->ep_size;
    c->gpn = t->gpus_per_node;
    c->N = n;
    c->L = md->num_layers;
    c->E = md->num_experts;
    c->top_k = md->top_k;
    c->speed = t->speed;
    c->gpu_node = rp_alloc(ctx, (size_t)c->G * sizeof *c->gpu_node);
    if (!c->gpu_node) {
        rp_free(ctx, c);
        return rp_fail_nomem(err, "a cost evaluator");
    }
    for (int32_t g = 0; g < c->G; g++) {
        c->gpu_node[g] = g / c->gpn;
        c->speed_sum += t->speed[g];
        if (t->speed[g] > c->speed_max) c->speed_max = t->speed[g];
    }
    c->cu_seqlens = rp_batch_cu_seqlens(batch);
    /* Stage r hands activations to stage r + 1 (and the last to the first, for the next
     * model chunk): DP rank g to DP rank g, both on one node when a stage is part of one. */
    c->pipe_same_node = rp_calloc(ctx, (size_t)t->pipeline_parallel_size, sizeof *c->pipe_same_node);
    c->layer_stage = rp_calloc(ctx, (size_t)md->num_layers, sizeof *c->layer_stage);
    if (!c->pipe_same_node || !c->layer_stage) {
        rp_free(ctx, c->pipe_same_node);
        rp_free(ctx, c->layer_stage);
        rp_free(ctx, c->gpu_node);
        rp_free(ctx, c);
        return rp_fail_nomem(err, "a cost evaluator");
    }
    for (int32_t v = 0; v < t->pipeline_parallel_size * t->virtual_pipeline_size; v++)
        for (int32_t l = t->stage_layer_begin[v]; l < t->stage_layer_begin[v] + t->layers_per_stage[v]; l++)
            c->layer_stage[l] = v % t->pipeline_parallel_size;
    {
        const int32_t P = t->pipeline_parallel_size, gpn = t->physical_gpus_per_node;
        const int64_t stage = (int64_t)t->physical_num_nodes * gpn / P;
        for (int32_t r = 0; r < P; r++)
            c->pipe_same_node[r] = stage < gpn && (r * stage) / gpn == (((r + 1) % P) * stage) / gpn;
    }

    double d = md->hidden_size, f = md->expert_ffn_size, hd = md->num_heads, hkv = md->num_kv_heads,
           dh = md->head_dim, bpp = md->bytes_per_param;
    c->attn_flop_s = 2.0 * hd * dh / h->peak_flops;
    c->attn_eff = h->attention_efficiency;
    c->num_attn_eff = h->num_attention_efficiency;
    c->attn_lin_s = 2.0 * d * (2.0 * hd * dh + 2.0 * hkv * dh) / (h->peak_flops * h->dense_efficiency);
    c->expert_token_s = 6.0 * d * f / h->peak_flops;
    c->expert_bytes = 3.0 * d * f * bpp;
    c->expert_mem_s = c->expert_bytes / h->hbm_bytes_per_s;
    /* weights plus the receiver's shard of the optimizer state (routepack/memory.h) */
    c->expert_move_bytes = (double)rp_memory_expert_move_bytes(cfg);
    const rp_execution *x = rp_config_execution(cfg);
    /* Dispatch and combine move the same copies, each at its own element size (DeepEP
     * combines in BF16 after an FP8 dispatch); one term D prices both at their mean, so
     * 2 D is exactly the dispatch plus the combine of every GPU. */
    c->token_bytes = d * (x->dispatch_bytes_per_element + x->combine_bytes_per_element) / 2.0;
    c->sync = x->sync;
    c->overlap = x->overlap;
    c->dedup = x->dispatch_dedup;
    c->NQ = c->sync == RP_SYNC_GROUP ? c->Q : 1;
    c->PP = t->pipeline_parallel_size;
    c->VPP = t->virtual_pipeline_size;
    c->schedule = t->pipeline_schedule;
    c->K = rp_config_trainer(cfg)->mini_batches;
    c->epochs = rp_config_trainer(cfg)->epochs;
    c->LW = c->PP > 1 ? 3 * c->NQ : c->NQ;
    c->stage_begin = t->stage_layer_begin;
    c->stage_layers = t->layers_per_stage;
    c->p2p_token_bytes = d * bpp;
    c->bwd = h->backward;
    c->token_linear_s = h->token_linear_bytes_per_token / h->hbm_bytes_per_s;
    c->fixed_s = h->layer_fixed_s + x->host_s_per_layer;
    /* the executor's replica gradient reduction and extra replicas (docs/cost-model.md,
     * "Executor profiles") */
    const rp_executor_profile *pf = rp_executor_profile_of(x->executor);
    c->grad_bytes = 3.0 * d * f * x->replica_grad_bytes_per_element;
    c->grad_form = x->replica_grad_reduce;
    c->extras_stacked = x->extras_stacked;
    c->extras_once = x->extras_once;
    c->extras_ahead = x->extras_once && x->extras_ahead;
    c->stack_s = 2.0 * c->expert_bytes / h->hbm_bytes_per_s;
    c->extra_launch_s = (pf ? pf->launches_per_local_expert : 0) * RP_HOST_LAUNCH_US * 1e-6;
    c->vexp_charges = pf && pf->balancer_charges;
    c->eff = h->gemm_efficiency;
    c->num_eff = h->num_gemm_efficiency;
    for (int32_t i = 0; i < c->num_eff; i++)
        if (c->eff[i].efficiency > c->eff_max) c->eff_max = c->eff[i].efficiency;
    c->nv_bw = t->nvlink_bytes_per_s;
    c->nv_lat = t->nvlink_latency_s;
    c->net_bw = t->net_bytes_per_s;
    c->net_lat = t->net_latency_s;
    /* Tensor parallelism (docs/cost-model.md, "TP and ETP"): the unit is a DP rank, a TP
     * group of tp GPUs. Its dense work splits over them (heads for attention and the
     * projections, sequence parallelism for the token-linear work); each expert's GEMMs
     * split over an ETP group of etp GPUs, and the rank's tp / etp ETP groups are priced
     * as sharing its experts evenly, so a slot's time divides by tp too; its traffic runs
     * over its tp GPUs' links; each ETP group all-gathers the tokens its experts take
     * (and reduce-scatters them back), etp - 1 copies of each over NVLink.
     * Context parallelism ("Context parallelism"): the DP rank is cp TP groups; each holds
     * 1/cp of every sequence (2 cp load-balanced causal chunks), so all of the above
     * divides by tp x cp instead, and the experts of the rank's tp cp / etp EP ranks pool
     * alike. What CP adds (padding, the K/V ring) is priced per cell (cost_cell_dense). */
    const double tp = t->tensor_parallel_size, etp = t->expert_tensor_parallel_size;
    const double rank_gpus = tp * t->context_parallel_size;
    c->attn_flop_s /= rank_gpus;
    c->attn_lin_s /= rank_gpus;
    c->token_linear_s /= rank_gpus;
    c->expert_token_s /= rank_gpus;
    c->expert_mem_s /= rank_gpus;
    c->stack_s /= rank_gpus;
    c->nv_bw *= rank_gpus;
    c->net_bw *= rank_gpus;
    /* ... but an expert's weights live on one EP rank, ETP GPUs, whose links alone carry
     * them when it migrates (docs/cost-model.md, "Migration") */
    migrate_links_init(&c->move_links, t, h->hbm_bytes_per_s);
    c->etp_gather_s = (etp - 1.0) * c->token_bytes / c->nv_bw;
    /* The ring (TransformerEngine's AttnFuncWithCPAndKVP2P): each GPU passes its K/V chunk
     * (its TP share of the KV heads, at least one head: Megatron replicates KV heads over
     * TP ranks beyond num_query_groups) to the same TP rank of the next CP rank, cp - 1
     * steps; over NVLink when the DP rank lies in one node. Sequences are padded to
     * 2 cp, times TP under sequence parallelism (which Megatron requires for MoE with TP). */
    c->cp = t->context_parallel_size;
    c->pad_multiple = c->cp > 1 ? 2 * (int64_t)c->cp * t->tensor_parallel_size : 1;
    {
        const double kv_heads = hkv >= tp ? hkv / tp : 1.0;
        const bool in_node = rank_gpus <= t->physical_gpus_per_node;
        c->ring_token_s = 2.0 * kv_heads * dh * bpp / (in_node ? t->nvlink_bytes_per_s : t->net_bytes_per_s);
        c->ring_lat = in_node ? t->nvlink_latency_s : t->net_latency_s;
    }
    c->token_cap = lim->max_tokens_per_microbatch;
    c->act_cap = lim->max_activation_bytes;
    c->act_per_token = lim->activation_bytes_per_token;
    /* integer loads below the curve's last point (at most SLOT_TABLE_MAX) */
    double last = c->eff[c->num_eff - 1].tokens;
    c->slot_table_n = last < SLOT_TABLE_MAX ? (int32_t)ceil(last) + 1 : SLOT_TABLE_MAX;
    c->slot_table = rp_alloc(ctx, (size_t)c->slot_table_n * sizeof *c->slot_table);
    if (!c->slot_table) {
        rp_cost_free(c);
        return rp_fail_nomem(err, "a cost evaluator");
    }
    for (int32_t i = 0; i < c->slot_table_n; i++) c->slot_table[i] = cost_slot_time(c, (double)i);
    /* Per-forward balancing: a plan that asks for it is priced with the planner, where
     * the config allows the balancer at all. Its weight pushes (forward, backward) and
     * gradient reduction, 3 transfers, are charged as dispatch time, which a layer pays
     * 2 (1 + backward.communication) times (dispatch and combine, forward and backward). */
    c->vexp_comm_scale = 1.0 / (2.0 * (1.0 + c->bwd.communication));
    c->vexp_grad_bytes = 3.0 * d * f * (md->bytes_per_grad > 0 ? md->bytes_per_grad : md->bytes_per_param);
    if (rp_vexp_check_config(cfg, NULL) == RP_OK && (st = rp_vexp_new(ctx, c->ep, c->E, &c->vexp, err)) != RP_OK) {
        rp_cost_free(c);
        return st;
    }
    if ((st = attention_weights(c, err)) != RP_OK) {
        rp_cost_free(c);
        return st;
    }
    *out = c;
    return RP_OK;
}

static void state_free(rp_context *ctx, cost_state *s);
static void scratch_free(rp_context *ctx, cost_scratch *sc);

void rp_cost_free(rp_cost *c)
{
    if (!c) return;
    rp_context *ctx = c->ctx;
    state_free(ctx, c->st);
    scratch_free(ctx, &c->sc);
    for (int32_t i = 0; i < COST_MEMO; i++) rp_plan_free(c->memo[i].plan);
    rp_free(ctx, c->gpu_node);
    rp_free(ctx, c->pipe_same_node);
    rp_free(ctx, c->layer_stage);
    rp_free(ctx, c->slot_table);
    rp_free(ctx, c->seq_quad);
    rp_vexp_free(c->vexp);
    rp_free(ctx, c);
}

const rp_config *rp_cost_config(const rp_cost *c) { return c->cfg; }

/* ---- unit costs ------------------------------------------------------------------ */

double rp_cost_attention_s(const rp_cost *c, int64_t seq_len)
{
    if (!c || seq_len <= 0) return 0.0;
    double len = (double)(seq_len + cost_pad(c, seq_len));
    return len * len * c->attn_flop_s / curve_at(c->attn_eff, c->num_attn_eff, len) + len * c->attn_lin_s;
}

double rp_cost_dense_s(const rp_cost *c, int64_t seq_len)
{
    if (!c || seq_len <= 0) return 0.0;
    double len = (double)(seq_len + cost_pad(c, seq_len));
    double core = len * len * c->attn_flop_s / curve_at(c->attn_eff, c->num_attn_eff, len);
    double proj = len * c->attn_lin_s, lin = len * c->token_linear_s;
    return (1.0 + c->bwd.attention) * core + (1.0 + c->bwd.projections) * proj + (1.0 + c->bwd.token_linear) * lin;
}

/* The quadratic attention work of every sequence, L^2 / eff(L), in fixed point: scaled by
 * 2^k with k the largest that keeps the batch's total under 2^61, and rounded to an
 * integer. Cells then sum integers, so a move changes a cell's sum exactly and an
 * incremental evaluation lands on the bits of a full one; the rounding costs at most
 * 2^-(k+1) of L^2 / eff per sequence (k >= 19 for a batch of 4096 sequences of 16k
 * tokens at efficiency 0.25: 1e-6 of a squared token). */
static rp_status attention_weights(rp_cost *c, rp_error *err)
{
    c->seq_quad = rp_alloc(c->ctx, (size_t)c->N * sizeof *c->seq_quad);
    if (!c->seq_quad) return rp_fail_nomem(err, "a cost evaluator");
    double total = 0.0;
    for (int32_t s = 0; s < c->N; s++) {
        const int64_t n = c->cu_seqlens[s + 1] - c->cu_seqlens[s];
        double len = (double)(n + cost_pad(c, n)); /* with its CP padding */
        total += len * len / curve_at(c->attn_eff, c->num_attn_eff, len);
    }
    if (!isfinite(total))
        return rp_fail(err, RP_ERANGE, "cost: the batch's attention work (sum of L^2 / efficiency) is not finite");
    int k = 0;
    if (total > 0) {
        frexp(ldexp(1.0, 61) / total, &k);
        k -= 1; /* 2^k <= 2^61 / total */
    }
    for (int32_t s = 0; s < c->N; s++) {
        const int64_t n = c->cu_seqlens[s + 1] - c->cu_seqlens[s];
        double len = (double)(n + cost_pad(c, n));
        c->seq_quad[s] = llround(ldexp(len * len / curve_at(c->attn_eff, c->num_attn_eff, len), k));
    }
    c->attn_quad_s = ldexp(c->attn_flop_s, -k);
    return RP_OK;
}

double cost_seq_attention(const rp_cost *c, int32_t seq)
{
    const int64_t n = c->cu_seqlens[seq + 1] - c->cu_seqlens[seq];
    return cost_cell_attention(c, c->seq_quad[seq], n + cost_pad(c, n), -1);
}

/* A curve at x: linear between points, flat beyond the ends. */
static double curve_at(const rp_eff_point *p, int32_t k, double x)
{
    if (x <= p[0].tokens) return p[0].efficiency;
    if (x >= p[k - 1].tokens) return p[k - 1].efficiency;
    int32_t lo = 0, hi = k - 1; /* p[lo].tokens < x < p[hi].tokens */
    while (hi - lo > 1) {
        int32_t mid = (lo + hi) / 2;
        if (p[mid].tokens <= x) lo = mid;
        else hi = mid;
    }
    double frac = (x - p[lo].tokens) / (p[hi].tokens - p[lo].tokens);
    return p[lo].efficiency + (p[hi].efficiency - p[lo].efficiency) * frac;
}

/* Grouped-GEMM efficiency at n tokens. */
static double eff_at(const rp_cost *c, double n) { return curve_at(c->eff, c->num_eff, n); }

double cost_slot_time(const rp_cost *c, double n)
{
    if (!(n > 0)) return 0.0;
    double t = n * c->expert_token_s / eff_at(c, n);
    return t > c->expert_mem_s ? t : c->expert_mem_s;
}

double rp_cost_expert_s(const rp_cost *c, double tokens)
{
    return c ? cost_slot_time(c, tokens) : 0.0;
}

double rp_cost_expert_move_s(const rp_cost *c, bool same_node)
{
    if (!c) return 0.0;
    /* received over one link, then written into its slot (the staged copy read, the slot
     * written: 2 x its bytes of HBM), as the migration plan charges one copy */
    const double b = c->expert_move_bytes;
    return same_node ? migrate_links_s(&c->move_links, b, 0.0, 2.0 * b)
                     : migrate_links_s(&c->move_links, 0.0, b, 2.0 * b);
}

/* The CP ring of a cell beyond its attention compute, forward and backward: the packed
 * microbatch runs one ring (THD), cp steps of 1/cp of the attention each, step i + 1's
 * K/V chunk (tokens / cp of them) arriving while step i computes, so each of the cp - 1
 * transfers costs what it takes beyond one step's compute; one latency (the first
 * exchange's start) is never hidden. The backward passes K/V and their gradients: twice
 * the bytes per step. `core` is the cell's attention core at its GPU's speed. */
static void ring_excess(const rp_cost *c, double core, int64_t tokens, double *fwd, double *bwd)
{
    const double steps = c->cp - 1, chunk = (double)tokens / c->cp;
    const double cf = core / c->cp, cb = c->bwd.attention * core / c->cp;
    const double pf = chunk * c->ring_token_s + c->ring_lat, pb = 2.0 * chunk * c->ring_token_s + c->ring_lat;
    *fwd = steps * (pf > cf ? pf - cf : 0.0) + c->ring_lat;
    *bwd = steps * (pb > cb ? pb - cb : 0.0) + c->ring_lat;
}

double cost_cell_attention(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu)
{
    double a = (double)sum_quad * c->attn_quad_s + (double)sum_len * c->attn_lin_s;
    a = gpu < 0 ? a : a / c->speed[gpu];
    if (c->cp > 1 && sum_len > 0) {
        double rf, rb;
        ring_excess(c, (double)sum_quad * c->attn_quad_s / (gpu < 0 ? 1.0 : c->speed[gpu]), sum_len, &rf, &rb);
        a += rf;
    }
    return a;
}

/* The dense phase of a cell: attention, its projections, the token-linear work and the
 * fixed cost of the layer, each with its own backward multiplier, plus the CP ring's
 * unhidden transfers. One function for the full and the incremental evaluation (same
 * bits). */
void cost_cell_dense_at(const rp_cost *c, int64_t sum_quad, int64_t sum_len, double speed, double *fwd,
                        double *bwd)
{
    const double core = (double)sum_quad * c->attn_quad_s, proj = (double)sum_len * c->attn_lin_s;
    const double lin = (double)sum_len * c->token_linear_s, fixed = c->fixed_s;
    *fwd = (core + proj + lin + fixed) / speed;
    *bwd = (c->bwd.attention * core + c->bwd.projections * proj + c->bwd.token_linear * lin +
            c->bwd.fixed * fixed) / speed;
    if (c->cp > 1 && sum_len > 0) {
        double rf, rb;
        ring_excess(c, core / speed, sum_len, &rf, &rb);
        *fwd += rf;
        *bwd += rb;
    }
}

void cost_cell_dense(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu, double *fwd, double *bwd)
{
    cost_cell_dense_at(c, sum_quad, sum_len, gpu < 0 ? 1.0 : c->speed[gpu], fwd, bwd);
}

void cost_group_dense(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int32_t gA, int32_t mA,
                      double fA, double bA, int32_t gB, int32_t mB, double fB, double bB, double *fmax,
                      double *bmax, int32_t *farg)
{
    const int32_t g0 = q * c->ep, M = st->M;
    *fmax = *bmax = -1.0;
    *farg = g0;
    cost_count(c, c->ep);
    for (int32_t g = g0; g < g0 + c->ep; g++) {
        double f, b;
        if (g == gA && m == mA) f = fA, b = bA;
        else if (g == gB && m == mB) f = fB, b = bB;
        else f = st->dense_f[(size_t)g * M + m], b = st->dense_b[(size_t)g * M + m];
        if (f > *fmax) {
            *fmax = f;
            *farg = g;
        }
        if (b > *bmax) *bmax = b;
    }
}

/* ---- one (microbatch, layer, EP group) ------------------------------------------ */

/* Slot time of an integer token count: a table below the curve's last point, where
 * the efficiency interpolation costs a search. The table holds cost_slot_time's own
 * results, so both paths give the same bits. */
static inline double slot_time_int(const rp_cost *c, int64_t n)
{
    return n < c->slot_table_n ? c->slot_table[n] : cost_slot_time(c, (double)n);
}

/* Group a destination map's experts by destination: ord lists the experts of
 * destination d at ord[seg[d] .. seg[d + 1]) (d = ep: split experts). */
static void map_segments(int32_t E, int32_t ep, const int32_t *dst, int32_t *seg, int32_t *ord)
{
    for (int32_t r = 0; r <= ep + 1; r++) seg[r] = 0;
    for (int32_t e = 0; e < E; e++) seg[dst[e] + 1]++;
    for (int32_t r = 0; r <= ep; r++) seg[r + 1] += seg[r];
    for (int32_t e = 0; e < E; e++) ord[seg[dst[e]]++] = e;
    for (int32_t r = ep; r > 0; r--) seg[r] = seg[r - 1];
    seg[0] = 0;
}

/* Where each expert's token-choices go at (m, l): the EP rank of its only replica, or
 * ep when it has several (then they are split, source by source). The base placement's
 * map is cached per layer; (m, l) with levers, and placements under trial, get theirs
 * built in the scratch space. */
cost_map cost_dst_map(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, const int32_t *rep_off,
                      const int32_t *rep_rank, bool base, cost_scratch *sc)
{
    const int32_t ml = m * c->L + l;
    const cost_override *ov = st->ov + st->ov_begin[ml], *ov_end = st->ov + st->ov_begin[ml + 1];
    if (base && ov == ov_end)
        return (cost_map){st->lay_dst + (size_t)l * c->E, st->lay_seg + (size_t)l * (c->ep + 2),
                          st->lay_ord + (size_t)l * c->E};
    for (int32_t e = 0; e < c->E; e++) {
        const cost_override *o = (ov < ov_end && ov->expert == e) ? ov++ : NULL;
        int32_t R = rep_off[e + 1] - rep_off[e] + (o ? o->num_extra : 0);
        sc->dst[e] = R == 1 ? rep_rank[rep_off[e]] : c->ep;
    }
    map_segments(c->E, c->ep, sc->dst, sc->seg, sc->ord);
    cost_count(c, 3 * (int64_t)c->E + 2 * (int64_t)c->ep + 4);
    return (cost_map){sc->dst, sc->seg, sc->ord};
}

/* The integer aggregates of group q at (m, l), from the per-GPU counts: each expert's
 * token-choices over the group, and the token-choices of single-replica experts each
 * GPU sends to each other GPU of the group (pair[src * ep + dst]; the diagonal stays 0).
 * Integers, so a move can update them by its own histogram and land on exactly these
 * values. */
void cost_group_rebuild(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                        cost_map map, int32_t *total, int32_t *pair)
{
    const int32_t ep = c->ep, E = c->E, g0 = q * ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    memset(total, 0, (size_t)E * sizeof *total);
    memset(pair, 0, (size_t)ep * ep * sizeof *pair);
    cost_count(c, E + 2 * (int64_t)ep * (E + ep) + 4 * (int64_t)ep);
    for (int32_t src = 0; src < ep; src++) {
        const int32_t *row = cnt + (size_t)src * E;
        for (int32_t e = 0; e < E; e++) total[e] += row[e];
        for (int32_t d = 0; d < ep; d++) {
            if (d == src) continue;
            int32_t sum = 0;
            for (int32_t i = map.seg[d]; i < map.seg[d + 1]; i++) sum += row[map.ord[i]];
            pair[(size_t)src * ep + d] = sum;
        }
    }
}

void cost_group_tokens(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int64_t *tok)
{
    for (int32_t r = 0; r < c->ep; r++) tok[r] = st->cell_tokens[(size_t)(q * c->ep + r) * st->M + m];
}

/* The change of a group's totals and pairs when EP rank `src` of the group gains
 * sign x hist. Integers: undone exactly by the opposite sign. */
void cost_delta_aggregates(const rp_cost *c, int32_t src, const int32_t *restrict h, int32_t sign, cost_map map,
                           int32_t *restrict total, int32_t *restrict pair)
{
    const int32_t ep = c->ep, E = c->E;
    cost_count(c, 2 * (int64_t)E + 2 * (int64_t)ep);
    if (sign > 0)
        for (int32_t e = 0; e < E; e++) total[e] += h[e];
    else
        for (int32_t e = 0; e < E; e++) total[e] -= h[e];
    for (int32_t d = 0; d < ep; d++) {
        if (d == src) continue;
        int32_t sum = 0;
        for (int32_t i = map.seg[d]; i < map.seg[d + 1]; i++) sum += h[map.ord[i]];
        pair[(size_t)src * ep + d] += sign * sum;
    }
}

/* The same change in the state: the GPU's counts and its group's aggregates. */
void cost_group_delta(const rp_cost *c, cost_state *st, int32_t m, int32_t l, int32_t gpu,
                      const uint32_t *hist, int32_t sign, cost_map map)
{
    const int32_t ep = c->ep, E = c->E, q = gpu / ep;
    const size_t gq = ((size_t)m * c->L + l) * c->Q + q;
    int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + gpu) * (size_t)E;
    const int32_t *h = (const int32_t *)hist; /* a sequence's counts fit int32 (see rp_cost_new) */
    cost_count(c, E);
    if (sign > 0)
        for (int32_t e = 0; e < E; e++) cnt[e] += h[e];
    else
        for (int32_t e = 0; e < E; e++) cnt[e] -= h[e];
    cost_delta_aggregates(c, gpu % ep, h, sign, map, st->gtotal + gq * E, st->gpair + gq * ep * ep);
}

/* Copies of a source's tokens that reach one destination (a GPU or a node) when `choices`
 * of its token-choices go there, sent once per token (execution.dispatch_dedup gpu or
 * node). The statistics hold per-sequence expert histograms, not which choices share a
 * token, so this is an expectation: a token can send at most m = min(top_k, experts the
 * destination holds) of its choices there; with each of those m chances taken
 * independently at p = choices / (tokens m), tokens (1 - (1 - p)^m) tokens send at least
 * one. Exact when m = 1 and when every token sends m choices there; always between
 * choices / m and min(choices, tokens). */
static double dedup_copies(double choices, double tokens, int32_t m)
{
    if (!(choices > 0) || m <= 1 || !(tokens > 0)) return choices;
    double p = choices / (tokens * m);
    if (p >= 1.0) return tokens;
    /* tokens (1 - q^m), q = 1 - p, as tokens p (1 + q + ... + q^(m-1)) = choices / m
     * times that sum (Horner): no cancellation however small p is, and m - 1
     * multiply-adds (m <= top_k) where expm1(m log1p(-p)) took a fifth of an evaluation */
    const double q = 1.0 - p;
    double sum = 1.0;
    for (int32_t k = 1; k < m; k++) sum = 1.0 + q * sum;
    return choices / m * sum;
}

/* min(top_k, slots of EP ranks [r0, r1)): the most choices a token can send there. */
static int32_t dedup_limit(const rp_cost *c, const cost_state *st, int32_t r0, int32_t r1)
{
    int64_t slots = st->slot_begin[r1] - st->slot_begin[r0];
    return slots < c->top_k ? (int32_t)slots : c->top_k;
}

/* Token copies each GPU of the group (first GPU g0) sends and receives inside its node
 * (sc->si, sc->ri) and across nodes (sc->se, sc->re) at one (m, l), from the
 * token-choices between each pair of GPUs (the single-replica experts' integer pairs plus
 * the split experts' shares) and each source's tokens, under the configured
 * de-duplication (docs/cost-model.md, "Dispatch and combine"). */
static void group_traffic(const rp_cost *c, const cost_state *st, int32_t g0, const int32_t *pair,
                          const double *sp, const int64_t *tokens, cost_scratch *sc)
{
    const int32_t ep = c->ep, gpn = c->gpn;
    double *si = sc->si, *ri = sc->ri, *se = sc->se, *re = sc->re;
    for (int32_t r = 0; r < ep; r++) si[r] = ri[r] = se[r] = re[r] = 0.0;
    for (int32_t src = 0; src < ep; src++) {
        const int32_t node = c->gpu_node[g0 + src];
        const double n = (double)tokens[src];
        if (c->dedup != RP_DEDUP_NODE) {
            for (int32_t d = 0; d < ep; d++) {
                if (d == src) continue;
                double ch = (double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d];
                if (!(ch > 0)) continue;
                double v = c->dedup == RP_DEDUP_GPU ? dedup_copies(ch, n, dedup_limit(c, st, d, d + 1)) : ch;
                if (c->gpu_node[g0 + d] == node) {
                    si[src] += v;
                    ri[d] += v;
                } else {
                    se[src] += v;
                    re[d] += v;
                }
            }
            continue;
        }
        /* per node: the group's GPUs of one node are a contiguous run [d0, d1) */
        for (int32_t d0 = 0; d0 < ep;) {
            const int32_t dn = c->gpu_node[g0 + d0];
            int32_t d1 = d0;
            double to_node = 0.0;
            while (d1 < ep && c->gpu_node[g0 + d1] == dn) {
                if (d1 != src) to_node += (double)pair[(size_t)src * ep + d1] + sp[(size_t)src * ep + d1];
                d1++;
            }
            if (dn == node) { /* own node: NVLink, one copy per destination GPU */
                for (int32_t d = d0; d < d1; d++) {
                    if (d == src) continue;
                    double v = dedup_copies((double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d], n,
                                            dedup_limit(c, st, d, d + 1));
                    si[src] += v;
                    ri[d] += v;
                }
            } else if (to_node > 0) {
                /* one copy per token over the network to the GPU of that node with the
                 * source's local index (else the node's first GPU in the group), which
                 * forwards one copy per destination GPU over NVLink */
                int32_t land = (int32_t)((int64_t)dn * gpn + (g0 + src) % gpn) - g0;
                if (land < d0 || land >= d1) land = d0;
                double v = dedup_copies(to_node, n, dedup_limit(c, st, d0, d1));
                se[src] += v;
                re[land] += v;
                for (int32_t d = d0; d < d1; d++) {
                    if (d == land) continue;
                    double f = dedup_copies((double)pair[(size_t)src * ep + d] + sp[(size_t)src * ep + d], n,
                                            dedup_limit(c, st, d, d + 1));
                    si[land] += f;
                    ri[d] += f;
                }
            }
            d0 = d1;
        }
    }
}

void cost_group_traffic(const rp_cost *c, const cost_state *st, int32_t g0, const int32_t *pair, const double *sp,
                        const int64_t *tokens, cost_scratch *sc)
{
    group_traffic(c, st, g0, pair, sp, tokens, sc);
}

/* Expert and dispatch time of every GPU of group q at (m, l), from the group's integer
 * aggregates (and the per-GPU counts for experts split over several replicas), in a
 * fixed order: a full evaluation and every incremental one call this same function on
 * the same integers, so their results agree bit for bit. */
void cost_group_eval(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                     const int32_t *rep_off, const int32_t *rep_rank, cost_map map,
                     const int32_t *total, const int32_t *pair, const int64_t *tokens, double *x_out,
                     double *d_out, group_result *res, cost_scratch *sc)
{
    if (st->vexp) {
        cost_group_eval_vexp(c, st, m, l, q, pair, tokens, x_out, d_out, res, sc);
        return;
    }
    const int32_t *dst = map.dst;
    const int32_t ep = c->ep, E = c->E, g0 = q * ep;
    const int32_t *cnt = st->counts + ((size_t)(m * c->L + l) * c->G + g0) * (size_t)E;
    double *xa = sc->xacc, *sp = sc->sp;
    const cost_override *ov = st->ov + st->ov_begin[m * c->L + l];
    const cost_override *ov_end = st->ov + st->ov_begin[m * c->L + l + 1];
    double *xtok = xa + ep; /* tokens each rank's experts take, for the ETP all-gather */
    for (int32_t r = 0; r < ep; r++) xa[r] = xtok[r] = 0.0;
    memset(sp, 0, (size_t)ep * ep * sizeof *sp);

    for (int32_t e = 0; e < E; e++) {
        if (dst[e] < ep) {
            xa[dst[e]] += slot_time_int(c, total[e]);
            xtok[dst[e]] += (double)total[e];
            continue;
        }
        while (ov < ov_end && ov->expert < e) ov++;
        const cost_override *o = (ov < ov_end && ov->expert == e) ? ov : NULL;
        const int32_t nb = rep_off[e + 1] - rep_off[e], R = nb + (o ? o->num_extra : 0);
        const int32_t *base = rep_rank + rep_off[e];
        cost_count(c, (int64_t)R * (5 + (int64_t)ep * (c->rule == RP_SPLIT_EVEN ? 1 : 3)));
        int32_t *rk = sc->rk;
        double *w = sc->w, *load = sc->load;
        for (int32_t i = 0; i < nb; i++) rk[i] = base[i];
        for (int32_t i = nb; i < R; i++) rk[i] = st->extra_rank[o->extra_off + i - nb];
        for (int32_t i = 0; i < R; i++) load[i] = 0.0;
        const bool fixed = (o && o->num_shares) || c->rule == RP_SPLIT_EVEN;
        if (fixed)
            for (int32_t i = 0; i < R; i++)
                w[i] = o && o->num_shares ? st->share_val[o->share_off + i] : 1.0 / R;
        for (int32_t src = 0; src < ep; src++) {
            int32_t v = cnt[(size_t)src * E + e];
            if (!v) continue;
            const int32_t node = c->gpu_node[g0 + src];
            int32_t tier = 2, k = R;
            if (!fixed) {
                /* locality: own GPU, else own node, else everyone, evenly inside the tier */
                int32_t own = 0, near = 0;
                for (int32_t i = 0; i < R; i++) {
                    own += rk[i] == src;
                    near += c->gpu_node[g0 + rk[i]] == node;
                }
                tier = own ? 0 : near ? 1 : 2;
                k = own ? own : near ? near : R;
            }
            for (int32_t i = 0; i < R; i++) {
                double part;
                if (fixed) part = (double)v * w[i];
                else if (tier == 2 || (tier == 1 && c->gpu_node[g0 + rk[i]] == node) || rk[i] == src)
                    part = (double)v / k;
                else continue;
                if (!fixed) load[i] += part;
                if (rk[i] == src || part == 0.0) continue;
                sp[(size_t)src * ep + rk[i]] += part;
            }
        }
        if (fixed)
            for (int32_t i = 0; i < R; i++) load[i] = (double)total[e] * w[i];
        for (int32_t i = 0; i < R; i++) {
            xa[rk[i]] += cost_slot_time(c, load[i]);
            xtok[rk[i]] += load[i];
        }
    }

    if (c->extras_stacked) {
        /* routepack.torch stacks a GPU's slots and extras into one weight tensor every
         * forward it has extras, and launches its GEMMs for each extra too */
        const int32_t *nx = st->extra_count + (size_t)(m * c->L + l) * ep;
        for (int32_t r = 0; r < ep; r++)
            if (nx[r] > 0)
                xa[r] += (double)(st->slot_begin[r + 1] - st->slot_begin[r] + nx[r]) * c->stack_s +
                         nx[r] * c->extra_launch_s;
    }
    cost_count(c, E + 2 * (int64_t)ep + 3 * (int64_t)ep * ep);
    group_traffic(c, st, g0, pair, sp, tokens, sc);
    const double *si = sc->si, *ri = sc->ri, *se = sc->se, *re = sc->re;
    res->xmax = res->dmax = -1.0;
    res->xarg = res->darg = g0;
    const double base_lat = ep > 1 ? c->nv_lat : 0.0;
    for (int32_t r = 0; r < ep; r++) {
        double x = xa[r] / c->speed[g0 + r];
        double send_in = si[r], send_out = se[r], recv_in = ri[r], recv_out = re[r];
        double intra = send_in > recv_in ? send_in : recv_in;
        double inter = send_out > recv_out ? send_out : recv_out;
        double d = intra * c->token_bytes / c->nv_bw + inter * c->token_bytes / c->net_bw + base_lat +
                   (inter > 0 ? c->net_lat : 0.0) + xtok[r] * c->etp_gather_s;
        x_out[r] = x;
        d_out[r] = d;
        group_result_note(res, g0 + r, x, d);
    }
}

/* T(m, l) of one sync domain, forward and backward: the dense phase (its forward and
 * backward maxima), the experts and, twice, the dispatch (combine moves the same volume
 * back), each phase at its own backward multiplier. Without overlap the phases follow
 * one another; with per-layer overlap the layer takes the longer of its compute and its
 * communication. One expression for every caller. */
double cost_layer_time(const rp_cost *c, double dfmax, double dbmax, double dmax, double xmax)
{
    const double compute = dfmax + dbmax + (1.0 + c->bwd.experts) * xmax;
    const double comm = 2.0 * (1.0 + c->bwd.communication) * dmax;
    if (c->overlap == RP_OVERLAP_LAYER) return compute > comm ? compute : comm;
    return compute + comm;
}

/* The forward and the backward of one (m, l) apart, for a pipeline that runs them at
 * different times: each pass's compute and communication at its own multipliers, under
 * the configured overlap. */
static void layer_passes(const rp_cost *c, double dfmax, double dbmax, double dmax, double xmax, double *fwd,
                         double *bwd)
{
    const double cf = dfmax + xmax, mf = 2.0 * dmax;
    const double cb = dbmax + c->bwd.experts * xmax, mb = 2.0 * c->bwd.communication * dmax;
    if (c->overlap == RP_OVERLAP_LAYER) {
        *fwd = cf > mf ? cf : mf;
        *bwd = cb > mb ? cb : mb;
    } else {
        *fwd = cf + mf;
        *bwd = cb + mb;
    }
}

void cost_layer_times(const rp_cost *c, const double *dfmax, const double *dbmax, const double *dmax,
                      const double *xmax, double *out)
{
    cost_count(c, c->Q);
    const int32_t NQ = c->NQ;
    if (c->sync == RP_SYNC_GROUP) {
        for (int32_t q = 0; q < c->Q; q++) {
            out[q] = cost_layer_time(c, dfmax[q], dbmax[q], dmax[q], xmax[q]);
            if (c->PP > 1) layer_passes(c, dfmax[q], dbmax[q], dmax[q], xmax[q], &out[NQ + q], &out[2 * NQ + q]);
        }
        return;
    }
    double f = dfmax[0], b = dbmax[0], d = dmax[0], x = xmax[0];
    for (int32_t q = 1; q < c->Q; q++) {
        if (dfmax[q] > f) f = dfmax[q];
        if (dbmax[q] > b) b = dbmax[q];
        if (dmax[q] > d) d = dmax[q];
        if (xmax[q] > x) x = xmax[q];
    }
    out[0] = cost_layer_time(c, f, b, d, x);
    if (c->PP > 1) layer_passes(c, f, b, d, x, &out[1], &out[2]);
}

/* One sync domain's time over mini-batch b: the critical path of its pipeline
 * (cost_pipe.c). With one stage that is the sum of its layer times in (m, l) order,
 * added one by one. */
static double domain_sum(const rp_cost *c, const cost_state *st, const double *layer_t, int32_t q, int32_t b)
{
    return cost_pipe_domain(c, st, layer_t, q, b);
}

/* The step, one rollout batch: per mini-batch, under group sync the slowest EP group's
 * own pipeline, under global sync the pipeline of the job-wide layer times (every
 * optimizer step waits for every group); then per mini-batch the replica gradient
 * reduction, once the extra-replica copies (they are per microbatch already), all of it
 * once per epoch. With one mini-batch and one epoch the terms add as they always did. */
double cost_step_from(const rp_cost *c, const cost_state *st, const double *layer_t, double grad_s)
{
    double run = 0.0;
    for (int32_t b = 0; b < c->K; b++) {
        double worst = 0.0;
        for (int32_t q = 0; q < c->NQ; q++) {
            double sum = domain_sum(c, st, layer_t, q, b);
            if (q == 0 || sum > worst) worst = sum;
        }
        run = b == 0 ? worst : run + worst;
    }
    const double epoch = run + (c->K == 1 ? grad_s : c->K * grad_s) + st->extra_s;
    return c->epochs == 1 ? epoch : c->epochs * epoch;
}

/* The domain with the largest time over all mini-batches. */
int32_t cost_critical_domain(const rp_cost *c, const cost_state *st)
{
    int32_t best = 0;
    double worst = 0.0;
    for (int32_t q = 0; q < c->NQ; q++) {
        double sum = 0.0;
        for (int32_t b = 0; b < c->K; b++) sum += domain_sum(c, st, st->layer_t, q, b);
        if (q == 0 || sum > worst) {
            worst = sum;
            best = q;
        }
    }
    return best;
}

/* Replicas of every expert of one layer: EP rank of each, in ascending slot order. */
void cost_index_layer(int32_t E, int32_t S, const int32_t *slot_rank_of, const int32_t *phy2log,
                      int32_t *rep_off, int32_t *rep_rank)
{
    memset(rep_off, 0, (size_t)(E + 1) * sizeof *rep_off);
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] >= 0) rep_off[phy2log[s] + 1]++;
    for (int32_t e = 0; e < E; e++) rep_off[e + 1] += rep_off[e];
    for (int32_t s = 0; s < S; s++)
        if (phy2log[s] >= 0) rep_rank[rep_off[phy2log[s]]++] = slot_rank_of[s];
    for (int32_t e = E; e > 0; e--) rep_off[e] = rep_off[e - 1];
    rep_off[0] = 0;
}

/* Destination map of a layer's base placement (no levers), into the state's cache. */
void cost_layer_dst(const rp_cost *c, cost_state *st, int32_t l, const int32_t *rep_off,
                    const int32_t *rep_rank)
{
    int32_t *dst = st->lay_dst + (size_t)l * c->E;
    cost_count(c, 3 * (int64_t)c->E + 2 * (int64_t)c->ep + 4);
    /* under per-forward balancing every expert counts as split: a trial move then keeps
     * every per-GPU count current, which the balancer's plan reads (cost_vexp.c) */
    for (int32_t e = 0; e < c->E; e++)
        dst[e] = rep_off[e + 1] - rep_off[e] == 1 && !st->vexp ? rep_rank[rep_off[e]] : c->ep;
    map_segments(c->E, c->ep, dst, st->lay_seg + (size_t)l * (c->ep + 2), st->lay_ord + (size_t)l * c->E);
}

/* Whether expert e has an extra replica at (m, l): the (m, l) overrides are sorted by
 * expert. */
static bool has_extra_at(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t e)
{
    const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
    for (; o < end && o->expert <= e; o++)
        if (o->expert == e && o->num_extra > 0) return true;
    return false;
}

/* The experts of layer l one all-reduce of the EP group carries (routepack.torch's
 * reduce_replica_grads): those with more than one replica in the placement, and those
 * with an extra replica at some microbatch of the step. */
static int32_t group_reduce_experts(const rp_cost *c, const cost_state *st, int32_t l, const int32_t *rep_off)
{
    int32_t R = 0;
    for (int32_t e = 0; e < c->E; e++) R += rep_off[e + 1] - rep_off[e] >= 2;
    if (!st->ov_begin || st->ov_begin[st->M * c->L] == 0) return R;
    for (int32_t m = 0; m < st->M; m++) {
        const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
        for (; o < end; o++) {
            if (o->num_extra == 0 || rep_off[o->expert + 1] - rep_off[o->expert] >= 2) continue;
            bool seen = false;
            for (int32_t k = 0; k < m && !seen; k++) seen = has_extra_at(c, st, k, l, o->expert);
            R += !seen;
        }
    }
    return R;
}

/* The distinct EP ranks holding a copy of expert e over the step at layer l (its replicas
 * in the placement, rep_rank[rep_off[e] ..], and its extra replicas of every microbatch),
 * into out (at most ep); their count. routepack.torch's replica_holders. */
static int32_t expert_holders(const rp_cost *c, const cost_state *st, int32_t l, int32_t e, const int32_t *rep_off,
                              const int32_t *rep_rank, int32_t *out)
{
    int32_t n = 0;
    for (int32_t i = rep_off[e]; i < rep_off[e + 1]; i++) {
        bool seen = false;
        for (int32_t k = 0; k < n && !seen; k++) seen = out[k] == rep_rank[i];
        if (!seen) out[n++] = rep_rank[i];
    }
    for (int32_t m = 0; st->ov_begin && m < st->M; m++) {
        const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
        for (; o < end && o->expert <= e; o++) {
            if (o->expert != e) continue;
            for (int32_t i = 0; i < o->num_extra; i++) {
                const int32_t j = st->extra_rank[o->extra_off + i];
                bool seen = false;
                for (int32_t k = 0; k < n && !seen; k++) seen = out[k] == j;
                if (!seen && n < c->ep) out[n++] = j;
            }
        }
    }
    return n;
}

/* Gradient reduction that replicas add, per GPU, for one layer, as the executor runs it
 * (execution.replica_grad_reduce), each expert's gradient at grad_bytes (the executor's
 * dtype):
 * - pairwise: every replica beyond the first (lowest slot) of an expert runs one
 *   two-party all-reduce of the expert's gradient with the first replica's GPU, in every
 *   EP group; each of the two GPUs sends and receives the gradient's bytes once, over
 *   NVLink inside a node and the network across nodes, plus that link's latency. Replicas
 *   on the same GPU add nothing (a local sum).
 * - group: one ring all-reduce of [R, params] over each EP group (routepack.torch), R the
 *   experts group_reduce_experts counts (none: no collective): every GPU of the group sends
 *   and receives 2 (ep - 1) / ep of its bytes, in 2 (ep - 1) steps of one latency each,
 *   over the network when the group spans nodes.
 * - holders: every distinct holder of an expert (its replicas and the step's extra
 *   replicas, expert_holders) sends its gradient to every other holder and receives
 *   theirs (routepack.torch's batched exchange among holders): each message the
 *   gradient's bytes over that pair's link, plus the link's latency.
 * `bytes` (NULL: not wanted) gets what each GPU of EP group 0 sends. */
static void grad_layer(const rp_cost *c, const cost_state *st, int32_t layer, const int32_t *rep_off,
                       const int32_t *rep_rank, double *row, double *bytes);

void cost_grad_layer(const rp_cost *c, const cost_state *st, int32_t layer, const int32_t *rep_off,
                     const int32_t *rep_rank, double *row)
{
    grad_layer(c, st, layer, rep_off, rep_rank, row, NULL);
}

static void grad_layer(const rp_cost *c, const cost_state *st, int32_t layer, const int32_t *rep_off,
                       const int32_t *rep_rank, double *row, double *bytes)
{
    cost_count(c, (int64_t)c->G + c->E);
    for (int32_t g = 0; g < c->G; g++) row[g] = 0.0;
    if (bytes)
        for (int32_t j = 0; j < c->ep; j++) bytes[j] = 0.0;
    if (c->grad_form == RP_GRAD_REDUCE_HOLDERS) {
        int32_t held[256], *h = held;
        int32_t *big = NULL;
        if (c->ep > 256) h = big = rp_alloc(c->ctx, (size_t)c->ep * sizeof *big); /* rare: EP > 256 */
        for (int32_t e = 0; h && e < c->E; e++) {
            const int32_t n = expert_holders(c, st, layer, e, rep_off, rep_rank, h);
            cost_count(c, (int64_t)n * n * c->Q + rep_off[e + 1] - rep_off[e]);
            if (n < 2) continue;
            if (bytes)
                for (int32_t a = 0; a < n; a++) bytes[h[a]] += (n - 1) * c->grad_bytes;
            for (int32_t q = 0; q < c->Q; q++)
                for (int32_t a = 0; a < n; a++)
                    for (int32_t b = 0; b < n; b++) {
                        if (a == b) continue;
                        const int32_t ga = q * c->ep + h[a], gb = q * c->ep + h[b];
                        row[ga] += c->gpu_node[ga] == c->gpu_node[gb] ? c->grad_bytes / c->nv_bw + c->nv_lat
                                                                      : c->grad_bytes / c->net_bw + c->net_lat;
                    }
        }
        rp_free(c->ctx, big);
        return;
    }
    if (c->grad_form == RP_GRAD_REDUCE_GROUP) {
        const int32_t R = c->ep > 1 ? group_reduce_experts(c, st, layer, rep_off) : 0;
        if (R == 0) return;
        const double steps = 2.0 * (c->ep - 1);
        for (int32_t q = 0; q < c->Q; q++) {
            const int32_t g0 = q * c->ep;
            const bool in_node = c->gpu_node[g0] == c->gpu_node[g0 + c->ep - 1];
            const double t = steps / c->ep * R * c->grad_bytes / (in_node ? c->nv_bw : c->net_bw) +
                             steps * (in_node ? c->nv_lat : c->net_lat);
            for (int32_t g = g0; g < g0 + c->ep; g++) row[g] = t;
        }
        if (bytes)
            for (int32_t j = 0; j < c->ep; j++) bytes[j] = steps / c->ep * R * c->grad_bytes;
        return;
    }
    const double nv = c->grad_bytes / c->nv_bw + c->nv_lat;
    const double net = c->grad_bytes / c->net_bw + c->net_lat;
    for (int32_t e = 0; e < c->E; e++) {
        if (rep_off[e + 1] - rep_off[e] < 2) continue;
        int32_t first = rep_rank[rep_off[e]];
        for (int32_t i = rep_off[e] + 1; i < rep_off[e + 1]; i++) {
            int32_t r = rep_rank[i];
            cost_count(c, 1);
            if (r == first) continue;
            if (bytes) bytes[first] += c->grad_bytes, bytes[r] += c->grad_bytes;
            cost_count(c, c->Q);
            for (int32_t q = 0; q < c->Q; q++) {
                int32_t a = q * c->ep + first, b = q * c->ep + r;
                double t = c->gpu_node[a] == c->gpu_node[b] ? nv : net;
                row[a] += t;
                row[b] += t;
            }
        }
    }
}

/* max over GPUs of the per-layer rows summed in layer order; `row` replaces layer
 * `layer` when given (a trial), else the state's rows are used as they are. */
double cost_grad_total(const rp_cost *c, const cost_state *st, int32_t layer, const double *row)
{
    double worst = 0.0;
    cost_count(c, (int64_t)c->G * c->L * c->PP);
    /* under PP the stages reduce their own layers' replicas at once: the slowest GPU of
     * the slowest stage */
    for (int32_t r = 0; r < c->PP; r++)
        for (int32_t g = 0; g < c->G; g++) {
            double sum = 0.0;
            for (int32_t l = 0; l < c->L; l++)
                if (c->layer_stage[l] == r) sum += (row && l == layer) ? row[g] : st->grad_gpu[(size_t)l * c->G + g];
            if (sum > worst) worst = sum;
        }
    return worst;
}

/* ---- state ----------------------------------------------------------------------- */

static void state_free(rp_context *ctx, cost_state *s)
{
    if (!s) return;
    void *arrays[] = {s->slot_begin, s->phy2log, s->rep_off, s->rep_rank, s->ov_begin, s->ov,
                      s->extra_rank, s->share_val, s->extra_count, s->seq_rank, s->seq_mb,
                      s->cell_tokens, s->cell_quad, s->cell_pad, s->counts, s->attn,
                      s->dense_f, s->dense_b, s->dfmax, s->dbmax, s->dfarg, s->expert, s->dispatch, s->xmax, s->dmax, s->xarg,
                      s->darg, s->layer_t, s->grad_gpu, s->slot_rank, s->cell_top, s->gtotal,
                      s->gpair, s->lay_dst, s->lay_seg, s->lay_ord, s->vexp_owner,
                      s->pipe_ops, s->pipe_begin, s->pipe_fend, s->pipe_bend, s->pipe_tdev, s->pipe_next};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) rp_free(ctx, arrays[i]);
    rp_free(ctx, s);
}

void cost_state_edited(rp_cost *c) { c->memo_bound = -1; }

/* Remember `plan` (a copy) and its summary as the newest evaluation, the bound state's. */
static void memo_push(rp_cost *c, const rp_plan *plan, const rp_cost_summary *sum, double forward_s)
{
    const int32_t at = c->memo_next;
    c->memo_next = (at + 1) % COST_MEMO;
    rp_plan_free(c->memo[at].plan);
    c->memo[at].plan = NULL;
    c->memo_bound = -1;
    if (plan_copy_in(c->ctx, plan, &c->memo[at].plan, NULL) != RP_OK) { /* only a shortcut lost */
        c->memo[at].plan = NULL;
        return;
    }
    c->memo[at].sum = *sum;
    c->memo[at].forward_s = forward_s;
    c->memo_bound = at;
}

rp_status cost_summary_of(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, double *forward_s, rp_error *err)
{
    for (int32_t i = 0; c && plan && i < COST_MEMO; i++)
        if (c->memo[i].plan && rp_plan_equal(c->memo[i].plan, plan)) {
            *out = c->memo[i].sum;
            if (forward_s) *forward_s = c->memo[i].forward_s;
            return RP_OK;
        }
    rp_status st = rp_cost_evaluate(c, plan, out, err);
    if (st == RP_OK && forward_s) *forward_s = c->st->forward_s;
    return st;
}

static void scratch_free(rp_context *ctx, cost_scratch *sc)
{
    void *arrays[] = {sc->hist, sc->x, sc->d, sc->si, sc->ri, sc->se, sc->re, sc->xacc, sc->rk,
                      sc->w, sc->load, sc->layer_t, sc->qdf, sc->qdb, sc->qx, sc->qd, sc->rep_off, sc->rep_rank, sc->row,
                      sc->grad_row, sc->total, sc->pair, sc->sp, sc->tok, sc->dst, sc->seg, sc->ord};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) rp_free(ctx, arrays[i]);
    memset(sc, 0, sizeof *sc);
}

/* count * size in bytes, or 0 with *bad set when it overflows. */
static size_t bytes_of(int64_t count, size_t size, bool *bad)
{
    int64_t total;
    if (count < 0 || rp_mul_overflow(count, (int64_t)size, &total) || (uint64_t)total > SIZE_MAX / 2) {
        *bad = true;
        return 0;
    }
    return (size_t)total + 1; /* never a zero-byte request */
}

/* One array of `count` elements, its bytes added to *total. */
static void *take(rp_context *ctx, int64_t count, size_t size, bool zero, bool *bad, size_t *total)
{
    size_t n = bytes_of(count, size, bad);
    if (*bad) return NULL;
    void *p = zero ? rp_calloc(ctx, n, 1) : rp_alloc(ctx, n);
    if (p) *total += n;
    return p;
}

static rp_status scratch_alloc(rp_cost *c, const cost_state *s, cost_scratch *sc, rp_error *err)
{
    bool bad = false;
    rp_context *ctx = c->ctx;
    size_t *total = &sc->bytes;
    int64_t LE = (int64_t)c->L * c->E, ML = (int64_t)s->M * c->L;
    memset(sc, 0, sizeof *sc);
    sc->bytes = 0;
    sc->hist = take(ctx, 2 * LE, sizeof(uint32_t), false, &bad, total);
    sc->x = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->d = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->si = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->ri = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->se = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->re = take(ctx, c->ep, sizeof(double), false, &bad, total);
    sc->xacc = take(ctx, 2 * (int64_t)c->ep, sizeof(double), false, &bad, total); /* times, then tokens */
    sc->rk = take(ctx, s->max_replicas, sizeof(int32_t), false, &bad, total);
    sc->w = take(ctx, s->max_replicas, sizeof(double), false, &bad, total);
    sc->load = take(ctx, s->max_replicas, sizeof(double), false, &bad, total);
    sc->layer_t = take(ctx, ML * c->LW, sizeof(double), false, &bad, total);
    sc->qdf = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qdb = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qx = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->qd = take(ctx, c->Q, sizeof(double), false, &bad, total);
    sc->rep_off = take(ctx, (int64_t)c->E + 1, sizeof(int32_t), false, &bad, total);
    sc->rep_rank = take(ctx, s->S, sizeof(int32_t), false, &bad, total);
    sc->row = take(ctx, s->S, sizeof(int32_t), false, &bad, total);
    sc->grad_row = take(ctx, c->G, sizeof(double), false, &bad, total);
    sc->total = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    sc->pair = take(ctx, (int64_t)c->ep * c->ep, sizeof(int32_t), false, &bad, total);
    sc->sp = take(ctx, (int64_t)c->ep * c->ep, sizeof(double), false, &bad, total);
    sc->tok = take(ctx, c->ep, sizeof(int64_t), false, &bad, total);
    sc->dst = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    sc->seg = take(ctx, (int64_t)c->ep + 2, sizeof(int32_t), false, &bad, total);
    sc->ord = take(ctx, c->E, sizeof(int32_t), false, &bad, total);
    if (bad || !sc->total || !sc->pair || !sc->sp || !sc->tok || !sc->dst || !sc->seg || !sc->ord || !sc->hist || !sc->x || !sc->d || !sc->si || !sc->ri || !sc->se || !sc->re ||
        !sc->xacc || !sc->rk || !sc->w || !sc->load || !sc->layer_t || !sc->rep_off || !sc->qdf || !sc->qdb ||
        !sc->qx || !sc->qd ||
        !sc->rep_rank || !sc->row || !sc->grad_row) {
        scratch_free(ctx, sc);
        return bad ? rp_fail(err, RP_ERANGE, "cost: the plan is too large to evaluate")
                   : rp_fail_nomem(err, "the cost evaluator's scratch space");
    }
    return RP_OK;
}

static rp_status fail_expert(rp_error *err, int32_t expert, const char *fmt, ...) RP_PRINTF(3, 4);
static rp_status fail_expert(rp_error *err, int32_t expert, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, RP_EINVAL, fmt, ap);
    va_end(ap);
    if (err) err->expert = expert;
    return RP_EINVAL;
}

/* Shape of the plan against the evaluator's config and batch. */
static rp_status check_plan_shape(const rp_cost *c, const rp_plan *plan, rp_error *err)
{
    if (!plan) return rp_fail(err, RP_EINVAL, "cost: no plan to evaluate");
    if (!rp_plan_has_packing(plan)) return rp_fail(err, RP_EINVAL, "cost: the plan has no packing");
    if (!rp_plan_has_placement(plan)) return rp_fail(err, RP_EINVAL, "cost: the plan has no placement");
    if (rp_plan_num_gpus(plan) != c->G)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d GPUs, but the config has %d", rp_plan_num_gpus(plan),
                       c->G);
    if (rp_plan_ep_size(plan) != c->ep)
        return rp_fail(err, RP_EINVAL, "cost: the plan has EP groups of %d GPUs, but the config has %d",
                       rp_plan_ep_size(plan), c->ep);
    if (rp_plan_num_layers(plan) != c->L)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d layers, but the model has %d",
                       rp_plan_num_layers(plan), c->L);
    if (rp_plan_num_experts(plan) != c->E)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d experts, but the model has %d",
                       rp_plan_num_experts(plan), c->E);
    if (rp_plan_num_microbatches(plan) < 1)
        return rp_fail(err, RP_EINVAL, "cost: the plan has %d microbatches", rp_plan_num_microbatches(plan));
    if (rp_plan_num_microbatches(plan) % c->K != 0)
        return rp_fail(err, RP_EINVAL,
                       "cost: the plan has %d microbatches, not a multiple of trainer.mini_batches %d (every "
                       "mini-batch runs the same number)", rp_plan_num_microbatches(plan), c->K);
    if (c->schedule == RP_SCHEDULE_INTERLEAVED && rp_plan_num_microbatches(plan) / c->K % c->PP != 0)
        return rp_fail(err, RP_EINVAL,
                       "cost: the plan has %d microbatches per mini-batch, not a multiple of pipeline_parallel_size "
                       "%d, which the interleaved schedule needs (Megatron)", rp_plan_num_microbatches(plan) / c->K,
                       c->PP);
    const int32_t *sb = rp_plan_slot_begin(plan);
    if (!sb || sb[0] != 0 || sb[c->ep] != rp_plan_total_slots(plan))
        return rp_fail(err, RP_EINVAL, "cost: the plan's slot offsets are inconsistent");
    for (int32_t j = 0; j < c->ep; j++)
        if (sb[j + 1] < sb[j])
            return rp_fail(err, RP_EINVAL, "cost: the plan's EP rank %d has a negative slot count", j);
    return RP_OK;
}

/* Read the packing into seq_rank/seq_mb; every sequence exactly once. */
static rp_status read_packing(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    if (rp_plan_num_seqs(plan) != c->N)
        return rp_fail(err, RP_EINVAL, "cost: the plan packs %d sequences, but the batch has %d",
                       rp_plan_num_seqs(plan), c->N);
    for (int32_t i = 0; i < c->N; i++) s->seq_rank[i] = -1;
    for (int32_t g = 0; g < c->G; g++)
        for (int32_t m = 0; m < s->M; m++) {
            int32_t count = 0;
            const int32_t *list = rp_plan_microbatch(plan, g, m, &count);
            for (int32_t k = 0; k < count; k++) {
                int32_t q = list[k];
                if (q < 0 || q >= c->N)
                    return rp_fail_seq(err, RP_EINVAL, q, "cost: rank %d mb %d holds sequence %d, but the batch has %d",
                                    g, m, q, c->N);
                if (s->seq_rank[q] >= 0)
                    return rp_fail_seq(err, RP_EINVAL, q, "cost: sequence %d is packed twice (rank %d mb %d, rank %d mb %d)",
                                    q, s->seq_rank[q], s->seq_mb[q], g, m);
                s->seq_rank[q] = g;
                s->seq_mb[q] = m;
            }
        }
    for (int32_t i = 0; i < c->N; i++)
        if (s->seq_rank[i] < 0) return rp_fail_seq(err, RP_EINVAL, i, "cost: sequence %d is not packed", i);
    return RP_OK;
}

/* Extra replicas and share sets of the plan, merged per (mb, layer) by expert. */
typedef struct lever_counts {
    int32_t entries, extras, shares;
} lever_counts;

static lever_counts count_levers(const rp_plan *plan)
{
    lever_counts n = {0, 0, 0};
    n.extras = rp_plan_num_extra_replicas(plan);
    int32_t sets = rp_plan_num_share_sets(plan);
    for (int32_t i = 0; i < sets; i++) {
        int32_t count = 0;
        rp_plan_share_set(plan, i, NULL, NULL, NULL, &count);
        if (count > 0) n.shares += count;
    }
    n.entries = n.extras + sets;
    return n;
}

static int key_cmp(int32_t m1, int32_t l1, int32_t e1, int32_t m2, int32_t l2, int32_t e2)
{
    if (m1 != m2) return m1 < m2 ? -1 : 1;
    if (l1 != l2) return l1 < l2 ? -1 : 1;
    if (e1 != e2) return e1 < e2 ? -1 : 1;
    return 0;
}

static rp_status read_levers(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    const int32_t L = c->L, ML = s->M * L;
    int32_t nx = rp_plan_num_extra_replicas(plan), ns = rp_plan_num_share_sets(plan);
    int32_t ix = 0, is = 0, n_ov = 0, n_extra = 0, n_share = 0;
    memset(s->ov_begin, 0, ((size_t)ML + 1) * sizeof *s->ov_begin);
    memset(s->extra_count, 0, (size_t)ML * c->ep * sizeof *s->extra_count);
    int32_t most_extras = 0; /* of one key: with S, bounds every replica set, also after slot moves */
    while (ix < nx || is < ns) {
        int32_t xm, xl, xe, xr, sm = 0, sl = 0, se = 0, scount = 0;
        const double *vals = NULL;
        rp_plan_extra_replica(plan, ix, &xm, &xl, &xe, &xr);
        if (is < ns) vals = rp_plan_share_set(plan, is, &sm, &sl, &se, &scount);
        int cmp = ix >= nx ? 1 : is >= ns ? -1 : key_cmp(xm, xl, xe, sm, sl, se);
        int32_t m = cmp <= 0 ? xm : sm, l = cmp <= 0 ? xl : sl, e = cmp <= 0 ? xe : se;
        if (m < 0 || m >= s->M || l < 0 || l >= L || e < 0 || e >= c->E)
            return fail_expert(err, e, "cost: a lever names mb %d layer %d expert %d, outside the plan", m, l, e);
        cost_override *o = &s->ov[n_ov++];
        o->expert = e;
        o->num_extra = 0;
        o->extra_off = n_extra;
        o->num_shares = 0;
        o->share_off = 0;
        /* every extra replica of this key (they are contiguous and keep insertion order) */
        while (ix < nx) {
            rp_plan_extra_replica(plan, ix, &xm, &xl, &xe, &xr);
            if (key_cmp(xm, xl, xe, m, l, e) != 0) break;
            if (xr < 0 || xr >= c->ep)
                return fail_expert(err, e, "cost: mb %d layer %d expert %d has an extra replica on EP rank %d, "
                                   "but EP groups have %d ranks", m, l, e, xr, c->ep);
            s->extra_rank[n_extra++] = xr;
            s->extra_count[((size_t)m * L + l) * c->ep + xr]++;
            o->num_extra++;
            ix++;
        }
        int32_t nb = s->rep_off[(size_t)l * (c->E + 1) + e + 1] - s->rep_off[(size_t)l * (c->E + 1) + e];
        int32_t R = nb + o->num_extra;
        if (o->num_extra > most_extras) most_extras = o->num_extra;
        if (is < ns && key_cmp(sm, sl, se, m, l, e) == 0) {
            is++;
            if (scount > 0) {
                if (scount != R)
                    return fail_expert(err, e, "cost: mb %d layer %d expert %d has %d shares for %d replicas",
                                       m, l, e, scount, R);
                double sum = 0.0;
                for (int32_t i = 0; i < R; i++) {
                    if (!isfinite(vals[i]) || vals[i] < 0)
                        return fail_expert(err, e, "cost: mb %d layer %d expert %d has share %g for replica %d; "
                                           "shares must be finite and >= 0", m, l, e, vals[i], i);
                    sum += vals[i];
                }
                if (!(fabs(sum - 1.0) <= 1e-6))
                    return fail_expert(err, e, "cost: mb %d layer %d expert %d has shares summing to %.9g, not 1",
                                       m, l, e, sum);
                o->num_shares = R;
                o->share_off = n_share;
                for (int32_t i = 0; i < R; i++) s->share_val[n_share++] = vals[i] / sum;
            }
        }
        s->ov_begin[m * L + l + 1]++;
    }
    for (int32_t i = 0; i < ML; i++) s->ov_begin[i + 1] += s->ov_begin[i];
    if ((int64_t)s->S + most_extras > INT32_MAX / 8)
        return rp_fail(err, RP_ERANGE, "cost: %d slots and %d extra replicas of one expert are too many",
                       s->S, most_extras);
    s->max_replicas = s->S + most_extras;
    return RP_OK;
}

static rp_status read_placement(const rp_cost *c, const rp_plan *plan, cost_state *s, rp_error *err)
{
    const int32_t S = s->S, E = c->E;
    for (int32_t l = 0; l < c->L; l++) {
        const int32_t *row = rp_plan_phy2log(plan, l);
        int32_t *dst = s->phy2log + (size_t)l * S;
        for (int32_t k = 0; k < S; k++) {
            if (row[k] < -1 || row[k] >= E)
                return fail_expert(err, row[k], "cost: layer %d slot %d holds expert %d, but the model has %d",
                                   l, k, row[k], E);
            dst[k] = row[k];
        }
        int32_t *off = s->rep_off + (size_t)l * (E + 1);
        cost_index_layer(E, S, s->slot_rank, dst, off, s->rep_rank + (size_t)l * S);
        for (int32_t e = 0; e < E; e++)
            if (off[e + 1] == off[e])
                return fail_expert(err, e, "cost: layer %d expert %d has no replica", l, e);
    }
    return RP_OK;
}

static rp_status state_alloc(rp_cost *c, const rp_plan *plan, cost_state **out, rp_error *err)
{
    rp_context *ctx = c->ctx;
    bool bad = false;
    const int64_t M = rp_plan_num_microbatches(plan), S = rp_plan_total_slots(plan);
    const int64_t G = c->G, L = c->L, E = c->E, ep = c->ep, Q = c->Q;
    int64_t ML = M * L, cells = 0; /* M, L < 2^31: no overflow */
    /* every other array is at most a few times `cells`, or L x S < 2^47 */
    if (rp_mul_overflow(ML, G, &cells) || rp_mul_overflow(cells, E, &cells) || cells > ((int64_t)1 << 56))
        return rp_fail(err, RP_ERANGE, "cost: %lld microbatches x %lld layers x %lld GPUs x %lld experts is too "
                       "large to evaluate", (long long)M, (long long)L, (long long)G, (long long)E);
    cost_state *s = rp_calloc(ctx, 1, sizeof *s);
    if (!s) return rp_fail_nomem(err, "a cost evaluation");
    lever_counts lv = count_levers(plan);
    s->bytes = sizeof *s;
    s->plan = plan;
    s->M = (int32_t)M;
    s->S = (int32_t)S;
    s->slot_begin = take(ctx, ep + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->slot_rank = take(ctx, S, sizeof(int32_t), false, &bad, &s->bytes);
    s->phy2log = take(ctx, L * S, sizeof(int32_t), false, &bad, &s->bytes);
    s->rep_off = take(ctx, L * (E + 1), sizeof(int32_t), false, &bad, &s->bytes);
    s->rep_rank = take(ctx, L * S, sizeof(int32_t), false, &bad, &s->bytes);
    s->ov_begin = take(ctx, ML + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->ov = take(ctx, lv.entries, sizeof(cost_override), false, &bad, &s->bytes);
    s->extra_rank = take(ctx, lv.extras, sizeof(int32_t), false, &bad, &s->bytes);
    s->share_val = take(ctx, lv.shares, sizeof(double), false, &bad, &s->bytes);
    s->extra_count = take(ctx, ML * ep, sizeof(int32_t), false, &bad, &s->bytes);
    s->seq_rank = take(ctx, c->N, sizeof(int32_t), false, &bad, &s->bytes);
    s->seq_mb = take(ctx, c->N, sizeof(int32_t), false, &bad, &s->bytes);
    s->cell_tokens = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_quad = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_pad = take(ctx, G * M, sizeof(int64_t), true, &bad, &s->bytes);
    s->cell_top = take(ctx, G * M, sizeof(int32_t), true, &bad, &s->bytes);
    /* s->counts: by bind_counts, once the packing is read (it may be the bound state's) */
    s->gtotal = take(ctx, ML * Q * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->gpair = take(ctx, ML * Q * ep * ep, sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_dst = take(ctx, L * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_seg = take(ctx, L * (ep + 2), sizeof(int32_t), false, &bad, &s->bytes);
    s->lay_ord = take(ctx, L * E, sizeof(int32_t), false, &bad, &s->bytes);
    s->attn = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dense_f = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dense_b = take(ctx, G * M, sizeof(double), false, &bad, &s->bytes);
    s->dfmax = take(ctx, M * Q, sizeof(double), false, &bad, &s->bytes);
    s->dbmax = take(ctx, M * Q, sizeof(double), false, &bad, &s->bytes);
    s->dfarg = take(ctx, M * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->expert = take(ctx, ML * G, sizeof(double), false, &bad, &s->bytes);
    s->dispatch = take(ctx, ML * G, sizeof(double), false, &bad, &s->bytes);
    s->xmax = take(ctx, ML * Q, sizeof(double), false, &bad, &s->bytes);
    s->dmax = take(ctx, ML * Q, sizeof(double), false, &bad, &s->bytes);
    s->xarg = take(ctx, ML * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->darg = take(ctx, ML * Q, sizeof(int32_t), false, &bad, &s->bytes);
    s->layer_t = take(ctx, ML * c->LW, sizeof(double), false, &bad, &s->bytes);
    s->grad_gpu = take(ctx, L * G, sizeof(double), false, &bad, &s->bytes);
    const int64_t PV = (int64_t)c->PP * c->VPP;
    s->pipe_ops = take(ctx, cost_pipe_capacity(c->PP, c->VPP, (int32_t)M), sizeof(cost_pipe_op), false, &bad,
                       &s->bytes);
    s->pipe_begin = take(ctx, c->PP + 1, sizeof(int32_t), false, &bad, &s->bytes);
    s->pipe_fend = take(ctx, PV * M, sizeof(double), false, &bad, &s->bytes);
    s->pipe_bend = take(ctx, PV * M, sizeof(double), false, &bad, &s->bytes);
    s->pipe_tdev = take(ctx, c->PP, sizeof(double), false, &bad, &s->bytes);
    s->pipe_next = take(ctx, c->PP, sizeof(int32_t), false, &bad, &s->bytes);
    if (bad || !s->slot_begin || !s->slot_rank || !s->phy2log || !s->rep_off || !s->rep_rank ||
        !s->ov_begin || !s->ov || !s->extra_rank || !s->share_val || !s->extra_count ||
        !s->seq_rank || !s->seq_mb || !s->cell_tokens || !s->cell_quad || !s->cell_pad || !s->cell_top ||
        !s->gtotal || !s->gpair || !s->lay_dst || !s->lay_seg || !s->lay_ord || !s->attn || !s->dense_f || !s->dense_b ||
        !s->dfmax || !s->dbmax || !s->dfarg ||
        !s->expert || !s->dispatch || !s->xmax || !s->dmax || !s->xarg || !s->darg ||
        !s->layer_t || !s->grad_gpu || !s->pipe_ops || !s->pipe_begin || !s->pipe_fend || !s->pipe_bend ||
        !s->pipe_tdev || !s->pipe_next) {
        state_free(ctx, s);
        return bad ? rp_fail(err, RP_ERANGE, "cost: a plan of %lld microbatches is too large to evaluate",
                             (long long)M)
                   : rp_fail_nomem(err, "a cost evaluation");
    }
    cost_pipe_schedule(c->PP, c->VPP, c->schedule, (int32_t)M / c->K, s->pipe_ops, s->pipe_begin);
    *out = s;
    return RP_OK;
}

/* ---- what an evaluation will take, before it is paid ----------------------------------- */

int64_t cost_work_units(const rp_config *cfg, const rp_batch *batch, int64_t M, int64_t S)
{
    const rp_model *md = rp_config_model(cfg);
    const rp_topology *t = rp_config_topology(cfg);
    const int64_t L = md->num_layers, E = md->num_experts, G = t->num_gpus, ep = t->ep_size, Q = G / ep;
    const int64_t N = rp_batch_num_seqs(batch);
    /* as the evaluator counts its operations: every sequence's histogram at every layer,
     * read whole and added (2 E); then per (microbatch, layer): the slots, the (GPU,
     * expert) counts, and each EP group's dispatch pairs, 2 x ep x (E + ep)
     * (cost_group_rebuild; with EP 64 and 256 experts twice the counts), and its pass over
     * its ranks, 3 ep^2 + 5 E + 9 ep (cost_group_eval, cost_dst_map). Without the pass and
     * with only the nonzero experts of a histogram, one evaluation at the DeepSeek-V3-like
     * example was priced at 70% of what it counts (17.1 of 24.2 M) */
    double work = (double)L * ((double)M * S + (double)M * G * E + (double)N * 2.0 * E +
                               (double)M * Q * (2.0 * ep * (E + ep) + 3.0 * ep * ep + 5.0 * E + 9.0 * ep)) + N;
    return work < 9e18 ? (int64_t)work : INT64_MAX;
}

/* Bytes of take(count, size): the same rounding, so the sums below equal what
 * state_alloc and scratch_alloc hand out (tests/test_cost.c holds them to it). */
static void need(int64_t count, size_t size, bool *bad, size_t *total)
{
    size_t n = bytes_of(count, size, bad);
    if (!*bad && n > SIZE_MAX / 4 - *total) *bad = true;
    if (!*bad) *total += n;
}

/* Most extra replicas one (microbatch, layer, expert) has: they are stored sorted by key. */
static int32_t most_extras_of(const rp_plan *plan)
{
    int32_t nx = rp_plan_num_extra_replicas(plan), most = 0, run = 0, pm = -1, pl = -1, pe = -1;
    for (int32_t i = 0; i < nx; i++) {
        int32_t m, l, e, r;
        rp_plan_extra_replica(plan, i, &m, &l, &e, &r);
        run = (m == pm && l == pl && e == pe) ? run + 1 : 1;
        pm = m, pl = l, pe = e;
        if (run > most) most = run;
    }
    return most;
}

rp_status rp_cost_evaluation_needs(const rp_cost *c, const rp_plan *plan, int64_t *units, size_t *bytes,
                                   rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st = check_plan_shape(c, plan, err);
    if (st != RP_OK) return st;
    const int64_t M = rp_plan_num_microbatches(plan), S = rp_plan_total_slots(plan);
    const int64_t G = c->G, L = c->L, E = c->E, ep = c->ep, Q = c->Q, ML = M * L;
    int64_t cells;
    if (rp_mul_overflow(ML, G, &cells) || rp_mul_overflow(cells, E, &cells) || cells > ((int64_t)1 << 56))
        return rp_fail(err, RP_ERANGE, "cost: %lld microbatches x %lld layers x %lld GPUs x %lld experts is too "
                       "large to evaluate", (long long)M, (long long)L, (long long)G, (long long)E);
    lever_counts lv = count_levers(plan);
    bool bad = false;
    size_t total = sizeof(cost_state);
    /* state_alloc, array by array */
    need(ep + 1, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(L * S, sizeof(int32_t), &bad, &total);
    need(L * (E + 1), sizeof(int32_t), &bad, &total);
    need(L * S, sizeof(int32_t), &bad, &total);
    need(ML + 1, sizeof(int32_t), &bad, &total);
    need(lv.entries, sizeof(cost_override), &bad, &total);
    need(lv.extras, sizeof(int32_t), &bad, &total);
    need(lv.shares, sizeof(double), &bad, &total);
    need(ML * ep, sizeof(int32_t), &bad, &total);
    need(c->N, sizeof(int32_t), &bad, &total);
    need(c->N, sizeof(int32_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total);
    need(G * M, sizeof(int64_t), &bad, &total); /* cell_pad */
    need(G * M, sizeof(int32_t), &bad, &total);
    need(cells, sizeof(int32_t), &bad, &total);
    need(ML * Q * E, sizeof(int32_t), &bad, &total);
    need(ML * Q * ep * ep, sizeof(int32_t), &bad, &total);
    need(L * E, sizeof(int32_t), &bad, &total);
    need(L * (ep + 2), sizeof(int32_t), &bad, &total);
    need(L * E, sizeof(int32_t), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(G * M, sizeof(double), &bad, &total);
    need(M * Q, sizeof(double), &bad, &total);
    need(M * Q, sizeof(double), &bad, &total);
    need(M * Q, sizeof(int32_t), &bad, &total);
    need(ML * G, sizeof(double), &bad, &total);
    need(ML * G, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(double), &bad, &total);
    need(ML * Q, sizeof(int32_t), &bad, &total);
    need(ML * Q, sizeof(int32_t), &bad, &total);
    need(ML * c->LW, sizeof(double), &bad, &total);
    need(L * G, sizeof(double), &bad, &total);
    const int64_t PV = (int64_t)c->PP * c->VPP;
    need(cost_pipe_capacity(c->PP, c->VPP, (int32_t)M), sizeof(cost_pipe_op), &bad, &total);
    need(c->PP + 1, sizeof(int32_t), &bad, &total);
    need(PV * M, sizeof(double), &bad, &total);
    need(PV * M, sizeof(double), &bad, &total);
    need(c->PP, sizeof(double), &bad, &total);
    need(c->PP, sizeof(int32_t), &bad, &total);
    /* scratch_alloc, with max_replicas as read_levers sets it */
    int64_t R = S + most_extras_of(plan);
    need(2 * L * E, sizeof(uint32_t), &bad, &total);
    for (int i = 0; i < 6; i++) need(ep, sizeof(double), &bad, &total);
    need(2 * ep, sizeof(double), &bad, &total); /* xacc */
    need(R, sizeof(int32_t), &bad, &total);
    need(R, sizeof(double), &bad, &total);
    need(R, sizeof(double), &bad, &total);
    need(ML * c->LW, sizeof(double), &bad, &total);
    for (int i = 0; i < 4; i++) need(Q, sizeof(double), &bad, &total);
    need(E + 1, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(S, sizeof(int32_t), &bad, &total);
    need(G, sizeof(double), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    need(ep * ep, sizeof(int32_t), &bad, &total);
    need(ep * ep, sizeof(double), &bad, &total);
    need(ep, sizeof(int64_t), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    need(ep + 2, sizeof(int32_t), &bad, &total);
    need(E, sizeof(int32_t), &bad, &total);
    if (bad)
        return rp_fail(err, RP_ERANGE, "cost: a plan of %lld microbatches is too large to evaluate", (long long)M);
    if (units) *units = cost_work_units(c->cfg, c->batch, M, S);
    if (bytes) *bytes = total;
    return RP_OK;
}

/* Attention and the dense phase of every cell, and the per-(microbatch, group) maxima. */
static void eval_dense(const rp_cost *c, cost_state *s)
{
    for (int32_t g = 0; g < c->G; g++)
        for (int32_t m = 0; m < s->M; m++) {
            size_t i = (size_t)g * s->M + m;
            const int64_t tok = s->cell_tokens[i] + s->cell_pad[i];
            s->attn[i] = cost_cell_attention(c, s->cell_quad[i], tok, g);
            cost_cell_dense(c, s->cell_quad[i], tok, g, &s->dense_f[i], &s->dense_b[i]);
        }
    for (int32_t m = 0; m < s->M; m++)
        for (int32_t q = 0; q < c->Q; q++) {
            size_t mq = (size_t)m * c->Q + q;
            cost_group_dense(c, s, m, q, -1, 0, 0, 0, -1, 0, 0, 0, &s->dfmax[mq], &s->dbmax[mq], &s->dfarg[mq]);
        }
}

/* Whether `s` packs every sequence where the bound state does, in as many microbatches:
 * then its per-(mb, layer, GPU, expert) counts are the bound state's. */
static bool same_packing(const rp_cost *c, const cost_state *old, const cost_state *s)
{
    return old && old->M == s->M && memcmp(old->seq_rank, s->seq_rank, (size_t)c->N * sizeof *s->seq_rank) == 0 &&
           memcmp(old->seq_mb, s->seq_mb, (size_t)c->N * sizeof *s->seq_mb) == 0;
}

/* The counts array of `s`: fresh zeroed memory, or with the bound state's packing none:
 * the bound state's array is taken over once nothing can fail any more (the commit frees
 * that state anyway), so scoring placements on one packing, as policies and the fallback
 * check do, copies no 12.6 MB per evaluation (reference scale) and faults in no fresh
 * pages for it. Counted in s->bytes either way. */
static rp_status bind_counts(rp_cost *c, cost_state *s, bool same, rp_error *err)
{
    bool bad = false;
    const int64_t cells = (int64_t)s->M * c->L * c->G * c->E; /* state_alloc checked the product */
    if (same) {
        s->bytes += bytes_of(cells, sizeof(int32_t), &bad);
        return RP_OK;
    }
    s->counts = take(c->ctx, cells, sizeof(int32_t), true, &bad, &s->bytes);
    if (!s->counts)
        return bad ? rp_fail(err, RP_ERANGE, "cost: the plan is too large to evaluate")
                   : rp_fail_nomem(err, "a cost evaluation");
    return RP_OK;
}

rp_status rp_cost_evaluate(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, rp_error *err)
{
    if (!c) return rp_fail(err, RP_EINVAL, "cost: no evaluator");
    rp_status st = check_plan_shape(c, plan, err);
    if (st != RP_OK) return st;
    if (c->st && c->memo_bound >= 0 && rp_plan_equal(c->memo[c->memo_bound].plan, plan)) {
        /* the bound state is this plan's evaluation: bind it to this copy of the plan */
        c->st->plan = plan;
        if (out) *out = c->memo[c->memo_bound].sum;
        return RP_OK;
    }
    cost_state *s = NULL;
    cost_scratch sc;
    memset(&sc, 0, sizeof sc);
    RP_CHECK_GOTO(state_alloc(c, plan, &s, err), st, out);
    const int32_t G = c->G, L = c->L, E = c->E, M = s->M, ep = c->ep;
    memcpy(s->slot_begin, rp_plan_slot_begin(plan), ((size_t)ep + 1) * sizeof(int32_t));
    s->slots_max = 0;
    for (int32_t j = 0; j < ep; j++) {
        int32_t n = s->slot_begin[j + 1] - s->slot_begin[j];
        if (n > s->slots_max) s->slots_max = n;
        for (int32_t k = s->slot_begin[j]; k < s->slot_begin[j + 1]; k++) s->slot_rank[k] = j;
    }
    /* reading the plan, zeroing the counts (calloc) and the slots' ranks */
    cost_count(c, (int64_t)G * M + 2 * (int64_t)c->N + (int64_t)L * (2 * (int64_t)s->S + 3 * (int64_t)E + s->S) +
                      rp_plan_num_extra_replicas(plan) + rp_plan_num_share_sets(plan) + (int64_t)M * L * (ep + 1) +
                      (int64_t)M * L * G * E + s->S);
    RP_CHECK_GOTO(read_packing(c, plan, s, err), st, out);
    const bool same = same_packing(c, c->st, s);
    RP_CHECK_GOTO(bind_counts(c, s, same, err), st, out);
    RP_CHECK_GOTO(read_placement(c, plan, s, err), st, out);
    RP_CHECK_GOTO(read_levers(c, plan, s, err), st, out);
    RP_CHECK_GOTO(scratch_alloc(c, s, &sc, err), st, out);
    if (rp_plan_balancing(plan) == RP_BALANCING_VIRTUAL_EXPERTS) {
        RP_CHECK_GOTO(cost_vexp_check(c, plan, err), st, out);
        s->vexp_owner = rp_alloc(c->ctx, (size_t)L * E * sizeof *s->vexp_owner);
        if (!s->vexp_owner) {
            st = rp_fail_nomem(err, "the experts' owners");
            goto out;
        }
        cost_vexp_owners(c, plan, s->vexp_owner);
        s->vexp = true;
    }

    /* Counts per (mb, layer, GPU, expert) from the per-sequence histograms; when the
     * packing is the one already bound (the same plan with another placement, as
     * policies compare them), the sums are copied instead of read again. */
    if (same) {
        /* nothing below fails: the bound state's counts become this state's */
        cost_state *old = c->st;
        const size_t cells = (size_t)G * M;
        cost_count(c, 2 * (int64_t)c->N + 3 * (int64_t)cells + (int64_t)M * L * G * E);
        memcpy(s->cell_tokens, old->cell_tokens, cells * sizeof *s->cell_tokens);
        memcpy(s->cell_quad, old->cell_quad, cells * sizeof *s->cell_quad);
        memcpy(s->cell_pad, old->cell_pad, cells * sizeof *s->cell_pad);
        memcpy(s->cell_top, old->cell_top, cells * sizeof *s->cell_top);
        s->counts = old->counts;
        old->counts = NULL;
    } else {
        cost_count(c, (int64_t)c->N * (1 + 2 * (int64_t)L * E) + (int64_t)G * M);
        for (size_t i = 0; i < (size_t)G * M; i++) s->cell_top[i] = -1;
        for (int32_t q = 0; q < c->N; q++) {
            int32_t g = s->seq_rank[q], m = s->seq_mb[q];
            int64_t len = c->cu_seqlens[q + 1] - c->cu_seqlens[q];
            size_t cell = (size_t)g * M + m;
            s->cell_tokens[cell] += len;
            s->cell_quad[cell] += c->seq_quad[q];
            s->cell_pad[cell] += cost_pad(c, len);
            if (s->cell_top[cell] < 0 || cost_seq_attention(c, q) > cost_seq_attention(c, s->cell_top[cell]))
                s->cell_top[cell] = q;
            stats_add_layers(c->stats, q, s->counts + ((size_t)m * L * G + g) * E, (size_t)G * E);
        }
    }

    eval_dense(c, s);
    cost_count(c, (int64_t)M * G + (int64_t)M * L * (c->Q + ep + 1));
    for (int32_t l = 0; l < L; l++)
        cost_layer_dst(c, s, l, s->rep_off + (size_t)l * (E + 1), s->rep_rank + (size_t)l * s->S);
    for (int32_t m = 0; m < M; m++)
        for (int32_t l = 0; l < L; l++) {
            size_t ml = (size_t)m * L + l;
            const int32_t *off = s->rep_off + (size_t)l * (E + 1), *rank = s->rep_rank + (size_t)l * s->S;
            cost_map map = cost_dst_map(c, s, m, l, off, rank, true, &sc);
            for (int32_t q = 0; q < c->Q; q++) {
                group_result r;
                size_t gq = ml * c->Q + q;
                int32_t *total = s->gtotal + gq * E;
                int32_t *pair = s->gpair + gq * ep * ep;
                cost_group_rebuild(c, s, m, l, q, map, total, pair);
                cost_group_tokens(c, s, m, q, sc.tok);
                cost_group_eval(c, s, m, l, q, off, rank, map, total, pair, sc.tok, s->expert + ml * G + (size_t)q * ep,
                                s->dispatch + ml * G + (size_t)q * ep, &r, &sc);
                s->xmax[gq] = r.xmax;
                s->dmax[gq] = r.dmax;
                s->xarg[gq] = r.xarg;
                s->darg[gq] = r.darg;
            }
            cost_layer_times(c, s->dfmax + (size_t)m * c->Q, s->dbmax + (size_t)m * c->Q, s->dmax + ml * c->Q,
                             s->xmax + ml * c->Q, s->layer_t + ml * c->LW);
        }
    for (int32_t l = 0; l < L; l++)
        cost_grad_layer(c, s, l, s->rep_off + (size_t)l * (E + 1), s->rep_rank + (size_t)l * s->S,
                        s->grad_gpu + (size_t)l * G);
    s->grad_s = cost_grad_total(c, s, -1, NULL);
    /* Extra replicas: a weight copy over NVLink before the microbatch's layer and its
     * gradient back after it; copies to different GPUs run in parallel. Under PP a
     * stage's GPUs copy only its own layers' replicas, and the stages copy at once: the
     * stage with the most copy time counts (PP 1: the sum, in the same order). */
    s->extra_s = 0.0;
    for (int32_t r = 0; r < c->PP; r++) {
        double stage_s = 0.0;
        if (c->extras_once) {
            stage_s = cost_extras_once(c, s, r, false, c->extras_ahead);
            if (stage_s > s->extra_s) s->extra_s = stage_s;
            continue;
        }
        for (int32_t i = 0; i < M * L; i++) {
            if (c->layer_stage[i % L] != r) continue;
            int32_t most = 0;
            for (int32_t j = 0; j < ep; j++)
                if (s->extra_count[(size_t)i * ep + j] > most) most = s->extra_count[(size_t)i * ep + j];
            if (most > 0) stage_s += 2.0 * (most * c->expert_bytes / c->nv_bw + c->nv_lat);
        }
        if (stage_s > s->extra_s) s->extra_s = stage_s;
    }
    s->step_s = cost_step_from(c, s, s->layer_t, s->grad_s);

    /* commit (nothing below can fail) */
    state_free(c->ctx, c->st);
    scratch_free(c->ctx, &c->sc);
    c->st = s;
    c->sc = sc;
    s = NULL;
    memset(&sc, 0, sizeof sc);
    rp_cost_summary sum;
    cost_summary(c, c->st, &sum);
    c->st->forward_s = cost_forward_s(c, c->st);
    memo_push(c, plan, &sum, c->st->forward_s);
    if (out) *out = sum;
out:
    state_free(c->ctx, s);
    scratch_free(c->ctx, &sc);
    return st;
}

/* ---- summary and breakdown ------------------------------------------------------- */

/* Phase maxima of (m, l) over sync domain q (-1: every group): forward dense phase and
 * backward, dispatch, experts, and the GPUs that set the forward ones. */
typedef struct phase_max {
    double df, db, d, x;
    int32_t dfarg, darg, xarg;
} phase_max;

static phase_max domain_phases(const rp_cost *c, const cost_state *s, int32_t m, int32_t l, int32_t q)
{
    const size_t ml = (size_t)m * c->L + l, mq = (size_t)m * c->Q;
    const int32_t q0 = q < 0 ? 0 : q, q1 = q < 0 ? c->Q : q + 1;
    phase_max p = {-1, -1, -1, -1, 0, 0, 0};
    for (int32_t k = q0; k < q1; k++) {
        if (s->dfmax[mq + k] > p.df) p.df = s->dfmax[mq + k], p.dfarg = s->dfarg[mq + k];
        if (s->dbmax[mq + k] > p.db) p.db = s->dbmax[mq + k];
        if (s->dmax[ml * c->Q + k] > p.d) p.d = s->dmax[ml * c->Q + k], p.darg = s->darg[ml * c->Q + k];
        if (s->xmax[ml * c->Q + k] > p.x) p.x = s->xmax[ml * c->Q + k], p.xarg = s->xarg[ml * c->Q + k];
    }
    return p;
}

/* The largest forward phase term of (m, l) in domain q: the dense phase (side attention),
 * dispatch or experts, and the GPU that sets it; ties to the earlier side. */
static rp_side layer_straggler(const rp_cost *c, const cost_state *s, int32_t m, int32_t l, int32_t q,
                               int32_t *gpu, double *value)
{
    phase_max p = domain_phases(c, s, m, l, q);
    rp_side side = RP_SIDE_ATTENTION;
    double best = p.df;
    *gpu = p.dfarg;
    if (p.d > best) {
        best = p.d;
        side = RP_SIDE_DISPATCH;
        *gpu = p.darg;
    }
    if (p.x > best) {
        best = p.x;
        side = RP_SIDE_EXPERT;
        *gpu = p.xarg;
    }
    if (value) *value = best;
    return side;
}

/* The sync domain that sets the step (-1 under global sync: every GPU). */
static int32_t summary_domain(const rp_cost *c, const cost_state *s)
{
    return c->sync == RP_SYNC_GROUP ? cost_critical_domain(c, s) : -1;
}

void cost_summary(const rp_cost *c, const cost_state *s, rp_cost_summary *out)
{
    const int32_t M = s->M, L = c->L, G = c->G, ep = c->ep;
    /* with cost_bound_step's loops */
    cost_count(c, (int64_t)M * G + (int64_t)M * L * (5 * (int64_t)c->Q + (int64_t)c->Q * ep + 3 * (int64_t)G + ep + 1) +
                      (int64_t)L * G);
    memset(out, 0, sizeof *out);
    const int32_t dom = summary_domain(c, s);
    double attn = 0, disp = 0, expert = 0, a_imb = 0, x_imb = 0, best = -1;
    for (int32_t m = 0; m < M; m++) {
        double sum = 0, amax = 0;
        for (int32_t g = 0; g < G; g++) {
            double a = s->attn[(size_t)g * M + m];
            sum += a;
            if (a > amax) amax = a;
        }
        double mean = sum / G;
        a_imb += mean > 0 ? amax / mean : 1.0;
        for (int32_t l = 0; l < L; l++) {
            size_t ml = (size_t)m * L + l;
            phase_max p = domain_phases(c, s, m, l, dom);
            attn += p.df + p.db;
            disp += p.d;
            expert += p.x;
            for (int32_t q = 0; q < c->Q; q++) {
                double gsum = 0;
                for (int32_t r = 0; r < ep; r++) gsum += s->expert[ml * G + (size_t)q * ep + r];
                double gmean = gsum / ep;
                x_imb += gmean > 0 ? s->xmax[ml * c->Q + q] / gmean : 1.0;
            }
            int32_t gpu;
            double value;
            rp_side side = layer_straggler(c, s, m, l, dom, &gpu, &value);
            if (value > best) {
                best = value;
                out->straggler_gpu = gpu;
                out->straggler_mb = m;
                out->straggler_layer = l;
                out->straggler_side = side;
            }
        }
    }
    /* every epoch runs every microbatch again; the replica gradient reduction follows
     * every mini-batch (factors of 1 leave the figures as they were) */
    const double E = c->epochs, EK = (double)c->epochs * c->K;
    out->step_s = s->step_s;
    out->attention_s = E * attn;
    out->dispatch_s = E * ((1.0 + c->bwd.communication) * disp);
    out->expert_s = E * ((1.0 + c->bwd.experts) * expert);
    out->combine_s = out->dispatch_s;
    out->grad_reduce_s = EK * s->grad_s;
    out->extra_copy_s = E * s->extra_s;
    out->lower_bound_s = cost_bound_step(c, s);
    out->ratio = out->lower_bound_s > 0 ? out->step_s / out->lower_bound_s : 1.0;
    out->attention_imbalance = a_imb / M;
    out->expert_imbalance = x_imb / ((double)M * L * c->Q);
}

/* The sync domain that sets mini-batch b's time, as cost_step_from takes it. */
static int32_t minibatch_domain(const rp_cost *c, const cost_state *s, int32_t b, double *time)
{
    int32_t q = 0;
    double worst = 0.0;
    for (int32_t d = 0; d < c->NQ; d++) {
        double sum = domain_sum(c, s, s->layer_t, d, b);
        if (d == 0 || sum > worst) worst = sum, q = d;
    }
    if (time) *time = worst;
    return q;
}

/* Pipeline figures (docs/cost-model.md, "Pipeline figures"): per mini-batch (each its own
 * pipeline) the critical path of the sync domain that sets it, and each stage's own
 * passes in that domain; summed over the mini-batches, times the epochs. Not on a hot
 * path: the domains' paths are recomputed per stage rather than kept. */
static void pipeline_summary(const rp_cost *c, const cost_state *s, rp_pipeline_summary *out)
{
    const int32_t L = c->L, Mk = s->M / c->K;
    memset(out, 0, sizeof *out);
    out->stages = c->PP;
    out->step_s = s->step_s;
    for (int32_t b = 0; b < c->K; b++) {
        double worst;
        minibatch_domain(c, s, b, &worst);
        out->critical_path_s += worst;
    }
    out->critical_path_s *= c->epochs;
    out->stage_busy_s = out->critical_path_s; /* one stage: the path is its passes */
    for (int32_t r = 0; r < c->PP && c->PP > 1; r++) {
        double busy = 0.0;
        for (int32_t b = 0; b < c->K; b++) {
            const int32_t q = minibatch_domain(c, s, b, NULL);
            const int32_t *order = cost_domain_order(c, s, q);
            for (int32_t pos = b * Mk; pos < (b + 1) * Mk; pos++) {
                const int32_t m = order ? order[pos] : pos;
                for (int32_t l = 0; l < L; l++)
                    if (c->layer_stage[l] == r) {
                        const double *t = s->layer_t + ((size_t)m * L + l) * c->LW;
                        busy += t[c->NQ + q] + t[2 * c->NQ + q];
                    }
            }
        }
        busy *= c->epochs;
        if (r == 0 || busy > out->stage_busy_s) {
            out->stage_busy_s = busy;
            out->busiest_stage = r;
        }
    }
    out->bubble_s = out->critical_path_s > out->stage_busy_s ? out->critical_path_s - out->stage_busy_s : 0.0;
}

rp_status rp_cost_pipeline_summary(const rp_cost *c, rp_pipeline_summary *out, rp_error *err)
{
    if (!c || !out) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    if (!c->st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    pipeline_summary(c, c->st, out);
    return RP_OK;
}

const double *rp_cost_attention_breakdown(const rp_cost *c) { return c && c->st ? c->st->attn : NULL; }
const double *rp_cost_expert_breakdown(const rp_cost *c) { return c && c->st ? c->st->expert : NULL; }
const double *rp_cost_dispatch_breakdown(const rp_cost *c) { return c && c->st ? c->st->dispatch : NULL; }
const double *rp_cost_combine_breakdown(const rp_cost *c) { return c && c->st ? c->st->dispatch : NULL; }

double rp_cost_current_s(const rp_cost *c) { return c && c->st ? c->st->step_s : NAN; }

rp_status rp_cost_current_summary(const rp_cost *c, rp_cost_summary *out, rp_error *err)
{
    if (!c || !out) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    if (!c->st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    cost_summary(c, c->st, out);
    return RP_OK;
}

double rp_cost_layer_s(const rp_cost *c, int32_t mb, int32_t layer)
{
    if (!c || !c->st || mb < 0 || mb >= c->st->M || layer < 0 || layer >= c->L) return NAN;
    const double *t = c->st->layer_t + ((size_t)mb * c->L + layer) * c->LW;
    double worst = t[0];
    for (int32_t q = 1; q < c->NQ; q++)
        if (t[q] > worst) worst = t[q];
    return worst;
}

rp_side rp_cost_layer_straggler(const rp_cost *c, int32_t mb, int32_t layer, int32_t *gpu)
{
    int32_t g = -1;
    rp_side side = RP_SIDE_ATTENTION;
    if (c && c->st && mb >= 0 && mb < c->st->M && layer >= 0 && layer < c->L)
        side = layer_straggler(c, c->st, mb, layer, summary_domain(c, c->st), &g, NULL);
    if (gpu) *gpu = g;
    return side;
}

int64_t rp_cost_operations(const rp_cost *c) { return c ? c->ops : 0; }

size_t rp_cost_bytes(const rp_cost *c)
{
    if (!c) return 0;
    size_t total = sizeof *c + (size_t)c->G * sizeof *c->gpu_node + (size_t)c->slot_table_n * sizeof(double);
    if (c->st) total += c->st->bytes + c->sc.bytes;
    return total;
}

/* ---- JSON ------------------------------------------------------------------------ */

typedef struct strbuf {
    rp_context *ctx;
    char *data;
    size_t len, cap;
    bool failed;
} strbuf;

static void sb_printf(strbuf *b, const char *fmt, ...) RP_PRINTF(2, 3);
static void sb_printf(strbuf *b, const char *fmt, ...)
{
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->data ? b->data + b->len : NULL, b->data ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = true;
            return;
        }
        if (b->data && (size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap : 4096;
        while (cap - b->len <= (size_t)n) cap *= 2;
        char *grown = rp_realloc(b->ctx, b->data, cap);
        if (!grown) {
            b->failed = true;
            return;
        }
        b->data = grown;
        b->cap = cap;
    }
}

static const char *side_name(rp_side side)
{
    switch (side) {
    case RP_SIDE_ATTENTION: return "attention";
    case RP_SIDE_DISPATCH: return "dispatch";
    case RP_SIDE_EXPERT: return "expert";
    case RP_SIDE_COMBINE: return "combine";
    }
    return "unknown";
}

static void sb_array(strbuf *b, const double *v, size_t n, size_t stride)
{
    sb_printf(b, "[");
    for (size_t i = 0; i < n; i++) sb_printf(b, "%s%.17g", i ? "," : "", v[i * stride]);
    sb_printf(b, "]");
}

rp_status rp_cost_breakdown_json(const rp_cost *c, char **text, size_t *len, rp_error *err)
{
    if (!c || !text) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    const cost_state *s = c->st;
    if (!s) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    const int32_t M = s->M, L = c->L, G = c->G;
    rp_cost_summary sum;
    cost_summary(c, s, &sum);
    const rp_backward *bw = &rp_config_hardware(c->cfg)->backward;
    strbuf b = {c->ctx, NULL, 0, 0, false};
    sb_printf(&b, "{\n\"summary\": {\"step_s\": %.17g, \"lower_bound_s\": %.17g, \"ratio\": %.17g, "
              "\"attention_s\": %.17g, \"dispatch_s\": %.17g, \"expert_s\": %.17g, \"combine_s\": %.17g, "
              "\"grad_reduce_s\": %.17g, \"extra_copy_s\": %.17g, \"attention_imbalance\": %.17g, "
              "\"expert_imbalance\": %.17g, \"straggler\": {\"gpu\": %d, \"microbatch\": %d, "
              "\"layer\": %d, \"side\": \"%s\"}",
              sum.step_s, sum.lower_bound_s, sum.ratio, sum.attention_s, sum.dispatch_s, sum.expert_s,
              sum.combine_s, sum.grad_reduce_s, sum.extra_copy_s, sum.attention_imbalance,
              sum.expert_imbalance, sum.straggler_gpu, sum.straggler_mb, sum.straggler_layer,
              side_name(sum.straggler_side));
    if (c->PP > 1) { /* PP 1 documents keep their keys */
        rp_pipeline_summary pipe;
        pipeline_summary(c, s, &pipe);
        sb_printf(&b, ", \"pipeline\": {\"stages\": %d, \"critical_path_s\": %.17g, \"busiest_stage\": %d, "
                  "\"stage_busy_s\": %.17g, \"bubble_s\": %.17g}",
                  pipe.stages, pipe.critical_path_s, pipe.busiest_stage, pipe.stage_busy_s, pipe.bubble_s);
    }
    sb_printf(&b, "},\n");
    static const char *const sync_names[] = {"group", "global"}, *const overlap_names[] = {"none", "layer"},
                             *const dedup_names[] = {"choice", "gpu", "node"};
    const rp_execution *xe = rp_config_execution(c->cfg);
    sb_printf(&b, "\"execution\": {\"executor\": \"%s\", \"sync\": \"%s\", \"overlap\": \"%s\", "
              "\"dispatch_dedup\": \"%s\", \"dispatch_bytes_per_element\": %d, \"combine_bytes_per_element\": %d, "
              "\"host_us_per_layer\": %.17g},\n",
              rp_executor_name(xe->executor), sync_names[c->sync], overlap_names[c->overlap], dedup_names[c->dedup],
              xe->dispatch_bytes_per_element, xe->combine_bytes_per_element, xe->host_s_per_layer * 1e6);
    /* what the replica gradient reduction carries per layer: under "group" the EP group's
     * one all-reduce of [R, params] (routepack.torch's buffer, R experts) */
    static const char *const grad_names[] = {"pairwise", "group", "holders"};
    sb_printf(&b, "\"replica_grad\": {\"form\": \"%s\", \"bytes_per_element\": %d, \"layers\": [",
              grad_names[c->grad_form], xe->replica_grad_bytes_per_element);
    double *row = rp_alloc(c->ctx, ((size_t)c->G + (size_t)c->ep) * sizeof *row);
    for (int32_t l = 0; row && l < c->L; l++) {
        const int32_t *off = s->rep_off + (size_t)l * (c->E + 1), *rank = s->rep_rank + (size_t)l * s->S;
        const int32_t R = group_reduce_experts(c, s, l, off);
        double *sent = row + c->G;
        grad_layer(c, s, l, off, rank, row, sent);
        sb_printf(&b, "%s{\"experts\": %d, \"bytes\": %.17g, \"sent_bytes\": [", l ? ", " : "", R, R * c->grad_bytes);
        for (int32_t j = 0; j < c->ep; j++) sb_printf(&b, "%s%.17g", j ? ", " : "", sent[j]);
        sb_printf(&b, "]}");
    }
    if (!row) b.failed = true;
    rp_free(c->ctx, row);
    sb_printf(&b, "]},\n");
    sb_printf(&b, "\"shape\": {\"num_gpus\": %d, \"num_microbatches\": %d, \"num_layers\": %d, "
              "\"num_experts\": %d, \"ep_size\": %d, \"backward\": {\"attention\": %.17g, \"projections\": %.17g, "
              "\"experts\": %.17g, \"token_linear\": %.17g, \"communication\": %.17g, \"fixed\": %.17g}, "
              "\"split_rule\": \"%s\"},\n",
              G, M, L, c->E, c->ep, bw->attention, bw->projections, bw->experts, bw->token_linear,
              bw->communication, bw->fixed, c->rule == RP_SPLIT_EVEN ? "even" : "locality");
    sb_printf(&b, "\"layers\": [");
    const int32_t dom = summary_domain(c, s); /* each layer's straggler: in the critical domain */
    for (int32_t m = 0; m < M; m++) {
        double amax = 0;
        for (int32_t g = 0; g < G; g++)
            if (s->attn[(size_t)g * M + m] > amax) amax = s->attn[(size_t)g * M + m];
        for (int32_t l = 0; l < L; l++) {
            size_t ml = (size_t)m * L + l;
            phase_max p = domain_phases(c, s, m, l, -1);
            int32_t gpu;
            rp_side side = layer_straggler(c, s, m, l, dom, &gpu, NULL);
            sb_printf(&b, "%s\n {\"microbatch\": %d, \"layer\": %d, \"time_s\": %.17g, \"attention_s\": %.17g, "
                      "\"dense_s\": %.17g, \"dense_backward_s\": %.17g, \"dispatch_s\": %.17g, \"expert_s\": %.17g, "
                      "\"combine_s\": %.17g, \"lower_bound_s\": %.17g, \"straggler_gpu\": %d, \"straggler_side\": \"%s\"",
                      ml ? "," : "", m, l, rp_cost_layer_s(c, m, l), amax, p.df, p.db, p.d, p.x, p.d,
                      cost_bound_layer(c, s, m, l), gpu, side_name(side));
            if (c->sync == RP_SYNC_GROUP) {
                sb_printf(&b, ", \"group_time_s\": ");
                sb_array(&b, s->layer_t + ml * c->LW, (size_t)c->NQ, 1);
            }
            sb_printf(&b, "}");
        }
    }
    sb_printf(&b, "],\n\"attention\": [");
    for (int32_t g = 0; g < G; g++) {
        sb_printf(&b, "%s\n ", g ? "," : "");
        sb_array(&b, s->attn + (size_t)g * M, (size_t)M, 1);
    }
    /* compute: forward and backward compute of one GPU for one (microbatch, layer): the
     * dense phase both ways and the experts at their multiplier (what a device times) */
    sb_printf(&b, "],\n\"compute\": [");
    for (int32_t m = 0; m < M; m++) {
        sb_printf(&b, "%s\n [", m ? "," : "");
        for (int32_t l = 0; l < L; l++) {
            sb_printf(&b, "%s\n  [", l ? "," : "");
            for (int32_t g = 0; g < G; g++) {
                size_t cell = (size_t)g * M + m;
                double v = s->dense_f[cell] + s->dense_b[cell] +
                           (1.0 + c->bwd.experts) * s->expert[((size_t)m * L + l) * G + g];
                sb_printf(&b, "%s%.17g", g ? "," : "", v);
            }
            sb_printf(&b, "]");
        }
        sb_printf(&b, "]");
    }
    const char *names[3] = {"expert", "dispatch", "combine"};
    const double *arrays[3] = {s->expert, s->dispatch, s->dispatch};
    for (int k = 0; k < 3; k++) {
        sb_printf(&b, "],\n\"%s\": [", names[k]);
        for (int32_t m = 0; m < M; m++) {
            sb_printf(&b, "%s\n [", m ? "," : "");
            for (int32_t l = 0; l < L; l++) {
                sb_printf(&b, "%s\n  ", l ? "," : "");
                sb_array(&b, arrays[k] + ((size_t)m * L + l) * G, (size_t)G, 1);
            }
            sb_printf(&b, "]");
        }
    }
    sb_printf(&b, "]\n}\n");
    if (b.failed) {
        rp_free(c->ctx, b.data);
        return rp_fail_nomem(err, "the cost breakdown JSON");
    }
    *text = b.data;
    if (len) *len = b.len;
    return RP_OK;
}
