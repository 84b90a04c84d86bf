/*
 * kernels/swiglu.cuh -- C-callable launchers for dg_swiglu (kernels/swiglu.cu).
 *
 * gate, up, y, dy, dgate, dup: contiguous device buffers of n elements of `dt` (f32 or bf16):
 *     y = silu(gate) up,   dgate = dy up silu'(gate),   dup = dy silu(gate)
 */
#ifndef DG_KERNELS_SWIGLU_CUH
#define DG_KERNELS_SWIGLU_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

dg_status dg__swiglu_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t n, const void *gate, const void *up,
                              void *y);
/* dgate, dup: NULL to skip. */
dg_status dg__swiglu_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t n, const void *gate, const void *up,
                              const void *dy, void *dgate, void *dup);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_SWIGLU_CUH */
