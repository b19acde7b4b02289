#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A zero-filled file is a valid empty region, so creation needs no lock and start-up never
 * serialises: the first process to map it stamps the magic with a compare-and-swap. */
#define FG_LIKELY_SLOT(x) __builtin_expect(!!(x), 1)
#define FG_REGION_MAGIC 0x6672616367707531ULL /* "fracgpu1" */

typedef struct {
    _Atomic int32_t pid;        /* 0 free; >0 owner; <0 being reclaimed by -pid */
    int32_t pad;
    _Atomic uint64_t starttime; /* owner's start time (clock ticks since boot) */
    _Atomic uint64_t used[FRACGPU_MAX_DEVICES];
    char cacheline_pad[48];
} fg_slot;

typedef struct {
    _Atomic uint64_t magic;
    _Atomic uint32_t high_water; /* slots [0, high_water) have ever been used */
    uint32_t nslots;
    char pad[48];
    fg_slot slots[FG_REGION_SLOTS];
} fg_region;

static fg_region *region;
static _Atomic int my_slot = -1;
/* Set at exit: frees that run after the slot was given back must not touch a new one. */
static _Atomic bool closed;

static uint64_t start_time_of(int32_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    /* Field 22; fields after the command name (which may hold spaces) start after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ') field++;
    uint64_t v = 0;
    for (; *p >= '0' && *p <= '9'; p++) v = v * 10 + (uint64_t)(*p - '0');
    return v;
}

/* Alive means: the pid exists and is the same process (pid reuse is told apart by start time). */
static bool alive(int32_t pid, uint64_t starttime, bool thorough) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    /* A start time of 0 is a slot being taken right now (stamped just after the pid): alive. */
    if (!thorough || starttime == 0) return true;
    uint64_t now = start_time_of(pid);
    return now == 0 ? true : now == starttime;
}

static void zero_slot(fg_slot *s) {
    for (int d = 0; d < FRACGPU_MAX_DEVICES; d++) atomic_store(&s->used[d], 0);
}

int fg_region_reap(bool thorough) {
    if (!region) return 0;
    int reaped = 0;
    int32_t me = (int32_t)getpid();
    uint32_t hw = atomic_load(&region->high_water);
    for (uint32_t i = 0; i < hw && i < FG_REGION_SLOTS; i++) {
        fg_slot *s = &region->slots[i];
        int32_t pid = atomic_load(&s->pid);
        if (pid == 0 || pid == me || pid == -me) continue;
        if (pid > 0 && alive(pid, atomic_load(&s->starttime), thorough)) continue;
        /* A reclaimer that died mid-way leaves -pid; anyone may take over from a dead one. */
        if (pid < 0 && kill(-pid, 0) == 0) continue;
        if (!atomic_compare_exchange_strong(&s->pid, &pid, -me)) continue;
        zero_slot(s);
        atomic_store(&s->starttime, 0);
        atomic_store(&s->pid, 0);
        reaped++;
    }
    return reaped;
}

static int take_slot(void) {
    int32_t me = (int32_t)getpid();
    uint64_t st = start_time_of(me);
    for (int attempt = 0; attempt < 2; attempt++) {
        for (int i = 0; i < FG_REGION_SLOTS; i++) {
            fg_slot *s = &region->slots[i];
            int32_t expected = 0;
            if (atomic_load(&s->pid) != 0) continue;
            if (!atomic_compare_exchange_strong(&s->pid, &expected, me)) continue;
            zero_slot(s);
            atomic_store(&s->starttime, st);
            uint32_t hw = atomic_load(&region->high_water);
            while (hw < (uint32_t)i + 1 &&
                   !atomic_compare_exchange_weak(&region->high_water, &hw, (uint32_t)i + 1)) {
            }
            return i;
        }
        fg_region_reap(true);
    }
    return -1;
}

int fg_region_open(const char *path, char *why, size_t why_len) {
    if (region) return 0;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0) {
        int e = errno;
        snprintf(why, why_len, "cannot open %s: %s", path, strerror(e));
        return -e;
    }
    /* Every process of the container, whatever its uid, must be able to join. */
    (void)fchmod(fd, 0666);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(why, why_len, "%s is not a regular file", path);
        return -EINVAL;
    }
    if ((size_t)st.st_size < sizeof(fg_region) && ftruncate(fd, sizeof(fg_region)) != 0) {
        int e = errno;
        close(fd);
        snprintf(why, why_len, "cannot size %s: %s", path, strerror(e));
        return -e;
    }
    void *m = mmap(NULL, sizeof(fg_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        int e = errno;
        snprintf(why, why_len, "cannot map %s: %s", path, strerror(e));
        return -e;
    }
    fg_region *r = m;
    uint64_t magic = 0;
    if (!atomic_compare_exchange_strong(&r->magic, &magic, FG_REGION_MAGIC) &&
        magic != FG_REGION_MAGIC) {
        munmap(m, sizeof(fg_region));
        snprintf(why, why_len, "%s has an unknown layout (magic %llx)", path,
                 (unsigned long long)magic);
        return -EPROTO;
    }
    region = r;
    /* Return the shares of processes that died (SIGKILL, OOM kill) since anyone last looked.
     * One kill(pid, 0) per slot: cheap enough for every start-up. Telling a reused pid apart
     * needs /proc reads, left to the slow path (a charge that does not fit). */
    fg_region_reap(false);
    int slot = take_slot();
    if (slot < 0) {
        region = NULL;
        munmap(m, sizeof(fg_region));
        snprintf(why, why_len, "%s has no free slot (%d live processes)", path, FG_REGION_SLOTS);
        return -ENOSPC;
    }
    atomic_store(&my_slot, slot);
    return 0;
}

static fg_slot *own(void) {
    int s = atomic_load_explicit(&my_slot, memory_order_relaxed);
    if (FG_LIKELY_SLOT(s >= 0)) return &region->slots[s];
    if (atomic_load(&closed)) return NULL;
    /* A forked child takes its own slot on first use. */
    s = take_slot();
    if (s < 0) return NULL;
    atomic_store(&my_slot, s);
    return &region->slots[s];
}

void fg_region_after_fork(void) { atomic_store(&my_slot, -1); }

void fg_region_close(void) {
    atomic_store(&closed, true);
    int s = atomic_exchange(&my_slot, -1);
    if (!region || s < 0) return;
    fg_slot *slot = &region->slots[s];
    zero_slot(slot);
    atomic_store(&slot->starttime, 0);
    atomic_store(&slot->pid, 0);
}

uint64_t fg_region_used(int dev) {
    if (!region || dev < 0 || dev >= FRACGPU_MAX_DEVICES) return 0;
    uint64_t sum = 0;
    uint32_t hw = atomic_load(&region->high_water);
    for (uint32_t i = 0; i < hw && i < FG_REGION_SLOTS; i++)
        sum += atomic_load(&region->slots[i].used[dev]);
    return sum;
}

bool fg_region_charge(int dev, uint64_t bytes, uint64_t limit) {
    if (!region || dev < 0 || dev >= FRACGPU_MAX_DEVICES || bytes > limit) return false;
    fg_slot *s = own();
    if (!s) return false;
    /* Add first, then look: of two racing charges at least the later one sees both, so the sum
     * never passes the limit. Both may fail; then back off and retry a few times, and reap dead
     * processes once, before saying out of memory. */
    for (int attempt = 0; attempt < 4; attempt++) {
        atomic_fetch_add(&s->used[dev], bytes);
        if (fg_region_used(dev) <= limit) return true;
        atomic_fetch_sub(&s->used[dev], bytes);
        if (attempt == 0 && fg_region_reap(true) > 0) continue;
        sched_yield();
    }
    return false;
}

void fg_region_force(int dev, uint64_t bytes) {
    if (!region || dev < 0 || dev >= FRACGPU_MAX_DEVICES) return;
    fg_slot *s = own();
    if (s) atomic_fetch_add(&s->used[dev], bytes);
}

void fg_region_release(int dev, uint64_t bytes) {
    if (!region || dev < 0 || dev >= FRACGPU_MAX_DEVICES) return;
    fg_slot *s = own();
    if (s) atomic_fetch_sub(&s->used[dev], bytes);
}
