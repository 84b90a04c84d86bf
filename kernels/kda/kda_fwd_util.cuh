/*
 * kernels/kda/kda_fwd_util.cuh -- device helpers shared by the KDA forward kernel files:
 * overflow-free sigmoid/softplus written exactly like the CPU reference (ops/kda/kda.h), the
 * chunk-size dispatch, and the launch sizes every chunk kernel shares.
 */
#ifndef DG_KDA_FWD_UTIL_CUH
#define DG_KDA_FWD_UTIL_CUH

#include "../common.cuh"
#include "kda_cuda.h"

#define KDA_THREADS 256 /* every chunk kernel: 8 warps */

__device__ __forceinline__ float kda_dsigmoid(float x) {
    if (x >= 0.f)
        return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}

__device__ __forceinline__ float kda_dsoftplus(float x) {
    return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

/* Run the statements (variadic: they may contain commas) with the compile-time constant BT_ bound to d->BT (16, 32 or 64). */
#define KDA_DISPATCH_BT(BTv, ...)                                                                 \
    do {                                                                                           \
        switch (BTv) {                                                                             \
        case 16: { constexpr int BT_ = 16; __VA_ARGS__; } break;                                          \
        case 32: { constexpr int BT_ = 32; __VA_ARGS__; } break;                                          \
        case 64: { constexpr int BT_ = 64; __VA_ARGS__; } break;                                          \
        default:                                                                                   \
            return dg__err(DG_ERR_ARG, "%s: chunk size BT=%d is not 16, 32 or 64", __func__,       \
                           (int)(BTv));                                                            \
        }                                                                                          \
    } while (0)

/* Arguments every launcher checks first. */
static inline dg_status kda_check_dims(const char *fn, dg_ctx *ctx, const kda_cuda_dims *d) {
    if (!ctx || !d || !d->buf)
        return dg__err(DG_ERR_ARG, "%s: ctx and a dims built by kda_cuda_dims_new are required", fn);
    return DG_OK;
}

#endif /* DG_KDA_FWD_UTIL_CUH */
