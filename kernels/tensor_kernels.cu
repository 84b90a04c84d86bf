/*
 * kernels/tensor_kernels.cu -- the tensor-level kernels behind tensor/tensor.c: strided copy with
 * dtype conversion, fill, axpy (gradient accumulation) and the counter-based random fills.
 * Element i of a random fill uses the same (seed, i) hash as the CPU (tensor/rand.h).
 *
 * Copies and axpy are templates over the source and destination element types, so a bf16 -> f32
 * conversion is one load, one convert and one store per element, never a trip through f64.
 * Contiguous copies move 4 elements per thread with vector loads when both pointers allow it;
 * same-dtype contiguous copies are plain device-to-device memcpys.
 */
#include "common.cuh"
#include "../tensor/rand.h"

#include <stdint.h>
#include <string.h>
#include <type_traits>

// ---- element conversion

/* The arithmetic type an element is read as: bf16 widens to float, everything else is itself. */
template <typename T> __device__ __forceinline__ T dg_widen(T x) { return x; }
__device__ __forceinline__ float dg_widen(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename D, typename S> __device__ __forceinline__ D dg_cvt(S x) {
    if constexpr (std::is_same_v<D, __nv_bfloat16>)
        return __float2bfloat16((float)dg_widen(x));
    else
        return (D)dg_widen(x);
}

__device__ __forceinline__ void st_any(void *p, dg_dtype t, int64_t i, double v) {
    switch (t) {
    case DG_F64:
        ((double *)p)[i] = v;
        break;
    case DG_F32:
        ((float *)p)[i] = (float)v;
        break;
    case DG_BF16:
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v);
        break;
    case DG_I32:
        ((int32_t *)p)[i] = (int32_t)v;
        break;
    default:
        ((int64_t *)p)[i] = (int64_t)v;
        break;
    }
}

// ---- CUDA kernels

#define DG_VEC 4

/* Contiguous conversion: thread i handles elements [DG_VEC i, DG_VEC i + DG_VEC) with one vector
 * load and one vector store (both pointers aligned to a vector); the tail of n % DG_VEC elements
 * goes element by element. */
template <typename D, typename S>
__global__ void copy_vec_kernel(D *__restrict__ dst, const S *__restrict__ src, int64_t n) {
    int64_t nv = n / DG_VEC;
    const dg_pack<S, DG_VEC> *sv = (const dg_pack<S, DG_VEC> *)src;
    dg_pack<D, DG_VEC> *dv = (dg_pack<D, DG_VEC> *)dst;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv;
         i += (int64_t)gridDim.x * blockDim.x) {
        dg_pack<S, DG_VEC> a = sv[i];
        dg_pack<D, DG_VEC> b;
#pragma unroll
        for (int j = 0; j < DG_VEC; j++)
            b.v[j] = dg_cvt<D>(a.v[j]);
        dv[i] = b;
    }
    int64_t t = nv * DG_VEC + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < n)
        dst[t] = dg_cvt<D>(src[t]);
}

template <typename D, typename S>
__global__ void copy_flat_kernel(D *__restrict__ dst, const S *__restrict__ src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = dg_cvt<D>(src[i]);
}

template <typename D, typename S, typename Idx>
__global__ void copy_strided_kernel(D *__restrict__ dst, const dg_layout dl,
                                    const S *__restrict__ src, const dg_layout sl, Idx n) {
    for (Idx i = blockIdx.x * (Idx)blockDim.x + threadIdx.x; i < n;
         i += (Idx)gridDim.x * blockDim.x)
        dst[dg_layout_off(dl, i)] = dg_cvt<D>(src[dg_layout_off(sl, i)]);
}

template <typename D, typename S>
__global__ void axpy_kernel(D *__restrict__ dst, double alpha, const S *__restrict__ src,
                            int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if constexpr (std::is_same_v<D, double> || std::is_same_v<S, double>)
            dst[i] = dg_cvt<D>((double)dg_widen(dst[i]) + alpha * (double)dg_widen(src[i]));
        else
            dst[i] = dg_cvt<D>((float)dg_widen(dst[i]) + (float)alpha * (float)dg_widen(src[i]));
    }
}

__global__ void fill_kernel(void *dst, dg_dtype dt, int64_t n, double v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_any(dst, dt, i, v);
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

/* Call f with a value of the C++ element type of dtype t (the value itself is unused). */
template <typename F> static dg_status with_type(dg_dtype t, F f) {
    switch (t) {
    case DG_F64:
        return f(double{});
    case DG_F32:
        return f(float{});
    case DG_BF16:
        return f(__nv_bfloat16{});
    case DG_I32:
        return f(int32_t{});
    case DG_I64:
        return f(int64_t{});
    default:
        return dg__err(DG_ERR_DTYPE, "tensor kernels: unknown dtype %d", (int)t);
    }
}

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
                                           const void *src, dg_dtype sdt, dg_layout sl, int64_t n) {
    if (n <= 0)
        return DG_OK;
    if (dl.ndim == 0)
        dl = contiguous_layout(sl);
    /* Both sides contiguous (a dtype conversion or a plain copy): no index arithmetic. */
    dg_layout cl = contiguous_layout(sl);
    bool flat = memcmp(sl.stride, cl.stride, sizeof cl.stride) == 0 &&
                memcmp(dl.stride, cl.stride, sizeof cl.stride) == 0;
    if (flat && ddt == sdt) {
        DG_CHECK_CUDA(cudaMemcpyAsync(dst, src, (size_t)n * dg_dtype_size(ddt),
                                      cudaMemcpyDeviceToDevice, dg__stream(ctx)));
        return DG_OK;
    }
    cudaStream_t s = dg__stream(ctx);
    dg_layout ls[2] = {dl, sl};
    dg__layouts_coalesce(ls, 2);
    dl = ls[0], sl = ls[1];
    bool small = dg__layout_fits_u32(dl, n) && dg__layout_fits_u32(sl, n);
    return with_type(ddt, [&](auto dv) {
        using D = decltype(dv);
        return with_type(sdt, [&](auto sv) {
            using S = decltype(sv);
            if (flat) {
                bool vec = (uintptr_t)dst % (sizeof(D) * DG_VEC) == 0 &&
                           (uintptr_t)src % (sizeof(S) * DG_VEC) == 0;
                if (vec)
                    copy_vec_kernel<D, S><<<dg__blocks(n / DG_VEC + 1, 256), 256, 0, s>>>(
                        (D *)dst, (const S *)src, n);
                else
                    copy_flat_kernel<D, S>
                        <<<dg__blocks(n, 256), 256, 0, s>>>((D *)dst, (const S *)src, n);
            } else if (small) {
                copy_strided_kernel<D, S, uint32_t><<<dg__blocks(n, 256), 256, 0, s>>>(
                    (D *)dst, dl, (const S *)src, sl, (uint32_t)n);
            } else {
                copy_strided_kernel<D, S, int64_t>
                    <<<dg__blocks(n, 256), 256, 0, s>>>((D *)dst, dl, (const S *)src, sl, n);
            }
            DG_CHECK_LAUNCH();
            return DG_OK;
        });
    });
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
    auto is_float = [](dg_dtype t) { return t == DG_F64 || t == DG_F32 || t == DG_BF16; };
    if (!is_float(ddt) || !is_float(sdt))
        return dg__err(DG_ERR_DTYPE, "dg__cuda_axpy: dst and src must be floating point");
    cudaStream_t s = dg__stream(ctx);
    return with_type(ddt, [&](auto dv) {
        using D = decltype(dv);
        return with_type(sdt, [&](auto sv) {
            using S = decltype(sv);
            if constexpr (std::is_integral_v<D> || std::is_integral_v<S>) {
                return DG_OK; /* unreachable: refused above */
            } else {
                axpy_kernel<D, S>
                    <<<dg__blocks(n, 256), 256, 0, s>>>((D *)dst, alpha, (const S *)src, n);
                DG_CHECK_LAUNCH();
                return DG_OK;
            }
        });
    });
}

extern "C" dg_status dg__cuda_rand(dg_ctx *ctx, void *dst, dg_dtype dt, int64_t n, uint64_t seed,
                                   int kind, double a, double b) {
    if (n <= 0)
        return DG_OK;
    rand_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(dst, dt, n, seed, kind, a, b);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
