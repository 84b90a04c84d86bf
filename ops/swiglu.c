/*
 * ops/swiglu.c -- SwiGLU, the gated MLP activation (Shazeer 2020, "GLU Variants Improve
 * Transformer").
 *
 *   y = silu(gate) up,               silu(g) = g s,  s = sigmoid(g)
 *   dgate = dy up s (1 + g (1 - s))   dup = dy silu(gate)
 *
 * Shapes: gate, up: the same shape (any), y like them. Tape: saves gate and up (nothing else is
 * worth keeping: s is one exp per element to recompute).
 *
 * dg_swiglu_linear fuses the product with the linear layer that reads it (the MLP's down
 * projection): out = y W^T, one tape node "swiglu_linear". Under RECOMPUTE (its default) the node
 * keeps gate, up and W, and backward forms y again for dW = dout^T y: the MLP's widest
 * activation is never kept between forward and backward. Under CACHE it keeps y as well.
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"
#include "linear.h"
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

// ---- dispatch (contiguous buffers of n elements, the device and dtype of `like`)

static dg_status swiglu_run_fwd(dg_ctx *ctx, const dg_tensor *like, int64_t n, dg_tensor *gate,
                                dg_tensor *up, dg_tensor *y) {
    if (dg__is_cuda(like)) {
#ifdef DG_HAVE_CUDA
        return dg__swiglu_fwd_cuda(ctx, like->dtype, n, dg_tensor_data(gate), dg_tensor_data(up),
                                   dg_tensor_data(y));
#else
        (void)ctx;
        return dg__no_cuda("swiglu");
#endif
    }
    (void)ctx;
    if (like->dtype == DG_F64)
        swiglu_fwd_f64(n, dg__f64(gate), dg__f64(up), dg__f64(y));
    else
        swiglu_fwd_f32(n, dg__f32(gate), dg__f32(up), dg__f32(y));
    return DG_OK;
}

/* dgate, dup: NULL to skip */
static dg_status swiglu_run_bwd(dg_ctx *ctx, const dg_tensor *like, int64_t n, dg_tensor *gate,
                                dg_tensor *up, dg_tensor *dy, dg_tensor *dg, dg_tensor *du) {
    if (dg__is_cuda(like)) {
#ifdef DG_HAVE_CUDA
        return dg__swiglu_bwd_cuda(ctx, like->dtype, n, dg_tensor_data(gate), dg_tensor_data(up),
                                   dg_tensor_data(dy), dg ? dg_tensor_data(dg) : NULL,
                                   du ? dg_tensor_data(du) : NULL);
#else
        (void)ctx;
        return dg__no_cuda("swiglu backward");
#endif
    }
    (void)ctx;
    if (like->dtype == DG_F64)
        swiglu_bwd_f64(n, dg__f64(gate), dg__f64(up), dg__f64(dy), dg ? dg__f64(dg) : NULL,
                       du ? dg__f64(du) : NULL);
    else
        swiglu_bwd_f32(n, dg__f32(gate), dg__f32(up), dg__f32(dy), dg ? dg__f32(dg) : NULL,
                       du ? dg__f32(du) : NULL);
    return DG_OK;
}

// ---- forward

static dg_status swiglu_backward(dg_ctx *ctx, dg_node *n);

/* The arguments both ops share: out, ctx, and gate and up of one float shape and dtype. */
static dg_status swiglu_check(const char *op, dg_ctx *ctx, const dg_tensor *gate,
                              const dg_tensor *up, dg_tensor **out) {
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "gate", gate));
    DG_TRY(dg__check_float(op, "gate", gate, ctx));
    DG_TRY(dg__check_ptr(op, "up", up));
    DG_TRY(dg__check_device(op, "up", up, ctx));
    DG_TRY(dg__check_shape(op, "up", up, gate->ndim, gate->shape));
    return dg__check_same_dtype(op, "up", up, gate);
}

/* y = swiglu(gate, up) (new, contiguous); *gc, *uc: the contiguous inputs it was formed from
 * (what a node saves). On failure nothing is left. */
static dg_status swiglu_forward(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor **gc,
                                dg_tensor **uc, dg_tensor **y) {
    *gc = *uc = *y = NULL;
    dg_status s = dg__contig(ctx, gate, gc);
    if (s == DG_OK)
        s = dg__contig(ctx, up, uc);
    if (s == DG_OK)
        s = dg__new_like(ctx, gate, y);
    if (s == DG_OK)
        s = swiglu_run_fwd(ctx, gate, dg_tensor_numel(gate), *gc, *uc, *y);
    if (s != DG_OK) {
        dg_tensor_free(gc);
        dg_tensor_free(uc);
        dg_tensor_free(y);
    }
    return s;
}

dg_status dg_swiglu(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor **out) {
    DG_TRY(swiglu_check("dg_swiglu", ctx, gate, up, out));
    dg_tensor *gc = NULL, *uc = NULL, *y = NULL;
    dg_status s = swiglu_forward(ctx, gate, up, &gc, &uc, &y);
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

/* The gradients of gate and up (inputs 0 and 1 of node n, as wanted) from dy = the gradient of
 * silu(gate) * up, added to the node's inputs. Shared by swiglu and swiglu_linear. */
static dg_status swiglu_grads(dg_ctx *c, dg_node *n, dg_tensor *gate, dg_tensor *up,
                              dg_tensor *dy) {
    dg_tensor *dg = NULL, *du = NULL;
    dg_status s = DG_OK;
    if (dg__node_wants_grad(n, 0))
        s = dg__new_like(c, gate, &dg);
    if (s == DG_OK && dg__node_wants_grad(n, 1))
        s = dg__new_like(c, up, &du);
    if (s == DG_OK && (dg || du))
        s = swiglu_run_bwd(c, gate, dg_tensor_numel(gate), gate, up, dy, dg, du);
    if (s == DG_OK && dg)
        s = dg__node_accum(c, n, 0, dg);
    if (s == DG_OK && du)
        s = dg__node_accum(c, n, 1, du);
    dg_tensor_free(&dg);
    dg_tensor_free(&du);
    return s;
}

static dg_status swiglu_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    dg_tensor *gate = n->saved[0], *up = n->saved[1];
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy)
        return DG_OK;
    dg_tensor *dy = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK)
        s = swiglu_grads(c, n, gate, up, dy);
    dg_tensor_free(&dy);
    return s;
}

// ---- swiglu_linear: out = swiglu(gate, up) W^T

static dg_status swiglu_linear_backward(dg_ctx *ctx, dg_node *n);

dg_status dg_swiglu_linear(dg_ctx *ctx, dg_tensor *gate, dg_tensor *up, dg_tensor *w,
                           dg_tensor **out) {
    const char *op = "dg_swiglu_linear";
    DG_TRY(swiglu_check(op, ctx, gate, up, out));
    DG_TRY(dg__check_ptr(op, "w", w));
    DG_TRY(dg__linear_check(op, ctx, "gate", gate, w));

    dg_tensor *gc = NULL, *uc = NULL, *y = NULL, *o = NULL;
    dg_status s = swiglu_forward(ctx, gate, up, &gc, &uc, &y);
    if (s == DG_OK)
        s = dg__linear_y(ctx, y, w, &o);
    if (s == DG_OK && dg__needs_grad(3, (dg_tensor *[]){gate, up, w})) {
        dg_node *nd = NULL;
        s = dg__node_new("swiglu_linear", DG_POLICY_RECOMPUTE, swiglu_linear_backward, ctx, &nd);
        if (s == DG_OK) {
            const int cache = nd->policy == DG_POLICY_CACHE && dg_tensor_requires_grad(w);
            dg__node_input(nd, gate);
            dg__node_input(nd, up);
            dg__node_input(nd, w);
            dg__node_output(nd, o);
            dg__node_save(nd, gc);
            dg__node_save(nd, uc);
            dg__node_save(nd, w);
            dg__node_save(nd, cache ? y : NULL); /* dW's operand, kept or formed again */
            s = dg__node_commit(nd);
        }
    }
    dg_tensor_free(&gc);
    dg_tensor_free(&uc);
    dg_tensor_free(&y);
    if (s != DG_OK)
        dg_tensor_free(&o);
    *out = o;
    return s;
}

static dg_status swiglu_linear_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx;
    dg_ctx *c = n->ctx;
    dg_tensor *gate = n->saved[0], *up = n->saved[1], *w = n->saved[2];
    dg_tensor *gy = (dg_tensor *)dg__node_grad_out(n, 0);
    const int want_g = dg__node_wants_grad(n, 0), want_u = dg__node_wants_grad(n, 1);
    const int want_w = dg__node_wants_grad(n, 2);
    const int64_t cnt = dg_tensor_numel(gate);
    dg_tensor *y = n->saved[3] ? dg_tensor_retain(n->saved[3]) : NULL;
    dg_tensor *dy = NULL, *dw = NULL;
    dg_status s = DG_OK;
    if (want_w && !y) { /* RECOMPUTE: the product again, as forward formed it */
        s = dg__new_like(c, gate, &y);
        if (s == DG_OK)
            s = swiglu_run_fwd(c, gate, cnt, gate, up, y);
    }
    if (s == DG_OK)
        s = dg__linear_grads(c, gy, y, w, NULL, want_g || want_u ? &dy : NULL, want_w ? &dw : NULL);
    dg_tensor_free(&y); /* before the product's own gradients are allocated */
    if (s == DG_OK && dw)
        s = dg__node_accum(c, n, 2, dw);
    dg_tensor_free(&dw);
    if (s == DG_OK && dy) /* the product's own gradients, after y is freed */
        s = swiglu_grads(c, n, gate, up, dy);
    dg_tensor_free(&dy);
    return s;
}
#endif
