/* Memory the driver takes later than the call that asks for it, or without saying how much.
 *
 * Graph memory nodes (added with cuGraphAddMemAllocNode, or recorded when cuMemAllocAsync runs
 * on a capturing stream) take nothing when added: the driver allocates them when the graph is
 * launched (or uploaded), from a per-card graph pool that grows and keeps what it reserved until
 * cuDeviceGraphMemTrim. So the hook reads each instantiated graph's memory-node bytes and
 * charges the growth the pool may need for them at instantiation and again before each launch,
 * as it does for stream-ordered pools; trims and later launches settle the charge on what the
 * pool reports it reserves.
 *
 * Module globals: the driver loads a module's __device__ variables onto the card at
 * cuModuleLoadData and offers no call that says how many bytes that took. The hook measures it:
 * the card's free memory before and after the load, with loads serialised in the process. */
#include "graph.h"

#include <pthread.h>
#include <stdlib.h>

#include "memory.h"
#include "rectable.h"
#include "region.h"
#include "state.h"
#include "throttle.h"

#define ENFORCED() (fg.mode != FG_MODE_INERT)

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* ---- graph memory nodes ------------------------------------------------------------------ */

/* Set once any instantiated graph has memory nodes: until then a launch looks nothing up. */
static _Atomic bool graph_memory_seen;
static pthread_mutex_t graph_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t graph_charged[FRACGPU_MAX_DEVICES]; /* what each card's graph pool is charged */

static uint64_t graph_attr(CUdevice d, CUgraphMem_attribute a) {
    cuuint64_t v = 0;
    if (!fg_real.cuDeviceGetGraphMemAttribute ||
        fg_real.cuDeviceGetGraphMemAttribute(d, a, &v) != CUDA_SUCCESS)
        return 0;
    return v;
}

/* Bring card idx's charge to what its graph pool reserves; up only, or both ways. */
static void graph_settle_locked(int idx, CUdevice d, bool down) {
    uint64_t reserved = graph_attr(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
    if (reserved > graph_charged[idx]) {
        fg_region_force(idx, reserved - graph_charged[idx]);
        graph_charged[idx] = reserved;
    } else if (down && reserved < graph_charged[idx]) {
        fg_region_release(idx, graph_charged[idx] - reserved);
        graph_charged[idx] = reserved;
    }
}

/* The bytes of a graph's memory nodes; UINT64_MAX when they cannot be read (refused later). */
static uint64_t graph_node_bytes(CUgraph g) {
    size_t n = 0;
    if (!fg_real.cuGraphGetNodes || !fg_real.cuGraphNodeGetType ||
        !fg_real.cuGraphMemAllocNodeGetParams || fg_real.cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS)
        return UINT64_MAX;
    if (n == 0) return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes || fg_real.cuGraphGetNodes(g, nodes, &n) != CUDA_SUCCESS) {
        free(nodes);
        return UINT64_MAX;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType t;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        if (fg_real.cuGraphNodeGetType(nodes[i], &t) != CUDA_SUCCESS) {
            total = UINT64_MAX;
            break;
        }
        if (t != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
        if (fg_real.cuGraphMemAllocNodeGetParams(nodes[i], &p) != CUDA_SUCCESS) {
            total = UINT64_MAX;
            break;
        }
        total = add_sat(total, p.bytesize);
    }
    free(nodes);
    return total;
}

/* ---- memory nodes as they are added: for a driver that cannot list a graph's nodes -------- */

static _Atomic int capturing_streams;

/* Add bytes to the record (kind, key), creating it. */
static void add_bytes(fg_rec_kind kind, uint64_t key, uint64_t bytes) {
    fg_rec rec;
    if (!fg_rec_get(kind, key, &rec)) rec = (fg_rec){key, 0, 0, 0, (int32_t)kind};
    rec.bytes = add_sat(rec.bytes, bytes);
    fg_rec_put(&rec);
}

FG_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    fg_init();
    if (!fg_real.cuGraphAddMemAllocNode) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuGraphAddMemAllocNode(node, g, deps, ndeps, params);
    if (r == CUDA_SUCCESS && ENFORCED() && params)
        add_bytes(FG_REC_GRAPH, (uint64_t)(uintptr_t)g, params->bytesize);
    return r;
}

FG_EXPORT CUresult cuGraphDestroy(CUgraph g) {
    fg_init();
    if (!fg_real.cuGraphDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuGraphDestroy(g);
    fg_rec rec;
    if (r == CUDA_SUCCESS && ENFORCED()) fg_rec_take(FG_REC_GRAPH, (uint64_t)(uintptr_t)g, &rec);
    return r;
}

typedef CUresult (*begin_fn)(CUstream, CUstreamCaptureMode);
typedef CUresult (*end_fn)(CUstream, CUgraph *);

static CUresult begin_capture(CUstream s, CUstreamCaptureMode mode, begin_fn real) {
    fg_init();
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(s, mode);
    if (r == CUDA_SUCCESS && ENFORCED()) {
        fg_rec rec = {(uint64_t)(uintptr_t)s, 0, 0, 0, FG_REC_CAPTURE};
        if (fg_rec_put(&rec)) atomic_fetch_add(&capturing_streams, 1);
    }
    return r;
}

FG_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
    return begin_capture(s, mode, fg_real.cuStreamBeginCapture_v2);
}
FG_EXPORT CUresult cuStreamBeginCapture(CUstream s, CUstreamCaptureMode mode) {
    return begin_capture(s, mode, fg_real.cuStreamBeginCapture);
}
FG_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s, CUstreamCaptureMode mode) {
    return begin_capture(s, mode, fg_real.cuStreamBeginCapture_ptsz);
}
FG_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
    return begin_capture(s, mode, fg_real.cuStreamBeginCapture_v2_ptsz);
}

static CUresult end_capture(CUstream s, CUgraph *g, end_fn real) {
    fg_init();
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(s, g);
    fg_rec rec;
    if (ENFORCED() && fg_rec_take(FG_REC_CAPTURE, (uint64_t)(uintptr_t)s, &rec)) {
        atomic_fetch_sub(&capturing_streams, 1);
        if (r == CUDA_SUCCESS && g && *g && rec.bytes)
            add_bytes(FG_REC_GRAPH, (uint64_t)(uintptr_t)*g, rec.bytes);
    }
    return r;
}

FG_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g) {
    return end_capture(s, g, fg_real.cuStreamEndCapture);
}
FG_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) {
    return end_capture(s, g, fg_real.cuStreamEndCapture_ptsz);
}

bool fg_graph_capturing(CUstream s) {
    fg_rec rec;
    return atomic_load_explicit(&capturing_streams, memory_order_relaxed) != 0 &&
           fg_rec_get(FG_REC_CAPTURE, (uint64_t)(uintptr_t)s, &rec);
}

void fg_graph_captured(CUstream s, uint64_t bytes) {
    fg_rec rec;
    if (FG_LIKELY(atomic_load_explicit(&capturing_streams, memory_order_relaxed) == 0) ||
        !fg_rec_get(FG_REC_CAPTURE, (uint64_t)(uintptr_t)s, &rec))
        return;
    add_bytes(FG_REC_CAPTURE, rec.key, bytes);
}

/* After an instantiation: remember what the executable graph's launches will allocate, and
 * charge the growth the graph pool may need already (an instantiation that cannot fit is
 * refused: it could never launch). The graph's nodes are listed when the driver can; else the
 * bytes added or captured into it, as they went by, are used. */
static CUresult instantiated(CUresult r, CUgraphExec *exec, CUgraph g) {
    if (r != CUDA_SUCCESS || !ENFORCED() || !exec || !*exec) return r;
    uint64_t bytes = graph_node_bytes(g);
    fg_rec seen;
    if (bytes == UINT64_MAX) bytes = fg_rec_get(FG_REC_GRAPH, (uint64_t)(uintptr_t)g, &seen) ? seen.bytes : 0;
    if (bytes == 0) return r;
    CUdevice d = 0;
    int idx = fg_current_index();
    if (!fg_real.cuCtxGetDevice || fg_real.cuCtxGetDevice(&d) != CUDA_SUCCESS) idx = FG_NOT_GRANTED;
    fg_rec rec = {(uint64_t)(uintptr_t)*exec, bytes, (uint64_t)d, idx, FG_REC_GRAPH_EXEC};
    bool fits = idx >= 0 && fg.mode == FG_MODE_ENFORCE;
    if (fits) {
        pthread_mutex_lock(&graph_mu);
        graph_settle_locked(idx, d, true);
        uint64_t need = add_sat(graph_attr(d, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), bytes);
        uint64_t growth = need > graph_charged[idx] ? need - graph_charged[idx] : 0;
        fits = !growth || fg_charge(idx, growth);
        if (fits) graph_charged[idx] += growth;
        pthread_mutex_unlock(&graph_mu);
    }
    if (!fits || !fg_rec_put(&rec)) {
        /* Unrecorded, its launches would go uncounted. */
        if (fg_real.cuGraphExecDestroy) fg_real.cuGraphExecDestroy(*exec);
        *exec = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    atomic_store(&graph_memory_seen, true);
    return r;
}

FG_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph g,
                                               unsigned long long flags) {
    fg_init();
    if (!fg_real.cuGraphInstantiateWithFlags) return CUDA_ERROR_NOT_INITIALIZED;
    return instantiated(fg_real.cuGraphInstantiateWithFlags(exec, g, flags), exec, g);
}

FG_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph g, void *params) {
    fg_init();
    if (!fg_real.cuGraphInstantiateWithParams) return CUDA_ERROR_NOT_INITIALIZED;
    return instantiated(fg_real.cuGraphInstantiateWithParams(exec, g, params), exec, g);
}

FG_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph g, void *params) {
    fg_init();
    if (!fg_real.cuGraphInstantiateWithParams_ptsz) return CUDA_ERROR_NOT_INITIALIZED;
    return instantiated(fg_real.cuGraphInstantiateWithParams_ptsz(exec, g, params), exec, g);
}

FG_EXPORT CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph g, CUgraphNode *error_node,
                                      char *log, size_t log_size) {
    fg_init();
    if (!fg_real.cuGraphInstantiate) return CUDA_ERROR_NOT_INITIALIZED;
    return instantiated(fg_real.cuGraphInstantiate(exec, g, error_node, log, log_size), exec, g);
}

FG_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph g, CUgraphNode *error_node,
                                         char *log, size_t log_size) {
    fg_init();
    if (!fg_real.cuGraphInstantiate_v2) return CUDA_ERROR_NOT_INITIALIZED;
    return instantiated(fg_real.cuGraphInstantiate_v2(exec, g, error_node, log, log_size), exec,
                        g);
}

FG_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) {
    fg_init();
    if (!fg_real.cuGraphExecDestroy) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuGraphExecDestroy(exec);
    fg_rec rec;
    if (r == CUDA_SUCCESS && ENFORCED()) fg_rec_take(FG_REC_GRAPH_EXEC, (uint64_t)(uintptr_t)exec, &rec);
    return r;
}

typedef CUresult (*graph_run_fn)(CUgraphExec, CUstream);

/* A launch or an upload: charge the growth the graph pool may need first (the whole launch is
 * refused, out of memory, when it does not fit), settle on the pool afterwards. */
static CUresult graph_run(CUgraphExec g, CUstream s, graph_run_fn real, bool launch) {
    fg_init();
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    if (launch && FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    fg_rec rec;
    if (FG_LIKELY(!atomic_load_explicit(&graph_memory_seen, memory_order_relaxed)) ||
        !fg_rec_get(FG_REC_GRAPH_EXEC, (uint64_t)(uintptr_t)g, &rec))
        return real(g, s);
    int idx = rec.dev;
    CUdevice d = (CUdevice)rec.aux;
    if (idx < 0 || fg.mode == FG_MODE_DENY) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&graph_mu);
    graph_settle_locked(idx, d, true);
    uint64_t need = add_sat(graph_attr(d, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), rec.bytes);
    uint64_t growth = need > graph_charged[idx] ? need - graph_charged[idx] : 0;
    if (growth && !fg_charge(idx, growth)) {
        pthread_mutex_unlock(&graph_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    graph_charged[idx] += growth;
    CUresult r = real(g, s);
    /* Only upward now: the driver may reserve for the launch after returning. */
    graph_settle_locked(idx, d, false);
    pthread_mutex_unlock(&graph_mu);
    return r;
}

FG_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) {
    return graph_run(g, s, fg_real.cuGraphLaunch, true);
}
FG_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
    return graph_run(g, s, fg_real.cuGraphLaunch_ptsz, true);
}
FG_EXPORT CUresult cuGraphUpload(CUgraphExec g, CUstream s) {
    return graph_run(g, s, fg_real.cuGraphUpload, false);
}
FG_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec g, CUstream s) {
    return graph_run(g, s, fg_real.cuGraphUpload_ptsz, false);
}

FG_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    fg_init();
    if (!fg_real.cuDeviceGraphMemTrim) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuDeviceGraphMemTrim(dev);
    int idx = ENFORCED() ? fg_device_index(dev) : -1;
    if (r == CUDA_SUCCESS && idx >= 0) {
        pthread_mutex_lock(&graph_mu);
        graph_settle_locked(idx, dev, true);
        pthread_mutex_unlock(&graph_mu);
    }
    return r;
}

void fg_graph_after_fork(void) {
    pthread_mutex_init(&graph_mu, NULL);
    atomic_store(&capturing_streams, 0);
    for (int i = 0; i < FRACGPU_MAX_DEVICES; i++) graph_charged[i] = 0;
}

/* ---- module globals ---------------------------------------------------------------------- */

static pthread_mutex_t module_mu = PTHREAD_MUTEX_INITIALIZER;

typedef CUresult (*load_fn)(void **handle, const void *image, void *extra);
typedef CUresult (*unload_fn)(void *handle);

static CUresult unload_module(void *h) { return fg_real.cuModuleUnload((CUmodule)h); }
static CUresult unload_library(void *h) { return fg_real.cuLibraryUnload((CUlibrary)h); }

/* Load, measure what the card lost, charge it; a load whose globals do not fit is undone. */
static CUresult measured_load(fg_rec_kind kind, void **handle, const void *image, void *extra,
                              load_fn load, unload_fn unload) {
    int idx = fg_current_index();
    if (!ENFORCED() || idx == FG_NO_CONTEXT || !handle || !fg_real.cuMemGetInfo_v2)
        return load(handle, image, extra);
    pthread_mutex_lock(&module_mu);
    size_t free0 = 0, free1 = 0, total = 0;
    CUresult r = fg_real.cuMemGetInfo_v2(&free0, &total);
    if (r == CUDA_SUCCESS) r = load(handle, image, extra);
    if (r == CUDA_SUCCESS && fg_real.cuMemGetInfo_v2(&free1, &total) != CUDA_SUCCESS) free1 = 0;
    pthread_mutex_unlock(&module_mu);
    if (r != CUDA_SUCCESS) return r;
    uint64_t taken = free0 > free1 ? free0 - free1 : 0;
    if (taken == 0) return r;
    if (!fg_charge(idx, taken)) {
        unload(*handle);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fg_rec rec = {(uint64_t)(uintptr_t)*handle, taken, 0, idx, (int32_t)kind};
    if (!fg_rec_put(&rec)) {
        fg_region_release(idx, taken);
        unload(*handle);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return r;
}

static CUresult measured_unload(fg_rec_kind kind, void *handle, unload_fn unload) {
    fg_rec rec;
    bool had = ENFORCED() && fg_rec_take(kind, (uint64_t)(uintptr_t)handle, &rec);
    CUresult r = unload(handle);
    if (had && r == CUDA_SUCCESS)
        fg_region_release(rec.dev, rec.bytes);
    else if (had)
        fg_rec_put(&rec);
    return r;
}

typedef struct {
    unsigned n;
    int *options;
    void **values;
    unsigned nlib;
    int *lib_options;
    void **lib_values;
} load_args;

static CUresult load_data(void **h, const void *image, void *extra) {
    (void)extra;
    return fg_real.cuModuleLoadData((CUmodule *)h, image);
}
static CUresult load_data_ex(void **h, const void *image, void *extra) {
    load_args *a = extra;
    return fg_real.cuModuleLoadDataEx((CUmodule *)h, image, a->n, a->options, a->values);
}
static CUresult load_file(void **h, const void *path, void *extra) {
    (void)extra;
    return fg_real.cuModuleLoad((CUmodule *)h, path);
}
static CUresult load_fatbin(void **h, const void *image, void *extra) {
    (void)extra;
    return fg_real.cuModuleLoadFatBinary((CUmodule *)h, image);
}
static CUresult load_library(void **h, const void *code, void *extra) {
    load_args *a = extra;
    return fg_real.cuLibraryLoadData((CUlibrary *)h, code, a->options, a->values, a->n,
                                     a->lib_options, a->lib_values, a->nlib);
}
static CUresult load_library_file(void **h, const void *path, void *extra) {
    load_args *a = extra;
    return fg_real.cuLibraryLoadFromFile((CUlibrary *)h, path, a->options, a->values, a->n,
                                         a->lib_options, a->lib_values, a->nlib);
}

#define NEED_MODULES(fn)                                                                       \
    do {                                                                                       \
        fg_init();                                                                             \
        if (!fg_real.fn || !fg_real.cuModuleUnload) return CUDA_ERROR_NOT_INITIALIZED;         \
    } while (0)

FG_EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    NEED_MODULES(cuModuleLoadData);
    return measured_load(FG_REC_MODULE, (void **)m, image, NULL, load_data, unload_module);
}

FG_EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, int *options,
                                      void **values) {
    NEED_MODULES(cuModuleLoadDataEx);
    load_args a = {n, options, values, 0, NULL, NULL};
    return measured_load(FG_REC_MODULE, (void **)m, image, &a, load_data_ex, unload_module);
}

FG_EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path) {
    NEED_MODULES(cuModuleLoad);
    return measured_load(FG_REC_MODULE, (void **)m, path, NULL, load_file, unload_module);
}

FG_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
    NEED_MODULES(cuModuleLoadFatBinary);
    return measured_load(FG_REC_MODULE, (void **)m, fatbin, NULL, load_fatbin, unload_module);
}

FG_EXPORT CUresult cuModuleUnload(CUmodule m) {
    fg_init();
    if (!fg_real.cuModuleUnload) return CUDA_ERROR_NOT_INITIALIZED;
    return measured_unload(FG_REC_MODULE, m, unload_module);
}

/* Libraries (CUDA 12) load into the current context at once and into others as they use them;
 * what the current context's load took is measured like a module's. */
FG_EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, int *jit_options,
                                     void **jit_values, unsigned int njit, int *lib_options,
                                     void **lib_values, unsigned int nlib) {
    fg_init();
    if (!fg_real.cuLibraryLoadData || !fg_real.cuLibraryUnload) return CUDA_ERROR_NOT_INITIALIZED;
    load_args a = {njit, jit_options, jit_values, nlib, lib_options, lib_values};
    return measured_load(FG_REC_LIBRARY, (void **)lib, code, &a, load_library, unload_library);
}

FG_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *path, int *jit_options,
                                         void **jit_values, unsigned int njit, int *lib_options,
                                         void **lib_values, unsigned int nlib) {
    fg_init();
    if (!fg_real.cuLibraryLoadFromFile || !fg_real.cuLibraryUnload)
        return CUDA_ERROR_NOT_INITIALIZED;
    load_args a = {njit, jit_options, jit_values, nlib, lib_options, lib_values};
    return measured_load(FG_REC_LIBRARY, (void **)lib, path, &a, load_library_file,
                         unload_library);
}

FG_EXPORT CUresult cuLibraryUnload(CUlibrary lib) {
    fg_init();
    if (!fg_real.cuLibraryUnload) return CUDA_ERROR_NOT_INITIALIZED;
    return measured_unload(FG_REC_LIBRARY, lib, unload_library);
}
