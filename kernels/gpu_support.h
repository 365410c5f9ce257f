/* Device-memory helpers for the GPU tests and for the CPU calls that forward device
 * memory to the kernels, so that C code needs no CUDA headers. Private: not installed.
 * Without CUDA they return RP_ENOTSUP (or 0). */
#ifndef RP_GPU_SUPPORT_H
#define RP_GPU_SUPPORT_H

#include "routepack/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Copy `bytes` bytes from the host to a new device allocation (*dev; at least one
 * byte is allocated, so *dev is never NULL on success). Free with rp_gpu_dev_free. */
rp_status rp_gpu_dev_upload(const void *host, size_t bytes, void **dev, rp_error *err);
/* Free a device allocation from rp_gpu_dev_upload; NULL is a no-op. */
void rp_gpu_dev_free(void *dev);
/* 1 when `ptr` is device or managed memory (cudaPointerGetAttributes), the memory the
 * CPU calls hand to the kernels; 0 for pinned or pageable host memory (even where a
 * kernel could read it), NULL, and without CUDA or a device. */
int rp_gpu_pointer_on_device(const void *ptr);

#ifdef __cplusplus
}
#endif
#endif
