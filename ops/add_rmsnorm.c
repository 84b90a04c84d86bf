/*
 * ops/add_rmsnorm.c -- the residual add fused with the RMSNorm that follows it (a pre-norm
 * block's `x = x + mixer(h); h = rmsnorm(x)`), one tape node with two outputs:
 *
 *   s = x + r                                   the new residual stream (output 0, "sum")
 *   y = s rstd w,  rstd = 1 / sqrt(mean_j s_j^2 + eps)    dg_rmsnorm of s (output 1)
 *
 * The statistics and y use s as stored (rounded to the dtype), so the outputs are those of
 * dg_add followed by dg_rmsnorm. Backward, with ds the gradient reaching s (NULL: zero), dy that of
 * y, g = dy w and sh = s rstd:
 *   dx = dr = ds + rstd (g - sh mean_j(g_j sh_j))      dw = sum over rows of dy sh
 * and with no gradient for y, dx = dr = ds and w gets none (as with the two separate ops).
 *
 * Shapes: x, r [..., D] (the same shape), w [D] or NULL (= 1). Dtypes: f64/f32 on the CPU (f32
 * computed in f32), f32/bf16 on CUDA (f32 math). Tape: the node saves s, w and, under CACHE (the
 * default), rstd [rows] (f64 for f64 inputs, else f32); RECOMPUTE recomputes rstd from s.
 */
#ifndef DG_REF_TMPL
#include "rmsnorm.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/norm.cuh"
#endif

#include <math.h>

typedef struct {
    double eps;
} arn_params;

#ifdef _OPENMP
#define ARN_OMP_ROWS _Pragma("omp parallel for schedule(static) if (n > 32768)")
#else
#define ARN_OMP_ROWS
#endif

#define DG_REF_TMPL "add_rmsnorm.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference: the sum, then ops/rmsnorm.c's reference on it (the same bits as the two ops)

/* out = a + b over n elements (out may be a or b); f64 or f32 by SUF. */
static void RF(arn_add)(int64_t n, const RT *a, const RT *b, RT *out) {
    ARN_OMP_ROWS
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

#else

// ---- forward

static const char *const k_op = "dg_add_rmsnorm";

/* Device first, then dtype (as dg_rmsnorm's x), then at least one dimension. */
static dg_status arn_check_x(const dg_tensor *x, const dg_ctx *ctx) {
    DG_TRY(dg__check_float(k_op, "x", x, ctx));
    if (x->ndim < 1)
        return dg__err(DG_ERR_SHAPE, "%s: 'x' must have at least one dimension, got %s", k_op,
                       dg_tensor_desc(x));
    return DG_OK;
}

/* r (like x) or w ([D]): device, shape, then x's dtype. */
static dg_status arn_check_like(const char *arg, const dg_tensor *t, int ndim, const int64_t *shape,
                                const dg_tensor *x, const dg_ctx *ctx) {
    DG_TRY(dg__check_device(k_op, arg, t, ctx));
    DG_TRY(dg__check_shape(k_op, arg, t, ndim, shape));
    if (t->dtype != x->dtype)
        return dg__err(DG_ERR_DTYPE, "%s: '%s' must have dtype %s like 'x', got %s", k_op, arg,
                       dg_dtype_name(x->dtype), dg_tensor_desc(t));
    return DG_OK;
}

static dg_status arn_backward(dg_ctx *ctx, dg_node *n);

static dg_status arn_run_fwd(dg_ctx *ctx, dg_tensor *x, dg_tensor *r, dg_tensor *w, double eps,
                             dg_tensor *sum, dg_tensor *y, dg_tensor *rstd) {
    int64_t D = x->shape[x->ndim - 1], rows = D ? dg_tensor_numel(x) / D : 0;
    if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
        return dg__add_norm_fwd_cuda(ctx, x->dtype, rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps,
                                     dg_tensor_data(x), dg_tensor_data(r),
                                     w ? dg_tensor_data(w) : NULL, dg_tensor_data(sum),
                                     dg_tensor_data(y), rstd ? dg__f32(rstd) : NULL);
#else
        (void)ctx;
        return dg__no_cuda("add_rmsnorm");
#endif
    }
    const int64_t n = rows * D;
    if (x->dtype == DG_F64) {
        arn_add_f64(n, dg__f64(x), dg__f64(r), dg__f64(sum));
        dg__rmsnorm_fwd_f64(rows, D, D ? 1.0 / (double)D : 0.0, eps, dg__f64(sum),
                            w ? dg__f64(w) : NULL, NULL, DG_ACT_NONE, dg__f64(y),
                            rstd ? dg__f64(rstd) : NULL);
    } else {
        arn_add_f32(n, dg__f32(x), dg__f32(r), dg__f32(sum));
        dg__rmsnorm_fwd_f32(rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps, dg__f32(sum),
                            w ? dg__f32(w) : NULL, NULL, DG_ACT_NONE, dg__f32(y),
                            rstd ? dg__f32(rstd) : NULL);
    }
    return DG_OK;
}

dg_status dg_add_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *r, dg_tensor *w, double eps,
                         dg_tensor **sum, dg_tensor **y) {
    DG_TRY(dg__check_ptr(k_op, "sum", sum));
    DG_TRY(dg__check_ptr(k_op, "y", y));
    if (sum == y)
        return dg__err(DG_ERR_ARG, "%s: 'sum' and 'y' must point to different variables", k_op);
    *sum = NULL;
    *y = NULL;
    DG_TRY(dg__check_ptr(k_op, "ctx", ctx));
    DG_TRY(dg__check_ptr(k_op, "x", x));
    DG_TRY(arn_check_x(x, ctx));
    DG_TRY(dg__check_ptr(k_op, "r", r));
    DG_TRY(arn_check_like("r", r, x->ndim, x->shape, x, ctx));
    int64_t D = x->shape[x->ndim - 1];
    if (w)
        DG_TRY(arn_check_like("w", w, 1, &D, x, ctx));
    if (!(eps > 0) || !isfinite(eps))
        return dg__err(DG_ERR_ARG, "%s: eps must be finite and > 0, got %g", k_op, eps);

    dg_tensor *xc = NULL, *rc = NULL, *wc = NULL, *s_out = NULL, *y_out = NULL, *rstd = NULL;
    dg_status s = dg__contig(ctx, x, &xc);
    if (s == DG_OK)
        s = dg__contig(ctx, r, &rc);
    if (s == DG_OK && w)
        s = dg__contig(ctx, w, &wc);
    if (s == DG_OK)
        s = dg__new_like(ctx, x, &s_out);
    if (s == DG_OK)
        s = dg__new_like(ctx, x, &y_out);
    int grad = dg__needs_grad(3, (dg_tensor *[]){x, r, w});
    dg_policy pol = dg_policy_resolve("add_rmsnorm", DG_POLICY_CACHE);
    if (s == DG_OK && grad && pol == DG_POLICY_CACHE) {
        int64_t rows = D ? dg_tensor_numel(x) / D : 0;
        s = dg_tensor_new(ctx, x->dtype == DG_F64 ? DG_F64 : DG_F32, 1, &rows, &rstd);
    }
    if (s == DG_OK)
        s = arn_run_fwd(ctx, xc, rc, wc, eps, s_out, y_out, rstd);
    if (s == DG_OK && grad) {
        dg_node *n = NULL;
        s = dg__node_new("add_rmsnorm", DG_POLICY_CACHE, arn_backward, ctx, &n);
        if (s == DG_OK)
            dg__node_input(n, x);
        if (s == DG_OK)
            dg__node_input(n, r);
        if (s == DG_OK)
            dg__node_input(n, w);
        if (s == DG_OK)
            s = dg__node_output(n, s_out);
        if (s == DG_OK)
            s = dg__node_output(n, y_out);
        if (s == DG_OK) {
            dg__node_save(n, s_out);
            dg__node_save(n, wc);
            dg__node_save(n, rstd);
            s = dg__node_commit_params(n, &(arn_params){.eps = eps}, sizeof(arn_params));
        } else if (n) {
            dg__node_abort(n);
        }
    }
    dg_tensor_free(&xc);
    dg_tensor_free(&rc);
    dg_tensor_free(&wc);
    dg_tensor_free(&rstd);
    if (s != DG_OK) {
        dg_tensor_free(&s_out);
        dg_tensor_free(&y_out);
    }
    *sum = s_out;
    *y = y_out;
    return s;
}

// ---- backward

static dg_status arn_run_bwd(dg_ctx *ctx, double eps, dg_tensor *s, dg_tensor *w, dg_tensor *rstd,
                             dg_tensor *dy, dg_tensor *dsum, dg_tensor *dx, dg_tensor *dw) {
    int64_t D = s->shape[s->ndim - 1], rows = D ? dg_tensor_numel(s) / D : 0;
#define ARN_PTR(t, f) ((t) ? f(t) : NULL)
    if (dg__is_cuda(s)) {
#ifdef DG_HAVE_CUDA
        return dg__add_norm_bwd_cuda(ctx, s->dtype, rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps,
                                     dg_tensor_data(s), ARN_PTR(w, dg_tensor_data),
                                     ARN_PTR(rstd, dg__f32), dg_tensor_data(dy),
                                     ARN_PTR(dsum, dg_tensor_data), ARN_PTR(dx, dg_tensor_data),
                                     ARN_PTR(dw, dg_tensor_data));
#else
        (void)ctx;
        return dg__no_cuda("add_rmsnorm backward");
#endif
    }
    /* dx = dsum + the RMSNorm's dx (dsum NULL: no gradient reached the sum) */
    const int64_t n = rows * D;
    if (s->dtype == DG_F64) {
        DG_TRY(dg__rmsnorm_bwd_f64(rows, D, D ? 1.0 / (double)D : 0.0, eps, dg__f64(s),
                                   ARN_PTR(w, dg__f64), NULL, DG_ACT_NONE, ARN_PTR(rstd, dg__f64),
                                   dg__f64(dy), ARN_PTR(dx, dg__f64), ARN_PTR(dw, dg__f64), NULL));
        if (dx && dsum)
            arn_add_f64(n, dg__f64(dsum), dg__f64(dx), dg__f64(dx));
        return DG_OK;
    }
    DG_TRY(dg__rmsnorm_bwd_f32(rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps, dg__f32(s),
                               ARN_PTR(w, dg__f32), NULL, DG_ACT_NONE, ARN_PTR(rstd, dg__f32),
                               dg__f32(dy), ARN_PTR(dx, dg__f32), ARN_PTR(dw, dg__f32), NULL));
    if (dx && dsum)
        arn_add_f32(n, dg__f32(dsum), dg__f32(dx), dg__f32(dx));
    return DG_OK;
#undef ARN_PTR
}

static dg_status arn_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    const arn_params *p = n->params;
    dg_tensor *sv = n->saved[0], *w = n->saved[1], *rstd = n->saved[2];
    const dg_tensor *gs = dg__node_grad_out(n, 0), *gy = dg__node_grad_out(n, 1);
    const int want_x = dg__node_wants_grad(n, 0) || dg__node_wants_grad(n, 1);
    if (!gy) { /* only the sum was used: its gradient goes to x and r as it is */
        dg_status s = DG_OK;
        if (gs && dg__node_wants_grad(n, 0))
            s = dg__node_accum(c, n, 0, (dg_tensor *)gs);
        if (s == DG_OK && gs && dg__node_wants_grad(n, 1))
            s = dg__node_accum(c, n, 1, (dg_tensor *)gs);
        return s;
    }
    dg_tensor *dy = NULL, *ds = NULL, *dx = NULL, *dw = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK && gs && want_x)
        s = dg__contig(c, (dg_tensor *)gs, &ds);
    if (s == DG_OK && want_x)
        s = dg__new_like(c, sv, &dx);
    if (s == DG_OK && dg__node_wants_grad(n, 2))
        s = dg__new_like(c, w, &dw);
    if (s == DG_OK && (dx || dw))
        s = arn_run_bwd(c, p->eps, sv, w, rstd, dy, ds, dx, dw);
    if (s == DG_OK && dx && dg__node_wants_grad(n, 0))
        s = dg__node_accum(c, n, 0, dx);
    if (s == DG_OK && dx && dg__node_wants_grad(n, 1))
        s = dg__node_accum(c, n, 1, dx);
    if (s == DG_OK && dw)
        s = dg__node_accum(c, n, 2, dw);
    dg_tensor_free(&dy);
    dg_tensor_free(&ds);
    dg_tensor_free(&dx);
    dg_tensor_free(&dw);
    return s;
}
#endif
