/*
 * tests/test_adamw.c -- dg_adamw_step and dg_global_norm.
 *
 * cpu: several AdamW steps (fresh random gradients each step, with and without decay) against
 *      the formula written out in f64, for f64 and f32 params; a NULL gradient changes nothing;
 *      bad arguments. global_norm against a direct f64 sum (NULL entries, strided views, a
 *      tensor past the 64Ki chunk), the same bits for any thread count.
 * gpu: the same AdamW steps on CUDA with f32 and bf16 gradients (rel < 1e-5 against the f64
 *      formula on the same numbers), global_norm against the CPU, bitwise repeatable.
 */
#include "tests/harness.h"

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static const dg_adamw_hparams g_hp = {3e-2, 0.9, 0.95, 1e-8, 0.1};

/* The update as written in the header, in f64. */
static void ref_step(double *p, const double *g, double *m, double *v, int64_t n, int64_t step,
                     const dg_adamw_hparams *hp, int decay) {
    for (int64_t i = 0; i < n; i++) {
        if (decay)
            p[i] -= hp->lr * hp->weight_decay * p[i];
        m[i] = hp->beta1 * m[i] + (1 - hp->beta1) * g[i];
        v[i] = hp->beta2 * v[i] + (1 - hp->beta2) * g[i] * g[i];
        double mhat = m[i] / (1 - pow(hp->beta1, (double)step));
        double vhat = v[i] / (1 - pow(hp->beta2, (double)step));
        p[i] -= hp->lr * mhat / (sqrt(vhat) + hp->eps);
    }
}

static double *host_of(const dg_tensor *t) {
    double *h;
    DG_TEST_TRY(dg_tensor_to_f64(t, &h));
    return h;
}

/* `steps` AdamW steps on ctx (param dtype pdt, grad dtype gdt) vs the f64 formula on the same
 * numbers (the gradients are drawn in gdt, so both sides see identical values). */
static void adamw_vs_formula(dg_ctx *ctx, dg_dtype pdt, dg_dtype gdt, int64_t n, int decay,
                             int steps, double tol) {
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    dg_dtype sdt = pdt; /* m, v follow the params */
    dg_tensor *p = dg_test_randn(ctx, pdt, 1, &n, 1), *m = NULL, *v = NULL;
    DG_TEST_TRY(dg_tensor_zeros(ctx, sdt, 1, &n, &m));
    DG_TEST_TRY(dg_tensor_zeros(ctx, sdt, 1, &n, &v));
    double *rp = host_of(p), *rm = calloc((size_t)n, sizeof *rm),
           *rv = calloc((size_t)n, sizeof *rv);
    for (int step = 1; step <= steps; step++) {
        dg_tensor *gc = dg_test_randn(cpu, gdt, 1, &n, 100 + (uint64_t)step), *g = NULL;
        double *rg = host_of(gc);
        for (int64_t i = 0; i < n; i += 97)
            rg[i] = 0; /* exact zeros: the update is driven by m only */
        dg_tensor_free(&gc);
        DG_TEST_TRY(dg_tensor_from_f64(cpu, gdt, 1, &n, rg, &gc));
        DG_TEST_TRY(dg_to_device(ctx, gc, &g));
        DG_TEST_TRY(dg_adamw_step(ctx, p, g, m, v, step, &g_hp, decay));
        ref_step(rp, rg, rm, rv, n, step, &g_hp, decay);
        free(rg);
        dg_tensor_free(&g);
        dg_tensor_free(&gc);
    }
    char name[128];
    double *hp = host_of(p), *hm = host_of(m), *hv = host_of(v);
    const char *dev = dg_device_str(dg_ctx_device(ctx));
    snprintf(name, sizeof name, "%s adamw %s params, %s grads, %s, %d steps: p", dev,
             dg_dtype_name(pdt), dg_dtype_name(gdt), decay ? "decay" : "no decay", steps);
    dg_check_rel(name, hp, rp, n, tol);
    snprintf(name, sizeof name, "%s adamw %s/%s: m", dev, dg_dtype_name(pdt), dg_dtype_name(gdt));
    dg_check_rel(name, hm, rm, n, tol);
    snprintf(name, sizeof name, "%s adamw %s/%s: v", dev, dg_dtype_name(pdt), dg_dtype_name(gdt));
    dg_check_rel(name, hv, rv, n, tol);
    free(hp);
    free(hm);
    free(hv);
    free(rp);
    free(rm);
    free(rv);
    dg_tensor_free(&p);
    dg_tensor_free(&m);
    dg_tensor_free(&v);
    dg_ctx_free(&cpu);
}

static void test_adamw_cpu(dg_ctx *cpu) {
    /* f64: the same operations as the formula, up to pow() vs the op's bias-correction order */
    adamw_vs_formula(cpu, DG_F64, DG_F64, 1001, 1, 5, 1e-13);
    adamw_vs_formula(cpu, DG_F64, DG_F64, 1001, 0, 5, 1e-13);
    /* f32 math: each step moves p by ~lr with ~1e-7 relative error; 5 steps stay < 1e-6 of |p| */
    adamw_vs_formula(cpu, DG_F32, DG_F32, 1001, 1, 5, 1e-6);

    /* decay = 0 really skips the decay: with zero lr nothing moves, with decay it shrinks. */
    int64_t n = 10;
    dg_tensor *p = dg_test_randn(cpu, DG_F64, 1, &n, 1), *g = dg_test_randn(cpu, DG_F64, 1, &n, 2);
    dg_tensor *m = NULL, *v = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n, &m));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n, &v));
    double *before = host_of(p);
    DG_TEST_TRY(dg_adamw_step(cpu, p, NULL, m, v, 1, &g_hp, 1));
    double *after = host_of(p);
    dg_check(memcmp(before, after, (size_t)n * sizeof *before) == 0,
             "NULL gradient leaves the param unchanged");
    free(after);

    /* bad arguments */
    dg_adamw_hparams bad = g_hp;
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 0, &g_hp, 1), DG_ERR_ARG, "step counts from 1",
                 "step 0");
    bad.beta1 = 1.0;
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 1, &bad, 1), DG_ERR_ARG, "beta1 1", "beta1 = 1");
    dg_check_err(dg_adamw_step(cpu, p, g, m, v, 1, NULL, 1), DG_ERR_ARG, "'hp' is NULL",
                 "NULL hparams");
    int64_t n2 = 11;
    dg_tensor *m2 = NULL, *m32 = NULL, *g32 = NULL, *pm = NULL, *pt = NULL, *gb = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 1, &n2, &m2));
    dg_check_err(dg_adamw_step(cpu, p, g, m2, v, 1, &g_hp, 1), DG_ERR_SHAPE,
                 "'m' must have shape [10]", "m of another shape");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 1, &n, &m32));
    dg_check_err(dg_adamw_step(cpu, p, g, m32, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'m' must be f64 for f64 params", "f32 state for f64 params");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 1, &n, &g32));
    dg_check_err(dg_adamw_step(cpu, p, g32, m, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'grad' must have dtype f64", "f32 grad for f64 params");
    DG_TEST_TRY(dg_to_dtype(cpu, g32, DG_BF16, &gb));
    dg_check_err(dg_adamw_step(cpu, p, gb, m, v, 1, &g_hp, 1), DG_ERR_DTYPE, "'grad'",
                 "bf16 grad on CPU");
    int64_t s2[2] = {2, 5};
    dg_tensor *p2 = dg_test_randn(cpu, DG_F64, 2, s2, 3);
    DG_TEST_TRY(dg_transpose(p2, 0, 1, &pt));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 2, dg_tensor_shape(pt), &pm));
    dg_check_err(dg_adamw_step(cpu, pt, pm, pm, pm, 1, &g_hp, 1), DG_ERR_ARG, "must be contiguous",
                 "strided param");
    dg_tensor *pi = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I64, 1, &n, &pi));
    dg_check_err(dg_adamw_step(cpu, pi, g, m, v, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'param' must have dtype f64/f32", "int param");
    dg_tensor *all[] = {p, g, m, v, m2, m32, g32, pm, pt, gb, p2, pi};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    free(before);
}

/* sqrt(sum of squares) of the non-NULL tensors, directly in f64 (long double accumulation). */
static double ref_norm(const dg_tensor *const *ts, int n) {
    long double s = 0;
    for (int i = 0; i < n; i++) {
        if (!ts[i])
            continue;
        double *h = host_of(ts[i]);
        for (int64_t j = 0; j < dg_tensor_numel(ts[i]); j++)
            s += (long double)h[j] * h[j];
        free(h);
    }
    return sqrt((double)s);
}

static void test_global_norm_cpu(dg_ctx *cpu) {
    int64_t s1[2] = {300, 700}, s2[1] = {17}, s3[2] = {6, 9};
    dg_tensor *a = dg_test_randn(cpu, DG_F32, 2, s1, 1), *b = dg_test_randn(cpu, DG_F64, 1, s2, 2);
    dg_tensor *c = dg_test_randn(cpu, DG_F64, 2, s3, 3), *ct = NULL;
    DG_TEST_TRY(dg_transpose(c, 0, 1, &ct));
    const dg_tensor *ts[4] = {a, NULL, b, ct};
    double got = 0, want = ref_norm(ts, 4);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &got));
    /* 210k squares summed in f64 in chunks vs one long-double sum: ~1e-15 relative */
    dg_check(fabs(got - want) <= 1e-12 * want,
             "global_norm (f32 210k elements, NULL, f64, strided view): %.15g vs %.15g", got, want);
#ifdef _OPENMP
    int nt = omp_get_max_threads();
    double g1 = 0, g2 = 0;
    omp_set_num_threads(1);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &g1));
    omp_set_num_threads(nt > 1 ? nt : 3);
    DG_TEST_TRY(dg_global_norm(cpu, ts, 4, &g2));
    omp_set_num_threads(nt);
    dg_check(g1 == g2, "global_norm: 1 thread == many threads, bitwise (%.17g)", g1);
#endif
    double z = -1;
    DG_TEST_TRY(dg_global_norm(cpu, NULL, 0, &z));
    dg_check(z == 0, "global_norm of an empty list is 0");
    dg_tensor *ii = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I32, 1, s2, &ii));
    const dg_tensor *bad[2] = {a, ii};
    dg_check_err(dg_global_norm(cpu, bad, 2, &z), DG_ERR_DTYPE, "'ts[1]' must have dtype",
                 "int tensor in the list");
    dg_check_err(dg_global_norm(cpu, ts, -1, &z), DG_ERR_ARG, "negative", "negative n");
    dg_check_err(dg_global_norm(cpu, ts, 4, NULL), DG_ERR_ARG, "'out' is NULL", "NULL out");
    dg_tensor_free(&ii);
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    dg_tensor_free(&c);
    dg_tensor_free(&ct);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    /* f32 math on the device (nvcc may fuse multiply-adds): < 1e-6 of |p| after 5 steps, as on
     * the CPU; the gradients, bf16 or f32, are the same numbers on both sides */
    adamw_vs_formula(gpu, DG_F32, DG_F32, 100003, 1, 5, 1e-5);
    adamw_vs_formula(gpu, DG_F32, DG_BF16, 100003, 1, 5, 1e-5);
    adamw_vs_formula(gpu, DG_F32, DG_F32, 4099, 0, 3, 1e-5);

    int64_t s1[1] = {3000017}, s2[2] = {33, 65}, s3[1] = {5};
    dg_tensor *a = dg_test_randn(gpu, DG_F32, 1, s1, 1), *b = dg_test_randn(gpu, DG_BF16, 2, s2, 2);
    dg_tensor *c = dg_test_randn(gpu, DG_F32, 1, s3, 3), *bt = NULL;
    DG_TEST_TRY(dg_transpose(b, 0, 1, &bt));
    const dg_tensor *ts[4] = {a, NULL, bt, c};
    double got = 0, again = 0, want = ref_norm(ts, 4);
    DG_TEST_TRY(dg_global_norm(gpu, ts, 4, &got));
    DG_TEST_TRY(dg_global_norm(gpu, ts, 4, &again));
    /* f64 sums of f32/bf16 squares in a different order than the long-double reference */
    dg_check(fabs(got - want) <= 1e-12 * want,
             "cuda global_norm (3M f32, bf16 view, NULL): "
             "%.15g vs %.15g",
             got, want);
    dg_check(got == again, "cuda global_norm bitwise repeatable");
    dg_tensor *h = NULL;
    DG_TEST_TRY(dg_to_device(cpu, a, &h));
    const dg_tensor *mixed[2] = {a, h};
    dg_check_err(dg_global_norm(gpu, mixed, 2, &got), DG_ERR_DEVICE, "'ts[1]' must be on cuda:0",
                 "cpu tensor in a cuda norm");
    /* a strided param is refused, a bf16 param too (CUDA params are f32) */
    int64_t n = 8;
    dg_tensor *pb = dg_test_randn(gpu, DG_BF16, 1, &n, 1), *m = NULL;
    DG_TEST_TRY(dg_tensor_zeros(gpu, DG_F32, 1, &n, &m));
    dg_check_err(dg_adamw_step(gpu, pb, pb, m, m, 1, &g_hp, 1), DG_ERR_DTYPE,
                 "'param' must have dtype f32", "cuda bf16 params");
    dg_tensor *all[] = {a, b, c, bt, h, pb, m};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
    dg_ctx_free(&gpu);
}

int main(int argc, char **argv) {
    int gpu = dg_test_init(argc, argv, "adamw");
    dg_ctx *cpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cpu(), &cpu));
    if (gpu) {
        int skip = dg_test_need_gpu();
        if (skip) {
            dg_ctx_free(&cpu);
            return skip;
        }
        test_gpu(cpu);
    } else {
        test_adamw_cpu(cpu);
        test_global_norm_cpu(cpu);
    }
    dg_ctx_free(&cpu);
    return dg_test_finish();
}
