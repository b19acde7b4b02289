/* fg_log (see log.h): formatted on the stack and written with write(2), not through stdio: the
 * stderr stream, its buffer and its lock are the program's, and the hook runs inside its calls. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

void fg_log(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "fracgpu: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf);
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}
