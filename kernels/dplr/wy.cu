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
 * Tensor cores, for bf16 leaves where dplr_mma_fits (K, V % 8 == 0, aligned arrays; TF32
 * m16n8k8 products, f32 accumulation; the f32 leaves keep the FFMA kernels, whose sums the f32
 * bound of 1e-5 needs):
 *   forward  dplr_wy_fwd_mma_kernel: block per (chunk, head) walking the 64-wide tiles of K
 *            then of V, Tab and Aak staged once, each tile's staged operand (Ge and a, or v) by
 *            cp.async while the tile before is multiplied; a key tile streams the gated
 *            operands through registers, forms ag in shared memory and w = Tab ag; a value tile
 *            X = Aak v (kept in shared memory) and u = Tab X. Dynamic shared memory 2 x BT x
 *            (BT + 4) floats and two stages of an f32 and a bf16 [BT][72] tile (88 KB at BT =
 *            64: two blocks per SM).
 *   backward dplr_wy_bwd_mma_kernel: block per (chunk, head) as the FFMA kernel, 64-wide tiles:
 *            a key tile forms dag = Tab^T dw (staged) and dTab += dw ag^T, then the elementwise
 *            gradients; a value tile X = Aak v and dX = Tab^T du (staged), then dv = Aak^T dX,
 *            dTab += du X^T, dAak += dX v^T; dTab and dAak stay in registers over all tiles.
 *            Dynamic shared memory 2 x BT x (BT + 8) + (BT + 3 x 64) x 72 + 256 floats
 *            (110 KB at BT = 64, opted in).
 * Entry points (dplr_cuda.h): dg__dplr_wy_fwd_cuda, dg__dplr_wy_bwd_cuda.
 */
#include "../kda/mma.cuh"
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

/* grid (NC, H): one block per chunk and head, walking the K / 64 key tiles, then the V / 64 value
 * tiles. Tab (and Aak, when value tiles are asked for) are staged once; each tile's staged
 * operand (Ge and a for a key tile, v for a value tile) comes in by cp.async into one of two
 * stages while the tile before is multiplied and stored. A key tile's gated operands qg, kg, bg
 * stream through registers (every load of a thread's rows issued before the first use); ag =
 * a exp(Ge) replaces the staged Ge in place (each thread rewrites only what it read), then w =
 * Tab ag. A value tile: X = Aak v straight from the staged bf16 v (exact in TF32), then u = Tab
 * X. Warp layout and products of kdamma::mma_stage (warp w: 16 rows, NTW 8-column tiles). */
template <int BT> constexpr size_t dplr_wy_fwd_smem() {
    using kdamma::AB_LDB;
    return sizeof(float) * 2 * BT * (BT + 4) +
           2 * (sizeof(float) + sizeof(kda_bf16)) * (size_t)BT * AB_LDB;
}

template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS, 2)
    dplr_wy_fwd_mma_kernel(Dims d, int nkt, int nvt, float scale, const kda_bf16 *__restrict__ q,
                           const kda_bf16 *__restrict__ k, const kda_bf16 *__restrict__ v,
                           const kda_bf16 *__restrict__ a, const kda_bf16 *__restrict__ b,
                           const float *__restrict__ Gi, const float *__restrict__ Ge,
                           const float *__restrict__ Aak, const float *__restrict__ Tab,
                           float *__restrict__ w, float *__restrict__ u, float *__restrict__ qg,
                           float *__restrict__ kg, float *__restrict__ bg) {
    using namespace kdamma;
    constexpr int LDS = BT + 4, LDX = AB_LDB, NT = AB_THREADS;
    constexpr int SB = (int)((sizeof(float) + sizeof(kda_bf16)) * BT * LDX); /* bytes per stage */
    static_assert(SB % 16 == 0, "stages stay 16-byte aligned");
    extern __shared__ __align__(16) float wy_smem[];
    float *const Ts = wy_smem;       /* Tab [BT][LDS] */
    float *const Ms = Ts + BT * LDS; /* Aak [BT][LDS] (value tiles) */
    unsigned char *const stages = reinterpret_cast<unsigned char *>(Ms + BT * LDS);
    /* stage sb: an f32 [BT][LDX] tile (Ge, turned into ag; or X), then a bf16 one (a or v) */
    auto fx = [&](int sb) { return reinterpret_cast<float *>(stages + sb * SB); };
    auto bx = [&](int sb) { return reinterpret_cast<kda_bf16 *>(fx(sb) + BT * LDX); };
    const int K = d.K, V = d.V, H = d.H;
    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y;
    const int z0 = (w || qg || kg || bg) ? 0 : nkt, z1 = u ? nkt + nvt : nkt;
    const int64_t t0 = d.chunk_t0[c], ra = (int64_t)H * BT, oa = (t0 * H + hh) * BT;
    const int L = d.chunk_len[c];
    if (z0 >= z1 || L <= 0)
        return; /* block-uniform: nothing to make here */
    const int64_t rk = (int64_t)H * K, rv = (int64_t)H * V;
    /* Tab rows >= L zero; its zeros above the diagonal are stored (TRI = 1 skips them); Aak:
     * zeros on and above the diagonal are stored */
    if (w || u)
        tile_async<BT, BT, LDS, NT>(Ts, Tab + oa, ra, L, 0, BT);
    if (u)
        tile_async<BT, BT, LDS, NT>(Ms, Aak + oa, ra, L, 0, BT);
    auto stage = [&](int z, int sb) {
        if (z < nkt) {
            tile_async<BT, AB_N, LDX, NT>(fx(sb), Ge + (t0 * H + hh) * K, rk, L, AB_N * z, K);
            tile_async<BT, AB_N, LDX, NT>(bx(sb), a + (t0 * H + hh) * K, rk, L, AB_N * z, K);
        } else {
            tile_async<BT, AB_N, LDX, NT>(bx(sb), v + (t0 * H + hh) * V, rv, L, AB_N * (z - nkt),
                                          V);
        }
    };
    stage(z0, 0);
    cp_async_commit();
    /* the elementwise part: thread = 4 consecutive columns e4 .. e4 + 3 and rows r0 + RS j */
    constexpr int CG = AB_N / 4, RS = NT / CG, RU = BT / RS;
    static_assert(NT % CG == 0 && BT % RS == 0, "a thread keeps its columns");
    const int e4 = 4 * (threadIdx.x % CG), r0 = threadIdx.x / CG;
    for (int z = z0, sb = 0; z < z1; z++, sb ^= 1) {
        if (z + 1 < z1)
            stage(z + 1, sb ^ 1); /* stage sb ^ 1 was released by the barrier ending tile z - 1 */
        cp_async_commit();
        float acc[AbTile<BT>::NTW][4] = {};
        if (z < nkt) {
            const int e0 = AB_N * z, ne = min(AB_N, K - e0);
            const bool colok = e4 < ne; /* K % 8 == 0: a thread's 4 columns are all in or out */
            const int64_t og0 = (t0 * H + hh) * K + e0 + e4;
            /* every streamed load of this thread's rows first (they fly during the wait) */
            float4 gi[RU], lam = make_float4(0.f, 0.f, 0.f, 0.f);
            kda_raw4<kda_bf16> qr[RU], kr[RU], br[RU];
            if (colok)
                lam = __ldg(reinterpret_cast<const float4 *>(Gi + og0 + (L - 1) * rk));
#pragma unroll
            for (int j = 0; j < RU; j++) {
                const int r = r0 + RS * j;
                if (colok && r < L) {
                    const int64_t o = og0 + r * rk;
                    gi[j] = __ldg(reinterpret_cast<const float4 *>(Gi + o));
                    if (qg)
                        qr[j].load(q + o);
                    if (kg)
                        kr[j].load(k + o);
                    if (bg)
                        br[j].load(b + o);
                }
            }
            cp_async_wait<1>(); /* this tile's Ge and a (and Tab) have landed */
            __syncthreads();
            float *const X = fx(sb);
            const kda_bf16 *const as = bx(sb);
#pragma unroll
            for (int j = 0; j < RU; j++) {
                const int r = r0 + RS * j;
                float4 ag = make_float4(0.f, 0.f, 0.f, 0.f);
                if (colok && r < L) {
                    const int64_t o = og0 + r * rk;
                    const float4 g = gi[j];
                    const float4 fl = make_float4(expf(lam.x - g.x), expf(lam.y - g.y),
                                                  expf(lam.z - g.z), expf(lam.w - g.w));
                    if (qg) {
                        const float4 x = qr[j].get();
                        *reinterpret_cast<float4 *>(qg + o) =
                            make_float4(scale * x.x * expf(g.x), scale * x.y * expf(g.y),
                                        scale * x.z * expf(g.z), scale * x.w * expf(g.w));
                    }
                    if (kg) {
                        const float4 x = kr[j].get();
                        *reinterpret_cast<float4 *>(kg + o) =
                            make_float4(x.x * fl.x, x.y * fl.y, x.z * fl.z, x.w * fl.w);
                    }
                    if (bg) {
                        const float4 x = br[j].get();
                        *reinterpret_cast<float4 *>(bg + o) =
                            make_float4(x.x * fl.x, x.y * fl.y, x.z * fl.z, x.w * fl.w);
                    }
                    const float4 ge = *reinterpret_cast<const float4 *>(X + r * LDX + e4);
                    const float4 av = kda_ld4(as + r * LDX + e4);
                    ag = make_float4(av.x * expf(ge.x), av.y * expf(ge.y), av.z * expf(ge.z),
                                     av.w * expf(ge.w));
                }
                *reinterpret_cast<float4 *>(X + r * LDX + e4) = ag; /* rows >= L: 0 */
            }
            if (w) { /* block-uniform */
                __syncthreads();
                mma_stage<BT, true, false, 1, BT>(acc, Ts, LDS, X, LDX, 0);
                store_acc<BT>(acc, w + (t0 * H + hh) * K + e0, rk, L, ne, 1.f);
            }
        } else {
            const int v0 = AB_N * (z - nkt), nv = min(AB_N, V - v0);
            cp_async_wait<1>(); /* this tile's v (and Tab, Aak) have landed */
            __syncthreads();
            float *const X = fx(sb);
            /* X = Aak v (rows >= L: 0), the bf16 v read as staged */
            mma_stage<BT, true, false, 1, BT>(acc, Ms, LDS, bx(sb), LDX, 0);
            store_acc<BT>(acc, X, LDX, BT, AB_N, 1.f);
            float uacc[AbTile<BT>::NTW][4] = {};
            __syncthreads();
            mma_stage<BT, true, false, 1, BT>(uacc, Ts, LDS, X, LDX, 0); /* u = Tab X */
            store_acc<BT>(uacc, u + (t0 * H + hh) * V + v0, rv, L, nv, 1.f);
        }
        __syncthreads(); /* stage sb is refilled by the next tile's copies */
    }
}

// ---- backward kernel

/* The elementwise gradients of element o of a key tile, shared by both backward kernels, from
 * dag = (Tab^T dw)[o] and lam = Gi at the chunk's last row: da, dGe, dq, dk, db written; dGi
 * written too, except on the last row (lastrow), where *last gets its own term and the caller
 * adds every row's side term k dk + b db (the return value) to it. */
template <class TI>
__device__ __forceinline__ float
wy_elem_bwd(int64_t o, bool lastrow, float lam, float dag, float scale, const TI *__restrict__ q,
            const TI *__restrict__ k, const TI *__restrict__ a, const TI *__restrict__ b,
            const float *__restrict__ Gi, const float *__restrict__ Ge,
            const float *__restrict__ dqg, const float *__restrict__ dkg,
            const float *__restrict__ dbg, float *__restrict__ dq, float *__restrict__ dk,
            float *__restrict__ da, float *__restrict__ db, float *__restrict__ dGi,
            float *__restrict__ dGe, float &last) {
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
    if (lastrow)
        last = gv;
    else
        dGi[o] = gv;
    return side;
}

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
            if (eok)
                psum += wy_elem_bwd(((t0 + r) * H + h) * K + e, r == L - 1, lam, dag, scale, q, k,
                                    a, b, Gi, Ge, dqg, dkg, dbg, dq, dk, da, db, dGi, dGe, last);
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

/* grid (NC, H). Shared memory (floats): Tab, Aak [BT][BT + 8]; P0 [BT][72] (dw / du tile);
 * P1, P2 [64][72] (ag / v tile, dag / X tile: the k-contiguous B operands of the chunk-square
 * products, whose n runs to 64, so rows BT.. stay zero); P3 [BT][72] (dX); red [4][64]. */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    dplr_wy_bwd_mma_kernel(Dims d, float scale, const kda_bf16 *__restrict__ q,
                           const kda_bf16 *__restrict__ k, const kda_bf16 *__restrict__ v,
                           const kda_bf16 *__restrict__ a, const kda_bf16 *__restrict__ b,
                           const float *__restrict__ Gi, const float *__restrict__ Ge,
                           const float *__restrict__ Aak, const float *__restrict__ Tab,
                           const float *__restrict__ dw, const float *__restrict__ du,
                           const float *__restrict__ dqg, const float *__restrict__ dkg,
                           const float *__restrict__ dbg, float *__restrict__ dq,
                           float *__restrict__ dk, float *__restrict__ dv, float *__restrict__ da,
                           float *__restrict__ db, float *__restrict__ dGi, float *__restrict__ dGe,
                           float *__restrict__ dAak, float *__restrict__ dTab) {
    using namespace kdamma;
    constexpr int LDS = BT + 8, LDT = AB_N + 8, NTW = AbTile<BT>::NTW, WN = AbTile<BT>::WN;
    constexpr int RQ = AB_THREADS / AB_N; /* threads per column of the elementwise passes */
    extern __shared__ __align__(16) float wyb_smem[];
    float *const Ts = wyb_smem, *const Ms = Ts + BT * LDS;
    float *const P0 = Ms + BT * LDS, *const P1 = P0 + BT * LDT, *const P2 = P1 + AB_N * LDT;
    float *const P3 = P2 + AB_N * LDT, *const red = P3 + BT * LDT;
    const int H = d.H, K = d.K, V = d.V;
    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y;
    const int64_t t0 = d.chunk_t0[c], ra = (int64_t)H * BT, oa = (t0 * H + hh) * BT;
    const int L = d.chunk_len[c];
    const int tid = threadIdx.x, col = tid % AB_N, rq = tid / AB_N;
    for (int idx = BT * LDT + tid; idx < AB_N * LDT; idx += AB_THREADS)
        P1[idx] = P2[idx] = 0.f; /* rows BT.. of the B operands (BT < 64) */
    tile_async<BT, BT, LDS, AB_THREADS>(Ts, Tab + oa, ra, L, 0, BT);
    tile_async<BT, BT, LDS, AB_THREADS>(Ms, Aak + oa, ra, L, 0, BT);
    cp_async_commit();
    float accT[NTW][4] = {}, accA[NTW][4] = {}; /* dTab, dAak */

    const int64_t rk = (int64_t)H * K;
    for (int e0 = 0; e0 < K; e0 += AB_N) {
        const int ne = min(AB_N, K - e0);
        const int64_t ok0 = (t0 * H + hh) * K + e0;
        __syncthreads(); /* the previous tile's P0, P1, P2 have been read */
        tile_async<BT, AB_N, LDT, AB_THREADS>(P0, dw ? dw + ok0 : Tab, rk, dw ? L : 0, 0, ne);
        cp_async_commit();
        for (int r = rq; r < BT; r += RQ) {
            const int64_t o = ok0 + r * rk + col;
            P1[r * LDT + col] = r < L && col < ne ? kda_ld(a + o) * expf(Ge[o]) : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();
        { /* dag = Tab^T dw (k = i >= m = r) into P2; dTab += dw ag^T */
            float g2[NTW][4] = {};
            mma_stage<BT, false, false, 2, BT>(g2, Ts, LDS, P0, LDT, 0);
            store_acc<BT>(g2, P2, LDT, BT, AB_N, 1.f);
            mma_stage<BT, true, true, 0, AB_N>(accT, P0, LDT, P1, LDT, 0);
        }
        __syncthreads();
        float psum = 0.f, last = 0.f;
        const bool cok = col < ne;
        const float lam = cok ? Gi[ok0 + (L - 1) * rk + col] : 0.f;
        for (int r = rq; r < L && cok; r += RQ) {
            psum += wy_elem_bwd(ok0 + r * rk + col, r == L - 1, lam, P2[r * LDT + col], scale, q, k,
                                a, b, Gi, Ge, dqg, dkg, dbg, dq, dk, da, db, dGi, dGe, last);
        }
        red[rq * AB_N + col] = psum;
        __syncthreads();
        if (rq == (L - 1) % RQ && cok) { /* lam = Gi_{L-1}: every row's side term */
            float s = last;
#pragma unroll
            for (int x = 0; x < RQ; x++)
                s += red[x * AB_N + col];
            dGi[ok0 + (L - 1) * rk + col] = s;
        }
    }

    const int64_t rv = (int64_t)H * V;
    for (int v0 = 0; v0 < V; v0 += AB_N) {
        const int nv = min(AB_N, V - v0);
        const int64_t ov0 = (t0 * H + hh) * V + v0;
        __syncthreads(); /* the previous tile's P0..P3 have been read */
        tile_async<BT, AB_N, LDT, AB_THREADS>(P0, du ? du + ov0 : Tab, rv, du ? L : 0, 0, nv);
        cp_async_commit();
        for (int r = rq; r < BT; r += RQ)
            P1[r * LDT + col] = r < L && col < nv ? kda_ld(v + ov0 + r * rv + col) : 0.f;
        cp_async_wait<0>();
        __syncthreads();
        {
            float x[NTW][4] = {}, dx[NTW][4] = {};
            mma_stage<BT, true, false, 1, BT>(x, Ms, LDS, P1, LDT, 0);   /* X = Aak v */
            mma_stage<BT, false, false, 2, BT>(dx, Ts, LDS, P0, LDT, 0); /* dX = Tab^T du */
            store_acc<BT>(x, P2, LDT, BT, AB_N, 1.f);
            store_acc<BT>(dx, P3, LDT, BT, AB_N, 1.f);
        }
        __syncthreads();
        float dvv[NTW][4] = {};
        mma_stage<BT, false, false, 2, BT>(dvv, Ms, LDS, P3, LDT, 0); /* dv = Aak^T dX */
        store_acc<BT>(dvv, dv + ov0, rv, L, nv, 1.f);
        mma_stage<BT, true, true, 0, AB_N>(accT, P0, LDT, P2, LDT, 0); /* dTab += du X^T */
        mma_stage<BT, true, true, 0, AB_N>(accA, P3, LDT, P1, LDT, 0); /* dAak += dX v^T */
    }

    /* dTab (j <= i) and dAak (j < i): whole rows of the L valid tokens, columns < BT */
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int m0 = 16 * (warp / WN), n0 = 8 * NTW * (warp % WN);
#pragma unroll
    for (int j = 0; j < NTW; j++)
#pragma unroll
        for (int hlf = 0; hlf < 2; hlf++) {
            const int r = m0 + g + 8 * hlf, cc = n0 + 8 * j + 2 * t;
            if (r >= L || cc >= BT)
                continue;
            const int64_t o = oa + r * ra + cc;
            kda_st2(dTab + o, cc <= r ? accT[j][2 * hlf] : 0.f,
                    cc + 1 <= r ? accT[j][2 * hlf + 1] : 0.f);
            kda_st2(dAak + o, cc < r ? accA[j][2 * hlf] : 0.f,
                    cc + 1 < r ? accA[j][2 * hlf + 1] : 0.f);
        }
}

// ---- launchers

template <int BT, class TI>
static dg_status wy_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, float scale, const void *q,
                          const void *k, const void *v, const void *a, const void *b,
                          const float *Gi, const float *Ge, const float *Aak, const float *Tab,
                          float *w, float *u, float *qg, float *kg, float *bg) {
    if (sizeof(TI) == 2 && dplr_mma_fits(d, {q, k, v, a, b, Gi, Ge, Tab, Aak, w, u, qg, kg, bg})) {
        using kdamma::AB_N;
        const int nkt = DG_CEIL_DIV(d->K, AB_N), nvt = DG_CEIL_DIV(d->V, AB_N);
        const size_t smem = dplr_wy_fwd_smem<BT>();
        DG_TRY(smem_opt_in(dplr_wy_fwd_mma_kernel<BT>, smem));
        dplr_wy_fwd_mma_kernel<BT>
            <<<dim3((unsigned)d->NC, d->H), kdamma::AB_THREADS, smem, dg__stream(ctx)>>>(
                make_dims(d), nkt, nvt, scale, (const kda_bf16 *)q, (const kda_bf16 *)k,
                (const kda_bf16 *)v, (const kda_bf16 *)a, (const kda_bf16 *)b, Gi, Ge, Aak, Tab, w,
                u, qg, kg, bg);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
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
    if (sizeof(TI) == 2 && dplr_mma_fits(d, {Tab, Aak, dw, du, dv, dTab, dAak})) {
        using kdamma::AB_N;
        const size_t smem =
            sizeof(float) * (2 * BT * (BT + 8) + (2 * BT + 2 * AB_N) * (AB_N + 8) + 4 * AB_N);
        DG_TRY(smem_opt_in(dplr_wy_bwd_mma_kernel<BT>, smem));
        dplr_wy_bwd_mma_kernel<BT>
            <<<dim3((unsigned)d->NC, d->H), kdamma::AB_THREADS, smem, dg__stream(ctx)>>>(
                make_dims(d), scale, (const kda_bf16 *)q, (const kda_bf16 *)k, (const kda_bf16 *)v,
                (const kda_bf16 *)a, (const kda_bf16 *)b, Gi, Ge, Aak, Tab, dw, du, dqg, dkg, dbg,
                dq, dk, dv, da, db, dGi, dGe, dAak, dTab);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
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
