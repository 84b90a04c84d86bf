/*
 * kernels/adamw.cu -- the fused AdamW update: one pass reads p, g, m, v and writes p, m, v.
 * Elementwise, so the result does not depend on the launch shape. Math in f32; a bf16 gradient
 * is widened on load.
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
