/* The hook's state, region and graph calls for the memory unit tests (see memory_unit.h). */
#include "memory_unit.h"

#include <stdarg.h>
#include <string.h>

fg_state fg;
fg_real_fns fg_real;
_Atomic int fg_ready = 1;

int failures;
CUdevice unit_device;
CUcontext unit_context;
int unit_logs;
char unit_last_log[512];
int unit_underflows;
CUstream unit_capturing;
uint64_t unit_captured;

void fg_init_slow(void) {}
void fg_init_nvml(void) {}

void fg_log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(unit_last_log, sizeof unit_last_log, fmt, ap);
    va_end(ap);
    unit_logs++;
}

/* ---- the region: one counter per card, the real one's rules ---------------------------------- */

static uint64_t used[FRACGPU_MAX_DEVICES];

bool fg_region_charge(int dev, uint64_t bytes, uint64_t limit) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES || bytes > limit) return false;
    if (used[dev] + bytes > limit) return false;
    used[dev] += bytes;
    return true;
}

void fg_region_force(int dev, uint64_t bytes) {
    if (dev >= 0 && dev < FRACGPU_MAX_DEVICES) used[dev] += bytes;
}

void fg_region_release(int dev, uint64_t bytes) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES) return;
    if (bytes > used[dev]) {
        unit_underflows++;
        used[dev] = 0;
        return;
    }
    used[dev] -= bytes;
}

uint64_t fg_region_used(int dev) {
    return dev >= 0 && dev < FRACGPU_MAX_DEVICES ? used[dev] : 0;
}

uint64_t unit_used(int idx) { return fg_region_used(idx); }

/* ---- graph.c ------------------------------------------------------------------------------ */

bool fg_graph_capturing(CUstream s) { return s && s == unit_capturing; }

void fg_graph_captured(CUstream s, uint64_t bytes) {
    if (fg_graph_capturing(s)) unit_captured += bytes;
}

/* ---- the context and the cards ------------------------------------------------------------ */

static CUresult ctx_get_device(CUdevice *d) {
    if (unit_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *d = unit_device;
    return CUDA_SUCCESS;
}

static CUresult ctx_get_current(CUcontext *c) {
    *c = unit_device < 0 ? NULL : unit_context;
    return CUDA_SUCCESS;
}

static CUresult device_get_uuid(CUuuid *u, CUdevice d) {
    if (d < 0 || d >= UNIT_CARDS) return CUDA_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 15; i++) u->bytes[i] = (char)(0xa0 + i);
    u->bytes[15] = (char)d;
    return CUDA_SUCCESS;
}

void unit_reset(fg_mode mode, uint64_t limit) {
    fg.mode = mode;
    fg.limits.ndevices = 2;
    strcpy(fg.limits.devices[0], UNIT_UUID0);
    strcpy(fg.limits.devices[1], UNIT_UUID1);
    fg.limits.memory_bytes = limit;
    fg.limits.compute_percent = 100;
    fg_real.cuCtxGetDevice = ctx_get_device;
    fg_real.cuCtxGetCurrent = ctx_get_current;
    fg_real.cuDeviceGetUuid = device_get_uuid;
    memset(used, 0, sizeof used);
    fg_memory_after_fork();
    unit_device = 0;
    unit_context = (CUcontext)(uintptr_t)0xc1;
    unit_logs = 0;
    unit_last_log[0] = '\0';
    unit_underflows = 0;
    unit_capturing = NULL;
    unit_captured = 0;
}
