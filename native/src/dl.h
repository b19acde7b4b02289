/* libc's own dynamic-loader entry points. The hook exports dlsym, dlopen and dlmopen
 * (interpose.c), so a plain call to them from inside the hook would come back to the hook; every
 * layer that needs the real ones (the start in state.c, rebind.c, interpose.c) asks here. */
#ifndef FRACGPU_DL_H
#define FRACGPU_DL_H

#include <dlfcn.h>

/* The sanitizer runtime resolves its own interceptors through dlsym before its shadow memory
 * exists, so the code on that path must not be instrumented. */
#define FG_NO_SAN __attribute__((no_sanitize("address", "undefined")))

typedef void *(*fg_dlsym_fn)(void *, const char *);
typedef void *(*fg_dlopen_fn)(const char *, int);
typedef void *(*fg_dlmopen_fn)(Lmid_t, const char *, int);

/* Each found once (by version, glibc 2.34 down) and remembered; safe from any thread. */
fg_dlsym_fn fg_real_dlsym(void);
fg_dlopen_fn fg_real_dlopen(void);
fg_dlmopen_fn fg_real_dlmopen(void);

#endif
