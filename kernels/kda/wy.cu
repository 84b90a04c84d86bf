/*
 * kernels/kda/wy.cu -- N5, the WY transform (kda.md §11.4(c) forward; §11.6 B3 WY part backward);
 * CPU twins: dg__kda_wy_fwd_f32 / dg__kda_wy_bwd_f32 in ops/kda/wy.c.
 *
 * Forward, per chunk and value head (lambda = G of the chunk's last row):
 *   W = Tm Diag(beta) (K . exp(G)),  U = Tm Diag(beta) V,  KG = K . exp(lambda - G),
 *   QG = Q . exp(G)
 * Backward, rows i, j < L, gamma_j = exp(G_j), lambda = G_{L-1}, X_j = beta_j k_j gamma_j:
 *   dX = Tm^T dW,  dVb = Tm^T dU                   (dX_j = sum_{i>=j} Tm[i,j] dW_i)
 *   dq_j = dQG_j gamma_j                            a_j = dKG_j exp(lambda - G_j)
 *   dk_j = a_j + beta_j gamma_j dX_j                dv_j = beta_j dVb_j
 *   dG_j = q_j dQG_j gamma_j - k_j a_j + X_j dX_j  (+ sum_i k_i a_i on row L-1: lambda's share)
 *   dbeta_j = sum_v dVb_j v_j + sum_d dX_j k_j gamma_j
 *   dTm[i,j] = beta_j (dU_i . v_j) + dW_i . X_j     (j <= i; zero for j > i, as the CPU writes)
 * Every exponent (G_j, lambda - G_j) is <= 0. Layouts (kda_cuda.h): q, k [TT,H,K]; v, U
 * [TT,HV,V]; G, W, KG, QG [TT,HV,K]; beta [TT,HV]; Tm [TT,HV,BT].
 *
 * Variants (the tc mode of kda_cuda_dims, kda_cuda.h):
 *   forward  f32 FFMA: kda_wy_fwd_kernel: block per (chunk, hv), KG and QG elementwise
 *                     (kda_wy_gates), W and U as (Tm Diag(beta)) times 64-column tiles of X;
 *            tc == 1 and the sizes allow (K, V % 4 == 0, 16-byte aligned arrays):
 *                     wy_fwd_mma_kernel, mma.sync TF32 with cp.async staging; everything else
 *                     (tc == 2, the 3xTF32 mode, included) takes the FFMA kernel in f32.
 *            The tensor-core kernels use the hardware exponential kdamma::exp_ftz (a relative
 * error of a few 1e-6, far below the TF32 operand rounding). Backward: tc == 1 and the sizes
 * allow (K, V % 4 == 0, 16-byte aligned Tm, dW, dU, G): wy_cols_mma_kernel, one block per (chunk,
 * hv) over the chunk's 64-column tiles: the column products on mma.sync TF32, the per-column work
 * of wy_cols_kernel on the product kept in shared memory, and dTm from the same staged tiles
 * (mma.sync TF32, accumulated in registers over the tiles). Else two kernels: (1) wy_cols_kernel
 * (f32): block per (chunk, hv, 32-wide tile of the K key dims followed by the V value dims); lane =
 * column, warp w = rows w, w+8, ...; the column sums of Tm^T are per thread; the last-row sum over
 * rows goes through an 8 x 32 shared array summed in warp order; dbeta's sums over columns are
 * warp butterflies written per tile and summed over tiles in a fixed order; (2) wy_dtm_kernel
 * (f32): block per (chunk, hv), 16 x 16 threads, each a (BT/16)^2 register block of dTm, looping
 * over 32-column tiles of the concatenated [dW | dU] and [X | beta v] rows. dq, dk per value head
 * are summed over the G heads of a group afterwards (G > 1, kda_sum_parts); acc adds the flagged
 * gradients to what their arrays hold (KDA_ACC_*). Shared memory (static): wy_cols BT x BT + BT x
 * 32 + 8 x 32 floats (25 KB at BT = 64); wy_dtm 2 x BT x 33
 * floats (17 KB at BT = 64). Entry points (kda_cuda.h): dg__kda_wy_fwd_cuda, dg__kda_wy_bwd_cuda.
 */
#include "common.cuh"
#include "mma.cuh"

using namespace kdab;

// ---- device helpers

/* KG = k * exp(lambda - G) and QG = q * exp(G) for the L rows of one (chunk, value head); either
 * output may be NULL. The elementwise part of both WY forward kernels (FFMA and tensor-core). */
template <int NT>
__device__ __forceinline__ void kda_wy_gates(const float *q, const float *k, const float *G,
                                             float *KG, float *QG, int64_t t0, int L, int hv,
                                             int hq, int H, int HV, int K) {
    if (!KG && !QG)
        return;
    const float *lam = G + ((t0 + L - 1) * HV + hv) * K;
    for (int idx = threadIdx.x; idx < L * K; idx += NT) {
        const int i = idx / K, e = idx % K;
        const int64_t og = ((t0 + i) * HV + hv) * K + e, oq = ((t0 + i) * H + hq) * K + e;
        const float gi = G[og];
        if (KG)
            KG[og] = k[oq] * expf(lam[e] - gi);
        if (QG)
            QG[og] = q[oq] * expf(gi);
    }
}

// ---- forward kernels

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

/* N5 on mma.sync (TF32 only), one block per (chunk, value head), walking the chunk's 64-column
 * tiles: first the K / 64 key tiles (KG, QG and W = Tm (Diag(beta) K exp(G)) of 64 key columns),
 * then the V / 64 value tiles of U = Tm (Diag(beta) V). Tm (read for j <= i, rows past L zero)
 * comes in once by cp.async and serves every tile; each tile's G and k (or v) come in by cp.async
 * into one of two stages while the tile before is multiplied and stored, and its q rows (for QG)
 * are loaded into registers during the tile before. The elementwise part turns the staged G into
 * X in place (each thread rewrites only the elements it read; lambda, the G row L - 1, is staged
 * a second time as row BT of the stage so that no thread reads an element another one rewrites).
 * Dynamic shared memory (wy_fwd_smem): Tm [BT][BT + 4] floats, two stages of G / X [BT + 1][72]
 * floats plus the raw k / v tile [BT][72] of its own type, and the rows' beta and row scales
 * (72 KB at BT = 64 for bf16 leaves: three blocks per SM; 90 KB for f32). The outputs are stored as
 * M (f32 or bf16, kda_cuda_dims.mid). Needs K, V % 4 == 0 and 16-byte aligned arrays (the launcher
 * checks). */
template <int BT, class TV, class TQ> constexpr size_t wy_fwd_stage_bytes() { /* one stage */
    constexpr size_t raw = sizeof(TV) > sizeof(TQ) ? sizeof(TV) : sizeof(TQ);
    return (sizeof(float) * (BT + 1) + raw * BT) * kdamma::AB_LDB;
}
template <int BT, class TV, class TQ> constexpr size_t wy_fwd_smem() {
    return sizeof(float) * BT * (BT + 4 + 3) + 2 * wy_fwd_stage_bytes<BT, TV, TQ>();
}

template <int BT, class M, class TV, class TQ>
__global__ void /* bf16 leaves: 72 KB of shared memory and 80 registers, three blocks per SM */
__launch_bounds__(kdamma::AB_THREADS, sizeof(TV) == 2 && sizeof(TQ) == 2 ? 3 : 2)
    wy_fwd_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int H, int HV, int K, int V, const TQ *__restrict__ q,
                      const TQ *__restrict__ k, const float *__restrict__ rq,
                      const float *__restrict__ rk, const TV *__restrict__ v,
                      const float *__restrict__ beta, const float *__restrict__ G,
                      const float *__restrict__ Tm, M *__restrict__ W, M *__restrict__ U,
                      M *__restrict__ KG, M *__restrict__ QG) {
    using namespace kdamma;
    constexpr int LDT = BT + 4, LDX = AB_LDB, NT = AB_THREADS;
    constexpr size_t SB = wy_fwd_stage_bytes<BT, TV, TQ>();
    static_assert(SB % 16 == 0, "stages stay 16-byte aligned");
    extern __shared__ __align__(16) float wy_smem[];
    float *const Ts = wy_smem;
    unsigned char *const stages = reinterpret_cast<unsigned char *>(Ts + BT * LDT);
    /* stage b: G / X rows at gx(b) (row BT: lambda), the raw k or v tile right after them */
    auto gx = [&](int b) { return reinterpret_cast<float *>(stages + b * SB); };
    auto raw = [&](int b) { return reinterpret_cast<void *>(gx(b) + (BT + 1) * LDX); };
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int nK = DG_CEIL_DIV(K, AB_N), nz = nK + DG_CEIL_DIV(V, AB_N);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    /* the tiles asked for: key tiles when W, KG or QG is, value tiles when U is (the inputs of
     * the others may be NULL then) */
    const int z0 = (W || KG || QG) ? 0 : nK, z1 = U ? nz : nK;
    if (z0 >= z1 || L <= 0)
        return;
    const bool mul_w = W != nullptr;
    /* issue the cp.async copies of tile z into stage b */
    auto stage = [&](int z, int b) {
        if (z < nK) {
            const int c0 = AB_N * z;
            float *g = gx(b);
            const float *gsrc = G + (t0 * HV + hv) * K;
            tile_async<BT, AB_N, LDX, NT>(g, gsrc, (int64_t)HV * K, L, c0, K);
            tile_async<1, AB_N, LDX, NT>(g + BT * LDX, gsrc + (int64_t)(L - 1) * HV * K,
                                         (int64_t)HV * K, 1, c0, K);
            if (k) /* (absent when only QG is asked for: X is not needed then) */
                tile_async<BT, AB_N, LDX, NT>(static_cast<TQ *>(raw(b)), k + (t0 * H + hq) * K,
                                              (int64_t)H * K, L, c0, K);
        } else {
            tile_async<BT, AB_N, LDX, NT>(static_cast<TV *>(raw(b)), v + (t0 * HV + hv) * V,
                                          (int64_t)HV * V, L, AB_N * (z - nK), V);
        }
    };
    if ((mul_w && z0 < nK) || z1 > nK) /* Tm and beta serve W and U only */
        tile_async<BT, BT, LDT, NT>(Ts, Tm + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0, BT);
    stage(z0, 0);
    cp_async_commit();
    /* The elementwise part: thread = 4 consecutive columns e4 .. e4 + 3 (16-byte pieces of f32;
     * nc is a multiple of 4) and rows r0 + RS u, u < RU (every row of the chunk). The per-row
     * values (beta, the row scales of k and q) are the same for every tile. */
    constexpr int CG = AB_N / 4, RS = NT / CG, RU = (BT + RS - 1) / RS;
    static_assert(NT % CG == 0, "a thread keeps its columns");
    const int e4 = 4 * (threadIdx.x % CG), r0 = threadIdx.x / CG;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float *const rowv = reinterpret_cast<float *>(stages + 2 * SB); /* beta, k's, q's row scales */
    if (threadIdx.x < BT) {
        const int j = threadIdx.x;
        const bool ok = j < L;
        rowv[j] = ok && (W || U) ? beta[(t0 + j) * HV + hv] : 0.f;
        rowv[BT + j] = ok && rk ? rk[(t0 + j) * H + hq] : 1.f;
        rowv[2 * BT + j] = ok && rq ? rq[(t0 + j) * H + hq] : 1.f;
    }
    /* q of key tile z (the rows of this thread), loaded a tile ahead */
    kda_raw4<TQ> qr[RU];
    auto load_q = [&](int z) {
        if (!QG || z >= nK)
            return;
        const int c = AB_N * z + e4;
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const int j = r0 + RS * u;
            if (c < K && j < L)
                qr[u].load(q + ((t0 + j) * H + hq) * K + c);
        }
    };
    load_q(z0);
    for (int z = z0, sb = 0; z < z1; z++, sb ^= 1) {
        if (z + 1 < z1)
            stage(z + 1, sb ^ 1); /* stage sb ^ 1 was released by the barrier ending tile z - 1 */
        cp_async_commit();
        cp_async_wait<1>(); /* tile z's copies (and Tm) have landed */
        __syncthreads();
        const bool wt = z < nK;
        const int c0 = AB_N * (wt ? z : z - nK), D = wt ? K : V;
        const int nc = min(AB_N, D - c0);
        const bool colok = e4 < nc;
        float *const X = gx(sb);
        const bool hasx = wt ? k != nullptr : true;
        auto ex = [](float4 a,
                     float4 c) { /* e^(a - c) per element */
                                 return make_float4(exp_ftz(a.x - c.x), exp_ftz(a.y - c.y),
                                                    exp_ftz(a.z - c.z), exp_ftz(a.w - c.w));
        };
        const float4 lam =
            wt && colok ? *reinterpret_cast<const float4 *>(X + BT * LDX + e4) : zero4;
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const int j = r0 + RS * u;
            if (j >= BT)
                break;
            /* zero past L and past nc: rows past L must be finite for the product */
            float4 x = zero4;
            if (colok && j < L) {
                if (hasx) {
                    const float4 r = wt ? kda_ld4(static_cast<const TQ *>(raw(sb)) + j * LDX + e4)
                                        : kda_ld4(static_cast<const TV *>(raw(sb)) + j * LDX + e4);
                    const float s = wt ? rowv[BT + j] : 1.f;
                    x = make_float4(r.x * s, r.y * s, r.z * s, r.w * s);
                }
                const float b_ = rowv[j];
                if (wt) {
                    const float4 gj = *reinterpret_cast<const float4 *>(X + j * LDX + e4);
                    const float4 eg = ex(gj, zero4);
                    const int64_t og = ((t0 + j) * HV + hv) * K + c0 + e4;
                    if (KG) {
                        const float4 el = ex(lam, gj);
                        kda_st4(KG + og,
                                make_float4(x.x * el.x, x.y * el.y, x.z * el.z, x.w * el.w));
                    }
                    if (QG) {
                        float4 qq = qr[u].get();
                        if (rq) {
                            const float sc = rowv[2 * BT + j];
                            qq = make_float4(qq.x * sc, qq.y * sc, qq.z * sc, qq.w * sc);
                        }
                        kda_st4(QG + og,
                                make_float4(qq.x * eg.x, qq.y * eg.y, qq.z * eg.z, qq.w * eg.w));
                    }
                    x = make_float4(b_ * x.x * eg.x, b_ * x.y * eg.y, b_ * x.z * eg.z,
                                    b_ * x.w * eg.w);
                } else {
                    x = make_float4(b_ * x.x, b_ * x.y, b_ * x.z, b_ * x.w);
                }
            }
            *reinterpret_cast<float4 *>(X + j * LDX + e4) = x;
        }
        if (wt && z + 1 < nK)
            load_q(z + 1);       /* in flight during the product */
        if (wt ? mul_w : true) { /* block-uniform */
            __syncthreads();     /* X is complete */
            float acc[AbTile<BT>::NTW][4] = {};
            mma_stage<BT, true, false, 1, BT>(acc, Ts, LDT, X, LDX, 0);
            M *const dst = wt ? W : U;
            if constexpr (sizeof(M) == 2) /* bf16 (the mid path: K, V % 16 == 0): 16-byte stores,
                                             staged in the raw tile, read no more */
                store_acc_rows<BT>(acc, dst + (t0 * HV + hv) * D + c0, (int64_t)HV * D, L, nc, 1.f,
                                   static_cast<M *>(raw(sb)));
            else
                store_acc<BT>(acc, dst + (t0 * HV + hv) * D + c0, (int64_t)HV * D, L, nc, 1.f);
        }
        __syncthreads(); /* stage sb is refilled by the next tile's copies */
    }
}

// ---- backward kernels

/* The arrays of the WY backward's per-column work (wy_cols_kernel, wy_cols_mma_kernel). */
struct WyCols {
    QkIn q, k; /* f32 or bf16 rows, optionally scaled (kda_cuda_dims.qk_bf16, rq, rk) */
    const float *v, *beta, *G, *dKG, *dQG;
    const kda_bf16 *vb; /* v in bf16 (v NULL then): the op's own leaf, read as stored */
    float *dqv, *dkv, *dv, *dG;
    kda_bf16 *dvb; /* dv in bf16 (dv NULL then): the leaf's gradient, written as stored */
    int H, HV, K, V;
    unsigned acc;
};

/* Token t of the N consecutive columns e.. of the WY backward (N = 1 or 2; e a multiple of N),
 * given s = (Tm^T dW)_t (key columns) or (Tm^T dU)_t (value columns): writes dq, dk and dG (key
 * columns; the chunk's last row keeps its dG in last, to which the column sum is added later) or
 * dv (value columns), adds k a to the column sums, sets xo to X_j of the columns (beta_j k_j
 * gamma_j, or beta_j v_j: dTm's operand) and returns these elements' share of dbeta (summed over
 * the N columns in order). FAST: the hardware exponential kdamma::exp_ftz (the tensor-core path).
 * All loads are issued before the first store. */
template <int N, bool FAST, class TQ>
__device__ __forceinline__ float
wy_col_row(const WyCols &o, int64_t t, int hv, int hq, int e, bool kcol, bool vcol, bool lastrow,
           const float (&lam)[N], const float (&s)[N], float (&colsum)[N], float (&last)[N],
           float (&xo)[N], const float *gs = nullptr) {
    const float bj = o.beta[t * o.HV + hv];
    float pb = 0.f;
    if (kcol) {
        const int64_t ig = (t * o.HV + hv) * o.K + e, iq = (t * o.H + hq) * o.K + e;
        /* q, k of TQ (o.q.bf16 says which), times their row scales (x 1 is exact) */
        const float sq = o.q.r ? o.q.r[t * o.H + hq] : 1.f;
        const float sk = o.k.r ? o.k.r[t * o.H + hq] : 1.f;
        float Gj[N], kj[N], qj[N], q0[N] = {}, k0[N] = {}, g0[N] = {}, dqg[N] = {}, dkg[N] = {};
        kda_ldn<N>(Gj, gs ? gs : o.G + ig);
        kda_ldn<N>(kj, static_cast<const TQ *>(o.k.p) + iq);
        kda_ldn<N>(qj, static_cast<const TQ *>(o.q.p) + iq);
        /* what the accumulated outputs hold, read with the other loads (after the first store
         * they would wait for it: the arrays may alias as far as the compiler knows) */
        if (o.dqv && (o.acc & KDA_ACC_DQ))
            kda_ldn<N>(q0, o.dqv + ig);
        if (o.dkv && (o.acc & KDA_ACC_DK))
            kda_ldn<N>(k0, o.dkv + ig);
        if (!lastrow && o.dG && (o.acc & KDA_ACC_DG))
            kda_ldn<N>(g0, o.dG + ig);
        if (o.dQG)
            kda_ldn<N>(dqg, o.dQG + ig);
        if (o.dKG)
            kda_ldn<N>(dkg, o.dKG + ig);
        float dq[N], dk[N], dg[N];
#pragma unroll
        for (int c = 0; c < N; c++) {
            kj[c] *= sk;
            qj[c] *= sq;
            const float gam = FAST ? kdamma::exp_ftz(Gj[c]) : expf(Gj[c]);
            const float X = bj * kj[c] * gam;
            const float tq = o.dQG ? dqg[c] * gam : 0.f;
            const float a =
                o.dKG ? dkg[c] * (FAST ? kdamma::exp_ftz(lam[c] - Gj[c]) : expf(lam[c] - Gj[c]))
                      : 0.f;
            dq[c] = q0[c] + tq;
            dk[c] = k0[c] + a + bj * gam * s[c];
            const float g = qj[c] * tq - kj[c] * a + X * s[c];
            dg[c] = g0[c] + g;
            if (lastrow)
                last[c] = g;
            colsum[c] += kj[c] * a;
            xo[c] = X;
            pb += s[c] * kj[c] * gam;
        }
        if (o.dqv)
            kda_stn<N>(o.dqv + ig, dq);
        if (o.dkv)
            kda_stn<N>(o.dkv + ig, dk);
        if (!lastrow && o.dG)
            kda_stn<N>(o.dG + ig, dg);
        return pb;
    }
    if (vcol) {
        const int64_t iv = (t * o.HV + hv) * o.V + e;
        float vj[N], dv[N];
        if (o.vb)
            kda_ldn<N>(vj, o.vb + iv);
        else
            kda_ldn<N>(vj, o.v + iv);
#pragma unroll
        for (int c = 0; c < N; c++) {
            dv[c] = bj * s[c];
            xo[c] = bj * vj[c];
            pb += s[c] * vj[c];
        }
        if (o.dvb)
            kda_stn<N>(o.dvb + iv, dv);
        else if (o.dv)
            kda_stn<N>(o.dv + iv, dv);
    }
    return pb;
}

template <int BT, class TQ>
__global__ void __launch_bounds__(NTH)
    wy_cols_kernel(Dims d, QkIn q, QkIn k, const float *v, const float *beta, const float *G,
                   const float *Tm, const float *dW, const float *dU, const float *dKG,
                   const float *dQG, float *dqv, float *dkv, float *dv, float *dG, float *dbp,
                   unsigned acc) {
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
    const WyCols o{q,   k,  v,  beta,    G, dKG, dQG, nullptr, dqv,
                   dkv, dv, dG, nullptr, H, HV,  K,   V,       acc};
    float colsum[1] = {0.f}, last[1] = {0.f};
    const float lam1[1] = {lam};
    for (int j = w; j < L; j += NW) { /* j is the same for the whole warp */
        float s[1] = {0.f};           /* (Tm^T up)_j, rows i >= j in order */
        for (int i = j; i < L; i++)
            s[0] += sTm[i][j] * sX[i][lane];
        const int64_t t = t0 + j;
        float x[1]; /* (dTm is wy_dtm_kernel's here) */
        const float pb = warp_sum(wy_col_row<1, false, TQ>(o, t, hv, hq, e, key && ok, !key && ok,
                                                           j == L - 1, lam1, s, colsum, last, x));
        if (dbp && lane == 0)
            dbp[(int64_t)z * d.TT * HV + t * HV + hv] = pb;
    }
    if (!key)
        return; /* block-uniform: the value tiles have no last-row sum */
    red[w][lane] = colsum[0];
    __syncthreads();
    if (w == (L - 1) % NW && ok && dG) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < NW; ww++)
            s += red[ww][lane];
        float *o = dG + ((t0 + L - 1) * HV + hv) * K + e;
        *o = (acc & KDA_ACC_DG ? *o : 0.f) + last[0] + s;
    }
}

/* wy_cols_kernel and dTm together on the tensor-core path (tc == 1, TF32), grid (NC, HV): one block
 * per (chunk, value head) walks the chunk's 64-column tiles in order, the ceil(K / 64) key tiles
 * c0 = 64 z first, then the ceil(V / 64) value tiles. Per tile: the upstream gradient up (dW or
 * dU) comes in with cp.async next to Tm (staged once per block), the column product Tm^T up runs
 * on mma.sync into shared memory, and wy_cols_kernel's per-column work runs on it with lane l
 * taking the column pair 2l, 2l + 1 (wy_col_row with N = 2: 8-byte f32, 4-byte bf16 pieces) and
 * warp w the rows w, w + 8, ... Each thread overwrites the product elements it has used with X_j
 * (beta_j k_j gamma_j, or beta_j v_j), so that after a barrier the tile's share of dTm, up X^T,
 * runs on mma.sync from the same two staged tiles: dTm never reads dW, dU, k, G or v again. The
 * dTm accumulator stays in registers over the tiles; its products, their order and the TF32
 * roundings are those of the 64-column stages of the separate tensor-core dTm kernel this one
 * replaced (the same bits). dbeta's partial sums are written per 32-column half (16 lanes) in
 * wy_cols_kernel's numbering of CT-wide tiles, so what follows the kernel does not change.
 * A key tile's G columns come in by cp.async with up, so the rows' work reads G (and lambda)
 * from shared memory. Dynamic shared memory: Tm [BT][BT + 8], up [BT][72], the product / X
 * [max(BT, 64)][72] and G [BT][72] floats (72 KB at BT = 64, and 2 KB static: three blocks per
 * SM, at most 80 registers). Needs K, V % 4 == 0 and 16-byte aligned Tm, dW, dU, G (the launcher
 * checks). */
template <int BT, class TQ>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 3)
    wy_cols_mma_kernel(Dims d, QkIn q, QkIn k, const float *__restrict__ v,
                       const kda_bf16 *__restrict__ vb, const float *__restrict__ beta,
                       const float *__restrict__ G, const float *__restrict__ Tm,
                       const float *__restrict__ dW, const float *__restrict__ dU,
                       const float *__restrict__ dKG, const float *__restrict__ dQG,
                       float *__restrict__ dqv, float *__restrict__ dkv, float *__restrict__ dv,
                       kda_bf16 *__restrict__ dvb, float *__restrict__ dG, float *__restrict__ dbp,
                       float *__restrict__ dTm, unsigned acc) {
    using namespace kdamma;
    static_assert(AB_THREADS == NTH && AB_N == 2 * CT, "two CT-wide halves per 64-column tile");
    constexpr int LDT = BT + 8, LDX = AB_LDB;
    extern __shared__ __align__(16) float cols_smem[];
    constexpr int XR = BT > AB_N ? BT : AB_N; /* rows of Xs: dTm's B operand has AB_N rows */
    float *Ts = cols_smem, *Us = Ts + BT * LDT, *Xs = Us + BT * LDX, *Gs = Xs + XR * LDX;
    __shared__ float red[NW][AB_N];
    const int H = d.H, HV = d.HV, K = d.K, V = d.V;
    const int nK = DG_CEIL_DIV(K, AB_N), nkt = DG_CEIL_DIV(K, CT), nz = nK + DG_CEIL_DIV(V, AB_N);
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / d.G;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const WyCols o{q, k, v, beta, G, dKG, dQG, vb, dqv, dkv, dv, dG, dvb, H, HV, K, V, acc};
    for (int idx = BT * LDX + threadIdx.x; idx < XR * LDX; idx += AB_THREADS)
        Xs[idx] = 0.f;                   /* rows BT.. of Xs (BT < 64) stay zero */
    float tacc[AbTile<BT>::NTW][4] = {}; /* dTm */
    if (dW || dU)
        tile_async<BT, BT, LDT, AB_THREADS>(Ts, Tm + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0,
                                            BT); /* waited for with the first tile's up */
    for (int z = 0; z < nz; z++) {
        const bool key = z < nK;
        const int c0 = AB_N * (key ? z : z - nK);
        const int ncol = key ? K : V;
        const float *up = key ? dW : dU; /* the upstream gradient Tm^T is applied to */
        float pr[AbTile<BT>::NTW][4] = {};
        __syncthreads(); /* the previous tile has read Us, Xs, Gs and red */
        /* up (for the product) and a key tile's G (for the rows' work) come in together */
        if (up) /* block-uniform; a NULL upstream gradient leaves the product zero */
            tile_async<BT, AB_N, LDX, AB_THREADS>(Us, up + (t0 * HV + hv) * ncol,
                                                  (int64_t)HV * ncol, L, c0, ncol);
        if (key)
            tile_async<BT, AB_N, LDX, AB_THREADS>(Gs, G + (t0 * HV + hv) * K, (int64_t)HV * K, L,
                                                  c0, K);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (up) /* A(m = j, k = i) = Tm[i][j], kept for i >= j; rows i >= L are zero */
            mma_stage<BT, false, false, 2, BT>(pr, Ts, LDT, Us, LDX, 0);
        store_acc<BT>(pr, Xs, LDX, BT, AB_N, 1.f); /* rows j >= L and columns past ncol: 0 */
        __syncthreads();

        /* lane = the column pair el, el + 1 of the tile (a 32-column half per 16 lanes), warp =
         * rows w, w + NW, ... */
        const int el = 2 * lane, e = c0 + el, hf = lane >> 4;
        const bool half = c0 + CT * hf < ncol, ok = e < ncol; /* K, V % 4 == 0: pairs whole */
        const int zs = (key ? 0 : nkt) + (c0 + CT * hf) / CT; /* wy_cols_kernel's tile index */
        float lam[2] = {0.f, 0.f}, colsum[2] = {0.f, 0.f}, last[2] = {0.f, 0.f};
        if (key && ok && L > 0)
            kda_ldn<2>(lam, Gs + (L - 1) * LDX + el);
        for (int j = w; j < L; j += NW) { /* j is the same for the whole warp */
            float *sx = Xs + j * LDX + el;
            const float2 s2 = *reinterpret_cast<const float2 *>(sx);
            const float sv[2] = {s2.x, s2.y};
            float x[2] = {0.f, 0.f};
            float pb =
                wy_col_row<2, true, TQ>(o, t0 + j, hv, hq, e, key && ok, !key && ok, j == L - 1,
                                        lam, sv, colsum, last, x, Gs + j * LDX + el);
            /* (Tm^T up)_j has been used: X_j in its place, for dTm */
            *reinterpret_cast<float2 *>(sx) = make_float2(x[0], x[1]);
#pragma unroll
            for (int m = 8; m > 0; m >>= 1) /* over the 16 lanes of each 32-column half */
                pb += __shfl_xor_sync(0xffffffffu, pb, m);
            if (dbp && (lane & 15) == 0 && half)
                dbp[(int64_t)zs * d.TT * HV + (t0 + j) * HV + hv] = pb;
        }
        if (key) { /* block-uniform: the last-row sum of the key columns, rows summed in order */
            red[w][el] = colsum[0];
            red[w][el + 1] = colsum[1];
            __syncthreads();
            if (w == (L - 1) % NW && ok && dG) {
#pragma unroll
                for (int cc = 0; cc < 2; cc++) {
                    float sr = 0.f;
#pragma unroll
                    for (int r = 0; r < NW; r++)
                        sr += red[r][el + cc];
                    float *og = dG + ((t0 + L - 1) * HV + hv) * K + e + cc;
                    *og = (acc & KDA_ACC_DG ? *og : 0.f) + last[cc] + sr;
                }
            }
        }
        if (dTm && up) { /* dTm += up X^T (rows i of up, rows j of X; columns past ncol are 0) */
            __syncthreads();
            mma_stage<BT, true, true, 0, AB_N>(tacc, Us, LDX, Xs, LDX, 0);
        }
    }
    if (dTm) /* rows i < L, every column j < BT: the product for j <= i, zero above (as the CPU) */
        store_acc<BT, true>(tacc, dTm + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, BT, 1.f);
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

// ---- launchers

/* Whether the forward runs on wy_fwd_mma_kernel (tc == 1, K, V % 4 == 0, 16-byte aligned
 * arrays (KG and QG are stored four elements at a time, bf16 W and U as 16-byte rows); a bf16 v
 * also needs V % 8 == 0). */
static bool wy_fwd_mma(const kda_cuda_dims *d, const void *q, const void *k, const void *v,
                       const void *G, const void *Tm, const void *W, const void *U, const void *KG,
                       const void *QG) {
    return d->tc == 1 && d->K % 4 == 0 && d->V % (d->leaf_bf16 ? 8 : 4) == 0 && aligned16(q) &&
           aligned16(k) && aligned16(v) && aligned16(G) && aligned16(Tm) && aligned16(W) &&
           aligned16(U) && aligned16(KG) && aligned16(QG);
}

/* The forward on wy_fwd_mma_kernel (wy_fwd_mma holds), v of TV, q and k of TQ (bf16: with d's
 * row scales). */
template <class TV, class TQ>
static dg_status wy_fwd_launch_mma(dg_ctx *ctx, const kda_cuda_dims *d, const void *q,
                                   const void *k, const TV *v, const float *beta, const float *G,
                                   const float *Tm, void *W, void *U, void *KG, void *QG) {
    if (d->NC == 0)
        return DG_OK;
    const bool qb = sizeof(TQ) == 2;
    KDA_DISPATCH_BT(d->BT, {
        const size_t smem = wy_fwd_smem<BT_, TV, TQ>();
        KDA_DISPATCH_MID(d->mid, {
            DG_TRY(dg__smem_opt_in((const void *)wy_fwd_mma_kernel<BT_, M_, TV, TQ>, smem));
            wy_fwd_mma_kernel<BT_, M_, TV, TQ><<<dim3((unsigned)d->NC, (unsigned)d->HV),
                                                 kdamma::AB_THREADS, smem, dg__stream(ctx)>>>(
                d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, d->V, (const TQ *)q, (const TQ *)k,
                qb ? d->rq : nullptr, qb ? d->rk : nullptr, v, beta, G, Tm, (M_ *)W, (M_ *)U,
                (M_ *)KG, (M_ *)QG);
            DG_CHECK_LAUNCH();
        });
    });
    return DG_OK;
}

/* v of TV; q, k as d says (bf16 ones as stored where the mma kernel runs, else f32 rows) */
template <class TV>
static dg_status wy_fwd_launch_qk(dg_ctx *ctx, const kda_cuda_dims *d, const void *q, const void *k,
                                  const TV *v, const float *beta, const float *G, const float *Tm,
                                  void *W, void *U, void *KG, void *QG) {
    if (d->qk_bf16 && dg__kda_qk_fits(d, q, k))
        return wy_fwd_launch_mma<TV, kda_bf16>(ctx, d, q, k, v, beta, G, Tm, W, U, KG, QG);
    Scratch qs(ctx), ks(ctx);
    const float *qf, *kf;
    DG_TRY(kda_qk_widen(ctx, d, q, k, qs, ks, &qf, &kf));
    return wy_fwd_launch_mma<TV, float>(ctx, d, qf, kf, v, beta, G, Tm, W, U, KG, QG);
}

extern "C" dg_status dg__kda_wy_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *qv,
                                         const void *kv, const void *v, const float *beta,
                                         const float *G, const float *Tm, void *W, void *U,
                                         void *KG, void *QG) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!G || ((W || KG) && !kv) || (QG && !qv) || (U && !v) || ((W || U) && (!beta || !Tm)))
        return dg__err(DG_ERR_ARG,
                       "%s: G and the inputs of every requested output are required "
                       "(W: k, beta, Tm; U: v, beta, Tm; KG: k; QG: q)",
                       __func__);
    if (!W && !U && !KG && !QG)
        return DG_OK;
    /* a bf16 v is read as stored by the mma kernel, else through an f32 copy; q, k likewise
     * (kda_cuda_dims.qk_bf16, rq, rk; NULL ones stay NULL) */
    const float *vf = (const float *)v;
    Scratch vs(ctx);
    if (d->leaf_bf16 && v) {
        if (wy_fwd_mma(d, qv, kv, v, G, Tm, W, U, KG, QG))
            return wy_fwd_launch_qk(ctx, d, qv, kv, (const kda_bf16 *)v, beta, G, Tm, W, U, KG, QG);
        DG_TRY(kda_widen(ctx, (const kda_bf16 *)v, d->TT * d->HV * d->V, vs, &vf));
    }
    kda_cuda_dims df = *d; /* v is f32 from here */
    df.leaf_bf16 = 0;
    if (wy_fwd_mma(&df, qv, kv, vf, G, Tm, W, U, KG, QG))
        return wy_fwd_launch_qk(ctx, &df, qv, kv, vf, beta, G, Tm, W, U, KG, QG);
    Scratch qs(ctx), ks(ctx);
    const float *q, *k;
    DG_TRY(kda_qk_widen(ctx, d, qv, kv, qs, ks, &q, &k));
    if (d->mid) /* bf16 intermediates have only the mma kernel */
        return kda_mid_refused(__func__, d);
    /* f32 FFMA: tc == 0, and the sizes, alignments or the 3xTF32 mode the mma kernel does not
     * take */
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    KDA_DISPATCH_BT(d->BT, {
        kda_wy_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, d->V, q, k, vf, beta, G, Tm, (float *)W,
            (float *)U, (float *)KG, (float *)QG);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

/* Whether wy_cols_mma_kernel's column-pair accesses are aligned: 8 bytes for f32 arrays, 4 for
 * bf16 ones (the row lengths K, V are multiples of 4 there, so the bases decide). */
static bool wy_pairs_aligned(const void *q, const void *k, bool qk_bf16, const void *G,
                             const void *dKG, const void *dQG, const void *dq, const void *dk,
                             const void *dG, const void *v, const void *vb, const void *dv,
                             const void *dvb, const void *dTm) {
    auto al = [](const void *p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; };
    const uintptr_t qa = qk_bf16 ? 4 : 8;
    return al(q, qa) && al(k, qa) && al(G, 8) && al(dKG, 8) && al(dQG, 8) && al(dq, 8) &&
           al(dk, 8) && al(dG, 8) && al(v, 8) && al(vb, 4) && al(dv, 8) && al(dvb, 4) && al(dTm, 8);
}

/* q, k as dd says (kda_cuda_dims.qk_bf16, rq, rk): the column kernels read them elementwise in
 * any form; the FFMA dTm kernel takes f32 rows. */
template <int BT>
static dg_status wy_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, const void *q, const void *k,
                           const float *v, const kda_bf16 *vb, const float *beta, const float *G,
                           const float *Tm, const float *dW, const float *dU, const float *dKG,
                           const float *dQG, float *dq, float *dk, float *dv, kda_bf16 *dvb,
                           float *dbeta, float *dG, float *dTm, unsigned acc) {
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
    const QkIn qi = qk_in(q, dd->rq, dd->qk_bf16), ki = qk_in(k, dd->rk, dd->qk_bf16);
    if (vb || (dd->tc == 1 && d.K % 4 == 0 && d.V % 4 == 0 && aligned16(Tm) && aligned16(dW) &&
               aligned16(dU) && aligned16(G) &&
               wy_pairs_aligned(q, k, qi.bf16, G, dKG, dQG, dqv, dkv, dG, v, vb, dv, dvb, dTm))) {
        /* columns and dTm in one kernel (vb: the caller has checked the same) */
        const size_t smem = sizeof(float) * ((size_t)BT * (BT + 8 + 2 * kdamma::AB_LDB) +
                                             (size_t)(BT > 64 ? BT : 64) * kdamma::AB_LDB);
        const dim3 grid((unsigned)d.NC, d.HV);
        if (qi.bf16) {
            DG_TRY(smem_opt_in(wy_cols_mma_kernel<BT, kda_bf16>, smem));
            wy_cols_mma_kernel<BT, kda_bf16>
                <<<grid, kdamma::AB_THREADS, smem, s>>>(d, qi, ki, v, vb, beta, G, Tm, dW, dU, dKG,
                                                        dQG, dqv, dkv, dv, dvb, dG, dbp, dTm, kacc);
        } else {
            DG_TRY(smem_opt_in(wy_cols_mma_kernel<BT, float>, smem));
            wy_cols_mma_kernel<BT, float>
                <<<grid, kdamma::AB_THREADS, smem, s>>>(d, qi, ki, v, vb, beta, G, Tm, dW, dU, dKG,
                                                        dQG, dqv, dkv, dv, dvb, dG, dbp, dTm, kacc);
        }
        DG_CHECK_LAUNCH();
    } else {
        const dim3 grid((unsigned)d.NC, d.HV, nkt + nvt);
        if (qi.bf16)
            wy_cols_kernel<BT, kda_bf16><<<grid, NTH, 0, s>>>(
                d, qi, ki, v, beta, G, Tm, dW, dU, dKG, dQG, dqv, dkv, dv, dG, dbp, kacc);
        else
            wy_cols_kernel<BT, float><<<grid, NTH, 0, s>>>(d, qi, ki, v, beta, G, Tm, dW, dU, dKG,
                                                           dQG, dqv, dkv, dv, dG, dbp, kacc);
        DG_CHECK_LAUNCH();
        if (dTm) { /* f32 k rows for the FFMA dTm kernel */
            const float *kf = static_cast<const float *>(k);
            Scratch qs(ctx), ks(ctx);
            if (kda_qk_special(dd)) {
                const float *unused;
                DG_TRY(kda_qk_widen(ctx, dd, nullptr, k, qs, ks, &unused, &kf));
            }
            wy_dtm_kernel<BT>
                <<<dim3((unsigned)d.NC, d.HV), NTH, 0, s>>>(d, kf, v, beta, G, dW, dU, dTm);
            DG_CHECK_LAUNCH();
        }
    }
    if (per_hv && dq)
        DG_TRY(kda_sum_parts(ctx, dq, dqv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DQ));
    if (per_hv && dk)
        DG_TRY(kda_sum_parts(ctx, dk, dkv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DK));
    if (dbeta)
        DG_TRY(kda_sum_parts(ctx, dbeta, dbp, d.TT * d.HV, 1, 1, 1, nkt + nvt, d.TT * d.HV, 0));
    return DG_OK;
}

extern "C" dg_status dg__kda_wy_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, const void *q,
                                         const void *k, const void *v, const float *beta,
                                         const float *G, const float *Tm, const float *dW,
                                         const float *dU, const float *dKG, const float *dQG,
                                         float *dq, float *dk, void *dvv, float *dbeta, float *dG,
                                         float *dTm, unsigned acc) {
    DG_TRY(check_dims("dg__kda_wy_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    /* a bf16 v is read as stored, and a bf16 dv written as stored, when both mma kernels run;
     * else through f32 copies */
    const float *vf = (const float *)v;
    const kda_bf16 *vb = nullptr;
    float *dv = d->leaf_bf16 ? nullptr : (float *)dvv;
    kda_bf16 *dvb = nullptr;
    const int64_t nv = d->TT * d->HV * d->V;
    Scratch vs(ctx), dvs(ctx);
    if (d->leaf_bf16) {
        const bool as_stored = d->tc == 1 && d->K % 4 == 0 && d->V % 8 == 0 && aligned16(Tm) &&
                               aligned16(dW) && aligned16(dU) && aligned16(k) && aligned16(G) &&
                               (!v || aligned16(v)) &&
                               wy_pairs_aligned(q, k, d->qk_bf16, G, dKG, dQG, dq, dk, dG, nullptr,
                                                v, nullptr, dvv, dTm);
        if (v && as_stored)
            vb = (const kda_bf16 *)v;
        else if (v)
            DG_TRY(kda_widen(ctx, (const kda_bf16 *)v, nv, vs, &vf));
        if (vb)
            vf = nullptr;
        if (dvv && as_stored && v) /* (the mma kernel, which writes it, runs with vb) */
            dvb = (kda_bf16 *)dvv;
        else if (dvv) {
            DG_TRY(dvs.alloc((size_t)nv));
            dv = dvs.f();
        }
    }
    dg_status st;
    switch (d->BT) {
    case 16:
        st = wy_bwd_bt<16>(ctx, d, q, k, vf, vb, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dvb,
                           dbeta, dG, dTm, acc);
        break;
    case 32:
        st = wy_bwd_bt<32>(ctx, d, q, k, vf, vb, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dvb,
                           dbeta, dG, dTm, acc);
        break;
    default:
        st = wy_bwd_bt<64>(ctx, d, q, k, vf, vb, beta, G, Tm, dW, dU, dKG, dQG, dq, dk, dv, dvb,
                           dbeta, dG, dTm, acc);
    }
    if (st == DG_OK && d->leaf_bf16 && dvv && !dvb)
        st = kda_narrow(ctx, dv, nv, (kda_bf16 *)dvv);
    return st;
}
