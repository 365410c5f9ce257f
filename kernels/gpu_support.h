/* Device-memory helpers for the GPU tests, so that test programs stay plain C and need
 * no CUDA headers. Private: not installed. Without CUDA they return RP_ENOTSUP. */
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

#ifdef __cplusplus
}
#endif
#endif
