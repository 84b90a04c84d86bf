/*
 * kernels/swiglu.cu -- SwiGLU y = silu(gate) * up, forward and backward, elementwise, for f32 and
 * bf16 storage with f32 math. silu(g) = g s and silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
 * Aligned buffers are read and written 16 bytes at a time (8 bf16 or 4 f32 per thread and step).
 */
#include "common.cuh"
#include "swiglu.cuh"

#include <initializer_list>

#define SWIGLU_THREADS 256

// ---- CUDA kernels

__device__ __forceinline__ float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

/* V elements per thread and step (a dg_pack): one 16-byte load per operand when every pointer is
 * aligned (V = 16 / sizeof(T)), else V = 1. The n % V tail is done element by element. */

template <typename T, int V>
__global__ void swiglu_fwd_kernel(int64_t n, const T *gate, const T *up, T *y) {
    using W = dg_pack<T, V>;
    const int64_t nv = n / V, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += stride) {
        W g = ((const W *)gate)[i], u = ((const W *)up)[i], o;
#pragma unroll
        for (int e = 0; e < V; e++) {
            float gf = dg_ld(g.v, e);
            dg_st(o.v, e, gf * swiglu_sigmoid(gf) * dg_ld(u.v, e));
        }
        ((W *)y)[i] = o;
    }
    for (int64_t i = nv * V + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = dg_ld(gate, i);
        dg_st(y, i, g * swiglu_sigmoid(g) * dg_ld(up, i));
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd_one(const T *gate, const T *up, const T *dy, T *dgate,
                                               T *dup, int64_t i, int64_t o) {
    float g = dg_ld(gate, i), s = swiglu_sigmoid(g), d = dg_ld(dy, i);
    if (dgate)
        dg_st(dgate, o, d * dg_ld(up, i) * (s * (1.0f + g * (1.0f - s))));
    if (dup)
        dg_st(dup, o, d * (g * s));
}

template <typename T, int V>
__global__ void swiglu_bwd_kernel(int64_t n, const T *gate, const T *up, const T *dy, T *dgate,
                                  T *dup) {
    using W = dg_pack<T, V>;
    const int64_t nv = n / V, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += stride) {
        W g = ((const W *)gate)[i], u = ((const W *)up)[i], d = ((const W *)dy)[i], og, ou;
#pragma unroll
        for (int e = 0; e < V; e++)
            swiglu_bwd_one(g.v, u.v, d.v, dgate ? og.v : (T *)nullptr, dup ? ou.v : (T *)nullptr, e,
                           e);
        if (dgate)
            ((W *)dgate)[i] = og;
        if (dup)
            ((W *)dup)[i] = ou;
    }
    for (int64_t i = nv * V + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
        swiglu_bwd_one(gate, up, dy, dgate, dup, i, i);
}

/* Do all non-NULL pointers sit on 16 bytes? */
static bool swiglu_aligned(std::initializer_list<const void *> ps) {
    for (const void *p : ps)
        if (p && (uintptr_t)p % 16)
            return false;
    return true;
}

template <typename T>
static void swiglu_fwd_launch(cudaStream_t st, int64_t n, const void *gate, const void *up,
                              void *y) {
    constexpr int V = 16 / sizeof(T);
    if (swiglu_aligned({gate, up, y}))
        swiglu_fwd_kernel<T, V><<<dg__blocks(n / V + 1, SWIGLU_THREADS), SWIGLU_THREADS, 0, st>>>(
            n, (const T *)gate, (const T *)up, (T *)y);
    else
        swiglu_fwd_kernel<T, 1><<<dg__blocks(n, SWIGLU_THREADS), SWIGLU_THREADS, 0, st>>>(
            n, (const T *)gate, (const T *)up, (T *)y);
}

template <typename T>
static void swiglu_bwd_launch(cudaStream_t st, int64_t n, const void *gate, const void *up,
                              const void *dy, void *dgate, void *dup) {
    constexpr int V = 16 / sizeof(T);
    if (swiglu_aligned({gate, up, dy, dgate, dup}))
        swiglu_bwd_kernel<T, V><<<dg__blocks(n / V + 1, SWIGLU_THREADS), SWIGLU_THREADS, 0, st>>>(
            n, (const T *)gate, (const T *)up, (const T *)dy, (T *)dgate, (T *)dup);
    else
        swiglu_bwd_kernel<T, 1><<<dg__blocks(n, SWIGLU_THREADS), SWIGLU_THREADS, 0, st>>>(
            n, (const T *)gate, (const T *)up, (const T *)dy, (T *)dgate, (T *)dup);
}

// ---- kernel launchers

extern "C" dg_status dg__swiglu_fwd_cuda(dg_ctx *ctx, dg_dtype dt, int64_t n, const void *gate,
                                         const void *up, void *y) {
    if (n <= 0)
        return DG_OK;
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        swiglu_fwd_launch<float>(st, n, gate, up, y);
    else if (dt == DG_BF16)
        swiglu_fwd_launch<__nv_bfloat16>(st, n, gate, up, y);
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
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        swiglu_bwd_launch<float>(st, n, gate, up, dy, dgate, dup);
    else if (dt == DG_BF16)
        swiglu_bwd_launch<__nv_bfloat16>(st, n, gate, up, dy, dgate, dup);
    else
        return dg__err(DG_ERR_DTYPE, "swiglu backward (cuda): no kernel for dtype %s (f32, bf16)",
                       dg_dtype_name(dt));
    DG_CHECK_LAUNCH();
    return DG_OK;
}
