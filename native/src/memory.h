/* What the memory paths lend the rest of the hook (graph.c, throttle.c, fork.c): which granted
 * card the caller's context is on, the charge that refuses what does not fit, and the reset of
 * every memory table after fork. */
#ifndef FRACGPU_MEMORY_H
#define FRACGPU_MEMORY_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_api.h"

/* Where an allocation lands, besides a card index (>= 0) of the limits file. */
enum {
    FG_NO_CONTEXT = -1,  /* no current context: the driver refuses the call itself */
    FG_NOT_GRANTED = -2, /* a card this container was not granted: refused */
};

/* The card index of the calling thread's current context, or one of the values above. */
int fg_current_index(void);
/* Charge bytes to card idx; false means answer CUDA_ERROR_OUT_OF_MEMORY. */
bool fg_charge(int idx, uint64_t bytes);
/* Index in the limits' device list of a CUDA ordinal, or -1 when the card was not granted. */
int fg_device_index(CUdevice dev);
int fg_nvml_device_index(nvmlDevice_t dev);

/* memory_fork.c: a forked child starts from empty tables (every family's, and the records). */
void fg_memory_after_fork(void);

#endif
