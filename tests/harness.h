/*
 * tests/harness.h -- the small harness every test uses.
 *
 * A test executable takes one argument, "cpu" or "gpu", and runs the cases for that mode. Every
 * test's main() is one call of dg_test_main(), which parses the mode, makes a CPU context, runs
 * the suite's cases for that mode and returns the exit code: 0 when every check passed, 1 when one
 * failed or none ran, 2 for a usage error or a mode the suite has no cases for, and in gpu mode
 * without a usable CUDA device 77, which ctest reports as skipped (SKIP_RETURN_CODE). Each check
 * prints one line (name, max abs/rel error, tolerance, OK / NOT OK) in the manner of llm.c's
 * check_tensor; dg_test_finish() prints a summary line and returns the exit code.
 */
#ifndef DG_TEST_HARNESS_H
#define DG_TEST_HARNESS_H

#include "deltagrad.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define DG_TEST_SKIP 77

/* The cases of one mode; `cpu` is a CPU context dg_test_main() makes and frees. */
typedef void (*dg_test_fn)(dg_ctx *cpu);
/* The whole main() of a test: `cpu_cases` in cpu mode; in gpu mode DG_TEST_SKIP when no CUDA
 * device is usable (built without CUDA, or none present), else `gpu_cases`. A NULL function means
 * the suite has no cases in that mode: CMakeLists.txt does not register it there, and run there
 * it exits 2. Arguments after the mode are the suite's own (parse them before the call). */
int dg_test_main(int argc, char **argv, const char *suite, dg_test_fn cpu_cases,
                 dg_test_fn gpu_cases);

/* The parts of dg_test_main() (tests/dist/ drives its MPI suites with them). */
/* Parses argv; returns 1 for gpu mode, 0 for cpu mode. */
int dg_test_init(int argc, char **argv, const char *suite);
int dg_test_gpu_mode(void);
/* In gpu mode: DG_TEST_SKIP (after printing why) if no CUDA device is usable, else 0. */
int dg_test_need_gpu(void);
/* Return value for main(): 0 if every check passed. */
int dg_test_finish(void);
/* Checks recorded so far and how many of them failed (for suites that tally their parts). */
void dg_test_counts(int *checks, int *failed);
/* For suites that have nothing to run in the current mode: prints why and returns 77. */
int dg_test_skip(const char *why);

/* Record a boolean check. */
int dg_check(int ok, const char *fmt, ...);
/* Compare n values: ok if |got - want| <= atol + rtol * |want| for every element. Prints max abs
 * and max rel error. NaN in either side fails. */
int dg_check_close(const char *name, const double *got, const double *want, int64_t n, double atol,
                   double rtol);
/* Norm-relative comparison: max|got - want| / max(max|want|, tiny) <= tol (the gradcheck metric
 * and the bf16 metric). */
int dg_check_rel(const char *name, const double *got, const double *want, int64_t n, double tol);
/* The same on tensors (any device/dtype). */
int dg_check_tensor_close(const char *name, const dg_tensor *got, const dg_tensor *want,
                          double atol, double rtol);
int dg_check_tensor_rel(const char *name, const dg_tensor *got, const dg_tensor *want, double tol);
/* A status must be DG_OK; prints dg_last_error() otherwise. */
int dg_check_ok(dg_status s, const char *what);
/* A status must equal `want` and the error message must mention `needle` (NULL: any). */
int dg_check_err(dg_status s, dg_status want, const char *needle, const char *what);

/* Abort the test (not a check) on a status that makes going on pointless. */
#define DG_TEST_TRY(expr)                                                                          \
    do {                                                                                           \
        dg_status dg__ts = (expr);                                                                 \
        if (dg__ts != DG_OK) {                                                                     \
            fprintf(stderr, "FATAL %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr,              \
                    dg_status_str(dg__ts), dg_last_error());                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Random tensor helpers: a new tensor in ctx filled uniform in [lo, hi) with `seed`. */
dg_tensor *dg_test_rand(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                        double lo, double hi);
dg_tensor *dg_test_randn(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, uint64_t seed);

/* The x an op along T runs on in a gradcheck: *xv = x, or with transpose (x [B, C, T]) the view
 * of x as [B, T, C], made in *tmp (NULL otherwise; free it after the op). */
dg_status dg_test_along_t(dg_tensor *x, int transpose, dg_tensor **tmp, dg_tensor **xv);

#endif
