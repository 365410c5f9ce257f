/* Routing views: construction for the common layouts, and checking against a batch. */
#include "internal.h"
#include "routing_access.h"

#include <string.h>

static void dense(rp_routing *r, rp_routing_layout layout, rp_id_width width,
                  int32_t num_layers, int32_t top_k)
{
    memset(r, 0, sizeof *r);
    r->layout = layout;
    r->width = width;
    r->num_layers = num_layers;
    r->top_k = top_k;
    r->k_stride = 1;
    r->layer_stride = top_k;
    r->token_stride = layout == RP_ROUTING_PER_LAYER ? top_k : (int64_t)num_layers * top_k;
}

void rp_routing_packed(rp_routing *r, rp_id_width width, int32_t num_layers, int32_t top_k,
                       const void *ids)
{
    dense(r, RP_ROUTING_PACKED, width, num_layers, top_k);
    r->base = ids;
}

void rp_routing_per_seq(rp_routing *r, rp_id_width width, int32_t num_layers, int32_t top_k,
                        const void *const *seq_ids, int32_t num_seqs)
{
    dense(r, RP_ROUTING_PER_SEQ, width, num_layers, top_k);
    r->bases = seq_ids;
    r->num_bases = num_seqs;
}

void rp_routing_per_layer(rp_routing *r, rp_id_width width, int32_t num_layers,
                          int32_t top_k, const void *const *layer_ids)
{
    dense(r, RP_ROUTING_PER_LAYER, width, num_layers, top_k);
    r->bases = layer_ids;
    r->num_bases = num_layers;
}

rp_status rp_routing_check_shape(const rp_routing *r, const rp_batch *batch, int32_t num_experts,
                                  rp_error *err)
{
    if (r->width != RP_ID_U8 && r->width != RP_ID_U16 && r->width != RP_ID_I32)
        return rp_fail(err, RP_EINVAL, "routing: id width %d is not 1, 2 or 4 bytes", (int)r->width);
    if (r->num_layers < 1 || r->top_k < 1)
        return rp_fail(err, RP_EINVAL, "routing: %d layers and top-k %d, both must be >= 1",
                       r->num_layers, r->top_k);
    if (num_experts < 1)
        return rp_fail(err, RP_EINVAL, "routing: %d experts, must be >= 1", num_experts);
    if (r->top_k > num_experts)
        return rp_fail(err, RP_EINVAL, "routing: top-k %d exceeds the %d experts", r->top_k, num_experts);
    if (r->token_stride < 0 || r->layer_stride < 0 || r->k_stride < 0)
        return rp_fail(err, RP_EINVAL, "routing: strides must not be negative");
    int32_t n = rp_batch_num_seqs(batch);
    switch (r->layout) {
    case RP_ROUTING_PACKED:
        if (!r->base && rp_batch_num_tokens(batch) > 0)
            return rp_fail(err, RP_EINVAL, "routing: packed layout without a base array");
        break;
    case RP_ROUTING_PER_SEQ:
        if (r->num_bases != n || (n > 0 && !r->bases))
            return rp_fail(err, RP_EINVAL, "routing: %d per-sequence arrays for %d sequences",
                           r->num_bases, n);
        for (int32_t s = 0; s < n; s++)
            if (!r->bases[s] && rp_batch_seq_len(batch, s) > 0) {
                rp_fail(err, RP_EINVAL, "routing: sequence %d has no routing array", s);
                if (err) err->sequence = s;
                return RP_EINVAL;
            }
        break;
    case RP_ROUTING_PER_LAYER:
        if (r->num_bases != r->num_layers || !r->bases)
            return rp_fail(err, RP_EINVAL, "routing: %d per-layer arrays for %d layers",
                           r->num_bases, r->num_layers);
        for (int32_t l = 0; l < r->num_layers; l++)
            if (!r->bases[l] && rp_batch_num_tokens(batch) > 0)
                return rp_fail(err, RP_EINVAL, "routing: layer %d has no routing array", l);
        break;
    default:
        return rp_fail(err, RP_EINVAL, "routing: unknown layout %d", (int)r->layout);
    }
    return RP_OK;
}

rp_status rp_routing_check(const rp_routing *r, const rp_batch *batch, int32_t num_experts,
                           rp_error *err)
{
    rp_status st = rp_routing_check_shape(r, batch, num_experts, err);
    if (st != RP_OK) return st;
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    int32_t n = rp_batch_num_seqs(batch);
    for (int32_t s = 0; s < n; s++) {
        int32_t len = rp_batch_seq_len(batch, s);
        for (int32_t l = 0; l < r->num_layers; l++) {
            const void *at = rp_routing_at(r, cu, s, l);
            for (int32_t t = 0; t < len; t++)
                for (int32_t j = 0; j < r->top_k; j++) {
                    int32_t id = rp_id_load(at, r->width, t * r->token_stride + j * r->k_stride);
                    if (id < 0 || id >= num_experts) {
                        rp_fail(err, RP_ERANGE,
                                "routing: sequence %d token %d layer %d choice %d has expert id %d, "
                                "but the model has %d experts", s, t, l, j, id, num_experts);
                        if (err) err->sequence = s, err->expert = id;
                        return RP_ERANGE;
                    }
                }
        }
    }
    return RP_OK;
}
