/* Unit test of the table of real entry points (src/real.c): every name once, each in its own
 * slot, resolved from the library it belongs to and from no other. Run as
 * real_test FAKE_LIBCUDA FAKE_LIBNVML; each case prints "ok <name>" or "FAIL <name>: <why>" and
 * the exit status counts failures. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "real.h"
#include "check.h"

int failures;


#define NSLOTS (sizeof(fg_real_fns) / sizeof(void *))

/* The index of a slot in fg_real, or -1 when the pointer is not one of its fields. */
static long slot_index(void **slot) {
    char *base = (char *)&fg_real, *p = (char *)slot;
    if (p < base || p >= base + sizeof fg_real || (size_t)(p - base) % sizeof(void *)) return -1;
    return (long)((size_t)(p - base) / sizeof(void *));
}

static void test_every_name_once_in_its_own_slot(void) {
    const char *name = "every name once, in a slot of its own";
    CHECK(name, fg_real_table_len == NSLOTS);
    bool used[NSLOTS] = {false};
    for (size_t i = 0; i < fg_real_table_len; i++) {
        long k = slot_index(fg_real_table[i].slot);
        CHECK(name, k >= 0 && !used[k]);
        used[k] = true;
        for (size_t j = 0; j < i; j++)
            CHECK(name, strcmp(fg_real_table[i].name, fg_real_table[j].name) != 0);
    }
    printf("ok %s\n", name);
}

static void test_the_families_are_named_by_prefix(void) {
    const char *name = "driver names resolve from libcuda, nvml names from NVML";
    for (size_t i = 0; i < fg_real_table_len; i++) {
        bool nvml_name = strncmp(fg_real_table[i].name, "nvml", 4) == 0;
        CHECK(name, fg_real_table[i].nvml == nvml_name);
        CHECK(name, nvml_name || strncmp(fg_real_table[i].name, "cu", 2) == 0);
    }
    printf("ok %s\n", name);
}

/* Each slot of the library at handle holds what dlsym finds there (found counts those that are
 * set); with other_null, every slot of the other library is still empty. */
static void check_slots(const char *name, void *handle, bool nvml, bool other_null, int *found) {
    *found = 0;
    for (size_t i = 0; i < fg_real_table_len; i++) {
        const fg_real_entry *e = &fg_real_table[i];
        if (e->nvml == nvml) {
            CHECK(name, *e->slot == dlsym(handle, e->name));
            if (*e->slot) (*found)++;
        } else if (other_null) {
            CHECK(name, *e->slot == NULL);
        }
    }
}

static void test_resolved_from_the_libraries(void *cuda, void *nvml) {
    const char *name = "each library fills its own slots only";
    memset(&fg_real, 0, sizeof fg_real);
    int found = 0;
    fg_real_resolve(cuda, false);
    check_slots(name, cuda, false, true, &found);
    CHECK(name, found > 0 && fg_real.cuMemAlloc_v2 && fg_real.cuCtxGetDevice);
    void *cu_alloc = (void *)fg_real.cuMemAlloc_v2;
    fg_real_resolve(nvml, true);
    check_slots(name, nvml, true, false, &found);
    CHECK(name, found > 0 && fg_real.nvmlDeviceGetMemoryInfo && fg_real.nvmlInit_v2);
    CHECK(name, (void *)fg_real.cuMemAlloc_v2 == cu_alloc);
    printf("ok %s\n", name);
}

static void test_a_library_without_the_names(void *cuda) {
    const char *name = "a library without the names leaves their slots empty";
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    CHECK(name, libc != NULL);
    fg_real_resolve(cuda, false);
    fg_real_resolve(libc, false);
    for (size_t i = 0; i < fg_real_table_len; i++)
        if (!fg_real_table[i].nvml) CHECK(name, *fg_real_table[i].slot == NULL);
    dlclose(libc);
    printf("ok %s\n", name);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 3) {
        fprintf(stderr, "usage: real_test FAKE_LIBCUDA FAKE_LIBNVML\n");
        return 2;
    }
    void *cuda = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    void *nvml = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!cuda || !nvml) {
        fprintf(stderr, "cannot open the fakes: %s\n", dlerror());
        return 2;
    }
    test_every_name_once_in_its_own_slot();
    test_the_families_are_named_by_prefix();
    test_resolved_from_the_libraries(cuda, nvml);
    test_a_library_without_the_names(cuda);
    return failures;
}
