/*
 * ops/token_shift.c -- token shift (RWKV-style "time shift" difference) along T, with varlen
 * sequences, and its context-parallel form (distributed.md K7).
 *
 *   y[b,t,c] = x[b,t-1,c] - x[b,t,c]          x before the sequence start = 0
 *   dx[b,s,c] = dy[b,s+1,c] - dy[b,s,c]       dy after the sequence end = 0
 *
 * Shapes: x [B,T,C], y [B,T,C]. cu_seqlens: NULL, or host int64 [n_seqs+1] with B == 1, cu[0] = 0,
 * cu[n_seqs] = T, non-decreasing; copied into the node. The node ("token_shift") saves nothing but
 * the sequence table: its backward reads only dy.
 *
 * CPU: f64, and f32 computed in f32 (one subtraction per element: exact up to that rounding).
 * CUDA (f32, bf16): the op is the causal depthwise convolution of width 2 with taps [1, -1] and
 * no bias, so it runs as dg_short_conv with those constant weights (whose kernels compute
 * 0 + 1 * x[t-1] + (-1) * x[t] in f32: the same value as the subtraction); the node is then
 * dg_short_conv's.
 *
 * dg_token_shift_cp: the halo exchange of dg_short_conv_cp with one row (dg__cp_halo_cat): each
 * rank sends its last token to the next, a rank whose local sequence 0 started earlier uses it as
 * that sequence's x[-1] (zero when the sequence starts on this rank), and backward returns the
 * gradient of that row, which the previous rank adds to the gradient of its last row.
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"
#include "seqlens.h"
#include "../dist/dist.h"

#include <string.h>

#define OP "dg_token_shift"
#define OP_CP "dg_token_shift_cp"

typedef struct {
    int n_seqs;   /* 0: batch mode (each of the B rows is one sequence) */
    int64_t T;    /* tokens per row */
    int64_t cu[]; /* host copy of cu_seqlens, n_seqs + 1 entries */
} ts_params;

#ifdef _OPENMP
#define TS_OMP_FOR _Pragma("omp parallel for schedule(static) if (rows * C > 32768)")
#else
#define TS_OMP_FOR
#endif

#define DG_REF_TMPL "token_shift.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
/* fwd: y[r] = (r > st ? x[r-1] : 0) - x[r];  bwd: dx[r] = (r+1 < en ? dy[r+1] : 0) - dy[r]. */
static void RF(ts_run)(int bwd, int64_t rows, int64_t Tn, int64_t C, const int64_t *cu, int n_seqs,
                       const RT *x, RT *y) {
    TS_OMP_FOR
    for (int64_t r = 0; r < rows; r++) {
        int64_t st, en;
        dg__seq_bounds(r, Tn, cu, n_seqs, &st, &en);
        const int has = bwd ? r + 1 < en : r > st;
        const RT *nb = x + (bwd ? r + 1 : r - 1) * C;
        for (int64_t c = 0; c < C; c++)
            y[r * C + c] = (has ? nb[c] : (RT)0) - x[r * C + c];
    }
}

#else

static void ts_run(int bwd, const dg_tensor *x, int64_t T, const int64_t *cu, int n_seqs,
                   dg_tensor *y) {
    const int64_t C = x->shape[2], rows = dg_tensor_numel(x) / (C > 0 ? C : 1);
    if (C == 0 || rows == 0)
        return;
    if (x->dtype == DG_F64)
        ts_run_f64(bwd, rows, T, C, cu, n_seqs, dg__f64((dg_tensor *)x), dg__f64(y));
    else
        ts_run_f32(bwd, rows, T, C, cu, n_seqs, dg__f32((dg_tensor *)x), dg__f32(y));
}

static dg_status ts_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    const ts_params *p = n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *dy = NULL, *dx = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK)
        s = dg__new_like(c, dy, &dx);
    if (s == DG_OK) {
        ts_run(1, dy, p->T, p->n_seqs ? p->cu : NULL, p->n_seqs, dx);
        s = dg__node_accum(c, n, 0, dx);
    }
    dg_tensor_free(&dy);
    dg_tensor_free(&dx);
    return s;
}

static dg_status ts_check(const char *op, dg_ctx *ctx, dg_tensor *x, const int64_t *cu,
                          int n_seqs) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "x", x));
    DG_TRY(dg__check_float(op, "x", x, ctx));
    DG_TRY(dg__check_shape(op, "x", x, 3, (int64_t[]){-1, -1, -1}));
    return dg__check_cu_seqlens(op, x, cu, n_seqs);
}

/* CUDA: dg_short_conv with w = [1, -1] per channel (constant, no gradient). */
static dg_status ts_as_conv(dg_ctx *ctx, dg_tensor *x, const int64_t *cu, int n_seqs,
                            dg_tensor **out) {
    const int64_t C = x->shape[2];
    double *wh = (double *)DG_MALLOC(sizeof(double) * (size_t)(2 * (C > 0 ? C : 1)));
    if (!wh)
        return dg__err(DG_ERR_NOMEM, OP ": out of host memory");
    for (int64_t c = 0; c < C; c++)
        wh[2 * c] = 1.0, wh[2 * c + 1] = -1.0;
    dg_tensor *w = NULL;
    dg_status s = dg_tensor_from_f64(ctx, x->dtype, 2, (int64_t[]){C, 2}, wh, &w);
    DG_FREE(wh);
    if (s == DG_OK)
        s = dg_short_conv(ctx, x, w, NULL, DG_ACT_NONE, cu, n_seqs, out);
    dg_tensor_free(&w);
    return s;
}

dg_status dg_token_shift(dg_ctx *ctx, dg_tensor *x, const int64_t *cu_seqlens, int n_seqs,
                         dg_tensor **out) {
    DG_TRY(dg__check_ptr(OP, "out", out));
    *out = NULL;
    DG_TRY(ts_check(OP, ctx, x, cu_seqlens, n_seqs));
    if (!cu_seqlens)
        n_seqs = 0;
    if (dg__is_cuda(x))
        return ts_as_conv(ctx, x, cu_seqlens, n_seqs, out);
    const int64_t T = x->shape[1];
    dg_tensor *xc = NULL, *y = NULL;
    dg_status s = dg__contig(ctx, x, &xc);
    if (s == DG_OK)
        s = dg__new_like(ctx, xc, &y);
    if (s == DG_OK)
        ts_run(0, xc, T, n_seqs ? cu_seqlens : NULL, n_seqs, y);
    if (s == DG_OK && dg__needs_grad(1, &x)) {
        dg_node *n = NULL;
        s = dg__node_new("token_shift", DG_POLICY_CACHE, ts_backward, ctx, &n);
        if (s == DG_OK) {
            dg__node_input(n, x);
            dg__node_output(n, y);
            ts_params *p = dg__node_params(n, sizeof *p + (size_t)(n_seqs + 1) * sizeof(int64_t));
            if (!p) {
                dg__node_abort(n);
                s = dg__err(DG_ERR_NOMEM, OP ": out of host memory");
            } else {
                p->n_seqs = n_seqs;
                p->T = T;
                if (n_seqs)
                    memcpy(p->cu, cu_seqlens, (size_t)(n_seqs + 1) * sizeof(int64_t));
                s = dg__node_commit(n);
            }
        }
    }
    dg_tensor_free(&xc);
    if (s != DG_OK)
        dg_tensor_free(&y);
    *out = y;
    return s;
}

static dg_status ts_local(dg_ctx *ctx, dg_tensor *xe, const int64_t *cu, int n_seqs, void *arg,
                          dg_tensor **ye) {
    (void)arg;
    return dg_token_shift(ctx, xe, cu, n_seqs, ye);
}

dg_status dg_token_shift_cp(dg_ctx *ctx, dg_comm *comm, const dg_cp_plan *plan, dg_tensor *x,
                            dg_tensor **out) {
    DG_TRY(dg__cp_check(OP_CP, ctx, comm, plan, x, out));
    DG_TRY(ts_check(OP_CP, ctx, x, NULL, 0));
    /* every rank holds at least one token (dg_cp_plan_new), so the one-row halo always exists;
     * local sequence 0 is extended by it (zero when the sequence starts here) */
    return dg__cp_halo_run(ctx, comm, plan, x, 1, OP_CP, "token_shift_cp_halo", ts_local, NULL,
                           out);
}
#endif
