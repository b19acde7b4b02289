/* What throttle.c lends the rest of the hook (the graph launches take a token too). */
#ifndef FRACGPU_THROTTLE_H
#define FRACGPU_THROTTLE_H

/* Wait for a launch token on the current device (only called when throttling). */
void fg_throttle_acquire(void);
void fg_throttle_after_fork(void);

#endif
