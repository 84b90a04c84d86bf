/*
 * kernels/reduce.cuh -- C-callable launchers of the summation kernels (kernels/reduce.cu): the sum
 * over the middle axis of an [outer, n, inner] array and its backward (a broadcast back along n).
 * Storage f32 or bf16, accumulation in f32, no atomics: each output is summed in one fixed order,
 * so results repeat bit for bit.
 */
#ifndef DG_KERNELS_REDUCE_CUH
#define DG_KERNELS_REDUCE_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[o,i] = scale * sum_{j<n} x[o,j,i]; x contiguous [outer,n,inner], y contiguous [outer,inner]. */
dg_status dg__sum_mid_cuda(dg_ctx *ctx, dg_dtype dt, const void *x, int64_t outer, int64_t n,
                           int64_t inner, double scale, void *y);

/* gx[o,j,i] = scale * gy[o,i]; gy contiguous [outer,inner], gx contiguous [outer,n,inner]. */
dg_status dg__sum_mid_bwd_cuda(dg_ctx *ctx, dg_dtype dt, const void *gy, int64_t outer, int64_t n,
                               int64_t inner, double scale, void *gx);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_REDUCE_CUH */
