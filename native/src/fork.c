/* After fork (see fork.h): every unit that keeps per-process state has its own reset, and this
 * calls them all, so the state at the bottom (whose start installs the handler through the
 * layer above) never names the families. */
#include "fork.h"

#include "graph.h"
#include "memory.h"
#include "region.h"
#include "state.h"
#include "throttle.h"

void fg_after_fork_child(void) {
    fg_state_after_fork();
    fg_region_after_fork();
    fg_memory_after_fork();
    fg_graph_after_fork();
    fg_throttle_after_fork();
}

void fg_child_detected(void) {
    fg_memory_after_fork();
    fg_graph_after_fork();
    fg_throttle_after_fork();
}
