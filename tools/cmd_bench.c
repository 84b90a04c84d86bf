/* tools/cmd_bench.c -- `deltagrad bench`. */
#include "tools/commands.h"

#include <stdio.h>

int dg_cmd_bench(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "deltagrad bench: not available in this build yet\n");
    return 2;
}
