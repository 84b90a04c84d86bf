/*
 * ops/unary.c -- elementwise exp, log, sigmoid, softplus and silu, with their backward.
 *
 *   exp       y = e^x                            dx = dy * y
 *   log       y = log x                          dx = dy / x        (x <= 0 gives -inf/NaN)
 *   sigmoid   y = 1 / (1 + e^-x)                 dx = dy * y (1 - y)
 *   softplus  y = max(x,0) + log1p(e^-|x|)       dx = dy * sigmoid(x)
 *   silu      y = x sigmoid(x)                   dx = dy * s (1 + x (1 - s)),  s = sigmoid(x)
 *
 * Shapes: y and dx have x's shape. sigmoid is evaluated as 1/(1+e^-x) for x >= 0 and e^x/(1+e^x)
 * below, and softplus as written, so no intermediate overflows for any finite x.
 * Saved for backward: exp and sigmoid keep their output y (CACHE, the default) or their input x
 * (RECOMPUTE: y is recomputed in backward); log, softplus and silu keep x.
 */
#include "../autograd/tape.h"
#include "../kernels/elementwise.cuh"
#include "elementwise.h"

#include <tgmath.h> /* exp, log, ... pick the float or double version from the argument */

static const char *const k_op_name[] = {"dg_exp", "dg_log", "dg_sigmoid", "dg_softplus", "dg_silu"};
static const char *const k_node_kind[] = {"exp", "log", "sigmoid", "softplus", "silu"};

/* ---- reference (CPU) ---------------------------------------------------------------------- */

#ifdef _OPENMP
#define DG_PRAGMA(x) _Pragma(#x)
#define DG_OMP_FOR(cond) DG_PRAGMA(omp parallel for if (cond))
#else
#define DG_OMP_FOR(cond)
#endif

/* One body for T = double and float; f32 stays f32 (tgmath picks expf etc.; constants are cast
 * to T so that nothing is promoted to double). */
#define DEFINE_UNARY_CPU(T)                                                                        \
    static inline T sigmoid_##T(T x) {                                                             \
        T e = exp(-fabs(x));                                                                       \
        return x >= 0 ? 1 / (1 + e) : e / (1 + e);                                                 \
    }                                                                                              \
    static inline T unary_f_##T(dg_unary_kind kind, T x) {                                         \
        switch (kind) {                                                                            \
        case DG_UNARY_EXP:                                                                         \
            return exp(x);                                                                         \
        case DG_UNARY_LOG:                                                                         \
            return log(x);                                                                         \
        case DG_UNARY_SIGMOID:                                                                     \
            return sigmoid_##T(x);                                                                 \
        case DG_UNARY_SOFTPLUS:                                                                    \
            return fmax(x, (T)0) + log1p(exp(-fabs(x)));                                           \
        case DG_UNARY_SILU:                                                                        \
            return x * sigmoid_##T(x);                                                             \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
    /* dy * f'(x) from v = x, or from v = y = f(x) when from_output (exp, sigmoid) */              \
    static inline T unary_df_##T(dg_unary_kind kind, T dy, T v, int from_output) {                 \
        T s;                                                                                       \
        switch (kind) {                                                                            \
        case DG_UNARY_EXP:                                                                         \
            return dy * (from_output ? v : exp(v));                                                \
        case DG_UNARY_LOG:                                                                         \
            return dy / v;                                                                         \
        case DG_UNARY_SIGMOID:                                                                     \
            s = from_output ? v : sigmoid_##T(v);                                                  \
            return dy * s * (1 - s);                                                               \
        case DG_UNARY_SOFTPLUS:                                                                    \
            return dy * sigmoid_##T(v);                                                            \
        case DG_UNARY_SILU:                                                                        \
            s = sigmoid_##T(v);                                                                    \
            return dy * s * (1 + v * (1 - s));                                                     \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
    static void unary_fwd_cpu_##T(dg_unary_kind kind, const T *x, T *y, int64_t n) {               \
        DG_OMP_FOR(n > 32768)                                                                      \
        for (int64_t i = 0; i < n; i++)                                                            \
            y[i] = unary_f_##T(kind, x[i]);                                                        \
    }                                                                                              \
    static void unary_bwd_cpu_##T(dg_unary_kind kind, const T *dy, const T *v, int from_output,    \
                                  T *dx, int64_t n) {                                              \
        DG_OMP_FOR(n > 32768)                                                                      \
        for (int64_t i = 0; i < n; i++)                                                            \
            dx[i] = unary_df_##T(kind, dy[i], v[i], from_output);                                  \
    }

DEFINE_UNARY_CPU(double)
DEFINE_UNARY_CPU(float)

/* ---- compute (not recorded) --------------------------------------------------------------- */

/* y = f(x), x contiguous */
static dg_status unary_fwd(dg_ctx *ctx, dg_unary_kind kind, const dg_tensor *x, dg_tensor **y) {
    DG_TRY(dg__new_like(ctx, x, y));
    int64_t n = dg_tensor_numel(x);
    dg_status s = DG_OK;
    if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
        s = dg__unary_fwd_cuda(ctx, kind, x->dtype, dg_tensor_data(*y), dg_tensor_data(x), n);
#else
        s = dg__no_cuda(k_op_name[kind]);
#endif
    } else if (x->dtype == DG_F64) {
        unary_fwd_cpu_double(kind, dg_tensor_data(x), dg_tensor_data(*y), n);
    } else {
        unary_fwd_cpu_float(kind, dg_tensor_data(x), dg_tensor_data(*y), n);
    }
    if (s != DG_OK)
        dg_tensor_free(y);
    return s;
}

/* dx = dy * f'(x); dy and saved contiguous */
static dg_status unary_bwd(dg_ctx *ctx, dg_unary_kind kind, const dg_tensor *dy,
                           const dg_tensor *saved, int from_output, dg_tensor **dx) {
    DG_TRY(dg__new_like(ctx, saved, dx));
    int64_t n = dg_tensor_numel(saved);
    dg_status s = DG_OK;
    if (dg__is_cuda(saved)) {
#ifdef DG_HAVE_CUDA
        s = dg__unary_bwd_cuda(ctx, kind, saved->dtype, dg_tensor_data(*dx), dg_tensor_data(dy),
                               dg_tensor_data(saved), from_output, n);
#else
        s = dg__no_cuda(k_op_name[kind]);
#endif
    } else if (saved->dtype == DG_F64) {
        unary_bwd_cpu_double(kind, dg_tensor_data(dy), dg_tensor_data(saved), from_output,
                             dg_tensor_data(*dx), n);
    } else {
        unary_bwd_cpu_float(kind, dg_tensor_data(dy), dg_tensor_data(saved), from_output,
                            dg_tensor_data(*dx), n);
    }
    if (s != DG_OK)
        dg_tensor_free(dx);
    return s;
}

/* ---- forward ------------------------------------------------------------------------------ */

typedef struct {
    dg_unary_kind kind;
    int from_output; /* saved[0] is y rather than x */
} unary_params;

static dg_status unary_backward(dg_ctx *ctx, dg_node *n);

static dg_status unary_op(dg_unary_kind kind, dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    const char *op = k_op_name[kind];
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "a", a));
    DG_TRY(dg__check_device(op, "a", a, ctx));
    DG_TRY(dg__check_float_dtype(op, "a", a));

    dg_tensor *x = NULL; /* a, or a contiguous copy of a strided view */
    DG_TRY(dg__contig(ctx, a, &x));
    dg_status s = unary_fwd(ctx, kind, x, out);

    if (s == DG_OK && dg__needs_grad(1, &a)) {
        dg_node *n;
        s = dg__node_new(k_node_kind[kind], DG_POLICY_CACHE, unary_backward, ctx, &n);
        unary_params *p = s == DG_OK ? dg__node_params(n, sizeof *p) : NULL;
        if (s == DG_OK && !p) {
            dg__node_abort(n);
            s = dg__err(DG_ERR_NOMEM, "%s: out of host memory recording the tape node", op);
        }
        if (s == DG_OK) {
            /* The node's policy is resolved now (global override, per-op setting, default). */
            p->kind = kind;
            p->from_output = (kind == DG_UNARY_EXP || kind == DG_UNARY_SIGMOID) &&
                             n->policy != DG_POLICY_RECOMPUTE;
            dg__node_input(n, a);
            s = dg__node_output(n, *out);
            if (s != DG_OK) {
                dg__node_abort(n);
            } else {
                dg__node_save(n, p->from_output ? *out : x);
                s = dg__node_commit(n);
            }
        }
    }
    dg_tensor_free(&x);
    if (s != DG_OK)
        dg_tensor_free(out);
    return s;
}

dg_status dg_exp(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return unary_op(DG_UNARY_EXP, ctx, a, out);
}
dg_status dg_log(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return unary_op(DG_UNARY_LOG, ctx, a, out);
}
dg_status dg_sigmoid(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return unary_op(DG_UNARY_SIGMOID, ctx, a, out);
}
dg_status dg_softplus(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return unary_op(DG_UNARY_SOFTPLUS, ctx, a, out);
}
dg_status dg_silu(dg_ctx *ctx, dg_tensor *a, dg_tensor **out) {
    return unary_op(DG_UNARY_SILU, ctx, a, out);
}

/* ---- backward ----------------------------------------------------------------------------- */

static dg_status unary_backward(dg_ctx *ctx, dg_node *n) {
    const unary_params *p = n->params;
    dg_tensor *dy = NULL, *dx = NULL;
    DG_TRY(dg__contig(ctx, (dg_tensor *)dg__node_grad_out(n, 0), &dy));
    dg_status s = unary_bwd(ctx, p->kind, dy, n->saved[0], p->from_output, &dx);
    if (s == DG_OK)
        s = dg__node_accum(ctx, n, 0, dx);
    dg_tensor_free(&dx);
    dg_tensor_free(&dy);
    return s;
}
