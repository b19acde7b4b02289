/* The hook's one voice: a line on stderr. Every layer may speak, so this sits at the bottom and
 * needs nothing of the hook. */
#ifndef FRACGPU_LOG_H
#define FRACGPU_LOG_H

/* One line on stderr, prefixed "fracgpu: ", in one write(2) (a whole line, even from racing
 * threads); a longer message is cut to fit 512 bytes with its newline. */
void fg_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
