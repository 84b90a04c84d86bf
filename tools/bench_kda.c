/* tools/bench_kda.c -- `deltagrad bench kda`: placeholder until the KDA benchmark lands. Weak, so
 * a real dg_bench_kda linked elsewhere replaces it. */
#include "tools/commands.h"

#include <stdio.h>

#if defined(__GNUC__)
__attribute__((weak))
#endif
int dg_bench_kda(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "bench kda: not available in this build yet\n");
    return 2;
}
