/* Interposition, the top of the hook: one table maps every replaced driver/NVML name to our
 * function and to the slot that holds the real one. The same table serves direct calls (our
 * exported symbols win under LD_PRELOAD / ld.so.preload), dlsym lookups, cuGetProcAddress (any
 * version and flag), which is how CUDA >= 11.3 runtimes and PyTorch reach the driver, and the
 * rebinding (rebind.c) that keeps those paths on the hook whatever the library order,
 * RTLD_DEEPBIND or dlmopen.
 *
 * The table names every family's entry points, so nothing else in the hook names this file:
 * what the start (state.c) needs from here it gets through fg_upper_ops (see state.h).
 *
 * The library is linked with -Bsymbolic: the addresses the table holds are the hook's own
 * functions, never whatever definition of the name comes first in the process. */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "dl.h"
#include "fork.h"
#include "rebind.h"
#include "state.h"

typedef struct {
    const char *name;
    void *hook;
    void **real;
    bool nvml;
} fg_entry;

#define FG_HOOK_ENTRY(n) {#n, (void *)n, (void **)&fg_real.n, false},
#define FG_NVML_HOOK_ENTRY(n) {#n, (void *)n, (void **)&fg_real.n, true},
static const fg_entry table[] = {FG_CUDA_HOOKS(FG_HOOK_ENTRY) FG_NVML_HOOKS(FG_NVML_HOOK_ENTRY)};
#define TABLE_LEN (sizeof table / sizeof table[0])

FG_NO_SAN static const fg_entry *find_name(const char *name) {
    if (!name || name[0] != 'c' || name[1] != 'u') {
        if (!name || strncmp(name, "nvml", 4) != 0) return NULL;
    }
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (strcmp(table[i].name, name) == 0) return &table[i];
    return NULL;
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

/* ---- the start: what only this layer knows ----------------------------------------------- */

/* Set at load when a definition of a replaced name comes before the hook (a library preloaded
 * ahead of it, e.g. LD_PRELOAD=libcuda.so.1 with the hook in /etc/ld.so.preload). */
static bool foreign_first;
static void *foreign_first_fn;

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
        void *h = fg_real_dlopen()(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) fg_rebind_driver(h, hook_of);
    }
    fg_rebind_bound(hook_of, own_map());
}

static void started(void *cuda) {
    rebind(cuda);
    pthread_atfork(NULL, NULL, fg_after_fork_child);
}

static void nvml_started(void *nvml) {
    if (fg.mode != FG_MODE_INERT) fg_rebind_driver(nvml, hook_of);
}

/* Replaces the state's weak do-nothing definition (state.h). */
const fg_upper fg_upper_ops = {started, nvml_started, fg_child_detected};

/* At load: nothing for the many programs that never touch a GPU. When the driver is already
 * loaded (linked in, or preloaded), or a definition of its names comes before the hook, start
 * now: the program may call the driver directly before any call reaches the hook. */
__attribute__((constructor)) static void fg_load(void) {
    fg_dlsym_fn d = fg_real_dlsym();
    if (!d) return;
    /* The program's handle searches in the process's lookup order (RTLD_DEFAULT from here
     * would start with the hook itself, which is linked -Bsymbolic). */
    void *program = fg_real_dlopen()(NULL, RTLD_LAZY);
    void *first = program ? d(program, "cuMemAlloc_v2") : NULL;
    if (first && first != (void *)cuMemAlloc_v2) {
        foreign_first = true;
        foreign_first_fn = first;
    }
    void *loaded = fg_real_dlopen()("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
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
    fg_dlsym_fn real = fg_real_dlsym();
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
    fg_dlopen_fn real = fg_real_dlopen();
    if (FG_UNLIKELY(file && ((flags & RTLD_DEEPBIND) || names_driver(file)))) fg_init_nvml();
    return real(file, flags);
}

/* A new namespace gets the driver before anything else, and that copy's entry points all lead
 * to the main namespace's driver, through the hook: one driver, one account, whatever the
 * namespace. The namespace's own dlmopen leads here too, so namespaces made from it are set up
 * the same way. */
static Lmid_t prepare_namespace(void) {
    fg_init_nvml();
    void *cuda_handle = fg_driver_handle();
    if (fg.mode == FG_MODE_INERT || !cuda_handle) return LM_ID_NEWLM;
    struct link_map *lm = NULL;
    if (dlinfo(cuda_handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return LM_ID_NEWLM;
    fg_dlmopen_fn real = fg_real_dlmopen();
    void *copy = real(LM_ID_NEWLM, lm->l_name, RTLD_NOW | RTLD_LOCAL);
    Lmid_t ns = LM_ID_NEWLM;
    if (!copy || dlinfo(copy, RTLD_DI_LMID, &ns) != 0) return -1;
    if (fg_rebind_namespace(copy, cuda_handle, "cuInit", (void *)dlmopen) < 0) return -1;
    void *nvml_handle = fg_nvml_handle();
    struct link_map *nl = NULL;
    if (nvml_handle && dlinfo(nvml_handle, RTLD_DI_LINKMAP, &nl) == 0 && nl) {
        void *ncopy = real(ns, nl->l_name, RTLD_NOW | RTLD_LOCAL);
        if (!ncopy || fg_rebind_namespace(ncopy, nvml_handle, "nvmlInit_v2", (void *)dlmopen) < 0)
            return -1;
    }
    return ns;
}

FG_NO_SAN FG_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags) {
    fg_dlmopen_fn real = fg_real_dlmopen();
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
        if (!table[i].nvml && *table[i].real == p) return table[i].hook;
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
