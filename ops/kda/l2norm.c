/*
 * ops/kda/l2norm.c -- N1: the in-op L2 norm of q and k (kda.md §11.3, FLA use_qk_l2norm_in_kernel).
 *
 *   r = 1 / sqrt(sum_d x_d^2 + 1e-6)   (eps inside the sqrt),   y = x r
 *   dx = r (dy - (dy . y) y)
 * x, y: [..., K] (KDA: [B,T,H,K]). Under CACHE (the default, as FLA keeps q_rstd, k_rstd) the node
 * keeps y and r [rows]; under RECOMPUTE only x, and backward recomputes y and r.
 * CUDA: x f32 or bf16, computed in f32; y has x's dtype (the composite keeps it in f32), the node
 * keeps the f32 y and r.
 */
#ifndef KDA_TMPL
#include "kda.h"
#define KDA_TMPL "l2norm.c"
#include "kda_tmpl.h"
#endif

#ifdef KT
/* ---- reference ------------------------------------------------------------------------------ */

void KF(dg__kda_l2norm_fwd)(int64_t rows, int K, const KT *x, KT *y, KT *r) {
    KDA_OMP(parallel for schedule(static) if (rows * K > 32768))
    for (int64_t i = 0; i < rows; i++) {
        const KT *xr = x + i * K;
        KT ss = 0;
        for (int c = 0; c < K; c++)
            ss += xr[c] * xr[c];
        KT ri = (KT)1 / KSQRT(ss + (KT)KDA_L2_EPS);
        for (int c = 0; c < K; c++)
            y[i * K + c] = xr[c] * ri;
        if (r)
            r[i] = ri;
    }
}

void KF(dg__kda_l2norm_bwd)(int64_t rows, int K, const KT *y, const KT *r, const KT *dy, KT *dx) {
    KDA_OMP(parallel for schedule(static) if (rows * K > 32768))
    for (int64_t i = 0; i < rows; i++) {
        const KT *yr = y + i * K, *dyr = dy + i * K;
        KT dot = 0;
        for (int c = 0; c < K; c++)
            dot += dyr[c] * yr[c];
        for (int c = 0; c < K; c++)
            dx[i * K + c] = r[i] * (dyr[c] - dot * yr[c]);
    }
}

#else
/* ---- node ----------------------------------------------------------------------------------- */

#define OP "dg_kda_l2norm"

typedef struct l2_params {
    dg_dtype dt; /* compute dtype (f32 on CUDA) */
    int cuda;
    int64_t rows;
    int K;
    int xbf16; /* CUDA: x is bf16, read as it is; dx is written in bf16 */
} l2_params;

static dg_status l2norm_backward(dg_ctx *ctx, dg_node *n) {
    const l2_params *p = (const l2_params *)n->params;
    const dg_tensor *gy = dg__node_grad_out(n, 0);
    if (!gy || !dg__node_wants_grad(n, 0))
        return DG_OK;
    dg_tensor *tg = NULL, *dx = NULL, *tx = NULL, *scratch = NULL;
    const void *pdy = NULL, *py = NULL, *pr = NULL;
    dg_status st = dg__kda_ptr(ctx, gy, p->dt, &tg, &pdy);
    if (st == DG_OK && n->policy == DG_POLICY_CACHE) {
        py = dg_tensor_data(n->saved[0]); /* both saved in the compute dtype */
        pr = dg_tensor_data(n->saved[1]);
    } else if (st == DG_OK) {
        const void *px = NULL;
        int64_t ns[1] = {p->rows * ((int64_t)p->K + 1)}; /* y then r */
        int xbf16 = 0;
        st = dg__kda_in_ptr(ctx, n->saved[0], p->dt, &tx, &px, &xbf16);
        if (st == DG_OK)
            st = dg_tensor_new(ctx, p->dt, 1, ns, &scratch);
        if (st == DG_OK) {
            void *y = dg_tensor_data(scratch);
            void *r = (char *)y + dg_dtype_size(p->dt) * (size_t)(p->rows * p->K);
            st = kda_run_l2norm_fwd(ctx, p->cuda, p->dt, p->rows, p->K, xbf16, px, y, r);
            py = y;
            pr = r;
        }
    }
    if (st == DG_OK) /* in x's dtype where the kernel writes bf16 */
        st = dg_tensor_new(ctx, p->xbf16 ? DG_BF16 : p->dt, n->saved[0]->ndim, n->saved[0]->shape,
                           &dx);
    if (st == DG_OK)
        st = kda_run_l2norm_bwd(ctx, p->cuda, p->dt, p->rows, p->K, py, pr, pdy, p->xbf16,
                                dg_tensor_data(dx));
    if (st == DG_OK)
        st = dg__node_accum(ctx, n, 0, dx);
    dg_tensor_free(&scratch);
    dg_tensor_free(&tg);
    dg_tensor_free(&tx);
    dg_tensor_free(&dx);
    return st;
}

dg_status dg__kda_l2norm_x(dg_ctx *ctx, dg_tensor *x, int keep_f32, dg_tensor **y) {
    DG_TRY(dg__check_ptr(OP, "ctx", ctx));
    DG_TRY(dg__check_ptr(OP, "y", y));
    *y = NULL;
    DG_TRY(dg__check_ptr(OP, "x", x));
    DG_TRY(dg__kda_check_first(OP, "x", x, ctx, x->ndim, "...,K"));
    if (x->ndim < 1 || x->shape[x->ndim - 1] < 1)
        return dg__err(DG_ERR_SHAPE, OP ": x must have a last axis K >= 1, got %s",
                       dg_tensor_desc(x));
    l2_params lp = {x->dtype, dg__is_cuda(x), 0, (int)x->shape[x->ndim - 1], 0};
#ifndef DG_HAVE_CUDA
    if (lp.cuda)
        return dg__no_cuda(OP);
#endif
    if (lp.cuda)
        lp.dt = DG_F32;
    lp.rows = dg_tensor_numel(x) / lp.K;
    /* yc: y in the compute dtype; *y is yc itself unless x is bf16 (and !keep_f32) */
    dg_tensor *tx = NULL, *r = NULL, *yc = NULL;
    const void *px = NULL;
    dg_status st = dg__kda_in_ptr(ctx, x, lp.dt, &tx, &px, &lp.xbf16);
    int64_t rshape[1] = {lp.rows};
    if (st == DG_OK)
        st = dg_tensor_new(ctx, lp.dt, x->ndim, x->shape, &yc);
    if (st == DG_OK)
        st = dg_tensor_new(ctx, lp.dt, 1, rshape, &r);
    if (st == DG_OK)
        st = kda_run_l2norm_fwd(ctx, lp.cuda, lp.dt, lp.rows, lp.K, lp.xbf16, px,
                                dg_tensor_data(yc), dg_tensor_data(r));
    if (st == DG_OK)
        st = dg__kda_as_dtype(ctx, yc, keep_f32 ? lp.dt : x->dtype, y);
    if (st == DG_OK && dg__needs_grad(1, &x)) {
        dg_node *n;
        st = dg__node_new("kda_l2norm", DG_POLICY_CACHE, l2norm_backward, ctx, &n);
        if (st == DG_OK) {
            dg__node_input(n, x);
            if (st == DG_OK)
                st = dg__node_output(n, *y);
            if (st == DG_OK && n->policy == DG_POLICY_CACHE) {
                dg__node_save(n, yc); /* the compute-dtype y, not its bf16 rounding */
                dg__node_save(n, r);
            } else if (st == DG_OK) {
                dg__node_save(n, x);
            }
            l2_params *pp = st == DG_OK ? (l2_params *)dg__node_params(n, sizeof *pp) : NULL;
            if (st == DG_OK && !pp)
                st = dg__err(DG_ERR_NOMEM, OP ": no memory for the node");
            if (st == DG_OK) {
                *pp = lp;
                st = dg__node_commit(n);
            } else {
                dg__node_abort(n);
            }
        }
    }
    dg_tensor_free(&tx);
    dg_tensor_free(&r);
    dg_tensor_free(&yc);
    if (st != DG_OK)
        dg_tensor_free(y);
    return st;
}

dg_status dg_kda_l2norm(dg_ctx *ctx, dg_tensor *x, dg_tensor **y) {
    return dg__kda_l2norm_x(ctx, x, 0, y);
}
#endif
