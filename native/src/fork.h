/* What a child process forgets of its parent: the records, pools and controllers that describe
 * the parent's memory and launches are not the child's to settle. */
#ifndef FRACGPU_FORK_H
#define FRACGPU_FORK_H

/* The fork handler (pthread_atfork's child), in the only thread the child has: the locks other
 * threads held are reset and every per-process table emptied. */
void fg_after_fork_child(void);
/* A child the region found no fork handler ran in (a raw clone): the same, but the region has
 * already taken its own slots. */
void fg_child_detected(void);

#endif
