/*
 * kernels/cross_entropy.cu -- fused, stable softmax cross-entropy: forward and backward.
 *
 * One block per row. Each thread keeps a running (max m, sum s of exp(x - m)) over its strided
 * share of the row (an online softmax: one pass over the logits), then the block merges the
 * pairs in a fixed tree: (m1,s1) + (m2,s2) = (m, s1 e^(m1-m) + s2 e^(m2-m)), m = max(m1,m2).
 * The row keeps (m, log s); loss_i = (m - x_t) + log s never overflows, whatever the logits'
 * scale. The mean over rows is a second
 * single-block kernel with a fixed reduction order (f64 partial sums), so the loss is bitwise
 * reproducible; no atomics touch floats.
 */
#include "common.cuh"
#include "cross_entropy.cuh"

#include <limits.h>
#include <math.h>

#define CE_THREADS 256

// ---- CUDA kernels

struct ms_pair {
    float m, s;
};

__device__ __forceinline__ ms_pair ms_merge(ms_pair a, ms_pair b) {
    float m = fmaxf(a.m, b.m);
    if (m == -INFINITY)
        return ms_pair{m, 0.0f};
    float s = (a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m)) +
              (b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m));
    return ms_pair{m, s};
}

/* (m, log s) of one row, s = sum_j exp(x[j] - m), by the whole block (blockDim.x ==
 * CE_THREADS). Kept as a pair, not m + log s: x - m is exact for large logits, x - lse is not. */
template <typename T> __device__ ms_pair row_stats(const T *x, int64_t V) {
    __shared__ ms_pair part[CE_THREADS / 32];
    ms_pair a{-INFINITY, 0.0f};
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        a = ms_merge(a, ms_pair{dg_ld(x, j), 1.0f});
    for (int off = 16; off > 0; off >>= 1) {
        ms_pair b{__shfl_down_sync(0xffffffffu, a.m, off), __shfl_down_sync(0xffffffffu, a.s, off)};
        a = ms_merge(a, b);
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0)
        part[warp] = a;
    __syncthreads();
    if (warp == 0) {
        a = lane < CE_THREADS / 32 ? part[lane] : ms_pair{-INFINITY, 0.0f};
        for (int off = 16; off > 0; off >>= 1) {
            ms_pair b{__shfl_down_sync(0xffffffffu, a.m, off),
                      __shfl_down_sync(0xffffffffu, a.s, off)};
            a = ms_merge(a, b);
        }
        if (lane == 0)
            part[0] = a;
    }
    __syncthreads();
    ms_pair r = part[0];
    __syncthreads(); /* part[] is reused by the next row */
    return ms_pair{r.m, logf(r.s)};
}

template <typename T, typename I>
__global__ void ce_fwd_rows_kernel(const T *logits, int64_t N, int64_t V, const I *targets,
                                   int64_t ignore, float *row_loss, float *stats,
                                   unsigned long long *bad) {
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *x = logits + i * V;
        ms_pair st = row_stats(x, V);
        if (threadIdx.x == 0) {
            int64_t t = (int64_t)targets[i];
            float loss = 0.0f;
            if (t != ignore) {
                if (t < 0 || t >= V)
                    atomicMin(bad, (unsigned long long)i);
                else
                    loss = (st.m - dg_ld(x, t)) + st.s;
            }
            row_loss[i] = loss;
            if (stats) {
                stats[2 * i] = st.m;
                stats[2 * i + 1] = st.s;
            }
        }
    }
}

/* loss = sum(row_loss) / count in one block: fixed partition, fixed tree, f64 partials. */
template <typename I>
__global__ void ce_fwd_mean_kernel(const float *row_loss, const I *targets, int64_t N,
                                   int64_t ignore, float *loss, int64_t *count) {
    __shared__ double ps[1024];
    __shared__ long long pc[1024];
    double s = 0.0;
    long long c = 0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
        s += (double)row_loss[i];
        c += (int64_t)targets[i] != ignore;
    }
    ps[threadIdx.x] = s;
    pc[threadIdx.x] = c;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            ps[threadIdx.x] += ps[threadIdx.x + w];
            pc[threadIdx.x] += pc[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        loss[0] = pc[0] > 0 ? (float)(ps[0] / (double)pc[0]) : 0.0f;
        count[0] = pc[0];
    }
}

template <typename T, typename I>
__global__ void ce_bwd_kernel(const T *logits, int64_t N, int64_t V, const I *targets,
                              int64_t ignore, const float *stats, const int64_t *count,
                              const float *dloss, T *dlogits) {
    const int64_t cnt = count[0];
    const float scale = cnt > 0 ? dloss[0] / (float)cnt : 0.0f;
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const T *x = logits + i * V;
        T *g = dlogits + i * V;
        int64_t t = (int64_t)targets[i];
        if (t == ignore || cnt == 0) {
            for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
                dg_st(g, j, 0.0f);
            continue;
        }
        ms_pair st = stats ? ms_pair{stats[2 * i], stats[2 * i + 1]} : row_stats(x, V);
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            float p = expf((dg_ld(x, j) - st.m) - st.s);
            dg_st(g, j, (p - (j == t ? 1.0f : 0.0f)) * scale);
        }
    }
}

// ---- kernel launchers

template <typename T, typename I>
static dg_status fwd_launch(dg_ctx *ctx, const void *logits, int64_t N, int64_t V,
                            const void *targets, int64_t ignore, float *row_loss, float *loss,
                            int64_t *count, float *stats, unsigned long long *bad) {
    cudaStream_t st = dg__stream(ctx);
    if (N > 0) {
        ce_fwd_rows_kernel<T, I><<<dg__blocks(N, 1), CE_THREADS, 0, st>>>(
            (const T *)logits, N, V, (const I *)targets, ignore, row_loss, stats, bad);
        DG_CHECK_LAUNCH();
    }
    ce_fwd_mean_kernel<I><<<1, 1024, 0, st>>>(row_loss, (const I *)targets, N, ignore, loss, count);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__cross_entropy_fwd_cuda(dg_ctx *ctx, dg_dtype ldt, const void *logits,
                                                int64_t N, int64_t V, dg_dtype tdt,
                                                const void *targets, int64_t ignore_index,
                                                float *loss, int64_t *count, float *stats,
                                                const dg_deverr_site *site) {
    if (ldt != DG_F32 && ldt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "cross_entropy (cuda): logits dtype %s, expected f32 or bf16",
                       dg_dtype_name(ldt));
    /* scratch: the per-row losses */
    size_t bytes = (size_t)(N > 0 ? N : 1) * sizeof(float);
    void *buf = NULL;
    DG_TRY(dg__cuda_malloc(ctx, bytes, &buf));
    unsigned long long *bad = &dg__deverr(ctx)->pending;
    float *rows = (float *)buf;
    dg_status s;
    if (ldt == DG_F32 && tdt == DG_I32)
        s = fwd_launch<float, int32_t>(ctx, logits, N, V, targets, ignore_index, rows, loss, count,
                                       stats, bad);
    else if (ldt == DG_F32)
        s = fwd_launch<float, int64_t>(ctx, logits, N, V, targets, ignore_index, rows, loss, count,
                                       stats, bad);
    else if (tdt == DG_I32)
        s = fwd_launch<__nv_bfloat16, int32_t>(ctx, logits, N, V, targets, ignore_index, rows, loss,
                                               count, stats, bad);
    else
        s = fwd_launch<__nv_bfloat16, int64_t>(ctx, logits, N, V, targets, ignore_index, rows, loss,
                                               count, stats, bad);
    dg__cuda_free(ctx, buf, bytes); /* stream-ordered: reused only by later work */
    DG_TRY(s);
    return N > 0 ? dg__deverr_commit(ctx, site, tdt, targets) : DG_OK;
}

template <typename T, typename I>
static dg_status bwd_launch(dg_ctx *ctx, const void *logits, int64_t N, int64_t V,
                            const void *targets, int64_t ignore, const float *stats,
                            const int64_t *count, const float *dloss, void *dlogits) {
    ce_bwd_kernel<T, I><<<dg__blocks(N, 1), CE_THREADS, 0, dg__stream(ctx)>>>(
        (const T *)logits, N, V, (const I *)targets, ignore, stats, count, dloss, (T *)dlogits);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__cross_entropy_bwd_cuda(dg_ctx *ctx, dg_dtype ldt, const void *logits,
                                                int64_t N, int64_t V, dg_dtype tdt,
                                                const void *targets, int64_t ignore_index,
                                                const float *stats, const int64_t *count,
                                                const float *dloss, void *dlogits) {
    if (N <= 0 || V <= 0)
        return DG_OK;
    if (ldt == DG_F32 && tdt == DG_I32)
        return bwd_launch<float, int32_t>(ctx, logits, N, V, targets, ignore_index, stats, count,
                                          dloss, dlogits);
    if (ldt == DG_F32)
        return bwd_launch<float, int64_t>(ctx, logits, N, V, targets, ignore_index, stats, count,
                                          dloss, dlogits);
    if (ldt != DG_BF16)
        return dg__err(DG_ERR_DTYPE, "cross_entropy (cuda): logits dtype %s, expected f32 or bf16",
                       dg_dtype_name(ldt));
    if (tdt == DG_I32)
        return bwd_launch<__nv_bfloat16, int32_t>(ctx, logits, N, V, targets, ignore_index, stats,
                                                  count, dloss, dlogits);
    return bwd_launch<__nv_bfloat16, int64_t>(ctx, logits, N, V, targets, ignore_index, stats,
                                              count, dloss, dlogits);
}
