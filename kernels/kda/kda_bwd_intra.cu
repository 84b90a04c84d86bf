/*
 * kernels/kda/kda_bwd_intra.cu -- backward of N4 (spec §6.3 last line, §6.4); CPU twin:
 * kda_intra_bwd_f32 in ops/kda/intra.c.
 *
 * Per chunk (rows i, j < L) and value head, with x_ij = exp(G_i - G_j) (per key dim, j <= i):
 *   dLkk = -stril(Tm^T dTm Tm^T):  X1 = stril(dTm) Tm^T,  dLkk[i,j] = -sum_m Tm[m,i] X1[m,j]
 *   dA = s dAqk,  dP[i,j] = beta_i dLkk[i,j]
 *   dq_i  = sum_{j<=i} dA[i,j] k_j x_ij                                  (Rq)
 *   dk_i  = beta_i sum_{j<i} dLkk[i,j] k_j x_ij                          (Rk = beta_i RL_i)
 *         + sum_{m>=i} dA[m,i] q_m x_mi + sum_{m>i} dP[m,i] k_m x_mi    (Cq + Ck)
 *   dG_i  = q_i Rq_i + k_i Rk_i - k_i (Cq_i + Ck_i)
 *   dbeta_i = sum_{j<i} dLkk[i,j] P[i,j] = sum_d k_i RL_i     (P expanded: no extra L*L*K pass)
 * Only exponents G_i - G_j with j <= i are formed; they are <= 0 (§7.1).
 *
 * Kernels: (1) intra_dl: block per (chunk, hv), dLkk into a scratch [TT,HV,BT] (the L^3 part, done
 * once per chunk); (2) intra_main: block per (chunk, hv, 32-wide key tile); lane = key dim, warp w
 * = rows w, w+8, ...; each thread forms its row side (j <= r) and column side (m >= r) sums, so no
 * reduction crosses threads except dbeta's sum over d (warp butterfly per tile, then the tiles in
 * a fixed order). dq, dk are produced per value head and summed over the G heads of a group by a
 * second kernel (deterministic GVA reduction); with G = 1 they are written in place.
 * Shared memory: intra_dl 2 x BT x (BT+1) floats (33 KB at BT = 64); intra_main
 * (3 x BT x 32 + 2 x BT x BT + BT) floats (56 KB at BT = 64, dynamic, opted in).
 */
#include "kda_bwd.cuh"

using namespace kdab;

// ---- CUDA kernels

/* grid (NC, HV), 256 threads. sTt[a][j] = Tm[j][a] (a <= j), sD = strictly lower dTm, then X1 in
 * place (row m is owned by one warp: all its lanes read, __syncwarp, then write). */
template <int BT>
__global__ void __launch_bounds__(NTH)
    intra_dl_kernel(Dims d, const float *Tm, const float *dTm, float *dL) {
    __shared__ float sTt[BT][BT + 1];
    __shared__ float sD[BT][BT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        float tv = 0.f, dv = 0.f;
        if (row < L) {
            const int64_t g = ((t0 + row) * d.HV + hv) * BT + col;
            if (col <= row)
                tv = Tm[g];
            if (col < row)
                dv = dTm[g];
        }
        sTt[col][row] = tv;
        sD[row][col] = dv;
    }
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int JP = (BT + 31) / 32;
    /* X1[m][j] = sum_{a <= j} dTm[m][a] Tm[j][a]  (j < m), same order as the CPU */
    for (int m = w; m < L; m += NW) {
        float val[JP];
#pragma unroll
        for (int p = 0; p < JP; p++) {
            const int j = lane + 32 * p;
            float s = 0.f;
            if (j < m)
                for (int a = 0; a <= j; a++)
                    s += sD[m][a] * sTt[a][j];
            val[p] = s;
        }
        __syncwarp();
#pragma unroll
        for (int p = 0; p < JP; p++) {
            const int j = lane + 32 * p;
            if (j < BT)
                sD[m][j] = val[p];
        }
    }
    __syncthreads();
    /* dLkk[i][j] = -sum_{m=i}^{L-1} Tm[m][i] X1[m][j]  (j < i); zero elsewhere in the row */
    for (int i = w; i < L; i += NW)
        for (int j = lane; j < BT; j += 32) {
            float s = 0.f;
            if (j < i)
                for (int m = i; m < L; m++)
                    s += sTt[i][m] * sD[m][j];
            dL[((t0 + i) * d.HV + hv) * BT + j] = j < i ? -s : 0.f;
        }
}

/* exp on the tensor-core path (FAST: bf16 inputs, TF32 products) is the hardware approximation
 * (ex2.approx; relative error a few 1e-6 for the exponents that occur, far below TF32's 2^-11);
 * the f32 path keeps the accurate expf that pins it to the CPU reference within 1e-5. */
template <bool FAST> __device__ __forceinline__ float intra_exp(float x) {
    return FAST ? __expf(x) : expf(x);
}

/* grid (NC, HV, ceil(K/32)), 256 threads, dynamic shared memory (see the file comment). */
template <int BT, bool FAST>
__global__ void __launch_bounds__(NTH)
    intra_main_kernel(Dims d, float scale, const float *q, const float *k, const float *beta,
                      const float *G, const float *dAqk, const float *dL, float *dqv, float *dkv,
                      float *dG, float *dbp) {
    extern __shared__ float sm[];
    float(*sq)[CT] = (float(*)[CT])sm;
    float(*sk)[CT] = sq + BT;
    float(*sG)[CT] = sk + BT;
    float(*sdA)[BT] = (float(*)[BT])(sm + 3 * BT * CT);
    float(*sdL)[BT] = sdA + BT;
    float *sb = sm + 3 * BT * CT + 2 * BT * BT;

    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, kt = blockIdx.z, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K;
    const int e0 = kt * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int row = idx / CT, col = idx % CT, e = e0 + col;
        const bool ok = row < L && e < K;
        sq[row][col] = ok ? q[((t0 + row) * H + hq) * K + e] : 0.f;
        sk[row][col] = ok ? k[((t0 + row) * H + hq) * K + e] : 0.f;
        sG[row][col] = ok ? G[((t0 + row) * HV + hv) * K + e] : 0.f;
    }
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        const int64_t g = ((t0 + row) * HV + hv) * BT + col;
        sdA[row][col] = (dAqk && row < L && col <= row) ? scale * dAqk[g] : 0.f;
        sdL[row][col] = (dL && row < L && col < row) ? dL[g] : 0.f;
    }
    for (int i = threadIdx.x; i < BT; i += NTH)
        sb[i] = i < L ? beta[(t0 + i) * HV + hv] : 0.f;
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    for (int r = w; r < L; r += NW) { /* r is the same for the whole warp */
        const float Gr = sG[r][lane], qr = sq[r][lane], kr = sk[r][lane];
        /* row side: j <= r (sdL[r][r] = 0) */
        float rq = 0.f, rl = 0.f;
        for (int j = 0; j <= r; j++) {
            const float kx = sk[j][lane] * intra_exp<FAST>(Gr - sG[j][lane]);
            rq += sdA[r][j] * kx;
            rl += sdL[r][j] * kx;
        }
        /* column side: m >= r (sdL[r][r] = 0) */
        float cq = 0.f, ck = 0.f;
        for (int m = r; m < L; m++) {
            const float x = intra_exp<FAST>(sG[m][lane] - Gr);
            cq += sdA[m][r] * sq[m][lane] * x;
            ck += sb[m] * sdL[m][r] * sk[m][lane] * x;
        }
        const float rk = sb[r] * rl, col = cq + ck;
        if (e < K) {
            const int64_t idx = ((t0 + r) * HV + hv) * K + e;
            if (dqv)
                dqv[idx] = rq;
            if (dkv)
                dkv[idx] = rk + col;
            if (dG)
                dG[idx] = qr * rq + kr * rk - kr * col;
        }
        const float pb = warp_sum(kr * rl); /* lanes past K hold k = 0 */
        if (dbp && lane == 0)
            dbp[(int64_t)kt * d.TT * HV + (t0 + r) * HV + hv] = pb;
    }
}

// ---- kernel launchers

template <int BT>
static dg_status intra_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const float *q,
                              const float *k, const float *beta, const float *G, const float *Tm,
                              const float *dAqk, const float *dTm, float *dq, float *dk,
                              float *dbeta, float *dG) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const int nkt = DG_CEIL_DIV(d.K, CT);
    const size_t vk = (size_t)d.TT * d.HV * d.K;
    /* scratch: dLkk [TT,HV,BT]; dq, dk per value head when G > 1; dbeta partials when nkt > 1 */
    const bool need_dl = dTm != nullptr, per_hv = d.G > 1, parts = nkt > 1;
    size_t n = (need_dl ? (size_t)d.TT * d.HV * BT : 0) + (per_hv ? 2 * vk : 0) +
               (parts && dbeta ? (size_t)nkt * d.TT * d.HV : 0);
    Scratch scr(ctx);
    if (n)
        DG_TRY(scr.alloc(n));
    float *p = scr.f();
    float *dL = nullptr, *dqv = dq, *dkv = dk, *dbp = dbeta;
    if (need_dl) {
        dL = p;
        p += (size_t)d.TT * d.HV * BT;
    }
    if (per_hv) {
        dqv = dq ? p : nullptr;
        dkv = dk ? p + vk : nullptr;
        p += 2 * vk;
    }
    if (parts && dbeta)
        dbp = p;
    if (need_dl) {
        intra_dl_kernel<BT><<<dim3((unsigned)d.NC, d.HV), NTH, 0, s>>>(d, Tm, dTm, dL);
        DG_CHECK_LAUNCH();
    }
    const size_t smem = sizeof(float) * (3 * BT * CT + 2 * BT * BT + BT);
    const dim3 grid((unsigned)d.NC, d.HV, nkt);
    if (dd->tc) {
        DG_TRY(smem_opt_in(intra_main_kernel<BT, true>, smem));
        intra_main_kernel<BT, true><<<grid, NTH, smem, s>>>(d, scale, q, k, beta, G, dAqk, dL,
                                                             dqv, dkv, dG, dbp);
    } else {
        DG_TRY(smem_opt_in(intra_main_kernel<BT, false>, smem));
        intra_main_kernel<BT, false><<<grid, NTH, smem, s>>>(d, scale, q, k, beta, G, dAqk, dL,
                                                              dqv, dkv, dG, dbp);
    }
    DG_CHECK_LAUNCH();
    if (per_hv && dq)
        DG_TRY(kda_sum_parts(ctx, dq, dqv, d.TT, d.H, d.G, d.K, 1, 0));
    if (per_hv && dk)
        DG_TRY(kda_sum_parts(ctx, dk, dkv, d.TT, d.H, d.G, d.K, 1, 0));
    if (parts && dbeta)
        DG_TRY(kda_sum_parts(ctx, dbeta, dbp, d.TT * d.HV, 1, 1, 1, nkt, d.TT * d.HV));
    return DG_OK;
}

extern "C" dg_status kda_intra_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                        const float *q, const float *k, const float *beta,
                                        const float *G, const float *Tm, const float *dAqk,
                                        const float *dTm, float *dq, float *dk, float *dbeta,
                                        float *dG) {
    DG_TRY(check_dims("kda_intra_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    switch (d->BT) {
    case 16:
        return intra_bwd_bt<16>(ctx, d, scale, q, k, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG);
    case 32:
        return intra_bwd_bt<32>(ctx, d, scale, q, k, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG);
    default:
        return intra_bwd_bt<64>(ctx, d, scale, q, k, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG);
    }
}
