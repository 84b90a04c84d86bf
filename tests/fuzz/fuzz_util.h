/*
 * tests/fuzz/fuzz_util.h -- what the libFuzzer targets share: the input as a file (the readers
 * take paths), quiet stderr around calls that print usage errors, and one CPU context.
 *
 * DG_FUZZ_VERBOSE=1 keeps stderr open (to read a crash report when re-running an input).
 */
#ifndef DG_FUZZ_UTIL_H
#define DG_FUZZ_UTIL_H

#include "deltagrad.h"

#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if !defined(_POSIX_C_SOURCE) || _POSIX_C_SOURCE < 200809L
#error "define _POSIX_C_SOURCE 200809L before the first #include (getpid, dup, dup2, open)"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A per-process file holding the input; its path (static storage). */
static inline const char *fz_file(const uint8_t *data, size_t size, const char *suffix) {
    static char path[128];
    snprintf(path, sizeof path, "/tmp/dg_fuzz_%ld%s", (long)getpid(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0)
        abort();
    return path;
}

static inline dg_ctx *fz_ctx(void) {
    static dg_ctx *ctx;
    if (!ctx && dg_ctx_new(dg_cpu(), &ctx) != DG_OK)
        abort();
    return ctx;
}

static int fz_saved_err = -1;

static inline void fz_quiet(void) {
    static int verbose = -1;
    if (verbose < 0)
        verbose = getenv("DG_FUZZ_VERBOSE") && getenv("DG_FUZZ_VERBOSE")[0] == '1';
    if (verbose)
        return;
    fflush(stderr);
    fz_saved_err = dup(2);
    int nul = open("/dev/null", O_WRONLY);
    dup2(nul, 2);
    close(nul);
}

static inline void fz_loud(void) {
    if (fz_saved_err < 0)
        return;
    fflush(stderr);
    dup2(fz_saved_err, 2);
    close(fz_saved_err);
    fz_saved_err = -1;
}

#endif /* DG_FUZZ_UTIL_H */
