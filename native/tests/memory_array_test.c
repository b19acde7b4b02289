/* Unit test of the arrays (src/memory_array.c): cuArrayCreate, cuArray3DCreate (v1 and v2) and
 * cuMipmappedArrayCreate charged by their texel bytes, released by their destroy, against a
 * scripted driver. Linked with the core and tests/memory_unit.c. */
#include <string.h>

#include "memory_unit.h"

void fg_pools_after_fork(void) {}
void fg_vmm_after_fork(void) {}

/* ---- the driver ------------------------------------------------------------------------------ */

/* Arrays and mipmapped arrays are numbered apart, from the same first value: the first of each
 * has the same handle, as two kinds of object may in a real driver. */
#define FIRST 0x1000
#define NOBJ 16
static bool arrays[NOBJ], mipmaps[NOBJ];
static int create_calls;
static CUresult fail_next, fail_destroy;

static void driver_reset(void) {
    memset(arrays, 0, sizeof arrays);
    memset(mipmaps, 0, sizeof mipmaps);
    create_calls = 0;
    fail_next = fail_destroy = CUDA_SUCCESS;
}

static CUresult make(bool *objs, void **out, const void *desc) {
    create_calls++;
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!out || !desc) return CUDA_ERROR_INVALID_VALUE;
    if (fail_next) return unit_fail_once(&fail_next);
    for (int i = 0; i < NOBJ; i++) {
        if (objs[i]) continue;
        objs[i] = true;
        *out = (void *)(uintptr_t)(FIRST + i);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult unmake(bool *objs, void *h) {
    int i = (int)((uintptr_t)h - FIRST);
    if ((uintptr_t)h < FIRST || i >= NOBJ || !objs[i]) return CUDA_ERROR_INVALID_HANDLE;
    if (fail_destroy) return fail_destroy;
    objs[i] = false;
    return CUDA_SUCCESS;
}

static CUresult drv_array_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
    return make(arrays, (void **)a, d);
}
static CUresult drv_array3d_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    return make(arrays, (void **)a, d);
}
static CUresult drv_array_v1(CUarray *a, const CUDA_ARRAY_DESCRIPTOR_v1 *d) {
    return make(arrays, (void **)a, d);
}
static CUresult drv_array3d_v1(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d) {
    return make(arrays, (void **)a, d);
}
static CUresult drv_mipmap(CUmipmappedArray *m, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned l) {
    return make(mipmaps, (void **)m, d);
}
static CUresult drv_array_destroy(CUarray a) { return unmake(arrays, a); }
static CUresult drv_mipmap_destroy(CUmipmappedArray m) { return unmake(mipmaps, m); }

static void reset(fg_mode mode, uint64_t limit) {
    unit_reset(mode, limit);
    driver_reset();
    fg_real.cuArrayCreate_v2 = drv_array_v2;
    fg_real.cuArray3DCreate_v2 = drv_array3d_v2;
    fg_real.cuArrayCreate = drv_array_v1;
    fg_real.cuArray3DCreate = drv_array3d_v1;
    fg_real.cuMipmappedArrayCreate = drv_mipmap;
    fg_real.cuArrayDestroy = drv_array_destroy;
    fg_real.cuMipmappedArrayDestroy = drv_mipmap_destroy;
}

/* ---- one call for every entry point ------------------------------------------------------- */

typedef enum { ARRAY_V2, ARRAY3D_V2, ARRAY_V1, ARRAY3D_V1, MIPMAP } entry;
static const char *const entry_names[] = {"cuArrayCreate_v2", "cuArray3DCreate_v2",
                                          "cuArrayCreate", "cuArray3DCreate",
                                          "cuMipmappedArrayCreate"};
#define NENTRIES 5

typedef struct {
    size_t w, h, d;
    CUarray_format format;
    unsigned channels, levels;
} shape;

/* Create through entry e; *out is the handle. null_desc: pass no descriptor. */
static CUresult create(entry e, shape s, uint64_t *out, bool null_desc) {
    CUDA_ARRAY_DESCRIPTOR a2 = {s.w, s.h, s.format, s.channels};
    CUDA_ARRAY3D_DESCRIPTOR a3 = {s.w, s.h, s.d, s.format, s.channels, 0};
    CUDA_ARRAY_DESCRIPTOR_v1 b2 = {(unsigned)s.w, (unsigned)s.h, s.format, s.channels};
    CUDA_ARRAY3D_DESCRIPTOR_v1 b3 = {(unsigned)s.w, (unsigned)s.h, (unsigned)s.d, s.format,
                                     s.channels, 0};
    CUarray a = NULL;
    CUmipmappedArray m = NULL;
    CUresult r;
    switch (e) {
    case ARRAY_V2:
        r = cuArrayCreate_v2(&a, null_desc ? NULL : &a2);
        break;
    case ARRAY3D_V2:
        r = cuArray3DCreate_v2(&a, null_desc ? NULL : &a3);
        break;
    case ARRAY_V1:
        r = cuArrayCreate(&a, null_desc ? NULL : &b2);
        break;
    case ARRAY3D_V1:
        r = cuArray3DCreate(&a, null_desc ? NULL : &b3);
        break;
    default:
        r = cuMipmappedArrayCreate(&m, null_desc ? NULL : &a3, s.levels);
        *out = (uint64_t)(uintptr_t)m;
        return r;
    }
    *out = (uint64_t)(uintptr_t)a;
    return r;
}

static CUresult destroy(entry e, uint64_t h) {
    return e == MIPMAP ? cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)h)
                       : cuArrayDestroy((CUarray)(uintptr_t)h);
}

/* ---- what each shape is charged ------------------------------------------------------------ */

static const struct {
    const char *name;
    entry entry;
    shape shape;
    uint64_t bytes; /* UINT64_MAX: refused before the driver */
} sizes[] = {
    {"2D: width x height x texel", ARRAY_V2, {100, 10, 0, CU_AD_FORMAT_FLOAT, 4, 0}, 16000},
    {"1D: no height counts as one row", ARRAY_V2, {1000, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0},
     1000},
    {"no channels count as one", ARRAY_V2, {10, 10, 0, CU_AD_FORMAT_UNSIGNED_INT32, 0, 0}, 400},
    {"16-bit signed texels", ARRAY_V2, {10, 10, 0, CU_AD_FORMAT_SIGNED_INT16, 2, 0}, 400},
    {"an unknown format counts the widest texel", ARRAY_V2, {10, 10, 0, 0x99, 1, 0}, 1600},
    {"3D: width x height x depth x texel", ARRAY3D_V2, {8, 8, 8, CU_AD_FORMAT_HALF, 2, 0}, 2048},
    {"3D without depth is one layer", ARRAY3D_V2, {8, 8, 0, CU_AD_FORMAT_SIGNED_INT32, 1, 0},
     256},
    {"legacy 2D descriptor", ARRAY_V1, {100, 10, 0, CU_AD_FORMAT_FLOAT, 4, 0}, 16000},
    {"legacy 3D descriptor", ARRAY3D_V1, {8, 8, 8, CU_AD_FORMAT_SIGNED_INT8, 2, 0}, 1024},
    {"mipmap: each level halves", MIPMAP, {16, 16, 0, CU_AD_FORMAT_FLOAT, 1, 3}, 1344},
    {"mipmap: no levels count as one", MIPMAP, {16, 16, 0, CU_AD_FORMAT_FLOAT, 1, 0}, 1024},
    {"mipmap: sizes stop at one texel", MIPMAP, {1, 1, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 5}, 5},
    {"mipmap: 3D levels halve depth too", MIPMAP, {4, 4, 4, CU_AD_FORMAT_UNSIGNED_INT8, 1, 3},
     73},
    {"mipmap: at most 64 levels", MIPMAP, {1, 1, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 100}, 64},
    {"an overflowing size is refused", ARRAY3D_V2,
     {SIZE_MAX / 2, 4, 4, CU_AD_FORMAT_FLOAT, 4, 0}, UINT64_MAX},
    {"an overflowing mipmap is refused", MIPMAP, {SIZE_MAX / 2, 4, 4, CU_AD_FORMAT_FLOAT, 4, 2},
     UINT64_MAX},
};

static void size_row(size_t i) {
    const char *name = sizes[i].name;
    entry e = sizes[i].entry;
    reset(FG_MODE_ENFORCE, 64 * MIB);
    uint64_t h = 0;
    bool fits = sizes[i].bytes != UINT64_MAX;
    CHECK(name, create(e, sizes[i].shape, &h, false) ==
                    (fits ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY));
    CHECK(name, create_calls == (fits ? 1 : 0));
    CHECK(name, unit_used(0) == (fits ? sizes[i].bytes : 0));
    if (fits) {
        fg_rec rec;
        CHECK(name, fg_rec_get(e == MIPMAP ? FG_REC_MIPMAP : FG_REC_ARRAY, h, &rec));
        CHECK(name, rec.bytes == sizes[i].bytes && rec.dev == 0);
        CHECK(name, destroy(e, h) == CUDA_SUCCESS);
        CHECK(name, unit_used(0) == 0 && fg_rec_count() == 0 && unit_underflows == 0);
    }
    printf("ok %s\n", name);
}

/* ---- who is charged, on every entry point ------------------------------------------------ */

static const struct {
    const char *name;
    fg_mode mode;
    CUdevice device;
    uint64_t limit;
    bool null_desc;
    CUresult driver, expect;
    int calls;
    bool charged;
} who[] = {
    {"enforced: charged until destroyed", FG_MODE_ENFORCE, 1, 8 * MIB, false, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, true},
    {"past the limit: refused before the driver", FG_MODE_ENFORCE, 0, 1000, false, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, false},
    {"the driver's refusal returns the charge", FG_MODE_ENFORCE, 0, 8 * MIB, false,
     CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE, 1, false},
    {"inert: passed through uncharged", FG_MODE_INERT, 0, 8 * MIB, false, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, false},
    {"deny: refused before the driver", FG_MODE_DENY, 0, 8 * MIB, false, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, false},
    {"an ungranted card: refused before the driver", FG_MODE_ENFORCE, 2, 8 * MIB, false,
     CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, false},
    {"no context: the driver answers, uncharged", FG_MODE_ENFORCE, -1, 8 * MIB, false,
     CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT, 1, false},
    {"no descriptor: the driver answers, uncharged", FG_MODE_ENFORCE, 0, 8 * MIB, true,
     CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, 1, false},
};

static void who_is_charged(size_t i) {
    char where[160];
    const shape s = {32, 32, 1, CU_AD_FORMAT_UNSIGNED_INT8, 1, 1}; /* 1024 bytes everywhere */
    UNIT_FOR_EACH(e, NENTRIES, where, who[i].name, entry_names[e]) {
        reset(who[i].mode, who[i].limit);
        unit_device = who[i].device;
        fail_next = who[i].driver;
        uint64_t h = 0;
        CHECK(where, create((entry)e, s, &h, who[i].null_desc) == who[i].expect);
        CHECK(where, create_calls == who[i].calls);
        CHECK(where, unit_used(0) + unit_used(1) == (who[i].charged ? 1024u : 0u));
        if (who[i].charged) {
            CHECK(where, unit_used(who[i].device) == 1024);
            CHECK(where, destroy((entry)e, h) == CUDA_SUCCESS);
            CHECK(where, unit_used(who[i].device) == 0);
        }
        CHECK(where, fg_rec_count() == 0);
    }
    printf("ok %s\n", who[i].name);
}

/* ---- destroys ---------------------------------------------------------------------------- */

static void test_kinds_apart(void) {
    const char *name = "an array and a mipmap with the same handle are charged apart";
    reset(FG_MODE_ENFORCE, 8 * MIB);
    uint64_t a = 0, m = 0;
    CHECK(name, create(ARRAY_V2, (shape){100, 1, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0}, &a,
                       false) == CUDA_SUCCESS);
    CHECK(name, create(MIPMAP, (shape){300, 1, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 1}, &m,
                       false) == CUDA_SUCCESS);
    CHECK(name, a == m && unit_used(0) == 400);
    CHECK(name, destroy(ARRAY_V2, a) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 300);
    CHECK(name, destroy(MIPMAP, m) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && unit_underflows == 0);
    printf("ok %s\n", name);
}

static void test_a_refused_destroy_keeps_the_charge(void) {
    const char *name = "a refused destroy keeps the charge";
    char where[160];
    UNIT_FOR_EACH(e, NENTRIES, where, name, entry_names[e]) {
        reset(FG_MODE_ENFORCE, 8 * MIB);
        uint64_t h = 0;
        CHECK(where, create((entry)e, (shape){64, 1, 1, CU_AD_FORMAT_FLOAT, 1, 1}, &h, false) ==
                         CUDA_SUCCESS);
        fail_destroy = CUDA_ERROR_INVALID_VALUE;
        CHECK(where, destroy((entry)e, h) == CUDA_ERROR_INVALID_VALUE);
        CHECK(where, unit_used(0) == 256 && fg_rec_count() == 1);
        fail_destroy = CUDA_SUCCESS;
        CHECK(where, destroy((entry)e, h) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == 0 && fg_rec_count() == 0);
    }
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) size_row(i);
    for (size_t i = 0; i < sizeof who / sizeof who[0]; i++) who_is_charged(i);
    test_kinds_apart();
    test_a_refused_destroy_keeps_the_charge();
    return failures;
}
