/* Baseline plans as users run them today: verl's Karmarkar-Karp packing and contiguous
 * or EPLB placement, from the primitives (docs/baselines.md: where each differs). */
#include "baseline_internal.h"
#include "routepack/virtual_experts.h"
#include "limits_internal.h"
#include "nonempty_internal.h"
#include "routepack/baseline.h"
#include "routepack/primitives.h"

#include <math.h>
#include <string.h>

static const char *const baseline_names[] = {
    "token_kk+contiguous", "token_kk+eplb", "verl_kk+contiguous",
    "verl_kk+eplb",        "attn_kk+contiguous", "attn_kk+eplb", "token_kk+virtual_experts",
    "verl_kk+virtual_experts", "attn_kk+virtual_experts", "slime_ff+contiguous", "slime_ff+eplb",
    "slime_ff+virtual_experts", "slime_kk+contiguous", "slime_kk+eplb", "slime_kk+virtual_experts", NULL,
};

const char *const *rp_baseline_names(void) { return baseline_names; }

typedef enum pack_kind {
    PACK_TOKEN, /* verl <= 0.6.0 */
    PACK_VERL,  /* verl >= 0.6.1 */
    PACK_ATTN,  /* verl >= 0.6.1's structure, keyed by attention time */
    PACK_SLIME_FF, /* slime --balance-data: first-fit microbatches dealt by FLOPs (baseline_slime.c) */
    PACK_SLIME_KK  /* slime --balance-by-flops: Karmarkar-Karp microbatches on FLOPs, dealt alike */
} pack_kind;

/* The expert groups EPLB is told about. The config has no expert groups (Qwen3- and
 * OLMoE-like models have none; DeepSeek-V3's n_group would go here), so one. */
enum { EPLB_NUM_GROUPS = 1 };

/* ---- small stable sort of microbatches by a (sum, first index) key, descending ---- */

typedef struct mb_key {
    double sum;
    int32_t first; /* smallest local index, 0 when empty (as verl's key) */
    int32_t mb;
} mb_key;

/* verl sorts with key (sum, first) and reverse=True: descending, stable. */
static bool mb_after(const mb_key *a, const mb_key *b)
{
    if (a->sum != b->sum) return a->sum < b->sum;
    return a->first < b->first;
}

static void sort_mb_keys(mb_key *k, mb_key *tmp, int32_t n)
{
    mb_key *src = k, *dst = tmp;
    for (int32_t width = 1; width < n; width *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * width) {
            int32_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) dst[o++] = mb_after(&src[i], &src[j]) ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        mb_key *t = src;
        src = dst;
        dst = t;
    }
    if (src != k) memcpy(k, src, (size_t)n * sizeof *k);
}

/* ---- packing ---- */

/* verl's packing as lists: cell (rank g, microbatch b) is counts[g * M + b] sequences,
 * the cells' lists laid end to end in seqs, rank-major, in the order each rank runs them. */
typedef struct packing_out {
    int32_t M;
    int32_t *counts; /* [G * M] */
    int32_t *seqs;   /* [n] */
} packing_out;

/* verl's two levels: DP balancing (_balance_batch: KK with equal sizes over the ranks)
 * then, per rank, dynamic batch size (rearrange_micro_batches: KK over microbatches,
 * their count the largest over ranks of ceil(tokens / cap)). With trainer.mini_batches K
 * each rank's sequences, in verl's local order, split into K contiguous parts of equal
 * count (the actor's DataProto.split / make_iterator without shuffle), and each part gets
 * its M / K microbatches on its own (verl rearranges each mini-batch). */
static rp_status pack_kk(rp_context *ctx, const rp_config *cfg, const rp_batch *batch, pack_kind kind,
                         const double *key, int32_t fixed_M, bool equal_size, packing_out *out, rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const int32_t G = t->num_gpus, n = rp_batch_num_seqs(batch);
    const int64_t cap = rp_limits_token_cap(rp_config_limits(cfg));
    const rp_trainer *tr = rp_config_trainer(cfg);
    const int32_t multiple = tr->microbatch_multiple, K = tr->mini_batches;
    if (tr->equal_sequences_per_rank) {
        /* verl's DataProto.chunk: the batch must divide over the ranks, no dummies */
        if (n % G != 0)
            return rp_fail(err, RP_EINVAL,
                           "baseline: the batch has %d sequences, which do not divide over the %d DP ranks; "
                           "trainer.equal_sequences_per_rank needs the same count on every rank (verl's "
                           "DataProto.chunk): give the step a multiple of %d sequences or turn the key off",
                           n, G, G);
        if (n / G % K != 0)
            return rp_fail(err, RP_EINVAL,
                           "baseline: each of the %d DP ranks runs %d sequences, which do not divide into "
                           "trainer.mini_batches %d mini-batches; trainer.equal_sequences_per_rank needs the same "
                           "count in every mini-batch (verl splits each rank's chunk by count): give the step a "
                           "multiple of %lld sequences or turn the key off",
                           G, n / G, K, (long long)G * K);
        equal_size = true;
    }
    if (fixed_M > 0 && fixed_M % multiple != 0)
        return rp_fail(err, RP_EINVAL,
                       "baseline: %d microbatches is not a multiple of %d (trainer.microbatch_multiple)", fixed_M,
                       multiple);
    if (fixed_M > 0 && fixed_M % (K * multiple) != 0)
        return rp_fail(err, RP_EINVAL,
                       "baseline: %d microbatches is not a multiple of %d (trainer.mini_batches %d x "
                       "trainer.microbatch_multiple %d)", fixed_M, K * multiple, K, multiple);
    /* verl needs the batch to divide over the ranks; pad with weightless dummies. */
    const int32_t per_rank = (int32_t)(((int64_t)n + G - 1) / G);
    int64_t n_pad64 = (int64_t)per_rank * G;
    if (n_pad64 > INT32_MAX) return rp_fail(err, RP_ERANGE, "baseline: %d sequences over %d ranks overflow", n, G);
    const int32_t n_pad = (int32_t)n_pad64;
    rp_status st = RP_OK;
    size_t nz = (size_t)n_pad, gz = (size_t)G;

    double *dbuf = rp_alloc(ctx, (3 * nz + 2) * sizeof(double));
    int32_t *ibuf = rp_alloc(ctx, (5 * nz + gz + 2) * sizeof(int32_t));
    mb_key *keys = NULL;
    int32_t *mb_order = NULL; /* position -> microbatch */
    out->counts = NULL;
    out->seqs = NULL;
    if (!dbuf || !ibuf) goto nomem;
    double *key_pad = dbuf, *lkey = key_pad + n_pad, *ltok = lkey + n_pad;
    int32_t *dp_part = ibuf, *local = dp_part + n_pad, *begin = local + n_pad, /* [G + 1] */
        *mpart = begin + G + 1, *order = mpart + n_pad, *tmp = order + n_pad;

    if ((st = rp_limits_check_batch(rp_config_limits(cfg), batch, err)) != RP_OK) goto out;
    for (int32_t s = 0; s < n; s++) key_pad[s] = key[s];
    for (int32_t s = n; s < n_pad; s++) key_pad[s] = 0;

    /* DP level: partition p is rank p (equal counts: verl's _balance_batch; else plain
     * KK, where the weightless dummies land anywhere and are dropped below) */
    st = rp_partition_kk(ctx, key_pad, n_pad, G, equal_size, NULL, dp_part, err);
    if (st != RP_OK) goto out;
    /* Each rank's sequences in verl's local order: ascending id (<= 0.6.0: the
     * partition as returned); >= 0.6.1: ascending (key, id), then the even positions
     * followed by the odd ones reversed. */
    for (int32_t g = 0; g <= G; g++) begin[g] = 0;
    for (int32_t s = 0; s < n; s++) begin[dp_part[s] + 1]++;
    for (int32_t g = 0; g < G; g++) begin[g + 1] += begin[g];
    for (int32_t g = 0; g < G; g++) tmp[g] = begin[g];
    for (int32_t s = 0; s < n; s++) local[tmp[dp_part[s]]++] = s;
    if (kind != PACK_TOKEN) {
        for (int32_t g = 0; g < G; g++) {
            int32_t m = begin[g + 1] - begin[g];
            int32_t *mine = local + begin[g];
            for (int32_t j = 0; j < m; j++) lkey[j] = key[mine[j]];
            /* mine[] is ascending by id, so a stable sort by key gives (key, id). */
            st = rp_sort_index(ctx, lkey, m, false, order, err);
            if (st != RP_OK) goto out;
            int32_t o = 0;
            for (int32_t j = 0; j < m; j += 2) tmp[o++] = mine[order[j]];
            for (int32_t j = (m % 2 == 0 ? m - 1 : m - 2); j >= 1; j -= 2) tmp[o++] = mine[order[j]];
            memcpy(mine, tmp, (size_t)m * sizeof *mine);
        }
    }

    /* Microbatch count of one mini-batch (all of them with one): the largest over
     * (rank, mini-batch) of ceil(tokens / cap). Mini-batch b of a rank holding m
     * sequences is its local positions [b m / K, (b + 1) m / K). */
    int32_t Mk = fixed_M / K, max_local = 0;
    for (int32_t g = 0; g < G; g++) {
        int32_t m = begin[g + 1] - begin[g];
        for (int32_t b = 0; b < K; b++) {
            const int32_t lo = (int32_t)((int64_t)b * m / K), hi = (int32_t)((int64_t)(b + 1) * m / K);
            if (hi - lo > max_local) max_local = hi - lo;
            if (fixed_M > 0) continue;
            int64_t tokens = 0;
            for (int32_t j = begin[g] + lo; j < begin[g] + hi; j++) tokens += rp_batch_seq_len(batch, local[j]);
            int64_t want = (tokens + cap - 1) / cap;
            if (want > hi - lo) want = hi - lo;
            if (want > Mk) Mk = (int32_t)want;
        }
    }
    if (Mk < 1) Mk = 1;
    /* verl's num_batches_divided_by: round the count up to the multiple */
    if (Mk % multiple != 0) Mk += multiple - Mk % multiple;
    if ((int64_t)Mk * K > INT32_MAX / G) {
        rp_fail(err, RP_ERANGE, "baseline: %d mini-batches of %d microbatches over %d ranks overflow", K, Mk, G);
        st = RP_ERANGE;
        goto out;
    }
    int32_t M = Mk * K;

    /* Per rank: KK over M microbatches on the key, within the cap (the repair pass is
     * ours: verl does not check the cap). If a rank cannot be repaired and the count
     * is ours to choose, one more microbatch for every rank. */
    for (;;) {
        rp_error kk_err;
        int32_t bad_rank = -1;
        for (int32_t g = 0; g < G && bad_rank < 0; g++) {
            int32_t m = begin[g + 1] - begin[g];
            for (int32_t b = 0; b < K && bad_rank < 0; b++) {
                const int32_t lo = (int32_t)((int64_t)b * m / K), hi = (int32_t)((int64_t)(b + 1) * m / K);
                int32_t *mine = local + begin[g] + lo, *part = mpart + begin[g] + lo;
                for (int32_t j = 0; j < hi - lo; j++) {
                    lkey[j] = key[mine[j]];
                    ltok[j] = (double)rp_batch_seq_len(batch, mine[j]);
                }
                rp_part_limits lim = {.size = ltok, .size_cap = (double)cap};
                rp_status kst = rp_partition_kk(ctx, lkey, hi - lo, Mk, false, &lim, part, &kk_err);
                if (kst == RP_ENOMEM) goto nomem;
                if (kst != RP_OK) bad_rank = g;
                for (int32_t j = 0; j < hi - lo && b > 0; j++) part[j] += b * Mk; /* the mini-batch's microbatches */
            }
        }
        if (bad_rank < 0) break;
        if (fixed_M > 0 || Mk >= max_local || (int64_t)(Mk + multiple) * K > INT32_MAX / G) {
            rp_fail(err, RP_ERANGE, "baseline: rank %d cannot split its sequences into %d microbatches within the "
                    "cap of %lld tokens (%s)", bad_rank, K == 1 ? M : Mk, (long long)cap, kk_err.text);
            st = RP_ERANGE;
            goto out;
        }
        Mk += multiple;
        M = Mk * K;
        rp_log(ctx, RP_LOG_INFO, "baseline: rank %d does not fit its microbatches under the cap; trying %d", bad_rank, M);
    }

    /* trainer.nonempty_microbatches: verl asserts that every microbatch holds a
     * sequence; KK leaves one empty only where a rank runs fewer sequences than cells
     * or the cap repair emptied one. Fill those inside the rank (nonempty.c). */
    if (tr->nonempty_microbatches) {
        int32_t *cell_rank = rp_alloc(ctx, (nz + 1) * sizeof *cell_rank);
        int32_t *cell_mb = rp_alloc(ctx, (nz + 1) * sizeof *cell_mb);
        if (!cell_rank || !cell_mb) {
            rp_free(ctx, cell_rank);
            rp_free(ctx, cell_mb);
            goto nomem;
        }
        for (int32_t k = 0; k < n; k++) {
            cell_rank[local[k]] = dp_part[local[k]];
            cell_mb[local[k]] = mpart[k];
        }
        st = rp_fill_empty_cells(ctx, batch, G, M, K, cell_rank, cell_mb, true, "baseline", err);
        for (int32_t k = 0; k < n && st == RP_OK; k++) mpart[k] = cell_mb[local[k]];
        rp_free(ctx, cell_rank);
        rp_free(ctx, cell_mb);
        if (st != RP_OK) goto out;
    }

    /* Lists: per rank and mini-batch, microbatches in verl's order, each in ascending
     * local index. */
    size_t cells = gz * (size_t)M;
    out->counts = rp_calloc(ctx, cells, sizeof *out->counts);
    out->seqs = rp_alloc(ctx, (nz + 1) * sizeof *out->seqs);
    keys = rp_alloc(ctx, 2 * (size_t)M * sizeof *keys);
    mb_order = rp_alloc(ctx, (size_t)M * sizeof *mb_order);
    if (!out->counts || !out->seqs || !keys || !mb_order) goto nomem;
    int32_t pos = 0;
    for (int32_t g = 0; g < G; g++) {
        int32_t m = begin[g + 1] - begin[g];
        const int32_t *mine = local + begin[g], *mp = mpart + begin[g];
        for (int32_t b = 0; b < M; b++) keys[b] = (mb_key){0, -1, b};
        for (int32_t j = 0; j < m; j++) {
            mb_key *k = &keys[mp[j]];
            double len = (double)rp_batch_seq_len(batch, mine[j]);
            k->sum += kind == PACK_TOKEN ? len * len : key[mine[j]];
            if (k->first < 0) k->first = j; /* local index (verl's is the mini-batch's: the same order) */
        }
        for (int32_t b = 0; b < M; b++)
            if (keys[b].first < 0) keys[b].first = 0;
        for (int32_t mb0 = 0; mb0 < M; mb0 += Mk) { /* each mini-batch on its own */
            mb_key *kb = keys + mb0;
            int32_t *ob = mb_order + mb0;
            sort_mb_keys(kb, keys + M, Mk);
            if (kind == PACK_TOKEN) {
                for (int32_t b = 0; b < Mk; b++) ob[b] = kb[b].mb;
            } else {
                /* verl >= 0.6.1: sorted[::2][::-1] + sorted[1::2], the small ones at both ends */
                int32_t o = 0;
                for (int32_t b = (Mk - 1) / 2 * 2; b >= 0; b -= 2) ob[o++] = kb[b].mb;
                for (int32_t b = 1; b < Mk; b += 2) ob[o++] = kb[b].mb;
            }
        }
        for (int32_t b = 0; b < M; b++) {
            int32_t src = mb_order[b], c = 0;
            for (int32_t j = 0; j < m; j++)
                if (mp[j] == src) out->seqs[pos + c++] = mine[j];
            out->counts[(size_t)g * M + b] = c;
            pos += c;
        }
    }
    out->M = M;
    goto out;
nomem:
    st = rp_fail_nomem(err, "a baseline packing");
out:
    if (st != RP_OK) {
        rp_free(ctx, out->counts);
        rp_free(ctx, out->seqs);
        out->counts = NULL;
        out->seqs = NULL;
    }
    rp_free(ctx, keys);
    rp_free(ctx, mb_order);
    rp_free(ctx, dbuf);
    rp_free(ctx, ibuf);
    return st;
}

/* ---- placement ---- */

/* EPLB from this step's loads, one layer at a time; the same placement serves every
 * EP group, as the plan requires. */
static rp_status place_eplb(rp_context *ctx, const rp_config *cfg, const rp_stats *stats, rp_plan *plan,
                            rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *md = rp_config_model(cfg);
    const int32_t E = md->num_experts, L = md->num_layers, ep = t->ep_size, gpn = t->gpus_per_node;
    const int32_t S = rp_plan_total_slots(plan);
    /* Nodes one EP group spans, as EPLB's num_nodes. */
    int32_t nodes = ep % gpn == 0 ? ep / gpn : 1;
    bool hier = EPLB_NUM_GROUPS % nodes == 0 && E % EPLB_NUM_GROUPS == 0;
    double *load = rp_alloc(ctx, (size_t)E * sizeof *load);
    int32_t *begin = rp_alloc(ctx, ((size_t)ep + 1) * sizeof *begin);
    int32_t *phy2log = rp_alloc(ctx, ((size_t)S + 1) * sizeof *phy2log);
    rp_status st = RP_OK;
    if (!load || !begin || !phy2log) {
        st = rp_fail_nomem(err, "an EPLB placement");
        goto out;
    }
    for (int32_t l = 0; l < L; l++) {
        const int64_t *el = rp_stats_expert_load(stats, l);
        for (int32_t e = 0; e < E; e++) load[e] = (double)el[e];
        /* EPLB knows neither GPU speeds nor uneven slots; slots we must honour. */
        rp_place_input in = {.num_experts = E, .load = load, .num_gpus = ep, .slots = t->slots,
                             .mode = hier ? RP_PLACE_HIERARCHICAL : RP_PLACE_GLOBAL,
                             .gpus_per_node = ep / nodes, .num_groups = EPLB_NUM_GROUPS};
        st = rp_place_replicas(ctx, &in, begin, phy2log, NULL, err);
        if (st == RP_OK) st = rp_plan_set_phy2log(plan, l, phy2log, err);
        if (st != RP_OK) goto out;
    }
out:
    rp_free(ctx, load);
    rp_free(ctx, begin);
    rp_free(ctx, phy2log);
    return st;
}

/* ---- entry point ---- */

/* The packing kind named by the first `len` bytes of `name`; false when none. */
static bool packing_kind_of(const char *name, size_t len, pack_kind *kind)
{
    if (len == 8 && !strncmp(name, "token_kk", 8)) *kind = PACK_TOKEN;
    else if (len == 7 && !strncmp(name, "verl_kk", 7)) *kind = PACK_VERL;
    else if (len == 7 && !strncmp(name, "attn_kk", 7)) *kind = PACK_ATTN;
    else if (len == 8 && !strncmp(name, "slime_ff", 8)) *kind = PACK_SLIME_FF;
    else if (len == 8 && !strncmp(name, "slime_kk", 8)) *kind = PACK_SLIME_KK;
    else return false;
    return true;
}

/* The packing of `kind` as a new plan without a placement. `what` names the caller in
 * messages. */
static rp_status build_packing(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                               const rp_stats *stats, pack_kind kind, int32_t num_microbatches,
                               bool equal_size, const char *what, rp_plan **out, rp_error *err)
{
    if (num_microbatches < 0)
        return rp_fail(err, RP_EINVAL, "baseline: %d microbatches, must be >= 0", num_microbatches);
    const rp_model *md = rp_config_model(cfg);
    int32_t n = rp_batch_num_seqs(batch);
    if (n < 1) return rp_fail(err, RP_EINVAL, "baseline: the batch is empty (no sequences to pack)");
    if (kind == PACK_ATTN && !stats)
        return rp_fail(err, RP_EINVAL, "baseline: %s needs this step's routing statistics", what);
    if (stats && (rp_stats_num_seqs(stats) != n || rp_stats_num_layers(stats) != md->num_layers ||
                  rp_stats_num_experts(stats) != md->num_experts))
        return rp_fail(err, RP_EINVAL,
                       "baseline: the statistics cover %d sequences, %d layers and %d experts, but the batch has %d "
                       "sequences and the model %d layers and %d experts",
                       rp_stats_num_seqs(stats), rp_stats_num_layers(stats), rp_stats_num_experts(stats), n,
                       md->num_layers, md->num_experts);
    int32_t fixed_M = num_microbatches > 0 ? num_microbatches : rp_config_limits(cfg)->num_microbatches;

    rp_status st = RP_OK;
    rp_cost *cost = NULL;
    rp_plan *plan = NULL;
    packing_out pk = {0, NULL, NULL};
    double *key = rp_alloc(ctx, (size_t)n * sizeof *key);
    const int32_t **lists = NULL;
    if (!key) {
        st = rp_fail_nomem(err, "baseline keys");
        goto out;
    }
    if (kind == PACK_ATTN) {
        RP_CHECK_GOTO(rp_cost_new(ctx, cfg, batch, stats, RP_SPLIT_EVEN, &cost, err), st, out);
        for (int32_t s = 0; s < n; s++) key[s] = rp_cost_attention_s(cost, rp_batch_seq_len(batch, s));
    } else {
        for (int32_t s = 0; s < n; s++) {
            double len = (double)rp_batch_seq_len(batch, s);
            /* verl's calculate_workload; exact in doubles below 2^53 */
            key[s] = kind == PACK_TOKEN ? len : kind == PACK_VERL ? 24576.0 * len + len * len
                                                                  : rp_slime_workload(md, len);
        }
    }
    if (kind == PACK_SLIME_FF || kind == PACK_SLIME_KK) {
        RP_CHECK_GOTO(rp_baseline_pack_slime(ctx, cfg, batch, key, kind == PACK_SLIME_FF, fixed_M, out, err), st, out);
        goto out;
    }
    RP_CHECK_GOTO(pack_kk(ctx, cfg, batch, kind, key, fixed_M, equal_size, &pk, err), st, out);

    const int32_t G = rp_config_topology(cfg)->num_gpus;
    size_t cells = (size_t)G * (size_t)pk.M;
    lists = rp_alloc(ctx, (cells + 1) * sizeof *lists);
    if (!lists) {
        st = rp_fail_nomem(err, "baseline lists");
        goto out;
    }
    for (size_t i = 0, pos = 0; i < cells; pos += (size_t)pk.counts[i], i++) lists[i] = pk.seqs + pos;
    RP_CHECK_GOTO(rp_plan_new(ctx, cfg, pk.M, &plan, err), st, out);
    RP_CHECK_GOTO(rp_plan_set_microbatches(plan, n, (const int32_t *const *)lists, pk.counts, err), st, out);
    *out = plan;
    plan = NULL;
out:
    rp_plan_free(plan);
    rp_cost_free(cost);
    rp_free(ctx, key);
    rp_free(ctx, lists);
    rp_free(ctx, pk.counts);
    rp_free(ctx, pk.seqs);
    return st;
}

rp_status rp_baseline_packing(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                              const rp_stats *stats, const char *name, int32_t num_microbatches,
                              bool equal_size, rp_plan **out, rp_error *err)
{
    if (!ctx || !cfg || !batch || !name || !out)
        return rp_fail(err, RP_EINVAL, "baseline: context, config, batch, name and output are required");
    pack_kind kind;
    if (!packing_kind_of(name, strlen(name), &kind))
        return rp_fail(err, RP_EINVAL, "baseline: unknown packing '%s'; the packings are token_kk, verl_kk, "
                       "attn_kk, slime_ff and slime_kk", name);
    return build_packing(ctx, cfg, batch, stats, kind, num_microbatches, equal_size, name, out, err);
}

rp_status rp_baseline_plan(rp_context *ctx, const rp_config *cfg, const rp_batch *batch,
                           const rp_stats *stats, const rp_plan *previous, const char *name,
                           int32_t num_microbatches, rp_plan **out, rp_error *err)
{
    if (!ctx || !cfg || !batch || !name || !out)
        return rp_fail(err, RP_EINVAL, "baseline: context, config, batch, name and output are required");
    const char *plus = strchr(name, '+');
    pack_kind kind;
    bool known = packing_kind_of(name, plus ? (size_t)(plus - name) : strlen(name), &kind);
    bool eplb = plus && !strcmp(plus + 1, "eplb");
    bool contiguous = plus && !strcmp(plus + 1, "contiguous");
    /* Megatron's virtual-expert balancer: contiguous placement, balanced per forward */
    bool vexp = plus && !strcmp(plus + 1, "virtual_experts");
    if (!known || (!eplb && !contiguous && !vexp))
        return rp_fail(err, RP_EINVAL,
                       "baseline: unknown baseline '%s'; a baseline is PACKING+PLACEMENT with packing token_kk, "
                       "verl_kk, attn_kk, slime_ff or slime_kk and placement contiguous, eplb or virtual_experts (e.g. token_kk+eplb)",
                       name);
    if (vexp) {
        rp_status vst = rp_vexp_check_config(cfg, err);
        if (vst != RP_OK) return vst;
    }
    if (eplb && !stats) return rp_fail(err, RP_EINVAL, "baseline: %s needs this step's routing statistics", name);
    rp_plan *plan = NULL;
    rp_status st;
    RP_CHECK_GOTO(build_packing(ctx, cfg, batch, stats, kind, num_microbatches, true, name, &plan, err), st, out);
    if (eplb) {
        RP_CHECK_GOTO(place_eplb(ctx, cfg, stats, plan, err), st, out);
        if (previous && rp_plan_has_placement(previous))
            RP_CHECK_GOTO(rp_plan_stabilize_slots(plan, previous, err), st, out);
    } else {
        RP_CHECK_GOTO(rp_plan_set_contiguous(plan, err), st, out);
        if (vexp) RP_CHECK_GOTO(rp_plan_set_balancing(plan, RP_BALANCING_VIRTUAL_EXPERTS, err), st, out);
    }
    /* Built to be valid; say so plainly if it is not. */
    RP_CHECK_GOTO(rp_plan_validate(plan, cfg, batch, err), st, out);
    *out = plan;
    plan = NULL;
out:
    rp_plan_free(plan);
    return st;
}
