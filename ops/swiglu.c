/*
 * ops/swiglu.c -- SwiGLU, the gated MLP activation (Shazeer 2020, "GLU Variants Improve
 * Transformer").
 *
 *   y = silu(gate) up,               silu(g) = g s,  s = sigmoid(g)
 *   dgate = dy up s (1 + g (1 - s))   dup = dy silu(gate)
 *
 * Shapes: gate, up: the same shape (any), y like them. Tape: saves gate and up (nothing else is
 * worth keeping: s is one exp per element to recompute).
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/swiglu.cuh"
#endif

#include <math.h>

#ifdef _OPENMP
#define SWIGLU_OMP_FOR _Pragma("omp parallel for schedule(static) if (n > 65536)")
#else
#define SWIGLU_OMP_FOR
#endif

#define DG_REF_TMPL "swiglu.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

/* One body for f64 and f32 (f32 computes in f32); same arithmetic order as the CUDA kernels. */
static void RF(swiglu_fwd)(int64_t n, const RT *gate, const RT *up, RT *y) {
    SWIGLU_OMP_FOR
    for (int64_t i = 0; i < n; i++) {
        RT g = gate[i], s = (RT)1 / ((RT)1 + REXP(-g));
        y[i] = g * s * up[i];
    }
}
static void RF(swiglu_bwd)(int64_t n, const RT *gate, const RT *up, const RT *dy, RT *dgate,
                           RT *dup) {
    SWIGLU_OMP_FOR
    for (int64_t i = 0; i < n; i++) {
        RT g = gate[i], s = (RT)1 / ((RT)1 + REXP(-g)), d = dy[i];
        if (dgate)
            dgate[i] = d * up[i] * (s * ((RT)1 + g * ((RT)1 - s)));
        if (dup)
            dup[i] = d * (g * s);
    }
}

#else

// ---- forward

static dg_status swiglu_backward(dg_ctx *ctx, dg_node *n);

static dg_status swiglu_check(const char *op, const char *arg, const dg_tensor *t,
                              const dg_ctx *ctx) {
    DG_TRY(dg__check_ptr(op, arg, t));
    return dg__check_float(op, arg, t, ctx);
}

dg_status dg_swiglu(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor **out) {
    const char *op = "dg_swiglu";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(swiglu_check(op, "gate", gate, ctx));
    DG_TRY(dg__check_ptr(op, "up", up));
    DG_TRY(dg__check_device(op, "up", up, ctx));
    DG_TRY(dg__check_shape(op, "up", up, gate->ndim, gate->shape));
    DG_TRY(dg__check_same_dtype(op, "up", up, gate));

    int64_t n = dg_tensor_numel(gate);
    dg_tensor *gc = NULL, *uc = NULL, *y = NULL;
    dg_status s = dg__contig(ctx, gate, &gc);
    if (s == DG_OK)
        s = dg__contig(ctx, up, &uc);
    if (s == DG_OK)
        s = dg__new_like(ctx, gate, &y);
    if (s == DG_OK) {
        if (dg__is_cuda(gate)) {
#ifdef DG_HAVE_CUDA
            s = dg__swiglu_fwd_cuda(ctx, gate->dtype, n, dg_tensor_data(gc), dg_tensor_data(uc),
                                    dg_tensor_data(y));
#else
            s = dg__no_cuda(op);
#endif
        } else if (gate->dtype == DG_F64) {
            swiglu_fwd_f64(n, dg__f64(gc), dg__f64(uc), dg__f64(y));
        } else {
            swiglu_fwd_f32(n, dg__f32(gc), dg__f32(uc), dg__f32(y));
        }
    }
    if (s == DG_OK && dg__needs_grad(2, (dg_tensor *[]){gate, up})) {
        dg_node *nd = NULL;
        s = dg__node_new("swiglu", DG_POLICY_CACHE, swiglu_backward, ctx, &nd);
        if (s == DG_OK) {
            dg__node_input(nd, gate);
            dg__node_input(nd, up);
            dg__node_output(nd, y);
            dg__node_save(nd, gc);
            dg__node_save(nd, uc);
            s = dg__node_commit(nd);
        }
    }
    dg_tensor_free(&gc);
    dg_tensor_free(&uc);
    if (s != DG_OK)
        dg_tensor_free(&y);
    *out = y;
    return s;
}

// ---- backward

static dg_status swiglu_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    dg_tensor *gate = n->saved[0], *up = n->saved[1];
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy)
        return DG_OK;
    int64_t cnt = dg_tensor_numel(gate);
    dg_tensor *dy = NULL, *dg = NULL, *du = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK && dg__node_wants_grad(n, 0))
        s = dg__new_like(c, gate, &dg);
    if (s == DG_OK && dg__node_wants_grad(n, 1))
        s = dg__new_like(c, up, &du);
    if (s == DG_OK) {
        if (dg__is_cuda(gate)) {
#ifdef DG_HAVE_CUDA
            s = dg__swiglu_bwd_cuda(c, gate->dtype, cnt, dg_tensor_data(gate), dg_tensor_data(up),
                                    dg_tensor_data(dy), dg ? dg_tensor_data(dg) : NULL,
                                    du ? dg_tensor_data(du) : NULL);
#else
            s = dg__no_cuda("swiglu backward");
#endif
        } else if (gate->dtype == DG_F64) {
            swiglu_bwd_f64(cnt, dg__f64(gate), dg__f64(up), dg__f64(dy), dg ? dg__f64(dg) : NULL,
                           du ? dg__f64(du) : NULL);
        } else {
            swiglu_bwd_f32(cnt, dg__f32(gate), dg__f32(up), dg__f32(dy), dg ? dg__f32(dg) : NULL,
                           du ? dg__f32(du) : NULL);
        }
    }
    if (s == DG_OK && dg)
        s = dg__node_accum(c, n, 0, dg);
    if (s == DG_OK && du)
        s = dg__node_accum(c, n, 1, du);
    dg_tensor_free(&dy);
    dg_tensor_free(&dg);
    dg_tensor_free(&du);
    return s;
}
#endif
