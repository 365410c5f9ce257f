/* Private state of the cost model and the calls between its files, declared by file from
 * the bottom (cost_unit.c) up (docs/layers.md, floor 5). Not installed. */
#ifndef RP_COST_INTERNAL_H
#define RP_COST_INTERNAL_H

#include "internal.h"
#include "migrate_links.h"
#include "routepack/cost.h"

/* Extra replicas and explicit shares of one (mb, layer, expert): the levers that change
 * an expert's replica set or split for one microbatch. Entries of one (mb, layer) are
 * sorted by expert. */
typedef struct cost_override {
    int32_t expert;
    int32_t num_extra, extra_off;   /* EP ranks in cost_state.extra_rank */
    int32_t num_shares, share_off;  /* normalised shares in cost_state.share_val; 0: rule */
} cost_override;

/* One pass of a pipeline schedule (cost_pipe.c): the forward or backward of virtual stage
 * v for the microbatch run at position k, or both at once (a forward of the last virtual
 * stage followed at once by its own backward). */
enum { COST_PIPE_F = 0, COST_PIPE_B = 1, COST_PIPE_FB = 2 };
typedef struct cost_pipe_op {
    int32_t kind, v, k;
} cost_pipe_op;

/* Working arrays of one critical-path run: [PP x V x M] forward and backward ends, [PP]
 * stage clocks and next ops. */
typedef struct cost_pipe_buf {
    double *fend, *bend, *tdev;
    int32_t *next;
} cost_pipe_buf;

/* The times a run needs: run returns an op's end given its start; p2p is the transfer
 * from virtual stage `from` to `to` before the op at position k. */
typedef struct cost_pipe_times {
    double (*run)(void *ud, int32_t kind, int32_t v, int32_t k, double start);
    double (*p2p)(void *ud, int32_t kind, int32_t from, int32_t to, int32_t k);
    void *ud;
} cost_pipe_times;

/* Everything bound to one evaluated plan. Built whole by rp_cost_evaluate and swapped
 * in only on success, so a failed evaluation leaves the previous binding intact.
 * Index conventions: cell (g, m) = g * M + m; layer cell (m, l) = m * L + l;
 * group cell (m, l, q) = (m * L + l) * Q + q; GPU cell (m, l, g) = (m * L + l) * G + g;
 * counts (m, l, g, e) = ((m * L + l) * G + g) * E + e. */
typedef struct cost_state {
    const rp_plan *plan;
    int32_t M;          /* microbatches */
    int32_t S;          /* physical slots of one EP group */
    int32_t slots_max;  /* largest slot count of one EP rank */
    int32_t *slot_begin;  /* [ep + 1] */
    int32_t *slot_rank;   /* [S] EP rank of each slot */
    int32_t *phy2log;     /* [L * S] */
    int32_t *rep_off;     /* [L * (E + 1)]: replicas of (l, e) in rep_rank[l * S + ...] */
    int32_t *rep_rank;    /* [L * S]: EP rank of each replica, ascending slot order */

    int32_t *ov_begin;    /* [M * L + 1] ranges into ov */
    cost_override *ov;
    int32_t *extra_rank;
    double *share_val;
    int32_t max_replicas; /* bound on any replica set: S + most extras of one key */
    int32_t *extra_count; /* [M * L * ep]: extra replicas on each EP rank */

    int32_t *seq_rank, *seq_mb;    /* [N] */
    int64_t *cell_tokens;          /* [G * M]: sum of L over the cell's sequences */
    int64_t *cell_quad;            /* [G * M]: sum of the sequences' seq_quad */
    int64_t *cell_pad;             /* [G * M]: padding tokens of the cell's sequences under CP (0 else) */
    int32_t *cell_top;             /* [G * M]: the sequence with the most attention, -1 if none */
    int32_t *counts;               /* [M * L * G * E] token-choices */
    int32_t *gtotal;               /* [M * L * Q * E] counts summed over each EP group */
    int32_t *gpair;                /* [M * L * Q * ep * ep] single-replica token-choices each GPU
                                      of the group sends to each other: [src * ep + dst] */
    int32_t *lay_dst;              /* [L * E] base destination map (cost_dst_map) */
    int32_t *lay_seg, *lay_ord;    /* [L * (ep + 2)], [L * E]: its experts by destination */

    double *attn;                  /* [G * M] A(g, m): attention and projections, forward, seconds */
    double *dense_f, *dense_b;     /* [G * M] the dense phase of the cell (attention, projections,
                                      token-linear, fixed), forward and backward, seconds */
    double *dfmax, *dbmax;         /* [M * Q] their maxima over each EP group */
    int32_t *dfarg;                /* [M * Q] GPU with the largest forward dense phase */
    double *expert;                /* [M * L * G] X(g, m, l), seconds */
    double *dispatch;              /* [M * L * G]; combine is the same volume reversed */
    double *xmax, *dmax;           /* [M * L * Q] */
    int32_t *xarg, *darg;          /* [M * L * Q] GPU that sets the maximum */
    double *layer_t;               /* [M * L * LW] T(m, l) of each sync domain, forward and
                                      backward seconds (NQ: Q under group sync, 1 under global),
                                      then under PP its forward and its backward apart (LW) */
    double *grad_gpu;              /* [L * G] replica gradient reduction per layer and GPU */
    double grad_s, extra_s, step_s;
    double forward_s;              /* cost_forward_s at the evaluation (stale after rp_cost_apply_*) */
    bool vexp;                     /* the plan runs with per-forward balancing (virtual experts) */
    int32_t *vexp_owner;           /* [L * E] EP rank owning each expert, when vexp */
    cost_pipe_op *pipe_ops;        /* the schedule of one mini-batch (M / K microbatches):
                                      [pipe_begin[r], pipe_begin[r + 1]) of stage r */
    int32_t *pipe_begin;           /* [PP + 1] */
    double *pipe_fend, *pipe_bend; /* [PP * VPP * M] working arrays of the critical path */
    double *pipe_tdev;             /* [PP] */
    int32_t *pipe_next;            /* [PP] */
    size_t bytes;                  /* allocated for this state */
} cost_state;

/* Scratch buffers, sized for the bound state (reallocated with it). */
typedef struct cost_scratch {
    uint32_t *hist;      /* [2 * L * E] histograms of the moved sequences */
    double *x, *d;       /* [ep] per-GPU results of a group under trial */
    double *si, *ri, *se, *re; /* [ep] bytes sent/received, intra/inter node */
    double *xacc;        /* [7 * ep]: of each rank, expert time, tokens taken, the grouped GEMM's
                            rows and groups, and the extras' own time, rows and groups */
    int32_t *rk;         /* [max_replicas] */
    double *w, *load;    /* [max_replicas] */
    double *layer_t;     /* [M * L * LW] */
    double *qdf, *qdb, *qx, *qd; /* [Q] per-group maxima of one (m, l) under trial */
    int32_t *rep_off;    /* [E + 1] a layer's replicas under trial */
    int32_t *rep_rank;   /* [S] */
    int32_t *row;        /* [S] a layer's phy2log under trial */
    double *grad_row;    /* [G] */
    size_t bytes;        /* allocated for the scratch space */
    int32_t *total;      /* [E] a group's totals under trial */
    int32_t *pair;       /* [ep * ep] a group's pairs under trial */
    double *sp;          /* [ep * ep] split experts' token-choices between GPUs of a group */
    int64_t *tok;        /* [ep] tokens of a group's cells at one microbatch */
    int32_t *dst;        /* [E] a destination map built on the fly */
    int32_t *seg, *ord;  /* [ep + 2], [E]: experts grouped by destination */
    /* the cells a trial move changes, with their tokens, for the pipeline's p2p transfers
     * (cost_pipe.c reads them while layer_t above is the trial's) */
    int32_t trial_cells, trial_g[2], trial_m[2];
    int64_t trial_tok[2];
} cost_scratch;

/* Evaluations an evaluator remembers (rp_cost.memo). */
#define COST_MEMO 4

struct rp_cost {
    rp_context *ctx;
    const rp_config *cfg;
    const rp_batch *batch;
    const rp_stats *stats;
    rp_split_rule rule;

    int32_t G, ep, Q, gpn, N, L, E, top_k;
    const double *speed;
    double speed_sum, speed_max;
    int32_t *gpu_node;         /* [G] */
    const int64_t *cu_seqlens;

    /* constants, seconds at speed 1 unless said */
    double attn_flop_s;        /* per L^2 / eff(L): 2 h d_h / peak */
    double attn_quad_s;        /* per unit of seq_quad: attn_flop_s / 2^k */
    const rp_eff_point *attn_eff;  /* attention efficiency by sequence length */
    int32_t num_attn_eff;
    int64_t *seq_quad;         /* [N] L^2 / eff(L) of each sequence, fixed point (cost.c) */
    double attn_lin_s;         /* per L: 2 d (2 h d_h + 2 h_kv d_h) / (peak * dense_efficiency) */
    double expert_token_s;     /* per token at efficiency 1: 6 d f / peak */
    double expert_mem_s;       /* weight read floor: 3 d f bytes_per_param / hbm */
    double eff_max;
    const rp_eff_point *eff;
    int32_t num_eff;
    double *slot_table;        /* [2 slot_table_n]: cost_slot_time of 0, 1, 2, ... tokens, then
                                  cost_wgrad_time of the same */
    int32_t slot_table_n;
    /* the grouped GEMM (cost_gemm.c; docs/cost-model.md, "Experts") */
    bool grouped;              /* execution.expert_gemm "grouped" (else the per-expert sum) */
    bool extras_apart;         /* grouped, and a GPU's extra replicas run as a grouped GEMM of their
                                  own (routepack.torch's buffers beside its slots) */
    int32_t tile_rows;         /* hardware.gemm_tile_rows, else the executor's alignment */
    bool tile_pow2;            /* tile_rows is a power of two: padding is a mask, not a division */
    double tile;               /* the same, as a double */
    const rp_eff_point *geff;  /* forward by a GPU's total padded rows; NULL: eff at the mean */
    int32_t num_geff;
    const rp_eff_point *weff;  /* weight gradient by one expert's padded rows */
    int32_t num_weff;
    double dgrad;              /* the backward beyond the weight gradient, x the grouped forward */
    double wgrad_floor_s;      /* writing one expert's dW: 3 d f bytes_per_grad / hbm */
    double xscale;             /* 1 / (1 + backward.experts): seconds into forward-equivalents */
    double token_bytes;        /* d * bytes_per_param: one token-choice on the wire */
    double expert_bytes;       /* 3 d f bytes_per_param: one expert's weights */
    double expert_move_bytes;  /* rp_memory_expert_move_bytes: weights + optimizer shard */
    double nv_bw, nv_lat, net_bw, net_lat;  /* one DP rank's: TP x CP GPUs' links */
    migrate_links move_links;  /* one EP rank's, which expert migration runs over */
    rp_backward bwd;           /* per-term backward / forward */
    double token_linear_s;     /* per token: token_linear_bytes_per_token / hbm */
    double fixed_s;            /* per (microbatch, layer): layer_fixed_s + the executor's host costs */
    /* What the executor charges (execution.executor, routepack/executor.h) */
    double grad_bytes;         /* 3 d f replica_grad_bytes_per_element: one expert's gradient */
    double grad_mem_s;         /* grad_bytes read or written once in the GPU's memory, per DP rank */
    rp_grad_reduce grad_form;
    bool extras_stacked;       /* a GPU with extras stacks all its local weights each forward */
    bool extras_once;          /* extras fetched once a step, their gradients reduced with replicas */
    bool extras_ahead;         /* ... fetched ahead, overlapped with the first microbatch's compute */
    double stack_s;            /* one expert's weights read and written (the stack), per DP rank */
    double extra_launch_s;     /* the launches one more local expert costs */
    double etp_gather_s;       /* per token a DP rank's experts take: the ETP all-gather over NVLink */
    /* Context parallelism (docs/cost-model.md, "Context parallelism"): every sequence
     * padded to a multiple of pad_multiple (1 without CP) and split over the CP ranks */
    int32_t cp;                /* context_parallel_size */
    int64_t pad_multiple;      /* 2 CP (x TP with sequence parallelism) under CP, else 1 */
    double ring_token_s;       /* K and V of one token on one GPU's ring link, seconds */
    double ring_lat;           /* latency of one ring step */
    rp_sync sync;
    rp_overlap overlap;
    rp_dispatch_dedup dedup;
    int32_t NQ;                /* sync domains with a time of their own: Q (group) or 1 (global) */
    int32_t LW;                /* doubles per (m, l) in layer_t: NQ, or 3 NQ under PP */
    int32_t PP, VPP;           /* pipeline stages, virtual stages per stage */
    int32_t K, epochs;         /* trainer.mini_batches and trainer.epochs: the plan's M
                                  microbatches are K pipelines of M / K each, run epochs times */
    rp_pipeline_schedule schedule;
    const int32_t *stage_begin, *stage_layers; /* [PP * VPP] the topology's layer split */
    bool *pipe_same_node;      /* [PP] stage r and r + 1 (mod PP) share a node */
    int32_t *layer_stage;      /* [L] the pipeline stage holding each layer */
    double p2p_token_bytes;    /* bytes one token's activations take on one GPU's p2p link */
    int64_t token_cap;
    double act_cap, act_per_token;

    struct rp_vexp *vexp;      /* the virtual-expert planner; NULL where the config rules it out */
    double vexp_comm_scale;    /* the pushes' time (forward, backward, gradient) as dispatch time */
    double vexp_grad_bytes;    /* one expert's gradient in the balancer's FP32 main-grad dtype */
    bool vexp_charges;         /* the balancer's padding, SM contention and FP32 push (its profile) */

    cost_state *st;            /* NULL until an evaluation succeeds */
    struct cost_packed *packed; /* a packing's counts read ahead (cost_read_packing), or NULL */
    /* The last COST_MEMO plans evaluated (copies; NULL where none or a copy failed) with
     * their summaries, the newest at memo_next - 1: a plan's summary depends on its content
     * alone, so an equal plan needs no second evaluation (cost_summary_of; the
     * scheduler's judgement of the plan its policy scored). memo_bound: the entry the bound
     * state is the evaluation of, -1 once rp_cost_apply_* or rp_cost_order_microbatches
     * changed the state (cost_state_edited). */
    struct {
        rp_plan *plan;
        rp_cost_summary sum;
        double forward_s;      /* cost_forward_s of the evaluation */
    } memo[COST_MEMO];
    int32_t memo_next, memo_bound;
    cost_scratch sc;
    /* Elementary operations performed so far (loop iterations of the evaluation, full
     * and incremental), counted where they happen: what callers charge (rp_cost_operations). */
    int64_t ops;
};

/* Count `ops` elementary operations (loop iterations) on the evaluator. The counter is
 * bookkeeping, not part of what the evaluator computes, so functions that take the
 * evaluator const count too (it is never a const object: rp_cost_new allocates it). */
static inline void cost_count(const rp_cost *c, int64_t ops) { ((rp_cost *)c)->ops += ops; }

/* A destination map: dst[e] is the EP rank of expert e's only replica or ep when it is
 * split; ord[seg[d] .. seg[d + 1]) lists the experts of destination d. */
typedef struct cost_map {
    const int32_t *dst, *seg, *ord;
} cost_map;

typedef struct group_result {
    double xmax, dmax;
    int32_t xarg, darg;
} group_result;

/* GPU g's expert time x and dispatch time d into the group's maxima (the first GPU
 * wins ties). */
static inline void group_result_note(group_result *res, int32_t g, double x, double d)
{
    if (x > res->xmax) {
        res->xmax = x;
        res->xarg = g;
    }
    if (d > res->dmax) {
        res->dmax = d;
        res->darg = g;
    }
}

/* A side's name in reports and to policies ("attention", "dispatch", "expert",
 * "combine"). */
static inline const char *cost_side_name(rp_side side)
{
    switch (side) {
    case RP_SIDE_ATTENTION: return "attention";
    case RP_SIDE_DISPATCH: return "dispatch";
    case RP_SIDE_EXPERT: return "expert";
    case RP_SIDE_COMBINE: return "combine";
    }
    return "unknown";
}

/* cost.c: the evaluator object */

/* What rp_cost_new refuses of a config and a batch, without statistics: the callers that
 * scan the routing first (rp_sched_step) check this before the scan, so a batch the
 * evaluator cannot take is refused at once, not after reading every id. */
rp_status cost_check_inputs(const rp_config *cfg, const rp_batch *batch, rp_error *err);

/* cost_unit.c: unit costs */

/* A curve at x: linear between points, flat beyond the ends. */
double cost_curve_at(const rp_eff_point *p, int32_t k, double x);
double cost_slot_time(const rp_cost *c, double tokens);
/* Slot time of an integer token count: a table below the curve's last point, where
 * the efficiency interpolation costs a search. The table holds cost_slot_time's own
 * results, so both paths give the same bits. */
static inline double cost_slot_time_int(const rp_cost *c, int64_t n)
{
    return n < c->slot_table_n ? c->slot_table[n] : cost_slot_time(c, (double)n);
}

/* cost_gemm.c: a GPU's experts as the executor runs them */

/* n rows padded up to the tile. */
double cost_gemm_pad(const rp_cost *c, double n);
/* One expert's weight-gradient GEMMs at n rows (padded), at least the write of dW. */
double cost_wgrad_time(const rp_cost *c, double n);
/* The same from rows already padded (p = cost_gemm_pad of some n > 0): the same bits,
 * without the second padding, and with the curve's search skipped beyond its last point
 * (where cost_curve_at returns that point's efficiency), as the evaluator meets most
 * experts' rows at the reference scale. */
static inline double cost_wgrad_padded(const rp_cost *c, double p)
{
    const rp_eff_point *w = c->weff;
    const int32_t k = c->num_weff;
    const double eff = p > w[0].tokens && p >= w[k - 1].tokens ? w[k - 1].efficiency : cost_curve_at(w, k, p);
    const double t = p * c->expert_token_s / eff;
    return t > c->wgrad_floor_s ? t : c->wgrad_floor_s;
}
/* An integer count n > 0 padded up to the tile: cost_gemm_pad's value (an integer below
 * 2^31 over a tile of at most 2^16 rows divides to a double strictly between two integers
 * unless exact, so the ceiling is the integer one), by a mask where the tile is a power
 * of two (the executors' alignments) instead of a 64-bit division. */
static inline int64_t cost_pad_rows(const rp_cost *c, int64_t n)
{
    const int64_t t = c->tile_rows;
    return c->tile_pow2 ? (n + t - 1) & -t : (n + t - 1) / t * t;
}
/* One expert's n rows into its GPU's accumulators: the per-expert time (loop form), or
 * its weight-gradient time, padded rows and one group (grouped form). */
void cost_expert_add(const rp_cost *c, double n, double *x, double *rows, double *groups);
/* The same for an integer count, from the tables below the curve's last point: the same
 * bits as cost_expert_add. */
static inline void cost_expert_add_int(const rp_cost *c, int64_t n, double *x, double *rows, double *groups)
{
    if (!c->grouped) {
        *x += cost_slot_time_int(c, n);
        return;
    }
    if (n <= 0) return;
    const int64_t p = cost_pad_rows(c, n);
    *x += n < c->slot_table_n ? c->slot_table[c->slot_table_n + n] : cost_wgrad_padded(c, (double)p);
    *rows += (double)p;
    *groups += 1.0;
}
/* The GPU's expert time (forward-equivalent seconds at speed 1) from its accumulators. */
double cost_gemm_finish(const rp_cost *c, double x, double rows, double groups);
/* Padding tokens of a sequence of `len` tokens (0 without CP). */
static inline int64_t cost_pad(const rp_cost *c, int64_t len)
{
    return (c->pad_multiple - len % c->pad_multiple) % c->pad_multiple;
}
/* Attention of a cell from its integer sums (sum_len: tokens with their CP padding);
 * gpu -1: at speed 1. */
double cost_cell_attention(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu);
/* The dense phase of a cell (attention, projections, token-linear, fixed cost, and the
 * CP ring's unhidden transfers), forward and backward, from its integer sums (sum_len
 * with the padding); gpu -1: at speed 1. cost_cell_dense_at: at the given speed. */
void cost_cell_dense(const rp_cost *c, int64_t sum_quad, int64_t sum_len, int32_t gpu, double *fwd,
                     double *bwd);
void cost_cell_dense_at(const rp_cost *c, int64_t sum_quad, int64_t sum_len, double speed, double *fwd,
                        double *bwd);
/* Attention of one sequence at speed 1, as the cells count it. */
double cost_seq_attention(const rp_cost *c, int32_t seq);
/* Forward and backward time of one (m, l) from its phase maxima (forward seconds) under
 * the configured overlap. */
double cost_layer_time(const rp_cost *c, double dfmax, double dbmax, double dmax, double xmax);
/* T of every sync domain at one (m, l) from the per-group maxima (arrays of Q): out[NQ]. */
void cost_layer_times(const rp_cost *c, const double *dfmax, const double *dbmax, const double *dmax,
                      const double *xmax, double *out);

/* cost_group.c: one (microbatch, layer, EP group) */

/* Largest dense phase of GPUs [g0, g0 + n) at microbatch m, cells (gA, mA) and (gB, mB)
 * replaced by the given values when they are among them (gA -1: none). */
void cost_group_dense(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int32_t gA, int32_t mA,
                      double fA, double bA, int32_t gB, int32_t mB, double fB, double bB, double *fmax,
                      double *bmax, int32_t *farg);
cost_map cost_dst_map(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, const int32_t *rep_off,
                      const int32_t *rep_rank, bool base, cost_scratch *sc);
void cost_layer_dst(const rp_cost *c, cost_state *st, int32_t l, const int32_t *rep_off,
                    const int32_t *rep_rank);
void cost_group_rebuild(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                        cost_map map, int32_t *total, int32_t *pair);
void cost_delta_aggregates(const rp_cost *c, int32_t src, const int32_t *restrict h, int32_t sign, cost_map map,
                           int32_t *restrict total, int32_t *restrict pair);
/* Tokens of group q's cells at microbatch m, into tok[ep]. */
void cost_group_tokens(const rp_cost *c, const cost_state *st, int32_t m, int32_t q, int64_t *tok);
void cost_group_delta(const rp_cost *c, cost_state *st, int32_t m, int32_t l, int32_t gpu,
                      const uint32_t *hist, int32_t sign, cost_map map);
/* Token copies each GPU of a group sends and receives (sc->si, ri, se, re) from its pair
 * counts, shares and tokens under the configured de-duplication. */
void cost_group_traffic(const rp_cost *c, const cost_state *st, int32_t g0, const int32_t *pair, const double *sp,
                        const int64_t *tokens, cost_scratch *sc);
void cost_group_eval(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                     const int32_t *rep_off, const int32_t *rep_rank, cost_map map,
                     const int32_t *total, const int32_t *pair, const int64_t *tokens, double *x_out,
                     double *d_out, group_result *res, cost_scratch *sc);
/* Per-forward balancing (virtual experts): the group's expert and dispatch times when the
 * balancer moves the experts' weights each forward. */
void cost_group_eval_vexp(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t q,
                          const int32_t *pair, const int64_t *tokens, double *x_out, double *d_out,
                          group_result *res, cost_scratch *sc);
void cost_index_layer(int32_t E, int32_t S, const int32_t *slot_rank_of, const int32_t *phy2log,
                      int32_t *rep_off, int32_t *rep_rank);

/* cost_grad.c: replica gradients */

/* Layer `layer`'s replica-gradient reduction time of every GPU into row[G]; `bytes`
 * (NULL: not wanted) gets what each GPU of EP group 0 sends. */
void cost_grad_layer(const rp_cost *c, const cost_state *st, int32_t layer, const int32_t *rep_off,
                     const int32_t *rep_rank, double *row, double *bytes);
double cost_grad_total(const rp_cost *c, const cost_state *st, int32_t layer, const double *row);
/* The experts of layer l one all-reduce of the EP group carries under the "group" form. */
int32_t cost_grad_experts(const rp_cost *c, const cost_state *st, int32_t l, const int32_t *rep_off);

/* cost_extras.c */

/* Extra-replica fetches of stage r under extras_once; `ahead`: only what the first
 * microbatch's compute leaves exposed. */
double cost_extras_once(const rp_cost *c, const cost_state *st, int32_t r, bool mean, bool ahead);

/* cost_eval.c: a whole plan's evaluation */

/* The work units of one full evaluation of a plan of M microbatches and S slots an EP group
 * for `batch` under `cfg`, from their shapes alone: the one formula behind
 * rp_cost_evaluation_needs (what rp.evaluate charges) and cost_evaluation_units (what
 * rp.joint charges an evaluation and the default step budget counts). Saturates at
 * INT64_MAX. */
int64_t cost_work_units(const rp_config *cfg, const rp_batch *batch, int64_t M, int64_t S);
/* The work units of one full evaluation of a plan for `batch` with the expected
 * microbatches (rp_limits_expected_microbatches) over the topology's slots, as
 * rp.evaluate charges them (cost_work_units): what rp.joint charges per evaluation and
 * what the scheduler sizes a step's instruction budget by. */
int64_t cost_evaluation_units(const rp_config *cfg, const rp_batch *batch);
/* The bound state no longer is the evaluation of the plan it was made from (a move,
 * swap, slot change or microbatch order was applied): no plan is equal to it any more. */
static inline void cost_state_edited(rp_cost *c) { c->memo_bound = -1; }
/* The summary of `plan`: a remembered evaluation's when an equal plan is among the last
 * COST_MEMO evaluated (the evaluator's binding unchanged), else rp_cost_evaluate's (which
 * binds it). For a caller that needs the summary only. */
rp_status cost_summary_of(rp_cost *c, const rp_plan *plan, rp_cost_summary *out, double *forward_s, rp_error *err);
void cost_state_free(rp_context *ctx, cost_state *s);
void cost_scratch_free(rp_context *ctx, cost_scratch *sc);
/* A packing's per-(mb, layer, GPU, expert) counts read ahead of its evaluation, with its
 * cells' tokens, quadratic attention, padding and top sequence (as a state holds them). */
typedef struct cost_packed {
    int32_t M;
    int32_t *seq_rank, *seq_mb;                   /* [N] */
    int64_t *cell_tokens, *cell_quad, *cell_pad;  /* [G M] */
    int32_t *cell_top;                            /* [G M] */
    int32_t *counts;                              /* [M L G E], as cost_state.counts */
    size_t bytes;
} cost_packed;
void cost_packed_free(rp_context *ctx, cost_packed *p);
/* The counts of the packing that puts sequence s on GPU seq_rank[s] in microbatch
 * seq_mb[s] of M (*counts: [M][L][G][E], valid until the evaluator's next evaluation or
 * read): the bound state's when it has this packing, else read once from the histograms
 * and kept, so that the next evaluation of a plan with exactly this packing takes them
 * over instead of reading the histograms again (the joint planner's per-group histograms
 * and its plan's evaluation then read them once). Counted as the evaluation's pass. */
rp_status cost_read_packing(rp_cost *c, int32_t M, const int32_t *seq_rank, const int32_t *seq_mb,
                            const int32_t **counts, rp_error *err);

/* cost_step.c */
double cost_forward_s(const rp_cost *c, const cost_state *s);

/* cost_summary.c */
void cost_summary(const rp_cost *c, const cost_state *st, rp_cost_summary *out);

/* cost_vexp.c: per-forward balancing (virtual experts) */
rp_status cost_vexp_check(const rp_cost *c, const rp_plan *plan, rp_error *err);
void cost_vexp_owners(const rp_cost *c, const rp_plan *plan, int32_t *owner);

/* cost_pipe.c: the pipeline schedule and its critical path */

/* Ops a schedule holds at most, all stages together. */
int64_t cost_pipe_capacity(int32_t PP, int32_t V, int32_t M);
/* The passes every stage runs, in order: 1F1B (V 1) or Megatron's interleaved order,
 * into ops[cost_pipe_capacity] with stage r's at [begin[r], begin[r + 1]). */
void cost_pipe_schedule(int32_t PP, int32_t V, rp_pipeline_schedule schedule, int32_t M, cost_pipe_op *ops,
                        int32_t *begin);
/* The critical path of a schedule: every op starts when its stage is free and its input
 * (plus the p2p transfer) is there; the step is the last stage clock. */
double cost_pipe_run(int32_t PP, int32_t V, int32_t M, const cost_pipe_op *ops, const int32_t *begin,
                     cost_pipe_buf *buf, const cost_pipe_times *times);
/* The critical path of sync domain q over mini-batch b (microbatch positions b M / K to
 * (b + 1) M / K - 1) from the layer times `layer_t` (state or trial). */
double cost_pipe_domain(const rp_cost *c, const cost_state *st, const double *layer_t, int32_t q, int32_t b);
/* The microbatch order sync domain q runs (NULL: the identity). */
const int32_t *cost_domain_order(const rp_cost *c, const cost_state *st, int32_t q);
double cost_step_from(const rp_cost *c, const cost_state *st, const double *layer_t,
                      double grad_s);
/* The sync domain with the largest sum of layer times (0 under global sync). */
int32_t cost_critical_domain(const rp_cost *c, const cost_state *st);

/* cost_bound.c */
double cost_bound_layer(const rp_cost *c, const cost_state *st, int32_t m, int32_t l);
double cost_bound_step(const rp_cost *c, const cost_state *st);

#endif
