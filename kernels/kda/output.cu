/*
 * kernels/kda/output.cu -- N7, the output (kda.md §11.4(e) forward; §11.6 B1 backward); CPU twins:
 * dg__kda_output_fwd_f32 / dg__kda_output_bwd_f32 in ops/kda/output.c.
 *   forward:   O_c = s QG_c h_c + Aqk_c E_c   (Aqk read for j <= i only)
 *   backward:  dQG = s dO h^T,  dh_c = s QG^T dO,  dAqk = tril(dO E^T) (j <= i),  dE = Aqk^T dO
 * Layouts: QG [TT,HV,K]; E, O, dO [TT,HV,V]; Aqk [TT,HV,BT]; h [NC,HV,K,V]. Chunk-parallel in
 * both directions; every backward kernel writes every element of its outputs (rows < L of the
 * token arrays, all of dh_c).
 *
 * Variants (the tc mode of kda_cuda_dims, kda_cuda.h):
 *   f32 FFMA: kda_output_fwd_kernel (block per (chunk, hv, 32 value columns));
 *     backward out_dh_kernel, out_dA_kernel, out_dE_kernel, and state.cu's rows_stateT product
 *     for dQG (dg__kda_rows_stateT).
 *   tc == 1 and K, V % 4 == 0 (bf16 operands: % 8) with 16-byte aligned arrays: mma.sync (TF32,
 *     or bf16 m16n8k16 where both operands are bf16) with cp.async stages (mma.cuh's gemm_acc):
 *     output_fwd_mma_kernel; backward out_dhq_mma_kernel for dh and dQG together, and
 *     out_dade_mma_kernel for dAqk and dE together (each one pass over the value tiles, a dO
 *     tile staged once for both products).
 *   Everything else (tc == 0; tc == 2, the 3xTF32 mode, which this stage serves in f32; sizes or
 *     alignments the mma kernels do not take) runs the FFMA kernels on f32 operands; bf16
 *     intermediates there are refused (kda_mid_refused).
 * Entry points (kda_cuda.h): dg__kda_output_fwd_cuda, dg__kda_output_bwd_cuda.
 */
#include "common.cuh"
#include "mma.cuh"

using namespace kdab;

// ---- forward kernels

/* One block of 256 threads per (chunk, value head, 32-column tile of V): blockIdx = (chunk, hv,
 * vtile). Warp w owns rows w*BT/8.., lane l column l. Inter part: QG [BT][32] and h [32][32]
 * tiles over the key dim; intra part: Aqk (masked to j <= i < L) times E, both staged whole. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_output_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                          const int32_t *__restrict__ chunk_len, int HV, int K, int V, float scale,
                          const float *__restrict__ QG, const float *__restrict__ h,
                          const float *__restrict__ Aqk, const float *__restrict__ E,
                          float *__restrict__ O) {
    constexpr int VT = KDA_VT, KT = KDA_KT, RW = BT / 8;
    __shared__ __align__(16) float Qs[BT * KT];
    __shared__ float Hs[KT * VT];
    __shared__ __align__(16) float As[BT * BT];
    __shared__ float Es[BT * VT];

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * VT;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;

    for (int idx = tid; idx < BT * BT; idx += KDA_THREADS) {
        const int i = idx / BT, j = idx % BT;
        As[idx] = (i < L && j <= i) ? Aqk[((t0 + i) * HV + hv) * BT + j] : 0.f;
    }
    for (int idx = tid; idx < BT * VT; idx += KDA_THREADS) {
        const int i = idx / VT, e = idx % VT;
        Es[idx] = (i < L && v0 + e < V) ? E[((t0 + i) * HV + hv) * V + v0 + e] : 0.f;
    }

    float acc[RW];
#pragma unroll
    for (int a = 0; a < RW; a++)
        acc[a] = 0.f;
    const float *hc = h + (ch * HV + hv) * (int64_t)K * V;
    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        for (int idx = tid; idx < BT * KT; idx += KDA_THREADS) {
            const int i = idx / KT, e = idx % KT;
            Qs[idx] = (i < L && kt0 + e < K) ? QG[((t0 + i) * HV + hv) * K + kt0 + e] : 0.f;
        }
        for (int idx = tid; idx < KT * VT; idx += KDA_THREADS) {
            const int kk = idx / VT, e = idx % VT;
            Hs[idx] = (kt0 + kk < K && v0 + e < V) ? hc[(int64_t)(kt0 + kk) * V + v0 + e] : 0.f;
        }
        __syncthreads(); /* the first pass also publishes As and Es */
#pragma unroll
        for (int kk = 0; kk < KT; kk += 4) {
            const float x0 = Hs[(kk + 0) * VT + lane], x1 = Hs[(kk + 1) * VT + lane];
            const float x2 = Hs[(kk + 2) * VT + lane], x3 = Hs[(kk + 3) * VT + lane];
#pragma unroll
            for (int a = 0; a < RW; a++) {
                const float4 qv = *reinterpret_cast<const float4 *>(Qs + (w * RW + a) * KT + kk);
                acc[a] += qv.x * x0;
                acc[a] += qv.y * x1;
                acc[a] += qv.z * x2;
                acc[a] += qv.w * x3;
            }
        }
        __syncthreads();
    }

    float acc2[RW];
#pragma unroll
    for (int a = 0; a < RW; a++)
        acc2[a] = 0.f;
    const int jend = ((w + 1) * RW + 3) & ~3; /* As is zero for j > i: stop past the last row */
    for (int j = 0; j < jend; j += 4) {
        const float e0 = Es[(j + 0) * VT + lane], e1 = Es[(j + 1) * VT + lane];
        const float e2 = Es[(j + 2) * VT + lane], e3 = Es[(j + 3) * VT + lane];
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const float4 av = *reinterpret_cast<const float4 *>(As + (w * RW + a) * BT + j);
            acc2[a] += av.x * e0;
            acc2[a] += av.y * e1;
            acc2[a] += av.z * e2;
            acc2[a] += av.w * e3;
        }
    }
    if (v0 + lane < V)
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const int i = w * RW + a;
            if (i < L)
                O[((t0 + i) * HV + hv) * V + v0 + lane] = scale * acc[a] + acc2[a];
        }
}

/* The forward on mma.sync with cp.async stages (mma.cuh), TF32 only: grid (chunk x V / 64,
 * hv) (chunk_tile), O = s QG h_c + Aqk E for the block's 64 value columns (both products
 * accumulate into one register tile; Aqk is read for j <= i only, E rows past L are
 * zero-filled). QG, h, E of M
 * (f32 or bf16, kda_cuda_dims.mid). Needs K, V % 4 == 0 (bf16: % 8) and 16-byte aligned arrays
 * (checked by the launcher). Four blocks per SM (64 registers; ncu, H100, (1,8192,96,128): 639 ->
 * 599 us against three at 71 registers). */
template <int BT, class M, class TO>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 4)
    output_fwd_mma_kernel(const int64_t *__restrict__ chunk_t0,
                          const int32_t *__restrict__ chunk_len, int HV, int K, int V, float scale,
                          const M *__restrict__ QG, const M *__restrict__ h,
                          const float *__restrict__ Aqk, const M *__restrict__ E,
                          TO *__restrict__ O) {
    constexpr int NTW = kdamma::AbTile<BT>::NTW;
    constexpr int SM1 = kdamma::gemm_smem<BT, true, false, M, M>(),
                  SM2 = kdamma::gemm_smem<BT, true, false, float, M>();
    __shared__ __align__(16) float sm[SM1 > SM2 ? SM1 : SM2];
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(V, kdamma::AB_N)); /* the tiles share QG, Aqk */
    const int64_t ch = ct.c;
    const int hv = blockIdx.y, v0 = ct.z * kdamma::AB_N;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch], nv = min(kdamma::AB_N, V - v0);
    const int64_t rv = (int64_t)HV * V;
    float acc[NTW][4] = {};
    kdamma::gemm_acc<BT, true, false>(acc, QG + (t0 * HV + hv) * K, (int64_t)HV * K, L,
                                      h + (ch * HV + hv) * (int64_t)K * V + v0, V, K, nv, K, sm);
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] *= scale;
    kdamma::gemm_acc<BT, true, false, 1>(acc, Aqk + (t0 * HV + hv) * BT, (int64_t)HV * BT, L,
                                         E + t0 * rv + (int64_t)hv * V + v0, rv, L, nv, BT, sm);
    if constexpr (sizeof(TO) == 2) { /* a bf16 O: 16-byte stores where V allows (uniform) */
        static_assert(sizeof(sm) >= BT * (kdamma::AB_N + 8) * sizeof(TO), "staging fits in sm");
        if (V % 8 == 0) {
            kdamma::store_acc_rows<BT>(acc, O + t0 * rv + (int64_t)hv * V + v0, rv, L, nv, 1.f,
                                       reinterpret_cast<TO *>(sm));
            return;
        }
    }
    kdamma::store_acc<BT, false, TO>(acc, O + t0 * rv + (int64_t)hv * V + v0, rv, L, nv, 1.f);
}

// ---- backward kernels

/* grid (NC, HV, nkt * nvt): dh_c[e][v] = s sum_{i<L} QG[i][e] dO[i][v]; lane = v, warp rows e. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    out_dh_kernel(Dims d, float scale, const float *QG, const float *dO, float *dh) {
    __shared__ float sQ[BT][CT], sO[BT][CT];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y;
    const int HV = d.HV, K = d.K, V = d.V;
    const int nvt = DG_CEIL_DIV(V, CT);
    const int e0 = (blockIdx.z / nvt) * CT, v0 = (blockIdx.z % nvt) * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int row = idx / CT, col = idx % CT;
        sQ[row][col] = (row < L && e0 + col < K) ? QG[((t0 + row) * HV + hv) * K + e0 + col] : 0.f;
        sO[row][col] = (row < L && v0 + col < V) ? dO[((t0 + row) * HV + hv) * V + v0 + col] : 0.f;
    }
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v = v0 + lane;
#pragma unroll
    for (int r = 0; r < CT / NW; r++) {
        const int ee = w + NW * r, e = e0 + ee;
        float s = 0.f;
        for (int i = 0; i < L; i++)
            s += sQ[i][ee] * sO[i][lane];
        if (e < K && v < V)
            dh[((c * HV + hv) * K + e) * V + v] = scale * s;
    }
}

/* grid (NC, HV, nvt): dE[j][v] = sum_{i=j}^{L-1} Aqk[i][j] dO[i][v]; lane = v, warp rows j. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    out_dE_kernel(Dims d, const float *Aqk, const float *dO, float *dE) {
    __shared__ float sM[BT][BT], sO[BT][CT];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * CT;
    const int HV = d.HV, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        sM[row][col] = (row < L && col <= row) ? Aqk[((t0 + row) * HV + hv) * BT + col] : 0.f;
    }
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int row = idx / CT, col = idx % CT;
        sO[row][col] = (row < L && v0 + col < V) ? dO[((t0 + row) * HV + hv) * V + v0 + col] : 0.f;
    }
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v = v0 + lane;
    for (int j = w; j < L; j += NW) {
        float s = 0.f;
        for (int i = j; i < L; i++)
            s += sM[i][j] * sO[i][lane];
        if (v < V)
            dE[((t0 + j) * HV + hv) * V + v] = s;
    }
}

/* grid (NC, HV), 16 x 16 threads: dAqk[i][j] = dO_i . E_j for j <= i, 0 for j > i (rows < L). */
template <int BT>
__global__ void __launch_bounds__(NTH)
    out_dA_kernel(Dims d, const float *dO, const float *E, float *dAqk) {
    constexpr int RB = BT / 16;
    __shared__ float sA[BT][CT + 1], sB[BT][CT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y;
    const int HV = d.HV, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[RB][RB];
#pragma unroll
    for (int a = 0; a < RB; a++)
#pragma unroll
        for (int b = 0; b < RB; b++)
            acc[a][b] = 0.f;
    for (int v0 = 0; v0 < V; v0 += CT) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
            const int row = idx / CT, cc = idx % CT;
            const bool ok = row < L && v0 + cc < V;
            const int64_t iv = ((t0 + row) * HV + hv) * V + v0 + cc;
            sA[row][cc] = ok ? dO[iv] : 0.f;
            sB[row][cc] = ok ? E[iv] : 0.f;
        }
        __syncthreads();
        kda_tile_abt<BT>(acc, sA, sB, tx, ty);
    }
    kda_store_lower<BT>(acc, dAqk, t0, L, hv, HV, tx, ty);
}

/* dAqk = tril(dO E^T) and dE = Aqk^T dO together on mma.sync, grid (chunk, hv): the block walks
 * the chunk's 64-column value tiles; each dO tile (and E tile) is staged once and serves both
 * products: dAqk accumulates dO_v E_v^T in registers over the tiles (both operands k-contiguous:
 * dO rows i, E rows j), and the tile's dE_v = Aqk^T dO_v (Aqk staged once, read for j <= i; dO_v
 * as the n-contiguous operand) is stored before the next tile. The products, their k order and
 * roundings are those of the two kernels (a product each, over 32-wide cp.async stages) this one
 * replaced (the same bits). Either output may be NULL. Dynamic shared memory: Aqk [BT][BT + 8] f32,
 * dO [BT][72] of TD, E [max(BT, 64)][72] of M (rows BT.. zero: the dAqk product's n runs to 64).
 * Needs V % 4 == 0 (bf16 operands: % 8) and 16-byte aligned arrays (output_bwd_mma). */
template <int BT, class M, class TD>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 4)
    out_dade_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                        int HV, int V, const float *__restrict__ Aqk, const TD *__restrict__ dO,
                        const M *__restrict__ E, float *__restrict__ dAqk, float *__restrict__ dE) {
    using namespace kdamma;
    constexpr int LDA = BT + 8, LDV = AB_N + 8, ER = BT > AB_N ? BT : AB_N;
    extern __shared__ __align__(16) float dade_smem[];
    float *const As = dade_smem;
    TD *const Os = reinterpret_cast<TD *>(As + BT * LDA);
    M *const Es = reinterpret_cast<M *>(Os + BT * LDV);
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = chunk_t0[ch], ro = (t0 * HV + hv) * V, rs = (int64_t)HV * V;
    const int L = chunk_len[ch];
    for (int idx = BT * LDV + threadIdx.x; idx < ER * LDV; idx += AB_THREADS)
        kda_st(Es + idx, 0.f);
    if (dE) /* rows i >= L zero; junk above the diagonal is masked as it is read (TRI = 2) */
        tile_async<BT, BT, LDA, AB_THREADS>(As, Aqk + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0,
                                            BT);
    float da[AbTile<BT>::NTW][4] = {};
    for (int v0 = 0; v0 < V; v0 += AB_N) {
        __syncthreads(); /* the previous tile's dO and E have been read */
        tile_async<BT, AB_N, LDV, AB_THREADS>(Os, dO + ro, rs, L, v0, V);
        if (dAqk)
            tile_async<BT, AB_N, LDV, AB_THREADS>(Es, E + ro, rs, L, v0, V);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (dAqk)
            mma_stage<BT, true, true, 0, AB_N>(da, Os, LDV, Es, LDV, 0);
        if (dE) {
            float de[AbTile<BT>::NTW][4] = {};
            mma_stage<BT, false, false, 2, BT>(de, As, LDA, Os, LDV, 0);
            store_acc<BT>(de, dE + ro + v0, rs, L, min(AB_N, V - v0), 1.f);
        }
    }
    if (dAqk)
        store_acc<BT, true>(da, dAqk + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, BT, 1.f);
}

/* dh_c = s QG^T dO and dQG = s dO h_c^T together on mma.sync, grid (chunk x K / 64, hv)
 * (chunk_tile): the block takes the 64 keys e0.. and walks the chunk's 64-column value tiles;
 * each dO tile is staged once (with the h_c tile of those keys and values) and serves both
 * products: the tile of dh_c (QG_e^T dO_v: QG staged once, read transposed) is stored before the
 * next tile, and dQG accumulates dO_v h_{e,v}^T in registers over the tiles. The products, their
 * k order and roundings are those of the two kernels this one replaced (a 64 x 64 dh tile per
 * block, and the rows_stateT product: the same bits). QG^T dO_v reads QG transposed (m-contiguous)
 * and dO_v as the n-contiguous operand, k = the chunk's tokens (rows past L zero-filled). Either
 * output may be NULL. Dynamic shared memory: QG [BT][72] and h [64][72] of M, dO [BT][72] of TD
 * (h's tile stages the bf16 dh tile on its way out). Needs K, V % 4 == 0 (bf16 operands: % 8) and
 * 16-byte aligned arrays (output_bwd_mma). */
template <int BT, class M, class TD>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 4)
    out_dhq_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                       int HV, int K, int V, float scale, const M *__restrict__ QG,
                       const M *__restrict__ h, const TD *__restrict__ dO, M *__restrict__ dh,
                       float *__restrict__ dQG) {
    using namespace kdamma;
    constexpr int LDV = AB_N + 8;
    extern __shared__ __align__(16) float dhq_smem[];
    M *const Qs = reinterpret_cast<M *>(dhq_smem);
    M *const Hs = Qs + BT * LDV;
    TD *const Os = reinterpret_cast<TD *>(Hs + AB_N * LDV);
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(K, AB_N)); /* the tiles share dO */
    const int64_t ch = ct.c;
    const int hv = blockIdx.y, e0 = ct.z * AB_N;
    const int64_t t0 = chunk_t0[ch], ro = (t0 * HV + hv) * V, rs = (int64_t)HV * V;
    const int L = chunk_len[ch], ne = min(AB_N, K - e0);
    const M *const hb = h + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V;
    if (dh) /* rows i >= L and keys past K zero */
        tile_async<BT, AB_N, LDV, AB_THREADS>(Qs, QG + (t0 * HV + hv) * K, (int64_t)HV * K, L, e0,
                                              K);
    float dq[AbTile<BT>::NTW][4] = {};
    for (int v0 = 0; v0 < V; v0 += AB_N) {
        const int nv = min(AB_N, V - v0);
        __syncthreads(); /* the previous tile's dO and h (and the dh staging) have been read */
        tile_async<BT, AB_N, LDV, AB_THREADS>(Os, dO + ro, rs, L, v0, V);
        if (dQG)
            tile_async<AB_N, AB_N, LDV, AB_THREADS>(Hs, hb, V, ne, v0, V);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (dQG) /* m = tokens, n = keys, k = values */
            mma_stage<BT, true, true, 0, AB_N>(dq, Os, LDV, Hs, LDV, 0);
        if (dh) { /* m = keys, n = values, k = tokens */
            float a[AbTile<64>::NTW][4] = {};
            mma_stage<64, false, false, 0, BT>(a, Qs, LDV, Os, LDV, 0);
            M *const dst = dh + (ch * HV + hv) * (int64_t)K * V + (int64_t)e0 * V + v0;
            if constexpr (sizeof(M) == 2) { /* (the mid path has V % 16 == 0) */
                __syncthreads();            /* Hs is free: the staging of the dh tile */
                store_acc_rows<64>(a, dst, V, ne, nv, scale, Hs);
            } else {
                store_acc<64>(a, dst, V, ne, nv, scale);
            }
        }
    }
    if (dQG)
        store_acc<BT>(dq, dQG + (t0 * HV + hv) * K + e0, (int64_t)HV * K, L, ne, scale);
}

// ---- launchers

/* Whether the forward runs on output_fwd_mma_kernel (tc == 1, K, V % 4 == 0 or % 8 with bf16
 * intermediates, aligned arrays). */
static bool output_fwd_mma(const kda_cuda_dims *d, const void *QG, const void *h, const void *Aqk,
                           const void *E, const void *O) {
    const int q = d->mid ? 8 : 4;
    return d->tc == 1 && d->K % q == 0 && d->V % q == 0 && aligned16(QG) && aligned16(h) &&
           aligned16(Aqk) && aligned16(E) && aligned16(O);
}

/* The forward on output_fwd_mma_kernel (output_fwd_mma holds), O of TO. */
template <class TO>
static dg_status output_fwd_launch_mma(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                       const void *QG, const void *h, const float *Aqk,
                                       const void *E, TO *O) {
    if (d->NC == 0)
        return DG_OK;
    const unsigned nvt = (unsigned)DG_CEIL_DIV(d->V, kdamma::AB_N);
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_MID(d->mid, {
                        output_fwd_mma_kernel<BT_, M_, TO>
                            <<<dim3((unsigned)d->NC * nvt, (unsigned)d->HV), kdamma::AB_THREADS, 0,
                               dg__stream(ctx)>>>(d->chunk_t0, d->chunk_len, d->HV, d->K, d->V,
                                                  scale, (const M_ *)QG, (const M_ *)h, Aqk,
                                                  (const M_ *)E, O);
                        DG_CHECK_LAUNCH();
                    }));
    return DG_OK;
}

extern "C" dg_status dg__kda_output_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                             const void *QG, const void *h, const float *Aqk,
                                             const void *E, void *Ov) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!QG || !h || !Aqk || !E || !Ov)
        return dg__err(DG_ERR_ARG, "%s: QG, h, Aqk, E and O are required", __func__);
    if (d->leaf_bf16) { /* a bf16 O is written by the mma kernel, else through an f32 copy */
        if (output_fwd_mma(d, QG, h, Aqk, E, Ov))
            return output_fwd_launch_mma(ctx, d, scale, QG, h, Aqk, E, (kda_bf16 *)Ov);
        const int64_t n = d->TT * d->HV * d->V;
        Scratch o32(ctx);
        DG_TRY(o32.alloc((size_t)n));
        kda_cuda_dims df = *d;
        df.leaf_bf16 = 0;
        DG_TRY(dg__kda_output_fwd_cuda(ctx, &df, scale, QG, h, Aqk, E, o32.f()));
        return kda_narrow(ctx, o32.f(), n, (kda_bf16 *)Ov);
    }
    float *O = (float *)Ov;
    if (output_fwd_mma(d, QG, h, Aqk, E, O))
        return output_fwd_launch_mma(ctx, d, scale, QG, h, Aqk, E, O);
    if (d->mid) /* bf16 intermediates have only the mma kernel */
        return kda_mid_refused(__func__, d);
    /* f32 FFMA: tc == 0, and the sizes, alignments or the 3xTF32 mode the mma kernel does not
     * take (f32 products: at least as accurate as either tensor-core mode) */
    dim3 grid((unsigned)d->NC, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, KDA_VT));
    KDA_DISPATCH_BT(d->BT, {
        kda_output_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, (const float *)QG,
            (const float *)h, Aqk, (const float *)E, O);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

template <int BT>
static dg_status output_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const float *QG,
                               const float *h, const float *Aqk, const float *E, const float *dO,
                               float *dQG, float *dh, float *dAqk, float *dE) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const int nkt = DG_CEIL_DIV(d.K, CT), nvt = DG_CEIL_DIV(d.V, CT);
    const dim3 g2((unsigned)d.NC, d.HV);
    if (dQG)
        DG_TRY(dg__kda_rows_stateT(ctx, dd, scale, dO, h, dQG));
    if (dh) {
        out_dh_kernel<BT>
            <<<dim3((unsigned)d.NC, d.HV, nkt * nvt), NTH, 0, s>>>(d, scale, QG, dO, dh);
        DG_CHECK_LAUNCH();
    }
    if (dAqk) {
        out_dA_kernel<BT><<<g2, NTH, 0, s>>>(d, dO, E, dAqk);
        DG_CHECK_LAUNCH();
    }
    if (dE) {
        out_dE_kernel<BT><<<dim3((unsigned)d.NC, d.HV, nvt), NTH, 0, s>>>(d, Aqk, dO, dE);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

/* Whether the backward's products run on the mma kernels (tc == 1; K % 4 (bf16 QG: % 8) and V %
 * 4 (bf16 operands: % 8) == 0; 16-byte aligned arrays); m: the size of QG, h, E's elements, td:
 * dO's. Else f32 operands take the FFMA kernels (output_bwd_bt) and bf16 ones are refused. */
static bool output_bwd_mma(const kda_cuda_dims *d, size_t m, size_t td, const void *QG,
                           const void *h, const float *Aqk, const void *E, const void *dO,
                           const float *dQG, const void *dh, const float *dAqk, const float *dE) {
    const int qk = 16 / (int)m, qv = (m == 2 || td == 2) ? 8 : 4;
    return d->tc == 1 && d->K % qk == 0 && d->V % qv == 0 && aligned16(QG) && aligned16(h) &&
           aligned16(Aqk) && aligned16(E) && aligned16(dO) && aligned16(dQG) && aligned16(dh) &&
           aligned16(dAqk) && aligned16(dE);
}

/* The backward on the mma kernels (output_bwd_mma holds; dO != NULL, NC > 0). */
template <class M, class TD>
static dg_status output_bwd_launch_mma(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                       const M *QG, const M *h, const float *Aqk, const M *E,
                                       const TD *dO, float *dQG, M *dh, float *dAqk, float *dE) {
    cudaStream_t s = dg__stream(ctx);
    const unsigned nc = (unsigned)d->NC, hvs = (unsigned)d->HV;
    const unsigned nkt = (unsigned)DG_CEIL_DIV(d->K, kdamma::AB_N);
    KDA_DISPATCH_BT(d->BT, {
        if (dh || dQG) {
            constexpr int LDV = kdamma::AB_N + 8;
            const size_t smem =
                sizeof(M) * (BT_ + kdamma::AB_N) * LDV + sizeof(TD) * (size_t)BT_ * LDV;
            DG_TRY(smem_opt_in(out_dhq_mma_kernel<BT_, M, TD>, smem));
            out_dhq_mma_kernel<BT_, M, TD><<<dim3(nc * nkt, hvs), kdamma::AB_THREADS, smem, s>>>(
                d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, h, dO, dh, dQG);
            DG_CHECK_LAUNCH();
        }
        if (dAqk || dE) {
            constexpr int ER = BT_ > kdamma::AB_N ? BT_ : kdamma::AB_N, LDV = kdamma::AB_N + 8;
            const size_t smem =
                sizeof(float) * BT_ * (BT_ + 8) + sizeof(TD) * BT_ * LDV + sizeof(M) * ER * LDV;
            DG_TRY(smem_opt_in(out_dade_mma_kernel<BT_, M, TD>, smem));
            out_dade_mma_kernel<BT_, M, TD><<<dim3(nc, hvs), kdamma::AB_THREADS, smem, s>>>(
                d->chunk_t0, d->chunk_len, d->HV, d->V, Aqk, dO, E, dAqk, dE);
            DG_CHECK_LAUNCH();
        }
    });
    return DG_OK;
}

int kda_output_bwd_bf16do_fits(const kda_cuda_dims *d, const float *QG, const float *h,
                               const float *Aqk, const void *E, const kda_bf16 *dO,
                               const float *dQG, const float *dh, const float *dAqk,
                               const float *dE) {
    const void *ps[] = {QG, h, Aqk, E, dO, dQG, dh, dAqk, dE};
    for (const void *p : ps)
        if (!aligned16(p))
            return 0;
    return d->K % 8 == 0 && d->V % 8 == 0;
}

dg_status kda_output_bwd_bf16do(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                                const float *h, const float *Aqk, const void *E, int e_bf16,
                                const kda_bf16 *dO, float *dQG, float *dh, float *dAqk, float *dE) {
    if (!dO || ((dQG || dh) && (!QG || !h)) || ((dAqk || dE) && (!Aqk || !E)) ||
        !kda_output_bwd_bf16do_fits(d, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE))
        return dg__err(DG_ERR_ARG,
                       "%s: missing operands, or sizes / alignment not supported (K=%d V=%d)",
                       __func__, d->K, d->V);
    if (d->NC == 0)
        return DG_OK;
    if (dQG || dh)
        DG_TRY((output_bwd_launch_mma<float, kda_bf16>(ctx, d, scale, QG, h, nullptr, nullptr, dO,
                                                       dQG, dh, nullptr, nullptr)));
    if (!dAqk && !dE)
        return DG_OK;
    if (e_bf16)
        return output_bwd_launch_mma<kda_bf16, kda_bf16>(ctx, d, scale, nullptr, nullptr, Aqk,
                                                         (const kda_bf16 *)E, dO, nullptr, nullptr,
                                                         dAqk, dE);
    return output_bwd_launch_mma<float, kda_bf16>(ctx, d, scale, nullptr, nullptr, Aqk,
                                                  (const float *)E, dO, nullptr, nullptr, dAqk, dE);
}

extern "C" dg_status dg__kda_output_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                             const void *QGv, const void *hv, const float *Aqk,
                                             const void *Ev, const void *dOv, float *dQG, void *dh,
                                             float *dAqk, float *dE) {
    DG_TRY(check_dims("dg__kda_output_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    /* a bf16 dO is read as stored by the mma kernels (bf16 intermediates), else through an f32
     * copy */
    const float *dO = (const float *)dOv;
    Scratch dO32(ctx);
    if (dOv && d->leaf_bf16) {
        if (d->mid && output_bwd_mma(d, 2, 2, QGv, hv, Aqk, Ev, dOv, dQG, dh, dAqk, dE))
            return output_bwd_launch_mma(ctx, d, scale, (const kda_bf16 *)QGv, (const kda_bf16 *)hv,
                                         Aqk, (const kda_bf16 *)Ev, (const kda_bf16 *)dOv, dQG,
                                         (kda_bf16 *)dh, dAqk, dE);
        DG_TRY(kda_widen(ctx, (const kda_bf16 *)dOv, d->TT * d->HV * d->V, dO32, &dO));
    }
    if (!dO) { /* no upstream gradient: every output is zero */
        cudaStream_t s = dg__stream(ctx);
        const size_t tk = (size_t)d->TT * d->HV;
        if (dQG)
            DG_CHECK_CUDA(cudaMemsetAsync(dQG, 0, sizeof(float) * tk * d->K, s));
        if (dh) /* stored like h */
            DG_CHECK_CUDA(cudaMemsetAsync(dh, 0,
                                          (d->mid ? sizeof(kda_bf16) : sizeof(float)) *
                                              (size_t)d->NC * d->HV * d->K * d->V,
                                          s));
        if (dAqk)
            DG_CHECK_CUDA(cudaMemsetAsync(dAqk, 0, sizeof(float) * tk * d->BT, s));
        if (dE)
            DG_CHECK_CUDA(cudaMemsetAsync(dE, 0, sizeof(float) * tk * d->V, s));
        return DG_OK;
    }
    if (d->mid) /* bf16 intermediates have only the mma kernels */
        return output_bwd_mma(d, 2, 4, QGv, hv, Aqk, Ev, dO, dQG, dh, dAqk, dE)
                   ? output_bwd_launch_mma(ctx, d, scale, (const kda_bf16 *)QGv,
                                           (const kda_bf16 *)hv, Aqk, (const kda_bf16 *)Ev, dO, dQG,
                                           (kda_bf16 *)dh, dAqk, dE)
                   : kda_mid_refused(__func__, d);
    const float *QG = (const float *)QGv, *h = (const float *)hv, *E = (const float *)Ev;
    float *dh32 = (float *)dh;
    if (output_bwd_mma(d, 4, 4, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE))
        return output_bwd_launch_mma(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh32, dAqk, dE);
    /* f32 FFMA: tc == 0, and what the mma kernels do not take (as in the forward) */
    switch (d->BT) {
    case 16:
        return output_bwd_bt<16>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh32, dAqk, dE);
    case 32:
        return output_bwd_bt<32>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh32, dAqk, dE);
    default:
        return output_bwd_bt<64>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh32, dAqk, dE);
    }
}
