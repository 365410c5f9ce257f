/* Executor profiles: what runs a plan (this project's routepack.torch layer, Megatron-Core's
 * all-to-all dispatcher, DeepEP/HybridEP, Megatron's virtual-expert balancer), and what the
 * cost model charges for it: dispatch de-duplication, combine dtype, the replica gradient
 * reduction (form, dtype), host and launch costs per layer, the cost of extra replicas, and
 * which levers it can run at all. docs/cost-model.md, "Executor profiles", cites a source
 * for every figure. The config key execution.executor picks a profile; the individual
 * execution keys override what it sets. Data only: no state, nothing to free. */
#ifndef ROUTEPACK_EXECUTOR_H
#define ROUTEPACK_EXECUTOR_H

#include "routepack/base.h"
#include "routepack/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The levers a plan may use; an executor runs a subset (rp_executor_profile.levers). */
#define RP_LEVER_REPLICAS 1u  /* an expert in more than one slot of an EP group */
#define RP_LEVER_SHARES 2u    /* per-microbatch token shares between an expert's replicas */
#define RP_LEVER_EXTRAS 4u    /* per-microbatch extra replicas */
#define RP_LEVER_BALANCER 8u  /* per-forward balancing (Megatron's virtual experts) */

/* Host costs the profiles count, forward, per (microbatch, layer) on one GPU (placeholders
 * of the right order; docs/cost-model.md): one blocking device-to-host synchronisation
 * (cudaStreamSynchronize on a copy, with the GPU pipeline drained), and one kernel
 * launched from Python (PyTorch's per-operator dispatch overhead). */
#define RP_HOST_SYNC_US 15.0
#define RP_HOST_LAUNCH_US 5.0

typedef struct rp_executor_profile {
    rp_executor executor;
    const char *name;                  /* the config's name: "routepack_torch", ... */
    rp_dispatch_dedup dispatch_dedup;  /* copies of a token the dispatch sends */
    int32_t combine_bytes_per_element; /* 0: model.bytes_per_param (the activations' dtype) */
    rp_grad_reduce grad_reduce;        /* how replica gradients are reduced */
    bool grad_in_grad_dtype;           /* in model.bytes_per_grad (else bytes_per_param) */
    int32_t host_syncs_per_layer;      /* blocking device-to-host syncs, forward */
    int32_t launches_per_local_expert; /* kernels launched per local expert, forward (a loop
                                          of GEMMs); 0 for a grouped GEMM */
    bool extras_stacked;               /* a GPU with extra replicas stacks all its local
                                          weights into one tensor every forward */
    bool extras_once;                  /* extra replicas fetched once a step (their gradients
                                          join the replica reduction), not per microbatch */
    uint32_t levers;                   /* RP_LEVER_* it can run */
    bool balancer_charges;             /* a plan with the per-forward balancer pays its padding,
                                          SM contention and FP32 gradient push (cost_vexp.c) */
    bool extras_ahead;                 /* with extras_once: the step's fetches start at the
                                          step's start on a stream of their own, each layer
                                          waiting for its own at its first forward */
    /* Added after the first version (append only). */
    bool grouped_gemm;                 /* a GPU's experts run as one grouped GEMM (else one GEMM
                                          per expert: the per-expert cost form) */
    int32_t group_align_rows;          /* rows the executor pads each expert's rows up to; the
                                          default of hardware.gemm_tile_rows */
} rp_executor_profile;

/* The profile of `executor`; NULL for a value outside the enum. Static storage. */
RP_API const rp_executor_profile *rp_executor_profile_of(rp_executor executor);
/* Its config name ("routepack_torch", ...); "?" for a value outside the enum. */
RP_API const char *rp_executor_name(rp_executor executor);
/* The words for a lever set ("replicas, shares, extra replicas"; "none"), into buf. */
RP_API void rp_executor_levers_text(uint32_t levers, char *buf, size_t size);

/* Megatron's virtual-expert balancer: what it charges beyond its weight pushes
 * (docs/cost-model.md, "Per-forward balancing"). The fraction of a GPU's SMs its pushes
 * take from concurrent expert GEMMs (Megatron's symmetric-memory copy kernels: up to 32 of
 * H100's 132 SMs). */
#define RP_BALANCER_PUSH_SM_FRACTION (32.0 / 132.0)

#ifdef __cplusplus
}
#endif
#endif
