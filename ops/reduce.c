/*
 * ops/reduce.c -- dg_sum and dg_mean along one axis, dg_sum_all, and the summation primitives the
 * broadcasting ops use for their gradients (ops/elementwise.h).
 *
 *   sum      y[o,i] = sum_j x[o,j,i]            dx[o,j,i] = dy[o,i]
 *   mean     y[o,i] = (1/n) sum_j x[o,j,i]      dx[o,j,i] = dy[o,i] / n
 *   sum_all  y[0]   = sum of every x            dx = dy[0] everywhere
 *
 * Shapes: x [..., n, ...] with the reduced axis in the middle, viewed as [outer, n, inner]; y drops
 * that axis, or keeps it as 1 with keepdim. A 1-d x reduced without keepdim gives [1] (tensors
 * have at least one dim); sum_all gives [1]. The mean over an empty axis is NaN, as in NumPy.
 *
 * Every output is summed in one fixed order (CPU: pairwise; CUDA: see kernels/reduce.cu), so
 * results do not depend on the number of threads.
 */
#include "../autograd/tape.h"
#include "../kernels/reduce.cuh"
#include "elementwise.h"

#include <math.h>

/* ---- reference (CPU) ---------------------------------------------------------------------- */

/* `#pragma omp parallel for if (cond)` from inside a macro */
#ifdef _OPENMP
#define DG_PRAGMA(x) _Pragma(#x)
#define DG_OMP_FOR(cond) DG_PRAGMA(omp parallel for if (cond))
#else
#define DG_OMP_FOR(cond)
#endif

/* Pairwise summation: halves down to SUM_BLOCK values, which are added in order. The rounding
 * error grows like log2(n) rather than n, f32 stays f32, and the order depends only on n. */
#define SUM_BLOCK 32
/* inner > 1: COLS neighbouring columns are summed together, reading rows of x in order. */
#define COLS 64

#define DEFINE_SUM_MID_CPU(T)                                                                      \
    static T pairwise_##T(const T *x, int64_t n) {                                                 \
        if (n <= SUM_BLOCK) {                                                                      \
            T s = 0;                                                                               \
            for (int64_t j = 0; j < n; j++)                                                        \
                s += x[j];                                                                         \
            return s;                                                                              \
        }                                                                                          \
        return pairwise_##T(x, n / 2) + pairwise_##T(x + n / 2, n - n / 2);                        \
    }                                                                                              \
    /* acc[i] = sum_j x[j*inner + i] for i < w, the same pairwise order per column */              \
    static void pairwise_cols_##T(const T *x, int64_t n, int64_t inner, int64_t w, T *acc) {       \
        for (int64_t i = 0; i < w; i++)                                                            \
            acc[i] = 0;                                                                            \
        if (n <= SUM_BLOCK) {                                                                      \
            for (int64_t j = 0; j < n; j++)                                                        \
                for (int64_t i = 0; i < w; i++)                                                    \
                    acc[i] += x[j * inner + i];                                                    \
            return;                                                                                \
        }                                                                                          \
        T right[COLS];                                                                             \
        pairwise_cols_##T(x, n / 2, inner, w, acc);                                                \
        pairwise_cols_##T(x + n / 2 * inner, n - n / 2, inner, w, right);                          \
        for (int64_t i = 0; i < w; i++)                                                            \
            acc[i] += right[i];                                                                    \
    }                                                                                              \
    static void sum_mid_cpu_##T(const T *x, int64_t outer, int64_t n, int64_t inner, T scale,      \
                                T *y) {                                                            \
        int64_t tiles = (inner + COLS - 1) / COLS, units = outer * tiles;                          \
        DG_OMP_FOR(units > 1 && outer * n * inner > 65536)                                         \
        for (int64_t u = 0; u < units; u++) {                                                      \
            int64_t o = u / tiles, i0 = (u % tiles) * COLS;                                        \
            int64_t w = inner - i0 < COLS ? inner - i0 : COLS;                                     \
            const T *xo = x + o * n * inner + i0;                                                  \
            T acc[COLS];                                                                           \
            if (inner == 1)                                                                        \
                acc[0] = pairwise_##T(xo, n);                                                      \
            else                                                                                   \
                pairwise_cols_##T(xo, n, inner, w, acc);                                           \
            for (int64_t i = 0; i < w; i++)                                                        \
                y[o * inner + i0 + i] = acc[i] * scale;                                            \
        }                                                                                          \
    }

#define DEFINE_SUM_MID_BWD_CPU(T)                                                                  \
    static void sum_mid_bwd_cpu_##T(const T *gy, int64_t outer, int64_t n, int64_t inner, T scale, \
                                    T *gx) {                                                       \
        int64_t rows = outer * n;                                                                  \
        DG_OMP_FOR(rows > 1 && rows * inner > 65536)                                               \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *src = gy + (r / n) * inner;                                                   \
            for (int64_t i = 0; i < inner; i++)                                                    \
                gx[r * inner + i] = scale * src[i];                                                \
        }                                                                                          \
    }

DEFINE_SUM_MID_CPU(double)
DEFINE_SUM_MID_CPU(float)
DEFINE_SUM_MID_BWD_CPU(double)
DEFINE_SUM_MID_BWD_CPU(float)

/* ---- the primitives (ops/elementwise.h) --------------------------------------------------- */

dg_status dg__sum_mid(dg_ctx *ctx, const dg_tensor *x, int64_t outer, int64_t n, int64_t inner,
                      double scale, dg_tensor *y) {
    DG_ASSERT(dg_tensor_is_contiguous(x) && dg_tensor_is_contiguous(y));
    DG_ASSERT(dg_tensor_numel(x) == outer * n * inner && dg_tensor_numel(y) == outer * inner);
    DG_ASSERT(x->dtype == y->dtype);
    if (outer * inner == 0)
        return DG_OK;
    if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
        return dg__sum_mid_cuda(ctx, x->dtype, dg_tensor_data(x), outer, n, inner, scale,
                                dg_tensor_data(y));
#else
        return dg__no_cuda("sum");
#endif
    }
    if (x->dtype == DG_F64)
        sum_mid_cpu_double(dg_tensor_data(x), outer, n, inner, scale, dg_tensor_data(y));
    else if (x->dtype == DG_F32)
        sum_mid_cpu_float(dg_tensor_data(x), outer, n, inner, (float)scale, dg_tensor_data(y));
    else
        return dg__err(DG_ERR_DTYPE, "sum: the CPU sums f64 or f32, got %s", dg_tensor_desc(x));
    return DG_OK;
}

/* gx[o,j,i] = scale * gy[o,i]; gy and gx contiguous. */
static dg_status sum_mid_bwd(dg_ctx *ctx, const dg_tensor *gy, int64_t outer, int64_t n,
                             int64_t inner, double scale, dg_tensor *gx) {
    if (outer * n * inner == 0)
        return DG_OK;
    if (dg__is_cuda(gy)) {
#ifdef DG_HAVE_CUDA
        return dg__sum_mid_bwd_cuda(ctx, gy->dtype, dg_tensor_data(gy), outer, n, inner, scale,
                                    dg_tensor_data(gx));
#else
        return dg__no_cuda("sum backward");
#endif
    }
    if (gy->dtype == DG_F64)
        sum_mid_bwd_cpu_double(dg_tensor_data(gy), outer, n, inner, scale, dg_tensor_data(gx));
    else
        sum_mid_bwd_cpu_float(dg_tensor_data(gy), outer, n, inner, (float)scale,
                              dg_tensor_data(gx));
    return DG_OK;
}

/* One run of neighbouring broadcast dims at a time, right to left, each a dg__sum_mid over
 * [outer, n, inner]: [R1,K1,R2,K2] -> sum R2 -> [R1,K1,1,K2] -> sum R1 -> [1,K1,1,K2]. At most
 * three passes for DG_MAX_DIMS = 5. */
dg_status dg__sum_to_shape(dg_ctx *ctx, const dg_tensor *g, int ndim, const int64_t *shape,
                           double scale, dg_tensor **out) {
    *out = NULL;
    int gd = g->ndim, lead = gd - ndim;
    int64_t want[DG_MAX_DIMS], cur[DG_MAX_DIMS];
    if (lead < 0)
        return dg__err(DG_ERR_SHAPE, "sum_to_shape: target has more dims than %s",
                       dg_tensor_desc(g));
    for (int d = 0; d < gd; d++) {
        want[d] = d < lead ? 1 : shape[d - lead];
        cur[d] = g->shape[d];
        if (want[d] != cur[d] && want[d] != 1)
            return dg__err(DG_ERR_SHAPE, "sum_to_shape: %s cannot be summed to dim %d = %lld",
                           dg_tensor_desc(g), d, (long long)want[d]);
    }
    if (lead == 0 && scale == 1.0 && memcmp(want, cur, (size_t)gd * sizeof *cur) == 0) {
        *out = dg_tensor_retain((dg_tensor *)g);
        return DG_OK;
    }
    dg_tensor *x = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)g, &x));
    int passes = 0;
    for (;;) {
        int d1 = gd - 1;
        while (d1 >= 0 && cur[d1] == want[d1])
            d1--;
        if (d1 < 0 && passes > 0)
            break;
        int64_t outer, n = 1, inner;
        if (d1 < 0) { /* nothing to sum, but a reshape or a scale: a pass with n = 1 copies */
            outer = dg__numel(gd, cur);
            inner = 1;
        } else {
            int d0 = d1; /* extend left over broadcast dims (and 1s, which cost nothing) */
            while (d0 > 0 && (cur[d0 - 1] != want[d0 - 1] || cur[d0 - 1] == 1))
                d0--;
            outer = dg__numel(d0, cur);
            inner = dg__numel(gd - d1 - 1, cur + d1 + 1);
            for (int d = d0; d <= d1; d++) {
                n *= cur[d];
                cur[d] = 1;
            }
        }
        int last = memcmp(want, cur, (size_t)gd * sizeof *cur) == 0;
        dg_tensor *y = NULL;
        dg_status s = last ? dg_tensor_new(ctx, g->dtype, ndim, shape, &y)
                           : dg_tensor_new(ctx, g->dtype, gd, cur, &y);
        if (s == DG_OK)
            s = dg__sum_mid(ctx, x, outer, n, inner, last ? scale : 1.0, y);
        dg_tensor_free(&x);
        if (s != DG_OK) {
            dg_tensor_free(&y);
            return s;
        }
        x = y;
        passes++;
        if (last)
            break;
    }
    *out = x;
    return DG_OK;
}

/* ---- forward ------------------------------------------------------------------------------ */

typedef struct {
    int ndim; /* the input's shape, for the gradient */
    int64_t shape[DG_MAX_DIMS];
    int64_t outer, n, inner;
    double scale;
} reduce_params;

static dg_status reduce_backward(dg_ctx *ctx, dg_node *nd);

/* y = scale * (sum of a over `axis`), or over everything when all_axes. */
static dg_status reduce_op(const char *op, const char *kind, dg_ctx *ctx, dg_tensor *a, int axis,
                           int keepdim, int is_mean, int all_axes, dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "a", a));
    DG_TRY(dg__check_device(op, "a", a, ctx));
    DG_TRY(dg__check_float_dtype(op, "a", a));

    reduce_params p = {.ndim = a->ndim};
    memcpy(p.shape, a->shape, sizeof p.shape);
    int ndim = 1;
    int64_t shape[DG_MAX_DIMS] = {1};
    if (all_axes) {
        p.outer = p.inner = 1;
        p.n = dg_tensor_numel(a);
    } else {
        int ax = axis < 0 ? axis + a->ndim : axis;
        if (ax < 0 || ax >= a->ndim)
            return dg__err(DG_ERR_ARG, "%s: axis %d is out of range for %s (valid: %d..%d)", op,
                           axis, dg_tensor_desc(a), -a->ndim, a->ndim - 1);
        p.outer = dg__numel(ax, a->shape);
        p.n = a->shape[ax];
        p.inner = dg__numel(a->ndim - ax - 1, a->shape + ax + 1);
        ndim = 0;
        for (int d = 0; d < a->ndim; d++)
            if (d != ax)
                shape[ndim++] = a->shape[d];
            else if (keepdim)
                shape[ndim++] = 1;
        if (ndim == 0) { /* a 1-d input without keepdim: [1], not a 0-d tensor */
            shape[0] = 1;
            ndim = 1;
        }
    }
    p.scale = !is_mean ? 1.0 : p.n > 0 ? 1.0 / (double)p.n : NAN;

    dg_tensor *x = NULL;
    DG_TRY(dg__contig(ctx, a, &x));
    dg_status s = dg_tensor_new(ctx, a->dtype, ndim, shape, out);
    if (s == DG_OK)
        s = dg__sum_mid(ctx, x, p.outer, p.n, p.inner, p.scale, *out);
    dg_tensor_free(&x);

    if (s == DG_OK && dg__needs_grad(1, &a)) { /* saves nothing: backward needs only shapes */
        dg_node *nd;
        s = dg__node_new(kind, DG_POLICY_CACHE, reduce_backward, ctx, &nd);
        reduce_params *np = s == DG_OK ? dg__node_params(nd, sizeof *np) : NULL;
        if (s == DG_OK && !np) {
            dg__node_abort(nd);
            s = dg__err(DG_ERR_NOMEM, "%s: out of host memory recording the tape node", op);
        }
        if (s == DG_OK) {
            *np = p;
            dg__node_input(nd, a);
            s = dg__node_output(nd, *out);
            if (s != DG_OK)
                dg__node_abort(nd);
            else
                s = dg__node_commit(nd);
        }
    }
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg_sum(dg_ctx *ctx, dg_tensor *a, int axis, int keepdim, dg_tensor **out) {
    return reduce_op("dg_sum", "sum", ctx, a, axis, keepdim, 0, 0, out);
}

dg_status dg_mean(dg_ctx *ctx, dg_tensor *a, int axis, int keepdim, dg_tensor **out) {
    return reduce_op("dg_mean", "mean", ctx, a, axis, keepdim, 1, 0, out);
}

dg_status dg_sum_all(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return reduce_op("dg_sum_all", "sum_all", ctx, a, 0, 0, 0, 1, out);
}

/* ---- backward ----------------------------------------------------------------------------- */

/* dx: dy broadcast back along the reduced axis (times 1/n for the mean). */
static dg_status reduce_backward(dg_ctx *ctx, dg_node *nd) {
    const reduce_params *p = nd->params;
    dg_tensor *dy = NULL, *dx = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)dg__node_grad_out(nd, 0), &dy));
    dg_status s = dg_tensor_new(ctx, dy->dtype, p->ndim, p->shape, &dx);
    if (s == DG_OK)
        s = sum_mid_bwd(ctx, dy, p->outer, p->n, p->inner, p->scale, dx);
    if (s == DG_OK)
        s = dg__node_accum(ctx, nd, 0, dx);
    dg_tensor_free(&dx);
    dg_tensor_free(&dy);
    return s;
}
