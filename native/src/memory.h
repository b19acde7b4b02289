/* What memory.c lends the other memory paths (graph.c): where the caller's context is, and the
 * charge that refuses what does not fit. */
#ifndef FRACGPU_MEMORY_H
#define FRACGPU_MEMORY_H

#include <stdbool.h>
#include <stdint.h>

/* Where an allocation lands, besides a card index (>= 0) of the limits file. */
enum {
    FG_NO_CONTEXT = -1,  /* no current context: the driver refuses the call itself */
    FG_NOT_GRANTED = -2, /* a card this container was not granted: refused */
};

/* The card index of the calling thread's current context, or one of the values above. */
int fg_current_index(void);
/* Charge bytes to card idx; false means answer CUDA_ERROR_OUT_OF_MEMORY. */
bool fg_charge(int idx, uint64_t bytes);

#endif
