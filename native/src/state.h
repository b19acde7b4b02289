/* What every layer of the hook reads: the mode and limits of this container (fg), the real
 * entry points (fg_real, real.h), the start that fills both, and the line on stderr (log.h).
 * Nothing here is exported from the library, and nothing here names a layer above it. */
#ifndef FRACGPU_STATE_H
#define FRACGPU_STATE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cuda_api.h"
#include "limits.h"
#include "log.h"
#include "real.h"

#define FG_EXPORT __attribute__((visibility("default")))
#define FG_LIKELY(x) __builtin_expect(!!(x), 1)
#define FG_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* What the limits file made of this container. */
typedef enum {
    FG_MODE_INERT = 0,  /* no limits file: pass everything through */
    FG_MODE_ENFORCE = 1,
    FG_MODE_DENY = 2,   /* limits unreadable or accounting unavailable: refuse device memory */
} fg_mode;

typedef struct {
    fg_mode mode;
    bool throttle;      /* compute_percent < 100 */
    fg_limits limits;
} fg_state;

extern fg_state fg;

/* Load limits and the real driver once; cheap after the first call. */
void fg_init_slow(void);
extern _Atomic int fg_ready;
static inline void fg_init(void) {
    if (FG_UNLIKELY(!atomic_load_explicit(&fg_ready, memory_order_acquire))) fg_init_slow();
}
/* Same for NVML (loaded only by processes that call it, or by the throttle's sampler). */
void fg_init_nvml(void);

/* The driver and NVML libraries the start opened (NULL: not loaded). */
void *fg_driver_handle(void);
void *fg_nvml_handle(void);

/* In a forked child: the start's lock may have been held by a thread that is gone. */
void fg_state_after_fork(void);

/* ---- the layer above ---------------------------------------------------------------------- */

/* The start must also lead the driver's entry points to the hook's (rebind.c) and install the
 * fork handler, and the region must tell someone when it finds itself in a child no fork handler
 * ran in. Only the top of the hook (interpose.c) knows every entry point, and the state must not
 * name it. So the state defines fg_upper_ops weakly, doing nothing, and the top defines it for
 * real: the linker takes the top's, and the state calls up without a reference to it. A
 * registration made by a constructor would come too late: another library's constructor may
 * call the driver through the hook before the hook's own constructors ran, and the start must be
 * whole then too. */
typedef struct {
    /* Under the start's lock, limits read and libcuda resolved (cuda NULL when absent). */
    void (*started)(void *cuda);
    /* Once, when NVML was loaded and resolved. */
    void (*nvml_started)(void *nvml);
    /* The region found this process to be a child no fork handler ran in (a raw clone). */
    void (*child_detected)(void);
} fg_upper;

extern const fg_upper fg_upper_ops;

#endif
