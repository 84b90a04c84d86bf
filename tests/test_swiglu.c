/*
 * tests/test_swiglu.c -- dg_swiglu: y = silu(gate) * up, and dg_swiglu_linear: y W^T.
 *
 * cpu: f64 gradcheck (both inputs, contiguous and strided), values against a direct loop, f32 vs
 *      f64, bad arguments; swiglu_linear: f64 gradcheck of gate, up and W under both policies, bit
 *      equality with dg_swiglu then dg_linear (f64, f32; forward and the three gradients), bad
 *      arguments.  gpu: CUDA (f32, bf16) vs the CPU on the same values, forward and both
 *      gradients, sizes that are not multiples of the block size; device/dtype errors;
 *      swiglu_linear on CUDA bit-equal to the two ops and close to the CPU.
 */
#include "tests/harness.h"

typedef struct {
    int transpose; /* inputs are [A, B] and are transposed before the op */
} sw_cfg;

static dg_status swiglu_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                           void *user) {
    (void)n_in;
    (void)n_out;
    const sw_cfg *c = user;
    if (!c->transpose)
        return dg_swiglu(ctx, in[0], in[1], &out[0]);
    dg_tensor *g = NULL, *u = NULL;
    dg_status s = dg_transpose(in[0], 0, 1, &g);
    if (s == DG_OK)
        s = dg_transpose(in[1], 0, 1, &u);
    if (s == DG_OK)
        s = dg_swiglu(ctx, g, u, &out[0]);
    dg_tensor_free(&g);
    dg_tensor_free(&u);
    return s;
}

static dg_tensor *conv(dg_ctx *ctx, dg_tensor *t, dg_dtype dt) {
    dg_tensor *a = NULL, *b = NULL;
    DG_TEST_TRY(dg_to_device(ctx, t, &a));
    DG_TEST_TRY(dg_to_dtype(ctx, a, dt, &b));
    dg_tensor_free(&a);
    return b;
}

/* gate, up, dy on ctx in dt, copied from f64 CPU tensors; grads on gate and up. */
static void run(dg_ctx *ctx, dg_tensor *g, dg_tensor *u, dg_tensor *dy, dg_tensor **y) {
    dg_tensor_set_requires_grad(g, 1);
    dg_tensor_set_requires_grad(u, 1);
    DG_TEST_TRY(dg_swiglu(ctx, g, u, y));
    DG_TEST_TRY(dg_tape_backward_with(ctx, *y, dy));
    dg_tape_reset();
}

static void compare(const char *label, dg_tensor *g1, dg_tensor *u1, dg_tensor *y1, dg_tensor *g0,
                    dg_tensor *u0, dg_tensor *y0, double tol) {
    char name[128];
    snprintf(name, sizeof name, "%s y", label);
    dg_check_tensor_rel(name, y1, y0, tol);
    snprintf(name, sizeof name, "%s dgate", label);
    dg_check_tensor_rel(name, dg_tensor_grad(g1), dg_tensor_grad(g0), tol);
    snprintf(name, sizeof name, "%s dup", label);
    dg_check_tensor_rel(name, dg_tensor_grad(u1), dg_tensor_grad(u0), tol);
}

// ---- cpu

static void test_gradcheck(dg_ctx *cpu) {
    for (int tr = 0; tr <= 1; tr++) {
        int64_t shape[3] = {3, 5, 7}, s2[2] = {9, 4};
        sw_cfg c = {tr};
        /* gate spans [-4, 4] to reach both tails of the sigmoid */
        dg_tensor *g = tr ? dg_test_rand(cpu, DG_F64, 2, s2, 11, -4, 4)
                          : dg_test_rand(cpu, DG_F64, 3, shape, 11, -4, 4);
        dg_tensor *u =
            tr ? dg_test_randn(cpu, DG_F64, 2, s2, 12) : dg_test_randn(cpu, DG_F64, 3, shape, 12);
        dg_tensor_set_requires_grad(g, 1);
        dg_tensor_set_requires_grad(u, 1);
        dg_tensor *in[2] = {g, u};
        dg_gradcheck_report rep;
        const char *what = tr ? "gradcheck swiglu strided" : "gradcheck swiglu [3,5,7]";
        if (dg_check_ok(dg_gradcheck(cpu, swiglu_fn, &c, in, 2, 1, 1e-6, 3, &rep), what))
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err gate %.2e up %.2e (< 1e-6)", what,
                     rep.rel_err[0], rep.rel_err[1]);
        dg_tensor_free(&g);
        dg_tensor_free(&u);
    }
}

static void test_values(dg_ctx *cpu) {
    int64_t n = 41;
    dg_tensor *g = dg_test_rand(cpu, DG_F64, 1, &n, 21, -10, 10);
    dg_tensor *u = dg_test_randn(cpu, DG_F64, 1, &n, 22), *y = NULL;
    DG_TEST_TRY(dg_swiglu(cpu, g, u, &y));
    double *gv, *uv, *yv, ref[41];
    DG_TEST_TRY(dg_tensor_to_f64(g, &gv));
    DG_TEST_TRY(dg_tensor_to_f64(u, &uv));
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    for (int i = 0; i < n; i++)
        ref[i] = gv[i] / (1.0 + exp(-gv[i])) * uv[i];
    /* the same function in the same precision: a few ulps */
    dg_check_close("swiglu f64 forward == g/(1+e^-g)*u", yv, ref, n, 1e-15, 1e-14);
    free(gv);
    free(uv);
    free(yv);
    dg_tensor_free(&y);

    /* silu(0) = 0 and silu(g) -> g for large g */
    double gs[3] = {0.0, 30.0, -30.0}, us[3] = {5.0, 2.0, 2.0}, want[3] = {0.0, 60.0, 0.0};
    int64_t three = 3;
    dg_tensor *g3 = NULL, *u3 = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F32, 1, &three, gs, &g3));
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F32, 1, &three, us, &u3));
    DG_TEST_TRY(dg_swiglu(cpu, g3, u3, &y));
    DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
    /* e^-30 ~ 1e-13: below f32 resolution at 60, and -30 e^-30 ~ 3e-12 */
    dg_check_close("swiglu f32 at 0, +30, -30", yv, want, 3, 1e-11, 1e-7);
    free(yv);
    dg_tensor_free(&y);
    dg_tensor_free(&g3);
    dg_tensor_free(&u3);
    dg_tensor_free(&g);
    dg_tensor_free(&u);
}

static void test_f32_vs_f64(dg_ctx *cpu) {
    int64_t shape[2] = {33, 65};
    dg_tensor *g = dg_test_rand(cpu, DG_F64, 2, shape, 31, -6, 6);
    dg_tensor *u = dg_test_randn(cpu, DG_F64, 2, shape, 32);
    dg_tensor *dy = dg_test_randn(cpu, DG_F64, 2, shape, 33);
    dg_tensor *g32 = conv(cpu, g, DG_F32), *u32 = conv(cpu, u, DG_F32);
    dg_tensor *dy32 = conv(cpu, dy, DG_F32), *y = NULL, *y32 = NULL;
    run(cpu, g, u, dy, &y);
    run(cpu, g32, u32, dy32, &y32);
    /* elementwise: a handful of f32 roundings per value (~1e-7) */
    compare("swiglu cpu f32 vs f64", g32, u32, y32, g, u, y, 1e-6);
    dg_tensor *all[] = {g, u, dy, g32, u32, dy32, y, y32};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

static void test_errors(dg_ctx *cpu) {
    int64_t shape[2] = {4, 6}, s2[2] = {4, 5}, s3[3] = {4, 6, 1};
    dg_tensor *g = dg_test_randn(cpu, DG_F64, 2, shape, 1);
    dg_tensor *u_bad = dg_test_randn(cpu, DG_F64, 2, s2, 2);
    dg_tensor *u_3d = dg_test_randn(cpu, DG_F64, 3, s3, 2);
    dg_tensor *u32 = dg_test_randn(cpu, DG_F32, 2, shape, 2);
    dg_tensor *gb = conv(cpu, g, DG_BF16), *gi = conv(cpu, g, DG_I64), *y = NULL;
    dg_check_err(dg_swiglu(cpu, NULL, g, &y), DG_ERR_ARG, "'gate' is NULL", "swiglu gate NULL");
    dg_check_err(dg_swiglu(cpu, g, NULL, &y), DG_ERR_ARG, "'up' is NULL", "swiglu up NULL");
    dg_check_err(dg_swiglu(cpu, g, g, NULL), DG_ERR_ARG, "'out' is NULL", "swiglu out NULL");
    dg_check_err(dg_swiglu(NULL, g, g, &y), DG_ERR_ARG, "'ctx' is NULL", "swiglu ctx NULL");
    dg_check_err(dg_swiglu(cpu, g, u_bad, &y), DG_ERR_SHAPE, "'up' must have shape [4,6]",
                 "swiglu up [4,5] vs gate [4,6]");
    dg_check_err(dg_swiglu(cpu, g, u_3d, &y), DG_ERR_SHAPE, "'up' must have shape [4,6]",
                 "swiglu up [4,6,1] vs gate [4,6] (no broadcasting)");
    dg_check_err(dg_swiglu(cpu, g, u32, &y), DG_ERR_DTYPE, "'up' must have dtype f64",
                 "swiglu f32 up with f64 gate");
    dg_check_err(dg_swiglu(cpu, gb, gb, &y), DG_ERR_DTYPE, "bf16 is a CUDA dtype",
                 "swiglu bf16 on the CPU");
    dg_check_err(dg_swiglu(cpu, gi, gi, &y), DG_ERR_DTYPE, "dtype", "swiglu i64 inputs");
    dg_check(y == NULL, "failed calls leave the output NULL");
    dg_tensor *all[] = {g, u_bad, u_3d, u32, gb, gi};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

// ---- swiglu_linear

static dg_status sl_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                       void *user) {
    (void)n_in;
    (void)n_out;
    (void)user;
    return dg_swiglu_linear(ctx, in[0], in[1], in[2], &out[0]);
}

/* Exactly equal values (f64 holds every f32 and bf16 value exactly). */
static void check_same(const char *name, const dg_tensor *a, const dg_tensor *b) {
    double *x = NULL, *y = NULL;
    int64_t n = a && b ? dg_tensor_numel(a) : -1;
    if (!dg_check(n >= 0 && n == dg_tensor_numel(b), "%s: both tensors exist, one size", name))
        return;
    DG_TEST_TRY(dg_tensor_to_f64(a, &x));
    DG_TEST_TRY(dg_tensor_to_f64(b, &y));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += x[i] != y[i];
    dg_check(bad == 0, "%s: bit-equal (%lld of %lld differ)", name, (long long)bad, (long long)n);
    free(x);
    free(y);
}

/* gate, up [R.., in], w [out, in] on ctx; out = swiglu_linear (fused) or swiglu then linear,
 * backward with dout; the three gradients stay on the inputs. */
static void sl_run(dg_ctx *ctx, int fused, dg_tensor *g, dg_tensor *u, dg_tensor *w,
                   dg_tensor *dout, dg_tensor **out) {
    dg_tensor_set_requires_grad(g, 1);
    dg_tensor_set_requires_grad(u, 1);
    dg_tensor_set_requires_grad(w, 1);
    if (fused) {
        DG_TEST_TRY(dg_swiglu_linear(ctx, g, u, w, out));
    } else {
        dg_tensor *y = NULL;
        DG_TEST_TRY(dg_swiglu(ctx, g, u, &y));
        DG_TEST_TRY(dg_linear(ctx, y, w, out));
        dg_tensor_free(&y);
    }
    DG_TEST_TRY(dg_tape_backward_with(ctx, *out, dout));
    dg_tape_reset();
}

static void sl_compare(const char *label, int exact, double tol, dg_tensor *const *a,
                       dg_tensor *const *b) {
    static const char *names[] = {"out", "dgate", "dup", "dW"};
    for (int i = 0; i < 4; i++) {
        char name[160];
        snprintf(name, sizeof name, "%s %s", label, names[i]);
        const dg_tensor *x = i ? dg_tensor_grad(a[i - 1]) : a[3];
        const dg_tensor *y = i ? dg_tensor_grad(b[i - 1]) : b[3];
        if (exact)
            check_same(name, x, y);
        else
            dg_check_tensor_rel(name, x, y, tol);
    }
}

static void test_swiglu_linear_cpu(dg_ctx *cpu) {
    int64_t xs[3] = {2, 3, 7}, ws[2] = {4, 7};
    for (int pol = 0; pol < 2; pol++) {
        dg_policy_set("swiglu_linear", pol ? DG_POLICY_CACHE : DG_POLICY_RECOMPUTE);
        const char *pn = pol ? "cache" : "recompute";
        dg_tensor *g = dg_test_rand(cpu, DG_F64, 3, xs, 71, -4, 4);
        dg_tensor *u = dg_test_randn(cpu, DG_F64, 3, xs, 72);
        dg_tensor *w = dg_test_randn(cpu, DG_F64, 2, ws, 73);
        dg_tensor_set_requires_grad(g, 1);
        dg_tensor_set_requires_grad(u, 1);
        dg_tensor_set_requires_grad(w, 1);
        dg_tensor *in[3] = {g, u, w};
        dg_gradcheck_report rep;
        char what[96];
        snprintf(what, sizeof what, "gradcheck swiglu_linear [2,3,7] x [4,7] (%s)", pn);
        if (dg_check_ok(dg_gradcheck(cpu, sl_fn, NULL, in, 3, 1, 1e-6, 3, &rep), what))
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err gate %.2e up %.2e W %.2e (< 1e-6)", what,
                     rep.rel_err[0], rep.rel_err[1], rep.rel_err[2]);
        dg_tensor_free(&g);
        dg_tensor_free(&u);
        dg_tensor_free(&w);

        /* the fused node computes what the two ops compute, in the same order */
        int64_t x2[2] = {37, 29}, w2[2] = {11, 29}, o2[2] = {37, 11};
        for (int dti = 0; dti < 2; dti++) {
            dg_dtype dt = dti ? DG_F32 : DG_F64;
            dg_tensor *v[2][4], *dout = dg_test_randn(cpu, dt, 2, o2, 77);
            for (int f = 0; f < 2; f++) {
                v[f][0] = dg_test_rand(cpu, dt, 2, x2, 74, -6, 6);
                v[f][1] = dg_test_randn(cpu, dt, 2, x2, 75);
                v[f][2] = dg_test_randn(cpu, dt, 2, w2, 76);
                sl_run(cpu, f, v[f][0], v[f][1], v[f][2], dout, &v[f][3]);
            }
            char label[96];
            snprintf(label, sizeof label, "swiglu_linear %s (%s) == swiglu + linear",
                     dg_dtype_name(dt), pn);
            sl_compare(label, 1, 0, v[1], v[0]);
            for (int f = 0; f < 2; f++)
                for (int i = 0; i < 4; i++)
                    dg_tensor_free(&v[f][i]);
            dg_tensor_free(&dout);
        }
    }
    dg_policy_set("swiglu_linear", DG_POLICY_DEFAULT);

    /* bad arguments name the argument and the expected shape/dtype */
    int64_t xs2[2] = {4, 6}, wsg[2] = {3, 6}, wbad[2] = {3, 5}, w3[3] = {1, 3, 6};
    dg_tensor *g = dg_test_randn(cpu, DG_F64, 2, xs2, 1),
              *w = dg_test_randn(cpu, DG_F64, 2, wsg, 2);
    dg_tensor *wb = dg_test_randn(cpu, DG_F64, 2, wbad, 3),
              *w3d = dg_test_randn(cpu, DG_F64, 3, w3, 4);
    dg_tensor *w32 = dg_test_randn(cpu, DG_F32, 2, wsg, 5),
              *u5 = dg_test_randn(cpu, DG_F64, 2, wbad, 6);
    dg_tensor *y = NULL;
    dg_check_err(dg_swiglu_linear(cpu, g, g, NULL, &y), DG_ERR_ARG, "'w' is NULL",
                 "swiglu_linear w NULL");
    dg_check_err(dg_swiglu_linear(cpu, g, g, wb, &y), DG_ERR_SHAPE, "expects in = 5",
                 "swiglu_linear w [3,5] for 6 features");
    dg_check_err(dg_swiglu_linear(cpu, g, g, w3d, &y), DG_ERR_SHAPE, "'w' must be [out, in]",
                 "swiglu_linear 3-D w");
    dg_check_err(dg_swiglu_linear(cpu, g, g, w32, &y), DG_ERR_DTYPE, "'w' must have dtype f64",
                 "swiglu_linear f32 w with f64 gate");
    dg_check_err(dg_swiglu_linear(cpu, g, u5, w, &y), DG_ERR_SHAPE, "'up' must have shape [4,6]",
                 "swiglu_linear up [3,5] vs gate [4,6]");
    dg_check_err(dg_swiglu_linear(cpu, g, g, w, NULL), DG_ERR_ARG, "'out' is NULL",
                 "swiglu_linear out NULL");
    dg_check(y == NULL, "failed swiglu_linear calls leave the output NULL");
    dg_tensor *all[] = {g, w, wb, w3d, w32, u5};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

static void test_swiglu_linear_gpu(dg_ctx *cpu, dg_ctx *gpu) {
    int64_t xs[3] = {3, 67, 96}, ws[2] = {40, 96}, os[3] = {3, 67, 40};
    for (int dti = 0; dti < 2; dti++) {
        dg_dtype dt = dti ? DG_BF16 : DG_F32;
        dg_tensor *gh = dg_test_rand(cpu, DG_F64, 3, xs, 91, -6, 6);
        dg_tensor *uh = dg_test_randn(cpu, DG_F64, 3, xs, 92);
        dg_tensor *wh = dg_test_randn(cpu, DG_F64, 2, ws, 93);
        dg_tensor *dh = dg_test_randn(cpu, DG_F64, 3, os, 94);
        dg_tensor *dd = conv(gpu, dh, dt), *dr = conv(cpu, dd, DG_F64);
        dg_tensor *v[3][4]; /* fused on cuda, two ops on cuda, fused on the cpu (f64) */
        for (int f = 0; f < 3; f++) {
            dg_ctx *c = f < 2 ? gpu : cpu;
            dg_dtype d = f < 2 ? dt : DG_F64;
            dg_tensor *gd = conv(gpu, gh, dt), *ud = conv(gpu, uh, dt), *wd = conv(gpu, wh, dt);
            v[f][0] = conv(c, gd, d);
            v[f][1] = conv(c, ud, d);
            v[f][2] = conv(c, wd, d);
            dg_tensor_free(&gd);
            dg_tensor_free(&ud);
            dg_tensor_free(&wd);
            sl_run(c, f != 1, v[f][0], v[f][1], v[f][2], f < 2 ? dd : dr, &v[f][3]);
        }
        char label[96];
        snprintf(label, sizeof label, "swiglu_linear cuda %s == swiglu + linear",
                 dg_dtype_name(dt));
        sl_compare(label, 1, 0, v[0], v[1]);
        snprintf(label, sizeof label, "swiglu_linear cuda %s vs cpu f64", dg_dtype_name(dt));
        /* f32: sums of 96-201 products in f32 (cuBLAS without TF32); bf16: the product and the
         * outputs are rounded to 8 bits before the GEMMs */
        sl_compare(label, 0, dt == DG_F32 ? 1e-5 : 2e-2, v[0], v[2]);
        for (int f = 0; f < 3; f++)
            for (int i = 0; i < 4; i++)
                dg_tensor_free(&v[f][i]);
        dg_tensor *all[] = {gh, uh, wh, dh, dd, dr};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }
}

// ---- gpu

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    const int64_t sizes[][2] = {{1, 1}, {7, 33}, {129, 1025}};
    for (int si = 0; si < 3; si++) {
        for (int dti = 0; dti < 2; dti++) {
            dg_dtype dt = dti ? DG_BF16 : DG_F32;
            dg_tensor *gh = dg_test_rand(cpu, DG_F64, 2, sizes[si], 40 + si, -6, 6);
            dg_tensor *uh = dg_test_randn(cpu, DG_F64, 2, sizes[si], 50 + si);
            dg_tensor *dh = dg_test_randn(cpu, DG_F64, 2, sizes[si], 60 + si);
            dg_tensor *gd = conv(gpu, gh, dt), *ud = conv(gpu, uh, dt), *dd = conv(gpu, dh, dt);
            dg_tensor *gr = conv(cpu, gd, DG_F64), *ur = conv(cpu, ud, DG_F64);
            dg_tensor *dr = conv(cpu, dd, DG_F64), *yd = NULL, *yr = NULL;
            run(gpu, gd, ud, dd, &yd);
            run(cpu, gr, ur, dr, &yr);
            char label[96];
            snprintf(label, sizeof label, "swiglu cuda %s vs cpu [%lld,%lld]", dg_dtype_name(dt),
                     (long long)sizes[si][0], (long long)sizes[si][1]);
            /* f32: a few roundings per element; bf16: outputs rounded to 8 bits */
            compare(label, gd, ud, yd, gr, ur, yr, dt == DG_F32 ? 1e-5 : 1e-2);
            dg_tensor *all[] = {gh, uh, dh, gd, ud, dd, gr, ur, dr, yd, yr};
            for (size_t i = 0; i < sizeof all / sizeof *all; i++)
                dg_tensor_free(&all[i]);
        }
    }
    /* strided inputs on the device */
    {
        int64_t shape[2] = {45, 31};
        dg_tensor *gh = dg_test_randn(cpu, DG_F64, 2, shape, 81);
        dg_tensor *uh = dg_test_randn(cpu, DG_F64, 2, shape, 82);
        dg_tensor *gd = conv(gpu, gh, DG_F32), *ud = conv(gpu, uh, DG_F32);
        dg_tensor *gdt = NULL, *udt = NULL, *ght = NULL, *uht = NULL, *yd = NULL, *yh = NULL;
        DG_TEST_TRY(dg_transpose(gd, 0, 1, &gdt));
        DG_TEST_TRY(dg_transpose(ud, 0, 1, &udt));
        DG_TEST_TRY(dg_transpose(gh, 0, 1, &ght));
        DG_TEST_TRY(dg_transpose(uh, 0, 1, &uht));
        DG_TEST_TRY(dg_swiglu(gpu, gdt, udt, &yd));
        DG_TEST_TRY(dg_swiglu(cpu, ght, uht, &yh));
        dg_check_tensor_rel("swiglu cuda f32 strided vs cpu", yd, yh, 1e-5);
        dg_tensor *all[] = {gh, uh, gd, ud, gdt, udt, ght, uht, yd, yh};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            dg_tensor_free(&all[i]);
    }
    /* device and dtype errors */
    {
        int64_t shape[2] = {4, 6};
        dg_tensor *h = dg_test_randn(cpu, DG_F32, 2, shape, 1);
        dg_tensor *d = conv(gpu, h, DG_F32), *d64 = conv(gpu, h, DG_F64), *y = NULL;
        dg_check_err(dg_swiglu(gpu, d, h, &y), DG_ERR_DEVICE, "'up' must be on cuda",
                     "swiglu cuda gate with cpu up");
        dg_check_err(dg_swiglu(cpu, d, d, &y), DG_ERR_DEVICE, "'gate' must be on cpu",
                     "swiglu cuda tensors in a cpu context");
        dg_check_err(dg_swiglu(gpu, d64, d64, &y), DG_ERR_DTYPE, "CUDA kernels run f32 or bf16",
                     "swiglu f64 on cuda");
        dg_tensor_free(&h);
        dg_tensor_free(&d);
        dg_tensor_free(&d64);
    }
    test_swiglu_linear_gpu(cpu, gpu);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_f32_vs_f64(cpu);
    test_errors(cpu);
    test_swiglu_linear_cpu(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "swiglu", cpu_cases, test_gpu); }
