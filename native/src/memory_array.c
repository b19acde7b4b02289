/* Arrays and mipmapped arrays (v1 and v2 descriptors): charged by their texel bytes. */
#include "memory_internal.h"

static CUresult undo_array(uint64_t a) { return fg_real.cuArrayDestroy((CUarray)(uintptr_t)a); }
static CUresult undo_mipmap(uint64_t a) {
    return fg_real.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)a);
}

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
    return fg_alloc_charged(ops, args, idx, bytes);
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
    return fg_free_recorded(FG_REC_ARRAY, (uint64_t)(uintptr_t)a, undo_array);
}

FG_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    fg_init();
    if (!fg_real.cuMipmappedArrayDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    return fg_free_recorded(FG_REC_MIPMAP, (uint64_t)(uintptr_t)a, undo_mipmap);
}
