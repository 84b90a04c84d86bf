/*
 * kernels/kda/kda_bwd_state.cu -- backward of N6 (the inter-chunk state pass, spec §6.2, §10 N6)
 * and of N7 (the output, §6.1, §10 N7); CPU twins: kda_state_bwd_f32, kda_output_bwd_f32.
 *
 * N6, per sequence and value head, chunks c = NT-1 .. 0, dH = dht (grad of the final state):
 *   dHn_c   = dH                                   (grad of h_{c+1}, the state at chunk end)
 *   dE_tot  = dE_c + KG_c dHn_c          -> dU = dE_tot
 *   dH      = exp(lambda_c) dHn_c - W_c^T dE_tot + dh_c      (grad of h_c, the chunk start)
 *   dKG = E dHn^T,  dW = -dE_tot h_c^T,  dG[L-1] = exp(lambda) rowsum(h_c . dHn)  (other rows 0)
 * dh0 = dH after chunk 0.
 * N7, per chunk: dQG = s dO h^T, dh_c = s QG^T dO, dAqk = tril(dO E^T), dE = Aqk^T dO.
 *
 * State pass design: the sequential kernel (state_seq, one block per (sequence, hv, 32-wide value
 * tile)) does only what is local to its value columns: dE_tot (a sum over K, which it holds) and
 * the dH update; it stores every dHn_c into a scratch [NC,HV,K,V]. The three products that sum
 * over V (dKG, dW, the lambda term) run afterwards, chunk-parallel, in rows_stateT, one block per
 * (chunk, hv, 32-wide key tile) holding all of V. So no value tile ever needs another tile's
 * partial sums: no atomics, no cross-tile reduction, and the serial kernel does 4 K V FLOP per
 * token instead of 8. Cost: the scratch of NC x HV x K x V floats (the size of h).
 * state_seq keeps its dH tile [K][32] in shared memory and stages 32-column slices of KG and W:
 * (K x 32 + 2 x BT x 32) floats of dynamic shared memory (32 KB at K = 128, BT = 64; 48 KB at
 * K = 256), thread (lane = value column, warp w) owns the dH rows w, w+8, ...
 */
#include "kda_bwd.cuh"
#include "kda_tc.cuh"

using namespace kdab;

// ---- CUDA kernels

template <int BT>
__global__ void __launch_bounds__(NTH)
    state_seq_kernel(Dims d, const float *W, const float *KG, const float *G, const float *dh,
                     const float *dE, const float *dht, float *dEtot, float *dHs, float *dh0) {
    constexpr int RPT = BT / NW;
    extern __shared__ float sm[];
    float *sdH = sm; /* [K][CT] */
    float(*sE)[CT] = (float(*)[CT])(sm + (size_t)d.K * CT);
    float(*sX)[CT] = sE + BT;
    const int n = blockIdx.x, hv = blockIdx.y;
    const int HV = d.HV, K = d.K, V = d.V;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v = blockIdx.z * CT + lane;
    const bool vok = v < V;
    const int64_t sb = ((int64_t)n * HV + hv) * K * V;
    for (int a = w; a < K; a += NW)
        sdH[a * CT + lane] = (dht && vok) ? dht[sb + (int64_t)a * V + v] : 0.f;
    const int64_t cb = d.chunk_off[n], ce = d.chunk_off[n + 1];
    for (int64_t c = ce - 1; c >= cb; c--) {
        const int64_t t0 = d.chunk_t0[c];
        const int L = d.chunk_len[c];
        const int64_t hb = (c * HV + hv) * K * V;
        if (dHs && vok) /* own rows: written by this thread in the previous update */
            for (int a = w; a < K; a += NW)
                dHs[hb + (int64_t)a * V + v] = sdH[a * CT + lane];
        /* dE_tot[i][v] = dE[i][v] + sum_a KG[i][a] dH[a][v], rows i = w + 8p */
        float acc[RPT];
#pragma unroll
        for (int p = 0; p < RPT; p++) {
            const int i = w + NW * p;
            acc[p] = (dE && i < L && vok) ? dE[((t0 + i) * HV + hv) * V + v] : 0.f;
        }
        for (int a0 = 0; a0 < K; a0 += CT) {
            __syncthreads(); /* sX free; the last dH update is visible */
            for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
                const int row = idx / CT, col = idx % CT, a = a0 + col;
                sX[row][col] = (row < L && a < K) ? KG[((t0 + row) * HV + hv) * K + a] : 0.f;
            }
            __syncthreads();
            const int na = min(CT, K - a0);
            for (int col = 0; col < na; col++) {
                const float hval = sdH[(a0 + col) * CT + lane];
#pragma unroll
                for (int p = 0; p < RPT; p++)
                    acc[p] += sX[w + NW * p][col] * hval;
            }
        }
#pragma unroll
        for (int p = 0; p < RPT; p++) {
            const int i = w + NW * p;
            sE[i][lane] = i < L ? acc[p] : 0.f;
            if (dEtot && i < L && vok)
                dEtot[((t0 + i) * HV + hv) * V + v] = acc[p];
        }
        /* dH[a][v] = exp(lambda_a) dH[a][v] - sum_i W[i][a] dE_tot[i][v] + dh_c[a][v] */
        const float *lam = G + ((t0 + L - 1) * HV + hv) * K;
        for (int a0 = 0; a0 < K; a0 += CT) {
            __syncthreads(); /* sE complete; sX free */
            for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
                const int row = idx / CT, col = idx % CT, a = a0 + col;
                sX[row][col] = (row < L && a < K) ? W[((t0 + row) * HV + hv) * K + a] : 0.f;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < CT / NW; r++) {
                const int aa = w + NW * r, a = a0 + aa; /* a = w mod 8: this thread's rows */
                if (a >= K)
                    continue;
                float s = 0.f;
                for (int i = 0; i < L; i++)
                    s += sX[i][aa] * sE[i][lane];
                const float up = (dh && vok) ? dh[hb + (int64_t)a * V + v] : 0.f;
                sdH[a * CT + lane] = expf(lam[a]) * sdH[a * CT + lane] - s + up;
            }
        }
    }
    if (dh0 && vok)
        for (int a = w; a < K; a += NW)
            dh0[sb + (int64_t)a * V + v] = sdH[a * CT + lane];
}

/* grid (NC, HV, ceil(K/32)): lane = key dim e, warp w = rows w, w+8, ... For rows i < L:
 *   out1[i][e] = a1 sum_v A1[i][v] S1_c[e][v],   out2[i][e] = a2 sum_v A2[i][v] S2_c[e][v],
 *   dG[i][e] = i == L-1 ? exp(lambda_e) sum_v S2_c[e][v] S1_c[e][v] : 0.
 * A*: [TT,HV,V]; S*: [NC,HV,K,V]. A NULL A or S counts as zero. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    rows_stateT_kernel(Dims d, const float *A1, const float *S1, float a1, float *out1,
                       const float *A2, const float *S2, float a2, float *out2, const float *G,
                       float *dG) {
    constexpr int RPT = BT / NW;
    __shared__ float sA1[BT][CT], sA2[BT][CT];
    __shared__ float sS1[CT][CT + 1], sS2[CT][CT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, e0 = blockIdx.z * CT;
    const int HV = d.HV, K = d.K, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    const int64_t sb = (c * HV + hv) * K * V;
    float acc1[RPT], acc2[RPT], accl = 0.f;
#pragma unroll
    for (int p = 0; p < RPT; p++)
        acc1[p] = acc2[p] = 0.f;
    for (int v0 = 0; v0 < V; v0 += CT) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
            const int row = idx / CT, col = idx % CT;
            const bool ok = row < L && v0 + col < V;
            const int64_t ia = ((t0 + row) * HV + hv) * V + v0 + col;
            sA1[row][col] = (A1 && ok) ? A1[ia] : 0.f;
            sA2[row][col] = (A2 && ok) ? A2[ia] : 0.f;
        }
        for (int idx = threadIdx.x; idx < CT * CT; idx += NTH) {
            const int r = idx / CT, col = idx % CT;
            const bool ok = e0 + r < K && v0 + col < V;
            const int64_t is = sb + (int64_t)(e0 + r) * V + v0 + col;
            sS1[r][col] = (S1 && ok) ? S1[is] : 0.f;
            sS2[r][col] = (S2 && ok) ? S2[is] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int cc = 0; cc < CT; cc++) {
            const float s1 = sS1[lane][cc], s2 = sS2[lane][cc];
#pragma unroll
            for (int p = 0; p < RPT; p++) {
                acc1[p] += sA1[w + NW * p][cc] * s1;
                acc2[p] += sA2[w + NW * p][cc] * s2;
            }
            accl += s2 * s1;
        }
    }
    if (e >= K)
        return;
    const float lt = dG ? expf(G[((t0 + L - 1) * HV + hv) * K + e]) * accl : 0.f;
#pragma unroll
    for (int p = 0; p < RPT; p++) {
        const int i = w + NW * p;
        if (i >= L)
            continue;
        const int64_t idx = ((t0 + i) * HV + hv) * K + e;
        if (out1)
            out1[idx] = a1 * acc1[p];
        if (out2)
            out2[idx] = a2 * acc2[p];
        if (dG)
            dG[idx] = i == L - 1 ? lt : 0.f;
    }
}

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

// ---- kernel launchers

template <int BT>
static dg_status state_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, const float *W, const float *KG,
                              const float *G, const float *h, const float *E, const float *dh,
                              const float *dE, const float *dht, float *dW, float *dU, float *dKG,
                              float *dG, float *dh0) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const bool par = d.NC > 0 && (dW || dKG || dG);
    const bool need_et = dW && !dU; /* dW needs dE_tot even when dU is not wanted */
    const size_t nh = (size_t)d.NC * d.HV * d.K * d.V, ne = (size_t)d.TT * d.HV * d.V;
    Scratch scr(ctx);
    size_t n = (par ? nh : 0) + (need_et ? ne : 0);
    if (n)
        DG_TRY(scr.alloc(n));
    float *dHs = par ? scr.f() : nullptr; /* NULL: the serial kernel stores nothing */
    float *dEtot = dU ? dU : need_et ? scr.f() + (par ? nh : 0) : nullptr;
    const size_t smem = sizeof(float) * ((size_t)d.K * CT + 2 * BT * CT);
    DG_TRY(smem_opt_in(state_seq_kernel<BT>, smem));
    if (d.N > 0) {
        state_seq_kernel<BT><<<dim3(d.N, d.HV, DG_CEIL_DIV(d.V, CT)), NTH, smem, s>>>(
            d, W, KG, G, dh, dE, dht, dEtot, dHs, dh0);
        DG_CHECK_LAUNCH();
    }
    if (par) {
        rows_stateT_kernel<BT><<<dim3((unsigned)d.NC, d.HV, DG_CEIL_DIV(d.K, CT)), NTH, 0, s>>>(
            d, E, dHs, 1.f, dKG, dEtot, h, -1.f, dW, G, dG);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

extern "C" dg_status kda_state_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const float *W,
                                        const float *KG, const float *G, const float *h,
                                        const float *E, const float *dh, const float *dE,
                                        const float *dht, float *dW, float *dU, float *dKG,
                                        float *dG, float *dh0) {
    DG_TRY(check_dims("kda_state_bwd_cuda", d));
    if (d->tc)
        return kda_state_bwd_tc(ctx, d, W, KG, G, h, E, dh, dE, dht, dW, dU, dKG, dG, dh0);
    switch (d->BT) {
    case 16:
        return state_bwd_bt<16>(ctx, d, W, KG, G, h, E, dh, dE, dht, dW, dU, dKG, dG, dh0);
    case 32:
        return state_bwd_bt<32>(ctx, d, W, KG, G, h, E, dh, dE, dht, dW, dU, dKG, dG, dh0);
    default:
        return state_bwd_bt<64>(ctx, d, W, KG, G, h, E, dh, dE, dht, dW, dU, dKG, dG, dh0);
    }
}

template <int BT>
static dg_status output_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const float *QG,
                               const float *h, const float *Aqk, const float *E, const float *dO,
                               float *dQG, float *dh, float *dAqk, float *dE) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const int nkt = DG_CEIL_DIV(d.K, CT), nvt = DG_CEIL_DIV(d.V, CT);
    const dim3 g2((unsigned)d.NC, d.HV);
    if (dQG) {
        rows_stateT_kernel<BT><<<dim3((unsigned)d.NC, d.HV, nkt), NTH, 0, s>>>(
            d, dO, h, scale, dQG, nullptr, nullptr, 0.f, nullptr, nullptr, nullptr);
        DG_CHECK_LAUNCH();
    }
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

extern "C" dg_status kda_output_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                         const float *QG, const float *h, const float *Aqk,
                                         const float *E, const float *dO, float *dQG, float *dh,
                                         float *dAqk, float *dE) {
    DG_TRY(check_dims("kda_output_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    if (!dO) { /* no upstream gradient: every output is zero */
        cudaStream_t s = dg__stream(ctx);
        const size_t tk = (size_t)d->TT * d->HV;
        if (dQG)
            DG_CHECK_CUDA(cudaMemsetAsync(dQG, 0, sizeof(float) * tk * d->K, s));
        if (dh)
            DG_CHECK_CUDA(
                cudaMemsetAsync(dh, 0, sizeof(float) * (size_t)d->NC * d->HV * d->K * d->V, s));
        if (dAqk)
            DG_CHECK_CUDA(cudaMemsetAsync(dAqk, 0, sizeof(float) * tk * d->BT, s));
        if (dE)
            DG_CHECK_CUDA(cudaMemsetAsync(dE, 0, sizeof(float) * tk * d->V, s));
        return DG_OK;
    }
    if (d->tc)
        return kda_output_bwd_tc(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE);
    switch (d->BT) {
    case 16:
        return output_bwd_bt<16>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE);
    case 32:
        return output_bwd_bt<32>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE);
    default:
        return output_bwd_bt<64>(ctx, d, scale, QG, h, Aqk, E, dO, dQG, dh, dAqk, dE);
    }
}
