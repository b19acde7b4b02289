/* A fake libnvidia-ml.so.1 for the device plugin's tests: inventory, health events and the
 * per-process memory the node guard reads.
 *
 * It implements the few NVML entry points that deviceplugin/inventory.py, health.py and guard.py
 * call,
 * with the real signatures and return codes, from state that the test controls:
 *
 *   FAKE_NVML_CONFIG  a file read at nvmlInit; one card per line:
 *                       card <uuid> <memory_mib> <minor> <numa_node|-1> <product name...>
 *   FAKE_NVML_EVENTS  a file the test appends to while the plugin runs; one command per line:
 *                       xid <index|-1> <code>   critical XID event (-1: not tied to a card)
 *                       dbe <index>             double-bit ECC event
 *                       lost <index>            queries about the card fail with GPU_IS_LOST
 *                       back <index>            the card answers again
 *                       fail_wait <n>           the next n event waits fail with UNKNOWN
 *                       proc <index> <pid> <mib>      a compute process holding <mib> MiB on
 *                                                     the card (again: new amount; -1: NVML
 *                                                     cannot tell, NVML_VALUE_NOT_AVAILABLE)
 *                       graphics <index> <pid> <mib>  the same, in the graphics list
 *                       exit <index> <pid>            the process leaves both lists
 *                       fail_procs <n>          the next n process-list calls fail with UNKNOWN
 *                       sm <index> <pid> <pct>  the process keeps <pct> % of the card's SMs
 *                                               busy (-1: no samples, as an idle process)
 *                       unsampled <index>       the card does not sample per-process
 *                                               utilisation (NOT_SUPPORTED, as under MIG)
 *
 * nvmlDeviceGetProcessUtilization answers one sample per busy process, stamped with the time of
 * the call (µs), when that is newer than lastSeenTimeStamp; NOT_FOUND when there is none, as
 * the driver does for a card no process used.
 *
 * The process lists follow the real _v3 calls: nvmlProcessInfo_v2_t entries (pid, usedGpuMemory,
 * gpuInstanceId, computeInstanceId; the instance IDs are NOT_AVAILABLE without MIG), and a count
 * smaller than the list answers NVML_ERROR_INSUFFICIENT_SIZE with the count needed.
 *
 * nvmlEventSetWait_v2 polls the events file every 2 ms until its timeout, so an injected event
 * is delivered within milliseconds, as a real driver would deliver it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define EVENT_SBE 0x1ULL
#define EVENT_DBE 0x2ULL
#define EVENT_XID 0x8ULL
#define MAX_CARDS 64
#define MAX_QUEUE 1024
#define MAX_PROCS 256
#define PROC_COMPUTE 1
#define PROC_GRAPHICS 2
#define VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFU

struct fake_proc {
    unsigned int pid;
    long long used_mib; /* -1: not available */
    int lists;          /* PROC_COMPUTE | PROC_GRAPHICS */
    int sm;             /* percent of the SMs busy; -1: no samples */
};

struct fake_device {
    int index;
    char uuid[96];
    char name[96];
    unsigned long long memory_mib;
    unsigned int minor;
    int numa;
    int lost;
    int unsampled;
    struct fake_proc procs[MAX_PROCS];
    int proc_count;
};
typedef struct fake_device *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_event_set {
    unsigned long long masks[MAX_CARDS];
};
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

struct queued {
    int card;
    unsigned long long type;
    unsigned long long data;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_device devices[MAX_CARDS];
static int device_count;
static int init_count;
static long events_offset;
static int fail_waits;
static int fail_procs;
static struct queued queue[MAX_QUEUE];
static int queue_len;

static void read_config(void) {
    device_count = 0;
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f) && device_count < MAX_CARDS) {
        struct fake_device *d = &devices[device_count];
        int consumed = 0;
        memset(d, 0, sizeof *d);
        if (sscanf(line, "card %95s %llu %u %d %n", d->uuid, &d->memory_mib, &d->minor, &d->numa,
                   &consumed) == 4) {
            snprintf(d->name, sizeof d->name, "%s", line + consumed);
            d->name[strcspn(d->name, "\r\n")] = 0;
            d->index = device_count++;
        }
    }
    fclose(f);
}

/* Add or update a process in one of a card's lists. Lock held. */
static void set_proc(int card, unsigned int pid, long long mib, int list) {
    if (card < 0 || card >= device_count) return;
    struct fake_device *d = &devices[card];
    for (int i = 0; i < d->proc_count; i++) {
        if (d->procs[i].pid == pid) {
            d->procs[i].used_mib = mib;
            d->procs[i].lists |= list;
            return;
        }
    }
    if (d->proc_count < MAX_PROCS)
        d->procs[d->proc_count++] = (struct fake_proc){pid, mib, list, -1};
}

static void set_sm(int card, unsigned int pid, int percent) {
    if (card < 0 || card >= device_count) return;
    struct fake_device *d = &devices[card];
    for (int i = 0; i < d->proc_count; i++) {
        if (d->procs[i].pid == pid) d->procs[i].sm = percent;
    }
}

static void drop_proc(int card, unsigned int pid) {
    if (card < 0 || card >= device_count) return;
    struct fake_device *d = &devices[card];
    for (int i = 0; i < d->proc_count; i++) {
        if (d->procs[i].pid == pid) {
            d->procs[i] = d->procs[--d->proc_count];
            return;
        }
    }
}

/* Apply the commands appended to the events file since the last call. Lock held. */
static void sync_events(void) {
    const char *path = getenv("FAKE_NVML_EVENTS");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    if (fseek(f, events_offset, SEEK_SET) != 0) {
        fclose(f);
        return;
    }
    char line[256];
    while (fgets(line, sizeof line, f)) {
        size_t n = strlen(line);
        if (n == 0 || line[n - 1] != '\n') break; /* a half-written line: read it next time */
        events_offset += (long)n;
        int card = 0;
        unsigned long long code = 0;
        unsigned int pid = 0;
        long long mib = 0;
        if (sscanf(line, "proc %d %u %lld", &card, &pid, &mib) == 3) {
            set_proc(card, pid, mib, PROC_COMPUTE);
        } else if (sscanf(line, "graphics %d %u %lld", &card, &pid, &mib) == 3) {
            set_proc(card, pid, mib, PROC_GRAPHICS);
        } else if (sscanf(line, "exit %d %u", &card, &pid) == 2) {
            drop_proc(card, pid);
        } else if (sscanf(line, "sm %d %u %lld", &card, &pid, &mib) == 3) {
            set_sm(card, pid, (int)mib);
        } else if (sscanf(line, "unsampled %d", &card) == 1 && card >= 0 && card < device_count) {
            devices[card].unsampled = 1;
        } else if (sscanf(line, "fail_procs %d", &card) == 1) {
            fail_procs += card;
        } else if (sscanf(line, "xid %d %llu", &card, &code) == 2 && queue_len < MAX_QUEUE) {
            queue[queue_len++] = (struct queued){card, EVENT_XID, code};
        } else if (sscanf(line, "dbe %d", &card) == 1 && queue_len < MAX_QUEUE) {
            queue[queue_len++] = (struct queued){card, EVENT_DBE, 0};
        } else if (sscanf(line, "lost %d", &card) == 1 && card >= 0 && card < device_count) {
            devices[card].lost = 1;
        } else if (sscanf(line, "back %d", &card) == 1 && card >= 0 && card < device_count) {
            devices[card].lost = 0;
        } else if (sscanf(line, "fail_wait %d", &card) == 1) {
            fail_waits += card;
        }
    }
    fclose(f);
}

static nvmlReturn_t check_device(nvmlDevice_t d) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (d < devices || d >= devices + device_count) return NVML_ERROR_INVALID_ARGUMENT;
    sync_events();
    return d->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (init_count++ == 0) {
        read_config();
        /* Commands written before init are history, not news. */
        const char *path = getenv("FAKE_NVML_EVENTS");
        FILE *f = path ? fopen(path, "r") : NULL;
        events_offset = 0;
        if (f) {
            fseek(f, 0, SEEK_END);
            events_offset = ftell(f);
            fclose(f);
        }
        queue_len = 0;
        fail_procs = 0;
    }
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (init_count > 0) init_count--;
    pthread_mutex_unlock(&lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!version || length < 8) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "%s", "999.99-fake");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = init_count ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)device_count;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (!init_count) rc = NVML_ERROR_UNINITIALIZED;
    else if (index >= (unsigned int)device_count) rc = NVML_ERROR_INVALID_ARGUMENT;
    else *device = &devices[index];
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = init_count ? NVML_ERROR_NOT_FOUND : NVML_ERROR_UNINITIALIZED;
    if (init_count) sync_events();
    for (int i = 0; init_count && i < device_count; i++) {
        if (strcmp(devices[i].uuid, uuid) == 0) {
            *device = &devices[i];
            rc = devices[i].lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

#define DEVICE_CALL(body)                                                                          \
    pthread_mutex_lock(&lock);                                                                     \
    nvmlReturn_t rc = check_device(device);                                                        \
    if (rc == NVML_SUCCESS) { body }                                                               \
    pthread_mutex_unlock(&lock);                                                                   \
    return rc;

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value) {
    if (!out || strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_CALL(*index = (unsigned int)device->index;)
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(rc = copy_string(uuid, length, device->uuid);)
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(rc = copy_string(name, length, device->name);)
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_CALL(memory->total = device->memory_mib << 20; memory->used = 0;
                memory->free = memory->total;)
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    DEVICE_CALL(*minor = device->minor;)
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, int *node) {
    DEVICE_CALL(if (device->numa < 0) rc = NVML_ERROR_NOT_SUPPORTED; else *node = device->numa;)
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    DEVICE_CALL(*types = EVENT_SBE | EVENT_DBE | EVENT_XID;)
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof(struct fake_event_set));
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    DEVICE_CALL(set->masks[device->index] |= types;)
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}

/* Take the first queued event this set listens to. Lock held. */
static int take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    for (int i = 0; i < queue_len; i++) {
        struct queued q = queue[i];
        int wanted = 0;
        if (q.card < 0) {
            for (int c = 0; c < device_count; c++) wanted |= (set->masks[c] & q.type) != 0;
        } else if (q.card < device_count) {
            wanted = (set->masks[q.card] & q.type) != 0;
        }
        if (!wanted) continue;
        memset(data, 0, sizeof *data);
        data->device = q.card < 0 ? NULL : &devices[q.card];
        data->eventType = q.type;
        data->eventData = q.data;
        memmove(&queue[i], &queue[i + 1], sizeof queue[0] * (size_t)(queue_len - i - 1));
        queue_len--;
        return 1;
    }
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec step = {0, 2 * 1000 * 1000};
    for (unsigned int waited = 0;; waited += 2) {
        pthread_mutex_lock(&lock);
        nvmlReturn_t rc = NVML_ERROR_TIMEOUT;
        if (!init_count) rc = NVML_ERROR_UNINITIALIZED;
        else {
            sync_events();
            if (fail_waits > 0) {
                fail_waits--;
                rc = NVML_ERROR_UNKNOWN;
            } else if (take_event(set, data)) {
                rc = NVML_SUCCESS;
            }
        }
        pthread_mutex_unlock(&lock);
        if (rc != NVML_ERROR_TIMEOUT || waited >= timeoutms) return rc;
        nanosleep(&step, NULL);
    }
}

/* The _v3 process lists. Lock held by the caller (DEVICE_CALL). */
static nvmlReturn_t list_procs(nvmlDevice_t device, unsigned int *count,
                               nvmlProcessInfo_v2_t *infos, int list) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (fail_procs > 0) {
        fail_procs--;
        return NVML_ERROR_UNKNOWN;
    }
    unsigned int found = 0;
    for (int i = 0; i < device->proc_count; i++) found += (device->procs[i].lists & list) != 0;
    if (*count < found) {
        *count = found;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (found > 0 && !infos) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (int i = 0; i < device->proc_count; i++) {
        const struct fake_proc *p = &device->procs[i];
        if (!(p->lists & list)) continue;
        infos[n].pid = p->pid;
        infos[n].usedGpuMemory =
            p->used_mib < 0 ? VALUE_NOT_AVAILABLE_ULL : (unsigned long long)p->used_mib << 20;
        infos[n].gpuInstanceId = VALUE_NOT_AVAILABLE_UINT;
        infos[n].computeInstanceId = VALUE_NOT_AVAILABLE_UINT;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_v2_t *infos) {
    DEVICE_CALL(rc = list_procs(device, count, infos, PROC_COMPUTE);)
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_v2_t *infos) {
    DEVICE_CALL(rc = list_procs(device, count, infos, PROC_GRAPHICS);)
}

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

static nvmlReturn_t utilisation(nvmlDevice_t device, nvmlProcessUtilizationSample_t *samples,
                                unsigned int *count, unsigned long long last_seen) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->unsampled) return NVML_ERROR_NOT_SUPPORTED;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long now = (unsigned long long)ts.tv_sec * 1000000ULL + ts.tv_nsec / 1000;
    unsigned int busy = 0;
    for (int i = 0; i < device->proc_count; i++) busy += device->procs[i].sm >= 0;
    if (busy == 0 || now <= last_seen) return NVML_ERROR_NOT_FOUND;
    if (!samples || *count < busy) {
        *count = busy;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (int i = 0; i < device->proc_count; i++) {
        const struct fake_proc *p = &device->procs[i];
        if (p->sm < 0) continue;
        samples[n++] = (nvmlProcessUtilizationSample_t){p->pid, now, (unsigned int)p->sm, 0, 0, 0};
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    DEVICE_CALL(rc = utilisation(device, utilization, processSamplesCount, lastSeenTimeStamp);)
}
