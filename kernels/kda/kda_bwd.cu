/*
 * kernels/kda/kda_bwd.cu -- backward of the elementwise KDA stages (spec §3, §4, §6.5-6.6) and the
 * deterministic partial-sum reduction shared by all backward stages.
 *
 *   l2norm (N1):  dx = r (dy - (dy . y) y)                 one warp per row of K
 *   beta   (N2):  db = dbeta c s (1 - s),  s = sigmoid(b)   one thread per element
 *   gate   (N3):  dg = reverse chunk-local cumsum of dG, then the gate backward (§3) -> dx;
 *                 dA_log [HV] and ddt_bias [HV*K] are sums over all tokens: per (chunk, hv, d)
 *                 partials into scratch, then a second kernel sums them in a fixed order.
 * The CPU twins are in ops/kda/l2norm.c, beta.c, gate_cumsum.c (same formulas, same branches).
 */
#include "kda_bwd.cuh"

using namespace kdab;

// ---- CUDA kernels

__global__ void sum_parts_kernel(float *out, const float *in, int64_t n_out, int E, int G, int P,
                                 int64_t pstride, bool acc) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_out;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t rh = i / E, e = i % E;
        const int64_t base = rh * G * E + e;
        float s = 0.f;
        for (int p = 0; p < P; p++)
            for (int g = 0; g < G; g++)
                s += in[p * pstride + base + (int64_t)g * E];
        out[i] = acc ? out[i] + s : s;
    }
}

/* One warp per row; the dot product is a butterfly warp sum, the same for every lane. */
__global__ void l2norm_bwd_kernel(int64_t rows, int K, const float *y, const float *r,
                                  const float *dy, float *dx) {
    const int lane = threadIdx.x & 31;
    const int64_t wpb = blockDim.x >> 5;
    for (int64_t row = blockIdx.x * wpb + (threadIdx.x >> 5); row < rows;
         row += (int64_t)gridDim.x * wpb) {
        const float *yr = y + row * K, *dyr = dy + row * K;
        float dot = 0.f;
        for (int c = lane; c < K; c += 32)
            dot += dyr[c] * yr[c];
        dot = warp_sum(dot);
        const float ri = r[row];
        for (int c = lane; c < K; c += 32)
            dx[row * K + c] = ri * (dyr[c] - dot * yr[c]);
    }
}

__global__ void beta_bwd_kernel(int64_t n, float c, const float *b, const float *dbeta, float *db) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float s = sigmoidf_(b[i]);
        db[i] = dbeta[i] * c * s * (1.f - s);
    }
}

/* grid (NC, ceil(HV*K / 256)): thread = one (hv, d) column of one chunk, walking its rows from the
 * last to the first (reverse inclusive cumsum), writing dx and the column's partial sums of
 * d dt_bias (pdt) and of d A_log (pA) over the chunk's tokens. */
__global__ void gate_bwd_kernel(Dims d, dg_gate_kind kind, float lb, int cumsum, const float *x,
                                const float *A_log, const float *dt_bias, const float *dG,
                                float *dx, float *pdt, float *pA) {
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
    for (int i = L - 1; i >= 0; i--) {
        const int64_t idx = (t0 + i) * row + e;
        float v = dG[idx];
        if (cumsum) {
            acc = v + acc;
            v = acc;
            /* a g floored in the forward (kda_gate_cumsum_fwd_kernel) has no gradient */
            const float gv = kind == DG_GATE_NONE  ? x[idx]
                             : kind == DG_GATE_KDA ? -a * softplusf_(x[idx] + bias)
                                                   : 0.f;
            if (gv < -128.f)
                v = 0.f;
        }
        if (kind == DG_GATE_KDA) {
            /* g = -a softplus(z): dg/dz = -a sigmoid(z), dg/dA_log = g */
            const float z = x[idx] + bias;
            const float dz = -v * a * sigmoidf_(z);
            sda += v * (-a * softplusf_(z));
            sdz += dz;
            dx[idx] = dz;
        } else if (kind == DG_GATE_LOWERBOUND) {
            /* g = lb sigmoid(u), u = a z: dg/du = lb s (1 - s); du/dz = a, du/dA_log = u */
            const float z = x[idx] + bias;
            const float u = a * z, s = sigmoidf_(u);
            const float du = v * lb * s * (1.f - s);
            const float dz = du * a;
            sda += du * u;
            sdz += dz;
            dx[idx] = dz;
        } else {
            dx[idx] = v;
        }
    }
    if (pdt)
        pdt[c * row + e] = sdz;
    if (pA)
        pA[c * row + e] = sda;
}

/* ddt_bias[e] = sum over chunks of pdt[c, e] (chunk order). */
__global__ void gate_ddt_reduce_kernel(int64_t NC, int row, const float *pdt, float *ddt_bias) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= row)
        return;
    float s = 0.f;
    for (int64_t c = 0; c < NC; c++)
        s += pdt[c * row + e];
    ddt_bias[e] = s;
}

/* dA_log[hv] = sum over chunks and key dims of pA[c, hv, d]: block hv, each thread a fixed
 * strided subset, then a fixed shared-memory tree. */
__global__ void gate_dA_reduce_kernel(int64_t NC, int HV, int K, const float *pA, float *dA_log) {
    __shared__ float red[NTH];
    const int hv = blockIdx.x;
    const int64_t n = NC * K;
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < n; i += NTH) {
        const int64_t c = i / K, col = i % K;
        s += pA[(c * HV + hv) * K + col];
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int w = NTH / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        dA_log[hv] = red[0];
}

// ---- kernel launchers

dg_status kda_sum_parts(dg_ctx *ctx, float *out, const float *in, int64_t rows, int Hout, int G,
                        int E, int P, int64_t pstride, int acc) {
    const int64_t n = rows * Hout * E;
    if (n <= 0)
        return DG_OK;
    sum_parts_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(out, in, n, E, G, P, pstride,
                                                                      acc != 0);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status kda_l2norm_bwd_cuda(dg_ctx *ctx, int64_t rows, int K, const float *y,
                                         const float *r, const float *dy, float *dx) {
    if (rows < 0 || K < 1)
        return dg__err(DG_ERR_SHAPE, "kda_l2norm_bwd_cuda: rows=%lld K=%d", (long long)rows, K);
    if (rows == 0 || !dx)
        return DG_OK;
    const int rows_per_block = NTH / 32;
    l2norm_bwd_kernel<<<dg__blocks(rows, rows_per_block), NTH, 0, dg__stream(ctx)>>>(rows, K, y, r,
                                                                                     dy, dx);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status kda_beta_bwd_cuda(dg_ctx *ctx, int64_t n, float c, const float *b,
                                       const float *dbeta, float *db) {
    if (n <= 0 || !db)
        return DG_OK;
    beta_bwd_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(n, c, b, dbeta, db);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status kda_gate_bwd_cuda(dg_ctx *ctx, const kda_cuda_dims *d, dg_gate_kind kind,
                                       float lb, int cumsum, const float *x, const float *A_log,
                                       const float *dt_bias, const float *dG, float *dx,
                                       float *dA_log, float *ddt_bias) {
    DG_TRY(check_dims("kda_gate_bwd_cuda", d));
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
        DG_TRY(part.alloc(2 * (size_t)d->NC * row));
        pdt = part.f();
        pA = pdt + (size_t)d->NC * row;
    }
    dim3 grid((unsigned)d->NC, DG_CEIL_DIV(row, NTH));
    gate_bwd_kernel<<<grid, NTH, 0, s>>>(make_dims(d), kind, lb, cumsum, x, A_log, dt_bias, dG, dx,
                                         pdt, pA);
    DG_CHECK_LAUNCH();
    if (pdt && ddt_bias) {
        gate_ddt_reduce_kernel<<<DG_CEIL_DIV(row, NTH), NTH, 0, s>>>(d->NC, row, pdt, ddt_bias);
        DG_CHECK_LAUNCH();
    }
    if (pA && dA_log) {
        gate_dA_reduce_kernel<<<d->HV, NTH, 0, s>>>(d->NC, d->HV, d->K, pA, dA_log);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}
