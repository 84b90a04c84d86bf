/*
 * kernels/global_norm.cu -- deterministic sum of squares of one tensor (dg_global_norm).
 *
 * Two passes, no atomics: pass 1 runs a grid whose size depends only on n; thread t of block b
 * accumulates x[i]^2 in f64 for i = b*256 + t, stepping by the grid, then the block reduces its
 * 256 values in a fixed tree into partials[b]. Pass 2, one block, reduces the partials the same
 * way. Same n, same bits, on every run.
 */
#include "common.cuh"
#include "global_norm.cuh"

#define SUMSQ_THREADS 256

// ---- CUDA kernels

__device__ __forceinline__ double ld_sq(const float *x, int64_t i) {
    double v = x[i];
    return v * v;
}
__device__ __forceinline__ double ld_sq(const __nv_bfloat16 *x, int64_t i) {
    double v = __bfloat162float(x[i]);
    return v * v;
}
__device__ __forceinline__ double ld_sq(const double *x, int64_t i) { return x[i] * x[i]; }

/* Fixed-tree sum of one value per thread (blockDim.x == SUMSQ_THREADS); thread 0 gets it. */
__device__ double block_sum(double v) {
    __shared__ double buf[SUMSQ_THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int w = SUMSQ_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            buf[threadIdx.x] += buf[threadIdx.x + w];
        __syncthreads();
    }
    return buf[0];
}

template <typename T>
__global__ void sumsq_partial_kernel(const T *x, int64_t n, double *partials) {
    double acc = 0.0;
    for (int64_t i = blockIdx.x * (int64_t)SUMSQ_THREADS + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * SUMSQ_THREADS)
        acc += ld_sq(x, i);
    double s = block_sum(acc);
    if (threadIdx.x == 0)
        partials[blockIdx.x] = s;
}

__global__ void sumsq_final_kernel(const double *partials, int nparts, double *result) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < nparts; i += SUMSQ_THREADS)
        acc += partials[i];
    double s = block_sum(acc);
    if (threadIdx.x == 0)
        *result = s;
}

// ---- kernel launchers

extern "C" dg_status dg__sumsq_cuda(dg_ctx *ctx, dg_dtype dt, const void *x, int64_t n,
                                    double *partials, double *result) {
    cudaStream_t st = dg__stream(ctx);
    /* about 8 elements per thread per pass, at most DG_SUMSQ_MAX_BLOCKS blocks */
    int64_t want = DG_CEIL_DIV(n, (int64_t)SUMSQ_THREADS * 8);
    int blocks = (int)(want < 1 ? 1 : want > DG_SUMSQ_MAX_BLOCKS ? DG_SUMSQ_MAX_BLOCKS : want);
    if (dt == DG_F32)
        sumsq_partial_kernel<float>
            <<<blocks, SUMSQ_THREADS, 0, st>>>((const float *)x, n, partials);
    else if (dt == DG_BF16)
        sumsq_partial_kernel<__nv_bfloat16>
            <<<blocks, SUMSQ_THREADS, 0, st>>>((const __nv_bfloat16 *)x, n, partials);
    else if (dt == DG_F64)
        sumsq_partial_kernel<double>
            <<<blocks, SUMSQ_THREADS, 0, st>>>((const double *)x, n, partials);
    else
        return dg__err(DG_ERR_DTYPE, "global_norm (cuda): dtype %s is not a float dtype",
                       dg_dtype_name(dt));
    DG_CHECK_LAUNCH();
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, st>>>(partials, blocks, result);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
