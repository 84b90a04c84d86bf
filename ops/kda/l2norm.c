/*
 * ops/kda/l2norm.c -- N1: the in-op L2 norm of q and k (kda.md §11.3, FLA use_qk_l2norm_in_kernel),
 * the shared L2 norm of ops/l2norm.c with eps 1e-6 as a node of its own kind, "kda_l2norm" (its
 * policy key). x, y: [..., K] (KDA: [B,T,H,K]). CUDA: x f32 or bf16, computed in f32; y has x's
 * dtype (the composite keeps it in f32).
 */
#include "kda.h"

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
