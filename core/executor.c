/* Executor profiles (routepack/executor.h): one row per executor, each figure with its
 * source in docs/cost-model.md ("Executor profiles"). Data only. */
#include "routepack/executor.h"

#include <stdio.h>
#include <string.h>

static const rp_executor_profile profiles[] = {
    /* python/routepack/torch/moe.py (issue 29's layer): dispatch_dedup "gpu" by default,
     * one copy of a token per destination rank each way (combine in the activations'
     * dtype); replica gradients: every holder sends its summed copy to every other holder
     * in one batch_isend_irecv, in the gradient's dtype (.grad: the weights'); one
     * device-to-host read a layer forward; grouped GEMMs (slots, then extras;
     * routepack/torch/kernels.py's torch._grouped_mm, each expert's rows padded to
     * GROUP_ALIGN_ROWS = 16 on CUDA); the step's extras fetched once by set_placement into
     * buffers (no per-forward stack). */
    {RP_EXECUTOR_ROUTEPACK_TORCH, "routepack_torch", RP_DEDUP_GPU, 0, RP_GRAD_REDUCE_HOLDERS, false, 1, 0, false,
     true, RP_LEVER_REPLICAS | RP_LEVER_SHARES | RP_LEVER_EXTRAS, true, true, true, 16},
    /* megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher: the
     * dropless path permutes tokens x topk rows before its all-to-all; one sync point a
     * layer (cuda_sync_point); GroupedMLP / TEGroupedMLP (--moe-grouped-gemm; without it
     * SequentialMLP loops over the experts: execution.expert_gemm "loop"), unpadded in BF16;
     * experts held once per EP group
     * (num_local_experts = num_moe_experts / expert_model_parallel_size). */
    {RP_EXECUTOR_MEGATRON_ALLTOALL, "megatron_alltoall", RP_DEDUP_CHOICE, 0, RP_GRAD_REDUCE_PAIRWISE, true, 1, 0,
     false, false, 0, true, false, true, 1},
    /* DeepEP (and HybridEP) through Megatron's flex dispatcher: one copy per destination
     * GPU inside a node, one per node across nodes (RDMA, then NVLink), combine in BF16;
     * one host wait for the received counts; experts held once per EP group. */
    {RP_EXECUTOR_DEEPEP, "deepep", RP_DEDUP_NODE, 2, RP_GRAD_REDUCE_PAIRWISE, true, 1, 0, false, false, 0, true, false,
     true, 1},
    /* Megatron-Core --moe-virtual-expert-load-balance (MoonEP) over HybridEP: the balancer
     * makes its own replicas each forward; its costs are priced per forward (cost_vexp.c). */
    {RP_EXECUTOR_MEGATRON_BALANCER, "megatron_balancer", RP_DEDUP_GPU, 2, RP_GRAD_REDUCE_PAIRWISE, true, 1, 0, false,
     false, RP_LEVER_BALANCER, true, false, true, 1},
    /* Megatron-Core's all-to-all dispatcher (as megatron_alltoall) running RoutePack's layer,
     * routepack.adapters.megatron_layer: RoutePackMoELayer builds Megatron's experts over the
     * plan's slots (num_moe_experts = EP x slots_per_gpu) and sends each token-choice to the
     * slot the plan's remap gives it, so replicas in spare slots and per-microbatch shares
     * run; reduce_replica_grads sends each holder's FP32 main_grad to the expert's other
     * holders. Megatron's expert forms hold a fixed number of local experts: no extras. */
    {RP_EXECUTOR_MEGATRON_ROUTEPACK, "megatron_routepack", RP_DEDUP_CHOICE, 0, RP_GRAD_REDUCE_HOLDERS, true, 1, 0,
     false, false, RP_LEVER_REPLICAS | RP_LEVER_SHARES, true, false, true, 1},
    /* The model before executor profiles (issue 30): DeepEP-like de-duplication, BF16
     * combine, pairwise replica reductions in the weights' dtype, no host costs, extras
     * copied per microbatch, the balancer's pushes alone, experts priced one by one (the
     * per-expert efficiency sum): every lever. No trainer runs
     * exactly this; it keeps the figures derived under it comparable. */
    {RP_EXECUTOR_IDEAL, "ideal", RP_DEDUP_GPU, 2, RP_GRAD_REDUCE_PAIRWISE, false, 0, 0, false, false,
     RP_LEVER_REPLICAS | RP_LEVER_SHARES | RP_LEVER_EXTRAS | RP_LEVER_BALANCER, false, false, false, 1},
};

const rp_executor_profile *rp_executor_profile_of(rp_executor executor)
{
    for (size_t i = 0; i < sizeof profiles / sizeof profiles[0]; i++)
        if (profiles[i].executor == executor) return &profiles[i];
    return NULL;
}

const char *rp_executor_name(rp_executor executor)
{
    const rp_executor_profile *p = rp_executor_profile_of(executor);
    return p ? p->name : "?";
}

void rp_executor_levers_text(uint32_t levers, char *buf, size_t size)
{
    static const struct {
        uint32_t bit;
        const char *name;
    } names[] = {{RP_LEVER_REPLICAS, "replicas"},
                 {RP_LEVER_SHARES, "shares"},
                 {RP_LEVER_EXTRAS, "extra replicas"},
                 {RP_LEVER_BALANCER, "the per-forward balancer"}};
    if (!buf || size == 0) return;
    buf[0] = '\0';
    size_t used = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(levers & names[i].bit)) continue;
        int n = snprintf(buf + used, size - used, "%s%s", used ? ", " : "", names[i].name);
        if (n < 0 || (size_t)n >= size - used) return;
        used += (size_t)n;
    }
    if (!used) snprintf(buf, size, "none");
}
