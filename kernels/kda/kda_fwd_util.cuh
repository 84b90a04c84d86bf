/*
 * kernels/kda/kda_fwd_util.cuh -- device helpers shared by the KDA forward kernel files:
 * overflow-free sigmoid/softplus written exactly like the CPU reference (ops/kda/kda.h), the
 * chunk-size dispatch, and the launch sizes every chunk kernel shares.
 */
#ifndef DG_KDA_FWD_UTIL_CUH
#define DG_KDA_FWD_UTIL_CUH

#include "../common.cuh"
#include "kda_cuda.h"

#define KDA_THREADS 256 /* every chunk kernel: 8 warps */
#define KDA_G_FLOOR_F (-128.f) /* per-step log decay floor before the cumsum (as the CPU's) */

__device__ __forceinline__ float kda_dsigmoid(float x) {
    if (x >= 0.f)
        return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}

__device__ __forceinline__ float kda_dsoftplus(float x) {
    return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

/* Run the statements (variadic: they may contain commas) with the compile-time constant BT_ bound to d->BT (16, 32 or 64). */
#define KDA_DISPATCH_BT(BTv, ...)                                                                 \
    do {                                                                                           \
        switch (BTv) {                                                                             \
        case 16: { constexpr int BT_ = 16; __VA_ARGS__; } break;                                          \
        case 32: { constexpr int BT_ = 32; __VA_ARGS__; } break;                                          \
        case 64: { constexpr int BT_ = 64; __VA_ARGS__; } break;                                          \
        default:                                                                                   \
            return dg__err(DG_ERR_ARG, "%s: chunk size BT=%d is not 16, 32 or 64", __func__,       \
                           (int)(BTv));                                                            \
        }                                                                                          \
    } while (0)

/* Arguments every launcher checks first. */
static inline dg_status kda_check_dims(const char *fn, dg_ctx *ctx, const kda_cuda_dims *d) {
    if (!ctx || !d || !d->buf)
        return dg__err(DG_ERR_ARG, "%s: ctx and a dims built by kda_cuda_dims_new are required", fn);
    return DG_OK;
}

/* Ts = (I + Ls)^{-1} for a strictly lower triangular BT x BT Ls (rows past L are zero, so those
 * rows of Ts come out as the identity's), by 16 x 16 blocks: the diagonal blocks are inverted by
 * forward substitution (thread = one column of one block: a chain of at most 120 FMAs instead of
 * the ~2000 of a whole column), then block row I = 1 .. R-1 in turn:
 *   X_IJ = sum_{J <= K < I} L_IK T_KJ,   T_IJ = -T_II X_IJ   (all J < I at once, 256 threads).
 * The same inverse as the column solve up to the order of the sums. Xs: scratch of
 * (BT/16 - 1) * 256 floats. Ends with the caller's __syncthreads. 256 threads. */
template <int BT>
__device__ __forceinline__ void kda_solve_blocked(const float *Ls, float *Ts, float *Xs) {
    constexpr int R = BT / 16;
    const int tid = threadIdx.x;
    if (tid < BT) { /* column c of diagonal block I */
        const int I = tid / 16, c = tid % 16, o = 16 * I;
        float col[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float s = 0.f;
#pragma unroll
            for (int m = 0; m < i; m++)
                s += m >= c ? Ls[(o + i) * BT + o + m] * col[m] : 0.f;
            col[i] = i < c ? 0.f : (i == c ? 1.f : -s);
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
            Ts[(o + i) * BT + o + c] = col[i];
    }
#pragma unroll
    for (int I = 1; I < R; I++) {
        __syncthreads(); /* block rows < I of Ts are final */
        /* X_IJ for J < I: thread tid owns element (a, b) = (tid / 16, tid % 16) of each */
        const int a = tid / 16, b = tid % 16;
        for (int J = 0; J < I; J++) {
            float s = 0.f;
            for (int m = 16 * J; m < 16 * I; m++)
                s += Ls[(16 * I + a) * BT + m] * Ts[m * BT + 16 * J + b];
            Xs[J * 256 + a * 16 + b] = s;
        }
        __syncthreads();
        for (int J = 0; J < I; J++) {
            float s = 0.f;
            for (int m = 0; m <= a; m++)
                s += Ts[(16 * I + a) * BT + 16 * I + m] * Xs[J * 256 + m * 16 + b];
            Ts[(16 * I + a) * BT + 16 * J + b] = -s;
        }
    }
}

/* The end of both intra forward kernels (FFMA and tensor-core): write the L valid rows of Aqk
 * (scaled, j <= i, zeros elsewhere), form Lkk = Diag(beta) P (j < i) in shared memory `Ls`, solve
 * Tm = (I + Lkk)^{-1} by forward substitution into `Ts` (one thread per column, in the CPU's
 * order) and write Tm's rows. accA/accP: this thread's R x R patch (rows ty + 16a, columns
 * tx + 16b) of s-less Araw and P. Ls, Ts: [BT, BT] shared floats. 256 threads (16 x 16). */
template <int BT, int R, bool BLOCKED = false>
__device__ __forceinline__ void kda_intra_finish(const float (&accA)[R][R], const float (&accP)[R][R],
                                                 float *Ls, float *Ts, const float *beta,
                                                 float *Aqk, float *Tm, int64_t t0, int L, int hv,
                                                 int HV, float scale, float *Xs = nullptr) {
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

    if (BLOCKED)
        kda_solve_blocked<BT>(Ls, Ts, Xs);
    else if (tid < L) {
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

#endif /* DG_KDA_FWD_UTIL_CUH */
