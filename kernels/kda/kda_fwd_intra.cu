/*
 * kernels/kda/kda_fwd_intra.cu -- the intra-chunk forward stages (spec §5.1, §5.2):
 *   N4 intra:  Araw[i,j] = sum_d q_i k_j exp(G_i - G_j) (j <= i),  Aqk = s Araw
 *              P[i,j]    = sum_d k_i k_j exp(G_i - G_j) (j <  i),  Tm = (I + Diag(beta) P)^{-1}
 *   N5 wy:     W = Tm Diag(beta) (K . exp(G)),  U = Tm Diag(beta) V,
 *              KG = K . exp(lambda - G),  QG = Q . exp(G),  lambda = G of the chunk's last row
 * Layouts (flat tokens TT, see kda_cuda.h): q, k [TT,H,K]; v, U [TT,HV,V]; G, W, KG, QG
 * [TT,HV,K]; beta [TT,HV]; Aqk, Tm [TT,HV,BT]. Value head hv reads q/k head hv / (HV/H).
 * f32 FFMA only. Stability (§7.1): exponents are only formed for j <= i, where G_i - G_j <= 0;
 * the upper triangle is masked in the exponent (exp(-inf) = 0), so -40/step gates stay finite.
 * Whole rows of Aqk and Tm are written for the L valid tokens of a chunk (zeros above the
 * diagonal and beyond L, ones on Tm's diagonal), exactly like the CPU reference.
 */
#include "kda_fwd_util.cuh"
#include "kda_tc.cuh"

#include <math.h>

// ---- CUDA kernels

/* One block of 256 threads per (chunk, value head); blockIdx.x = chunk, blockIdx.y = hv.
 * Thread (ty, tx) = (tid / 16, tid % 16) owns rows i = ty + 16a and columns j = tx + 16b
 * (a, b < BT/16) of both [BT,BT] matrices; the key dim is walked in tiles of 32 staged in shared
 * memory (rows padded to 33 floats: the 16 column reads of a half-warp hit 16 banks).
 * Tm: forward substitution in shared memory, one thread per column j (columns are independent:
 * T[j,j] = 1, T[i,j] = -sum_{m=j}^{i-1} Lkk[i,m] T[m,j]), summed in the CPU's order. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_intra_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int H, int HV, int K,
                         float scale, const float *__restrict__ q, const float *__restrict__ k,
                         const float *__restrict__ beta, const float *__restrict__ G,
                         float *__restrict__ Aqk, float *__restrict__ Tm) {
    constexpr int R = BT / 16, KT = 32, LD = KT + 1;
    static_assert(3 * BT * LD >= BT * BT, "Lkk reuses the tile buffer");
    __shared__ float tiles[3 * BT * LD]; /* q, k, G tiles [BT][LD]; then Lkk [BT][BT] */
    __shared__ float Ts[BT * BT];        /* Tm of the chunk, row stride BT */
    float *qs = tiles, *ks = tiles + BT * LD, *gs = tiles + 2 * BT * LD;

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;

    float accA[R][R], accP[R][R];
#pragma unroll
    for (int a = 0; a < R; a++)
#pragma unroll
        for (int b = 0; b < R; b++)
            accA[a][b] = accP[a][b] = 0.f;

    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        for (int idx = tid; idx < BT * KT; idx += KDA_THREADS) {
            const int i = idx / KT, e = idx % KT;
            const bool ok = i < L && kt0 + e < K;
            const int64_t oq = ((t0 + i) * H + hq) * K + kt0 + e;
            const int64_t og = ((t0 + i) * HV + hv) * K + kt0 + e;
            qs[i * LD + e] = ok ? q[oq] : 0.f;
            ks[i * LD + e] = ok ? k[oq] : 0.f;
            gs[i * LD + e] = ok ? G[og] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int e = 0; e < KT; e++) {
            float qi[R], ki[R], gi[R], kj[R], gj[R];
#pragma unroll
            for (int a = 0; a < R; a++) {
                const int i = ty + 16 * a, j = tx + 16 * a;
                qi[a] = qs[i * LD + e];
                ki[a] = ks[i * LD + e];
                gi[a] = gs[i * LD + e];
                kj[a] = ks[j * LD + e];
                gj[a] = gs[j * LD + e];
            }
#pragma unroll
            for (int a = 0; a < R; a++)
#pragma unroll
                for (int b = 0; b <= a; b++) {
                    /* b < a: every j < i; b == a: j <= i iff tx <= ty, else exponent -inf */
                    float dg = gi[a] - gj[b];
                    if (b == a && tx > ty)
                        dg = -INFINITY;
                    const float x = kj[b] * expf(dg);
                    accA[a][b] += qi[a] * x;
                    accP[a][b] += ki[a] * x;
                }
        }
        __syncthreads();
    }

    /* Aqk rows, Lkk into shared memory (reusing the tiles), the solve, Tm rows */
    kda_intra_finish<BT, R>(accA, accP, tiles, Ts, beta, Aqk, Tm, t0, L, hv, HV, scale);
}

/* One block of 256 threads per (chunk, value head). KG and QG elementwise; W and U as
 * (Tm Diag(beta)) times a [BT, 64] column tile of X = K exp(G) (resp. V) staged in shared memory.
 * Tb = Tm Diag(beta) is stored transposed (TbT[j][i], zero above the diagonal and beyond L) so
 * that thread (r, c) = (tid / 64, tid % 64) owning the BT/4 consecutive rows r*BT/4.. of column c
 * reads them as warp-broadcast float4s; j stops at the last row it owns (lower triangle). */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_wy_fwd_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int H, int HV, int K, int V, const float *__restrict__ q,
                      const float *__restrict__ k, const float *__restrict__ v,
                      const float *__restrict__ beta, const float *__restrict__ G,
                      const float *__restrict__ Tm, float *__restrict__ W, float *__restrict__ U,
                      float *__restrict__ KG, float *__restrict__ QG) {
    constexpr int RB = BT / 4, CT = 64, LDT = BT + 4;
    __shared__ __align__(16) float TbT[BT * LDT];
    __shared__ float Xs[BT * CT];

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x;

    kda_wy_gates<KDA_THREADS>(q, k, G, KG, QG, t0, L, hv, hq, H, HV, K);
    if (!W && !U)
        return;

    for (int idx = tid; idx < BT * BT; idx += KDA_THREADS) {
        const int i = idx / BT, j = idx % BT;
        float t = 0.f;
        if (i < L && j <= i)
            t = Tm[((t0 + i) * HV + hv) * BT + j] * beta[(t0 + j) * HV + hv];
        TbT[j * LDT + i] = t;
    }

    const int r = tid >> 6, c = tid & 63, i0 = r * RB;
    const int jend = min(i0 + RB, L); /* rows i0.. need j <= i < i0 + RB */
    for (int pass = 0; pass < 2; pass++) {
        float *dst = pass == 0 ? W : U;
        const int D = pass == 0 ? K : V;
        if (!dst)
            continue;
        for (int e0 = 0; e0 < D; e0 += CT) {
            __syncthreads(); /* TbT written / previous tile consumed */
            for (int idx = tid; idx < BT * CT; idx += KDA_THREADS) {
                const int j = idx / CT, e = idx % CT;
                float x = 0.f;
                if (j < L && e0 + e < D) {
                    if (pass == 0)
                        x = k[((t0 + j) * H + hq) * K + e0 + e] *
                            expf(G[((t0 + j) * HV + hv) * K + e0 + e]);
                    else
                        x = v[((t0 + j) * HV + hv) * V + e0 + e];
                }
                Xs[j * CT + e] = x;
            }
            __syncthreads();
            float acc[RB];
#pragma unroll
            for (int a = 0; a < RB; a++)
                acc[a] = 0.f;
            for (int j = 0; j < jend; j++) {
                const float x = Xs[j * CT + c];
                const float4 *tb = reinterpret_cast<const float4 *>(TbT + j * LDT + i0);
#pragma unroll
                for (int a4 = 0; a4 < RB / 4; a4++) {
                    const float4 t = tb[a4];
                    acc[4 * a4 + 0] += t.x * x;
                    acc[4 * a4 + 1] += t.y * x;
                    acc[4 * a4 + 2] += t.z * x;
                    acc[4 * a4 + 3] += t.w * x;
                }
            }
            if (e0 + c < D)
#pragma unroll
                for (int a = 0; a < RB; a++)
                    if (i0 + a < L)
                        dst[((t0 + i0 + a) * HV + hv) * D + e0 + c] = acc[a];
        }
    }
}

// ---- kernel launchers

extern "C" dg_status kda_intra_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                        const float *q, const float *k, const float *beta,
                                        const float *G, float *Aqk, float *Tm) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!q || !k || !beta || !G || !Aqk || !Tm)
        return dg__err(DG_ERR_ARG, "%s: q, k, beta, G, Aqk and Tm are required", __func__);
    if (d->tc)
        return kda_intra_fwd_tc(ctx, d, scale, q, k, beta, G, Aqk, Tm);
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    KDA_DISPATCH_BT(d->BT, {
        kda_intra_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, scale, q, k, beta, G, Aqk, Tm);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

extern "C" dg_status kda_wy_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const float *q,
                                     const float *k, const float *v, const float *beta,
                                     const float *G, const float *Tm, float *W, float *U,
                                     float *KG, float *QG) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!G || ((W || KG) && !k) || (QG && !q) || (U && !v) || ((W || U) && (!beta || !Tm)))
        return dg__err(DG_ERR_ARG, "%s: G and the inputs of every requested output are required "
                       "(W: k, beta, Tm; U: v, beta, Tm; KG: k; QG: q)", __func__);
    if (!W && !U && !KG && !QG)
        return DG_OK;
    if (d->tc)
        return kda_wy_fwd_tc(ctx, d, q, k, v, beta, G, Tm, W, U, KG, QG);
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    KDA_DISPATCH_BT(d->BT, {
        kda_wy_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, d->V, q, k, v, beta, G, Tm, W, U, KG,
            QG);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}
