/*
 * kernels/bench_util.cu -- see bench_util.cuh: event timer, device info, cuBLAS math mode.
 */
#include "common.cuh"
#include "bench_util.cuh"

#include <stdlib.h>
#include <stdio.h>
#include <string.h>

struct dg_cuda_timer {
    dg_ctx *ctx;
    cudaEvent_t start, stop;
};

extern "C" dg_status dg__cuda_timer_new(dg_ctx *ctx, dg_cuda_timer **out) {
    *out = NULL;
    dg_cuda_timer *t = (dg_cuda_timer *)calloc(1, sizeof *t);
    if (!t)
        return dg__err(DG_ERR_NOMEM, "cuda timer: out of host memory");
    t->ctx = ctx;
    cudaError_t e = cudaEventCreate(&t->start);
    if (e == cudaSuccess) {
        e = cudaEventCreate(&t->stop);
        if (e != cudaSuccess)
            cudaEventDestroy(t->start);
    }
    if (e != cudaSuccess) {
        free(t);
        return dg__err(DG_ERR_CUDA, "cuda timer: cudaEventCreate failed: %s",
                       cudaGetErrorString(e));
    }
    *out = t;
    return DG_OK;
}

extern "C" dg_status dg__cuda_timer_start(dg_cuda_timer *t) {
    DG_CHECK_CUDA(cudaEventRecord(t->start, dg__stream(t->ctx)));
    return DG_OK;
}

extern "C" dg_status dg__cuda_timer_stop(dg_cuda_timer *t, double *ms) {
    DG_CHECK_CUDA(cudaEventRecord(t->stop, dg__stream(t->ctx)));
    DG_CHECK_CUDA(cudaEventSynchronize(t->stop));
    float f = 0;
    DG_CHECK_CUDA(cudaEventElapsedTime(&f, t->start, t->stop));
    *ms = f;
    return DG_OK;
}

extern "C" void dg__cuda_timer_free(dg_cuda_timer **t) {
    if (!t || !*t)
        return;
    cudaEventDestroy((*t)->start);
    cudaEventDestroy((*t)->stop);
    free(*t);
    *t = NULL;
}

extern "C" dg_status dg__cuda_device_info(int device, dg_cuda_device_info *out) {
    memset(out, 0, sizeof *out);
    cudaDeviceProp p;
    DG_CHECK_CUDA(cudaGetDeviceProperties(&p, device));
    snprintf(out->name, sizeof out->name, "%.*s", (int)sizeof p.name, p.name);
    out->cc_major = p.major;
    out->cc_minor = p.minor;
    out->sm_count = p.multiProcessorCount;
    out->mem_gib = (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0);
    out->l2_mib = p.l2CacheSize / (1024 * 1024);
    return DG_OK;
}

extern "C" dg_status dg__cuda_cublas_math_mode(dg_ctx *ctx, int *mode) {
    cublasMath_t m;
    DG_CHECK_CUBLAS(cublasGetMathMode(dg__cublas(ctx), &m));
    *mode = (int)m;
    return DG_OK;
}
