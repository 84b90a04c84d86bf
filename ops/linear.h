/*
 * ops/linear.h -- the GEMMs of dg_linear without the tape (library-internal), for ops that fuse
 * a linear layer with what feeds it (dg_swiglu_linear) and run its products themselves.
 *
 *   y = x W^T      x [..., in], W [out, in] -> [..., out]
 *   dx = dy W      dy [..., out] -> [..., in]
 *   dW = dy^T x    -> [out, in]
 */
#ifndef DG_OPS_LINEAR_H
#define DG_OPS_LINEAR_H

#include "../autograd/tape.h"

/* dg_linear's argument checks for x (called `xname` in messages) and w under the name `op`. */
dg_status dg__linear_check(const char *op, dg_ctx *ctx, const char *xname, dg_tensor *x,
                           dg_tensor *w);
/* *y = x W^T (new; NULL on failure). x and w as dg__linear_check accepts them. */
dg_status dg__linear_y(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor **y);
/* The gradients asked for: *gx = dy W when gx is not NULL, or gx_acc += dy W in the GEMM when
 * gx_acc is (a contiguous tensor of x's shape and w's dtype; one of the two at most); *gw = dy^T x
 * when gw is not NULL (x is read only then). New tensors in w's dtype; on failure none is left. */
dg_status dg__linear_grads(dg_ctx *ctx, dg_tensor *gy, dg_tensor *x, dg_tensor *w,
                           dg_tensor *gx_acc, dg_tensor **gx, dg_tensor **gw);

#endif /* DG_OPS_LINEAR_H */
