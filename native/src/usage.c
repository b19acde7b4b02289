/* Reads the usage file the node agent rewrites every period beside the limits file, and decides
 * each sampler period whether the throttle may steer by it.
 *
 * Why a node-written file: the card-wide utilisation NVML gives a container counts every share
 * on the card, so two busy shares each drive the sum to their own target and the smaller one is
 * starved. Only the node knows which host PIDs belong to which share. What it writes is trusted
 * no further than the limits file: strict like limits.c (unknown or repeated keys, signs,
 * overflow, a second version: invalid), and only while fresh, so a node agent that stops or
 * writes garbage leaves the hook exactly as it is without the file. Never allocates. */
#include "usage.h"

#include <stdio.h>
#include <string.h>

fg_limits_status fg_usage_parse(const char *text, size_t len, fg_usage *out, char *why,
                                size_t why_len) {
    static const char *const keys[] = {FRACGPU_KEY_VERSION, FRACGPU_KEY_STAMP_US,
                                       FRACGPU_KEY_WINDOW_US, FRACGPU_KEY_USED_PERCENT,
                                       FRACGPU_KEY_CEILING_PERCENT};
    enum { NKEYS = 5, ALL = (1u << NKEYS) - 1 };
    uint64_t v[NKEYS] = {0};
    unsigned seen = 0;
    memset(out, 0, sizeof *out);
    if (len > FRACGPU_USAGE_MAX_FILE_BYTES) {
        snprintf(why, why_len, "is larger than %d bytes", FRACGPU_USAGE_MAX_FILE_BYTES);
        return FG_LIMITS_INVALID;
    }
    fg_text_lines it = {text, text + len, 0};
    const char *s, *eq, *e;
    int more;
    while ((more = fg_text_next(&it, &s, &eq, &e, why, why_len)) > 0) {
        int k = 0;
        while (k < NKEYS && !fg_text_key_is(s, eq, keys[k])) k++;
        if (k == NKEYS || (seen & (1u << k))) {
            snprintf(why, why_len, "line %d: expected one of its keys, once", it.line);
            return FG_LIMITS_INVALID;
        }
        seen |= 1u << k;
        if (fg_text_u64(eq + 1, e, &v[k]) != 0) {
            snprintf(why, why_len, "line %d: not an unsigned integer", it.line);
            return FG_LIMITS_INVALID;
        }
    }
    if (more < 0) return FG_LIMITS_INVALID;
    if (seen != ALL) {
        snprintf(why, why_len, "missing key(s)");
        return FG_LIMITS_INVALID;
    }
    if (v[0] != FRACGPU_USAGE_FORMAT_VERSION || v[1] == 0 || v[1] >= (1ull << 63) || v[2] == 0 ||
        v[2] > FRACGPU_USAGE_MAX_WINDOW_US || v[2] > v[1] || v[3] > 100 || v[4] < 1 ||
        v[4] > 100) {
        snprintf(why, why_len, "a value out of range (version %d)", FRACGPU_USAGE_FORMAT_VERSION);
        return FG_LIMITS_INVALID;
    }
    *out = (fg_usage){v[1], v[2], (int)v[3], (int)v[4]};
    return FG_LIMITS_OK;
}

fg_limits_status fg_usage_load(const char *path, fg_usage *out, char *why, size_t why_len) {
    char buf[FRACGPU_USAGE_MAX_FILE_BYTES + 1];
    size_t len;
    memset(out, 0, sizeof *out);
    fg_limits_status st = fg_small_file_read(path, buf, sizeof buf, &len, why, why_len);
    return st == FG_LIMITS_OK ? fg_usage_parse(buf, len, out, why, why_len) : st;
}

fg_feed_step fg_usage_step(fg_usage_feed *f, const char *path, uint64_t now_us, fg_usage *out,
                           bool *changed, char *why, size_t why_len) {
    fg_feed_step step = FG_FEED_OFF;
    switch (fg_usage_load(path, out, why, why_len)) {
    case FG_LIMITS_ABSENT: snprintf(why, why_len, "is absent"); break;
    case FG_LIMITS_INVALID: break;
    default:
        if (out->stamp_us > now_us + FRACGPU_USAGE_MAX_AHEAD_US)
            snprintf(why, why_len, "is stamped in the future");
        else if (out->stamp_us + FRACGPU_USAGE_MAX_AGE_US < now_us)
            snprintf(why, why_len, "is stale");
        else
            step = out->stamp_us > f->last_stamp_us ? FG_FEED_NEW : FG_FEED_SAME;
    }
    bool live = step != FG_FEED_OFF;
    *changed = live != f->live;
    f->live = live;
    /* Off forgets the last stamp: a node agent restarted with an earlier clock is taken again
     * as soon as its file is fresh. */
    if (!live) f->last_stamp_us = 0;
    else if (step == FG_FEED_NEW) f->last_stamp_us = out->stamp_us;
    return step;
}
