/* Unit test of the usage file reader (src/usage.c), linked with it and the limits reader whose
 * primitives it shares. Each case prints "ok <name>" or "FAIL <name>: <why>"; the exit status
 * counts failures. A temporary directory (argv[1]) holds the files of the step cases. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "usage.h"
#include "check.h"

int failures;
static char dir[512], path[600];


#define NOW 1764230400000000ull
static const char *const GOOD = "version=1\nstamp_us=1764230400000000\nwindow_us=100000\n"
                                "used_percent=27\nceiling_percent=30\n";

static fg_limits_status parse(const char *text, fg_usage *u) {
    char why[128];
    return fg_usage_parse(text, strlen(text), u, why, sizeof why);
}

static void test_a_good_file(void) {
    const char *name = "a good file";
    fg_usage u;
    CHECK(name, parse(GOOD, &u) == FG_LIMITS_OK);
    CHECK(name, u.stamp_us == NOW && u.window_us == 100000);
    CHECK(name, u.used_percent == 27 && u.ceiling_percent == 30);
    CHECK(name, parse("# comment\n ceiling_percent=100 \r\nused_percent=0\nwindow_us=1\n"
                      "stamp_us=5\nversion=1",
                      &u) == FG_LIMITS_OK);
    CHECK(name, u.ceiling_percent == 100 && u.used_percent == 0 && u.window_us == 1);
    printf("ok %s\n", name);
}

static void test_hostile_files(void) {
    const char *name = "hostile files refused";
    static const char *const bad[] = {
        "",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\n",
        "version=2\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=0\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=101\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=101\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=0\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=6\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=99999999\nwindow_us=10000001\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=0\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=-5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=+5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=5 5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=99999999999999999999\nwindow_us=1\nused_percent=0\n"
        "ceiling_percent=1\n",
        "version=1\nversion=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\nextra=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0.5\nceiling_percent=1\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fg_usage u;
        if (parse(bad[i], &u) != FG_LIMITS_INVALID) {
            printf("FAIL %s: case %zu accepted\n", name, i);
            failures++;
            return;
        }
    }
    char big[FRACGPU_USAGE_MAX_FILE_BYTES + 2];
    memset(big, '#', sizeof big);
    char why[64];
    fg_usage u;
    CHECK(name, fg_usage_parse(big, sizeof big, &u, why, sizeof why) == FG_LIMITS_INVALID);
    printf("ok %s\n", name);
}

static void write_file(const char *text) {
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
}

static void write_usage(uint64_t stamp, int used, int ceiling) {
    char text[256];
    snprintf(text, sizeof text,
             "version=1\nstamp_us=%llu\nwindow_us=100000\nused_percent=%d\nceiling_percent=%d\n",
             (unsigned long long)stamp, used, ceiling);
    write_file(text);
}

static fg_feed_step step(fg_usage_feed *f, uint64_t now, fg_usage *u, bool *changed) {
    char why[128];
    return fg_usage_step(f, path, now, u, changed, why, sizeof why);
}

static void test_the_feed_takes_each_window_once(void) {
    const char *name = "each window taken once";
    fg_usage_feed f = {0, false};
    fg_usage u;
    bool changed;
    unlink(path);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF && !changed);
    write_usage(NOW, 27, 30);
    CHECK(name, step(&f, NOW + 1000, &u, &changed) == FG_FEED_NEW && changed);
    CHECK(name, u.used_percent == 27 && f.live);
    CHECK(name, step(&f, NOW + 50000, &u, &changed) == FG_FEED_SAME && !changed);
    CHECK(name, u.ceiling_percent == 30);
    write_usage(NOW + 100000, 31, 60);
    CHECK(name, step(&f, NOW + 101000, &u, &changed) == FG_FEED_NEW && !changed);
    CHECK(name, u.ceiling_percent == 60 && f.last_stamp_us == NOW + 100000);
    /* A stamp that goes back is not a new window. */
    write_usage(NOW + 50000, 31, 60);
    CHECK(name, step(&f, NOW + 151000, &u, &changed) == FG_FEED_SAME);
    printf("ok %s\n", name);
}

static void test_stale_future_and_garbage_turn_the_feed_off(void) {
    const char *name = "stale, future, garbage and absent turn it off";
    fg_usage_feed f = {0, false};
    fg_usage u;
    bool changed;
    write_usage(NOW, 27, 30);
    CHECK(name, step(&f, NOW + FRACGPU_USAGE_MAX_AGE_US, &u, &changed) == FG_FEED_NEW);
    CHECK(name, step(&f, NOW + FRACGPU_USAGE_MAX_AGE_US + 1, &u, &changed) == FG_FEED_OFF);
    CHECK(name, changed && !f.live && f.last_stamp_us == 0);
    /* Off forgets the last stamp: the same window is new again once it is fresh. */
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_NEW && changed);
    write_usage(NOW + FRACGPU_USAGE_MAX_AHEAD_US + 1, 27, 30);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF && changed);
    write_usage(NOW + FRACGPU_USAGE_MAX_AHEAD_US, 27, 30);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_NEW);
    write_file("version=1\nstamp_us=garbage\n");
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF && changed);
    write_usage(NOW, 27, 30);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_NEW);
    unlink(path);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF && changed);
    printf("ok %s\n", name);
}

static void test_only_a_regular_file_is_read(void) {
    const char *name = "only a regular file";
    fg_usage_feed f = {0, false};
    fg_usage u;
    bool changed;
    unlink(path);
    CHECK(name, mkfifo(path, 0600) == 0);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF); /* and did not hang */
    unlink(path);
    CHECK(name, mkdir(path, 0700) == 0);
    CHECK(name, step(&f, NOW, &u, &changed) == FG_FEED_OFF);
    rmdir(path);
    printf("ok %s\n", name);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* usage_test dump FILE: what the reader makes of a file, for the Python side to compare. */
    if (argc == 3 && strcmp(argv[1], "dump") == 0) {
        fg_usage u;
        char why[128] = "";
        fg_limits_status st = fg_usage_load(argv[2], &u, why, sizeof why);
        if (st != FG_LIMITS_OK) {
            printf("%s %s\n", st == FG_LIMITS_ABSENT ? "absent" : "invalid", why);
            return (int)st;
        }
        printf("%llu %llu %d %d\n", (unsigned long long)u.stamp_us,
               (unsigned long long)u.window_us, u.used_percent, u.ceiling_percent);
        return 0;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: usage_test DIR | usage_test dump FILE\n");
        return 64;
    }
    snprintf(dir, sizeof dir, "%s", argv[1]);
    snprintf(path, sizeof path, "%s/usage", dir);
    test_a_good_file();
    test_hostile_files();
    test_the_feed_takes_each_window_once();
    test_stale_future_and_garbage_turn_the_feed_off();
    test_only_a_regular_file_is_read();
    return failures;
}
