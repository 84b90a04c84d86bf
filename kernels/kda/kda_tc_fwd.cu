/*
 * kernels/kda/kda_tc_fwd.cu -- tensor-core (WMMA TF32) variants of the forward stage matmuls,
 * run instead of the FFMA kernels when kda_cuda_dims.tc != 0 (bf16 activations; kda_cuda.h):
 *   N7 output:  O_c = s QG_c h_c + Aqk_c E_c                                    (spec §5.4)
 *   N6 state:   E_c = U_c - W_c h_c,  h_{c+1} = Diag(exp(lambda_c)) h_c + KG_c^T E_c   (§5.3)
 *   N5 wy:      W = (Tm Diag(beta)) (K . exp(G)),  U = (Tm Diag(beta)) V;  KG, QG elementwise
 *   N4 intra:   the off-diagonal 16x16 blocks of Aqk and Lkk (reference-row factorisation)
 *   and the serial state pass of the backward (state_tc_kernel<BWD = true>)
 * Same layouts and results (up to TF32 rounding) as kda_fwd_state.cu / kda_fwd_intra.cu.
 * Fragments m16n16k8 TF32 (P = 1) or 3xTF32 (P = 2) with f32 accumulators, operands staged
 * zero-padded in shared memory (kda_tc.cuh). Warp w of a block owns the 16x16 output tiles
 * w, w + 8, ... of the block's output tile (row-major tile numbering).
 * Exponentials in these kernels use __expf (the hardware ex2 approximation, relative error of a
 * few 1e-6 for the exponents that occur here): far below the TF32 operand rounding (2^-11).
 */
#include "kda_fwd_util.cuh"
#include "kda_mma.cuh"
#include "kda_tc.cuh"

using namespace kdatc;

// ---- CUDA kernels

#define TC_OUT_VT 64 /* output: value columns per block */
#define TC_ST_VT 32  /* state: value columns per block (as the FFMA kernel: parallelism) */
#define TC_KT 64     /* key-dim tile staged per step */
#define TC_WY_CT 64  /* wy: output columns per step */

/* grid (chunk, hv, V / 64). Phase 1: acc = QG h over key tiles of 64 (QG tile [BT][64], h tile
 * [64][64]); acc *= s; phase 2: acc += Aqk E with Aqk masked to j <= i < L (row block ti needs
 * the k-steps j < 16(ti+1) only). Static shared memory: max(BT*72 + 64*72, BT*(BT+8) + BT*72)
 * floats = 36 KB at BT = 64; the result goes out through the same buffer. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    output_fwd_tc_kernel(const int64_t *__restrict__ chunk_t0,
                         const int32_t *__restrict__ chunk_len, int HV, int K, int V, float scale,
                         const float *__restrict__ QG, const float *__restrict__ h,
                         const float *__restrict__ Aqk, const float *__restrict__ E,
                         float *__restrict__ O) {
    constexpr int VT = TC_OUT_VT, KT = TC_KT;
    constexpr int LDQ = KT + TC_PAD, LDV = VT + TC_PAD, LDA = BT + TC_PAD;
    constexpr int NTJ = VT / 16, NTILE = (BT / 16) * NTJ, TPW = (NTILE + 7) / 8;
    constexpr int S1 = BT * LDQ + KT * LDV, S2 = BT * LDA + BT * LDV;
    __shared__ __align__(128) float sm[S1 > S2 ? S1 : S2];
    float *Qs = sm, *Hs = sm + BT * LDQ; /* phase 1 */
    float *As = sm, *Es = sm + BT * LDA; /* phase 2 */
    float *Os = sm;                      /* result */

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * VT;
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int w = threadIdx.x >> 5;
    const int nv = min(VT, V - v0);
    const int64_t rk = (int64_t)HV * K, rv = (int64_t)HV * V;

    Acc acc[TPW];
#pragma unroll
    for (int r = 0; r < TPW; r++)
        wmma::fill_fragment(acc[r], 0.f);
    const float *hc = h + (ch * HV + hv) * (int64_t)K * V + v0;
    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        const int nk = min(KT, K - kt0);
        load_tile<BT, KT, LDQ>(Qs, QG + (t0 * HV + hv) * K + kt0, rk, L, nk);
        load_tile<KT, VT, LDV>(Hs, hc + (int64_t)kt0 * V, V, nk, nv);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < TPW; r++) {
            const int tile = w + 8 * r, ti = tile / NTJ, tj = tile % NTJ;
            if (tile < NTILE)
                mma_k<P, false, RM, RM>(acc[r], Qs + ti * 16 * LDQ, LDQ, Hs + tj * 16, LDV,
                                        (nk + 7) / 8);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < TPW; r++)
#pragma unroll
        for (int t = 0; t < acc[r].num_elements; t++)
            acc[r].x[t] *= scale;

    for (int idx = threadIdx.x; idx < BT * BT; idx += TC_THREADS) {
        const int i = idx / BT, j = idx % BT;
        As[i * LDA + j] = (i < L && j <= i) ? Aqk[((t0 + i) * HV + hv) * BT + j] : 0.f;
    }
    load_tile<BT, VT, LDV>(Es, E + (t0 * HV + hv) * V + v0, rv, L, nv);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        const int tile = w + 8 * r, ti = tile / NTJ, tj = tile % NTJ;
        if (tile < NTILE)
            mma_k<P, false, RM, RM>(acc[r], As + ti * 16 * LDA, LDA, Es + tj * 16, LDV,
                                    2 * (ti + 1));
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TPW; r++) {
        const int tile = w + 8 * r, ti = tile / NTJ, tj = tile % NTJ;
        if (tile < NTILE)
            wmma::store_matrix_sync(Os + ti * 16 * LDV + tj * 16, acc[r], LDV, wmma::mem_row_major);
    }
    __syncthreads();
    store_tile<BT, VT, LDV>(O + (t0 * HV + hv) * V + v0, rv, Os, L, nv);
}

/* The serial state pass of the forward (BWD = false) and of the backward (BWD = true, spec §6.2),
 * which have the same shape:
 *   forward,  chunks in order:    store S = h_c;   X = U  - W  S  -> E;
 *                                 S = exp(lambda) S + KG^T X
 *   backward, chunks in reverse:  store S = dHn_c; X = dE + KG S -> dE_tot;
 *                                 S = exp(lambda) S - W^T X + dh_c
 * i.e. X = X0 + sgnA A1 S, S = exp(lambda) S + Sup_c + sgnB A2^T X, with (A1, A2, sgnA, sgnB) =
 * (W, KG, -, +) forward and (KG, W, +, -) backward. S0 = h0 / dht, Sst = h / dHn scratch, Xo =
 * E / dE_tot, Sfin = ht / dh0; X0, S0, Sup, Sst, Xo, Sfin may be NULL (zero / not stored).
 * grid (sequence, hv, V / 32). The running state S [KP][32] (KP = K rounded up to 64) is f32 in
 * shared memory and is the home of the update's accumulators: each 16x16 tile of S is loaded
 * into an accumulator fragment, gets sgnB A2^T X added, and is stored back. Per chunk:
 *   store S; Xs = X0 tile; warp w < BT/8 owns X tile (w/2, w%2): acc = X0, acc += sgnA A1 S over
 *   key tiles of 64 (A1 tile [BT][64] in Ts); Xs = acc; store Xo; S = exp(lambda) S (+ Sup_c);
 *   for each key tile: Ts = A2 tile, warp w updates S rows kt0 + 16(w/2).., columns 16(w%2)..
 *   with A2^T read as a col_major operand of Ts.
 * Dynamic shared memory: (KP*40 + BT*40 + BT*72 + KP) floats: 49 KB at K = 128, BT = 64;
 * 70 KB at K = 256. */
template <int BT, int P, bool BWD>
__global__ void __launch_bounds__(TC_THREADS)
    state_tc_kernel(const int64_t *__restrict__ chunk_off, const int64_t *__restrict__ chunk_t0,
                    const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                    const float *__restrict__ A1, const float *__restrict__ X0,
                    const float *__restrict__ A2, const float *__restrict__ G,
                    const float *__restrict__ S0, const float *__restrict__ Sup,
                    float *__restrict__ Sst, float *__restrict__ Xo, float *__restrict__ Sfin) {
    constexpr int VT = TC_ST_VT, KT = TC_KT, LDH = VT + TC_PAD, LDT = KT + TC_PAD;
    extern __shared__ __align__(128) float tc_state_smem[];
    const int KP = (K + KT - 1) / KT * KT;
    float *hs = tc_state_smem;   /* [KP][LDH] the running state S */
    float *Es = hs + KP * LDH;   /* [BT][LDH] X */
    float *Ts = Es + BT * LDH;   /* [BT][LDT] key tile of A1 or A2 */
    float *elam = Ts + BT * LDT; /* [KP] exp(lambda) */

    const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VT;
    const int w = threadIdx.x >> 5;
    const int nv = min(VT, V - v0);
    const int64_t rk = (int64_t)HV * K, rv = (int64_t)HV * V, KV = (int64_t)K * V;
    const bool ewarp = w < BT / 8; /* owns an X tile */
    const int eti = w >> 1, etj = w & 1;

    {
        const float *s0 = S0 ? S0 + ((int64_t)n * HV + hv) * KV + v0 : nullptr;
        for (int idx = threadIdx.x; idx < KP * VT; idx += TC_THREADS) {
            const int r = idx / VT, c = idx % VT;
            hs[r * LDH + c] = (s0 && r < K && c < nv) ? s0[(int64_t)r * V + c] : 0.f;
        }
    }

    const int64_t c_beg = chunk_off[n], c_end = chunk_off[n + 1];
    for (int64_t it = 0; it < c_end - c_beg; it++) {
        const int64_t ch = BWD ? c_end - 1 - it : c_beg + it;
        const int64_t t0 = chunk_t0[ch];
        const int L = chunk_len[ch];
        __syncthreads(); /* hs complete (S0 or the last update); Es, Ts, elam free */
        if (Sst) {
            float *sc = Sst + (ch * HV + hv) * KV + v0;
            for (int idx = threadIdx.x; idx < K * VT; idx += TC_THREADS) {
                const int r = idx / VT, c = idx % VT;
                if (c < nv)
                    sc[(int64_t)r * V + c] = hs[r * LDH + c];
            }
        }
        for (int kk = threadIdx.x; kk < KP; kk += TC_THREADS)
            elam[kk] = kk < K ? expf(G[((t0 + L - 1) * HV + hv) * K + kk]) : 0.f;
        load_tile<BT, VT, LDH>(Es, X0 ? X0 + (t0 * HV + hv) * V + v0 : nullptr, rv, X0 ? L : 0, nv);
        __syncthreads();

        /* X = X0 + sgnA A1 S */
        Acc acc;
        if (ewarp)
            wmma::load_matrix_sync(acc, Es + eti * 16 * LDH + etj * 16, LDH, wmma::mem_row_major);
        for (int kt0 = 0; kt0 < K; kt0 += KT) {
            const int nk = min(KT, K - kt0);
            load_tile<BT, KT, LDT>(Ts, A1 + (t0 * HV + hv) * K + kt0, rk, L, nk);
            __syncthreads();
            if (ewarp)
                mma_k<P, !BWD, RM, RM>(acc, Ts + eti * 16 * LDT, LDT, hs + kt0 * LDH + etj * 16,
                                       LDH, (nk + 7) / 8);
            __syncthreads();
        }
        if (ewarp)
            wmma::store_matrix_sync(Es + eti * 16 * LDH + etj * 16, acc, LDH, wmma::mem_row_major);
        __syncthreads();
        if (Xo)
            store_tile<BT, VT, LDH>(Xo + (t0 * HV + hv) * V + v0, rv, Es, L, nv);
        {
            const float *up = Sup ? Sup + (ch * HV + hv) * KV + v0 : nullptr;
            for (int idx = threadIdx.x; idx < KP * VT; idx += TC_THREADS) {
                const int r = idx / VT, c = idx % VT;
                const float add = (up && r < K && c < nv) ? up[(int64_t)r * V + c] : 0.f;
                hs[r * LDH + c] = hs[r * LDH + c] * elam[r] + add;
            }
        }

        /* S += sgnB A2^T X (rows of A2 and X past L are zero) */
        for (int kt0 = 0; kt0 < K; kt0 += KT) {
            const int nk = min(KT, K - kt0);
            load_tile<BT, KT, LDT>(Ts, A2 + (t0 * HV + hv) * K + kt0, rk, L, nk);
            __syncthreads(); /* also: the scaling of hs is complete */
            const int ri = w >> 1, tj = w & 1, r0 = kt0 + 16 * ri;
            if (r0 < K) {
                Acc hacc;
                float *st = hs + r0 * LDH + tj * 16;
                wmma::load_matrix_sync(hacc, st, LDH, wmma::mem_row_major);
                mma_k<P, BWD, CM, RM>(hacc, Ts + 16 * ri, LDT, Es + tj * 16, LDH, (L + 7) / 8);
                wmma::store_matrix_sync(st, hacc, LDH, wmma::mem_row_major);
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (Sfin) {
        float *sf = Sfin + ((int64_t)n * HV + hv) * KV + v0;
        for (int idx = threadIdx.x; idx < K * VT; idx += TC_THREADS) {
            const int r = idx / VT, c = idx % VT;
            if (c < nv)
                sf[(int64_t)r * V + c] = hs[r * LDH + c];
        }
    }
}

/* N4 intra (spec §5.1, §5.2), grid (chunk, hv). Araw[i,j] = sum_d q_i k_j exp(G_i - G_j) (j <= i)
 * and P[i,j] = sum_d k_i k_j exp(G_i - G_j) (j < i), then Tm = (I + Diag(beta) P)^{-1} as in the
 * FFMA kernel. Off-diagonal 16x16 blocks (row block I > column block J) on tensor cores with the
 * reference-row factorisation of §7 rule 2, r = 16 I (the first row of block I):
 *   Araw_IJ = (Q_I . exp(G_I - G_r)) (K_J . exp(G_r - G_J))^T,  P_IJ likewise with K_I,
 * where both exponents are <= 0 (G is non-increasing in a chunk), so no factor exceeds 1 for any
 * gate values. The exponents are clamped at 0 (min(., 0)), which changes nothing for valid rows
 * and keeps zero-padded rows (G = 0 padding past L) at exp(0) times a zero q/k row. Warp p <
 * R(R-1)/2 owns pair p = I(I-1)/2 + J; each k-step loads f32 fragments of q, k, G and of a tile
 * whose 16 rows all hold G_r, applies the factors element by element (fragments of one type
 * share their element-to-position map), then rounds to TF32 (or splits, P = 2). Diagonal blocks:
 * per key tile, when every valid row of every block is within MID_SPAN of its block's middle row
 * (all key columns of the tile), the same products around the middle row (clamped at MID_SPAN,
 * which only zero-padded rows reach), as 3xTF32 by warps 0..R-1; otherwise exact per-pair FFMA
 * (thread (ty, tx) owns (ty + 16a, tx + 16a)), as in the FFMA kernel. The factor split of a
 * product over d may change from one key tile to the next: both factors go into the operands.
 * Static shared memory: one region of 3 BT x 40 + R x 16 x 40 floats (40 KB at BT = 64) holding
 * the q, k, G, G_r key tiles (cp.async 16-byte pieces when K % 4 == 0 and the arrays are aligned:
 * vec), then the off-diagonal results, then Lkk and Tm. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    intra_fwd_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                        int H, int HV, int K, bool vec, float scale, const float *__restrict__ q,
                        const float *__restrict__ k, const float *__restrict__ beta,
                        const float *__restrict__ G, float *__restrict__ Aqk,
                        float *__restrict__ Tm) {
    constexpr int R = BT / 16, KT = 32, LD = KT + TC_PAD, LDS = BT + TC_PAD;
    constexpr int NP = R * (R - 1) / 2;
    constexpr int REGION = 3 * BT * LD + R * 16 * LD;
    static_assert(REGION >= BT * LDS && REGION >= 2 * BT * BT, "the region is reused");
    __shared__ __align__(128) float sm[REGION];
    float *qs = sm, *ks = sm + BT * LD, *gs = sm + 2 * BT * LD; /* [BT][LD] */
    float *grs = sm + 3 * BT * LD;                              /* [R][16][LD] rows = G_16I */

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15, w = tid >> 5;

    /* the block pair of warp w */
    int pI = 1, pJ = w;
    while (pI < R && pJ >= pI) {
        pJ -= pI;
        pI++;
    }
    const bool pwarp = w < NP && 16 * pI < L; /* block I has a valid row (else all zero) */

    float accA[R][R], accP[R][R];
#pragma unroll
    for (int a = 0; a < R; a++)
#pragma unroll
        for (int b = 0; b < R; b++)
            accA[a][b] = accP[a][b] = 0.f;
    Acc cA, cP, dA, dP; /* dA, dP: diagonal block w (w < R), when it is factorised */
    wmma::fill_fragment(cA, 0.f);
    wmma::fill_fragment(cP, 0.f);
    wmma::fill_fragment(dA, 0.f);
    wmma::fill_fragment(dP, 0.f);
    bool dwarp = false; /* this warp's diagonal block took at least one factorised key tile */
    /* Block pair (I, J) over this key tile: A = q_I, k_I times exp(G_I - G_r), B = k_J times
     * exp(G_r - G_J), with G_r the rows of gr (a tile of 16 copies of one row); exponents
     * clamped at cap (0 off the diagonal, where both factors are <= 1; MID_SPAN on it, which
     * only zero-padded rows past L can reach). */
    auto pair_mma = [&](Acc &a, Acc &p_, int I, int J, const float *gr, float cap, int kt0,
                        auto pconst) {
        constexpr int PP = decltype(pconst)::value;
        const float *qI = qs + 16 * I * LD, *kI = ks + 16 * I * LD, *gI = gs + 16 * I * LD;
        const float *kJ = ks + 16 * J * LD, *gJ = gs + 16 * J * LD;
        for (int s8 = 0; s8 < KT / 8 && kt0 + 8 * s8 < K; s8++) {
            FragA<RM> fq, fk, fg, fr;
            FragB<CM> bk, bg, br;
            wmma::load_matrix_sync(fq, qI + 8 * s8, LD);
            wmma::load_matrix_sync(fk, kI + 8 * s8, LD);
            wmma::load_matrix_sync(fg, gI + 8 * s8, LD);
            wmma::load_matrix_sync(fr, gr + 8 * s8, LD);
            wmma::load_matrix_sync(bk, kJ + 8 * s8, LD); /* B(d, j) = k_j[d] */
            wmma::load_matrix_sync(bg, gJ + 8 * s8, LD);
            wmma::load_matrix_sync(br, gr + 8 * s8, LD); /* B(d, j) = G_r[d] */
#pragma unroll
            for (int t = 0; t < fq.num_elements; t++) {
                const float f = __expf(fminf(fg.x[t] - fr.x[t], cap));
                fq.x[t] *= f;
                fk.x[t] *= f;
            }
#pragma unroll
            for (int t = 0; t < bk.num_elements; t++)
                bk.x[t] *= __expf(fminf(br.x[t] - bg.x[t], cap));
            mma_frag<PP>(a, fq, bk);
            mma_frag<PP>(p_, fk, bk);
        }
    };

    for (int kt0 = 0; kt0 < K; kt0 += KT) {
        if (vec) { /* 16-byte pieces all in flight at once; rows >= L, columns >= K zero */
            kdamma::tile_async<BT, KT, LD, TC_THREADS>(qs, q + (t0 * H + hq) * K, (int64_t)H * K, L,
                                                      kt0, K);
            kdamma::tile_async<BT, KT, LD, TC_THREADS>(ks, k + (t0 * H + hq) * K, (int64_t)H * K, L,
                                                      kt0, K);
            kdamma::tile_async<BT, KT, LD, TC_THREADS>(gs, G + (t0 * HV + hv) * K,
                                                      (int64_t)HV * K, L, kt0, K);
            kdamma::cp_async_commit();
            kdamma::cp_async_wait<0>();
            __syncthreads();
            for (int idx = tid; idx < R * 16 * KT; idx += TC_THREADS) {
                const int I = idx / (16 * KT), m = (idx / KT) % 16, e = idx % KT;
                grs[(I * 16 + m) * LD + e] = 16 * I < L ? gs[16 * I * LD + e] : 0.f;
            }
        } else {
            for (int idx = tid; idx < BT * KT; idx += TC_THREADS) {
                const int i = idx / KT, e = idx % KT;
                const bool ok = i < L && kt0 + e < K;
                const int64_t oq = ((t0 + i) * H + hq) * K + kt0 + e;
                const int64_t og = ((t0 + i) * HV + hv) * K + kt0 + e;
                qs[i * LD + e] = ok ? q[oq] : 0.f;
                ks[i * LD + e] = ok ? k[oq] : 0.f;
                gs[i * LD + e] = ok ? G[og] : 0.f;
            }
            for (int idx = tid; idx < R * 16 * KT; idx += TC_THREADS) {
                const int I = idx / (16 * KT), m = (idx / KT) % 16, e = idx % KT;
                const bool ok = 16 * I < L && kt0 + e < K;
                grs[(I * 16 + m) * LD + e] =
                    ok ? G[((t0 + 16 * I) * HV + hv) * K + kt0 + e] : 0.f;
            }
        }
        __syncthreads();

        /* off-diagonal blocks: reference-row factorised tensor-core products */
        if (pwarp)
            pair_mma(cA, cP, pI, pJ, grs + 16 * pI * LD, 0.f, kt0,
                     std::integral_constant<int, P>());

        /* diagonal blocks: factorised around their middle rows when every |G_j - G_mid| of the
         * tile's valid rows is <= MID_SPAN (block-wide decision), else exact exponentials,
         * masked in the exponent above the diagonal */
        bool fast = true;
        for (int idx = tid; idx < BT * KT; idx += TC_THREADS) {
            const int i = idx / KT, e = idx % KT, a = i / 16, mid = min(16 * a + 8, L - 1);
            if (i < L && fabsf(gs[i * LD + e] - gs[mid * LD + e]) > kdamma::MID_SPAN)
                fast = false;
        }
        fast = __syncthreads_and(fast);
        if (fast) {
            for (int idx = tid; idx < R * 16 * KT; idx += TC_THREADS) {
                const int I = idx / (16 * KT), m = (idx / KT) % 16, e = idx % KT;
                const int mid = min(16 * I + 8, L - 1);
                grs[(I * 16 + m) * LD + e] = 16 * I < L ? gs[mid * LD + e] : 0.f;
            }
            __syncthreads();
            if (w < R && 16 * w < L) {
                pair_mma(dA, dP, w, w, grs + 16 * w * LD, kdamma::MID_SPAN, kt0,
                         std::integral_constant<int, 2>());
                dwarp = true;
            }
        } else {
#pragma unroll 4
            for (int e = 0; e < KT; e++) {
#pragma unroll
                for (int a = 0; a < R; a++) {
                    const int i = ty + 16 * a, j = tx + 16 * a;
                    const float dg = tx > ty ? -INFINITY : gs[i * LD + e] - gs[j * LD + e];
                    const float x = ks[j * LD + e] * __expf(dg);
                    accA[a][a] += qs[i * LD + e] * x;
                    accP[a][a] += ks[i * LD + e] * x;
                }
            }
        }
        __syncthreads();
    }

    /* tensor-core results into the owners' registers, through the region: off-diagonal blocks
     * replace, diagonal blocks add to the exact tiles' sums (on and below the diagonal) */
    float *Ss = sm; /* [BT][LDS] */
    const bool anyd = __syncthreads_or(dwarp);
    for (int pass = 0; pass < 2; pass++) {
        if (pwarp) {
            if (pass)
                wmma::store_matrix_sync(Ss + 16 * pI * LDS + 16 * pJ, cP, LDS, wmma::mem_row_major);
            else
                wmma::store_matrix_sync(Ss + 16 * pI * LDS + 16 * pJ, cA, LDS, wmma::mem_row_major);
        }
        if (anyd && w < R)
            wmma::store_matrix_sync(Ss + 16 * w * LDS + 16 * w, pass ? dP : dA, LDS,
                                    wmma::mem_row_major);
        __syncthreads();
#pragma unroll
        for (int a = 0; a < R; a++) {
#pragma unroll
            for (int b = 0; b < a; b++) {
                /* blocks with no valid row were not stored: their rows are never used */
                const int i = ty + 16 * a, j = tx + 16 * b;
                const float x = 16 * a < L ? Ss[i * LDS + j] : 0.f;
                if (pass)
                    accP[a][b] = x;
                else
                    accA[a][b] = x;
            }
            if (anyd && 16 * a < L && tx <= ty) {
                const float x = Ss[(ty + 16 * a) * LDS + tx + 16 * a];
                if (pass)
                    accP[a][a] += x;
                else
                    accA[a][a] += x;
            }
        }
        __syncthreads();
    }

    /* Aqk rows, Lkk, the solve and Tm rows: as the FFMA kernel */
    /* the block solve (kda_solve_blocked) takes its scratch behind Lkk and Tm */
    static_assert(REGION >= 2 * BT * BT + (R - 1) * 256, "the block solve's scratch fits");
    kda_intra_finish<BT, R, true>(accA, accP, sm, sm + BT * BT, beta, Aqk, Tm, t0, L, hv, HV,
                                  scale, sm + 2 * BT * BT);
}

/* grid (chunk, hv). KG, QG elementwise as in the FFMA kernel; then W, U = Tb X with Tb = Tm
 * Diag(beta) staged [BT][BT+8] (zero above the diagonal and past L) and X = K exp(G) (resp. V)
 * in column tiles of 64 [BT][72]; row block ti of Tb needs the k-steps j < 16(ti+1) only.
 * Static shared memory 2 x BT x 72 floats (36 KB at BT = 64); results go out through Xs. */
template <int BT, int P>
__global__ void __launch_bounds__(TC_THREADS)
    wy_fwd_tc_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                     int H, int HV, int K, int V, const float *__restrict__ q,
                     const float *__restrict__ k, const float *__restrict__ v,
                     const float *__restrict__ beta, const float *__restrict__ G,
                     const float *__restrict__ Tm, float *__restrict__ W, float *__restrict__ U,
                     float *__restrict__ KG, float *__restrict__ QG) {
    constexpr int CT = TC_WY_CT, LDB = BT + TC_PAD, LDX = CT + TC_PAD;
    constexpr int NTJ = CT / 16, NTILE = (BT / 16) * NTJ, TPW = (NTILE + 7) / 8;
    __shared__ __align__(128) float Tb[BT * LDB];
    __shared__ __align__(128) float Xs[BT * LDX];

    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    const int tid = threadIdx.x, w = tid >> 5;

    kda_wy_gates<TC_THREADS>(q, k, G, KG, QG, t0, L, hv, hq, H, HV, K);
    if (!W && !U)
        return;

    for (int idx = tid; idx < BT * BT; idx += TC_THREADS) {
        const int i = idx / BT, j = idx % BT;
        float t = 0.f;
        if (i < L && j <= i)
            t = Tm[((t0 + i) * HV + hv) * BT + j] * beta[(t0 + j) * HV + hv];
        Tb[i * LDB + j] = t;
    }

    for (int pass = 0; pass < 2; pass++) {
        float *dst = pass == 0 ? W : U;
        const int D = pass == 0 ? K : V;
        if (!dst)
            continue;
        for (int e0 = 0; e0 < D; e0 += CT) {
            const int ne = min(CT, D - e0);
            __syncthreads(); /* Tb written / Xs of the previous tile stored out */
            for (int idx = tid; idx < BT * CT; idx += TC_THREADS) {
                const int j = idx / CT, e = idx % CT;
                float x = 0.f;
                if (j < L && e < ne) {
                    if (pass == 0)
                        x = k[((t0 + j) * H + hq) * K + e0 + e] *
                            __expf(G[((t0 + j) * HV + hv) * K + e0 + e]);
                    else
                        x = v[((t0 + j) * HV + hv) * V + e0 + e];
                }
                Xs[j * LDX + e] = x;
            }
            __syncthreads();
            Acc acc[TPW];
#pragma unroll
            for (int r = 0; r < TPW; r++) {
                const int tile = w + 8 * r, ti = tile / NTJ, tj = tile % NTJ;
                if (tile < NTILE) {
                    wmma::fill_fragment(acc[r], 0.f);
                    mma_k<P, false, RM, RM>(acc[r], Tb + ti * 16 * LDB, LDB, Xs + tj * 16, LDX,
                                            2 * (ti + 1));
                }
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < TPW; r++) {
                const int tile = w + 8 * r, ti = tile / NTJ, tj = tile % NTJ;
                if (tile < NTILE)
                    wmma::store_matrix_sync(Xs + ti * 16 * LDX + tj * 16, acc[r], LDX,
                                            wmma::mem_row_major);
            }
            __syncthreads();
            store_tile<BT, CT, LDX>(dst + (t0 * HV + hv) * D + e0, (int64_t)HV * D, Xs, L, ne);
        }
    }
}

/* N7 on mma.sync with cp.async stages (kda_mma.cuh), TF32 only: grid (chunk, hv, V / 64),
 * O = s QG h_c + Aqk E for the block's 64 value columns (both products accumulate into one
 * register tile; Aqk is read for j <= i only, E rows past L are zero-filled).
 * Needs K, V % 4 == 0 and 16-byte aligned arrays (checked by the launcher). */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    output_fwd_mma_kernel(const int64_t *__restrict__ chunk_t0,
                          const int32_t *__restrict__ chunk_len, int HV, int K, int V,
                          float scale, const float *__restrict__ QG, const float *__restrict__ h,
                          const float *__restrict__ Aqk, const float *__restrict__ E,
                          float *__restrict__ O) {
    constexpr int NTW = kdamma::AbTile<BT>::NTW;
    __shared__ __align__(16) float sm[kdamma::gemm_smem<BT, true, false>()];
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, v0 = blockIdx.z * kdamma::AB_N;
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
    kdamma::store_acc<BT>(acc, O + t0 * rv + (int64_t)hv * V + v0, rv, L, nv, 1.f);
}

/* N5 on mma.sync (TF32 only), grid (chunk, hv, K / 64 + V / 64): block z < K / 64 makes the
 * 64 key columns e0 = 64 z of KG, QG and W = Tm (Diag(beta) K exp(G)); the others a 64-column
 * tile of U = Tm (Diag(beta) V). Tm (read for j <= i, rows past L zero) and the k / G or v tile
 * come in with cp.async; the elementwise part runs on the staged tile, which is then turned into
 * X in place and multiplied. Dynamic shared memory: Tm [BT][BT + 4], X and G [BT][72] floats
 * (54 KB at BT = 64). Needs K, V % 4 == 0 and 16-byte aligned arrays (the launcher checks). */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    wy_fwd_mma_kernel(const int64_t *__restrict__ chunk_t0, const int32_t *__restrict__ chunk_len,
                      int H, int HV, int K, int V, const float *__restrict__ q,
                      const float *__restrict__ k, const float *__restrict__ v,
                      const float *__restrict__ beta, const float *__restrict__ G,
                      const float *__restrict__ Tm, float *__restrict__ W, float *__restrict__ U,
                      float *__restrict__ KG, float *__restrict__ QG) {
    using namespace kdamma;
    constexpr int LDT = BT + 4, LDX = AB_LDB, NT = AB_THREADS;
    extern __shared__ __align__(16) float wy_smem[];
    float *Ts = wy_smem, *Xs = Ts + BT * LDT, *Gs = Xs + BT * LDX;
    const int64_t ch = blockIdx.x;
    const int hv = blockIdx.y, hq = hv / (HV / H), nK = DG_CEIL_DIV(K, AB_N);
    const bool wt = (int)blockIdx.z < nK; /* a W tile (with KG, QG), else a U tile */
    const int c0 = AB_N * (wt ? (int)blockIdx.z : (int)blockIdx.z - nK), D = wt ? K : V;
    const int nc = min(AB_N, D - c0);
    const int64_t t0 = chunk_t0[ch];
    const int L = chunk_len[ch];
    float *dst = wt ? W : U;
    if (wt ? !W && !KG && !QG : !U)
        return; /* nothing asked of this tile (its inputs may be NULL then) */
    tile_async<BT, BT, LDT, NT>(Ts, Tm + (t0 * HV + hv) * BT, (int64_t)HV * BT, L, 0, BT);
    if (wt) {
        tile_async<BT, AB_N, LDX, NT>(Xs, k + (t0 * H + hq) * K, (int64_t)H * K, L, c0, K);
        tile_async<BT, AB_N, LDX, NT>(Gs, G + (t0 * HV + hv) * K, (int64_t)HV * K, L, c0, K);
    } else {
        tile_async<BT, AB_N, LDX, NT>(Xs, v + (t0 * HV + hv) * V, (int64_t)HV * V, L, c0, V);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int idx = threadIdx.x; idx < L * AB_N; idx += NT) {
        const int j = idx / AB_N, e = idx % AB_N;
        if (e >= nc)
            continue;
        const float bj = beta[(t0 + j) * HV + hv];
        float x = Xs[j * LDX + e];
        if (wt) {
            const float gj = Gs[j * LDX + e], lam = Gs[(L - 1) * LDX + e];
            const int64_t og = ((t0 + j) * HV + hv) * K + c0 + e;
            if (KG)
                KG[og] = x * __expf(lam - gj);
            if (QG)
                QG[og] = q[((t0 + j) * H + hq) * K + c0 + e] * __expf(gj);
            x = bj * x * __expf(gj);
        } else {
            x = bj * x;
        }
        Xs[j * LDX + e] = x; /* rows past L stay zero */
    }
    if (!dst)
        return; /* block-uniform */
    __syncthreads();
    float acc[AbTile<BT>::NTW][4] = {};
    mma_stage<BT, true, false, 1, BT>(acc, Ts, LDT, Xs, LDX, 0);
    store_acc<BT>(acc, dst + (t0 * HV + hv) * D + c0, (int64_t)HV * D, L, nc, 1.f);
}

// ---- kernel launchers (called by the public launchers when d->tc != 0; arguments checked)

dg_status kda_intra_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *q,
                           const float *k, const float *beta, const float *G, float *Aqk,
                           float *Tm) {
    if (d->NC == 0)
        return DG_OK;
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    auto al = [](const void *ptr) { return ((uintptr_t)ptr & 15) == 0; };
    const bool vec = d->K % 4 == 0 && al(q) && al(k) && al(G); /* cp.async tile loads */
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_P(d->tc, {
                        intra_fwd_tc_kernel<BT_, P_><<<grid, TC_THREADS, 0, dg__stream(ctx)>>>(
                            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, vec, scale, q, k, beta,
                            G, Aqk, Tm);
                        DG_CHECK_LAUNCH();
                    }));
    return DG_OK;
}

dg_status kda_output_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const float *QG,
                            const float *h, const float *Aqk, const float *E, float *O) {
    if (d->NC == 0)
        return DG_OK;
    dim3 grid((unsigned)d->NC, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, TC_OUT_VT));
    auto al = [](const void *p) { return ((uintptr_t)p & 15) == 0; };
    if (d->tc == 1 && d->K % 4 == 0 && d->V % 4 == 0 && al(QG) && al(h) && al(Aqk) && al(E) &&
        al(O)) {
        KDA_DISPATCH_BT(d->BT, {
            output_fwd_mma_kernel<BT_><<<grid, kdamma::AB_THREADS, 0, dg__stream(ctx)>>>(
                d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, h, Aqk, E, O);
            DG_CHECK_LAUNCH();
        });
        return DG_OK;
    }
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_P(d->tc, {
                        output_fwd_tc_kernel<BT_, P_><<<grid, TC_THREADS, 0, dg__stream(ctx)>>>(
                            d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, scale, QG, h, Aqk, E, O);
                        DG_CHECK_LAUNCH();
                    }));
    return DG_OK;
}

/* The serial state pass, forward or backward (operands as in state_tc_kernel). */
template <bool BWD>
static dg_status state_tc_launch(dg_ctx *ctx, const kda_cuda_dims *d, const float *A1,
                                 const float *X0, const float *A2, const float *G, const float *S0,
                                 const float *Sup, float *Sst, float *Xo, float *Sfin) {
    const int KP = DG_CEIL_DIV(d->K, TC_KT) * TC_KT;
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, TC_ST_VT));
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_P(d->tc, {
                        const size_t smem =
                            sizeof(float) * ((size_t)(KP + BT_) * (TC_ST_VT + TC_PAD) +
                                             (size_t)BT_ * (TC_KT + TC_PAD) + (size_t)KP);
                        if (smem > 48 * 1024)
                            DG_CHECK_CUDA(cudaFuncSetAttribute(
                                state_tc_kernel<BT_, P_, BWD>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                        state_tc_kernel<BT_, P_, BWD><<<grid, TC_THREADS, smem, dg__stream(ctx)>>>(
                            d->chunk_off, d->chunk_t0, d->chunk_len, d->HV, d->K, d->V, A1, X0, A2,
                            G, S0, Sup, Sst, Xo, Sfin);
                        DG_CHECK_LAUNCH();
                    }));
    return DG_OK;
}

dg_status kda_state_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *U,
                           const float *KG, const float *G, const float *h0, float *h, float *E,
                           float *ht) {
    if (kda_state_mma_fits(d, W, U, KG, G, h0, nullptr, h, E, ht))
        return kda_state_mma(ctx, d, 0, W, U, KG, G, h0, nullptr, h, E, ht);
    return state_tc_launch<false>(ctx, d, W, U, KG, G, h0, nullptr, h, E, ht);
}

dg_status kda_state_seq_bwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *W, const float *KG,
                               const float *G, const float *dh, const float *dE, const float *dht,
                               float *dEtot, float *dHs, float *dh0) {
    if (kda_state_mma_fits(d, KG, dE, W, G, dht, dh, dHs, dEtot, dh0))
        return kda_state_mma(ctx, d, 1, KG, dE, W, G, dht, dh, dHs, dEtot, dh0);
    return state_tc_launch<true>(ctx, d, KG, dE, W, G, dht, dh, dHs, dEtot, dh0);
}

dg_status kda_wy_fwd_tc(dg_ctx *ctx, const kda_cuda_dims *d, const float *q, const float *k,
                        const float *v, const float *beta, const float *G, const float *Tm,
                        float *W, float *U, float *KG, float *QG) {
    if (d->NC == 0)
        return DG_OK;
    auto al = [](const void *p) { return ((uintptr_t)p & 15) == 0; };
    if (d->tc == 1 && d->K % 4 == 0 && d->V % 4 == 0 && al(q) && al(k) && al(v) && al(G) &&
        al(Tm)) {
        const unsigned nz = (unsigned)(DG_CEIL_DIV(d->K, kdamma::AB_N) + DG_CEIL_DIV(d->V, kdamma::AB_N));
        KDA_DISPATCH_BT(d->BT, {
            const size_t smem =
                sizeof(float) * ((size_t)BT_ * (BT_ + 4) + 2 * (size_t)BT_ * kdamma::AB_LDB);
            DG_TRY(dg__smem_opt_in((const void *)wy_fwd_mma_kernel<BT_>, smem));
            wy_fwd_mma_kernel<BT_><<<dim3((unsigned)d->NC, (unsigned)d->HV, nz),
                                     kdamma::AB_THREADS, smem, dg__stream(ctx)>>>(
                d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, d->V, q, k, v, beta, G, Tm, W, U, KG,
                QG);
            DG_CHECK_LAUNCH();
        });
        return DG_OK;
    }
    dim3 grid((unsigned)d->NC, (unsigned)d->HV);
    KDA_DISPATCH_BT(d->BT, KDA_DISPATCH_P(d->tc, {
                        wy_fwd_tc_kernel<BT_, P_><<<grid, TC_THREADS, 0, dg__stream(ctx)>>>(
                            d->chunk_t0, d->chunk_len, d->H, d->HV, d->K, d->V, q, k, v, beta, G,
                            Tm, W, U, KG, QG);
                        DG_CHECK_LAUNCH();
                    }));
    return DG_OK;
}
