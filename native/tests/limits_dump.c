/* Prints what the hook's limits reader makes of a file, one key per line, so a test can check
 * that it agrees with core/contract.py. Exit 0 parsed, 1 absent, 2 invalid. */
#include <stdio.h>

#include "limits.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: limits_dump FILE\n");
        return 64;
    }
    fg_limits l;
    char why[256] = "";
    fg_limits_status st = fg_limits_load(argv[1], &l, why, sizeof why);
    if (st == FG_LIMITS_ABSENT) {
        printf("absent\n");
        return 1;
    }
    if (st == FG_LIMITS_INVALID) {
        printf("invalid %s\n", why);
        return 2;
    }
    printf("devices=");
    for (int i = 0; i < l.ndevices; i++) printf("%s%s", i ? "," : "", l.devices[i]);
    printf("\nmemory_bytes=%llu\ncompute_percent=%d\n", (unsigned long long)l.memory_bytes,
           l.compute_percent);
    return 0;
}
