/*
 * kernels/dplr/state.cu -- the inter-chunk state pass of DPLR (dplr.md D3 forward, D4 steps
 * 2-4 backward); CPU twins: dg__dplr_state_fwd_f32 / dg__dplr_state_bwd_f32 in ops/dplr/state.c.
 *
 * Forward, per sequence and head, S = h0 (or 0), chunks c in order (lam_c = Gi at the chunk's
 * last row):
 *   h_c = S;  v2_c = u_c + w_c S  ("v_new", plus sign);  S = Diag(exp(lam_c)) S + kg_c^T v_c +
 *   bg_c^T v2_c;  ht = S at the end.
 * Backward, chunks c = NT-1 .. 0, dH = dht (the gradient of the chunk-END state):
 *   dHn_c = dH;  dv2_c = dv2_c^out + bg_c dH -> du_c;  dv_c = kg_c dH
 *   dH = Diag(exp(lam_c)) dH + w_c^T dv2_c + dh_c^out;          dh0 = dH at the end
 *   and, chunk-parallel from the stored dHn_c:
 *   dkg_c = v_c dHn_c^T,  dbg_c = v2_c dHn_c^T,  dw_c = du_c h_c^T,
 *   dGi[L-1] = exp(lam_c) rowsum(h_c . dHn_c)  (the other rows of dGi: 0)
 * Layouts: w, kg, bg, Gi [TT,H,K]; u, v, v2 [TT,H,V]; h [NC,H,K,V] (row chunk_off[n] + c);
 * h0, ht [N,H,K,V]. v is f32 or bf16 (TI, read as stored); everything else is f32.
 *
 * Forward with bf16 leaves (bf16 = 1) where the sizes allow (K % 16 == 0, K <= 256, V % 8 == 0,
 * 16-byte aligned arrays: kda_state_plus_fits and dplr_mma_fits): the serial pass runs on KDA's
 * tensor-core kernel (kernels/kda/state.cu, state_mma_kernel: mma.sync TF32, the state in
 * registers) with both products added, X = u + w S -> v2 and S = exp(lam) S + P_c + bg^T X,
 * where the input term P_c = kg_c^T v_c [K,V] of every chunk is formed first, chunk-parallel, by
 * dplr_kgv_mma_kernel into a scratch [NC,H,K,V] (the size of h). The rounding of the TF32
 * products is within what bf16 inputs already carry; f32 leaves keep the f32 FFMA kernels below.
 * The backward likewise (bf16 leaves, same sizes): state_mma_kernel backward with
 * X = dv2 + bg dH -> du, dH = exp(lam) dH + dh_c + w^T X, storing dHn_c; then, chunk-parallel,
 * dv = kg dHn (dplr_kdh_mma_kernel) and the products that sum over V on KDA's TF32 kernels
 * (kda_state_rows_plus).
 * Tensor-core kernels here (kdamma::gemm_acc, TF32 m16n8k8, f32 accumulation):
 *   dplr_kgv_mma_kernel: P_c = kg_c^T v_c, block per (chunk, head, 64 x 64 tile of P);
 *   dplr_kdh_mma_kernel: dv_c = kg_c dHn_c, block per (chunk, head, 64 value columns).
 * FFMA kernels (f32 leaves, and the sizes the tensor-core path does not take; each sum in the
 * CPU's order):
 *   dplr_state_fwd_kernel: block per (sequence, head, 32 value columns); the running state
 *     [KP][32] (KP = K rounded up to 32) in shared memory, lane l = column l. Per chunk:
 *     phase A v2 = u + w S (warp w rows w*BT/8..; w tiles [BT][32] staged, the state row read
 *     as one float per lane); phase B S = exp(lam) S + kg^T v + bg^T v2 (warp w updates key rows
 *     4w..4w+3 of each 32-row tile). Dynamic shared memory KP x 32 + 4 x BT x 32 + KP floats
 *     (65 KB at K = 256, BT = 64, opted in).
 *   dplr_state_seq_kernel: the serial backward pass in the same layout (dH in shared memory):
 *     du, dv and the dH update; dHn_c into a scratch [NC,H,K,V] (the size of h).
 *   dplr_state_rows_kernel: the products that sum over V, chunk-parallel: block per (chunk,
 *     head, 32-wide key tile), lane = key column, warp w = rows w, w + 8, ...; V walked in tiles
 *     of 32 (static shared memory 3 x BT x 32 + 2 x 32 x 33 floats, 33 KB at BT = 64). No value
 *     tile ever needs another tile's partial sums.
 * KCP summaries (dg__dplr_state_summary_cuda): the two serial kernels over one sequence, storing
 * nothing per chunk (their per-chunk outputs h, v2 / dHn, du, dv may be NULL, and so may the
 * input terms u, v / dh, dv2: zero), from S0 with the input terms and from the identity over K
 * columns without them.
 * Entry points (dplr_cuda.h): dg__dplr_state_fwd_cuda, dg__dplr_state_bwd_cuda,
 * dg__dplr_state_summary_cuda.
 */
#include "../kda/mma.cuh"
#include "common.cuh"

using namespace kdab;

namespace {
constexpr int VT = 32; /* value columns per block of the serial kernels */
constexpr int KT = 32; /* key-dim tile of the serial kernels */

/* Rows [0, BT) x columns [kt0, kt0 + KT) of a [TT,H,K] f32 array into the shared [BT][KT] dst
 * (zero outside L and K). */
template <int BT>
__device__ __forceinline__ void ktile(float *dst, const float *__restrict__ src, int64_t t0, int L,
                                      int H, int h, int K, int kt0) {
    dplr::load_rows<BT, KT>(dst, src, t0, L, H, h, K, kt0);
}

/* Dynamic shared memory of the serial kernels, in floats. */
template <int BT> constexpr size_t seq_smem_floats(int KP) {
    return (size_t)KP * VT + 4 * (size_t)BT * VT + (size_t)KP;
}
} // namespace

// ---- forward kernel

template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_state_fwd_kernel(Dims d, const float *__restrict__ w, const float *__restrict__ u,
                          const float *__restrict__ kg, const float *__restrict__ bg,
                          const TI *__restrict__ v, const float *__restrict__ Gi,
                          const float *__restrict__ h0, float *__restrict__ hout,
                          float *__restrict__ v2, float *__restrict__ ht) {
    constexpr int RW = BT / 8;
    extern __shared__ float sm[];
    const int H = d.H, K = d.K, V = d.V;
    const int nk = (K + KT - 1) / KT, KP = nk * KT;
    float *hs = sm;            /* [KP][VT] the running state */
    float *Es = hs + KP * VT;  /* [BT][VT] v2 */
    float *Vs = Es + BT * VT;  /* [BT][VT] v */
    float *Ta = Vs + BT * VT;  /* [BT][KT] w, then kg */
    float *Tb = Ta + BT * KT;  /* [BT][KT] bg */
    float *lam = Tb + BT * KT; /* [KP] */

    const int n = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x, wp = tid >> 5, lane = tid & 31;
    const int col = blockIdx.z * VT + lane;
    const bool colok = col < V;
    const int64_t sb = ((int64_t)n * H + h) * K * V; /* h0, ht */

    for (int x = wp; x < KP; x += NW)
        hs[x * VT + lane] = (h0 && x < K && colok) ? h0[sb + (int64_t)x * V + col] : 0.f;
    __syncthreads();

    for (int64_t ch = d.chunk_off[n]; ch < d.chunk_off[n + 1]; ch++) {
        const int64_t t0 = d.chunk_t0[ch];
        const int L = d.chunk_len[ch];
        if (colok && hout)
            for (int x = wp; x < K; x += NW)
                hout[((ch * H + h) * K + x) * V + col] = hs[x * VT + lane];
        for (int x = tid; x < KP; x += NTH)
            lam[x] = x < K ? Gi[((t0 + L - 1) * H + h) * K + x] : 0.f;
        float acc[RW];
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int i = wp * RW + r;
            acc[r] = (u && i < L && colok) ? u[((t0 + i) * H + h) * V + col] : 0.f;
        }
        /* phase A: v2 = u + w S */
        for (int s = 0; s < nk; s++) {
            ktile<BT>(Ta, w, t0, L, H, h, K, s * KT);
            __syncthreads();
            const float *hk = hs + s * KT * VT + lane;
#pragma unroll 4
            for (int kk = 0; kk < KT; kk++) {
                const float sv = hk[kk * VT];
#pragma unroll
                for (int r = 0; r < RW; r++)
                    acc[r] += Ta[(wp * RW + r) * KT + kk] * sv;
            }
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int i = wp * RW + r;
            const bool ok = i < L && colok;
            Es[i * VT + lane] = ok ? acc[r] : 0.f;
            Vs[i * VT + lane] = ok && v ? kda_ld(v + ((t0 + i) * H + h) * V + col) : 0.f;
            if (ok && v2)
                v2[((t0 + i) * H + h) * V + col] = acc[r];
        }
        /* phase B: S = exp(lam) S + kg^T v + bg^T v2 (rows of the tiles past L are zero) */
        for (int s = 0; s < nk; s++) {
            ktile<BT>(Ta, kg, t0, L, H, h, K, s * KT);
            ktile<BT>(Tb, bg, t0, L, H, h, K, s * KT);
            __syncthreads();
#pragma unroll
            for (int r4 = 0; r4 < 4; r4++) {
                const int xl = 4 * wp + r4, x = s * KT + xl;
                float sv = expf(lam[x]) * hs[x * VT + lane];
#pragma unroll 8
                for (int i = 0; i < BT; i++)
                    sv += Ta[i * KT + xl] * Vs[i * VT + lane] + Tb[i * KT + xl] * Es[i * VT + lane];
                hs[x * VT + lane] = sv;
            }
            __syncthreads();
        }
    }

    if (ht && colok)
        for (int x = wp; x < K; x += NW)
            ht[sb + (int64_t)x * V + col] = hs[x * VT + lane];
}

/* P_c = kg_c^T v_c (rows i < L) for every chunk and head into P [NC,H,K,V], on mma.sync TF32
 * (kdamma::gemm_acc, k = the chunk's tokens); grid (NC x ceil(K / 64) ceil(V / 64), H)
 * (chunk_tile), a 64 x 64 tile of P per block. Needs K, V % 8 == 0 and aligned arrays. */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    dplr_kgv_mma_kernel(Dims d, const float *__restrict__ kg, const kda_bf16 *__restrict__ v,
                        float *__restrict__ P) {
    using namespace kdamma;
    __shared__ __align__(16) float sm[gemm_smem<64, false, false, float, kda_bf16>()];
    const int H = d.H, K = d.K, V = d.V, nvt = DG_CEIL_DIV(V, AB_N);
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(K, AB_N) * nvt);
    const int64_t ch = ct.c;
    const int h = blockIdx.y, x0 = (ct.z / nvt) * AB_N, e0 = (ct.z % nvt) * AB_N;
    const int64_t t0 = d.chunk_t0[ch], rv = (int64_t)H * V;
    const int L = d.chunk_len[ch], nx = min(AB_N, K - x0), ne = min(AB_N, V - e0);
    float acc[AbTile<64>::NTW][4] = {};
    gemm_acc<64, false, false>(acc, kg + (t0 * H + h) * K + x0, (int64_t)H * K, nx,
                               v + t0 * rv + (int64_t)h * V + e0, rv, L, ne, BT, sm);
    store_acc<64>(acc, P + ((ch * H + h) * K + x0) * (int64_t)V + e0, V, nx, ne, 1.f);
}

// ---- backward kernels

/* dv_c = kg_c dHn_c (rows i < L) for every chunk and head, the tensor-core backward's share of
 * the serial pass (dplr_state_seq_kernel forms it inline), on mma.sync TF32 (kdamma::gemm_acc,
 * k = the key dim); grid (NC x ceil(V / 64), H) (chunk_tile), a BT x 64 tile of dv per block. */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    dplr_kdh_mma_kernel(Dims d, const float *__restrict__ kg, const float *__restrict__ dHn,
                        float *__restrict__ dv) {
    using namespace kdamma;
    __shared__ __align__(16) float sm[gemm_smem<BT, true, false>()];
    const int H = d.H, K = d.K, V = d.V;
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(V, AB_N));
    const int64_t ch = ct.c;
    const int h = blockIdx.y, e0 = ct.z * AB_N;
    const int64_t t0 = d.chunk_t0[ch], rv = (int64_t)H * V;
    const int L = d.chunk_len[ch], ne = min(AB_N, V - e0);
    float acc[AbTile<BT>::NTW][4] = {};
    gemm_acc<BT, true, false>(acc, kg + (t0 * H + h) * K, (int64_t)H * K, L,
                              dHn + (ch * H + h) * (int64_t)K * V + e0, V, K, ne, K, sm);
    store_acc<BT>(acc, dv + t0 * rv + (int64_t)h * V + e0, rv, L, ne, 1.f);
}

/* The serial pass, grid (sequence, head, V / 32), layout as the forward's. dh, dv2, dht may be
 * NULL (zero); dHn, du, dv, dh0 NULL (not stored). */
template <int BT>
__global__ void __launch_bounds__(NTH)
    dplr_state_seq_kernel(Dims d, const float *__restrict__ w, const float *__restrict__ kg,
                          const float *__restrict__ bg, const float *__restrict__ Gi,
                          const float *__restrict__ dh, const float *__restrict__ dv2,
                          const float *__restrict__ dht, float *__restrict__ dHn,
                          float *__restrict__ du, float *__restrict__ dv, float *__restrict__ dh0) {
    constexpr int RW = BT / 8;
    extern __shared__ float sm[];
    const int H = d.H, K = d.K, V = d.V;
    const int nk = (K + KT - 1) / KT, KP = nk * KT;
    float *hs = sm;               /* [KP][VT] dH, the gradient of the chunk-end state */
    float *Xs = hs + KP * VT;     /* [BT][VT] the total dv2 */
    float *Ta = Xs + 2 * BT * VT; /* [BT][KT] bg, then w */
    float *Tb = Ta + BT * KT;     /* [BT][KT] kg */
    float *lam = Tb + BT * KT;    /* [KP] */

    const int n = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x, wp = tid >> 5, lane = tid & 31;
    const int col = blockIdx.z * VT + lane;
    const bool colok = col < V;
    const int64_t sb = ((int64_t)n * H + h) * K * V;

    for (int x = wp; x < KP; x += NW)
        hs[x * VT + lane] = (dht && x < K && colok) ? dht[sb + (int64_t)x * V + col] : 0.f;
    __syncthreads();

    for (int64_t ch = d.chunk_off[n + 1] - 1; ch >= d.chunk_off[n]; ch--) {
        const int64_t t0 = d.chunk_t0[ch];
        const int L = d.chunk_len[ch];
        const int64_t hb = (ch * H + h) * K * (int64_t)V; /* dHn_c, dh_c */
        if (colok && dHn)
            for (int x = wp; x < K; x += NW)
                dHn[hb + (int64_t)x * V + col] = hs[x * VT + lane];
        for (int x = tid; x < KP; x += NTH)
            lam[x] = x < K ? Gi[((t0 + L - 1) * H + h) * K + x] : 0.f;
        float ax[RW], av[RW]; /* dv2 = dv2^out + bg dH, dv = kg dH */
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int i = wp * RW + r;
            ax[r] = (dv2 && i < L && colok) ? dv2[((t0 + i) * H + h) * V + col] : 0.f;
            av[r] = 0.f;
        }
        for (int s = 0; s < nk; s++) {
            ktile<BT>(Ta, bg, t0, L, H, h, K, s * KT);
            ktile<BT>(Tb, kg, t0, L, H, h, K, s * KT);
            __syncthreads();
            const float *hk = hs + s * KT * VT + lane;
#pragma unroll 4
            for (int kk = 0; kk < KT; kk++) {
                const float g = hk[kk * VT];
#pragma unroll
                for (int r = 0; r < RW; r++) {
                    ax[r] += Ta[(wp * RW + r) * KT + kk] * g;
                    av[r] += Tb[(wp * RW + r) * KT + kk] * g;
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int i = wp * RW + r;
            const bool ok = i < L && colok;
            Xs[i * VT + lane] = ok ? ax[r] : 0.f;
            if (ok && du)
                du[((t0 + i) * H + h) * V + col] = ax[r];
            if (ok && dv)
                dv[((t0 + i) * H + h) * V + col] = av[r];
        }
        /* dH = exp(lam) dH + w^T dv2 + dh_c */
        for (int s = 0; s < nk; s++) {
            ktile<BT>(Ta, w, t0, L, H, h, K, s * KT);
            __syncthreads();
#pragma unroll
            for (int r4 = 0; r4 < 4; r4++) {
                const int xl = 4 * wp + r4, x = s * KT + xl;
                float g = expf(lam[x]) * hs[x * VT + lane];
#pragma unroll 8
                for (int i = 0; i < BT; i++)
                    g += Ta[i * KT + xl] * Xs[i * VT + lane];
                if (dh && x < K && colok)
                    g += dh[hb + (int64_t)x * V + col];
                hs[x * VT + lane] = g;
            }
            __syncthreads();
        }
    }

    if (dh0 && colok)
        for (int x = wp; x < K; x += NW)
            dh0[sb + (int64_t)x * V + col] = hs[x * VT + lane];
}

/* grid (NC, H, ceil(K / 32)): dkg, dbg, dw and dGi of the chunk's rows for 32 key columns. */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_state_rows_kernel(Dims d, const TI *__restrict__ v, const float *__restrict__ v2,
                           const float *__restrict__ du, const float *__restrict__ h,
                           const float *__restrict__ dHn, const float *__restrict__ Gi,
                           float *__restrict__ dkg, float *__restrict__ dbg, float *__restrict__ dw,
                           float *__restrict__ dGi) {
    constexpr int RP = BT / NW, LD = CT + 1;
    __shared__ float sv[BT][CT], sv2[BT][CT], sdu[BT][CT];
    __shared__ float sdH[CT][LD], shh[CT][LD]; /* [key row][value column] */
    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int x0 = blockIdx.z * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t hb = (c * H + hh) * K * (int64_t)V;

    float akg[RP], abg[RP], aw[RP], ag = 0.f;
#pragma unroll
    for (int p = 0; p < RP; p++)
        akg[p] = abg[p] = aw[p] = 0.f;
    for (int y0 = 0; y0 < V; y0 += CT) {
        dplr::load_rows<BT, CT>(&sv[0][0], v, t0, L, H, hh, V, y0);
        dplr::load_rows<BT, CT>(&sv2[0][0], v2, t0, L, H, hh, V, y0);
        dplr::load_rows<BT, CT>(&sdu[0][0], du, t0, L, H, hh, V, y0);
        dplr::load_state_tile<LD>(&sdH[0][0], dHn + hb, K, V, x0, y0);
        dplr::load_state_tile<LD>(&shh[0][0], h + hb, K, V, x0, y0);
        __syncthreads();
#pragma unroll 4
        for (int yy = 0; yy < CT; yy++) {
            const float g = sdH[lane][yy], hv = shh[lane][yy];
            ag += hv * g;
#pragma unroll
            for (int p = 0; p < RP; p++) {
                const int i = wp + NW * p;
                akg[p] += sv[i][yy] * g;
                abg[p] += sv2[i][yy] * g;
                aw[p] += sdu[i][yy] * hv;
            }
        }
        __syncthreads();
    }
    const int x = x0 + lane;
    if (x >= K)
        return;
    const float lam = Gi[((t0 + L - 1) * H + hh) * K + x];
#pragma unroll
    for (int p = 0; p < RP; p++) {
        const int i = wp + NW * p;
        if (i >= L)
            continue;
        const int64_t o = ((t0 + i) * H + hh) * K + x;
        dkg[o] = akg[p];
        dbg[o] = abg[p];
        dw[o] = aw[p];
        dGi[o] = i == L - 1 ? expf(lam) * ag : 0.f;
    }
}

// ---- launchers

template <int BT, class TI>
static dg_status state_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, const float *w, const float *u,
                             const float *kg, const float *bg, const void *v, const float *Gi,
                             const float *h0, float *h, float *v2, float *ht) {
    const int KP = DG_CEIL_DIV(d->K, KT) * KT;
    const size_t smem = sizeof(float) * seq_smem_floats<BT>(KP);
    DG_TRY(smem_opt_in(dplr_state_fwd_kernel<BT, TI>, smem));
    const dim3 grid((unsigned)d->N, d->H, (unsigned)DG_CEIL_DIV(d->V, VT));
    dplr_state_fwd_kernel<BT, TI><<<grid, NTH, smem, dg__stream(ctx)>>>(
        make_dims(d), w, u, kg, bg, (const TI *)v, Gi, h0, h, v2, ht);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_state_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                             const float *w, const float *u, const float *kg,
                                             const float *bg, const void *v, const float *Gi,
                                             const float *h0, float *h, float *v2, float *ht) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!w || !u || !kg || !bg || !v || !Gi || !h || !v2)
        return dg__err(DG_ERR_ARG,
                       "%s: w, u, kg, bg, v, Gi, h and v2 are required (h0, ht optional)",
                       __func__);
    if (bf16 && d->NC > 0 && kda_state_plus_fits(d, w, u, bg, Gi, h0, nullptr, h, v2, ht) &&
        dplr_mma_fits(d, {kg, v})) {
        /* the tensor-core pass: P = kg^T v per chunk, then state_mma_kernel with P as Sup */
        Scratch P(ctx);
        DG_TRY(P.alloc((size_t)d->NC * d->H * d->K * d->V));
        const unsigned nt =
            (unsigned)(DG_CEIL_DIV(d->K, kdamma::AB_N) * DG_CEIL_DIV(d->V, kdamma::AB_N));
        KDA_DISPATCH_BT(d->BT, {
            dplr_kgv_mma_kernel<BT_>
                <<<dim3((unsigned)d->NC * nt, d->H), kdamma::AB_THREADS, 0, dg__stream(ctx)>>>(
                    make_dims(d), kg, (const kda_bf16 *)v, P.f());
            DG_CHECK_LAUNCH();
        });
        return kda_state_plus(ctx, d, false, w, u, bg, Gi, h0, P.f(), h, v2, ht);
    }
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return state_fwd_t<BT_, TI_>(
                                                      ctx, d, w, u, kg, bg, v, Gi, h0, h, v2, ht)));
    return DG_OK;
}

template <int BT, class TI>
static dg_status state_bwd_t(dg_ctx *ctx, const kda_cuda_dims *dd, const float *w, const float *kg,
                             const float *bg, const void *v, const float *Gi, const float *h,
                             const float *v2, const float *dh, const float *dv2, const float *dht,
                             float *dw, float *du, float *dkg, float *dbg, float *dv, float *dGi,
                             float *dh0) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    Scratch dHn(ctx);
    DG_TRY(dHn.alloc((size_t)d.NC * d.H * d.K * d.V));
    const bool tc = sizeof(TI) == 2 && d.NC > 0 &&
                    kda_state_plus_fits(dd, bg, dv2, w, Gi, dht, dh, dHn.f(), du, dh0) &&
                    kda_state_rows_plus_fits(dd, v, v2, du, h, dHn.f(), dkg, dbg, dw, dGi) &&
                    dplr_mma_fits(dd, {kg, dv});
    if (tc) {
        /* the tensor-core serial pass (bf16 leaves), then dv = kg dHn and the products that sum
         * over V, chunk-parallel */
        DG_TRY(kda_state_plus(ctx, dd, true, bg, dv2, w, Gi, dht, dh, dHn.f(), du, dh0));
        const unsigned nvt = (unsigned)DG_CEIL_DIV(d.V, kdamma::AB_N);
        dplr_kdh_mma_kernel<BT>
            <<<dim3((unsigned)d.NC * nvt, d.H), kdamma::AB_THREADS, 0, s>>>(d, kg, dHn.f(), dv);
        DG_CHECK_LAUNCH();
        return kda_state_rows_plus(ctx, dd, (const kda_bf16 *)v, v2, du, h, dHn.f(), Gi, dkg, dbg,
                                   dw, dGi);
    } else {
        const int KP = DG_CEIL_DIV(d.K, KT) * KT;
        const size_t smem = sizeof(float) * seq_smem_floats<BT>(KP);
        DG_TRY(smem_opt_in(dplr_state_seq_kernel<BT>, smem));
        dplr_state_seq_kernel<BT>
            <<<dim3((unsigned)d.N, d.H, (unsigned)DG_CEIL_DIV(d.V, VT)), NTH, smem, s>>>(
                d, w, kg, bg, Gi, dh, dv2, dht, dHn.f(), du, dv, dh0);
        DG_CHECK_LAUNCH();
    }
    if (d.NC == 0)
        return DG_OK;
    dplr_state_rows_kernel<BT, TI>
        <<<dim3((unsigned)d.NC, d.H, (unsigned)DG_CEIL_DIV(d.K, CT)), NTH, 0, s>>>(
            d, (const TI *)v, v2, du, h, dHn.f(), Gi, dkg, dbg, dw, dGi);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_state_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                             const float *w, const float *kg, const float *bg,
                                             const void *v, const float *Gi, const float *h,
                                             const float *v2, const float *dh, const float *dv2,
                                             const float *dht, float *dw, float *du, float *dkg,
                                             float *dbg, float *dv, float *dGi, float *dh0) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!w || !kg || !bg || !v || !Gi || !h || !v2 || !dw || !du || !dkg || !dbg || !dv || !dGi)
        return dg__err(DG_ERR_ARG,
                       "%s: w, kg, bg, v, Gi, h, v2 and dw, du, dkg, dbg, dv, dGi are required "
                       "(dh, dv2, dht, dh0 optional)",
                       __func__);
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return state_bwd_t<BT_, TI_>(
                                                      ctx, d, w, kg, bg, v, Gi, h, v2, dh, dv2, dht,
                                                      dw, du, dkg, dbg, dv, dGi, dh0)));
    return DG_OK;
}

/* The KCP summaries (ops/dplr/kcp.c): the serial kernels over sequence seq alone (block 0 walks
 * chunks chunk_off[seq]..), storing nothing per chunk. */
extern "C" dg_status dg__dplr_state_summary_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int seq,
                                                 int bwd, int bf16, const float *w, const float *u,
                                                 const float *kg, const float *bg, const void *v,
                                                 const float *Gi, const float *dh, const float *dv2,
                                                 const float *S0, float *Sh, float *SM) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (seq < 0 || seq >= d->N || !w || !kg || !bg || !Gi || !Sh || !SM || (!bwd && (!u || !v)))
        return dg__err(DG_ERR_ARG,
                       "%s: seq in [0, N), w, kg, bg, Gi, Sh, SM (and forward: u, v) are "
                       "required (seq=%d N=%d)",
                       __func__, seq, (int)d->N);
    kda_cuda_dims one = *d;
    one.N = 1;
    one.chunk_off = d->chunk_off + seq;
    Scratch I(ctx);
    DG_TRY(I.alloc((size_t)d->H * d->K * d->K));
    DG_TRY(kda_identity(ctx, I.f(), d->H, d->K));
    kda_cuda_dims cols = one; /* the transition: K columns from the identity, no input term */
    cols.V = d->K;
    const int KP = DG_CEIL_DIV(d->K, KT) * KT;
    cudaStream_t s = dg__stream(ctx);
    KDA_DISPATCH_BT(d->BT, {
        const size_t smem = sizeof(float) * seq_smem_floats<BT_>(KP);
        if (bwd) {
            DG_TRY(smem_opt_in(dplr_state_seq_kernel<BT_>, smem));
            dplr_state_seq_kernel<BT_>
                <<<dim3(1, d->H, (unsigned)DG_CEIL_DIV(d->V, VT)), NTH, smem, s>>>(
                    make_dims(&one), w, kg, bg, Gi, dh, dv2, S0, nullptr, nullptr, nullptr, Sh);
            DG_CHECK_LAUNCH();
            dplr_state_seq_kernel<BT_>
                <<<dim3(1, d->H, (unsigned)DG_CEIL_DIV(d->K, VT)), NTH, smem, s>>>(
                    make_dims(&cols), w, kg, bg, Gi, nullptr, nullptr, I.f(), nullptr, nullptr,
                    nullptr, SM);
            DG_CHECK_LAUNCH();
            return DG_OK;
        }
        DPLR_DISPATCH_TI(bf16, {
            DG_TRY(smem_opt_in(dplr_state_fwd_kernel<BT_, TI_>, smem));
            dplr_state_fwd_kernel<BT_, TI_>
                <<<dim3(1, d->H, (unsigned)DG_CEIL_DIV(d->V, VT)), NTH, smem, s>>>(
                    make_dims(&one), w, u, kg, bg, (const TI_ *)v, Gi, S0, nullptr, nullptr, Sh);
            DG_CHECK_LAUNCH();
            dplr_state_fwd_kernel<BT_, TI_>
                <<<dim3(1, d->H, (unsigned)DG_CEIL_DIV(d->K, VT)), NTH, smem, s>>>(
                    make_dims(&cols), w, nullptr, kg, bg, (const TI_ *)nullptr, Gi, I.f(), nullptr,
                    nullptr, SM);
            DG_CHECK_LAUNCH();
            return DG_OK;
        });
    });
    return DG_OK;
}
