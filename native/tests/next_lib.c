/* A library that wraps a libc function with dlsym(RTLD_NEXT), as many tools do: under the hook's
 * dlsym wrapper it must still get libc's function, not its own. */
#include <dlfcn.h>
#include <stdlib.h>

__attribute__((visibility("default"))) int abs(int x) {
    int (*next)(int) = (int (*)(int))dlsym(RTLD_NEXT, "abs");
    if (!next || next == abs) return -12345; /* resolving to itself would recurse forever */
    return next(x) + 1000;
}
