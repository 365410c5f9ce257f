/* The migration plan object: the move from the current to the target placement that
 * migrate_build.c plans (copies, sources, rounds, predicted time; docs/migration.md), kept
 * with both placements, its hash and the accessors the executor and the trainer read. */
#include "internal.h"
#include "migrate_build.h"
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
    const int32_t ep = topo->ep_size, L = model->num_layers;
    const int32_t *sb = rp_plan_slot_begin(current), *sb_t = rp_plan_slot_begin(target);
    for (int32_t j = 0; j <= ep; j++)
        if (sb[j] != sb_t[j])
            return rp_fail(err, RP_EINVAL, "migration: the current and target plans give EP rank %d different slot "
                           "counts", j > 0 ? j - 1 : 0);
    migrate_build built;
    rp_migration_plan *mp = rp_calloc(ctx, 1, sizeof *mp);
    const int32_t **rows = rp_alloc(ctx, 2 * (size_t)L * sizeof *rows);
    if (mp) mp->ctx = ctx;
    if (!mp || !rows) {
        memset(&built, 0, sizeof built);
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    for (int32_t l = 0; l < L; l++) {
        rows[l] = rp_plan_phy2log(current, l);
        rows[L + l] = rp_plan_phy2log(target, l);
    }
    RP_CHECK_GOTO(migrate_build_new(ctx, cfg, sb, rows, rows + L, opts, &built, err), st, fail);
    mp->num_gpus = built.num_gpus;
    mp->num_stages = topo->pipeline_parallel_size > 1 ? topo->pipeline_parallel_size : 1;
    mp->stage_gpus = topo->num_gpus;
    mp->ep_size = ep;
    mp->num_groups = topo->num_ep_groups;
    mp->num_layers = L;
    mp->num_experts = model->num_experts;
    mp->gpus_per_node = topo->gpus_per_node;
    /* the plan takes the builder's arrays */
    mp->layer_round = built.layer_round;
    mp->layer_stage = built.layer_stage;
    mp->expert_bytes = built.expert_bytes;
    mp->transfers = built.transfers;
    mp->num_transfers = built.num_transfers;
    mp->writes = built.writes;
    mp->num_writes = built.num_writes;
    mp->gpus = built.gpus;
    mp->num_rounds = built.num_rounds;
    mp->summary = built.summary;
    memset(&built, 0, sizeof built);
    mp->slot_begin = rp_alloc(ctx, (size_t)(ep + 1) * sizeof(int32_t));
    const int32_t S = sb[ep];
    for (int w = 0; w < 2; w++) mp->placement[w] = rp_alloc(ctx, (size_t)L * (size_t)S * sizeof(int32_t) + 1);
    if (!mp->slot_begin || !mp->placement[0] || !mp->placement[1]) {
        st = rp_fail_nomem(err, "a migration plan");
        goto fail;
    }
    memcpy(mp->slot_begin, sb, (size_t)(ep + 1) * sizeof(int32_t));
    for (int w = 0; w < 2; w++)
        for (int32_t l = 0; l < L; l++)
            memcpy(mp->placement[w] + (size_t)l * S, rows[(size_t)w * L + l], (size_t)S * sizeof(int32_t));
    mp->hash = plan_hash(mp);
    *out = mp;
    mp = NULL;
    st = RP_OK;
fail:
    migrate_build_free(ctx, &built);
    rp_free(ctx, (void *)rows);
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
