/* A test program that reaches the driver the three ways real programs do:
 *   probe proc ...       dlopen("libcuda.so.1") + cuGetProcAddress_v2 (how the CUDA >= 11.3
 *                        runtime and PyTorch do it); "proc-ptds" asks for per-thread-stream
 *                        variants, "proc-v1" uses the older cuGetProcAddress
 *   probe dlsym ...      dlopen + dlsym of the exported names
 *   probe_direct ...     linked against libcuda.so.1 / libnvidia-ml.so.1 (direct calls)
 * followed by operations, each printing one line "<op> <values...>" (see usage()). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_api.h"

#define F(name) __typeof__(name) *name
static struct {
    F(cuInit); F(cuDeviceGet); F(cuCtxCreate_v2); F(cuCtxSetCurrent); F(cuCtxSynchronize);
    F(cuMemAlloc_v2); F(cuMemAlloc); F(cuMemFree_v2); F(cuMemFree); F(cuMemAllocPitch_v2);
    F(cuMemAllocManaged); F(cuMemAllocAsync); F(cuMemAllocFromPoolAsync); F(cuMemFreeAsync);
    F(cuMemPoolCreate); F(cuMemPoolDestroy); F(cuMemPoolTrimTo); F(cuDeviceGetMemPool);
    F(cuMemCreate); F(cuMemRelease); F(cuArrayCreate_v2); F(cuArray3DCreate_v2);
    F(cuMemAllocPitch); F(cuArrayCreate); F(cuArray3DCreate); F(cuMemAddressReserve);
    F(cuMemAddressFree); F(cuMemMap); F(cuMemUnmap); F(cuModuleUnload); F(cuStreamCreate);
    F(cuStreamBeginCapture_v2); F(cuStreamEndCapture); F(cuGraphAddMemAllocNode);
    F(cuDeviceGraphMemTrim); F(cuModuleLoad); F(cuModuleLoadFatBinary); F(cuLibraryLoadData);
    F(cuLibraryLoadFromFile); F(cuLibraryUnload); F(cuCtxDestroy_v2);
    F(cuMemExportToShareableHandle); F(cuMemImportFromShareableHandle);
    F(cuArrayDestroy); F(cuMipmappedArrayCreate); F(cuMipmappedArrayDestroy);
    F(cuMemGetInfo_v2); F(cuMemGetInfo); F(cuDeviceTotalMem_v2); F(cuDeviceTotalMem);
    F(cuModuleLoadData); F(cuModuleGetFunction); F(cuLaunchKernel); F(cuLaunchKernelEx);
    F(cuLaunchCooperativeKernel); F(cuGraphCreate); F(cuGraphInstantiateWithFlags);
    F(cuGraphLaunch);
    F(nvmlInit_v2); F(nvmlDeviceGetHandleByIndex_v2); F(nvmlDeviceGetMemoryInfo);
    F(nvmlDeviceGetMemoryInfo_v2); F(nvmlDeviceGetUtilizationRates);
} api;

static void die(const char *what) {
    fprintf(stderr, "probe: %s\n", what);
    exit(2);
}

#ifdef PROBE_DIRECT
static void load(const char *mode) {
    (void)mode;
#define D(n) api.n = n;
    D(cuInit) D(cuDeviceGet) D(cuCtxCreate_v2) D(cuCtxSetCurrent) D(cuCtxSynchronize)
    D(cuMemAlloc_v2) D(cuMemAlloc) D(cuMemFree_v2) D(cuMemFree) D(cuMemAllocPitch_v2)
    D(cuMemAllocManaged) D(cuMemAllocAsync) D(cuMemAllocFromPoolAsync) D(cuMemFreeAsync)
    D(cuMemPoolCreate) D(cuMemPoolDestroy) D(cuMemPoolTrimTo) D(cuDeviceGetMemPool)
    D(cuMemCreate) D(cuMemRelease) D(cuArrayCreate_v2) D(cuArray3DCreate_v2) D(cuArrayDestroy)
    D(cuMemAllocPitch) D(cuArrayCreate) D(cuArray3DCreate) D(cuMemAddressReserve)
    D(cuMemAddressFree) D(cuMemMap) D(cuMemUnmap) D(cuModuleUnload) D(cuStreamCreate)
    D(cuStreamBeginCapture_v2) D(cuStreamEndCapture) D(cuGraphAddMemAllocNode)
    D(cuDeviceGraphMemTrim) D(cuModuleLoad) D(cuModuleLoadFatBinary) D(cuLibraryLoadData)
    D(cuLibraryLoadFromFile) D(cuLibraryUnload) D(cuCtxDestroy_v2)
    D(cuMemExportToShareableHandle) D(cuMemImportFromShareableHandle)
    D(cuMipmappedArrayCreate) D(cuMipmappedArrayDestroy) D(cuMemGetInfo_v2) D(cuMemGetInfo)
    D(cuDeviceTotalMem_v2) D(cuDeviceTotalMem) D(cuModuleLoadData) D(cuModuleGetFunction)
    D(cuLaunchKernel) D(cuLaunchKernelEx) D(cuLaunchCooperativeKernel) D(cuGraphCreate)
    D(cuGraphInstantiateWithFlags) D(cuGraphLaunch) D(nvmlInit_v2)
    D(nvmlDeviceGetHandleByIndex_v2) D(nvmlDeviceGetMemoryInfo) D(nvmlDeviceGetMemoryInfo_v2)
    D(nvmlDeviceGetUtilizationRates)
#undef D
}
#else
static void load(const char *mode) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!cuda || !nvml) die(dlerror());
    bool by_proc = strncmp(mode, "proc", 4) == 0;
    cuuint64_t flags = strcmp(mode, "proc-ptds") == 0 ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                      : CU_GET_PROC_ADDRESS_DEFAULT;
    __typeof__(cuGetProcAddress_v2) *gpa2 = NULL;
    __typeof__(cuGetProcAddress) *gpa1 = NULL;
    if (by_proc) {
        gpa2 = (__typeof__(gpa2))dlsym(cuda, "cuGetProcAddress_v2");
        gpa1 = (__typeof__(gpa1))dlsym(cuda, "cuGetProcAddress");
        if (!gpa2 || !gpa1) die("no cuGetProcAddress");
        /* As the runtime does: resolve cuGetProcAddress through itself, then use that. */
        void *self = NULL;
        if (gpa2("cuGetProcAddress", &self, 12040, 0, NULL) != CUDA_SUCCESS || !self)
            die("cuGetProcAddress cannot resolve itself");
        gpa2 = (__typeof__(gpa2))self;
    }
    /* exported name, base name for cuGetProcAddress, version asked */
#define R(field, base, version)                                                                \
    do {                                                                                       \
        void *p = NULL;                                                                        \
        if (!by_proc) {                                                                        \
            p = dlsym(cuda, #field);                                                           \
        } else if (strcmp(mode, "proc-v1") == 0) {                                             \
            if (gpa1(base, &p, version, flags) != CUDA_SUCCESS) p = NULL;                      \
        } else {                                                                               \
            CUdriverProcAddressQueryResult st;                                                 \
            if (gpa2(base, &p, version, flags, &st) != CUDA_SUCCESS) p = NULL;                 \
        }                                                                                      \
        if (!p) die("cannot resolve " #field);                                                 \
        api.field = (__typeof__(api.field))p;                                                  \
    } while (0)
    R(cuInit, "cuInit", 12040);
    R(cuDeviceGet, "cuDeviceGet", 12040);
    R(cuCtxCreate_v2, "cuCtxCreate", 12040);
    R(cuCtxSetCurrent, "cuCtxSetCurrent", 12040);
    R(cuCtxSynchronize, "cuCtxSynchronize", 12040);
    R(cuMemAlloc_v2, "cuMemAlloc", 12040);
    R(cuMemAlloc, "cuMemAlloc", 2000);
    R(cuMemFree_v2, "cuMemFree", 12040);
    R(cuMemFree, "cuMemFree", 2000);
    R(cuMemAllocPitch_v2, "cuMemAllocPitch", 12040);
    R(cuMemAllocManaged, "cuMemAllocManaged", 12040);
    R(cuMemAllocAsync, "cuMemAllocAsync", 12040);
    R(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 12040);
    R(cuMemFreeAsync, "cuMemFreeAsync", 12040);
    R(cuMemPoolCreate, "cuMemPoolCreate", 12040);
    R(cuMemPoolDestroy, "cuMemPoolDestroy", 12040);
    R(cuMemPoolTrimTo, "cuMemPoolTrimTo", 12040);
    R(cuDeviceGetMemPool, "cuDeviceGetMemPool", 12040);
    R(cuMemCreate, "cuMemCreate", 12040);
    R(cuMemRelease, "cuMemRelease", 12040);
    R(cuArrayCreate_v2, "cuArrayCreate", 12040);
    R(cuArray3DCreate_v2, "cuArray3DCreate", 12040);
    R(cuArrayDestroy, "cuArrayDestroy", 12040);
    R(cuMemAllocPitch, "cuMemAllocPitch", 2000);
    R(cuArrayCreate, "cuArrayCreate", 2000);
    R(cuArray3DCreate, "cuArray3DCreate", 2000);
    R(cuMemAddressReserve, "cuMemAddressReserve", 12040);
    R(cuMemAddressFree, "cuMemAddressFree", 12040);
    R(cuMemMap, "cuMemMap", 12040);
    R(cuMemUnmap, "cuMemUnmap", 12040);
    R(cuModuleUnload, "cuModuleUnload", 12040);
    R(cuStreamCreate, "cuStreamCreate", 12040);
    R(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 12040);
    R(cuStreamEndCapture, "cuStreamEndCapture", 12040);
    R(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 12040);
    R(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 12040);
    R(cuModuleLoad, "cuModuleLoad", 12040);
    R(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 12040);
    R(cuLibraryLoadData, "cuLibraryLoadData", 12040);
    R(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 12040);
    R(cuLibraryUnload, "cuLibraryUnload", 12040);
    R(cuCtxDestroy_v2, "cuCtxDestroy", 12040);
    R(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 12040);
    R(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 12040);
    R(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 12040);
    R(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 12040);
    R(cuMemGetInfo_v2, "cuMemGetInfo", 12040);
    R(cuMemGetInfo, "cuMemGetInfo", 2000);
    R(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 12040);
    R(cuDeviceTotalMem, "cuDeviceTotalMem", 2000);
    R(cuModuleLoadData, "cuModuleLoadData", 12040);
    R(cuModuleGetFunction, "cuModuleGetFunction", 12040);
    R(cuLaunchKernel, "cuLaunchKernel", 12040);
    R(cuLaunchKernelEx, "cuLaunchKernelEx", 12040);
    R(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 12040);
    R(cuGraphCreate, "cuGraphCreate", 12040);
    R(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 12040);
    R(cuGraphLaunch, "cuGraphLaunch", 12040);
#undef R
#define N(field)                                                                               \
    do {                                                                                       \
        api.field = (__typeof__(api.field))dlsym(nvml, #field);                                \
        if (!api.field) die("cannot resolve " #field);                                         \
    } while (0)
    N(nvmlInit_v2);
    N(nvmlDeviceGetHandleByIndex_v2);
    N(nvmlDeviceGetMemoryInfo);
    N(nvmlDeviceGetMemoryInfo_v2);
    N(nvmlDeviceGetUtilizationRates);
#undef N
}
#endif

typedef enum { L_PTR, L_PTR1, L_ASYNC, L_VMM, L_ARRAY, L_MIPMAP, L_MODULE, L_LIBRARY } lkind;
typedef struct { lkind kind; uint64_t v; } live_t;
static live_t live[1 << 16];
static int nlive;
static CUcontext ctx;
static CUmemoryPool pool;
static CUfunction fn;

static void push(lkind k, uint64_t v) {
    if (nlive < (int)(sizeof live / sizeof live[0])) live[nlive++] = (live_t){k, v};
}

static CUresult free_one(live_t l) {
    switch (l.kind) {
    case L_PTR: return api.cuMemFree_v2(l.v);
    case L_PTR1: return api.cuMemFree((CUdeviceptr_v1)l.v);
    case L_ASYNC: return api.cuMemFreeAsync(l.v, NULL);
    case L_VMM: return api.cuMemRelease(l.v);
    case L_ARRAY: return api.cuArrayDestroy((CUarray)(uintptr_t)l.v);
    case L_MODULE: return api.cuModuleUnload((CUmodule)(uintptr_t)l.v);
    case L_LIBRARY: return api.cuLibraryUnload((CUlibrary)(uintptr_t)l.v);
    default: return api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)l.v);
    }
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

typedef struct { uint64_t size, total; } thread_arg;
static void *thread_fill(void *p) {
    thread_arg *a = p;
    api.cuCtxSetCurrent(ctx);
    CUdeviceptr d;
    int misses = 0;
    while (misses < 20) {
        if (api.cuMemAlloc_v2(&d, a->size) == CUDA_SUCCESS) {
            a->total += a->size;
            misses = 0;
        } else {
            misses++;
        }
    }
    return NULL;
}

static CUresult launch_one(const char *kind, CUgraphExec exec) {
    if (strcmp(kind, "ex") == 0) {
        CUlaunchConfig c = {1, 1, 1, 32, 1, 1, 0, NULL, NULL, 0};
        return api.cuLaunchKernelEx(&c, fn, NULL, NULL);
    }
    if (strcmp(kind, "coop") == 0)
        return api.cuLaunchCooperativeKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL);
    if (strcmp(kind, "graph") == 0) return api.cuGraphLaunch(exec, NULL);
    return api.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
}

/* Load the user library next to this program (tests/deep_lib.c) and run one of its fills. */
static long long deep(const char *how, unsigned long long chunk) {
    char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 16);
    if (n <= 0) die("readlink");
    path[n] = '\0';
    strcpy(strrchr(path, '/') + 1, "libdeep.so");
    void *h;
    const char *fn = "deep_fill";
    if (strcmp(how, "deepbind") == 0) {
        h = dlopen(path, RTLD_NOW | RTLD_DEEPBIND);
    } else if (strcmp(how, "dlmopen") == 0) {
        h = dlmopen(LM_ID_NEWLM, path, RTLD_NOW);
    } else {
        h = dlopen(path, RTLD_NOW);
        fn = "deep_next_fill";
    }
    if (!h) return -1;
    unsigned long long (*fill)(unsigned long long) =
        (unsigned long long (*)(unsigned long long))dlsym(h, fn);
    return fill ? (long long)fill(chunk) : -2;
}

/* Pinned device memory on card 0, as cuMemCreate takes it. */
static CUmemAllocationProp device_prop(void) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    return prop;
}

/* rounds x (cuMemCreate, reserve, cuMemMap, cuMemRelease, and with unmap also cuMemUnmap and
 * the address range freed); the number of rounds whose cuMemCreate succeeded. */
static unsigned vmm_rounds(uint64_t bytes, unsigned rounds, bool unmap) {
    unsigned ok = 0;
    for (unsigned k = 0; k < rounds; k++) {
        CUmemAllocationProp prop = device_prop();
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        if (api.cuMemCreate(&h, bytes, &prop, 0) != CUDA_SUCCESS) continue;
        ok++;
        if (api.cuMemAddressReserve(&va, bytes, 0, 0, 0) != CUDA_SUCCESS ||
            api.cuMemMap(va, bytes, 0, h, 0) != CUDA_SUCCESS || api.cuMemRelease(h) != CUDA_SUCCESS)
            die("vmm map");
        if (unmap && (api.cuMemUnmap(va, bytes) != CUDA_SUCCESS ||
                      api.cuMemAddressFree(va, bytes) != CUDA_SUCCESS))
            die("vmm unmap");
    }
    return ok;
}

/* rounds x (cuMemCreate, export, import the descriptor as a second handle, release the first,
 * map the imported one, release it): what another process importing the memory would do; the
 * mappings stay. The number of rounds that got their memory mapped. */
static unsigned vmm_import_rounds(uint64_t bytes, unsigned rounds) {
    unsigned ok = 0;
    for (unsigned k = 0; k < rounds; k++) {
        CUmemAllocationProp prop = device_prop();
        CUmemGenericAllocationHandle h, imported;
        CUdeviceptr va;
        int fd = -1;
        if (api.cuMemCreate(&h, bytes, &prop, 0) != CUDA_SUCCESS) continue;
        if (api.cuMemExportToShareableHandle(&fd, h, 1, 0) != CUDA_SUCCESS ||
            api.cuMemImportFromShareableHandle(&imported, (void *)(intptr_t)fd, 1) != CUDA_SUCCESS ||
            api.cuMemRelease(h) != CUDA_SUCCESS ||
            api.cuMemAddressReserve(&va, bytes, 0, 0, 0) != CUDA_SUCCESS)
            die("vmm import");
        if (api.cuMemMap(va, bytes, 0, imported, 0) == CUDA_SUCCESS) ok++;
        api.cuMemRelease(imported);
    }
    return ok;
}

static void usage(void) {
    fprintf(stderr,
            "usage: probe {proc|proc-ptds|proc-v1|dlsym} OP...   (probe_direct OP...)\n"
            "OP: init alloc:N alloc1:N pitch:W:H managed:N async:N pool:N vmm:N array:W:H\n"
            "    array3d:W:H:D mipmap:W:H:L free freeall trim pooldestroy info info1 total\n"
            "    total1 nvml fill:N threads:T:N ready launch:MS:KIND util sleep:MS fork-alloc:N\n"
            "    bench-launch:N bench-alloc:N:SIZE deepbind:N dlmopen:N next:N pitch1:W:H\n"
            "    array1:W:H array3d1:W:H:D vmmleak:N:K vmmcycle:N:K rawclone-alloc:N rawclone-free\n"
            "    zombie-alloc:N await:PATH module:N graphalloc:N capture:N:K graphtrim\n"
            "    modulefile:N fatbin:N library:N libraryfile:N ctxdestroy poolon:DEV:N\n"
            "    vmmimport:N:K pace:MS:PERIOD_US:SKIP_MS\n");
    exit(2);
}

int main(int argc, char **argv) {
    int first = 1;
#ifndef PROBE_DIRECT
    if (argc < 2) usage();
    load(argv[1]);
    first = 2;
#else
    load("direct");
#endif
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = first; i < argc; i++) {
        const char *op = argv[i];
        unsigned long long a = 0, b = 0, c = 0;
        char kind[16] = "kernel";
        if (strcmp(op, "init") == 0) {
            CUdevice dev;
            CUresult r = api.cuInit(0);
            if (r == CUDA_SUCCESS) r = api.cuDeviceGet(&dev, 0);
            if (r == CUDA_SUCCESS) r = api.cuCtxCreate_v2(&ctx, 0, dev);
            CUmodule m;
            if (r == CUDA_SUCCESS) r = api.cuModuleLoadData(&m, "fake image");
            if (r == CUDA_SUCCESS) r = api.cuModuleGetFunction(&fn, m, "kernel");
            printf("init %d\n", r);
        } else if (sscanf(op, "alloc:%llu", &a) == 1) {
            CUdeviceptr d;
            CUresult r = api.cuMemAlloc_v2(&d, a);
            if (r == CUDA_SUCCESS) push(L_PTR, d);
            printf("alloc %d\n", r);
        } else if (sscanf(op, "alloc1:%llu", &a) == 1) {
            CUdeviceptr_v1 d;
            CUresult r = api.cuMemAlloc(&d, (unsigned)a);
            if (r == CUDA_SUCCESS) push(L_PTR1, d);
            printf("alloc1 %d\n", r);
        } else if (sscanf(op, "pitch:%llu:%llu", &a, &b) == 2) {
            CUdeviceptr d;
            size_t pitch = 0;
            CUresult r = api.cuMemAllocPitch_v2(&d, &pitch, a, b, 4);
            if (r == CUDA_SUCCESS) push(L_PTR, d);
            printf("pitch %d %llu\n", r, (unsigned long long)pitch * b);
        } else if (sscanf(op, "pitch1:%llu:%llu", &a, &b) == 2) {
            CUdeviceptr_v1 d;
            unsigned pitch = 0;
            CUresult r = api.cuMemAllocPitch(&d, &pitch, (unsigned)a, (unsigned)b, 4);
            if (r == CUDA_SUCCESS) push(L_PTR1, d);
            printf("pitch1 %d %llu\n", r, (unsigned long long)pitch * b);
        } else if (sscanf(op, "array1:%llu:%llu", &a, &b) == 2) {
            CUDA_ARRAY_DESCRIPTOR_v1 d = {(unsigned)a, (unsigned)b, CU_AD_FORMAT_FLOAT, 1};
            CUarray arr;
            CUresult r = api.cuArrayCreate(&arr, &d);
            if (r == CUDA_SUCCESS) push(L_ARRAY, (uint64_t)(uintptr_t)arr);
            printf("array1 %d\n", r);
        } else if (sscanf(op, "array3d1:%llu:%llu:%llu", &a, &b, &c) == 3) {
            CUDA_ARRAY3D_DESCRIPTOR_v1 d = {(unsigned)a, (unsigned)b, (unsigned)c,
                                            CU_AD_FORMAT_FLOAT, 1, 0};
            CUarray arr;
            CUresult r = api.cuArray3DCreate(&arr, &d);
            if (r == CUDA_SUCCESS) push(L_ARRAY, (uint64_t)(uintptr_t)arr);
            printf("array3d1 %d\n", r);
        } else if (sscanf(op, "vmmleak:%llu:%llu", &a, &b) == 2) {
            printf("vmmleak %u\n", vmm_rounds(a, (unsigned)b, false));
        } else if (sscanf(op, "vmmimport:%llu:%llu", &a, &b) == 2) {
            printf("vmmimport %u\n", vmm_import_rounds(a, (unsigned)b));
        } else if (sscanf(op, "vmmcycle:%llu:%llu", &a, &b) == 2) {
            printf("vmmcycle %u\n", vmm_rounds(a, (unsigned)b, true));
        } else if (sscanf(op, "managed:%llu", &a) == 1) {
            CUdeviceptr d;
            CUresult r = api.cuMemAllocManaged(&d, a, 1);
            if (r == CUDA_SUCCESS) push(L_PTR, d);
            printf("managed %d\n", r);
        } else if (sscanf(op, "async:%llu", &a) == 1) {
            CUdeviceptr d;
            CUresult r = api.cuMemAllocAsync(&d, a, NULL);
            if (r == CUDA_SUCCESS) push(L_ASYNC, d);
            printf("async %d\n", r);
        } else if (sscanf(op, "poolon:%llu:%llu", &a, &b) == 2) {
            /* A pool on card a (whichever card the context is on), one allocation of b. */
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = 1;
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = (int)a;
            CUmemoryPool p;
            CUdeviceptr d;
            CUresult r = api.cuMemPoolCreate(&p, &props);
            if (r == CUDA_SUCCESS) r = api.cuMemAllocFromPoolAsync(&d, b, p, NULL);
            printf("poolon %d\n", r);
        } else if (sscanf(op, "pool:%llu", &a) == 1) {
            if (!pool) {
                CUmemPoolProps props;
                memset(&props, 0, sizeof props);
                props.allocType = 1;
                props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                if (api.cuMemPoolCreate(&pool, &props) != CUDA_SUCCESS) die("pool create");
            }
            CUdeviceptr d;
            CUresult r = api.cuMemAllocFromPoolAsync(&d, a, pool, NULL);
            if (r == CUDA_SUCCESS) push(L_ASYNC, d);
            printf("pool %d\n", r);
        } else if (sscanf(op, "vmm:%llu", &a) == 1) {
            CUmemAllocationProp prop = device_prop();
            CUmemGenericAllocationHandle h;
            CUresult r = api.cuMemCreate(&h, a, &prop, 0);
            if (r == CUDA_SUCCESS) push(L_VMM, h);
            printf("vmm %d\n", r);
        } else if (sscanf(op, "array3d:%llu:%llu:%llu", &a, &b, &c) == 3) {
            CUDA_ARRAY3D_DESCRIPTOR d = {a, b, c, CU_AD_FORMAT_FLOAT, 1, 0};
            CUarray arr;
            CUresult r = api.cuArray3DCreate_v2(&arr, &d);
            if (r == CUDA_SUCCESS) push(L_ARRAY, (uint64_t)(uintptr_t)arr);
            printf("array3d %d\n", r);
        } else if (sscanf(op, "array:%llu:%llu", &a, &b) == 2) {
            CUDA_ARRAY_DESCRIPTOR d = {a, b, CU_AD_FORMAT_FLOAT, 1};
            CUarray arr;
            CUresult r = api.cuArrayCreate_v2(&arr, &d);
            if (r == CUDA_SUCCESS) push(L_ARRAY, (uint64_t)(uintptr_t)arr);
            printf("array %d\n", r);
        } else if (sscanf(op, "mipmap:%llu:%llu:%llu", &a, &b, &c) == 3) {
            CUDA_ARRAY3D_DESCRIPTOR d = {a, b, 0, CU_AD_FORMAT_FLOAT, 1, 0};
            CUmipmappedArray arr;
            CUresult r = api.cuMipmappedArrayCreate(&arr, &d, (unsigned)c);
            if (r == CUDA_SUCCESS) push(L_MIPMAP, (uint64_t)(uintptr_t)arr);
            printf("mipmap %d\n", r);
        } else if (strcmp(op, "free") == 0) {
            if (!nlive) die("nothing to free");
            printf("free %d\n", free_one(live[--nlive]));
        } else if (strcmp(op, "freeasync") == 0 || strcmp(op, "freesync") == 0) {
            /* Free the last allocation with the other family's call (cuMemFreeAsync for
             * cuMemAlloc memory, cuMemFree for stream-ordered memory). */
            if (!nlive) die("nothing to free");
            live_t l = live[--nlive];
            CUresult r = op[4] == 'a' ? api.cuMemFreeAsync(l.v, NULL) : api.cuMemFree_v2(l.v);
            printf("%s %d\n", op, r);
        } else if (strcmp(op, "freeall") == 0) {
            CUresult worst = CUDA_SUCCESS;
            while (nlive) {
                CUresult r = free_one(live[--nlive]);
                if (r != CUDA_SUCCESS) worst = r;
            }
            printf("freeall %d\n", worst);
        } else if (strcmp(op, "trim") == 0) {
            CUmemoryPool dflt;
            CUresult r = api.cuDeviceGetMemPool(&dflt, 0);
            if (r == CUDA_SUCCESS) r = api.cuMemPoolTrimTo(dflt, 0);
            if (r == CUDA_SUCCESS && pool) r = api.cuMemPoolTrimTo(pool, 0);
            printf("trim %d\n", r);
        } else if (strcmp(op, "pooldestroy") == 0) {
            CUresult r = pool ? api.cuMemPoolDestroy(pool) : CUDA_ERROR_INVALID_VALUE;
            for (int k = 0; k < nlive;)
                if (live[k].kind == L_ASYNC) live[k] = live[--nlive]; else k++;
            pool = NULL;
            printf("pooldestroy %d\n", r);
        } else if (strcmp(op, "info") == 0) {
            size_t f = 0, t = 0;
            CUresult r = api.cuMemGetInfo_v2(&f, &t);
            printf("info %d %zu %zu\n", r, f, t);
        } else if (strcmp(op, "info1") == 0) {
            unsigned f = 0, t = 0;
            CUresult r = api.cuMemGetInfo(&f, &t);
            printf("info1 %d %u %u\n", r, f, t);
        } else if (strcmp(op, "total") == 0) {
            size_t t = 0;
            CUresult r = api.cuDeviceTotalMem_v2(&t, 0);
            printf("total %d %zu\n", r, t);
        } else if (strcmp(op, "total1") == 0) {
            unsigned t = 0;
            CUresult r = api.cuDeviceTotalMem(&t, 0);
            printf("total1 %d %u\n", r, t);
        } else if (strcmp(op, "nvml") == 0) {
            nvmlDevice_t d;
            nvmlMemory_t m = {0, 0, 0};
            nvmlMemory_v2_t m2 = {(unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)), 0, 0, 0, 0};
            nvmlReturn_t r = api.nvmlInit_v2();
            if (r == NVML_SUCCESS) r = api.nvmlDeviceGetHandleByIndex_v2(0, &d);
            if (r == NVML_SUCCESS) r = api.nvmlDeviceGetMemoryInfo(d, &m);
            if (r == NVML_SUCCESS) r = api.nvmlDeviceGetMemoryInfo_v2(d, &m2);
            printf("nvml %d %llu %llu %llu %llu %llu %llu\n", r, m.total, m.free, m.used, m2.total,
                   m2.free, m2.used);
        } else if (sscanf(op, "fill:%llu", &a) == 1) {
            unsigned long long n = 0;
            CUdeviceptr d;
            CUresult r;
            while ((r = api.cuMemAlloc_v2(&d, a)) == CUDA_SUCCESS) {
                push(L_PTR, d);
                n++;
            }
            printf("fill %llu %d\n", n, r);
        } else if (sscanf(op, "threads:%llu:%llu", &a, &b) == 2) {
            pthread_t t[64];
            thread_arg args[64];
            unsigned long long total = 0;
            if (a > 64) a = 64;
            for (unsigned k = 0; k < a; k++) {
                args[k] = (thread_arg){b, 0};
                pthread_create(&t[k], NULL, thread_fill, &args[k]);
            }
            for (unsigned k = 0; k < a; k++) {
                pthread_join(t[k], NULL);
                total += args[k].total;
            }
            printf("threads %llu\n", total);
        } else if (strcmp(op, "ready") == 0) {
            printf("ready\n");
            fflush(stdout);
            for (;;) pause();
        } else if (sscanf(op, "launch:%llu:%15s", &a, kind) >= 1) {
            CUgraphExec exec = NULL;
            if (strcmp(kind, "graph") == 0) {
                CUgraph g;
                if (api.cuGraphCreate(&g, 0) != CUDA_SUCCESS ||
                    api.cuGraphInstantiateWithFlags(&exec, g, 0) != CUDA_SUCCESS)
                    die("graph");
            }
            uint64_t end = now_ns() + a * 1000000ull;
            unsigned long long n = 0;
            CUresult r = CUDA_SUCCESS;
            while (now_ns() < end && (r = launch_one(kind, exec)) == CUDA_SUCCESS) n++;
            api.cuCtxSynchronize();
            printf("launch %d %llu\n", r, n);
        } else if (strcmp(op, "util") == 0) {
            nvmlDevice_t d;
            nvmlUtilization_t u = {0, 0};
            nvmlReturn_t r = api.nvmlInit_v2();
            if (r == NVML_SUCCESS) r = api.nvmlDeviceGetHandleByIndex_v2(0, &d);
            if (r == NVML_SUCCESS) r = api.nvmlDeviceGetUtilizationRates(d, &u);
            printf("util %d %u\n", r, u.gpu);
        } else if (sscanf(op, "fork-alloc:%llu", &a) == 1) {
            /* A child of this process allocates and exits without freeing (normal exit). */
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                CUdeviceptr d;
                printf("child-alloc %d\n", api.cuMemAlloc_v2(&d, a));
                exit(0);
            }
            int status = 0;
            waitpid(pid, &status, 0);
            printf("fork-alloc %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        } else if (sscanf(op, "deepbind:%llu", &a) == 1 || sscanf(op, "dlmopen:%llu", &a) == 1 ||
                   sscanf(op, "next:%llu", &a) == 1) {
            char how[16];
            snprintf(how, sizeof how, "%.*s", (int)(strchr(op, ':') - op), op);
            printf("%s %lld\n", how, deep(how, a));
        } else if (sscanf(op, "rawclone-alloc:%llu", &a) == 1 || strcmp(op, "rawclone-free") == 0) {
            /* A child made with the clone system call itself: no fork handlers run in it. It
             * allocates (or frees the parent's last allocation) and exits normally. */
            fflush(stdout);
            pid_t pid = (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
            if (pid == 0) {
                CUdeviceptr d;
                CUresult r = a ? api.cuMemAlloc_v2(&d, a) : free_one(live[nlive - 1]);
                printf("child %d\n", r);
                exit(0);
            }
            int status = 0;
            waitpid(pid, &status, 0);
            printf("rawclone %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        } else if (sscanf(op, "zombie-alloc:%llu", &a) == 1) {
            /* A child allocates and ends without its exit handlers; it stays a zombie, unreaped. */
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                CUdeviceptr d;
                printf("child %d\n", api.cuMemAlloc_v2(&d, a));
                fflush(stdout);
                _exit(0);
            }
            siginfo_t si;
            waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT);
            printf("zombie %d\n", (int)pid);
        } else if (sscanf(op, "module:%llu", &a) == 1 || sscanf(op, "modulefile:%llu", &a) == 1 ||
                   sscanf(op, "fatbin:%llu", &a) == 1 || sscanf(op, "library:%llu", &a) == 1 ||
                   sscanf(op, "libraryfile:%llu", &a) == 1) {
            /* An image holding a bytes of device globals, loaded each way the driver offers. */
            char image[64], path[64], how[16];
            snprintf(image, sizeof image, "fake globals=%llu", a);
            snprintf(how, sizeof how, "%.*s", (int)(strchr(op, ':') - op), op);
            snprintf(path, sizeof path, "/tmp/fracgpu-probe-%d.image", (int)getpid());
            if (strstr(how, "file")) {
                FILE *f = fopen(path, "w");
                if (!f || fputs(image, f) < 0 || fclose(f) != 0) die("image file");
            }
            void *h = NULL;
            CUresult r;
            if (strcmp(how, "module") == 0)
                r = api.cuModuleLoadData((CUmodule *)&h, image);
            else if (strcmp(how, "modulefile") == 0)
                r = api.cuModuleLoad((CUmodule *)&h, path);
            else if (strcmp(how, "fatbin") == 0)
                r = api.cuModuleLoadFatBinary((CUmodule *)&h, image);
            else if (strcmp(how, "library") == 0)
                r = api.cuLibraryLoadData((CUlibrary *)&h, image, NULL, NULL, 0, NULL, NULL, 0);
            else
                r = api.cuLibraryLoadFromFile((CUlibrary *)&h, path, NULL, NULL, 0, NULL, NULL, 0);
            if (strstr(how, "file")) unlink(path);
            if (r == CUDA_SUCCESS) push(strncmp(how, "lib", 3) == 0 ? L_LIBRARY : L_MODULE,
                                        (uint64_t)(uintptr_t)h);
            printf("%s %d\n", how, r);
        } else if (sscanf(op, "graphalloc:%llu", &a) == 1 ||
                   sscanf(op, "capture:%llu:%llu", &a, &b) == 2) {
            /* A graph with memory nodes, added explicitly or recorded by capturing b
             * cuMemAllocAsync calls on a stream; instantiated and launched once. The launch's
             * allocations are left live (freed by "free" as pointers). */
            CUgraph g = NULL;
            CUgraphExec x;
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            CUresult r;
            bool capture = op[0] == 'c';
            if (!capture) {
                CUgraphNode node;
                p.poolProps.allocType = 1;
                p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                p.bytesize = a;
                r = api.cuGraphCreate(&g, 0);
                if (r == CUDA_SUCCESS) r = api.cuGraphAddMemAllocNode(&node, g, NULL, 0, &p);
                if (r == CUDA_SUCCESS) push(L_PTR, p.dptr);
            } else {
                CUstream st;
                r = api.cuStreamCreate(&st, 0);
                if (r == CUDA_SUCCESS) r = api.cuStreamBeginCapture_v2(st, 0);
                for (unsigned long long k = 0; r == CUDA_SUCCESS && k < b; k++) {
                    CUdeviceptr d;
                    r = api.cuMemAllocAsync(&d, a, st);
                    if (r == CUDA_SUCCESS) push(L_PTR, d);
                }
                if (r == CUDA_SUCCESS) r = api.cuStreamEndCapture(st, &g);
            }
            if (r != CUDA_SUCCESS) die("graph setup");
            /* Out of memory may come at instantiation or at launch. */
            r = api.cuGraphInstantiateWithFlags(&x, g, 0);
            if (r == CUDA_SUCCESS) r = api.cuGraphLaunch(x, NULL);
            printf("%s %d\n", capture ? "capture" : "graphalloc", r);
        } else if (strcmp(op, "ctxdestroy") == 0) {
            /* The driver frees the context's linear memory; a new context takes its place. */
            CUresult r = api.cuCtxDestroy_v2(ctx);
            if (r == CUDA_SUCCESS) r = api.cuCtxCreate_v2(&ctx, 0, 0);
            nlive = 0;
            printf("ctxdestroy %d\n", r);
        } else if (strcmp(op, "graphtrim") == 0) {
            printf("graphtrim %d\n", api.cuDeviceGraphMemTrim(0));
        } else if (strncmp(op, "await:", 6) == 0) {
            struct stat st;
            while (stat(op + 6, &st) != 0) usleep(1000);
            printf("await 0\n");
        } else if (sscanf(op, "sleep:%llu", &a) == 1) {
            usleep((useconds_t)(a * 1000));
            printf("sleep 0\n");
        } else if (sscanf(op, "pace:%llu:%llu:%llu", &a, &b, &c) == 3) {
            /* A paced workload: every PERIOD_US one kernel, waited for; how long each took from
             * its launch to its end (µs; the token wait, the queue ahead of it and itself), over
             * the kernels launched after the first SKIP_MS: median, 99th percentile, worst. */
            static uint64_t lat[200000];
            unsigned long long n = 0, kept = 0;
            uint64_t t0 = now_ns(), end = t0 + a * 1000000ull, skip = t0 + c * 1000000ull;
            CUresult r = CUDA_SUCCESS;
            for (uint64_t next = t0; now_ns() < end && r == CUDA_SUCCESS; n++) {
                uint64_t t = now_ns();
                r = api.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
                if (r == CUDA_SUCCESS) r = api.cuCtxSynchronize();
                if (t >= skip && kept < sizeof lat / sizeof lat[0]) lat[kept++] = now_ns() - t;
                next += b * 1000ull;
                uint64_t now = now_ns();
                if (next > now) {
                    struct timespec ts = {(time_t)((next - now) / 1000000000ull),
                                          (long)((next - now) % 1000000000ull)};
                    nanosleep(&ts, NULL);
                }
            }
            qsort(lat, kept, sizeof lat[0], cmp_u64);
            printf("pace %d %llu %llu %llu %llu\n", r, n,
                   kept ? (unsigned long long)lat[kept / 2] / 1000 : 0,
                   kept ? (unsigned long long)lat[kept * 99 / 100] / 1000 : 0,
                   kept ? (unsigned long long)lat[kept - 1] / 1000 : 0);
        } else if (sscanf(op, "bench-launch:%llu", &a) == 1) {
            uint64_t t0 = now_ns();
            for (unsigned long long k = 0; k < a; k++)
                api.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
            printf("bench-launch %.2f\n", (double)(now_ns() - t0) / (double)a);
        } else if (sscanf(op, "bench-alloc:%llu:%llu", &a, &b) == 2) {
            CUdeviceptr d;
            uint64_t t0 = now_ns();
            for (unsigned long long k = 0; k < a; k++) {
                if (api.cuMemAlloc_v2(&d, b) != CUDA_SUCCESS) die("bench alloc");
                api.cuMemFree_v2(d);
            }
            printf("bench-alloc %.2f\n", (double)(now_ns() - t0) / (double)a);
        } else {
            usage();
        }
    }
    return 0;
}
