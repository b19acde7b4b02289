/* Device memory: every allocation path is charged to the container's share before the driver is
 * asked (so racing processes can never pass the limit), and every free releases exactly what its
 * allocation charged, looked up in a per-process table keyed by pointer or handle. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"
#include "memory.h"
#include "rectable.h"
#include "region.h"

/* Sizes come from the caller: a product that overflows must not wrap into a small charge. */
static uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* ---- which granted card ------------------------------------------------------------------- */

#define MAX_ORDINALS 64
static _Atomic int ordinal_index[MAX_ORDINALS]; /* 0 unknown, else index + 1, or -1 not granted */

static int uuid_index(const char *uuid) {
    for (int i = 0; i < fg.limits.ndevices; i++)
        if (strcmp(fg.limits.devices[i], uuid) == 0) return i;
    return -1;
}

int fg_device_index(CUdevice dev) {
    if (dev < 0 || dev >= MAX_ORDINALS || !fg_real.cuDeviceGetUuid) return -1;
    int cached = atomic_load_explicit(&ordinal_index[dev], memory_order_relaxed);
    if (FG_LIKELY(cached != 0)) return cached > 0 ? cached - 1 : -1;
    CUuuid u;
    if (fg_real.cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS) return -1;
    const unsigned char *b = (const unsigned char *)u.bytes;
    char s[64];
    snprintf(s, sizeof s,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
    int idx = uuid_index(s);
    int expected = 0;
    if (atomic_compare_exchange_strong(&ordinal_index[dev], &expected, idx >= 0 ? idx + 1 : -1) &&
        idx < 0 && fg.mode == FG_MODE_ENFORCE)
        fg_log("card %s (device %d) is not in the limits file's devices; its memory is refused",
               s, dev);
    return idx;
}

int fg_nvml_device_index(nvmlDevice_t dev) {
    char uuid[NVML_DEVICE_UUID_BUFFER_SIZE];
    if (!fg_real.nvmlDeviceGetUUID ||
        fg_real.nvmlDeviceGetUUID(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return -1;
    return uuid_index(uuid);
}

int fg_current_index(void) {
    CUdevice d;
    if (!fg_real.cuCtxGetDevice || fg_real.cuCtxGetDevice(&d) != CUDA_SUCCESS)
        return FG_NO_CONTEXT;
    int idx = fg_device_index(d);
    return idx >= 0 ? idx : FG_NOT_GRANTED;
}

bool fg_charge(int idx, uint64_t bytes) {
    if (fg.mode == FG_MODE_DENY || idx < 0) return false;
    return fg_region_charge(idx, bytes, fg.limits.memory_bytes);
}

#define ENFORCED() (fg.mode != FG_MODE_INERT)

/* ---- the one shape of every charged allocation -------------------------------------------- */

/* How one allocation entry point asks the driver, what it actually took, and how to give it
 * back when the hook cannot keep a record of it. */
typedef struct {
    fg_rec_kind kind;
    CUresult (*call)(void *args, uint64_t *key);
    CUresult (*undo)(uint64_t key);
    uint64_t (*actual)(const void *args); /* NULL: what was charged is exact */
} fg_alloc_ops;

/* The context a linear allocation belongs to: destroying the context frees it. */
static uint64_t linear_context(fg_rec_kind kind) {
    CUcontext c = NULL;
    if ((kind != FG_REC_PTR && kind != FG_REC_PTR_V1) || !fg_real.cuCtxGetCurrent ||
        fg_real.cuCtxGetCurrent(&c) != CUDA_SUCCESS)
        return 0;
    return (uint64_t)(uintptr_t)c;
}

/* Charge first (so racing processes can never pass the limit together), then ask the driver,
 * settle on what it took, and record the charge for the free. */
static CUresult alloc_charged(const fg_alloc_ops *ops, void *args, int idx, uint64_t bytes) {
    if (!fg_charge(idx, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t key = 0;
    CUresult r = ops->call(args, &key);
    if (r != CUDA_SUCCESS) {
        fg_region_release(idx, bytes);
        return r;
    }
    uint64_t actual = ops->actual ? ops->actual(args) : bytes;
    if (actual < bytes) {
        fg_region_release(idx, bytes - actual);
    } else if (actual > bytes && !fg_charge(idx, actual - bytes)) {
        ops->undo(key);
        fg_region_release(idx, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fg_rec rec = {key, actual, linear_context(ops->kind), idx, (int32_t)ops->kind};
    if (!fg_rec_put(&rec)) {
        ops->undo(key);
        fg_region_release(idx, actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static CUresult undo_free_v2(uint64_t p) { return fg_real.cuMemFree_v2(p); }
static CUresult undo_free_v1(uint64_t p) { return fg_real.cuMemFree((CUdeviceptr_v1)p); }
static CUresult undo_release(uint64_t h) { return fg_real.cuMemRelease(h); }
static CUresult undo_array(uint64_t a) { return fg_real.cuArrayDestroy((CUarray)(uintptr_t)a); }
static CUresult undo_mipmap(uint64_t a) {
    return fg_real.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)a);
}

/* ---- linear allocations -------------------------------------------------------------------- */

typedef struct {
    CUdeviceptr *dptr;
    size_t bytes;
    unsigned flags;
} linear_args;

static CUresult call_alloc_v2(void *a, uint64_t *key) {
    linear_args *l = a;
    CUresult r = fg_real.cuMemAlloc_v2(l->dptr, l->bytes);
    *key = r == CUDA_SUCCESS ? *l->dptr : 0;
    return r;
}
static CUresult call_managed(void *a, uint64_t *key) {
    linear_args *l = a;
    CUresult r = fg_real.cuMemAllocManaged(l->dptr, l->bytes, l->flags);
    *key = r == CUDA_SUCCESS ? *l->dptr : 0;
    return r;
}
static const fg_alloc_ops alloc_v2_ops = {FG_REC_PTR, call_alloc_v2, undo_free_v2, NULL};
static const fg_alloc_ops managed_ops = {FG_REC_PTR, call_managed, undo_free_v2, NULL};

FG_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    fg_init();
    if (!fg_real.cuMemAlloc_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || bytes == 0 || !dptr) return fg_real.cuMemAlloc_v2(dptr, bytes);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAlloc_v2(dptr, bytes);
    linear_args args = {dptr, bytes, 0};
    return alloc_charged(&alloc_v2_ops, &args, idx, bytes);
}

/* Managed memory can migrate to the host, but it can also fill the card: counted in full. */
FG_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    fg_init();
    if (!fg_real.cuMemAllocManaged) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || bytes == 0 || !dptr) return fg_real.cuMemAllocManaged(dptr, bytes, flags);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAllocManaged(dptr, bytes, flags);
    linear_args args = {dptr, bytes, flags};
    return alloc_charged(&managed_ops, &args, idx, bytes);
}

typedef struct {
    CUdeviceptr_v1 *dptr;
    unsigned bytes;
} linear_v1_args;

static CUresult call_alloc_v1(void *a, uint64_t *key) {
    linear_v1_args *l = a;
    CUresult r = fg_real.cuMemAlloc(l->dptr, l->bytes);
    *key = r == CUDA_SUCCESS ? *l->dptr : 0;
    return r;
}
static const fg_alloc_ops alloc_v1_ops = {FG_REC_PTR_V1, call_alloc_v1, undo_free_v1, NULL};

FG_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytes) {
    fg_init();
    if (!fg_real.cuMemAlloc) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || bytes == 0 || !dptr) return fg_real.cuMemAlloc(dptr, bytes);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAlloc(dptr, bytes);
    linear_v1_args args = {dptr, bytes};
    return alloc_charged(&alloc_v1_ops, &args, idx, bytes);
}

/* Pitched allocations: the driver pads rows to its pitch alignment (at most 512 bytes on current
 * cards), so the padded worst case is charged first and settled on the pitch it chose. */
typedef struct {
    CUdeviceptr *dptr;
    size_t *pitch;
    size_t width, height;
    unsigned elem;
} pitch_args;

static CUresult call_pitch_v2(void *a, uint64_t *key) {
    pitch_args *p = a;
    CUresult r = fg_real.cuMemAllocPitch_v2(p->dptr, p->pitch, p->width, p->height, p->elem);
    *key = r == CUDA_SUCCESS ? *p->dptr : 0;
    return r;
}
static uint64_t pitch_actual(const void *a) {
    const pitch_args *p = a;
    return mul_sat(*p->pitch, p->height);
}
static const fg_alloc_ops pitch_v2_ops = {FG_REC_PTR, call_pitch_v2, undo_free_v2, pitch_actual};

static uint64_t pitch_worst(uint64_t width, uint64_t height) {
    return mul_sat(add_sat(width, 511) / 512 * 512, height);
}

FG_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                      size_t height, unsigned int elem) {
    fg_init();
    if (!fg_real.cuMemAllocPitch_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !dptr || !pitch || width == 0 || height == 0)
        return fg_real.cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    pitch_args args = {dptr, pitch, width, height, elem};
    return alloc_charged(&pitch_v2_ops, &args, idx, pitch_worst(width, height));
}

/* The legacy 32-bit cuMemAllocPitch (also what cuGetProcAddress gives for versions before 3.2). */
typedef struct {
    CUdeviceptr_v1 *dptr;
    unsigned *pitch;
    unsigned width, height, elem;
} pitch_v1_args;

static CUresult call_pitch_v1(void *a, uint64_t *key) {
    pitch_v1_args *p = a;
    CUresult r = fg_real.cuMemAllocPitch(p->dptr, p->pitch, p->width, p->height, p->elem);
    *key = r == CUDA_SUCCESS ? *p->dptr : 0;
    return r;
}
static uint64_t pitch_v1_actual(const void *a) {
    const pitch_v1_args *p = a;
    return (uint64_t)*p->pitch * p->height;
}
static const fg_alloc_ops pitch_v1_ops = {FG_REC_PTR_V1, call_pitch_v1, undo_free_v1,
                                          pitch_v1_actual};

FG_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                   unsigned int height, unsigned int elem) {
    fg_init();
    if (!fg_real.cuMemAllocPitch) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !dptr || !pitch || width == 0 || height == 0)
        return fg_real.cuMemAllocPitch(dptr, pitch, width, height, elem);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAllocPitch(dptr, pitch, width, height, elem);
    pitch_v1_args args = {dptr, pitch, width, height, elem};
    return alloc_charged(&pitch_v1_ops, &args, idx, pitch_worst(width, height));
}

/* Frees: forget the record first (so a racing allocation may reuse the address), then free;
 * if the driver refuses, the record goes back. */
static CUresult free_recorded(fg_rec_kind kind, uint64_t key, CUresult (*do_free)(uint64_t)) {
    fg_rec rec;
    bool had = ENFORCED() && fg_rec_take(kind, key, &rec);
    CUresult r = do_free(key);
    if (!had) return r;
    if (r == CUDA_SUCCESS)
        fg_region_release(rec.dev, rec.bytes);
    else
        fg_rec_put(&rec);
    return r;
}

static CUresult free_any(CUdeviceptr p, CUstream s, bool async, __typeof__(cuMemFreeAsync) *real);

FG_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    fg_init();
    if (!fg_real.cuMemFree_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemFree_v2(p);
    return free_any(p, NULL, false, NULL);
}

FG_EXPORT CUresult cuMemFree(CUdeviceptr_v1 p) {
    fg_init();
    if (!fg_real.cuMemFree) return CUDA_ERROR_NOT_INITIALIZED;
    return free_recorded(FG_REC_PTR_V1, p, undo_free_v1);
}

/* Destroying a context frees the linear memory allocated in it: its charges go too. */
static bool in_context(const fg_rec *r, void *ctx) {
    return (r->kind == FG_REC_PTR || r->kind == FG_REC_PTR_V1) && r->aux == (uint64_t)(uintptr_t)ctx;
}
static void give_back(const fg_rec *r) { fg_region_release(r->dev, r->bytes); }

FG_EXPORT CUresult cuCtxDestroy_v2(CUcontext c) {
    fg_init();
    if (!fg_real.cuCtxDestroy_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuCtxDestroy_v2(c);
    if (r == CUDA_SUCCESS && ENFORCED() && c) fg_rec_take_each(in_context, c, give_back);
    return r;
}

/* ---- stream-ordered allocations: charged by what their pool reserves ---------------------- */

/* A pool keeps freed memory for reuse and grows in chunks, so what it holds on the card is its
 * reserved size, not the sum of live allocations. The hook charges each pool's reserved bytes:
 * before an allocation it charges the growth the allocation may need, afterwards it settles on
 * what the driver reports, and frees, trims and destroys settle again. */
typedef struct {
    CUmemoryPool pool;
    int dev;
    uint64_t charged;
} fg_pool;
#define MAX_POOLS 256
static fg_pool pools[MAX_POOLS];
static int npools;
static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;

static void pools_after_fork(void) {
    pthread_mutex_init(&pools_mu, NULL);
    npools = 0;
}

static void vmm_after_fork(void);

void fg_memory_after_fork(void) {
    /* The parent's allocations are not the child's to free: start from empty tables. */
    pools_after_fork();
    vmm_after_fork();
    fg_rec_after_fork();
}

static fg_pool *pool_find(CUmemoryPool p, int dev, bool create) {
    for (int i = 0; i < npools; i++)
        if (pools[i].pool == p) return &pools[i];
    if (!create || npools == MAX_POOLS) return NULL;
    pools[npools] = (fg_pool){p, dev, 0};
    return &pools[npools++];
}

static uint64_t pool_attr(CUmemoryPool p, CUmemPool_attribute a) {
    cuuint64_t v = 0;
    if (!fg_real.cuMemPoolGetAttribute || fg_real.cuMemPoolGetAttribute(p, a, &v) != CUDA_SUCCESS)
        return 0;
    return v;
}

/* Bring the charge to what the pool now reserves. Growth the driver already made is forced
 * (it is on the card); false when that leaves the container beyond its limit. */
static bool pool_settle(fg_pool *fp) {
    uint64_t reserved = pool_attr(fp->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    if (reserved < fp->charged) {
        fg_region_release(fp->dev, fp->charged - reserved);
    } else if (reserved > fp->charged) {
        fg_region_force(fp->dev, reserved - fp->charged);
    }
    fp->charged = reserved;
    return fg_region_used(fp->dev) <= fg.limits.memory_bytes;
}

typedef CUresult (*pool_alloc_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream, void *);

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream,
                           pool_alloc_fn call, void *real, CUresult (*free_async)(CUdeviceptr,
                                                                                    CUstream)) {
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT || !dptr || bytes == 0) return call(dptr, bytes, pool, stream, real);
    if (fg.mode == FG_MODE_DENY || idx == FG_NOT_GRANTED) return CUDA_ERROR_OUT_OF_MEMORY;
    if (fg_graph_capturing(stream)) {
        /* A graph memory node, not the pool's: counted at instantiation and launch (graph.c). */
        CUresult r = call(dptr, bytes, pool, stream, real);
        if (r == CUDA_SUCCESS) fg_graph_captured(stream, bytes);
        return r;
    }
    if (!pool) {
        CUdevice d;
        if (!fg_real.cuDeviceGetMemPool || fg_real.cuCtxGetDevice(&d) != CUDA_SUCCESS ||
            fg_real.cuDeviceGetMemPool(&pool, d) != CUDA_SUCCESS)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&pools_mu);
    fg_pool *fp = pool_find(pool, idx, true);
    if (!fp || fp->dev == FG_NOT_GRANTED) {
        pthread_mutex_unlock(&pools_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (fp->dev == FG_NO_CONTEXT) { /* a pool of host memory: not the card's */
        pthread_mutex_unlock(&pools_mu);
        return call(dptr, bytes, pool, stream, real);
    }
    idx = fp->dev; /* the pool's card, whichever the context's is */
    pool_settle(fp);
    uint64_t used = pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    uint64_t growth = used + bytes > fp->charged ? used + bytes - fp->charged : 0;
    if (growth && !fg_region_charge(idx, growth, fg.limits.memory_bytes)) {
        pthread_mutex_unlock(&pools_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fp->charged += growth;
    CUresult r = call(dptr, bytes, pool, stream, real);
    if (r == CUDA_SUCCESS && !pool_settle(fp)) {
        /* The pool grew by more than the allocation (chunk rounding) and that passed the limit. */
        free_async(*dptr, stream);
        if (fg_real.cuMemPoolTrimTo) fg_real.cuMemPoolTrimTo(pool, 0);
        pool_settle(fp);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (r != CUDA_SUCCESS) {
        pool_settle(fp);
    } else {
        fg_rec rec = {*dptr, bytes, (uint64_t)(uintptr_t)pool, idx, FG_REC_POOL};
        fg_rec_put(&rec);
        fg_graph_captured(stream, bytes);
    }
    pthread_mutex_unlock(&pools_mu);
    return r;
}

static CUresult call_default(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s, void *f) {
    (void)p;
    return ((__typeof__(cuMemAllocAsync) *)f)(d, n, s);
}
static CUresult call_from_pool(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s, void *f) {
    return ((__typeof__(cuMemAllocFromPoolAsync) *)f)(d, n, p, s);
}

#define ASYNC_ALLOC(name, free_name)                                                           \
    FG_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytes, CUstream stream) {                \
        fg_init();                                                                             \
        if (!fg_real.name) return CUDA_ERROR_NOT_INITIALIZED;                                  \
        if (!ENFORCED()) return fg_real.name(dptr, bytes, stream);                             \
        return pool_alloc(dptr, bytes, NULL, stream, call_default, (void *)fg_real.name,       \
                          fg_real.free_name);                                                  \
    }
ASYNC_ALLOC(cuMemAllocAsync, cuMemFreeAsync)
ASYNC_ALLOC(cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz)

#define POOL_ALLOC(name, free_name)                                                            \
    FG_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,                \
                            CUstream stream) {                                                 \
        fg_init();                                                                             \
        if (!fg_real.name) return CUDA_ERROR_NOT_INITIALIZED;                                  \
        if (!ENFORCED() || !pool) return fg_real.name(dptr, bytes, pool, stream);              \
        return pool_alloc(dptr, bytes, pool, stream, call_from_pool, (void *)fg_real.name,     \
                          fg_real.free_name);                                                  \
    }
POOL_ALLOC(cuMemAllocFromPoolAsync, cuMemFreeAsync)
POOL_ALLOC(cuMemAllocFromPoolAsync_ptsz, cuMemFreeAsync_ptsz)

/* cuMemFreeAsync also frees cuMemAlloc memory, and cuMemFree stream-ordered memory: whichever
 * record the pointer has is settled. */
static CUresult free_any(CUdeviceptr p, CUstream s, bool async, __typeof__(cuMemFreeAsync) *real) {
    fg_rec rec;
    if (fg_rec_take(FG_REC_PTR, p, &rec)) { /* the common case takes no process-wide lock */
        CUresult r = async ? real(p, s) : fg_real.cuMemFree_v2(p);
        if (r == CUDA_SUCCESS)
            fg_region_release(rec.dev, rec.bytes);
        else
            fg_rec_put(&rec);
        return r;
    }
    pthread_mutex_lock(&pools_mu);
    bool had = fg_rec_take(FG_REC_POOL, p, &rec);
    CUresult r = async ? real(p, s) : fg_real.cuMemFree_v2(p);
    if (had && r != CUDA_SUCCESS) {
        fg_rec_put(&rec);
    } else if (had) {
        fg_pool *fp = pool_find((CUmemoryPool)(uintptr_t)rec.aux, rec.dev, false);
        if (fp) pool_settle(fp);
    }
    pthread_mutex_unlock(&pools_mu);
    return r;
}

static CUresult free_async(CUdeviceptr p, CUstream s, __typeof__(cuMemFreeAsync) *real) {
    /* Captured, the free happens when the graph runs: records settle on the pool's next event,
     * and a query now could invalidate the capture. */
    if (!ENFORCED() || fg_graph_capturing(s)) return real(p, s);
    return free_any(p, s, true, real);
}

FG_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    fg_init();
    if (!fg_real.cuMemFreeAsync) return CUDA_ERROR_NOT_INITIALIZED;
    return free_async(p, s, fg_real.cuMemFreeAsync);
}

FG_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    fg_init();
    if (!fg_real.cuMemFreeAsync_ptsz) return CUDA_ERROR_NOT_INITIALIZED;
    return free_async(p, s, fg_real.cuMemFreeAsync_ptsz);
}

/* A pool's memory lives on the card its properties name, not necessarily the context's. */
FG_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    fg_init();
    if (!fg_real.cuMemPoolCreate) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemPoolCreate(pool, props);
    if (r != CUDA_SUCCESS || !ENFORCED() || !pool || !props) return r;
    int dev = FG_NO_CONTEXT;
    if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        dev = fg_device_index(props->location.id);
        if (dev < 0) dev = FG_NOT_GRANTED;
    }
    pthread_mutex_lock(&pools_mu);
    fg_pool *fp = pool_find(*pool, dev, true);
    pthread_mutex_unlock(&pools_mu);
    if (!fp) {
        /* Untracked, its growth could not be charged to the right card. */
        fg_real.cuMemPoolDestroy(*pool);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return r;
}

FG_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    fg_init();
    if (!fg_real.cuMemPoolTrimTo) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemPoolTrimTo(pool, keep);
    pthread_mutex_lock(&pools_mu);
    CUresult r = fg_real.cuMemPoolTrimTo(pool, keep);
    fg_pool *fp = pool_find(pool, 0, false);
    if (fp) pool_settle(fp);
    pthread_mutex_unlock(&pools_mu);
    return r;
}

FG_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    fg_init();
    if (!fg_real.cuMemPoolDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemPoolDestroy(pool);
    pthread_mutex_lock(&pools_mu);
    CUresult r = fg_real.cuMemPoolDestroy(pool);
    fg_pool *fp = pool_find(pool, 0, false);
    if (r == CUDA_SUCCESS && fp) {
        fg_region_release(fp->dev, fp->charged);
        *fp = pools[--npools];
    }
    pthread_mutex_unlock(&pools_mu);
    return r;
}

/* ---- virtual memory management ----------------------------------------------------------- */

typedef struct {
    CUmemGenericAllocationHandle *h;
    size_t bytes;
    const CUmemAllocationProp *prop;
    unsigned long long flags;
} vmm_args;

static CUresult call_mem_create(void *a, uint64_t *key) {
    vmm_args *v = a;
    CUresult r = fg_real.cuMemCreate(v->h, v->bytes, v->prop, v->flags);
    *key = r == CUDA_SUCCESS ? *v->h : 0;
    return r;
}
static const fg_alloc_ops vmm_ops = {FG_REC_VMM, call_mem_create, undo_release, NULL};

FG_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                               const CUmemAllocationProp *prop, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemCreate) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !h || !prop || bytes == 0 ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return fg_real.cuMemCreate(h, bytes, prop, flags);
    int idx = fg_device_index(prop->location.id);
    vmm_args args = {h, bytes, prop, flags};
    return alloc_charged(&vmm_ops, &args, idx < 0 ? FG_NOT_GRANTED : idx, bytes);
}

/* Physical memory stays on the card while its handle is unreleased or any mapping of it is
 * alive: cuMemRelease of a mapped handle frees nothing until the last cuMemUnmap. So a handle's
 * record counts its live mappings (aux, with VMM_RELEASED once released) and its charge goes
 * when both are gone. The mappings themselves are kept in a list: one cuMemUnmap may cover
 * several of them. */
#define VMM_RELEASED (1ull << 63)
/* Exported (cuMemExportToShareableHandle): another process may hold it on; the charge stays
 * while this process lives. */
#define VMM_EXPORTED (1ull << 62)
#define VMM_FLAGS (VMM_RELEASED | VMM_EXPORTED)

/* A mapping of a handle this process created (charged through the handle's record), or of one
 * it imported from another process, charged by the mapping itself: the importer cannot know
 * how long the exporter keeps its own charge. */
typedef struct {
    CUdeviceptr va;
    uint64_t size;
    CUmemGenericAllocationHandle handle;
    int dev; /* >= 0: this mapping charged size to card dev itself */
} fg_mapping;

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static fg_mapping *mappings;
static size_t nmappings, capmappings;

static void vmm_after_fork(void) {
    pthread_mutex_init(&vmm_mu, NULL);
    free(mappings);
    mappings = NULL;
    nmappings = capmappings = 0;
}

/* With vmm_mu held: one reference fewer on handle h (a mapping or the handle itself). */
static void vmm_drop_locked(CUmemGenericAllocationHandle h, bool release) {
    fg_rec rec;
    if (!fg_rec_take(FG_REC_VMM, h, &rec)) return;
    uint64_t maps = rec.aux & ~VMM_FLAGS;
    bool released = (rec.aux & VMM_RELEASED) || release;
    if (!release && maps > 0) maps--;
    if (released && maps == 0 && !(rec.aux & VMM_EXPORTED)) {
        fg_region_release(rec.dev, rec.bytes);
        return;
    }
    rec.aux = maps | (released ? VMM_RELEASED : 0) | (rec.aux & VMM_EXPORTED);
    fg_rec_put(&rec);
}

FG_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    fg_init();
    if (!fg_real.cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemRelease(h);
    if (r != CUDA_SUCCESS || !ENFORCED()) return r;
    pthread_mutex_lock(&vmm_mu);
    vmm_drop_locked(h, true);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

FG_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h,
                                                int type, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemExportToShareableHandle) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemExportToShareableHandle(out, h, type, flags);
    fg_rec rec;
    if (r != CUDA_SUCCESS || !ENFORCED()) return r;
    pthread_mutex_lock(&vmm_mu);
    if (fg_rec_get(FG_REC_VMM, h, &rec)) {
        rec.aux |= VMM_EXPORTED;
        fg_rec_put(&rec);
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

/* The card a handle's memory lives on, for a handle this process did not create. */
static int handle_index(CUmemGenericAllocationHandle h) {
    CUmemAllocationProp prop;
    if (!fg_real.cuMemGetAllocationPropertiesFromHandle ||
        fg_real.cuMemGetAllocationPropertiesFromHandle(&prop, h) != CUDA_SUCCESS ||
        prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return FG_NOT_GRANTED;
    int idx = fg_device_index(prop.location.id);
    return idx >= 0 ? idx : FG_NOT_GRANTED;
}

FG_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset,
                            CUmemGenericAllocationHandle h, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemMap) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemMap(va, size, offset, h, flags);
    pthread_mutex_lock(&vmm_mu);
    fg_rec rec;
    bool own = fg_rec_get(FG_REC_VMM, h, &rec);
    int dev = -1;
    if (!own) {
        dev = handle_index(h);
        if (!fg_charge(dev, size)) {
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    CUresult r = fg_real.cuMemMap(va, size, offset, h, flags);
    if (r != CUDA_SUCCESS && !own) fg_region_release(dev, size);
    if (r == CUDA_SUCCESS) {
        if (nmappings == capmappings) {
            size_t ncap = capmappings ? capmappings * 2 : 64;
            fg_mapping *n = realloc(mappings, ncap * sizeof *n);
            if (!n) {
                /* Without room to remember the mapping its memory could outlive the charge. */
                fg_real.cuMemUnmap(va, size);
                if (!own) fg_region_release(dev, size);
                pthread_mutex_unlock(&vmm_mu);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            mappings = n;
            capmappings = ncap;
        }
        mappings[nmappings++] = (fg_mapping){va, size, h, dev};
        if (own) {
            rec.aux++;
            fg_rec_put(&rec);
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

FG_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    fg_init();
    if (!fg_real.cuMemUnmap) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemUnmap(va, size);
    pthread_mutex_lock(&vmm_mu);
    CUresult r = fg_real.cuMemUnmap(va, size);
    for (size_t i = 0; r == CUDA_SUCCESS && i < nmappings;) {
        if (mappings[i].va >= va && mappings[i].va - va < size) {
            fg_mapping m = mappings[i];
            mappings[i] = mappings[--nmappings];
            if (m.dev >= 0)
                fg_region_release(m.dev, m.size);
            else
                vmm_drop_locked(m.handle, false);
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

/* ---- arrays ------------------------------------------------------------------------------ */

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 16; /* formats this hook does not know are charged as the widest texel */
    }
}

static uint64_t dim(size_t v) { return v ? (uint64_t)v : 1; }


static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch) {
    uint64_t texels = mul_sat(mul_sat(dim(w), dim(h)), dim(d));
    return mul_sat(texels, format_bytes(f) * (ch ? ch : 1));
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned levels) {
    uint64_t total = 0;
    size_t w = a->Width, h = a->Height, d = a->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        total = add_sat(total, array_bytes(w, h, d, a->Format, a->NumChannels));
        w = w > 1 ? w / 2 : w;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    return total;
}

typedef struct {
    void **out;
    const void *desc;
    unsigned levels;
    CUresult (*create)(void **out, const void *desc, unsigned levels);
} array_args;

static CUresult call_array(void *a, uint64_t *key) {
    array_args *x = a;
    CUresult r = x->create(x->out, x->desc, x->levels);
    *key = r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*x->out : 0;
    return r;
}
static const fg_alloc_ops array_ops = {FG_REC_ARRAY, call_array, undo_array, NULL};
static const fg_alloc_ops mipmap_ops = {FG_REC_MIPMAP, call_array, undo_mipmap, NULL};

/* Arrays and mipmapped arrays: charged by their texel bytes from the descriptor. */
static CUresult array_create(const fg_alloc_ops *ops, array_args *args, uint64_t bytes) {
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return args->create(args->out, args->desc, args->levels);
    return alloc_charged(ops, args, idx, bytes);
}

static CUresult create_array_v2(void **out, const void *desc, unsigned levels) {
    (void)levels;
    return fg_real.cuArrayCreate_v2((CUarray *)out, desc);
}
static CUresult create_array3d_v2(void **out, const void *desc, unsigned levels) {
    (void)levels;
    return fg_real.cuArray3DCreate_v2((CUarray *)out, desc);
}
static CUresult create_mipmap(void **out, const void *desc, unsigned levels) {
    return fg_real.cuMipmappedArrayCreate((CUmipmappedArray *)out, desc, levels);
}

FG_EXPORT CUresult cuArrayCreate_v2(CUarray *out, const CUDA_ARRAY_DESCRIPTOR *a) {
    fg_init();
    if (!fg_real.cuArrayCreate_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !out || !a) return fg_real.cuArrayCreate_v2(out, a);
    array_args args = {(void **)out, a, 0, create_array_v2};
    return array_create(&array_ops, &args,
                        array_bytes(a->Width, a->Height, 0, a->Format, a->NumChannels));
}

FG_EXPORT CUresult cuArray3DCreate_v2(CUarray *out, const CUDA_ARRAY3D_DESCRIPTOR *a) {
    fg_init();
    if (!fg_real.cuArray3DCreate_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !out || !a) return fg_real.cuArray3DCreate_v2(out, a);
    array_args args = {(void **)out, a, 0, create_array3d_v2};
    return array_create(&array_ops, &args,
                        array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels));
}

/* The legacy 32-bit descriptors (before CUDA 3.2): the same charge from narrower fields. */
static CUresult create_array_v1(void **out, const void *desc, unsigned levels) {
    (void)levels;
    return fg_real.cuArrayCreate((CUarray *)out, desc);
}
static CUresult create_array3d_v1(void **out, const void *desc, unsigned levels) {
    (void)levels;
    return fg_real.cuArray3DCreate((CUarray *)out, desc);
}

FG_EXPORT CUresult cuArrayCreate(CUarray *out, const CUDA_ARRAY_DESCRIPTOR_v1 *a) {
    fg_init();
    if (!fg_real.cuArrayCreate) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !out || !a) return fg_real.cuArrayCreate(out, a);
    array_args args = {(void **)out, a, 0, create_array_v1};
    return array_create(&array_ops, &args,
                        array_bytes(a->Width, a->Height, 0, a->Format, a->NumChannels));
}

FG_EXPORT CUresult cuArray3DCreate(CUarray *out, const CUDA_ARRAY3D_DESCRIPTOR_v1 *a) {
    fg_init();
    if (!fg_real.cuArray3DCreate) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !out || !a) return fg_real.cuArray3DCreate(out, a);
    array_args args = {(void **)out, a, 0, create_array3d_v1};
    return array_create(&array_ops, &args,
                        array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels));
}

FG_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *out, const CUDA_ARRAY3D_DESCRIPTOR *a,
                                          unsigned int levels) {
    fg_init();
    if (!fg_real.cuMipmappedArrayCreate) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !out || !a) return fg_real.cuMipmappedArrayCreate(out, a, levels);
    array_args args = {(void **)out, a, levels, create_mipmap};
    return array_create(&mipmap_ops, &args, mipmap_bytes(a, levels));
}

FG_EXPORT CUresult cuArrayDestroy(CUarray a) {
    fg_init();
    if (!fg_real.cuArrayDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    return free_recorded(FG_REC_ARRAY, (uint64_t)(uintptr_t)a, undo_array);
}

FG_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    fg_init();
    if (!fg_real.cuMipmappedArrayDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    return free_recorded(FG_REC_MIPMAP, (uint64_t)(uintptr_t)a, undo_mipmap);
}

/* ---- what the container is told it has ---------------------------------------------------- */

static uint64_t share_total(uint64_t card_total) {
    if (fg.mode == FG_MODE_DENY) return 0;
    return card_total < fg.limits.memory_bytes ? card_total : fg.limits.memory_bytes;
}

static void share_info(int idx, uint64_t card_free, uint64_t card_total, uint64_t *free_out,
                       uint64_t *total_out) {
    uint64_t total = share_total(card_total);
    uint64_t used = fg.mode == FG_MODE_DENY ? 0 : fg_region_used(idx);
    uint64_t left = used < total ? total - used : 0;
    *total_out = total;
    *free_out = left < card_free ? left : card_free;
}

FG_EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    fg_init();
    if (!fg_real.cuMemGetInfo_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemGetInfo_v2(free_b, total_b);
    if (r != CUDA_SUCCESS || !ENFORCED() || !free_b || !total_b) return r;
    int idx = fg_current_index();
    if (idx == -1) return r;
    uint64_t f, t;
    share_info(idx, *free_b, idx < 0 ? 0 : *total_b, &f, &t);
    *free_b = (size_t)f;
    *total_b = (size_t)t;
    return r;
}

FG_EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    fg_init();
    if (!fg_real.cuMemGetInfo) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemGetInfo(free_b, total_b);
    if (r != CUDA_SUCCESS || !ENFORCED() || !free_b || !total_b) return r;
    int idx = fg_current_index();
    if (idx == -1) return r;
    uint64_t f, t;
    share_info(idx, *free_b, idx < 0 ? 0 : *total_b, &f, &t);
    *free_b = (unsigned int)f;
    *total_b = (unsigned int)t;
    return r;
}

FG_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    fg_init();
    if (!fg_real.cuDeviceTotalMem_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuDeviceTotalMem_v2(bytes, dev);
    if (r == CUDA_SUCCESS && ENFORCED() && bytes)
        *bytes = fg_device_index(dev) < 0 ? 0 : (size_t)share_total(*bytes);
    return r;
}

FG_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    fg_init();
    if (!fg_real.cuDeviceTotalMem) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuDeviceTotalMem(bytes, dev);
    if (r == CUDA_SUCCESS && ENFORCED() && bytes)
        *bytes = fg_device_index(dev) < 0 ? 0 : (unsigned int)share_total(*bytes);
    return r;
}

FG_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    fg_init_nvml();
    if (!fg_real.nvmlDeviceGetMemoryInfo) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = fg_real.nvmlDeviceGetMemoryInfo(dev, m);
    if (r != NVML_SUCCESS || !ENFORCED() || !m) return r;
    int idx = fg_nvml_device_index(dev);
    uint64_t f, t;
    share_info(idx, m->free, idx < 0 ? 0 : m->total, &f, &t);
    m->total = t;
    m->free = f;
    m->used = t - f;
    return r;
}

FG_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    fg_init_nvml();
    if (!fg_real.nvmlDeviceGetMemoryInfo_v2) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = fg_real.nvmlDeviceGetMemoryInfo_v2(dev, m);
    if (r != NVML_SUCCESS || !ENFORCED() || !m) return r;
    int idx = fg_nvml_device_index(dev);
    uint64_t f, t;
    share_info(idx, m->free, idx < 0 ? 0 : m->total, &f, &t);
    m->total = t;
    m->reserved = 0;
    m->free = f;
    m->used = t - f;
    return r;
}
