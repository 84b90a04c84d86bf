/* tests/harness.c -- see harness.h. */
#include "harness.h"

#include <stdarg.h>
#include <string.h>

static int g_gpu, g_checks, g_fails;
static const char *g_suite = "test";

int dg_test_init(int argc, char **argv, const char *suite) {
    g_suite = suite;
    g_gpu = argc > 1 && strcmp(argv[1], "gpu") == 0;
    if (argc > 1 && strcmp(argv[1], "gpu") != 0 && strcmp(argv[1], "cpu") != 0) {
        fprintf(stderr, "usage: %s [cpu|gpu]\n", argv[0]);
        exit(2);
    }
    printf("== %s (%s mode)\n", suite, g_gpu ? "gpu" : "cpu");
    return g_gpu;
}

int dg_test_gpu_mode(void) { return g_gpu; }

int dg_test_skip(const char *why) {
    printf("SKIPPED %s: %s\n", g_suite, why);
    return DG_TEST_SKIP;
}

int dg_test_need_gpu(void) {
    if (!dg_have_cuda())
        return dg_test_skip("built without CUDA");
    if (dg_cuda_device_count() <= 0)
        return dg_test_skip("no CUDA device");
    return 0;
}

int dg_test_main(int argc, char **argv, const char *suite, dg_test_fn cpu_cases,
                 dg_test_fn gpu_cases) {
    const int gpu = dg_test_init(argc, argv, suite);
    if (gpu) {
        const int skip = dg_test_need_gpu();
        if (skip)
            return skip;
    }
    const dg_test_fn cases = gpu ? gpu_cases : cpu_cases;
    if (!cases) {
        printf("== %s has no %s cases: it is registered in %s mode only\n", suite,
               gpu ? "gpu" : "cpu", gpu ? "cpu" : "gpu");
        return 2;
    }
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    cases(cpu);
    dg_ctx_free(&cpu);
    return dg_test_finish();
}

int dg_test_finish(void) {
    printf("== %s: %d checks, %d failed: %s\n", g_suite, g_checks, g_fails,
           g_fails ? "NOT OK" : "overall okay");
    if (g_checks == 0) {
        printf("== %s: no checks ran, which counts as a failure\n", g_suite);
        return 1;
    }
    return g_fails ? 1 : 0;
}

void dg_test_counts(int *checks, int *failed) {
    *checks = g_checks;
    *failed = g_fails;
}

int dg_check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  %-6s ", ok ? "OK" : "NOT OK");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    g_checks++;
    if (!ok)
        g_fails++;
    return ok;
}

int dg_check_close(const char *name, const double *got, const double *want, int64_t n, double atol,
                   double rtol) {
    double max_abs = 0, max_rel = 0;
    int ok = 1;
    int64_t first_bad = -1;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(got[i] - want[i]);
        if (!(d <= atol + rtol * fabs(want[i]))) { /* also catches NaN */
            ok = 0;
            if (first_bad < 0)
                first_bad = i;
        }
        if (d > max_abs || isnan(d))
            max_abs = isnan(d) ? NAN : d;
        double r = d / (fabs(want[i]) > 1e-30 ? fabs(want[i]) : 1e-30);
        if (r > max_rel && fabs(want[i]) > atol)
            max_rel = r;
    }
    if (first_bad >= 0)
        printf("         first mismatch at %lld: got %.10g want %.10g\n", (long long)first_bad,
               got[first_bad], want[first_bad]);
    return dg_check(ok, "%-44s n=%-7lld max|abs|=%.3e max|rel|=%.3e (atol %.0e rtol %.0e)", name,
                    (long long)n, max_abs, max_rel, atol, rtol);
}

int dg_check_rel(const char *name, const double *got, const double *want, int64_t n, double tol) {
    double num = 0, den = 0;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i]))
            finite = 0;
        double d = fabs(got[i] - want[i]);
        if (d > num)
            num = d;
        if (fabs(want[i]) > den)
            den = fabs(want[i]);
    }
    double rel = num / (den > 1e-12 ? den : 1e-12);
    return dg_check(finite && rel <= tol, "%-44s n=%-7lld rel err=%.3e (max|want|=%.3e, tol %.0e)",
                    name, (long long)n, rel, den, tol);
}

static int tensor_pair(const char *name, const dg_tensor *got, const dg_tensor *want, double **g,
                       double **w) {
    *g = *w = NULL;
    if (dg_tensor_numel(got) != dg_tensor_numel(want)) {
        return dg_check(0, "%s: numel %lld vs %lld", name, (long long)dg_tensor_numel(got),
                        (long long)dg_tensor_numel(want));
    }
    if (dg_tensor_to_f64(got, g) != DG_OK || dg_tensor_to_f64(want, w) != DG_OK) {
        free(*g);
        free(*w);
        return dg_check(0, "%s: copy to host failed: %s", name, dg_last_error());
    }
    return 1;
}

int dg_check_tensor_close(const char *name, const dg_tensor *got, const dg_tensor *want,
                          double atol, double rtol) {
    double *g, *w;
    if (!tensor_pair(name, got, want, &g, &w) || !g)
        return 0;
    int ok = dg_check_close(name, g, w, dg_tensor_numel(want), atol, rtol);
    free(g);
    free(w);
    return ok;
}

int dg_check_tensor_rel(const char *name, const dg_tensor *got, const dg_tensor *want, double tol) {
    double *g, *w;
    if (!tensor_pair(name, got, want, &g, &w) || !g)
        return 0;
    int ok = dg_check_rel(name, g, w, dg_tensor_numel(want), tol);
    free(g);
    free(w);
    return ok;
}

int dg_check_ok(dg_status s, const char *what) {
    if (s == DG_OK)
        return dg_check(1, "%s", what);
    return dg_check(0, "%s -> %s: %s", what, dg_status_str(s), dg_last_error());
}

int dg_check_err(dg_status s, dg_status want, const char *needle, const char *what) {
    const char *msg = dg_last_error();
    int ok = s == want && (!needle || strstr(msg, needle) != NULL);
    return dg_check(ok, "%s -> %s (want %s): \"%s\"", what, dg_status_str(s), dg_status_str(want),
                    msg);
}

dg_tensor *dg_test_rand(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                        double lo, double hi) {
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, ndim, shape, &t));
    DG_TEST_TRY(dg_tensor_rand_uniform(t, seed, lo, hi));
    return t;
}

dg_tensor *dg_test_randn(dg_ctx *ctx, dg_dtype dt, int ndim, const int64_t *shape, uint64_t seed) {
    dg_tensor *t = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, ndim, shape, &t));
    DG_TEST_TRY(dg_tensor_rand_normal(t, seed, 0.0, 1.0));
    return t;
}

dg_status dg_test_along_t(dg_tensor *x, int transpose, dg_tensor **tmp, dg_tensor **xv) {
    *tmp = NULL;
    *xv = x;
    if (!transpose)
        return DG_OK;
    dg_status s = dg_transpose(x, 1, 2, tmp);
    if (s == DG_OK)
        *xv = *tmp;
    return s;
}
