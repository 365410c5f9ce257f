/* Shared by the migration executor tests (in-process threads and MPI processes): a
 * config and placements, one GPU's expert buffers filled with each expert's own bytes,
 * and the checks that every slot holds what it must. */
#ifndef RP_TEST_MIGRATE_WORLD_H
#define RP_TEST_MIGRATE_WORLD_H

#include "routepack/routepack.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define W_MAX_LAYERS 8
#define W_MAX_TENSORS 3

static inline rp_config *w_config(rp_context *ctx, int nodes, int gpn, int ep, int slots, int layers, int experts)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": %d, \"gpus_per_node\": %d, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": %d, \"num_experts\": %d, \"top_k\": 1, \"hidden_size\": 8,"
             " \"expert_ffn_size\": 4, \"num_heads\": 1, \"head_dim\": 8},"
             " \"limits\": {\"max_tokens_per_microbatch\": 1024}}",
             nodes, gpn, ep, slots, layers, experts);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, &err) != RP_OK) {
        printf("# config: %s\n", err.text);
        return NULL;
    }
    return cfg;
}

static inline rp_plan *w_plan(rp_context *ctx, const rp_config *cfg, const int32_t *rows)
{
    rp_plan *p = NULL;
    if (rp_plan_new(ctx, cfg, 1, &p, NULL) != RP_OK) return NULL;
    int32_t S = rp_plan_total_slots(p);
    for (int32_t l = 0; l < rp_plan_num_layers(p); l++)
        if (rp_plan_set_phy2log(p, l, rows + (size_t)l * S, NULL) != RP_OK) {
            rp_plan_free(p);
            return NULL;
        }
    return p;
}

static uint64_t w_rng = 0x2545f4914f6cdd1dULL;
static inline uint32_t w_rnd(uint32_t n)
{
    w_rng ^= w_rng << 13;
    w_rng ^= w_rng >> 7;
    w_rng ^= w_rng << 17;
    return (uint32_t)(w_rng % n);
}

/* A valid layer: every expert once, spare slots random replicas or empty, shuffled. */
static inline void w_random_layer(int32_t *row, int S, int E)
{
    for (int i = 0; i < S; i++) row[i] = i < E ? i : (w_rnd(4) == 0 ? -1 : (int32_t)w_rnd((uint32_t)E));
    for (int i = S - 1; i > 0; i--) {
        int j = (int)w_rnd((uint32_t)i + 1);
        int32_t t = row[i];
        row[i] = row[j];
        row[j] = t;
    }
}

/* The byte an expert has at (layer, tensor, i); junk of an empty slot likewise. */
static inline unsigned char w_byte(uint64_t key, size_t i)
{
    uint64_t x = key * 0x9e3779b97f4a7c15ULL + (uint64_t)i * 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 31;
    x *= 0x94d049bb133111ebULL;
    return (unsigned char)(x >> 56);
}
static inline uint64_t w_expert_key(int layer, int expert, int tensor)
{
    return ((uint64_t)layer << 40) ^ ((uint64_t)(expert + 1) << 8) ^ (uint64_t)tensor ^ 0x1111;
}
static inline uint64_t w_junk_key(int gpu, int layer, int slot, int tensor)
{
    return 0xdead000000000000ULL ^ ((uint64_t)gpu << 32) ^ ((uint64_t)layer << 20) ^ ((uint64_t)slot << 4) ^
           (uint64_t)tensor;
}

/* The tensor layout of every layer (the same on every rank). */
typedef struct w_layout {
    int L;
    int count[W_MAX_LAYERS];
    size_t size[W_MAX_LAYERS][W_MAX_TENSORS];
    int64_t bytes[W_MAX_LAYERS];
} w_layout;

static inline void w_random_layout(w_layout *lay, int L, size_t max_size)
{
    lay->L = L;
    for (int l = 0; l < L; l++) {
        lay->count[l] = 1 + (int)w_rnd(W_MAX_TENSORS);
        lay->bytes[l] = 0;
        for (int t = 0; t < lay->count[l]; t++) {
            lay->size[l][t] = 1 + w_rnd((uint32_t)max_size);
            lay->bytes[l] += (int64_t)lay->size[l][t];
        }
    }
}

/* One GPU's slots: buffers, their original contents and the registry over them. */
typedef struct w_gpu {
    int gpu, ep_rank, slots;
    const w_layout *lay;
    unsigned char *mem;      /* every tensor of every (layer, slot), back to back */
    unsigned char *original; /* a copy taken before migrating */
    size_t total;
    size_t *offset;          /* [L * slots * W_MAX_TENSORS] */
    rp_registry *reg;
} w_gpu;

static inline void w_expected(const w_gpu *w, int layer, int slot, int tensor, int expert, unsigned char *out)
{
    size_t n = w->lay->size[layer][tensor];
    uint64_t key = expert >= 0 ? w_expert_key(layer, expert, tensor) : w_junk_key(w->gpu, layer, slot, tensor);
    for (size_t i = 0; i < n; i++) out[i] = w_byte(key, i);
}

/* Buffers of GPU `gpu` filled from placement `cur` (a slot holds its expert's bytes, an
 * empty slot its own junk) and registered. Returns 0 on success. */
static inline int w_gpu_init(w_gpu *w, rp_context *ctx, const w_layout *lay, const rp_plan *cur, int gpu)
{
    memset(w, 0, sizeof *w);
    const int ep = rp_plan_ep_size(cur);
    const int32_t *sb = rp_plan_slot_begin(cur);
    w->gpu = gpu;
    w->ep_rank = gpu % ep;
    w->slots = sb[w->ep_rank + 1] - sb[w->ep_rank];
    w->lay = lay;
    w->offset = calloc((size_t)lay->L * w->slots * W_MAX_TENSORS, sizeof(size_t));
    for (int l = 0; l < lay->L; l++)
        for (int k = 0; k < w->slots; k++)
            for (int t = 0; t < lay->count[l]; t++) {
                w->offset[((size_t)l * w->slots + k) * W_MAX_TENSORS + t] = w->total;
                w->total += lay->size[l][t];
            }
    w->mem = malloc(w->total + 1);
    w->original = malloc(w->total + 1);
    for (int l = 0; l < lay->L; l++) {
        const int32_t *row = rp_plan_phy2log(cur, l);
        for (int k = 0; k < w->slots; k++)
            for (int t = 0; t < lay->count[l]; t++)
                w_expected(w, l, k, t, row[sb[w->ep_rank] + k], w->mem + w->offset[((size_t)l * w->slots + k) *
                                                                                       W_MAX_TENSORS + t]);
    }
    memcpy(w->original, w->mem, w->total);
    if (rp_registry_new(ctx, lay->L, w->slots, &w->reg, NULL) != RP_OK) return -1;
    for (int l = 0; l < lay->L; l++)
        for (int k = 0; k < w->slots; k++) {
            rp_tensor ts[W_MAX_TENSORS];
            for (int t = 0; t < lay->count[l]; t++)
                ts[t] = (rp_tensor){w->mem + w->offset[((size_t)l * w->slots + k) * W_MAX_TENSORS + t],
                                    lay->size[l][t], RP_MEMORY_HOST};
            if (rp_registry_set(w->reg, l, k, ts, lay->count[l], NULL) != RP_OK) return -1;
        }
    /* What each slot holds: the executor keeps it from here on. */
    if (rp_registry_set_placement(w->reg, cur, w->ep_rank, 0, NULL) != RP_OK) return -1;
    return 0;
}

static inline void w_gpu_free(w_gpu *w)
{
    rp_registry_free(w->reg);
    free(w->mem);
    free(w->original);
    free(w->offset);
    memset(w, 0, sizeof *w);
}

/* Slots that do not hold what they must: a layer in `moved` (bit l) holds the target
 * expert in every slot the target fills; everything else is as before. */
static inline int w_gpu_bad_slots(const w_gpu *w, const rp_plan *tgt, unsigned moved)
{
    const int32_t *sb = rp_plan_slot_begin(tgt);
    unsigned char want[512];
    int bad = 0;
    for (int l = 0; l < w->lay->L; l++) {
        const int32_t *row = rp_plan_phy2log(tgt, l);
        for (int k = 0; k < w->slots; k++) {
            int e = row[sb[w->ep_rank] + k];
            bool ok_slot = true;
            for (int t = 0; t < w->lay->count[l]; t++) {
                size_t off = w->offset[((size_t)l * w->slots + k) * W_MAX_TENSORS + t], n = w->lay->size[l][t];
                if ((moved >> l & 1) && e >= 0) {
                    w_expected(w, l, k, t, e, want);
                    ok_slot &= memcmp(w->mem + off, want, n) == 0;
                } else {
                    ok_slot &= memcmp(w->mem + off, w->original + off, n) == 0;
                }
            }
            bad += !ok_slot;
        }
    }
    return bad;
}

/* Whether every byte is as before. */
static inline bool w_gpu_intact(const w_gpu *w) { return memcmp(w->mem, w->original, w->total) == 0; }

/* The transfer that rank `sender`'s nth payload message (0-based, counted from round 0)
 * carries, and (if `tensor` is not NULL) which of its tensors: the executor sends,
 * round by round, to peers in ascending order, each copy's tensors in plan order (host
 * transports never split these small tensors). */
static inline int64_t w_fault_message(const rp_migration_plan *mp, const w_layout *lay, int sender, int64_t nth,
                               int *tensor)
{
    int64_t n = 0;
    int G = rp_migration_plan_num_gpus(mp);
    for (int round = 0; round < rp_migration_plan_num_rounds(mp); round++)
        for (int peer = 0; peer < G; peer++)
            for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
                rp_migration_transfer t;
                rp_migration_plan_transfer(mp, i, &t, NULL);
                if (t.round != round || t.src_gpu != sender || t.dst_gpu != peer || peer == sender) continue;
                if (n + lay->count[t.layer] > nth) {
                    if (tensor) *tensor = (int)(nth - n);
                    return i;
                }
                n += lay->count[t.layer];
            }
    return -1;
}

/* `prefer` if it sends to another GPU in the plan, else the lowest GPU that does. */
static inline int w_sender(const rp_migration_plan *mp, int prefer)
{
    int first = -1;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
        rp_migration_transfer t;
        rp_migration_plan_transfer(mp, i, &t, NULL);
        if (t.src_gpu == t.dst_gpu) continue;
        if (t.src_gpu == prefer) return prefer;
        if (first < 0 || t.src_gpu < first) first = t.src_gpu;
    }
    return first;
}

/* rp_checksum_expert of `expert`'s bytes at `layer` (its tensors one after another):
 * `*sent` as the source holds them, `*received` with the middle byte of tensor
 * `corrupt_tensor` flipped, as the transports' corruption fault delivers them. */
static inline void w_expert_checksums(const w_gpu *w, int layer, int expert, int corrupt_tensor, uint64_t *sent,
                               uint64_t *received)
{
    size_t total = (size_t)w->lay->bytes[layer], off = 0, flip = 0;
    unsigned char *bytes = malloc(total + 1);
    for (int t = 0; t < w->lay->count[layer]; t++) {
        w_expected(w, layer, 0, t, expert, bytes + off);
        if (t == corrupt_tensor) flip = off + w->lay->size[layer][t] / 2;
        off += w->lay->size[layer][t];
    }
    *sent = rp_checksum_bytes(bytes, total);
    bytes[flip] ^= 0xff;
    *received = rp_checksum_bytes(bytes, total);
    free(bytes);
}

/* Whether a checksum-mismatch error gives exactly `received` and `sent`. */
static inline bool w_error_has_checksums(const char *text, uint64_t received, uint64_t sent)
{
    char want[96];
    snprintf(want, sizeof want, "checksum mismatch (0x%016llx received, 0x%016llx sent)",
             (unsigned long long)received, (unsigned long long)sent);
    return strstr(text, want) != NULL;
}

/* Each GPU's slots of its EP rank take the next EP rank's experts (within the group):
 * every rank sends and receives at every layer. */
static inline void w_rotate(const int32_t *cur, int32_t *tgt, int L, int ep, int slots)
{
    int S = ep * slots;
    for (int l = 0; l < L; l++)
        for (int r = 0; r < ep; r++)
            for (int k = 0; k < slots; k++) tgt[l * S + r * slots + k] = cur[l * S + ((r + 1) % ep) * slots + k];
}

#endif
