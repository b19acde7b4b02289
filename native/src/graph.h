/* What graph.c lends the rest of the hook: its reset after fork, and the capture state the
 * stream-ordered allocations (memory_pool.c) consult. */
#ifndef FRACGPU_GRAPH_H
#define FRACGPU_GRAPH_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_api.h"

void fg_graph_after_fork(void);
/* A stream-ordered allocation of bytes on stream s: recorded if s is capturing. */
void fg_graph_captured(CUstream s, uint64_t bytes);
/* Whether s is being captured (begun through the hook). While it is, the hook makes no driver
 * query of its own for s's allocations: a query may invalidate the capture (seen on an H200 with
 * PyTorch's cudaMallocAsync backend), and what the capture allocates is charged when the graph
 * is instantiated and launched. */
bool fg_graph_capturing(CUstream s);

#endif
