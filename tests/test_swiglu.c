/*
 * tests/test_swiglu.c -- dg_swiglu: y = silu(gate) * up.
 *
 * cpu: f64 gradcheck (both inputs, contiguous and strided), values against a direct loop, f32 vs
 *      f64, bad arguments.  gpu: CUDA (f32, bf16) vs the CPU on the same values, forward and both
 *      gradients, sizes that are not multiples of the block size; device/dtype errors.
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
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_f32_vs_f64(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "swiglu", cpu_cases, test_gpu); }
