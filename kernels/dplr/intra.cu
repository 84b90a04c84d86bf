/*
 * kernels/dplr/intra.cu -- the four intra-chunk matrices and the WY solve of DPLR
 * (docs/dplr.md D3 forward, D4 steps 5-7 backward); CPU twins: dg__dplr_intra_fwd_f32 /
 * dg__dplr_intra_bwd_f32 in ops/dplr/intra.c.
 *
 * Forward, per chunk (rows i, j < L) and head:
 *   Aqk[i,j] = s sum_d q_i k_j exp(Gi_i - Gi_j)   (j <= i)
 *   Aqb[i,j] = s sum_d q_i b_j exp(Gi_i - Gi_j)   (j <= i)
 *   Aak[i,j] =   sum_d a_i k_j exp(Ge_i - Gi_j)   (j <  i)
 *   Aab[i,j] =   sum_d a_i b_j exp(Ge_i - Gi_j)   (j <  i)
 *   Tab = (I - Aab)^{-1}: T[i,i] = 1, T[i,j] = sum_{m=j}^{i-1} Aab[i,m] T[m,j]
 * Backward from dAqk, dAqb, dAak, dTab (each optional):
 *   dAab = +stril(Tab^T S Tab^T), S = stril(dTab):  X1[m,j] = sum_{c<=j} S[m,c] Tab[j,c],
 *          dAab[i,j] = sum_{m>=i} Tab[m,i] X1[m,j]
 *   with g1 = s dAqk, g2 = s dAqb, g3 = dAak, g4 = dAab and x = the pair's exponential:
 *   dq_i = sum_{j<=i} (g1 k_j + g2 b_j) x_ij        da_i = sum_{j<i} (g3 k_j + g4 b_j) x'_ij
 *   dk_j = sum_{i>=j} g1 q_i x_ij + sum_{i>j} g3 a_i x'_ij      (db_j: g2, g4 in place of g1, g3)
 *   dGi = q dq - k dk - b db,  dGe = a da       (x_ij = exp(Gi_i - Gi_j), x'_ij = exp(Ge_i - Gi_j))
 * Every exponent is of a pair that is read (j <= i resp. j < i), where it is <= 0; the other
 * pairs are masked in the exponent (exp(-inf) = 0). Whole rows of the four matrices are written
 * for the L valid tokens of a chunk (zeros outside the read triangle, ones on Tab's diagonal),
 * as on the CPU. q, k, a, b are f32 or bf16 (TI, read as stored); everything else is f32.
 *
 * Kernels (f32 FFMA; the pair exponentials by the accurate expf for f32 leaves, by the hardware
 * exp2 for bf16 leaves: pair_exp below):
 *   forward  dplr_intra_fwd_kernel: block per (chunk, head); thread (ty, tx) owns rows ty + 16a,
 *            columns tx + 16b of all four matrices; the key dim in tiles of 16 staged in shared
 *            memory (rows padded to 17 floats); then the solve by forward substitution, one
 *            thread per column, summed in the CPU's order. Static shared memory
 *            6 x BT x 17 + BT x BT floats (42 KB at BT = 64).
 *   backward (1) dplr_intra_dab_kernel (when dTab is given): block per (chunk, head), dAab into
 *            a scratch [TT,H,BT] (the L^3 part, once per chunk; 33 KB static at BT = 64);
 *            (2) dplr_intra_bwd_kernel: block per (chunk, head, 32-wide key tile); lane = key
 *            dim, warp w = rows w, w + 8, ...; each thread forms its row's row side (sums over
 *            j) and column side (sums over i), so nothing is reduced across threads. Dynamic
 *            shared memory: the q, k, a, b tiles as stored (4 x BT x 32 elements), the Gi, Ge
 *            tiles (2 x BT x 32 floats) and the four gradient squares packed two to a square
 *            (each strictly lower one turned into the upper part of a lower one: 2 x BT x
 *            (BT + 1) floats); 65 KB at BT = 64 for bf16 leaves (three blocks per SM), 81 KB for
 *            f32 (opted in).
 * Entry points (dplr_cuda.h): dg__dplr_intra_fwd_cuda, dg__dplr_intra_bwd_cuda.
 */
#include "../kda/mma.cuh"
#include "common.cuh"

#include <math.h>

using namespace kdab;

namespace {
/* exp(x) of a gate difference x <= 0 (or -inf for a masked pair). f32 leaves: the accurate expf
 * (their results are held to 1e-5 of float64). bf16 leaves: the hardware exp2 of x log2(e)
 * (kdamma::exp_ftz, relative error below 1e-5 for x >= -88, results below 1e-38 flushed to 0),
 * far under the 5e-3 that bounds a bf16 call, for a fraction of expf's instructions. */
template <class TI> __device__ __forceinline__ float pair_exp(float x);
template <> __device__ __forceinline__ float pair_exp<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ float pair_exp<kda_bf16>(float x) {
    return kdamma::exp_ftz(x);
}
} // namespace

// ---- forward kernel

template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_intra_fwd_kernel(Dims d, float scale, const TI *__restrict__ q, const TI *__restrict__ k,
                          const TI *__restrict__ a, const TI *__restrict__ b,
                          const float *__restrict__ Gi, const float *__restrict__ Ge,
                          float *__restrict__ Aqk, float *__restrict__ Aqb, float *__restrict__ Aak,
                          float *__restrict__ Tab) {
    constexpr int R = BT / 16, KT = 16, LD = KT + 1;
    static_assert(6 * BT * LD >= BT * BT, "Aab reuses the tile buffer");
    __shared__ float tiles[6 * BT * LD]; /* q, a, Gi, Ge, k, b tiles [BT][LD]; then Aab [BT][BT] */
    __shared__ float Ts[BT * BT];        /* Tab of the chunk, row stride BT */
    float *qs = tiles, *as = qs + BT * LD, *gis = as + BT * LD, *ges = gis + BT * LD;
    float *ks = ges + BT * LD, *bs = ks + BT * LD;

    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H, K = d.K;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;

    float aqk[R][R], aqb[R][R], aak[R][R], aab[R][R];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < R; j++)
            aqk[i][j] = aqb[i][j] = aak[i][j] = aab[i][j] = 0.f;

    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        for (int idx = tid; idx < BT * KT; idx += NTH) {
            const int i = idx / KT, e = idx % KT;
            const bool ok = i < L && kt0 + e < K;
            const int64_t o = ((t0 + i) * H + h) * K + kt0 + e;
            qs[i * LD + e] = ok ? kda_ld(q + o) : 0.f;
            as[i * LD + e] = ok ? kda_ld(a + o) : 0.f;
            ks[i * LD + e] = ok ? kda_ld(k + o) : 0.f;
            bs[i * LD + e] = ok ? kda_ld(b + o) : 0.f;
            gis[i * LD + e] = ok ? Gi[o] : 0.f;
            ges[i * LD + e] = ok ? Ge[o] : 0.f;
        }
        __syncthreads();
#pragma unroll 2
        for (int e = 0; e < KT; e++) {
            float qi[R], ai[R], gii[R], gei[R], kj[R], bj[R], gij[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int i = ty + 16 * r, j = tx + 16 * r;
                qi[r] = qs[i * LD + e];
                ai[r] = as[i * LD + e];
                gii[r] = gis[i * LD + e];
                gei[r] = ges[i * LD + e];
                kj[r] = ks[j * LD + e];
                bj[r] = bs[j * LD + e];
                gij[r] = gis[j * LD + e];
            }
#pragma unroll
            for (int ra = 0; ra < R; ra++)
#pragma unroll
                for (int rb = 0; rb <= ra; rb++) {
                    /* rb < ra: every j < i; rb == ra: j <= i iff tx <= ty (j < i iff tx < ty) */
                    float d1 = gii[ra] - gij[rb], d2 = gei[ra] - gij[rb];
                    if (rb == ra && tx > ty)
                        d1 = -INFINITY;
                    if (rb == ra && tx >= ty)
                        d2 = -INFINITY;
                    const float x1 = qi[ra] * pair_exp<TI>(d1), x2 = ai[ra] * pair_exp<TI>(d2);
                    aqk[ra][rb] += x1 * kj[rb];
                    aqb[ra][rb] += x1 * bj[rb];
                    aak[ra][rb] += x2 * kj[rb];
                    aab[ra][rb] += x2 * bj[rb];
                }
        }
        __syncthreads();
    }

    /* the three product rows, Aab into shared memory (reusing the tiles), the solve, Tab rows */
    float *Ab = tiles;
#pragma unroll
    for (int ra = 0; ra < R; ra++) {
        const int i = ty + 16 * ra;
#pragma unroll
        for (int rb = 0; rb < R; rb++) {
            const int j = tx + 16 * rb;
            const bool le = rb < ra || (rb == ra && tx <= ty); /* j <= i */
            const bool lt = rb < ra || (rb == ra && tx < ty);  /* j < i */
            if (i < L) {
                const int64_t o = ((t0 + i) * H + h) * BT + j;
                Aqk[o] = le ? scale * aqk[ra][rb] : 0.f;
                Aqb[o] = le ? scale * aqb[ra][rb] : 0.f;
                Aak[o] = lt ? aak[ra][rb] : 0.f;
            }
            Ab[i * BT + j] = (lt && i < L) ? aab[ra][rb] : 0.f;
        }
    }
    __syncthreads();
    if (tid < L) { /* column j: T[j,j] = 1, T[i,j] = sum_{m=j}^{i-1} Aab[i,m] T[m,j] */
        const int j = tid;
        Ts[j * BT + j] = 1.f;
        for (int i = j + 1; i < L; i++) {
            float s = 0.f;
            for (int m = j; m < i; m++)
                s += Ab[i * BT + m] * Ts[m * BT + j];
            Ts[i * BT + j] = s;
        }
    }
    __syncthreads();
    for (int idx = tid; idx < L * BT; idx += NTH) {
        const int i = idx / BT, j = idx % BT;
        Tab[((t0 + i) * H + h) * BT + j] = j < i ? Ts[i * BT + j] : (j == i ? 1.f : 0.f);
    }
}

// ---- backward kernels

/* grid (NC, H): dA = dAab = stril(Tab^T S Tab^T) with S = stril(dTab) (only the strictly lower
 * part of dTab matters: Tab's diagonal and upper part are constants), the CPU's order. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    dplr_intra_dab_kernel(Dims d, const float *__restrict__ Tab, const float *__restrict__ dTab,
                          float *__restrict__ dA) {
    __shared__ float sTt[BT][BT + 1]; /* sTt[c][r] = Tab[r][c] (c <= r) */
    __shared__ float sD[BT][BT + 1];  /* S, then X1 */
    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        float tv = 0.f, dv = 0.f;
        if (row < L) {
            const int64_t g = ((t0 + row) * H + h) * BT + col;
            if (col <= row)
                tv = Tab[g];
            if (col < row)
                dv = dTab[g];
        }
        sTt[col][row] = tv;
        sD[row][col] = dv;
    }
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int JP = (BT + 31) / 32;
    /* X1[m][j] = sum_{c <= j} S[m][c] Tab[j][c]  (j < m); row m is read and written by one warp */
    for (int m = w; m < L; m += NW) {
        float val[JP];
#pragma unroll
        for (int p = 0; p < JP; p++) {
            const int j = lane + 32 * p;
            float s = 0.f;
            if (j < m)
                for (int cc = 0; cc <= j; cc++)
                    s += sD[m][cc] * sTt[cc][j];
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
    /* dAab[i][j] = sum_{m=i}^{L-1} Tab[m][i] X1[m][j]  (j < i); zero elsewhere in the row */
    for (int i = w; i < L; i += NW)
        for (int j = lane; j < BT; j += 32) {
            float s = 0.f;
            if (j < i)
                for (int m = i; m < L; m++)
                    s += sTt[i][m] * sD[m][j];
            dA[((t0 + i) * H + h) * BT + j] = j < i ? s : 0.f;
        }
}

/* Two chunk squares into one shared [BT][BT + 1] square P: P[i][j] = mul lower[i][j] for
 * j <= i, and P[i][j] = strict[j][i] for j > i (the strictly lower square turned over the
 * diagonal); zero outside the L valid rows and for a NULL source. The backward reads P only at
 * warp-uniform positions (a broadcast), so the layout costs nothing in bank conflicts; the odd
 * row stride keeps the turned stores conflict-free. Block-wide. */
template <int BT>
__device__ __forceinline__ void load_packed(float *P, const float *__restrict__ lower, float mul,
                                            const float *__restrict__ strict, int64_t t0, int L,
                                            int H, int h) {
    constexpr int LP = BT + 1;
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int i = idx / BT, j = idx % BT; /* (i, j) of the sources: row-major reads */
        const int64_t g = ((t0 + i) * H + h) * BT + j;
        if (j <= i)
            P[i * LP + j] = lower && i < L ? mul * lower[g] : 0.f;
        if (j < i) /* into (j, i) of P, above its diagonal */
            P[j * LP + i] = strict && i < L ? strict[g] : 0.f;
    }
}

/* grid (NC, H, ceil(K / 32)), dynamic shared memory (see the file comment). */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_intra_bwd_kernel(Dims d, float scale, const TI *__restrict__ q, const TI *__restrict__ k,
                          const TI *__restrict__ a, const TI *__restrict__ b,
                          const float *__restrict__ Gi, const float *__restrict__ Ge,
                          const float *__restrict__ dAqk, const float *__restrict__ dAqb,
                          const float *__restrict__ dAak, const float *__restrict__ dAab,
                          float *__restrict__ dq, float *__restrict__ dk, float *__restrict__ da,
                          float *__restrict__ db, float *__restrict__ dGi,
                          float *__restrict__ dGe) {
    constexpr int LP = BT + 1;
    extern __shared__ __align__(16) unsigned char smraw[];
    TI(*sq)[CT] = (TI(*)[CT])smraw; /* the leaf tiles as stored */
    TI(*sk)[CT] = sq + BT;
    TI(*sa)[CT] = sk + BT;
    TI(*sb)[CT] = sa + BT;
    float(*sgi)[CT] = (float(*)[CT])(smraw + 4 * BT * CT * sizeof(TI));
    float(*sge)[CT] = sgi + BT;
    /* P1: g1 = s dAqk (j <= i) with g3 = dAak turned into its upper part; P2: g2 = s dAqb with
     * g4 = dAab. g1[i][j] = P1[i][j] (j <= i), g3[i][j] = P1[j][i] (j < i); likewise P2. */
    float(*P1)[LP] = (float(*)[LP])(sge + BT);
    float(*P2)[LP] = P1 + BT;

    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H, K = d.K;
    const int e0 = blockIdx.z * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    dplr::load_rows<BT, CT>(&sq[0][0], q, t0, L, H, h, K, e0);
    dplr::load_rows<BT, CT>(&sk[0][0], k, t0, L, H, h, K, e0);
    dplr::load_rows<BT, CT>(&sa[0][0], a, t0, L, H, h, K, e0);
    dplr::load_rows<BT, CT>(&sb[0][0], b, t0, L, H, h, K, e0);
    dplr::load_rows<BT, CT>(&sgi[0][0], Gi, t0, L, H, h, K, e0);
    dplr::load_rows<BT, CT>(&sge[0][0], Ge, t0, L, H, h, K, e0);
    load_packed<BT>(&P1[0][0], dAqk, scale, dAak, t0, L, H, h);
    load_packed<BT>(&P2[0][0], dAqb, scale, dAab, t0, L, H, h);
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    for (int r = w; r < L; r += NW) { /* r is the same for the whole warp */
        const float gir = sgi[r][lane], ger = sge[r][lane];
        /* row side: r as the row i of the pairs */
        float rq = 0.f, ra = 0.f;
        for (int j = 0; j <= r; j++) {
            const float x = pair_exp<TI>(gir - sgi[j][lane]);
            rq += (P1[r][j] * kda_ld(&sk[j][lane]) + P2[r][j] * kda_ld(&sb[j][lane])) * x;
        }
        for (int j = 0; j < r; j++) {
            const float x = pair_exp<TI>(ger - sgi[j][lane]);
            ra += (P1[j][r] * kda_ld(&sk[j][lane]) + P2[j][r] * kda_ld(&sb[j][lane])) * x;
        }
        /* column side: r as the column j of the pairs */
        float ck = 0.f, cb = 0.f;
        for (int i = r; i < L; i++) {
            const float qx = kda_ld(&sq[i][lane]) * pair_exp<TI>(sgi[i][lane] - gir);
            ck += P1[i][r] * qx;
            cb += P2[i][r] * qx;
        }
        for (int i = r + 1; i < L; i++) {
            const float ax = kda_ld(&sa[i][lane]) * pair_exp<TI>(sge[i][lane] - gir);
            ck += P1[r][i] * ax;
            cb += P2[r][i] * ax;
        }
        if (e < K) {
            const int64_t o = ((t0 + r) * H + h) * K + e;
            dq[o] = rq;
            da[o] = ra;
            dk[o] = ck;
            db[o] = cb;
            dGi[o] =
                kda_ld(&sq[r][lane]) * rq - kda_ld(&sk[r][lane]) * ck - kda_ld(&sb[r][lane]) * cb;
            dGe[o] = kda_ld(&sa[r][lane]) * ra;
        }
    }
}

// ---- launchers

template <int BT, class TI>
static dg_status intra_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                             const void *k, const void *a, const void *b, const float *Gi,
                             const float *Ge, float *Aqk, float *Aqb, float *Aak, float *Tab) {
    dplr_intra_fwd_kernel<BT, TI><<<dim3((unsigned)d->NC, d->H), NTH, 0, dg__stream(ctx)>>>(
        make_dims(d), scale, (const TI *)q, (const TI *)k, (const TI *)a, (const TI *)b, Gi, Ge,
        Aqk, Aqb, Aak, Tab);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_intra_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                             int bf16, const void *q, const void *k, const void *a,
                                             const void *b, const float *Gi, const float *Ge,
                                             float *Aqk, float *Aqb, float *Aak, float *Tab) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !a || !b || !Gi || !Ge || !Aqk || !Aqb || !Aak || !Tab)
        return dg__err(DG_ERR_ARG, "%s: every array is required", __func__);
    if (d->NC == 0)
        return DG_OK;
    KDA_DISPATCH_BT(
        d->BT, DPLR_DISPATCH_TI(bf16, return intra_fwd_t<BT_, TI_>(ctx, d, scale, q, k, a, b, Gi,
                                                                   Ge, Aqk, Aqb, Aak, Tab)));
    return DG_OK;
}

template <int BT, class TI>
static dg_status intra_bwd_t(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const void *q,
                             const void *k, const void *a, const void *b, const float *Gi,
                             const float *Ge, const float *Tab, const float *dAqk,
                             const float *dAqb, const float *dAak, const float *dTab, float *dq,
                             float *dk, float *da, float *db, float *dGi, float *dGe) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    Scratch scr(ctx);
    float *dAab = nullptr;
    if (dTab) {
        DG_TRY(scr.alloc((size_t)d.TT * d.H * BT));
        dAab = scr.f();
        dplr_intra_dab_kernel<BT><<<dim3((unsigned)d.NC, d.H), NTH, 0, s>>>(d, Tab, dTab, dAab);
        DG_CHECK_LAUNCH();
    }
    const size_t smem =
        sizeof(TI) * 4 * BT * CT + sizeof(float) * (2 * BT * CT + 2 * BT * (BT + 1));
    DG_TRY(smem_opt_in(dplr_intra_bwd_kernel<BT, TI>, smem));
    const dim3 grid((unsigned)d.NC, d.H, (unsigned)DG_CEIL_DIV(d.K, CT));
    dplr_intra_bwd_kernel<BT, TI><<<grid, NTH, smem, s>>>(
        d, scale, (const TI *)q, (const TI *)k, (const TI *)a, (const TI *)b, Gi, Ge, dAqk, dAqb,
        dAak, dAab, dq, dk, da, db, dGi, dGe);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_intra_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                             int bf16, const void *q, const void *k, const void *a,
                                             const void *b, const float *Gi, const float *Ge,
                                             const float *Tab, const float *dAqk, const float *dAqb,
                                             const float *dAak, const float *dTab, float *dq,
                                             float *dk, float *da, float *db, float *dGi,
                                             float *dGe) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !a || !b || !Gi || !Ge || !Tab || !dq || !dk || !da || !db || !dGi || !dGe)
        return dg__err(DG_ERR_ARG,
                       "%s: q, k, a, b, Gi, Ge, Tab and every gradient output are required "
                       "(dAqk, dAqb, dAak, dTab optional)",
                       __func__);
    if (d->NC == 0)
        return DG_OK;
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return intra_bwd_t<BT_, TI_>(
                                                      ctx, d, scale, q, k, a, b, Gi, Ge, Tab, dAqk,
                                                      dAqb, dAak, dTab, dq, dk, da, db, dGi, dGe)));
    return DG_OK;
}
