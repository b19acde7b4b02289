/* Device memory: every allocation path is charged to the container's share before the driver is
 * asked (so racing processes can never pass the limit), and every free releases exactly what its
 * allocation charged, looked up in a per-process table keyed by pointer or handle.
 *
 * This file is what every path shares: which granted card a call lands on, the charge, and the
 * one shape of every charged allocation. The families are apart, above it: linear allocations
 * (memory_linear.c), stream-ordered pools (memory_pool.c), virtual memory management
 * (memory_vmm.c), arrays (memory_array.c), and what the container is told it has
 * (memory_info.c); the reset after fork of all their tables is above them (memory_fork.c). */
#include <stdio.h>
#include <string.h>

#include "memory_internal.h"
#include "region.h"

/* ---- which granted card ------------------------------------------------------------------- */

#define MAX_ORDINALS 64
static _Atomic int ordinal_index[MAX_ORDINALS]; /* 0 unknown, else index + 1, or -1 not granted */

static int uuid_index(const char *uuid) {
    for (int i = 0; i < fg.limits.ndevices; i++)
        if (strcmp(fg.limits.devices[i], uuid) == 0) return i;
    return -1;
}

int fg_device_index(CUdevice dev) {
    if (dev < 0 || dev >= MAX_ORDINALS || !fg_real.cuDeviceGetUuid) return -1;
    int cached = atomic_load_explicit(&ordinal_index[dev], memory_order_relaxed);
    if (FG_LIKELY(cached != 0)) return cached > 0 ? cached - 1 : -1;
    CUuuid u;
    if (fg_real.cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS) return -1;
    const unsigned char *b = (const unsigned char *)u.bytes;
    char s[64];
    snprintf(s, sizeof s,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
    int idx = uuid_index(s);
    int expected = 0;
    if (atomic_compare_exchange_strong(&ordinal_index[dev], &expected, idx >= 0 ? idx + 1 : -1) &&
        idx < 0 && fg.mode == FG_MODE_ENFORCE)
        fg_log("card %s (device %d) is not in the limits file's devices; its memory is refused",
               s, dev);
    return idx;
}

int fg_nvml_device_index(nvmlDevice_t dev) {
    char uuid[NVML_DEVICE_UUID_BUFFER_SIZE];
    if (!fg_real.nvmlDeviceGetUUID ||
        fg_real.nvmlDeviceGetUUID(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return -1;
    return uuid_index(uuid);
}

int fg_current_index(void) {
    CUdevice d;
    if (!fg_real.cuCtxGetDevice || fg_real.cuCtxGetDevice(&d) != CUDA_SUCCESS)
        return FG_NO_CONTEXT;
    int idx = fg_device_index(d);
    return idx >= 0 ? idx : FG_NOT_GRANTED;
}

bool fg_charge(int idx, uint64_t bytes) {
    if (fg.mode == FG_MODE_DENY || idx < 0) return false;
    return fg_region_charge(idx, bytes, fg.limits.memory_bytes);
}

/* ---- the one shape of every charged allocation -------------------------------------------- */

/* The context a linear allocation belongs to: destroying the context frees it. */
static uint64_t linear_context(fg_rec_kind kind) {
    CUcontext c = NULL;
    if ((kind != FG_REC_PTR && kind != FG_REC_PTR_V1) || !fg_real.cuCtxGetCurrent ||
        fg_real.cuCtxGetCurrent(&c) != CUDA_SUCCESS)
        return 0;
    return (uint64_t)(uintptr_t)c;
}

/* Charge first (so racing processes can never pass the limit together), then ask the driver,
 * settle on what it took, and record the charge for the free. */
CUresult fg_alloc_charged(const fg_alloc_ops *ops, void *args, int idx, uint64_t bytes) {
    if (!fg_charge(idx, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t key = 0;
    CUresult r = ops->call(args, &key);
    if (r != CUDA_SUCCESS) {
        fg_region_release(idx, bytes);
        return r;
    }
    uint64_t actual = ops->actual ? ops->actual(args) : bytes;
    if (actual < bytes) {
        fg_region_release(idx, bytes - actual);
    } else if (actual > bytes && !fg_charge(idx, actual - bytes)) {
        ops->undo(key);
        fg_region_release(idx, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fg_rec rec = {key, actual, linear_context(ops->kind), idx, (int32_t)ops->kind};
    if (!fg_rec_put(&rec)) {
        ops->undo(key);
        fg_region_release(idx, actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

/* Frees: forget the record first (so a racing allocation may reuse the address), then free;
 * if the driver refuses, the record goes back. */
CUresult fg_free_recorded(fg_rec_kind kind, uint64_t key, CUresult (*do_free)(uint64_t)) {
    fg_rec rec;
    bool had = ENFORCED() && fg_rec_take(kind, key, &rec);
    CUresult r = do_free(key);
    if (!had) return r;
    if (r == CUDA_SUCCESS)
        fg_region_release(rec.dev, rec.bytes);
    else
        fg_rec_put(&rec);
    return r;
}
