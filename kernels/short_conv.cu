/*
 * kernels/short_conv.cu -- causal depthwise short convolution along T (the q/k/v conv of KDA and
 * other linear-attention layers), forward and backward, f32 and bf16 storage with f32 math.
 *
 * Rows r = b*T + t of [B*T, C]. Each row belongs to one sequence [st, en): [b*T, b*T + T) in batch
 * mode, or the cu_seqlens segment holding r (binary search) in varlen mode; reads before st are
 * zero, so nothing crosses a sequence boundary.
 * Backward: dz = dy act'(z) is recomputed where it is needed (W <= 8 taps, so this is cheaper than
 * a [B*T, C] f32 scratch buffer): dx[r] = sum_i dz[r + W-1-i] w[i] within the sequence; dw, dbias
 * are per-(channel, row chunk) partial sums, then a fixed-order sum over chunks. No atomics, so
 * the result is bitwise reproducible.
 */
#include "common.cuh"
#include "short_conv.cuh"

#define SC_THREADS 256
#define SC_COLS 32 /* channels per block in the dw reduction */
#define SC_LANES 8 /* row lanes per block in the dw reduction */
#define SC_MAX_CHUNKS 512
#define SC_MIN_CHUNK_ROWS 64

// ---- CUDA kernels

__device__ __forceinline__ float sc_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

/* The sequence [st, en) holding row r. */
__device__ __forceinline__ void sc_bounds(int64_t r, int64_t T, const int64_t *cu, int n_seqs,
                                          int64_t &st, int64_t &en) {
    if (!cu) {
        st = r / T * T;
        en = st + T;
        return;
    }
    int lo = 0, hi = n_seqs; /* largest k < n_seqs with cu[k] <= r; cu[k+1] > r then */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (cu[mid] <= r)
            lo = mid;
        else
            hi = mid;
    }
    st = cu[lo];
    en = cu[lo + 1];
}

/* Pre-activation z[r, c]: taps in order i = 0..W-1, then the bias (the CPU reference's order). */
template <typename DT>
__device__ __forceinline__ float sc_pre(const DT *x, const DT *w, const DT *bias, int64_t r,
                                        int64_t st, int64_t C, int64_t c, int W) {
    float acc = 0.0f;
    for (int i = 0; i < W; i++) {
        int64_t src = r - W + 1 + i;
        if (src >= st)
            acc += dg_ld(w, c * W + i) * dg_ld(x, src * C + c);
    }
    if (bias)
        acc += dg_ld(bias, c);
    return acc;
}

template <typename DT>
__global__ void sc_fwd_kernel(int64_t n, int64_t T, int64_t C, int W, const DT *x, const DT *w,
                              const DT *bias, dg_act act, const int64_t *cu, int n_seqs, DT *y) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = k / C, c = k % C, st, en;
        sc_bounds(r, T, cu, n_seqs, st, en);
        float z = sc_pre(x, w, bias, r, st, C, c, W);
        dg_st(y, k, act == DG_ACT_SILU ? z * sc_sigmoid(z) : z);
    }
}

/* dz[r, c] = dy act'(z); st is the start of r's sequence. */
template <typename DT>
__device__ __forceinline__ float sc_dz(const DT *x, const DT *w, const DT *bias, dg_act act,
                                       const DT *dy, int64_t r, int64_t st, int64_t C, int64_t c,
                                       int W) {
    float d = dg_ld(dy, r * C + c);
    if (act == DG_ACT_SILU) {
        float z = sc_pre(x, w, bias, r, st, C, c, W), s = sc_sigmoid(z);
        d *= s * (1.0f + z * (1.0f - s));
    }
    return d;
}

/* dx[r, c] = sum_i dz[r + W-1-i, c] w[c, i] over outputs in the same sequence. */
template <typename DT>
__global__ void sc_dx_kernel(int64_t n, int64_t T, int64_t C, int W, const DT *x, const DT *w,
                             const DT *bias, dg_act act, const int64_t *cu, int n_seqs,
                             const DT *dy, DT *dx) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = k / C, c = k % C, st, en;
        sc_bounds(r, T, cu, n_seqs, st, en);
        float acc = 0.0f;
        for (int i = 0; i < W; i++) {
            int64_t out = r + W - 1 - i;
            if (out < en)
                acc += sc_dz(x, w, bias, act, dy, out, st, C, c, W) * dg_ld(w, c * W + i);
        }
        dg_st(dx, k, acc);
    }
}

/* partial[chunk, c, i] = sum over the chunk's rows r of dz[r, c] x[r - W + 1 + i, c] (i < W) and
 * of dz[r, c] (i = W, the bias), each in a fixed order. Block: SC_COLS channels x SC_LANES rows. */
template <typename DT>
__global__ void sc_dw_partial_kernel(int64_t rows, int64_t T, int64_t C, int W, int64_t chunk_rows,
                                     const DT *x, const DT *w, const DT *bias, dg_act act,
                                     const int64_t *cu, int n_seqs, const DT *dy, float *partial) {
    __shared__ float sm[SC_LANES][DG_SHORT_CONV_MAX_W + 1][SC_COLS];
    int64_t c = (int64_t)blockIdx.x * SC_COLS + threadIdx.x;
    int64_t r0 = (int64_t)blockIdx.y * chunk_rows;
    int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float acc[DG_SHORT_CONV_MAX_W + 1];
#pragma unroll
    for (int i = 0; i <= DG_SHORT_CONV_MAX_W; i++)
        acc[i] = 0.0f;
    if (c < C) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += SC_LANES) {
            int64_t st, en;
            sc_bounds(r, T, cu, n_seqs, st, en);
            float d = sc_dz(x, w, bias, act, dy, r, st, C, c, W);
#pragma unroll
            for (int i = 0; i < DG_SHORT_CONV_MAX_W; i++) {
                int64_t src = r - W + 1 + i;
                if (i < W && src >= st)
                    acc[i] += d * dg_ld(x, src * C + c);
            }
            acc[DG_SHORT_CONV_MAX_W] += d;
        }
    }
#pragma unroll
    for (int i = 0; i <= DG_SHORT_CONV_MAX_W; i++)
        sm[threadIdx.y][i][threadIdx.x] = acc[i];
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float *pc = partial + ((int64_t)blockIdx.y * C + c) * (W + 1);
        for (int i = 0; i <= W; i++) {
            int slot = i < W ? i : DG_SHORT_CONV_MAX_W;
            float s = 0.0f;
            for (int l = 0; l < SC_LANES; l++)
                s += sm[l][slot][threadIdx.x];
            pc[i] = s;
        }
    }
}

/* dw[c, i] / dbias[c] = sum over chunks in order. */
template <typename DT>
__global__ void sc_dw_final_kernel(int nchunks, int64_t C, int W, const float *partial, DT *dw,
                                   DT *dbias) {
    int64_t n = C * (W + 1);
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x) {
        int64_t c = k / (W + 1);
        int i = (int)(k % (W + 1));
        float s = 0.0f;
        for (int j = 0; j < nchunks; j++)
            s += partial[(int64_t)j * n + k];
        if (i < W) {
            if (dw)
                dg_st(dw, c * W + i, s);
        } else if (dbias) {
            dg_st(dbias, c, s);
        }
    }
}

// ---- kernel launchers

static dg_status sc_check_args(const char *fn, dg_dtype dt, int W) {
    if (dt != DG_F32 && dt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "%s: no kernel for dtype %s (f32, bf16)", fn,
                       dg_dtype_name(dt));
    if (W < 1 || W > DG_SHORT_CONV_MAX_W)
        return dg__err(DG_ERR_SHAPE, "%s: W = %d must be 1..%d", fn, W, DG_SHORT_CONV_MAX_W);
    return DG_OK;
}

template <typename DT>
static dg_status sc_fwd_typed(dg_ctx *ctx, int64_t n, int64_t T, int64_t C, int W, const void *x,
                              const void *w, const void *bias, dg_act act, const int64_t *cu,
                              int n_seqs, void *y) {
    sc_fwd_kernel<DT><<<dg__blocks(n, SC_THREADS), SC_THREADS, 0, dg__stream(ctx)>>>(
        n, T, C, W, (const DT *)x, (const DT *)w, (const DT *)bias, act, cu, n_seqs, (DT *)y);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__short_conv_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T,
                                             int64_t C, int W, const void *x, const void *w,
                                             const void *bias, dg_act act, const int64_t *cu,
                                             int n_seqs, void *y) {
    DG_TRY(sc_check_args("short_conv (cuda)", dt, W));
    int64_t n = B * T * C;
    if (n <= 0)
        return DG_OK;
    if (dt == DG_F32)
        return sc_fwd_typed<float>(ctx, n, T, C, W, x, w, bias, act, cu, n_seqs, y);
    return sc_fwd_typed<__nv_bfloat16>(ctx, n, T, C, W, x, w, bias, act, cu, n_seqs, y);
}

template <typename DT>
static dg_status sc_bwd_typed(dg_ctx *ctx, int64_t rows, int64_t T, int64_t C, int W, const void *x,
                              const void *w, const void *bias, dg_act act, const int64_t *cu,
                              int n_seqs, const void *dy, void *dx, void *dw, void *dbias,
                              float *partial, int nchunks, int64_t chunk_rows) {
    cudaStream_t st = dg__stream(ctx);
    int64_t n = rows * C;
    if (dx) {
        sc_dx_kernel<DT><<<dg__blocks(n, SC_THREADS), SC_THREADS, 0, st>>>(
            n, T, C, W, (const DT *)x, (const DT *)w, (const DT *)bias, act, cu, n_seqs,
            (const DT *)dy, (DT *)dx);
        DG_CHECK_LAUNCH();
    }
    if (dw || dbias) {
        dim3 grid((unsigned)DG_CEIL_DIV(C, (int64_t)SC_COLS), (unsigned)nchunks);
        dim3 block(SC_COLS, SC_LANES);
        sc_dw_partial_kernel<DT><<<grid, block, 0, st>>>(rows, T, C, W, chunk_rows, (const DT *)x,
                                                         (const DT *)w, (const DT *)bias, act, cu,
                                                         n_seqs, (const DT *)dy, partial);
        DG_CHECK_LAUNCH();
        sc_dw_final_kernel<DT><<<dg__blocks(C * (W + 1), SC_THREADS), SC_THREADS, 0, st>>>(
            nchunks, C, W, partial, (DT *)dw, (DT *)dbias);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

extern "C" dg_status dg__short_conv_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T,
                                             int64_t C, int W, const void *x, const void *w,
                                             const void *bias, dg_act act, const int64_t *cu,
                                             int n_seqs, const void *dy, void *dx, void *dw,
                                             void *dbias) {
    DG_TRY(sc_check_args("short_conv backward (cuda)", dt, W));
    int64_t rows = B * T;
    if (C <= 0)
        return DG_OK;
    if (rows <= 0) { /* empty sums */
        size_t es = dg_dtype_size(dt);
        if (dw)
            DG_CHECK_CUDA(cudaMemsetAsync(dw, 0, (size_t)(C * W) * es, dg__stream(ctx)));
        if (dbias)
            DG_CHECK_CUDA(cudaMemsetAsync(dbias, 0, (size_t)C * es, dg__stream(ctx)));
        return DG_OK;
    }
    int64_t chunk_rows = DG_CEIL_DIV(rows, (int64_t)SC_MAX_CHUNKS);
    if (chunk_rows < SC_MIN_CHUNK_ROWS)
        chunk_rows = SC_MIN_CHUNK_ROWS;
    int nchunks = (int)DG_CEIL_DIV(rows, chunk_rows);
    size_t partial_bytes = 0;
    float *partial = NULL;
    if (dw || dbias) {
        partial_bytes = (size_t)nchunks * (size_t)(C * (W + 1)) * sizeof(float);
        DG_TRY(dg__cuda_malloc(ctx, partial_bytes, (void **)&partial));
    }
    dg_status s;
    if (dt == DG_F32)
        s = sc_bwd_typed<float>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx, dw, dbias,
                                partial, nchunks, chunk_rows);
    else
        s = sc_bwd_typed<__nv_bfloat16>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx, dw,
                                        dbias, partial, nchunks, chunk_rows);
    /* Stream-ordered free: the block is reused only by work queued after these kernels. */
    dg__cuda_free(ctx, partial, partial_bytes);
    return s;
}
