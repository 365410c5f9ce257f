/* Device-memory helpers (kernels/gpu_support.h) for the GPU tests and the CPU calls'
 * dispatch, so that C code needs no CUDA headers. */
#include <cuda_runtime.h>

extern "C" {
#include "internal.h"
}
#include "gpu_support.h"
#include "routepack/gpu.h"

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

extern "C" int rp_gpu_pointer_on_device(const void *ptr)
{
    cudaPointerAttributes at;
    if (!ptr || rp_gpu_count() == 0) return 0;
    if (cudaPointerGetAttributes(&at, ptr) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}
