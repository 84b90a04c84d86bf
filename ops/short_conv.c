/*
 * ops/short_conv.c -- causal depthwise convolution along T (FLA's ShortConvolution, the 4-tap conv
 * on q, k, v in KDA), with optional bias, SiLU and varlen sequences.
 *
 *   z[b,t,c] = sum_{i<W} w[c,i] x[b, t-W+1+i, c] + bias[c]     x before the sequence start = 0
 *   y = act(z),  act NONE or SILU
 *   dz = dy act'(z)     dx[b,s,c] = sum_i dz[b, s+W-1-i, c] w[c,i]  (outputs in s's sequence only)
 *   dw[c,i] = sum_{b,t} dz[b,t,c] x[b,t-W+1+i,c]                  dbias[c] = sum_{b,t} dz[b,t,c]
 *
 * Shapes: x [B,T,C], w [C,W] with 1 <= W <= 8, bias [C] or NULL, y [B,T,C]. cu_seqlens: NULL, or
 * host int64 [n_seqs+1] with B == 1, cu[0] = 0, cu[n_seqs] = T, non-decreasing; it is copied into
 * the node. Tape: saves x, w, bias (and, on CUDA, a device copy of cu_seqlens); z is recomputed in
 * backward under either policy (W multiply-adds per element, cheaper than storing [B,T,C]).
 */
#ifndef DG_REF_TMPL
#include "../autograd/tape.h"
#include "seqlens.h"
#ifdef DG_HAVE_CUDA
#include "../kernels/short_conv.cuh"
#endif

#include <math.h>

#define SC_MAX_W 8

typedef struct {
    dg_act act;
    int W;
    int n_seqs;   /* 0: batch mode */
    int64_t cu[]; /* host copy of cu_seqlens, n_seqs + 1 entries */
} sc_params;

#ifdef _OPENMP
#define SC_OMP_FOR _Pragma("omp parallel for schedule(static) if (rows * C > 32768)")
#else
#define SC_OMP_FOR
#endif

#define DG_REF_TMPL "short_conv.c"
#include "ref_tmpl.h"
#endif

#ifdef RT
// ---- reference

/* One body for f64 and f32 (f32 computes in f32); the same arithmetic order as the kernels. */
static RT RF(sc_pre)(const RT *x, const RT *w, const RT *bias, int64_t r, int64_t st, int64_t C,
                     int64_t c, int W) {
    RT acc = 0;
    for (int i = 0; i < W; i++) {
        int64_t src = r - W + 1 + i;
        if (src >= st)
            acc += w[c * W + i] * x[src * C + c];
    }
    if (bias)
        acc += bias[c];
    return acc;
}
static void RF(sc_fwd)(int64_t rows, int64_t Tn, int64_t C, int W, const RT *x, const RT *w,
                       const RT *bias, dg_act act, const int64_t *cu, int n_seqs, RT *y) {
    SC_OMP_FOR
    for (int64_t r = 0; r < rows; r++) {
        int64_t st, en;
        dg__seq_bounds(r, Tn, cu, n_seqs, &st, &en);
        for (int64_t c = 0; c < C; c++) {
            RT z = RF(sc_pre)(x, w, bias, r, st, C, c, W);
            y[r * C + c] = act == DG_ACT_SILU ? z * ((RT)1 / ((RT)1 + REXP(-z))) : z;
        }
    }
}
static dg_status RF(sc_bwd)(int64_t rows, int64_t Tn, int64_t C, int W, const RT *x, const RT *w,
                            const RT *bias, dg_act act, const int64_t *cu, int n_seqs, const RT *dy,
                            RT *dx, RT *dw, RT *dbias) {
    size_t nr = (size_t)(rows > 0 ? rows : 1);
    RT *dz = DG_MALLOC((size_t)(rows * C > 0 ? rows * C : 1) * sizeof(RT));
    int64_t *st = DG_MALLOC(nr * sizeof *st), *en = DG_MALLOC(nr * sizeof *en);
    if (!dz || !st || !en) {
        DG_FREE(dz);
        DG_FREE(st);
        DG_FREE(en);
        return dg__err(DG_ERR_NOMEM, "short_conv backward: out of host memory");
    }
    for (int64_t r = 0; r < rows; r++)
        dg__seq_bounds(r, Tn, cu, n_seqs, &st[r], &en[r]);
    SC_OMP_FOR
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < C; c++) {
            RT d = dy[r * C + c];
            if (act == DG_ACT_SILU) {
                RT z = RF(sc_pre)(x, w, bias, r, st[r], C, c, W);
                RT s = (RT)1 / ((RT)1 + REXP(-z));
                d *= s * ((RT)1 + z * ((RT)1 - s));
            }
            dz[r * C + c] = d;
        }
    if (dx) {
        SC_OMP_FOR
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < C; c++) {
                RT acc = 0;
                for (int i = 0; i < W; i++) {
                    int64_t o = r + W - 1 - i;
                    if (o < en[r])
                        acc += dz[o * C + c] * w[c * W + i];
                }
                dx[r * C + c] = acc;
            }
    }
    if (dw || dbias) {
        /* One channel per iteration, rows in order: deterministic. */
        SC_OMP_FOR
        for (int64_t c = 0; c < C; c++) {
            RT acc[SC_MAX_W + 1] = {0};
            for (int64_t r = 0; r < rows; r++) {
                RT d = dz[r * C + c];
                for (int i = 0; i < W; i++) {
                    int64_t src = r - W + 1 + i;
                    if (src >= st[r])
                        acc[i] += d * x[src * C + c];
                }
                acc[W] += d;
            }
            if (dw)
                for (int i = 0; i < W; i++)
                    dw[c * W + i] = acc[i];
            if (dbias)
                dbias[c] = acc[W];
        }
    }
    DG_FREE(dz);
    DG_FREE(st);
    DG_FREE(en);
    return DG_OK;
}

#else

// ---- forward

static dg_status sc_backward(dg_ctx *ctx, dg_node *n);

static dg_status sc_check(const char *op, dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *bias,
                          dg_act act, const int64_t *cu, int n_seqs) {
    DG_TRY(dg__check_ptr(op, "ctx", ctx));
    DG_TRY(dg__check_ptr(op, "x", x));
    DG_TRY(dg__check_float(op, "x", x, ctx));
    DG_TRY(dg__check_shape(op, "x", x, 3, (int64_t[]){-1, -1, -1}));
    int64_t C = x->shape[2];
    DG_TRY(dg__check_ptr(op, "w", w));
    DG_TRY(dg__check_device(op, "w", w, ctx));
    DG_TRY(dg__check_shape(op, "w", w, 2, (int64_t[]){C, -1}));
    if (w->shape[1] < 1 || w->shape[1] > SC_MAX_W)
        return dg__err(DG_ERR_SHAPE, "%s: 'w' %s has W = %lld taps; W must be 1..%d", op,
                       dg_tensor_desc(w), (long long)w->shape[1], SC_MAX_W);
    DG_TRY(dg__check_same_dtype(op, "w", w, x));
    if (bias) {
        DG_TRY(dg__check_device(op, "bias", bias, ctx));
        DG_TRY(dg__check_shape(op, "bias", bias, 1, &C));
        DG_TRY(dg__check_same_dtype(op, "bias", bias, x));
    }
    if (act != DG_ACT_NONE && act != DG_ACT_SILU)
        return dg__err(DG_ERR_ARG, "%s: act must be DG_ACT_NONE or DG_ACT_SILU, got %d", op,
                       (int)act);
    return dg__check_cu_seqlens(op, x, cu, n_seqs);
}

dg_status dg_short_conv(dg_ctx *ctx, dg_tensor *x, dg_tensor *w, dg_tensor *bias, dg_act act,
                        const int64_t *cu_seqlens, int n_seqs, dg_tensor **out) {
    const char *op = "dg_short_conv";
    DG_TRY(dg__check_ptr(op, "out", out));
    *out = NULL;
    DG_TRY(sc_check(op, ctx, x, w, bias, act, cu_seqlens, n_seqs));
    if (!cu_seqlens)
        n_seqs = 0;
    int64_t T = x->shape[1], C = x->shape[2], rows = x->shape[0] * T;
    int W = (int)w->shape[1];

    dg_tensor *xc = NULL, *wc = NULL, *bc = NULL, *cu_dev = NULL, *y = NULL;
    dg_status s = dg__contig(ctx, x, &xc);
    if (s == DG_OK)
        s = dg__contig(ctx, w, &wc);
    if (s == DG_OK && bias)
        s = dg__contig(ctx, bias, &bc);
    if (s == DG_OK)
        s = dg__new_like(ctx, x, &y);
    if (s == DG_OK) {
        if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
            if (n_seqs) { /* the kernels search the offsets on the device */
                int64_t len = n_seqs + 1;
                s = dg_tensor_from_host(ctx, DG_I64, 1, &len, cu_seqlens, &cu_dev);
            }
            if (s == DG_OK)
                s = dg__short_conv_fwd_cuda(ctx, x->dtype, x->shape[0], T, C, W, dg_tensor_data(xc),
                                            dg_tensor_data(wc), bc ? dg_tensor_data(bc) : NULL, act,
                                            cu_dev ? dg_tensor_data(cu_dev) : NULL, n_seqs,
                                            dg_tensor_data(y));
#else
            s = dg__no_cuda(op);
#endif
        } else if (x->dtype == DG_F64) {
            sc_fwd_f64(rows, T, C, W, dg__f64(xc), dg__f64(wc), bc ? dg__f64(bc) : NULL, act,
                       n_seqs ? cu_seqlens : NULL, n_seqs, dg__f64(y));
        } else {
            sc_fwd_f32(rows, T, C, W, dg__f32(xc), dg__f32(wc), bc ? dg__f32(bc) : NULL, act,
                       n_seqs ? cu_seqlens : NULL, n_seqs, dg__f32(y));
        }
    }
    if (s == DG_OK && dg__needs_grad(3, (dg_tensor *[]){x, w, bias})) {
        dg_node *n = NULL;
        s = dg__node_new("short_conv", DG_POLICY_RECOMPUTE, sc_backward, ctx, &n);
        if (s == DG_OK) {
            dg__node_input(n, x);
            dg__node_input(n, w);
            dg__node_input(n, bias);
            dg__node_output(n, y);
            dg__node_save(n, xc);
            dg__node_save(n, wc);
            dg__node_save(n, bc);
            dg__node_save(n, cu_dev);
            /* The caller's cu_seqlens need not outlive this call: keep a copy. */
            sc_params *p = dg__node_params(n, sizeof *p + (size_t)(n_seqs + 1) * sizeof(int64_t));
            if (!p) {
                dg__node_abort(n);
                s = dg__err(DG_ERR_NOMEM, "%s: out of host memory", op);
            } else {
                p->act = act;
                p->W = W;
                p->n_seqs = n_seqs;
                if (n_seqs)
                    memcpy(p->cu, cu_seqlens, (size_t)(n_seqs + 1) * sizeof(int64_t));
                s = dg__node_commit(n);
            }
        }
    }
    dg_tensor_free(&xc);
    dg_tensor_free(&wc);
    dg_tensor_free(&bc);
    dg_tensor_free(&cu_dev);
    if (s != DG_OK)
        dg_tensor_free(&y);
    *out = y;
    return s;
}

// ---- backward

static dg_status sc_backward(dg_ctx *ctx, dg_node *n) {
    (void)ctx; /* the node's own context: its tensors live there */
    dg_ctx *c = n->ctx;
    const sc_params *p = n->params;
    dg_tensor *x = n->saved[0], *w = n->saved[1], *bias = n->saved[2], *cu_dev = n->saved[3];
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy)
        return DG_OK;
    int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2];
    dg_tensor *dy = NULL, *dx = NULL, *dw = NULL, *db = NULL;
    dg_status s = dg__contig(c, (dg_tensor *)gy, &dy);
    if (s == DG_OK && dg__node_wants_grad(n, 0))
        s = dg__new_like(c, x, &dx);
    if (s == DG_OK && dg__node_wants_grad(n, 1))
        s = dg__new_like(c, w, &dw);
    if (s == DG_OK && dg__node_wants_grad(n, 2))
        s = dg__new_like(c, bias, &db);
    const int64_t *cu = p->n_seqs ? p->cu : NULL;
    if (s == DG_OK) {
        if (dg__is_cuda(x)) {
#ifdef DG_HAVE_CUDA
            s = dg__short_conv_bwd_cuda(
                c, x->dtype, B, T, C, p->W, dg_tensor_data(x), dg_tensor_data(w),
                bias ? dg_tensor_data(bias) : NULL, p->act, cu_dev ? dg_tensor_data(cu_dev) : NULL,
                p->n_seqs, dg_tensor_data(dy), dx ? dg_tensor_data(dx) : NULL,
                dw ? dg_tensor_data(dw) : NULL, db ? dg_tensor_data(db) : NULL);
#else
            (void)cu_dev;
            s = dg__no_cuda("short_conv backward");
#endif
        } else if (x->dtype == DG_F64) {
            s = sc_bwd_f64(B * T, T, C, p->W, dg__f64(x), dg__f64(w), bias ? dg__f64(bias) : NULL,
                           p->act, cu, p->n_seqs, dg__f64(dy), dx ? dg__f64(dx) : NULL,
                           dw ? dg__f64(dw) : NULL, db ? dg__f64(db) : NULL);
        } else {
            s = sc_bwd_f32(B * T, T, C, p->W, dg__f32(x), dg__f32(w), bias ? dg__f32(bias) : NULL,
                           p->act, cu, p->n_seqs, dg__f32(dy), dx ? dg__f32(dx) : NULL,
                           dw ? dg__f32(dw) : NULL, db ? dg__f32(db) : NULL);
        }
    }
    if (s == DG_OK && dx)
        s = dg__node_accum(c, n, 0, dx);
    if (s == DG_OK && dw)
        s = dg__node_accum(c, n, 1, dw);
    if (s == DG_OK && db)
        s = dg__node_accum(c, n, 2, db);
    dg_tensor_free(&dy);
    dg_tensor_free(&dx);
    dg_tensor_free(&dw);
    dg_tensor_free(&db);
    return s;
}
#endif
