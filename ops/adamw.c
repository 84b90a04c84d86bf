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
 *
 * dg_adamw: the same update over a list of parameters, after clipping by the global gradient
 * norm. The CPU path is the reference: dg_global_norm, then per parameter dg_scale by the clip
 * coefficient (when below 1) and dg_adamw_step, exactly what a loop over the parameters does.
 * On CUDA (kernels/adamw.cu) a device table of the parameters (pointers, sizes, decay flags) is
 * built once; each update writes the gradient pointers into it by kernel arguments, reduces the
 * norm, computes the coefficient and updates every parameter in one launch, reading the step's lr
 * and bias corrections from device memory (written by dg_adamw_set_step). No host sync.
 */
#ifndef DG_REF_TMPL
#include "../tensor/tensor.h"

#include <math.h>
#include <stdio.h>

#include "../kernels/adamw.cuh" /* C-compatible: the scalars' layout, and the launchers */
#ifdef DG_HAVE_CUDA
#include "../kernels/cuda_api.h"
#endif

#define DG_REF_TMPL "adamw.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

static void RF(adamw)(RT *p, const RT *g, RT *m, RT *v, int64_t n, RT lr, RT b1, RT b2, RT eps,
                      RT lr_wd, RT bc1, RT bc2) {
    for (int64_t i = 0; i < n; i++) {
        RT pi = p[i] - lr_wd * p[i];
        RT mi = b1 * m[i] + (1 - b1) * g[i];
        RT vi = b2 * v[i] + (1 - b2) * g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - lr * (mi / bc1) / (RSQRT(vi / bc2) + eps);
    }
}

#else

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

// ---- AdamW over a parameter list

struct dg_adamw {
    dg_ctx *ctx;
    int n;
    dg_tensor **p, **m, **v; /* referenced */
    int *decay;
    dg_adamw_hparams hp; /* hp.lr: the lr of the step set last */
    double clip;
    int64_t step;     /* 0 until dg_adamw_set_step */
    dg_tensor *sc;    /* f64 [DG_ADAMW_NSCALARS] on ctx's device: norm, coef, lr, ... */
    dg_tensor *stats; /* view: sc[0:2] */
#ifdef DG_HAVE_CUDA
    dg_adamw_dev dev;
    void *dev_buf;
    size_t dev_bytes;
#endif
};

void dg_adamw_free(dg_adamw **opt) {
    if (!opt || !*opt)
        return;
    dg_adamw *o = *opt;
    for (int i = 0; i < o->n; i++) {
        if (o->p)
            dg_tensor_free(&o->p[i]);
        if (o->m)
            dg_tensor_free(&o->m[i]);
        if (o->v)
            dg_tensor_free(&o->v[i]);
    }
    free(o->p);
    free(o->m);
    free(o->v);
    free(o->decay);
    dg_tensor_free(&o->stats);
    dg_tensor_free(&o->sc);
#ifdef DG_HAVE_CUDA
    if (o->dev_buf)
        dg__cuda_free(o->ctx, o->dev_buf, o->dev_bytes);
#endif
    free(o);
    *opt = NULL;
}

#ifdef DG_HAVE_CUDA
static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* The device table: entries, chunk_begin, grads, gdt, partials in one allocation. */
static dg_status build_table(dg_adamw *o) {
    const int n = o->n;
    dg_adamw_entry *ent = calloc((size_t)n + 1, sizeof *ent);
    int64_t *cb = calloc((size_t)n + 1, sizeof *cb);
    dg_status s = DG_OK;
    if (!ent || !cb)
        s = dg__err(DG_ERR_NOMEM, "dg_adamw_new: out of host memory");
    for (int i = 0; s == DG_OK && i < n; i++) {
        int64_t len = dg_tensor_numel(o->p[i]);
        ent[i] = (dg_adamw_entry){
            dg__f32(o->p[i]), dg__f32(o->m[i]), dg__f32(o->v[i]), len, o->decay[i], 0};
        cb[i + 1] = cb[i] + (len + DG_ADAMW_CHUNK - 1) / DG_ADAMW_CHUNK;
    }
    dg_adamw_dev *d = &o->dev;
    d->n = n;
    d->n_chunks = cb[n];
    size_t b_ent = align256((size_t)n * sizeof *ent), b_cb = align256(((size_t)n + 1) * 8);
    size_t b_g = align256((size_t)n * sizeof(void *)), b_dt = align256((size_t)n * 4);
    size_t b_part = align256((size_t)(d->n_chunks ? d->n_chunks : 1) * sizeof(double));
    o->dev_bytes = b_ent + b_cb + b_g + b_dt + b_part;
    if (s == DG_OK)
        s = dg__cuda_malloc(o->ctx, o->dev_bytes, &o->dev_buf);
    if (s == DG_OK) {
        char *b = o->dev_buf;
        d->entries = (dg_adamw_entry *)b;
        d->chunk_begin = (int64_t *)(b + b_ent);
        d->grads = (const void **)(b + b_ent + b_cb);
        d->gdt = (int32_t *)(b + b_ent + b_cb + b_g);
        d->partials = (double *)(b + b_ent + b_cb + b_g + b_dt);
        s = dg__cuda_memcpy(o->ctx, d->entries, ent, (size_t)n * sizeof *ent, DG_COPY_H2D);
    }
    if (s == DG_OK)
        s = dg__cuda_memcpy(o->ctx, d->chunk_begin, cb, ((size_t)n + 1) * sizeof *cb, DG_COPY_H2D);
    free(ent);
    free(cb);
    return s;
}
#endif

static dg_status adamw_new(dg_adamw *o, dg_tensor *const *params, dg_tensor *const *m,
                           dg_tensor *const *v, const int *decay) {
    const char *op = "dg_adamw_new";
    dg_ctx *ctx = o->ctx;
    const int n = o->n, cuda = ctx->device.kind == DG_DEV_CUDA;
    o->p = calloc((size_t)n + 1, sizeof *o->p);
    o->m = calloc((size_t)n + 1, sizeof *o->m);
    o->v = calloc((size_t)n + 1, sizeof *o->v);
    o->decay = calloc((size_t)n + 1, sizeof *o->decay);
    if (!o->p || !o->m || !o->v || !o->decay)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    for (int i = 0; i < n; i++) {
        char arg[48];
        snprintf(arg, sizeof arg, "params[%d]", i);
        DG_TRY(dg__check_ptr(op, arg, params[i]));
        DG_TRY(dg__check_device(op, arg, params[i], ctx));
        DG_TRY(dg__check_dtype(op, arg, params[i],
                               cuda ? DG_MASK(DG_F32) : DG_MASK(DG_F32) | DG_MASK(DG_F64)));
        if (!dg_tensor_is_contiguous(params[i]))
            return dg__err(DG_ERR_ARG, "%s: '%s' %s is updated in place and must be contiguous", op,
                           arg, dg_tensor_desc(params[i]));
        snprintf(arg, sizeof arg, "m[%d]", i);
        DG_TRY(dg__check_ptr(op, arg, m[i]));
        DG_TRY(check_state(op, arg, m[i], params[i], params[i]->dtype, ctx));
        snprintf(arg, sizeof arg, "v[%d]", i);
        DG_TRY(dg__check_ptr(op, arg, v[i]));
        DG_TRY(check_state(op, arg, v[i], params[i], params[i]->dtype, ctx));
        o->p[i] = dg_tensor_retain(params[i]);
        o->m[i] = dg_tensor_retain(m[i]);
        o->v[i] = dg_tensor_retain(v[i]);
        o->decay[i] = decay ? decay[i] != 0 : 1;
    }
    int64_t len = DG_ADAMW_NSCALARS;
    DG_TRY(dg_tensor_zeros(ctx, DG_F64, 1, &len, &o->sc));
    DG_TRY(dg_slice(o->sc, 0, 0, 2, &o->stats));
    if (!cuda)
        return DG_OK;
#ifdef DG_HAVE_CUDA
    return build_table(o);
#else
    return dg__no_cuda(op);
#endif
}

dg_status dg_adamw_new(dg_ctx *ctx, int n, dg_tensor *const *params, dg_tensor *const *m,
                       dg_tensor *const *v, const int *decay, const dg_adamw_hparams *hp,
                       double clip, dg_adamw **out) {
    const char *op = "dg_adamw_new";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "hp", hp));
    if (n < 0)
        return dg__err(DG_ERR_ARG, "%s: n = %d is negative", op, n);
    if (n > 0) {
        DG_TRY(dg__check_ptr(op, "params", params));
        DG_TRY(dg__check_ptr(op, "m", m));
        DG_TRY(dg__check_ptr(op, "v", v));
    }
    if (!(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1) ||
        !(hp->eps >= 0) || !isfinite(hp->weight_decay) || !isfinite(hp->eps))
        return dg__err(DG_ERR_ARG,
                       "%s: need 0 <= beta1, beta2 < 1, eps >= 0 and a finite weight_decay; got "
                       "beta1 %g beta2 %g eps %g weight_decay %g",
                       op, hp->beta1, hp->beta2, hp->eps, hp->weight_decay);
    if (!(clip >= 0) || !isfinite(clip))
        return dg__err(DG_ERR_ARG, "%s: clip must be >= 0 and finite (0: no clipping), got %g", op,
                       clip);
    dg_adamw *o = calloc(1, sizeof *o);
    if (!o)
        return dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    o->ctx = ctx;
    o->n = n;
    o->hp = *hp;
    o->clip = clip;
    dg_status s = adamw_new(o, params, m, v, decay);
    if (s != DG_OK) {
        dg_adamw_free(&o);
        return s;
    }
    *out = o;
    return DG_OK;
}

dg_status dg_adamw_set_step(dg_adamw *o, int64_t step, double lr) {
    const char *op = "dg_adamw_set_step";
    DG_TRY(dg__check_ptr(op, "opt", o));
    if (step < 1)
        return dg__err(DG_ERR_ARG, "%s: step counts from 1, got %lld", op, (long long)step);
    if (!isfinite(lr))
        return dg__err(DG_ERR_ARG, "%s: lr must be finite, got %g", op, lr);
    o->step = step;
    o->hp.lr = lr;
    /* the values dg_adamw_step computes, in the same f64 expressions */
    const double bc1 = 1.0 - pow(o->hp.beta1, (double)step);
    const double bc2 = 1.0 - pow(o->hp.beta2, (double)step);
    const double lr_wd = lr * o->hp.weight_decay;
    if (o->ctx->device.kind != DG_DEV_CUDA) {
        double *sc = dg__f64(o->sc);
        sc[DG_ADAMW_LR] = lr;
        sc[DG_ADAMW_LR_WD] = lr_wd;
        sc[DG_ADAMW_BC1] = bc1;
        sc[DG_ADAMW_BC2] = bc2;
        return DG_OK;
    }
#ifdef DG_HAVE_CUDA
    return dg__adamw_set_step_cuda(o->ctx, dg__f64(o->sc), lr, lr_wd, bc1, bc2);
#else
    return dg__no_cuda(op);
#endif
}

/* The reference: norm, coefficient, then dg_scale + dg_adamw_step per parameter. */
static dg_status update_cpu(dg_adamw *o, const dg_tensor *const *grads) {
    double norm = 0.0;
    DG_TRY(dg_global_norm(o->ctx, grads, o->n, &norm));
    const double coef = o->clip > 0 && norm > o->clip ? o->clip / (norm + 1e-6) : 1.0;
    double *sc = dg__f64(o->sc);
    sc[DG_ADAMW_NORM] = norm;
    sc[DG_ADAMW_COEF] = coef;
    dg_status s = DG_OK;
    dg_no_grad_begin();
    for (int i = 0; i < o->n && s == DG_OK; i++) {
        const dg_tensor *g = grads[i];
        dg_tensor *scaled = NULL;
        if (g && coef < 1.0) {
            s = dg_scale(o->ctx, (dg_tensor *)g, coef, &scaled);
            g = scaled;
        }
        if (s == DG_OK)
            s = dg_adamw_step(o->ctx, o->p[i], g, o->m[i], o->v[i], o->step, &o->hp, o->decay[i]);
        dg_tensor_free(&scaled);
    }
    dg_no_grad_end();
    return s;
}

dg_status dg_adamw_update(dg_adamw *o, const dg_tensor *const *grads) {
    const char *op = "dg_adamw_update";
    DG_TRY(dg__check_ptr(op, "opt", o));
    if (o->n > 0)
        DG_TRY(dg__check_ptr(op, "grads", grads));
    if (o->step < 1)
        return dg__err(DG_ERR_STATE, "%s: no step set (call dg_adamw_set_step first)", op);
    const int cuda = o->ctx->device.kind == DG_DEV_CUDA;
    for (int i = 0; i < o->n; i++) {
        if (!grads[i])
            continue;
        char arg[48];
        snprintf(arg, sizeof arg, "grads[%d]", i);
        DG_TRY(dg__check_shape(op, arg, grads[i], o->p[i]->ndim, o->p[i]->shape));
        DG_TRY(dg__check_device(op, arg, grads[i], o->ctx));
        if (cuda)
            DG_TRY(dg__check_dtype(op, arg, grads[i], DG_MASK(DG_F32) | DG_MASK(DG_BF16)));
        else
            DG_TRY(dg__check_same_dtype(op, arg, grads[i], o->p[i]));
    }
    if (!cuda)
        return update_cpu(o, grads);
#ifdef DG_HAVE_CUDA
    /* strided gradients are copied; the copies may be freed once the update is queued (the
     * allocator hands their memory only to work queued later on the stream) */
    dg_tensor **tmp = calloc((size_t)o->n + 1, sizeof *tmp);
    const void **ptr = calloc((size_t)o->n + 1, sizeof *ptr);
    dg_dtype *dt = calloc((size_t)o->n + 1, sizeof *dt);
    dg_status s = tmp && ptr && dt ? DG_OK : dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
    for (int i = 0; i < o->n && s == DG_OK; i++) {
        if (!grads[i] || dg_tensor_numel(grads[i]) == 0) {
            dt[i] = DG_F32;
            continue;
        }
        s = dg__contig(o->ctx, (dg_tensor *)grads[i], &tmp[i]);
        if (s == DG_OK) {
            ptr[i] = dg_tensor_data(tmp[i]);
            dt[i] = tmp[i]->dtype;
        }
    }
    if (s == DG_OK)
        s = dg__adamw_set_grads_cuda(o->ctx, &o->dev, ptr, dt);
    if (s == DG_OK)
        s = dg__adamw_multi_cuda(o->ctx, &o->dev, dg__f64(o->sc), o->clip, (float)o->hp.beta1,
                                 (float)o->hp.beta2, (float)o->hp.eps);
    for (int i = 0; tmp && i < o->n; i++)
        dg_tensor_free(&tmp[i]);
    free(tmp);
    free(ptr);
    free(dt);
    return s;
#else
    return dg__no_cuda(op);
#endif
}

const dg_tensor *dg_adamw_stats(const dg_adamw *o) { return o ? o->stats : NULL; }
#endif
