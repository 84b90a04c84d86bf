/*
 * kernels/kda/intra.cu -- N4, the intra-chunk matrices (kda.md §11.4(b)-(c) forward; §11.6 B3
 * last line and B4 backward); CPU twins: dg__kda_intra_fwd_f32 / dg__kda_intra_bwd_f32 in
 * ops/kda/intra.c.
 *
 * Forward, per chunk and value head:
 *   Araw[i,j] = sum_d q_i k_j exp(G_i - G_j) (j <= i),  Aqk = s Araw
 *   P[i,j]    = sum_d k_i k_j exp(G_i - G_j) (j <  i),  Tm = (I + Diag(beta) P)^{-1}
 * Backward, rows i, j < L, with x_ij = exp(G_i - G_j) (per key dim, j <= i):
 *   dLkk = -stril(Tm^T dTm Tm^T):  X1 = stril(dTm) Tm^T,  dLkk[i,j] = -sum_m Tm[m,i] X1[m,j]
 *   dA = s dAqk,  dP[i,j] = beta_i dLkk[i,j]
 *   dq_i  = sum_{j<=i} dA[i,j] k_j x_ij                                  (Rq)
 *   dk_i  = beta_i sum_{j<i} dLkk[i,j] k_j x_ij                          (Rk = beta_i RL_i)
 *         + sum_{m>=i} dA[m,i] q_m x_mi + sum_{m>i} dP[m,i] k_m x_mi    (Cq + Ck)
 *   dG_i  = q_i Rq_i + k_i Rk_i - k_i (Cq_i + Ck_i)
 *   dbeta_i = sum_{j<i} dLkk[i,j] P[i,j] = sum_d k_i RL_i     (P expanded: no extra L*L*K pass)
 * Layouts (flat tokens TT, see kda_cuda.h): q, k [TT,H,K]; G, dG [TT,HV,K]; beta [TT,HV]; Aqk,
 * Tm and their gradients [TT,HV,BT]. Value head hv reads q/k head hv / (HV/H).
 * Stability (kda.md §11.7): exponents are only formed for j <= i, where G_i - G_j <= 0; the upper
 * triangle is masked in the exponent (exp(-inf) = 0), so -40/step gates stay finite. Whole rows
 * of Aqk and Tm are written for the L valid tokens of a chunk (zeros above the diagonal and
 * beyond L, ones on Tm's diagonal), exactly like the CPU reference.
 *
 * Variants (the tc mode of kda_cuda_dims, kda_cuda.h):
 *   tc == 0, f32 FFMA (pinned to the CPU f32 reference within 1e-5, accurate expf):
 *     forward  kda_intra_fwd_kernel: block per (chunk, hv), the key dim in tiles of 32, the
 *              solve by forward substitution, one thread per column (kda_intra_finish);
 *     backward (1) intra_dl_kernel: block per (chunk, hv), dLkk into a scratch [TT,HV,BT] (the
 *              L^3 part, done once per chunk); (2) intra_main_kernel: block per (chunk, hv,
 *              32-wide key tile); lane = key dim, warp w = rows w, w+8, ...; each thread forms its
 *              row side (j <= r) and column side (m >= r) sums, so no reduction crosses threads
 *              except dbeta's sum over d (warp butterfly per tile, then the tiles in a fixed
 *              order).
 *   tc != 0, tensor cores (the hardware exponential kdamma::exp_ftz, far below the TF32 operand
 * rounding): forward  intra_fwd_mma_kernel: mma.sync m16n8k8 on exponent-factorised operands, warp
 * = whole 16 x 16 blocks over every key column (a diagonal block, or up to two off-diagonal ones
 * of a block row); off-diagonal blocks around the block row's first row, TF32 (tc == 1) or 3xTF32
 * (tc == 2) (kda.md §11.7 rule 2); diagonal blocks 3xTF32 around their middle rows when the gates
 * allow (MID_SPAN, decided per 8 key columns), else exact FFMA; the solve by 16 x 16 blocks
 * (intra_diag_inverse, then intra_merge_blocks on mma.sync 3xTF32); backward intra_dl_mma_kernel
 * and intra_main_mma_kernel: the same sums as mma.sync 3xTF32 products (tc == 1 and 2: the sums of
 * these gradients feed dA_log's long sums, where TF32 rounding showed). dq, dk are produced per
 * value head and summed over the G heads of a group by kda_sum_parts (deterministic GVA reduction);
 * with G = 1 they are written in place (acc: added to what the arrays hold, KDA_ACC_*). Shared
 * memory: intra_dl 2 x BT x (BT+1) floats (33 KB at BT = 64); intra_main (3 x BT x 32 + 2 x BT x BT
 * + BT) floats (56 KB at BT = 64, dynamic, opted in); intra_main_mma (3 x BT x 72 + 2 x BT x (BT+4)
 * + 3 x BT) floats (90 KB at BT = 64); intra_fwd_mma two stages of q, k, G key tiles, overlaid
 * by the solve's arrays, plus row scales and scratch (47 KB at BT = 64 for bf16 q, k; 63 KB for
 * f32), dynamic. Entry points (kda_cuda.h): dg__kda_intra_fwd_cuda,
 * dg__kda_intra_bwd_cuda.
 */
#include "common.cuh"
#include "mma.cuh"

#include <math.h>

using namespace kdab;

// ---- device helpers

namespace {
/* Largest |G_j - G_mid| (rows of a 16-row block against its middle row) for which the intra
 * kernels factorise the block's diagonal exponentials around the middle row: factors up to
 * e^40 ~ 2e17 keep every product far inside f32 range, and a factor that underflows stands only
 * for terms below e^-47 of the diagonal's. Checked per key column from the data. */
constexpr float MID_SPAN = 40.f;
} // namespace

/* acc += A B on one warp's 16 x 8 tile in 3xTF32 (about f32 accuracy), k over [k0, k1) in
 * steps of 8: A row-major at A (row r, column k at A[r * LDA + k]), B row-major at B (row k,
 * column n at B[k * LDB + n]); za(r, k) / zb(k, n) say which elements count as zero (the
 * unwritten blocks above a triangle's diagonal). The block solve's merge products. */
template <int LDA, int LDB, class ZA, class ZB>
__device__ __forceinline__ void mm16x8_3x(float (&acc)[4], const float *A, const float *B, int k0,
                                          int k1, ZA za, ZB zb) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = k0; k < k1; k += 8) {
        unsigned ah[4], al[4], bh0, bl0, bh1, bl1;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = g + 8 * (x & 1), c = k + t + 4 * (x >> 1);
            kdamma::tf32_split(za(r, c) ? 0.f : A[r * LDA + c], ah[x], al[x]);
        }
        kdamma::tf32_split(zb(k + t, g) ? 0.f : B[(k + t) * LDB + g], bh0, bl0);
        kdamma::tf32_split(zb(k + t + 4, g) ? 0.f : B[(k + t + 4) * LDB + g], bh1, bl1);
        kdamma::mma_3xtf32(acc, ah, al, bh0, bh1, bl0, bl1);
    }
}

/* Stores a warp's 16 x 8 accumulator tile times s at D (row-major, leading dimension LD). */
template <int LD> __device__ __forceinline__ void st16x8(const float (&acc)[4], float *D, float s) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    D[g * LD + 2 * t] = s * acc[0];
    D[g * LD + 2 * t + 1] = s * acc[1];
    D[(g + 8) * LD + 2 * t] = s * acc[2];
    D[(g + 8) * LD + 2 * t + 1] = s * acc[3];
}

/* Ts = (I + Ls)^{-1} (the tensor-core forward's solve) for the strictly lower triangular BT x
 * BT matrix Ls (leading dimension LD; rows past L zero, so those rows of Ts come out as the
 * identity's), once the diagonal 16 x 16 blocks T_II = (I + L_II)^{-1} are in Ts (intra_fwd_mma
 * inverts them: intra_diag_inverse). The other blocks by doubling, on mma.sync 3xTF32:
 *   level 1, pairs (a, b) = (2p, 2p + 1):  X = L_ba T_aa,  T_ba = -T_bb X
 *   level 2 (BT = 64), 32-row halves:      X = L_[23][01] T_[01],  T_[23][01] = -T_[23] X
 * where T_[01] is the inverse of the top-left 32 x 32 corner that level 1 completed. Blocks of
 * Ts above the diagonal are never written: the products read them as zeros. Four barriers;
 * Xs: 32 x (32 + 4) floats of scratch. Needs 2 * BT / 16 warps (level 1 uses BT / 16 of them). */
template <int BT, int LD>
__device__ __forceinline__ void intra_merge_blocks(const float *Ls, float *Ts, float *Xs) {
    constexpr int R = BT / 16, LDX = 36;
    const int w = threadIdx.x >> 5;
    auto none = [](int, int) { return false; };
    if (R >= 2) {
        const int p = w / 2, n = w % 2, a = 2 * p, b = a + 1;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (w < R)
            mm16x8_3x<LD, LD>(acc, Ls + 16 * b * LD + 16 * a, Ts + 16 * a * LD + 16 * a + 8 * n, 0,
                              16, none, none);
        if (w < R)
            st16x8<LDX>(acc, Xs + 16 * p * LDX + 8 * n, 1.f);
        __syncthreads();
        if (w < R) {
            float acc2[4] = {0.f, 0.f, 0.f, 0.f};
            mm16x8_3x<LD, LDX>(acc2, Ts + 16 * b * LD + 16 * b, Xs + 16 * p * LDX + 8 * n, 0, 16,
                               none, none);
            st16x8<LD>(acc2, Ts + 16 * b * LD + 16 * a + 8 * n, -1.f);
        }
        __syncthreads();
    }
    if (R == 4) { /* warp w: rows 32 + 16 m, columns 8 n of the bottom-left 32 x 32 quarter */
        const int m = w / 4, n = w % 4;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        /* B = T_[01]: block (0, 1) (rows < 16, columns >= 16) is zero, so for n >= 2 the sum
         * starts at k = 16 */
        mm16x8_3x<LD, LD>(acc, Ls + (32 + 16 * m) * LD, Ts + 8 * n, n >= 2 ? 16 : 0, 32, none,
                          [n](int k, int) { return (n >> 1) > (k >> 4); });
        st16x8<LDX>(acc, Xs + 16 * m * LDX + 8 * n, 1.f);
        __syncthreads();
        /* A = T_[23], rows of block 2 + m: block (2, 3) is zero, so for m = 0 the sum ends at 16 */
        float acc2[4] = {0.f, 0.f, 0.f, 0.f};
        mm16x8_3x<LD, LDX>(
            acc2, Ts + (32 + 16 * m) * LD + 32, Xs + 8 * n, 0, m == 0 ? 16 : 32,
            [m](int, int k) { return (k >> 4) > m; }, none);
        st16x8<LD>(acc2, Ts + (32 + 16 * m) * LD + 8 * n, -1.f);
        __syncthreads();
    }
}

/* T_II = (I + L_II)^{-1} for one diagonal 16 x 16 block (rows and columns o .. o + 15) of the
 * strictly lower Ls into Ts (both leading dimension LD), by forward substitution: lanes 0 .. 15
 * of the calling warp, one column each (a chain of at most 120 FMAs); the whole block is written,
 * zeros above the diagonal and ones on it. */
template <int LD>
__device__ __forceinline__ void intra_diag_inverse(const float *Ls, float *Ts, int o) {
    const int c = threadIdx.x & 31;
    if (c >= 16)
        return;
    float col[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        float s = 0.f;
#pragma unroll
        for (int m = 0; m < i; m++)
            s += m >= c ? Ls[(o + i) * LD + o + m] * col[m] : 0.f;
        col[i] = i < c ? 0.f : (i == c ? 1.f : -s);
    }
#pragma unroll
    for (int i = 0; i < 16; i++)
        Ts[(o + i) * LD + o + c] = col[i];
}

/* The end of the FFMA intra forward kernel: write the L valid rows of Aqk
 * (scaled, j <= i, zeros elsewhere), form Lkk = Diag(beta) P (j < i) in shared memory `Ls`, solve
 * Tm = (I + Lkk)^{-1} by forward substitution into `Ts` (one thread per column, in the CPU's
 * order) and write Tm's rows. accA/accP: this thread's R x R patch (rows ty + 16a, columns
 * tx + 16b) of s-less Araw and P. Ls, Ts: [BT, BT] shared floats. 256 threads (16 x 16). */
template <int BT, int R>
__device__ __forceinline__ void kda_intra_finish(const float (&accA)[R][R],
                                                 const float (&accP)[R][R], float *Ls, float *Ts,
                                                 const float *beta, float *Aqk, float *Tm,
                                                 int64_t t0, int L, int hv, int HV, float scale) {
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
#pragma unroll
    for (int a = 0; a < R; a++) {
        const int i = ty + 16 * a;
        const float bi = i < L ? beta[(t0 + i) * HV + hv] : 0.f;
#pragma unroll
        for (int b = 0; b < R; b++) {
            const int j = tx + 16 * b;
            const bool lower = b < a || (b == a && tx <= ty); /* j <= i */
            if (i < L)
                Aqk[((t0 + i) * HV + hv) * BT + j] = lower ? scale * accA[a][b] : 0.f;
            Ls[i * BT + j] = (lower && j != i) ? bi * accP[a][b] : 0.f;
        }
    }
    __syncthreads();

    if (tid < L) {
        const int j = tid;
        Ts[j * BT + j] = 1.f;
        for (int i = j + 1; i < L; i++) {
            float s = 0.f;
            for (int m = j; m < i; m++)
                s += Ls[i * BT + m] * Ts[m * BT + j];
            Ts[i * BT + j] = -s;
        }
    }
    __syncthreads();

    for (int idx = tid; idx < L * BT; idx += KDA_THREADS) {
        const int i = idx / BT, j = idx % BT;
        Tm[((t0 + i) * HV + hv) * BT + j] = j < i ? Ts[i * BT + j] : (j == i ? 1.f : 0.f);
    }
}

/* The 3xTF32 halves of an m16n8k8 A fragment read from a row-major shared tile: frag_rows at
 * p = &M[m0 + g][k0 + t] (A = M), frag_cols at p = &M[k0 + t][m0 + g] (A = M^T). */
template <int LD>
__device__ __forceinline__ void frag_rows(const float *p, unsigned (&hi)[4], unsigned (&lo)[4]) {
    kdamma::tf32_split(p[0], hi[0], lo[0]);
    kdamma::tf32_split(p[8 * LD], hi[1], lo[1]);
    kdamma::tf32_split(p[4], hi[2], lo[2]);
    kdamma::tf32_split(p[8 * LD + 4], hi[3], lo[3]);
}
template <int LD>
__device__ __forceinline__ void frag_cols(const float *p, unsigned (&hi)[4], unsigned (&lo)[4]) {
    kdamma::tf32_split(p[0], hi[0], lo[0]);
    kdamma::tf32_split(p[8], hi[1], lo[1]);
    kdamma::tf32_split(p[4 * LD], hi[2], lo[2]);
    kdamma::tf32_split(p[4 * LD + 8], hi[3], lo[3]);
}

// ---- forward kernels

/* One block of 256 threads per (chunk, value head); blockIdx.x = chunk, blockIdx.y = hv.
 * Thread (ty, tx) = (tid / 16, tid % 16) owns rows i = ty + 16a and columns j = tx + 16b
 * (a, b < BT/16) of both [BT,BT] matrices; the key dim is walked in tiles of 32 staged in shared
 * memory (rows padded to 33 floats: the 16 column reads of a half-warp hit 16 banks).
 * Tm: forward substitution in shared memory, one thread per column j (columns are independent:
 * T[j,j] = 1, T[i,j] = -sum_{m=j}^{i-1} Lkk[i,m] T[m,j]), summed in the CPU's order. */
template <int BT>
__global__ void __launch_bounds__(KDA_THREADS)
    kda_intra_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int H, int HV, int K, float scale,
                         const float *__restrict__ q, const float *__restrict__ k,
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

/* N4 intra forward on tensor cores (kda.md §11.4(b)), grid (chunk, hv), IntraFwd<BT>::NTHR
 * threads. Araw[i,j] = sum_d q_i k_j exp(G_i - G_j) (j <= i) and P[i,j] = sum_d k_i k_j
 * exp(G_i - G_j) (j < i) as mma.sync m16n8k8 products on exponent-factorised operands, then
 * Tm = (I + Diag(beta) P)^{-1}.
 * Work split: each warp owns whole 16 x 16 blocks of both matrices over every key column
 * (intra_task): warp I < R = BT / 16 the diagonal block (I, I), the others the off-diagonal
 * blocks, two of one block row at most (BT = 64: (3,0) + (3,1), (3,2), (2,0) + (2,1), (1,0)).
 * Each warp forms its exponent factors in registers from the staged q, k, G tiles:
 *   off-diagonal blocks (I, J) (kda.md §11.7 rule 2, reference row r = 16 I): A = q_I, k_I times
 *     exp(G_I - G_r), B = k_J times exp(G_r - G_J); both exponents <= 0 (G is non-increasing in
 *     a chunk), clamped at 0 so zero-padded rows past L stay exp(0) times a zero row. TF32
 *     (P = 1) or 3xTF32 (P = 2).
 *   diagonal block I: around the middle row m = min(16 I + 8, L - 1): A factor exp(G_i - G_m),
 *     B factor exp(G_m - G_j), clamped at MID_SPAN, 3xTF32, for every key step whose 8 columns
 *     keep all valid rows of the block within MID_SPAN of row m (a warp vote per step); other
 *     steps add the exact per-pair sums (FFMA, pairs j <= i only; above the diagonal nothing is
 *     stored).
 * The split of a product over d may differ from one key step to the next: both factors of a
 * step go into its own operands. Key tiles of 32 columns of q, k (as stored, f32 or bf16: TQ; the
 * products use the rows as stored, and bf16 rows' scales rq, rk multiply each element of Aqk
 * and Lkk once, after the key loop: both sums are bilinear in the rows) and G are staged by
 * cp.async (16-byte pieces, when K % 4 == 0 and the arrays are 16-byte aligned: vec, which also
 * stores Aqk in pairs and Tm in 16-byte pieces; bf16 q, k come only so) in two stages, so the next
 * tile loads while this one is multiplied. Then each warp writes its blocks of Aqk from its
 * registers and those of Lkk = Diag(beta) P into shared memory; a diagonal warp inverts its block
 * at once (intra_diag_inverse), and intra_merge_blocks completes Tm. Every warp keeps at most four
 * 16 x 8 accumulator tiles of each matrix (32 registers), so that three blocks fit on an SM (MINB).
 * Shared memory (dynamic, IntraFwd::smem): the two stages, which Lkk, Tm and the merge scratch
 * overlay once the key loop is done; after them the row scales and the diagonal warps' scratch
 * for their exact sums. */
struct IntraTask {
    int I, J0, NB; /* row block; first column block, number of blocks (1 or 2); I < 0: none */
    bool D;        /* the diagonal block (I, I) */
};
template <int R> __device__ __forceinline__ IntraTask intra_task(int w) {
    if (w < R)
        return {w, w, 1, true};
    if (R == 2 && w == 2)
        return {1, 0, 1, false};
    if (R == 4) {
        switch (w) {
        case 4:
            return {3, 0, 2, false};
        case 5:
            return {3, 2, 1, false};
        case 6:
            return {2, 0, 2, false};
        case 7:
            return {1, 0, 1, false};
        default:
            break;
        }
    }
    return {-1, 0, 0, false};
}

template <int BT> struct IntraFwd {
    static constexpr int R = BT / 16;               /* row blocks */
    static constexpr int NW = BT == 16 ? 2 : 2 * R; /* warps: the solve's merges use 2 R */
    static constexpr int NTHR = 32 * NW;
    static constexpr int MINB = 768 / NTHR;     /* blocks per SM the registers allow */
    static constexpr int KT = 32, LDG = KT + 4; /* key tile; LD % 32 == 4 (mma.cuh) */
    static constexpr int LDS = BT + 4;          /* Lkk and Tm in shared memory */
    static constexpr int SOLVE = (2 * BT * LDS + 32 * 36) * 4; /* bytes: Lkk, Tm, merge scratch */
    template <class TQ> static constexpr int ldq() { return sizeof(TQ) == 2 ? KT + 8 : KT + 4; }
    /* bytes of one stage: q, k tiles, and the G tile (PR: the bf16 gate input's tile instead) */
    template <class TQ, bool PR = false> static constexpr int stage() {
        return 2 * BT * ldq<TQ>() * (int)sizeof(TQ) +
               (PR ? BT * ldq<kda_bf16>() * 2 : BT * LDG * 4);
    }
    /* bytes: the two stages (PR: and the G tile the prep forms), then the solve's */
    template <class TQ, bool PR = false> static constexpr int body() {
        return 2 * stage<TQ, PR>() + (PR ? BT * LDG * 4 : 0) > SOLVE
                   ? 2 * stage<TQ, PR>() + (PR ? BT * LDG * 4 : 0)
                   : SOLVE;
    }
    /* bytes: + row scales, exact-sum scratch */
    template <class TQ, bool PR = false> static constexpr int smem() {
        return body<TQ, PR>() + 2 * BT * 4 + R * 32 * 16 * 4;
    }
};

/* What the intra forward's prep (PR) computes on behalf of the norm and gate nodes (N1, N3) of
 * one dg_kda_chunk call: G = the chunk-local cumsum of gate(g) from the bf16 gate input, and the
 * reciprocal norms rq, rk of the bf16 q, k rows (kda_intra_prep of kda_cuda.h, whose fields these
 * are). */
struct IntraPrep {
    const kda_bf16 *g;
    const float *A_log, *dt_bias;
    dg_gate_kind kind;
    float lb, eps;
    float *G, *rq, *rk;
};

template <int BT, int P, class TQ, bool PR>
__global__ void __launch_bounds__(IntraFwd<BT>::NTHR, IntraFwd<BT>::MINB)
    intra_fwd_mma_kernel(const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int H, int HV, int K, bool vec,
                         float scale, const TQ *__restrict__ q, const TQ *__restrict__ k,
                         const float *__restrict__ rq, const float *__restrict__ rk,
                         const float *__restrict__ beta, const float *__restrict__ G,
                         float *__restrict__ Aqk, float *__restrict__ Tm, const IntraPrep pp) {
    using F = IntraFwd<BT>;
    constexpr int KT = F::KT, LDQ = F::template ldq<TQ>(), LDG = F::LDG, LDS = F::LDS;
    constexpr int NTHR = F::NTHR, STAGE = F::template stage<TQ, PR>();
    constexpr bool QB = sizeof(TQ) == 2; /* bf16 rows times their scales */
    static_assert(!PR || (QB && NTHR == 4 * BT), "the prep takes bf16 rows, 4 threads per row");
    extern __shared__ __align__(16) unsigned char smb[];
    float *scq = reinterpret_cast<float *>(smb + F::template body<TQ, PR>()), *sck = scq + BT;
    float *fb = sck + BT; /* the diagonal warps' scratch for their exact sums */

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const IntraTask tk = intra_task<F::R>(w);
    const int I = tk.I;
    const bool active = I >= 0 && 16 * I < L; /* a valid row in the block (else its sums are 0) */
    const int i0 = 16 * I + g, mid = min(16 * I + 8, L - 1);
    const TQ *qg = q + (t0 * H + hq) * K, *kg = k + (t0 * H + hq) * K;
    const float *gg = G + (t0 * HV + hv) * K;
    const kda_bf16 *gx = PR ? pp.g + (t0 * HV + hv) * K : nullptr; /* the prep's gate input */
    /* the prep's G tile, formed in shared memory after the two stages */
    float *gp = reinterpret_cast<float *>(smb + 2 * STAGE);

    /* row scales (bf16 rows: q^ = rq q, k^ = rk k) in shared memory. The key loop multiplies the
     * rows as stored; both sums are bilinear in the rows, so the epilogue applies the scales once
     * per element: Araw[i,j] = rq_i rk_j (q_i . k_j x_ij), P[i,j] = rk_i rk_j (k_i . k_j x_ij). */
    auto rscale = [&](const float *r, int row) {
        return QB && r && row < L ? r[(t0 + row) * H + hq] : 1.f;
    };
    if (!PR && tid < BT) {
        scq[tid] = rscale(rq, tid);
        sck[tid] = rscale(rk, tid);
    }
    float ssq = 0.f, ssk = 0.f; /* PR: the sums of squares of row tid / 4, a quarter each */

    float accA[2][2][4], accP[2][2][4]; /* [column block][8-column tile][fragment] */
#pragma unroll
    for (int nb = 0; nb < 2; nb++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int x = 0; x < 4; x++)
                accA[nb][h][x] = accP[nb][h][x] = 0.f;

    auto stq = [&](int b) { return reinterpret_cast<TQ *>(smb + b * STAGE); };
    auto load = [&](int kt, int b) {
        TQ *qs = stq(b), *ks = qs + BT * LDQ;
        float *gs = reinterpret_cast<float *>(ks + BT * LDQ);
        const int k0 = kt * KT;
        if (QB || vec) { /* rows >= L and columns >= K zero-filled */
            constexpr int EQ = 16 / sizeof(TQ), PQ = BT * KT / EQ, PG = BT * KT / 4;
            for (int idx = tid; idx < PQ; idx += NTHR) {
                const int r = idx / (KT / EQ), c = EQ * (idx % (KT / EQ));
                const bool ok = r < L && k0 + c < K;
                const int64_t o = ok ? (int64_t)r * H * K + k0 + c : 0;
                kdamma::cp_async16(qs + r * LDQ + c, qg + o, ok);
                kdamma::cp_async16(ks + r * LDQ + c, kg + o, ok);
                if (PR) /* the gate input's tile (bf16, q's layout) where G's would be */
                    kdamma::cp_async16(reinterpret_cast<kda_bf16 *>(ks + BT * LDQ) + r * LDQ + c,
                                       gx + (ok ? (int64_t)r * HV * K + k0 + c : 0), ok);
            }
            for (int idx = tid; !PR && idx < PG; idx += NTHR) {
                const int r = idx / (KT / 4), c = 4 * (idx % (KT / 4));
                const bool ok = r < L && k0 + c < K;
                kdamma::cp_async16(gs + r * LDG + c, gg + (ok ? (int64_t)r * HV * K + k0 + c : 0),
                                   ok);
            }
        } else { /* f32 q, k only (the launcher's rule) */
            for (int idx = tid; idx < BT * KT; idx += NTHR) {
                const int i = idx / KT, e = idx % KT;
                const bool ok = i < L && k0 + e < K;
                qs[i * LDQ + e] = ok ? qg[(int64_t)i * H * K + k0 + e] : TQ(0.f);
                ks[i * LDQ + e] = ok ? kg[(int64_t)i * H * K + k0 + e] : TQ(0.f);
                gs[i * LDG + e] = ok ? gg[(int64_t)i * HV * K + k0 + e] : 0.f;
            }
        }
    };
    /* q or k at (row, column) of a staged tile, as stored */
    auto rd = [&](const TQ *s, int row, int col) { return kda_ld(s + row * LDQ + col); };

    using kdamma::exp_ftz;
    using kdamma::mma_3xtf32;
    /* one key step of an off-diagonal warp: columns c .. c + 7 */
    auto off_step = [&](const TQ *qs, const TQ *ks, const float *gs, int c) {
        const int e0 = c + t, r = 16 * I;
        const float gr[2] = {gs[r * LDG + e0], gs[r * LDG + e0 + 4]};
        unsigned qh[4], ql[4], kh[4], kl[4];
#pragma unroll
        for (int x = 0; x < 4;
             x++) { /* a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) */
            const int row = i0 + 8 * (x & 1), col = e0 + 4 * (x >> 1);
            const float f = exp_ftz(fminf(gs[row * LDG + col] - gr[x >> 1], 0.f));
            const float qa = rd(qs, row, col), ka = rd(ks, row, col);
            if (P == 1) {
                qh[x] = kdamma::tf32(qa * f);
                kh[x] = kdamma::tf32(ka * f);
            } else {
                kdamma::tf32_split(qa * f, qh[x], ql[x]);
                kdamma::tf32_split(ka * f, kh[x], kl[x]);
            }
        }
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            if (nb >= tk.NB)
                break;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = 16 * (tk.J0 + nb) + 8 * h + g;
                /* b0 (k = t, n = g), b1 (k = t + 4, n = g) */
                const float b0 = rd(ks, j, e0) * exp_ftz(fminf(gr[0] - gs[j * LDG + e0], 0.f));
                const float b1 =
                    rd(ks, j, e0 + 4) * exp_ftz(fminf(gr[1] - gs[j * LDG + e0 + 4], 0.f));
                if (P == 1) {
                    const unsigned bh0 = kdamma::tf32(b0), bh1 = kdamma::tf32(b1);
                    kdamma::mma_tf32(accA[nb][h], qh, bh0, bh1);
                    kdamma::mma_tf32(accP[nb][h], kh, bh0, bh1);
                } else {
                    unsigned bh0, bl0, bh1, bl1;
                    kdamma::tf32_split(b0, bh0, bl0);
                    kdamma::tf32_split(b1, bh1, bl1);
                    mma_3xtf32(accA[nb][h], qh, ql, bh0, bh1, bl0, bl1);
                    mma_3xtf32(accP[nb][h], kh, kl, bh0, bh1, bl0, bl1);
                }
            }
        }
    };
    /* one key step of a diagonal warp */
    auto diag_step = [&](const TQ *qs, const TQ *ks, const float *gs, int c) {
        const int e0 = c + t;
        const float gm[2] = {gs[mid * LDG + e0], gs[mid * LDG + e0 + 4]};
        float ga[4]; /* q and k are read where they are used: fewer live registers */
        bool near = true;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int row = i0 + 8 * (x & 1), col = e0 + 4 * (x >> 1);
            ga[x] = gs[row * LDG + col];
            if (row < L && fabsf(ga[x] - gm[x >> 1]) > MID_SPAN)
                near = false;
        }
        if (__all_sync(0xffffffffu, near)) {
            /* B first (both tiles), then A's halves for Araw and for P in turn: fewer live
             * registers */
            unsigned bh[2][2], bl[2][2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = 16 * I + 8 * h + g;
                const float b0 = rd(ks, j, e0) * exp_ftz(fminf(gm[0] - gs[j * LDG + e0], MID_SPAN));
                const float b1 =
                    rd(ks, j, e0 + 4) * exp_ftz(fminf(gm[1] - gs[j * LDG + e0 + 4], MID_SPAN));
                kdamma::tf32_split(b0, bh[h][0], bl[h][0]);
                kdamma::tf32_split(b1, bh[h][1], bl[h][1]);
            }
            float f[4];
#pragma unroll
            for (int x = 0; x < 4; x++)
                f[x] = exp_ftz(fminf(ga[x] - gm[x >> 1], MID_SPAN));
            unsigned ah[4], al[4];
#pragma unroll
            for (int x = 0; x < 4; x++)
                kdamma::tf32_split(rd(qs, i0 + 8 * (x & 1), e0 + 4 * (x >> 1)) * f[x], ah[x],
                                   al[x]);
#pragma unroll
            for (int h = 0; h < 2; h++)
                mma_3xtf32(accA[0][h], ah, al, bh[h][0], bh[h][1], bl[h][0], bl[h][1]);
#pragma unroll
            for (int x = 0; x < 4; x++)
                kdamma::tf32_split(rd(ks, i0 + 8 * (x & 1), e0 + 4 * (x >> 1)) * f[x], ah[x],
                                   al[x]);
#pragma unroll
            for (int h = 0; h < 2; h++)
                mma_3xtf32(accP[0][h], ah, al, bh[h][0], bh[h][1], bl[h][0], bl[h][1]);
        } else { /* exact sums of the lane's accumulator elements on or below the diagonal,
                    through the warp's scratch row in shared memory (a rare path: kept out of the
                    registers of the common one) */
            float *fs = fb + (w * 32 + lane) * 16;
#pragma unroll 1
            for (int y = 0; y < 8; y++) { /* h = y / 4; d0 (g, 2t), d1 (g, 2t + 1), d2, d3: + 8 */
                const int x = y % 4, i = i0 + 8 * (x >> 1),
                          j = 16 * I + 8 * (y / 4) + 2 * t + (x & 1);
                float sa = 0.f, sp = 0.f;
#pragma unroll 1
                for (int e = c; e < c + 8 && j <= i; e++) {
                    const float xk = rd(ks, j, e) * exp_ftz(gs[i * LDG + e] - gs[j * LDG + e]);
                    sa += rd(qs, i, e) * xk;
                    sp += rd(ks, i, e) * xk;
                }
                fs[y] = sa;
                fs[8 + y] = sp;
            }
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    accA[0][h][x] += fs[4 * h + x];
                    accP[0][h][x] += fs[8 + 4 * h + x];
                }
        }
    };

    /* PR, once the tile of stage b has landed: the rows' sums of squares gain its columns
     * (thread: row tid / 4, 8 columns), and the block forms the tile's G in gp and writes it:
     * thread (warp w, lane = column) the gates of rows RS w .. RS w + RS - 1 (kda_gate_value_tc)
     * and their running sum, the segments' totals through the exact-sum scratch fb, then each
     * row's G = the totals of the segments above it (in order) + its running sum. Rows past L and
     * columns past K stay 0, as the zero-filled G tile of the other path. */
    const float ga = PR && pp.A_log ? expf(pp.A_log[hv]) : 1.f;
    auto prep_tile = [&](int kt, int b) {
        if constexpr (PR) {
            constexpr int RS = BT / F::NW; /* rows per segment (8) */
            const TQ *qs = stq(b), *ks = qs + BT * LDQ;
            const kda_bf16 *xs = reinterpret_cast<const kda_bf16 *>(ks + BT * LDQ);
            {
                const int r = tid >> 2, c = 8 * (tid & 3);
                float xq[8], xk[8];
                kda_ld16(qs + r * LDQ + c, xq);
                kda_ld16(ks + r * LDQ + c, xk);
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    ssq = fmaf(xq[u], xq[u], ssq);
                    ssk = fmaf(xk[u], xk[u], ssk);
                }
            }
            const int col = kt * KT + lane, r0 = RS * w;
            const bool ok = col < K;
            const float bias = ok && pp.dt_bias ? pp.dt_bias[hv * K + col] : 0.f;
            float run[RS], sum = 0.f;
#pragma unroll
            for (int u = 0; u < RS; u++) {
                if (ok && r0 + u < L) {
                    const float gv = kda_gate_value_tc(
                        pp.kind, pp.lb, kda_ld(xs + (r0 + u) * LDQ + lane), ga, bias);
                    sum += gv < KDA_G_FLOOR_F ? KDA_G_FLOOR_F : gv;
                }
                run[u] = sum;
            }
            fb[w * 32 + lane] = sum;
            __syncthreads();
            float off = 0.f;
            for (int p = 0; p < w; p++)
                off += fb[p * 32 + lane];
            float *Gc = pp.G + (t0 * HV + hv) * K + col;
#pragma unroll
            for (int u = 0; u < RS; u++) {
                const int i = r0 + u;
                const bool in = ok && i < L;
                gp[i * LDG + lane] = in ? off + run[u] : 0.f;
                if (in)
                    Gc[(int64_t)i * HV * K] = off + run[u];
            }
            __syncthreads(); /* gp complete; fb free for the diagonal warps */
        }
    };

    const int nkt = (K + KT - 1) / KT;
    load(0, 0);
    kdamma::cp_async_commit();
    for (int kt = 0; kt < nkt; kt++) {
        const int b = kt & 1;
        if (kt + 1 < nkt)
            load(kt + 1, b ^ 1);
        kdamma::cp_async_commit();
        kdamma::cp_async_wait<1>();
        __syncthreads();
        if (PR)
            prep_tile(kt, b);
        if (active) {
            const TQ *qs = stq(b), *ks = qs + BT * LDQ;
            const float *gs = PR ? gp : reinterpret_cast<const float *>(ks + BT * LDQ);
            const int ns = min(KT, K - kt * KT); /* key columns of this tile */
            if (tk.D) {
#pragma unroll 1
                for (int c = 0; c < ns; c += 8)
                    diag_step(qs, ks, gs, c);
            } else {
#pragma unroll 1
                for (int c = 0; c < ns; c += 8)
                    off_step(qs, ks, gs, c);
            }
        }
        __syncthreads(); /* stage b is refilled next; after the last tile: the stages are free */
    }
    if (PR) { /* the rows' reciprocal norms (as dg__l2norm_fwd_cuda's: 1 / sqrt(ss + eps)) */
        ssq += __shfl_xor_sync(0xffffffffu, ssq, 1);
        ssq += __shfl_xor_sync(0xffffffffu, ssq, 2);
        ssk += __shfl_xor_sync(0xffffffffu, ssk, 1);
        ssk += __shfl_xor_sync(0xffffffffu, ssk, 2);
        const int r = tid >> 2;
        if ((tid & 3) == 0) {
            const float a = 1.f / sqrtf(ssq + pp.eps), c = 1.f / sqrtf(ssk + pp.eps);
            scq[r] = r < L ? a : 1.f;
            sck[r] = r < L ? c : 1.f;
            if (r < L && hv % (HV / H) == 0) { /* one writer per q, k head */
                pp.rq[(t0 + r) * H + hq] = a;
                pp.rk[(t0 + r) * H + hq] = c;
            }
        }
        __syncthreads();
    }

    /* Aqk (scaled, j <= i, zeros elsewhere) from the registers, row block by row block; Lkk =
     * Diag(beta) P (j < i) into shared memory (rows past L: beta = 0, zero rows) */
    float *Ls = reinterpret_cast<float *>(smb), *Ts = Ls + BT * LDS, *Xs = Ts + BT * LDS;
    if (I >= 0) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int i = i0 + 8 * hh;
            const float bi = i < L ? beta[(t0 + i) * HV + hv] : 0.f;
            const float sa = scale * scq[i], sp = bi * sck[i]; /* the row's factors */
            float *arow = Aqk + ((t0 + i) * HV + hv) * BT;
            auto put = [&](int j, float a0, float a1) { /* Aqk[i, j .. j + 1] */
                                                        if (i >= L)
                                                            return;
                                                        if (vec) {
                                                            *reinterpret_cast<float2 *>(arow + j) =
                                                                make_float2(a0, a1);
                                                        } else {
                                                            arow[j] = a0;
                                                            arow[j + 1] = a1;
                                                        }
            };
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                if (nb >= tk.NB)
                    break;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int j = 16 * (tk.J0 + nb) + 8 * h + 2 * t;
                    const float a0 = accA[nb][h][2 * hh], a1 = accA[nb][h][2 * hh + 1];
                    const float p0 = accP[nb][h][2 * hh], p1 = accP[nb][h][2 * hh + 1];
                    const float s0 = sck[j], s1 = sck[j + 1]; /* the columns' factors */
                    put(j, j <= i ? sa * s0 * a0 : 0.f, j + 1 <= i ? sa * s1 * a1 : 0.f);
                    Ls[i * LDS + j] = j < i ? sp * s0 * p0 : 0.f;
                    Ls[i * LDS + j + 1] = j + 1 < i ? sp * s1 * p1 : 0.f;
                }
            }
            if (tk.D) /* the zero blocks right of the diagonal */
                for (int j = 16 * (I + 1) + 2 * t; j < BT; j += 8)
                    put(j, 0.f, 0.f);
        }
        if (tk.D) {
            __syncwarp(); /* its own block of Lkk, written by this warp */
            intra_diag_inverse<LDS>(Ls, Ts, 16 * I);
        }
    }
    __syncthreads();
    intra_merge_blocks<BT, LDS>(Ls, Ts, Xs);
    if (vec) { /* rows of Tm in 16-byte pieces */
        for (int idx = tid; idx < L * (BT / 4); idx += NTHR) {
            const int i = idx / (BT / 4), j = 4 * (idx % (BT / 4));
            const float4 v = *reinterpret_cast<const float4 *>(Ts + i * LDS + j);
            float4 o;
            o.x = j < i ? v.x : (j == i ? 1.f : 0.f);
            o.y = j + 1 < i ? v.y : (j + 1 == i ? 1.f : 0.f);
            o.z = j + 2 < i ? v.z : (j + 2 == i ? 1.f : 0.f);
            o.w = j + 3 < i ? v.w : (j + 3 == i ? 1.f : 0.f);
            *reinterpret_cast<float4 *>(Tm + ((t0 + i) * HV + hv) * BT + j) = o;
        }
    } else {
        for (int idx = tid; idx < L * BT; idx += NTHR) {
            const int i = idx / BT, j = idx % BT;
            Tm[((t0 + i) * HV + hv) * BT + j] = j < i ? Ts[i * LDS + j] : (j == i ? 1.f : 0.f);
        }
    }
}

// ---- backward kernels

/* grid (NC, HV), 256 threads. sTt[a][j] = Tm[j][a] (a <= j), sD = strictly lower dTm, then X1 in
 * place (row m is owned by one warp: all its lanes read, __syncwarp, then write). */
template <int BT>
__global__ void __launch_bounds__(NTH)
    intra_dl_kernel(Dims d, const float *Tm, const float *dTm, float *dL) {
    __shared__ float sTt[BT][BT + 1];
    __shared__ float sD[BT][BT + 1];
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        float tv = 0.f, dv = 0.f;
        if (row < L) {
            const int64_t g = ((t0 + row) * d.HV + hv) * BT + col;
            if (col <= row)
                tv = Tm[g];
            if (col < row)
                dv = dTm[g];
        }
        sTt[col][row] = tv;
        sD[row][col] = dv;
    }
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int JP = (BT + 31) / 32;
    /* X1[m][j] = sum_{a <= j} dTm[m][a] Tm[j][a]  (j < m), same order as the CPU */
    for (int m = w; m < L; m += NW) {
        float val[JP];
#pragma unroll
        for (int p = 0; p < JP; p++) {
            const int j = lane + 32 * p;
            float s = 0.f;
            if (j < m)
                for (int a = 0; a <= j; a++)
                    s += sD[m][a] * sTt[a][j];
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
    /* dLkk[i][j] = -sum_{m=i}^{L-1} Tm[m][i] X1[m][j]  (j < i); zero elsewhere in the row */
    for (int i = w; i < L; i += NW)
        for (int j = lane; j < BT; j += 32) {
            float s = 0.f;
            if (j < i)
                for (int m = i; m < L; m++)
                    s += sTt[i][m] * sD[m][j];
            dL[((t0 + i) * d.HV + hv) * BT + j] = j < i ? -s : 0.f;
        }
}

/* grid (NC, HV, ceil(K/32)), 256 threads, dynamic shared memory (see the file comment). The f32
 * path (tc == 0): the accurate expf pins it to the CPU reference within 1e-5. */
template <int BT>
__global__ void __launch_bounds__(NTH)
    intra_main_kernel(Dims d, float scale, const float *q, const float *k, const float *beta,
                      const float *G, const float *dAqk, const float *dL, float *dqv, float *dkv,
                      float *dG, float *dbp, unsigned acc) {
    extern __shared__ float sm[];
    float(*sq)[CT] = (float(*)[CT])sm;
    float(*sk)[CT] = sq + BT;
    float(*sG)[CT] = sk + BT;
    float(*sdA)[BT] = (float(*)[BT])(sm + 3 * BT * CT);
    float(*sdL)[BT] = sdA + BT;
    float *sb = sm + 3 * BT * CT + 2 * BT * BT;

    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, kt = blockIdx.z, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K;
    const int e0 = kt * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    for (int idx = threadIdx.x; idx < BT * CT; idx += NTH) {
        const int row = idx / CT, col = idx % CT, e = e0 + col;
        const bool ok = row < L && e < K;
        sq[row][col] = ok ? q[((t0 + row) * H + hq) * K + e] : 0.f;
        sk[row][col] = ok ? k[((t0 + row) * H + hq) * K + e] : 0.f;
        sG[row][col] = ok ? G[((t0 + row) * HV + hv) * K + e] : 0.f;
    }
    for (int idx = threadIdx.x; idx < BT * BT; idx += NTH) {
        const int row = idx / BT, col = idx % BT;
        const int64_t g = ((t0 + row) * HV + hv) * BT + col;
        sdA[row][col] = (dAqk && row < L && col <= row) ? scale * dAqk[g] : 0.f;
        sdL[row][col] = (dL && row < L && col < row) ? dL[g] : 0.f;
    }
    for (int i = threadIdx.x; i < BT; i += NTH)
        sb[i] = i < L ? beta[(t0 + i) * HV + hv] : 0.f;
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = e0 + lane;
    for (int r = w; r < L; r += NW) { /* r is the same for the whole warp */
        const float Gr = sG[r][lane], qr = sq[r][lane], kr = sk[r][lane];
        /* row side: j <= r (sdL[r][r] = 0) */
        float rq = 0.f, rl = 0.f;
        for (int j = 0; j <= r; j++) {
            const float kx = sk[j][lane] * expf(Gr - sG[j][lane]);
            rq += sdA[r][j] * kx;
            rl += sdL[r][j] * kx;
        }
        /* column side: m >= r (sdL[r][r] = 0) */
        float cq = 0.f, ck = 0.f;
        for (int m = r; m < L; m++) {
            const float x = expf(sG[m][lane] - Gr);
            cq += sdA[m][r] * sq[m][lane] * x;
            ck += sb[m] * sdL[m][r] * sk[m][lane] * x;
        }
        const float rk = sb[r] * rl, col = cq + ck;
        if (e < K) {
            const int64_t idx = ((t0 + r) * HV + hv) * K + e;
            if (dqv)
                dqv[idx] = (acc & KDA_ACC_DQ ? dqv[idx] : 0.f) + rq;
            if (dkv)
                dkv[idx] = (acc & KDA_ACC_DK ? dkv[idx] : 0.f) + rk + col;
            if (dG)
                dG[idx] = (acc & KDA_ACC_DG ? dG[idx] : 0.f) + qr * rq + kr * rk - kr * col;
        }
        const float pb = warp_sum(kr * rl); /* lanes past K hold k = 0 */
        if (dbp && lane == 0)
            dbp[(int64_t)kt * d.TT * HV + (t0 + r) * HV + hv] = pb;
    }
}

/* ---- the tensor-core variant (tc != 0): the sums as products on mma.sync, 3xTF32
 *
 * Block per (chunk, 64-column key tile, value head); warp w owns row block rb = w / 2 (rows
 * 16 rb .. 16 rb + 15) and the 32 key columns 32 (w % 2) .. + 31 of the tile, i.e. four m16n8
 * accumulator tiles per sum (Rq, RL, and C = Cq + Ck, which only ever appear summed). Each
 * exponential is split around a reference row p, exp(G_a - G_b) = exp(G_a - G_p) exp(G_p - G_b),
 * so that a sum over j (or m) becomes an MMA with dA, dL (or their transposes) as the A operand,
 * k_j exp(G_p - G_j) (or q_m exp(G_m - G_p), beta_m k_m exp(G_m - G_p)) as the B operand, formed
 * as its fragment is read, and the factor of the row applied to the accumulator afterwards.
 *   Common case: p = the block's middle row for the whole row side (j < 16 rb + 16) and column
 *     side (m >= 16 rb). Factors from blocks further away are <= 1 (G falls within a chunk);
 *     factors within the block are bounded by the block's own spread of G, which is checked
 *     against MID_SPAN per column first. Every warp does NB + 1 16-wide steps per side.
 *   Steep gates (spread above MID_SPAN): the blocks off the diagonal use p = the block's first
 *     row (row side) or the next block's first row (column side), where both factors are <= 1,
 *     and the diagonal block is summed with exact exponentials per accumulator element in f32.
 * A factor that underflows stands only for terms that underflow (or are negligible) anyway. */
constexpr int MMA_C = 64; /* key columns per block */
/* q, k, G tiles: B-fragment reads (k = t, n = g) hit banks 8t + g */
constexpr int MMA_LDK = MMA_C + 8;

template <int BT> struct IntraMma {
    static constexpr int NB = BT / 16;   /* row blocks */
    static constexpr int NTHR = 64 * NB; /* two warps per row block */
    static constexpr int LDA = BT + 4;   /* dA, dL: A-fragment reads (g, t) hit banks 4g + t */
    static constexpr size_t smem_floats = 3 * BT * MMA_LDK + 2 * BT * LDA + 3 * BT;
};

template <int BT, bool QB>
__global__ void __launch_bounds__(IntraMma<BT>::NTHR)
    intra_main_mma_kernel(Dims d, int nkt, bool vec, float scale, const void *qv, const void *kv,
                          const float *rq, const float *rk, const float *beta, const float *G,
                          const float *dAqk, const float *dL, float *dqv, float *dkv, float *dG,
                          float *dbp, unsigned acc) {
    using kdamma::mma_3xtf32;
    using kdamma::tf32_split;
    constexpr int LDA = IntraMma<BT>::LDA, NT = IntraMma<BT>::NTHR;
    constexpr int LDK = MMA_LDK;
    extern __shared__ __align__(16) float imma_smem[];
    float *sq = imma_smem, *sk = sq + BT * LDK, *sG = sk + BT * LDK;
    float *sdA = sG + BT * LDK, *sdL = sdA + BT * LDA, *sb = sdL + BT * LDA, *sdb = sb + BT;

    const int64_t c = blockIdx.x / nkt;
    const int kt = (int)(blockIdx.x % nkt);
    const int hv = blockIdx.y, hq = hv / d.G;
    const int H = d.H, HV = d.HV, K = d.K, e0 = kt * MMA_C;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const float *q = static_cast<const float *>(qv), *k = static_cast<const float *>(kv);
    if (vec) { /* 16-byte pieces in flight all at once; rows >= L and columns >= K zero */
        using kdamma::tile_async;
        if (QB) { /* bf16 q, k (vec holds): widened, times the row scales */
            const int64_t o = t0 * H + hq;
            kdamma::TileInBf16<BT, MMA_C, NT> tq, tk; /* both tiles' loads in flight together */
            tq.load(static_cast<const kda_bf16 *>(qv) + o * K, (int64_t)H * K, L, e0, K,
                    rq ? rq + o : nullptr, H);
            tk.load(static_cast<const kda_bf16 *>(kv) + o * K, (int64_t)H * K, L, e0, K,
                    rk ? rk + o : nullptr, H);
            tq.store<LDK>(sq);
            tk.store<LDK>(sk);
        } else {
            tile_async<BT, MMA_C, LDK, NT>(sq, q + (t0 * H + hq) * K, (int64_t)H * K, L, e0, K);
            tile_async<BT, MMA_C, LDK, NT>(sk, k + (t0 * H + hq) * K, (int64_t)H * K, L, e0, K);
        }
        tile_async<BT, MMA_C, LDK, NT>(sG, G + (t0 * HV + hv) * K, (int64_t)HV * K, L, e0, K);
        if (dAqk)
            tile_async<BT, BT, LDA, NT>(sdA, dAqk + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0,
                                        BT);
        if (dL)
            tile_async<BT, BT, LDA, NT>(sdL, dL + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0, BT);
        kdamma::cp_async_commit();
    } else {
        for (int idx = threadIdx.x; idx < BT * MMA_C; idx += NT) {
            const int r = idx / MMA_C, cc = idx % MMA_C, e = e0 + cc;
            const bool ok = r < L && e < K;
            sq[r * LDK + cc] = ok ? q[((t0 + r) * H + hq) * K + e] : 0.f;
            sk[r * LDK + cc] = ok ? k[((t0 + r) * H + hq) * K + e] : 0.f;
            sG[r * LDK + cc] = ok ? G[((t0 + r) * HV + hv) * K + e] : 0.f;
        }
        for (int idx = threadIdx.x; idx < BT * BT; idx += NT) {
            const int r = idx / BT, j = idx % BT;
            const int64_t gi = ((t0 + r) * HV + hv) * BT + j;
            if (dAqk)
                sdA[r * LDA + j] = r < L ? dAqk[gi] : 0.f;
            if (dL)
                sdL[r * LDA + j] = r < L ? dL[gi] : 0.f;
        }
    }
    for (int i = threadIdx.x; i < BT; i += NT)
        sb[i] = i < L ? beta[(t0 + i) * HV + hv] : 0.f;
    kdamma::cp_async_wait<0>();
    __syncthreads();
    /* dA = scale * dAqk on and below the diagonal, dL strictly below; zero elsewhere */
    for (int idx = threadIdx.x; idx < BT * BT; idx += NT) {
        const int r = idx / BT, j = idx % BT;
        float *a = sdA + r * LDA + j, *l = sdL + r * LDA + j;
        *a = dAqk && j <= r ? scale * *a : 0.f;
        *l = dL && j < r ? *l : 0.f;
    }
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rb = w >> 1, cb = 32 * (w & 1);
    const int r0 = 16 * rb + g, r1 = r0 + 8; /* the two rows of this thread's accumulators */
    const bool active = 16 * rb < L;         /* warp-uniform */
    /* accumulator element e of tile n: row (e < 2 ? r0 : r1), column cb + 8n + 2t + (e & 1) */
    float Rq[4][4] = {}, Rl[4][4] = {}, Cs[4][4] = {};
    float db0 = 0.f, db1 = 0.f;
    if (active) {
        float G0[4][2], G1[4][2]; /* G at this thread's accumulator elements */
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int p = 0; p < 2; p++) {
                const int col = cb + 8 * n + 2 * t + p;
                G0[n][p] = sG[r0 * LDK + col];
                G1[n][p] = sG[r1 * LDK + col];
            }
        /* Row side over j in [0, kend): Rq += dA[r, j] k_j exp(G_p - G_j), RL likewise with dL
         * (A = dA, dL rows r0, r0 + 8; B formed from k, G as its fragment is read). */
        auto row_side = [&](const float *gp, int kend) {
            for (int kk = 0; kk < kend; kk += 8) {
                unsigned aq[4], aqs[4], al[4], als[4]; /* hi, lo halves */
                frag_rows<LDA>(sdA + r0 * LDA + kk + t, aq, aqs);
                frag_rows<LDA>(sdL + r0 * LDA + kk + t, al, als);
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    const int col = cb + 8 * n + g;
                    const float gr = gp[col];
                    const int i0 = (kk + t) * LDK + col, i1 = i0 + 4 * LDK;
                    /* rows past L hold k = 0 and G = 0 padding: never exponentiate it (with a
                     * G_p > 0, possible for gates passed to the stage directly, it would
                     * overflow) */
                    const float x0 = kk + t < L ? sk[i0] * kdamma::exp_ftz(gr - sG[i0]) : 0.f;
                    const float x1 = kk + t + 4 < L ? sk[i1] * kdamma::exp_ftz(gr - sG[i1]) : 0.f;
                    unsigned b0, b0s, b1, b1s;
                    tf32_split(x0, b0, b0s);
                    tf32_split(x1, b1, b1s);
                    mma_3xtf32(Rq[n], aq, aqs, b0, b1, b0s, b1s);
                    mma_3xtf32(Rl[n], al, als, b0, b1, b0s, b1s);
                }
            }
        };
        /* Column side over m in [mbeg, BT): C += (dA[m, r] q_m + dL[m, r] beta_m k_m) exp(G_m -
         * G_p) (A = dA, dL transposed: columns r0, r0 + 8). */
        auto col_side = [&](const float *gp, int mbeg) {
            for (int mm = mbeg; mm < BT; mm += 8) {
                unsigned aq[4], aqs[4], al[4], als[4];
                frag_cols<LDA>(sdA + (mm + t) * LDA + 16 * rb + g, aq, aqs);
                frag_cols<LDA>(sdL + (mm + t) * LDA + 16 * rb + g, al, als);
                const int ma = mm + t, mb = ma + 4;
                const bool va = ma < L, vb = mb < L; /* rows past L hold G = 0: never exp them */
                const float ba = sb[ma], bb = sb[mb];
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    const int col = cb + 8 * n + g;
                    const float gr = gp[col];
                    const int ia = ma * LDK + col, ib = mb * LDK + col;
                    const float xa = va ? kdamma::exp_ftz(sG[ia] - gr) : 0.f;
                    const float xb = vb ? kdamma::exp_ftz(sG[ib] - gr) : 0.f;
                    unsigned b0, b0s, b1, b1s;
                    tf32_split(sq[ia] * xa, b0, b0s);
                    tf32_split(sq[ib] * xb, b1, b1s);
                    mma_3xtf32(Cs[n], aq, aqs, b0, b1, b0s, b1s);
                    tf32_split(ba * sk[ia] * xa, b0, b0s);
                    tf32_split(bb * sk[ib] * xb, b1, b1s);
                    mma_3xtf32(Cs[n], al, als, b0, b1, b0s, b1s);
                }
            }
        };
        /* The factors of the rows: exp(G_r - G_p) on the row side, exp(G_p - G_r) on the column
         * side (rows past L: zero, their G is padding). */
        auto scale_rows = [&](const float *gp, bool row, bool col) {
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const float gr = gp[cb + 8 * n + 2 * t + p];
                    const float d0 = G0[n][p] - gr, d1 = G1[n][p] - gr;
                    if (row) {
                        const float s0 = r0 < L ? kdamma::exp_ftz(d0) : 0.f,
                                    s1 = r1 < L ? kdamma::exp_ftz(d1) : 0.f;
                        Rq[n][p] *= s0;
                        Rl[n][p] *= s0;
                        Rq[n][2 + p] *= s1;
                        Rl[n][2 + p] *= s1;
                    }
                    if (col) {
                        Cs[n][p] *= r0 < L ? kdamma::exp_ftz(-d0) : 0.f;
                        Cs[n][2 + p] *= r1 < L ? kdamma::exp_ftz(-d1) : 0.f;
                    }
                }
        };

        /* The block's middle row pm as the one reference row of both sides, diagonal block
         * included, when no exponent formed from it exceeds MID_SPAN in size (checked per
         * column, lane = column); otherwise first rows off the diagonal, exact pairs on it. */
        const int pm = min(16 * rb + 8, L - 1);
        float dev = 0.f;
        for (int jj = 0; jj < 16 && 16 * rb + jj < L; jj++)
            dev =
                fmaxf(dev, fabsf(sG[(16 * rb + jj) * LDK + cb + lane] - sG[pm * LDK + cb + lane]));
        if (__all_sync(0xffffffffu, dev <= MID_SPAN)) {
            row_side(sG + pm * LDK, 16 * rb + 16);
            col_side(sG + pm * LDK, 16 * rb);
            scale_rows(sG + pm * LDK, true, true);
        } else {
            if (rb > 0) {
                row_side(sG + 16 * rb * LDK, 16 * rb);
                scale_rows(sG + 16 * rb * LDK, true, false);
            }
            /* row side, the diagonal block: j from the block's first row to r */
            for (int jj = 0; jj < 16; jj++) {
                const int j = 16 * rb + jj;
                if (j >= L)
                    break;
                const bool in0 = jj <= g && r0 < L, in1 = jj <= g + 8 && r1 < L;
                const float a0 = sdA[r0 * LDA + j], a1 = sdA[r1 * LDA + j];
                const float l0 = sdL[r0 * LDA + j], l1 = sdL[r1 * LDA + j];
#pragma unroll
                for (int n = 0; n < 4; n++)
#pragma unroll
                    for (int p = 0; p < 2; p++) {
                        const int i = j * LDK + cb + 8 * n + 2 * t + p;
                        const float kj = sk[i], gj = sG[i];
                        if (in0) {
                            const float x = kj * kdamma::exp_ftz(G0[n][p] - gj);
                            Rq[n][p] += a0 * x;
                            Rl[n][p] += l0 * x;
                        }
                        if (in1) {
                            const float x = kj * kdamma::exp_ftz(G1[n][p] - gj);
                            Rq[n][2 + p] += a1 * x;
                            Rl[n][2 + p] += l1 * x;
                        }
                    }
            }
            const int p16 = 16 * (rb + 1);
            if (p16 < L) {
                col_side(sG + p16 * LDK, p16);
                scale_rows(sG + p16 * LDK, false, true);
            }
            /* column side, the diagonal block: m from r to the block's last row */
            for (int mm = 0; mm < 16; mm++) {
                const int m = 16 * rb + mm;
                if (m >= L)
                    break;
                const bool in0 = mm >= g, in1 = mm >= g + 8;
                const float a0 = sdA[m * LDA + r0], a1 = sdA[m * LDA + r1];
                const float l0 = sdL[m * LDA + r0] * sb[m], l1 = sdL[m * LDA + r1] * sb[m];
#pragma unroll
                for (int n = 0; n < 4; n++)
#pragma unroll
                    for (int p = 0; p < 2; p++) {
                        const int i = m * LDK + cb + 8 * n + 2 * t + p;
                        const float qm = sq[i], km = sk[i], gm = sG[i];
                        if (in0)
                            Cs[n][p] += (a0 * qm + l0 * km) * kdamma::exp_ftz(gm - G0[n][p]);
                        if (in1)
                            Cs[n][2 + p] += (a1 * qm + l1 * km) * kdamma::exp_ftz(gm - G1[n][p]);
                    }
            }
        }
        /* outputs: dq = Rq, dk = beta_r RL + C, dG = q Rq + k beta_r RL - k C, dbeta = k . RL;
         * a thread's two adjacent columns go out as one float2 where K allows */
        const bool pair = K % 2 == 0;
        float *const outs[3] = {dqv, dkv, dG};
        constexpr unsigned flags[3] = {KDA_ACC_DQ, KDA_ACC_DK, KDA_ACC_DG};
        /* the values to add to (acc, paired columns) of both rows, all four column pairs and
         * all three arrays are read first, so that the 24 loads are in flight together */
        const int64_t idx0 = ((t0 + r0) * HV + hv) * K + e0 + cb + 2 * t;
        const int64_t idx1 = ((t0 + r1) * HV + hv) * K + e0 + cb + 2 * t;
        float2 old[4][2][3];
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = h ? r1 : r0, ke = e0 + cb + 8 * n + 2 * t;
                const bool in = r < L && ke < K;
#pragma unroll
                for (int a = 0; a < 3; a++)
                    old[n][h][a] =
                        pair && in && outs[a] && (acc & flags[a])
                            ? *reinterpret_cast<const float2 *>(outs[a] + (h ? idx1 : idx0) + 8 * n)
                            : make_float2(0.f, 0.f);
            }
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const int col = cb + 8 * n + 2 * t, ke = e0 + col;
            const int64_t idx[2] = {idx0 + 8 * n, idx1 + 8 * n};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = h ? r1 : r0;
                float v[3][2]; /* dq, dk, dG */
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const int e = 2 * h + p;
                    const float kr = sk[r * LDK + col + p], qr = sq[r * LDK + col + p];
                    const float rk = sb[r] * Rl[n][e], cs = Cs[n][e];
                    if (h)
                        db1 += kr * Rl[n][e];
                    else
                        db0 += kr * Rl[n][e];
                    v[0][p] = Rq[n][e];
                    v[1][p] = rk + cs;
                    v[2][p] = qr * Rq[n][e] + kr * rk - kr * cs;
                }
                if (r >= L || ke >= K)
                    continue;
                    /* write, or add to what is there (acc) */
#pragma unroll
                for (int a = 0; a < 3; a++) {
                    float *o = outs[a];
                    if (!o)
                        continue;
                    if (pair) { /* ke even, K even: both columns valid, 8-byte aligned */
                        *reinterpret_cast<float2 *>(o + idx[h]) =
                            make_float2(old[n][h][a].x + v[a][0], old[n][h][a].y + v[a][1]);
                    } else {
                        for (int p = 0; p < 2 && ke + p < K; p++)
                            o[idx[h] + p] = (acc & flags[a] ? o[idx[h] + p] : 0.f) + v[a][p];
                    }
                }
            }
        }
    }
    /* dbeta: the four lanes of a row, then the two column halves, in a fixed order */
    db0 += __shfl_xor_sync(0xffffffffu, db0, 1);
    db0 += __shfl_xor_sync(0xffffffffu, db0, 2);
    db1 += __shfl_xor_sync(0xffffffffu, db1, 1);
    db1 += __shfl_xor_sync(0xffffffffu, db1, 2);
    if (active && t == 0) {
        sdb[(w & 1) * BT + r0] = db0;
        sdb[(w & 1) * BT + r1] = db1;
    }
    __syncthreads();
    if (dbp)
        for (int i = threadIdx.x; i < L; i += NT)
            dbp[(int64_t)kt * d.TT * HV + (t0 + i) * HV + hv] = sdb[i] + sdb[BT + i];
}

/* intra_dl on mma.sync 3xTF32 for the tensor-core path, grid (NC, HV): the same two products,
 * X1 = stril(dTm) Tm^T (kept strictly lower: only j < m is used) and dLkk = -stril(Tm^T X1), on
 * Tm (lower with its diagonal) and dTm (strictly lower) staged by cp.async and masked in place.
 * Warp (wm, wn) owns rows 16 wm .. + 15 and columns NCW wn .. + NCW - 1 of each product. */
template <int BT> struct IntraDlMma {
    static constexpr int NCW = BT < 32 ? BT : 32; /* columns per warp */
    static constexpr int WM = BT / 16, WN = BT / NCW, NTHR = 32 * WM * WN;
    static constexpr int LDT = BT + 4; /* Tm, dTm: k-contiguous reads hit banks 4g + t */
    static constexpr int LDX = BT + 8; /* X1: n-contiguous reads hit banks 8t + g */
    static constexpr size_t smem_floats = 2 * BT * LDT + BT * LDX;
};

template <int BT>
__global__ void __launch_bounds__(IntraDlMma<BT>::NTHR)
    intra_dl_mma_kernel(Dims d, const float *Tm, const float *dTm, float *dL) {
    using C = IntraDlMma<BT>;
    constexpr int LDT = C::LDT, LDX = C::LDX, NT = C::NTHR, NJ = C::NCW / 8;
    extern __shared__ __align__(16) float dl_smem[];
    float *sT = dl_smem, *sD = sT + BT * LDT, *sX = sD + BT * LDT;
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, HV = d.HV;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int64_t base = (t0 * HV + hv) * BT;
    kdamma::tile_async<BT, BT, LDT, NT>(sT, Tm + base, (int64_t)HV * BT, L, 0, BT);
    kdamma::tile_async<BT, BT, LDT, NT>(sD, dTm + base, (int64_t)HV * BT, L, 0, BT);
    kdamma::cp_async_commit();
    kdamma::cp_async_wait<0>();
    __syncthreads();
    for (int idx = threadIdx.x; idx < BT * BT; idx += NT) {
        const int r = idx / BT, j = idx % BT;
        if (j > r)
            sT[r * LDT + j] = 0.f;
        if (j >= r)
            sD[r * LDT + j] = 0.f;
    }
    __syncthreads();

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (w / C::WN), n0 = C::NCW * (w % C::WN);
    float acc[NJ][4] = {};
    /* Both products skip the k-steps whose operands are zero by the masks above (adding exact
     * zeros: the same sums): X1 needs a < m (dTm strictly lower) and a <= j (Tm lower), and no
     * column j >= m is kept; dLkk needs m >= i (Tm lower) and only columns j < i. */
    const int k1 = n0 < m0 + 16 ? min(m0 + 16, n0 + C::NCW) : 0; /* warp-uniform */
    /* X1[m][j] = sum_a dTm[m][a] Tm[j][a]: A = dTm rows, B(a, j) = Tm[j][a] */
    for (int k0 = 0; k0 < k1; k0 += 8) {
        unsigned ah[4], al[4];
        frag_rows<LDT>(sD + (m0 + g) * LDT + k0 + t, ah, al);
#pragma unroll
        for (int n = 0; n < NJ; n++) {
            const float *bp = sT + (n0 + 8 * n + g) * LDT + k0 + t;
            unsigned b0, b0s, b1, b1s;
            kdamma::tf32_split(bp[0], b0, b0s);
            kdamma::tf32_split(bp[4], b1, b1s);
            kdamma::mma_3xtf32(acc[n], ah, al, b0, b1, b0s, b1s);
        }
    }
#pragma unroll
    for (int n = 0; n < NJ; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int m = m0 + g + 8 * (e >> 1), j = n0 + 8 * n + 2 * t + (e & 1);
            sX[m * LDX + j] = j < m ? acc[n][e] : 0.f;
            acc[n][e] = 0.f;
        }
    __syncthreads();
    /* dLkk[i][j] = -sum_m Tm[m][i] X1[m][j]: A(i, m) = Tm[m][i], B(m, j) = X1[m][j] */
    for (int k0 = n0 < m0 + 16 ? m0 : BT; k0 < BT; k0 += 8) {
        unsigned ah[4], al[4];
        frag_cols<LDT>(sT + (k0 + t) * LDT + m0 + g, ah, al);
#pragma unroll
        for (int n = 0; n < NJ; n++) {
            const float *bp = sX + (k0 + t) * LDX + n0 + 8 * n + g;
            unsigned b0, b0s, b1, b1s;
            kdamma::tf32_split(bp[0], b0, b0s);
            kdamma::tf32_split(bp[4 * LDX], b1, b1s);
            kdamma::mma_3xtf32(acc[n], ah, al, b0, b1, b0s, b1s);
        }
    }
#pragma unroll
    for (int n = 0; n < NJ; n++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = m0 + g + 8 * h, j = n0 + 8 * n + 2 * t;
            if (i < L)
                *reinterpret_cast<float2 *>(dL + base + (int64_t)i * HV * BT + j) =
                    make_float2(j < i ? -acc[n][2 * h] : 0.f, j + 1 < i ? -acc[n][2 * h + 1] : 0.f);
        }
}

// ---- launchers

/* One launch of intra_fwd_mma_kernel with q, k of TQ (bf16: with the row scales of d; PR: the
 * scales and G formed by the kernel, pp). */
template <int BT, int P, class TQ, bool PR = false>
static dg_status intra_fwd_mma_launch(dg_ctx *ctx, const kda_cuda_dims *d, bool vec, float scale,
                                      const void *q, const void *k, const float *beta,
                                      const float *G, float *Aqk, float *Tm,
                                      const IntraPrep &pp = IntraPrep{}) {
    using F = IntraFwd<BT>;
    constexpr bool QB = sizeof(TQ) == 2;
    auto kern = intra_fwd_mma_kernel<BT, P, TQ, PR>;
    const size_t smem = F::template smem<TQ, PR>();
    DG_TRY(smem_opt_in(kern, smem));
    kern<<<dim3((unsigned)d->NC, (unsigned)d->HV), F::NTHR, smem, dg__stream(ctx)>>>(
        d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, vec, scale, static_cast<const TQ *>(q),
        static_cast<const TQ *>(k), QB && !PR ? d->rq : nullptr, QB && !PR ? d->rk : nullptr, beta,
        G, Aqk, Tm, pp);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

/* The tensor-core forward (d->tc != 0), called by dg__kda_intra_fwd_cuda after its checks. q, k
 * are f32, or bf16 (qb: d->qk_bf16 with vec, the only case the launcher passes) with the row
 * scales of d. */
static dg_status intra_fwd_mma(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                               const void *k, bool qb, const float *beta, const float *G,
                               float *Aqk, float *Tm) {
    if (d->NC == 0)
        return DG_OK;
    /* vec: cp.async tile loads, paired Aqk and 16-byte Tm stores */
    const bool vec = d->K % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(G) &&
                     aligned16(Aqk) && aligned16(Tm);
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_P(d->tc, {
                        return qb ? intra_fwd_mma_launch<BT_, P_, kda_bf16>(ctx, d, vec, scale, q,
                                                                            k, beta, G, Aqk, Tm)
                                  : intra_fwd_mma_launch<BT_, P_, float>(ctx, d, vec, scale, q, k,
                                                                         beta, G, Aqk, Tm);
                    }));
    return DG_OK;
}

extern "C" int dg__kda_intra_prep_fits(const kda_cuda_dims *d, const void *q, const void *k,
                                       const void *g) {
    return d && dg__kda_qk_fits(d, q, k) && aligned16(g) &&
           (d->BT == 16 || d->BT == 32 || d->BT == 64);
}

extern "C" dg_status dg__kda_intra_prep_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                                 const void *q, const void *k, const float *beta,
                                                 const kda_intra_prep *p, float *Aqk, float *Tm) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!q || !k || !beta || !p || !p->g || !p->G || !p->rq || !p->rk || !Aqk || !Tm)
        return dg__err(DG_ERR_ARG, "%s: q, k, beta, g, G, rq, rk, Aqk and Tm are required",
                       __func__);
    if (!dg__kda_intra_prep_fits(d, q, k, p->g) || !aligned16(p->G) || !aligned16(Aqk) ||
        !aligned16(Tm))
        return dg__err(DG_ERR_STATE,
                       "%s: needs the bf16 tensor-core path (tc == 1, K %% 16 == 0, 16-byte "
                       "aligned q, k, g, G, Aqk, Tm), got tc %d, K %d",
                       __func__, d->tc, d->K);
    if (d->NC == 0)
        return DG_OK;
    const IntraPrep pp = {static_cast<const kda_bf16 *>(p->g),
                          p->A_log,
                          p->dt_bias,
                          p->kind,
                          p->lb,
                          p->eps,
                          p->G,
                          p->rq,
                          p->rk};
    KDA_DISPATCH_BT(d->BT, {
        return intra_fwd_mma_launch<BT_, 1, kda_bf16, true>(ctx, d, true, scale, q, k, beta, p->G,
                                                            Aqk, Tm, pp);
    });
    return DG_OK;
}

extern "C" dg_status dg__kda_intra_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                            const void *qv, const void *kv, const float *beta,
                                            const float *G, float *Aqk, float *Tm) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!qv || !kv || !beta || !G || !Aqk || !Tm)
        return dg__err(DG_ERR_ARG, "%s: q, k, beta, G, Aqk and Tm are required", __func__);
    /* bf16 q, k (with or without row scales) as stored where the tensor-core kernel's vector
     * path runs; anything else through f32 rows */
    if (d->tc && d->qk_bf16 && dg__kda_qk_fits(d, qv, kv) && aligned16(G) && aligned16(Aqk) &&
        aligned16(Tm))
        return intra_fwd_mma(ctx, d, scale, qv, kv, true, beta, G, Aqk, Tm);
    Scratch qs(ctx), ks(ctx);
    const float *q, *k;
    DG_TRY(kda_qk_widen(ctx, d, qv, kv, qs, ks, &q, &k));
    if (d->tc)
        return intra_fwd_mma(ctx, d, scale, q, k, false, beta, G, Aqk, Tm);
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    KDA_DISPATCH_BT(d->BT, {
        kda_intra_fwd_kernel<BT_><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, scale, q, k, beta, G, Aqk, Tm);
        DG_CHECK_LAUNCH();
    });
    return DG_OK;
}

/* q, k: f32 rows, or (qb) bf16 with dd's row scales, taken only on the mma kernel's vector
 * path (the caller checks). */
template <int BT>
static dg_status intra_bwd_bt(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const void *q,
                              const void *k, bool qb, const float *beta, const float *G,
                              const float *Tm, const float *dAqk, const float *dTm, float *dq,
                              float *dk, float *dbeta, float *dG, unsigned acc) {
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    /* tc != 0: the mma.sync kernel on 64-column key tiles; tc == 0 the FFMA kernel on 32 */
    const bool mma = dd->tc != 0;
    const int nkt = DG_CEIL_DIV(d.K, mma ? MMA_C : CT);
    const size_t vk = (size_t)d.TT * d.HV * d.K;
    /* scratch: dLkk [TT,HV,BT]; dq, dk per value head when G > 1; dbeta partials when nkt > 1 */
    const bool need_dl = dTm != nullptr, per_hv = d.G > 1, parts = nkt > 1;
    size_t n = (need_dl ? (size_t)d.TT * d.HV * BT : 0) + (per_hv ? 2 * vk : 0) +
               (parts && dbeta ? (size_t)nkt * d.TT * d.HV : 0);
    Scratch scr(ctx);
    if (n)
        DG_TRY(scr.alloc(n));
    float *p = scr.f();
    float *dL = nullptr, *dqv = dq, *dkv = dk, *dbp = dbeta;
    if (need_dl) {
        dL = p;
        p += (size_t)d.TT * d.HV * BT;
    }
    if (per_hv) {
        dqv = dq ? p : nullptr;
        dkv = dk ? p + vk : nullptr;
        p += 2 * vk;
    }
    if (parts && dbeta)
        dbp = p;
    /* the kernels add to dq, dk only where they write the final arrays (no GVA scratch) */
    const unsigned kacc = per_hv ? (acc & KDA_ACC_DG) : acc;
    if (need_dl) {
        if (mma && aligned16(Tm) && aligned16(dTm)) {
            const size_t smem = sizeof(float) * IntraDlMma<BT>::smem_floats;
            DG_TRY(smem_opt_in(intra_dl_mma_kernel<BT>, smem));
            intra_dl_mma_kernel<BT>
                <<<dim3((unsigned)d.NC, d.HV), IntraDlMma<BT>::NTHR, smem, s>>>(d, Tm, dTm, dL);
        } else {
            intra_dl_kernel<BT><<<dim3((unsigned)d.NC, d.HV), NTH, 0, s>>>(d, Tm, dTm, dL);
        }
        DG_CHECK_LAUNCH();
    }
    if (mma) {
        const size_t smem = sizeof(float) * IntraMma<BT>::smem_floats;
        const dim3 grid((unsigned)(d.NC * nkt), d.HV);
        const bool vec = d.K % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(G) &&
                         aligned16(dAqk) && aligned16(dL);
        if (qb) {
            DG_TRY(smem_opt_in(intra_main_mma_kernel<BT, true>, smem));
            intra_main_mma_kernel<BT, true>
                <<<grid, IntraMma<BT>::NTHR, smem, s>>>(d, nkt, true, scale, q, k, dd->rq, dd->rk,
                                                        beta, G, dAqk, dL, dqv, dkv, dG, dbp, kacc);
        } else {
            DG_TRY(smem_opt_in(intra_main_mma_kernel<BT, false>, smem));
            intra_main_mma_kernel<BT, false>
                <<<grid, IntraMma<BT>::NTHR, smem, s>>>(d, nkt, vec, scale, q, k, nullptr, nullptr,
                                                        beta, G, dAqk, dL, dqv, dkv, dG, dbp, kacc);
        }
    } else {
        const size_t smem = sizeof(float) * (3 * BT * CT + 2 * BT * BT + BT);
        const dim3 grid((unsigned)d.NC, d.HV, nkt);
        DG_TRY(smem_opt_in(intra_main_kernel<BT>, smem));
        intra_main_kernel<BT><<<grid, NTH, smem, s>>>(d, scale, static_cast<const float *>(q),
                                                      static_cast<const float *>(k), beta, G, dAqk,
                                                      dL, dqv, dkv, dG, dbp, kacc);
    }
    DG_CHECK_LAUNCH();
    if (per_hv && dq)
        DG_TRY(kda_sum_parts(ctx, dq, dqv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DQ));
    if (per_hv && dk)
        DG_TRY(kda_sum_parts(ctx, dk, dkv, d.TT, d.H, d.G, d.K, 1, 0, acc & KDA_ACC_DK));
    if (parts && dbeta)
        DG_TRY(kda_sum_parts(ctx, dbeta, dbp, d.TT * d.HV, 1, 1, 1, nkt, d.TT * d.HV, 0));
    return DG_OK;
}

extern "C" dg_status dg__kda_intra_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                            const void *qv, const void *kv, const float *beta,
                                            const float *G, const float *Tm, const float *dAqk,
                                            const float *dTm, float *dq, float *dk, float *dbeta,
                                            float *dG, unsigned acc) {
    DG_TRY(check_dims("dg__kda_intra_bwd_cuda", d));
    if (d->NC == 0)
        return DG_OK;
    /* bf16 q, k as stored on the mma kernel's vector path (the dL scratch is aligned); anything
     * else through f32 rows */
    const bool qb =
        d->tc && d->qk_bf16 && dg__kda_qk_fits(d, qv, kv) && aligned16(G) && aligned16(dAqk);
    Scratch qs(ctx), ks(ctx);
    const void *q = qv, *k = kv;
    if (!qb) {
        const float *qf, *kf;
        DG_TRY(kda_qk_widen(ctx, d, qv, kv, qs, ks, &qf, &kf));
        q = qf;
        k = kf;
    }
    switch (d->BT) {
    case 16:
        return intra_bwd_bt<16>(ctx, d, scale, q, k, qb, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG,
                                acc);
    case 32:
        return intra_bwd_bt<32>(ctx, d, scale, q, k, qb, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG,
                                acc);
    default:
        return intra_bwd_bt<64>(ctx, d, scale, q, k, qb, beta, G, Tm, dAqk, dTm, dq, dk, dbeta, dG,
                                acc);
    }
}
