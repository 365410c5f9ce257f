/* The plan object: shape, packing (CSR lists per rank and microbatch), placement (one
 * phy2log per layer with a replica index), the per-microbatch levers, copy and hash. */
#include "internal.h"
#include "plan_internal.h"
#include "routepack/plan.h"

#include <string.h>

typedef struct extra_replica {
    int32_t mb, layer, expert, ep_rank;
} extra_replica;

typedef struct share_set {
    int32_t mb, layer, expert, count;
    double *shares; /* [count], owned */
} share_set;

/* The packing as CSR: list i = rank * M + mb holds seqs[begin[i] .. begin[i+1]). */
typedef struct packing {
    int32_t num_seqs;
    int64_t *begin;   /* [G * M + 1] */
    int32_t *seqs;    /* [begin[G * M]] */
    int32_t *seq_rank; /* [num_seqs] first occurrence, -1 if not packed */
    int32_t *seq_mb;
} packing;

struct rp_plan {
    rp_context *ctx;
    int32_t num_gpus, num_microbatches, ep_size, num_layers, num_experts, total_slots;
    int32_t *slot_begin; /* [ep_size + 1] */

    bool has_packing;
    packing pack;

    bool has_placement;
    int32_t *phy2log;   /* [L * S] */
    /* Replica index, rebuilt with each layer: the slots of expert e at layer l, in
     * ascending order, are rep_slots[l * S + rep_begin[l * (E + 1) + e] ..
     * rep_slots[l * S + rep_begin[l * (E + 1) + e + 1]). */
    int32_t *rep_begin; /* [L * (E + 1)] */
    int32_t *rep_slots; /* [L * S] */

    extra_replica *extras; /* sorted by (mb, layer, expert), stable */
    int32_t num_extras, cap_extras;
    share_set *shares;     /* sorted by (mb, layer, expert), unique keys */
    int32_t num_shares, cap_shares;
    rp_balancing balancing;
    /* [G * M]: the microbatch each rank runs at each position (pipeline order); NULL
     * while every rank runs them in index order */
    int32_t *mb_order;
};

/* ---- shape ----------------------------------------------------------------------- */

static int key_cmp(int32_t mb_a, int32_t layer_a, int32_t expert_a, int32_t mb_b,
                   int32_t layer_b, int32_t expert_b)
{
    if (mb_a != mb_b) return mb_a < mb_b ? -1 : 1;
    if (layer_a != layer_b) return layer_a < layer_b ? -1 : 1;
    if (expert_a != expert_b) return expert_a < expert_b ? -1 : 1;
    return 0;
}

static void packing_free(rp_context *ctx, packing *p)
{
    rp_free(ctx, p->begin);
    rp_free(ctx, p->seqs);
    rp_free(ctx, p->seq_rank);
    rp_free(ctx, p->seq_mb);
    memset(p, 0, sizeof *p);
}

static void shares_free(rp_plan *plan)
{
    for (int32_t i = 0; i < plan->num_shares; i++) rp_free(plan->ctx, plan->shares[i].shares);
    rp_free(plan->ctx, plan->shares);
    plan->shares = NULL;
    plan->num_shares = plan->cap_shares = 0;
}

void rp_plan_free(rp_plan *plan)
{
    if (!plan) return;
    rp_context *ctx = plan->ctx;
    packing_free(ctx, &plan->pack);
    rp_free(ctx, plan->slot_begin);
    rp_free(ctx, plan->phy2log);
    rp_free(ctx, plan->rep_begin);
    rp_free(ctx, plan->rep_slots);
    rp_free(ctx, plan->extras);
    rp_free(ctx, plan->mb_order);
    shares_free(plan);
    rp_free(ctx, plan);
}

/* Rebuild the replica index of one layer from its phy2log (slots are visited in
 * ascending order, so each expert's slots come out ascending). */
static void index_layer(rp_plan *plan, int32_t layer)
{
    int32_t S = plan->total_slots, E = plan->num_experts;
    const int32_t *p2l = plan->phy2log + (size_t)layer * S;
    int32_t *begin = plan->rep_begin + (size_t)layer * (E + 1);
    int32_t *slots = plan->rep_slots + (size_t)layer * S;
    memset(begin, 0, (size_t)(E + 1) * sizeof *begin);
    for (int32_t s = 0; s < S; s++)
        if (p2l[s] >= 0) begin[p2l[s] + 1]++;
    for (int32_t e = 0; e < E; e++) begin[e + 1] += begin[e];
    /* fill using begin[e] as a cursor, then shift back */
    for (int32_t s = 0; s < S; s++)
        if (p2l[s] >= 0) slots[begin[p2l[s]]++] = s;
    for (int32_t e = E; e > 0; e--) begin[e] = begin[e - 1];
    begin[0] = 0;
}

/* An empty packing for `num_seqs` sequences: every list empty, nothing packed. */
static rp_status packing_alloc(rp_plan *plan, int32_t num_seqs, int64_t total, packing *out,
                               rp_error *err)
{
    rp_context *ctx = plan->ctx;
    size_t lists = (size_t)plan->num_gpus * (size_t)plan->num_microbatches;
    memset(out, 0, sizeof *out);
    out->num_seqs = num_seqs;
    out->begin = rp_calloc(ctx, lists + 1, sizeof *out->begin);
    out->seqs = rp_alloc(ctx, (size_t)total * sizeof *out->seqs);
    out->seq_rank = rp_alloc(ctx, (size_t)num_seqs * sizeof *out->seq_rank);
    out->seq_mb = rp_alloc(ctx, (size_t)num_seqs * sizeof *out->seq_mb);
    if (!out->begin || !out->seqs || !out->seq_rank || !out->seq_mb) {
        packing_free(ctx, out);
        return rp_fail_nomem(err, "a packing");
    }
    for (int32_t s = 0; s < num_seqs; s++) out->seq_rank[s] = out->seq_mb[s] = -1;
    return RP_OK;
}

rp_status rp_plan_new(rp_context *ctx, const rp_config *cfg, int32_t num_microbatches,
                      rp_plan **out, rp_error *err)
{
    if (!ctx || !cfg || !out) return rp_fail(err, RP_EINVAL, "plan: context, config and output are required");
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    if (num_microbatches < 1)
        return rp_fail(err, RP_EINVAL, "plan: %d microbatches, must be >= 1", num_microbatches);
    if (topo->num_gpus < 1 || topo->ep_size < 1 || topo->num_gpus % topo->ep_size != 0)
        return rp_fail(err, RP_EINVAL, "plan: %d GPUs in EP groups of %d is not a valid topology",
                       topo->num_gpus, topo->ep_size);
    if (model->num_layers < 0 || model->num_experts < 1)
        return rp_fail(err, RP_EINVAL, "plan: %d layers of %d experts is not a valid model",
                       model->num_layers, model->num_experts);
    int64_t lists, total_slots = 0, cells, index;
    if (rp_mul_overflow(topo->num_gpus, num_microbatches, &lists) || lists >= INT32_MAX)
        return rp_fail(err, RP_ERANGE, "plan: %d GPUs x %d microbatches is too many lists",
                       topo->num_gpus, num_microbatches);
    for (int32_t j = 0; j < topo->ep_size; j++) {
        if (topo->slots[j] < 0)
            return rp_fail(err, RP_EINVAL, "plan: EP rank %d has %d slots", j, topo->slots[j]);
        total_slots += topo->slots[j];
    }
    if (total_slots > INT32_MAX || rp_mul_overflow(total_slots, model->num_layers, &cells) ||
        rp_mul_overflow((int64_t)model->num_experts + 1, model->num_layers, &index) ||
        cells > INT32_MAX || index > INT32_MAX)
        return rp_fail(err, RP_ERANGE, "plan: %lld slots x %d layers is too large",
                       (long long)total_slots, model->num_layers);

    rp_status st = RP_OK;
    rp_plan *plan = rp_calloc(ctx, 1, sizeof *plan);
    if (!plan) return rp_fail_nomem(err, "a plan");
    plan->ctx = ctx;
    plan->num_gpus = topo->num_gpus;
    plan->num_microbatches = num_microbatches;
    plan->ep_size = topo->ep_size;
    plan->num_layers = model->num_layers;
    plan->num_experts = model->num_experts;
    plan->total_slots = (int32_t)total_slots;
    plan->slot_begin = rp_alloc(ctx, ((size_t)plan->ep_size + 1) * sizeof(int32_t));
    plan->phy2log = rp_alloc(ctx, (size_t)cells * sizeof(int32_t));
    plan->rep_begin = rp_alloc(ctx, (size_t)index * sizeof(int32_t));
    plan->rep_slots = rp_alloc(ctx, (size_t)cells * sizeof(int32_t));
    if (!plan->slot_begin || !plan->phy2log || !plan->rep_begin || !plan->rep_slots) {
        st = rp_fail_nomem(err, "a plan");
        goto out;
    }
    plan->slot_begin[0] = 0;
    for (int32_t j = 0; j < plan->ep_size; j++)
        plan->slot_begin[j + 1] = plan->slot_begin[j] + topo->slots[j];
    for (int64_t i = 0; i < cells; i++) plan->phy2log[i] = -1;
    for (int32_t l = 0; l < plan->num_layers; l++) index_layer(plan, l);
    RP_CHECK_GOTO(packing_alloc(plan, 0, 0, &plan->pack, err), st, out);
out:
    if (st != RP_OK) {
        rp_plan_free(plan);
        return st;
    }
    *out = plan;
    return RP_OK;
}

/* memcpy that accepts NULL pointers for empty ranges (memcpy itself does not). */
static void copy_bytes(void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
}

rp_status rp_plan_copy(const rp_plan *src, rp_plan **out, rp_error *err)
{
    if (!src || !out) return rp_fail(err, RP_EINVAL, "plan: nothing to copy");
    return plan_copy_in(src->ctx, src, out, err);
}

rp_status plan_copy_in(rp_context *ctx, const rp_plan *src, rp_plan **out, rp_error *err)
{
    size_t lists = (size_t)src->num_gpus * (size_t)src->num_microbatches;
    size_t cells = (size_t)src->num_layers * (size_t)src->total_slots;
    size_t index = (size_t)src->num_layers * ((size_t)src->num_experts + 1);
    size_t total = (size_t)src->pack.begin[lists];
    size_t n = (size_t)src->pack.num_seqs;
    rp_status st = RP_OK;
    rp_plan *p = rp_calloc(ctx, 1, sizeof *p);
    if (!p) return rp_fail_nomem(err, "a plan copy");
    *p = *src;
    p->ctx = ctx;
    memset(&p->pack, 0, sizeof p->pack);
    p->slot_begin = p->phy2log = p->rep_begin = p->rep_slots = NULL;
    p->extras = NULL;
    p->mb_order = NULL;
    p->shares = NULL;
    p->num_shares = p->cap_shares = 0; /* shares_free walks only what was copied */
    p->cap_extras = src->num_extras;
    p->slot_begin = rp_alloc(ctx, ((size_t)src->ep_size + 1) * sizeof(int32_t));
    p->phy2log = rp_alloc(ctx, cells * sizeof(int32_t));
    p->rep_begin = rp_alloc(ctx, index * sizeof(int32_t));
    p->rep_slots = rp_alloc(ctx, cells * sizeof(int32_t));
    p->extras = rp_alloc(ctx, (size_t)src->num_extras * sizeof *p->extras);
    p->shares = rp_calloc(ctx, (size_t)src->num_shares + 1, sizeof *p->shares);
    if (!p->slot_begin || !p->phy2log || !p->rep_begin || !p->rep_slots || !p->extras ||
        !p->shares) {
        st = rp_fail_nomem(err, "a plan copy");
        goto out;
    }
    p->cap_shares = src->num_shares + 1;
    if (src->mb_order) {
        p->mb_order = rp_alloc(ctx, lists * sizeof *p->mb_order);
        if (!p->mb_order) {
            st = rp_fail_nomem(err, "a plan copy");
            goto out;
        }
        memcpy(p->mb_order, src->mb_order, lists * sizeof *p->mb_order);
    }
    RP_CHECK_GOTO(packing_alloc(p, src->pack.num_seqs, (int64_t)total, &p->pack, err), st, out);
    memcpy(p->pack.begin, src->pack.begin, (lists + 1) * sizeof *p->pack.begin);
    copy_bytes(p->pack.seqs, src->pack.seqs, total * sizeof *p->pack.seqs);
    copy_bytes(p->pack.seq_rank, src->pack.seq_rank, n * sizeof *p->pack.seq_rank);
    copy_bytes(p->pack.seq_mb, src->pack.seq_mb, n * sizeof *p->pack.seq_mb);
    memcpy(p->slot_begin, src->slot_begin, ((size_t)src->ep_size + 1) * sizeof(int32_t));
    memcpy(p->phy2log, src->phy2log, cells * sizeof(int32_t));
    memcpy(p->rep_begin, src->rep_begin, index * sizeof(int32_t));
    memcpy(p->rep_slots, src->rep_slots, cells * sizeof(int32_t));
    copy_bytes(p->extras, src->extras, (size_t)src->num_extras * sizeof *p->extras);
    for (int32_t i = 0; i < src->num_shares; i++) {
        const share_set *s = &src->shares[i];
        double *values = rp_alloc(p->ctx, (size_t)s->count * sizeof(double));
        if (!values) {
            st = rp_fail_nomem(err, "a plan copy");
            goto out;
        }
        memcpy(values, s->shares, (size_t)s->count * sizeof(double));
        p->shares[i] = *s;
        p->shares[i].shares = values;
        p->num_shares = i + 1;
    }
out:
    if (st != RP_OK) {
        rp_plan_free(p);
        return st;
    }
    *out = p;
    return RP_OK;
}

rp_context *rp_plan_context(const rp_plan *plan) { return plan->ctx; }
int32_t rp_plan_num_gpus(const rp_plan *plan) { return plan->num_gpus; }
int32_t rp_plan_num_microbatches(const rp_plan *plan) { return plan->num_microbatches; }
int32_t rp_plan_ep_size(const rp_plan *plan) { return plan->ep_size; }
int32_t rp_plan_num_layers(const rp_plan *plan) { return plan->num_layers; }
int32_t rp_plan_num_experts(const rp_plan *plan) { return plan->num_experts; }

/* ---- packing --------------------------------------------------------------------- */

/* Record the first occurrence of every sequence, scanning lists in order. */
static void packing_index(const rp_plan *plan, packing *p)
{
    int32_t M = plan->num_microbatches;
    int64_t lists = (int64_t)plan->num_gpus * M;
    for (int32_t s = 0; s < p->num_seqs; s++) p->seq_rank[s] = p->seq_mb[s] = -1;
    for (int64_t i = lists - 1; i >= 0; i--) {
        for (int64_t k = p->begin[i + 1] - 1; k >= p->begin[i]; k--) {
            int32_t s = p->seqs[k];
            p->seq_rank[s] = (int32_t)(i / M);
            p->seq_mb[s] = (int32_t)(i % M);
        }
    }
}

rp_status rp_plan_set_packing(rp_plan *plan, int32_t num_seqs, const int32_t *seq_rank,
                              const int32_t *seq_mb, rp_error *err)
{
    if (num_seqs < 0) return rp_fail(err, RP_EINVAL, "plan: sequence count %d is negative", num_seqs);
    if (num_seqs > 0 && (!seq_rank || !seq_mb))
        return rp_fail(err, RP_EINVAL, "plan: ranks and microbatches of the sequences are required");
    int32_t G = plan->num_gpus, M = plan->num_microbatches;
    for (int32_t s = 0; s < num_seqs; s++) {
        if (seq_rank[s] < 0 || seq_rank[s] >= G)
            return rp_fail_seq(err, RP_EINVAL, s, "plan: sequence %d is assigned to rank %d, but there are %d ranks",
                            s, seq_rank[s], G);
        if (seq_mb[s] < 0 || seq_mb[s] >= M)
            return rp_fail_seq(err, RP_EINVAL, s,
                            "plan: sequence %d is assigned to microbatch %d, but there are %d microbatches",
                            s, seq_mb[s], M);
    }
    packing p;
    rp_status st = packing_alloc(plan, num_seqs, num_seqs, &p, err);
    if (st != RP_OK) return st;
    /* counting sort by list; ascending ids inside a list because s ascends */
    for (int32_t s = 0; s < num_seqs; s++) p.begin[(int64_t)seq_rank[s] * M + seq_mb[s] + 1]++;
    int64_t lists = (int64_t)G * M;
    for (int64_t i = 0; i < lists; i++) p.begin[i + 1] += p.begin[i];
    for (int32_t s = 0; s < num_seqs; s++) {
        int64_t i = (int64_t)seq_rank[s] * M + seq_mb[s];
        p.seqs[p.begin[i]++] = s;
        p.seq_rank[s] = seq_rank[s];
        p.seq_mb[s] = seq_mb[s];
    }
    for (int64_t i = lists; i > 0; i--) p.begin[i] = p.begin[i - 1];
    p.begin[0] = 0;
    packing_free(plan->ctx, &plan->pack);
    plan->pack = p;
    plan->has_packing = true;
    return RP_OK;
}

rp_status rp_plan_set_microbatches(rp_plan *plan, int32_t num_seqs, const int32_t *const *lists,
                                   const int32_t *counts, rp_error *err)
{
    if (num_seqs < 0) return rp_fail(err, RP_EINVAL, "plan: sequence count %d is negative", num_seqs);
    int32_t M = plan->num_microbatches;
    int64_t n_lists = (int64_t)plan->num_gpus * M, total = 0;
    if (!counts) return rp_fail(err, RP_EINVAL, "plan: microbatch sizes are required");
    for (int64_t i = 0; i < n_lists; i++) {
        int32_t rank = (int32_t)(i / M), mb = (int32_t)(i % M);
        if (counts[i] < 0)
            return rp_fail(err, RP_EINVAL, "plan: rank %d mb %d has a negative size %d", rank, mb, counts[i]);
        if (counts[i] > 0 && (!lists || !lists[i]))
            return rp_fail(err, RP_EINVAL, "plan: rank %d mb %d has %d sequences but no list", rank, mb,
                           counts[i]);
        for (int32_t k = 0; k < counts[i]; k++) {
            int32_t s = lists[i][k];
            if (s < 0 || s >= num_seqs)
                return rp_fail_seq(err, RP_EINVAL, s, "plan: rank %d mb %d position %d holds sequence %d, but there are %d sequences",
                                rank, mb, k, s, num_seqs);
        }
        total += counts[i];
        if (total > INT32_MAX)
            return rp_fail(err, RP_ERANGE, "plan: the microbatches hold more than 2^31-1 entries");
    }
    packing p;
    rp_status st = packing_alloc(plan, num_seqs, total, &p, err);
    if (st != RP_OK) return st;
    for (int64_t i = 0; i < n_lists; i++) {
        p.begin[i + 1] = p.begin[i] + counts[i];
        if (counts[i] > 0) memcpy(p.seqs + p.begin[i], lists[i], (size_t)counts[i] * sizeof(int32_t));
    }
    packing_index(plan, &p);
    packing_free(plan->ctx, &plan->pack);
    plan->pack = p;
    plan->has_packing = true;
    return RP_OK;
}

rp_status rp_plan_move_sequence(rp_plan *plan, int32_t seq, int32_t rank, int32_t mb, rp_error *err)
{
    if (!plan->has_packing) return rp_fail(err, RP_EINVAL, "plan: no packing to move sequence %d in", seq);
    packing *p = &plan->pack;
    int32_t M = plan->num_microbatches;
    if (seq < 0 || seq >= p->num_seqs)
        return rp_fail_seq(err, RP_EINVAL, seq, "plan: sequence %d does not exist (%d sequences)", seq, p->num_seqs);
    if (rank < 0 || rank >= plan->num_gpus || mb < 0 || mb >= M)
        return rp_fail_seq(err, RP_EINVAL, seq, "plan: rank %d mb %d does not exist (%d ranks, %d microbatches)", rank,
                        mb, plan->num_gpus, M);
    int64_t lists = (int64_t)plan->num_gpus * M;
    int64_t to = (int64_t)rank * M + mb;
    int64_t from, from_pos;
    if (p->seq_rank[seq] < 0) {
        /* not packed: append it to the last list first, then move it like any other */
        int64_t total = p->begin[lists];
        if (total >= INT32_MAX) return rp_fail(err, RP_ERANGE, "plan: the packing is full");
        int32_t *grown = rp_realloc(plan->ctx, p->seqs, ((size_t)total + 1) * sizeof *grown);
        if (!grown) return rp_fail_nomem(err, "a packing");
        p->seqs = grown;
        p->seqs[total] = seq;
        p->begin[lists] = total + 1;
        from = lists - 1;
        from_pos = total;
    } else {
        from = (int64_t)p->seq_rank[seq] * M + p->seq_mb[seq];
        from_pos = p->begin[from];
        while (p->seqs[from_pos] != seq) from_pos++;
    }
    if (from <= to) {
        /* shift left what lies between, then `to` ends one earlier than it did */
        int64_t dst = p->begin[to + 1] - 1;
        memmove(p->seqs + from_pos, p->seqs + from_pos + 1, (size_t)(dst - from_pos) * sizeof *p->seqs);
        p->seqs[dst] = seq;
        for (int64_t i = from + 1; i <= to; i++) p->begin[i]--;
    } else {
        int64_t dst = p->begin[to + 1];
        memmove(p->seqs + dst + 1, p->seqs + dst, (size_t)(from_pos - dst) * sizeof *p->seqs);
        p->seqs[dst] = seq;
        for (int64_t i = to + 1; i <= from; i++) p->begin[i]++;
    }
    /* The first occurrence is now (rank, mb) unless another copy of a repeated
     * sequence sits in an earlier list. */
    p->seq_rank[seq] = rank;
    p->seq_mb[seq] = mb;
    for (int64_t k = 0; k < p->begin[to]; k++)
        if (p->seqs[k] == seq) {
            int64_t i = 0;
            while (p->begin[i + 1] <= k) i++;
            p->seq_rank[seq] = (int32_t)(i / M);
            p->seq_mb[seq] = (int32_t)(i % M);
            break;
        }
    return RP_OK;
}

bool rp_plan_has_packing(const rp_plan *plan) { return plan->has_packing; }
int32_t rp_plan_num_seqs(const rp_plan *plan) { return plan->pack.num_seqs; }

const int32_t *rp_plan_microbatch(const rp_plan *plan, int32_t rank, int32_t mb, int32_t *count)
{
    if (rank < 0 || rank >= plan->num_gpus || mb < 0 || mb >= plan->num_microbatches) {
        if (count) *count = 0;
        return NULL;
    }
    int64_t i = (int64_t)rank * plan->num_microbatches + mb;
    if (count) *count = (int32_t)(plan->pack.begin[i + 1] - plan->pack.begin[i]);
    return plan->pack.seqs + plan->pack.begin[i];
}

int32_t rp_plan_seq_rank(const rp_plan *plan, int32_t seq)
{
    return seq >= 0 && seq < plan->pack.num_seqs ? plan->pack.seq_rank[seq] : -1;
}

int32_t rp_plan_seq_microbatch(const rp_plan *plan, int32_t seq)
{
    return seq >= 0 && seq < plan->pack.num_seqs ? plan->pack.seq_mb[seq] : -1;
}

/* ---- placement ------------------------------------------------------------------- */

bool rp_plan_has_placement(const rp_plan *plan) { return plan->has_placement; }
int32_t rp_plan_total_slots(const rp_plan *plan) { return plan->total_slots; }
const int32_t *rp_plan_slot_begin(const rp_plan *plan) { return plan->slot_begin; }

const int32_t *rp_plan_phy2log(const rp_plan *plan, int32_t layer)
{
    if (layer < 0 || layer >= plan->num_layers) return NULL;
    return plan->phy2log + (size_t)layer * plan->total_slots;
}

static rp_status check_layer(const rp_plan *plan, int32_t layer, rp_error *err)
{
    if (layer < 0 || layer >= plan->num_layers)
        return rp_fail(err, RP_EINVAL, "plan: layer %d does not exist (%d layers)", layer, plan->num_layers);
    return RP_OK;
}

static rp_status check_expert_ids(const rp_plan *plan, int32_t layer, const int32_t *experts,
                                  int32_t count, int32_t first_slot, rp_error *err)
{
    for (int32_t k = 0; k < count; k++) {
        if (experts[k] < -1 || experts[k] >= plan->num_experts) {
            rp_fail(err, RP_EINVAL, "plan: layer %d slot %d holds expert %d, but the model has %d experts",
                    layer, first_slot + k, experts[k], plan->num_experts);
            if (err) err->expert = experts[k];
            return RP_EINVAL;
        }
    }
    return RP_OK;
}

rp_status rp_plan_set_phy2log(rp_plan *plan, int32_t layer, const int32_t *phy2log, rp_error *err)
{
    rp_status st = check_layer(plan, layer, err);
    if (st != RP_OK) return st;
    if (!phy2log && plan->total_slots > 0) return rp_fail(err, RP_EINVAL, "plan: phy2log is required");
    st = check_expert_ids(plan, layer, phy2log, plan->total_slots, 0, err);
    if (st != RP_OK) return st;
    if (plan->total_slots > 0)
        memcpy(plan->phy2log + (size_t)layer * plan->total_slots, phy2log,
               (size_t)plan->total_slots * sizeof(int32_t));
    index_layer(plan, layer);
    plan->has_placement = true;
    return RP_OK;
}

rp_status rp_plan_set_gpu_experts(rp_plan *plan, int32_t layer, int32_t ep_rank,
                                  const int32_t *experts, int32_t count, rp_error *err)
{
    rp_status st = check_layer(plan, layer, err);
    if (st != RP_OK) return st;
    if (ep_rank < 0 || ep_rank >= plan->ep_size)
        return rp_fail(err, RP_EINVAL, "plan: EP rank %d does not exist (EP size %d)", ep_rank, plan->ep_size);
    int32_t first = plan->slot_begin[ep_rank];
    int32_t slots = plan->slot_begin[ep_rank + 1] - first;
    if (count < 0 || count > slots)
        return rp_fail(err, RP_EINVAL, "plan: layer %d EP rank %d is given %d experts, but it has %d slots",
                       layer, ep_rank, count, slots);
    if (count > 0 && !experts) return rp_fail(err, RP_EINVAL, "plan: the experts are required");
    st = check_expert_ids(plan, layer, experts, count, first, err);
    if (st != RP_OK) return st;
    int32_t *p2l = plan->phy2log + (size_t)layer * plan->total_slots + first;
    for (int32_t k = 0; k < slots; k++) p2l[k] = k < count ? experts[k] : -1;
    index_layer(plan, layer);
    plan->has_placement = true;
    return RP_OK;
}

int32_t rp_plan_logcnt(const rp_plan *plan, int32_t layer, int32_t *logcnt)
{
    if (layer < 0 || layer >= plan->num_layers) return -1;
    const int32_t *begin = plan->rep_begin + (size_t)layer * (plan->num_experts + 1);
    int32_t largest = 0;
    for (int32_t e = 0; e < plan->num_experts; e++) {
        int32_t c = begin[e + 1] - begin[e];
        if (logcnt) logcnt[e] = c;
        if (c > largest) largest = c;
    }
    return largest;
}

/* ---- levers ---------------------------------------------------------------------- */

static rp_status check_key(const rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                           rp_error *err)
{
    if (mb < 0 || mb >= plan->num_microbatches)
        return rp_fail(err, RP_EINVAL, "plan: microbatch %d does not exist (%d microbatches)", mb,
                       plan->num_microbatches);
    rp_status st = check_layer(plan, layer, err);
    if (st != RP_OK) return st;
    if (expert < 0 || expert >= plan->num_experts) {
        rp_fail(err, RP_EINVAL, "plan: expert %d does not exist (%d experts)", expert, plan->num_experts);
        if (err) err->expert = expert;
        return RP_EINVAL;
    }
    return RP_OK;
}

rp_status rp_plan_add_extra_replica(rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                                    int32_t ep_rank, rp_error *err)
{
    rp_status st = check_key(plan, mb, layer, expert, err);
    if (st != RP_OK) return st;
    if (ep_rank < 0 || ep_rank >= plan->ep_size)
        return rp_fail(err, RP_EINVAL, "plan: EP rank %d does not exist (EP size %d)", ep_rank, plan->ep_size);
    if (plan->num_extras == plan->cap_extras) {
        if (plan->cap_extras > INT32_MAX / 2) return rp_fail(err, RP_ERANGE, "plan: too many extra replicas");
        int32_t cap = plan->cap_extras ? plan->cap_extras * 2 : 8;
        extra_replica *grown = rp_realloc(plan->ctx, plan->extras, (size_t)cap * sizeof *grown);
        if (!grown) return rp_fail_nomem(err, "extra replicas");
        plan->extras = grown;
        plan->cap_extras = cap;
    }
    /* after every entry with a key <= this one: sorted, insertion order kept per key */
    int32_t at = plan->num_extras;
    while (at > 0) {
        const extra_replica *x = &plan->extras[at - 1];
        if (key_cmp(x->mb, x->layer, x->expert, mb, layer, expert) <= 0) break;
        at--;
    }
    memmove(plan->extras + at + 1, plan->extras + at, (size_t)(plan->num_extras - at) * sizeof *plan->extras);
    plan->extras[at] = (extra_replica){mb, layer, expert, ep_rank};
    plan->num_extras++;
    return RP_OK;
}

/* Index of the share set with this key, or -(insertion point) - 1. */
static int32_t find_shares(const rp_plan *plan, int32_t mb, int32_t layer, int32_t expert)
{
    int32_t lo = 0, hi = plan->num_shares;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        const share_set *s = &plan->shares[mid];
        int c = key_cmp(s->mb, s->layer, s->expert, mb, layer, expert);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -lo - 1;
}

rp_status rp_plan_set_shares(rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                             const double *shares, int32_t count, rp_error *err)
{
    rp_status st = check_key(plan, mb, layer, expert, err);
    if (st != RP_OK) return st;
    if (count < 0) return rp_fail(err, RP_EINVAL, "plan: share count %d is negative", count);
    if (count > 0 && !shares) return rp_fail(err, RP_EINVAL, "plan: the shares are required");
    double *values = rp_alloc(plan->ctx, (size_t)count * sizeof(double));
    if (!values) return rp_fail_nomem(err, "shares");
    if (count > 0) memcpy(values, shares, (size_t)count * sizeof(double));
    int32_t at = find_shares(plan, mb, layer, expert);
    if (at >= 0) {
        rp_free(plan->ctx, plan->shares[at].shares);
        plan->shares[at].shares = values;
        plan->shares[at].count = count;
        return RP_OK;
    }
    at = -at - 1;
    if (plan->num_shares == plan->cap_shares) {
        if (plan->cap_shares > INT32_MAX / 2) {
            rp_free(plan->ctx, values);
            return rp_fail(err, RP_ERANGE, "plan: too many share sets");
        }
        int32_t cap = plan->cap_shares ? plan->cap_shares * 2 : 8;
        share_set *grown = rp_realloc(plan->ctx, plan->shares, (size_t)cap * sizeof *grown);
        if (!grown) {
            rp_free(plan->ctx, values);
            return rp_fail_nomem(err, "shares");
        }
        plan->shares = grown;
        plan->cap_shares = cap;
    }
    memmove(plan->shares + at + 1, plan->shares + at, (size_t)(plan->num_shares - at) * sizeof *plan->shares);
    plan->shares[at] = (share_set){mb, layer, expert, count, values};
    plan->num_shares++;
    return RP_OK;
}

rp_status rp_plan_set_balancing(rp_plan *plan, rp_balancing balancing, rp_error *err)
{
    if (!plan) return rp_fail(err, RP_EINVAL, "plan: no plan");
    if (!rp_balancing_name(balancing))
        return rp_fail(err, RP_EINVAL, "plan: per-forward balancing %d is not one of none (0), virtual_experts (1)",
                       (int)balancing);
    plan->balancing = balancing;
    return RP_OK;
}

rp_balancing rp_plan_balancing(const rp_plan *plan) { return plan ? plan->balancing : RP_BALANCING_NONE; }

/* ---- microbatch order ------------------------------------------------------------ */

rp_status rp_plan_set_microbatch_order(rp_plan *plan, int32_t rank, const int32_t *order, rp_error *err)
{
    if (!plan) return rp_fail(err, RP_EINVAL, "plan: no plan");
    const int32_t G = plan->num_gpus, M = plan->num_microbatches;
    if (rank < 0 || rank >= G)
        return rp_fail(err, RP_EINVAL, "plan: microbatch order for rank %d, but the plan has %d ranks (0 to %d)", rank,
                       G, G - 1);
    if (!order && !plan->mb_order) return RP_OK;
    /* a permutation of 0 .. M - 1: every value in range, none twice (first position kept
     * in `seen` to name both) */
    int32_t *seen = NULL, small[4096];
    if (order) {
        /* on the stack for any count a pipeline runs, so that setting the orders of a plan
         * that has one already cannot fail for memory */
        seen = M <= 4096 ? small : rp_alloc(plan->ctx, (size_t)M * sizeof *seen);
        if (!seen) return rp_fail_nomem(err, "checking a microbatch order");
        for (int32_t m = 0; m < M; m++) seen[m] = -1;
        for (int32_t k = 0; k < M; k++) {
            int32_t m = order[k];
            rp_status st = RP_OK;
            if (m < 0 || m >= M)
                st = rp_fail(err, RP_EINVAL,
                             "plan: rank %d's microbatch order has %d at position %d, but the plan has %d microbatches "
                             "(0 to %d)", rank, m, k, M, M - 1);
            else if (seen[m] >= 0)
                st = rp_fail(err, RP_EINVAL,
                             "plan: rank %d's microbatch order lists microbatch %d twice (positions %d and %d): it "
                             "must be a permutation of 0 to %d", rank, m, seen[m], k, M - 1);
            if (st != RP_OK) {
                if (seen != small) rp_free(plan->ctx, seen);
                return st;
            }
            seen[m] = k;
        }
        if (seen != small) rp_free(plan->ctx, seen);
    }
    const size_t lists = (size_t)G * M;
    if (!plan->mb_order) {
        plan->mb_order = rp_alloc(plan->ctx, lists * sizeof *plan->mb_order);
        if (!plan->mb_order) return rp_fail_nomem(err, "a microbatch order");
        for (size_t i = 0; i < lists; i++) plan->mb_order[i] = (int32_t)(i % (size_t)M);
    }
    for (int32_t k = 0; k < M; k++) plan->mb_order[(size_t)rank * M + k] = order ? order[k] : k;
    /* back to no order at all when every rank runs the identity */
    for (size_t i = 0; i < lists; i++)
        if (plan->mb_order[i] != (int32_t)(i % (size_t)M)) return RP_OK;
    rp_free(plan->ctx, plan->mb_order);
    plan->mb_order = NULL;
    return RP_OK;
}

const int32_t *rp_plan_microbatch_order(const rp_plan *plan, int32_t rank)
{
    if (!plan || !plan->mb_order || rank < 0 || rank >= plan->num_gpus) return NULL;
    return plan->mb_order + (size_t)rank * plan->num_microbatches;
}

int32_t rp_plan_microbatch_at(const rp_plan *plan, int32_t rank, int32_t position)
{
    if (!plan || rank < 0 || rank >= plan->num_gpus || position < 0 || position >= plan->num_microbatches) return -1;
    return plan->mb_order ? plan->mb_order[(size_t)rank * plan->num_microbatches + position] : position;
}

bool rp_plan_has_microbatch_order(const rp_plan *plan) { return plan && plan->mb_order; }

const char *rp_balancing_name(rp_balancing balancing)
{
    switch (balancing) {
    case RP_BALANCING_NONE: return "none";
    case RP_BALANCING_VIRTUAL_EXPERTS: return "virtual_experts";
    }
    return NULL;
}

void rp_plan_clear_levers(rp_plan *plan)
{
    rp_free(plan->ctx, plan->extras);
    plan->extras = NULL;
    plan->num_extras = plan->cap_extras = 0;
    shares_free(plan);
}

/* Ascending slot order of the placement's replicas, then the extras in order. */
int32_t rp_plan_replicas(const rp_plan *plan, int32_t mb, int32_t layer, int32_t expert,
                         int32_t *ep_ranks, double *shares, int32_t cap)
{
    if (check_key(plan, mb, layer, expert, NULL) != RP_OK) return 0;
    const double *explicit_shares = NULL;
    int32_t num_explicit = 0;
    int32_t at = find_shares(plan, mb, layer, expert);
    if (at >= 0) {
        explicit_shares = plan->shares[at].shares;
        num_explicit = plan->shares[at].count;
    }
    int32_t n = 0;
    const int32_t *begin = plan->rep_begin + (size_t)layer * (plan->num_experts + 1);
    const int32_t *slots = plan->rep_slots + (size_t)layer * plan->total_slots;
    int32_t rank = 0;
    for (int32_t k = begin[expert]; k < begin[expert + 1]; k++, n++) {
        if (n >= cap) continue;
        while (slots[k] >= plan->slot_begin[rank + 1]) rank++;
        if (ep_ranks) ep_ranks[n] = rank;
        if (shares) shares[n] = n < num_explicit ? explicit_shares[n] : -1.0;
    }
    /* extras of this key: binary search for the first, then walk */
    int32_t lo = 0, hi = plan->num_extras;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        const extra_replica *x = &plan->extras[mid];
        if (key_cmp(x->mb, x->layer, x->expert, mb, layer, expert) < 0) lo = mid + 1;
        else hi = mid;
    }
    for (int32_t i = lo; i < plan->num_extras; i++, n++) {
        const extra_replica *x = &plan->extras[i];
        if (key_cmp(x->mb, x->layer, x->expert, mb, layer, expert) != 0) break;
        if (n >= cap) continue;
        if (ep_ranks) ep_ranks[n] = x->ep_rank;
        if (shares) shares[n] = n < num_explicit ? explicit_shares[n] : -1.0;
    }
    return n;
}

int32_t rp_plan_num_extra_replicas(const rp_plan *plan) { return plan->num_extras; }

void rp_plan_extra_replica(const rp_plan *plan, int32_t i, int32_t *mb, int32_t *layer,
                           int32_t *expert, int32_t *ep_rank)
{
    extra_replica x = {-1, -1, -1, -1};
    if (i >= 0 && i < plan->num_extras) x = plan->extras[i];
    if (mb) *mb = x.mb;
    if (layer) *layer = x.layer;
    if (expert) *expert = x.expert;
    if (ep_rank) *ep_rank = x.ep_rank;
}

int32_t rp_plan_num_share_sets(const rp_plan *plan) { return plan->num_shares; }

const double *rp_plan_share_set(const rp_plan *plan, int32_t i, int32_t *mb, int32_t *layer,
                                int32_t *expert, int32_t *count)
{
    share_set s = {-1, -1, -1, 0, NULL};
    if (i >= 0 && i < plan->num_shares) s = plan->shares[i];
    if (mb) *mb = s.mb;
    if (layer) *layer = s.layer;
    if (expert) *expert = s.expert;
    if (count) *count = s.count;
    return s.shares;
}

/* ---- hash -----------------------------------------------------------------------
 * Canonical serialisation, every value little-endian: the tag "rp-plan1", shape
 * (G, M, ep_size, L, E, S, slot_begin), packing (flag, num_seqs, each list's length and
 * ids, lists in rank-major order), placement (flag, phy2log of each layer), extra
 * replicas (count, then mb, layer, expert, ep_rank each) and share sets (count, then
 * mb, layer, expert, count and the IEEE-754 bits of each share). */

typedef struct hasher {
    rp_hash_state st;
    unsigned char buf[512];
    size_t n;
} hasher;

static void hash_flush(hasher *h)
{
    rp_hash_update(&h->st, h->buf, h->n);
    h->n = 0;
}

static void hash_u64(hasher *h, uint64_t v)
{
    if (h->n + 8 > sizeof h->buf) hash_flush(h);
    for (int i = 0; i < 8; i++) h->buf[h->n++] = (unsigned char)(v >> (8 * i));
}

static void hash_i32(hasher *h, int32_t v)
{
    if (h->n + 4 > sizeof h->buf) hash_flush(h);
    uint32_t u = (uint32_t)v;
    for (int i = 0; i < 4; i++) h->buf[h->n++] = (unsigned char)(u >> (8 * i));
}

static bool same_ints(const int32_t *a, const int32_t *b, size_t n)
{
    return n == 0 || memcmp(a, b, n * sizeof *a) == 0;
}

/* rp_plan_equal, the placement rows compared only with `rows` */
static bool equal_parts(const rp_plan *a, const rp_plan *b, bool rows)
{
    if (a == b) return true;
    if (!a || !b) return false;
    if (a->num_gpus != b->num_gpus || a->num_microbatches != b->num_microbatches || a->ep_size != b->ep_size ||
        a->num_layers != b->num_layers || a->num_experts != b->num_experts || a->total_slots != b->total_slots ||
        !same_ints(a->slot_begin, b->slot_begin, (size_t)a->ep_size + 1))
        return false;
    if (a->has_packing != b->has_packing || a->has_placement != b->has_placement || a->balancing != b->balancing ||
        !a->mb_order != !b->mb_order || a->num_extras != b->num_extras || a->num_shares != b->num_shares)
        return false;
    const size_t lists = (size_t)a->num_gpus * a->num_microbatches;
    if (a->has_packing) {
        const packing *p = &a->pack, *q = &b->pack;
        if (p->num_seqs != q->num_seqs || memcmp(p->begin, q->begin, (lists + 1) * sizeof *p->begin) != 0 ||
            !same_ints(p->seqs, q->seqs, (size_t)p->begin[lists]))
            return false;
    }
    if (rows && a->has_placement && !same_ints(a->phy2log, b->phy2log, (size_t)a->num_layers * a->total_slots))
        return false;
    if (a->mb_order && !same_ints(a->mb_order, b->mb_order, lists)) return false;
    for (int32_t i = 0; i < a->num_extras; i++) {
        const extra_replica *x = &a->extras[i], *y = &b->extras[i];
        if (x->mb != y->mb || x->layer != y->layer || x->expert != y->expert || x->ep_rank != y->ep_rank) return false;
    }
    for (int32_t i = 0; i < a->num_shares; i++) {
        const share_set *x = &a->shares[i], *y = &b->shares[i];
        /* bit for bit, as rp_plan_hash hashes them */
        if (x->mb != y->mb || x->layer != y->layer || x->expert != y->expert || x->count != y->count ||
            memcmp(x->shares, y->shares, (size_t)x->count * sizeof *x->shares) != 0)
            return false;
    }
    return true;
}

bool rp_plan_equal(const rp_plan *a, const rp_plan *b) { return equal_parts(a, b, true); }

bool plan_equal_but_rows(const rp_plan *a, const rp_plan *b) { return equal_parts(a, b, false); }

uint64_t rp_plan_hash(const rp_plan *plan)
{
    hasher h;
    rp_hash_init(&h.st, 0);
    h.n = 0;
    static const char tag[8] = {'r', 'p', '-', 'p', 'l', 'a', 'n', '1'};
    memcpy(h.buf, tag, sizeof tag);
    h.n = sizeof tag;
    hash_i32(&h, plan->num_gpus);
    hash_i32(&h, plan->num_microbatches);
    hash_i32(&h, plan->ep_size);
    hash_i32(&h, plan->num_layers);
    hash_i32(&h, plan->num_experts);
    hash_i32(&h, plan->total_slots);
    for (int32_t j = 0; j <= plan->ep_size; j++) hash_i32(&h, plan->slot_begin[j]);

    hash_i32(&h, plan->has_packing);
    if (plan->has_packing) {
        const packing *p = &plan->pack;
        int64_t lists = (int64_t)plan->num_gpus * plan->num_microbatches;
        hash_i32(&h, p->num_seqs);
        for (int64_t i = 0; i < lists; i++) {
            hash_i32(&h, (int32_t)(p->begin[i + 1] - p->begin[i]));
            for (int64_t k = p->begin[i]; k < p->begin[i + 1]; k++) hash_i32(&h, p->seqs[k]);
        }
    }
    hash_i32(&h, plan->has_placement);
    if (plan->has_placement) {
        size_t cells = (size_t)plan->num_layers * plan->total_slots;
        for (size_t i = 0; i < cells; i++) hash_i32(&h, plan->phy2log[i]);
    }
    /* only when set, so the hashes of plans without it stay what they were */
    if (plan->balancing != RP_BALANCING_NONE) hash_i32(&h, 0x62616c00 | (int32_t)plan->balancing);
    if (plan->mb_order) {
        hash_i32(&h, 0x6f726400); /* "ord" */
        for (size_t i = 0; i < (size_t)plan->num_gpus * plan->num_microbatches; i++) hash_i32(&h, plan->mb_order[i]);
    }
    hash_i32(&h, plan->num_extras);
    for (int32_t i = 0; i < plan->num_extras; i++) {
        const extra_replica *x = &plan->extras[i];
        hash_i32(&h, x->mb);
        hash_i32(&h, x->layer);
        hash_i32(&h, x->expert);
        hash_i32(&h, x->ep_rank);
    }
    hash_i32(&h, plan->num_shares);
    for (int32_t i = 0; i < plan->num_shares; i++) {
        const share_set *s = &plan->shares[i];
        hash_i32(&h, s->mb);
        hash_i32(&h, s->layer);
        hash_i32(&h, s->expert);
        hash_i32(&h, s->count);
        for (int32_t k = 0; k < s->count; k++) {
            uint64_t bits;
            memcpy(&bits, &s->shares[k], sizeof bits);
            hash_u64(&h, bits);
        }
    }
    hash_flush(&h);
    return rp_hash_final(&h.st);
}

/* Experts that arrive on an EP rank that did not hold them (per layer, any EP group). */
int32_t plan_experts_moved_into(const rp_plan *from, const rp_plan *to, uint8_t *held, int32_t E)
{
    int32_t moved = 0, Ly = rp_plan_num_layers(to), ep = rp_plan_ep_size(to);
    const int32_t *begin = rp_plan_slot_begin(to);
    for (int32_t l = 0; l < Ly; l++) {
        const int32_t *a = rp_plan_phy2log(from, l), *b = rp_plan_phy2log(to, l);
        for (int32_t j = 0; j < ep; j++) {
            memset(held, 0, (size_t)E);
            for (int32_t s = begin[j]; s < begin[j + 1]; s++)
                if (a[s] >= 0) held[a[s]] = 1;
            for (int32_t s = begin[j]; s < begin[j + 1]; s++)
                if (b[s] >= 0 && !held[b[s]]) {
                    held[b[s]] = 1;
                    moved++;
                }
        }
    }
    return moved;
}

int32_t plan_experts_moved(rp_context *ctx, const rp_plan *from, const rp_plan *to)
{
    if (!from || !to || !rp_plan_has_placement(from) || !rp_plan_has_placement(to)) return 0;
    int32_t E = rp_plan_num_experts(to);
    uint8_t *held = rp_alloc(ctx, (size_t)E + 1);
    if (!held) return -1;
    int32_t moved = plan_experts_moved_into(from, to, held, E);
    rp_free(ctx, held);
    return moved;
}
