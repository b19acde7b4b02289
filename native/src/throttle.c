/* Compute share: a token bucket per card, refilled by a sampler thread that reads the card's
 * utilisation from NVML and sets the launch rate that would bring it to the container's percent.
 *
 * NVML measures utilisation over sample periods of its own (1/6 s to 1 s by product; 200 ms on an
 * H200), and a reading stays the same until the next one closes. So the sampler records how many
 * launches went out in each of its 50 ms periods and acts only on fresh samples
 * (nvmlDeviceGetSamples): over the last second of samples, L launches per period caused a mean
 * utilisation U, so the rate that yields the target T is L*T/U launches per period, smoothed.
 * Acting every period on a stale reading compounded each correction: a real H100 held a 30 %
 * share at 44 %. Comparing over a second, not one sample, keeps work that runs long after its
 * launch (a CUDA graph replay) from swinging the estimate. Drivers that keep no samples fall back
 * to nvmlDeviceGetUtilizationRates every period.
 *
 * A launch takes a token, or sleeps until the next refill. Rates are fractional (one graph replay
 * can cost more than a period of the card): a period's tokens are the whole part of the rate
 * plus the fraction carried over. Until the first sample a process is not throttled (its launches'
 * cost is not known yet). The hook never throttles at 100 % (fg.throttle false), and the launch
 * path then costs one branch.
 *
 * The card's utilisation counts every share on the card: two busy shares would each drive the
 * sum to their own target (30 and 70 end near 0 and 70; two 50s near 25 each). So when the node
 * agent keeps a fresh usage file beside the limits (usage.c), its windows of the share's *own*
 * use replace the card's samples as the controller's input, and its ceiling (never below
 * compute_percent: the node may lend, never take) replaces compute_percent as the target. The
 * file is read every period; stale, missing or malformed, the controller is exactly the one
 * above. Only a share of one card steers by it: the file holds one figure per share. */
#include "throttle.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "memory.h"
#include "state.h"
#include "usage.h"

#define PERIOD_NS 50000000L /* refill and sample every 50 ms */
#define WAIT_NS 200000L     /* a launch without a token sleeps this long before looking again */
#define HISTORY 64          /* periods remembered: 3.2 s, longer than any NVML sample period */
#define MAX_SAMPLES 128
#define SPANS 64
#define WINDOW_US 1000000ull /* the controller compares launches and utilisation over 1 s */
#define MIN_RATE 0.02 /* launches per period: one a second, so a share always makes progress */

typedef struct {
    uint64_t end_us; /* CLOCK_REALTIME, as NVML stamps its samples */
    int64_t launches;
} fg_period;

typedef struct {
    uint64_t from_us, to_us; /* the time one NVML sample covers */
    double util;
} fg_span;

typedef struct {
    _Atomic int64_t tokens;
    _Atomic int64_t launches; /* this period */
    _Atomic bool starved;     /* a launch waited this period */
    _Atomic bool active;
    /* The sampler thread's alone: */
    double rate;   /* launches per period; 0 = not yet measured (no limit) */
    double credit; /* the fraction of a token carried into the next period */
    nvmlDevice_t nvml;
    bool samples;          /* nvmlDeviceGetSamples works for this card */
    bool by_usage;         /* the spans are the usage file's windows, not NVML's samples */
    double target;         /* the last period's target, to see a ceiling fall */
    bool fell;             /* the target fell since the rate was last set */
    fg_span spans[SPANS];  /* NVML's samples (or the usage file's windows), newest last */
    unsigned nspans;
    unsigned long long seen_us; /* newest sample used; at first, when the sampler started */
    fg_period history[HISTORY];
    unsigned next;
} fg_bucket;

static fg_bucket buckets[FRACGPU_MAX_DEVICES];
/* Built with -DFRACGPU_THROTTLE_TRACE (make HOOKDEFS=...): one line on stderr per decision, to
 * watch the controller on a card. Never in a release build, which reads no environment. */
#ifdef FRACGPU_THROTTLE_TRACE
static const bool trace = true;
#else
static const bool trace = false;
#endif
static _Atomic int sampler_state; /* 0 not started, 1 running, 2 unavailable */
static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;

static void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static uint64_t realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static double sample_value(nvmlValueType_t type, nvmlValue_t v) {
    switch (type) {
    case NVML_VALUE_TYPE_DOUBLE: return v.dVal;
    case NVML_VALUE_TYPE_UNSIGNED_LONG: return (double)v.ulVal;
    case NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: return (double)v.ullVal;
    case NVML_VALUE_TYPE_SIGNED_LONG_LONG: return (double)v.sllVal;
    case NVML_VALUE_TYPE_SIGNED_INT: return v.siVal;
    default: return v.uiVal;
    }
}

/* Adds the samples NVML took since the last call to b->spans; false when there is none (or
 * samples are unsupported: then b->samples is cleared and the caller falls back). */
static bool fresh_samples(fg_bucket *b) {
    nvmlSample_t got[MAX_SAMPLES];
    unsigned n = MAX_SAMPLES;
    nvmlValueType_t type = NVML_VALUE_TYPE_UNSIGNED_INT;
    nvmlReturn_t r = fg_real.nvmlDeviceGetSamples(b->nvml, NVML_GPU_UTILIZATION_SAMPLES,
                                                  b->seen_us, &type, &n, got);
    if (r == NVML_ERROR_NOT_FOUND || (r == NVML_SUCCESS && n == 0)) return false;
    if (r != NVML_SUCCESS) {
        b->samples = false;
        return false;
    }
    bool added = false;
    for (unsigned i = 0; i < n && i < MAX_SAMPLES; i++) { /* oldest first */
        if (got[i].timeStamp <= b->seen_us) continue;
        double v = sample_value(type, got[i].sampleValue);
        b->spans[b->nspans++ % SPANS] =
            (fg_span){b->seen_us, got[i].timeStamp, v < 0 ? 0 : v > 100 ? 100 : v};
        b->seen_us = got[i].timeStamp;
        added = true;
    }
    return added;
}

/* The card's mean utilisation over the samples of the last WINDOW_US, and the launches per
 * period over the same time. */
static void window(const fg_bucket *b, double *util, double *per_period) {
    const fg_span *newest = &b->spans[(b->nspans - 1) % SPANS];
    uint64_t from = newest->to_us, to = newest->to_us;
    double busy = 0, time = 0;
    for (unsigned k = 0; k < SPANS && k < b->nspans; k++) {
        const fg_span *sp = &b->spans[(b->nspans - 1 - k) % SPANS];
        if (k > 0 && sp->to_us + WINDOW_US < to) break;
        busy += sp->util * (double)(sp->to_us - sp->from_us);
        time += (double)(sp->to_us - sp->from_us);
        from = sp->from_us;
    }
    *util = time > 0 ? busy / time : 0;
    int64_t sum = 0;
    int n = 0;
    for (unsigned k = 0; k < HISTORY; k++) {
        const fg_period *p = &b->history[k];
        if (p->end_us > from && p->end_us <= to + PERIOD_NS / 2000) {
            sum += p->launches;
            n++;
        }
    }
    /* Clocks that do not line up: the periods as long ago as the window is long. */
    if (n == 0) {
        n = (int)((to - from) / (PERIOD_NS / 1000)) + 1;
        if (n > HISTORY) n = HISTORY;
        for (int k = 1; k <= n; k++) sum += b->history[(b->next + HISTORY - k) % HISTORY].launches;
    }
    *per_period = (double)sum / n;
}

/* The usage file's window [stamp - window, stamp] as a span, like a sample of the share alone. */
static void usage_span(fg_bucket *b, const fg_usage *u) {
    b->spans[b->nspans++ % SPANS] =
        (fg_span){u->stamp_us - u->window_us, u->stamp_us, (double)u->used_percent};
}

static void adjust(fg_bucket *b, double target, fg_feed_step step, const fg_usage *u) {
    int64_t launched = atomic_exchange(&b->launches, 0);
    bool starved = atomic_exchange(&b->starved, false);
    uint64_t now = realtime_us();
    b->history[b->next++ % HISTORY] = (fg_period){now, launched};
    double util = 0, per_period = 0;
    bool fresh = false;
    bool by_usage = step != FG_FEED_OFF;
    /* Below the last target: a loan ended (its owner is back, or the file went stale). Kept
     * until the next fresh measurement sets the rate. */
    if (b->target > 0 && target < b->target) b->fell = true;
    b->target = target;
    if (by_usage != b->by_usage) {
        /* The share's own use and the card's are not one measure: start over from here, and
         * take NVML's samples from now on, as at the sampler's start. */
        b->by_usage = by_usage;
        b->nspans = 0;
        b->seen_us = now;
    }
    if (by_usage) {
        if (step == FG_FEED_NEW) {
            usage_span(b, u);
            window(b, &util, &per_period);
            fresh = true;
        }
    } else if (b->samples && fresh_samples(b)) {
        window(b, &util, &per_period);
        fresh = true;
    } else if (!b->samples) {
        nvmlUtilization_t u;
        if (b->nvml && fg_real.nvmlDeviceGetUtilizationRates(b->nvml, &u) == NVML_SUCCESS) {
            util = u.gpu;
            per_period = (double)launched;
            fresh = true;
        }
    }
    if (fresh) {
        double rate = b->rate;
        if (per_period > 0 && util > 0.5) {
            /* Launches cost util/per_period each: the rate that costs the target. */
            double wanted = per_period * target / util;
            /* A ceiling that fell is met at once, not over several samples: the owner of lent
             * compute gets its guarantee back within one window. Without a loan the target
             * never moves, and this is the controller as it always was. */
            rate = rate > 0 && !(b->fell && wanted < rate) ? 0.5 * rate + 0.5 * wanted : wanted;
        } else if (starved && rate > 0 && per_period > 0) {
            rate *= 2; /* launches that leave no trace on the card: they cost little */
        }
        if (rate > 0 && rate < MIN_RATE) rate = MIN_RATE;
        /* Up at most 2x a sample, so a burst of idle samples cannot open the gate wide. */
        if (b->rate > 0 && rate > b->rate * 2) rate = b->rate * 2;
        if (trace)
            fg_log("throttle: %s util %.1f target %.0f launches/period %.2f starved %d rate %.3f "
                   "-> %.3f",
                   by_usage ? "own" : "card", util, target, per_period, (int)starved, b->rate,
                   rate);
        b->rate = rate;
        b->fell = false;
    }
    if (b->rate <= 0) return; /* not measured yet: no limit */
    /* This period's tokens, and the fraction carried; unused ones do not pile up into a burst. */
    double credit = b->credit + b->rate;
    int64_t whole = (int64_t)credit;
    b->credit = credit - (double)whole;
    atomic_store(&b->tokens, whole);
}

static void *sampler(void *arg) {
    (void)arg;
    static const char path[] = FRACGPU_LIMITS_DIR "/" FRACGPU_USAGE_FILE;
    const double guarantee = fg.limits.compute_percent;
    const bool one_card = fg.limits.ndevices == 1;
    fg_usage_feed feed = {0, false};
    for (;;) {
        sleep_ns(PERIOD_NS);
        fg_usage u = {0, 0, 0, 0};
        bool changed = false;
        char why[160] = "";
        fg_feed_step step = one_card ? fg_usage_step(&feed, path, realtime_us(), &u, &changed,
                                                     why, sizeof why)
                                     : FG_FEED_OFF;
        if (trace && changed && step == FG_FEED_OFF)
            fg_log("throttle: usage file %s %s; steering by the card's utilisation", path, why);
        else if (trace && changed)
            fg_log("throttle: usage file %s is fresh; steering by the share's own use", path);
        double target = guarantee;
        if (step != FG_FEED_OFF && u.ceiling_percent > guarantee) target = u.ceiling_percent;
        for (int i = 0; i < fg.limits.ndevices; i++)
            if (atomic_load(&buckets[i].active)) adjust(&buckets[i], target, step, &u);
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
            buckets[i].credit = 0;
            buckets[i].by_usage = false;
            buckets[i].target = 0;
            buckets[i].fell = false;
            buckets[i].nspans = 0;
            buckets[i].seen_us = realtime_us(); /* the driver's earlier history is not ours */
            buckets[i].samples = fg_real.nvmlDeviceGetSamples != NULL;
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
