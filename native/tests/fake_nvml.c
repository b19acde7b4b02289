/* A fake libnvidia-ml.so.1: the cards of the fake libcuda.so.1, their memory and the utilisation
 * of its simulated clock, the card's and each process's (FAKE_CUDA_SHARED_CARD puts several
 * processes on one card). Strict: every call before nvmlInit fails with NVML_ERROR_UNINITIALIZED,
 * unknown handles and UUIDs are rejected. (It initialises the fake driver itself, as the real
 * NVML does not need a CUDA context.) */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8

int fakecuda_device_count(void);
void fakecuda_memory(int d, uint64_t *total, uint64_t *used);
unsigned fakecuda_utilization(int d);
unsigned fakecuda_utilization_samples(int d, uint64_t after_us, uint64_t *stamps_us,
                                      unsigned *values, unsigned max);
unsigned fakecuda_process_samples(int d, uint64_t after_us, int *pids, uint64_t *stamps_us,
                                  unsigned *values, unsigned max);

/* NVML's own layout (nvml.h); the hook never calls this, so cuda_api.h does not declare it. */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

struct nvmlDevice_st { int index; };
static struct nvmlDevice_st devices[MAX_DEV] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static atomic_int inits;

static int index_of(nvmlDevice_t d) {
    if (!atomic_load(&inits) || d < &devices[0] || d >= &devices[MAX_DEV]) return -1;
    return d->index < fakecuda_device_count() ? d->index : -1;
}

static void uuid_of(int i, char *out, size_t n) {
    snprintf(out, n, "GPU-10111213-1415-1617-1819-1a1b1c1d1e%02x", i);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    cuInit(0);
    atomic_fetch_add(&inits, 1);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlShutdown(void) {
    if (atomic_load(&inits) == 0) return NVML_ERROR_UNINITIALIZED;
    atomic_fetch_sub(&inits, 1);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)fakecuda_device_count();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= (unsigned)fakecuda_device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *d = &devices[i];
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !d) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < fakecuda_device_count(); i++) {
        char u[NVML_DEVICE_UUID_BUFFER_SIZE];
        uuid_of(i, u, sizeof u);
        if (strcmp(u, uuid) == 0) {
            *d = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (len < 42) return NVML_ERROR_INSUFFICIENT_SIZE;
    uuid_of(i, uuid, len);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !m) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total, used;
    fakecuda_memory(i, &total, &used);
    *m = (nvmlMemory_t){total, total - used, used};
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !m || m->version != (unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total, used;
    fakecuda_memory(i, &total, &used);
    m->total = total;
    m->reserved = 0;
    m->free = total - used;
    m->used = used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !u) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = fakecuda_utilization(i);
    u->memory = 0;
    return NVML_SUCCESS;
}

/* GPU utilisation samples only; FAKE_NVML_NO_SAMPLES=1 makes it unsupported, as on drivers that
 * keep none, so the hook's fallback to nvmlDeviceGetUtilizationRates is exercised too. */
EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t d, nvmlSamplingType_t type,
                                         unsigned long long last_seen, nvmlValueType_t *value_type,
                                         unsigned int *count, nvmlSample_t *samples) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    const char *off = getenv("FAKE_NVML_NO_SAMPLES");
    if (off && *off == '1') return NVML_ERROR_NOT_SUPPORTED;
    int i = index_of(d);
    if (i < 0 || !count || !value_type) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_GPU_UTILIZATION_SAMPLES) return NVML_ERROR_NOT_SUPPORTED;
    uint64_t stamps[100];
    unsigned values[100];
    unsigned n = fakecuda_utilization_samples(i, last_seen, stamps, values, 100);
    *value_type = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (!samples) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (n > *count) n = *count;
    for (unsigned k = 0; k < n; k++) {
        samples[k].timeStamp = stamps[k];
        samples[k].sampleValue.uiVal = values[k];
    }
    *count = n;
    return NVML_SUCCESS;
}

/* Per-process SM use, as the real call gives it: one entry per process and sample window newer
 * than lastSeenTimeStamp in which the process ran kernels (its percent of that window, stamped
 * when the window closed); NOT_FOUND when there is none; NVML's sizing protocol: a NULL buffer or
 * a count too small answers NVML_ERROR_INSUFFICIENT_SIZE with the count needed. */
#define MAX_PROC_SAMPLES 1600
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                    nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *count,
                                                    unsigned long long last_seen) {
    if (!atomic_load(&inits)) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    static _Thread_local int pids[MAX_PROC_SAMPLES];
    static _Thread_local uint64_t stamps[MAX_PROC_SAMPLES];
    static _Thread_local unsigned values[MAX_PROC_SAMPLES];
    unsigned n = fakecuda_process_samples(i, last_seen, pids, stamps, values, MAX_PROC_SAMPLES);
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (!utilization || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++)
        utilization[k] = (nvmlProcessUtilizationSample_t){(unsigned)pids[k], stamps[k], values[k],
                                                          0, 0, 0};
    *count = n;
    return NVML_SUCCESS;
}
