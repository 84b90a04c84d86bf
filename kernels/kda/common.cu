/*
 * kernels/kda/common.cu -- the out-of-line part of common.cuh: kda_sum_parts, the deterministic
 * "sum over partials and value-head groups" reduction with which the intra, WY and recurrent
 * backward launchers (intra.cu, wy.cu, recurrent.cu) finish dq, dk, dg and dbeta. One thread per
 * output element, summing in a fixed order: the result is bitwise reproducible. Also kda_widen,
 * the f32 copy of a bf16 leaf (v, dO) for a kernel that reads only f32 (kda_cuda_dims.leaf_bf16),
 * made by the tensor layer's conversion (dg__cuda_copy_strided), and kda_qk_widen, the f32 rows of
 * q, k for a kernel that reads plain f32 (kda_cuda_dims.qk_bf16, rq, rk). And kda_identity, the
 * starting point of the KCP transition summaries (kernels/kda/state.cu, kernels/dplr/state.cu).
 */
#include "common.cuh"

using namespace kdab;

// ---- kernel

__global__ void sum_parts_kernel(float *out, const float *in, int64_t n_out, int E, int G, int P,
                                 int64_t pstride, bool acc) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_out;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t rh = i / E, e = i % E;
        const int64_t base = rh * G * E + e;
        float s = 0.f;
        for (int p = 0; p < P; p++)
            for (int g = 0; g < G; g++)
                s += in[p * pstride + base + (int64_t)g * E];
        out[i] = acc ? out[i] + s : s;
    }
}

__global__ void identity_kernel(float *I, int64_t n, int K) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i % ((int64_t)K * K);
        I[i] = r / K == r % K ? 1.f : 0.f;
    }
}

/* out[i] = x[i] r[i / K] (r NULL: 1), x f32 or bf16 */
__global__ void qk_widen_kernel(int64_t n, int K, const void *x, bool bf16, const float *r,
                                float *out) {
    const QkIn in = {x, r, bf16};
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = in.at(i, i / K);
}

// ---- launchers

dg_status kda_qk_widen(dg_ctx *ctx, const kda_cuda_dims *d, const void *q, const void *k,
                       Scratch &qs, Scratch &ks, const float **qf, const float **kf) {
    *qf = (const float *)q;
    *kf = (const float *)k;
    if (!kda_qk_special(d))
        return DG_OK;
    const int64_t n = d->TT * d->H * d->K;
    const void *src[2] = {q, k};
    const float *sc[2] = {d->rq, d->rk};
    Scratch *dst[2] = {&qs, &ks};
    const float **out[2] = {qf, kf};
    for (int i = 0; i < 2; i++) {
        if (!src[i])
            continue;
        DG_TRY(dst[i]->alloc((size_t)(n > 0 ? n : 0)));
        *out[i] = dst[i]->f();
        if (n > 0) {
            qk_widen_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(
                n, d->K, src[i], d->qk_bf16 != 0, sc[i], dst[i]->f());
            DG_CHECK_LAUNCH();
        }
    }
    return DG_OK;
}

dg_status kda_widen(dg_ctx *ctx, const kda_bf16 *in, int64_t n, Scratch &scr, const float **out) {
    DG_TRY(scr.alloc((size_t)(n > 0 ? n : 0)));
    *out = scr.f();
    dg_layout flat = {};
    flat.ndim = 1;
    flat.shape[0] = n;
    flat.stride[0] = 1;
    return dg__cuda_copy_strided(ctx, scr.f(), DG_F32, flat, in, DG_BF16, flat, n);
}

dg_status kda_narrow(dg_ctx *ctx, const float *in, int64_t n, kda_bf16 *out) {
    dg_layout flat = {};
    flat.ndim = 1;
    flat.shape[0] = n;
    flat.stride[0] = 1;
    return dg__cuda_copy_strided(ctx, out, DG_BF16, flat, in, DG_F32, flat, n);
}

dg_status kda_sum_parts(dg_ctx *ctx, float *out, const float *in, int64_t rows, int Hout, int G,
                        int E, int P, int64_t pstride, int acc) {
    const int64_t n = rows * Hout * E;
    if (n <= 0)
        return DG_OK;
    sum_parts_kernel<<<dg__blocks(n, NTH), NTH, 0, dg__stream(ctx)>>>(out, in, n, E, G, P, pstride,
                                                                      acc != 0);
    DG_CHECK_LAUNCH();
    return DG_OK;
}

dg_status kda_identity(dg_ctx *ctx, float *I, int heads, int K) {
    const int64_t n = (int64_t)heads * K * K;
    if (n == 0)
        return DG_OK;
    identity_kernel<<<dg__blocks(n, 256), 256, 0, dg__stream(ctx)>>>(I, n, K);
    DG_CHECK_LAUNCH();
    return DG_OK;
}
