/* Where a CPU call's routing ids live (gpu_dispatch.h): host memory stays on the CPU
 * path, device memory goes to the kernels, a view mixing both is an error. */
#include "gpu_dispatch.h"
#include "routepack/gpu.h"
#include "../kernels/gpu_support.h"

#include <string.h>

int gpu_on_device(const void *ptr) { return rp_gpu_pointer_on_device(ptr); }

void gpu_error_as_cpu(rp_error *err)
{
    static const char suffix[] = " (counted in none)";
    const size_t n = sizeof suffix - 1;
    if (!err || err->status != RP_ERANGE) return;
    size_t len = strlen(err->text);
    if (len >= n && strcmp(err->text + len - n, suffix) == 0) err->text[len - n] = '\0';
}

rp_status gpu_routing_on_device(const rp_routing *r, const rp_batch *batch, const char *what,
                                bool *on_device, rp_error *err)
{
    *on_device = false;
    if (rp_gpu_count() == 0) return RP_OK;
    const int32_t n = rp_batch_num_seqs(batch);
    if (rp_batch_num_tokens(batch) == 0) return RP_OK; /* no id is read */
    if (r->layout == RP_ROUTING_PACKED) {
        *on_device = rp_gpu_pointer_on_device(r->base) != 0;
        return RP_OK;
    }
    /* Per-sequence (only non-empty sequences' arrays are read) or per-layer arrays. */
    const bool per_seq = r->layout == RP_ROUTING_PER_SEQ;
    const char *unit = per_seq ? "sequence" : "layer";
    const int32_t count = per_seq ? n : r->num_layers;
    int32_t first = -1;
    for (int32_t i = 0; i < count; i++) {
        if (per_seq && rp_batch_seq_len(batch, i) == 0) continue;
        const bool dev = rp_gpu_pointer_on_device(r->bases[i]) != 0;
        if (first < 0) {
            first = i;
            *on_device = dev;
        } else if (dev != *on_device) {
            rp_fail(err, RP_EINVAL,
                    "%s: the routing ids of %s %d are %s memory but those of %s %d are %s memory; "
                    "the arrays of one view must all be on the host or all on the device",
                    what, unit, first, *on_device ? "device" : "host", unit, i,
                    dev ? "device" : "host");
            if (err && per_seq) err->sequence = i;
            *on_device = false;
            return RP_EINVAL;
        }
    }
    if (*on_device) {
        *on_device = false;
        return rp_fail(err, RP_ENOTSUP,
                       "%s: the routing ids are %s arrays in device memory; the GPU path reads a "
                       "packed [tokens, layers, k] view (rp_routing_packed, any strides)",
                       what, per_seq ? "per-sequence" : "per-layer");
    }
    return RP_OK;
}
