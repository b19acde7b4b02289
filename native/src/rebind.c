#include "rebind.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dl.h"

#if defined(__x86_64__)
#define R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define R_GLOB_DAT R_X86_64_GLOB_DAT
#define R_ABS64 R_X86_64_64
#elif defined(__aarch64__)
#define R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define R_GLOB_DAT R_AARCH64_GLOB_DAT
#define R_ABS64 R_AARCH64_ABS64
#else
#error "the hook rebinds GOT slots on x86_64 and aarch64 only"
#endif

/* What the dynamic section of one loaded object says, with addresses made absolute. */
typedef struct {
    ElfW(Addr) base;
    ElfW(Sym) *sym;
    const char *str;
    size_t nsyms;
    const ElfW(Rela) *rela[2];
    size_t nrela[2];
    const ElfW(Phdr) *phdr;
    int phnum;
} fg_obj;

/* The linker stores absolute addresses in the dynamic section on most targets and offsets on a
 * few; an address below the load base can only be an offset. */
static ElfW(Addr) abs_addr(ElfW(Addr) base, ElfW(Addr) v) { return v < base ? base + v : v; }

static size_t gnu_hash_nsyms(const uint32_t *h) {
    uint32_t nbuckets = h[0], symoffset = h[1], bloom = h[2];
    const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)(h + 4) + bloom);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t last = 0;
    for (uint32_t b = 0; b < nbuckets; b++)
        if (buckets[b] > last) last = buckets[b];
    if (last < symoffset) return symoffset;
    while (!(chain[last - symoffset] & 1)) last++;
    return (size_t)last + 1;
}

typedef struct {
    ElfW(Addr) base;
    const ElfW(Phdr) *phdr;
    int phnum;
} phdr_query;

static int find_phdrs(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    phdr_query *q = arg;
    if (info->dlpi_addr != q->base) return 0;
    q->phdr = info->dlpi_phdr;
    q->phnum = info->dlpi_phnum;
    return 1;
}

static bool obj_open(const struct link_map *lm, fg_obj *o) {
    memset(o, 0, sizeof *o);
    if (!lm->l_ld || strstr(lm->l_name, "linux-vdso") || strstr(lm->l_name, "linux-gate"))
        return false;
    o->base = lm->l_addr;
    const uint32_t *gnu = NULL, *sysv = NULL;
    ElfW(Addr) jmprel = 0, rela = 0;
    size_t pltrelsz = 0, relasz = 0;
    for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB: o->sym = (ElfW(Sym) *)abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_STRTAB: o->str = (const char *)abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_GNU_HASH: gnu = (const uint32_t *)abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_HASH: sysv = (const uint32_t *)abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_JMPREL: jmprel = abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_PLTRELSZ: pltrelsz = d->d_un.d_val; break;
        case DT_RELA: rela = abs_addr(o->base, d->d_un.d_ptr); break;
        case DT_RELASZ: relasz = d->d_un.d_val; break;
        default: break;
        }
    }
    if (!o->sym || !o->str) return false;
    o->nsyms = gnu ? gnu_hash_nsyms(gnu) : sysv ? sysv[1] : 0;
    o->rela[0] = (const ElfW(Rela) *)rela;
    o->nrela[0] = rela ? relasz / sizeof(ElfW(Rela)) : 0;
    o->rela[1] = (const ElfW(Rela) *)jmprel;
    o->nrela[1] = jmprel ? pltrelsz / sizeof(ElfW(Rela)) : 0;
    phdr_query q = {o->base, NULL, 0};
    dl_iterate_phdr(find_phdrs, &q);
    if (!q.phdr && o->base) {
        /* dl_iterate_phdr reports only the caller's namespace; a shared object elsewhere
         * still has its ELF header mapped at its base. */
        const ElfW(Ehdr) *eh = (const ElfW(Ehdr) *)o->base;
        if (memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0) {
            q.phdr = (const ElfW(Phdr) *)(o->base + eh->e_phoff);
            q.phnum = eh->e_phnum;
        }
    }
    o->phdr = q.phdr;
    o->phnum = q.phnum;
    return o->phdr != NULL;
}

/* The protection the object's program headers give [addr, addr + n) once relocated (RELRO is
 * read-only then), or -1 when the range is not inside one loaded segment. */
static int prot_of(const fg_obj *o, const void *addr, size_t n) {
    ElfW(Addr) off = (ElfW(Addr))addr - o->base;
    int prot = -1;
    bool relro = false;
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *p = &o->phdr[i];
        bool inside = off >= p->p_vaddr && off + n <= p->p_vaddr + p->p_memsz;
        if (p->p_type == PT_LOAD && inside)
            prot = ((p->p_flags & PF_R) ? PROT_READ : 0) | ((p->p_flags & PF_W) ? PROT_WRITE : 0) |
                   ((p->p_flags & PF_X) ? PROT_EXEC : 0);
        if (p->p_type == PT_GNU_RELRO && inside) relro = true;
    }
    return prot >= 0 && relro ? prot & ~PROT_WRITE : prot;
}

/* Make [addr, addr + n) writable (true) or give it back its protection (false). */
static bool unprotect(const fg_obj *o, void *addr, size_t n, bool writable) {
    int prot = prot_of(o, addr, n);
    if (prot < 0) return false;
    if (prot & PROT_WRITE) return true;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr & ~(page - 1);
    size_t len = ((uintptr_t)addr + n - start + page - 1) & ~(page - 1);
    return mprotect((void *)start, len, writable ? prot | PROT_WRITE : prot) == 0;
}

/* Write n bytes at addr inside o, lifting the page protection for the write. */
static bool poke(const fg_obj *o, void *addr, const void *val, size_t n) {
    if (!unprotect(o, addr, n, true)) return false;
    memcpy(addr, val, n);
    unprotect(o, addr, n, false);
    return true;
}

static bool is_function(const ElfW(Sym) *s) {
    int t = ELF64_ST_TYPE(s->st_info);
    return s->st_shndx != SHN_UNDEF && (t == STT_FUNC || t == STT_GNU_IFUNC);
}

/* Make symbol s of o resolve to target from now on (the symbol table is writable: see
 * open_symbols). */
static void point_symbol(const fg_obj *o, ElfW(Sym) *s, void *target) {
    s->st_value = (ElfW(Addr))target - o->base; /* the linker adds the base back */
    s->st_info = ELF64_ST_INFO(ELF64_ST_BIND(s->st_info), STT_FUNC);
}

/* The whole symbol table is made writable once around a batch of edits, not per symbol. */
static bool open_symbols(const fg_obj *o, bool writable) {
    return unprotect(o, o->sym, o->nsyms * sizeof *o->sym, writable);
}

static struct link_map *map_of(void *handle) {
    struct link_map *lm = NULL;
    return dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 ? lm : NULL;
}

int fg_rebind_driver(void *handle, fg_hook_lookup hook_of) {
    struct link_map *lm = map_of(handle);
    fg_obj o;
    if (!lm || !obj_open(lm, &o)) return -1;
    if (!open_symbols(&o, true)) return -1;
    int n = 0;
    for (size_t i = 1; i < o.nsyms; i++) {
        ElfW(Sym) *s = &o.sym[i];
        if (!is_function(s)) continue;
        void *hook = hook_of(o.str + s->st_name);
        if (!hook) continue;
        point_symbol(&o, s, hook);
        n++;
    }
    open_symbols(&o, false);
    return n;
}

static int rebind_relocs(const fg_obj *o, fg_hook_lookup hook_of) {
    int n = 0;
    for (int t = 0; t < 2; t++) {
        for (size_t i = 0; i < o->nrela[t]; i++) {
            const ElfW(Rela) *r = &o->rela[t][i];
            unsigned type = (unsigned)ELF64_R_TYPE(r->r_info);
            size_t symi = ELF64_R_SYM(r->r_info);
            if ((type != R_JUMP_SLOT && type != R_GLOB_DAT && type != R_ABS64) || symi == 0 ||
                (o->nsyms && symi >= o->nsyms))
                continue;
            const ElfW(Sym) *s = &o->sym[symi];
            if (s->st_shndx != SHN_UNDEF) continue;
            void *hook = hook_of(o->str + s->st_name);
            if (!hook) continue;
            void **slot = (void **)(o->base + r->r_offset);
            void *want = (char *)hook + (type == R_ABS64 ? r->r_addend : 0);
            if (*slot != want && poke(o, slot, &want, sizeof want)) n++;
        }
    }
    return n;
}

int fg_rebind_bound(fg_hook_lookup hook_of, const void *skip) {
    struct link_map *lm = _r_debug.r_map; /* the main namespace, the program first */
    int n = 0;
    for (; lm; lm = lm->l_next) {
        fg_obj o;
        if (lm == skip || !obj_open(lm, &o)) continue;
        n += rebind_relocs(&o, hook_of);
    }
    return n;
}

static ElfW(Sym) *find_defined(const fg_obj *o, const char *name) {
    for (size_t i = 1; i < o->nsyms; i++)
        if (is_function(&o->sym[i]) && strcmp(o->str + o->sym[i].st_name, name) == 0)
            return &o->sym[i];
    return NULL;
}

int fg_rebind_namespace(void *handle, void *main_handle, const char *forward_name,
                        void *dlmopen_fn) {
    struct link_map *lm = map_of(handle);
    if (!lm) return -1;
    while (lm->l_prev) lm = lm->l_prev;
    fg_dlsym_fn real_dlsym = fg_real_dlsym();
    int n = 0;
    for (; lm; lm = lm->l_next) {
        fg_obj o;
        if (!obj_open(lm, &o)) continue;
        bool driver = find_defined(&o, forward_name) != NULL;
        if (!driver && !find_defined(&o, "dlmopen")) continue;
        if (!open_symbols(&o, true)) return -1;
        for (size_t i = 1; i < o.nsyms; i++) {
            ElfW(Sym) *s = &o.sym[i];
            if (!is_function(s)) continue;
            const char *name = o.str + s->st_name;
            void *target = NULL;
            if (strcmp(name, "dlmopen") == 0)
                target = dlmopen_fn;
            else if (driver)
                target = real_dlsym(main_handle, name);
            if (!target) continue;
            point_symbol(&o, s, target);
            n++;
        }
        open_symbols(&o, false);
    }
    return n;
}
