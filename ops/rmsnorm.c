/*
 * ops/rmsnorm.c -- RMSNorm and gated RMSNorm over the last axis (as FLA's RMSNorm and
 * FusedRMSNormGated).
 *
 *   r = 1 / sqrt(mean_j x_j^2 + eps)         one r per row of D = x's last dimension
 *   y = x r w act(gate)                       w: [D] or NULL (= 1); gate: x's shape, gated only
 *   act: NONE (identity), SILU, SIGMOID
 * Backward, with xh = x r, a = act(gate), g = dy w a:
 *   dx = r (g - xh mean_j(g_j xh_j))    dw = sum over rows of dy xh a    dgate = dy xh w act'(gate)
 *
 * Shapes: x [..., D], y like x. Tape: the node saves x, w, gate and, under CACHE (the default),
 * rstd [rows] (f64 for f64 inputs, else f32); RECOMPUTE recomputes rstd in backward.
 */
#ifndef DG_REF_TMPL
#include "rmsnorm.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/norm.cuh"
#endif

#include <math.h>

typedef struct {
    double eps;
    dg_act act;
} rms_params;

#ifdef _OPENMP
#define RMS_OMP_ROWS _Pragma("omp parallel for schedule(static) if (rows * D > 32768)")
#else
#define RMS_OMP_ROWS
#endif
#define RMS_DW_COLS 64 /* columns per OpenMP task in the dw reduction */

#define DG_REF_TMPL "rmsnorm.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

/* One body for f64 and f32 (f32 computes in f32). rstd_in: the forward's r or NULL. */
static RT RF(rms_act)(dg_act a, RT g) {
    if (a == DG_ACT_SILU)
        return g * ((RT)1 / ((RT)1 + REXP(-g)));
    if (a == DG_ACT_SIGMOID)
        return (RT)1 / ((RT)1 + REXP(-g));
    return g;
}
static RT RF(rms_act_grad)(dg_act a, RT g) {
    RT s = (RT)1 / ((RT)1 + REXP(-g));
    if (a == DG_ACT_SILU)
        return s * ((RT)1 + g * ((RT)1 - s));
    if (a == DG_ACT_SIGMOID)
        return s * ((RT)1 - s);
    return (RT)1;
}
static RT RF(rms_rstd)(const RT *xr, int64_t D, RT scale, RT eps) {
    RT ss = 0;
    for (int64_t j = 0; j < D; j++)
        ss += xr[j] * xr[j];
    return (RT)1 / RSQRT(ss * scale + eps);
}
/* The gradient reaching the normalised x at column j: dy w act(gate) (w, gate: NULL for none). */
static RT RF(rms_gin)(const RT *dyr, const RT *w, const RT *gr, dg_act act, int64_t j) {
    RT g = dyr[j];
    if (w)
        g *= w[j];
    if (gr)
        g *= RF(rms_act)(act, gr[j]);
    return g;
}
void RF(dg__rmsnorm_fwd)(int64_t rows, int64_t D, RT scale, RT eps, const RT *x, const RT *w,
                         const RT *gate, dg_act act, RT *y, RT *rstd) {
    RMS_OMP_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const RT *xr = x + r * D;
        RT rs = RF(rms_rstd)(xr, D, scale, eps);
        if (rstd)
            rstd[r] = rs;
        for (int64_t j = 0; j < D; j++) {
            RT v = xr[j] * rs;
            if (w)
                v *= w[j];
            if (gate)
                v *= RF(rms_act)(act, gate[r * D + j]);
            y[r * D + j] = v;
        }
    }
}
dg_status RF(dg__rmsnorm_bwd)(int64_t rows, int64_t D, RT scale, RT eps, const RT *x, const RT *w,
                              const RT *gate, dg_act act, const RT *rstd_in, const RT *dy, RT *dx,
                              RT *dw, RT *dgate) {
    RT *rs_buf = NULL;
    const RT *rs = rstd_in;
    if (!rs) {
        rs_buf = DG_MALLOC((size_t)(rows > 0 ? rows : 1) * sizeof(RT));
        if (!rs_buf)
            return dg__err(DG_ERR_NOMEM, "rmsnorm backward: out of host memory");
        RMS_OMP_ROWS
        for (int64_t r = 0; r < rows; r++)
            rs_buf[r] = RF(rms_rstd)(x + r * D, D, scale, eps);
        rs = rs_buf;
    }
    if (dx || dgate) {
        RMS_OMP_ROWS
        for (int64_t r = 0; r < rows; r++) {
            const RT *xr = x + r * D, *dyr = dy + r * D;
            const RT *gr = gate ? gate + r * D : NULL;
            if (dx) {
                RT dot = 0;
                for (int64_t j = 0; j < D; j++)
                    dot += RF(rms_gin)(dyr, w, gr, act, j) * xr[j];
                RT m = scale * rs[r] * dot;
                for (int64_t j = 0; j < D; j++)
                    dx[r * D + j] = rs[r] * (RF(rms_gin)(dyr, w, gr, act, j) - xr[j] * rs[r] * m);
            }
            if (dgate) {
                for (int64_t j = 0; j < D; j++) {
                    RT v = dyr[j] * xr[j] * rs[r];
                    if (w)
                        v *= w[j];
                    dgate[r * D + j] = v * RF(rms_act_grad)(act, gr[j]);
                }
            }
        }
    }
    if (dw) {
        /* Column blocks in parallel, rows in order inside each: deterministic. */
        int64_t nb = (D + RMS_DW_COLS - 1) / RMS_DW_COLS;
        RMS_OMP_ROWS
        for (int64_t b = 0; b < nb; b++) {
            int64_t j0 = b * RMS_DW_COLS, j1 = j0 + RMS_DW_COLS < D ? j0 + RMS_DW_COLS : D;
            for (int64_t j = j0; j < j1; j++)
                dw[j] = 0;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = j0; j < j1; j++) {
                    RT v = dy[r * D + j] * x[r * D + j] * rs[r];
                    if (gate)
                        v *= RF(rms_act)(act, gate[r * D + j]);
                    dw[j] += v;
                }
        }
    }
    DG_FREE(rs_buf);
    return DG_OK;
}

#else

// ---- forward

static dg_status rms_backward(dg_ctx *ctx, dg_node *n);

static dg_status rms_run_fwd(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *gate, double eps,
                             dg_act act, dg_tensor *y, dg_tensor *rstd) {
    int64_t D = x->shape[x->ndim - 1], rows = D ? dg_tensor_numel(x) / D : 0;
    if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
        return dg__norm_fwd_cuda(ctx, x->dtype, rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps,
                                 dg_tensor_data(x), w ? dg_tensor_data(w) : NULL,
                                 gate ? dg_tensor_data(gate) : NULL, act, dg_tensor_data(y),
                                 rstd ? dg__f32(rstd) : NULL);
#else
        return dg__no_cuda("rmsnorm");
#endif
    }
    if (x->dtype == DG_F64)
        dg__rmsnorm_fwd_f64(rows, D, D ? 1.0 / (double)D : 0.0, eps, dg__f64(x),
                            w ? dg__f64(w) : NULL, gate ? dg__f64(gate) : NULL, act, dg__f64(y),
                            rstd ? dg__f64(rstd) : NULL);
    else
        dg__rmsnorm_fwd_f32(rows, D, D ? 1.0f / (float)D : 0.0f, (float)eps, dg__f32(x),
                            w ? dg__f32(w) : NULL, gate ? dg__f32(gate) : NULL, act, dg__f32(y),
                            rstd ? dg__f32(rstd) : NULL);
    return DG_OK;
}

static dg_status rms_impl(const char *op, const char *kind, dg_ctx *ctx, dg_tensor *x, dg_tensor *w,
                          dg_tensor *gate, int gated, double eps, dg_act act, dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "x", x));
    DG_TRY(dg__check_float(op, "x", x, ctx));
    if (x->ndim < 1)
        return dg__err(DG_ERR_SHAPE, "%s: 'x' must have at least one dimension, got %s", op,
                       dg_tensor_desc(x));
    int64_t D = x->shape[x->ndim - 1];
    if (w) {
        DG_TRY(dg__check_device(op, "w", w, ctx));
        DG_TRY(dg__check_shape(op, "w", w, 1, &D));
        DG_TRY(dg__check_same_dtype(op, "w", w, x));
    }
    if (gated) {
        if (!gate)
            return dg__err(DG_ERR_ARG, "%s: argument 'gate' is NULL (use dg_rmsnorm for no gate)",
                           op);
        DG_TRY(dg__check_device(op, "gate", gate, ctx));
        DG_TRY(dg__check_shape(op, "gate", gate, x->ndim, x->shape));
        DG_TRY(dg__check_same_dtype(op, "gate", gate, x));
        if (act != DG_ACT_NONE && act != DG_ACT_SILU && act != DG_ACT_SIGMOID)
            return dg__err(DG_ERR_ARG, "%s: act must be NONE, SILU or SIGMOID, got %d", op,
                           (int)act);
    }
    if (!(eps >= 0) || !isfinite(eps))
        return dg__err(DG_ERR_ARG, "%s: eps must be finite and >= 0, got %g", op, eps);

    dg_tensor *xc = NULL, *wc = NULL, *gc = NULL, *y = NULL, *rstd = NULL;
    dg_status s = dg__contig(ctx, x, &xc);
    if (s == DG_OK && w)
        s = dg__contig(ctx, w, &wc);
    if (s == DG_OK && gate)
        s = dg__contig(ctx, gate, &gc);
    if (s == DG_OK)
        s = dg__new_like(ctx, x, &y);
    int grad = dg__needs_grad(3, (dg_tensor *[]){x, w, gate});
    dg_policy pol = dg_policy_resolve(kind, DG_POLICY_CACHE);
    if (s == DG_OK && grad && pol == DG_POLICY_CACHE) {
        int64_t rows = D ? dg_tensor_numel(x) / D : 0;
        s = dg_tensor_new(ctx, x->dtype == DG_F64 ? DG_F64 : DG_F32, 1, &rows, &rstd);
    }
    if (s == DG_OK)
        s = rms_run_fwd(ctx, xc, wc, gc, eps, act, y, rstd);
    if (s == DG_OK && grad) {
        dg_node *n = NULL;
        s = dg__node_new(kind, DG_POLICY_CACHE, rms_backward, ctx, &n);
        if (s == DG_OK) {
            dg__node_input(n, x);
            dg__node_input(n, w);
            dg__node_input(n, gate);
            dg__node_output(n, y);
            dg__node_save(n, xc);
            dg__node_save(n, wc);
            dg__node_save(n, gc);
            dg__node_save(n, rstd);
            s = dg__node_commit_params(n, &(rms_params){.eps = eps, .act = act},
                                       sizeof(rms_params));
        }
    }
    dg_tensor_free(&xc);
    dg_tensor_free(&wc);
    dg_tensor_free(&gc);
    dg_tensor_free(&rstd);
    if (s != DG_OK)
        dg_tensor_free(&y);
    *out = y;
    return s;
}

dg_status dg_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, double eps, dg_tensor **out) {
    return rms_impl("dg_rmsnorm", "rmsnorm", ctx, x, w, NULL, 0, eps, DG_ACT_NONE, out);
}

dg_status dg_gated_rmsnorm(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *gate, double eps,
                           dg_act act, dg_tensor **out) {
    return rms_impl("dg_gated_rmsnorm", "gated_rmsnorm", ctx, x, w, gate, 1, eps, act, out);
}

// ---- backward

static dg_status rms_run_bwd(dg_ctx *ctx, const rms_params *p, dg_tensor *x, dg_tensor *w,
                             dg_tensor *gate, dg_tensor *rstd, dg_tensor *dy, dg_tensor *dx,
                             dg_tensor *dw, dg_tensor *dgate) {
    int64_t D = x->shape[x->ndim - 1], rows = D ? dg_tensor_numel(x) / D : 0;
#define RMS_PTR(t, f) ((t) ? f(t) : NULL)
    if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
        return dg__norm_bwd_cuda(ctx, x->dtype, rows, D, D ? 1.0f / (float)D : 0.0f, (float)p->eps,
                                 dg_tensor_data(x), RMS_PTR(w, dg_tensor_data),
                                 RMS_PTR(gate, dg_tensor_data), p->act, RMS_PTR(rstd, dg__f32),
                                 dg_tensor_data(dy), RMS_PTR(dx, dg_tensor_data),
                                 RMS_PTR(dw, dg_tensor_data), RMS_PTR(dgate, dg_tensor_data));
#else
        return dg__no_cuda("rmsnorm backward");
#endif
    }
    if (x->dtype == DG_F64)
        return dg__rmsnorm_bwd_f64(rows, D, D ? 1.0 / (double)D : 0.0, p->eps, dg__f64(x),
                                   RMS_PTR(w, dg__f64), RMS_PTR(gate, dg__f64), p->act,
                                   RMS_PTR(rstd, dg__f64), dg__f64(dy), RMS_PTR(dx, dg__f64),
                                   RMS_PTR(dw, dg__f64), RMS_PTR(dgate, dg__f64));
    return dg__rmsnorm_bwd_f32(rows, D, D ? 1.0f / (float)D : 0.0f, (float)p->eps, dg__f32(x),
                               RMS_PTR(w, dg__f32), RMS_PTR(gate, dg__f32), p->act,
                               RMS_PTR(rstd, dg__f32), dg__f32(dy), RMS_PTR(dx, dg__f32),
                               RMS_PTR(dw, dg__f32), RMS_PTR(dgate, dg__f32));
#undef RMS_PTR
}

static dg_status rms_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    const rms_params *p = n->params;
    dg_tensor *x = n->saved[0], *w = n->saved[1], *gate = n->saved[2], *rstd = n->saved[3];
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy)
        return DG_OK;
    dg_tensor *dy = NULL, *dx = NULL, *dw = NULL, *dg = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK && dg__node_wants_grad(n, 0))
        s = dg__new_like(c, x, &dx);
    if (s == DG_OK && dg__node_wants_grad(n, 1))
        s = dg__new_like(c, w, &dw);
    if (s == DG_OK && dg__node_wants_grad(n, 2))
        s = dg__new_like(c, gate, &dg);
    if (s == DG_OK)
        s = rms_run_bwd(c, p, x, w, gate, rstd, dy, dx, dw, dg);
    if (s == DG_OK && dx)
        s = dg__node_accum(c, n, 0, dx);
    if (s == DG_OK && dw)
        s = dg__node_accum(c, n, 1, dw);
    if (s == DG_OK && dg)
        s = dg__node_accum(c, n, 2, dg);
    dg_tensor_free(&dy);
    dg_tensor_free(&dx);
    dg_tensor_free(&dw);
    dg_tensor_free(&dg);
    return s;
}
#endif
