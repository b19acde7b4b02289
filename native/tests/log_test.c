/* Unit test of the log line (src/log.c): the prefix, the newline, and a long message cut to fit
 * with its newline kept. Each case prints "ok <name>" or "FAIL <name>: <why>" on stdout (stderr
 * is what is tested) and the exit status counts failures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "check.h"

int failures;


/* What fg_log wrote to stderr for one call with a single %s argument, and in how many writes. */
static size_t logged(const char *arg, char *out, size_t cap) {
    FILE *f = tmpfile();
    if (!f) return 0;
    int saved = dup(STDERR_FILENO);
    dup2(fileno(f), STDERR_FILENO);
    fg_log("%s", arg);
    dup2(saved, STDERR_FILENO);
    close(saved);
    rewind(f);
    size_t n = fread(out, 1, cap, f);
    fclose(f);
    return n;
}

static const struct {
    const char *name;
    const char *arg;
    const char *want;
} lines[] = {
    {"a line with the prefix", "card 3 is not granted", "fracgpu: card 3 is not granted\n"},
    {"an empty message is the prefix alone", "", "fracgpu: \n"},
    {"a percent sign in an argument is text", "100%s", "fracgpu: 100%s\n"},
};

static void test_line(size_t i) {
    const char *name = lines[i].name;
    char out[1024];
    size_t n = logged(lines[i].arg, out, sizeof out);
    CHECK(name, n == strlen(lines[i].want) && memcmp(out, lines[i].want, n) == 0);
    printf("ok %s\n", name);
}

static void test_a_long_message_is_cut(void) {
    const char *name = "a long message is cut to 511 bytes, newline kept";
    char arg[2000];
    memset(arg, 'a', sizeof arg - 1);
    arg[sizeof arg - 1] = '\0';
    char out[4096];
    size_t n = logged(arg, out, sizeof out);
    CHECK(name, n == 511);
    CHECK(name, memcmp(out, "fracgpu: ", 9) == 0 && out[510] == '\n' && out[509] == 'a');
    printf("ok %s\n", name);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) test_line(i);
    test_a_long_message_is_cut();
    return failures;
}
