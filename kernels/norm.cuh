/*
 * kernels/norm.cuh -- C-callable launchers for the row normalisations over the last axis
 * (dg_rmsnorm and dg_gated_rmsnorm share the first pair; dg_add_rmsnorm, the residual add
 * fused with the RMSNorm after it, has its own). Implemented in kernels/norm.cu.
 *
 * Every tensor argument is a contiguous device buffer of `dt` (f32 or bf16) viewed as [rows, D];
 * w is [D]; rstd is f32 [rows]. With r = 1 / sqrt(scale * sum_j x_j^2 + eps)
 * (scale = 1/D for rmsnorm) and a = act(gate) (1 when gate is NULL):
 *     y_j = x_j r (w ? w_j : 1) a_j
 */
#ifndef DG_KERNELS_NORM_CUH
#define DG_KERNELS_NORM_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Forward. w, gate: NULL when absent. rstd: NULL, or f32 [rows] receiving r for backward. */
dg_status dg__norm_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D, float scale,
                            float eps, const void *x, const void *w, const void *gate, dg_act act,
                            void *y, float *rstd);

/* Backward. rstd: the forward's r, or NULL to recompute it. dx, dw, dgate: NULL to skip.
 * With g = dy (w ? w : 1) a and xh = x r:
 *     dx = r (g - xh * scale * sum_j g_j xh_j)
 *     dw = sum over rows of dy xh a          (deterministic two-pass reduction, no atomics)
 *     dgate = dy xh (w ? w : 1) act'(gate) */
dg_status dg__norm_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D, float scale,
                            float eps, const void *x, const void *w, const void *gate, dg_act act,
                            const float *rstd, const void *dy, void *dx, void *dw, void *dgate);

/* Residual add + RMSNorm forward, one kernel: per row, s = x + res rounded to dt (written to sum:
 * the statistics and y use the stored value, as dg_add followed by dg_rmsnorm would), then
 *     r = 1 / sqrt(scale * sum_j s_j^2 + eps),   y_j = s_j r (w ? w_j : 1).
 * x, res, sum, y: [rows, D]; w: [D] or NULL; rstd: NULL, or f32 [rows] receiving r. */
dg_status dg__add_norm_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D, float scale,
                                float eps, const void *x, const void *res, const void *w, void *sum,
                                void *y, float *rstd);

/* Its backward, one row kernel plus a column sum of per-block dw partials. s: the saved sum;
 * rstd: the forward's r, or NULL to recompute it; dy: required; dsum: NULL when no gradient
 * reached the sum; dx, dw: NULL to skip. With g = dy (w ? w : 1) and sh = s r:
 *     dx = dsum + r (g - sh * scale * sum_j g_j sh_j)     (f32, rounded once to dt)
 *     dw = sum over rows of dy sh                          (fixed order, no atomics) */
dg_status dg__add_norm_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D, float scale,
                                float eps, const void *s, const void *w, const float *rstd,
                                const void *dy, const void *dsum, void *dx, void *dw);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_NORM_CUH */
