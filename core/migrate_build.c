/* The migration planner's rule (migrate_build.h; docs/migration.md): from one placement's
 * rows to another's, the fewest expert copies between GPUs, their sources (same GPU, same
 * node, least-loaded remote), rounds of whole layers within a staging budget, bytes per
 * link and the predicted time. Under pipeline parallelism a layer's copies run between the
 * GPUs of the stage holding it, and the stages migrate at once. */
#include "migrate_build.h"

#include "internal.h"
#include "migrate_links.h"
#include "routepack/memory.h"

#include <string.h>

/* Growable arrays of the plan under construction. */
typedef struct builder {
    rp_context *ctx;
    rp_migration_transfer *transfers;
    int64_t num_transfers, cap_transfers;
    rp_migration_write *writes;
    int64_t num_writes, cap_writes;
} builder;

static bool grow(rp_context *ctx, void **items, int64_t *cap, int64_t need, size_t item)
{
    if (need <= *cap) return true;
    int64_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *p = rp_realloc(ctx, *items, (size_t)n * item);
    if (!p) return false;
    *items = p;
    *cap = n;
    return true;
}

/* The local slot of EP rank `r` holding `expert` at a layer row, or -1. */
static int32_t find_slot(const int32_t *row, const int32_t *sb, int32_t r, int32_t expert)
{
    for (int32_t s = sb[r]; s < sb[r + 1]; s++)
        if (row[s] == expert) return s - sb[r];
    return -1;
}

/* The first local slot of every expert on every EP rank in one layer's row (`first`,
 * [ep x E], -1: none): find_slot's answers for the layer at one read each. */
static void index_row(const int32_t *row, const int32_t *sb, int32_t ep, int32_t E, int32_t *first)
{
    for (size_t i = 0; i < (size_t)ep * E; i++) first[i] = -1;
    for (int32_t r = 0; r < ep; r++)
        for (int32_t s = sb[r + 1] - 1; s >= sb[r]; s--)
            if (row[s] >= 0 && row[s] < E) first[(size_t)r * E + row[s]] = s - sb[r];
}

/* find_slot(row, sb, r, expert) for expert >= 0, from row's index */
static int32_t slot_of(const int32_t *first, int32_t E, const int32_t *row, const int32_t *sb, int32_t r,
                       int32_t expert)
{
    return expert < E ? first[(size_t)r * E + expert] : find_slot(row, sb, r, expert);
}

/* Whether EP rank `r` is given `expert` by an earlier slot than local slot `k` in the
 * target, so that slot's copy serves this one too. */
static bool earlier_need(const int32_t *cur, const int32_t *tgt, const int32_t *sb, int32_t r, int32_t k,
                         int32_t expert)
{
    for (int32_t s = sb[r]; s < sb[r] + k; s++)
        if (tgt[s] == expert && cur[s] != expert) return true;
    return false;
}

/* Checked accumulation; *overflow stays set once set. A product of two plan counts
 * and one expert size was already checked when the layer's staging was sized. */
static void add(int64_t *acc, int64_t v, bool *overflow)
{
    if (rp_add_overflow(*acc, v, acc)) *overflow = true;
}

/* Seconds an EP rank is busy in a round (docs/migration.md, "Predicted time"): the
 * larger of what it sends and receives on each link, at one EP rank's bandwidth. */
static double round_time(const migrate_links *links, const int64_t *sent, const int64_t *recv, int64_t hbm_bytes)
{
    double nv = (double)(sent[RP_LINK_NVLINK] > recv[RP_LINK_NVLINK] ? sent[RP_LINK_NVLINK] : recv[RP_LINK_NVLINK]);
    double net = (double)(sent[RP_LINK_NET] > recv[RP_LINK_NET] ? sent[RP_LINK_NET] : recv[RP_LINK_NET]);
    return migrate_links_s(links, nv, net, (double)hbm_bytes);
}

rp_status migrate_build_new(rp_context *ctx, const rp_config *cfg, const int32_t *slot_begin,
                            const int32_t *const *current, const int32_t *const *target,
                            const rp_migration_options *opts, migrate_build *out, rp_error *err)
{
    memset(out, 0, sizeof *out);
    rp_status st;
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    const rp_hardware *hw = rp_config_hardware(cfg);
    const int32_t G = topo->num_gpus, ep = topo->ep_size, Q = topo->num_ep_groups, L = model->num_layers,
                  E = model->num_experts;
    const int32_t gpn = topo->gpus_per_node;
    /* G is one stage's DP ranks; GP the pipeline's, stage s holding [s * G, (s + 1) * G) */
    const int32_t PP = topo->pipeline_parallel_size > 1 ? topo->pipeline_parallel_size : 1, GP = G * PP;
    const int32_t *sb = slot_begin;
    rp_migration_options defaults = {0};
    if (!opts) opts = &defaults;
    if (opts->staging_budget_bytes < 0)
        return rp_fail(err, RP_EINVAL, "migration: staging budget %lld bytes is negative",
                       (long long)opts->staging_budget_bytes);
    int64_t model_bytes = 0;
    if (!opts->expert_bytes) {
        /* weights plus the receiver's shard of the optimizer state; within int64 for
         * every config the loader accepts */
        model_bytes = rp_memory_expert_move_bytes(cfg);
    }
    for (int32_t l = 0; l < L; l++) {
        int64_t b = opts->expert_bytes ? opts->expert_bytes[l] : model_bytes;
        if (b <= 0)
            return rp_fail(err, RP_EINVAL, "migration: layer %d has %lld bytes per expert; it must be positive", l,
                           (long long)b);
        if (b > INT64_MAX / 4)
            return rp_fail(err, RP_ERANGE, "migration: layer %d has %lld bytes per expert, too many to count", l,
                           (long long)b);
    }
    /* A DP rank's slots belong to its R EP ranks (ETP groups), each moving its own
     * experts over its own GPUs' links: the round's time is counted per EP rank. */
    migrate_links links;
    migrate_links_init(&links, topo, hw->hbm_bytes_per_s);
    const int32_t R = links.ep_ranks;

    migrate_build *mp = out;
    builder b = {ctx, NULL, 0, 0, NULL, 0, 0};
    int64_t *need = rp_calloc(ctx, (size_t)ep, sizeof(int64_t));       /* staging of a layer per EP rank */
    /* of the round being filled, per (stage, EP rank) */
    int64_t *round_need = rp_calloc(ctx, (size_t)PP * ep, sizeof(int64_t));
    int32_t *stage_rounds = rp_calloc(ctx, (size_t)PP, sizeof(int32_t)); /* rounds each stage opened */
    int64_t *load = rp_calloc(ctx, (size_t)GP * RP_NUM_LINKS, sizeof(int64_t)); /* sends in this round */
    /* this round's bytes per (GPU, EP rank of it): sent and received per link, HBM */
    int64_t *rsent = rp_calloc(ctx, (size_t)GP * R * RP_NUM_LINKS, sizeof(int64_t));
    int64_t *rrecv = rp_calloc(ctx, (size_t)GP * R * RP_NUM_LINKS, sizeof(int64_t));
    int64_t *rhbm = rp_calloc(ctx, (size_t)GP * R, sizeof(int64_t));
    int64_t *rstage = rp_calloc(ctx, (size_t)GP, sizeof(int64_t));
    /* the current and the target row's slot index of the layer at hand (index_row) */
    int32_t *cur_first = rp_alloc(ctx, 2 * (size_t)ep * E * sizeof(int32_t)), *tgt_first = cur_first + (size_t)ep * E;
    if (!need || !round_need || !stage_rounds || !load || !rsent || !rrecv || !rhbm || !rstage || !cur_first) {
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    mp->num_gpus = GP;
    mp->expert_bytes = rp_alloc(ctx, (size_t)L * sizeof(int64_t));
    mp->layer_round = rp_alloc(ctx, (size_t)L * sizeof(int32_t));
    mp->gpus = rp_calloc(ctx, (size_t)GP, sizeof *mp->gpus);
    mp->layer_stage = rp_calloc(ctx, (size_t)L, sizeof(int32_t));
    if (!mp->expert_bytes || !mp->layer_round || !mp->gpus || !mp->layer_stage) {
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    /* virtual stage v holds its layers on stage v % PP (rp_topology) */
    if (PP > 1)
        for (int32_t v = 0; v < PP * topo->virtual_pipeline_size; v++)
            for (int32_t l = topo->stage_layer_begin[v]; l < topo->stage_layer_begin[v] + topo->layers_per_stage[v]; l++)
                mp->layer_stage[l] = v % PP;
    for (int32_t l = 0; l < L; l++) mp->expert_bytes[l] = opts->expert_bytes ? opts->expert_bytes[l] : model_bytes;

    /* Rounds: whole layers, in order, while every EP rank's staging fits the budget. The
     * staging a layer needs depends only on the placements (one staged copy per (GPU,
     * expert) it lacks in a slot), so rounds come before sources. Under PP each stage
     * fills its own rounds with its own layers (its GPUs stage nothing of the others'):
     * round k moves the k-th round of every stage at once. */
    rp_migration_summary *sum = &mp->summary;
    int32_t rounds = 0;
    bool overflow = false;
    for (int32_t l = 0; l < L; l++) {
        const int32_t stage = mp->layer_stage[l];
        int64_t *stage_need = round_need + (size_t)stage * ep;
        const int32_t *cur = current[l], *tgt = target[l];
        mp->layer_round[l] = -1;
        if (!tgt) continue;
        bool moves = false;
        for (int32_t r = 0; r < ep; r++) {
            int64_t items = 0;
            for (int32_t k = 0; k < sb[r + 1] - sb[r]; k++) {
                int32_t e = tgt[sb[r] + k];
                if (e < 0 || e == cur[sb[r] + k]) continue;
                moves = true;
                if (!earlier_need(cur, tgt, sb, r, k, e)) items++;
            }
            if (rp_mul_overflow(items, mp->expert_bytes[l], &need[r])) {
                st = rp_fail(err, RP_ERANGE, "migration: layer %d's staging size overflows", l);
                goto fail;
            }
            if (need[r] > sum->min_budget_bytes) sum->min_budget_bytes = need[r];
            if (opts->staging_budget_bytes > 0 && need[r] > opts->staging_budget_bytes) {
                st = rp_fail(err, RP_ERANGE, "migration: the staging budget of %lld bytes per GPU is below the %lld "
                             "bytes that layer %d needs on EP rank %d (a round holds whole layers)",
                             (long long)opts->staging_budget_bytes, (long long)need[r], l, r);
                goto fail;
            }
        }
        if (!moves) continue;
        sum->layers_moved++;
        bool fits = stage_rounds[stage] > 0;
        if (fits && opts->staging_budget_bytes > 0)
            for (int32_t r = 0; r < ep && fits; r++) fits = stage_need[r] <= opts->staging_budget_bytes - need[r];
        if (!fits) {
            stage_rounds[stage]++;
            memset(stage_need, 0, (size_t)ep * sizeof(int64_t));
        }
        for (int32_t r = 0; r < ep; r++) stage_need[r] += need[r];
        mp->layer_round[l] = stage_rounds[stage] - 1;
        if (stage_rounds[stage] > rounds) rounds = stage_rounds[stage];
    }
    mp->num_rounds = rounds;
    sum->num_rounds = rounds;

    /* Copies and writes, round by round, so that sender loads balance each round. */
    for (int32_t round = 0; round < rounds; round++) {
        memset(load, 0, (size_t)GP * RP_NUM_LINKS * sizeof(int64_t));
        memset(rsent, 0, (size_t)GP * R * RP_NUM_LINKS * sizeof(int64_t));
        memset(rrecv, 0, (size_t)GP * R * RP_NUM_LINKS * sizeof(int64_t));
        memset(rhbm, 0, (size_t)GP * R * sizeof(int64_t));
        memset(rstage, 0, (size_t)GP * sizeof(int64_t));
        for (int32_t l = 0; l < L; l++) {
            if (mp->layer_round[l] != round) continue;
            const int32_t *cur = current[l], *tgt = target[l];
            const int64_t bytes = mp->expert_bytes[l];
            index_row(cur, sb, ep, E, cur_first);
            const int32_t base = mp->layer_stage[l] * G; /* the stage's first GPU */
            for (int32_t q = 0; q < Q; q++)
                for (int32_t r = 0; r < ep; r++) {
                    const int32_t g = base + q * ep + r;
                    const int64_t first = b.num_transfers; /* this GPU's copies at this layer */
                    for (int32_t k = 0; k < sb[r + 1] - sb[r]; k++) {
                        int32_t e = tgt[sb[r] + k];
                        if (e < 0 || e == cur[sb[r] + k]) continue;
                        /* the EP rank of g whose slot k is: it receives the copy and writes it */
                        const size_t at = (size_t)g * R + migrate_links_ep_rank(R, sb[r + 1] - sb[r], k);
                        int64_t item = -1;
                        for (int64_t i = first; i < b.num_transfers && item < 0; i++)
                            if (b.transfers[i].expert == e) item = i;
                        if (item < 0) {
                            rp_migration_transfer t = {round, l, e, g, -1, g, RP_LINK_LOCAL, bytes};
                            int32_t own = slot_of(cur_first, E, cur, sb, r, e), src_rank = r;
                            if (own >= 0) {
                                t.src_slot = own;
                            } else {
                                /* Same node first, then any node; least loaded on that link,
                                 * ties to the lowest GPU id (j ascending). */
                                int32_t best = -1, best_slot = -1;
                                rp_link best_link = RP_LINK_NET;
                                for (int32_t j = 0; j < ep; j++) {
                                    if (j == r) continue;
                                    int32_t s = slot_of(cur_first, E, cur, sb, j, e);
                                    if (s < 0) continue;
                                    int32_t h = base + q * ep + j;
                                    /* a stage is whole nodes or an equal part of one: nodes
                                     * are told apart by the stage's own GPU ids */
                                    rp_link link = (q * ep + j) / gpn == (q * ep + r) / gpn ? RP_LINK_NVLINK
                                                                                            : RP_LINK_NET;
                                    if (best < 0 || link < best_link ||
                                        (link == best_link &&
                                         load[(size_t)h * RP_NUM_LINKS + link] <
                                             load[(size_t)best * RP_NUM_LINKS + best_link])) {
                                        best = h;
                                        best_slot = s;
                                        best_link = link;
                                    }
                                }
                                if (best < 0) {
                                    st = rp_fail(err, RP_EPLAN, "migration: layer %d expert %d is in the target "
                                                 "placement but in no slot of the current placement, so no GPU "
                                                 "can send it", l, e);
                                    if (err) err->expert = e;
                                    goto fail;
                                }
                                t.src_gpu = best;
                                t.src_slot = best_slot;
                                t.link = best_link;
                                src_rank = best - base - q * ep;
                                load[(size_t)best * RP_NUM_LINKS + best_link] += bytes;
                            }
                            if (!grow(ctx, (void **)&b.transfers, &b.cap_transfers, b.num_transfers + 1,
                                      sizeof *b.transfers)) {
                                st = rp_fail_nomem(err, "a migration plan");
                                goto fail;
                            }
                            item = b.num_transfers++;
                            b.transfers[item] = t;
                            const size_t from =
                                (size_t)t.src_gpu * R +
                                migrate_links_ep_rank(R, sb[src_rank + 1] - sb[src_rank], t.src_slot);
                            add(&rsent[from * RP_NUM_LINKS + t.link], bytes, &overflow);
                            add(&rrecv[at * RP_NUM_LINKS + t.link], bytes, &overflow);
                            add(&rstage[g], bytes, &overflow);
                            if (t.link == RP_LINK_LOCAL) add(&rhbm[at], 2 * bytes, &overflow);
                            add(&sum->bytes[t.link], bytes, &overflow);
                            if (t.link == RP_LINK_LOCAL) sum->local_copies++;
                            else sum->transfers++;
                        }
                        if (!grow(ctx, (void **)&b.writes, &b.cap_writes, b.num_writes + 1, sizeof *b.writes)) {
                            st = rp_fail_nomem(err, "a migration plan");
                            goto fail;
                        }
                        b.writes[b.num_writes++] = (rp_migration_write){l, g, k, item};
                        add(&rhbm[at], 2 * bytes, &overflow);
                    }
                }
        }
        /* the round lasts its busiest EP rank of any GPU of any stage; a GPU is busy while
         * its busiest EP rank is */
        double round_s = 0.0;
        for (int32_t g = 0; g < GP; g++) {
            rp_migration_gpu *gs = &mp->gpus[g];
            double s = 0.0;
            for (int32_t u = 0; u < R; u++) {
                const size_t at = (size_t)g * R + u;
                for (int32_t c = 0; c < RP_NUM_LINKS; c++) {
                    gs->sent[c] += rsent[at * RP_NUM_LINKS + c];
                    gs->received[c] += rrecv[at * RP_NUM_LINKS + c];
                }
                double su = round_time(&links, &rsent[at * RP_NUM_LINKS], &rrecv[at * RP_NUM_LINKS], rhbm[at]);
                if (su > s) s = su;
            }
            if (rstage[g] > gs->staging_bytes) gs->staging_bytes = rstage[g];
            if (rstage[g] > sum->max_staging_bytes) sum->max_staging_bytes = rstage[g];
            gs->predicted_s += s;
            if (s > round_s) round_s = s;
        }
        sum->predicted_s += round_s;
    }

    /* The minimum, counted independently of the copies: every (GPU, layer) must receive
     * each distinct expert of its target that none of its slots holds now. */
    for (int32_t l = 0; l < L; l++) {
        const int32_t *cur = current[l], *tgt = target[l];
        if (!tgt) continue;
        index_row(cur, sb, ep, E, cur_first);
        index_row(tgt, sb, ep, E, tgt_first);
        for (int32_t r = 0; r < ep; r++)
            for (int32_t s = sb[r]; s < sb[r + 1]; s++) {
                int32_t e = tgt[s];
                if (e < 0 || slot_of(cur_first, E, cur, sb, r, e) >= 0 ||
                    slot_of(tgt_first, E, tgt, sb, r, e) != s - sb[r])
                    continue;
                int64_t all_groups;
                if (rp_mul_overflow(Q, mp->expert_bytes[l], &all_groups)) overflow = true;
                else add(&sum->min_bytes, all_groups, &overflow);
            }
    }
    if (overflow) {
        st = rp_fail(err, RP_ERANGE, "migration: the byte counts overflow (expert sizes too large)");
        goto fail;
    }
    sum->moved_bytes = sum->bytes[RP_LINK_NVLINK] + sum->bytes[RP_LINK_NET];
    sum->writes = b.num_writes;
    mp->transfers = b.transfers;
    mp->num_transfers = b.num_transfers;
    mp->writes = b.writes;
    mp->num_writes = b.num_writes;
    b.transfers = NULL;
    b.writes = NULL;
    st = RP_OK;
fail:
    rp_free(ctx, b.transfers);
    rp_free(ctx, b.writes);
    rp_free(ctx, need);
    rp_free(ctx, round_need);
    rp_free(ctx, stage_rounds);
    rp_free(ctx, load);
    rp_free(ctx, rsent);
    rp_free(ctx, rrecv);
    rp_free(ctx, rhbm);
    rp_free(ctx, rstage);
    rp_free(ctx, cur_first);
    return st;
}

void migrate_build_free(rp_context *ctx, migrate_build *b)
{
    if (!b) return;
    rp_free(ctx, b->layer_round);
    rp_free(ctx, b->layer_stage);
    rp_free(ctx, b->expert_bytes);
    rp_free(ctx, b->transfers);
    rp_free(ctx, b->writes);
    rp_free(ctx, b->gpus);
    memset(b, 0, sizeof *b);
}
