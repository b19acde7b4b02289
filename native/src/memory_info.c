/* What the container is told it has: cuMemGetInfo, cuDeviceTotalMem and NVML's memory info
 * report the share, not the card. */
#include "memory_internal.h"
#include "region.h"

static uint64_t share_total(uint64_t card_total) {
    if (fg.mode == FG_MODE_DENY) return 0;
    return card_total < fg.limits.memory_bytes ? card_total : fg.limits.memory_bytes;
}

static void share_info(int idx, uint64_t card_free, uint64_t card_total, uint64_t *free_out,
                       uint64_t *total_out) {
    uint64_t total = share_total(card_total);
    uint64_t used = fg.mode == FG_MODE_DENY ? 0 : fg_region_used(idx);
    uint64_t left = used < total ? total - used : 0;
    *total_out = total;
    *free_out = left < card_free ? left : card_free;
}

FG_EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    fg_init();
    if (!fg_real.cuMemGetInfo_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemGetInfo_v2(free_b, total_b);
    if (r != CUDA_SUCCESS || !ENFORCED() || !free_b || !total_b) return r;
    int idx = fg_current_index();
    if (idx == -1) return r;
    uint64_t f, t;
    share_info(idx, *free_b, idx < 0 ? 0 : *total_b, &f, &t);
    *free_b = (size_t)f;
    *total_b = (size_t)t;
    return r;
}

FG_EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    fg_init();
    if (!fg_real.cuMemGetInfo) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuMemGetInfo(free_b, total_b);
    if (r != CUDA_SUCCESS || !ENFORCED() || !free_b || !total_b) return r;
    int idx = fg_current_index();
    if (idx == -1) return r;
    uint64_t f, t;
    share_info(idx, *free_b, idx < 0 ? 0 : *total_b, &f, &t);
    *free_b = (unsigned int)f;
    *total_b = (unsigned int)t;
    return r;
}

FG_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    fg_init();
    if (!fg_real.cuDeviceTotalMem_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuDeviceTotalMem_v2(bytes, dev);
    if (r == CUDA_SUCCESS && ENFORCED() && bytes)
        *bytes = fg_device_index(dev) < 0 ? 0 : (size_t)share_total(*bytes);
    return r;
}

FG_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    fg_init();
    if (!fg_real.cuDeviceTotalMem) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = fg_real.cuDeviceTotalMem(bytes, dev);
    if (r == CUDA_SUCCESS && ENFORCED() && bytes)
        *bytes = fg_device_index(dev) < 0 ? 0 : (unsigned int)share_total(*bytes);
    return r;
}

FG_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    fg_init_nvml();
    if (!fg_real.nvmlDeviceGetMemoryInfo) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = fg_real.nvmlDeviceGetMemoryInfo(dev, m);
    if (r != NVML_SUCCESS || !ENFORCED() || !m) return r;
    int idx = fg_nvml_device_index(dev);
    uint64_t f, t;
    share_info(idx, m->free, idx < 0 ? 0 : m->total, &f, &t);
    m->total = t;
    m->free = f;
    m->used = t - f;
    return r;
}

FG_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    fg_init_nvml();
    if (!fg_real.nvmlDeviceGetMemoryInfo_v2) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = fg_real.nvmlDeviceGetMemoryInfo_v2(dev, m);
    if (r != NVML_SUCCESS || !ENFORCED() || !m) return r;
    int idx = fg_nvml_device_index(dev);
    uint64_t f, t;
    share_info(idx, m->free, idx < 0 ? 0 : m->total, &f, &t);
    m->total = t;
    m->reserved = 0;
    m->free = f;
    m->used = t - f;
    return r;
}
