/*
 * kernels/kda/gate.cu -- N3, the gate and the chunk-local cumsum (kda.md §11.2, §11.4(a),
 * §11.6 B5);
 * CPU twin: ops/kda/gate_cumsum.c (same formulas, same branches).
 *   forward:   g = gate(x) (NONE / KDA / LOWERBOUND), then (cumsum != 0) the chunk-local
 *              inclusive cumsum G_i = sum_{r <= i} g_r restarting at every chunk, with each g
 *              floored at KDA_G_FLOOR_F first                       x, G: [TT, HV, K]
 *   backward:  dg = reverse chunk-local cumsum of dG, then the gate backward (kda.md §11.2) -> dx;
 *              dA_log [HV] and ddt_bias [HV*K] are sums over all tokens: per (chunk, hv, d)
 *              partials into scratch, then sums over the chunks (dg_colsum_kernel, 32 lanes
 *              per column) and, for dA_log, over the key dims (one warp per hv): fixed orders.
 * One thread per (chunk, key column) walks its chunk's tokens in order (backward: in reverse),
 * as the CPU does. One f32 FFMA variant: the tc mode does not apply.
 * Entry points (kda_cuda.h): dg__kda_gate_fwd_cuda, dg__kda_gate_bwd_cuda.
 */
#include "common.cuh"

using namespace kdab;

#define GATE_ROWS 8 /* token rows whose loads a column walk issues together */

// ---- forward kernels

/* No cumsum: one thread per element of [TT, HV*K]. x of TX (f32 or bf16, read as stored) in
 * every kernel of this file; dx of the backward has x's dtype. */
template <class TX>
__global__ void kda_gate_fwd_kernel(int64_t n, int HV, int K, dg_gate_kind kind, float lb,
                                    const TX *__restrict__ x, const float *__restrict__ A_log,
                                    const float *__restrict__ dt_bias, float *__restrict__ G) {
    const int row = HV * K;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int e = (int)(i % row), hv = e / K;
        const float a = A_log ? expf(A_log[hv]) : 1.f;
        G[i] = kda_gate_value(kind, lb, kda_ld(x + i), a, dt_bias, e);
    }
}

/* Cumsum: blockIdx.x = chunk, threads over the HV*K columns of a token row (coalesced), P
 * adjacent columns per thread (P = 2 where HV*K is even: one 4-byte bf16 / 8-byte f32 load and
 * one 8-byte store per row instead of P); each thread walks the L tokens of its chunk in order,
 * as the CPU does (G_i = G_{i-1} + g_i). */
template <int P, class TX>
__global__ void
kda_gate_cumsum_fwd_kernel(const int64_t *__restrict__ chunk_t0,
                           const int32_t *__restrict__ chunk_len, int HV, int K, dg_gate_kind kind,
                           float lb, const TX *__restrict__ x, const float *__restrict__ A_log,
                           const float *__restrict__ dt_bias, float *__restrict__ G) {
    const int row = HV * K;
    const int e = P * (blockIdx.y * blockDim.x + threadIdx.x);
    if (e >= row)
        return;
    const int64_t t0 = chunk_t0[blockIdx.x];
    const int L = chunk_len[blockIdx.x];
    float a[P], acc[P];
#pragma unroll
    for (int p = 0; p < P; p++) {
        a[p] = A_log ? expf(A_log[(e + p) / K]) : 1.f;
        acc[p] = 0.f;
    }
    /* rows in groups of GATE_ROWS, each group's loads issued before its sums (a thread walks a
     * column, so one load at a time would leave the memory system mostly idle) */
    for (int i0 = 0; i0 < L; i0 += GATE_ROWS) {
        float xv[GATE_ROWS][P];
#pragma unroll
        for (int u = 0; u < GATE_ROWS; u++) {
            if (i0 + u < L)
                kda_ldn<P>(xv[u], x + (t0 + i0 + u) * row + e);
            else
#pragma unroll
                for (int p = 0; p < P; p++)
                    xv[u][p] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < GATE_ROWS; u++) {
            if (i0 + u >= L)
                break;
#pragma unroll
            for (int p = 0; p < P; p++) {
                /* floored as on the CPU (ops/kda/gate_cumsum.c): a decay of zero (g = -inf)
                 * would make G differences -inf - (-inf); exp(-128) is 0 in f32 anyway. NaN
                 * stays NaN. */
                const float gv = kda_gate_value(kind, lb, xv[u][p], a[p], dt_bias, e + p);
                acc[p] += gv < KDA_G_FLOOR_F ? KDA_G_FLOOR_F : gv;
            }
            kda_stn<P>(G + (t0 + i0 + u) * row + e, acc);
        }
    }
}

// ---- backward kernels

/* grid (NC, ceil(HV*K / 256)): thread = one (hv, d) column of one chunk, walking its rows from the
 * last to the first (reverse inclusive cumsum), writing dx and the column's partial sums of
 * d dt_bias (pdt) and of d A_log (pA) over the chunk's tokens. */
template <class TX>
__global__ void gate_bwd_kernel(Dims d, dg_gate_kind kind, float lb, int cumsum,
                                const TX *__restrict__ x, const float *__restrict__ A_log,
                                const float *__restrict__ dt_bias, const float *__restrict__ dG,
                                TX *__restrict__ dx, float *__restrict__ pdt,
                                float *__restrict__ pA) {
    const int row = d.HV * d.K;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= row)
        return;
    const int64_t c = blockIdx.x;
    const int64_t t0 = d.chunk_t0[c];
    const int L = d.chunk_len[c];
    const int hv = e / d.K;
    const float a = A_log ? expf(A_log[hv]) : 1.f;
    const float bias = dt_bias ? dt_bias[e] : 0.f;
    float acc = 0.f, sdz = 0.f, sda = 0.f;
    for (int i1 = L - 1; i1 >= 0; i1 -= GATE_ROWS) { /* rows i1, i1 - 1, ..: loads first */
        float dgv[GATE_ROWS], xvs[GATE_ROWS];
#pragma unroll
        for (int u = 0; u < GATE_ROWS; u++) {
            const int64_t idx = (t0 + i1 - u) * row + e;
            dgv[u] = i1 - u >= 0 ? dG[idx] : 0.f;
            xvs[u] = i1 - u >= 0 ? kda_ld(x + idx) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < GATE_ROWS; u++) {
            if (i1 - u < 0)
                break;
            const int64_t idx = (t0 + i1 - u) * row + e;
            float v = dgv[u];
            const float xv = xvs[u];
            if (cumsum) {
                acc = v + acc;
                v = acc;
                /* a g floored in the forward (kda_gate_cumsum_fwd_kernel) has no gradient */
                const float gv = kind == DG_GATE_NONE  ? xv
                                 : kind == DG_GATE_KDA ? -a * kda_dsoftplus(xv + bias)
                                                       : 0.f;
                if (gv < KDA_G_FLOOR_F)
                    v = 0.f;
            }
            if (kind == DG_GATE_KDA) {
                /* g = -a softplus(z): dg/dz = -a sigmoid(z), dg/dA_log = g */
                const float z = xv + bias;
                const float dz = -v * a * kda_dsigmoid(z);
                sda += v * (-a * kda_dsoftplus(z));
                sdz += dz;
                kda_st(dx + idx, dz);
            } else if (kind == DG_GATE_LOWERBOUND) {
                /* g = lb sigmoid(u), u = a z: dg/du = lb s (1 - s); du/dz = a, du/dA_log = u */
                const float z = xv + bias;
                const float u = a * z, s = kda_dsigmoid(u);
                const float du = v * lb * s * (1.f - s);
                const float dz = du * a;
                sda += du * u;
                sdz += dz;
                kda_st(dx + idx, dz);
            } else {
                kda_st(dx + idx, v);
            }
        }
    }
    if (pdt)
        pdt[c * row + e] = sdz;
    if (pA)
        pA[c * row + e] = sda;
}

#define GATE_CS_LANES 32 /* lanes per column of the sums over chunks */

/* dA_log[hv] = sum over the key dims of tA[hv, d]: one warp per value head, lane l over
 * d = l, l + 32, ... in order, then a butterfly (every lane ends with the same bits). */
__global__ void gate_dA_reduce_kernel(int HV, int K, const float *tA, float *dA_log) {
    const int hv = blockIdx.x;
    float s = 0.f;
    for (int d = threadIdx.x; d < K; d += 32)
        s += tA[(int64_t)hv * K + d];
    s = warp_sum(s);
    if (threadIdx.x == 0 && hv < HV)
        dA_log[hv] = s;
}

// ---- launchers

extern "C" dg_status dg__kda_gate_fwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind,
                                           float lb, int cumsum, int xbf16, const void *x,
                                           const float *A_log, const float *dt_bias, float *G) {
    DG_TRY(kda_check_dims(__func__, ctx, d));
    if (!x || !G)
        return dg__err(DG_ERR_ARG, "%s: x and G are required", __func__);
    if (kind != DG_GATE_NONE && kind != DG_GATE_KDA && kind != DG_GATE_LOWERBOUND)
        return dg__err(DG_ERR_ARG, "%s: unknown gate kind %d", __func__, (int)kind);
    const int row = d->HV * d->K;
    if (!cumsum) {
        const int64_t n = d->TT * row;
        if (xbf16)
            kda_gate_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(
                n, d->HV, d->K, kind, lb, (const kda_bf16 *)x, A_log, dt_bias, G);
        else
            kda_gate_fwd_kernel<<<dg__blocks(n, KDA_THREADS), KDA_THREADS, 0, dg__stream(ctx)>>>(
                n, d->HV, d->K, kind, lb, (const float *)x, A_log, dt_bias, G);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
    if (d->NC == 0)
        return DG_OK;
    /* column pairs where every pair stays in a row and keeps its alignment */
    const bool pairs = row % 2 == 0 && (uintptr_t)x % (xbf16 ? 4 : 8) == 0 && (uintptr_t)G % 8 == 0;
    dim3 grid((unsigned)d->NC, (unsigned)DG_CEIL_DIV(row, (pairs ? 2 : 1) * KDA_THREADS));
    auto launch = [&](auto P, const auto *xt) {
        kda_gate_cumsum_fwd_kernel<decltype(P)::value><<<grid, KDA_THREADS, 0, dg__stream(ctx)>>>(
            d->chunk_t0, d->chunk_len, d->HV, d->K, kind, lb, xt, A_log, dt_bias, G);
    };
    if (xbf16 && pairs)
        launch(std::integral_constant<int, 2>(), (const kda_bf16 *)x);
    else if (xbf16)
        launch(std::integral_constant<int, 1>(), (const kda_bf16 *)x);
    else if (pairs)
        launch(std::integral_constant<int, 2>(), (const float *)x);
    else
        launch(std::integral_constant<int, 1>(), (const float *)x);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__kda_gate_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind,
                                           float lb, int cumsum, int xbf16, const void *x,
                                           const float *A_log, const float *dt_bias,
                                           const float *dG, void *dx, float *dA_log,
                                           float *ddt_bias) {
    DG_TRY(check_dims("dg__kda_gate_bwd_cuda", d));
    cudaStream_t s = dg__stream(ctx);
    const int row = d->HV * d->K;
    const int gated = kind != DG_GATE_NONE;
    if (dA_log)
        DG_CHECK_CUDA(cudaMemsetAsync(dA_log, 0, sizeof(float) * (size_t)d->HV, s));
    if (ddt_bias)
        DG_CHECK_CUDA(cudaMemsetAsync(ddt_bias, 0, sizeof(float) * (size_t)row, s));
    if (d->NC == 0)
        return DG_OK;
    /* dx doubles as the cumsum buffer, so it is required even when only the reductions are */
    Scratch sdx(ctx), part(ctx);
    if (!dx) {
        DG_TRY(sdx.alloc((size_t)d->TT * row));
        dx = sdx.f();
    }
    float *pdt = nullptr, *pA = nullptr;
    if (gated && (dA_log || ddt_bias)) {
        DG_TRY(part.alloc(2 * (size_t)d->NC * row + (size_t)row)); /* pdt, pA, tA */
        pdt = part.f();
        pA = pdt + (size_t)d->NC * row;
    }
    dim3 grid((unsigned)d->NC, DG_CEIL_DIV(row, NTH));
    if (xbf16)
        gate_bwd_kernel<<<grid, NTH, 0, s>>>(make_dims(d), kind, lb, cumsum, (const kda_bf16 *)x,
                                             A_log, dt_bias, dG, (kda_bf16 *)dx, pdt, pA);
    else
        gate_bwd_kernel<<<grid, NTH, 0, s>>>(make_dims(d), kind, lb, cumsum, (const float *)x,
                                             A_log, dt_bias, dG, (float *)dx, pdt, pA);
    DG_CHECK_LAUNCH();
    if (pdt && (ddt_bias || dA_log)) {
        /* sums over the chunks in a fixed order (dg_colsum_kernel): pdt into ddt_bias, pA into
         * tA, then tA over the key dims into dA_log */
        float *tA = pA + (size_t)d->NC * row;
        const dim3 cblock(32, GATE_CS_LANES);
        const unsigned cgrid = DG_CEIL_DIV(row, 32);
        if (ddt_bias) {
            dg_colsum_kernel<float, GATE_CS_LANES>
                <<<cgrid, cblock, 0, s>>>(d->NC, row, pdt, ddt_bias);
            DG_CHECK_LAUNCH();
        }
        if (dA_log) {
            dg_colsum_kernel<float, GATE_CS_LANES><<<cgrid, cblock, 0, s>>>(d->NC, row, pA, tA);
            DG_CHECK_LAUNCH();
            gate_dA_reduce_kernel<<<d->HV, 32, 0, s>>>(d->HV, d->K, tA, dA_log);
            DG_CHECK_LAUNCH();
        }
    }
    return DG_OK;
}
