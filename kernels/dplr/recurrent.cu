/*
 * kernels/dplr/recurrent.cu -- the token-by-token DPLR recurrence (dplr.md D1), forward and
 * backward through time: the ground truth the chunked stages must reproduce on the GPU. CPU
 * twins: dg__dplr_recurrent_fwd_f32 / dg__dplr_recurrent_bwd_f32 in ops/dplr/recurrent.c (states
 * recomputed from checkpoints in the backward, as here).
 *
 * Forward, per sequence and head, S = h0 (or 0):
 *   p = S^T a_t (the undecayed S_{t-1});  S = Diag(exp(gk_t)) S + b_t p^T + k_t v_t^T;
 *   o_t = s S^T q_t;  ht = S at the end
 * Backward, t from last to first, dS = the gradient of S_t (starts at dht), Sp = S_{t-1}:
 *   dS += s q_t dO_t^T, dq_t = s S_t dO_t;  dk_t = dS v_t, dv_t = dS^T k_t
 *   db_t = dS p, dp = dS^T b_t;  da_t = Sp dp;  dgk_t = exp(gk_t) . rowsum(Sp . dS)
 *   dS = Diag(exp(gk_t)) dS + a_t dp^T;  dh0 = dS at the sequence start
 * q, k, a, b, gk [TT,H,K], v, o, dO [TT,H,V] are f32 or bf16 (TI: read as stored, o written in
 * that dtype); h0, ht, dht, dh0 [N,H,K,V] and the gradients are f32. K <= 256.
 *
 * Forward kernel: blockIdx = (n, h, column group); warp w owns 4 state columns, lane l its key
 * rows l + 32b, all in registers; the two sums over K per token are warp shuffles.
 * Backward kernel (as KDA's): block per (sequence, head, 32-wide value tile), lane = value
 * column, warp w = state rows w, w + 8, ... (KPT rows per thread, in registers). Sums over the
 * state rows (p, dv, dp) cross warps: an 8 x 32 shared array summed in warp order,
 * double-buffered (dplr::rows_sum). Sums over value columns (dq, dk, db, da, dgk) are warp
 * butterflies per tile; the tiles are then summed in a fixed order by kda_sum_parts. dv is
 * complete per tile. States: a first forward pass stores a checkpoint every REC_SEG tokens; then,
 * segment by segment from the last, the segment's states are recomputed into a per-block scratch
 * of REC_SEG x K x 32 floats and walked backwards.
 * Entry points (dplr_cuda.h): dg__dplr_recurrent_fwd_cuda, dg__dplr_recurrent_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

namespace {
constexpr int REC_CPW = 4;   /* forward: state columns per warp */
constexpr int REC_WARPS = 4; /* forward: warps per block (16 columns per block) */
constexpr int REC_SEG = 64;  /* backward: tokens per checkpoint segment (DPLR_REC_SEG on the CPU) */
} // namespace

// ---- forward kernel

template <int NB, class TI>
__global__ void __launch_bounds__(32 * REC_WARPS)
    dplr_rec_fwd_kernel(Dims d, float scale, const TI *__restrict__ q, const TI *__restrict__ k,
                        const TI *__restrict__ v, const TI *__restrict__ a,
                        const TI *__restrict__ b, const TI *__restrict__ gk,
                        const float *__restrict__ h0, TI *__restrict__ o, float *__restrict__ ht) {
    constexpr int CPW = REC_CPW;
    const int n = blockIdx.x, h = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col0 = (blockIdx.z * REC_WARPS + wp) * CPW;
    if (col0 >= V) /* whole warp; no block-level barriers below */
        return;
    const int64_t sb = ((int64_t)n * H + h) * K * V;

    float S[NB][CPW];
#pragma unroll
    for (int bb = 0; bb < NB; bb++)
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            const int x = lane + 32 * bb;
            S[bb][j] = (h0 && x < K && col0 + j < V) ? h0[sb + (int64_t)x * V + col0 + j] : 0.f;
        }

    for (int64_t t = d.cu[n]; t < d.cu[n + 1]; t++) {
        const int64_t r = (t * H + h) * K, rv = (t * H + h) * V;
        float ka[NB], qa[NB], aa[NB], ba[NB], ea[NB], vv[CPW];
#pragma unroll
        for (int bb = 0; bb < NB; bb++) {
            const int x = lane + 32 * bb;
            const bool ok = x < K;
            ka[bb] = ok ? kda_ld(k + r + x) : 0.f;
            qa[bb] = ok ? kda_ld(q + r + x) : 0.f;
            aa[bb] = ok ? kda_ld(a + r + x) : 0.f;
            ba[bb] = ok ? kda_ld(b + r + x) : 0.f;
            ea[bb] = ok ? expf(kda_ld(gk + r + x)) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < CPW; j++)
            vv[j] = col0 + j < V ? kda_ld(v + rv + col0 + j) : 0.f;
        float p[CPW], ov[CPW];
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            float s = 0.f;
#pragma unroll
            for (int bb = 0; bb < NB; bb++)
                s += aa[bb] * S[bb][j];
            p[j] = warp_sum(s);
        }
#pragma unroll
        for (int j = 0; j < CPW; j++) {
            float s = 0.f;
#pragma unroll
            for (int bb = 0; bb < NB; bb++) {
                S[bb][j] = ea[bb] * S[bb][j] + ba[bb] * p[j] + ka[bb] * vv[j];
                s += qa[bb] * S[bb][j];
            }
            ov[j] = warp_sum(s);
        }
#pragma unroll
        for (int j = 0; j < CPW; j++)
            if (lane == j && col0 + j < V)
                kda_st(o + rv + col0 + j, scale * ov[j]);
    }

    if (ht)
#pragma unroll
        for (int bb = 0; bb < NB; bb++)
#pragma unroll
            for (int j = 0; j < CPW; j++) {
                const int x = lane + 32 * bb;
                if (x < K && col0 + j < V)
                    ht[sb + (int64_t)x * V + col0 + j] = S[bb][j];
            }
}

// ---- backward kernel

/* grid (N, H, nvt). The per-tile partial outputs (dqp, dkp, dap, dbp, dgp: [nvt][TT,H,K], or the
 * outputs themselves when nvt == 1) are offset by this block's tile here. */
template <int KPT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_rec_bwd_kernel(Dims d, float scale, const TI *__restrict__ q, const TI *__restrict__ k,
                        const TI *__restrict__ v, const TI *__restrict__ a,
                        const TI *__restrict__ b, const TI *__restrict__ gk,
                        const float *__restrict__ h0, const TI *__restrict__ dO,
                        const float *__restrict__ dht, float *__restrict__ ckpt,
                        float *__restrict__ segbuf, float *dqp, float *dkp, float *dap, float *dbp,
                        float *dgp, float *__restrict__ dv, float *__restrict__ dh0) {
    __shared__ float red[2][NW][CT];
    const int n = blockIdx.x, h = blockIdx.y, vt = blockIdx.z, nvt = gridDim.z;
    const int H = d.H, K = d.K, V = d.V;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int vc = vt * CT + lane;
    const bool vok = vc < V;
    const int64_t tb = d.cu[n], te = d.cu[n + 1];
    const int64_t nseg = (te - tb + REC_SEG - 1) / REC_SEG;
    int64_t segbase = 0;
    for (int m = 0; m < n; m++)
        segbase += (d.cu[m + 1] - d.cu[m] + REC_SEG - 1) / REC_SEG;
    const int64_t KC = (int64_t)K * CT;
    const int64_t blk = ((int64_t)n * H + h) * nvt + vt;
    float *seg = segbuf + blk * REC_SEG * KC;
    const int64_t sb = ((int64_t)n * H + h) * K * V; /* h0, dht, dh0 */
    const int64_t pofs = (int64_t)vt * d.TT * H * K;
    if (dqp)
        dqp += pofs;
    if (dkp)
        dkp += pofs;
    if (dap)
        dap += pofs;
    if (dbp)
        dbp += pofs;
    if (dgp)
        dgp += pofs;
    int rc = 0;

    /* one forward step of this thread's state entries; every thread takes part (barrier) */
    auto step = [&](float(&S)[KPT], int64_t t) {
        const int64_t base = (t * H + h) * K;
        float part = 0.f;
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int x = w + NW * r;
            if (x < K)
                part += kda_ld(a + base + x) * S[r];
        }
        const float p = dplr::rows_sum(part, red, rc, w, lane);
        const float vv = vok ? kda_ld(v + (t * H + h) * V + vc) : 0.f;
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int x = w + NW * r;
            if (x < K)
                S[r] = expf(kda_ld(gk + base + x)) * S[r] + kda_ld(b + base + x) * p +
                       kda_ld(k + base + x) * vv;
        }
    };

    float S[KPT];
#pragma unroll
    for (int r = 0; r < KPT; r++) {
        const int x = w + NW * r;
        S[r] = (h0 && vok && x < K) ? h0[sb + (int64_t)x * V + vc] : 0.f;
    }
    for (int64_t t = tb; t < te; t++) {
        if ((t - tb) % REC_SEG == 0) {
            float *ck = ckpt + ((segbase + (t - tb) / REC_SEG) * H * nvt + h * nvt + vt) * KC;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int x = w + NW * r;
                if (x < K)
                    ck[x * CT + lane] = S[r];
            }
        }
        if (t + 1 < te) /* the state after the last token is never needed */
            step(S, t);
    }

    float dS[KPT];
#pragma unroll
    for (int r = 0; r < KPT; r++) {
        const int x = w + NW * r;
        dS[r] = (dht && vok && x < K) ? dht[sb + (int64_t)x * V + vc] : 0.f;
    }
    for (int64_t s = nseg - 1; s >= 0; s--) {
        const int64_t ts = tb + s * REC_SEG, tl = ts + REC_SEG < te ? ts + REC_SEG : te;
        const float *ck = ckpt + ((segbase + s) * H * nvt + h * nvt + vt) * KC;
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int x = w + NW * r;
            S[r] = x < K ? ck[x * CT + lane] : 0.f;
        }
        for (int64_t t = ts; t < tl; t++) { /* seg[t - ts] = S_{t-1} */
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int x = w + NW * r;
                if (x < K)
                    seg[(t - ts) * KC + x * CT + lane] = S[r];
            }
            if (t + 1 < tl)
                step(S, t);
        }
        for (int64_t t = tl - 1; t >= ts; t--) {
            const int64_t base = (t * H + h) * K, rv = (t * H + h) * V;
            float Sp[KPT];
            float part = 0.f;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int x = w + NW * r;
                Sp[r] = x < K ? seg[(t - ts) * KC + x * CT + lane] : 0.f;
                if (x < K)
                    part += kda_ld(a + base + x) * Sp[r];
            }
            const float p = dplr::rows_sum(part, red, rc, w, lane);
            const float vv = vok ? kda_ld(v + rv + vc) : 0.f;
            const float dOv = (dO && vok) ? kda_ld(dO + rv + vc) : 0.f;
            /* o_t = s S_t^T q_t: dq_t = s S_t dO_t, dS += s q_t dO_t^T */
            float pv = 0.f, pp = 0.f;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int x = w + NW * r;
                if (x >= K)
                    continue;
                const float St = expf(kda_ld(gk + base + x)) * Sp[r] + kda_ld(b + base + x) * p +
                                 kda_ld(k + base + x) * vv;
                const float pq = warp_sum(St * dOv);
                if (dqp && lane == 0)
                    dqp[base + x] = scale * pq;
                dS[r] += scale * kda_ld(q + base + x) * dOv;
                pv += dS[r] * kda_ld(k + base + x);
                pp += dS[r] * kda_ld(b + base + x);
            }
            /* dv = dS^T k (complete in this tile), dp = dS^T b */
            const float dvv = dplr::rows_sum(pv, red, rc, w, lane);
            const float dp = dplr::rows_sum(pp, red, rc, w, lane);
            if (w == 0 && vok)
                dv[rv + vc] = dvv;
#pragma unroll
            for (int r = 0; r < KPT; r++) {
                const int x = w + NW * r;
                if (x >= K)
                    continue;
                const float eg = expf(kda_ld(gk + base + x));
                const float pk = warp_sum(dS[r] * vv);
                const float pb = warp_sum(dS[r] * p);
                const float pa = warp_sum(Sp[r] * dp);
                const float pg = warp_sum(Sp[r] * dS[r]);
                if (lane == 0) {
                    if (dkp)
                        dkp[base + x] = pk;
                    if (dbp)
                        dbp[base + x] = pb;
                    if (dap)
                        dap[base + x] = pa;
                    if (dgp)
                        dgp[base + x] = eg * pg;
                }
                dS[r] = eg * dS[r] + kda_ld(a + base + x) * dp;
            }
        }
    }
    if (dh0 && vok)
#pragma unroll
        for (int r = 0; r < KPT; r++) {
            const int x = w + NW * r;
            if (x < K)
                dh0[sb + (int64_t)x * V + vc] = dS[r];
        }
}

// ---- launchers

template <class TI>
static dg_status rec_fwd_t(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const void *q,
                           const void *k, const void *v, const void *a, const void *b,
                           const void *gk, const float *h0, void *o, float *ht) {
    const Dims d = make_dims(dd);
    const dim3 grid((unsigned)d.N, d.H, (unsigned)DG_CEIL_DIV(d.V, REC_CPW * REC_WARPS));
    const int threads = 32 * REC_WARPS;
    cudaStream_t s = dg__stream(ctx);
#define DPLR_REC_FWD(NBv)                                                                          \
    dplr_rec_fwd_kernel<NBv, TI>                                                                   \
        <<<grid, threads, 0, s>>>(d, scale, (const TI *)q, (const TI *)k, (const TI *)v,           \
                                  (const TI *)a, (const TI *)b, (const TI *)gk, h0, (TI *)o, ht)
    if (d.K <= 32)
        DPLR_REC_FWD(1);
    else if (d.K <= 64)
        DPLR_REC_FWD(2);
    else if (d.K <= 128)
        DPLR_REC_FWD(4);
    else
        DPLR_REC_FWD(8);
#undef DPLR_REC_FWD
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_recurrent_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                                 int bf16, const void *q, const void *k,
                                                 const void *v, const void *a, const void *b,
                                                 const void *gk, const float *h0, void *o,
                                                 float *ht) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !v || !a || !b || !gk || !o)
        return dg__err(DG_ERR_ARG, "%s: q, k, v, a, b, gk and o are required (h0, ht optional)",
                       __func__);
    DPLR_DISPATCH_TI(bf16, return rec_fwd_t<TI_>(ctx, d, scale, q, k, v, a, b, gk, h0, o, ht));
    return DG_OK;
}

template <int KPT, class TI>
static dg_status rec_bwd_launch(dg_ctx *ctx, const Dims &d, int nvt, float scale, const void *q,
                                const void *k, const void *v, const void *a, const void *b,
                                const void *gk, const float *h0, const void *dO, const float *dht,
                                float *ckpt, float *segbuf, float *dqp, float *dkp, float *dap,
                                float *dbp, float *dgp, float *dv, float *dh0) {
    dplr_rec_bwd_kernel<KPT, TI><<<dim3((unsigned)d.N, d.H, nvt), NTH, 0, dg__stream(ctx)>>>(
        d, scale, (const TI *)q, (const TI *)k, (const TI *)v, (const TI *)a, (const TI *)b,
        (const TI *)gk, h0, (const TI *)dO, dht, ckpt, segbuf, dqp, dkp, dap, dbp, dgp, dv, dh0);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <class TI>
static dg_status rec_bwd_t(dg_ctx *ctx, const kda_cuda_dims *dd, float scale, const void *q,
                           const void *k, const void *v, const void *a, const void *b,
                           const void *gk, const float *h0, const void *dO, const float *dht,
                           float *dq, float *dk, float *dv, float *da, float *db, float *dgk,
                           float *dh0) {
    const Dims d = make_dims(dd);
    const int nvt = DG_CEIL_DIV(d.V, CT);
    const size_t KC = (size_t)d.K * CT, tk = (size_t)d.TT * d.H * d.K;
    /* direct writes when there is one value tile; else per-tile partials summed afterwards */
    const bool parts = nvt > 1;
    const size_t nck = ((size_t)d.TT / REC_SEG + d.N) * d.H * nvt * KC;
    const size_t nseg = (size_t)d.N * d.H * nvt * REC_SEG * KC;
    const size_t npart = parts ? 5 * (size_t)nvt * tk : 0;
    Scratch scr(ctx);
    DG_TRY(scr.alloc(nck + nseg + npart));
    float *ckpt = scr.f(), *segbuf = ckpt + nck, *p = segbuf + nseg;
    float *dqp = dq, *dkp = dk, *dap = da, *dbp = db, *dgp = dgk;
    if (parts) {
        dqp = p;
        dkp = p + nvt * tk;
        dap = p + 2 * nvt * tk;
        dbp = p + 3 * nvt * tk;
        dgp = p + 4 * nvt * tk;
    }
    dg_status st;
#define DPLR_REC_BWD(KPTv)                                                                         \
    st = rec_bwd_launch<KPTv, TI>(ctx, d, nvt, scale, q, k, v, a, b, gk, h0, dO, dht, ckpt,        \
                                  segbuf, dqp, dkp, dap, dbp, dgp, dv, dh0)
    if (d.K <= 16)
        DPLR_REC_BWD(2);
    else if (d.K <= 32)
        DPLR_REC_BWD(4);
    else if (d.K <= 64)
        DPLR_REC_BWD(8);
    else if (d.K <= 128)
        DPLR_REC_BWD(16);
    else
        DPLR_REC_BWD(32);
#undef DPLR_REC_BWD
    DG_TRY(st);
    if (parts) {
        float *outs[5] = {dq, dk, da, db, dgk};
        const float *ins[5] = {dqp, dkp, dap, dbp, dgp};
        for (int i = 0; i < 5; i++)
            DG_TRY(kda_sum_parts(ctx, outs[i], ins[i], d.TT, d.H, 1, d.K, nvt, (int64_t)tk, 0));
    }
    return DG_OK;
}

extern "C" dg_status dg__dplr_recurrent_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                                 int bf16, const void *q, const void *k,
                                                 const void *v, const void *a, const void *b,
                                                 const void *gk, const float *h0, const void *dO,
                                                 const float *dht, float *dq, float *dk, float *dv,
                                                 float *da, float *db, float *dgk, float *dh0) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !v || !a || !b || !gk || !dq || !dk || !dv || !da || !db || !dgk)
        return dg__err(DG_ERR_ARG,
                       "%s: q, k, v, a, b, gk and dq, dk, dv, da, db, dgk are required (h0, dO, "
                       "dht, dh0 optional)",
                       __func__);
    DPLR_DISPATCH_TI(bf16, return rec_bwd_t<TI_>(ctx, d, scale, q, k, v, a, b, gk, h0, dO, dht, dq,
                                                 dk, dv, da, db, dgk, dh0));
    return DG_OK;
}
