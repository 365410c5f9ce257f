/* Device-memory helpers for the GPU tests (kernels/gpu_support.h), so that the test
 * programs stay plain C. */
#include <cuda_runtime.h>

extern "C" {
#include "internal.h"
}
#include "gpu_support.h"

extern "C" rp_status rp_gpu_dev_upload(const void *host, size_t bytes, void **dev, rp_error *err)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e == cudaSuccess && bytes) e = cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        if (p) cudaFree(p);
        (void)cudaGetLastError();
        return rp_fail(err, e == cudaErrorMemoryAllocation ? RP_ENOMEM : RP_EIO,
                       "gpu: copying %zu bytes to the device: %s", bytes, cudaGetErrorString(e));
    }
    *dev = p;
    return RP_OK;
}

extern "C" void rp_gpu_dev_free(void *dev)
{
    if (dev) cudaFree(dev);
}
