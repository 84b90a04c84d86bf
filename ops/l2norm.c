/*
 * ops/l2norm.c -- L2 normalisation over the last axis (KDA's q/k normalisation, FLA l2norm).
 *
 *   r = 1 / sqrt(sum_j x_j^2 + eps)     eps inside the sqrt (1e-6 in KDA)
 *   y = x r
 *   dx = r (dy - (dy . y) y)
 *
 * Shapes: x [..., D], y like x. Tape: the node saves x and, under CACHE (the default), rstd
 * [rows] (f64 for f64 inputs, else f32); RECOMPUTE recomputes rstd in backward.
 * CUDA shares the row-norm kernels of kernels/norm.cu (scale 1, no weight, no gate).
 */
#include "../autograd/tape.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/norm.cuh"
#endif

#include <math.h>

typedef struct {
    double eps;
} l2_params;

// ---- reference

#ifdef _OPENMP
#define L2_OMP_ROWS _Pragma("omp parallel for schedule(static) if (rows * D > 32768)")
#else
#define L2_OMP_ROWS
#endif

/* One body for f64 and f32 (f32 computes in f32). */
#define L2_DEFINE(T, SUF, SQRT)                                                                    \
    static T l2_rstd_##SUF(const T *xr, int64_t D, T eps) {                                        \
        T ss = 0;                                                                                  \
        for (int64_t j = 0; j < D; j++)                                                            \
            ss += xr[j] * xr[j];                                                                   \
        return (T)1 / SQRT(ss + eps);                                                              \
    }                                                                                              \
    static void l2_fwd_##SUF(int64_t rows, int64_t D, T eps, const T *x, T *y, T *rstd) {          \
        L2_OMP_ROWS                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            T rs = l2_rstd_##SUF(x + r * D, D, eps);                                               \
            if (rstd)                                                                              \
                rstd[r] = rs;                                                                      \
            for (int64_t j = 0; j < D; j++)                                                        \
                y[r * D + j] = x[r * D + j] * rs;                                                  \
        }                                                                                          \
    }                                                                                              \
    /* Same arithmetic order as the CUDA kernel: m = r * sum_j dy_j x_j = dy . y, then */          \
    /* dx_j = r (dy_j - x_j r m). */                                                               \
    static void l2_bwd_##SUF(int64_t rows, int64_t D, T eps, const T *x, const T *rstd,            \
                             const T *dy, T *dx) {                                                 \
        L2_OMP_ROWS                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *xr = x + r * D, *dyr = dy + r * D;                                            \
            T rs = rstd ? rstd[r] : l2_rstd_##SUF(xr, D, eps);                                     \
            T dot = 0;                                                                             \
            for (int64_t j = 0; j < D; j++)                                                        \
                dot += dyr[j] * xr[j];                                                             \
            T m = rs * dot;                                                                        \
            for (int64_t j = 0; j < D; j++)                                                        \
                dx[r * D + j] = rs * (dyr[j] - xr[j] * rs * m);                                    \
        }                                                                                          \
    }

L2_DEFINE(double, f64, sqrt)
L2_DEFINE(float, f32, sqrtf)

// ---- forward

static dg_status l2_backward(dg_ctx *ctx, dg_node *n);

dg_status dg_l2norm(dg_ctx *ctx, dg_tensor *x, double eps, dg_tensor **out) {
    const char *op = "dg_l2norm";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "x", x));
    DG_TRY(dg__check_device(op, "x", x, ctx));
    DG_TRY(dg__check_dtype(op, "x", x, DG_FLOATS));
    if (!dg__is_cuda(x) && x->dtype == DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "%s: 'x' is %s, but bf16 is a CUDA dtype; use f32 or f64 on the CPU", op,
                       dg_tensor_desc(x));
    if (dg__is_cuda(x) && x->dtype == DG_F64)
        return dg__err(DG_ERR_DTYPE, "%s: 'x' is %s; the CUDA kernels run f32 or bf16", op,
                       dg_tensor_desc(x));
    if (!(eps >= 0) || !isfinite(eps))
        return dg__err(DG_ERR_ARG, "%s: eps must be finite and >= 0, got %g", op, eps);

    int64_t D = x->shape[x->ndim - 1], rows = D ? dg_tensor_numel(x) / D : 0;
    dg_tensor *xc = NULL, *y = NULL, *rstd = NULL;
    dg_status s = dg__contig(ctx, x, &xc);
    if (s == DG_OK)
        s = dg__new_like(ctx, x, &y);
    int grad = dg__needs_grad(1, &x);
    if (s == DG_OK && grad && dg_policy_resolve("l2norm", DG_POLICY_CACHE) == DG_POLICY_CACHE)
        s = dg_tensor_new(ctx, x->dtype == DG_F64 ? DG_F64 : DG_F32, 1, &rows, &rstd);
    if (s == DG_OK) {
        if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
            s = dg__norm_fwd_cuda(ctx, x->dtype, rows, D, 1.0f, (float)eps, dg_tensor_data(xc),
                                  NULL, NULL, DG_ACT_NONE, dg_tensor_data(y),
                                  rstd ? dg__f32(rstd) : NULL);
#else
            s = dg__no_cuda(op);
#endif
        } else if (x->dtype == DG_F64) {
            l2_fwd_f64(rows, D, eps, dg__f64(xc), dg__f64(y), rstd ? dg__f64(rstd) : NULL);
        } else {
            l2_fwd_f32(rows, D, (float)eps, dg__f32(xc), dg__f32(y), rstd ? dg__f32(rstd) : NULL);
        }
    }
    if (s == DG_OK && grad) {
        dg_node *n = NULL;
        s = dg__node_new("l2norm", DG_POLICY_CACHE, l2_backward, ctx, &n);
        if (s == DG_OK) {
            dg__node_input(n, x);
            dg__node_output(n, y);
            dg__node_save(n, xc);
            dg__node_save(n, rstd);
            s = dg__node_commit_params(n, &(l2_params){.eps = eps}, sizeof(l2_params));
        }
    }
    dg_tensor_free(&xc);
    dg_tensor_free(&rstd);
    if (s != DG_OK)
        dg_tensor_free(&y);
    *out = y;
    return s;
}

// ---- backward

static dg_status l2_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    const l2_params *p = n->params;
    dg_tensor *x = n->saved[0], *rstd = n->saved[1];
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    int64_t D = x->shape[x->ndim - 1], rows = D ? dg_tensor_numel(x) / D : 0;
    dg_tensor *dy = NULL, *dx = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK)
        s = dg__new_like(c, x, &dx);
    if (s == DG_OK) {
        if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
            s = dg__norm_bwd_cuda(c, x->dtype, rows, D, 1.0f, (float)p->eps, dg_tensor_data(x),
                                  NULL, NULL, DG_ACT_NONE, rstd ? dg__f32(rstd) : NULL,
                                  dg_tensor_data(dy), dg_tensor_data(dx), NULL, NULL);
#else
            s = dg__no_cuda("l2norm backward");
#endif
        } else if (x->dtype == DG_F64) {
            l2_bwd_f64(rows, D, p->eps, dg__f64(x), rstd ? dg__f64(rstd) : NULL, dg__f64(dy),
                       dg__f64(dx));
        } else {
            l2_bwd_f32(rows, D, (float)p->eps, dg__f32(x), rstd ? dg__f32(rstd) : NULL, dg__f32(dy),
                       dg__f32(dx));
        }
    }
    if (s == DG_OK)
        s = dg__node_accum(c, n, 0, dx);
    dg_tensor_free(&dy);
    dg_tensor_free(&dx);
    return s;
}
