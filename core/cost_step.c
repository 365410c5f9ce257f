/* The whole training step beside the MoE layers (docs/cost-model.md, "The whole step"):
 * one forward pass of the plan's microbatches through the MoE layers (what each RL
 * log-probability pass costs), and what a step does outside them (LM head and loss, dense
 * layers, the optimizer step, data-parallel gradient reduction), the same for every plan
 * of a batch. */
#include "cost_internal.h"
#include "routepack/memory.h"

#include <math.h>
#include <string.h>

/* The forward halves of T(m, l) summed over the step, in the domain that sets the step
 * (the slowest EP group under group sync, the job under global), each layer's forward at
 * the configured overlap: what a forward-only pass of the same packing and placement costs.
 * A pipeline's forward passes are summed (no schedule). */
double cost_forward_s(const rp_cost *c, const cost_state *s)
{
    const int32_t M = s->M, L = c->L, Q = c->Q;
    double worst = 0.0;
    for (int32_t q = 0; q < (c->sync == RP_SYNC_GROUP ? Q : 1); q++) {
        double sum = 0.0;
        for (int32_t m = 0; m < M; m++)
            for (int32_t l = 0; l < L; l++) {
                const size_t ml = (size_t)m * L + l;
                double df = 0, x = 0, d = 0;
                for (int32_t g = (c->sync == RP_SYNC_GROUP ? q : 0); g < (c->sync == RP_SYNC_GROUP ? q + 1 : Q); g++) {
                    df = fmax(df, s->dfmax[(size_t)m * Q + g]);
                    x = fmax(x, s->xmax[ml * Q + g]);
                    d = fmax(d, s->dmax[ml * Q + g]);
                }
                const double compute = df + x, comm = 2.0 * d;
                sum += c->overlap == RP_OVERLAP_LAYER ? fmax(compute, comm) : compute + comm;
            }
        if (sum > worst) worst = sum;
    }
    return worst;
}

/* A ring all-reduce of `bytes` over n ranks: 2 (n - 1) / n of them over the link, in
 * 2 (n - 1) steps of one latency. */
static double ring_s(double bytes, int64_t n, double bw, double lat)
{
    return n > 1 ? 2.0 * (double)(n - 1) / (double)n * bytes / bw + 2.0 * (double)(n - 1) * lat : 0.0;
}

rp_status rp_cost_outside(const rp_cost *c, rp_step_outside *out, rp_error *err)
{
    if (!c || !out) return rp_fail(err, RP_EINVAL, "rp_cost_outside needs an evaluator and an output");
    const rp_config *cfg = c->cfg;
    const rp_model *md = rp_config_model(cfg);
    const rp_hardware *h = rp_config_hardware(cfg);
    const rp_topology *t = rp_config_topology(cfg);
    const rp_trainer *tr = rp_config_trainer(cfg);
    const rp_execution *x = rp_config_execution(cfg);
    memset(out, 0, sizeof *out);
    const double G = c->G, rank_gpus = (double)t->tensor_parallel_size * t->context_parallel_size;
    const double d = md->hidden_size, V = md->vocab_size, peak = h->peak_flops * h->dense_efficiency * rank_gpus;
    const double tokens = (double)rp_batch_num_tokens(c->batch) / G; /* one DP rank's, balanced */
    const double epochs = tr->epochs, steps = (double)tr->mini_batches * tr->epochs; /* optimizer steps */
    /* LM head: a d x V GEMM, its backward two more; the loss reads and writes FP32
     * logits, forward and backward: 3 passes of 4 bytes */
    const double head_f = 2.0 * tokens * d * V / peak + tokens * V * 4.0 / (h->hbm_bytes_per_s * rank_gpus);
    out->lm_head_s = epochs * 3.0 * head_f;
    /* dense layers: each runs the MoE layer's dense phase (attention, projections,
     * token-linear work and fixed cost, at their backward multipliers) and a SwiGLU MLP of
     * dense_ffn_size (6 d f FLOPs a token forward, twice that backward) */
    double dense_f = 0.0, dense_fb = 0.0;
    if (md->dense_layers > 0) {
        double attn = 0.0;
        for (int32_t s = 0; s < c->N; s++)
            attn += rp_cost_dense_s(c, c->cu_seqlens[s + 1] - c->cu_seqlens[s]);
        const double mlp = 6.0 * tokens * d * md->dense_ffn_size / peak;
        dense_fb = md->dense_layers * (attn / G + (1.0 + c->bwd.fixed) * c->fixed_s + 3.0 * mlp);
        /* the forward alone: the dense work at its share (1 of 1 + the projections'
         * backward multiplier) */
        dense_f = md->dense_layers * (attn / G / (1.0 + c->bwd.projections) + c->fixed_s + mlp);
    }
    out->dense_layers_s = epochs * dense_fb;
    /* the optimizer step (Adam) over what a GPU holds, per optimizer step: weights and
     * master weights, both moments read and written, the gradient read */
    rp_gpu_memory mem;
    if (rp_memory_peak(cfg, NULL, &mem, NULL) == RP_OK) {
        const double traffic = 2.0 * (mem.expert_weight_bytes + mem.dense_weight_bytes) + mem.expert_grad_bytes +
                               mem.dense_grad_bytes + 2.0 * (mem.expert_optimizer_bytes + mem.dense_optimizer_bytes);
        out->optimizer_s = steps * traffic / h->hbm_bytes_per_s;
    }
    /* data-parallel gradient reduction, per optimizer step, not overlapped with the
     * backward (an upper estimate: Megatron's --overlap-grad-reduce hides much of it):
     * the dense parameters' gradients over every DP rank, the experts' over the EP
     * groups (expert data parallelism), each a ring over the network when it spans nodes */
    const bool one_node = t->num_nodes <= 1;
    const double bw = one_node ? c->nv_bw : c->net_bw, lat = one_node ? c->nv_lat : c->net_lat;
    const double dense_grad = (double)md->dense_params * md->bytes_per_grad / t->tensor_parallel_size;
    double slots = 0;
    for (int32_t g = 0; g < c->ep; g++) slots += t->slots[g];
    const double expert_grad = slots / c->ep * c->L * 3.0 * d * md->expert_ffn_size * md->bytes_per_grad / rank_gpus;
    out->dp_grad_s = steps * (ring_s(dense_grad, c->G, bw, lat) + ring_s(expert_grad, c->Q, c->net_bw, c->net_lat));
    /* RL's forward-only passes outside the MoE layers (the MoE layers' part is the plan's
     * forward_s) */
    out->logprob_s = tr->logprob_forwards * (head_f + dense_f);
    out->total_s = out->lm_head_s + out->dense_layers_s + out->optimizer_s + out->dp_grad_s + out->logprob_s;
    (void)x;
    return RP_OK;
}
