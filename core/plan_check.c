/* Plan validation: every violation of the packing, the placement and the levers against
 * a config and a batch, each reported with its own precise message. */
#include "internal.h"
#include "memory_internal.h"
#include "routepack/executor.h"
#include "routepack/virtual_experts.h"
#include "routepack/plan.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SHARE_TOLERANCE 1e-9
/* A sequence packed many times lists this many places, then "...". */
#define MAX_LISTED_PLACES 8
/* Messages passed to the caller's report function; the rest are counted and summed up
 * in one "... and N more problems" line, so a plan with millions of violations cannot
 * flood a log (the count stays exact). */
#define MAX_REPORTED_MESSAGES 100

typedef struct reporter {
    void (*fn)(void *ud, const char *message);
    void *ud;
    int32_t count;
    bool nomem;
    char first[RP_ERROR_TEXT];
    int64_t first_seq, first_expert;
} reporter;

static void report(reporter *r, int64_t seq, int64_t expert, const char *fmt, ...) RP_PRINTF(4, 5);
static void report(reporter *r, int64_t seq, int64_t expert, const char *fmt, ...)
{
    if (r->count >= MAX_REPORTED_MESSAGES) { /* only counted from here on */
        if (r->count < INT32_MAX) r->count++;
        return;
    }
    char msg[RP_ERROR_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->count == 0) {
        memcpy(r->first, msg, sizeof msg);
        r->first_seq = seq;
        r->first_expert = expert;
    }
    if (r->count < INT32_MAX) r->count++;
    if (r->fn) r->fn(r->ud, msg);
}

/* The line that stands for the messages report() held back. */
static void report_rest(const reporter *r)
{
    if (!r->fn || r->count <= MAX_REPORTED_MESSAGES) return;
    char msg[RP_ERROR_TEXT];
    int32_t more = r->count - MAX_REPORTED_MESSAGES;
    snprintf(msg, sizeof msg, "plan: ... and %d more problem%s (only the first %d are listed)", (int)more,
             more == 1 ? "" : "s", MAX_REPORTED_MESSAGES);
    r->fn(r->ud, msg);
}

/* A plan that cannot be checked is not known to be valid: count it as a violation. */
static void report_nomem(reporter *r, const char *what)
{
    r->nomem = true;
    report(r, -1, -1, "plan: out of memory while checking the %s", what);
}

/* The plan's shape against the config. Returns false when GPUs, EP size, layers or
 * slots differ: the other checks index by them. A different expert count is reported
 * and the checks go on, judging expert ids against the config's count. */
static bool check_shape(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    int32_t before = r->count;
    if (rp_plan_num_gpus(plan) != topo->num_gpus)
        report(r, -1, -1, "plan: the plan has %d GPUs, but the config has %d", rp_plan_num_gpus(plan),
               topo->num_gpus);
    if (rp_plan_ep_size(plan) != topo->ep_size)
        report(r, -1, -1, "plan: the plan has EP size %d, but the config has %d", rp_plan_ep_size(plan),
               topo->ep_size);
    if (rp_plan_num_layers(plan) != model->num_layers)
        report(r, -1, -1, "plan: the plan has %d layers, but the model has %d", rp_plan_num_layers(plan),
               model->num_layers);
    if (r->count != before) return false;
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    /* The config makes every EP group repeat group 0's slot counts, so group 0 suffices. */
    for (int32_t j = 0; j < topo->ep_size; j++) {
        int32_t slots = slot_begin[j + 1] - slot_begin[j];
        if (topo->slots[j] != slots)
            report(r, -1, -1, "plan: EP rank %d has %d slots in the plan, but %d in the config", j, slots,
                   topo->slots[j]);
    }
    if (r->count != before) return false;
    if (rp_plan_num_experts(plan) != model->num_experts)
        report(r, -1, -1, "plan: the plan has %d experts per layer, but the model has %d",
               rp_plan_num_experts(plan), model->num_experts);
    return true;
}

static void describe_place(char *buf, size_t size, size_t *used, int32_t list, int32_t M)
{
    if (*used >= size) return;
    int w = snprintf(buf + *used, size - *used, "%srank %d mb %d", *used ? ", " : "", list / M, list % M);
    if (w > 0) *used += (size_t)w;
}

/* trainer.equal_sequences_per_rank: every DP rank runs n / G sequences (verl's
 * DataProto.chunk splits the batch into G equal chunks). */
static void check_equal_sequences(const rp_plan *plan, int32_t n, reporter *r)
{
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    if (n % G != 0) {
        report(r, -1, -1,
               "plan: the batch has %d sequences, which do not divide over the %d DP ranks "
               "(trainer.equal_sequences_per_rank needs the same count on every rank)",
               n, G);
        return;
    }
    for (int32_t g = 0; g < G; g++) {
        int64_t count = 0;
        for (int32_t m = 0; m < M; m++) {
            int32_t c;
            rp_plan_microbatch(plan, g, m, &c);
            count += c;
        }
        if (count != n / G)
            report(r, -1, -1,
                   "plan: rank %d runs %lld sequences, but trainer.equal_sequences_per_rank needs %d on every rank "
                   "(%d sequences over %d DP ranks)",
                   g, (long long)count, n / G, n, G);
    }
}

/* trainer.equal_sequences_per_rank with trainer.mini_batches K: verl splits each rank's
 * chunk into K mini-batches of equal count (DataProto.split, make_iterator asserts the
 * chunk divides), so every (rank, mini-batch) runs n / G / K sequences. */
static void check_equal_mini_batches(const rp_plan *plan, int32_t n, int32_t K, reporter *r)
{
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan), Mk = M / K;
    if (n % G != 0) return; /* check_equal_sequences said so */
    if (n / G % K != 0) {
        report(r, -1, -1,
               "plan: each rank runs %d sequences, which do not divide into trainer.mini_batches %d mini-batches "
               "(trainer.equal_sequences_per_rank: verl splits each rank's chunk into mini-batches of one size)",
               n / G, K);
        return;
    }
    for (int32_t g = 0; g < G; g++)
        for (int32_t b = 0; b < K; b++) {
            int64_t count = 0;
            for (int32_t m = b * Mk; m < (b + 1) * Mk; m++) {
                int32_t c;
                rp_plan_microbatch(plan, g, m, &c);
                count += c;
            }
            if (count != n / G / K)
                report(r, -1, -1,
                       "plan: rank %d mini-batch %d (microbatches %d to %d) runs %lld sequences, but "
                       "trainer.equal_sequences_per_rank needs %d in every mini-batch of every rank (%d sequences "
                       "per rank over trainer.mini_batches %d)",
                       g, b, b * Mk, (b + 1) * Mk - 1, (long long)count, n / G / K, n / G, K);
        }
}

/* trainer.nonempty_microbatches: every (rank, microbatch) runs a sequence (verl's
 * micro-batch partitioning asserts it). */
static void check_nonempty(const rp_plan *plan, reporter *r)
{
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    for (int32_t g = 0; g < G; g++)
        for (int32_t m = 0; m < M; m++) {
            int32_t c;
            rp_plan_microbatch(plan, g, m, &c);
            if (c == 0)
                report(r, -1, -1,
                       "plan: rank %d microbatch %d runs no sequence, but trainer.nonempty_microbatches needs one in "
                       "every microbatch (%d microbatches per rank)",
                       g, m, M);
        }
}

static void check_packing(const rp_plan *plan, const rp_config *cfg, const rp_batch *batch,
                          reporter *r)
{
    const rp_limits *lim = rp_config_limits(cfg);
    rp_context *ctx = rp_plan_context(plan);
    int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    int32_t n = rp_plan_num_seqs(plan);
    int32_t lists = G * M; /* < 2^31: checked by rp_plan_new */

    if (lim->num_microbatches > 0 && M != lim->num_microbatches)
        report(r, -1, -1,
               "plan: the plan runs %d microbatches per rank, but the config fixes %d (limits.num_microbatches)",
               M, lim->num_microbatches);

    const rp_trainer *tr = rp_config_trainer(cfg);
    if (M % tr->microbatch_multiple != 0)
        report(r, -1, -1,
               "plan: the plan runs %d microbatches per rank, not a multiple of %d (trainer.microbatch_multiple)", M,
               tr->microbatch_multiple);
    const int32_t K = tr->mini_batches;
    const bool whole = M % K == 0; /* mini-batches of M / K microbatches each */
    if (!whole)
        report(r, -1, -1,
               "plan: the plan runs %d microbatches per rank, not a multiple of trainer.mini_batches %d (every "
               "mini-batch runs the same number of microbatches)", M, K);
    else if (K > 1 && M % tr->microbatch_multiple == 0 && (M / K) % tr->microbatch_multiple != 0)
        report(r, -1, -1,
               "plan: the plan runs %d microbatches per mini-batch, not a multiple of %d (trainer.microbatch_multiple "
               "holds in every mini-batch: verl rearranges each mini-batch's micro-batches on its own)", M / K,
               tr->microbatch_multiple);
    if (tr->equal_sequences_per_rank) check_equal_sequences(plan, batch ? rp_batch_num_seqs(batch) : n, r);
    if (tr->equal_sequences_per_rank && K > 1 && whole)
        check_equal_mini_batches(plan, batch ? rp_batch_num_seqs(batch) : n, K, r);
    if (tr->nonempty_microbatches) check_nonempty(plan, r);

    int32_t batch_n = batch ? rp_batch_num_seqs(batch) : 0;
    const int64_t cap = lim->max_tokens_per_microbatch;
    const double mem_cap = lim->max_activation_bytes;
    const double per_token = lim->activation_bytes_per_token;
    if (batch) {
        if (n != batch_n)
            report(r, -1, -1, "plan: the packing has %d sequences, but the batch has %d", n, batch_n);
        for (int32_t s = 0; s < batch_n; s++) {
            int64_t len = rp_batch_seq_len(batch, s);
            if (cap > 0 && len > cap)
                report(r, s, -1,
                       "plan: sequence %d has %lld tokens, longer than the microbatch cap of %lld: no packing can hold it",
                       s, (long long)len, (long long)cap);
            if (mem_cap > 0 && (double)len * per_token > mem_cap)
                report(r, s, -1,
                       "plan: sequence %d needs %.0f bytes of activations (%lld tokens), more than the microbatch "
                       "memory cap of %.0f bytes: no packing can hold it",
                       s, (double)len * per_token, (long long)len, mem_cap);
        }
        /* A microbatch of one sequence over a cap is that sequence's fault, reported above. */
        for (int32_t i = 0; i < lists; i++) {
            int32_t count;
            const int32_t *seqs = rp_plan_microbatch(plan, i / M, i % M, &count);
            int64_t tokens = 0;
            for (int32_t k = 0; k < count; k++)
                if (seqs[k] < batch_n) tokens += rp_batch_seq_len(batch, seqs[k]);
            if (count < 2) continue;
            if (cap > 0 && tokens > cap)
                report(r, -1, -1, "plan: rank %d mb %d holds %lld tokens, over the cap of %lld", i / M, i % M,
                       (long long)tokens, (long long)cap);
            if (mem_cap > 0 && (double)tokens * per_token > mem_cap)
                report(r, -1, -1,
                       "plan: rank %d mb %d needs %.0f bytes of activations (%lld tokens), over the memory cap of "
                       "%.0f bytes",
                       i / M, i % M, (double)tokens * per_token, (long long)tokens, mem_cap);
        }
    }

    /* Occurrences of each sequence; places listed only for repeated ones. */
    int32_t *times = rp_calloc(ctx, (size_t)n + 1, sizeof *times);
    int64_t *place_begin = NULL;
    int32_t *places = NULL;
    if (!times) {
        report_nomem(r, "packing");
        return;
    }
    bool repeated = false;
    for (int32_t i = 0; i < lists; i++) {
        int32_t count;
        const int32_t *seqs = rp_plan_microbatch(plan, i / M, i % M, &count);
        for (int32_t k = 0; k < count; k++)
            if (++times[seqs[k]] > 1) repeated = true;
    }
    if (repeated) {
        place_begin = rp_calloc(ctx, (size_t)n + 1, sizeof *place_begin);
        int64_t total = 0;
        for (int32_t s = 0; s < n; s++) total += times[s];
        places = rp_alloc(ctx, (size_t)total * sizeof *places + 1);
        if (!place_begin || !places) {
            report_nomem(r, "packing");
            goto out;
        }
        for (int32_t s = 0; s < n; s++) place_begin[s + 1] = place_begin[s] + times[s];
        for (int32_t i = 0; i < lists; i++) {
            int32_t count;
            const int32_t *seqs = rp_plan_microbatch(plan, i / M, i % M, &count);
            for (int32_t k = 0; k < count; k++) places[place_begin[seqs[k]]++] = i;
        }
        for (int32_t s = n; s > 0; s--) place_begin[s] = place_begin[s - 1];
        place_begin[0] = 0;
    }
    for (int32_t s = 0; s < n; s++) {
        if (times[s] == 0) {
            report(r, s, -1, "plan: sequence %d is not packed", s);
        } else if (times[s] > 1) {
            char where[RP_ERROR_TEXT / 2];
            size_t used = 0;
            where[0] = '\0';
            for (int32_t k = 0; k < times[s] && k < MAX_LISTED_PLACES; k++)
                describe_place(where, sizeof where, &used, places[place_begin[s] + k], M);
            const char *more = times[s] > MAX_LISTED_PLACES ? ", ..." : "";
            if (times[s] == 2)
                report(r, s, -1, "plan: sequence %d is packed twice (%s)", s, where);
            else
                report(r, s, -1, "plan: sequence %d is packed %d times (%s%s)", s, times[s], where, more);
        }
    }
out:
    rp_free(ctx, times);
    rp_free(ctx, place_begin);
    rp_free(ctx, places);
}

static void check_placement(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    rp_context *ctx = rp_plan_context(plan);
    int32_t E = rp_config_model(cfg)->num_experts, ep = rp_plan_ep_size(plan), L = rp_plan_num_layers(plan);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    int32_t *replicas = rp_alloc(ctx, (size_t)E * sizeof *replicas);
    int32_t *seen_rank = rp_alloc(ctx, (size_t)E * sizeof *seen_rank);
    int32_t *seen_slot = rp_alloc(ctx, (size_t)E * sizeof *seen_slot);
    if (!replicas || !seen_rank || !seen_slot) {
        report_nomem(r, "placement");
        goto out;
    }
    for (int32_t l = 0; l < L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        for (int32_t e = 0; e < E; e++) replicas[e] = 0, seen_rank[e] = -1;
        for (int32_t j = 0; j < ep; j++) {
            for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++) {
                int32_t e = p2l[s];
                if (e == -1) continue;
                if (e < -1 || e >= E) {
                    report(r, -1, e, "plan: layer %d slot %d holds expert %d, but the model has %d experts", l, s,
                           e, E);
                    continue;
                }
                replicas[e]++;
                if (seen_rank[e] == j)
                    report(r, -1, e, "plan: layer %d EP rank %d holds expert %d twice (slots %d and %d)", l, j, e,
                           seen_slot[e], s);
                else
                    seen_rank[e] = j, seen_slot[e] = s;
            }
        }
        for (int32_t e = 0; e < E; e++)
            if (replicas[e] == 0) report(r, -1, e, "plan: layer %d expert %d has no replica", l, e);
    }
out:
    rp_free(ctx, replicas);
    rp_free(ctx, seen_rank);
    rp_free(ctx, seen_slot);
}

/* Does EP rank j hold expert e at layer l in the placement (not counting extras)? */
static bool rank_holds(const rp_plan *plan, int32_t l, int32_t j, int32_t e)
{
    const int32_t *p2l = rp_plan_phy2log(plan, l);
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++)
        if (p2l[s] == e) return true;
    return false;
}

static void check_levers(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    int32_t num_extras = rp_plan_num_extra_replicas(plan), num_sets = rp_plan_num_share_sets(plan);
    if (num_extras == 0 && num_sets == 0) return;
    if (!rp_plan_has_placement(plan)) {
        report(r, -1, -1, "plan: the plan has extra replicas or shares (%d and %d), but no placement for them to "
               "refer to", num_extras, num_sets);
        return;
    }
    /* EP rank j is GPU j of group 0 for the node map; see docs/formats.md. */
    int32_t gpus_per_node = rp_config_topology(cfg)->gpus_per_node;
    int32_t ep = rp_plan_ep_size(plan), E = rp_config_model(cfg)->num_experts;
    for (int32_t i = 0; i < num_extras; i++) {
        int32_t mb, l, e, j;
        rp_plan_extra_replica(plan, i, &mb, &l, &e, &j);
        if (e >= E) {
            report(r, -1, e, "plan: mb %d layer %d: extra replica of expert %d, but the model has %d experts", mb, l,
                   e, E);
            continue;
        }
        bool held = rank_holds(plan, l, j, e);
        /* extras are sorted by key: earlier ones of the same key sit just before */
        for (int32_t k = i - 1; k >= 0 && !held; k--) {
            int32_t mb2, l2, e2, j2;
            rp_plan_extra_replica(plan, k, &mb2, &l2, &e2, &j2);
            if (mb2 != mb || l2 != l || e2 != e) break;
            held = j2 == j;
        }
        if (held) {
            report(r, -1, e, "plan: mb %d layer %d: extra replica of expert %d on EP rank %d, which already holds it",
                   mb, l, e, j);
            continue;
        }
        int32_t node = j / gpus_per_node;
        /* an executor that fetches a step's extras once fetches from any GPU, across nodes
         * over the network (routepack_torch's set_placement); one that copies them per
         * microbatch copies over NVLink only */
        bool source = rp_config_execution(cfg)->extras_once;
        for (int32_t j2 = node * gpus_per_node; j2 < (node + 1) * gpus_per_node && j2 < ep && !source; j2++)
            source = rank_holds(plan, l, j2, e);
        if (!source)
            report(r, -1, e,
                   "plan: mb %d layer %d: extra replica of expert %d on EP rank %d has no replica of the expert in "
                   "its node (node %d) to copy from over NVLink (execution.executor \"%s\" copies extras per "
                   "microbatch; \"routepack_torch\" fetches them across nodes)",
                   mb, l, e, j, node, rp_executor_name(rp_config_execution(cfg)->executor));
    }
    for (int32_t i = 0; i < num_sets; i++) {
        int32_t mb, l, e, count;
        const double *shares = rp_plan_share_set(plan, i, &mb, &l, &e, &count);
        if (e >= E) {
            report(r, -1, e, "plan: mb %d layer %d: shares of expert %d, but the model has %d experts", mb, l, e, E);
            continue;
        }
        int32_t num_replicas = rp_plan_replicas(plan, mb, l, e, NULL, NULL, 0);
        if (count != num_replicas)
            report(r, -1, e, "plan: mb %d layer %d expert %d has %d share%s for %d replica%s", mb, l, e, count,
                   count == 1 ? "" : "s", num_replicas, num_replicas == 1 ? "" : "s");
        bool valid = count > 0;
        double sum = 0;
        for (int32_t k = 0; k < count; k++) {
            double x = shares[k];
            if (isnan(x)) {
                report(r, -1, e, "plan: mb %d layer %d expert %d share %d is NaN", mb, l, e, k);
                valid = false;
            } else if (x < 0) {
                report(r, -1, e, "plan: mb %d layer %d expert %d share %d is negative (%g)", mb, l, e, k, x);
                valid = false;
            } else if (isinf(x)) {
                report(r, -1, e, "plan: mb %d layer %d expert %d share %d is infinite", mb, l, e, k);
                valid = false;
            } else {
                sum += x;
            }
        }
        if (valid && fabs(sum - 1.0) > SHARE_TOLERANCE)
            report(r, -1, e, "plan: mb %d layer %d expert %d shares sum to %.12g, not 1", mb, l, e, sum);
    }
}

/* Every GPU must hold its slots, dense parameters, staging and the plan's extra replicas
 * (docs/cost-model.md, "Memory per GPU"). The config alone fits (rp_config_parse checks
 * it), so in practice this catches extra replicas that tip a GPU over. */
static void check_memory(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    /* another expert count was reported by check_shape; the extras cannot be counted */
    if (rp_plan_num_experts(plan) != rp_config_model(cfg)->num_experts) return;
    rp_context *ctx = rp_plan_context(plan);
    const int32_t ep = rp_plan_ep_size(plan);
    rp_gpu_memory *per_rank = rp_alloc(ctx, (size_t)ep * sizeof *per_rank);
    if (!per_rank || memory_per_rank(cfg, plan, per_rank, NULL) != RP_OK) {
        report_nomem(r, "memory per GPU"); /* the shape was checked: only memory can fail */
        rp_free(ctx, per_rank);
        return;
    }
    for (int32_t j = 0; j < ep; j++) {
        if (per_rank[j].total_bytes <= per_rank[j].capacity_bytes) continue;
        char what[RP_ERROR_TEXT - 64];
        rp_memory_describe(&per_rank[j], what, sizeof what);
        report(r, -1, -1, "plan: %s%s", what,
               rp_plan_num_gpus(plan) > ep ? " (and the same EP rank in every EP group)" : "");
    }
    rp_free(ctx, per_rank);
}

/* What Megatron's virtual-expert balancer requires of the plan it runs with: the
 * config's limits, num_experts / ep_size experts on each EP rank (with every expert
 * placed, which check_placement reports, that is every expert once) and no levers (it
 * makes its own replicas every forward). */
static void check_balancing(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    if (rp_plan_balancing(plan) != RP_BALANCING_VIRTUAL_EXPERTS) return;
    rp_error err;
    if (rp_vexp_check_config(cfg, &err) != RP_OK) {
        report(r, -1, -1, "plan: per_forward_balancing virtual_experts: %s", err.text);
        return;
    }
    int32_t num_extras = rp_plan_num_extra_replicas(plan), num_sets = rp_plan_num_share_sets(plan);
    if (num_extras || num_sets)
        report(r, -1, -1, "plan: per_forward_balancing virtual_experts makes its own replicas each forward, but the "
               "plan also has %d extra replica%s and %d share set%s", num_extras, num_extras == 1 ? "" : "s",
               num_sets, num_sets == 1 ? "" : "s");
    if (!rp_plan_has_placement(plan)) return;
    int32_t E = rp_config_model(cfg)->num_experts, ep = rp_plan_ep_size(plan), L = rp_plan_num_layers(plan);
    int32_t per_rank = E / ep;
    const int32_t *slot_begin = rp_plan_slot_begin(plan);
    for (int32_t l = 0; l < L; l++) {
        const int32_t *p2l = rp_plan_phy2log(plan, l);
        for (int32_t j = 0; j < ep; j++) {
            int32_t held = 0;
            for (int32_t s = slot_begin[j]; s < slot_begin[j + 1]; s++) held += p2l[s] >= 0;
            if (held != per_rank) {
                report(r, -1, -1, "plan: per_forward_balancing virtual_experts needs %d experts (num_experts / "
                       "ep_size) on every EP rank, but layer %d EP rank %d holds %d", per_rank, l, j, held);
                return;
            }
        }
    }
}

/* The levers the config's executor runs (execution.executor): a plan with share sets or
 * extra replicas it cannot run is invalid, named. (Replicas in spare slots cannot occur
 * where the executor holds every expert once: the config has no spare slot then.) */
static void check_executor_levers(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    const rp_execution *x = rp_config_execution(cfg);
    int32_t num_sets = rp_plan_num_share_sets(plan), num_extras = rp_plan_num_extra_replicas(plan);
    bool bad_sets = num_sets && !(x->levers & RP_LEVER_SHARES), bad_extras = num_extras && !(x->levers & RP_LEVER_EXTRAS);
    if (!bad_sets && !bad_extras) return;
    char runs[96];
    rp_executor_levers_text(x->levers, runs, sizeof runs);
    if (bad_sets)
        report(r, -1, -1, "plan: execution.executor \"%s\" cannot run per-microbatch shares (it runs: %s), but the "
               "plan has %d share set%s", rp_executor_name(x->executor), runs, num_sets, num_sets == 1 ? "" : "s");
    if (bad_extras)
        report(r, -1, -1, "plan: execution.executor \"%s\" cannot run extra replicas (it runs: %s), but the plan "
               "has %d extra replica%s", rp_executor_name(x->executor), runs, num_extras, num_extras == 1 ? "" : "s");
}

/* Position k of every rank of an EP group runs together (the all-to-all of a microbatch
 * is collective; under sync "global" every rank meets at every layer): one order per EP
 * group, per job under global sync. Each order is a permutation (rp_plan_set_microbatch_order). */
static void check_order(const rp_plan *plan, const rp_config *cfg, reporter *r)
{
    if (!rp_plan_has_microbatch_order(plan)) return;
    const int32_t G = rp_plan_num_gpus(plan), M = rp_plan_num_microbatches(plan);
    const bool global = rp_config_execution(cfg)->sync == RP_SYNC_GLOBAL;
    const int32_t span = global ? G : rp_config_topology(cfg)->ep_size;
    /* each mini-batch is a pipeline run of its own: its order permutes its microbatches */
    const int32_t K = rp_config_trainer(cfg)->mini_batches, Mk = M % K == 0 ? M / K : M;
    for (int32_t g = 0; g < G; g += span)
        for (int32_t k = 0; k < M && Mk < M; k++) {
            int32_t mine = rp_plan_microbatch_at(plan, g, k);
            if (mine / Mk != k / Mk)
                report(r, -1, -1,
                       "plan: rank %d runs microbatch %d at position %d, in mini-batch %d (positions %d to %d), but "
                       "microbatch %d belongs to mini-batch %d: microbatch_order permutes only within a mini-batch "
                       "(trainer.mini_batches %d)",
                       g, mine, k, k / Mk, k / Mk * Mk, k / Mk * Mk + Mk - 1, mine, mine / Mk, K);
        }
    for (int32_t g = 0; g < G; g++) {
        const int32_t lead = g - g % span;
        for (int32_t k = 0; k < M; k++) {
            int32_t mine = rp_plan_microbatch_at(plan, g, k), theirs = rp_plan_microbatch_at(plan, lead, k);
            if (mine != theirs) {
                report(r, -1, -1,
                       "plan: rank %d runs microbatch %d at position %d, but rank %d of its %s runs %d: ranks "
                       "that meet in the all-to-all run one microbatch order",
                       g, mine, k, lead, global ? "job (execution.sync \"global\")" : "EP group", theirs);
                break;
            }
        }
    }
}

static int32_t check(const rp_plan *plan, const rp_config *cfg, const rp_batch *batch, reporter *r)
{
    if (!check_shape(plan, cfg, r)) return r->count;
    if (rp_plan_has_packing(plan)) check_packing(plan, cfg, batch, r);
    if (rp_plan_has_placement(plan)) check_placement(plan, cfg, r);
    check_levers(plan, cfg, r);
    check_memory(plan, cfg, r);
    check_balancing(plan, cfg, r);
    check_executor_levers(plan, cfg, r);
    check_order(plan, cfg, r);
    return r->count;
}

int32_t rp_plan_check(const rp_plan *plan, const rp_config *cfg, const rp_batch *batch,
                      void (*fn)(void *ud, const char *message), void *ud)
{
    reporter r = {fn, ud, 0, false, "", -1, -1};
    int32_t count = check(plan, cfg, batch, &r);
    report_rest(&r);
    return count;
}

rp_status rp_plan_validate(const rp_plan *plan, const rp_config *cfg, const rp_batch *batch,
                           rp_error *err)
{
    reporter r = {NULL, NULL, 0, false, "", -1, -1};
    check(plan, cfg, batch, &r);
    if (r.nomem) return rp_fail_nomem(err, "a plan check");
    if (r.count == 0) {
        rp_error_clear(err);
        return RP_OK;
    }
    if (r.count == 1) {
        rp_fail(err, RP_EPLAN, "%s", r.first);
    } else {
        const char *first = r.first;
        if (strncmp(first, "plan: ", 6) == 0) first += 6;
        rp_fail(err, RP_EPLAN, "plan: %d problems; first: %s", r.count, first);
    }
    if (err) {
        err->sequence = r.first_seq;
        err->expert = r.first_expert;
    }
    return RP_EPLAN;
}
