/*
 * kernels/bench_util.cuh -- small C-callable CUDA helpers for benchmarks and diagnostics: an
 * event timer on a context's stream, the device's name and size, and the cuBLAS math mode of a
 * context. C-compatible; only built with CUDA.
 */
#ifndef DG_KERNELS_BENCH_UTIL_CUH
#define DG_KERNELS_BENCH_UTIL_CUH

#include "../tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Two CUDA events recorded on ctx's stream: time from start() to stop() in milliseconds, as the
 * GPU saw it (host launch overhead counts only if the GPU sat idle waiting for work). */
typedef struct dg_cuda_timer dg_cuda_timer;
dg_status dg__cuda_timer_new(dg_ctx *ctx, dg_cuda_timer **out);
dg_status dg__cuda_timer_start(dg_cuda_timer *t);
/* Records the stop event, waits for it, returns the elapsed time. */
dg_status dg__cuda_timer_stop(dg_cuda_timer *t, double *ms);
void dg__cuda_timer_free(dg_cuda_timer **t);

typedef struct dg_cuda_device_info {
    char name[256];
    int cc_major, cc_minor;
    int sm_count;
    double mem_gib; /* total device memory */
    int l2_mib;     /* L2 cache size */
} dg_cuda_device_info;
dg_status dg__cuda_device_info(int device, dg_cuda_device_info *out);

/* The context's cuBLAS math mode (cublasMath_t as an int), e.g. 0 = CUBLAS_DEFAULT_MATH. */
dg_status dg__cuda_cublas_math_mode(dg_ctx *ctx, int *mode);

#ifdef __cplusplus
}
#endif
#endif /* DG_KERNELS_BENCH_UTIL_CUH */
