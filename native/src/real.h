/* The real driver and NVML entry points: every name the hook replaces or calls, listed once,
 * and the slot (in fg_real) that holds the driver's own function once it is resolved. */
#ifndef FRACGPU_REAL_H
#define FRACGPU_REAL_H

#include <stdbool.h>
#include <stddef.h>

#include "cuda_api.h"

/* The driver functions the hook replaces: each has an entry point of the same name in the hook
 * (interpose.c names them all). */
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

/* NULL until resolved, and for a name the loaded driver lacks: every caller checks its slot. */
extern fg_real_fns fg_real;

/* One name of the lists above and where its real function goes. */
typedef struct {
    const char *name;
    void **slot; /* a field of fg_real */
    bool nvml;   /* resolved from libnvidia-ml, else from libcuda */
} fg_real_entry;

/* Every name of the four lists, once, in their order. */
extern const fg_real_entry fg_real_table[];
extern const size_t fg_real_table_len;

/* Fill the slots of libcuda's names (nvml false) or NVML's from the library at handle, with
 * libc's dlsym: a name the library lacks gets NULL. */
void fg_real_resolve(void *handle, bool nvml);

#endif
