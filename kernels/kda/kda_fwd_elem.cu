/*
 * kernels/kda/kda_fwd_elem.cu -- the elementwise KDA forward stages (spec §3, §4, §5.0):
 *   N1 l2norm:  y = x r,  r = 1/sqrt(sum_K x^2 + 1e-6)             x, y: [rows, K]; r: [rows]
 *   N2 beta:    beta = c sigmoid(b)                                  n elements
 *   N3 gate:    g = gate(x) (NONE / KDA / LOWERBOUND), then the chunk-local inclusive cumsum
 *               G_i = sum_{r <= i} g_r restarting at every chunk     x, G: [TT, HV, K]
 * f32 storage and arithmetic; the same formulas as ops/kda/{l2norm,beta,gate_cumsum}.c.
 */
#include "kda_fwd_util.cuh"

// ---- CUDA kernels

/* One warp per row; lanes stride over K, then a butterfly sum (every lane gets the total). */
__global__ void kda_l2norm_fwd_kernel(int64_t rows, int K, const float *__restrict__ x,
                                      float *__restrict__ y, float *__restrict__ r) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
         row += warps) {
        const float *xr = x + row * K;
        float ss = 0.f;
        for (int c = lane; c < K; c += 32)
            ss += xr[c] * xr[c];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float ri = 1.f / sqrtf(ss + 1e-6f);
        for (int c = lane; c < K; c += 32)
            y[row * K + c] = xr[c] * ri;
        if (r && lane == 0)
            r[row] = ri;
    }
}

__global__ void kda_beta_fwd_kernel(int64_t n, float c, const float *__restrict__ b,
                                    float *__restrict__ beta) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        beta[i] = c * kda_dsigmoid(b[i]);
}

/* g for element (hv, c) of one token row; xv = x at that element. */
__device__ __forceinline__ float kda_gate_value(dg_gate_kind kind, float lb, float xv, float a,
                                                const float *dt_bias, int e) {
    if (kind == DG_GATE_NONE)
        return xv;
    const float z = xv + (dt_bias ? dt_bias[e] : 0.f);
    if (kind == DG_GATE_KDA)
        return -a * kda_dsoftplus(z);
    return lb * kda_dsigmoid(a * z);
}

/* No cumsum: one thread per element of [TT, HV*K]. */
__global__ void kda_gate_fwd_kernel(int64_t n, int HV, int K, dg_gate_kind kind, float lb,
                                    const float *__restrict__ x, const float *__restrict__ A_log,
                                    const float *__restrict__ dt_bias, float *__restrict__ G) {
    const int row = HV * K;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int e = (int)(i % row), hv = e / K;
        const float a = A_log ? expf(A_log[hv]) : 1.f;
        G[i] = kda_gate_value(kind, lb, x[i], a, dt_bias, e);
    }
}

/* Cumsum: blockIdx.x = chunk, threads over the HV*K columns of a token row (coalesced); each
 * thread walks the L tokens of its chunk in order, as the CPU does (G_i = G_{i-1} + g_i). */
__global__ void kda_gate_cumsum_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                                           const int32_t *__restrict__ chunk_len, int HV, int K,
                                           dg_gate_kind kind, float lb,
                                           const float *__restrict__ x,
                                           const float *__restrict__ A_log,
                                           const float *__restrict__ dt_bias,
                                           float *__restrict__ G) {
    const int row = HV * K;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= row)
        return;
    const int64_t t0 = chunk_t0[blockIdx.x];
    const int L = chunk_len[blockIdx.x];
    const float a = A_log ? expf(A_log[e / K]) : 1.f;
    float acc = 0.f;
    for (int i = 0; i < L; i++) {
        const int64_t idx = (t0 + i) * row + e;
        /* floored as on the CPU (ops/kda/gate_cumsum.c): a decay of zero (g = -inf) would make
         * G differences -inf - (-inf); exp(-128) is 0 in f32 anyway. NaN stays NaN. */
        const float gv = kda_gate_value(kind, lb, x[idx], a, dt_bias, e);
        acc += gv < KDA_G_FLOOR_F ? KDA_G_FLOOR_F : gv;
        G[idx] = acc;
    }
}

// ---- kernel launchers

extern "C" dg_status kda_l2norm_fwd_cuda(dg_ctx *ctx, int64_t rows, int K, const float *x,
                                         float *y, float *r) {
    if (!ctx || !x || !y || K < 1 || rows < 0)
        return dg__err(DG_ERR_ARG, "kda_l2norm_fwd_cuda: bad arguments (rows=%lld K=%d)",
                       (long long)rows, K);
    if (rows == 0)
        return DG_OK;
    const int threads = KDA_THREADS;
    kda_l2norm_fwd_kernel<<<dg__blocks(rows * 32, threads), threads, 0, dg__stream(ctx)>>>(
        rows, K, x, y, r);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status kda_beta_fwd_cuda(dg_ctx *ctx, int64_t n, float c, const float *b,
                                       float *beta) {
    if (!ctx || !b || !beta || n < 0)
        return dg__err(DG_ERR_ARG, "kda_beta_fwd_cuda: bad arguments (n=%lld)", (long long)n);
    if (n == 0)
        return DG_OK;
    kda_beta_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(n, c, b,
                                                                                           beta);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status kda_gate_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind,
                                       float lb, int cumsum, const float *x, const float *A_log,
                                       const float *dt_bias, float *G) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!x || !G)
        return dg__err(DG_ERR_ARG, "%s: x and G are required", __func__);
    if (kind != DG_GATE_NONE && kind != DG_GATE_KDA && kind != DG_GATE_LOWERBOUND)
        return dg__err(DG_ERR_ARG, "%s: unknown gate kind %d", __func__, (int)kind);
    const int row = d->HV * d->K;
    if (!cumsum) {
        const int64_t n = d->TT * row;
        kda_gate_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(
            n, d->HV, d->K, kind, lb, x, A_log, dt_bias, G);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
    if (d->NC == 0)
        return DG_OK;
    dim3 grid((unsigned)d->NC, (unsigned)DG_CEIL_DIV(row, KDA_THREADS));
    kda_gate_cumsum_fwd_kernel<<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
        d->chunk_t0, d->chunk_len, d->HV, d->K, kind, lb, x, A_log, dt_bias, G);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
