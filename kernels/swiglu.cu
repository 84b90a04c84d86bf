/*
 * kernels/swiglu.cu -- SwiGLU y = silu(gate) * up, forward and backward, elementwise, for f32 and
 * bf16 storage with f32 math. silu(g) = g s and silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
 */
#include "common.cuh"
#include "swiglu.cuh"

#define SWIGLU_THREADS 256

// ---- CUDA kernels

__device__ __forceinline__ float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void swiglu_fwd_kernel(int64_t n, const T *gate, const T *up, T *y) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float g = dg_ld(gate, i);
        dg_st(y, i, g * swiglu_sigmoid(g) * dg_ld(up, i));
    }
}

template <typename T>
__global__ void swiglu_bwd_kernel(int64_t n, const T *gate, const T *up, const T *dy, T *dgate,
                                  T *dup) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float g = dg_ld(gate, i), s = swiglu_sigmoid(g), d = dg_ld(dy, i);
        if (dgate)
            dg_st(dgate, i, d * dg_ld(up, i) * (s * (1.0f + g * (1.0f - s))));
        if (dup)
            dg_st(dup, i, d * (g * s));
    }
}

// ---- kernel launchers

extern "C" dg_status dg__swiglu_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t n, const void *gate,
                                         const void *up, void *y) {
    if (n <= 0)
        return DG_OK;
    unsigned blocks = dg__blocks(n, SWIGLU_THREADS);
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        swiglu_fwd_kernel<float><<<blocks, SWIGLU_THREADS, 0, st>>>(n, (const float *)gate,
                                                                    (const float *)up, (float *)y);
    else if (dt == DG_BF16)
        swiglu_fwd_kernel<__nv_bfloat16><<<blocks, SWIGLU_THREADS, 0, st>>>(
            n, (const __nv_bfloat16 *)gate, (const __nv_bfloat16 *)up, (__nv_bfloat16 *)y);
    else
        return dg__err(DG_ERR_DTYPE, "swiglu (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__swiglu_bwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t n, const void *gate,
                                         const void *up, const void *dy, void *dgate, void *dup) {
    if (n <= 0 || (!dgate && !dup))
        return DG_OK;
    unsigned blocks = dg__blocks(n, SWIGLU_THREADS);
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        swiglu_bwd_kernel<float>
            <<<blocks, SWIGLU_THREADS, 0, st>>>(n, (const float *)gate, (const float *)up,
                                                (const float *)dy, (float *)dgate, (float *)dup);
    else if (dt == DG_BF16)
        swiglu_bwd_kernel<__nv_bfloat16><<<blocks, SWIGLU_THREADS, 0, st>>>(
            n, (const __nv_bfloat16 *)gate, (const __nv_bfloat16 *)up, (const __nv_bfloat16 *)dy,
            (__nv_bfloat16 *)dgate, (__nv_bfloat16 *)dup);
    else
        return dg__err(DG_ERR_DTYPE, "swiglu backward (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    DG_CHECK_LAUNCH();
    return DG_OK;
}
