#include "region.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* A zero-filled file is a valid empty region, so creation needs no lock and start-up never
 * serialises: the first process to map it stamps the magic with a compare-and-swap. */
#define FG_LIKELY_SLOT(x) __builtin_expect(!!(x), 1)
#define FG_REGION_MAGIC 0x6672616367707532ULL    /* "fracgpu2" */
#define FG_REGION_STAMPING 0x7374616d70696e67ULL /* a reset is being taken stock of */
#define FG_MAX_REGIONS 8

typedef struct {
    _Atomic int32_t pid;      /* the owner's pid in its own namespace: for people, not for us */
    _Atomic uint32_t pending; /* 1: a reset zeroed this live slot and its owner has not refilled it */
    _Atomic uint64_t gen;     /* the region generation the counters were written for */
    _Atomic uint64_t used[FRACGPU_MAX_DEVICES];
    char cacheline_pad[48];
} fg_slot;

typedef struct {
    _Atomic uint64_t magic;
    _Atomic uint32_t high_water; /* slots [0, high_water) have ever been used */
    _Atomic uint32_t npending;   /* live slots a reset zeroed, not yet refilled */
    _Atomic uint64_t gen;        /* changes at every reset (truncation) of the region */
    _Atomic uint32_t joined;     /* some process also takes part in another region file */
    char pad[36];
    fg_slot slots[FG_REGION_SLOTS];
} fg_region;

/* One region this process takes part in: normally just the file at the path; more when the
 * file was removed and recreated while processes still held the old one (each found through
 * /proc and charged alike, so any two processes of the container share at least one). */
typedef struct {
    fg_region *r;
    int fd;        /* this process's own open file description: its slot lock lives there */
    int slot;      /* -1: none yet (a forked child takes one on first use) */
} fg_map;

static fg_map maps[FG_MAX_REGIONS];
static _Atomic int nmaps;
/* What this process has charged per card: the truth its slots are refilled from after a reset. */
static _Atomic uint64_t shadow[FRACGPU_MAX_DEVICES];
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic bool need_slots; /* after fork: take fresh slots through fresh descriptions */
/* Set at exit: frees that run after the slots were given back must not touch new ones. */
static _Atomic bool closed;
/* Whom to tell of a child no fork handler ran in (fg_region_open); set before any slot exists. */
static void (*child_detected)(void);

/* ---- slot locks: liveness that pid namespaces, zombies and reused pids cannot fool ---------- */

/* Each live process holds an open-file-description lock on one byte per slot it owns. The kernel
 * drops it when the last descriptor of that description closes, i.e. when the process (and any
 * child sharing the description) is gone, whatever namespace looks at it. */
static off_t slot_offset(int i) {
    return (off_t)(offsetof(fg_region, slots) + (size_t)i * sizeof(fg_slot));
}

static struct flock slot_range(int i, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = slot_offset(i);
    fl.l_len = 1;
    return fl;
}

static int slot_lock(int fd, int i, short type) {
    struct flock fl = slot_range(i, type);
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Whether another open file description holds slot i (without taking it). */
static bool slot_held(int fd, int i) {
    struct flock fl = slot_range(i, F_WRLCK);
    return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

static void zero_slot(fg_slot *s) {
    for (int d = 0; d < FRACGPU_MAX_DEVICES; d++) atomic_store(&s->used[d], 0);
}

static void bump_high_water(fg_region *r, uint32_t n) {
    uint32_t hw = atomic_load(&r->high_water);
    while (hw < n && !atomic_compare_exchange_weak(&r->high_water, &hw, n)) {
    }
}

/* The slot of a dead owner is zeroed by whoever gets its lock; a slot another process holds
 * is left alone. */
static int reap_map(fg_map *m) {
    int reaped = 0;
    uint32_t hw = atomic_load(&m->r->high_water);
    for (uint32_t i = 0; i < hw && i < FG_REGION_SLOTS; i++) {
        fg_slot *s = &m->r->slots[i];
        if ((int)i == m->slot) continue;
        bool any = atomic_load(&s->pid) != 0 || atomic_load(&s->pending) != 0;
        for (int d = 0; !any && d < FRACGPU_MAX_DEVICES; d++) any = atomic_load(&s->used[d]) != 0;
        if (!any || slot_lock(m->fd, (int)i, F_WRLCK) != 0) continue;
        zero_slot(s);
        atomic_store(&s->pid, 0);
        uint32_t one = 1;
        if (atomic_compare_exchange_strong(&s->pending, &one, 0)) atomic_fetch_sub(&m->r->npending, 1);
        slot_lock(m->fd, (int)i, F_UNLCK);
        reaped++;
    }
    return reaped;
}

int fg_region_reap(bool thorough) {
    (void)thorough;
    int reaped = 0, n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++) reaped += reap_map(&maps[k]);
    return reaped;
}

static void fill_slot(fg_map *m) {
    fg_slot *s = &m->r->slots[m->slot];
    for (int d = 0; d < FRACGPU_MAX_DEVICES; d++) atomic_store(&s->used[d], atomic_load(&shadow[d]));
    atomic_store(&s->gen, atomic_load(&m->r->gen));
}

static int take_slot(fg_map *m) {
    for (int i = 0; i < FG_REGION_SLOTS; i++) {
        if (slot_lock(m->fd, i, F_WRLCK) != 0) continue;
        fg_slot *s = &m->r->slots[i];
        uint32_t one = 1;
        if (atomic_compare_exchange_strong(&s->pending, &one, 0)) atomic_fetch_sub(&m->r->npending, 1);
        m->slot = i;
        fill_slot(m); /* a dead owner's counters go; this process's own come in */
        atomic_store(&s->pid, (int32_t)getpid());
        bump_high_water(m->r, (uint32_t)i + 1);
        return i;
    }
    return -1;
}

/* ---- truncation: no SIGBUS, and no share granted twice -------------------------------------- */

static struct sigaction previous_bus;
static _Atomic bool bus_installed;

/* A truncated region faults on the next access. The file is given its size back (zeros), so the
 * access goes on; the zeroed content is then taken stock of (see settle_reset). Faults elsewhere
 * go to whatever handled SIGBUS before. */
static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    int n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++) {
        char *base = (char *)maps[k].r;
        if ((char *)si->si_addr >= base && (char *)si->si_addr < base + sizeof(fg_region)) {
            if (ftruncate(maps[k].fd, sizeof(fg_region)) == 0) return;
        }
    }
    if ((previous_bus.sa_flags & SA_SIGINFO) && previous_bus.sa_sigaction) {
        previous_bus.sa_sigaction(sig, si, uc);
    } else if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(sig);
    } else {
        signal(SIGBUS, SIG_DFL); /* the fault comes again and takes its default course */
    }
}

static void install_sigbus(void) {
    bool expected = false;
    if (!atomic_compare_exchange_strong(&bus_installed, &expected, true)) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &previous_bus);
}

/* After a truncation every counter reads 0 while the memory is still on the card. The first
 * process to notice marks every slot whose lock is held as pending; each owner refills its slot
 * from its own record on its next charge or release; until all have, nobody is granted memory. */
static void settle_reset(fg_map *m) {
    fg_region *r = m->r;
    uint64_t magic = 0;
    if (atomic_compare_exchange_strong(&r->magic, &magic, FG_REGION_STAMPING)) {
        uint32_t hw = 0;
        /* Count a slot before marking it: its owner may clear the mark at once (taking its
         * slot does), and a count stored after the marks would then never come back to 0. */
        atomic_store(&r->npending, 0);
        for (int i = 0; i < FG_REGION_SLOTS; i++) {
            if (i == m->slot || !slot_held(m->fd, i)) continue;
            atomic_fetch_add(&r->npending, 1);
            atomic_store(&r->slots[i].pending, 1);
            hw = (uint32_t)i + 1;
        }
        if (m->slot >= 0 && (uint32_t)m->slot + 1 > hw) hw = (uint32_t)m->slot + 1;
        bump_high_water(r, hw);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        atomic_store(&r->gen, ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) | 1);
        atomic_store(&r->magic, FG_REGION_MAGIC);
    }
    for (int spin = 0; spin < 1000 && atomic_load(&r->magic) != FG_REGION_MAGIC; spin++)
        sched_yield();
    if (m->slot < 0 || atomic_load(&r->magic) != FG_REGION_MAGIC) return;
    fg_slot *s = &r->slots[m->slot];
    if (atomic_load(&s->gen) != atomic_load(&r->gen)) {
        fill_slot(m);
        atomic_store(&s->pid, (int32_t)getpid());
    }
    uint32_t one = 1;
    if (atomic_compare_exchange_strong(&s->pending, &one, 0)) atomic_fetch_sub(&r->npending, 1);
}

static bool current(const fg_map *m) {
    const fg_region *r = m->r;
    return FG_LIKELY_SLOT(atomic_load_explicit(&r->magic, memory_order_acquire) == FG_REGION_MAGIC &&
                          atomic_load_explicit(&r->slots[m->slot].gen, memory_order_relaxed) ==
                              atomic_load_explicit(&r->gen, memory_order_relaxed));
}

/* ---- opening ---------------------------------------------------------------------------- */

static int map_fd(int fd, fg_region **out, char *why, size_t why_len, const char *path) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(why, why_len, "%s is not a regular file", path);
        return -EINVAL;
    }
    if ((size_t)st.st_size < sizeof(fg_region) && ftruncate(fd, sizeof(fg_region)) != 0) {
        int e = errno;
        snprintf(why, why_len, "cannot size %s: %s", path, strerror(e));
        return -e;
    }
    void *p = mmap(NULL, sizeof(fg_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        snprintf(why, why_len, "cannot map %s: %s", path, strerror(e));
        return -e;
    }
    fg_region *r = p;
    /* A zero magic (a new file, or one truncated under its holders) is stamped by settle_reset,
     * which first takes stock of the slots whose owners are still alive. */
    uint64_t magic = atomic_load(&r->magic);
    if (magic != 0 && magic != FG_REGION_MAGIC && magic != FG_REGION_STAMPING) {
        munmap(p, sizeof(fg_region));
        snprintf(why, why_len, "%s has an unknown layout (magic %llx)", path,
                 (unsigned long long)magic);
        return -EPROTO;
    }
    *out = r;
    return 0;
}

static bool have_inode(dev_t dev, ino_t ino) {
    int n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++) {
        struct stat st;
        if (fstat(maps[k].fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino) return true;
    }
    return false;
}

static bool add_map(int fd, const char *path, char *why, size_t why_len) {
    int k = atomic_load(&nmaps);
    if (k == FG_MAX_REGIONS) return false;
    fg_region *r = NULL;
    if (map_fd(fd, &r, why, why_len, path) != 0) return false;
    maps[k] = (fg_map){r, fd, -1};
    if (take_slot(&maps[k]) < 0) {
        munmap(r, sizeof(fg_region));
        snprintf(why, why_len, "%s has no free slot (%d live processes)", path, FG_REGION_SLOTS);
        return false;
    }
    if (!current(&maps[k])) settle_reset(&maps[k]);
    atomic_store(&nmaps, k + 1);
    return true;
}

/* The accounting file may have been removed (or renamed) while processes of the container
 * still hold it: the path then names a new, empty file. Any region file another visible
 * process holds open is joined too. Regions are found by the name the file had, "(deleted)" or
 * not; a decoy only costs its maker a second charge. */
static void join_held_regions(const char *path) {
    DIR *proc = opendir("/proc");
    if (!proc) return;
    size_t plen = strlen(path);
    struct dirent *p;
    while ((p = readdir(proc)) != NULL) {
        if (p->d_name[0] < '0' || p->d_name[0] > '9') continue;
        char dir[300];
        snprintf(dir, sizeof dir, "/proc/%.32s/fd", p->d_name);
        DIR *fds = opendir(dir);
        if (!fds) continue;
        struct dirent *f;
        while ((f = readdir(fds)) != NULL) {
            if (f->d_name[0] < '0' || f->d_name[0] > '9') continue;
            char link[360], target[4096];
            snprintf(link, sizeof link, "%s/%.32s", dir, f->d_name);
            ssize_t n = readlink(link, target, sizeof target - 1);
            if (n < (ssize_t)plen || memcmp(target, path, plen) != 0) continue;
            target[n] = '\0';
            if (target[plen] != '\0' && strcmp(target + plen, " (deleted)") != 0) continue;
            struct stat st;
            if (stat(link, &st) != 0 || have_inode(st.st_dev, st.st_ino)) continue;
            int fd = open(link, O_RDWR | O_CLOEXEC);
            char why[256];
            if (fd >= 0 && !add_map(fd, path, why, sizeof why)) close(fd);
        }
        closedir(fds);
    }
    closedir(proc);
}

static void mark_lineage(void);

int fg_region_open(const char *path, void (*on_child)(void), char *why, size_t why_len) {
    if (atomic_load(&nmaps) > 0) return 0;
    child_detected = on_child;
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    bool created = fd >= 0;
    if (!created && errno == EEXIST) fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        int e = errno;
        snprintf(why, why_len, "cannot open %s: %s", path, strerror(e));
        return -e;
    }
    /* Every process of the container, whatever its uid, must be able to join. */
    (void)fchmod(fd, 0666);
    install_sigbus();
    if (!add_map(fd, path, why, why_len)) {
        close(fd);
        return -EINVAL;
    }
    mark_lineage();
    /* Looking through /proc is for a file that was removed while held: the process that
     * creates its successor looks, and marks it joined so that every later one looks too. */
    if (created || atomic_load(&maps[0].r->joined)) join_held_regions(path);
    int n = atomic_load(&nmaps);
    for (int k = 0; n > 1 && k < n; k++) atomic_store(&maps[k].r->joined, 1);
    /* Return the shares of processes that died (SIGKILL, OOM kill) since anyone last looked. */
    fg_region_reap(true);
    return 0;
}

/* ---- this process's slots ------------------------------------------------------------------- */

/* A page the kernel zeroes in every child that does not share this memory (fork, vfork-less
 * clone, a raw clone system call alike): a child knows it is one from a single load, with no
 * system call and no fork handler. */
static _Atomic uint64_t *lineage;

static void mark_lineage(void) {
    if (!lineage) {
        void *p = mmap(NULL, (size_t)sysconf(_SC_PAGESIZE), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED || madvise(p, (size_t)sysconf(_SC_PAGESIZE), MADV_WIPEONFORK) != 0)
            return;
        lineage = p;
    }
    atomic_store(lineage, 1);
}

static bool a_child_of_the_owner(void) {
    return lineage && atomic_load_explicit(lineage, memory_order_relaxed) == 0;
}

/* A forked child gets its own open file descriptions (the parent's locks are the parent's) and
 * its own slots; so does a child made by a raw clone, which ran no fork handler and finds out
 * from the lineage page on its first charge or release. */
static bool own_slots(void) {
    if (FG_LIKELY_SLOT(!atomic_load_explicit(&need_slots, memory_order_relaxed))) {
        if (FG_LIKELY_SLOT(!a_child_of_the_owner())) return atomic_load(&nmaps) > 0;
        /* A child no fork handler told: what its parent recorded is not its own to free. */
        if (child_detected) child_detected();
        atomic_store(&need_slots, true);
    }
    if (atomic_load(&closed)) return false;
    pthread_mutex_lock(&slot_mu);
    bool ok = true;
    if (atomic_load(&need_slots)) {
        for (int d = 0; d < FRACGPU_MAX_DEVICES; d++) atomic_store(&shadow[d], 0);
        int n = atomic_load(&nmaps);
        for (int k = 0; k < n; k++) {
            char self[64];
            snprintf(self, sizeof self, "/proc/self/fd/%d", maps[k].fd);
            int fd = open(self, O_RDWR | O_CLOEXEC);
            if (fd < 0) {
                ok = false;
                continue;
            }
            close(maps[k].fd);
            maps[k].fd = fd;
            maps[k].slot = -1;
            if (take_slot(&maps[k]) < 0) ok = false;
        }
        mark_lineage();
        atomic_store(&need_slots, !ok);
    }
    pthread_mutex_unlock(&slot_mu);
    return ok;
}

void fg_region_after_fork(void) {
    pthread_mutex_init(&slot_mu, NULL);
    atomic_store(&need_slots, true);
}

void fg_region_close(void) {
    atomic_store(&closed, true);
    if (a_child_of_the_owner() || atomic_load(&need_slots)) return; /* the slots are not ours */
    int n = atomic_load(&nmaps);
    /* Frees made later (by other exit handlers) find no region: they charge and release
     * nothing, and touch no slot that is not this process's any more. */
    atomic_store(&nmaps, 0);
    for (int k = 0; k < n; k++) {
        if (maps[k].slot < 0) continue;
        fg_slot *s = &maps[k].r->slots[maps[k].slot];
        zero_slot(s);
        atomic_store(&s->pid, 0);
    }
}

static uint64_t used_in(const fg_region *r, int dev) {
    uint64_t sum = 0;
    uint32_t hw = atomic_load(&r->high_water);
    for (uint32_t i = 0; i < hw && i < FG_REGION_SLOTS; i++)
        sum += atomic_load(&r->slots[i].used[dev]);
    return sum;
}

uint64_t fg_region_used(int dev) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES) return 0;
    uint64_t most = 0;
    int n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++) {
        uint64_t u = used_in(maps[k].r, dev);
        if (u > most) most = u;
    }
    return most;
}

/* Every region this process is in is up to date and no live slot awaits its refill. */
static bool ready(void) {
    int n = atomic_load(&nmaps);
    bool ok = true;
    for (int k = 0; k < n; k++) {
        fg_map *m = &maps[k];
        if (!current(m)) settle_reset(m);
        if (!current(m) || atomic_load(&m->r->npending) != 0) ok = false;
    }
    return ok;
}

static void add_own(int dev, uint64_t bytes) {
    atomic_fetch_add(&shadow[dev], bytes);
    int n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++)
        atomic_fetch_add(&maps[k].r->slots[maps[k].slot].used[dev], bytes);
}

/* Subtract without going below zero: a slot never holds less than nothing. */
static void sub_clamped(_Atomic uint64_t *v, uint64_t bytes) {
    uint64_t cur = atomic_load(v);
    while (!atomic_compare_exchange_weak(v, &cur, cur > bytes ? cur - bytes : 0)) {
    }
}

static void sub_own(int dev, uint64_t bytes) {
    sub_clamped(&shadow[dev], bytes);
    int n = atomic_load(&nmaps);
    for (int k = 0; k < n; k++) sub_clamped(&maps[k].r->slots[maps[k].slot].used[dev], bytes);
}

bool fg_region_charge(int dev, uint64_t bytes, uint64_t limit) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES || bytes > limit || !own_slots()) return false;
    /* Add first, then look: of two racing charges at least the later one sees both, so the sum
     * never passes the limit. Both may fail; then back off and retry a few times, and reap dead
     * processes once, before saying out of memory. */
    for (int attempt = 0; attempt < 4; attempt++) {
        if (!ready()) {
            sched_yield();
            continue;
        }
        add_own(dev, bytes);
        if (fg_region_used(dev) <= limit && ready()) return true;
        sub_own(dev, bytes);
        if (attempt == 0 && fg_region_reap(true) > 0) continue;
        sched_yield();
    }
    return false;
}

void fg_region_force(int dev, uint64_t bytes) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES || !own_slots()) return;
    ready();
    add_own(dev, bytes);
}

void fg_region_release(int dev, uint64_t bytes) {
    if (dev < 0 || dev >= FRACGPU_MAX_DEVICES || !own_slots()) return;
    ready();
    sub_own(dev, bytes);
}
