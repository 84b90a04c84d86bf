/*
 * kernels/elementwise.cuh -- C-callable launchers of the elementwise kernels
 * (kernels/elementwise.cu): the broadcasting binary ops, scale, and the unary activations with
 * their backward. Storage f32 or bf16, math in f32. The op kinds are shared with the CPU reference
 * in ops/, so this header is plain C and the op files include it whether or not CUDA is built.
 */
#ifndef DG_KERNELS_ELEMENTWISE_CUH
#define DG_KERNELS_ELEMENTWISE_CUH

#include "cuda_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dg_binary_kind { DG_BINARY_ADD = 0, DG_BINARY_SUB, DG_BINARY_MUL } dg_binary_kind;

/*   exp       y = e^x                            dx = dy * y
 *   log       y = log x                          dx = dy / x
 *   sigmoid   y = 1 / (1 + e^-x)                 dx = dy * y (1 - y)
 *   softplus  y = max(x,0) + log1p(e^-|x|)       dx = dy * sigmoid(x)
 *   silu      y = x sigmoid(x)                   dx = dy * s (1 + x (1 - s)),  s = sigmoid(x) */
typedef enum dg_unary_kind {
    DG_UNARY_EXP = 0,
    DG_UNARY_LOG,
    DG_UNARY_SIGMOID,
    DG_UNARY_SOFTPLUS,
    DG_UNARY_SILU,
} dg_unary_kind;

/* y[i] = a[.] (op) b[.] for i over the logical row-major index of the shape al and bl share.
 * y: contiguous, n elements; al/bl: each input's element strides, 0 along broadcast dims. */
dg_status dg__binary_fwd_cuda(dg_ctx *ctx, dg_binary_kind kind, dg_dtype dt, void *y, const void *a,
                              dg_layout al, const void *b, dg_layout bl, int64_t n);

/* y = s * x; both contiguous with n elements. */
dg_status dg__scale_fwd_cuda(dg_ctx *ctx, dg_dtype dt, void *y, const void *x, double s, int64_t n);

/* y = f(x); both contiguous with n elements. */
dg_status dg__unary_fwd_cuda(dg_ctx *ctx, dg_unary_kind kind, dg_dtype dt, void *y, const void *x,
                             int64_t n);

/* gx = gy * f'(x). `saved` is x, or y = f(x) when saved_is_output (exp and sigmoid only). */
dg_status dg__unary_bwd_cuda(dg_ctx *ctx, dg_unary_kind kind, dg_dtype dt, void *gx, const void *gy,
                             const void *saved, int saved_is_output, int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_ELEMENTWISE_CUH */
