/* Stream-ordered allocations (cuMemAllocAsync, cuMemAllocFromPoolAsync and their _ptsz forms),
 * charged by what their pool reserves; their frees, and pool creation, trim and destroy. */
#include <pthread.h>

#include "graph.h"
#include "memory_internal.h"
#include "region.h"

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

void fg_pools_after_fork(void) {
    pthread_mutex_init(&pools_mu, NULL);
    npools = 0;
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
CUresult fg_free_any(CUdeviceptr p, CUstream s, bool async, __typeof__(cuMemFreeAsync) *real) {
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
    return fg_free_any(p, s, true, real);
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
