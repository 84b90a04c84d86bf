/*
 * tests/test_unary.c -- dg_exp, dg_log, dg_sigmoid, dg_softplus, dg_silu.
 *
 * cpu: f64 gradcheck of each op (both save policies for exp and sigmoid, and a strided input);
 *      values at known points; no overflow for |x| up to 1e4 in f64 and f32; f32 vs f64; errors.
 * gpu: CUDA (f32, bf16) vs a CPU f64 reference from the same input values, forward and backward,
 *      on odd sizes, a strided input and large |x|.
 */
#include "tests/harness.h"

#include <string.h>

typedef dg_status (*unop)(dg_ctx *, dg_tensor *, dg_tensor **);

static const struct {
    const char *name;
    unop f;
    double lo, hi; /* input range for random tests (log needs x > 0) */
} k_ops[5] = {{"exp", dg_exp, -3, 3},
              {"log", dg_log, 0.2, 4},
              {"sigmoid", dg_sigmoid, -6, 6},
              {"softplus", dg_softplus, -6, 6},
              {"silu", dg_silu, -6, 6}};

/* user: index into k_ops. y = f(x) */
static dg_status unop_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                         void *user) {
    (void)n_in;
    (void)n_out;
    return k_ops[*(const int *)user].f(ctx, in[0], &out[0]);
}

/* y = f(transpose(x)) */
static dg_status unop_t_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                           void *user) {
    (void)n_in;
    (void)n_out;
    dg_tensor *t = NULL;
    dg_status s = dg_transpose(in[0], 0, 2, &t);
    if (s == DG_OK)
        s = k_ops[*(const int *)user].f(ctx, t, &out[0]);
    dg_tensor_free(&t);
    return s;
}

static dg_tensor *copy_as(dg_ctx *ctx, dg_dtype dt, const dg_tensor *t) {
    dg_tensor *c = NULL;
    DG_TEST_TRY(dg_tensor_new(ctx, dt, dg_tensor_ndim(t), dg_tensor_shape(t), &c));
    DG_TEST_TRY(dg_tensor_copy_(c, t));
    return c;
}

static void test_gradcheck(dg_ctx *cpu) {
    int64_t shape[3] = {3, 5, 7};
    for (int k = 0; k < 5; k++) {
        dg_tensor *x = dg_test_rand(cpu, DG_F64, 3, shape, 10 + k, k_ops[k].lo, k_ops[k].hi);
        dg_tensor_set_requires_grad(x, 1);
        for (int pol = 0; pol < 2; pol++) {
            dg_policy_reset();
            if (pol)
                dg_policy_set(k_ops[k].name, DG_POLICY_RECOMPUTE);
            dg_gradcheck_report rep;
            dg_status s = dg_gradcheck(cpu, unop_fn, &k, &x, 1, 1, 1e-6, 3, &rep);
            /* smooth maps, central differences with eps 1e-6 in f64 */
            dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck %s [3,5,7] (%s): %.2e",
                     k_ops[k].name, pol ? "recompute" : "cache", rep.max_rel_err);
        }
        dg_policy_reset();
        dg_gradcheck_report rep;
        dg_status s = dg_gradcheck(cpu, unop_t_fn, &k, &x, 1, 1, 1e-6, 4, &rep);
        dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck %s of a transposed view: %.2e",
                 k_ops[k].name, rep.max_rel_err);
        dg_tensor_free(&x);
    }

    /* the policy decides what is kept: recompute shows up in the tape dump */
    int64_t s4[1] = {4};
    dg_tensor *x = dg_test_rand(cpu, DG_F64, 1, s4, 1, -1, 1), *y = NULL;
    dg_tensor_set_requires_grad(x, 1);
    dg_policy_set("sigmoid", DG_POLICY_RECOMPUTE);
    dg_tape_reset();
    DG_TEST_TRY(dg_sigmoid(cpu, x, &y));
    char buf[512] = "";
    FILE *f = tmpfile();
    if (f) {
        dg_tape_dump(f);
        rewind(f);
        size_t nr = fread(buf, 1, sizeof buf - 1, f);
        while (nr > 0 && buf[nr - 1] == '\n')
            nr--;
        buf[nr] = 0;
        fclose(f);
    }
    dg_check(strstr(buf, "sigmoid") && strstr(buf, "recompute"), "tape dump: %s", buf);
    dg_policy_reset();
    dg_tape_reset();
    dg_tensor_free(&y);
    dg_tensor_free(&x);
}

static void test_values(dg_ctx *cpu) {
    const double xs[6] = {-2, -0.5, 0, 0.5, 1, 3};
    int64_t s6[1] = {6};
    for (int k = 0; k < 5; k++) {
        double in[6], want[6], dwant[6];
        for (int i = 0; i < 6; i++) {
            double x = k == 1 ? fabs(xs[i]) + 0.25 : xs[i], sg = 1 / (1 + exp(-x));
            in[i] = x;
            switch (k) {
            case 0:
                want[i] = exp(x), dwant[i] = exp(x);
                break;
            case 1:
                want[i] = log(x), dwant[i] = 1 / x;
                break;
            case 2:
                want[i] = sg, dwant[i] = sg * (1 - sg);
                break;
            case 3:
                want[i] = log(1 + exp(x)), dwant[i] = sg;
                break;
            default:
                want[i] = x * sg, dwant[i] = sg + x * sg * (1 - sg);
                break;
            }
        }
        dg_tensor *x = NULL, *y = NULL;
        DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, s6, in, &x));
        dg_tensor_set_requires_grad(x, 1);
        DG_TEST_TRY(k_ops[k].f(cpu, x, &y));
        dg_tensor *ones = NULL;
        DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 1, s6, &ones));
        DG_TEST_TRY(dg_tensor_fill_(ones, 1.0));
        DG_TEST_TRY(dg_tape_backward_with(cpu, y, ones));
        double *yv, *gv;
        DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
        DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &gv));
        char name[64];
        /* the stable formulas differ from the textbook ones by a few ulps */
        snprintf(name, sizeof name, "%s at known points", k_ops[k].name);
        dg_check_close(name, yv, want, 6, 1e-15, 1e-14);
        snprintf(name, sizeof name, "d%s at known points", k_ops[k].name);
        dg_check_close(name, gv, dwant, 6, 1e-15, 1e-14);
        free(yv);
        free(gv);
        dg_tape_reset();
        dg_tensor_free(&ones);
        dg_tensor_free(&y);
        dg_tensor_free(&x);
    }
}

/* Large |x|: every value and gradient finite, and the right limits. */
static void test_stability(dg_ctx *cpu) {
    const double xs[4] = {-1e4, -100, 100, 1e4};
    int64_t s4[1] = {4};
    for (int dt = DG_F64; dt <= DG_F32; dt++) {
        for (int k = 2; k < 5; k++) { /* sigmoid, softplus, silu */
            dg_tensor *x = NULL, *y = NULL, *ones = NULL;
            DG_TEST_TRY(dg_tensor_from_f64(cpu, (dg_dtype)dt, 1, s4, xs, &x));
            dg_tensor_set_requires_grad(x, 1);
            DG_TEST_TRY(k_ops[k].f(cpu, x, &y));
            DG_TEST_TRY(dg_tensor_new(cpu, (dg_dtype)dt, 1, s4, &ones));
            DG_TEST_TRY(dg_tensor_fill_(ones, 1.0));
            DG_TEST_TRY(dg_tape_backward_with(cpu, y, ones));
            double *yv, *gv;
            DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
            DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &gv));
            int finite = 1;
            for (int i = 0; i < 4; i++)
                finite &= isfinite(yv[i]) && isfinite(gv[i]);
            /* limits: sigmoid -> 0 / 1, softplus -> 0 / x, silu -> 0 / x */
            double hi = k == 2 ? 1 : 1e4;
            int limits = fabs(yv[0]) < 1e-30 && fabs(yv[3] - hi) <= 1e-6 * hi && gv[0] >= 0 &&
                         fabs(gv[3] - (k == 2 ? 0 : 1)) < 1e-6;
            dg_check(finite && limits, "%s %s at +-1e4, +-100: y = %g %g %g %g, dy = %g .. %g",
                     k_ops[k].name, dg_dtype_name((dg_dtype)dt), yv[0], yv[1], yv[2], yv[3], gv[0],
                     gv[3]);
            free(yv);
            free(gv);
            dg_tape_reset();
            dg_tensor_free(&ones);
            dg_tensor_free(&y);
            dg_tensor_free(&x);
        }
    }
}

static void fwd_bwd(dg_ctx *ctx, unop f, dg_tensor *x, dg_tensor *gy, double **y, double **gx) {
    dg_tensor *out = NULL;
    dg_tape_reset();
    dg_tensor_zero_grad(x);
    DG_TEST_TRY(f(ctx, x, &out));
    DG_TEST_TRY(dg_tape_backward_with(ctx, out, gy));
    DG_TEST_TRY(dg_tensor_to_f64(out, y));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), gx));
    dg_tape_reset();
    dg_tensor_free(&out);
}

static void test_f32(dg_ctx *cpu) {
    int64_t s[2] = {33, 31};
    for (int k = 0; k < 5; k++) {
        dg_tensor *x32 = dg_test_rand(cpu, DG_F32, 2, s, 20 + k, k_ops[k].lo, k_ops[k].hi);
        dg_tensor *g32 = dg_test_randn(cpu, DG_F32, 2, s, 30 + k);
        dg_tensor *x64 = copy_as(cpu, DG_F64, x32), *g64 = copy_as(cpu, DG_F64, g32);
        dg_tensor_set_requires_grad(x32, 1);
        dg_tensor_set_requires_grad(x64, 1);
        double *y[2], *gx[2];
        fwd_bwd(cpu, k_ops[k].f, x64, g64, &y[0], &gx[0]);
        fwd_bwd(cpu, k_ops[k].f, x32, g32, &y[1], &gx[1]);
        char name[64];
        /* a few f32 roundings and libm's f32 functions (<= 1-2 ulp each): ~1e-7 of the norm */
        snprintf(name, sizeof name, "f32 vs f64 %s y", k_ops[k].name);
        dg_check_rel(name, y[1], y[0], 33 * 31, 1e-6);
        snprintf(name, sizeof name, "f32 vs f64 %s dx", k_ops[k].name);
        dg_check_rel(name, gx[1], gx[0], 33 * 31, 1e-6);
        for (int i = 0; i < 2; i++) {
            free(y[i]);
            free(gx[i]);
        }
        dg_tensor *all[] = {x32, g32, x64, g64};
        for (int i = 0; i < 4; i++)
            dg_tensor_free(&all[i]);
    }
}

static void test_errors(dg_ctx *cpu) {
    int64_t s[1] = {3};
    dg_tensor *h = NULL, *ii = NULL, *y = (dg_tensor *)1;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_BF16, 1, s, &h));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I64, 1, s, &ii));
    dg_check_err(dg_exp(cpu, NULL, &y), DG_ERR_ARG, "dg_exp: argument 'a' is NULL", "exp(NULL)");
    dg_check(y == NULL, "failed call leaves out NULL");
    dg_check_err(dg_log(cpu, ii, NULL), DG_ERR_ARG, "dg_log: argument 'out' is NULL", "NULL out");
    dg_check_err(dg_sigmoid(NULL, ii, &y), DG_ERR_ARG, "'ctx' is NULL", "NULL ctx");
    dg_check_err(dg_softplus(cpu, ii, &y), DG_ERR_DTYPE, "dg_softplus: 'a' must have dtype f64/f32",
                 "softplus of i64");
    dg_check_err(dg_silu(cpu, h, &y), DG_ERR_DTYPE, "dg_silu: 'a' is bf16, which only the CUDA",
                 "silu of bf16 on the CPU");
    dg_tensor_free(&h);
    dg_tensor_free(&ii);
}

/* ---- gpu ---- */

/* x itself, or its transpose (a view recorded on the tape, so make it after any tape reset) */
static dg_tensor *view_of(dg_tensor *x, int strided) {
    dg_tensor *t = NULL;
    if (!strided)
        return dg_tensor_retain(x);
    DG_TEST_TRY(dg_transpose(x, 0, 1, &t));
    return t;
}

static void gpu_case(dg_ctx *cpu, dg_ctx *gpu, dg_dtype dt, int k, dg_tensor *xg, int strided,
                     const char *what) {
    dg_tensor *xc = copy_as(cpu, DG_F64, xg);
    dg_tensor_set_requires_grad(xg, 1);
    dg_tensor_set_requires_grad(xc, 1);
    dg_tensor *yg = NULL, *yc = NULL;
    dg_tape_reset();
    dg_tensor *tg = view_of(xg, strided);
    DG_TEST_TRY(k_ops[k].f(gpu, tg, &yg));
    dg_tensor *gyg = dg_test_randn(gpu, dt, dg_tensor_ndim(yg), dg_tensor_shape(yg), 77);
    dg_tensor *gyc = copy_as(cpu, DG_F64, gyg);
    DG_TEST_TRY(dg_tape_backward_with(gpu, yg, gyg));
    dg_tape_reset();
    dg_tensor *tc = view_of(xc, strided);
    DG_TEST_TRY(k_ops[k].f(cpu, tc, &yc));
    DG_TEST_TRY(dg_tape_backward_with(cpu, yc, gyc));
    dg_tape_reset();
    /* f32: libdevice vs libm, a few ulps; bf16: values stored with 8 bits (2^-9 relative) */
    double tol = dt == DG_F32 ? 1e-5 : 1e-2;
    char name[96];
    snprintf(name, sizeof name, "cuda %s %s %s: y", dg_dtype_name(dt), k_ops[k].name, what);
    dg_check_tensor_rel(name, yg, yc, tol);
    snprintf(name, sizeof name, "cuda %s %s %s: dx", dg_dtype_name(dt), k_ops[k].name, what);
    dg_check_tensor_rel(name, dg_tensor_grad(xg), dg_tensor_grad(xc), tol);
    dg_tensor *all[] = {xc, tg, tc, yg, yc, gyg, gyc};
    for (int i = 0; i < 7; i++)
        dg_tensor_free(&all[i]);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    int64_t s[2] = {37, 1001}, s4[1] = {4};
    const double big[4] = {-300, -90, 90, 300};
    for (int dt = DG_F32; dt <= DG_BF16; dt++)
        for (int k = 0; k < 5; k++)
            for (int pol = 0; pol < 2; pol++) {
                dg_policy_reset();
                if (pol)
                    dg_policy_set(k_ops[k].name, DG_POLICY_RECOMPUTE);
                dg_tensor *x =
                    dg_test_rand(gpu, (dg_dtype)dt, 2, s, 50 + k, k_ops[k].lo, k_ops[k].hi);
                gpu_case(cpu, gpu, (dg_dtype)dt, k, x, pol,
                         pol ? "[37,1001]^T recompute" : "[37,1001]");
                dg_tensor_free(&x);
                if (k >= 2) { /* large |x| stays finite and matches */
                    DG_TEST_TRY(dg_tensor_from_f64(gpu, (dg_dtype)dt, 1, s4, big, &x));
                    gpu_case(cpu, gpu, (dg_dtype)dt, k, x, 0, "at +-90, +-300");
                    dg_tensor_free(&x);
                }
            }
    dg_policy_reset();

    int64_t s3[1] = {3};
    dg_tensor *hc = dg_test_rand(cpu, DG_F32, 1, s3, 1, 0, 1), *d64 = NULL, *y = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F64, 1, s3, &d64));
    dg_check_err(dg_exp(gpu, hc, &y), DG_ERR_DEVICE, "'a' must be on cuda:0",
                 "cpu tensor, cuda ctx");
    dg_check_err(dg_sigmoid(gpu, d64, &y), DG_ERR_DTYPE, "f64, which the CUDA kernels do not",
                 "f64 on CUDA");
    dg_tensor_free(&hc);
    dg_tensor_free(&d64);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_stability(cpu);
    test_f32(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "unary", cpu_cases, test_gpu); }
