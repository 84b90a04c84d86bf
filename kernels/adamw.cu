/*
 * kernels/adamw.cu -- the fused AdamW update: one pass reads p, g, m, v and writes p, m, v.
 * Elementwise, so the result does not depend on the launch shape. Math in f32; a bf16 gradient
 * is widened on load.
 *
 * The multi-tensor form (dg_adamw) runs over all parameters at once: a grid over fixed-size
 * chunks of every parameter (adamw.cuh), the gradient norm reduced per chunk and then over the
 * chunks in a fixed order, the clip coefficient and the step's lr / bias corrections read from
 * device memory. Nothing goes back to the host.
 */
#include "common.cuh"
#include "adamw.cuh"

// ---- CUDA kernels

template <typename G>
__global__ void adamw_kernel(float *p, const G *g, float *m, float *v, int64_t n, float lr,
                             float b1, float b2, float eps, float lr_wd, float bc1, float bc2) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float gi = dg_ld(g, i), pi = p[i];
        pi -= lr_wd * pi;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    }
}

// ---- kernel launchers

extern "C" dg_status dg__adamw_cuda(dg_ctx *ctx, float *param, dg_dtype gdt, const void *grad,
                                    float *m, float *v, int64_t n, float lr, float b1, float b2,
                                    float eps, float lr_wd, float bc1, float bc2) {
    if (n <= 0)
        return DG_OK;
    unsigned blocks = dg__blocks(n, 256);
    if (gdt == DG_F32)
        adamw_kernel<float><<<blocks, 256, 0, dg__stream(ctx)>>>(
            param, (const float *)grad, m, v, n, lr, b1, b2, eps, lr_wd, bc1, bc2);
    else if (gdt == DG_BF16)
        adamw_kernel<__nv_bfloat16><<<blocks, 256, 0, dg__stream(ctx)>>>(
            param, (const __nv_bfloat16 *)grad, m, v, n, lr, b1, b2, eps, lr_wd, bc1, bc2);
    else
        return dg__err(DG_ERR_DTYPE, "adamw (cuda): gradient dtype %s, expected f32 or bf16",
                       dg_dtype_name(gdt));
    DG_CHECK_LAUNCH();
    return DG_OK;
}

// ---- multi-tensor: CUDA kernels

#define MT_THREADS 256

/* Parameter owning chunk c: the last i with chunk_begin[i] <= c (empty parameters own none). */
__device__ __forceinline__ int chunk_owner(const int64_t *chunk_begin, int n, int64_t c) {
    int lo = 0, hi = n; /* chunk_begin[lo] <= c < chunk_begin[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (chunk_begin[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ float ld_grad(const void *g, int32_t dt, int64_t i) {
    return dt == DG_BF16 ? __bfloat162float(((const __nv_bfloat16 *)g)[i]) : ((const float *)g)[i];
}

/* Fixed-tree sum over the block (blockDim.x == MT_THREADS); every thread gets the result. */
__device__ double mt_block_sum(double v) {
    __shared__ double buf[MT_THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int w = MT_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            buf[threadIdx.x] += buf[threadIdx.x + w];
        __syncthreads();
    }
    double r = buf[0];
    __syncthreads(); /* buf is reused by the next call */
    return r;
}

__global__ void set_step_kernel(double *sc, double lr, double lr_wd, double bc1, double bc2) {
    sc[DG_ADAMW_LR] = lr;
    sc[DG_ADAMW_LR_WD] = lr_wd;
    sc[DG_ADAMW_BC1] = bc1;
    sc[DG_ADAMW_BC2] = bc2;
}

#define GRADS_PER_LAUNCH 128
struct grads_arg {
    const void *g[GRADS_PER_LAUNCH];
    int32_t dt[GRADS_PER_LAUNCH];
    int off, n;
};

__global__ void set_grads_kernel(const void **grads, int32_t *gdt, grads_arg a) {
    for (int i = threadIdx.x; i < a.n; i += blockDim.x) {
        grads[a.off + i] = a.g[i];
        gdt[a.off + i] = a.dt[i];
    }
}

__global__ void chunk_sumsq_kernel(dg_adamw_dev d) {
    for (int64_t c = blockIdx.x; c < d.n_chunks; c += gridDim.x) {
        int t = chunk_owner(d.chunk_begin, d.n, c);
        const void *g = d.grads[t];
        double acc = 0.0;
        if (g) {
            int64_t i0 = (c - d.chunk_begin[t]) * DG_ADAMW_CHUNK, n = d.entries[t].n;
            int64_t i1 = i0 + DG_ADAMW_CHUNK < n ? i0 + DG_ADAMW_CHUNK : n;
            for (int64_t i = i0 + threadIdx.x; i < i1; i += MT_THREADS) {
                double x = ld_grad(g, d.gdt[t], i);
                acc += x * x;
            }
        }
        double s = mt_block_sum(acc);
        if (threadIdx.x == 0)
            d.partials[c] = s;
    }
}

__global__ void norm_coef_kernel(const double *partials, int64_t n_chunks, double clip,
                                 double *sc) {
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < n_chunks; c += MT_THREADS)
        acc += partials[c];
    double total = mt_block_sum(acc);
    if (threadIdx.x == 0) {
        double norm = sqrt(total);
        sc[DG_ADAMW_NORM] = norm;
        sc[DG_ADAMW_COEF] = clip > 0.0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
    }
}

__global__ void adamw_multi_kernel(dg_adamw_dev d, const double *sc, float b1, float b2,
                                   float eps) {
    const float coef = (float)sc[DG_ADAMW_COEF], lr = (float)sc[DG_ADAMW_LR];
    const float bc1 = (float)sc[DG_ADAMW_BC1], bc2 = (float)sc[DG_ADAMW_BC2];
    for (int64_t c = blockIdx.x; c < d.n_chunks; c += gridDim.x) {
        int t = chunk_owner(d.chunk_begin, d.n, c);
        const void *g = d.grads[t];
        if (!g)
            continue;
        const int32_t gdt = d.gdt[t];
        const dg_adamw_entry e = d.entries[t];
        const float lr_wd = e.decay ? (float)sc[DG_ADAMW_LR_WD] : 0.0f;
        int64_t i0 = (c - d.chunk_begin[t]) * DG_ADAMW_CHUNK;
        int64_t i1 = i0 + DG_ADAMW_CHUNK < e.n ? i0 + DG_ADAMW_CHUNK : e.n;
        for (int64_t i = i0 + threadIdx.x; i < i1; i += MT_THREADS) {
            float gi = coef * ld_grad(g, gdt, i), pi = e.p[i];
            pi -= lr_wd * pi;
            float mi = b1 * e.m[i] + (1.0f - b1) * gi;
            float vi = b2 * e.v[i] + (1.0f - b2) * gi * gi;
            e.m[i] = mi;
            e.v[i] = vi;
            e.p[i] = pi - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        }
    }
}

// ---- multi-tensor: kernel launchers

extern "C" dg_status dg__adamw_set_step_cuda(dg_ctx *ctx, double *sc, double lr, double lr_wd,
                                             double bc1, double bc2) {
    set_step_kernel<<<1, 1, 0, dg__stream(ctx)>>>(sc, lr, lr_wd, bc1, bc2);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

extern "C" dg_status dg__adamw_set_grads_cuda(dg_ctx *ctx, const dg_adamw_dev *d,
                                              const void *const *grads, const dg_dtype *gdt) {
    for (int off = 0; off < d->n; off += GRADS_PER_LAUNCH) {
        grads_arg a;
        memset(&a, 0, sizeof a);
        a.off = off;
        a.n = d->n - off < GRADS_PER_LAUNCH ? d->n - off : GRADS_PER_LAUNCH;
        for (int i = 0; i < a.n; i++) {
            a.g[i] = grads[off + i];
            a.dt[i] = (int32_t)gdt[off + i];
        }
        set_grads_kernel<<<1, GRADS_PER_LAUNCH, 0, dg__stream(ctx)>>>(d->grads, d->gdt, a);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}

extern "C" dg_status dg__adamw_multi_cuda(dg_ctx *ctx, const dg_adamw_dev *d, double *sc,
                                          double clip, float b1, float b2, float eps) {
    cudaStream_t st = dg__stream(ctx);
    /* a fixed grid for a given parameter list: the norm's reduction order depends only on it */
    unsigned blocks = dg__blocks(d->n_chunks, 1);
    if (d->n_chunks > 0) {
        chunk_sumsq_kernel<<<blocks, MT_THREADS, 0, st>>>(*d);
        DG_CHECK_LAUNCH();
    }
    norm_coef_kernel<<<1, MT_THREADS, 0, st>>>(d->partials, d->n_chunks, clip, sc);
    DG_CHECK_LAUNCH();
    if (d->n_chunks > 0) {
        adamw_multi_kernel<<<blocks, MT_THREADS, 0, st>>>(*d, sc, b1, b2, eps);
        DG_CHECK_LAUNCH();
    }
    return DG_OK;
}
