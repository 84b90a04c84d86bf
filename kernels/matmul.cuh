/*
 * kernels/matmul.cuh -- the GEMM description shared by the CPU GEMM (ops/gemm.c) and the cuBLAS
 * launcher (kernels/matmul.cu), and the launcher itself. C-compatible: the ops include it.
 *
 * Row-major throughout. For each batch item b:
 *   C_b [m,n] = alpha * op(A_b) [m,k] @ op(B_b) [k,n] + beta * C_b
 *   op(A)(i,p) = trans_a ? A[p*lda + i] : A[i*lda + p]     (A_b = A + b*stride_a)
 *   op(B)(p,j) = trans_b ? B[j*ldb + p] : B[p*ldb + j]     (B_b = B + b*stride_b)
 *   C(i,j)     = C[i*ldc + j]                              (C_b = C + b*stride_c)
 * A stride of 0 broadcasts that operand over the batch (never for C). beta == 0 overwrites C
 * without reading it.
 */
#ifndef DG_KERNELS_MATMUL_CUH
#define DG_KERNELS_MATMUL_CUH

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_gemm_desc {
    int trans_a, trans_b;
    int64_t m, n, k, batch;
    int64_t lda, ldb, ldc;
    int64_t stride_a, stride_b, stride_c; /* elements between batch items */
    double alpha, beta;
} dg_gemm_desc;

/* cuBLAS GEMM (cublasGemmStridedBatchedEx) for f64 (64F compute), f32 (32F compute, no TF32:
 * fails with DG_ERR_CUBLAS if the context's cuBLAS handle was switched to a TF32 or emulated
 * math mode) and bf16 (bf16 storage, 32F compute). Queued on the context's stream. */
dg_status dg__matmul_cuda(dg_ctx *ctx, dg_dtype dt, const dg_gemm_desc *g, const void *a,
                          const void *b, void *c);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_MATMUL_CUH */
