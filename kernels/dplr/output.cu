/*
 * kernels/dplr/output.cu -- the output of DPLR (dplr.md D3; backward D4 step 1); CPU twins:
 * dg__dplr_output_fwd_f32 / dg__dplr_output_bwd_f32 in ops/dplr/output.c.
 *   forward:   o_c = qg_c h_c + Aqk_c v_c + Aqb_c v2_c     (Aqk, Aqb read for j <= i)
 *   backward:  dqg = dO h^T, dh_c = qg^T dO, dAqk = tril(dO v^T), dAqb = tril(dO v2^T),
 *              dv = Aqk^T dO, dv2 = Aqb^T dO
 * (qg, Aqk and Aqb carry the scale.) Layouts: qg [TT,H,K]; v, v2, o, dO [TT,H,V]; Aqk, Aqb
 * [TT,H,BT]; h [NC,H,K,V]. v, o and dO are f32 or bf16 (TI: v and dO read as stored, o written
 * in that dtype); everything else is f32.
 *
 * Kernels (f32 FFMA, chunk-parallel, each sum in the CPU's order; lane = one column of a 32-wide
 * tile, warp w = a set of rows):
 *   dplr_output_fwd_kernel: block per (chunk, head, 32 value columns): qg [BT][32] and h [32][32]
 *     tiles over the key dim, then Aqk, Aqb (masked to j <= i < L) times v, v2 staged whole.
 *     Dynamic shared memory 3 x BT x 32 + 32 x 32 + 2 x BT x BT floats (60 KB at BT = 64).
 *   dplr_output_dv_kernel: block per (chunk, head, 32 value columns): dv, dv2 and the columns of
 *     dh_c (key rows 4w..4w+3 of each 32-row tile per warp). Dynamic shared memory
 *     2 x BT x 32 + 2 x BT x BT floats (48 KB at BT = 64).
 *   dplr_output_dqg_kernel: block per (chunk, head, 32 key columns): dqg over V in tiles of 32.
 *   dplr_output_da_kernel: block per (chunk, head): dAqk and dAqb with KDA's 16 x 16-thread
 *     product (kda_tile_abt) over V in tiles of 32, so each is summed inside one block.
 * Tensor cores, for bf16 leaves where K, V % 8 == 0 and the arrays are 16-byte aligned (TF32
 * m16n8k8 on the f32 operands and the widened bf16 ones, f32 accumulation; the f32 leaves keep
 * the FFMA kernels above, whose sums the f32 bound of 1e-5 against float64 needs):
 *   dplr_output_fwd_mma_kernel: block per (chunk, head, 64 value columns), KDA's gemm_acc
 *     (kernels/kda/mma.cuh) three times into one accumulator tile: qg h, tril(Aqk) v,
 *     tril(Aqb) v2; o stored as bf16 rows. Static shared memory 36 KB at BT = 64.
 *   backward: KDA's output backward kernels (kda_output_bwd_bf16do, kernels/kda/output.cu):
 *     dqg and dh_c in one pass, then (dAqk, dv) from v and (dAqb, dv2) from v2, each pair in
 *     one pass over the value tiles.
 * Entry points (dplr_cuda.h): dg__dplr_output_fwd_cuda, dg__dplr_output_bwd_cuda.
 */
#include "../kda/mma.cuh"
#include "common.cuh"

using namespace kdab;

// ---- forward kernel

/* grid (NC, H, ceil(V / 32)) */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_output_fwd_kernel(Dims d, const float *__restrict__ qg, const float *__restrict__ h,
                           const float *__restrict__ Aqk, const float *__restrict__ Aqb,
                           const TI *__restrict__ v, const float *__restrict__ v2,
                           TI *__restrict__ o) {
    constexpr int RW = BT / 8;
    extern __shared__ float sm[];
    float(*sq)[CT] = (float(*)[CT])sm;                           /* qg tile [BT][32] */
    float(*sh)[CT] = sq + BT;                                    /* h tile [32][32] */
    float(*sv)[CT] = sh + CT;                                    /* v tile [BT][32] */
    float(*sv2)[CT] = sv + BT;                                   /* v2 tile [BT][32] */
    float(*s1)[BT] = (float(*)[BT])(sm + 3 * BT * CT + CT * CT); /* Aqk */
    float(*s2)[BT] = s1 + BT;                                    /* Aqb */

    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int y0 = blockIdx.z * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *hc = h + (c * H + hh) * K * (int64_t)V;

    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; r++)
        acc[r] = 0.f;
    for (int x0 = 0; x0 < K; x0 += CT) {
        dplr::load_rows<BT, CT>(&sq[0][0], qg, t0, L, H, hh, K, x0);
        dplr::load_state_tile<CT>(&sh[0][0], hc, K, V, x0, y0);
        __syncthreads();
#pragma unroll 4
        for (int xx = 0; xx < CT; xx++) {
            const float hv = sh[xx][lane];
#pragma unroll
            for (int r = 0; r < RW; r++)
                acc[r] += sq[wp * RW + r][xx] * hv;
        }
        __syncthreads();
    }
    dplr::load_rows<BT, CT>(&sv[0][0], v, t0, L, H, hh, V, y0);
    dplr::load_rows<BT, CT>(&sv2[0][0], v2, t0, L, H, hh, V, y0);
    dplr::load_square<BT, BT>(&s1[0][0], Aqk, t0, L, H, hh, dplr::LOWER);
    dplr::load_square<BT, BT>(&s2[0][0], Aqb, t0, L, H, hh, dplr::LOWER);
    __syncthreads();
    const int y = y0 + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        const int i = wp * RW + r;
        if (i >= L)
            continue;
        float s = acc[r];
        for (int j = 0; j <= i; j++)
            s += s1[i][j] * sv[j][lane] + s2[i][j] * sv2[j][lane];
        if (y < V)
            kda_st(o + ((t0 + i) * H + hh) * V + y, s);
    }
}

/* grid (NC x ceil(V / 64), H) (chunk_tile): o = qg h + tril(Aqk) v + tril(Aqb) v2 for 64 value
 * columns, on mma.sync TF32 (kdamma::gemm_acc); needs K, V % 8 == 0 and 16-byte aligned arrays
 * (dplr_mma_fits). */
template <int BT>
__global__ void __launch_bounds__(kdamma::AB_THREADS)
    dplr_output_fwd_mma_kernel(Dims d, const float *__restrict__ qg, const float *__restrict__ h,
                               const float *__restrict__ Aqk, const float *__restrict__ Aqb,
                               const kda_bf16 *__restrict__ v, const float *__restrict__ v2,
                               kda_bf16 *__restrict__ o) {
    using namespace kdamma;
    constexpr int NTW = AbTile<BT>::NTW;
    constexpr int SM1 = gemm_smem<BT, true, false, float, float>(),
                  SM2 = gemm_smem<BT, true, false, float, kda_bf16>();
    __shared__ __align__(16) float sm[SM1 > SM2 ? SM1 : SM2];
    static_assert(sizeof(sm) >= BT * (AB_N + 8) * sizeof(kda_bf16), "o's staging fits in sm");
    const int H = d.H, K = d.K, V = d.V;
    const ChunkTile ct = chunk_tile(DG_CEIL_DIV(V, AB_N));
    const int64_t c = ct.c;
    const int hh = blockIdx.y, v0 = ct.z * AB_N;
    const int64_t t0 = d.chunk_t0[c], rv = (int64_t)H * V, ra = (int64_t)H * BT;
    const int L = d.chunk_len[c], nv = min(AB_N, V - v0);
    const int64_t ov = t0 * rv + (int64_t)hh * V + v0, oa = (t0 * H + hh) * BT;
    float acc[NTW][4] = {};
    gemm_acc<BT, true, false>(acc, qg + (t0 * H + hh) * K, (int64_t)H * K, L,
                              h + (c * H + hh) * (int64_t)K * V + v0, V, K, nv, K, sm);
    gemm_acc<BT, true, false, 1>(acc, Aqk + oa, ra, L, v + ov, rv, L, nv, BT, sm);
    gemm_acc<BT, true, false, 1>(acc, Aqb + oa, ra, L, v2 + ov, rv, L, nv, BT, sm);
    store_acc_rows<BT>(acc, o + ov, rv, L, nv, 1.f, reinterpret_cast<kda_bf16 *>(sm));
}

// ---- backward kernels

/* grid (NC, H, ceil(V / 32)): dv, dv2 and dh_c's columns y0..y0+31. */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_output_dv_kernel(Dims d, const float *__restrict__ qg, const float *__restrict__ Aqk,
                          const float *__restrict__ Aqb, const TI *__restrict__ dO,
                          float *__restrict__ dh, float *__restrict__ dv, float *__restrict__ dv2) {
    extern __shared__ float sm[];
    float(*sdo)[CT] = (float(*)[CT])sm; /* dO tile [BT][32] */
    float(*sq)[CT] = sdo + BT;          /* qg tile [BT][32] */
    float(*s1)[BT] = (float(*)[BT])(sm + 2 * BT * CT);
    float(*s2)[BT] = s1 + BT;

    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int y0 = blockIdx.z * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, y = y0 + lane;
    dplr::load_rows<BT, CT>(&sdo[0][0], dO, t0, L, H, hh, V, y0);
    dplr::load_square<BT, BT>(&s1[0][0], Aqk, t0, L, H, hh, dplr::LOWER);
    dplr::load_square<BT, BT>(&s2[0][0], Aqb, t0, L, H, hh, dplr::LOWER);
    __syncthreads();
    for (int r = wp; r < L; r += NW) { /* dv_r = sum_{i>=r} Aqk[i,r] dO_i (dv2: Aqb) */
        float s1v = 0.f, s2v = 0.f;
        for (int i = r; i < L; i++) {
            s1v += s1[i][r] * sdo[i][lane];
            s2v += s2[i][r] * sdo[i][lane];
        }
        if (y < V) {
            const int64_t o = ((t0 + r) * H + hh) * V + y;
            dv[o] = s1v;
            dv2[o] = s2v;
        }
    }
    /* dh_c[x][y] = sum_i qg_i[x] dO_i[y] (every element of dh_c is written) */
    float *dhc = dh + (c * H + hh) * K * (int64_t)V;
    for (int x0 = 0; x0 < K; x0 += CT) {
        dplr::load_rows<BT, CT>(&sq[0][0], qg, t0, L, H, hh, K, x0);
        __syncthreads();
#pragma unroll
        for (int r4 = 0; r4 < 4; r4++) {
            const int xl = 4 * wp + r4, x = x0 + xl;
            float s = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; i++)
                s += sq[i][xl] * sdo[i][lane];
            if (x < K && y < V)
                dhc[(int64_t)x * V + y] = s;
        }
        __syncthreads();
    }
}

/* grid (NC, H, ceil(K / 32)): dqg[i][x] = sum_y dO_i[y] h_c[x][y]. */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_output_dqg_kernel(Dims d, const float *__restrict__ h, const TI *__restrict__ dO,
                           float *__restrict__ dqg) {
    constexpr int RP = BT / NW, LD = CT + 1;
    __shared__ float sdo[BT][CT];
    __shared__ float sh[CT][LD]; /* [key row][value column] */
    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y, H = d.H, K = d.K, V = d.V;
    const int x0 = blockIdx.z * CT;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *hc = h + (c * H + hh) * K * (int64_t)V;
    float acc[RP];
#pragma unroll
    for (int p = 0; p < RP; p++)
        acc[p] = 0.f;
    for (int y0 = 0; y0 < V; y0 += CT) {
        dplr::load_rows<BT, CT>(&sdo[0][0], dO, t0, L, H, hh, V, y0);
        dplr::load_state_tile<LD>(&sh[0][0], hc, K, V, x0, y0);
        __syncthreads();
#pragma unroll 4
        for (int yy = 0; yy < CT; yy++) {
            const float hv = sh[lane][yy];
#pragma unroll
            for (int p = 0; p < RP; p++)
                acc[p] += sdo[wp + NW * p][yy] * hv;
        }
        __syncthreads();
    }
    const int x = x0 + lane;
    if (x >= K)
        return;
#pragma unroll
    for (int p = 0; p < RP; p++) {
        const int i = wp + NW * p;
        if (i < L)
            dqg[((t0 + i) * H + hh) * K + x] = acc[p];
    }
}

/* grid (NC, H): dAqk = tril(dO v^T), dAqb = tril(dO v2^T), whole rows of the L valid tokens. */
template <int BT, class TI>
__global__ void __launch_bounds__(NTH)
    dplr_output_da_kernel(Dims d, const TI *__restrict__ dO, const TI *__restrict__ v,
                          const float *__restrict__ v2, float *__restrict__ dAqk,
                          float *__restrict__ dAqb) {
    constexpr int R = BT / 16, LD = CT + 1;
    __shared__ float sdo[BT][LD], sv[BT][LD], sv2[BT][LD];
    const int64_t c = blockIdx.x;
    const int hh = blockIdx.y, H = d.H, V = d.V;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float a1[R][R], a2[R][R];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < R; j++)
            a1[i][j] = a2[i][j] = 0.f;
    for (int y0 = 0; y0 < V; y0 += CT) {
        dplr::load_rows<BT, LD>(&sdo[0][0], dO, t0, L, H, hh, V, y0);
        dplr::load_rows<BT, LD>(&sv[0][0], v, t0, L, H, hh, V, y0);
        dplr::load_rows<BT, LD>(&sv2[0][0], v2, t0, L, H, hh, V, y0);
        __syncthreads();
        kda_tile_abt<BT>(a1, sdo, sv, tx, ty);
        kda_tile_abt<BT>(a2, sdo, sv2, tx, ty);
        __syncthreads();
    }
    kda_store_lower<BT>(a1, dAqk, t0, L, hh, H, tx, ty);
    kda_store_lower<BT>(a2, dAqb, t0, L, hh, H, tx, ty);
}

// ---- launchers

template <int BT, class TI>
static dg_status output_fwd_t(dg_ctx *ctx, const kda_cuda_dims *d, const float *qg, const float *h,
                              const float *Aqk, const float *Aqb, const void *v, const float *v2,
                              void *o) {
    if (sizeof(TI) == 2 && dplr_mma_fits(d, {qg, h, Aqk, Aqb, v, v2, o})) {
        const unsigned nvt = (unsigned)DG_CEIL_DIV(d->V, kdamma::AB_N);
        dplr_output_fwd_mma_kernel<BT>
            <<<dim3((unsigned)d->NC * nvt, d->H), kdamma::AB_THREADS, 0, dg__stream(ctx)>>>(
                make_dims(d), qg, h, Aqk, Aqb, (const kda_bf16 *)v, v2, (kda_bf16 *)o);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
    const size_t smem = sizeof(float) * (3 * BT * CT + CT * CT + 2 * BT * BT);
    DG_TRY(smem_opt_in(dplr_output_fwd_kernel<BT, TI>, smem));
    const dim3 grid((unsigned)d->NC, d->H, (unsigned)DG_CEIL_DIV(d->V, CT));
    dplr_output_fwd_kernel<BT, TI><<<grid, NTH, smem, dg__stream(ctx)>>>(
        make_dims(d), qg, h, Aqk, Aqb, (const TI *)v, v2, (TI *)o);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_output_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                              const float *qg, const float *h, const float *Aqk,
                                              const float *Aqb, const void *v, const float *v2,
                                              void *o) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!qg || !h || !Aqk || !Aqb || !v || !v2 || !o)
        return dg__err(DG_ERR_ARG, "%s: every array is required", __func__);
    if (d->NC == 0)
        return DG_OK;
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return output_fwd_t<BT_, TI_>(ctx, d, qg, h, Aqk,
                                                                                Aqb, v, v2, o)));
    return DG_OK;
}

template <int BT, class TI>
static dg_status output_bwd_t(dg_ctx *ctx, const kda_cuda_dims *dd, const float *qg, const float *h,
                              const float *Aqk, const float *Aqb, const void *v, const float *v2,
                              const void *dO, float *dqg, float *dh, float *dAqk, float *dAqb,
                              float *dv, float *dv2) {
    if (sizeof(TI) == 2 &&
        dplr_mma_fits(dd, {qg, h, Aqk, Aqb, v, v2, dO, dqg, dh, dAqk, dAqb, dv, dv2})) {
        const kda_bf16 *bdO = (const kda_bf16 *)dO;
        DG_TRY(kda_output_bwd_bf16do(ctx, dd, 1.f, qg, h, nullptr, nullptr, 0, bdO, dqg, dh,
                                     nullptr, nullptr));
        DG_TRY(kda_output_bwd_bf16do(ctx, dd, 1.f, nullptr, nullptr, Aqk, v, 1, bdO, nullptr,
                                     nullptr, dAqk, dv));
        return kda_output_bwd_bf16do(ctx, dd, 1.f, nullptr, nullptr, Aqb, v2, 0, bdO, nullptr,
                                     nullptr, dAqb, dv2);
    }
    const Dims d = make_dims(dd);
    cudaStream_t s = dg__stream(ctx);
    const TI *tdO = (const TI *)dO;
    const size_t smem = sizeof(float) * (2 * BT * CT + 2 * BT * BT);
    DG_TRY(smem_opt_in(dplr_output_dv_kernel<BT, TI>, smem));
    dplr_output_dv_kernel<BT, TI>
        <<<dim3((unsigned)d.NC, d.H, (unsigned)DG_CEIL_DIV(d.V, CT)), NTH, smem, s>>>(
            d, qg, Aqk, Aqb, tdO, dh, dv, dv2);
    DG_CHECK_LAUNCH();
    dplr_output_dqg_kernel<BT, TI>
        <<<dim3((unsigned)d.NC, d.H, (unsigned)DG_CEIL_DIV(d.K, CT)), NTH, 0, s>>>(d, h, tdO, dqg);
    DG_CHECK_LAUNCH();
    dplr_output_da_kernel<BT, TI>
        <<<dim3((unsigned)d.NC, d.H), NTH, 0, s>>>(d, tdO, (const TI *)v, v2, dAqk, dAqb);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__dplr_output_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, int bf16,
                                              const float *qg, const float *h, const float *Aqk,
                                              const float *Aqb, const void *v, const float *v2,
                                              const void *dO, float *dqg, float *dh, float *dAqk,
                                              float *dAqb, float *dv, float *dv2) {
    DG_TRY(dplr_check_dims(__func__, ctx, d));
    if (!qg || !h || !Aqk || !Aqb || !v || !v2 || !dO || !dqg || !dh || !dAqk || !dAqb || !dv ||
        !dv2)
        return dg__err(DG_ERR_ARG, "%s: every array is required", __func__);
    if (d->NC == 0)
        return DG_OK;
    KDA_DISPATCH_BT(d->BT, DPLR_DISPATCH_TI(bf16, return output_bwd_t<BT_, TI_>(
                                                      ctx, d, qg, h, Aqk, Aqb, v, v2, dO, dqg, dh,
                                                      dAqk, dAqb, dv, dv2)));
    return DG_OK;
}
