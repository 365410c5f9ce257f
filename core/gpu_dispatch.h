/* Where a CPU call's routing ids live: the check that sends rp_stats_compute and
 * rp_remap to the CUDA kernels when handed device memory (docs/kernels.md, "Which path
 * runs"). Not installed. */
#ifndef RP_GPU_DISPATCH_H
#define RP_GPU_DISPATCH_H

#include "internal.h"
#include "routepack/batch.h"

/* *on_device = true when the view's id arrays are device (or managed) memory, false
 * when they are host memory, when the view holds no array the call would read, and
 * always without CUDA or a device. Asks CUDA about every array a call would read (which
 * initialises the CUDA runtime on a machine with a GPU). Errors, prefixed with `what`:
 * arrays of one view on both sides (RP_EINVAL, naming the first that differs from the
 * first array, with err->sequence for a per-sequence view); device arrays in a
 * per-sequence or per-layer view (RP_ENOTSUP: the kernels read packed views only).
 * Call after rp_routing_check_shape. */
rp_status gpu_routing_on_device(const rp_routing *r, const rp_batch *batch, const char *what,
                                bool *on_device, rp_error *err);

/* 1 when `ptr` is device or managed memory (0 without CUDA or a device). */
int gpu_on_device(const void *ptr);

/* The kernels report an id out of range with the CPU's message plus " (counted in
 * none)", because they still write their outputs; a forwarding call that returns no
 * result drops the suffix, so both paths give the same text. */
void gpu_error_as_cpu(rp_error *err);

#endif
