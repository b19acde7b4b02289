/* What each live allocation of this process charged, keyed by kind and pointer or handle.
 *
 * A per-process table, sharded so that threads allocating at once rarely meet on one mutex:
 * 64 shards, each an open-addressing table with linear probing and backward-shift deletion (no
 * tombstones, so a long-lived process that allocates and frees forever never degrades). The
 * kind is part of the key: a device pointer and a VMM handle with the same value are different
 * records. */
#ifndef FRACGPU_RECTABLE_H
#define FRACGPU_RECTABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What a record stands for; the value 0 is reserved for "empty slot". */
typedef enum {
    FG_REC_PTR = 1,   /* cuMemAlloc_v2, cuMemAllocManaged, cuMemAllocPitch_v2; aux: context */
    FG_REC_PTR_V1,    /* the 32-bit legacy cuMemAlloc / cuMemAllocPitch; aux: context */
    FG_REC_POOL,      /* stream-ordered allocation (charged through its pool) */
    FG_REC_VMM,       /* cuMemCreate handle; aux counts its live mappings */
    FG_REC_ARRAY,     /* cuArrayCreate / cuArray3DCreate (v1 and v2) */
    FG_REC_MIPMAP,    /* cuMipmappedArrayCreate */
    FG_REC_MODULE,    /* a loaded module's device globals */
    FG_REC_LIBRARY,   /* a loaded library's device globals (CUDA 12 cuLibrary*) */
    FG_REC_GRAPH_EXEC, /* an instantiated graph's memory-node bytes */
    FG_REC_GRAPH,      /* a graph's memory-node bytes, as added or captured into it */
    FG_REC_CAPTURE     /* a capturing stream's cuMemAllocAsync bytes so far */
} fg_rec_kind;

typedef struct {
    uint64_t key;   /* pointer or handle */
    uint64_t bytes; /* what was charged */
    uint64_t aux;   /* kind-specific: the pool, a reference count */
    int32_t dev;    /* card index in the limits file */
    int32_t kind;   /* fg_rec_kind; 0 marks an empty slot */
} fg_rec;

#define FG_REC_SHARDS 64

/* Insert or replace the record (kind, key). false: no memory for the table. */
bool fg_rec_put(const fg_rec *r);
/* Remove the record (kind, key) into *out; false when there is none. */
bool fg_rec_take(fg_rec_kind kind, uint64_t key, fg_rec *out);
/* Copy the record (kind, key) into *out without removing it. */
bool fg_rec_get(fg_rec_kind kind, uint64_t key, fg_rec *out);
/* Remove every record match accepts, handing each to taken (under the shard's lock). */
void fg_rec_take_each(bool (*match)(const fg_rec *, void *), void *match_arg,
                      void (*taken)(const fg_rec *));
/* In a forked child: the parent's records are not the child's, and only the forking thread
 * survived, so every shard starts empty with a fresh mutex. */
void fg_rec_after_fork(void);

/* For the unit test: which shard and home slot a key hashes to, and a shard's size. */
uint64_t fg_rec_hash(fg_rec_kind kind, uint64_t key);
size_t fg_rec_shard_capacity(size_t shard);
size_t fg_rec_count(void);

#endif
