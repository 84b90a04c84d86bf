/* tests/fuzz/fuzz_args.c -- the argument parsing of `deltagrad train`, `sample`, `kda` and
 * `dplr`, and the strict number parser. The input is NUL-separated arguments; its first byte
 * picks the command (mod 4). */
#define _POSIX_C_SOURCE 200809L /* fuzz_util.h: getpid, dup, dup2, open */
#include "tests/fuzz/fuzz_util.h"
#include "tools/commands.h"
#include "tools/args.h"

#include <math.h>

#define MAX_ARGS 32

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096)
        return 0;
    char *buf = malloc(size + 1);
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = 0;
    char *argv[MAX_ARGS + 2];
    int argc = 0;
    static char *const cmds[4] = {"train", "sample", "kda", "dplr"};
    int which = data[0] % 4;
    argv[argc++] = cmds[which];
    for (char *p = buf; p < buf + size - 1 && argc < MAX_ARGS + 1; p += strlen(p) + 1)
        argv[argc++] = p;
    argv[argc] = NULL;
    fz_quiet();
    int rc = which == 0   ? dg_cmd_train_check(argc, argv)
             : which == 1 ? dg_cmd_sample_check(argc, argv)
             : which == 2 ? dg_cmd_kda_check(argc, argv)
                          : dg_cmd_dplr_check(argc, argv);
    fz_loud();
    if (rc != 0 && rc != 2)
        abort(); /* parsing alone never fails otherwise */
    /* each argument as a number: accepted values are finite, in range, and round-trip */
    for (int i = 1; i < argc; i++) {
        int64_t v = 0;
        if (dg_arg_i64("--n", argv[i], -1000, 1000, &v) == DG_OK && (v < -1000 || v > 1000))
            abort();
        double x = 0;
        if (dg_arg_f64("--x", argv[i], -5.0, 0.0, DG_ARG_HI_OPEN, &x) == DG_OK &&
            !(x >= -5.0 && x < 0.0))
            abort();
        if (dg_arg_f64("--y", argv[i], -INFINITY, INFINITY, 0, &x) == DG_OK && !isfinite(x))
            abort();
    }
    free(buf);
    return 0;
}
