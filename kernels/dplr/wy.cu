/*
 * kernels/dplr/wy.cu -- the WY representation and the gated operands of DPLR (dplr.md D3;
 * backward dplr.md D4 steps 4-5); CPU twins: dg__dplr_wy_fwd_f32 / dg__dplr_wy_bwd_f32 in
 * ops/dplr/wy.c.
 *
 * Per chunk (rows i < L) and head, lam = Gi_{L-1}:
 *   ag_i = a_i exp(Ge_i)     X = Aak v (Aak read for j < i)     w = Tab ag,  u = Tab X
 *   qg_i = s q_i exp(Gi_i)   kg_i = k_i exp(lam - Gi_i)         bg_i = b_i exp(lam - Gi_i)
 * (Tab read for j <= i.) Backward from dw, du, dqg, dkg, dbg (each optional):
 *   dag = Tab^T dw    dX = Tab^T du    dTab[i,j] = dw_i . ag_j + du_i . X_j   (j <= i)
 *   dAak[i,j] = dX_i . v_j (j < i)     dv = Aak^T dX     da = dag exp(Ge),  dGe = a da
 *   dq = s dqg exp(Gi), dk = dkg exp(lam - Gi), db = dbg exp(lam - Gi),
 *   dGi = q dq - (k dk + b db), and dGi_{L-1} += sum_i (k_i dk_i + b_i db_i)
 * Every exponent (Gi_i, Ge_i, lam - Gi_i) is <= 0. q, k, v, a, b are f32 or bf16 (TI, read as
 * stored); everything else is f32.
 *
 * Kernels (f32 FFMA), lane = one column of a 32-wide tile, warp w = rows w, w + 8, ...:
 *   forward  dplr_wy_fwd_kernel: block per (chunk, head, tile), the tiles being the 32-wide
 *            column tiles of K (w and the gated operands) followed by those of V (X, then u);
 *            Tab, Aak and the tiles in dynamic shared memory, 2 x BT x BT + 2 x BT x 32 floats
 *            (48 KB at BT = 64).
 *   backward dplr_wy_bwd_kernel: block per (chunk, head), walking the key tiles (dag and the
 *            elementwise gradients; dTab += dw ag^T) and then the value tiles (X, dX, dv;
 *            dTab += du X^T, dAak += dX v^T), so the chunk-square gradients are summed over the
 *            whole of K and V inside one block (kda_tile_abt, KDA's 16 x 16-thread product) and
 *            nothing is reduced across blocks. The column sum into dGi_{L-1} crosses warps
 *            through a [8][32] shared array summed in warp order. Dynamic shared memory
 *            2 x BT x BT + 4 x BT x 33 + 256 floats (66 KB at BT = 64, opted in).
 * Entry points (dplr_cuda.h): dg__dplr_wy_fwd_cuda, dg__dplr_wy_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

// ---- forward kernel

/* grid (NC, H, nkt + nvt): blockIdx.z < nkt is key tile z, else value tile z - nkt. */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_wy_fwd_kernel(Dims d, int nkt, float scale, const TI *__restrict__ q,
                       const TI *__restrict__ k, const TI *__restrict__ v, const TI *__restrict__ a,
                       const TI *__restrict__ b, const float *__restrict__ Gi,
                       const float *__restrict__ Ge, const float *__restrict__ Aak,
                       const float *__restrict__ Tab, float *__restrict__ w, float *__restrict__ u,
                       float *__restrict__ qg, float *__restrict__ kg, float *__restrict__ bg) {
    extern __shared__ float sm[];
    float(*sT)[BT] = (float(*)[BT])sm;                 /* Tab (j <= i) */
    float(*sM)[BT] = sT + BT;                          /* Aak (j < i) */
    float(*sX)[CT] = (float(*)[CT])(sm + 2 * BT * BT); /* ag tile, or v tile */
    float(*sY)[CT] = sX + BT;                          /* X tile */

    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int z = blockIdx.z;
    const bool ktile = z < nkt;
    /* block-uniform: nothing to make in this tile */
    if (ktile ? !(w || qg || kg || bg) : !u)
        return;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    dplr::load_square<BT, BT>(&sT[0][0], Tab, t0, L, H, h, dplr::LOWER);

    if (ktile) {
        const int e = z * CT + lane;
        const bool eok = e < K;
        const float lam = eok ? Gi[((t0 + L - 1) * H + h) * K + e] : 0.f;
        for (int r = wp; r < BT; r += NW) {
            float agv = 0.f;
            if (r < L && eok) {
                const int64_t o = ((t0 + r) * H + h) * K + e;
                const float gi = Gi[o], fl = expf(lam - gi);
                if (qg)
                    qg[o] = scale * kda_ld(q + o) * expf(gi);
                if (kg)
                    kg[o] = kda_ld(k + o) * fl;
                if (bg)
                    bg[o] = kda_ld(b + o) * fl;
                agv = kda_ld(a + o) * expf(Ge[o]);
            }
            sX[r][lane] = agv;
        }
        __syncthreads();
        if (w)
            for (int r = wp; r < L; r += NW) {
                float s = 0.f;
                for (int j = 0; j <= r; j++)
                    s += sT[r][j] * sX[j][lane];
                if (eok)
                    w[((t0 + r) * H + h) * K + e] = s;
            }
    } else {
        const int y0 = (z - nkt) * CT, y = y0 + lane;
        dplr::load_square<BT, BT>(&sM[0][0], Aak, t0, L, H, h, dplr::STRICT);
        dplr::load_rows<BT, CT>(&sX[0][0], v, t0, L, H, h, V, y0);
        __syncthreads();
        for (int r = wp; r < BT; r += NW) { /* X_r = sum_{j<r} Aak[r,j] v_j (rows >= L: 0) */
            float s = 0.f;
            for (int j = 0; j < r; j++)
                s += sM[r][j] * sX[j][lane];
            sY[r][lane] = s;
        }
        __syncthreads();
        for (int r = wp; r < L; r += NW) {
            float s = 0.f;
            for (int j = 0; j <= r; j++)
                s += sT[r][j] * sY[j][lane];
            if (y < V)
                u[((t0 + r) * H + h) * V + y] = s;
        }
    }
}

// ---- backward kernel

/* grid (NC, H), dynamic shared memory (see the file comment). */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_wy_bwd_kernel(Dims d, float scale, const TI *__restrict__ q, const TI *__restrict__ k,
                       const TI *__restrict__ v, const TI *__restrict__ a, const TI *__restrict__ b,
                       const float *__restrict__ Gi, const float *__restrict__ Ge,
                       const float *__restrict__ Aak, const float *__restrict__ Tab,
                       const float *__restrict__ dw, const float *__restrict__ du,
                       const float *__restrict__ dqg, const float *__restrict__ dkg,
                       const float *__restrict__ dbg, float *__restrict__ dq,
                       float *__restrict__ dk, float *__restrict__ dv, float *__restrict__ da,
                       float *__restrict__ db, float *__restrict__ dGi, float *__restrict__ dGe,
                       float *__restrict__ dAak, float *__restrict__ dTab) {
    constexpr int R = BT / 16, LD = CT + 1;
    extern __shared__ float sm[];
    float(*sT)[BT] = (float(*)[BT])sm;                                /* Tab (j <= i) */
    float(*sM)[BT] = sT + BT;                                         /* Aak (j < i) */
    float(*p0)[LD] = (float(*)[LD])(sm + 2 * BT * BT);                /* dw tile / du tile */
    float(*p1)[LD] = p0 + BT;                                         /* ag tile / v tile */
    float(*p2)[LD] = p1 + BT;                                         /* X tile */
    float(*p3)[LD] = p2 + BT;                                         /* dX tile */
    float(*red)[CT] = (float(*)[CT])(sm + 2 * BT * BT + 4 * BT * LD); /* [NW][CT] */

    const int64_t c = blockIdx.x;
    const int h = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int tid = threadIdx.x, wp = tid >> 5, lane = tid & 31, ty = tid >> 4, tx = tid & 15;
    dplr::load_square<BT, BT>(&sT[0][0], Tab, t0, L, H, h, dplr::LOWER);
    dplr::load_square<BT, BT>(&sM[0][0], Aak, t0, L, H, h, dplr::STRICT);

    float accT[R][R], accA[R][R]; /* dTab, dAak of this thread's pairs */
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < R; j++)
            accT[i][j] = accA[i][j] = 0.f;

    /* key tiles: dag, the elementwise gradients, dTab += dw ag^T */
    for (int e0 = 0; e0 < K; e0 += CT) {
        const int e = e0 + lane;
        const bool eok = e < K;
        dplr::load_rows<BT, LD>(&p0[0][0], dw, t0, L, H, h, K, e0);
        for (int idx = tid; idx < BT * CT; idx += NTH) {
            const int r = idx / CT, col = idx % CT;
            const int64_t o = ((t0 + r) * H + h) * K + e0 + col;
            p1[r][col] = (r < L && e0 + col < K) ? kda_ld(a + o) * expf(Ge[o]) : 0.f;
        }
        __syncthreads();
        const float lam = eok ? Gi[((t0 + L - 1) * H + h) * K + e] : 0.f;
        float psum = 0.f, last = 0.f; /* this warp's sum of the side terms; dGi of row L-1 */
        for (int r = wp; r < L; r += NW) {
            float dag = 0.f; /* sum_{i>=r} Tab[i,r] dw_i */
            for (int i = r; i < L; i++)
                dag += sT[i][r] * p0[i][lane];
            if (eok) {
                const int64_t o = ((t0 + r) * H + h) * K + e;
                const float gi = Gi[o], fl = expf(lam - gi);
                const float dai = dag * expf(Ge[o]);
                const float dqi = dqg ? scale * dqg[o] * expf(gi) : 0.f;
                const float dki = dkg ? dkg[o] * fl : 0.f, dbi = dbg ? dbg[o] * fl : 0.f;
                const float side = kda_ld(k + o) * dki + kda_ld(b + o) * dbi;
                da[o] = dai;
                dGe[o] = kda_ld(a + o) * dai;
                dq[o] = dqi;
                dk[o] = dki;
                db[o] = dbi;
                const float gv = kda_ld(q + o) * dqi - side;
                psum += side;
                if (r == L - 1)
                    last = gv;
                else
                    dGi[o] = gv;
            }
        }
        red[wp][lane] = psum;
        kda_tile_abt<BT>(accT, p0, p1, tx, ty);
        __syncthreads();
        if (wp == (L - 1) % NW && eok) { /* lam = Gi_{L-1}: every row's side term */
            float s = last;
#pragma unroll
            for (int ww = 0; ww < NW; ww++)
                s += red[ww][lane];
            dGi[((t0 + L - 1) * H + h) * K + e] = s;
        }
        __syncthreads();
    }

    /* value tiles: X, dX, dv; dTab += du X^T, dAak += dX v^T */
    for (int y0 = 0; y0 < V; y0 += CT) {
        const int y = y0 + lane;
        dplr::load_rows<BT, LD>(&p0[0][0], du, t0, L, H, h, V, y0);
        dplr::load_rows<BT, LD>(&p1[0][0], v, t0, L, H, h, V, y0);
        __syncthreads();
        for (int r = wp; r < BT; r += NW) { /* rows >= L come out as 0 */
            float x = 0.f, dx = 0.f;
            for (int j = 0; j < r; j++)
                x += sM[r][j] * p1[j][lane];
            for (int i = r; i < L; i++)
                dx += sT[i][r] * p0[i][lane];
            p2[r][lane] = x;
            p3[r][lane] = dx;
        }
        __syncthreads();
        for (int r = wp; r < L; r += NW) {
            float s = 0.f; /* dv_r = sum_{i>r} Aak[i,r] dX_i */
            for (int i = r + 1; i < L; i++)
                s += sM[i][r] * p3[i][lane];
            if (y < V)
                dv[((t0 + r) * H + h) * V + y] = s;
        }
        kda_tile_abt<BT>(accT, p0, p2, tx, ty);
        kda_tile_abt<BT>(accA, p3, p1, tx, ty);
        __syncthreads();
    }

#pragma unroll
    for (int ra = 0; ra < R; ra++) {
        const int i = ty + 16 * ra;
        if (i >= L)
            continue;
#pragma unroll
        for (int rb = 0; rb < R; rb++) {
            const int j = tx + 16 * rb;
            const int64_t o = ((t0 + i) * H + h) * BT + j;
            dTab[o] = j <= i ? accT[ra][rb] : 0.f;
            dAak[o] = j < i ? accA[ra][rb] : 0.f;
        }
    }
}

// ---- launchers

template <int BT, class TI>
static dg_status wy_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                          const void *k, const void *v, const void *a, const void *b,
                          const float *Gi, const float *Ge, const float *Aak, const float *Tab,
                          float *w, float *u, float *qg, float *kg, float *bg) {
    const int nkt = DG_CEIL_DIV(d->K, CT), nvt = DG_CEIL_DIV(d->V, CT);
    const size_t smem = sizeof(float) * (2 * BT * BT + 2 * BT * CT);
    DG_TRY(smem_opt_in(dplr_wy_fwd_kernel<BT, TI>, smem));
    dplr_wy_fwd_kernel<BT, TI>
        <<<dim3((unsigned)d->NC, d->H, nkt + nvt), NTH, smem, dg__stream(ctx)>>>(
            make_dims(d), nkt, scale, (const TI *)q, (const TI *)k, (const TI *)v, (const TI *)a,
            (const TI *)b, Gi, Ge, Aak, Tab, w, u, qg, kg, bg);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_wy_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                          int bf16, const void *q, const void *k, const void *v,
                                          const void *a, const void *b, const float *Gi,
                                          const float *Ge, const float *Aak, const float *Tab,
                                          float *w, float *u, float *qg, float *kg, float *bg) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !v || !a || !b || !Gi || !Ge || !Aak || !Tab)
        return dg__err(DG_ERR_ARG,
                       "%s: q, k, v, a, b, Gi, Ge, Aak and Tab are required (the outputs are "
                       "optional)",
                       __func__);
    if (d->NC == 0 || !(w || u || qg || kg || bg))
        return DG_OK;
    KDA_DISPATCH_BT(
        d->BT, DPLR_DISPATCH_TI(bf16, return wy_fwd_t<BT_, TI_>(ctx, d, scale, q, k, v, a, b, Gi,
                                                                Ge, Aak, Tab, w, u, qg, kg, bg)));
    return DG_OK;
}

template <int BT, class TI>
static dg_status wy_bwd_t(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                          const void *k, const void *v, const void *a, const void *b,
                          const float *Gi, const float *Ge, const float *Aak, const float *Tab,
                          const float *dw, const float *du, const float *dqg, const float *dkg,
                          const float *dbg, float *dq, float *dk, float *dv, float *da, float *db,
                          float *dGi, float *dGe, float *dAak, float *dTab) {
    const size_t smem = sizeof(float) * (2 * BT * BT + 4 * BT * (CT + 1) + NW * CT);
    DG_TRY(smem_opt_in(dplr_wy_bwd_kernel<BT, TI>, smem));
    dplr_wy_bwd_kernel<BT, TI><<<dim3((unsigned)d->NC, d->H), NTH, smem, dg__stream(ctx)>>>(
        make_dims(d), scale, (const TI *)q, (const TI *)k, (const TI *)v, (const TI *)a,
        (const TI *)b, Gi, Ge, Aak, Tab, dw, du, dqg, dkg, dbg, dq, dk, dv, da, db, dGi, dGe, dAak,
        dTab);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_wy_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, float scale,
                                          int bf16, const void *q, const void *k, const void *v,
                                          const void *a, const void *b, const float *Gi,
                                          const float *Ge, const float *Aak, const float *Tab,
                                          const float *dw, const float *du, const float *dqg,
                                          const float *dkg, const float *dbg, float *dq, float *dk,
                                          float *dv, float *da, float *db, float *dGi, float *dGe,
                                          float *dAak, float *dTab) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!q || !k || !v || !a || !b || !Gi || !Ge || !Aak || !Tab || !dq || !dk || !dv || !da ||
        !db || !dGi || !dGe || !dAak || !dTab)
        return dg__err(DG_ERR_ARG,
                       "%s: the inputs and every gradient output are required (dw, du, dqg, dkg, "
                       "dbg optional)",
                       __func__);
    if (d->NC == 0)
        return DG_OK;
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return wy_bwd_t<BT_, TI_>(
                                                      ctx, d, scale, q, k, v, a, b, Gi, Ge, Aak,
                                                      Tab, dw, du, dqg, dkg, dbg, dq, dk, dv, da,
                                                      db, dGi, dGe, dAak, dTab)));
    return DG_OK;
}
