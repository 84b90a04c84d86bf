/*
 * kernels/kda/kda_tc_bwd.cu -- tensor-core (WMMA TF32) variant of the N7 output backward (spec
 * §6.1, §10 N7), run instead of the FFMA kernels of kda_bwd_state.cu when kda_cuda_dims.tc != 0:
 *   dQG = s dO h^T,   dh_c = s QG^T dO,   dAqk = tril(dO E^T) (j <= i),   dE = Aqk^T dO
 * (Aqk read for j <= i only). One kernel per product, chunk-parallel, each writing every element
 * the FFMA kernels write (rows < L of the token arrays, all of dh_c). Fragments m16n16k8 TF32
 * (P = 1) or 3xTF32 (P = 2) with f32 accumulators; transposed operands are row-major shared
 * tiles read as col_major (kda_tc.cuh). Static shared memory: at most 2 x 64 x 72 floats (36 KB).
 */
#include "kda_bwd.cuh"
#include "kda_fwd_util.cuh"
#include "kda_mma.cuh"
#include "kda_tc.cuh"

using namespace kdatc;

// ---- CUDA kernels

#define TC_CT 64               /* column tile: key or value columns per step / per block */
#define TC_LD (TC_CT + TC_PAD) /* leading dim of a [*][64] tile */

/* Warp w's output tiles of an (R16*16) x (C16*16) result: tile = w + 8r, (ti, tj) row-major. */
#define TC_TILE(r, ti, tj, C16)                                                                    \
    const int tile_ = w + 8 * (r), ti = tile_ / (C16), tj = tile_ % (C16)

/* grid (chunk, hv, K / 64): dQG[i][e0 + e] = s sum_v dO[i][v] h_c[e0 + e][v], over value tiles
 * of 64 (dO tile [BT][64], h tile [64 keys][64 values] read as the col_major B = h^T). */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    out_dqg_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int HV, int K, int V, float scale, const float *__restrict__ dO,
                      const float *__restrict__ h, float *__restrict__ dQG) {
    constexpr int LD = TC_LD, C16 = TC_CT / 16, NTILE = (BT / 16) * C16, TPW = (NTILE + 7) / 8;
    __shared__ __align__(128) float sm[BT * LD + TC_CT * LD];
    float *Os = sm, *Hs = sm + BT * LD;
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, e0 = blockIdx.z * TC_CT;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5;
    const int ne = min(TC_CT, K - e0);
    const float *hc = h + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V;

    Acc acc[TPW];
#pragma unroll
    for (int r = 0; r < TPW; r++)
        wmma::fill_fragment(acc[r], 0.f);
    for (int v0 = 0; v0 < V; v0 += TC_CT) {
        const int nv = min(TC_CT, V - v0);
        __syncthreads();
        load_tile<BT, TC_CT, LD>(Os, dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv);
        load_tile<TC_CT, TC_CT, LD>(Hs, hc + v0, V, ne, nv);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < TPW; r++) {
            TC_TILE(r, ti, tj, C16);
            if (tile_ < NTILE)
                mma_k<P, false, RM, CM>(acc[r], Os + ti * 16 * LD, LD, Hs + tj * 16 * LD, LD,
                                        (nv + 7) / 8);
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, C16);
        if (tile_ < NTILE) {
#pragma unroll
            for (int t = 0; t < acc[r].num_elements; t++)
                acc[r].x[t] *= scale;
            wmma::store_matrix_sync(sm + ti * 16 * LD + tj * 16, acc[r], LD, wmma::mem_row_major);
        }
    }
    __syncthreads();
    store_tile<BT, TC_CT, LD>(dQG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, sm, L, ne);
}

/* The same product on mma.sync with a cp.async pipeline (kda_mma.cuh): grid (chunk, hv, K / 64),
 * dQG[i][e0 + e] = s sum_v dO[i][v] h_c[e0 + e][v]. TF32 (P = 1) only; needs V % 4 == 0, K even
 * and 16-byte aligned arrays (dqg_launch checks). */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    out_dqg_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                       int HV, int K, int V, float scale, const float *__restrict__ dO,
                       const float *__restrict__ h, float *__restrict__ dQG) {
    __shared__ __align__(16) float sm[kdamma::gemm_smem<BT, true, true>()];
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, e0 = blockIdx.z * kdamma::AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], ne = min(kdamma::AB_N, K - e0);
    float acc[kdamma::AbTile<BT>::NTW][4] = {};
    kdamma::gemm_acc<BT, true, true>(acc, dO + (t0 * HV + hv) * V, (int64_t)HV * V, L,
                               h + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V, V, ne, ne, V,
                               sm);
    kdamma::store_acc<BT>(acc, dQG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, L, ne, scale);
}

/* grid (chunk, hv, (K / 64) * (V / 64)): dh_c[e0 + e][v0 + v] = s sum_{i<L} QG[i][e0 + e]
 * dO[i][v0 + v]; QG tile [BT][64] read as the col_major A = QG^T. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    out_dh_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                     int HV, int K, int V, float scale, const float *__restrict__ QG,
                     const float *__restrict__ dO, float *__restrict__ dh) {
    constexpr int LD = TC_LD, C16 = TC_CT / 16, NTILE = C16 * C16, TPW = (NTILE + 7) / 8;
    constexpr int S = 2 * BT * LD > TC_CT * LD ? 2 * BT * LD : TC_CT * LD;
    __shared__ __align__(128) float sm[S];
    float *Qs = sm, *Os = sm + BT * LD;
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, nvt = DG_CEIL_DIV(V, TC_CT);
    const int e0 = (blockIdx.z / nvt) * TC_CT, v0 = (blockIdx.z % nvt) * TC_CT;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5;
    const int ne = min(TC_CT, K - e0), nv = min(TC_CT, V - v0);

    load_tile<BT, TC_CT, LD>(Qs, QG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, L, ne);
    load_tile<BT, TC_CT, LD>(Os, dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv);
    __syncthreads();
    Acc acc[TPW];
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, C16);
        wmma::fill_fragment(acc[r], 0.f);
        if (tile_ < NTILE)
            mma_k<P, false, CM, RM>(acc[r], Qs + ti * 16, LD, Os + tj * 16, LD, (L + 7) / 8);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, C16);
        if (tile_ < NTILE) {
#pragma unroll
            for (int t = 0; t < acc[r].num_elements; t++)
                acc[r].x[t] *= scale;
            wmma::store_matrix_sync(sm + ti * 16 * LD + tj * 16, acc[r], LD, wmma::mem_row_major);
        }
    }
    __syncthreads();
    store_tile<TC_CT, TC_CT, LD>(dh + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V + v0, V, sm,
                                 ne, nv);
}

/* grid (chunk, hv): dAqk[i][j] = sum_v dO[i][v] E[j][v] for j <= i, 0 above (rows < L, all BT
 * columns), over value tiles of 64; E tile read as the col_major B = E^T. Tiles above the
 * diagonal are skipped. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    out_da_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                     int HV, int V, const float *__restrict__ dO, const float *__restrict__ E,
                     float *__restrict__ dAqk) {
    constexpr int LD = TC_LD, R16 = BT / 16, NTILE = R16 * R16, TPW = (NTILE + 7) / 8;
    constexpr int LDS = BT + TC_PAD;
    static_assert(BT * LDS <= 2 * BT * LD, "the result reuses the operand buffer");
    __shared__ __align__(128) float sm[2 * BT * LD];
    float *Os = sm, *Es = sm + BT * LD;
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5;

    Acc acc[TPW];
#pragma unroll
    for (int r = 0; r < TPW; r++)
        wmma::fill_fragment(acc[r], 0.f);
    for (int v0 = 0; v0 < V; v0 += TC_CT) {
        const int nv = min(TC_CT, V - v0);
        __syncthreads();
        load_tile<BT, TC_CT, LD>(Os, dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv);
        load_tile<BT, TC_CT, LD>(Es, E + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < TPW; r++) {
            TC_TILE(r, ti, tj, R16);
            if (tile_ < NTILE && tj <= ti)
                mma_k<P, false, RM, CM>(acc[r], Os + ti * 16 * LD, LD, Es + tj * 16 * LD, LD,
                                        (nv + 7) / 8);
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, R16);
        if (tile_ < NTILE && tj <= ti)
            wmma::store_matrix_sync(sm + ti * 16 * LDS + tj * 16, acc[r], LDS, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < L * BT; idx += TC_THREADS) {
        const int i = idx / BT, j = idx % BT;
        dAqk[((t0 + i) * HV + hv) * BT + j] = j <= i ? sm[i * LDS + j] : 0.f;
    }
}

/* grid (chunk, hv, V / 64): dE[j][v0 + v] = sum_{i >= j} Aqk[i][j] dO[i][v0 + v] (rows j < L).
 * Aqk staged [BT][BT+8] masked to j <= i < L and read as the col_major A = Aqk^T; row block tj
 * of the result needs the k-steps i >= 16 tj only. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    out_de_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                     int HV, int V, const float *__restrict__ Aqk, const float *__restrict__ dO,
                     float *__restrict__ dE) {
    constexpr int LD = TC_LD, LDA = BT + TC_PAD, C16 = TC_CT / 16, R16 = BT / 16;
    constexpr int NTILE = R16 * C16, TPW = (NTILE + 7) / 8;
    static_assert(BT * LD <= BT * LDA + BT * LD, "the result reuses the operand buffer");
    __shared__ __align__(128) float sm[BT * LDA + BT * LD];
    float *As = sm, *Os = sm + BT * LDA;
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * TC_CT;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5;
    const int nv = min(TC_CT, V - v0);

    for (int idx = threadIdx.x; idx < BT * BT; idx += TC_THREADS) {
        const int i = idx / BT, j = idx % BT;
        As[i * LDA + j] = (i < L && j <= i) ? Aqk[((t0 + i) * HV + hv) * BT + j] : 0.f;
    }
    load_tile<BT, TC_CT, LD>(Os, dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv);
    __syncthreads();
    Acc acc[TPW];
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, C16);
        wmma::fill_fragment(acc[r], 0.f);
        if (tile_ < NTILE)
            mma_k<P, false, CM, RM>(acc[r], As + ti * 16 + ti * 16 * LDA, LDA,
                                    Os + ti * 16 * LD + tj * 16, LD, 2 * (R16 - ti));
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        TC_TILE(r, ti, tj, C16);
        if (tile_ < NTILE)
            wmma::store_matrix_sync(sm + ti * 16 * LD + tj * 16, acc[r], LD, wmma::mem_row_major);
    }
    __syncthreads();
    store_tile<BT, TC_CT, LD>(dE + (t0 * HV + hv) * V + v0, (int64_t)HV * V, sm, L, nv);
}

/* grid (chunk, hv): dG rows of the chunk: row L-1 = exp(lambda_e) sum_v h_c[e][v] dHn_c[e][v]
 * (0 when h is NULL), every other row 0. Warp w: keys e = w, w + 8, ...; lanes over v. */
__global__ void __launch_bounds__(TC_THREADS)
    state_dg_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                       int HV, int K, int V, const float *__restrict__ G,
                       const float *__restrict__ h, const float *__restrict__ dHs,
                       float *__restrict__ dG) {
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int idx = threadIdx.x; idx < (L - 1) * K; idx += TC_THREADS)
        dG[((t0 + idx / K) * HV + hv) * K + idx % K] = 0.f;
    const int64_t sb = (ch * HV + hv) * (int64_t)K * V, rl = ((t0 + L - 1) * HV + hv) * K;
    for (int e = w; e < K; e += 8) {
        float s = 0.f;
        if (h)
            for (int v = lane; v < V; v += 32)
                s += h[sb + (int64_t)e * V + v] * dHs[sb + (int64_t)e * V + v];
        s = kdab::warp_sum(s);
        if (lane == 0)
            dG[rl + e] = h ? expf(G[rl + e]) * s : 0.f;
    }
}

/* dh_c = s QG^T dO and dE = Aqk^T dO on mma.sync (kda_mma.cuh), TF32 only; both read A
 * transposed (m-contiguous) and dO as an n-contiguous B, k = the chunk's tokens (rows past L are
 * zero-filled; Aqk is read for j <= i only). out_dh: grid (chunk, hv, (K / 64) * (V / 64)), a 64 x 64 tile of dh_c, every
 * element written. out_de: grid (chunk, hv, V / 64), rows < L. Need K, V % 4 == 0 and 16-byte
 * aligned arrays (checked by the launcher). */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    out_dh_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int HV, int K, int V, float scale, const float *__restrict__ QG,
                      const float *__restrict__ dO, float *__restrict__ dh) {
    __shared__ __align__(16) float sm[kdamma::gemm_smem<64, false, false>()];
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, nvt = DG_CEIL_DIV(V, kdamma::AB_N);
    const int e0 = (blockIdx.z / nvt) * kdamma::AB_N, v0 = (blockIdx.z % nvt) * kdamma::AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], ne = min(kdamma::AB_N, K - e0), nv = min(kdamma::AB_N, V - v0);
    float acc[kdamma::AbTile<64>::NTW][4] = {};
    kdamma::gemm_acc<64, false, false>(acc, QG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, ne,
                                       dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv, BT,
                                       sm);
    kdamma::store_acc<64>(acc, dh + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V + v0, V,
                          ne, nv, scale);
}

template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    out_de_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int HV, int V, const float *__restrict__ Aqk, const float *__restrict__ dO,
                      float *__restrict__ dE) {
    __shared__ __align__(16) float sm[kdamma::gemm_smem<BT, false, false>()];
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * kdamma::AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], nv = min(kdamma::AB_N, V - v0);
    float acc[kdamma::AbTile<BT>::NTW][4] = {};
    kdamma::gemm_acc<BT, false, false, 2>(acc, Aqk + (t0 * HV + hv) * BT, (int64_t)HV * BT, BT,
                                       dO + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv, BT,
                                       sm);
    kdamma::store_acc<BT>(acc, dE + (t0 * HV + hv) * V + v0, (int64_t)HV * V, L, nv, 1.f);
}

// ---- kernel launchers

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* C = s A h^T chunk by chunk (the out_dqg product; see out_dqg_tc_kernel): on mma.sync when the
 * mode is TF32 and the sizes allow it, else on WMMA (TF32 or 3xTF32). */
static dg_status dqg_launch(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *A,
                            const float *Hm, float *C) {
    cudaStream_t s = dg__stream(ctx);
    const dim3 grid((unsigned)d->NC, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->K, TC_CT));
    const bool mma = d->tc == 1 && d->V % 4 == 0 && d->K % 2 == 0 && aligned16(A) &&
                     aligned16(Hm) && aligned16(C);
    KDA_DISPATCH_BT(d->BT, {
        if (mma)
            out_dqg_mma_kernel<BT_><<<grid, kdamma::AB_THREADS, 0, s>>>(
                d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, A, Hm, C);
        else
            KDA_DISPATCH_P(d->tc, {
                out_dqg_tc_kernel<BT_, P_><<<grid, TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, A, Hm, C);
            });
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

/* Called by kda_state_bwd_cuda when d->tc != 0; the same buffers and NULL rules as its FFMA
 * path (state_bwd_bt). */
dg_status kda_state_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *KG,
                           const float *G, const float *h, const float *E, const float *dh,
                           const float *dE, const float *dht, float *dW, float *dU, float *dKG,
                           float *dG, float *dh0) {
    cudaStream_t s = dg__stream(ctx);
    const bool par = d->NC > 0 && (dW || dKG || dG);
    const bool need_et = dW && !dU; /* dW needs dE_tot even when dU is not wanted */
    const size_t nh = (size_t)d->NC * d->HV * d->K * d->V, ne = (size_t)d->TT * d->HV * d->V;
    kdab::Scratch scr(ctx);
    const size_t n = (par ? nh : 0) + (need_et ? ne : 0);
    if (n)
        DG_TRY(scr.alloc(n));
    float *dHs = par ? scr.f() : nullptr; /* NULL: the serial kernel stores nothing */
    float *dEtot = dU ? dU : need_et ? scr.f() + (par ? nh : 0) : nullptr;
    DG_TRY(kda_state_seq_bwd_tc(ctx, d, W, KG, G, dh, dE, dht, dEtot, dHs, dh0));
    if (!par)
        return DG_OK;
    const size_t tk = sizeof(float) * (size_t)d->TT * d->HV * d->K;
    if (dKG && !E)
        DG_CHECK_CUDA(cudaMemsetAsync(dKG, 0, tk, s));
    if (dW && !h)
        DG_CHECK_CUDA(cudaMemsetAsync(dW, 0, tk, s));
    if (dKG && E)
        DG_TRY(dqg_launch(ctx, d, 1.f, E, dHs, dKG));
    if (dW && h)
        DG_TRY(dqg_launch(ctx, d, -1.f, dEtot, h, dW));
    if (dG) {
        state_dg_tc_kernel<<<dim3((unsigned)d->NC, (unsigned)d->HV), TC_THREADS, 0, s>>>(
            d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, G, h, dHs, dG);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

// ---- kernel launcher (called by kda_output_bwd_cuda when d->tc != 0, dO != NULL, NC > 0)

dg_status kda_output_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                            const float *h, const float *Aqk, const float *E, const float *dO,
                            float *dQG, float *dh, float *dAqk, float *dE) {
    cudaStream_t s = dg__stream(ctx);
    const unsigned nc = (unsigned)d->NC, hvs = (unsigned)d->HV;
    const unsigned nkt = (unsigned)DG_CEIL_DIV(d->K, TC_CT),
                   nvt = (unsigned)DG_CEIL_DIV(d->V, TC_CT);
    const bool p2 = d->tc >= 2;
    const bool mma = d->tc == 1 && d->K % 4 == 0 && d->V % 4 == 0 && aligned16(QG) &&
                     aligned16(Aqk) && aligned16(dO) && (!dh || aligned16(dh)) &&
                     (!dE || aligned16(dE));
    if (dQG)
        DG_TRY(dqg_launch(ctx, d, scale, dO, h, dQG));
    KDA_DISPATCH_BT(d->BT, {
        if (dh) {
            if (mma)
                out_dh_mma_kernel<BT_><<<dim3(nc, hvs, nkt * nvt), kdamma::AB_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, dO, dh);
            else if (p2)
                out_dh_tc_kernel<BT_, 2><<<dim3(nc, hvs, nkt * nvt), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, dO, dh);
            else
                out_dh_tc_kernel<BT_, 1><<<dim3(nc, hvs, nkt * nvt), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, dO, dh);
            DG_CHECK_LAUNCH();
        }
        if (dAqk) {
            if (p2)
                out_da_tc_kernel<BT_, 2><<<dim3(nc, hvs), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->V, dO, E, dAqk);
            else
                out_da_tc_kernel<BT_, 1><<<dim3(nc, hvs), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->V, dO, E, dAqk);
            DG_CHECK_LAUNCH();
        }
        if (dE) {
            if (mma)
                out_de_mma_kernel<BT_><<<dim3(nc, hvs, nvt), kdamma::AB_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->V, Aqk, dO, dE);
            else if (p2)
                out_de_tc_kernel<BT_, 2><<<dim3(nc, hvs, nvt), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->V, Aqk, dO, dE);
            else
                out_de_tc_kernel<BT_, 1><<<dim3(nc, hvs, nvt), TC_THREADS, 0, s>>>(
                    d->chunk_t0, d->chunk_len, d->HV, d->V, Aqk, dO, dE);
            DG_CHECK_LAUNCH();
        }
    });
    return DG_OK;
}
