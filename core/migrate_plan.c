/* The migration planner: from the current to the target placement, the fewest expert
 * copies between GPUs, their sources (same GPU, same node, least-loaded remote), rounds
 * of whole layers within a staging budget, bytes per link and the predicted time. Under
 * pipeline parallelism a layer's experts live on the GPUs of the stage holding it, so its
 * copies run between those GPUs, and the stages migrate at once (docs/migration.md). */
#include "internal.h"
#include "migrate_links.h"
#include "routepack/memory.h"
#include "routepack/migrate.h"

#include <string.h>

struct rp_migration_plan {
    rp_context *ctx;
    /* num_gpus: DP ranks of the whole pipeline, stage s's are [s * stage_gpus, (s + 1) *
     * stage_gpus); the placements are one stage's (every stage has the same layout) */
    int32_t num_gpus, ep_size, num_groups, num_layers, num_experts, gpus_per_node;
    int32_t num_stages, stage_gpus;
    int32_t *layer_stage;     /* [num_layers] the pipeline stage holding each layer */
    int32_t *slot_begin;      /* [ep_size + 1] */
    int64_t *expert_bytes;    /* [num_layers] */
    int32_t *layer_round;     /* [num_layers], -1: nothing moves */
    int32_t *placement[2];    /* current, target: [num_layers * slot_begin[ep_size]], one EP
                                 group's phy2log (every group has the same) */
    int32_t num_rounds;
    rp_migration_transfer *transfers;
    int64_t num_transfers;
    rp_migration_write *writes;
    int64_t num_writes;
    rp_migration_gpu *gpus;   /* [num_gpus] */
    rp_migration_summary summary;
    uint64_t hash;
};

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

static rp_status check_shape(const rp_config *cfg, const rp_plan *p, const char *which, rp_error *err)
{
    const rp_topology *t = rp_config_topology(cfg);
    const rp_model *m = rp_config_model(cfg);
    if (!p) return rp_fail(err, RP_EINVAL, "migration: the %s plan is missing", which);
    if (!rp_plan_has_placement(p)) return rp_fail(err, RP_EINVAL, "migration: the %s plan has no placement", which);
    if (rp_plan_num_gpus(p) != t->num_gpus || rp_plan_ep_size(p) != t->ep_size ||
        rp_plan_num_layers(p) != m->num_layers || rp_plan_num_experts(p) != m->num_experts)
        return rp_fail(err, RP_EINVAL,
                       "migration: the %s plan is shaped for %d GPUs, EP %d, %d layers, %d experts; the config has "
                       "%d, %d, %d, %d", which, rp_plan_num_gpus(p), rp_plan_ep_size(p), rp_plan_num_layers(p),
                       rp_plan_num_experts(p), t->num_gpus, t->ep_size, m->num_layers, m->num_experts);
    const int32_t *sb = rp_plan_slot_begin(p);
    if (sb[0] != 0 || sb[t->ep_size] != rp_plan_total_slots(p))
        return rp_fail(err, RP_EINVAL, "migration: the %s plan's slot offsets are inconsistent", which);
    for (int32_t j = 0; j < t->ep_size; j++)
        if (sb[j + 1] < sb[j])
            return rp_fail(err, RP_EINVAL, "migration: the %s plan's EP rank %d has a negative slot count", which, j);
    for (int32_t l = 0; l < m->num_layers; l++) {
        const int32_t *row = rp_plan_phy2log(p, l);
        for (int32_t s = 0; s < sb[t->ep_size]; s++)
            if (row[s] < -1 || row[s] >= m->num_experts) {
                rp_fail(err, RP_EINVAL, "migration: the %s plan's layer %d slot %d holds expert %d, but the model has "
                        "%d", which, l, s, row[s], m->num_experts);
                if (err) err->expert = row[s];
                return RP_EINVAL;
            }
    }
    return RP_OK;
}

/* The local slot of EP rank `r` holding `expert` at a layer row, or -1. */
static int32_t find_slot(const int32_t *row, const int32_t *sb, int32_t r, int32_t expert)
{
    for (int32_t s = sb[r]; s < sb[r + 1]; s++)
        if (row[s] == expert) return s - sb[r];
    return -1;
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

static void hash_i64(rp_hash_state *st, int64_t v)
{
    uint64_t u = (uint64_t)v;
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(u >> (8 * i)); /* little-endian on every host */
    rp_hash_update(st, b, 8);
}

static uint64_t plan_hash(const rp_migration_plan *mp)
{
    rp_hash_state st;
    rp_hash_init(&st, 0x6d696772617465ULL); /* "migrate" */
    hash_i64(&st, mp->num_gpus);
    hash_i64(&st, mp->ep_size);
    hash_i64(&st, mp->num_layers);
    hash_i64(&st, mp->num_experts);
    hash_i64(&st, mp->gpus_per_node);
    for (int32_t j = 0; j <= mp->ep_size; j++) hash_i64(&st, mp->slot_begin[j]);
    for (int32_t l = 0; l < mp->num_layers; l++) {
        hash_i64(&st, mp->expert_bytes[l]);
        hash_i64(&st, mp->layer_round[l]);
    }
    if (mp->num_stages > 1) /* PP 1 plans hash as before */
        for (int32_t l = 0; l < mp->num_layers; l++) hash_i64(&st, mp->layer_stage[l]);
    /* The placements: ranks that move from different current placements disagree even
     * where the copies happen to be the same. */
    for (int w = 0; w < 2; w++)
        for (int64_t i = 0; i < (int64_t)mp->num_layers * mp->slot_begin[mp->ep_size]; i++)
            hash_i64(&st, mp->placement[w][i]);
    hash_i64(&st, mp->num_transfers);
    for (int64_t i = 0; i < mp->num_transfers; i++) {
        const rp_migration_transfer *t = &mp->transfers[i];
        hash_i64(&st, t->round);
        hash_i64(&st, t->layer);
        hash_i64(&st, t->expert);
        hash_i64(&st, t->src_gpu);
        hash_i64(&st, t->src_slot);
        hash_i64(&st, t->dst_gpu);
        hash_i64(&st, t->link);
        hash_i64(&st, t->bytes);
    }
    hash_i64(&st, mp->num_writes);
    for (int64_t i = 0; i < mp->num_writes; i++) {
        const rp_migration_write *w = &mp->writes[i];
        hash_i64(&st, w->layer);
        hash_i64(&st, w->gpu);
        hash_i64(&st, w->slot);
        hash_i64(&st, w->transfer);
    }
    return rp_hash_final(&st);
}

/* Seconds an EP rank is busy in a round (docs/migration.md, "Predicted time"): the
 * larger of what it sends and receives on each link, at one EP rank's bandwidth. */
static double round_time(const migrate_links *links, const int64_t *sent, const int64_t *recv, int64_t hbm_bytes)
{
    double nv = (double)(sent[RP_LINK_NVLINK] > recv[RP_LINK_NVLINK] ? sent[RP_LINK_NVLINK] : recv[RP_LINK_NVLINK]);
    double net = (double)(sent[RP_LINK_NET] > recv[RP_LINK_NET] ? sent[RP_LINK_NET] : recv[RP_LINK_NET]);
    return migrate_links_s(links, nv, net, (double)hbm_bytes);
}

rp_status rp_migration_plan_new(rp_context *ctx, const rp_config *cfg, const rp_plan *current,
                                const rp_plan *target, const rp_migration_options *opts,
                                rp_migration_plan **out, rp_error *err)
{
    if (!ctx || !cfg || !out) return rp_fail(err, RP_EINVAL, "migration: no context, config or output");
    *out = NULL;
    rp_status st;
    if ((st = check_shape(cfg, current, "current", err)) != RP_OK) return st;
    if ((st = check_shape(cfg, target, "target", err)) != RP_OK) return st;
    const rp_topology *topo = rp_config_topology(cfg);
    const rp_model *model = rp_config_model(cfg);
    const rp_hardware *hw = rp_config_hardware(cfg);
    const int32_t G = topo->num_gpus, ep = topo->ep_size, Q = topo->num_ep_groups, L = model->num_layers;
    const int32_t gpn = topo->gpus_per_node;
    /* G is one stage's DP ranks; GP the pipeline's, stage s holding [s * G, (s + 1) * G) */
    const int32_t PP = topo->pipeline_parallel_size > 1 ? topo->pipeline_parallel_size : 1, GP = G * PP;
    const int32_t *sb = rp_plan_slot_begin(current), *sb_t = rp_plan_slot_begin(target);
    for (int32_t j = 0; j <= ep; j++)
        if (sb[j] != sb_t[j])
            return rp_fail(err, RP_EINVAL, "migration: the current and target plans give EP rank %d different slot "
                           "counts", j > 0 ? j - 1 : 0);
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
    int32_t max_slots = 0;
    for (int32_t j = 0; j < ep; j++)
        if (sb[j + 1] - sb[j] > max_slots) max_slots = sb[j + 1] - sb[j];
    /* A DP rank's slots belong to its R EP ranks (ETP groups), each moving its own
     * experts over its own GPUs' links: the round's time is counted per EP rank. */
    migrate_links links;
    migrate_links_init(&links, topo, hw->hbm_bytes_per_s);
    const int32_t R = links.ep_ranks;

    rp_migration_plan *mp = rp_calloc(ctx, 1, sizeof *mp);
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
    if (mp) mp->ctx = ctx;
    if (!mp || !need || !round_need || !stage_rounds || !load || !rsent || !rrecv || !rhbm || !rstage) {
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    mp->num_gpus = GP;
    mp->num_stages = PP;
    mp->stage_gpus = G;
    mp->ep_size = ep;
    mp->num_groups = Q;
    mp->num_layers = L;
    mp->num_experts = model->num_experts;
    mp->gpus_per_node = gpn;
    mp->slot_begin = rp_alloc(ctx, (size_t)(ep + 1) * sizeof(int32_t));
    mp->expert_bytes = rp_alloc(ctx, (size_t)L * sizeof(int64_t));
    mp->layer_round = rp_alloc(ctx, (size_t)L * sizeof(int32_t));
    mp->gpus = rp_calloc(ctx, (size_t)GP, sizeof *mp->gpus);
    mp->layer_stage = rp_calloc(ctx, (size_t)L, sizeof(int32_t));
    if (!mp->slot_begin || !mp->expert_bytes || !mp->layer_round || !mp->gpus || !mp->layer_stage) {
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    memcpy(mp->slot_begin, sb, (size_t)(ep + 1) * sizeof(int32_t));
    /* virtual stage v holds its layers on stage v % PP (rp_topology) */
    if (PP > 1)
        for (int32_t v = 0; v < PP * topo->virtual_pipeline_size; v++)
            for (int32_t l = topo->stage_layer_begin[v]; l < topo->stage_layer_begin[v] + topo->layers_per_stage[v]; l++)
                mp->layer_stage[l] = v % PP;
    const int32_t S = sb[ep];
    for (int w = 0; w < 2; w++) {
        mp->placement[w] = rp_alloc(ctx, (size_t)L * (size_t)S * sizeof(int32_t) + 1);
        if (!mp->placement[w]) {
            st = rp_fail_nomem(err, "a migration plan");
            goto fail;
        }
        for (int32_t l = 0; l < L; l++)
            memcpy(mp->placement[w] + (size_t)l * S, rp_plan_phy2log(w ? target : current, l),
                   (size_t)S * sizeof(int32_t));
    }
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
        const int32_t *cur = rp_plan_phy2log(current, l), *tgt = rp_plan_phy2log(target, l);
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
        mp->layer_round[l] = -1;
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
            const int32_t *cur = rp_plan_phy2log(current, l), *tgt = rp_plan_phy2log(target, l);
            const int64_t bytes = mp->expert_bytes[l];
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
                            int32_t own = find_slot(cur, sb, r, e), src_rank = r;
                            if (own >= 0) {
                                t.src_slot = own;
                            } else {
                                /* Same node first, then any node; least loaded on that link,
                                 * ties to the lowest GPU id (j ascending). */
                                int32_t best = -1, best_slot = -1;
                                rp_link best_link = RP_LINK_NET;
                                for (int32_t j = 0; j < ep; j++) {
                                    if (j == r) continue;
                                    int32_t s = find_slot(cur, sb, j, e);
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
        const int32_t *cur = rp_plan_phy2log(current, l), *tgt = rp_plan_phy2log(target, l);
        for (int32_t r = 0; r < ep; r++)
            for (int32_t s = sb[r]; s < sb[r + 1]; s++) {
                int32_t e = tgt[s];
                if (e < 0 || find_slot(cur, sb, r, e) >= 0 || find_slot(tgt, sb, r, e) != s - sb[r]) continue;
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
    mp->hash = plan_hash(mp);
    *out = mp;
    mp = NULL;
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
    rp_migration_plan_free(mp);
    return st;
}

void rp_migration_plan_free(rp_migration_plan *mp)
{
    if (!mp) return;
    rp_context *ctx = mp->ctx;
    rp_free(ctx, mp->slot_begin);
    rp_free(ctx, mp->expert_bytes);
    rp_free(ctx, mp->layer_round);
    rp_free(ctx, mp->placement[0]);
    rp_free(ctx, mp->placement[1]);
    rp_free(ctx, mp->transfers);
    rp_free(ctx, mp->writes);
    rp_free(ctx, mp->gpus);
    rp_free(ctx, mp->layer_stage);
    rp_free(ctx, mp);
}

uint64_t rp_migration_plan_hash(const rp_migration_plan *mp) { return mp ? mp->hash : 0; }

void rp_migration_plan_summary(const rp_migration_plan *mp, rp_migration_summary *out)
{
    if (!out) return;
    if (!mp) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = mp->summary;
}

rp_status rp_migration_plan_gpu(const rp_migration_plan *mp, int32_t gpu, rp_migration_gpu *out, rp_error *err)
{
    if (!mp || !out) return rp_fail(err, RP_EINVAL, "migration: no plan or output");
    if (gpu < 0 || gpu >= mp->num_gpus)
        return rp_fail(err, RP_EINVAL, "migration: GPU %d is out of range (the plan has %d GPUs)", gpu, mp->num_gpus);
    *out = mp->gpus[gpu];
    return RP_OK;
}

int32_t rp_migration_plan_num_gpus(const rp_migration_plan *mp) { return mp ? mp->num_gpus : 0; }
int32_t rp_migration_plan_ep_size(const rp_migration_plan *mp) { return mp ? mp->ep_size : 0; }
int32_t rp_migration_plan_num_stages(const rp_migration_plan *mp) { return mp ? mp->num_stages : 0; }

int32_t rp_migration_plan_layer_stage(const rp_migration_plan *mp, int32_t layer)
{
    if (!mp || layer < 0 || layer >= mp->num_layers) return -1;
    return mp->layer_stage[layer];
}
int32_t rp_migration_plan_num_layers(const rp_migration_plan *mp) { return mp ? mp->num_layers : 0; }
int32_t rp_migration_plan_num_rounds(const rp_migration_plan *mp) { return mp ? mp->num_rounds : 0; }

int32_t rp_migration_plan_num_slots(const rp_migration_plan *mp, int32_t ep_rank)
{
    if (!mp || ep_rank < 0 || ep_rank >= mp->ep_size) return 0;
    return mp->slot_begin[ep_rank + 1] - mp->slot_begin[ep_rank];
}

int64_t rp_migration_plan_expert_bytes(const rp_migration_plan *mp, int32_t layer)
{
    if (!mp || layer < 0 || layer >= mp->num_layers) return -1;
    return mp->expert_bytes[layer];
}

int32_t rp_migration_plan_layer_round(const rp_migration_plan *mp, int32_t layer)
{
    if (!mp || layer < 0 || layer >= mp->num_layers) return -1;
    return mp->layer_round[layer];
}

int32_t rp_migration_plan_slot_expert(const rp_migration_plan *mp, int32_t layer, int32_t ep_rank, int32_t slot,
                                      bool target)
{
    if (!mp || layer < 0 || layer >= mp->num_layers || ep_rank < 0 || ep_rank >= mp->ep_size || slot < 0 ||
        slot >= mp->slot_begin[ep_rank + 1] - mp->slot_begin[ep_rank])
        return -2;
    return mp->placement[target ? 1 : 0][(size_t)layer * mp->slot_begin[mp->ep_size] + mp->slot_begin[ep_rank] + slot];
}

int64_t rp_migration_plan_num_transfers(const rp_migration_plan *mp) { return mp ? mp->num_transfers : 0; }
int64_t rp_migration_plan_num_writes(const rp_migration_plan *mp) { return mp ? mp->num_writes : 0; }

rp_status rp_migration_plan_transfer(const rp_migration_plan *mp, int64_t i, rp_migration_transfer *out,
                                     rp_error *err)
{
    if (!mp || !out) return rp_fail(err, RP_EINVAL, "migration: no plan or output");
    if (i < 0 || i >= mp->num_transfers)
        return rp_fail(err, RP_EINVAL, "migration: transfer %lld is out of range (the plan has %lld)", (long long)i,
                       (long long)mp->num_transfers);
    *out = mp->transfers[i];
    return RP_OK;
}

rp_status rp_migration_plan_write(const rp_migration_plan *mp, int64_t i, rp_migration_write *out, rp_error *err)
{
    if (!mp || !out) return rp_fail(err, RP_EINVAL, "migration: no plan or output");
    if (i < 0 || i >= mp->num_writes)
        return rp_fail(err, RP_EINVAL, "migration: write %lld is out of range (the plan has %lld)", (long long)i,
                       (long long)mp->num_writes);
    *out = mp->writes[i];
    return RP_OK;
}
