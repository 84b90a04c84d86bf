/*
 * kernels/kda/kda_fwd_state.cu -- the inter-chunk forward stages (spec §5.3, §5.4):
 *   N6 state:   for each chunk c of a sequence, in order:  h_c stored (state at chunk START),
 *               E_c = U_c - W_c h_c,  h_{c+1} = Diag(exp(lambda_c)) h_c + KG_c^T E_c;  ht = h_NT
 *   N7 output:  O_c = s QG_c h_c + Aqk_c E_c   (Aqk read for j <= i only)
 * Layouts: W, KG, G, QG [TT,HV,K]; U, E, O [TT,HV,V]; Aqk [TT,HV,BT]; h [NC,HV,K,V] (row
 * chunk_off[n] + c); h0, ht [N,HV,K,V]. f32 FFMA only. lambda_c = G of the chunk's last token.
 */
#include "kda_fwd_util.cuh"
#include "kda_tc.cuh"

// ---- CUDA kernels

#define KDA_VT 32 /* state / output columns per block (one per lane) */
#define KDA_KT 32 /* key-dim tile */

/* Tile [BT][32] of a [TT,HV,K] array (rows = tokens t0.., columns kt0..), zero outside the L
 * valid rows and K: thread tid holds rows tid/32 + 8p, column tid%32 (coalesced 128-byte rows). */
template <int BT>
__device__ __forceinline__ void kda_tile_load(float (&pf)[BT / 8], const float *__restrict__ src,
                                              int64_t t0, int L, int HV, int hv, int K, int kt0,
                                              int tid) {
    const int col = tid & 31;
#pragma unroll
    for (int p = 0; p < BT / 8; p++) {
        const int row = (tid >> 5) + 8 * p;
        pf[p] = (row < L && kt0 + col < K) ? src[((t0 + row) * HV + hv) * K + kt0 + col] : 0.f;
    }
}

template <int BT>
__device__ __forceinline__ void kda_tile_store(const float (&pf)[BT / 8], float *Ts, int tid) {
#pragma unroll
    for (int p = 0; p < BT / 8; p++)
        Ts[((tid >> 5) + 8 * p) * KDA_KT + (tid & 31)] = pf[p];
}

/* One block of 256 threads per (sequence, value head, 32-column tile of V): blockIdx = (n, hv,
 * vtile). The running state h [KP][32] (KP = K rounded up to 32) lives in shared memory; warp w,
 * lane l own column l. Per chunk:
 *   phase A  E = U - W h:       warp w computes rows w*BT/8.. of E (W rows read as broadcast
 *                               float4s from a [BT][32] tile, h rows as one float per lane);
 *   phase B  h = exp(lam) h + KG^T E:  warp w updates key rows kt0 + 4w..4w+3 of each tile.
 * The W/KG tiles stream through one buffer; the next tile (the next chunk's first W tile after
 * the last KG tile) is loaded into registers while the current one is used. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_state_fwd_kernel(const int64_t *__restrict__ chunk_off,
                         const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                         const float *__restrict__ W, const float *__restrict__ U,
                         const float *__restrict__ KG, const float *__restrict__ G,
                         const float *__restrict__ h0, float *__restrict__ h,
                         float *__restrict__ E, float *__restrict__ ht) {
    constexpr int VT = KDA_VT, KT = KDA_KT, RW = BT / 8;
    extern __shared__ __align__(16) float kda_state_smem[];
    const int nk = (K + KT - 1) / KT, KP = nk * KT;
    float *hs = kda_state_smem;  /* [KP][VT] */
    float *Es = hs + KP * VT;    /* [BT][VT] */
    float *Ts = Es + BT * VT;    /* [BT][KT] */
    float *lam = Ts + BT * KT;   /* [KP] */

    const int n = blockIdx.x, hv = blockIdx.y;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int col = blockIdx.z * VT + lane;
    const bool colok = col < V;

    for (int kk = w; kk < KP; kk += 8)
        hs[kk * VT + lane] =
            (h0 && kk < K && colok) ? h0[(((int64_t)n * HV + hv) * K + kk) * V + col] : 0.f;
    __syncthreads();

    const int64_t c_beg = chunk_off[n], c_end = chunk_off[n + 1];
    float pf[BT / 8];
    if (c_beg < c_end)
        kda_tile_load<BT>(pf, W, chunk_t0[c_beg], chunk_len[c_beg], HV, hv, K, 0, tid);

    for (int64_t ch = c_beg; ch < c_end; ch++) {
        const int64_t t0 = chunk_t0[ch];
        const int L = chunk_len[ch];
        if (colok)
            for (int kk = w; kk < K; kk += 8)
                h[((ch * HV + hv) * K + kk) * V + col] = hs[kk * VT + lane];
        for (int kk = tid; kk < KP; kk += KDA_THREADS)
            lam[kk] = kk < K ? G[((t0 + L - 1) * HV + hv) * K + kk] : 0.f;
        float u[RW], acc[RW];
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const int i = w * RW + a;
            u[a] = (i < L && colok) ? U[((t0 + i) * HV + hv) * V + col] : 0.f;
            acc[a] = 0.f;
        }

        /* phase A: acc = W h */
        for (int s = 0; s < nk; s++) {
            kda_tile_store<BT>(pf, Ts, tid);
            __syncthreads();
            if (s + 1 < nk)
                kda_tile_load<BT>(pf, W, t0, L, HV, hv, K, (s + 1) * KT, tid);
            else
                kda_tile_load<BT>(pf, KG, t0, L, HV, hv, K, 0, tid);
            const float *hk = hs + s * KT * VT + lane;
#pragma unroll
            for (int kk = 0; kk < KT; kk += 4) {
                const float x0 = hk[(kk + 0) * VT], x1 = hk[(kk + 1) * VT];
                const float x2 = hk[(kk + 2) * VT], x3 = hk[(kk + 3) * VT];
#pragma unroll
                for (int a = 0; a < RW; a++) {
                    const float4 wv = *reinterpret_cast<const float4 *>(Ts + (w * RW + a) * KT + kk);
                    acc[a] += wv.x * x0;
                    acc[a] += wv.y * x1;
                    acc[a] += wv.z * x2;
                    acc[a] += wv.w * x3;
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < RW; a++) {
            const int i = w * RW + a;
            const float e = u[a] - acc[a];
            Es[i * VT + lane] = i < L ? e : 0.f;
            if (i < L && colok)
                E[((t0 + i) * HV + hv) * V + col] = e;
        }

        /* phase B: h = exp(lam) h + KG^T E (rows of KG and E beyond L are zero) */
        for (int s = 0; s < nk; s++) {
            kda_tile_store<BT>(pf, Ts, tid);
            __syncthreads();
            if (s + 1 < nk)
                kda_tile_load<BT>(pf, KG, t0, L, HV, hv, K, (s + 1) * KT, tid);
            else if (ch + 1 < c_end)
                kda_tile_load<BT>(pf, W, chunk_t0[ch + 1], chunk_len[ch + 1], HV, hv, K, 0, tid);
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; i++) {
                const float4 kg = *reinterpret_cast<const float4 *>(Ts + i * KT + 4 * w);
                const float ev = Es[i * VT + lane];
                s0 += kg.x * ev;
                s1 += kg.y * ev;
                s2 += kg.z * ev;
                s3 += kg.w * ev;
            }
            const int kb = s * KT + 4 * w;
            float *hr = hs + kb * VT + lane;
            hr[0 * VT] = expf(lam[kb + 0]) * hr[0 * VT] + s0;
            hr[1 * VT] = expf(lam[kb + 1]) * hr[1 * VT] + s1;
            hr[2 * VT] = expf(lam[kb + 2]) * hr[2 * VT] + s2;
            hr[3 * VT] = expf(lam[kb + 3]) * hr[3 * VT] + s3;
            __syncthreads();
        }
    }

    if (ht && colok)
        for (int kk = w; kk < K; kk += 8)
            ht[(((int64_t)n * HV + hv) * K + kk) * V + col] = hs[kk * VT + lane];
}

/* One block of 256 threads per (chunk, value head, 32-column tile of V): blockIdx = (chunk, hv,
 * vtile). Warp w owns rows w*BT/8.., lane l column l. Inter part: QG [BT][32] and h [32][32]
 * tiles over the key dim; intra part: Aqk (masked to j <= i < L) times E, both staged whole. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_output_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                          const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                          float scale, const float *__restrict__ QG, const float *__restrict__ h,
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

// ---- kernel launchers

extern "C" dg_status kda_state_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const float *W,
                                        const float *U, const float *KG, const float *G,
                                        const float *h0, float *h, float *E, float *ht) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!W || !U || !KG || !G || !h || !E)
        return dg__err(DG_ERR_ARG, "%s: W, U, KG, G, h and E are required (h0, ht optional)",
                       __func__);
    if (d->tc)
        return kda_state_fwd_tc(ctx, d, W, U, KG, G, h0, h, E, ht);
    const int KP = DG_CEIL_DIV(d->K, KDA_KT) * KDA_KT;
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, KDA_VT));
    KDA_DISPATCH_BT(d->BT, {
        const size_t smem =
            sizeof(float) * ((size_t)KP * KDA_VT + 2 * (size_t)BT_ * KDA_VT + (size_t)KP);
        if (smem > 48 * 1024)
            DG_CHECK_CUDA(cudaFuncSetAttribute(kda_state_fwd_kernel<BT_>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem));
        kda_state_fwd_kernel<BT_><<<grid, KDA_THREADS, smem, dg__stream(ctx)>>>(
            d->chunk_off, d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, W, U, KG, G, h0, h, E,
            ht);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

extern "C" dg_status kda_output_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                         const float *QG, const float *h, const float *Aqk,
                                         const float *E, float *O) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!QG || !h || !Aqk || !E || !O)
        return dg__err(DG_ERR_ARG, "%s: QG, h, Aqk, E and O are required", __func__);
    if (d->tc)
        return kda_output_fwd_tc(ctx, d, scale, QG, h, Aqk, E, O);
    dim3 grid((unsigned)d->NC, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, KDA_VT));
    KDA_DISPATCH_BT(d->BT, {
        kda_output_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, h, Aqk, E, O);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}
