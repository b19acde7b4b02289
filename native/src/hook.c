/* Interposition: one table maps every replaced driver/NVML name to our function and to the slot
 * that holds the real one. The same table serves direct calls (our exported symbols win under
 * LD_PRELOAD / ld.so.preload), dlsym lookups, cuGetProcAddress (any version and flag), which
 * is how CUDA >= 11.3 runtimes and PyTorch reach the driver, and the rebinding (rebind.c) that
 * keeps those paths on the hook whatever the library order, RTLD_DEEPBIND or dlmopen.
 *
 * The library is linked with -Bsymbolic: the addresses the table holds are the hook's own
 * functions, never whatever definition of the name comes first in the process. */
#include "hook.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rebind.h"
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

typedef fg_dlsym_fn dlsym_fn;
typedef void *(*dlopen_fn)(const char *, int);
typedef void *(*dlmopen_fn)(Lmid_t, const char *, int);
static _Atomic(dlsym_fn) real_dlsym;
static _Atomic(dlopen_fn) real_dlopen;
static _Atomic(dlmopen_fn) real_dlmopen;

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

fg_dlsym_fn fg_real_dlsym(void) { return get_real_dlsym(); }

/* libc's dlopen and dlmopen, found the way dlsym is: versions from glibc 2.34 down. */
FG_NO_SAN static void *libc_fn(const char *name, const char *const *versions, size_t n) {
    dlsym_fn d = get_real_dlsym();
    void *f = NULL;
    for (size_t i = 0; i < n && !f; i++) f = dlvsym(RTLD_NEXT, name, versions[i]);
    return f ? f : d(RTLD_NEXT, name);
}
FG_NO_SAN static dlopen_fn get_real_dlopen(void) {
    dlopen_fn f = atomic_load_explicit(&real_dlopen, memory_order_acquire);
    if (FG_LIKELY(f)) return f;
    static const char *v[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.1"};
    f = (dlopen_fn)libc_fn("dlopen", v, sizeof v / sizeof v[0]);
    atomic_store_explicit(&real_dlopen, f, memory_order_release);
    return f;
}
FG_NO_SAN static dlmopen_fn get_real_dlmopen(void) {
    dlmopen_fn f = atomic_load_explicit(&real_dlmopen, memory_order_acquire);
    if (FG_LIKELY(f)) return f;
    static const char *v[] = {"GLIBC_2.34", "GLIBC_2.3.4", "GLIBC_2.17"};
    f = (dlmopen_fn)libc_fn("dlmopen", v, sizeof v / sizeof v[0]);
    atomic_store_explicit(&real_dlmopen, f, memory_order_release);
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

/* What rebinding points a name at: the hook's function, for the names it replaces (and the
 * dynamic-loader entry points through which libraries reach the driver). */
FG_NO_SAN static void *hook_of(const char *name) {
    if (name[0] == 'd' && name[1] == 'l') {
        if (strcmp(name, "dlsym") == 0) return (void *)dlsym;
        if (strcmp(name, "dlopen") == 0) return (void *)dlopen;
        if (strcmp(name, "dlmopen") == 0) return (void *)dlmopen;
        return NULL;
    }
    const fg_entry *e = find_name(name);
    return e ? e->hook : NULL;
}

/* ---- initialisation ---------------------------------------------------------------------- */

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool initialising;
/* Set at load when a definition of a replaced name comes before the hook (a library preloaded
 * ahead of it, e.g. LD_PRELOAD=libcuda.so.1 with the hook in /etc/ld.so.preload). */
static bool foreign_first;
static void *foreign_first_fn;

static void after_fork_child(void) {
    /* Only the forking thread survives: locks other threads held must not stay held. */
    pthread_mutex_init(&init_mu, NULL);
    fg_region_after_fork();
    fg_memory_after_fork();
    fg_graph_after_fork();
    fg_throttle_after_fork();
}

void fg_child_detected(void) {
    fg_memory_after_fork();
    fg_graph_after_fork();
    fg_throttle_after_fork();
}

__attribute__((destructor)) static void fg_fini(void) { fg_region_close(); }

/* Whether this process runs in a container fracgpu set up: the device plugin mounts the limits
 * and the accounting directories and the hook itself. An unprivileged process cannot unmount or
 * remove a mount point; overmounting one (possible only in a private mount namespace) or
 * replacing the limits file by a dangling symlink still leaves a path behind, and the hook's own
 * path is the name it was preloaded by. Only a process with none of them (a workstation that
 * preloads a copy of the library by hand) is outside, and there the hook stays inert. */
static bool in_fracgpu_container(void) {
    struct stat st;
    if (lstat(FRACGPU_LIMITS_DIR, &st) == 0 || lstat(FRACGPU_SHARED_DIR, &st) == 0) return true;
    Dl_info info;
    return dladdr((void *)fg_init_slow, &info) && info.dli_fname &&
           strcmp(info.dli_fname, FG_INSTALLED_HOOK) == 0;
}

static void load_limits(void) {
    char why[256] = "";
    const char *path = FRACGPU_LIMITS_DIR "/" FRACGPU_LIMITS_FILE;
    switch (fg_limits_load(path, &fg.limits, why, sizeof why)) {
    case FG_LIMITS_ABSENT:
        if (!in_fracgpu_container()) {
            fg.mode = FG_MODE_INERT;
            break;
        }
        fg.mode = FG_MODE_DENY;
        fg_log("limits file %s is missing in a fracgpu container; device memory allocations are "
               "refused (out of memory) and compute is not throttled until the device plugin "
               "rewrites it",
               path);
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
}

static const struct link_map *own_map(void) {
    Dl_info info;
    struct link_map *lm = NULL;
    if (!dladdr1((void *)fg_init_slow, &info, (void **)&lm, RTLD_DL_LINKMAP)) return NULL;
    return lm;
}

/* After the real entry points are known: every later lookup in the driver finds the hook, and
 * bindings made to a copy that came first are moved to the hook. */
static void rebind(void *driver) {
    if (fg.mode == FG_MODE_INERT) return;
    if (driver) fg_rebind_driver(driver, hook_of);
    if (!foreign_first) return;
    Dl_info info;
    if (foreign_first_fn && dladdr(foreign_first_fn, &info) && info.dli_fname) {
        void *h = get_real_dlopen()(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) fg_rebind_driver(h, hook_of);
    }
    fg_rebind_bound(hook_of, own_map());
}

static void *cuda_handle;

void fg_init_slow(void) {
    if (initialising) return; /* re-entered from the driver's own start-up: real fns stay NULL */
    pthread_mutex_lock(&init_mu);
    if (atomic_load(&fg_ready)) {
        pthread_mutex_unlock(&init_mu);
        return;
    }
    initialising = true;
    load_limits();
    dlopen_fn open_lib = get_real_dlopen();
    void *cuda = open_lib("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) cuda = open_lib("libcuda.so.1", RTLD_NOW);
    if (cuda) resolve(cuda, false);
    cuda_handle = cuda;
    rebind(cuda);
    pthread_atfork(NULL, NULL, after_fork_child);
    initialising = false;
    atomic_store_explicit(&fg_ready, 1, memory_order_release);
    pthread_mutex_unlock(&init_mu);
}

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static void *nvml_handle;
static void nvml_load(void) {
    dlopen_fn open_lib = get_real_dlopen();
    void *nvml = open_lib("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!nvml) nvml = open_lib("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) return;
    resolve(nvml, true);
    nvml_handle = nvml;
    if (fg.mode != FG_MODE_INERT) fg_rebind_driver(nvml, hook_of);
}
void fg_init_nvml(void) {
    fg_init();
    pthread_once(&nvml_once, nvml_load);
}

/* At load: nothing for the many programs that never touch a GPU. When the driver is already
 * loaded (linked in, or preloaded), or a definition of its names comes before the hook, start
 * now: the program may call the driver directly before any call reaches the hook. */
__attribute__((constructor)) static void fg_load(void) {
    dlsym_fn d = get_real_dlsym();
    if (!d) return;
    /* The program's handle searches in the process's lookup order (RTLD_DEFAULT from here
     * would start with the hook itself, which is linked -Bsymbolic). */
    void *program = get_real_dlopen()(NULL, RTLD_LAZY);
    void *first = program ? d(program, "cuMemAlloc_v2") : NULL;
    if (first && first != (void *)cuMemAlloc_v2) {
        foreign_first = true;
        foreign_first_fn = first;
    }
    void *loaded = get_real_dlopen()("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (foreign_first || loaded) fg_init();
    if (loaded) dlclose(loaded);
}

/* ---- the dynamic loader ------------------------------------------------------------------- */

/* The caller gets our function for a replaced name whenever the object it asked holds that name.
 * Other lookups are forwarded as tail calls so that glibc still sees the caller's return address
 * (RTLD_NEXT searches after the caller, not after us: tests/test_native_interpose.py checks
 * this). RTLD_NEXT for a replaced name is answered with the hook too: after the hook in the
 * lookup order there is only the driver. */
FG_NO_SAN FG_EXPORT void *dlsym(void *restrict handle, const char *restrict name) {
    dlsym_fn real = get_real_dlsym();
    if (handle == RTLD_NEXT) {
        const fg_entry *e = find_name(name);
        if (FG_LIKELY(!e)) return real(handle, name);
        fg_init();
        if (fg.mode != FG_MODE_INERT && *e->real) return e->hook;
        return real(handle, name);
    }
    void *p = real(handle, name);
    if (!p) return NULL;
    const fg_entry *e = find_name(name);
    if (!e) return p;
    fg_init();
    return fg.mode == FG_MODE_INERT ? p : e->hook;
}

static bool names_driver(const char *file) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    return strncmp(base, "libcuda.so", 10) == 0 || strncmp(base, "libnvidia-ml.so", 15) == 0;
}

/* A library opened with RTLD_DEEPBIND binds to its own dependencies first, so the driver it
 * depends on must already lead to the hook when it is loaded; the same for a program that opens
 * the driver by name (dlvsym on it must not find the real entry points either). The call is
 * forwarded as a tail call: glibc finds the caller's RUNPATH and namespace by return address. */
FG_NO_SAN FG_EXPORT void *dlopen(const char *file, int flags) {
    dlopen_fn real = get_real_dlopen();
    if (FG_UNLIKELY(file && ((flags & RTLD_DEEPBIND) || names_driver(file)))) fg_init_nvml();
    return real(file, flags);
}

/* A new namespace gets the driver before anything else, and that copy's entry points all lead
 * to the main namespace's driver, through the hook: one driver, one account, whatever the
 * namespace. The namespace's own dlmopen leads here too, so namespaces made from it are set up
 * the same way. */
static Lmid_t prepare_namespace(void) {
    fg_init_nvml();
    if (fg.mode == FG_MODE_INERT || !cuda_handle) return LM_ID_NEWLM;
    struct link_map *lm = NULL;
    if (dlinfo(cuda_handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return LM_ID_NEWLM;
    dlmopen_fn real = get_real_dlmopen();
    void *copy = real(LM_ID_NEWLM, lm->l_name, RTLD_NOW | RTLD_LOCAL);
    Lmid_t ns = LM_ID_NEWLM;
    if (!copy || dlinfo(copy, RTLD_DI_LMID, &ns) != 0) return -1;
    if (fg_rebind_namespace(copy, cuda_handle, "cuInit", (void *)dlmopen) < 0) return -1;
    struct link_map *nl = NULL;
    if (nvml_handle && dlinfo(nvml_handle, RTLD_DI_LINKMAP, &nl) == 0 && nl) {
        void *ncopy = real(ns, nl->l_name, RTLD_NOW | RTLD_LOCAL);
        if (!ncopy || fg_rebind_namespace(ncopy, nvml_handle, "nvmlInit_v2", (void *)dlmopen) < 0)
            return -1;
    }
    return ns;
}

FG_NO_SAN FG_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags) {
    dlmopen_fn real = get_real_dlmopen();
    if (FG_UNLIKELY(lmid == LM_ID_NEWLM)) {
        lmid = prepare_namespace();
        if (lmid == -1) {
            fg_log("dlmopen of %s in a new namespace refused: the driver could not be set up "
                   "there, and without it the namespace would reach the card around the limit",
                   file ? file : "(null)");
            return NULL;
        }
    }
    return real(lmid, file, flags);
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
    /* From CUDA 12.0 this name means the three-argument form, not the _v2 one. */
    if (strcmp(symbol, "cuGraphInstantiate") == 0 && version >= 12000)
        symbol = "cuGraphInstantiateWithFlags";
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
