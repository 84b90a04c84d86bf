/*
 * kernels/global_norm.cuh -- CUDA launcher of dg_global_norm (ops/global_norm.c). C-compatible.
 */
#ifndef DG_KERNELS_GLOBAL_NORM_CUH
#define DG_KERNELS_GLOBAL_NORM_CUH

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Blocks of the first pass; `partials` must hold this many doubles. */
#define DG_SUMSQ_MAX_BLOCKS 1024

/* *result (device) = sum_i x[i]^2 over n contiguous elements of dtype dt (f32, bf16 or f64), in
 * f64 with a reduction order that depends only on n: a fixed grid of blocks each sums a strided
 * share into partials[b], then one block adds the partials in a fixed tree. */
dg_status dg__sumsq_cuda(dg_ctx *ctx, dg_dtype dt, const void *x, int64_t n, double *partials,
                         double *result);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_GLOBAL_NORM_CUH */
