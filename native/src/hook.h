/* State shared by the hook's translation units. Nothing here is exported from the library. */
#ifndef FRACGPU_HOOK_H
#define FRACGPU_HOOK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cuda_api.h"
#include "limits.h"

#define FG_EXPORT __attribute__((visibility("default")))

/* Where the device plugin mounts the hook in a container (the test build names a directory of
 * its own). */
#ifndef FG_INSTALLED_HOOK
#define FG_INSTALLED_HOOK FRACGPU_HOOK_LIBRARY
#endif
#define FG_LIKELY(x) __builtin_expect(!!(x), 1)
#define FG_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* What the limits file made of this container. */
typedef enum {
    FG_MODE_INERT = 0,  /* no limits file: pass everything through */
    FG_MODE_ENFORCE = 1,
    FG_MODE_DENY = 2,   /* limits unreadable or accounting unavailable: refuse device memory */
} fg_mode;

typedef struct {
    fg_mode mode;
    bool throttle;      /* compute_percent < 100 */
    fg_limits limits;
} fg_state;

extern fg_state fg;

/* The real driver and NVML entry points, filled from the hook table (hook.c). */
#define FG_CUDA_HOOKS(X)                                                                       \
    X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemFree)     \
    X(cuMemFree_v2) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync)      \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz)                   \
    X(cuMemPoolCreate) X(cuMemPoolTrimTo) X(cuMemPoolDestroy) X(cuMemCreate) X(cuMemRelease)   \
    X(cuMemMap) X(cuMemUnmap) X(cuMemExportToShareableHandle) X(cuArrayCreate_v2)              \
    X(cuArray3DCreate_v2) X(cuArrayCreate) X(cuArray3DCreate) X(cuMemAllocPitch)               \
    X(cuArrayDestroy) X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy) X(cuMemGetInfo)     \
    X(cuMemGetInfo_v2) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuLaunchKernel)            \
    X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)                        \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch)            \
    X(cuGraphLaunch_ptsz) X(cuGraphUpload) X(cuGraphUpload_ptsz)                               \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams)                             \
    X(cuGraphInstantiateWithParams_ptsz) X(cuGraphInstantiate_v2) X(cuGraphExecDestroy)        \
    X(cuDeviceGraphMemTrim) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleUnload)        \
    X(cuGraphAddMemAllocNode) X(cuGraphDestroy) X(cuStreamBeginCapture_v2)                     \
    X(cuStreamEndCapture) X(cuModuleLoad) X(cuModuleLoadFatBinary) X(cuLibraryLoadData)        \
    X(cuLibraryLoadFromFile) X(cuLibraryUnload) X(cuCtxDestroy_v2) X(cuGetProcAddress)         \
    X(cuGetProcAddress_v2) X(cuGraphInstantiate) X(cuStreamBeginCapture)                       \
    X(cuStreamBeginCapture_ptsz) X(cuStreamBeginCapture_v2_ptsz) X(cuStreamEndCapture_ptsz)

/* Driver functions the hook calls but does not replace. */
#define FG_CUDA_USED(X)                                                                        \
    X(cuCtxGetDevice) X(cuCtxGetCurrent) X(cuDeviceGetUuid) X(cuDeviceGetMemPool)              \
    X(cuMemPoolGetAttribute) X(cuMemGetAllocationPropertiesFromHandle)                         \
    X(cuGraphGetNodes) X(cuGraphNodeGetType) X(cuGraphMemAllocNodeGetParams)                   \
    X(cuDeviceGetGraphMemAttribute)

#define FG_NVML_HOOKS(X) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)
#define FG_NVML_USED(X)                                                                        \
    X(nvmlInit_v2) X(nvmlDeviceGetUUID) X(nvmlDeviceGetHandleByUUID)                           \
    X(nvmlDeviceGetUtilizationRates) X(nvmlDeviceGetSamples)

#define FG_REAL_FIELD(name) __typeof__(name) *name;
typedef struct {
    FG_CUDA_HOOKS(FG_REAL_FIELD)
    FG_CUDA_USED(FG_REAL_FIELD)
    FG_NVML_HOOKS(FG_REAL_FIELD)
    FG_NVML_USED(FG_REAL_FIELD)
} fg_real_fns;
#undef FG_REAL_FIELD

extern fg_real_fns fg_real;

/* Load limits and the real driver once; cheap after the first call. */
void fg_init_slow(void);
extern _Atomic int fg_ready;
static inline void fg_init(void) {
    if (FG_UNLIKELY(!atomic_load_explicit(&fg_ready, memory_order_acquire))) fg_init_slow();
}
/* Same for NVML (loaded only by processes that call it, or by the throttle's sampler). */
void fg_init_nvml(void);

/* libc's dlsym (the hook exports its own). */
typedef void *(*fg_dlsym_fn)(void *, const char *);
fg_dlsym_fn fg_real_dlsym(void);

/* One line on stderr, prefixed "fracgpu: ". */
void fg_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* memory.c */
void fg_memory_after_fork(void);
/* Index in the limits' device list of a CUDA ordinal, or -1 when the card was not granted. */
int fg_device_index(CUdevice dev);
int fg_nvml_device_index(nvmlDevice_t dev);

/* graph.c */
void fg_graph_after_fork(void);
/* A stream-ordered allocation of bytes on stream s: recorded if s is capturing. */
void fg_graph_captured(CUstream s, uint64_t bytes);
/* Whether s is being captured (begun through the hook). While it is, the hook makes no driver
 * query of its own for s's allocations: a query may invalidate the capture (seen on an H200 with
 * PyTorch's cudaMallocAsync backend), and what the capture allocates is charged when the graph
 * is instantiated and launched. */
bool fg_graph_capturing(CUstream s);

/* throttle.c: wait for a launch token on the current device (only called when throttling). */
void fg_throttle_acquire(void);
void fg_throttle_after_fork(void);

#endif
