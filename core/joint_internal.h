/* Private state of the joint planner, shared by joint.c (the flow, migration, fallbacks),
 * joint_pack.c (packing), joint_hist.c (group histograms), joint_balance.c (sequence
 * trades between groups), joint_place.c (placement), joint_levers.c (shares and
 * extra replicas) and joint_fill.c (the shares' water level). Not installed. */
#ifndef RP_JOINT_INTERNAL_H
#define RP_JOINT_INTERNAL_H

#include "internal.h"
#include "routepack/joint.h"

/* One layer's placement in one EP group: EP rank j holds slots [slot_begin[j],
 * slot_begin[j + 1]) and slot p holds phy2log[p] (-1: empty). The replicas of expert e
 * are rep_rank[rep_off[e] .. rep_off[e + 1]), ascending EP rank (= ascending slot,
 * since slots are rank-major): the order the plan's shares refer to. */
typedef struct joint_layer {
    int32_t *phy2log;  /* [S] */
    int32_t *rep_off;  /* [E + 1] */
    int32_t *rep_rank; /* [S] */
} joint_layer;

typedef struct joint {
    rp_context *ctx;
    const rp_config *cfg;
    const rp_batch *batch;
    const rp_stats *stats;
    rp_cost *cost;
    const rp_joint_params *par;
    /* the placement in use ran under the per-forward balancer: keeping a layer of it
     * without the balancer is no plan anyone runs, so placement re-places every layer and
     * the candidates' scores (step + migration) decide (issue 35) */
    bool previous_balanced;
    int32_t N, G, ep, Q, gpn, L, E, K, M, S;
    const int32_t *slot_begin;  /* [ep + 1] slots of each EP rank (a plan's offsets) */
    const double *speed;        /* [G] */
    double rank_speed_min;      /* slowest GPU */
    double speed_max;           /* fastest GPU */
    bool uniform_speed;
    bool unit_speed;            /* every GPU at speed 1: joint_per_speed divides by nothing */
    int64_t cap;                /* token cap of one cell, the activation cap included */
    /* Pipeline packings (joint.c, pack_pipeline): the tokens of one (microbatch, EP group)
     * and the sequences of one cell the packing fills to while a cell within them is
     * open; 0: no such limit. */
    int64_t pack_budget;
    int32_t pack_cell_quota;

    /* Surrogate unit costs, forward and backward (step seconds), each term at its own
     * backward multiplier as the cost model has them. */
    double t_choice;            /* expert work of one token-choice at full efficiency */
    double d_choice;            /* sending one token-choice to another GPU of the group, de-duplicated
                                   as the config says (for an even spread of a token's choices) */
    bool overlap;               /* execution.overlap layer: a layer costs max(compute, communication) */
    /* execution.sync group with several EP groups: the surrogates take the step as the
     * slowest group's own sum over (microbatch, layer), not the sum of maxima over all
     * groups (docs/routepack-policy.md, "The configured structure"). */
    bool group_form;
    /* Every plan runs under Megatron's per-forward balancer and the executor charges its
     * equal-token padding (execution.per_forward_balancing virtual_experts, a profile with
     * balancer_charges): a group's experts then run its fullest cell's tokens on every
     * rank, so the packers price the expert work by the largest cell's tokens (x ep), not
     * by the group's tokens over its ranks (joint_pack.c, joint_pack_group.c). */
    bool vexp_pad;
    /* Per microbatch, the token-choices the busiest GPU sends (its tokens x top-k): the
     * dispatch floor that rank loads compete with (joint_mb_value). [M]; send_mq the same
     * per (microbatch, EP group) [M * Q], for the group form. */
    double *send_max, *send_mq;
    /* Dense phase of one layer (attention, projections, token-linear work and the fixed
     * cost, forward and backward, per GPU speed, step seconds) of the slowest GPU of each
     * microbatch [M] and (microbatch, EP group) [M * Q]. NULL under global sync without
     * overlap, where it is the same constant for every placement. */
    double *dense_max, *dense_mq;
    double fixed_s;             /* the fixed cost of one (microbatch, layer), forward and backward */
    double x_mult;              /* 1 + backward.experts: forward expert seconds to step seconds */
    double copy_s;              /* weights of one extra replica over NVLink */
    double nv_lat;
    double copy_net_s, net_lat; /* the same over the network */
    bool extras_once;           /* the executor fetches a step's extras once (routepack_torch):
                                   an extra held in an earlier microbatch of the step is free,
                                   a new one costs its fetch and its gradient's exchange once */
    double move_nv_s, move_net_s; /* migrating one expert (weights and optimizer state) */
    double grad_nv_s, grad_net_s; /* one replica's gradient all-reduce, step seconds */
    /* Expert slot time t(n) from the cost model (joint_slot_time): a table at integer
     * loads below t_table_n, t_slope per token-choice beyond, never below t_mem. */
    double *t_table;            /* [t_table_n + 1] */
    int32_t t_table_n;
    double t_slope, t_mem;

    /* The packing: cell (g, m) = g * M + m. */
    int32_t *seq_gpu, *seq_mb;  /* [N] */
    /* Token-choices per (microbatch, EP group): grp_hist[((m * Q + q) * L + l) * E + e]. */
    int64_t *grp_hist;
    /* The placement being built, one per layer. */
    joint_layer *layers;        /* [L] */
    int32_t *slot_rank;         /* [S] EP rank of each slot */
    const int32_t *node_of_rank; /* [ep] node of EP rank j (GPU j of group 0) */
} joint;

/* x / speed of GPU (group q, EP rank j). With every GPU at speed 1 the quotient is x
 * itself, bit for bit (IEEE division by 1 is exact), so the hot loops skip the division
 * (a divsd costs several cycles where the other work is one add). */
static inline double joint_per_speed(const joint *jt, double x, int32_t q, int32_t j)
{
    return jt->unit_speed ? x : x / jt->speed[q * jt->ep + j];
}

/* Surrogate time (forward and backward) of one (microbatch, layer) whose busiest rank
 * receives `load` token-choices (per unit speed): its expert work, and dispatch and
 * combine, which wait for the busier of the largest send and the largest receive; with
 * per-layer overlap, the longer of the two. */
static inline double joint_mb_value(const joint *jt, int32_t m, double load)
{
    double send = jt->send_max ? jt->send_max[m] : 0.0;
    double dense = jt->dense_max ? jt->dense_max[m] : 0.0;
    double compute = dense + jt->t_choice * load, comm = 2.0 * jt->d_choice * (load > send ? load : send);
    if (jt->overlap) return compute > comm ? compute : comm;
    return compute + comm;
}

/* The same for EP group q alone (its dense phase, its busiest sender): a term of the
 * group's own sum, which the group form of the surrogates maximises over groups. */
static inline double joint_mq_value(const joint *jt, int32_t m, int32_t q, double load)
{
    const size_t i = (size_t)m * jt->Q + q;
    double send = jt->send_mq ? jt->send_mq[i] : 0.0;
    double dense = jt->dense_mq ? jt->dense_mq[i] : 0.0;
    double compute = dense + jt->t_choice * load, comm = 2.0 * jt->d_choice * (load > send ? load : send);
    if (jt->overlap) return compute > comm ? compute : comm;
    return compute + comm;
}

static inline const int64_t *grp_row(const joint *jt, int32_t m, int32_t q, int32_t l)
{
    return jt->grp_hist + (((size_t)m * jt->Q + q) * jt->L + l) * jt->E;
}

/* joint_pack.c: sequences into (rank, microbatch) cells, M microbatches; RP_ERANGE when
 * a sequence fits in no cell (the caller may try more microbatches). */
/* The surrogate's communication unit costs: dispatch per token-choice, replica copy and
 * gradient reduction, at the DP rank's bandwidth (TP x CP GPUs' links) as the cost model
 * prices them. Needs jt->cfg, ep, gpn and K; sets d_choice, copy_s, nv_lat, grad_*_s. */
void joint_comm_costs(joint *jt);
rp_status joint_pack(joint *jt, int32_t M, rp_error *err);
/* joint_pack_group.c: the same under the group form (jt->group_form): each EP group's own
 * sum over microbatches balanced, the slowest group's minimised. */
rp_status joint_pack_group(joint *jt, int32_t M, rp_error *err);
/* What both packers set up before their greedy fill (joint_pack.c): per sequence its
 * tokens (len) and dense work a(L) (attn, speed 1), the sequences longest first (order),
 * the prompt ids (prompt, when prompt_spread > 0) and the prompt counts per (sequence's
 * prompt, microbatch, EP group) (pcount, NULL when spreading is off or the table too
 * large), the sequences per (rank, mini-batch) so far (rank_count[joint_pack_unit], zero;
 * KB = trainer.mini_batches, Mk = M / KB microbatches a mini-batch) and the most one may
 * take (rank_quota: N / G / KB under trainer.equal_sequences_per_rank, verl splitting a
 * rank's chunk into mini-batches by count; else INT32_MAX), and the
 * mean cell's dense work per speed (a_ref) and tokens (t_ref) for the tie-break. */
typedef struct joint_pack_prep {
    double *len, *attn;
    int32_t *order, *prompt, *pcount, *rank_count;
    int32_t rank_quota;
    int32_t M, KB, Mk; /* microbatches, mini-batches, microbatches of one */
    double a_ref, t_ref;
    /* trainer.nonempty_microbatches (else NULL): sequences per cell [G * M], empty cells
     * per (rank, mini-batch) [G * KB] and in all; joint_pack_open says where the next
     * sequence may go */
    int32_t *cell_count, *empty_rank;
    int64_t empty;
    int32_t *cell_seqs; /* sequences per cell [G * M] under jt->pack_cell_quota, else NULL */
} joint_pack_prep;
/* RP_ERANGE naming the sequence when one is longer than the cap; joint_pack_prep_free
 * whatever it returns. */
rp_status joint_pack_prepare(joint *jt, int32_t M, joint_pack_prep *p, rp_error *err);
void joint_pack_prep_free(const joint *jt, joint_pack_prep *p);
/* trainer.nonempty_microbatches as a packing rule: a sequence placed while `left`
 * sequences (itself included) are still to place may go to an empty cell, or to a
 * non-empty one only while enough sequences remain for every empty cell (under
 * trainer.equal_sequences_per_rank: enough of rank g's quota for its empty cells). So
 * the greedy fills as it would until the shortest sequences are needed, and then puts
 * them where the surrogate likes them best among the empty cells; no cell is left empty.
 * Without the key: whether the cell's (rank, mini-batch) is below its quota. */
/* The (rank, mini-batch) of cell c = g * M + m of rank g: rank_count's and empty_rank's
 * index (g with one mini-batch). */
static inline size_t joint_pack_unit(const joint_pack_prep *p, int32_t g, size_t c)
{
    return (size_t)g * p->KB + (size_t)(c % (size_t)p->M) / (size_t)p->Mk;
}
/* u: the cell's joint_pack_unit, which the packers' loops over a group's GPUs at one
 * microbatch find without its two 64-bit divisions per candidate (a fifth of the group
 * packer's time). */
static inline bool joint_pack_open(const joint_pack_prep *p, size_t u, size_t c, int32_t left)
{
    if (p->rank_count[u] >= p->rank_quota) return false;
    if (!p->cell_count || p->cell_count[c] == 0) return true;
    if ((int64_t)left - 1 < p->empty) return false;
    return p->rank_quota == INT32_MAX || p->rank_quota - p->rank_count[u] - 1 >= p->empty_rank[u];
}
/* Whether cell c, of (microbatch, EP group) holding tq tokens, stays within the pipeline
 * packing's limits after a sequence of n tokens (an empty microbatch takes any one). */
static inline bool joint_pack_within(const joint *jt, const joint_pack_prep *p, size_t c, int64_t tq, int64_t n)
{
    if (jt->pack_budget > 0 && tq > 0 && tq + n > jt->pack_budget) return false;
    return !p->cell_seqs || p->cell_seqs[c] < jt->pack_cell_quota;
}
/* Sequence placed in cell c of rank g: the counts above and rank_count. */
static inline void joint_pack_placed(joint_pack_prep *p, int32_t g, size_t c)
{
    const size_t u = joint_pack_unit(p, g, c);
    p->rank_count[u]++;
    if (p->cell_seqs) p->cell_seqs[c]++;
    if (p->cell_count && p->cell_count[c]++ == 0) {
        p->empty--;
        p->empty_rank[u]--;
    }
}
/* RP_ERANGE: sequence s fits in no cell of M microbatches (the caller may try more). */
rp_status joint_pack_nofit(const joint *jt, const joint_pack_prep *p, int32_t s, int32_t M, rp_error *err);
/* Dense ids of the prompts with several sequences, -1 for a sequence alone ([N]). */
rp_status joint_prompt_ids(const joint *jt, int32_t *prompt, int32_t *num_prompts, rp_error *err);

/* joint_hist.c: the per-(mb, group) histograms of the packing (one pass over every
 * histogram). */
rp_status joint_group_hist(joint *jt, rp_error *err);

/* joint_balance.c: sequence trades between EP groups inside each microbatch against
 * the reference placement, within `budget` candidate evaluations; keeps seq_gpu and
 * grp_hist exact. */
rp_status joint_balance(joint *jt, const joint_layer *ref, int64_t budget, int64_t *used, rp_error *err);

/* joint_place.c */
rp_status joint_layer_alloc(const joint *jt, joint_layer *lay, rp_error *err);
void joint_layer_free(const joint *jt, joint_layer *lay);
void joint_layer_index(const joint *jt, joint_layer *lay);
rp_status joint_layer_copy_from_plan(const joint *jt, const rp_plan *plan, int32_t l, joint_layer *lay,
                                     rp_error *err);
/* A fresh placement of layer l from this step's loads (replicas apportioned by load,
 * placed node-aware), improved against the per-(mb, group) loads. */
rp_status joint_place_fresh(joint *jt, int32_t l, joint_layer *lay, rp_error *err);
/* Improve `lay` in place for `rounds` rounds; each replica an EP rank gains that
 * `anchor` did not have there costs `copy_penalty` (surrogate seconds per step),
 * so a search from the previous placement moves only what pays. `first_s` and
 * `final_s` (either may be NULL) receive joint_place_score of `lay` as it came and as
 * it leaves, bit for bit, from the loads the search keeps (no pass of its own). */
rp_status joint_place_improve(joint *jt, int32_t l, joint_layer *lay, const joint_layer *anchor,
                              double copy_penalty, int32_t rounds, double *scratch, double *first_s,
                              double *final_s, rp_error *err);
/* Doubles of scratch space joint_place_score and joint_place_improve need. */
size_t joint_place_scratch_doubles(const joint *jt);
/* Surrogate expert time of layer l under `lay` (forward seconds summed over
 * microbatches, max over groups and ranks, even split). */
double joint_place_score(const joint *jt, int32_t l, const joint_layer *lay, double *scratch);
/* The same with replicated experts' loads water-filled per (mb, group): the best
 * shares could do; compares replica counts. */
double joint_place_score_ideal(const joint *jt, int32_t l, const joint_layer *lay, double *scratch);
/* Gradient all-reduce time a layer's replicas add (step seconds, mean over ranks);
 * per_rank is scratch of ep doubles. */
double joint_layer_grad_s(const joint *jt, const joint_layer *lay, double *per_rank);
/* joint_migrate.c: *seconds = the time the migration plan predicts (and the executor is
 * charged) for moving layer `layer` alone from `from` to `to` (migrate_build.h); errors
 * as migrate_build_new's. */
rp_status joint_layer_migration_s(const joint *jt, int32_t layer, const joint_layer *from, const joint_layer *to,
                                  double *seconds, rp_error *err);

/* joint_levers.c: shares and extra replicas of every (mb, layer) into `plan`, whose
 * placement must equal jt->layers. Counts what it added. */
rp_status joint_levers(joint *jt, rp_plan *plan, int32_t *share_sets, int32_t *extras, rp_error *err);
/* Extra replicas are tried at a (mb, layer) only where, after the shares, its busiest rank
 * (U: token-choices per speed of every (group, rank) [Q * ep]) is more than
 * JOINT_EXTRAS_MARGIN above the balanced level, the largest over the groups of the group's
 * work over its summed speed, which no lever goes below. Below the margin the shares have
 * done what there is to do: at the reference scale half the cells are within 3.3% after the
 * shares, and leaving out every cell within 10% takes a quarter off the levers' time with
 * the frozen batches' step 0.010% shorter in sum and none longer (bench_policies
 * --scores-against tests/bench/joint-scores-reference.csv). */
#define JOINT_EXTRAS_MARGIN 0.1
bool joint_extras_may_gain(const joint *jt, const double *U);
/* Expert slot time of n token-choices (forward, speed 1), as the cost model's t(n). */
double joint_slot_time(const joint *jt, double n);
/* joint_fill.c: the level h in (lo, hi] where F(h) = sum over i < R of
 * clamp(min over q < Q with slope[i Q + q] > 0 of slope[i Q + q] h - offset[i Q + q], 0, 1)
 * reaches 1: the upper end 28 halvings of [lo, hi] leave (keeping F >= 1 there), bit for
 * bit, from a few evaluations of F; adds their count to *evaluations (may be NULL). */
double joint_fill_level(const double *slope, const double *offset, int32_t R, int32_t Q, double lo, double hi,
                        int64_t *evaluations);

/* joint_relabel.c: permute the EP ranks of a fresh placement `lay` among ranks the
 * surrogate cannot tell apart (same node, slot count and speeds) so that it keeps the
 * most experts on the ranks of `old` that already hold them; its surrogate score does
 * not change. scratch: joint_relabel_scratch_ints(jt) ints. */
size_t joint_relabel_scratch_ints(const joint *jt);
void joint_relabel(const joint *jt, joint_layer *lay, const joint_layer *old, int32_t *scratch);

/* joint_vexp.c: the joint packing run with per-forward balancing (virtual experts) on
 * the contiguous placement, slots stabilised against the placement in use; valid for
 * the config and batch. */
rp_status joint_vexp_candidate(const joint *jt, const rp_plan *previous_placed, rp_plan **out, rp_error *err);
/* joint_vexp_own.c: `base` (a plan run with the balancer) with each layer's experts evenly
 * owned where the balancer pushes the fewest virtual experts over the step's (microbatch,
 * EP group) cells, starting from the placement in use where it is evenly owned (else
 * base's), a swap kept where its pushes saved pay for its moves over the horizon; *out
 * NULL where the balancer's group is beyond the search's limit. */
rp_status joint_vexp_owned(const joint *jt, const rp_plan *base, const rp_plan *previous_placed, rp_plan **out,
                           rp_error *err);
/* The most virtual experts any rank of one EP group pushes or receives in one forward of
 * rp_vexp_plan (steps 1 to 3), from each expert's token-choices in the group nat[E] and
 * each rank's experts owned[r * (E / ep) + i] (ascending id); scratch from
 * joint_vexp_pushes_init over joint_vexp_pushes_scratch(ep, E) bytes. */
int32_t joint_vexp_pushes(int32_t ep, int32_t E, const int64_t *nat, const int32_t *owned, void *scratch);
size_t joint_vexp_pushes_scratch(int32_t ep, int32_t E);
void *joint_vexp_pushes_init(void *mem, int32_t ep, int32_t E);

#endif
