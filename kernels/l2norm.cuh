/*
 * kernels/l2norm.cuh -- C-callable launchers of the L2 normalisation over the last axis
 * (dg_l2norm and KDA's stage N1; ops/l2norm.h). Implemented in kernels/l2norm.cu.
 *
 *   forward:   y = x r,  r = 1 / sqrt(sum_D x^2 + eps)     x, y, dy, dx: [rows, D]; r: [rows]
 *   backward:  dx = r (dy - (dy . y) y)
 * y, r and dy are f32 device buffers; x and dx are f32, or bf16 where xbf16 is set (read and
 * written as stored, no converted copy).
 */
#ifndef DG_KERNELS_L2NORM_CUH
#define DG_KERNELS_L2NORM_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y, r: NULL to skip. */
dg_status dg__l2norm_fwd_cuda(dg_ctx *ctx, int64_t rows, int D, float eps, int xbf16, const void *x,
                              float *y, float *r);
/* dx: NULL to skip. y NULL: y = x r formed from x (f32, or bf16 when xbf16) and r, bit for bit
 * what the forward would have stored; else x is not read (may be NULL). */
dg_status dg__l2norm_bwd_cuda(dg_ctx *ctx, int64_t rows, int D, const float *y, const void *x,
                              const float *r, const float *dy, int xbf16, void *dx);

#ifdef __cplusplus
}
#endif

#endif
