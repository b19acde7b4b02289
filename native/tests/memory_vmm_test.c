/* Unit test of virtual memory management (src/memory_vmm.c): cuMemCreate handles charged until
 * both released and unmapped, exported handles kept, imported mappings charged by their size,
 * against a scripted driver. Linked with the core and tests/memory_unit.c. */
#include <string.h>

#include "memory_unit.h"

void fg_pools_after_fork(void) {}

/* ---- the driver ------------------------------------------------------------------------------ */

#define NHANDLES 16
#define NMAPS 16
#define HOST (-1)
static struct {
    bool exists, released;
    uint64_t bytes;
    int device; /* ordinal, or HOST */
} handles[NHANDLES];
static struct {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle h;
    bool live;
} maps[NMAPS];
static int create_calls, map_calls;
static CUresult fail_next, fail_release;

static CUmemGenericAllocationHandle handle(int i) {
    return 0x100 + (CUmemGenericAllocationHandle)i;
}
static int handle_of(CUmemGenericAllocationHandle h) {
    int i = (int)(h - 0x100);
    return h >= 0x100 && i < NHANDLES && handles[i].exists ? i : -1;
}

static void driver_reset(void) {
    memset(handles, 0, sizeof handles);
    memset(maps, 0, sizeof maps);
    create_calls = map_calls = 0;
    fail_next = fail_release = CUDA_SUCCESS;
}

/* A handle some other process created (and this one imported). */
static CUmemGenericAllocationHandle foreign(int device, uint64_t bytes) {
    for (int i = NHANDLES - 1; i >= 0; i--) {
        if (handles[i].exists) continue;
        handles[i].exists = true;
        handles[i].bytes = bytes;
        handles[i].device = device;
        return handle(i);
    }
    return 0;
}

static CUresult drv_create(CUmemGenericAllocationHandle *h, size_t bytes,
                           const CUmemAllocationProp *prop, unsigned long long flags) {
    create_calls++;
    if (fail_next) return unit_fail_once(&fail_next);
    for (int i = 0; i < NHANDLES; i++) {
        if (handles[i].exists) continue;
        handles[i].exists = true;
        handles[i].released = false;
        handles[i].bytes = bytes;
        handles[i].device =
            prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : HOST;
        *h = handle(i);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult drv_release(CUmemGenericAllocationHandle h) {
    int i = handle_of(h);
    if (i < 0 || handles[i].released) return CUDA_ERROR_INVALID_VALUE;
    if (fail_release) return fail_release;
    handles[i].released = true;
    return CUDA_SUCCESS;
}

static CUresult drv_map(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                        unsigned long long flags) {
    map_calls++;
    int i = handle_of(h);
    if (i < 0 || handles[i].released || offset + size > handles[i].bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (fail_next) return unit_fail_once(&fail_next);
    for (int m = 0; m < NMAPS; m++) {
        if (maps[m].live) continue;
        maps[m] = (__typeof__(maps[0])){va, size, h, true};
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult drv_unmap(CUdeviceptr va, size_t size) {
    int n = 0;
    for (int m = 0; m < NMAPS; m++) {
        if (maps[m].live && maps[m].va >= va && maps[m].va - va < size) {
            maps[m].live = false;
            n++;
        }
    }
    return n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult drv_export(void *out, CUmemGenericAllocationHandle h, int type,
                           unsigned long long flags) {
    if (handle_of(h) < 0) return CUDA_ERROR_INVALID_VALUE;
    *(int *)out = 42;
    return CUDA_SUCCESS;
}

static CUresult drv_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    int i = handle_of(h);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    memset(prop, 0, sizeof *prop);
    prop->location.type = handles[i].device == HOST ? 0 : CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = handles[i].device == HOST ? 0 : handles[i].device;
    return CUDA_SUCCESS;
}

static void reset(fg_mode mode, uint64_t limit) {
    unit_reset(mode, limit);
    driver_reset();
    fg_real.cuMemCreate = drv_create;
    fg_real.cuMemRelease = drv_release;
    fg_real.cuMemMap = drv_map;
    fg_real.cuMemUnmap = drv_unmap;
    fg_real.cuMemExportToShareableHandle = drv_export;
    fg_real.cuMemGetAllocationPropertiesFromHandle = drv_props;
}

static CUresult create(int type, int ordinal, size_t bytes, CUmemGenericAllocationHandle *h) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.location.type = type;
    prop.location.id = ordinal;
    return cuMemCreate(h, bytes, &prop, 0);
}

/* ---- cuMemCreate ------------------------------------------------------------------------- */

static const struct {
    const char *name;
    int type, ordinal;
    size_t bytes;
    CUresult driver, expect;
    int calls;
    int charged_idx; /* -1: nothing charged */
} creates[] = {
    {"create: charged by size on its card", CU_MEM_LOCATION_TYPE_DEVICE, 1, 4 * MIB,
     CUDA_SUCCESS, CUDA_SUCCESS, 1, 1},
    {"create: the whole share fits", CU_MEM_LOCATION_TYPE_DEVICE, 0, 8 * MIB, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, 0},
    {"create: past the limit refused before the driver", CU_MEM_LOCATION_TYPE_DEVICE, 0,
     8 * MIB + 1, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"create: an ungranted card is refused", CU_MEM_LOCATION_TYPE_DEVICE, 2, MIB, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"create: host memory is not the card's", 0, 0, MIB, CUDA_SUCCESS, CUDA_SUCCESS, 1, -1},
    {"create: the driver's refusal returns the charge", CU_MEM_LOCATION_TYPE_DEVICE, 0, MIB,
     CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE, 1, -1},
};

static void create_row(size_t i) {
    const char *name = creates[i].name;
    reset(FG_MODE_ENFORCE, 8 * MIB);
    fail_next = creates[i].driver;
    CUmemGenericAllocationHandle h = 0;
    CHECK(name, create(creates[i].type, creates[i].ordinal, creates[i].bytes, &h) ==
                    creates[i].expect);
    CHECK(name, create_calls == creates[i].calls);
    int c = creates[i].charged_idx;
    CHECK(name, unit_used(0) + unit_used(1) == (c >= 0 ? creates[i].bytes : 0));
    if (c >= 0) CHECK(name, unit_used(c) == creates[i].bytes);
    fg_rec rec;
    CHECK(name, fg_rec_get(FG_REC_VMM, h, &rec) == (c >= 0));
    if (c >= 0) {
        CHECK(name, rec.bytes == creates[i].bytes && rec.dev == c && rec.aux == 0);
        CHECK(name, cuMemRelease(h) == CUDA_SUCCESS);
        CHECK(name, unit_used(c) == 0 && fg_rec_count() == 0 && unit_underflows == 0);
    }
    printf("ok %s\n", name);
}

/* ---- a handle's lifetime: release, mappings, export ---------------------------------------- */

/* One 4 MiB handle; mapping A is its first half, B its second. */
typedef enum { END, CREATE, MAP_A, MAP_B, UNMAP_A, UNMAP_B, UNMAP_AB, RELEASE, EXPORT } op;
static const char *const op_names[] = {"end",     "create",   "map A",   "map B", "unmap A",
                                       "unmap B", "unmap AB", "release", "export"};
#define VA_A 0x10000000ull
#define VA_B (VA_A + 2 * MIB)

static const struct {
    const char *name;
    struct {
        op op;
        uint64_t used; /* the charge after the step */
    } steps[8];
} lives[] = {
    {"released, never mapped: the charge goes", {{CREATE, 4 * MIB}, {RELEASE, 0}}},
    {"released while mapped: charged until the last unmap",
     {{CREATE, 4 * MIB},
      {MAP_A, 4 * MIB},
      {MAP_B, 4 * MIB},
      {RELEASE, 4 * MIB},
      {UNMAP_A, 4 * MIB},
      {UNMAP_B, 0}}},
    {"unmapped, then released: the charge goes at the release",
     {{CREATE, 4 * MIB}, {MAP_A, 4 * MIB}, {UNMAP_A, 4 * MIB}, {RELEASE, 0}}},
    {"one unmap covering both mappings",
     {{CREATE, 4 * MIB}, {MAP_A, 4 * MIB}, {MAP_B, 4 * MIB}, {RELEASE, 4 * MIB}, {UNMAP_AB, 0}}},
    {"mapped again after an unmap",
     {{CREATE, 4 * MIB},
      {MAP_A, 4 * MIB},
      {UNMAP_A, 4 * MIB},
      {MAP_B, 4 * MIB},
      {RELEASE, 4 * MIB},
      {UNMAP_B, 0}}},
    {"exported: charged while the process lives",
     {{CREATE, 4 * MIB}, {EXPORT, 4 * MIB}, {MAP_A, 4 * MIB}, {RELEASE, 4 * MIB},
      {UNMAP_A, 4 * MIB}}},
    {"exported after its release, while mapped: still kept",
     {{CREATE, 4 * MIB}, {MAP_A, 4 * MIB}, {RELEASE, 4 * MIB}, {EXPORT, 4 * MIB},
      {UNMAP_A, 4 * MIB}}},
};

static CUresult step(op o, CUmemGenericAllocationHandle *h) {
    switch (o) {
    case CREATE:
        return create(CU_MEM_LOCATION_TYPE_DEVICE, 0, 4 * MIB, h);
    case MAP_A:
        return cuMemMap(VA_A, 2 * MIB, 0, *h, 0);
    case MAP_B:
        return cuMemMap(VA_B, 2 * MIB, 2 * MIB, *h, 0);
    case UNMAP_A:
        return cuMemUnmap(VA_A, 2 * MIB);
    case UNMAP_B:
        return cuMemUnmap(VA_B, 2 * MIB);
    case UNMAP_AB:
        return cuMemUnmap(VA_A, 4 * MIB);
    case RELEASE:
        return cuMemRelease(*h);
    case EXPORT: {
        int fd = 0;
        return cuMemExportToShareableHandle(&fd, *h, 1, 0);
    }
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

static void lifetime(size_t i) {
    char where[160];
    reset(FG_MODE_ENFORCE, 8 * MIB);
    CUmemGenericAllocationHandle h = 0;
    for (int s = 0; lives[i].steps[s].op != END; s++) {
        snprintf(where, sizeof where, "%s [step %d: %s]", lives[i].name, s + 1,
                 op_names[lives[i].steps[s].op]);
        CHECK(where, step(lives[i].steps[s].op, &h) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == lives[i].steps[s].used);
        CHECK(where, unit_underflows == 0);
        /* The record lives exactly as long as the charge. */
        fg_rec rec;
        CHECK(where, fg_rec_get(FG_REC_VMM, h, &rec) == (lives[i].steps[s].used != 0));
    }
    printf("ok %s\n", lives[i].name);
}

/* ---- mappings of imported handles ---------------------------------------------------------- */

static const struct {
    const char *name;
    int device;
    uint64_t limit;
    CUresult driver, expect;
    int calls;
    int charged_idx; /* -1: nothing charged */
} imports[] = {
    {"imported: charged by the mapping's size on the handle's card", 1, 8 * MIB, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, 1},
    {"imported: past the limit refused before the driver", 0, MIB, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"imported: an ungranted card is refused", 2, 8 * MIB, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"imported: a handle on no card is refused", HOST, 8 * MIB, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"imported: the driver's refusal returns the charge", 0, 8 * MIB, CUDA_ERROR_INVALID_VALUE,
     CUDA_ERROR_INVALID_VALUE, 1, -1},
};

static void import_row(size_t i) {
    const char *name = imports[i].name;
    reset(FG_MODE_ENFORCE, imports[i].limit);
    CUmemGenericAllocationHandle h = foreign(imports[i].device, 4 * MIB);
    fail_next = imports[i].driver;
    CHECK(name, cuMemMap(VA_A, 2 * MIB, 0, h, 0) == imports[i].expect);
    CHECK(name, map_calls == imports[i].calls);
    int c = imports[i].charged_idx;
    CHECK(name, unit_used(0) + unit_used(1) == (c >= 0 ? 2 * MIB : 0));
    CHECK(name, fg_rec_count() == 0); /* the mapping is charged, not a handle of ours */
    if (c >= 0) {
        CHECK(name, unit_used(c) == 2 * MIB);
        CHECK(name, cuMemUnmap(VA_A, 2 * MIB) == CUDA_SUCCESS);
        CHECK(name, unit_used(c) == 0 && unit_underflows == 0);
    }
    printf("ok %s\n", name);
}

/* ---- the rest ---------------------------------------------------------------------------- */

static void test_a_refused_release_keeps_the_charge(void) {
    const char *name = "a refused release keeps the charge";
    reset(FG_MODE_ENFORCE, 8 * MIB);
    CUmemGenericAllocationHandle h = 0;
    CHECK(name, create(CU_MEM_LOCATION_TYPE_DEVICE, 0, 4 * MIB, &h) == CUDA_SUCCESS);
    fail_release = CUDA_ERROR_INVALID_VALUE;
    CHECK(name, cuMemRelease(h) == CUDA_ERROR_INVALID_VALUE);
    CHECK(name, unit_used(0) == 4 * MIB && fg_rec_count() == 1);
    fail_release = CUDA_SUCCESS;
    CHECK(name, cuMemRelease(h) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && fg_rec_count() == 0);
    printf("ok %s\n", name);
}

static void test_inert_passes_through(void) {
    const char *name = "inert: create, map, unmap and release pass through uncharged";
    reset(FG_MODE_INERT, 8 * MIB);
    CUmemGenericAllocationHandle h = 0;
    CHECK(name, create(CU_MEM_LOCATION_TYPE_DEVICE, 0, 4 * MIB, &h) == CUDA_SUCCESS);
    CHECK(name, cuMemMap(VA_A, 2 * MIB, 0, h, 0) == CUDA_SUCCESS);
    CHECK(name, cuMemUnmap(VA_A, 2 * MIB) == CUDA_SUCCESS);
    CHECK(name, cuMemRelease(h) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && fg_rec_count() == 0 && create_calls == 1 && map_calls == 1);
    printf("ok %s\n", name);
}

static void test_a_forked_child_forgets_the_mappings(void) {
    const char *name = "a forked child forgets the parent's handles and mappings";
    reset(FG_MODE_ENFORCE, 8 * MIB);
    CUmemGenericAllocationHandle h = 0, f = foreign(1, 4 * MIB);
    CHECK(name, create(CU_MEM_LOCATION_TYPE_DEVICE, 0, 4 * MIB, &h) == CUDA_SUCCESS);
    CHECK(name, cuMemMap(VA_A, 2 * MIB, 0, h, 0) == CUDA_SUCCESS);
    CHECK(name, cuMemMap(VA_B, 2 * MIB, 0, f, 0) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 4 * MIB && unit_used(1) == 2 * MIB);
    fg_memory_after_fork();
    CHECK(name, cuMemUnmap(VA_A, 4 * MIB) == CUDA_SUCCESS);
    CHECK(name, cuMemRelease(h) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 4 * MIB && unit_used(1) == 2 * MIB && unit_underflows == 0);
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof creates / sizeof creates[0]; i++) create_row(i);
    for (size_t i = 0; i < sizeof lives / sizeof lives[0]; i++) lifetime(i);
    for (size_t i = 0; i < sizeof imports / sizeof imports[0]; i++) import_row(i);
    test_a_refused_release_keeps_the_charge();
    test_inert_passes_through();
    test_a_forked_child_forgets_the_mappings();
    return failures;
}
