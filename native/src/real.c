/* The table of real entry points (see real.h): a name and the fg_real slot it fills. The
 * interposer (interpose.c) has a table of its own, of the replaced names only, that pairs each
 * slot with the hook's function; this one is what the start (state.c) needs, and it names
 * nothing above it. */
#include "real.h"

#include "dl.h"

fg_real_fns fg_real;

#define FG_CUDA_ENTRY(n) {#n, (void **)&fg_real.n, false},
#define FG_NVML_ENTRY(n) {#n, (void **)&fg_real.n, true},
const fg_real_entry fg_real_table[] = {
    FG_CUDA_HOOKS(FG_CUDA_ENTRY) FG_CUDA_USED(FG_CUDA_ENTRY) FG_NVML_HOOKS(FG_NVML_ENTRY)
        FG_NVML_USED(FG_NVML_ENTRY)};
const size_t fg_real_table_len = sizeof fg_real_table / sizeof fg_real_table[0];

void fg_real_resolve(void *handle, bool nvml) {
    fg_dlsym_fn d = fg_real_dlsym();
    for (size_t i = 0; i < fg_real_table_len; i++) {
        const fg_real_entry *e = &fg_real_table[i];
        if (e->nvml == nvml) *e->slot = d(handle, e->name);
    }
}
