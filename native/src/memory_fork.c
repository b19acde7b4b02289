/* The memory paths' reset after fork: the parent's allocations are not the child's to free, so
 * the child starts from empty tables. Above every family, so that the core (memory.c), which the
 * families build on, never names them. */
#include "memory_internal.h"

void fg_memory_after_fork(void) {
    fg_pools_after_fork();
    fg_vmm_after_fork();
    fg_rec_after_fork();
}
