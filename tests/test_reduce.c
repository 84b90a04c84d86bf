/*
 * tests/test_reduce.c -- dg_sum and dg_mean along one axis (negative axes, keepdim), dg_sum_all.
 *
 * cpu: f64 gradcheck of every axis with and without keepdim, of sum_all and of a reduction of a
 *      strided view; values and output shapes; empty axes; f32 vs f64 on long sums; errors.
 * gpu: CUDA (f32, bf16) vs a CPU f64 reference from the same input values, forward and backward,
 *      on shapes that take every path of kernels/reduce.cu (warp rows, block rows, two-pass rows,
 *      columns, two-pass columns); bitwise repeatability; errors.
 */
#include "tests/harness.h"

#include <string.h>

typedef struct {
    int op; /* 0 sum, 1 mean, 2 sum_all */
    int axis, keepdim;
    int transpose; /* reduce transpose(x, 0, last) instead of x */
} red_args;

static const char *const k_names[3] = {"sum", "mean", "sum_all"};

static dg_status reduce(dg_ctx *ctx, const red_args *r, dg_tensor *x, dg_tensor **out) {
    if (r->op == 0)
        return dg_sum(ctx, x, r->axis, r->keepdim, out);
    if (r->op == 1)
        return dg_mean(ctx, x, r->axis, r->keepdim, out);
    return dg_sum_all(ctx, x, out);
}

static dg_status red_fn(dg_ctx *ctx, dg_tensor *const *in, int n_in, dg_tensor **out, int n_out,
                        void *user) {
    (void)n_in;
    (void)n_out;
    const red_args *r = user;
    if (!r->transpose)
        return reduce(ctx, r, in[0], &out[0]);
    dg_tensor *t = NULL;
    dg_status s = dg_transpose(in[0], 0, -1, &t);
    if (s == DG_OK)
        s = reduce(ctx, r, t, &out[0]);
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
    int64_t s3[3] = {3, 4, 5}, s1[1] = {7};
    dg_tensor *x = dg_test_rand(cpu, DG_F64, 3, s3, 1, -2, 2);
    dg_tensor *v = dg_test_rand(cpu, DG_F64, 1, s1, 2, -2, 2);
    dg_tensor_set_requires_grad(x, 1);
    dg_tensor_set_requires_grad(v, 1);
    for (int op = 0; op < 2; op++)
        for (int axis = -3; axis < 3; axis++)
            for (int keep = 0; keep < 2; keep++) {
                red_args r = {op, axis, keep, 0};
                dg_gradcheck_report rep;
                dg_status s = dg_gradcheck(cpu, red_fn, &r, &x, 1, 1, 1e-6, 9, &rep);
                /* linear maps: only rounding error in the finite differences */
                dg_check(s == DG_OK && rep.max_rel_err < 1e-6,
                         "gradcheck %s [3,4,5] axis %d keepdim %d: %.2e", k_names[op], axis, keep,
                         rep.max_rel_err);
            }
    for (int op = 0; op < 3; op++) {
        red_args r = {op, -1, 0, 1};
        dg_gradcheck_report rep;
        dg_status s = dg_gradcheck(cpu, red_fn, &r, &x, 1, 1, 1e-6, 9, &rep);
        dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck %s of transpose([3,4,5]): %.2e",
                 k_names[op], rep.max_rel_err);
        r.transpose = 0;
        s = dg_gradcheck(cpu, red_fn, &r, &v, 1, 1, 1e-6, 9, &rep);
        dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck %s of a 1-d [7]: %.2e",
                 k_names[op], rep.max_rel_err);
    }
    red_args r = {2, 0, 0, 0};
    dg_gradcheck_report rep;
    dg_status s = dg_gradcheck(cpu, red_fn, &r, &x, 1, 1, 1e-6, 9, &rep);
    dg_check(s == DG_OK && rep.max_rel_err < 1e-6, "gradcheck sum_all [3,4,5]: %.2e",
             rep.max_rel_err);
    dg_tensor_free(&x);
    dg_tensor_free(&v);
}

static void test_values(dg_ctx *cpu) {
    int64_t s3[3] = {2, 3, 4};
    dg_tensor *x = dg_test_rand(cpu, DG_F64, 3, s3, 3, -1, 1);
    double *xv;
    DG_TEST_TRY(dg_tensor_to_f64(x, &xv));
    for (int axis = 0; axis < 3; axis++) {
        for (int op = 0; op < 2; op++) {
            dg_tensor *y = NULL, *yk = NULL;
            DG_TEST_TRY(op ? dg_mean(cpu, x, axis - 3, 0, &y) : dg_sum(cpu, x, axis, 0, &y));
            DG_TEST_TRY(op ? dg_mean(cpu, x, axis, 1, &yk) : dg_sum(cpu, x, axis, 1, &yk));
            double want[12] = {0}, *yv;
            int64_t n = s3[axis];
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 3; j++)
                    for (int k = 0; k < 4; k++) {
                        int idx[3] = {i, j, k}, o = 0;
                        for (int d = 0; d < 3; d++)
                            if (d != axis)
                                o = o * (int)s3[d] + idx[d];
                        want[o] += xv[(i * 3 + j) * 4 + k] / (op ? (double)n : 1.0);
                    }
            DG_TEST_TRY(dg_tensor_to_f64(y, &yv));
            char name[64];
            snprintf(name, sizeof name, "%s axis %d values", k_names[op], axis);
            /* a different summation order than the loop above: a few ulps */
            dg_check_close(name, yv, want, 24 / n, 1e-15, 1e-13);
            free(yv);
            dg_check(dg_tensor_ndim(y) == 2 && dg_tensor_ndim(yk) == 3 &&
                         dg_tensor_shape(yk)[axis] == 1 && dg_tensor_numel(yk) == 24 / n,
                     "%s axis %d: %s, keepdim %s", k_names[op], axis, dg_tensor_desc(y),
                     dg_tensor_desc(yk));
            dg_tensor_free(&y);
            dg_tensor_free(&yk);
        }
    }
    dg_tensor *y = NULL;
    DG_TEST_TRY(dg_sum_all(cpu, x, &y));
    double tot = 0, got;
    for (int i = 0; i < 24; i++)
        tot += xv[i];
    DG_TEST_TRY(dg_tensor_item(y, &got));
    dg_check(dg_tensor_ndim(y) == 1 && dg_tensor_shape(y)[0] == 1 && fabs(got - tot) < 1e-14,
             "sum_all: %s = %.17g (want %.17g)", dg_tensor_desc(y), got, tot);
    dg_tensor_free(&y);

    /* 1-d without keepdim gives [1]; an empty axis sums to 0 and averages to NaN */
    int64_t s1[1] = {24}, se[2] = {3, 0};
    dg_tensor *v = NULL, *e = NULL;
    DG_TEST_TRY(dg_tensor_from_f64(cpu, DG_F64, 1, s1, xv, &v));
    DG_TEST_TRY(dg_sum(cpu, v, 0, 0, &y));
    DG_TEST_TRY(dg_tensor_item(y, &got));
    dg_check(dg_tensor_ndim(y) == 1 && fabs(got - tot) < 1e-14, "sum of 1-d: %s",
             dg_tensor_desc(y));
    dg_tensor_free(&y);
    DG_TEST_TRY(dg_tensor_new(cpu, DG_F64, 2, se, &e));
    DG_TEST_TRY(dg_sum(cpu, e, 1, 0, &y));
    double *ev;
    DG_TEST_TRY(dg_tensor_to_f64(y, &ev));
    dg_check(dg_tensor_numel(y) == 3 && ev[0] == 0 && ev[2] == 0, "sum over an empty axis: 0");
    free(ev);
    dg_tensor_free(&y);
    DG_TEST_TRY(dg_mean(cpu, e, -1, 1, &y));
    DG_TEST_TRY(dg_tensor_to_f64(y, &ev));
    dg_check(dg_tensor_numel(y) == 3 && isnan(ev[1]), "mean over an empty axis: NaN");
    free(ev);
    dg_tensor_free(&y);
    DG_TEST_TRY(dg_sum(cpu, e, 0, 0, &y));
    dg_check(dg_tensor_numel(y) == 0, "sum of [3,0] over axis 0: %s", dg_tensor_desc(y));
    dg_tensor_free(&y);
    dg_tensor_free(&e);
    dg_tensor_free(&v);
    free(xv);
    dg_tensor_free(&x);
}

static void fwd_bwd(dg_ctx *ctx, const red_args *r, dg_tensor *x, uint64_t gseed, dg_dtype gdt,
                    dg_tensor **y, double **gx) {
    dg_tape_reset();
    dg_tensor_zero_grad(x);
    DG_TEST_TRY(reduce(ctx, r, x, y));
    dg_tensor *gy = dg_test_randn(ctx, gdt, dg_tensor_ndim(*y), dg_tensor_shape(*y), gseed);
    DG_TEST_TRY(dg_tape_backward_with(ctx, *y, gy));
    DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(x), gx));
    dg_tape_reset();
    dg_tensor_free(&gy);
}

static void test_f32(dg_ctx *cpu) {
    int64_t s3[3] = {5, 2001, 3}, s1[1] = {200003};
    dg_tensor *x32 = dg_test_randn(cpu, DG_F32, 3, s3, 4), *x64 = copy_as(cpu, DG_F64, x32);
    dg_tensor *v32 = dg_test_randn(cpu, DG_F32, 1, s1, 5), *v64 = copy_as(cpu, DG_F64, v32);
    dg_tensor *xs[4] = {x64, x32, v64, v32};
    for (int i = 0; i < 4; i++)
        dg_tensor_set_requires_grad(xs[i], 1);
    const red_args cases[5] = {
        {0, 1, 0, 0}, {1, 1, 1, 0}, {0, -1, 0, 0}, {0, 0, 0, 0}, {2, 0, 0, 0}};
    for (int c = 0; c < 6; c++) {
        red_args r = cases[c < 5 ? c : 4];
        dg_tensor *a64 = c < 5 ? x64 : v64, *a32 = c < 5 ? x32 : v32;
        dg_tensor *y64 = NULL, *y32 = NULL;
        double *g64, *g32;
        fwd_bwd(cpu, &r, a64, 8, DG_F32, &y64, &g64); /* same gradient seed values in both */
        fwd_bwd(cpu, &r, a32, 8, DG_F32, &y32, &g32);
        char name[80];
        /* f32 pairwise sums: error ~ log2(n) * 2^-24 of sum |x|, well under 1e-5 */
        char ax[16] = "";
        if (r.op != 2)
            snprintf(ax, sizeof ax, " axis %d", r.axis);
        snprintf(name, sizeof name, "f32 vs f64 %s%s of %s", k_names[r.op], ax,
                 c < 5 ? "[5,2001,3]" : "[200003]");
        dg_check_tensor_rel(name, y32, y64, 1e-5);
        snprintf(name, sizeof name, "f32 vs f64 %s backward (a broadcast: exact)", k_names[r.op]);
        dg_check_close(name, g32, g64, dg_tensor_numel(a32), 0, r.op == 1 ? 1e-7 : 0);
        free(g64);
        free(g32);
        dg_tensor_free(&y64);
        dg_tensor_free(&y32);
    }
    for (int i = 0; i < 4; i++)
        dg_tensor_free(&xs[i]);
}

static void test_errors(dg_ctx *cpu) {
    int64_t s[2] = {2, 3};
    dg_tensor *x = dg_test_rand(cpu, DG_F64, 2, s, 1, 0, 1), *h = NULL, *ii = NULL;
    dg_tensor *y = (dg_tensor *)1;
    DG_TEST_TRY(dg_tensor_new(cpu, DG_BF16, 2, s, &h));
    DG_TEST_TRY(dg_tensor_zeros(cpu, DG_I32, 2, s, &ii));
    dg_check_err(dg_sum(cpu, x, 2, 0, &y), DG_ERR_ARG, "axis 2 is out of range for [2,3]",
                 "sum axis 2 of 2-d");
    dg_check(y == NULL, "failed call leaves out NULL");
    dg_check_err(dg_mean(cpu, x, -3, 1, &y), DG_ERR_ARG, "(valid: -2..1)", "mean axis -3 of 2-d");
    dg_check_err(dg_sum(cpu, NULL, 0, 0, &y), DG_ERR_ARG, "dg_sum: argument 'a' is NULL", "NULL a");
    dg_check_err(dg_sum_all(cpu, x, NULL), DG_ERR_ARG, "dg_sum_all: argument 'out' is NULL",
                 "NULL out");
    dg_check_err(dg_mean(NULL, x, 0, 0, &y), DG_ERR_ARG, "'ctx' is NULL", "NULL ctx");
    dg_check_err(dg_sum_all(cpu, h, &y), DG_ERR_DTYPE, "bf16, which only the CUDA kernels",
                 "bf16 on the CPU");
    dg_check_err(dg_mean(cpu, ii, 0, 0, &y), DG_ERR_DTYPE, "dg_mean: 'a' must have dtype",
                 "mean of i32");
    dg_tensor_free(&x);
    dg_tensor_free(&h);
    dg_tensor_free(&ii);
}

/* ---- gpu ---- */

/* x itself, or transpose(x, 0, last) */
static dg_tensor *view_of(dg_tensor *x, int transpose) {
    dg_tensor *t = NULL;
    if (!transpose)
        return dg_tensor_retain(x);
    DG_TEST_TRY(dg_transpose(x, 0, -1, &t));
    return t;
}

typedef struct {
    int ndim;
    int64_t shape[3];
    red_args r;
    const char *path; /* which kernel path of kernels/reduce.cu the case takes */
} gpu_red_case;

static const gpu_red_case k_gpu_cases[] = {
    {2, {5, 301}, {0, 1, 0, 0}, "warp per row"},
    {2, {3, 5001}, {1, -1, 1, 0}, "block per row"},
    {2, {3, 100003}, {0, 1, 0, 0}, "two-pass rows"},
    {2, {2000, 3}, {1, 0, 0, 0}, "two-pass columns"},
    {3, {7, 33, 65}, {0, 1, 1, 0}, "columns"},
    {3, {4, 1000, 129}, {0, -2, 0, 0}, "two-pass columns"},
    {3, {4, 1000, 129}, {0, 2, 0, 1}, "strided input"},
    {1, {17}, {2, 0, 0, 0}, "sum_all, one warp"},
    {1, {1000003}, {2, 0, 0, 0}, "sum_all, two-pass rows"},
    {3, {300, 70, 3}, {1, 0, 0, 0}, "mean, two-pass columns"},
    {3, {100, 70, 1000}, {1, 1, 0, 0}, "mean, columns, many outputs"},
    {2, {1100, 9001}, {0, 1, 0, 0}, "block per row, many rows"},
};

static void test_gpu(dg_ctx *cpu) {
    dg_ctx *gpu = NULL;
    DG_TEST_TRY(dg_ctx_new(dg_cuda(0), &gpu));
    for (int dt = DG_F32; dt <= DG_BF16; dt++)
        for (size_t c = 0; c < sizeof k_gpu_cases / sizeof *k_gpu_cases; c++) {
            const gpu_red_case *k = &k_gpu_cases[c];
            dg_tensor *xg = dg_test_randn(gpu, (dg_dtype)dt, k->ndim, k->shape, 60 + c);
            dg_tensor *xc = copy_as(cpu, DG_F64, xg);
            dg_tensor_set_requires_grad(xg, 1);
            dg_tensor_set_requires_grad(xc, 1);
            dg_tensor *yg = NULL, *yc = NULL;
            double *gg, *gc;
            /* backward through the transpose view too (views are tape nodes: make each one
             * after the tape reset that precedes its forward); the seed dy has the same values */
            dg_tape_reset();
            dg_tensor *tg = view_of(xg, k->r.transpose);
            DG_TEST_TRY(reduce(gpu, &k->r, tg, &yg));
            dg_tensor *dyg =
                dg_test_randn(gpu, (dg_dtype)dt, dg_tensor_ndim(yg), dg_tensor_shape(yg), 99);
            dg_tensor *dyc = copy_as(cpu, DG_F64, dyg);
            DG_TEST_TRY(dg_tape_backward_with(gpu, yg, dyg));
            dg_tape_reset();
            dg_tensor *tc = view_of(xc, k->r.transpose);
            DG_TEST_TRY(reduce(cpu, &k->r, tc, &yc));
            DG_TEST_TRY(dg_tape_backward_with(cpu, yc, dyc));
            dg_tape_reset();
            DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(xg), &gg));
            DG_TEST_TRY(dg_tensor_to_f64(dg_tensor_grad(xc), &gc));
            /* f32: f32 partial sums in a different order than the f64 CPU sum; bf16: the output
             * is rounded to 8 bits (2^-9) after f32 accumulation */
            double tol = dt == DG_F32 ? 1e-5 : 1e-2;
            char name[112];
            snprintf(name, sizeof name, "cuda %s %s axis %d of [%lld..] (%s)",
                     dg_dtype_name((dg_dtype)dt), k_names[k->r.op], k->r.axis,
                     (long long)k->shape[0], k->path);
            dg_check_tensor_rel(name, yg, yc, tol);
            snprintf(name, sizeof name, "cuda %s %s backward (%s)", dg_dtype_name((dg_dtype)dt),
                     k_names[k->r.op], k->path);
            dg_check_rel(name, gg, gc, dg_tensor_numel(xc), tol);

            /* the same call again gives the same bits */
            dg_tensor *y2 = NULL;
            dg_no_grad_begin();
            DG_TEST_TRY(reduce(gpu, &k->r, tg, &y2));
            dg_no_grad_end();
            snprintf(name, sizeof name, "cuda %s %s repeats bit for bit (%s)",
                     dg_dtype_name((dg_dtype)dt), k_names[k->r.op], k->path);
            dg_check_tensor_close(name, y2, yg, 0, 0);
            free(gg);
            free(gc);
            dg_tensor *all[] = {xg, xc, tg, tc, yg, yc, dyg, dyc, y2};
            for (int i = 0; i < 9; i++)
                dg_tensor_free(&all[i]);
        }

    int64_t s3[1] = {3};
    dg_tensor *hc = dg_test_rand(cpu, DG_F32, 1, s3, 1, 0, 1), *d64 = NULL, *y = NULL;
    DG_TEST_TRY(dg_tensor_new(gpu, DG_F64, 1, s3, &d64));
    dg_check_err(dg_sum(gpu, hc, 0, 0, &y), DG_ERR_DEVICE, "'a' must be on cuda:0",
                 "cpu tensor, cuda ctx");
    dg_check_err(dg_sum_all(gpu, d64, &y), DG_ERR_DTYPE, "f64, which the CUDA kernels do not",
                 "f64 on CUDA");
    dg_tensor_free(&hc);
    dg_tensor_free(&d64);
    dg_ctx_free(&gpu);
}

static void cpu_cases(dg_ctx *cpu) {
    test_gradcheck(cpu);
    test_values(cpu);
    test_f32(cpu);
    test_errors(cpu);
}

int main(int argc, char **argv) { return dg_test_main(argc, argv, "reduce", cpu_cases, test_gpu); }
