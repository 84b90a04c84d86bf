/* tools/cmd_kda.c -- `deltagrad kda`. */
#include "tools/commands.h"

#include <stdio.h>

int dg_cmd_kda(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "deltagrad kda: not available in this build yet\n");
    return 2;
}
