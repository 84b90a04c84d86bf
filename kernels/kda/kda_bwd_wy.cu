/*
 * kernels/kda/kda_bwd_wy.cu -- backward of N5, the WY transform (spec §6.3 WY part, §10 N5); CPU
 * twin: kda_wy_bwd_f32 in ops/kda/wy.c.
 *
 * Per chunk (rows i, j < L) and value head, gamma_j = exp(G_j), lambda = G_{L-1}, X_j = beta_j k_j
 * gamma_j:
 *   dX = Tm^T dW,  dVb = Tm^T dU                   (dX_j = sum_{i>=j} Tm[i,j] dW_i)
 *   dq_j = dQG_j gamma_j                            a_j = dKG_j exp(lambda - G_j)
 *   dk_j = a_j + beta_j gamma_j dX_j                dv_j = beta_j dVb_j
 *   dG_j = q_j dQG_j gamma_j - k_j a_j + X_j dX_j  (+ sum_i k_i a_i on row L-1: lambda's share)
 *   dbeta_j = sum_v dVb_j v_j + sum_d dX_j k_j gamma_j
 *   dTm[i,j] = beta_j (dU_i . v_j) + dW_i . X_j     (j <= i; zero for j > i, as the CPU writes)
 * Every exponent (G_j, lambda - G_j) is <= 0.
 *
 * Kernels: (1) wy_cols: block per (chunk, hv, 32-wide tile of the K key dims followed by the V
 * value dims); lane = column, warp w = rows w, w+8, ...; the column sums of Tm^T are per thread;
 * the last-row sum over rows goes through an 8 x 32 shared array summed in warp order; dbeta's
 * sums over columns are warp butterflies written per tile and summed over tiles in a fixed order.
 * (2) wy_dtm: block per (chunk, hv), 16 x 16 threads, each a (BT/16)^2 register block of dTm,
 * looping over 32-column tiles of the concatenated [dW | dU] and [X | beta v] rows.
 * dq, dk per value head are summed over the G heads of a group afterwards (G > 1).
 * Shared memory (static): wy_cols BT x BT + BT x 32 + 8 x 32 floats (25 KB at BT = 64);
 * wy_dtm 2 x BT x 33 floats (17 KB at BT = 64).
 */
#include "kda_bwd.cuh"
#include "kda_mma.cuh"

using namespace kdab;

// ---- CUDA kernels

template <int BT>
__global__ void __launch_bounds__(NTH)
    wy_cols_kernel(Dims d, const float *q, const float *k, const float *v, const float *beta,
                   const float *G, const float *Tm, const float *dW, const float *dU,
                   const float *dKG, const float *dQG, float *dqv, float *dkv, float *dv, float *dG,
                   float *dbp, unsigned acc) {
    __shared__ float sTm[BT][BT];
    __shared__ float sX[BT][CT];
    __shared__ float red[NW][CT];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, z = blockIdx.z, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K, V = d.V;
    const int nkt = DG_CEIL_DIV(K, CT);
    const bool key = z < nkt;
    const int c0 = key ? z * CT : (z - nkt) * CT; /* first key dim or first value dim */
    const int ncol = key ? K : V;
    const float *up = key ? dW : dU; /* the upstream gradient Tm^T is applied to */
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        sTm[row][col] = (row < L && col <= row) ? Tm[((t0 + row) * HV + hv) * BT + col] : 0.f;
    }
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int row = idx / CT, col = idx % CT;
        sX[row][col] =
            (up && row < L && c0 + col < ncol) ? up[((t0 + row) * HV + hv) * ncol + c0 + col] : 0.f;
    }
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = c0 + lane;
    const bool ok = e < ncol;
    const float lam = (key && ok) ? G[((t0 + L - 1) * HV + hv) * K + e] : 0.f;
    float colsum = 0.f, last = 0.f;
    for (int j = w; j < L; j += NW) { /* j is the same for the whole warp */
        float s = 0.f;                /* (Tm^T up)_j, rows i >= j in order */
        for (int i = j; i < L; i++)
            s += sTm[i][j] * sX[i][lane];
        const int64_t t = t0 + j;
        const float bj = beta[t * HV + hv];
        float pb = 0.f;
        if (key && ok) {
            const int64_t ig = (t * HV + hv) * K + e, iq = (t * H + hq) * K + e;
            const float Gj = G[ig], kj = k[iq], qj = q[iq];
            const float gam = expf(Gj);
            const float X = bj * kj * gam;
            const float tq = dQG ? dQG[ig] * gam : 0.f;
            const float a = dKG ? dKG[ig] * expf(lam - Gj) : 0.f;
            if (dqv)
                dqv[ig] = (acc & KDA_ACC_DQ ? dqv[ig] : 0.f) + tq;
            if (dkv)
                dkv[ig] = (acc & KDA_ACC_DK ? dkv[ig] : 0.f) + a + bj * gam * s;
            const float g = qj * tq - kj * a + X * s;
            if (j == L - 1)
                last = g;
            else if (dG)
                dG[ig] = (acc & KDA_ACC_DG ? dG[ig] : 0.f) + g;
            colsum += kj * a;
            pb = s * kj * gam;
        } else if (ok) {
            const int64_t iv = (t * HV + hv) * V + e;
            if (dv)
                dv[iv] = bj * s;
            pb = s * v[iv];
        }
        pb = warp_sum(pb);
        if (dbp && lane == 0)
            dbp[(int64_t)z * d.TT * HV + t * HV + hv] = pb;
    }
    if (!key)
        return; /* block-uniform: the value tiles have no last-row sum */
    red[w][lane] = colsum;
    __syncthreads();
    if (w == (L - 1) % NW && ok && dG) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < NW; ww++)
            s += red[ww][lane];
        float *o = dG + ((t0 + L - 1) * HV + hv) * K + e;
        *o = (acc & KDA_ACC_DG ? *o : 0.f) + last + s;
    }
}

/* grid (NC, HV), 256 threads as 16 x 16; thread (tx, ty) owns rows ty + 16a, columns tx + 16b. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    wy_dtm_kernel(Dims d, const float *k, const float *v, const float *beta, const float *G,
                  const float *dW, const float *dU, float *dTm) {
    constexpr int RB = BT / 16;
    __shared__ float sA[BT][CT + 1];
    __shared__ float sB[BT][CT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[RB][RB];
#pragma unroll
    for (int a = 0; a < RB; a++)
#pragma unroll
        for (int b = 0; b < RB; b++)
            acc[a][b] = 0.f;
    const int ncol = K + V;
    for (int c0 = 0; c0 < ncol; c0 += CT) {
        __syncthreads(); /* the previous tile has been read */
        for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
            const int row = idx / CT, cc = idx % CT, col = c0 + cc;
            float av = 0.f, bv = 0.f;
            if (row < L && col < ncol) {
                const int64_t t = t0 + row;
                const float bj = beta[t * HV + hv];
                if (col < K) {
                    const int64_t ig = (t * HV + hv) * K + col;
                    av = dW ? dW[ig] : 0.f;
                    bv = bj * k[(t * H + hq) * K + col] * expf(G[ig]);
                } else {
                    const int64_t iv = (t * HV + hv) * V + (col - K);
                    av = dU ? dU[iv] : 0.f;
                    bv = bj * v[iv];
                }
            }
            sA[row][cc] = av;
            sB[row][cc] = bv;
        }
        __syncthreads();
        kda_tile_abt<BT>(acc, sA, sB, tx, ty);
    }
    kda_store_lower<BT>(acc, dTm, t0, L, hv, HV, tx, ty);
}

/* dTm on mma.sync for the tensor-core path (TF32), grid (NC, HV): the same product as
 * wy_dtm_kernel, dTm = [dW | dU] [X | Diag(beta) V]^T (j <= i), in 64-column stages of K then
 * V: the dW / dU tile (rows i) and the k (with G) or v tile (rows j) come in with cp.async, the
 * B tile is turned into X or beta v in place, then one mma stage. Dynamic shared memory
 * (BT + 128) x 68 floats (52 KB at BT = 64). Needs K, V % 4 == 0, 16-byte aligned arrays. */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    wy_dtm_mma_kernel(Dims d, const float *__restrict__ k, const float *__restrict__ v,
                      const float *__restrict__ beta, const float *__restrict__ G,
                      const float *__restrict__ dW, const float *__restrict__ dU,
                      float *__restrict__ dTm) {
    using namespace kdamma;
    constexpr int CS = AB_N, LD = CS + 4, NT = AB_THREADS;
    extern __shared__ __align__(16) float dtm_smem[];
    float *As = dtm_smem, *Bs = As + BT * LD, *Gs = Bs + AB_N * LD;
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int nK = DG_CEIL_DIV(K, CS), nV = DG_CEIL_DIV(V, CS);
    float acc[AbTile<BT>::NTW][4] = {};
    for (int st = 0; st < nK + nV; st++) {
        const bool kp = st < nK; /* a key stage (dW, X) or a value stage (dU, beta v) */
        const float *A = kp ? dW : dU;
        if (!A)
            continue; /* block-uniform: zero gradient */
        const int D = kp ? K : V, c0 = CS * (kp ? st : st - nK);
        __syncthreads(); /* the previous stage has been read */
        tile_async<BT, CS, LD, NT>(As, A + (t0 * HV + hv) * D, (int64_t)HV * D, L, c0, D);
        if (kp) {
            tile_async<AB_N, CS, LD, NT>(Bs, k + (t0 * H + hq) * K, (int64_t)H * K, L, c0, K);
            tile_async<AB_N, CS, LD, NT>(Gs, G + (t0 * HV + hv) * K, (int64_t)HV * K, L, c0, K);
        } else {
            tile_async<AB_N, CS, LD, NT>(Bs, v + (t0 * HV + hv) * V, (int64_t)HV * V, L, c0, V);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        for (int idx = threadIdx.x; idx < L * CS; idx += NT) {
            const int j = idx / CS, e = idx % CS;
            const float bj = beta[(t0 + j) * HV + hv], x = Bs[j * LD + e];
            Bs[j * LD + e] = kp ? bj * x * __expf(Gs[j * LD + e]) : bj * x;
        }
        __syncthreads();
        mma_stage<BT, true, true, 0, CS>(acc, As, LD, Bs, LD, 0);
    }
    /* rows i < L, every column j < BT: the product for j <= i, zero above (as the CPU writes) */
    store_acc<BT, true>(acc, dTm + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, BT, 1.f);
}

// ---- kernel launchers

template <int BT>
static dg_status wy_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, const float *q, const float *k,
                           const float *v, const float *beta, const float *G, const float *Tm,
                           const float *dW, const float *dU, const float *dKG, const float *dQG,
                           float *dq, float *dk, float *dv, float *dbeta, float *dG, float *dTm,
                           unsigned acc) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const int nkt = DG_CEIL_DIV(d.K, CT), nvt = DG_CEIL_DIV(d.V, CT);
    const size_t vk = (size_t)d.TT * d.HV * d.K;
    const bool per_hv = d.G > 1;
    size_t n = (per_hv ? 2 * vk : 0) + (dbeta ? (size_t)(nkt + nvt) * d.TT * d.HV : 0);
    Scratch scr(ctx);
    if (n)
        DG_TRY(scr.alloc(n));
    float *p = scr.f();
    float *dqv = dq, *dkv = dk, *dbp = nullptr;
    if (per_hv) {
        dqv = dq ? p : nullptr;
        dkv = dk ? p + vk : nullptr;
        p += 2 * vk;
    }
    if (dbeta)
        dbp = p;
    /* the kernel adds to dq, dk only where it writes the final arrays (no GVA scratch) */
    const unsigned kacc = per_hv ? (acc & KDA_ACC_DG) : acc;
    wy_cols_kernel<BT><<<dim3((unsigned)d.NC, d.HV, nkt + nvt), NTH, 0, s>>>(
        d, q, k, v, beta, G, Tm, dW, dU, dKG, dQG, dqv, dkv, dv, dG, dbp, kacc);
    DG_CHECK_LAUNCH();
    if (dTm) {
        auto al = [](const void *ptr) { return ((uintptr_t)ptr & 15) == 0; };
        if (dd->tc == 1 && d.K % 4 == 0 && d.V % 4 == 0 && al(k) && al(v) && al(G) && al(dW) &&
            al(dU)) {
            const size_t smem = sizeof(float) * (size_t)(BT + 2 * kdamma::AB_N) * (kdamma::AB_N + 4);
            DG_TRY(smem_opt_in(wy_dtm_mma_kernel<BT>, smem));
            wy_dtm_mma_kernel<BT><<<dim3((unsigned)d.NC, d.HV), kdamma::AB_THREADS, smem, s>>>(
                d, k, v, beta, G, dW, dU, dTm);
        } else {
            wy_dtm_kernel<BT><<<dim3((unsigned)d.NC, d.HV), NTH, 0, s>>>(d, k, v, beta, G, dW, dU,
                                                                        dTm);
        }
        DG_CHECK_LAUNCH();
    }
    if (per_hv && dq)
        DG_TRY(kda_sum_parts(ctx, dq, dqv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DQ));
    if (per_hv && dk)
        DG_TRY(kda_sum_parts(ctx, dk, dkv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DK));
    if (dbeta)
        DG_TRY(kda_sum_parts(ctx, dbeta, dbp, d.TT * d.HV, 1, 1, 1, nkt + nvt, d.TT * d.HV, 0));
    return DG_OK;
}

extern "C" dg_status kda_wy_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const float *q,
                                     const float *k, const float *v, const float *beta,
                                     const float *G, const float *Tm, const float *dW,
                                     const float *dU, const float *dKG, const float *dQG, float *dq,
                                     float *dk, float *dv, float *dbeta, float *dG, float *dTm,
                                     unsigned acc) {
    DG_TRY(check_dims("kda_wy_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    switch (d->BT) {
    case 16:
        return wy_bwd_bt<16>(ctx, d, q, k, v, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dbeta, dG,
                             dTm, acc);
    case 32:
        return wy_bwd_bt<32>(ctx, d, q, k, v, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dbeta, dG,
                             dTm, acc);
    default:
        return wy_bwd_bt<64>(ctx, d, q, k, v, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dbeta, dG,
                             dTm, acc);
    }
}
