/* Makes the driver's entry points lead to the hook whatever order the libraries are in.
 *
 * Preloading wins symbol lookups only when the hook comes first; a library preloaded before it,
 * a library opened with RTLD_DEEPBIND (which looks in its own dependencies first) or one opened
 * in another link-map namespace with dlmopen would reach libcuda directly. So, besides
 * exporting the driver's names, the hook edits what the dynamic linker reads:
 *  - in every loaded copy of the driver, the dynamic symbol table entries of the names it
 *    replaces point at the hook (lookups made from then on, from any scope, find the hook);
 *  - in every other object, the GOT slots already bound to such a name point at the hook
 *    (bindings made before the hook started);
 *  - a new dlmopen namespace is given the driver before anything else, and that copy's entry
 *    points all lead to the driver of the main namespace, through the hook. */
#ifndef FRACGPU_REBIND_H
#define FRACGPU_REBIND_H

#include <stdbool.h>
#include <stddef.h>

/* name -> the hook's function, or NULL for a name the hook does not replace. */
typedef void *(*fg_hook_lookup)(const char *name);

/* Point the dynamic symbols of the object holding handle's entry points at the hook. */
int fg_rebind_driver(void *handle, fg_hook_lookup hook_of);
/* Point every loaded object's GOT slots bound to a replaced name at the hook; skip is the
 * hook's own object. */
int fg_rebind_bound(fg_hook_lookup hook_of, const void *skip);
/* In the namespace of handle (another than the main one), lead every exported function of the
 * objects that define forward_name to the same name in main_handle (the main namespace's
 * copy), and every "dlmopen" to the one given. */
int fg_rebind_namespace(void *handle, void *main_handle, const char *forward_name,
                        void *dlmopen_fn);

#endif
