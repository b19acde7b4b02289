/* Reads the limits file the device plugin writes (format: core/contract.py).
 *
 * Strict on purpose: the file is machine-written, so anything unexpected (unknown or repeated
 * keys, signs, spaces inside numbers, overflow, a second version) means corruption or tampering,
 * and the caller then fails safe. Never allocates; never reads more than FRACGPU_MAX_FILE_BYTES. */
#include "limits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *fg_text_trim(const char *s, const char *end, const char **out_end) {
    while (s < end && (*s == ' ' || *s == '\t' || *s == '\r')) s++;
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r')) end--;
    *out_end = end;
    return s;
}

int fg_text_u64(const char *s, const char *end, uint64_t *out) {
    if (s == end || end - s > 20) return -1;
    uint64_t v = 0;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9') return -1;
        uint64_t d = (uint64_t)(*s - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

int fg_text_key_is(const char *k, const char *kend, const char *name) {
    size_t n = strlen(name);
    return (size_t)(kend - k) == n && memcmp(k, name, n) == 0;
}

int fg_text_next(fg_text_lines *it, const char **k, const char **eq, const char **e, char *why,
                 size_t why_len) {
    while (it->p < it->end) {
        const char *nl = memchr(it->p, '\n', (size_t)(it->end - it->p));
        const char *lend = nl ? nl : it->end;
        it->line++;
        const char *s = fg_text_trim(it->p, lend, e);
        it->p = nl ? nl + 1 : it->end;
        if (s == *e || *s == '#') continue;
        if (memchr(s, '\0', (size_t)(*e - s))) {
            snprintf(why, why_len, "line %d: contains a NUL byte", it->line);
            return -1;
        }
        *eq = memchr(s, '=', (size_t)(*e - s));
        if (!*eq) {
            snprintf(why, why_len, "line %d: expected key=value", it->line);
            return -1;
        }
        *k = s;
        return 1;
    }
    return 0;
}

static int parse_devices(const char *s, const char *end, fg_limits *out) {
    out->ndevices = 0;
    while (1) {
        const char *comma = memchr(s, ',', (size_t)(end - s));
        const char *stop = comma ? comma : end;
        size_t n = (size_t)(stop - s);
        if (n == 0 || n >= FG_UUID_MAX || out->ndevices >= FRACGPU_MAX_DEVICES) return -1;
        for (const char *c = s; c < stop; c++) {
            unsigned char u = (unsigned char)*c;
            if (u <= ' ' || u >= 0x7f || u == '=' || u == '#') return -1;
        }
        memcpy(out->devices[out->ndevices], s, n);
        out->devices[out->ndevices][n] = '\0';
        out->ndevices++;
        if (!comma) return 0;
        s = comma + 1;
    }
}

fg_limits_status fg_limits_parse(const char *text, size_t len, fg_limits *out, char *why,
                                 size_t why_len) {
    enum { K_VERSION = 1, K_DEVICES = 2, K_MEMORY = 4, K_COMPUTE = 8, K_ALL = 15 };
    unsigned seen = 0;
    memset(out, 0, sizeof *out);
    if (len > FRACGPU_MAX_FILE_BYTES) {
        snprintf(why, why_len, "is larger than %d bytes", FRACGPU_MAX_FILE_BYTES);
        return FG_LIMITS_INVALID;
    }
    fg_text_lines it = {text, text + len, 0};
    const char *s, *eq, *e;
    int more;
    while ((more = fg_text_next(&it, &s, &eq, &e, why, why_len)) > 0) {
        const char *v = eq + 1;
        unsigned bit;
        if (fg_text_key_is(s, eq, FRACGPU_KEY_VERSION)) {
            bit = K_VERSION;
        } else if (fg_text_key_is(s, eq, FRACGPU_KEY_DEVICES)) {
            bit = K_DEVICES;
        } else if (fg_text_key_is(s, eq, FRACGPU_KEY_MEMORY_BYTES)) {
            bit = K_MEMORY;
        } else if (fg_text_key_is(s, eq, FRACGPU_KEY_COMPUTE_PERCENT)) {
            bit = K_COMPUTE;
        } else {
            snprintf(why, why_len, "line %d: unknown key '%.*s'", it.line,
                     (int)((eq - s) > 40 ? 40 : (eq - s)), s);
            return FG_LIMITS_INVALID;
        }
        if (seen & bit) {
            snprintf(why, why_len, "line %d: repeated key '%.*s'", it.line, (int)(eq - s), s);
            return FG_LIMITS_INVALID;
        }
        seen |= bit;
        uint64_t n = 0;
        switch (bit) {
        case K_VERSION:
            if (fg_text_u64(v, e, &n) != 0 || n != FRACGPU_FORMAT_VERSION) {
                snprintf(why, why_len, "line %d: unsupported version (this hook reads %d)", it.line,
                         FRACGPU_FORMAT_VERSION);
                return FG_LIMITS_INVALID;
            }
            break;
        case K_DEVICES:
            if (parse_devices(v, e, out) != 0) {
                snprintf(why, why_len,
                         "line %d: devices must be 1 to %d comma-separated card UUIDs", it.line,
                         FRACGPU_MAX_DEVICES);
                return FG_LIMITS_INVALID;
            }
            break;
        case K_MEMORY:
            if (fg_text_u64(v, e, &n) != 0 || n == 0 || n > (uint64_t)FRACGPU_MAX_MEMORY_BYTES) {
                snprintf(why, why_len, "line %d: memory_bytes must be a positive integer", it.line);
                return FG_LIMITS_INVALID;
            }
            out->memory_bytes = n;
            break;
        default:
            if (fg_text_u64(v, e, &n) != 0 || n < 1 || n > 100) {
                snprintf(why, why_len, "line %d: compute_percent must be 1 to 100", it.line);
                return FG_LIMITS_INVALID;
            }
            out->compute_percent = (int)n;
            break;
        }
    }
    if (more < 0) return FG_LIMITS_INVALID;
    if (seen != K_ALL) {
        snprintf(why, why_len, "missing key(s):%s%s%s%s", (seen & K_VERSION) ? "" : " version",
                 (seen & K_DEVICES) ? "" : " devices", (seen & K_MEMORY) ? "" : " memory_bytes",
                 (seen & K_COMPUTE) ? "" : " compute_percent");
        return FG_LIMITS_INVALID;
    }
    return FG_LIMITS_OK;
}

fg_limits_status fg_small_file_read(const char *path, char *buf, size_t cap, size_t *len,
                                    char *why, size_t why_len) {
    *len = 0;
    /* O_NONBLOCK: a FIFO planted at the path must not hang the process. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT) return FG_LIMITS_ABSENT;
        snprintf(why, why_len, "cannot be opened: %s", strerror(errno));
        return FG_LIMITS_INVALID;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(why, why_len, "is not a regular file");
        return FG_LIMITS_INVALID;
    }
    while (*len < cap) {
        ssize_t n = read(fd, buf + *len, cap - *len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            snprintf(why, why_len, "cannot be read: %s", strerror(errno));
            close(fd);
            return FG_LIMITS_INVALID;
        }
        if (n == 0) break;
        *len += (size_t)n;
    }
    close(fd);
    return FG_LIMITS_OK;
}

fg_limits_status fg_limits_load(const char *path, fg_limits *out, char *why, size_t why_len) {
    memset(out, 0, sizeof *out);
    char buf[FRACGPU_MAX_FILE_BYTES + 1];
    size_t len;
    fg_limits_status st = fg_small_file_read(path, buf, sizeof buf, &len, why, why_len);
    return st == FG_LIMITS_OK ? fg_limits_parse(buf, len, out, why, why_len) : st;
}
