/* Compute share: a token bucket per card, refilled by a sampler thread that reads the card's
 * utilisation from NVML and sets the launch rate that would bring it to the container's percent.
 *
 * Each period the sampler knows how many launches went out (L) and what utilisation they caused
 * (U), so one launch costs about U/L percent; the rate that yields the target T is L*T/U launches
 * per period, smoothed so that NVML's averaging lag does not make it oscillate. A launch takes a
 * token, or sleeps until the next refill. The hook never throttles at 100 % (fg.throttle false),
 * and the launch path then costs one branch. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "hook.h"

#define PERIOD_NS 50000000L /* refill and sample every 50 ms */
#define WAIT_NS 200000L     /* a launch without a token sleeps this long before looking again */

typedef struct {
    _Atomic int64_t tokens;
    _Atomic int64_t launches; /* this period */
    _Atomic bool starved;     /* a launch waited this period */
    _Atomic bool active;
    double rate;              /* launches per period; 0 = not yet measured (no limit) */
    nvmlDevice_t nvml;
} fg_bucket;

static fg_bucket buckets[FRACGPU_MAX_DEVICES];
static _Atomic int sampler_state; /* 0 not started, 1 running, 2 unavailable */
static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;

static void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void adjust(fg_bucket *b, double target) {
    nvmlUtilization_t u;
    if (!b->nvml || fg_real.nvmlDeviceGetUtilizationRates(b->nvml, &u) != NVML_SUCCESS) return;
    int64_t launched = atomic_exchange(&b->launches, 0);
    bool starved = atomic_exchange(&b->starved, false);
    double util = u.gpu;
    double rate = b->rate;
    if (launched > 0 && util > 0.5) {
        double wanted = (double)launched * target / util;
        /* Smooth, and move up at most 2x a period so a burst of idle samples cannot open the
         * gate wide; below the target and starved means the estimate is low: nudge it up. */
        rate = rate > 0 ? 0.5 * rate + 0.5 * wanted : wanted;
        if (starved && util < target) rate *= 1.0 + 0.5 * (target - util) / target;
    } else if (starved) {
        rate = rate > 0 ? rate * 2 : 1;
    }
    if (rate < 1) rate = 1;
    if (b->rate > 0 && rate > b->rate * 2) rate = b->rate * 2;
    b->rate = rate;
    /* Refill to one period's tokens, no more: unused ones do not pile up into a burst. */
    atomic_store(&b->tokens, (int64_t)rate);
}

static void *sampler(void *arg) {
    (void)arg;
    double target = fg.limits.compute_percent;
    for (;;) {
        sleep_ns(PERIOD_NS);
        for (int i = 0; i < fg.limits.ndevices; i++)
            if (atomic_load(&buckets[i].active)) adjust(&buckets[i], target);
    }
    return NULL;
}

static bool start_sampler(void) {
    pthread_mutex_lock(&start_mu);
    int state = atomic_load(&sampler_state);
    if (state == 0) {
        fg_init_nvml();
        bool ok = fg_real.nvmlInit_v2 && fg_real.nvmlDeviceGetHandleByUUID &&
                  fg_real.nvmlDeviceGetUtilizationRates && fg_real.nvmlInit_v2() == NVML_SUCCESS;
        for (int i = 0; ok && i < fg.limits.ndevices; i++) {
            buckets[i].rate = 0;
            atomic_store(&buckets[i].tokens, INT64_MAX / 2);
            if (fg_real.nvmlDeviceGetHandleByUUID(fg.limits.devices[i], &buckets[i].nvml) !=
                NVML_SUCCESS)
                buckets[i].nvml = NULL;
        }
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (ok && pthread_create(&t, &attr, sampler, NULL) == 0) {
            state = 1;
        } else {
            state = 2;
            fg_log("NVML utilisation is unavailable; kernel launches are not throttled");
        }
        pthread_attr_destroy(&attr);
        atomic_store(&sampler_state, state);
    }
    pthread_mutex_unlock(&start_mu);
    return state == 1;
}

void fg_throttle_after_fork(void) {
    pthread_mutex_init(&start_mu, NULL);
    atomic_store(&sampler_state, 0);
}

void fg_throttle_acquire(void) {
    int state = atomic_load_explicit(&sampler_state, memory_order_acquire);
    if (FG_UNLIKELY(state != 1)) {
        if (state == 2 || !start_sampler()) return;
    }
    CUdevice d;
    if (fg_real.cuCtxGetDevice(&d) != CUDA_SUCCESS) return;
    int idx = fg_device_index(d);
    if (idx < 0) return;
    fg_bucket *b = &buckets[idx];
    atomic_store_explicit(&b->active, true, memory_order_relaxed);
    atomic_fetch_add_explicit(&b->launches, 1, memory_order_relaxed);
    while (atomic_fetch_sub(&b->tokens, 1) <= 0) {
        atomic_fetch_add(&b->tokens, 1);
        atomic_store_explicit(&b->starved, true, memory_order_relaxed);
        sleep_ns(WAIT_NS);
    }
}

/* ---- the launch entry points ------------------------------------------------------------- */

#define LAUNCH_ARGS f, gx, gy, gz, bx, by, bz, shmem, stream, params

FG_EXPORT CUresult cuLaunchKernel(FRACGPU_LAUNCH_PARAMS, void **extra) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchKernel ? fg_real.cuLaunchKernel(LAUNCH_ARGS, extra)
                                  : CUDA_ERROR_NOT_INITIALIZED;
}

FG_EXPORT CUresult cuLaunchKernel_ptsz(FRACGPU_LAUNCH_PARAMS, void **extra) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchKernel_ptsz ? fg_real.cuLaunchKernel_ptsz(LAUNCH_ARGS, extra)
                                       : CUDA_ERROR_NOT_INITIALIZED;
}

FG_EXPORT CUresult cuLaunchCooperativeKernel(FRACGPU_LAUNCH_PARAMS) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchCooperativeKernel ? fg_real.cuLaunchCooperativeKernel(LAUNCH_ARGS)
                                             : CUDA_ERROR_NOT_INITIALIZED;
}

FG_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(FRACGPU_LAUNCH_PARAMS) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchCooperativeKernel_ptsz
               ? fg_real.cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS)
               : CUDA_ERROR_NOT_INITIALIZED;
}

FG_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params,
                                    void **extra) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchKernelEx ? fg_real.cuLaunchKernelEx(c, f, params, extra)
                                    : CUDA_ERROR_NOT_INITIALIZED;
}

FG_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params,
                                         void **extra) {
    fg_init();
    if (FG_UNLIKELY(fg.throttle)) fg_throttle_acquire();
    return fg_real.cuLaunchKernelEx_ptsz ? fg_real.cuLaunchKernelEx_ptsz(c, f, params, extra)
                                         : CUDA_ERROR_NOT_INITIALIZED;
}
