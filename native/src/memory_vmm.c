/* Virtual memory management: cuMemCreate handles, their release, export and mappings. */
#include <pthread.h>
#include <stdlib.h>

#include "memory_internal.h"
#include "region.h"

static CUresult undo_release(uint64_t h) { return fg_real.cuMemRelease(h); }

typedef struct {
    CUmemGenericAllocationHandle *h;
    size_t bytes;
    const CUmemAllocationProp *prop;
    unsigned long long flags;
} vmm_args;

static CUresult call_mem_create(void *a, uint64_t *key) {
    vmm_args *v = a;
    CUresult r = fg_real.cuMemCreate(v->h, v->bytes, v->prop, v->flags);
    *key = r == CUDA_SUCCESS ? *v->h : 0;
    return r;
}
static const fg_alloc_ops vmm_ops = {FG_REC_VMM, call_mem_create, undo_release, NULL};

FG_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                               const CUmemAllocationProp *prop, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemCreate) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED() || !h || !prop || bytes == 0 ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return fg_real.cuMemCreate(h, bytes, prop, flags);
    int idx = fg_device_index(prop->location.id);
    vmm_args args = {h, bytes, prop, flags};
    return fg_alloc_charged(&vmm_ops, &args, idx < 0 ? FG_NOT_GRANTED : idx, bytes);
}

/* Physical memory stays on the card while its handle is unreleased or any mapping of it is
 * alive: cuMemRelease of a mapped handle frees nothing until the last cuMemUnmap. So a handle's
 * record counts its live mappings (aux, with VMM_RELEASED once released) and its charge goes
 * when both are gone. The mappings themselves are kept in a list: one cuMemUnmap may cover
 * several of them. */
#define VMM_RELEASED (1ull << 63)
/* Exported (cuMemExportToShareableHandle): another process may hold it on; the charge stays
 * while this process lives. */
#define VMM_EXPORTED (1ull << 62)
#define VMM_FLAGS (VMM_RELEASED | VMM_EXPORTED)

/* A mapping of a handle this process created (charged through the handle's record), or of one
 * it imported from another process, charged by the mapping itself: the importer cannot know
 * how long the exporter keeps its own charge. */
typedef struct {
    CUdeviceptr va;
    uint64_t size;
    CUmemGenericAllocationHandle handle;
    int dev; /* >= 0: this mapping charged size to card dev itself */
} fg_mapping;

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static fg_mapping *mappings;
static size_t nmappings, capmappings;

void fg_vmm_after_fork(void) {
    pthread_mutex_init(&vmm_mu, NULL);
    free(mappings);
    mappings = NULL;
    nmappings = capmappings = 0;
}

/* With vmm_mu held: one reference fewer on handle h (a mapping or the handle itself). */
static void vmm_drop_locked(CUmemGenericAllocationHandle h, bool release) {
    fg_rec rec;
    if (!fg_rec_take(FG_REC_VMM, h, &rec)) return;
    uint64_t maps = rec.aux & ~VMM_FLAGS;
    bool released = (rec.aux & VMM_RELEASED) || release;
    if (!release && maps > 0) maps--;
    if (released && maps == 0 && !(rec.aux & VMM_EXPORTED)) {
        fg_region_release(rec.dev, rec.bytes);
        return;
    }
    rec.aux = maps | (released ? VMM_RELEASED : 0) | (rec.aux & VMM_EXPORTED);
    fg_rec_put(&rec);
}

FG_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    fg_init();
    if (!fg_real.cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemRelease(h);
    if (r != CUDA_SUCCESS || !ENFORCED()) return r;
    pthread_mutex_lock(&vmm_mu);
    vmm_drop_locked(h, true);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

FG_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h,
                                                int type, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemExportToShareableHandle) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemExportToShareableHandle(out, h, type, flags);
    fg_rec rec;
    if (r != CUDA_SUCCESS || !ENFORCED()) return r;
    pthread_mutex_lock(&vmm_mu);
    if (fg_rec_get(FG_REC_VMM, h, &rec)) {
        rec.aux |= VMM_EXPORTED;
        fg_rec_put(&rec);
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

/* The card a handle's memory lives on, for a handle this process did not create. */
static int handle_index(CUmemGenericAllocationHandle h) {
    CUmemAllocationProp prop;
    if (!fg_real.cuMemGetAllocationPropertiesFromHandle ||
        fg_real.cuMemGetAllocationPropertiesFromHandle(&prop, h) != CUDA_SUCCESS ||
        prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return FG_NOT_GRANTED;
    int idx = fg_device_index(prop.location.id);
    return idx >= 0 ? idx : FG_NOT_GRANTED;
}

FG_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset,
                            CUmemGenericAllocationHandle h, unsigned long long flags) {
    fg_init();
    if (!fg_real.cuMemMap) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemMap(va, size, offset, h, flags);
    pthread_mutex_lock(&vmm_mu);
    fg_rec rec;
    bool own = fg_rec_get(FG_REC_VMM, h, &rec);
    int dev = -1;
    if (!own) {
        dev = handle_index(h);
        if (!fg_charge(dev, size)) {
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    CUresult r = fg_real.cuMemMap(va, size, offset, h, flags);
    if (r != CUDA_SUCCESS && !own) fg_region_release(dev, size);
    if (r == CUDA_SUCCESS) {
        if (nmappings == capmappings) {
            size_t ncap = capmappings ? capmappings * 2 : 64;
            fg_mapping *n = realloc(mappings, ncap * sizeof *n);
            if (!n) {
                /* Without room to remember the mapping its memory could outlive the charge. */
                fg_real.cuMemUnmap(va, size);
                if (!own) fg_region_release(dev, size);
                pthread_mutex_unlock(&vmm_mu);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            mappings = n;
            capmappings = ncap;
        }
        mappings[nmappings++] = (fg_mapping){va, size, h, dev};
        if (own) {
            rec.aux++;
            fg_rec_put(&rec);
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

FG_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    fg_init();
    if (!fg_real.cuMemUnmap) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ENFORCED()) return fg_real.cuMemUnmap(va, size);
    pthread_mutex_lock(&vmm_mu);
    CUresult r = fg_real.cuMemUnmap(va, size);
    for (size_t i = 0; r == CUDA_SUCCESS && i < nmappings;) {
        if (mappings[i].va >= va && mappings[i].va - va < size) {
            fg_mapping m = mappings[i];
            mappings[i] = mappings[--nmappings];
            if (m.dev >= 0)
                fg_region_release(m.dev, m.size);
            else
                vmm_drop_locked(m.handle, false);
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}
