/*
 * kernels/reduce.cu -- deterministic sums over the middle axis of a contiguous [outer, n, inner]
 * array (behind dg_sum, dg_mean, dg_sum_all and the gradient of every broadcasting op), and the
 * broadcast that is their backward.
 *
 * No atomics: every output is summed in a fixed order that depends only on the shape, so two runs
 * give the same bits. Storage f32 or bf16, accumulation f32; partial sums are kept in f32.
 *   inner == 1  the n values of an output are adjacent: a warp (short rows) or a block (long
 *               rows) per output, threads striding over the row, then a fixed shuffle tree. Few
 *               long rows are cut into segments first (pass 1, f32 partials), then the segments
 *               are summed (pass 2).
 *   inner > 1   neighbouring outputs are adjacent in memory: one thread per output walking down
 *               the column, so a warp reads 32 neighbours at once. When there are too few
 *               outputs to fill the GPU the column is cut into chunks the same two-pass way.
 */
#include "common.cuh"
#include "reduce.cuh"

// ---- CUDA kernels

/* The warp's total in lane 0; the same tree every time. */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

/* Row segments: x is [rows, n]; each row is cut into S segments of `seg` values (the last may be
 * shorter); y[r*S + s] = scale * sum of segment s of row r. One warp per segment. */
template <typename Tin, typename Tout>
__global__ void sum_rows_warp_kernel(const Tin *x, int64_t rows, int64_t n, int64_t S, int64_t seg,
                                     float scale, Tout *y) {
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t v = warp; v < rows * S; v += nwarps) { /* the same v for all lanes of a warp */
        int64_t j0 = (v % S) * seg, j1 = min(n, j0 + seg);
        const Tin *row = x + (v / S) * n;
        float acc = 0.f;
        for (int64_t j = j0 + lane; j < j1; j += 32)
            acc += dg_ld(row, j);
        acc = warp_sum(acc);
        if (lane == 0)
            dg_st(y, v, acc * scale);
    }
}

/* The same with one block per segment, for long segments. blockDim.x: a multiple of 32, <= 1024. */
template <typename Tin, typename Tout>
__global__ void sum_rows_block_kernel(const Tin *x, int64_t rows, int64_t n, int64_t S, int64_t seg,
                                      float scale, Tout *y) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t v = blockIdx.x; v < rows * S; v += gridDim.x) { /* uniform across the block */
        int64_t j0 = (v % S) * seg, j1 = min(n, j0 + seg);
        const Tin *row = x + (v / S) * n;
        float acc = 0.f;
        for (int64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x)
            acc += dg_ld(row, j);
        acc = warp_sum(acc);
        if (lane == 0)
            part[wid] = acc;
        __syncthreads();
        if (wid == 0) {
            acc = warp_sum(lane < nw ? part[lane] : 0.f);
            if (lane == 0)
                dg_st(y, v, acc * scale);
        }
        __syncthreads(); /* part[] is reused by the next segment */
    }
}

/* Column chunks: x is [outer, n, inner]; the n axis is cut into S chunks of L; y is
 * [outer, S, inner] with y[o,c,i] = scale * sum_{j in chunk c} x[o,j,i]. One thread per output;
 * consecutive threads take consecutive i, so loads coalesce. */
template <typename Tin, typename Tout>
__global__ void sum_cols_kernel(const Tin *x, int64_t outer, int64_t n, int64_t inner, int64_t S,
                                int64_t L, float scale, Tout *y) {
    int64_t total = outer * S * inner;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = t % inner, c = (t / inner) % S, o = t / (inner * S);
        int64_t j0 = c * L, j1 = min(n, j0 + L);
        const Tin *col = x + o * n * inner + i;
        float acc = 0.f;
        for (int64_t j = j0; j < j1; j++)
            acc += dg_ld(col, j * inner);
        dg_st(y, t, acc * scale);
    }
}

/* gx[o,j,i] = scale * gy[o,i] */
template <typename T>
__global__ void sum_mid_bwd_kernel(const T *gy, int64_t outer, int64_t n, int64_t inner,
                                   float scale, T *gx) {
    int64_t total = outer * n * inner;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = t % inner, o = t / (n * inner);
        dg_st(gx, t, scale * dg_ld(gy, o * inner + i));
    }
}

// ---- kernel launchers

static const int kThreads = 256;
/* Below this many outputs (inner > 1) or row segments (inner == 1) a long reduction is split in
 * two passes so that enough threads have work (about 2 waves of 256-thread blocks on an H100). */
static const int64_t kWantThreads = 65536, kWantSegments = 1024;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static unsigned grid_of(int64_t blocks) {
    return (unsigned)(blocks < 1 ? 1 : blocks > 65535LL * 16 ? 65535LL * 16 : blocks);
}

/* One pass over rows: warps for short segments, blocks for long ones. */
template <typename Tin, typename Tout>
static void rows_pass(cudaStream_t st, const Tin *x, int64_t rows, int64_t n, int64_t S,
                      int64_t seg, float scale, Tout *y) {
    int64_t nseg = rows * S;
    if (seg <= 1024)
        sum_rows_warp_kernel<Tin, Tout>
            <<<grid_of(ceil_div(nseg * 32, kThreads)), kThreads, 0, st>>>(x, rows, n, S, seg, scale,
                                                                          y);
    else
        sum_rows_block_kernel<Tin, Tout>
            <<<grid_of(nseg), kThreads, 0, st>>>(x, rows, n, S, seg, scale, y);
}

/* The n axis cut into S pieces of `piece` values: pass 1 writes f32 partials [outer, S, inner],
 * pass 2 sums them in order. */
template <typename T>
static dg_status two_pass(cudaStream_t st, const T *x, int64_t outer, int64_t n, int64_t inner,
                          int64_t S, int64_t piece, float scale, float *part, T *y) {
    int64_t outputs = outer * inner;
    if (inner == 1) {
        rows_pass<T, float>(st, x, outer, n, S, piece, 1.f, part);
        DG_CHECK_LAUNCH();
        rows_pass<float, T>(st, part, outer, S, 1, S, scale, y);
        DG_CHECK_LAUNCH();
    } else {
        sum_cols_kernel<T, float><<<dg__blocks(outputs * S, kThreads), kThreads, 0, st>>>(
            x, outer, n, inner, S, piece, 1.f, part);
        DG_CHECK_LAUNCH();
        sum_cols_kernel<float, T><<<dg__blocks(outputs, kThreads), kThreads, 0, st>>>(
            part, outer, S, inner, 1, S, scale, y);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

template <typename T>
static dg_status sum_mid(dg_ctx *ctx, const T *x, int64_t outer, int64_t n, int64_t inner,
                         float scale, T *y) {
    cudaStream_t st = dg__stream(ctx);
    int64_t outputs = outer * inner;
    /* How many pieces to cut the n axis into (1: a single pass). */
    int64_t S = 1;
    if (inner == 1 && n > 8192 && outer < kWantSegments) {
        S = ceil_div(kWantSegments, outer);
        if (S > ceil_div(n, 4096)) /* segments of at least ~4096 values */
            S = ceil_div(n, 4096);
    } else if (inner > 1 && n > 64 && outputs < kWantThreads) {
        S = ceil_div(kWantThreads, outputs);
        if (S > ceil_div(n, 32)) /* chunks of at least ~32 values */
            S = ceil_div(n, 32);
    }

    if (S == 1) {
        if (inner == 1)
            rows_pass<T, T>(st, x, outer, n, 1, n, scale, y);
        else
            sum_cols_kernel<T, T><<<dg__blocks(outputs, kThreads), kThreads, 0, st>>>(
                x, outer, n, inner, 1, n, scale, y);
        DG_CHECK_LAUNCH();
        return DG_OK;
    }
    int64_t piece = ceil_div(n, S);
    S = ceil_div(n, piece);
    size_t bytes = (size_t)(outputs * S) * sizeof(float);
    void *part = NULL;
    DG_TRY(dg__cuda_malloc(ctx, bytes, &part));
    dg_status s = two_pass<T>(st, x, outer, n, inner, S, piece, scale, (float *)part, y);
    dg__cuda_free(ctx, part, bytes); /* stream-ordered: reused only by later work on this stream */
    return s;
}

extern "C" dg_status dg__sum_mid_cuda(dg_ctx *ctx, dg_dtype dt, const void *x, int64_t outer,
                                      int64_t n, int64_t inner, double scale, void *y) {
    int64_t outputs = outer * inner;
    if (outputs <= 0)
        return DG_OK;
    if (dt != DG_F32 && dt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "sum: the CUDA kernels take f32 or bf16, got %s",
                       dg_dtype_name(dt));
    if (n == 0) /* an empty sum: 0 (times scale, so the mean of nothing is NaN as in NumPy) */
        return dg__cuda_fill(ctx, y, dt, outputs, 0.0 * scale);
    if (dt == DG_F32)
        return sum_mid<float>(ctx, (const float *)x, outer, n, inner, (float)scale, (float *)y);
    return sum_mid<__nv_bfloat16>(ctx, (const __nv_bfloat16 *)x, outer, n, inner, (float)scale,
                                  (__nv_bfloat16 *)y);
}

extern "C" dg_status dg__sum_mid_bwd_cuda(dg_ctx *ctx, dg_dtype dt, const void *gy, int64_t outer,
                                          int64_t n, int64_t inner, double scale, void *gx) {
    int64_t total = outer * n * inner;
    if (total <= 0)
        return DG_OK;
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        sum_mid_bwd_kernel<float><<<dg__blocks(total, kThreads), kThreads, 0, st>>>(
            (const float *)gy, outer, n, inner, (float)scale, (float *)gx);
    else if (dt == DG_BF16)
        sum_mid_bwd_kernel<__nv_bfloat16><<<dg__blocks(total, kThreads), kThreads, 0, st>>>(
            (const __nv_bfloat16 *)gy, outer, n, inner, (float)scale, (__nv_bfloat16 *)gx);
    else
        return dg__err(DG_ERR_DTYPE, "sum backward: the CUDA kernels take f32 or bf16, got %s",
                       dg_dtype_name(dt));
    DG_CHECK_LAUNCH();
    return DG_OK;
}
