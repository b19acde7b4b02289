/* The limits file reader: the C half of core/contract.py (format version 1). */
#ifndef FRACGPU_LIMITS_H
#define FRACGPU_LIMITS_H

#include <stddef.h>
#include <stdint.h>

#include "fracgpu_contract.h"

#define FG_UUID_MAX 96

typedef struct {
    int ndevices;
    char devices[FRACGPU_MAX_DEVICES][FG_UUID_MAX];
    uint64_t memory_bytes;
    int compute_percent;
} fg_limits;

typedef enum {
    FG_LIMITS_OK = 0,      /* parsed; enforce */
    FG_LIMITS_ABSENT = 1,  /* no file: the hook is a pure pass-through */
    FG_LIMITS_INVALID = 2, /* unreadable or malformed: see why */
} fg_limits_status;

/* Parse text (not NUL-terminated, len bytes). On FG_LIMITS_INVALID, why holds one line. */
fg_limits_status fg_limits_parse(const char *text, size_t len, fg_limits *out, char *why,
                                 size_t why_len);

/* Read and parse the file at path. ENOENT is FG_LIMITS_ABSENT; every other failure is invalid. */
fg_limits_status fg_limits_load(const char *path, fg_limits *out, char *why, size_t why_len);

/* What the usage reader (usage.c) shares with this one, so both are equally strict. */
/* s..end without surrounding blanks; *out_end is the new end. */
const char *fg_text_trim(const char *s, const char *end, const char **out_end);
/* Digits only, no sign or blank, no overflow: 0, else -1. */
int fg_text_u64(const char *s, const char *end, uint64_t *out);
/* Whether k..kend is exactly name. */
int fg_text_key_is(const char *k, const char *kend, const char *name);

/* The lines of a key=value file, in order; blank lines and '#' comments are skipped. */
typedef struct {
    const char *p, *end;
    int line; /* the number of the line fg_text_next last returned, from 1 */
} fg_text_lines;

/* The next line that says something, trimmed: 1 with its key at *k..*eq and its value at
 * *eq + 1..*e; 0 at the end; -1 with why set when the line holds a NUL byte or no '='. */
int fg_text_next(fg_text_lines *it, const char **k, const char **eq, const char **e, char *why,
                 size_t why_len);
/* Read at most cap bytes of a regular file (O_NONBLOCK: a FIFO cannot hang the caller). ENOENT
 * is FG_LIMITS_ABSENT; any other failure FG_LIMITS_INVALID with why set. */
fg_limits_status fg_small_file_read(const char *path, char *buf, size_t cap, size_t *len,
                                    char *why, size_t why_len);

#endif
