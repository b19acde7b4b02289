/* Unit test of what the container is told it has (src/memory_info.c): cuMemGetInfo (v1 and v2),
 * cuDeviceTotalMem (v1 and v2) and nvmlDeviceGetMemoryInfo (v1 and v2) report the share and the
 * container's use of it, against a scripted card. Linked with the core and tests/memory_unit.c. */
#include <string.h>

#include "memory_unit.h"

void fg_pools_after_fork(void) {}
void fg_vmm_after_fork(void) {}

/* ---- the card ------------------------------------------------------------------------------ */

static uint64_t card_free, card_total;

static CUresult drv_info_v2(size_t *f, size_t *t) {
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *f = card_free;
    *t = card_total;
    return CUDA_SUCCESS;
}
static CUresult drv_info_v1(unsigned *f, unsigned *t) {
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *f = (unsigned)card_free;
    *t = (unsigned)card_total;
    return CUDA_SUCCESS;
}
static CUresult drv_total_v2(size_t *b, CUdevice d) {
    *b = card_total;
    return CUDA_SUCCESS;
}
static CUresult drv_total_v1(unsigned *b, CUdevice d) {
    *b = (unsigned)card_total;
    return CUDA_SUCCESS;
}

/* NVML handles 1, 2, 3 are ordinals 0, 1, 2. */
static nvmlDevice_t nvml_handle(int ordinal) { return (nvmlDevice_t)(uintptr_t)(ordinal + 1); }
static nvmlReturn_t nvml_uuid(nvmlDevice_t d, char *uuid, unsigned len) {
    static const char *const uuids[] = {UNIT_UUID0, UNIT_UUID1, UNIT_UUID2};
    uintptr_t i = (uintptr_t)d - 1;
    if (i >= UNIT_CARDS) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, len, "%s", uuids[i]);
    return NVML_SUCCESS;
}
static nvmlReturn_t nvml_info(nvmlDevice_t d, nvmlMemory_t *m) {
    m->total = card_total;
    m->free = card_free;
    m->used = card_total - card_free;
    return NVML_SUCCESS;
}
static nvmlReturn_t nvml_info_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    m->total = card_total;
    m->reserved = 5;
    m->free = card_free;
    m->used = card_total - card_free - 5;
    return NVML_SUCCESS;
}

static void reset(fg_mode mode, uint64_t limit) {
    unit_reset(mode, limit);
    fg_real.cuMemGetInfo_v2 = drv_info_v2;
    fg_real.cuMemGetInfo = drv_info_v1;
    fg_real.cuDeviceTotalMem_v2 = drv_total_v2;
    fg_real.cuDeviceTotalMem = drv_total_v1;
    fg_real.nvmlDeviceGetUUID = nvml_uuid;
    fg_real.nvmlDeviceGetMemoryInfo = nvml_info;
    fg_real.nvmlDeviceGetMemoryInfo_v2 = nvml_info_v2;
}

/* ---- every report, one table ------------------------------------------------------------- */

#define U MIB /* small enough that the 32-bit calls hold every value */
static const struct {
    const char *name;
    fg_mode mode;
    int card;             /* the context's ordinal, also asked of NVML and cuDeviceTotalMem */
    uint64_t share;       /* the limit */
    uint64_t used0, used1; /* the container's use of cards 0 and 1 */
    uint64_t card_free, card_total;
    uint64_t free, total; /* what the container is told */
} reports[] = {
    {"a share below the card: the share, less the container's use", FG_MODE_ENFORCE, 0, 40 * U,
     10 * U, 0, 700 * U, 800 * U, 30 * U, 40 * U},
    {"the card's free memory bounds what is left of the share", FG_MODE_ENFORCE, 0, 40 * U,
     10 * U, 0, 20 * U, 800 * U, 20 * U, 40 * U},
    {"a share larger than the card: the card", FG_MODE_ENFORCE, 0, 1000 * U, 100 * U, 0,
     750 * U, 800 * U, 700 * U, 800 * U},
    {"use beyond the share leaves nothing free", FG_MODE_ENFORCE, 0, 40 * U, 50 * U, 0, 700 * U,
     800 * U, 0, 40 * U},
    {"each card's use is its own", FG_MODE_ENFORCE, 1, 40 * U, 30 * U, 5 * U, 700 * U, 800 * U,
     35 * U, 40 * U},
    {"deny: nothing", FG_MODE_DENY, 0, 40 * U, 0, 0, 700 * U, 800 * U, 0, 0},
    {"an ungranted card: nothing", FG_MODE_ENFORCE, 2, 40 * U, 10 * U, 0, 700 * U, 800 * U, 0,
     0},
    {"inert: the card as it is", FG_MODE_INERT, 0, 40 * U, 10 * U, 0, 700 * U, 800 * U, 700 * U,
     800 * U},
};

static void report(size_t i) {
    const char *name = reports[i].name;
    reset(reports[i].mode, reports[i].share);
    fg_region_force(0, reports[i].used0);
    fg_region_force(1, reports[i].used1);
    unit_device = reports[i].card;
    card_free = reports[i].card_free;
    card_total = reports[i].card_total;
    uint64_t f = reports[i].free, t = reports[i].total;

    size_t f2 = 0, t2 = 0;
    CHECK(name, cuMemGetInfo_v2(&f2, &t2) == CUDA_SUCCESS);
    CHECK(name, f2 == f && t2 == t);
    unsigned f1 = 0, t1 = 0;
    CHECK(name, cuMemGetInfo(&f1, &t1) == CUDA_SUCCESS);
    CHECK(name, f1 == f && t1 == t);

    CHECK(name, cuDeviceTotalMem_v2(&t2, reports[i].card) == CUDA_SUCCESS && t2 == t);
    CHECK(name, cuDeviceTotalMem(&t1, reports[i].card) == CUDA_SUCCESS && t1 == t);

    nvmlMemory_t m;
    CHECK(name, nvmlDeviceGetMemoryInfo(nvml_handle(reports[i].card), &m) == NVML_SUCCESS);
    CHECK(name, m.free == f && m.total == t);
    bool inert = reports[i].mode == FG_MODE_INERT;
    CHECK(name, m.used == t - f);
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    CHECK(name, nvmlDeviceGetMemoryInfo_v2(nvml_handle(reports[i].card), &m2) == NVML_SUCCESS);
    CHECK(name, m2.free == f && m2.total == t);
    /* The share has nothing reserved by the driver: used is the rest. */
    CHECK(name, m2.reserved == (inert ? 5u : 0u) && m2.used == t - f - m2.reserved);
    printf("ok %s\n", name);
}

static void test_without_a_context(void) {
    const char *name = "no context: the driver's answer, untouched";
    reset(FG_MODE_ENFORCE, 40 * U);
    unit_device = -1;
    size_t f2 = 7, t2 = 7;
    CHECK(name, cuMemGetInfo_v2(&f2, &t2) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(name, f2 == 7 && t2 == 7);
    /* A driver that answers without a context (the hook cannot tell whose card it is). */
    fg_real.cuCtxGetDevice = NULL;
    card_free = 700 * U;
    card_total = 800 * U;
    unit_device = 0;
    CHECK(name, cuMemGetInfo_v2(&f2, &t2) == CUDA_SUCCESS);
    CHECK(name, f2 == 700 * U && t2 == 800 * U);
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof reports / sizeof reports[0]; i++) report(i);
    test_without_a_context();
    return failures;
}
