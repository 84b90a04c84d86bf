/*
 * ops/l2norm.c -- the L2 normalisation over the last axis (ops/l2norm.h): dg_l2norm, and through
 * dg__l2norm_x KDA's stage N1 (ops/kda/l2norm.c, FLA use_qk_l2norm_in_kernel).
 *
 *   r = 1 / sqrt(sum_j x_j^2 + eps)     eps inside the sqrt (1e-6 in KDA)
 *   y = x r
 *   dx = r (dy - (dy . y) y)
 *
 * Shapes: x [..., D], y like x. The compute dtype is x's on the CPU (f64 or f32) and f32 on CUDA
 * (kernels/l2norm.cu, which reads a bf16 x as stored and writes its bf16 gradient directly).
 * Tape: under CACHE (the default, as FLA keeps q_rstd, k_rstd) the node keeps y and r [rows] in
 * the compute dtype; under RECOMPUTE only x, and backward recomputes y and r.
 */
#ifndef DG_REF_TMPL
#include "l2norm.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/l2norm.cuh"
#endif

#include <limits.h>

#ifdef _OPENMP
#define L2_OMP_ROWS _Pragma("omp parallel for schedule(static) if (rows * D > 32768)")
#else
#define L2_OMP_ROWS
#endif

#define DG_REF_TMPL "l2norm.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
/* ---- reference ------------------------------------------------------------------------------ */

void RF(dg__l2norm_fwd)(int64_t rows, int64_t D, double eps, const RT *x, RT *y, RT *r) {
    L2_OMP_ROWS
    for (int64_t i = 0; i < rows; i++) {
        const RT *xr = x + i * D;
        RT ss = 0;
        for (int64_t c = 0; c < D; c++)
            ss += xr[c] * xr[c];
        RT ri = (RT)1 / RSQRT(ss + (RT)eps);
        for (int64_t c = 0; c < D; c++)
            y[i * D + c] = xr[c] * ri;
        if (r)
            r[i] = ri;
    }
}

void RF(dg__l2norm_bwd)(int64_t rows, int64_t D, const RT *y, const RT *r, const RT *dy, RT *dx) {
    L2_OMP_ROWS
    for (int64_t i = 0; i < rows; i++) {
        const RT *yr = y + i * D, *dyr = dy + i * D;
        RT dot = 0;
        for (int64_t c = 0; c < D; c++)
            dot += dyr[c] * yr[c];
        for (int64_t c = 0; c < D; c++)
            dx[i * D + c] = r[i] * (dyr[c] - dot * yr[c]);
    }
}

#else
/* ---- dispatch ------------------------------------------------------------------------------- */

#ifdef DG_HAVE_CUDA
/* The CUDA kernels index the last axis with an int. */
static dg_status l2_cuda_axis(int64_t D) {
    if (D > INT_MAX)
        return dg__err(DG_ERR_SHAPE, "l2norm: the last axis (%lld) exceeds the CUDA kernel's %d",
                       (long long)D, INT_MAX);
    return DG_OK;
}
#endif

dg_status dg__l2norm_run_fwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t rows, int64_t D,
                             double eps, int xbf16, const void *x, void *y, void *r) {
    if (rows == 0 || D == 0)
        return DG_OK;
    if (cuda) {
#ifdef DG_HAVE_CUDA
        DG_TRY(l2_cuda_axis(D));
        return dg__l2norm_fwd_cuda(ctx, rows, (int)D, (float)eps, xbf16, x, y, r);
#else
        (void)ctx;
        return dg__no_cuda("l2norm");
#endif
    }
    (void)xbf16;
    if (dt == DG_F64)
        dg__l2norm_fwd_f64(rows, D, eps, x, y, r);
    else
        dg__l2norm_fwd_f32(rows, D, eps, x, y, r);
    return DG_OK;
}

dg_status dg__l2norm_run_bwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t rows, int64_t D,
                             const void *y, const void *r, const void *dy, int xbf16, void *dx) {
    if (rows == 0 || D == 0)
        return DG_OK;
    if (cuda) {
#ifdef DG_HAVE_CUDA
        DG_TRY(l2_cuda_axis(D));
        return dg__l2norm_bwd_cuda(ctx, rows, (int)D, y, NULL, r, dy, xbf16, dx);
#else
        (void)ctx;
        return dg__no_cuda("l2norm backward");
#endif
    }
    (void)xbf16;
    if (dt == DG_F64)
        dg__l2norm_bwd_f64(rows, D, y, r, dy, dx);
    else
        dg__l2norm_bwd_f32(rows, D, y, r, dy, dx);
    return DG_OK;
}

/* ---- node ----------------------------------------------------------------------------------- */

typedef struct l2_params {
    double eps;
    dg_dtype dt; /* compute dtype (f32 on CUDA) */
    int cuda;
    int64_t rows, D;
    int xbf16; /* CUDA: x is bf16, read as it is; dx is written in bf16 */
} l2_params;

static dg_status l2_backward(dg_ctx *ctx, dg_node *n) {
    const l2_params *p = (const l2_params *)n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *tg = NULL, *dx = NULL, *tx = NULL, *scratch = NULL;
    const void *pdy = NULL, *py = NULL, *pr = NULL;
    int dybf16 = 0;
    dg_status st = dg__data_as(ctx, gy, p->dt, 0, &tg, &pdy, &dybf16);
    if (st == DG_OK && n->policy == DG_POLICY_CACHE) {
        py = dg_tensor_data(n->saved[0]); /* both saved in the compute dtype */
        pr = dg_tensor_data(n->saved[1]);
    } else if (st == DG_OK) {
        const void *px = NULL;
        int64_t ns[1] = {p->rows * (p->D + 1)}; /* y then r */
        int xbf16 = 0;
        st = dg__data_as(ctx, n->saved[0], p->dt, 1, &tx, &px, &xbf16);
        if (st == DG_OK)
            st = dg_tensor_new(ctx, p->dt, 1, ns, &scratch);
        if (st == DG_OK) {
            void *y = dg_tensor_data(scratch);
            void *r = (char *)y + dg_dtype_size(p->dt) * (size_t)(p->rows * p->D);
            st = dg__l2norm_run_fwd(ctx, p->cuda, p->dt, p->rows, p->D, p->eps, xbf16, px, y, r);
            py = y;
            pr = r;
        }
    }
    if (st == DG_OK) /* in x's dtype where the kernel writes bf16 */
        st = dg_tensor_new(ctx, p->xbf16 ? DG_BF16 : p->dt, n->saved[0]->ndim, n->saved[0]->shape,
                           &dx);
    if (st == DG_OK)
        st = dg__l2norm_run_bwd(ctx, p->cuda, p->dt, p->rows, p->D, py, pr, pdy, p->xbf16,
                                dg_tensor_data(dx));
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, dx);
    dg_tensor_free(&scratch);
    dg_tensor_free(&tg);
    dg_tensor_free(&tx);
    dg_tensor_free(&dx);
    return st;
}

dg_status dg__l2norm_x(dg_ctx *ctx, const char *kind, dg_tensor *x, double eps, int keep_f32,
                       int y_kept, dg_tensor **y) {
    *y = NULL;
    l2_params lp = {eps, x->dtype, dg__is_cuda(x), 0, x->shape[x->ndim - 1], 0};
    if (lp.cuda)
        lp.dt = DG_F32;
    lp.rows = lp.D ? dg_tensor_numel(x) / lp.D : 0;
    /* yc: y in the compute dtype; *y is yc itself unless x is bf16 (and !keep_f32) */
    dg_tensor *tx = NULL, *r = NULL, *yc = NULL;
    const void *px = NULL;
    dg_status st = dg__data_as(ctx, x, lp.dt, 1, &tx, &px, &lp.xbf16);
    int64_t rshape[1] = {lp.rows};
    if (st == DG_OK)
        st = dg_tensor_new(ctx, lp.dt, x->ndim, x->shape, &yc);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, lp.dt, 1, rshape, &r);
    if (st == DG_OK)
        st = dg__l2norm_run_fwd(ctx, lp.cuda, lp.dt, lp.rows, lp.D, eps, lp.xbf16, px,
                                dg_tensor_data(yc), dg_tensor_data(r));
    dg_dtype ydt = keep_f32 ? lp.dt : x->dtype;
    if (st == DG_OK && yc->dtype == ydt) {
        *y = dg_tensor_retain(yc);
    } else if (st == DG_OK) {
        st = dg_tensor_new(ctx, ydt, yc->ndim, yc->shape, y);
        if (st == DG_OK)
            st = dg_tensor_copy_(*y, yc);
    }
    if (st == DG_OK && dg__needs_grad(1, &x)) {
        dg_node *n;
        st = dg__node_new(kind, DG_POLICY_CACHE, l2_backward, ctx, &n);
        if (st == DG_OK && y_kept && yc == *y)
            n->policy = DG_POLICY_CACHE; /* keeping x instead would only add to y */
        if (st == DG_OK) {
            dg__node_input(n, x);
            st = dg__node_output(n, *y);
            if (n->policy == DG_POLICY_CACHE) {
                dg__node_save(n, yc); /* the compute-dtype y, not its bf16 rounding */
                dg__node_save(n, r);
            } else {
                dg__node_save(n, x);
            }
            if (st == DG_OK)
                st = dg__node_commit_params(n, &lp, sizeof lp);
            else
                dg__node_abort(n);
        }
    }
    dg_tensor_free(&tx);
    dg_tensor_free(&r);
    dg_tensor_free(&yc);
    if (st != DG_OK)
        dg_tensor_free(y);
    return st;
}

dg_status dg_l2norm(dg_ctx *ctx, dg_tensor *x, double eps, dg_tensor **out) {
    const char *op = "dg_l2norm";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "x", x));
    DG_TRY(dg__check_float(op, "x", x, ctx));
    if (!(eps >= 0) || !isfinite(eps))
        return dg__err(DG_ERR_ARG, "%s: eps must be finite and >= 0, got %g", op, eps);
    if (x->ndim < 1)
        return dg__err(DG_ERR_SHAPE, "%s: 'x' must have a last axis, got %s", op,
                       dg_tensor_desc(x));
    return dg__l2norm_x(ctx, "l2norm", x, eps, 0, 0, out);
}
#endif
