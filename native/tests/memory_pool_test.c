/* Unit test of the stream-ordered allocations (src/memory_pool.c): charged by what their pool
 * reserves, settled on frees, trims and destroys, against a scripted driver whose pools grow in
 * chunks and keep freed memory until trimmed. Linked with the core and tests/memory_unit.c. */
#include <string.h>

#include "memory_unit.h"

void fg_vmm_after_fork(void) {}

/* ---- the driver ------------------------------------------------------------------------------ */

#define NPOOLS 300 /* more than the hook tracks; the first UNIT_CARDS are the cards' defaults */
#define NALLOCS 64
static struct {
    bool live;
    uint64_t reserved, used;
} pools[NPOOLS];
static struct {
    CUdeviceptr p;
    uint64_t bytes;
    int pool;
    bool live;
} allocs[NALLOCS];
static uint64_t chunk;
static int queries, alloc_calls, destroys;
static CUresult fail_next, fail_free, fail_destroy;
static CUdeviceptr next_ptr, linear_ptr;

static CUmemoryPool handle(int i) { return (CUmemoryPool)(uintptr_t)(i + 1); }
static int pool_of(CUmemoryPool h) {
    int i = (int)(uintptr_t)h - 1;
    return i >= 0 && i < NPOOLS && pools[i].live ? i : -1;
}
static uint64_t round_up(uint64_t v) { return (v + chunk - 1) / chunk * chunk; }

static void driver_reset(void) {
    memset(pools, 0, sizeof pools);
    memset(allocs, 0, sizeof allocs);
    for (int d = 0; d < UNIT_CARDS; d++) pools[d].live = true;
    chunk = 32 * MIB;
    queries = alloc_calls = destroys = 0;
    fail_next = fail_free = fail_destroy = CUDA_SUCCESS;
    next_ptr = 0x70000000;
    linear_ptr = 0;
}

static int driver_live(void) {
    int n = 0;
    for (int i = 0; i < NALLOCS; i++) n += allocs[i].live;
    return n;
}

static CUresult pool_take(CUdeviceptr *d, size_t n, CUmemoryPool h, CUstream s) {
    alloc_calls++;
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    int i = h ? pool_of(h) : unit_device;
    if (!d || n == 0 || i < 0) return CUDA_ERROR_INVALID_VALUE;
    if (fail_next) return unit_fail_once(&fail_next);
    if (s && s == unit_capturing) { /* a graph memory node: the pool is untouched */
        *d = next_ptr += 0x100000;
        return CUDA_SUCCESS;
    }
    for (int a = 0; a < NALLOCS; a++) {
        if (allocs[a].live) continue;
        allocs[a] = (__typeof__(allocs[0])){next_ptr += 0x100000, n, i, true};
        pools[i].used += n;
        if (pools[i].reserved < pools[i].used) pools[i].reserved = round_up(pools[i].used);
        *d = allocs[a].p;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult drv_alloc_async(CUdeviceptr *d, size_t n, CUstream s) {
    return pool_take(d, n, NULL, s);
}
static CUresult drv_alloc_from_pool(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s) {
    return pool_take(d, n, p, s);
}

static CUresult drv_free_async(CUdeviceptr p, CUstream s) {
    if (fail_free) return fail_free;
    if (s && s == unit_capturing) return CUDA_SUCCESS;
    if (p && p == linear_ptr) {
        linear_ptr = 0;
        return CUDA_SUCCESS;
    }
    for (int a = 0; a < NALLOCS; a++) {
        if (allocs[a].live && allocs[a].p == p) {
            allocs[a].live = false;
            pools[allocs[a].pool].used -= allocs[a].bytes;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult drv_get_mem_pool(CUmemoryPool *p, CUdevice d) {
    queries++;
    *p = handle(d);
    return d >= 0 && d < UNIT_CARDS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult drv_pool_attr(CUmemoryPool h, CUmemPool_attribute a, void *v) {
    queries++;
    int i = pool_of(h);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    if (a == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) *(cuuint64_t *)v = pools[i].reserved;
    else if (a == CU_MEMPOOL_ATTR_USED_MEM_CURRENT) *(cuuint64_t *)v = pools[i].used;
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult drv_pool_create(CUmemoryPool *h, const CUmemPoolProps *props) {
    for (int i = UNIT_CARDS; i < NPOOLS; i++) {
        if (pools[i].live) continue;
        pools[i] = (__typeof__(pools[0])){true, 0, 0};
        *h = handle(i);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult drv_pool_trim(CUmemoryPool h, size_t keep) {
    int i = pool_of(h);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t floor = round_up(pools[i].used), kept = round_up(keep);
    if (pools[i].reserved > kept) pools[i].reserved = kept > floor ? kept : floor;
    return CUDA_SUCCESS;
}

static CUresult drv_pool_destroy(CUmemoryPool h) {
    destroys++;
    int i = pool_of(h);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    if (fail_destroy) return fail_destroy;
    pools[i].live = false;
    return CUDA_SUCCESS;
}

static void reset(fg_mode mode, uint64_t limit) {
    unit_reset(mode, limit);
    driver_reset();
    fg_real.cuMemAllocAsync = drv_alloc_async;
    fg_real.cuMemAllocAsync_ptsz = drv_alloc_async;
    fg_real.cuMemAllocFromPoolAsync = drv_alloc_from_pool;
    fg_real.cuMemAllocFromPoolAsync_ptsz = drv_alloc_from_pool;
    fg_real.cuMemFreeAsync = drv_free_async;
    fg_real.cuMemFreeAsync_ptsz = drv_free_async;
    fg_real.cuDeviceGetMemPool = drv_get_mem_pool;
    fg_real.cuMemPoolGetAttribute = drv_pool_attr;
    fg_real.cuMemPoolCreate = drv_pool_create;
    fg_real.cuMemPoolTrimTo = drv_pool_trim;
    fg_real.cuMemPoolDestroy = drv_pool_destroy;
}

static CUresult create_pool(int type, int ordinal, CUmemoryPool *p) {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.location.type = type;
    props.location.id = ordinal;
    return cuMemPoolCreate(p, &props);
}
static CUmemoryPool device_pool(int ordinal) {
    CUmemoryPool p = NULL;
    return create_pool(CU_MEM_LOCATION_TYPE_DEVICE, ordinal, &p) == CUDA_SUCCESS ? p : NULL;
}

/* ---- the four allocation entry points, one table ------------------------------------------ */

static const struct {
    const char *name;
    bool from_pool, ptsz;
} entries[] = {
    {"cuMemAllocAsync", false, false},
    {"cuMemAllocAsync_ptsz", false, true},
    {"cuMemAllocFromPoolAsync", true, false},
    {"cuMemAllocFromPoolAsync_ptsz", true, true},
};
#define NENTRIES (sizeof entries / sizeof entries[0])
static const CUstream stream = (CUstream)(uintptr_t)0x51;

/* From pool (NULL: the entry's own; the device's default pool for the plain ones). */
static CUresult alloc_on(size_t e, CUdeviceptr *d, size_t n, CUmemoryPool pool) {
    if (!entries[e].from_pool)
        return entries[e].ptsz ? cuMemAllocAsync_ptsz(d, n, stream) : cuMemAllocAsync(d, n, stream);
    if (!pool) pool = handle(unit_device < 0 ? 0 : unit_device);
    return entries[e].ptsz ? cuMemAllocFromPoolAsync_ptsz(d, n, pool, stream)
                           : cuMemAllocFromPoolAsync(d, n, pool, stream);
}
static CUresult free_on(size_t e, CUdeviceptr d) {
    return entries[e].ptsz ? cuMemFreeAsync_ptsz(d, stream) : cuMemFreeAsync(d, stream);
}

#define FOR_EACH_ENTRY(E, WHERE, ROW) UNIT_FOR_EACH(E, NENTRIES, WHERE, ROW, entries[E].name)

static void test_charged_by_the_reserve(void) {
    const char *name = "charged by the pool's reserve: a free keeps it, a trim returns it";
    char where[160];
    FOR_EACH_ENTRY(e, where, name) {
        reset(FG_MODE_ENFORCE, 256 * MIB);
        CUdeviceptr a = 0, b = 0;
        CHECK(where, alloc_on(e, &a, MIB, NULL) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == 32 * MIB);
        fg_rec rec;
        CHECK(where, fg_rec_get(FG_REC_POOL, a, &rec));
        CHECK(where, rec.bytes == MIB && rec.dev == 0 && rec.aux == (uint64_t)(uintptr_t)handle(0));
        CHECK(where, alloc_on(e, &b, 40 * MIB, NULL) == CUDA_SUCCESS); /* 41 MiB: two chunks */
        CHECK(where, unit_used(0) == 64 * MIB);
        CHECK(where, free_on(e, b) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == 64 * MIB && fg_rec_count() == 1);
        CHECK(where, cuMemPoolTrimTo(handle(0), 0) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == 32 * MIB);
        CHECK(where, free_on(e, a) == CUDA_SUCCESS);
        CHECK(where, cuMemPoolTrimTo(handle(0), 0) == CUDA_SUCCESS);
        CHECK(where, unit_used(0) == 0 && fg_rec_count() == 0 && unit_underflows == 0);
    }
    printf("ok %s\n", name);
}

/* One allocation of bytes (after one of before, when not 0): what it answers and leaves. */
static const struct {
    const char *name;
    fg_mode mode;
    CUdevice device;
    uint64_t limit, before, bytes;
    CUresult driver, expect;
    int calls;     /* driver calls for the allocation */
    uint64_t used; /* the charge after it */
    int live;      /* allocations the driver holds after it, each with its record if charged */
} rows[] = {
    {"the whole share fits", FG_MODE_ENFORCE, 0, 64 * MIB, 0, 64 * MIB, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, 64 * MIB, 1},
    {"growth past the limit never reaches the driver", FG_MODE_ENFORCE, 0, 64 * MIB, 0,
     64 * MIB + 1, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
    /* 20 MiB reserve one 32 MiB chunk; 15 more fit the 40 MiB share, the second chunk not. */
    {"chunk rounding past the limit: freed, trimmed, refused", FG_MODE_ENFORCE, 0, 40 * MIB,
     20 * MIB, 15 * MIB, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 1, 32 * MIB, 1},
    {"the driver's refusal settles back", FG_MODE_ENFORCE, 0, 256 * MIB, 0, 5 * MIB,
     CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE, 1, 0, 0},
    {"inert: passed through uncharged", FG_MODE_INERT, 0, 256 * MIB, 0, MIB, CUDA_SUCCESS,
     CUDA_SUCCESS, 1, 0, 1},
    {"deny: refused before the driver", FG_MODE_DENY, 0, 256 * MIB, 0, MIB, CUDA_SUCCESS,
     CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
    {"an ungranted context: refused before the driver", FG_MODE_ENFORCE, 2, 256 * MIB, 0, MIB,
     CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
    {"no context: the driver answers, uncharged", FG_MODE_ENFORCE, -1, 256 * MIB, 0, MIB,
     CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT, 1, 0, 0},
    {"zero bytes: the driver answers, uncharged", FG_MODE_ENFORCE, 0, 256 * MIB, 0, 0,
     CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, 1, 0, 0},
};

static void row(size_t i) {
    char where[160];
    FOR_EACH_ENTRY(e, where, rows[i].name) {
        reset(rows[i].mode, rows[i].limit);
        unit_device = rows[i].device;
        CUdeviceptr a = 0, b = 0;
        if (rows[i].before) CHECK(where, alloc_on(e, &a, rows[i].before, NULL) == CUDA_SUCCESS);
        int calls = alloc_calls;
        fail_next = rows[i].driver;
        CHECK(where, alloc_on(e, &b, rows[i].bytes, NULL) == rows[i].expect);
        CHECK(where, alloc_calls - calls == rows[i].calls);
        CHECK(where, unit_used(0) + unit_used(1) == rows[i].used && driver_live() == rows[i].live);
        CHECK(where, fg_rec_count() == (rows[i].used ? (size_t)rows[i].live : 0));
        CHECK(where, unit_underflows == 0);
    }
    printf("ok %s\n", rows[i].name);
}

/* ---- pools of their own --------------------------------------------------------------------- */

static const struct {
    const char *name;
    int type, ordinal;
    CUresult expect;
    int calls;
    int charged_idx; /* -1: nothing charged anywhere */
} created[] = {
    {"a pool's memory is charged to the pool's card, not the context's",
     CU_MEM_LOCATION_TYPE_DEVICE, 1, CUDA_SUCCESS, 1, 1},
    {"a pool on an ungranted card gets nothing", CU_MEM_LOCATION_TYPE_DEVICE, 2,
     CUDA_ERROR_OUT_OF_MEMORY, 0, -1},
    {"a pool of host memory is not the card's", 0, 0, CUDA_SUCCESS, 1, -1},
};

static void created_pool(size_t i) {
    const char *name = created[i].name;
    reset(FG_MODE_ENFORCE, 256 * MIB);
    CUmemoryPool p = NULL;
    CHECK(name, create_pool(created[i].type, created[i].ordinal, &p) == CUDA_SUCCESS);
    CUdeviceptr a = 0;
    CHECK(name, cuMemAllocFromPoolAsync(&a, MIB, p, stream) == created[i].expect);
    CHECK(name, alloc_calls == created[i].calls);
    int c = created[i].charged_idx;
    CHECK(name, unit_used(0) + unit_used(1) == (c >= 0 ? 32 * MIB : 0));
    if (c >= 0) CHECK(name, unit_used(c) == 32 * MIB);
    CHECK(name, fg_rec_count() == (c >= 0 ? 1u : 0u));
    printf("ok %s\n", name);
}

static void test_destroy(void) {
    const char *name = "destroy returns the pool's charge, a failed one keeps it";
    reset(FG_MODE_ENFORCE, 256 * MIB);
    CUmemoryPool p = device_pool(0);
    CUdeviceptr a = 0;
    CHECK(name, cuMemAllocFromPoolAsync(&a, 40 * MIB, p, stream) == CUDA_SUCCESS);
    CHECK(name, cuMemFreeAsync(a, stream) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 64 * MIB);
    fail_destroy = CUDA_ERROR_INVALID_VALUE;
    CHECK(name, cuMemPoolDestroy(p) == CUDA_ERROR_INVALID_VALUE);
    CHECK(name, unit_used(0) == 64 * MIB);
    fail_destroy = CUDA_SUCCESS;
    CHECK(name, cuMemPoolDestroy(p) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && unit_underflows == 0);
    /* Its slot in the hook's table is free again: a new pool starts from nothing. */
    CUmemoryPool q = device_pool(1);
    CHECK(name, cuMemAllocFromPoolAsync(&a, MIB, q, stream) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 0 && unit_used(1) == 32 * MIB);
    printf("ok %s\n", name);
}

static void test_a_full_pool_table_refuses_new_pools(void) {
    const char *name = "a pool the hook cannot track is destroyed and refused";
    reset(FG_MODE_ENFORCE, 256 * MIB);
    for (int i = 0; i < 256; i++) CHECK(name, device_pool(0));
    CHECK(name, destroys == 0);
    CUmemoryPool p = NULL;
    CHECK(name, create_pool(CU_MEM_LOCATION_TYPE_DEVICE, 0, &p) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(name, destroys == 1 && pool_of(p) < 0);
    printf("ok %s\n", name);
}

/* ---- frees -------------------------------------------------------------------------------- */

static void test_frees_settle_either_record(void) {
    const char *name = "cuMemFreeAsync settles a linear or a pool record; a refused one keeps it";
    reset(FG_MODE_ENFORCE, 256 * MIB);
    linear_ptr = 0x1234000;
    CHECK(name, fg_charge(1, 3 * MIB));
    CHECK(name, fg_rec_put(&(fg_rec){linear_ptr, 3 * MIB, 0, 1, FG_REC_PTR}));
    CUdeviceptr a = 0;
    CHECK(name, cuMemAllocAsync(&a, MIB, stream) == CUDA_SUCCESS);
    int asked = queries;
    fail_free = CUDA_ERROR_INVALID_VALUE;
    CHECK(name, cuMemFreeAsync(0x1234000, stream) == CUDA_ERROR_INVALID_VALUE);
    CHECK(name, cuMemFreeAsync(a, stream) == CUDA_ERROR_INVALID_VALUE);
    CHECK(name, unit_used(0) == 32 * MIB && unit_used(1) == 3 * MIB && fg_rec_count() == 2);
    fail_free = CUDA_SUCCESS;
    /* A linear record is settled without a pool query. */
    CHECK(name, cuMemFreeAsync_ptsz(0x1234000, stream) == CUDA_SUCCESS);
    CHECK(name, unit_used(1) == 0 && fg_rec_count() == 1 && queries == asked);
    CHECK(name, cuMemFreeAsync(a, stream) == CUDA_SUCCESS);
    CHECK(name, fg_rec_count() == 0 && unit_used(0) == 32 * MIB && unit_underflows == 0);
    printf("ok %s\n", name);
}

static void test_captured_allocations_are_the_graphs(void) {
    const char *name = "captured: the graph's bytes, and no pool query";
    /* A pool query while the stream captures may invalidate the capture (graph.c). */
    reset(FG_MODE_ENFORCE, 256 * MIB);
    unit_capturing = stream;
    CUdeviceptr a = 0;
    CHECK(name, cuMemAllocAsync(&a, 5 * MIB, stream) == CUDA_SUCCESS);
    CHECK(name, cuMemFreeAsync(a, stream) == CUDA_SUCCESS);
    CHECK(name, queries == 0 && unit_captured == 5 * MIB);
    CHECK(name, unit_used(0) == 0 && fg_rec_count() == 0);
    /* The same stream after its capture is the pool's again. */
    unit_capturing = NULL;
    CHECK(name, cuMemAllocAsync(&a, 5 * MIB, stream) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 32 * MIB && unit_captured == 5 * MIB);
    printf("ok %s\n", name);
}

static void test_a_forked_child_forgets_the_pools(void) {
    const char *name = "a forked child forgets the parent's pools";
    reset(FG_MODE_ENFORCE, 256 * MIB);
    CUmemoryPool p = device_pool(0);
    CUdeviceptr a = 0;
    CHECK(name, cuMemAllocFromPoolAsync(&a, MIB, p, stream) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 32 * MIB);
    fg_memory_after_fork();
    /* The parent's pool and record are not the child's: nothing of theirs is settled. */
    CHECK(name, cuMemFreeAsync(a, stream) == CUDA_SUCCESS);
    CHECK(name, cuMemPoolTrimTo(p, 0) == CUDA_SUCCESS);
    CHECK(name, cuMemPoolDestroy(p) == CUDA_SUCCESS);
    CHECK(name, unit_used(0) == 32 * MIB && unit_underflows == 0);
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_charged_by_the_reserve();
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) row(i);
    for (size_t i = 0; i < sizeof created / sizeof created[0]; i++) created_pool(i);
    test_destroy();
    test_a_full_pool_table_refuses_new_pools();
    test_frees_settle_either_record();
    test_captured_allocations_are_the_graphs();
    test_a_forked_child_forgets_the_pools();
    return failures;
}
