/* libc's dlsym, dlopen and dlmopen, found past the hook's own (see dl.h). */
#include "dl.h"

#include <stdatomic.h>
#include <stddef.h>

#define FG_LIKELY_DL(x) __builtin_expect(!!(x), 1)

static _Atomic(fg_dlsym_fn) real_dlsym;
static _Atomic(fg_dlopen_fn) real_dlopen;
static _Atomic(fg_dlmopen_fn) real_dlmopen;

FG_NO_SAN fg_dlsym_fn fg_real_dlsym(void) {
    fg_dlsym_fn f = atomic_load_explicit(&real_dlsym, memory_order_acquire);
    if (FG_LIKELY_DL(f)) return f;
    /* glibc 2.34 moved dlsym into libc under a new version; older ones only have 2.2.5. */
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !f; i++)
        f = (fg_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym, f, memory_order_release);
    return f;
}

/* libc's dlopen and dlmopen, found the way dlsym is: versions from glibc 2.34 down. */
FG_NO_SAN static void *libc_fn(const char *name, const char *const *versions, size_t n) {
    fg_dlsym_fn d = fg_real_dlsym();
    void *f = NULL;
    for (size_t i = 0; i < n && !f; i++) f = dlvsym(RTLD_NEXT, name, versions[i]);
    return f ? f : d(RTLD_NEXT, name);
}

FG_NO_SAN fg_dlopen_fn fg_real_dlopen(void) {
    fg_dlopen_fn f = atomic_load_explicit(&real_dlopen, memory_order_acquire);
    if (FG_LIKELY_DL(f)) return f;
    static const char *v[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.1"};
    f = (fg_dlopen_fn)libc_fn("dlopen", v, sizeof v / sizeof v[0]);
    atomic_store_explicit(&real_dlopen, f, memory_order_release);
    return f;
}

FG_NO_SAN fg_dlmopen_fn fg_real_dlmopen(void) {
    fg_dlmopen_fn f = atomic_load_explicit(&real_dlmopen, memory_order_acquire);
    if (FG_LIKELY_DL(f)) return f;
    static const char *v[] = {"GLIBC_2.34", "GLIBC_2.3.4", "GLIBC_2.17"};
    f = (fg_dlmopen_fn)libc_fn("dlmopen", v, sizeof v / sizeof v[0]);
    atomic_store_explicit(&real_dlmopen, f, memory_order_release);
    return f;
}
