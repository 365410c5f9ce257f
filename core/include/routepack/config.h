/* RoutePack configuration: topology, hardware constants, model shape, limits and the
 * policy, read from one JSON document. Every key is documented in docs/config.md. */
#ifndef ROUTEPACK_CONFIG_H
#define ROUTEPACK_CONFIG_H

#include "routepack/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The machine, as the planner sees it: its unit (a "GPU" in every plan, cost and report)
 * is one data-parallel rank, which is a tensor-parallel group of tensor_parallel_size
 * physical GPUs (one GPU when TP is 1). Ranks follow Megatron-Core's order tp-cp-ep-dp-pp:
 * DP rank g is physical GPUs [g * tp, (g + 1) * tp), node-major, so it sits on node
 * g / gpus_per_node. EP groups are contiguous blocks of ep_size DP ranks (they may span
 * nodes). The physical counts are kept in the fields at the end. Under pipeline
 * parallelism (PP, outermost) the planner sees one pipeline stage: num_nodes, num_gpus and
 * the EP groups are one stage's, every stage has the same layout, and DP rank g of every
 * stage forms DP rank g's pipeline; the layers are split over the (virtual) stages.
 * Under context parallelism (CP) a DP rank is CP TP groups, TP x CP GPUs (GPUs
 * [g * tp * cp, (g + 1) * tp * cp)), which split every sequence of the rank. */
typedef enum rp_pipeline_schedule {
    RP_SCHEDULE_1F1B = 0,        /* PipeDream-Flush / Megatron's non-interleaved 1F1B */
    RP_SCHEDULE_INTERLEAVED = 1  /* Megatron's interleaved 1F1B over virtual stages */
} rp_pipeline_schedule;

typedef struct rp_topology {
    int32_t num_nodes;       /* nodes of one pipeline stage (at least 1; all nodes when PP is 1) */
    int32_t gpus_per_node;   /* DP ranks per node: physical_gpus_per_node / tensor_parallel_size */
    int32_t num_gpus;        /* DP ranks: num_nodes * gpus_per_node */
    int32_t dp_size;         /* == num_gpus */
    int32_t ep_size;         /* DP ranks per EP group; divides num_gpus */
    int32_t num_ep_groups;   /* num_gpus / ep_size */
    const int32_t *slots;    /* [num_gpus] expert slots per MoE layer on each DP rank (all of its EP ranks) */
    const double *speed;     /* [num_gpus] relative compute speed of each DP rank, 1.0 nominal */
    double nvlink_bytes_per_s;   /* per GPU, per direction, inside a node */
    double nvlink_latency_s;
    double net_bytes_per_s;      /* per GPU, per direction, across nodes */
    double net_latency_s;
    int32_t tensor_parallel_size;        /* physical GPUs of one DP rank (a TP group), >= 1 */
    int32_t expert_tensor_parallel_size; /* GPUs that share each expert's GEMMs (an ETP group); divides TP */
    int32_t expert_parallel_size;        /* Megatron's EP size: EP ranks (ETP groups) per EP group */
    int32_t physical_gpus_per_node;      /* GPUs per node as configured */
    /* Pipeline parallelism (docs/config.md, "topology"), appended after the fields above. */
    int32_t physical_num_nodes;          /* nodes as configured */
    int32_t pipeline_parallel_size;      /* pipeline stages (devices of a pipeline), >= 1 */
    int32_t virtual_pipeline_size;       /* model chunks per stage, >= 1 (> 1: interleaved) */
    rp_pipeline_schedule pipeline_schedule;
    /* [pipeline_parallel_size * virtual_pipeline_size] MoE layers of each virtual stage v,
     * in model order; v runs on stage v % pipeline_parallel_size (Megatron's model chunk
     * v / pipeline_parallel_size) and holds layers stage_layer_begin[v] .. + layers_per_stage[v] */
    const int32_t *layers_per_stage;
    const int32_t *stage_layer_begin;
    /* Context parallelism (docs/config.md, "topology"), appended after the fields above:
     * CP consecutive TP groups form one DP rank (TP x CP GPUs), each holding 1/CP of every
     * sequence of the rank's microbatches (Megatron's load-balanced chunks); 1: none. */
    int32_t context_parallel_size;
} rp_topology;

/* One point of an efficiency curve: at `tokens` the kernel reaches `efficiency` of peak.
 * For the grouped-GEMM curve `tokens` is the tokens one expert gets; for the attention
 * curve it is the sequence length. Linear interpolation between points; flat beyond. */
typedef struct rp_eff_point {
    double tokens;
    double efficiency;
} rp_eff_point;

/* Backward time / forward time of each term of the cost model (docs/cost-model.md).
 * A step costs (1 + multiplier) x forward for each term. */
typedef struct rp_backward {
    double attention;      /* FlashAttention backward / forward */
    double projections;    /* the attention's dense projections (QKV, O) */
    double experts;        /* the grouped expert GEMMs */
    double token_linear;   /* norms, RoPE, router, permute, activation, residual adds */
    double communication;  /* dispatch and combine */
    double fixed;          /* the fixed cost of one (microbatch, layer) */
} rp_backward;

/* Hardware constants of one GPU (defaults: H200 SXM, see docs/cost-model.md). */
typedef struct rp_hardware {
    double peak_flops;            /* dense BF16 FLOP/s */
    double hbm_bytes_per_s;
    double hbm_bytes;             /* memory capacity */
    const rp_eff_point *attention_efficiency; /* by sequence length (the `tokens` field) */
    int32_t num_attention_efficiency;
    double dense_efficiency;      /* fraction of peak for the attention projections */
    const rp_eff_point *gemm_efficiency; /* sorted by tokens */
    int32_t num_gemm_efficiency;
    rp_backward backward;         /* per-term backward / forward */
    double token_linear_bytes_per_token; /* HBM bytes per token per layer, forward */
    double layer_fixed_s;         /* fixed cost of one (microbatch, layer) forward on one GPU */
    /* Added after the first version (append only). The grouped expert GEMM
     * (docs/cost-model.md, "Experts"): */
    int32_t gemm_tile_rows;       /* rows each expert's rows are padded up to; 0: the executor's */
    const rp_eff_point *grouped_gemm_efficiency; /* by a GPU's total padded rows; NULL: gemm_efficiency
                                                    at the mean padded rows per expert */
    int32_t num_grouped_gemm_efficiency;
    const rp_eff_point *wgrad_efficiency; /* weight-gradient GEMMs by one expert's padded rows;
                                             NULL: gemm_efficiency */
    int32_t num_wgrad_efficiency;
    double backward_experts_dgrad; /* backward.experts_dgrad: the expert backward beyond its weight
                                      gradient, a multiple of the grouped forward; < 0: not
                                      given (backward.experts - 1, at least 0) */
} rp_hardware;

/* The MoE model. Attention shape drives the dense work; expert shape the sparse work. */
typedef struct rp_model {
    int32_t num_layers;       /* MoE layers */
    int32_t num_experts;      /* routed experts per layer */
    int32_t top_k;
    int32_t hidden_size;      /* d */
    int32_t expert_ffn_size;  /* f, one expert's intermediate size */
    int32_t num_heads;        /* h */
    int32_t num_kv_heads;     /* h_kv */
    int32_t head_dim;         /* d_h */
    int32_t bytes_per_param;          /* weights as trained (2 for BF16) */
    int32_t bytes_per_optimizer_state;/* optimizer bytes per parameter kept beside it */
    int32_t bytes_per_grad;           /* gradient buffer bytes per parameter (4: FP32 main grads) */
    int64_t dense_params;             /* parameters outside the routed experts, held by every GPU */
    /* Added after the first version (append only): what the step does outside the MoE
     * layers (docs/cost-model.md, "The whole step"). */
    int32_t vocab_size;               /* LM head and loss; 0: not priced */
    int32_t dense_layers;             /* transformer layers with a dense MLP (not in num_layers) */
    int32_t dense_ffn_size;           /* their MLP's intermediate size */
} rp_model;

/* Limits of one microbatch. */
typedef struct rp_limits {
    int64_t max_tokens_per_microbatch;  /* token cap; > 0 */
    int32_t num_microbatches;           /* 0: the plan chooses */
    double max_activation_bytes;        /* 0: no memory cap */
    double activation_bytes_per_token;  /* activation memory model: bytes per token */
} rp_limits;

/* How the trainer executes a step: what the cost model prices (docs/cost-model.md). */
typedef enum rp_sync {
    RP_SYNC_GROUP = 0,  /* EP groups meet per layer inside the group, across groups once a step */
    RP_SYNC_GLOBAL = 1  /* every (microbatch, layer) waits for the slowest GPU of the job */
} rp_sync;

typedef enum rp_overlap {
    RP_OVERLAP_NONE = 0,  /* compute and communication one after the other */
    RP_OVERLAP_LAYER = 1  /* per layer max(compute, communication) */
} rp_overlap;

/* How many copies of a token the expert dispatch sends. */
typedef enum rp_dispatch_dedup {
    RP_DEDUP_CHOICE = 0,  /* one per token-choice */
    RP_DEDUP_GPU = 1,     /* one per distinct destination GPU */
    RP_DEDUP_NODE = 2     /* one per destination node across nodes, fanned out over NVLink */
} rp_dispatch_dedup;

/* What runs the plan (routepack/executor.h: each one's profile). */
typedef enum rp_executor {
    RP_EXECUTOR_ROUTEPACK_TORCH = 0,   /* this project's routepack.torch MoELayer */
    RP_EXECUTOR_MEGATRON_ALLTOALL = 1, /* Megatron-Core's all-to-all token dispatcher, dropless */
    RP_EXECUTOR_DEEPEP = 2,            /* Megatron-Core's flex dispatcher over DeepEP/HybridEP */
    RP_EXECUTOR_MEGATRON_BALANCER = 3, /* Megatron-Core with its virtual-expert balancer (MoonEP) */
    RP_EXECUTOR_IDEAL = 4,             /* what the model priced before executor profiles: no
                                          trainer runs exactly this (docs/cost-model.md) */
    RP_EXECUTOR_MEGATRON_ROUTEPACK = 5 /* Megatron-Core's all-to-all dispatcher with RoutePack's
                                          layer (routepack.adapters.megatron_layer): replicas in
                                          spare slots and shares, no extra replicas */
} rp_executor;

/* How the gradients of an expert's replicas are summed (docs/cost-model.md). */
/* How the executor runs a GPU's experts (execution.expert_gemm). */
typedef enum rp_expert_gemm {
    RP_EXPERT_GEMM_GROUPED = 0, /* one grouped GEMM per projection over all local experts */
    RP_EXPERT_GEMM_LOOP = 1     /* one GEMM per expert (Megatron's SequentialMLP) */
} rp_expert_gemm;

typedef enum rp_grad_reduce {
    RP_GRAD_REDUCE_PAIRWISE = 0, /* every replica with the first: a two-party all-reduce each */
    RP_GRAD_REDUCE_GROUP = 1,    /* one all-reduce of [R, params] over the whole EP group, R the
                                    experts with more than one replica at the layer */
    RP_GRAD_REDUCE_HOLDERS = 2   /* every holder of an expert sends its gradient to every other
                                    holder (routepack.torch: one batched exchange among them) */
} rp_grad_reduce;

/* Where optimizer state lives (docs/cost-model.md, "Memory per GPU"). */
typedef enum rp_optimizer_sharding {
    RP_OPTIMIZER_SHARDING_NONE = 0, /* every GPU keeps the whole state of what it holds */
    RP_OPTIMIZER_SHARDING_DP = 1    /* Megatron's distributed optimizer: state sharded over the
                                       data-parallel replicas of each parameter (an expert slot's
                                       over the num_ep_groups GPUs that hold it, a dense
                                       parameter's over all GPUs) */
} rp_optimizer_sharding;
/* Per-forward expert balancing inside every EP group (routepack/virtual_experts.h). */
typedef enum rp_balancing {
    RP_BALANCING_NONE = 0,
    RP_BALANCING_VIRTUAL_EXPERTS = 1  /* Megatron-Core's virtual experts (MoonEP) */
} rp_balancing;

typedef struct rp_execution {
    rp_sync sync;
    rp_overlap overlap;
    rp_dispatch_dedup dispatch_dedup;
    int32_t dispatch_bytes_per_element;  /* 2 for BF16, 1 for FP8 dispatch */
    rp_optimizer_sharding optimizer_sharding;
    int64_t staging_budget_bytes;  /* migration staging per GPU; 0: no limit (one round) */
    /* what the trainer can run: the joint planner plans for it (docs/routepack-policy.md) */
    rp_balancing per_forward_balancing;
    /* Added after the first version (append only). */
    int32_t combine_bytes_per_element;   /* 2: DeepEP combines in BF16 even after an FP8 dispatch */
    /* What runs the plan (execution.executor) and what its profile sets, each overridable
     * by its own key (routepack/executor.h). */
    rp_executor executor;
    rp_grad_reduce replica_grad_reduce;
    int32_t replica_grad_bytes_per_element; /* bytes per parameter the replica reduction moves */
    double host_s_per_layer;              /* host syncs and launches of one (microbatch, layer)
                                             forward, beyond hardware.layer_fixed_us */
    uint32_t levers;                      /* RP_LEVER_* the executor runs */
    bool extras_stacked;                  /* rp_executor_profile.extras_stacked */
    bool extras_once;                     /* rp_executor_profile.extras_once */
    bool extras_ahead;                    /* rp_executor_profile.extras_ahead */
    rp_expert_gemm expert_gemm;           /* rp_executor_profile.grouped_gemm */
} rp_execution;

/* What the trainer demands of a packing (docs/config.md, "trainer"); every packer
 * (baselines, joint planner, local search) honours these and rp_plan_validate checks them. */
typedef struct rp_trainer {
    /* every DP rank runs the same number of sequences (verl's DataProto.chunk) */
    bool equal_sequences_per_rank;
    /* the microbatch count is a multiple of this, >= 1 (verl's
     * rearrange_micro_batches(num_batches_divided_by=...): the virtual pipeline stages) */
    int32_t microbatch_multiple;
    /* Added after the first version (append only). */
    /* every (rank, microbatch) runs at least one sequence (verl's micro-batch partitioning
     * asserts it) */
    bool nonempty_microbatches;
    /* the trainer can run Megatron-Core's per-forward expert balancer (virtual experts) on
     * a plan that asks for it; false: no plan may (rp_vexp_check_config refuses, naming the
     * key). Default: whether execution.executor runs it (megatron_balancer). */
    bool per_forward_balancer;
    /* the rollout batch is trained as this many mini-batches, one optimizer step each
     * (verl's ppo_mini_batch_size: the rank's chunk over it), >= 1: the plan's microbatches
     * are mini_batches runs of M / mini_batches consecutive ones, and M is a multiple of
     * mini_batches x microbatch_multiple */
    int32_t mini_batches;
    /* passes over the mini-batches per rollout batch (verl's ppo_epochs), >= 1 */
    int32_t epochs;
    /* forward-only passes over the rollout batch before training (RL: the old policy's and
     * the reference policy's log-probabilities), >= 0 */
    int32_t logprob_forwards;
} rp_trainer;

/* The policy to run and its parameters (checked by the policy engine, not here). */
typedef struct rp_policy_config {
    const char *name;          /* a policy name or a path; never NULL */
    const char *params_json;   /* the "params" object as JSON text; "{}" when absent */
    const char *const *search_path;  /* directories, NULL-terminated */
    /* Added after the first version (append only). */
    const char *initial_placement;   /* the placement in use before the first step:
                                        "contiguous" (default) or a plan file's path,
                                        made relative to the config's directory; never NULL */
} rp_policy_config;

typedef struct rp_config rp_config;

/* Read and validate a config file. Unknown keys, wrong types and out-of-range values
 * are errors whose text gives path:line:column and the JSON path of the value. */
RP_API rp_status rp_config_load(rp_context *ctx, const char *path, rp_config **out, rp_error *err);
/* Same from memory; `name` is used in messages (e.g. "<inline>"). */
RP_API rp_status rp_config_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                          rp_config **out, rp_error *err);
RP_API void rp_config_free(rp_config *cfg);

/* Borrowed views, valid until rp_config_free. */
RP_API const rp_topology *rp_config_topology(const rp_config *cfg);
RP_API const rp_hardware *rp_config_hardware(const rp_config *cfg);
RP_API const rp_model *rp_config_model(const rp_config *cfg);
RP_API const rp_limits *rp_config_limits(const rp_config *cfg);
RP_API const rp_execution *rp_config_execution(const rp_config *cfg);
RP_API const rp_trainer *rp_config_trainer(const rp_config *cfg);
RP_API const rp_policy_config *rp_config_policy(const rp_config *cfg);
/* The file the config came from ("<inline>" when parsed from memory). */
RP_API const char *rp_config_source(const rp_config *cfg);

#ifdef __cplusplus
}
#endif
#endif
