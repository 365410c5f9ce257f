/* Memory per GPU: the bytes a GPU holds to train a plan's placement (expert slots,
 * dense parameters, their gradients and optimizer state, the plan's extra replicas,
 * migration staging), against hardware.hbm_bytes. Activations are not counted: they
 * are the microbatch limits' business (docs/cost-model.md, "Memory per GPU"). */
#ifndef ROUTEPACK_MEMORY_H
#define ROUTEPACK_MEMORY_H

#include "routepack/config.h"
#include "routepack/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What one GPU holds, in bytes. Fields may be appended, never reordered. */
typedef struct rp_gpu_memory {
    int32_t gpu;                    /* the GPU these figures are for */
    double expert_weight_bytes;     /* every slot of every layer: 3 d f bytes_per_param */
    double expert_grad_bytes;       /* every slot: 3 d f bytes_per_grad */
    double expert_optimizer_bytes;  /* every slot: 3 d f bytes_per_optimizer_state / shards */
    double dense_weight_bytes;      /* dense_params bytes_per_param */
    double dense_grad_bytes;        /* dense_params bytes_per_grad */
    double dense_optimizer_bytes;   /* dense_params bytes_per_optimizer_state / shards */
    int64_t extra_replicas;         /* the plan's extra replicas this GPU holds in the step:
                                       distinct (layer, expert) over its microbatches */
    double extra_replica_bytes;     /* extra_replicas 3 d f (bytes_per_param + bytes_per_grad) */
    double staging_bytes;           /* migration staging (execution.staging_budget_bytes;
                                       0 there: every slot restaged at once) */
    double total_bytes;             /* the sum of the above */
    double capacity_bytes;          /* hardware.hbm_bytes */
    int32_t expert_optimizer_shards;/* 1, or num_ep_groups under optimizer_sharding "dp" */
    int32_t dense_optimizer_shards; /* 1, or num_gpus x context_parallel_size under optimizer_sharding "dp" */
    /* Under pipeline parallelism a GPU holds its stage's layers only, and the extra
     * replicas of those: the figures are for the stage where this DP rank needs the most
     * (without extra replicas the one with the most MoE layers; 0 when PP is 1), which
     * holds stage_layers of them (num_layers when PP is 1) and that share of dense_params. */
    int32_t pipeline_stage;
    int32_t stage_layers;
    /* Added after the first version. Activations, not in total_bytes (the microbatch
     * limits' business): one microbatch at the token cap (rp_limits' max_tokens_per_microbatch,
     * lowered by the memory cap), of whose tokens a GPU holds 1/context_parallel_size,
     * activation_tokens of them; activation_bytes = the cap x activation_bytes_per_token
     * (per GPU: its default divides by TP x CP). */
    int32_t context_parallel_size;
    int64_t activation_tokens;
    double activation_bytes;
} rp_gpu_memory;

/* The memory of GPU `gpu` under `cfg`, with the extra replicas of `plan` (NULL: the
 * config alone, no extra replicas). Every slot counts, empty or not: the trainer
 * allocates its buffers. Errors (nothing written): no config or output, gpu out of
 * range, a plan shaped for another config (RP_EINVAL); no memory. */
RP_API rp_status rp_memory_gpu(const rp_config *cfg, const rp_plan *plan, int32_t gpu, rp_gpu_memory *out,
                               rp_error *err);

/* The GPU that needs the most memory (the lowest id on ties), as rp_memory_gpu. */
RP_API rp_status rp_memory_peak(const rp_config *cfg, const rp_plan *plan, rp_gpu_memory *out, rp_error *err);

/* One line for messages: "GPU 3 needs 163.2 GB (expert weights 98.0 GB, ...) but
 * hardware.hbm_bytes is 141 GB" (or "... of hardware.hbm_bytes 141 GB" when it fits),
 * into buf (always NUL-terminated when size > 0). Returns what snprintf returns. */
RP_API int rp_memory_describe(const rp_gpu_memory *mem, char *buf, size_t size);

/* Bytes one expert copy moves in a migration: its weights plus the receiver's shard of
 * its optimizer state, 3 d f (bytes_per_param + bytes_per_optimizer_state / shards),
 * rounded up to a whole byte. Gradients do not move (they are zero between steps). */
RP_API int64_t rp_memory_expert_move_bytes(const rp_config *cfg);

#ifdef __cplusplus
}
#endif
#endif
