#include "rectable.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    pthread_mutex_t mu;
    fg_rec *slots;
    size_t cap, len; /* cap is 0 or a power of two >= 16; len <= cap / 2 */
    char pad[64];    /* one shard per cache line pair: no false sharing between shards */
} fg_shard;

static fg_shard shards[FG_REC_SHARDS];
static pthread_once_t shards_once = PTHREAD_ONCE_INIT;

static void shards_init(void) {
    for (int i = 0; i < FG_REC_SHARDS; i++) pthread_mutex_init(&shards[i].mu, NULL);
}

uint64_t fg_rec_hash(fg_rec_kind kind, uint64_t key) {
    uint64_t x = key ^ ((uint64_t)kind * 0x9e3779b97f4a7c15ULL);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* The shard comes from the top bits and the home slot from the low ones, so that the keys of
 * one shard still spread over all of its slots. */
static fg_shard *shard_of(uint64_t h) { return &shards[h >> 58]; }
static size_t home_of(uint64_t h, size_t mask) { return (size_t)h & mask; }

static bool same(const fg_rec *s, int32_t kind, uint64_t key) {
    return s->kind == kind && s->key == key;
}

static size_t find_slot(const fg_shard *s, int32_t kind, uint64_t key, uint64_t h) {
    size_t mask = s->cap - 1, i = home_of(h, mask);
    while (s->slots[i].kind && !same(&s->slots[i], kind, key)) i = (i + 1) & mask;
    return i;
}

static bool grow(fg_shard *s) {
    size_t ncap = s->cap ? s->cap * 2 : 16;
    fg_rec *n = calloc(ncap, sizeof *n);
    if (!n) return false;
    for (size_t i = 0; i < s->cap; i++) {
        const fg_rec *r = &s->slots[i];
        if (!r->kind) continue;
        size_t j = home_of(fg_rec_hash((fg_rec_kind)r->kind, r->key), ncap - 1);
        while (n[j].kind) j = (j + 1) & (ncap - 1);
        n[j] = *r;
    }
    free(s->slots);
    s->slots = n;
    s->cap = ncap;
    return true;
}

bool fg_rec_put(const fg_rec *r) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = fg_rec_hash((fg_rec_kind)r->kind, r->key);
    fg_shard *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    bool ok = (s->len + 1) * 2 <= s->cap || grow(s);
    if (ok) {
        size_t i = find_slot(s, r->kind, r->key, h);
        if (!s->slots[i].kind) s->len++;
        s->slots[i] = *r;
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

/* Backward-shift deletion: after emptying slot i, walk the chain that follows it and move back
 * each record whose home does not lie strictly between the hole and its current place, so
 * every remaining record stays reachable from its home without tombstones. */
static void remove_at(fg_shard *s, size_t i) {
    size_t mask = s->cap - 1, j = i;
    for (;;) {
        s->slots[i].kind = 0;
        for (;;) {
            j = (j + 1) & mask;
            if (!s->slots[j].kind) {
                s->len--;
                return;
            }
            size_t home = home_of(fg_rec_hash((fg_rec_kind)s->slots[j].kind, s->slots[j].key),
                                  mask);
            bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) break;
        }
        s->slots[i] = s->slots[j];
        i = j;
    }
}

static bool lookup(fg_rec_kind kind, uint64_t key, fg_rec *out, bool take) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = fg_rec_hash(kind, key);
    fg_shard *s = shard_of(h);
    bool found = false;
    pthread_mutex_lock(&s->mu);
    if (s->cap) {
        size_t i = find_slot(s, (int32_t)kind, key, h);
        if (s->slots[i].kind) {
            *out = s->slots[i];
            found = true;
            if (take) remove_at(s, i);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return found;
}

bool fg_rec_take(fg_rec_kind kind, uint64_t key, fg_rec *out) {
    return lookup(kind, key, out, true);
}

bool fg_rec_get(fg_rec_kind kind, uint64_t key, fg_rec *out) {
    return lookup(kind, key, out, false);
}

void fg_rec_take_each(bool (*match)(const fg_rec *, void *), void *match_arg,
                      void (*taken)(const fg_rec *)) {
    pthread_once(&shards_once, shards_init);
    for (int k = 0; k < FG_REC_SHARDS; k++) {
        fg_shard *s = &shards[k];
        pthread_mutex_lock(&s->mu);
        /* A removal shifts a later record into the emptied slot: look at the slot again. */
        for (size_t i = 0; i < s->cap;) {
            if (s->slots[i].kind && match(&s->slots[i], match_arg)) {
                fg_rec r = s->slots[i];
                remove_at(s, i);
                taken(&r);
            } else {
                i++;
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
}

void fg_rec_after_fork(void) {
    for (int i = 0; i < FG_REC_SHARDS; i++) {
        pthread_mutex_init(&shards[i].mu, NULL);
        free(shards[i].slots);
        shards[i].slots = NULL;
        shards[i].cap = shards[i].len = 0;
    }
}

size_t fg_rec_shard_capacity(size_t shard) {
    return shard < FG_REC_SHARDS ? shards[shard].cap : 0;
}

size_t fg_rec_count(void) {
    pthread_once(&shards_once, shards_init);
    size_t n = 0;
    for (int i = 0; i < FG_REC_SHARDS; i++) {
        pthread_mutex_lock(&shards[i].mu);
        n += shards[i].len;
        pthread_mutex_unlock(&shards[i].mu);
    }
    return n;
}
