/* The assertion every C unit test uses: on a false condition it prints the case, the condition
 * and the line, counts a failure and ends the case (the test function returns). Each test
 * program defines `int failures` once and exits non-zero when it is above 0. */
#ifndef FRACGPU_TESTS_CHECK_H
#define FRACGPU_TESTS_CHECK_H

#include <stdio.h>

extern int failures;

#define CHECK(name, cond)                                                                      \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            printf("FAIL %s: %s (line %d)\n", name, #cond, __LINE__);                         \
            failures++;                                                                        \
            return;                                                                            \
        }                                                                                      \
    } while (0)

#endif
