/* runtime.cu: thin wrappers of the CUDA runtime (memory, copies, streams,
 * device facts) for module.c, which includes no CUDA header.  Each returns 0
 * or a cudaError_t value. */
#include <cuda_runtime.h>
#include <stdio.h>

#include "fastattn_cuda.h"

extern "C" {

const char *fa_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int fa_cuda_device_count(int *n)
{
    *n = 0;
    cudaError_t e = cudaGetDeviceCount(n);
    if (e != cudaSuccess) {
        *n = 0;
        (void)cudaGetLastError(); /* clear it so later calls do not report it */
    }
    return (int)e;
}

int fa_cuda_device_name(int dev, char *name, size_t len, int *major, int *minor)
{
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) return (int)e;
    snprintf(name, len, "%s", prop.name);
    *major = prop.major;
    *minor = prop.minor;
    return 0;
}

int fa_cuda_runtime_version(int *v) { return (int)cudaRuntimeGetVersion(v); }
int fa_cuda_driver_version(int *v) { return (int)cudaDriverGetVersion(v); }
int fa_cuda_malloc(void **ptr, size_t nbytes) { return (int)cudaMalloc(ptr, nbytes); }
int fa_cuda_free(void *ptr) { return (int)cudaFree(ptr); }
int fa_cuda_memcpy_htod(void *dst, const void *src, size_t n) { return (int)cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice); }
int fa_cuda_memcpy_dtoh(void *dst, const void *src, size_t n) { return (int)cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost); }
int fa_cuda_synchronize(void) { return (int)cudaDeviceSynchronize(); }
int fa_cuda_stream_synchronize(uintptr_t stream) { return (int)cudaStreamSynchronize((cudaStream_t)stream); }

} /* extern "C" */
