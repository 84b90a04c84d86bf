/*
 * kernels/matmul.cu -- the cuBLAS launcher behind dg_matmul / dg_linear (see matmul.cuh).
 *
 * cuBLAS is column-major; our matrices are row-major. A row-major [r,c] matrix with leading
 * dimension ld is the column-major [c,r] matrix with the same ld, i.e. its transpose. So
 *   C = op(A) op(B)   (row-major)   <=>   C^T = op(B)^T op(A)^T   (column-major)
 * and we call cuBLAS with the operands swapped: m = n, n = m, first = B (cuBLAS op T iff trans_b),
 * second = A (op T iff trans_a), ldc = our ldc.
 *
 * Precision: f32 uses CUBLAS_COMPUTE_32F, which is full f32 only while the handle's math mode
 * allows no TF32 or emulation; the launcher checks the mode (contexts set CUBLAS_DEFAULT_MATH)
 * rather than trusting it. bf16 stores bf16 and accumulates in f32; f64 uses CUBLAS_COMPUTE_64F.
 */
#include "common.cuh"
#include "matmul.cuh"

#include <limits.h>

// ---- kernel launchers

static int fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

extern "C" dg_status dg__matmul_cuda(dg_ctx *ctx, dg_dtype dt, const dg_gemm_desc *g, const void *a,
                                     const void *b, void *c) {
    if (g->m <= 0 || g->n <= 0 || g->batch <= 0)
        return DG_OK;
    size_t esize = dg_dtype_size(dt);
    if (g->k <= 0) { /* cuBLAS leaves C alone for k = 0 with beta = 0 on some paths: zero it */
        if (g->beta != 0)
            return dg__err(DG_ERR_ARG, "matmul (cuda): k = 0 with beta != 0 is not supported");
        if (g->ldc != g->n || (g->batch > 1 && g->stride_c != g->m * g->n))
            return dg__err(DG_ERR_ARG, "matmul (cuda): k = 0 needs a contiguous C");
        DG_CHECK_CUDA(
            cudaMemsetAsync(c, 0, (size_t)(g->batch * g->m * g->n) * esize, dg__stream(ctx)));
        return DG_OK;
    }
    if (!fits_int(g->m) || !fits_int(g->n) || !fits_int(g->k) || !fits_int(g->lda) ||
        !fits_int(g->ldb) || !fits_int(g->ldc) || !fits_int(g->batch))
        return dg__err(DG_ERR_ARG,
                       "matmul (cuda): sizes m=%lld n=%lld k=%lld (lda %lld, ldb %lld, ldc %lld, "
                       "batch %lld) exceed cuBLAS's int range",
                       (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->lda,
                       (long long)g->ldb, (long long)g->ldc, (long long)g->batch);

    cublasHandle_t h = dg__cublas(ctx);
    cublasMath_t mode;
    DG_CHECK_CUBLAS(cublasGetMathMode(h, &mode));
    int base = (int)mode & ~(int)CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    if (dt == DG_F32 && base != CUBLAS_DEFAULT_MATH && base != CUBLAS_PEDANTIC_MATH)
        return dg__err(DG_ERR_CUBLAS,
                       "matmul (cuda): the context's cuBLAS math mode is %d, which allows TF32 or "
                       "emulated f32; f32 GEMMs need CUBLAS_DEFAULT_MATH",
                       (int)mode);

    cudaDataType_t ty;
    cublasComputeType_t ct;
    const void *alpha, *beta;
    float af = (float)g->alpha, bf = (float)g->beta;
    double ad = g->alpha, bd = g->beta;
    switch (dt) {
    case DG_F64:
        ty = CUDA_R_64F;
        ct = CUBLAS_COMPUTE_64F;
        alpha = &ad;
        beta = &bd;
        break;
    case DG_F32:
        ty = CUDA_R_32F;
        ct = CUBLAS_COMPUTE_32F;
        alpha = &af;
        beta = &bf;
        break;
    case DG_BF16:
        ty = CUDA_R_16BF;
        ct = CUBLAS_COMPUTE_32F;
        alpha = &af;
        beta = &bf;
        break;
    default:
        return dg__err(DG_ERR_DTYPE, "matmul (cuda): dtype %s has no GEMM", dg_dtype_name(dt));
    }
    /* Pointer-mode host: alpha/beta are read at call time, so stack values are fine. */
    DG_CHECK_CUBLAS(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
    DG_CHECK_CUBLAS(cublasGemmStridedBatchedEx(
        h, g->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
        (int)g->n, (int)g->m, (int)g->k, alpha, b, ty, (int)g->ldb, (long long)g->stride_b, a, ty,
        (int)g->lda, (long long)g->stride_a, beta, c, ty, (int)g->ldc, (long long)g->stride_c,
        (int)g->batch, ct, CUBLAS_GEMM_DEFAULT));
    return DG_OK;
}
