/* Linear allocations: cuMemAlloc(_v2), cuMemAllocManaged, cuMemAllocPitch(_v2), their frees,
 * and cuCtxDestroy, which frees what was allocated in the context. */
#include "memory_internal.h"
#include "region.h"

static CUresult undo_free_v2(uint64_t p) { return fg_real.cuMemFree_v2(p); }
static CUresult undo_free_v1(uint64_t p) { return fg_real.cuMemFree((CUdeviceptr_v1)p); }

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
    return fg_alloc_charged(&alloc_v2_ops, &args, idx, bytes);
}

/* Managed memory can migrate to the host, but it can also fill the card: counted in full. */
FG_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    fg_init();
    if (!fg_real.cuMemAllocManaged) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || bytes == 0 || !dptr) return fg_real.cuMemAllocManaged(dptr, bytes, flags);
    int idx = fg_current_index();
    if (idx == FG_NO_CONTEXT) return fg_real.cuMemAllocManaged(dptr, bytes, flags);
    linear_args args = {dptr, bytes, flags};
    return fg_alloc_charged(&managed_ops, &args, idx, bytes);
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
    return fg_alloc_charged(&alloc_v1_ops, &args, idx, bytes);
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
    return fg_alloc_charged(&pitch_v2_ops, &args, idx, pitch_worst(width, height));
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
    return fg_alloc_charged(&pitch_v1_ops, &args, idx, pitch_worst(width, height));
}

FG_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    fg_init();
    if (!fg_real.cuMemFree_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemFree_v2(p);
    return fg_free_any(p, NULL, false, NULL);
}

FG_EXPORT CUresult cuMemFree(CUdeviceptr_v1 p) {
    fg_init();
    if (!fg_real.cuMemFree) return CUDA_ERROR_NOT_INITIALIZED;
    return fg_free_recorded(FG_REC_PTR_V1, p, undo_free_v1);
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
