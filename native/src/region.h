/* The container's shared accounting region: device memory in use, per process and per card.
 *
 * One file in the writable shared directory, mapped by every process of the container. Each
 * process owns one slot and is its only writer; the container's use of a card is the sum over
 * live slots. A charge adds to the own slot first and then checks the sum, so concurrent charges
 * can only both fail, never both pass beyond the limit; no lock is taken. A slot whose process
 * died (SIGKILL included) is found by pid + start time and zeroed, which returns its share. */
#ifndef FRACGPU_REGION_H
#define FRACGPU_REGION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fracgpu_contract.h"

#define FG_REGION_SLOTS 256

/* Map (creating if needed) the region at path and take a slot for this process. 0 or -errno.
 * on_child (may be NULL) is called when the region finds itself in a child no fork handler ran
 * in (a raw clone): the hook forgets what the parent recorded, as after a fork. */
int fg_region_open(const char *path, void (*on_child)(void), char *why, size_t why_len);
/* Forget the mapping's slot in a forked child; the child takes a fresh slot on first use. */
void fg_region_after_fork(void);
/* Give the slot back (normal exit): its counters go to zero. */
void fg_region_close(void);

/* Reserve bytes on card index dev unless the container's total would exceed limit. */
bool fg_region_charge(int dev, uint64_t bytes, uint64_t limit);
/* Add bytes even beyond the limit (only for memory the driver already holds). */
void fg_region_force(int dev, uint64_t bytes);
void fg_region_release(int dev, uint64_t bytes);
/* The container's use of card dev, summed over live processes. */
uint64_t fg_region_used(int dev);
/* Reclaim the slots of dead processes; returns how many were reclaimed. thorough also tells a
 * reused pid from its dead owner by start time (reads /proc). */
int fg_region_reap(bool thorough);

#endif
