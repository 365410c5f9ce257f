/* The registry of expert buffers: per (layer, local slot) of one rank, the tensors the
 * trainer owns and migration moves, with one tensor layout per layer, and what each
 * slot holds (its identity: layer, expert, version), which the executor checks and
 * keeps up to date. */
#include "internal.h"
#include "routepack/migrate.h"

#include <stdlib.h>
#include <string.h>

#define MAX_TENSORS 64

typedef struct slot_entry {
    rp_tensor *tensors; /* [count], NULL when not registered */
    int32_t count;
    rp_slot_identity id; /* expert RP_SLOT_UNKNOWN until set */
} slot_entry;

/* A layer's layout: what its first registered slot set. */
typedef struct layer_layout {
    int32_t count;      /* 0: nothing registered yet */
    int32_t first_slot;
    int64_t bytes;      /* sum over tensors */
    size_t *sizes;      /* [count] */
    rp_memory *memory;  /* [count] */
    int32_t registered; /* slots registered */
} layer_layout;

struct rp_registry {
    rp_context *ctx;
    int32_t num_layers, num_slots;
    slot_entry *slots;     /* [num_layers * num_slots] */
    layer_layout *layouts; /* [num_layers] */
};

rp_status rp_registry_new(rp_context *ctx, int32_t num_layers, int32_t num_slots,
                          rp_registry **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "registry: no context or output");
    *out = NULL;
    if (num_layers < 1 || num_slots < 1)
        return rp_fail(err, RP_EINVAL, "registry: %d layers and %d slots; both must be at least 1",
                       num_layers, num_slots);
    int64_t cells;
    if (rp_mul_overflow(num_layers, num_slots, &cells) || cells > (int64_t)(SIZE_MAX / sizeof(slot_entry)))
        return rp_fail(err, RP_ERANGE, "registry: %d layers x %d slots is too many", num_layers, num_slots);
    rp_registry *r = rp_calloc(ctx, 1, sizeof *r);
    if (!r) return rp_fail_nomem(err, "a registry");
    r->ctx = ctx;
    r->num_layers = num_layers;
    r->num_slots = num_slots;
    r->slots = rp_calloc(ctx, (size_t)cells, sizeof *r->slots);
    r->layouts = rp_calloc(ctx, (size_t)num_layers, sizeof *r->layouts);
    if (!r->slots || !r->layouts) {
        rp_registry_free(r);
        return rp_fail_nomem(err, "a registry");
    }
    for (int64_t i = 0; i < cells; i++)
        r->slots[i].id = (rp_slot_identity){(int32_t)(i / num_slots), RP_SLOT_UNKNOWN, 0};
    *out = r;
    return RP_OK;
}

void rp_registry_free(rp_registry *r)
{
    if (!r) return;
    rp_context *ctx = r->ctx;
    if (r->slots)
        for (int64_t i = 0; i < (int64_t)r->num_layers * r->num_slots; i++) rp_free(ctx, r->slots[i].tensors);
    if (r->layouts)
        for (int32_t l = 0; l < r->num_layers; l++) {
            rp_free(ctx, r->layouts[l].sizes);
            rp_free(ctx, r->layouts[l].memory);
        }
    rp_free(ctx, r->slots);
    rp_free(ctx, r->layouts);
    rp_free(ctx, r);
}

int32_t rp_registry_num_layers(const rp_registry *r) { return r ? r->num_layers : 0; }
int32_t rp_registry_num_slots(const rp_registry *r) { return r ? r->num_slots : 0; }

static const char *memory_name(rp_memory m)
{
    return m == RP_MEMORY_HOST ? "host" : m == RP_MEMORY_CUDA ? "CUDA" : "unknown";
}

rp_status rp_registry_set(rp_registry *r, int32_t layer, int32_t slot, const rp_tensor *tensors,
                          int32_t count, rp_error *err)
{
    if (!r) return rp_fail(err, RP_EINVAL, "registry: no registry");
    if (layer < 0 || layer >= r->num_layers)
        return rp_fail(err, RP_EINVAL, "registry: layer %d is out of range (the registry has %d layers)", layer,
                       r->num_layers);
    if (slot < 0 || slot >= r->num_slots)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d is out of range (the registry has %d slots)",
                       layer, slot, r->num_slots);
    if (count < 1 || count > MAX_TENSORS)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d registers %d tensors; 1 to %d are allowed",
                       layer, slot, count, MAX_TENSORS);
    if (!tensors) return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d: no tensors given", layer, slot);
    int64_t total = 0;
    for (int32_t i = 0; i < count; i++) {
        const rp_tensor *t = &tensors[i];
        if (t->memory != RP_MEMORY_HOST && t->memory != RP_MEMORY_CUDA)
            return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d has memory kind %d, neither host "
                           "(0) nor CUDA (1)", layer, slot, i, (int)t->memory);
        if (t->bytes == 0)
            return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d is empty (0 bytes)", layer, slot, i);
        if (!t->data)
            return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d has a NULL pointer for %zu bytes",
                           layer, slot, i, t->bytes);
        if (t->bytes > (size_t)INT64_MAX || rp_add_overflow(total, (int64_t)t->bytes, &total))
            return rp_fail(err, RP_ERANGE, "registry: layer %d slot %d: the tensors' sizes overflow", layer, slot);
        if ((uintptr_t)t->data > UINTPTR_MAX - t->bytes)
            return rp_fail(err, RP_ERANGE, "registry: layer %d slot %d tensor %d wraps around the address space",
                           layer, slot, i);
    }
    layer_layout *lay = &r->layouts[layer];
    slot_entry *e = &r->slots[(int64_t)layer * r->num_slots + slot];
    /* The layout is set by the first slot registered; re-registering that slot while
     * it is the only one may change it. */
    bool defines = lay->count == 0 || (lay->registered == 1 && lay->first_slot == slot);
    if (!defines) {
        if (count != lay->count)
            return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d registers %d tensors, but layer %d has %d (as "
                           "registered for slot %d)", layer, slot, count, layer, lay->count, lay->first_slot);
        for (int32_t i = 0; i < count; i++) {
            if (tensors[i].bytes != lay->sizes[i])
                return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d is %zu bytes, but layer %d's "
                               "tensor %d is %zu bytes (as registered for slot %d)", layer, slot, i, tensors[i].bytes,
                               layer, i, lay->sizes[i], lay->first_slot);
            if (tensors[i].memory != lay->memory[i])
                return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d is %s memory, but layer %d's "
                               "tensor %d is %s memory (as registered for slot %d)", layer, slot, i,
                               memory_name(tensors[i].memory), layer, i, memory_name(lay->memory[i]),
                               lay->first_slot);
        }
    }
    rp_tensor *copy = rp_alloc(r->ctx, (size_t)count * sizeof *copy);
    size_t *sizes = NULL;
    rp_memory *memory = NULL;
    if (defines) {
        sizes = rp_alloc(r->ctx, (size_t)count * sizeof *sizes);
        memory = rp_alloc(r->ctx, (size_t)count * sizeof *memory);
    }
    if (!copy || (defines && (!sizes || !memory))) {
        rp_free(r->ctx, copy);
        rp_free(r->ctx, sizes);
        rp_free(r->ctx, memory);
        return rp_fail_nomem(err, "a registry entry");
    }
    memcpy(copy, tensors, (size_t)count * sizeof *copy);
    if (defines) {
        for (int32_t i = 0; i < count; i++) {
            sizes[i] = tensors[i].bytes;
            memory[i] = tensors[i].memory;
        }
        rp_free(r->ctx, lay->sizes);
        rp_free(r->ctx, lay->memory);
        lay->sizes = sizes;
        lay->memory = memory;
        lay->count = count;
        lay->first_slot = slot;
        lay->bytes = total;
    }
    if (!e->tensors) lay->registered++;
    rp_free(r->ctx, e->tensors);
    e->tensors = copy;
    e->count = count;
    return RP_OK;
}

const rp_tensor *rp_registry_tensors(const rp_registry *r, int32_t layer, int32_t slot, int32_t *count)
{
    if (count) *count = 0;
    if (!r || layer < 0 || layer >= r->num_layers || slot < 0 || slot >= r->num_slots) return NULL;
    const slot_entry *e = &r->slots[(int64_t)layer * r->num_slots + slot];
    if (count) *count = e->count;
    return e->tensors;
}

int64_t rp_registry_expert_bytes(const rp_registry *r, int32_t layer)
{
    if (!r || layer < 0 || layer >= r->num_layers || r->layouts[layer].count == 0) return -1;
    return r->layouts[layer].bytes;
}

typedef struct span {
    uintptr_t begin, end;
    int32_t memory, layer, slot, tensor;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->memory != y->memory) return x->memory < y->memory ? -1 : 1;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return 0;
}

rp_status rp_registry_check(const rp_registry *r, rp_error *err) { return registry_check_layers(r, NULL, err); }

rp_status registry_check_layers(const rp_registry *r, const unsigned char *layers, rp_error *err)
{
    if (!r) return rp_fail(err, RP_EINVAL, "registry: no registry");
    int64_t n = 0;
    for (int32_t l = 0; l < r->num_layers; l++)
        for (int32_t s = 0; s < r->num_slots && (!layers || layers[l]); s++) {
            const slot_entry *e = &r->slots[(int64_t)l * r->num_slots + s];
            if (!e->tensors)
                return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d is not registered (every %s and slot "
                               "must be)", l, s, layers ? "layer of this rank's pipeline stage" : "layer");
            n += e->count;
        }
    /* Two slots sharing memory would make one commit overwrite another's expert. */
    span *spans = rp_alloc(r->ctx, (size_t)n * sizeof *spans + 1);
    if (!spans) return rp_fail_nomem(err, "the registry's overlap check");
    int64_t k = 0;
    for (int32_t l = 0; l < r->num_layers; l++)
        for (int32_t s = 0; s < r->num_slots && (!layers || layers[l]); s++) {
            const slot_entry *e = &r->slots[(int64_t)l * r->num_slots + s];
            for (int32_t i = 0; i < e->count; i++)
                spans[k++] = (span){(uintptr_t)e->tensors[i].data, (uintptr_t)e->tensors[i].data + e->tensors[i].bytes,
                                    (int32_t)e->tensors[i].memory, l, s, i};
        }
    qsort(spans, (size_t)n, sizeof *spans, span_cmp);
    rp_status st = RP_OK;
    for (int64_t i = 1; i < n; i++) {
        const span *a = &spans[i - 1], *b = &spans[i];
        if (a->memory == b->memory && b->begin < a->end) {
            st = rp_fail(err, RP_EINVAL, "registry: layer %d slot %d tensor %d overlaps layer %d slot %d tensor %d",
                         b->layer, b->slot, b->tensor, a->layer, a->slot, a->tensor);
            break;
        }
    }
    rp_free(r->ctx, spans);
    return st;
}

/* ---- identity ---- */

rp_status rp_registry_set_identity(rp_registry *r, int32_t layer, int32_t slot, const rp_slot_identity *id,
                                   rp_error *err)
{
    if (!r || !id) return rp_fail(err, RP_EINVAL, "registry: no registry or identity");
    if (layer < 0 || layer >= r->num_layers || slot < 0 || slot >= r->num_slots)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d is out of range (the registry has %d layers and "
                       "%d slots)", layer, slot, r->num_layers, r->num_slots);
    if (id->layer < 0 || id->layer >= r->num_layers)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d: the identity names layer %d, but the registry has "
                       "%d layers", layer, slot, id->layer, r->num_layers);
    if (id->expert < RP_SLOT_UNKNOWN)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d: expert %d is not an expert id, -1 (empty) or "
                       "RP_SLOT_UNKNOWN", layer, slot, id->expert);
    r->slots[(int64_t)layer * r->num_slots + slot].id = *id;
    return RP_OK;
}

rp_status rp_registry_identity(const rp_registry *r, int32_t layer, int32_t slot, rp_slot_identity *out,
                               rp_error *err)
{
    if (!r || !out) return rp_fail(err, RP_EINVAL, "registry: no registry or output");
    if (layer < 0 || layer >= r->num_layers || slot < 0 || slot >= r->num_slots)
        return rp_fail(err, RP_EINVAL, "registry: layer %d slot %d is out of range (the registry has %d layers and "
                       "%d slots)", layer, slot, r->num_layers, r->num_slots);
    *out = r->slots[(int64_t)layer * r->num_slots + slot].id;
    return RP_OK;
}

rp_status rp_registry_set_placement(rp_registry *r, const rp_plan *plan, int32_t ep_rank, uint64_t version,
                                    rp_error *err)
{
    if (!r || !plan) return rp_fail(err, RP_EINVAL, "registry: no registry or plan");
    const int32_t ep = rp_plan_ep_size(plan);
    if (ep_rank < 0 || ep_rank >= ep)
        return rp_fail(err, RP_EINVAL, "registry: EP rank %d is out of range (the plan has EP size %d)", ep_rank, ep);
    const int32_t *sb = rp_plan_slot_begin(plan);
    const int32_t slots = sb[ep_rank + 1] - sb[ep_rank];
    if (rp_plan_num_layers(plan) != r->num_layers || slots != r->num_slots)
        return rp_fail(err, RP_EINVAL, "registry: the registry has %d layers and %d slots, but EP rank %d has %d "
                       "layers and %d slots in the plan", r->num_layers, r->num_slots, ep_rank,
                       rp_plan_num_layers(plan), slots);
    for (int32_t l = 0; l < r->num_layers; l++) {
        const int32_t *row = rp_plan_phy2log(plan, l);
        if (!row) return rp_fail(err, RP_EINVAL, "registry: the plan has no placement at layer %d", l);
        for (int32_t k = 0; k < slots; k++)
            r->slots[(int64_t)l * r->num_slots + k].id = (rp_slot_identity){l, row[sb[ep_rank] + k], version};
    }
    return RP_OK;
}

void rp_registry_set_version(rp_registry *r, uint64_t version)
{
    if (!r) return;
    for (int64_t i = 0; i < (int64_t)r->num_layers * r->num_slots; i++) r->slots[i].id.version = version;
}
