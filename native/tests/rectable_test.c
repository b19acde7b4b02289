/* Unit test of the hook's record table (src/rectable.c), linked directly against it.
 * Each case prints "ok <name>" or "FAIL <name>: <why>" and the exit status counts failures. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rectable.h"
#include "check.h"

int failures;


/* n keys of kind that hash to one shard and one home slot of a 16-slot table. */
static void colliding(fg_rec_kind kind, uint64_t *out, int n, uint64_t home) {
    int found = 0;
    for (uint64_t k = 1; found < n; k++) {
        uint64_t h = fg_rec_hash(kind, k);
        if (h >> 58 == 7 && (h & 15) == home) out[found++] = k;
    }
}

static void drain(void) {
    /* Leave the table empty for the next case, whatever it holds. */
    fg_rec_after_fork();
}

static void test_colliding_keys_are_all_found(void) {
    const char *name = "colliding keys";
    uint64_t k[5];
    colliding(FG_REC_PTR, k, 5, 3);
    for (int i = 0; i < 5; i++) CHECK(name, fg_rec_put(&(fg_rec){k[i], 100u + i, 0, 0, FG_REC_PTR}));
    for (int i = 0; i < 5; i++) {
        fg_rec got;
        CHECK(name, fg_rec_get(FG_REC_PTR, k[i], &got));
        CHECK(name, got.bytes == 100u + (uint64_t)i);
    }
    CHECK(name, fg_rec_count() == 5);
    drain();
    printf("ok %s\n", name);
}

static void test_the_kind_is_part_of_the_key(void) {
    const char *name = "kind is part of the key";
    CHECK(name, fg_rec_put(&(fg_rec){42, 1, 0, 0, FG_REC_PTR}));
    CHECK(name, fg_rec_put(&(fg_rec){42, 2, 0, 0, FG_REC_VMM}));
    fg_rec got;
    CHECK(name, fg_rec_take(FG_REC_VMM, 42, &got));
    CHECK(name, got.bytes == 2);
    CHECK(name, fg_rec_take(FG_REC_PTR, 42, &got));
    CHECK(name, got.bytes == 1);
    CHECK(name, !fg_rec_take(FG_REC_PTR, 42, &got));
    drain();
    printf("ok %s\n", name);
}

static void delete_middle(const char *name, uint64_t home) {
    /* Five keys in one probe chain; taking the middle one must keep the later ones reachable
     * (a plain "mark empty" would cut the chain). With home 14 the chain wraps past slot 15. */
    uint64_t k[5];
    colliding(FG_REC_ARRAY, k, 5, home);
    for (int i = 0; i < 5; i++) CHECK(name, fg_rec_put(&(fg_rec){k[i], (uint64_t)i, 0, 0, FG_REC_ARRAY}));
    fg_rec got;
    CHECK(name, fg_rec_take(FG_REC_ARRAY, k[2], &got));
    CHECK(name, got.bytes == 2);
    CHECK(name, !fg_rec_get(FG_REC_ARRAY, k[2], &got));
    for (int i = 0; i < 5; i++) {
        if (i == 2) continue;
        CHECK(name, fg_rec_get(FG_REC_ARRAY, k[i], &got));
        CHECK(name, got.bytes == (uint64_t)i);
    }
    CHECK(name, fg_rec_count() == 4);
    CHECK(name, fg_rec_take(FG_REC_ARRAY, k[0], &got));
    CHECK(name, fg_rec_get(FG_REC_ARRAY, k[4], &got));
    drain();
    printf("ok %s\n", name);
}

static void test_growth_keeps_every_record(void) {
    const char *name = "growth 16 -> 32 -> 64 and beyond";
    /* 200 keys of one shard: the table grows from 16 slots through every power of two. */
    static uint64_t k[200];
    int n = 0;
    size_t caps_seen = 0, last_cap = 0;
    for (uint64_t key = 1; n < 200; key++) {
        if (fg_rec_hash(FG_REC_POOL, key) >> 58 != 9) continue;
        k[n] = key;
        CHECK(name, fg_rec_put(&(fg_rec){key, key * 3, 0, 0, FG_REC_POOL}));
        n++;
        size_t cap = fg_rec_shard_capacity(9);
        if (cap != last_cap) {
            caps_seen++;
            last_cap = cap;
        }
        CHECK(name, cap >= (size_t)n * 2);
    }
    CHECK(name, caps_seen >= 5); /* 16, 32, 64, 128, 256, 512 */
    for (int i = 0; i < n; i++) {
        fg_rec got;
        CHECK(name, fg_rec_take(FG_REC_POOL, k[i], &got));
        CHECK(name, got.bytes == k[i] * 3);
    }
    CHECK(name, fg_rec_count() == 0);
    drain();
    printf("ok %s\n", name);
}

static void test_a_forked_child_starts_empty(void) {
    const char *name = "reset after fork";
    CHECK(name, fg_rec_put(&(fg_rec){7, 7, 0, 0, FG_REC_PTR}));
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        fg_rec_after_fork();
        fg_rec got;
        int bad = fg_rec_count() != 0 || fg_rec_get(FG_REC_PTR, 7, &got);
        /* The table works after the reset: new mutexes, fresh shards. */
        bad |= !fg_rec_put(&(fg_rec){8, 8, 0, 0, FG_REC_PTR}) || !fg_rec_take(FG_REC_PTR, 8, &got);
        _exit(bad);
    }
    int status = -1;
    CHECK(name, waitpid(pid, &status, 0) == pid);
    CHECK(name, WIFEXITED(status) && WEXITSTATUS(status) == 0);
    fg_rec got;
    CHECK(name, fg_rec_get(FG_REC_PTR, 7, &got)); /* the parent keeps its own */
    drain();
    printf("ok %s\n", name);
}

static bool odd_bytes(const fg_rec *r, void *arg) {
    (void)arg;
    return r->bytes % 2 == 1;
}
static int taken_count;
static void count_taken(const fg_rec *r) {
    (void)r;
    taken_count++;
}

static void test_take_each_removes_what_matches_and_keeps_the_rest(void) {
    const char *name = "take each matching record";
    /* Twelve keys in one probe chain, every other one matching: removals shift the chain under
     * the scan, which must neither skip a match nor lose a survivor. */
    uint64_t k[12];
    colliding(FG_REC_PTR, k, 12, 5);
    for (int i = 0; i < 12; i++) CHECK(name, fg_rec_put(&(fg_rec){k[i], (uint64_t)i, 0, 0, FG_REC_PTR}));
    taken_count = 0;
    fg_rec_take_each(odd_bytes, NULL, count_taken);
    CHECK(name, taken_count == 6);
    for (int i = 0; i < 12; i++) {
        fg_rec got;
        CHECK(name, fg_rec_get(FG_REC_PTR, k[i], &got) == (i % 2 == 0));
    }
    drain();
    printf("ok %s\n", name);
}

#define THREADS 8
#define ROUNDS 20000
static int thread_errors[THREADS];

static void *churn(void *arg) {
    int t = (int)(intptr_t)arg;
    /* Each thread owns its keys; 64 live at a time, so shards grow and shrink under contention. */
    uint64_t base = (uint64_t)(t + 1) << 40;
    for (int r = 0; r < ROUNDS; r++) {
        uint64_t key = base + (uint64_t)r;
        if (!fg_rec_put(&(fg_rec){key, key, 0, t, FG_REC_PTR})) thread_errors[t]++;
        if (r >= 64) {
            fg_rec got;
            uint64_t old = base + (uint64_t)(r - 64);
            if (!fg_rec_take(FG_REC_PTR, old, &got) || got.bytes != old || got.dev != t)
                thread_errors[t]++;
        }
    }
    for (int r = ROUNDS - 64; r < ROUNDS; r++) {
        fg_rec got;
        if (!fg_rec_take(FG_REC_PTR, base + (uint64_t)r, &got)) thread_errors[t]++;
    }
    return NULL;
}

static void test_threads_put_and_take(void) {
    const char *name = "8 threads put and take";
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, churn, (void *)(intptr_t)t);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < THREADS; t++) CHECK(name, thread_errors[t] == 0);
    CHECK(name, fg_rec_count() == 0);
    drain();
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_colliding_keys_are_all_found();
    test_the_kind_is_part_of_the_key();
    delete_middle("delete from the middle of a probe chain", 3);
    delete_middle("delete from the middle of a chain that wraps", 14);
    test_growth_keeps_every_record();
    test_a_forked_child_starts_empty();
    test_take_each_removes_what_matches_and_keeps_the_rest();
    test_threads_put_and_take();
    return failures;
}
