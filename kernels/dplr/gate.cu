/*
 * kernels/dplr/gate.cu -- the chunk-local cumulative log decays of DPLR (dplr.md D3); CPU
 * twins: dg__dplr_cumsum_fwd_f32 / dg__dplr_cumsum_bwd_f32 in ops/dplr/gate_cumsum.c (same
 * formulas, same order of the sums).
 *   forward:   Ge_i = sum_{r<i} gk_r,  Gi_i = sum_{r<=i} gk_r  within each chunk, every gk floored
 *              at -128 first (a decay of zero stays finite in the gate differences)
 *   backward:  dgk_i = sum_{r>=i} dGi_r + sum_{r>i} dGe_r within the chunk, 0 where gk is below
 *              the floor
 * gk [TT,H,K] is f32 or bf16 (read as stored; dgk is written in the same dtype); Gi, Ge, dGi, dGe
 * are f32. One thread per (chunk, column of the [H*K] token row) walks its chunk's tokens in
 * order (backward: in reverse), as the CPU does; threads of a block read consecutive columns.
 * Entry points (dplr_cuda.h): dg__dplr_cumsum_fwd_cuda, dg__dplr_cumsum_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

// ---- kernels

/* grid (NC, ceil(H*K / NTH)) */
template <class TI>
__global__ void __launch_bounds__(NTH)
    dplr_cumsum_fwd_kernel(Dims d, const TI *__restrict__ gk, float *__restrict__ Gi,
                           float *__restrict__ Ge) {
    const int row = d.H * d.K;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= row)
        return;
    const int64_t t0 = d.chunk_t0[blockIdx.x];
    const int L = d.chunk_len[blockIdx.x];
    float acc = 0.f;
    for (int i = 0; i < L; i++) {
        const int64_t x = (t0 + i) * row + e;
        const float g = kda_ld(gk + x);
        Ge[x] = acc;
        acc += g < DPLR_G_FLOOR_F ? DPLR_G_FLOOR_F : g; /* NaN stays NaN */
        Gi[x] = acc;
    }
}

template <class TI>
__global__ void __launch_bounds__(NTH)
    dplr_cumsum_bwd_kernel(Dims d, const TI *__restrict__ gk, const float *__restrict__ dGi,
                           const float *__restrict__ dGe, TI *__restrict__ dgk) {
    const int row = d.H * d.K;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= row)
        return;
    const int64_t t0 = d.chunk_t0[blockIdx.x];
    const int L = d.chunk_len[blockIdx.x];
    float acc = 0.f; /* sum_{r>=i} dGi_r + sum_{r>i} dGe_r */
    for (int i = L - 1; i >= 0; i--) {
        const int64_t x = (t0 + i) * row + e;
        if (dGi)
            acc += dGi[x];
        kda_st(dgk + x, kda_ld(gk + x) < DPLR_G_FLOOR_F ? 0.f : acc);
        if (dGe)
            acc += dGe[x];
    }
}

// ---- launchers

extern "C" dg_status dg__dplr_cumsum_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                              const void *gk, float *Gi, float *Ge) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!gk || !Gi || !Ge)
        return dg__err(DG_ERR_ARG, "%s: gk, Gi and Ge are required", __func__);
    if (d->NC == 0)
        return DG_OK;
    const dim3 grid((unsigned)d->NC, (unsigned)DG_CEIL_DIV(d->H * d->K, NTH));
    DPLR_DISPATCH_TI(bf16, dplr_cumsum_fwd_kernel<TI_>
                     <<<grid, NTH, 0, dg__stream(ctx)>>>(make_dims(d), (const TI_ *)gk, Gi, Ge));
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_cumsum_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                              const void *gk, const float *dGi, const float *dGe,
                                              void *dgk) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!gk || !dgk)
        return dg__err(DG_ERR_ARG, "%s: gk and dgk are required (dGi, dGe optional)", __func__);
    if (d->NC == 0)
        return DG_OK;
    const dim3 grid((unsigned)d->NC, (unsigned)DG_CEIL_DIV(d->H * d->K, NTH));
    DPLR_DISPATCH_TI(bf16, dplr_cumsum_bwd_kernel<TI_><<<grid, NTH, 0, dg__stream(ctx)>>>(
                               make_dims(d), (const TI_ *)gk, dGi, dGe, (TI_ *)dgk));
    DG_CHECK_LAUNCH();
    return DG_OK;
}
