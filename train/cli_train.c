/* train/cli_train.c -- `deltagrad train` and `deltagrad sample`. */
#include "tools/commands.h"

#include <stdio.h>

int dg_cmd_train(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "deltagrad train: not available in this build yet\n");
    return 2;
}

int dg_cmd_sample(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "deltagrad sample: not available in this build yet\n");
    return 2;
}
