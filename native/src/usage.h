/* The usage file reader: what the node measured of the share's own compute use and the ceiling
 * it may run at now (format: core/contract.py, the usage file's version 1). */
#ifndef FRACGPU_USAGE_H
#define FRACGPU_USAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "limits.h"

typedef struct {
    uint64_t stamp_us;  /* CLOCK_REALTIME at which the measured window closed */
    uint64_t window_us; /* the window's length */
    int used_percent;   /* 0-100: the share's own SM use over the window */
    int ceiling_percent; /* 1-100: what the share may use now */
} fg_usage;

/* Parse text (len bytes, not NUL-terminated) as strictly as fg_limits_parse. */
fg_limits_status fg_usage_parse(const char *text, size_t len, fg_usage *out, char *why,
                                size_t why_len);

/* Read and parse the file at path: ENOENT is FG_LIMITS_ABSENT, any other failure invalid. */
fg_limits_status fg_usage_load(const char *path, fg_usage *out, char *why, size_t why_len);

/* The sampler's view of the file from one period to the next. */
typedef struct {
    uint64_t last_stamp_us; /* the newest window taken; 0 while the feed is off */
    bool live;              /* the last step found a fresh file */
} fg_usage_feed;

typedef enum {
    FG_FEED_OFF = 0,  /* missing, malformed or stale: the card's samples and compute_percent */
    FG_FEED_SAME = 1, /* fresh, but no window newer than the last one taken */
    FG_FEED_NEW = 2,  /* fresh, with a new window in *out */
} fg_feed_step;

/* One sampler period: read path and judge it against now_us (CLOCK_REALTIME µs). Fresh means
 * stamped at most FRACGPU_USAGE_MAX_AGE_US ago and at most FRACGPU_USAGE_MAX_AHEAD_US ahead.
 * *out is set on SAME and NEW. On a change between off and live, *changed is set and why says
 * why the feed went off (for the trace build's one line). */
fg_feed_step fg_usage_step(fg_usage_feed *f, const char *path, uint64_t now_us, fg_usage *out,
                           bool *changed, char *why, size_t why_len);

#endif
