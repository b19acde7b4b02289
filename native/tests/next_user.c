#include <stdio.h>
#include <stdlib.h>

int main(void) {
    printf("abs %d\n", abs(-7));
    return 0;
}
