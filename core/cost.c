/* The cost model's evaluator object: the config's checks, construction and free
 * (docs/cost-model.md). Unit costs are in cost_unit.c, one EP group's evaluation in
 * cost_group.c, replica gradients in cost_grad.c, a whole plan's evaluation in
 * cost_eval.c and its summaries and breakdown in cost_summary.c. */
#include "cost_internal.h"
#include "routepack/executor.h"
#include "routepack/memory.h"
#include "routepack/virtual_experts.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SLOT_TABLE_MAX 16384

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
    c->grad_mem_s = c->grad_bytes / h->hbm_bytes_per_s;
    c->extra_launch_s = (pf ? pf->launches_per_local_expert : 0) * RP_HOST_LAUNCH_US * 1e-6;
    c->vexp_charges = pf && pf->balancer_charges;
    c->eff = h->gemm_efficiency;
    c->num_eff = h->num_gemm_efficiency;
    /* the grouped GEMM (cost_gemm.c), where the executor runs one */
    c->grouped = x->expert_gemm == RP_EXPERT_GEMM_GROUPED;
    c->extras_apart = c->grouped && x->extras_once && !x->extras_stacked;
    c->tile_rows = h->gemm_tile_rows > 0 ? h->gemm_tile_rows : pf && pf->group_align_rows > 0 ? pf->group_align_rows : 1;
    c->tile_pow2 = (c->tile_rows & (c->tile_rows - 1)) == 0;
    c->tile = c->tile_rows;
    c->geff = h->num_grouped_gemm_efficiency > 0 ? h->grouped_gemm_efficiency : NULL;
    c->num_geff = h->num_grouped_gemm_efficiency;
    c->weff = h->num_wgrad_efficiency > 0 ? h->wgrad_efficiency : h->gemm_efficiency;
    c->num_weff = h->num_wgrad_efficiency > 0 ? h->num_wgrad_efficiency : h->num_gemm_efficiency;
    c->dgrad = h->backward_experts_dgrad >= 0 ? h->backward_experts_dgrad
                                              : (h->backward.experts > 1.0 ? h->backward.experts - 1.0 : 0.0);
    c->wgrad_floor_s = 3.0 * d * f * (md->bytes_per_grad > 0 ? md->bytes_per_grad : md->bytes_per_param) /
                       h->hbm_bytes_per_s;
    c->xscale = 1.0 / (1.0 + h->backward.experts);
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
    c->wgrad_floor_s /= rank_gpus;
    c->stack_s /= rank_gpus;
    c->grad_mem_s /= rank_gpus;
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
    c->slot_table = rp_alloc(ctx, 2 * (size_t)c->slot_table_n * sizeof *c->slot_table);
    if (!c->slot_table) {
        rp_cost_free(c);
        return rp_fail_nomem(err, "a cost evaluator");
    }
    for (int32_t i = 0; i < c->slot_table_n; i++) {
        c->slot_table[i] = cost_slot_time(c, (double)i);
        c->slot_table[c->slot_table_n + i] = cost_wgrad_time(c, (double)i);
    }
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

void rp_cost_free(rp_cost *c)
{
    if (!c) return;
    rp_context *ctx = c->ctx;
    cost_state_free(ctx, c->st);
    cost_packed_free(ctx, c->packed);
    cost_scratch_free(ctx, &c->sc);
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
        total += len * len / cost_curve_at(c->attn_eff, c->num_attn_eff, len);
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
        c->seq_quad[s] = llround(ldexp(len * len / cost_curve_at(c->attn_eff, c->num_attn_eff, len), k));
    }
    c->attn_quad_s = ldexp(c->attn_flop_s, -k);
    return RP_OK;
}
