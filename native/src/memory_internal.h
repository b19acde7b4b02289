/* What the memory paths (memory.c and its families: memory_linear.c, memory_pool.c,
 * memory_vmm.c, memory_array.c, memory_info.c) share with one another and with nobody else. */
#ifndef FRACGPU_MEMORY_INTERNAL_H
#define FRACGPU_MEMORY_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "state.h"
#include "memory.h"
#include "rectable.h"

/* Sizes come from the caller: a product that overflows must not wrap into a small charge. */
static inline uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
static inline uint64_t add_sat(uint64_t a, uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

#define ENFORCED() (fg.mode != FG_MODE_INERT)

/* ---- the one shape of every charged allocation (memory.c) --------------------------------- */

/* How one allocation entry point asks the driver, what it actually took, and how to give it
 * back when the hook cannot keep a record of it. */
typedef struct {
    fg_rec_kind kind;
    CUresult (*call)(void *args, uint64_t *key);
    CUresult (*undo)(uint64_t key);
    uint64_t (*actual)(const void *args); /* NULL: what was charged is exact */
} fg_alloc_ops;

/* Charge bytes to card idx, ask the driver (ops->call), settle on what it took and record it.
 * CUDA_ERROR_OUT_OF_MEMORY when the charge does not fit; the driver's error when it refuses. */
CUresult fg_alloc_charged(const fg_alloc_ops *ops, void *args, int idx, uint64_t bytes);
/* Free key with do_free and release what its record of kind charged (once the driver agrees). */
CUresult fg_free_recorded(fg_rec_kind kind, uint64_t key, CUresult (*do_free)(uint64_t));

/* ---- each family's own table, emptied in a forked child (memory_fork.c) ------------------- */

void fg_pools_after_fork(void); /* memory_pool.c */
void fg_vmm_after_fork(void);   /* memory_vmm.c */

/* ---- frees that cross families (memory_pool.c) -------------------------------------------- */

/* cuMemFree_v2 and cuMemFreeAsync(_ptsz): free p (async: with real on stream s, else with
 * cuMemFree_v2) and settle whichever record it has, linear or stream-ordered. */
CUresult fg_free_any(CUdeviceptr p, CUstream s, bool async, __typeof__(cuMemFreeAsync) *real);

#endif
