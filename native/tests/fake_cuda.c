/* A fake libcuda.so.1 for GPU-less tests: simulated device memory, memory pools, VMM handles,
 * arrays, kernels and graphs on a simulated clock. Strict like the real driver: every call before
 * cuInit fails with CUDA_ERROR_NOT_INITIALIZED, calls without a current context fail with
 * CUDA_ERROR_INVALID_CONTEXT, unknown pointers and handles are rejected, and device memory runs
 * out at the simulated card's size.
 *
 * Linked -Bsymbolic: its entry points that call one another (the _ptsz forms, cuModuleLoad) do
 * so inside the library, not through whatever a preloaded library exports under the same name.
 *
 * Environment (test-only knobs): FAKE_CUDA_DEVICES (1), FAKE_CUDA_MEMORY_MIB (16384),
 * FAKE_CUDA_KERNEL_US (0: kernels take no simulated time), FAKE_CUDA_QUEUE_US (20000: how far
 * ahead of the clock launches may queue before a launch blocks), FAKE_CUDA_GRAPH_KERNELS (4),
 * FAKE_CUDA_NO_GRAPH_NODES (0; 1: cuGraphGetNodes is not supported), FAKE_CUDA_SHARED_CARD
 * (unset: each process has a card of its own; a file path: every process that names the same
 * file runs its kernels on one card, as processes of several containers do on a real one).
 *
 * Graph memory as the driver documents it: memory nodes (added explicitly, or recorded by
 * stream capture of cuMemAllocAsync) take nothing until the graph is launched; then they come
 * from a per-card graph pool that grows in chunks and keeps what it reserved until
 * cuDeviceGraphMemTrim. A module image "fake globals=N" holds N bytes of device globals from
 * cuModuleLoadData until cuModuleUnload. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8
#define MAGIC_CTX 0x43545831u
#define MAGIC_POOL 0x504f4f4cu
#define MAGIC_ARRAY 0x41525259u
#define MAGIC_MOD 0x4d4f4431u
#define MAGIC_FN 0x464e4331u
#define MAGIC_GRAPH 0x47524631u
#define MAGIC_EXEC 0x47455831u
#define CHUNK (32ull << 20)
#define UTIL_WINDOW_NS 100000000ull

struct CUctx_st { unsigned magic; int dev; };
struct CUmemPoolHandle_st { unsigned magic; int dev; uint64_t reserved, used; };
struct CUarray_st { unsigned magic; int dev; uint64_t bytes; };
struct CUmipmappedArray_st { unsigned magic; int dev; uint64_t bytes; };
#define MAGIC_NODE 0x4e4f4431u
#define MAGIC_STREAM 0x53545231u
#define MAX_NODES 64
struct CUmod_st { unsigned magic; int dev; uint64_t bytes; };
struct CUlib_st { unsigned magic; int dev; uint64_t bytes; };
#define MAGIC_LIB 0x4c494231u
struct CUfunc_st { unsigned magic; };
struct CUgraphNode_st { unsigned magic; CUgraphNodeType type; uint64_t bytes; CUdeviceptr dptr; };
struct CUgraph_st { unsigned magic; int dev; size_t n; struct CUgraphNode_st nodes[MAX_NODES]; };
struct CUgraphExec_st {
    unsigned magic; unsigned kernels; int dev; size_t n; struct CUgraphNode_st nodes[MAX_NODES];
};
struct CUstream_st { unsigned magic; CUgraph capture; };

typedef enum { A_PTR = 1, A_PTR_V1, A_POOL, A_VMM, A_VA, A_MAP, A_GRAPH } akind;
/* A_VMM: maps counts live mappings, released once cuMemRelease was called; A_MAP: a mapping
 * at key of bytes, of handle; A_VA: a reserved address range. */
typedef struct {
    uint64_t key; akind kind; int dev; uint64_t bytes; CUmemoryPool pool;
    uint64_t handle; int maps; bool released; CUcontext ctx;
} alloc_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool initialised;
static int ndev = 1;
static uint64_t dev_total = 16384ull << 20;
static uint64_t dev_used[MAX_DEV];
static alloc_t *allocs;
static size_t nallocs, capallocs;
static uint64_t next_addr = 0x7f0000000000ull, next_addr_v1 = 0x10000000ull, next_handle = 1;
static struct CUmemPoolHandle_st default_pool[MAX_DEV];
static struct CUmemPoolHandle_st *current_pool[MAX_DEV];
static _Thread_local CUcontext current;
static uint64_t kernel_ns, queue_ns = 20000000ull;
static uint64_t graph_reserved[MAX_DEV], graph_used[MAX_DEV];
static unsigned graph_kernels = 4;

/* The simulated clock: the card runs kernels one after another; busy intervals are kept, with
 * the process that ran them, so NVML can report utilisation over its window, the card's and each
 * process's. The timeline is this process's own, or (FAKE_CUDA_SHARED_CARD) lives in a file that
 * every process naming it maps, guarded by a process-shared robust mutex (a process killed while
 * holding it leaves the card usable), so the kernels of several processes serialize on one card
 * and the card's samples count them all, as on a real card. CLOCK_MONOTONIC is the machine's, so
 * the processes' times compare. */
typedef struct { uint64_t start, end; int pid; } span;
#define SPANS 8192
#define MAGIC_CARD 0x43415244u
typedef struct {
    unsigned magic;
    pthread_mutex_t mu;
    uint64_t busy_until[MAX_DEV];
    size_t nspan[MAX_DEV];
    span spans[MAX_DEV][SPANS];
} card_timeline;
static card_timeline own_card = {.mu = PTHREAD_MUTEX_INITIALIZER};
static card_timeline *card = &own_card;
/* When this process's last kernel on each card ends: what cuCtxSynchronize waits for (on a
 * shared card, not the other processes' work queued after it). Under the card's lock. */
static uint64_t own_until[MAX_DEV];

static void card_lock(void) {
    if (pthread_mutex_lock(&card->mu) == EOWNERDEAD) pthread_mutex_consistent(&card->mu);
}
static void card_unlock(void) { pthread_mutex_unlock(&card->mu); }

/* Map the shared timeline named by FAKE_CUDA_SHARED_CARD; the first process to open the file
 * (under flock, so two starting at once do not both) sizes it and makes its mutex. On any
 * failure the process keeps a card of its own and says so. */
static void attach_shared_card(void) {
    const char *path = getenv("FAKE_CUDA_SHARED_CARD");
    if (!path || !*path) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    struct stat st;
    void *m = MAP_FAILED;
    if (fd >= 0 && flock(fd, LOCK_EX) == 0 && fstat(fd, &st) == 0 &&
        ((size_t)st.st_size >= sizeof(card_timeline) ||
         ftruncate(fd, sizeof(card_timeline)) == 0))
        m = mmap(NULL, sizeof(card_timeline), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED) {
        card_timeline *shared = m;
        if (shared->magic != MAGIC_CARD) {
            pthread_mutexattr_t a;
            pthread_mutexattr_init(&a);
            pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
            pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
            pthread_mutex_init(&shared->mu, &a);
            pthread_mutexattr_destroy(&a);
            shared->magic = MAGIC_CARD;
        }
        card = shared;
    } else {
        fprintf(stderr, "fake libcuda: FAKE_CUDA_SHARED_CARD %s unusable; card is private\n", path);
    }
    if (fd >= 0) {
        /* Unlocked by hand: the mapping keeps the open file, and with it a flock, alive. */
        flock(fd, LOCK_UN);
        close(fd);
    }
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}

#define NEED_INIT() \
    do { if (!atomic_load(&initialised)) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() \
    do { NEED_INIT(); if (!current) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!atomic_load(&initialised)) {
        ndev = (int)env_u64("FAKE_CUDA_DEVICES", 1);
        if (ndev < 1 || ndev > MAX_DEV) ndev = 1;
        dev_total = env_u64("FAKE_CUDA_MEMORY_MIB", 16384) << 20;
        kernel_ns = env_u64("FAKE_CUDA_KERNEL_US", 0) * 1000;
        queue_ns = env_u64("FAKE_CUDA_QUEUE_US", 20000) * 1000;
        graph_kernels = (unsigned)env_u64("FAKE_CUDA_GRAPH_KERNELS", 4);
        attach_shared_card();
        for (int i = 0; i < MAX_DEV; i++) {
            default_pool[i] = (struct CUmemPoolHandle_st){MAGIC_POOL, i, 0, 0};
            current_pool[i] = &default_pool[i];
        }
        atomic_store(&initialised, true);
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 12040;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n) {
    NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = ndev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

/* Card i's UUID is GPU-10111213-1415-1617-1819-1a1b1c1d1e0<i>. */
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    NEED_INIT();
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    for (int k = 0; k < 15; k++) u->bytes[k] = (char)(0x10 + k);
    u->bytes[15] = (char)d;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = dev_total;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d) {
    size_t b;
    CUresult r = cuDeviceTotalMem_v2(&b, d);
    if (r == CUDA_SUCCESS) *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned)b;
    return r;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice d) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    CUcontext c = calloc(1, sizeof *c);
    c->magic = MAGIC_CTX;
    c->dev = d;
    current = c;
    *ctx = c;
    return CUDA_SUCCESS;
}

static void remove_locked(alloc_t *a);

/* As the driver does, destroying a context frees the linear memory allocated in it. */
EXPORT CUresult cuCtxDestroy_v2(CUcontext c) {
    NEED_INIT();
    if (!c || c->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nallocs;) {
        alloc_t *a = &allocs[i];
        if ((a->kind == A_PTR || a->kind == A_PTR_V1) && a->ctx == c) {
            dev_used[a->dev] -= a->bytes;
            remove_locked(a);
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&mu);
    c->magic = 0;
    if (current == c) current = NULL;
    free(c);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
    NEED_INIT();
    if (c && c->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    current = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *c) {
    NEED_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = current;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    NEED_CTX();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    *d = current->dev;
    return CUDA_SUCCESS;
}

/* ---- memory ------------------------------------------------------------------------------ */

static alloc_t *find_locked(uint64_t key, akind kind) {
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].key == key && allocs[i].kind == kind) return &allocs[i];
    return NULL;
}

static void add_locked(uint64_t key, akind kind, int dev, uint64_t bytes, CUmemoryPool pool) {
    if (nallocs == capallocs) {
        capallocs = capallocs ? capallocs * 2 : 64;
        allocs = realloc(allocs, capallocs * sizeof *allocs);
    }
    allocs[nallocs++] = (alloc_t){key, kind, dev, bytes, pool, 0, 0, false, current};
}

static void remove_locked(alloc_t *a) { *a = allocs[--nallocs]; }

static CUresult take_device_memory_locked(int dev, uint64_t bytes) {
    if (bytes > dev_total - dev_used[dev]) return CUDA_ERROR_OUT_OF_MEMORY;
    dev_used[dev] += bytes;
    return CUDA_SUCCESS;
}

static CUresult alloc_ptr(CUdeviceptr *p, uint64_t bytes, akind kind) {
    NEED_CTX();
    if (!p || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = take_device_memory_locked(current->dev, bytes);
    if (r == CUDA_SUCCESS) {
        uint64_t *next = kind == A_PTR_V1 ? &next_addr_v1 : &next_addr;
        *p = *next;
        *next += (bytes + 511) & ~511ull;
        add_locked(*p, kind, current->dev, bytes, NULL);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static CUresult free_key(uint64_t key, akind kind, CUresult bad) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(key, kind);
    if (!a) {
        pthread_mutex_unlock(&mu);
        return bad;
    }
    dev_used[a->dev] -= a->bytes;
    remove_locked(a);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) { return alloc_ptr(p, bytes, A_PTR); }
EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *p, unsigned int bytes) {
    CUdeviceptr wide = 0;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = alloc_ptr(&wide, bytes, A_PTR_V1);
    if (r == CUDA_SUCCESS) *p = (CUdeviceptr_v1)wide;
    return r;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned int flags) {
    if (flags != 1 && flags != 2) return CUDA_ERROR_INVALID_VALUE; /* GLOBAL or HOST */
    return alloc_ptr(p, bytes, A_PTR);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h,
                                   unsigned int elem) {
    NEED_CTX();
    if (!pitch || w == 0 || h == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pt = (w + 511) & ~(size_t)511;
    CUresult r = alloc_ptr(p, (uint64_t)pt * h, A_PTR);
    if (r == CUDA_SUCCESS) *pitch = pt;
    return r;
}
EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *p, unsigned int *pitch, unsigned int w,
                                unsigned int h, unsigned int elem) {
    NEED_CTX();
    if (!p || !pitch || w == 0 || h == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t pt = ((uint64_t)w + 511) & ~511ull;
    if (pt > 0xffffffffu) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr wide = 0;
    CUresult r = alloc_ptr(&wide, pt * h, A_PTR_V1);
    if (r == CUDA_SUCCESS) {
        *p = (CUdeviceptr_v1)wide;
        *pitch = (unsigned)pt;
    }
    return r;
}
static CUresult free_pool_allocation(CUdeviceptr d);
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    if (p == 0) return atomic_load(&initialised) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = free_key(p, A_PTR, CUDA_ERROR_INVALID_VALUE);
    /* As with cudaFree, stream-ordered (and graph) memory may be freed here too. */
    return r == CUDA_ERROR_INVALID_VALUE ? free_pool_allocation(p) : r;
}
EXPORT CUresult cuMemFree(CUdeviceptr_v1 p) {
    if (p == 0) return atomic_load(&initialised) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    return free_key(p, A_PTR_V1, CUDA_ERROR_INVALID_VALUE);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    NEED_CTX();
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *free_b = dev_total - dev_used[current->dev];
    *total_b = dev_total;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    size_t f, t;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    if (r == CUDA_SUCCESS) {
        *free_b = f > 0xffffffffu ? 0xffffffffu : (unsigned)f;
        *total_b = t > 0xffffffffu ? 0xffffffffu : (unsigned)t;
    }
    return r;
}

/* ---- pools ---------------------------------------------------------------------------------- */

static bool pool_ok(CUmemoryPool p) { return p && p->magic == MAGIC_POOL; }

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *p, CUdevice d) {
    NEED_INIT();
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *p = &default_pool[d];
    return CUDA_SUCCESS;
}
/* Streams being captured, and whether a pool query broke their capture: the fake is strict
 * where a real H200 was (PyTorch's capture, invalidated while the hook queried the pool). */
static atomic_int captures;
static atomic_bool capture_broken;
static void query_during_capture(void) {
    if (atomic_load(&captures) > 0) atomic_store(&capture_broken, true);
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *p, CUdevice d) {
    NEED_INIT();
    query_during_capture();
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *p = current_pool[d];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *p, const CUmemPoolProps *props) {
    NEED_INIT();
    if (!p || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        props->location.id < 0 || props->location.id >= ndev)
        return CUDA_ERROR_INVALID_VALUE;
    CUmemoryPool pool = calloc(1, sizeof *pool);
    pool->magic = MAGIC_POOL;
    pool->dev = props->location.id;
    *p = pool;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool p) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    if (!pool_ok(p) || (p >= &default_pool[0] && p < &default_pool[MAX_DEV])) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < nallocs;)
        if (allocs[i].kind == A_POOL && allocs[i].pool == p)
            remove_locked(&allocs[i]);
        else
            i++;
    dev_used[p->dev] -= p->reserved;
    p->magic = 0;
    pthread_mutex_unlock(&mu);
    free(p);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool p, CUmemPool_attribute a, void *v) {
    NEED_INIT();
    query_during_capture();
    if (!pool_ok(p) || !v) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    if (a == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        *(cuuint64_t *)v = p->reserved;
    else if (a == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        *(cuuint64_t *)v = p->used;
    else if (a == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        *(cuuint64_t *)v = 0;
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&mu);
    return r;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep) {
    NEED_INIT();
    if (!pool_ok(p)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    uint64_t target = p->used > keep ? p->used : keep;
    target = (target + (2ull << 20) - 1) & ~((2ull << 20) - 1);
    if (target < p->reserved) {
        dev_used[p->dev] -= p->reserved - target;
        p->reserved = target;
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytes, CUmemoryPool p, CUstream s) {
    NEED_CTX();
    if (!dptr || bytes == 0 || !pool_ok(p)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    if (p->used + bytes > p->reserved) {
        uint64_t grow = (p->used + bytes - p->reserved + CHUNK - 1) / CHUNK * CHUNK;
        r = take_device_memory_locked(p->dev, grow);
        if (r == CUDA_SUCCESS) p->reserved += grow;
    }
    if (r == CUDA_SUCCESS) {
        p->used += bytes;
        *dptr = next_addr;
        next_addr += (bytes + 511) & ~511ull;
        add_locked(*dptr, A_POOL, p->dev, bytes, p);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static CUresult free_pool_allocation(CUdeviceptr d);
static bool capturing(CUstream s);
static CUresult capture_node(CUstream s, CUgraphNodeType type, uint64_t bytes, CUdeviceptr *d);

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s) {
    NEED_CTX();
    if (capturing(s)) {
        if (!d || n == 0) return CUDA_ERROR_INVALID_VALUE;
        return capture_node(s, CU_GRAPH_NODE_TYPE_MEM_ALLOC, n, d);
    }
    return pool_alloc(d, n, current_pool[current->dev], s);
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s) {
    return cuMemAllocAsync(d, n, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s) {
    return pool_alloc(d, n, p, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t n, CUmemoryPool p,
                                             CUstream s) {
    return pool_alloc(d, n, p, s);
}
static CUresult free_pool_allocation(CUdeviceptr d) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(d, A_POOL);
    if (a) {
        a->pool->used -= a->bytes; /* stays reserved in the pool until trimmed */
        remove_locked(a);
    } else if ((a = find_locked(d, A_GRAPH)) != NULL) {
        graph_used[a->dev] -= a->bytes; /* stays reserved until cuDeviceGraphMemTrim */
        remove_locked(a);
    }
    pthread_mutex_unlock(&mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static bool capturing(CUstream s) { return s && s->magic == MAGIC_STREAM && s->capture; }

/* Stream capture records a memory node instead of allocating; its address is fixed now. */
static CUresult capture_node(CUstream s, CUgraphNodeType type, uint64_t bytes, CUdeviceptr *d) {
    CUgraph g = s->capture;
    if (g->n == MAX_NODES) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    CUdeviceptr p = d && type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? next_addr : (d ? *d : 0);
    if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) next_addr += (bytes + 511) & ~511ull;
    pthread_mutex_unlock(&mu);
    g->nodes[g->n++] = (struct CUgraphNode_st){MAGIC_NODE, type, bytes, p};
    if (d) *d = p;
    return CUDA_SUCCESS;
}

/* Frees stream-ordered memory, and cuMemAlloc memory as well (the driver allows both). */
EXPORT CUresult cuMemFreeAsync(CUdeviceptr d, CUstream s) {
    if (capturing(s)) return capture_node(s, CU_GRAPH_NODE_TYPE_MEM_FREE, 0, &d);
    CUresult r = free_pool_allocation(d);
    return r == CUDA_ERROR_INVALID_VALUE ? free_key(d, A_PTR, r) : r;
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, CUstream s) { return cuMemFreeAsync(d, s); }

/* ---- VMM ------------------------------------------------------------------------------------ */

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                            const CUmemAllocationProp *prop, unsigned long long flags) {
    NEED_INIT();
    if (!h || !prop || bytes == 0 || flags != 0 ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
        prop->location.id >= ndev || bytes % (2u << 20) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = take_device_memory_locked(prop->location.id, bytes);
    if (r == CUDA_SUCCESS) {
        *h = next_handle++;
        add_locked(*h, A_VMM, prop->location.id, bytes, NULL);
        allocs[nallocs - 1].handle = *h; /* its physical memory: its own */
    }
    pthread_mutex_unlock(&mu);
    return r;
}
/* As the driver documents: the physical memory of a handle is freed once the handle is released
 * and no mapping of it is left, whichever comes last. */
static void vmm_maybe_free_locked(alloc_t *h) {
    if (!h->released || h->maps > 0) return;
    uint64_t backing = h->handle, bytes = h->bytes;
    int dev = h->dev;
    remove_locked(h);
    /* Handles imported from an exported one share its memory: the last one frees it. */
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].kind == A_VMM && allocs[i].handle == backing) return;
    dev_used[dev] -= bytes;
}

/* Export as a POSIX file descriptor (type 1); the fake's "descriptor" names the memory. */
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) {
    NEED_INIT();
    if (!out || type != 1 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(h, A_VMM);
    if (a && !a->released) *(int *)out = (int)a->handle;
    pthread_mutex_unlock(&mu);
    return a && !a->released ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A new handle to the same physical memory (the descriptor is passed by value, as for the
 * driver). */
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os,
                                               int type) {
    NEED_INIT();
    if (!h || type != 1) return CUDA_ERROR_INVALID_VALUE;
    uint64_t backing = (uint64_t)(uintptr_t)os;
    pthread_mutex_lock(&mu);
    alloc_t *src = NULL;
    for (size_t i = 0; i < nallocs && !src; i++)
        if (allocs[i].kind == A_VMM && allocs[i].handle == backing) src = &allocs[i];
    if (src) {
        int dev = src->dev;
        uint64_t bytes = src->bytes;
        *h = next_handle++;
        add_locked(*h, A_VMM, dev, bytes, NULL);
        allocs[nallocs - 1].handle = backing;
    }
    pthread_mutex_unlock(&mu);
    return src ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                       CUmemGenericAllocationHandle h) {
    NEED_INIT();
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(h, A_VMM);
    if (a) {
        memset(prop, 0, sizeof *prop);
        prop->type = 1;
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = a->dev;
    }
    pthread_mutex_unlock(&mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(h, A_VMM);
    if (!a || a->released) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    a->released = true;
    vmm_maybe_free_locked(a);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    NEED_INIT();
    if (!ptr || size == 0 || size % (2u << 20) != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    next_addr = (next_addr + (2ull << 20) - 1) & ~((2ull << 20) - 1);
    *ptr = next_addr;
    next_addr += size;
    add_locked(*ptr, A_VA, 0, size, NULL);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(ptr, A_VA);
    CUresult r = a && a->bytes == size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) remove_locked(a);
    pthread_mutex_unlock(&mu);
    return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle h, unsigned long long flags) {
    NEED_INIT();
    if (size == 0 || flags != 0 || size % (2u << 20) != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    alloc_t *a = find_locked(h, A_VMM);
    CUresult r = CUDA_SUCCESS;
    if (!a || a->released || offset + size > a->bytes || find_locked(ptr, A_MAP))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        a->maps++;
        add_locked(ptr, A_MAP, a->dev, size, NULL);
        allocs[nallocs - 1].handle = h;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Unmaps every mapping that starts in [ptr, ptr + size). */
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    int found = 0;
    for (size_t i = 0; i < nallocs;) {
        alloc_t *m = &allocs[i];
        if (m->kind != A_MAP || m->key < ptr || m->key - ptr >= size) {
            i++;
            continue;
        }
        uint64_t h = m->handle;
        remove_locked(m);
        found++;
        alloc_t *a = find_locked(h, A_VMM);
        if (a) {
            a->maps--;
            vmm_maybe_free_locked(a);
        }
        i = 0; /* removal moved entries around */
    }
    pthread_mutex_unlock(&mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- arrays ------------------------------------------------------------------------------- */

static uint64_t texel(CUarray_format f, unsigned ch) {
    uint64_t b = 0;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF:
        b = 2; break;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT:
        b = 4; break;
    default: return 0;
    }
    return (ch == 1 || ch == 2 || ch == 4) ? b * ch : 0;
}
static uint64_t one(size_t v) { return v ? v : 1; }

static CUresult make_array(void **out, unsigned magic, uint64_t bytes) {
    NEED_CTX();
    if (!out || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = take_device_memory_locked(current->dev, bytes);
    pthread_mutex_unlock(&mu);
    if (r != CUDA_SUCCESS) return r;
    struct CUarray_st *a = calloc(1, sizeof *a);
    *a = (struct CUarray_st){magic, current->dev, bytes};
    *out = a;
    return CUDA_SUCCESS;
}
static CUresult drop_array(void *p, unsigned magic) {
    NEED_INIT();
    struct CUarray_st *a = p;
    if (!a || a->magic != magic) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    dev_used[a->dev] -= a->bytes;
    pthread_mutex_unlock(&mu);
    a->magic = 0;
    free(a);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *out, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return make_array((void **)out, MAGIC_ARRAY,
                      one(d->Width) * one(d->Height) * texel(d->Format, d->NumChannels));
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *out, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return make_array((void **)out, MAGIC_ARRAY,
                      one(d->Width) * one(d->Height) * one(d->Depth) *
                          texel(d->Format, d->NumChannels));
}
EXPORT CUresult cuArrayCreate(CUarray *out, const CUDA_ARRAY_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return make_array((void **)out, MAGIC_ARRAY,
                      one(d->Width) * one(d->Height) * texel(d->Format, d->NumChannels));
}
EXPORT CUresult cuArray3DCreate(CUarray *out, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return make_array((void **)out, MAGIC_ARRAY,
                      one(d->Width) * one(d->Height) * one(d->Depth) *
                          texel(d->Format, d->NumChannels));
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return drop_array(a, MAGIC_ARRAY); }
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *out, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int levels) {
    if (!d || levels == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < levels; l++) {
        total += one(w) * one(h) * one(z) * texel(d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : w;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return make_array((void **)out, MAGIC_ARRAY + 1, total);
}
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    return drop_array(a, MAGIC_ARRAY + 1);
}

/* ---- kernels, graphs and the clock -------------------------------------------------------- */

static struct CUfunc_st the_function = {MAGIC_FN};

/* Modules, graphs, executable graphs and streams come from fixed tables, as long-lived as the
 * driver's own objects (the leak checker sees them reachable), and are never reused. */
#define MAX_OBJECTS 256
#define TAKE(table, counter) \
    (atomic_load(&counter) < MAX_OBJECTS ? &table[atomic_fetch_add(&counter, 1) % MAX_OBJECTS] : NULL)
static struct CUmod_st module_table[MAX_OBJECTS];
static atomic_int nmodules;

static struct CUlib_st library_table[MAX_OBJECTS];
static atomic_int nlibraries;

/* The globals an image holds on the card ("fake globals=N"); out of memory when they do not fit. */
static CUresult take_globals(const void *image, uint64_t *bytes) {
    const char *text = image, *tag = "fake globals=";
    *bytes = strncmp(text, tag, strlen(tag)) == 0 ? strtoull(text + strlen(tag), NULL, 10) : 0;
    pthread_mutex_lock(&mu);
    CUresult r = take_device_memory_locked(current->dev, *bytes);
    pthread_mutex_unlock(&mu);
    return r;
}

static void give_back(int dev, uint64_t bytes) {
    pthread_mutex_lock(&mu);
    dev_used[dev] -= bytes;
    pthread_mutex_unlock(&mu);
}

EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    NEED_CTX();
    if (!m || !image) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes;
    CUresult r = take_globals(image, &bytes);
    if (r != CUDA_SUCCESS) return r;
    CUmodule mod = TAKE(module_table, nmodules);
    if (!mod) {
        give_back(current->dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *mod = (struct CUmod_st){MAGIC_MOD, current->dev, bytes};
    *m = mod;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
    return cuModuleLoadData(m, fatbin);
}
/* The image a file holds; false when it cannot be read. */
static bool read_image(const char *path, char *image, size_t size) {
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return false;
    size_t n = fread(image, 1, size - 1, f);
    fclose(f);
    image[n] = '\0';
    return true;
}

EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path) {
    NEED_CTX();
    char image[256];
    return read_image(path, image, sizeof image) ? cuModuleLoadData(m, image)
                                                 : CUDA_ERROR_NOT_FOUND;
}
EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, int *jo, void **jv,
                                  unsigned int nj, int *lo, void **lv, unsigned int nl) {
    NEED_CTX();
    if (!lib || !code) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes;
    CUresult r = take_globals(code, &bytes);
    if (r != CUDA_SUCCESS) return r;
    CUlibrary l = TAKE(library_table, nlibraries);
    if (!l) {
        give_back(current->dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *l = (struct CUlib_st){MAGIC_LIB, current->dev, bytes};
    *lib = l;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *path, int *jo, void **jv,
                                      unsigned int nj, int *lo, void **lv, unsigned int nl) {
    NEED_CTX();
    char image[256];
    return read_image(path, image, sizeof image)
               ? cuLibraryLoadData(lib, image, jo, jv, nj, lo, lv, nl)
               : CUDA_ERROR_NOT_FOUND;
}
EXPORT CUresult cuLibraryUnload(CUlibrary l) {
    NEED_INIT();
    if (!l || l->magic != MAGIC_LIB) return CUDA_ERROR_INVALID_HANDLE;
    give_back(l->dev, l->bytes);
    l->magic = 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, int *options,
                                   void **values) {
    return cuModuleLoadData(m, image);
}
EXPORT CUresult cuModuleUnload(CUmodule m) {
    NEED_INIT();
    if (!m || m->magic != MAGIC_MOD) return CUDA_ERROR_INVALID_HANDLE;
    give_back(m->dev, m->bytes);
    m->magic = 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    NEED_CTX();
    if (!f || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != MAGIC_MOD) return CUDA_ERROR_INVALID_HANDLE;
    *f = &the_function;
    return CUDA_SUCCESS;
}

/* Queue work of ns on the current card; block while the queue is too far ahead of the clock. */
static CUresult run_work(uint64_t ns) {
    int d = current->dev;
    int pid = getpid(); /* not cached: a forked child runs its own kernels */
    card_lock();
    uint64_t now = now_ns();
    if (card->busy_until[d] < now) card->busy_until[d] = now;
    uint64_t start = card->busy_until[d];
    card->busy_until[d] += ns;
    if (ns) {
        size_t n = card->nspan[d];
        span *last = n ? &card->spans[d][(n - 1) % SPANS] : NULL;
        if (last && last->end == start && last->pid == pid)
            last->end = card->busy_until[d];
        else
            card->spans[d][card->nspan[d]++ % SPANS] = (span){start, card->busy_until[d], pid};
    }
    own_until[d] = card->busy_until[d];
    uint64_t ahead = card->busy_until[d] - now;
    card_unlock();
    if (ahead > queue_ns) {
        uint64_t wait = ahead - queue_ns;
        struct timespec ts = {(time_t)(wait / 1000000000ull), (long)(wait % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz) {
    NEED_CTX();
    if (!f || f->magic != MAGIC_FN) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    /* Kernels that take no simulated time cost nothing more: the benchmark's baseline. */
    return kernel_ns ? run_work(kernel_ns) : CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel(FRACGPU_LAUNCH_PARAMS, void **extra) {
    if (capturing(stream)) return capture_node(stream, CU_GRAPH_NODE_TYPE_KERNEL, 0, NULL);
    return launch(f, gx, gy, gz, bx, by, bz);
}
EXPORT CUresult cuLaunchKernel_ptsz(FRACGPU_LAUNCH_PARAMS, void **extra) {
    return launch(f, gx, gy, gz, bx, by, bz);
}
EXPORT CUresult cuLaunchCooperativeKernel(FRACGPU_LAUNCH_PARAMS) {
    return launch(f, gx, gy, gz, bx, by, bz);
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(FRACGPU_LAUNCH_PARAMS) {
    return launch(f, gx, gy, gz, bx, by, bz);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                  c->blockDimZ);
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    return cuLaunchKernelEx(c, f, p, e);
}

static bool graph_ok(CUgraph g) { return g && g->magic == MAGIC_GRAPH; }
static struct CUgraph_st graph_table[MAX_OBJECTS];
static struct CUgraphExec_st exec_table[MAX_OBJECTS];
static struct CUstream_st stream_table[MAX_OBJECTS];
static atomic_int ngraphs, nexecs, nstreams;

EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned int flags) {
    NEED_CTX();
    if (!g || flags) return CUDA_ERROR_INVALID_VALUE;
    CUgraph graph = TAKE(graph_table, ngraphs);
    if (!graph) return CUDA_ERROR_OUT_OF_MEMORY;
    graph->magic = MAGIC_GRAPH;
    graph->dev = current->dev;
    *g = graph;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphDestroy(CUgraph g) {
    NEED_INIT();
    if (!graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    g->magic = 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                       size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    NEED_CTX();
    if (!node || !graph_ok(g) || !p || p->bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (g->n == MAX_NODES) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    p->dptr = next_addr;
    next_addr += (p->bytesize + 511) & ~511ull;
    pthread_mutex_unlock(&mu);
    g->nodes[g->n] = (struct CUgraphNode_st){MAGIC_NODE, CU_GRAPH_NODE_TYPE_MEM_ALLOC, p->bytesize,
                                             p->dptr};
    *node = &g->nodes[g->n++];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                      size_t ndeps, CUdeviceptr d) {
    NEED_CTX();
    if (!node || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    if (g->n == MAX_NODES) return CUDA_ERROR_OUT_OF_MEMORY;
    g->nodes[g->n] = (struct CUgraphNode_st){MAGIC_NODE, CU_GRAPH_NODE_TYPE_MEM_FREE, 0, d};
    *node = &g->nodes[g->n++];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *count) {
    NEED_INIT();
    /* FAKE_CUDA_NO_GRAPH_NODES=1: a driver that cannot list a graph's nodes. */
    if (env_u64("FAKE_CUDA_NO_GRAPH_NODES", 0)) return CUDA_ERROR_NOT_SUPPORTED;
    if (!graph_ok(g) || !count) return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *count = g->n;
        return CUDA_SUCCESS;
    }
    size_t k = 0;
    for (; k < *count && k < g->n; k++) nodes[k] = &g->nodes[k];
    *count = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphNodeGetType(CUgraphNode n, CUgraphNodeType *t) {
    NEED_INIT();
    if (!n || n->magic != MAGIC_NODE || !t) return CUDA_ERROR_INVALID_VALUE;
    *t = n->type;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    NEED_INIT();
    if (!n || n->magic != MAGIC_NODE || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || !p)
        return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->bytesize = n->bytes;
    p->dptr = n->dptr;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *x, CUgraph g, unsigned long long fl) {
    NEED_CTX();
    if (!x || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    CUgraphExec e = TAKE(exec_table, nexecs);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EXEC;
    e->kernels = graph_kernels;
    e->dev = g->dev;
    e->n = g->n;
    memcpy(e->nodes, g->nodes, sizeof g->nodes);
    *x = e;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecDestroy(CUgraphExec x) {
    NEED_INIT();
    if (!x || x->magic != MAGIC_EXEC) return CUDA_ERROR_INVALID_VALUE;
    x->magic = 0;
    return CUDA_SUCCESS;
}

/* A launch makes the graph's allocations (refused while the last launch's are still live) from
 * the card's graph pool, growing it in chunks, then runs its frees. */
static CUresult graph_memory(CUgraphExec x) {
    uint64_t need = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < x->n; i++) {
        if (x->nodes[i].type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
        if (find_locked(x->nodes[i].dptr, A_GRAPH)) {
            pthread_mutex_unlock(&mu);
            return CUDA_ERROR_INVALID_VALUE;
        }
        need += x->nodes[i].bytes;
    }
    int d = x->dev;
    CUresult r = CUDA_SUCCESS;
    if (graph_used[d] + need > graph_reserved[d]) {
        uint64_t grow = (graph_used[d] + need - graph_reserved[d] + CHUNK - 1) / CHUNK * CHUNK;
        r = take_device_memory_locked(d, grow);
        if (r == CUDA_SUCCESS) graph_reserved[d] += grow;
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < x->n; i++) {
        if (x->nodes[i].type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
        graph_used[d] += x->nodes[i].bytes;
        add_locked(x->nodes[i].dptr, A_GRAPH, d, x->nodes[i].bytes, NULL);
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < x->n; i++) {
        alloc_t *a;
        if (x->nodes[i].type != CU_GRAPH_NODE_TYPE_MEM_FREE ||
            !(a = find_locked(x->nodes[i].dptr, A_GRAPH)))
            continue;
        graph_used[d] -= a->bytes;
        remove_locked(a);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec x, CUstream s) {
    NEED_CTX();
    if (!x || x->magic != MAGIC_EXEC) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = graph_memory(x);
    return r == CUDA_SUCCESS ? run_work(kernel_ns * x->kernels) : r;
}
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec x, CUstream s) { return cuGraphLaunch(x, s); }
EXPORT CUresult cuGraphUpload(CUgraphExec x, CUstream s) {
    NEED_CTX();
    return x && x->magic == MAGIC_EXEC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, CUgraphMem_attribute a, void *v) {
    NEED_INIT();
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    if (a == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)
        *(cuuint64_t *)v = graph_used[d];
    else if (a == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)
        *(cuuint64_t *)v = graph_reserved[d];
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&mu);
    return r;
}
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d) {
    NEED_INIT();
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    uint64_t keep = (graph_used[d] + CHUNK - 1) / CHUNK * CHUNK;
    if (keep < graph_reserved[d]) {
        dev_used[d] -= graph_reserved[d] - keep;
        graph_reserved[d] = keep;
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
    NEED_CTX();
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    CUstream st = TAKE(stream_table, nstreams);
    if (!st) return CUDA_ERROR_OUT_OF_MEMORY;
    st->magic = MAGIC_STREAM;
    *s = st;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    NEED_INIT();
    if (!s || s->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    return CUDA_SUCCESS;
}
/* Capture is refused on the legacy default stream, as the driver does. */
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
    NEED_CTX();
    if (!s || s->magic != MAGIC_STREAM || s->capture) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuGraphCreate(&s->capture, 0);
    if (r == CUDA_SUCCESS) atomic_fetch_add(&captures, 1);
    return r;
}
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g) {
    NEED_CTX();
    if (!s || s->magic != MAGIC_STREAM || !s->capture || !g) return CUDA_ERROR_INVALID_VALUE;
    *g = s->capture;
    s->capture = NULL;
    bool broken = atomic_load(&capture_broken);
    if (atomic_fetch_sub(&captures, 1) == 1) atomic_store(&capture_broken, false);
    if (broken) {
        cuGraphDestroy(*g);
        *g = NULL;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) {
    NEED_CTX();
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    *st = capturing(s) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) {
    NEED_CTX();
    card_lock();
    uint64_t until = own_until[current->dev];
    card_unlock();
    uint64_t now = now_ns();
    if (until > now) {
        struct timespec ts = {(time_t)((until - now) / 1000000000ull),
                              (long)((until - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
    return CUDA_SUCCESS;
}

/* ---- what the fake NVML reads --------------------------------------------------------------- */

EXPORT int fakecuda_device_count(void) { return atomic_load(&initialised) ? ndev : 0; }

EXPORT void fakecuda_memory(int d, uint64_t *total, uint64_t *used) {
    pthread_mutex_lock(&mu);
    *total = dev_total;
    *used = dev_used[d];
    pthread_mutex_unlock(&mu);
}

/* Percent of (to - UTIL_WINDOW_NS, to] (monotonic ns) the card spent running kernels of pid
 * (0: of any process). */
static unsigned busy_percent_locked(int d, uint64_t to, int pid) {
    uint64_t from = to > UTIL_WINDOW_NS ? to - UTIL_WINDOW_NS : 0, busy = 0;
    size_t n = card->nspan[d];
    for (size_t k = 0; k < n && k < SPANS; k++) {
        span s = card->spans[d][(n - 1 - k) % SPANS];
        if (s.end <= from) break;
        if (pid && s.pid != pid) continue;
        uint64_t a = s.start > from ? s.start : from, b = s.end < to ? s.end : to;
        if (b > a) busy += b - a;
    }
    return (unsigned)(busy * 100 / UTIL_WINDOW_NS);
}

/* Percent of the last UTIL_WINDOW_NS the card spent running kernels. */
EXPORT unsigned fakecuda_utilization(int d) {
    card_lock();
    unsigned u = busy_percent_locked(d, now_ns(), 0);
    card_unlock();
    return u;
}

/* The sample windows NVML keeps: one per UTIL_WINDOW_NS, at fixed boundaries, the last 100,
 * stamped in CPU microseconds (CLOCK_REALTIME) when each closes. The first boundary (monotonic
 * ns) whose stamp is newer than after_us, the last one closed, and the realtime offset. */
static void sample_windows(uint64_t after_us, uint64_t *first, uint64_t *last, int64_t *offset) {
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t mono = now_ns();
    uint64_t real = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
    *offset = (int64_t)(real - mono);
    *last = mono / UTIL_WINDOW_NS * UTIL_WINDOW_NS;
    *first = *last;
    for (int k = 0; k < 100 && *first >= UTIL_WINDOW_NS; k++) {
        uint64_t prev = *first - UTIL_WINDOW_NS;
        if ((uint64_t)((int64_t)prev + *offset) / 1000 <= after_us) break;
        *first = prev;
    }
}

/* The driver's utilisation samples, as NVML keeps them: each the card's busy percent over the
 * window it closes. Fills up to max samples newer than after_us, oldest first; returns how many. */
EXPORT unsigned fakecuda_utilization_samples(int d, uint64_t after_us, uint64_t *stamps_us,
                                             unsigned *values, unsigned max) {
    card_lock();
    uint64_t first, last;
    int64_t offset;
    sample_windows(after_us, &first, &last, &offset);
    unsigned n = 0;
    for (uint64_t b = first; b <= last && n < max; b += UTIL_WINDOW_NS) {
        uint64_t us = (uint64_t)((int64_t)b + offset) / 1000;
        if (us <= after_us) continue;
        stamps_us[n] = us;
        values[n++] = busy_percent_locked(d, b, 0);
    }
    card_unlock();
    return n;
}

/* Per-process samples, as nvmlDeviceGetProcessUtilization gives them: for each window newer than
 * after_us, one entry per process that ran kernels in it (idle processes have none), its busy
 * percent of the window. Up to max entries, oldest window first; returns how many. */
EXPORT unsigned fakecuda_process_samples(int d, uint64_t after_us, int *pids, uint64_t *stamps_us,
                                         unsigned *values, unsigned max) {
    card_lock();
    uint64_t first, last;
    int64_t offset;
    sample_windows(after_us, &first, &last, &offset);
    unsigned n = 0;
    for (uint64_t b = first; b <= last && n < max; b += UTIL_WINDOW_NS) {
        uint64_t us = (uint64_t)((int64_t)b + offset) / 1000, from = b - UTIL_WINDOW_NS;
        if (us <= after_us) continue;
        int seen[16];
        unsigned nseen = 0;
        size_t ns = card->nspan[d];
        for (size_t k = 0; k < ns && k < SPANS && n < max; k++) {
            span s = card->spans[d][(ns - 1 - k) % SPANS];
            if (s.end <= from) break;
            if (s.start >= b) continue;
            bool dup = false;
            for (unsigned i = 0; i < nseen; i++) dup |= seen[i] == s.pid;
            if (dup || nseen == 16) continue;
            seen[nseen++] = s.pid;
            pids[n] = s.pid;
            stamps_us[n] = us;
            values[n++] = busy_percent_locked(d, b, s.pid);
        }
    }
    card_unlock();
    return n;
}

/* ---- cuGetProcAddress -------------------------------------------------------------------- */

typedef struct { const char *name; int since; bool ptsz; void *fn; } proc;
#define P(n, v) {#n, v, false, (void *)n}
#define PT(base, n, v) {#base, v, true, (void *)n}
static const proc procs[] = {
    P(cuInit, 2000), P(cuDriverGetVersion, 2020), P(cuDeviceGet, 2000),
    P(cuDeviceGetCount, 2000), P(cuDeviceGetUuid, 9020), {"cuDeviceGetUuid", 11040, false,
    (void *)cuDeviceGetUuid_v2}, {"cuDeviceTotalMem", 2000, false, (void *)cuDeviceTotalMem},
    {"cuDeviceTotalMem", 3020, false, (void *)cuDeviceTotalMem_v2},
    {"cuCtxCreate", 3020, false, (void *)cuCtxCreate_v2}, {"cuCtxDestroy", 4000, false,
    (void *)cuCtxDestroy_v2}, P(cuCtxSetCurrent, 4000), P(cuCtxGetDevice, 2000),
    P(cuCtxGetCurrent, 4000),
    P(cuCtxSynchronize, 2000),
    {"cuMemGetInfo", 2000, false, (void *)cuMemGetInfo},
    {"cuMemGetInfo", 3020, false, (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", 2000, false, (void *)cuMemAlloc},
    {"cuMemAlloc", 3020, false, (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", 2000, false, (void *)cuMemAllocPitch},
    {"cuMemAllocPitch", 3020, false, (void *)cuMemAllocPitch_v2},
    P(cuMemAllocManaged, 6000),
    {"cuMemFree", 2000, false, (void *)cuMemFree}, {"cuMemFree", 3020, false, (void *)cuMemFree_v2},
    P(cuMemAllocAsync, 11020), PT(cuMemAllocAsync, cuMemAllocAsync_ptsz, 11020),
    P(cuMemAllocFromPoolAsync, 11020),
    PT(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, 11020),
    P(cuMemFreeAsync, 11020), PT(cuMemFreeAsync, cuMemFreeAsync_ptsz, 11020),
    P(cuDeviceGetDefaultMemPool, 11020), P(cuDeviceGetMemPool, 11020), P(cuMemPoolCreate, 11020),
    P(cuMemPoolDestroy, 11020), P(cuMemPoolGetAttribute, 11020), P(cuMemPoolTrimTo, 11020),
    P(cuMemCreate, 10020), P(cuMemRelease, 10020), P(cuMemAddressReserve, 10020),
    P(cuMemAddressFree, 10020), P(cuMemMap, 10020), P(cuMemUnmap, 10020),
    P(cuMemExportToShareableHandle, 10020), P(cuMemImportFromShareableHandle, 10020),
    P(cuMemGetAllocationPropertiesFromHandle, 10020),
    {"cuArrayCreate", 2000, false, (void *)cuArrayCreate},
    {"cuArrayCreate", 3020, false, (void *)cuArrayCreate_v2},
    {"cuArray3DCreate", 2000, false, (void *)cuArray3DCreate},
    {"cuArray3DCreate", 3020, false, (void *)cuArray3DCreate_v2}, P(cuArrayDestroy, 2000),
    P(cuMipmappedArrayCreate, 5000), P(cuMipmappedArrayDestroy, 5000),
    P(cuModuleLoadData, 2000), P(cuModuleLoadDataEx, 2010), P(cuModuleUnload, 2000),
    P(cuModuleLoad, 2000), P(cuModuleLoadFatBinary, 2000), P(cuLibraryLoadData, 12000),
    P(cuLibraryLoadFromFile, 12000), P(cuLibraryUnload, 12000),
    P(cuModuleGetFunction, 2000), P(cuStreamCreate, 2000),
    {"cuStreamDestroy", 4000, false, (void *)cuStreamDestroy_v2},
    {"cuStreamBeginCapture", 10010, false, (void *)cuStreamBeginCapture_v2},
    P(cuStreamEndCapture, 10000), P(cuStreamIsCapturing, 10000),
    P(cuGraphDestroy, 10000), P(cuGraphExecDestroy, 10000), P(cuGraphAddMemAllocNode, 11040),
    P(cuGraphAddMemFreeNode, 11040), P(cuGraphGetNodes, 10000), P(cuGraphNodeGetType, 10000),
    P(cuGraphMemAllocNodeGetParams, 11040), P(cuGraphUpload, 11010),
    P(cuDeviceGetGraphMemAttribute, 11040), P(cuDeviceGraphMemTrim, 11040),
    P(cuLaunchKernel, 4000), PT(cuLaunchKernel, cuLaunchKernel_ptsz, 7000),
    P(cuLaunchKernelEx, 11060), PT(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, 11060),
    P(cuLaunchCooperativeKernel, 9000),
    PT(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, 9000),
    P(cuGraphCreate, 10000), {"cuGraphInstantiate", 11040, false,
    (void *)cuGraphInstantiateWithFlags}, P(cuGraphInstantiateWithFlags, 11040),
    P(cuGraphLaunch, 10000), PT(cuGraphLaunch, cuGraphLaunch_ptsz, 10000),
    P(cuGetProcAddress, 11030), {"cuGetProcAddress", 12000, false, (void *)cuGetProcAddress_v2},
};

/* With FAKE_CUDA_PROC_INTERNAL=1, cuGetProcAddress hands out internal entry points (other
 * addresses than the exported symbols) for the memory calls, to test the hook's fallback. */
static CUresult internal_alloc_v2(CUdeviceptr *p, size_t n) { return alloc_ptr(p, n, A_PTR); }
static CUresult internal_free_v2(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult internal_info_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult internal_alloc_async_ptsz(CUdeviceptr *d, size_t n, CUstream s) {
    return cuMemAllocAsync(d, n, s);
}
static void *internal_entry(void *fn) {
    static int on = -1;
    if (on < 0) on = env_u64("FAKE_CUDA_PROC_INTERNAL", 0) != 0;
    if (!on) return fn;
    if (fn == (void *)cuMemAlloc_v2) return (void *)internal_alloc_v2;
    if (fn == (void *)cuMemFree_v2) return (void *)internal_free_v2;
    if (fn == (void *)cuMemGetInfo_v2) return (void *)internal_info_v2;
    if (fn == (void *)cuMemAllocAsync_ptsz) return (void *)internal_alloc_async_ptsz;
    return fn;
}

static CUresult lookup(const char *sym, void **pfn, int version, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *status) {
    if (!sym || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;
    bool want_ptsz = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    const proc *best = NULL;
    bool known = false;
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        const proc *p = &procs[i];
        if (strcmp(p->name, sym) != 0) continue;
        known = true;
        if (p->since > version || (p->ptsz && !want_ptsz)) continue;
        if (!best || p->since > best->since || (p->ptsz && !best->ptsz)) best = p;
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = internal_entry(best->fn);
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags) {
    return lookup(sym, pfn, version, flags, NULL);
}
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    return lookup(sym, pfn, version, flags, status);
}
