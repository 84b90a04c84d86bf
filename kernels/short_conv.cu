/*
 * kernels/short_conv.cu -- causal depthwise short convolution along T (the q/k/v conv of KDA and
 * other linear-attention layers), forward and backward, f32 and bf16 storage with f32 math.
 *
 * Rows r = b*T + t of [B*T, C]. Each row belongs to one sequence [st, en): [b*T, b*T + T) in batch
 * mode, or the cu_seqlens segment holding r (binary search) in varlen mode; reads before st are
 * zero, so nothing crosses a sequence boundary.
 *
 * Tiling (forward and backward): a block of SC_PAIRS x SC_LANES threads owns SC_CT = 64 channels
 * (one channel pair per thread along x, read and written as one 4- or 8-byte vector where C is
 * even and the buffers aligned, else as two scalars) and SC_R = 64 consecutive rows at a time (a
 * tile; warp y takes rows y, y + SC_LANES, ...). Per tile it stages in shared memory, as f32,
 *   - x rows [r0 - W + 1, r0 + SC_R + W - 1) (the forward only up to r0 + SC_R), zero outside
 *     [0, rows);
 *   - per row h of [r0, r0 + SC_R + W - 1): lo[h], the first tap whose input lies in h's
 *     sequence, and (backward) dlo[h], the first tap whose output does; the sequence is looked up
 *     once per row and tile (a division in batch mode, a binary search in varlen mode).
 * Forward: y[r] = act(z[r]) from W shared reads per element.
 * Backward: dz = dy act'(z) is computed once per (row, channel) of [r0, r0 + SC_R + W - 1) into
 * shared memory (z recomputed from the staged x: W shared reads), then for the tile's rows
 *   dx[r] = sum_{i >= dlo} dz[r + W-1-i] w[i]   and   dw[i] += dz[r] x[r - W + 1 + i] (i >= lo),
 *   dbias += dz[r], the last two in registers. A block walks a fixed chunk of consecutive tiles,
 * reduces its registers over the SC_LANES warps in shared memory in a fixed order, and writes one
 * partial row [C, W+1] for its channels; a second kernel sums the chunks in order. No atomics, so
 * the result is bitwise reproducible.
 */
#include "common.cuh"
#include "short_conv.cuh"

#define SC_THREADS 256
#define SC_PAIRS 32          /* channel pairs per block (threadIdx.x) */
#define SC_CT (2 * SC_PAIRS) /* channels per block */
#define SC_LANES 8           /* row lanes per block (threadIdx.y, one warp each) */
#define SC_R 64              /* rows per tile */
#define SC_HALO (DG_SHORT_CONV_MAX_W - 1)
#define SC_ZROWS (SC_R + SC_HALO)     /* rows of dz (and of the forward's x) per tile */
#define SC_XROWS (SC_R + 2 * SC_HALO) /* rows of x per backward tile */
#define SC_MAX_CHUNKS 512             /* row chunks of the backward (partial rows of dw, dbias) */
#define SC_TARGET_BLOCKS 2048         /* backward blocks aimed at: several waves on any GPU */
#define SC_MAX_GRID_Y 65535

static_assert(SC_PAIRS * SC_LANES == SC_THREADS, "block shape");
static_assert(SC_ZROWS <= SC_THREADS, "one thread per row of the sequence lookup");

// ---- CUDA kernels

__device__ __forceinline__ float sc_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

/* d silu(z) / dz */
__device__ __forceinline__ float sc_dsilu(float z) {
    float s = sc_sigmoid(z);
    return s * (1.0f + z * (1.0f - s));
}

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

/* Two adjacent channels as one vector of the storage dtype. */
template <typename DT> struct sc_pair;
template <> struct sc_pair<float> { typedef float2 type; };
template <> struct sc_pair<__nv_bfloat16> { typedef __nv_bfloat162 type; };
__device__ __forceinline__ float2 sc_f2(float2 v) { return v; }
__device__ __forceinline__ float2 sc_f2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void sc_put(float2 *p, float2 v) { *p = v; }
__device__ __forceinline__ void sc_put(__nv_bfloat162 *p, float2 v) {
    *p = __float22bfloat162_rn(v);
}

/* Channels c, c + 1 (c even) of `row`; zero past C. VEC: C is even and p vector-aligned. */
template <typename DT, bool VEC>
__device__ __forceinline__ float2 sc_ld2(const DT *__restrict__ p, int64_t row, int64_t C,
                                         int64_t c) {
    float2 v = make_float2(0.0f, 0.0f);
    const int64_t k = row * C + c;
    if constexpr (VEC) {
        if (c < C)
            v = sc_f2(*reinterpret_cast<const typename sc_pair<DT>::type *>(p + k));
    } else {
        if (c < C)
            v.x = dg_ld(p, k);
        if (c + 1 < C)
            v.y = dg_ld(p, k + 1);
    }
    return v;
}

template <typename DT, bool VEC>
__device__ __forceinline__ void sc_st2(DT *__restrict__ p, int64_t row, int64_t C, int64_t c,
                                       float2 v) {
    const int64_t k = row * C + c;
    if constexpr (VEC) {
        if (c < C)
            sc_put(reinterpret_cast<typename sc_pair<DT>::type *>(p + k), v);
    } else {
        if (c < C)
            dg_st(p, k, v.x);
        if (c + 1 < C)
            dg_st(p, k + 1, v.y);
    }
}

/* The taps w[c..c+1, 0..W-1] and the bias into registers (zero past C, W, or without a bias). */
template <typename DT>
__device__ __forceinline__ void sc_load_w(const DT *__restrict__ w, const DT *__restrict__ bias,
                                          int64_t C, int W, int64_t c, float2 *wr, float2 &b) {
#pragma unroll
    for (int i = 0; i < DG_SHORT_CONV_MAX_W; i++) {
        wr[i] = make_float2(0.0f, 0.0f);
        if (i < W) {
            if (c < C)
                wr[i].x = dg_ld(w, c * W + i);
            if (c + 1 < C)
                wr[i].y = dg_ld(w, (c + 1) * W + i);
        }
    }
    b = make_float2(0.0f, 0.0f);
    if (bias) {
        if (c < C)
            b.x = dg_ld(bias, c);
        if (c + 1 < C)
            b.y = dg_ld(bias, c + 1);
    }
}

/* Stage one tile: x rows [r0 - W + 1, r0 - W + 1 + nx) of this thread's channel pair into sx,
 * and for rows h = r0 + j, j < nmeta: lo[j] = first tap i with h - W + 1 + i in h's sequence;
 * dlo[j] (j < SC_R, when dlo is not NULL) = first tap i with h + W - 1 - i in h's sequence. Rows
 * past `rows` get W (no taps). The caller synchronises. */
template <typename DT, bool VEC>
__device__ __forceinline__ void sc_stage(float2 (*sx)[SC_PAIRS], int *lo, int *dlo,
                                         const DT *__restrict__ x, int64_t rows, int64_t T,
                                         int64_t C, int W, const int64_t *__restrict__ cu,
                                         int n_seqs, int64_t r0, int nx, int nmeta, int64_t c) {
    for (int j = threadIdx.y; j < nx; j += SC_LANES) {
        int64_t h = r0 - W + 1 + j;
        float2 v = make_float2(0.0f, 0.0f);
        if (h >= 0 && h < rows)
            v = sc_ld2<DT, VEC>(x, h, C, c);
        sx[j][threadIdx.x] = v;
    }
    int j = threadIdx.y * SC_PAIRS + threadIdx.x;
    if (j < nmeta) {
        int64_t h = r0 + j;
        int l = W, d = W;
        if (h < rows) {
            int64_t st, en;
            sc_bounds(h, T, cu, n_seqs, st, en);
            l = st > h - W + 1 ? (int)(st - (h - W + 1)) : 0; /* st <= h: l <= W - 1 */
            d = h + W > en ? (int)(h + W - en) : 0;           /* en > h: d <= W - 1 */
        }
        lo[j] = l;
        if (dlo && j < SC_R)
            dlo[j] = d;
    }
}

/* z of tile row j (x staged from row r0 - W + 1): taps in order i = 0..W-1, then the bias (the
 * CPU reference's order). */
__device__ __forceinline__ float2 sc_z(const float2 (*sx)[SC_PAIRS], int j, int lo, int W,
                                       const float2 *wr, float2 b) {
    float2 z = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < DG_SHORT_CONV_MAX_W; i++)
        if (i < W && i >= lo) {
            float2 v = sx[j + i][threadIdx.x];
            z.x += wr[i].x * v.x;
            z.y += wr[i].y * v.y;
        }
    z.x += b.x;
    z.y += b.y;
    return z;
}

/* WC: the taps as a compile-time constant (4, the usual width: loops over taps unroll without
 * predicates) or 0 (W_ as passed). */
template <typename DT, bool VEC, int WC>
__global__ void __launch_bounds__(SC_THREADS)
    sc_fwd_kernel(int64_t rows, int64_t T, int64_t C, int W_, int64_t ntiles,
                  const DT *__restrict__ x, const DT *__restrict__ w, const DT *__restrict__ bias,
                  dg_act act, const int64_t *__restrict__ cu, int n_seqs, DT *__restrict__ y) {
    const int W = WC ? WC : W_;
    __shared__ float2 sm_x[SC_ZROWS][SC_PAIRS];
    __shared__ int sm_lo[SC_R];
    const int64_t c = (int64_t)blockIdx.x * SC_CT + 2 * threadIdx.x;
    float2 wr[DG_SHORT_CONV_MAX_W], b;
    sc_load_w(w, bias, C, W, c, wr, b);
    for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
        const int64_t r0 = tile * SC_R;
        __syncthreads(); /* the previous tile's reads are done */
        sc_stage<DT, VEC>(sm_x, sm_lo, NULL, x, rows, T, C, W, cu, n_seqs, r0, SC_R + W - 1, SC_R,
                          c);
        __syncthreads();
        for (int j = threadIdx.y; j < SC_R && r0 + j < rows; j += SC_LANES) {
            float2 z = sc_z(sm_x, j, sm_lo[j], W, wr, b);
            if (act == DG_ACT_SILU) {
                z.x *= sc_sigmoid(z.x);
                z.y *= sc_sigmoid(z.y);
            }
            sc_st2<DT, VEC>(y, r0 + j, C, c, z);
        }
    }
}

/* Fused backward over tiles [blockIdx.y * chunk_tiles, + chunk_tiles) of this block's channels:
 * dx (when not NULL) and, when partial is not NULL, partial[blockIdx.y, c, i] = sum over the
 * chunk's rows r of dz[r, c] x[r - W + 1 + i, c] (i < W) and of dz[r, c] (i = W, the bias). */
template <typename DT, bool VEC, int WC>
__global__ void __launch_bounds__(SC_THREADS)
    sc_bwd_kernel(int64_t rows, int64_t T, int64_t C, int W_, int64_t ntiles, int64_t chunk_tiles,
                  const DT *__restrict__ x, const DT *__restrict__ w, const DT *__restrict__ bias,
                  dg_act act, const int64_t *__restrict__ cu, int n_seqs, const DT *__restrict__ dy,
                  DT *__restrict__ dx, float *__restrict__ partial) {
    const int W = WC ? WC : W_; /* as in sc_fwd_kernel */
    /* x of the tiles, then the warps' dw / dbias sums of the final reduction */
    __shared__ union sc_bwd_smem {
        float2 x[SC_XROWS][SC_PAIRS];
        float red[SC_LANES][DG_SHORT_CONV_MAX_W + 1][SC_CT];
    } sm;
    __shared__ float2 sm_dz[SC_ZROWS][SC_PAIRS];
    __shared__ int sm_lo[SC_ZROWS], sm_dlo[SC_R];
    const int lane = threadIdx.x, ty = threadIdx.y;
    const int64_t c0 = (int64_t)blockIdx.x * SC_CT, c = c0 + 2 * lane;
    float2 wr[DG_SHORT_CONV_MAX_W], b;
    sc_load_w(w, bias, C, W, c, wr, b);
    float2 acc[DG_SHORT_CONV_MAX_W + 1]; /* dw taps, then dbias in the last slot */
#pragma unroll
    for (int i = 0; i <= DG_SHORT_CONV_MAX_W; i++)
        acc[i] = make_float2(0.0f, 0.0f);

    const int64_t t0 = (int64_t)blockIdx.y * chunk_tiles;
    const int64_t t1 = t0 + chunk_tiles < ntiles ? t0 + chunk_tiles : ntiles;
    for (int64_t tile = t0; tile < t1; tile++) {
        const int64_t r0 = tile * SC_R;
        __syncthreads(); /* the previous tile's reads are done */
        sc_stage<DT, VEC>(sm.x, sm_lo, sm_dlo, x, rows, T, C, W, cu, n_seqs, r0, SC_R + 2 * (W - 1),
                          SC_R + W - 1, c);
        __syncthreads();
        /* dz of rows [r0, r0 + SC_R + W - 1), zero past the last row */
        for (int j = ty; j < SC_R + W - 1; j += SC_LANES) {
            float2 d = make_float2(0.0f, 0.0f);
            if (r0 + j < rows) {
                d = sc_ld2<DT, VEC>(dy, r0 + j, C, c);
                if (act == DG_ACT_SILU) {
                    float2 z = sc_z(sm.x, j, sm_lo[j], W, wr, b);
                    d.x *= sc_dsilu(z.x);
                    d.y *= sc_dsilu(z.y);
                }
            }
            sm_dz[j][lane] = d;
        }
        __syncthreads();
        for (int j = ty; j < SC_R && r0 + j < rows; j += SC_LANES) {
            if (dx) { /* dx[r] = sum_i dz[r + W-1-i] w[i], outputs in r's sequence only */
                const int dl = sm_dlo[j];
                float2 g = make_float2(0.0f, 0.0f);
#pragma unroll
                for (int i = 0; i < DG_SHORT_CONV_MAX_W; i++)
                    if (i < W && i >= dl) {
                        float2 v = sm_dz[j + W - 1 - i][lane];
                        g.x += v.x * wr[i].x;
                        g.y += v.y * wr[i].y;
                    }
                sc_st2<DT, VEC>(dx, r0 + j, C, c, g);
            }
            if (partial) {
                const float2 d = sm_dz[j][lane];
                const int l = sm_lo[j];
#pragma unroll
                for (int i = 0; i < DG_SHORT_CONV_MAX_W; i++)
                    if (i < W && i >= l) {
                        float2 v = sm.x[j + i][lane];
                        acc[i].x += d.x * v.x;
                        acc[i].y += d.y * v.y;
                    }
                acc[DG_SHORT_CONV_MAX_W].x += d.x;
                acc[DG_SHORT_CONV_MAX_W].y += d.y;
            }
        }
    }
    if (!partial)
        return;

    /* sum the SC_LANES warps in order; one coalesced partial row [channels, W + 1] */
    __syncthreads(); /* sm.x is dead from here */
#pragma unroll
    for (int i = 0; i <= DG_SHORT_CONV_MAX_W; i++) {
        sm.red[ty][i][2 * lane] = acc[i].x;
        sm.red[ty][i][2 * lane + 1] = acc[i].y;
    }
    __syncthreads();
    const int n = SC_CT * (W + 1);
    float *pc = partial + ((int64_t)blockIdx.y * C + c0) * (W + 1);
    for (int k = ty * SC_PAIRS + lane; k < n; k += SC_THREADS) {
        const int cc = k / (W + 1), i = k % (W + 1);
        if (c0 + cc >= C)
            break;
        const int slot = i < W ? i : DG_SHORT_CONV_MAX_W;
        float s = 0.0f;
#pragma unroll
        for (int l = 0; l < SC_LANES; l++)
            s += sm.red[l][slot][cc];
        pc[k] = s;
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

/* Channel pairs move as one vector when C is even and every [rows, C] buffer is aligned to it. */
template <typename DT>
static bool sc_vec_ok(int64_t C, const void *a, const void *b, const void *c) {
    const uintptr_t al = sizeof(typename sc_pair<DT>::type);
    return C % 2 == 0 && (uintptr_t)a % al == 0 && (uintptr_t)b % al == 0 && (uintptr_t)c % al == 0;
}

template <typename DT, bool VEC>
static dg_status sc_fwd_typed(dg_ctx *ctx, int64_t rows, int64_t T, int64_t C, int W, const void *x,
                              const void *w, const void *bias, dg_act act, const int64_t *cu,
                              int n_seqs, void *y) {
    const int64_t ntiles = DG_CEIL_DIV(rows, (int64_t)SC_R);
    dim3 grid((unsigned)DG_CEIL_DIV(C, (int64_t)SC_CT),
              (unsigned)(ntiles < SC_MAX_GRID_Y ? ntiles : SC_MAX_GRID_Y));
    dim3 block(SC_PAIRS, SC_LANES);
    auto *kern = W == 4 ? sc_fwd_kernel<DT, VEC, 4> : sc_fwd_kernel<DT, VEC, 0>;
    kern<<<grid, block, 0, dg__stream(ctx)>>>(rows, T, C, W, ntiles, (const DT *)x, (const DT *)w,
                                              (const DT *)bias, act, cu, n_seqs, (DT *)y);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <typename DT>
static dg_status sc_fwd_dispatch(dg_ctx *ctx, int64_t rows, int64_t T, int64_t C, int W,
                                 const void *x, const void *w, const void *bias, dg_act act,
                                 const int64_t *cu, int n_seqs, void *y) {
    if (sc_vec_ok<DT>(C, x, y, NULL))
        return sc_fwd_typed<DT, true>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, y);
    return sc_fwd_typed<DT, false>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, y);
}

extern "C" dg_status dg__short_conv_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T,
                                             int64_t C, int W, const void *x, const void *w,
                                             const void *bias, dg_act act, const int64_t *cu,
                                             int n_seqs, void *y) {
    DG_TRY(sc_check_args("short_conv (cuda)", dt, W));
    const int64_t rows = B * T;
    if (rows <= 0 || C <= 0)
        return DG_OK;
    if (dt == DG_F32)
        return sc_fwd_dispatch<float>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, y);
    return sc_fwd_dispatch<__nv_bfloat16>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, y);
}

template <typename DT, bool VEC>
static dg_status sc_bwd_typed(dg_ctx *ctx, int64_t rows, int64_t T, int64_t C, int W, const void *x,
                              const void *w, const void *bias, dg_act act, const int64_t *cu,
                              int n_seqs, const void *dy, void *dx, void *dw, void *dbias,
                              float *partial, int64_t ntiles, int64_t nchunks,
                              int64_t chunk_tiles) {
    cudaStream_t st = dg__stream(ctx);
    dim3 grid((unsigned)DG_CEIL_DIV(C, (int64_t)SC_CT), (unsigned)nchunks);
    dim3 block(SC_PAIRS, SC_LANES);
    auto *kern = W == 4 ? sc_bwd_kernel<DT, VEC, 4> : sc_bwd_kernel<DT, VEC, 0>;
    kern<<<grid, block, 0, st>>>(rows, T, C, W, ntiles, chunk_tiles, (const DT *)x, (const DT *)w,
                                 (const DT *)bias, act, cu, n_seqs, (const DT *)dy, (DT *)dx,
                                 partial);
    DG_CHECK_LAUNCH();
    if (partial) {
        sc_dw_final_kernel<DT><<<dg__blocks(C * (W + 1), SC_THREADS), SC_THREADS, 0, st>>>(
            (int)nchunks, C, W, partial, (DT *)dw, (DT *)dbias);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

template <typename DT>
static dg_status sc_bwd_dispatch(dg_ctx *ctx, int64_t rows, int64_t T, int64_t C, int W,
                                 const void *x, const void *w, const void *bias, dg_act act,
                                 const int64_t *cu, int n_seqs, const void *dy, void *dx, void *dw,
                                 void *dbias, float *partial, int64_t ntiles, int64_t nchunks,
                                 int64_t chunk_tiles) {
    if (sc_vec_ok<DT>(C, x, dy, dx))
        return sc_bwd_typed<DT, true>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx, dw,
                                      dbias, partial, ntiles, nchunks, chunk_tiles);
    return sc_bwd_typed<DT, false>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx, dw,
                                   dbias, partial, ntiles, nchunks, chunk_tiles);
}

extern "C" dg_status dg__short_conv_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t B, int64_t T,
                                             int64_t C, int W, const void *x, const void *w,
                                             const void *bias, dg_act act, const int64_t *cu,
                                             int n_seqs, const void *dy, void *dx, void *dw,
                                             void *dbias) {
    DG_TRY(sc_check_args("short_conv backward (cuda)", dt, W));
    const int64_t rows = B * T;
    if (C <= 0 || (!dx && !dw && !dbias))
        return DG_OK;
    if (rows <= 0) { /* empty sums */
        size_t es = dg_dtype_size(dt);
        if (dw)
            DG_CHECK_CUDA(cudaMemsetAsync(dw, 0, (size_t)(C * W) * es, dg__stream(ctx)));
        if (dbias)
            DG_CHECK_CUDA(cudaMemsetAsync(dbias, 0, (size_t)C * es, dg__stream(ctx)));
        return DG_OK;
    }
    /* Row chunks: enough blocks to fill the GPU, at most SC_MAX_CHUNKS partial rows; the split
     * depends on the shapes only, so the sums' order is the same on every run. */
    const int64_t ctiles = DG_CEIL_DIV(C, (int64_t)SC_CT);
    const int64_t ntiles = DG_CEIL_DIV(rows, (int64_t)SC_R);
    int64_t nchunks = DG_CEIL_DIV((int64_t)SC_TARGET_BLOCKS, ctiles);
    if (nchunks > SC_MAX_CHUNKS)
        nchunks = SC_MAX_CHUNKS;
    if (nchunks > ntiles)
        nchunks = ntiles;
    const int64_t chunk_tiles = DG_CEIL_DIV(ntiles, nchunks);
    nchunks = DG_CEIL_DIV(ntiles, chunk_tiles);
    size_t partial_bytes = 0;
    float *partial = NULL;
    if (dw || dbias) {
        partial_bytes = (size_t)nchunks * (size_t)(C * (W + 1)) * sizeof(float);
        DG_TRY(dg__cuda_malloc(ctx, partial_bytes, (void **)&partial));
    }
    dg_status s;
    if (dt == DG_F32)
        s = sc_bwd_dispatch<float>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx, dw,
                                   dbias, partial, ntiles, nchunks, chunk_tiles);
    else
        s = sc_bwd_dispatch<__nv_bfloat16>(ctx, rows, T, C, W, x, w, bias, act, cu, n_seqs, dy, dx,
                                           dw, dbias, partial, ntiles, nchunks, chunk_tiles);
    /* Stream-ordered free: the block is reused only by work queued after these kernels. */
    if (partial)
        dg__cuda_free(ctx, partial, partial_bytes);
    return s;
}
