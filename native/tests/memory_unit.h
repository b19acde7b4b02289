/* What the memory files' unit tests (memory_*_test.c) share: the hook's state without state.c
 * and real.c, a region that counts in process memory instead of the shared file, graph stubs, and
 * a fake context. Each test links one memory family with the core (src/memory.c), the reset after
 * fork (src/memory_fork.c), the real record table (src/rectable.c) and this
 * (tests/memory_unit.c), and sets the fg_real entries of its family to fake driver functions of
 * its own, so it calls the hook's entry points directly.
 * Each case prints "ok <name>" or "FAIL <name>: <why>" and the exit status counts failures. */
#ifndef FRACGPU_MEMORY_UNIT_H
#define FRACGPU_MEMORY_UNIT_H

#include <stdio.h>

#include "graph.h"
#include "memory_internal.h"
#include "region.h"
#include "check.h"


#define MIB (1ull << 20)

/* Runs the statement after it once for each of the n entries of a table, with where naming
 * the row and the entry (for CHECK); "ok" then names the row alone. */
#define UNIT_FOR_EACH(I, N, WHERE, ROW, ENTRY_NAME)                                            \
    for (size_t I = 0; I < (N); I++)                                                           \
        if (snprintf(WHERE, sizeof WHERE, "%s [%s]", ROW, ENTRY_NAME) >= 0)

/* A scripted driver's one-shot failure: *next once (then success again), or CUDA_SUCCESS. */
static inline CUresult unit_fail_once(CUresult *next) {
    CUresult r = *next;
    *next = CUDA_SUCCESS;
    return r;
}

/* The cards: ordinals 0 and 1 are granted (limits indices 0 and 1), ordinal 2 is a card the
 * limits file does not name, and there is no ordinal 3. */
#define UNIT_UUID0 "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae00"
#define UNIT_UUID1 "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae01"
#define UNIT_UUID2 "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae02"
#define UNIT_CARDS 3

/* The calling thread's current context: its device (-1: no context) and handle. */
extern CUdevice unit_device;
extern CUcontext unit_context;
/* What fg_log printed: how many lines, and the last. */
extern int unit_logs;
extern char unit_last_log[512];
/* Releases of more bytes than the card had charged (the real region clamps them at zero). */
extern int unit_underflows;
/* The stream fg_graph_capturing answers true for, and the bytes fg_graph_captured got for it. */
extern CUstream unit_capturing;
extern uint64_t unit_captured;

/* A fresh start for a case: mode and limit set, the region at zero, every memory table empty
 * (fg_memory_after_fork), current context 1 on ordinal 0, nothing capturing, no log lines. */
void unit_reset(fg_mode mode, uint64_t limit);
/* What the container has charged on card index idx. */
uint64_t unit_used(int idx);

#endif
