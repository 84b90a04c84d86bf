/*
 * kernels/tensor_kernels.cu -- the tensor-level kernels behind tensor/tensor.c: strided copy with
 * dtype conversion, fill, axpy (gradient accumulation) and the counter-based random fills.
 * Element i of a random fill uses the same (seed, i) hash as the CPU (tensor/rand.h).
 */
#include "common.cuh"
#include "../tensor/rand.h"

#include <string.h>

// ---- CUDA kernels

__device__ __forceinline__ double ld_any(const void *p, dg_dtype t, int64_t i) {
    switch (t) {
    case DG_F64: return ((const double *)p)[i];
    case DG_F32: return ((const float *)p)[i];
    case DG_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case DG_I32: return ((const int32_t *)p)[i];
    default: return (double)((const int64_t *)p)[i];
    }
}

__device__ __forceinline__ void st_any(void *p, dg_dtype t, int64_t i, double v) {
    switch (t) {
    case DG_F64: ((double *)p)[i] = v; break;
    case DG_F32: ((float *)p)[i] = (float)v; break;
    case DG_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v); break;
    case DG_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((int64_t *)p)[i] = (int64_t)v; break;
    }
}

__device__ __forceinline__ int64_t layout_off(const dg_layout &l, int64_t i) {
    int64_t off = 0;
    for (int d = l.ndim - 1; d >= 0; d--) {
        int64_t c = i % l.shape[d];
        i /= l.shape[d];
        off += c * l.stride[d];
    }
    return off;
}

__global__ void copy_strided_kernel(void *dst, dg_dtype ddt, dg_layout dl, const void *src,
                                    dg_dtype sdt, dg_layout sl, int64_t n, int flat) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t so = flat ? i : layout_off(sl, i), dof = flat ? i : layout_off(dl, i);
        if ((ddt == DG_I64 || ddt == DG_I32) && (sdt == DG_I64 || sdt == DG_I32)) {
            int64_t v = sdt == DG_I64 ? ((const int64_t *)src)[so] : ((const int32_t *)src)[so];
            if (ddt == DG_I64)
                ((int64_t *)dst)[dof] = v;
            else
                ((int32_t *)dst)[dof] = (int32_t)v;
        } else {
            st_any(dst, ddt, dof, ld_any(src, sdt, so));
        }
    }
}

__global__ void fill_kernel(void *dst, dg_dtype dt, int64_t n, double v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_any(dst, dt, i, v);
}

__global__ void axpy_kernel(void *dst, dg_dtype ddt, double alpha, const void *src, dg_dtype sdt,
                            int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_any(dst, ddt, i, ld_any(dst, ddt, i) + alpha * ld_any(src, sdt, i));
}

__global__ void axpy_f32_kernel(float *dst, float alpha, const float *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] += alpha * src[i];
}

__global__ void rand_kernel(void *dst, dg_dtype dt, int64_t n, uint64_t seed, int kind, double a,
                            double b) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        double v = kind == 0 ? a + (b - a) * dg__u01(seed, (uint64_t)i)
                             : a + b * dg__normal(seed, (uint64_t)i);
        st_any(dst, dt, i, v);
    }
}

// ---- kernel launchers

static dg_layout contiguous_layout(const dg_layout &like) {
    dg_layout l = like;
    int64_t s = 1;
    for (int d = l.ndim - 1; d >= 0; d--) {
        l.stride[d] = s;
        s *= l.shape[d];
    }
    return l;
}

extern "C" dg_status dg__cuda_copy_strided(dg_ctx *ctx, void *dst, dg_dtype ddt, dg_layout dl,
                                           const void *src, dg_dtype sdt, dg_layout sl,
                                           int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (dl.ndim == 0)
        dl = contiguous_layout(sl);
    /* Both sides contiguous (a dtype conversion): index directly, no per-element div/mod. */
    dg_layout cl = contiguous_layout(sl);
    int flat = memcmp(sl.stride, cl.stride, sizeof cl.stride) == 0 &&
               memcmp(dl.stride, cl.stride, sizeof cl.stride) == 0;
    copy_strided_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(dst, ddt, dl, src, sdt,
                                                                        sl, n, flat);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__cuda_fill(dg_ctx *ctx, void *dst, dg_dtype dt, int64_t n, double value) {
    if (n <= 0)
        return DG_OK;
    fill_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(dst, dt, n, value);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__cuda_axpy(dg_ctx *ctx, void *dst, dg_dtype ddt, double alpha,
                                   const void *src, dg_dtype sdt, int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (ddt == DG_F32 && sdt == DG_F32)
        axpy_f32_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(
            (float *)dst, (float)alpha, (const float *)src, n);
    else
        axpy_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(dst, ddt, alpha, src, sdt, n);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__cuda_rand(dg_ctx *ctx, void *dst, dg_dtype dt, int64_t n, uint64_t seed,
                                   int kind, double a, double b) {
    if (n <= 0)
        return DG_OK;
    rand_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(dst, dt, n, seed, kind, a, b);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
