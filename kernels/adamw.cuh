/*
 * kernels/adamw.cuh -- CUDA launcher of dg_adamw_step (ops/adamw.c). C-compatible.
 */
#ifndef DG_KERNELS_ADAMW_CUH
#define DG_KERNELS_ADAMW_CUH

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One AdamW step over n contiguous elements; param, m, v f32, grad f32 or bf16 (gdt).
 *   p -= lr_wd * p   (lr_wd = lr * weight_decay, 0 to skip)
 *   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
 *   p -= lr * (m / bc1) / (sqrt(v / bc2) + eps)      bc1 = 1 - b1^step, bc2 = 1 - b2^step */
dg_status dg__adamw_cuda(dg_ctx *ctx, float *param, dg_dtype gdt, const void *grad, float *m,
                         float *v, int64_t n, float lr, float b1, float b2, float eps, float lr_wd,
                         float bc1, float bc2);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_ADAMW_CUH */
