/*
 * kernels/l2norm.cu -- the L2 normalisation over the last axis (kernels/l2norm.cuh): dg_l2norm and
 * KDA's stage N1, the normalisation of q and k (kda.md §11.3, §11.6 B5); CPU twin: ops/l2norm.c
 * (same formulas).
 *   forward:   y = x r,  r = 1/sqrt(sum_D x^2 + eps)      x, y, dy, dx: [rows, D]; r: [rows]
 *   backward:  dx = r (dy - (dy . y) y)
 * y may be left unstored: the forward then writes r only and the backward forms y = x r again
 * (KDA's factored q, k: ops/kda/kda.h). The forward takes 16-byte pieces, a group of lanes per
 * row (l2norm_fwd_vec_kernel) where the sizes allow, else one warp per row; the backward one warp
 * per row; the sums over D are butterfly sums over the row's lanes. One f32 FFMA variant. The bf16
 * loads and stores and the warp sums are the KDA kernels' helpers (kda/common.cuh).
 */
#include "kda/common.cuh"
#include "l2norm.cuh"

using namespace kdab;

// ---- forward kernels

/* One warp per row; lanes stride over K, then a butterfly sum (every lane gets the total). x of
 * TX: f32, or bf16 read as it is stored (no converted copy). Any K and alignment. */
template <class TX>
__global__ void l2norm_fwd_kernel(int64_t rows, int K, float eps, const TX *__restrict__ x,
                                  float *__restrict__ y, float *__restrict__ r) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
         row += warps) {
        const TX *xr = x + row * K;
        float ss = 0.f;
        for (int c = lane; c < K; c += 32) {
            const float xv = kda_ld(xr + c);
            ss += xv * xv;
        }
        ss = warp_sum(ss);
        const float ri = 1.f / sqrtf(ss + eps);
        if (y)
            for (int c = lane; c < K; c += 32)
                y[row * K + c] = kda_ld(xr + c) * ri;
        if (r && lane == 0)
            r[row] = ri;
    }
}

/* 16-byte pieces: VEC = 16 / sizeof(TX) elements each, NP = K / VEC <= 32 pieces per row, a group
 * of LPR lanes per row (the smallest power of two >= NP, so a lane holds at most one piece of a
 * row), 32 / LPR rows per warp and pass, RU passes' loads issued before any sum (RU pieces in
 * flight per lane); the group's sum is a butterfly over its LPR lanes. Needs K % VEC == 0 and
 * 16-byte aligned x and y (the launcher checks). */
template <class TX>
__global__ void l2norm_fwd_vec_kernel(int64_t rows, int NP, int LPR, float eps,
                                      const TX *__restrict__ x, float *__restrict__ y,
                                      float *__restrict__ r) {
    constexpr int VEC = 16 / sizeof(TX), RU = 4;
    const int lane = threadIdx.x & 31, sub = lane % LPR, rpw = 32 / LPR;
    const int64_t K = (int64_t)NP * VEC;
    const int64_t step = (int64_t)gridDim.x * (blockDim.x >> 5) * rpw * RU;
    for (int64_t row0 = ((int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw * RU;
         row0 < rows; row0 += step) { /* warp-uniform: every lane takes part in the shuffles */
        float v[RU][VEC], ss[RU];
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const int64_t row = row0 + u * rpw + lane / LPR;
            if (row < rows && sub < NP) {
                kda_ld16(x + row * K + (int64_t)sub * VEC, v[u]);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; e++)
                    v[u][e] = 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < RU; u++) {
            ss[u] = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; e++)
                ss[u] += v[u][e] * v[u][e];
            for (int o = LPR / 2; o > 0; o >>= 1)
                ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
        }
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const int64_t row = row0 + u * rpw + lane / LPR;
            const float ri = 1.f / sqrtf(ss[u] + eps);
            if (row >= rows)
                continue;
            if (y && sub < NP) {
                float4 *yo = reinterpret_cast<float4 *>(y + row * K + (int64_t)sub * VEC);
#pragma unroll
                for (int e = 0; e < VEC; e += 4)
                    yo[e / 4] = make_float4(v[u][e] * ri, v[u][e + 1] * ri, v[u][e + 2] * ri,
                                            v[u][e + 3] * ri);
            }
            if (r && sub == 0)
                r[row] = ri;
        }
    }
}

// ---- backward kernel

/* One warp per row; the dot product is a butterfly warp sum, the same for every lane. dx of TD:
 * f32, or bf16 written straight into the input's gradient dtype. y NULL: y = x r is formed from
 * x (of TX) as the forward forms it (the factored form of KDA's in-op norm). */
template <class TD, class TX>
__global__ void l2norm_bwd_kernel(int64_t rows, int K, const float *y, const TX *x, const float *r,
                                  const float *dy, TD *dx) {
    const int lane = threadIdx.x & 31;
    const int64_t wpb = blockDim.x >> 5;
    for (int64_t row = blockIdx.x * wpb + (threadIdx.x >> 5); row < rows;
         row += (int64_t)gridDim.x * wpb) {
        const float *dyr = dy + row * K;
        const float ri = r[row];
        auto yv = [&](int c) { return y ? y[row * K + c] : kda_ld(x + row * K + c) * ri; };
        float dot = 0.f;
        for (int c = lane; c < K; c += 32)
            dot += dyr[c] * yv(c);
        dot = warp_sum(dot);
        for (int c = lane; c < K; c += 32)
            kda_st(dx + row * K + c, ri * (dyr[c] - dot * yv(c)));
    }
}

// ---- launchers

extern "C" dg_status dg__l2norm_fwd_cuda(dg_ctx *ctx, int64_t rows, int K, float eps, int xbf16,
                                         const void *x, float *y, float *r) {
    if (!ctx || !x || K < 1 || rows < 0)
        return dg__err(DG_ERR_ARG, "dg__l2norm_fwd_cuda: bad arguments (rows=%lld K=%d)",
                       (long long)rows, K);
    if (rows == 0)
        return DG_OK;
    const int threads = KDA_THREADS;
    const int vec = xbf16 ? 8 : 4, np = K / vec;
    if (K % vec == 0 && np <= 32 && aligned16(x) && (!y || aligned16(y))) {
        int lpr = 1; /* lanes per row: the smallest power of two >= np */
        while (lpr < np)
            lpr *= 2;
        const unsigned blocks = dg__blocks(DG_CEIL_DIV(rows, 4) * lpr, threads); /* RU = 4 */
        if (xbf16)
            l2norm_fwd_vec_kernel<<<blocks, threads, 0, dg__stream(ctx)>>>(
                rows, np, lpr, eps, (const kda_bf16 *)x, y, r);
        else
            l2norm_fwd_vec_kernel<<<blocks, threads, 0, dg__stream(ctx)>>>(rows, np, lpr, eps,
                                                                           (const float *)x, y, r);
    } else if (xbf16) {
        l2norm_fwd_kernel<<<dg__blocks(rows * 32, threads), threads, 0, dg__stream(ctx)>>>(
            rows, K, eps, (const kda_bf16 *)x, y, r);
    } else {
        l2norm_fwd_kernel<<<dg__blocks(rows * 32, threads), threads, 0, dg__stream(ctx)>>>(
            rows, K, eps, (const float *)x, y, r);
    }
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__l2norm_bwd_cuda(dg_ctx *ctx, int64_t rows, int K, const float *y,
                                         const void *x, const float *r, const float *dy, int xbf16,
                                         void *dx) {
    if (rows < 0 || K < 1)
        return dg__err(DG_ERR_SHAPE, "dg__l2norm_bwd_cuda: rows=%lld K=%d", (long long)rows, K);
    if (rows == 0 || !dx)
        return DG_OK;
    if (!r || !dy || (!y && !x))
        return dg__err(DG_ERR_ARG, "dg__l2norm_bwd_cuda: r, dy and one of y, x are required");
    const int rows_per_block = NTH / 32;
    const dim3 grid(dg__blocks(rows, rows_per_block));
    cudaStream_t s = dg__stream(ctx);
    if (xbf16)
        l2norm_bwd_kernel<<<grid, NTH, 0, s>>>(rows, K, y, (const kda_bf16 *)x, r, dy,
                                               (kda_bf16 *)dx);
    else
        l2norm_bwd_kernel<<<grid, NTH, 0, s>>>(rows, K, y, (const float *)x, r, dy, (float *)dx);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
