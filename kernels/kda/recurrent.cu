/*
 * kernels/kda/recurrent.cu -- the token-by-token KDA recurrence (kda.md §11.1), forward and
 * backward
 * through time: the ground truth the chunked stages must reproduce on the GPU. CPU twins:
 * dg__kda_recurrent_fwd_f32 / dg__kda_recurrent_bwd_f32 in ops/kda/recurrent.c (states recomputed
 * from checkpoints in the backward, like here).
 *
 * Forward, per sequence and value head, S_{-1} = h0 (or 0):
 *   S'_t = Diag(exp(g_t)) S_{t-1};  e_t = beta_t (v_t - S'_t^T k_t);  S_t = S'_t + k_t e_t^T;
 *   o_t = s S_t^T q_t;  ht = S_{T_n - 1}
 * Backward, token t from last to first, dS = grad of S_t (starts at dht), u = v_t - S'^T k_t:
 *   dS += s q_t dO_t^T                       dq_t = s S_t dO_t
 *   de = dS^T k_t                            dk_t = dS e - beta_t S' de
 *   dbeta_t = de . u                         dv_t = beta_t de
 *   dS' = dS - beta_t k_t de^T               dg_t = rowsum(S' . dS')
 *   dS = Diag(exp g_t) dS'                   (grad of S_{t-1});  dh0 = dS at the sequence start
 * q, k [TT,H,K] (normalised); v, o [TT,HV,V]; g [TT,HV,K] (log decay, not cumulated);
 * beta [TT,HV]; h0, ht [N,HV,K,V]. f32 storage and arithmetic, one f32 FFMA variant in each
 * direction: the tc mode does not apply. K <= 256.
 *
 * Forward kernel: blockIdx = (n, hv, column group); warp w owns 4 state columns, lane l its key
 * rows l + 32b, all in registers; the two sums over K per token are warp shuffles.
 * Backward kernel: every column v of S evolves on its own, so one block handles (sequence, hv,
 * 32-wide value tile): lane = value column, warp w = state rows w, w+8, ... (KPT rows per thread,
 * in registers). Sums over the state rows (S'^T k, dS^T k) cross warps: an 8 x 32 shared array
 * summed in warp order, double-buffered so each needs one barrier. Sums over value columns (dq,
 * dk, dg, dbeta) are warp butterflies per tile; the tiles (and the G value heads of a q/k head
 * for dq, dk) are then summed in a fixed order by kda_sum_parts. dv is complete per tile.
 * States: a first forward pass stores a checkpoint every REC_SEG tokens (scratch, one per
 * segment); then, segment by segment from the last, the segment's states are recomputed into a
 * per-block scratch of REC_SEG x K x 32 floats and walked backwards.
 * Entry points (kda_cuda.h): dg__kda_recurrent_fwd_cuda, dg__kda_recurrent_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

#define KDA_REC_CPW 4   /* forward: state columns per warp */
#define KDA_REC_WARPS 4 /* forward: warps per block: 16 columns per block */

namespace {
constexpr int REC_SEG = 64; /* backward: tokens per checkpoint segment (KDA_REC_SEG on the CPU) */
}

// ---- device helpers

/* One token's operands for one lane: key rows lane + 32b. */
template <int NB> struct kda_rec_tok { float k[NB], q[NB], g[NB], v[KDA_REC_CPW], beta; };

template <int NB>
__device__ __forceinline__ void
kda_rec_load(kda_rec_tok<NB> &x, int64_t t, int H, int hq, int HV, int hv, int K, int V, int col0,
             int lane, const float *__restrict__ q, const float *__restrict__ k,
             const float *__restrict__ v, const float *__restrict__ g,
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

/* Sum of `part` over the 8 warps for this lane's column; every thread gets the result. */
__device__ __forceinline__ float rows_sum(float part, float (*red)[NW][CT], int &rc, int w,
                                          int lane) {
    float(*buf)[CT] = red[rc & 1];
    rc++;
    buf[w][lane] = part;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ww++)
        s += buf[ww][lane];
    return s;
}

// ---- forward kernel

/* blockIdx = (n, hv, column group); warp w of the block owns columns col0..col0+3 of the state,
 * lane l its key rows l + 32b (b < NB = ceil(K/32)), all in registers. The two reductions over K
 * per token are warp shuffles, so warps never wait for each other; the next token's operands
 * are loaded while the current one is processed. */
template <int NB>
__global__ void __launch_bounds__(32 * KDA_REC_WARPS)
    kda_recurrent_fwd_kernel(const int64_t *__restrict__ cu, int H, int HV, int K, int V,
                             float scale, const float *__restrict__ q, const float *__restrict__ k,
                             const float *__restrict__ v, const float *__restrict__ g,
                             const float *__restrict__ beta, const float *__restrict__ h0,
                             float *__restrict__ o, float *__restrict__ ht) {
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
            e[j] = cur.beta * (cur.v[j] - warp_sum(p[j]));
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
            const float s = warp_sum(ov[j]);
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

// ---- backward kernel

template <int KPT>
__global__ void __launch_bounds__(NTH)
    rec_bwd_kernel(Dims d, float scale, const float *q, const float *k, const float *v,
                   const float *g, const float *beta, const float *h0, const float *dO,
                   const float *dht, float *ckpt, float *segbuf, float *dqp, float *dkp, float *dgp,
                   float *dbp, float *dv, float *dh0) {
    __shared__ float red[2][NW][CT];
    const int n = blockIdx.x, hv = blockIdx.y, vt = blockIdx.z, nvt = gridDim.z;
    const int H = d.H, HV = d.HV, K = d.K, V = d.V, hq = hv / d.G;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int vc = vt * CT + lane;
    const bool vok = vc < V;
    const int64_t TT = d.TT, tb = d.cu[n], te = d.cu[n + 1];
    const int64_t nseg = (te - tb + REC_SEG - 1) / REC_SEG;
    int64_t segbase = 0;
    for (int m = 0; m < n; m++)
        segbase += (d.cu[m + 1] - d.cu[m] + REC_SEG - 1) / REC_SEG;
    const int64_t KC = (int64_t)K * CT;
    const int64_t blk = ((int64_t)n * HV + hv) * nvt + vt;
    float *seg = segbuf + blk * REC_SEG * KC;
    const int64_t sb = ((int64_t)n * HV + hv) * K * V; /* h0, dht, dh0 */
    if (dqp)
        dqp += vt * TT * HV * K;
    if (dkp)
        dkp += vt * TT * HV * K;
    if (dgp)
        dgp += vt * TT * HV * K;
    if (dbp)
        dbp += vt * TT * HV;
    int rc = 0;

    /* one forward step of this thread's state entries; every thread takes part (barrier) */
    auto step = [&](float(&S)[KPT], int64_t t) {
        const float *kt = k + (t * H + hq) * K, *gt = g + (t * HV + hv) * K;
        float part = 0.f;
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int a = w + NW * r;
            if (a < K) {
                S[r] *= expf(gt[a]);
                part += S[r] * kt[a];
            }
        }
        const float kS = rows_sum(part, red, rc, w, lane);
        const float vt_ = vok ? v[(t * HV + hv) * V + vc] : 0.f;
        const float e = beta[t * HV + hv] * (vt_ - kS);
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int a = w + NW * r;
            if (a < K)
                S[r] += kt[a] * e;
        }
    };

    float S[KPT];
#pragma unroll
    for (int r = 0; r < KPT; r++) {
        const int a = w + NW * r;
        S[r] = (h0 && vok && a < K) ? h0[sb + (int64_t)a * V + vc] : 0.f;
    }
    for (int64_t t = tb; t < te; t++) {
        if ((t - tb) % REC_SEG == 0) {
            float *ck = ckpt + ((segbase + (t - tb) / REC_SEG) * HV * nvt + hv * nvt + vt) * KC;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int a = w + NW * r;
                if (a < K)
                    ck[a * CT + lane] = S[r];
            }
        }
        if (t + 1 < te) /* the state after the last token is never needed */
            step(S, t);
    }

    float dS[KPT];
#pragma unroll
    for (int r = 0; r < KPT; r++) {
        const int a = w + NW * r;
        dS[r] = (dht && vok && a < K) ? dht[sb + (int64_t)a * V + vc] : 0.f;
    }
    for (int64_t s = nseg - 1; s >= 0; s--) {
        const int64_t ts = tb + s * REC_SEG, tl = ts + REC_SEG < te ? ts + REC_SEG : te;
        const float *ck = ckpt + ((segbase + s) * HV * nvt + hv * nvt + vt) * KC;
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int a = w + NW * r;
            S[r] = a < K ? ck[a * CT + lane] : 0.f;
        }
        for (int64_t t = ts; t < tl; t++) { /* seg[t - ts] = S_{t-1} */
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int a = w + NW * r;
                if (a < K)
                    seg[(t - ts) * KC + a * CT + lane] = S[r];
            }
            if (t + 1 < tl)
                step(S, t);
        }
        for (int64_t t = tl - 1; t >= ts; t--) {
            const float *kt = k + (t * H + hq) * K, *qt = q + (t * H + hq) * K;
            const float *gt = g + (t * HV + hv) * K;
            const float bt = beta[t * HV + hv];
            float eg[KPT], Sd[KPT]; /* exp(g), S' = Diag(exp g) S_{t-1} */
            float part = 0.f;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int a = w + NW * r;
                eg[r] = a < K ? expf(gt[a]) : 0.f;
                Sd[r] = a < K ? eg[r] * seg[(t - ts) * KC + a * CT + lane] : 0.f;
                if (a < K)
                    part += Sd[r] * kt[a];
            }
            const float kS = rows_sum(part, red, rc, w, lane);
            const float u = (vok ? v[(t * HV + hv) * V + vc] : 0.f) - kS;
            const float e = bt * u;
            const float dOv = (dO && vok) ? dO[(t * HV + hv) * V + vc] : 0.f;
            /* dq_t = s S_t dO_t, with S_t = S' + k e^T; dS += s q dO^T; de = dS^T k */
            part = 0.f;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int a = w + NW * r;
                if (a >= K)
                    continue;
                const float St = Sd[r] + kt[a] * e;
                const float pq = warp_sum(St * dOv);
                if (dqp && lane == 0)
                    dqp[(t * HV + hv) * K + a] = scale * pq;
                dS[r] += scale * qt[a] * dOv;
                part += dS[r] * kt[a];
            }
            const float de = rows_sum(part, red, rc, w, lane);
            if (w == 0) {
                const float pb = warp_sum(de * u);
                if (dbp && lane == 0)
                    dbp[t * HV + hv] = pb;
                if (dv && vok)
                    dv[(t * HV + hv) * V + vc] = bt * de;
            }
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int a = w + NW * r;
                if (a >= K)
                    continue;
                const float pk = warp_sum(dS[r] * e - bt * Sd[r] * de);
                const float dSd = dS[r] - bt * kt[a] * de;
                const float pg = warp_sum(Sd[r] * dSd);
                if (lane == 0) {
                    if (dkp)
                        dkp[(t * HV + hv) * K + a] = pk;
                    if (dgp)
                        dgp[(t * HV + hv) * K + a] = pg;
                }
                dS[r] = eg[r] * dSd;
            }
        }
    }
    if (dh0 && vok)
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int a = w + NW * r;
            if (a < K)
                dh0[sb + (int64_t)a * V + vc] = dS[r];
        }
}

// ---- launchers

extern "C" dg_status dg__kda_recurrent_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
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

template <int KPT>
static dg_status rec_launch(dg_ctx *ctx, const Dims &d, int nvt, float scale, const float *q,
                            const float *k, const float *v, const float *g, const float *beta,
                            const float *h0, const float *dO, const float *dht, float *ckpt,
                            float *segbuf, float *dqp, float *dkp, float *dgp, float *dbp,
                            float *dv, float *dh0) {
    rec_bwd_kernel<KPT><<<dim3(d.N, d.HV, nvt), NTH, 0, dg__stream(ctx)>>>(
        d, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp, dkp, dgp, dbp, dv, dh0);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__kda_recurrent_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *dd, float scale,
                                                const float *q, const float *k, const float *v,
                                                const float *g, const float *beta, const float *h0,
                                                const float *dO, const float *dht, float *dq,
                                                float *dk, float *dv, float *dg, float *dbeta,
                                                float *dh0) {
    DG_TRY(check_dims("dg__kda_recurrent_bwd_cuda", dd));
    if (dd->K > 8 * 32)
        return dg__err(DG_ERR_UNSUPPORTED,
                       "dg__kda_recurrent_bwd_cuda: K=%d > 256 is not supported", dd->K);
    if (dd->N == 0)
        return DG_OK;
    const Dims d = make_dims(dd);
    const int nvt = DG_CEIL_DIV(d.V, CT);
    const size_t KC = (size_t)d.K * CT, tk = (size_t)d.TT * d.HV * d.K, tb = (size_t)d.TT * d.HV;
    /* direct writes when nothing needs summing: one value tile (and G = 1 for dq, dk) */
    const bool sum_v = nvt > 1, sum_qk = sum_v || d.G > 1;
    const size_t nck = ((size_t)d.TT / REC_SEG + d.N) * d.HV * nvt * KC;
    const size_t nseg = (size_t)d.N * d.HV * nvt * REC_SEG * KC;
    const size_t npart = (size_t)nvt * ((sum_qk ? 2 * tk : 0) + (sum_v ? tk + tb : 0));
    Scratch scr(ctx);
    DG_TRY(scr.alloc(nck + nseg + npart));
    float *ckpt = scr.f(), *segbuf = ckpt + nck, *p = segbuf + nseg;
    float *dqp = dq, *dkp = dk, *dgp = dg, *dbp = dbeta;
    if (sum_qk) {
        dqp = dq ? p : nullptr;
        dkp = dk ? p + nvt * tk : nullptr;
        p += 2 * nvt * tk;
    }
    if (sum_v) {
        dgp = dg ? p : nullptr;
        dbp = dbeta ? p + nvt * tk : nullptr;
    }
    /* the kernel offsets the partial buffers by its value tile: vt * TT*HV*K (dbeta: vt * TT*HV) */
    dg_status st;
    if (d.K <= 16)
        st = rec_launch<2>(ctx, d, nvt, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp,
                           dkp, dgp, dbp, dv, dh0);
    else if (d.K <= 32)
        st = rec_launch<4>(ctx, d, nvt, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp,
                           dkp, dgp, dbp, dv, dh0);
    else if (d.K <= 64)
        st = rec_launch<8>(ctx, d, nvt, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp,
                           dkp, dgp, dbp, dv, dh0);
    else if (d.K <= 128)
        st = rec_launch<16>(ctx, d, nvt, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp,
                            dkp, dgp, dbp, dv, dh0);
    else
        st = rec_launch<32>(ctx, d, nvt, scale, q, k, v, g, beta, h0, dO, dht, ckpt, segbuf, dqp,
                            dkp, dgp, dbp, dv, dh0);
    DG_TRY(st);
    if (sum_qk && dq)
        DG_TRY(kda_sum_parts(ctx, dq, dqp, d.TT, d.H, d.G, d.K, nvt, (int64_t)tk, 0));
    if (sum_qk && dk)
        DG_TRY(kda_sum_parts(ctx, dk, dkp, d.TT, d.H, d.G, d.K, nvt, (int64_t)tk, 0));
    if (sum_v && dg)
        DG_TRY(kda_sum_parts(ctx, dg, dgp, d.TT, d.HV, 1, d.K, nvt, (int64_t)tk, 0));
    if (sum_v && dbeta)
        DG_TRY(kda_sum_parts(ctx, dbeta, dbp, (int64_t)tb, 1, 1, 1, nvt, (int64_t)tb, 0));
    return DG_OK;
}
