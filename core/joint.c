/* The joint planner's flow: packing, the statistics pass, migration-aware placement, shares and
 * extra replicas, exact refinement, and the fallback to the better baseline
 * (docs/routepack-policy.md). */
#include "joint_internal.h"
#include "limits_internal.h"
#include "routepack/baseline.h"
#include "routepack/executor.h"
#include "routepack/virtual_experts.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *const default_fallbacks[] = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb",
                                                "attn_kk+eplb", NULL};

rp_joint_params rp_joint_defaults(void)
{
    return (rp_joint_params){.num_microbatches = 0, .pack = true, .place = true, .prompt_spread = 0.5,
                             .balance_evaluations = 0, .place_rounds = 4, .shares = true, .max_extra_per_rank = 1,
                             .horizon_steps = 10.0, .refine_evaluations = 0, .seed = 0, .fallbacks = NULL,
                             .persistence = 1.0, .virtual_experts = false, .relabel = true,
                             .recurring_migration_s = 0.0, .fallback_above_ratio = 0.0, .balancer_first = false};
}

static bool known_baseline(const char *name)
{
    for (const char *const *n = rp_baseline_names(); *n; n++)
        if (!strcmp(*n, name)) return true;
    return false;
}

/* Under per-forward balancing every plan runs with the balancer: each fallback keeps its
 * packing and takes the virtual_experts placement (once per packing, in order). */
enum { VEXP_PACKINGS = 5 };
static const char *const *with_virtual_experts(const char *const *names, const char *out[VEXP_PACKINGS + 1])
{
    static const char *const vexp_names[VEXP_PACKINGS][2] = {
        {"token_kk+", "token_kk+virtual_experts"}, {"verl_kk+", "verl_kk+virtual_experts"},
        {"attn_kk+", "attn_kk+virtual_experts"},   {"slime_ff+", "slime_ff+virtual_experts"},
        {"slime_kk+", "slime_kk+virtual_experts"}};
    int n = 0;
    for (const char *const *name = names; *name; name++)
        for (int k = 0; k < VEXP_PACKINGS; k++) {
            if (strncmp(*name, vexp_names[k][0], strlen(vexp_names[k][0])) != 0) continue;
            bool seen = false;
            for (int i = 0; i < n; i++) seen |= out[i] == vexp_names[k][1];
            if (!seen) out[n++] = vexp_names[k][1];
        }
    out[n] = NULL;
    return out;
}

static rp_status check_params(const rp_joint_params *p, rp_error *err)
{
    if (p->num_microbatches < 0)
        return rp_fail(err, RP_EINVAL, "joint: num_microbatches = %d, must be >= 0", p->num_microbatches);
    if (!(p->prompt_spread >= 0) || !isfinite(p->prompt_spread))
        return rp_fail(err, RP_EINVAL, "joint: prompt_spread = %g, must be a finite number >= 0", p->prompt_spread);
    if (p->balance_evaluations < 0)
        return rp_fail(err, RP_EINVAL, "joint: balance_evaluations = %lld, must be >= 0",
                       (long long)p->balance_evaluations);
    if (p->place_rounds < 0)
        return rp_fail(err, RP_EINVAL, "joint: place_rounds = %d, must be >= 0", p->place_rounds);
    if (p->max_extra_per_rank < 0 || p->max_extra_per_rank > 64)
        return rp_fail(err, RP_EINVAL, "joint: max_extra_per_rank = %d, must be in [0, 64]", p->max_extra_per_rank);
    if (!(p->horizon_steps > 0))
        return rp_fail(err, RP_EINVAL, "joint: horizon_steps = %g, must be > 0 (INFINITY: always re-place)",
                       p->horizon_steps);
    if (!(p->persistence >= 0 && p->persistence <= 1))
        return rp_fail(err, RP_EINVAL, "joint: persistence = %g, must be in [0, 1]", p->persistence);
    if (p->refine_max_operations < 0)
        return rp_fail(err, RP_EINVAL, "joint: refine_max_operations = %lld, must be >= 0 (0: no limit)",
                       (long long)p->refine_max_operations);
    if (p->refine_evaluations < 0)
        return rp_fail(err, RP_EINVAL, "joint: refine_evaluations = %lld, must be >= 0",
                       (long long)p->refine_evaluations);
    if (!(p->recurring_migration_s >= 0) || !isfinite(p->recurring_migration_s))
        return rp_fail(err, RP_EINVAL, "joint: recurring_migration_s = %g, must be a finite number >= 0",
                       p->recurring_migration_s);
    if (!(p->fallback_above_ratio >= 0) || !isfinite(p->fallback_above_ratio))
        return rp_fail(err, RP_EINVAL, "joint: fallback_above_ratio = %g, must be a finite number >= 0 (0: always check)",
                       p->fallback_above_ratio);
    if (p->fallbacks)
        for (const char *const *n = p->fallbacks; *n; n++)
            if (!known_baseline(*n))
                return rp_fail(err, RP_EINVAL, "joint: unknown fallback baseline '%s' (see rp_baseline_names)", *n);
    return RP_OK;
}

/* The surrogate's communication unit costs (d_choice, copy_s, nv_lat, grad_nv_s,
 * grad_net_s) from jt->cfg, jt->ep, jt->gpn and jt->K. */
void joint_comm_costs(joint *jt)
{
    const rp_topology *t = rp_config_topology(jt->cfg);
    const rp_model *md = rp_config_model(jt->cfg);
    const rp_hardware *hw = rp_config_hardware(jt->cfg);
    const rp_execution *x = rp_config_execution(jt->cfg);
    /* dispatch and combine at their mean element size, as the cost model prices them */
    const double token_bytes = (double)md->hidden_size * (x->dispatch_bytes_per_element + x->combine_bytes_per_element) / 2.0;
    const int32_t near = jt->ep < jt->gpn ? jt->ep : jt->gpn; /* GPUs of a group on one node */
    /* de-duplication for a token whose K choices spread evenly over the group: K / ep of
     * them per GPU, at most m = min(K, slots of a rank) each (docs/cost-model.md, dd) */
    double dedup = 1.0;
    if (x->dispatch_dedup != RP_DEDUP_CHOICE && jt->K > 1) {
        int32_t m = t->slots[0] < jt->K ? t->slots[0] : jt->K;
        double p = (double)jt->K / jt->ep / (m > 0 ? m : 1);
        dedup = p >= 1.0 ? (double)jt->ep / jt->K : -expm1(m * log1p(-p)) * jt->ep / jt->K;
    }
    /* A DP rank is TP x CP GPUs and its traffic runs over all their links, so every
     * transfer of the rank (dispatch, replica copies, gradient reduction) runs at TP x CP
     * times the per-GPU bandwidth, as the cost model prices it (rp_cost_new; docs/cost-model.md,
     * "TP and ETP" and "Context parallelism"). Latencies do not divide. */
    const double rank_gpus = (double)t->tensor_parallel_size * t->context_parallel_size;
    jt->d_choice = (1.0 + hw->backward.communication) * dedup * token_bytes *
                   ((double)(near - 1) / jt->ep / t->nvlink_bytes_per_s +
                    (double)(jt->ep - near) / jt->ep / t->net_bytes_per_s);
    jt->d_choice /= rank_gpus;
    const double expert_bytes = 3.0 * md->hidden_size * (double)md->expert_ffn_size * md->bytes_per_param;
    const double nv_bw = t->nvlink_bytes_per_s * rank_gpus, net_bw = t->net_bytes_per_s * rank_gpus;
    jt->copy_s = expert_bytes / nv_bw;
    jt->nv_lat = t->nvlink_latency_s;
    jt->copy_net_s = expert_bytes / net_bw;
    jt->net_lat = t->net_latency_s;
    jt->extras_once = x->extras_once;
    jt->grad_nv_s = expert_bytes / nv_bw + t->nvlink_latency_s;
    jt->grad_net_s = expert_bytes / net_bw + t->net_latency_s;
}

static rp_status setup(joint *jt, rp_error *err)
{
    const rp_topology *t = rp_config_topology(jt->cfg);
    const rp_model *md = rp_config_model(jt->cfg);
    const rp_hardware *hw = rp_config_hardware(jt->cfg);
    jt->N = rp_batch_num_seqs(jt->batch);
    jt->G = t->num_gpus;
    jt->ep = t->ep_size;
    jt->Q = t->num_gpus / t->ep_size;
    jt->gpn = t->gpus_per_node;
    jt->L = md->num_layers;
    jt->E = md->num_experts;
    jt->K = md->top_k;
    jt->speed = t->speed;
    jt->uniform_speed = true;
    jt->rank_speed_min = INFINITY;
    for (int32_t g = 0; g < jt->G; g++) {
        if (t->speed[g] != t->speed[0]) jt->uniform_speed = false;
        if (t->speed[g] < jt->rank_speed_min) jt->rank_speed_min = t->speed[g];
        if (t->speed[g] > jt->speed_max) jt->speed_max = t->speed[g];
    }
    jt->unit_speed = jt->uniform_speed && t->speed[0] == 1.0;
    jt->cap = rp_limits_token_cap(rp_config_limits(jt->cfg));
    const rp_execution *x = rp_config_execution(jt->cfg);
    joint_comm_costs(jt);
    jt->overlap = x->overlap == RP_OVERLAP_LAYER;
    jt->group_form = x->sync == RP_SYNC_GROUP && jt->Q > 1;
    const rp_executor_profile *pf = rp_executor_profile_of(x->executor);
    jt->vexp_pad = x->per_forward_balancing == RP_BALANCING_VIRTUAL_EXPERTS && pf && pf->balancer_charges;
    jt->fixed_s = (1.0 + hw->backward.fixed) * hw->layer_fixed_s;
    jt->x_mult = 1.0 + hw->backward.experts;
    jt->move_nv_s = rp_cost_expert_move_s(jt->cost, true);
    jt->move_net_s = rp_cost_expert_move_s(jt->cost, false);
    double last = hw->gemm_efficiency[hw->num_gemm_efficiency - 1].tokens;
    jt->t_table_n = last < 16384 ? (int32_t)ceil(last) : 16384;
    if (jt->t_table_n < 1) jt->t_table_n = 1;
    jt->t_slope = rp_cost_expert_s(jt->cost, 1e12) / 1e12;
    jt->t_mem = rp_cost_expert_s(jt->cost, 1e-9);
    jt->t_choice = jt->x_mult * jt->t_slope;

    int64_t S = 0;
    for (int32_t j = 0; j < jt->ep; j++) S += t->slots[j];
    if (S < jt->E)
        return rp_fail(err, RP_EINVAL, "joint: an EP group has %lld expert slots for %d experts; every expert needs one",
                       (long long)S, jt->E);
    if (S > INT32_MAX / 2) return rp_fail(err, RP_ERANGE, "joint: %lld slots per EP group is too many", (long long)S);
    jt->S = (int32_t)S;
    int32_t *sb = rp_alloc(jt->ctx, ((size_t)jt->ep + 1) * sizeof *sb);
    int32_t *nr = rp_alloc(jt->ctx, (size_t)jt->ep * sizeof *nr);
    jt->slot_rank = rp_alloc(jt->ctx, (size_t)jt->S * sizeof *jt->slot_rank);
    jt->t_table = rp_alloc(jt->ctx, ((size_t)jt->t_table_n + 1) * sizeof *jt->t_table);
    jt->seq_gpu = rp_alloc(jt->ctx, (size_t)jt->N * sizeof *jt->seq_gpu);
    jt->seq_mb = rp_alloc(jt->ctx, (size_t)jt->N * sizeof *jt->seq_mb);
    jt->slot_begin = sb;
    jt->node_of_rank = nr;
    if (!sb || !nr || !jt->slot_rank || !jt->t_table || !jt->seq_gpu || !jt->seq_mb)
        return rp_fail_nomem(err, "the joint planner");
    sb[0] = 0;
    for (int32_t j = 0; j < jt->ep; j++) {
        sb[j + 1] = sb[j] + t->slots[j];
        for (int32_t s = sb[j]; s < sb[j + 1]; s++) jt->slot_rank[s] = j;
        nr[j] = j / jt->gpn; /* as plan validation reads an EP rank's node */
    }
    for (int32_t i = 0; i <= jt->t_table_n; i++) jt->t_table[i] = rp_cost_expert_s(jt->cost, (double)i);
    return RP_OK;
}

static void teardown(joint *jt)
{
    rp_context *ctx = jt->ctx;
    if (jt->layers)
        for (int32_t l = 0; l < jt->L; l++) joint_layer_free(jt, &jt->layers[l]);
    rp_free(ctx, jt->layers);
    rp_free(ctx, (void *)jt->slot_begin);
    rp_free(ctx, (void *)jt->node_of_rank);
    rp_free(ctx, jt->slot_rank);
    rp_free(ctx, jt->t_table);
    rp_free(ctx, jt->seq_gpu);
    rp_free(ctx, jt->seq_mb);
    rp_free(ctx, jt->grp_hist);
    rp_free(ctx, jt->send_max);
    rp_free(ctx, jt->send_mq);
    rp_free(ctx, jt->dense_max);
    rp_free(ctx, jt->dense_mq);
}

/* Shape of `previous` against the config; false (with the reason) when it cannot be
 * the placement we start from. */
static rp_status check_previous(const joint *jt, const rp_plan *prev, rp_error *err)
{
    if (rp_plan_num_gpus(prev) != jt->G || rp_plan_ep_size(prev) != jt->ep || rp_plan_num_layers(prev) != jt->L ||
        rp_plan_num_experts(prev) != jt->E || rp_plan_total_slots(prev) != jt->S)
        return rp_fail(err, RP_EINVAL,
                       "joint: the previous plan is shaped for %d GPUs, EP %d, %d layers, %d experts, %d slots; the "
                       "config has %d, %d, %d, %d, %d", rp_plan_num_gpus(prev), rp_plan_ep_size(prev),
                       rp_plan_num_layers(prev), rp_plan_num_experts(prev), rp_plan_total_slots(prev), jt->G, jt->ep,
                       jt->L, jt->E, jt->S);
    const int32_t *sb = rp_plan_slot_begin(prev);
    for (int32_t j = 0; j <= jt->ep; j++)
        if (sb[j] != jt->slot_begin[j])
            return rp_fail(err, RP_EINVAL, "joint: the previous plan's EP rank %d starts at slot %d, the config's at %d",
                           j, sb[j], jt->slot_begin[j]);
    return RP_OK;
}

/* The packings tried under pipeline parallelism: a token budget of one (microbatch, EP
 * group), as a multiple of an even share (the batch's tokens over M x Q), and whether a
 * cell takes at most an even share of the sequences (N over G x M, rounded up); the first
 * is the surrogate's packing alone. On the DeepSeek-V3-like example the budget of one
 * share wins; where a few long sequences a rank set the levels, the even count. */
static const struct {
    double budget;
    bool even_count;
} pipeline_packings[] = {{0.0, false}, {1.0, false}, {1.5, false}, {0.0, true}};
/* The share of its step a limited packing must save over the surrogate's to replace it:
 * the screen prices every packing on one placement, not the one the plan will have. */
#define PIPELINE_MARGIN 0.01

int32_t rp_joint_packing_evaluations(const rp_config *cfg)
{
    if (!cfg || rp_config_topology(cfg)->pipeline_parallel_size == 1) return 0;
    return (int32_t)(sizeof pipeline_packings / sizeof *pipeline_packings);
}

/* Under pipeline parallelism the step is the schedule's critical path, not the sum over
 * microbatches that the packing's surrogate takes: a microbatch crosses every stage in
 * turn, so the heaviest one is paid about PP times, while the others run in its bubbles.
 * Filling under the levels the longest sequences set is then no longer free: it loads the
 * microbatch that sets the path with every sequence's expert work and dispatch (with few
 * sequences a rank the surrogate packs the whole batch into one microbatch, and the
 * pipeline runs none of it at once). So the packing is also made under the limits of
 * pipeline_packings (a cell beyond them takes nothing while another is open), and the
 * one with the shortest step wins, each priced exactly (rp_cost_evaluate, microbatches in
 * their best order) on the same placement: the one in use, else the contiguous one; a
 * limited packing must beat the surrogate's by PIPELINE_MARGIN. Keeps jt->seq_gpu and
 * jt->seq_mb of the winner (the earlier on a tie). */
static rp_status pack_pipeline(joint *jt, const rp_plan *previous_placed, int32_t M, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const size_t n = (size_t)jt->N;
    rp_plan *plan = NULL;
    int32_t *best = rp_alloc(ctx, 2 * n * sizeof *best);
    rp_status st = RP_OK;
    if (!best) return rp_fail_nomem(err, "joint: pipeline packings");
    RP_CHECK_GOTO(rp_plan_new(ctx, jt->cfg, M, &plan, err), st, out);
    if (previous_placed && rp_plan_balancing(previous_placed) == RP_BALANCING_NONE) {
        for (int32_t l = 0; l < jt->L; l++)
            RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, rp_plan_phy2log(previous_placed, l), err), st, out);
    } else {
        RP_CHECK_GOTO(rp_plan_set_contiguous(plan, err), st, out);
        if (rp_config_execution(jt->cfg)->per_forward_balancing == RP_BALANCING_VIRTUAL_EXPERTS)
            RP_CHECK_GOTO(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, err), st, out);
    }
    const double share = (double)rp_batch_num_tokens(jt->batch) / ((double)M * jt->Q);
    const int32_t cell_share = (int32_t)(((int64_t)jt->N + (int64_t)jt->G * M - 1) / ((int64_t)jt->G * M));
    double best_s = INFINITY;
    for (size_t i = 0; i < sizeof pipeline_packings / sizeof *pipeline_packings; i++) {
        const double budget = pipeline_packings[i].budget;
        jt->pack_budget = budget > 0 ? (int64_t)ceil(budget * share) : 0;
        jt->pack_cell_quota = pipeline_packings[i].even_count ? cell_share : 0;
        if (i > 0) {
            st = joint_pack(jt, M, err);
            if (st == RP_ERANGE) { /* this budget led the greedy where a sequence fits nowhere */
                st = RP_OK;
                continue;
            }
            if (st != RP_OK) goto out;
        }
        double step_s;
        RP_CHECK_GOTO(rp_plan_set_packing(plan, jt->N, jt->seq_gpu, jt->seq_mb, err), st, out);
        RP_CHECK_GOTO(rp_cost_evaluate(jt->cost, plan, NULL, err), st, out);
        RP_CHECK_GOTO(rp_cost_order_microbatches(jt->cost, plan, &step_s, err), st, out);
        if (i == 0) step_s *= 1.0 - PIPELINE_MARGIN;
        if (step_s < best_s) {
            best_s = step_s;
            memcpy(best, jt->seq_gpu, n * sizeof *best);
            memcpy(best + n, jt->seq_mb, n * sizeof *best);
        }
    }
    memcpy(jt->seq_gpu, best, n * sizeof *best);
    memcpy(jt->seq_mb, best + n, n * sizeof *best);
out:
    jt->pack_budget = 0;
    jt->pack_cell_quota = 0;
    rp_plan_free(plan);
    rp_free(ctx, best);
    return st;
}

/* Packing: ours, with as few microbatches as fit (or the fixed count), or token_kk's.
 * Under trainer.nonempty_microbatches both leave no (rank, microbatch) empty. Under
 * pipeline parallelism, the best of a few microbatch budgets (pack_pipeline). */
static rp_status pack_cells(joint *jt, const rp_plan *previous_placed, rp_error *err)
{
    int32_t fixed = jt->par->num_microbatches > 0 ? jt->par->num_microbatches
                                                   : rp_config_limits(jt->cfg)->num_microbatches;
    if (!jt->par->pack) {
        rp_plan *base = NULL;
        rp_status st = rp_baseline_plan(jt->ctx, jt->cfg, jt->batch, jt->stats, NULL, "token_kk+contiguous",
                                        fixed, &base, err);
        if (st != RP_OK) return st;
        jt->M = rp_plan_num_microbatches(base);
        for (int32_t s = 0; s < jt->N; s++) {
            jt->seq_gpu[s] = rp_plan_seq_rank(base, s);
            jt->seq_mb[s] = rp_plan_seq_microbatch(base, s);
        }
        rp_plan_free(base);
        return RP_OK;
    }
    const rp_trainer *tr = rp_config_trainer(jt->cfg);
    /* every mini-batch runs M / K microbatches, a multiple of microbatch_multiple */
    const int32_t K = tr->mini_batches, multiple = rp_limits_microbatch_step(jt->cfg);
    if (tr->equal_sequences_per_rank && jt->N % jt->G != 0)
        return rp_fail(err, RP_EINVAL,
                       "joint: the batch has %d sequences, which do not divide over the %d DP ranks; "
                       "trainer.equal_sequences_per_rank needs the same count on every rank (verl's "
                       "DataProto.chunk): give the step a multiple of %d sequences or turn the key off",
                       jt->N, jt->G, jt->G);
    if (tr->equal_sequences_per_rank && jt->N / jt->G % K != 0)
        return rp_fail(err, RP_EINVAL,
                       "joint: each of the %d DP ranks runs %d sequences, which do not divide into "
                       "trainer.mini_batches %d mini-batches; trainer.equal_sequences_per_rank needs the same count "
                       "in every mini-batch (verl splits each rank's chunk by count): give the step a multiple of %lld "
                       "sequences or turn the key off",
                       jt->G, jt->N / jt->G, K, (long long)jt->G * K);
    if (fixed > 0 && fixed % tr->microbatch_multiple != 0)
        return rp_fail(err, RP_EINVAL, "joint: %d microbatches is not a multiple of %d (trainer.microbatch_multiple)",
                       fixed, tr->microbatch_multiple);
    if (fixed > 0 && fixed % multiple != 0)
        return rp_fail(err, RP_EINVAL,
                       "joint: %d microbatches is not a multiple of %d (trainer.mini_batches %d x "
                       "trainer.microbatch_multiple %d)", fixed, multiple, K, tr->microbatch_multiple);
    int64_t M = fixed > 0 ? fixed : rp_limits_least_microbatches(jt->cfg, rp_batch_num_tokens(jt->batch));
    for (;; M += multiple) {
        if (fixed <= 0 && (M > INT32_MAX / jt->G - multiple || M > (int64_t)jt->N + multiple))
            return rp_fail(err, RP_ERANGE, "joint: the batch does not fit under the caps with up to %lld microbatches",
                           (long long)(M - 1));
        rp_status st = joint_pack(jt, (int32_t)M, err);
        if (st == RP_ERANGE && fixed <= 0) continue;
        if (st != RP_OK || rp_config_topology(jt->cfg)->pipeline_parallel_size == 1) return st;
        return pack_pipeline(jt, previous_placed, (int32_t)M, err);
    }
}

/* The busiest GPU's token-choices per microbatch (jt->send_max) and per (microbatch,
 * EP group) (jt->send_mq); and, where the surrogates need it (group form or overlap),
 * the slowest GPU's dense phase of one layer, per microbatch and per (microbatch, group). */
static rp_status send_maxima(joint *jt, rp_error *err)
{
    const int32_t G = jt->G, M = jt->M, Q = jt->Q, ep = jt->ep;
    const bool dense = jt->group_form || jt->overlap;
    int64_t *tok = rp_calloc(jt->ctx, (size_t)G * M, sizeof *tok);
    double *cell = dense ? rp_calloc(jt->ctx, (size_t)G * M, sizeof *cell) : NULL;
    if (!jt->send_max) jt->send_max = rp_alloc(jt->ctx, (size_t)M * sizeof *jt->send_max);
    if (!jt->send_mq) jt->send_mq = rp_alloc(jt->ctx, (size_t)M * Q * sizeof *jt->send_mq);
    if (dense && !jt->dense_max) jt->dense_max = rp_alloc(jt->ctx, (size_t)M * sizeof *jt->dense_max);
    if (dense && !jt->dense_mq) jt->dense_mq = rp_alloc(jt->ctx, (size_t)M * Q * sizeof *jt->dense_mq);
    if (!tok || !jt->send_max || !jt->send_mq || (dense && (!cell || !jt->dense_max || !jt->dense_mq))) {
        rp_free(jt->ctx, tok);
        rp_free(jt->ctx, cell);
        return rp_fail_nomem(err, "joint: send volumes");
    }
    for (int32_t s = 0; s < jt->N; s++) {
        const size_t c = (size_t)jt->seq_gpu[s] * M + jt->seq_mb[s];
        tok[c] += rp_batch_seq_len(jt->batch, s);
        if (cell) cell[c] += rp_cost_dense_s(jt->cost, rp_batch_seq_len(jt->batch, s));
    }
    for (int32_t m = 0; m < M; m++) {
        int64_t most = 0;
        double dmost = 0;
        for (int32_t q = 0; q < Q; q++) {
            int64_t gmost = 0;
            double gd = 0;
            for (int32_t g = q * ep; g < (q + 1) * ep; g++) {
                const size_t c = (size_t)g * M + m;
                gmost = tok[c] > gmost ? tok[c] : gmost;
                if (cell) {
                    double v = (cell[c] + jt->fixed_s) / jt->speed[g];
                    gd = v > gd ? v : gd;
                }
            }
            jt->send_mq[(size_t)m * Q + q] = (double)gmost * jt->K;
            if (cell) jt->dense_mq[(size_t)m * Q + q] = gd;
            most = gmost > most ? gmost : most;
            dmost = gd > dmost ? gd : dmost;
        }
        jt->send_max[m] = (double)most * jt->K;
        if (cell) jt->dense_max[m] = dmost;
    }
    rp_free(jt->ctx, tok);
    rp_free(jt->ctx, cell);
    return RP_OK;
}

static bool same_sets(const joint *jt, const joint_layer *a, const joint_layer *b)
{
    for (int32_t e = 0; e < jt->E; e++) {
        if (a->rep_off[e + 1] - a->rep_off[e] != b->rep_off[e + 1] - b->rep_off[e]) return false;
        for (int32_t i = 0; i < a->rep_off[e + 1] - a->rep_off[e]; i++)
            if (a->rep_rank[a->rep_off[e] + i] != b->rep_rank[b->rep_off[e] + i]) return false;
    }
    return true;
}

/* The persistent part of a layer's surrogate: the same value computed from the expert
 * loads expected over the coming steps (params.expected_loads, else this step's
 * aggregate loads), each (microbatch, group) taking its share of them by tokens. What a
 * placement gains here it keeps over the coming steps; what it gains beyond this fits
 * this batch's own spikes and lasts one step. */
static double persistent_score(const joint *jt, int32_t l, const joint_layer *lay, const double *share_max,
                               const double *share_mq, double *rank_load)
{
    const int64_t *load = rp_stats_expert_load(jt->stats, l);
    const double *expected = jt->par->expected_loads ? jt->par->expected_loads + (size_t)l * jt->E : NULL;
    /* expected loads are scaled to this step's token-choices of the layer */
    double scale = 1.0;
    if (expected) {
        double now = 0, then = 0;
        for (int32_t e = 0; e < jt->E; e++) {
            now += (double)load[e];
            then += expected[e];
        }
        scale = then > 0 ? now / then : 0.0;
    }
    for (int32_t j = 0; j < jt->ep; j++) rank_load[j] = 0;
    for (int32_t e = 0; e < jt->E; e++) {
        int32_t a = lay->rep_off[e], b = lay->rep_off[e + 1];
        double w = expected ? expected[e] * scale : (double)load[e];
        for (int32_t i = a; i < b; i++) rank_load[lay->rep_rank[i]] += w / (b - a);
    }
    double most = 0;
    for (int32_t j = 0; j < jt->ep; j++) {
        double slowest = INFINITY;
        for (int32_t q = 0; q < jt->Q; q++) slowest = jt->speed[q * jt->ep + j] < slowest ? jt->speed[q * jt->ep + j] : slowest;
        most = rank_load[j] / slowest > most ? rank_load[j] / slowest : most;
    }
    double sum = 0;
    if (jt->group_form) /* the slowest group's own sum */
        for (int32_t q = 0; q < jt->Q; q++) {
            double group = 0;
            for (int32_t m = 0; m < jt->M; m++) group += joint_mq_value(jt, m, q, most * share_mq[(size_t)m * jt->Q + q]);
            sum = group > sum ? group : sum;
        }
    else
        for (int32_t m = 0; m < jt->M; m++) sum += joint_mb_value(jt, m, most * share_max[m]);
    return sum + joint_layer_grad_s(jt, lay, rank_load);
}

/* Placement of every layer: a fresh one, and (with a previous plan) the previous one
 * improved only by the moves that pay back their copy within this step. A layer is
 * re-placed when this step's saving plus the persistent saving over the other
 * horizon - 1 steps exceeds the time to migrate it (horizon INFINITY: always). */
static rp_status place(joint *jt, const joint_layer *prev, rp_joint_report *rep, rp_error *err)
{
    rp_context *ctx = jt->ctx;
    const double H = jt->par->horizon_steps;
    rp_status st = RP_OK;
    double *scratch = rp_alloc(ctx, joint_place_scratch_doubles(jt) * sizeof *scratch);
    double *share_max = rp_calloc(ctx, (size_t)jt->M, sizeof *share_max);
    double *share_mq = rp_calloc(ctx, (size_t)jt->M * jt->Q, sizeof *share_mq);
    int64_t *group_tok = rp_calloc(ctx, (size_t)jt->M * jt->Q, sizeof *group_tok);
    int32_t *relabel_scratch = rp_alloc(ctx, joint_relabel_scratch_ints(jt) * sizeof *relabel_scratch);
    joint_layer kept;
    memset(&kept, 0, sizeof kept);
    if (!scratch || !share_max || !share_mq || !group_tok || !relabel_scratch) {
        st = rp_fail_nomem(err, "joint: placement scratch");
        goto out;
    }
    /* each microbatch's largest group share of the step's tokens */
    const int64_t tokens = rp_batch_num_tokens(jt->batch);
    for (int32_t s = 0; s < jt->N; s++)
        group_tok[(size_t)jt->seq_mb[s] * jt->Q + jt->seq_gpu[s] / jt->ep] += rp_batch_seq_len(jt->batch, s);
    for (int32_t m = 0; m < jt->M; m++)
        for (int32_t q = 0; q < jt->Q; q++) {
            double sh = tokens > 0 ? (double)group_tok[(size_t)m * jt->Q + q] / (double)tokens : 0.0;
            share_mq[(size_t)m * jt->Q + q] = sh;
            share_max[m] = sh > share_max[m] ? sh : share_max[m];
        }
    if (prev) RP_CHECK_GOTO(joint_layer_alloc(jt, &kept, err), st, out);
    for (int32_t l = 0; l < jt->L; l++) {
        joint_layer *lay = &jt->layers[l];
        RP_CHECK_GOTO(joint_place_fresh(jt, l, lay, err), st, out);
        double x_fresh = 0, x_kept = 0, x_old = 0;
        RP_CHECK_GOTO(joint_place_improve(jt, l, lay, NULL, 0.0, jt->par->place_rounds, scratch, NULL,
                                          prev ? &x_fresh : NULL, err), st, out);
        if (!prev) {
            rep->layers_replaced++;
            continue;
        }
        const joint_layer *old = &prev[l];
        /* relabelling permutes interchangeable ranks (same node, slots and speed in every
         * group): each rank's load is the same sum over the same experts, so x_fresh holds */
        if (jt->par->relabel) joint_relabel(jt, lay, old, relabel_scratch);
        memcpy(kept.phy2log, old->phy2log, (size_t)jt->S * sizeof *kept.phy2log);
        joint_layer_index(jt, &kept);
        /* moves that pay within this step; a copy comes over the network when the EP
         * group spans nodes (conservative). The search starts from old's layout, so its
         * first score is old's. */
        double penalty = isinf(H) ? 0.0 : (jt->ep > jt->gpn ? jt->move_net_s : jt->move_nv_s);
        RP_CHECK_GOTO(joint_place_improve(jt, l, &kept, old, penalty, jt->par->place_rounds, scratch, &x_old,
                                          &x_kept, err), st, out);
        /* each placement's expert and gradient parts, kept apart for the report below */
        double g_fresh = joint_layer_grad_s(jt, lay, scratch);
        double g_kept = joint_layer_grad_s(jt, &kept, scratch);
        double s_old = x_old + joint_layer_grad_s(jt, old, scratch);
        double s_fresh = x_fresh + g_fresh, s_kept = x_kept + g_kept;
        bool fresh = true;
        if (!isinf(H) && !jt->previous_balanced) {
            double p_fresh = persistent_score(jt, l, lay, share_max, share_mq, scratch);
            double p_kept = persistent_score(jt, l, &kept, share_max, share_mq, scratch);
            /* the persistent part counts only as far as earlier moves' savings held */
            double saving = (s_kept - s_fresh) + (H - 1) * jt->par->persistence * (p_kept - p_fresh);
            double move_fresh = 0, move_kept = 0;
            RP_CHECK_GOTO(joint_layer_migration_s(jt, l, old, lay, &move_fresh, err), st, out);
            RP_CHECK_GOTO(joint_layer_migration_s(jt, l, old, &kept, &move_kept, err), st, out);
            fresh = saving > move_fresh - move_kept;
        }
        if (!fresh) {
            memcpy(lay->phy2log, kept.phy2log, (size_t)jt->S * sizeof *lay->phy2log);
            joint_layer_index(jt, lay);
        }
        if (!same_sets(jt, lay, old)) rep->layers_replaced++;
        /* lay is the fresh placement or a copy of the kept one: its parts are known */
        rep->surrogate_saving_s += s_old - (fresh ? x_fresh : x_kept) - (fresh ? g_fresh : g_kept);
    }
out:
    joint_layer_free(jt, &kept);
    rp_free(ctx, scratch);
    rp_free(ctx, share_max);
    rp_free(ctx, share_mq);
    rp_free(ctx, group_tok);
    rp_free(ctx, relabel_scratch);
    return st;
}

/* Layers whose slots differ between two plans' placements (a NULL `before`: all). */
static int32_t layers_changed(const joint *jt, const rp_plan *before, const rp_plan *after)
{
    if (!before) return jt->L;
    int32_t n = 0;
    for (int32_t l = 0; l < jt->L; l++)
        n += memcmp(rp_plan_phy2log(before, l), rp_plan_phy2log(after, l), (size_t)jt->S * sizeof(int32_t)) != 0;
    return n;
}

/* One candidate's score under the cost model: step time, plus the migration from the
 * previous plan spread over the horizon. */
typedef struct scored {
    double step_s, lower_bound_s, ratio, migration_s, migration_bytes, total;
} scored;

static rp_status score_plan(const joint *jt, const rp_plan *plan, const rp_plan *previous, scored *out,
                            rp_error *err)
{
    rp_cost_summary sum;
    rp_status st = rp_cost_evaluate(jt->cost, plan, &sum, err);
    if (st != RP_OK) return st;
    out->step_s = sum.step_s;
    out->lower_bound_s = sum.lower_bound_s;
    out->ratio = sum.ratio;
    out->migration_s = out->migration_bytes = 0;
    if (previous && rp_plan_has_placement(previous)) {
        st = rp_cost_migration(jt->cost, previous, plan, &out->migration_s, &out->migration_bytes, err);
        if (st != RP_OK) return st;
    }
    double H = jt->par->horizon_steps;
    out->total = out->step_s + (isinf(H) ? 0.0 : out->migration_s / H);
    return RP_OK;
}

/* The joint candidate's score (`mine`) and the virtual-expert one's (`vs`, when `vx`).
 * The one likelier to be returned is scored last: the one of the kind the step before
 * returned (the balancer's plan when the placement in use ran under it). The evaluator
 * then stays bound to it, and the engine's evaluation of the returned plan (the same
 * evaluator, through rp.joint) finds it already evaluated (rp_cost_evaluate returns the
 * bound state's summary for an equal plan), unless fallbacks are scored after it. Both
 * candidates share the packing, so the second reuses the first's per-microbatch counts.
 * The order changes no score (each is a full evaluation). */
static rp_status score_joint(const joint *jt, const rp_plan *plan, const rp_plan *vx, bool vx_scored,
                             const rp_plan *previous, scored *mine, scored *vs, rp_error *err)
{
    if (vx_scored) vx = NULL; /* balancer_first scored it already */
    const bool vx_last = vx && previous && rp_plan_balancing(previous) == RP_BALANCING_VIRTUAL_EXPERTS;
    rp_status st = RP_OK;
    if (vx && !vx_last) st = score_plan(jt, vx, previous, vs, err);
    if (st == RP_OK) st = score_plan(jt, plan, previous, mine, err);
    if (st == RP_OK && vx_last) st = score_plan(jt, vx, previous, vs, err);
    if (st != RP_OK) return st;
    /* the joint placement's re-fits recur on every later step of the horizon */
    const rp_joint_params *par = jt->par;
    if (!isinf(par->horizon_steps) && par->recurring_migration_s > 0)
        mine->total += (par->horizon_steps - 1) * par->recurring_migration_s / par->horizon_steps;
    return RP_OK;
}

/* The candidate that runs with the per-forward balancer (rp_joint_params.virtual_experts):
 * the joint packing on the balancer's placement, and where the executor charges the
 * balancer's equal-token padding (a profile with balancer_charges) also a packing made
 * for it (jt->vexp_pad: the expert work priced by each group's fullest cell), the one
 * with the lower step + migration over the horizon (the first on a tie), and then the
 * better of that and the same plan on an ownership planned for the balancer's pushes
 * (joint_vexp_own.c). Leaves jt's own packing as it found it. */
static rp_status vexp_candidate(joint *jt, const rp_plan *previous_placed, rp_plan **out, rp_error *err)
{
    rp_plan *own = NULL, *padded = NULL;
    rp_status first = joint_vexp_candidate(jt, previous_placed, &own, err);
    if (first != RP_OK) return first;
    const rp_executor_profile *pf = rp_executor_profile_of(rp_config_execution(jt->cfg)->executor);
    if (jt->vexp_pad || !jt->par->pack || !pf || !pf->balancer_charges) {
        *out = own;
        return RP_OK;
    }
    rp_context *ctx = jt->ctx;
    const size_t n = (size_t)jt->N;
    const int32_t M = jt->M;
    int32_t *keep = rp_alloc(ctx, 2 * n * sizeof *keep);
    rp_status st = RP_OK;
    scored own_s = {0};
    bool scored_own = false;
    if (!keep) {
        st = rp_fail_nomem(err, "joint: the balancer's packing");
        goto out;
    }
    memcpy(keep, jt->seq_gpu, n * sizeof *keep);
    memcpy(keep + n, jt->seq_mb, n * sizeof *keep);
    jt->vexp_pad = true;
    st = pack_cells(jt, previous_placed, err);
    jt->vexp_pad = false;
    if (st == RP_OK && (jt->M != M || memcmp(keep, jt->seq_gpu, n * sizeof *keep) != 0 ||
                        memcmp(keep + n, jt->seq_mb, n * sizeof *keep) != 0)) {
        st = joint_vexp_candidate(jt, previous_placed, &padded, err);
        scored b;
        if (st == RP_OK) st = score_plan(jt, own, previous_placed, &own_s, err);
        if (st == RP_OK) st = score_plan(jt, padded, previous_placed, &b, err);
        scored_own = st == RP_OK;
        if (st == RP_OK && b.total < own_s.total) {
            rp_plan *t = own;
            own = padded;
            padded = t;
            own_s = b;
        }
    }
    memcpy(jt->seq_gpu, keep, n * sizeof *keep);
    memcpy(jt->seq_mb, keep + n, n * sizeof *keep);
    jt->M = M;
    /* the better of those on an ownership planned for the balancer's pushes */
    rp_plan_free(padded);
    padded = NULL;
    if (st == RP_OK) st = joint_vexp_owned(jt, own, previous_placed, &padded, err);
    if (st == RP_OK && padded) {
        scored b;
        if (!scored_own) st = score_plan(jt, own, previous_placed, &own_s, err);
        if (st == RP_OK) st = score_plan(jt, padded, previous_placed, &b, err);
        if (st == RP_OK && b.total < own_s.total) {
            rp_plan *t = own;
            own = padded;
            padded = t;
        }
    }
out:
    rp_free(ctx, keep);
    rp_plan_free(padded);
    if (st != RP_OK) {
        rp_plan_free(own);
        return st;
    }
    *out = own;
    return RP_OK;
}

/* The report of balancer_first's candidate returned alone (`vx`, scored `vs`): no joint
 * placement was built, so no joint figures. */
static void report_balancer_alone(const joint *jt, const rp_plan *previous, const rp_plan *vx, const scored *vs,
                                  rp_joint_report *rep)
{
    rep->evaluated = true;
    rep->per_forward_balancing = true;
    rep->joint_built = false;
    rep->virtual_experts_step_s = rep->step_s = vs->step_s;
    rep->lower_bound_s = vs->lower_bound_s;
    rep->ratio = vs->ratio;
    rep->migration_s = vs->migration_s;
    rep->migration_bytes = vs->migration_bytes;
    rep->layers_replaced = layers_changed(jt, previous, vx);
}

rp_status rp_joint_plan(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, const rp_stats *stats,
                        const rp_plan *previous, rp_cost *cost, const rp_joint_params *params, rp_plan **out,
                        rp_joint_report *report, rp_error *err)
{
    if (!ctx || !cfg || !batch || !stats || !out)
        return rp_fail(err, RP_EINVAL, "joint: context, config, batch, statistics and output are required");
    const rp_model *md = rp_config_model(cfg);
    if (rp_batch_num_seqs(batch) < 1) return rp_fail(err, RP_EINVAL, "joint: the batch is empty (no sequences to plan)");
    if (rp_stats_num_seqs(stats) != rp_batch_num_seqs(batch) || rp_stats_num_layers(stats) != md->num_layers ||
        rp_stats_num_experts(stats) != md->num_experts)
        return rp_fail(err, RP_EINVAL,
                       "joint: the statistics cover %d sequences, %d layers and %d experts, but the batch has %d "
                       "sequences and the model %d layers and %d experts",
                       rp_stats_num_seqs(stats), rp_stats_num_layers(stats), rp_stats_num_experts(stats),
                       rp_batch_num_seqs(batch), md->num_layers, md->num_experts);
    rp_joint_params defaults = rp_joint_defaults();
    rp_joint_params runnable = params ? *params : defaults;
    /* only the levers the executor runs (execution.executor): never a plan it cannot */
    const uint32_t levers = rp_config_execution(cfg)->levers;
    if (!(levers & RP_LEVER_SHARES)) runnable.shares = false;
    if (!(levers & RP_LEVER_EXTRAS)) runnable.max_extra_per_rank = 0;
    const rp_joint_params *par = &runnable;
    rp_status st = check_params(par, err);
    if (st == RP_OK && par->expected_loads)
        for (int64_t i = 0; i < (int64_t)md->num_layers * md->num_experts; i++)
            if (!(par->expected_loads[i] >= 0) || !isfinite(par->expected_loads[i])) {
                st = rp_fail(err, RP_EINVAL, "joint: expected_loads[%lld] (layer %lld, expert %lld) = %g, must be a finite number >= 0",
                             (long long)i, (long long)(i / md->num_experts), (long long)(i % md->num_experts),
                             par->expected_loads[i]);
                break;
            }
    if (st != RP_OK) return st;

    joint jt;
    memset(&jt, 0, sizeof jt);
    jt.ctx = ctx;
    jt.cfg = cfg;
    jt.batch = batch;
    jt.stats = stats;
    jt.par = par;
    rp_cost *own_cost = NULL;
    rp_plan *plan = NULL, *cand = NULL, *best_fb = NULL, *vx = NULL;
    joint_layer *prev = NULL;
    rp_joint_report rep;
    memset(&rep, 0, sizeof rep);
    snprintf(rep.chosen, sizeof rep.chosen, "joint");
    rep.joint_built = true;
    rep.step_s = rep.lower_bound_s = rep.ratio = rep.joint_step_s = rep.joint_ratio = NAN;
    rep.best_fallback_step_s = rep.virtual_experts_step_s = NAN;
    if (!cost) {
        RP_CHECK_GOTO(rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &own_cost, err), st, out);
        cost = own_cost;
    }
    jt.cost = cost;
    RP_CHECK_GOTO(setup(&jt, err), st, out);
    const rp_plan *previous_placed = previous && rp_plan_has_placement(previous) ? previous : NULL;
    jt.previous_balanced = previous_placed && rp_plan_balancing(previous_placed) == RP_BALANCING_VIRTUAL_EXPERTS;
    if (previous_placed) {
        RP_CHECK_GOTO(check_previous(&jt, previous_placed, err), st, out);
        prev = rp_calloc(ctx, (size_t)jt.L, sizeof *prev);
        if (!prev) {
            st = rp_fail_nomem(err, "joint: the previous placement");
            goto out;
        }
        for (int32_t l = 0; l < jt.L; l++) {
            RP_CHECK_GOTO(joint_layer_alloc(&jt, &prev[l], err), st, out);
            RP_CHECK_GOTO(joint_layer_copy_from_plan(&jt, previous_placed, l, &prev[l], err), st, out);
        }
    }

    RP_CHECK_GOTO(rp_limits_check_batch(rp_config_limits(cfg), batch, err), st, out);

    /* packing */
    RP_CHECK_GOTO(pack_cells(&jt, previous_placed, err), st, out);
    rep.num_microbatches = jt.M;
    RP_CHECK_GOTO(rp_plan_new(ctx, cfg, jt.M, &plan, err), st, out);
    RP_CHECK_GOTO(rp_plan_set_packing(plan, jt.N, jt.seq_gpu, jt.seq_mb, err), st, out);

    /* The trainer balances every forward's expert side itself (Megatron's virtual
     * experts): plan for it rather than duplicate it. No replicas, shares or extra
     * replicas: the balancer makes its own each forward; the placement is the contiguous,
     * evenly owned one it requires; the packing keeps balancing attention and each
     * group's tokens, which the balancer cannot move. */
    const bool vexp = rp_config_execution(cfg)->per_forward_balancing == RP_BALANCING_VIRTUAL_EXPERTS;
    rep.per_forward_balancing = vexp;
    const char *const *fallbacks = par->fallbacks ? par->fallbacks : default_fallbacks;
    const char *vexp_fallbacks[VEXP_PACKINGS + 1] = {NULL};
    if (vexp) fallbacks = with_virtual_experts(fallbacks, vexp_fallbacks);
    const bool vx_applies = par->virtual_experts && !vexp && par->place && rp_vexp_check_config(cfg, NULL) == RP_OK;
    /* balancer_first: the virtual-expert candidate alone, unless the gate opens */
    const bool gate_set = *fallbacks && par->fallback_above_ratio > 0;
    bool vx_scored = false, force_check = false;
    scored vs_first = {0};
    if (vx_applies && par->balancer_first && gate_set && par->refine_evaluations == 0 &&
        par->balance_evaluations == 0) {
        RP_CHECK_GOTO(vexp_candidate(&jt, previous_placed, &vx, err), st, out);
        RP_CHECK_GOTO(score_plan(&jt, vx, previous_placed, &vs_first, err), st, out);
        vx_scored = true;
        if (vs_first.ratio <= par->fallback_above_ratio) { /* it stands as it is */
            report_balancer_alone(&jt, previous_placed, vx, &vs_first, &rep);
            *out = vx;
            vx = NULL;
            if (report) *report = rep;
            goto out;
        }
        force_check = true; /* the gate opened: the full comparison, with the fallbacks */
    }
    if (vexp) {
        RP_CHECK_GOTO(rp_plan_set_contiguous(plan, err), st, out);
        RP_CHECK_GOTO(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, err), st, out);
        if (previous_placed) RP_CHECK_GOTO(rp_plan_stabilize_slots(plan, previous_placed, err), st, out);
    } else if (par->place) {
        jt.layers = rp_calloc(ctx, (size_t)jt.L, sizeof *jt.layers);
        if (!jt.layers) {
            st = rp_fail_nomem(err, "joint: placement");
            goto out;
        }
        for (int32_t l = 0; l < jt.L; l++) RP_CHECK_GOTO(joint_layer_alloc(&jt, &jt.layers[l], err), st, out);
        /* Everything that looks at per-microbatch expert loads needs the one pass over the
         * histograms; without it the placement comes from the step's loads alone. */
        const bool balancing = par->pack && par->balance_evaluations > 0;
        const bool pass = balancing || prev || par->place_rounds > 0 || par->shares || par->max_extra_per_rank > 0;
        if (balancing && !prev) {
            /* mix against the placement the step will most likely use */
            for (int32_t l = 0; l < jt.L; l++) RP_CHECK_GOTO(joint_place_fresh(&jt, l, &jt.layers[l], err), st, out);
        }
        if (pass) RP_CHECK_GOTO(joint_group_hist(&jt, err), st, out);
        RP_CHECK_GOTO(send_maxima(&jt, err), st, out);
        if (balancing) {
            int64_t used = 0;
            RP_CHECK_GOTO(joint_balance(&jt, prev ? prev : jt.layers, par->balance_evaluations, &used, err), st, out);
            RP_CHECK_GOTO(rp_plan_set_packing(plan, jt.N, jt.seq_gpu, jt.seq_mb, err), st, out);
        }
        if (balancing) RP_CHECK_GOTO(send_maxima(&jt, err), st, out);
        RP_CHECK_GOTO(place(&jt, prev, &rep, err), st, out);
        for (int32_t l = 0; l < jt.L; l++) RP_CHECK_GOTO(rp_plan_set_phy2log(plan, l, jt.layers[l].phy2log, err), st, out);
        if (previous_placed) RP_CHECK_GOTO(rp_plan_stabilize_slots(plan, previous_placed, err), st, out);
        if (par->shares || par->max_extra_per_rank > 0)
            RP_CHECK_GOTO(joint_levers(&jt, plan, &rep.share_sets, &rep.extra_replicas, err), st, out);
    } else {
        /* EPLB's placement (it does not depend on the packing) */
        rp_plan *eplb = NULL;
        RP_CHECK_GOTO(rp_baseline_plan(ctx, cfg, batch, stats, previous_placed, "token_kk+eplb", 0, &eplb, err), st, out);
        for (int32_t l = 0; l < jt.L && st == RP_OK; l++) st = rp_plan_set_phy2log(plan, l, rp_plan_phy2log(eplb, l), err);
        rp_plan_free(eplb);
        if (st != RP_OK) goto out;
        rep.layers_replaced = jt.L;
    }
    /* Built to be valid; a violation here is a planner bug, reported as such. */
    RP_CHECK_GOTO(rp_plan_validate(plan, cfg, batch, err), st, out);

    if (par->refine_evaluations > 0) {
        rp_search_params sp = rp_search_defaults();
        sp.max_evaluations = par->refine_evaluations;
        sp.max_operations = par->refine_max_operations;
        sp.seed = par->seed;
        rp_search_result sr;
        RP_CHECK_GOTO(rp_search_local(cost, plan, &sp, &sr, err), st, out);
        rep.refine_evaluations = sr.evaluations;
        rep.refine_operations = sr.operations;
        rep.refine_stopped = sr.stopped;
    }
    /* Under pipeline parallelism the microbatch order is part of the plan: the one with
     * the shortest critical path for this packing and placement (docs/cost-model.md) */
    if (rp_config_topology(cfg)->pipeline_parallel_size > 1) {
        RP_CHECK_GOTO(rp_cost_evaluate(cost, plan, NULL, err), st, out);
        RP_CHECK_GOTO(rp_cost_order_microbatches(cost, plan, NULL, err), st, out);
    }

    if (vx_applies && !vx) RP_CHECK_GOTO(vexp_candidate(&jt, previous_placed, &vx, err), st, out);
    if (*fallbacks || par->refine_evaluations > 0 || vx) {
        scored mine = {0}, best = {0}, s, vs = vs_first;
        const char *best_name = NULL;
        /* Under the gate the joint candidate is scored first: its ratio decides whether
         * the fallbacks are checked (a NaN ratio checks). Otherwise it is scored last. */
        const bool gated = gate_set && !force_check;
        if (gated) RP_CHECK_GOTO(score_joint(&jt, plan, vx, vx_scored, previous_placed, &mine, &vs, err), st, out);
        rep.fallbacks_checked = *fallbacks && !(gated && mine.ratio <= par->fallback_above_ratio);
        for (const char *const *n = fallbacks; rep.fallbacks_checked && *n; n++) {
            RP_CHECK_GOTO(rp_baseline_plan(ctx, cfg, batch, stats, previous_placed, *n, 0, &cand, err), st, out);
            RP_CHECK_GOTO(score_plan(&jt, cand, previous_placed, &s, err), st, out);
            if (!best_name || s.total < best.total) {
                best = s;
                best_name = *n;
                rp_plan_free(best_fb);
                best_fb = cand;
            } else {
                rp_plan_free(cand);
            }
            cand = NULL;
        }
        if (!gated) RP_CHECK_GOTO(score_joint(&jt, plan, vx, vx_scored, previous_placed, &mine, &vs, err), st, out);
        if (vx) rep.virtual_experts_step_s = vs.step_s;
        rep.evaluated = true;
        rep.joint_step_s = mine.step_s;
        rep.joint_ratio = mine.ratio;
        scored chosen = mine;
        if (vx && vs.total < mine.total) {
            /* the same packing with the balancer scores better: the joint plan is that one */
            chosen = vs;
            rp_plan_free(plan);
            plan = vx;
            vx = NULL;
            rep.per_forward_balancing = true;
            rep.layers_replaced = layers_changed(&jt, previous_placed, plan);
            rep.share_sets = rep.extra_replicas = 0;
        }
        if (best_name) {
            rep.best_fallback_step_s = best.step_s;
            snprintf(rep.best_fallback, sizeof rep.best_fallback, "%s", best_name);
            if (best.total < chosen.total) { /* against the balancer's plan when it replaced the joint one */
                chosen = best;
                snprintf(rep.chosen, sizeof rep.chosen, "%s", best_name);
                rp_plan_free(plan);
                plan = best_fb;
                best_fb = NULL;
                rep.layers_replaced = jt.L;
                rep.share_sets = rep.extra_replicas = 0;
                rep.per_forward_balancing = rp_plan_balancing(plan) == RP_BALANCING_VIRTUAL_EXPERTS;
            }
        }
        rep.step_s = chosen.step_s;
        rep.lower_bound_s = chosen.lower_bound_s;
        rep.ratio = chosen.ratio;
        rep.migration_s = chosen.migration_s;
        rep.migration_bytes = chosen.migration_bytes;
    } else if (previous_placed) {
        RP_CHECK_GOTO(rp_cost_migration(cost, previous_placed, plan, &rep.migration_s, &rep.migration_bytes, err), st,
                      out);
    }
    *out = plan;
    plan = NULL;
    if (report) *report = rep;
out:
    rp_plan_free(plan);
    rp_plan_free(cand);
    rp_plan_free(best_fb);
    rp_plan_free(vx);
    if (prev) {
        for (int32_t l = 0; l < jt.L; l++) joint_layer_free(&jt, &prev[l]);
        rp_free(ctx, prev);
    }
    teardown(&jt);
    rp_cost_free(own_cost);
    return st;
}
