/* tools/cmd_explain.c -- `deltagrad explain`. */
#include "tools/commands.h"

#include <stdio.h>

int dg_cmd_explain(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "deltagrad explain: not available in this build yet\n");
    return 2;
}
