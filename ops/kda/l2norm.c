/*
 * ops/kda/l2norm.c -- N1: the in-op L2 norm of q and k (kda.md §11.3, FLA use_qk_l2norm_in_kernel),
 * the shared L2 norm of ops/l2norm.c with eps 1e-6 as a node of its own kind, "kda_l2norm" (its
 * policy key). x, y: [..., K] (KDA: [B,T,H,K]). CUDA: x f32 or bf16, computed in f32; y has x's
 * dtype (the composite keeps it in f32). The composite's factored form on CUDA (kda.h: the rows
 * are not stored, only r = 1 / ||x||) is dg__kda_l2norm_factored, a node of the same kind: it
 * keeps x and r under either policy (r is 1/K of x, and x is its input anyway).
 */
#include "kda.h"

#ifdef DG_HAVE_CUDA
#include "../../kernels/l2norm.cuh"
#endif

#define OP "dg_kda_l2norm"

dg_status dg__kda_l2norm_x(dg_ctx *ctx, dg_tensor *x, int keep_f32, dg_tensor **y) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "y", y));
    *y = NULL;
    DG_TRY(dg__check_ptr(OP, "x", x));
    DG_TRY(dg__kda_check_first(OP, "x", x, ctx, x->ndim, "...,K"));
    if (x->ndim < 1 || x->shape[x->ndim - 1] < 1)
        return dg__err(DG_ERR_SHAPE, OP ": x must have a last axis K >= 1, got %s",
                       dg_tensor_desc(x));
#ifndef DG_HAVE_CUDA
    if (dg__is_cuda(x))
        return dg__no_cuda(OP);
#endif
    /* the composite (keep_f32) hands y to intra, WY and output, which keep it under every policy */
    return dg__l2norm_x(ctx, "kda_l2norm", x, KDA_L2_EPS, keep_f32, keep_f32, y);
}

dg_status dg_kda_l2norm(dg_ctx *ctx, dg_tensor *x, dg_tensor **y) {
    return dg__kda_l2norm_x(ctx, x, 0, y);
}

/* ---- the factored form (CUDA) ---------------------------------------------------------------- */

int dg__kda_l2norm_factors(const kda_dev *dev, const dg_tensor *q, const dg_tensor *k) {
#ifdef DG_HAVE_CUDA
    return dev && q->dtype == DG_BF16 && k->dtype == DG_BF16 && dg_tensor_is_contiguous(q) &&
           dg_tensor_is_contiguous(k) && dg__is_cuda(q) && dg__is_cuda(k) &&
           dg__kda_qk_fits(&dev->d, dg_tensor_data(q), dg_tensor_data(k));
#else
    (void)dev;
    (void)q;
    (void)k;
    return 0;
#endif
}

#ifdef DG_HAVE_CUDA
typedef struct l2f_params {
    int64_t rows;
    int D;
} l2f_params;

/* dx = r (dy - (dy . y) y) with y = x r formed again from the saved x and r; dy is the gradient
 * of the normalised rows (f32), dx is written in x's dtype (bf16). */
static dg_status l2f_backward(dg_ctx *ctx, dg_node *n) {
    const l2f_params *p = (const l2f_params *)n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *x = n->saved[0], *r = n->saved[1], *tg = NULL, *dx = NULL;
    const void *pdy = NULL;
    dg_status st = dg__data_as(ctx, gy, DG_F32, 0, &tg, &pdy, NULL);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, x->dtype, x->ndim, x->shape, &dx);
    if (st == DG_OK)
        st = dg__l2norm_bwd_cuda(ctx, p->rows, p->D, NULL, dg_tensor_data(x), dg_tensor_data(r),
                                 pdy, x->dtype == DG_BF16, dg_tensor_data(dx));
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, dx);
    dg_tensor_free(&tg);
    dg_tensor_free(&dx);
    return st;
}
#endif

dg_status dg__kda_l2norm_factored(dg_ctx *ctx, dg_tensor *x, int defer, dg_tensor **xn,
                                  dg_tensor **r) {
    *xn = *r = NULL;
#ifndef DG_HAVE_CUDA
    (void)ctx;
    (void)x;
    (void)defer;
    return dg__no_cuda(OP);
#else
    if (!dg__is_cuda(x) || x->dtype != DG_BF16 || !dg_tensor_is_contiguous(x) || x->ndim < 2)
        return dg__err(DG_ERR_STATE,
                       OP ": the factored form needs a contiguous bf16 CUDA x, got %s",
                       dg_tensor_desc(x));
    l2f_params p = {0, (int)x->shape[x->ndim - 1]};
    p.rows = p.D ? dg_tensor_numel(x) / p.D : 0;
    dg_status st = dg_tensor_new(ctx, DG_F32, x->ndim - 1, x->shape, r);
    if (st == DG_OK && !defer) /* defer: the intra kernel's prep fills r (kda.h) */
        st = dg__l2norm_fwd_cuda(ctx, p.rows, p.D, (float)KDA_L2_EPS, 1, dg_tensor_data(x), NULL,
                                 dg_tensor_data(*r));
    if (st == DG_OK) { /* xn: a view of x's storage; it stands for the rows x r */
        dg_no_grad_begin();
        st = dg_reshape(x, x->ndim, x->shape, xn);
        dg_no_grad_end();
    }
    if (st == DG_OK && dg__needs_grad(1, &x)) {
        dg_node *n;
        st = dg__node_new("kda_l2norm", DG_POLICY_CACHE, l2f_backward, ctx, &n);
        if (st == DG_OK) {
            dg__node_input(n, x);
            st = dg__node_output_as(n, *xn, DG_F32); /* the normalised rows' gradient, f32 */
            dg__node_save(n, x);
            dg__node_save(n, *r);
            if (st == DG_OK)
                st = dg__node_commit_params(n, &p, sizeof p);
            else
                dg__node_abort(n);
        }
    }
    if (st != DG_OK) {
        dg_tensor_free(xn);
        dg_tensor_free(r);
    }
    return st;
#endif
}
