/* Memory per GPU: expert slots, dense parameters, gradients, optimizer state (sharded
 * as Megatron's distributed optimizer shards it), a plan's extra replicas and the
 * migration staging, against hardware.hbm_bytes (docs/cost-model.md, "Memory per GPU"). */
#include "internal.h"
#include "limits_internal.h"
#include "memory_internal.h"
#include "routepack/memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parameters of one routed expert: the gate, up and down projections. */
static double expert_params(const rp_model *m) { return 3.0 * m->hidden_size * (double)m->expert_ffn_size; }

/* Megatron shards an expert's optimizer state over its expert-data-parallel group: the
 * num_ep_groups GPUs that hold the same slot; a dense parameter's over every GPU. */
static int32_t expert_shards(const rp_config *cfg)
{
    return rp_config_execution(cfg)->optimizer_sharding == RP_OPTIMIZER_SHARDING_DP
               ? rp_config_topology(cfg)->num_ep_groups
               : 1;
}

/* ... and a dense parameter's over the data-parallel group with CP (Megatron's
 * data_parallel_group_with_cp: the CP ranks replicate the dense weights), DP x CP GPUs. */
static int32_t dense_shards(const rp_config *cfg)
{
    const rp_topology *t = rp_config_topology(cfg);
    return rp_config_execution(cfg)->optimizer_sharding == RP_OPTIMIZER_SHARDING_DP
               ? t->num_gpus * t->context_parallel_size
               : 1;
}

int64_t rp_memory_expert_move_bytes(const rp_config *cfg)
{
    if (!cfg) return 0;
    const rp_model *m = rp_config_model(cfg);
    /* 3 d f <= 3 * 2^48 and the byte counts are <= 16 and 256 (config limits): the
     * products stay far inside int64. */
    int64_t params = 3 * (int64_t)m->hidden_size * m->expert_ffn_size;
    int64_t shards = expert_shards(cfg);
    return params * m->bytes_per_param + (params * m->bytes_per_optimizer_state + shards - 1) / shards;
}

double memory_extra_replica_bytes(const rp_config *cfg)
{
    const rp_model *m = rp_config_model(cfg);
    return expert_params(m) * (m->bytes_per_param + m->bytes_per_grad);
}

static int compare_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The pipeline stage holding MoE layer l (0 when PP is 1): virtual stage v runs on v % PP. */
static int32_t stage_of_layer(const rp_topology *t, int32_t l)
{
    for (int32_t v = 0; v < t->pipeline_parallel_size * t->virtual_pipeline_size; v++)
        if (l >= t->stage_layer_begin[v] && l < t->stage_layer_begin[v] + t->layers_per_stage[v])
            return v % t->pipeline_parallel_size;
    return 0;
}

/* Extra replicas each EP rank holds in the step, counted once per (layer, expert): the
 * trainer fetches them once a step and keeps them, with their gradients, until the
 * replica gradients are reduced (routepack.torch's MoELayer.set_placement). Under PP a
 * GPU holds those of its stage's layers only. *out is [PP * ep_size] (stage s, EP rank
 * j at s * ep_size + j), allocated in the plan's context, or NULL when there are none. */
static rp_status count_extras(const rp_config *cfg, const rp_plan *plan, int64_t **out, rp_error *err)
{
    *out = NULL;
    const rp_topology *t = rp_config_topology(cfg);
    const int32_t ep = t->ep_size;
    int32_t n = plan ? rp_plan_num_extra_replicas(plan) : 0;
    if (n == 0) return RP_OK;
    rp_context *ctx = rp_plan_context(plan);
    const int64_t E = rp_plan_num_experts(plan), L = rp_plan_num_layers(plan);
    int64_t *keys = rp_alloc(ctx, (size_t)n * sizeof *keys);
    int64_t *per_rank = rp_calloc(ctx, (size_t)t->pipeline_parallel_size * ep, sizeof *per_rank);
    if (!keys || !per_rank) {
        rp_free(ctx, keys);
        rp_free(ctx, per_rank);
        return rp_fail_nomem(err, "counting the extra replicas of a plan");
    }
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t mb, l, e, j;
        rp_plan_extra_replica(plan, i, &mb, &l, &e, &j);
        if (j < 0 || j >= ep || l < 0 || l >= L || e < 0 || e >= E) continue; /* rp_plan_check's to report */
        keys[k++] = ((int64_t)j * L + l) * E + e;
    }
    qsort(keys, (size_t)k, sizeof *keys, compare_i64);
    for (int32_t i = 0; i < k; i++)
        if (i == 0 || keys[i] != keys[i - 1]) {
            const int32_t j = (int32_t)(keys[i] / (L * E)), l = (int32_t)(keys[i] / E % L);
            per_rank[(size_t)stage_of_layer(t, l) * ep + j]++;
        }
    rp_free(ctx, keys);
    *out = per_rank;
    return RP_OK;
}

/* MoE layers of pipeline stage s: under pipeline parallelism a GPU holds only its stage's
 * layers, over all its virtual stages. */
static int32_t stage_layers(const rp_topology *t, int32_t s)
{
    int32_t n = 0;
    for (int32_t c = 0; c < t->virtual_pipeline_size; c++) n += t->layers_per_stage[c * t->pipeline_parallel_size + s];
    return n;
}

/* The figures of GPU g of pipeline stage `stage` given its extra replica count. */
static void fill_stage(const rp_config *cfg, int32_t g, int32_t stage, int64_t extras, rp_gpu_memory *out)
{
    const rp_model *m = rp_config_model(cfg);
    const rp_topology *t = rp_config_topology(cfg);
    const rp_execution *x = rp_config_execution(cfg);
    memset(out, 0, sizeof *out);
    out->gpu = g;
    out->expert_optimizer_shards = expert_shards(cfg);
    out->dense_optimizer_shards = dense_shards(cfg);
    const int32_t layers = stage_layers(t, stage);
    out->pipeline_stage = stage;
    out->stage_layers = layers;
    const double slot_params = (double)t->slots[g] * layers * expert_params(m);
    out->expert_weight_bytes = slot_params * m->bytes_per_param;
    out->expert_grad_bytes = slot_params * m->bytes_per_grad;
    out->expert_optimizer_bytes = slot_params * m->bytes_per_optimizer_state / out->expert_optimizer_shards;
    /* a stage holds the dense parameters of its share of the layers (PP 1: all of them) */
    const double dense = t->pipeline_parallel_size == 1 ? (double)m->dense_params
                                                        : (double)m->dense_params * layers / m->num_layers;
    out->dense_weight_bytes = dense * m->bytes_per_param;
    out->dense_grad_bytes = dense * m->bytes_per_grad;
    out->dense_optimizer_bytes = dense * m->bytes_per_optimizer_state / out->dense_optimizer_shards;
    out->extra_replicas = extras;
    out->extra_replica_bytes = (double)extras * memory_extra_replica_bytes(cfg);
    /* Without a budget a migration is one round: in the worst case every slot of every
     * layer receives a new expert, each staged whole (docs/migration.md, "Rounds"). */
    out->staging_bytes = x->staging_budget_bytes > 0
                             ? (double)x->staging_budget_bytes
                             : (double)t->slots[g] * layers * (double)rp_memory_expert_move_bytes(cfg);
    /* Tensor parallelism (docs/cost-model.md, "TP and ETP"): DP rank g is a TP group of
     * TP GPUs. Each holds 1/TP of the dense parameters, and its share of the rank's
     * expert slots: slots / (TP / ETP) of one EP rank, each expert split over ETP GPUs,
     * so 1/TP of the rank's expert bytes (a set staging budget is per GPU already). */
    /* Context parallelism: the DP rank is CP TP groups. Its expert slots spread over its
     * TP x CP / ETP EP ranks (parallel folding), 1/(TP x CP) of the rank's expert bytes
     * per GPU; the dense parameters are replicated over the CP ranks (1/TP each; their
     * optimizer state shards over DP x CP, dense_shards). */
    const double tp = t->tensor_parallel_size, rank_gpus = tp * t->context_parallel_size;
    out->expert_weight_bytes /= rank_gpus;
    out->expert_grad_bytes /= rank_gpus;
    out->expert_optimizer_bytes /= rank_gpus;
    out->dense_weight_bytes /= tp;
    out->dense_grad_bytes /= tp;
    out->dense_optimizer_bytes /= tp;
    out->extra_replica_bytes /= rank_gpus;
    if (x->staging_budget_bytes == 0) out->staging_bytes /= rank_gpus;
    /* Activations, shown and not summed: a microbatch at the token cap, of which a GPU
     * holds 1/CP of the tokens (activation_bytes_per_token is per GPU already). */
    out->context_parallel_size = t->context_parallel_size;
    const rp_limits *lim = rp_config_limits(cfg);
    out->activation_tokens = (rp_limits_token_cap(lim) + t->context_parallel_size - 1) / t->context_parallel_size;
    out->activation_bytes = (double)rp_limits_token_cap(lim) * lim->activation_bytes_per_token;
    out->total_bytes = out->expert_weight_bytes + out->expert_grad_bytes + out->expert_optimizer_bytes +
                       out->dense_weight_bytes + out->dense_grad_bytes + out->dense_optimizer_bytes +
                       out->extra_replica_bytes + out->staging_bytes;
    out->capacity_bytes = rp_config_hardware(cfg)->hbm_bytes;
}

/* The figures of DP rank g (EP rank g % ep_size) in the stage where it needs the most
 * (the lowest stage on ties: without extra replicas the one with the most layers).
 * extras: count_extras' [PP * ep_size], or NULL. */
static void fill(const rp_config *cfg, int32_t g, const int64_t *extras, rp_gpu_memory *out)
{
    const rp_topology *t = rp_config_topology(cfg);
    const int32_t j = g % t->ep_size;
    rp_gpu_memory cur;
    for (int32_t s = 0; s < t->pipeline_parallel_size; s++) {
        fill_stage(cfg, g, s, extras ? extras[(size_t)s * t->ep_size + j] : 0, s ? &cur : out);
        if (s && cur.total_bytes > out->total_bytes) *out = cur;
    }
}

static rp_status check_plan(const rp_config *cfg, const rp_plan *plan, rp_error *err)
{
    if (!plan) return RP_OK;
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    if (rp_plan_num_gpus(plan) != t->num_gpus || rp_plan_ep_size(plan) != t->ep_size ||
        rp_plan_num_layers(plan) != m->num_layers || rp_plan_num_experts(plan) != m->num_experts)
        return rp_fail(err, RP_EINVAL,
                       "memory: the plan is shaped for %d GPUs, EP %d, %d layers, %d experts; the config has %d, "
                       "%d, %d, %d",
                       rp_plan_num_gpus(plan), rp_plan_ep_size(plan), rp_plan_num_layers(plan),
                       rp_plan_num_experts(plan), t->num_gpus, t->ep_size, m->num_layers, m->num_experts);
    return RP_OK;
}

rp_status memory_per_rank(const rp_config *cfg, const rp_plan *plan, rp_gpu_memory *per_rank, rp_error *err)
{
    const int32_t ep = rp_config_topology(cfg)->ep_size;
    rp_status st = check_plan(cfg, plan, err);
    int64_t *extras = NULL;
    if (st == RP_OK) st = count_extras(cfg, plan, &extras, err);
    if (st != RP_OK) return st;
    for (int32_t j = 0; j < ep; j++) fill(cfg, j, extras, &per_rank[j]);
    if (extras) rp_free(rp_plan_context(plan), extras);
    return RP_OK;
}

rp_status rp_memory_gpu(const rp_config *cfg, const rp_plan *plan, int32_t gpu, rp_gpu_memory *out, rp_error *err)
{
    if (!cfg || !out) return rp_fail(err, RP_EINVAL, "memory: rp_memory_gpu needs a config and an output");
    const rp_topology *t = rp_config_topology(cfg);
    if (gpu < 0 || gpu >= t->num_gpus)
        return rp_fail(err, RP_EINVAL, "memory: GPU %d is out of range: the config has %d GPUs", gpu, t->num_gpus);
    rp_status st = check_plan(cfg, plan, err);
    int64_t *extras = NULL;
    if (st == RP_OK) st = count_extras(cfg, plan, &extras, err);
    if (st != RP_OK) return st;
    /* EP rank j of every EP group holds the same slots and extra replicas */
    fill(cfg, gpu, extras, out);
    if (extras) rp_free(rp_plan_context(plan), extras);
    return RP_OK;
}

rp_status rp_memory_peak(const rp_config *cfg, const rp_plan *plan, rp_gpu_memory *out, rp_error *err)
{
    if (!cfg || !out) return rp_fail(err, RP_EINVAL, "memory: rp_memory_peak needs a config and an output");
    const int32_t ep = rp_config_topology(cfg)->ep_size;
    rp_status st = check_plan(cfg, plan, err);
    int64_t *extras = NULL;
    if (st == RP_OK) st = count_extras(cfg, plan, &extras, err);
    if (st != RP_OK) return st;
    /* the GPUs of EP group 0 stand for every group: later groups repeat their slots */
    rp_gpu_memory best, cur;
    fill(cfg, 0, extras, &best);
    for (int32_t j = 1; j < ep; j++) {
        fill(cfg, j, extras, &cur);
        if (cur.total_bytes > best.total_bytes) best = cur;
    }
    if (extras) rp_free(rp_plan_context(plan), extras);
    *out = best;
    return RP_OK;
}

/* The unit that suits `bytes`: GB, MB or kB (decimal, as hbm_bytes is written). */
static double unit_of(double bytes, const char **name)
{
    if (bytes >= 1e9) return *name = "GB", 1e9;
    if (bytes >= 1e6) return *name = "MB", 1e6;
    return *name = "kB", 1e3;
}

int rp_memory_describe(const rp_gpu_memory *mem, char *buf, size_t size)
{
    if (!mem) return snprintf(buf, size, "(no memory figures)");
    /* one unit for the total and its parts, the one that suits the total */
    const char *name, *cap_name;
    const double unit = unit_of(mem->total_bytes, &name), cap_unit = unit_of(mem->capacity_bytes, &cap_name);
    char extra[64] = "";
    if (mem->extra_replicas > 0)
        snprintf(extra, sizeof extra, ", %lld extra replica%s %.1f", (long long)mem->extra_replicas,
                 mem->extra_replicas == 1 ? "" : "s", mem->extra_replica_bytes / unit);
    bool over = mem->total_bytes > mem->capacity_bytes;
    return snprintf(buf, size,
                    "GPU %d needs %.1f %s (expert weights %.1f, expert grads %.1f, expert optimizer %.1f, dense "
                    "%.1f%s, staging %.1f %s)%s %.4g %s",
                    (int)mem->gpu, mem->total_bytes / unit, name, mem->expert_weight_bytes / unit,
                    mem->expert_grad_bytes / unit, mem->expert_optimizer_bytes / unit,
                    (mem->dense_weight_bytes + mem->dense_grad_bytes + mem->dense_optimizer_bytes) / unit, extra,
                    mem->staging_bytes / unit, name,
                    over ? " but hardware.hbm_bytes is" : ", within hardware.hbm_bytes of",
                    mem->capacity_bytes / cap_unit, cap_name);
}
