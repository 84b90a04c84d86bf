/*
 * kernels/kda/beta.cu -- N2, the beta transform (kda.md §11.3, §11.6 B5); CPU twin: ops/kda/beta.c.
 *   forward:   beta = c sigmoid(b)
 *   backward:  db = dbeta c s (1 - s),  s = sigmoid(b)
 * One thread per element (n elements, grid-stride); one f32 FFMA variant: the tc mode does not
 * apply. Entry points (kda_cuda.h): dg__kda_beta_fwd_cuda, dg__kda_beta_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

// ---- forward kernel

/* b of TB: f32 or bf16 (read as stored). */
template <class TB>
__global__ void kda_beta_fwd_kernel(int64_t n, float c, const TB *__restrict__ b,
                                    float *__restrict__ beta) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        beta[i] = c * kda_dsigmoid(kda_ld(b + i));
}

// ---- backward kernel

/* b and db of TB: f32 or bf16 (db written in b's dtype). */
template <class TB>
__global__ void beta_bwd_kernel(int64_t n, float c, const TB *b, const float *dbeta, TB *db) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float s = kda_dsigmoid(kda_ld(b + i));
        kda_st(db + i, dbeta[i] * c * s * (1.f - s));
    }
}

// ---- launchers

extern "C" dg_status dg__kda_beta_fwd_cuda(dg_ctx *ctx, int64_t n, float c, int bbf16,
                                           const void *b, float *beta) {
    if (!ctx || !b || !beta || n < 0)
        return dg__err(DG_ERR_ARG, "dg__kda_beta_fwd_cuda: bad arguments (n=%lld)", (long long)n);
    if (n == 0)
        return DG_OK;
    if (bbf16)
        kda_beta_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(
            n, c, (const kda_bf16 *)b, beta);
    else
        kda_beta_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(
            n, c, (const float *)b, beta);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__kda_beta_bwd_cuda(dg_ctx *ctx, int64_t n, float c, int bbf16,
                                           const void *b, const float *dbeta, void *db) {
    if (n <= 0 || !db)
        return DG_OK;
    if (bbf16)
        beta_bwd_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(n, c, (const kda_bf16 *)b,
                                                                         dbeta, (kda_bf16 *)db);
    else
        beta_bwd_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(n, c, (const float *)b,
                                                                         dbeta, (float *)db);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
