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
 * Kernels (f32 FFMA, accurate expf):
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
 *            shared memory 6 x BT x 32 + 4 x BT x BT floats (112 KB at BT = 64, opted in).
 * Tensor cores, forward, for bf16 leaves where dplr_mma_fits (K, V % 8 == 0):
 * dplr_intra_fwd_mma_kernel, block per (chunk, head). The diagonal 16 x 16 blocks exactly as above
 * (FFMA, accurate expf, a thread per element of their lower triangles, key tiles of 32 staged);
 * every block below the diagonal, (I, J) with J < I, as mma.sync 3xTF32 products (about f32
 * accuracy) of operands factorised around the last row j1 of block J: x_ij = exp(Gi_i - Gi_j1)
 * exp(Gi_j1 - Gi_j),  x'_ij = exp(Ge_i - Gi_j1) exp(Gi_j1 - Gi_j) Both factors are <= 1 (i > j1 >=
 * j, the cumsums fall), so nothing overflows, and a factor that underflows stands for a term below
 * e^-87 of |q_i| |k_j|. Per J the rows below block J (q and a scaled by the first factors) and
 * block J's k and b (scaled by the second, stored transposed) are staged 64 key columns at a time;
 * warp tasks are (I, product, 8-column half). Then the solve as above. Dynamic shared memory: 6 x
 * BT x 33 floats of key tiles (reused by the staged operands and the solve's Tab) + BT x BT for Aab
 * (66 KB at BT = 64). Entry points (dplr_cuda.h): dg__dplr_intra_fwd_cuda, dg__dplr_intra_bwd_cuda.
 */
#include "../kda/mma.cuh"
#include "common.cuh"

#include <math.h>

using namespace kdab;

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
                    const float x1 = qi[ra] * expf(d1), x2 = ai[ra] * expf(d2);
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

/* grid (NC, H); dynamic shared memory intra_fwd_mma_smem<BT>() floats (see the file comment). */
namespace {
constexpr int IMMA_KT = 32;  /* key tile of the diagonal blocks' FFMA pass */
constexpr int IMMA_KC = 64;  /* key columns staged per step of the off-diagonal products */
constexpr int IMMA_LDQ = 68; /* rows of the scaled q, a: KC + 4 (fragment reads hit 4g + t) */
constexpr int IMMA_LDB = 24; /* rows of the transposed k, b: 16 + 8 (banks 8t + g) */
} // namespace
template <int BT> constexpr int intra_fwd_mma_smem() {
    constexpr int tiles = 6 * BT * (IMMA_KT + 1);
    constexpr int ops = 2 * IMMA_KC * IMMA_LDB + 2 * (BT - 16) * IMMA_LDQ;
    static_assert(tiles >= ops && tiles >= BT * BT, "the tile region holds the staged operands");
    return tiles + BT * BT;
}

template <int BT>
__global__ void __launch_bounds__(NTH)
    dplr_intra_fwd_mma_kernel(Dims d, float scale, const kda_bf16 *__restrict__ q,
                              const kda_bf16 *__restrict__ k, const kda_bf16 *__restrict__ a,
                              const kda_bf16 *__restrict__ b, const float *__restrict__ Gi,
                              const float *__restrict__ Ge, float *__restrict__ Aqk,
                              float *__restrict__ Aqb, float *__restrict__ Aak,
                              float *__restrict__ Tab) {
    constexpr int R = BT / 16, KT = IMMA_KT, LD = KT + 1, NE = R * 136; /* diagonal entries */
    constexpr int EPT = (NE + NTH - 1) / NTH, KC = IMMA_KC, LDQ = IMMA_LDQ, LDB = IMMA_LDB;
    extern __shared__ float imma_smem[];
    float *const tiles = imma_smem, *const Ab = imma_smem + 6 * BT * LD; /* Aab [BT][BT] */
    float *qs = tiles, *as = qs + BT * LD, *gis = as + BT * LD, *ges = gis + BT * LD;
    float *ks = ges + BT * LD, *bs = ks + BT * LD;

    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H, K = d.K;
    const int64_t t0 = d.chunk_t0[c], rk = (int64_t)H * K, ra = (int64_t)H * BT;
    const int64_t ob = (t0 * H + h) * K, oa = (t0 * H + h) * BT;
    const int L = d.chunk_len[c];
    const int tid = threadIdx.x;

    for (int idx = tid; idx < BT * BT; idx += NTH) {
        const int i = idx / BT, j = idx % BT;
        Ab[idx] = 0.f;
        if (i < L && j > i) { /* above the diagonal: zeros (Aak's diagonal: below) */
            Aqk[oa + i * ra + j] = 0.f;
            Aqb[oa + i * ra + j] = 0.f;
            Aak[oa + i * ra + j] = 0.f;
        }
    }

    /* the diagonal blocks' lower triangles, entry e -> block e / 136, (il, jl) with jl <= il */
    int ei[EPT], ej[EPT];
    float acc[EPT][4];
#pragma unroll
    for (int n = 0; n < EPT; n++) {
        const int e = tid + n * NTH, blk = e / 136;
        int rem = e % 136, il = 0;
        while (rem > il) {
            rem -= il + 1;
            il++;
        }
        ei[n] = e < NE ? 16 * blk + il : BT; /* BT: no entry */
        ej[n] = 16 * blk + rem;
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }
    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        __syncthreads(); /* the previous tile has been read */
        for (int idx = tid; idx < BT * KT; idx += NTH) {
            const int i = idx / KT, e = idx % KT;
            const bool ok = i < L && kt0 + e < K;
            const int64_t o = ob + i * rk + kt0 + e;
            qs[i * LD + e] = ok ? kda_ld(q + o) : 0.f;
            as[i * LD + e] = ok ? kda_ld(a + o) : 0.f;
            ks[i * LD + e] = ok ? kda_ld(k + o) : 0.f;
            bs[i * LD + e] = ok ? kda_ld(b + o) : 0.f;
            gis[i * LD + e] = ok ? Gi[o] : 0.f;
            ges[i * LD + e] = ok ? Ge[o] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int n = 0; n < EPT; n++) {
            const int i = ei[n], j = ej[n];
            if (i >= L)
                continue;
            const float *qi = qs + i * LD, *ai = as + i * LD, *gi = gis + i * LD;
            const float *gei = ges + i * LD, *kj = ks + j * LD, *bj = bs + j * LD;
            const float *gj = gis + j * LD;
            float s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f;
            if (j < i) {
#pragma unroll 4
                for (int e = 0; e < KT; e++) {
                    const float x1 = qi[e] * expf(gi[e] - gj[e]);
                    const float x2 = ai[e] * expf(gei[e] - gj[e]);
                    s1 += x1 * kj[e];
                    s2 += x1 * bj[e];
                    s3 += x2 * kj[e];
                    s4 += x2 * bj[e];
                }
            } else { /* j == i: exp(0) = 1; Aak, Aab are strict */
#pragma unroll 4
                for (int e = 0; e < KT; e++) {
                    s1 += qi[e] * kj[e];
                    s2 += qi[e] * bj[e];
                }
            }
            acc[n][0] += s1;
            acc[n][1] += s2;
            acc[n][2] += s3;
            acc[n][3] += s4;
        }
    }
#pragma unroll
    for (int n = 0; n < EPT; n++) {
        const int i = ei[n], j = ej[n];
        if (i >= L)
            continue;
        const int64_t o = oa + i * ra + j;
        Aqk[o] = scale * acc[n][0];
        Aqb[o] = scale * acc[n][1];
        Aak[o] = j < i ? acc[n][2] : 0.f;
        Ab[i * BT + j] = j < i ? acc[n][3] : 0.f;
    }

    /* the blocks below the diagonal, by column block J */
    float *const KtT = tiles, *const BtT = KtT + KC * LDB; /* [KC][LDB]: k, b of block J */
    float *const Qt = BtT + KC * LDB, *const At = Qt + (BT - 16) * LDQ; /* [BT - 16][LDQ] */
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    auto none = [](int, int) { return false; };
    for (int J = 0; J < R - 1 && 16 * (J + 1) < L; J++) {
        const int j0 = 16 * J, j1 = j0 + 15, i0 = j0 + 16, NI = BT - i0;
        const int ntask = (R - 1 - J) * 8; /* (I block, product, column half) */
        float pacc[3][4] = {};
        for (int kc = 0; kc < K; kc += KC) {
            __syncthreads(); /* the previous operands (or tiles) have been read */
            for (int idx = tid; idx < KC * 16; idx += NTH) {
                const int jl = idx / KC, e = idx % KC, j = j0 + jl, x = kc + e;
                float kv = 0.f, bv = 0.f;
                if (j < L && x < K) {
                    const float f = expf(Gi[ob + j1 * rk + x] - Gi[ob + j * rk + x]);
                    kv = kda_ld(k + ob + j * rk + x) * f;
                    bv = kda_ld(b + ob + j * rk + x) * f;
                }
                KtT[e * LDB + jl] = kv;
                BtT[e * LDB + jl] = bv;
            }
            for (int idx = tid; idx < NI * KC; idx += NTH) {
                const int il = idx / KC, e = idx % KC, i = i0 + il, x = kc + e;
                float qv = 0.f, av = 0.f;
                if (i < L && x < K) {
                    const float gr = Gi[ob + j1 * rk + x];
                    const int64_t o = ob + i * rk + x;
                    qv = kda_ld(q + o) * expf(Gi[o] - gr);
                    av = kda_ld(a + o) * expf(Ge[o] - gr);
                }
                Qt[il * LDQ + e] = qv;
                At[il * LDQ + e] = av;
            }
            __syncthreads();
#pragma unroll
            for (int n = 0; n < 3; n++) {
                const int task = warp + 8 * n;
                if (task >= ntask)
                    continue;
                const int Ib = task >> 3, p = (task >> 1) & 3, nh = task & 1;
                const float *A = (p < 2 ? Qt : At) + 16 * Ib * LDQ;
                const float *B = ((p & 1) == 0 ? KtT : BtT) + 8 * nh;
                kdamma::mm16x8_3x<LDQ, LDB>(pacc[n], A, B, 0, KC, none, none);
            }
        }
#pragma unroll
        for (int n = 0; n < 3; n++) {
            const int task = warp + 8 * n;
            if (task >= ntask)
                continue;
            const int Ib = task >> 3, p = (task >> 1) & 3, nh = task & 1;
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int i = i0 + 16 * Ib + g + 8 * (x >> 1), j = j0 + 8 * nh + 2 * t + (x & 1);
                if (i >= L)
                    continue;
                const int64_t o = oa + i * ra + j;
                const float v = pacc[n][x];
                if (p == 0)
                    Aqk[o] = scale * v;
                else if (p == 1)
                    Aqb[o] = scale * v;
                else if (p == 2)
                    Aak[o] = v;
                else
                    Ab[i * BT + j] = v;
            }
        }
    }
    __syncthreads(); /* Ab complete; the tile region is free */

    float *const Ts = tiles; /* Tab of the chunk, row stride BT */
    if (tid < L) {           /* column j: T[j,j] = 1, T[i,j] = sum_{m=j}^{i-1} Aab[i,m] T[m,j] */
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
        Tab[oa + i * ra + j] = j < i ? Ts[i * BT + j] : (j == i ? 1.f : 0.f);
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
    extern __shared__ float sm[];
    float(*sq)[CT] = (float(*)[CT])sm;
    float(*sk)[CT] = sq + BT;
    float(*sa)[CT] = sk + BT;
    float(*sb)[CT] = sa + BT;
    float(*sgi)[CT] = sb + BT;
    float(*sge)[CT] = sgi + BT;
    float(*g1)[BT] = (float(*)[BT])(sm + 6 * BT * CT);
    float(*g2)[BT] = g1 + BT;
    float(*g3)[BT] = g2 + BT;
    float(*g4)[BT] = g3 + BT;

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
    dplr::load_square<BT, BT>(&g1[0][0], dAqk, t0, L, H, h, dplr::LOWER, scale);
    dplr::load_square<BT, BT>(&g2[0][0], dAqb, t0, L, H, h, dplr::LOWER, scale);
    dplr::load_square<BT, BT>(&g3[0][0], dAak, t0, L, H, h, dplr::STRICT);
    dplr::load_square<BT, BT>(&g4[0][0], dAab, t0, L, H, h, dplr::STRICT);
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    for (int r = w; r < L; r += NW) { /* r is the same for the whole warp */
        const float gir = sgi[r][lane], ger = sge[r][lane];
        /* row side: r as the row i of the pairs */
        float rq = 0.f, ra = 0.f;
        for (int j = 0; j <= r; j++) {
            const float x = expf(gir - sgi[j][lane]);
            rq += (g1[r][j] * sk[j][lane] + g2[r][j] * sb[j][lane]) * x;
        }
        for (int j = 0; j < r; j++) {
            const float x = expf(ger - sgi[j][lane]);
            ra += (g3[r][j] * sk[j][lane] + g4[r][j] * sb[j][lane]) * x;
        }
        /* column side: r as the column j of the pairs */
        float ck = 0.f, cb = 0.f;
        for (int i = r; i < L; i++) {
            const float qx = sq[i][lane] * expf(sgi[i][lane] - gir);
            ck += g1[i][r] * qx;
            cb += g2[i][r] * qx;
        }
        for (int i = r + 1; i < L; i++) {
            const float ax = sa[i][lane] * expf(sge[i][lane] - gir);
            ck += g3[i][r] * ax;
            cb += g4[i][r] * ax;
        }
        if (e < K) {
            const int64_t o = ((t0 + r) * H + h) * K + e;
            dq[o] = rq;
            da[o] = ra;
            dk[o] = ck;
            db[o] = cb;
            dGi[o] = sq[r][lane] * rq - sk[r][lane] * ck - sb[r][lane] * cb;
            dGe[o] = sa[r][lane] * ra;
        }
    }
}

// ---- launchers

template <int BT, class TI>
static dg_status intra_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                             const void *k, const void *a, const void *b, const float *Gi,
                             const float *Ge, float *Aqk, float *Aqb, float *Aak, float *Tab) {
    if (sizeof(TI) == 2 && dplr_mma_fits(d, {})) {
        const size_t smem = sizeof(float) * intra_fwd_mma_smem<BT>();
        DG_TRY(smem_opt_in(dplr_intra_fwd_mma_kernel<BT>, smem));
        dplr_intra_fwd_mma_kernel<BT><<<dim3((unsigned)d->NC, d->H), NTH, smem, dg__stream(ctx)>>>(
            make_dims(d), scale, (const kda_bf16 *)q, (const kda_bf16 *)k, (const kda_bf16 *)a,
            (const kda_bf16 *)b, Gi, Ge, Aqk, Aqb, Aak, Tab);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
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
    const size_t smem = sizeof(float) * (6 * BT * CT + 4 * BT * BT);
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
