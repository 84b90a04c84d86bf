/*
 * ops/rmsnorm.h -- the RMSNorm CPU reference (defined in ops/rmsnorm.c), shared with the fused
 * residual add + RMSNorm (ops/add_rmsnorm.c) so both compute the same bits (library-internal).
 */
#ifndef DG_OPS_RMSNORM_H
#define DG_OPS_RMSNORM_H

#include "../autograd/tape.h"

/* y = x r w act(gate) per row of D, r = 1 / sqrt(scale sum_j x_j^2 + eps) (scale = 1 / D);
 * w, gate, rstd may be NULL (w = 1, no gate, r not stored). f32 computes in f32. */
void dg__rmsnorm_fwd_f64(int64_t rows, int64_t D, double scale, double eps, const double *x,
                         const double *w, const double *gate, dg_act act, double *y, double *rstd);
void dg__rmsnorm_fwd_f32(int64_t rows, int64_t D, float scale, float eps, const float *x,
                         const float *w, const float *gate, dg_act act, float *y, float *rstd);
/* Gradients of the forward above given dy, overwriting dx, dw, dgate (each NULL to skip);
 * rstd_in: the forward's r, or NULL to recompute it. DG_ERR_NOMEM if that needs memory and
 * there is none. */
dg_status dg__rmsnorm_bwd_f64(int64_t rows, int64_t D, double scale, double eps, const double *x,
                              const double *w, const double *gate, dg_act act,
                              const double *rstd_in, const double *dy, double *dx, double *dw,
                              double *dgate);
dg_status dg__rmsnorm_bwd_f32(int64_t rows, int64_t D, float scale, float eps, const float *x,
                              const float *w, const float *gate, dg_act act, const float *rstd_in,
                              const float *dy, float *dx, float *dw, float *dgate);

#endif /* DG_OPS_RMSNORM_H */
