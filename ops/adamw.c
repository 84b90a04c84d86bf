/*
 * ops/adamw.c -- dg_adamw_step: one AdamW update in place (not recorded on the tape).
 *
 *   p -= lr * wd * p                                     (decoupled decay; skipped if decay == 0)
 *   m  = b1 m + (1 - b1) g,     v = b2 v + (1 - b2) g^2
 *   p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
 *
 * Shapes: param, grad, m, v all alike. CPU: f64 params (grad, m, v f64) or f32 params (grad, m,
 * v f32), the math in the params' dtype. CUDA: f32 params, m, v; grad f32 or bf16. The bias
 * corrections 1 - b^step are computed once in f64 on the host. param, m and v are updated in
 * place and must be contiguous; a strided grad is copied first. Elementwise, so deterministic.
 */
#include "../tensor/tensor.h"

#include <math.h>

#ifdef DG_HAVE_CUDA
#include "../kernels/adamw.cuh"
#endif

// ---- reference

#define ADAMW_DEFINE(T, SUF, SQRT)                                                                 \
    static void adamw_##SUF(T *p, const T *g, T *m, T *v, int64_t n, T lr, T b1, T b2, T eps,      \
                            T lr_wd, T bc1, T bc2) {                                               \
        for (int64_t i = 0; i < n; i++) {                                                          \
            T pi = p[i] - lr_wd * p[i];                                                            \
            T mi = b1 * m[i] + (1 - b1) * g[i];                                                    \
            T vi = b2 * v[i] + (1 - b2) * g[i] * g[i];                                             \
            m[i] = mi;                                                                             \
            v[i] = vi;                                                                             \
            p[i] = pi - lr * (mi / bc1) / (SQRT(vi / bc2) + eps);                                  \
        }                                                                                          \
    }
ADAMW_DEFINE(double, f64, sqrt)
ADAMW_DEFINE(float, f32, sqrtf)

// ---- the step

static dg_status check_state(const char *op, const char *arg, const dg_tensor *t,
                             const dg_tensor *param, dg_dtype want, dg_ctx *ctx) {
    DG_TRY(dg__check_shape(op, arg, t, param->ndim, param->shape));
    DG_TRY(dg__check_device(op, arg, t, ctx));
    if (t->dtype != want)
        return dg__err(DG_ERR_DTYPE, "%s: '%s' must be %s for %s params, got %s", op, arg,
                       dg_dtype_name(want), dg_dtype_name(param->dtype), dg_tensor_desc(t));
    if (!dg_tensor_is_contiguous(t))
        return dg__err(DG_ERR_ARG, "%s: '%s' %s is updated in place and must be contiguous", op,
                       arg, dg_tensor_desc(t));
    return DG_OK;
}

dg_status dg_adamw_step(dg_ctx *ctx, dg_tensor *param, const dg_tensor *grad, dg_tensor *m,
                        dg_tensor *v, int64_t step, const dg_adamw_hparams *hp, int decay) {
    const char *op = "dg_adamw_step";
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "param", param));
    DG_TRY(dg__check_ptr(op, "m", m));
    DG_TRY(dg__check_ptr(op, "v", v));
    DG_TRY(dg__check_ptr(op, "hp", hp));
    if (!grad)
        return DG_OK;
    if (step < 1)
        return dg__err(DG_ERR_ARG, "%s: step counts from 1, got %lld", op, (long long)step);
    if (!(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1) ||
        !(hp->eps >= 0) || !isfinite(hp->lr) || !isfinite(hp->weight_decay) || !isfinite(hp->eps))
        return dg__err(DG_ERR_ARG,
                       "%s: need 0 <= beta1, beta2 < 1, eps >= 0 and finite lr, weight_decay; got "
                       "lr %g beta1 %g beta2 %g eps %g weight_decay %g",
                       op, hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay);
    DG_TRY(dg__check_device(op, "param", param, ctx));
    const int cuda = param->device.kind == DG_DEV_CUDA;
    DG_TRY(dg__check_dtype(op, "param", param,
                           cuda ? DG_MASK(DG_F32) : DG_MASK(DG_F32) | DG_MASK(DG_F64)));
    if (!dg_tensor_is_contiguous(param))
        return dg__err(DG_ERR_ARG, "%s: 'param' %s is updated in place and must be contiguous", op,
                       dg_tensor_desc(param));
    DG_TRY(check_state(op, "m", m, param, param->dtype, ctx));
    DG_TRY(check_state(op, "v", v, param, param->dtype, ctx));
    DG_TRY(dg__check_shape(op, "grad", grad, param->ndim, param->shape));
    DG_TRY(dg__check_device(op, "grad", grad, ctx));
    if (cuda)
        DG_TRY(dg__check_dtype(op, "grad", grad, DG_MASK(DG_F32) | DG_MASK(DG_BF16)));
    else
        DG_TRY(dg__check_same_dtype(op, "grad", grad, param));
#ifndef DG_HAVE_CUDA
    if (cuda)
        return dg__no_cuda(op);
#endif

    const double bc1 = 1.0 - pow(hp->beta1, (double)step), bc2 = 1.0 - pow(hp->beta2, (double)step);
    const double lr_wd = decay ? hp->lr * hp->weight_decay : 0.0;
    const int64_t n = dg_tensor_numel(param);
    dg_tensor *g = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)grad, &g));
    dg_status s = DG_OK;
    if (!cuda && param->dtype == DG_F64) {
        adamw_f64(dg__f64(param), dg__f64(g), dg__f64(m), dg__f64(v), n, hp->lr, hp->beta1,
                  hp->beta2, hp->eps, lr_wd, bc1, bc2);
    } else if (!cuda) {
        adamw_f32(dg__f32(param), dg__f32(g), dg__f32(m), dg__f32(v), n, (float)hp->lr,
                  (float)hp->beta1, (float)hp->beta2, (float)hp->eps, (float)lr_wd, (float)bc1,
                  (float)bc2);
    } else {
#ifdef DG_HAVE_CUDA
        s = dg__adamw_cuda(ctx, dg__f32(param), g->dtype, dg_tensor_data(g), dg__f32(m), dg__f32(v),
                           n, (float)hp->lr, (float)hp->beta1, (float)hp->beta2, (float)hp->eps,
                           (float)lr_wd, (float)bc1, (float)bc2);
#endif
    }
    dg_tensor_free(&g);
    return s;
}
