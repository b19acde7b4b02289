/* Unit test of what every memory path shares (src/memory.c): which granted card a call lands
 * on, the charge, the one shape of a charged allocation (fg_alloc_charged), fg_free_recorded; and
 * the reset after fork (src/memory_fork.c). Linked with tests/memory_unit.c; the families' tables
 * are stubs here. */
#include <string.h>

#include "memory_unit.h"

static int pools_resets, vmm_resets;
void fg_pools_after_fork(void) { pools_resets++; }
void fg_vmm_after_fork(void) { vmm_resets++; }

static void test_an_ungranted_card_is_named_once(void) {
    const char *name = "an ungranted card is named once";
    /* Runs first: a card's index is looked up once per process and then remembered. */
    unit_reset(FG_MODE_ENFORCE, 8 * MIB);
    CHECK(name, fg_device_index(2) == -1);
    CHECK(name, fg_device_index(2) == -1);
    CHECK(name, unit_logs == 1);
    CHECK(name, strstr(unit_last_log, UNIT_UUID2) != NULL);
    CHECK(name, fg_device_index(0) == 0);
    CHECK(name, unit_logs == 1);
    printf("ok %s\n", name);
}

static void test_card_index_by_uuid(void) {
    const char *name = "card index by uuid";
    static const struct {
        CUdevice ordinal;
        int index;
    } cases[] = {{0, 0}, {1, 1}, {2, -1}, {3, -1}, {-1, -1}, {64, -1}, {0, 0}, {1, 1}};
    unit_reset(FG_MODE_ENFORCE, 8 * MIB);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK(name, fg_device_index(cases[i].ordinal) == cases[i].index);
    printf("ok %s\n", name);
}

static void test_the_current_context_card(void) {
    const char *name = "the current context's card";
    static const struct {
        CUdevice device;
        int index;
    } cases[] = {{0, 0}, {1, 1}, {2, FG_NOT_GRANTED}, {-1, FG_NO_CONTEXT}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unit_reset(FG_MODE_ENFORCE, 8 * MIB);
        unit_device = cases[i].device;
        CHECK(name, fg_current_index() == cases[i].index);
    }
    printf("ok %s\n", name);
}

static void test_the_charge(void) {
    const char *name = "charge up to the limit, never past it";
    static const struct {
        fg_mode mode;
        int idx;
        uint64_t before, bytes;
        bool fits;
    } cases[] = {
        {FG_MODE_ENFORCE, 0, 0, 8 * MIB, true},      /* the whole share */
        {FG_MODE_ENFORCE, 0, 8 * MIB - 1, 1, true},  /* the last byte */
        {FG_MODE_ENFORCE, 0, 8 * MIB, 1, false},     /* one past */
        {FG_MODE_ENFORCE, 1, 0, 8 * MIB + 1, false}, /* more than the share at once */
        {FG_MODE_ENFORCE, FG_NOT_GRANTED, 0, 1, false},
        {FG_MODE_ENFORCE, FG_NO_CONTEXT, 0, 1, false},
        {FG_MODE_DENY, 0, 0, 1, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unit_reset(cases[i].mode, 8 * MIB);
        if (cases[i].before) CHECK(name, fg_region_charge(cases[i].idx, cases[i].before, 8 * MIB));
        CHECK(name, fg_charge(cases[i].idx, cases[i].bytes) == cases[i].fits);
        uint64_t after = cases[i].before + (cases[i].fits ? cases[i].bytes : 0);
        CHECK(name, unit_used(cases[i].idx) == (cases[i].idx >= 0 ? after : 0));
    }
    printf("ok %s\n", name);
}

/* ---- fg_alloc_charged with a scripted driver ------------------------------------------------ */

static struct {
    CUresult result; /* what the call answers */
    uint64_t actual; /* what it took; 0: exactly the charge */
    int calls, undos;
    uint64_t undone;
    uint64_t used_at_call; /* the charge the driver was asked under */
} drv;

static CUresult scripted_call(void *args, uint64_t *key) {
    (void)args;
    drv.calls++;
    drv.used_at_call = unit_used(0) + unit_used(1);
    *key = drv.result == CUDA_SUCCESS ? 0xabc000 : 0;
    return drv.result;
}
static CUresult scripted_undo(uint64_t key) {
    drv.undos++;
    drv.undone = key;
    return CUDA_SUCCESS;
}
static uint64_t scripted_actual(const void *args) {
    (void)args;
    return drv.actual;
}

static void test_alloc_charged(void) {
    static const struct {
        const char *name;
        fg_mode mode;
        fg_rec_kind kind;
        int idx;
        uint64_t bytes, actual;
        CUresult driver, expect;
        uint64_t used; /* after; also the record's bytes on success */
        int calls, undos;
    } cases[] = {
        {"alloc charged: exact", FG_MODE_ENFORCE, FG_REC_PTR, 0, 3 * MIB, 0, CUDA_SUCCESS,
         CUDA_SUCCESS, 3 * MIB, 1, 0},
        {"alloc charged: settles down on what the driver took", FG_MODE_ENFORCE, FG_REC_PTR, 0,
         4 * MIB, 3 * MIB, CUDA_SUCCESS, CUDA_SUCCESS, 3 * MIB, 1, 0},
        {"alloc charged: settles up while it fits", FG_MODE_ENFORCE, FG_REC_PTR_V1, 1, 2 * MIB,
         8 * MIB, CUDA_SUCCESS, CUDA_SUCCESS, 8 * MIB, 1, 0},
        {"alloc charged: settling past the limit is undone", FG_MODE_ENFORCE, FG_REC_PTR, 0,
         2 * MIB, 8 * MIB + 1, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, 1, 1},
        {"alloc charged: refused before the driver", FG_MODE_ENFORCE, FG_REC_ARRAY, 0,
         8 * MIB + 1, 0, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
        {"alloc charged: the driver's refusal releases", FG_MODE_ENFORCE, FG_REC_VMM, 1, 5 * MIB,
         0, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE, 0, 1, 0},
        {"alloc charged: an ungranted card is refused", FG_MODE_ENFORCE, FG_REC_PTR,
         FG_NOT_GRANTED, 1, 0, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
        {"alloc charged: deny mode refuses", FG_MODE_DENY, FG_REC_PTR, 0, 1, 0, CUDA_SUCCESS,
         CUDA_ERROR_OUT_OF_MEMORY, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *name = cases[i].name;
        unit_reset(cases[i].mode, 8 * MIB);
        memset(&drv, 0, sizeof drv);
        drv.result = cases[i].driver;
        drv.actual = cases[i].actual;
        fg_alloc_ops ops = {cases[i].kind, scripted_call, scripted_undo,
                            cases[i].actual ? scripted_actual : NULL};
        CHECK(name, fg_alloc_charged(&ops, NULL, cases[i].idx, cases[i].bytes) == cases[i].expect);
        CHECK(name, drv.calls == cases[i].calls);
        CHECK(name, drv.undos == cases[i].undos);
        if (drv.undos) CHECK(name, drv.undone == 0xabc000);
        /* The driver is only ever asked with the charge already taken. */
        if (drv.calls) CHECK(name, drv.used_at_call == cases[i].bytes);
        int idx = cases[i].idx;
        CHECK(name, unit_used(idx) == cases[i].used);
        fg_rec rec;
        bool recorded = fg_rec_get(cases[i].kind, 0xabc000, &rec);
        CHECK(name, recorded == (cases[i].expect == CUDA_SUCCESS));
        CHECK(name, fg_rec_count() == (recorded ? 1u : 0u));
        if (recorded) {
            CHECK(name, rec.bytes == cases[i].used && rec.dev == idx);
            /* Linear kinds keep their context (cuCtxDestroy frees them); the others none. */
            bool linear = cases[i].kind == FG_REC_PTR || cases[i].kind == FG_REC_PTR_V1;
            CHECK(name, rec.aux == (linear ? (uint64_t)(uintptr_t)unit_context : 0));
        }
        CHECK(name, unit_underflows == 0);
        printf("ok %s\n", name);
    }
}

/* ---- fg_free_recorded ------------------------------------------------------------------------ */

static CUresult free_result;
static int frees;
static CUresult scripted_free(uint64_t key) {
    (void)key;
    frees++;
    return free_result;
}

static void test_free_recorded(void) {
    static const struct {
        const char *name;
        fg_mode mode;
        uint64_t key;
        CUresult driver;
        uint64_t used; /* after */
        bool kept;     /* the record is still there */
    } cases[] = {
        {"free recorded: releases the record's charge", FG_MODE_ENFORCE, 0x5000, CUDA_SUCCESS, 0,
         false},
        {"free recorded: a refused free keeps the charge", FG_MODE_ENFORCE, 0x5000,
         CUDA_ERROR_INVALID_VALUE, 2 * MIB, true},
        {"free recorded: an unknown key releases nothing", FG_MODE_ENFORCE, 0x6000, CUDA_SUCCESS,
         2 * MIB, true},
        {"free recorded: inert takes no record", FG_MODE_INERT, 0x5000, CUDA_SUCCESS, 2 * MIB,
         true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *name = cases[i].name;
        unit_reset(FG_MODE_ENFORCE, 8 * MIB);
        CHECK(name, fg_charge(1, 2 * MIB));
        CHECK(name, fg_rec_put(&(fg_rec){0x5000, 2 * MIB, 0, 1, FG_REC_ARRAY}));
        fg.mode = cases[i].mode;
        free_result = cases[i].driver;
        frees = 0;
        CHECK(name, fg_free_recorded(FG_REC_ARRAY, cases[i].key, scripted_free) == cases[i].driver);
        CHECK(name, frees == 1);
        CHECK(name, unit_used(1) == cases[i].used);
        fg_rec rec;
        CHECK(name, fg_rec_get(FG_REC_ARRAY, 0x5000, &rec) == cases[i].kept);
        /* The kind is part of the key: a record of another kind is not this one's. */
        CHECK(name, fg_free_recorded(FG_REC_MIPMAP, 0x5000, scripted_free) == cases[i].driver);
        CHECK(name, unit_used(1) == cases[i].used);
        printf("ok %s\n", name);
    }
}

static void test_fork_empties_every_table(void) {
    const char *name = "a forked child starts from empty tables";
    unit_reset(FG_MODE_ENFORCE, 8 * MIB);
    CHECK(name, fg_rec_put(&(fg_rec){0x7000, 1, 0, 0, FG_REC_PTR}));
    int pools_before = pools_resets, vmm_before = vmm_resets;
    fg_memory_after_fork();
    CHECK(name, fg_rec_count() == 0);
    CHECK(name, pools_resets == pools_before + 1 && vmm_resets == vmm_before + 1);
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_an_ungranted_card_is_named_once();
    test_card_index_by_uuid();
    test_the_current_context_card();
    test_the_charge();
    test_alloc_charged();
    test_free_recorded();
    test_fork_empties_every_table();
    return failures;
}
