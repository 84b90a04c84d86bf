/*
 * kernels/kda/kda_recurrent_fwd.cu -- the token-by-token KDA recurrence (spec §2), the ground
 * truth the chunked stages must reproduce on the GPU:
 *   S'_t = Diag(exp(g_t)) S_{t-1};  e_t = beta_t (v_t - S'_t^T k_t);  S_t = S'_t + k_t e_t^T;
 *   o_t = s S_t^T q_t;  S_{-1} = h0 (or 0), ht = S_{T_n - 1}
 * q, k [TT,H,K] (normalised); v, o [TT,HV,V]; g [TT,HV,K] (log decay, not cumulated);
 * beta [TT,HV]; h0, ht [N,HV,K,V]. f32 storage and arithmetic.
 */
#include "kda_fwd_util.cuh"

// ---- CUDA kernels

#define KDA_REC_CPW 4   /* state columns per warp */
#define KDA_REC_WARPS 4 /* warps per block: 16 columns per block */

/* One token's operands for one lane: key rows lane + 32b. */
template <int NB>
struct kda_rec_tok {
    float k[NB], q[NB], g[NB], v[KDA_REC_CPW], beta;
};

template <int NB>
__device__ __forceinline__ void kda_rec_load(kda_rec_tok<NB> &x, int64_t t, int H, int hq, int HV,
                                             int hv, int K, int V, int col0, int lane,
                                             const float *__restrict__ q,
                                             const float *__restrict__ k,
                                             const float *__restrict__ v,
                                             const float *__restrict__ g,
                                             const float *__restrict__ beta) {
#pragma unroll
    for (int b = 0; b < NB; b++) {
        const int kk = lane + 32 * b;
        const bool ok = kk < K;
        x.k[b] = ok ? k[(t * H + hq) * K + kk] : 0.f;
        x.q[b] = ok ? q[(t * H + hq) * K + kk] : 0.f;
        x.g[b] = ok ? g[(t * HV + hv) * K + kk] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < KDA_REC_CPW; j++)
        x.v[j] = col0 + j < V ? v[(t * HV + hv) * V + col0 + j] : 0.f;
    x.beta = beta[t * HV + hv];
}

/* Butterfly sum over the warp: every lane gets the total (a fixed order: deterministic). */
__device__ __forceinline__ float kda_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* blockIdx = (n, hv, column group); warp w of the block owns columns col0..col0+3 of the state,
 * lane l its key rows l + 32b (b < NB = ceil(K/32)), all in registers. The two reductions over K
 * per token are warp shuffles, so warps never wait for each other; the next token's operands
 * are loaded while the current one is processed. */
template <int NB>
__global__ void __launch_bounds__(32 * KDA_REC_WARPS)
    kda_recurrent_fwd_kernel(const int64_t *__restrict__ cu, int H, int HV, int K, int V,
                             float scale, const float *__restrict__ q,
                             const float *__restrict__ k, const float *__restrict__ v,
                             const float *__restrict__ g, const float *__restrict__ beta,
                             const float *__restrict__ h0, float *__restrict__ o,
                             float *__restrict__ ht) {
    constexpr int CPW = KDA_REC_CPW;
    const int n = blockIdx.x, hv = blockIdx.y, hq = hv / (HV / H);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col0 = (blockIdx.z * KDA_REC_WARPS + w) * CPW;
    if (col0 >= V) /* whole warp; no block-level barriers below */
        return;

    float S[NB][CPW];
    const float *h0n = h0 ? h0 + ((int64_t)n * HV + hv) * K * V : nullptr;
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            const int kk = lane + 32 * b;
            S[b][j] = (h0n && kk < K && col0 + j < V) ? h0n[(int64_t)kk * V + col0 + j] : 0.f;
        }

    const int64_t tb = cu[n], te = cu[n + 1];
    kda_rec_tok<NB> cur, nxt;
    if (tb < te)
        kda_rec_load<NB>(cur, tb, H, hq, HV, hv, K, V, col0, lane, q, k, v, g, beta);
    for (int64_t t = tb; t < te; t++) {
        if (t + 1 < te)
            kda_rec_load<NB>(nxt, t + 1, H, hq, HV, hv, K, V, col0, lane, q, k, v, g, beta);
        float p[CPW];
#pragma unroll
        for (int j = 0; j < CPW; j++)
            p[j] = 0.f;
#pragma unroll
        for (int b = 0; b < NB; b++) {
            const float dec = expf(cur.g[b]);
#pragma unroll
            for (int j = 0; j < CPW; j++) {
                S[b][j] *= dec;
                p[j] += S[b][j] * cur.k[b];
            }
        }
        float e[CPW], ov[CPW];
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            e[j] = cur.beta * (cur.v[j] - kda_warp_sum(p[j]));
            ov[j] = 0.f;
        }
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int j = 0; j < CPW; j++) {
                S[b][j] += cur.k[b] * e[j];
                ov[j] += S[b][j] * cur.q[b];
            }
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            const float s = kda_warp_sum(ov[j]);
            if (lane == j && col0 + j < V)
                o[(t * HV + hv) * V + col0 + j] = scale * s;
        }
        cur = nxt;
    }

    if (ht) {
        float *htn = ht + ((int64_t)n * HV + hv) * K * V;
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int j = 0; j < CPW; j++) {
                const int kk = lane + 32 * b;
                if (kk < K && col0 + j < V)
                    htn[(int64_t)kk * V + col0 + j] = S[b][j];
            }
    }
}

// ---- kernel launchers

extern "C" dg_status kda_recurrent_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                            const float *q, const float *k, const float *v,
                                            const float *g, const float *beta, const float *h0,
                                            float *o, float *ht) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!q || !k || !v || !g || !beta || !o)
        return dg__err(DG_ERR_ARG, "%s: q, k, v, g, beta and o are required (h0, ht optional)",
                       __func__);
    const int cols = KDA_REC_CPW * KDA_REC_WARPS;
    dim3 grid((unsigned)d->N, (unsigned)d->HV, (unsigned)DG_CEIL_DIV(d->V, cols));
    const int threads = 32 * KDA_REC_WARPS;
#define KDA_REC_LAUNCH(NBv)                                                                        \
    kda_recurrent_fwd_kernel<NBv><<<grid, threads, 0, dg__stream(ctx)>>>(                          \
        d->cu, d->H, d->HV, d->K, d->V, scale, q, k, v, g, beta, h0, o, ht)
    if (d->K <= 32)
        KDA_REC_LAUNCH(1);
    else if (d->K <= 64)
        KDA_REC_LAUNCH(2);
    else if (d->K <= 128)
        KDA_REC_LAUNCH(4);
    else if (d->K <= 256)
        KDA_REC_LAUNCH(8);
    else
        return dg__err(DG_ERR_ARG, "%s: K=%d > 256 is not supported", __func__, d->K);
#undef KDA_REC_LAUNCH
    DG_CHECK_LAUNCH();
    return DG_OK;
}
