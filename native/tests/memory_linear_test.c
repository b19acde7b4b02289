/* Unit test of the linear allocations (src/memory_linear.c): cuMemAlloc(_v2), cuMemAllocManaged,
 * cuMemAllocPitch(_v2), their frees and cuCtxDestroy, against a scripted driver. Linked with the
 * core, tests/memory_unit.c and src/memory_pool.c (cuMemFree_v2's free is shared with it). */
#include <string.h>

#include "memory_unit.h"

void fg_vmm_after_fork(void) {}

/* ---- the driver ------------------------------------------------------------------------------ */

#define SLOTS 64
static struct {
    CUdeviceptr p;
    uint64_t bytes;
    CUcontext ctx;
    bool live;
} allocs[SLOTS];
static CUdeviceptr next_ptr;
static int alloc_calls;
static CUresult fail_next, fail_free;
static size_t pitch_align;
static unsigned last_flags;

static void driver_reset(void) {
    memset(allocs, 0, sizeof allocs);
    next_ptr = 0x10000000;
    alloc_calls = 0;
    fail_next = fail_free = CUDA_SUCCESS;
    pitch_align = 512;
    last_flags = 0;
}

static int driver_live(void) {
    int n = 0;
    for (int i = 0; i < SLOTS; i++) n += allocs[i].live;
    return n;
}

static CUresult take(CUdeviceptr *out, uint64_t bytes) {
    alloc_calls++;
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!out || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (fail_next) return unit_fail_once(&fail_next);
    for (int i = 0; i < SLOTS; i++) {
        if (allocs[i].live) continue;
        allocs[i].p = next_ptr += 0x100000;
        allocs[i].bytes = bytes;
        allocs[i].ctx = unit_context;
        allocs[i].live = true;
        *out = allocs[i].p;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult give(CUdeviceptr p) {
    if (fail_free) return fail_free;
    for (int i = 0; i < SLOTS; i++) {
        if (allocs[i].live && allocs[i].p == p) {
            allocs[i].live = false;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult drv_alloc_v2(CUdeviceptr *d, size_t n) { return take(d, n); }
static CUresult drv_managed(CUdeviceptr *d, size_t n, unsigned flags) {
    last_flags = flags;
    return take(d, n);
}
static CUresult drv_alloc_v1(CUdeviceptr_v1 *d, unsigned n) {
    CUdeviceptr p = 0;
    CUresult r = take(d ? &p : NULL, n);
    if (r == CUDA_SUCCESS) *d = (CUdeviceptr_v1)p;
    return r;
}
static CUresult drv_pitch_v2(CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned elem) {
    if (!pitch || w == 0 || h == 0) return CUDA_ERROR_INVALID_VALUE;
    *pitch = (w + pitch_align - 1) / pitch_align * pitch_align;
    return take(d, (uint64_t)*pitch * h);
}
static CUresult drv_pitch_v1(CUdeviceptr_v1 *d, unsigned *pitch, unsigned w, unsigned h,
                             unsigned elem) {
    size_t p64 = 0;
    CUdeviceptr p = 0;
    CUresult r = drv_pitch_v2(d ? &p : NULL, pitch ? &p64 : NULL, w, h, elem);
    if (r == CUDA_SUCCESS) {
        *d = (CUdeviceptr_v1)p;
        *pitch = (unsigned)p64;
    }
    return r;
}
static CUresult drv_free_v2(CUdeviceptr p) { return give(p); }
static CUresult drv_free_v1(CUdeviceptr_v1 p) { return give(p); }
static CUresult drv_ctx_destroy(CUcontext c) {
    if (c == (CUcontext)(uintptr_t)0xdead) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < SLOTS; i++)
        if (allocs[i].ctx == c) allocs[i].live = false;
    return CUDA_SUCCESS;
}

static void reset(fg_mode mode, uint64_t limit) {
    unit_reset(mode, limit);
    driver_reset();
    fg_real.cuMemAlloc_v2 = drv_alloc_v2;
    fg_real.cuMemAllocManaged = drv_managed;
    fg_real.cuMemAlloc = drv_alloc_v1;
    fg_real.cuMemAllocPitch_v2 = drv_pitch_v2;
    fg_real.cuMemAllocPitch = drv_pitch_v1;
    fg_real.cuMemFree_v2 = drv_free_v2;
    fg_real.cuMemFree = drv_free_v1;
    fg_real.cuCtxDestroy_v2 = drv_ctx_destroy;
}

/* ---- the three plain entry points, one table --------------------------------------------- */

typedef enum { PATH_V2, PATH_MANAGED, PATH_V1 } path;
static const struct {
    const char *name;
    path path;
    fg_rec_kind kind;
} paths[] = {
    {"cuMemAlloc_v2", PATH_V2, FG_REC_PTR},
    {"cuMemAllocManaged", PATH_MANAGED, FG_REC_PTR},
    {"cuMemAlloc (v1)", PATH_V1, FG_REC_PTR_V1},
};
#define NPATHS (sizeof paths / sizeof paths[0])

static CUresult alloc_on(path p, CUdeviceptr *out, uint64_t bytes) {
    CUdeviceptr_v1 p1 = 0;
    CUresult r;
    switch (p) {
    case PATH_V2:
        return cuMemAlloc_v2(out, bytes);
    case PATH_MANAGED:
        return cuMemAllocManaged(out, bytes, 1);
    default:
        r = cuMemAlloc(&p1, (unsigned)bytes);
        *out = p1;
        return r;
    }
}
static CUresult free_on(path p, CUdeviceptr d) {
    return p == PATH_V1 ? cuMemFree((CUdeviceptr_v1)d) : cuMemFree_v2(d);
}

/* Each row runs on every path; a failure names the path, "ok" the row. */
#define FOR_EACH_PATH(P, WHERE, ROW) UNIT_FOR_EACH(P, NPATHS, WHERE, ROW, paths[P].name)

static void test_charged_by_size_and_freed(void) {
    const char *name = "charged by size on either card, freed exactly";
    char where[160];
    FOR_EACH_PATH(p, where, name) {
        for (CUdevice dev = 0; dev < 2; dev++) {
            reset(FG_MODE_ENFORCE, 8 * MIB);
            unit_device = dev;
            CUdeviceptr d = 0;
            CHECK(where, alloc_on(paths[p].path, &d, 3 * MIB) == CUDA_SUCCESS);
            CHECK(where, unit_used(dev) == 3 * MIB && unit_used(1 - dev) == 0);
            fg_rec rec;
            CHECK(where, fg_rec_get(paths[p].kind, d, &rec));
            CHECK(where, rec.bytes == 3 * MIB && rec.dev == dev);
            if (paths[p].path == PATH_MANAGED) CHECK(where, last_flags == 1);
            CHECK(where, free_on(paths[p].path, d) == CUDA_SUCCESS);
            CHECK(where, unit_used(dev) == 0 && fg_rec_count() == 0 && driver_live() == 0);
            CHECK(where, unit_underflows == 0);
        }
    }
    printf("ok %s\n", name);
}

static void test_the_limit_is_exact(void) {
    const char *name = "the last byte fits, the next never reaches the driver";
    char where[160];
    FOR_EACH_PATH(p, where, name) {
        reset(FG_MODE_ENFORCE, 8 * MIB);
        CUdeviceptr a = 0, b = 0, c = 0;
        CHECK(where, alloc_on(paths[p].path, &a, 8 * MIB - 1) == CUDA_SUCCESS);
        CHECK(where, alloc_on(paths[p].path, &b, 1) == CUDA_SUCCESS);
        int calls = alloc_calls;
        CHECK(where, alloc_on(paths[p].path, &c, 1) == CUDA_ERROR_OUT_OF_MEMORY);
        CHECK(where, alloc_calls == calls && unit_used(0) == 8 * MIB);
        CHECK(where, free_on(paths[p].path, b) == CUDA_SUCCESS);
        CHECK(where, alloc_on(paths[p].path, &c, 1) == CUDA_SUCCESS);
    }
    printf("ok %s\n", name);
}

static void test_the_drivers_refusal_returns_the_charge(void) {
    const char *name = "the driver's refusal returns the charge";
    char where[160];
    FOR_EACH_PATH(p, where, name) {
        reset(FG_MODE_ENFORCE, 8 * MIB);
        fail_next = CUDA_ERROR_INVALID_VALUE;
        CUdeviceptr d = 0;
        CHECK(where, alloc_on(paths[p].path, &d, 2 * MIB) == CUDA_ERROR_INVALID_VALUE);
        CHECK(where, unit_used(0) == 0 && fg_rec_count() == 0);
    }
    printf("ok %s\n", name);
}

/* ---- who is charged at all ----------------------------------------------------------------- */

static const struct {
    const char *name;
    fg_mode mode;
    CUdevice device;
    uint64_t bytes;
    CUresult expect;
    bool driver_asked;
    uint64_t used;
} who[] = {
    {"enforced: charged", FG_MODE_ENFORCE, 0, MIB, CUDA_SUCCESS, true, MIB},
    {"inert: passed through uncharged", FG_MODE_INERT, 0, MIB, CUDA_SUCCESS, true, 0},
    {"deny: refused before the driver", FG_MODE_DENY, 0, MIB, CUDA_ERROR_OUT_OF_MEMORY, false,
     0},
    {"an ungranted card: refused before the driver", FG_MODE_ENFORCE, 2, MIB,
     CUDA_ERROR_OUT_OF_MEMORY, false, 0},
    {"no context: the driver answers, uncharged", FG_MODE_ENFORCE, -1, MIB,
     CUDA_ERROR_INVALID_CONTEXT, true, 0},
    {"zero bytes: the driver answers, uncharged", FG_MODE_ENFORCE, 0, 0, CUDA_ERROR_INVALID_VALUE,
     true, 0},
};

static void who_is_charged(size_t i) {
    char where[160];
    FOR_EACH_PATH(p, where, who[i].name) {
        reset(who[i].mode, 8 * MIB);
        unit_device = who[i].device;
        CUdeviceptr d = 0;
        CHECK(where, alloc_on(paths[p].path, &d, who[i].bytes) == who[i].expect);
        CHECK(where, alloc_calls == (who[i].driver_asked ? 1 : 0));
        CHECK(where, unit_used(0) + unit_used(1) == who[i].used);
        CHECK(where, fg_rec_count() == (who[i].used ? 1u : 0u));
    }
    printf("ok %s\n", who[i].name);
}

/* ---- pitched allocations ------------------------------------------------------------------- */

/* The driver pads each row to its pitch alignment (pitch_align here). */
static const struct {
    const char *name;
    bool v1;
    size_t width, height, align;
    uint64_t limit;
    CUresult expect;
    uint64_t used;
    int calls;
} pitch[] = {
    {"pitch: settled on the driver's 512-byte pitch", false, 100, 10, 512, 8 * MIB, CUDA_SUCCESS,
     5120, 1},
    {"pitch: a finer pitch settles down", false, 100, 10, 256, 8 * MIB, CUDA_SUCCESS, 2560, 1},
    {"pitch: a coarser pitch settles up", false, 100, 10, 1024, 8 * MIB, CUDA_SUCCESS, 10240, 1},
    {"pitch: settling up past the limit frees it", false, 100, 10, 1024, 8000,
     CUDA_ERROR_OUT_OF_MEMORY, 0, 1},
    {"pitch: the padded worst case is charged first", false, 100, 10, 256, 5000,
     CUDA_ERROR_OUT_OF_MEMORY, 0, 0},
    {"pitch: an overflowing size is refused", false, SIZE_MAX - 10, 2, 512, 8 * MIB,
     CUDA_ERROR_OUT_OF_MEMORY, 0, 0},
    {"legacy pitch: settled on the driver's pitch", true, 100, 10, 256, 8 * MIB, CUDA_SUCCESS,
     2560, 1},
    {"legacy pitch: settling up past the limit frees it", true, 100, 10, 1024, 8000,
     CUDA_ERROR_OUT_OF_MEMORY, 0, 1},
};

static void pitch_row(size_t i) {
    const char *name = pitch[i].name;
    reset(FG_MODE_ENFORCE, pitch[i].limit);
    pitch_align = pitch[i].align;
    CUresult r;
    CUdeviceptr d = 0;
    if (pitch[i].v1) {
        CUdeviceptr_v1 d1 = 0;
        unsigned p = 0;
        r = cuMemAllocPitch(&d1, &p, (unsigned)pitch[i].width, (unsigned)pitch[i].height, 4);
        d = d1;
    } else {
        size_t p = 0;
        r = cuMemAllocPitch_v2(&d, &p, pitch[i].width, pitch[i].height, 4);
    }
    CHECK(name, r == pitch[i].expect);
    CHECK(name, alloc_calls == pitch[i].calls);
    CHECK(name, unit_used(0) == pitch[i].used);
    CHECK(name, driver_live() == (r == CUDA_SUCCESS ? 1 : 0)); /* refused: undone */
    if (r == CUDA_SUCCESS) {
        fg_rec rec;
        CHECK(name, fg_rec_get(pitch[i].v1 ? FG_REC_PTR_V1 : FG_REC_PTR, d, &rec));
        CHECK(name, rec.bytes == pitch[i].used);
        CHECK(name, (pitch[i].v1 ? cuMemFree((CUdeviceptr_v1)d) : cuMemFree_v2(d)) ==
                        CUDA_SUCCESS);
        CHECK(name, unit_used(0) == 0 && driver_live() == 0);
    }
    CHECK(name, unit_underflows == 0);
    printf("ok %s\n", name);
}

/* ---- frees and contexts ------------------------------------------------------------------- */

static void test_a_refused_free_keeps_the_charge(void) {
    const char *name = "a refused free keeps the charge";
    reset(FG_MODE_ENFORCE, 8 * MIB);
    CUdeviceptr d = 0;
    CHECK(name, cuMemAlloc_v2(&d, 2 * MIB) == CUDA_SUCCESS);
    fail_free = CUDA_ERROR_INVALID_VALUE;
    CHECK(name, cuMemFree_v2(d) == CUDA_ERROR_INVALID_VALUE);
    CHECK(name, unit_used(0) == 2 * MIB && fg_rec_count() == 1);
    fail_free = CUDA_SUCCESS;
    CHECK(name, cuMemFree_v2(d) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && fg_rec_count() == 0);
    printf("ok %s\n", name);
}

static void test_a_free_of_uncharged_memory_releases_nothing(void) {
    const char *name = "a free of memory never charged releases nothing";
    reset(FG_MODE_INERT, 8 * MIB);
    CUdeviceptr d = 0;
    CHECK(name, cuMemAlloc_v2(&d, 2 * MIB) == CUDA_SUCCESS);
    fg.mode = FG_MODE_ENFORCE;
    CUdeviceptr e = 0;
    CHECK(name, cuMemAlloc_v2(&e, MIB) == CUDA_SUCCESS);
    CHECK(name, cuMemFree_v2(d) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == MIB && unit_underflows == 0);
    printf("ok %s\n", name);
}

static void test_context_destroy(void) {
    const char *name = "cuCtxDestroy returns that context's linear memory only";
    reset(FG_MODE_ENFORCE, 8 * MIB);
    CUcontext a = (CUcontext)(uintptr_t)0xa0, b = (CUcontext)(uintptr_t)0xb0;
    CUdeviceptr d = 0;
    CUdeviceptr_v1 d1 = 0;
    unit_context = a;
    CHECK(name, cuMemAlloc_v2(&d, MIB) == CUDA_SUCCESS);
    CHECK(name, cuMemAlloc(&d1, MIB) == CUDA_SUCCESS);
    unit_context = b;
    CHECK(name, cuMemAlloc_v2(&d, 2 * MIB) == CUDA_SUCCESS);
    /* Another kind's record with the context's value in aux is not the context's. */
    CHECK(name, fg_rec_put(&(fg_rec){0x99, 0, (uint64_t)(uintptr_t)a, 0, FG_REC_VMM}));
    CHECK(name, cuCtxDestroy_v2((CUcontext)(uintptr_t)0xdead) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(name, unit_used(0) == 4 * MIB);
    CHECK(name, cuCtxDestroy_v2(a) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 2 * MIB && fg_rec_count() == 2);
    CHECK(name, cuCtxDestroy_v2(b) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && fg_rec_count() == 1 && unit_underflows == 0);
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_charged_by_size_and_freed();
    test_the_limit_is_exact();
    test_the_drivers_refusal_returns_the_charge();
    for (size_t i = 0; i < sizeof who / sizeof who[0]; i++) who_is_charged(i);
    for (size_t i = 0; i < sizeof pitch / sizeof pitch[0]; i++) pitch_row(i);
    test_a_refused_free_keeps_the_charge();
    test_a_free_of_uncharged_memory_releases_nothing();
    test_context_destroy();
    return failures;
}
