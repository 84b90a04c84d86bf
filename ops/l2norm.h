/*
 * ops/l2norm.h -- the one L2 normalisation over the last axis (library-internal): its CPU
 * reference, its dispatch to the CPU or CUDA (kernels/l2norm.cu) and its tape node. dg_l2norm
 * and KDA's stage N1 (dg_kda_l2norm, the in-op normalisation of q and k) are both this op.
 *
 *   r = 1 / sqrt(sum_j x_j^2 + eps)     eps inside the sqrt (1e-6 in KDA)
 *   y = x r
 *   dx = r (dy - (dy . y) y)
 * x, y, dy, dx: [rows, D]; r: [rows].
 */
#ifndef DG_OPS_L2NORM_H
#define DG_OPS_L2NORM_H

#include "../autograd/tape.h"

/* The CPU reference, f64 and f32 (the f32 one computes in f32). r: NULL to skip. */
void dg__l2norm_fwd_f64(int64_t rows, int64_t D, double eps, const double *x, double *y, double *r);
void dg__l2norm_fwd_f32(int64_t rows, int64_t D, double eps, const float *x, float *y, float *r);
void dg__l2norm_bwd_f64(int64_t rows, int64_t D, const double *y, const double *r, const double *dy,
                        double *dx);
void dg__l2norm_bwd_f32(int64_t rows, int64_t D, const float *y, const float *r, const float *dy,
                        float *dx);

/* Raw arrays in the compute dtype `dt` (f64 or f32 on the CPU, f32 on CUDA: `cuda`). On CUDA the
 * input x and its gradient dx may be bf16 instead (xbf16: the kernels read and write it as it is
 * stored); the CPU needs xbf16 = 0. */
dg_status dg__l2norm_run_fwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t rows, int64_t D,
                             double eps, int xbf16, const void *x, void *y, void *r);
dg_status dg__l2norm_run_bwd(dg_ctx *ctx, int cuda, dg_dtype dt, int64_t rows, int64_t D,
                             const void *y, const void *r, const void *dy, int xbf16, void *dx);

/* y = l2norm(x) over the last axis, recorded on the tape as a node of kind `kind` ("l2norm",
 * "kda_l2norm": the policy key). The caller has checked x (a float tensor of ctx with a last
 * axis >= 1; bf16 and f64 only where the device runs them) and eps (finite, >= 0). y has x's
 * dtype, or the compute dtype with keep_f32. Under CACHE (the default) the node keeps y and r in
 * the compute dtype; under RECOMPUTE it keeps x and backward recomputes y and r. y_kept: the
 * caller's later nodes keep y whatever their policy (KDA's stages keep the normalised q and k);
 * when y is the compute-dtype tensor itself the node then caches under every policy, since
 * keeping x would add to y rather than replace it. */
dg_status dg__l2norm_x(dg_ctx *ctx, const char *kind, dg_tensor *x, double eps, int keep_f32,
                       int y_kept, dg_tensor **y);

#endif
