/*
 * tests/test_matmul.c -- dg_matmul and dg_linear.
 *
 * cpu: forward against a naive triple loop (odd sizes, transposed and sliced views, sizes past
 *      the GEMM's cache blocks), f64 gradcheck of every layout (2-D, batched, broadcast B, linear
 *      with 1-D and 3-D x), f32 against f64, results independent of the thread count, bad inputs;
 *      one x read by three linears (dx accumulated inside the later GEMMs) against a direct loop.
 * gpu: cuBLAS against the CPU f64 reference: f64, f32 (rel < 1e-5, which TF32 would miss by
 *      two orders of magnitude at K = 1024), bf16 (rel < 1e-2), forward and both gradients; the
 *      three-linear case in f64, f32 and bf16.
 */
#include "tests/harness.h"

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const char *name;
    int linear; /* dg_linear(x = a, w = b) instead of dg_matmul(a, b) */
    int ta;     /* a arrives as a transposed view of its last two dims */
    int sl;     /* a arrives as a slice [..., 0:K] of a tensor twice as wide */
    int an, bn; /* ndims of a and b as the op sees them */
    int64_t as[3], bs[3];
} mcase;

/* The tensor that holds a's values: the op sees a view of it. */
static void storage_shape(const mcase *c, int64_t *s) {
    memcpy(s, c->as, sizeof c->as);
    if (c->ta) {
        int64_t t = s[c->an - 1];
        s[c->an - 1] = s[c->an - 2];
        s[c->an - 2] = t;
    }
    if (c->sl)
        s[c->an - 1] *= 2;
}

/* The view of the a-storage that the op receives (a new reference). */
static dg_status a_view(const mcase *c, dg_tensor *as, dg_tensor **a) {
    if (c->ta)
        return dg_transpose(as, -1, -2, a);
    if (c->sl)
        return dg_slice(as, -1, 0, c->as[c->an - 1], a);
    *a = dg_tensor_retain(as);
    return DG_OK;
}

static dg_status case_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                         void *user) {
    (void)n_in;
    (void)n_out;
    const mcase *c = user;
    dg_tensor *a = NULL;
    dg_status s = a_view(c, in[0], &a);
    if (s != DG_OK)
        return s;
    s = c->linear ? dg_linear(ctx, a, in[1], &out[0]) : dg_matmul(ctx, a, in[1], &out[0]);
    dg_tensor_free(&a);
    return s;
}

static const mcase g_cases[] = {
    {"matmul 2-D 7x5 @ 5x6", 0, 0, 0, 2, 2, {7, 5}, {5, 6}},
    {"matmul 2-D a transposed view", 0, 1, 0, 2, 2, {6, 4}, {4, 5}},
    {"matmul 2-D a sliced (ld 2K)", 0, 0, 1, 2, 2, {5, 3}, {3, 4}},
    {"matmul batched 3x4x5 @ 3x5x2", 0, 0, 0, 3, 3, {3, 4, 5}, {3, 5, 2}},
    {"matmul batched, a transposed", 0, 1, 0, 3, 3, {2, 3, 4}, {2, 4, 3}},
    {"matmul broadcast 3x4x5 @ 5x3", 0, 0, 0, 3, 2, {3, 4, 5}, {5, 3}},
    {"matmul broadcast, a sliced", 0, 0, 1, 3, 2, {2, 3, 4}, {4, 3}},
    {"linear 3-D x 2x3x5, w 4x5", 1, 0, 0, 3, 2, {2, 3, 5}, {4, 5}},
    {"linear 2-D x transposed", 1, 1, 0, 2, 2, {4, 3}, {5, 3}},
    {"linear 3-D x sliced (ld 2in)", 1, 0, 1, 3, 2, {2, 2, 3}, {4, 3}},
    {"linear 1-D x", 1, 0, 0, 1, 2, {5}, {3, 5}},
};
#define N_CASES ((int)(sizeof g_cases / sizeof *g_cases))

/* Naive f64 reference of the case from the logical values of a and b. */
static double *reference(const mcase *c, const double *a, const double *b, int64_t *n_out) {
    int64_t bt = c->an == 3 && !c->linear ? c->as[0] : 1;
    int64_t M, K, N;
    if (c->linear) {
        K = c->as[c->an - 1];
        M = 1;
        for (int i = 0; i < c->an - 1; i++)
            M *= c->as[i];
        N = c->bs[0];
    } else {
        M = c->as[c->an - 2];
        K = c->as[c->an - 1];
        N = c->bs[c->bn - 1];
    }
    double *y = calloc((size_t)(bt * M * N), sizeof *y);
    for (int64_t q = 0; q < bt; q++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t p = 0; p < K; p++) {
                    double av = a[(q * M + i) * K + p];
                    double bv = c->linear    ? b[j * K + p]
                                : c->bn == 3 ? b[(q * K + p) * N + j]
                                             : b[p * N + j];
                    s += av * bv;
                }
                y[(q * M + i) * N + j] = s;
            }
    *n_out = bt * M * N;
    return y;
}

static void test_forward_values(dg_ctx *cpu) {
    for (int ci = 0; ci < N_CASES; ci++) {
        const mcase *c = &g_cases[ci];
        int64_t ss[3];
        storage_shape(c, ss);
        dg_tensor *as = dg_test_randn(cpu, DG_F64, c->an, ss, 100 + ci);
        dg_tensor *b = dg_test_randn(cpu, DG_F64, c->bn, c->bs, 200 + ci);
        dg_tensor *a = NULL, *y = NULL;
        DG_TEST_TRY(a_view(c, as, &a));
        DG_TEST_TRY(case_fn(cpu, (dg_tensor *[]){as, b}, 2, &y, 1, (void *)c));
        double *av, *bv, *yv;
        DG_TEST_TRY(dg_tensor_to_f64(a, &av));
        DG_TEST_TRY(dg_tensor_to_f64(b, &bv));
        DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
        int64_t n;
        double *want = reference(c, av, bv, &n);
        char name[96];
        snprintf(name, sizeof name, "%s: forward == naive", c->name);
        dg_check(dg_tensor_numel(y) == n, "%s: output has %lld elements (want %lld)", c->name,
                 (long long)dg_tensor_numel(y), (long long)n);
        /* the same products summed in another order: a few ulps of f64 */
        dg_check_close(name, yv, want, n, 1e-13, 1e-12);
        free(av);
        free(bv);
        free(yv);
        free(want);
        dg_tensor_free(&a);
        dg_tensor_free(&y);
        dg_tensor_free(&as);
        dg_tensor_free(&b);
    }
}

/* Shapes past the CPU GEMM's blocks (KC 256, NC 2048, MC 96), with transposes. */
static void test_blocking(dg_ctx *cpu) {
    static const mcase big[] = {
        {"matmul 37x29 @ 29x53 (odd)", 0, 0, 0, 2, 2, {37, 29}, {29, 53}},
        {"matmul 130x300 @ 300x70 (k > KC)", 0, 0, 0, 2, 2, {130, 300}, {300, 70}},
        {"matmul 5x260 @ 260x2100 (n > NC)", 0, 1, 0, 2, 2, {5, 260}, {260, 2100}},
        {"linear 2x100x300, w 33x300", 1, 0, 0, 3, 2, {2, 100, 300}, {33, 300}},
        /* many small items: the GEMM runs one item per thread */
        {"matmul batched 24x64x48 @ 24x48x40", 0, 1, 0, 3, 3, {24, 64, 48}, {24, 48, 40}},
    };
    for (int ci = 0; ci < (int)(sizeof big / sizeof *big); ci++) {
        const mcase *c = &big[ci];
        for (int dt = DG_F64; dt <= DG_F32; dt++) {
            int64_t ss[3];
            storage_shape(c, ss);
            dg_tensor *as = dg_test_randn(cpu, (dg_dtype)dt, c->an, ss, 300 + ci);
            dg_tensor *b = dg_test_randn(cpu, (dg_dtype)dt, c->bn, c->bs, 400 + ci);
            dg_tensor *a = NULL, *y = NULL;
            DG_TEST_TRY(a_view(c, as, &a));
            DG_TEST_TRY(case_fn(cpu, (dg_tensor *[]){as, b}, 2, &y, 1, (void *)c));
            double *av, *bv;
            DG_TEST_TRY(dg_tensor_to_f64(a, &av));
            DG_TEST_TRY(dg_tensor_to_f64(b, &bv));
            int64_t n;
            double *want = reference(c, av, bv, &n);
            double *yv;
            DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
            char name[96];
            snprintf(name, sizeof name, "%s %s", c->name, dg_dtype_name((dg_dtype)dt));
            /* f64: reordering only. f32: the inputs are the same f32 numbers, so the error is
             * f32 accumulation over K <= 300 terms: ~sqrt(K) * 6e-8 relative to the row norm */
            dg_check_rel(name, yv, want, n, dt == DG_F64 ? 1e-13 : 1e-5);
            free(av);
            free(bv);
            free(yv);
            free(want);
            dg_tensor_free(&a);
            dg_tensor_free(&y);
            dg_tensor_free(&as);
            dg_tensor_free(&b);
        }
    }
#ifdef _OPENMP
    /* Each C element is summed by one thread in a fixed order: bitwise equal for 1 or n threads,
     * whether the team splits one matrix by row blocks or takes whole batch items. */
    static const int64_t shp[2][2][3] = {{{190, 300}, {300, 150}}, {{24, 64, 48}, {24, 48, 40}}};
    for (int k = 0; k < 2; k++) {
        int nd = k ? 3 : 2;
        dg_tensor *a = dg_test_randn(cpu, DG_F32, nd, shp[k][0], 1);
        dg_tensor *b = dg_test_randn(cpu, DG_F32, nd, shp[k][1], 2);
        dg_tensor *y1 = NULL, *y2 = NULL;
        int nt = omp_get_max_threads();
        omp_set_num_threads(1);
        DG_TEST_TRY(dg_matmul(cpu, a, b, &y1));
        omp_set_num_threads(nt > 1 ? nt : 2);
        DG_TEST_TRY(dg_matmul(cpu, a, b, &y2));
        omp_set_num_threads(nt);
        dg_check_tensor_close(k ? "f32 batched GEMM: 1 thread == many threads (bitwise)"
                                : "f32 GEMM: 1 thread == many threads (bitwise)",
                              y2, y1, 0, 0);
        dg_tensor_free(&a);
        dg_tensor_free(&b);
        dg_tensor_free(&y1);
        dg_tensor_free(&y2);
    }
#endif
}

static void test_gradcheck(dg_ctx *cpu) {
    for (int ci = 0; ci < N_CASES; ci++) {
        const mcase *c = &g_cases[ci];
        int64_t ss[3];
        storage_shape(c, ss);
        dg_tensor *in[2] = {dg_test_randn(cpu, DG_F64, c->an, ss, 500 + ci),
                            dg_test_randn(cpu, DG_F64, c->bn, c->bs, 600 + ci)};
        dg_tensor_set_requires_grad(in[0], 1);
        dg_tensor_set_requires_grad(in[1], 1);
        dg_gradcheck_report rep;
        char name[96];
        snprintf(name, sizeof name, "gradcheck %s", c->name);
        if (dg_check_ok(dg_gradcheck(cpu, case_fn, (void *)c, in, 2, 1, 1e-6, 7, &rep), name))
            /* bilinear: central differences are exact up to rounding */
            dg_check(rep.max_rel_err < 1e-6, "%s: rel err a %.2e, b %.2e < 1e-6", name,
                     rep.rel_err[0], rep.rel_err[1]);
        dg_tensor_free(&in[0]);
        dg_tensor_free(&in[1]);
    }
    /* Only one side requiring grad: the other gets none, and the gradient is still right. */
    const mcase *c = &g_cases[0];
    dg_tensor *in[2] = {dg_test_randn(cpu, DG_F64, 2, c->as, 1),
                        dg_test_randn(cpu, DG_F64, 2, c->bs, 2)};
    dg_tensor_set_requires_grad(in[1], 1);
    dg_gradcheck_report rep;
    dg_check_ok(dg_gradcheck(cpu, case_fn, (void *)c, in, 2, 1, 1e-6, 3, &rep),
                "gradcheck matmul, only b requires grad");
    dg_check(rep.rel_err[1] < 1e-6 && dg_tensor_grad(in[0]) == NULL,
             "b-only: rel err %.2e, a has no gradient", rep.rel_err[1]);
    dg_tensor_free(&in[0]);
    dg_tensor_free(&in[1]);
}

/* Values and gradients of one case on (ctx, dt), from f64 host data (rounded to dt). */
typedef struct {
    double *y, *ga, *gb;
    int64_t ny, na, nb;
} mresult;

static void run_case(dg_ctx *ctx, dg_dtype dt, const mcase *c, const double *ah, const double *bh,
                     const double *gyh, mresult *r) {
    int64_t ss[3];
    storage_shape(c, ss);
    dg_tensor *as = NULL, *b = NULL, *y = NULL, *gy = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, c->an, ss, ah, &as));
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, c->bn, c->bs, bh, &b));
    dg_tensor_set_requires_grad(as, 1);
    dg_tensor_set_requires_grad(b, 1);
    DG_TEST_TRY(case_fn(ctx, (dg_tensor *[]){as, b}, 2, &y, 1, (void *)c));
    DG_TEST_TRY(dg_tensor_from_f64(ctx, dt, dg_tensor_ndim(y), dg_tensor_shape(y), gyh, &gy));
    DG_TEST_TRY(dg_tape_backward_with(ctx, y, gy));
    DG_TEST_TRY(dg_tensor_to_f64(y, &r->y));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(as), &r->ga));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(b), &r->gb));
    r->ny = dg_tensor_numel(y);
    r->na = dg_tensor_numel(as);
    r->nb = dg_tensor_numel(b);
    dg_tape_reset();
    dg_tensor_free(&as);
    dg_tensor_free(&b);
    dg_tensor_free(&y);
    dg_tensor_free(&gy);
}

static void free_result(mresult *r) {
    free(r->y);
    free(r->ga);
    free(r->gb);
}

/* Host data for a case: a, b and the output gradient, rounded through `dt`. */
static void case_data(dg_ctx *cpu, const mcase *c, dg_dtype dt, uint64_t seed, double **ah,
                      double **bh, double **gyh) {
    int64_t ss[3];
    storage_shape(c, ss);
    dg_tensor *t[3];
    t[0] = dg_test_randn(cpu, dt, c->an, ss, seed);
    t[1] = dg_test_randn(cpu, dt, c->bn, c->bs, seed + 1);
    /* the output gradient: shape from a forward run in f64 */
    dg_tensor *a0 = dg_test_randn(cpu, DG_F64, c->an, ss, 1), *b0 = NULL, *y0 = NULL;
    b0 = dg_test_randn(cpu, DG_F64, c->bn, c->bs, 2);
    DG_TEST_TRY(case_fn(cpu, (dg_tensor *[]){a0, b0}, 2, &y0, 1, (void *)c));
    t[2] = dg_test_randn(cpu, dt, dg_tensor_ndim(y0), dg_tensor_shape(y0), seed + 2);
    DG_TEST_TRY(dg_tensor_to_f64(t[0], ah));
    DG_TEST_TRY(dg_tensor_to_f64(t[1], bh));
    DG_TEST_TRY(dg_tensor_to_f64(t[2], gyh));
    for (int i = 0; i < 3; i++)
        dg_tensor_free(&t[i]);
    dg_tensor_free(&a0);
    dg_tensor_free(&b0);
    dg_tensor_free(&y0);
}

static void compare_case(dg_ctx *cpu, dg_ctx *dev, const mcase *c, dg_dtype dev_dt,
                         dg_dtype data_dt, double tol, uint64_t seed) {
    double *ah, *bh, *gyh;
    case_data(cpu, c, data_dt, seed, &ah, &bh, &gyh);
    mresult want, got;
    run_case(cpu, DG_F64, c, ah, bh, gyh, &want);
    run_case(dev, dev_dt, c, ah, bh, gyh, &got);
    char name[128];
    snprintf(name, sizeof name, "%s %s %s: y", dg_device_str(dg_ctx_device(dev)),
             dg_dtype_name(dev_dt), c->name);
    dg_check_rel(name, got.y, want.y, want.ny, tol);
    snprintf(name, sizeof name, "%s %s %s: da", dg_device_str(dg_ctx_device(dev)),
             dg_dtype_name(dev_dt), c->name);
    dg_check_rel(name, got.ga, want.ga, want.na, tol);
    snprintf(name, sizeof name, "%s %s %s: db", dg_device_str(dg_ctx_device(dev)),
             dg_dtype_name(dev_dt), c->name);
    dg_check_rel(name, got.gb, want.gb, want.nb, tol);
    free_result(&want);
    free_result(&got);
    free(ah);
    free(bh);
    free(gyh);
}

static void test_f32_vs_f64(dg_ctx *cpu) {
    for (int ci = 0; ci < N_CASES; ci++)
        /* inputs are f32 numbers in both runs; f32 sums over K <= 6 terms: a few ulps */
        compare_case(cpu, cpu, &g_cases[ci], DG_F32, DG_F32, 1e-6, 700 + ci);
    static const mcase k100 = {"matmul 37x100 @ 100x29", 0, 0, 0, 2, 2, {37, 100}, {100, 29}};
    /* K = 100: f32 accumulation error ~ sqrt(K) * 6e-8 ~ 1e-6 of the row norm */
    compare_case(cpu, cpu, &k100, DG_F32, DG_F32, 1e-5, 800);
}

static void test_errors(dg_ctx *cpu) {
    int64_t s34[2] = {3, 4}, s56[2] = {5, 6}, s3[1] = {3}, s245[3] = {2, 4, 5}, s356[3] = {3, 5, 6};
    dg_tensor *a = dg_test_randn(cpu, DG_F64, 2, s34, 1),
              *b = dg_test_randn(cpu, DG_F64, 2, s56, 2);
    dg_tensor *y = NULL;
    dg_check_err(dg_matmul(cpu, a, b, &y), DG_ERR_SHAPE, "[3,4] f64 cpu", "inner dim: names a");
    dg_check_err(dg_matmul(cpu, a, b, &y), DG_ERR_SHAPE, "[5,6] f64 cpu", "inner dim: names b");
    dg_tensor *ai = NULL, *af = NULL, *ab = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I32, 2, s34, &ai));
    dg_check_err(dg_matmul(cpu, ai, b, &y), DG_ERR_DTYPE, "must have dtype f64/f32/bf16",
                 "int dtype for matmul");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F32, 2, s56, &af));
    dg_check_err(dg_matmul(cpu, b, af, &y), DG_ERR_DTYPE, "like the other inputs", "mixed f64/f32");
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_BF16, 2, s34, &ab));
    dg_check_err(dg_matmul(cpu, ab, ab, &y), DG_ERR_DTYPE, "bf16 is a CUDA dtype", "bf16 on CPU");
    dg_check_err(dg_matmul(cpu, NULL, b, &y), DG_ERR_ARG, "'a' is NULL", "NULL a");
    dg_check_err(dg_matmul(cpu, a, b, NULL), DG_ERR_ARG, "'out' is NULL", "NULL out");
    dg_check_err(dg_matmul(NULL, a, b, &y), DG_ERR_ARG, "'ctx' is NULL", "NULL ctx");
    dg_tensor *v = dg_test_randn(cpu, DG_F64, 1, s3, 3);
    dg_check_err(dg_matmul(cpu, v, b, &y), DG_ERR_SHAPE, "expected a [M,K]", "1-D a");
    dg_tensor *a3 = dg_test_randn(cpu, DG_F64, 3, s245, 4),
              *b3 = dg_test_randn(cpu, DG_F64, 3, s356, 5);
    dg_check_err(dg_matmul(cpu, a3, b3, &y), DG_ERR_SHAPE, "batch sizes differ", "batch mismatch");
    dg_check_err(dg_matmul(cpu, a, b3, &y), DG_ERR_SHAPE, "expected a [M,K]", "2-D a, 3-D b");
    dg_check_err(dg_linear(cpu, a, b, &y), DG_ERR_SHAPE, "expects in = 6", "linear in mismatch");
    dg_check_err(dg_linear(cpu, a, a3, &y), DG_ERR_SHAPE, "'w' must be [out, in]", "linear 3-D w");
    dg_check_err(dg_linear(cpu, ai, b, &y), DG_ERR_DTYPE, "'x' must have dtype", "linear int x");
    dg_check(y == NULL, "failed calls leave the output NULL");

    /* Empty inner dimension: the product is all zeros. */
    int64_t s30[2] = {3, 0}, s02[2] = {0, 2};
    dg_tensor *e1 = NULL, *e2 = NULL;
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 2, s30, &e1));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_F64, 2, s02, &e2));
    if (dg_check_ok(dg_matmul(cpu, e1, e2, &y), "matmul with K = 0")) {
        double *yv;
        DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
        int ok = dg_tensor_numel(y) == 6;
        for (int i = 0; i < 6 && ok; i++)
            ok = yv[i] == 0;
        dg_check(ok, "K = 0 gives a [3,2] zero matrix");
        free(yv);
    }
    dg_tensor *all[] = {a, b, ai, af, ab, v, a3, b3, e1, e2, y};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        dg_tensor_free(&all[i]);
}

/* x [2,9,23] read by three linears w_i [17,23]; loss sum_i <y_i, dy_i>. dx = sum_i dy_i W_i: the
 * first linear's backward creates x's gradient, the next two add to it inside their GEMMs. Checked
 * against a direct f64 loop over the same (dt-rounded) values. */
static void test_linear_shared(dg_ctx *cpu, dg_ctx *ctx, dg_dtype dt, double tol) {
    const int64_t R = 18, IN = 23, OUT = 17, xs[3] = {2, 9, 23}, ws[2] = {17, 23},
                  ys[3] = {2, 9, 17};
    dg_tensor *xh = dg_test_randn(cpu, DG_F64, 3, xs, 61), *x = NULL, *y[3] = {0}, *dy[3] = {0};
    dg_tensor *w[3] = {0};
    double *xv = NULL, *wv[3], *dyv[3], *want = calloc((size_t)(R * IN), sizeof(double));
    DG_TEST_TRY(dg_to_device(ctx, xh, &x));
    dg_tensor *xr = NULL;
    DG_TEST_TRY(dg_to_dtype(ctx, x, dt, &xr));
    dg_tensor_free(&x);
    x = xr;
    dg_tensor_set_requires_grad(x, 1);
    for (int i = 0; i < 3; i++) {
        dg_tensor *wh = dg_test_randn(cpu, DG_F64, 2, ws, 62 + (uint64_t)i), *t = NULL;
        dg_tensor *gh = dg_test_randn(cpu, DG_F64, 3, ys, 72 + (uint64_t)i);
        DG_TEST_TRY(dg_to_device(ctx, wh, &t));
        DG_TEST_TRY(dg_to_dtype(ctx, t, dt, &w[i]));
        dg_tensor_free(&t);
        DG_TEST_TRY(dg_to_device(ctx, gh, &t));
        DG_TEST_TRY(dg_to_dtype(ctx, t, dt, &dy[i]));
        dg_tensor_free(&t);
        DG_TEST_TRY(dg_tensor_to_f64(w[i], &wv[i]));
        DG_TEST_TRY(dg_tensor_to_f64(dy[i], &dyv[i]));
        DG_TEST_TRY(dg_linear(ctx, x, w[i], &y[i]));
        dg_tensor_free(&wh);
        dg_tensor_free(&gh);
    }
    DG_TEST_TRY(dg_tape_backward_multi(ctx, 3, y, (const dg_tensor *const *)dy));
    for (int i = 0; i < 3; i++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < IN; j++)
                for (int64_t o = 0; o < OUT; o++)
                    want[r * IN + j] += dyv[i][r * OUT + o] * wv[i][o * IN + j];
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), &xv));
    char name[96];
    snprintf(name, sizeof name, "%s %s linear x3 sharing x: dx", dg_device_str(dg_ctx_device(ctx)),
             dg_dtype_name(dt));
    dg_check_rel(name, xv, want, R * IN, tol);
    dg_tape_reset();
    free(xv);
    free(want);
    for (int i = 0; i < 3; i++) {
        free(wv[i]);
        free(dyv[i]);
        dg_tensor_free(&w[i]);
        dg_tensor_free(&dy[i]);
        dg_tensor_free(&y[i]);
    }
    dg_tensor_free(&x);
    dg_tensor_free(&xh);
}

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    static const mcase extra[] = {
        {"matmul 37x29 @ 29x53 (odd)", 0, 0, 0, 2, 2, {37, 29}, {29, 53}},
        {"matmul 64x100 @ 100x96 (K ~ 100)", 0, 0, 0, 2, 2, {64, 100}, {100, 96}},
        {"matmul 33x1024 @ 1024x65 (TF32 would fail)", 0, 1, 0, 2, 2, {33, 1024}, {1024, 65}},
        {"matmul batched 5x37x53 @ 5x53x29", 0, 0, 0, 3, 3, {5, 37, 53}, {5, 53, 29}},
        {"matmul broadcast 4x37x53 @ 53x29", 0, 0, 0, 3, 2, {4, 37, 53}, {53, 29}},
        {"linear 3x17x100, w 65x100", 1, 0, 0, 3, 2, {3, 17, 100}, {65, 100}},
    };
    for (int pass = 0; pass < 2; pass++) {
        const mcase *cs = pass ? extra : g_cases;
        int n = pass ? (int)(sizeof extra / sizeof *extra) : N_CASES;
        for (int ci = 0; ci < n; ci++) {
            uint64_t seed = 1000 + 10 * (uint64_t)ci + 500 * (uint64_t)pass;
            /* f64 on cuBLAS: the same sums in another order */
            compare_case(cpu, gpu, &cs[ci], DG_F64, DG_F64, 1e-12, seed);
            /* f32 data, f32 GEMM vs f64 truth: f32 accumulation over K <= 1024 terms stays well
             * under 1e-5 of the largest value; TF32 (10-bit mantissa) would give ~1e-3 */
            compare_case(cpu, gpu, &cs[ci], DG_F32, DG_F32, 1e-5, seed);
            /* bf16 data (exactly representable in the f64 reference), f32 accumulation, one
             * bf16 rounding of each output: <= 2^-9 relative, plus accumulation */
            compare_case(cpu, gpu, &cs[ci], DG_BF16, DG_BF16, 1e-2, seed);
        }
    }
    test_linear_shared(cpu, gpu, DG_F64, 1e-12);
    test_linear_shared(cpu, gpu, DG_F32, 1e-5);
    /* bf16 inputs exact in the loop; the sum of three products rounded once per GEMM */
    test_linear_shared(cpu, gpu, DG_BF16, 1e-2);
    /* Device mismatch and the f32 no-TF32 guard are reported, not crashed on. */
    int64_t s34[2] = {3, 4}, s45[2] = {4, 5};
    dg_tensor *a = dg_test_randn(gpu, DG_F32, 2, s34, 1),
              *b = dg_test_randn(cpu, DG_F32, 2, s45, 2);
    dg_tensor *y = NULL;
    dg_check_err(dg_matmul(gpu, a, b, &y), DG_ERR_DEVICE, "'b' must be on cuda:0",
                 "a on cuda, b on cpu");
    dg_tensor_free(&a);
    dg_tensor_free(&b);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_forward_values(cpu);
    test_blocking(cpu);
    test_gradcheck(cpu);
    test_f32_vs_f64(cpu);
    test_errors(cpu);
    test_linear_shared(cpu, cpu, DG_F64, 1e-12);
    test_linear_shared(cpu, cpu, DG_F32, 1e-5);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "matmul", cpu_cases, test_gpu); }
