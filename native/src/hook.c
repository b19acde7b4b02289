/* Interposition: one table maps every replaced driver/NVML name to our function and to the slot
 * that holds the real one. The same table serves direct calls (our exported symbols win under
 * LD_PRELOAD / ld.so.preload), dlsym lookups, and cuGetProcAddress (any version and flag), which
 * is how CUDA >= 11.3 runtimes and PyTorch reach the driver. */
#include "hook.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "region.h"

fg_state fg;
fg_real_fns fg_real;
_Atomic int fg_ready;

typedef struct {
    const char *name;
    void *hook; /* NULL: resolved for our own use, never handed out */
    void **real;
    bool nvml;
} fg_entry;

#define FG_HOOK_ENTRY(n) {#n, (void *)n, (void **)&fg_real.n, false},
#define FG_USED_ENTRY(n) {#n, NULL, (void **)&fg_real.n, false},
#define FG_NVML_HOOK_ENTRY(n) {#n, (void *)n, (void **)&fg_real.n, true},
#define FG_NVML_USED_ENTRY(n) {#n, NULL, (void **)&fg_real.n, true},
static const fg_entry table[] = {
    FG_CUDA_HOOKS(FG_HOOK_ENTRY) FG_CUDA_USED(FG_USED_ENTRY) FG_NVML_HOOKS(FG_NVML_HOOK_ENTRY)
        FG_NVML_USED(FG_NVML_USED_ENTRY)};
#define TABLE_LEN (sizeof table / sizeof table[0])

void fg_log(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "fracgpu: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf);
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}

/* ---- the real dlsym ---------------------------------------------------------------------- */

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) real_dlsym;

/* The sanitizer runtime resolves its own interceptors through dlsym before its shadow memory
 * exists, so the code on that path must not be instrumented. */
#define FG_NO_SAN __attribute__((no_sanitize("address", "undefined")))

FG_NO_SAN static dlsym_fn get_real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym, memory_order_acquire);
    if (FG_LIKELY(f)) return f;
    /* glibc 2.34 moved dlsym into libc under a new version; older ones only have 2.2.5. */
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !f; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym, f, memory_order_release);
    return f;
}

FG_NO_SAN static const fg_entry *find_name(const char *name) {
    if (!name || name[0] != 'c' || name[1] != 'u') {
        if (!name || strncmp(name, "nvml", 4) != 0) return NULL;
    }
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (table[i].hook && strcmp(table[i].name, name) == 0) return &table[i];
    return NULL;
}

static void resolve(void *handle, bool nvml) {
    dlsym_fn d = get_real_dlsym();
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (table[i].nvml == nvml) *table[i].real = d(handle, table[i].name);
}

/* ---- initialisation ---------------------------------------------------------------------- */

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool initialising;

static void after_fork_child(void) {
    /* Only the forking thread survives: locks other threads held must not stay held. */
    pthread_mutex_init(&init_mu, NULL);
    fg_region_after_fork();
    fg_memory_after_fork();
    fg_throttle_after_fork();
}

__attribute__((destructor)) static void fg_fini(void) { fg_region_close(); }

void fg_init_slow(void) {
    if (initialising) return; /* re-entered from the driver's own start-up: real fns stay NULL */
    pthread_mutex_lock(&init_mu);
    if (atomic_load(&fg_ready)) {
        pthread_mutex_unlock(&init_mu);
        return;
    }
    initialising = true;
    char why[256] = "";
    const char *path = FRACGPU_LIMITS_DIR "/" FRACGPU_LIMITS_FILE;
    switch (fg_limits_load(path, &fg.limits, why, sizeof why)) {
    case FG_LIMITS_ABSENT:
        fg.mode = FG_MODE_INERT;
        break;
    case FG_LIMITS_INVALID:
        fg.mode = FG_MODE_DENY;
        fg_log("limits file %s %s; device memory allocations are refused (out of memory) and "
               "compute is not throttled until the device plugin rewrites it",
               path, why);
        break;
    case FG_LIMITS_OK:
        fg.mode = FG_MODE_ENFORCE;
        fg.throttle = fg.limits.compute_percent < 100;
        const char *shared = FRACGPU_SHARED_DIR "/" FRACGPU_SHARED_REGION_FILE;
        if (fg_region_open(shared, why, sizeof why) != 0) {
            fg.mode = FG_MODE_DENY;
            fg_log("accounting region unavailable (%s); device memory allocations are refused "
                   "(out of memory) so the limit cannot be exceeded",
                   why);
        }
        break;
    }
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda) resolve(cuda, false);
    pthread_atfork(NULL, NULL, after_fork_child);
    initialising = false;
    atomic_store_explicit(&fg_ready, 1, memory_order_release);
    pthread_mutex_unlock(&init_mu);
}

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static void nvml_load(void) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!nvml) nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (nvml) resolve(nvml, true);
}
void fg_init_nvml(void) {
    fg_init();
    pthread_once(&nvml_once, nvml_load);
}

/* ---- dlsym and dlvsym ---------------------------------------------------------------------- */

/* The caller gets our function for a replaced name whenever the object it asked holds that name.
 * RTLD_NEXT is forwarded as a tail call so that glibc still sees the caller's return address
 * and searches after the caller, not after us (tests/test_native_interpose.py checks this). */
FG_NO_SAN FG_EXPORT void *dlsym(void *restrict handle, const char *restrict name) {
    dlsym_fn real = get_real_dlsym();
    if (handle == RTLD_NEXT) return real(handle, name);
    void *p = real(handle, name);
    if (!p) return NULL;
    const fg_entry *e = find_name(name);
    if (!e) return p;
    fg_init();
    return fg.mode == FG_MODE_INERT ? p : e->hook;
}

/* ---- cuGetProcAddress ---------------------------------------------------------------------- */

/* The driver picks the variant (cuMemAlloc -> cuMemAlloc_v2, _ptsz for per-thread streams) from
 * version and flags; we let it choose and then swap the pointer it chose for ours, by identity
 * with the real pointers the table resolved. So every version and flag is covered, with no
 * version arithmetic of our own to get wrong.
 *
 * Should a driver hand out entry points other than its exported symbols, identity finds
 * nothing; then the variant is named the way the driver names its exports (_v2 from CUDA 3.2 on,
 * or 12.0 for cuGetProcAddress itself; _ptsz for per-thread default streams) and looked up in
 * the table, most specific first. */
static void *hook_by_name(const char *symbol, int version, cuuint64_t flags) {
    if (!symbol || strlen(symbol) > 64) return NULL;
    bool v2 = version >= (strcmp(symbol, "cuGetProcAddress") == 0 ? 12000 : 3020);
    bool ptds = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    const char *suffixes[3] = {v2 ? (ptds ? "_v2_ptsz" : "_v2") : (ptds ? "_ptsz" : ""),
                               v2 ? "_v2" : "", ""};
    if (v2 && ptds) suffixes[1] = "_ptsz";
    for (int i = 0; i < 3; i++) {
        char name[80];
        snprintf(name, sizeof name, "%s%s", symbol, suffixes[i]);
        const fg_entry *e = find_name(name);
        if (e && !e->nvml && *e->real) return e->hook;
    }
    return NULL;
}

static void *swap_for_hook(void *p, const char *symbol, int version, cuuint64_t flags) {
    if (!p || fg.mode == FG_MODE_INERT) return p;
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (table[i].hook && !table[i].nvml && *table[i].real == p) return table[i].hook;
    void *by_name = hook_by_name(symbol, version, flags);
    return by_name ? by_name : p;
}

FG_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
                                    cuuint64_t flags) {
    fg_init();
    if (!fg_real.cuGetProcAddress) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuGetProcAddress(symbol, pfn, cuda_version, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = swap_for_hook(*pfn, symbol, cuda_version, flags);
    return r;
}

FG_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    fg_init();
    if (!fg_real.cuGetProcAddress_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, status);
    if (r == CUDA_SUCCESS && pfn) *pfn = swap_for_hook(*pfn, symbol, cuda_version, flags);
    return r;
}
