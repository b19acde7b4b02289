/* The start: the limits file read into fg, the accounting region opened, the real driver loaded
 * and resolved into fg_real, then the layer above (see state.h) rebinds and installs the fork
 * handler. Whichever entry point is called first triggers it (fg_init); the constructor of the
 * top layer (interpose.c) triggers it at load when the driver is already there. */
#include "state.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>

#include "dl.h"
#include "region.h"

/* Where the device plugin mounts the hook in a container (the test build names a directory of
 * its own). */
#ifndef FG_INSTALLED_HOOK
#define FG_INSTALLED_HOOK FRACGPU_HOOK_LIBRARY
#endif

fg_state fg;
_Atomic int fg_ready;

/* ---- the layer above ---------------------------------------------------------------------- */

/* What a program with the state and without the top would get: a start that rebinds nothing and
 * installs no fork handler. The library links the top, whose definition replaces this. */
static void no_start(void *lib) { (void)lib; }
static void no_child(void) {}
__attribute__((weak)) const fg_upper fg_upper_ops = {no_start, no_start, no_child};

/* ---- the limits --------------------------------------------------------------------------- */

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
        if (fg_region_open(shared, fg_upper_ops.child_detected, why, sizeof why) != 0) {
            fg.mode = FG_MODE_DENY;
            fg_log("accounting region unavailable (%s); device memory allocations are refused "
                   "(out of memory) so the limit cannot be exceeded",
                   why);
        }
        break;
    }
}

/* ---- the start ---------------------------------------------------------------------------- */

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool initialising;
static void *cuda_handle;

void fg_state_after_fork(void) {
    /* Only the forking thread survives: locks other threads held must not stay held. */
    pthread_mutex_init(&init_mu, NULL);
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
    load_limits();
    fg_dlopen_fn open_lib = fg_real_dlopen();
    void *cuda = open_lib("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) cuda = open_lib("libcuda.so.1", RTLD_NOW);
    if (cuda) fg_real_resolve(cuda, false);
    cuda_handle = cuda;
    fg_upper_ops.started(cuda);
    initialising = false;
    atomic_store_explicit(&fg_ready, 1, memory_order_release);
    pthread_mutex_unlock(&init_mu);
}

void *fg_driver_handle(void) { return cuda_handle; }

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static void *nvml_handle;
static void nvml_load(void) {
    fg_dlopen_fn open_lib = fg_real_dlopen();
    void *nvml = open_lib("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!nvml) nvml = open_lib("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) return;
    fg_real_resolve(nvml, true);
    nvml_handle = nvml;
    fg_upper_ops.nvml_started(nvml);
}

void fg_init_nvml(void) {
    fg_init();
    pthread_once(&nvml_once, nvml_load);
}

void *fg_nvml_handle(void) { return nvml_handle; }
