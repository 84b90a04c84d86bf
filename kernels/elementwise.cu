/*
 * kernels/elementwise.cu -- the elementwise kernels behind ops/elementwise.c and ops/unary.c:
 * broadcasting add/sub/mul, scale, and exp/log/sigmoid/softplus/silu with their backward.
 * One grid-stride thread per output element; storage f32 or bf16 (T), math in f32. The formulas
 * match the CPU reference (see dg_unary_kind in elementwise.cuh); sigmoid and softplus are written
 * so that no intermediate overflows for large |x|.
 */
#include "common.cuh"
#include "elementwise.cuh"

// ---- CUDA kernels

template <int KIND> __device__ __forceinline__ float binary_f(float a, float b) {
    if (KIND == DG_BINARY_ADD)
        return a + b;
    if (KIND == DG_BINARY_SUB)
        return a - b;
    return a * b;
}

/* a and b contiguous with y's shape: no index arithmetic. */
template <typename T, int KIND>
__global__ void binary_fwd_kernel_flat(T *y, const T *a, const T *b, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dg_st(y, i, binary_f<KIND>(dg_ld(a, i), dg_ld(b, i)));
}

/* General case: y's logical index i -> an offset into each input through its strides (0 along
 * broadcast dims), the layouts coalesced first (dg__layouts_coalesce). */
template <typename T, int KIND, typename Idx>
__global__ void binary_fwd_kernel_strided(T *y, const T *a, const dg_layout la, const T *b,
                                          const dg_layout lb, Idx n) {
    for (Idx i = blockIdx.x * (Idx)blockDim.x + threadIdx.x; i < n;
         i += (Idx)gridDim.x * blockDim.x)
        dg_st(y, i, binary_f<KIND>(dg_ld(a, dg_layout_off(la, i)), dg_ld(b, dg_layout_off(lb, i))));
}

/* Two dims after coalescing (a bias over rows, a row scale, a transpose): one div per element. */
template <typename T, int KIND>
__global__ void binary_fwd_kernel_2d(T *y, const T *a, uint32_t sa0, uint32_t sa1, const T *b,
                                     uint32_t sb0, uint32_t sb1, uint32_t C, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t r = i / C, c = i - r * C;
        dg_st(y, i, binary_f<KIND>(dg_ld(a, r * sa0 + c * sa1), dg_ld(b, r * sb0 + c * sb1)));
    }
}

template <typename T> __global__ void scale_fwd_kernel(T *y, const T *x, float s, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dg_st(y, i, s * dg_ld(x, i));
}

/* sigmoid without overflow: e^-|x| is at most 1. */
__device__ __forceinline__ float sigmoid_f(float x) {
    float e = expf(-fabsf(x));
    return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

template <int KIND> __device__ __forceinline__ float unary_f(float x) {
    switch (KIND) {
    case DG_UNARY_EXP:
        return expf(x);
    case DG_UNARY_LOG:
        return logf(x);
    case DG_UNARY_SIGMOID:
        return sigmoid_f(x);
    case DG_UNARY_SOFTPLUS:
        return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));
    default:
        return x * sigmoid_f(x); /* silu */
    }
}

/* dy * f'(x), from v = x, or from v = y = f(x) when from_output (exp and sigmoid). */
template <int KIND> __device__ __forceinline__ float unary_df(float dy, float v, bool from_output) {
    switch (KIND) {
    case DG_UNARY_EXP:
        return dy * (from_output ? v : expf(v));
    case DG_UNARY_LOG:
        return dy / v;
    case DG_UNARY_SIGMOID: {
        float s = from_output ? v : sigmoid_f(v);
        return dy * s * (1.f - s);
    }
    case DG_UNARY_SOFTPLUS:
        return dy * sigmoid_f(v);
    default: { /* silu */
        float s = sigmoid_f(v);
        return dy * s * (1.f + v * (1.f - s));
    }
    }
}

template <typename T, int KIND> __global__ void unary_fwd_kernel(T *y, const T *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dg_st(y, i, unary_f<KIND>(dg_ld(x, i)));
}

template <typename T, int KIND>
__global__ void unary_bwd_kernel(T *gx, const T *gy, const T *saved, bool from_output, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dg_st(gx, i, unary_df<KIND>(dg_ld(gy, i), dg_ld(saved, i), from_output));
}

// ---- kernel launchers

static const int kThreads = 256;

template <typename T, int KIND>
static void launch_binary(cudaStream_t st, T *y, const T *a, const dg_layout &la, const T *b,
                          const dg_layout &lb, int64_t n) {
    dg_layout l[2] = {la, lb};
    dg__layouts_coalesce(l, 2);
    if (l[0].ndim == 1 && l[0].stride[0] == 1 && l[1].stride[0] == 1)
        binary_fwd_kernel_flat<T, KIND><<<dg__blocks(n, kThreads), kThreads, 0, st>>>(y, a, b, n);
    else if (l[0].ndim == 2 && dg__layout_fits_u32(l[0], n) && dg__layout_fits_u32(l[1], n) &&
             l[0].stride[0] >= 0 && l[0].stride[1] >= 0 && l[1].stride[0] >= 0 &&
             l[1].stride[1] >= 0)
        binary_fwd_kernel_2d<T, KIND><<<dg__blocks(n, kThreads), kThreads, 0, st>>>(
            y, a, (uint32_t)l[0].stride[0], (uint32_t)l[0].stride[1], b, (uint32_t)l[1].stride[0],
            (uint32_t)l[1].stride[1], (uint32_t)l[0].shape[1], (uint32_t)n);
    else if (dg__layout_fits_u32(l[0], n) && dg__layout_fits_u32(l[1], n))
        binary_fwd_kernel_strided<T, KIND, uint32_t>
            <<<dg__blocks(n, kThreads), kThreads, 0, st>>>(y, a, l[0], b, l[1], (uint32_t)n);
    else
        binary_fwd_kernel_strided<T, KIND, int64_t>
            <<<dg__blocks(n, kThreads), kThreads, 0, st>>>(y, a, l[0], b, l[1], n);
}

template <typename T>
static dg_status binary_fwd(dg_ctx *ctx, dg_binary_kind kind, void *y, const void *a,
                            const dg_layout &la, const void *b, const dg_layout &lb, int64_t n) {
    cudaStream_t st = dg__stream(ctx);
    T *yt = (T *)y;
    const T *at = (const T *)a, *bt = (const T *)b;
    switch (kind) {
    case DG_BINARY_ADD:
        launch_binary<T, DG_BINARY_ADD>(st, yt, at, la, bt, lb, n);
        break;
    case DG_BINARY_SUB:
        launch_binary<T, DG_BINARY_SUB>(st, yt, at, la, bt, lb, n);
        break;
    case DG_BINARY_MUL:
        launch_binary<T, DG_BINARY_MUL>(st, yt, at, la, bt, lb, n);
        break;
    }
    DG_CHECK_LAUNCH();
    return DG_OK;
}

static dg_status bad_dtype(const char *what, dg_dtype dt) {
    return dg__err(DG_ERR_DTYPE, "%s: the CUDA kernels take f32 or bf16, got %s", what,
                   dg_dtype_name(dt));
}

extern "C" dg_status dg__binary_fwd_cuda(dg_ctx *ctx, dg_binary_kind kind, dg_dtype dt, void *y,
                                         const void *a, dg_layout al, const void *b, dg_layout bl,
                                         int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (dt == DG_F32)
        return binary_fwd<float>(ctx, kind, y, a, al, b, bl, n);
    if (dt == DG_BF16)
        return binary_fwd<__nv_bfloat16>(ctx, kind, y, a, al, b, bl, n);
    return bad_dtype("binary op", dt);
}

extern "C" dg_status dg__scale_fwd_cuda(dg_ctx *ctx, dg_dtype dt, void *y, const void *x, double s,
                                        int64_t n) {
    if (n <= 0)
        return DG_OK;
    cudaStream_t st = dg__stream(ctx);
    if (dt == DG_F32)
        scale_fwd_kernel<float><<<dg__blocks(n, kThreads), kThreads, 0, st>>>(
            (float *)y, (const float *)x, (float)s, n);
    else if (dt == DG_BF16)
        scale_fwd_kernel<__nv_bfloat16><<<dg__blocks(n, kThreads), kThreads, 0, st>>>(
            (__nv_bfloat16 *)y, (const __nv_bfloat16 *)x, (float)s, n);
    else
        return bad_dtype("dg_scale", dt);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

template <typename T>
static void unary_fwd(cudaStream_t st, dg_unary_kind kind, T *y, const T *x, int64_t n) {
    unsigned g = dg__blocks(n, kThreads);
    switch (kind) {
    case DG_UNARY_EXP:
        unary_fwd_kernel<T, DG_UNARY_EXP><<<g, kThreads, 0, st>>>(y, x, n);
        break;
    case DG_UNARY_LOG:
        unary_fwd_kernel<T, DG_UNARY_LOG><<<g, kThreads, 0, st>>>(y, x, n);
        break;
    case DG_UNARY_SIGMOID:
        unary_fwd_kernel<T, DG_UNARY_SIGMOID><<<g, kThreads, 0, st>>>(y, x, n);
        break;
    case DG_UNARY_SOFTPLUS:
        unary_fwd_kernel<T, DG_UNARY_SOFTPLUS><<<g, kThreads, 0, st>>>(y, x, n);
        break;
    case DG_UNARY_SILU:
        unary_fwd_kernel<T, DG_UNARY_SILU><<<g, kThreads, 0, st>>>(y, x, n);
        break;
    }
}

template <typename T>
static void unary_bwd(cudaStream_t st, dg_unary_kind kind, T *gx, const T *gy, const T *v,
                      bool from_out, int64_t n) {
    unsigned g = dg__blocks(n, kThreads);
    switch (kind) {
    case DG_UNARY_EXP:
        unary_bwd_kernel<T, DG_UNARY_EXP><<<g, kThreads, 0, st>>>(gx, gy, v, from_out, n);
        break;
    case DG_UNARY_LOG:
        unary_bwd_kernel<T, DG_UNARY_LOG><<<g, kThreads, 0, st>>>(gx, gy, v, from_out, n);
        break;
    case DG_UNARY_SIGMOID:
        unary_bwd_kernel<T, DG_UNARY_SIGMOID><<<g, kThreads, 0, st>>>(gx, gy, v, from_out, n);
        break;
    case DG_UNARY_SOFTPLUS:
        unary_bwd_kernel<T, DG_UNARY_SOFTPLUS><<<g, kThreads, 0, st>>>(gx, gy, v, from_out, n);
        break;
    case DG_UNARY_SILU:
        unary_bwd_kernel<T, DG_UNARY_SILU><<<g, kThreads, 0, st>>>(gx, gy, v, from_out, n);
        break;
    }
}

extern "C" dg_status dg__unary_fwd_cuda(dg_ctx *ctx, dg_unary_kind kind, dg_dtype dt, void *y,
                                        const void *x, int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (dt == DG_F32)
        unary_fwd<float>(dg__stream(ctx), kind, (float *)y, (const float *)x, n);
    else if (dt == DG_BF16)
        unary_fwd<__nv_bfloat16>(dg__stream(ctx), kind, (__nv_bfloat16 *)y,
                                 (const __nv_bfloat16 *)x, n);
    else
        return bad_dtype("unary op", dt);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__unary_bwd_cuda(dg_ctx *ctx, dg_unary_kind kind, dg_dtype dt, void *gx,
                                        const void *gy, const void *saved, int saved_is_output,
                                        int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (dt == DG_F32)
        unary_bwd<float>(dg__stream(ctx), kind, (float *)gx, (const float *)gy,
                         (const float *)saved, saved_is_output != 0, n);
    else if (dt == DG_BF16)
        unary_bwd<__nv_bfloat16>(dg__stream(ctx), kind, (__nv_bfloat16 *)gx,
                                 (const __nv_bfloat16 *)gy, (const __nv_bfloat16 *)saved,
                                 saved_is_output != 0, n);
    else
        return bad_dtype("unary op backward", dt);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
