/*
 * kernels/norm.cu -- row normalisations over the last axis: rmsnorm and gated rmsnorm, forward and
 * backward, for f32 and bf16 storage with f32 math (see norm.cuh for the formulas). The L2 norm
 * has its own kernels, kernels/l2norm.cu.
 *
 * Rows of up to NORM_WARP_MAX_D elements get one warp each (NORM_WARP_ROWS rows per block); wider
 * rows get a block of NORM_BLOCK_THREADS threads. Every row reduction is a butterfly within the
 * warp plus, in block mode, a fixed-order sum over the warps, so results are bitwise reproducible.
 * The weight gradient sums over rows in two passes: blocks of NORM_DW_COLS columns x one chunk of
 * rows write partial sums, then dg_colsum_kernel (common.cuh) adds the chunks in a fixed order (8
 * lanes per column, each over every 8th chunk, then the lanes in order). No atomics. Rows of D <=
 * 256 (the per-head norms) run the backward with the row held in registers (norm_bwd_warp_kernel).
 *
 * The residual add + RMSNorm (dg_add_rmsnorm) uses the same row layout. Its forward reads x and
 * the residual once and writes the sum and y. Its backward is one row kernel: each block takes a
 * contiguous run of rows, writes dx and keeps its share of dw in shared memory (one row of D per
 * warp on the warp path, one per block on the block path while D fits, else in the block's own
 * row of the partial buffer), then writes one partial row; norm_colsum adds the partials in its
 * fixed order. The rows a block takes depend on rows and D only: bitwise reproducible.
 */
#include "common.cuh"
#include "norm.cuh"

#include <limits.h>

#define NORM_WARP_MAX_D 1024
#define NORM_WARP_ROWS 8
#define NORM_BWD_PL 8 /* rows of D <= 256: the backward keeps the row in registers */
#define NORM_BLOCK_THREADS 256
#define NORM_DW_COLS 32
#define NORM_DW_LANES 8
#define NORM_DW_MAX_CHUNKS 512
#define NORM_DW_MIN_CHUNK_ROWS 64
/* dg_add_rmsnorm's backward: at most this many blocks (= dw partial rows) when dw is wanted. A
 * fixed number, so that the summation order does not depend on the device; 768 blocks are one
 * wave on a 132-SM H100/H200 for D <= 1024 (32 KB of shared memory per block, 6 per SM). */
#define ADD_NORM_MAX_BLOCKS 768
#define ADD_NORM_SMEM_MAX_D (48 * 1024 / 4) /* block path: dw share in shared memory up to here */

// ---- CUDA kernels

__device__ __forceinline__ float norm_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

/* act(g) and act'(g); DG_ACT_NONE is the identity. */
__device__ __forceinline__ float norm_act(dg_act act, float g) {
    if (act == DG_ACT_SILU)
        return g * norm_sigmoid(g);
    if (act == DG_ACT_SIGMOID)
        return norm_sigmoid(g);
    return g;
}

__device__ __forceinline__ float norm_act_grad(dg_act act, float g) {
    if (act == DG_ACT_SILU) {
        float s = norm_sigmoid(g);
        return s * (1.0f + g * (1.0f - s));
    }
    if (act == DG_ACT_SIGMOID) {
        float s = norm_sigmoid(g);
        return s * (1.0f - s);
    }
    return 1.0f;
}

/* Butterfly sum: every lane ends with the same bits (fp addition is commutative). */
__device__ __forceinline__ float norm_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the threads that share a row, returned to all of them. Block mode ends with a barrier
 * so that `smem` (32 floats) can be reused by the next call. */
template <bool WARP> __device__ __forceinline__ float norm_row_sum(float v, float *smem) {
    v = norm_warp_sum(v);
    if (WARP)
        return v;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0)
        smem[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < nw; i++)
        s += smem[i];
    __syncthreads();
    return s;
}

/* First row, row step, this thread's first column and the column step. */
template <bool WARP>
__device__ __forceinline__ void norm_rows(int64_t &row, int64_t &step, int &lane, int &width) {
    if (WARP) {
        row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
        step = (int64_t)gridDim.x * blockDim.y;
        lane = threadIdx.x;
        width = 32;
    } else {
        row = blockIdx.x;
        step = gridDim.x;
        lane = threadIdx.x;
        width = blockDim.x;
    }
}

template <typename T, bool WARP>
__global__ void norm_fwd_kernel(int64_t rows, int D, float scale, float eps, const T *x, const T *w,
                                const T *gate, dg_act act, T *y, float *rstd) {
    __shared__ float smem[32];
    int64_t row, step;
    int lane, width;
    norm_rows<WARP>(row, step, lane, width);
    for (; row < rows; row += step) {
        const T *xr = x + row * D;
        float ss = 0.0f;
        for (int j = lane; j < D; j += width) {
            float v = dg_ld(xr, j);
            ss += v * v;
        }
        ss = norm_row_sum<WARP>(ss, smem);
        float r = 1.0f / sqrtf(ss * scale + eps);
        if (rstd && lane == 0)
            rstd[row] = r;
        const T *gr = gate ? gate + row * D : nullptr;
        T *yr = y + row * D;
        for (int j = lane; j < D; j += width) {
            float v = dg_ld(xr, j) * r;
            if (w)
                v *= dg_ld(w, j);
            if (gr)
                v *= norm_act(act, dg_ld(gr, j));
            dg_st(yr, j, v);
        }
    }
}

/* dx and dgate per row; also writes r to rstd_out when asked (for the dw pass). */
template <typename T, bool WARP>
__global__ void norm_bwd_kernel(int64_t rows, int D, float scale, float eps, const T *x, const T *w,
                                const T *gate, dg_act act, const float *rstd, const T *dy, T *dx,
                                T *dgate, float *rstd_out) {
    __shared__ float smem[32];
    int64_t row, step;
    int lane, width;
    norm_rows<WARP>(row, step, lane, width);
    for (; row < rows; row += step) {
        const T *xr = x + row * D, *dyr = dy + row * D;
        const T *gr = gate ? gate + row * D : nullptr;
        float r;
        if (rstd) {
            r = rstd[row];
        } else {
            float ss = 0.0f;
            for (int j = lane; j < D; j += width) {
                float v = dg_ld(xr, j);
                ss += v * v;
            }
            ss = norm_row_sum<WARP>(ss, smem);
            r = 1.0f / sqrtf(ss * scale + eps);
        }
        if (rstd_out && lane == 0)
            rstd_out[row] = r;
        if (dx) {
            float dot = 0.0f; /* sum_j g_j x_j */
            for (int j = lane; j < D; j += width) {
                float g = dg_ld(dyr, j);
                if (w)
                    g *= dg_ld(w, j);
                if (gr)
                    g *= norm_act(act, dg_ld(gr, j));
                dot += g * dg_ld(xr, j);
            }
            dot = norm_row_sum<WARP>(dot, smem);
            float m = scale * r * dot; /* scale * sum_j g_j xh_j */
            T *dxr = dx + row * D;
            for (int j = lane; j < D; j += width) {
                float g = dg_ld(dyr, j);
                if (w)
                    g *= dg_ld(w, j);
                if (gr)
                    g *= norm_act(act, dg_ld(gr, j));
                dg_st(dxr, j, r * (g - dg_ld(xr, j) * r * m));
            }
        }
        if (dgate) {
            T *dgr = dgate + row * D;
            for (int j = lane; j < D; j += width) {
                float v = dg_ld(dyr, j) * dg_ld(xr, j) * r;
                if (w)
                    v *= dg_ld(w, j);
                dg_st(dgr, j, v * norm_act_grad(act, dg_ld(gr, j)));
            }
        }
    }
}

/* norm_bwd_kernel for rows of D <= 32 PL on the warp path, with the row's values read once into
 * registers (lane owns columns lane + 32 k): the same arithmetic in the same order, so the same
 * bits, without reading x, dy, gate and w three times and forming act(gate) twice. */
template <typename T, int PL>
__global__ void norm_bwd_warp_kernel(int64_t rows, int D, float scale, float eps, const T *x,
                                     const T *w, const T *gate, dg_act act, const float *rstd,
                                     const T *dy, T *dx, T *dgate, float *rstd_out) {
    const int lane = threadIdx.x;
    const int64_t step = (int64_t)gridDim.x * blockDim.y;
    for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += step) {
        const T *xr = x + row * D, *dyr = dy + row * D;
        const T *gr = gate ? gate + row * D : nullptr;
        float xv[PL], dyw[PL], gt[PL], g[PL];
        float ss = 0.0f, dot = 0.0f;
#pragma unroll
        for (int k = 0; k < PL; k++) {
            const int j = lane + 32 * k;
            xv[k] = dyw[k] = gt[k] = g[k] = 0.0f;
            if (j < D) {
                xv[k] = dg_ld(xr, j);
                ss += xv[k] * xv[k];
                dyw[k] = dg_ld(dyr, j);
                if (w)
                    dyw[k] *= dg_ld(w, j);
                g[k] = dyw[k];
                if (gr) {
                    gt[k] = dg_ld(gr, j);
                    g[k] *= norm_act(act, gt[k]);
                }
                dot += g[k] * xv[k];
            }
        }
        float r;
        if (rstd) {
            r = rstd[row];
        } else {
            ss = norm_warp_sum(ss);
            r = 1.0f / sqrtf(ss * scale + eps);
        }
        if (rstd_out && lane == 0)
            rstd_out[row] = r;
        if (dx) {
            dot = norm_warp_sum(dot);
            const float m = scale * r * dot;
            T *dxr = dx + row * D;
#pragma unroll
            for (int k = 0; k < PL; k++)
                if (lane + 32 * k < D)
                    dg_st(dxr, lane + 32 * k, r * (g[k] - xv[k] * r * m));
        }
        if (dgate) {
            T *dgr = dgate + row * D;
#pragma unroll
            for (int k = 0; k < PL; k++) {
                const int j = lane + 32 * k;
                if (j < D) {
                    /* dy x r w in norm_bwd_kernel's order: ((dy x) r) w */
                    float v = dg_ld(dyr, j) * xv[k] * r;
                    if (w)
                        v *= dg_ld(w, j);
                    dg_st(dgr, j, v * norm_act_grad(act, gt[k]));
                }
            }
        }
    }
}

/* partial[chunk, j] = sum over the chunk's rows of dy x r act(gate), in a fixed order. */
template <typename T>
__global__ void norm_dw_partial_kernel(int64_t rows, int D, int64_t chunk_rows, const T *x,
                                       const T *gate, dg_act act, const float *rstd, const T *dy,
                                       float *partial) {
    __shared__ float acc_s[NORM_DW_LANES][NORM_DW_COLS];
    int col = blockIdx.x * NORM_DW_COLS + threadIdx.x;
    int64_t r0 = (int64_t)blockIdx.y * chunk_rows;
    int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float acc = 0.0f;
    if (col < D) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += NORM_DW_LANES) {
            int64_t i = r * D + col;
            float v = dg_ld(dy, i) * dg_ld(x, i) * rstd[r];
            if (gate)
                v *= norm_act(act, dg_ld(gate, i));
            acc += v;
        }
    }
    acc_s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < D) {
        float s = 0.0f;
        for (int k = 0; k < NORM_DW_LANES; k++)
            s += acc_s[k][threadIdx.x];
        partial[(int64_t)blockIdx.y * D + col] = s;
    }
}

/* Sum the nchunks partial rows of the weight gradient into out (dg_colsum_kernel). */
template <typename T>
static void norm_colsum(cudaStream_t st, int nchunks, int D, const float *partial, void *out) {
    dim3 block(32, NORM_DW_LANES);
    dg_colsum_kernel<T, NORM_DW_LANES>
        <<<(unsigned)DG_CEIL_DIV(D, 32), block, 0, st>>>(nchunks, D, partial, (T *)out);
}

/* The value v takes once stored as T (what a later reader of the stored tensor sees). */
__device__ __forceinline__ float norm_round(float v, const float *) { return v; }
__device__ __forceinline__ float norm_round(float v, const __nv_bfloat16 *) {
    return __bfloat162float(__float2bfloat16(v));
}

/* sum = x + res (stored as T), y = sum r w; the statistics use the stored sum. */
template <typename T, bool WARP>
__global__ void add_norm_fwd_kernel(int64_t rows, int D, float scale, float eps, const T *x,
                                    const T *res, const T *w, T *sum, T *y, float *rstd) {
    __shared__ float smem[32];
    int64_t row, step;
    int lane, width;
    norm_rows<WARP>(row, step, lane, width);
    for (; row < rows; row += step) {
        const T *xr = x + row * D, *rr = res + row * D;
        T *sr = sum + row * D;
        float ss = 0.0f;
        for (int j = lane; j < D; j += width) {
            float v = norm_round(dg_ld(xr, j) + dg_ld(rr, j), sr);
            dg_st(sr, j, v); /* exact: v is representable in T */
            ss += v * v;
        }
        ss = norm_row_sum<WARP>(ss, smem);
        float r = 1.0f / sqrtf(ss * scale + eps);
        if (rstd && lane == 0)
            rstd[row] = r;
        T *yr = y + row * D;
        for (int j = lane; j < D; j += width) { /* this thread's own stores: no barrier needed */
            float v = dg_ld(sr, j) * r;
            if (w)
                v *= dg_ld(w, j);
            dg_st(yr, j, v);
        }
    }
}

/* Rows [blockIdx.x * rows_per_block, + rows_per_block): dx = dsum + rmsnorm backward, and, when
 * partial is set, partial[blockIdx.x, j] = this block's sum over its rows of dy s r. Dynamic shared
 * memory: NORM_WARP_ROWS * D floats (warp path), D floats (block path, acc_smem) or none. */
template <typename T, bool WARP>
__global__ void add_norm_bwd_kernel(int64_t rows, int D, int64_t rows_per_block, float scale,
                                    float eps, const T *s, const T *w, const float *rstd,
                                    const T *dy, const T *dsum, T *dx, float *partial,
                                    int acc_smem) {
    extern __shared__ float acc_s[];
    __shared__ float smem[32];
    const int lane = threadIdx.x, width = WARP ? 32 : blockDim.x;
    const int sub = WARP ? threadIdx.y : 0, nsub = WARP ? blockDim.y : 1;
    const int64_t r0 = (int64_t)blockIdx.x * rows_per_block;
    const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
    float *acc = nullptr; /* this warp's (or block's) dw share; column j belongs to one thread */
    if (partial) {
        if (WARP)
            acc = acc_s + (int64_t)sub * D;
        else
            acc = acc_smem ? acc_s : partial + (int64_t)blockIdx.x * D;
        for (int j = lane; j < D; j += width)
            acc[j] = 0.0f;
    }
    for (int64_t row = r0 + sub; row < r1; row += nsub) {
        const T *sr = s + row * D, *dyr = dy + row * D;
        float r;
        if (rstd) {
            r = rstd[row];
        } else { /* the forward's reduction, in the forward's order */
            float ss = 0.0f;
            for (int j = lane; j < D; j += width) {
                float v = dg_ld(sr, j);
                ss += v * v;
            }
            ss = norm_row_sum<WARP>(ss, smem);
            r = 1.0f / sqrtf(ss * scale + eps);
        }
        if (dx) {
            float dot = 0.0f; /* sum_j g_j s_j */
            for (int j = lane; j < D; j += width) {
                float g = dg_ld(dyr, j);
                if (w)
                    g *= dg_ld(w, j);
                dot += g * dg_ld(sr, j);
            }
            dot = norm_row_sum<WARP>(dot, smem);
            float m = scale * r * dot; /* scale * sum_j g_j sh_j */
            const T *dsr = dsum ? dsum + row * D : nullptr;
            T *dxr = dx + row * D;
            for (int j = lane; j < D; j += width) {
                float sv = dg_ld(sr, j), dyv = dg_ld(dyr, j);
                float g = w ? dyv * dg_ld(w, j) : dyv;
                float v = r * (g - sv * r * m);
                if (dsr)
                    v += dg_ld(dsr, j);
                dg_st(dxr, j, v);
                if (acc)
                    acc[j] += dyv * sv * r;
            }
        } else if (acc) {
            for (int j = lane; j < D; j += width)
                acc[j] += dg_ld(dyr, j) * dg_ld(sr, j) * r;
        }
    }
    if (!partial)
        return;
    float *out = partial + (int64_t)blockIdx.x * D;
    if (WARP) { /* the warps' shares, added in warp order */
        __syncthreads();
        for (int j = sub * 32 + lane; j < D; j += 32 * nsub) {
            float v = 0.0f;
            for (int k = 0; k < nsub; k++)
                v += acc_s[(int64_t)k * D + j];
            out[j] = v;
        }
    } else if (acc_smem) { /* each thread copies its own columns */
        for (int j = lane; j < D; j += width)
            out[j] = acc_s[j];
    }
}

// ---- kernel launchers

template <typename T>
static dg_status norm_fwd_typed(dg_ctx *ctx, int64_t rows, int D, float scale, float eps,
                                const void *x, const void *w, const void *gate, dg_act act, void *y,
                                float *rstd) {
    cudaStream_t st = dg__stream(ctx);
    if (D <= NORM_WARP_MAX_D) {
        dim3 block(32, NORM_WARP_ROWS);
        norm_fwd_kernel<T, true><<<dg__blocks(rows, NORM_WARP_ROWS), block, 0, st>>>(
            rows, D, scale, eps, (const T *)x, (const T *)w, (const T *)gate, act, (T *)y, rstd);
    } else {
        norm_fwd_kernel<T, false><<<dg__blocks(rows, 1), NORM_BLOCK_THREADS, 0, st>>>(
            rows, D, scale, eps, (const T *)x, (const T *)w, (const T *)gate, act, (T *)y, rstd);
    }
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__norm_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D,
                                       float scale, float eps, const void *x, const void *w,
                                       const void *gate, dg_act act, void *y, float *rstd) {
    if (rows <= 0 || D <= 0)
        return DG_OK;
    if (D > INT_MAX)
        return dg__err(DG_ERR_SHAPE, "norm (cuda): last axis %lld is too long", (long long)D);
    switch (dt) {
    case DG_F32:
        return norm_fwd_typed<float>(ctx, rows, (int)D, scale, eps, x, w, gate, act, y, rstd);
    case DG_BF16:
        return norm_fwd_typed<__nv_bfloat16>(ctx, rows, (int)D, scale, eps, x, w, gate, act, y,
                                             rstd);
    default:
        return dg__err(DG_ERR_DTYPE, "norm (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    }
}

template <typename T>
static dg_status norm_bwd_typed(dg_ctx *ctx, int64_t rows, int D, float scale, float eps,
                                const void *x, const void *w, const void *gate, dg_act act,
                                const float *rstd, const void *dy, void *dx, void *dw, void *dgate,
                                float *rstd_tmp, float *partial, int nchunks, int64_t chunk_rows) {
    cudaStream_t st = dg__stream(ctx);
    if (dx || dgate || rstd_tmp) {
        if (D <= 32 * NORM_BWD_PL) {
            dim3 block(32, NORM_WARP_ROWS);
            norm_bwd_warp_kernel<T, NORM_BWD_PL>
                <<<dg__blocks(rows, NORM_WARP_ROWS), block, 0, st>>>(
                    rows, D, scale, eps, (const T *)x, (const T *)w, (const T *)gate, act, rstd,
                    (const T *)dy, (T *)dx, (T *)dgate, rstd_tmp);
        } else if (D <= NORM_WARP_MAX_D) {
            dim3 block(32, NORM_WARP_ROWS);
            norm_bwd_kernel<T, true><<<dg__blocks(rows, NORM_WARP_ROWS), block, 0, st>>>(
                rows, D, scale, eps, (const T *)x, (const T *)w, (const T *)gate, act, rstd,
                (const T *)dy, (T *)dx, (T *)dgate, rstd_tmp);
        } else {
            norm_bwd_kernel<T, false><<<dg__blocks(rows, 1), NORM_BLOCK_THREADS, 0, st>>>(
                rows, D, scale, eps, (const T *)x, (const T *)w, (const T *)gate, act, rstd,
                (const T *)dy, (T *)dx, (T *)dgate, rstd_tmp);
        }
        DG_CHECK_LAUNCH();
    }
    if (dw) {
        dim3 grid((unsigned)DG_CEIL_DIV(D, NORM_DW_COLS), (unsigned)nchunks);
        dim3 block(NORM_DW_COLS, NORM_DW_LANES);
        norm_dw_partial_kernel<T>
            <<<grid, block, 0, st>>>(rows, D, chunk_rows, (const T *)x, (const T *)gate, act,
                                     rstd ? rstd : rstd_tmp, (const T *)dy, partial);
        DG_CHECK_LAUNCH();
        norm_colsum<T>(st, nchunks, D, partial, dw);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

extern "C" dg_status dg__norm_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D,
                                       float scale, float eps, const void *x, const void *w,
                                       const void *gate, dg_act act, const float *rstd,
                                       const void *dy, void *dx, void *dw, void *dgate) {
    if (D <= 0)
        return DG_OK;
    if (dt != DG_F32 && dt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "norm backward (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    if (D > INT_MAX)
        return dg__err(DG_ERR_SHAPE, "norm backward (cuda): last axis %lld is too long",
                       (long long)D);
    if (rows <= 0) { /* no rows: dw is an empty sum */
        if (dw)
            DG_CHECK_CUDA(cudaMemsetAsync(dw, 0, (size_t)D * dg_dtype_size(dt), dg__stream(ctx)));
        return DG_OK;
    }
    float *rstd_tmp = NULL, *partial = NULL;
    int nchunks = 0;
    int64_t chunk_rows = 0;
    size_t partial_bytes = 0, rstd_bytes = 0;
    if (dw) {
        chunk_rows = DG_CEIL_DIV(rows, (int64_t)NORM_DW_MAX_CHUNKS);
        if (chunk_rows < NORM_DW_MIN_CHUNK_ROWS)
            chunk_rows = NORM_DW_MIN_CHUNK_ROWS;
        nchunks = (int)DG_CEIL_DIV(rows, chunk_rows);
        partial_bytes = (size_t)nchunks * (size_t)D * sizeof(float);
        DG_TRY(dg__cuda_malloc(ctx, partial_bytes, (void **)&partial));
        if (!rstd) {
            rstd_bytes = (size_t)rows * sizeof(float);
            dg_status s = dg__cuda_malloc(ctx, rstd_bytes, (void **)&rstd_tmp);
            if (s != DG_OK) {
                dg__cuda_free(ctx, partial, partial_bytes);
                return s;
            }
        }
    }
    dg_status s;
    if (dt == DG_F32)
        s = norm_bwd_typed<float>(ctx, rows, (int)D, scale, eps, x, w, gate, act, rstd, dy, dx, dw,
                                  dgate, rstd_tmp, partial, nchunks, chunk_rows);
    else
        s = norm_bwd_typed<__nv_bfloat16>(ctx, rows, (int)D, scale, eps, x, w, gate, act, rstd, dy,
                                          dx, dw, dgate, rstd_tmp, partial, nchunks, chunk_rows);
    /* Stream-ordered frees: the blocks are reused only by work queued after these kernels. */
    dg__cuda_free(ctx, partial, partial_bytes);
    dg__cuda_free(ctx, rstd_tmp, rstd_bytes);
    return s;
}

// ---- residual add + RMSNorm launchers

template <typename T>
static dg_status add_norm_fwd_typed(dg_ctx *ctx, int64_t rows, int D, float scale, float eps,
                                    const void *x, const void *res, const void *w, void *sum,
                                    void *y, float *rstd) {
    cudaStream_t st = dg__stream(ctx);
    if (D <= NORM_WARP_MAX_D) {
        dim3 block(32, NORM_WARP_ROWS);
        add_norm_fwd_kernel<T, true><<<dg__blocks(rows, NORM_WARP_ROWS), block, 0, st>>>(
            rows, D, scale, eps, (const T *)x, (const T *)res, (const T *)w, (T *)sum, (T *)y,
            rstd);
    } else {
        add_norm_fwd_kernel<T, false><<<dg__blocks(rows, 1), NORM_BLOCK_THREADS, 0, st>>>(
            rows, D, scale, eps, (const T *)x, (const T *)res, (const T *)w, (T *)sum, (T *)y,
            rstd);
    }
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__add_norm_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D,
                                           float scale, float eps, const void *x, const void *res,
                                           const void *w, void *sum, void *y, float *rstd) {
    if (rows <= 0 || D <= 0)
        return DG_OK;
    if (D > INT_MAX)
        return dg__err(DG_ERR_SHAPE, "add_rmsnorm (cuda): last axis %lld is too long",
                       (long long)D);
    switch (dt) {
    case DG_F32:
        return add_norm_fwd_typed<float>(ctx, rows, (int)D, scale, eps, x, res, w, sum, y, rstd);
    case DG_BF16:
        return add_norm_fwd_typed<__nv_bfloat16>(ctx, rows, (int)D, scale, eps, x, res, w, sum, y,
                                                 rstd);
    default:
        return dg__err(DG_ERR_DTYPE, "add_rmsnorm (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    }
}

template <typename T>
static dg_status add_norm_bwd_typed(dg_ctx *ctx, int64_t rows, int D, int64_t rows_per_block,
                                    int nblocks, float scale, float eps, const void *s,
                                    const void *w, const float *rstd, const void *dy,
                                    const void *dsum, void *dx, void *dw, float *partial) {
    cudaStream_t st = dg__stream(ctx);
    if (D <= NORM_WARP_MAX_D) {
        dim3 block(32, NORM_WARP_ROWS);
        size_t smem = partial ? (size_t)NORM_WARP_ROWS * D * sizeof(float) : 0;
        add_norm_bwd_kernel<T, true><<<nblocks, block, smem, st>>>(
            rows, D, rows_per_block, scale, eps, (const T *)s, (const T *)w, rstd, (const T *)dy,
            (const T *)dsum, (T *)dx, partial, 1);
    } else {
        int acc_smem = partial && D <= ADD_NORM_SMEM_MAX_D;
        size_t smem = acc_smem ? (size_t)D * sizeof(float) : 0;
        add_norm_bwd_kernel<T, false><<<nblocks, NORM_BLOCK_THREADS, smem, st>>>(
            rows, D, rows_per_block, scale, eps, (const T *)s, (const T *)w, rstd, (const T *)dy,
            (const T *)dsum, (T *)dx, partial, acc_smem);
    }
    DG_CHECK_LAUNCH();
    if (dw) {
        norm_colsum<T>(st, nblocks, D, partial, dw);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

extern "C" dg_status dg__add_norm_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t rows, int64_t D,
                                           float scale, float eps, const void *s, const void *w,
                                           const float *rstd, const void *dy, const void *dsum,
                                           void *dx, void *dw) {
    if (D <= 0 || (!dx && !dw))
        return DG_OK;
    if (dt != DG_F32 && dt != DG_BF16)
        return dg__err(DG_ERR_DTYPE,
                       "add_rmsnorm backward (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    if (D > INT_MAX)
        return dg__err(DG_ERR_SHAPE, "add_rmsnorm backward (cuda): last axis %lld is too long",
                       (long long)D);
    if (rows <= 0) { /* no rows: dw is an empty sum */
        if (dw)
            DG_CHECK_CUDA(cudaMemsetAsync(dw, 0, (size_t)D * dg_dtype_size(dt), dg__stream(ctx)));
        return DG_OK;
    }
    /* Contiguous row runs per block: at most ADD_NORM_MAX_BLOCKS partial rows with dw, else as
     * many blocks as the row layout wants (capped as dg__blocks caps). */
    const int warp = D <= NORM_WARP_MAX_D;
    const int64_t min_rows = warp ? NORM_WARP_ROWS : 1;
    const int64_t max_blocks = dw ? ADD_NORM_MAX_BLOCKS : 65535LL * 16;
    int64_t rows_per_block = DG_CEIL_DIV(rows, max_blocks);
    if (rows_per_block < min_rows)
        rows_per_block = min_rows;
    int nblocks = (int)DG_CEIL_DIV(rows, rows_per_block);
    float *partial = NULL;
    size_t partial_bytes = 0;
    if (dw) {
        partial_bytes = (size_t)nblocks * (size_t)D * sizeof(float);
        DG_TRY(dg__cuda_malloc(ctx, partial_bytes, (void **)&partial));
    }
    dg_status st;
    if (dt == DG_F32)
        st = add_norm_bwd_typed<float>(ctx, rows, (int)D, rows_per_block, nblocks, scale, eps, s, w,
                                       rstd, dy, dsum, dx, dw, partial);
    else
        st = add_norm_bwd_typed<__nv_bfloat16>(ctx, rows, (int)D, rows_per_block, nblocks, scale,
                                               eps, s, w, rstd, dy, dsum, dx, dw, partial);
    /* Stream-ordered free: the block is reused only by work queued after these kernels. */
    dg__cuda_free(ctx, partial, partial_bytes);
    return st;
}
