/* A user library that reaches the driver on its own, linked against libcuda.so.1: what a
 * program loads with RTLD_DEEPBIND or into a new dlmopen namespace to get around the hook. Each
 * function starts the driver itself and takes chunks until the driver says no; the bytes it got
 * are the answer. */
#include <dlfcn.h>

#include "cuda_api.h"

#define EXPORT __attribute__((visibility("default")))

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);

static unsigned long long fill(alloc_fn alloc, unsigned long long chunk) {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuCtxCreate_v2(&ctx, 0, dev) != CUDA_SUCCESS)
        return 0;
    unsigned long long total = 0;
    CUdeviceptr d;
    for (int i = 0; i < 1 << 16 && alloc(&d, chunk) == CUDA_SUCCESS; i++) total += chunk;
    return total;
}

/* Direct calls: bound by the dynamic linker in this library's own lookup scope. */
EXPORT unsigned long long deep_fill(unsigned long long chunk) { return fill(cuMemAlloc_v2, chunk); }

/* The next definition after this library, as a wrapper library would find the real one. */
EXPORT unsigned long long deep_next_fill(unsigned long long chunk) {
    alloc_fn next = (alloc_fn)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    return next ? fill(next, chunk) : 0;
}
